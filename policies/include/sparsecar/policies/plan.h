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
  // Dense plans with dense_collective=trainer: the daemon sends nothing and hands each trainer its
  // share of the node's contribution (local sum + residual) / local trainers; the trainer
  // all-reduces it over its own process group (NCCL, gloo) and divides by its world size. Only
  // where every trainer of the job said it does (the DDP hook); the daemons' ring otherwise.
  kTrainerAllReduce = 2,
};
// The knob dense_collective's names of the two dense collectives: "ring", "trainer".
inline constexpr const char* kDenseCollectiveChoices = "ring|trainer";
std::string_view dense_collective_name(Collective c);  // "ring", "trainer" ("sparse-allgather")
bool parse_dense_collective(std::string_view text, Collective* out);  // "ring" or "trainer" only

// ErrorFeedback and LrRescale: compression_knobs.h.

struct Plan {
  uint32_t version = 1;
  bool dense = true;  // no selection: send everything (residual included), residual -> 0
  kernels::Selector selector = kernels::Selector::kNone;
  // The selector's parameters (kernels/selectors.h), as its select function reads them: density
  // (top-k: fraction kept), threshold (hard threshold: lambda), ..., and seed, the stream of this
  // (tensor, step). Structured selectors (daemon/pipeline/structured_select.h): groups kept =
  // topk_count(groups, density); a tensor whose registered shape does not fit its selector gets
  // exact top-k. Set on every plan (a dense one reads none).
  kernels::SelectorParams params;
  kernels::Format format = kernels::Format::kDense;
  bool auto_format = false;  // pick the smallest format per message (kernels::choose_format); `format` ignored
  kernels::ValueType value_type = kernels::ValueType::kF32;
  uint32_t rows = 1;  // rows of the tensor's 2-D view, for CSR (1 for 1-D tensors)
  Collective collective = Collective::kRingAllReduce;
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
  // Every selector parameter's knob (kernels/selectors.h). `seed` is the random_seed knob: a plan
  // gets kernels::derive_seed(random_seed, tensor, step).
  kernels::SelectorParams params;
  // Error compensation (copied into every plan; see Plan).
  ErrorFeedback error_feedback = ErrorFeedback::kResidual;
  double momentum = 0.9;
  double clip_norm = 0.0;
  LrRescale lr_rescale = LrRescale::kOff;
  // Per-tensor overrides (overrides.h), applied by static_plan to tensors whose name matches.
  // Every field here but lr_rescale and the job-wide selector parameters (hybrid_density,
  // random_seed: kernels::ParamInfo::per_tensor) has an override key.
  std::vector<TensorOverride> overrides;
  kernels::Format format = kernels::Format::kCoo;
  bool auto_format = false;  // `format` = auto
  kernels::ValueType value_type = kernels::ValueType::kF32;
  // How dense plans (compression off, a controller's dense step) are reduced: the daemons' ring
  // (kRingAllReduce) or the trainers' own all-reduce (kTrainerAllReduce; knob dense_collective).
  Collective dense_collective = Collective::kRingAllReduce;
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

// Compression off -> dense, reduced by settings.dense_collective; on -> the configured selector,
// format (or auto) and value type, sparse all-gather.
Plan static_plan(const StaticSettings& settings, const TensorObservation& observation);

// "topk density=0.002 coo/fp32 sparse-allgather" — for logs and errors.
std::string describe(const Plan& plan);

}  // namespace sparsecar::policies
