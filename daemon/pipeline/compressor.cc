#include "daemon/pipeline/compressor.h"

#include <algorithm>
#include <chrono>
#include <cmath>

#include "sparsecar/common/log.h"
#include "sparsecar/kernels/codec.h"
#include "sparsecar/kernels/ef.h"
#include "sparsecar/kernels/select.h"
#include "sparsecar/kernels/selectors.h"

namespace sparsecar {

TensorCompressor::TensorCompressor(uint32_t id, const TensorSpec& spec, kernels::ThreadPool* pool,
                                   const Clock& clock)
    : id_(id),
      spec_(spec),
      pool_(pool),
      clock_(clock),
      residual_(spec.count, 0.0f),
      work_(spec.count, 0.0f),
      index_(spec.count, 0),
      value_(spec.count, 0.0f),
      scratch_(kernels::selector_scratch_bytes(spec.count, spec.shape)),
      payload_(kernels::max_encoded_bytes(spec.count)),
      structured_(spec) {}

uint64_t TensorCompressor::footprint_bytes(const TensorSpec& spec) {
  const uint64_t n = spec.count;
  // residual, work, value, velocity (float) and index (uint32_t); scratch; payload; structured.
  return n * (4 * sizeof(float) + sizeof(uint32_t)) + kernels::selector_scratch_bytes(n, spec.shape) +
         kernels::max_encoded_bytes(n) + StructuredSelection::footprint_bytes(spec);
}

void TensorCompressor::rescale_for_lr(const policies::Plan& plan, float lr) {
  if (lr > 0.0f && last_lr_ > 0.0f && lr != last_lr_ && plan.lr_rescale != policies::LrRescale::kOff) {
    const float factor =
        plan.lr_rescale == policies::LrRescale::kNewOverOld ? lr / last_lr_ : last_lr_ / lr;
    kernels::scale(residual_, factor);
  }
  if (lr > 0.0f) last_lr_ = lr;
}

float TensorCompressor::fold(const policies::Plan& plan, std::span<const float> local_sum) {
  const float clip =
      plan.clip_norm > 0.0f
          ? kernels::clip_factor(std::sqrt(kernels::norm2(local_sum)), plan.clip_norm)
          : 1.0f;
  switch (plan.error_feedback) {
    case policies::ErrorFeedback::kMomentum:
      if (velocity_.size() != residual_.size()) velocity_.assign(residual_.size(), 0.0f);  // once
      kernels::momentum_accumulate(velocity_, residual_, local_sum, plan.momentum, clip);
      break;
    case policies::ErrorFeedback::kOff:
      std::fill(residual_.begin(), residual_.end(), 0.0f);
      kernels::ef_accumulate_scaled(residual_, local_sum, clip);
      break;
    case policies::ErrorFeedback::kResidual:
      kernels::ef_accumulate_scaled(residual_, local_sum, clip);
      break;
  }
  return clip;
}

Expected<size_t> TensorCompressor::accumulate_and_select(const policies::Plan& plan,
                                                         std::span<const float> local_sum,
                                                         float lr) {
  const size_t n = residual_.size();
  uint32_t* index = index_.data();
  float* value = value_.data();
  pending_ef_ = plan.error_feedback;
  pending_scaled_ = false;
  rescale_for_lr(plan, lr);
  const kernels::SelectorInfo* row = kernels::find_selector(plan.selector);
  if (row == nullptr) {
    return invalid_argument("selector " + std::to_string(static_cast<unsigned>(plan.selector)) + " is not known");
  }
  if (row->cpu == nullptr) return invalid_argument("compress() needs a selector; dense plans use dense_input()");
  const kernels::SelectorParams& params = plan.params;
  if (row->fused_lambda != nullptr && plan.error_feedback == policies::ErrorFeedback::kResidual &&
      !(plan.clip_norm > 0.0f)) {
    // Plain EF + hard threshold: one fused pass (lambda may come from a sample of residual + sum,
    // read without writing).
    const float lambda = row->fused_lambda(residual_, local_sum, params, scratch_);
    return kernels::ef_threshold(residual_, local_sum, lambda, index, value, n, pool_);
  }
  fold(plan, local_sum);
  // From here the step's gradient is in the residual: an error leaves it there (nothing lost).
  kernels::SelectInput in;
  in.x = residual_;
  in.grad = local_sum;
  in.shape = spec_.shape;
  in.params = &params;
  in.unbiased = row->unbiased && plan.error_feedback == policies::ErrorFeedback::kOff;
  in.scratch = scratch_;
  in.pool = pool_;
  if (row->stateful) in.state = structured_.state();
  if (row->pooled_lambda) in.pooled_lambda = structured_.take_pooled_lambda(residual_);
  SC_ASSIGN_OR_RETURN(const size_t nnz, row->cpu(in, kernels::SelectOutput{index, value, n}));
  pending_scaled_ = in.unbiased;
  // The selection leaves the residual: values that are the residual's own are cleared (exact,
  // also for NaN/inf); scaled (unbiased) values are subtracted.
  if (pending_scaled_) {
    kernels::subtract_selected(residual_, std::span<const uint32_t>(index, nnz),
                               std::span<const float>(value, nnz));
  } else {
    kernels::clear_selected(residual_, std::span<const uint32_t>(index, nnz));
  }
  return nnz;
}

Expected<TensorCompressor::Encoded> TensorCompressor::compress(const policies::Plan& plan,
                                                               std::span<const float> local_sum,
                                                               float lr) {
  SC_CHECK(pending_ == Pending::kNone, "compress() while a step is pending");
  SC_CHECK(local_sum.size() == residual_.size(), "local sum of the wrong size");
  const size_t n = residual_.size();
  SC_ASSIGN_OR_RETURN(const size_t nnz, accumulate_and_select(plan, local_sum, lr));
  pending_ = Pending::kSparse;
  pending_nnz_ = nnz;
  selected_count_ = pending_scaled_ ? 0 : nnz;  // scaled values (x / p) are not the residual's
  pending_value_type_ = plan.value_type;
  const std::span<const uint32_t> index(index_.data(), nnz);
  const std::span<const float> value(value_.data(), nnz);
  kernels::EncodeParams params;
  params.format = plan.format;
  params.value_type = plan.value_type;
  params.rows = plan.rows;
  const auto encode_started = clock_.now();
  if (plan.auto_format) {
    auto choice = kernels::choose_format(plan.value_type, plan.rows, n, index);
    if (!choice.ok()) {
      rollback();
      return choice.status();
    }
    params.format = choice->format;
  }
  auto wrote = kernels::encode(params, n, index, value, payload_);
  if (!wrote.ok()) {
    rollback();
    return wrote.status();
  }
  Encoded out;
  out.encode_seconds = std::chrono::duration<double>(clock_.now() - encode_started).count();
  out.format = params.format;
  out.value_type = params.value_type;
  out.nnz = kernels::find_codec(params.format)->dense ? n : nnz;  // encode() checked the format
  out.selected = nnz;
  out.payload = std::span<const std::byte>(payload_.data(), *wrote);
  return out;
}

std::span<float> TensorCompressor::dense_input(std::span<const float> local_sum,
                                               const policies::Plan& plan, float lr) {
  SC_CHECK(pending_ == Pending::kNone, "dense_input() while a step is pending");
  SC_CHECK(local_sum.size() == residual_.size(), "local sum of the wrong size");
  pending_ef_ = plan.error_feedback;
  rescale_for_lr(plan, lr);
  if (plan.error_feedback == policies::ErrorFeedback::kResidual && !(plan.clip_norm > 0.0f)) {
    std::copy(local_sum.begin(), local_sum.end(), work_.begin());
    kernels::add(work_, residual_);
    pending_sum_ = local_sum;  // rollback adds it to the untouched residual
  } else {
    // Clipping / momentum / no EF: fold into the residual now; rollback keeps the fold.
    fold(plan, local_sum);
    std::copy(residual_.begin(), residual_.end(), work_.begin());
    pending_sum_ = {};
  }
  pending_ = Pending::kDense;
  return work_;
}

void TensorCompressor::commit() {
  if (pending_ == Pending::kDense) {
    std::fill(residual_.begin(), residual_.end(), 0.0f);
    // Momentum-factor masking, once: the first dense step after sparse ones sent every coordinate
    // with the velocity it had held back, so the velocity restarts; the dense steps after it send
    // u = m u + g, SGD with momentum (docs/controllers.md, "A sparse -> dense switch").
    if (pending_ef_ == policies::ErrorFeedback::kMomentum && sparse_before_) {
      std::fill(velocity_.begin(), velocity_.end(), 0.0f);
    }
    sparse_before_ = false;
  }
  if (pending_ == Pending::kSparse) sparse_before_ = true;
  if (pending_ == Pending::kSparse && pending_ef_ == policies::ErrorFeedback::kMomentum) {
    // Momentum-factor masking (DGC): the velocity restarts at the coordinates just sent.
    kernels::clear_selected(velocity_, std::span<const uint32_t>(index_.data(), pending_nnz_));
  }
  if (pending_ == Pending::kSparse && pending_value_type_ != kernels::ValueType::kF32) {
    // Receivers got y = quantised(x): keep x - y. value_ is free after commit, so quantise in place.
    std::span<float> value(value_.data(), pending_nnz_);
    for (size_t j = 0; j < pending_nnz_; ++j) residual_[index_[j]] += value[j];
    Status s = kernels::quantize_roundtrip(pending_value_type_, value, value);
    SC_CHECK(s.ok(), "quantize_roundtrip: {}", s.to_string());
    for (size_t j = 0; j < pending_nnz_; ++j) residual_[index_[j]] -= value[j];
  }
  if (pending_ != Pending::kNone && pending_ef_ == policies::ErrorFeedback::kOff) {
    std::fill(residual_.begin(), residual_.end(), 0.0f);  // no error feedback: the rest is dropped
  }
  pending_ = Pending::kNone;
  pending_nnz_ = 0;
  pending_sum_ = {};
}

void TensorCompressor::rollback() {
  if (pending_ == Pending::kSparse) {
    for (size_t j = 0; j < pending_nnz_; ++j) residual_[index_[j]] += value_[j];
  } else if (pending_ == Pending::kDense && !pending_sum_.empty()) {
    kernels::ef_accumulate(residual_, pending_sum_);
  }
  pending_ = Pending::kNone;
  pending_nnz_ = 0;
  pending_sum_ = {};
}

double TensorCompressor::residual_norm2() const { return kernels::norm2(residual_); }

}  // namespace sparsecar
