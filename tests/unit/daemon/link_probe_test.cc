// LinkProbe (daemon/pipeline/link_probe.h): when a node sends the step controller's link probe,
// to whom, how large, and how often. A recording transport holds each send until the test
// completes it, on a FakeClock, so the spacing (the first 3 steps and 1 s into a sparse plan, or
// a ring step's time for the probe's bytes / share where that is longer; then
// the probe's time / share, the longer of its send's and the predecessor's probe's as received
// here; at least 250 ms and 10 steps; one in flight; 5 s after a failure; once due, the next step
// of the grid of its wait, where the other nodes' probes go too) is checked against the rule,
// step by step.
#include "daemon/pipeline/link_probe.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "daemon/metrics/metrics.h"
#include "daemon/transport/wire.h"
#include "sparsecar/policies/link_model.h"
#include "tests/unit/common/fake_clock.h"

namespace sparsecar {
namespace {

using namespace std::chrono_literals;
using testing::FakeClock;

constexpr uint64_t kJob = 11;

// Keeps every send (a copy of its bytes and its callback) until the test completes it.
class RecordingTransport final : public Transport {
 public:
  explicit RecordingTransport(uint32_t rank, uint32_t world) : rank_(rank), world_(world) {}
  struct Sent {
    uint32_t peer;
    std::vector<std::byte> header, payload;
    SendCallback done;
  };
  uint32_t rank() const override { return rank_; }
  uint32_t world_size() const override { return world_; }
  std::string peer_name(uint32_t peer) const override { return "rank " + std::to_string(peer); }
  Status send(uint32_t peer, std::span<const std::byte> header, std::span<const std::byte> payload,
              SendCallback done) override {
    if (refuse) {
      ++refused;
      return unavailable("refused by the test");
    }
    sent.push_back({peer, {header.begin(), header.end()}, {payload.begin(), payload.end()}, std::move(done)});
    return Status::Ok();
  }
  void stop() override {}
  void complete(size_t i, const Status& s = Status::Ok()) { sent.at(i).done(s); }

  std::vector<Sent> sent;
  bool refuse = false;
  int refused = 0;  // sends refused while `refuse`

