// COO and dense payload encoders, and the validating decode-and-accumulate of the receiver.
#include "sparsecar/kernels/codec.h"

#include <bit>
#include <cstring>
#include <limits>
#include <string>

namespace sparsecar::kernels {
namespace {

static_assert(std::endian::native == std::endian::little,
              "payloads are little-endian; add byte swaps before building on a big-endian host");

constexpr size_t kCooEntryBytes = sizeof(uint32_t) + sizeof(float);

size_t mul_saturating(size_t a, size_t b) {
  size_t r = 0;
  return __builtin_mul_overflow(a, b, &r) ? std::numeric_limits<size_t>::max() : r;
}

// Unaligned little-endian loads: payloads come straight from the network buffer.
inline uint32_t load_u32(const std::byte* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline float load_f32(const std::byte* p) {
  float v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// Index of the first entry that breaks "strictly increasing and < dense_len", or nnz if none.
// The common (valid) case is one branch-free pass that the compiler vectorises.
size_t first_bad_index(const std::byte* idx, size_t nnz, size_t dense_len) {
  if (nnz == 0) return 0;
  bool bad = false;
  for (size_t i = 1; i < nnz; ++i) bad |= load_u32(idx + 4 * i) <= load_u32(idx + 4 * (i - 1));
  // Strictly increasing, so the last index is the largest.
  if (!bad && load_u32(idx + 4 * (nnz - 1)) < dense_len) return nnz;
  if (load_u32(idx) >= dense_len) return 0;
  for (size_t i = 1; i < nnz; ++i) {
    const uint32_t cur = load_u32(idx + 4 * i);
    if (cur <= load_u32(idx + 4 * (i - 1)) || cur >= dense_len) return i;
  }
  return nnz;
}

}  // namespace

size_t encoded_bytes(Format format, ValueType value_type, size_t dense_len, size_t nnz) {
  if (value_type != ValueType::kF32) return 0;
  switch (format) {
    case Format::kDense: return mul_saturating(dense_len, sizeof(float));
    case Format::kCoo: return mul_saturating(nnz, kCooEntryBytes);
  }
  return 0;
}

Status coo_encode(std::span<const uint32_t> index, std::span<const float> value,
                  std::span<std::byte> out) {
  const size_t nnz = index.size();
  if (value.size() != nnz) {
    return invalid_argument("coo_encode: " + std::to_string(nnz) + " indices but " +
                            std::to_string(value.size()) + " values");
  }
  const size_t need = mul_saturating(nnz, kCooEntryBytes);
  if (out.size() < need) {
    return invalid_argument("coo_encode: output of " + std::to_string(out.size()) +
                            " bytes, " + std::to_string(nnz) + " entries need " +
                            std::to_string(need));
  }
  bool bad = false;
  for (size_t i = 1; i < nnz; ++i) bad |= index[i] <= index[i - 1];
  if (bad) {
    for (size_t i = 1; i < nnz; ++i) {
      if (index[i] <= index[i - 1]) {
        return invalid_argument("coo_encode: index[" + std::to_string(i) + "]=" +
                                std::to_string(index[i]) + " is not greater than index[" +
                                std::to_string(i - 1) + "]=" + std::to_string(index[i - 1]));
      }
    }
  }
  if (nnz > 0) {
    std::memcpy(out.data(), index.data(), nnz * sizeof(uint32_t));
    std::memcpy(out.data() + nnz * sizeof(uint32_t), value.data(), nnz * sizeof(float));
  }
  return Status::Ok();
}

Status dense_encode(std::span<const float> values, std::span<std::byte> out) {
  const size_t need = values.size() * sizeof(float);
  if (out.size() < need) {
    return invalid_argument("dense_encode: output of " + std::to_string(out.size()) +
                            " bytes, need " + std::to_string(need));
  }
  if (need > 0) std::memcpy(out.data(), values.data(), need);
  return Status::Ok();
}

Status decode_accumulate(Format format, ValueType value_type, std::span<const std::byte> payload,
                         uint64_t nnz, std::span<float> dense_out) {
  const size_t dense_len = dense_out.size();
  if (value_type != ValueType::kF32) {
    return data_loss("payload value_type " + std::to_string(static_cast<unsigned>(value_type)) +
                     " is unknown");
  }
  switch (format) {
    case Format::kDense: {
      if (nnz != dense_len) {
        return data_loss("dense payload: nnz " + std::to_string(nnz) +
                         " differs from the dense length " + std::to_string(dense_len));
      }
      const size_t need = dense_len * sizeof(float);
      if (payload.size() != need) {
        return data_loss("dense payload: payload_bytes " + std::to_string(payload.size()) +
                         ", expected " + std::to_string(need) + " for " +
                         std::to_string(dense_len) + " values");
      }
      const std::byte* p = payload.data();
      float* out = dense_out.data();
      for (size_t i = 0; i < dense_len; ++i) out[i] += load_f32(p + 4 * i);
      return Status::Ok();
    }
    case Format::kCoo: {
      if (nnz > dense_len) {
        return data_loss("coo payload: nnz " + std::to_string(nnz) + " exceeds the dense length " +
                         std::to_string(dense_len));
      }
      const size_t n = static_cast<size_t>(nnz);
      const size_t need = n * kCooEntryBytes;
      if (payload.size() != need) {
        return data_loss("coo payload: payload_bytes " + std::to_string(payload.size()) +
                         ", expected " + std::to_string(need) + " for nnz " + std::to_string(n));
      }
      const std::byte* idx = payload.data();
      const std::byte* val = payload.data() + n * sizeof(uint32_t);
      const size_t bad = first_bad_index(idx, n, dense_len);
      if (bad < n) {
        const uint32_t at = load_u32(idx + 4 * bad);
        if (at >= dense_len) {
          return data_loss("coo payload: index[" + std::to_string(bad) + "]=" +
                           std::to_string(at) + " is outside the dense length " +
                           std::to_string(dense_len));
        }
        return data_loss("coo payload: index[" + std::to_string(bad) + "]=" + std::to_string(at) +
                         " is not greater than index[" + std::to_string(bad - 1) + "]=" +
                         std::to_string(load_u32(idx + 4 * (bad - 1))));
      }
      float* out = dense_out.data();
      for (size_t i = 0; i < n; ++i) out[load_u32(idx + 4 * i)] += load_f32(val + 4 * i);
      return Status::Ok();
    }
  }
  return data_loss("payload format " + std::to_string(static_cast<unsigned>(format)) +
                   " is unknown");
}

}  // namespace sparsecar::kernels
