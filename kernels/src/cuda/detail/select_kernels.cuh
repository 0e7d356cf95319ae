// The device kernels behind cuda.h's selections (the bottom layer; select.cu validates and
// launches them). They assume valid arguments.
//
// Three building blocks:
// - compact_kernel<Op>: one pass that decides per element (Op::keep), writes the kept pairs in
//   increasing index order and lets Op write its element back (error feedback). A persistent
//   grid (4 blocks an SM) takes tiles of kTile elements in order from an atomic counter; a tile
//   is loaded striped (coalesced), every load issued before the first decision; its order is
//   found with warp ballots and a scan of the (row, warp) counts, and tiles are chained by a
//   decoupled look-back (a block only waits on tiles taken before its own).
// - radix select: histogram passes over the magnitude keys, 11 + 10 + 10 bits, each followed by
//   one block that finds the digit of the k-th largest key (RadixState), then an exact tie cut
//   (the index below which the ties at the k-th key are kept) when the ties outnumber the need.
// - small kernels: the stratified sample, counting keys above a lambda, the approximate top-k's
//   decision.
// Every kernel may be gated by a device flag (`gate`): it returns at once unless *gate != 0, so
// a data-dependent path (approximate top-k's exact fallback) needs no host round trip.
// The non-template kernels are `static`: select.cu and importance.cu both include this header, and
// an external __global__ defined in both would define its host stub twice (link error).
#pragma once

#include <cuda/atomic>
#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cstddef>
#include <cstdint>

#include "detail/bits.h"

namespace sparsecar::kernels::cuda::detail {

using kernels::detail::cpu_add;
using kernels::detail::cpu_mul;
using kernels::detail::magnitude_key;

inline constexpr int kThreads = 256;
inline constexpr int kWarps = kThreads / 32;
inline constexpr int kItems = 16;
inline constexpr size_t kTile = size_t{kThreads} * kItems;  // elements per compaction tile
inline constexpr int kHistBins = 2048;                      // the first digit's 11 bits
inline constexpr int kFindThreads = 1024;

// The radix select's progress, in device memory (zeroed before a call, then written by the
// find kernels only).
struct RadixState {
  unsigned long long k;           // the rank wanted (1-based), min(k, n)
  unsigned long long above;       // keys known to be above the current prefix's bin
  unsigned long long ties_total;  // keys equal to the k-th key (after the last digit)
  unsigned long long need;        // of those, how many belong to the top k
  unsigned long long cut;         // ties with an index below this are kept
  unsigned long long candidates;   // keys the filter pass has appended
  unsigned int prefix;            // the digits found so far
  unsigned int kth;               // the k-th largest key (after the last digit)
  unsigned int use_candidates;    // digit 0's bin fits the candidate buffer: digits 1 and 2 run
  unsigned int full_passes;       // over it (filter pass), else over the whole tensor
};

struct SelectState {
  RadixState main;                 // over the tensor (the result top-k's compaction reads)
  RadixState sample;               // over the sample keys
  RadixState band;                 // top-k: over the candidates (band.candidates: their count)
  unsigned int band_lo_key;        // top-k: keys >= this are candidates
  unsigned int cand_path;          // the result is selected from the candidates
  unsigned int cand_radix;         //   by their radix select (exact)
  unsigned int full;               // the result is selected from the tensor (a fallback)
  unsigned int full_radix;         //   by the tensor's radix select (exact)
  unsigned int exact;              // 1: the exact top-k; 0: the approximate threshold stands

