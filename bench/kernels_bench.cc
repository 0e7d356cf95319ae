// Throughput of the CPU kernels, in GB/s counting the bytes each kernel must read and write,
// next to a memcpy of n floats (8n bytes moved) measured in the same run as the ceiling.
//
//   sparsecar_kernels_bench [--benchmark_filter=...]
//
// Arguments of every case: /<elements>/<density in per mille>. Data: N(0, 1) floats, seed 42.
// Bytes counted per call (k = selected count, n = elements):
//   memcpy            read 4n + write 4n
//   ef_threshold      read residual + grad (8n), write residual (4n) + pairs (8k)
//   topk_exact        read 4n, write pairs (8k)
//   nth_element       same bytes as topk_exact (the baseline it replaces: copy |x|,
//                     std::nth_element for the k-th magnitude, then a threshold pass)
//   coo_encode        read pairs (8k), write payload (8k)
//   decode_accumulate read payload (8k), read + write the k touched floats (8k)
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <random>
#include <vector>

#include "sparsecar/kernels/codec.h"
#include "sparsecar/kernels/select.h"

namespace sk = sparsecar::kernels;

namespace {

const std::vector<float>& data(size_t n) {
  static std::map<size_t, std::vector<float>> cache;
  auto it = cache.find(n);
  if (it == cache.end()) {
    std::mt19937_64 rng(42);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    std::vector<float> x(n);
    for (float& v : x) v = dist(rng);
    it = cache.emplace(n, std::move(x)).first;
  }
  return it->second;
}

size_t elements(const benchmark::State& s) { return static_cast<size_t>(s.range(0)); }
double density(const benchmark::State& s) { return static_cast<double>(s.range(1)) / 1000.0; }

// The magnitude of the k-th largest element: the lambda that makes a threshold keep ~k.
float lambda_for(const std::vector<float>& x, size_t k) {
  std::vector<float> mag(x.size());
  for (size_t i = 0; i < x.size(); ++i) mag[i] = std::fabs(x[i]);
  std::nth_element(mag.begin(), mag.begin() + static_cast<std::ptrdiff_t>(k - 1), mag.end(),
                   std::greater<>());
  return mag[k - 1];
}

void set_bytes(benchmark::State& s, double bytes_per_call) {
  s.SetBytesProcessed(static_cast<int64_t>(bytes_per_call * static_cast<double>(s.iterations())));
}

void BM_memcpy(benchmark::State& s) {
  const auto& x = data(elements(s));
  std::vector<float> dst(x.size(), 0.0f);
  for (auto _ : s) {
    std::memcpy(dst.data(), x.data(), x.size() * sizeof(float));
    benchmark::ClobberMemory();
  }
  set_bytes(s, 8.0 * static_cast<double>(x.size()));
}

void BM_ef_threshold(benchmark::State& s) {
  const auto& g = data(elements(s));
  const size_t n = g.size();
  const float lambda = lambda_for(g, sk::topk_count(n, density(s)));
  std::vector<float> residual(n, 0.0f);
  std::vector<uint32_t> index(n);
  std::vector<float> value(n);
  size_t selected = 0;
  for (auto _ : s) {
    // Zero the residual before each call so every call sees the same density (not timed).
    s.PauseTiming();
    std::fill(residual.begin(), residual.end(), 0.0f);
    s.ResumeTiming();
    selected = sk::ef_threshold(residual, g, lambda, index.data(), value.data(), n);
    benchmark::DoNotOptimize(selected);
    benchmark::ClobberMemory();
  }
  s.counters["selected"] = static_cast<double>(selected);
  set_bytes(s, 12.0 * static_cast<double>(n) + 8.0 * static_cast<double>(selected));
}

void BM_topk_exact(benchmark::State& s) {
  const auto& x = data(elements(s));
  const size_t n = x.size();
  const size_t k = sk::topk_count(n, density(s));
  std::vector<std::byte> scratch(sk::topk_scratch_bytes(n));
  std::vector<uint32_t> index(k);
  std::vector<float> value(k);
  for (auto _ : s) {
    auto got = sk::topk_exact(x, k, scratch, index.data(), value.data());
    if (!got.ok()) {
      s.SkipWithError(got.status().to_string().c_str());
      break;
    }
    benchmark::DoNotOptimize(*got);
    benchmark::ClobberMemory();
  }
  set_bytes(s, 4.0 * static_cast<double>(n) + 8.0 * static_cast<double>(k));
}

void BM_nth_element(benchmark::State& s) {
  const auto& x = data(elements(s));
  const size_t n = x.size();
  const size_t k = sk::topk_count(n, density(s));
  std::vector<float> mag(n);
  std::vector<uint32_t> index(n);
  std::vector<float> value(n);
  for (auto _ : s) {
    for (size_t i = 0; i < n; ++i) mag[i] = std::fabs(x[i]);
    std::nth_element(mag.begin(), mag.begin() + static_cast<std::ptrdiff_t>(k - 1), mag.end(),
                     std::greater<>());
    const size_t got = sk::threshold_select(x, mag[k - 1], index.data(), value.data(), n);
    benchmark::DoNotOptimize(got);
    benchmark::ClobberMemory();
  }
  set_bytes(s, 4.0 * static_cast<double>(n) + 8.0 * static_cast<double>(k));
}

struct Selection {
  std::vector<uint32_t> index;
  std::vector<float> value;
};

Selection select_topk(const std::vector<float>& x, size_t k) {
  Selection sel{std::vector<uint32_t>(k), std::vector<float>(k)};
  std::vector<std::byte> scratch(sk::topk_scratch_bytes(x.size()));
  if (!sk::topk_exact(x, k, scratch, sel.index.data(), sel.value.data()).ok()) std::abort();
  return sel;
}

void BM_coo_encode(benchmark::State& s) {
  const auto& x = data(elements(s));
  const size_t k = sk::topk_count(x.size(), density(s));
  const Selection sel = select_topk(x, k);
  std::vector<std::byte> payload(
      sk::encoded_bytes(sk::Format::kCoo, sk::ValueType::kF32, x.size(), k));
  for (auto _ : s) {
    const sparsecar::Status st = sk::coo_encode(sel.index, sel.value, payload);
    if (!st.ok()) {
      s.SkipWithError(st.to_string().c_str());
      break;
    }
    benchmark::ClobberMemory();
  }
  set_bytes(s, 16.0 * static_cast<double>(k));
}

void BM_decode_accumulate(benchmark::State& s) {
  const auto& x = data(elements(s));
  const size_t k = sk::topk_count(x.size(), density(s));
  const Selection sel = select_topk(x, k);
  std::vector<std::byte> payload(
      sk::encoded_bytes(sk::Format::kCoo, sk::ValueType::kF32, x.size(), k));
  if (!sk::coo_encode(sel.index, sel.value, payload).ok()) std::abort();
  std::vector<float> dense(x.size(), 0.0f);
  for (auto _ : s) {
    const sparsecar::Status st =
        sk::decode_accumulate(sk::Format::kCoo, sk::ValueType::kF32, payload, k, dense);
    if (!st.ok()) {
      s.SkipWithError(st.to_string().c_str());
      break;
    }
    benchmark::ClobberMemory();
  }
  set_bytes(s, 16.0 * static_cast<double>(k));
}

void sizes_only(benchmark::internal::Benchmark* b) {
  for (int64_t n : {int64_t{1} << 20, int64_t{1} << 24}) b->Args({n, 10});
}
void sizes_and_densities(benchmark::internal::Benchmark* b) {
  for (int64_t n : {int64_t{1} << 20, int64_t{1} << 24}) {
    for (int64_t permille : {1, 10, 100}) b->Args({n, permille});
  }
}

}  // namespace

BENCHMARK(BM_memcpy)->Apply(sizes_only)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_ef_threshold)->Apply(sizes_and_densities)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_topk_exact)->Apply(sizes_and_densities)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_nth_element)->Apply(sizes_and_densities)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_coo_encode)->Apply(sizes_and_densities)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_decode_accumulate)->Apply(sizes_and_densities)->Unit(benchmark::kMicrosecond);

BENCHMARK_MAIN();
