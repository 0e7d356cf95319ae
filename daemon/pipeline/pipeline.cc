#include "daemon/pipeline/pipeline.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <optional>
#include <cmath>
#include <cstring>
#include <sstream>

#include "daemon/collective/collective.h"
#include "daemon/metrics/metrics.h"
#include "daemon/pipeline/checkpoint.h"
#include "daemon/pipeline/device_compressor.h"
#include "daemon/pipeline/job_agreement.h"
#include "daemon/pipeline/settings.h"
#include "sparsecar/common/clock_wait.h"
#include "sparsecar/common/log.h"
#include "sparsecar/kernels/codec.h"
#include "sparsecar/kernels/parallel.h"
#include "sparsecar/kernels/select.h"

namespace sparsecar {

// Per-tensor state: the compressor (residual and buffers, sized at registration: on the host, or
// on the GPU for a device tensor) and the step order check.
struct Pipeline::TensorState {
  TensorState(uint32_t id_, const TensorSpec& spec_, kernels::ThreadPool* pool, uint32_t world, const Clock& clock)
      : id(id_), spec(spec_) {
    if (spec.on_device) {
      device = std::make_unique<DeviceCompressor>(id, spec, world, clock);
    } else {
      host = std::make_unique<TensorCompressor>(id, spec, pool, clock);
    }
  }
  const uint32_t id;
  const TensorSpec spec;
  std::unique_ptr<TensorCompressor> host;    // host tensors
  std::unique_ptr<DeviceCompressor> device;  // device tensors (spec.on_device)
  std::string device_plan_notes;             // the last substitution logged (device_plan())
  // A device step compressed ahead, while the previous step was on the wire (overlap).
  struct Prepared {
    uint64_t step = 0;
    uint64_t generation = 0;
    uint32_t epoch = 0;
    policies::Plan plan;
    Status status;  // a failed compression: the step fails with it (its gradient is in the residual)
    DeviceCompressor::Encoded encoded;
    double seconds = 0;  // the compression's time
  };
  std::optional<Prepared> prepared;
  // The residual on the host: the host compressor's, or the device's copied down (checkpoints).
  std::vector<float> residual_copy;
  Expected<std::span<const float>> residual() {
    if (host) return host->residual();
    SC_RETURN_IF_ERROR(device->read_residual(&residual_copy));
    return std::span<const float>(residual_copy);
  }
  double residual_norm2() {
    if (host) return host->residual_norm2();
    double s = 0;
    for (float v : residual_copy) s += static_cast<double>(v) * v;
    return s;
  }
  bool has_step = false;
  uint64_t last_step = 0;
  // Trainer-reduced steps in a row, this one included (the lease's slow start: trainer_lease()).
  uint32_t trainer_steps = 0;
  uint32_t lease = 0;  // the last step's StepResult::lease_steps (steps_total{result="leased"})
  Clock::time_point handled{};  // when the pipeline took the last step
  double pace = 0;              // seconds per trainer-reduced step, smoothed (follow_lease); 0 unknown
  // Latest step, for metrics and status (pipeline thread).
  uint64_t last_selected = 0;
  double last_norm2 = 0;
  double last_lambda = 0;
  std::string plan;
  // A sparse host step's residual norm is read after its result went out (settle_residual_norm):
  // a pass over the residual that the trainers need not wait for.
  bool norm_due = false;
  uint64_t norm_step = 0;
};

namespace {

// A device step that never reached a DeviceCompressor still owes its trainers their done events.
void release_device_buffers(std::span<const DeviceBuffer> buffers) {
  Status s = DeviceCompressor::release_untouched(buffers);
  if (!s.ok()) SC_LOG_ERROR("releasing a trainer's device buffer: {}", s.to_string());
}

double seconds_since(const Clock& clock, Clock::time_point t0) {
  return std::chrono::duration<double>(clock.now() - t0).count();
}

PipelineSnapshot empty_snapshot() {
  PipelineSnapshot s;
  for (int g = 0; g < kGroupCount; ++g) s.groups.emplace_back(std::string(group_name(static_cast<TensorGroup>(g))), PipelineSnapshot::Group{});
  return s;
}

}  // namespace

Pipeline::Pipeline(const PipelineOptions& options, Transport* transport, Mailbox* mailbox, Metrics* metrics,
                   DecisionBoard* decisions, const Clock& clock)
    : options_(options), transport_(transport), mailbox_(mailbox), metrics_(metrics), decisions_(decisions),
      clock_(clock),
      agreement_(JobAgreement::Options{options.rank, options.world_size, options.job_id, options.local_clients},
                 transport, mailbox, decisions, clock),
      stats_(empty_snapshot()),
      progress_(clock, options.progress_interval) {
  plan_settings_.base = options.settings;
  SC_CHECK(options.world_size == 1 || transport != nullptr, "a multi-node pipeline needs a transport");
  if (options.kernel_threads > 1) kernel_pool_ = std::make_unique<kernels::ThreadPool>(options.kernel_threads);
}

Pipeline::~Pipeline() { stop(); }

void Pipeline::start() {
  SC_CHECK(sink_ != nullptr, "set_result_sink() before start()");
  if (options_.rank == 0 && options_.world_size > 1) {
    mailbox_->set_manifest_handler([this](uint32_t peer, const wire::WireHeader& h, std::span<const std::byte> payload) {
      return agreement_.answer_late_manifest(peer, h, payload);
    });
  }
  mailbox_->resume();
  thread_ = std::thread([this] { run(); });
}

void Pipeline::stop() {
  std::deque<Command> leftover;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
    leftover.swap(queue_);
    cv_.notify_all();
  }
  mailbox_->cancel();
  if (thread_.joinable()) {
    thread_.join();
    end_job_progress("the daemon is stopping");  // the thread is gone: its state is ours now
  }
  fail_queued(leftover, "daemon is stopping");
}

void Pipeline::end_job_progress(const char* why) {
  const ProgressTotals job = progress_.job();
  if (auto summary = progress_.end_job()) SC_LOG_INFO("{} ({})", summary->c_str(), why);
  if (overlap_.steps > 0) {
    SC_LOG_INFO("device steps compressed while the previous step was on the wire: {} ({:.1f} ms of compression hidden)",
                overlap_.steps, overlap_.seconds * 1e3);
  }
  overlap_ = Overlap{};
  finished_jobs_.add(job);
  std::lock_guard<std::mutex> lock(stats_mu_);
  stats_.job = ProgressTotals{};
  stats_.since_start = finished_jobs_;
}