  unsigned long long lambda_count; // keys >= lambda_key (approximate top-k)
  unsigned int lambda_key;         // the threshold's key (set by the host or a kernel)
  unsigned int tile_counter;       // compaction: the next tile number (first pass)
  unsigned int tile_counter2;      //   (the final selection's pass)
};

// ---- digits ----------------------------------------------------------------------------------

// Digit d of a 31-bit key: bits 30..20 (11 bits), 19..10, 9..0.
__host__ __device__ constexpr int digit_shift(int d) { return d == 0 ? 20 : (d == 1 ? 10 : 0); }
__host__ __device__ constexpr int digit_bins(int d) { return d == 0 ? 2048 : 1024; }

// sh[bin] += 1 for every lane of the warp that passes `take`, one shared atomic per distinct bin
// (skewed keys put many lanes of a warp on one bin; their atomics would serialise).
__device__ __forceinline__ void hist_add(unsigned* sh, unsigned bin, bool take) {
  const unsigned active = __ballot_sync(0xffffffffu, take);
  if (!take) return;
  const unsigned peers = __match_any_sync(active, bin);
  if ((threadIdx.x & 31u) == static_cast<unsigned>(__ffs(peers) - 1)) atomicAdd(&sh[bin], __popc(peers));
}

__device__ __forceinline__ bool gated_off(const unsigned* gate) { return gate != nullptr && *gate == 0; }
__device__ __forceinline__ bool gated_off(const unsigned* gate, const unsigned* gate2) {
  return gated_off(gate) || gated_off(gate2);
}

// Keys of a float array, optionally of x + add (float addition, as the CPU's sample does).
struct FloatKeys {
  const float* x;
  __device__ uint32_t operator()(size_t i) const { return magnitude_key(x[i]); }
};
struct SampleKeys {
  const uint32_t* keys;
  __device__ uint32_t operator()(size_t i) const { return keys[i]; }
};

// Histogram of digit d over the keys whose higher digits equal state->prefix.
// n_dev (optional): the key count is *n_dev (at most n), e.g. the candidates appended.
template <class Keys>
__global__ void __launch_bounds__(kThreads) radix_hist_kernel(Keys keys, size_t n, const unsigned long long* n_dev,
                                                              int d, const RadixState* state, unsigned* hist,
                                                              const unsigned* gate, const unsigned* gate2) {
  if (gated_off(gate, gate2)) return;
  if (n_dev != nullptr && *n_dev < n) n = *n_dev;
  __shared__ unsigned sh[kHistBins];
  const int bins = digit_bins(d);
  for (int b = threadIdx.x; b < bins; b += blockDim.x) sh[b] = 0;
  __syncthreads();
  const int shift = digit_shift(d);
  const int high_shift = d == 0 ? 31 : digit_shift(d - 1);
  const unsigned prefix = d == 0 ? 0u : state->prefix;
  const unsigned mask = static_cast<unsigned>(bins - 1);
  // Whole warps step together (hist_add's warp intrinsics): the loop bound is block-uniform.
  for (size_t i0 = blockIdx.x * size_t{blockDim.x}; i0 < n; i0 += size_t{gridDim.x} * blockDim.x) {
    const size_t i = i0 + threadIdx.x;
    const uint32_t key = i < n ? keys(i) : 0u;
    hist_add(sh, (key >> shift) & mask, i < n && (d == 0 || (key >> high_shift) == prefix));
  }
  __syncthreads();
  for (int b = threadIdx.x; b < bins; b += blockDim.x) {
    if (sh[b] != 0) atomicAdd(&hist[b], sh[b]);
  }
}

// Top-k's candidate bound from the sample's digit-0 histogram: the bin of sample rank rank_lo
// (the k-th key's expected sample rank r = k s / n plus a margin); every key in that bin or above
// is a candidate. With `with_lambda` (approximate top-k) the bound is also at most lambda_key,
// so the candidates hold every key the threshold keeps. A rank past the sample leaves bound 0
// (every element: the candidates overflow unless n is small). One block of kFindThreads.
static __global__ void __launch_bounds__(kFindThreads) bracket_kernel(SelectState* state, const unsigned* hist,
                                                               unsigned long long rank_lo, bool with_lambda) {
  using Scan = cub::BlockScan<unsigned long long, kFindThreads>;
  __shared__ typename Scan::TempStorage temp;
  __shared__ unsigned s_bin;
  constexpr int kPer = kHistBins / kFindThreads;
  unsigned long long counts[kPer];
  unsigned long long mine = 0;
#pragma unroll
  for (int q = 0; q < kPer; ++q) {
    counts[q] = hist[kHistBins - 1 - (threadIdx.x * kPer + q)];
    mine += counts[q];
  }
  unsigned long long before = 0;
  unsigned long long total = 0;
  Scan(temp).ExclusiveSum(mine, before, total);
  if (threadIdx.x == 0) s_bin = 0;
  __syncthreads();
#pragma unroll
  for (int q = 0; q < kPer; ++q) {
    const unsigned bin = kHistBins - 1 - (threadIdx.x * kPer + q);
    if (counts[q] != 0 && rank_lo <= total && before < rank_lo && rank_lo <= before + counts[q]) s_bin = bin;
    before += counts[q];
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    unsigned bound = s_bin << digit_shift(0);
    if (with_lambda && state->lambda_key < bound) bound = state->lambda_key;
    state->band_lo_key = bound;
  }
}

// Keys of the candidates' values; past the count (known on the device only) a key no element
// has (keys are below 2^31), so the tie kernels never count one there.
struct CandKeys {
  const float* value;
  const unsigned long long* count;
  __device__ uint32_t operator()(size_t i) const { return i < *count ? magnitude_key(value[i]) : 0xffffffffu; }
};

// The candidates' final selection: the approximate threshold (key >= lambda_key) when it
// stands (state->exact == 0), else the candidates' top-k (state->band: key > kth, or == kth at
// a candidate position below the cut). Sends the candidate's tensor index and clears it there.
struct CandTopkOp {
  const uint32_t* cand_index;
  const float* cand_value;
  float* residual;
  const SelectState* state;
  bool clear_sent;
  struct Item {
    uint32_t i;
    float v;
  };
  __device__ Item load(size_t p) const { return {cand_index[p], cand_value[p]}; }
  __device__ bool keep(const Item& it, size_t p) const {
    const uint32_t key = magnitude_key(it.v);
    if (state->exact == 0) return key >= state->lambda_key;
    const uint32_t kth = state->band.kth;
    return key > kth || (key == kth && p < state->band.cut);
  }
  __device__ uint32_t index(const Item& it, size_t) const { return it.i; }
  __device__ float value(const Item& it, size_t) const { return it.v; }
  __device__ void store(size_t, const Item& it, bool, bool written) const {
    if (written && clear_sent) residual[it.i] = 0.0f;
  }
};

// After the candidate pass, exact top-k: the candidates hold the top k when they did not
// overflow and number at least k; else the tensor's radix select runs.
static __global__ void topk_decide_kernel(SelectState* state, unsigned long long cand_capacity) {
  const unsigned long long count = state->band.candidates;
  const bool cand = count <= cand_capacity && count >= state->band.k;
  state->exact = 1u;
  state->cand_path = cand ? 1u : 0u;
  state->cand_radix = state->cand_path;
  state->full = 1u - state->cand_path;
  state->full_radix = state->full;
}

// Keys >= lambda_key among the candidates (approximate top-k; meaningful when they did not
// overflow).
static __global__ void __launch_bounds__(kThreads) cand_count_kernel(const float* value, size_t cap, SelectState* state) {
  using Reduce = cub::BlockReduce<unsigned long long, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  const size_t n = state->band.candidates < cap ? state->band.candidates : cap;
  const unsigned lambda = state->lambda_key;
  unsigned long long mine = 0;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    if (magnitude_key(value[i]) >= lambda) ++mine;
  }
  const unsigned long long total = Reduce(temp).Sum(mine);
  if (threadIdx.x == 0 && total != 0) atomicAdd(&state->lambda_count, total);
}

