// Error-compensation building blocks: the per-element updates behind the compressor's error
// feedback variants (plain residual, DGC momentum correction with factor masking, local
// clipping, learning-rate rescaling). The compressor (daemon/pipeline/compressor.cc) composes
// them; select.h has the fused EF + threshold pass.
//
// Pure functions over spans: no allocation, no threads. Sizes must match (checked; a mismatch
// is a bug and aborts). Thread-safety: concurrent calls on disjoint buffers are safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

namespace sparsecar::kernels {

// residual[i] += factor * grad[i] (factor == 1 is exactly ef_accumulate: fl(r + g)).
void ef_accumulate_scaled(std::span<float> residual, std::span<const float> grad, float factor);

// DGC momentum correction, one pass: u = momentum * u + factor * g; v += u
// (u: the local velocity, v: the accumulated velocity that gets compressed, i.e. the residual).
void momentum_accumulate(std::span<float> velocity, std::span<float> residual,
                         std::span<const float> grad, float momentum, float factor);

// residual[index[j]] -= value[j]: the selection leaves the residual when the sent values are
// not the residual's own (unbiased random-k / importance scale them).
void subtract_selected(std::span<float> residual, std::span<const uint32_t> index,
                       std::span<const float> value);
// residual[index[j]] += value[j]: puts a selection back (rollback of a failed step).
void add_selected(std::span<float> residual, std::span<const uint32_t> index,
                  std::span<const float> value);

// sum of x_i^2 in float64 (non-finite values make it non-finite).
double norm2(std::span<const float> x);

// Local gradient clipping by norm: the factor that brings ||g|| (norm = sqrt(norm2(g))) down to
// max_norm: min(1, max_norm / norm). 1 when max_norm <= 0 (off), when the norm is 0, or when it
// is not finite (a NaN/inf gradient is passed through unclipped so it shows up downstream).
float clip_factor(double norm, double max_norm);

}  // namespace sparsecar::kernels