 private:
  uint32_t rank_, world_;
};

// The small digits MLP's tensors: the ring sends its successor 2 chunks of 128 KiB a step over 2 nodes.
const std::vector<uint64_t> kTensors = {65'536, 16'384, 2'560, 256, 10};

LinkProbe::StepFacts sparse_step(uint64_t step, double share = 0.02) {
  return {.step = step, .wanted = true, .share = share,
          .payload_bytes = policies::link_probe_payload_bytes(kTensors, 2)};
}

TEST(LinkProbe, SendsOneRingChunkToTheRingSuccessorAFewStepsIntoASparsePlan) {
  MetricsOptions options;
  options.rank = 1;
  options.world_size = 3;
  auto metrics = Metrics::create("off", options).value();
  FakeClock clock;
  RecordingTransport net(1, 3);  // rank 1 of 3: its successor is 2
  LinkProbe probe(1, kJob, &net, metrics.get(), clock);
  const auto facts = [](uint64_t step) {
    LinkProbe::StepFacts f = sparse_step(step);
    f.payload_bytes = policies::link_probe_payload_bytes(kTensors, 3);
    return f;
  };
  EXPECT_FALSE(probe.after_step(facts(10)));  // the sparse plan's first step
  clock.advance(LinkProbe::kStartAfter);
  EXPECT_FALSE(probe.after_step(facts(11)));
  EXPECT_FALSE(probe.after_step(facts(12)));
  // Due at 13 (LinkProbe::kStartAfterSteps after the first); its grid: 4, the least power of two
  // >= the 3 steps it waited.
  for (uint64_t s = 13; s < 16; ++s) EXPECT_FALSE(probe.after_step(facts(s))) << "step " << s << ": off its grid";
  ASSERT_TRUE(probe.after_step(facts(16)));
  ASSERT_EQ(net.sent.size(), 1u);
  const auto& m = net.sent[0];
  EXPECT_EQ(m.peer, 2u);
  EXPECT_EQ(m.payload.size(), 4u * 4 * 21'846) << "4 chunks of 65 536 elements / 3 nodes, rounded up, 4 bytes each";
  ASSERT_EQ(m.header.size(), wire::kHeaderBytes);
  std::span<const std::byte, wire::kHeaderBytes> fixed(m.header.data(), wire::kHeaderBytes);
  const wire::WireHeader h = wire::decode_header(fixed);
  EXPECT_EQ(h.kind, static_cast<uint16_t>(wire::Kind::kProbe));
  EXPECT_EQ(h.sender_rank, 1u);
  EXPECT_TRUE(wire::validate_header(h, {.job_id = kJob, .world_size = 3, .sender_rank = 1}, m.payload.size()).ok());
  EXPECT_TRUE(wire::verify_checksum(fixed, m.payload).ok());
  for (std::byte b : m.payload) ASSERT_EQ(b, std::byte{0});
  EXPECT_EQ(probe.sent(), 1u);
  const std::string text = metrics->scrape_text();
  EXPECT_NE(text.find(R"(sparsecar_link_probes_total{direction="sent"} 1)"), std::string::npos) << text;
  EXPECT_NE(text.find(R"(sparsecar_wire_bytes_sent_total{peer="2"} 349616)"), std::string::npos)
      << "80 + 349 536 bytes: " << text;
}

TEST(LinkProbe, TakesAtMostItsShareOfTheTimeOneAtATime) {
  FakeClock clock;
  RecordingTransport net(0, 2);
  LinkProbe probe(0, kJob, &net, nullptr, clock);
  uint64_t step = 0;
  while (net.sent.empty() && step < 20) {
    if (!probe.after_step(sparse_step(step++))) clock.advance(200ms);
  }
  ASSERT_EQ(net.sent.size(), 1u);
  uint64_t last = step - 1;
  uint64_t grid = 0;  // the plan's first probe hands its grid (8) on to none
  EXPECT_EQ(last, 8u) << "due at step 5 (1 s, 200 ms a step), on the grid of 8 (its 5 steps' wait) at 8";
  const auto posted = clock.now();
  // In flight: no second one, however long it takes.
  for (int i = 0; i < 20; ++i, ++step) {
    clock.advance(1s);
    EXPECT_FALSE(probe.after_step(sparse_step(step)));
  }
  // It took 20 s: at a share of 2 % 1000 s, and the back-off makes the wait after a plan's first
  // probe 2x that: the next may go 2000 s after the first was posted.
  net.complete(0);
  // Steps 1 s apart until t, none goes before it; due there, it goes at the next step of the grid
  // of its wait (the clock stands still meanwhile).
  const auto wait_until = [&](std::chrono::steady_clock::time_point t) {
    while (clock.now() + 1s < t) {
      EXPECT_FALSE(probe.after_step(sparse_step(step++))) << "too early";
      clock.advance(1s);
    }
    clock.set(t);
    const uint64_t due = step;
    grid = LinkProbe::grid_for(due - last, grid);
    const uint64_t at = LinkProbe::next_on_grid(due, grid);
    for (; step < at; ++step) EXPECT_FALSE(probe.after_step(sparse_step(step))) << "due at " << due << ", not " << at;
    EXPECT_TRUE(probe.after_step(sparse_step(step++))) << "step " << at;
    last = at;
  };
  wait_until(posted + 2000s);
  ASSERT_EQ(net.sent.size(), 2u);
  // A fast one (1 ms; 4x: 200 ms) waits the least interval, 250 ms, and 10 steps.
  const auto second = clock.now();
  clock.advance(1ms);
  net.complete(1);
  const uint64_t at = step;
  clock.advance(300ms);
  for (; step < at + 9; ++step) EXPECT_FALSE(probe.after_step(sparse_step(step))) << "step " << step;
  const uint64_t due = step;  // 10 steps after the last
  ASSERT_EQ(due, last + LinkProbe::kMinProbeSteps);
  grid = LinkProbe::grid_for(LinkProbe::kMinProbeSteps, grid);
  ASSERT_EQ(grid, 16u) << "10 steps, 4x below the last grid: its own";
  for (; step < LinkProbe::next_on_grid(due, grid); ++step) {
    EXPECT_FALSE(probe.after_step(sparse_step(step))) << "step " << step << ": off the grid of 16";
  }
  EXPECT_TRUE(probe.after_step(sparse_step(step++)));
  last = step - 1;
  EXPECT_GE(clock.now() - second, LinkProbe::kMinProbeInterval);
  ASSERT_EQ(net.sent.size(), 3u);
  net.complete(2);
  for (int i = 0; i < 20; ++i) EXPECT_FALSE(probe.after_step(sparse_step(step++))) << "the clock stood still";
  // Its send completed at once (its bytes went to the kernel's queues), but the predecessor's probe
  // of the same size took 100 ms to arrive here: the link's time is that, 5 s by the share; after
  // the plan's third probe the back-off waits 8x that.
  const auto third = clock.now();
  LinkProbe::StepFacts got = sparse_step(step++);
  got.received_s = 0.1;
  EXPECT_FALSE(probe.after_step(got));
  wait_until(third + 40s);
  EXPECT_EQ(net.sent.size(), 4u);
}

TEST(LinkProbe, AProbeCostsTheStepsItDelays) {
  // Steps of 20 ms. A probe whose send completes in 1 ms, no probe received: by its own time the
  // next may go 250 ms (kMinProbeInterval) and 10 steps later. If the 2 steps after its post took
  // 90 ms more each than the node's pace (the messages held behind it), it cost 180 ms: at a
  // share of 2 % 9 s, and the back-off makes the wait after a plan's first probe 2x that, 18 s. A
  // ring step among them (no probe wanted: the plan moved) is no stall of it, however long: 90 ms,
  // 4.5 s (the sparse plan after it is a new one: its back-off starts over).
  struct Case {
    double stall;  // extra seconds on each step after the post that counts
    bool ring;     // the second step after the post runs the ring, 5 s
    double cost;   // what the probe cost
  };
  for (const Case c : {Case{0.0, false, 0.0}, Case{0.09, false, 0.18}, Case{0.09, true, 0.09}}) {
    SCOPED_TRACE(c.cost);
    FakeClock clock;
    RecordingTransport net(0, 2);
    LinkProbe probe(0, kJob, &net, nullptr, clock);
    uint64_t step = 0;
    std::chrono::steady_clock::time_point posted{};
    const auto run_step = [&](double extra, bool wanted = true) {
      LinkProbe::StepFacts f = sparse_step(step++);
      f.wanted = wanted;
      f.step_s = 0.020 + extra;
      clock.advance(std::chrono::duration_cast<std::chrono::steady_clock::duration>(std::chrono::duration<double>(f.step_s)));
      const bool sent = probe.after_step(f);
      if (sent) posted = clock.now();
      return sent;
    };
    while (net.sent.empty() && step < 200) run_step(0);
    ASSERT_EQ(net.sent.size(), 1u);
    clock.advance(1ms);
    net.complete(0);
    const auto first_at = posted;
    ASSERT_FALSE(run_step(c.stall)) << "in the steps it delays";
    ASSERT_FALSE(c.ring ? run_step(4.98, /*wanted=*/false) : run_step(c.stall));
    while (net.sent.size() == 1 && step < 5000) run_step(0);
    ASSERT_EQ(net.sent.size(), 2u);
    const double waited = std::chrono::duration<double>(posted - first_at).count();
    if (c.cost == 0) {
      EXPECT_LT(waited, 1.0) << "250 ms and 10 steps, then its grid";
    } else {
      // x2 after a plan's first probe; a ring step between starts a new plan, whose back-off starts over.
      const double backoff = c.ring ? 1 : 2;
      EXPECT_GE(waited, backoff * c.cost / 0.02) << "the stall / the share, x" << backoff;
      EXPECT_LT(waited, 2 * backoff * c.cost / 0.02 + 6) << "on the grid of its wait: at most twice it (and a ring step)";
    }
  }
}

// The back-off: the waits after a plan's probes grow 2x, 4x, then 8x the share's; a
// predecessor's probe received in half the time of the one before (a rise) makes the next wait
// the share's again, and so does a new sparse plan. Steps of 10 ms; every probe's send completes
// in 1 ms and the predecessor's (the same steps: the grid) arrives in 10 ms, the step after it:
// by the share alone each would wait 10 ms / 2 % = 0.5 s.
TEST(LinkProbe, TheWaitsBackOffUpToEightTimesTheSharesAndARiseOrANewPlanStartsOver) {
  FakeClock clock;
  RecordingTransport net(0, 2);
  LinkProbe probe(0, kJob, &net, nullptr, clock);
  uint64_t step = 0;
  double next_received = 0;  // what the predecessor's probe of this step took, timed here
  std::vector<std::chrono::steady_clock::time_point> posts;
  const auto run_until_sent = [&](double received_s, bool wanted = true) {
    const size_t before = net.sent.size();
    for (int i = 0; i < 100'000 && net.sent.size() == before; ++i) {
      LinkProbe::StepFacts f = sparse_step(step++);
      f.wanted = wanted;
      f.received_s = std::exchange(next_received, 0);
      clock.advance(10ms);
      if (probe.after_step(f)) {
        posts.push_back(clock.now());
        clock.advance(1ms);
        net.complete(net.sent.size() - 1);
        next_received = received_s;
      }
      if (!wanted) return;
    }
  };
  const auto waited = [&](size_t i) { return std::chrono::duration<double>(posts.at(i) - posts.at(i - 1)).count(); };
  for (int i = 0; i < 7; ++i) run_until_sent(0.010);
  ASSERT_EQ(posts.size(), 7u);
  // The waits after probes 1 .. 6: 0.5 s x 2, 4, 8, 8, 8, 8; once due, the next step of the grid
  // of its wait (less than twice the wait past it).
  const double factor[] = {0, 2, 4, 8, 8, 8, 8};
  for (size_t i = 1; i < posts.size(); ++i) {
    SCOPED_TRACE("the wait after probe " + std::to_string(i));
    EXPECT_GE(waited(i), 0.5 * factor[i]);
    EXPECT_LT(waited(i), 3 * 0.5 * factor[i]);
  }
  // A rise: the predecessor's probe after the 8th took 4 ms (<= half of the 10 ms before): the
  // wait after the 8th (for the probe that confirms it) is the share's again, 4 ms / 2 % = 0.2 s,
  // at least 250 ms; then 2x, 4x.
  run_until_sent(0.004);  // the 8th, after the 7th's 8x wait
  run_until_sent(0.004);
  run_until_sent(0.004);
  run_until_sent(0.004);
  ASSERT_EQ(posts.size(), 11u);
  EXPECT_GE(waited(7), 0.5 * 8) << "before the rise was seen";
  EXPECT_LT(waited(8), 0.75) << "the share's wait (8x: 1.6 s)";
  EXPECT_GE(waited(9), 0.2 * 2) << "then 2x";
  EXPECT_GE(waited(10), 0.2 * 4) << "and 4x";
  // A new plan (a dense step between) starts over: its first probe waits kStartAfter, the one
  // after it 2x the share's time (from the 10th on, 8x: 1.6 s).
  run_until_sent(0.004, /*wanted=*/false);
  run_until_sent(0.004);
  run_until_sent(0.004);
  ASSERT_EQ(posts.size(), 13u);
  EXPECT_GE(waited(11), 1.0) << "kStartAfter into the new plan";
  EXPECT_LT(waited(12), 3 * 0.4) << "the new plan's second probe: 2x the share's wait (8x: 1.6 s)";
}

TEST(LinkProbe, NoProbeUnlessASparsePlanRunsWithTheRingACandidate) {
  FakeClock clock;
  RecordingTransport net(0, 2);
  LinkProbe probe(0, kJob, &net, nullptr, clock);
  for (uint64_t s = 0; s < 50; ++s, clock.advance(1s)) {
    LinkProbe::StepFacts f = sparse_step(s);
    switch (s % 4) {
      case 0: f.wanted = false; break;  // a dense step, the ring not allowed, no step controller
      case 1: f.share = 0; break;       // step_probe_share 0
      case 2: f.payload_bytes = 0; break;  // a ring too small to probe
      case 3: f.payload_bytes = wire::kMaxProbePayloadBytes + 1; break;  // more than a receiver takes
    }
    EXPECT_FALSE(probe.after_step(f)) << "step " << s;
  }
  EXPECT_TRUE(net.sent.empty());
  RecordingTransport alone(0, 1);
  LinkProbe single(0, kJob, &alone, nullptr, clock);
  for (uint64_t s = 0; s < 20; ++s) EXPECT_FALSE(single.after_step(sparse_step(s)));
  LinkProbe none(0, kJob, nullptr, nullptr, clock);
  for (uint64_t s = 0; s < 20; ++s) EXPECT_FALSE(none.after_step(sparse_step(s)));
}

TEST(LinkProbe, AFailedProbeWaitsFiveSecondsAndANewPlanOrJobWaitsItsFirstSteps) {
  FakeClock clock;
  RecordingTransport net(0, 2);
  LinkProbe probe(0, kJob, &net, nullptr, clock);
  uint64_t step = 0;
  for (; net.sent.empty() && step < 20; ++step, clock.advance(200ms)) probe.after_step(sparse_step(step));
  ASSERT_EQ(net.sent.size(), 1u);
  const uint64_t first = step - 1;
  net.complete(0, unavailable("peer down"));
  clock.advance(4900ms);
  for (int i = 0; i < 12; ++i) EXPECT_FALSE(probe.after_step(sparse_step(step++)));
  clock.advance(100ms);
  // Due now (5 s after the failure): it goes at the grid's next step.
  for (const uint64_t at = LinkProbe::next_on_grid(step, LinkProbe::grid_for(step - first, 8)); step < at; ++step) {
    EXPECT_FALSE(probe.after_step(sparse_step(step))) << "step " << step;
  }
  EXPECT_TRUE(probe.after_step(sparse_step(step++)));
  net.complete(1);
  net.refuse = true;  // cannot even be queued: the same wait
  clock.advance(1h);
  step += 20;
  for (int i = 0; i < 64 && net.refused == 0; ++i) EXPECT_FALSE(probe.after_step(sparse_step(step++)));
  ASSERT_EQ(net.refused, 1) << "tried on its grid's step";
  net.refuse = false;
  clock.advance(4s);
  step += 20;
  EXPECT_FALSE(probe.after_step(sparse_step(step++)));
  clock.advance(1s);
  // The ring ran in between: the sparse plan's first 3 steps and 1 s again.
  LinkProbe::StepFacts dense = sparse_step(step++);
  dense.wanted = false;
  EXPECT_FALSE(probe.after_step(dense));
  const uint64_t plan = step;
  EXPECT_FALSE(probe.after_step(sparse_step(step++)));
  EXPECT_FALSE(probe.after_step(sparse_step(step++)));
  EXPECT_FALSE(probe.after_step(sparse_step(step++)));
  EXPECT_FALSE(probe.after_step(sparse_step(step++))) << "not 1 s into the sparse plan yet";
  clock.advance(LinkProbe::kStartAfter);
  for (const uint64_t at = LinkProbe::next_on_grid(step, LinkProbe::grid_for(step - plan, 0)); step < at; ++step) {
    EXPECT_FALSE(probe.after_step(sparse_step(step))) << "step " << step;
  }
  EXPECT_TRUE(probe.after_step(sparse_step(step++)));
  ASSERT_EQ(net.sent.size(), 3u);
  net.complete(2);
  // A new job starts its steps at 0 again: due at 3, on the grid of 4 at 4.
  probe.reset();
  clock.advance(1h);
  EXPECT_FALSE(probe.after_step(sparse_step(0)));
  clock.advance(LinkProbe::kStartAfter);
  EXPECT_FALSE(probe.after_step(sparse_step(1)));
  EXPECT_FALSE(probe.after_step(sparse_step(2)));
  EXPECT_FALSE(probe.after_step(sparse_step(3)));
  EXPECT_TRUE(probe.after_step(sparse_step(4)));
}

// The ring's distance: every wait is also times a ring step's whole time over the sparse plan's
// price (this node's pace times step_dense_worth), from 1 to kMaxDistance (8).
TEST(LinkProbe, TheRingsDistanceStretchesEveryWait) {
  // Three ring steps of `ring_step` s (their exchange 10 ms for a probe's bytes: 0.5 s at 2 %),
  // then sparse steps of 10 ms priced at 12.5 ms (step_dense_worth 1.25); the predecessor's
  // probe takes 10 ms here, so the wait after a plan's first probe is 10 ms / 2 % x 2 (the
  // back-off) = 1 s. Returns the seconds from the plan's start to its first probe and from that
  // one to the second.
  const auto spacing = [](double ring_step) {
    FakeClock clock;
    RecordingTransport net(0, 2);
    LinkProbe probe(0, kJob, &net, nullptr, clock);
    uint64_t step = 0;
    for (int i = 0; i < 3; ++i) {
      LinkProbe::StepFacts f = sparse_step(step++);
      f.wanted = false;
      f.ring_probe_s = 0.010;
      f.ring_step_s = ring_step;
      f.step_s = ring_step;
      f.ring_ran = true;  // the daemons' ring (not the trainers' hint: below)
      EXPECT_FALSE(probe.after_step(f));
      clock.advance(std::chrono::duration_cast<FakeClock::duration>(std::chrono::duration<double>(ring_step)));
    }
    const auto start = clock.now();
    std::vector<double> at;
    double received = 0;
    while (at.size() < 2 && step < 100'000) {
      clock.advance(10ms);
      LinkProbe::StepFacts f = sparse_step(step++);
      f.step_s = 0.010;
      f.dense_worth = 1.25;
      f.received_s = std::exchange(received, 0.0);
      if (probe.after_step(f)) {
        at.push_back(std::chrono::duration<double>(clock.now() - start).count());
        net.complete(net.sent.size() - 1);
        received = 0.010;
      }
    }
    EXPECT_EQ(at.size(), 2u);
    at.resize(2);
    return std::pair{at[0], at[1] - at[0]};
  };
  // Once due, a probe goes at the next step of its grid: less than twice its wait (+ a step).
  const auto expect_within = [](double got, double wait, const char* what) {
    EXPECT_GE(got, wait) << what;
    EXPECT_LT(got, 2 * wait + 0.011) << what;
  };
  // A ring within the sparse price (8 ms, 0.64x): waits as without a distance, kStartAfter (1 s)
  // for the first (over its 0.5 s share) and 1 s for the second.
  auto [first, second] = spacing(0.008);
  expect_within(first, 1.0, "the first probe, distance 1");
  expect_within(second, 1.0, "the second, distance 1");
  // A ring of 50 ms, 4x the price: the first's 0.5 s share x 4 = 2 s, the second's 1 s x 4.
  std::tie(first, second) = spacing(0.050);
  expect_within(first, 2.0, "the first probe, distance 4");
  expect_within(second, 4.0, "the second, distance 4");
  // A ring of 1 s, 80x the price: kMaxDistance, 8.
  std::tie(first, second) = spacing(1.0);
  expect_within(first, 0.5 * LinkProbe::kMaxDistance, "the first probe, distance 8 (the most)");
  expect_within(second, 1.0 * LinkProbe::kMaxDistance, "the second, distance 8");
}

// The hint's ring: where the daemons have not run the ring this job (a warm-up cut before it
// started), its only price is the trainers' dense step (StepFacts::ring_step_s on the first
// sparse step, not ring_ran). The job's first two probes (kEarlyProbes) then go early, where the
// ring's distance (that step over the pace times step_dense_worth) is at most kEarlyDistance
// (2.5): the first kEarlySteps (8) into the plan, the second kMinProbeSteps (10) after it, each
// on its wait's grid, without waiting for kStartAfter or the share; the third waits as after any
// probe. Else, or once the daemons ran the ring, or for a later plan, the first waits as any.
TEST(LinkProbe, AJobWhoseRingOnlyTheHintPricedProbesItEarlyWhereTheRingIsNear) {
  // Sparse steps of 10 ms priced at 16 ms (worth 1.6) from step 2; the hint's dense step `hint`
  // (its wait 20 ms for a probe's bytes: 1 s at 2 %) arrives with the first; each probe completes
  // at once. The steps of the plan's first `count` probes, and with `ring_after`, after the first
  // a ring step, then how many steps into the next sparse plan its first probe went.
  struct Probes {
    std::vector<uint64_t> at;
    uint64_t next_plan = 0;
  };
  const auto probes = [](double hint, bool ring_ran_first, size_t count, bool ring_after = false) {
    FakeClock clock;
    RecordingTransport net(0, 2);
    LinkProbe probe(0, kJob, &net, nullptr, clock);
    uint64_t step = 2;
    if (ring_ran_first) {  // the warm-up's ring through the daemons
      LinkProbe::StepFacts f = sparse_step(step++);
      f.wanted = false;
      f.ring_ran = true;
      f.ring_probe_s = 0.020;
      f.ring_step_s = f.step_s = hint;
      EXPECT_FALSE(probe.after_step(f));
      clock.advance(20ms);
    }
    const auto sparse = [&](bool with_hint) {
      LinkProbe::StepFacts f = sparse_step(step++);
      f.step_s = 0.010;
      f.dense_worth = 1.6;
      if (with_hint) {
        f.ring_probe_s = 0.020;
        f.ring_step_s = hint;
      }
      clock.advance(10ms);
      const bool sent = probe.after_step(f);
      if (sent) net.complete(net.sent.size() - 1);
      return sent;
    };
    Probes out;
    for (bool first = true; step < 5000 && out.at.size() < count; first = false) {
      if (sparse(first && !ring_ran_first)) out.at.push_back(step - 1);
    }
    if (ring_after) {
      clock.advance(1h);  // no wait after the last probe is left
      LinkProbe::StepFacts ring = sparse_step(step++);
      ring.wanted = false;
      ring.ring_ran = true;
      ring.ring_step_s = ring.step_s = hint;
      EXPECT_FALSE(probe.after_step(ring));
      const uint64_t plan = step;
      while (step < 5000 && !sparse(false)) {}
      out.next_plan = step - 1 - plan;
    }
    return out;
  };
  // 24 ms: 1.5x the price. The first due 8 steps into the plan (step 10), on the grid of 8 at 16,
  // where a first probe waits for kStartAfter (1 s: step 102, on the grid of 128 at 128); the
  // second due 10 steps later (26), on the grid of 16 at 32; the third waits at least
  // kMinProbeInterval (250 ms: 25 steps).
  const Probes near = probes(0.024, false, 3, false);
  ASSERT_EQ(near.at.size(), 3u);
  EXPECT_EQ(near.at[0], 16u) << "the hint's ring within 2.5x of the price";
  EXPECT_EQ(near.at[1], 32u) << "the second early probe";
  EXPECT_GE(near.at[2], near.at[1] + 25) << "the third waits as after any probe";
  const Probes bound = probes(0.040, false, 2);
  EXPECT_EQ(bound.at, (std::vector<uint64_t>{16, 32})) << "at 2.5x, the bound";
  // Else the share's wait: 20 ms / 2 % x the distance, from the plan's first step; once due, at
  // the next step of its grid (less than twice the wait).
  const auto expect_waited = [](uint64_t at, uint64_t plan, double wait_s, const char* what) {
    const double steps = wait_s / 0.010;
    EXPECT_GE(static_cast<double>(at - plan), steps - 1) << what;
    EXPECT_LT(static_cast<double>(at - plan), 2 * steps + 2) << what;
  };
  expect_waited(probes(0.024, true, 1).at.at(0), 3, 1.5, "the daemons ran the ring: its price is theirs (1.5x: 1.5 s)");
  expect_waited(probes(0.041, false, 1).at.at(0), 2, 2.5625, "past 2.5x (2.56x: 2.56 s)");
  const Probes after = probes(0.024, false, 1, true);
  EXPECT_EQ(after.at, (std::vector<uint64_t>{16}));
  expect_waited(after.next_plan, 0, 1.5, "the next plan's first probe, after the daemons' ring step");
}

TEST(LinkProbe, TheFirstProbeWaitsForTheExpectedTimeOverTheShareAndAJobForgetsIt) {
  FakeClock clock;
  RecordingTransport net(0, 2);
  LinkProbe probe(0, kJob, &net, nullptr, clock);
  LinkProbe::StepFacts ring = sparse_step(0);
  ring.wanted = false;     // a ring step ...
  ring.ring_probe_s = 0.2;  // ... that took 200 ms for a probe's bytes: 10 s at 2 %
  EXPECT_FALSE(probe.after_step(ring));
  uint64_t step = 1;
  const auto start = clock.now();
  while (clock.now() - start < 10s) {
    EXPECT_FALSE(probe.after_step(sparse_step(step++))) << "too early";
    clock.advance(500ms);
  }
  EXPECT_EQ(step, 21u) << "due at step 21 (20 steps of 500 ms); on the grid of 32 at 32";
  for (; step < 32; ++step) EXPECT_FALSE(probe.after_step(sparse_step(step))) << "step " << step;
  EXPECT_TRUE(probe.after_step(sparse_step(step++)));
  net.complete(0);
  // One stalled ring step does not hold the next plan's first probe off: of two, the shorter
  // (200 ms: 10 s); of the last three, the median (0.2, 30, 0.3 s: 300 ms, 15 s). Steps of 100 ms:
  // due `wait` / 100 ms steps into the plan; it goes at the next step of that wait's grid.
  const auto first_probe_after = [&](std::vector<double> ring_steps, std::chrono::milliseconds wait) {
    for (double r : ring_steps) {
      LinkProbe::StepFacts f = sparse_step(step++);
      f.wanted = false;
      f.ring_probe_s = r;
      EXPECT_FALSE(probe.after_step(f));
    }
    const uint64_t plan = step;
    while (!probe.after_step(sparse_step(step++))) clock.advance(100ms);
    net.complete(net.sent.size() - 1);
    const uint64_t waited = static_cast<uint64_t>(wait / 100ms);
    return std::pair{step - 1, LinkProbe::next_on_grid(plan + waited, LinkProbe::grid_for(waited, 0))};
  };
  clock.advance(1h);
  const auto [two, two_expected] = first_probe_after({30.0}, 10s);
  EXPECT_EQ(two, two_expected) << "200 ms and 30 s: the shorter, 10 s";
  clock.advance(1h);
  const auto [three, three_expected] = first_probe_after({0.3}, 15s);
  EXPECT_EQ(three, three_expected) << "200 ms, 30 s and 300 ms: the median, 15 s";
  probe.reset();  // a new job: what the last one's ring took is not this one's
  EXPECT_FALSE(probe.after_step(sparse_step(0)));
  clock.advance(LinkProbe::kStartAfter);
  for (uint64_t s = 1; s < 4; ++s) EXPECT_FALSE(probe.after_step(sparse_step(s)));
  EXPECT_TRUE(probe.after_step(sparse_step(4))) << "due at 3 (1 s and 3 steps), on the grid of 4 at 4";
}

// The grid, by its definition: a power of two of steps >= the wait, kept while the waits are
// within 4x below it; a probe goes at the first step >= due divisible by it.
TEST(LinkProbe, AProbeGoesAtTheNextStepOfItsGrid) {
  EXPECT_EQ(LinkProbe::grid_for(3, 0), 4u);
  EXPECT_EQ(LinkProbe::grid_for(285, 0), 512u);
  EXPECT_EQ(LinkProbe::grid_for(256, 0), 256u);
  EXPECT_EQ(LinkProbe::grid_for(0, 0), 1u);
  EXPECT_EQ(LinkProbe::grid_for(300, 512), 512u) << "kept";
  EXPECT_EQ(LinkProbe::grid_for(128, 512), 512u) << "kept: a quarter";
  EXPECT_EQ(LinkProbe::grid_for(127, 512), 128u) << "below a quarter: its own";
  EXPECT_EQ(LinkProbe::grid_for(513, 512), 1024u) << "a longer wait: its own";
  EXPECT_EQ(LinkProbe::next_on_grid(13, 4), 16u);
  EXPECT_EQ(LinkProbe::next_on_grid(512, 512), 512u);
  EXPECT_EQ(LinkProbe::next_on_grid(7, 0), 7u);
  constexpr uint64_t kTop = std::numeric_limits<uint64_t>::max();
  EXPECT_EQ(LinkProbe::next_on_grid(kTop - 3, 1024), kTop - 3) << "no step of the grid above it";
  EXPECT_EQ(LinkProbe::grid_for(uint64_t{1} << 50, 0), LinkProbe::kMaxGrid);
  std::mt19937_64 rng(5);
  for (int i = 0; i < 10'000; ++i) {
    const uint64_t due = rng() % 1'000'000, waited = 1 + rng() % 100'000, last = uint64_t{1} << (rng() % 20);
    const uint64_t grid = LinkProbe::grid_for(waited, last);
    ASSERT_EQ(grid & (grid - 1), 0u) << "a power of two: " << grid;
    ASSERT_GE(grid, waited);
    ASSERT_TRUE(grid == last || grid < 2 * waited) << waited << " " << last << " " << grid;
    ASSERT_LE(grid, 4 * waited);
    const uint64_t at = LinkProbe::next_on_grid(due, grid);
    ASSERT_EQ(at % grid, 0u) << due << " " << grid;
    ASSERT_GE(at, due);
    ASSERT_LT(at - due, grid);
  }
}

// Two nodes whose probes take 10 ms (then 32 ms) at 3.5 ms a step, each timed with ±20 % noise as
// the other receives it: their waits differ, but their probes go at the same steps, so a step
// waits for the job's probes once, not once per node; and each keeps to its share (and uses at
// least a third of it).
TEST(LinkProbe, TheNodesProbesGoAtTheSameSteps) {
  FakeClock clock;
  RecordingTransport net_a(0, 2), net_b(1, 2);
  LinkProbe a(0, kJob, &net_a, nullptr, clock), b(1, kJob, &net_b, nullptr, clock);
  std::mt19937_64 rng(9);
  std::uniform_real_distribution<double> noise(0.8, 1.2);
  std::vector<uint64_t> steps_a, steps_b;
  double took_a = 0, took_b = 0;        // each one's last probe, as its receiver timed it
  double link_a_s = 0, link_b_s = 0;    // the link time of every probe sent
  constexpr auto kStep = 3500us;
  constexpr uint64_t kSteps = 60'000;   // 210 s
  for (uint64_t step = 0; step < kSteps; ++step, clock.advance(kStep)) {
    // A slower link half way. 6.5 ms: the waits after the first probes (x2, x4, x8 the share's: 186,
    // 371, 743 steps, +-20 % by the noise) stay clear of a power of two, so that on the steady
    // first half both nodes grow the same grids.
    const double d = step < kSteps / 2 ? 0.0065 : 0.032;
    LinkProbe::StepFacts fa = sparse_step(step), fb = sparse_step(step);
    fa.received_s = std::exchange(took_b, 0);  // b's probe, timed at a
    fb.received_s = std::exchange(took_a, 0);
    if (a.after_step(fa)) {
      steps_a.push_back(step);
      took_a = d * noise(rng);
      link_a_s += took_a;
      net_a.complete(net_a.sent.size() - 1);
    }
    if (b.after_step(fb)) {
      steps_b.push_back(step);
      took_b = d * noise(rng);
      link_b_s += took_b;
      net_b.complete(net_b.sent.size() - 1);
    }
  }
  // On the steady first half, the same steps. After the slowdown each grows its grid when its own
  // wait outgrows it, and until both have, the one still on the finer grid probes alone every
  // other time: the coarser one's steps are the finer one's, so a step never waits for two
  // probes sent apart.
  const auto before = [](const std::vector<uint64_t>& v, uint64_t step) {
    return std::vector<uint64_t>(v.begin(), std::lower_bound(v.begin(), v.end(), step));
  };
  EXPECT_EQ(before(steps_a, kSteps / 2), before(steps_b, kSteps / 2));
  ASSERT_GE(steps_a.size(), 3u);
  EXPECT_EQ(steps_a[0], 512u) << "the first waits 1 s (286 steps): on the grid of 512";
  EXPECT_EQ(steps_a[1] - steps_a[0], 256u) << "6.5 ms / 2 % x2 = 0.65 s (186 steps): a grid of its own, 256";
  EXPECT_GE(steps_a[2] - steps_a[1], 297u) << "x4 after its second: 371 steps +-20 %";
  EXPECT_EQ(steps_a[2] % 512, 0u) << "on its grid of 512";
  EXPECT_TRUE(std::includes(steps_a.begin(), steps_a.end(), steps_b.begin(), steps_b.end()) ||
              std::includes(steps_b.begin(), steps_b.end(), steps_a.begin(), steps_a.end()));
  EXPECT_NE(steps_a, steps_b) << "the seed's noise gives a transition (else this test checks less than it says)";
  const double seconds = std::chrono::duration<double>(kStep * kSteps).count();
  for (double link_s : {link_a_s, link_b_s}) {
    // After a plan's first probes the back-off waits 8x the share's time (and a grid up to 2x).
    EXPECT_LE(link_s / seconds, 0.02 / LinkProbe::kMaxBackoff * 1.3) << "an eighth of its share, within the noise";
    EXPECT_GE(link_s / seconds, 0.02 / LinkProbe::kMaxBackoff / 3) << "at least a third of that";
  }
}

TEST(LinkProbe, TheJobsProbesAreCountedWithTheirStepsAndAResetForgetsThem) {
  FakeClock clock;
  RecordingTransport net(1, 2);  // rank 1 of 2: its successor is 0
  LinkProbe probe(1, kJob, &net, nullptr, clock);
  EXPECT_EQ(probe.job_summary(), "") << "no probe yet";
  // Steps 1 s apart, each probe's send completing within the step: every probe waits its share's
  // time (or the least interval and steps) and goes on its grid; the steps it went at are the job's.
  std::vector<uint64_t> went;
  uint64_t step = 0;
  while (went.size() < LinkProbe::kJobStepsKept + 3 && step < 100'000) {
    if (probe.after_step(sparse_step(step))) {
      went.push_back(step);
      net.complete(net.sent.size() - 1);
    }
    ++step;
    clock.advance(1s);
  }
  ASSERT_EQ(went.size(), LinkProbe::kJobStepsKept + 3);
  EXPECT_EQ(probe.job_sent(), went.size());
  EXPECT_EQ(net.sent.size(), went.size());
  const std::vector<uint64_t> kept(went.begin(), went.begin() + LinkProbe::kJobStepsKept);
  EXPECT_EQ(probe.job_steps(), kept) << "the first " << LinkProbe::kJobStepsKept << " only";
  std::string steps;
  for (uint64_t s : kept) steps += (steps.empty() ? "" : ",") + std::to_string(s);
  EXPECT_EQ(probe.job_summary(),
            "link probes this job: " + std::to_string(went.size()) + " sent to rank 0, at steps " + steps + ",...");
  // A new job: none of them.
  probe.reset();
  EXPECT_EQ(probe.job_sent(), 0u);
  EXPECT_TRUE(probe.job_steps().empty());
  EXPECT_EQ(probe.job_summary(), "");
  EXPECT_EQ(probe.sent(), went.size()) << "the daemon's total stays";
  // One probe in the next job: its step, no ellipsis.
  uint64_t first = 0;
  for (uint64_t s = 0; s < 1000 && first == 0; ++s, clock.advance(1s)) {
    if (probe.after_step(sparse_step(s))) first = s;
  }
  ASSERT_GT(first, 0u);
  EXPECT_EQ(probe.job_summary(), "link probes this job: 1 sent to rank 0, at steps " + std::to_string(first));
}

}  // namespace
}  // namespace sparsecar
