// The metrics catalogue: every documented family is exposed from the start with its bounded
// series, labels never exceed their caps, and the exposer serves on port 0.
#include <arpa/inet.h>
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "daemon/metrics/catalogue.h"
#include "daemon/metrics/metrics.h"

namespace sparsecar {
namespace {

// A TCP connection to 127.0.0.1:port with a 10 s receive timeout (so no test can hang on it).
int connect_local(uint16_t port) {
  int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  EXPECT_GE(fd, 0);
  timeval tv{10, 0};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  return fd;
}

// GET /metrics over a fresh connection; the whole response (HTTP/1.0: until the server closes).
std::string scrape(uint16_t port) {
  int fd = connect_local(port);
  const std::string request = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  EXPECT_EQ(::send(fd, request.data(), request.size(), MSG_NOSIGNAL), static_cast<ssize_t>(request.size()));
  std::string response;
  char buf[65536];
  for (;;) {
    ssize_t n = ::recv(fd, buf, sizeof buf, 0);
    if (n <= 0) break;
    response.append(buf, static_cast<size_t>(n));
  }
  ::close(fd);
  return response;
}

// Idle connections (connected, never sending a request) used to take both of civetweb's two
// workers for its 30 s request timeout, holding every scrape.
TEST(Metrics, IdleConnectionsDoNotBlockScrapes) {
  auto m = Metrics::create("127.0.0.1:0").value();
  const uint16_t port = m->listening_ports().at(0);
  using Clock = std::chrono::steady_clock;
  auto seconds = [](Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); };
  std::vector<int> idle;
  for (int i = 0; i < 2; ++i) idle.push_back(connect_local(port));
  ::usleep(100 * 1000);  // let the server take them
  auto t0 = Clock::now();
  std::string r = scrape(port);
  EXPECT_NE(r.find("sparsecar_connected_clients"), std::string::npos) << r.substr(0, 200);
  EXPECT_LT(seconds(t0), 1.0) << "2 idle connections delayed the scrape";
  // More idle connections than workers: a scrape waits at most for the request timeout.
  for (int i = 0; i < 2 * kExposerThreads; ++i) idle.push_back(connect_local(port));
  ::usleep(100 * 1000);
  t0 = Clock::now();
  r = scrape(port);
  EXPECT_NE(r.find("sparsecar_connected_clients"), std::string::npos) << r.substr(0, 200);
  EXPECT_LT(seconds(t0), kExposerRequestTimeoutMs / 1000.0 * 3 + 1.0);
  for (int fd : idle) ::close(fd);
}

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

// Splits `text` at `sep`, trimming spaces.
std::vector<std::string> split(const std::string& text, char sep) {
  std::vector<std::string> out;
  std::string cur;
  for (char c : text + sep) {
    if (c != sep) {
      cur += c;
      continue;
    }
    while (!cur.empty() && cur.front() == ' ') cur.erase(0, 1);
    while (!cur.empty() && cur.back() == ' ') cur.pop_back();
    out.push_back(cur);
    cur.clear();
  }
  return out;
}

// The catalogue table of dashboards/README.md: name (without the prefix) -> {type, label names}.
std::map<std::string, std::pair<std::string, std::string>> readme_catalogue() {
  std::ifstream in(std::string(SPARSECAR_SOURCE_DIR) + "/dashboards/README.md");
  EXPECT_TRUE(in.good()) << "dashboards/README.md not found";
  std::map<std::string, std::pair<std::string, std::string>> out;
  bool in_catalogue = false;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("## ", 0) == 0) in_catalogue = line == "## Metric catalogue";
    if (!in_catalogue || line.rfind("| `", 0) != 0) continue;
    // "| `a` / `b` | type | labels | meaning |" (the meaning may contain escaped pipes)
    std::vector<std::string> cells;
    std::string cell;
    for (size_t i = 1; i < line.size(); ++i) {
      if (line[i] == '\\' && i + 1 < line.size() && line[i + 1] == '|') {
        cell += '|';
        ++i;
      } else if (line[i] == '|') {
        cells.push_back(cell);
        cell.clear();
      } else {
        cell += line[i];
      }
    }
    if (cells.size() < 3) continue;
    std::string labels;
    for (const std::string& l : split(cells[2], ',')) {
      if (l.empty() || l == "—") continue;
      labels += (labels.empty() ? "" : ",") + l.substr(0, l.find('='));
    }
    for (std::string name : split(cells[0], '/')) {
      name.erase(std::remove(name.begin(), name.end(), '`'), name.end());
      out[name] = {split(cells[1], ',')[0], labels};
    }
  }
  return out;
}

