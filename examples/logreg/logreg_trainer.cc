// sparsecar-logreg-trainer: one data-parallel trainer of a logistic-regression job.
//
// Every trainer builds the same seeded gisette-like problem (logreg_problem.h), takes its shard
// (sample i belongs to rank i mod world), and per step: computes the minibatch gradient of its
// shard, writes it into the two registered tensors ("logreg.weight", "logreg.bias"), submits
// both to its local sparsecard, waits for both, and applies the averaged gradient with SGD.
// Every trainer receives the same average, so the models stay identical without ever being
// exchanged. Rank 0 prints a live line every --log-every steps; each trainer writes its totals
// as JSON (--json-out). scripts/run_demo.py starts one per daemon.
//
// --local runs without a daemon: it simulates --world-size trainers in this process (and, with
// --local-compress topk, the daemon's Top-k with error feedback per node) to check the maths and
// choose the demo's defaults. Byte counts in that mode come from the wire model (72-byte header
// per message; COO = 8 bytes per element; dense = ring all-reduce), not from a network.
#include <sparsecar/client.h>

#include <CLI/CLI.hpp>

#include <chrono>
#include <cerrno>
#include <cinttypes>
#include <cstdint>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "logreg_problem.h"

namespace {

struct Flags {
  std::string socket;
  uint32_t rank = 0;
  uint32_t world = 1;
  uint64_t steps = 400;
  float lr = 0.5f;
  size_t batch = 64;
  uint64_t seed = 1;
  uint64_t log_every = 25;
  int64_t deadline_ms = 30000;
  std::string json_out;
  bool local = false;
  bool local_topk = false;
  double density = 0.001;
  logreg::ProblemOptions problem;
  float l2 = 0.02f;
};

[[noreturn]] void usage_error(const std::string& message) {
  std::fprintf(stderr, "sparsecar-logreg-trainer: %s (see --help)\n", message.c_str());
  std::exit(2);
}

// The command line, parsed by CLI11 ("--flag value" and "--flag=value"; numbers are checked, an
// unsigned flag refuses a negative value). Exit 0 for --help, 2 for a usage error.
Flags parse_flags(int argc, char** argv) {
  Flags f;
  CLI::App app(
      "Logistic regression on a seeded, gisette-like synthetic problem (5,000 sparse non-negative\n"
      "features, 4,000 samples, 20 informative), data-parallel through the local sparsecard.",
      "sparsecar-logreg-trainer");
  app.option_defaults()->always_capture_default();
  std::string compress = "off";
  app.add_option("--socket", f.socket, "the local daemon's Unix socket (required unless --local)")
      ->type_name("PATH");
  app.add_option("--rank", f.rank, "this trainer's rank")->type_name("R");
  app.add_option("--world-size", f.world, "number of trainers in the job")->type_name("W");
  app.add_option("--steps", f.steps, "SGD steps")->type_name("N");
  app.add_option("--lr", f.lr, "learning rate")->type_name("X");
  app.add_option("--batch", f.batch, "minibatch size per trainer")->type_name("B");
  app.add_option("--seed", f.seed, "data and sampling seed; same on every trainer")->type_name("S");
  app.add_option("--log-every", f.log_every, "rank 0 prints a line every N steps (0 = only the last)")
      ->type_name("N");
  app.add_option("--deadline-ms", f.deadline_ms, "how long to wait for each averaged gradient")
      ->type_name("MS");
  app.add_option("--json-out", f.json_out, "write this trainer's totals as JSON")->type_name("FILE");
  app.add_flag("--local", f.local, "no daemon: simulate --world-size trainers in this process");
  app.add_option("--local-compress", compress,
                 "with --local: off (exact average) or topk (Top-k + error feedback)")
      ->type_name("M")->check(CLI::IsMember({"off", "topk"}));
  app.add_option("--density", f.density, "with --local-compress topk: fraction of elements kept")
      ->type_name("D");
  const std::string shape = "Problem shape (every trainer of a job must pass the same values)";
  app.add_option("--samples", f.problem.samples, "training samples")->type_name("N")->group(shape);
  app.add_option("--informative", f.problem.informative, "features that carry the label")
      ->type_name("N")->group(shape);
  app.add_option("--probe-density", f.problem.probe_density,
                 "fraction of samples in which a probe feature is non-zero")->type_name("X")->group(shape);
  app.add_option("--signal", f.problem.signal, "scale of the hidden weights; higher = cleaner labels")
      ->type_name("X")->group(shape);
  app.add_option("--label-noise", f.problem.label_noise, "fraction of labels flipped on top")
      ->type_name("X")->group(shape);
  app.add_option("--l2", f.l2, "L2 penalty added to the gradient (weight decay)")->type_name("X")->group(shape);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::fputs(app.help().c_str(), stdout);
    std::exit(0);
  } catch (const CLI::ParseError& e) {
    usage_error(e.what());
  }
  f.local_topk = compress == "topk";
  if (f.world == 0) usage_error("--world-size must be at least 1");
  if (f.rank >= f.world) usage_error("--rank must be below --world-size");
  if (f.batch == 0) usage_error("--batch must be at least 1");
  if (f.deadline_ms <= 0) usage_error("--deadline-ms must be positive");
  if (!(f.lr > 0.0f) || !std::isfinite(f.lr)) usage_error("--lr must be positive");
  if (!(f.density > 0.0 && f.density <= 1.0)) usage_error("--density must be in (0, 1]");
  if (!f.local && f.socket.empty()) usage_error("--socket is required (or --local)");
  return f;
}

