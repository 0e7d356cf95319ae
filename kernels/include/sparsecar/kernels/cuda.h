// Selectors and error feedback on an NVIDIA GPU: the CUDA backend of the selector registry.
//
// This header compiles without nvcc and without the CUDA headers: callers (the daemon, tests,
// benchmarks) see plain pointers and an opaque stream. The functions are built from
// kernels/src/cuda/ when CMake finds nvcc; otherwise a stub answers every call with
// kUnavailable ("built without CUDA"), and device_count() is 0, so callers can always link.
//
// The contract of every selection function (CUB's pattern):
// - Buffers are device memory the caller owns; nothing is allocated inside and the host never
//   waits: work is queued on `stream` and the result count lands in device memory
//   (DeviceSelection::count). Read it after the stream is synchronised, or let a later kernel on
//   the stream read it.
// - Workspace: device memory of select_workspace_bytes(n) bytes (structured selections:
//   structured_workspace_bytes(n, groups); registry rows: select_workspace_bytes(n, shape)),
//   sized once per tensor, used by one call at a time (calls on one stream may share it).
// - The arguments are validated on the host before anything is queued; an error queues nothing.
// - The selected set, its order (increasing index), the values and the residual afterwards
//   equal the CPU functions of select.h / structured.h bit for bit, on any input (NaN and +-inf
//   included: magnitude order as in select.h; a NaN the arithmetic makes carries the payload
//   x86 gives it). One exception: where two NaN operands meet in the momentum variant's
//   m u + f g, x86 returns one of them and the compiler picks which, so that element may be a
//   different NaN. The matching CPU composition is named with each function;
//   tests/unit/kernels/cuda_select_test.cc checks every one against it.
// - Output: pairs in increasing index order; `count` receives the number of matches, which may
//   exceed `capacity` (only the first `capacity` pairs are written then; with clear_sent the
//   residual keeps the unwritten ones, so nothing is lost).
// - Tensors hold at most 2^32 - 1 elements (uint32 indices); byte sizes above 2^31 are fine.
//
// Thread-safety: the functions are reentrant; a workspace and the buffers belong to one call
// at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "sparsecar/common/status.h"
#include "sparsecar/kernels/selectors.h"

struct CUstream_st;  // cuda_runtime.h: typedef struct CUstream_st* cudaStream_t

