// The accuracy controller: a density multiplier from the reported metric against a target
// (the trainer's `<metric>_target`, else a fit of the dense warm-up). Its row: controllers.cc.
#include "controller_internal.h"

#include <algorithm>
#include <cmath>
#include <memory>
#include <utility>
#include <vector>

namespace sparsecar::policies {
namespace {

class AccuracyController final : public Controller {
 public:
  ControllerKind kind() const override { return ControllerKind::kAccuracy; }
  uint32_t version() const override { return 1; }
  Status update(const ControlContext& ctx, ControlKnobs* knobs) override {
    const auto& s = ctx.settings;
    const auto& o = ctx.obs;
    if (o.has_loss && std::isfinite(o.loss)) {
      double target = 0;
      bool has_target = false;
      if (o.has_loss_target && std::isfinite(o.loss_target)) {
        target = o.loss_target;
        has_target = true;
      } else if (s.schedule_warmup_steps > 0) {
        if (o.step < s.schedule_warmup_steps) {
          warm_.emplace_back(static_cast<double>(o.step), o.loss);
        } else {
          fit_trend();
          if (fitted_) {
            target = a_ + b_ / (static_cast<double>(o.step) + 1.0);
            has_target = true;
          }
        }
      }
      if (has_target) {
        const double gap = (o.loss - target) / std::max(std::fabs(target), 1e-12);
        gap_ = has_gap_ ? s.accuracy.alpha * gap + (1 - s.accuracy.alpha) * gap_ : gap;
        has_gap_ = true;
        ctx.status->accuracy_gap = gap_;
        ctx.status->accuracy_target = target;
        if (!moved_ || o.step >= last_move_ + s.accuracy.hold_steps) {
          double next = multiplier_;
          if (gap_ > s.accuracy.tolerance) {
            next *= s.accuracy.backoff;
          } else if (gap_ < s.accuracy.tolerance / 2) {
            next *= s.accuracy.tighten;
          }
          // Bounds: the density this multiplier gives stays within [density_min, density_max].
          const double d0 = std::max(ctx.base.density, 1e-12);
          next = std::clamp(next, s.density_min / d0, s.density_max / d0);
          if (next != multiplier_) {
            multiplier_ = next;
            moved_ = true;
            last_move_ = o.step;
          }
        }
      }
    }
    knobs->density = clamp_density(knobs->density * multiplier_, s);
    knobs->threshold /= multiplier_;
    return Status::Ok();
  }

 private:
  // Least squares of loss = a + b / (t + 1) over the dense warm-up.
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

  double multiplier_ = 1.0;
  double gap_ = 0;
  bool has_gap_ = false;
  bool moved_ = false;
  uint64_t last_move_ = 0;
  std::vector<std::pair<double, double>> warm_;
  bool fitted_ = false;
  double a_ = 0, b_ = 0;
};

}  // namespace

std::unique_ptr<Controller> make_accuracy_controller() { return std::make_unique<AccuracyController>(); }

}  // namespace sparsecar::policies
