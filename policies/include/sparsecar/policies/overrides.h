// Per-tensor overrides of the compression knobs: "tensors named like this use that selector,
// format, block size, ...".
//
// Text form (the `tensor_overrides` knob; a config file's [tensor."<glob>"] tables turn into
// it), rules separated by ';', each `GLOB: key=value, key=value`:
//
//   embed*: selector=randomk, density=0.001, format=bitmap; *.bias: compression=off;
//   attn.*: selector=head_topk, heads=16, group_norm=l1; fc*: block_size=128, value_type=fp16
//
// GLOB matches the whole registered tensor name as an fnmatch(3) pattern without flags: `*` is
// any run of characters (also none, also '.' and '/'), `?` any one character, `[abc]` / `[a-z]`
// one character of a set and `[!abc]` one outside it, `\` takes the next character literally
// (`\*` is a '*'); a `[` without its `]` is a literal '['.
// Keys (tensor_override_keys()), with exactly the values of the global knobs of the same names
// (ranges and names from the selector registry, kernels/selectors.h, and compression_knobs.h):
//   compression (on|off), selector (a selector name), every per-tensor selector parameter (each
//   row of kernels::kSelectorParams with per_tensor, parsed by its row's type, range or choices:
//   density, block_size, group_norm, ...; tensor_override_keys() lists them), format (a codec
//   name or auto: kFormatChoices), value_type (kValueTypeChoices), error_feedback
//   (residual|momentum|off), momentum, clip_norm.
// Not keys: the job-wide selector parameters (per_tensor false): hybrid_density stays global
// because it is a cross-tensor threshold (one lambda pooled over every hybrid tensor of a step,
// structured_select.h), random_seed is the job's seed; lr_rescale is a job-wide knob too.
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
#include "sparsecar/kernels/selectors.h"
#include "sparsecar/kernels/structured.h"
#include "sparsecar/kernels/types.h"
#include "sparsecar/policies/compression_knobs.h"

namespace sparsecar::policies {

struct TensorOverride {
  std::string glob;
  std::optional<bool> compression;
  std::optional<kernels::Selector> selector;
  // The per-tensor selector parameters the rule sets: their values in `params`, their
  // kernels::param_bit()s in `params_set` (a parameter not in it keeps its default in `params`
  // and follows the global knob).
  kernels::SelectorParams params;
  uint32_t params_set = 0;
  // format=auto sets auto_format (true) alone; a named format sets format and auto_format (false).
  std::optional<kernels::Format> format;
  std::optional<bool> auto_format;
  std::optional<kernels::ValueType> value_type;
  std::optional<ErrorFeedback> error_feedback;
  std::optional<double> momentum;
  std::optional<double> clip_norm;
  bool sets(kernels::SelectorParam p) const { return (params_set & kernels::param_bit(p)) != 0; }
  bool operator==(const TensorOverride&) const = default;
};

// Parses the text form; errors (kInvalidArgument) name the rule and the bad key or value.
// Whitespace around separators is ignored; an empty text is no rules.
Expected<std::vector<TensorOverride>> parse_tensor_overrides(std::string_view text);

// The keys, ", "-separated: compression, selector, every per-tensor selector parameter of the
// selector registry (kernels/selectors.h), format, value_type and the error compensation keys.
std::string tensor_override_keys();

// fnmatch(3) of the whole name (flags 0; the pattern syntax above); false when either holds a NUL.
bool glob_match(std::string_view glob, std::string_view name);

}  // namespace sparsecar::policies
