#include "daemon/metrics/metrics.h"

#include <prometheus/exposer.h>

#include "sparsecar/common/log.h"

namespace sparsecar {

struct Metrics::Families {
  prometheus::Family<prometheus::Counter>* steps;
  prometheus::Family<prometheus::Counter>* wire_bytes;
  prometheus::Family<prometheus::Counter>* dense_bytes;
  prometheus::Family<prometheus::Counter>* elements;
  prometheus::Family<prometheus::Counter>* rejected;
  prometheus::Family<prometheus::Gauge>* clients;
  prometheus::Family<prometheus::Gauge>* build;
};

Metrics::Metrics(std::shared_ptr<prometheus::Registry> registry, Families f)
    : steps_ok(f.steps->Add({{"result", "ok"}})),
      steps_failed(f.steps->Add({{"result", "error"}})),
      wire_bytes_sent(f.wire_bytes->Add({{"direction", "sent"}})),
      wire_bytes_received(f.wire_bytes->Add({{"direction", "received"}})),
      dense_equivalent_bytes(f.dense_bytes->Add({})),
      elements_selected(f.elements->Add({{"kind", "selected"}})),
      elements_total(f.elements->Add({{"kind", "total"}})),
      messages_rejected(f.rejected->Add({})),
      connected_clients(f.clients->Add({})),
      registry_(std::move(registry)) {
  f.build->Add({{"version", "0.1.0"}}).Set(1);
}

Metrics::~Metrics() = default;

Expected<std::unique_ptr<Metrics>> Metrics::create(const std::string& listen) {
  auto registry = std::make_shared<prometheus::Registry>();
  auto& r = *registry;
  Families f{
      &prometheus::BuildCounter().Name("sparsecar_steps_total").Help("Tensor steps completed, by result").Register(r),
      &prometheus::BuildCounter()
           .Name("sparsecar_wire_bytes_total")
           .Help("Bytes exchanged with peers (headers included), by direction")
           .Register(r),
      &prometheus::BuildCounter()
           .Name("sparsecar_dense_equivalent_bytes_total")
           .Help("Bytes a dense ring all-reduce of the same steps would have sent")
           .Register(r),
      &prometheus::BuildCounter()
           .Name("sparsecar_elements_total")
           .Help("Gradient elements seen and selected for sending, by kind")
           .Register(r),
      &prometheus::BuildCounter()
           .Name("sparsecar_wire_messages_rejected_total")
           .Help("Peer messages rejected by header, checksum or payload validation")
           .Register(r),
      &prometheus::BuildGauge().Name("sparsecar_connected_clients").Help("Trainer sessions connected now").Register(r),
      &prometheus::BuildGauge().Name("sparsecar_build_info").Help("Build information (value 1)").Register(r),
  };
  std::unique_ptr<Metrics> metrics(new Metrics(registry, f));
  if (listen != "off" && !listen.empty()) {
    try {
      metrics->exposer_ = std::make_unique<prometheus::Exposer>(listen);
      metrics->exposer_->RegisterCollectable(registry);
    } catch (const std::exception& e) {
      return unavailable("cannot serve metrics on '" + listen + "': " + e.what());
    }
    SC_LOG_INFO("metrics on http://%s/metrics", listen.c_str());
  }
  return metrics;
}

std::vector<uint16_t> Metrics::listening_ports() const {
  if (!exposer_) return {};
  std::vector<uint16_t> out;
  for (int p : exposer_->GetListeningPorts()) out.push_back(static_cast<uint16_t>(p));
  return out;
}

}  // namespace sparsecar
