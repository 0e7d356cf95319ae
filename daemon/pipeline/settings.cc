#include "daemon/pipeline/settings.h"

namespace sparsecar {

policies::StaticSettings settings_from_config(const Config& config, OverridesCache* cache) {
  policies::StaticSettings s;
  write_knobs(config, {.base = &s, .plan = nullptr, .controllers = nullptr, .control = nullptr,
                       .overrides_cache = cache});
  return s;
}

policies::PlanSettings plan_settings_from_config(const Config& config, OverridesCache* cache) {
  policies::PlanSettings p;
  write_knobs(config, {.base = &p.base, .plan = &p, .controllers = nullptr, .control = nullptr,
                       .overrides_cache = cache});
  return p;
}

policies::ControllerSettings controller_settings_from_config(const Config& config) {
  policies::ControllerSettings s;
  write_knobs(config, {.base = nullptr, .plan = nullptr, .controllers = &s, .control = nullptr,
                       .overrides_cache = nullptr});
  return s;
}

policies::ControlKnobs control_knobs_from_config(const Config& config) {
  policies::ControlKnobs k;
  write_knobs(config, {.base = nullptr, .plan = nullptr, .controllers = nullptr, .control = &k,
                       .overrides_cache = nullptr});
  return k;
}

}  // namespace sparsecar