void Pipeline::fail_queued(std::deque<Command>& queue, const std::string& why) {
  for (auto& cmd : queue) {
    if (auto* call = std::get_if<Call>(&cmd)) {
      std::lock_guard<std::mutex> lock(call->state->mu);
      call->state->done = true;
      call->state->status = aborted(why);
      call->state->cv.notify_all();
      continue;
    }
    if (auto* job = std::get_if<StepJob>(&cmd)) {
      StepResult r;
      r.tensor_id = job->tensor_id;
      r.step = job->step;
      r.generation = job->generation;
      r.status = aborted(why);
      if (sink_) sink_->complete(r);
    }
  }
  queue.clear();
}

Status Pipeline::register_tensor(uint32_t tensor_id, const TensorSpec& spec) {
  std::lock_guard<std::mutex> lock(mu_);
  if (job_started_) {
    return failed_precondition("tensor '" + spec.name +
                               "' registered after the job's first step; register every tensor before submitting");
  }
  if (tensor_id != registered_) {
    return internal_error("tensor ids must be dense: got " + std::to_string(tensor_id) + ", expected " +
                          std::to_string(registered_));
  }
  if (spec.count == 0 || spec.count > wire::kMaxDenseLen) {
    return invalid_argument("tensor '" + spec.name + "' has " + std::to_string(spec.count) +
                            " elements; allowed 1.." + std::to_string(wire::kMaxDenseLen));
  }
  if (Status shape = check_shape(spec.count, spec.shape); !shape.ok()) {
    return shape.with_context("tensor '" + spec.name + "'");
  }
  for (char c : spec.name) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      return invalid_argument("tensor name contains a control character");
    }
  }
  ++registered_;
  if (tensor_id == 0) registered_specs_.clear();  // the first tensor of a new job
  registered_specs_.push_back(spec);
  queue_.push_back(Register{tensor_id, spec});
  cv_.notify_all();
  return Status::Ok();
}

void Pipeline::submit(const StepJob& job) {
  if (draining_.load()) {
    StepResult r;
    r.tensor_id = job.tensor_id;
    r.step = job.step;
    r.generation = job.generation;
    r.status = unavailable("the daemon is draining (sparsecarctl drain); it takes no new steps");
    if (metrics_) metrics_->count_step_failure(r.status.code());
    if (sink_) sink_->complete(r);
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  job_started_ = true;
  queue_.push_back(job);
  cv_.notify_all();
}

void Pipeline::report_metric(const std::string& name, double value, uint64_t step) {
  // Controllers that consume trainer metrics come with the controllers issue.
  if (metrics_) metrics_->set_trainer_metric(name, value);
  SC_LOG_DEBUG("trainer reported {} = {:g} at step {}", name, value, static_cast<unsigned long long>(step));
  if (observer_) observer_->on_metric(name, value, step);
}

void Pipeline::reset() {
  // Cancel before the Reset is queued: the pipeline thread resumes the mailbox when it runs the
  // Reset, and a cancel() after that would leave every step of the next job cancelled.
  mailbox_->cancel();  // the step in flight (if any) ends now instead of at its deadline
  std::deque<Command> leftover;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& cmd : queue_) {
      if (std::holds_alternative<StepJob>(cmd)) leftover.push_back(std::move(cmd));
    }
    // Steps are answered below; registrations of the finished job would only allocate buffers
    // that the Reset frees again. Control calls and FailSteps stay, in order, before the Reset.
    std::erase_if(queue_, [](const Command& c) {
      return std::holds_alternative<StepJob>(c) || std::holds_alternative<Register>(c);
    });
    queue_.push_back(Reset{});
    registered_ = 0;
    job_started_ = false;
    cv_.notify_all();
  }
  fail_queued(leftover, "every trainer on this node disconnected");
}

void Pipeline::run() {
  for (;;) {
    Command cmd;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (stopping_) return;
      cmd = std::move(queue_.front());
      queue_.pop_front();
    }
    if (auto* reg = std::get_if<Register>(&cmd)) {
      auto t = std::make_shared<TensorState>(reg->id, reg->spec, kernel_pool_.get(), options_.world_size, clock_);
      if (t->host) t->host->structured().set_pool(&pooled_);
      const size_t n = reg->spec.count;
      if (tensors_.size() != reg->id) tensors_.resize(reg->id);
      tensors_.push_back(std::move(t));
      {
        std::lock_guard<std::mutex> lock(stats_mu_);
        auto& g = stats_.groups[static_cast<int>(tensor_group(n))].second;
        g.tensors += 1;
        g.elements += n;
      }
      SC_LOG_DEBUG("tensor {} '{}' registered ({} elements)", reg->id, reg->spec.name, n);
    } else if (std::holds_alternative<Reset>(cmd)) {
      end_job_progress("every trainer disconnected");
      tensors_.clear();
      pooled_.reset();
      {
        std::lock_guard<std::mutex> lock(stats_mu_);
        stats_ = empty_snapshot();
        stats_.since_start = finished_jobs_;
      }
      if (decisions_) decisions_->reset();
      if (observer_) observer_->on_reset();
      agreed_ = false;
      ring_instead_logged_ = false;
      restored_ = false;
      incarnation_ = 0;
      total_trainers_ = 0;
      agreement_.reset();
      mailbox_->begin_job();
      mailbox_->resume();
      SC_LOG_INFO("job reset: every trainer disconnected; waiting for the next job");
    } else if (auto* call = std::get_if<Call>(&cmd)) {
      run_call(*call);
    } else if (auto* fail = std::get_if<FailStep>(&cmd)) {
      run_fail_step(*fail);
    } else {
      const auto started = clock_.now();
      const StepJob& job = std::get<StepJob>(cmd);
      StepResult r = process(job);
      const double busy = seconds_since(clock_, started);
      progress_.on_tensor_step(job.step, r.status.ok(), job.local_sum.size(), r.nnz, r.bytes_sent, r.dense_bytes,
                               busy);
      if (auto line = progress_.due_line()) SC_LOG_INFO("{}", line->c_str());
      {
        std::lock_guard<std::mutex> lock(stats_mu_);
        stats_.job = progress_.job();
        stats_.since_start = finished_jobs_;
        stats_.since_start.add(stats_.job);
      }
      if (metrics_) {
        metrics_->observe_step(busy);
        if (r.status.ok()) {
          metrics_->steps_ok.Increment();
        } else {
          metrics_->count_step_failure(r.status.code());
        }
      }
      sink_->complete(r);
      // The residual's norm and the controllers' share of the step (rank 0 prices it; the others
      // send it there) run while the trainers compute the next one, not before they get this
      // one's result.
      if (job.tensor_id < tensors_.size() && tensors_[job.tensor_id]) settle_residual_norm(*tensors_[job.tensor_id]);
      if (observer_) observer_->after_complete();
    }
  }
}

