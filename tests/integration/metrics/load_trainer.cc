// A trainer that keeps a daemon busy for the metrics test: registers tensors of the given sizes
// (two size classes by default), then runs STEPS steps of random gradients, sleeping SLEEP_MS
// between steps. Every node must run the same number of steps (a collective), hence steps, not
// seconds. Usage: sparsecar_load_trainer SOCKET STEPS SLEEP_MS [SIZE,SIZE,...]
// Prints "steps N failed F" and exits 0 when at least one step succeeded.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <thread>
#include <sstream>
#include <string>
#include <vector>

#include "sparsecar/client.h"

int main(int argc, char** argv) {
  using namespace std::chrono;
  if (argc < 4) {
    std::fprintf(stderr, "usage: %s SOCKET STEPS SLEEP_MS [SIZE,SIZE,...]\n", argv[0]);
    return 2;
  }
  const std::string socket = argv[1];
  const uint64_t steps = std::strtoull(argv[2], nullptr, 10);
  const auto gap = milliseconds(std::atol(argv[3]));
  std::vector<size_t> sizes = {1000, 100000};
  if (argc > 4) {
    sizes.clear();
    std::stringstream ss(argv[4]);
    for (std::string s; std::getline(ss, s, ',');) sizes.push_back(std::strtoull(s.c_str(), nullptr, 10));
  }
  auto client = sparsecar::Client::connect(socket);
  if (!client.ok()) {
    std::fprintf(stderr, "connect: %s\n", client.status().to_string().c_str());
    return 1;
  }
  std::vector<sparsecar::Tensor*> tensors;
  for (size_t i = 0; i < sizes.size(); ++i) {
    auto t = (*client)->register_tensor("layer" + std::to_string(i) + ".weight", sizes[i]);
    if (!t.ok()) {
      std::fprintf(stderr, "register: %s\n", t.status().to_string().c_str());
      return 1;
    }
    tensors.push_back(*t);
  }
  std::mt19937 rng(42);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  uint64_t ok = 0, failed = 0;
  for (uint64_t step = 0; step < steps; ++step) {
    std::this_thread::sleep_for(gap);
    for (auto* t : tensors) {
      for (size_t i = 0; i < t->size(); i += 7) t->data()[i] = normal(rng);
      if (!(*client)->submit(*t, step, {.lr = 0.1f}).ok()) ++failed;
    }
    for (auto* t : tensors) {
      auto info = (*client)->wait(*t, step, std::chrono::seconds(30));
      info.ok() ? ++ok : ++failed;
    }
    if (step % 10 == 0) (*client)->report_metric("loss", 1.0 / static_cast<double>(step + 1), step).ignore();
  }
  std::printf("steps %llu failed %llu\n", static_cast<unsigned long long>(ok), static_cast<unsigned long long>(failed));
  return ok > 0 ? 0 : 1;
}
