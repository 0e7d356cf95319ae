// Pipeline + collectives + mailbox over the in-process FakeNetwork: results are checked against
// references computed independently here (float64 means, a sort-based top-k with the same error
// feedback), and every failure path must produce its documented error within its deadline.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <condition_variable>
#include <map>
#include <mutex>
#include <numeric>
#include <random>
#include <thread>

#include "daemon/collective/collective.h"
#include "daemon/collective/mailbox.h"
#include "daemon/config/knobs.h"
#include "daemon/metrics/metrics.h"
#include "daemon/pipeline/decisions.h"
#include "daemon/pipeline/observations.h"
#include "daemon/pipeline/pipeline.h"
#include "daemon/transport/wire.h"
#include "sparsecar/kernels/codec.h"
#include "tests/unit/common/fake_clock.h"
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

PipelineOptions options(bool compression, kernels::Selector selector, double density, double threshold = 1.0) {
  PipelineOptions o;
  o.settings.compression = compression;
  o.settings.selector = selector;
  o.settings.params.density = density;
  o.settings.params.threshold = threshold;
  o.step_timeout = 5000ms;
  o.join_timeout = 5000ms;
  return o;
}

// Runs one step of one tensor on every node; inputs[r] is node r's local sum.
void register_all(Job& job, const std::vector<TensorSpec>& specs) {
  for (auto& n : job.nodes) {
    for (uint32_t i = 0; i < specs.size(); ++i) ASSERT_TRUE(n->pipeline->register_tensor(i, specs[i]).ok());
  }
}

class DenseTest : public ::testing::TestWithParam<uint32_t> {};

