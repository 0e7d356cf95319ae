// sparsecar client library (C++ API): what a trainer links to hand gradients to its local
// daemon (sparsecard) and get the averaged gradient back. The C ABI in sparsecar.h mirrors it.
//
//   auto client = sparsecar::Client::connect("/run/sparsecar/sparsecard.sock");
//   auto w = client->register_tensor("fc.weight", 5000);      // once, before the first step
//   auto c = client->register_tensor("conv1.weight", 64 * 3 * 3 * 3, sparsecar::DType::kF32,
//                                    {64, 3, 3, 3});            // with its shape (optional)
//   std::copy(grad.begin(), grad.end(), w->data());             // write the gradient in place
//   client->submit(*w, step, {.lr = 0.1f});
//   auto done = client->wait(*w, step, std::chrono::seconds(30));
//   // on success w->data() now holds the average over every trainer of the job
//
// A tensor that lives in GPU memory (DESIGN §8) is registered by its CUDA IPC handles instead
// (register_device_tensor): the daemon maps the trainer's allocation and works on it in place,
// with no shared-memory slot. The trainer records `ready` on its stream after writing the
// gradient and before submit(); once wait() returns OK, the daemon has recorded `done` after
// writing the average, and the trainer's stream must wait on `done` before reading the tensor.
// A daemon without CUDA or without a GPU refuses with kUnavailable; register a host tensor then.
//
// Rules: register every tensor before the first submit; every trainer of the job registers the
// same tensors (names, sizes, order) and submits them in the same order with increasing steps;
// between submit() and the matching wait() the tensor's memory belongs to the daemon.
// Errors are Status values with a message (dead peer, deadline, bad registration), never a hang:
// every wait has a deadline and a dead daemon is noticed at once.
//
// Thread-safety: a Client may be used from one thread at a time (callers serialise), except
// await_activity(), which may run while another thread calls the rest; different Clients are
// independent.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "sparsecar/common/status.h"

namespace sparsecar {

enum class DType : uint32_t { kF32 = 0 };

struct ConnectOptions {
  // How long connect() keeps retrying while the socket does not exist yet / refuses.
  std::chrono::milliseconds timeout{10000};
};

struct SubmitOptions {
  float lr = 0.0f;  // learning rate of this step; 0 = not given
  // This trainer all-reduces a dense step itself when the daemon asks (StepInfo::trainer_reduces):
  // the knob dense_collective=trainer uses it where every trainer of the job says so. Not sent to a
  // daemon older than the knob (it would refuse the step): that daemon never asks.
  bool trainer_reduces = false;
  // With trainer_reduces: this trainer reads StepInfo::lease_steps (dense steps it may reduce
  // without submitting them). Not sent to a daemon older than leases.
  bool takes_lease = false;
};

// What the daemon reports with a successful step.
struct StepInfo {
  uint64_t step = 0;
  uint64_t bytes_sent = 0;   // bytes the local daemon put on the wire for this (tensor, step)
  uint64_t dense_bytes = 0;  // what a dense exchange of the same step would have sent
  uint64_t nnz = 0;          // elements the local daemon selected for this step
  // The tensor holds this trainer's share of its node's contribution, not the average: sum it
  // over every trainer of the job (an all-reduce of its own) and divide by their number. Only
  // for a submit with SubmitOptions::trainer_reduces.
  bool trainer_reduces = false;
  // With trainer_reduces, for a submit with SubmitOptions::takes_lease: the next this many steps
  // of the tensor are dense steps the trainers reduce as well (the knob trainer_lease), so the
  // trainer may all-reduce them itself without submitting them (every trainer of the job must
  // skip the same steps: take the minimum over all of them, and over the tensors of a step); its
  // next submit may name any later step. Skipping fewer, or none, is always right. Else 0.
  uint32_t lease_steps = 0;
};

// Where a GPU tensor is, as CUDA IPC handles (the bytes of the CUDA types; this header needs no
// CUDA headers). Fill it in the trainer with cudaIpcGetMemHandle on the base of the allocation
// holding the tensor (cuMemGetAddressRange gives the base), cudaIpcGetEventHandle on two events
// created with cudaEventInterprocess | cudaEventDisableTiming on the tensor's device, and
// cudaDeviceProp::uuid of that device (the daemon may number the GPUs differently).
struct DeviceHandles {
  std::array<uint8_t, 16> device_uuid{};  // cudaUUID_t of the GPU holding the tensor
  std::array<uint8_t, 64> mem_handle{};   // cudaIpcMemHandle_t of the allocation's base
  uint64_t offset = 0;                    // bytes from the allocation's base to the tensor; 4-aligned
  std::array<uint8_t, 64> ready_event{};  // cudaIpcEventHandle_t: the trainer records it per step
  std::array<uint8_t, 64> done_event{};   // cudaIpcEventHandle_t: the daemon records it per step
  bool operator==(const DeviceHandles&) const = default;
};

// A registered tensor: a view of its shared-memory slot, or of nothing on the host for a device
// tensor (on_device(): data() is null; the gradient and the average are in the trainer's GPU
// memory). Owned by the Client that made it; valid until that Client is destroyed.
class Tensor {
 public:
  uint32_t id() const { return id_; }
  const std::string& name() const { return name_; }
  size_t size() const { return count_; }
  // The shape it was registered with (row-major, shape()[0] leading); empty when registered
  // without one.
  const std::vector<uint64_t>& shape() const { return shape_; }
  // The slot (size() floats); null for a device tensor.
  float* data() { return data_; }
  const float* data() const { return data_; }
  // Registered by register_device_tensor: the data stays in the trainer's GPU memory.
  bool on_device() const { return on_device_; }

