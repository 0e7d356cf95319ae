// SessionServer: the trainers' side of the daemon. Owns the Unix socket, every client session,
// their shared-memory mappings and rings, and the per-tensor local-sum/result buffers.
//
// Accepts clients on the Unix socket (SO_PEERCRED: only the daemon's uid, or root), performs
// the versioned handshake, passes the control memfd and eventfds with SCM_RIGHTS, registers
// tensors (one pre-faulted memfd slot per tensor per client), and watches the submission rings.
// When every expected local client has submitted (tensor, step), it sums their slots densely
// (in client order) and hands one StepJob to the pipeline; when the StepResult comes back it
// copies the average into every local client's slot and posts a Completion to each.
//
// Errors go back to the client that caused them as a failed Completion (unknown tensor, step out
// of order, a step the other local clients did not submit) or a registration reply (size
// mismatch), and are counted. A client that disconnects is noticed (socket close), its session
// freed and its pending steps failed for the other local clients; once no client is left the
// pipeline is reset and the daemon serves the next job.
//
// Protocol: common/include/sparsecar/common/session_protocol.h (socket messages) and
// shm_layout.h (control mapping, rings). Per step the daemon sums the L local slots in client-id
// order (float64 accumulation, rounded once to fp32) into the tensor's local_sum buffer.
// A disconnecting client fails every step still being collected (the others can never complete
// it) with kAborted naming the client; steps already handed to the pipeline complete for the
// clients still connected. Until L clients are connected again (a replacement), every new
// submission fails at once with kAborted naming the client that left, so trainers never wait
// for a step this node cannot complete. Before the first departure, early submissions simply
// wait for the remaining clients to connect.
//
// Contract with the pipeline (StepSink): ids are dense per job; every StepJob is answered exactly
// once through complete(); after reset() returns, the pipeline has answered (or will never
// answer) every job and no longer touches their buffers. Results that match no job in flight are
// dropped and counted (stale_results). complete() may be called from inside StepSink::submit().
//
// Device tensors (RegisterDevice, DESIGN §8): the server asks its DeviceRuntime whether device
// tensors can be opened here at all (kUnavailable with the reason, e.g. no CUDA or no GPU: the
// session stays open and the trainer registers a host tensor instead), lets the StepCollector
// check the registration, then opens the trainer's CUDA IPC handles (DeviceRuntime::open) and
// attaches them to the collector. The RegisterAck carries no fd. Refusals of either kind are
// counted in registrations_device_refused.
//
// Parts (each its own file in daemon/session/): the SessionServer runs the session thread's poll
// loop and wires them — Connection (one client's socket, handshake, SCM_RIGHTS, rings),
// StepCollector (tensors, step collection and local sums, disconnects, the memory budget; no
// sockets), ShmMapping (the sealed memfds) and frames.h (parsing the socket's bytes). Time
// (handshake deadlines) is read from the Clock given to start().
//
// Threads: one session thread (started by start()) does all of the above; complete(), stats()
// and connected_clients() may be called from any thread; stop() from any thread but the session
// thread and not concurrently with itself.
//
// A trainer that dies while this node owes its peers a step fails that step job-wide
// (StepSink::fail_step) so the other nodes' trainers error at once, not at their deadline: a
// step being collected from the local clients; while the dead trainer was in the middle of step
// S (some tensors at S, others not), every tensor it had not submitted for S. Between steps
// nothing is failed (that is also how a job ends; peers then learn from their own deadline).
// Later submissions of the remaining clients that are refused (a local client is missing) fail
// their step job-wide too.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "daemon/device/device_runtime.h"
#include "daemon/pipeline/step.h"
#include "sparsecar/common/clock.h"
#include "sparsecar/common/status.h"

