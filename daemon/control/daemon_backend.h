// DaemonBackend: the control commands applied to a running daemon's parts (the real
// ControlBackend; commands.h has the fake-able interface).
//
// set/pause/resume/policy go through DecisionBoard::propose (rank 0 decides, every node applies
// at one step); checkpoint/restore/drain are queued on the pipeline thread; status reads
// snapshots. Also refreshes the mirrored gauges before each scrape (refresh_metrics()).
// Time: deadlines (propose, drain, checkpoint, restore) and drain's duration are read only
// through the parts' Clock (DaemonParts::clock).
// Thread-safety: commands run on the control thread; refresh_metrics() on the exposer's thread;
// both only read thread-safe snapshots of the parts.
#pragma once

#include <chrono>

#include "daemon/control/commands.h"
#include "sparsecar/common/clock.h"

namespace sparsecar {
class Mailbox;
class Metrics;
class ControllerRunner;
class Pipeline;
class SessionServer;
class Transport;
}  // namespace sparsecar

namespace sparsecar::control {

struct DaemonParts {
  Config config;  // start-up configuration
  Metrics* metrics = nullptr;
  Mailbox* mailbox = nullptr;
  Transport* transport = nullptr;  // null when world_size == 1
  DecisionBoard* decisions = nullptr;
  Pipeline* pipeline = nullptr;
  SessionServer* sessions = nullptr;
  const ControllerRunner* controllers = nullptr;  // rank 0 only
  const Clock* clock = &steady_clock();  // the one the parts above read time through
};

class DaemonBackend final : public ControlBackend {
 public:
  explicit DaemonBackend(DaemonParts parts) : p_(std::move(parts)) {}

  nlohmann::json status() override;
  Decision latest_decision() override;
  Expected<Decision> propose(const KnobChanges& changes, const std::string& reason) override;
  Status report_metric(const std::string& name, double value, uint64_t step) override;
  Expected<nlohmann::json> drain(std::chrono::milliseconds timeout, bool cancel) override;
  Expected<nlohmann::json> checkpoint(const std::string& path) override;
  Expected<nlohmann::json> restore(const std::string& path) override;

  void refresh_metrics();

 private:
  DaemonParts p_;
  struct SessionCounts {
    uint64_t protocol = 0, clients = 0, registrations = 0, submissions = 0, over_budget = 0, evicted = 0, device_refused = 0;
  } last_;  // session counters already added to sparsecar_errors_total (exposer thread)
};

}  // namespace sparsecar::control
