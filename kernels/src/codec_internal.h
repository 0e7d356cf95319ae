// Internals shared by the codec files (codec.cc: the public API; codecs.cc: the registry rows;
// codec_*.cc: one format family each; quantize.cc: the value types). Layouts: WIRE.md.
//
// Layering: the public functions in codec.cc validate the selection (encoders) or the format and
// value type (decoders) and then call the row's functions (codecs.cc), which call the
// per-format functions:
//   - *_write: assume a valid selection and an output buffer of the exact size; return bytes;
//   - *_decode: validate the whole payload first (kDataLoss naming the field, nothing written),
//     then accumulate.
// Thread-safety: pure functions.
#pragma once

#include <bit>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <span>
#include <string>

#include "detail/value_bits.h"
#include "sparsecar/common/status.h"
#include "sparsecar/kernels/codec.h"
#include "sparsecar/kernels/parallel.h"
#include "sparsecar/kernels/types.h"

namespace sparsecar::kernels::codec {

static_assert(std::endian::native == std::endian::little,
              "payloads are little-endian; add byte swaps before building on a big-endian host");

inline constexpr size_t kSizeMax = std::numeric_limits<size_t>::max();

inline size_t mul_sat(size_t a, size_t b) {
  size_t r = 0;
  return __builtin_mul_overflow(a, b, &r) ? kSizeMax : r;
}
inline size_t add_sat(size_t a, size_t b) {
  size_t r = 0;
  return __builtin_add_overflow(a, b, &r) ? kSizeMax : r;
}

// Unaligned little-endian loads and stores: payloads come straight from the network buffer.
inline uint16_t load_u16(const std::byte* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline uint32_t load_u32(const std::byte* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline uint64_t load_u64(const std::byte* p) {
  uint64_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline float load_f32(const std::byte* p) {
  float v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void store_u16(std::byte* p, uint16_t v) { std::memcpy(p, &v, sizeof v); }
inline void store_u32(std::byte* p, uint32_t v) { std::memcpy(p, &v, sizeof v); }
inline void store_f32(std::byte* p, float v) { std::memcpy(p, &v, sizeof v); }

inline std::string num(uint64_t v) { return std::to_string(v); }

// ---- LEB128 varints of uint32 (at most 5 bytes, minimal length) -------------------------------
inline size_t varint_len(uint32_t v) {
  // 1 + floor(bit_width / 7), with 0 taking one byte.
  return 1 + (static_cast<size_t>(std::bit_width(v | 1u)) - 1) / 7;
}
inline std::byte* varint_put(std::byte* p, uint32_t v) {
  while (v >= 0x80u) {
    *p++ = static_cast<std::byte>((v & 0x7fu) | 0x80u);
    v >>= 7;
  }
  *p++ = static_cast<std::byte>(v);
  return p;
}
// Reads one varint from [p, end). Returns the bytes consumed, or 0 if it is truncated, longer
// than 5 bytes, overflows 32 bits or is not minimal (a last byte of 0 after the first).
inline size_t varint_get(const std::byte* p, const std::byte* end, uint32_t* out) {
  uint32_t v = 0;
  for (size_t i = 0; i < 5; ++i) {
    if (p + i >= end) return 0;
    const uint32_t b = std::to_integer<uint32_t>(p[i]);
    if (i == 4 && b > 0x0fu) return 0;  // would overflow 32 bits (or continue past 5 bytes)
    v |= (b & 0x7fu) << (7 * i);
    if ((b & 0x80u) == 0) {
      if (i > 0 && b == 0) return 0;  // overlong: a redundant zero byte
      *out = v;
      return i + 1;
    }
  }
  return 0;
}

// ---- value blocks (quantize.cc) --------------------------------------------------------------
size_t value_bytes(ValueType vt, size_t m);  // kSizeMax for an unknown type (callers check)
bool known_value_type(ValueType vt);
// The int8 scale for these values: max|v| / 127, NaN if any value is not finite, 0 if all are 0.
float int8_scale(std::span<const float> value);
// detail/value_bits.h's, shared with the CUDA codecs.
inline int8_t int8_code(float v, float scale) { return detail::int8_code_of(v, scale); }
// Writes V(m) for `value` in order; returns the bytes written (value_bytes(vt, m)).
size_t write_values(ValueType vt, std::span<const float> value, std::byte* out);
// Writes V(n): zeros except value[j] at index[j].
size_t write_values_scattered(ValueType vt, std::span<const uint32_t> index,
                              std::span<const float> value, size_t n, std::byte* out);
// Checks a value block of m values at p (int8: scale and codes); kDataLoss naming `what`.
Status check_values(ValueType vt, const std::byte* p, size_t m, const char* what);

// Readers: value j of a block. Valid blocks only (check_values first).
struct F32Reader {
  const std::byte* p;
  float operator()(size_t j) const { return load_f32(p + 4 * j); }
};
struct F16Reader {
  const std::byte* p;
  float operator()(size_t j) const { return half_to_float(load_u16(p + 2 * j)); }
};
struct Bf16Reader {
  const std::byte* p;
  float operator()(size_t j) const { return std::bit_cast<float>(uint32_t{load_u16(p + 2 * j)} << 16); }
};
struct I8Reader {
  const std::byte* p;  // the block: scale, then codes
  float scale;
  explicit I8Reader(const std::byte* block) : p(block + 4), scale(load_f32(block)) {}
  float operator()(size_t j) const { return static_cast<float>(static_cast<int8_t>(std::to_integer<uint8_t>(p[j]))) * scale; }
};
// Calls fn(reader) with the reader of the block's type (vt known).
template <typename Fn>
void with_reader(ValueType vt, const std::byte* block, Fn&& fn) {
  switch (vt) {
    case ValueType::kF32: fn(F32Reader{block}); return;
    case ValueType::kF16: fn(F16Reader{block}); return;
    case ValueType::kBf16: fn(Bf16Reader{block}); return;
    case ValueType::kI8: fn(I8Reader(block)); return;
  }
}

// ---- formats (codec_coo.cc, codec_bitmap.cc, codec_csr.cc, codec_rle.cc) ---------------------
// Called only by the registry rows (codecs.cc), which give them the rows' signatures.
// Index bytes of each variable-size layout for a valid selection.
size_t varint_index_bytes(std::span<const uint32_t> index);
size_t rle_index_bytes(std::span<const uint32_t> index);
// CSR: column index width for cols.
inline size_t csr_col_width(uint64_t cols) { return cols <= 65536 ? 2 : 4; }

size_t coo_write(ValueType vt, std::span<const uint32_t> index, std::span<const float> value, std::byte* out);
size_t coo_varint_write(ValueType vt, std::span<const uint32_t> index, std::span<const float> value,
                        std::byte* out);
size_t rle_write(ValueType vt, std::span<const uint32_t> index, std::span<const float> value, std::byte* out);
size_t bitmap_write(ValueType vt, size_t n, std::span<const uint32_t> index, std::span<const float> value,
                    std::byte* out);
size_t csr_write(ValueType vt, size_t n, uint32_t rows, std::span<const uint32_t> index,
                 std::span<const float> value, std::byte* out);

// The scatters of dense, COO and bitmap split over `pool` when one is given (parallel.h); the
// validation before them runs on the calling thread.
Status dense_decode(ValueType vt, std::span<const std::byte> payload, uint64_t nnz, std::span<float> out,
                    ThreadPool* pool);
Status coo_decode(ValueType vt, std::span<const std::byte> payload, uint64_t nnz, std::span<float> out,
                  ThreadPool* pool);
Status coo_varint_decode(ValueType vt, std::span<const std::byte> payload, uint64_t nnz, std::span<float> out);
Status rle_decode(ValueType vt, std::span<const std::byte> payload, uint64_t nnz, std::span<float> out);
Status bitmap_decode(ValueType vt, std::span<const std::byte> payload, uint64_t nnz, std::span<float> out,
                     ThreadPool* pool);
Status csr_decode(ValueType vt, std::span<const std::byte> payload, uint64_t nnz, std::span<float> out);

// "payload_bytes N, expected M ..." for a size mismatch of `format`.
Status size_mismatch(const char* format, size_t got, size_t want, const std::string& why);

}  // namespace sparsecar::kernels::codec
