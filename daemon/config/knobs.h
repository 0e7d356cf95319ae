// The knob table: every tunable of sparsecard, declared once.
//
// Each knob has a name, a type, a default, a range or choice list, a one-line doc, whether it may
// change while a job runs (`live`), whether every node of a job must hold the same value
// (`agreed`, checked by rank 0 at the first step), where its value lives in Config and which
// fields of the policies' settings it feeds (KnobField). The command line (--<name with dashes>),
// the config file (`name = value`), the environment fallbacks, `--help`, the control socket and
// the policies' settings (daemon/pipeline/settings.h, through write_knobs) all read this one
// table, so they cannot drift apart. Adding a knob: its Config field and its row in knobs.cc.
// The selector parameters' rows are not written here: knobs.cc makes one per row of the selector
// registry's kSelectorParams (kernels/selectors.h), in its order, after the `selector` knob.
//
// Thread-safety: the table is immutable; a Config is a plain value owned by whoever holds it.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "sparsecar/common/status.h"
#include "sparsecar/kernels/selectors.h"
#include "sparsecar/kernels/types.h"
#include "sparsecar/policies/overrides.h"

namespace sparsecar {

namespace policies {
struct StaticSettings;      // plan.h
struct PlanSettings;        // tensor_plan.h
struct ControllerSettings;  // controllers.h
struct ControlKnobs;        // controllers.h
}  // namespace policies

// Every knob's current value. Defaults here are the documented defaults.
struct Config {
  // Placement of this daemon in the job (structural: fixed for the daemon's life).
  uint32_t rank = 0;
  uint32_t world_size = 1;
  std::string coordinator = "127.0.0.1:29600";
  uint64_t job_id = 0;
  std::string job_secret_file;  // empty: the job is open (anyone reaching the coordinator may join)
  uint32_t local_clients = 1;
  std::string socket = "/run/sparsecar/sparsecard.sock";
  std::string control = "auto";  // auto: ipc://<socket without .sock>-control.sock
  std::string control_group;     // empty: the control socket is 0600 (owner only)
  std::string control_token;     // required by tcp:// unless CURVE is configured
  std::string control_curve_secret_key;  // Z85, 40 characters: tcp:// with CURVE
  uint32_t control_max_message_bytes = 65536;
  uint32_t drain_timeout_ms = 10000;  // SIGTERM: how long queued steps may finish
  std::string metrics_listen = "auto";  // 127.0.0.1:(9464 + rank) (local_paths.h)
  std::string log_level = "info";
  double progress_log_seconds = 10;  // periodic progress line (pipeline/progress.h); 0 = off
  std::string ucx_tls;          // empty: UCX's default (or UCX_TLS)
  std::string ucx_net_devices;  // empty: all
  uint32_t kernel_threads = 1;  // threads one selection kernel call may use (kernels/parallel.h)
  uint64_t mailbox_max_bytes = uint64_t{4} << 30;  // payload bytes one peer may have waiting here
  uint64_t tensor_memory_budget_bytes = 0;  // registered tensors' memory on this node; 0 = half of RAM
  uint32_t session_handshake_timeout_ms = 2000;  // a trainer connection must say Hello within this

  // Compression: every node must agree on these.
  bool compression = true;
  kernels::Selector selector = kernels::Selector::kTopk;
  // Every selector parameter's knob, one field each (kernels/selectors.h: kSelectorParams names
  // the knobs, their ranges, defaults and docs; `seed` is the random_seed knob).
  kernels::SelectorParams selector_params;
  // Error compensation (issue 3; agreed).
  std::string error_feedback = "residual";  // residual|momentum|off
  double momentum = 0.9;                  // error_feedback = momentum: DGC's m
  double clip_norm = 0;                   // > 0: local gradient clipping to this L2 norm
  std::string lr_rescale = "off";         // off|new_over_old|old_over_new
  std::string dense_collective = "ring";  // ring|trainer: who reduces dense plans (policies/plan.h)
  uint64_t trainer_lease = 16;            // trainer-reduced dense steps a trainer may run unasked
  std::string tensor_overrides;           // "GLOB: key=value, ...; GLOB: ..." (policies/overrides.h)
  // Encoding of the selection (kernels/codec.h). Receivers decode whatever arrives, so nodes need
  // not agree; `auto` takes the smallest exact size per message.
  std::string format = "coo";       // coo|coo_varint|bitmap|csr|rle|dense|auto
  std::string value_type = "fp32";  // fp32|fp16|bf16|int8 (quantisation error stays in the residual)

