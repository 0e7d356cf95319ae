// The seam between sessions (trainers on this node) and the pipeline (compression + exchange).
//
// Data flows one way: the session thread hands the pipeline a StepJob once every local client
// has submitted (tensor, step) and the local dense sum is ready; the pipeline hands back a
// StepResult through StepResultSink. Buffers in a StepJob are owned by the session and lent to
// the pipeline until the matching StepResult: the session neither reads `result` nor writes
// `local_sum` in between.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "sparsecar/common/status.h"

namespace sparsecar {

// At most this many dims in a registered shape (the session protocol's kMaxShapeDims).
inline constexpr size_t kMaxTensorDims = 4;

struct TensorSpec {
  std::string name;
  uint64_t count = 0;  // elements (fp32)
  // Row-major dims as the trainer registered them (shape[0] is the leading one); empty when it
  // registered without a shape (a 1-D tensor of `count`). 1..kMaxTensorDims dims, each >= 1,
  // product == count (check_shape). Structured selectors read it; nodes agree on it.
  std::vector<uint64_t> shape = {};
  // The trainers keep this tensor in GPU memory (session protocol RegisterDevice): its steps come
  // as StepJob::device buffers, and the pipeline compresses it on the GPU (DESIGN §8).
  bool on_device = false;
};

// One local client's device tensor as this daemon opened it (daemon/device/device_runtime.h).
// The pointers are this process's: `data` is the client's allocation mapped by CUDA IPC, the
// events are the client's interprocess events opened here.
struct DeviceBuffer {
  float* data = nullptr;         // count floats on `device`
  int device = -1;               // CUDA ordinal in this daemon
  void* ready_event = nullptr;   // cudaEvent_t: the client recorded it after writing its gradient
  void* done_event = nullptr;    // cudaEvent_t: recorded once the pipeline is done with `data`
};

// "[64, 3, 3, 3]", or "none" for an empty shape (logs, errors, the job manifest).
inline std::string shape_text(std::span<const uint64_t> shape) {
  if (shape.empty()) return "none";
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

// OK when `shape` is empty (no shape given) or has 1..kMaxTensorDims dims, each >= 1, whose
// product is `count`; kInvalidArgument saying which rule fails otherwise.
inline Status check_shape(uint64_t count, std::span<const uint64_t> shape) {
  if (shape.empty()) return Status::Ok();
  if (shape.size() > kMaxTensorDims) {
    return invalid_argument("shape " + shape_text(shape) + " has " + std::to_string(shape.size()) +
                            " dims; at most " + std::to_string(kMaxTensorDims) + " are allowed");
  }
  uint64_t product = 1;
  for (uint64_t d : shape) {
    if (d == 0) return invalid_argument("shape " + shape_text(shape) + " has a dim of 0");
    if (__builtin_mul_overflow(product, d, &product)) {
      return invalid_argument("shape " + shape_text(shape) + " holds more than 2^64 elements");
    }
  }
  if (product != count) {
    return invalid_argument("shape " + shape_text(shape) + " holds " + std::to_string(product) +
                            " elements, not " + std::to_string(count));
  }
  return Status::Ok();
}

struct StepJob {
  uint32_t tensor_id = 0;
  uint64_t step = 0;
  float lr = 0.0f;                     // learning rate the trainers passed (0 = not given)
  std::span<const float> local_sum;    // sum over the local clients, count elements
  std::span<float> result;             // the pipeline writes the job-wide average here
  uint64_t generation = 0;             // the session's job generation; echoed in the result
  // A device tensor's step (TensorSpec::on_device): local_sum and result are empty and these are
  // the local clients' buffers, in client-id order. The pipeline makes its stream wait on every
  // ready_event before it reads them, writes the job-wide average into every `data` on success
  // (on failure it writes nothing), and on every path records every done_event after its last
  // access and before it answers with the StepResult. `keepalive` owns the mappings until then:
  // the pipeline drops it when it answers (the mappings close with the last owner).
  std::span<const DeviceBuffer> device = {};
  std::shared_ptr<const void> keepalive = {};
  // Every local trainer said it all-reduces a dense step itself (shm::kSubmitTrainerReduces).
  bool trainer_reduces = false;
  // ... and reads StepResult::lease_steps (shm::kSubmitTakesLease).
  bool takes_lease = false;
};

struct StepResult {
  uint32_t tensor_id = 0;
  uint64_t step = 0;
  Status status;             // OK: `result` of the job holds the average
  uint64_t bytes_sent = 0;   // bytes this daemon sent for the step (headers included)
  uint64_t dense_bytes = 0;  // bytes a dense exchange of this step would have sent
  uint64_t nnz = 0;          // elements this node selected
  uint64_t generation = 0;   // StepJob::generation, so a late answer from before a reset is
                             // never mistaken for the same (tensor, step) of the next job
  // `result` holds each trainer's share of this node's contribution (dense_collective=trainer):
  // the trainers reduce it themselves (shm::kCompletionTrainerReduces).
  bool trainer_reduces = false;
  // With trainer_reduces, for a job with takes_lease: the next this many steps of the tensor are
  // trainer-reduced dense steps as well under the decision in force (Completion::lease_steps).
  uint32_t lease_steps = 0;
};

// The pipeline as the session sees it. All calls come from the session thread and never block.
class StepSink {
 public:
  virtual ~StepSink() = default;
  // A new tensor, announced before its first StepJob. Ids are dense, 0, 1, 2, ... in
  // registration order. Returns an error when the job already started (no late registration).
  virtual Status register_tensor(uint32_t tensor_id, const TensorSpec& spec) = 0;
  // Queues a step. The pipeline answers every job exactly once through StepResultSink.
  virtual void submit(const StepJob& job) = 0;
  // A trainer reported a named scalar (e.g. "loss") for a step; controllers and metrics use it.
  virtual void report_metric(const std::string& name, double value, uint64_t step) = 0;
  // Every local client has gone: forget tensors, residuals and job state (the next clients start
  // a new job). Jobs still queued are answered with kAborted first.
  virtual void reset() = 0;

  // Bytes the pipeline allocates for a tensor of `spec` when it is registered (its residual,
  // selection, scratch and payload buffers) plus what it may allocate for it later (momentum
  // velocity, masks): the session charges them to the node's tensor memory budget before it
  // registers the tensor. A sink that keeps no per-tensor buffers answers 0.
  virtual uint64_t tensor_footprint_bytes(const TensorSpec& spec) const {
    (void)spec;
    return 0;
  }
  // This node will never hand over (tensor, step): a local trainer died before it submitted.
  // The pipeline fails the step job-wide (every peer is told, so their trainers error at once
  // instead of at their step deadline), after every command queued before it. `reason` says who
  // died and why. A sink without peers has nobody to tell.
  virtual void fail_step(uint32_t tensor_id, uint64_t step, const std::string& reason) {
    (void)tensor_id;
    (void)step;
    (void)reason;
  }
};

// The session as the pipeline sees it. complete() may be called from any thread; it only queues.
class StepResultSink {
 public:
  virtual ~StepResultSink() = default;
  virtual void complete(const StepResult& result) = 0;
};

}  // namespace sparsecar
