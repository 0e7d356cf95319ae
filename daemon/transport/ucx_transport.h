// UcxTransport: the Transport over UCX (UCP active messages), with a TCP rendezvous.
//
// start() performs the job rendezvous (rendezvous.h, RENDEZVOUS.md): rank 0 listens on the
// coordinator address (plain TCP) and challenges every connection; every other rank connects
// (retrying until the deadline) and answers with {job id, world size, rank, UCX worker address}
// under a MAC keyed with the job secret; rank 0 verifies it first, checks the fields and, once
// everyone has joined, sends each rank the address table and a random formation id under its
// own MAC (mutual authentication). Every rank then creates a UCP endpoint to every peer with peer
// error handling. Afterwards all traffic is UCX active messages.
//
// Threads: one progress thread owns the UCP worker. It sleeps on the worker's event fd (no busy
// spin when idle) plus an eventfd that send() uses to wake it; it also wakes every
// `idle_wakeup` so UCX keepalive (which finds dead shared-memory peers) runs. send() is
// thread-safe and lock-light: it validates, appends to a mutex-guarded MPSC queue (a vector swap,
// no allocation in steady state) and writes the eventfd only when the progress thread sleeps.
// MessageSink callbacks and SendCallbacks run on the progress thread; they must not block and
// must not call stop() (stop() from the progress thread only requests the stop; the destructor
// then joins — never destroy the transport from its own callback).
// stats(), formation_id() and incarnation() may be called from any thread.
//
// Time: deadlines (rendezvous, device wait, stop) and the rate limit of its log read time only
// through the Clock in its options; the waits themselves (event fd, poll) are bounded real time.
//
// Framing: one message = one UCP active message whose header is a 32-byte route prefix {sender
// rank, magic "SCT2", per-(sender -> receiver) sequence number, 16-byte MAC} + the caller's header,
// and whose data is the payload (eager or rendezvous, <= 1 GiB). The MAC (keyed BLAKE2b-128, the
// key derived from the job secret, the job id and the formation id) covers the prefix, the
// receiver, the AM id and the caller's header; the receiver verifies it and rejects a sequence
// number it has already accepted (or one too old to tell) before the sink sees anything. A
// rejected message is dropped, counted (stats(), MessageSink::on_rejected) and logged, rate
// limited. The "bye" of an orderly stop() carries the same prefix, so a forged bye is dropped too.
// The payload is covered only through the CRC-32C in the wire header (WIRE.md, "Transport
// framing").
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

#include "daemon/transport/auth.h"
#include "daemon/transport/transport.h"
#include "sparsecar/common/clock.h"

namespace sparsecar {

// Bytes of the route prefix in front of the caller's header (WIRE.md, "Transport framing").
inline constexpr size_t kUcxRouteBytes = 32;
// Active-message ids: sparsecar messages and the "bye" of an orderly stop().
inline constexpr unsigned kUcxDataAmId = 1;
inline constexpr unsigned kUcxByeAmId = 2;
inline constexpr unsigned kUcxRejoinAmId = 3;  // rank 0: "rank R has a new process" (replacements)

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
  // The job key (auth::load_job_key(job_secret_file)); default: the public open-job key, which
  // authenticates nobody.
  auth::JobKey key = auth::open_job_key();
  // How long start() keeps retrying to create the UCX context and worker when no usable network
  // device is there yet (a daemon started just before its interface comes up). Bounded by
  // rendezvous_timeout too.
  std::chrono::milliseconds device_wait{10000};
  // Rank 0's rendezvous limits (rendezvous::Options): connections waiting for a hello, and how
  // long each may take.
  size_t rendezvous_max_pending = 64;
  std::chrono::milliseconds rendezvous_hello_timeout{5000};
  // Rank 0 only: admit a replacement for a rank whose endpoint has failed into the running
  // formation (rendezvous::Coordinator; rank 0 keeps its rendezvous socket open either way). Off:
  // a replacement is refused with a reason that says so, and a lost rank stays lost.
  bool accept_replacements = true;
  // What deadlines are read on (also the rendezvous'); must outlive the transport.
  const Clock* clock = &steady_clock();

  // Tests only. Called on the progress thread with every sealed AM header the transport sends.
  std::function<void(uint32_t peer, unsigned am_id, std::span<const std::byte> am_header)> observe_sent_for_test;
  // Tests only. Called by send() after its checks, just before it queues the request.
  std::function<void()> before_enqueue_for_test;
};

// Counters of a running transport (monotonic).
struct UcxTransportStats {
  uint64_t messages_rejected = 0;       // bad prefix or MAC, replayed sequence number, forged bye
  uint64_t messages_out_of_order = 0;   // authentic, accepted, but below the highest sequence seen
  uint64_t rendezvous_auth_failures = 0;  // rank 0: hellos whose MAC did not verify
  uint64_t rendezvous_refused = 0;      // rank 0: authenticated hellos refused, or malformed ones
  uint64_t rendezvous_shed = 0;         // rank 0: connections closed (cap, hello deadline, no fds)
  uint64_t replacements_admitted = 0;   // rank 0: replacements of lost ranks admitted
  uint64_t peers_rejoined = 0;          // peers that came back as a new process (replacements)
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
  Status send_bulk(uint32_t peer, std::span<const std::byte> header, std::span<const std::byte> payload,
                   SendCallback done) override;
  void stop() override;
  std::vector<ReceiveSample> drain_receive_samples() override;
  void set_timed_sends(uint32_t every) override;

  UcxTransportStats stats() const;
  // The random id rank 0 drew for this formation of the job (the same on every rank), and its
  // first 8 bytes as a little-endian number: a per-formation job incarnation.
  const auth::Nonce& formation_id() const;
  uint64_t incarnation() const;

  // Tests only: sends `am_header` exactly as given (no prefix, no MAC) as AM `am_id` with no
  // payload, from the progress thread. Lets tests forge and replay messages.
  Status send_raw_for_test(uint32_t peer, unsigned am_id, std::span<const std::byte> am_header);

  class Impl;

 private:
  explicit UcxTransport(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace sparsecar
