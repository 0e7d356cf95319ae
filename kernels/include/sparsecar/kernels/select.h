// Sparsifiers and error feedback on the CPU.
//
// Pure functions over spans: no allocation, no threads, no I/O. Scratch memory is owned by the
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

// residual[i] += grad[i]. Sizes must match (checked; a mismatch is a bug and aborts).
void ef_accumulate(std::span<float> residual, std::span<const float> grad);

// Number of elements top-k keeps for a density in (0, 1]: max(1, round(density * n)), capped at n;
// 0 when n == 0.
size_t topk_count(size_t n, double density);

// Bytes of scratch topk_exact needs for n elements: 4n + 32 KiB + 64 (any alignment is fine).
// Size it once when the tensor is registered.
size_t topk_scratch_bytes(size_t n);

// Exact top-k by magnitude |x_i| (order above). Ties at the k-th magnitude are broken by the
// lower index, so the result is deterministic and identical on every node. Writes min(k, n)
// pairs in increasing index order into out_index/out_value (each must hold at least min(k, n)
// entries) and returns that count; k == 0 or n == 0 returns 0 and writes nothing.
// A selection algorithm, not a sort: one histogram pass over the top 11 magnitude bits, one pass
// that writes the certain winners and collects the k-th element's bin, then 10 + 10 bit
// refinement over that bin only. O(n) time, two streaming reads of x.
// Errors: scratch smaller than topk_scratch_bytes(n), null outputs with k > 0, or more than
// 2^32 - 1 elements -> kInvalidArgument (nothing written).
Expected<size_t> topk_exact(std::span<const float> x, size_t k, std::span<std::byte> scratch,
                            uint32_t* out_index, float* out_value);

// All i with |x_i| >= lambda, in increasing index order (NaNs match, see above). A lambda that is
// not > 0 (zero, negative, NaN) matches every element. Writes at most `capacity` pairs; returns
// the number of matches found, which may exceed capacity (then only the first `capacity` were
// written).
size_t threshold_select(std::span<const float> x, float lambda, uint32_t* out_index,
                        float* out_value, size_t capacity);

// residual[index[j]] = 0 for every selected j: "residual -= selected" when the selected values
// were read from the residual itself. Indices must be < residual.size() (checked; aborts).
void clear_selected(std::span<float> residual, std::span<const uint32_t> index);

// Fused error feedback + hard threshold, one pass over memory:
//   residual += grad; select i with |residual_i| >= lambda; residual_i = 0 for the selected.
// Output as threshold_select (capacity >= residual.size() guarantees nothing is dropped; if
// the count exceeds capacity, the residual keeps the unwritten ones so nothing is lost).
// Equals ef_accumulate + threshold_select + clear_selected bit for bit, in one pass: reads
// residual and grad once, writes residual once plus the pairs.
size_t ef_threshold(std::span<float> residual, std::span<const float> grad, float lambda,
                    uint32_t* out_index, float* out_value, size_t capacity);

// dst[i] += src[i]. Sizes must match (checked; aborts).
void add(std::span<float> dst, std::span<const float> src);
// x[i] *= factor
void scale(std::span<float> x, float factor);

}  // namespace sparsecar::kernels