StepResult Pipeline::process(const StepJob& job) {
  StepResult r;
  r.tensor_id = job.tensor_id;
  r.step = job.step;
  r.generation = job.generation;
  // A device step that ends before run_step() still owes its trainers their done events.
  struct ReleaseUnstarted {
    const StepJob& job;
    bool armed;
    ~ReleaseUnstarted() {
      if (armed) release_device_buffers(job.device);
    }
  } release{job, !job.device.empty()};
  if (job.tensor_id >= tensors_.size() || !tensors_[job.tensor_id]) {
    r.status = not_found("tensor " + std::to_string(job.tensor_id) + " is not registered");
    return r;
  }
  TensorState& t = *tensors_[job.tensor_id];
  const TensorSpec& spec = t.spec;
  const bool sizes_ok = spec.on_device ? job.device.size() == options_.local_clients && job.local_sum.empty()
                                       : job.local_sum.size() == spec.count && job.result.size() == spec.count &&
                                             job.device.empty();
  if (!sizes_ok) {
    r.status = internal_error("step buffers of tensor '" + spec.name + "' have the wrong size or kind");
    return r;
  }
  if (t.has_step && job.step <= t.last_step) {
    r.status = out_of_range("tensor '" + spec.name + "' step " + std::to_string(job.step) +
                            " is not after the last step " + std::to_string(t.last_step));
    return r;
  }
  // Before anything else: from here on rank 0 never decides a change effective before step+2.
  Decision decision = decisions_ ? decisions_->at_step(job.step) : Decision{};
  if (!agreed_) {
    node_trainers_reduce_ = job.trainer_reduces;
    Status agreed = agree_on_job(clock_.now() + options_.join_timeout);
    if (!agreed.ok()) {
      r.status = agreed;
      SC_LOG_ERROR("job agreement failed: {}", agreed.to_string());
      return r;
    }
    // The agreement may have brought rank 0's decisions (a node that joined late adopts them).
    if (decisions_) decision = decisions_->at_step(job.step);
  }
  if (!decision.error.ok()) {
    // This node could not apply the epoch in force: fail the step everywhere rather than run it
    // with other knobs than the peers.
    r.status = decision.error.with_context("tensor '" + spec.name + "' step " + std::to_string(job.step));
    broadcast_abort(exchange_context(decision.epoch), job.tensor_id, job.step, r.status.message());
    return r;
  }
  follow_lease(t, job);
  t.has_step = true;
  t.last_step = job.step;
  t.lease = 0;
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    if (!stats_.has_step || job.step > stats_.last_step) stats_.last_step = job.step;
    stats_.has_step = true;
    stats_.total_trainers = total_trainers_;
  }
  release.armed = job.device.empty() ? false : !t.device;  // a device tensor's step ends in run_step()
  r.status = run_step(t, job, decision, &r);
  if (r.status.ok()) t.lease = r.lease_steps;
  if (!r.status.ok()) {
    r.status = r.status.with_context("tensor '" + spec.name + "' step " + std::to_string(job.step));
    SC_LOG_WARN("{}", r.status.to_string());
  }
  return r;
}

Status Pipeline::run_step(TensorState& t, const StepJob& job, const Decision& decision, StepResult* result) {
  if (t.device) return run_device_step(t, job, decision, result);
  TensorCompressor& c = *t.host;
  const uint32_t id = t.id;
  const size_t n = t.spec.count;
  const policies::Plan plan = plan_for(observation(t, job), decision);

  ExchangeContext ctx = exchange_context(decision.epoch);
  ctx.keepalive = tensors_[id];
  ctx.kernel_pool = kernel_pool_.get();
  mailbox_->drop_before(id, job.step);

  ExchangeStats stats;
  result->dense_bytes = ring_allreduce_bytes(n, options_.world_size, options_.rank);
  if (metrics_) metrics_->elements_total.Increment(static_cast<double>(n));

  Status s;
  kernels::Format sent_format = plan.format;
  StepTimes times;
  times.encode_started = clock_.now();
  times.exchange_started = times.encode_started;
  SC_ASSIGN_OR_RETURN(const bool trainers, by_trainers(plan, job));
  result->trainer_reduces = trainers;  // before observe_step: the controllers time such a step by its period
  t.trainer_steps = trainers ? t.trainer_steps + 1 : 0;
  if (trainers && job.takes_lease) result->lease_steps = trainer_lease(t, job, decision);
  if (plan.dense) {
    std::span<float> work = c.dense_input(job.local_sum, plan, job.lr);
    times.exchange_started = clock_.now();
    if (!trainers) s = ring_allreduce(ctx, id, job.step, work, &stats);
    if (s.ok()) {
      std::copy(work.begin(), work.end(), job.result.begin());
      result->nnz = n;
    }
  } else {
    const auto compress_started = clock_.now();
    // Hybrid: the first hybrid tensor of a new step closes the last step's pool into lambda.
    if (plan.selector == kernels::Selector::kHybrid) pooled_.begin_step(job.step, plan.params.hybrid_density);
    Expected<TensorCompressor::Encoded> compressed = c.compress(plan, job.local_sum, job.lr);
    if (!compressed.ok()) {
      // Nothing is pending (the gradient stays in the residual); the peers must not wait out
      // their deadline for a message this node will never send.
      s = compressed.status().with_context("compressing on rank " + std::to_string(options_.rank));
      broadcast_abort(ctx, id, job.step, s.message());
      return s;
    }
    const TensorCompressor::Encoded& e = *compressed;
    times.exchange_started = clock_.now();
    observe_compression(plan, compress_started, e.encode_seconds);
    s = sparse_allgather(ctx, id, job.step, e.format, e.value_type, e.nnz, e.payload, job.result, &stats);
    result->nnz = e.selected;
    sent_format = e.format;
  }
  count_messages(plan, sent_format, stats);
  times.exchange_ended = clock_.now();
  // Reduced by the trainers: their all-reduce sends what the ring would (the step's bytes in the
  // trainer's and the job summary's ratio); the daemon's own link sent nothing (stats).
  result->bytes_sent = result->trainer_reduces ? result->dense_bytes : stats.bytes_sent;
  if (!s.ok()) {
    c.rollback();  // nothing lost
    broadcast_abort(ctx, id, job.step, s.message());
    observe_step(t, job, decision, plan, false, *result, stats, times, job.local_sum, c.residual(), {});
    return s;
  }
  c.commit();
  // A sparse step's residual norm (the metrics', the controllers' observation's) is read after
  // the result went out (settle_residual_norm; ~20 us for 85 k floats on the 2-core box, a pass
  // over every element); a dense step emptied the residual.
  t.norm_due = !plan.dense;
  t.norm_step = job.step;
  observe_step(t, job, decision, plan, true, *result, stats, times, job.local_sum, c.residual(),
               plan.dense ? std::span<const float>{} : c.selected_values(), -1,
               plan.dense ? -1 : TensorStepRecord::kNormLater);
  const auto reduce_started = clock_.now();
  // The average; or, reduced by the trainers, each local trainer's share of this node's part.
  const uint32_t over = trainers ? options_.local_clients : total_trainers_;
  if (over != 1) kernels::scale(job.result, 1.0f / static_cast<float>(over));
  stats.reduce_seconds += seconds_since(clock_, reduce_started);
  finish_step(t, plan, *result, stats, plan.dense ? std::optional<double>(0.0) : std::nullopt);
  return Status::Ok();
}