// After the candidate pass, approximate top-k, as the CPU's decision: the threshold's selection
// stands when it fits the output and lies within [low, high]. The candidates (bound <=
// lambda_key) hold every key the threshold keeps, so when they did not overflow the count is
// exact: the threshold, else the candidates' top-k (when at least k), else the tensor's. When
// they overflowed, the tensor is counted again (full path, approx_full_decide_kernel).
static __global__ void approx_decide_kernel(SelectState* state, unsigned long long cand_capacity, double low, double high,
                                     unsigned long long capacity) {
  const unsigned long long count = state->band.candidates;
  const unsigned long long lc = state->lambda_count;
  const double c = static_cast<double>(lc);
  state->full_radix = 0u;
  if (count > cand_capacity) {
    state->cand_path = 0u;
    state->cand_radix = 0u;
    state->full = 1u;
    state->lambda_count = 0;  // counted again over the tensor
    return;
  }
  state->full = 0u;
  if (lc <= capacity && c >= low && c <= high) {
    state->exact = 0u;
    state->cand_path = 1u;
    state->cand_radix = 0u;
    return;
  }
  state->exact = 1u;
  state->cand_path = count >= state->band.k ? 1u : 0u;
  state->cand_radix = state->cand_path;
  state->full = 1u - state->cand_path;
  state->full_radix = state->full;
}

