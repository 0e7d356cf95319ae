// The budget controller's online lambda calibration (controller_budget.cc, v2), driven by scripted
// traces: synthetic gradients through error feedback and the hard threshold on two simulated
// nodes, the decisions taking effect two steps after the observation they were made on (as
// decision epochs do in the daemon). What the threshold sends is counted here, element by element
// (|e_i| >= lambda), independently of the histograms the controller reads.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "sparsecar/policies/controllers.h"
#include "sparsecar/policies/observations.h"
#include "tests/unit/policies/fake_job.h"

namespace sparsecar::policies {
namespace {

using testing::FakeJob;

constexpr uint64_t kPeers = 3, kHeaderBytes = 80;  // what a sent element costs on the wire: 8 bytes x 3

// One node's gradient tensor under error feedback. Coordinate i's gradient at step t is
// scale(t) * a_i * (m_i + z), a_i log-normal (coordinates differ by orders of magnitude), m_i a
// per-coordinate drift (`drift` x N(0, 1)), z fresh noise: a persistent signal plus noise, like a
// real gradient. With `momentum` m the node hands over u = m u + g instead (the DDP hook's
// momentum correction): smoothed, so every coordinate's residual climbs steadily.
class Node {
 public:
  Node(size_t n, uint64_t seed, double drift = 0.1, double momentum = 0)
      : rng_(seed), a_(n), m_(n), residual_(n, 0.0f), g_(n), e_(n), u_(n, 0.0), momentum_(momentum) {
    std::normal_distribution<double> normal;
    for (size_t i = 0; i < n; ++i) {
      a_[i] = std::exp(normal(rng_));
      m_[i] = drift * normal(rng_);
    }
  }

  // One step under the knobs in force; fills the node's observation. Top-k (the operator's
  // selector before the budget controller takes over) keeps the k largest.
  NodeObservation step(uint64_t t, const ControlKnobs& k, double scale) {
    std::normal_distribution<double> normal;
    const size_t n = residual_.size();
    for (size_t i = 0; i < n; ++i) {
      u_[i] = momentum_ * u_[i] + scale * a_[i] * (m_[i] + normal(rng_));
      g_[i] = static_cast<float>(u_[i]);
      e_[i] = residual_[i] + g_[i];
    }
    NodeObservation o;
    o.step = t;
    o.elements = n;
    o.magnitude_hist.assign(kMagnitudeBins, 0);
    magnitude_hist_add(o.magnitude_hist, e_);
    o.gradient_hist.assign(kMagnitudeBins, 0);
    magnitude_hist_add(o.gradient_hist, g_);
    o.magnitude_elements = n;
    float lambda;
    if (k.selector == kernels::Selector::kThreshold) {
      lambda = static_cast<float>(k.threshold);
    } else {
      std::vector<float> mag(n);
      for (size_t i = 0; i < n; ++i) mag[i] = std::fabs(e_[i]);
      const size_t kk = std::max<size_t>(1, static_cast<size_t>(k.density * static_cast<double>(n)));
      std::nth_element(mag.begin(), mag.begin() + static_cast<std::ptrdiff_t>(kk - 1), mag.end(), std::greater<>());
      lambda = mag[kk - 1];
    }
    if (k.selector == kernels::Selector::kThreshold) o.threshold = k.threshold;
    for (size_t i = 0; i < n; ++i) {
      if (std::fabs(e_[i]) >= lambda) {
        ++o.nnz;
        residual_[i] = 0;
      } else {
        residual_[i] = e_[i];
      }
    }
    o.bytes_sent = kPeers * (kHeaderBytes + 8 * o.nnz);  // COO fp32 to every peer
    return o;
  }

  // The exact lambda at which `density` of this node's last pre-selection magnitudes pass.
  double exact_quantile(double density) const {
    std::vector<float> mag(e_.size());
    for (size_t i = 0; i < e_.size(); ++i) mag[i] = std::fabs(e_[i]);
    std::sort(mag.begin(), mag.end(), std::greater<>());
    return mag[static_cast<size_t>(density * static_cast<double>(mag.size())) - 1];
  }

