// TensorCompressor's selection + error compensation against independent references: EF
// conservation for every selector (float64, with a bound derived from float rounding), DGC
// momentum correction against the update rule in float64, clipping, LR-scaled residuals,
// unbiased sends without EF, and per-tensor overrides in the static plan.
#include "daemon/pipeline/compressor.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>

#include "sparsecar/kernels/codec.h"
#include "sparsecar/kernels/parallel.h"
#include "sparsecar/kernels/select.h"
#include "sparsecar/kernels/selectors.h"
#include "sparsecar/policies/plan.h"

namespace sparsecar {
namespace {

using kernels::Selector;
using policies::ErrorFeedback;

std::vector<float> normal(size_t n, uint64_t seed, float sigma = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, sigma);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

policies::Plan sparse_plan(Selector s) {
  policies::Plan p;
  p.dense = false;
  p.selector = s;
  p.params.density = 0.02;
  p.params.threshold = 2.0f;
  p.params.quantile = 0.97;
  p.params.approx_tolerance = 0.1;
  p.format = kernels::Format::kCoo;
  p.value_type = kernels::ValueType::kF32;
  p.collective = policies::Collective::kSparseAllGather;
  return p;
}

// What the receivers get from one compressed step, as float64.
std::vector<double> decode(const TensorCompressor::Encoded& e, size_t n) {
  std::vector<float> out(n, 0.0f);
  const Status s = kernels::decode_accumulate(e.format, e.value_type, e.payload, e.nnz, out);
  EXPECT_TRUE(s.ok()) << s.to_string();
  return std::vector<double>(out.begin(), out.end());
}

// The float64 reference of a DGC momentum-correction sparse step: what `e` sent must be the k
// largest |v|, which then leave v and u (momentum-factor masking).
void expect_momentum_topk_sent(const TensorCompressor::Encoded& e, std::vector<double>& u, std::vector<double>& v,
                               size_t k, double tolerance, uint64_t step) {
  const size_t n = v.size();
  std::vector<uint32_t> order(n);
  std::iota(order.begin(), order.end(), 0u);
  std::partial_sort(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(),
                    [&](uint32_t a, uint32_t b) { return std::fabs(v[a]) > std::fabs(v[b]); });
  const auto got = decode(e, n);
  for (size_t j = 0; j < k; ++j) {
    const uint32_t i = order[j];
    ASSERT_NEAR(got[i], v[i], tolerance * (1 + std::fabs(v[i]))) << "step " << step << " element " << i;
    u[i] = v[i] = 0.0;
  }
}

// Every selector of the registry (kernels/selectors.h), so a new row is covered here unasked.
std::vector<Selector> all_selectors() {
  std::vector<Selector> all;
  for (const kernels::SelectorInfo& row : kernels::selector_registry()) {
    if (row.cpu != nullptr) all.push_back(row.id);
  }
  return all;
}

class ConservationTest : public ::testing::TestWithParam<Selector> {};

// sum over steps of what was sent + the final residual == sum of the gradients. Each step adds
// g into the residual with one float rounding (|error| <= 2^-24 |r + g|) and takes the selection
// out exactly (cleared) or with one more rounding (subtracted): the bound per element is
// sum_t 2^-23 (|r_t| + |g_t|), accumulated alongside.
TEST_P(ConservationTest, SentPlusResidualEqualsSumOfGradients) {
  const size_t n = 3000;
  TensorCompressor c(0, TensorSpec{"w", n});
  policies::Plan plan = sparse_plan(GetParam());
  std::vector<double> sent(n, 0.0), grads(n, 0.0), bound(n, 0.0);
  for (uint64_t step = 0; step < 60; ++step) {
    plan.params.seed = kernels::derive_seed(5, 0, step);
    const auto g = normal(n, 100 + step);
    const std::vector<float> before(c.residual().begin(), c.residual().end());
    auto e = c.compress(plan, g);
    ASSERT_TRUE(e.ok()) << e.status().to_string();
    c.commit();
    const auto got = decode(*e, n);
    for (size_t i = 0; i < n; ++i) {
      sent[i] += got[i];
      grads[i] += g[i];
      bound[i] += std::ldexp(std::fabs(before[i]) + std::fabs(g[i]) + std::fabs(got[i]), -23);
    }
    if (GetParam() == Selector::kTopk) {
      EXPECT_EQ(e->nnz, kernels::topk_count(n, plan.params.density));  // COO: the header nnz is the count
    }
  }
  for (size_t i = 0; i < n; ++i) {
    ASSERT_LE(std::fabs(sent[i] + c.residual()[i] - grads[i]), bound[i] + 1e-30) << "element " << i;
  }
}

// kernel_threads: a compressor given a pool sends the same bytes and keeps the same residual as
// one without, step after step (the kernels split tensors of 256 Ki+ elements per thread).
TEST_P(ConservationTest, ThreadPoolChangesNothing) {
  const size_t n = 3 * kernels::kParallelMinElements + 100;
  kernels::ThreadPool pool(3);
  TensorCompressor serial(0, TensorSpec{"w", n});
  TensorCompressor parallel(0, TensorSpec{"w", n}, &pool);
  policies::Plan plan = sparse_plan(GetParam());
  for (uint64_t step = 0; step < 3; ++step) {
    plan.params.seed = kernels::derive_seed(5, 0, step);
    const auto g = normal(n, 300 + step);
    auto a = serial.compress(plan, g);
    auto b = parallel.compress(plan, g);
    ASSERT_TRUE(a.ok() && b.ok());
    ASSERT_EQ(a->nnz, b->nnz) << "step " << step;
    ASSERT_TRUE(std::equal(a->payload.begin(), a->payload.end(), b->payload.begin(), b->payload.end()))
        << "step " << step;
    serial.commit();
    parallel.commit();
    ASSERT_TRUE(std::equal(serial.residual().begin(), serial.residual().end(), parallel.residual().begin()));
  }
}

TEST_P(ConservationTest, RollbackPutsEverythingBack) {
  const size_t n = 2000;
  TensorCompressor c(0, TensorSpec{"w", n});
  policies::Plan plan = sparse_plan(GetParam());
  const auto g1 = normal(n, 1);
  ASSERT_TRUE(c.compress(plan, g1).ok());
  c.commit();
  const std::vector<float> before(c.residual().begin(), c.residual().end());
  const auto g2 = normal(n, 2);
  ASSERT_TRUE(c.compress(plan, g2).ok());
  c.rollback();
  for (size_t i = 0; i < n; ++i) {
    const double want = static_cast<double>(before[i]) + g2[i];
    ASSERT_NEAR(c.residual()[i], want, 1e-5 * (1 + std::fabs(want))) << i;
  }
}

INSTANTIATE_TEST_SUITE_P(Selectors, ConservationTest, ::testing::ValuesIn(all_selectors()),
                         [](const auto& param_info) {
                           return std::string(kernels::selector_name(param_info.param));
                         });

TEST(CompressorTest, MomentumCorrectionFollowsTheFloat64Rule) {
  const size_t n = 2000;
  const size_t k = 40;
  TensorCompressor c(0, TensorSpec{"w", n});
  policies::Plan plan = sparse_plan(Selector::kTopk);
  plan.params.density = static_cast<double>(k) / n;
  plan.error_feedback = ErrorFeedback::kMomentum;
  plan.momentum = 0.9f;
  std::vector<double> u(n, 0.0), v(n, 0.0);
  for (uint64_t step = 0; step < 30; ++step) {
    const auto g = normal(n, 300 + step);
    for (size_t i = 0; i < n; ++i) {
      u[i] = 0.9 * u[i] + g[i];
      v[i] += u[i];
    }
    auto e = c.compress(plan, g);
    ASSERT_TRUE(e.ok());
    c.commit();
    ASSERT_NO_FATAL_FAILURE(expect_momentum_topk_sent(*e, u, v, k, 1e-4, step));
    for (size_t i = 0; i < n; ++i) {
      ASSERT_NEAR(c.residual()[i], v[i], 1e-4 * (1 + std::fabs(v[i]))) << i;
      ASSERT_NEAR(c.velocity()[i], u[i], 1e-4 * (1 + std::fabs(u[i]))) << i;
    }
  }
}

TEST(CompressorTest, ClippingScalesTheGradientToTheNorm) {
  const size_t n = 1000;
  TensorCompressor c(0, TensorSpec{"w", n});
  policies::Plan plan = sparse_plan(Selector::kThreshold);
  plan.params.threshold = 1e30f;  // send nothing: the residual is the clipped gradient
  plan.clip_norm = 2.0f;
  const auto g = normal(n, 9);
  ASSERT_TRUE(c.compress(plan, g).ok());
  c.commit();
  double norm = 0;
  for (float r : c.residual()) norm += static_cast<double>(r) * r;
  EXPECT_NEAR(std::sqrt(norm), 2.0, 1e-5);
  double dot = 0;
  for (size_t i = 0; i < n; ++i) dot += static_cast<double>(c.residual()[i]) * g[i];
  EXPECT_GT(dot, 0);  // same direction
}

TEST(CompressorTest, ResidualFollowsTheLearningRate) {
  const size_t n = 500;
  for (auto mode : {policies::LrRescale::kNewOverOld, policies::LrRescale::kOldOverNew,
                    policies::LrRescale::kOff}) {
    TensorCompressor c(0, TensorSpec{"w", n});
    policies::Plan plan = sparse_plan(Selector::kThreshold);
    plan.params.threshold = 1e30f;
    plan.lr_rescale = mode;
    const auto g = normal(n, 4);
    ASSERT_TRUE(c.compress(plan, g, 0.1f).ok());
    c.commit();
    const std::vector<float> zero(n, 0.0f);
    ASSERT_TRUE(c.compress(plan, zero, 0.01f).ok());  // lr drops 10x
    c.commit();
    const double factor = mode == policies::LrRescale::kNewOverOld   ? 0.1
                          : mode == policies::LrRescale::kOldOverNew ? 10.0
                                                                     : 1.0;
    for (size_t i = 0; i < n; ++i) ASSERT_NEAR(c.residual()[i], g[i] * factor, 1e-5 * std::fabs(g[i] * factor));
  }
}

TEST(CompressorTest, WithoutErrorFeedbackRandomkIsUnbiasedAndNothingIsKept) {
  const size_t n = 400;
  const auto g = normal(n, 8);
  policies::Plan plan = sparse_plan(Selector::kRandomk);
  plan.params.density = 0.1;
  plan.error_feedback = ErrorFeedback::kOff;
  std::vector<double> mean(n, 0.0);
  const int draws = 3000;
  TensorCompressor c(0, TensorSpec{"w", n});
  for (int d = 0; d < draws; ++d) {
    plan.params.seed = kernels::derive_seed(1, 0, static_cast<uint64_t>(d));
    auto e = c.compress(plan, g);
    ASSERT_TRUE(e.ok());
    c.commit();
    for (float r : c.residual()) ASSERT_EQ(r, 0.0f);
    const auto got = decode(*e, n);
    for (size_t i = 0; i < n; ++i) mean[i] += got[i] / draws;
  }
  for (size_t i = 0; i < n; ++i) {
    const double sigma = std::fabs(g[i]) * std::sqrt((1 - 0.1) / 0.1 / draws);
    ASSERT_NEAR(mean[i], g[i], 5 * sigma + 1e-6) << i;
  }
}

// error_feedback = momentum through dense and sparse steps against the rule in float64: u = m u + g,
// v += u; a dense step sends v and clears it, and the first dense step after sparse ones also
// restarts u (every coordinate went out with what it held back); later dense steps keep u, so a
// dense phase is SGD with momentum; a sparse step sends top-k of |v| and clears u, v there.
TEST(CompressorTest, MomentumDenseStepsKeepTheVelocityExceptTheFirstAfterSparseOnes) {
  const size_t n = 200;
  const size_t k = 10;
  const double m = 0.5;
  TensorCompressor c(0, TensorSpec{"w", n});
  policies::Plan dense;  // dense
  dense.error_feedback = ErrorFeedback::kMomentum;
  dense.momentum = static_cast<float>(m);
  policies::Plan sparse = sparse_plan(Selector::kTopk);
  sparse.params.density = static_cast<double>(k) / n;
  sparse.error_feedback = ErrorFeedback::kMomentum;
  sparse.momentum = static_cast<float>(m);
  std::vector<double> u(n, 0.0), v(n, 0.0);
  bool sparse_before = false;
  const bool is_dense[] = {true, true, false, false, false, true, true, false, true};
  for (size_t step = 0; step < std::size(is_dense); ++step) {
    const auto g = normal(n, 700 + step);
    for (size_t i = 0; i < n; ++i) {
      u[i] = m * u[i] + g[i];
      v[i] += u[i];
    }
    if (is_dense[step]) {
      auto work = c.dense_input(g, dense, 0.0f);
      for (size_t i = 0; i < n; ++i) ASSERT_NEAR(work[i], v[i], 1e-5 * (1 + std::fabs(v[i]))) << step << " " << i;
      c.commit();
      std::fill(v.begin(), v.end(), 0.0);
      if (sparse_before) std::fill(u.begin(), u.end(), 0.0);
      sparse_before = false;
    } else {
      auto e = c.compress(sparse, g);
      ASSERT_TRUE(e.ok());
      c.commit();
      ASSERT_NO_FATAL_FAILURE(expect_momentum_topk_sent(*e, u, v, k, 1e-5, step));
      sparse_before = true;
    }
    for (size_t i = 0; i < n; ++i) {
      ASSERT_NEAR(c.residual()[i], v[i], 1e-5 * (1 + std::fabs(v[i]))) << step << " " << i;
      ASSERT_NEAR(c.velocity()[i], u[i], 1e-5 * (1 + std::fabs(u[i]))) << step << " " << i;
    }
  }
}

TEST(OverridesTest, ParseMatchAndApplyInOrder) {
  auto rules = policies::parse_tensor_overrides(
      " embed*: selector=randomk, density=0.001 ; *.bias: compression=off; embed.pos*: density=0.5 ");
  ASSERT_TRUE(rules.ok()) << rules.status().to_string();
  ASSERT_EQ(rules->size(), 3u);
  policies::StaticSettings s;
  s.selector = Selector::kTopk;
  s.params.density = 0.01;
  s.overrides = *rules;
  policies::TensorObservation o;
  o.name = "embed.tok";
  auto p = policies::static_plan(s, o);
  EXPECT_EQ(p.selector, Selector::kRandomk);
  EXPECT_EQ(p.params.density, 0.001);
  o.name = "embed.pos_table";  // both embed rules: the later density wins
  p = policies::static_plan(s, o);
  EXPECT_EQ(p.selector, Selector::kRandomk);
  EXPECT_EQ(p.params.density, 0.5);
  o.name = "fc1.bias";
  EXPECT_TRUE(policies::static_plan(s, o).dense);
  o.name = "fc1.weight";
  p = policies::static_plan(s, o);
  EXPECT_EQ(p.selector, Selector::kTopk);
  EXPECT_EQ(p.params.density, 0.01);
  // Seeds differ per tensor and step, are the same for the same (tensor, step).
  o.tensor_id = 3;
  o.step = 7;
  EXPECT_EQ(policies::static_plan(s, o).params.seed, kernels::derive_seed(0, 3, 7));
  for (const char* bad : {"x", "a*: density=2", "a*: selector=nope", "a*: colour=red", ": density=0.1",
                          "a*: density"}) {
    EXPECT_FALSE(policies::parse_tensor_overrides(bad).ok()) << bad;
  }
  EXPECT_TRUE(policies::glob_match("*", ""));
  EXPECT_TRUE(policies::glob_match("a?c*", "abcdef"));
  EXPECT_FALSE(policies::glob_match("a?c", "abcd"));
  EXPECT_TRUE(policies::glob_match("*.weight", "layer.0.weight"));
}

}  // namespace
}  // namespace sparsecar
