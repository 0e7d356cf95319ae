// The control commands: a table of every command with its arguments, and the Dispatcher that
// turns one request message into one reply message.
//
// The Dispatcher knows the protocol (protocol.h) and the command table; what a command does to
// the daemon goes through ControlBackend, so the table is unit-tested against a fake backend
// (tests/unit/control/) and the daemon supplies the real one (daemon_backend.h).
//
//   status                                     job, rank, peers, step, plan per tensor group, ...
//   get          [knob]                        one knob or every knob (newest decision)
//   set          knob, value | knobs{k: v}     live knobs; forwarded to rank 0; reply has the step
//   policy       controller                    switch the controller (knob `controller`)
//   report-metric name, value, [step]          a scalar for controllers and the dashboards
//   pause / resume                             compression off (dense) / on, job-wide
//   drain        [timeout_ms], [cancel]        finish queued steps, refuse new ones
//   checkpoint   path                          write every tensor's residual to a file
//   restore      path                          read them back (same tensors, same sizes)
//   commands                                   this table
//
// Thread-safety: handle() runs on the control thread; the backend's methods are called there.
#pragma once

#include <chrono>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "daemon/config/knobs.h"
#include "daemon/control/protocol.h"
#include "daemon/pipeline/decisions.h"
#include "sparsecar/common/status.h"

namespace sparsecar {
class Metrics;
}

namespace sparsecar::control {

// What the commands do to the daemon. Every method runs on the control thread and returns
// within its own bound (propose/drain/checkpoint take a deadline or timeout).
class ControlBackend {
 public:
  virtual ~ControlBackend() = default;
  // Job, rank, peers and their state, step, epoch, plan per tensor group, clients, draining.
  virtual nlohmann::json status() = 0;
  // The newest decision known on this node (its config holds every knob's value).
  virtual Decision latest_decision() = 0;
  // Job-wide live knob change through rank 0 (DecisionBoard::propose).
  virtual Expected<Decision> propose(const KnobChanges& changes, const std::string& reason) = 0;
  virtual Status report_metric(const std::string& name, double value, uint64_t step) = 0;
  virtual Expected<nlohmann::json> drain(std::chrono::milliseconds timeout, bool cancel) = 0;
  virtual Expected<nlohmann::json> checkpoint(const std::string& path) = 0;
  virtual Expected<nlohmann::json> restore(const std::string& path) = 0;
};

enum class ArgType { kString, kNumber, kInteger, kBool, kScalar, kObject };

struct ArgSpec {
  const char* name;
  ArgType type;
  bool required;
  const char* doc;
};

struct CommandSpec {
  const char* name;
  const char* doc;
  std::vector<ArgSpec> args;
  bool changes_state;  // false: read-only (status, get, commands)
};

const std::vector<CommandSpec>& command_table();
const CommandSpec* find_command(std::string_view name);

struct DispatcherOptions {
  size_t max_message_bytes = kDefaultMaxMessageBytes;
  std::string token;  // non-empty: every request must carry it ("token" field)
};

class Dispatcher {
 public:
  // `metrics` may be null.
  Dispatcher(ControlBackend* backend, Metrics* metrics, DispatcherOptions options = {});
  // One request message in, one reply message out. Never throws.
  std::string handle(std::string_view message);

 private:
  Expected<nlohmann::json> run(const Request& request);
  const DispatcherOptions options_;
  ControlBackend* const backend_;
  Metrics* const metrics_;
};

// A JSON scalar as the text set_knob() parses: "on"/"off" for booleans, shortest round-trip
// text for numbers, strings unchanged.
std::string scalar_text(const nlohmann::json& value);

}  // namespace sparsecar::control
