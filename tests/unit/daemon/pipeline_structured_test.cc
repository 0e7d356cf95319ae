// Shapes and structured selectors through the pipeline over the in-process FakeNetwork: shape
// validation at registration, nodes that disagree on a shape at the first step, and (below)
// every structured selector end to end against references computed here.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <limits>
#include <cmath>
#include <condition_variable>
#include <map>
#include <mutex>
#include <numeric>
#include <random>

#include "daemon/collective/mailbox.h"
#include "daemon/pipeline/compressor.h"
#include "daemon/pipeline/pipeline.h"
#include "daemon/pipeline/structured_select.h"
#include "sparsecar/kernels/codec.h"
#include "sparsecar/kernels/select.h"
#include "tests/unit/daemon/fake_transport.h"
#include "tests/unit/daemon/pipeline_job.h"
#include "tests/unit/daemon/step_results.h"

namespace sparsecar {
namespace {

using namespace std::chrono_literals;
using fakes::FakeNetwork;

using Results = fakes::StepResults;

using Node = fakes::PipelineNode;
using Job = fakes::PipelineJob;
using fakes::random_vector;
using fakes::run_step;

PipelineOptions options(kernels::Selector selector, double density) {
  PipelineOptions o;
  o.settings.compression = true;
  o.settings.selector = selector;
  o.settings.params.density = density;
  o.step_timeout = 5000ms;
  o.join_timeout = 5000ms;
  return o;
}

TEST(PipelineShape, RegistrationValidatesTheShape) {
  Job job(1, options(kernels::Selector::kTopk, 0.1));
  Pipeline& p = *job.nodes[0]->pipeline;
  auto bad = p.register_tensor(0, TensorSpec{"w", 12, {3, 5}});
  EXPECT_EQ(bad.code(), Code::kInvalidArgument);
  EXPECT_NE(bad.message().find("holds 15 elements, not 12"), std::string::npos) << bad.message();
  bad = p.register_tensor(0, TensorSpec{"w", 32, {2, 2, 2, 2, 2}});
  EXPECT_EQ(bad.code(), Code::kInvalidArgument);
  EXPECT_NE(bad.message().find("at most 4"), std::string::npos) << bad.message();
  bad = p.register_tensor(0, TensorSpec{"w", 12, {12, 0}});
  EXPECT_EQ(bad.code(), Code::kInvalidArgument);
  EXPECT_TRUE(p.register_tensor(0, TensorSpec{"w", 12, {3, 4}}).ok());
  EXPECT_TRUE(p.register_tensor(1, TensorSpec{"b", 3, {}}).ok());
}

TEST(PipelineShape, NodesThatDisagreeOnAShapeFailTheFirstStepEverywhere) {
  struct Case {
    std::vector<uint64_t> rank0, rank1;
    const char* rank0_says;
    const char* rank1_says;
  };
  const Case cases[] = {
      {{3, 4}, {4, 3}, "shape=3x4", "shape=4x3"},
      {{3, 4}, {}, "shape=3x4", "shape=none"},
      {{2, 2, 3}, {2, 6}, "shape=2x2x3", "shape=2x6"},
  };
  for (const Case& c : cases) {
    Job job(2, options(kernels::Selector::kTopk, 0.25));
    ASSERT_TRUE(job.nodes[0]->pipeline->register_tensor(0, TensorSpec{"w", 12, c.rank0}).ok());
    ASSERT_TRUE(job.nodes[1]->pipeline->register_tensor(0, TensorSpec{"w", 12, c.rank1}).ok());
    std::vector<std::vector<float>> in = {random_vector(12, 1), random_vector(12, 2)}, out;
    auto results = run_step(job, 0, 0, in, out);
    for (uint32_t r = 0; r < 2; ++r) {
      EXPECT_EQ(results[r].status.code(), Code::kFailedPrecondition) << results[r].status.to_string();
      EXPECT_NE(results[r].status.message().find(c.rank0_says), std::string::npos) << results[r].status.message();
      EXPECT_NE(results[r].status.message().find(c.rank1_says), std::string::npos) << results[r].status.message();
    }
  }
  // Agreeing shapes run.
  Job job(2, options(kernels::Selector::kTopk, 0.25));
  for (auto& n : job.nodes) ASSERT_TRUE(n->pipeline->register_tensor(0, TensorSpec{"w", 12, {3, 4}}).ok());
  std::vector<std::vector<float>> in = {random_vector(12, 1), random_vector(12, 2)}, out;
  auto results = run_step(job, 0, 0, in, out);
  for (auto& r : results) EXPECT_TRUE(r.status.ok()) << r.status.to_string();
}


// ---- structured selectors end to end ------------------------------------------------------------

// Reference groups of a selector for a tensor (the rules of structured_select.h); empty when the
// shape does not fit (then the reference is plain top-k).
std::vector<std::vector<size_t>> reference_groups(kernels::Selector sel, const TensorSpec& spec, uint32_t block,
                                                  uint32_t heads) {
  std::vector<std::vector<size_t>> g;
  const size_t n = spec.count;
  auto contiguous = [&](size_t size) {
    for (size_t b = 0; b < n; b += size) {
      auto& grp = g.emplace_back();
      for (size_t i = b; i < std::min(n, b + size); ++i) grp.push_back(i);
    }
  };
  const auto& s = spec.shape;
  switch (sel) {
    case kernels::Selector::kBlockTopk: contiguous(block); break;
    case kernels::Selector::kRowTopk: if (s.size() == 2) contiguous(s[1]); break;
    case kernels::Selector::kChannelTopk: if (s.size() == 4) contiguous(n / s[0]); break;
    case kernels::Selector::kHeadTopk: if (!s.empty() && s[0] % heads == 0) contiguous(n / heads); break;
    case kernels::Selector::kColumnTopk:
      if (s.size() == 2) {
        g.resize(s[1]);
        for (size_t i = 0; i < n; ++i) g[i % s[1]].push_back(i);
      }
      break;
    default: break;
  }
  return g;
}

std::vector<uint32_t> reference_select(const std::vector<float>& e, const std::vector<std::vector<size_t>>& groups,
                                       double density) {
  std::vector<uint32_t> out;
  if (groups.empty()) {  // plain top-k: (|x| desc, index asc)
    std::vector<uint32_t> idx(e.size());
    std::iota(idx.begin(), idx.end(), 0u);
    std::sort(idx.begin(), idx.end(), [&](uint32_t a, uint32_t b) {
      return std::fabs(e[a]) != std::fabs(e[b]) ? std::fabs(e[a]) > std::fabs(e[b]) : a < b;
    });
    idx.resize(kernels::topk_count(e.size(), density));
    std::sort(idx.begin(), idx.end());
    return idx;
  }
  std::vector<double> score(groups.size(), 0.0);
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t i : groups[g]) score[g] += double(e[i]) * double(e[i]);
  }
  std::vector<size_t> order(groups.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return score[a] != score[b] ? score[a] > score[b] : a < b; });
  order.resize(kernels::topk_count(groups.size(), density));
  for (size_t g : order) {
    for (size_t i : groups[g]) out.push_back(static_cast<uint32_t>(i));
  }
  std::sort(out.begin(), out.end());
  return out;
}

