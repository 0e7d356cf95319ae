#include "daemon/daemon.h"

#include <cstdlib>

#include "daemon/collective/mailbox.h"
#include "daemon/config/local_paths.h"
#include "daemon/control/control_server.h"
#include "daemon/control/daemon_backend.h"
#include "daemon/device/device_runtime.h"
#include "daemon/metrics/metrics.h"
#include "daemon/pipeline/controller_runner.h"
#include "daemon/pipeline/decisions.h"
#include "daemon/pipeline/observations.h"
#include "daemon/pipeline/pipeline.h"
#include "daemon/pipeline/settings.h"
#include "daemon/session/session_server.h"
#include "daemon/transport/fault_injection.h"
#include "daemon/transport/ucx_transport.h"
#include "sparsecar/common/log.h"
#include "sparsecar/policies/plan.h"

namespace sparsecar {

struct Daemon::Parts {
  // Takes the parts down in the reverse of start's order, stopping every thread that could call
  // into another part before any part is freed: also when start() fails half-way (the mailbox's
  // control handler and the scrape hook hold raw pointers to later parts).
  ~Parts() {
    if (control) control->stop();
    if (metrics) metrics->set_scrape_hook(nullptr);
    if (sessions) sessions->stop();
    if (pipeline) pipeline->stop();
    if (faults) faults->stop();
    if (transport) transport->stop();
  }
  // Taken first, released last (after the sockets they guard are closed and removed).
  LocalClaims claims;
  std::unique_ptr<Metrics> metrics;
  std::unique_ptr<Mailbox> mailbox;
  std::unique_ptr<UcxTransport> transport;
  std::unique_ptr<FaultyTransport> faults;  // tests only: SPARSECAR_TEST_FAULTS
  Transport* net = nullptr;                 // what the parts send through: faults or transport
  std::unique_ptr<DecisionBoard> decisions;
  std::unique_ptr<ControllerRunner> controllers;  // rank 0 only
  std::unique_ptr<ObservationCollector> observations;
  // Trainers' GPU tensors (CUDA IPC); freed after the sessions and the pipeline that use it.
  std::unique_ptr<DeviceRuntime> devices;
  std::unique_ptr<Pipeline> pipeline;
  std::unique_ptr<SessionServer> sessions;
  std::unique_ptr<control::DaemonBackend> backend;
  std::unique_ptr<control::Dispatcher> dispatcher;
  std::unique_ptr<control::ControlServer> control;
  std::chrono::milliseconds peer_down_grace{0};
  // What every part reads time through (the production clock; tests of the parts pass a fake).
  const Clock* clock = &steady_clock();
};

Daemon::Daemon(std::unique_ptr<Parts> parts) : parts_(std::move(parts)) {}
Daemon::~Daemon() { stop(); }

Expected<std::unique_ptr<Daemon>> Daemon::start(const Config& config) {
  // The same checks as --check-config (one function), before anything is opened.
  SC_RETURN_IF_ERROR(validate(config).with_context("configuration"));
  auto parts = std::make_unique<Parts>();
  const Clock& clock = steady_clock();
  parts->clock = &clock;
  parts->peer_down_grace = std::chrono::milliseconds(config.peer_down_grace_ms);
  // Everything that can clash with another daemon on this host is checked before joining, so a
  // mistake fails this daemon alone and at once (local_paths.h).
  auto claims = claim_local_paths(config);
  if (!claims.ok()) return claims.status();
  parts->claims = std::move(claims).value();
  MetricsOptions mo;
  mo.rank = config.rank;
  mo.world_size = config.world_size;
  const std::string metrics_listen = resolved_metrics_listen(config);
  auto metrics = Metrics::create(metrics_listen, mo);
  if (!metrics.ok()) {
    return metrics.status().with_context(
        "--metrics-listen " + config.metrics_listen + " (" + metrics_listen +
        " taken? pick a free ADDRESS:PORT with --metrics-listen, or 'off'; 'auto' is 127.0.0.1:" +
        std::to_string(kMetricsBasePort) + "+rank)");
  }
  parts->metrics = std::move(metrics).value();
  parts->mailbox = std::make_unique<Mailbox>(config.job_id, config.world_size, parts->metrics.get(),
                                             config.mailbox_max_bytes, clock);

  // The job secret is read once, here, and only its derived key is kept (never logged).
  auto key = auth::load_job_key(config.job_secret_file);
  if (!key.ok()) return key.status().with_context("reading job_secret_file");
  if (key->open && config.world_size > 1) {
    SC_LOG_WARN("the job is open: any host that reaches the coordinator port ({}) can join; set job_secret_file",
                config.coordinator);
  }

  if (config.world_size > 1) {
    UcxTransportOptions t;
    t.rank = config.rank;
    t.world_size = config.world_size;
    t.job_id = config.job_id;
    t.coordinator = config.coordinator;
    t.tls = config.ucx_tls;
    t.net_devices = config.ucx_net_devices;
    t.rendezvous_timeout = std::chrono::milliseconds(config.join_timeout_ms);
    t.key = *key;
    t.accept_replacements = config.accept_replacements;
    t.clock = &clock;
    SC_LOG_INFO("rank {} of {}: joining the job through {}", config.rank, config.world_size,
                config.coordinator);
    auto transport = UcxTransport::start(t, parts->mailbox.get());
    if (!transport.ok()) return transport.status().with_context("joining the job");
    parts->transport = std::move(transport).value();
    const UcxTransportStats joined = parts->transport->stats();
    if (const uint64_t refused = joined.rendezvous_auth_failures + joined.rendezvous_refused; refused > 0) {
      parts->metrics->count_error(ErrorKind::kJoinRefused, static_cast<double>(refused));
    }
    parts->net = parts->transport.get();
    if (const char* spec = std::getenv("SPARSECAR_TEST_FAULTS"); spec != nullptr && *spec != '\0') {
      auto faults = parse_fault_spec(spec);
      if (!faults.ok()) return faults.status();
      SC_LOG_WARN("SPARSECAR_TEST_FAULTS is set: this daemon drops, corrupts, duplicates, delays and reorders "
                  "its messages on purpose ({}); never use it outside tests", spec);
      parts->faults = std::make_unique<FaultyTransport>(parts->transport.get(), *faults, clock);
      parts->net = parts->faults.get();
    }
  }

  parts->decisions = std::make_unique<DecisionBoard>(config, parts->net, clock);
  // Controllers run on rank 0; every node measures its steps and sends them there.
  if (config.rank == 0) {
    parts->controllers = std::make_unique<ControllerRunner>(config, parts->decisions.get(), clock);
    parts->controllers->set_decision_listener(
        [metrics = parts->metrics.get()](const std::string& controllers, const std::string& outcome) {
          metrics->count_decision(controllers, outcome);
        });
  }
  parts->observations = std::make_unique<ObservationCollector>(config.rank, config.job_id, parts->net,
                                                               parts->controllers.get(), clock,
                                                               parts->metrics.get());
  parts->mailbox->set_control_handler([board = parts->decisions.get(), runner = parts->controllers.get()](
                                          uint32_t peer, const wire::WireHeader& h, std::span<const std::byte> payload) {
    if (h.kind == static_cast<uint16_t>(wire::Kind::kObservation)) {
      if (runner == nullptr) return;  // only rank 0 runs controllers
      auto o = parse_observation(std::string_view(reinterpret_cast<const char*>(payload.data()), payload.size()));
      if (!o.ok()) {
        SC_LOG_WARN("bad observation from rank {}: {}", peer, o.status().to_string());
        return;
      }
      o->rank = peer;  // the transport knows who sent it
      runner->add(*o);
      return;
    }
    board->on_message(peer, h, payload);
  });

  PipelineOptions p;
  p.rank = config.rank;
  p.world_size = config.world_size;
  p.job_id = config.job_id;
  p.local_clients = config.local_clients;
  p.settings = settings_from_config(config);
  p.agreed_knobs = agreed_knobs(config);
  p.step_timeout = std::chrono::milliseconds(config.step_timeout_ms);
  p.join_timeout = std::chrono::milliseconds(config.join_timeout_ms);
  p.kernel_threads = config.kernel_threads;
  p.trainer_lease = config.trainer_lease;
  p.progress_interval = std::chrono::milliseconds(static_cast<int64_t>(config.progress_log_seconds * 1000.0));
  parts->pipeline = std::make_unique<Pipeline>(p, parts->net, parts->mailbox.get(), parts->metrics.get(),
                                               parts->decisions.get(), clock);

  SessionServerOptions s;
  s.socket_path = config.socket;
  s.local_clients = config.local_clients;
  s.handshake_timeout = std::chrono::milliseconds(config.session_handshake_timeout_ms);
  s.tensor_memory_budget_bytes = config.tensor_memory_budget_bytes;
  parts->devices = make_device_runtime();
  if (Status st = parts->devices->available(); !st.ok()) SC_LOG_INFO("{}", st.message());
  auto sessions = SessionServer::start(s, parts->pipeline.get(), clock, parts->devices.get());
  if (!sessions.ok()) return sessions.status().with_context("opening the trainer socket");
  parts->sessions = std::move(sessions).value();
  parts->pipeline->set_result_sink(parts->sessions.get());
  parts->pipeline->set_observer(parts->observations.get());
  parts->pipeline->start();

  control::DaemonParts dp;
  dp.config = config;
  dp.metrics = parts->metrics.get();
  dp.mailbox = parts->mailbox.get();
  dp.transport = parts->net;
  dp.decisions = parts->decisions.get();
  dp.pipeline = parts->pipeline.get();
  dp.sessions = parts->sessions.get();
  dp.clock = &clock;
  dp.controllers = parts->controllers.get();
  parts->backend = std::make_unique<control::DaemonBackend>(dp);
  parts->metrics->set_scrape_hook([backend = parts->backend.get()] { backend->refresh_metrics(); });
  const std::string endpoint = resolved_control_endpoint(config);
  Status usable = control::check_endpoint(endpoint, config.control_token, config.control_curve_secret_key);
  if (config.control == "auto" && !usable.ok()) {
    SC_LOG_WARN("no control socket: {} (set --control to a shorter ipc:// path)", usable.message());
  } else if (config.control != "off") {
    control::DispatcherOptions d;
    d.max_message_bytes = config.control_max_message_bytes;
    d.token = config.control_token;
    parts->dispatcher = std::make_unique<control::Dispatcher>(parts->backend.get(), parts->metrics.get(), d);
    control::ControlServerOptions c;
    c.endpoint = endpoint;
    c.group = config.control_group;
    c.token = config.control_token;
    c.curve_secret_key = config.control_curve_secret_key;
    c.max_message_bytes = config.control_max_message_bytes;
    c.lock_held = parts->claims.control_lock.held();
    auto server = control::ControlServer::start(c, parts->dispatcher.get());
    if (!server.ok()) return server.status().with_context("opening the control socket");
    parts->control = std::move(server).value();
  }

  policies::TensorObservation any;
  SC_LOG_INFO("rank {} of {} ready: trainers connect to {}; plan: {}", config.rank, config.world_size,
              config.socket, policies::describe(policies::static_plan(p.settings, any)));
  return std::unique_ptr<Daemon>(new Daemon(std::move(parts)));
}

void Daemon::stop() {
  // Reverse of start (Parts::~Parts): stop taking new work, finish or fail what is in flight,
  // then the network.
  parts_.reset();
}

Status Daemon::drain(std::chrono::milliseconds timeout) {
  if (!parts_ || !parts_->pipeline) return Status::Ok();
  return parts_->pipeline->drain(parts_->clock->now() + timeout);
}

Status Daemon::reload(const Config& before, const Config& after) {
  if (!parts_) return unavailable("the daemon is stopped");
  KnobChanges changes;
  for (const auto& spec : knob_table()) {
    const std::string old_value = get_knob(before, spec.name).value();
    const std::string new_value = get_knob(after, spec.name).value();
    if (old_value == new_value) continue;
    if (!spec.live) {
      SC_LOG_ERROR("reload: knob '{}' changed but cannot change while the daemon runs; keeping the running value "
                   "(restart to apply)", spec.name);
      continue;
    }
    changes.emplace_back(spec.name, new_value);
  }
  // What the next job starts from, whether or not this job takes the change (DecisionBoard::reset).
  parts_->decisions->set_configured(after);
  if (changes.empty()) {
    SC_LOG_INFO("reload: no live knob changed");
    return Status::Ok();
  }
  for (const auto& [name, value] : changes) {
    if (name == "log_level") {
      LogLevel level;
      if (parse_log_level(value, &level)) set_log_level(level);
    }
  }
  auto d = parts_->decisions->propose(changes, "reload", parts_->clock->now() + std::chrono::seconds(5));
  if (!d.ok()) {
    SC_LOG_ERROR("reload: {}", d.status().to_string());
    return d.status();
  }
  parts_->metrics->count_decision("control", "reload");
  SC_LOG_INFO("reload: epoch {} from step {}: {}", d->epoch, static_cast<unsigned long long>(d->effective_step),
              format_changes(changes));
  return Status::Ok();
}

Status Daemon::fatal() const {
  if (!parts_ || !parts_->mailbox || parts_->peer_down_grace.count() == 0) return Status::Ok();
  auto down = parts_->mailbox->peer_down_past(parts_->peer_down_grace);
  if (!down) return Status::Ok();
  return unavailable("rank " + std::to_string(down->peer) + " has been down for more than peer_down_grace_ms = " +
                     std::to_string(parts_->peer_down_grace.count()) + " (" + down->why.message() + ")");
}

std::vector<uint16_t> Daemon::metrics_ports() const {
  return parts_ && parts_->metrics ? parts_->metrics->listening_ports() : std::vector<uint16_t>{};
}

std::string Daemon::control_endpoint() const {
  return parts_ && parts_->control ? parts_->control->endpoint() : std::string();
}

}  // namespace sparsecar
