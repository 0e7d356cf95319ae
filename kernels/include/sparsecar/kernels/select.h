// Sparsifiers and error feedback on the CPU.
//
// Pure functions over spans: no allocation, no threads, no I/O. Scratch memory is owned by the
// caller and sized by the matching *_scratch_bytes() query, so the daemon sizes every buffer
// when a tensor is registered and the per-step path never allocates.
//
// Every selector writes its result as (index, value) pairs with indices strictly increasing, so
// encoders can rely on sorted input and receivers can validate it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "sparsecar/common/status.h"

namespace sparsecar::kernels {

// residual[i] += grad[i]. Sizes must match.
void ef_accumulate(std::span<float> residual, std::span<const float> grad);

// Number of elements top-k keeps for a density in (0, 1]: max(1, round(density * n)), capped at n;
// 0 when n == 0.
size_t topk_count(size_t n, double density);

// Bytes of scratch topk_exact needs for n elements.
size_t topk_scratch_bytes(size_t n);

// Exact top-k by magnitude |x_i|. A NaN counts as larger than every number (it is selected, so a
// diverged model shows up instead of hiding in the residual). Ties are broken by the lower index, so the result is deterministic. Writes min(k, n) pairs in increasing index
// order into out_index/out_value (each must hold at least min(k, n) entries) and returns that
// count. A selection algorithm (radix select on the magnitude bits), not a sort: O(n).
// Errors: scratch smaller than topk_scratch_bytes(n) -> kInvalidArgument.
Expected<size_t> topk_exact(std::span<const float> x, size_t k, std::span<std::byte> scratch,
                            uint32_t* out_index, float* out_value);

// All i with |x_i| >= lambda (lambda > 0), in increasing index order. Writes at most `capacity`
// pairs; returns the number of matches found, which may exceed capacity (then only the first
// `capacity` were written).
size_t threshold_select(std::span<const float> x, float lambda, uint32_t* out_index,
                        float* out_value, size_t capacity);

// residual[index[j]] = 0 for every selected j: "residual -= selected" when the selected values
// were read from the residual itself. Indices must be < residual.size().
void clear_selected(std::span<float> residual, std::span<const uint32_t> index);

// Fused error feedback + hard threshold, one pass over memory:
//   residual += grad; select i with |residual_i| >= lambda; residual_i = 0 for the selected.
// Output as threshold_select (capacity >= residual.size() guarantees nothing is dropped; if
// the count exceeds capacity, the residual keeps the unwritten ones so nothing is lost).
size_t ef_threshold(std::span<float> residual, std::span<const float> grad, float lambda,
                    uint32_t* out_index, float* out_value, size_t capacity);

// dst[i] += src[i]
void add(std::span<float> dst, std::span<const float> src);
// x[i] *= factor
void scale(std::span<float> x, float factor);

}  // namespace sparsecar::kernels
