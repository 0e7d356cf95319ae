// Mailbox: where messages from peers wait until the pipeline asks for them.
//
// The transport's progress thread delivers every message here (Mailbox is the MessageSink). Each
// message is validated before it is kept: header fields (wire::validate_header), sender identity
// (the header's sender must be the transport's peer) and the checksum. A bad message is counted,
// logged once with the peer and reason, and — when its (tensor, step) can be trusted enough to
// name — turned into a failure for that step so the waiting pipeline fails fast with kDataLoss
// instead of running into its deadline.
//
// The pipeline thread takes messages with take(): it blocks until the message is there, the
// peer has failed, the peer aborted that step, the deadline passes, or cancel() is called.
//
// Job incarnations: every job formation on long-lived daemons draws a random 64-bit incarnation
// (rank 0, at the first-step agreement) that every data and abort message carries. Between jobs
// (begin_job() .. set_incarnation()) such messages are kept under the incarnation they carry;
// set_incarnation(I) then drops every one of another incarnation, and while I is in force a
// data or abort message of another incarnation is dropped on arrival. Each drop is counted
// (stale(), errors_total{kind="wire_stale"}): nothing of an earlier job is ever summed into a
// later one, even when both use the same steps. Manifests and their acks are formation-level:
// a manifest is kept across begin_job() (a peer may start its next job before this node has
// reset) and the newest one from a peer replaces an older one.
//
// Memory is bounded per peer: the payload bytes a peer has waiting here may not exceed
// max_bytes_per_peer (the `mailbox_max_bytes` knob). A message that would go over is rejected
// like a corrupt one (counted, logged, its step failed at once with kResourceExhausted): a peer
// that runs far ahead or floods cannot exhaust this daemon's memory. A peer in step can be at
// most about two steps ahead, so the limit only needs to cover two steps of its messages.
//
// A failed peer's stored messages and step failures are dropped when it fails: a replacement of
// that rank (on_peer_rejoined) starts clean, and nothing of the lost process is summed after.
//
// Time: the mailbox reads time only through the Clock it is given (when a peer went down, the
// grace period, take()'s deadline); take() waits in bounded real-time slices (clock_wait.h).
//
// Thread-safety: on_message/on_peer_failed/on_peer_rejoined run on the transport thread; everything else on the
// pipeline thread; one mutex guards the state (messages are per tensor step, not per element).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "daemon/transport/transport.h"
#include "daemon/transport/wire.h"
#include "sparsecar/common/clock.h"

namespace sparsecar {

class Metrics;

struct Envelope {
  wire::WireHeader header{};
  std::vector<std::byte> payload;
};

class Mailbox final : public MessageSink {
 public:
  static constexpr uint64_t kDefaultMaxBytesPerPeer = uint64_t{4} << 30;
  // `clock` must outlive the mailbox.
  Mailbox(uint64_t job_id, uint32_t world_size, Metrics* metrics,
          uint64_t max_bytes_per_peer = kDefaultMaxBytesPerPeer, const Clock& clock = steady_clock());

  // MessageSink (transport thread).
  void on_message(uint32_t peer, std::span<const std::byte> header,
                  std::span<const std::byte> payload) override;
  void on_peer_failed(uint32_t peer, const Status& why) override;
  // A replacement took the lost peer's place: takes from it work again. What the lost process had
  // sent was dropped when it failed (on_peer_failed), so nothing of it can be taken.
  void on_peer_rejoined(uint32_t peer) override;
  // The transport dropped a message from `peer` before it got here (bad MAC, replayed sequence
  // number, forged bye): counted as errors_total{kind="transport_rejected"} (the transport logs it).
  void on_rejected(uint32_t peer, const Status& why) override;

  // Decision, knob and observation messages (kinds 5..8) are not stored: once validated they go
  // to this handler, on the transport thread. Set it before the first such message can arrive.
  using ControlHandler = std::function<void(uint32_t peer, const wire::WireHeader& header,
                                            std::span<const std::byte> payload)>;
  void set_control_handler(ControlHandler handler);
  // Rank 0: a manifest (a node's first-step agreement request) first goes to this handler, on the
  // transport thread; it returns true when it answered it (a replacement joining the running
  // job), false to keep it for the pipeline's own agreement as usual.
  using ManifestHandler = std::function<bool(uint32_t peer, const wire::WireHeader& header,
                                             std::span<const std::byte> payload)>;
  void set_manifest_handler(ManifestHandler handler);

