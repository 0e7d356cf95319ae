// Job-level controllers: observations of finished steps in, live knob values out.
//
// They run on rank 0 only (daemon/pipeline/controller_runner.h), fed with what every node
// measured (NodeObservation, piggybacked to rank 0 as kObservation messages) merged into one
// JobObservation per step. They act by proposing knob values (ControlKnobs); the daemon turns a
// proposal into a decision epoch (daemon/pipeline/decisions.h), so every node switches at the
// same step and per-tensor plans (tensor_plan.h) stay identical everywhere.
//
// Like NCCL's tuner plugins, a controller is versioned and works on plain structs only: no
// clock (time comes in the observations), no I/O, no randomness. Fed the same observations in
// the same order it makes the same proposals, so tests drive it with scripted traces. A
// controller that fails (error, non-finite or out-of-range output) makes the ControlLoop fall
// back to the static knobs (the operator's) and stay there.
//
// Composition: the active controllers run in a fixed order, each refining what the previous one
// proposed, starting from the operator's knobs (`base`):
//   accuracy (density multiplier) -> gradnorm (temporary boost / relax) -> budget (lambda)
//   -> frequency (per-tensor scales) -> bandwidth (density cap, dense-vs-sparse) -> step
//   (dense ring or a density at or above the one asked for, by step time) -> cost (collective
//   and format for the final density)
// The ControlLoop then rate-limits (min steps between proposals) and applies hysteresis
// (relative change needed) against the knobs in force.
//
// Files: this header (knobs, settings, the Controller interface, the registry, the loop);
// observations.h (what the loop is fed), cost_model.h (bytes of a step, sparse or dense),
// goodput.h (the link estimate the loop keeps). policies/src/controllers.cc holds the registry
// rows and the loop, controller_<name>.cc one job-level controller each (its class private to
// the file), controller_internal.h their factories and shared helpers.
//
// Adding a job-level controller: its ControllerKind (tensor_plan.h), its controller_<name>.cc
// and line in policies/CMakeLists.txt, its factory in controller_internal.h, its registry row
// (controllers.cc; the row's place is its place in the chain), its settings part here (a struct
// nested in ControllerSettings) with one knob per field (Config member in daemon/config/knobs.h,
// row in knobs.cc writing in<&ControllerSettings::part, &Part::field>), its test
// (tests/unit/policies/controllers_test.cc) and docs/controllers.md. The `controller` knob's
// words, make_controller and the chain order come from the row.
//
// Thread-safety: none; a ControlLoop is owned by one thread.
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "sparsecar/common/status.h"
#include "sparsecar/policies/cost_model.h"
#include "sparsecar/policies/goodput.h"
#include "sparsecar/policies/observations.h"
#include "sparsecar/policies/plan.h"
#include "sparsecar/policies/tensor_plan.h"

