// Closed-loop harness for the controllers (docs/controllers.md).
//
// W simulated workers train an L2-regularised logistic regression on their own shard of a
// seeded synthetic problem. Each step every worker computes a minibatch gradient, runs the real
// kernels (error feedback + top-k or hard threshold) on the plan that policies::plan_tensor gives
// for the knobs in force, and the selections are averaged. A simulated link turns the bytes a
// worker would send (exact COO sizes + 72-byte headers, sparse all-gather; dense ring otherwise)
// into an exchange time from a bandwidth trace. Rank 0's policies::ControlLoop sees the same
// JobObservation the daemon would build and its proposals take effect two steps later, as
// decision epochs do.
//
// Scenarios: bandwidth (10x drop mid-run), accuracy (pushed too hard, then closed loop on the
// loss against a dense run's trajectory), budget (hard threshold with a whole-run volume
// budget). Writes a JSON summary and per-step CSV traces; --check exits 1 when an acceptance
// bound is missed.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "sparsecar/kernels/codec.h"
#include "sparsecar/kernels/select.h"
#include "sparsecar/policies/controllers.h"
#include "sparsecar/policies/tensor_plan.h"

namespace {

using namespace sparsecar;
using policies::ControlKnobs;
using policies::ControllerKind;
using policies::ControllerSettings;

struct Problem {
  uint32_t d = 0, workers = 0, per_worker = 0;
  std::vector<float> x;  // (workers * per_worker) x d, row-major
  std::vector<float> y;  // +-1
  double l2 = 1e-4;

  // heavy: every 50th feature 4x larger (a few coordinates dominate the gradient).
  Problem(uint32_t dim, uint32_t w, uint32_t n, uint32_t seed, bool heavy = true, float noise = 0.3f)
      : d(dim), workers(w), per_worker(n) {
    std::mt19937 rng(seed);
    std::normal_distribution<float> g;
    std::vector<float> truth(d);
    for (auto& v : truth) v = g(rng);
    const size_t rows = size_t{w} * n;
    x.resize(rows * d);
    y.resize(rows);
    const float inv = 1.0f / std::sqrt(static_cast<float>(d));
    for (size_t i = 0; i < rows; ++i) {
      double dot = 0;
      for (uint32_t j = 0; j < d; ++j) {
        // Heavy-tailed feature scales: a few coordinates matter much more (as in real gradients).
        const float v = g(rng) * inv * (heavy && j % 50 == 0 ? 4.0f : 1.0f);
        x[i * d + j] = v;
        dot += v * truth[j];
      }
      y[i] = dot + noise * g(rng) > 0 ? 1.0f : -1.0f;
    }
  }
  const float* row(size_t i) const { return &x[i * d]; }

  // Minibatch gradient of worker `w` at `step` (batch rows in a fixed rotation).
  void gradient(const std::vector<float>& model, uint32_t w, uint64_t step, uint32_t batch, std::vector<float>& g) const {
    std::fill(g.begin(), g.end(), 0.0f);
    for (uint32_t b = 0; b < batch; ++b) {
      const size_t i = size_t{w} * per_worker + (step * batch + b) % per_worker;
      const float* r = row(i);
      double dot = 0;
      for (uint32_t j = 0; j < d; ++j) dot += r[j] * model[j];
      const double p = 1.0 / (1.0 + std::exp(y[i] * dot));  // d/d(dot) of log(1+exp(-y dot)) = -y p
      const float c = static_cast<float>(-y[i] * p / batch);
      for (uint32_t j = 0; j < d; ++j) g[j] += c * r[j];
    }
    for (uint32_t j = 0; j < d; ++j) g[j] += static_cast<float>(l2) * model[j];
  }

  double loss(const std::vector<float>& model) const {
    double s = 0;
    const size_t rows = y.size();
    for (size_t i = 0; i < rows; ++i) {
      const float* r = row(i);
      double dot = 0;
      for (uint32_t j = 0; j < d; ++j) dot += r[j] * model[j];
      const double z = -y[i] * dot;
      s += z > 30 ? z : std::log1p(std::exp(z));
    }
    double n2 = 0;
    for (float v : model) n2 += double{v} * v;
    return s / static_cast<double>(rows) + 0.5 * l2 * n2;
  }
};

struct Link {
  std::function<double(uint64_t)> bandwidth;  // bytes/s at a step
  double latency_s = 50e-6;                    // per message
};

struct Row {
  uint64_t step = 0;
  bool compression = true;
  double density = 0, cap = 1, threshold = 0, nnz = 0;
  uint64_t bytes = 0;
  double exchange_s = 0, budget_s = 0, loss = NAN, target = NAN, total_error = 0;
};

struct RunConfig {
  uint64_t steps = 100;
  uint32_t batch = 32;
  double lr = 0.5;
  ControlKnobs base;
  ControllerSettings settings;
  uint64_t controller_from = 0;  // the loop runs from this step on (before: static)
  double compute_s = 0.02;
  bool track_loss = false;
  const std::vector<double>* target = nullptr;  // explicit loss target per step
};

class Simulation {
 public:
  Simulation(const Problem& p, Link link) : p_(p), link_(std::move(link)) {}

