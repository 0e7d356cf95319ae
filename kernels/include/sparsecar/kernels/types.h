// Enums shared by kernels, policies, codecs and the wire format.
//
// The numeric values travel on the wire and in the shm layout: they are frozen. Add new values
// at the end; never renumber or reuse one. Thread-safety: plain functions, no state.
#pragma once

#include <cstdint>
#include <string_view>

#include "sparsecar/kernels/selectors.h"

namespace sparsecar::kernels {

// How the kept coordinates are chosen: Selector, in the selector registry (selectors.h).

// How a selection is laid out in a message payload.
enum class Format : uint16_t {
  kDense = 0,  // value[dense_len]
  kCoo = 1,    // uint32 index[nnz] (strictly increasing), then value[nnz]
  kCooVarint = 2,  // value[nnz], then the index gaps as LEB128 varints
  kBitmap = 3,     // bit per element (LSB first), then value[nnz]
  kCsr = 4,        // rows, cols, row ends, column indices (u16/u32), then value[nnz]
  kRle = 5,        // value[nnz], then (zero run, kept run) varint pairs
};
// Number of formats (ids 0 .. kFormatCount - 1); payload layouts in kernels/codec.h and WIRE.md.
inline constexpr int kFormatCount = 6;

// Element type of the values in a payload.
enum class ValueType : uint16_t {
  kF32 = 0,
  kF16 = 1,   // IEEE binary16, round to nearest even, finite values saturate at +-65504
  kBf16 = 2,  // bfloat16 (top 16 bits of fp32), round to nearest even, saturating
  kI8 = 3,    // float32 scale, then int8 q[] in [-127, 127]; value = q * scale
};
inline constexpr int kValueTypeCount = 4;

std::string_view format_name(Format f);
std::string_view value_type_name(ValueType v);
// Parse the names above ("dense", "coo", "coo_varint", "bitmap", "csr", "rle"; "fp32", "fp16",
// "bf16", "int8"); false if unknown (and *out is left unchanged). A value outside the enum is
// named "unknown". Selector names: selectors.h.
bool parse_format(std::string_view text, Format* out);
bool parse_value_type(std::string_view text, ValueType* out);

}  // namespace sparsecar::kernels
