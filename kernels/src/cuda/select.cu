// cuda.h's selections: validate on the host, then queue the kernels of
// detail/select_kernels.cuh and detail/structured_kernels.cuh on the caller's stream (no
// allocation, no host synchronisation). One translation unit: the headers define kernels.
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <span>
#include <string>

#include <cub/device/device_radix_sort.cuh>

#include "cuda/detail/launch.h"
#include "cuda/detail/select_kernels.cuh"
#include "cuda/detail/status.h"
#include "cuda/detail/structured_kernels.cuh"
#include "sparsecar/kernels/cuda.h"
#include "sparsecar/kernels/select.h"
#include "sparsecar/kernels/structured.h"

namespace sparsecar::kernels::cuda {
namespace {

using namespace detail;  // NOLINT: the kernels of this backend

constexpr size_t kMaxElements = std::numeric_limits<uint32_t>::max();
size_t tiles_of(size_t n) { return (n + kTile - 1) / kTile; }
// compact_kernel's look-back words (one per tile) for n elements.
size_t compact_tiles(size_t n) { return std::max<size_t>(tiles_of(n), 1); }
// The persistent compaction grid: 4 blocks per SM (compact_kernel's launch bounds), which loop
// over the tiles; never more blocks than tiles.
size_t persistent_blocks() { return static_cast<size_t>(detail::stride_blocks(size_t{1} << 40, kThreads)) / 2; }
// Top-k's candidates (index + value pairs) and, on the fallback path, the keys the filter pass
// keeps (digit 0's bin of the k-th key, in the same memory): 1/8 of the tensor and 4096 more.
// More candidates (k above ~10 %, or few distinct magnitudes) take the tensor's passes instead.
size_t candidate_capacity(size_t n) { return std::min(n, n / 8 + 4096); }

// The workspace, carved in this order; the first four are zeroed before every call.
struct Layout {
  SelectState* state;
  unsigned* hist_main;    // 3 digits x kHistBins
  unsigned* hist_sample;  // 3 digits x kHistBins
  unsigned* hist_band;    // 3 digits x kHistBins
  unsigned* hist_bracket; // kHistBins
  unsigned long long* status;   // one look-back word per tile (first compaction pass)
  unsigned long long* status2;  //   (the final selection's pass)
  size_t zeroed_bytes;
  unsigned* tile_ties;    // one count per tile
  uint32_t* cand_index;   // candidate_capacity(n) indices
  float* cand_value;      //   and their values
  uint32_t* candidates;   // the fallback's filter keys (cand_index's memory)
  uint32_t* sample;       // kSampleMax keys
  size_t bytes;
};

Layout layout(void* base, size_t n) {
  Layout l{};
  WorkspaceCarver carve(base);
  const size_t tiles = std::max<size_t>(tiles_of(n), 1);
  l.state = carve.take<SelectState>(sizeof(SelectState));
  l.hist_main = carve.take<unsigned>(3 * kHistBins * sizeof(unsigned));
  l.hist_sample = carve.take<unsigned>(3 * kHistBins * sizeof(unsigned));
  l.hist_band = carve.take<unsigned>(3 * kHistBins * sizeof(unsigned));
  l.hist_bracket = carve.take<unsigned>(kHistBins * sizeof(unsigned));
  l.status = carve.take<unsigned long long>(compact_tiles(n) * sizeof(unsigned long long));
  l.status2 = carve.take<unsigned long long>(compact_tiles(n) * sizeof(unsigned long long));
  l.zeroed_bytes = carve.bytes();
  l.tile_ties = carve.take<unsigned>(tiles * sizeof(unsigned));
  l.cand_index = carve.take<uint32_t>(candidate_capacity(n) * sizeof(uint32_t));
  l.cand_value = carve.take<float>(candidate_capacity(n) * sizeof(float));
  l.candidates = l.cand_index;
  l.sample = carve.take<uint32_t>(kernels::detail::kSampleMax * sizeof(uint32_t));
  l.bytes = carve.bytes();
  return l;
}

unsigned stride_blocks(size_t n) { return detail::stride_blocks(n, kThreads); }

__global__ void init_kernel(SelectState* state, unsigned long long main_k, unsigned long long sample_k,
                            unsigned lambda_key) {
  state->main.k = main_k;
  state->band.k = main_k;
  state->sample.k = sample_k;
  state->lambda_key = lambda_key;
}

__global__ void add_kernel(float* residual, const float* grad, size_t n) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    residual[i] = kernels::detail::cpu_add(residual[i], grad[i]);
  }
}

Status check_common(const char* what, const void* x, size_t n, const DeviceSelection& out, Workspace ws) {
  const std::string name(what);
  if (n > kMaxElements) return invalid_argument(name + ": " + std::to_string(n) + " elements exceed 2^32 - 1");
  if (n > 0 && x == nullptr) return invalid_argument(name + ": null input");
  if (out.count == nullptr) return invalid_argument(name + ": null count");
  if (out.capacity > 0 && (out.index == nullptr || out.value == nullptr)) {
    return invalid_argument(name + ": null output with capacity " + std::to_string(out.capacity));
  }
  const size_t need = select_workspace_bytes(n);
  return check_workspace(name, ws, need);
}

