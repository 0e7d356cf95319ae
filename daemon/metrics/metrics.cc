#include "daemon/metrics/metrics.h"

#include <prometheus/exposer.h>
#include <prometheus/text_serializer.h>

#include <cctype>
#include <cmath>
#include <sstream>

#include "daemon/metrics/catalogue.h"
#include "daemon/transport/transport.h"
#include "sparsecar/common/log.h"

namespace sparsecar {
namespace {

using prometheus::Counter;
using prometheus::Family;
using prometheus::Gauge;
using prometheus::Histogram;

// 10 us .. 10 s, 1 and 2.5 per decade. prometheus-cpp prints a bound with "%.16g", so each must
// be a double whose 16-digit form is its short decimal: 0.00064 prints le="0.0006400000000000001"
// (what the computed 1e-5 * 4^i bounds showed) and 0.0006 "0.0005999999999999999"; these print as
// written (metrics_test HistogramBucketLabelsAreCleanDecimals reads the exposition text).
Histogram::BucketBoundaries latency_buckets() {
  return {0.00001, 0.000025, 0.0001, 0.00025, 0.001, 0.0025, 0.01, 0.025, 0.1, 0.25, 1.0, 2.5, 10.0};
}

constexpr std::string_view kControlCommands[] = {"status", "get", "set", "policy", "report-metric", "pause",
                                                 "resume", "drain", "checkpoint", "restore", "commands", "unknown"};
constexpr std::string_view kControlRejections[] = {"malformed", "too_large", "unsupported_version",
                                                   "unknown_command", "wrong_type", "unauthenticated"};
constexpr std::pair<std::string_view, std::string_view> kKnownDecisions[] = {
    {"control", "set"}, {"control", "pause"}, {"control", "resume"}, {"control", "policy"}, {"control", "reload"}};

// A collectable that runs the scrape hook, then hands out the registry's metrics.
class HookedCollectable final : public prometheus::Collectable {
 public:
  HookedCollectable(std::shared_ptr<prometheus::Registry> registry, std::mutex* mu, std::function<void()>* hook)
      : registry_(std::move(registry)), mu_(mu), hook_(hook) {}
  std::vector<prometheus::MetricFamily> Collect() const override {
    {
      std::lock_guard<std::mutex> lock(*mu_);
      if (*hook_) (*hook_)();
    }
    return registry_->Collect();
  }

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  std::mutex* mu_;
  std::function<void()>* hook_;
};

}  // namespace

std::string_view stage_name(Stage s) {
  static constexpr std::string_view names[] = {"select", "encode", "send", "wait", "decode", "reduce"};
  return names[static_cast<int>(s)];
}

TensorGroup tensor_group(uint64_t elements) {
  if (elements < (uint64_t{1} << 16)) return TensorGroup::kSmall;
  if (elements < (uint64_t{1} << 22)) return TensorGroup::kMedium;
  return TensorGroup::kLarge;
}

std::string_view group_name(TensorGroup g) {
  static constexpr std::string_view names[] = {"small", "medium", "large"};
  return names[static_cast<int>(g)];
}

std::string_view error_kind_name(ErrorKind k) {
  static constexpr std::string_view names[] = {
      "step_invalid_argument", "step_not_found",   "step_out_of_range", "step_deadline",
      "step_peer_down",        "step_data_loss",   "step_disagreement", "step_aborted",
      "step_other",            "wire_rejected",    "session_protocol",  "client_rejected",
      "registration_rejected", "submission_rejected", "control_rejected", "transport_rejected", "join_refused",
      "wire_stale", "registration_over_budget", "handshake_evicted", "restore_rejected",
      "registration_device_refused"};
  static_assert(sizeof names / sizeof names[0] == static_cast<size_t>(ErrorKind::kCount));
  return names[static_cast<int>(k)];
}

ErrorKind step_error_kind(Code code) {
  switch (code) {
    case Code::kInvalidArgument: return ErrorKind::kStepInvalidArgument;
    case Code::kNotFound: return ErrorKind::kStepNotFound;
    case Code::kOutOfRange: return ErrorKind::kStepOutOfRange;
    case Code::kDeadlineExceeded: return ErrorKind::kStepDeadline;
    case Code::kUnavailable: return ErrorKind::kStepPeerDown;
    case Code::kDataLoss: return ErrorKind::kStepDataLoss;
    case Code::kFailedPrecondition: return ErrorKind::kStepDisagreement;
    case Code::kAborted: return ErrorKind::kStepAborted;
    default: return ErrorKind::kStepOther;
  }
}

struct Metrics::Families {
  Family<Counter>* steps;
  Family<Histogram>* step_duration;
  Family<Histogram>* stage_duration;
  Family<Counter>* bytes_sent;
  Family<Counter>* bytes_received;
  Family<Counter>* dense_bytes;
  Family<Counter>* elements;
  Family<Counter>* messages;
  Family<Gauge>* density;
  Family<Gauge>* threshold;
  Family<Gauge>* residual_norm;
  Family<Counter>* residual_error;
  Family<Gauge>* bandwidth;
  Family<Gauge>* peer_up;
  Family<Counter>* probes;
  Family<Counter>* decisions;
  Family<Gauge>* epoch;
  Family<Gauge>* compression;
  Family<Gauge>* draining;
  Family<Gauge>* clients;
  Family<Gauge>* tensor_memory;
  Family<Counter>* errors;
  Family<Counter>* control_requests;
  Family<Counter>* control_rejected;
  Family<Gauge>* trainer_metric;
  Family<Gauge>* build;
};

struct Metrics::Impl {
  uint32_t rank = 0;
  std::array<Histogram*, kStageCount> stages{};
  Histogram* step = nullptr;
  std::vector<Counter*> sent, received;  // by peer; index kMaxPeerLabels = "other"
  std::vector<Gauge*> bandwidth, peer_up;
  std::vector<double> bandwidth_ewma;     // guarded by mu
  std::array<Gauge*, kGroupCount> density{}, threshold{}, residual{};
  std::array<Counter*, kGroupCount> residual_error{};
  std::array<Counter*, static_cast<size_t>(ErrorKind::kCount)> errors{};
  std::map<std::string, Counter*, std::less<>> control, rejected;
  std::mutex mu;  // guards the lazily created label sets below and bandwidth_ewma
  std::map<std::pair<uint16_t, uint16_t>, Counter*> messages;
  std::map<std::string, Counter*, std::less<>> decisions;
  std::map<std::string, Gauge*, std::less<>> trainer;
  std::mutex hook_mu;
  std::function<void()> hook;
};

Metrics::Metrics(std::shared_ptr<prometheus::Registry> registry, std::unique_ptr<Families> f,
                 const MetricsOptions& options)
    : steps_ok(f->steps->Add({{"result", "ok"}})),
      steps_failed(f->steps->Add({{"result", "error"}})),
      steps_leased(f->steps->Add({{"result", "leased"}})),
      dense_equivalent_bytes(f->dense_bytes->Add({})),
      elements_selected(f->elements->Add({{"kind", "selected"}})),
      elements_total(f->elements->Add({{"kind", "all"}})),
      messages_rejected(f->errors->Add({{"kind", std::string(error_kind_name(ErrorKind::kWireRejected))}})),
      probes_sent(f->probes->Add({{"direction", "sent"}})),
      probes_received(f->probes->Add({{"direction", "received"}})),
      connected_clients(f->clients->Add({})),
      tensor_memory_in_use(f->tensor_memory->Add({{"kind", "in_use"}})),
      tensor_memory_budget(f->tensor_memory->Add({{"kind", "budget"}})),
      decision_epoch(f->epoch->Add({})),
      compression_enabled(f->compression->Add({})),
      draining(f->draining->Add({})),
      registry_(std::move(registry)),
      f_(std::move(f)),
      impl_(std::make_unique<Impl>()) {
  Impl& m = *impl_;
  m.rank = options.rank;
  f_->build->Add({{"version", options.version}}).Set(1);
  for (int s = 0; s < kStageCount; ++s) {
    m.stages[s] = &f_->stage_duration->Add({{"stage", std::string(stage_name(static_cast<Stage>(s)))}},
                                           latency_buckets());
  }
  m.step = &f_->step_duration->Add({}, latency_buckets());
  const uint32_t labelled = std::min(options.world_size, kMaxPeerLabels);
  m.sent.assign(kMaxPeerLabels + 1, nullptr);
  m.received.assign(kMaxPeerLabels + 1, nullptr);
  m.bandwidth.assign(kMaxPeerLabels + 1, nullptr);
  m.peer_up.assign(kMaxPeerLabels + 1, nullptr);
  m.bandwidth_ewma.assign(kMaxPeerLabels + 1, 0.0);
  for (uint32_t p = 0; p <= kMaxPeerLabels; ++p) {
    const bool other = p == kMaxPeerLabels;
    if (!other && (p >= labelled || p == options.rank)) continue;
    if (other && options.world_size <= kMaxPeerLabels) continue;
    prometheus::Labels l{{"peer", other ? "other" : std::to_string(p)}};
    m.sent[p] = &f_->bytes_sent->Add(l);
    m.received[p] = &f_->bytes_received->Add(l);
    m.bandwidth[p] = &f_->bandwidth->Add(l);
    m.peer_up[p] = &f_->peer_up->Add(l);
    m.peer_up[p]->Set(1);
  }
  for (int g = 0; g < kGroupCount; ++g) {
    prometheus::Labels l{{"group", std::string(group_name(static_cast<TensorGroup>(g)))}};
    m.density[g] = &f_->density->Add(l);
    m.threshold[g] = &f_->threshold->Add(l);
    m.residual[g] = &f_->residual_norm->Add(l);
    m.residual_error[g] = &f_->residual_error->Add(l);
  }
  for (int k = 0; k < static_cast<int>(ErrorKind::kCount); ++k) {
    m.errors[k] = &f_->errors->Add({{"kind", std::string(error_kind_name(static_cast<ErrorKind>(k)))}});
  }
  for (auto c : kControlCommands) {
    m.control[std::string(c) + "/ok"] = &f_->control_requests->Add({{"command", std::string(c)}, {"result", "ok"}});
    m.control[std::string(c) + "/error"] =
        &f_->control_requests->Add({{"command", std::string(c)}, {"result", "error"}});
  }
  for (auto r : kControlRejections) m.rejected[std::string(r)] = &f_->control_rejected->Add({{"reason", std::string(r)}});
  for (auto [c, r] : kKnownDecisions) decision_counter(c, r);
  compression_enabled.Set(1);
}

Metrics::~Metrics() {
  if (exposer_) exposer_.reset();  // no scrape may run past this point
}

Expected<std::unique_ptr<Metrics>> Metrics::create(const std::string& listen, const MetricsOptions& options) {
  auto registry = std::make_shared<prometheus::Registry>();
  auto& r = *registry;
  auto f = std::make_unique<Families>();
  // Every family from its catalogue row (catalogue.h): name, type and help are written only there.
  auto row = [](std::string_view name, MetricType type) -> const MetricSpec& {
    const MetricSpec* spec = find_metric(name);
    SC_CHECK(spec != nullptr && spec->type == type, "metric '{}' is not in the catalogue as that type", name);
    return *spec;
  };
  auto full_name = [](const MetricSpec& m) { return std::string(kMetricPrefix) + std::string(m.name); };
  auto counter = [&](std::string_view name) {
    const MetricSpec& m = row(name, MetricType::kCounter);
    return &prometheus::BuildCounter().Name(full_name(m)).Help(std::string(m.help)).Register(r);
  };
  auto gauge = [&](std::string_view name) {
    const MetricSpec& m = row(name, MetricType::kGauge);
    return &prometheus::BuildGauge().Name(full_name(m)).Help(std::string(m.help)).Register(r);
  };
  auto histogram = [&](std::string_view name) {
    const MetricSpec& m = row(name, MetricType::kHistogram);
    return &prometheus::BuildHistogram().Name(full_name(m)).Help(std::string(m.help)).Register(r);
  };
  f->steps = counter("steps_total");
  f->step_duration = histogram("step_duration_seconds");
  f->stage_duration = histogram("stage_duration_seconds");
  f->bytes_sent = counter("wire_bytes_sent_total");
  f->bytes_received = counter("wire_bytes_received_total");
  f->dense_bytes = counter("dense_equivalent_bytes_total");
  f->elements = counter("elements_total");
  f->messages = counter("messages_total");
  f->density = gauge("density_ratio");
  f->threshold = gauge("selection_threshold");
  f->residual_norm = gauge("residual_norm");
  f->residual_error = counter("residual_squared_norm_total");
  f->bandwidth = gauge("link_bandwidth_bytes_per_second");
  f->peer_up = gauge("peer_up");
  f->probes = counter("link_probes_total");
  f->decisions = counter("controller_decisions_total");
  f->epoch = gauge("decision_epoch");
  f->compression = gauge("compression_enabled");
  f->draining = gauge("draining");
  f->clients = gauge("connected_clients");
  f->tensor_memory = gauge("tensor_memory_bytes");
  f->errors = counter("errors_total");
  f->control_requests = counter("control_requests_total");
  f->control_rejected = counter("control_rejected_total");
  f->trainer_metric = gauge("trainer_metric");
  f->build = gauge("build_info");
  std::unique_ptr<Metrics> metrics(new Metrics(registry, std::move(f), options));
  if (listen != "off" && !listen.empty()) {
    try {
      // civetweb serves each connection on one of num_threads workers and waits up to
      // request_timeout_ms for its request: with its defaults (2 threads, 30 s) two idle
      // connections held every scrape for 30 s.
      metrics->exposer_ = std::make_unique<prometheus::Exposer>(std::vector<std::string>{
          "listening_ports", listen, "num_threads", std::to_string(kExposerThreads), "request_timeout_ms",
          std::to_string(kExposerRequestTimeoutMs)});
      auto hooked = std::make_shared<HookedCollectable>(metrics->registry_, &metrics->impl_->hook_mu,
                                                        &metrics->impl_->hook);
      metrics->exposer_->RegisterCollectable(hooked);
      metrics->hooked_ = hooked;
    } catch (const std::exception& e) {
      return unavailable("cannot serve metrics on '" + listen + "': " + e.what());
    }
    auto ports = metrics->listening_ports();
    SC_LOG_INFO("metrics on http://{}/metrics (port {})", listen, ports.empty() ? 0u : unsigned{ports[0]});
  }
  return metrics;
}

std::vector<uint16_t> Metrics::listening_ports() const {
  if (!exposer_) return {};
  std::vector<uint16_t> out;
  for (int p : exposer_->GetListeningPorts()) out.push_back(static_cast<uint16_t>(p));
  return out;
}

void Metrics::set_scrape_hook(std::function<void()> hook) {
  std::lock_guard<std::mutex> lock(impl_->hook_mu);
  impl_->hook = std::move(hook);
}

void Metrics::observe_step(double seconds) { impl_->step->Observe(seconds); }
void Metrics::observe_stage(Stage stage, double seconds) { impl_->stages[static_cast<int>(stage)]->Observe(seconds); }
void Metrics::count_error(ErrorKind kind, double n) { impl_->errors[static_cast<int>(kind)]->Increment(n); }
void Metrics::count_step_failure(Code code) {
  steps_failed.Increment();
  count_error(step_error_kind(code));
}

void Metrics::count_messages(kernels::Format format, kernels::Selector selector, double n) {
  Counter* c;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    auto key = std::make_pair(static_cast<uint16_t>(format), static_cast<uint16_t>(selector));
    auto it = impl_->messages.find(key);
    if (it == impl_->messages.end()) {
      it = impl_->messages
               .emplace(key, &f_->messages->Add({{"format", std::string(kernels::format_name(format))},
                                                 {"selector", std::string(kernels::selector_name(selector))}}))
               .first;
    }
    c = it->second;
  }
  c->Increment(n);
}

