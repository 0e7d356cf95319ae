// Plan: what the pipeline does with one tensor at one step, and the static policy that makes it.
//
// Policies are pure functions of plain-struct observations to a plain-struct plan:
// the same inputs give the same plan on every node. The static policy is the
// fallback every later controller reverts to when it fails.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "sparsecar/kernels/selectors.h"
#include "sparsecar/kernels/structured.h"
#include "sparsecar/kernels/types.h"
#include "sparsecar/policies/compression_knobs.h"
#include "sparsecar/policies/overrides.h"

namespace sparsecar::policies {

// How the nodes combine their contributions. Values are frozen (they travel in manifests).
enum class Collective : uint16_t {
  kRingAllReduce = 0,  // dense reduce-scatter + all-gather, 2(P-1)/P * n words per rank
  kSparseAllGather = 1,  // every node sends its encoded selection to every other node
};

// ErrorFeedback and LrRescale: compression_knobs.h.

struct Plan {
  uint32_t version = 1;
  bool dense = true;  // no selection: send everything (residual included), residual -> 0
  kernels::Selector selector = kernels::Selector::kNone;
  double density = 1.0;    // top-k: fraction kept
  float threshold = 0.0f;  // hard threshold: lambda
  kernels::Format format = kernels::Format::kDense;
  bool auto_format = false;  // pick the smallest format per message (kernels::choose_format); `format` ignored
  kernels::ValueType value_type = kernels::ValueType::kF32;
  uint32_t rows = 1;  // rows of the tensor's 2-D view, for CSR (1 for 1-D tensors)
  // Structured selectors (daemon/pipeline/structured_select.h): groups kept = topk_count(groups,
  // density); a tensor whose registered shape does not fit its selector gets exact top-k.
  uint32_t block_size = 64;                                 // block_topk: elements per block (32..256)
  kernels::GroupNorm group_norm = kernels::GroupNorm::kL2;  // how blocks/rows/columns/channels/heads rank
  uint32_t heads = 8;                                       // head_topk: heads in the leading dimension
  uint32_t mask_period = 100;                               // periodic_mask: steps a mask is reused
  double hybrid_density = 0.001;  // hybrid: fraction of the previous step's pooled elements lambda keeps
  Collective collective = Collective::kRingAllReduce;
  // Selector parameters (issue 3; kernels/select.h).
  double quantile = 0.99;         // percentile: lambda = this quantile of |e| (sampled)
  double approx_tolerance = 0.1;  // topk_approx: |nnz - k| / k accepted before refining
  uint64_t seed = 0;              // randomk / importance: the stream of this (tensor, step)
  // Error compensation: the compressor applies these on dense steps too. Set on every plan.
  ErrorFeedback error_feedback = ErrorFeedback::kResidual;
  float momentum = 0.9f;   // DGC momentum correction: u = momentum u + g, v += u, compress v
  float clip_norm = 0.0f;  // > 0: scale the node's gradient down to this L2 norm first
  LrRescale lr_rescale = LrRescale::kOff;
};

// The knobs the static policy reads (all `agreed` knobs, identical on every node).
struct StaticSettings {
  bool compression = true;
  kernels::Selector selector = kernels::Selector::kTopk;
  double density = 0.01;
  double threshold = 1e-3;
  // Structured selectors (see Plan).
  uint32_t block_size = 64;
  kernels::GroupNorm group_norm = kernels::GroupNorm::kL2;
  uint32_t heads = 8;
  uint32_t mask_period = 100;
  double hybrid_density = 0.001;
  // Issue 3's selector parameters and error compensation (copied into every plan; see Plan).
  double quantile = 0.99;
  double approx_tolerance = 0.1;
  uint64_t random_seed = 0;  // randomk / importance: Plan::seed = kernels::derive_seed(random_seed, tensor, step)
  ErrorFeedback error_feedback = ErrorFeedback::kResidual;
  double momentum = 0.9;
  double clip_norm = 0.0;
  LrRescale lr_rescale = LrRescale::kOff;
  // Per-tensor overrides (overrides.h), applied by static_plan to tensors whose name matches.
  // Every field here but hybrid_density, random_seed and lr_rescale (job-wide) has an override key.
  std::vector<TensorOverride> overrides;
  kernels::Format format = kernels::Format::kCoo;
  bool auto_format = false;  // `format` = auto
  kernels::ValueType value_type = kernels::ValueType::kF32;
  bool operator==(const StaticSettings&) const = default;
};

// What a policy knows about the tensor and step it plans for.
struct TensorObservation {
  uint32_t tensor_id = 0;
  uint64_t elements = 0;
  uint64_t step = 0;
  uint32_t world_size = 1;
  uint32_t rows = 1;  // leading dimension of the registered shape (1 until shapes are registered)
  std::string_view name;  // the registered name (checked equal on every node at the first step)
};

// Compression off -> dense ring all-reduce; on -> the configured selector, format (or auto) and
// value type, sparse all-gather.
Plan static_plan(const StaticSettings& settings, const TensorObservation& observation);

// The selector parameters of a plan, as the selector registry's functions read them
// (kernels/selectors.h).
kernels::SelectorParams selector_params(const Plan& plan);

// "topk density=0.002 coo/fp32 sparse-allgather" — for logs and errors.
std::string describe(const Plan& plan);

}  // namespace sparsecar::policies
