// Pipeline: turns each StepJob (the local dense sum of one tensor step) into the job-wide
// average, through error feedback, selection, encoding and a collective.
//
//   local sum -> plan (policy) -> residual += sum -> select (top-k | threshold) -> residual -= sent
//             -> encode (COO) -> sparse all-gather | dense ring all-reduce -> decode + sum
//             -> scale 1/(trainers in the job) -> StepResult
//
// Before the first step of a job, the nodes agree: every node sends rank 0 a manifest (its
// tensors in registration order, its local trainer count and its `agreed` knobs) under a fresh
// random attempt nonce; rank 0 compares them, draws the job's random incarnation and answers
// every node with "ok <total trainers>" (the ack carries the incarnation and echoes the node's
// nonce, so an ack meant for an earlier attempt is never taken) or the first difference. A
// disagreement fails the step on every node with that message. Every data and abort message of
// the job carries the incarnation; the mailbox drops those of any other (mailbox.h).
//
// Nothing is lost: if a step fails, what this node selected goes back into its residual.
//
// Operations (control socket): checkpoint() of every tensor's residual runs on the pipeline
// thread between steps, queued like steps. restore() reads and validates the file on the calling
// thread (regular files of exactly the size the registered tensors imply: checkpoint.h) and only
// the copy into the residuals runs on the pipeline thread. drain() makes submit() refuse new
// steps (kUnavailable) and waits until the steps queued before it are answered.
//
// Operations queued for the pipeline thread (call_on_thread) wait at most until their deadline
// for the thread to *start* them: one not started by then is never run (kDeadlineExceeded, "not
// run"). Once started it is not abandonable: the waiter waits for it to finish and returns its
// real outcome, so a caller never sees a failure for an operation that took effect. Operations
// are short (a residual copy, a checkpoint write) for that reason.
//
// Checkpoint file format: checkpoint.h. restore() requires the same rank and the same tensors
// (names, sizes, order) as registered now.
//
// Steps failed job-wide: fail_step() (session thread, a local trainer died) queues an abort that
// the pipeline thread broadcasts to every peer in queue order, so peers waiting for this node's
// part of (tensor, step) fail at once with this node's reason.
//
// Time: the pipeline reads time (stage timings, step and join deadlines) only through the Clock it
// is given, and hands it to the parts it runs (job agreement, compressors, collectives). Deadlines
// given to checkpoint(), restore() and drain() are times on that clock; waits for them are
// bounded real-time slices (clock_wait.h).
//
// Threads: one pipeline thread (start()) runs every step in submission order. The StepSink
// methods are called from the session thread and only queue work. checkpoint(), restore(),
// drain(), snapshot() may be called from any other thread (the control thread).
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "daemon/collective/collective.h"
#include "daemon/collective/mailbox.h"
#include "daemon/pipeline/checkpoint.h"
#include "daemon/pipeline/compressor.h"
#include "daemon/pipeline/decisions.h"
#include "daemon/pipeline/job_agreement.h"
#include "daemon/pipeline/observations.h"
#include "daemon/pipeline/progress.h"
#include "daemon/pipeline/settings.h"
#include "daemon/pipeline/step.h"
#include "daemon/transport/transport.h"
#include "sparsecar/common/clock.h"
#include "sparsecar/kernels/parallel.h"
#include "sparsecar/policies/plan.h"
#include "sparsecar/policies/tensor_plan.h"

