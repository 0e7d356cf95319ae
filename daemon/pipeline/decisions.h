// DecisionBoard: the live settings of the job, changed only by rank 0 and applied by every node
// at the same step ("decision epochs", docs/architecture.md).
//
// A Decision is {epoch, effective_step, config}: the full knob values in force from
// `effective_step` on. Epoch 0 is the start-up configuration (checked equal on every node at the
// first step). Changes come from the control socket (`set`, `pause`, `policy`) or from the
// controllers; on any rank they go to propose(), which on rank 0 validates them (live knobs
// only, ranges), assigns epoch e+1 effective at (the highest step rank 0 has started) + 2, and
// broadcasts a kDecision to every peer; on other ranks propose() forwards them to rank 0 as a
// kKnobRequest and waits for the kKnobReply.
//
// Why "+2" is safe: a node can finish step s only after every node sent its step-s message, so
// while rank 0 works on step s no node has started s+2; rank 0 sends the decision before its own
// s+1 message, and UCX delivers active messages of one endpoint in order, so every node knows the
// decision before it can complete s+1. If that ever failed, the epoch in every data message
// turns it into a loud step error, never a silent mix.
//
// Joining: rank 0 answers every node's first-step manifest (and a replacement's, when it joins a
// running job) with a snapshot of its decisions, which the node adopts (with_snapshot / adopt):
// a node that started later, or with older decisions, holds rank 0's from its first step on.
// Snapshot text: per decision "epoch E step S state N changes M\n" + N bytes + M bytes of
// knob=value lines: the first decision's state lists every live knob, then each decision's own
// changes (the later ones carry no state, N = 0).
//
// Threads: propose() from any thread (control, pipeline); at_step() from the pipeline thread;
// on_message() from the transport thread. One mutex guards the state, and rank 0 sends a
// decision while still holding it: epochs decided e+1, e+2 are queued on every endpoint in that
// order (deciding under the lock and sending after it could send e+2 first, and the peers would
// then refuse every later epoch).
//
// Time: propose()'s deadline is a time on the Clock the board is given; the wait for rank 0's
// reply reads time only through it, in bounded real-time slices (clock_wait.h).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "daemon/config/knobs.h"
#include "daemon/transport/transport.h"
#include "daemon/transport/wire.h"
#include "sparsecar/common/clock.h"
#include "sparsecar/common/status.h"

namespace sparsecar {

struct Decision {
  uint32_t epoch = 0;
  uint64_t effective_step = 0;
  std::shared_ptr<const Config> config;
  std::string changes;  // "knob=value" lines relative to the previous epoch ("" for epoch 0)
  std::string reason;   // who asked: "control: set", "controller bandwidth", ...
  // Not OK when this node could not apply the epoch rank 0 announced (a knob it does not know or
  // a value it refuses: mixed versions). Steps under such an epoch fail with this status on
  // this node instead of running with half of the change.
  Status error;
};

using KnobChanges = std::vector<std::pair<std::string, std::string>>;

class DecisionBoard {
 public:
  // `transport` may be null when world_size == 1. `clock` must outlive the board.
  DecisionBoard(const Config& initial, Transport* transport, const Clock& clock = steady_clock());

  // Changes live knobs for the whole job; returns the decision that carries them (its epoch and
  // the step it takes effect at). Errors: unknown or non-live knob, bad value (kInvalidArgument /
  // kNotFound), rank 0 unreachable or silent until `deadline` (kUnavailable/kDeadlineExceeded).
  Expected<Decision> propose(const KnobChanges& changes, const std::string& reason, Clock::time_point deadline);

  // The decision in force for `step` (the latest epoch whose effective_step <= step). Records
  // that this node started `step`.
  Decision at_step(uint64_t step);

  // The newest decision known here (may not be in force yet).
  Decision latest() const;
  // Every decision known here, oldest first (for status and tests).
  std::vector<Decision> history() const;

  // kDecision / kKnobRequest / kKnobReply from `peer`, already validated by the mailbox.
  void on_message(uint32_t peer, const wire::WireHeader& header, std::span<const std::byte> payload);

  // Rank 0: calls `fn` with the decisions in force here as text (snapshot format below) while
  // holding the board's lock, so no decision can be broadcast between the snapshot and what `fn`
  // sends: a peer that adopts the snapshot and then applies what follows misses nothing.
  void with_snapshot(const std::function<void(const std::string& snapshot)>& fn) const;
  // A node joining a job (first-step agreement, or a replacement joining a running job): takes
  // rank 0's decisions as its own. Decisions that rank 0 broadcast after the snapshot and that
  // arrived first are kept and applied on top. Errors (malformed snapshot, a value this node
  // refuses) leave the board unchanged.
  Status adopt(std::string_view snapshot);

  // A new job starts (every trainer left): live settings last for one job only. Every live knob
  // reverts to its configured value (start-up flags and file, or the last set_configured()), with
  // one INFO line naming the knobs that reverted; the step counter restarts. If the finished job
  // made any decision (or a value reverts), the base is a new epoch (newest + 1, from step 0)
  // holding the configured values, so a late decision of the finished job is never applied on
  // top; else the newest decision stays the base. Every node does this at its own reset, and at
  // the next job's first step every node adopts rank 0's decisions (adopt), as at start-up: the
  // job runs on rank 0's configured values (the agreed ones are equal on every node anyway).
  void reset();
  // SIGHUP: the live knobs of `config` become the configured values the next reset() reverts to
  // (structural knobs are ignored: they do not change while the daemon runs).
  void set_configured(const Config& config);

 private:
  Expected<Decision> decide_locked(const KnobChanges& changes, const std::string& reason);
  void broadcast(const Decision& d);
  // Appends epoch `epoch` (the next one) with `text` applied on top of the newest decision; then
  // any decisions that arrived early and now follow. mu_ held.
  void apply_locked(uint32_t epoch, uint64_t effective_step, const std::string& text, const std::string& reason);
  void apply_early_locked();
  void send_text(uint32_t peer, wire::Kind kind, uint64_t step, uint32_t epoch, std::string text);

  const uint32_t rank_;
  const uint32_t world_size_;
  const uint64_t job_id_;
  Transport* const transport_;
  const Clock& clock_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Decision> decisions_;            // guarded by mu_; epochs 0, 1, 2, ... in order
  std::shared_ptr<const Config> configured_;   // guarded by mu_: what reset() reverts to
  bool started_ = false;                       // guarded by mu_: a step started since reset
  uint64_t max_started_step_ = 0;              // guarded by mu_
  uint64_t next_request_ = 1;                  // guarded by mu_
  std::map<uint64_t, std::string> replies_;    // guarded by mu_: request id -> reply text
  // Decisions from rank 0 that arrived ahead of their predecessor (a node that has not yet
  // adopted rank 0's snapshot): epoch -> {effective step, changes}. Bounded.
  std::map<uint32_t, std::pair<uint64_t, std::string>> early_;  // guarded by mu_
};

// "knob=value\n" lines <-> pairs. parse_changes rejects lines without '='.
std::string format_changes(const KnobChanges& changes);
Expected<KnobChanges> parse_changes(std::string_view text);

}  // namespace sparsecar