TEST_P(DenseTest, CompressionOffGivesTheFloat64MeanOnEveryNodeBitIdentical) {
  const uint32_t w = GetParam();
  Job job(w, options(false, kernels::Selector::kTopk, 0.01));
  const size_t n = 1003;  // not a multiple of w: uneven ring chunks
  register_all(job, {{"w", n}});
  for (uint64_t step = 1; step <= 3; ++step) {
    std::vector<std::vector<float>> in;
    for (uint32_t r = 0; r < w; ++r) in.push_back(random_vector(n, 100 * static_cast<uint32_t>(step) + r));
    std::vector<std::vector<float>> out;
    auto results = run_step(job, 0, step, in, out);
    for (uint32_t r = 0; r < w; ++r) {
      ASSERT_TRUE(results[r].status.ok()) << results[r].status.to_string();
      EXPECT_EQ(results[r].nnz, n);
      EXPECT_EQ(results[r].bytes_sent, ring_allreduce_bytes(n, w, r));
      EXPECT_EQ(out[r], out[0]) << "rank " << r << " differs from rank 0";
    }
    for (size_t i = 0; i < n; ++i) {
      double sum = 0, abs_sum = 0;
      for (uint32_t r = 0; r < w; ++r) {
        sum += in[r][i];
        abs_sum += std::fabs(in[r][i]);
      }
      ASSERT_NEAR(out[0][i], sum / w, 1e-6 * abs_sum / w + 1e-30) << "element " << i;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, DenseTest, ::testing::Values(1u, 2u, 3u, 4u));

// dense_collective=trainer, every node's trainers reducing: the daemons send nothing, and each
// node hands each of its L trainers (local sum + residual) / L; the trainers' own all-reduce (a
// sum over all W * L of them, then / (W * L), done here in float64) gives the mean the ring gives.
// What the controllers are told of each tensor step: whether the trainers reduced it.
class TrainerReducedRecorder final : public StepObserver {
 public:
  void on_tensor_step(const TensorStepRecord& r, const Decision&) override {
    std::lock_guard<std::mutex> lock(mu);
    seen.push_back(r.trainer_reduced);
  }
  void on_metric(const std::string&, double, uint64_t) override {}
  void on_reset() override {}
  std::mutex mu;
  std::vector<bool> seen;
};

TEST(TrainerCollectiveTest, DenseStepsAreHandedToTheTrainersAsTheirShare) {
  const uint32_t w = 3, local = 2;
  PipelineOptions o = options(false, kernels::Selector::kTopk, 0.01);
  o.settings.dense_collective = policies::Collective::kTrainerAllReduce;
  o.local_clients = local;
  TrainerReducedRecorder recorder;  // outlives the job: the pipelines call it until they stop
  uint32_t node = 0;
  Job job(w, o, [&](Pipeline& p) {
    if (node++ == 1) p.set_observer(&recorder);
  });
  const size_t n = 257;
  register_all(job, {{"w", n}});
  for (uint64_t step = 0; step < 3; ++step) {
    std::vector<std::vector<float>> in, out;
    for (uint32_t r = 0; r < w; ++r) in.push_back(random_vector(n, 7 * static_cast<uint32_t>(step) + r));
    auto results = run_step(job, 0, step, in, out, std::vector<bool>(w, true));
    for (uint32_t r = 0; r < w; ++r) {
      ASSERT_TRUE(results[r].status.ok()) << results[r].status.to_string();
      EXPECT_TRUE(results[r].trainer_reduces);
      // What the trainers' all-reduce sends (the ring's bytes); the daemons sent nothing.
      EXPECT_EQ(results[r].bytes_sent, ring_allreduce_bytes(n, w, r));
      EXPECT_EQ(results[r].nnz, n);
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(out[r][i], in[r][i] * 0.5f) << "rank " << r << " element " << i;
    }
    for (size_t i = 0; i < n; ++i) {
      double trainers = 0, mean = 0;
      for (uint32_t r = 0; r < w; ++r) {
        trainers += local * static_cast<double>(out[r][i]);
        mean += in[r][i];
      }
      ASSERT_NEAR(trainers / (w * local), mean / (w * local), 1e-6) << "element " << i;
    }
  }
  // The step controller times such steps by their period (the daemons' exchange is not theirs).
  std::lock_guard<std::mutex> lock(recorder.mu);
  EXPECT_EQ(recorder.seen, std::vector<bool>(3, true));
}

// Error feedback through the trainers' share: top-k steps with a dense one every third step
// (the schedule controller), reduced by the trainers. The dense step hands over the residual the
// sparse ones left, so after it everything every node ever put in has been applied once:
// Σ_steps (what the trainers apply) * W * L = Σ_steps Σ_nodes input, in float64.
TEST(TrainerCollectiveTest, TheDenseShareCarriesTheResidualOfTheSparseSteps) {
  const uint32_t w = 2, local = 2;
  const size_t n = 300;
  Config c;
  c.compression = true;
  c.selector_params.density = 0.05;
  c.controller = "schedule";
  c.schedule_dense_every = 3;
  c.dense_collective = "trainer";
  PipelineOptions o;
  o.local_clients = local;
  o.step_timeout = 5000ms;
  o.join_timeout = 5000ms;
  Job job(w, o, {}, steady_clock(), &c);
  register_all(job, {{"w", n}});
  auto& nodes = job.nodes;
  std::vector<double> put_in(n, 0.0), applied(n, 0.0);
  for (uint64_t step = 0; step < 6; ++step) {  // steps 2 and 5 are dense
    std::vector<std::vector<float>> in, out(w, std::vector<float>(n, std::nanf("")));
    for (uint32_t r = 0; r < w; ++r) {
      in.push_back(random_vector(n, 31 * static_cast<uint32_t>(step) + r));
      StepJob j;
      j.tensor_id = 0;
      j.step = step;
      j.local_sum = in[r];
      j.result = out[r];
      j.trainer_reduces = true;
      nodes[r]->pipeline->submit(j);
    }
    std::vector<StepResult> results;
    for (uint32_t r = 0; r < w; ++r) results.push_back(nodes[r]->results.wait(0, step));
    const bool dense = (step + 1) % 3 == 0;
    for (uint32_t r = 0; r < w; ++r) {
      ASSERT_TRUE(results[r].status.ok()) << results[r].status.to_string();
      ASSERT_EQ(results[r].trainer_reduces, dense) << "step " << step;
    }
    for (size_t i = 0; i < n; ++i) {
      for (uint32_t r = 0; r < w; ++r) put_in[i] += in[r][i];
      // What every trainer applies: the average (sparse), or the trainers' sum of shares / (W L).
      double avg = out[0][i];
      if (dense) {
        avg = 0;
        for (uint32_t r = 0; r < w; ++r) avg += local * static_cast<double>(out[r][i]);
        avg /= w * local;
      }
      applied[i] += avg;
    }
    if (step == 1) {
      double missing = 0;
      for (size_t i = 0; i < n; ++i) missing += std::fabs(put_in[i] - applied[i] * w * local);
      EXPECT_GT(missing, 1.0) << "top-k 5 % left nothing in the residual: the check below would be empty";
    }
  }
  for (size_t i = 0; i < n; ++i) ASSERT_NEAR(applied[i] * w * local, put_in[i], 1e-4) << "element " << i;
}

// Leases: a trainer-reduced step tells how many of the next steps are trainer-reduced dense too
// under the decision in force (the schedule's warm-up: steps 0-11 dense here), at most
// trainer_lease (3) and 2^(n-1) for the n-th such step in a row; the trainers skip them, and the
// daemons take the next step they submit, whatever its number. Expected from the rule: step 0
// (1st) -> 1; step 2 (2nd) -> 2; step 5 (3rd) -> 3, the knob; step 9 (4th) -> 2, steps 10 and
// 11 (12 is sparse); step 12 -> none (sparse); step 15 -> none.
TEST(TrainerCollectiveTest, ALeaseCoversTheTrainerReducedStepsAheadAndTheNextStepMayComeAfterIt) {
  const uint32_t w = 2;
  const size_t n = 100;
  testing::FakeClock clock;  // 5 ms a step: an even pace (a slower one restarts the slow start)
  Config c;
  c.selector_params.density = 0.05;
  c.controller = "schedule";
  c.schedule_warmup_steps = 12;
  c.dense_collective = "trainer";
  c.trainer_lease = 3;
  PipelineOptions o;
  o.step_timeout = 5000ms;
  o.join_timeout = 5000ms;
  Job job(w, o, {}, clock, &c);
  register_all(job, {{"w", n}});
  auto& nodes = job.nodes;
  struct Want {
    uint64_t step;
    bool takes_lease;
    bool reduced;
    uint32_t lease;
  };
  uint64_t last = 0;
  for (const Want& want : {Want{0, true, true, 1}, Want{2, true, true, 2}, Want{5, true, true, 3},
                           Want{9, true, true, 2}, Want{12, true, false, 0}, Want{15, true, false, 0}}) {
    clock.advance(std::chrono::milliseconds(5 * (want.step - last)));
    last = want.step;
    std::vector<std::vector<float>> in, out(w, std::vector<float>(n, std::nanf("")));
    for (uint32_t r = 0; r < w; ++r) {
      in.push_back(random_vector(n, 13 * static_cast<uint32_t>(want.step) + r));
      StepJob j;
      j.tensor_id = 0;
      j.step = want.step;
      j.local_sum = in[r];
      j.result = out[r];
      j.trainer_reduces = true;
      j.takes_lease = want.takes_lease;
      nodes[r]->pipeline->submit(j);
    }
    for (uint32_t r = 0; r < w; ++r) {
      const StepResult res = nodes[r]->results.wait(0, want.step);
      ASSERT_TRUE(res.status.ok()) << "step " << want.step << ": " << res.status.to_string();
      EXPECT_EQ(res.trainer_reduces, want.reduced) << "step " << want.step;
      EXPECT_EQ(res.lease_steps, want.lease) << "step " << want.step;
      if (want.reduced) {
        for (size_t i = 0; i < n; ++i) ASSERT_EQ(out[r][i], in[r][i]) << "one trainer's share is the node's part";
      }
    }
  }
  // Skipped under a lease: 1 (0 -> 2), 2 (2 -> 5), 3 (5 -> 9), 2 (9 -> 12); 13-14 were not leased.
  for (auto& node : nodes) {
    const std::string text = node->metrics->scrape_text();
    EXPECT_NE(text.find(R"(sparsecar_steps_total{result="leased"} 8)"), std::string::npos) << text;
  }
}

// Compression off: every step is a trainer-reduced dense one, so the lease doubles from 1 with
// each step through the daemons up to the knob (steps 0, 2, 5, 10, 19: 1, 2, 4, 8, 8); none for
// trainers that do not take leases, none with the knob at 0 (without a decision board the
// pipeline's options hold the knob).
TEST(TrainerCollectiveTest, TheLeaseDoublesToTheKnobWhereEveryStepIsDenseAndNoneUnasked) {
  struct Case {
    uint64_t knob;
    bool takes_lease;
    std::vector<uint32_t> want;
  };
  for (const Case& c : {Case{8, true, {1, 2, 4, 8, 8}}, Case{8, false, {0, 0, 0, 0, 0}},
                        Case{0, true, {0, 0, 0, 0, 0}}}) {
    PipelineOptions o = options(false, kernels::Selector::kTopk, 0.01);
    o.settings.dense_collective = policies::Collective::kTrainerAllReduce;
    o.trainer_lease = c.knob;
    testing::FakeClock clock;  // still: no pace, so no restart of the slow start (the test after this one)
    Job job(2, o, {}, clock);
    register_all(job, {{"w", 64}});
    std::vector<std::vector<float>> in{random_vector(64, 1), random_vector(64, 2)}, out;
    uint64_t step = 0;
    for (uint32_t want : c.want) {
      for (const auto& r : run_step(job, 0, step, in, out, {true, true}, c.takes_lease)) {
        ASSERT_TRUE(r.status.ok()) << r.status.to_string();
        EXPECT_TRUE(r.trainer_reduces);
        EXPECT_EQ(r.lease_steps, want) << "knob " << c.knob << " takes " << c.takes_lease << " step " << step;
      }
      step += uint64_t{want} + 1;  // the trainers skip the lease
    }
  }
}

// The trainers' pace under leases (a fake clock, one node, every step trainer-reduced, knob 16):
// 5 ms a step while the lease doubles (steps 0, 2, 5, 10: leases 1, 2, 4, 8); then the trainers'
// steps take 20 ms each (their link slowed): step 19 comes 4x slower per step than the smoothed
// 5 ms, over the 2x that restarts the slow start, so it leases 1; step 21 (20 ms against the
// smoothed 8.75) again 1; step 23 (20 against 11.6) is not 2x slower: 2.
TEST(TrainerCollectiveTest, StepsThatGotSlowerUnderALeaseStartItAgainFromOne) {
  testing::FakeClock clock;
  PipelineOptions o = options(false, kernels::Selector::kTopk, 0.01);
  o.settings.dense_collective = policies::Collective::kTrainerAllReduce;
  o.trainer_lease = 16;
  Job job(1, o, {}, clock);
  register_all(job, {{"w", 64}});
  std::vector<std::vector<float>> in{random_vector(64, 1)}, out;
  struct Want {
    uint64_t step;
    double ms_per_step;  // the trainers' time per step since the last step seen
    uint32_t lease;
  };
  uint64_t last = 0;
  for (const Want& w : {Want{0, 0, 1}, Want{2, 5, 2}, Want{5, 5, 4}, Want{10, 5, 8}, Want{19, 20, 1},
                        Want{21, 20, 1}, Want{23, 20, 2}}) {
    clock.advance(std::chrono::microseconds(static_cast<int64_t>(w.ms_per_step * 1000 * (w.step - last))));
    last = w.step;
    auto results = run_step(job, 0, w.step, in, out, {true}, true);
    ASSERT_TRUE(results[0].status.ok()) << results[0].status.to_string();
    EXPECT_EQ(results[0].lease_steps, w.lease) << "step " << w.step;
  }
}

// The knob without trainers that reduce: the daemons' ring runs the step (the average, as
// always), also where the trainers reduce on one node and not on another (the job's is the AND
// over the nodes, so both nodes run the ring, not each its own way).
TEST(TrainerCollectiveTest, WithoutEveryTrainerReducingTheRingRuns) {
  PipelineOptions o = options(false, kernels::Selector::kTopk, 0.01);
  o.settings.dense_collective = policies::Collective::kTrainerAllReduce;
  for (const std::vector<bool>& reducing : {std::vector<bool>{false, false}, {true, false}, {false, true}}) {
    Job job(2, o);
    register_all(job, {{"w", 64}});
    std::vector<std::vector<float>> in{random_vector(64, 1), random_vector(64, 2)}, out;
    for (uint64_t step = 0; step < 2; ++step) {
      auto results = run_step(job, 0, step, in, out, reducing);
      for (uint32_t r = 0; r < 2; ++r) {
        ASSERT_TRUE(results[r].status.ok()) << results[r].status.to_string();
        EXPECT_FALSE(results[r].trainer_reduces);
        EXPECT_EQ(results[r].bytes_sent, ring_allreduce_bytes(64, 2, r));
        for (size_t i = 0; i < 64; ++i) ASSERT_NEAR(out[r][i], (in[0][i] + in[1][i]) / 2.0, 1e-6);
      }
    }
  }
}

TEST(TrainerCollectiveTest, ATrainerThatStopsReducingMidJobFailsItsStep) {
  PipelineOptions o = options(false, kernels::Selector::kTopk, 0.01);
  o.settings.dense_collective = policies::Collective::kTrainerAllReduce;
  {
    // Agreed with trainers that reduce, then a step whose trainer no longer says so.
    Job job(2, o);
    register_all(job, {{"w", 64}});
    std::vector<std::vector<float>> in(2, random_vector(64, 4)), out;
    for (const auto& r : run_step(job, 0, 0, in, out, {true, true})) ASSERT_TRUE(r.status.ok());
    auto results = run_step(job, 0, 1, in, out, {true, false});
    EXPECT_TRUE(results[0].status.ok()) << results[0].status.to_string();
    EXPECT_EQ(results[1].status.code(), Code::kFailedPrecondition) << results[1].status.to_string();
    EXPECT_NE(results[1].status.message().find("no longer"), std::string::npos) << results[1].status.message();
  }
}

// Records what the pipeline reports per tensor step (the controllers' input).
class LinkRecorder final : public StepObserver {
 public:
  void on_tensor_step(const TensorStepRecord& r, const Decision&) override {
    std::lock_guard<std::mutex> lock(mu);
    records.push_back({r.bytes_sent, r.link_bytes, r.link_s, r.exchange_s});
  }
  void on_metric(const std::string&, double, uint64_t) override {}
  void on_reset() override {}
  struct Seen {
    uint64_t bytes_sent, link_bytes;
    double link_s, exchange_s;
  };
  std::mutex mu;
  std::vector<Seen> records;
};

TEST(LinkGoodputTest, LargeSendsAreTimedFromPostToCompletionSmallOnesAreLeftOut) {
  for (const bool dense : {true, false}) {
    LinkRecorder rec;  // outlives the job: the pipelines call it until they stop
    bool first = true;
    Job job(2, options(!dense, kernels::Selector::kTopk, 0.01), [&](Pipeline& p) {
      if (first) p.set_observer(&rec);
      first = false;
    });
    // Dense: two ring chunks of 200 KB (rendezvous-sized). Sparse: 1,000 x 8 bytes (eager).
    const size_t n = 100'000;
    register_all(job, {{"w", n}});
    std::vector<std::vector<float>> in{random_vector(n, 1), random_vector(n, 2)}, out;
    auto results = run_step(job, 0, 1, in, out);
    ASSERT_TRUE(results[0].status.ok()) << results[0].status.to_string();
    job.nodes[0]->pipeline->stop();
    std::lock_guard<std::mutex> lock(rec.mu);
    ASSERT_EQ(rec.records.size(), 1u);
    const auto& r = rec.records[0];
    if (dense) {
      EXPECT_EQ(r.link_bytes, r.bytes_sent) << "every ring chunk is large enough to time";
      EXPECT_GT(r.link_s, 0);
      EXPECT_LE(r.link_s, r.exchange_s) << "only while a send was in flight";
    } else {
      EXPECT_EQ(r.link_bytes, 0u) << "eager-sized sends say nothing about the link";
      EXPECT_EQ(r.link_s, 0);
    }
  }
}

TEST(RingBytes, MatchesTheRingFormula) {
  // 2(W-1) messages per rank, each about n/W elements: total payload 2(W-1)/W * n * 4 when W | n.
  EXPECT_EQ(ring_allreduce_bytes(4000, 4, 0), 6 * (80 + 1000 * 4));
  EXPECT_EQ(ring_allreduce_bytes(4000, 1, 0), 0u);
  uint64_t all = 0;
  for (uint32_t r = 0; r < 3; ++r) all += ring_allreduce_bytes(10, 3, r) - 4 * 80;
  EXPECT_EQ(all, 2u * (3 - 1) * 10 * 4);  // each chunk is sent W-1 times per half
}

// Reference top-k: sort indices by (|x| desc, index asc), keep k.
std::vector<uint32_t> reference_topk(const std::vector<float>& x, size_t k) {
  std::vector<uint32_t> idx(x.size());
  std::iota(idx.begin(), idx.end(), 0u);
  std::sort(idx.begin(), idx.end(), [&](uint32_t a, uint32_t b) {
    float fa = std::fabs(x[a]), fb = std::fabs(x[b]);
    return fa != fb ? fa > fb : a < b;
  });
  idx.resize(std::min(k, x.size()));
  std::sort(idx.begin(), idx.end());
  return idx;
}

TEST(SparseTest, TopkResultIsTheMeanOfEveryNodesIndependentlySelectedValues) {
  const uint32_t w = 4;
  const size_t n = 5000;
  const double density = 0.01;
  Job job(w, options(true, kernels::Selector::kTopk, density));
  register_all(job, {{"w", n}, {"b", 7}});
  std::vector<std::vector<float>> residual(w, std::vector<float>(n, 0.0f));
  const size_t k = 50;
  for (uint64_t step = 0; step < 5; ++step) {
    std::vector<std::vector<float>> in, out;
    for (uint32_t r = 0; r < w; ++r) in.push_back(random_vector(n, 1000 * static_cast<uint32_t>(step) + r));
    std::vector<double> expected(n, 0.0);
    for (uint32_t r = 0; r < w; ++r) {
      for (size_t i = 0; i < n; ++i) residual[r][i] += in[r][i];
      for (uint32_t i : reference_topk(residual[r], k)) {
        expected[i] += residual[r][i];
        residual[r][i] = 0.0f;
      }
    }
    auto results = run_step(job, 0, step, in, out);
    for (uint32_t r = 0; r < w; ++r) {
      ASSERT_TRUE(results[r].status.ok()) << results[r].status.to_string();
      EXPECT_EQ(results[r].nnz, k);
      EXPECT_EQ(results[r].bytes_sent, (w - 1) * (80 + 8 * k));
      EXPECT_EQ(out[r], out[0]);
    }
    for (size_t i = 0; i < n; ++i) {
      ASSERT_NEAR(out[0][i], expected[i] / w, 1e-6 * std::fabs(expected[i]) + 1e-7) << "element " << i;
    }
    // The small tensor keeps at least one element per node.
    std::vector<std::vector<float>> bin(w, std::vector<float>(7, 1.0f)), bout;
    auto bres = run_step(job, 1, step, bin, bout);
    for (auto& r : bres) ASSERT_TRUE(r.status.ok()) << r.status.to_string();
    EXPECT_EQ(bres[0].nnz, 1u);
  }
}

// kernel_threads: the pipeline's pool reaches selection (compressor) and decoding (collective);
// a job with 3 kernel threads per node gives bit-identical averages to one with 1, for top-k
// (COO) and hard threshold (bitmap) on a tensor large enough to be split.
TEST(SparseTest, KernelThreadsGiveTheSameAverages) {
  const uint32_t w = 2;
  const size_t n = 3 * kernels::kParallelMinElements + 33;
  for (const auto& [selector, format] : {std::pair{kernels::Selector::kTopk, kernels::Format::kCoo},
                                         std::pair{kernels::Selector::kThreshold, kernels::Format::kBitmap}}) {
    PipelineOptions one = options(true, selector, 0.05, 1.5);
    one.settings.format = format;
    PipelineOptions three = one;
    three.kernel_threads = 3;
    Job a(w, one);
    Job b(w, three);
    register_all(a, {{"w", n}});
    register_all(b, {{"w", n}});
    for (uint64_t step = 0; step < 3; ++step) {
      std::vector<std::vector<float>> in, out_a, out_b;
      for (uint32_t r = 0; r < w; ++r) in.push_back(random_vector(n, 77 * static_cast<uint32_t>(step) + r));
      auto ra = run_step(a, 0, step, in, out_a);
      auto rb = run_step(b, 0, step, in, out_b);
      for (uint32_t r = 0; r < w; ++r) {
        ASSERT_TRUE(ra[r].status.ok() && rb[r].status.ok()) << rb[r].status.to_string();
        EXPECT_GT(ra[r].nnz, 0u);
        EXPECT_EQ(ra[r].nnz, rb[r].nnz);
        ASSERT_EQ(0, std::memcmp(out_a[r].data(), out_b[r].data(), n * sizeof(float))) << "node " << r;
      }
    }
  }
}

TEST(SparseTest, HardThresholdSendsEveryResidualAboveLambda) {
  const uint32_t w = 2;
  const size_t n = 2000;
  const float lambda = 2.0f;
  Job job(w, options(true, kernels::Selector::kThreshold, 0.01, lambda));
  register_all(job, {{"w", n}});
  std::vector<std::vector<float>> residual(w, std::vector<float>(n, 0.0f));
  for (uint64_t step = 0; step < 4; ++step) {
    std::vector<std::vector<float>> in, out;
    for (uint32_t r = 0; r < w; ++r) in.push_back(random_vector(n, 77 * static_cast<uint32_t>(step) + r));
    std::vector<double> expected(n, 0.0);
    uint64_t selected0 = 0;
    for (uint32_t r = 0; r < w; ++r) {
      for (size_t i = 0; i < n; ++i) {
        residual[r][i] += in[r][i];
        if (std::fabs(residual[r][i]) >= lambda) {
          expected[i] += residual[r][i];
          residual[r][i] = 0.0f;
          if (r == 0) ++selected0;
        }
      }
    }
    auto results = run_step(job, 0, step, in, out);
    ASSERT_TRUE(results[0].status.ok()) << results[0].status.to_string();
    EXPECT_EQ(results[0].nnz, selected0);
    for (size_t i = 0; i < n; ++i) ASSERT_NEAR(out[1][i], expected[i] / w, 1e-6 * std::fabs(expected[i]) + 1e-7);
  }
}

TEST(AgreementTest, DifferentTensorSizesFailTheFirstStepOnEveryNodeNamingTheTensor) {
  Job job(3, options(true, kernels::Selector::kTopk, 0.1));
  ASSERT_TRUE(job.nodes[0]->pipeline->register_tensor(0, {"fc.weight", 100}).ok());
  ASSERT_TRUE(job.nodes[1]->pipeline->register_tensor(0, {"fc.weight", 100}).ok());
  ASSERT_TRUE(job.nodes[2]->pipeline->register_tensor(0, {"fc.weight", 120}).ok());
  std::vector<std::vector<float>> in{std::vector<float>(100, 1.f), std::vector<float>(100, 1.f),
                                     std::vector<float>(120, 1.f)};
  std::vector<std::vector<float>> out(3);
  for (uint32_t r = 0; r < 3; ++r) {
    out[r].resize(in[r].size());
    job.nodes[r]->pipeline->submit({0, 0, 0.f, in[r], out[r]});
  }
  for (uint32_t r = 0; r < 3; ++r) {
    auto res = job.nodes[r]->results.wait(0, 0);
    EXPECT_EQ(res.status.code(), Code::kFailedPrecondition) << res.status.to_string();
    EXPECT_NE(res.status.message().find("rank 2"), std::string::npos) << res.status.message();
    EXPECT_NE(res.status.message().find("fc.weight"), std::string::npos) << res.status.message();
  }
}

TEST(AgreementTest, DifferentKnobsFailNamingTheKnobs) {
  PipelineOptions o = options(true, kernels::Selector::kTopk, 0.1);
  Job job(2, o);
  // Rebuild rank 1 with a different knob fingerprint.
  job.nodes[1]->pipeline->stop();
  PipelineOptions o1 = o;
  o1.rank = 1;
  o1.world_size = 2;
  o1.agreed_knobs = "density=0.5";
  job.nodes[1]->pipeline = std::make_unique<Pipeline>(o1, job.net.transport(1), job.nodes[1]->mailbox.get(), nullptr);
  job.nodes[1]->pipeline->set_result_sink(&job.nodes[1]->results);
  job.nodes[1]->pipeline->start();
  register_all(job, {{"w", 10}});
  std::vector<std::vector<float>> in(2, std::vector<float>(10, 1.f)), out;
  auto results = run_step(job, 0, 0, in, out);
  for (auto& r : results) {
    EXPECT_EQ(r.status.code(), Code::kFailedPrecondition);
    EXPECT_NE(r.status.message().find("density=0.5"), std::string::npos) << r.status.message();
  }
}

TEST(FailureTest, KilledPeerFailsTheStepNamingIt) {
  Job job(3, options(true, kernels::Selector::kTopk, 0.1));
  register_all(job, {{"w", 100}});
  std::vector<std::vector<float>> in(3, random_vector(100, 5)), out;
  for (auto& r : run_step(job, 0, 0, in, out)) ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  job.net.kill(2);
  out.assign(3, std::vector<float>(100));
  for (uint32_t r = 0; r < 2; ++r) job.nodes[r]->pipeline->submit({0, 1, 0.f, in[r], out[r]});
  auto start = std::chrono::steady_clock::now();
  for (uint32_t r = 0; r < 2; ++r) {
    auto res = job.nodes[r]->results.wait(0, 1);
    EXPECT_EQ(res.status.code(), Code::kUnavailable) << res.status.to_string();
    EXPECT_NE(res.status.message().find("rank 2"), std::string::npos) << res.status.message();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 4s) << "a dead peer must be noticed before the deadline";
}

// What the controllers are told of each tensor step: its step and whether it succeeded.
class OutcomeRecorder final : public StepObserver {
 public:
  void on_tensor_step(const TensorStepRecord& r, const Decision&) override {
    std::lock_guard<std::mutex> lock(mu);
    seen.emplace_back(r.step, r.ok);
  }
  void on_metric(const std::string&, double, uint64_t) override {}
  void on_reset() override {}
  std::mutex mu;
  std::vector<std::pair<uint64_t, bool>> seen;
};

// What the controllers are told of a sparse host step's residual norm, and when.
class NormRecorder final : public StepObserver {
 public:
  struct Seen {
    double in_record = 0;     // TensorStepRecord::residual_norm2
    double reference = 0;     // Σ residual², float64, from the record's span
    double later = -1;        // on_residual_norm2's
    bool after_result = false;  // the step's result had gone out by then
  };
  void watch(fakes::StepResults* results) { results_ = results; }  // before the first step
  void on_tensor_step(const TensorStepRecord& r, const Decision&) override {
    double e = 0;
    for (float v : r.residual) e += static_cast<double>(v) * v;
    std::lock_guard<std::mutex> lock(mu_);
    seen_[{r.tensor_id, r.step}] = {r.residual_norm2, e, -1, false};
  }
  void on_residual_norm2(uint32_t tensor_id, uint64_t step, double norm2) override {
    const bool out = results_->completed(tensor_id, step);
    std::lock_guard<std::mutex> lock(mu_);
    Seen& s = seen_[{tensor_id, step}];
    s.later = norm2;
    s.after_result = out;
    cv_.notify_all();
  }
  void on_metric(const std::string&, double, uint64_t) override {}
  void on_reset() override {}
  // The step's record once its norm came (bounded: 5 s).
  Seen wait(uint32_t tensor, uint64_t step) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, std::chrono::seconds(5), [&] {
      auto it = seen_.find({tensor, step});
      return it != seen_.end() && it->second.later >= 0;
    });
    return seen_[{tensor, step}];
  }

 private:
  fakes::StepResults* results_ = nullptr;
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::pair<uint32_t, uint64_t>, Seen> seen_;
};