  std::vector<Row> run(const RunConfig& rc, policies::ControlStatus* final_status = nullptr) {
    const uint32_t d = p_.d, W = p_.workers;
    std::vector<float> model(d, 0.0f), g(d), agg(d);
    std::vector<std::vector<float>> residual(W, std::vector<float>(d, 0.0f));
    std::vector<uint32_t> index(d);
    std::vector<float> value(d);
    std::vector<std::byte> scratch(kernels::topk_scratch_bytes(d));
    std::vector<std::pair<uint64_t, ControlKnobs>> decisions{{0, rc.base}};
    policies::ControlLoop loop;
    std::vector<Row> rows;
    double total_error = 0;
    for (uint64_t step = 0; step < rc.steps; ++step) {
      ControlKnobs k = decisions.front().second;
      for (const auto& [eff, kk] : decisions) {
        if (eff <= step) k = kk;
      }
      policies::PlanSettings ps;
      ps.base.compression = k.compression;
      ps.base.selector = k.selector;
      ps.base.params.density = k.density;
      ps.base.params.threshold = k.threshold;
      ps.density_cap = k.density_cap;
      ps.tensor_scale = k.tensor_scale;
      ps.density_min = rc.settings.density_min;
      ps.density_max = rc.settings.density_max;
      ps.active = rc.settings.active;
      policies::TensorObservation to;
      to.elements = d;
      to.step = step;
      to.world_size = W;
      to.name = "weight";
      const policies::Plan plan = policies::plan_tensor(ps, to);

      std::fill(agg.begin(), agg.end(), 0.0f);
      uint64_t max_bytes = 0;
      double nnz_sum = 0, res2 = 0, grad2 = 0;
      // The budget controller's histograms, as the daemon's ObservationCollector builds them:
      // pre-selection |residual + g| (the residual after selection plus the selected values) and
      // |g|, over every worker's sparse tensor.
      std::vector<uint64_t> mag_hist(policies::kMagnitudeBins, 0), grad_hist(policies::kMagnitudeBins, 0);
      uint64_t mag_elements = 0;
      for (uint32_t w = 0; w < W; ++w) {
        p_.gradient(model, w, step, rc.batch, g);
        for (float v : g) grad2 += double{v} * v;
        auto& r = residual[w];
        size_t nnz = 0;
        if (plan.dense) {
          kernels::add(r, g);
          kernels::add(agg, r);
          std::fill(r.begin(), r.end(), 0.0f);
          nnz = d;
          max_bytes = std::max<uint64_t>(max_bytes, policies::ring_allreduce_bytes(d, W));
        } else {
          if (plan.selector == kernels::Selector::kThreshold) {
            nnz = kernels::ef_threshold(r, g, static_cast<float>(plan.params.threshold), index.data(), value.data(), d);
          } else {
            kernels::ef_accumulate(r, g);
            nnz = kernels::topk_exact(r, kernels::topk_count(d, plan.params.density), scratch, index.data(),
                                      value.data())
                      .value();
            kernels::clear_selected(r, std::span<const uint32_t>(index.data(), nnz));
          }
          for (size_t i = 0; i < nnz; ++i) agg[index[i]] += value[i];
          policies::magnitude_hist_add(mag_hist, r);
          policies::magnitude_hist_add(mag_hist, std::span<const float>(value.data(), nnz));
          policies::magnitude_hist_add(grad_hist, g);
          mag_elements += d;
          max_bytes = std::max<uint64_t>(
              max_bytes, uint64_t{W - 1} * (policies::kWireHeaderBytes +
                                            kernels::encoded_bytes(kernels::Format::kCoo, kernels::ValueType::kF32, d, nnz)));
        }
        nnz_sum += static_cast<double>(nnz);
        for (float v : r) res2 += double{v} * v;
      }
      for (uint32_t j = 0; j < d; ++j) model[j] -= static_cast<float>(rc.lr) * agg[j] / static_cast<float>(W);
      total_error += res2;

      Row row;
      row.step = step;
      row.compression = !plan.dense;
      row.density = plan.dense ? 1.0 : plan.params.density;
      row.cap = k.density_cap;
      row.threshold = k.threshold;
      row.nnz = nnz_sum / W;
      row.bytes = max_bytes;
      const uint64_t messages = plan.dense ? 2ull * (W - 1) : W - 1;
      row.exchange_s = static_cast<double>(max_bytes) / link_.bandwidth(step) + link_.latency_s * messages;
      const policies::BandwidthSettings& bw = rc.settings.bandwidth;
      row.budget_s = bw.exchange_budget_ms > 0 ? bw.exchange_budget_ms / 1e3 : rc.compute_s * bw.exchange_budget_fraction;
      row.total_error = total_error;
      if (rc.track_loss) row.loss = p_.loss(model);
      if (rc.target) row.target = (*rc.target)[step];

      if (step >= rc.controller_from) {
        policies::JobObservation o;
        o.step = step;
        o.world_size = W;
        o.nodes = W;
        o.elements = d;
        o.nnz = row.nnz;
        o.bytes_sent = max_bytes;
        o.exchange_s = row.exchange_s;
        o.goodput_Bps = static_cast<double>(max_bytes) / row.exchange_s;
        o.compute_s = rc.compute_s;
        o.grad_norm2 = grad2;
        o.residual_norm2 = res2;
        if (rc.track_loss) {
          o.has_loss = true;
          o.loss = row.loss;
        }
        if (rc.target) {
          o.has_loss_target = true;
          o.loss_target = row.target;
        }
        o.tensors.push_back({0, d, static_cast<uint64_t>(row.nnz), -1});
        if (!plan.dense) {
          o.magnitude_hist = mag_hist;
          o.gradient_hist = grad_hist;
          o.magnitude_elements = mag_elements;
          if (plan.selector == kernels::Selector::kThreshold) o.threshold = plan.params.threshold;
        }
        auto proposal = loop.update(rc.settings, o, rc.base, decisions.back().second);
        if (proposal) decisions.push_back({step + 2, proposal->knobs});
      }
      rows.push_back(row);
    }
    if (final_status) *final_status = loop.status();
    return rows;
  }

