// StepCollector: see step_collector.h. Moved out of the session server unchanged: the same checks
// in the same order, the same messages, the same sums.
#include "daemon/session/step_collector.h"

#include <unistd.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>

#include "sparsecar/common/large_vector.h"
#include "sparsecar/common/log.h"
#include "sparsecar/common/session_protocol.h"

namespace sparsecar {
namespace {

std::string mib(uint64_t bytes) { return fmt::format("{:.1f} MiB", static_cast<double>(bytes) / (1 << 20)); }

void bump(std::atomic<uint64_t>& c) { c.fetch_add(1, std::memory_order_relaxed); }

}  // namespace

uint64_t slot_footprint(uint64_t count) {
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  return (count * sizeof(float) + page - 1) / page * page;
}

// What a device step's keepalive owns: every participant's mappings (OpenedDevice::keepalive).
struct StepCollector::DeviceLease {
  std::vector<std::shared_ptr<const void>> owners;
};

struct StepCollector::Tensor {
  uint32_t id = 0;
  std::string name;
  uint64_t count = 0;
  std::vector<uint64_t> shape;  // empty: registered without a shape
  bool on_device = false;       // RegisterDevice: no local_sum/result, the clients' GPU buffers
  std::string first_client;     // label of the client that registered it first (errors)
  LargeVector<float> local_sum;  // huge-page backed: the pipeline streams over it
  LargeVector<float> result;     // the decoders scatter into it
  // Device tensors: the step in flight's buffers (StepJob::device points here; rewritten only
  // when a step is dispatched, never while one is in flight) and the keepalive it was lent.
  std::vector<DeviceBuffer> device_buffers;
  std::shared_ptr<DeviceLease> lease;
  bool has_last = false;
  uint64_t last_step = 0;  // last step handed to the pipeline
  // Being collected from the local clients.
  bool collecting = false;
  uint64_t collect_step = 0;
  std::vector<std::pair<uint32_t, float>> submitters;  // client id, lr
  bool collect_reduces = true;  // every submitter so far set kSubmitTrainerReduces
  bool collect_lease = true;    // ... and kSubmitTakesLease
  // Handed to the pipeline.
  bool in_flight = false;
  uint64_t flight_step = 0;
  std::vector<uint32_t> participants;
  uint64_t flight_generation = 0;  // generation_ when it was handed over (orphans are matched by it)
  // Charged to the tensor memory budget: local_sum + result + the pipeline's buffers.
  uint64_t bytes = 0;
  // Newest step failed job-wide through StepSink::fail_step (no duplicates).
  bool failed_job_wide = false;
  uint64_t failed_step = 0;
};

StepCollector::StepCollector(const StepCollectorOptions& options, StepSink* pipeline, CompletionSink* clients)
    : options_(options), pipeline_(pipeline), clients_sink_(clients) {
  SC_CHECK(pipeline_ != nullptr && clients_sink_ != nullptr, "a StepCollector needs a pipeline and a client sink");
}

StepCollector::~StepCollector() = default;

std::string StepCollector::label_of(uint32_t client) const {
  auto it = clients_.find(client);
  return it != clients_.end() ? it->second.label : fmt::format("client {}", client);
}

void StepCollector::charge(uint64_t bytes) {
  bytes_in_use_ += bytes;
  counters_.tensor_bytes_in_use.store(bytes_in_use_);
}

void StepCollector::release(uint64_t bytes) {
  bytes_in_use_ -= std::min(bytes, bytes_in_use_);
  counters_.tensor_bytes_in_use.store(bytes_in_use_);
}

// ---- clients -------------------------------------------------------------------------------------

void StepCollector::client_joined(uint32_t client, std::string label) {
  clients_[client].label = std::move(label);
  if (clients_.size() == options_.local_clients && !lost_client_.empty()) {
    SC_LOG_INFO("{} replaces {}", clients_[client].label, lost_client_);
    lost_client_.clear();
  }
}

void StepCollector::client_left(uint32_t client, const std::string& reason, bool fail_owed) {
  auto it = clients_.find(client);
  if (it == clients_.end()) return;
  const std::string label = it->second.label;
  if (clients_.size() > 1) lost_client_ = label + " disconnected (" + reason + ")";
  if (fail_owed) fail_owed_steps(label, reason);
  for (auto& t : tensors_) {
    if (t->collecting) {
      Status st = aborted(fmt::format("local {} disconnected ({}) before step {} of tensor '{}' completed",
                                 label, reason, static_cast<unsigned long long>(t->collect_step),
                                 t->name));
      fail_collecting(*t, st, client);
    }
    if (t->in_flight) std::erase(t->participants, client);
  }
  for (const auto& [tid, slot] : it->second.slots) release(slot_footprint(slot.size()));
  // Drops the client's OpenedDevices: a step in flight still holds their mappings (its lease).
  clients_.erase(it);
}

// ---- registration --------------------------------------------------------------------------------

Status StepCollector::plan_registration(uint32_t client, const RegisterRequest& m, Plan* plan) {
  auto name_field = proto::field_string(m.name, proto::kNameBytes);
  if (!name_field) return invalid_argument("tensor name is not NUL-terminated within 256 bytes");
  std::string name(*name_field);
  if (name.empty()) return invalid_argument("tensor name is empty");
  if (!m.malformed.empty()) return invalid_argument(fmt::format("tensor '{}': {}", name, m.malformed));
  if (m.dtype != 0) {
    return invalid_argument(fmt::format("tensor '{}': unsupported dtype {} (only fp32 = 0)", name, m.dtype));
  }
  if (m.count == 0) return invalid_argument(fmt::format("tensor '{}' has 0 elements", name));
  if (m.count > options_.max_tensor_elements || m.count > SIZE_MAX / sizeof(float)) {
    return resource_exhausted(fmt::format("tensor '{}' has {} elements; the daemon allows at most {}", name,
                                     static_cast<unsigned long long>(m.count),
                                     static_cast<unsigned long long>(options_.max_tensor_elements)));
  }
  if (Status st = check_shape(m.count, m.shape); !st.ok()) {
    return st.with_context(fmt::format("tensor '{}'", name));
  }
  const bool on_device = m.device.has_value();
  // Charged before anything is allocated; over the budget is kResourceExhausted, not an OOM kill.
  // A device tensor has no shm slot and no host buffers of the session: only the pipeline's.
  const uint64_t budget = options_.budget_bytes;
  const uint64_t slot_bytes = on_device ? 0 : slot_footprint(m.count);
  auto over_budget = [&](uint64_t tensor_bytes, uint64_t pipeline_bytes) -> Status {
    const uint64_t need = slot_bytes + tensor_bytes + pipeline_bytes;
    if (need <= budget && bytes_in_use_ <= budget - need) return Status::Ok();
    bump(counters_.registrations_over_budget);
    size_t slots = 0;
    for (const auto& [cid, other] : clients_) slots += other.slots.size();
    // Most telling first: the client's message field is short (the log line has all of it).
    return resource_exhausted(fmt::format(
        "tensor_memory_budget_bytes = {} exceeded: tensor '{}' ({} elements) needs {} bytes, {} are in "
        "use ({} tensors, {} slots); needs = shm slot {} + session {} + pipeline {}",
        static_cast<unsigned long long>(budget), name, static_cast<unsigned long long>(m.count),
        static_cast<unsigned long long>(need), static_cast<unsigned long long>(bytes_in_use_),
        tensors_.size() + orphans_.size(), slots, mib(slot_bytes), mib(tensor_bytes),
        mib(pipeline_bytes)));
  };
  plan->name = name;
  plan->existing = nullptr;
  plan->session_bytes = 0;
  plan->pipeline_bytes = 0;
  if (auto it = tensor_ids_.find(name); it != tensor_ids_.end()) {
    Tensor* t = tensors_[it->second].get();
    if (t->count != m.count) {
      return invalid_argument(fmt::format("tensor '{}' is registered with {} elements; {} asked for {}", name,
                                     static_cast<unsigned long long>(t->count), label_of(client),
                                     static_cast<unsigned long long>(m.count)));
    }
    if (t->shape != m.shape) {
      return invalid_argument(fmt::format("tensor '{}' is registered with shape {}; {} asked for {}", name,
                                     shape_text(t->shape), label_of(client),
                                     shape_text(m.shape)));
    }
    if (t->on_device != on_device) {
      auto kind = [](bool device) { return device ? "a GPU tensor (RegisterDevice)" : "a host tensor"; };
      return invalid_argument(fmt::format("tensor '{}' is registered as {} by {}; {} asked for {}: every local "
                                     "trainer must register a name the same way",
                                     name, kind(t->on_device), t->first_client, label_of(client),
                                     kind(on_device)));
    }
    auto c = clients_.find(client);
    if (c != clients_.end() && c->second.has(t->id)) {
      return Status(Code::kAlreadyExists, fmt::format("tensor '{}' is already registered by this client", name));
    }
    if (Status st = over_budget(0, 0); !st.ok()) return st;
    plan->existing = t;
    return Status::Ok();
  }
  if (tensors_.size() >= options_.max_tensors) {
    return resource_exhausted(
        fmt::format("tensor '{}': the daemon allows at most {} tensors", name, options_.max_tensors));
  }
  TensorSpec spec{name, m.count, m.shape};
  spec.on_device = on_device;
  plan->session_bytes = on_device ? 0 : 2 * m.count * sizeof(float);  // local_sum + result
  plan->pipeline_bytes = pipeline_->tensor_footprint_bytes(spec);
  return over_budget(plan->session_bytes, plan->pipeline_bytes);
}

Status StepCollector::check_registration(uint32_t client, const RegisterRequest& request) {
  Plan plan;
  return plan_registration(client, request, &plan);
}

Expected<StepCollector::Registration> StepCollector::register_tensor(uint32_t client, const RegisterRequest& m) {
  Plan plan;
  SC_RETURN_IF_ERROR(plan_registration(client, m, &plan));
  Tensor* t = plan.existing;
  if (t == nullptr) {
    const bool on_device = m.device.has_value();
    TensorSpec spec{plan.name, m.count, m.shape};
    spec.on_device = on_device;
    auto fresh = std::make_unique<Tensor>();
    fresh->id = static_cast<uint32_t>(tensors_.size());
    fresh->name = plan.name;
    fresh->count = m.count;
    fresh->shape = m.shape;
    fresh->on_device = on_device;
    fresh->first_client = label_of(client);
    fresh->bytes = plan.session_bytes + plan.pipeline_bytes;
    try {
      if (on_device) {
        fresh->device_buffers.reserve(options_.local_clients);  // no allocation per step
      } else {
        fresh->local_sum.resize(m.count);
        fresh->result.resize(m.count);
      }
    } catch (const std::bad_alloc&) {
      return resource_exhausted(fmt::format("tensor '{}': cannot allocate 2 x {} floats", plan.name,
                                       static_cast<unsigned long long>(m.count)));
    }
    Status st = pipeline_->register_tensor(fresh->id, spec);
    if (!st.ok()) return st.with_context(fmt::format("tensor '{}'", plan.name));
    charge(fresh->bytes);
    t = fresh.get();
    tensor_ids_.emplace(plan.name, fresh->id);
    tensors_.push_back(std::move(fresh));
  }
  return Registration{t->id, t->count, t->name, t->shape};
}

void StepCollector::attach_slot(uint32_t client, uint32_t tensor_id, std::span<float> slot) {
  auto it = clients_.find(client);
  SC_CHECK(it != clients_.end(), "slot of tensor {} attached to client {}, which has not joined", tensor_id, client);
  SC_CHECK(tensor_id < tensors_.size() && slot.size() == tensors_[tensor_id]->count &&
               !tensors_[tensor_id]->on_device,
           "slot of {} floats attached for tensor {}", slot.size(), tensor_id);
  charge(slot_footprint(slot.size()));
  it->second.slots[tensor_id] = slot;
}

void StepCollector::detach_slot(uint32_t client, uint32_t tensor_id) {
  auto it = clients_.find(client);
  if (it == clients_.end()) return;
  auto slot = it->second.slots.find(tensor_id);
  if (slot == it->second.slots.end()) return;
  release(slot_footprint(slot->second.size()));
  it->second.slots.erase(slot);
}

void StepCollector::attach_device(uint32_t client, uint32_t tensor_id, OpenedDevice opened) {
  auto it = clients_.find(client);
  SC_CHECK(it != clients_.end(), "device tensor {} attached to client {}, which has not joined", tensor_id,
           client);
  SC_CHECK(tensor_id < tensors_.size() && tensors_[tensor_id]->on_device,
           "device buffer attached for tensor {}, which is not a device tensor", tensor_id);
  it->second.devices[tensor_id] = std::move(opened);
}

void StepCollector::detach_device(uint32_t client, uint32_t tensor_id) {
  auto it = clients_.find(client);
  if (it != clients_.end()) it->second.devices.erase(tensor_id);
}

// ---- steps ---------------------------------------------------------------------------------------

void StepCollector::submit(uint32_t client, const shm::Submission& s) {
  bump(counters_.submissions);
  auto reject = [&](const Status& st) {
    bump(counters_.submissions_rejected);
    SC_LOG_WARN("{}: submission refused: {}", label_of(client), st.message());
    clients_sink_->post(client, s.tensor_id, s.step, st, nullptr);
  };
  if ((s.flags & ~shm::kSubmitFlags) != 0 || s.reserved != 0 ||
      ((s.flags & shm::kSubmitTakesLease) != 0 && (s.flags & shm::kSubmitTrainerReduces) == 0)) {
    return reject(invalid_argument("submission has unknown flags (or takes a lease without reducing dense steps) or a "
                                   "non-zero reserved field"));
  }
  if (!std::isfinite(s.lr) || s.lr < 0.0f) {
    return reject(
        invalid_argument(fmt::format("learning rate {:g} is not a finite value >= 0", static_cast<double>(s.lr))));
  }
  auto c = clients_.find(client);
  if (c == clients_.end() || !c->second.has(s.tensor_id) || s.tensor_id >= tensors_.size()) {
    return reject(not_found(fmt::format("unknown tensor id {} (not registered by this client)", s.tensor_id)));
  }
  Tensor& t = *tensors_[s.tensor_id];
  auto step = static_cast<unsigned long long>(s.step);
  if (!lost_client_.empty() && clients_.size() < options_.local_clients) {
    Status st = aborted(fmt::format("tensor '{}' step {}: local {}; this node cannot complete steps "
                               "until {} local clients are connected again",
                               t.name, step, lost_client_, options_.local_clients));
    if (!t.in_flight && !(t.has_last && s.step <= t.last_step)) fail_job_wide(t, s.step, st.message());
    return reject(st);
  }
  if (t.in_flight) {
    return reject(failed_precondition(
        fmt::format("tensor '{}': step {} is still in flight; wait for it before submitting step {}", t.name,
               static_cast<unsigned long long>(t.flight_step), step)));
  }
  if (t.collecting) {
    for (const auto& sub : t.submitters) {
      if (sub.first == client) {
        return reject(failed_precondition(fmt::format("tensor '{}': step {} submitted twice", t.name, step)));
      }
    }
    if (s.step != t.collect_step) {
      Status st = failed_precondition(
          fmt::format("local clients disagree on the step of tensor '{}': {} submitted step {}, "
                 "client {} submitted step {}",
                 t.name, label_of(client), step, t.submitters.front().first,
                 static_cast<unsigned long long>(t.collect_step)));
      fail_collecting(t, st, 0);
      return reject(st);
    }
  } else {
    if (t.has_last && s.step <= t.last_step) {
      return reject(out_of_range(fmt::format("tensor '{}': step {} is not greater than its last step {}",
                                        t.name, step, static_cast<unsigned long long>(t.last_step))));
    }
    t.collecting = true;
    t.collect_step = s.step;
    t.submitters.clear();
    t.collect_reduces = true;
    t.collect_lease = true;
  }
  t.submitters.emplace_back(client, s.lr);
  t.collect_reduces = t.collect_reduces && (s.flags & shm::kSubmitTrainerReduces) != 0;
  t.collect_lease = t.collect_lease && (s.flags & shm::kSubmitTakesLease) != 0;
  if (t.submitters.size() >= options_.local_clients) dispatch(t);
}

void StepCollector::fail_collecting(Tensor& t, const Status& st, uint32_t except_client) {
  for (const auto& sub : t.submitters) {
    if (sub.first == except_client) continue;
    clients_sink_->post(sub.first, t.id, t.collect_step, st, nullptr);
  }
  bump(counters_.steps_failed);
  t.collecting = false;
  t.submitters.clear();
}

void StepCollector::release_lease(Tensor& t) {
  if (!t.lease) return;
  if (t.lease.use_count() == 1) {
    // The pipeline let go: drop the mappings' refs now and keep the vector for the next step.
    std::atomic_thread_fence(std::memory_order_acquire);
    t.lease->owners.clear();
  } else {
    t.lease.reset();  // the pipeline still holds it; its last owner frees it
  }
}

void StepCollector::dispatch(Tensor& t) {
  std::sort(t.submitters.begin(), t.submitters.end());
  StepJob job;
  if (t.on_device) {
    // No host data: the clients' buffers in client-id order, and one keepalive for all of them.
    if (!t.lease || t.lease.use_count() != 1) {
      t.lease = std::make_shared<DeviceLease>();
      t.lease->owners.reserve(options_.local_clients);
    } else {
      std::atomic_thread_fence(std::memory_order_acquire);  // pairs with the last owner's release
    }
    t.lease->owners.clear();
    t.device_buffers.clear();
    for (const auto& sub : t.submitters) {
      auto c = clients_.find(sub.first);
      SC_CHECK(c != clients_.end() && c->second.devices.count(t.id) == 1, "submitter {} of device tensor {} vanished",
               sub.first, t.id);
      const OpenedDevice& d = c->second.devices[t.id];
      t.device_buffers.push_back(d.buffer);
      t.lease->owners.push_back(d.keepalive);
    }
    job.device = std::span<const DeviceBuffer>(t.device_buffers.data(), t.device_buffers.size());
    job.keepalive = t.lease;
  } else {
    sum_inputs_.clear();
    for (const auto& sub : t.submitters) {
      auto c = clients_.find(sub.first);
      SC_CHECK(c != clients_.end() && c->second.slots.count(t.id) == 1, "submitter {} of tensor {} vanished",
               sub.first, t.id);
      sum_inputs_.push_back(c->second.slots[t.id].data());
    }
    float* out = t.local_sum.data();
    const size_t count = t.count;
    if (sum_inputs_.size() == 1) {
      std::memcpy(out, sum_inputs_[0], count * sizeof(float));
    } else {
      // float64 accumulation in client order, rounded once: the same sum whatever L is.
      for (size_t i = 0; i < count; ++i) {
        double acc = 0.0;
        for (const float* in : sum_inputs_) acc += static_cast<double>(in[i]);
        out[i] = static_cast<float>(acc);
      }
    }
    job.local_sum = std::span<const float>(out, count);
    job.result = std::span<float>(t.result.data(), count);
  }
  job.tensor_id = t.id;
  job.step = t.collect_step;
  job.lr = t.submitters.front().second;
  job.trainer_reduces = t.collect_reduces;
  job.takes_lease = t.collect_reduces && t.collect_lease;
  job.generation = generation_;
  t.in_flight = true;
  t.flight_step = t.collect_step;
  t.flight_generation = generation_;
  t.participants.clear();
  for (const auto& sub : t.submitters) t.participants.push_back(sub.first);
  t.has_last = true;
  t.last_step = t.collect_step;
  t.collecting = false;
  t.submitters.clear();
  bump(counters_.steps_dispatched);
  pipeline_->submit(job);  // may answer at once (the server only queues it)
}

void StepCollector::on_result(const StepResult& r) {
  if (r.generation != generation_) {
    // The pipeline is done with the buffers of that step: free the orphan that lent them.
    auto orphan = std::find_if(orphans_.begin(), orphans_.end(), [&](const auto& o) {
      return o->id == r.tensor_id && o->flight_step == r.step && o->flight_generation == r.generation;
    });
    if (orphan != orphans_.end()) {
      free_orphan(static_cast<size_t>(orphan - orphans_.begin()));
      return;
    }
  }
  Tensor* t = r.tensor_id < tensors_.size() ? tensors_[r.tensor_id].get() : nullptr;
  if (r.generation != generation_ || t == nullptr || !t->in_flight || t->flight_step != r.step) {
    bump(counters_.stale_results);
    SC_LOG_WARN("dropping a result for tensor {} step {}: no such step in flight", r.tensor_id,
                static_cast<unsigned long long>(r.step));
    return;
  }
  t->in_flight = false;
  bump(r.status.ok() ? counters_.steps_completed : counters_.steps_failed);
  for (uint32_t id : t->participants) {
    if (!clients_sink_->reachable(id)) continue;
    auto c = clients_.find(id);
    if (c == clients_.end()) continue;
    if (t->on_device) {
      // The pipeline wrote the average into the client's GPU buffer and recorded its done event.
      if (c->second.devices.count(t->id) == 0) continue;
    } else {
      auto slot = c->second.slots.find(t->id);
      if (slot == c->second.slots.end()) continue;
      if (r.status.ok()) std::memcpy(slot->second.data(), t->result.data(), t->count * sizeof(float));
    }
    clients_sink_->post(id, t->id, r.step, r.status, &r);
  }
  t->participants.clear();
  release_lease(*t);
}

// ---- disconnects and job resets ------------------------------------------------------------------

void StepCollector::fail_job_wide(Tensor& t, uint64_t step, const std::string& reason) {
  if (t.failed_job_wide && t.failed_step >= step) return;
  t.failed_job_wide = true;
  t.failed_step = step;
  bump(counters_.steps_failed_job_wide);
  SC_LOG_WARN("failing tensor '{}' step {} job-wide: {}", t.name, static_cast<unsigned long long>(step),
              reason);
  pipeline_->fail_step(t.id, step, reason);
}

void StepCollector::fail_owed_steps(const std::string& dead_label, const std::string& why) {
  // The step the dead trainer was in: the newest one any tensor of this node reached.
  bool any = false;
  uint64_t current = 0;
  auto reached = [&](uint64_t step) {
    current = any ? std::max(current, step) : step;
    any = true;
  };
  for (const auto& t : tensors_) {
    if (t->collecting) reached(t->collect_step);
    if (t->has_last) reached(t->last_step);
  }
  if (!any) return;  // no step yet: the peers wait for nothing of ours
  bool mid_step = false;
  for (const auto& t : tensors_) {
    const bool at_current =
        (t->collecting && t->collect_step == current) || (t->has_last && t->last_step == current);
    mid_step = mid_step || !at_current;
  }
  const std::string who = fmt::format("local trainer {} disconnected ({})", dead_label, why);
  for (auto& t : tensors_) {
    if (t->collecting) {
      fail_job_wide(*t, t->collect_step,
                    fmt::format("{} before every local trainer submitted step {} of tensor '{}'", who,
                           static_cast<unsigned long long>(t->collect_step), t->name));
    } else if (mid_step && !(t->has_last && t->last_step >= current)) {
      fail_job_wide(*t, current, fmt::format("{} in step {} before it submitted tensor '{}'", who,
                                        static_cast<unsigned long long>(current), t->name));
    }
    // Between steps (every tensor reached `current`) nothing is failed: that is also how every
    // job ends, and the next step number is only a guess.
  }
}

void StepCollector::free_orphan(size_t index) {
  std::unique_ptr<Tensor> t = std::move(orphans_[index]);
  orphans_.erase(orphans_.begin() + static_cast<std::ptrdiff_t>(index));
  counters_.orphaned_tensors.store(orphans_.size());
  release(t->bytes);
  SC_LOG_DEBUG("freed tensor '{}' of a reset job: the pipeline answered its step {}", t->name,
               static_cast<unsigned long long>(t->flight_step));
}

void StepCollector::reset_job() {
  for (auto& t : tensors_) {
    if (t->in_flight) {
      orphans_.push_back(std::move(t));  // the pipeline still holds its buffers until it answers
    } else {
      release(t->bytes);
    }
  }
  counters_.orphaned_tensors.store(orphans_.size());
  ++generation_;  // a late answer of this job never matches a step of the next one
  tensors_.clear();
  tensor_ids_.clear();
  lost_client_.clear();
}

}  // namespace sparsecar
