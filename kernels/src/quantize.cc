// Value blocks: fp32 / fp16 / bf16 / int8-with-scale (layouts and bounds: WIRE.md "Value blocks").
#include <algorithm>
#include <cmath>

#include "codec_internal.h"
#include "detail/value_bits.h"

namespace sparsecar::kernels {

// The conversions themselves are detail/value_bits.h's, shared with the CUDA codecs.
uint16_t float_to_half(float x) { return detail::float_to_half_bits(x); }
float half_to_float(uint16_t h) { return detail::half_bits_to_float(h); }
uint16_t float_to_bf16(float x) { return detail::float_to_bf16_bits(x); }
float bf16_to_float(uint16_t b) { return detail::bf16_bits_to_float(b); }

namespace codec {
namespace {

// The fp16 loops, each with an F16C clone where the conversion is the compiler's (value_bits.h).
SC_F16_CLONES void halves_of(const float* value, size_t m, std::byte* out) {
  for (size_t j = 0; j < m; ++j) store_u16(out + 2 * j, detail::float_to_half_bits(value[j]));
}
SC_F16_CLONES void halves_scattered(const uint32_t* index, const float* value, size_t k, std::byte* out) {
  for (size_t j = 0; j < k; ++j) store_u16(out + 2 * size_t{index[j]}, detail::float_to_half_bits(value[j]));
}
SC_F16_CLONES void half_roundtrip(const float* value, size_t m, float* out) {
  for (size_t j = 0; j < m; ++j) out[j] = detail::half_bits_to_float(detail::float_to_half_bits(value[j]));
}

}  // namespace

bool known_value_type(ValueType vt) { return find_value_type(vt) != nullptr; }

size_t value_bytes(ValueType vt, size_t m) {
  switch (vt) {
    case ValueType::kF32: return mul_sat(m, 4);
    case ValueType::kF16:
    case ValueType::kBf16: return mul_sat(m, 2);
    case ValueType::kI8: return add_sat(m, 4);
  }
  return kSizeMax;
}

float int8_scale(std::span<const float> value) {
  float max_abs = 0.0f;
  bool finite = true;
  for (float v : value) {
    const float a = std::fabs(v);
    finite &= std::isfinite(v);
    max_abs = a > max_abs ? a : max_abs;
  }
  if (!finite) return std::numeric_limits<float>::quiet_NaN();
  return max_abs / 127.0f;
}

size_t write_values(ValueType vt, std::span<const float> value, std::byte* out) {
  const size_t m = value.size();
  switch (vt) {
    case ValueType::kF32:
      if (m > 0) std::memcpy(out, value.data(), 4 * m);
      return 4 * m;
    case ValueType::kF16:
      halves_of(value.data(), m, out);
      return 2 * m;
    case ValueType::kBf16:
      for (size_t j = 0; j < m; ++j) store_u16(out + 2 * j, float_to_bf16(value[j]));
      return 2 * m;
    case ValueType::kI8: {
      const float scale = int8_scale(value);
      store_f32(out, scale);
      for (size_t j = 0; j < m; ++j) out[4 + j] = static_cast<std::byte>(int8_code(value[j], scale));
      return 4 + m;
    }
  }
  return 0;
}

size_t write_values_scattered(ValueType vt, std::span<const uint32_t> index, std::span<const float> value,
                              size_t n, std::byte* out) {
  const size_t bytes = value_bytes(vt, n);
  const size_t k = index.size();
  switch (vt) {
    case ValueType::kF32:
      if (n > 0) std::memset(out, 0, 4 * n);
      for (size_t j = 0; j < k; ++j) store_f32(out + 4 * size_t{index[j]}, value[j]);
      break;
    case ValueType::kF16:
      if (n > 0) std::memset(out, 0, 2 * n);
      halves_scattered(index.data(), value.data(), k, out);
      break;
    case ValueType::kBf16:
      if (n > 0) std::memset(out, 0, 2 * n);
      for (size_t j = 0; j < k; ++j) store_u16(out + 2 * size_t{index[j]}, float_to_bf16(value[j]));
      break;
    case ValueType::kI8: {
      const float scale = int8_scale(value);
      store_f32(out, scale);
      if (n > 0) std::memset(out + 4, 0, n);
      for (size_t j = 0; j < k; ++j) out[4 + size_t{index[j]}] = static_cast<std::byte>(int8_code(value[j], scale));
      break;
    }
  }
  return bytes;
}

Status check_values(ValueType vt, const std::byte* p, size_t m, const char* what) {
  if (vt != ValueType::kI8) return Status::Ok();  // every fp32/fp16/bf16 bit pattern is a value
  const float scale = load_f32(p);
  if (std::signbit(scale) || std::isinf(scale)) {
    return data_loss(std::string(what) + " payload: int8 scale " + std::to_string(scale) +
                     " is negative or infinite");
  }
  bool bad = false;
  for (size_t j = 0; j < m; ++j) bad |= p[4 + j] == std::byte{0x80};
  if (bad) {
    for (size_t j = 0; j < m; ++j) {
      if (p[4 + j] == std::byte{0x80}) {
        return data_loss(std::string(what) + " payload: int8 value[" + num(j) + "] is -128 (codes are -127..127)");
      }
    }
  }
  return Status::Ok();
}

}  // namespace codec

Status quantize_roundtrip(ValueType value_type, std::span<const float> value, std::span<float> out) {
  if (value.size() != out.size()) {
    return invalid_argument("quantize_roundtrip: " + codec::num(value.size()) + " values but room for " +
                            codec::num(out.size()));
  }
  const size_t m = value.size();
  switch (value_type) {
    case ValueType::kF32:
      std::copy(value.begin(), value.end(), out.begin());
      return Status::Ok();
    case ValueType::kF16:
      codec::half_roundtrip(value.data(), m, out.data());
      return Status::Ok();
    case ValueType::kBf16:
      for (size_t j = 0; j < m; ++j) out[j] = bf16_to_float(float_to_bf16(value[j]));
      return Status::Ok();
    case ValueType::kI8: {
      const float scale = codec::int8_scale(value);
      for (size_t j = 0; j < m; ++j) out[j] = static_cast<float>(codec::int8_code(value[j], scale)) * scale;
      return Status::Ok();
    }
  }
  return invalid_argument("quantize_roundtrip: value type " + codec::num(static_cast<unsigned>(value_type)) +
                          " is unknown");
}

}  // namespace sparsecar::kernels