Status Pipeline::run_device_step(TensorState& t, const StepJob& job, const Decision& decision, StepResult* result) {
  DeviceCompressor& d = *t.device;
  const uint32_t id = t.id;
  const size_t n = t.spec.count;
  std::string notes;
  const policies::Plan plan = DeviceCompressor::device_plan(plan_for(observation(t, job), decision), &notes);
  if (!notes.empty() && notes != t.device_plan_notes) {
    SC_LOG_WARN("tensor '{}' on the GPU runs {}: {}", t.spec.name, policies::describe(plan), notes);
    t.device_plan_notes = notes;
  }

  ExchangeContext ctx = exchange_context(decision.epoch);
  ctx.keepalive = tensors_[id];
  mailbox_->drop_before(id, job.step);

  ExchangeStats stats;
  result->dense_bytes = ring_allreduce_bytes(n, options_.world_size, options_.rank);
  if (metrics_) metrics_->elements_total.Increment(static_cast<double>(n));
  // A step that fails before anything is pending: tell the peers, release the trainers' buffers.
  auto fail_early = [&](Status s) {
    s = s.with_context("on the GPU of rank " + std::to_string(options_.rank));
    broadcast_abort(ctx, id, job.step, s.message());
    d.end(job.device, false).ignore();
    return s;
  };

  kernels::Format sent_format = plan.format;
  StepTimes times;
  times.encode_started = clock_.now();
  times.exchange_started = times.encode_started;
  std::optional<TensorState::Prepared> ahead;
  if (t.prepared && t.prepared->step == job.step && t.prepared->generation == job.generation) ahead.swap(t.prepared);
  if (t.prepared) {
    // Compressed ahead for a step that failed before it ran: its selection goes back.
    if (t.prepared->status.ok()) d.rollback();
    t.prepared.reset();
  }
  if (ahead && !ahead->status.ok()) return fail_early(ahead->status);
  if (ahead && ahead->epoch != decision.epoch) {
    // Cannot happen (a decision takes effect two steps after it is made); never mix epochs.
    d.rollback();
    return fail_early(internal_error("compressed ahead under decision epoch " + std::to_string(ahead->epoch) +
                                     ", run under " + std::to_string(decision.epoch)));
  }
  Status s;
  d.measure_norms(controllers_listen(decision));
  d.measure_magnitudes(budget_listens(decision));
  if (!ahead) s = d.begin(job.device);
  if (!s.ok()) return fail_early(std::move(s));
  Expected<bool> trainers = by_trainers(plan, job);
  if (!trainers.ok()) return fail_early(trainers.status());
  result->trainer_reduces = *trainers;  // as on the host path: before observe_step
  t.trainer_steps = *trainers ? t.trainer_steps + 1 : 0;
  if (*trainers && job.takes_lease) result->lease_steps = trainer_lease(t, job, decision);
  if (*trainers) {
    // Each local trainer's share of this node's part, on the GPU; the trainers all-reduce it.
    s = d.dense_share(plan, options_.local_clients);
    if (!s.ok()) return fail_early(std::move(s));
    times.exchange_started = clock_.now();
    result->nnz = n;
  } else if (plan.dense) {
    Expected<std::span<float>> work = d.dense_input(plan);
    if (!work.ok()) return fail_early(work.status());
    times.exchange_started = clock_.now();
    s = ring_allreduce(ctx, id, job.step, *work, &stats);
    if (s.ok()) s = d.finish_dense(total_trainers_);
    result->nnz = n;
  } else {
    const auto compress_started = clock_.now();
    Expected<DeviceCompressor::Encoded> compressed =
        ahead ? Expected<DeviceCompressor::Encoded>(ahead->encoded) : d.compress(plan);
    if (!compressed.ok()) return fail_early(compressed.status());
    const DeviceCompressor::Encoded& e = *compressed;
    times.exchange_started = clock_.now();
    if (!ahead) observe_compression(plan, compress_started, e.encode_seconds);
    auto upload = [&d](const GatheredPayload& g) { return d.add_payload(g); };
    ctx.while_waiting = [this, id] { prepare_next_device_step(id); };
    s = sparse_allgather_each(ctx, id, job.step, e.format, e.value_type, e.nnz, n, e.payload, upload, &stats);
    const auto decode_started = clock_.now();
    if (s.ok()) {
      s = d.finish_sparse(total_trainers_);
      stats.decode_seconds += seconds_since(clock_, decode_started);
    }
    SC_LOG_DEBUG("tensor {} step {} on the GPU: select+encode {:.3f} ms{} (waiting for the trainers' ready events "
                 "included), exchange {:.3f} ms (send {:.3f}, wait {:.3f}), decode {:.3f} ms",
                 id, job.step, std::chrono::duration<double, std::milli>(times.exchange_started - times.encode_started).count(),
                 ahead ? " (done ahead)" : "",
                 std::chrono::duration<double, std::milli>(decode_started - times.exchange_started).count(),
                 stats.send_seconds * 1e3, stats.wait_seconds * 1e3, seconds_since(clock_, decode_started) * 1e3);
    result->nnz = e.selected;
    sent_format = e.format;
  }
  count_messages(plan, sent_format, stats);
  times.exchange_ended = clock_.now();
  result->bytes_sent = result->trainer_reduces ? result->dense_bytes : stats.bytes_sent;
  if (!s.ok()) {
    d.rollback();  // nothing lost
    broadcast_abort(ctx, id, job.step, s.message());
    Status ended = d.end(job.device, false);
    if (!ended.ok()) SC_LOG_ERROR("tensor '{}': releasing the trainers' buffers: {}", t.spec.name, ended.to_string());
    observe_step(t, job, decision, plan, false, *result, stats, times, {}, {}, {});
    return s;
  }
  d.commit();
  // The peers have this step now; writing the average into the trainers' buffers can still fail
  // on a CUDA error, which fails the step here (the residual already let the selection go).
  const auto end_started = clock_.now();
  SC_RETURN_IF_ERROR(d.end(job.device, true).with_context("writing the average into the trainers' buffers"));
  SC_LOG_DEBUG("tensor {} step {} on the GPU: written back in {:.3f} ms; {:.3f} ms in all", id, job.step,
               seconds_since(clock_, end_started) * 1e3, seconds_since(clock_, times.encode_started) * 1e3);
  observe_step(t, job, decision, plan, true, *result, stats, times, {}, {}, {}, d.last_grad_norm2(),
               d.last_residual_norm2(), d.last_magnitude_hist(), d.last_gradient_hist());
  // A device residual is measured on the GPU only while a controller listens (else 0 here).
  finish_step(t, plan, *result, stats, plan.dense ? 0.0 : std::max(0.0, d.last_residual_norm2()));
  return Status::Ok();
}