namespace sparsecar {

class Metrics;

// What status shows about the pipeline (a consistent copy).
struct PipelineSnapshot {
  bool has_step = false;
  uint64_t last_step = 0;   // newest step started on this node
  uint64_t queued = 0;      // commands waiting for the pipeline thread
  bool draining = false;
  uint32_t total_trainers = 0;
  ProgressTotals job;          // this job's steps and bytes (progress.h); zero between jobs
  ProgressTotals since_start;  // every job of this daemon, the current one included
  struct Group {
    uint32_t tensors = 0;
    uint64_t elements = 0;
    uint64_t selected = 0;                  // in each tensor's latest step
    double residual_norm2 = 0;              // Σ residual² after each tensor's latest step
    std::map<std::string, uint32_t> plans;  // policies::describe(plan) -> tensors using it
  };
  std::vector<std::pair<std::string, Group>> groups;  // by tensor group name, fixed order
};

struct CheckpointInfo {
  uint32_t tensors = 0;
  uint64_t elements = 0;
  uint64_t bytes = 0;
  double residual_norm = 0;  // L2 norm over every tensor
};

struct PipelineOptions {
  uint32_t rank = 0;
  uint32_t world_size = 1;
  uint64_t job_id = 0;
  uint32_t local_clients = 1;
  policies::StaticSettings settings;
  std::string agreed_knobs;  // knobs.h agreed_knobs(): compared across nodes at the first step
  std::chrono::milliseconds step_timeout{30000};
  std::chrono::milliseconds join_timeout{120000};
  uint32_t kernel_threads = 1;  // > 1: the pipeline owns a kernels::ThreadPool of this size
  // progress_log_seconds at start; a decision epoch that changes it takes over (progress.h).
  std::chrono::milliseconds progress_interval{10000};
  // The knob trainer_lease without a decision board (with one, the decision in force has it).
  uint64_t trainer_lease = 0;
};

class Pipeline final : public StepSink {
 public:
  // `transport` may be null only when world_size == 1. `decisions` may be null: then the plan
  // inputs are options.settings for ever (epoch 0). All pointers and `clock` (the mailbox's) must
  // outlive the pipeline.
  Pipeline(const PipelineOptions& options, Transport* transport, Mailbox* mailbox, Metrics* metrics,
           DecisionBoard* decisions = nullptr, const Clock& clock = steady_clock());
  ~Pipeline() override;

  // Must be called before start().
  void set_result_sink(StepResultSink* sink) { sink_ = sink; }
  // Optional; before start(). Sees every tensor step and trainer metric (observations.h); must
  // outlive the pipeline thread (it is called until stop() returns).
  void set_observer(StepObserver* observer) { observer_ = observer; }
  void start();
  // Answers queued jobs with kAborted, stops the thread. Idempotent.
  void stop();

  // StepSink (session thread).
  Status register_tensor(uint32_t tensor_id, const TensorSpec& spec) override;
  uint64_t tensor_footprint_bytes(const TensorSpec& spec) const override;
  void fail_step(uint32_t tensor_id, uint64_t step, const std::string& reason) override;
  void submit(const StepJob& job) override;
  void report_metric(const std::string& name, double value, uint64_t step) override;
  void reset() override;

  // Control operations (any thread but the pipeline thread). Each waits at most until
  // `deadline`; a request given up on is never run later.
  Expected<CheckpointInfo> checkpoint(const std::string& path, Clock::time_point deadline);
  Expected<CheckpointInfo> restore(const std::string& path, Clock::time_point deadline);
  // Refuses new steps from now on and waits for the queued ones (kDeadlineExceeded if they are
  // not done in time; draining stays on). undrain() accepts steps again.
  Status drain(Clock::time_point deadline);
  void undrain();
  PipelineSnapshot snapshot() const;
  // Tests: runs on the pipeline thread as each control operation starts (before it runs), e.g. to
  // make one outlast its waiter's deadline. Set before start().
  void set_call_started_hook_for_test(std::function<void()> hook) { call_started_hook_ = std::move(hook); }

  struct TensorState;

 private:
  struct Reset {};
  struct Register {
    uint32_t id;
    TensorSpec spec;
  };
  // A control operation run on the pipeline thread between steps (shared with its waiter).
  struct Call {
    struct State {
      std::mutex mu;
      std::condition_variable cv;
      bool started = false;    // guarded by mu: the pipeline thread runs it; no abandoning now
      bool done = false;       // guarded by mu
      bool abandoned = false;  // guarded by mu: the waiter gave up before it started, do not run
      Status status;           // guarded by mu
    };
    std::shared_ptr<State> state;
    std::function<Status()> fn;
  };
  // A step this node will never hand over: broadcast an abort for it (fail_step()).
  struct FailStep {
    uint32_t tensor_id;
    uint64_t step;
    std::string reason;
  };
  using Command = std::variant<Register, StepJob, Reset, Call, FailStep>;

