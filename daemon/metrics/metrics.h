// Metrics: the daemon's Prometheus counters, declared once (STYLE.md habit 8).
//
// The registry always exists; the HTTP exposer only when `listen` is not "off". Counters are
// cached references, updated atomically from any thread (prometheus-cpp's hot path is
// lock-free). Names: prefix sparsecar_, base units, _total for counters, bounded labels.
// This is the v1 set; the full catalogue (per peer, per format, stage latencies) comes with the
// metrics issue.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>

#include "sparsecar/common/status.h"

namespace prometheus {
class Exposer;
}

namespace sparsecar {

class Metrics {
 public:
  // `listen` is "ADDRESS:PORT" (port 0 picks one) or "off".
  static Expected<std::unique_ptr<Metrics>> create(const std::string& listen);
  ~Metrics();

  // Ports the exposer listens on (empty when off).
  std::vector<uint16_t> listening_ports() const;

  prometheus::Counter& steps_ok;
  prometheus::Counter& steps_failed;
  prometheus::Counter& wire_bytes_sent;
  prometheus::Counter& wire_bytes_received;
  prometheus::Counter& dense_equivalent_bytes;
  prometheus::Counter& elements_selected;
  prometheus::Counter& elements_total;
  prometheus::Counter& messages_rejected;
  prometheus::Gauge& connected_clients;

 private:
  struct Families;
  Metrics(std::shared_ptr<prometheus::Registry> registry, Families families);
  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<prometheus::Exposer> exposer_;
};

}  // namespace sparsecar
