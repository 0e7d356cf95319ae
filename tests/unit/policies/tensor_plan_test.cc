// Per-tensor plans: schedules, layer-wise rules, per-tensor scales and bounds, as pure
// functions of (knobs, tensor, step).
#include <gtest/gtest.h>

#include <cmath>

#include "sparsecar/kernels/selectors.h"
#include "sparsecar/policies/plan.h"
#include "sparsecar/policies/tensor_plan.h"

namespace sparsecar::policies {
namespace {

PlanSettings topk(double density, ControllerSet active) {
  PlanSettings p;
  p.base.compression = true;
  p.base.selector = kernels::Selector::kTopk;
  p.base.params.density = density;
  p.active = active;
  return p;
}

TensorObservation tensor(uint64_t step, uint64_t elements = 1 << 20, std::string_view name = "fc.weight",
                         uint32_t id = 0) {
  TensorObservation o;
  o.tensor_id = id;
  o.elements = elements;
  o.step = step;
  o.world_size = 4;
  o.name = name;
  return o;
}

TEST(TensorPlanTest, ControllerListsParseAndPrintCanonically) {
  auto set = parse_controllers(" bandwidth, schedule ,static");
  ASSERT_TRUE(set.ok());
  EXPECT_TRUE(has(*set, ControllerKind::kBandwidth));
  EXPECT_TRUE(has(*set, ControllerKind::kSchedule));
  EXPECT_EQ(format_controllers(*set), "schedule,bandwidth");
  EXPECT_EQ(format_controllers(*parse_controllers("static")), "static");
  EXPECT_EQ(*parse_controllers(""), 0u);
  auto bad = parse_controllers("schedule,magic");
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.status().message().find("magic"), std::string::npos);
}

TEST(TensorPlanTest, StaticAloneIsExactlyTheStaticPolicy) {
  PlanSettings p = topk(0.7, 0);  // even a density the plan controllers would send dense
  p.density_cap = 1e-3;           // and a cap: ignored by the static policy
  Plan plan = plan_tensor(p, tensor(5));
  EXPECT_FALSE(plan.dense);
  EXPECT_EQ(plan.params.density, 0.7);
}

TEST(TensorPlanTest, WarmupRampAndPeriodicDense) {
  PlanSettings p = topk(0.001, bit(ControllerKind::kSchedule));
  p.schedule.warmup_steps = 3;
  p.schedule.ramp_steps = 4;
  p.schedule.start_density = 0.25;
  p.schedule.dense_every = 10;
  for (uint64_t s = 0; s < 3; ++s) EXPECT_TRUE(plan_tensor(p, tensor(s)).dense) << s;
  // Geometric 0.25 -> 0.001 over 4 steps: 0.25, 0.0628, 0.0158, 0.00397, then 0.001.
  const double expect[] = {0.25, 0.25 * std::pow(0.004, 0.25), 0.25 * std::pow(0.004, 0.5),
                           0.25 * std::pow(0.004, 0.75), 0.001, 0.001};
  for (uint64_t t = 0; t < 6; ++t) {
    Plan plan = plan_tensor(p, tensor(3 + t));
    ASSERT_FALSE(plan.dense) << t;
    EXPECT_NEAR(plan.params.density, expect[t], 1e-12) << t;
  }
  EXPECT_TRUE(plan_tensor(p, tensor(9)).dense) << "every 10th step is dense";
  EXPECT_TRUE(plan_tensor(p, tensor(19)).dense);
  EXPECT_FALSE(plan_tensor(p, tensor(20)).dense);
}

TEST(TensorPlanTest, DenseFromAKnownStepOnAndNotBefore) {
  PlanSettings p = topk(0.005, bit(ControllerKind::kSchedule));
  p.schedule.dense_from = 14;
  for (uint64_t s = 0; s < 14; ++s) {
    Plan plan = plan_tensor(p, tensor(s));
    ASSERT_FALSE(plan.dense) << s;
    EXPECT_EQ(plan.params.density, 0.005) << s;
  }
  for (uint64_t s : {14u, 15u, 1000u}) EXPECT_TRUE(plan_tensor(p, tensor(s)).dense) << s;
  p.schedule.dense_from = 0;  // off
  EXPECT_FALSE(plan_tensor(p, tensor(1000)).dense);
  p.schedule.dense_from = 14;  // the schedule's knobs act only with the schedule controller on
  p.active = 0;
  EXPECT_FALSE(plan_tensor(p, tensor(20)).dense);
}

TEST(TensorPlanTest, LinearDecayFrom99To90PercentSparsity) {
  PlanSettings p = topk(0.5, bit(ControllerKind::kSchedule));
  p.schedule.ramp_steps = 100;
  p.schedule.start_density = 0.01;
  p.schedule.end_density = 0.1;
  p.schedule.exponential = false;
  EXPECT_NEAR(plan_tensor(p, tensor(0)).params.density, 0.01, 1e-12);
  EXPECT_NEAR(plan_tensor(p, tensor(50)).params.density, 0.055, 1e-12);
  EXPECT_NEAR(plan_tensor(p, tensor(100)).params.density, 0.1, 1e-12);
  EXPECT_NEAR(plan_tensor(p, tensor(5000)).params.density, 0.1, 1e-12);
}

TEST(TensorPlanTest, LayerwiseBySizeKindAndSensitivityTable) {
  PlanSettings p = topk(0.01, bit(ControllerKind::kLayerwise));
  p.layerwise.dense_below = 4096;
  EXPECT_TRUE(plan_tensor(p, tensor(7, 512, "fc.bias")).dense) << "small tensors are dense";
  EXPECT_NEAR(plan_tensor(p, tensor(7, 100000, "ln_f.bias")).params.density, 0.1, 1e-12) << "norm/bias: light";
  EXPECT_NEAR(plan_tensor(p, tensor(7, 1 << 24, "tok_embed.weight")).params.density, 0.001, 1e-12) << "embedding: very sparse";
  EXPECT_NEAR(plan_tensor(p, tensor(7, 1 << 20, "fc.weight")).params.density, 0.01, 1e-12);

  auto rules = parse_sensitivity("attn:dense, fc:3 ,embed:0.5");
  ASSERT_TRUE(rules.ok());
  p.layerwise.rules = *rules;
  EXPECT_TRUE(plan_tensor(p, tensor(7, 1 << 20, "h0.attn.qkv")).dense);
  EXPECT_NEAR(plan_tensor(p, tensor(7, 1 << 20, "fc.weight")).params.density, 0.03, 1e-12);
  EXPECT_NEAR(plan_tensor(p, tensor(7, 1 << 24, "tok_embed.weight")).params.density, 0.005, 1e-12) << "table beats kind";
  EXPECT_FALSE(parse_sensitivity("fc").ok());
  EXPECT_FALSE(parse_sensitivity("fc:-1").ok());
  EXPECT_FALSE(parse_sensitivity("fc:x").ok());
}

TEST(TensorPlanTest, ScalesCapAndBounds) {
  PlanSettings p = topk(0.01, bit(ControllerKind::kFrequency) | bit(ControllerKind::kBandwidth));
  p.tensor_scale = {{1, 4.0}, {2, 0.25}};
  p.density_min = 0.004;
  EXPECT_NEAR(plan_tensor(p, tensor(1, 1 << 20, "a", 1)).params.density, 0.04, 1e-12);
  EXPECT_NEAR(plan_tensor(p, tensor(1, 1 << 20, "b", 2)).params.density, 0.004, 1e-12) << "floor: 0.0025 -> 0.004";
  p.density_cap = 0.02;
  EXPECT_NEAR(plan_tensor(p, tensor(1, 1 << 20, "a", 1)).params.density, 0.02, 1e-12) << "cap";
  p.density_cap = 0.001;  // a cap below the floor wins: the cap is the budget
  EXPECT_NEAR(plan_tensor(p, tensor(1, 1 << 20, "c", 3)).params.density, 0.001, 1e-12);
  p.density_cap = 1.0;
  p.tensor_scale = {{1, 60.0}};
  EXPECT_TRUE(plan_tensor(p, tensor(1, 1 << 20, "a", 1)).dense) << "0.6 >= dense_above";
}

TEST(TensorPlanTest, ThresholdSelectorScalesLambdaInversely) {
  PlanSettings p = topk(0.01, bit(ControllerKind::kFrequency));
  p.base.selector = kernels::Selector::kThreshold;
  p.base.params.threshold = 0.8;
  p.tensor_scale = {{0, 4.0}};
  Plan plan = plan_tensor(p, tensor(0));
  EXPECT_EQ(plan.selector, kernels::Selector::kThreshold);
  EXPECT_FLOAT_EQ(plan.params.threshold, 0.2f);
}

TEST(TensorPlanTest, CompressionOffStaysDense) {
  PlanSettings p = topk(0.01, bit(ControllerKind::kSchedule) | bit(ControllerKind::kLayerwise));
  p.base.compression = false;
  EXPECT_TRUE(plan_tensor(p, tensor(100)).dense);
}

TEST(TensorPlanTest, StepsTheControllersMakeDenseKeepTheErrorCompensation) {
  // The compressor clips, folds (EF variant) and rescales on dense steps too, so a dense plan
  // must carry the same error compensation as the static plan's (which compression=off keeps).
  PlanSettings p = topk(0.01, bit(ControllerKind::kSchedule) | bit(ControllerKind::kLayerwise) |
                                  bit(ControllerKind::kFrequency));
  p.base.error_feedback = ErrorFeedback::kMomentum;
  p.base.momentum = 0.5;
  p.base.clip_norm = 4.0;
  p.base.lr_rescale = LrRescale::kOldOverNew;
  p.schedule.warmup_steps = 3;
  p.layerwise.dense_below = 4096;
  p.tensor_scale = {{2, 100.0}};  // 0.01 x 100 >= dense_above
  const Plan plans[] = {plan_tensor(p, tensor(0)), plan_tensor(p, tensor(7, 512, "fc.bias")),
                        plan_tensor(p, tensor(7, 1 << 20, "fc.weight", 2)), plan_tensor(p, tensor(7))};
  for (size_t i = 0; i < 4; ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(plans[i].dense, i < 3);
    EXPECT_EQ(plans[i].error_feedback, ErrorFeedback::kMomentum);
    EXPECT_FLOAT_EQ(plans[i].momentum, 0.5f);
    EXPECT_FLOAT_EQ(plans[i].clip_norm, 4.0f);
    EXPECT_EQ(plans[i].lr_rescale, LrRescale::kOldOverNew);
  }
}

// dense_collective names who reduces every dense plan, the static one (compression off) and
// the controllers' (warm-up, small layers, a density past dense_above); sparse plans stay
// sparse all-gathers.
TEST(TensorPlanTest, EveryDensePlanCarriesTheDenseCollective) {
  PlanSettings p = topk(0.01, bit(ControllerKind::kSchedule) | bit(ControllerKind::kLayerwise) |
                                  bit(ControllerKind::kFrequency));
  p.schedule.warmup_steps = 3;
  p.layerwise.dense_below = 4096;
  p.tensor_scale = {{2, 100.0}};
  for (Collective c : {Collective::kRingAllReduce, Collective::kTrainerAllReduce}) {
    SCOPED_TRACE(std::string(dense_collective_name(c)));
    p.base.dense_collective = c;
    const Plan plans[] = {plan_tensor(p, tensor(0)), plan_tensor(p, tensor(7, 512, "fc.bias")),
                          plan_tensor(p, tensor(7, 1 << 20, "fc.weight", 2)), plan_tensor(p, tensor(7))};
    for (size_t i = 0; i < 4; ++i) {
      SCOPED_TRACE(i);
      ASSERT_EQ(plans[i].dense, i < 3);
      EXPECT_EQ(plans[i].collective, i < 3 ? c : Collective::kSparseAllGather);
    }
    PlanSettings off = p;
    off.base.compression = false;
    EXPECT_EQ(plan_tensor(off, tensor(7)).collective, c);
    EXPECT_EQ(static_plan(off.base, tensor(7)).collective, c);
    EXPECT_EQ(describe(plan_tensor(off, tensor(7))),
              c == Collective::kTrainerAllReduce ? "dense trainer-allreduce" : "dense ring-allreduce");
  }
  Collective parsed = Collective::kSparseAllGather;
  EXPECT_TRUE(parse_dense_collective("trainer", &parsed));
  EXPECT_EQ(parsed, Collective::kTrainerAllReduce);
  EXPECT_TRUE(parse_dense_collective("ring", &parsed));
  EXPECT_EQ(parsed, Collective::kRingAllReduce);
  EXPECT_FALSE(parse_dense_collective("sparse-allgather", &parsed));
  EXPECT_FALSE(parse_dense_collective("nccl", &parsed));
}

TEST(TensorPlanTest, TensorScalesRoundTrip) {
  TensorScales s{{0, 2.0}, {17, 0.7071}};
  auto back = parse_tensor_scales(format_tensor_scales(s));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, s);
  EXPECT_TRUE(parse_tensor_scales("").ok());
  EXPECT_FALSE(parse_tensor_scales("3").ok());
  EXPECT_FALSE(parse_tensor_scales("x:2").ok());
  EXPECT_FALSE(parse_tensor_scales("3:0").ok());
}