TEST(ObserverTest, ASparseStepsResidualNormComesAfterItsResultAndIsTheResiduals) {
  // The pass over the residual is off the step's critical path: the observer gets the norm once
  // the trainer has the result, and it is the residual's own (a float64 sum of its squares).
  NormRecorder recorder;
  bool first = true;  // node 0's pipeline comes first
  Job job(2, options(true, kernels::Selector::kTopk, 0.1), [&](Pipeline& p) {
    if (first) p.set_observer(&recorder);
    first = false;
  });
  recorder.watch(&job.nodes[0]->results);
  register_all(job, {{"w", 1000}});
  std::vector<std::vector<float>> out;
  for (uint64_t s = 0; s < 4; ++s) {
    std::vector<std::vector<float>> in = {random_vector(1000, 10 + static_cast<uint32_t>(s)),
                                          random_vector(1000, 20 + static_cast<uint32_t>(s))};
    for (auto& r : run_step(job, 0, s, in, out)) ASSERT_TRUE(r.status.ok());
    const NormRecorder::Seen seen = recorder.wait(0, s);
    EXPECT_EQ(seen.in_record, TensorStepRecord::kNormLater) << "step " << s;
    EXPECT_GT(seen.reference, 0) << "step " << s << ": error feedback keeps 90 % of the gradient";
    EXPECT_NEAR(seen.later, seen.reference, 1e-6 * seen.reference) << "step " << s;
    EXPECT_TRUE(seen.after_result) << "step " << s;
  }
}

