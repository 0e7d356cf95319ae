// Encoders and decoders of selections into message payloads (the bytes after the wire header).
//
// A selection is (index[], value[]) with indices strictly increasing and < dense_len, as every
// selector writes it. It can be laid out in six formats and four value types; the receiver
// learns both from the wire header and decodes whatever arrives (payloads are self-describing
// given the header's dense_len and nnz). `auto` (choose_format) computes the exact size of every
// candidate and takes the smallest.
//
// Payloads are little-endian with no alignment requirement. Decoders treat their input as
// hostile: every length, count, index, varint and run is checked in a first pass before
// anything is written, and a bad payload returns kDataLoss with a message naming the field,
// leaving `dense_out` untouched. Encoders return kInvalidArgument for a bad selection (indices
// not strictly increasing or out of range, sizes differing, output too small).
//
// Thread-safety: pure functions; concurrent calls on disjoint buffers are safe.
//
// ---- Value block V(m): m values of the message's value type (frozen; WIRE.md) ----------------
//   fp32 (0): float32 v[m]                                       4m bytes
//   fp16 (1): binary16 h[m]                                      2m bytes
//   bf16 (2): bfloat16 b[m] (the top 16 bits of a float32)       2m bytes
//   int8 (3): float32 scale, then int8 q[m], value = q * scale    4 + m bytes (scale even if m = 0)
// Quantisation bounds (x = the fp32 value given to the encoder, y = what every receiver decodes):
//   fp32: y == x bit for bit.
//   fp16: round to nearest even. |y - x| <= 2^-11 |x| for 2^-14 <= |x| <= 65504, <= 2^-25 below
//         (subnormals); finite |x| > 65504 saturates to +-65504; +-inf and NaN are kept.
//   bf16: round to nearest even. |y - x| <= 2^-8 |x| for normal x, <= 2^-134 for subnormals;
//         finite values that would round past the largest bf16 saturate to it; inf/NaN kept.
//   int8: symmetric per message: scale = max|x| / 127 (float32), q = round-half-even(x / scale)
//         in [-127, 127], so |y - x| <= (0.5 + 2^-12) * scale = ~max|x| / 254. If any x is not
//         finite the scale is NaN and the whole message decodes to NaN (a diverged gradient
//         stays visible). Decoders reject a negative or infinite scale and q = -128.
// The pipeline keeps x - y in the error-feedback residual, so quantisation loses nothing for good.
//
// ---- Formats (frozen ids; k = nnz, n = dense_len) -------------------------------------------------
//   dense      (0): V(n), the selection scattered into zeros; nnz must equal n.
//   coo        (1): uint32 index[k], then V(k).                              4k + |V(k)|
//   coo_varint (2): V(k), then k LEB128 varints (7 bits per byte, low first, high bit = more,
//                   at most 5 bytes, minimal length): index[0], then index[i] - index[i-1] - 1.
//   bitmap     (3): ceil(n/8) bytes, bit i (byte i/8, bit i%8, LSB first) set iff i is kept, the
//                   bits past n zero; then V(k) in index order.             ceil(n/8) + |V(k)|
//   csr        (4): uint32 rows, uint32 cols (rows >= 1, rows * cols == n), uint32 row_end[rows]
//                   (non-decreasing, row_end[rows-1] == k), column index[k] as uint16 when
//                   cols <= 65536 else uint32 (strictly increasing within a row, < cols), then
//                   V(k) in row-major order.                        8 + 4 rows + 2|4 k + |V(k)|
//   rle        (5): V(k), then one (gap, length) varint pair per maximal run of kept elements:
//                   gap = skipped elements since the end of the previous run (>= 1 after the
//                   first run), length >= 1; the runs end at or before n and their lengths sum
//                   to k.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

#include "sparsecar/common/status.h"
#include "sparsecar/kernels/types.h"

