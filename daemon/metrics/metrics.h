// Metrics: the daemon's Prometheus metrics, declared once. The catalogue with
// every name, type, label and unit is docs in dashboards/README.md; the names below are the
// contract the dashboards and alert rules read.
//
// Conventions: prefix sparsecar_, base units (seconds, bytes), _total for counters, and bounded
// labels only — peer (rank number, at most kMaxPeerLabels distinct, the rest "other"), format,
// selector, stage, group (tensor size class, see tensor_group()), kind/reason (fixed lists),
// trainer metric names (at most kMaxTrainerMetrics). Raw tensor names never become labels.
// Every bounded series is created up front (value 0), so dashboards and alerts see it before
// the first event.
//
// The registry always exists; the HTTP exposer only when `listen` is not "off". Hot-path updates
// go to cached counter references (prometheus-cpp updates them lock-free); label sets that appear
// at run time (format x selector, trainer metric names) are created once under a mutex. Gauges
// that mirror another part's state (connected clients, peers up, session counters) are refreshed
// by the scrape hook just before each scrape.
//
// The exposer serves scrapes on kExposerThreads threads and closes a connection that has not sent
// its request within kExposerRequestTimeoutMs, so idle or slow connections cannot hold scrapes
// up: fewer than kExposerThreads of them cost nothing, more delay a scrape by at most the timeout.
//
// Thread-safety: every method may be called from any thread.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include "sparsecar/common/status.h"
#include "sparsecar/kernels/types.h"

namespace prometheus {
class Exposer;
}

namespace sparsecar {

// Pipeline stages timed by sparsecar_stage_duration_seconds{stage}.
enum class Stage { kSelect, kEncode, kSend, kWait, kDecode, kReduce };
inline constexpr int kExposerThreads = 8;
inline constexpr int kExposerRequestTimeoutMs = 2000;

inline constexpr int kStageCount = 6;
std::string_view stage_name(Stage s);

// Tensor groups: size classes, so a label never carries a tensor name.
enum class TensorGroup { kSmall, kMedium, kLarge };
inline constexpr int kGroupCount = 3;
// small: < 64 Ki elements, medium: < 4 Mi elements, large: the rest.
TensorGroup tensor_group(uint64_t elements);
std::string_view group_name(TensorGroup g);

// sparsecar_errors_total{kind}: every kind is listed here (bounded).
enum class ErrorKind {
  kStepInvalidArgument, kStepNotFound, kStepOutOfRange, kStepDeadline, kStepPeerDown, kStepDataLoss,
  kStepDisagreement, kStepAborted, kStepOther,
  kWireRejected, kSessionProtocol, kClientRejected, kRegistrationRejected, kSubmissionRejected,
  kControlRejected, kTransportRejected, kJoinRefused, kWireStale, kRegistrationOverBudget, kHandshakeEvicted,
  kRestoreRejected, kRegistrationDeviceRefused, kCount
};
std::string_view error_kind_name(ErrorKind k);
ErrorKind step_error_kind(Code code);

struct MetricsOptions {
  uint32_t rank = 0;
  uint32_t world_size = 1;
  std::string version = "0.1.0";
};

class Metrics {
 public:
  static constexpr uint32_t kMaxPeerLabels = 256;
  static constexpr size_t kMaxTrainerMetrics = 32;

  // `listen` is "ADDRESS:PORT" (port 0 picks one) or "off".
  static Expected<std::unique_ptr<Metrics>> create(const std::string& listen, const MetricsOptions& options = {});
  ~Metrics();

  // Ports the exposer listens on (empty when off).
  std::vector<uint16_t> listening_ports() const;
  // Called on the exposer's thread before every scrape (refreshes mirrored gauges). Set it once,
  // before the first scrape can arrive, or clear it (nullptr) before what it touches goes away.
  void set_scrape_hook(std::function<void()> hook);

  // --- steps (pipeline thread)
  prometheus::Counter& steps_ok;
  prometheus::Counter& steps_failed;
  prometheus::Counter& steps_leased;  // result="leased": steps the trainers ran under a lease
  prometheus::Counter& dense_equivalent_bytes;
  prometheus::Counter& elements_selected;
  prometheus::Counter& elements_total;
  prometheus::Counter& messages_rejected;  // = errors_total{kind="wire_rejected"}
  prometheus::Counter& probes_sent;        // link_probes_total{direction="sent"} (its bytes: wire_bytes_sent_total)
  prometheus::Counter& probes_received;    // link_probes_total{direction="received"}
  prometheus::Gauge& connected_clients;
  prometheus::Gauge& tensor_memory_in_use;  // sparsecar_tensor_memory_bytes{kind="in_use"}
  prometheus::Gauge& tensor_memory_budget;  // sparsecar_tensor_memory_bytes{kind="budget"}
  prometheus::Gauge& decision_epoch;
  prometheus::Gauge& compression_enabled;
  prometheus::Gauge& draining;

  void observe_step(double seconds);
  void observe_stage(Stage stage, double seconds);
  void count_error(ErrorKind kind, double n = 1);
  void count_step_failure(Code code);
  // Data messages sent, by their format and the selector that produced them ("none" for dense).
  void count_messages(kernels::Format format, kernels::Selector selector, double n);
  // The newest state of a tensor group: selected/elements, lambda (0 unless threshold) and the
  // residual L2 norm; `step_error` (Σ residual² of the step) is added to the total error.
  void set_group(TensorGroup group, double density, double threshold, double residual_norm);
  void add_group_error(TensorGroup group, double squared_norm);

  // --- peers (pipeline / transport threads)
  void add_bytes_sent(uint32_t peer, uint64_t bytes);
  void add_bytes_received(uint32_t peer, uint64_t bytes);
  // One completed send of `bytes` that took `seconds`: folded into the peer's bandwidth
  // estimate (exponentially weighted, messages of 64 KiB and more only).
  void observe_link(uint32_t peer, uint64_t bytes, double seconds);
  void set_peer_up(uint32_t peer, bool up);

  // --- decisions and control
  // `controller` and `reason` must come from a fixed vocabulary (e.g. "control"/"set"); at most
  // 64 distinct pairs, the rest count as ("other", "other").
  void count_decision(std::string_view controller, std::string_view reason);
  void count_control(std::string_view command, bool ok);  // command: known name or "unknown"
  void count_control_rejected(std::string_view reason);
  // A trainer-reported scalar; names are sanitised to [a-zA-Z0-9_] (64 bytes) and capped at
  // kMaxTrainerMetrics distinct names (returns false when the name was dropped).
  bool set_trainer_metric(std::string_view name, double value);

  // The text exposition of everything (for tests and `sparsecarctl` debugging).
  std::string scrape_text();

 private:
  struct Families;
  struct Impl;
  Metrics(std::shared_ptr<prometheus::Registry> registry, std::unique_ptr<Families> families,
          const MetricsOptions& options);
  prometheus::Counter* decision_counter(std::string_view controller, std::string_view reason);

  std::shared_ptr<prometheus::Registry> registry_;
  std::unique_ptr<Families> f_;
  std::unique_ptr<Impl> impl_;
  std::shared_ptr<prometheus::Collectable> hooked_;  // the exposer only holds a weak pointer
  std::unique_ptr<prometheus::Exposer> exposer_;
};

}  // namespace sparsecar
