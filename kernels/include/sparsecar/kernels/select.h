// Sparsifiers and error feedback on the CPU (the element-wise helpers declared here,
// ef_accumulate / add / scale / clear_selected, live in ef.cc with the other EF building blocks).
//
// Pure functions over spans: no allocation, no I/O, and no threads of their own; the large
// kernels (top-k exact/approx, threshold, fused EF + threshold) take an optional caller-owned
// ThreadPool (parallel.h) and give the identical result for every thread count. Scratch memory is owned by the
// caller and sized by the matching *_scratch_bytes() query, so the daemon sizes every buffer
// when a tensor is registered and the per-step path never allocates.
//
// Every selector writes its result as (index, value) pairs with indices strictly increasing, so
// encoders can rely on sorted input and receivers can validate it. Indices are uint32: tensors
// hold at most 2^32 - 1 elements.
//
// Magnitude order (all selectors): |x| compared as IEEE bits without the sign, so -0 == +0,
// denormals order by value, +-inf are above every finite value, and every NaN is above +-inf
// (NaNs tie with each other). A NaN is therefore always selected: a diverged gradient shows up
// at the receivers instead of hiding in the residual.
//
// Implementation: the public functions validate and pick the best variant for this CPU at run
// time (AVX-512 where present, else portable C++); see src/detail/cpu.h.
// Thread-safety: pure functions; concurrent calls on disjoint buffers are safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "sparsecar/common/status.h"

