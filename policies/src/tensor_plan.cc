#include "sparsecar/policies/tensor_plan.h"

#include "sparsecar/policies/controllers.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

namespace sparsecar::policies {
namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

// Calls fn(item) for every comma-separated, trimmed, non-empty item; stops at the first error.
template <typename Fn>
Status for_each_item(std::string_view text, Fn fn) {
  while (!text.empty()) {
    size_t comma = text.find(',');
    std::string_view item = trim(text.substr(0, comma));
    text.remove_prefix(comma == std::string_view::npos ? text.size() : comma + 1);
    if (item.empty()) continue;
    Status s = fn(item);
    if (!s.ok()) return s;
  }
  return Status::Ok();
}

bool parse_positive(std::string_view text, double* out) {
  std::string s(text);
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size() || !std::isfinite(v) || v <= 0) return false;
  *out = v;
  return true;
}

bool contains(std::string_view haystack, std::string_view needle) {
  return haystack.find(needle) != std::string_view::npos;
}

}  // namespace

std::string_view controller_name(ControllerKind k) {
  const ControllerInfo* row = find_controller(k);
  return row != nullptr ? row->name : "unknown";
}

Expected<ControllerSet> parse_controllers(std::string_view text) {
  ControllerSet set = 0;
  Status s = for_each_item(text, [&](std::string_view item) -> Status {
    for (const ControllerInfo& row : controller_registry()) {
      if (item == row.name) {
        if (row.kind != ControllerKind::kStatic) set |= bit(row.kind);
        return Status::Ok();
      }
    }
    std::string known;
    for (uint32_t i = 0; i < kControllerKindCount; ++i) {
      known.append(i == 0 ? "" : ", ").append(controller_name(static_cast<ControllerKind>(i)));
    }
    return invalid_argument("unknown controller '" + std::string(item) + "' (known: " + known + ")");
  });
  if (!s.ok()) return s;
  return set;
}

std::string format_controllers(ControllerSet set) {
  std::string out;
  for (uint32_t i = 1; i < kControllerKindCount; ++i) {
    if (!has(set, static_cast<ControllerKind>(i))) continue;
    if (!out.empty()) out += ',';
    out += controller_name(static_cast<ControllerKind>(i));
  }
  return out.empty() ? "static" : out;
}

double scheduled_density(const ScheduleSettings& s, double base_density, uint64_t step, bool* dense) {
  *dense = false;
  if (step < s.warmup_steps) {
    *dense = true;
    return 1.0;
  }
  if ((s.dense_every > 0 && (step + 1) % s.dense_every == 0) || (s.dense_from > 0 && step >= s.dense_from)) {
    *dense = true;
    return 1.0;
  }
  const double end = s.end_density > 0 ? s.end_density : base_density;
  if (s.ramp_steps == 0) return end;
  const uint64_t t = step - s.warmup_steps;
  if (t >= s.ramp_steps) return end;
  const double f = static_cast<double>(t) / static_cast<double>(s.ramp_steps);
  const double start = s.start_density > 0 ? s.start_density : end;
  if (s.exponential) return start * std::pow(end / start, f);
  return start + (end - start) * f;
}

Expected<std::vector<SensitivityRule>> parse_sensitivity(std::string_view text) {
  std::vector<SensitivityRule> rules;
  Status s = for_each_item(text, [&](std::string_view item) -> Status {
    size_t colon = item.rfind(':');
    if (colon == std::string_view::npos || colon == 0) {
      return invalid_argument("sensitivity entry '" + std::string(item) + "' is not pattern:dense or pattern:scale");
    }
    SensitivityRule r;
    r.pattern = std::string(trim(item.substr(0, colon)));
    std::string_view value = trim(item.substr(colon + 1));
    if (value == "dense") {
      r.dense = true;
    } else if (!parse_positive(value, &r.scale)) {
      return invalid_argument("sensitivity entry '" + std::string(item) + "': scale must be a number > 0 or 'dense'");
    }
    rules.push_back(std::move(r));
    return Status::Ok();
  });
  if (!s.ok()) return s;
  return rules;
}

