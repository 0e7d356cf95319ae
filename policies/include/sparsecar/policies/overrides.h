// Per-tensor overrides of the compression knobs: "tensors named like this use that selector,
// format, block size, ...".
//
// Text form (the `tensor_overrides` knob; a config file's [tensor."<glob>"] tables turn into
// it), rules separated by ';', each `GLOB: key=value, key=value`:
//
//   embed*: selector=randomk, density=0.001, format=bitmap; *.bias: compression=off;
//   attn.*: selector=head_topk, heads=16, group_norm=l1; fc*: block_size=128, value_type=fp16
//
// GLOB matches the whole registered tensor name; `*` is any run of characters (also none),
// `?` any one character. Keys (tensor_override_keys()), with exactly the values of the global
// knobs of the same names (ranges and names from the selector registry, kernels/selectors.h, and
// compression_knobs.h):
//   compression (on|off), selector (a selector name), every per-tensor selector parameter
//   (density, threshold, quantile, approx_tolerance, block_size, group_norm (l2|l1), heads,
//   mask_period), format (a codec name or auto: kFormatChoices), value_type (kValueTypeChoices),
//   error_feedback (residual|momentum|off), momentum, clip_norm.
// Not keys: hybrid_density stays global because it is a cross-tensor threshold (one lambda
// pooled over every hybrid tensor of a step, structured_select.h); random_seed and lr_rescale
// are job-wide knobs too.
// Rules apply in order and a later matching rule overrides the keys it sets, like a cascade of
// config sections. A key no rule sets follows the global knob, also when a controller moves
// that knob; a key a rule sets does not (a per-tensor density ignores controller moves of
// `density`, though the plan controllers' scales and density bounds still apply; a per-tensor
// format ignores the cost controller's `format`).
// The whole text is an `agreed` knob, so rank 0's first-step check catches nodes that disagree
// on it. Error compensation state (residual, DGC velocity) is per tensor already, so a tensor's
// own error_feedback/momentum/clip_norm needs nothing shared.
//
// Thread-safety: pure functions and plain values.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "sparsecar/common/status.h"
#include "sparsecar/kernels/structured.h"
#include "sparsecar/kernels/types.h"
#include "sparsecar/policies/compression_knobs.h"

namespace sparsecar::policies {

struct TensorOverride {
  std::string glob;
  std::optional<bool> compression;
  std::optional<kernels::Selector> selector;
  std::optional<double> density;
  std::optional<double> threshold;
  std::optional<double> quantile;
  std::optional<double> approx_tolerance;
  // format=auto sets auto_format (true) alone; a named format sets format and auto_format (false).
  std::optional<kernels::Format> format;
  std::optional<bool> auto_format;
  std::optional<kernels::ValueType> value_type;
  std::optional<uint32_t> block_size;
  std::optional<kernels::GroupNorm> group_norm;
  std::optional<uint32_t> heads;
  std::optional<uint32_t> mask_period;
  std::optional<ErrorFeedback> error_feedback;
  std::optional<double> momentum;
  std::optional<double> clip_norm;
  bool operator==(const TensorOverride&) const = default;
};

// Parses the text form; errors (kInvalidArgument) name the rule and the bad key or value.
// Whitespace around separators is ignored; an empty text is no rules.
Expected<std::vector<TensorOverride>> parse_tensor_overrides(std::string_view text);

// The keys, ", "-separated: compression, selector, every per-tensor selector parameter of the
// selector registry (kernels/selectors.h), format, value_type and the error compensation keys.
std::string tensor_override_keys();

// `*` and `?` glob match of the whole name.
bool glob_match(std::string_view glob, std::string_view name);

}  // namespace sparsecar::policies
