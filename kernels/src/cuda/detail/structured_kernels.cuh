// The device kernels behind cuda.h's structured selections (structured.cu validates and launches
// them). They assume valid arguments.
//
// Three steps, each bit for bit the CPU's (structured.cc):
// - scores: each group's Σ x² or Σ |x| in float64, added in the CPU's order with __dadd_rn and
//   __dmul_rn (no FMA contraction), fused with error feedback (residual += grad, written back).
//   Contiguous groups: one warp per group; the lanes load 32 consecutive elements and compute
//   their terms, then every lane adds the 32 terms in index order (the sum stays sequential).
//   Columns: one thread per column, down the rows (the CPU's row-by-row loop adds each column's
//   elements in increasing index order too).
// - ranking: the score becomes a 64-bit key that orders like the CPU's rule (NaN highest, then
//   the score's bits: scores are +0, positive or +inf); CUB's stable descending radix sort of
//   (key, group id) keeps equal keys in increasing id order, so the first `keep` sorted ids are
//   the CPU's `keep` best groups. group_flags_kernel marks them.
// - emission: compact_kernel<GroupOp> (select_kernels.cuh) keeps element i when its group is
//   marked.
#pragma once

#include <cstddef>
#include <cstdint>

#include "cuda/detail/select_kernels.cuh"

namespace sparsecar::kernels::cuda::detail {

// x² or |x| in float64, as structured.cc's term().
__device__ __forceinline__ double group_term(float v, bool l1) {
  const double d = static_cast<double>(v);
  return l1 ? fabs(d) : __dmul_rn(d, d);
}

// The ranking key of a score: NaN above everything, else the float64 bits (a score is never
// negative; -0 is folded into +0 all the same).
__device__ __forceinline__ unsigned long long score_key(double s) {
  if (isnan(s)) return ~0ull;
  const auto bits = static_cast<unsigned long long>(__double_as_longlong(s));
  return bits == 0x8000000000000000ull ? 0ull : bits;
}

// Contiguous groups [g*size, min((g+1)*size, n)): one warp per group (blockDim.x a multiple of
// 32, so a warp's lanes share g and leave together).
__global__ void __launch_bounds__(kThreads) contiguous_scores_kernel(float* residual, const float* grad, size_t n,
                                                                     size_t size, size_t groups, bool l1,
                                                                     unsigned long long* keys, uint32_t* ids) {
  const size_t g = (blockIdx.x * size_t{blockDim.x} + threadIdx.x) / 32;
  const unsigned lane = threadIdx.x & 31u;
  if (g >= groups) return;
  const size_t begin = g * size;
  const size_t end = begin + size < n ? begin + size : n;
  double acc = 0.0;
  for (size_t i0 = begin; i0 < end; i0 += 32) {
    const size_t i = i0 + lane;
    double t = 0.0;
    if (i < end) {
      float v = residual[i];
      if (grad != nullptr) {
        v = cpu_add(v, grad[i]);
        residual[i] = v;
      }
      t = group_term(v, l1);
    }
    const unsigned m = end - i0 < 32 ? static_cast<unsigned>(end - i0) : 32u;
    for (unsigned j = 0; j < m; ++j) acc = __dadd_rn(acc, __shfl_sync(0xffffffffu, t, static_cast<int>(j)));
  }
  if (lane == 0) {
    keys[g] = score_key(acc);
    ids[g] = static_cast<uint32_t>(g);
  }
}

// Columns of a row-major [rows, cols] matrix: one thread per column, rows in order.
__global__ void __launch_bounds__(kThreads) column_scores_kernel(float* residual, const float* grad, size_t rows,
                                                                 size_t cols, bool l1, unsigned long long* keys,
                                                                 uint32_t* ids) {
  const size_t c = blockIdx.x * size_t{blockDim.x} + threadIdx.x;
  if (c >= cols) return;
  double acc = 0.0;
  for (size_t r = 0; r < rows; ++r) {
    const size_t i = r * cols + c;
    float v = residual[i];
    if (grad != nullptr) {
      v = cpu_add(v, grad[i]);
      residual[i] = v;
    }
    acc = __dadd_rn(acc, group_term(v, l1));
  }
  keys[c] = score_key(acc);
  ids[c] = static_cast<uint32_t>(c);
}

// flags[group] = 1 for the first `keep` groups of the ranking, 0 for the rest. sorted_ids null:
// the identity ranking (every group kept when keep >= groups).
__global__ void group_flags_kernel(const uint32_t* sorted_ids, size_t groups, size_t keep, unsigned char* flags) {
  for (size_t j = blockIdx.x * size_t{blockDim.x} + threadIdx.x; j < groups; j += size_t{gridDim.x} * blockDim.x) {
    flags[sorted_ids != nullptr ? sorted_ids[j] : j] = static_cast<unsigned char>(j < keep ? 1 : 0);
  }
}

// residual += grad alone (keep == 0: nothing is selected, the error feedback still folds).
__global__ void group_add_kernel(float* residual, const float* grad, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    residual[i] = cpu_add(residual[i], grad[i]);
  }
}

// Emission: element i is kept when its group is flagged; the group is i / size (contiguous) or
// i % cols (columns, cols != 0). Indices fit 32 bits (n <= 2^32 - 1), so the division is 32-bit.
struct GroupOp {
  float* x;
  const unsigned char* flags;
  uint32_t size;
  uint32_t cols;
  bool clear_sent;
  struct Item {
    float v;
  };
  __device__ Item load(size_t i) const { return {x[i]}; }
  __device__ bool keep(const Item&, size_t i) const {
    const auto i32 = static_cast<uint32_t>(i);
    return flags[cols != 0 ? i32 % cols : i32 / size] != 0;
  }
  __device__ float value(const Item& it, size_t) const { return it.v; }
  __device__ void store(size_t i, const Item&, bool, bool written) const {
    if (written && clear_sent) x[i] = 0.0f;
  }
};

}  // namespace sparsecar::kernels::cuda::detail
