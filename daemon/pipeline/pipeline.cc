#include "daemon/pipeline/pipeline.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <sstream>

#include "daemon/collective/collective.h"
#include "daemon/metrics/metrics.h"
#include "daemon/pipeline/settings.h"
#include "sparsecar/common/log.h"
#include "sparsecar/kernels/codec.h"
#include "sparsecar/kernels/select.h"

namespace sparsecar {

using Clock = std::chrono::steady_clock;

// Per-tensor state: the compressor (residual and buffers, sized at registration) and the step
// order check.
struct Pipeline::TensorState {
  explicit TensorState(uint32_t id, const TensorSpec& spec) : compressor(id, spec) {}
  TensorCompressor compressor;
  bool has_step = false;
  uint64_t last_step = 0;
};

Pipeline::Pipeline(const PipelineOptions& options, Transport* transport, Mailbox* mailbox, Metrics* metrics,
                   DecisionBoard* decisions)
    : options_(options), transport_(transport), mailbox_(mailbox), metrics_(metrics), decisions_(decisions) {
  SC_CHECK(options.world_size == 1 || transport != nullptr, "a multi-node pipeline needs a transport");
}

Pipeline::~Pipeline() { stop(); }

void Pipeline::start() {
  SC_CHECK(sink_ != nullptr, "set_result_sink() before start()");
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
  if (thread_.joinable()) thread_.join();
  fail_queued(leftover, "daemon is stopping");
}

void Pipeline::fail_queued(std::deque<Command>& queue, const std::string& why) {
  for (auto& cmd : queue) {
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
  for (char c : spec.name) {
    if (static_cast<unsigned char>(c) < 0x20 || c == 0x7f) {
      return invalid_argument("tensor name contains a control character");
    }
  }
  ++registered_;
  queue_.push_back(Register{tensor_id, spec});
  cv_.notify_all();
  return Status::Ok();
}

void Pipeline::submit(const StepJob& job) {
  std::lock_guard<std::mutex> lock(mu_);
  job_started_ = true;
  queue_.push_back(job);
  cv_.notify_all();
}

void Pipeline::report_metric(const std::string& name, double value, uint64_t step) {
  // Controllers that consume trainer metrics come with the controllers issue.
  SC_LOG_DEBUG("trainer reported %s = %g at step %llu", name.c_str(), value, static_cast<unsigned long long>(step));
  if (observer_) observer_->on_metric(name, value, step);
}

void Pipeline::reset() {
  std::deque<Command> leftover;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& cmd : queue_) {
      if (std::holds_alternative<StepJob>(cmd)) leftover.push_back(std::move(cmd));
    }
    std::erase_if(queue_, [](const Command& c) { return std::holds_alternative<StepJob>(c); });
    queue_.push_back(Reset{});
    registered_ = 0;
    job_started_ = false;
    cv_.notify_all();
  }
  mailbox_->cancel();  // the step in flight (if any) ends now instead of at its deadline
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
      auto t = std::make_shared<TensorState>(reg->id, reg->spec);
      const size_t n = reg->spec.count;
      if (tensors_.size() != reg->id) tensors_.resize(reg->id);
      tensors_.push_back(std::move(t));
      SC_LOG_DEBUG("tensor %u '%s' registered (%zu elements)", reg->id, reg->spec.name.c_str(), n);
    } else if (std::holds_alternative<Reset>(cmd)) {
      tensors_.clear();
      if (decisions_) decisions_->reset();
      if (observer_) observer_->on_reset();
      agreed_ = false;
      total_trainers_ = 0;
      mailbox_->clear();
      mailbox_->resume();
      SC_LOG_INFO("job reset: every trainer disconnected; waiting for the next job");
    } else {
      StepResult r = process(std::get<StepJob>(cmd));
      if (metrics_) (r.status.ok() ? metrics_->steps_ok : metrics_->steps_failed).Increment();
      sink_->complete(r);
    }
  }
}

StepResult Pipeline::process(const StepJob& job) {
  StepResult r;
  r.tensor_id = job.tensor_id;
  r.step = job.step;
  r.generation = job.generation;
  if (job.tensor_id >= tensors_.size() || !tensors_[job.tensor_id]) {
    r.status = not_found("tensor " + std::to_string(job.tensor_id) + " is not registered");
    return r;
  }
  TensorState& t = *tensors_[job.tensor_id];
  const TensorSpec& spec = t.compressor.spec();
  if (job.local_sum.size() != spec.count || job.result.size() != spec.count) {
    r.status = internal_error("step buffers of tensor '" + spec.name + "' have the wrong size");
    return r;
  }
  if (t.has_step && job.step <= t.last_step) {
    r.status = out_of_range("tensor '" + spec.name + "' step " + std::to_string(job.step) +
                            " is not after the last step " + std::to_string(t.last_step));
    return r;
  }
  // Before anything else: from here on rank 0 never decides a change effective before step+2.
  const Decision decision = decisions_ ? decisions_->at_step(job.step) : Decision{};
  if (!agreed_) {
    Status agreed = agree_on_job(Clock::now() + options_.join_timeout);
    if (!agreed.ok()) {
      r.status = agreed;
      SC_LOG_ERROR("job agreement failed: %s", agreed.to_string().c_str());
      return r;
    }
  }
  t.has_step = true;
  t.last_step = job.step;
  r.status = run_step(t, job, decision, &r);
  if (!r.status.ok()) {
    r.status = r.status.with_context("tensor '" + spec.name + "' step " + std::to_string(job.step));
    SC_LOG_WARN("%s", r.status.to_string().c_str());
  }
  return r;
}

