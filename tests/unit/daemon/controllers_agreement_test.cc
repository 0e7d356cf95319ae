// Controllers across a 4-node job: the active policy changes every few steps (operator
// `controller=` changes from different ranks, and rank 0's controllers proposing their own
// decisions from the observations every node piggybacks to it), and every node must have
// used the same plan, under the same decision epoch, for every (tensor, step).
#include <gtest/gtest.h>

#include <thread>

#include <atomic>
#include <condition_variable>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <set>

#include "daemon/collective/mailbox.h"
#include "daemon/pipeline/controller_runner.h"
#include "daemon/pipeline/decisions.h"
#include "daemon/pipeline/observations.h"
#include "daemon/pipeline/pipeline.h"
#include "tests/unit/daemon/fake_transport.h"
#include "tests/unit/daemon/step_results.h"

namespace sparsecar {
namespace {

using namespace std::chrono_literals;
using fakes::FakeNetwork;

using Results = fakes::StepResults;

// Records the plan and epoch of every tensor step, then hands it to the real collector.
class Recorder final : public StepObserver {
 public:
  explicit Recorder(StepObserver* next) : next_(next) {}
  void on_tensor_step(const TensorStepRecord& r, const Decision& d) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      plans[{r.tensor_id, r.step}] = {d.epoch, policies::describe(r.plan)};
    }
    next_->on_tensor_step(r, d);
  }
  void on_metric(const std::string& name, double value, uint64_t step) override { next_->on_metric(name, value, step); }
  void on_reset() override { next_->on_reset(); }
  void on_residual_norm2(uint32_t tensor_id, uint64_t step, double norm2) override {
    next_->on_residual_norm2(tensor_id, step, norm2);
  }
  void after_complete() override {
    next_->after_complete();
    completed.fetch_add(1);
  }
  // Waits (bounded) until the pipeline ran after_complete() `n` times in all: a tensor step's
  // observation work (rank 0's controllers) runs after its result went out.
  bool wait_completed(uint64_t n) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (completed.load() < n) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
    return true;
  }

  std::mutex mu_;
  std::atomic<uint64_t> completed{0};
  std::map<std::pair<uint32_t, uint64_t>, std::pair<uint32_t, std::string>> plans;

 private:
  StepObserver* next_;
};

const std::vector<TensorSpec> kTensors = {{"tok_embed.weight", 20000}, {"fc.weight", 6000}, {"fc.bias", 64}};

struct Node {
  std::unique_ptr<Mailbox> mailbox;
  std::unique_ptr<DecisionBoard> board;
  std::unique_ptr<ControllerRunner> runner;
  std::unique_ptr<ObservationCollector> collector;
  std::unique_ptr<Recorder> recorder;
  std::unique_ptr<Pipeline> pipeline;
  Results results;
};