namespace sparsecar {

// Memory budget (tensor_memory_budget_bytes): every registration is charged what it really
// costs this node before anything is allocated — a new tensor its local_sum and result buffers
// (2 x 4n bytes) plus the pipeline's buffers for it (StepSink::tensor_footprint_bytes), every
// client's registration its shm slot (4n bytes, page-rounded). One over the budget is refused with
// kResourceExhausted naming the budget, the request and what is in use. Slots are released when
// their client goes, tensors at the job reset; a tensor whose step was still in the pipeline at
// the reset stays charged (and allocated) until the pipeline answers that step.
//
// Handshakes: a connection must send Hello within handshake_timeout; at most
// max_handshakes_per_uid connections of one uid may wait for their handshake at once — a new one
// of that uid closes its oldest (counted in handshakes_evicted), so silent connections cannot
// lock a real trainer out; at most kMaxPendingConnections wait in all.
inline constexpr size_t kMaxPendingConnections = 64;

// Default of tensor_memory_budget_bytes (0): half of the machine's physical memory.
uint64_t default_tensor_memory_budget();

struct SessionServerOptions {
  std::string socket_path;         // created 0660; an existing stale socket file is replaced
  uint32_t local_clients = 1;      // trainers per node whose gradients are summed per step
  uint64_t max_tensor_elements = uint64_t{1} << 31;  // larger registrations: kResourceExhausted
  uint32_t max_tensors = 4096;                       // distinct tensor names per job
  std::chrono::milliseconds handshake_timeout{2000}; // a connection must send Hello within this
  uint32_t max_handshakes_per_uid = 8;               // connections of one uid awaiting Hello
  uint64_t tensor_memory_budget_bytes = 0;           // 0: default_tensor_memory_budget()
};

// Counters of what the session thread saw (monotonic, relaxed snapshots).
struct SessionStats {
  uint64_t clients_accepted = 0;        // handshakes completed
  uint64_t clients_rejected = 0;        // uid check failed, too many clients, version mismatch
  uint64_t clients_disconnected = 0;    // sessions freed after a handshake
  uint64_t protocol_errors = 0;         // malformed frames, corrupt rings, stray fds: session dropped
  uint64_t registrations = 0;           // successful registrations (one per client and tensor)
  uint64_t registrations_rejected = 0;  // bad name/count/dtype, size mismatch, limits, late
  uint64_t submissions = 0;             // entries popped from submission rings
  uint64_t submissions_rejected = 0;    // unknown tensor, step out of order, busy, disagreement
  uint64_t steps_dispatched = 0;        // StepJobs handed to the pipeline
  uint64_t steps_completed = 0;         // StepResults with OK status delivered
  uint64_t steps_failed = 0;            // failed StepResults + steps aborted by a disconnect
  uint64_t stale_results = 0;           // StepResults that matched no job in flight
  uint64_t metrics = 0;                 // Metric messages forwarded to the pipeline
  uint64_t registrations_over_budget = 0;  // of registrations_rejected: tensor memory budget
  uint64_t registrations_device_refused = 0;  // of registrations_rejected: a device tensor the
                                              // DeviceRuntime refused (no CUDA/GPU, bad handles)
  uint64_t handshakes_evicted = 0;      // of clients_rejected: closed for a newer one of its uid
  uint64_t steps_failed_job_wide = 0;   // (tensor, step)s handed to StepSink::fail_step
  uint64_t tensor_bytes_in_use = 0;     // charged to the tensor memory budget now
  uint64_t tensor_memory_budget = 0;    // the budget in force (bytes)
  uint64_t orphaned_tensors = 0;        // tensors of a reset job still waiting for the pipeline
};

class SessionServer final : public StepResultSink {
 public:
  // Binds the socket and starts the session thread. `pipeline`, `clock` and `devices` must
  // outlive the server; the clock times the handshakes (a test passes a FakeClock). `devices`
  // opens device tensors (daemon.cc passes make_device_runtime(); tests a fake); null refuses
  // every device tensor with kUnavailable.
  static Expected<std::unique_ptr<SessionServer>> start(const SessionServerOptions& options,
                                                        StepSink* pipeline,
                                                        const Clock& clock = steady_clock(),
                                                        DeviceRuntime* devices = nullptr);
  ~SessionServer() override;

  void complete(const StepResult& result) override;
  // Number of clients connected now (for status/metrics).
  uint32_t connected_clients() const;
  SessionStats stats() const;
  // Stops the thread, closes every session and removes the socket file. Idempotent.
  void stop();

  class Impl;

 private:
  explicit SessionServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace sparsecar