 private:
  const Problem& p_;
  Link link_;
};

void write_csv(const std::string& path, const std::vector<Row>& rows) {
  std::ofstream f(path);
  f << "step,compression,density,cap,threshold,nnz,bytes,exchange_s,budget_s,loss,target,total_error\n";
  for (const auto& r : rows) {
    f << r.step << ',' << r.compression << ',' << r.density << ',' << r.cap << ',' << r.threshold << ',' << r.nnz
      << ',' << r.bytes << ',' << r.exchange_s << ',' << r.budget_s << ',' << r.loss << ',' << r.target << ','
      << r.total_error << '\n';
  }
}

double rel_gap(double loss, double target) { return (loss - target) / std::fabs(target); }

// Mean relative gap over the last `n` rows ending at `end` (inclusive): one number that is not
// a single noisy minibatch step.
double window_gap(const std::vector<Row>& rows, uint64_t end, uint64_t n) {
  double s = 0;
  uint64_t c = 0;
  for (uint64_t i = end + 1 - std::min(n, end + 1); i <= end; ++i) {
    s += rel_gap(rows[i].loss, rows[i].target);
    ++c;
  }
  return s / static_cast<double>(c);
}

}  // namespace

int main(int argc, char** argv) {
  bool short_run = false, check = false;
  std::string out = "bench-controllers.json", traces = ".";
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--short")) {
      short_run = true;
    } else if (!std::strcmp(argv[i], "--check")) {
      check = true;
    } else if (!std::strcmp(argv[i], "--out") && i + 1 < argc) {
      out = argv[++i];
    } else if (!std::strcmp(argv[i], "--traces") && i + 1 < argc) {
      traces = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--short] [--check] [--out FILE.json] [--traces DIR]\n", argv[0]);
      return 2;
    }
  }
  const uint32_t W = 4;

  // ---- bandwidth: a 10x drop of the link mid-run ------------------------------------------------
  const uint64_t bw_steps = short_run ? 60 : 150, drop = short_run ? 25 : 60;
  Problem bw_problem(20000, W, short_run ? 64 : 256, 1);
  Simulation bw_sim(bw_problem, Link{[&](uint64_t s) { return s < drop ? 12e6 : 1.2e6; }, 50e-6});
  RunConfig bw;
  bw.steps = bw_steps;
  bw.base.density = 0.1;
  bw.settings.active = policies::bit(ControllerKind::kBandwidth);
  bw.settings.world_size = W;
  bw.settings.density_min = 1e-4;
  bw.compute_s = 0.02;
  policies::ControlStatus bw_status;
  auto bw_rows = bw_sim.run(bw, &bw_status);
  std::optional<uint64_t> back;
  double worst_after = 0;
  for (uint64_t s = drop; s < bw_steps; ++s) {
    const double ratio = bw_rows[s].exchange_s / bw_rows[s].budget_s;
    if (!back && ratio <= 1.0) back = s;
    if (back) worst_after = std::max(worst_after, ratio);
  }
  double worst_before = 0;
  for (uint64_t s = 5; s < drop; ++s) worst_before = std::max(worst_before, bw_rows[s].exchange_s / bw_rows[s].budget_s);
  const double steps_to_budget = back ? static_cast<double>(*back - drop) : 1e9;
  write_csv(traces + "/bench-controllers-bandwidth.csv", bw_rows);

  // ---- accuracy: pushed too hard, then the closed loop on the loss ------------------------------
  const uint64_t acc_steps = short_run ? 160 : 400, push = short_run ? 60 : 100;
  Problem acc_problem(2000, W, short_run ? 256 : 512, 2, /*heavy=*/false, /*noise=*/0.05f);
  Simulation acc_sim(acc_problem, Link{[](uint64_t) { return 1e9; }, 0});
  RunConfig dense;
  dense.steps = acc_steps;
  dense.lr = 4.0;
  dense.base.compression = false;
  dense.settings.world_size = W;
  dense.track_loss = true;
  auto dense_rows = acc_sim.run(dense);
  std::vector<double> target;
  for (const auto& r : dense_rows) target.push_back(r.loss);
  RunConfig acc = dense;
  acc.base.compression = true;
  acc.base.density = 0.0005;  // k = 1 of 2000: far too aggressive
  acc.target = &target;
  auto static_rows = acc_sim.run(acc);
  acc.settings.active = policies::bit(ControllerKind::kAccuracy);
  acc.settings.density_min = 1e-4;
  acc.settings.density_max = 0.25;
  acc.controller_from = push;
  policies::ControlStatus acc_status;
  auto acc_rows = acc_sim.run(acc, &acc_status);
  const double gap_before = window_gap(acc_rows, push - 1, 10);
  const double gap_after = window_gap(acc_rows, acc_steps - 1, 10);
  const double gap_static = window_gap(static_rows, acc_steps - 1, 10);
  write_csv(traces + "/bench-controllers-accuracy.csv", acc_rows);
  write_csv(traces + "/bench-controllers-accuracy-static.csv", static_rows);

  // ---- total-error budget: hard threshold over the whole run ------------------------------------
  const uint64_t budget_steps = short_run ? 150 : 400;
  Problem b_problem(2000, W, short_run ? 256 : 512, 3);
  Simulation b_sim(b_problem, Link{[](uint64_t) { return 1e9; }, 0});
  RunConfig budget;
  budget.steps = budget_steps;
  budget.base.selector = kernels::Selector::kThreshold;
  budget.base.threshold = 1e-3;  // about 10x too low
  budget.settings.active = policies::bit(ControllerKind::kBudget);
  budget.settings.world_size = W;
  budget.settings.budget.steps = budget_steps;
  budget.settings.budget.total_elements = 0.05 * 2000 * static_cast<double>(budget_steps);  // 5 % on average
  budget.track_loss = !short_run;
  policies::ControlStatus b_status;
  auto b_rows = b_sim.run(budget, &b_status);
  double volume = 0;
  for (const auto& r : b_rows) volume += r.nnz;
  const double budget_fraction = std::fabs(volume - budget.settings.budget.total_elements) / budget.settings.budget.total_elements;
  // Start-up: the largest lambda move after the first threshold decision (budget_max_move bounds
  // it), and the first step from which every 4-step mean of nnz stays within 25 % of the rate the
  // controller aims at (what is left of the budget over what is left of the run, after the two
  // steps under the operator's lambda), up to 20 steps before the end.
  double largest_move = 1;
  std::optional<uint64_t> settled;
  {
    std::vector<double> rate(b_rows.size());
    double sent = 0;
    for (size_t t = 0; t < b_rows.size(); ++t) {
      rate[t] = (budget.settings.budget.total_elements - sent) / static_cast<double>(b_rows.size() - t);
      sent += b_rows[t].nnz;
    }
    for (size_t i = 1; i < b_rows.size(); ++i) {
      if (i >= 3 && b_rows[i].threshold != b_rows[i - 1].threshold && b_rows[i - 1].threshold != budget.base.threshold) {
        largest_move = std::max(largest_move, std::max(b_rows[i].threshold / b_rows[i - 1].threshold,
                                                       b_rows[i - 1].threshold / b_rows[i].threshold));
      }
    }
    for (size_t t = 0; t + 4 + 20 <= b_rows.size(); ++t) {
      const double mean = (b_rows[t].nnz + b_rows[t + 1].nnz + b_rows[t + 2].nnz + b_rows[t + 3].nnz) / 4;
      if (std::fabs(mean / rate[t] - 1) < 0.25) {
        if (!settled) settled = t;
      } else {
        settled.reset();
      }
    }
  }
  const double settle_steps = settled ? static_cast<double>(*settled) : 1e9;
  // Top-k at the same average density, for the total error comparison (hard-threshold paper).
  RunConfig topk = budget;
  topk.base.selector = kernels::Selector::kTopk;
  topk.base.density = 0.05;
  topk.settings.active = 0;
  auto t_rows = b_sim.run(topk);
  write_csv(traces + "/bench-controllers-budget.csv", b_rows);
  write_csv(traces + "/bench-controllers-budget-topk.csv", t_rows);

  std::ofstream j(out);
  char buf[2048];
  std::snprintf(buf, sizeof buf,
                "{\n"
                "  \"short\": %s,\n"
                "  \"workers\": %u,\n"
                "  \"bandwidth_drop_step\": %llu,\n"
                "  \"bandwidth_drop_steps_to_budget\": %.0f,\n"
                "  \"bandwidth_exchange_over_budget_after\": %.4f,\n"
                "  \"bandwidth_exchange_over_budget_before\": %.4f,\n"
                "  \"bandwidth_final_density_cap\": %.6g,\n"
                "  \"accuracy_push_step\": %llu,\n"
                "  \"accuracy_gap_before\": %.5f,\n"
                "  \"accuracy_gap_after\": %.5f,\n"
                "  \"accuracy_gap_static_end\": %.5f,\n"
                "  \"accuracy_final_density\": %.6g,\n"
                "  \"budget_total_elements\": %.0f,\n"
                "  \"budget_volume_elements\": %.0f,\n"
                "  \"budget_total_error_fraction\": %.5f,\n"
                "  \"budget_final_lambda\": %.6g,\n"
                "  \"budget_settle_step\": %.0f,\n"
                "  \"budget_largest_lambda_move\": %.4f,\n"
                "  \"budget_total_error\": %.6g,\n"
                "  \"topk_same_volume_total_error\": %.6g,\n"
                "  \"topk_same_volume_elements\": %.0f\n"
                "}\n",
                short_run ? "true" : "false", W, static_cast<unsigned long long>(drop), steps_to_budget, worst_after,
                worst_before, bw_rows.back().cap, static_cast<unsigned long long>(push), gap_before, gap_after, gap_static,
                acc_rows.back().density, budget.settings.budget.total_elements, volume, budget_fraction,
                b_rows.back().threshold, settle_steps, largest_move, b_rows.back().total_error, t_rows.back().total_error,
                [&] {
                  double v = 0;
                  for (const auto& r : t_rows) v += r.nnz;
                  return v;
                }());
  j << buf;
  std::fputs(buf, stdout);

  if (check) {
    int bad = 0;
    auto expect = [&](bool ok, const char* what) {
      if (!ok) {
        std::fprintf(stderr, "FAILED: %s\n", what);
        ++bad;
      }
    };
    expect(steps_to_budget <= 10, "bandwidth: exchange back within budget within 10 steps of the 10x drop");
    expect(worst_after <= 1.0, "bandwidth: exchange stays within budget after that");
    expect(gap_before > 0.05, "accuracy: the aggressive density opened a loss gap");
    expect(gap_after < gap_before / 3 && gap_after < 0.03, "accuracy: the controller recovered the gap");
    expect(budget_fraction <= 0.05, "budget: total volume within 5 % of the budget");
    expect(settle_steps <= 15, "budget: the start-up settles within 15 steps");
    expect(largest_move <= 2.0 + 1e-9, "budget: no lambda move beyond 2x");
    return bad == 0 ? 0 : 1;
  }
  return 0;
}