bool Pipeline::controllers_listen(const Decision& decision) {
  if (!decision.config) return false;
  if (decision.config != listen_config_) {
    listen_config_ = decision.config;
    auto active = policies::parse_controllers(decision.config->controller);
    listen_ = active.ok() && (*active & policies::job_level_controllers()) != 0;
    listen_budget_ = active.ok() && policies::has(*active, policies::ControllerKind::kBudget);
  }
  return listen_;
}

bool Pipeline::budget_listens(const Decision& decision) {
  return controllers_listen(decision) && listen_budget_;
}

void Pipeline::prepare_next_device_step(uint32_t current) {
  // The next queued command, if it is a device step of another tensor this node can compress now.
  StepJob next;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (queue_.empty() || stopping_) return;
    const StepJob* j = std::get_if<StepJob>(&queue_.front());
    if (j == nullptr || j->device.empty()) return;
    next = *j;
  }
  if (!agreed_ || next.tensor_id == current || next.tensor_id >= tensors_.size() || !tensors_[next.tensor_id]) return;
  TensorState& t = *tensors_[next.tensor_id];
  if (!t.device || t.prepared || next.device.size() != options_.local_clients) return;
  if (t.has_step && next.step <= t.last_step) return;
  const Decision decision = decisions_ ? decisions_->at_step(next.step) : Decision{};
  if (!decision.error.ok()) return;
  const policies::Plan plan = DeviceCompressor::device_plan(plan_for(observation(t, next), decision));
  if (plan.dense) return;
  const auto started = clock_.now();
  TensorState::Prepared p;
  p.step = next.step;
  p.generation = next.generation;
  p.epoch = decision.epoch;
  p.plan = plan;
  t.device->measure_norms(controllers_listen(decision));
  Status begun = t.device->begin(next.device);
  if (!begun.ok()) return;  // nothing happened: the step runs (and reports) it again in turn
  Expected<DeviceCompressor::Encoded> e = t.device->compress(plan);
  if (e.ok()) {
    p.encoded = *e;
  } else {
    p.status = e.status();
  }
  p.seconds = seconds_since(clock_, started);
  if (metrics_ && e.ok()) {
    metrics_->observe_stage(Stage::kSelect, std::max(0.0, p.seconds - e->encode_seconds));
    metrics_->observe_stage(Stage::kEncode, e->encode_seconds);
  }
  overlap_.steps += 1;
  overlap_.seconds += p.seconds;
  t.prepared = std::move(p);
}

policies::TensorObservation Pipeline::observation(const TensorState& t, const StepJob& job) const {
  policies::TensorObservation obs;
  obs.tensor_id = t.id;
  obs.elements = t.spec.count;
  obs.step = job.step;
  obs.world_size = options_.world_size;
  obs.name = t.spec.name;
  obs.rows = t.spec.shape.empty() ? 1 : static_cast<uint32_t>(t.spec.shape[0]);
  return obs;
}

void Pipeline::observe_compression(const policies::Plan& plan, Clock::time_point compress_started,
                                   double encode_seconds) {
  (void)plan;
  if (!metrics_) return;
  // compress() folds, selects and encodes; it reports the encoding part.
  metrics_->observe_stage(Stage::kSelect, std::max(0.0, seconds_since(clock_, compress_started) - encode_seconds));
  metrics_->observe_stage(Stage::kEncode, encode_seconds);
}

void Pipeline::count_messages(const policies::Plan& plan, kernels::Format sent, const ExchangeStats& stats) {
  if (!metrics_) return;
  if (plan.dense) {
    metrics_->count_messages(kernels::Format::kDense, kernels::Selector::kNone, static_cast<double>(stats.messages_sent));
  } else {
    metrics_->count_messages(sent, plan.selector, static_cast<double>(stats.messages_sent));
  }
}