 private:
  std::mt19937_64 rng_;
  std::vector<double> a_, m_;
  std::vector<float> residual_, g_, e_;
  std::vector<double> u_;
  double momentum_ = 0;
};

struct Trace {
  std::vector<double> density;      // realised, mean over the nodes, per step
  std::vector<double> lambda;       // in force per step
  std::vector<double> moves;        // |log| of each decided lambda against the one decided before
  std::optional<double> first_lambda;
  uint64_t first_lambda_step = 0;   // the step whose observation it was decided on
  std::optional<uint64_t> threshold_from;  // first step the threshold selected after the top-k start-up
  double first_quantile = 0;        // exact quantile of step 0's magnitudes at the target density
  std::vector<double> quantile;     // per step: node 0's exact quantile at the target density (first_density)
  double sent = 0;                  // elements per node over the run
  double bytes = 0;                 // the most any node sent, summed over the run
  double largest_move() const { return moves.empty() ? 0.0 : *std::max_element(moves.begin(), moves.end()); }
};

// `steps` steps of two nodes of n/2 elements each; gradients shrink `shrink`x over the run. With
// burst > 0, every step's gradient is also scaled by exp(burst * z), z ~ N(0, 1) drawn once per
// step for both nodes: the step-to-step swings of a real minibatch gradient's size, under which
// the hard threshold's volume swings too. drift, momentum: Node's.
Trace run(FakeJob& job, size_t n, uint64_t steps, double shrink, double first_density, double burst = 0,
          double drift = 0.1, double momentum = 0) {
  std::mt19937_64 burst_rng(99);
  std::normal_distribution<double> burst_normal;
  std::vector<Node> nodes;
  nodes.emplace_back(n / 2, 1, drift, momentum);
  nodes.emplace_back(n / 2, 2, drift, momentum);
  Trace tr;
  bool saw_topk = false;
  for (uint64_t t = 0; t < steps; ++t) {
    const ControlKnobs k = job.at(t);
    const double swing = burst > 0 ? std::exp(burst * burst_normal(burst_rng)) : 1.0;
    const double scale = swing * 1e-3 * std::pow(shrink, -static_cast<double>(t) / static_cast<double>(steps));
    std::vector<NodeObservation> obs;
    double nnz = 0;
    for (auto& node : nodes) {
      obs.push_back(node.step(t, k, scale));
      obs.back().rank = static_cast<uint32_t>(obs.size() - 1);
      nnz += static_cast<double>(obs.back().nnz);
    }
    if (t == 0) tr.first_quantile = nodes[0].exact_quantile(first_density);
    tr.quantile.push_back(nodes[0].exact_quantile(first_density));
    if (k.selector == kernels::Selector::kTopk) saw_topk = true;
    if (!tr.threshold_from && saw_topk && k.selector == kernels::Selector::kThreshold) tr.threshold_from = t;
    tr.density.push_back(nnz / static_cast<double>(n));
    tr.lambda.push_back(k.selector == kernels::Selector::kThreshold ? k.threshold : 0);
    tr.sent += nnz / static_cast<double>(nodes.size());
    tr.bytes += static_cast<double>(std::max(obs[0].bytes_sent, obs[1].bytes_sent));
    const size_t before = job.decisions.size();
    job.feed(merge_observations(obs, 2));
    if (job.decisions.size() > before && job.latest().selector == kernels::Selector::kThreshold) {
      const double lambda = job.latest().threshold;
      const ControlKnobs& prev = job.decisions[before - 1].second;
      if (!tr.first_lambda) {
        tr.first_lambda = lambda;
        tr.first_lambda_step = t;
      } else if (prev.selector == kernels::Selector::kThreshold) {
        tr.moves.push_back(std::fabs(std::log(lambda / prev.threshold)));
      }
    }
  }
  return tr;
}

ControllerSettings budget_settings() {
  ControllerSettings s;
  s.active = bit(ControllerKind::kBudget);
  s.world_size = 2;
  s.density_min = 1e-5;
  return s;
}

// The loop decides at most every other step (controller_interval_steps), so the volume comes in
// pairs of steps: the realised density is judged over 4 steps (two decisions).
constexpr uint64_t kWindow = 4;

// Mean of v[t .. t + n - 1].
double window(const std::vector<double>& v, uint64_t t, uint64_t n) {
  double sum = 0;
  for (uint64_t i = t; i < t + n; ++i) sum += v[i];
  return sum / static_cast<double>(n);
}

// Relative error of x against the target.
double off(double x, double target) { return std::fabs(x / target - 1); }

// The first window start from which every kWindow-step mean up to `upto` stays within 25 % of
// `target` (none: never for good).
std::optional<uint64_t> settled_at(const std::vector<double>& density, double target, uint64_t upto) {
  std::optional<uint64_t> settled;
  for (uint64_t t = 0; t + kWindow <= upto; ++t) {
    if (off(window(density, t, kWindow), target) < 0.25) {
      if (!settled) settled = t;
    } else {
      settled.reset();
    }
  }
  return settled;
}

TEST(MagnitudeHistogramTest, QuantileMatchesASortedReferenceWithinABin) {
  std::mt19937_64 rng(7);
  std::lognormal_distribution<double> lognormal(-5, 2);
  std::vector<float> x(200000);
  for (auto& v : x) v = static_cast<float>((rng() & 1 ? 1 : -1) * lognormal(rng));
  x[5] = 0;
  std::vector<uint64_t> hist(kMagnitudeBins, 0);
  magnitude_hist_add(hist, x);
  std::vector<float> mag(x.size());
  for (size_t i = 0; i < x.size(); ++i) mag[i] = std::fabs(x[i]);
  std::sort(mag.begin(), mag.end(), std::greater<>());
  for (double d : {1e-4, 1e-3, 5e-3, 0.05, 0.5}) {
    const double ref = mag[static_cast<size_t>(d * static_cast<double>(x.size())) - 1];
    const double q = magnitude_quantile(hist, static_cast<double>(x.size()), d);
    EXPECT_LT(std::fabs(std::log(q / ref)), std::log(1.125)) << "density " << d << ": " << q << " vs " << ref;
    // What that lambda would keep, counted directly.
    const auto kept = std::count_if(mag.begin(), mag.end(), [&](float m) { return m >= q; });
    EXPECT_LT(off(static_cast<double>(kept), d * static_cast<double>(x.size())), 0.1) << "density " << d;
  }
  EXPECT_EQ(magnitude_quantile(std::vector<uint64_t>(kMagnitudeBins, 0), 10, 0.5), 0) << "empty: unknown";
  EXPECT_EQ(magnitude_quantile(hist, static_cast<double>(x.size()), 1.0), 0) << "everything: lambda 0";
}

TEST(MagnitudeHistogramTest, MergeSumsTheNodesThatMeasured) {
  NodeObservation a, b, c;
  a.elements = b.elements = c.elements = 4;
  a.magnitude_hist.assign(kMagnitudeBins, 0);
  b.magnitude_hist.assign(kMagnitudeBins, 0);
  a.gradient_hist.assign(kMagnitudeBins, 0);
  b.gradient_hist.assign(kMagnitudeBins, 0);
  const std::vector<float> xa = {1.0f, -2.0f, 0.0f, 3.0f}, xb = {1.0f, 5.0f, 5.0f, 0.5f};
  magnitude_hist_add(a.magnitude_hist, xa);
  magnitude_hist_add(b.magnitude_hist, xb);
  a.magnitude_elements = b.magnitude_elements = 4;
  const std::vector<NodeObservation> all = {a, b, c};  // c measured nothing
  const JobObservation j = merge_observations(all, 3);
  ASSERT_EQ(j.magnitude_hist.size(), kMagnitudeBins);
  EXPECT_EQ(j.magnitude_elements, 8u);
  EXPECT_EQ(j.magnitude_hist[magnitude_bin(1.0f)], 2u);
  EXPECT_EQ(j.magnitude_hist[magnitude_bin(5.0f)], 2u);
  EXPECT_EQ(j.magnitude_hist[0], 1u);
  // The top 2 of 8 are the two 5s: lambda inside 5's bin.
  const double q = magnitude_quantile(j.magnitude_hist, 8, 0.25);
  EXPECT_LE(q, 5.0 * 1.125);
  EXPECT_GT(q, 3.0);
}

TEST(BudgetCalibrationTest, FixedDensityTracksGradientsShrinking30xWithinAQuarterAfter15Steps) {
  // 0.5 % of 2 x 100k coordinates, gradients shrinking 30x over 300 steps; the operator's lambda
  // (1e-3) is ~100x above where this gradient needs it.
  const double d = 0.005;
  ControllerSettings s = budget_settings();
  s.budget.density = d;
  ControlKnobs base;
  base.threshold = 1e-3;
  FakeJob job(s, base);
  const Trace tr = run(job, 200000, 300, 30.0, d);
  ASSERT_TRUE(tr.first_lambda.has_value());
  ASSERT_TRUE(tr.threshold_from.has_value());
  // v4: top-k at the target until the residuals' climb slows (at least 6 steps, at most 40), each
  // of those steps sending the target (k rounded per node); then the first calibrated lambda: the
  // quantile of the step it was decided on (one bin of resolution), extrapolated over the
  // decision latency by a climb of at most 2 % a step.
  EXPECT_GE(*tr.threshold_from, 6u);
  EXPECT_LE(*tr.threshold_from, 40u + 3u);
  for (uint64_t t = 2; t < *tr.threshold_from; ++t) EXPECT_LT(off(tr.density[t], d), 1e-3) << "top-k step " << t;
  EXPECT_LT(std::fabs(std::log(*tr.first_lambda / tr.quantile[tr.first_lambda_step])), std::log(1.13) + 3 * 0.02)
      << *tr.first_lambda << " vs " << tr.quantile[tr.first_lambda_step] << " at step " << tr.first_lambda_step;
  double worst = 0, worst_step = 0, largest_move = 0;
  for (uint64_t t = 15; t + kWindow <= tr.density.size(); ++t) {
    const double mean = window(tr.density, t, kWindow);
    EXPECT_LT(off(mean, d), 0.25) << "steps " << t << "-" << t + 3 << ": density " << mean;
    worst = std::max(worst, off(mean, d));
    worst_step = std::max(worst_step, off(tr.density[t], d));
  }
  for (double m : tr.moves) largest_move = std::max(largest_move, m);
  EXPECT_LE(largest_move, std::log(2.0) + 1e-9);
  // Not front-loaded: the first and the last 100 steps send the same within 10 %.
  double early = 0, late = 0;
  for (uint64_t t = 0; t < 100; ++t) early += tr.density[t];
  for (uint64_t t = 200; t < 300; ++t) late += tr.density[t];
  EXPECT_LT(off(early, late), 0.10) << early / 100 << " vs " << late / 100;
  EXPECT_LT(off(tr.sent / (300 * 100000.0), d), 0.10) << "the run's mean, start-up included";
  std::printf("[trace] fixed density %.3g: threshold from step %llu; from step 15 worst |density/target - 1| over "
              "4 steps %.3f (one step %.3f), largest move %.3fx, decisions %zu, lambda %.3g -> %.3g, mean density "
              "steps 0-99 %.4g, 200-299 %.4g\n",
              d, static_cast<unsigned long long>(*tr.threshold_from), worst, worst_step, std::exp(largest_move),
              job.decisions.size(), *tr.first_lambda, tr.lambda.back(), early / 100, late / 100);
}

TEST(BudgetCalibrationTest, GradientsSwingingStepToStepStillSendTheTargetOnAverage) {
  // Each step's gradient scaled by a log-normal factor (sigma 0.7: a step 2x the median size one
  // step in six): the threshold's volume swings from step to step, several-fold. Aiming every
  // step's density at the target in log terms would leave the arithmetic mean (the volume on the
  // wire) above it; the density budget is a volume, so the mean after the start-up must be the
  // target.
  const double d = 0.005;
  ControllerSettings s = budget_settings();
  s.budget.density = d;
  ControlKnobs base;
  base.density = d;  // the documented start: top-k at the budget's density
  FakeJob job(s, base);
  const Trace tr = run(job, 200000, 300, 30.0, d, 0.7);
  double swing_lo = 1, swing_hi = 0;
  for (uint64_t t = 15; t < 300; ++t) {
    swing_lo = std::min(swing_lo, tr.density[t] / d);
    swing_hi = std::max(swing_hi, tr.density[t] / d);
  }
  EXPECT_GT(swing_hi / swing_lo, 4.0) << "the plant's volume does swing";
  // The start-up (the first calibrated lambda, then the residuals piling up under it) is not
  // paid back: its 15 steps and the decision latency.
  const double mean = window(tr.density, 20, 280), whole = window(tr.density, 0, 300);
  EXPECT_LT(off(mean, d), 0.05) << "mean density from step 20 " << mean;
  EXPECT_LT(off(whole, d), 0.25) << "mean density over the run " << whole;
  EXPECT_LE(tr.largest_move(), std::log(2.0) + 1e-9);
  std::printf("[trace] swinging gradients, density %.3g: mean from step 20 %.4g (%+.1f %%), over the run %.4g "
              "(%+.1f %%), one step from %.2fx to %.2fx the target, decisions %zu\n",
              d, mean, 100 * (mean / d - 1), whole, 100 * (whole / d - 1), swing_lo, swing_hi, job.decisions.size());
}

TEST(BudgetCalibrationTest, MomentumSmoothedGradientsTopKStartThenTheTargetOnAverage) {
  // The real small job's gradients through the hook's momentum correction: u = 0.9 u + g, a drift
  // as large as the noise. Every coordinate's residual climbs steadily, the residuals pile up just
  // under lambda and the pile climbs with it (on the real job ~4 % a step, ~2 % of the coordinates
  // within 13 % of one another): lambda has to rise ~100x over the run, and a lambda decided two steps
  // earlier sends many times the target. v3 started the threshold at step 2 at the quantile of a
  // young residual (0.04 here): steps 2-9 sent 34x the target, as the real job's start-up sent
  // 1-3 % for 0.1 % for ~50 steps. v4 keeps top-k at the target while the climb is fast.
  const double d = 0.001;
  ControllerSettings s = budget_settings();
  s.budget.density = d;
  ControlKnobs base;
  base.density = d;  // top-k at the budget's density first, as documented
  FakeJob job(s, base);
  const Trace tr = run(job, 200000, 300, 3.0, d, 0.3, /*drift=*/1.0, /*momentum=*/0.9);
  ASSERT_TRUE(tr.threshold_from.has_value());
  const double mean = window(tr.density, 20, 280), start = window(tr.density, 2, 8);
  EXPECT_LT(off(start, d), 0.01) << "steps 2-9 under top-k: " << start;
  EXPECT_LT(off(mean, d), 0.10) << "mean density from step 20 " << mean;
  EXPECT_LE(tr.largest_move(), std::log(2.0) + 1e-9);
  const auto settled = settled_at(tr.density, d, 300);
  std::printf("[trace] momentum-smoothed gradients, density %.3g: threshold from step %llu, steps 2-9 send %.2fx the "
              "target, mean from step 20 %.4g (%+.1f %%), settled (4-step windows within 25 %%, for good) at %s, "
              "lambda %.3g -> %.3g, largest move %.3fx\n",
              d, static_cast<unsigned long long>(*tr.threshold_from), start / d, mean, 100 * (mean / d - 1),
              settled ? std::to_string(*settled).c_str() : "never", *tr.first_lambda, tr.lambda.back(),
              std::exp(tr.largest_move()));
}

TEST(BudgetCalibrationTest, GradientsCollapsingFastGoBackToTopKAndTheVolumeHolds) {
  // Gradients shrinking 1e6x over 300 steps (4.6 % a step; a GPU job that memorised its batch saw
  // its gradients fall to ~1e-10): under error feedback the residuals pile up just under lambda,
  // and a lambda two steps old - 7 % under the exact quantile, or 1 % over it - sent 5-40x the
  // target or nothing; v4 sent 5.3x the target over the run. v5 goes back to top-k at the target
  // while |g|'s scale moves more than 2 % a step (over two 30-step halves), and the volume holds.
  const double d = 0.001;
  ControllerSettings s = budget_settings();
  s.budget.density = d;
  ControlKnobs base;
  base.density = d;
  FakeJob job(s, base);
  const uint64_t steps = 300;
  const Trace tr = run(job, 200000, steps, 1e6, d, 0.3, /*drift=*/1.0);
  ASSERT_TRUE(tr.threshold_from.has_value());
  uint64_t topk_again = 0;  // steps under top-k after the threshold had taken over
  for (uint64_t t = *tr.threshold_from; t < steps; ++t) topk_again += tr.lambda[t] == 0 ? 1 : 0;
  const double whole = window(tr.density, 0, steps);
  double late = 0;  // the most one step sends once top-k is back: the aim, within [1/4, 2]x the target
  for (uint64_t t = 150; t < steps; ++t) late = std::max(late, tr.density[t] / d);
  EXPECT_GT(topk_again, 100u) << "the scale's fall took the job back to top-k";
  EXPECT_LT(off(whole, d), 0.05) << "mean density over the run " << whole;
  EXPECT_LE(late, 2.0 + 1e-3) << "one step of the last 150 sent " << late << "x the target";
  EXPECT_LE(tr.largest_move(), std::log(2.0) + 1e-9);
  std::printf("[trace] gradients collapsing 1e6x in %llu steps, density %.3g: threshold from step %llu, %llu steps "
              "back under top-k, mean over the run %.4g (%+.1f %%), one step of the last 150 at most %.2fx the target, "
              "decisions %zu\n",
              static_cast<unsigned long long>(steps), d, static_cast<unsigned long long>(*tr.threshold_from),
              static_cast<unsigned long long>(topk_again), whole, 100 * (whole / d - 1), late, job.decisions.size());
}

TEST(BudgetCalibrationTest, AFixedLambdaOnTheSameTraceIsFrontLoaded) {
  // The baseline the calibration removes: the static threshold at step 0's exact 0.5 % quantile.
  ControllerSettings s = budget_settings();
  s.active = 0;  // static
  ControlKnobs probe;
  probe.selector = kernels::Selector::kTopk;
  probe.density = 0.005;
  Node first(100000, 1);
  first.step(0, probe, 1e-3);
  ControlKnobs base;
  base.selector = kernels::Selector::kThreshold;
  base.threshold = first.exact_quantile(0.005);
  FakeJob job(s, base);
  const Trace tr = run(job, 200000, 300, 30.0, 0.005);
  double early = 0, late = 0;
  for (uint64_t t = 0; t < 100; ++t) early += tr.density[t];
  for (uint64_t t = 200; t < 300; ++t) late += tr.density[t];
  EXPECT_GT(early / late, 3.0) << early / 100 << " vs " << late / 100;
  std::printf("[trace] fixed lambda %.3g: mean density steps 0-99 %.4g, 200-299 %.4g\n", base.threshold, early / 100,
              late / 100);
}

TEST(BudgetCalibrationTest, RunBudgetIsMetAndTheStartUpFromTopKSettlesIn15Steps) {
  // The volume budget of 0.5 % of the coordinates on average over 300 steps, the operator's
  // selector top-k (the default: its lambda knob is not used; the first lambda is the
  // histogram's quantile). v1 needed ~50 steps of 2-76x moves here.
  ControllerSettings s = budget_settings();
  s.budget.total_elements = 0.005 * 100000 * 300;
  s.budget.steps = 300;
  ControlKnobs base;
  FakeJob job(s, base);
  const Trace tr = run(job, 200000, 300, 30.0, 0.005);
  // The last steps pay the run's rounding back (what is left over what few steps are left):
  // settling is judged up to step 280.
  const std::optional<uint64_t> settled = settled_at(tr.density, 0.005, 280);
  ASSERT_TRUE(settled.has_value());
  EXPECT_LE(*settled, 15u);
  const double largest_move = tr.largest_move();
  EXPECT_LE(largest_move, std::log(2.0) + 1e-9);
  EXPECT_LT(off(tr.sent, s.budget.total_elements), 0.02) << "sent " << tr.sent;
  std::printf("[trace] run budget from top-k: settled (within 25 %%, for good) at step %llu, largest move %.3fx, "
              "sent %.4g of %.4g (%+.2f %%)\n",
              static_cast<unsigned long long>(*settled), std::exp(largest_move), tr.sent, s.budget.total_elements,
              100 * (tr.sent / s.budget.total_elements - 1));
}

TEST(BudgetCalibrationTest, FromTheThresholdAtALambda1e4TooHighTheStartUpSettlesIn15Steps) {
  // The operator's selector the hard threshold at lambda 100 (10^4x the 0.5 % quantile): the
  // steps before the first decision send nothing, then the calibrated lambda takes over.
  // (From a lambda 10^4x too LOW those steps send everything: a run budget of this volume is
  // spent by them, and a density budget's start-up is not settled by step 15 — not asserted.)
  ControllerSettings s = budget_settings();
  s.budget.density = 0.005;
  ControlKnobs base;
  base.selector = kernels::Selector::kThreshold;
  base.threshold = 1e2;
  FakeJob job(s, base);
  const Trace tr = run(job, 200000, 300, 30.0, 0.005);
  ASSERT_GT(tr.lambda[0], 0.0) << "the operator's threshold runs before the first decision";
  const std::optional<uint64_t> settled = settled_at(tr.density, 0.005, 300);
  ASSERT_TRUE(settled.has_value());
  EXPECT_LE(*settled, 15u);
  const double largest_move = tr.largest_move();
  EXPECT_LE(largest_move, std::log(2.0) + 1e-9);
}

TEST(BudgetCalibrationTest, AByteBudgetIsSpentAtTheMeasuredBytesPerElement) {
  // The bytes of 0.5 % of the coordinates every step, headers and all three copies included.
  ControllerSettings s = budget_settings();
  s.budget.steps = 300;
  s.budget.total_bytes = 300.0 * kPeers * (kHeaderBytes + 8 * 500);
  ControlKnobs base;
  base.threshold = 1e-3;
  FakeJob job(s, base);
  const Trace tr = run(job, 200000, 300, 30.0, 0.005);
  EXPECT_LT(off(tr.bytes, s.budget.total_bytes), 0.02) << tr.bytes << " of " << s.budget.total_bytes;
  double worst = 0, largest_move = 0;
  const std::optional<uint64_t> settled = settled_at(tr.density, 0.005, 280);
  for (uint64_t t = 15; t + kWindow <= 280; ++t) worst = std::max(worst, off(window(tr.density, t, kWindow), 0.005));
  for (double m : tr.moves) largest_move = std::max(largest_move, m);
  ASSERT_TRUE(settled.has_value());
  // Not the 15 steps of the element budget on this trace: it settles at 17, while the bytes per
  // element it converts by still move (top-k's start-up steps, then the headers' share).
  EXPECT_LE(*settled, 20u);
  EXPECT_LE(largest_move, std::log(2.0) + 1e-9);
  std::printf("[trace] byte budget: sent %.4g of %.4g bytes (%+.2f %%), settled at step %llu, worst 4-step window "
              "from step 15 %.3f, largest move %.3fx\n",
              tr.bytes, s.budget.total_bytes, 100 * (tr.bytes / s.budget.total_bytes - 1),
              static_cast<unsigned long long>(*settled), worst, std::exp(largest_move));
}

}  // namespace
}  // namespace sparsecar::policies
