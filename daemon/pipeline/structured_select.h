// The state of the structured selectors as the compressor runs them: the per-tensor state of
// periodic masks and the pooled global threshold of the hybrid selector. Which kernel a plan's
// selector means is its row in the selector registry (kernels/selectors.h, kernels/src/selectors.cc).
//
// Shape rules (the rows' kernels apply them) (a tensor whose shape does not fit falls back to exact top-k at the plan's density,
// so one global selector knob can cover biases and norms too):
//   block_topk     any tensor: contiguous blocks of plan.params.block_size elements (last one ragged)
//   row_topk       2-D shape [rows, cols]: whole rows
//   column_topk    2-D shape [rows, cols]: whole columns
//   channel_topk   4-D shape [c_out, c_in, kh, kw]: whole output channels
//   head_topk      a shape whose leading dim is a multiple of plan.params.heads (>= 2): whole heads,
//                  each leading/heads consecutive rows
// Groups kept: kernels::topk_count(groups, plan.params.density), so at least one group per step; with
// few large groups (8 heads) the real density is coarser than the knob.
//
// Periodic masks are per node: every node computes its mask from its own accumulated |g|
// (deterministically: same inputs, same mask), so nodes' masks differ and the sparse all-gather
// carries each node's own indices. The mask is recomputed on the first step and then every
// plan.params.mask_period steps of this tensor (counted in steps this node compressed), from
// Σ|local sum| over the steps since the last mask (the step being compressed included), as the
// top-k of that importance at plan.params.density; in between, every step sends the residual at the mask.
// A failed step (rollback) keeps its importance and the mask schedule.
//
// Hybrid: a tensor sends its own top-k (plan.params.density) plus every coordinate with |e_i| >= λ,
// where λ is one threshold per node per step: the magnitude above which a plan.params.hybrid_density
// fraction of the previous step's pooled |e| lay (e = residual after the fold, before selection,
// over every hybrid tensor this node compressed in that step; kernels::magnitude_histogram_*).
// Tensors of one step are compressed one after another, so the previous step's pool is what all
// of them can share. The first step (no pool yet) sends top-k only. λ is per node, like the masks.
//
// Threads: pipeline thread only (like the compressor that owns it).
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "daemon/pipeline/step.h"
#include "sparsecar/common/status.h"
#include "sparsecar/kernels/selectors.h"
#include "sparsecar/kernels/structured.h"
#include "sparsecar/kernels/types.h"
#include "sparsecar/policies/plan.h"

namespace sparsecar {

// The hybrid selector's pooled magnitudes: one per pipeline (per node).
class PooledThreshold {
 public:
  PooledThreshold();
  // Called before each step's first compress. A new step number closes the pool of the last
  // one: λ for this step comes from it. `budget_density`: the fraction of the pooled elements
  // λ keeps (plan.params.hybrid_density).
  void begin_step(uint64_t step, double budget_density);
  // λ for the current step; +inf (top-k only) until a previous step pooled anything.
  float lambda() const { return lambda_; }
  // Adds a hybrid tensor's folded residual to the current step's pool.
  void add(std::span<const float> e);
  // Forget everything (job reset).
  void reset();

 private:
  std::unique_ptr<uint64_t[]> hist_;  // kernels::kMagnitudeBins counters
  uint64_t pooled_ = 0;
  bool has_step_ = false;
  uint64_t step_ = 0;
  float lambda_;
};

// The per-tensor state the selector registry's rows may need beyond the residual
// (kernels/selectors.h): a stateful row's kernels::SelectorState (the periodic mask, allocated on
// first use) and, for a pooled-lambda row, the node's PooledThreshold. Which row needs which is
// the row's flag, never a selector name here.
class StructuredSelection {
 public:
  explicit StructuredSelection(const TensorSpec& spec);

  // The most memory the state can hold: the periodic mask's buffers (allocated on first use).
  // For the node's tensor memory budget.
  static uint64_t footprint_bytes(const TensorSpec& spec);

  // The pool hybrid tensors share (owned by the pipeline; may be null: hybrid is then top-k).
  void set_pool(PooledThreshold* pool) { pool_ = pool; }

  // The state a stateful row reads and updates (allocated, zeroed, on the first call).
  kernels::SelectorState* state();
  // A pooled-lambda row's lambda for this step (+inf without a pool or before one filled), and
  // `e` (the residual after the fold) joins the pool.
  float take_pooled_lambda(std::span<const float> e);

  // Periodic-mask state, for tests: the current mask and the steps since it was computed.
  std::span<const uint32_t> mask() const { return {state_.mask.data(), state_.mask_size}; }
  uint64_t steps_since_mask() const { return state_.steps_since_mask; }

 private:
  const TensorSpec spec_;
  PooledThreshold* pool_ = nullptr;
  // Stateful rows (allocated on first use); state_ points into them.
  std::vector<float> importance_;
  std::vector<uint32_t> mask_;
  std::vector<float> mask_values_;
  kernels::SelectorState state_;
};

}  // namespace sparsecar
