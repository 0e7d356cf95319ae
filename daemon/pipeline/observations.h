// Observations: what each node measures per step for the controllers, and how it reaches rank 0.
//
//   pipeline thread ── on_tensor_step() ──► ObservationCollector ── one NodeObservation per step
//        (bytes, exchange and encode time,       │   rank 0: ControllerRunner::add() + poll()
//         link bytes/busy time from send          └── other ranks: kObservation message to rank 0
//         completions, norms, repeat of the selection)
//   after each step's result (after_complete): the link probe (LinkProbe, link_probe.h) while the
//        step controller may want the ring and a sparse plan runs
//   session thread ── on_metric() ──► latest trainer metrics (loss, its target, compute time)
//        (rank 0: "dense_step_s" after "dense_wait_s", with "momentum_correction" before them
//         ──► ControllerRunner::start_hint())
//
// Measurements cost nothing unless a controller needs them: norms (two passes over the tensor)
// only while a rank-0 controller is active in the decision in force, the selection repeat (one
// more pass and a bitmap per tensor) only while `frequency` is, the magnitude histograms (two
// more passes, over the residual and the local sum, plus the selected values; a device tensor's
// made on its GPU, DeviceCompressor::measure_magnitudes) only while `budget` is.
//
// Threads: on_tensor_step/on_reset on the pipeline thread; on_metric on the session thread
// (guarded by a mutex). Messages go out through the Transport (any thread may send).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "daemon/pipeline/decisions.h"
#include "daemon/pipeline/link_probe.h"
#include "daemon/transport/transport.h"
#include "sparsecar/common/clock.h"
#include "sparsecar/common/status.h"
#include "sparsecar/policies/controllers.h"

namespace sparsecar {

class ControllerRunner;

// One tensor step as the pipeline saw it. Spans are valid during the call only.
struct TensorStepRecord {
  uint32_t tensor_id = 0;
  uint64_t step = 0;
  uint32_t tensors_in_job = 1;  // tensors registered: a step is complete after this many records
  uint64_t elements = 0;
  bool on_device = false;  // compressed on a GPU (the device path), not by the host's cores
  bool trainer_reduced = false;  // a dense step the trainers all-reduced (dense_collective=trainer)
  uint32_t lease_steps = 0;      // StepResult::lease_steps: the trainers may skip this many next steps
  bool ok = true;
  policies::Plan plan;
  uint64_t nnz = 0;
  uint64_t bytes_sent = 0;
  uint64_t dense_bytes = 0;
  double exchange_s = 0;
  double encode_s = 0;
  double decode_s = 0;  // ExchangeStats::decode_seconds / reduce_seconds
  double reduce_s = 0;
  uint64_t link_bytes = 0;  // ExchangeStats::link_bytes / link_seconds: goodput from completions
  double link_s = 0;
  std::span<const float> local_sum;
  std::span<const float> residual;  // after commit/rollback
  // The values selected this step (sparse steps; empty when unknown): with the residual after the
  // commit they are the step's pre-selection |residual + g| (the selected coordinates' residual
  // is zero, or the small quantisation error of a narrower value type).
  std::span<const float> selected;
  // Device tensors: their squared norms measured on the GPU (the spans are empty); < 0: from the
  // spans. kNormLater: the residual's, a host step's, comes through on_residual_norm2() once the
  // step's result went out.
  static constexpr double kNormLater = -2;
  double grad_norm2 = -1;
  double residual_norm2 = -1;
  // Device tensors while `budget` listens: the step's magnitude histograms measured on the GPU
  // (policies::kMagnitudeBins each: |residual + g| before the selection, and |g|); empty when not
  // measured (the host path: made from the spans above).
  std::span<const uint64_t> magnitude_hist;
  std::span<const uint64_t> gradient_hist;
};

// The pipeline's view of whoever watches its steps (tests record plans through it).
class StepObserver {
 public:
  virtual ~StepObserver() = default;
  // Pipeline thread, after every tensor step (failed ones included), under `decision`.
  virtual void on_tensor_step(const TensorStepRecord& record, const Decision& decision) = 0;
  // Session thread: a trainer reported a named scalar.
  virtual void on_metric(const std::string& name, double value, uint64_t step) = 0;
  // Pipeline thread: job reset.
  virtual void on_reset() = 0;
  // Pipeline thread, after a tensor step's result went to its trainer and before after_complete():
  // the squared norm of its residual, for a record that said TensorStepRecord::kNormLater.
  virtual void on_residual_norm2(uint32_t /*tensor_id*/, uint64_t /*step*/, double /*norm2*/) {}
  // Pipeline thread, after a tensor step's result went to its trainer: the work the step need not
  // wait for (rank 0's controllers, an observation's send to rank 0). A wrapper forwards both.
  virtual void after_complete() {}
};

// NodeObservation <-> the kObservation payload ("key value" lines, "lk peer bytes seconds" lines
// (link samples), then "tensor id elements nnz repeat" lines). parse rejects unknown shapes with kDataLoss.
std::string format_observation(const policies::NodeObservation& o);
Expected<policies::NodeObservation> parse_observation(std::string_view text);

// NodeObservation::compute_s from the trainers' latest metrics (name -> value): "compute_time"
// (s), else "compute_time_ms", else "step_time_ms", else the DDP hook's own timing of the trainer
// on CPU buckets, "hook_compute_time" (s; the trainer's own report wins where it makes one).
// -1: none reported.
double trainer_compute_s(const std::map<std::string, double>& metrics);

// NodeObservation::period_s: the wall time between two consecutive steps finishing on a node.
// After a step that leased the trainers the next `lease` steps (StepResult::lease_steps), the
// next step seen may be any of the `lease + 1` after it: the trainers ran the ones between
// themselves, and the period is the mean over all of them.
class StepPeriod {
 public:
  // Step `step` finished at `now`: seconds since step - 1 finished (or the mean per step since
  // the last one, across the steps it leased), or 0 (the first step seen, a gap in the steps, a
  // clock that did not move forward). `lease`: the steps after `step` the trainers may skip.
  double on_finish(uint64_t step, Clock::time_point now, uint32_t lease = 0);
  void reset() { has_last_ = false; }