  Status call_on_thread(std::function<Status()> fn, Clock::time_point deadline);
  // Pipeline thread: the Call and FailStep commands.
  void run_call(Call& call);
  void run_fail_step(const FailStep& fail);
  Status write_checkpoint(const std::string& path, CheckpointInfo* info);
  // Pipeline thread: copies a checkpoint read by restore() into the residuals.
  Status read_checkpoint(const std::string& path, const std::vector<TensorSpec>& specs,
                         const LoadedCheckpoint& file, CheckpointInfo* info);
  // norm2: the residual's ||e||^2 after the step (0 after a dense step, which empties it); none: a
  // sparse host step's, which settle_residual_norm() adds once the result went out.
  void record_step_metrics(TensorState& t, const policies::Plan& plan, const StepResult& r, std::optional<double> norm2);
  // Pipeline thread, after a step's result went to its trainer: the residual's norm of the
  // tensor's last sparse host step (the metrics, the observer's on_residual_norm2), if not read yet.
  void settle_residual_norm(TensorState& t);

  void run();
  StepResult process(const StepJob& job);
  Status run_step(TensorState& t, const StepJob& job, const Decision& decision, StepResult* result);
  // run_step() of a device tensor (DESIGN §8): DeviceCompressor + sparse_allgather_each.
  Status run_device_step(TensorState& t, const StepJob& job, const Decision& decision, StepResult* result);
  // When the parts of a step happened (TensorStepRecord's encode and exchange times).
  struct StepTimes {
    Clock::time_point encode_started, exchange_started, exchange_ended;
  };
  policies::TensorObservation observation(const TensorState& t, const StepJob& job) const;
  // While a device step waits for its peers: compresses the next queued device step (another
  // tensor) ahead, so that its compression overlaps this step's exchange.
  void prepare_next_device_step(uint32_t current_tensor);
  // The plan of a tensor step under `decision` (adopts a new decision config first).
  policies::Plan plan_for(const policies::TensorObservation& obs, const Decision& decision);
  void observe_compression(const policies::Plan& plan, Clock::time_point compress_started, double encode_seconds);
  void count_messages(const policies::Plan& plan, kernels::Format sent, const ExchangeStats& stats);
  void observe_step(TensorState& t, const StepJob& job, const Decision& decision, const policies::Plan& plan, bool ok,
                    const StepResult& result, const ExchangeStats& stats, const StepTimes& times,
                    std::span<const float> local_sum, std::span<const float> residual,
                    std::span<const float> selected, double grad_norm2 = -1, double residual_norm2 = -1,
                    std::span<const uint64_t> magnitude_hist = {}, std::span<const uint64_t> gradient_hist = {});
  // Whether a job-level controller runs under `decision` (it needs the norms measured).
  bool controllers_listen(const Decision& decision);
  // Whether `budget` runs under `decision` (it needs the magnitude histograms; the host path's
  // ObservationCollector makes them from the record's spans, the device path on the GPU).
  bool budget_listens(const Decision& decision);
  // A successful step's metrics (residual_norm2: as record_step_metrics' norm2).
  void finish_step(TensorState& t, const policies::Plan& plan, const StepResult& result, const ExchangeStats& stats,
                   std::optional<double> residual_norm2);
  Status agree_on_job(Clock::time_point deadline);
  // This job's identity for a collective or an abort under `epoch`, deadline one step_timeout
  // from now (pipeline thread).
  ExchangeContext exchange_context(uint32_t epoch) const;
  std::string manifest() const;
  // dense_collective=trainer: whether this step goes to the trainers' own all-reduce; alike on
  // every node (the plan's knob and trainers_reduce_ are agreed). kFailedPrecondition when the
  // job's trainers said they reduce and this step's did not.
  Expected<bool> by_trainers(const policies::Plan& plan, const StepJob& job);
  // A trainer-reduced step of a job that takes leases: how many of the tensor's next steps (at
  // most the knob trainer_lease, and 2^(n-1) for the n-th such step in a row) are
  // trainer-reduced dense steps too under `decision` (the plan is a function of the decision and
  // the step; StepResult::lease_steps).
  uint32_t trainer_lease(const TensorState& t, const StepJob& job, const Decision& decision);
  // Before a step of `t` is run: the steps the trainers ran under the last one's lease
  // (steps_total{result="leased"}), and their pace: trainer-reduced steps that got
  // kLeaseSlowerRestarts x slower per step than before (the trainers' link slowed, or a pause)
  // restart the lease's slow start, so that the controllers see the next steps soon.
  void follow_lease(TensorState& t, const StepJob& job);
  static constexpr double kLeaseSlowerRestarts = 2.0;
  void fail_queued(std::deque<Command>& queue, const std::string& why);
  // Pipeline thread (or stop() after it ended): logs the job's summary line, folds its totals into
  // the daemon's and starts fresh ones.
  void end_job_progress(const char* why);

