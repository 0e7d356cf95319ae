// Names of the kernel enums (selectors: selectors.cc), as used in config files, flags, logs and metrics labels.
#include "sparsecar/kernels/types.h"

namespace sparsecar::kernels {

std::string_view format_name(Format f) {
  switch (f) {
    case Format::kDense: return "dense";
    case Format::kCoo: return "coo";
    case Format::kCooVarint: return "coo_varint";
    case Format::kBitmap: return "bitmap";
    case Format::kCsr: return "csr";
    case Format::kRle: return "rle";
  }
  return "unknown";
}

std::string_view value_type_name(ValueType v) {
  switch (v) {
    case ValueType::kF32: return "fp32";
    case ValueType::kF16: return "fp16";
    case ValueType::kBf16: return "bf16";
    case ValueType::kI8: return "int8";
  }
  return "unknown";
}

bool parse_format(std::string_view text, Format* out) {
  for (Format f : {Format::kDense, Format::kCoo, Format::kCooVarint, Format::kBitmap, Format::kCsr, Format::kRle}) {
    if (text == format_name(f)) {
      *out = f;
      return true;
    }
  }
  return false;
}

bool parse_value_type(std::string_view text, ValueType* out) {
  for (ValueType v : {ValueType::kF32, ValueType::kF16, ValueType::kBf16, ValueType::kI8}) {
    if (text == value_type_name(v)) {
      *out = v;
      return true;
    }
  }
  return false;
}

}  // namespace sparsecar::kernels