Output output_of(const DeviceSelection& out) {
  return {out.index, out.value, out.capacity, reinterpret_cast<unsigned long long*>(out.count)};
}

// Zeroes the workspace's state and sets the ranks and lambda.
Status begin(const char* what, const Layout& l, unsigned long long main_k, unsigned long long sample_k,
             unsigned lambda_key, Stream stream) {
  SC_RETURN_IF_ERROR(cuda_status(what, cudaMemsetAsync(l.state, 0, l.zeroed_bytes, stream)));
  init_kernel<<<1, 1, 0, stream>>>(l.state, main_k, sample_k, lambda_key);
  return cuda_status(what, cudaGetLastError());
}

// One compaction pass with the layout's first look-back (`second`: its second, for a pass after
// another in the same call). gate / n_dev: see compact_kernel.
template <class Op>
void queue_compact(const Op& op, size_t n, Output out, const Layout& l, bool second, const unsigned* gate,
                   const unsigned long long* n_dev, Stream stream) {
  unsigned long long* st = second ? l.status2 : l.status;
  unsigned* counter = second ? &l.state->tile_counter2 : &l.state->tile_counter;
  const unsigned grid = static_cast<unsigned>(std::min(compact_tiles(n), persistent_blocks()));
  compact_kernel<Op><<<grid, kThreads, 0, stream>>>(op, n, out, st, counter, gate, n_dev);
}

template <class Op>
Status compact(const char* what, const Op& op, size_t n, const DeviceSelection& out, const Layout& l, Stream stream) {
  queue_compact(op, n, output_of(out), l, false, nullptr, nullptr, stream);
  return cuda_status(what, cudaGetLastError());
}

// Digits 1 and 2 of the radix select (digit 0's histogram is queued by the caller) and the tie
// cut, over `keys`. With a candidate buffer, digit 1 also filters digit 0's bin into it when it
// fits, and digit 2 reads only the candidates; gated kernels pick the path on the device.
// filter: the tensor's radix select (the sample's is small); with_cut: queue the tie cut too.
template <class Keys>
void radix_rest(Keys keys, size_t n, RadixState* state, unsigned* hist, const unsigned* gate, const Layout& l,
                bool filter, bool with_cut, Stream stream) {
  const size_t cand_capacity = filter ? candidate_capacity(n) : 0;
  radix_find_kernel<<<1, kFindThreads, 0, stream>>>(state, hist, 0, n, cand_capacity, gate);
  unsigned* h1 = hist + kHistBins;
  unsigned* h2 = hist + 2 * kHistBins;
  const unsigned* full = filter ? &state->full_passes : nullptr;
  if (filter) {
    filter_kernel<Keys><<<stride_blocks(n), kThreads, 0, stream>>>(keys, n, state, l.candidates, h1, gate);
  }
  radix_hist_kernel<Keys><<<stride_blocks(n), kThreads, 0, stream>>>(keys, n, nullptr, 1, state, h1, gate, full);
  radix_find_kernel<<<1, kFindThreads, 0, stream>>>(state, h1, 1, n, 0, gate);
  if (filter) {
    radix_hist_kernel<SampleKeys><<<stride_blocks(cand_capacity), kThreads, 0, stream>>>(
        SampleKeys{l.candidates}, cand_capacity, &state->candidates, 2, state, h2, gate, &state->use_candidates);
  }
  radix_hist_kernel<Keys><<<stride_blocks(n), kThreads, 0, stream>>>(keys, n, nullptr, 2, state, h2, gate, full);
  radix_find_kernel<<<1, kFindThreads, 0, stream>>>(state, h2, 2, n, 0, gate);
  if (!with_cut) return;
  const size_t tiles = tiles_of(n);
  tie_count_kernel<Keys><<<stride_blocks(n), kThreads, 0, stream>>>(keys, n, state, l.tile_ties, gate);
  tie_cut_kernel<Keys><<<1, kFindThreads, 0, stream>>>(keys, n, state, l.tile_ties, tiles, gate);
}

// The key of the sample at 0-based descending position `rank` goes to state->lambda_key.
void sample_lambda(float* x, const float* add, size_t n, const Layout& l, Stream stream) {
  const size_t s = kernels::detail::sample_size(n);
  sample_kernel<<<static_cast<unsigned>((s + kThreads - 1) / kThreads), kThreads, 0, stream>>>(x, add, n, s, l.sample);
  const SampleKeys keys{l.sample};
  radix_hist_kernel<SampleKeys><<<stride_blocks(s), kThreads, 0, stream>>>(keys, s, nullptr, 0, &l.state->sample,
                                                                           l.hist_sample, nullptr, nullptr);
  radix_rest(keys, s, &l.state->sample, l.hist_sample, nullptr, l, false, false, stream);
  lambda_from_sample_kernel<<<1, 1, 0, stream>>>(l.state);
}