// Digit 1 over the tensor once more, appending the keys in digit 0's bin to `cand` (AIR top-k's
// filtering) so that digit 2 reads only those. Runs when state->use_candidates.
template <class Keys>
__global__ void __launch_bounds__(kThreads) filter_kernel(Keys keys, size_t n, RadixState* state, uint32_t* cand,
                                                          unsigned* hist, const unsigned* gate) {
  if (gated_off(gate, &state->use_candidates)) return;
  __shared__ unsigned sh[kHistBins];
  for (int b = threadIdx.x; b < 1024; b += blockDim.x) sh[b] = 0;
  __syncthreads();
  const unsigned prefix = state->prefix;
  const unsigned lane = threadIdx.x & 31u;
  for (size_t i0 = blockIdx.x * size_t{blockDim.x}; i0 < n; i0 += size_t{gridDim.x} * blockDim.x) {
    const size_t i = i0 + threadIdx.x;
    const uint32_t key = i < n ? keys(i) : 0u;
    const bool take = i < n && (key >> digit_shift(0)) == prefix;
    hist_add(sh, (key >> digit_shift(1)) & 1023u, take);
    const unsigned mask = __ballot_sync(0xffffffffu, take);
    if (mask == 0) continue;
    unsigned long long base = 0;
    if (lane == static_cast<unsigned>(__ffs(mask) - 1)) base = atomicAdd(&state->candidates, __popc(mask));
    base = __shfl_sync(0xffffffffu, base, __ffs(mask) - 1);
    if (take) cand[base + __popc(mask & ((1u << lane) - 1u))] = key;
  }
  __syncthreads();
  for (int b = threadIdx.x; b < 1024; b += blockDim.x) {
    if (sh[b] != 0) atomicAdd(&hist[b], sh[b]);
  }
}

// One block of kFindThreads: the bin of digit d that holds the k-th largest key. After the last
// digit it sets kth, ties_total, need and (when every tie is kept) cut = n.
// cand_capacity: after digit 0, digits 1 and 2 run over the candidates when the bin's count fits
// (0: always over the tensor).
static __global__ void __launch_bounds__(kFindThreads) radix_find_kernel(RadixState* state, const unsigned* hist, int d,
                                                                  size_t n, size_t cand_capacity, const unsigned* gate) {
  if (gated_off(gate)) return;
  using Scan = cub::BlockScan<unsigned long long, kFindThreads>;
  __shared__ typename Scan::TempStorage temp;
  const int bins = digit_bins(d);
  constexpr int kPer = kHistBins / kFindThreads;  // 2 bins per thread (1 used for 1024 bins)
  // Thread t holds the bins in descending order: positions t*kPer .. t*kPer+kPer-1 of the
  // reversed histogram, so an exclusive scan gives the count of keys in higher bins.
  unsigned long long counts[kPer];
  unsigned long long mine = 0;
#pragma unroll
  for (int q = 0; q < kPer; ++q) {
    const int r = threadIdx.x * kPer + q;
    counts[q] = r < bins ? hist[bins - 1 - r] : 0;
    mine += counts[q];
  }
  // Read before the scan's barrier: one thread writes the state after it.
  const unsigned long long k = state->k;
  const unsigned long long above0 = state->above;
  const unsigned prefix0 = state->prefix;
  unsigned long long before = 0;
  Scan(temp).ExclusiveSum(mine, before);
#pragma unroll
  for (int q = 0; q < kPer; ++q) {
    const int r = threadIdx.x * kPer + q;
    const unsigned long long higher = above0 + before;
    if (r < bins && counts[q] != 0 && higher < k && k <= higher + counts[q]) {
      const unsigned bin = static_cast<unsigned>(bins - 1 - r);
      const unsigned prefix = d == 0 ? bin : ((prefix0 << 10) | bin);
      state->prefix = prefix;
      state->above = higher;
      if (d == 0) {
        state->use_candidates = counts[q] <= cand_capacity ? 1u : 0u;
        state->full_passes = 1u - state->use_candidates;
      }
      if (d == 2) {
        state->kth = prefix;
        state->ties_total = counts[q];
        state->need = k - higher;
        state->cut = (counts[q] == k - higher) ? n : 0;
      }
    }
    before += counts[q];
  }
}