TEST(FailureTest, SilentPeerRunsIntoTheDeadlineNamingIt) {
  PipelineOptions o = options(true, kernels::Selector::kTopk, 0.1);
  o.step_timeout = 300ms;
  OutcomeRecorder recorder;
  bool first = true;  // node 0's pipeline comes first
  Job job(2, o, [&](Pipeline& p) {
    if (first) p.set_observer(&recorder);
    first = false;
  });
  register_all(job, {{"w", 100}});
  std::vector<std::vector<float>> in(2, random_vector(100, 6)), out;
  for (auto& r : run_step(job, 0, 0, in, out)) ASSERT_TRUE(r.status.ok());
  job.net.silence(1);
  out.assign(2, std::vector<float>(100));
  auto start = std::chrono::steady_clock::now();
  job.nodes[0]->pipeline->submit({0, 1, 0.f, in[0], out[0]});
  auto res = job.nodes[0]->results.wait(0, 1);
  EXPECT_EQ(res.status.code(), Code::kDeadlineExceeded) << res.status.to_string();
  EXPECT_NE(res.status.message().find("rank 1"), std::string::npos);
  EXPECT_LT(std::chrono::steady_clock::now() - start, 3s);
  // The controllers are told the step failed (they must not take its times or selection).
  std::lock_guard<std::mutex> lock(recorder.mu);
  const std::vector<std::pair<uint64_t, bool>> want = {{0, true}, {1, false}};
  EXPECT_EQ(recorder.seen, want);
}

