// Per-ISA pieces of the sampled top-k, random-k and importance selectors (select.cc dispatches).
// Separate from cpu.h so the selection kernels can grow without touching the shared CPU header.
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "cpu.h"  // relative: tests include this header without kernels/src on the path

namespace sparsecar::kernels::detail {

// Returned by the band passes when an output would overflow its capacity (the pass stops early).
inline constexpr size_t kBandOverflow = ~size_t{0};

// One streaming pass for the sampled top-k: every i with key > hi goes to out_* (in index order;
// at most out_cap), every i with lo <= key <= hi to band_* (at most band_cap). Returns the
// count written to out_* and the band count in *n_band, or kBandOverflow when either would
// exceed its capacity (then the outputs are partial and must be ignored). Every output buffer
// must have kBandSlack entries beyond its capacity: the AVX-512 variant stores whole vectors.
inline constexpr size_t kBandSlack = 16;
size_t topk_band_portable(const float* x, size_t n, uint32_t lo, uint32_t hi, uint32_t* out_index,
                          float* out_value, size_t out_cap, uint32_t* band_index,
                          float* band_value, size_t band_cap, size_t* n_band);
size_t topk_band_avx512(const float* x, size_t n, uint32_t lo, uint32_t hi, uint32_t* out_index,
                        float* out_value, size_t out_cap, uint32_t* band_index, float* band_value,
                        size_t band_cap, size_t* n_band);

// Dense-k variant of the same idea, two streaming passes and no merge: count_band counts the
// keys > hi and stores the band's keys (lo <= key <= hi, at most band_cap, + kBandSlack room);
// final writes every i with key > kth plus the first `ties` with key == kth, in index order, to
// out_* (exactly k entries; no slack needed) and returns the count (kBandOverflow if more).
size_t topk_count_band_portable(const float* x, size_t n, uint32_t lo, uint32_t hi,
                                 uint32_t* band_keys, size_t band_cap, size_t* n_band);
size_t topk_count_band_avx512(const float* x, size_t n, uint32_t lo, uint32_t hi,
                              uint32_t* band_keys, size_t band_cap, size_t* n_band);
size_t topk_final_portable(const float* x, size_t n, uint32_t kth, size_t ties,
                           uint32_t* out_index, float* out_value, size_t k);
size_t topk_final_avx512(const float* x, size_t n, uint32_t kth, size_t ties,
                         uint32_t* out_index, float* out_value, size_t k);

// Top-k with the ISA chosen by the caller (tests run each); same contract as select.h.
Expected<size_t> topk_approx_isa(Isa isa, std::span<const float> x, size_t k, double tolerance,
                                 std::span<std::byte> scratch, uint32_t* out_index,
                                 float* out_value, size_t capacity);
// The two-pass path of topk_exact alone (histogram + partition + refine), for tests that must
// cover it on large inputs too.
Expected<size_t> topk_exact_two_pass_isa(Isa isa, std::span<const float> x, size_t k,
                                         std::span<std::byte> scratch, uint32_t* out_index,
                                         float* out_value);

// murmur3's 32-bit finaliser (a bijection with full avalanche) and splitmix64's.
inline uint32_t fmix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}
inline uint64_t splitmix64(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}
// random_draw(seed, i) with splitmix64(seed) already split into (a, b).
inline uint32_t draw(uint32_t a, uint32_t b, uint32_t index) { return fmix32(fmix32(index ^ a) + b); }

}  // namespace sparsecar::kernels::detail
