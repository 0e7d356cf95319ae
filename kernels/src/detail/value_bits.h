// The value blocks' conversions (WIRE.md "Value blocks"), written once for the CPU codecs
// (quantize.cc, codec_internal.h) and the CUDA codecs (cuda/detail/codec_kernels.cuh): fp32 to
// IEEE binary16 and bfloat16 with round to nearest even and saturation (NaN kept, made quiet;
// +-inf kept), back to fp32, and the int8 code of a value for a scale. SC_HOST_DEVICE compiles
// them for both under nvcc, so a device encoder writes the CPU's bytes bit for bit. Only exact
// integer operations and exactly rounded float operations are used; the one rounding step of
// each (lrint / nearbyint on the host, __float2int_rn / rintf on the device) is round to nearest
// even in the default floating-point environment, which sparsecar never changes.
//
// fp32 -> fp16 on the host uses the compiler's _Float16 conversion where the compiler has one
// (GCC 12+ on x86-64; not clang 14, not nvcc): IEEE round to nearest even, subnormals included,
// NaN made quiet with its top payload bits -- checked equal to the integer code below for all
// 2^32 inputs with GCC 12. Saturation is ours, not IEEE's (IEEE rounds |x| >= 65520 to inf), so
// that guard stays in front of it. nvcc (host and device passes alike) and compilers without
// _Float16 keep the integer code, so the CUDA codecs still write the CPU's bytes bit for bit.
// fp16 -> fp32 stays integer code everywhere: _Float16's widening quiets a signalling NaN, while
// WIRE.md keeps a NaN's bits ("inf/NaN kept").
// Without F16C, GCC converts _Float16 through libgcc (~34 ns an element vs ~4 ns for the integer
// code, measured here); SC_F16_CLONES on a loop adds an x86-64-v3 (F16C) clone chosen at load
// time (vcvtps2ph, ~2 ns an element).
//
// Thread-safety: pure functions.
#pragma once

#include <cmath>
#include <cstdint>

#include "detail/bits.h"

#if !defined(__CUDACC__) && defined(__FLT16_MAX__)
#define SC_HOST_FLOAT16 1
#include <bit>
#else
#define SC_HOST_FLOAT16 0
#endif
#if SC_HOST_FLOAT16 && defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define SC_F16_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define SC_F16_CLONES
#endif

namespace sparsecar::kernels::detail {

// fp32 -> binary16 bits: round to nearest even; finite |x| >= 65504 (after rounding) saturates
// to +-65504; inf kept; NaN kept with the quiet bit set and the top mantissa bits.
SC_HOST_DEVICE uint16_t float_to_half_bits(float x) {
  const uint32_t bits = float_bits(x);
  const auto sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  const uint32_t ax = bits & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));  // NaN, quiet
  if (ax == 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u);                         // inf
  if (ax >= 0x477fe000u) return static_cast<uint16_t>(sign | 0x7bffu);  // >= 65504: saturate
#if SC_HOST_FLOAT16
  return std::bit_cast<uint16_t>(static_cast<_Float16>(x));
#else
  if (ax < 0x38800000u) {
    // Below 2^-14: a half subnormal, m * 2^-24. Scaling by 2^24 is exact (the result is below
    // 1024); the conversion to an integer rounds to even.
    const float scaled = bits_float(ax) * 16777216.0f;
#if defined(__CUDA_ARCH__)
    const auto m = static_cast<uint16_t>(__float2int_rn(scaled));
#else
    const auto m = static_cast<uint16_t>(std::lrint(scaled));
#endif
    return static_cast<uint16_t>(sign | m);
  }
  // Normal: rebias the exponent (127 -> 15) and round the 13 dropped bits to nearest even; a
  // mantissa carry correctly bumps the exponent (the saturation above keeps it below inf).
  uint32_t r = ax - (uint32_t{127 - 15} << 23);
  r += 0x0fffu + ((r >> 13) & 1u);
  return static_cast<uint16_t>(sign | (r >> 13));
#endif
}

SC_HOST_DEVICE float half_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1fu;
  const uint32_t m = h & 0x3ffu;
  if (e == 0) {
    const float mag = static_cast<float>(m) * 5.9604644775390625e-8f;  // m * 2^-24, exact
    return sign ? -mag : mag;
  }
  if (e == 31) return bits_float(sign | 0x7f800000u | (m << 13));
  return bits_float(sign | ((e + 112u) << 23) | (m << 13));
}

// fp32 -> bfloat16 bits: round to nearest even; what would round to inf saturates to the largest
// finite bf16; inf kept; NaN kept, made quiet.
SC_HOST_DEVICE uint16_t float_to_bf16_bits(float x) {
  uint32_t bits = float_bits(x);
  const uint32_t ax = bits & 0x7fffffffu;
  if (ax > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x40u);  // NaN, quiet
  if (ax >= 0x7f7f8000u && ax < 0x7f800000u) {
    return static_cast<uint16_t>(((bits >> 16) & 0x8000u) | 0x7f7fu);  // would round to inf
  }
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

SC_HOST_DEVICE float bf16_bits_to_float(uint16_t b) { return bits_float(uint32_t{b} << 16); }

// The int8 code of v for `scale` (max|x| / 127): round(v / scale) to nearest even, clamped to
// -127..127; 0 when the scale is not a positive finite number (all zeros, or a non-finite value
// made the scale NaN). The division is IEEE (nvcc's default -prec-div=true; __fdiv_rn says so).
SC_HOST_DEVICE int8_t int8_code_of(float v, float scale) {
#if defined(__CUDA_ARCH__)
  if (!(scale > 0.0f) || !isfinite(scale)) return 0;
  float q = rintf(__fdiv_rn(v, scale));
#else
  if (!(scale > 0.0f) || !std::isfinite(scale)) return 0;
  float q = std::nearbyint(v / scale);
#endif
  q = q > 127.0f ? 127.0f : (q < -127.0f ? -127.0f : q);
  return static_cast<int8_t>(q);
}

}  // namespace sparsecar::kernels::detail
