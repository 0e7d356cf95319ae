// cuda.h's selections: validate on the host, then queue the kernels of
// detail/select_kernels.cuh on the caller's stream (no allocation, no host synchronisation).
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>

#include "cuda/detail/select_kernels.cuh"
#include "cuda/detail/status.h"
#include "sparsecar/kernels/cuda.h"
#include "sparsecar/kernels/select.h"
#include "sparsecar/kernels/structured.h"

namespace sparsecar::kernels::cuda {
namespace {

using namespace detail;  // NOLINT: the kernels of this backend

constexpr size_t kMaxElements = std::numeric_limits<uint32_t>::max();
constexpr size_t kAlign = 256;

size_t align_up(size_t v) { return (v + kAlign - 1) / kAlign * kAlign; }
size_t tiles_of(size_t n) { return (n + kTile - 1) / kTile; }
// Keys the top-k's filter pass may keep (digit 0's bin of the k-th key): 1/16 of the tensor
// and 4096 more; a fuller bin (few distinct magnitudes) takes the full passes instead.
size_t candidate_capacity(size_t n) { return std::min(n, n / 16 + 4096); }

// The workspace, carved in this order; the first four are zeroed before every call.
struct Layout {
  SelectState* state;
  unsigned* hist_main;    // 3 digits x kHistBins
  unsigned* hist_sample;  // 3 digits x kHistBins
  unsigned* hist_band;    // 3 digits x kHistBins
  unsigned* hist_bracket; // kHistBins
  unsigned long long* status;  // one look-back word per tile
  size_t zeroed_bytes;
  unsigned* tile_ties;    // one count per tile
  uint32_t* candidates;   // candidate_capacity(n) keys
  uint32_t* sample;       // kSampleMax keys
  size_t bytes;
};

Layout layout(void* base, size_t n) {
  auto* p = static_cast<char*>(base);
  Layout l{};
  size_t off = 0;
  auto take = [&](size_t bytes) {
    char* at = p == nullptr ? nullptr : p + off;
    off += align_up(bytes);
    return at;
  };
  const size_t tiles = std::max<size_t>(tiles_of(n), 1);
  l.state = reinterpret_cast<SelectState*>(take(sizeof(SelectState)));
  l.hist_main = reinterpret_cast<unsigned*>(take(3 * kHistBins * sizeof(unsigned)));
  l.hist_sample = reinterpret_cast<unsigned*>(take(3 * kHistBins * sizeof(unsigned)));
  l.hist_band = reinterpret_cast<unsigned*>(take(3 * kHistBins * sizeof(unsigned)));
  l.hist_bracket = reinterpret_cast<unsigned*>(take(kHistBins * sizeof(unsigned)));
  l.status = reinterpret_cast<unsigned long long*>(take(tiles * sizeof(unsigned long long)));
  l.zeroed_bytes = off;
  l.tile_ties = reinterpret_cast<unsigned*>(take(tiles * sizeof(unsigned)));
  l.candidates = reinterpret_cast<uint32_t*>(take(candidate_capacity(n) * sizeof(uint32_t)));
  l.sample = reinterpret_cast<uint32_t*>(take(kernels::detail::kSampleMax * sizeof(uint32_t)));
  l.bytes = off;
  return l;
}

// Blocks for a grid-stride pass: enough to fill the device, no more than the work.
unsigned stride_blocks(size_t n) {
  int device = 0;
  int sms = 132;
  if (cudaGetDevice(&device) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const size_t want = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(std::clamp<size_t>(want, 1, static_cast<size_t>(sms) * 8));
}

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
  if (ws.bytes < need || (need > 0 && ws.ptr == nullptr)) {
    return invalid_argument(name + ": workspace of " + std::to_string(ws.bytes) + " bytes; " + std::to_string(need) +
                            " needed");
  }
  if (reinterpret_cast<uintptr_t>(ws.ptr) % kAlign != 0) {
    return invalid_argument(name + ": workspace not aligned to " + std::to_string(kAlign) + " bytes");
  }
  return Status::Ok();
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

template <class Op>
Status compact(const char* what, const Op& op, size_t n, const DeviceSelection& out, const Layout& l, Stream stream) {
  const size_t tiles = tiles_of(n);
  compact_kernel<Op><<<static_cast<unsigned>(tiles), kThreads, 0, stream>>>(
      op, n, output_of(out), l.status, &l.state->tile_counter, tiles, nullptr);
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
  tie_count_kernel<Keys><<<static_cast<unsigned>(tiles), kThreads, 0, stream>>>(keys, n, state, l.tile_ties, gate);
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
  // 1. The band: from the sample of residual + grad, the digit-0 bins that hold the k-th key's
  //    sample rank +- 3 sigma + 2 (as the CPU's sampled path brackets it).
  const size_t s = kernels::detail::sample_size(n);
  sample_kernel<<<static_cast<unsigned>((s + kThreads - 1) / kThreads), kThreads, 0, stream>>>(residual, grad, n, s,
                                                                                               l.sample);
  radix_hist_kernel<SampleKeys><<<stride_blocks(s), kThreads, 0, stream>>>(SampleKeys{l.sample}, s, nullptr, 0,
                                                                           &l.state->sample, l.hist_bracket,
                                                                           nullptr, nullptr);
  const double r = static_cast<double>(k) * static_cast<double>(s) / static_cast<double>(n);
  const double margin = 3.0 * std::sqrt(r) + 2.0;
  const double hi_rank = std::floor(r - margin);
  const auto lo_rank = static_cast<unsigned long long>(std::min(std::ceil(r + margin), static_cast<double>(s)));
  bracket_kernel<<<1, kFindThreads, 0, stream>>>(l.state, l.hist_bracket,
                                                 hi_rank < 1.0 ? 0ull : static_cast<unsigned long long>(hi_rank),
                                                 lo_rank);
  // 2. One pass over the tensor (with the error feedback): keys above the band counted, the
  //    band's keys appended.
  const size_t cap = candidate_capacity(n);
  band_kernel<<<stride_blocks(n), kThreads, 0, stream>>>(residual, grad, n, l.state, l.candidates, cap);
  band_decide_kernel<<<1, 1, 0, stream>>>(l.state, cap);
  // 3a. The band holds the k-th key: a radix select over the candidates alone.
  const unsigned* ok = &l.state->band_ok;
  RadixState* band = &l.state->band;
  const SampleKeys cand{l.candidates};
  for (int d = 0; d < 3; ++d) {
    radix_hist_kernel<SampleKeys><<<stride_blocks(cap), kThreads, 0, stream>>>(
        cand, cap, &band->candidates, d, band, l.hist_band + d * kHistBins, ok, nullptr);
    radix_find_kernel<<<1, kFindThreads, 0, stream>>>(band, l.hist_band + d * kHistBins, d, n, 0, ok);
  }
  band_finish_kernel<<<1, 1, 0, stream>>>(l.state);
  // 3b. It does not (rare: a miss of the bracket, or few distinct magnitudes): the full radix
  //     select over the tensor, whose residual already holds the sum.
  const unsigned* missed = &l.state->band_missed;
  const FloatKeys keys{residual};
  radix_hist_kernel<FloatKeys><<<stride_blocks(n), kThreads, 0, stream>>>(keys, n, nullptr, 0, &l.state->main,
                                                                          l.hist_main, missed, nullptr);
  radix_rest(keys, n, &l.state->main, l.hist_main, missed, l, true, false, stream);
  // 4. The ties at the k-th key beyond the need: the index cut (either path's answer).
  const size_t tiles = tiles_of(n);
  tie_count_kernel<FloatKeys><<<static_cast<unsigned>(tiles), kThreads, 0, stream>>>(keys, n, &l.state->main,
                                                                                     l.tile_ties, nullptr);
  tie_cut_kernel<FloatKeys><<<1, kFindThreads, 0, stream>>>(keys, n, &l.state->main, l.tile_ties, tiles, nullptr);
  SC_RETURN_IF_ERROR(cuda_status(kWhat, cudaGetLastError()));
  return compact(kWhat, TopkOp{residual, l.state, clear_sent, false}, n, out, l, stream);
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
  // The sample position of the k-th largest, aimed above k as the CPU's topk_approx does.
  const size_t s = kernels::detail::sample_size(n);
  const double r = static_cast<double>(k) * static_cast<double>(s) / static_cast<double>(n);
  double aim = r;
  if (s < n) {
    const double two_sigma = 2.0 * std::sqrt(r);
    aim = two_sigma > r * tolerance ? r + two_sigma : r * (1.0 + tolerance / 2.0);
  }
  const double pos = std::round(aim) - 1.0;
  const size_t at = static_cast<size_t>(std::clamp(pos, 0.0, static_cast<double>(s - 1)));
  const double low = static_cast<double>(k) * (1.0 - tolerance);
  const double high = static_cast<double>(k) * (1.0 + tolerance);

  const Layout l = layout(ws.ptr, n);
  SC_RETURN_IF_ERROR(begin(kWhat, l, k, at + 1, 0, stream));
  sample_lambda(residual, grad, n, l, stream);
  ef_count_kernel<<<stride_blocks(n), kThreads, 0, stream>>>(residual, grad, n, l.state);
  approx_decide_kernel<<<1, 1, 0, stream>>>(l.state, low, high, out.capacity);
  const unsigned* gate = &l.state->exact;
  const FloatKeys keys{residual};
  radix_hist_kernel<FloatKeys><<<stride_blocks(n), kThreads, 0, stream>>>(keys, n, nullptr, 0, &l.state->main,
                                                                          l.hist_main, gate, nullptr);
  radix_rest(keys, n, &l.state->main, l.hist_main, gate, l, true, true, stream);
  SC_RETURN_IF_ERROR(cuda_status(kWhat, cudaGetLastError()));
  return compact(kWhat, TopkOp{residual, l.state, clear_sent, true}, n, out, l, stream);
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
    {Selector::kRandblock, randblock_row},
};

}  // namespace

SelectFn find_select(Selector s) {
  for (const Row& row : kRows) {
    if (row.id == s) return row.fn;
  }
  return nullptr;
}

}  // namespace sparsecar::kernels::cuda
