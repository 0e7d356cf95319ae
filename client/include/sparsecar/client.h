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
// Rules: register every tensor before the first submit; every trainer of the job registers the
// same tensors (names, sizes, order) and submits them in the same order with increasing steps;
// between submit() and the matching wait() the tensor's memory belongs to the daemon.
// Errors are Status values with a message (dead peer, deadline, bad registration), never a hang:
// every wait has a deadline and a dead daemon is noticed at once.
//
// Thread-safety: a Client may be used from one thread at a time (callers serialise); different
// Clients are independent.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
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
};

// What the daemon reports with a successful step.
struct StepInfo {
  uint64_t step = 0;
  uint64_t bytes_sent = 0;   // bytes the local daemon put on the wire for this (tensor, step)
  uint64_t dense_bytes = 0;  // what a dense exchange of the same step would have sent
  uint64_t nnz = 0;          // elements the local daemon selected for this step
};

// A registered tensor: a view of its shared-memory slot. Owned by the Client that made it;
// valid until that Client is destroyed.
class Tensor {
 public:
  uint32_t id() const { return id_; }
  const std::string& name() const { return name_; }
  size_t size() const { return count_; }
  // The shape it was registered with (row-major, shape()[0] leading); empty when registered
  // without one.
  const std::vector<uint64_t>& shape() const { return shape_; }
  float* data() { return data_; }
  const float* data() const { return data_; }

 private:
  friend class Client;
  uint32_t id_ = 0;
  std::string name_;
  size_t count_ = 0;
  std::vector<uint64_t> shape_;
  float* data_ = nullptr;
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

  class Impl;

 private:
  explicit Client(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace sparsecar
