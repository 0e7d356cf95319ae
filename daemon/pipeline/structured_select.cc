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

StructuredSelection::StructuredSelection(const TensorSpec& spec) : spec_(spec) {}

uint64_t StructuredSelection::footprint_bytes(const TensorSpec& spec) {
  // importance_ and mask_values_ (float) and mask_ (uint32_t): one per element each.
  return spec.count * (2 * sizeof(float) + sizeof(uint32_t));
}

kernels::SelectorState* StructuredSelection::state() {
  if (importance_.empty() && spec_.count > 0) {  // first use: the only allocation, once per tensor
    importance_.assign(spec_.count, 0.0f);
    mask_.assign(spec_.count, 0);
    mask_values_.assign(spec_.count, 0.0f);
    state_ = kernels::SelectorState{};
    state_.importance = importance_;
    state_.mask = mask_;
    state_.mask_values = mask_values_;
  }
  return &state_;
}

float StructuredSelection::take_pooled_lambda(std::span<const float> e) {
  if (pool_ == nullptr) return std::numeric_limits<float>::infinity();
  const float lambda = pool_->lambda();
  pool_->add(e);
  return lambda;
}

}  // namespace sparsecar
