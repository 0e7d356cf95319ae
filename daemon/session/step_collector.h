// StepCollector: the session's bookkeeping of one job on this node, without any socket. Owns the
// registered tensors (their local_sum and result buffers), which local client registered which
// slot, the steps being collected from the local clients, the steps lent to the pipeline, the
// tensor memory budget and the tensors orphaned by a job reset.
//
// Per (tensor, step) it waits until all `local_clients` clients have submitted, sums their slots
// in client-id order (float64 accumulation, rounded once to fp32; a single client's slot is
// copied) into the tensor's local_sum and hands one StepJob to the pipeline (StepSink). The
// pipeline's StepResult (on_result) is copied into the slot of every client that took part and
// answered with a completion.
//
// Device tensors (RegisterDevice, TensorSpec::on_device) have no slots and no local sum: each
// client attaches the OpenedDevice the DeviceRuntime made of its registration (attach_device),
// and a step hands the pipeline the participants' DeviceBuffers in client-id order
// (StepJob::device) plus one keepalive that owns every participant's mappings, so a client that
// leaves while its step is in flight does not unmap memory the pipeline still uses. on_result
// only posts the completions: the pipeline wrote the average on the GPU. They charge the budget
// only what the pipeline says (tensor_footprint_bytes): no host memory is allocated for them. Everything a client is told goes through a CompletionSink (the
// SessionServer posts it on the client's completion ring), so tests can drive the collector with
// plain float buffers as slots. The rules it enforces (refused submissions, disconnects, what is
// failed job-wide) are the ones session_server.h describes.
//
// Thread-safety: none, except counters(): every other call comes from one thread (the session
// thread). counters() are atomics that any thread may read.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "daemon/device/device_runtime.h"
#include "daemon/pipeline/step.h"
#include "daemon/session/frames.h"
#include "sparsecar/common/shm_layout.h"
#include "sparsecar/common/status.h"

namespace sparsecar {

// Bytes a shm slot of `count` floats occupies (the kernel allocates whole pages).
uint64_t slot_footprint(uint64_t count);

// Where the collector's answers to the clients go.
class CompletionSink {
 public:
  virtual ~CompletionSink() = default;
  // Whether `client` still takes results (false once its session is being closed): a result is
  // copied into the slot of a reachable client only.
  virtual bool reachable(uint32_t client) const = 0;
  // Posts a completion of (tensor_id, step) with `st` to `client`; `info` carries the pipeline's
  // numbers of an answered step (null otherwise). A client gone or being closed is skipped.
  virtual void post(uint32_t client, uint32_t tensor_id, uint64_t step, const Status& st,
                    const StepResult* info) = 0;
};

struct StepCollectorOptions {
  uint32_t local_clients = 1;                        // clients whose slots are summed per step
  uint64_t max_tensor_elements = uint64_t{1} << 31;  // larger registrations: kResourceExhausted
  uint32_t max_tensors = 4096;                       // distinct tensor names per job
  uint64_t budget_bytes = 0;                         // the tensor memory budget (resolved, > 0)
};

// What the collector counted (monotonic except the two gauges; relaxed).
struct StepCounters {
  std::atomic<uint64_t> submissions{0}, submissions_rejected{0}, steps_dispatched{0}, steps_completed{0},
      steps_failed{0}, stale_results{0}, registrations_over_budget{0}, steps_failed_job_wide{0};
  std::atomic<uint64_t> tensor_bytes_in_use{0};  // gauge: charged to the budget now
  std::atomic<uint64_t> orphaned_tensors{0};     // gauge: tensors of a reset job the pipeline holds
};

class StepCollector {
 public:
  // `pipeline` and `clients` must outlive the collector.
  StepCollector(const StepCollectorOptions& options, StepSink* pipeline, CompletionSink* clients);
  ~StepCollector();
  StepCollector(const StepCollector&) = delete;
  StepCollector& operator=(const StepCollector&) = delete;

  // ---- clients ----
  // A client finished its handshake; `label` names it in errors ("client 3 (pid 1234)"). Once
  // `local_clients` are connected again after a departure, submissions are accepted again.
  void client_joined(uint32_t client, std::string label);
  // A joined client went (`reason`: why). Fails every step still being collected for the other
  // submitters (kAborted naming the client), takes it out of the steps in flight and releases
  // its slots from the budget. With `fail_owed`, also fails job-wide (StepSink::fail_step) what
  // this node now owes its peers (see session_server.h); not when the daemon itself stops.
  void client_left(uint32_t client, const std::string& reason, bool fail_owed);
  size_t clients() const { return clients_.size(); }