 private:
  bool has_last_ = false;
  uint64_t last_step_ = 0;
  uint32_t lease_ = 0;
  Clock::time_point last_;
};

class ObservationCollector final : public StepObserver {
 public:
  // `runner` is set on rank 0 only; `transport` may be null when world_size == 1; `metrics` (the
  // link probe's counts) may be null. `clock` (period_s, the probe's timing) must outlive the
  // collector and the transport's callbacks.
  ObservationCollector(uint32_t rank, uint64_t job_id, Transport* transport, ControllerRunner* runner,
                       const Clock& clock = steady_clock(), Metrics* metrics = nullptr);

  void on_tensor_step(const TensorStepRecord& record, const Decision& decision) override;
  void on_metric(const std::string& name, double value, uint64_t step) override;
  void on_reset() override;
  // The observations of the steps that finished since the last call go to rank 0's controllers
  // (runner_->poll(): ~0.1 ms of pricing a step) or are sent to rank 0. Not in on_tensor_step:
  // the step's result would wait for them (the pipeline completes a step after observing it).
  void on_residual_norm2(uint32_t tensor_id, uint64_t step, double norm2) override;
  void after_complete() override;

  // Observations finished so far (for tests and status).
  uint64_t finished() const { return finished_; }
  // Link probes sent so far (for tests).
  uint64_t probes_sent() const { return probe_.sent(); }

 private:
  // The budget controller's histograms (policies::NodeObservation::magnitude_hist): this
  // record's magnitudes into the current step's.
  void add_magnitudes(const TensorStepRecord& record, const Decision& decision);
  void finish(const Decision& decision);
  // `hint_wait_s`, `hint_step_s`: the trainers' dense iterations' wait on the all-reduce and
  // their step, reported since the last step (0: none); `corrected`: the trainer's hook corrects
  // momentum (step_dense_worth_corrected prices its sparse steps).
  LinkProbe::StepFacts probe_facts(const policies::NodeObservation& o, const Decision& decision,
                                   double hint_wait_s, double hint_step_s, bool corrected) const;
  void send_to_rank0(const policies::NodeObservation& o);

  const uint32_t rank_;
  const uint64_t job_id_;
  Transport* const transport_;
  ControllerRunner* const runner_;
  const Clock& clock_;

  // Pipeline thread.
  std::optional<policies::NodeObservation> current_;
  std::vector<policies::NodeObservation> ready_;  // finished, for after_complete()
  uint32_t records_ = 0;
  uint32_t expected_records_ = 0;
  bool magnitudes_incomplete_ = false;  // a record of the current step could not be histogrammed
  uint32_t lease_ = 0;  // the least StepResult::lease_steps of the current step's records
  std::map<uint32_t, std::vector<uint64_t>> last_selected_;  // tensor -> bitmap of last step's zeros
  uint64_t finished_ = 0;
  StepPeriod period_;
  std::shared_ptr<const Config> active_config_;  // the decision config active_ was parsed from
  policies::ControllerSet active_ = 0;
  LinkProbe probe_;
  std::optional<LinkProbe::StepFacts> probe_facts_;  // of the last finished step, for after_complete()

  // Session thread -> pipeline thread.
  std::mutex mu_;
  std::map<std::string, double> metrics_;  // guarded by mu_: latest value per name (capped)
  std::optional<std::pair<uint64_t, double>> dense_wait_;  // guarded by mu_: "dense_wait_s" (step, value)
  double hint_wait_s_ = 0;  // guarded by mu_: the last start hint's dense_wait_s, until a step takes it
  double hint_step_s_ = 0;  // guarded by mu_: and its dense_step_s
  bool corrected_ = false;  // guarded by mu_: "momentum_correction" 1 (the hook's), this job
};

}  // namespace sparsecar