// Top-k's candidate bound (bracket_kernel) from a sample histogram of digit 0: the sample rank
// r = k s / n of the k-th key plus 3 sigma + 2 (as the CPU's sampled path brackets it).
void queue_bracket(size_t n, size_t k, size_t s, const unsigned* hist, bool with_lambda, const Layout& l,
                   Stream stream) {
  const double r = static_cast<double>(k) * static_cast<double>(s) / static_cast<double>(n);
  const double margin = 3.0 * std::sqrt(r) + 2.0;
  const auto lo_rank = static_cast<unsigned long long>(std::min(std::ceil(r + margin), static_cast<double>(s)));
  bracket_kernel<<<1, kFindThreads, 0, stream>>>(l.state, hist, lo_rank, with_lambda);
}

// Exact and approximate top-k after the bound: one pass over the tensor (error feedback written
// back, candidates >= the bound appended in index order), the decision, the candidates' radix
// select and tie cut (or, when the candidates do not hold the answer, the tensor's), and the
// final selection from the candidates (or the tensor). The paths are gated on the device, so
// the call queues them all without a host round trip; the ones not taken return at once.
// approx: the sample's threshold stands when its count lies in [low, high] (state->exact).
void queue_topk_passes(float* residual, const float* grad, size_t n, bool clear_sent, bool approx, Output out,
                       const Layout& l, Stream stream, double low = 0.0, double high = 0.0) {
  SelectState* st = l.state;
  const size_t cap = candidate_capacity(n);
  RadixState* band = &st->band;
  // The candidate pass: EF + threshold at the bound (residual += grad written back), nothing
  // cleared (what is sent is known only after the candidates' select); candidates in index order.
  queue_compact(EfThresholdOp{residual, grad, &st->band_lo_key, false}, n,
                Output{l.cand_index, l.cand_value, cap, &band->candidates}, l, false, nullptr, nullptr, stream);
  if (approx) {
    cand_count_kernel<<<stride_blocks(cap), kThreads, 0, stream>>>(l.cand_value, cap, st);
    approx_decide_kernel<<<1, 1, 0, stream>>>(st, cap, low, high, out.capacity);
    lambda_count_kernel<<<stride_blocks(n), kThreads, 0, stream>>>(residual, n, st, &st->full);
    approx_full_decide_kernel<<<1, 1, 0, stream>>>(st, low, high, out.capacity);
  } else {
    topk_decide_kernel<<<1, 1, 0, stream>>>(st, cap);
  }
  // The candidates' radix select and tie cut (positions in the candidate array: in index order).
  const CandKeys cand{l.cand_value, &band->candidates};
  const unsigned* cand_radix = &st->cand_radix;
  for (int d = 0; d < 3; ++d) {
    radix_hist_kernel<CandKeys><<<stride_blocks(cap), kThreads, 0, stream>>>(
        cand, cap, &band->candidates, d, band, l.hist_band + d * kHistBins, cand_radix, nullptr);
    radix_find_kernel<<<1, kFindThreads, 0, stream>>>(band, l.hist_band + d * kHistBins, d, cap, 0, cand_radix);
  }
  const size_t cand_tiles = tiles_of(cap);
  tie_count_kernel<CandKeys><<<stride_blocks(cap), kThreads, 0, stream>>>(cand, cap, band,
                                                                                         l.tile_ties, cand_radix);
  tie_cut_kernel<CandKeys><<<1, kFindThreads, 0, stream>>>(cand, cap, band, l.tile_ties, cand_tiles, cand_radix);
  // The tensor's (the residual already holds the sum).
  const unsigned* full_radix = &st->full_radix;
  const FloatKeys keys{residual};
  radix_hist_kernel<FloatKeys><<<stride_blocks(n), kThreads, 0, stream>>>(keys, n, nullptr, 0, &st->main, l.hist_main,
                                                                          full_radix, nullptr);
  radix_rest(keys, n, &st->main, l.hist_main, full_radix, l, true, true, stream);
  // The final selection: from the candidates, or from the tensor.
  queue_compact(CandTopkOp{l.cand_index, l.cand_value, residual, st, clear_sent}, cap, out, l, true, &st->cand_path,
                &band->candidates, stream);
  queue_compact(TopkOp{residual, st, clear_sent, approx}, n, out, l, true, &st->full, nullptr, stream);
}

Status zero_count(const char* what, const DeviceSelection& out, Stream stream) {
  return cuda_status(what, cudaMemsetAsync(out.count, 0, sizeof(uint64_t), stream));
}

Status add_only(const char* what, float* residual, const float* grad, size_t n, Stream stream) {
  if (grad != nullptr && n > 0) add_kernel<<<stride_blocks(n), kThreads, 0, stream>>>(residual, grad, n);
  return cuda_status(what, cudaGetLastError());
}

}  // namespace

size_t select_workspace_bytes(size_t n) { return layout(nullptr, n).bytes; }

Status ef_threshold(float* residual, const float* grad, size_t n, float lambda, bool clear_sent,
                    const DeviceSelection& out, Workspace ws, Stream stream) {
  constexpr const char* kWhat = "cuda::ef_threshold";
  SC_RETURN_IF_ERROR(check_common(kWhat, residual, n, out, ws));
  if (n == 0) return zero_count(kWhat, out, stream);
  const Layout l = layout(ws.ptr, n);
  SC_RETURN_IF_ERROR(begin(kWhat, l, 0, 0, kernels::detail::lambda_key(lambda), stream));
  return compact(kWhat, EfThresholdOp{residual, grad, &l.state->lambda_key, clear_sent}, n, out, l, stream);
}