double layer_scale(const LayerwiseSettings& s, std::string_view name, uint64_t elements, bool* dense) {
  *dense = false;
  for (const auto& r : s.rules) {
    if (contains(name, r.pattern)) {
      *dense = r.dense;
      return r.dense ? 1.0 : r.scale;
    }
  }
  if (elements < s.dense_below) {
    *dense = true;
    return 1.0;
  }
  if (contains(name, "embed")) return s.embedding_scale;
  if (contains(name, "bias") || contains(name, "norm") || contains(name, "bn") || contains(name, "ln")) {
    return s.small_scale;
  }
  return 1.0;
}

Expected<TensorScales> parse_tensor_scales(std::string_view text) {
  TensorScales out;
  Status s = for_each_item(text, [&](std::string_view item) -> Status {
    size_t colon = item.find(':');
    std::string id_text(colon == std::string_view::npos ? item : item.substr(0, colon));
    char* end = nullptr;
    unsigned long id = std::strtoul(id_text.c_str(), &end, 10);
    double scale = 0;
    if (colon == std::string_view::npos || id_text.empty() || end != id_text.c_str() + id_text.size() ||
        id > 0xFFFFFFFFul || !parse_positive(item.substr(colon + 1), &scale)) {
      return invalid_argument("tensor scale '" + std::string(item) + "' is not <tensor id>:<scale > 0>");
    }
    out[static_cast<uint32_t>(id)] = scale;
    return Status::Ok();
  });
  if (!s.ok()) return s;
  return out;
}

std::string format_tensor_scales(const TensorScales& scales) {
  std::string out;
  char buf[64];
  for (const auto& [id, scale] : scales) {
    std::snprintf(buf, sizeof buf, "%s%u:%.4g", out.empty() ? "" : ",", id, scale);
    // Near DBL_MAX four digits round up past it and would not parse back (a round trip
    // tests/fuzz/policy_lists_fuzz.cc checks); such a scale gets every digit.
    if (!std::isfinite(std::strtod(std::strchr(buf, ':') + 1, nullptr))) {
      std::snprintf(buf, sizeof buf, "%s%u:%.17g", out.empty() ? "" : ",", id, scale);
    }
    out += buf;
  }
  return out;
}

Plan plan_tensor(const PlanSettings& settings, const TensorObservation& obs) {
  Plan plan = static_plan(settings.base, obs);
  if (plan.dense || settings.active == 0) return plan;  // compression off, or the static policy alone
  // What static_plan gives with compression off: dense, with the tensor's error compensation
  // (the compressor applies it on dense steps too: clipping, EF variant, lr rescale).
  Plan dense_plan;
  dense_plan.collective = settings.base.dense_collective;
  dense_plan.params = plan.params;
  dense_plan.error_feedback = plan.error_feedback;
  dense_plan.momentum = plan.momentum;
  dense_plan.clip_norm = plan.clip_norm;
  dense_plan.lr_rescale = plan.lr_rescale;
  double density = plan.params.density;
  double scale = 1.0;
  bool dense = false;
  if (has(settings.active, ControllerKind::kSchedule)) {
    density = scheduled_density(settings.schedule, density, obs.step, &dense);
    if (dense) return dense_plan;
  }
  if (has(settings.active, ControllerKind::kLayerwise)) {
    scale *= layer_scale(settings.layerwise, obs.name, obs.elements, &dense);
    if (dense) return dense_plan;
  }
  if (has(settings.active, ControllerKind::kFrequency)) {
    auto it = settings.tensor_scale.find(obs.tensor_id);
    if (it != settings.tensor_scale.end()) scale *= it->second;
  }
  const double hi = std::min(settings.density_max, settings.density_cap);
  const double lo = std::min(settings.density_min, hi);
  if (plan.selector == kernels::Selector::kThreshold) {
    // Hard threshold: a larger density scale means a lower lambda. The cap and bounds are
    // density-only notions and do not apply to lambda.
    plan.params.threshold /= scale;
    return plan;
  }
  density = std::clamp(density * scale, lo, hi);
  if (density >= settings.dense_above) return dense_plan;
  plan.params.density = density;
  return plan;
}

}  // namespace sparsecar::policies
