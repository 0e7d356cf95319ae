#include "daemon/pipeline/compressor.h"

#include <algorithm>

#include "sparsecar/common/log.h"
#include "sparsecar/kernels/codec.h"
#include "sparsecar/kernels/select.h"

namespace sparsecar {

TensorCompressor::TensorCompressor(uint32_t id, const TensorSpec& spec)
    : id_(id),
      spec_(spec),
      residual_(spec.count, 0.0f),
      work_(spec.count, 0.0f),
      index_(spec.count, 0),
      value_(spec.count, 0.0f),
      scratch_(kernels::topk_scratch_bytes(spec.count)),
      payload_(kernels::max_encoded_bytes(spec.count)) {}

Expected<TensorCompressor::Encoded> TensorCompressor::compress(const policies::Plan& plan,
                                                               std::span<const float> local_sum) {
  SC_CHECK(pending_ == Pending::kNone, "compress() while a step is pending");
  SC_CHECK(local_sum.size() == residual_.size(), "local sum of the wrong size");
  const size_t n = residual_.size();
  size_t nnz = 0;
  switch (plan.selector) {
    case kernels::Selector::kThreshold:
      nnz = kernels::ef_threshold(residual_, local_sum, plan.threshold, index_.data(), value_.data(), n);
      break;
    case kernels::Selector::kTopk: {
      kernels::ef_accumulate(residual_, local_sum);
      auto selected = kernels::topk_exact(residual_, kernels::topk_count(n, plan.density), scratch_, index_.data(),
                                          value_.data());
      if (!selected.ok()) {
        for (size_t i = 0; i < n; ++i) residual_[i] -= local_sum[i];  // undo the fold: nothing happened
        return selected.status();
      }
      nnz = *selected;
      kernels::clear_selected(residual_, std::span<const uint32_t>(index_.data(), nnz));
      break;
    }
    case kernels::Selector::kNone:
      return invalid_argument("compress() needs a selector; dense plans use dense_input()");
    default:
      return invalid_argument("selector " + std::string(kernels::selector_name(plan.selector)) +
                           " is not wired into the compressor yet");
  }
  pending_ = Pending::kSparse;
  pending_nnz_ = nnz;
  pending_value_type_ = plan.value_type;
  const std::span<const uint32_t> index(index_.data(), nnz);
  const std::span<const float> value(value_.data(), nnz);
  kernels::EncodeParams params;
  params.format = plan.format;
  params.value_type = plan.value_type;
  params.rows = plan.rows;
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
  out.format = params.format;
  out.value_type = params.value_type;
  out.nnz = params.format == kernels::Format::kDense ? n : nnz;
  out.selected = nnz;
  out.payload = std::span<const std::byte>(payload_.data(), *wrote);
  return out;
}

std::span<float> TensorCompressor::dense_input(std::span<const float> local_sum) {
  SC_CHECK(pending_ == Pending::kNone, "dense_input() while a step is pending");
  SC_CHECK(local_sum.size() == residual_.size(), "local sum of the wrong size");
  std::copy(local_sum.begin(), local_sum.end(), work_.begin());
  kernels::add(work_, residual_);
  pending_ = Pending::kDense;
  pending_sum_ = local_sum;
  return work_;
}

void TensorCompressor::commit() {
  if (pending_ == Pending::kDense) std::fill(residual_.begin(), residual_.end(), 0.0f);
  if (pending_ == Pending::kSparse && pending_value_type_ != kernels::ValueType::kF32) {
    // Receivers got y = quantised(x): keep x - y. value_ is free after commit, so quantise in place.
    std::span<float> value(value_.data(), pending_nnz_);
    for (size_t j = 0; j < pending_nnz_; ++j) residual_[index_[j]] += value[j];
    Status s = kernels::quantize_roundtrip(pending_value_type_, value, value);
    SC_CHECK(s.ok(), "quantize_roundtrip: %s", s.to_string().c_str());
    for (size_t j = 0; j < pending_nnz_; ++j) residual_[index_[j]] -= value[j];
  }
  pending_ = Pending::kNone;
  pending_nnz_ = 0;
  pending_sum_ = {};
}

void TensorCompressor::rollback() {
  if (pending_ == Pending::kSparse) {
    for (size_t j = 0; j < pending_nnz_; ++j) residual_[index_[j]] += value_[j];
  } else if (pending_ == Pending::kDense) {
    kernels::ef_accumulate(residual_, pending_sum_);
  }
  pending_ = Pending::kNone;
  pending_nnz_ = 0;
  pending_sum_ = {};
}

double TensorCompressor::residual_norm2() const {
  double s = 0.0;
  for (float v : residual_) s += static_cast<double>(v) * v;
  return s;
}

}  // namespace sparsecar