 private:
  friend class Client;
  uint32_t id_ = 0;
  std::string name_;
  size_t count_ = 0;
  std::vector<uint64_t> shape_;
  float* data_ = nullptr;
  bool on_device_ = false;
  DeviceHandles handles_{};  // on_device_ only
};

class Client {
 public:
  // Connects to the daemon's Unix socket and performs the handshake (protocol version, uid).
  static Expected<std::unique_ptr<Client>> connect(const std::string& socket_path,
                                                   const ConnectOptions& options = {});
  ~Client();
  Client(const Client&) = delete;
  Client& operator=(const Client&) = delete;

  // Registers a tensor of `count` elements and maps its shared-memory slot (pre-faulted).
  // Errors: a name already registered with another size (kInvalidArgument), registration after
  // the job started (kFailedPrecondition), daemon gone (kUnavailable).
  Expected<Tensor*> register_tensor(std::string_view name, size_t count, DType dtype = DType::kF32);

  // The same with the tensor's shape (row-major dims, shape[0] leading): 1..kMaxDims dims, each
  // >= 1, whose product is `count` (else kInvalidArgument, checked here and by the daemon).
  // Structured selectors (rows, columns, conv channels, attention heads) use it; an empty shape
  // is the call above. Every local trainer must register a name with the same shape, and every
  // node of the job the same (checked at the first step). Needs a daemon that knows shapes (an
  // older one closes the session with a protocol error).
  static constexpr size_t kMaxDims = 4;
  Expected<Tensor*> register_tensor(std::string_view name, size_t count, DType dtype,
                                    const std::vector<uint64_t>& shape);

  // Registers an fp32 tensor of `count` elements that lives in GPU memory, by its CUDA IPC
  // handles (DeviceHandles; `shape` as above, empty for none). No slot is mapped: the returned
  // Tensor has on_device() true and data() null; submit/wait/in_flight work as for host tensors,
  // with the event protocol described at the top of this file. Registering the same name again
  // with the same count, shape and handles returns the same tensor. Errors: those of
  // register_tensor, plus the daemon's refusal as it said it — kUnavailable when it was built
  // without CUDA or sees no GPU (register a host tensor instead), kNotFound when it does not
  // see the tensor's GPU, kInvalidArgument when the handles do not open or the tensor passes the
  // end of its allocation. A name registered as a host tensor by another local trainer is
  // kInvalidArgument (every local trainer registers a name the same way).
  Expected<Tensor*> register_device_tensor(std::string_view name, size_t count, const DeviceHandles& handles,
                                           std::span<const uint64_t> shape = {});

  // Hands the tensor's current contents for `step` to the daemon. Non-blocking.
  Status submit(const Tensor& tensor, uint64_t step, const SubmitOptions& options = {});

  // Waits until the daemon completed (tensor, step) or `timeout` passes (kDeadlineExceeded).
  // On OK the tensor's memory holds the averaged gradient. Completions for other tensors that
  // arrive meanwhile are kept for their own wait(). A failed completion from the daemon comes
  // back with the daemon's code and message unchanged — which may be kDeadlineExceeded too (a
  // peer did not deliver in time): in_flight() tells the two apart.
  Expected<StepInfo> wait(const Tensor& tensor, uint64_t step, std::chrono::milliseconds timeout);

  // True while (tensor, step) was submitted and wait() has not returned its completion yet: after
  // a kDeadlineExceeded from wait(), true means only this wait timed out (wait again); false
  // means the daemon failed the step with that code (the step is over).
  bool in_flight(const Tensor& tensor, uint64_t step);

  // Reports a named scalar (e.g. "loss") for a step; the daemon's controllers and metrics use it.
  Status report_metric(std::string_view name, double value, uint64_t step);

  // Blocks until a completion may have arrived (the daemon rang the completion doorbell) or the
  // daemon's socket has something to read (it is closing), or `timeout` passes. Consumes the
  // doorbell only, never a completion: call wait() after it, which then need not block
  // (wait(..., 0ms) returns at once). Returns true when the socket is readable: wait() with a
  // timeout of at least 1 ms then reads why the daemon closed it.
  // The one member that may run concurrently with the others (which a caller serializes): it
  // touches nothing but the client's two descriptors. So a trainer thread can submit() while a
  // completion thread blocks here, not in wait() behind the caller's lock.
  bool await_activity(std::chrono::milliseconds timeout);

  class Impl;

 private:
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace sparsecar
