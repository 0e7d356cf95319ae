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
// Threads: one session thread (started by start()) does all of the above; complete() is the
// only method called from other threads.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>

#include "daemon/pipeline/step.h"
#include "sparsecar/common/status.h"

namespace sparsecar {


struct SessionServerOptions {
  std::string socket_path;         // created 0660; an existing stale socket file is replaced
  uint32_t local_clients = 1;      // trainers per node whose gradients are summed per step
  uint64_t max_tensor_elements = uint64_t{1} << 31;
  uint32_t max_tensors = 4096;
};

class SessionServer final : public StepResultSink {
 public:
  // Binds the socket and starts the session thread. `pipeline` must outlive the server.
  static Expected<std::unique_ptr<SessionServer>> start(const SessionServerOptions& options,
                                                        StepSink* pipeline);
  ~SessionServer() override;

  void complete(const StepResult& result) override;
  // Number of clients connected now (for status/metrics).
  uint32_t connected_clients() const;
  // Stops the thread, closes every session and removes the socket file. Idempotent.
  void stop();

  class Impl;

 private:
  explicit SessionServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace sparsecar
