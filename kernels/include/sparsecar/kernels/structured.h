// Structured sparsifiers: selectors that keep whole groups of coordinates (blocks, rows,
// columns, output channels, attention heads), the building blocks of periodic masks, and the
// hybrid "per-tensor top-k + pooled global threshold" rule.
//
// Owner: the structured-sparsity part of issue 3. Same contract as select.h: pure functions over
// spans, no allocation, no threads, no I/O; scratch is owned by the caller and sized by
// group_scratch_bytes(); outputs are (index, value) pairs with strictly increasing indices, so
// every existing encoder/decoder (COO, ...) takes them unchanged.
//
// Group ranking (every group selector): a group's score is Σ x_i² (L2; the square root does not
// change the order) or Σ |x_i| (L1), summed in float64 in increasing index order. A group that
// holds a NaN ranks above every other group (like a NaN in select.h's magnitude order: a diverged
// gradient is sent, not hidden); NaN groups tie with each other. Ties are broken by the lower
// group index, so the result is deterministic and the same on every node for the same input.
// `keep` groups are kept (capped at the number of groups); every element of a kept group is
// written, zeros included (the structure is the point).
//
// Thread-safety: pure functions; concurrent calls on disjoint buffers are safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "sparsecar/common/status.h"

namespace sparsecar::kernels {

// How a group is scored. Values are frozen (they may travel in manifests and checkpoints).
enum class GroupNorm : uint16_t {
  kL2 = 0,  // Σ x²
  kL1 = 1,  // Σ |x|
};
std::string_view group_norm_name(GroupNorm norm);            // "l2", "l1"
bool parse_group_norm(std::string_view text, GroupNorm* out);  // false (and *out unchanged) if unknown

// Block sizes block_topk accepts (the knob's range): 32..256 elements.
inline constexpr size_t kMinBlock = 32;
inline constexpr size_t kMaxBlock = 256;

// Bytes of scratch any group selector needs for `groups` groups: 12 per group + 64.
size_t group_scratch_bytes(size_t groups);

// ---- contiguous groups -------------------------------------------------------------------------

// Block top-k: x is cut into ceil(n / block) contiguous blocks of `block` elements (the last one
// may be shorter: it is scored over the elements it has). The `keep` best blocks are written.
// Output capacity (out_index/out_value): at least min(n, keep * block) entries.
// Errors (kInvalidArgument, nothing written): block outside kMinBlock..kMaxBlock, scratch smaller
// than group_scratch_bytes(ceil(n / block)), null outputs with work to do, n > 2^32 - 1.
// Returns the number of pairs written (0 when n == 0 or keep == 0).
Expected<size_t> block_topk(std::span<const float> x, size_t block, size_t keep, GroupNorm norm,
                            std::span<std::byte> scratch, uint32_t* out_index, float* out_value);

// Random blocks: x is cut into ceil(n / block) contiguous blocks of `block` elements as in
// block_topk (the last one may be shorter), and block b is kept when random_draw(seed, b) <
// random_keep_threshold(p) (select.h: random-k's rule with one draw per block index), so every
// node keeps the same blocks for the same seed, whatever its data, each with probability p' =
// t / 2^32 (the probability actually used; p <= 0 keeps nothing, p >= 1 everything). Every element
// of a kept block is written, zeros included: x_i, or with `unbiased` x_i / p' (E[sent] = x; for
// error feedback off, as randomk_select). Writes min(count, capacity) pairs in index order and
// returns the count (capacity n never drops any).
// Errors (kInvalidArgument, nothing written): block outside kMinBlock..kMaxBlock, n > 2^32 - 1,
// null outputs with capacity > 0.
Expected<size_t> randblock_select(std::span<const float> x, size_t block, double p, uint64_t seed, bool unbiased,
                                  uint32_t* out_index, float* out_value, size_t capacity);

// Row top-k of a row-major [rows, cols] matrix: the `keep` best rows. rows * cols must equal
// x.size(). Output capacity: min(rows, keep) * cols. Scratch: group_scratch_bytes(rows).
Expected<size_t> row_topk(std::span<const float> x, size_t rows, size_t cols, size_t keep, GroupNorm norm,
                          std::span<std::byte> scratch, uint32_t* out_index, float* out_value);

// Channel sparsity of a conv weight [c_out, c_in, kh, kw] (row-major, as PyTorch lays it out):
// ranks the c_out output channels (each a contiguous slice of c_in*kh*kw) and keeps `keep`.
// The product of `shape` must equal x.size(). Output capacity: min(c_out, keep) * c_in*kh*kw.
// Scratch: group_scratch_bytes(c_out).
Expected<size_t> channel_topk(std::span<const float> x, std::span<const uint64_t, 4> shape, size_t keep,
                              GroupNorm norm, std::span<std::byte> scratch, uint32_t* out_index,
                              float* out_value);

// Attention-head sparsity: the leading dimension (`leading` rows of x.size() / leading elements)
// is split into `heads` contiguous slices of leading / heads rows each (the usual [heads*d_head,
// d_model] projection layout); the `keep` best heads are kept. leading must be a multiple of
// heads and divide x.size(). Output capacity: min(heads, keep) * x.size() / heads.
// Scratch: group_scratch_bytes(heads).
Expected<size_t> head_topk(std::span<const float> x, size_t leading, size_t heads, size_t keep, GroupNorm norm,
                           std::span<std::byte> scratch, uint32_t* out_index, float* out_value);

// ---- strided groups ----------------------------------------------------------------------------

// Column top-k of a row-major [rows, cols] matrix: the `keep` best columns, written row by row
// (so indices stay increasing). Output capacity: rows * min(cols, keep). Scratch:
// group_scratch_bytes(cols).
Expected<size_t> column_topk(std::span<const float> x, size_t rows, size_t cols, size_t keep, GroupNorm norm,
                             std::span<std::byte> scratch, uint32_t* out_index, float* out_value);

// ---- periodic masks ------------------------------------------------------------------------------

// importance[i] += |g[i]| (the accumulated importance a periodic mask is computed from). Sizes
// must match (checked; aborts). A NaN in g makes that coordinate's importance NaN, which ranks
// first when the mask is computed (topk_exact's order).
void importance_accumulate(std::span<float> importance, std::span<const float> g);

// out_value[j] = x[index[j]] for every j: reads the values of a fixed mask. Indices must be
// < x.size() (checked; aborts).
void gather(std::span<const float> x, std::span<const uint32_t> index, float* out_value);

// ---- hybrid: per-tensor top-k plus a pooled global threshold -----------------------------------

// Union of topk_exact(x, k) and { i : |x_i| >= lambda } (threshold_select's rule, so a lambda
// that is not > 0 selects everything). Outputs must hold x.size() entries; scratch as
// topk_exact (topk_scratch_bytes(n)). Returns the number of pairs written.
// Cost: one top-k, plus one threshold pass only when lambda is at or below the k-th magnitude.
Expected<size_t> topk_or_threshold(std::span<const float> x, size_t k, float lambda, std::span<std::byte> scratch,
                                   uint32_t* out_index, float* out_value);

// A magnitude histogram pooled over several tensors: bin = the top 16 bits of |x|'s IEEE bits
// (sign dropped; 8 exponent + 7 mantissa bits, i.e. < 0.8 % relative width; NaNs in the top bin).
inline constexpr size_t kMagnitudeBins = size_t{1} << 16;
// hist[bin(|x_i|)] += 1 for every i.
void magnitude_histogram_add(std::span<uint64_t, kMagnitudeBins> hist, std::span<const float> x);
// The largest bin edge λ (a float) such that at least `count` of the pooled elements have
// |x| >= λ: the lower edge of the bin where the running count from the top reaches `count`.
// count == 0 gives +inf; count > the total gives 0 (select everything).
float magnitude_histogram_threshold(std::span<const uint64_t, kMagnitudeBins> hist, uint64_t count);

}  // namespace sparsecar::kernels
