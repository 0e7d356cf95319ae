#include "daemon/config/knobs.h"

#include <arpa/inet.h>

#include <charconv>
#include <cmath>
#include <cstdio>
#include <variant>

#include "daemon/transport/auth.h"
#include "sparsecar/common/log.h"
#include "sparsecar/kernels/selectors.h"
#include "sparsecar/policies/compression_knobs.h"
#include "sparsecar/policies/overrides.h"
#include "sparsecar/policies/tensor_plan.h"

namespace sparsecar {
namespace {

using Member = std::variant<bool Config::*, uint32_t Config::*, uint64_t Config::*, double Config::*,
                            std::string Config::*, kernels::Selector Config::*>;

struct Knob {
  KnobSpec spec;
  Member member;
};

// The selector knob's doc: every row of the selector registry (kernels/selectors.h) with its doc.
std::string selector_knob_doc() {
  std::string doc = "how coordinates are chosen when compression is on:";
  for (const kernels::SelectorInfo& row : kernels::selector_registry()) {
    if (row.id == kernels::Selector::kNone) continue;
    doc.append(" ").append(row.name).append(" = ").append(row.doc).append(";");
  }
  doc.pop_back();
  return doc;
}

const std::vector<Knob>& knobs() {
  using K = KnobType;
  namespace R = policies;  // ranges and choices shared with the per-tensor overrides (compression_knobs.h)
  using P = kernels::SelectorParam;
  // Names, docs and ranges of the selectors and their parameters: the selector registry.
  auto doc = [](P p) { return kernels::selector_param(p).doc; };
  static const std::string selector_choices = kernels::selector_choices();
  static const std::string selector_doc = selector_knob_doc();
  static const std::string error_feedback_doc = [] {
    std::string unbiased;
    for (const kernels::SelectorInfo& row : kernels::selector_registry()) {
      if (row.unbiased) unbiased.append(unbiased.empty() ? "" : "/").append(row.name);
    }
    return "unsent part: residual (plain EF), momentum (DGC momentum correction + factor masking), off (dropped; " +
           unbiased + " then send unbiased x/p)";
  }();
  static const std::string overrides_doc =
      "per-tensor settings, 'GLOB: key=value, ...; GLOB: ...' (keys " + policies::tensor_override_keys() +
      "; values as those knobs; later rules win); a config file's [tensor.\"GLOB\"] tables add to it";
  static const std::vector<Knob> table = {
      {{"rank", K::kUint, "rank of this node in the job (0 = leader/coordinator)", 0, 65535, "", false,
        false, "RANK"},
       &Config::rank},
      {{"world_size", K::kUint, "number of nodes (daemons) in the job", 1, 65536, "", false, true,
        "WORLD_SIZE"},
       &Config::world_size},
      {{"coordinator", K::kString,
        "HOST:PORT of rank 0's rendezvous listener (fallback: MASTER_ADDR and MASTER_PORT+1)", 0, 0, "",
        false, false, "SPARSECAR_COORDINATOR"},
       &Config::coordinator},
      {{"job_id", K::kUint, "job identifier; daemons of different jobs refuse each other", 0, 1.8e19, "",
        false, true, "SPARSECAR_JOB_ID"},
       &Config::job_id},
      {{"job_secret_file", K::kString,
        "file holding the job's shared secret (16 bytes to 4 KiB; owned by the daemon's uid, mode 0600): peers "
        "prove they hold it at rendezvous and MAC every message with it; empty = an open job that any host "
        "reaching the coordinator port can join",
        0, 0, "", false, false, "SPARSECAR_JOB_SECRET_FILE"},
       &Config::job_secret_file},
      {{"local_clients", K::kUint, "trainer processes per node whose gradients are summed each step", 1,
        1024, "", false, false, "LOCAL_WORLD_SIZE"},
       &Config::local_clients},
      {{"socket", K::kString, "Unix socket path trainers connect to", 0, 0, "", false, false,
        "SPARSECAR_SOCKET"},
       &Config::socket},
      {{"control", K::kString,
        "ZeroMQ control endpoint: ipc://PATH, tcp://HOST:PORT (needs a token or CURVE key), 'auto' "
        "(ipc:// beside the trainer socket: <socket minus .sock>-control.sock) or 'off'",
        0, 0, "", false, false, "SPARSECAR_CONTROL"},
       &Config::control},
      {{"control_group", K::kString, "group allowed to use the ipc:// control socket (mode 0660); empty = 0600", 0,
        0, "", false, false, ""},
       &Config::control_group},
      {{"control_token", K::kString, "shared token every tcp:// control request must carry (16+ characters)", 0, 0,
        "", false, false, "SPARSECAR_CONTROL_TOKEN", true},
       &Config::control_token},
      {{"control_curve_secret_key", K::kString, "Z85 CURVE server secret key for a tcp:// control endpoint", 0, 0,
        "", false, false, "", true},
       &Config::control_curve_secret_key},
      {{"control_max_message_bytes", K::kUint, "largest control request served (bigger: TOO_LARGE)", 1024, 16777216,
        "", false, false, ""},
       &Config::control_max_message_bytes},
      {{"drain_timeout_ms", K::kUint, "on SIGTERM, how long queued steps may finish before shutdown", 0, 3.6e6, "",
        true, false, ""},
       &Config::drain_timeout_ms},
      {{"metrics_listen", K::kString, "ADDRESS:PORT for Prometheus /metrics, or 'off'", 0, 0, "", false,
        false, ""},
       &Config::metrics_listen},
      {{"log_level", K::kChoice, "log verbosity", 0, 0, "error|warn|info|debug|trace", true, false,
        "SPARSECAR_LOG_LEVEL"},
       &Config::log_level},
      {{"ucx_tls", K::kString, "UCX transports (UCX_TLS syntax, e.g. tcp or posix,self); empty = UCX default",
        0, 0, "", false, false, ""},
       &Config::ucx_tls},
      {{"ucx_net_devices", K::kString, "UCX network devices (e.g. lo); empty = all", 0, 0, "", false, false,
        ""},
       &Config::ucx_net_devices},
      {{"kernel_threads", K::kUint,
        "threads one kernel call may use: selection (top-k, threshold, EF + threshold) and decoding "
        "(dense, COO, bitmap) of large tensors and messages (256 Ki elements, 16 Ki COO entries or "
        "1 Mi bitmap elements per thread); results are identical for every count",
        1, 64, "", false, false, "SPARSECAR_KERNEL_THREADS"},
       &Config::kernel_threads},
      {{"mailbox_max_bytes", K::kUint,
        "payload bytes one peer may have waiting in this daemon's mailbox (about two steps of its "
        "messages are needed); a message beyond it is rejected and fails its step",
        65536, 1.1e12, "", false, false, ""},
       &Config::mailbox_max_bytes},
      {{"tensor_memory_budget_bytes", K::kUint,
        "memory this node may spend on registered tensors: every trainer's shm slot plus the session's and "
        "the pipeline's buffers per tensor; a registration beyond it is refused (RESOURCE_EXHAUSTED); "
        "0 = half the physical memory (or of the cgroup's memory.max)",
        0, 1.8e19, "", false, false, ""},
       &Config::tensor_memory_budget_bytes},
      {{"session_handshake_timeout_ms", K::kUint,
        "a connection to the trainer socket must complete its handshake within this (silent ones are "
        "closed; at most 8 of one uid wait at once, a newer one closes the oldest)",
        100, 60000, "", false, false, ""},
       &Config::session_handshake_timeout_ms},
      {{"compression", K::kBool, "compress gradients (off = exact dense average)", 0, 0, "", true, true, ""},
       &Config::compression},
      {{"selector", K::kChoice, selector_doc.c_str(), 0, 0, selector_choices.c_str(), true, true, ""},
       &Config::selector},
      {{"density", K::kDouble, doc(P::kDensity), R::kDensityRange.min,
        R::kDensityRange.max, "", true, true, ""},
       &Config::density},
      {{"threshold", K::kDouble, doc(P::kThreshold),
        R::kThresholdRange.min, R::kThresholdRange.max, "", true, true, ""},
       &Config::threshold},
      {{"block_size", K::kUint, doc(P::kBlockSize),
        R::kBlockSizeRange.min, R::kBlockSizeRange.max, "", true, true, ""},
       &Config::block_size},
      {{"group_norm", K::kChoice, doc(P::kGroupNorm), 0, 0,
        R::kGroupNormChoices, true, true, ""},
       &Config::group_norm},
      {{"heads", K::kUint, doc(P::kHeads),
        R::kHeadsRange.min, R::kHeadsRange.max, "", true, true, ""},
       &Config::heads},
      {{"mask_period", K::kUint, doc(P::kMaskPeriod),
        R::kMaskPeriodRange.min, R::kMaskPeriodRange.max, "", true, true, ""},
       &Config::mask_period},
      {{"hybrid_density", K::kDouble, doc(P::kHybridDensity),
        R::kHybridDensityRange.min, R::kHybridDensityRange.max, "", true, true, ""},
       &Config::hybrid_density},
      {{"quantile", K::kDouble, doc(P::kQuantile),
        R::kQuantileRange.min, R::kQuantileRange.max, "", true, true, ""},
       &Config::quantile},
      {{"approx_tolerance", K::kDouble, doc(P::kApproxTolerance),
        R::kApproxToleranceRange.min, R::kApproxToleranceRange.max, "", true, true, ""},
       &Config::approx_tolerance},
      {{"random_seed", K::kUint, doc(P::kRandomSeed), kernels::selector_param(P::kRandomSeed).min,
        kernels::selector_param(P::kRandomSeed).max, "", true, true, ""},
       &Config::random_seed},
      {{"error_feedback", K::kChoice, error_feedback_doc.c_str(), 0, 0, R::kErrorFeedbackChoices, true, true, ""},
       &Config::error_feedback},
      {{"momentum", K::kDouble, "error_feedback=momentum: velocity factor m (u = m u + g; v += u)",
        R::kMomentumRange.min, R::kMomentumRange.max, "", true, true, ""},
       &Config::momentum},
      {{"clip_norm", K::kDouble, "local gradient clipping: scale each node's gradient to at most this L2 norm (0 = off)",
        R::kClipNormRange.min, R::kClipNormRange.max, "", true, true, ""},
       &Config::clip_norm},
      {{"lr_rescale", K::kChoice,
        "when the trainer's lr changes: residual *= lr_new/lr_old (new_over_old), lr_old/lr_new (old_over_new) or off",
        0, 0, "off|new_over_old|old_over_new", true, true, ""},
       &Config::lr_rescale},
      {{"tensor_overrides", K::kString, overrides_doc.c_str(), 0, 0, "", true, true, ""},
       &Config::tensor_overrides},
      {{"format", K::kChoice,
        "payload layout of the selection; auto = the smallest exact size per message (WIRE.md)", 0, 0,
        R::kFormatChoices, true, false, ""},
       &Config::format},
      {{"value_type", K::kChoice,
        "value encoding: fp32 exact; fp16/bf16 rounded; int8 with a per-message scale (error kept in the residual)",
        0, 0, R::kValueTypeChoices, true, false, ""},
       &Config::value_type},
      // Controllers (docs/controllers.md). Knobs that shape per-tensor plans are agreed.
      {{"controller", K::kString,
        "active controllers, a comma list of static|schedule|layerwise|gradnorm|frequency|bandwidth|accuracy|"
        "budget|cost (static = fixed knobs, the fallback)",
        0, 0, "", true, true, ""},
       &Config::controller},
      {{"density_min", K::kDouble, "controllers never go below this density (quality floor)", 1e-6, 1.0, "", true,
        true, ""},
       &Config::density_min},
      {{"density_max", K::kDouble, "controllers never go above this density", 1e-6, 1.0, "", true, true, ""},
       &Config::density_max},
      {{"density_cap", K::kDouble, "upper bound on every tensor's density (set by the bandwidth controller)", 1e-6,
        1.0, "", true, true, ""},
       &Config::density_cap},
      {{"tensor_density_scale", K::kString,
        "per-tensor density multipliers 'id:scale,...' (set by the frequency controller)", 0, 0, "", true, true, ""},
       &Config::tensor_density_scale},
      {{"schedule_warmup_steps", K::kUint, "schedule: the first N steps are dense", 0, 1e15, "", true, true, ""},
       &Config::schedule_warmup_steps},
      {{"schedule_ramp_steps", K::kUint,
        "schedule: after warm-up the density moves from schedule_start_density to the end over N steps (0 = off)", 0,
        1e15, "", true, true, ""},
       &Config::schedule_ramp_steps},
      {{"schedule_start_density", K::kDouble, "schedule: density at the start of the ramp (0.25 = 75 % sparsity)",
        1e-6, 1.0, "", true, true, ""},
       &Config::schedule_start_density},
      {{"schedule_end_density", K::kDouble,
        "schedule: density at the end of the ramp; 0 = `density` (ramp 0.25 -> 0.001 = DGC, 0.01 -> 0.1 = decay)", 0,
        1.0, "", true, true, ""},
       &Config::schedule_end_density},
      {{"schedule_shape", K::kChoice, "schedule: exp (geometric, DGC) or linear", 0, 0, "exp|linear", true, true, ""},
       &Config::schedule_shape},
      {{"schedule_dense_every", K::kUint, "schedule: every N-th step is dense (0 = never)", 0, 1e15, "", true, true,
        ""},
       &Config::schedule_dense_every},
      {{"layerwise_dense_below", K::kUint, "layerwise: tensors with fewer elements are sent dense", 0, 1e15, "", true,
        true, ""},
       &Config::layerwise_dense_below},
      {{"layerwise_small_scale", K::kDouble, "layerwise: density multiplier for bias/norm tensors", 1e-6, 1e6, "",
        true, true, ""},
       &Config::layerwise_small_scale},
      {{"layerwise_embedding_scale", K::kDouble, "layerwise: density multiplier for embedding tensors", 1e-6, 1e6, "",
        true, true, ""},
       &Config::layerwise_embedding_scale},
      {{"layerwise_sensitivity", K::kString,
        "layerwise: sensitivity table 'name-substring:dense|scale,...' (first match wins)", 0, 0, "", true, true, ""},
       &Config::layerwise_sensitivity},
      {{"controller_interval_steps", K::kUint, "rank 0 proposes at most one controller decision per N steps", 1,
        1e9, "", true, false, ""},
       &Config::controller_interval_steps},
      {{"controller_hysteresis", K::kDouble, "relative density change a controller needs before it proposes", 0, 10,
        "", true, false, ""},
       &Config::controller_hysteresis},
      {{"controller_metric", K::kString,
        "trainer metric the accuracy controller tracks (lower is better; '<name>_target' = explicit target)", 0, 0,
        "", true, false, ""},
       &Config::controller_metric},
      {{"gradnorm_jump", K::kDouble, "gradnorm: norm / running mean above this is a jump", 1.0, 1e6, "", true, false,
        ""},
       &Config::gradnorm_jump},
      {{"gradnorm_boost", K::kDouble, "gradnorm: density multiplier after a jump", 1.0, 1e6, "", true, false, ""},
       &Config::gradnorm_boost},
      {{"gradnorm_boost_steps", K::kUint, "gradnorm: steps the boost lasts", 0, 1e9, "", true, false, ""},
       &Config::gradnorm_boost_steps},
      {{"gradnorm_window", K::kUint, "gradnorm: steps over which steadiness is judged", 2, 1e6, "", true, false, ""},
       &Config::gradnorm_window},
      {{"gradnorm_steady_cv", K::kDouble, "gradnorm: coefficient of variation below which the norm is steady", 0, 10,
        "", true, false, ""},
       &Config::gradnorm_steady_cv},
      {{"gradnorm_steady_scale", K::kDouble, "gradnorm: density multiplier while steady", 1e-6, 1.0, "", true, false,
        ""},
       &Config::gradnorm_steady_scale},
      {{"frequency_max_scale", K::kDouble, "frequency: largest per-tensor density multiplier (and 1/x smallest)",
        1.0, 1e3, "", true, false, ""},
       &Config::frequency_max_scale},
      {{"exchange_budget_ms", K::kDouble,
        "bandwidth: exchange time budget per step in ms (0 = exchange_budget_fraction x reported compute time)", 0,
        3.6e6, "", true, false, ""},
       &Config::exchange_budget_ms},
      {{"exchange_budget_fraction", K::kDouble, "bandwidth: budget as a fraction of the trainer's compute time",
        1e-3, 1e3, "", true, false, ""},
       &Config::exchange_budget_fraction},
      {{"goodput_smoothing", K::kDouble, "bandwidth: EMA weight (log domain) of a new goodput sample", 1e-3,
        1.0, "", true, false, ""},
       &Config::goodput_smoothing},
      {{"bandwidth_margin", K::kDouble, "bandwidth: aim at (1 - margin) of the budget", 0, 0.9, "", true, false, ""},
       &Config::bandwidth_margin},
      {{"bandwidth_allow_dense", K::kBool, "bandwidth: switch to the dense ring when it fits the budget", 0, 0, "",
        true, false, ""},
       &Config::bandwidth_allow_dense},
      {{"goodput_confirm_steps", K::kUint,
        "bandwidth: consecutive goodput samples more than 2x off the estimate before it follows them", 1, 100, "",
        true, false, ""},
       &Config::goodput_confirm_steps},
      {{"bandwidth_confirm_steps", K::kUint,
        "bandwidth: consecutive observations over budget (or with room) before the controller moves", 1, 100, "",
        true, false, ""},
       &Config::bandwidth_confirm_steps},
      {{"bandwidth_hold_steps", K::kUint, "bandwidth: at least this many steps between its decisions", 0, 10000, "",
        true, false, ""},
       &Config::bandwidth_hold_steps},
      {{"bandwidth_raise_max", K::kDouble, "bandwidth: one decision raises the density cap at most this factor", 1.01,
        1000, "", true, false, ""},
       &Config::bandwidth_raise_max},
      {{"bandwidth_lower_max", K::kDouble, "bandwidth: one decision lowers the density cap at most this factor", 1.01,
        1e6, "", true, false, ""},
       &Config::bandwidth_lower_max},
      {{"accuracy_tolerance", K::kDouble, "accuracy: relative metric gap to the target that triggers a back-off", 0,
        10, "", true, false, ""},
       &Config::accuracy_tolerance},
      {{"accuracy_backoff", K::kDouble, "accuracy: density multiplier when behind", 1.0, 1e3, "", true, false, ""},
       &Config::accuracy_backoff},
      {{"accuracy_tighten", K::kDouble, "accuracy: density multiplier when on track", 1e-3, 1.0, "", true, false,
        ""},
       &Config::accuracy_tighten},
      {{"accuracy_hold_steps", K::kUint, "accuracy: steps between two moves", 1, 1e9, "", true, false, ""},
       &Config::accuracy_hold_steps},
      {{"budget_total_elements", K::kDouble,
        "budget: elements each node may send over the whole run (hard threshold; 0 = off)", 0, 1e18, "", true,
        false, ""},
       &Config::budget_total_elements},
      {{"budget_steps", K::kUint, "budget: length of the run in steps", 0, 1e15, "", true, false, ""},
       &Config::budget_steps},
      {{"step_timeout_ms", K::kUint, "deadline for peers to deliver a step", 10, 3.6e6, "", true, false, ""},
       &Config::step_timeout_ms},
      {{"join_timeout_ms", K::kUint, "deadline for the rendezvous and the first-step agreement check", 100,
        3.6e6, "", false, false, ""},
       &Config::join_timeout_ms},
      {{"peer_down_grace_ms", K::kUint,
        "after a peer is lost (killed, unreachable) the daemon keeps failing steps loudly for this long, then "
        "exits with status 3 so the service manager restarts the job (0: never exit)",
        0, 3.6e6, "", false, false, ""},
       &Config::peer_down_grace_ms},
      {{"accept_replacements", K::kBool,
        "rank 0: after the job has formed, admit a new process for a lost rank (started like the lost one) into "
        "the running job; off: a lost rank stays lost until the job restarts",
        0, 0, "", false, false, ""},
       &Config::accept_replacements},
  };
  return table;
}

const Knob* find(std::string_view name) {
  for (const auto& k : knobs()) {
    if (name == k.spec.name) return &k;
  }
  return nullptr;
}

Status bad_value(const KnobSpec& spec, std::string_view value, std::string_view allowed) {
  return invalid_argument("knob '" + std::string(spec.name) + "': invalid value '" + std::string(value) +
                          "' (" + std::string(allowed) + ")");
}

std::string format_double(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  // Prefer the shortest text that round-trips.
  for (int precision = 1; precision <= 17; ++precision) {
    char shorter[64];
    std::snprintf(shorter, sizeof shorter, "%.*g", precision, v);
    if (std::strtod(shorter, nullptr) == v) return shorter;
  }
  return buf;
}

bool in_choices(const char* choices, std::string_view value) {
  std::string_view rest(choices);
  while (!rest.empty()) {
    size_t bar = rest.find('|');
    std::string_view item = rest.substr(0, bar);
    if (item == value) return true;
    if (bar == std::string_view::npos) break;
    rest.remove_prefix(bar + 1);
  }
  return false;
}

// metrics_listen: "off", or PORT, IPV4:PORT or [IPV6]:PORT with an address literal (the exposer
// binds without resolving names) and a port in 0..65535. Empty when fine, else what is wrong.
std::string listen_address_error(const std::string& listen) {
  if (listen == "off") return "";
  std::string host, port = listen;
  if (const size_t colon = listen.rfind(':'); colon != std::string::npos) {
    host = listen.substr(0, colon);
    port = listen.substr(colon + 1);
  }
  if (port.empty() || port.size() > 5 || port.find_first_not_of("0123456789") != std::string::npos ||
      std::stoul(port) > 65535) {
    return "port '" + port + "' is not a number in 0..65535";
  }
  if (host.empty() && listen.find(':') == std::string::npos) return "";  // a port alone: every address
  unsigned char addr[16];
  if (host.size() > 2 && host.front() == '[' && host.back() == ']') {
    if (::inet_pton(AF_INET6, host.substr(1, host.size() - 2).c_str(), addr) == 1) return "";
    return "'" + host + "' is not an IPv6 address";
  }
  if (::inet_pton(AF_INET, host.c_str(), addr) == 1) return "";
  return "'" + host + "' is not an IPv4 address or a bracketed IPv6 address (names are not resolved)";
}

}  // namespace

const std::vector<KnobSpec>& knob_table() {
  static const std::vector<KnobSpec> specs = [] {
    std::vector<KnobSpec> out;
    for (const auto& k : knobs()) out.push_back(k.spec);
    return out;
  }();
  return specs;
}

const KnobSpec* find_knob(std::string_view name) {
  const Knob* k = find(name);
  return k ? &k->spec : nullptr;
}

Status set_knob(Config& config, std::string_view name, std::string_view value) {
  const Knob* knob = find(name);
  if (!knob) return not_found("unknown knob '" + std::string(name) + "'");
  const KnobSpec& spec = knob->spec;
  char range[96];
  std::snprintf(range, sizeof range, "a number in [%g, %g]", spec.min, spec.max);
  switch (spec.type) {
    case KnobType::kBool: {
      bool v;
      if (value == "on" || value == "true" || value == "1" || value == "yes") {
        v = true;
      } else if (value == "off" || value == "false" || value == "0" || value == "no") {
        v = false;
      } else {
        return bad_value(spec, value, "on|off");
      }
      config.*std::get<bool Config::*>(knob->member) = v;
      return Status::Ok();
    }
    case KnobType::kUint: {
      uint64_t v = 0;
      auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), v);
      if (ec != std::errc() || end != value.data() + value.size() || value.empty()) {
        return bad_value(spec, value, std::string("an unsigned integer in [") + format_double(spec.min) +
                                          ", " + format_double(spec.max) + "]");
      }
      if (static_cast<double>(v) < spec.min || static_cast<double>(v) > spec.max) {
        return bad_value(spec, value, std::string("an unsigned integer in [") + format_double(spec.min) +
                                          ", " + format_double(spec.max) + "]");
      }
      if (auto* m = std::get_if<uint32_t Config::*>(&knob->member)) {
        config.**m = static_cast<uint32_t>(v);
      } else {
        config.*std::get<uint64_t Config::*>(knob->member) = v;
      }
      return Status::Ok();
    }
    case KnobType::kDouble: {
      std::string text(value);
      char* end = nullptr;
      double v = std::strtod(text.c_str(), &end);
      if (text.empty() || end != text.c_str() + text.size() || !std::isfinite(v) || v < spec.min ||
          v > spec.max) {
        return bad_value(spec, value, range);
      }
      config.*std::get<double Config::*>(knob->member) = v;
      return Status::Ok();
    }
    case KnobType::kString: {
      if (value.find('\0') != std::string_view::npos || value.size() > 4096) {
        return bad_value(spec, "<binary>", "text up to 4096 bytes");
      }
      config.*std::get<std::string Config::*>(knob->member) = std::string(value);
      return Status::Ok();
    }
    case KnobType::kChoice: {
      if (!in_choices(spec.choices, value)) return bad_value(spec, value, spec.choices);
      if (auto* m = std::get_if<kernels::Selector Config::*>(&knob->member)) {
        kernels::Selector s;
        if (!kernels::parse_selector(value, &s)) return bad_value(spec, value, spec.choices);
        config.**m = s;
      } else {
        config.*std::get<std::string Config::*>(knob->member) = std::string(value);
      }
      return Status::Ok();
    }
  }
  return internal_error("knob type not handled");
}