TEST(PipelineStructured, EverySelectorAveragesEachNodesReferenceSelection) {
  const std::vector<TensorSpec> specs = {
      {"fc.weight", 240, {24, 10}},        // rows / columns
      {"conv.weight", 144, {8, 2, 3, 3}},  // channels
      {"attn.qkv", 96, {16, 6}},           // 4 heads of 4 rows
      {"flat", 300, {}},                   // blocks of 32 with a ragged last one; others fall back
  };
  const uint32_t w = 2;
  for (kernels::Selector sel : {kernels::Selector::kBlockTopk, kernels::Selector::kRowTopk,
                                kernels::Selector::kColumnTopk, kernels::Selector::kChannelTopk,
                                kernels::Selector::kHeadTopk}) {
    SCOPED_TRACE(std::string(kernels::selector_name(sel)));
    PipelineOptions o = options(sel, 0.25);
    o.settings.params.block_size = 32;
    o.settings.params.heads = 4;
    Job job(w, o);
    for (auto& n : job.nodes) {
      for (uint32_t i = 0; i < specs.size(); ++i) ASSERT_TRUE(n->pipeline->register_tensor(i, specs[i]).ok());
    }
    std::vector<std::vector<std::vector<float>>> residual(specs.size());
    for (size_t t = 0; t < specs.size(); ++t) residual[t].assign(w, std::vector<float>(specs[t].count, 0.0f));
    for (uint64_t step = 0; step < 3; ++step) {
      for (uint32_t t = 0; t < specs.size(); ++t) {
        const size_t n = specs[t].count;
        std::vector<std::vector<float>> in, out;
        std::vector<double> expected(n, 0.0);
        for (uint32_t r = 0; r < w; ++r) {
          in.push_back(random_vector(n, 7000 + 100 * static_cast<uint32_t>(step) + 10 * t + r));
          auto& e = residual[t][r];
          for (size_t i = 0; i < n; ++i) e[i] += in[r][i];
          for (uint32_t i : reference_select(e, reference_groups(sel, specs[t], 32, 4), 0.25)) {
            expected[i] += e[i];
            e[i] = 0.0f;
          }
        }
        auto results = run_step(job, t, step, in, out);
        for (uint32_t r = 0; r < w; ++r) {
          ASSERT_TRUE(results[r].status.ok()) << results[r].status.to_string();
          ASSERT_EQ(out[r], out[0]);
        }
        for (size_t i = 0; i < n; ++i) {
          ASSERT_NEAR(out[0][i], expected[i] / w, 1e-6) << specs[t].name << " step " << step << " element " << i;
        }
      }
    }
  }
}

