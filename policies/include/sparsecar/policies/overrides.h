// Per-tensor overrides of the compression knobs: "tensors named like this use that selector".
//
// Text form (the `tensor_overrides` knob; a config file's [tensor."<glob>"] tables turn into
// it), rules separated by ';', each `GLOB: key=value, key=value`:
//
//   embed*: selector=randomk, density=0.001; *.bias: compression=off; *norm*: selector=topk, density=0.5
//
// GLOB matches the whole registered tensor name; `*` is any run of characters (also none),
// `?` any one character. Keys: compression (on|off), selector (a selector name), density,
// threshold, quantile, approx_tolerance (ranges as the knobs of the same names). Rules apply
// in order and a later matching rule overrides the keys it sets, like a cascade of config
// sections. The whole text is an `agreed` knob, so rank 0's first-step check catches nodes
// that disagree on it.
//
// Thread-safety: pure functions and plain values.
#pragma once

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "sparsecar/common/status.h"
#include "sparsecar/kernels/types.h"

namespace sparsecar::policies {

struct TensorOverride {
  std::string glob;
  std::optional<bool> compression;
  std::optional<kernels::Selector> selector;
  std::optional<double> density;
  std::optional<double> threshold;
  std::optional<double> quantile;
  std::optional<double> approx_tolerance;
};

// Parses the text form; errors (kInvalidArgument) name the rule and the bad key or value.
// Whitespace around separators is ignored; an empty text is no rules.
Expected<std::vector<TensorOverride>> parse_tensor_overrides(std::string_view text);

// `*` and `?` glob match of the whole name.
bool glob_match(std::string_view glob, std::string_view name);

}  // namespace sparsecar::policies
