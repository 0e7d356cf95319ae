// Names of the kernel enums, as used in config files, flags, logs and metrics labels.
#include "sparsecar/kernels/types.h"

namespace sparsecar::kernels {

std::string_view selector_name(Selector s) {
  switch (s) {
    case Selector::kNone: return "none";
    case Selector::kTopk: return "topk";
    case Selector::kThreshold: return "threshold";
    case Selector::kTopkApprox: return "topk_approx";
    case Selector::kPercentile: return "percentile";
    case Selector::kRandomk: return "randomk";
    case Selector::kImportance: return "importance";
  }
  return "unknown";
}

std::string_view format_name(Format f) {
  switch (f) {
    case Format::kDense: return "dense";
    case Format::kCoo: return "coo";
  }
  return "unknown";
}

std::string_view value_type_name(ValueType v) {
  switch (v) {
    case ValueType::kF32: return "fp32";
  }
  return "unknown";
}

bool parse_selector(std::string_view text, Selector* out) {
  for (Selector s : {Selector::kNone, Selector::kTopk, Selector::kThreshold, Selector::kTopkApprox,
                     Selector::kPercentile, Selector::kRandomk, Selector::kImportance}) {
    if (text == selector_name(s)) {
      *out = s;
      return true;
    }
  }
  return false;
}

bool parse_format(std::string_view text, Format* out) {
  for (Format f : {Format::kDense, Format::kCoo}) {
    if (text == format_name(f)) {
      *out = f;
      return true;
    }
  }
  return false;
}

bool parse_value_type(std::string_view text, ValueType* out) {
  if (text == value_type_name(ValueType::kF32)) {
    *out = ValueType::kF32;
    return true;
  }
  return false;
}

}  // namespace sparsecar::kernels