Status ef_momentum_threshold(float* velocity, float* residual, const float* grad, size_t n, float momentum,
                             float factor, float lambda, const DeviceSelection& out, Workspace ws, Stream stream) {
  constexpr const char* kWhat = "cuda::ef_momentum_threshold";
  SC_RETURN_IF_ERROR(check_common(kWhat, residual, n, out, ws));
  if (n > 0 && (velocity == nullptr || grad == nullptr)) return invalid_argument(std::string(kWhat) + ": null input");
  if (n == 0) return zero_count(kWhat, out, stream);
  const Layout l = layout(ws.ptr, n);
  SC_RETURN_IF_ERROR(begin(kWhat, l, 0, 0, 0, stream));
  return compact(kWhat,
                 MomentumThresholdOp{velocity, residual, grad, momentum, factor, kernels::detail::lambda_key(lambda)},
                 n, out, l, stream);
}

Status ef_topk(float* residual, const float* grad, size_t n, size_t k, bool clear_sent, const DeviceSelection& out,
               Workspace ws, Stream stream) {
  constexpr const char* kWhat = "cuda::ef_topk";
  SC_RETURN_IF_ERROR(check_common(kWhat, residual, n, out, ws));
  k = std::min(k, n);
  if (out.capacity < k) {
    return invalid_argument(std::string(kWhat) + ": capacity " + std::to_string(out.capacity) + " is below k=" +
                            std::to_string(k));
  }
  if (k == 0) {
    SC_RETURN_IF_ERROR(add_only(kWhat, residual, grad, n, stream));
    return zero_count(kWhat, out, stream);
  }
  const Layout l = layout(ws.ptr, n);
  SC_RETURN_IF_ERROR(begin(kWhat, l, k, 0, 0, stream));
  const size_t s = kernels::detail::sample_size(n);
  sample_kernel<<<static_cast<unsigned>((s + kThreads - 1) / kThreads), kThreads, 0, stream>>>(residual, grad, n, s,
                                                                                               l.sample);
  radix_hist_kernel<SampleKeys><<<stride_blocks(s), kThreads, 0, stream>>>(SampleKeys{l.sample}, s, nullptr, 0,
                                                                           &l.state->sample, l.hist_bracket,
                                                                           nullptr, nullptr);
  queue_bracket(n, k, s, l.hist_bracket, false, l, stream);
  queue_topk_passes(residual, grad, n, clear_sent, false, output_of(out), l, stream);
  return cuda_status(kWhat, cudaGetLastError());
}

Status ef_topk_approx(float* residual, const float* grad, size_t n, size_t k, double tolerance, bool clear_sent,
                      const DeviceSelection& out, Workspace ws, Stream stream) {
  constexpr const char* kWhat = "cuda::ef_topk_approx";
  if (!(tolerance >= 0.0 && tolerance <= 1.0)) {
    return invalid_argument(std::string(kWhat) + ": tolerance " + std::to_string(tolerance) + " is outside [0, 1]");
  }
  SC_RETURN_IF_ERROR(check_common(kWhat, residual, n, out, ws));
  k = std::min(k, n);
  if (out.capacity < k) {
    return invalid_argument(std::string(kWhat) + ": capacity " + std::to_string(out.capacity) + " is below k=" +
                            std::to_string(k));
  }
  // k == 0 and k == n have the CPU's trivial answers, which ef_topk gives.
  if (k == 0 || k == n) return ef_topk(residual, grad, n, k, clear_sent, out, ws, stream);
  // The sample position of the k-th largest, as the CPU's topk_approx takes it.
  const size_t s = kernels::detail::sample_size(n);
  const size_t at = kernels::detail::approx_sample_position(k, n, s, tolerance);
  const double low = static_cast<double>(k) * (1.0 - tolerance);
  const double high = static_cast<double>(k) * (1.0 + tolerance);

  const Layout l = layout(ws.ptr, n);
  SC_RETURN_IF_ERROR(begin(kWhat, l, k, at + 1, 0, stream));
  // The threshold from the sample (its digit-0 histogram, in hist_sample, also gives the
  // candidates' bound, which is at most the threshold), then the same passes as the exact top-k.
  sample_lambda(residual, grad, n, l, stream);
  queue_bracket(n, k, s, l.hist_sample, true, l, stream);
  queue_topk_passes(residual, grad, n, clear_sent, true, output_of(out), l, stream, low, high);
  return cuda_status(kWhat, cudaGetLastError());
}

Status ef_percentile(float* residual, const float* grad, size_t n, double q, bool clear_sent,
                     const DeviceSelection& out, Workspace ws, Stream stream) {
  constexpr const char* kWhat = "cuda::ef_percentile";
  SC_RETURN_IF_ERROR(check_common(kWhat, residual, n, out, ws));
  if (n == 0) return zero_count(kWhat, out, stream);
  if (!(q >= 0.0)) q = 0.0;  // NaN too, as magnitude_quantile
  if (q > 1.0) q = 1.0;
  const size_t s = kernels::detail::sample_size(n);
  const auto asc = std::min(s - 1, static_cast<size_t>(std::floor(q * static_cast<double>(s))));
  const Layout l = layout(ws.ptr, n);
  SC_RETURN_IF_ERROR(begin(kWhat, l, 0, s - asc, 0, stream));
  sample_lambda(residual, grad, n, l, stream);
  SC_RETURN_IF_ERROR(cuda_status(kWhat, cudaGetLastError()));
  return compact(kWhat, EfThresholdOp{residual, grad, &l.state->lambda_key, clear_sent}, n, out, l, stream);
}

