#include "daemon/control/daemon_backend.h"

#include <cstdio>

#include <cmath>

#include "daemon/collective/mailbox.h"
#include "daemon/metrics/metrics.h"
#include "daemon/pipeline/controller_runner.h"
#include "daemon/pipeline/pipeline.h"
#include "daemon/pipeline/settings.h"
#include "daemon/session/session_server.h"
#include "daemon/transport/transport.h"

namespace sparsecar::control {

using json = nlohmann::json;

namespace {
constexpr auto kProposeTimeout = std::chrono::seconds(5);

// The job's incarnation as 16 hex digits (as the daemon logs it), null between jobs.
json incarnation_text(uint64_t incarnation) {
  if (incarnation == 0) return nullptr;
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(incarnation));
  return std::string(buf);
}
// Bytes this node sent against a dense exchange of the same steps (pipeline/progress.h).
json traffic(const ProgressTotals& t) {
  return json{{"steps", t.steps},
              {"bytes_sent", t.bytes_sent},
              {"dense_bytes", t.dense_bytes},
              {"bytes_saved", t.bytes_saved()},
              {"compression_ratio", t.bytes_sent == 0 ? json(nullptr) : json(t.ratio())}};
}
// Rank 0's controllers: what runs, what they saw and decided, what the accuracy controller acts on.
json controllers_json(const ControllerRunner::Snapshot& s) {
  const policies::ControlStatus& c = s.status;
  auto known = [](double v) { return v > 0 ? json(v) : json(nullptr); };
  return json{{"active", s.active},
              {"steps_observed", s.steps_observed},
              {"steps_dropped", s.steps_dropped},
              {"proposals", c.proposals},
              {"last_reason", c.last_reason},
              {"failed", c.failed},
              {"failure", c.failure},
              {"goodput_Bps", known(c.goodput_Bps)},
              {"accuracy_signal", c.accuracy_signal.empty() ? json(nullptr) : json(c.accuracy_signal)},
              {"compression_error", known(c.compression_error)},
              {"compression_error_bound", known(c.compression_error_bound)},
              {"step_model", c.step_model.empty() ? json(nullptr) : json(c.step_model)},
              {"predicted_step_s", known(c.predicted_step_s)}};
}
}  // namespace

json DaemonBackend::status() {
  const Config& c = p_.config;
  const Decision d = p_.decisions->latest();
  json peers = json::array();
  for (uint32_t r = 0; r < c.world_size; ++r) {
    if (r == c.rank) continue;
    Status s = p_.mailbox->peer_status(r);
    json peer{{"rank", r}, {"state", s.ok() ? "up" : "down"}};
    if (p_.transport) peer["name"] = p_.transport->peer_name(r);
    if (!s.ok()) peer["error"] = s.message();
    peers.push_back(peer);
  }
  const PipelineSnapshot snap = p_.pipeline->snapshot();
  json groups = json::array();
  for (const auto& [name, g] : snap.groups) {
    if (g.tensors == 0) continue;
    json plans = json::object();
    for (const auto& [desc, n] : g.plans) plans[desc] = n;
    groups.push_back({{"group", name},
                      {"tensors", g.tensors},
                      {"elements", g.elements},
                      {"density", g.elements ? static_cast<double>(g.selected) / static_cast<double>(g.elements) : 0.0},
                      {"residual_norm", std::sqrt(g.residual_norm2)},
                      {"plans", plans}});
  }
  policies::TensorObservation any;
  any.world_size = c.world_size;
  const SessionStats ss = p_.sessions ? p_.sessions->stats() : SessionStats{};
  json out{{"job_id", c.job_id},
           {"rank", c.rank},
           {"world_size", c.world_size},
           {"leader", c.rank == 0},
           {"job_open", c.job_secret_file.empty()},
           {"incarnation", incarnation_text(p_.mailbox ? p_.mailbox->incarnation() : 0)},
           {"stale_messages", p_.mailbox ? p_.mailbox->stale() : 0},
           {"peers_rejoined", p_.mailbox ? p_.mailbox->rejoined() : 0},
           {"peers", peers},
           {"step", snap.has_step ? json(snap.last_step) : json(nullptr)},
           {"epoch", d.epoch},
           {"effective_step", d.effective_step},
           {"compression", d.config->compression},
           {"plan", policies::describe(policies::static_plan(settings_from_config(*d.config), any))},
           {"groups", groups},
           {"clients", {{"connected", p_.sessions ? p_.sessions->connected_clients() : 0},
                        {"expected", c.local_clients},
                        {"steps_completed", ss.steps_completed},
                        {"steps_failed", ss.steps_failed},
                        {"steps_failed_job_wide", ss.steps_failed_job_wide}}},
           {"tensor_memory", {{"in_use_bytes", ss.tensor_bytes_in_use},
                              {"budget_bytes", ss.tensor_memory_budget},
                              {"orphaned_tensors", ss.orphaned_tensors}}},
           {"traffic", {{"job", traffic(snap.job)}, {"since_start", traffic(snap.since_start)}}},
           {"total_trainers", snap.total_trainers},
           {"queued", snap.queued},
           {"draining", snap.draining}};
  if (p_.controllers != nullptr) out["controllers"] = controllers_json(p_.controllers->snapshot());
  if (p_.metrics) {
    auto ports = p_.metrics->listening_ports();
    if (!ports.empty()) out["metrics_port"] = ports[0];
  }
  return out;
}

