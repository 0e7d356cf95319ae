// Value blocks: fp32 / fp16 / bf16 / int8-with-scale (layouts and bounds: WIRE.md "Value blocks").
#include <algorithm>
#include <cmath>

#include "codec_internal.h"

namespace sparsecar::kernels {

uint16_t float_to_half(float x) {
  const uint32_t bits = std::bit_cast<uint32_t>(x);
  const auto sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t ax = bits & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));  // NaN, quiet
  if (ax == 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u);                         // inf
  if (ax >= 0x477fe000u) return static_cast<uint16_t>(sign | 0x7bffu);  // >= 65504: saturate
  if (ax < 0x38800000u) {
    // Below 2^-14: a half subnormal, m * 2^-24. Scaling by 2^24 is exact; lrint rounds to even.
    const float scaled = std::bit_cast<float>(ax) * 16777216.0f;
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::lrint(scaled)));
  }
  // Normal: rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest even; a
  // mantissa carry correctly bumps the exponent (the saturation above keeps it below inf).
  uint32_t r = ax - (uint32_t{127 - 15} << 23);
  r += 0x0fffu + ((r >> 13) & 1u);
  return static_cast<uint16_t>(sign | (r >> 13));
}

float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu;
  const uint32_t m = h & 0x3ffu;
  if (e == 0) {
    const float mag = static_cast<float>(m) * 5.9604644775390625e-8f;  // m * 2^-24, exact
    return sign ? -mag : mag;
  }
  if (e == 31) return std::bit_cast<float>(sign | 0x7f800000u | (m << 13));
  return std::bit_cast<float>(sign | ((e + 112u) << 23) | (m << 13));
}

uint16_t float_to_bf16(float x) {
  uint32_t bits = std::bit_cast<uint32_t>(x);
  const uint32_t ax = bits & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // NaN, quiet
  if (ax >= 0x7f7f8000u && ax < 0x7f800000u) {
    return static_cast<uint16_t>(((bits >> 16) & 0x8000u) | 0x7f7fu);  // would round to inf
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

float bf16_to_float(uint16_t b) { return std::bit_cast<float>(uint32_t{b} << 16); }

namespace codec {

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
      for (size_t j = 0; j < m; ++j) store_u16(out + 2 * j, float_to_half(value[j]));
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
      for (size_t j = 0; j < k; ++j) store_u16(out + 2 * size_t{index[j]}, float_to_half(value[j]));
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
      for (size_t j = 0; j < m; ++j) out[j] = half_to_float(float_to_half(value[j]));
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
