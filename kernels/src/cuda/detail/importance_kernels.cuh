// The device kernels behind cuda::ef_importance (the bottom layer; importance.cu validates and
// launches them). They assume valid arguments.
//
// Importance sampling needs c, which solves sum_i min(1, c |x_i|) = k by a fixed point of up to
// 8 rounds, each a float64 sum over the tensor. The CPU reference sums in the blocked tree order
// of detail/importance.h, and so do these kernels:
// - importance_leaf_kernel<kStats>: one block per chunk of kTreeWidth = 1024 elements (grid-
//   stride over chunks) puts the chunk's terms in shared memory and sums them by the same
//   pairwise tree; it writes one float64 per chunk and adds its counts (non-finite / non-zero,
//   or capped) to the state. The stats pass also does the error feedback (residual += grad).
// - tree_level_kernel: the chunk sums, 1024 at a time, by the same tree, until one is left.
// - importance_start_kernel / importance_round_kernel: one thread runs the CPU's step
//   (importance_start / importance_round) on the counts and the sum.
// A round's kernels are gated by state->running (select_kernels.cuh's gated_off): once the
// fixed point is done the rest of the queued rounds return at once, with no host round trip.
// The selection is one compaction (select_kernels.cuh's compact_kernel) with ImportanceOp.
//
// The kernels are `static` (internal linkage): this header defines them, and a second .cu that
// included it would otherwise define their host stubs twice.
#pragma once

#include <cub/block/block_reduce.cuh>

#include <cstddef>
#include <cstdint>

#include "cuda/detail/select_kernels.cuh"
#include "detail/importance.h"