TEST(FailureTest, CorruptPayloadIsRejectedCountedAndFailsTheStep) {
  Job job(2, options(true, kernels::Selector::kTopk, 0.1));
  register_all(job, {{"w", 100}});
  std::vector<std::vector<float>> in(2, random_vector(100, 7)), out;
  for (auto& r : run_step(job, 0, 0, in, out)) ASSERT_TRUE(r.status.ok());
  job.net.corrupt_next_from(1, wire::kHeaderBytes + 5);  // a payload byte
  auto results = run_step(job, 0, 1, in, out);
  EXPECT_EQ(results[0].status.code(), Code::kDataLoss) << results[0].status.to_string();
  EXPECT_NE(results[0].status.message().find("rank 1"), std::string::npos);
  EXPECT_EQ(job.nodes[0]->mailbox->rejected(), 1u);
  // Rank 1 received a valid message from rank 0 and may have finished before rank 0's abort
  // arrived; either way it must not hang (run_step bounds the wait).
  // The job goes on: the next step works again.
  for (auto& r : run_step(job, 0, 2, in, out)) EXPECT_TRUE(r.status.ok()) << r.status.to_string();
}

TEST(FailureTest, StepNotAfterTheLastIsOutOfRange) {
  Job job(1, options(true, kernels::Selector::kTopk, 0.5));
  register_all(job, {{"w", 4}});
  std::vector<std::vector<float>> in{{1, 2, 3, 4}}, out;
  ASSERT_TRUE(run_step(job, 0, 5, in, out)[0].status.ok());
  EXPECT_EQ(run_step(job, 0, 5, in, out)[0].status.code(), Code::kOutOfRange);
  EXPECT_EQ(run_step(job, 0, 3, in, out)[0].status.code(), Code::kOutOfRange);
}

