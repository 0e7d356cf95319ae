// The compression choices that more than one reader must accept identically: the error
// compensation variants, and the ranges and names of the compression knobs.
//
// Two parsers read these values: the knob table (daemon/config/knobs.cc: flags, config file,
// control socket) and the per-tensor overrides (overrides.h). Both take their ranges and choice
// lists from here, so a value one accepts the other accepts too. It is its own header because
// plan.h includes overrides.h, and overrides.h needs the error-feedback variants.
//
// Thread-safety: constants and pure functions (the choice strings are built once, before main).
#pragma once

#include <cstdint>
#include <string_view>

#include "sparsecar/kernels/codecs.h"
#include "sparsecar/kernels/selectors.h"
#include "sparsecar/kernels/structured.h"

namespace sparsecar::policies {

// What happens to the part of the gradient a step does not send.
enum class ErrorFeedback : uint16_t {
  kResidual = 0,  // plain EF: e += g; send C(e); e -= sent
  kMomentum = 1,  // DGC momentum correction + momentum-factor masking (u, v zeroed where sent)
  kOff = 2,       // dropped; randomk / importance then send unbiased values (x / p)
};
// Residual rescaling when the trainer's learning rate changes between steps (StepJob::lr).
enum class LrRescale : uint16_t {
  kOff = 0,
  kNewOverOld = 1,  // residual *= lr_new / lr_old: stale residual shrinks with a decay
  kOldOverNew = 2,  // residual *= lr_old / lr_new: keeps lr * residual (the update it stands for)
};
std::string_view error_feedback_name(ErrorFeedback e);
bool parse_error_feedback(std::string_view text, ErrorFeedback* out);
std::string_view lr_rescale_name(LrRescale r);
bool parse_lr_rescale(std::string_view text, LrRescale* out);

// Closed ranges [min, max] of the numeric compression knobs. Integer knobs take unsigned
// integers in the range; the others finite numbers. The selector parameters' ranges (and types
// and choices) are their rows in the selector registry (kernels::kSelectorParams).
struct KnobRange {
  double min;
  double max;
};
constexpr KnobRange param_range(kernels::SelectorParam p) {
  return {kernels::selector_param(p).min, kernels::selector_param(p).max};
}
inline constexpr KnobRange kMomentumRange{0.0, 0.999999};
inline constexpr KnobRange kClipNormRange{0.0, 1e30};

// The names the choice knobs accept, '|'-separated (the knob table's `choices`). Each name
// parses with kernels::parse_format ("auto" aside), parse_value_type and parse_error_feedback
// respectively. Formats and value types are the codec registry's rows
// (kernels/codecs.h) in id order, then "auto": "dense|coo|...|auto" and "fp32|...".
const char* format_knob_choices();  // lives as long as the program
inline const char* const kFormatChoices = format_knob_choices();
inline const char* const kValueTypeChoices = kernels::value_type_choices();
inline constexpr const char* kErrorFeedbackChoices = "residual|momentum|off";

}  // namespace sparsecar::policies
