// Enums shared by kernels, policies, codecs and the wire format.
//
// The numeric values travel on the wire and in the shm layout: they are frozen. Add new values
// at the end; never renumber or reuse one. Thread-safety: plain functions, no state.
#pragma once

#include <cstdint>
#include <string_view>

namespace sparsecar::kernels {

// How the kept coordinates are chosen.
enum class Selector : uint16_t {
  kNone = 0,       // dense: every coordinate (compression off)
  kTopk = 1,       // exact top-k by magnitude
  kThreshold = 2,  // hard threshold: |e_i| >= lambda
  kTopkApprox = 3,   // DGC: lambda from a sample of |e|, one threshold pass, refined if nnz misses k
  kPercentile = 4,   // hard threshold with lambda = the q-quantile of |e| (estimated from a sample)
  kRandomk = 5,      // Bernoulli(p) keep, value / p (unbiased); seeded by (job seed, tensor, step)
  kImportance = 6,   // keep with probability min(1, c|e_i|), value / probability (unbiased)
  // Structured (kernels/structured.h); a tensor whose registered shape does not fit falls back
  // to kTopk at the same density.
  kBlockTopk = 7,     // best contiguous blocks of block_size elements by L2/L1 norm
  kRowTopk = 8,       // best rows of a 2-D tensor
  kColumnTopk = 9,    // best columns of a 2-D tensor
  kChannelTopk = 10,  // best output channels of a 4-D conv weight [c_out, c_in, kh, kw]
  kHeadTopk = 11,     // best attention heads: `heads` slices of the leading dimension
  kPeriodicMask = 12, // top-k mask of |g| accumulated over mask_period steps, reused in between
  kHybrid = 13,       // per-tensor top-k plus a global lambda pooled over the previous step
};

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

std::string_view selector_name(Selector s);
std::string_view format_name(Format f);
std::string_view value_type_name(ValueType v);
// Parse the names above ("none", "topk", "threshold"; "dense", "coo", "coo_varint", "bitmap",
// "csr", "rle"; "fp32", "fp16", "bf16", "int8"); false if unknown
// (and *out is left unchanged). A value outside the enum is named "unknown".
bool parse_selector(std::string_view text, Selector* out);
bool parse_format(std::string_view text, Format* out);
bool parse_value_type(std::string_view text, ValueType* out);

}  // namespace sparsecar::kernels
