#include <cstdio>

#include "sparsecar/policies/plan.h"

namespace sparsecar::policies {

Plan static_plan(const StaticSettings& settings, const TensorObservation& observation) {
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
  plan.collective = Collective::kSparseAllGather;
  return plan;
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