  const PipelineOptions options_;
  // Workers the selection kernels split large tensors over (kernel_threads > 1; else null).
  // Declared before the tensors, whose compressors hold a pointer to it.
  std::unique_ptr<kernels::ThreadPool> kernel_pool_;
  Transport* const transport_;
  Mailbox* const mailbox_;
  Metrics* const metrics_;
  DecisionBoard* const decisions_;
  const Clock& clock_;
  JobAgreement agreement_;  // the first-step agreement; rank 0 also answers replacements with it
  StepResultSink* sink_ = nullptr;
  StepObserver* observer_ = nullptr;
  std::function<void()> call_started_hook_;  // tests only (set_call_started_hook_for_test)

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Command> queue_;  // guarded by mu_
  bool stopping_ = false;      // guarded by mu_
  uint32_t registered_ = 0;    // guarded by mu_: tensors announced since the last reset
  bool job_started_ = false;   // guarded by mu_: a step was submitted since the last reset
  // Specs of the tensors registered in this job, by id (a registration of id 0 starts a new
  // list): what restore() validates a checkpoint against off the pipeline thread.
  std::vector<TensorSpec> registered_specs_;  // guarded by mu_

  std::atomic<bool> draining_{false};

  // What snapshot() reports; written by the pipeline thread once per tensor step.
  mutable std::mutex stats_mu_;
  PipelineSnapshot stats_;  // guarded by stats_mu_ (groups indexed by TensorGroup)

  // Pipeline-thread state.
  std::vector<std::shared_ptr<TensorState>> tensors_;
  PooledThreshold pooled_;  // the hybrid selector's global lambda (structured_select.h)
  std::shared_ptr<const Config> plan_config_;  // the decision config plan_settings_ came from
  std::shared_ptr<const Config> listen_config_;  // controllers_listen() parsed this one
  bool listen_ = false;
  bool listen_budget_ = false;
  policies::PlanSettings plan_settings_;       // options.settings until a decision config arrives
  OverridesCache overrides_cache_;             // tensor_overrides parsed once per distinct text
  bool agreed_ = false;
  bool restored_ = false;     // residuals came from a checkpoint in this job (restore())
  uint64_t incarnation_ = 0;  // the agreed job's incarnation (mailbox.h); 0 until agreed
  uint32_t total_trainers_ = 0;
  // Whether this node's trainers all-reduce dense steps themselves (the job's first step's
  // StepJob::trainer_reduces; its manifest line), and whether the job's all do (the AND over the
  // nodes, AgreedJob::trainers_reduce: equal on every node); and whether the knob asking for it
  // without them was logged in this job.
  bool node_trainers_reduce_ = false;
  bool trainers_reduce_ = false;
  bool ring_instead_logged_ = false;
  JobProgress progress_;           // the progress lines and the job summary (progress.h)
  struct Overlap {
    uint64_t steps = 0;   // device steps compressed while the previous one was on the wire
    double seconds = 0;   // the time those compressions took (hidden behind the exchange)
  };
  Overlap overlap_;  // this job's; logged with the job summary
  ProgressTotals finished_jobs_;   // totals of the jobs before this one
  std::thread thread_;
};

}  // namespace sparsecar
