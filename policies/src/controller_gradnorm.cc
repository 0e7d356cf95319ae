// The gradnorm controller: density up for a while after the gradient norm jumps, down while it
// is small and steady. Its row: controllers.cc.
#include "controller_internal.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <memory>

namespace sparsecar::policies {
namespace {

class GradNormController final : public Controller {
 public:
  ControllerKind kind() const override { return ControllerKind::kGradNorm; }
  uint32_t version() const override { return 1; }
  Status update(const ControlContext& ctx, ControlKnobs* knobs) override {
    const auto& s = ctx.settings;
    const double g = std::sqrt(std::max(ctx.obs.grad_norm2, 0.0));
    if (g > 0 && std::isfinite(g)) {
      if (has_mean_ && g > s.gradnorm.jump * mean_) {
        boost_left_ = s.gradnorm.boost_steps;
        window_.clear();
      }
      mean_ = has_mean_ ? 0.9 * mean_ + 0.1 * g : g;
      has_mean_ = true;
      window_.push_back(g);
      while (window_.size() > std::max<uint64_t>(s.gradnorm.window, 2)) window_.pop_front();
    }
    double mult = 1.0;
    if (boost_left_ > 0) {
      mult = s.gradnorm.boost;
      --boost_left_;
    } else if (window_.size() >= std::max<uint64_t>(s.gradnorm.window, 2)) {
      double sum = 0, sum2 = 0;
      for (double v : window_) {
        sum += v;
        sum2 += v * v;
      }
      const double n = static_cast<double>(window_.size());
      const double mean = sum / n;
      const double var = std::max(sum2 / n - mean * mean, 0.0);
      if (mean > 0 && std::sqrt(var) / mean < s.gradnorm.steady_cv) mult = s.gradnorm.steady_scale;
    }
    knobs->density = clamp_density(knobs->density * mult, s);
    knobs->threshold /= mult;
    return Status::Ok();
  }

 private:
  bool has_mean_ = false;
  double mean_ = 0;
  uint64_t boost_left_ = 0;
  std::deque<double> window_;
};

}  // namespace

std::unique_ptr<Controller> make_gradnorm_controller() { return std::make_unique<GradNormController>(); }

}  // namespace sparsecar::policies
