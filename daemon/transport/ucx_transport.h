// UcxTransport: the Transport over UCX (UCP active messages), with a TCP rendezvous.
//
// start() performs the job rendezvous: rank 0 listens on the coordinator address (plain TCP),
// every other rank connects (retrying until the deadline) and sends {job id, world size, rank,
// UCX worker address}; rank 0 checks them (duplicate rank, wrong world size or job id are
// refused with a reason) and answers every rank with the full address table. Every rank then
// creates a UCP endpoint to every peer with peer error handling, and the rendezvous sockets are
// closed. Afterwards all traffic is UCX active messages.
//
// Threads: one progress thread owns the UCP worker. It sleeps on the worker's event fd (no busy
// spin when idle) plus an eventfd that send() uses to wake it; it also wakes every
// `idle_wakeup` so UCX keepalive (which finds dead shared-memory peers) runs. send() is
// thread-safe and lock-light: it validates, appends to a mutex-guarded MPSC queue (a vector swap,
// no allocation in steady state) and writes the eventfd only when the progress thread sleeps.
// MessageSink callbacks and SendCallbacks run on the progress thread; they must not block and
// must not call stop() (stop() from the progress thread only requests the stop; the destructor
// then joins — never destroy the transport from its own callback).
//
// Framing: one message = one UCP active message whose header is an 8-byte route prefix (sender
// rank) + the caller's header, and whose data is the payload (eager or rendezvous, <= 1 GiB).
// See WIRE.md, "Transport framing".
//
// UCX configuration: `tls`/`net_devices` go to ucp_config_modify, as do the shared-memory error
// handling switch and the keepalive interval. UCX's memory hooks (which fight AddressSanitizer)
// are read from the environment when libucm loads; see daemon/transport/README.md.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "daemon/transport/transport.h"

namespace sparsecar {

struct UcxTransportOptions {
  uint32_t rank = 0;
  uint32_t world_size = 1;
  uint64_t job_id = 0;
  // "HOST:PORT" of rank 0's rendezvous listener. Rank 0 binds it, the others connect to it.
  std::string coordinator;
  // UCX transports to use (UCX_TLS syntax, e.g. "tcp" or "posix,self"); empty = UCX's default
  // (or the UCX_TLS environment variable). Shared-memory transports need UCX_MM_ERROR_HANDLING=y
  // under peer error handling; the transport sets it when `tls` is empty or names posix, sysv,
  // sm, shm or all (see README.md for the exact UCX 1.13 spelling).
  std::string tls;
  // UCX_NET_DEVICES (e.g. "lo"); empty = all.
  std::string net_devices;
  // How long start() waits for the whole job to gather.
  std::chrono::milliseconds rendezvous_timeout{60000};
  // UCX keepalive period (UCX_KEEPALIVE_INTERVAL): how soon a silently dead peer is noticed on
  // transports without a connection to break (shared memory). TCP notices a killed peer at once.
  std::chrono::milliseconds keepalive_interval{1000};
  // Longest the idle progress thread sleeps without an event (drives keepalive).
  std::chrono::milliseconds idle_wakeup{250};
  // How long stop() waits for endpoints to flush before closing them anyway.
  std::chrono::milliseconds stop_timeout{2000};
  // Human label of this rank in peers' error messages; empty = "<hostname>:<pid>".
  std::string label;
  // Rank 0 only: called with the bound rendezvous port once listening (tests use port 0).
  std::function<void(uint16_t port)> on_listening;
};

class UcxTransport final : public Transport {
 public:
  // Creates the UCP context and worker, runs the rendezvous, connects to every peer and starts
  // the progress thread. `sink` must outlive the transport. Blocks the calling thread for up to
  // `rendezvous_timeout`. Errors: INVALID_ARGUMENT (options), DEADLINE_EXCEEDED (the job did not
  // gather in time), FAILED_PRECONDITION (rank 0 refused this rank: the reason says why),
  // UNAVAILABLE/INTERNAL (UCX or sockets; the UCX status text is in the message).
  static Expected<std::unique_ptr<UcxTransport>> start(const UcxTransportOptions& options,
                                                       MessageSink* sink);
  ~UcxTransport() override;

  uint32_t rank() const override;
  uint32_t world_size() const override;
  std::string peer_name(uint32_t peer) const override;
  Status send(uint32_t peer, std::span<const std::byte> header, std::span<const std::byte> payload,
              SendCallback done) override;
  void stop() override;

  class Impl;

 private:
  explicit UcxTransport(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace sparsecar
