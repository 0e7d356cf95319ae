// The accuracy controller (v2): a density multiplier that keeps a quality signal in bounds. Its
// row: controllers.cc; what it does: docs/controllers.md.
//
// The signal, the first one the observations carry:
//   "loss target"        the trainer reports `<metric>_target`: the relative gap of the metric to
//                        it (v1's rule: back off above `tolerance`, tighten below half of it).
//   "compression error"  rho = ||e|| / ||g||, the residual after the step against the step's
//                        gradient (summed over nodes): how much gradient error feedback still
//                        owes. Kept under `error_bound` (0: calibrated, `error_margin` x its mean
//                        over the first `calibrate_steps` observations at the operator's
//                        density): above it, back off. It tightens only while the reported
//                        metric keeps pace with its own recent trend (the mean of its last 20
//                        reports at most tolerance / 2 above the mean of the 20 before) and rho
//                        has room (< 0.8 x the bound); without a reported metric it never
//                        tightens. A metric that falls behind (more than `tolerance` above) backs
//                        off too.
//   "loss trend"         no gradient norms but a dense warm-up (`schedule_warmup_steps`): the gap
//                        to the fit a + b / (t + 1) of the warm-up's metric (v1).
//   "none: <why>"        nothing usable: the multiplier stays where it is (ControlStatus says so;
//                        the daemon logs it once).
// The multiplier acts on what the selector reads: the density (top-k and the other density
// selectors) or lambda (hard threshold, divided); a selector reading neither is a "none".
#include "controller_internal.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "sparsecar/kernels/selectors.h"

namespace sparsecar::policies {
namespace {

class AccuracyController final : public Controller {
 public:
  ControllerKind kind() const override { return ControllerKind::kAccuracy; }
  uint32_t version() const override { return 2; }
  Status update(const ControlContext& ctx, ControlKnobs* knobs) override {
    const auto& s = ctx.settings;
    const auto& o = ctx.obs;
    const kernels::SelectorInfo* row = kernels::find_selector(knobs->selector);
    const uint32_t reads = row == nullptr ? 0 : row->params;
    const bool on_density = (reads & kernels::param_bit(kernels::SelectorParam::kDensity)) != 0;
    const bool on_threshold = (reads & kernels::param_bit(kernels::SelectorParam::kThreshold)) != 0;
    const bool has_metric = o.has_loss && std::isfinite(o.loss);
    if (has_metric) track_metric(o.loss);

    int want = 0;  // -1 tighten, +1 back off, 0 hold
    std::string signal;
    if (!on_density && !on_threshold) {
      signal = "none: selector '" + std::string(kernels::selector_name(knobs->selector)) +
               "' reads neither a density nor a threshold";
    } else if (has_metric && o.has_loss_target && std::isfinite(o.loss_target)) {
      signal = "loss target";
      want = from_gap(o.loss, o.loss_target, ctx);
    } else if (o.grad_norm2 > 0 && std::isfinite(o.grad_norm2) && std::isfinite(o.residual_norm2)) {
      signal = "compression error";
      want = from_error(std::sqrt(o.residual_norm2 / o.grad_norm2), has_metric, ctx);
    } else if (has_metric && s.schedule_warmup_steps > 0) {
      signal = "loss trend";
      if (o.step < s.schedule_warmup_steps) {
        warm_.emplace_back(static_cast<double>(o.step), o.loss);
      } else {
        fit_trend();
        if (fitted_) want = from_gap(o.loss, a_ + b_ / (static_cast<double>(o.step) + 1.0), ctx);
      }
    } else {
      signal = "none: no gradient norms observed and no metric target reported";
    }
    ctx.status->accuracy_signal = signal;

    if (want != 0 && (!moved_ || o.step >= last_move_ + s.accuracy.hold_steps)) {
      double next = multiplier_ * (want > 0 ? s.accuracy.backoff : s.accuracy.tighten);
      // Bounds: the density this multiplier gives stays within [density_min, density_max].
      const double d0 = std::max(ctx.base.density, 1e-12);
      next = std::clamp(next, s.density_min / d0, s.density_max / d0);
      if (next != multiplier_) {
        multiplier_ = next;
        moved_ = true;
        last_move_ = o.step;
      }
    }
    if (on_density) knobs->density = clamp_density(knobs->density * multiplier_, s);
    if (on_threshold) knobs->threshold /= multiplier_;
    return Status::Ok();
  }