void Pipeline::observe_step(TensorState& t, const StepJob& job, const Decision& decision, const policies::Plan& plan,
                            bool ok, const StepResult& result, const ExchangeStats& stats, const StepTimes& times,
                            std::span<const float> local_sum, std::span<const float> residual,
                            std::span<const float> selected, double grad_norm2, double residual_norm2,
                            std::span<const uint64_t> magnitude_hist, std::span<const uint64_t> gradient_hist) {
  if (!observer_) return;
  TensorStepRecord rec;
  rec.tensor_id = t.id;
  rec.step = job.step;
  rec.tensors_in_job = static_cast<uint32_t>(tensors_.size());
  rec.elements = t.spec.count;
  rec.on_device = t.device != nullptr;
  rec.trainer_reduced = result.trainer_reduces;
  rec.lease_steps = ok ? result.lease_steps : 0;
  rec.ok = ok;
  rec.plan = plan;
  rec.nnz = ok ? result.nnz : 0;
  rec.bytes_sent = stats.bytes_sent;
  rec.dense_bytes = result.dense_bytes;
  rec.encode_s = std::chrono::duration<double>(times.exchange_started - times.encode_started).count();
  rec.exchange_s = std::chrono::duration<double>(times.exchange_ended - times.exchange_started).count();
  rec.decode_s = stats.decode_seconds;
  rec.reduce_s = stats.reduce_seconds;
  rec.link_bytes = stats.link_bytes;
  rec.link_s = stats.link_seconds;
  rec.local_sum = local_sum;
  rec.residual = residual;
  rec.selected = selected;
  rec.grad_norm2 = grad_norm2;
  rec.residual_norm2 = residual_norm2;
  rec.magnitude_hist = magnitude_hist;
  rec.gradient_hist = gradient_hist;
  observer_->on_tensor_step(rec, decision);
}

void Pipeline::finish_step(TensorState& t, const policies::Plan& plan, const StepResult& result,
                           const ExchangeStats& stats, std::optional<double> residual_norm2) {
  if (metrics_) {
    metrics_->elements_selected.Increment(static_cast<double>(result.nnz));
    metrics_->dense_equivalent_bytes.Increment(static_cast<double>(result.dense_bytes));
    metrics_->observe_stage(Stage::kSend, stats.send_seconds);
    metrics_->observe_stage(Stage::kWait, stats.wait_seconds);
    metrics_->observe_stage(Stage::kDecode, stats.decode_seconds);
    metrics_->observe_stage(Stage::kReduce, stats.reduce_seconds);
  }
  record_step_metrics(t, plan, result, residual_norm2);
}

policies::Plan Pipeline::plan_for(const policies::TensorObservation& obs, const Decision& decision) {
  // Without a decision board plan_settings_ stays options_.settings (set at construction).
  if (decision.config && decision.config != plan_config_) {
    plan_config_ = decision.config;  // once per decision epoch; the overrides once per text
    plan_settings_ = plan_settings_from_config(*decision.config, &overrides_cache_);
    progress_.set_interval(std::chrono::milliseconds(
        static_cast<int64_t>(decision.config->progress_log_seconds * 1000.0)));
  }
  return policies::plan_tensor(plan_settings_, obs);
}

void Pipeline::record_step_metrics(TensorState& t, const policies::Plan& plan, const StepResult& r,
                                   std::optional<double> norm2) {
  const uint64_t n = t.spec.count;
  const TensorGroup group = tensor_group(n);
  std::string desc = policies::describe(plan);
  double density = 0, group_norm2 = 0;
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    auto& g = stats_.groups[static_cast<int>(group)].second;
    g.selected = g.selected - t.last_selected + r.nnz;
    if (norm2) g.residual_norm2 = std::max(0.0, g.residual_norm2 - t.last_norm2 + *norm2);
    if (desc != t.plan) {
      if (!t.plan.empty() && --g.plans[t.plan] == 0) g.plans.erase(t.plan);
      g.plans[desc] += 1;
    }
    density = g.elements ? static_cast<double>(g.selected) / static_cast<double>(g.elements) : 0.0;
    group_norm2 = g.residual_norm2;
  }
  t.last_selected = r.nnz;
  if (norm2) t.last_norm2 = *norm2;
  t.plan = std::move(desc);
  t.last_lambda = !plan.dense && plan.selector == kernels::Selector::kThreshold ? plan.params.threshold : 0.0;
  if (metrics_) {
    metrics_->set_group(group, density, t.last_lambda, std::sqrt(group_norm2));
    if (norm2) metrics_->add_group_error(group, *norm2);
  }
}

void Pipeline::settle_residual_norm(TensorState& t) {
  if (!t.norm_due) return;
  t.norm_due = false;
  const double norm2 = t.residual_norm2();
  const TensorGroup group = tensor_group(t.spec.count);
  double density = 0, group_norm2 = 0;
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    auto& g = stats_.groups[static_cast<int>(group)].second;
    g.residual_norm2 = std::max(0.0, g.residual_norm2 - t.last_norm2 + norm2);
    density = g.elements ? static_cast<double>(g.selected) / static_cast<double>(g.elements) : 0.0;
    group_norm2 = g.residual_norm2;
  }
  t.last_norm2 = norm2;
  if (metrics_) {
    metrics_->set_group(group, density, t.last_lambda, std::sqrt(group_norm2));
    metrics_->add_group_error(group, norm2);
  }
  if (observer_) observer_->on_residual_norm2(t.id, t.norm_step, norm2);
}

PipelineSnapshot Pipeline::snapshot() const {
  PipelineSnapshot s;
  {
    std::lock_guard<std::mutex> lock(stats_mu_);
    s = stats_;
  }
  {
    std::lock_guard<std::mutex> lock(const_cast<std::mutex&>(mu_));
    s.queued = queue_.size();
  }
  s.draining = draining_.load();
  return s;
}

Status Pipeline::call_on_thread(std::function<Status()> fn, Clock::time_point deadline) {
  Call call{std::make_shared<Call::State>(), std::move(fn)};
  auto state = call.state;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_) return unavailable("the pipeline is stopping");
    queue_.push_back(std::move(call));
    cv_.notify_all();
  }
  std::unique_lock<std::mutex> lock(state->mu);
  if (!wait_until(state->cv, lock, clock_, deadline, [&] { return state->done || state->started; })) {
    state->abandoned = true;  // not started: it never will be
    return deadline_exceeded("the pipeline did not get to the request in time (a step is still running); "
                             "it was not run");
  }
  // Started before the deadline: it runs to the end and its outcome is the answer, even if that
  // is after the deadline (see the header: operations are short and not abandonable once started).
  state->cv.wait(lock, [&] { return state->done; });
  return state->status;
}

void Pipeline::run_call(Call& call) {
  std::unique_lock<std::mutex> lock(call.state->mu);
  if (call.state->abandoned) return;
  call.state->started = true;
  call.state->cv.notify_all();
  lock.unlock();  // the operation may take a while; the waiter only reads under the lock
  if (call_started_hook_) call_started_hook_();
  Status s = call.fn();
  lock.lock();
  call.state->done = true;
  call.state->status = std::move(s);
  call.state->cv.notify_all();
}

