// The bandwidth controller: a density cap, or the dense ring, so that the exchange fits the
// time budget at the estimated link goodput. Its row: controllers.cc.
#include "controller_internal.h"

#include <algorithm>
#include <cmath>
#include <memory>

namespace sparsecar::policies {
namespace {

// 3 significant digits, rounded down: proposals stay readable and do not creep.
double round_down3(double v) {
  if (!(v > 0) || !std::isfinite(v)) return v;
  const double p = std::pow(10.0, std::floor(std::log10(v)) - 2);
  return std::floor(v / p) * p;
}

// Fits the exchange into the budget (a fixed one, or a fraction of the trainer's compute time)
// at the link goodput the loop estimated from send completions. Damped so that it cannot flap:
//   - the budget (from a noisy compute time) is smoothed like the goodput;
//   - it moves only after `bandwidth_confirm_steps` consecutive observations in which the plan in
//     force is predicted over the budget (lower), or in which a plan at least 2 x hysteresis
//     denser (or the dense ring) fits the aim of (1 - margin) x budget (raise) — a dead band
//     between the two, so an estimate wobbling around the aim does nothing;
//   - at least `bandwidth_hold_steps` between decisions, and a decision moves the cap by at most
//     bandwidth_raise_max up / bandwidth_lower_max down;
//   - the dense ring whenever it fits the aim (or is cheaper than any allowed sparse plan).
// The first decision (nothing in force to flap against) goes straight to the fitting plan.
class BandwidthController final : public Controller {
 public:
  ControllerKind kind() const override { return ControllerKind::kBandwidth; }
  uint32_t version() const override { return 2; }
  Status update(const ControlContext& ctx, ControlKnobs* knobs) override {
    const auto& s = ctx.settings;
    const auto& o = ctx.obs;
    double budget_sample = 0;
    if (s.bandwidth.exchange_budget_ms > 0) {
      budget_sample = s.bandwidth.exchange_budget_ms / 1e3;
    } else if (o.compute_s > 0) {
      budget_sample = o.compute_s * s.bandwidth.exchange_budget_fraction;
    }
    // Decisions look at slow averages (a third of the loop's EMA weight) of the loop's goodput
    // estimate and of the budget: a stationary link's noise averages out, and a step change of
    // the link (the loop's estimate moved 2x) is taken at once.
    const double slow = std::clamp(s.goodput_smoothing / 3, 1e-3, 1.0);
    if (budget_sample > 0) {
      const bool computed = s.bandwidth.exchange_budget_ms <= 0;  // from the noisy compute time
      budget_ = budget_ > 0 && computed ? smooth(budget_, budget_sample, slow) : budget_sample;
    }
    if (ctx.goodput_Bps > 0) {
      goodput_ = goodput_ > 0 && ctx.goodput_Bps < goodput_ * 2 && ctx.goodput_Bps > goodput_ / 2
                     ? smooth(goodput_, ctx.goodput_Bps, slow)
                     : ctx.goodput_Bps;
    }
    const double budget = budget_;
    ctx.status->exchange_budget_s = budget;
    if (!init_) {
      init_ = true;
      dense_ = !knobs->compression;
    }
    const double g = goodput_;
    if (budget <= 0 || g <= 0 || o.tensors.empty() || s.world_size < 2) return apply(knobs);
    const double target = budget * (1 - s.bandwidth.margin);
    const uint32_t w = s.world_size;
    const double dense_s = static_cast<double>(step_dense_bytes(o.tensors, w)) / g;
    if (knobs->selector == kernels::Selector::kThreshold) {
      // Lambda: nnz ~ 1/lambda, so scale lambda by how far the measured volume is over.
      const double now_s = static_cast<double>(o.bytes_sent) / g;
      knobs->compression = true;
      if (now_s > target) knobs->threshold *= now_s / target;
      ctx.status->predicted_exchange_s = std::min(now_s, target);
      return Status::Ok();
    }
    // Predict in the format that will be sent (the cost controller may change it afterwards).
    auto time_at = [&](double d) { return static_cast<double>(step_sparse_bytes(o.tensors, d, w, knobs->format)) / g; };
    const double desired = std::min(knobs->density, s.density_max);
    const double floor = std::min(s.density_min, desired);
    // The densest sparse plan that fits the aim (the floor when none does).
    double fit = desired;
    if (time_at(desired) > target) {
      double lo = floor, hi = desired;
      if (time_at(lo) > target) {
        hi = lo;
      } else {
        for (int i = 0; i < 50; ++i) {
          const double mid = std::sqrt(lo * hi);
          (time_at(mid) <= target ? lo : hi) = mid;
        }
        hi = lo;
      }
      fit = std::max(round_down3(hi), floor);
    }
    const bool dense_fits = s.bandwidth.allow_dense && (dense_s <= target || time_at(fit) >= dense_s);
    const double held = std::min(desired, cap_);
    const double held_s = dense_ ? dense_s : time_at(held);
    const bool over = held_s > budget && (dense_ ? true : held > floor || dense_fits);
    const bool room = !dense_ && (dense_fits || fit > held * (1 + 2 * s.controller_hysteresis));
    over_ = over ? over_ + 1 : 0;
    room_ = room ? room_ + 1 : 0;
    const bool first = !decided_;
    const bool may = first || o.step >= last_decision_step_ + s.bandwidth.hold_steps;
    const uint64_t confirm = first ? 1 : std::max<uint64_t>(s.bandwidth.confirm_steps, 1);
    if (may && (over_ >= confirm || room_ >= confirm)) {
      if (dense_fits) {
        dense_ = true;
        cap_ = 1.0;
      } else if (dense_ || first) {
        dense_ = false;
        cap_ = fit >= desired ? 1.0 : fit;
      } else {
        // Bounded move from the density in force towards the fitting one.
        double next = std::clamp(fit, held / std::max(s.bandwidth.lower_max, 1.0),
                                 held * std::max(s.bandwidth.raise_max, 1.0));
        next = std::max(round_down3(next), floor);
        cap_ = next >= desired ? 1.0 : next;
      }
      decided_ = true;
      last_decision_step_ = o.step;
      over_ = room_ = 0;
    }
    return apply(knobs, decided_ ? (dense_ ? dense_s : time_at(std::min(desired, cap_))) : held_s, ctx.status);
  }

 private:
  // The plan in force for this controller (nothing until its first decision).
  Status apply(ControlKnobs* knobs, double predicted_s = 0, ControlStatus* status = nullptr) const {
    if (!decided_) return Status::Ok();
    knobs->compression = !dense_;
    knobs->density_cap = dense_ ? 1.0 : cap_;
    if (status) status->predicted_exchange_s = predicted_s;
    return Status::Ok();
  }

  static double smooth(double mean, double sample, double alpha) {
    return std::exp(alpha * std::log(sample) + (1 - alpha) * std::log(mean));
  }

  bool init_ = false;
  bool decided_ = false;
  bool dense_ = false;
  double cap_ = 1.0;
  double budget_ = 0;   // smoothed
  double goodput_ = 0;  // smoothed again
  uint64_t over_ = 0, room_ = 0;
  uint64_t last_decision_step_ = 0;
};

}  // namespace

std::unique_ptr<Controller> make_bandwidth_controller() { return std::make_unique<BandwidthController>(); }

}  // namespace sparsecar::policies