// Ties at the k-th key per compaction tile (only when some ties are not kept).
template <class Keys>
__global__ void __launch_bounds__(kThreads) tie_count_kernel(Keys keys, size_t n, const RadixState* state,
                                                             unsigned* tile_ties, const unsigned* gate) {
  if (gated_off(gate)) return;
  if (state->ties_total == state->need) return;
  using Reduce = cub::BlockReduce<unsigned, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  const unsigned kth = state->kth;
  const size_t tiles = (n + kTile - 1) / kTile;
  // A bounded grid steps over the tiles (gated off, it costs one wave, not one block a tile).
  for (size_t tile = blockIdx.x; tile < tiles; tile += gridDim.x) {
    const size_t base = tile * kTile;
    unsigned mine = 0;
    for (int j = 0; j < kItems; ++j) {
      const size_t i = base + static_cast<size_t>(j) * kThreads + threadIdx.x;
      if (i < n && keys(i) == kth) ++mine;
    }
    const unsigned total = Reduce(temp).Sum(mine);
    if (threadIdx.x == 0) tile_ties[tile] = total;
    __syncthreads();  // temp is reused
  }
}

// One block of kFindThreads: the cut index after the need-th tie (in index order).
template <class Keys>
__global__ void __launch_bounds__(kFindThreads) tie_cut_kernel(Keys keys, size_t n, RadixState* state,
                                                               const unsigned* tile_ties, size_t tiles,
                                                               const unsigned* gate) {
  if (gated_off(gate)) return;
  if (state->ties_total == state->need) return;
  using Scan = cub::BlockScan<unsigned long long, kFindThreads>;
  __shared__ typename Scan::TempStorage temp;
  __shared__ unsigned long long s_found_tile;
  __shared__ unsigned long long s_before;
  const unsigned long long need = state->need;
  if (threadIdx.x == 0) s_found_tile = ~0ull;
  __syncthreads();
  // 1. The tile holding the need-th tie.
  unsigned long long running = 0;
  for (size_t chunk = 0; chunk < tiles; chunk += kFindThreads) {
    const size_t t = chunk + threadIdx.x;
    const unsigned long long c = t < tiles ? tile_ties[t] : 0;
    unsigned long long excl = 0;
    unsigned long long chunk_total = 0;
    Scan(temp).ExclusiveSum(c, excl, chunk_total);
    if (t < tiles && running + excl < need && need <= running + excl + c) {
      s_found_tile = t;
      s_before = running + excl;
    }
    __syncthreads();
    if (s_found_tile != ~0ull) break;
    running += chunk_total;
  }
  if (s_found_tile == ~0ull) return;  // unreachable: the tiles hold ties_total > need ties
  // 2. Inside it: the element of the (need - before)-th tie. Thread t looks at kItems
  // consecutive elements.
  const size_t tile = s_found_tile;
  const unsigned long long want = need - s_before;
  const unsigned kth = state->kth;
  const size_t base = tile * kTile;
  constexpr int kPer = static_cast<int>(kTile / kFindThreads);
  unsigned long long mine = 0;
  for (int q = 0; q < kPer; ++q) {
    const size_t i = base + size_t{threadIdx.x} * kPer + q;
    if (i < n && keys(i) == kth) ++mine;
  }
  unsigned long long excl = 0;
  Scan(temp).ExclusiveSum(mine, excl);
  if (excl < want && want <= excl + mine) {
    unsigned long long seen = excl;
    for (int q = 0; q < kPer; ++q) {
      const size_t i = base + size_t{threadIdx.x} * kPer + q;
      if (i < n && keys(i) == kth && ++seen == want) {
        state->cut = i + 1;
        break;
      }
    }
  }
}

// ---- compaction --------------------------------------------------------------------------------

struct Output {
  uint32_t* index;
  float* value;
  unsigned long long capacity;
  unsigned long long* count;
};

// Tile status of the look-back: flag in the top two bits (1: the tile's own count, 2: the
// inclusive prefix), the count below.
inline constexpr unsigned long long kFlagAggregate = 1ull << 62;
inline constexpr unsigned long long kFlagPrefix = 2ull << 62;
inline constexpr unsigned long long kCountMask = (1ull << 62) - 1;

// The count and its flag share one 64-bit word, so the look-back needs no ordering beyond the
// word's own atomicity: relaxed loads and stores (acquire/release cost 10-25 % of a pass).
__device__ __forceinline__ void publish(unsigned long long* status, unsigned long long word) {
  ::cuda::atomic_ref<unsigned long long, ::cuda::thread_scope_device> ref(*status);
  ref.store(word, ::cuda::memory_order_relaxed);
}
__device__ __forceinline__ unsigned long long observe(unsigned long long* status) {
  ::cuda::atomic_ref<unsigned long long, ::cuda::thread_scope_device> ref(*status);
  return ref.load(::cuda::memory_order_relaxed);
}

