// DeviceCompressor: one device tensor's compression on the GPU (DESIGN §8) — the error-feedback
// residual stays on the device, the CUDA selectors and encoders of kernels/ run there, and only
// the encoded payload crosses PCIe, through pinned host memory, to UCX (which has no CUDA
// transport here). It is the device twin of TensorCompressor (compressor.h), with its contract:
// after a failed step the residual holds everything it held before plus the step's local sum.
//
// One step, on the compressor's stream (the host waits only where it must read a size):
//   begin()           the stream waits for every local trainer's ready event; the local sum
//                     (float64 in client order, rounded once: the session's host sum, bit for bit)
//   sparse plan:      compress()   residual += sum, select (the registry row's CUDA function),
//                                  encode; the payload is copied to pinned host memory
//                     add_payload() for every node in rank order (sparse_allgather_each's
//                                  consumer): a peer's payload is uploaded; the own one is on
//                                  the device already
//                     finish_sparse()  decode + add in rank order, times 1/trainers, into the
//                                  compressor's output buffer; every payload's verdict checked
//   dense plan:       dense_input()  residual + sum in pinned host memory (the ring runs there)
//                     finish_dense()  the reduced buffer, times 1/trainers, back to the device
//                     or, reduced by the trainers, dense_share(): (residual + sum) / local
//                     trainers into the output, on the device
//   then              commit() or rollback()
//   and always        end(): on success the output is copied into every trainer's buffer; on
//                     every path each trainer's done event is recorded after the last access to
//                     its buffer, and the stream is synchronised, so nothing of the step runs
//                     on after the pipeline answers.
// The trainers' buffers are written only by end() after a successful step, so a failed step leaves
// the trainers' gradients as they were.
//
// Plans the device does not run yet are run as the nearest one it does, the same way on every
// node (the substitution depends on the plan only), and logged once per tensor: a selector without
// a CUDA function (periodic_mask, hybrid) -> top-k at the plan's density; random rows with error feedback
// off -> their values unscaled; a format without a
// device codec (dense/csr/rle) -> coo; value types other than fp32 -> fp32; momentum correction,
// clipping and lr rescaling -> plain error feedback. At most capacity() = n/8 + 4096 coordinates
// are sent per step (a top-k above it is cut to it; a threshold that matches more leaves the rest
// in the residual, nothing lost).
//
// Memory is allocated on the first step, on the device of the first trainer's buffer: residual,
// output and (L > 1) sum buffers of n floats, the selection, the payload, the upload buffer for
// the peers and the workspaces; pinned host memory for the payload, the uploads and, on the first
// dense step, n floats. footprint_bytes() is the host (pinned) part, charged to the node budget.
//
// Threads: the pipeline thread only. Without CUDA every call answers kUnavailable.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "daemon/collective/collective.h"
#include "daemon/pipeline/step.h"
#include "sparsecar/common/clock.h"
#include "sparsecar/common/status.h"
#include "sparsecar/kernels/cuda.h"
#include "sparsecar/kernels/cuda_codecs.h"
#include "sparsecar/policies/plan.h"

namespace sparsecar {

class DeviceCompressor {
 public:
  DeviceCompressor(uint32_t id, const TensorSpec& spec, uint32_t world_size, const Clock& clock = steady_clock());
  ~DeviceCompressor();
  DeviceCompressor(const DeviceCompressor&) = delete;
  DeviceCompressor& operator=(const DeviceCompressor&) = delete;

  // Pinned host bytes a tensor of `spec` may hold in a job of `world_size` nodes.
  static uint64_t footprint_bytes(const TensorSpec& spec, uint32_t world_size);
  // Most coordinates one step sends: n/8 + 4096, at most n.
  static size_t capacity(uint64_t n);

  const TensorSpec& spec() const { return spec_; }
  // The plan the device runs for `plan` (see the header comment); `why` (optional) receives what
  // was substituted, empty when nothing was.
  static policies::Plan device_plan(const policies::Plan& plan, std::string* why = nullptr);