 private:
  // v1's rule on a relative gap to a target: +1 above the tolerance, -1 below half of it.
  int from_gap(double metric, double target, const ControlContext& ctx) {
    const auto& s = ctx.settings;
    const double gap = (metric - target) / std::max(std::fabs(target), 1e-12);
    gap_ = has_gap_ ? s.accuracy.alpha * gap + (1 - s.accuracy.alpha) * gap_ : gap;
    has_gap_ = true;
    ctx.status->accuracy_gap = gap_;
    ctx.status->accuracy_target = target;
    if (gap_ > s.accuracy.tolerance) return 1;
    if (gap_ < s.accuracy.tolerance / 2) return -1;
    return 0;
  }

  int from_error(double rho, bool has_metric, const ControlContext& ctx) {
    const auto& s = ctx.settings;
    rho_ = has_rho_ ? s.accuracy.alpha * rho + (1 - s.accuracy.alpha) * rho_ : rho;
    has_rho_ = true;
    ctx.status->compression_error = rho_;
    double bound = s.accuracy.error_bound;
    if (!(bound > 0)) {
      if (calibrated_ < s.accuracy.calibrate_steps) {  // at the operator's density: no move yet
        calibration_sum_ += rho;
        ++calibrated_;
        ctx.status->compression_error_bound = 0;
        return 0;
      }
      bound = s.accuracy.error_margin * calibration_sum_ / static_cast<double>(calibrated_);
    }
    ctx.status->compression_error_bound = bound;
    const double pace = has_metric ? metric_pace() : 0;  // recent over earlier, relative; 0 unknown
    if (rho_ > bound || pace > s.accuracy.tolerance) return 1;
    if (has_metric && metric_.size() == 2 * kHalf && pace <= s.accuracy.tolerance / 2 && rho_ < 0.8 * bound) return -1;
    return 0;
  }

  // The metric's last 2 x kHalf reports: the recent half against the earlier one.
  void track_metric(double metric) {
    metric_.push_back(metric);
    if (metric_.size() > 2 * kHalf) metric_.pop_front();
  }
  // (mean of the recent half - mean of the earlier half) / |earlier|: > 0 when the metric got
  // worse (lower is better); 0 until the window is full.
  double metric_pace() const {
    if (metric_.size() < 2 * kHalf) return 0;
    double earlier = 0, recent = 0;
    for (size_t i = 0; i < kHalf; ++i) {
      earlier += metric_[i];
      recent += metric_[kHalf + i];
    }
    return (recent - earlier) / std::max(std::fabs(earlier), 1e-12);
  }

  // Least squares of metric = a + b / (t + 1) over the dense warm-up.
  void fit_trend() {
    if (fitted_ || warm_.size() < 3) return;
    double sx = 0, sy = 0, sxx = 0, sxy = 0;
    const double n = static_cast<double>(warm_.size());
    for (auto [t, y] : warm_) {
      const double x = 1.0 / (t + 1.0);
      sx += x;
      sy += y;
      sxx += x * x;
      sxy += x * y;
    }
    const double den = n * sxx - sx * sx;
    if (std::fabs(den) < 1e-300) return;
    b_ = (n * sxy - sx * sy) / den;
    a_ = (sy - b_ * sx) / n;
    fitted_ = std::isfinite(a_) && std::isfinite(b_);
  }

  static constexpr size_t kHalf = 20;  // reports per half of the metric's window

  double multiplier_ = 1.0;
  bool moved_ = false;
  uint64_t last_move_ = 0;
  // loss target / loss trend
  double gap_ = 0;
  bool has_gap_ = false;
  std::vector<std::pair<double, double>> warm_;
  bool fitted_ = false;
  double a_ = 0, b_ = 0;
  // compression error
  double rho_ = 0;
  bool has_rho_ = false;
  uint64_t calibrated_ = 0;
  double calibration_sum_ = 0;
  // the metric's own trend
  std::deque<double> metric_;
};

}  // namespace

std::unique_ptr<Controller> make_accuracy_controller() { return std::make_unique<AccuracyController>(); }

}  // namespace sparsecar::policies
