#include <cstdio>

#include "sparsecar/policies/plan.h"

namespace sparsecar::policies {

Plan static_plan(const StaticSettings& settings, const TensorObservation& /*observation*/) {
  Plan plan;
  if (!settings.compression || settings.selector == kernels::Selector::kNone) {
    return plan;  // dense ring all-reduce
  }
  plan.dense = false;
  plan.selector = settings.selector;
  plan.density = settings.density;
  plan.threshold = static_cast<float>(settings.threshold);
  plan.format = kernels::Format::kCoo;
  plan.collective = Collective::kSparseAllGather;
  return plan;
}

std::string describe(const Plan& plan) {
  if (plan.dense) return "dense ring-allreduce";
  char buf[160];
  const char* collective = plan.collective == Collective::kSparseAllGather ? "sparse-allgather" : "ring";
  if (plan.selector == kernels::Selector::kThreshold) {
    std::snprintf(buf, sizeof buf, "threshold lambda=%g %.*s/%.*s %s", static_cast<double>(plan.threshold),
                  static_cast<int>(kernels::format_name(plan.format).size()), kernels::format_name(plan.format).data(),
                  static_cast<int>(kernels::value_type_name(plan.value_type).size()),
                  kernels::value_type_name(plan.value_type).data(), collective);
  } else {
    std::snprintf(buf, sizeof buf, "topk density=%g %.*s/%.*s %s", plan.density,
                  static_cast<int>(kernels::format_name(plan.format).size()), kernels::format_name(plan.format).data(),
                  static_cast<int>(kernels::value_type_name(plan.value_type).size()),
                  kernels::value_type_name(plan.value_type).data(), collective);
  }
  return buf;
}

}  // namespace sparsecar::policies