  // Starts a step: allocates on the first one, waits for the trainers' ready events on the
  // stream, sums their buffers. `inputs` must be the StepJob's device buffers.
  Status begin(std::span<const DeviceBuffer> inputs);

  struct Encoded {
    kernels::Format format = kernels::Format::kCoo;
    kernels::ValueType value_type = kernels::ValueType::kF32;
    uint64_t nnz = 0;
    uint64_t selected = 0;
    std::span<const std::byte> payload;  // pinned host memory, valid until the next step
    double encode_seconds = 0;
  };
  // Sparse plan (after device_plan()): selects and encodes. The selection has left the residual;
  // commit() or rollback() must follow.
  Expected<Encoded> compress(const policies::Plan& plan);
  // The consumer of sparse_allgather_each: queues node g.rank's payload for finish_sparse().
  Status add_payload(const GatheredPayload& g);
  // Decodes what add_payload() queued, in rank order, times 1 / average_over.
  Status finish_sparse(uint32_t average_over);

  // Dense plan: residual + sum, in pinned host memory, for the ring; the residual is untouched
  // until commit() zeroes it.
  Expected<std::span<float>> dense_input(const policies::Plan& plan);
  // The ring's result (dense_input()'s buffer, reduced in place) times 1 / average_over.
  Status finish_dense(uint32_t average_over);
  // Dense plan reduced by the trainers (dense_collective=trainer): (residual + sum) times
  // 1 / average_over (the local trainers) into the output, on the device; nothing crosses PCIe.
  // The residual is untouched until commit() zeroes it (rollback() keeps the sum, as after
  // dense_input()).
  Status dense_share(const policies::Plan& plan, uint32_t average_over);

  void commit();
  void rollback();
  // The residual copied to / from the host (checkpoints; between steps). Before the first step
  // the residual is zero and nothing is on a device yet: read gives zeros, write keeps the values
  // and uploads them when the device memory is allocated.
  Status read_residual(std::vector<float>* out);
  Status write_residual(std::span<const float> values);
  // Records every done event of a step that nothing of ours touched on a GPU (no compressor
  // state, or none allocated yet): a record on each device's legacy stream releases the buffers.
  static Status release_untouched(std::span<const DeviceBuffer> buffers);
  // Measures ||sum||^2 (in compress() / dense_input()) and, after a successful step, ||residual||^2
  // (in end()) on the GPU, for the controllers (the host path's NodeObservation norms): two passes
  // over the tensor, so only while a controller listens. Read after end(); -1 when not measured.
  void measure_norms(bool on) { measure_ = on; }
  double last_grad_norm2() const { return last_grad_norm2_; }
  double last_residual_norm2() const { return last_residual_norm2_; }
  // The budget controller's magnitude histograms (policies::magnitude_hist_add's bins), measured
  // in compress() on the GPU: |residual + g| before the selection (the residual it leaves plus
  // the values it selected, as the host path counts them) and |g| (the local sum). Three passes,
  // 32 KiB to the host, so only while `budget` listens. Read after end(); empty when the step
  // was not measured, was dense, or failed.
  void measure_magnitudes(bool on) { measure_magnitudes_ = on; }
  std::span<const uint64_t> last_magnitude_hist() const;
  std::span<const uint64_t> last_gradient_hist() const;
  // Ends the step (see the header comment): `ok` writes the output into every trainer's buffer.
  // Records every done event whatever happens; returns the first CUDA error.
  Status end(std::span<const DeviceBuffer> outputs, bool ok);