namespace sparsecar::kernels::cuda::detail {

inline constexpr int kTreeThreads = 256;
inline constexpr int kTreeWidth = static_cast<int>(kernels::detail::kTreeWidth);
static_assert(kTreeWidth % kTreeThreads == 0 && kTreeThreads >= 64, "block_tree_sum's shapes");

// The solve's progress, in device memory (zeroed before a call).
struct ImportanceState {
  kernels::detail::ImportanceSolve solve;  // c, and the fixed point's bookkeeping
  unsigned long long nonfinite;            // the stats pass's counts
  unsigned long long nonzero;
  unsigned long long capped;               // the current round's capped finite elements
  unsigned int running;                    // 1 while rounds remain (gates the round kernels)
  unsigned int tile_counter;               // the compaction's next tile
};

// The tree sum of v[0 .. kTreeWidth) in shared memory, by the pairs of tree_sum_chunk:
// v[i] += v[i + s] for s = 512 .. 64 in shared memory, s = 32 .. 1 in warp 0 by shuffles (lane i
// adds lane i + s, the same pair). Call with kTreeThreads threads after v is written and
// synchronised; v is overwritten; thread 0 returns the sum. Ends without a barrier: synchronise
// before v is written again.
__device__ __forceinline__ double block_tree_sum(double* v) {
  for (int s = kTreeWidth / 2; s >= 64; s >>= 1) {
    for (int i = threadIdx.x; i < s; i += kTreeThreads) v[i] = kernels::detail::add_f64(v[i], v[i + s]);
    __syncthreads();
  }
  double a = 0.0;
  if (threadIdx.x < 32) {
    a = kernels::detail::add_f64(v[threadIdx.x], v[threadIdx.x + 32]);
#pragma unroll
    for (int s = 16; s >= 1; s >>= 1) a = kernels::detail::add_f64(a, __shfl_down_sync(0xffffffffu, a, s));
  }
  return a;
}

// The stats pass (kStats: residual += grad written back when grad is given; the terms and counts
// of importance_stats_term) or one round's pass (importance_round_term under state->solve.c),
// one float64 per chunk of kTreeWidth elements into `sums`.
template <bool kStats>
static __global__ void __launch_bounds__(kTreeThreads)
    importance_leaf_kernel(float* residual, const float* grad, size_t n, ImportanceState* state, double* sums,
                           const unsigned* gate) {
  if (gated_off(gate)) return;
  using Reduce = cub::BlockReduce<unsigned long long, kTreeThreads>;
  __shared__ typename Reduce::TempStorage temp;
  __shared__ double v[kTreeWidth];
  const double c = kStats ? 0.0 : state->solve.c;
  uint64_t count_a = 0;  // stats: non-finite; round: capped
  uint64_t count_b = 0;  // stats: non-zero finite
  const size_t chunks = (n + kTreeWidth - 1) / kTreeWidth;
  for (size_t chunk = blockIdx.x; chunk < chunks; chunk += gridDim.x) {
    const size_t base = chunk * kTreeWidth;
#pragma unroll
    for (int q = 0; q < kTreeWidth / kTreeThreads; ++q) {
      const int j = q * kTreeThreads + threadIdx.x;
      const size_t i = base + static_cast<size_t>(j);
      double term = 0.0;
      if (i < n) {
        float x = residual[i];
        if (kStats && grad != nullptr) {
          x = kernels::detail::cpu_add(x, grad[i]);
          residual[i] = x;
        }
        term = kStats ? kernels::detail::importance_stats_term(x, count_a, count_b)
                      : kernels::detail::importance_round_term(x, c, count_a);
      }
      v[j] = term;
    }
    __syncthreads();
    const double sum = block_tree_sum(v);
    if (threadIdx.x == 0) sums[chunk] = sum;
    __syncthreads();
  }
  const unsigned long long a = Reduce(temp).Sum(static_cast<unsigned long long>(count_a));
  if (kStats) {
    __syncthreads();  // temp is reused
    const unsigned long long b = Reduce(temp).Sum(static_cast<unsigned long long>(count_b));
    if (threadIdx.x == 0) {
      if (a != 0) atomicAdd(&state->nonfinite, a);
      if (b != 0) atomicAdd(&state->nonzero, b);
    }
  } else if (threadIdx.x == 0 && a != 0) {
    atomicAdd(&state->capped, a);
  }
}

// One level of the tree above the chunks: out[g] = the tree sum of in[1024 g .. 1024 g + 1024)
// (entries past `count` are 0).
static __global__ void __launch_bounds__(kTreeThreads)
    tree_level_kernel(const double* in, size_t count, double* out, const unsigned* gate) {
  if (gated_off(gate)) return;
  __shared__ double v[kTreeWidth];
  const size_t groups = (count + kTreeWidth - 1) / kTreeWidth;
  for (size_t g = blockIdx.x; g < groups; g += gridDim.x) {
    const size_t base = g * kTreeWidth;
#pragma unroll
    for (int q = 0; q < kTreeWidth / kTreeThreads; ++q) {
      const int j = q * kTreeThreads + threadIdx.x;
      const size_t i = base + static_cast<size_t>(j);
      v[j] = i < count ? in[i] : 0.0;
    }
    __syncthreads();
    const double sum = block_tree_sum(v);
    if (threadIdx.x == 0) out[g] = sum;
    __syncthreads();
  }
}

// After the stats pass: the CPU's importance_start (c, or done at once).
static __global__ void importance_start_kernel(ImportanceState* state, unsigned long long k, const double* sum) {
  state->solve = kernels::detail::importance_start(k, state->nonfinite, state->nonzero, *sum);
  state->running = state->solve.done ? 0u : 1u;
}

// After round `round`'s pass: the CPU's importance_round; the count is reset for the next round.
static __global__ void importance_round_kernel(ImportanceState* state, int round, const double* uncapped) {
  if (state->running == 0) return;
  kernels::detail::importance_round(state->solve, round, state->solve.nonfinite + state->capped, *uncapped);
  state->capped = 0;
  state->running = state->solve.done ? 0u : 1u;
}

// residual += grad alone (k == 0: nothing is selected, the error feedback still happens).
static __global__ void importance_add_kernel(float* residual, const float* grad, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    residual[i] = kernels::detail::cpu_add(residual[i], grad[i]);
  }
}

// The selection under the solved c: kept when draw(a, b, i) < importance_keep_threshold(x_i, c);
// values x_i or (unbiased) importance_unbiased(x_i, t); the residual cleared where written with
// clear_sent. x is the residual after the error feedback (the stats pass wrote it). The item is
// the float alone and t is recomputed where needed (a few float64 operations): the compaction
// holds kItems items per thread in registers.
struct ImportanceOp {
  float* residual;
  const ImportanceState* state;
  uint32_t a;
  uint32_t b;
  bool unbiased;
  bool clear_sent;
  struct Item {
    float v;
  };
  __device__ unsigned long long threshold(float v) const {
    return kernels::detail::importance_keep_threshold(v, state->solve.c);
  }
  __device__ Item load(size_t i) const { return {residual[i]}; }
  __device__ bool keep(const Item& it, size_t i) const {
    return kernels::detail::draw(a, b, static_cast<uint32_t>(i)) < threshold(it.v);
  }
  __device__ float value(const Item& it, size_t) const {
    return unbiased ? kernels::detail::importance_unbiased(it.v, threshold(it.v)) : it.v;
  }
  __device__ void store(size_t i, const Item&, bool, bool written) const {
    if (written && clear_sent) residual[i] = 0.0f;
  }
};

}  // namespace sparsecar::kernels::cuda::detail