__device__ __forceinline__ unsigned long long warp_sum(unsigned long long v) {
#pragma unroll
  for (int delta = 16; delta > 0; delta >>= 1) v += __shfl_down_sync(0xffffffffu, v, delta);
  return __shfl_sync(0xffffffffu, v, 0);
}

// The decoupled look-back of one warp (CUB's scheme): publish this tile's count, then read the
// 32 tiles before it at once; if one of them has its inclusive prefix, the prefix is that plus
// the counts of the tiles after it; else add the 32 counts and look 32 further back. Returns the
// exclusive prefix of `tile` (to every lane) after publishing its inclusive one.
__device__ __forceinline__ unsigned long long look_back(unsigned long long* status, size_t tile,
                                                        unsigned long long total, unsigned lane) {
  if (tile == 0) {
    if (lane == 0) publish(&status[0], kFlagPrefix | total);
    return 0;
  }
  if (lane == 0) publish(&status[tile], kFlagAggregate | total);
  unsigned long long prefix = 0;
  long long nearest = static_cast<long long>(tile) - 1;  // lane 0 reads this one, lane j nearest - j
  while (true) {
    const long long t = nearest - static_cast<long long>(lane);
    unsigned long long word = kFlagPrefix;  // before tile 0: an inclusive prefix of 0
    if (t >= 0) {
      do {
        word = observe(&status[t]);
      } while ((word & ~kCountMask) == 0);  // not yet published: spin
    }
    const unsigned with_prefix = __ballot_sync(0xffffffffu, (word & ~kCountMask) == kFlagPrefix);
    if (with_prefix != 0) {
      const unsigned stop = __ffs(with_prefix) - 1;  // the nearest tile that has its prefix
      prefix += warp_sum(lane <= stop ? (word & kCountMask) : 0);
      break;
    }
    prefix += warp_sum(word & kCountMask);
    nearest -= 32;
  }
  if (lane == 0) publish(&status[tile], kFlagPrefix | (prefix + total));
  return prefix;
}

// The index written for element i: Op::index(item, i) where the op has one (a compaction over
// candidates sends the candidate's own index), else i.
template <class Op>
__device__ __forceinline__ uint32_t index_of(const Op& op, const typename Op::Item& it, size_t i) {
  if constexpr (requires { op.index(it, i); }) {
    return op.index(it, i);
  } else {
    return static_cast<uint32_t>(i);
  }
}

