// Encoders and decoders of selections into message payloads (the bytes after the wire header).
//
// A selection is (index[], value[]) with indices strictly increasing and < dense_len, as every
// selector writes it. It can be laid out in every format of the codec registry (codecs.h: one
// row per format) and every value type; the receiver learns both from the wire header and
// decodes whatever arrives (payloads are self-describing given the header's dense_len and nnz).
// `auto` (choose_format) computes the exact size of every row's format and takes the smallest.
// The functions here validate their arguments and then call the row of the format: one table
// lookup, no switch over formats.
//
// The bytes of every format and value block, and the receiver's error bound per value type, are
// specified in daemon/transport/WIRE.md ("Payload layouts", "Value blocks") and pinned by golden
// tests (tests/unit/kernels/codec_formats_test.cc, codec_test.cc). In short: payloads are
// little-endian with no alignment requirement; fp32 is exact, fp16/bf16 round to nearest even
// and saturate, int8 has one float32 scale per message (max|x| / 127; NaN if any value is not
// finite). The pipeline keeps x - y in the error-feedback residual, so quantisation loses
// nothing for good.
//
// Decoders treat their input as hostile: every length, count, index, varint and run is checked
// in a first pass before anything is written, and a bad payload returns kDataLoss with a message
// naming the field, leaving `dense_out` untouched. Encoders return kInvalidArgument for a bad
// selection (indices not strictly increasing or out of range, sizes differing, output too small).
//
// Thread-safety: pure functions; concurrent calls on disjoint buffers are safe.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>

#include "sparsecar/common/status.h"
#include "sparsecar/kernels/codecs.h"
#include "sparsecar/kernels/types.h"

namespace sparsecar::kernels {

class ThreadPool;  // parallel.h

// Bytes of the value block for m values (0 for an unknown value type; saturates at SIZE_MAX).
size_t value_block_bytes(ValueType value_type, size_t m);

// Sizes a payload of (format, value_type) with nnz entries of a dense_len tensor can have,
// from what the wire header says alone (the row's size_range): min == max for dense, coo and
// bitmap; a range for coo_varint, csr and rle. {1, 0} (empty) for an unknown format or value
// type, or nnz > dense_len (or nnz != dense_len for a row with .dense). Saturates instead of
// wrapping for hostile inputs.
SizeRange payload_size_range(Format format, ValueType value_type, uint64_t dense_len, uint64_t nnz);

// The largest payload size (payload_size_range().max). Exact for dense, coo and bitmap; 0 for an
// unknown format/value type; a .dense row's size whatever nnz is; SIZE_MAX for nnz > dense_len
// otherwise (no payload holds it). Kept for callers that size buffers by (format, nnz).
size_t encoded_bytes(Format format, ValueType value_type, size_t dense_len, size_t nnz);

// A buffer of this many bytes holds any encoding of any selection of a dense_len tensor, in
// every format and value type (size the encode buffer once, at registration).
size_t max_encoded_bytes(size_t dense_len);

// How to encode one message.
struct EncodeParams {
  Format format = Format::kCoo;
  ValueType value_type = ValueType::kF32;
  // Rows with .needs_rows (csr) only: rows of the tensor's 2-D view (dense_len must be a multiple
  // of it); 1 for 1-D.
  uint32_t rows = 1;
};

// Exact payload size of `index` (strictly increasing, < dense_len) encoded as `params`.
// kInvalidArgument for a bad selection, unknown format/value type, or (rows with .needs_rows)
// rows that are 0 or do not divide dense_len.
Expected<size_t> encoded_size(const EncodeParams& params, size_t dense_len,
                              std::span<const uint32_t> index);

// Encodes the selection into out (out.size() >= encoded_size) and returns the bytes written
// (== encoded_size). Errors as encoded_size, plus index/value sizes differing or out too small;
// out's contents are unspecified after an error.
Expected<size_t> encode(const EncodeParams& params, size_t dense_len, std::span<const uint32_t> index,
                        std::span<const float> value, std::span<std::byte> out);

// `auto`: the exact size of every row's format for this selection and the smallest. A format that
// cannot carry it (a row with .needs_rows when rows do not divide dense_len) gets SIZE_MAX. Ties
// go to the row with the lowest auto_rank, the faster decoder (coo, bitmap, dense, csr,
// coo_varint, rle).
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