// What this trainer's daemon reported, summed over steps and tensors.
struct Totals {
  uint64_t steps = 0;
  uint64_t bytes_sent = 0;
  uint64_t dense_bytes = 0;
  uint64_t nnz = 0;
  uint64_t elements = 0;
  double exchange_seconds = 0.0;  // time spent between submit and the last wait of a step
};

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB"};
  int u = 0;
  while (b >= 1024.0 && u < 3) {
    b /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.1f %s", b, units[u]);
  return buf;
}

struct LossPoint {
  uint64_t step;
  double loss;
  double accuracy;
};

class Reporter {
 public:
  explicit Reporter(const Flags& f) : flags_(f) {}

  bool due(uint64_t done) const {
    return done == flags_.steps || (flags_.log_every > 0 && done % flags_.log_every == 0);
  }

  // `step_nnz`/`step_elements`: this step's selection; `t`: cumulative totals.
  void line(uint64_t done, double loss, double accuracy, uint64_t step_nnz, uint64_t step_elements,
            const Totals& t) {
    history_.push_back({done, loss, accuracy});
    if (flags_.rank != 0) return;
    double density = step_elements ? static_cast<double>(step_nnz) / static_cast<double>(step_elements) : 0.0;
    double ratio = t.bytes_sent ? static_cast<double>(t.dense_bytes) / static_cast<double>(t.bytes_sent) : 0.0;
    std::printf("step %5" PRIu64 "  loss %.5f  acc %.3f  density %7.3f%%  sent %10s  ratio %6.1fx\n",
                done, loss, accuracy, 100.0 * density, human_bytes(static_cast<double>(t.bytes_sent)).c_str(),
                ratio);
    std::fflush(stdout);
  }

  const std::vector<LossPoint>& history() const { return history_; }

 private:
  const Flags& flags_;
  std::vector<LossPoint> history_;
};

bool write_json(const Flags& f, const Totals& t, double initial_loss, double final_loss,
                double final_accuracy, double test_loss, double test_accuracy, double wall_seconds, const std::vector<LossPoint>& history) {
  if (f.json_out.empty()) return true;
  FILE* out = std::fopen(f.json_out.c_str(), "w");
  if (out == nullptr) {
    std::fprintf(stderr, "sparsecar-logreg-trainer[rank %u]: cannot write %s: %s\n", f.rank,
                 f.json_out.c_str(), std::strerror(errno));
    return false;
  }
  std::fprintf(out, "{\n  \"rank\": %u,\n  \"world_size\": %u,\n", f.rank, f.world);
  std::fprintf(out, "  \"mode\": \"%s\",\n", f.local ? (f.local_topk ? "local-topk" : "local-dense") : "daemon");
  std::fprintf(out, "  \"steps\": %" PRIu64 ",\n  \"lr\": %.9g,\n  \"batch\": %zu,\n  \"seed\": %" PRIu64 ",\n",
               t.steps, static_cast<double>(f.lr), f.batch, f.seed);
  std::fprintf(out, "  \"initial_loss\": %.17g,\n  \"final_loss\": %.17g,\n  \"final_accuracy\": %.17g,\n",
               initial_loss, final_loss, final_accuracy);
  std::fprintf(out, "  \"held_out_loss\": %.17g,\n  \"held_out_accuracy\": %.17g,\n", test_loss, test_accuracy);
  std::fprintf(out, "  \"bytes_sent\": %" PRIu64 ",\n  \"dense_bytes\": %" PRIu64 ",\n", t.bytes_sent,
               t.dense_bytes);
  std::fprintf(out, "  \"nnz\": %" PRIu64 ",\n  \"elements\": %" PRIu64 ",\n", t.nnz, t.elements);
  std::fprintf(out, "  \"wall_seconds\": %.6f,\n  \"exchange_seconds\": %.6f,\n", wall_seconds,
               t.exchange_seconds);
  std::fprintf(out, "  \"loss_history\": [");
  for (size_t i = 0; i < history.size(); ++i) {
    std::fprintf(out, "%s[%" PRIu64 ", %.17g, %.6g]", i ? ", " : "", history[i].step, history[i].loss,
                 history[i].accuracy);
  }
  std::fprintf(out, "]\n}\n");
  bool ok = std::fflush(out) == 0;
  ok = (std::fclose(out) == 0) && ok;
  if (!ok) std::fprintf(stderr, "sparsecar-logreg-trainer[rank %u]: writing %s failed\n", f.rank, f.json_out.c_str());
  return ok;
}