namespace sparsecar::kernels {

class ThreadPool;  // parallel.h

// residual[i] += grad[i]. Sizes must match (checked; a mismatch is a bug and aborts).
void ef_accumulate(std::span<float> residual, std::span<const float> grad);

// Number of elements top-k keeps for a density in (0, 1]: max(1, round(density * n)), capped at n;
// 0 when n == 0.
size_t topk_count(size_t n, double density);

// Bytes of scratch topk_exact, topk_approx and magnitude_quantile need for n elements:
// 4n + 96 KiB + 64 (any alignment is fine). Size it once when the tensor is registered.
size_t topk_scratch_bytes(size_t n);

// Exact top-k by magnitude |x_i| (order above). Ties at the k-th magnitude are broken by the
// lower index, so the result is deterministic and identical on every node. Writes min(k, n)
// pairs in increasing index order into out_index/out_value (each must hold at least min(k, n)
// entries) and returns that count; k == 0 or n == 0 returns 0 and writes nothing.
// A selection algorithm, not a sort. Large inputs (>= 32 Ki elements) take the sampled path:
// the magnitudes of a fixed stratified sample bracket the k-th key with a safety margin
// (lo <= k-th <= hi, 3 sigma of the sample rank), then ONE streaming pass writes every
// candidate (key >= lo) to scratch and the band's keys (lo <= key <= hi) beside them; a radix
// select over the (small) band finds the exact k-th key and a compaction of the candidates
// (about k + band of them) yields the result. When the
// bracket misses (a count check after the pass; rare, e.g. huge exact ties), or for small
// inputs, the two-pass path runs: a histogram of the top 11 key bits, a partition pass, and a
// 10 + 10 bit refinement of the k-th element's bin. Both paths give the identical answer.
// Errors: scratch smaller than topk_scratch_bytes(n), null outputs with k > 0, or more than
// 2^32 - 1 elements -> kInvalidArgument (nothing written).
// capacity (optional): entries out_index/out_value hold, when more than min(k, n). With about
// 3n/8 + 16 or more (the daemon passes n), a single-threaded call keeps its candidates in the
// outputs themselves and compacts them in place, saving a write-allocate of the result; entries
// past the returned count may then be overwritten.
Expected<size_t> topk_exact(std::span<const float> x, size_t k, std::span<std::byte> scratch,
                            uint32_t* out_index, float* out_value, ThreadPool* pool = nullptr,
                            size_t capacity = 0);

// Approximate top-k (DGC's sampled threshold): lambda = the magnitude of rank k estimated from a
// sample of x (aimed slightly above k: at k (1 + tolerance/2), or 2 sigma of the sample rank
// above it when the sample is too small for the tolerance, so that a miss is usually the cheap
// overshoot), then one threshold pass. If the count c lands within k * (1 +- tolerance) the
// c pairs are the answer (every |x_i| >= lambda, i.e. a hard threshold); if c overshoots, the
// exact top k of those c are kept (then the result equals topk_exact); if c undershoots or does
// not fit `capacity`, exact top-k runs. Returns the number of pairs written (the nnz actually
// selected), in increasing index order. capacity >= min(k, n) is required; capacity >=
// k * (1 + tolerance) avoids the exact fallback on overshoot. tolerance in [0, 1].
// Deterministic (fixed sample positions). Errors as topk_exact, plus capacity < min(k, n).
Expected<size_t> topk_approx(std::span<const float> x, size_t k, double tolerance,
                             std::span<std::byte> scratch, uint32_t* out_index, float* out_value,
                             size_t capacity, ThreadPool* pool = nullptr);

// The magnitude below which a fraction q of the |x_i + add_i| lie (add empty: |x_i|), estimated
// from the same fixed stratified sample (up to 16 Ki elements; exact when n is small). q is
// clamped to [0, 1]; q == 1 returns the largest sampled magnitude. Used as lambda of the
// percentile threshold selector (`|e_i| >= lambda` keeps about (1 - q) n elements). NaNs count
// as the largest magnitude (+inf is returned if they reach rank q). 0 for n == 0.
// scratch: topk_scratch_bytes(n) (only 64 KiB of it are used).
float magnitude_quantile(std::span<const float> x, double q, std::span<std::byte> scratch,
                         std::span<const float> add = {});

// A counter-based 32-bit random draw for element `index` of the stream `seed` (a splitmix64
// of the seed, then two murmur3 finalisers of the index): the same (seed, index) gives the
// same value on every machine, in any order and any thread. Public so tests and other
// selectors can reproduce the draws.
uint32_t random_draw(uint64_t seed, uint32_t index);

// The per-(tensor, step) stream seed: splitmix64 chain of (job seed, tensor id, step).
uint64_t derive_seed(uint64_t job_seed, uint32_t tensor_id, uint64_t step);

// The keep rule of the random selectors: a draw d keeps when d < random_keep_threshold(p), which
// happens with probability exactly t / 2^32 (t = ceil(p 2^32); 0 for p <= 0 or NaN, 2^32 for
// p >= 1). Unbiased values are x * 2^32 / t: scaled by the probability actually used.
uint64_t random_keep_threshold(double p);

// Random-k: keeps i independently with probability p (random_draw(seed, i) < p * 2^32), so
// the kept set is identical on every node for the same seed. unbiased = true writes
// x_i / p (E[sent] = x); false writes x_i unchanged (for error feedback, which keeps the rest
// and must not be scaled: E[(1 - B/p)^2] = (1 - p)/p > 1 would grow the residual without
// bound). Returns the match count, writes min(count, capacity) pairs in index order.
// p <= 0 keeps nothing, p >= 1 keeps everything.
size_t randomk_select(std::span<const float> x, double p, uint64_t seed, bool unbiased,
                      uint32_t* out_index, float* out_value, size_t capacity);

// Importance sampling: keeps i with probability p_i = min(1, c |x_i|) where c is solved (a
// fixed point over the capped elements, float64, at most 8 passes) so that sum p_i = k; NaN
// and +-inf have p_i = 1, zeros 0. Every float64 sum of |x_i| is taken in a fixed blocked
// tree order (chunks of 1024 by a pairwise tree, then the chunk sums the same way:
// kernels/src/detail/importance.h), so c depends only on x and k, and the CUDA backend
// (cuda::ef_importance) reproduces it bit for bit. unbiased = true writes x_i / p_i; false writes x_i (for
// error feedback, as randomk_select). Draws as randomk_select: random_draw(seed, i) < p_i 2^32.
// Returns the match count, writes min(count, capacity) pairs in index order. The expected count
// is k (when at least k elements are non-zero).
size_t importance_select(std::span<const float> x, size_t k, uint64_t seed, bool unbiased,
                         uint32_t* out_index, float* out_value, size_t capacity);

// The c of importance_select for x and k (exposed for tests): sum_i min(1, c |x_i|) == k up
// to rounding (when the fixed point settles within its 8 rounds); +inf when no more than k
// elements are non-zero, 0 when the non-finite ones alone fill k.
double importance_scale(std::span<const float> x, size_t k);

// All i with |x_i| >= lambda, in increasing index order (NaNs match, see above). A lambda that is
// not > 0 (zero, negative, NaN) matches every element. Writes at most `capacity` pairs; returns
// the number of matches found, which may exceed capacity (then only the first `capacity` were
// written). Entries past the returned count, up to capacity, may be overwritten (vector stores).
// With a pool, the split needs capacity >= x.size() (else one thread runs it).
size_t threshold_select(std::span<const float> x, float lambda, uint32_t* out_index,
                        float* out_value, size_t capacity, ThreadPool* pool = nullptr);

// residual[index[j]] = 0 for every selected j: "residual -= selected" when the selected values
// were read from the residual itself. Indices must be < residual.size() (checked; aborts).
void clear_selected(std::span<float> residual, std::span<const uint32_t> index);

// Fused error feedback + hard threshold, one pass over memory:
//   residual += grad; select i with |residual_i| >= lambda; residual_i = 0 for the selected.
// Output as threshold_select (capacity >= residual.size() guarantees nothing is dropped; if
// the count exceeds capacity, the residual keeps the unwritten ones so nothing is lost).
// Equals ef_accumulate + threshold_select + clear_selected bit for bit, in one pass: reads
// residual and grad once, writes residual once plus the pairs.
// With a pool, the split needs capacity >= residual.size() (else one thread runs it).
size_t ef_threshold(std::span<float> residual, std::span<const float> grad, float lambda,
                    uint32_t* out_index, float* out_value, size_t capacity,
                    ThreadPool* pool = nullptr);

// dst[i] += src[i]. Sizes must match (checked; aborts).
void add(std::span<float> dst, std::span<const float> src);
// x[i] *= factor
void scale(std::span<float> x, float factor);

}  // namespace sparsecar::kernels