struct Job {
  explicit Job(uint32_t world, const std::function<void(Config&)>& configure = nullptr) : net(world) {
    for (uint32_t r = 0; r < world; ++r) {
      auto& n = nodes.emplace_back(std::make_unique<Node>());
      Config c;
      c.rank = r;
      c.world_size = world;
      c.selector_params.density = 0.01;
      c.controller = "gradnorm,frequency,bandwidth";
      c.exchange_budget_ms = 1e-3;  // a budget nothing meets: the bandwidth controller caps at once
      c.controller_interval_steps = 1;
      c.layerwise_dense_below = 100;
      c.schedule_warmup_steps = 2;
      c.schedule_ramp_steps = 6;
      c.schedule_dense_every = 7;
      if (configure) configure(c);
      n->mailbox = std::make_unique<Mailbox>(0, world, nullptr);
      n->board = std::make_unique<DecisionBoard>(c, net.transport(r));
      if (r == 0) n->runner = std::make_unique<ControllerRunner>(c, n->board.get());
      n->collector = std::make_unique<ObservationCollector>(r, 0, net.transport(r), n->runner.get());
      n->recorder = std::make_unique<Recorder>(n->collector.get());
      n->mailbox->set_control_handler([b = n->board.get(), runner = n->runner.get(), this](
                                          uint32_t peer, const wire::WireHeader& h, std::span<const std::byte> p) {
        if (h.kind == static_cast<uint16_t>(wire::Kind::kObservation)) {
          auto o = parse_observation(std::string_view(reinterpret_cast<const char*>(p.data()), p.size()));
          ASSERT_TRUE(o.ok()) << o.status().to_string();
          ASSERT_NE(runner, nullptr) << "observations go to rank 0 only";
          if (o->magnitude_elements > 0) {
            // A peer's budget histograms: |g| once per covered element, |residual + g| once per
            // element plus once per selected value.
            uint64_t magnitudes = 0, gradients = 0;
            for (uint64_t count : o->magnitude_hist) magnitudes += count;
            for (uint64_t count : o->gradient_hist) gradients += count;
            EXPECT_EQ(gradients, o->magnitude_elements);
            EXPECT_GE(magnitudes, o->magnitude_elements);
            EXPECT_LE(magnitudes, o->magnitude_elements + o->nnz);
            ++histogram_observations;
          }
          o->rank = peer;
          runner->add(*o);
          return;
        }
        b->on_message(peer, h, p);
      });
      net.attach(r, n->mailbox.get());
      PipelineOptions o;
      o.rank = r;
      o.world_size = world;
      o.agreed_knobs = agreed_knobs(c);
      o.step_timeout = 5000ms;
      o.join_timeout = 5000ms;
      n->pipeline = std::make_unique<Pipeline>(o, net.transport(r), n->mailbox.get(), nullptr, n->board.get());
      n->pipeline->set_result_sink(&n->results);
      n->pipeline->set_observer(n->recorder.get());
      n->pipeline->start();
      for (uint32_t t = 0; t < kTensors.size(); ++t) EXPECT_TRUE(n->pipeline->register_tensor(t, kTensors[t]).ok());
    }
  }
  ~Job() {
    for (auto& n : nodes) n->pipeline->stop();
  }
  void step(uint64_t s) {
    std::vector<std::vector<std::vector<float>>> in(nodes.size()), out(nodes.size());
    for (uint32_t r = 0; r < nodes.size(); ++r) {
      std::mt19937 rng(static_cast<uint32_t>(s * 131 + r));
      // The gradient norm jumps at step 20 (as after an LR change): gradnorm reacts.
      std::normal_distribution<float> d(0.f, s == 20 ? 10.f : 1.f);
      for (const auto& spec : kTensors) {
        auto& v = in[r].emplace_back(spec.count);
        for (auto& x : v) x = d(rng);
        out[r].emplace_back(spec.count);
      }
    }
    for (uint32_t t = 0; t < kTensors.size(); ++t) {
      for (uint32_t r = 0; r < nodes.size(); ++r) nodes[r]->pipeline->submit({t, s, 0.f, in[r][t], out[r][t]});
    }
    for (uint32_t t = 0; t < kTensors.size(); ++t) {
      for (uint32_t r = 0; r < nodes.size(); ++r) {
        StepResult res = nodes[r]->results.wait(t, s);
        ASSERT_TRUE(res.status.ok()) << "rank " << r << " tensor " << t << " step " << s << ": "
                                     << res.status.to_string();
      }
    }
    // The step is over once every node also did its observation work (as a trainer's next step
    // would find it): the tests read and reset the controllers between steps.
    completed_tensor_steps += kTensors.size();
    for (uint32_t r = 0; r < nodes.size(); ++r) {
      ASSERT_TRUE(nodes[r]->recorder->wait_completed(completed_tensor_steps)) << "rank " << r << " step " << s;
    }
  }
  uint64_t completed_tensor_steps = 0;
  std::atomic<int> histogram_observations{0};  // peers' observations with budget histograms
  // Members die in reverse order: `net` stops delivering before any node's mailbox is freed.
  std::vector<std::unique_ptr<Node>> nodes;
  FakeNetwork net;
};