namespace sparsecar::kernels {

class ThreadPool;  // parallel.h

// Bytes of the value block for m values (0 for an unknown value type; saturates at SIZE_MAX).
size_t value_block_bytes(ValueType value_type, size_t m);

// Sizes a payload of (format, value_type) with nnz entries of a dense_len tensor can have,
// from what the wire header says alone: min == max for dense, coo and bitmap; a range for
// coo_varint, csr and rle. {1, 0} (empty) for an unknown format or value type, or nnz > dense_len
// (or dense with nnz != dense_len). Saturates instead of wrapping for hostile inputs.
struct SizeRange {
  size_t min = 1;
  size_t max = 0;
  bool contains(size_t bytes) const { return min <= bytes && bytes <= max; }
};
SizeRange payload_size_range(Format format, ValueType value_type, uint64_t dense_len, uint64_t nnz);

// The largest payload size (payload_size_range().max). Exact for dense, coo and bitmap; 0 for an
// unknown format/value type. Kept for callers that size buffers by (format, nnz).
size_t encoded_bytes(Format format, ValueType value_type, size_t dense_len, size_t nnz);

// A buffer of this many bytes holds any encoding of any selection of a dense_len tensor, in
// every format and value type (size the encode buffer once, at registration).
size_t max_encoded_bytes(size_t dense_len);

// How to encode one message.
struct EncodeParams {
  Format format = Format::kCoo;
  ValueType value_type = ValueType::kF32;
  // CSR only: rows of the tensor's 2-D view (dense_len must be a multiple of it); 1 for 1-D.
  uint32_t rows = 1;
};

// Exact payload size of `index` (strictly increasing, < dense_len) encoded as `params`.
// kInvalidArgument for a bad selection, unknown format/value type, or CSR rows that are 0 or do
// not divide dense_len.
Expected<size_t> encoded_size(const EncodeParams& params, size_t dense_len,
                              std::span<const uint32_t> index);

// Encodes the selection into out (out.size() >= encoded_size) and returns the bytes written
// (== encoded_size). Errors as encoded_size, plus index/value sizes differing or out too small;
// out's contents are unspecified after an error.
Expected<size_t> encode(const EncodeParams& params, size_t dense_len, std::span<const uint32_t> index,
                        std::span<const float> value, std::span<std::byte> out);

// `auto`: the exact size of every format for this selection and the smallest. A format that
// cannot carry it (csr with rows not dividing dense_len) gets SIZE_MAX. Ties go to the format
// that decodes fastest, in this order: coo, bitmap, dense, csr, coo_varint, rle.
struct FormatChoice {
  Format format = Format::kCoo;
  size_t bytes = 0;
  std::array<size_t, kFormatCount> bytes_by_format{};  // indexed by the format id
};
Expected<FormatChoice> choose_format(ValueType value_type, uint32_t rows, size_t dense_len,
                                     std::span<const uint32_t> index);

// What every receiver will decode for `value` in `value_type` (the same scale and rounding as
// the encoder), written to out (same size as value). The sender uses it to keep the
// quantisation error x - y in its residual. kInvalidArgument on a size mismatch or unknown type.
Status quantize_roundtrip(ValueType value_type, std::span<const float> value, std::span<float> out);

// COO fp32 shortcuts (the format's fast path): index[] then value[] into out.
Status coo_encode(std::span<const uint32_t> index, std::span<const float> value,
                  std::span<std::byte> out);
// Dense fp32: writes the values as-is. Error (kInvalidArgument): out too small.
Status dense_encode(std::span<const float> values, std::span<std::byte> out);

// Validates `payload` as (format, value_type) with `nnz` entries for a tensor of
// dense_out.size() elements, then adds it into dense_out (dense_out[index] += value). On error
// (kDataLoss, naming the field) nothing is written. Checks: format and value type known; the
// payload size exact for what it holds (truncated, oversized -> "payload_bytes"); nnz against
// dense length and against the count the payload holds; every index in range and strictly
// increasing; varints well-formed; runs non-empty and maximal; int8 scale and codes valid.
// pool (optional, parallel.h): the dense, COO and bitmap scatters split over it (validation runs
// on the calling thread first); the same sums for every thread count.
Status decode_accumulate(Format format, ValueType value_type, std::span<const std::byte> payload,
                         uint64_t nnz, std::span<float> dense_out, ThreadPool* pool = nullptr);

// fp16 / bf16 conversions used by the value blocks (exposed for tests and references).
uint16_t float_to_half(float x);
float half_to_float(uint16_t h);
uint16_t float_to_bf16(float x);
float bf16_to_float(uint16_t b);

// CRC-32C (Castagnoli), hardware-accelerated where SSE4.2 is present (checked at run time),
// slicing-by-8 tables otherwise. crc32c(0, p, n) of the ASCII bytes "123456789" is 0xE3069283.
// Chains: crc32c(crc32c(0, a, na), b, nb) == crc32c(0, a||b, na + nb).
uint32_t crc32c(uint32_t crc, const void* data, size_t size);

}  // namespace sparsecar::kernels