Decision DaemonBackend::latest_decision() { return p_.decisions->latest(); }

Expected<Decision> DaemonBackend::propose(const KnobChanges& changes, const std::string& reason) {
  for (const auto& [name, value] : changes) {
    const KnobSpec* spec = find_knob(name);
    if (spec && spec->secret) return failed_precondition("knob '" + name + "' cannot change while the daemon runs");
  }
  return p_.decisions->propose(changes, reason, p_.clock->now() + kProposeTimeout);
}

Status DaemonBackend::report_metric(const std::string& name, double value, uint64_t step) {
  p_.pipeline->report_metric(name, value, step);
  return Status::Ok();
}

Expected<json> DaemonBackend::drain(std::chrono::milliseconds timeout, bool cancel) {
  if (cancel) {
    p_.pipeline->undrain();
    return json{{"draining", false}};
  }
  const auto started = p_.clock->now();
  SC_RETURN_IF_ERROR(p_.pipeline->drain(started + timeout));
  return json{{"draining", true},
              {"drained", true},
              {"seconds", std::chrono::duration<double>(p_.clock->now() - started).count()}};
}

namespace {
json checkpoint_json(const std::string& path, const CheckpointInfo& info) {
  return json{{"path", path},
              {"tensors", info.tensors},
              {"elements", info.elements},
              {"bytes", info.bytes},
              {"residual_norm", info.residual_norm}};
}
}  // namespace

Expected<json> DaemonBackend::checkpoint(const std::string& path) {
  SC_ASSIGN_OR_RETURN(CheckpointInfo info, p_.pipeline->checkpoint(path, p_.clock->now() + std::chrono::seconds(60)));
  return checkpoint_json(path, info);
}

Expected<json> DaemonBackend::restore(const std::string& path) {
  auto restored = p_.pipeline->restore(path, p_.clock->now() + std::chrono::seconds(60));
  if (!restored.ok()) {
    if (p_.metrics) p_.metrics->count_error(ErrorKind::kRestoreRejected);
    return restored.status();
  }
  const CheckpointInfo& info = *restored;
  return checkpoint_json(path, info);
}

void DaemonBackend::refresh_metrics() {
  Metrics* m = p_.metrics;
  if (!m) return;
  const Config& c = p_.config;
  for (uint32_t r = 0; r < c.world_size && r < Metrics::kMaxPeerLabels; ++r) {
    if (r != c.rank) m->set_peer_up(r, p_.mailbox->peer_status(r).ok());
  }
  const Decision d = p_.decisions->latest();
  m->decision_epoch.Set(d.epoch);
  m->compression_enabled.Set(d.config->compression ? 1 : 0);
  if (!p_.sessions) return;
  m->connected_clients.Set(p_.sessions->connected_clients());
  const SessionStats s = p_.sessions->stats();
  auto add = [&](ErrorKind kind, uint64_t now, uint64_t& last) {
    if (now > last) m->count_error(kind, static_cast<double>(now - last));
    last = now;
  };
  add(ErrorKind::kSessionProtocol, s.protocol_errors, last_.protocol);
  add(ErrorKind::kClientRejected, s.clients_rejected, last_.clients);
  add(ErrorKind::kRegistrationRejected, s.registrations_rejected, last_.registrations);
  add(ErrorKind::kSubmissionRejected, s.submissions_rejected, last_.submissions);
  add(ErrorKind::kRegistrationOverBudget, s.registrations_over_budget, last_.over_budget);
  add(ErrorKind::kHandshakeEvicted, s.handshakes_evicted, last_.evicted);
  add(ErrorKind::kRegistrationDeviceRefused, s.registrations_device_refused, last_.device_refused);
  m->tensor_memory_in_use.Set(static_cast<double>(s.tensor_bytes_in_use));
  m->tensor_memory_budget.Set(static_cast<double>(s.tensor_memory_budget));
}

}  // namespace sparsecar::control