namespace sparsecar::policies {

// Observations (TensorStepObservation, NodeObservation, JobObservation, merge_observations):
// observations.h. The cost model (sparse_allgather_bytes, step_sparse_bytes, ...): cost_model.h.

// ---- what controllers change ------------------------------------------------------------------
// Mirrors the live knobs of the same names (daemon/config/knobs.h).
struct ControlKnobs {
  bool compression = true;
  kernels::Selector selector = kernels::Selector::kTopk;
  double density = 0.01;
  double threshold = 1e-3;
  double density_cap = 1.0;
  TensorScales tensor_scale;
  kernels::Format format = kernels::Format::kCoo;
  // The schedule's dense warm-up (`schedule_warmup_steps`): the step controller may end it early
  // where a dense step costs more than it is worth (StepSettings::warmup_cut).
  uint64_t schedule_warmup_steps = 0;
};
bool operator==(const ControlKnobs& a, const ControlKnobs& b);

// Each job-level controller's parameters, its part of ControllerSettings named after it. A field
// is the knob of its part's name plus the field's (`gradnorm.jump`: `gradnorm_jump`); fields whose
// knob has another prefix keep the whole knob name (`bandwidth.exchange_budget_ms`).
struct GradNormSettings {
  double jump = 2.0;           // norm / running mean above this = a jump
  double boost = 4.0;          // density multiplier after a jump
  uint64_t boost_steps = 20;
  uint64_t window = 20;        // steadiness window
  double steady_cv = 0.05;     // coefficient of variation below this = steady
  double steady_scale = 0.5;
  bool operator==(const GradNormSettings&) const = default;
};
struct FrequencySettings {
  double max_scale = 4.0;
  double alpha = 0.2;          // EMA weight of a tensor's new repeat fraction
  bool operator==(const FrequencySettings&) const = default;
};
struct BandwidthSettings {
  double exchange_budget_ms = 0;          // > 0: fixed exchange budget per step
  double exchange_budget_fraction = 1.0;  // else: this fraction of the reported compute time
  double margin = 0.15;                   // aim at (1 - margin) of the budget
  bool allow_dense = true;                // go dense (ring) when even that fits the budget
  uint64_t confirm_steps = 3;             // consecutive observations over budget (or room to grow)
                                          // before the bandwidth controller moves
  uint64_t hold_steps = 6;                // at least this many steps between its decisions
  double raise_max = 2.0;                 // a decision raises the density cap at most this factor
  double lower_max = 16.0;                // and lowers it at most this factor
  bool operator==(const BandwidthSettings&) const = default;
};
struct StepSettings {
  double slack = 0.1;          // the ring where it is the cheapest; else, within this of the least
                               // price, the sparse plan nearest the density asked for
  uint64_t confirm_steps = 3;  // consecutive observations that want the same change before it is made
  uint64_t hold_steps = 10;    // at least this many steps between two of its decisions
  double forget = 0.8;         // the link fits' weight of a step's samples at the next step
  bool allow_dense = true;     // the dense ring is a candidate
  double dense_worth = 1.3;    // a dense step does the work of this many sparse ones (price factor
                               // of sparse plans; 1 = step time alone). 1.3 since step v5's
                               // Fashion-MNIST runs (docs/controllers.md, "A job the controllers
                               // were not tuned on"); 2 before
  double dense_worth_corrected = 1.6;  // the same where the trainer's DDP hook corrects momentum
                               // (StartHint::momentum_corrected): a ring's lead then survives the
                               // switch to sparse (without, a ring -> sparse switch forfeited it:
                               // x1.01-1.13 top-k's steps). 100 ring steps then top-k did the work
                               // of 1.6 (small digits MLP) and 1.9 (large) top-k steps each
                               // (docs/controllers.md, "What a dense step is worth, in steps")
  double warmup_cut = 2.0;     // v6: the schedule's dense warm-up ends early once a ring step costs
                               // more than this many sparse steps of the density asked for (v8:
                               // also before it starts, on the trainer's StartHint). 2 since
                               // 2026-12-02: the most an early dense step was worth on any job
                               // here (the small digits MLP); 3 before, which ran the large
                               // model's ring at 1.8-2.6 sparse steps for nothing
                               // (docs/controllers.md, "The warm-up's cut at 2")
  bool operator==(const StepSettings&) const = default;
};
// The dense steps a sparse one is worth, its price factor (>= 1): `worth_corrected` where the
// trainer's DDP hook corrects momentum (step v21), else `worth` (step_dense_worth).
inline double sparse_step_worth(double worth, double worth_corrected, bool corrected) {
  const double w = corrected ? worth_corrected : worth;
  return w > 1.0 ? w : 1.0;
}

struct AccuracySettings {
  double tolerance = 0.02;     // relative loss gap that triggers a back-off
  double backoff = 2.0;        // density multiplier when behind
  double tighten = 0.9;        // density multiplier when on track (gap < tolerance / 2)
  uint64_t hold_steps = 5;     // steps between two moves (lets the last one show)
  double alpha = 0.3;          // EMA weight of a new relative gap / compression error / metric
  double error_bound = 0;      // compression error ||e|| / ||g|| kept below this; 0: calibrated
  double error_margin = 1.5;   // calibrated bound = this x the mean over the first calibrate_steps
  uint64_t calibrate_steps = 10;
  bool operator==(const AccuracySettings&) const = default;
};
struct BudgetSettings {
  double total_elements = 0;   // elements each node may send over the run (0 = off)
  uint64_t steps = 0;          // length of the run in steps
  double total_bytes = 0;      // instead of total_elements: bytes each node may send over the run
                               // (the most any node sent, headers and every copy included)
  double density = 0;          // > 0: a fixed density on average over the steps instead (the totals unused)
  double max_move = 2.0;       // a lambda move is at most this factor (after the first calibration)
  uint64_t settle_steps = 3;   // without magnitude histograms only: steps between two lambda moves
                               // (>= the decision latency, 2)
  bool operator==(const BudgetSettings&) const = default;
};

// Every controller parameter: the loop's own and those every controller may read here, each
// controller's in its part. Each is a knob (`active`: `controller`), and the knob table writes
// them (daemon/config/knobs.cc, through daemon/pipeline/settings.h).
struct ControllerSettings {
  ControllerSet active = 0;
  uint32_t world_size = 1;
  double density_min = 1e-5;
  double density_max = 1.0;
  uint64_t controller_interval_steps = 2;  // at least this many steps between two proposals
  double controller_hysteresis = 0.1;      // relative density change needed to propose (lambda: a quarter)
  uint64_t schedule_warmup_steps = 0;      // the schedule's dense warm-up (accuracy fits its trend)
  // Who reduces dense steps (the knob dense_collective): the step controller prices the ring by
  // the DDP hook's own dense iterations where the trainers reduce them (v11).
  Collective dense_collective = Collective::kRingAllReduce;
  // The link goodput estimate (goodput.h) that bandwidth and cost read.
  double goodput_smoothing = 0.3;      // EMA weight (log domain) of a new goodput / compute-time sample
  uint64_t goodput_confirm_steps = 2;  // consecutive samples beyond 2x on one side that move the
                                       // estimate at once (a step change of the link, not noise)
  GradNormSettings gradnorm;
  FrequencySettings frequency;
  BandwidthSettings bandwidth;
  AccuracySettings accuracy;
  BudgetSettings budget;
  StepSettings step;
  bool operator==(const ControllerSettings&) const = default;
};

// What one controller reports about itself (for status and metrics).
struct ControlStatus {
  bool failed = false;
  std::string failure;              // why the loop fell back to static
  uint64_t proposals = 0;
  std::string last_reason;
  uint64_t last_step = 0;           // step of the last observation used
  double goodput_Bps = 0;           // smoothed
  double exchange_budget_s = 0;     // 0 unknown
  double predicted_exchange_s = 0;  // for the knobs proposed/in force
  double accuracy_gap = 0;          // relative, smoothed
  double accuracy_target = 0;
  std::string accuracy_signal;      // what the accuracy controller acts on; "none: <why>" when nothing
  double compression_error = 0;     // smoothed ||e|| / ||g|| (accuracy's "compression error" signal)
  double compression_error_bound = 0;  // in force (0 while calibrating)
  double budget_used_elements = 0;
  double total_error = 0;           // Σ_t ||e_t||^2 since the loop started (hard-threshold paper)
  std::string step_model;           // the step controller's fits and prices ("" while it is off)
  double predicted_step_s = 0;      // its step time of the plan in force (trainer compute and the step's
                                    // overhead included)
  // Why a controller changed something this update (set by the controller, appended to the
  // proposal's reason and cleared by the loop): what the decision log line says beyond the change.
  std::string decision_note;
};

// What the trainer measured before the daemons' first step: its own dense iterations (the DDP
// hook runs the first ones through torch.distributed over the same link, then reports the last
// one's period and how long it waited on the all-reduce after its last bucket, as the metrics
// "dense_step_s" and "dense_wait_s"). Rank 0's loop hears it once per job, before any
// observation.
struct StartHint {
  uint64_t step = 0;          // the first step the daemons will see
  double dense_step_s = 0;    // one dense step, the exchange included
  double dense_wait_s = 0;    // of it, the wait on the exchange after the backward pass
  bool momentum_corrected = false;  // the hook corrects momentum (metric "momentum_correction" 1,
                                    // before the timing): sparse steps priced x dense_worth_corrected
};

// Shared per-step context for the controllers.
struct ControlContext {
  const ControllerSettings& settings;
  const JobObservation& obs;
  const ControlKnobs& base;  // the operator's knobs
  double goodput_Bps = 0;    // smoothed link estimate (0 unknown)
  ControlStatus* status = nullptr;
  const ControlKnobs* in_force = nullptr;  // the newest decided knobs (a move's reference); may be null
};

class Controller {
 public:
  virtual ~Controller() = default;
  virtual ControllerKind kind() const = 0;
  virtual uint32_t version() const = 0;
  // Refines *knobs (holding the previous controllers' proposal). Errors make the loop fall back.
  virtual Status update(const ControlContext& ctx, ControlKnobs* knobs) = 0;
  // Before the first step (ctx.obs is empty but for its step): the trainer's StartHint. A change
  // made here is in force from the job's first step where rank 0 has not started it yet.
  virtual Status before_start(const ControlContext& /*ctx*/, const StartHint& /*hint*/, ControlKnobs* /*knobs*/) {
    return Status::Ok();
  }
};
// A new job-level controller of `kind` (its registry row's factory), or null for the per-tensor
// ones (static, schedule, layerwise: tensor_plan.h).
std::unique_ptr<Controller> make_controller(ControllerKind kind);

// ---- the controller registry --------------------------------------------------------------------
// One row per controller (policies/src/controllers.cc): its kind, its name (the word of the
// `controller` knob), a one-line doc, whether rank 0's ControlLoop runs it, its factory and the
// knobs it reads. The rows are in the order the ControlLoop chains the job-level controllers.
// Derived from them: controller_name / parse_controllers / format_controllers, the `controller`
// knob's doc, make_controller and the ControlLoop's order (adding one: the top of this header).
struct ControllerInfo {
  ControllerKind kind;
  const char* name;
  const char* doc;
  bool job_level;                         // rank 0's ControlLoop runs it (else: per-tensor plans)
  std::unique_ptr<Controller> (*make)();  // job-level rows; null for the per-tensor ones
  const char* knobs;                      // the knobs only it reads, ' '-separated; "x_*" = a prefix
};
// Every controller once, in chain order (the per-tensor ones first).
std::span<const ControllerInfo> controller_registry();
// The row of `kind`, or null for a value no row has.
const ControllerInfo* find_controller(ControllerKind kind);
// "static|schedule|...": every name in ControllerKind order.
std::string controller_choices();
// The job-level rows' kinds: the controllers rank 0's ControlLoop runs (and feeds with what every
// node measures).
ControllerSet job_level_controllers();

// ---- the loop -------------------------------------------------------------------------------
class ControlLoop {
 public:
  struct Proposal {
    ControlKnobs knobs;
    std::string reason;  // "controller bandwidth,accuracy: ..."
  };

