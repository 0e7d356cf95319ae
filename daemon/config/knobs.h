// The knob table: every tunable of sparsecard, declared once.
//
// Each knob has a name, a type, a default, a range or choice list, a one-line doc, whether it may
// change while a job runs (`live`), and whether every node of a job must hold the same value
// (`agreed`, checked by rank 0 at the first step). The command line (--<name with dashes>),
// the config file (`name = value`), the environment fallbacks, `--help` and (later) the control
// socket all read this one table, so they cannot drift apart.
//
// Thread-safety: the table is immutable; a Config is a plain value owned by whoever holds it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "sparsecar/common/status.h"
#include "sparsecar/kernels/types.h"

namespace sparsecar {

// Every knob's current value. Defaults here are the documented defaults.
struct Config {
  // Placement of this daemon in the job (structural: fixed for the daemon's life).
  uint32_t rank = 0;
  uint32_t world_size = 1;
  std::string coordinator = "127.0.0.1:29600";
  uint64_t job_id = 0;
  uint32_t local_clients = 1;
  std::string socket = "/run/sparsecar/sparsecard.sock";
  std::string control = "ipc:///run/sparsecar/control.sock";
  std::string metrics_listen = "127.0.0.1:9464";
  std::string log_level = "info";
  std::string ucx_tls;          // empty: UCX's default (or UCX_TLS)
  std::string ucx_net_devices;  // empty: all

  // Compression: every node must agree on these.
  bool compression = true;
  kernels::Selector selector = kernels::Selector::kTopk;
  double density = 0.01;    // fraction kept by top-k
  double threshold = 1e-3;  // lambda of the hard-threshold selector

  // Deadlines.
  uint32_t step_timeout_ms = 30000;   // a step whose peers do not answer in time fails
  uint32_t join_timeout_ms = 120000;  // rendezvous and the first-step agreement check
};

enum class KnobType { kBool, kUint, kDouble, kString, kChoice };

struct KnobSpec {
  const char* name;      // snake_case; the flag is --name-with-dashes
  KnobType type;
  const char* doc;
  double min = 0;        // inclusive range for numeric knobs
  double max = 0;
  const char* choices = "";  // "|"-separated, for kChoice
  bool live = false;     // may change while a job runs
  bool agreed = false;   // every node of the job must hold the same value
  const char* env = "";  // environment variable used when neither flag nor file sets it
};

const std::vector<KnobSpec>& knob_table();
const KnobSpec* find_knob(std::string_view name);

// Parses and range-checks `value` for knob `name` and stores it in `config`.
// Errors name the knob, the bad value and what is allowed.
Status set_knob(Config& config, std::string_view name, std::string_view value);
// The knob's current value as text, in the form set_knob() accepts.
Expected<std::string> get_knob(const Config& config, std::string_view name);
// Text of the default value, for --help.
std::string knob_default(const KnobSpec& spec);

// "compression=on selector=topk density=0.002 threshold=0.001" — every `agreed` knob, in table
// order. Nodes compare these at the first step.
std::string agreed_knobs(const Config& config);

// Cross-knob checks (rank < world size, a selector's parameter in range, ...).
Status validate(const Config& config);

}  // namespace sparsecar