// Op: struct Item; __device__ Item load(size_t i); bool keep(const Item&, size_t i);
// float value(const Item&, size_t i) (what is sent); void store(size_t i, const Item&, bool kept,
// bool written) (the element's write-back, may do nothing); optionally uint32_t index(const
// Item&, size_t i). keep is called twice per element (counting, then writing): it must be a
// pure function of the item, the index and state no kernel of the pass writes.
// The grid: at most one block per tile (persistent: blocks loop over the tiles); status: one
// zeroed word per tile of kTile elements.
// n_dev (optional): the element count is min(n, *n_dev), known on the device only (the grid is
// sized for n; tiles past the count return at once).
template <class Op>
__global__ void __launch_bounds__(kThreads, 4) compact_kernel(Op op, size_t n, Output out, unsigned long long* status,
                                                              unsigned* tile_counter, const unsigned* gate,
                                                              const unsigned long long* n_dev) {
  if (gated_off(gate)) return;
  if (n_dev != nullptr && *n_dev < n) n = *n_dev;
  const size_t tiles = (n + kTile - 1) / kTile;
  if (tiles == 0) {
    if (blockIdx.x == 0 && threadIdx.x == 0) *out.count = 0;
    return;
  }
  __shared__ unsigned s_tile;
  __shared__ unsigned s_offsets[kItems * kWarps];  // counts per (row, warp), then exclusive offsets
  __shared__ unsigned long long s_prefix;
  const unsigned lane = threadIdx.x & 31u;
  const unsigned warp = threadIdx.x >> 5;
  const unsigned lower = (1u << lane) - 1u;
  while (true) {
    if (threadIdx.x == 0) s_tile = atomicAdd(tile_counter, 1u);
    __syncthreads();
    const size_t tile = s_tile;
    if (tile >= tiles) return;  // block-uniform
    const size_t base = tile * kTile + threadIdx.x;
    const bool full = tile * kTile + kTile <= n;
    // Every load of the tile is issued before the first ballot (the bytes in flight are what a
    // streaming pass needs); the decisions are made again when writing rather than kept, which
    // saves the registers that let 4 blocks share an SM.
    typename Op::Item items[kItems];
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const size_t i = base + static_cast<size_t>(j) * kThreads;
      if (full || i < n) items[j] = op.load(i);
    }
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const size_t i = base + static_cast<size_t>(j) * kThreads;
      const unsigned mask = __ballot_sync(0xffffffffu, (full || i < n) && op.keep(items[j], i));
      if (lane == 0) s_offsets[j * kWarps + warp] = __popc(mask);
    }
    __syncthreads();
    if (warp == 0) {
      // 128 counts in (row, warp) order, 4 per lane: scan them.
      constexpr int kPerLane = kItems * kWarps / 32;
      unsigned c[kPerLane];
      unsigned sum = 0;
#pragma unroll
      for (int q = 0; q < kPerLane; ++q) {
        c[q] = s_offsets[lane * kPerLane + q];
        sum += c[q];
      }
      unsigned incl = sum;
#pragma unroll
      for (int delta = 1; delta < 32; delta <<= 1) {
        const unsigned other = __shfl_up_sync(0xffffffffu, incl, delta);
        if (lane >= static_cast<unsigned>(delta)) incl += other;
      }
      unsigned run = incl - sum;
#pragma unroll
      for (int q = 0; q < kPerLane; ++q) {
        s_offsets[lane * kPerLane + q] = run;
        run += c[q];
      }
      const unsigned long long total = __shfl_sync(0xffffffffu, incl, 31);
      const unsigned long long prefix = look_back(status, tile, total, lane);
      if (lane == 0) {
        s_prefix = prefix;
        if (tile == tiles - 1) *out.count = prefix + total;
      }
    }
    __syncthreads();
    const unsigned long long prefix = s_prefix;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const size_t i = base + static_cast<size_t>(j) * kThreads;
      const bool in = full || i < n;
      const unsigned mask = __ballot_sync(0xffffffffu, in && op.keep(items[j], i));
      if (!in) continue;
      const bool kept = (mask >> lane) & 1u;
      bool written = false;
      if (kept) {
        const unsigned long long pos = prefix + s_offsets[j * kWarps + warp] + __popc(mask & lower);
        if (pos < out.capacity) {
          out.index[pos] = index_of(op, items[j], i);
          out.value[pos] = op.value(items[j], i);
          written = true;
        }
      }
      op.store(i, items[j], kept, written);
    }
    __syncthreads();  // s_tile, s_offsets and s_prefix are reused by the next tile
  }
}

// ---- the ops -------------------------------------------------------------------------------------

// Hard threshold with error feedback: r = residual (+ grad), kept when key(r) >= lambda_key.
struct EfThresholdOp {
  float* residual;
  const float* grad;
  const unsigned* lambda_key;
  bool clear_sent;
  struct Item {
    float v;
  };
  __device__ Item load(size_t i) const {
    float v = residual[i];
    if (grad != nullptr) v = cpu_add(v, grad[i]);
    return {v};
  }
  __device__ bool keep(const Item& it, size_t) const { return magnitude_key(it.v) >= *lambda_key; }
  __device__ float value(const Item& it, size_t) const { return it.v; }
  __device__ void store(size_t i, const Item& it, bool, bool written) const {
    if (written && clear_sent) {
      residual[i] = 0.0f;
    } else if (grad != nullptr) {
      residual[i] = it.v;
    }
  }
};

// DGC momentum correction: u = m u + f g; v = r + u; kept when key(v) >= lambda_key.
struct MomentumThresholdOp {
  float* velocity;
  float* residual;
  const float* grad;
  float momentum;
  float factor;
  unsigned lambda_key;
  struct Item {
    float u;
    float v;
  };
  __device__ Item load(size_t i) const {
    const float u = cpu_add(cpu_mul(momentum, velocity[i]), cpu_mul(factor, grad[i]));
    return {u, cpu_add(residual[i], u)};
  }
  __device__ bool keep(const Item& it, size_t) const { return magnitude_key(it.v) >= lambda_key; }
  __device__ float value(const Item& it, size_t) const { return it.v; }
  __device__ void store(size_t i, const Item& it, bool, bool written) const {
    velocity[i] = written ? 0.0f : it.u;
    residual[i] = written ? 0.0f : it.v;
  }
};