int fail(const Flags& f, const char* what, const sparsecar::Status& status) {
  std::fprintf(stderr, "sparsecar-logreg-trainer[rank %u]: %s: %s\n", f.rank, what, status.to_string().c_str());
  return 1;
}

// Samples generated beyond --samples and kept out of training, to report generalisation.
constexpr size_t kHeldOut = 1000;

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

// The real trainer: gradients go through the local daemon.
int run_with_daemon(const Flags& f, const logreg::Dataset& data, logreg::Model& model, Totals& t,
                    Reporter& reporter) {
  auto connected = sparsecar::Client::connect(f.socket);
  if (!connected.ok()) return fail(f, ("connect to " + f.socket).c_str(), connected.status());
  std::unique_ptr<sparsecar::Client> client = std::move(connected).value();

  auto w = client->register_tensor("logreg.weight", data.features);
  if (!w.ok()) return fail(f, "register logreg.weight", w.status());
  auto b = client->register_tensor("logreg.bias", 1);
  if (!b.ok()) return fail(f, "register logreg.bias", b.status());
  sparsecar::Tensor& weight = **w;
  sparsecar::Tensor& bias = **b;

  logreg::ShardSampler sampler(data.rows(), f.rank, f.world, f.batch, f.seed);
  std::vector<float> grad(data.features);
  const auto deadline = std::chrono::milliseconds(f.deadline_ms);
  for (uint64_t step = 0; step < f.steps; ++step) {
    float grad_bias = 0.0f;
    logreg::minibatch_gradient(data, model, sampler.next(), grad, &grad_bias);
    logreg::add_l2(model, f.l2, grad);
    std::copy(grad.begin(), grad.end(), weight.data());
    bias.data()[0] = grad_bias;

    auto t0 = Clock::now();
    const sparsecar::SubmitOptions options{.lr = f.lr};
    if (auto s = client->submit(weight, step, options); !s.ok()) return fail(f, "submit logreg.weight", s);
    if (auto s = client->submit(bias, step, options); !s.ok()) return fail(f, "submit logreg.bias", s);
    auto wi = client->wait(weight, step, deadline);
    if (!wi.ok()) return fail(f, ("wait logreg.weight step " + std::to_string(step)).c_str(), wi.status());
    auto bi = client->wait(bias, step, deadline);
    if (!bi.ok()) return fail(f, ("wait logreg.bias step " + std::to_string(step)).c_str(), bi.status());
    t.exchange_seconds += seconds_since(t0);

    logreg::sgd_update(model, std::span<const float>(weight.data(), weight.size()), bias.data()[0], f.lr);
    uint64_t step_nnz = wi->nnz + bi->nnz;
    uint64_t step_elements = weight.size() + bias.size();
    t.steps = step + 1;
    t.bytes_sent += wi->bytes_sent + bi->bytes_sent;
    t.dense_bytes += wi->dense_bytes + bi->dense_bytes;
    t.nnz += step_nnz;
    t.elements += step_elements;

    if (reporter.due(step + 1)) {
      double accuracy = 0.0;
      double loss = logreg::mean_loss(data, model, &accuracy);
      if (auto s = client->report_metric("loss", loss, step); !s.ok()) return fail(f, "report loss", s);
      reporter.line(step + 1, loss, accuracy, step_nnz, step_elements, t);
    }
  }
  return 0;
}

// Per node and tensor step, what the daemon's wire model sends (see the demo's README notes):
// sparse all-gather of COO to W-1 peers, or a dense ring all-reduce of 2(W-1) chunk messages.
constexpr uint64_t kHeaderBytes = 72;
uint64_t sparse_wire_bytes(uint32_t world, uint64_t k) { return (world - 1) * (kHeaderBytes + 8 * k); }
uint64_t dense_wire_bytes(uint32_t world, uint64_t n) {
  uint64_t chunk = (n + world - 1) / world;
  return 2ull * (world - 1) * (kHeaderBytes + 4 * chunk);
}

