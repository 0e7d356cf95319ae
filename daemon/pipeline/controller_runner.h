// ControllerRunner: rank 0's side of the controllers.
//
// Collects every node's NodeObservation (its own from the ObservationCollector, the others'
// from kObservation messages), merges each step once all world_size nodes reported it, feeds
// the policies::ControlLoop with it, and turns a proposal into a decision epoch through
// DecisionBoard::propose — so a controller's choice reaches every node at the same step, and
// every data message carries the epoch it was planned under.
//
// The loop starts each evaluation from the operator's knobs ("base": the start-up config plus
// every decision that did not come from a controller), so switching a controller off reverts
// what it changed, and operator changes (control socket `set`/`policy`) are never overwritten
// by a stale controller value.
//
// Time: a proposal's deadline is read only through the Clock it is given (the board's).
//
// Threads: add() from the transport thread (peers) and the pipeline thread (own); poll() from
// rank 0's pipeline thread; start_hint() from the session thread; status() from any thread. One
// mutex.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <mutex>
#include <vector>

#include "daemon/config/knobs.h"
#include "daemon/pipeline/decisions.h"
#include "sparsecar/common/clock.h"
#include "sparsecar/policies/controllers.h"

namespace sparsecar {

class ControllerRunner {
 public:
  // `board` and `clock` (the board's) must outlive the runner.
  ControllerRunner(const Config& initial, DecisionBoard* board, const Clock& clock = steady_clock());

  void add(const policies::NodeObservation& observation);
  // Runs the controllers over every step all nodes have reported, proposing decisions.
  void poll();
  // The trainer's timing of its own dense first steps (policies::StartHint; the metrics
  // "dense_step_s" / "dense_wait_s"). Taken once per job, before any observation of it; a decision
  // made on it is in force from the job's first step when rank 0 has not started it (the hook
  // reports before its first submit, so rank 0's first step cannot have started).
  void start_hint(const policies::StartHint& hint);
  // A job reset: pending observations and the controllers' state belong to the finished job.
  void reset();

  // Called after each proposal with the controllers that made it ("bandwidth,accuracy") and
  // whether the decision was taken ("applied") or refused ("refused"); for metrics. Set before
  // the first poll(); runs on the thread that polls (or gives the start hint).
  using DecisionListener = std::function<void(const std::string& controllers, const std::string& outcome)>;
  void set_decision_listener(DecisionListener listener) { listener_ = std::move(listener); }

  struct Snapshot {
    policies::ControlStatus status;
    std::string active;          // the `controller` knob in force
    uint64_t steps_observed = 0;  // merged steps fed to the loop
    uint64_t steps_dropped = 0;   // steps some node never reported
  };
  Snapshot snapshot() const;

 private:
  void refresh_base_locked();
  // A proposal of the loop: to the board, logged, and told to the listener.
  void propose_locked(const policies::ControlLoop::Proposal& proposal, const Config& in_force);
  void log_accuracy_signal_locked();

  DecisionBoard* const board_;
  const Clock& clock_;
  const uint32_t world_size_;
  DecisionListener listener_;

  mutable std::mutex mu_;
  std::map<uint64_t, std::vector<policies::NodeObservation>> pending_;  // guarded by mu_
  std::string logged_signal_;  // guarded by mu_: the accuracy signal last logged
  Config base_;                       // guarded by mu_
  uint32_t base_epoch_ = 0;           // guarded by mu_: decisions up to here are in base_
  bool has_last_step_ = false;        // guarded by mu_
  bool hinted_ = false;               // guarded by mu_: this job's StartHint was taken
  uint64_t last_step_ = 0;            // guarded by mu_
  policies::ControlLoop loop_;        // guarded by mu_
  uint64_t observed_ = 0, dropped_ = 0;  // guarded by mu_
};

// The knob changes that turn `config` into `knobs` (only the knobs that differ, in the text
// set_knob accepts). `format` is included only when the knob table has a `format` knob.
KnobChanges knob_changes(const Config& config, const policies::ControlKnobs& knobs);

}  // namespace sparsecar