void Metrics::set_group(TensorGroup group, double density, double threshold, double residual_norm) {
  const int g = static_cast<int>(group);
  impl_->density[g]->Set(density);
  impl_->threshold[g]->Set(threshold);
  impl_->residual[g]->Set(residual_norm);
}

void Metrics::add_group_error(TensorGroup group, double squared_norm) {
  if (std::isfinite(squared_norm) && squared_norm >= 0) impl_->residual_error[static_cast<int>(group)]->Increment(squared_norm);
}

namespace {
uint32_t peer_slot(uint32_t peer) { return peer < Metrics::kMaxPeerLabels ? peer : Metrics::kMaxPeerLabels; }
}  // namespace

void Metrics::add_bytes_sent(uint32_t peer, uint64_t bytes) {
  if (Counter* c = impl_->sent[peer_slot(peer)]) c->Increment(static_cast<double>(bytes));
}

void Metrics::add_bytes_received(uint32_t peer, uint64_t bytes) {
  if (Counter* c = impl_->received[peer_slot(peer)]) c->Increment(static_cast<double>(bytes));
}

void Metrics::observe_link(uint32_t peer, uint64_t bytes, double seconds) {
  if (bytes < kLinkSampleMinBytes || seconds <= 0) return;
  const uint32_t p = peer_slot(peer);
  Gauge* g = impl_->bandwidth[p];
  if (!g) return;
  const double sample = static_cast<double>(bytes) / seconds;
  std::lock_guard<std::mutex> lock(impl_->mu);
  double& e = impl_->bandwidth_ewma[p];
  e = e == 0 ? sample : 0.8 * e + 0.2 * sample;
  g->Set(e);
}