// One list (daemon/metrics/catalogue.h) gives the families, their help, and the README's
// catalogue: the README table and the scrape output are checked against it, row by row.
TEST(Metrics, TheReadmeAndTheScrapeMatchTheCatalogue) {
  const auto readme = readme_catalogue();
  EXPECT_EQ(readme.size(), std::size(kMetricCatalogue)) << "rows in dashboards/README.md vs catalogue.h";
  for (const MetricSpec& m : kMetricCatalogue) {
    auto it = readme.find(std::string(m.name));
    ASSERT_NE(it, readme.end()) << m.name << " is not in dashboards/README.md";
    EXPECT_EQ(it->second.first, metric_type_name(m.type)) << m.name;
    EXPECT_EQ(it->second.second, m.labels) << m.name << ": labels in the README";
  }
  MetricsOptions o;
  o.world_size = 2;
  auto metrics = Metrics::create("off", o).value();
  // The two families whose series appear with their first use.
  metrics->count_messages(kernels::Format::kCoo, kernels::Selector::kTopk, 1);
  EXPECT_TRUE(metrics->set_trainer_metric("loss", 0.5));
  const std::string text = metrics->scrape_text();
  size_t families = 0;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("# TYPE ", 0) != 0) continue;
    ++families;
    const auto words = split(line.substr(7), ' ');
    ASSERT_EQ(words.size(), 2u) << line;
    ASSERT_EQ(words[0].rfind(std::string(kMetricPrefix), 0), 0u) << line;
    const MetricSpec* spec = find_metric(words[0].substr(kMetricPrefix.size()));
    ASSERT_NE(spec, nullptr) << words[0] << " is exported but not in the catalogue";
    EXPECT_EQ(words[1], metric_type_name(spec->type)) << words[0];
    EXPECT_NE(text.find("# HELP " + words[0] + " " + std::string(spec->help) + "\n"), std::string::npos) << words[0];
  }
  EXPECT_EQ(families, std::size(kMetricCatalogue)) << "families in the scrape vs catalogue.h";
}

// Histogram bucket bounds print as short decimals in the exposition text (no le="0.0006400000000000001"),
// the same list for the step and every stage histogram.
TEST(Metrics, HistogramBucketLabelsAreCleanDecimals) {
  MetricsOptions o;
  o.world_size = 2;
  auto m = Metrics::create("off", o).value();
  const std::string text = m->scrape_text();
  const std::vector<std::string> want = {"1e-05", "2.5e-05", "0.0001", "0.00025", "0.001", "0.0025", "0.01",
                                         "0.025", "0.1",     "0.25",   "1",       "2.5",   "10",     "+Inf"};
  std::map<std::string, std::vector<std::string>> les;  // series (name and other labels) -> le values
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    const size_t bucket = line.find("_bucket{");
    if (line.empty() || line[0] == '#' || bucket == std::string::npos) continue;
    const size_t le = line.find("le=\"");
    ASSERT_NE(le, std::string::npos) << line;
    const size_t end = line.find('"', le + 4);
    std::string series = line.substr(0, le);
    les[series].push_back(line.substr(le + 4, end - le - 4));
  }
  ASSERT_FALSE(les.empty()) << text;
  for (const auto& [series, values] : les) EXPECT_EQ(values, want) << series;
  EXPECT_NE(text.find("sparsecar_step_duration_seconds_bucket{le=\"0.00025\"}"), std::string::npos) << text;
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