namespace sparsecar::kernels::cuda {

using Stream = CUstream_st*;  // a cudaStream_t; nullptr is the legacy default stream

// ---- the device ------------------------------------------------------------------------------

// True when this library was built with the CUDA kernels.
bool built();
// GPUs this process can use: 0 when built without CUDA, without a driver or without a GPU.
int device_count();
// "NVIDIA H100 80GB HBM3, 132 SMs, compute 9.0, 79.1 GiB" (or the error that prevented it).
std::string device_description(int device);

// Thin wrappers so that callers need no CUDA headers. Asynchronous on `stream` where they take
// one; errors name the CUDA error.
Expected<void*> device_alloc(size_t bytes);
void device_free(void* ptr);  // null is fine
Status copy_async(void* dst, const void* src, size_t bytes, Stream stream);  // any direction
Status zero_async(void* ptr, size_t bytes, Stream stream);
Status synchronize(Stream stream);
Expected<Stream> stream_create();
void stream_destroy(Stream stream);
// The calling thread's current device (cudaSetDevice).
Status set_device(int device);
// Lets kernels and copies on `device` reach `peer`'s memory directly (NVLink / PCIe P2P):
// cudaDeviceEnablePeerAccess from `device`. true once on (already on counts), false when the pair
// cannot (copies between them are then staged through host memory by the driver). Leaves the
// current device as it found it.
Expected<bool> enable_peer_access(int device, int peer);
// Page-locked host memory (cudaHostAlloc), for copies that overlap and run at full PCIe speed.
Expected<void*> host_alloc_pinned(size_t bytes);
void host_free_pinned(void* ptr);  // null is fine
// Events: `event` is a cudaEvent_t, an interprocess one opened with cudaIpcOpenEventHandle
// included. The stream waits on the GPU for the event's latest record (the host does not wait);
// a record must be queued on a stream of the event's device.
Status stream_wait_event(Stream stream, void* event);
Status event_record(void* event, Stream stream);
Expected<void*> event_create();  // cudaEventDisableTiming, this process only
void event_destroy(void* event);  // null is fine

// ---- selections ------------------------------------------------------------------------------

// Where a selection goes: device buffers of `capacity` entries each and a device counter.
struct DeviceSelection {
  uint32_t* index = nullptr;
  float* value = nullptr;
  size_t capacity = 0;
  uint64_t* count = nullptr;  // receives the number of matches
};

struct Workspace {
  void* ptr = nullptr;  // device memory, any alignment of 256 bytes or more
  size_t bytes = 0;
};

// ---- element-wise helpers of the daemon's device path --------------------------------------------
// Where the summands of local_sum() are: device pointers readable from the current device.
inline constexpr size_t kMaxSumInputs = 16;
// dst[i] = float(Σ_j double(src[j][i])) for i < n, the sum in j order in float64, rounded once
// (the session's host local sum, bit for bit); one input is copied. 1..kMaxSumInputs inputs.
Status local_sum(float* dst, std::span<const float* const> src, size_t n, Stream stream);
// dense[index[j]] += value[j] for j < min(*sel.count, sel.capacity), one float addition each
// (the indices of a selection are distinct). Gives a rolled-back selection back to its residual.
Status scatter_add(const DeviceSelection& sel, float* dense, size_t n, Stream stream);
// x[i] *= factor for i < n, one float multiplication each (kernels::scale on the host, bit for bit).
Status scale(float* x, size_t n, float factor, Stream stream);
// *out = Σ double(x[i])² for i < n (a device double; zeroed first). Blocks add their partial
// sums atomically: the order, and so the last bits, vary from run to run — a measurement (the
// controllers' ||g||² and ||e||²), not a result.
Status norm2(const float* x, size_t n, double* out, Stream stream);
// The budget controller's magnitude histogram (policies::magnitude_hist_add on the host, the same
// bins): hist[(bits(x[i]) & 0x7fffffff) >> 20] += 1 for i < m, m = n, or min(n, *count) where
// `count` (a device counter, e.g. a selection's) is given. `hist` is kMagnitudeHistogramBins
// device counters, added to (not zeroed): two calls pool two arrays.
inline constexpr size_t kMagnitudeHistogramBins = 2048;
Status magnitude_histogram_add(const float* x, size_t n, const uint64_t* count, uint64_t* hist, Stream stream);

// Workspace bytes every selection function below needs for a tensor of n elements.
size_t select_workspace_bytes(size_t n);

// Error feedback + hard threshold, one pass over memory:
//   r = residual + grad (grad null: r = residual, nothing added); select |r_i| >= lambda;
//   residual_i = r_i, or 0 where a pair was written and clear_sent.
// CPU: ef_threshold (grad, clear_sent), threshold_select (no grad, no clear_sent).
Status ef_threshold(float* residual, const float* grad, size_t n, float lambda, bool clear_sent,
                    const DeviceSelection& out, Workspace ws, Stream stream);

// DGC momentum correction + hard threshold, one pass: u = momentum u + factor g (velocity);
// v = residual + u; select |v_i| >= lambda; velocity and residual are zeroed where a pair was
// written (factor masking), else they keep u and v.
// CPU: momentum_accumulate, threshold_select, clear_selected on both.
Status ef_momentum_threshold(float* velocity, float* residual, const float* grad, size_t n,
                             float momentum, float factor, float lambda, const DeviceSelection& out,
                             Workspace ws, Stream stream);

// Exact top-k by magnitude fused with error feedback: residual += grad (grad may be null),
// then the k largest |residual_i| (ties to the lower index), residual zeroed where written with
// clear_sent. A radix select on the magnitude bits (11 + 10 + 10 bits, each digit one
// histogram pass, the first fused with the accumulation), an exact tie count when the k-th
// magnitude is shared, then one compaction pass. out.capacity >= min(k, n).
// CPU: ef_accumulate, topk_exact, clear_selected.
Status ef_topk(float* residual, const float* grad, size_t n, size_t k, bool clear_sent,
               const DeviceSelection& out, Workspace ws, Stream stream);

// Approximate top-k (DGC's sampled threshold) fused with error feedback: lambda from the fixed
// sample of residual + grad, one threshold pass; the exact top-k when the count misses
// k (1 +- tolerance) or does not fit the capacity. out.capacity >= min(k, n).
// CPU: ef_accumulate, topk_approx, clear_selected.
Status ef_topk_approx(float* residual, const float* grad, size_t n, size_t k, double tolerance,
                      bool clear_sent, const DeviceSelection& out, Workspace ws, Stream stream);

// The percentile selector fused with error feedback: lambda = the q-quantile of |residual +
// grad| estimated from the fixed sample, then ef_threshold with that lambda.
// CPU: magnitude_quantile(residual, q, scratch, grad), then ef_threshold.
Status ef_percentile(float* residual, const float* grad, size_t n, double q, bool clear_sent,
                     const DeviceSelection& out, Workspace ws, Stream stream);

// Random-k: keeps i when random_draw(seed, i) < random_keep_threshold(p) (the same coordinates
// as the CPU for the same seed); values x_i, or x_i / p' with unbiased. CPU: randomk_select.
Status randomk(const float* x, size_t n, double p, uint64_t seed, bool unbiased,
               const DeviceSelection& out, Workspace ws, Stream stream);

// Random blocks of `block` elements, one draw per block index. CPU: randblock_select.
Status randblock(const float* x, size_t n, size_t block, double p, uint64_t seed, bool unbiased,
                 const DeviceSelection& out, Workspace ws, Stream stream);

// Importance sampling fused with error feedback: residual += grad (grad may be null); then i is
// kept when random_draw(seed, i) < the threshold of p_i = min(1, c |residual_i|) (NaN and +-inf
// always, zeros never), c solved so that k are expected; values residual_i, or residual_i / p_i
// with unbiased; residual zeroed where written with clear_sent. c comes from the CPU's fixed
// point (up to 8 rounds) with every float64 sum in its blocked tree order (detail/importance.h),
// so the draws, the set and the values are the CPU's; the rounds after the fixed point settles
// are skipped on the device. Workspace: importance_workspace_bytes(n), which is at most
// select_workspace_bytes(n). Any capacity (the count is random; pairs past it are not written).
// CPU: ef_accumulate, importance_select, clear_selected.
Status ef_importance(float* residual, const float* grad, size_t n, size_t k, uint64_t seed, bool unbiased,
                     bool clear_sent, const DeviceSelection& out, Workspace ws, Stream stream);
// Workspace bytes of ef_importance for n elements (about n / 128 + n / 512 bytes and 1 KiB).
size_t importance_workspace_bytes(size_t n);

// ---- structured selections (structured.h) -----------------------------------------------------
// The `keep` best groups of elements (capped at the number of groups), every element of a kept
// group written, zeros included; fused with error feedback as ef_topk: residual += grad (grad
// may be null), the selection, residual zeroed where written with clear_sent. Group scores are
// Σ x² (kL2) or Σ |x| (kL1) of residual + grad, summed in float64 in the CPU's order; a group
// holding a NaN ranks first, ties go to the lower group index (structured.h's rule). The scores
// are one warp per group (columns: one thread per column) and the ranking is CUB's stable radix
// sort of the groups; then one compaction pass. out.capacity must hold the whole selection (the
// bound named with each function); workspace: structured_workspace_bytes(n, groups).
// Errors (nothing queued): the CPU function's shape errors, and those of every selection above.

// Workspace bytes of a structured selection over n elements in `groups` groups (about
// 25 bytes per group plus CUB's sort storage, and 8 bytes per 4096 elements).
size_t structured_workspace_bytes(size_t n, size_t groups);

// ceil(n / block) contiguous blocks, the last one possibly shorter; block in kMinBlock..kMaxBlock.
// out.capacity >= min(n, keep * block). CPU: ef_accumulate, block_topk, clear_selected.
Status ef_block_topk(float* residual, const float* grad, size_t n, size_t block, size_t keep, GroupNorm norm,
                     bool clear_sent, const DeviceSelection& out, Workspace ws, Stream stream);

// The rows of a row-major [rows, cols] matrix (rows * cols == n). out.capacity >=
// min(rows, keep) * cols. CPU: ef_accumulate, row_topk, clear_selected.
Status ef_row_topk(float* residual, const float* grad, size_t n, size_t rows, size_t cols, size_t keep,
                   GroupNorm norm, bool clear_sent, const DeviceSelection& out, Workspace ws, Stream stream);

// The columns of a row-major [rows, cols] matrix (rows * cols == n), written row by row (indices
// increasing). out.capacity >= rows * min(cols, keep). CPU: ef_accumulate, column_topk,
// clear_selected.
Status ef_column_topk(float* residual, const float* grad, size_t n, size_t rows, size_t cols, size_t keep,
                      GroupNorm norm, bool clear_sent, const DeviceSelection& out, Workspace ws, Stream stream);

// The c_out output channels of a conv weight [c_out, c_in, kh, kw] (the product == n).
// out.capacity >= min(c_out, keep) * n / c_out. CPU: ef_accumulate, channel_topk, clear_selected.
Status ef_channel_topk(float* residual, const float* grad, size_t n, std::span<const uint64_t, 4> shape, size_t keep,
                       GroupNorm norm, bool clear_sent, const DeviceSelection& out, Workspace ws, Stream stream);

// `heads` contiguous slices of the leading dimension (leading divides n, heads divides leading).
// out.capacity >= min(heads, keep) * n / heads. CPU: ef_accumulate, head_topk, clear_selected.
Status ef_head_topk(float* residual, const float* grad, size_t n, size_t leading, size_t heads, size_t keep,
                    GroupNorm norm, bool clear_sent, const DeviceSelection& out, Workspace ws, Stream stream);

// ---- the selector registry's CUDA column ------------------------------------------------------
// The CPU library must not link CUDA, so the CUDA functions of the registry's rows live here,
// keyed by the same frozen ids (selectors.h): find_select(id) is the row's CUDA backend.

// One call shape for every selector (what the daemon's GPU path fills from a plan).
struct SelectArgs {
  float* residual = nullptr;        // the tensor selected from; with grad, the residual
  const float* grad = nullptr;      // null: select from residual as it is (no error feedback)
  size_t n = 0;
  const SelectorParams* params = nullptr;
  bool clear_sent = false;          // error feedback: residual_i = 0 where a pair was written
  bool unbiased = false;            // random rows: values scaled by 1/p (error feedback off)
  DeviceSelection out;
  Workspace ws;                     // select_workspace_bytes(n, shape)
  Stream stream = nullptr;
  std::span<const uint64_t> shape;  // the registered shape (empty: unknown), as SelectInput's;
                                    // the shaped rows fall back to top-k when it does not fit
};
// Equals, bit for bit: residual += grad (if grad), the row's CPU select function on the
// residual (SelectInput with the same shape, no pool), then residual cleared where written (if
// clear_sent) — tests/unit/kernels/cuda_select_test.cc runs every row that has one.
using SelectFn = Status (*)(const SelectArgs& args);

// Workspace bytes of any registry row for a tensor of n elements with this registered shape:
// select_workspace_bytes(n), or the structured rows' need for their finest grouping (blocks of
// kMinBlock, or one group per entry of a shape's dimension) when that is more.
size_t select_workspace_bytes(size_t n, std::span<const uint64_t> shape);

// The CUDA function of selector `s`, or null (that selector runs on the CPU only, so far: the
// periodic-mask and hybrid rows).
SelectFn find_select(Selector s);

}  // namespace sparsecar::kernels::cuda
