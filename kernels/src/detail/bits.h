// The bit-level rules every backend shares, written once for the CPU and the CUDA kernels
// (SC_HOST_DEVICE compiles them for both under nvcc): the magnitude key that orders |x|, and the
// counter-based random draw of the random selectors. A CUDA kernel that calls these gives the
// CPU's keys and draws bit for bit, which is what makes "equal to the CPU reference" possible.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define SC_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define SC_HOST_DEVICE inline
#endif

namespace sparsecar::kernels::detail {

// |v| as an unsigned key that orders like the magnitude: the float's bits without the sign.
// Every NaN maps to one key just above +inf, so NaNs are "larger than every number" and equal
// to each other (ties among NaNs are then broken by index like any other tie).
inline constexpr uint32_t kNanKey = 0x7f800001u;
SC_HOST_DEVICE uint32_t float_bits(float v) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(v);
#else
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof bits);
  return bits;
#endif
}
SC_HOST_DEVICE uint32_t magnitude_key(float v) {
  const uint32_t bits = float_bits(v) & 0x7fffffffu;
  return bits < kNanKey ? bits : kNanKey;
}
// The key a hard threshold lambda selects from: |x_i| >= lambda is magnitude_key(x_i) >= this.
// A lambda that is not > 0 (zero, negative, NaN) selects everything.
SC_HOST_DEVICE uint32_t lambda_key(float lambda) { return lambda > 0.0f ? magnitude_key(lambda) : 0u; }

// Float arithmetic as the CPU does it, NaN payloads included, so that a NaN the GPU sends or
// keeps has the CPU's bits. x86-64 (SSE/AVX) returns the first operand's NaN (quieted), else
// the second's, and the "default NaN" 0xffc00000 for inf - inf or 0 * inf; a GPU returns the
// canonical NaN 0x7fffffff. Only the NaN results are patched, so the device code's speed is that
// of a plain add.
SC_HOST_DEVICE float bits_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float v;
  std::memcpy(&v, &bits, sizeof v);
  return v;
#endif
}
SC_HOST_DEVICE bool is_nan(float v) { return (float_bits(v) & 0x7fffffffu) > 0x7f800000u; }
SC_HOST_DEVICE float quieted(float v) { return bits_float(float_bits(v) | 0x00400000u); }
SC_HOST_DEVICE float x86_nan(float a, float b) {
  if (is_nan(a)) return quieted(a);
  if (is_nan(b)) return quieted(b);
  return bits_float(0xffc00000u);
}
SC_HOST_DEVICE float cpu_add(float a, float b) {
#if defined(__CUDA_ARCH__)
  const float r = __fadd_rn(a, b);
  return is_nan(r) ? x86_nan(a, b) : r;
#else
  return a + b;
#endif
}
SC_HOST_DEVICE float cpu_mul(float a, float b) {
#if defined(__CUDA_ARCH__)
  const float r = __fmul_rn(a, b);
  return is_nan(r) ? x86_nan(a, b) : r;
#else
  return a * b;
#endif
}
// static_cast<float>(static_cast<double>(v) * scale) with a finite scale: a NaN keeps its payload
// (quieted) through both conversions on the CPU.
SC_HOST_DEVICE float cpu_scale_f64(float v, double scale) {
#if defined(__CUDA_ARCH__)
  return is_nan(v) ? quieted(v) : static_cast<float>(__dmul_rn(static_cast<double>(v), scale));
#else
  return static_cast<float>(static_cast<double>(v) * scale);
#endif
}

// murmur3's 32-bit finaliser (a bijection with full avalanche) and splitmix64's.
SC_HOST_DEVICE uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}
SC_HOST_DEVICE uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
// random_draw(seed, i) with splitmix64(seed) already split into (a, b).
SC_HOST_DEVICE uint32_t draw(uint32_t a, uint32_t b, uint32_t index) { return fmix32(fmix32(index ^ a) + b); }

// The fixed stratified sample that estimates a magnitude rank (approximate top-k, the
// percentile selector's lambda, top-k's bracket): up to kSampleMax keys, all of x when n is at
// most that; s strata of n / s elements with one position in each, drawn with a fixed seed, so
// every call, node and backend samples the same positions.
inline constexpr size_t kSampleMax = 16384;
inline constexpr uint64_t kSampleSeed = 0x5ca1ab1e0ddba11ull;
SC_HOST_DEVICE size_t sample_size(size_t n) {
  if (n <= kSampleMax) return n;
  const size_t s = n / 256;
  return s < 4096 ? 4096 : (s > kSampleMax ? kSampleMax : s);
}
// The position of sample j (stride = n / s; a, b from splitmix64(kSampleSeed)): a position in
// [0, stride) of stratum j by multiply-shift.
SC_HOST_DEVICE size_t sample_position(size_t j, size_t stride, uint32_t a, uint32_t b) {
  return j * stride + static_cast<size_t>((uint64_t{draw(a, b, static_cast<uint32_t>(j))} * stride) >> 32);
}

// Approximate top-k's threshold rank (host code of both backends): the 0-based position, in
// decreasing order, of the sample key taken as lambda for k of n elements with s samples. k s / n
// - 1 exactly when the sample is all of x; else aimed above k (by tolerance / 2, or by 2 sigma of
// the binomial sample rank when the sample is too coarse for the tolerance), because a count
// below k costs a full exact pass while one above it is cheap. 0 < k < n, s >= 1.
inline size_t approx_sample_position(size_t k, size_t n, size_t s, double tolerance) {
  const double r = static_cast<double>(k) * static_cast<double>(s) / static_cast<double>(n);
  double aim = r;
  if (s < n) {
    const double two_sigma = 2.0 * std::sqrt(r);
    aim = two_sigma > r * tolerance ? r + two_sigma : r * (1.0 + tolerance / 2.0);
  }
  const double pos = std::round(aim) - 1.0;
  return static_cast<size_t>(std::clamp(pos, 0.0, static_cast<double>(s - 1)));
}

}  // namespace sparsecar::kernels::detail