TEST(FailureTest, ResultsCarryTheSessionsJobGeneration) {
  Job job(1, options(true, kernels::Selector::kTopk, 0.5));
  register_all(job, {{"w", 4}});
  std::vector<float> in{1, 2, 3, 4}, out(4);
  StepJob j{0, 9, 0.f, in, out, 41};
  job.nodes[0]->pipeline->submit(j);
  auto r = job.nodes[0]->results.wait(0, 9);
  ASSERT_TRUE(r.status.ok());
  EXPECT_EQ(r.generation, 41u);
}

TEST(FailureTest, RegistrationAfterTheFirstStepIsRefused) {
  Job job(1, options(true, kernels::Selector::kTopk, 0.5));
  register_all(job, {{"w", 4}});
  std::vector<std::vector<float>> in{{1, 2, 3, 4}}, out;
  ASSERT_TRUE(run_step(job, 0, 0, in, out)[0].status.ok());
  EXPECT_EQ(job.nodes[0]->pipeline->register_tensor(1, {"late", 3}).code(), Code::kFailedPrecondition);
  job.nodes[0]->pipeline->reset();
  EXPECT_TRUE(job.nodes[0]->pipeline->register_tensor(0, {"next-job", 3}).ok());
}

TEST(ErrorFeedbackTest, SingleNodeConservesEverythingSentPlusResidual) {
  // W = 1, one trainer: the output of each step is exactly what was sent. Over many steps the
  // total sent plus what is still held back must equal the total gradient; drain by switching to
  // a dense pipeline is not possible here, so compare sum(sent) + residual via a final dense step
  // of zeros on a compression-off pipeline fed the same stream.
  const size_t n = 300;
  Job job(1, options(true, kernels::Selector::kTopk, 0.02));
  register_all(job, {{"w", n}});
  std::vector<double> total_grad(n, 0.0), total_sent(n, 0.0);
  std::vector<float> residual(n, 0.0f);
  for (uint64_t step = 0; step < 100; ++step) {
    std::vector<std::vector<float>> in{random_vector(n, static_cast<uint32_t>(step) + 1)}, out;
    for (size_t i = 0; i < n; ++i) {
      total_grad[i] += in[0][i];
      residual[i] += in[0][i];
    }
    auto res = run_step(job, 0, step, in, out);
    ASSERT_TRUE(res[0].status.ok());
    for (size_t i = 0; i < n; ++i) {
      total_sent[i] += out[0][i];
      if (out[0][i] != 0.0f) residual[i] = 0.0f;  // independent EF bookkeeping
    }
  }
  // sum(sent) + residual == sum(grad): each residual entry is a float sum of at most 100 terms of
  // magnitude <= ~5, so the float rounding is below 100 * 5 * 2^-24 * 100 ~ 3e-3.
  for (size_t i = 0; i < n; ++i) ASSERT_NEAR(total_sent[i] + residual[i], total_grad[i], 3e-3) << i;
}

