// Helpers shared by the kernel tests: seeded data generators, the ISAs to run, bitwise compare.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/src/detail/cpu.h"

namespace sparsecar::kernels::testing {

using detail::Isa;

// Every ISA variant: the portable one always, AVX-512 where this CPU has it (the test skips
// itself otherwise, so the skip shows up in the output).
inline std::vector<Isa> all_isas() { return {Isa::kPortable, Isa::kAvx512}; }
inline bool isa_available(Isa isa) {
  return isa == Isa::kPortable || detail::best_isa() == Isa::kAvx512;
}
inline std::string isa_name(Isa isa) { return isa == Isa::kAvx512 ? "avx512" : "portable"; }

inline bool same_bits(float a, float b) {
  return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b);
}

inline std::vector<float> normal_floats(size_t n, uint64_t seed, float sigma = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> dist(0.0f, sigma);
  std::vector<float> x(n);
  for (float& v : x) v = dist(rng);
  return x;
}

// Hostile values: ties, +-0, +-inf, NaNs of several payloads and signs, denormals, extremes.
inline std::vector<float> special_floats(size_t n, uint64_t seed) {
  const float inf = std::numeric_limits<float>::infinity();
  const float pool[] = {0.0f, -0.0f, 1.0f, -1.0f, 2.0f, -2.0f, 0.5f, inf, -inf,
                        std::numeric_limits<float>::quiet_NaN(),
                        -std::numeric_limits<float>::quiet_NaN(),
                        std::bit_cast<float>(0x7fa00001u),  // signalling-pattern NaN
                        std::bit_cast<float>(0xffffffffu),  // NaN, all payload bits
                        std::numeric_limits<float>::denorm_min(),
                        -std::numeric_limits<float>::denorm_min(),
                        std::bit_cast<float>(0x00400000u),  // a mid denormal
                        std::numeric_limits<float>::min(), std::numeric_limits<float>::max(),
                        -std::numeric_limits<float>::max(), 1e-30f, 3.0f, -3.0f};
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<size_t> pick(0, std::size(pool) - 1);
  std::vector<float> x(n);
  for (float& v : x) v = pool[pick(rng)];
  return x;
}

// Values whose magnitudes share the top 11 key bits (and often the next 10), so top-k must
// resolve the k-th element in its second and third digit, with exact ties in the last one.
inline std::vector<float> same_bin_floats(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<uint32_t> low(0, (1u << 20) - 1);
  std::uniform_int_distribution<uint32_t> coin(0, 3);
  std::vector<float> x(n);
  for (float& v : x) {
    uint32_t bits = 0x3f800000u;                      // 1.0f: one 11-bit bin spans [1, 1.125)
    // A quarter spread over the whole bin; the rest share bits 19..10 and take one of 8 low
    // patterns, so the k-th key usually has many exact ties.
    bits |= coin(rng) == 0 ? low(rng) : ((0x155u << 10) | (low(rng) & 0x7u));
    if (coin(rng) & 1) bits |= 0x80000000u;
    v = std::bit_cast<float>(bits);
  }
  return x;
}

}  // namespace sparsecar::kernels::testing