TEST(ControllersAgreementTest, PolicyChangesEveryFewStepsEveryNodeUsesTheSamePlanAtEveryStep) {
  Job job(4);
  const char* policies[] = {"schedule",          "layerwise,gradnorm",        "schedule,layerwise,frequency",
                            "static",            "bandwidth,cost",            "schedule,bandwidth,gradnorm",
                            "layerwise",         "frequency,gradnorm,budget", "static"};
  constexpr uint64_t kSteps = 45;
  for (uint64_t s = 0; s < kSteps; ++s) {
    if (s % 5 == 3) {
      const size_t i = (s / 5) % std::size(policies);
      const uint32_t proposer = static_cast<uint32_t>(s % 4);  // from every rank in turn
      KnobChanges changes{{"controller", policies[i]}};
      if (i == 7) {
        changes.emplace_back("budget_total_elements", "20000");
        changes.emplace_back("budget_steps", "60");
      }
      auto d = job.nodes[proposer]->board->propose(changes, "test: policy", std::chrono::steady_clock::now() + 5s);
      ASSERT_TRUE(d.ok()) << d.status().to_string();
    }
    job.step(s);
    if (HasFatalFailure()) return;
  }
  EXPECT_GT(job.histogram_observations.load(), 0) << "while budget was active, peers sent their histograms";
  // Same (epoch, plan) for every (tensor, step) on every node.
  std::set<std::string> distinct;
  for (uint32_t t = 0; t < kTensors.size(); ++t) {
    for (uint64_t s = 0; s < kSteps; ++s) {
      std::pair<uint32_t, std::string> first;
      for (uint32_t r = 0; r < 4; ++r) {
        auto& rec = *job.nodes[r]->recorder;
        std::lock_guard<std::mutex> lock(rec.mu_);
        auto it = rec.plans.find({t, s});
        ASSERT_NE(it, rec.plans.end()) << "rank " << r << " has no record of tensor " << t << " step " << s;
        if (r == 0) {
          first = it->second;
          distinct.insert(first.second);
        } else {
          EXPECT_EQ(it->second, first) << "rank " << r << " tensor " << t << " step " << s;
        }
      }
    }
  }
  EXPECT_GE(distinct.size(), 8u) << "the plans did change";
  // The controllers on rank 0 decided too, and every node holds the same history.
  const auto h0 = job.nodes[0]->board->history();
  size_t by_controller = 0;
  for (const auto& d : h0) by_controller += d.reason.rfind("controller", 0) == 0;
  EXPECT_GE(by_controller, 3u) << "rank 0's controllers proposed decisions from the observations";
  for (uint32_t r = 1; r < 4; ++r) {
    // The last decisions may still be on their way to the peers: wait (bounded) for them.
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (job.nodes[r]->board->latest().epoch < h0.back().epoch && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::sleep_for(1ms);
    }
    const auto h = job.nodes[r]->board->history();
    ASSERT_EQ(h.size(), h0.size()) << "rank " << r << " holds epochs up to " << h.back().epoch << " of "
                                   << h0.back().epoch;
    for (size_t i = 0; i < h.size(); ++i) {
      EXPECT_EQ(h[i].epoch, h0[i].epoch);
      EXPECT_EQ(h[i].effective_step, h0[i].effective_step);
      EXPECT_EQ(agreed_knobs(*h[i].config), agreed_knobs(*h0[i].config)) << "epoch " << h[i].epoch;
    }
  }
  EXPECT_GT(job.nodes[0]->runner->snapshot().steps_observed, kSteps / 2);
}

// The trainer's dense first steps (the DDP hook's "dense_wait_s" then "dense_step_s", reported
// to its daemon before its first submit) reach rank 0's step controller before any step: on a
// slow link it ends the schedule's dense warm-up before it starts, in force on every node from
// the first step; on a fast one the warm-up runs. One hint a job; a peer's hint is not rank 0's.
void configure_warm_up(Config& c) {
  c.controller = "schedule,step";
  c.schedule_warmup_steps = 6;
  c.schedule_ramp_steps = 0;
  c.schedule_dense_every = 0;
  c.layerwise_dense_below = 0;
}

// A trainer of node `rank` reports its dense step before the daemons' step 0, as the hook does.
void hint(Job& job, uint32_t rank, double wait_s, double step_s) {
  job.nodes[rank]->recorder->on_metric("dense_wait_s", wait_s, 0);
  job.nodes[rank]->recorder->on_metric("dense_step_s", step_s, 0);
}

// Runs steps [0, steps); which of them every node ran dense (the plan's text names the ring),
// checked equal on every node. Empty after a fatal failure.
std::vector<bool> run_steps(Job& job, uint64_t steps) {
  for (uint64_t s = 0; s < steps; ++s) {
    job.step(s);
    if (::testing::Test::HasFatalFailure()) return {};
  }
  std::vector<bool> dense(steps, false);
  for (uint64_t s = 0; s < steps; ++s) {
    for (uint32_t r = 0; r < job.nodes.size(); ++r) {
      auto& rec = *job.nodes[r]->recorder;
      std::lock_guard<std::mutex> lock(rec.mu_);
      auto it = rec.plans.find({0, s});
      EXPECT_NE(it, rec.plans.end()) << "rank " << r << " step " << s;
      if (it == rec.plans.end()) continue;
      const bool d = it->second.second.find("sparse") == std::string::npos;
      if (r == 0) dense[s] = d;
      EXPECT_EQ(d, dense[s]) << "rank " << r << " step " << s << ": " << it->second.second;
    }
  }
  return dense;
}

