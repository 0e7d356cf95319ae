// LinkProbe (daemon/pipeline/link_probe.h): when a node sends the step controller's link probe,
// to whom, how large, and how often. A recording transport holds each send until the test
// completes it, on a FakeClock, so the spacing (the first 3 steps and 1 s into a sparse plan, or
// a ring step's time for the probe's bytes / share where that is longer; then
// the probe's time / share, the longer of its send's and the predecessor's probe's as received
// here; at least 250 ms and 10 steps; one in flight; 5 s after a failure) is checked against the
// rule, step by step.
#include "daemon/pipeline/link_probe.h"

#include <gtest/gtest.h>

#include <chrono>
#include <functional>
#include <string>
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
    if (refuse) return unavailable("refused by the test");
    sent.push_back({peer, {header.begin(), header.end()}, {payload.begin(), payload.end()}, std::move(done)});
    return Status::Ok();
  }
  void stop() override {}
  void complete(size_t i, const Status& s = Status::Ok()) { sent.at(i).done(s); }

  std::vector<Sent> sent;
  bool refuse = false;

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
  ASSERT_TRUE(probe.after_step(facts(13))) << "LinkProbe::kStartAfterSteps after the first";
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
  const auto posted = clock.now();
  // In flight: no second one, however long it takes.
  for (int i = 0; i < 20; ++i, ++step) {
    clock.advance(1s);
    EXPECT_FALSE(probe.after_step(sparse_step(step)));
  }
  // It took 20 s: at a share of 2 % the next may go 1000 s after the first was posted.
  net.complete(0);
  const auto wait_until = [&](std::chrono::steady_clock::time_point t) {
    while (clock.now() + 1s < t) {
      EXPECT_FALSE(probe.after_step(sparse_step(step++))) << "too early";
      clock.advance(1s);
    }
    clock.set(t);
    EXPECT_TRUE(probe.after_step(sparse_step(step++)));
  };
  wait_until(posted + 1000s);
  ASSERT_EQ(net.sent.size(), 2u);
  // A fast one (1 ms) waits the least interval, 250 ms, and 10 steps.
  const auto second = clock.now();
  clock.advance(1ms);
  net.complete(1);
  const uint64_t at = step;
  clock.advance(300ms);
  for (; step < at + 9; ++step) EXPECT_FALSE(probe.after_step(sparse_step(step))) << "step " << step;
  EXPECT_TRUE(probe.after_step(sparse_step(step++)));
  EXPECT_GE(clock.now() - second, LinkProbe::kMinProbeInterval);
  ASSERT_EQ(net.sent.size(), 3u);
  net.complete(2);
  for (int i = 0; i < 20; ++i) EXPECT_FALSE(probe.after_step(sparse_step(step++))) << "the clock stood still";
  // Its send completed at once (its bytes went to the kernel's queues), but the predecessor's probe
  // of the same size took 100 ms to arrive here: the link's time is that, the next one 5 s after.
  const auto third = clock.now();
  LinkProbe::StepFacts got = sparse_step(step++);
  got.received_s = 0.1;
  EXPECT_FALSE(probe.after_step(got));
  wait_until(third + 5s);
  EXPECT_EQ(net.sent.size(), 4u);
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
  net.complete(0, unavailable("peer down"));
  clock.advance(4900ms);
  for (int i = 0; i < 12; ++i) EXPECT_FALSE(probe.after_step(sparse_step(step++)));
  clock.advance(100ms);
  EXPECT_TRUE(probe.after_step(sparse_step(step++)));
  net.complete(1);
  net.refuse = true;  // cannot even be queued: the same wait
  clock.advance(1h);
  step += 20;
  EXPECT_FALSE(probe.after_step(sparse_step(step++)));
  net.refuse = false;
  clock.advance(4s);
  step += 20;
  EXPECT_FALSE(probe.after_step(sparse_step(step++)));
  clock.advance(1s);
  // The ring ran in between: the sparse plan's first 3 steps and 1 s again.
  LinkProbe::StepFacts dense = sparse_step(step++);
  dense.wanted = false;
  EXPECT_FALSE(probe.after_step(dense));
  EXPECT_FALSE(probe.after_step(sparse_step(step++)));
  EXPECT_FALSE(probe.after_step(sparse_step(step++)));
  EXPECT_FALSE(probe.after_step(sparse_step(step++)));
  EXPECT_FALSE(probe.after_step(sparse_step(step++))) << "not 1 s into the sparse plan yet";
  clock.advance(LinkProbe::kStartAfter);
  EXPECT_TRUE(probe.after_step(sparse_step(step++)));
  ASSERT_EQ(net.sent.size(), 3u);
  net.complete(2);
  // A new job starts its steps at 0 again.
  probe.reset();
  clock.advance(1h);
  EXPECT_FALSE(probe.after_step(sparse_step(0)));
  clock.advance(LinkProbe::kStartAfter);
  EXPECT_FALSE(probe.after_step(sparse_step(1)));
  EXPECT_FALSE(probe.after_step(sparse_step(2)));
  EXPECT_TRUE(probe.after_step(sparse_step(3)));
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
  EXPECT_TRUE(probe.after_step(sparse_step(step++)));
  net.complete(0);
  // One stalled ring step does not hold the next plan's first probe off: of two, the shorter
  // (200 ms: 10 s); of the last three, the median (0.2, 30, 0.3 s: 300 ms, 15 s).
  const auto first_probe_after = [&](std::vector<double> ring_steps) {
    for (double r : ring_steps) {
      LinkProbe::StepFacts f = sparse_step(step++);
      f.wanted = false;
      f.ring_probe_s = r;
      EXPECT_FALSE(probe.after_step(f));
    }
    const auto plan = clock.now();
    while (!probe.after_step(sparse_step(step++))) clock.advance(100ms);
    net.complete(net.sent.size() - 1);
    return clock.now() - plan;
  };
  clock.advance(1h);
  EXPECT_EQ(first_probe_after({30.0}), 10s) << "200 ms and 30 s: the shorter";
  clock.advance(1h);
  EXPECT_EQ(first_probe_after({0.3}), 15s) << "200 ms, 30 s and 300 ms: the median";
  probe.reset();  // a new job: what the last one's ring took is not this one's
  EXPECT_FALSE(probe.after_step(sparse_step(0)));
  clock.advance(LinkProbe::kStartAfter);
  for (uint64_t s = 1; s < 3; ++s) EXPECT_FALSE(probe.after_step(sparse_step(s)));
  EXPECT_TRUE(probe.after_step(sparse_step(3)));
}

}  // namespace
}  // namespace sparsecar
