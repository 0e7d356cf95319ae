// Job-level controllers driven by scripted observations. The "fake clock" is the step counter
// and the durations in the observations; a decision proposed after step s takes effect at
// s + 2, as decision epochs do in the daemon. No sleeps, no threads.
#include <gtest/gtest.h>

#include <cmath>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "sparsecar/policies/controllers.h"
#include "tests/unit/policies/fake_job.h"

namespace sparsecar::policies {
namespace {

using testing::FakeJob;

std::vector<TensorStepObservation> model(std::initializer_list<uint64_t> sizes) {
  std::vector<TensorStepObservation> t;
  uint32_t id = 0;
  for (uint64_t n : sizes) t.push_back({id++, n, 0, -1});
  return t;
}

// The simulated link: bytes the knobs in force put on the wire, at `bandwidth` bytes/s.
JobObservation link_step(uint64_t step, const ControlKnobs& k, const std::vector<TensorStepObservation>& tensors,
                         uint32_t world, double bandwidth, double compute_s) {
  JobObservation o;
  o.step = step;
  o.world_size = world;
  o.nodes = world;
  o.tensors = tensors;
  for (const auto& t : tensors) o.elements += t.elements;
  o.bytes_sent = k.compression ? step_sparse_bytes(tensors, std::min(k.density, k.density_cap), world)
                               : step_dense_bytes(tensors, world);
  o.exchange_s = static_cast<double>(o.bytes_sent) / bandwidth;
  o.goodput_Bps = bandwidth;
  o.compute_s = compute_s;
  return o;
}

ControllerSettings with(ControllerSet active, uint32_t world = 4) {
  ControllerSettings s;
  s.active = active;
  s.world_size = world;
  s.density_min = 1e-4;
  return s;
}

TEST(BandwidthControllerTest, TenfoldDropIsBackWithinBudgetInAFewStepsAndStays) {
  // 4 nodes, 25M parameters, compute 20 ms = the budget. At 10 GB/s the dense ring fits
  // (150 MB per node, 15 ms); at 1 GB/s (from step 40) only a sparse plan does, and density 0.05
  // (30 MB, 30 ms) does not: the controller must cap it.
  const auto tensors = model({20'000'000, 5'000'000});
  ControlKnobs base;
  base.density = 0.05;
  FakeJob job(with(bit(ControllerKind::kBandwidth)), base);
  const double budget = 0.02;
  std::optional<uint64_t> back_in_budget;
  for (uint64_t s = 0; s < 100; ++s) {
    const double bw = s < 40 ? 1e10 : 1e9;
    const auto o = link_step(s, job.at(s), tensors, 4, bw, budget);
    if (s >= 40 && !back_in_budget && o.exchange_s <= budget) back_in_budget = s;
    if (back_in_budget) {
      EXPECT_LE(o.exchange_s, budget) << "step " << s << ": over budget after recovering";
    }
    if (s < 40 && s >= 3) {
      EXPECT_FALSE(job.at(s).compression) << "the dense ring fits at 10 GB/s (step " << s << ")";
    }
    job.feed(o);
  }
  ASSERT_TRUE(back_in_budget.has_value());
  // The drop must persist (2 samples) before the estimate follows, and the plan in force be over
  // budget for 3 observations before the controller moves; the decision applies 2 steps later.
  EXPECT_LE(*back_in_budget - 40, 10u) << "reacts within a few steps";
  const ControlKnobs end = job.latest();
  EXPECT_TRUE(end.compression);
  EXPECT_LT(end.density_cap, 0.05);
  EXPECT_GE(end.density_cap, job.settings.density_min);
  EXPECT_LE(job.loop.status().predicted_exchange_s, budget * (1 - job.settings.bandwidth.margin) * 1.001);
  // Rate limit: proposals at least controller_interval_steps apart.
  for (size_t i = 1; i < job.proposal_steps.size(); ++i) {
    EXPECT_GE(job.proposal_steps[i] - job.proposal_steps[i - 1], job.settings.controller_interval_steps);
  }
  EXPECT_LE(job.proposal_steps.size(), 4u) << "no churn on a steady link";
}

TEST(BandwidthControllerTest, BandwidthRecoveryLiftsTheCapAndTheFloorHolds) {
  const auto tensors = model({10'000'000});
  ControlKnobs base;
  base.density = 0.01;
  ControllerSettings s = with(bit(ControllerKind::kBandwidth));
  s.bandwidth.exchange_budget_ms = 5;
  s.bandwidth.allow_dense = false;
  s.density_min = 0.001;
  FakeJob job(s, base);
  for (uint64_t step = 0; step < 80; ++step) {
    // 1 GB/s, then 10 MB/s (nothing but the floor fits), then 1 GB/s again: the cap climbs back
    // at most 2x per decision (bandwidth_raise_max), every bandwidth_hold_steps.
    const double bw = step < 20 ? 1e9 : step < 40 ? 1e7 : 1e9;
    job.feed(link_step(step, job.at(step), tensors, 4, bw, -1));
    if (step == 30) {
      EXPECT_EQ(job.latest().density_cap, 0.001) << "the quality floor, even over budget";
    }
  }
  EXPECT_EQ(job.latest().density_cap, 1.0) << "back to the operator's density";
  EXPECT_TRUE(job.latest().compression);
}

// A deterministic noise source (no <random>: the same numbers on every standard library).
struct Noise {
  uint64_t state;
  double uniform() {  // [0, 1)
    state = state * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<double>(state >> 11) / 9007199254740992.0;
  }
  double factor(double spread) { return std::exp(spread * (2 * uniform() - 1)); }  // log-uniform
};

TEST(BandwidthControllerTest, WaitingForSlowPeersIsNotASlowLink) {
  // A CPU-starved job: the collectives' wall time is mostly waiting for peers (10x the link
  // time, jittery), but the send completions show a 1 GB/s link on which the operator's density
  // fits the budget with room. The controller must not lower the density.
  const auto tensors = model({20'000'000, 5'000'000});
  ControlKnobs base;
  base.density = 0.01;  // 6 MB per node: 6 ms at 1 GB/s, budget 20 ms
  FakeJob job(with(bit(ControllerKind::kBandwidth)), base);
  Noise noise{7};
  for (uint64_t s = 0; s < 300; ++s) {
    JobObservation o = link_step(s, job.at(s), tensors, 4, 1e9, 0.02 * noise.factor(0.2));
    o.wall_goodput_Bps = o.goodput_Bps / (10 * noise.factor(0.7));
    o.exchange_s = static_cast<double>(o.bytes_sent) / o.wall_goodput_Bps;
    o.goodput_Bps *= noise.factor(0.3);
    job.feed(o);
    EXPECT_TRUE(job.latest().compression) << "step " << s;
    EXPECT_EQ(job.latest().density_cap, 1.0) << "step " << s << ": lowered the density for peers' waiting";
  }
  EXPECT_TRUE(job.proposal_steps.empty());
}

TEST(BandwidthControllerTest, NoisyStationaryLinkMakesAHandfulOfDecisions) {
  // 500 steps of a link whose goodput samples wander +-50 % (log-uniform) around 1 GB/s and a
  // compute time +-30 % around 20 ms, with the budget cutting into the operator's density: the
  // old controller re-fitted the cap to every sample.
  const auto tensors = model({20'000'000, 5'000'000});
  ControlKnobs base;
  base.density = 0.05;
  FakeJob job(with(bit(ControllerKind::kBandwidth)), base);
  Noise noise{42};
  double worst = 0;
  for (uint64_t s = 0; s < 500; ++s) {
    const double bw = 1e9 * noise.factor(0.4);
    JobObservation o = link_step(s, job.at(s), tensors, 4, bw, 0.02 * noise.factor(0.26));
    if (s > 20) worst = std::max(worst, static_cast<double>(o.bytes_sent) / 1e9 / 0.02);
    job.feed(o);
  }
  EXPECT_LE(job.proposal_steps.size(), 5u) << "decisions at noise";
  EXPECT_TRUE(job.latest().compression);
  EXPECT_LT(job.latest().density_cap, 0.05);
  EXPECT_LE(worst, 1.0) << "at the mean link the exchange fits the mean budget";
}

TEST(BandwidthControllerTest, FastLinkWhereDenseFitsChoosesTheDenseRing) {
  // 10 GB/s with noise: the dense ring (150 MB per node, 15 ms) fits a 20 ms budget. Starting
  // from a sparse operator plan, the controller goes dense and stays there.
  const auto tensors = model({20'000'000, 5'000'000});
  ControlKnobs base;
  base.density = 0.01;
  ControllerSettings s = with(bit(ControllerKind::kBandwidth));
  s.bandwidth.margin = 0.1;
  FakeJob job(s, base);
  Noise noise{3};
  for (uint64_t step = 0; step < 200; ++step) {
    job.feed(link_step(step, job.at(step), tensors, 4, 1.2e10 * noise.factor(0.1), 0.02));
    if (step >= 2) {
      EXPECT_FALSE(job.at(step + 1).compression) << "step " << step;
    }
  }
  EXPECT_EQ(job.proposal_steps.size(), 1u);
  EXPECT_FALSE(job.latest().compression);
}

TEST(BandwidthControllerTest, NoBudgetKnownMeansNoChange) {
  ControlKnobs base;
  FakeJob job(with(bit(ControllerKind::kBandwidth)), base);
  for (uint64_t s = 0; s < 20; ++s) {
    EXPECT_FALSE(job.feed(link_step(s, job.at(s), model({1000000}), 4, 1e6, /*compute unknown*/ -1)));
  }
}

// A plant whose loss falls behind a target when the density is below 0.004.
double plant_gap(double density) { return density >= 0.004 ? 0.005 : 0.2 * (0.004 - density) / 0.004 + 0.005; }

TEST(AccuracyControllerTest, BacksOffWhenBehindTightensWhenOnTrackWithinBounds) {
  ControlKnobs base;
  base.density = 0.0005;  // pushed too hard
  ControllerSettings s = with(bit(ControllerKind::kAccuracy));
  s.density_max = 0.05;
  FakeJob job(s, base);
  std::vector<uint64_t> moves;
  double last = base.density;
  for (uint64_t step = 0; step < 300; ++step) {
    const ControlKnobs k = job.at(step);
    JobObservation o;
    o.step = step;
    o.has_loss = true;
    o.has_loss_target = true;
    o.loss_target = 1.0 + 10.0 / (step + 1.0);
    o.loss = o.loss_target * (1 + plant_gap(k.density));
    job.feed(o);
    EXPECT_LE(job.latest().density, s.density_max);
    EXPECT_GE(job.latest().density, s.density_min);
    if (job.latest().density != last) {
      moves.push_back(step);
      last = job.latest().density;
    }
    if (step == 40) {
      EXPECT_GE(job.at(step).density, 0.004) << "backed off within 40 steps";
    }
  }
  EXPECT_LT(std::fabs(job.loop.status().accuracy_gap), s.accuracy.tolerance) << "gap recovered";
  // Hysteresis: it settles near the boundary instead of flapping every hold period.
  for (size_t i = 1; i < moves.size(); ++i) EXPECT_GE(moves[i] - moves[i - 1], s.accuracy.hold_steps);
  EXPECT_LT(moves.size(), 60u);
}

TEST(AccuracyControllerTest, TargetFromTheDenseWarmupTrend) {
  ControlKnobs base;
  base.density = 0.01;
  ControllerSettings s = with(bit(ControllerKind::kAccuracy));
  s.schedule_warmup_steps = 10;
  FakeJob job(s, base);
  for (uint64_t step = 0; step < 60; ++step) {
    JobObservation o;
    o.step = step;
    o.has_loss = true;
    const double trend = 0.3 + 2.0 / (step + 1.0);
    o.loss = step < 30 ? trend : trend * 1.2;  // degrades at step 30
    job.feed(o);
    if (step == 25) {
      EXPECT_NEAR(job.loop.status().accuracy_target, trend, 1e-9) << "fitted a + b/(t+1)";
      EXPECT_LE(job.latest().density, base.density) << "on track: no back-off";
    }
  }
  EXPECT_GT(job.latest().density, base.density) << "a degrading loss backs compression off";
}

// A plant for the compression error: with error feedback at density d the residual holds about
// `c / sqrt(d)` times the step's gradient (more compression, more owed), c set by the regime.
JobObservation error_step(uint64_t step, const ControlKnobs& k, double c) {
  JobObservation o;
  o.step = step;
  o.grad_norm2 = 4.0;  // ||g|| = 2
  const double rho = c / std::sqrt(k.density);
  o.residual_norm2 = rho * rho * o.grad_norm2;
  return o;
}

TEST(AccuracyControllerTest, CompressionErrorIsKeptUnderItsCalibratedBoundWithoutAMetric) {
  ControlKnobs base;
  base.density = 0.01;
  ControllerSettings s = with(bit(ControllerKind::kAccuracy));
  s.density_max = 0.5;
  FakeJob job(s, base);
  const double c0 = 0.5;  // rho = 5 at the base density
  for (uint64_t step = 0; step < 300; ++step) {
    const double c = step < 100 ? c0 : 2 * c0;  // the regime doubles the error at step 100
    job.feed(error_step(step, job.at(step), c));
    if (step == 99) {
      EXPECT_EQ(job.at(step).density, base.density) << "on budget, and no metric: it never tightens";
    }
  }
  const ControlStatus& st = job.loop.status();
  EXPECT_EQ(st.accuracy_signal, "compression error");
  // Calibrated over the first calibrate_steps at the base density: 1.5 x 5.
  EXPECT_NEAR(st.compression_error_bound, s.accuracy.error_margin * c0 / std::sqrt(base.density), 1e-9);
  // Back under the bound: rho = 2 c0 / sqrt(d) <= 7.5 needs d >= (1 / 7.5)^2 = 0.0178; backing off
  // doubles the density per move, so it lands on 0.02 (0.04 would be one move too many).
  EXPECT_NEAR(job.latest().density, 0.02, 1e-12);
  EXPECT_LE(st.compression_error, st.compression_error_bound);
  for (const auto& [eff, k] : job.decisions) EXPECT_GE(k.density, base.density);
}

TEST(AccuracyControllerTest, TightensWhileTheMetricKeepsPaceAndBacksOffWhenItFallsBehind) {
  ControlKnobs base;
  base.density = 0.01;
  ControllerSettings s = with(bit(ControllerKind::kAccuracy));
  s.accuracy.error_bound = 100;  // the error never binds here: the metric decides
  FakeJob job(s, base);
  double before = 0, peak_after = 0;
  for (uint64_t step = 0; step < 260; ++step) {
    JobObservation o = error_step(step, job.at(step), 0.5);
    o.has_loss = true;
    // On its trend until step 200; then 20 % worse than that trend.
    o.loss = (0.2 + 1.0 / (1.0 + 0.05 * static_cast<double>(step))) * (step < 200 ? 1.0 : 1.2);
    job.feed(o);
    if (step == 199) before = job.latest().density;
    if (step >= 200 && step < 230) peak_after = std::max(peak_after, job.latest().density);
  }
  EXPECT_EQ(job.loop.status().accuracy_signal, "compression error");
  EXPECT_LT(before, base.density) << "on track: tightened";
  // Behind its trend (the last 20 reports' mean over the 20 before by more than the tolerance)
  // within 30 steps: at least two back-offs (one per hold period) while the window straddles it.
  EXPECT_GE(peak_after, before * s.accuracy.backoff * s.accuracy.backoff * 0.99);
}

TEST(AccuracyControllerTest, WithoutAnySignalItHoldsAndSaysWhy) {
  ControlKnobs base;
  base.density = 0.01;
  FakeJob job(with(bit(ControllerKind::kAccuracy)), base);
  for (uint64_t step = 0; step < 50; ++step) {
    JobObservation o;
    o.step = step;  // no gradient norms, no metric, no warm-up fit
    EXPECT_FALSE(job.feed(o));
  }
  EXPECT_EQ(job.loop.status().accuracy_signal.rfind("none: ", 0), 0u) << job.loop.status().accuracy_signal;
  EXPECT_EQ(job.latest().density, base.density);
}

TEST(AccuracyControllerTest, MovesOnlyWhatTheSelectorReads) {
  // Top-k reads the density: lambda stays (v1 moved it too: decisions that did nothing).
  ControlKnobs topk;
  topk.density = 0.01;
  topk.threshold = 0.05;
  ControllerSettings s = with(bit(ControllerKind::kAccuracy));
  s.accuracy.error_bound = 1.0;  // rho = 5: always over, it backs off
  FakeJob a(s, topk);
  for (uint64_t step = 0; step < 40; ++step) a.feed(error_step(step, a.at(step), 0.5));
  EXPECT_GT(a.latest().density, topk.density);
  for (const auto& [eff, k] : a.decisions) EXPECT_EQ(k.threshold, topk.threshold);
  // The hard threshold reads lambda: backing off divides it; the density knob stays.
  ControlKnobs thr = topk;
  thr.selector = kernels::Selector::kThreshold;
  FakeJob b(s, thr);
  for (uint64_t step = 0; step < 40; ++step) {
    JobObservation o;
    o.step = step;
    o.grad_norm2 = 1.0;
    o.residual_norm2 = 25.0;  // rho = 5 whatever lambda: over the bound of 1
    b.feed(o);
  }
  EXPECT_LT(b.latest().threshold, thr.threshold);
  for (const auto& [eff, k] : b.decisions) EXPECT_EQ(k.density, thr.density);
}

TEST(BudgetControllerTest, LandsWithin5PercentOfTheRunBudgetAndExportsTotalError) {
  // Plant: with error feedback the steady-state volume of a hard threshold is ~ C / lambda.
  const double C = 2e4;  // per node: nnz = C / lambda
  ControlKnobs base;
  base.threshold = 0.01;  // 10x too low: would send 2e6 per step
  ControllerSettings s = with(bit(ControllerKind::kBudget));
  s.budget.total_elements = 4e7;
  s.budget.steps = 400;  // 1e5 per step -> lambda 0.2
  FakeJob job(s, base);
  double sent = 0, error = 0;
  for (uint64_t step = 0; step < s.budget.steps; ++step) {
    const ControlKnobs k = job.at(step);
    JobObservation o;
    o.step = step;
    o.world_size = 4;
    ASSERT_EQ(k.selector, step < 2 ? kernels::Selector::kTopk : kernels::Selector::kThreshold);
    const double wobble = 1.0 + 0.1 * std::sin(0.3 * static_cast<double>(step));
    o.nnz = k.selector == kernels::Selector::kThreshold ? C / k.threshold * wobble : 0.01 * 1e7;
    o.residual_norm2 = k.threshold * k.threshold * 1e3;
    sent += o.nnz;
    error += o.residual_norm2;
    job.feed(o);
  }
  EXPECT_LT(std::fabs(sent - s.budget.total_elements) / s.budget.total_elements, 0.05) << sent;
  EXPECT_NEAR(job.loop.status().total_error, error, 1e-6 * error);
  EXPECT_NEAR(job.loop.status().budget_used_elements, sent, 1e-6 * sent);
  // Without histograms (v1's loop) every move is bounded too: at most budget_max_move (2x).
  for (size_t i = 1; i < job.decisions.size(); ++i) {
    const double r = job.decisions[i].second.threshold / job.decisions[i - 1].second.threshold;
    EXPECT_LE(r, 2.0 + 1e-9) << "decision " << i;
    EXPECT_GE(r, 0.5 - 1e-9) << "decision " << i;
  }
  // "Slowly" once calibrated: the last 300 steps change lambda by at most 20 % a time.
  for (size_t i = 1; i < job.decisions.size(); ++i) {
    if (job.decisions[i].first < 100) continue;
    const double r = job.decisions[i].second.threshold / job.decisions[i - 1].second.threshold;
    EXPECT_LE(r, 1.2 + 1e-9);
    EXPECT_GE(r, 1 / 1.2 - 1e-9);
  }
}

TEST(GradNormControllerTest, JumpBoostsSteadyRelaxes) {
  ControlKnobs base;
  base.density = 0.01;
  ControllerSettings s = with(bit(ControllerKind::kGradNorm));
  s.gradnorm.window = 10;
  s.gradnorm.boost_steps = 10;
  FakeJob job(s, base);
  auto feed = [&](uint64_t step, double norm) {
    JobObservation o;
    o.step = step;
    o.grad_norm2 = norm * norm;
    job.feed(o);
  };
  for (uint64_t t = 0; t < 30; ++t) feed(t, 1.0 + 0.001 * (t % 3));  // small and steady
  EXPECT_NEAR(job.latest().density, 0.005, 1e-12) << "steady -> sparser";
  feed(30, 5.0);  // LR change: the norm jumps
  EXPECT_NEAR(job.latest().density, 0.04, 1e-12) << "jump -> 4x density at once";
  for (uint64_t t = 31; t < 40; ++t) feed(t, 5.0 - 0.3 * (t - 30));
  EXPECT_NEAR(job.latest().density, 0.04, 1e-12) << "boost lasts boost_steps";
  for (uint64_t t = 40; t < 46; ++t) feed(t, 2.0 + 0.2 * (t % 2));
  EXPECT_NEAR(job.latest().density, 0.01, 1e-12) << "then back to the base density";
}

TEST(FrequencyControllerTest, OftenReselectedTensorsGetMoreDensityBounded) {
  ControlKnobs base;
  ControllerSettings s = with(bit(ControllerKind::kFrequency));
  s.frequency.max_scale = 4;
  FakeJob job(s, base);
  for (uint64_t t = 0; t < 30; ++t) {
    JobObservation o;
    o.step = t;
    o.tensors = {{0, 1000000, 10000, 0.9}, {1, 1000000, 10000, 0.3}, {2, 1000000, 10000, 0.001}};
    job.feed(o);
  }
  const auto& sc = job.latest().tensor_scale;
  ASSERT_EQ(sc.size(), 3u);
  EXPECT_GT(sc.at(0), 1.0);
  EXPECT_LT(sc.at(2), 1.0);
  EXPECT_GE(sc.at(2), 0.25) << "bounded by 1/frequency_max_scale";
  EXPECT_LE(sc.at(0), 4.0);
}

TEST(CostControllerTest, DenseRingAboveOneOverWSparseBelowExactSizes) {
  // Sparse all-gather costs (W-1)(80 + 8k); the ring 2(W-1)(80 + 4n/W): break-even k/n ~ 1/W.
  const auto tensors = model({1 << 20});
  EXPECT_EQ(sparse_allgather_bytes(1 << 20, 1000, 8, nullptr), 7u * (80 + 8000));
  EXPECT_EQ(ring_allreduce_bytes(1 << 20, 8), 14u * (80 + 4 * (1 << 17)));
  for (double d : {0.001, 0.05, 0.3}) {
    ControlKnobs base;
    base.density = d;
    FakeJob job(with(bit(ControllerKind::kCost), 8), base);
    for (uint64_t s = 0; s < 5; ++s) job.feed(link_step(s, job.at(s), tensors, 8, 1e9, -1));
    EXPECT_EQ(job.latest().compression, d < 1.0 / 8) << "density " << d;
    kernels::Format best = kernels::Format::kDense;
    sparse_allgather_bytes(1 << 20, static_cast<uint64_t>(d * (1 << 20)), 8, &best);
    if (d < 1.0 / 8) {
      EXPECT_EQ(job.latest().format, best) << "the smallest exact encoding";
    }
  }
}

TEST(ControlLoopTest, SwitchingAControllerOffRevertsToTheOperatorKnobs) {
  const auto tensors = model({20'000'000});
  ControlKnobs base;
  base.density = 0.05;
  FakeJob job(with(bit(ControllerKind::kBandwidth)), base);
  for (uint64_t s = 0; s < 10; ++s) job.feed(link_step(s, job.at(s), tensors, 4, 1e7, 0.05));
  ASSERT_LT(job.latest().density_cap, 1.0);
  job.settings.active = 0;  // controller = static
  for (uint64_t s = 10; s < 14; ++s) job.feed(link_step(s, job.at(s), tensors, 4, 1e7, 0.05));
  EXPECT_EQ(job.latest(), base);
}

TEST(ControlLoopTest, AFailingControllerFallsBackToStaticOnce) {
  ControlKnobs base;
  base.threshold = 0;  // the budget controller cannot scale a zero lambda: its output is invalid
  ControllerSettings s = with(bit(ControllerKind::kBudget));
  s.budget.total_elements = 1e6;
  s.budget.steps = 100;
  FakeJob job(s, base);
  JobObservation o;
  o.nnz = 1e5;
  // First step: the controller's proposal is rejected (threshold 0 is out of range).
  auto p = job.feed(o);
  EXPECT_TRUE(job.loop.status().failed);
  EXPECT_NE(job.loop.status().failure.find("budget"), std::string::npos) << job.loop.status().failure;
  EXPECT_FALSE(p.has_value()) << "in force == base: nothing to undo";
  for (uint64_t step = 1; step < 10; ++step) {
    o.step = step;
    EXPECT_FALSE(job.feed(o).has_value());
  }
}

TEST(ControlLoopTest, SameObservationsSameDecisions) {
  auto run = [] {
    const auto tensors = model({3'000'000, 100'000});
    ControlKnobs base;
    base.density = 0.02;
    ControllerSettings s =
        with(bit(ControllerKind::kBandwidth) | bit(ControllerKind::kGradNorm) | bit(ControllerKind::kCost));
    FakeJob job(s, base);
    for (uint64_t step = 0; step < 80; ++step) {
      auto o = link_step(step, job.at(step), tensors, 4, step < 30 ? 5e8 : 5e7, 0.02);
      o.grad_norm2 = 1.0 + (step == 50 ? 30 : 0);
      job.feed(o);
    }
    return job.decisions;
  };
  auto a = run(), b = run();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].first, b[i].first);
    EXPECT_EQ(a[i].second, b[i].second);
  }
}

TEST(MergeTest, GoodputFromCompletionsNotWallTime) {
  NodeObservation a, b;
  a.bytes_sent = b.bytes_sent = 1'000'000;
  a.exchange_s = 0.5;  // mostly waiting for b
  b.exchange_s = 0.01;
  a.link_bytes = 900'000;
  a.link_s = 0.001;  // 900 MB/s while its sends were in flight
  b.link_bytes = 1'000'000;
  b.link_s = 0.002;  // 500 MB/s: the slower link
  NodeObservation both[] = {a, b};
  JobObservation j = merge_observations(both, 2);
  EXPECT_DOUBLE_EQ(j.goodput_Bps, 5e8);
  EXPECT_DOUBLE_EQ(j.wall_goodput_Bps, 2e6);
}

TEST(MergeTest, SlowestNodeAndSums) {
  NodeObservation a, b;
  a.step = b.step = 7;
  a.bytes_sent = 1000;
  a.exchange_s = 0.001;  // 1 MB/s
  b.bytes_sent = 1000;
  b.exchange_s = 0.01;  // 100 kB/s: the slow link
  a.nnz = 10;
  b.nnz = 30;
  a.residual_norm2 = 1;
  b.residual_norm2 = 2;
  a.has_loss = true;
  a.loss = 3;
  a.tensors = {{0, 100, 10, 0.5}};
  b.tensors = {{0, 100, 30, -1}};
  NodeObservation both[] = {a, b};
  JobObservation j = merge_observations(both, 2);
  EXPECT_EQ(j.step, 7u);
  EXPECT_EQ(j.nodes, 2u);
  EXPECT_DOUBLE_EQ(j.goodput_Bps, 0) << "no completion-based sample: unknown";
  EXPECT_DOUBLE_EQ(j.wall_goodput_Bps, 1e5);
  EXPECT_DOUBLE_EQ(j.exchange_s, 0.01);
  EXPECT_DOUBLE_EQ(j.nnz, 20);
  EXPECT_DOUBLE_EQ(j.residual_norm2, 3);
  EXPECT_TRUE(j.has_loss);
  EXPECT_DOUBLE_EQ(j.loss, 3);
  ASSERT_EQ(j.tensors.size(), 1u);
  EXPECT_EQ(j.tensors[0].nnz, 20u);
  EXPECT_DOUBLE_EQ(j.tensors[0].repeat_fraction, 0.5);
}

// The registry: every kind once, unique names; the job-level rows make a controller of their own
// kind and are chained in the documented order (docs/controllers.md, controllers.h).
TEST(ControllerRegistryTest, EveryKindOnceAndTheChainInItsDocumentedOrder) {
  std::set<uint32_t> kinds;
  std::set<std::string> names;
  std::vector<std::string> chain;
  for (const ControllerInfo& row : controller_registry()) {
    SCOPED_TRACE(row.name);
    EXPECT_TRUE(kinds.insert(static_cast<uint32_t>(row.kind)).second);
    EXPECT_TRUE(names.insert(row.name).second);
    EXPECT_EQ(find_controller(row.kind), &row);
    EXPECT_EQ(controller_name(row.kind), row.name);
    std::unique_ptr<Controller> c = make_controller(row.kind);
    EXPECT_EQ(c != nullptr, row.job_level);
    if (c) {
      EXPECT_EQ(c->kind(), row.kind);
      chain.push_back(row.name);
    }
  }
  EXPECT_EQ(kinds.size(), kControllerKindCount);
  EXPECT_EQ(chain,
            (std::vector<std::string>{"accuracy", "gradnorm", "budget", "frequency", "bandwidth", "step", "cost"}));
  EXPECT_EQ(controller_choices(), "static|schedule|layerwise|gradnorm|frequency|bandwidth|accuracy|budget|cost|step");
  auto bad = parse_controllers("bogus");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find(
                "(known: static, schedule, layerwise, gradnorm, frequency, bandwidth, accuracy, budget, cost, step)"),
            std::string::npos)
      << bad.status().message();
}

// The set rank 0 measures for (daemon/pipeline/observations.cc) is the rows that make a
// controller, the seven of the chain above, and none of the per-tensor ones.
TEST(ControllerRegistryTest, JobLevelSetIsTheKindsThatMakeAController) {
  ControllerSet made = 0;
  for (uint32_t i = 0; i < kControllerKindCount; ++i) {
    if (make_controller(static_cast<ControllerKind>(i)) != nullptr) made |= ControllerSet{1} << i;
  }
  EXPECT_EQ(job_level_controllers(), made);
  EXPECT_EQ(job_level_controllers(), *parse_controllers("accuracy,gradnorm,budget,frequency,bandwidth,step,cost"));
}

}  // namespace
}  // namespace sparsecar::policies