// Every wire format (and auto) x value type through the pipeline over the FakeNetwork: each node
// decodes whatever its peers sent; the average is the mean of every node's selection as the
// receivers decode it (kernels::quantize_roundtrip), identical on every node; the quantisation
// error stays in the residual (the reference keeps x - y too, so the selections agree).
struct FormatCase {
  const char* format;  // knob text
  kernels::ValueType value_type;
};

class FormatTest : public ::testing::TestWithParam<FormatCase> {};

TEST_P(FormatTest, EveryNodeDecodesWhateverArrivesAndKeepsTheQuantisationErrorInTheResidual) {
  const FormatCase fc = GetParam();
  const uint32_t w = 3;
  const size_t n = 1200;
  const size_t k = 60;
  PipelineOptions o = options(true, kernels::Selector::kTopk, static_cast<double>(k) / n);
  o.settings.auto_format = std::string(fc.format) == "auto";
  if (!o.settings.auto_format) {
    ASSERT_TRUE(kernels::parse_format(fc.format, &o.settings.format));
  }
  o.settings.value_type = fc.value_type;
  Job job(w, o);
  register_all(job, {{"w", n}});
  std::vector<std::vector<float>> residual(w, std::vector<float>(n, 0.0f));
  for (uint64_t step = 0; step < 4; ++step) {
    std::vector<std::vector<float>> in, out;
    for (uint32_t r = 0; r < w; ++r) in.push_back(random_vector(n, 77 * static_cast<uint32_t>(step) + r));
    std::vector<double> expected(n, 0.0);
    size_t coo_bytes = 0;
    for (uint32_t r = 0; r < w; ++r) {
      for (size_t i = 0; i < n; ++i) residual[r][i] += in[r][i];
      const auto idx = reference_topk(residual[r], k);
      std::vector<float> x(idx.size()), y(idx.size());
      for (size_t j = 0; j < idx.size(); ++j) x[j] = residual[r][idx[j]];
      ASSERT_TRUE(kernels::quantize_roundtrip(fc.value_type, x, y).ok());
      for (size_t j = 0; j < idx.size(); ++j) {
        expected[idx[j]] += y[j];
        residual[r][idx[j]] = 0.0f;
        residual[r][idx[j]] += x[j];
        residual[r][idx[j]] -= y[j];
      }
      coo_bytes = kernels::encoded_bytes(kernels::Format::kCoo, fc.value_type, n, k);
    }
    auto results = run_step(job, 0, step, in, out);
    for (uint32_t r = 0; r < w; ++r) {
      ASSERT_TRUE(results[r].status.ok()) << results[r].status.to_string();
      EXPECT_EQ(results[r].nnz, k);
      EXPECT_EQ(out[r], out[0]) << "rank " << r << " differs from rank 0";
      if (o.settings.auto_format) {
        EXPECT_LE(results[r].bytes_sent, (w - 1) * (80 + coo_bytes));
      }
    }
    for (size_t i = 0; i < n; ++i) {
      ASSERT_NEAR(out[0][i], expected[i] / w, 1e-6 * std::fabs(expected[i]) + 1e-7) << "element " << i;
    }
  }
}

// Every row of the codec registry and auto, in every value type: a codec added to the registry
// runs here without an edit.
std::vector<FormatCase> every_format_and_value_type() {
  std::vector<FormatCase> out;
  for (const kernels::ValueTypeInfo& vt : kernels::value_type_registry()) {
    for (const kernels::CodecInfo& row : kernels::codec_registry()) out.push_back({row.name, vt.id});
    out.push_back({"auto", vt.id});
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(
    Formats, FormatTest, ::testing::ValuesIn(every_format_and_value_type()),
    [](const ::testing::TestParamInfo<FormatCase>& param_info) {
      return std::string(param_info.param.format) + "_" +
             std::string(kernels::value_type_name(param_info.param.value_type));
    });

}  // namespace
}  // namespace sparsecar
