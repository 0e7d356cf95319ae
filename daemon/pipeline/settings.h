// The bridge from knob values (Config) to the inputs of the plan policies.
//
// Every knob a policy reads is copied here, in one place, so that a live change through a
// decision epoch (decisions.h) reaches the plans exactly as a start-up flag would.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "daemon/config/knobs.h"
#include "sparsecar/policies/controllers.h"
#include "sparsecar/policies/plan.h"
#include "sparsecar/policies/tensor_plan.h"

namespace sparsecar {

// tensor_overrides parsed once per distinct text. Every decision epoch brings a new Config (a
// controller may make one every few steps) while the override rules rarely change: whoever owns
// the Configs keeps one of these and settings_from_config parses only when the text differs
// from the previous call's.
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

// `cache` may be null: the overrides are then parsed on every call.
policies::StaticSettings settings_from_config(const Config& config, OverridesCache* cache = nullptr);

// The inputs of policies::plan_tensor (static policy + schedule, layer-wise and per-tensor
// scales). Unparsable table knobs (validated when set) count as empty.
policies::PlanSettings plan_settings_from_config(const Config& config, OverridesCache* cache = nullptr);

// Rank 0's controller parameters and the live knobs they act on.
policies::ControllerSettings controller_settings_from_config(const Config& config);
policies::ControlKnobs control_knobs_from_config(const Config& config);

}  // namespace sparsecar