  // ---- registration ----
  struct Registration {
    uint32_t tensor_id = 0;
    uint64_t count = 0;
    std::string name;
    std::vector<uint64_t> shape;
  };
  // Checks a registration of `client` (name, dtype, count, shape, limits, agreement with an
  // earlier registration of the same name — host or device too —, the memory budget counting
  // the client's slot too) and registers a new tensor with the pipeline. The error is what the
  // client is told. The client's slot (or device buffer) is not attached yet: see attach_slot
  // and attach_device.
  Expected<Registration> register_tensor(uint32_t client, const RegisterRequest& request);
  // The same checks without registering anything (nothing is counted but a refusal over the
  // budget): the server asks before it opens a device registration's CUDA handles, so that a
  // registration the collector refuses opens nothing and one it accepts needs no undoing.
  Status check_registration(uint32_t client, const RegisterRequest& request);
  // The client's slot of `tensor_id` (count floats, the client writes its gradient there and
  // reads the result back): charged to the budget and summed from now on.
  void attach_slot(uint32_t client, uint32_t tensor_id, std::span<float> slot);
  // Undoes attach_slot (the slot never reached the client).
  void detach_slot(uint32_t client, uint32_t tensor_id);
  // The client's opened device tensor `tensor_id` (registered with request.device): its buffer is
  // handed to the pipeline from now on; the collector holds `opened` until the client leaves (or
  // detach_device), and each step in flight holds its keepalive too.
  void attach_device(uint32_t client, uint32_t tensor_id, OpenedDevice opened);
  // Undoes attach_device (the ack never reached the client).
  void detach_device(uint32_t client, uint32_t tensor_id);

  // ---- steps ----
  // One submission popped from `client`'s ring. Refused ones are answered at once through the
  // CompletionSink; the last one a step needs sums the slots and hands the StepJob on.
  void submit(uint32_t client, const shm::Submission& submission);
  // The pipeline's answer to a StepJob (or a late one of a reset job, which frees its orphan).
  void on_result(const StepResult& result);
  // Every client has gone and the pipeline has been reset: forget the job's tensors. A tensor
  // whose step the pipeline still holds stays allocated and charged until on_result answers it.
  void reset_job();

  size_t tensor_count() const { return tensors_.size(); }
  uint64_t budget() const { return options_.budget_bytes; }
  const StepCounters& counters() const { return counters_; }

 private:
  struct Tensor;
  struct DeviceLease;
  struct Client {
    std::string label;
    std::map<uint32_t, std::span<float>> slots;  // tensor id -> the client's slot
    std::map<uint32_t, OpenedDevice> devices;     // tensor id -> the client's device tensor
    bool has(uint32_t tensor_id) const { return slots.count(tensor_id) != 0 || devices.count(tensor_id) != 0; }
  };
  // What a registration would do (check_registration/register_tensor share it).
  struct Plan {
    std::string name;
    Tensor* existing = nullptr;  // the tensor registered under that name, if any
    uint64_t session_bytes = 0;  // of a new tensor: local_sum + result (0 on the device)
    uint64_t pipeline_bytes = 0;
  };
  Status plan_registration(uint32_t client, const RegisterRequest& request, Plan* plan);

  std::string label_of(uint32_t client) const;
  void dispatch(Tensor& t);
  void fail_collecting(Tensor& t, const Status& st, uint32_t except_client);
  // Tells the pipeline this node will never hand over (t, step); once per (tensor, step).
  void fail_job_wide(Tensor& t, uint64_t step, const std::string& reason);
  // A client died: fail job-wide what this node now owes its peers (see session_server.h).
  void fail_owed_steps(const std::string& dead_label, const std::string& why);
  void free_orphan(size_t index);
  // A step of device tensor `t` was answered: its lease drops what it held (reused if the
  // pipeline let go of it already, so a steady state allocates nothing per step).
  static void release_lease(Tensor& t);
  void charge(uint64_t bytes);
  void release(uint64_t bytes);

  StepCollectorOptions options_;
  StepSink* pipeline_;
  CompletionSink* clients_sink_;
  std::map<uint32_t, Client> clients_;       // by client id: the local-sum order
  std::vector<std::unique_ptr<Tensor>> tensors_;  // by tensor id
  std::unordered_map<std::string, uint32_t> tensor_ids_;
  std::vector<std::unique_ptr<Tensor>> orphans_;  // in flight when the job was reset
  uint64_t bytes_in_use_ = 0;                     // charged to the budget
  uint64_t generation_ = 0;                       // bumped by every job reset; stamped on StepJobs
  // Set when a local client left while others stay: steps fail at once until L are back.
  std::string lost_client_;
  std::vector<const float*> sum_inputs_;
  StepCounters counters_;
};

}  // namespace sparsecar
