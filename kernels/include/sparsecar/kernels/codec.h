// Encoders and decoders of selections into message payloads (the bytes after the wire header).
//
// Payloads are little-endian. Decoders treat their input as hostile: every length, count and
// index is checked before anything is written, and a bad payload returns kDataLoss with a
// message naming the field, leaving `dense_out` untouched.
//
// Thread-safety: pure functions.
//
// Layouts (frozen; see daemon/transport/WIRE.md):
//   kDense: float32 value[dense_len]                       -> dense_len * 4 bytes
//   kCoo:   uint32 index[nnz] strictly increasing, < dense_len; then float32 value[nnz]
//                                                          -> nnz * 8 bytes
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "sparsecar/common/status.h"
#include "sparsecar/kernels/types.h"

namespace sparsecar::kernels {

// Exact payload size of a selection of nnz out of dense_len elements in `format`. 0 for an
// unknown format or value type; saturates at SIZE_MAX instead of wrapping (for hostile nnz).
size_t encoded_bytes(Format format, ValueType value_type, size_t dense_len, size_t nnz);

// COO: writes index[] then value[] into out (out.size() must be >= encoded_bytes). Errors
// (kInvalidArgument): index/value sizes differ, out too small, indices not strictly increasing;
// out's contents are unspecified after an error.
Status coo_encode(std::span<const uint32_t> index, std::span<const float> value,
                  std::span<std::byte> out);
// Dense: writes the values as-is. Error (kInvalidArgument): out too small.
Status dense_encode(std::span<const float> values, std::span<std::byte> out);

// Validates `payload` as `format` with `nnz` entries for a tensor of dense_out.size() elements,
// then adds it into dense_out (dense_out[index] += value). On error nothing is written.
// Checks, each failing with kDataLoss and a message naming the field: value_type and format
// known; kDense: nnz == dense length and payload_bytes == 4 * dense length; kCoo: nnz <= dense
// length, payload_bytes == 8 * nnz, every index[i] < dense length and > index[i - 1].
Status decode_accumulate(Format format, ValueType value_type, std::span<const std::byte> payload,
                         uint64_t nnz, std::span<float> dense_out);

// CRC-32C (Castagnoli), hardware-accelerated where SSE4.2 is present (checked at run time),
// slicing-by-8 tables otherwise. crc32c(0, p, n) of the ASCII bytes "123456789" is 0xE3069283.
// Chains: crc32c(crc32c(0, a, na), b, nb) == crc32c(0, a||b, na + nb).
uint32_t crc32c(uint32_t crc, const void* data, size_t size);

}  // namespace sparsecar::kernels