Status Pipeline::drain(Clock::time_point deadline) {
  draining_.store(true);
  if (metrics_) metrics_->draining.Set(1);
  return call_on_thread([] { return Status::Ok(); }, deadline)
      .with_context("draining");
}

void Pipeline::undrain() {
  draining_.store(false);
  if (metrics_) metrics_->draining.Set(0);
}

Expected<CheckpointInfo> Pipeline::checkpoint(const std::string& path, Clock::time_point deadline) {
  auto info = std::make_shared<CheckpointInfo>();
  SC_RETURN_IF_ERROR(call_on_thread([this, path, info] { return write_checkpoint(path, info.get()); }, deadline));
  return *info;
}

Expected<CheckpointInfo> Pipeline::restore(const std::string& path, Clock::time_point deadline) {
  std::vector<TensorSpec> specs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    specs = registered_specs_;
    if (registered_ == 0) specs.clear();  // reset since: nothing is registered in this job yet
  }
  // Open, size-check, read and validate here, on the caller's thread; only the copy is queued.
  SC_ASSIGN_OR_RETURN(LoadedCheckpoint loaded, load_checkpoint(path, specs, options_.rank, options_.world_size));
  auto file = std::make_shared<LoadedCheckpoint>(std::move(loaded));
  auto info = std::make_shared<CheckpointInfo>();
  SC_RETURN_IF_ERROR(call_on_thread(
      [this, path, file, specs = std::move(specs), info] { return read_checkpoint(path, specs, *file, info.get()); },
      deadline));
  return *info;
}

Status Pipeline::write_checkpoint(const std::string& path, CheckpointInfo* info) {
  std::vector<CheckpointEntry> entries;
  double norm2 = 0;
  for (const auto& t : tensors_) {
    if (!t) continue;
    const auto& spec = t->spec;
    SC_ASSIGN_OR_RETURN(std::span<const float> residual, t->residual());
    entries.push_back(CheckpointEntry{spec.name, residual});
    info->elements += spec.count;
    norm2 += t->residual_norm2();
  }
  if (entries.empty()) return failed_precondition("no tensors are registered; nothing to checkpoint");
  const std::string out = encode_checkpoint(options_.job_id, options_.rank, options_.world_size, entries);
  const std::string tmp = path + ".tmp";
  // O_NONBLOCK|O_NOFOLLOW: a FIFO or symlink planted at PATH.tmp must not stall the pipeline
  // thread or redirect the write; only a regular file is written.
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC | O_NONBLOCK | O_NOFOLLOW, 0600);
  if (fd < 0) return errno_status("creating checkpoint " + tmp, errno);
  struct stat tmp_stat{};
  if (::fstat(fd, &tmp_stat) != 0 || !S_ISREG(tmp_stat.st_mode)) {
    ::close(fd);
    return failed_precondition("checkpoint " + tmp + " exists and is not a regular file; remove it");
  }
  size_t done = 0;
  while (done < out.size()) {
    ssize_t w = ::write(fd, out.data() + done, out.size() - done);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) {
      const int err = errno;
      ::close(fd);
      ::unlink(tmp.c_str());
      return errno_status("writing checkpoint " + tmp, err);
    }
    done += static_cast<size_t>(w);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return errno_status("syncing checkpoint " + tmp, err);
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    ::unlink(tmp.c_str());
    return errno_status("renaming checkpoint to " + path, err);
  }
  info->tensors = static_cast<uint32_t>(entries.size());
  info->bytes = out.size();
  info->residual_norm = std::sqrt(norm2);
  SC_LOG_INFO("checkpoint: {} tensors' residuals ({} bytes) written to {}", info->tensors, out.size(), path);
  return Status::Ok();
}

Status Pipeline::read_checkpoint(const std::string& path, const std::vector<TensorSpec>& specs,
                                 const LoadedCheckpoint& file, CheckpointInfo* info) {
  // Pipeline thread, between steps: the file was validated against `specs`; check that they are
  // still the tensors registered (a job reset may have come in between), then copy.
  std::vector<std::shared_ptr<TensorState>> live;
  for (const auto& t : tensors_) {
    if (t) live.push_back(t);
  }
  bool same = live.size() == specs.size() && file.offsets.size() == specs.size();
  for (size_t i = 0; same && i < live.size(); ++i) {
    same = live[i]->spec.name == specs[i].name && live[i]->spec.count == specs[i].count;
  }
  if (!same) {
    return failed_precondition("the registered tensors changed while checkpoint " + path +
                               " was read (job reset?); nothing was restored");
  }
  double norm2 = 0;
  for (size_t i = 0; i < live.size(); ++i) {
    // The pipeline thread owns the compressor and no step is pending: overwrite its residual.
    TensorState& t = *live[i];
    const size_t count = t.spec.count;
    if (t.host) {
      auto current = t.host->residual();
      std::memcpy(const_cast<float*>(current.data()), file.bytes.data() + file.offsets[i], current.size_bytes());
    } else {
      t.residual_copy.resize(count);
      std::memcpy(t.residual_copy.data(), file.bytes.data() + file.offsets[i], count * sizeof(float));
      SC_RETURN_IF_ERROR(t.device->write_residual(t.residual_copy).with_context("restoring tensor '" + t.spec.name + "'"));
    }
    norm2 += t.residual_norm2();
    info->elements += count;
  }
  info->tensors = static_cast<uint32_t>(live.size());
  info->bytes = file.bytes.size();
  info->residual_norm = std::sqrt(norm2);
  SC_LOG_INFO("restore: {} tensors' residuals loaded from {}", live.size(), path);
  restored_ = true;
  return Status::Ok();
}

std::string Pipeline::manifest() const {
  std::ostringstream os;
  os << "local_clients " << options_.local_clients << "\n";
  os << "knobs " << options_.agreed_knobs << "\n";
  // Whether this node's trainers reduce dense steps themselves: the job's is the AND over the
  // nodes (job_agreement.h), so dense_collective=trainer runs alike everywhere.
  os << "trainers_reduce " << (node_trainers_reduce_ ? 1 : 0) << "\n";
  for (const auto& t : tensors_) {
    if (!t) continue;
    // "tensor <id> <count> shape=<d0>x<d1>... <name>" (shape=none without one): the shape must
    // agree across nodes like the count, since structured selectors read it.
    const TensorSpec& spec = t->spec;
    std::string shape = spec.shape.empty() ? "none" : "";
    for (size_t i = 0; i < spec.shape.size(); ++i) shape += (i ? "x" : "") + std::to_string(spec.shape[i]);
    os << "tensor " << t->id << " " << spec.count << " shape=" << shape << " " << spec.name << "\n";
  }
  return os.str();
}