namespace {

Status random_select(const char* what, const float* x, size_t n, size_t block, double p, uint64_t seed,
                     bool unbiased, const DeviceSelection& out, Workspace ws, Stream stream) {
  const uint64_t t = random_keep_threshold(p);
  if (n == 0 || t == 0) return zero_count(what, out, stream);
  const Layout l = layout(ws.ptr, n);
  SC_RETURN_IF_ERROR(begin(what, l, 0, 0, 0, stream));
  const uint64_t mixed = kernels::detail::splitmix64(seed);
  const RandomOp op{x,     static_cast<uint32_t>(mixed), static_cast<uint32_t>(mixed >> 32), t, block,
                    4294967296.0 / static_cast<double>(t), unbiased};
  return compact(what, op, n, out, l, stream);
}

}  // namespace

Status randomk(const float* x, size_t n, double p, uint64_t seed, bool unbiased, const DeviceSelection& out,
               Workspace ws, Stream stream) {
  constexpr const char* kWhat = "cuda::randomk";
  SC_RETURN_IF_ERROR(check_common(kWhat, x, n, out, ws));
  return random_select(kWhat, x, n, 1, p, seed, unbiased, out, ws, stream);
}

Status randblock(const float* x, size_t n, size_t block, double p, uint64_t seed, bool unbiased,
                 const DeviceSelection& out, Workspace ws, Stream stream) {
  constexpr const char* kWhat = "cuda::randblock";
  SC_RETURN_IF_ERROR(check_common(kWhat, x, n, out, ws));
  if (block < kMinBlock || block > kMaxBlock) {
    return invalid_argument(std::string(kWhat) + ": block of " + std::to_string(block) + " elements; allowed " +
                            std::to_string(kMinBlock) + ".." + std::to_string(kMaxBlock));
  }
  return random_select(kWhat, x, n, block, p, seed, unbiased, out, ws, stream);
}

// ---- structured selections ---------------------------------------------------------------------

namespace {

// How a tensor of n elements is grouped: contiguous groups of `size` elements (the last may be
// shorter), or (columns) the `groups` columns of a row-major [n / groups, groups] matrix.
struct Grouping {
  size_t n;
  size_t groups;
  size_t size;   // contiguous: elements per group
  bool columns;  // group of element i: i % groups
};

// The structured workspace, carved in this order; status and the tile counter are zeroed.
struct GroupLayout {
  unsigned long long* status;  // one look-back word per compaction tile
  unsigned* tile_counter;
  size_t zeroed_bytes;
  unsigned long long* keys;    // per group: ranking key, then sorted
  unsigned long long* keys_sorted;
  uint32_t* ids;               // per group: group id, then sorted by key
  uint32_t* ids_sorted;
  unsigned char* flags;        // per group: 1 when kept
  void* sort_temp;             // CUB's radix sort storage
  size_t sort_bytes;
  size_t bytes;
};

// CUB's temporary storage for sorting `groups` (key, id) pairs (a host-side query; 0 when it
// fails, e.g. without a GPU: the call then reports the error itself).
size_t sort_temp_bytes(size_t groups) {
  if (groups == 0) return 0;
  size_t bytes = 0;
  const cudaError_t err = cub::DeviceRadixSort::SortPairsDescending(
      nullptr, bytes, static_cast<const unsigned long long*>(nullptr), static_cast<unsigned long long*>(nullptr),
      static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr), static_cast<uint32_t>(groups), 0, 64);
  return err == cudaSuccess ? bytes : 0;
}

GroupLayout group_layout(void* base, size_t n, size_t groups) {
  GroupLayout l{};
  WorkspaceCarver carve(base);
  l.status = carve.take<unsigned long long>(compact_tiles(n) * sizeof(unsigned long long));
  l.tile_counter = carve.take<unsigned>(sizeof(unsigned));
  l.zeroed_bytes = carve.bytes();
  l.keys = carve.take<unsigned long long>(groups * sizeof(unsigned long long));
  l.keys_sorted = carve.take<unsigned long long>(groups * sizeof(unsigned long long));
  l.ids = carve.take<uint32_t>(groups * sizeof(uint32_t));
  l.ids_sorted = carve.take<uint32_t>(groups * sizeof(uint32_t));
  l.flags = carve.take<unsigned char>(groups);
  l.sort_bytes = sort_temp_bytes(groups);
  l.sort_temp = carve.take<void>(l.sort_bytes);
  l.bytes = carve.bytes();
  return l;
}

