#include "daemon/config/knobs.h"

#include <arpa/inet.h>

#include <array>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <type_traits>
#include <utility>
#include <variant>

#include "daemon/transport/auth.h"
#include "sparsecar/common/log.h"
#include "sparsecar/kernels/selectors.h"
#include "sparsecar/policies/compression_knobs.h"
#include "sparsecar/policies/controllers.h"
#include "sparsecar/policies/overrides.h"
#include "sparsecar/policies/tensor_plan.h"

namespace sparsecar {
namespace {

// ---- from a Config field to the policies' settings -----------------------------------------------
// A row's KnobField is knob_field<&Config::x, targets...>: the value of Config::x is written into
// every target. A target is a pointer to a field of one of the settings structs (the value is
// converted to the field's type by convert() below; a type with no conversion does not compile),
// a field of a part of one (in<&ControllerSettings::gradnorm, &GradNormSettings::jump>), or,
// where one field is not enough, a function void(const V&, const KnobTargets&).

using policies::ControlKnobs;
using policies::ControllerSettings;
using policies::LayerwiseSettings;
using policies::PlanSettings;
using policies::ScheduleSettings;
using policies::StaticSettings;

// The struct of type D that `to` asks for, or null. Schedule and layer-wise settings are parts
// of PlanSettings.
template <typename D>
D* target(const KnobTargets& to) {
  if constexpr (std::is_same_v<D, StaticSettings>) {
    return to.base;
  } else if constexpr (std::is_same_v<D, PlanSettings>) {
    return to.plan;
  } else if constexpr (std::is_same_v<D, ScheduleSettings>) {
    return to.plan ? &to.plan->schedule : nullptr;
  } else if constexpr (std::is_same_v<D, LayerwiseSettings>) {
    return to.plan ? &to.plan->layerwise : nullptr;
  } else if constexpr (std::is_same_v<D, ControllerSettings>) {
    return to.controllers;
  } else {
    static_assert(std::is_same_v<D, ControlKnobs>, "not a settings struct write_knobs fills");
    return to.control;
  }
}

template <typename T>
T or_default(Expected<T> e) {
  return e.ok() ? std::move(e).value() : T{};
}

// Knob value -> settings field. Same type: copied; numbers: widened; names: parsed (the table
// admits valid names only, so a parse failure keeps the field's default).
template <typename V, typename F>
void convert(const V& value, F& field) {
  static_assert(std::is_same_v<V, F> || (std::is_arithmetic_v<V> && std::is_arithmetic_v<F> &&
                                         !std::is_same_v<V, bool> && !std::is_same_v<F, bool>),
                "no conversion from this knob's type to this settings field");
  field = static_cast<F>(value);
}
void convert(const std::string& text, kernels::Format& field) { kernels::parse_format(text, &field); }  // auto: kept
void convert(const std::string& text, kernels::ValueType& field) { kernels::parse_value_type(text, &field); }
void convert(const std::string& text, policies::ErrorFeedback& field) { policies::parse_error_feedback(text, &field); }
void convert(const std::string& text, policies::LrRescale& field) { policies::parse_lr_rescale(text, &field); }
void convert(const std::string& text, policies::Collective& field) { policies::parse_dense_collective(text, &field); }
void convert(const std::string& text, policies::TensorScales& field) {
  field = or_default(policies::parse_tensor_scales(text));
}
void convert(const std::string& text, std::vector<policies::SensitivityRule>& field) {
  field = or_default(policies::parse_sensitivity(text));
}

// The targets that are more than one field.
void controllers_into(const std::string& text, const KnobTargets& to) {
  const policies::ControllerSet active = or_default(policies::parse_controllers(text));
  if (to.plan) to.plan->active = active;
  if (to.controllers) to.controllers->active = active;
}
void format_into(const std::string& text, const KnobTargets& to) {
  if (!to.base) return;
  to.base->auto_format = text == "auto";
  if (!to.base->auto_format) convert(text, to.base->format);
}
void schedule_shape_into(const std::string& text, const KnobTargets& to) {
  if (to.plan) to.plan->schedule.exponential = text != "linear";
}
void overrides_into(const std::string& text, const KnobTargets& to) {
  if (!to.base) return;
  // validate() rejected unparsable overrides at start-up; a live change is validated the same way.
  if (to.overrides_cache != nullptr) {
    to.base->overrides = to.overrides_cache->rules(text);
  } else {
    to.base->overrides = or_default(policies::parse_tensor_overrides(text));
  }
}

template <typename T>
struct member_of;
template <typename M, typename C>
struct member_of<M C::*> {
  using value = M;
  using owner = C;
};

// A target inside a part of a settings struct: Part is the part's member, Field the field's.
template <auto Part, auto Field>
struct In {
  static constexpr auto part = Part;
  static constexpr auto field = Field;
};
template <auto Part, auto Field>
constexpr In<Part, Field> in{};

template <auto Target, typename V>
void write_one(const V& value, const KnobTargets& to) {
  using Type = std::remove_cv_t<decltype(Target)>;
  if constexpr (std::is_member_object_pointer_v<Type>) {
    if (auto* settings = target<typename member_of<Type>::owner>(to)) convert(value, settings->*Target);
  } else if constexpr (requires { Type::part; Type::field; }) {
    using Owner = typename member_of<std::remove_cv_t<decltype(Type::part)>>::owner;
    if (auto* settings = target<Owner>(to)) convert(value, settings->*Type::part.*Type::field);
  } else {
    static_assert(std::is_same_v<Type, void (*)(const V&, const KnobTargets&)>,
                  "a target is a settings field or a function (const V&, const KnobTargets&)");
    Target(value, to);
  }
}

template <auto Member, auto... Targets>
void write_targets([[maybe_unused]] const Config& config, [[maybe_unused]] const KnobTargets& to) {
  (write_one<Targets>(config.*Member, to), ...);
}

template <auto Member, auto... Targets>
constexpr KnobField knob_field{Member, &write_targets<Member, Targets...>};

// ---- the selector parameters' knobs ---------------------------------------------------------------
// One knob per row of kernels::kSelectorParams, made from the row alone: name, type, range,
// choices, doc, live; every one is agreed (it shapes the plans). Its value is the row's field of
// Config::selector_params, written into the same field of StaticSettings::params.

template <size_t I>
void write_param(const Config& config, const KnobTargets& to) {
  constexpr auto p = static_cast<kernels::SelectorParam>(I);
  if (to.base) kernels::set_param(to.base->params, p, kernels::get_param(config.selector_params, p));
  // The controllers move density and lambda from the operator's values (policies::ControlKnobs).
  if constexpr (p == kernels::SelectorParam::kDensity) {
    if (to.control) to.control->density = config.selector_params.density;
  } else if constexpr (p == kernels::SelectorParam::kThreshold) {
    if (to.control) to.control->threshold = config.selector_params.threshold;
  }
}

using WriteFn = void (*)(const Config&, const KnobTargets&);
template <size_t... I>
constexpr std::array<WriteFn, sizeof...(I)> param_writers(std::index_sequence<I...>) {
  return {&write_param<I>...};
}
constexpr std::array<WriteFn, kernels::kSelectorParamCount> kParamWriters =
    param_writers(std::make_index_sequence<kernels::kSelectorParamCount>());

KnobType knob_type(kernels::ParamType t) {
  switch (t) {
    case kernels::ParamType::kNumber: return KnobType::kDouble;
    case kernels::ParamType::kUint: return KnobType::kUint;
    case kernels::ParamType::kChoice: return KnobType::kChoice;
  }
  return KnobType::kString;  // not reached: every ParamType is above
}

KnobSpec param_knob(const kernels::ParamInfo& p) {
  return {.name = p.name, .type = knob_type(p.type), .live = p.live, .agreed = true, .secret = false,
          .env = "", .min = p.min, .max = p.max, .choices = p.choices,
          .doc = p.doc,
          .field = {p.param, kParamWriters[static_cast<size_t>(p.param)]}};
}

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

const std::vector<KnobSpec>& knobs() {
  using K = KnobType;
  using S = StaticSettings;
  using PS = PlanSettings;
  using Schedule = ScheduleSettings;
  using Layerwise = LayerwiseSettings;
  using CS = ControllerSettings;
  using GradNorm = policies::GradNormSettings;
  using Frequency = policies::FrequencySettings;
  using Bandwidth = policies::BandwidthSettings;
  using Accuracy = policies::AccuracySettings;
  using Budget = policies::BudgetSettings;
  using StepS = policies::StepSettings;
  using CK = ControlKnobs;
  namespace R = policies;  // ranges and choices shared with the per-tensor overrides (compression_knobs.h)
  // Names and docs of the selectors: the selector registry.
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
  // The controller registry's names (policies/controllers.h).
  static const std::string controller_doc =
      "active controllers, a comma list of " + policies::controller_choices() + " (static = fixed knobs, the fallback)";
  static const std::string overrides_doc =
      "per-tensor settings, 'GLOB: key=value, ...; GLOB: ...' (keys " + policies::tensor_override_keys() +
      "; values as those knobs; later rules win); a config file's [tensor.\"GLOB\"] tables add to it";
  static const std::vector<KnobSpec> before_params = {
      {.name = "rank", .type = K::kUint, .live = false, .agreed = false, .secret = false,
       .env = "SPARSECAR_NODE_RANK|NODE_RANK", .min = 0, .max = 65535, .choices = "",
       .doc = "rank of this node (daemon) in the job (0 = leader/coordinator); never read from the launcher's "
              "per-process RANK",
       .field = knob_field<&Config::rank>},
      {.name = "world_size", .type = K::kUint, .live = false, .agreed = true, .secret = false,
       .env = "SPARSECAR_NNODES|NNODES", .min = 1, .max = 65536, .choices = "",
       .doc = "number of nodes (daemons) in the job; never read from the launcher's per-process WORLD_SIZE",
       .field = knob_field<&Config::world_size, &CS::world_size>},
      {.name = "coordinator", .type = K::kString, .live = false, .agreed = false, .secret = false,
       .env = "SPARSECAR_COORDINATOR", .min = 0, .max = 0, .choices = "",
       .doc = "HOST:PORT of rank 0's rendezvous listener (fallback: MASTER_ADDR and MASTER_PORT+1)",
       .field = knob_field<&Config::coordinator>},
      {.name = "job_id", .type = K::kUint, .live = false, .agreed = true, .secret = false,
       .env = "SPARSECAR_JOB_ID", .min = 0, .max = 1.8e19, .choices = "",
       .doc = "job identifier; daemons of different jobs refuse each other",
       .field = knob_field<&Config::job_id>},
      {.name = "job_secret_file", .type = K::kString, .live = false, .agreed = false, .secret = false,
       .env = "SPARSECAR_JOB_SECRET_FILE", .min = 0, .max = 0, .choices = "",
       .doc = "file holding the job's shared secret (16 bytes to 4 KiB; owned by the daemon's uid, mode 0600): peers "
              "prove they hold it at rendezvous and MAC every message with it; empty = an open job that any host "
              "reaching the coordinator port can join",
       .field = knob_field<&Config::job_secret_file>},
      {.name = "local_clients", .type = K::kUint, .live = false, .agreed = false, .secret = false,
       .env = "SPARSECAR_LOCAL_WORLD_SIZE", .min = 1, .max = 1024, .choices = "",
       .doc = "trainer processes per node whose gradients are summed each step (torchrun's --nproc-per-node)",
       .field = knob_field<&Config::local_clients>},
      {.name = "socket", .type = K::kString, .live = false, .agreed = false, .secret = false,
       .env = "SPARSECAR_SOCKET", .min = 0, .max = 0, .choices = "",
       .doc = "Unix socket path trainers connect to",
       .field = knob_field<&Config::socket>},
      {.name = "control", .type = K::kString, .live = false, .agreed = false, .secret = false,
       .env = "SPARSECAR_CONTROL", .min = 0, .max = 0, .choices = "",
       .doc = "ZeroMQ control endpoint: ipc://PATH, tcp://HOST:PORT (needs a token or CURVE key), 'auto' "
              "(ipc:// beside the trainer socket: <socket minus .sock>-control.sock) or 'off'",
       .field = knob_field<&Config::control>},
      {.name = "control_group", .type = K::kString, .live = false, .agreed = false, .secret = false,
       .env = "", .min = 0, .max = 0, .choices = "",
       .doc = "group allowed to use the ipc:// control socket (mode 0660); empty = 0600",
       .field = knob_field<&Config::control_group>},
      {.name = "control_token", .type = K::kString, .live = false, .agreed = false, .secret = true,
       .env = "SPARSECAR_CONTROL_TOKEN", .min = 0, .max = 0, .choices = "",
       .doc = "shared token every tcp:// control request must carry (16+ characters)",
       .field = knob_field<&Config::control_token>},
      {.name = "control_curve_secret_key", .type = K::kString, .live = false, .agreed = false, .secret = true,
       .env = "", .min = 0, .max = 0, .choices = "",
       .doc = "Z85 CURVE server secret key for a tcp:// control endpoint",
       .field = knob_field<&Config::control_curve_secret_key>},
      {.name = "control_max_message_bytes", .type = K::kUint, .live = false, .agreed = false, .secret = false,
       .env = "", .min = 1024, .max = 16777216, .choices = "",
       .doc = "largest control request served (bigger: TOO_LARGE)",
       .field = knob_field<&Config::control_max_message_bytes>},
      {.name = "drain_timeout_ms", .type = K::kUint, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 0, .max = 3.6e6, .choices = "",
       .doc = "on SIGTERM, how long queued steps may finish before shutdown",
       .field = knob_field<&Config::drain_timeout_ms>},
      {.name = "metrics_listen", .type = K::kString, .live = false, .agreed = false, .secret = false,
       .env = "", .min = 0, .max = 0, .choices = "",
       .doc = "ADDRESS:PORT for Prometheus /metrics, 'auto' = 127.0.0.1:(9464 + rank) so that the daemons of a "
              "single-host job do not collide, or 'off'",
       .field = knob_field<&Config::metrics_listen>},
      {.name = "log_level", .type = K::kChoice, .live = true, .agreed = false, .secret = false,
       .env = "SPARSECAR_LOG_LEVEL", .min = 0, .max = 0, .choices = "error|warn|info|debug|trace",
       .doc = "log verbosity",
       .field = knob_field<&Config::log_level>},
      {.name = "progress_log_seconds", .type = K::kDouble, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 0, .max = 86400, .choices = "",
       .doc = "while a job runs, an INFO line this often: step, density, compression ratio, bytes saved, step "
              "latency (0 = off; the summary line at job end comes regardless)",
       .field = knob_field<&Config::progress_log_seconds>},
      {.name = "ucx_tls", .type = K::kString, .live = false, .agreed = false, .secret = false,
       .env = "", .min = 0, .max = 0, .choices = "",
       .doc = "UCX transports (UCX_TLS syntax, e.g. tcp or posix,self); empty = UCX default",
       .field = knob_field<&Config::ucx_tls>},
      {.name = "ucx_net_devices", .type = K::kString, .live = false, .agreed = false, .secret = false,
       .env = "", .min = 0, .max = 0, .choices = "",
       .doc = "UCX network devices (e.g. lo); empty = all",
       .field = knob_field<&Config::ucx_net_devices>},
      {.name = "kernel_threads", .type = K::kUint, .live = false, .agreed = false, .secret = false,
       .env = "SPARSECAR_KERNEL_THREADS", .min = 1, .max = 64, .choices = "",
       .doc = "threads one kernel call may use: selection (top-k, threshold, EF + threshold) and decoding "
              "(dense, COO, bitmap) of large tensors and messages (256 Ki elements, 16 Ki COO entries or "
              "1 Mi bitmap elements per thread); results are identical for every count",
       .field = knob_field<&Config::kernel_threads>},
      {.name = "mailbox_max_bytes", .type = K::kUint, .live = false, .agreed = false, .secret = false,
       .env = "", .min = 65536, .max = 1.1e12, .choices = "",
       .doc = "payload bytes one peer may have waiting in this daemon's mailbox (about two steps of its "
              "messages are needed); a message beyond it is rejected and fails its step",
       .field = knob_field<&Config::mailbox_max_bytes>},
      {.name = "tensor_memory_budget_bytes", .type = K::kUint, .live = false, .agreed = false, .secret = false,
       .env = "", .min = 0, .max = 1.8e19, .choices = "",
       .doc = "memory this node may spend on registered tensors: every trainer's shm slot plus the session's and "
              "the pipeline's buffers per tensor; a registration beyond it is refused (RESOURCE_EXHAUSTED); "
              "0 = half the physical memory (or of the cgroup's memory.max)",
       .field = knob_field<&Config::tensor_memory_budget_bytes>},
      {.name = "session_handshake_timeout_ms", .type = K::kUint, .live = false, .agreed = false, .secret = false,
       .env = "", .min = 100, .max = 60000, .choices = "",
       .doc = "a connection to the trainer socket must complete its handshake within this (silent ones are "
              "closed; at most 8 of one uid wait at once, a newer one closes the oldest)",
       .field = knob_field<&Config::session_handshake_timeout_ms>},
      {.name = "compression", .type = K::kBool, .live = true, .agreed = true, .secret = false,
       .env = "", .min = 0, .max = 0, .choices = "",
       .doc = "compress gradients (off = exact dense average)",
       .field = knob_field<&Config::compression, &S::compression, &CK::compression>},
      {.name = "selector", .type = K::kChoice, .live = true, .agreed = true, .secret = false,
       .env = "", .min = 0, .max = 0, .choices = selector_choices.c_str(),
       .doc = selector_doc.c_str(),
       .field = knob_field<&Config::selector, &S::selector, &CK::selector>},
      // Here: one knob per selector parameter (param_knob), in the registry's order.
  };
  static const std::vector<KnobSpec> after_params = {
      {.name = "error_feedback", .type = K::kChoice, .live = true, .agreed = true, .secret = false,
       .env = "", .min = 0, .max = 0, .choices = R::kErrorFeedbackChoices,
       .doc = error_feedback_doc.c_str(),
       .field = knob_field<&Config::error_feedback, &S::error_feedback>},
      {.name = "momentum", .type = K::kDouble, .live = true, .agreed = true, .secret = false,
       .env = "", .min = R::kMomentumRange.min, .max = R::kMomentumRange.max, .choices = "",
       .doc = "error_feedback=momentum: velocity factor m (u = m u + g; v += u)",
       .field = knob_field<&Config::momentum, &S::momentum>},
      {.name = "clip_norm", .type = K::kDouble, .live = true, .agreed = true, .secret = false,
       .env = "", .min = R::kClipNormRange.min, .max = R::kClipNormRange.max, .choices = "",
       .doc = "local gradient clipping: scale each node's gradient to at most this L2 norm (0 = off)",
       .field = knob_field<&Config::clip_norm, &S::clip_norm>},
      {.name = "lr_rescale", .type = K::kChoice, .live = true, .agreed = true, .secret = false,
       .env = "", .min = 0, .max = 0, .choices = "off|new_over_old|old_over_new",
       .doc = "when the trainer's lr changes: residual *= lr_new/lr_old (new_over_old), lr_old/lr_new (old_over_new) "
              "or off",
       .field = knob_field<&Config::lr_rescale, &S::lr_rescale>},
      {.name = "dense_collective", .type = K::kChoice, .live = true, .agreed = true, .secret = false,
       .env = "", .min = 0, .max = 0, .choices = policies::kDenseCollectiveChoices,
       .doc = "who reduces dense steps (compression off, a controller's dense step): ring = the daemons' ring "
              "all-reduce; trainer = the trainers' own all-reduce (NCCL, gloo), where every trainer of the job "
              "says it does (the DDP hook), else the ring",
       .field = knob_field<&Config::dense_collective, &S::dense_collective, &CS::dense_collective>},
      {.name = "trainer_lease", .type = K::kUint, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 0, .max = 1000, .choices = "",
       .doc = "dense_collective=trainer: with a trainer-reduced dense step the daemon tells the trainer how many "
              "of the next steps are trainer-reduced dense steps as well under the decision in force (at most "
              "this many, and 2^(n-1) for the n-th such step in a row); the DDP hook all-reduces those itself "
              "without a round trip through the daemon, and a decision made meanwhile takes effect after them "
              "(0 = every step through the daemon; nodes need not agree: the trainers take the least lease)",
       .field = knob_field<&Config::trainer_lease>},
      {.name = "tensor_overrides", .type = K::kString, .live = true, .agreed = true, .secret = false,
       .env = "", .min = 0, .max = 0, .choices = "",
       .doc = overrides_doc.c_str(),
       .field = knob_field<&Config::tensor_overrides, overrides_into>},
      {.name = "format", .type = K::kChoice, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 0, .max = 0, .choices = R::kFormatChoices,
       .doc = "payload layout of the selection; auto = the smallest exact size per message (WIRE.md)",
       .field = knob_field<&Config::format, format_into, &CK::format>},
      {.name = "value_type", .type = K::kChoice, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 0, .max = 0, .choices = R::kValueTypeChoices,
       .doc = "value encoding: fp32 exact; fp16/bf16 rounded; int8 with a per-message scale (error kept in the "
              "residual)",
       .field = knob_field<&Config::value_type, &S::value_type>},
      // Controllers (docs/controllers.md). Knobs that shape per-tensor plans are agreed.
      {.name = "controller", .type = K::kString, .live = true, .agreed = true, .secret = false,
       .env = "", .min = 0, .max = 0, .choices = "",
       .doc = controller_doc.c_str(),
       .field = knob_field<&Config::controller, controllers_into>},
      {.name = "density_min", .type = K::kDouble, .live = true, .agreed = true, .secret = false,
       .env = "", .min = 1e-6, .max = 1.0, .choices = "",
       .doc = "controllers never go below this density (quality floor)",
       .field = knob_field<&Config::density_min, &PS::density_min, &CS::density_min>},
      {.name = "density_max", .type = K::kDouble, .live = true, .agreed = true, .secret = false,
       .env = "", .min = 1e-6, .max = 1.0, .choices = "",
       .doc = "controllers never go above this density",
       .field = knob_field<&Config::density_max, &PS::density_max, &CS::density_max>},
      {.name = "density_cap", .type = K::kDouble, .live = true, .agreed = true, .secret = false,
       .env = "", .min = 1e-6, .max = 1.0, .choices = "",
       .doc = "upper bound on every tensor's density (set by the bandwidth controller)",
       .field = knob_field<&Config::density_cap, &PS::density_cap, &CK::density_cap>},
      {.name = "tensor_density_scale", .type = K::kString, .live = true, .agreed = true, .secret = false,
       .env = "", .min = 0, .max = 0, .choices = "",
       .doc = "per-tensor density multipliers 'id:scale,...' (set by the frequency controller)",
       .field = knob_field<&Config::tensor_density_scale, &PS::tensor_scale, &CK::tensor_scale>},
      {.name = "schedule_warmup_steps", .type = K::kUint, .live = true, .agreed = true, .secret = false,
       .env = "", .min = 0, .max = 1e15, .choices = "",
       .doc = "schedule: the first N steps are dense",
       .field = knob_field<&Config::schedule_warmup_steps, &Schedule::warmup_steps, &CS::schedule_warmup_steps,
                           &CK::schedule_warmup_steps>},
      {.name = "schedule_ramp_steps", .type = K::kUint, .live = true, .agreed = true, .secret = false,
       .env = "", .min = 0, .max = 1e15, .choices = "",
       .doc = "schedule: after warm-up the density moves from schedule_start_density to the end over N steps (0 = off)",
       .field = knob_field<&Config::schedule_ramp_steps, &Schedule::ramp_steps>},
      {.name = "schedule_start_density", .type = K::kDouble, .live = true, .agreed = true, .secret = false,
       .env = "", .min = 1e-6, .max = 1.0, .choices = "",
       .doc = "schedule: density at the start of the ramp (0.25 = 75 % sparsity)",
       .field = knob_field<&Config::schedule_start_density, &Schedule::start_density>},
      {.name = "schedule_end_density", .type = K::kDouble, .live = true, .agreed = true, .secret = false,
       .env = "", .min = 0, .max = 1.0, .choices = "",
       .doc = "schedule: density at the end of the ramp; 0 = `density` (ramp 0.25 -> 0.001 = DGC, 0.01 -> 0.1 = decay)",
       .field = knob_field<&Config::schedule_end_density, &Schedule::end_density>},
      {.name = "schedule_shape", .type = K::kChoice, .live = true, .agreed = true, .secret = false,
       .env = "", .min = 0, .max = 0, .choices = "exp|linear",
       .doc = "schedule: exp (geometric, DGC) or linear",
       .field = knob_field<&Config::schedule_shape, schedule_shape_into>},
      {.name = "schedule_dense_every", .type = K::kUint, .live = true, .agreed = true, .secret = false,
       .env = "", .min = 0, .max = 1e15, .choices = "",
       .doc = "schedule: every N-th step is dense (0 = never)",
       .field = knob_field<&Config::schedule_dense_every, &Schedule::dense_every>},
      {.name = "schedule_dense_from", .type = K::kUint, .live = true, .agreed = true, .secret = false,
       .env = "", .min = 0, .max = 1e15, .choices = "",
       .doc = "schedule: the steps from N on are dense (0 = never; a sparse -> dense switch at a known step)",
       .field = knob_field<&Config::schedule_dense_from, &Schedule::dense_from>},
      {.name = "layerwise_dense_below", .type = K::kUint, .live = true, .agreed = true, .secret = false,
       .env = "", .min = 0, .max = 1e15, .choices = "",
       .doc = "layerwise: tensors with fewer elements are sent dense",
       .field = knob_field<&Config::layerwise_dense_below, &Layerwise::dense_below>},
      {.name = "layerwise_small_scale", .type = K::kDouble, .live = true, .agreed = true, .secret = false,
       .env = "", .min = 1e-6, .max = 1e6, .choices = "",
       .doc = "layerwise: density multiplier for bias/norm tensors",
       .field = knob_field<&Config::layerwise_small_scale, &Layerwise::small_scale>},
      {.name = "layerwise_embedding_scale", .type = K::kDouble, .live = true, .agreed = true, .secret = false,
       .env = "", .min = 1e-6, .max = 1e6, .choices = "",
       .doc = "layerwise: density multiplier for embedding tensors",
       .field = knob_field<&Config::layerwise_embedding_scale, &Layerwise::embedding_scale>},
      {.name = "layerwise_sensitivity", .type = K::kString, .live = true, .agreed = true, .secret = false,
       .env = "", .min = 0, .max = 0, .choices = "",
       .doc = "layerwise: sensitivity table 'name-substring:dense|scale,...' (first match wins)",
       .field = knob_field<&Config::layerwise_sensitivity, &Layerwise::rules>},
      {.name = "dense_above", .type = K::kDouble, .live = true, .agreed = true, .secret = false,
       .env = "", .min = 1e-3, .max = 1.0, .choices = "",
       .doc = "plan controllers: a tensor whose density after the schedule, layer-wise and frequency scales and "
              "the bounds is at or above this is sent dense (the dense ring is cheaper there, and exact)",
       .field = knob_field<&Config::dense_above, &PS::dense_above>},
      {.name = "controller_interval_steps", .type = K::kUint, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 1, .max = 1e9, .choices = "",
       .doc = "rank 0 proposes at most one controller decision per N steps",
       .field = knob_field<&Config::controller_interval_steps, &CS::controller_interval_steps>},
      {.name = "controller_hysteresis", .type = K::kDouble, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 0, .max = 10, .choices = "",
       .doc = "relative density change a controller needs before it proposes",
       .field = knob_field<&Config::controller_hysteresis, &CS::controller_hysteresis>},
      {.name = "controller_metric", .type = K::kString, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 0, .max = 0, .choices = "",
       .doc = "trainer metric the accuracy controller tracks (lower is better; '<name>_target' = explicit target)",
       .field = knob_field<&Config::controller_metric>},
      {.name = "gradnorm_jump", .type = K::kDouble, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 1.0, .max = 1e6, .choices = "",
       .doc = "gradnorm: norm / running mean above this is a jump",
       .field = knob_field<&Config::gradnorm_jump, in<&CS::gradnorm, &GradNorm::jump>>},
      {.name = "gradnorm_boost", .type = K::kDouble, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 1.0, .max = 1e6, .choices = "",
       .doc = "gradnorm: density multiplier after a jump",
       .field = knob_field<&Config::gradnorm_boost, in<&CS::gradnorm, &GradNorm::boost>>},
      {.name = "gradnorm_boost_steps", .type = K::kUint, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 0, .max = 1e9, .choices = "",
       .doc = "gradnorm: steps the boost lasts",
       .field = knob_field<&Config::gradnorm_boost_steps, in<&CS::gradnorm, &GradNorm::boost_steps>>},
      {.name = "gradnorm_window", .type = K::kUint, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 2, .max = 1e6, .choices = "",
       .doc = "gradnorm: steps over which steadiness is judged",
       .field = knob_field<&Config::gradnorm_window, in<&CS::gradnorm, &GradNorm::window>>},
      {.name = "gradnorm_steady_cv", .type = K::kDouble, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 0, .max = 10, .choices = "",
       .doc = "gradnorm: coefficient of variation below which the norm is steady",
       .field = knob_field<&Config::gradnorm_steady_cv, in<&CS::gradnorm, &GradNorm::steady_cv>>},
      {.name = "gradnorm_steady_scale", .type = K::kDouble, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 1e-6, .max = 1.0, .choices = "",
       .doc = "gradnorm: density multiplier while steady",
       .field = knob_field<&Config::gradnorm_steady_scale, in<&CS::gradnorm, &GradNorm::steady_scale>>},
      {.name = "frequency_max_scale", .type = K::kDouble, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 1.0, .max = 1e3, .choices = "",
       .doc = "frequency: largest per-tensor density multiplier (and 1/x smallest)",
       .field = knob_field<&Config::frequency_max_scale, in<&CS::frequency, &Frequency::max_scale>>},
      {.name = "frequency_alpha", .type = K::kDouble, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 1e-3, .max = 1.0, .choices = "",
       .doc = "frequency: EMA weight of a tensor's new repeat fraction (share of its selection also selected the "
              "step before)",
       .field = knob_field<&Config::frequency_alpha, in<&CS::frequency, &Frequency::alpha>>},
      {.name = "exchange_budget_ms", .type = K::kDouble, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 0, .max = 3.6e6, .choices = "",
       .doc = "bandwidth: exchange time budget per step in ms (0 = exchange_budget_fraction x reported compute time)",
       .field = knob_field<&Config::exchange_budget_ms, in<&CS::bandwidth, &Bandwidth::exchange_budget_ms>>},
      {.name = "exchange_budget_fraction", .type = K::kDouble, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 1e-3, .max = 1e3, .choices = "",
       .doc = "bandwidth: budget as a fraction of the trainer's compute time",
       .field = knob_field<&Config::exchange_budget_fraction,
                           in<&CS::bandwidth, &Bandwidth::exchange_budget_fraction>>},
      {.name = "goodput_smoothing", .type = K::kDouble, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 1e-3, .max = 1.0, .choices = "",
       .doc = "bandwidth: EMA weight (log domain) of a new goodput sample",
       .field = knob_field<&Config::goodput_smoothing, &CS::goodput_smoothing>},
      {.name = "bandwidth_margin", .type = K::kDouble, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 0, .max = 0.9, .choices = "",
       .doc = "bandwidth: aim at (1 - margin) of the budget",
       .field = knob_field<&Config::bandwidth_margin, in<&CS::bandwidth, &Bandwidth::margin>>},
      {.name = "bandwidth_allow_dense", .type = K::kBool, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 0, .max = 0, .choices = "",
       .doc = "bandwidth: switch to the dense ring when it fits the budget",
       .field = knob_field<&Config::bandwidth_allow_dense, in<&CS::bandwidth, &Bandwidth::allow_dense>>},
      {.name = "goodput_confirm_steps", .type = K::kUint, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 1, .max = 100, .choices = "",
       .doc = "bandwidth: consecutive goodput samples more than 2x off the estimate before it follows them",
       .field = knob_field<&Config::goodput_confirm_steps, &CS::goodput_confirm_steps>},
      {.name = "bandwidth_confirm_steps", .type = K::kUint, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 1, .max = 100, .choices = "",
       .doc = "bandwidth: consecutive observations over budget (or with room) before the controller moves",
       .field = knob_field<&Config::bandwidth_confirm_steps, in<&CS::bandwidth, &Bandwidth::confirm_steps>>},
      {.name = "bandwidth_hold_steps", .type = K::kUint, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 0, .max = 10000, .choices = "",
       .doc = "bandwidth: at least this many steps between its decisions",
       .field = knob_field<&Config::bandwidth_hold_steps, in<&CS::bandwidth, &Bandwidth::hold_steps>>},
      {.name = "bandwidth_raise_max", .type = K::kDouble, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 1.01, .max = 1000, .choices = "",
       .doc = "bandwidth: one decision raises the density cap at most this factor",
       .field = knob_field<&Config::bandwidth_raise_max, in<&CS::bandwidth, &Bandwidth::raise_max>>},
      {.name = "bandwidth_lower_max", .type = K::kDouble, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 1.01, .max = 1e6, .choices = "",
       .doc = "bandwidth: one decision lowers the density cap at most this factor",
       .field = knob_field<&Config::bandwidth_lower_max, in<&CS::bandwidth, &Bandwidth::lower_max>>},
      {.name = "accuracy_tolerance", .type = K::kDouble, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 0, .max = 10, .choices = "",
       .doc = "accuracy: relative metric gap to the target that triggers a back-off",
       .field = knob_field<&Config::accuracy_tolerance, in<&CS::accuracy, &Accuracy::tolerance>>},
      {.name = "accuracy_backoff", .type = K::kDouble, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 1.0, .max = 1e3, .choices = "",
       .doc = "accuracy: density multiplier when behind",
       .field = knob_field<&Config::accuracy_backoff, in<&CS::accuracy, &Accuracy::backoff>>},
      {.name = "accuracy_tighten", .type = K::kDouble, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 1e-3, .max = 1.0, .choices = "",
       .doc = "accuracy: density multiplier when on track",
       .field = knob_field<&Config::accuracy_tighten, in<&CS::accuracy, &Accuracy::tighten>>},
      {.name = "accuracy_hold_steps", .type = K::kUint, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 1, .max = 1e9, .choices = "",
       .doc = "accuracy: steps between two moves",
       .field = knob_field<&Config::accuracy_hold_steps, in<&CS::accuracy, &Accuracy::hold_steps>>},
      {.name = "accuracy_alpha", .type = K::kDouble, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 1e-3, .max = 1.0, .choices = "",
       .doc = "accuracy: EMA weight of a new relative gap to the target, compression error or metric",
       .field = knob_field<&Config::accuracy_alpha, in<&CS::accuracy, &Accuracy::alpha>>},
      {.name = "accuracy_error_bound", .type = K::kDouble, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 0, .max = 1e9, .choices = "",
       .doc = "accuracy: compression error ||e||/||g|| kept below this (0: calibrated at the start)",
       .field = knob_field<&Config::accuracy_error_bound, in<&CS::accuracy, &Accuracy::error_bound>>},
      {.name = "accuracy_error_margin", .type = K::kDouble, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 1.0, .max = 1e3, .choices = "",
       .doc = "accuracy: calibrated error bound = this x the mean error of the first calibrate steps",
       .field = knob_field<&Config::accuracy_error_margin, in<&CS::accuracy, &Accuracy::error_margin>>},
      {.name = "accuracy_calibrate_steps", .type = K::kUint, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 1, .max = 1e9, .choices = "",
       .doc = "accuracy: steps at the operator's density that calibrate the error bound",
       .field = knob_field<&Config::accuracy_calibrate_steps, in<&CS::accuracy, &Accuracy::calibrate_steps>>},
      {.name = "budget_total_elements", .type = K::kDouble, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 0, .max = 1e18, .choices = "",
       .doc = "budget: elements each node may send over the whole run (hard threshold; 0 = off)",
       .field = knob_field<&Config::budget_total_elements, in<&CS::budget, &Budget::total_elements>>},
      {.name = "budget_steps", .type = K::kUint, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 0, .max = 1e15, .choices = "",
       .doc = "budget: length of the run in steps",
       .field = knob_field<&Config::budget_steps, in<&CS::budget, &Budget::steps>>},
      {.name = "budget_total_bytes", .type = K::kDouble, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 0, .max = 1e18, .choices = "",
       .doc = "budget: bytes each node may send over the whole run, headers included (instead of "
              "budget_total_elements; 0 = off)",
       .field = knob_field<&Config::budget_total_bytes, in<&CS::budget, &Budget::total_bytes>>},
      {.name = "budget_density", .type = K::kDouble, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 0, .max = 1.0, .choices = "",
       .doc = "budget: a fixed density, on average over the steps, instead of a run budget (hard threshold, "
              "lambda calibrated online from the gradient's magnitudes after a start-up under topk at this "
              "density; start the daemon with selector topk at it too; 0 = off)",
       .field = knob_field<&Config::budget_density, in<&CS::budget, &Budget::density>>},
      {.name = "budget_max_move", .type = K::kDouble, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 1.01, .max = 100.0, .choices = "",
       .doc = "budget: a lambda move is at most this factor (after the first, calibrated lambda)",
       .field = knob_field<&Config::budget_max_move, in<&CS::budget, &Budget::max_move>>},
      {.name = "budget_settle_steps", .type = K::kUint, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 2, .max = 1e6, .choices = "",
       .doc = "budget: without magnitude histograms (older peers), steps between two lambda moves, so that the "
              "last move shows in the measured volume (at least the decision latency, 2)",
       .field = knob_field<&Config::budget_settle_steps, in<&CS::budget, &Budget::settle_steps>>},
      {.name = "step_slack", .type = K::kDouble, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 0.0, .max = 10.0, .choices = "",
       .doc = "step: the dense ring where its price is the least; else, among the sparse plans whose price is within "
              "this fraction of the least, the one nearest the density asked for",
       .field = knob_field<&Config::step_slack, in<&CS::step, &StepS::slack>>},
      {.name = "step_confirm_steps", .type = K::kUint, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 1, .max = 1e6, .choices = "",
       .doc = "step: consecutive observations that must want the same change before it is made",
       .field = knob_field<&Config::step_confirm_steps, in<&CS::step, &StepS::confirm_steps>>},
      {.name = "step_hold_steps", .type = K::kUint, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 0, .max = 1e6, .choices = "",
       .doc = "step: at least this many steps between two of its decisions",
       .field = knob_field<&Config::step_hold_steps, in<&CS::step, &StepS::hold_steps>>},
      {.name = "step_forget", .type = K::kDouble, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 0.01, .max = 1.0, .choices = "",
       .doc = "step: weight the link fits keep of a step's samples at the next step (1 = never forget)",
       .field = knob_field<&Config::step_forget, in<&CS::step, &StepS::forget>>},
      {.name = "step_allow_dense", .type = K::kBool, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 0, .max = 0, .choices = "",
       .doc = "step: the dense ring is a candidate plan",
       .field = knob_field<&Config::step_allow_dense, in<&CS::step, &StepS::allow_dense>>},
      {.name = "step_dense_worth", .type = K::kDouble, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 1.0, .max = 100.0, .choices = "",
       .doc = "step: a dense step does the work of this many sparse ones (error feedback delays what a sparse step "
              "leaves out): sparse plans are priced at their step time x this; 1 prices step time alone. A property "
              "of the model (measured 1.05-1.9 over whole jobs, docs/controllers.md); without the hook's momentum "
              "correction (else step_dense_worth_corrected)",
       .field = knob_field<&Config::step_dense_worth, in<&CS::step, &StepS::dense_worth>>},
      {.name = "step_dense_worth_corrected", .type = K::kDouble, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 1.0, .max = 100.0, .choices = "",
       .doc = "step: step_dense_worth for a job whose DDP hook corrects momentum (momentum_correction=True; it reports "
              "the metric momentum_correction before the first step): a dense step's lead then survives a switch to "
              "sparse (100 ring steps then top-k: each did the work of 1.6-1.9 top-k steps, docs/controllers.md)",
       .field = knob_field<&Config::step_dense_worth_corrected, in<&CS::step, &StepS::dense_worth_corrected>>},
      {.name = "step_warmup_cut", .type = K::kDouble, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 1.0, .max = 1000.0, .choices = "",
       .doc = "step: under the schedule's dense warm-up, end it early once a dense step measures more than this many "
              "sparse steps of the density asked for (modelled), or before it starts where the trainer's own dense "
              "first steps (metrics dense_step_s, dense_wait_s: the DDP hook reports them) do: the early dense "
              "steps are worth more than later ones, but not a ring at a slow link's rate",
       .field = knob_field<&Config::step_warmup_cut, in<&CS::step, &StepS::warmup_cut>>},
      {.name = "step_probe_share", .type = K::kDouble, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 0.0, .max = 0.5, .choices = "",
       .doc = "step: while a sparse plan runs and the ring is a candidate, each node sends its ring successor a "
              "message of the bytes the ring sends it in a step now and then, timed by the receiver, so that a faster link the sparse "
              "messages do not show (a shaper's burst covers them) prices the ring anew; the probes take at most "
              "this share of the time (their own and the steps they delay; 0: none), and after each of a sparse plan's "
              "probes a half, a quarter, then an eighth of it, until a probe shows a faster link; and, where a ring "
              "step cost more than the sparse plan's price when it last ran, that much less again (at most 8x); but where only "
              "the trainers' dense iterations priced the ring, at most 2.5x that price, the job's first two go early (8 and "
              "10 steps apart) to test it",
       .field = knob_field<&Config::step_probe_share>},
      {.name = "step_timed_send_every", .type = K::kUint, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 0, .max = 1024, .choices = "",
       .doc = "step: one small data send in this many to each peer goes rendezvous, so that its receiver can time "
              "it and the link fits see messages of any size (it costs that message a round trip); 0: only the "
              "sends the transport makes rendezvous anyway (the ring's chunks, the link probes) are timed",
       .field = knob_field<&Config::step_timed_send_every>},
      {.name = "step_timeout_ms", .type = K::kUint, .live = true, .agreed = false, .secret = false,
       .env = "", .min = 10, .max = 3.6e6, .choices = "",
       .doc = "deadline for peers to deliver a step",
       .field = knob_field<&Config::step_timeout_ms>},
      {.name = "join_timeout_ms", .type = K::kUint, .live = false, .agreed = false, .secret = false,
       .env = "", .min = 100, .max = 3.6e6, .choices = "",
       .doc = "deadline for the rendezvous and the first-step agreement check",
       .field = knob_field<&Config::join_timeout_ms>},
      {.name = "peer_down_grace_ms", .type = K::kUint, .live = false, .agreed = false, .secret = false,
       .env = "", .min = 0, .max = 3.6e6, .choices = "",
       .doc = "after a peer is lost (killed, unreachable) the daemon keeps failing steps loudly for this long, then "
              "exits with status 3 so the service manager restarts the job (0: never exit)",
       .field = knob_field<&Config::peer_down_grace_ms>},
      {.name = "accept_replacements", .type = K::kBool, .live = false, .agreed = false, .secret = false,
       .env = "", .min = 0, .max = 0, .choices = "",
       .doc = "rank 0: after the job has formed, admit a new process for a lost rank (started like the lost one) into "
              "the running job; off: a lost rank stays lost until the job restarts",
       .field = knob_field<&Config::accept_replacements>},
  };
  static const std::vector<KnobSpec> table = [] {
    std::vector<KnobSpec> rows = before_params;
    for (const kernels::ParamInfo& p : kernels::kSelectorParams) rows.push_back(param_knob(p));
    rows.insert(rows.end(), after_params.begin(), after_params.end());
    return rows;
  }();
  return table;
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

// A Config member's value as text, in the form set_knob() accepts.
template <typename T>
std::string member_text(const T& v) {
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
}

// A selector parameter's value as text, the same way (a choice by its name).
std::string param_text(const kernels::SelectorParams& params, kernels::SelectorParam p) {
  const kernels::ParamInfo& row = kernels::selector_param(p);
  const kernels::ParamValue v = kernels::get_param(params, p);
  switch (row.type) {
    case kernels::ParamType::kNumber: return format_double(v.number);
    case kernels::ParamType::kUint: return std::to_string(v.integer);
    case kernels::ParamType::kChoice: return std::string(kernels::param_choice(row, v.integer));
  }
  return "";
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

// metrics_listen: "off", "auto" (local_paths.h), or PORT, IPV4:PORT or [IPV6]:PORT with an
// address literal (the exposer binds without resolving names) and a port in 0..65535. Empty when
// fine, else what is wrong.
std::string listen_address_error(const std::string& listen) {
  if (listen == "off" || listen == "auto") return "";
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

const std::vector<KnobSpec>& knob_table() { return knobs(); }

const KnobSpec* find_knob(std::string_view name) {
  for (const auto& spec : knobs()) {
    if (name == spec.name) return &spec;
  }
  return nullptr;
}

const std::vector<policies::TensorOverride>& OverridesCache::rules(const std::string& text) {
  if (valid_ && text == text_) return rules_;
  ++parses_;
  auto parsed = policies::parse_tensor_overrides(text);
  rules_ = parsed.ok() ? std::move(parsed).value() : std::vector<policies::TensorOverride>{};
  text_ = text;
  valid_ = true;
  return rules_;
}

void write_knobs(const Config& config, const KnobTargets& to) {
  for (const auto& spec : knobs()) spec.field.write(config, to);
}

Status set_knob(Config& config, std::string_view name, std::string_view value) {
  const KnobSpec* knob = find_knob(name);
  if (!knob) return not_found("unknown knob '" + std::string(name) + "'");
  const KnobSpec& spec = *knob;
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
      config.*std::get<bool Config::*>(knob->field.member) = v;
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
      if (auto* m = std::get_if<uint32_t Config::*>(&knob->field.member)) {
        config.**m = static_cast<uint32_t>(v);
      } else if (auto* p = std::get_if<kernels::SelectorParam>(&knob->field.member)) {
        kernels::set_param(config.selector_params, *p, {.integer = v});
      } else {
        config.*std::get<uint64_t Config::*>(knob->field.member) = v;
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
      if (auto* p = std::get_if<kernels::SelectorParam>(&knob->field.member)) {
        kernels::set_param(config.selector_params, *p, {.number = v});
      } else {
        config.*std::get<double Config::*>(knob->field.member) = v;
      }
      return Status::Ok();
    }
    case KnobType::kString: {
      if (value.find('\0') != std::string_view::npos || value.size() > 4096) {
        return bad_value(spec, "<binary>", "text up to 4096 bytes");
      }
      config.*std::get<std::string Config::*>(knob->field.member) = std::string(value);
      return Status::Ok();
    }
    case KnobType::kChoice: {
      if (!in_choices(spec.choices, value)) return bad_value(spec, value, spec.choices);
      if (auto* m = std::get_if<kernels::Selector Config::*>(&knob->field.member)) {
        kernels::Selector s;
        if (!kernels::parse_selector(value, &s)) return bad_value(spec, value, spec.choices);
        config.**m = s;
      } else if (auto* p = std::get_if<kernels::SelectorParam>(&knob->field.member)) {
        kernels::ParamValue choice;
        if (!kernels::parse_param_choice(kernels::selector_param(*p), value, &choice.integer)) {
          return bad_value(spec, value, spec.choices);
        }
        kernels::set_param(config.selector_params, *p, choice);
      } else {
        config.*std::get<std::string Config::*>(knob->field.member) = std::string(value);
      }
      return Status::Ok();
    }
  }
  return internal_error("knob type not handled");
}

Expected<std::string> get_knob(const Config& config, std::string_view name) {
  const KnobSpec* knob = find_knob(name);
  if (!knob) return not_found("unknown knob '" + std::string(name) + "'");
  return std::visit(
      [&](auto member) -> std::string {
        if constexpr (std::is_same_v<decltype(member), kernels::SelectorParam>) {
          return param_text(config.selector_params, member);
        } else {
          return member_text(config.*member);
        }
      },
      knob->field.member);
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
