// Daemon: owns and wires the parts of sparsecard for one node, in data-flow order:
//   local claims (socket directories and locks: config/local_paths.h) -> metrics -> mailbox
//   -> transport (rendezvous with the other nodes) -> pipeline -> sessions -> control socket.
// Whatever can clash with another daemon on the host is claimed before the rendezvous, so a
// mistake fails this daemon at once instead of every node after the join.
// Start-up fails with a Status naming the part and the cause. stop() takes them down in reverse.
// Every part is given the production Clock (steady_clock()) here and reads time only through it.
//
// Threads: start()/stop() from main; each part runs its own thread(s).
#pragma once

#include <chrono>
#include <memory>
#include <vector>

#include "daemon/config/knobs.h"
#include "sparsecar/common/status.h"

namespace sparsecar {

class Daemon {
 public:
  static Expected<std::unique_ptr<Daemon>> start(const Config& config);
  ~Daemon();
  void stop();

  // SIGTERM: refuse new steps and let the queued ones finish, at most `timeout`.
  Status drain(std::chrono::milliseconds timeout);
  // SIGHUP: `before` and `after` are the configuration before and after re-reading the file.
  // Live knobs that changed are proposed job-wide (one decision); structural ones that changed
  // are refused with a log line each and keep their running value. Returns the proposal's error.
  Status reload(const Config& before, const Config& after);
  // OK while the daemon can serve its job. Once a peer has been down for peer_down_grace_ms
  // (when that is not 0), an error naming the peer: main then stops and exits with status 3 so
  // that the service manager restarts the job (a lost rank cannot rejoin the running daemons).
  Status fatal() const;
  // Ports of the metrics exposer and the bound control endpoint (for logs and tests).
  std::vector<uint16_t> metrics_ports() const;
  std::string control_endpoint() const;

  struct Parts;

 private:
  explicit Daemon(std::unique_ptr<Parts> parts);
  std::unique_ptr<Parts> parts_;
};

}  // namespace sparsecar