// The checks every structured function shares (after its own shape checks).
Status check_groups(const char* what, const float* residual, const Grouping& g, size_t keep,
                    const DeviceSelection& out, Workspace ws) {
  const std::string name(what);
  if (g.n > kMaxElements) return invalid_argument(name + ": " + std::to_string(g.n) + " elements exceed 2^32 - 1");
  if (g.n > 0 && residual == nullptr) return invalid_argument(name + ": null input");
  if (out.count == nullptr) return invalid_argument(name + ": null count");
  if (out.capacity > 0 && (out.index == nullptr || out.value == nullptr)) {
    return invalid_argument(name + ": null output with capacity " + std::to_string(out.capacity));
  }
  const size_t kept = std::min(keep, g.groups);
  // The whole selection must fit (as on the CPU): rows * kept columns, or kept groups of size.
  const size_t most = g.columns ? (g.n / std::max<size_t>(g.groups, 1)) * kept : std::min(g.n, kept * g.size);
  if (out.capacity < most) {
    return invalid_argument(name + ": capacity " + std::to_string(out.capacity) + " is below the " +
                            std::to_string(most) + " pairs of " + std::to_string(kept) + " groups");
  }
  const size_t need = structured_workspace_bytes(g.n, g.groups);
  return check_workspace(name, ws, need);
}

// Scores, ranks and emits: the CPU's contiguous_topk / column_topk with error feedback.
Status group_topk(const char* what, float* residual, const float* grad, const Grouping& g, size_t keep,
                  GroupNorm norm, bool clear_sent, const DeviceSelection& out, Workspace ws, Stream stream) {
  SC_RETURN_IF_ERROR(check_groups(what, residual, g, keep, out, ws));
  keep = std::min(keep, g.groups);
  if (g.n == 0 || keep == 0) {
    if (grad != nullptr && g.n > 0) group_add_kernel<<<stride_blocks(g.n), kThreads, 0, stream>>>(residual, grad, g.n);
    SC_RETURN_IF_ERROR(cuda_status(what, cudaGetLastError()));
    return zero_count(what, out, stream);
  }
  const GroupLayout l = group_layout(ws.ptr, g.n, g.groups);
  SC_RETURN_IF_ERROR(cuda_status(what, cudaMemsetAsync(l.status, 0, l.zeroed_bytes, stream)));
  const bool l1 = norm == GroupNorm::kL1;
  // 1. Scores (with residual += grad), one key and id per group.
  if (g.columns) {
    column_scores_kernel<<<static_cast<unsigned>((g.groups + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
        residual, grad, g.n / g.groups, g.groups, l1, l.keys, l.ids);
  } else {
    const size_t warps_per_block = kThreads / 32;
    contiguous_scores_kernel<<<static_cast<unsigned>((g.groups + warps_per_block - 1) / warps_per_block), kThreads, 0,
                               stream>>>(residual, grad, g.n, g.size, g.groups, l1, l.keys, l.ids);
  }
  SC_RETURN_IF_ERROR(cuda_status(what, cudaGetLastError()));
  // 2. The ranking (all groups kept: no sort) and the kept groups' flags.
  const uint32_t* order = nullptr;
  if (keep < g.groups) {
    size_t bytes = l.sort_bytes;
    if (bytes == 0) {
      return internal_error(std::string(what) + ": CUB's radix sort storage could not be sized on this device");
    }
    SC_RETURN_IF_ERROR(cuda_status(
        what, cub::DeviceRadixSort::SortPairsDescending(l.sort_temp, bytes, l.keys, l.keys_sorted, l.ids,
                                                        l.ids_sorted, static_cast<uint32_t>(g.groups), 0, 64,
                                                        stream)));
    order = l.ids_sorted;
  }
  group_flags_kernel<<<stride_blocks(g.groups), kThreads, 0, stream>>>(order, g.groups, keep, l.flags);
  SC_RETURN_IF_ERROR(cuda_status(what, cudaGetLastError()));
  // 3. Every element of a kept group, in index order.
  const GroupOp op{residual, l.flags, static_cast<uint32_t>(g.columns ? 1 : g.size),
                   static_cast<uint32_t>(g.columns ? g.groups : 0), clear_sent};
  compact_kernel<GroupOp><<<static_cast<unsigned>(std::min(compact_tiles(g.n), persistent_blocks())), kThreads, 0,
                                  stream>>>(
      op, g.n, output_of(out), l.status, l.tile_counter, nullptr, nullptr);
  return cuda_status(what, cudaGetLastError());
}

std::string shape_text(std::initializer_list<uint64_t> dims) {
  std::string s = "[";
  for (uint64_t d : dims) s += (s.size() > 1 ? ", " : "") + std::to_string(d);
  return s + "]";
}

}  // namespace

size_t structured_workspace_bytes(size_t n, size_t groups) { return group_layout(nullptr, n, groups).bytes; }

size_t select_workspace_bytes(size_t n, std::span<const uint64_t> shape) {
  // The finest grouping any row can make from this shape (as selector_scratch_bytes): blocks of
  // the smallest size, rows, columns, channels or heads (heads divide shape[0]).
  size_t bytes = std::max(select_workspace_bytes(n), structured_workspace_bytes(n, (n + kMinBlock - 1) / kMinBlock));
  for (uint64_t d : shape) {
    if (d <= n) bytes = std::max(bytes, structured_workspace_bytes(n, static_cast<size_t>(d)));
  }
  return bytes;
}

