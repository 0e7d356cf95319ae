// Pipeline: turns each StepJob (the local dense sum of one tensor step) into the job-wide
// average, through error feedback, selection, encoding and a collective.
//
//   local sum -> plan (policy) -> residual += sum -> select (top-k | threshold) -> residual -= sent
//             -> encode (COO) -> sparse all-gather | dense ring all-reduce -> decode + sum
//             -> scale 1/(trainers in the job) -> StepResult
//
// Before the first step of a job, the nodes agree: every node sends rank 0 a manifest (its
// tensors in registration order, its local trainer count and its `agreed` knobs); rank 0
// compares them and answers every node with "ok <total trainers>" or the first difference. A
// disagreement fails the step on every node with that message.
//
// Nothing is lost: if a step fails, what this node selected goes back into its residual.
//
// Threads: one pipeline thread (start()) runs every step in submission order. The StepSink
// methods are called from the session thread and only queue work.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <variant>
#include <vector>

#include "daemon/collective/mailbox.h"
#include "daemon/pipeline/compressor.h"
#include "daemon/pipeline/decisions.h"
#include "daemon/pipeline/observations.h"
#include "daemon/pipeline/step.h"
#include "daemon/transport/transport.h"
#include "sparsecar/policies/plan.h"
#include "sparsecar/policies/tensor_plan.h"

namespace sparsecar {

class Metrics;

struct PipelineOptions {
  uint32_t rank = 0;
  uint32_t world_size = 1;
  uint64_t job_id = 0;
  uint32_t local_clients = 1;
  policies::StaticSettings settings;
  std::string agreed_knobs;  // knobs.h agreed_knobs(): compared across nodes at the first step
  std::chrono::milliseconds step_timeout{30000};
  std::chrono::milliseconds join_timeout{120000};
};

class Pipeline final : public StepSink {
 public:
  // `transport` may be null only when world_size == 1. `decisions` may be null: then the plan
  // inputs are options.settings for ever (epoch 0). All pointers must outlive the pipeline.
  Pipeline(const PipelineOptions& options, Transport* transport, Mailbox* mailbox, Metrics* metrics,
           DecisionBoard* decisions = nullptr);
  ~Pipeline() override;

  // Must be called before start().
  void set_result_sink(StepResultSink* sink) { sink_ = sink; }
  // Optional; before start(). Sees every tensor step and trainer metric (observations.h).
  void set_observer(StepObserver* observer) { observer_ = observer; }
  void start();
  // Answers queued jobs with kAborted, stops the thread. Idempotent.
  void stop();

  // StepSink (session thread).
  Status register_tensor(uint32_t tensor_id, const TensorSpec& spec) override;
  void submit(const StepJob& job) override;
  void report_metric(const std::string& name, double value, uint64_t step) override;
  void reset() override;

  struct TensorState;

 private:
  struct Reset {};
  struct Register {
    uint32_t id;
    TensorSpec spec;
  };
  using Command = std::variant<Register, StepJob, Reset>;

  void run();
  StepResult process(const StepJob& job);
  Status run_step(TensorState& t, const StepJob& job, const Decision& decision, StepResult* result);
  Status agree_on_job(std::chrono::steady_clock::time_point deadline);
  std::string manifest() const;
  void fail_queued(std::deque<Command>& queue, const std::string& why);

  const PipelineOptions options_;
  Transport* const transport_;
  Mailbox* const mailbox_;
  Metrics* const metrics_;
  DecisionBoard* const decisions_;
  StepResultSink* sink_ = nullptr;
  StepObserver* observer_ = nullptr;

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Command> queue_;  // guarded by mu_
  bool stopping_ = false;      // guarded by mu_
  uint32_t registered_ = 0;    // guarded by mu_: tensors announced since the last reset
  bool job_started_ = false;   // guarded by mu_: a step was submitted since the last reset

  // Pipeline-thread state.
  std::vector<std::shared_ptr<TensorState>> tensors_;
  std::shared_ptr<const Config> plan_config_;  // the decision config plan_settings_ came from
  policies::PlanSettings plan_settings_;
  bool agreed_ = false;
  uint32_t total_trainers_ = 0;
  std::thread thread_;
};

}  // namespace sparsecar
