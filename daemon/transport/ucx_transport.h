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
// spin when idle) plus an eventfd that send() uses to wake it. send() is thread-safe.
#pragma once

#include <chrono>
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
  // under peer error handling; the transport sets it when `tls` names posix or sysv.
  std::string tls;
  // UCX_NET_DEVICES (e.g. "lo"); empty = all.
  std::string net_devices;
  // How long start() waits for the whole job to gather.
  std::chrono::milliseconds rendezvous_timeout{60000};
};

class UcxTransport final : public Transport {
 public:
  // Creates the UCP context and worker, runs the rendezvous, connects to every peer and starts
  // the progress thread. `sink` must outlive the transport.
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
