// Per-ISA pieces of the sampled top-k, random-k and importance selectors (select.cc dispatches).
// Separate from cpu.h so the selection kernels can grow without touching the shared CPU header.
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "cpu.h"  // relative: tests include this header without kernels/src on the path

namespace sparsecar::kernels::detail {

// Returned by the sampled top-k passes when an output would overflow its capacity (the pass
// stops early; the outputs are partial and must be ignored).
inline constexpr size_t kBandOverflow = ~size_t{0};
// Every output buffer of topk_candidates must have kBandSlack entries beyond its capacity: the
// AVX-512 variant stores whole vectors.
inline constexpr size_t kBandSlack = 16;

// The one streaming pass of the sampled top-k over x[0, n) (element i has index base + i):
// every i with key >= lo goes to cand_* in index order (at most cap), and of those, the keys
// with key <= hi (the band) also to band_keys (at most band_cap). Returns the candidate count,
// *n_band and *n_above (candidates with key > hi), or kBandOverflow.
size_t topk_candidates_portable(const float* x, size_t n, uint32_t base, uint32_t lo, uint32_t hi,
                                uint32_t* cand_index, float* cand_value, size_t cap,
                                uint32_t* band_keys, size_t band_cap, size_t* n_band,
                                size_t* n_above);
size_t topk_candidates_avx512(const float* x, size_t n, uint32_t base, uint32_t lo, uint32_t hi,
                              uint32_t* cand_index, float* cand_value, size_t cap,
                              uint32_t* band_keys, size_t band_cap, size_t* n_band,
                              size_t* n_above);
// Writes the candidates with key > kth plus the first `ties` with key == kth, in order, to out_*
// (at most k entries; no slack needed). Returns the count written, kBandOverflow if more than k.
size_t topk_compact_portable(const uint32_t* cand_index, const float* cand_value, size_t count,
                             uint32_t kth, size_t ties, uint32_t* out_index, float* out_value,
                             size_t k);
size_t topk_compact_avx512(const uint32_t* cand_index, const float* cand_value, size_t count,
                           uint32_t kth, size_t ties, uint32_t* out_index, float* out_value,
                           size_t k);

// Top-k with the ISA chosen by the caller (tests run each); same contract as select.h.
Expected<size_t> topk_approx_isa(Isa isa, std::span<const float> x, size_t k, double tolerance,
                                 std::span<std::byte> scratch, uint32_t* out_index,
                                 float* out_value, size_t capacity, ThreadPool* pool = nullptr);
// The two-pass path of topk_exact alone (histogram + partition + refine), for tests that must
// cover it on large inputs too.
Expected<size_t> topk_exact_two_pass_isa(Isa isa, std::span<const float> x, size_t k,
                                         std::span<std::byte> scratch, uint32_t* out_index,
                                         float* out_value);


}  // namespace sparsecar::kernels::detail