TEST(ControllersAgreementTest, ASlowStartHintCutsTheDenseWarmUpOnEveryNodeFromTheFirstStep) {
  Job job(2, configure_warm_up);
  // 74 ms a dense step, 70.6 of them waiting on the exchange (the real small job at 50 Mbit/s):
  // the rest, 3.4 ms, prices a sparse step at 10.2 ms; 74 > 3 x 10.2.
  hint(job, 1, 0.0706, 0.074);  // a peer's: rank 0 decides alone
  EXPECT_EQ(job.nodes[0]->board->latest().epoch, 0u);
  hint(job, 0, 0.0706, 0.074);
  const Decision cut = job.nodes[0]->board->latest();
  ASSERT_EQ(cut.epoch, 1u) << "decided on the hint, before any step";
  EXPECT_EQ(cut.effective_step, 0u);
  EXPECT_EQ(cut.config->schedule_warmup_steps, 0u);
  EXPECT_NE(cut.reason.find("before step 0"), std::string::npos) << cut.reason;
  EXPECT_NE(cut.reason.find("warm-up cut before it starts"), std::string::npos) << cut.reason;
  // A second hint (the node's other trainer) changes nothing.
  hint(job, 0, 0.5, 0.6);
  EXPECT_EQ(job.nodes[0]->board->latest().epoch, 1u);
  const std::vector<bool> dense = run_steps(job, 8);
  if (HasFatalFailure()) return;
  for (uint64_t s = 0; s < 8; ++s) EXPECT_FALSE(dense[s]) << "step " << s << " ran the ring";
  EXPECT_EQ(job.nodes[1]->board->at_step(0).epoch, 1u) << "rank 1 ran step 0 under the cut";
}

TEST(ControllersAgreementTest, EveryJobOnLongLivedDaemonsWeighsItsOwnStartHint) {
  Job job(2, configure_warm_up);
  hint(job, 0, 0.0706, 0.074);
  ASSERT_EQ(job.nodes[0]->board->latest().config->schedule_warmup_steps, 0u);
  run_steps(job, 4);
  if (HasFatalFailure()) return;
  // The job ends (every trainer disconnected: the pipeline resets the board and the collector,
  // which resets rank 0's runner). The next job's steps start at 0 again, and so does its hint.
  for (auto& n : job.nodes) n->board->reset();
  job.nodes[0]->recorder->on_reset();
  EXPECT_EQ(job.nodes[0]->board->latest().config->schedule_warmup_steps, 6u) << "back to the configured value";
  hint(job, 0, 0.0706, 0.074);
  const Decision cut = job.nodes[0]->board->latest();
  EXPECT_EQ(cut.config->schedule_warmup_steps, 0u) << "the second job's hint was weighed: " << cut.reason;
  EXPECT_EQ(cut.effective_step, 0u);
}

TEST(ControllersAgreementTest, AFastStartHintLeavesTheDenseWarmUp) {
  Job job(2, configure_warm_up);
  // The wait of another step, or none, makes no hint (these would cut).
  job.nodes[0]->recorder->on_metric("dense_step_s", 0.074, 0);
  job.nodes[0]->recorder->on_metric("dense_wait_s", 0.07, 1);
  job.nodes[0]->recorder->on_metric("dense_step_s", 0.074, 0);
  EXPECT_EQ(job.nodes[0]->board->latest().epoch, 0u);
  // 13 ms a dense step, 9 of them waiting (the real small job at 1 Gbit/s): 13 < 3 x 12.
  hint(job, 0, 0.009, 0.013);
  EXPECT_EQ(job.nodes[0]->board->latest().epoch, 0u);
  const std::vector<bool> dense = run_steps(job, 8);
  if (HasFatalFailure()) return;
  for (uint64_t s = 0; s < 6; ++s) EXPECT_TRUE(dense[s]) << "the warm-up's step " << s;
  EXPECT_FALSE(dense[6]);
  EXPECT_FALSE(dense[7]);
}

// The hook says before the timing whether it corrects momentum ("momentum_correction" 1): rank
// 0's runner hands it to the step controller with the hint (which then prices sparse steps x
// step_dense_worth_corrected: step_controller_test) and logs it; a job's end forgets it, so the
// next job on the same daemons that does not say so is priced x step_dense_worth.
TEST(ControllersAgreementTest, TheHooksMomentumCorrectionReachesTheStartHint) {
  for (const bool reset_between : {false, true}) {
    Job job(2, configure_warm_up);
    job.nodes[0]->recorder->on_metric("momentum_correction", 1.0, 0);
    if (reset_between) {
      for (auto& n : job.nodes) n->board->reset();
      job.nodes[0]->recorder->on_reset();
    }
    ::testing::internal::CaptureStderr();
    hint(job, 0, 0.009, 0.013);
    const std::string said = ::testing::internal::GetCapturedStderr();
    const std::string want = reset_between ? "momentum not corrected" : "momentum corrected by the hook";
    EXPECT_NE(said.find("the trainer's dense steps before step 0: 13 ms a step, 9 ms of it waiting on the exchange; " +
                        want),
              std::string::npos)
        << "reset " << reset_between << ": " << said;
  }
}

}  // namespace
}  // namespace sparsecar