Status Pipeline::run_step(TensorState& t, const StepJob& job, const Decision& decision, StepResult* result) {
  TensorCompressor& c = t.compressor;
  const uint32_t id = c.id();
  const size_t n = c.spec().count;
  policies::TensorObservation obs;
  obs.tensor_id = id;
  obs.elements = n;
  obs.step = job.step;
  obs.world_size = options_.world_size;
  obs.name = c.spec().name;
  if (!decision.config) {
    plan_settings_ = policies::PlanSettings{};
    plan_settings_.base = options_.settings;
  } else if (decision.config != plan_config_) {
    plan_config_ = decision.config;  // parsed once per decision epoch
    plan_settings_ = plan_settings_from_config(*decision.config);
  }
  const policies::Plan plan = policies::plan_tensor(plan_settings_, obs);

  ExchangeContext ctx;
  ctx.transport = transport_;
  ctx.mailbox = mailbox_;
  ctx.job_id = options_.job_id;
  ctx.rank = options_.rank;
  ctx.world_size = options_.world_size;
  ctx.epoch = decision.epoch;
  ctx.deadline = Clock::now() + options_.step_timeout;
  ctx.keepalive = tensors_[id];
  mailbox_->drop_before(id, job.step);

  const float inv_trainers = 1.0f / static_cast<float>(total_trainers_);
  ExchangeStats stats;
  result->dense_bytes = ring_allreduce_bytes(n, options_.world_size, options_.rank);
  if (metrics_) metrics_->elements_total.Increment(static_cast<double>(n));

  Status s;
  const Clock::time_point encode_started = Clock::now();
  Clock::time_point exchange_started = encode_started;
  if (plan.dense) {
    std::span<float> work = c.dense_input(job.local_sum, plan, job.lr);
    exchange_started = Clock::now();
    s = ring_allreduce(ctx, id, job.step, work, &stats);
    if (s.ok()) {
      std::copy(work.begin(), work.end(), job.result.begin());
      result->nnz = n;
    }
  } else {
    SC_ASSIGN_OR_RETURN(TensorCompressor::Encoded e, c.compress(plan, job.local_sum, job.lr));
    exchange_started = Clock::now();
    s = sparse_allgather(ctx, id, job.step, e.format, e.value_type, e.nnz, e.payload, job.result, &stats);
    result->nnz = e.selected;
  }
  const Clock::time_point exchange_ended = Clock::now();
  auto observe = [&] {
    if (!observer_) return;
    TensorStepRecord rec;
    rec.tensor_id = id;
    rec.step = job.step;
    rec.tensors_in_job = static_cast<uint32_t>(tensors_.size());
    rec.elements = n;
    rec.ok = s.ok();
    rec.plan = plan;
    rec.nnz = s.ok() ? result->nnz : 0;
    rec.bytes_sent = stats.bytes_sent;
    rec.dense_bytes = result->dense_bytes;
    rec.encode_s = std::chrono::duration<double>(exchange_started - encode_started).count();
    rec.exchange_s = std::chrono::duration<double>(exchange_ended - exchange_started).count();
    rec.local_sum = job.local_sum;
    rec.residual = c.residual();
    observer_->on_tensor_step(rec, decision);
  };
  result->bytes_sent = stats.bytes_sent;
  if (!s.ok()) {
    c.rollback();  // nothing lost
    broadcast_abort(ctx, id, job.step, s.message());
    observe();
    return s;
  }
  c.commit();
  observe();
  kernels::scale(job.result, inv_trainers);
  if (metrics_) {
    metrics_->elements_selected.Increment(static_cast<double>(result->nnz));
    metrics_->wire_bytes_sent.Increment(static_cast<double>(result->bytes_sent));
    metrics_->dense_equivalent_bytes.Increment(static_cast<double>(result->dense_bytes));
  }
  return Status::Ok();
}

std::string Pipeline::manifest() const {
  std::ostringstream os;
  os << "local_clients " << options_.local_clients << "\n";
  os << "knobs " << options_.agreed_knobs << "\n";
  for (const auto& t : tensors_) {
    if (t) os << "tensor " << t->compressor.id() << " " << t->compressor.spec().count << " " << t->compressor.spec().name << "\n";
  }
  return os.str();
}