  // One step's observation (steps increasing). `base`: the operator's knobs; `in_force`: the
  // newest decided knobs. Returns a proposal when the chain wants a change that passes the rate
  // limit and hysteresis. After a failure it proposes `base` once and then nothing.
  std::optional<Proposal> update(const ControllerSettings& settings, const JobObservation& obs,
                                 const ControlKnobs& base, const ControlKnobs& in_force);

  // The trainer's StartHint, before any observation of the job: a proposal (from `in_force`)
  // when a controller changes something on it.
  std::optional<Proposal> before_start(const ControllerSettings& settings, const StartHint& hint,
                                       const ControlKnobs& base, const ControlKnobs& in_force);

  const ControlStatus& status() const { return status_; }

 private:
  // Calls `call` on every active job-level controller in chain order (made on first use; a
  // deactivated one dropped), appending the names of those that ran (changed_only: that changed
  // *k) to *names. False after a failure, recorded in status_ ("<name> vN<when><step>: why").
  bool run_chain(const ControllerSettings& settings, uint64_t step, const char* when, ControlKnobs* k,
                 std::string* names, bool changed_only, const std::function<Status(Controller&, ControlKnobs*)>& call);
  std::optional<Proposal> propose_change(const ControllerSettings& settings, uint64_t step, const std::string& names,
                                         ControlKnobs k, const ControlKnobs& in_force, const char* when);
  std::array<std::unique_ptr<Controller>, kControllerKindCount> controllers_{};
  ControlStatus status_;
  GoodputEstimator goodput_;
  bool proposed_ = false;
  uint64_t last_proposal_step_ = 0;
  bool fallback_sent_ = false;
};

}  // namespace sparsecar::policies
