// TensorCompressor: one tensor's compression state on this node — the error-feedback residual,
// the selection buffers and the encoded payload, all sized once at registration — and the
// operations of one step:
//
//   sparse plans:  compress()      residual += local sum; select per plan; encode
//   dense plans:   dense_input()   work = residual + local sum (the ring reduces `work` in place)
//   then           commit()        the exchange succeeded: the sent part leaves the residual
//   or             rollback()      it failed: everything goes back into the residual
//
// "Nothing lost": after rollback() the residual holds everything it held before the step plus
// the step's local sum.
//
// Time: the encoding time it reports is read only through the Clock it is given.
//
// Threads: owned and used by the pipeline thread only. Buffers handed out (payload, work) stay
// valid while the compressor lives; the pipeline keeps it alive (shared_ptr) for in-flight sends.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "daemon/pipeline/step.h"
#include "daemon/pipeline/structured_select.h"
#include "sparsecar/common/clock.h"
#include "sparsecar/common/large_vector.h"
#include "sparsecar/common/status.h"
#include "sparsecar/kernels/types.h"
#include "sparsecar/policies/plan.h"

namespace sparsecar {
namespace kernels {
class ThreadPool;  // sparsecar/kernels/parallel.h
}  // namespace kernels

class TensorCompressor {
 public:
  // pool (optional, must outlive the compressor): the selection kernels split this tensor over it.
  // `clock` (must outlive the compressor) times the encoding.
  TensorCompressor(uint32_t id, const TensorSpec& spec, kernels::ThreadPool* pool = nullptr,
                   const Clock& clock = steady_clock());
  // The most memory a compressor for `spec` can hold: what the constructor allocates plus what a
  // later plan may (momentum velocity, the structured selection's mask state). A registration is
  // charged this worst case, so no later plan change can take the node over its budget.
  static uint64_t footprint_bytes(const TensorSpec& spec);

  uint32_t id() const { return id_; }
  const TensorSpec& spec() const { return spec_; }

  struct Encoded {
    kernels::Format format = kernels::Format::kCoo;
    kernels::ValueType value_type = kernels::ValueType::kF32;
    uint64_t nnz = 0;       // the header's nnz: the selection's count (dense_len for dense)
    uint64_t selected = 0;  // coordinates selected this step
    std::span<const std::byte> payload;
    double encode_seconds = 0;  // of compress()'s time, spent choosing the format and encoding
  };

  // Sparse plan: folds `local_sum` into the residual, selects and encodes in the plan's format
  // (or the smallest, for auto_format) and value type. The selection is taken out of the residual
  // now; commit() or rollback() must follow. commit() keeps the quantisation error (what was
  // selected minus what every receiver decodes, kernels::quantize_roundtrip) in the residual.
  // `lr`: the learning rate the trainers passed with this step (0 = not given), for
  // plan.lr_rescale. Error compensation follows plan.error_feedback / clip_norm (see fold()).
  Expected<Encoded> compress(const policies::Plan& plan, std::span<const float> local_sum,
                             float lr = 0.0f);

  // Dense plan: returns residual + local_sum in the work buffer; the residual is untouched until
  // commit() zeroes it.
  // With plan.error_feedback = momentum, clipping or no EF, the sum is folded into the
  // residual (velocity) first and work = the folded residual; commit() zeroes residual and
  // velocity (every coordinate was sent), rollback() keeps the fold.
  std::span<float> dense_input(std::span<const float> local_sum, const policies::Plan& plan = {},
                               float lr = 0.0f);

  void commit();
  void rollback();

  std::span<const float> residual() const { return residual_; }
  // The values the last compress() selected (taken out of the residual), until the next
  // compress(); after a commit with a narrower value type, as the receivers decoded them. Empty
  // when the selector scaled them (random selectors send x / p).
  std::span<const float> selected_values() const { return {value_.data(), selected_count_}; }
  // The structured selectors' state (pipeline thread; the pipeline sets the hybrid pool).
  StructuredSelection& structured() { return structured_; }
  // DGC's local velocity u (empty until error_feedback = momentum is first used).
  std::span<const float> velocity() const { return velocity_; }
  // Σ residual², in float64 (for metrics and controllers).
  double residual_norm2() const;

 private:
  enum class Pending { kNone, kSparse, kDense };

  // Error compensation + selection of a sparse step into index_/value_; returns nnz. The
  // selection has left the residual when it returns.
  Expected<size_t> accumulate_and_select(const policies::Plan& plan, std::span<const float> local_sum,
                                         float lr);
  // residual (+ velocity) += the clipped local sum per plan.error_feedback; returns the clip factor.
  float fold(const policies::Plan& plan, std::span<const float> local_sum);
  // residual *= lr ratio when the learning rate changed (plan.lr_rescale); remembers lr.
  void rescale_for_lr(const policies::Plan& plan, float lr);

  const uint32_t id_;
  const TensorSpec spec_;
  kernels::ThreadPool* const pool_;
  const Clock& clock_;
  LargeVector<float> residual_;
  LargeVector<float> work_;
  LargeVector<uint32_t> index_;
  LargeVector<float> value_;
  LargeVector<std::byte> scratch_;
  LargeVector<std::byte> payload_;
  StructuredSelection structured_;  // structured selectors: group scratch, periodic mask
  Pending pending_ = Pending::kNone;
  size_t pending_nnz_ = 0;
  size_t selected_count_ = 0;  // selected_values()
  kernels::ValueType pending_value_type_ = kernels::ValueType::kF32;
  std::span<const float> pending_sum_;  // dense: the local sum to give back on rollback
  LargeVector<float> velocity_;          // error_feedback = momentum: u (allocated on first use)
  float last_lr_ = 0.0f;                 // lr of the last step that passed one
  policies::ErrorFeedback pending_ef_ = policies::ErrorFeedback::kResidual;
  bool pending_scaled_ = false;          // the pending values are x / p, not the residual's own
  bool sparse_before_ = false;           // the last committed step was sparse
};

}  // namespace sparsecar