Expected<std::string> get_knob(const Config& config, std::string_view name) {
  const Knob* knob = find(name);
  if (!knob) return not_found("unknown knob '" + std::string(name) + "'");
  return std::visit(
      [&](auto member) -> std::string {
        const auto& v = config.*member;
        using T = std::decay_t<decltype(v)>;
        if constexpr (std::is_same_v<T, bool>) {
          return v ? "on" : "off";
        } else if constexpr (std::is_same_v<T, double>) {
          return format_double(v);
        } else if constexpr (std::is_same_v<T, std::string>) {
          return v;
        } else if constexpr (std::is_same_v<T, kernels::Selector>) {
          return std::string(kernels::selector_name(v));
        } else {
          return std::to_string(v);
        }
      },
      knob->member);
}

std::string knob_default(const KnobSpec& spec) {
  Config defaults;
  auto v = get_knob(defaults, spec.name);
  return v.ok() ? *v : "";
}

std::string agreed_knobs(const Config& config) {
  std::string out;
  for (const auto& spec : knob_table()) {
    if (!spec.agreed) continue;
    if (!out.empty()) out += ' ';
    out += spec.name;
    out += '=';
    out += get_knob(config, spec.name).value();
  }
  return out;
}

Status validate(const Config& config) {
  if (config.rank >= config.world_size) {
    return invalid_argument("rank " + std::to_string(config.rank) + " is not below world_size " +
                            std::to_string(config.world_size));
  }
  if (config.world_size > 1 && config.coordinator.rfind(':') == std::string::npos) {
    return invalid_argument("coordinator '" + config.coordinator + "' is not HOST:PORT");
  }
  if (config.socket.empty()) return invalid_argument("socket path is empty");
  if (config.socket.size() >= 108) {
    return invalid_argument("socket path '" + config.socket + "' is longer than a Unix socket allows (107)");
  }
  if (config.control.rfind("tcp://", 0) == 0 && config.control_token.empty() &&
      config.control_curve_secret_key.empty()) {
    return invalid_argument("control endpoint '" + config.control +
                            "' is tcp://: set control_token or control_curve_secret_key (or use ipc://)");
  }
  if (config.control != "auto" && config.control != "off" && config.control.rfind("tcp://", 0) != 0 &&
      config.control.rfind("ipc:///", 0) != 0) {
    return invalid_argument("control endpoint '" + config.control + "' is not ipc:///PATH, tcp://HOST:PORT, auto or off");
  }
  // The control socket's security settings are checked here, not when it binds, so that
  // --check-config refuses what start would refuse.
  if (!config.control_token.empty() && config.control_token.size() < 16) {
    return invalid_argument("control_token has " + std::to_string(config.control_token.size()) +
                            " characters; at least 16 are required");
  }
  if (!config.control_curve_secret_key.empty() && config.control_curve_secret_key.size() != 40) {
    return invalid_argument("control_curve_secret_key has " + std::to_string(config.control_curve_secret_key.size()) +
                            " characters; a Z85 CURVE key has 40");
  }
  if (config.control.rfind("ipc://", 0) == 0 && config.control.size() - 6 + 5 >= 108) {
    return invalid_argument("control endpoint '" + config.control + "': path longer than a Unix socket allows");
  }
  if (std::string why = listen_address_error(config.metrics_listen); !why.empty()) {
    return invalid_argument("metrics_listen '" + config.metrics_listen + "': " + why);
  }
  if (config.compression && config.selector == kernels::Selector::kNone) {
    return invalid_argument("compression is on but selector is none");
  }
  if (auto rules = policies::parse_tensor_overrides(config.tensor_overrides); !rules.ok()) {
    return rules.status().with_context("knob 'tensor_overrides'");
  }
  if (auto c = policies::parse_controllers(config.controller); !c.ok()) {
    return invalid_argument("controller: " + c.status().message());
  }
  if (auto r = policies::parse_sensitivity(config.layerwise_sensitivity); !r.ok()) {
    return invalid_argument("layerwise_sensitivity: " + r.status().message());
  }
  if (auto t = policies::parse_tensor_scales(config.tensor_density_scale); !t.ok()) {
    return invalid_argument("tensor_density_scale: " + t.status().message());
  }
  if (config.density_min > config.density_max) {
    return invalid_argument("density_min is above density_max");
  }
  if (!config.job_secret_file.empty()) {
    // The same check start makes; the secret itself is read and dropped at once.
    if (auto secret = auth::read_job_secret_file(config.job_secret_file); !secret.ok()) return secret.status();
  }
  LogLevel level;
  if (!parse_log_level(config.log_level, &level)) {
    return invalid_argument("log_level '" + config.log_level + "' is not error|warn|info|debug|trace");
  }
  return Status::Ok();
}

}  // namespace sparsecar