 private:
  enum class Pending { kNone, kSparse, kDense };
  struct Queued {
    kernels::cuda::DevicePayload payload;
    std::string from;
  };
  Status allocate(int device);
  Status ensure_dense_host();
  Status ensure_histograms();
  // Queues the two histograms of a selection that just ran and their copy to the host.
  Status queue_histograms();
  // A dense step's start, queued on the stream: residual + sum into the output (and ||sum||^2
  // when measuring); dense_summed() waits for the stream and marks the step pending.
  Status queue_dense_sum(const policies::Plan& plan);
  Status dense_summed();

  const uint32_t id_;
  const TensorSpec spec_;
  const uint32_t world_;
  const Clock& clock_;
  const size_t n_;
  const size_t capacity_;
  size_t payload_bound_ = 0;  // bytes of one encoded payload at most (every format, fp32)
  int device_ = -1;           // where this tensor's state lives (the first trainer's GPU)
  bool measure_ = false;
  bool measure_magnitudes_ = false;
  bool magnitudes_measured_ = false;  // this step's compress() histogrammed, and the step succeeded
  double last_grad_norm2_ = -1;
  double last_residual_norm2_ = -1;
  kernels::cuda::Stream stream_ = nullptr;
  struct OtherStream {
    int device;
    kernels::cuda::Stream stream;
    void* bridge;  // an event of `device`: its stream's work on a trainer's buffer, for stream_ to wait on
  };
  // Other trainers' GPUs. Everything that touches a trainer's buffer or events (the wait on
  // `ready`, the peer copies in and out, the record of `done`) runs on a stream of that trainer's
  // GPU: an interprocess event opened here crashed the driver (cuStreamWaitEvent, 2 x 2 H100)
  // when a stream of another GPU waited on it.
  std::vector<OtherStream> other_streams_;
  OtherStream* other(int device);  // created on first use; null when CUDA refuses
  void* step_event_ = nullptr;              // marks the end of the step's work on stream_
  // Device memory.
  float* residual_ = nullptr;
  float* out_ = nullptr;
  float* sum_ = nullptr;    // L > 1, or inputs on another GPU
  float* stage_ = nullptr;  // copies of the inputs on other GPUs, stage_buffers_ x n floats
  size_t stage_buffers_ = 0;
  uint32_t* index_ = nullptr;
  float* value_ = nullptr;
  uint64_t* counters_ = nullptr;  // [0] selection count, [1] payload bytes, [2] payload nnz
  double* norms_ = nullptr;       // [0] ||sum||^2, [1] ||residual||^2 (measure_norms)
  uint64_t* hists_ = nullptr;     // magnitude, then gradient histogram (measure_magnitudes; on first use)
  std::byte* payload_ = nullptr;
  std::byte* upload_ = nullptr;   // peers' payloads, world - 1 slots of payload_bound_
  kernels::cuda::DecodeStatus* verdicts_ = nullptr;  // world entries
  void* select_ws_ = nullptr;
  size_t select_ws_bytes_ = 0;
  void* encode_ws_ = nullptr;
  size_t encode_ws_bytes_ = 0;
  void* decode_ws_ = nullptr;
  size_t decode_ws_bytes_ = 0;
  // Pinned host memory.
  uint64_t* host_counters_ = nullptr;
  double* host_norms_ = nullptr;
  uint64_t* host_hists_ = nullptr;  // hists_ on the host, read after the step's synchronisation
  std::byte* host_payload_ = nullptr;
  std::byte* host_upload_ = nullptr;
  kernels::cuda::DecodeStatus* host_verdicts_ = nullptr;
  float* host_dense_ = nullptr;  // n floats, on the first dense step

  std::vector<float> pending_restore_;  // write_residual() before the first step
  const float* grad_ = nullptr;  // this step's local sum (a trainer's buffer or sum_)
  Pending pending_ = Pending::kNone;
  bool clear_residual_on_commit_ = false;  // error feedback off: the rest is dropped
  std::vector<Queued> queued_;
  size_t uploaded_ = 0;  // peers' payloads uploaded this step
  bool warned_ = false;  // the substitution was logged
};

}  // namespace sparsecar
