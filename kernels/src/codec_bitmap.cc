// Bitmap payloads (format 3) and dense payloads (format 0). Layouts in kernels/codec.h.
#include <bit>

#include "codec_internal.h"

namespace sparsecar::kernels::codec {
namespace {

size_t bitmap_bytes(size_t n) { return n / 8 + (n % 8 != 0); }

// Word w (64 bits, little-endian) of a bitmap of `bytes` bytes; the last word may be partial.
inline uint64_t bitmap_word(const std::byte* bm, size_t bytes, size_t w) {
  if (8 * w + 8 <= bytes) return load_u64(bm + 8 * w);
  uint64_t v = 0;
  std::memcpy(&v, bm + 8 * w, bytes - 8 * w);
  return v;
}

template <typename Reader>
void bitmap_scatter(const std::byte* bm, size_t bytes, Reader value, float* out) {
  const size_t words = bytes / 8 + (bytes % 8 != 0);
  size_t j = 0;
  for (size_t w = 0; w < words; ++w) {
    uint64_t bits = bitmap_word(bm, bytes, w);
    float* base = out + 64 * w;
    while (bits != 0) {
      base[std::countr_zero(bits)] += value(j++);
      bits &= bits - 1;
    }
  }
}

}  // namespace

size_t bitmap_write(ValueType vt, size_t n, std::span<const uint32_t> index, std::span<const float> value,
                    std::byte* out) {
  const size_t bytes = bitmap_bytes(n);
  if (bytes > 0) std::memset(out, 0, bytes);
  auto* bm = reinterpret_cast<unsigned char*>(out);
  for (uint32_t i : index) bm[i >> 3] = static_cast<unsigned char>(bm[i >> 3] | (1u << (i & 7u)));
  return bytes + write_values(vt, value, out + bytes);
}

Status bitmap_decode(ValueType vt, std::span<const std::byte> payload, uint64_t nnz, std::span<float> dense_out) {
  const size_t dense_len = dense_out.size();
  if (nnz > dense_len) {
    return data_loss("bitmap payload: nnz " + num(nnz) + " exceeds the dense length " + num(dense_len));
  }
  const size_t n = static_cast<size_t>(nnz);
  const size_t bytes = bitmap_bytes(dense_len);
  const size_t need = add_sat(bytes, value_bytes(vt, n));
  if (payload.size() != need) {
    return size_mismatch("bitmap", payload.size(), need, "for dense length " + num(dense_len) + " and nnz " + num(n));
  }
  const std::byte* bm = payload.data();
  size_t count = 0;
  const size_t full = bytes / 8;
  for (size_t w = 0; w < full; ++w) count += static_cast<size_t>(std::popcount(load_u64(bm + 8 * w)));
  for (size_t b = 8 * full; b < bytes; ++b) count += static_cast<size_t>(std::popcount(std::to_integer<uint8_t>(bm[b])));
  if (dense_len % 8 != 0) {
    const auto last = std::to_integer<uint8_t>(bm[bytes - 1]);
    if ((last >> (dense_len % 8)) != 0) {
      return data_loss("bitmap payload: bits past the dense length " + num(dense_len) + " are set (index out of range)");
    }
  }
  if (count != n) {
    return data_loss("bitmap payload: " + num(count) + " bits set but nnz is " + num(n));
  }
  const std::byte* values = payload.data() + bytes;
  SC_RETURN_IF_ERROR(check_values(vt, values, n, "bitmap"));
  with_reader(vt, values, [&](auto reader) { bitmap_scatter(bm, bytes, reader, dense_out.data()); });
  return Status::Ok();
}

Status dense_decode(ValueType vt, std::span<const std::byte> payload, uint64_t nnz, std::span<float> dense_out) {
  const size_t dense_len = dense_out.size();
  if (nnz != dense_len) {
    return data_loss("dense payload: nnz " + num(nnz) + " differs from the dense length " + num(dense_len));
  }
  const size_t need = value_bytes(vt, dense_len);
  if (payload.size() != need) {
    return size_mismatch("dense", payload.size(), need, "for " + num(dense_len) + " values");
  }
  SC_RETURN_IF_ERROR(check_values(vt, payload.data(), dense_len, "dense"));
  float* out = dense_out.data();
  with_reader(vt, payload.data(), [&](auto reader) {
    for (size_t i = 0; i < dense_len; ++i) out[i] += reader(i);
  });
  return Status::Ok();
}

}  // namespace sparsecar::kernels::codec