  // Controllers (policies/; docs/controllers.md). Plan-shaping knobs are agreed and live: they
  // change through decision epochs; the rest are read by rank 0's controllers only.
  std::string controller = "static";  // comma list: static|schedule|layerwise|gradnorm|frequency|
                                      // bandwidth|accuracy|budget|cost
  double density_min = 1e-5;          // quality floor of every controller
  double density_max = 1.0;
  double density_cap = 1.0;           // set by the bandwidth controller (1 = no cap)
  std::string tensor_density_scale;   // set by the frequency controller: "id:scale,..."
  uint64_t schedule_warmup_steps = 0;
  uint64_t schedule_ramp_steps = 0;
  double schedule_start_density = 0.25;
  double schedule_end_density = 0;    // 0: `density`
  std::string schedule_shape = "exp";
  uint64_t schedule_dense_every = 0;
  uint64_t schedule_dense_from = 0;   // 0: never
  uint64_t layerwise_dense_below = 4096;
  double layerwise_small_scale = 10.0;
  double layerwise_embedding_scale = 0.1;
  std::string layerwise_sensitivity;  // "pattern:dense|scale,..."
  double dense_above = 0.5;           // a planned density at or above this is sent dense
  uint64_t controller_interval_steps = 2;
  double controller_hysteresis = 0.1;
  std::string controller_metric = "loss";
  double gradnorm_jump = 2.0;
  double gradnorm_boost = 4.0;
  uint64_t gradnorm_boost_steps = 20;
  uint64_t gradnorm_window = 20;
  double gradnorm_steady_cv = 0.05;
  double gradnorm_steady_scale = 0.5;
  double frequency_max_scale = 4.0;
  double frequency_alpha = 0.2;
  double exchange_budget_ms = 0;
  double exchange_budget_fraction = 1.0;
  double goodput_smoothing = 0.3;
  double bandwidth_margin = 0.15;
  bool bandwidth_allow_dense = true;
  uint32_t goodput_confirm_steps = 2;
  uint32_t bandwidth_confirm_steps = 3;
  uint32_t bandwidth_hold_steps = 6;
  double bandwidth_raise_max = 2.0;
  double bandwidth_lower_max = 16.0;
  double accuracy_tolerance = 0.02;
  double accuracy_backoff = 2.0;
  double accuracy_tighten = 0.9;
  uint64_t accuracy_hold_steps = 5;
  double accuracy_alpha = 0.3;
  double accuracy_error_bound = 0;
  double accuracy_error_margin = 1.5;
  uint64_t accuracy_calibrate_steps = 10;
  double budget_total_elements = 0;
  uint64_t budget_steps = 0;
  double budget_total_bytes = 0;
  double budget_density = 0;
  double budget_max_move = 2.0;
  uint64_t budget_settle_steps = 3;
  double step_slack = 0.1;
  uint64_t step_confirm_steps = 3;
  uint64_t step_hold_steps = 10;
  double step_forget = 0.8;
  bool step_allow_dense = true;
  double step_dense_worth = 1.3;
  double step_dense_worth_corrected = 1.6;
  double step_warmup_cut = 2.0;
  double step_probe_share = 0.02;
  uint64_t step_timed_send_every = 4;

  // Deadlines.
  uint32_t step_timeout_ms = 30000;   // a step whose peers do not answer in time fails
  uint32_t join_timeout_ms = 120000;  // rendezvous and the first-step agreement check
  uint32_t peer_down_grace_ms = 30000;  // a peer lost: exit (status 3) after this long; 0 = never
  bool accept_replacements = true;      // rank 0: a lost rank's replacement may rejoin the running job
};

enum class KnobType { kBool, kUint, kDouble, kString, kChoice };

// tensor_overrides parsed once per distinct text. Every decision epoch brings a new Config (a
// controller may make one every few steps) while the override rules rarely change: whoever owns
// the Configs keeps one of these and write_knobs parses only when the text differs from the
// previous call's.
// Thread-safety: none; one per owning thread (the pipeline thread keeps its own).
class OverridesCache {
 public:
  // The rules of `text`; an unparsable text (validate() rejects it when set) is no rules.
  const std::vector<policies::TensorOverride>& rules(const std::string& text);
  // Times the text was parsed (for tests).
  uint64_t parses() const { return parses_; }

 private:
  bool valid_ = false;
  uint64_t parses_ = 0;
  std::string text_;
  std::vector<policies::TensorOverride> rules_;
};

// The policy settings write_knobs fills; a null pointer is a struct not wanted this time.
struct KnobTargets {
  policies::StaticSettings* base = nullptr;
  policies::PlanSettings* plan = nullptr;  // its schedule and layerwise parts too (`base` apart)
  policies::ControllerSettings* controllers = nullptr;
  policies::ControlKnobs* control = nullptr;
  OverridesCache* overrides_cache = nullptr;  // null: tensor_overrides is parsed on every call
};

// Where a knob's value lives: its Config field, and a function that writes the value into every
// policy-settings field the knob feeds (converted: a choice name to its enum, a table text to
// its parsed form). Rows make one with knob_field<&Config::x, targets...> (knobs.cc).
// A selector parameter's knob has no Config member of its own: its `member` is the parameter, whose
// value is the field of Config::selector_params it names (kernels::get_param / set_param).
struct KnobField {
  std::variant<bool Config::*, uint32_t Config::*, uint64_t Config::*, double Config::*, std::string Config::*,
               kernels::Selector Config::*, kernels::SelectorParam>
      member;
  void (*write)(const Config& config, const KnobTargets& to);
};

// One row of the table. Rows spell every field out (designated initialisers, no defaults), so a
// forgotten column is a compile error, not a silent `false`.
struct KnobSpec {
  const char* name;     // snake_case; the flag is --name-with-dashes
  KnobType type;
  bool live;            // may change while a job runs
  bool agreed;          // every node of the job must hold the same value
  bool secret;          // never shown by `get`/status (tokens, keys)
  const char* env;      // environment variables used when neither flag nor file sets it, "|"-separated,
                        // the first one set wins ("" none)
  double min;           // inclusive range for numeric knobs
  double max;
  const char* choices;  // "|"-separated, for kChoice ("" otherwise)
  const char* doc;
  KnobField field;
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

// Writes every knob's value into the policy settings `to` points at, through the rows' fields.
// Fields no knob feeds keep their defaults (settings.h fills the settings this way).
void write_knobs(const Config& config, const KnobTargets& to);

// "compression=on selector=topk density=0.002 threshold=0.001" — every `agreed` knob, in table
// order. Nodes compare these at the first step.
std::string agreed_knobs(const Config& config);

// Everything start-up checks about a configuration, short of binding sockets: cross-knob checks
// (rank < world size, a selector's parameter in range, ...), the control endpoint and its token
// or CURVE key, the metrics listen address. `--check-config` and Daemon::start both call this one
// function, so a file that passes the check does not fail at start for a reason it could have seen.
Status validate(const Config& config);

}  // namespace sparsecar