Status ef_block_topk(float* residual, const float* grad, size_t n, size_t block, size_t keep, GroupNorm norm,
                     bool clear_sent, const DeviceSelection& out, Workspace ws, Stream stream) {
  constexpr const char* kWhat = "cuda::ef_block_topk";
  if (block < kMinBlock || block > kMaxBlock) {
    return invalid_argument(std::string(kWhat) + ": block of " + std::to_string(block) + " elements; allowed " +
                            std::to_string(kMinBlock) + ".." + std::to_string(kMaxBlock));
  }
  return group_topk(kWhat, residual, grad, {n, (n + block - 1) / block, block, false}, keep, norm, clear_sent, out,
                    ws, stream);
}

Status ef_row_topk(float* residual, const float* grad, size_t n, size_t rows, size_t cols, size_t keep,
                   GroupNorm norm, bool clear_sent, const DeviceSelection& out, Workspace ws, Stream stream) {
  constexpr const char* kWhat = "cuda::ef_row_topk";
  if (rows == 0 || cols == 0 || rows > n || rows * cols != n) {
    return invalid_argument(std::string(kWhat) + ": shape " + shape_text({rows, cols}) + " does not hold " +
                            std::to_string(n) + " elements");
  }
  return group_topk(kWhat, residual, grad, {n, rows, cols, false}, keep, norm, clear_sent, out, ws, stream);
}

Status ef_column_topk(float* residual, const float* grad, size_t n, size_t rows, size_t cols, size_t keep,
                      GroupNorm norm, bool clear_sent, const DeviceSelection& out, Workspace ws, Stream stream) {
  constexpr const char* kWhat = "cuda::ef_column_topk";
  if (rows == 0 || cols == 0 || rows > n || rows * cols != n) {
    return invalid_argument(std::string(kWhat) + ": shape " + shape_text({rows, cols}) + " does not hold " +
                            std::to_string(n) + " elements");
  }
  return group_topk(kWhat, residual, grad, {n, cols, 1, true}, keep, norm, clear_sent, out, ws, stream);
}

Status ef_channel_topk(float* residual, const float* grad, size_t n, std::span<const uint64_t, 4> shape, size_t keep,
                       GroupNorm norm, bool clear_sent, const DeviceSelection& out, Workspace ws, Stream stream) {
  constexpr const char* kWhat = "cuda::ef_channel_topk";
  uint64_t product = 1;
  bool overflow = false;
  for (uint64_t d : shape) {
    if (d == 0 || product > std::numeric_limits<uint64_t>::max() / d) overflow = true;
    if (!overflow) product *= d;
  }
  if (overflow || product != n) {
    return invalid_argument(std::string(kWhat) + ": shape " + shape_text({shape[0], shape[1], shape[2], shape[3]}) +
                            " does not hold " + std::to_string(n) + " elements");
  }
  return group_topk(kWhat, residual, grad, {n, shape[0], n / shape[0], false}, keep, norm, clear_sent, out, ws,
                    stream);
}

Status ef_head_topk(float* residual, const float* grad, size_t n, size_t leading, size_t heads, size_t keep,
                    GroupNorm norm, bool clear_sent, const DeviceSelection& out, Workspace ws, Stream stream) {
  constexpr const char* kWhat = "cuda::ef_head_topk";
  if (leading == 0 || heads == 0 || n % leading != 0 || leading % heads != 0) {
    return invalid_argument(std::string(kWhat) + ": " + std::to_string(heads) +
                            " heads do not split a leading dimension of " + std::to_string(leading) + " (of " +
                            std::to_string(n) + " elements)");
  }
  return group_topk(kWhat, residual, grad, {n, heads, n / heads, false}, keep, norm, clear_sent, out, ws, stream);
}

// ---- the registry's CUDA column --------------------------------------------------------------

