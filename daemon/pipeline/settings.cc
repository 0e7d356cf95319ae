#include "daemon/pipeline/settings.h"

namespace sparsecar {
namespace {

template <typename T>
T or_default(Expected<T> e) {
  return e.ok() ? std::move(e).value() : T{};
}

}  // namespace

const std::vector<policies::TensorOverride>& OverridesCache::rules(const std::string& text) {
  if (valid_ && text == text_) return rules_;
  ++parses_;
  auto parsed = policies::parse_tensor_overrides(text);
  rules_ = parsed.ok() ? std::move(parsed).value() : std::vector<policies::TensorOverride>{};
  text_ = text;
  valid_ = true;
  return rules_;
}

policies::StaticSettings settings_from_config(const Config& config, OverridesCache* cache) {
  policies::StaticSettings s;
  s.compression = config.compression;
  s.selector = config.selector;
  s.density = config.density;
  s.threshold = config.threshold;
  s.block_size = config.block_size;
  if (!kernels::parse_group_norm(config.group_norm, &s.group_norm)) s.group_norm = kernels::GroupNorm::kL2;
  s.heads = config.heads;
  s.mask_period = config.mask_period;
  s.hybrid_density = config.hybrid_density;
  s.quantile = config.quantile;
  s.approx_tolerance = config.approx_tolerance;
  s.job_seed = config.random_seed;
  if (!policies::parse_error_feedback(config.error_feedback, &s.error_feedback)) {
    s.error_feedback = policies::ErrorFeedback::kResidual;  // the knob table only admits valid names
  }
  s.momentum = config.momentum;
  s.clip_norm = config.clip_norm;
  if (!policies::parse_lr_rescale(config.lr_rescale, &s.lr_rescale)) s.lr_rescale = policies::LrRescale::kOff;
  // validate() rejected unparsable overrides at start-up; a live change is validated the same way.
  if (cache != nullptr) {
    s.overrides = cache->rules(config.tensor_overrides);
  } else if (auto rules = policies::parse_tensor_overrides(config.tensor_overrides); rules.ok()) {
    s.overrides = std::move(*rules);
  }
  s.auto_format = config.format == "auto";
  if (!s.auto_format && !kernels::parse_format(config.format, &s.format)) s.format = kernels::Format::kCoo;
  if (!kernels::parse_value_type(config.value_type, &s.value_type)) s.value_type = kernels::ValueType::kF32;
  return s;
}

policies::PlanSettings plan_settings_from_config(const Config& config, OverridesCache* cache) {
  policies::PlanSettings p;
  p.base = settings_from_config(config, cache);
  p.active = or_default(policies::parse_controllers(config.controller));
  p.schedule.warmup_steps = config.schedule_warmup_steps;
  p.schedule.ramp_steps = config.schedule_ramp_steps;
  p.schedule.start_density = config.schedule_start_density;
  p.schedule.end_density = config.schedule_end_density;
  p.schedule.exponential = config.schedule_shape != "linear";
  p.schedule.dense_every = config.schedule_dense_every;
  p.layerwise.dense_below = config.layerwise_dense_below;
  p.layerwise.small_kind_scale = config.layerwise_small_scale;
  p.layerwise.embedding_scale = config.layerwise_embedding_scale;
  p.layerwise.rules = or_default(policies::parse_sensitivity(config.layerwise_sensitivity));
  p.tensor_scale = or_default(policies::parse_tensor_scales(config.tensor_density_scale));
  p.density_min = config.density_min;
  p.density_max = config.density_max;
  p.density_cap = config.density_cap;
  return p;
}

policies::ControllerSettings controller_settings_from_config(const Config& config) {
  policies::ControllerSettings s;
  s.active = or_default(policies::parse_controllers(config.controller));
  s.world_size = config.world_size;
  s.density_min = config.density_min;
  s.density_max = config.density_max;
  s.min_interval_steps = config.controller_interval_steps;
  s.hysteresis = config.controller_hysteresis;
  s.warmup_steps = config.schedule_warmup_steps;
  s.gradnorm_jump = config.gradnorm_jump;
  s.gradnorm_boost = config.gradnorm_boost;
  s.gradnorm_boost_steps = config.gradnorm_boost_steps;
  s.gradnorm_window = config.gradnorm_window;
  s.gradnorm_steady_cv = config.gradnorm_steady_cv;
  s.gradnorm_steady_scale = config.gradnorm_steady_scale;
  s.frequency_max_scale = config.frequency_max_scale;
  s.exchange_budget_ms = config.exchange_budget_ms;
  s.exchange_budget_fraction = config.exchange_budget_fraction;
  s.goodput_alpha = config.goodput_smoothing;
  s.bandwidth_margin = config.bandwidth_margin;
  s.bandwidth_allow_dense = config.bandwidth_allow_dense;
  s.goodput_confirm_steps = config.goodput_confirm_steps;
  s.bandwidth_confirm_steps = config.bandwidth_confirm_steps;
  s.bandwidth_hold_steps = config.bandwidth_hold_steps;
  s.bandwidth_raise_max = config.bandwidth_raise_max;
  s.bandwidth_lower_max = config.bandwidth_lower_max;
  s.accuracy_tolerance = config.accuracy_tolerance;
  s.accuracy_backoff = config.accuracy_backoff;
  s.accuracy_tighten = config.accuracy_tighten;
  s.accuracy_hold_steps = config.accuracy_hold_steps;
  s.budget_total_elements = config.budget_total_elements;
  s.budget_steps = config.budget_steps;
  return s;
}

policies::ControlKnobs control_knobs_from_config(const Config& config) {
  policies::ControlKnobs k;
  k.compression = config.compression;
  k.selector = config.selector;
  k.density = config.density;
  k.threshold = config.threshold;
  k.density_cap = config.density_cap;
  k.tensor_scale = or_default(policies::parse_tensor_scales(config.tensor_density_scale));
  // `format` is a knob only once the codecs issue adds it; until then COO.
  if (find_knob("format") != nullptr) {
    auto text = get_knob(config, "format");
    if (text.ok()) kernels::parse_format(*text, &k.format);
  }
  return k;
}

}  // namespace sparsecar