void Metrics::set_peer_up(uint32_t peer, bool up) {
  if (Gauge* g = impl_->peer_up[peer_slot(peer)]) g->Set(up ? 1 : 0);
}

prometheus::Counter* Metrics::decision_counter(std::string_view controller, std::string_view reason) {
  std::string key = std::string(controller) + "/" + std::string(reason);
  std::lock_guard<std::mutex> lock(impl_->mu);
  auto it = impl_->decisions.find(key);
  if (it != impl_->decisions.end()) return it->second;
  if (impl_->decisions.size() >= 64) {
    controller = "other";
    reason = "other";
    key = "other/other";
    it = impl_->decisions.find(key);
    if (it != impl_->decisions.end()) return it->second;
  }
  return impl_->decisions
      .emplace(key, &f_->decisions->Add({{"controller", std::string(controller)}, {"reason", std::string(reason)}}))
      .first->second;
}

void Metrics::count_decision(std::string_view controller, std::string_view reason) {
  decision_counter(controller, reason)->Increment();
}

void Metrics::count_control(std::string_view command, bool ok) {
  auto it = impl_->control.find(std::string(command) + (ok ? "/ok" : "/error"));
  if (it == impl_->control.end()) it = impl_->control.find(ok ? "unknown/ok" : "unknown/error");
  it->second->Increment();
}

