// Issue 3's selectors through the real pipeline over the FakeNetwork on W = 2..4: every node's
// result must equal the mean of the selections computed independently here (error feedback
// kept in this test's own residuals, selection by the kernel functions the kernel tests check
// against plain references), and be bit-identical across nodes.
#include <gtest/gtest.h>

#include <cmath>
#include <condition_variable>
#include <map>
#include <mutex>
#include <random>

#include "daemon/collective/mailbox.h"
#include "daemon/pipeline/pipeline.h"
#include "sparsecar/kernels/select.h"
#include "tests/unit/daemon/fake_transport.h"
#include "tests/unit/daemon/step_results.h"

namespace sparsecar {
namespace {

using namespace std::chrono_literals;
using kernels::Selector;

using Results = fakes::StepResults;

struct Node {
  std::unique_ptr<Mailbox> mailbox;
  std::unique_ptr<Pipeline> pipeline;
  Results results;
};

struct Job {
  Job(uint32_t world, const PipelineOptions& base) : net(world) {
    for (uint32_t r = 0; r < world; ++r) {
      auto& n = nodes.emplace_back(std::make_unique<Node>());
      PipelineOptions o = base;
      o.rank = r;
      o.world_size = world;
      o.agreed_knobs = "selectors-test";
      n->mailbox = std::make_unique<Mailbox>(o.job_id, world, nullptr);
      net.attach(r, n->mailbox.get());
      n->pipeline = std::make_unique<Pipeline>(o, net.transport(r), n->mailbox.get(), nullptr);
      n->pipeline->set_result_sink(&n->results);
      n->pipeline->start();
    }
  }
  ~Job() {
    for (auto& n : nodes) n->pipeline->stop();
  }
  std::vector<std::unique_ptr<Node>> nodes;  // destroyed after `net` stops delivering
  fakes::FakeNetwork net;
};

std::vector<float> normal(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

struct Case {
  Selector selector;
  uint32_t world;
};

class SelectorPipelineTest : public ::testing::TestWithParam<Case> {};

TEST_P(SelectorPipelineTest, ResultIsTheMeanOfIndependentSelections) {
  const Case c = GetParam();
  const size_t n = 3000;
  PipelineOptions o;
  o.settings.compression = true;
  o.settings.selector = c.selector;
  o.settings.params.density = 0.02;
  o.settings.params.quantile = 0.98;
  o.settings.params.approx_tolerance = 0.05;
  o.settings.params.seed = 77;  // the random_seed knob
  o.settings.format = kernels::Format::kCoo;
  o.step_timeout = 5000ms;
  o.join_timeout = 5000ms;
  Job job(c.world, o);
  for (auto& node : job.nodes) ASSERT_TRUE(node->pipeline->register_tensor(0, {"w", n}).ok());

  std::vector<std::vector<float>> residual(c.world, std::vector<float>(n, 0.0f));
  std::vector<std::byte> scratch(kernels::topk_scratch_bytes(n));
  std::vector<uint32_t> index(n);
  std::vector<float> value(n);
  const size_t k = kernels::topk_count(n, 0.02);
  for (uint64_t step = 0; step < 4; ++step) {
    std::vector<std::vector<float>> in, out(c.world, std::vector<float>(n, std::nanf("")));
    for (uint32_t r = 0; r < c.world; ++r) in.push_back(normal(n, 1000 * step + r));
    std::vector<double> expected(n, 0.0);
    std::vector<size_t> nnz(c.world);
    const uint64_t seed = kernels::derive_seed(77, 0, step);
    for (uint32_t r = 0; r < c.world; ++r) {
      auto& res = residual[r];
      float lambda = 0;
      if (c.selector == Selector::kPercentile) lambda = kernels::magnitude_quantile(res, 0.98, scratch, in[r]);
      for (size_t i = 0; i < n; ++i) res[i] += in[r][i];
      size_t m = 0;
      switch (c.selector) {
        case Selector::kTopkApprox:
          m = *kernels::topk_approx(res, k, 0.05, scratch, index.data(), value.data(), n);
          break;
        case Selector::kPercentile:
          m = kernels::threshold_select(res, lambda, index.data(), value.data(), n);
          break;
        case Selector::kRandomk:
          m = kernels::randomk_select(res, 0.02, seed, false, index.data(), value.data(), n);
          break;
        case Selector::kImportance:
          m = kernels::importance_select(res, k, seed, false, index.data(), value.data(), n);
          break;
        default:
          FAIL();
      }
      nnz[r] = m;
      for (size_t j = 0; j < m; ++j) {
        expected[index[j]] += value[j];
        res[index[j]] = 0.0f;
      }
    }
    for (uint32_t r = 0; r < c.world; ++r) {
      StepJob j;
      j.tensor_id = 0;
      j.step = step;
      j.local_sum = in[r];
      j.result = out[r];
      job.nodes[r]->pipeline->submit(j);
    }
    for (uint32_t r = 0; r < c.world; ++r) {
      const StepResult res = job.nodes[r]->results.wait(0, step);
      ASSERT_TRUE(res.status.ok()) << res.status.to_string();
      EXPECT_EQ(res.nnz, nnz[r]) << "rank " << r;
      EXPECT_EQ(out[r], out[0]) << "rank " << r << " differs from rank 0";
    }
    for (size_t i = 0; i < n; ++i) {
      const double want = expected[i] / c.world;
      ASSERT_NEAR(out[0][i], want, 1e-6 * std::fabs(want) + 1e-7) << "step " << step << " element " << i;
    }
  }
}

std::vector<Case> cases() {
  std::vector<Case> out;
  for (Selector s : {Selector::kTopkApprox, Selector::kPercentile, Selector::kRandomk, Selector::kImportance}) {
    for (uint32_t w : {2u, 3u, 4u}) out.push_back({s, w});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(Selectors, SelectorPipelineTest, ::testing::ValuesIn(cases()),
                         [](const auto& param_info) {
                           return std::string(kernels::selector_name(param_info.param.selector)) + "_W" +
                                  std::to_string(param_info.param.world);
                         });

}  // namespace
}  // namespace sparsecar
