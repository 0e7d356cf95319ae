// Every metric family sparsecard exports, declared once: its name (after the `sparsecar_` prefix),
// type, label names and help text. Metrics registers its families from these rows, and
// tests/unit/control/metrics_test.cc checks the catalogue in dashboards/README.md and the scrape
// output against them, so the three cannot drift apart. A new family is one row here, its
// registration in metrics.cc (which looks the row up by name), and its line in the README.
//
// Thread-safety: constant data.
#pragma once

#include <span>
#include <string_view>

namespace sparsecar {

enum class MetricType { kCounter, kGauge, kHistogram };

struct MetricSpec {
  std::string_view name;    // without the "sparsecar_" prefix
  MetricType type;
  std::string_view labels;  // label names, comma-separated ("" for none)
  std::string_view help;
};

inline constexpr std::string_view kMetricPrefix = "sparsecar_";

inline constexpr MetricSpec kMetricCatalogue[] = {
    {"build_info", MetricType::kGauge, "version", "Build information (value 1)"},
    {"steps_total", MetricType::kCounter, "result",
     "Tensor steps completed, by result (leased: all-reduced by the trainers under a lease, counted at the next "
     "step through the daemon)"},
    {"step_duration_seconds", MetricType::kHistogram, "",
     "Time from taking a tensor step off the queue to its result"},
    {"stage_duration_seconds", MetricType::kHistogram, "stage",
     "Time spent per tensor step in each stage (select, encode, send, wait, decode, reduce)"},
    {"wire_bytes_sent_total", MetricType::kCounter, "peer", "Bytes sent to each peer (wire headers included)"},
    {"wire_bytes_received_total", MetricType::kCounter, "peer",
     "Bytes received from each peer (wire headers included)"},
    {"dense_equivalent_bytes_total", MetricType::kCounter, "",
     "Bytes a dense ring all-reduce of the same steps would have sent"},
    {"elements_total", MetricType::kCounter, "kind",
     "Gradient elements processed (kind=all) and selected for sending (kind=selected)"},
    {"messages_total", MetricType::kCounter, "format,selector",
     "Data messages sent to peers, by payload format and selector"},
    {"density_ratio", MetricType::kGauge, "group",
     "Fraction of elements selected in the latest step of each tensor group"},
    {"selection_threshold", MetricType::kGauge, "group",
     "Lambda of the hard-threshold selector per tensor group (0 when another selector runs)"},
    {"residual_norm", MetricType::kGauge, "group",
     "L2 norm of the error-feedback residual of each tensor group after its latest step"},
    {"residual_squared_norm_total", MetricType::kCounter, "group",
     "Total error: sum over steps of the squared residual norm, per tensor group"},
    {"link_bandwidth_bytes_per_second", MetricType::kGauge, "peer",
     "Estimated send bandwidth to each peer (EWMA over sends of 64 KiB and more)"},
    {"link_probes_total", MetricType::kCounter, "direction",
     "Link probes (the bytes the ring sends its successor in a step, timed by the receiver for the step controller) sent to the ring "
     "successor and received from the predecessor"},
    {"peer_up", MetricType::kGauge, "peer", "1 while the peer is reachable, 0 once it failed"},
    {"controller_decisions_total", MetricType::kCounter, "controller,reason",
     "Knob decisions proposed from this node, by controller and reason"},
    {"decision_epoch", MetricType::kGauge, "", "Newest decision epoch known to this node"},
    {"compression_enabled", MetricType::kGauge, "",
     "1 when compression is on in the newest decision, 0 when paused (dense)"},
    {"draining", MetricType::kGauge, "", "1 while the daemon drains (new steps refused)"},
    {"connected_clients", MetricType::kGauge, "", "Trainer sessions connected now"},
    {"tensor_memory_bytes", MetricType::kGauge, "kind",
     "Registered tensors' memory on this node: charged now (in_use) and the budget (tensor_memory_budget_bytes)"},
    {"errors_total", MetricType::kCounter, "kind", "Errors, by kind"},
    {"control_requests_total", MetricType::kCounter, "command,result",
     "Control socket requests handled, by command and result"},
    {"control_rejected_total", MetricType::kCounter, "reason",
     "Control socket requests rejected before any command ran, by reason"},
    {"trainer_metric", MetricType::kGauge, "name",
     "Latest scalar reported by a trainer or operator (report-metric), by name"},
};

// The row of `name` (without the prefix); nullptr when there is none.
constexpr const MetricSpec* find_metric(std::string_view name) {
  for (const MetricSpec& m : kMetricCatalogue) {
    if (m.name == name) return &m;
  }
  return nullptr;
}

constexpr std::string_view metric_type_name(MetricType t) {
  switch (t) {
    case MetricType::kCounter:
      return "counter";
    case MetricType::kGauge:
      return "gauge";
    case MetricType::kHistogram:
      return "histogram";
  }
  return "?";
}

}  // namespace sparsecar
