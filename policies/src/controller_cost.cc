// The cost controller: collective (sparse all-gather or dense ring) and format for the final
// density, from the cost model (cost_model.h). Its row: controllers.cc.
#include "controller_internal.h"

#include <algorithm>
#include <memory>

namespace sparsecar::policies {
namespace {

class CostController final : public Controller {
 public:
  ControllerKind kind() const override { return ControllerKind::kCost; }
  uint32_t version() const override { return 1; }
  Status update(const ControlContext& ctx, ControlKnobs* knobs) override {
    const auto& s = ctx.settings;
    const auto& o = ctx.obs;
    if (s.world_size < 2 || o.tensors.empty() || !ctx.base.compression) return Status::Ok();
    double d = std::min(knobs->density, knobs->density_cap);
    if (knobs->selector == kernels::Selector::kThreshold && o.elements > 0) {
      d = std::max(o.nnz / static_cast<double>(o.elements), 1e-9);
    }
    // Format of the largest tensor's selection (exact sizes from the codec).
    const auto* largest = &o.tensors.front();
    for (const auto& t : o.tensors) {
      if (t.elements > largest->elements) largest = &t;
    }
    kernels::Format f = kernels::Format::kCoo;
    sparse_allgather_bytes(largest->elements, topk_count(largest->elements, d), s.world_size, &f);
    const double g = ctx.goodput_Bps > 0 ? ctx.goodput_Bps : 1.0;  // unknown: compare bytes
    const double sparse_s = static_cast<double>(step_sparse_bytes(o.tensors, d, s.world_size, f)) / g +
                            (ctx.goodput_Bps > 0 ? std::max(o.encode_s, 0.0) : 0.0);
    const double dense_s = static_cast<double>(step_dense_bytes(o.tensors, s.world_size)) / g;
    if (!dense_) {
      if (dense_s < sparse_s * (1 - s.controller_hysteresis)) dense_ = true;
    } else if (sparse_s < dense_s * (1 - s.controller_hysteresis)) {
      dense_ = false;
    }
    if (dense_) {
      knobs->compression = false;
      return Status::Ok();
    }
    knobs->format = f;
    return Status::Ok();
  }

 private:
  bool dense_ = false;
};

}  // namespace

std::unique_ptr<Controller> make_cost_controller() { return std::make_unique<CostController>(); }

}  // namespace sparsecar::policies
