#include <cstdio>
#include <string>

#include "sparsecar/kernels/select.h"
#include "sparsecar/policies/plan.h"

namespace sparsecar::policies {

static Plan static_plan_base(const StaticSettings& settings, const TensorObservation& observation) {
  Plan plan;
  if (!settings.compression || settings.selector == kernels::Selector::kNone) {
    return plan;  // dense ring all-reduce
  }
  plan.dense = false;
  plan.selector = settings.selector;
  plan.density = settings.density;
  plan.threshold = static_cast<float>(settings.threshold);
  plan.format = settings.format;
  plan.auto_format = settings.auto_format;
  plan.value_type = settings.value_type;
  plan.rows = observation.rows == 0 ? 1 : observation.rows;
  plan.block_size = settings.block_size;
  plan.group_norm = settings.group_norm;
  plan.heads = settings.heads;
  plan.mask_period = settings.mask_period;
  plan.hybrid_density = settings.hybrid_density;
  plan.collective = Collective::kSparseAllGather;
  return plan;
}

namespace {

// The base settings with every override whose glob matches the tensor's name applied in order.
// Copies (allocates) only for tensors that some rule matches.
const StaticSettings& with_overrides(const StaticSettings& base, std::string_view name,
                                     StaticSettings* storage) {
  const StaticSettings* out = &base;
  for (const TensorOverride& o : base.overrides) {
    if (!glob_match(o.glob, name)) continue;
    if (out == &base) {
      *storage = base;
      out = storage;
    }
    if (o.compression) storage->compression = *o.compression;
    if (o.selector) storage->selector = *o.selector;
    if (o.density) storage->density = *o.density;
    if (o.threshold) storage->threshold = *o.threshold;
    if (o.quantile) storage->quantile = *o.quantile;
    if (o.approx_tolerance) storage->approx_tolerance = *o.approx_tolerance;
    if (o.format) storage->format = *o.format;
    if (o.auto_format) storage->auto_format = *o.auto_format;
    if (o.value_type) storage->value_type = *o.value_type;
    if (o.block_size) storage->block_size = *o.block_size;
    if (o.group_norm) storage->group_norm = *o.group_norm;
    if (o.heads) storage->heads = *o.heads;
    if (o.mask_period) storage->mask_period = *o.mask_period;
    if (o.error_feedback) storage->error_feedback = *o.error_feedback;
    if (o.momentum) storage->momentum = *o.momentum;
    if (o.clip_norm) storage->clip_norm = *o.clip_norm;
  }
  return *out;
}

}  // namespace

Plan static_plan(const StaticSettings& settings, const TensorObservation& observation) {
  StaticSettings storage;
  const StaticSettings& effective = settings.overrides.empty()
                                        ? settings
                                        : with_overrides(settings, observation.name, &storage);
  Plan plan = static_plan_base(effective, observation);
  plan.quantile = effective.quantile;
  plan.approx_tolerance = effective.approx_tolerance;
  plan.seed = kernels::derive_seed(effective.random_seed, observation.tensor_id, observation.step);
  plan.error_feedback = effective.error_feedback;
  plan.momentum = static_cast<float>(effective.momentum);
  plan.clip_norm = static_cast<float>(effective.clip_norm);
  plan.lr_rescale = effective.lr_rescale;
  return plan;
}

const char* format_knob_choices() {
  static const std::string choices = std::string(kernels::format_choices()) + "|auto";
  return choices.c_str();
}

std::string_view error_feedback_name(ErrorFeedback e) {
  switch (e) {
    case ErrorFeedback::kResidual: return "residual";
    case ErrorFeedback::kMomentum: return "momentum";
    case ErrorFeedback::kOff: return "off";
  }
  return "unknown";
}

bool parse_error_feedback(std::string_view text, ErrorFeedback* out) {
  for (ErrorFeedback e : {ErrorFeedback::kResidual, ErrorFeedback::kMomentum, ErrorFeedback::kOff}) {
    if (text == error_feedback_name(e)) {
      *out = e;
      return true;
    }
  }
  return false;
}

std::string_view lr_rescale_name(LrRescale r) {
  switch (r) {
    case LrRescale::kOff: return "off";
    case LrRescale::kNewOverOld: return "new_over_old";
    case LrRescale::kOldOverNew: return "old_over_new";
  }
  return "unknown";
}

bool parse_lr_rescale(std::string_view text, LrRescale* out) {
  for (LrRescale r : {LrRescale::kOff, LrRescale::kNewOverOld, LrRescale::kOldOverNew}) {
    if (text == lr_rescale_name(r)) {
      *out = r;
      return true;
    }
  }
  return false;
}

kernels::SelectorParams selector_params(const Plan& plan) {
  kernels::SelectorParams p;
  p.density = plan.density;
  p.threshold = plan.threshold;
  p.quantile = plan.quantile;
  p.approx_tolerance = plan.approx_tolerance;
  p.block_size = plan.block_size;
  p.group_norm = plan.group_norm;
  p.heads = plan.heads;
  p.mask_period = plan.mask_period;
  p.hybrid_density = plan.hybrid_density;
  p.seed = plan.seed;
  return p;
}

std::string describe(const Plan& plan) {
  if (plan.dense) return "dense ring-allreduce";
  char buf[160];
  const char* collective = plan.collective == Collective::kSparseAllGather ? "sparse-allgather" : "ring";
  const std::string_view format = plan.auto_format ? std::string_view("auto") : kernels::format_name(plan.format);
  if (plan.selector == kernels::Selector::kThreshold) {
    std::snprintf(buf, sizeof buf, "threshold lambda=%g %.*s/%.*s %s", static_cast<double>(plan.threshold),
                  static_cast<int>(format.size()), format.data(),
                  static_cast<int>(kernels::value_type_name(plan.value_type).size()),
                  kernels::value_type_name(plan.value_type).data(), collective);
  } else {
    std::snprintf(buf, sizeof buf, "topk density=%g %.*s/%.*s %s", plan.density,
                  static_cast<int>(format.size()), format.data(),
                  static_cast<int>(kernels::value_type_name(plan.value_type).size()),
                  kernels::value_type_name(plan.value_type).data(), collective);
  }
  return buf;
}

}  // namespace sparsecar::policies