namespace {

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream is(text);
  for (std::string line; std::getline(is, line);) out.push_back(line);
  return out;
}

// First difference between two manifests, described for humans; empty when they match.
std::string manifest_difference(const std::string& mine, const std::string& theirs, uint32_t their_rank) {
  auto a = lines_of(mine);
  auto b = lines_of(theirs);
  std::string who = "rank " + std::to_string(their_rank);
  for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    if (i >= a.size()) return who + " registered an extra tensor: '" + b[i] + "'";
    if (i >= b.size()) return who + " is missing a tensor rank 0 registered: '" + a[i] + "'";
    if (a[i].rfind("local_clients", 0) == 0) continue;  // may differ per node
    if (a[i] != b[i]) return who + " has '" + b[i] + "' where rank 0 has '" + a[i] + "'";
  }
  return "";
}

uint32_t local_clients_of(const std::string& manifest) {
  auto lines = lines_of(manifest);
  if (lines.empty() || lines[0].rfind("local_clients ", 0) != 0) return 0;
  return static_cast<uint32_t>(std::strtoul(lines[0].c_str() + 14, nullptr, 10));
}

}  // namespace

Status Pipeline::agree_on_job(Clock::time_point deadline) {
  const std::string mine = manifest();
  if (options_.world_size == 1) {
    total_trainers_ = options_.local_clients;
    agreed_ = true;
    return Status::Ok();
  }
  auto send_text = [&](uint32_t peer, wire::Kind kind, const std::string& text) -> Status {
    auto shared = std::make_shared<std::string>(text);
    wire::WireHeader h{};
    h.magic = wire::kMagic;
    h.version = wire::kVersion;
    h.kind = static_cast<uint16_t>(kind);
    h.job_id = options_.job_id;
    h.sender_rank = options_.rank;
    auto payload = std::as_bytes(std::span<const char>(shared->data(), shared->size()));
    h.payload_bytes = payload.size();
    auto header = std::make_shared<std::array<std::byte, wire::kHeaderBytes>>();
    wire::seal(h, payload, std::span<std::byte, wire::kHeaderBytes>(*header));
    return transport_->send(peer, *header, payload, [shared, header, peer](const Status& s) {
      if (!s.ok()) SC_LOG_WARN("manifest send to rank %u failed: %s", peer, s.to_string().c_str());
    });
  };

  if (options_.rank != 0) {
    SC_RETURN_IF_ERROR(send_text(0, wire::Kind::kManifest, mine).with_context("sending the job manifest to rank 0"));
    SC_ASSIGN_OR_RETURN(Envelope ack, mailbox_->take(wire::Kind::kManifestAck, 0, 0, 0, 0, deadline,
                                                     transport_->peer_name(0)));
    std::string text(reinterpret_cast<const char*>(ack.payload.data()), ack.payload.size());
    if (text.rfind("ok ", 0) == 0) {
      total_trainers_ = static_cast<uint32_t>(std::strtoul(text.c_str() + 3, nullptr, 10));
      if (total_trainers_ == 0) return data_loss("rank 0 sent a job agreement without a trainer count");
      agreed_ = true;
      SC_LOG_INFO("job agreed: %u trainers across %u nodes", total_trainers_, options_.world_size);
      return Status::Ok();
    }
    return failed_precondition("nodes disagree: " + (text.rfind("error ", 0) == 0 ? text.substr(6) : text));
  }

  // Rank 0: gather every manifest, compare, answer everyone.
  uint32_t total = options_.local_clients;
  std::string error;
  for (uint32_t peer = 1; peer < options_.world_size; ++peer) {
    auto got = mailbox_->take(wire::Kind::kManifest, peer, 0, 0, 0, deadline, transport_->peer_name(peer));
    if (!got.ok()) {
      error = "no job manifest from " + transport_->peer_name(peer) + ": " + got.status().message();
      break;
    }
    std::string theirs(reinterpret_cast<const char*>(got->payload.data()), got->payload.size());
    std::string diff = manifest_difference(mine, theirs, peer);
    if (!diff.empty() && error.empty()) error = diff;
    total += local_clients_of(theirs);
  }
  const std::string verdict = error.empty() ? "ok " + std::to_string(total) : "error " + error;
  for (uint32_t peer = 1; peer < options_.world_size; ++peer) {
    send_text(peer, wire::Kind::kManifestAck, verdict).ignore();
  }
  if (!error.empty()) return failed_precondition("nodes disagree: " + error);
  total_trainers_ = total;
  agreed_ = true;
  SC_LOG_INFO("job agreed: %u trainers across %u nodes", total_trainers_, options_.world_size);
  return Status::Ok();
}

}  // namespace sparsecar