policies::Plan structured_plan(kernels::Selector sel, double density) {
  policies::Plan plan;
  plan.dense = false;
  plan.selector = sel;
  plan.params.density = density;
  plan.format = kernels::Format::kCoo;
  plan.collective = policies::Collective::kSparseAllGather;
  return plan;
}

// Compresses one step and returns the decoded selection; checks EF conservation on the way:
// residual_before + sum == residual_after + sent, element by element, exactly.
std::vector<float> compress_step(TensorCompressor& c, const policies::Plan& plan, const std::vector<float>& sum,
                                 std::vector<uint32_t>* selected = nullptr) {
  std::vector<float> before(c.residual().begin(), c.residual().end());
  for (size_t i = 0; i < sum.size(); ++i) before[i] += sum[i];
  auto e = c.compress(plan, sum);
  EXPECT_TRUE(e.ok()) << e.status().to_string();
  std::vector<float> sent(sum.size(), 0.0f);
  if (!e.ok()) return sent;
  EXPECT_TRUE(kernels::decode_accumulate(e->format, e->value_type, e->payload, e->nnz, sent).ok());
  c.commit();
  for (size_t i = 0; i < sum.size(); ++i) {
    const bool was_sent = c.residual()[i] == 0.0f && sent[i] != 0.0f;
    EXPECT_EQ(was_sent ? sent[i] : c.residual()[i], before[i]) << "element " << i;
    if (was_sent && selected) selected->push_back(static_cast<uint32_t>(i));
  }
  return sent;
}

TEST(PipelineStructured, PeriodicMaskIsTheTopkOfAccumulatedImportanceRecomputedEveryPeriod) {
  const TensorSpec spec{"w", 500, {}};
  TensorCompressor c(0, spec);
  policies::Plan plan = structured_plan(kernels::Selector::kPeriodicMask, 0.02);
  plan.params.mask_period = 4;
  std::vector<float> importance(spec.count, 0.0f);
  std::vector<uint32_t> mask;
  for (uint32_t step = 0; step < 13; ++step) {
    auto g = random_vector(spec.count, 9000 + step);
    for (size_t i = 0; i < g.size(); ++i) importance[i] += std::fabs(g[i]);
    if (step % 4 == 0) {  // steps 0, 4, 8, 12 recompute from |g| summed since the last mask
      mask = reference_select(importance, {}, 0.02);
      std::fill(importance.begin(), importance.end(), 0.0f);
    }
    std::vector<float> before(c.residual().begin(), c.residual().end());
    auto sent = compress_step(c, plan, g);
    ASSERT_EQ(std::vector<uint32_t>(c.structured().mask().begin(), c.structured().mask().end()), mask)
        << "step " << step;
    for (uint32_t i : mask) EXPECT_EQ(sent[i], before[i] + g[i]) << "step " << step;
  }
}

