// Run-time CPU feature detection and the per-ISA kernel variants (the bottom layer of kernels/).
//
// Layering (as in raft's select_k): the public functions in select.cc/codec.cc validate their
// arguments, then dispatch here on best_isa(); the variants below assume valid input. Every
// kernel has a portable variant (plain C++, auto-vectorised for the baseline ISA) and, where it
// pays, an AVX-512 variant compiled with a function-level target attribute, so the library runs
// on any x86-64 and uses AVX-512 only where __builtin_cpu_supports says so.
// Tests call the variants directly to check each one against the same references.
// Thread-safety: all functions are pure; best_isa() caches its answer in a function-local static.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <span>

#include "bits.h"  // relative, as topk.h
#include "sparsecar/common/status.h"

#define SC_TARGET_AVX512 __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,bmi,bmi2,popcnt")))

namespace sparsecar::kernels {
class ThreadPool;  // parallel.h
}  // namespace sparsecar::kernels

namespace sparsecar::kernels::detail {

enum class Isa : int { kPortable = 0, kAvx512 = 1 };

// The best ISA this CPU supports among those compiled in.
Isa best_isa();
// SSE4.2 (crc32 instruction) present.
bool has_sse42();

// Top-k radix select works on 31-bit keys in three digits: 11 + 10 + 10 bits.
inline constexpr int kTopkHiShift = 20;
inline constexpr size_t kTopkHiBins = size_t{1} << 11;
inline constexpr size_t kTopkLoBins = size_t{1} << 10;
// The first-pass histogram is kept in this many interleaved copies to break the dependency of
// consecutive increments of the same bin; select.cc sums them.
inline constexpr size_t kTopkHistCopies = 4;

// ---- the public kernels of select.h with the ISA chosen by the caller (tests run every ISA the
// machine has; the public functions pass best_isa()). Same contracts as select.h.
void add_isa(Isa isa, std::span<float> dst, std::span<const float> src);
void scale_isa(Isa isa, std::span<float> x, float factor);
Expected<size_t> topk_exact_isa(Isa isa, std::span<const float> x, size_t k,
                                std::span<std::byte> scratch, uint32_t* out_index,
                                float* out_value, ThreadPool* pool = nullptr,
                                size_t capacity = 0);
size_t threshold_select_isa(Isa isa, std::span<const float> x, float lambda, uint32_t* out_index,
                            float* out_value, size_t capacity, ThreadPool* pool = nullptr);
size_t ef_threshold_isa(Isa isa, std::span<float> residual, std::span<const float> grad,
                        float lambda, uint32_t* out_index, float* out_value, size_t capacity,
                        ThreadPool* pool = nullptr);

// ---- portable variants -----------------------------------------------------------------------
void add_portable(float* dst, const float* src, size_t n);
void scale_portable(float* x, size_t n, float factor);
// Selected: magnitude_key(x_i) >= lambda_key. Returns the match count; writes min(count, cap).
size_t threshold_select_portable(const float* x, size_t n, uint32_t lambda_key, uint32_t* out_index,
                                 float* out_value, size_t capacity);
size_t ef_threshold_portable(float* residual, const float* grad, size_t n, uint32_t lambda_key,
                             uint32_t* out_index, float* out_value, size_t capacity);
// hist has kTopkHistCopies * kTopkHiBins zeroed counters; adds the count of each key >> 20.
void topk_histogram_portable(const float* x, size_t n, uint32_t* hist);
// Writes every i with (key >> 20) > bin to out_* (returns that count) and every i with
// (key >> 20) == bin to candidates (count in *n_candidates); both in increasing index order.
size_t topk_partition_portable(const float* x, size_t n, uint32_t bin, uint32_t* out_index,
                               float* out_value, uint32_t* candidates, size_t* n_candidates);

// ---- AVX-512 variants (call only when best_isa() == Isa::kAvx512) -----------------------------
void add_avx512(float* dst, const float* src, size_t n);
void scale_avx512(float* x, size_t n, float factor);
size_t threshold_select_avx512(const float* x, size_t n, uint32_t lambda_key, uint32_t* out_index,
                               float* out_value, size_t capacity);
size_t ef_threshold_avx512(float* residual, const float* grad, size_t n, uint32_t lambda_key,
                           uint32_t* out_index, float* out_value, size_t capacity);
void topk_histogram_avx512(const float* x, size_t n, uint32_t* hist);
size_t topk_partition_avx512(const float* x, size_t n, uint32_t bin, uint32_t* out_index,
                             float* out_value, uint32_t* candidates, size_t* n_candidates);

// ---- CRC-32C (crc32c.cc) -----------------------------------------------------------------------
// Raw update without the pre/post inversion: state' = crc(state, data).
uint32_t crc32c_update_table(uint32_t state, const unsigned char* p, size_t n);
uint32_t crc32c_update_sse42(uint32_t state, const unsigned char* p, size_t n);

}  // namespace sparsecar::kernels::detail
