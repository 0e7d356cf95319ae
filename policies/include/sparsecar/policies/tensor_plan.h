// The per-tensor plan controllers: schedules, layer-wise rules and per-tensor density scales.
//
// These run on every node, for every (tensor, step), as pure functions of the agreed knobs (the
// decision in force), the step number and what every node registered (the tensor's name and
// size, checked equal at the job's first step). Same inputs, same plan on every node: no message
// is needed to agree on them. The job-level controllers (controllers.h) run on rank 0 only and
// act by changing the knobs these functions read.
//
//   plan_tensor = static_plan(base)                      (the fallback, plan.h)
//               -> schedule: dense warm-up, ramp / decay of the density, periodic dense step
//               -> layer-wise: small tensors dense, kinds (bias, norm, embedding) scaled,
//                  an optional sensitivity table from the config
//               -> frequency: per-tensor density scale published by rank 0
//               -> bounds: [density_min, min(density_max, density_cap)]
//
// Thread-safety: pure functions and plain values.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "sparsecar/common/status.h"
#include "sparsecar/policies/plan.h"

namespace sparsecar::policies {

// Version of the controller interface (plain structs in this header and controllers.h). Bumped
// when a field changes meaning; new fields are added at the end with defaults.
inline constexpr uint32_t kControllerApiVersion = 1;

// The controllers, selectable and composable through the `controller` knob ("static",
// "schedule,layerwise", "bandwidth,accuracy", ...). Bit i = ControllerKind i.
enum class ControllerKind : uint32_t {
  kStatic = 0,     // fixed k or fixed lambda (always the fallback)
  kSchedule = 1,   // per step: warm-up, ramp/decay, periodic dense (every node)
  kLayerwise = 2,  // per tensor: by size, kind and a sensitivity table (every node)
  kGradNorm = 3,   // rank 0: density up when the gradient norm jumps, down when small and steady
  kFrequency = 4,  // rank 0: tensors whose coordinates are selected again and again get more density
  kBandwidth = 5,  // rank 0: density cap / collective so the exchange fits the time budget
  kAccuracy = 6,   // rank 0: closed loop on the reported loss against a target trajectory
  kBudget = 7,     // rank 0: hard threshold, lambda adapted so the run's volume tracks a budget
  kCost = 8,       // rank 0: format and collective from the cost model (exact encoded sizes)
  kStep = 9,       // rank 0: the plan (dense ring, or a density >= the quality floor) of least step time
};
inline constexpr uint32_t kControllerKindCount = 10;
using ControllerSet = uint32_t;
inline constexpr ControllerSet bit(ControllerKind k) { return ControllerSet{1} << static_cast<uint32_t>(k); }
inline constexpr bool has(ControllerSet set, ControllerKind k) { return (set & bit(k)) != 0; }

std::string_view controller_name(ControllerKind k);
// "schedule, bandwidth" -> the set; "static" alone (or "") is the empty set. Unknown names are
// kInvalidArgument naming them and the known ones.
Expected<ControllerSet> parse_controllers(std::string_view text);
// The canonical text ("static" for the empty set), names in ControllerKind order.
std::string format_controllers(ControllerSet set);

// ---- schedule ----------------------------------------------------------------------------------
struct ScheduleSettings {
  uint64_t warmup_steps = 0;     // steps 0 .. warmup_steps-1 are dense
  uint64_t ramp_steps = 0;       // after warm-up: density moves start -> end over this many steps
  double start_density = 0.25;   // 75 % sparsity (DGC's first stage)
  double end_density = 0.0;      // 0: the `density` knob (99.9 % sparsity = 0.001 in DGC)
  bool exponential = true;       // geometric interpolation (DGC's ramp); false: linear (a decay)
  uint64_t dense_every = 0;      // > 0: every dense_every-th step is dense (flushes residuals)
  uint64_t dense_from = 0;       // > 0: steps dense_from, dense_from+1, ... are dense (a switch at a known step)
  bool operator==(const ScheduleSettings&) const = default;
};
// The density the schedule wants at `step` (base_density when it has nothing to say); *dense is
// set when the step must be dense (warm-up, periodic, from dense_from on).
double scheduled_density(const ScheduleSettings& s, double base_density, uint64_t step, bool* dense);

// ---- layer-wise -------------------------------------------------------------------------------
// One line of the sensitivity table: tensors whose name contains `pattern` are dense, or get
// their density multiplied by `scale`. The first matching rule wins and overrides the kind rules.
struct SensitivityRule {
  std::string pattern;
  bool dense = false;
  double scale = 1.0;
  bool operator==(const SensitivityRule&) const = default;
};
// "bias:dense, embed:0.1, fc2:2" -> rules. kInvalidArgument names the bad entry.
Expected<std::vector<SensitivityRule>> parse_sensitivity(std::string_view text);

struct LayerwiseSettings {
  uint64_t dense_below = 4096;    // tensors with fewer elements are sent dense
  double small_scale = 10.0;       // names with bias/norm/bn/ln: density x this
  double embedding_scale = 0.1;    // names with embed: density x this (very sparse)
  std::vector<SensitivityRule> rules;
  bool operator==(const LayerwiseSettings&) const = default;
};
// Density multiplier for a tensor (1 when no rule applies); *dense when it must be dense.
double layer_scale(const LayerwiseSettings& s, std::string_view name, uint64_t elements, bool* dense);

// ---- per-tensor scales (published by the frequency controller) -------------------------------
using TensorScales = std::map<uint32_t, double>;  // tensor id -> density multiplier
// "3:2,7:0.5" <-> map; "" is empty. Scales must be finite and > 0.
Expected<TensorScales> parse_tensor_scales(std::string_view text);
std::string format_tensor_scales(const TensorScales& scales);

// ---- the plan -----------------------------------------------------------------------------------
struct PlanSettings {
  StaticSettings base;
  ControllerSet active = 0;
  ScheduleSettings schedule;
  LayerwiseSettings layerwise;
  TensorScales tensor_scale;
  double density_min = 1e-5;  // quality floor of every controller
  double density_max = 1.0;
  double density_cap = 1.0;   // the bandwidth controller's cap (1 = none)
  double dense_above = 0.5;   // a scaled density at or above this is sent dense (cheaper, exact)
  bool operator==(const PlanSettings&) const = default;
};

// The plan of one tensor at one step. Starts from static_plan(base) and applies the active
// per-tensor controllers; compression off stays dense. Deterministic: no state, no clock.
Plan plan_tensor(const PlanSettings& settings, const TensorObservation& observation);

}  // namespace sparsecar::policies