Expected<bool> Pipeline::by_trainers(const policies::Plan& plan, const StepJob& job) {
  if (!plan.dense || plan.collective != policies::Collective::kTrainerAllReduce) return false;
  if (!trainers_reduce_) {
    if (!ring_instead_logged_) {
      SC_LOG_WARN("dense_collective=trainer: this job's trainers do not all-reduce dense steps themselves (the DDP "
                  "hook does; a trainer says so with each submit): the daemons' ring runs them");
      ring_instead_logged_ = true;
    }
    return false;
  }
  if (!job.trainer_reduces) {
    return failed_precondition("dense_collective=trainer: a local trainer of this job no longer says it "
                               "all-reduces dense steps itself");
  }
  return true;
}

void Pipeline::follow_lease(TensorState& t, const StepJob& job) {
  const auto now = clock_.now();
  const bool follows =
      t.has_step && t.trainer_steps > 0 && job.step > t.last_step && job.step - t.last_step - 1 <= t.lease;
  if (!follows) {
    t.pace = 0;
  } else if (const uint64_t gap = job.step - t.last_step; metrics_ && gap > 1) {
    metrics_->steps_leased.Increment(static_cast<double>(gap - 1));
  }
  if (follows && now > t.handled) {
    const uint64_t gap = job.step - t.last_step;
    const double per_step = std::chrono::duration<double>(now - t.handled).count() / static_cast<double>(gap);
    if (t.pace > 0 && per_step > kLeaseSlowerRestarts * t.pace) {
      SC_LOG_DEBUG("tensor '{}' step {}: the trainer-reduced steps took {:.3g} ms each, {:.3g} before: the lease "
                   "starts again from 1", t.spec.name, job.step, per_step * 1e3, t.pace * 1e3);
      t.trainer_steps = 0;
    }
    t.pace = t.pace > 0 ? 0.75 * t.pace + 0.25 * per_step : per_step;
  }
  t.handled = now;
}

uint32_t Pipeline::trainer_lease(const TensorState& t, const StepJob& job, const Decision& decision) {
  const uint64_t knob = decision.config ? decision.config->trainer_lease : options_.trainer_lease;
  // A slow start: 1, 2, 4, ... with each trainer-reduced step in a row, so that a decision made
  // early in a run of them (the step controller cutting the schedule's warm-up after its first
  // steps) waits for few skipped steps; the whole knob once such steps have gone on a while.
  const uint64_t most = std::min(knob, uint64_t{1} << std::min<uint32_t>(std::max<uint32_t>(t.trainer_steps, 1) - 1, 20));
  StepJob next;
  next.tensor_id = job.tensor_id;
  uint32_t lease = 0;
  // A decision made after this one takes effect at its step (rank 0's highest started + 2) or,
  // where the trainers skip that step, at the first step they submit after the lease.
  for (; lease < most; ++lease) {
    next.step = job.step + lease + 1;
    const policies::Plan plan = plan_for(observation(t, next), decision);
    if (!plan.dense || plan.collective != policies::Collective::kTrainerAllReduce) break;
  }
  return lease;
}

Status Pipeline::agree_on_job(Clock::time_point deadline) {
  SC_ASSIGN_OR_RETURN(AgreedJob job, agreement_.agree(manifest(), deadline));
  incarnation_ = job.incarnation;
  total_trainers_ = job.total_trainers;
  if (node_trainers_reduce_ && !job.trainers_reduce) {
    SC_LOG_INFO("this node's trainers all-reduce dense steps themselves, another node's do not: dense steps run "
                "on the daemons' ring in this job");
  }
  trainers_reduce_ = job.trainers_reduce;
  agreed_ = true;
  SC_LOG_INFO("job agreed: {} trainers across {} nodes (incarnation {:016x})", total_trainers_, options_.world_size,
              static_cast<unsigned long long>(incarnation_));
  if (job.joined_running) {
    // What the lost process of this rank held is gone with it: its error-feedback residuals.
    size_t tensors = 0, elements = 0;
    for (const auto& t : tensors_) {
      if (!t) continue;
      ++tensors;
      elements += t->spec.count;
    }
    SC_LOG_WARN("joined the running job as a replacement for rank {}: the error-feedback residuals of {} tensor(s) "
                "({} elements) start at zero{}",
                options_.rank, tensors, elements,
                restored_ ? " except those restored from a checkpoint"
                          : " (restore a checkpoint before the first step to keep them: sparsecarctl restore PATH)");
  }
  return Status::Ok();
}

uint64_t Pipeline::tensor_footprint_bytes(const TensorSpec& spec) const {
  if (spec.on_device) return DeviceCompressor::footprint_bytes(spec, options_.world_size);
  return TensorCompressor::footprint_bytes(spec);
}

void Pipeline::fail_step(uint32_t tensor_id, uint64_t step, const std::string& reason) {
  std::lock_guard<std::mutex> lock(mu_);
  if (stopping_) return;
  queue_.push_back(FailStep{tensor_id, step, reason});
  cv_.notify_all();
}

ExchangeContext Pipeline::exchange_context(uint32_t epoch) const {
  ExchangeContext ctx;
  ctx.transport = transport_;
  ctx.mailbox = mailbox_;
  ctx.job_id = options_.job_id;
  ctx.rank = options_.rank;
  ctx.world_size = options_.world_size;
  ctx.epoch = epoch;
  ctx.incarnation = incarnation_;
  ctx.clock = &clock_;
  ctx.deadline = clock_.now() + options_.step_timeout;
  ctx.metrics = metrics_;
  return ctx;
}

void Pipeline::run_fail_step(const FailStep& fail) {
  SC_LOG_WARN("tensor {} step {} fails job-wide: {}", fail.tensor_id, static_cast<unsigned long long>(fail.step),
              fail.reason);
  if (metrics_) metrics_->count_step_failure(Code::kAborted);
  if (options_.world_size == 1 || transport_ == nullptr) return;
  // Receivers do not check an abort's epoch; the incarnation is still this job's (a FailStep is
  // queued before any Reset).
  broadcast_abort(exchange_context(decisions_ ? decisions_->latest().epoch : 0), fail.tensor_id, fail.step,
                  fail.reason);
}

}  // namespace sparsecar
