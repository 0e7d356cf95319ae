// The bridge from knob values (Config) to the inputs of the plan policies.
//
// Every knob a policy reads is copied here, in one place, so that a live change through a
// decision epoch (decisions.h) reaches the plans exactly as a start-up flag would.
#pragma once

#include "daemon/config/knobs.h"
#include "sparsecar/policies/plan.h"

namespace sparsecar {

policies::StaticSettings settings_from_config(const Config& config);

}  // namespace sparsecar
