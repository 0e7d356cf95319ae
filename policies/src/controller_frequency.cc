// The frequency controller: per-tensor density scales, more for tensors whose coordinates are
// selected again and again. Its row: controllers.cc.
#include "controller_internal.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <utility>

namespace sparsecar::policies {
namespace {

class FrequencyController final : public Controller {
 public:
  ControllerKind kind() const override { return ControllerKind::kFrequency; }
  uint32_t version() const override { return 1; }
  Status update(const ControlContext& ctx, ControlKnobs* knobs) override {
    const auto& s = ctx.settings;
    for (const auto& t : ctx.obs.tensors) {
      if (t.repeat_fraction < 0 || !std::isfinite(t.repeat_fraction)) continue;
      auto [it, fresh] = ema_.try_emplace(t.tensor_id, t.repeat_fraction);
      if (!fresh) it->second = s.frequency.alpha * t.repeat_fraction + (1 - s.frequency.alpha) * it->second;
      weight_[t.tensor_id] = static_cast<double>(std::max<uint64_t>(t.nnz, 1));
    }
    double sw = 0, swr = 0;
    for (const auto& [id, r] : ema_) {
      sw += weight_[id];
      swr += weight_[id] * r;
    }
    TensorScales scales;
    if (sw > 0 && swr > 0) {
      const double mean = swr / sw;
      const double max_scale = std::max(s.frequency.max_scale, 1.0);
      for (const auto& [id, r] : ema_) {
        double scale = std::clamp(r / mean, 1.0 / max_scale, max_scale);
        // Half powers of two: small wobbles of the repeat rate do not churn decisions.
        scale = std::exp2(std::round(2 * std::log2(scale)) / 2);
        if (scale != 1.0) scales[id] = scale;
      }
    }
    knobs->tensor_scale = std::move(scales);
    return Status::Ok();
  }

 private:
  std::map<uint32_t, double> ema_;
  std::map<uint32_t, double> weight_;
};

}  // namespace

std::unique_ptr<Controller> make_frequency_controller() { return std::make_unique<FrequencyController>(); }

}  // namespace sparsecar::policies
