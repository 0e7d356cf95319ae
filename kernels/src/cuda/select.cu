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

// The workspace, carved in this order; the first four are zeroed before every call.
struct Layout {
  SelectState* state;
  unsigned* hist_main;    // 3 digits x kHistBins
  unsigned* hist_sample;  // 3 digits x kHistBins
  unsigned long long* status;  // one look-back word per tile
  size_t zeroed_bytes;
  unsigned* tile_ties;    // one count per tile
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
  l.status = reinterpret_cast<unsigned long long*>(take(tiles * sizeof(unsigned long long)));
  l.zeroed_bytes = off;
  l.tile_ties = reinterpret_cast<unsigned*>(take(tiles * sizeof(unsigned)));
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
// cut, over `keys`.
template <class Keys>
void radix_rest(Keys keys, size_t n, RadixState* state, unsigned* hist, const unsigned* gate, const Layout& l,
                bool with_cut, Stream stream) {
  radix_find_kernel<<<1, kFindThreads, 0, stream>>>(state, hist, 0, n, gate);
  for (int d = 1; d < 3; ++d) {
    unsigned* h = hist + d * kHistBins;
    radix_hist_kernel<Keys><<<stride_blocks(n), kThreads, 0, stream>>>(keys, n, d, state, h, gate);
    radix_find_kernel<<<1, kFindThreads, 0, stream>>>(state, h, d, n, gate);
  }
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
  radix_hist_kernel<SampleKeys><<<stride_blocks(s), kThreads, 0, stream>>>(keys, s, 0, &l.state->sample,
                                                                           l.hist_sample, nullptr);
  radix_rest(keys, s, &l.state->sample, l.hist_sample, nullptr, l, false, stream);
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
  ef_hist_kernel<<<stride_blocks(n), kThreads, 0, stream>>>(residual, grad, n, l.hist_main);
  radix_rest(FloatKeys{residual}, n, &l.state->main, l.hist_main, nullptr, l, true, stream);
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
  radix_hist_kernel<FloatKeys><<<stride_blocks(n), kThreads, 0, stream>>>(keys, n, 0, &l.state->main, l.hist_main,
                                                                          gate);
  radix_rest(keys, n, &l.state->main, l.hist_main, gate, l, true, stream);
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

}  // namespace sparsecar::kernels::cuda
