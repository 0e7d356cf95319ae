// Decision epochs: live knob changes proposed on any rank take effect on every node at the same
// step, and a node that runs a step under another epoch fails it loudly. A proposal's deadline
// is a time on the board's clock.
#include <gtest/gtest.h>

#include <atomic>
#include <condition_variable>
#include <future>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "daemon/collective/collective.h"
#include "daemon/collective/mailbox.h"
#include "daemon/pipeline/controller_runner.h"
#include "daemon/pipeline/decisions.h"
#include "daemon/pipeline/pipeline.h"
#include "daemon/pipeline/settings.h"
#include "tests/unit/common/fake_clock.h"
#include "tests/unit/daemon/fake_transport.h"
#include "tests/unit/daemon/step_results.h"

namespace sparsecar {
namespace {

using namespace std::chrono_literals;
using fakes::FakeNetwork;

using Results = fakes::StepResults;

struct Node {
  std::unique_ptr<Mailbox> mailbox;
  std::unique_ptr<DecisionBoard> board;
  std::unique_ptr<Pipeline> pipeline;
  Results results;
};

struct Job {
  Job(uint32_t world, double density) : net(world) {
    for (uint32_t r = 0; r < world; ++r) {
      auto& n = nodes.emplace_back(std::make_unique<Node>());
      Config c;
      c.rank = r;
      c.world_size = world;
      c.selector_params.density = density;
      n->mailbox = std::make_unique<Mailbox>(0, world, nullptr);
      n->board = std::make_unique<DecisionBoard>(c, net.transport(r));
      n->mailbox->set_control_handler([b = n->board.get()](uint32_t peer, const wire::WireHeader& h,
                                                           std::span<const std::byte> p) { b->on_message(peer, h, p); });
      net.attach(r, n->mailbox.get());
      PipelineOptions o;
      o.rank = r;
      o.world_size = world;
      o.agreed_knobs = agreed_knobs(c);
      o.step_timeout = 5000ms;
      o.join_timeout = 5000ms;
      n->pipeline = std::make_unique<Pipeline>(o, net.transport(r), n->mailbox.get(), nullptr, n->board.get());
      n->pipeline->set_result_sink(&n->results);
      n->pipeline->start();
      EXPECT_TRUE(n->pipeline->register_tensor(0, {"w", 1000}).ok());
    }
  }
  ~Job() {
    for (auto& n : nodes) n->pipeline->stop();
  }
  std::vector<StepResult> step(uint64_t s) {
    std::vector<std::vector<float>> in, out(nodes.size(), std::vector<float>(1000));
    for (uint32_t r = 0; r < nodes.size(); ++r) {
      std::mt19937 rng(static_cast<uint32_t>(s * 31 + r));
      std::normal_distribution<float> d;
      auto& v = in.emplace_back(1000);
      for (auto& x : v) x = d(rng);
    }
    for (uint32_t r = 0; r < nodes.size(); ++r) nodes[r]->pipeline->submit({0, s, 0.f, in[r], out[r]});
    std::vector<StepResult> res;
    for (auto& n : nodes) res.push_back(n->results.wait(0, s));
    return res;
  }
  // Members die in reverse order: `net` (declared after `nodes`) stops its delivery thread
  // before any node's mailbox is freed.
  std::vector<std::unique_ptr<Node>> nodes;
  FakeNetwork net;
};

// A kDecision from rank 0 arriving at `board` (as the mailbox hands it over).
void deliver_decision(DecisionBoard& board, uint32_t epoch, uint64_t step, const std::string& text) {
  wire::WireHeader h{};
  h.kind = static_cast<uint16_t>(wire::Kind::kDecision);
  h.epoch = epoch;
  h.step = step;
  board.on_message(0, h, std::as_bytes(std::span<const char>(text.data(), text.size())));
}

TEST(DecisionsTest, ChangesFromAnyRankTakeEffectEverywhereAtTheAnnouncedStep) {
  Job job(4, 0.01);
  std::map<uint64_t, size_t> expected_k;  // step -> k in force
  size_t k = 10;
  uint64_t effective = 0;
  double densities[] = {0.05, 0.002, 0.1, 0.02, 0.3};
  int change = 0;
  for (uint64_t s = 0; s < 30; ++s) {
    if (s % 5 == 2) {
      // Alternate the proposing rank; rank 3 forwards to rank 0.
      uint32_t proposer = change % 2 == 0 ? 0 : 3;
      double d = densities[change % 5];
      auto decision = job.nodes[proposer]->board->propose({{"density", std::to_string(d)}}, "test",
                                                          std::chrono::steady_clock::now() + 5s);
      ASSERT_TRUE(decision.ok()) << decision.status().to_string();
      EXPECT_EQ(decision->epoch, static_cast<uint32_t>(change + 1));
      EXPECT_GT(decision->effective_step, s - 1) << "a change must never take effect in the past";
      effective = decision->effective_step;
      ++change;
      k = static_cast<size_t>(std::max<long long>(1, std::llround(d * 1000)));
    }
    auto res = job.step(s);
    for (uint32_t r = 0; r < 4; ++r) {
      ASSERT_TRUE(res[r].status.ok()) << "rank " << r << " step " << s << ": " << res[r].status.to_string();
      EXPECT_EQ(res[r].nnz, res[0].nnz) << "rank " << r << " used another plan at step " << s;
    }
    expected_k[s] = res[0].nnz;
    if (change > 0 && s >= effective) {
      EXPECT_EQ(res[0].nnz, k) << "step " << s;
    }
  }
  // Every node holds the same history.
  auto h0 = job.nodes[0]->board->history();
  for (uint32_t r = 1; r < 4; ++r) {
    auto h = job.nodes[r]->board->history();
    ASSERT_EQ(h.size(), h0.size());
    for (size_t i = 0; i < h.size(); ++i) {
      EXPECT_EQ(h[i].epoch, h0[i].epoch);
      EXPECT_EQ(h[i].effective_step, h0[i].effective_step);
      EXPECT_EQ(h[i].config->selector_params.density, h0[i].config->selector_params.density);
    }
  }
}

TEST(DecisionsTest, LiveTensorOverridesHoldAcrossLaterEpochsUntilTheirTextChanges) {
  Job job(2, 0.01);  // "w", 1000 elements: top-k keeps round(density * 1000)
  struct Change {
    const char* knob;
    const char* value;
    size_t k;  // from its effective step on
  };
  const Change changes[] = {{"tensor_overrides", "w: density=0.05", 50},
                            {"density", "0.002", 50},  // a new epoch; the rule still wins for w
                            {"tensor_overrides", "x*: density=0.5", 2},
                            {"tensor_overrides", "", 2}};
  uint64_t s = 0;
  EXPECT_EQ(job.step(s++)[0].nnz, 10u);
  for (const Change& c : changes) {
    auto d = job.nodes[1]->board->propose({{c.knob, c.value}}, "test", std::chrono::steady_clock::now() + 5s);
    ASSERT_TRUE(d.ok()) << d.status().to_string();
    for (; s <= d->effective_step; ++s) job.step(s);
    auto res = job.step(s++);
    for (uint32_t r = 0; r < 2; ++r) {
      ASSERT_TRUE(res[r].status.ok()) << res[r].status.to_string();
      EXPECT_EQ(res[r].nnz, c.k) << c.knob << "=" << c.value << " rank " << r;
    }
  }
}

TEST(DecisionsTest, NonLiveUnknownAndBadValuesAreRefusedWithoutAnEpoch) {
  Job job(2, 0.01);
  auto deadline = std::chrono::steady_clock::now() + 5s;
  EXPECT_EQ(job.nodes[1]->board->propose({{"world_size", "3"}}, "t", deadline).status().code(),
            Code::kFailedPrecondition);
  EXPECT_EQ(job.nodes[1]->board->propose({{"nope", "3"}}, "t", deadline).status().code(), Code::kNotFound);
  EXPECT_EQ(job.nodes[0]->board->propose({{"density", "7"}}, "t", deadline).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(job.nodes[0]->board->latest().epoch, 0u);
  auto ok = job.nodes[1]->board->propose({{"compression", "off"}}, "t", deadline);
  ASSERT_TRUE(ok.ok()) << ok.status().to_string();
  EXPECT_EQ(ok->epoch, 1u);
  auto res = job.step(0);
  EXPECT_TRUE(res[0].status.ok());
  EXPECT_EQ(res[0].nnz, 1000u) << "compression off from step 0 (no step had started)";
}

TEST(DecisionsTest, ADataMessageUnderAnotherEpochFailsTheStepLoudly) {
  Job job(2, 0.01);
  ASSERT_TRUE(job.step(0)[0].status.ok());
  // Rank 1 learns of an epoch rank 0 never decided (as if a decision had been lost).
  deliver_decision(*job.nodes[1]->board, 1, 1, "density=0.05\n");
  auto res = job.step(1);
  EXPECT_FALSE(res[0].status.ok());
  EXPECT_NE(res[0].status.message().find("epoch"), std::string::npos) << res[0].status.to_string();
}

// Proposals from the control socket, the controllers and peers' knob requests race on rank 0.
// Every node must end with the same epochs in the same order: rank 0 used to decide under its
// lock but send after releasing it, so epoch e+2 could leave before e+1 and a peer then refused
// every later epoch.
TEST(DecisionsTest, ConcurrentProposalsKeepEpochsInOrderOnEveryNode) {
  Job job(3, 0.01);
  ASSERT_TRUE(job.step(0)[0].status.ok());
  std::vector<std::thread> proposers;
  std::atomic<int> accepted{0};
  for (uint32_t t = 0; t < 6; ++t) {
    const uint32_t rank = t < 3 ? 0 : 1 + (t - 3) % 2;  // three on rank 0, then ranks 1, 2 and 1 again
    proposers.emplace_back([&, t, rank] {
      for (int i = 0; i < 40; ++i) {
        const std::string density = std::to_string(0.001 * (1 + (t * 40 + i) % 200));
        auto d = job.nodes[rank]->board->propose({{"density", density}}, "test", std::chrono::steady_clock::now() + 5s);
        if (d.ok()) ++accepted;
      }
    });
  }
  for (auto& p : proposers) p.join();
  EXPECT_EQ(accepted.load(), 240);
  const auto want = job.nodes[0]->board->history();
  ASSERT_EQ(want.size(), 241u);
  for (uint32_t r = 1; r < 3; ++r) {
    // Decisions reach the peers asynchronously: wait (bounded) for the last one.
    const auto deadline = std::chrono::steady_clock::now() + 10s;
    while (job.nodes[r]->board->latest().epoch < want.back().epoch && std::chrono::steady_clock::now() < deadline) {
      std::this_thread::yield();
    }
    const auto got = job.nodes[r]->board->history();
    ASSERT_EQ(got.size(), want.size()) << "rank " << r << " missed epochs";
    for (size_t e = 0; e < want.size(); ++e) {
      EXPECT_EQ(got[e].epoch, e);
      EXPECT_EQ(got[e].changes, want[e].changes) << "rank " << r << " epoch " << e;
      EXPECT_EQ(got[e].effective_step, want[e].effective_step);
      EXPECT_TRUE(got[e].error.ok());
    }
  }
  // And the job still runs in step.
  for (const auto& r : job.step(1)) EXPECT_TRUE(r.status.ok()) << r.status.to_string();
}

// A peer that cannot apply all of a decision (a knob it does not know: mixed versions) must not
// run with half of it: the epoch is recorded as failed and its steps fail loudly.
TEST(DecisionsTest, ADecisionAPeerCannotApplyWhollyFailsItsStepsInsteadOfHalfApplying) {
  Job job(2, 0.01);
  ASSERT_TRUE(job.step(0)[0].status.ok());
  deliver_decision(*job.nodes[1]->board, 1, 1, "density=0.05\nno_such_knob=1\n");
  const Decision d = job.nodes[1]->board->latest();
  EXPECT_EQ(d.epoch, 1u);
  EXPECT_EQ(d.error.code(), Code::kFailedPrecondition);
  EXPECT_NE(d.error.message().find("no_such_knob"), std::string::npos) << d.error.to_string();
  EXPECT_EQ(d.config->selector_params.density, 0.01) << "the first line was applied anyway";
  auto res = job.step(1);
  ASSERT_FALSE(res[1].status.ok());
  EXPECT_NE(res[1].status.message().find("no_such_knob"), std::string::npos) << res[1].status.to_string();
  EXPECT_EQ(res[0].status.code(), Code::kAborted) << "rank 0 must learn of it through the abort, not its deadline: "
                                                 << res[0].status.to_string();
}

// A node that joins late (a replacement joining a running job) adopts rank 0's decisions: the
// full live state of the oldest kept epoch, then the later ones; a decision that rank 0 sent after
// the snapshot and that arrived first is kept and applied on top.
TEST(DecisionsTest, ALateNodeAdoptsRankZerosDecisionsAndKeepsOnesThatArriveEarly) {
  Config c0;
  c0.selector_params.density = 0.01;
  DecisionBoard leader(c0, nullptr);  // world of one: nothing to broadcast
  ASSERT_TRUE(leader.propose({{"density", "0.05"}}, "test", std::chrono::steady_clock::now() + 1s).ok());
  ASSERT_TRUE(leader.propose({{"threshold", "0.002"}, {"step_timeout_ms", "7000"}}, "test",
                             std::chrono::steady_clock::now() + 1s)
                  .ok());
  std::string snapshot;
  leader.with_snapshot([&](const std::string& text) { snapshot = text; });

  Config c1;
  c1.rank = 1;
  c1.world_size = 2;
  c1.selector_params.density = 0.5;  // started with another live value: rank 0's must win
  DecisionBoard late(c1, nullptr);
  // Epoch 3, decided by rank 0 after the snapshot, overtakes it.
  const std::string epoch3 = "density=0.07\n";
  wire::WireHeader h{};
  h.kind = static_cast<uint16_t>(wire::Kind::kDecision);
  h.epoch = 3;
  h.step = 40;
  late.on_message(0, h, std::as_bytes(std::span<const char>(epoch3.data(), epoch3.size())));
  EXPECT_EQ(late.latest().epoch, 0u) << "an epoch cannot apply before its predecessors";

  ASSERT_TRUE(late.adopt(snapshot).ok());
  const auto history = late.history();
  ASSERT_EQ(history.size(), 4u);
  for (uint32_t e = 0; e < 4; ++e) EXPECT_EQ(history[e].epoch, e);
  EXPECT_DOUBLE_EQ(history[0].config->selector_params.density, 0.01);
  EXPECT_DOUBLE_EQ(history[1].config->selector_params.density, 0.05);
  EXPECT_DOUBLE_EQ(history[2].config->selector_params.threshold, 0.002);
  EXPECT_EQ(history[2].config->step_timeout_ms, 7000u);
  EXPECT_DOUBLE_EQ(history[3].config->selector_params.density, 0.07);
  EXPECT_EQ(history[3].effective_step, 40u);
  EXPECT_DOUBLE_EQ(history[3].config->selector_params.threshold, 0.002) << "later epochs build on the adopted ones";
  // Non-live knobs stay this node's own.
  EXPECT_EQ(history[3].config->rank, 1u);
  for (const auto& d : history) EXPECT_TRUE(d.error.ok()) << d.error.to_string();
}

TEST(DecisionsTest, AMalformedOrUnacceptableSnapshotLeavesTheBoardAsItWas) {
  Config c;
  c.rank = 1;
  c.world_size = 2;
  DecisionBoard board(c, nullptr);
  for (const char* bad : {"", "epoch 0 step 0 state 99 changes 0\ndensity=0.1\n",
                          "epoch x step 0 state 0 changes 0\n",
                          "epoch 0 step 0 state 12 changes 0\ndensity=0.1\nepoch 5 step 0 state 0 changes 0\n",
                          "epoch 0 step 0 state 12 changes 0\ndensity=0.1\nepoch 1 step 0 state 12 changes 0\ndensity=0.1\n",
                          "epoch 0 step 0 state 12 changes 0\ndensity=7.0\n", "epoch 0 step 0 state 10 changes 0\nnot_a=knob",
                          "epoch 0 step 0 state 7 changes 0\nrank=3\n", "epoch 0 step 0 state 0 changes 5\nnoeq\n"}) {
    EXPECT_FALSE(board.adopt(bad).ok()) << "'" << bad << "'";
    ASSERT_EQ(board.history().size(), 1u) << "'" << bad << "'";
    EXPECT_DOUBLE_EQ(board.latest().config->selector_params.density, c.selector_params.density);
  }
}

// Live settings last one job: `set` (any rank) changes the running job, and when every trainer has
// left and the next job starts on the same daemons, every node is back to the configured values,
// under a new epoch. A SIGHUP reload (set_configured) moves what they revert to.
TEST(DecisionsTest, LiveSettingsRevertToTheConfiguredValuesWhenANewJobStarts) {
  Job job(2, 0.01);  // "w", 1000 elements: top-k keeps round(density * 1000)
  uint64_t s = 0;
  EXPECT_EQ(job.step(s++)[0].nnz, 10u);
  auto d = job.nodes[1]->board->propose({{"density", "0.05"}, {"selector", "threshold"}}, "test",
                                        std::chrono::steady_clock::now() + 5s);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  for (; s <= d->effective_step; ++s) job.step(s);
  EXPECT_EQ(job.nodes[0]->board->latest().config->selector, kernels::Selector::kThreshold);

  auto next_job = [&] {
    for (auto& n : job.nodes) n->pipeline->reset();
    for (auto& n : job.nodes) ASSERT_TRUE(n->pipeline->register_tensor(0, {"w", 1000}).ok());
  };
  next_job();
  auto res = job.step(0);
  for (uint32_t r = 0; r < 2; ++r) {
    ASSERT_TRUE(res[r].status.ok()) << res[r].status.to_string();
    EXPECT_EQ(res[r].nnz, 10u) << "rank " << r << " kept the finished job's live settings";
    const Decision latest = job.nodes[r]->board->latest();
    EXPECT_EQ(latest.config->selector, kernels::Selector::kTopk);
    EXPECT_EQ(latest.config->selector_params.density, 0.01);
    EXPECT_EQ(latest.epoch, d->epoch + 1) << "the configured values come as a new epoch";
    EXPECT_EQ(latest.effective_step, 0u);
    EXPECT_EQ(job.nodes[r]->board->history().size(), 1u);
  }

  // A reload on every node: the next job starts from the reloaded values.
  for (auto& n : job.nodes) {
    Config reloaded = *n->board->latest().config;
    reloaded.selector_params.density = 0.03;
    n->board->set_configured(reloaded);
  }
  next_job();
  res = job.step(0);
  for (uint32_t r = 0; r < 2; ++r) {
    ASSERT_TRUE(res[r].status.ok()) << res[r].status.to_string();
    EXPECT_EQ(res[r].nnz, 30u) << "rank " << r;
  }

  // A job without any change keeps its epoch across the reset.
  const uint32_t epoch = job.nodes[0]->board->latest().epoch;
  next_job();
  ASSERT_TRUE(job.step(0)[0].status.ok());
  EXPECT_EQ(job.nodes[0]->board->latest().epoch, epoch);
}

TEST(DecisionsTest, ChangeLinesRoundTrip) {
  KnobChanges c{{"density", "0.5"}, {"selector", "threshold"}};
  auto back = parse_changes(format_changes(c));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(*back, c);
  EXPECT_FALSE(parse_changes("density").ok());
  EXPECT_FALSE(parse_changes("=3\n").ok());
}

// A rank other than 0 waits for rank 0's answer until the deadline on the board's clock: with a
// fake clock that stands still it keeps waiting, and it gives up once the clock passes the
// deadline, not before.
TEST(DecisionsClock, AnUnansweredProposalTimesOutOnTheBoardsClock) {
  testing::FakeClock clock;
  Config c;
  c.rank = 1;
  c.world_size = 2;
  DecisionBoard board(c, nullptr, clock);  // no transport: rank 0 never hears of it
  std::atomic<bool> passed{false};
  std::promise<std::pair<Code, bool>> result;  // propose()'s code, and whether the deadline had passed
  auto done = result.get_future();
  std::thread proposer([&] {
    auto d = board.propose({{"density", "0.05"}}, "test", clock.now() + 5s);
    result.set_value({d.status().code(), passed.load()});
  });
  EXPECT_EQ(done.wait_for(100ms), std::future_status::timeout) << "gave up before the deadline";
  clock.advance(5s - 1ms);
  EXPECT_EQ(done.wait_for(100ms), std::future_status::timeout) << "gave up 1 ms before the deadline";
  passed = true;
  clock.advance(1ms);
  ASSERT_EQ(done.wait_for(10s), std::future_status::ready) << "missed the deadline on the fake clock";
  const auto [code, after_deadline] = done.get();
  EXPECT_EQ(code, Code::kDeadlineExceeded);
  EXPECT_TRUE(after_deadline);
  proposer.join();
  EXPECT_EQ(board.latest().epoch, 0u);
}

}  // namespace
}  // namespace sparsecar

namespace sparsecar {
namespace {

TEST(KnobChangesTest, ASelectorSwitchCarriesTheNewLambdaWithIt) {
  // The budget controller's first decision from a top-k start: the threshold selector and its
  // calibrated lambda, both, or the first steps of the threshold run the operator's lambda.
  Config c;
  c.selector = kernels::Selector::kTopk;
  c.selector_params.density = 0.001;
  policies::ControlKnobs k = control_knobs_from_config(c);
  k.selector = kernels::Selector::kThreshold;
  k.threshold = 0.0471;
  const KnobChanges changes = knob_changes(c, k);
  ASSERT_EQ(changes.size(), 2u);
  EXPECT_EQ(changes[0].first, "selector");
  EXPECT_EQ(changes[1].first, "threshold");
  EXPECT_EQ(changes[1].second, "0.0471");
}

TEST(KnobChangesTest, AWarmUpCutIsAnAgreedKnobThatRoundTripsThroughTheConfig) {
  // The step controller (v6) ends the schedule's dense warm-up early by lowering
  // schedule_warmup_steps: the change must name that knob, and setting it on a node's config must
  // give back the same knobs (every node's schedule plans from it).
  Config c;
  c.schedule_warmup_steps = 100;
  policies::ControlKnobs k = control_knobs_from_config(c);
  ASSERT_EQ(k.schedule_warmup_steps, 100u);
  k.schedule_warmup_steps = 7;
  const KnobChanges changes = knob_changes(c, k);
  ASSERT_EQ(changes.size(), 1u);
  EXPECT_EQ(changes[0].first, "schedule_warmup_steps");
  EXPECT_EQ(changes[0].second, "7");
  ASSERT_TRUE(find_knob("schedule_warmup_steps")->agreed);
  ASSERT_TRUE(set_knob(c, changes[0].first, changes[0].second).ok());
  EXPECT_EQ(control_knobs_from_config(c), k);
}

}  // namespace
}  // namespace sparsecar