namespace {

Status params_ok(const SelectArgs& a) {
  return a.params != nullptr ? Status::Ok() : invalid_argument("cuda::find_select: null params");
}

Status add_then(const SelectArgs& a, const char* what) {
  return add_only(what, a.residual, a.grad, a.n, a.stream);
}

__global__ void clear_kernel(float* x, const uint32_t* index, const unsigned long long* count, size_t capacity) {
  const unsigned long long written = *count < capacity ? *count : capacity;
  for (size_t j = blockIdx.x * size_t{blockDim.x} + threadIdx.x; j < written; j += size_t{gridDim.x} * blockDim.x) {
    x[index[j]] = 0.0f;
  }
}

// Random rows: the residual after error feedback, the selection, then the sent ones cleared.
Status random_row(const SelectArgs& a, size_t block) {
  constexpr const char* kWhat = "cuda::find_select(random)";
  SC_RETURN_IF_ERROR(params_ok(a));
  SC_RETURN_IF_ERROR(check_common(kWhat, a.residual, a.n, a.out, a.ws));
  SC_RETURN_IF_ERROR(add_then(a, kWhat));
  const double p = a.params->density;
  SC_RETURN_IF_ERROR(block == 1 ? randomk(a.residual, a.n, p, a.params->seed, a.unbiased, a.out, a.ws, a.stream)
                                : randblock(a.residual, a.n, block, p, a.params->seed, a.unbiased, a.out, a.ws,
                                            a.stream));
  if (a.clear_sent && a.n > 0 && a.out.capacity > 0) {
    clear_kernel<<<stride_blocks(std::min(a.n, a.out.capacity)), kThreads, 0, a.stream>>>(
        a.residual, a.out.index, reinterpret_cast<const unsigned long long*>(a.out.count), a.out.capacity);
  }
  return cuda_status(kWhat, cudaGetLastError());
}

Status topk_row(const SelectArgs& a) {
  SC_RETURN_IF_ERROR(params_ok(a));
  return ef_topk(a.residual, a.grad, a.n, topk_count(a.n, a.params->density), a.clear_sent, a.out, a.ws, a.stream);
}
Status threshold_row(const SelectArgs& a) {
  SC_RETURN_IF_ERROR(params_ok(a));
  return ef_threshold(a.residual, a.grad, a.n, a.params->threshold, a.clear_sent, a.out, a.ws, a.stream);
}
Status topk_approx_row(const SelectArgs& a) {
  SC_RETURN_IF_ERROR(params_ok(a));
  return ef_topk_approx(a.residual, a.grad, a.n, topk_count(a.n, a.params->density), a.params->approx_tolerance,
                        a.clear_sent, a.out, a.ws, a.stream);
}
Status percentile_row(const SelectArgs& a) {
  SC_RETURN_IF_ERROR(params_ok(a));
  return ef_percentile(a.residual, a.grad, a.n, a.params->quantile, a.clear_sent, a.out, a.ws, a.stream);
}
// The structured rows, as the CPU rows of selectors.cc: the kept groups from the density, and
// exact top-k at the same density when the registered shape does not fit the row.
size_t groups_kept(size_t groups, const SelectArgs& a) { return topk_count(groups, a.params->density); }
Status block_topk_row(const SelectArgs& a) {
  SC_RETURN_IF_ERROR(params_ok(a));
  const size_t block = a.params->block_size;
  return ef_block_topk(a.residual, a.grad, a.n, block, groups_kept((a.n + block - 1) / std::max<size_t>(block, 1), a),
                       a.params->group_norm, a.clear_sent, a.out, a.ws, a.stream);
}
Status row_topk_row(const SelectArgs& a) {
  SC_RETURN_IF_ERROR(params_ok(a));
  if (a.shape.size() != 2) return topk_row(a);
  return ef_row_topk(a.residual, a.grad, a.n, a.shape[0], a.shape[1], groups_kept(a.shape[0], a),
                     a.params->group_norm, a.clear_sent, a.out, a.ws, a.stream);
}
Status column_topk_row(const SelectArgs& a) {
  SC_RETURN_IF_ERROR(params_ok(a));
  if (a.shape.size() != 2) return topk_row(a);
  return ef_column_topk(a.residual, a.grad, a.n, a.shape[0], a.shape[1], groups_kept(a.shape[1], a),
                        a.params->group_norm, a.clear_sent, a.out, a.ws, a.stream);
}
Status channel_topk_row(const SelectArgs& a) {
  SC_RETURN_IF_ERROR(params_ok(a));
  if (a.shape.size() != 4) return topk_row(a);
  return ef_channel_topk(a.residual, a.grad, a.n, a.shape.first<4>(), groups_kept(a.shape[0], a),
                         a.params->group_norm, a.clear_sent, a.out, a.ws, a.stream);
}
Status head_topk_row(const SelectArgs& a) {
  SC_RETURN_IF_ERROR(params_ok(a));
  const uint32_t heads = a.params->heads;
  if (a.shape.empty() || heads < 2 || a.shape[0] % heads != 0) return topk_row(a);
  return ef_head_topk(a.residual, a.grad, a.n, a.shape[0], heads, groups_kept(heads, a), a.params->group_norm,
                      a.clear_sent, a.out, a.ws, a.stream);
}
Status importance_row(const SelectArgs& a) {
  SC_RETURN_IF_ERROR(params_ok(a));
  return ef_importance(a.residual, a.grad, a.n, topk_count(a.n, a.params->density), a.params->seed, a.unbiased,
                       a.clear_sent, a.out, a.ws, a.stream);
}
Status randomk_row(const SelectArgs& a) { return random_row(a, 1); }
Status randblock_row(const SelectArgs& a) { return random_row(a, a.params->block_size); }

struct Row {
  Selector id;
  SelectFn fn;
};
constexpr Row kRows[] = {
    {Selector::kTopk, topk_row},
    {Selector::kThreshold, threshold_row},
    {Selector::kTopkApprox, topk_approx_row},
    {Selector::kPercentile, percentile_row},
    {Selector::kRandomk, randomk_row},
    {Selector::kImportance, importance_row},
    {Selector::kRandblock, randblock_row},
    {Selector::kBlockTopk, block_topk_row},
    {Selector::kRowTopk, row_topk_row},
    {Selector::kColumnTopk, column_topk_row},
    {Selector::kChannelTopk, channel_topk_row},
    {Selector::kHeadTopk, head_topk_row},
};

}  // namespace

SelectFn find_select(Selector s) {
  for (const Row& row : kRows) {
    if (row.id == s) return row.fn;
  }
  return nullptr;
}

}  // namespace sparsecar::kernels::cuda
