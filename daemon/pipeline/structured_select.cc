#include "daemon/pipeline/structured_select.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>

#include "sparsecar/common/log.h"
#include "sparsecar/kernels/select.h"

namespace sparsecar {

PooledThreshold::PooledThreshold()
    : hist_(new uint64_t[kernels::kMagnitudeBins]()), lambda_(std::numeric_limits<float>::infinity()) {}

void PooledThreshold::begin_step(uint64_t step, double budget_density) {
  if (has_step_ && step == step_) return;
  if (has_step_ && pooled_ > 0) {
    const auto budget = static_cast<uint64_t>(std::ceil(budget_density * static_cast<double>(pooled_)));
    lambda_ = kernels::magnitude_histogram_threshold(
        std::span<const uint64_t, kernels::kMagnitudeBins>(hist_.get(), kernels::kMagnitudeBins), budget);
  }
  std::fill(hist_.get(), hist_.get() + kernels::kMagnitudeBins, uint64_t{0});
  pooled_ = 0;
  has_step_ = true;
  step_ = step;
}

void PooledThreshold::add(std::span<const float> e) {
  kernels::magnitude_histogram_add(std::span<uint64_t, kernels::kMagnitudeBins>(hist_.get(), kernels::kMagnitudeBins),
                                   e);
  pooled_ += e.size();
}

void PooledThreshold::reset() {
  std::fill(hist_.get(), hist_.get() + kernels::kMagnitudeBins, uint64_t{0});
  pooled_ = 0;
  has_step_ = false;
  step_ = 0;
  lambda_ = std::numeric_limits<float>::infinity();
}

namespace {

// Groups the largest structured selector can make for this tensor: blocks of the smallest size,
// rows, columns, channels or heads (all <= count).
size_t max_groups(const TensorSpec& spec) {
  size_t groups = (spec.count + kernels::kMinBlock - 1) / kernels::kMinBlock;
  for (uint64_t d : spec.shape) groups = std::max<size_t>(groups, d);
  if (spec.shape.size() == 2) groups = std::max<size_t>(groups, spec.count / spec.shape[0]);
  return groups;
}

size_t scratch_bytes(const TensorSpec& spec) {
  return std::max(kernels::group_scratch_bytes(max_groups(spec)), kernels::topk_scratch_bytes(spec.count));
}

}  // namespace

StructuredSelection::StructuredSelection(const TensorSpec& spec) : spec_(spec), scratch_(scratch_bytes(spec)) {}

uint64_t StructuredSelection::footprint_bytes(const TensorSpec& spec) {
  // importance_ and mask_values_ (float) and mask_ (uint32_t): up to one per element each.
  return scratch_bytes(spec) + spec.count * (2 * sizeof(float) + sizeof(uint32_t));
}

bool StructuredSelection::handles(kernels::Selector s) {
  switch (s) {
    case kernels::Selector::kBlockTopk:
    case kernels::Selector::kRowTopk:
    case kernels::Selector::kColumnTopk:
    case kernels::Selector::kChannelTopk:
    case kernels::Selector::kHeadTopk:
    case kernels::Selector::kPeriodicMask:
    case kernels::Selector::kHybrid:
      return true;
    default:
      return false;
  }
}

Expected<size_t> StructuredSelection::select(const policies::Plan& plan, std::span<const float> e,
                                             std::span<const float> grad, uint32_t* out_index, float* out_value) {
  SC_CHECK(e.size() == spec_.count && grad.size() == spec_.count, "structured select: %zu/%zu elements, expected %llu",
           e.size(), grad.size(), static_cast<unsigned long long>(spec_.count));
  const size_t n = e.size();
  const auto& shape = spec_.shape;
  const kernels::GroupNorm norm = plan.group_norm;
  auto groups_kept = [&](size_t groups) { return kernels::topk_count(groups, plan.density); };
  switch (plan.selector) {
    case kernels::Selector::kBlockTopk: {
      const size_t block = plan.block_size;
      return kernels::block_topk(e, block, groups_kept((n + block - 1) / std::max<size_t>(block, 1)), norm, scratch_,
                                 out_index, out_value);
    }
    case kernels::Selector::kRowTopk:
      if (shape.size() != 2) break;
      return kernels::row_topk(e, shape[0], shape[1], groups_kept(shape[0]), norm, scratch_, out_index, out_value);
    case kernels::Selector::kColumnTopk:
      if (shape.size() != 2) break;
      return kernels::column_topk(e, shape[0], shape[1], groups_kept(shape[1]), norm, scratch_, out_index, out_value);
    case kernels::Selector::kChannelTopk: {
      if (shape.size() != 4) break;
      const std::array<uint64_t, 4> dims = {shape[0], shape[1], shape[2], shape[3]};
      return kernels::channel_topk(e, dims, groups_kept(shape[0]), norm, scratch_, out_index, out_value);
    }
    case kernels::Selector::kHeadTopk:
      if (shape.empty() || plan.heads < 2 || shape[0] % plan.heads != 0) break;
      return kernels::head_topk(e, shape[0], plan.heads, groups_kept(plan.heads), norm, scratch_, out_index,
                                out_value);
    case kernels::Selector::kPeriodicMask:
      return select_mask(plan, e, grad, out_index, out_value);
    case kernels::Selector::kHybrid: {
      const size_t k = kernels::topk_count(n, plan.density);
      if (pool_ == nullptr) return kernels::topk_exact(e, k, scratch_, out_index, out_value);
      const float lambda = pool_->lambda();
      pool_->add(e);
      if (std::isinf(lambda)) return kernels::topk_exact(e, k, scratch_, out_index, out_value);
      return kernels::topk_or_threshold(e, k, lambda, scratch_, out_index, out_value);
    }
    default:
      return invalid_argument("selector " + std::string(kernels::selector_name(plan.selector)) +
                              " is not a structured selector");
  }
  // The shape does not fit the selector: plain exact top-k at the same density.
  return kernels::topk_exact(e, kernels::topk_count(n, plan.density), scratch_, out_index, out_value);
}

Expected<size_t> StructuredSelection::select_mask(const policies::Plan& plan, std::span<const float> e,
                                                  std::span<const float> grad, uint32_t* out_index,
                                                  float* out_value) {
  const size_t n = e.size();
  if (importance_.empty()) {  // first use: the only allocation, once per tensor
    importance_.assign(n, 0.0f);
    mask_.assign(n, 0);
    mask_values_.assign(n, 0.0f);
  }
  kernels::importance_accumulate(importance_, grad);
  if (!has_mask_ || steps_since_mask_ >= std::max<uint32_t>(plan.mask_period, 1)) {
    SC_ASSIGN_OR_RETURN(size_t k, kernels::topk_exact(importance_, kernels::topk_count(n, plan.density), scratch_,
                                                      mask_.data(), mask_values_.data()));
    mask_size_ = k;
    has_mask_ = true;
    steps_since_mask_ = 0;
    std::fill(importance_.begin(), importance_.end(), 0.0f);
  }
  ++steps_since_mask_;
  std::copy(mask_.begin(), mask_.begin() + static_cast<std::ptrdiff_t>(mask_size_), out_index);
  kernels::gather(e, std::span<const uint32_t>(mask_.data(), mask_size_), out_value);
  return mask_size_;
}

}  // namespace sparsecar
