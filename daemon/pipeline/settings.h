// The bridge from knob values (Config) to the inputs of the plan policies.
//
// Every knob a policy reads is copied here, in one place, so that a live change through a
// decision epoch (decisions.h) reaches the plans exactly as a start-up flag would.
#pragma once

#include "daemon/config/knobs.h"
#include "sparsecar/policies/controllers.h"
#include "sparsecar/policies/plan.h"
#include "sparsecar/policies/tensor_plan.h"

namespace sparsecar {

policies::StaticSettings settings_from_config(const Config& config);

// The inputs of policies::plan_tensor (static policy + schedule, layer-wise and per-tensor
// scales). Unparsable table knobs (validated when set) count as empty.
policies::PlanSettings plan_settings_from_config(const Config& config);

// Rank 0's controller parameters and the live knobs they act on.
policies::ControllerSettings controller_settings_from_config(const Config& config);
policies::ControlKnobs control_knobs_from_config(const Config& config);

}  // namespace sparsecar