// Top-k after the radix select: key > kth, or key == kth below the tie cut. With `approx`, the
// approximate top-k's threshold (key >= lambda_key) unless state->exact.
struct TopkOp {
  float* x;
  const SelectState* state;
  bool clear_sent;
  bool approx;
  struct Item {
    float v;
  };
  __device__ Item load(size_t i) const { return {x[i]}; }
  __device__ bool keep(const Item& it, size_t i) const {
    const uint32_t key = magnitude_key(it.v);
    if (approx && state->exact == 0) return key >= state->lambda_key;
    const uint32_t kth = state->main.kth;
    return key > kth || (key == kth && i < state->main.cut);
  }
  __device__ float value(const Item& it, size_t) const { return it.v; }
  __device__ void store(size_t i, const Item&, bool, bool written) const {
    if (written && clear_sent) x[i] = 0.0f;
  }
};

// Random-k (block 1) and random blocks: kept when draw(a, b, i / block) < t; unbiased values
// are x * inv_p computed in float64, as on the CPU.
struct RandomOp {
  const float* x;
  uint32_t a;
  uint32_t b;
  unsigned long long t;
  unsigned long long block;
  double inv_p;
  bool unbiased;
  struct Item {
    float v;
  };
  __device__ Item load(size_t i) const { return {x[i]}; }
  __device__ bool keep(const Item&, size_t i) const {
    return kernels::detail::draw(a, b, static_cast<uint32_t>(block == 1 ? i : i / block)) < t;
  }
  __device__ float value(const Item& it, size_t) const {
    return unbiased ? kernels::detail::cpu_scale_f64(it.v, inv_p) : it.v;
  }
  __device__ void store(size_t, const Item&, bool, bool) const {}
};

// ---- small kernels ---------------------------------------------------------------------------

// Keys of the stratified sample of x (+ add), as the CPU's sample_keys.
static __global__ void sample_kernel(const float* x, const float* add, size_t n, size_t s, uint32_t* keys) {
  const size_t j = blockIdx.x * size_t{blockDim.x} + threadIdx.x;
  if (j >= s) return;
  const uint64_t mixed = kernels::detail::splitmix64(kernels::detail::kSampleSeed);
  const size_t i = kernels::detail::sample_position(j, n / s, static_cast<uint32_t>(mixed),
                                                    static_cast<uint32_t>(mixed >> 32));
  keys[j] = magnitude_key(add != nullptr ? cpu_add(x[i], add[i]) : x[i]);
}

// lambda_key from the sample's radix select: the key found, +inf's key for a NaN key (the
// CPU's magnitude_quantile returns +inf then).
static __global__ void lambda_from_sample_kernel(SelectState* state) {
  const unsigned key = state->sample.kth;
  state->lambda_key = key >= kernels::detail::kNanKey ? 0x7f800000u : key;
}

// Approximate top-k's fallback when the candidates overflowed: the count of the tensor's keys
// >= lambda_key (the residual already holds the sum), then the CPU's decision.
static __global__ void __launch_bounds__(kThreads) lambda_count_kernel(const float* x, size_t n, SelectState* state,
                                                                const unsigned* gate) {
  if (gated_off(gate)) return;
  using Reduce = cub::BlockReduce<unsigned long long, kThreads>;
  __shared__ typename Reduce::TempStorage temp;
  const unsigned lambda = state->lambda_key;
  unsigned long long mine = 0;
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    if (magnitude_key(x[i]) >= lambda) ++mine;
  }
  const unsigned long long total = Reduce(temp).Sum(mine);
  if (threadIdx.x == 0 && total != 0) atomicAdd(&state->lambda_count, total);
}

static __global__ void approx_full_decide_kernel(SelectState* state, double low, double high, unsigned long long capacity) {
  if (state->full == 0) return;
  const unsigned long long count = state->lambda_count;
  const double c = static_cast<double>(count);
  state->exact = (count <= capacity && c >= low && c <= high) ? 0u : 1u;
  state->full_radix = state->exact;
}

}  // namespace sparsecar::kernels::cuda::detail
