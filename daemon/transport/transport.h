// Transport: moves opaque messages (a wire header + a payload) between the daemons of one job.
//
// The seam between the pipeline and the network. UcxTransport (ucx_transport.h) is the product;
// tests/unit/daemon/fake_transport.h is an in-process fake for unit tests.
//
// Threads: the transport owns one progress thread. send() may be called from any thread; the
// MessageSink callbacks run on the progress thread and must not block (copy what you keep and
// return). A transport never interprets the bytes it moves; validation is the receiver's job.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <vector>

#include "sparsecar/common/status.h"

namespace sparsecar {

// Sends smaller than this say nothing about the link: UCX sends them eagerly and completes them
// once they are copied out locally. Larger ones go rendezvous: they complete only when the peer's
// transport (its progress thread, not its pipeline) has fetched the last byte, so posted ->
// completed is the time the bytes spent crossing the link (where UCX still sends them eagerly
// in fragments, the socket's buffer paces them at the link's rate). Used for the controllers' link
// goodput (ExchangeStats::link_*) and the per-peer bandwidth metric alike.
inline constexpr uint64_t kLinkSampleMinBytes = 64 * 1024;

// One busy period of the link from `peer`, timed by this receiver: from the arrival of a
// rendezvous announcement until the last byte of every message announced meanwhile from that peer
// arrived (overlapping messages count once; their bytes, headers included, add up). The step
// controller fits t = alpha + beta * bytes per link from these (policies/link_model.h).
struct ReceiveSample {
  uint32_t peer = 0;
  uint64_t bytes = 0;
  double seconds = 0;
};
// A transport keeps at most this many undrained samples (the oldest go).
inline constexpr size_t kMaxReceiveSamples = 1024;

// Receives what arrives from peers. Called on the transport's progress thread.
class MessageSink {
 public:
  virtual ~MessageSink() = default;
  // One whole message from `peer`; both spans are valid only during the call.
  virtual void on_message(uint32_t peer, std::span<const std::byte> header,
                          std::span<const std::byte> payload) = 0;
  // `peer` is gone (killed, connection reset, endpoint timeout). Called once per peer process.
  virtual void on_peer_failed(uint32_t peer, const Status& why) = 0;
  // A new process of `peer` took the place of the failed one (a replacement admitted by rank 0):
  // messages from `peer` come from it from now on, and sends to `peer` reach it.
  virtual void on_peer_rejoined(uint32_t /*peer*/) {}
  // The transport dropped a message before delivering it (bad route prefix or MAC, replayed
  // sequence number, forged bye). `peer` is the rank the message claims to come from, which is
  // not authenticated (kUnknownPeer when the claim is not a rank of the job). For counting only.
  static constexpr uint32_t kUnknownPeer = 0xFFFFFFFFu;
  virtual void on_rejected(uint32_t /*peer*/, const Status& /*why*/) {}
};

// Called once when a send has completed (buffers may be reused) or failed.
using SendCallback = std::function<void(const Status&)>;

class Transport {
 public:
  virtual ~Transport() = default;

  virtual uint32_t rank() const = 0;
  virtual uint32_t world_size() const = 0;
  // Human name of a peer for error messages: "rank 2 (10.0.0.3:41234)".
  virtual std::string peer_name(uint32_t peer) const = 0;

  // Queues `header` + `payload` for `peer` (peer != rank()). Zero-copy: the caller keeps both
  // buffers alive and unchanged until `done` runs. `done` runs exactly once, on the progress
  // thread, with OK or the reason the send failed (peer down, transport stopped).
  // Returns an error without calling `done` if the request cannot even be queued.
  virtual Status send(uint32_t peer, std::span<const std::byte> header,
                      std::span<const std::byte> payload, SendCallback done) = 0;

  // Stops the progress thread, fails queued sends, closes endpoints. Idempotent.
  virtual void stop() = 0;
  // Receiver-side link timing: the samples since the last call (any thread). Default: none.
  virtual std::vector<ReceiveSample> drain_receive_samples() { return {}; }
  // every > 0: one send with a payload in `every` to each peer (the first one included) goes
  // rendezvous, so that receivers can time messages of any size; 0 (the default): the
  // transport's own choice (its rendezvous sends, the large ones, are timed either way). Any thread.
  virtual void set_timed_sends(uint32_t /*every*/) {}
  // send() for bulk data whose receiver need not time each message (the dense ring's segments):
  // while timed sends are on, all but the timed one in `every` may go eagerly (their completion
  // then says when the bytes left for the socket, not when they arrived). A rendezvous send's
  // reply queues behind the receiver's own bulk data on a shaped link. Default: send().
  virtual Status send_bulk(uint32_t peer, std::span<const std::byte> header, std::span<const std::byte> payload,
                           SendCallback done) {
    return send(peer, header, payload, std::move(done));
  }
};

}  // namespace sparsecar
