// The bridge from knob values (Config) to the inputs of the plan policies.
//
// Each function fills its settings through the knob table (write_knobs, daemon/config/knobs.h):
// every row names the settings fields its knob feeds, so a live change through a decision epoch
// (decisions.h) reaches the plans exactly as a start-up flag would, and no knob is copied by hand.
#pragma once

#include "daemon/config/knobs.h"
#include "sparsecar/policies/controllers.h"
#include "sparsecar/policies/plan.h"
#include "sparsecar/policies/tensor_plan.h"

namespace sparsecar {

// OverridesCache (tensor_overrides parsed once per distinct text): knobs.h.

// `cache` may be null: the overrides are then parsed on every call.
policies::StaticSettings settings_from_config(const Config& config, OverridesCache* cache = nullptr);

// The inputs of policies::plan_tensor (static policy + schedule, layer-wise and per-tensor
// scales). Unparsable table knobs (validated when set) count as empty.
policies::PlanSettings plan_settings_from_config(const Config& config, OverridesCache* cache = nullptr);

// Rank 0's controller parameters and the live knobs they act on.
policies::ControllerSettings controller_settings_from_config(const Config& config);
policies::ControlKnobs control_knobs_from_config(const Config& config);

}  // namespace sparsecar