// Four digits of a scale just below DBL_MAX round up to "1.798e+308", which does not parse
// back (caught by the round-trip check of tests/fuzz/policy_lists_fuzz.cc).
TEST(TensorPlanTest, TensorScalesNearDoubleMaxRoundTrip) {
  TensorScales s{{0, 1.79769e308}, {1, 2.0}};
  const std::string text = format_tensor_scales(s);
  EXPECT_EQ(text.substr(text.find(',')), ",1:2");  // the usual four digits elsewhere
  auto back = parse_tensor_scales(text);
  ASSERT_TRUE(back.ok()) << text;
  EXPECT_EQ(*back, s);
}

}  // namespace
}  // namespace sparsecar::policies

// describe() names the plan's selector by its registry name (a row_topk override used to read
// "topk density=..." in sparsecarctl status), and a threshold plan by its lambda.
TEST(DescribePlan, NamesTheSelector) {
  sparsecar::policies::Plan plan;
  plan.dense = false;  // a default Plan is the dense ring
  plan.selector = sparsecar::kernels::Selector::kRowTopk;
  plan.params.density = 0.1;
  const std::string row = sparsecar::policies::describe(plan);
  EXPECT_EQ(row.rfind("row_topk density=0.1 ", 0), 0u) << row;
  plan.selector = sparsecar::kernels::Selector::kTopk;
  EXPECT_EQ(sparsecar::policies::describe(plan).rfind("topk density=0.1 ", 0), 0u);
  plan.selector = sparsecar::kernels::Selector::kThreshold;
  plan.params.threshold = 0.5;
  EXPECT_EQ(sparsecar::policies::describe(plan).rfind("threshold lambda=0.5 ", 0), 0u);
  plan.dense = true;
  EXPECT_EQ(sparsecar::policies::describe(plan), "dense ring-allreduce");
}
