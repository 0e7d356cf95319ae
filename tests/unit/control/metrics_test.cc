// The metrics catalogue: every documented family is exposed from the start with its bounded
// series, labels never exceed their caps, and the exposer serves on port 0.
#include <gtest/gtest.h>

#include "daemon/metrics/metrics.h"

namespace sparsecar {
namespace {

TEST(Metrics, CatalogueIsThereFromTheStart) {
  MetricsOptions o;
  o.rank = 1;
  o.world_size = 3;
  auto m = Metrics::create("off", o).value();
  const std::string text = m->scrape_text();
  for (const char* name :
       {"sparsecar_build_info", "sparsecar_steps_total", "sparsecar_step_duration_seconds_bucket",
        "sparsecar_stage_duration_seconds_bucket{stage=\"select\"", "stage=\"encode\"", "stage=\"send\"",
        "stage=\"wait\"", "stage=\"decode\"", "stage=\"reduce\"", "sparsecar_wire_bytes_sent_total{peer=\"0\"}",
        "sparsecar_wire_bytes_received_total{peer=\"2\"}", "sparsecar_dense_equivalent_bytes_total",
        "sparsecar_elements_total{kind=\"selected\"}", "sparsecar_density_ratio{group=\"small\"}",
        "sparsecar_selection_threshold{group=\"large\"}", "sparsecar_residual_norm{group=\"medium\"}",
        "sparsecar_residual_squared_norm_total{group=\"small\"}",
        "sparsecar_link_bandwidth_bytes_per_second{peer=\"2\"}", "sparsecar_peer_up{peer=\"0\"} 1",
        "sparsecar_controller_decisions_total{controller=\"control\",reason=\"set\"} 0",
        "sparsecar_connected_clients", "sparsecar_errors_total{kind=\"step_deadline\"} 0",
        "sparsecar_control_requests_total", "sparsecar_decision_epoch", "sparsecar_compression_enabled 1"}) {
    EXPECT_NE(text.find(name), std::string::npos) << name;
  }
  EXPECT_EQ(text.find("peer=\"1\""), std::string::npos) << "no series for the node itself";
}

TEST(Metrics, UpdatesAndCaps) {
  MetricsOptions o;
  o.world_size = 2;
  auto m = Metrics::create("off", o).value();
  m->add_bytes_sent(1, 100);
  m->add_bytes_received(1, 50);
  m->observe_link(1, 1 << 20, 0.001);  // 1 GiB/s-ish
  m->observe_link(1, 10, 1.0);         // too small to count
  m->count_messages(kernels::Format::kCoo, kernels::Selector::kTopk, 3);
  m->set_group(TensorGroup::kSmall, 0.01, 0, 2.5);
  m->add_group_error(TensorGroup::kSmall, 6.25);
  m->count_step_failure(Code::kDeadlineExceeded);
  for (int i = 0; i < 100; ++i) m->set_trainer_metric("metric " + std::to_string(i), i);
  for (int i = 0; i < 100; ++i) m->count_decision("ctl" + std::to_string(i), "r");
  const std::string text = m->scrape_text();
  EXPECT_NE(text.find("sparsecar_wire_bytes_sent_total{peer=\"1\"} 100"), std::string::npos);
  EXPECT_NE(text.find("sparsecar_wire_bytes_received_total{peer=\"1\"} 50"), std::string::npos);
  EXPECT_NE(text.find("sparsecar_link_bandwidth_bytes_per_second{peer=\"1\"} 1048576000"), std::string::npos);
  EXPECT_NE(text.find("sparsecar_messages_total{format=\"coo\",selector=\"topk\"} 3"), std::string::npos);
  EXPECT_NE(text.find("sparsecar_residual_norm{group=\"small\"} 2.5"), std::string::npos);
  EXPECT_NE(text.find("sparsecar_errors_total{kind=\"step_deadline\"} 1"), std::string::npos);
  EXPECT_NE(text.find("sparsecar_trainer_metric{name=\"metric_0\"} 0"), std::string::npos);
  size_t trainer_series = 0, decision_series = 0;
  for (size_t p = text.find("sparsecar_trainer_metric{"); p != std::string::npos;
       p = text.find("sparsecar_trainer_metric{", p + 1)) {
    ++trainer_series;
  }
  for (size_t p = text.find("sparsecar_controller_decisions_total{"); p != std::string::npos;
       p = text.find("sparsecar_controller_decisions_total{", p + 1)) {
    ++decision_series;
  }
  EXPECT_EQ(trainer_series, Metrics::kMaxTrainerMetrics);
  EXPECT_LE(decision_series, 65u);
  EXPECT_NE(text.find("controller=\"other\""), std::string::npos);
}

TEST(Metrics, ExposerOnPortZeroAndScrapeHook) {
  auto m = Metrics::create("127.0.0.1:0").value();
  auto ports = m->listening_ports();
  ASSERT_EQ(ports.size(), 1u);
  EXPECT_GT(ports[0], 0);
  int calls = 0;
  m->set_scrape_hook([&] { m->connected_clients.Set(++calls); });
  EXPECT_NE(m->scrape_text().find("sparsecar_connected_clients 1"), std::string::npos);
  m->set_scrape_hook(nullptr);
}

TEST(Metrics, Groups) {
  EXPECT_EQ(tensor_group(1), TensorGroup::kSmall);
  EXPECT_EQ(tensor_group(65536), TensorGroup::kMedium);
  EXPECT_EQ(tensor_group(uint64_t{1} << 22), TensorGroup::kLarge);
}

}  // namespace
}  // namespace sparsecar