TEST(PipelineStructured, HybridSendsTopkPlusThePreviousStepsPooledThreshold) {
  const TensorSpec a{"a", 400, {}}, b{"b", 300, {20, 15}};
  TensorCompressor ca(0, a), cb(1, b);
  PooledThreshold pool;
  ca.structured().set_pool(&pool);
  cb.structured().set_pool(&pool);
  policies::Plan plan = structured_plan(kernels::Selector::kHybrid, 0.01);
  plan.params.hybrid_density = 0.05;
  std::vector<float> pooled;  // |e| of both tensors in the previous step, before selection
  for (uint32_t step = 0; step < 4; ++step) {
    float lambda = std::numeric_limits<float>::infinity();
    if (!pooled.empty()) {
      std::sort(pooled.begin(), pooled.end(), std::greater<float>());
      const size_t budget = static_cast<size_t>(std::ceil(0.05 * pooled.size()));
      lambda = std::bit_cast<float>(std::bit_cast<uint32_t>(pooled[budget - 1]) & ~0x7fffu);  // its bin's edge
    }
    pooled.clear();
    pool.begin_step(step, plan.params.hybrid_density);
    EXPECT_EQ(pool.lambda(), lambda) << "step " << step;
    for (TensorCompressor* c : {&ca, &cb}) {
      auto g = random_vector(c->spec().count, 9500 + 10 * step + c->id());
      std::vector<float> e(c->residual().begin(), c->residual().end());
      for (size_t i = 0; i < e.size(); ++i) {
        e[i] += g[i];
        pooled.push_back(std::fabs(e[i]));
      }
      std::vector<uint32_t> want = reference_select(e, {}, 0.01);
      for (size_t i = 0; i < e.size(); ++i) {
        if (std::fabs(e[i]) >= lambda) want.push_back(static_cast<uint32_t>(i));
      }
      std::sort(want.begin(), want.end());
      want.erase(std::unique(want.begin(), want.end()), want.end());
      std::vector<uint32_t> got;
      compress_step(*c, plan, g, &got);
      EXPECT_EQ(got, want) << "tensor " << c->spec().name << " step " << step;
      if (step > 0) {
        EXPECT_GT(got.size(), kernels::topk_count(e.size(), 0.01)) << "lambda adds coordinates";
      }
    }
  }
}

TEST(PipelineStructured, StructuredSelectorsConserveTheResidual) {
  const TensorSpec spec{"conv", 2 * 4 * 3 * 3 * 10, {20, 4, 3, 3}};
  for (kernels::Selector sel : {kernels::Selector::kBlockTopk, kernels::Selector::kRowTopk,
                                kernels::Selector::kColumnTopk, kernels::Selector::kChannelTopk,
                                kernels::Selector::kHeadTopk, kernels::Selector::kPeriodicMask,
                                kernels::Selector::kHybrid}) {
    SCOPED_TRACE(std::string(kernels::selector_name(sel)));
    TensorCompressor c(0, spec);
    PooledThreshold pool;
    c.structured().set_pool(&pool);
    policies::Plan plan = structured_plan(sel, 0.1);
    plan.params.heads = 5;
    plan.params.mask_period = 3;
    std::vector<double> in(spec.count, 0.0), out(spec.count, 0.0);
    for (uint32_t step = 0; step < 8; ++step) {
      pool.begin_step(step, plan.params.hybrid_density);
      auto g = random_vector(spec.count, 9900 + step);
      auto sent = compress_step(c, plan, g);
      for (size_t i = 0; i < g.size(); ++i) {
        in[i] += g[i];
        out[i] += sent[i];
      }
    }
    for (size_t i = 0; i < spec.count; ++i) ASSERT_NEAR(out[i] + c.residual()[i], in[i], 1e-4) << "element " << i;
  }
}

}  // namespace
}  // namespace sparsecar