  // Waits for the message of `kind` from `peer` for (tensor, step, chunk) of job `incarnation`
  // (0 for the formation-level kinds kManifest and kManifestAck). Errors: kUnavailable (peer
  // failed), kAborted (peer aborted the step, or cancel()), kDataLoss (its message was corrupt),
  // kDeadlineExceeded. `peer_name` is used in messages.
  Expected<Envelope> take(wire::Kind kind, uint32_t peer, uint32_t tensor, uint64_t step, uint32_t chunk,
                          uint64_t incarnation, Clock::time_point deadline, const std::string& peer_name);

  // Drops messages for `tensor` with step < `step` (late arrivals of failed steps).
  void drop_before(uint32_t tensor, uint64_t step);
  // A job ended on this node (every trainer left): forgets every data and abort message, step
  // failure and manifest ack, and accepts messages of any incarnation until set_incarnation().
  // Manifests stay (see above). Peer failures stay: a dead peer stays dead.
  void begin_job();
  // The job agreed on incarnation `incarnation` (non-zero): drops what is kept of any other.
  void set_incarnation(uint64_t incarnation);
  uint64_t incarnation() const;
  // Makes every current and future take() return kAborted until resume().
  void cancel();
  void resume();

  // Why `peer` failed, or OK while it is alive.
  Status peer_status(uint32_t peer) const;
  // The first peer failure and when it was seen; nullopt while every peer is alive.
  struct PeerDown {
    uint32_t peer = 0;
    Status why;
    Clock::time_point since;
  };
  // (The earliest failure among the peers that are down now: a peer that rejoined no longer counts.)
  std::optional<PeerDown> first_peer_down() const;
  // first_peer_down() once that peer has been down for `grace` or longer by the mailbox's clock
  // (the daemon's peer_down_grace_ms: past it the daemon gives up); nullopt before.
  std::optional<PeerDown> peer_down_past(Clock::duration grace) const;
  uint64_t rejected() const { return rejected_.load(); }
  // Data and abort messages dropped because they belong to another job incarnation.
  uint64_t stale() const { return stale_.load(); }
  // Peers that came back as a new process (on_peer_rejoined), in all and for one peer.
  uint64_t rejoined() const;
  uint64_t rejoined(uint32_t peer) const;
  // Payload bytes waiting from `peer` (for tests and status).
  uint64_t buffered_bytes(uint32_t peer) const;

 private:
  // kind, peer, tensor, step, chunk, incarnation (0 for the formation-level kinds)
  using Key = std::tuple<uint16_t, uint32_t, uint32_t, uint64_t, uint32_t, uint64_t>;
  using StepKey = std::tuple<uint32_t, uint32_t, uint64_t, uint64_t>;  // peer, tensor, step, incarnation

  void reject(uint32_t peer, const Status& why, const wire::WireHeader* trusted_header);
  // Counts (and logs, rate-limited) `n` messages dropped as stale. mu_ not held.
  void count_stale(uint64_t n, const char* why);
  // Drops kept data/abort messages and step failures whose incarnation is not `keep` (mu_
  // held); returns how many messages went.
  uint64_t drop_other_incarnations(uint64_t keep);
  // Removes a stored message and its bytes from the peer's account (mu_ held).
  std::map<Key, Envelope>::iterator erase_message(std::map<Key, Envelope>::iterator it);

  const uint64_t job_id_;
  const uint32_t world_size_;
  Metrics* const metrics_;
  const uint64_t max_bytes_per_peer_;
  const Clock& clock_;
  std::atomic<uint64_t> rejected_{0};
  std::atomic<uint64_t> stale_{0};

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::map<Key, Envelope> messages_;            // guarded by mu_
  std::map<StepKey, Status> step_failures_;     // guarded by mu_: aborts and corrupt messages
  std::vector<Status> peer_failures_;           // guarded by mu_: OK while alive
  std::vector<Clock::time_point> down_since_;   // guarded by mu_: when each down peer failed
  std::vector<uint64_t> rejoins_;               // guarded by mu_: replacements per peer
  std::vector<uint64_t> buffered_;              // guarded by mu_: payload bytes waiting per peer
  bool cancelled_ = false;                      // guarded by mu_
  uint64_t incarnation_ = 0;                    // guarded by mu_: 0 between jobs
  ControlHandler control_;                      // guarded by mu_ (copied out before the call)
  ManifestHandler manifests_;                   // guarded by mu_ (copied out before the call)
};

}  // namespace sparsecar