void Metrics::count_control_rejected(std::string_view reason) {
  auto it = impl_->rejected.find(reason);
  if (it != impl_->rejected.end()) it->second->Increment();
  count_error(ErrorKind::kControlRejected);
}

bool Metrics::set_trainer_metric(std::string_view name, double value) {
  std::string clean;
  for (char c : name.substr(0, 64)) {
    clean += (std::isalnum(static_cast<unsigned char>(c)) || c == '_') ? c : '_';
  }
  if (clean.empty()) return false;
  Gauge* g;
  {
    std::lock_guard<std::mutex> lock(impl_->mu);
    auto it = impl_->trainer.find(clean);
    if (it == impl_->trainer.end()) {
      if (impl_->trainer.size() >= kMaxTrainerMetrics) return false;
      it = impl_->trainer.emplace(clean, &f_->trainer_metric->Add({{"name", clean}})).first;
    }
    g = it->second;
  }
  g->Set(value);
  return true;
}

std::string Metrics::scrape_text() {
  {
    std::lock_guard<std::mutex> lock(impl_->hook_mu);
    if (impl_->hook) impl_->hook();
  }
  std::ostringstream os;
  prometheus::TextSerializer().Serialize(os, registry_->Collect());
  return os.str();
}

}  // namespace sparsecar
