#include <cstdio>
#include <string>

#include "sparsecar/kernels/select.h"
#include "sparsecar/kernels/selectors.h"
#include "sparsecar/policies/plan.h"

namespace sparsecar::policies {

static Plan static_plan_base(const StaticSettings& settings, const TensorObservation& observation) {
  Plan plan;
  if (!settings.compression || settings.selector == kernels::Selector::kNone) {
    plan.collective = settings.dense_collective;
    return plan;  // dense
  }
  plan.dense = false;
  plan.selector = settings.selector;
  plan.format = settings.format;
  plan.auto_format = settings.auto_format;
  plan.value_type = settings.value_type;
  plan.rows = observation.rows == 0 ? 1 : observation.rows;
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
    for (const kernels::ParamInfo& p : kernels::kSelectorParams) {
      if (o.sets(p.param)) kernels::set_param(storage->params, p.param, kernels::get_param(o.params, p.param));
    }
    if (o.format) storage->format = *o.format;
    if (o.auto_format) storage->auto_format = *o.auto_format;
    if (o.value_type) storage->value_type = *o.value_type;
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
  plan.params = effective.params;
  plan.params.seed = kernels::derive_seed(effective.params.seed, observation.tensor_id, observation.step);
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

std::string_view dense_collective_name(Collective c) {
  switch (c) {
    case Collective::kRingAllReduce: return "ring";
    case Collective::kSparseAllGather: return "sparse-allgather";
    case Collective::kTrainerAllReduce: return "trainer";
  }
  return "unknown";
}

bool parse_dense_collective(std::string_view text, Collective* out) {
  for (Collective c : {Collective::kRingAllReduce, Collective::kTrainerAllReduce}) {
    if (text == dense_collective_name(c)) {
      *out = c;
      return true;
    }
  }
  return false;
}

std::string describe(const Plan& plan) {
  if (plan.dense) {
    return plan.collective == Collective::kTrainerAllReduce ? "dense trainer-allreduce" : "dense ring-allreduce";
  }
  char buf[160];
  const char* collective = plan.collective == Collective::kSparseAllGather ? "sparse-allgather" : "ring";
  const std::string_view format = plan.auto_format ? std::string_view("auto") : kernels::format_name(plan.format);
  const std::string_view vt = kernels::value_type_name(plan.value_type);
  if (plan.selector == kernels::Selector::kThreshold) {
    std::snprintf(buf, sizeof buf, "threshold lambda=%g %.*s/%.*s %s", plan.params.threshold,
                  static_cast<int>(format.size()), format.data(), static_cast<int>(vt.size()), vt.data(), collective);
  } else {
    // The selector's registry name (row_topk, randomk, ...), not "topk" for every one of them.
    const std::string_view name = kernels::selector_name(plan.selector);
    std::snprintf(buf, sizeof buf, "%.*s density=%g %.*s/%.*s %s", static_cast<int>(name.size()), name.data(),
                  plan.params.density, static_cast<int>(format.size()), format.data(), static_cast<int>(vt.size()),
                  vt.data(), collective);
  }
  return buf;
}

}  // namespace sparsecar::policies