// --local: W trainers in this process; the average is exact or Top-k + error feedback per node.
int run_local(const Flags& f, const logreg::Dataset& data, logreg::Model& model, Totals& t,
              Reporter& reporter) {
  const uint32_t W = f.world;
  std::vector<logreg::ShardSampler> samplers;
  std::vector<logreg::TopkErrorFeedback> ef_weight, ef_bias;
  for (uint32_t r = 0; r < W; ++r) {
    samplers.emplace_back(data.rows(), r, W, f.batch, f.seed);
    ef_weight.emplace_back(data.features, f.density);
    ef_bias.emplace_back(1, f.density);
  }
  std::vector<float> grad(data.features), sum(data.features);
  for (uint64_t step = 0; step < f.steps; ++step) {
    std::fill(sum.begin(), sum.end(), 0.0f);
    float sum_bias = 0.0f;
    uint64_t step_nnz = 0;
    for (uint32_t r = 0; r < W; ++r) {
      float grad_bias = 0.0f;
      logreg::minibatch_gradient(data, model, samplers[r].next(), grad, &grad_bias);
      logreg::add_l2(model, f.l2, grad);
      uint64_t nnz_w = data.features, nnz_b = 1;
      if (f.local_topk) {
        nnz_w = ef_weight[r].compress(grad);
        nnz_b = ef_bias[r].compress(std::span<float>(&grad_bias, 1));
      }
      for (size_t j = 0; j < grad.size(); ++j) sum[j] += grad[j];
      sum_bias += grad_bias;
      if (r == 0) step_nnz = nnz_w + nnz_b;
    }
    for (float& v : sum) v /= static_cast<float>(W);
    sum_bias /= static_cast<float>(W);
    logreg::sgd_update(model, sum, sum_bias, f.lr);

    uint64_t dense = dense_wire_bytes(W, data.features) + dense_wire_bytes(W, 1);
    t.steps = step + 1;
    t.dense_bytes += dense;
    t.bytes_sent += f.local_topk ? sparse_wire_bytes(W, step_nnz - 1) + sparse_wire_bytes(W, 1) : dense;
    t.nnz += step_nnz;
    t.elements += data.features + 1;
    if (reporter.due(step + 1)) {
      double accuracy = 0.0;
      double loss = logreg::mean_loss(data, model, &accuracy);
      reporter.line(step + 1, loss, accuracy, step_nnz, data.features + 1, t);
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const Flags f = parse_flags(argc, argv);
  const auto start = Clock::now();

  logreg::ProblemOptions problem = f.problem;
  problem.seed = f.seed;
  problem.samples += kHeldOut;
  logreg::Dataset data = logreg::make_gisette_like(problem);
  const logreg::Dataset held_out = logreg::split_tail(data, kHeldOut);
  logreg::Model model;
  model.weight.assign(data.features, 0.0f);
  const double initial_loss = logreg::mean_loss(data, model);
  if (f.rank == 0) {
    std::printf("logreg: %zu samples x %zu features (%.1f%% non-zero, %zu informative), %u trainer(s), "
                "%s, batch %zu, lr %g, %" PRIu64 " steps\n",
                data.rows(), data.features,
                100.0 * static_cast<double>(data.nnz()) / static_cast<double>(data.rows() * data.features),
                problem.informative, f.world,
                f.local ? (f.local_topk ? "local simulation, top-k + error feedback" : "local simulation, dense")
                        : "through sparsecard",
                f.batch, static_cast<double>(f.lr), f.steps);
    std::fflush(stdout);
  }

  Totals totals;
  Reporter reporter(f);
  int rc = f.local ? run_local(f, data, model, totals, reporter)
                   : run_with_daemon(f, data, model, totals, reporter);
  if (rc != 0) return rc;

  double accuracy = 0.0;
  const double final_loss = logreg::mean_loss(data, model, &accuracy);
  double test_accuracy = 0.0;
  const double test_loss = logreg::mean_loss(held_out, model, &test_accuracy);
  const double wall = seconds_since(start);
  if (!std::isfinite(final_loss)) {
    std::fprintf(stderr, "sparsecar-logreg-trainer[rank %u]: the loss diverged (%g)\n", f.rank, final_loss);
    return 1;
  }
  if (f.rank == 0) {
    std::printf("done: %" PRIu64 " steps, loss %.5f -> %.5f, accuracy %.3f (held-out loss %.5f, accuracy %.3f), "
                "sent %s (dense would be %s), %.2f s\n",
                totals.steps, initial_loss, final_loss, accuracy, test_loss, test_accuracy,
                human_bytes(static_cast<double>(totals.bytes_sent)).c_str(),
                human_bytes(static_cast<double>(totals.dense_bytes)).c_str(), wall);
  }
  return write_json(f, totals, initial_loss, final_loss, accuracy, test_loss, test_accuracy, wall, reporter.history()) ? 0 : 1;
}
