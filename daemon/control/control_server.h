// ControlServer: the daemon's ZeroMQ control socket (protocol: daemon/control/protocol.h).
//
// A ROUTER socket served by one control thread that polls it with a bounded timeout
// (zmq::poll, no draft API), hands each request to the Dispatcher and sends its reply back on the
// same routing envelope (DEALER clients send [payload], REQ clients [empty, payload]; both work).
//
// Endpoints:
//   ipc://PATH   default. A lock file PATH.lock (flock) is taken first, because a second bind to
//                the same path would silently steal it from a running daemon; then a stale PATH
//                is removed, the socket bound and chmod'ed to 0600 (or 0660 with `group`).
//                PATH and PATH.lock are removed on stop (LockFile: only by the process that
//                holds the lock, never under another live daemon). A caller that took PATH.lock
//                itself (sparsecard does, before it joins the job) says so with lock_held.
//   tcp://H:P    only with a CURVE server secret key (clients must know its public key) or a
//                token every request must carry; refused otherwise. Port 0 picks a free port
//                (endpoint() tells which).
// Limits: ZMQ_LINGER=0. A request over max_message_bytes is still received and answered with a
// TOO_LARGE reply that names its size and the limit ("request of N bytes exceeds
// control_max_message_bytes = M"), so a client learns why. Only above the hard cap,
// hard_cap_bytes(max_message_bytes) = max(16 x max_message_bytes, 16 MiB), does libzmq drop the
// frame (ZMQ_MAXMSGSIZE) and close that connection without a reply; the client then times out
// (ControlClient says a large request may be why). ZMQ_RCVHWM = kReceiveQueueMessages bounds the
// requests queued per connection, so the memory one connection can pin is bounded too.
//
// Thread-safety: start()/stop() from one thread (main); the control thread owns the socket.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "daemon/control/commands.h"
#include "sparsecar/common/status.h"

namespace sparsecar::control {

struct ControlServerOptions {
  std::string endpoint;           // ipc://PATH or tcp://HOST:PORT
  std::string group;              // ipc: group that may connect (0660); empty = owner only (0600)
  std::string token;              // tcp: shared token (also checked by the Dispatcher)
  std::string curve_secret_key;   // tcp: Z85 CURVE server secret key (40 characters)
  size_t max_message_bytes = kDefaultMaxMessageBytes;
  std::chrono::milliseconds poll_interval{100};  // how quickly stop() is noticed
  // ipc: the caller holds PATH.lock (a LockFile) for the server's life, so the server neither
  // takes nor removes it.
  bool lock_held = false;
};

class ControlServer {
 public:
  // Binds and starts the control thread. `dispatcher` must outlive the server.
  static Expected<std::unique_ptr<ControlServer>> start(const ControlServerOptions& options, Dispatcher* dispatcher);
  ~ControlServer();
  // The bound endpoint (tcp port resolved).
  const std::string& endpoint() const { return endpoint_; }
  // Stops the thread, closes the socket, removes the ipc file and its lock. Idempotent.
  void stop();

  struct Impl;

 private:
  explicit ControlServer(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  std::string endpoint_;
};

// Largest frame the socket receives at all (ZMQ_MAXMSGSIZE): see "Limits" above.
size_t hard_cap_bytes(size_t max_message_bytes);
inline constexpr int kReceiveQueueMessages = 4;

// Checks an endpoint and its security settings without binding (config validation).
Status check_endpoint(const std::string& endpoint, const std::string& token, const std::string& curve_secret_key);

}  // namespace sparsecar::control
