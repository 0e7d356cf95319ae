// Daemon: owns and wires the parts of sparsecard for one node, in data-flow order:
//   metrics -> mailbox -> transport (rendezvous with the other nodes) -> pipeline -> sessions.
// Start-up fails with a Status naming the part and the cause. stop() takes them down in reverse.
//
// Threads: start()/stop() from main; each part runs its own thread(s).
#pragma once

#include <memory>

#include "daemon/config/knobs.h"
#include "sparsecar/common/status.h"

namespace sparsecar {

class Daemon {
 public:
  static Expected<std::unique_ptr<Daemon>> start(const Config& config);
  ~Daemon();
  void stop();

  struct Parts;

 private:
  explicit Daemon(std::unique_ptr<Parts> parts);
  std::unique_ptr<Parts> parts_;
};

}  // namespace sparsecar
