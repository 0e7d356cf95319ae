// The controller registry's rows, make_controller and the ControlLoop that chains the active
// job-level controllers (each in its controller_<name>.cc) and applies the rate limit and
// hysteresis to what they propose.
#include "sparsecar/policies/controllers.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <iterator>

#include "controller_internal.h"
#include "sparsecar/kernels/codecs.h"

namespace sparsecar::policies {
namespace {

double rel_diff(double a, double b) {
  const double m = std::max(std::fabs(a), std::fabs(b));
  return m == 0 ? 0 : std::fabs(a - b) / m;
}

std::string fmt(const char* f, double a, double b = 0, double c = 0) {
  char buf[160];
  std::snprintf(buf, sizeof buf, f, a, b, c);
  return buf;
}

// Lambda's hysteresis: a twentieth of the density's. A hard threshold's volume is steep in lambda
// (error feedback piles residuals up just under it, and a lower lambda flushes them at once), so
// lambda must move in small, frequent steps rather than rare jumps.
double threshold_hysteresis(const ControllerSettings& s) { return s.controller_hysteresis / 20; }

bool valid(const ControlKnobs& k) {
  auto ok = [](double v, double lo, double hi) { return std::isfinite(v) && v >= lo && v <= hi; };
  if (!ok(k.density, 1e-6, 1.0) || !ok(k.threshold, 1e-30, 1e30) || !ok(k.density_cap, 1e-6, 1.0)) return false;
  for (const auto& [id, s] : k.tensor_scale) {
    if (!ok(s, 1e-6, 1e6)) return false;
  }
  return true;
}

std::string describe_change(const ControlKnobs& from, const ControlKnobs& to) {
  std::string out;
  auto add = [&](const std::string& s) {
    if (!out.empty()) out += ' ';
    out += s;
  };
  if (from.compression != to.compression) add(to.compression ? "compression=on" : "compression=off");
  if (from.selector != to.selector) add(std::string("selector=").append(kernels::selector_name(to.selector)));
  if (from.density != to.density) add(fmt("density=%.4g", to.density));
  if (from.threshold != to.threshold) add(fmt("threshold=%.4g", to.threshold));
  if (from.density_cap != to.density_cap) add(fmt("density_cap=%.4g", to.density_cap));
  if (from.tensor_scale != to.tensor_scale) {
    add(std::string("tensor_density_scale=").append(format_tensor_scales(to.tensor_scale)));
  }
  if (from.format != to.format) add(std::string("format=").append(kernels::format_name(to.format)));
  if (from.schedule_warmup_steps != to.schedule_warmup_steps) {
    add("schedule_warmup_steps=" + std::to_string(to.schedule_warmup_steps));
  }
  return out;
}

}  // namespace

bool operator==(const ControlKnobs& a, const ControlKnobs& b) {
  return a.compression == b.compression && a.selector == b.selector && a.density == b.density &&
         a.threshold == b.threshold && a.density_cap == b.density_cap && a.tensor_scale == b.tensor_scale &&
         a.format == b.format && a.schedule_warmup_steps == b.schedule_warmup_steps;
}

// ---- the registry ------------------------------------------------------------------------------
namespace {

// Every field is written out in every row. Job-level rows in the order the ControlLoop chains
// them (each refines the previous one's proposal).
constexpr ControllerInfo kRows[] = {
    {.kind = ControllerKind::kStatic, .name = "static", .doc = "fixed knobs (always the fallback)",
     .job_level = false, .make = nullptr, .knobs = ""},
    {.kind = ControllerKind::kSchedule, .name = "schedule",
     .doc = "per step: dense warm-up, density ramp or decay, periodic dense steps", .job_level = false,
     .make = nullptr, .knobs = "schedule_*"},
    {.kind = ControllerKind::kLayerwise, .name = "layerwise",
     .doc = "per tensor: small tensors dense, bias/norm/embedding tensors scaled, a sensitivity table",
     .job_level = false, .make = nullptr, .knobs = "layerwise_*"},
    {.kind = ControllerKind::kAccuracy, .name = "accuracy",
     .doc = "density multiplier keeping the compression error (or the metric's gap to its target) in bounds",
     .job_level = true,
     .make = make_accuracy_controller, .knobs = "accuracy_* controller_metric"},
    {.kind = ControllerKind::kGradNorm, .name = "gradnorm",
     .doc = "density up when the gradient norm jumps, down while it is small and steady", .job_level = true,
     .make = make_gradnorm_controller, .knobs = "gradnorm_*"},
    {.kind = ControllerKind::kBudget, .name = "budget",
     .doc = "hard threshold, lambda moved so that the run's volume tracks a budget", .job_level = true,
     .make = make_budget_controller, .knobs = "budget_*"},
    {.kind = ControllerKind::kFrequency, .name = "frequency",
     .doc = "per-tensor density scales: often re-selected tensors get more", .job_level = true,
     .make = make_frequency_controller, .knobs = "frequency_*"},
    {.kind = ControllerKind::kBandwidth, .name = "bandwidth",
     .doc = "density cap or dense ring so that the exchange fits the time budget", .job_level = true,
     .make = make_bandwidth_controller, .knobs = "bandwidth_* exchange_budget_* goodput_*"},
    {.kind = ControllerKind::kStep, .name = "step",
     .doc = "within step_slack of the least price, the dense ring, else the sparse plan nearest the density "
            "asked for; prices: measured step times of the plans that ran, else receiver-timed link fits and "
            "measured compute costs, plus the step's measured overhead; sparse steps priced x step_dense_worth "
            "(x step_dense_worth_corrected where the DDP hook corrects momentum)",
     .job_level = true, .make = make_step_controller,
     .knobs = "step_slack step_confirm_steps step_hold_steps step_forget step_allow_dense step_dense_worth "
              "step_dense_worth_corrected step_warmup_cut "
              "step_probe_share step_timed_send_every"},
    {.kind = ControllerKind::kCost, .name = "cost", .doc = "collective and format from the cost model",
     .job_level = true, .make = make_cost_controller, .knobs = ""},
};
static_assert(std::size(kRows) == kControllerKindCount, "one row per ControllerKind");

}  // namespace

std::span<const ControllerInfo> controller_registry() { return kRows; }

const ControllerInfo* find_controller(ControllerKind kind) {
  for (const ControllerInfo& row : kRows) {
    if (row.kind == kind) return &row;
  }
  return nullptr;
}

std::string controller_choices() {
  std::string out;
  for (uint32_t i = 0; i < kControllerKindCount; ++i) {
    const ControllerInfo* row = find_controller(static_cast<ControllerKind>(i));
    if (row == nullptr) continue;
    out.append(out.empty() ? "" : "|").append(row->name);
  }
  return out;
}

ControllerSet job_level_controllers() {
  ControllerSet set = 0;
  for (const ControllerInfo& row : kRows) {
    if (row.job_level) set |= bit(row.kind);
  }
  return set;
}

std::unique_ptr<Controller> make_controller(ControllerKind kind) {
  const ControllerInfo* row = find_controller(kind);
  return row != nullptr && row->make != nullptr ? row->make() : nullptr;
}

std::optional<ControlLoop::Proposal> ControlLoop::update(const ControllerSettings& settings, const JobObservation& obs,
                                                         const ControlKnobs& base, const ControlKnobs& in_force) {
  if (status_.failed) {
    if (fallback_sent_ || in_force == base) return std::nullopt;
    fallback_sent_ = true;
    ++status_.proposals;
    status_.last_reason = std::string("controllers failed, back to static: ").append(status_.failure);
    return Proposal{base, status_.last_reason};
  }
  status_.last_step = obs.step;
  if (std::isfinite(obs.residual_norm2)) status_.total_error += obs.residual_norm2;
  status_.goodput_Bps =
      goodput_.update(obs.goodput_Bps, obs.wall_goodput_Bps, settings.goodput_smoothing, settings.goodput_confirm_steps);

  status_.decision_note.clear();
  ControlKnobs k = base;
  k.density_cap = 1.0;
  k.tensor_scale.clear();
  ControlContext ctx{settings, obs, base, goodput_.estimate(), &status_, &in_force};
  std::string names;
  if (!run_chain(settings, obs.step, " at step ", &k, &names, /*changed_only=*/false,
                 [&](Controller& c, ControlKnobs* knobs) { return c.update(ctx, knobs); })) {
    return update(settings, obs, base, in_force);
  }
  if (k.selector == kernels::Selector::kThreshold || !k.compression) k.format = in_force.format;
  return propose_change(settings, obs.step, names, std::move(k), in_force, " at step ");
}

std::optional<ControlLoop::Proposal> ControlLoop::before_start(const ControllerSettings& settings,
                                                               const StartHint& hint, const ControlKnobs& base,
                                                               const ControlKnobs& in_force) {
  if (status_.failed || proposed_) return std::nullopt;
  status_.decision_note.clear();
  JobObservation none;
  none.step = hint.step;
  ControlKnobs k = in_force;  // only what a controller changes on the hint moves
  ControlContext ctx{settings, none, base, 0, &status_, &in_force};
  std::string names;
  if (!run_chain(settings, hint.step, " before step ", &k, &names, /*changed_only=*/true,
                 [&](Controller& c, ControlKnobs* knobs) { return c.before_start(ctx, hint, knobs); })) {
    return std::nullopt;  // nothing was proposed yet: the operator's knobs are in force
  }
  return propose_change(settings, hint.step, names, std::move(k), in_force, " before step ");
}

bool ControlLoop::run_chain(const ControllerSettings& settings, uint64_t step, const char* when, ControlKnobs* k,
                            std::string* names, bool changed_only,
                            const std::function<Status(Controller&, ControlKnobs*)>& call) {
  for (const ControllerInfo& row : controller_registry()) {
    if (!row.job_level) continue;
    auto& c = controllers_[static_cast<uint32_t>(row.kind)];
    if (!has(settings.active, row.kind)) {
      c.reset();  // deactivated: its state goes; reactivating starts afresh
      continue;
    }
    if (!c) c = make_controller(row.kind);
    std::optional<ControlKnobs> before;
    if (changed_only) before = *k;  // (a copy a step only where it is asked for)
    Status s = call(*c, k);
    if (s.ok() && !valid(*k)) s = internal_error("proposed out-of-range knobs");
    if (!s.ok()) {
      status_.failed = true;
      status_.failure = controller_name(row.kind);
      status_.failure.append(" v").append(std::to_string(c->version())).append(when).append(std::to_string(step));
      status_.failure.append(": ").append(s.message());
      return false;
    }
    if (before && *k == *before) continue;
    if (!names->empty()) *names += ',';
    *names += controller_name(row.kind);
  }
  return true;
}

std::optional<ControlLoop::Proposal> ControlLoop::propose_change(const ControllerSettings& settings, uint64_t step,
                                                                 const std::string& names, ControlKnobs k,
                                                                 const ControlKnobs& in_force, const char* when) {
  const bool structural = k.compression != in_force.compression || k.selector != in_force.selector ||
                          k.tensor_scale != in_force.tensor_scale || k.format != in_force.format ||
                          k.schedule_warmup_steps != in_force.schedule_warmup_steps;
  const bool numeric = rel_diff(k.density, in_force.density) > settings.controller_hysteresis ||
                       rel_diff(k.density_cap, in_force.density_cap) > settings.controller_hysteresis ||
                       rel_diff(k.threshold, in_force.threshold) > threshold_hysteresis(settings);
  if (!structural && !numeric) return std::nullopt;
  if (proposed_ && step < last_proposal_step_ + settings.controller_interval_steps) return std::nullopt;
  // Values that did not move past the hysteresis keep their value in force (no creeping).
  if (rel_diff(k.density, in_force.density) <= settings.controller_hysteresis) k.density = in_force.density;
  if (rel_diff(k.density_cap, in_force.density_cap) <= settings.controller_hysteresis) {
    k.density_cap = in_force.density_cap;
  }
  if (rel_diff(k.threshold, in_force.threshold) <= threshold_hysteresis(settings)) k.threshold = in_force.threshold;
  if (k == in_force) return std::nullopt;
  proposed_ = true;
  last_proposal_step_ = step;
  ++status_.proposals;
  status_.last_reason = "controller ";
  status_.last_reason.append(names.empty() ? std::string("static") : names)
      .append(when)
      .append(std::to_string(step))
      .append(": ")
      .append(describe_change(in_force, k));
  if (!status_.decision_note.empty()) status_.last_reason.append(" (").append(status_.decision_note).append(")");
  return Proposal{k, status_.last_reason};
}

}  // namespace sparsecar::policies