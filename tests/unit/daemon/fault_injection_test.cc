// The test-only fault switch (FaultyTransport) over the in-process FakeNetwork: each fault does
// what it says at rate 1, the sender's `done` runs exactly once whatever happened, and the
// caller's buffers are never written. A delay is measured on the clock the switch is given.
#include "daemon/transport/fault_injection.h"

#include <gtest/gtest.h>

#include <atomic>
#include <bit>
#include <chrono>
#include <thread>

#include "tests/unit/common/fake_clock.h"
#include "tests/unit/daemon/fake_transport.h"

namespace sparsecar {
namespace {

using namespace std::chrono_literals;

struct Received {
  std::vector<std::byte> header, payload;
};

class Recorder final : public MessageSink {
 public:
  void on_message(uint32_t, std::span<const std::byte> header, std::span<const std::byte> payload) override {
    std::lock_guard<std::mutex> lock(mu_);
    got_.push_back({{header.begin(), header.end()}, {payload.begin(), payload.end()}});
  }
  void on_peer_failed(uint32_t, const Status&) override {}
  std::vector<Received> got() {
    std::lock_guard<std::mutex> lock(mu_);
    return got_;
  }

 private:
  std::mutex mu_;
  std::vector<Received> got_;
};

// A message whose header says `kind` (bytes 6..7, as on the wire) and whose payload is `tag`.
struct Message {
  explicit Message(uint8_t tag, uint16_t kind = 1) : header(80, std::byte{0}), payload(64, std::byte{tag}) {
    header[6] = std::byte(kind & 0xFF);
    header[7] = std::byte(kind >> 8);
  }
  std::vector<std::byte> header, payload;
};

struct Harness {
  explicit Harness(const FaultOptions& o, const Clock& clock = steady_clock())
      : net(2), faulty(net.transport(0), o, clock) {
    net.attach(1, &sink);
  }
  Status send(const Message& m) {
    return faulty.send(1, m.header, m.payload, [this](const Status& s) {
      ++done;
      if (!s.ok()) ++failed;
    });
  }
  bool wait_done(int n) {
    const auto deadline = std::chrono::steady_clock::now() + 5s;
    while (done.load() < n) {
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::yield();
    }
    return true;
  }
  Recorder sink;
  fakes::FakeNetwork net;
  FaultyTransport faulty;
  std::atomic<int> done{0}, failed{0};
};

TEST(FaultSpec, ParsesAndRefusesClearly) {
  auto o = parse_fault_spec("drop=0.1,duplicate=0.2,delay=0.05,delay_ms=30,corrupt=0.01,reorder=0.04,seed=9,kinds=1+2");
  ASSERT_TRUE(o.ok()) << o.status().to_string();
  EXPECT_DOUBLE_EQ(o->drop, 0.1);
  EXPECT_DOUBLE_EQ(o->duplicate, 0.2);
  EXPECT_EQ(o->delay_ms, 30u);
  EXPECT_EQ(o->seed, 9u);
  EXPECT_EQ(o->kinds, (std::set<uint16_t>{1, 2}));
  for (const char* bad : {"drop=2", "drop=-0.1", "drop", "bogus=1", "delay_ms=x", "drop=0.6,corrupt=0.6", "kinds=1+x"}) {
    auto b = parse_fault_spec(bad);
    EXPECT_EQ(b.status().code(), Code::kInvalidArgument) << bad;
  }
}

TEST(FaultyTransport, DropCompletesTheSendButDeliversNothing) {
  FaultOptions o;
  o.drop = 1;
  Harness h(o);
  Message m(7);
  ASSERT_TRUE(h.send(m).ok());
  ASSERT_TRUE(h.wait_done(1));
  std::this_thread::sleep_for(50ms);  // nothing may arrive late either
  EXPECT_TRUE(h.sink.got().empty());
  EXPECT_EQ(h.failed.load(), 0);
  EXPECT_EQ(h.faulty.counts().dropped, 1u);
}

TEST(FaultyTransport, DuplicateDeliversTwoIdenticalCopiesAndCompletesOnce) {
  FaultOptions o;
  o.duplicate = 1;
  Harness h(o);
  Message m(9);
  ASSERT_TRUE(h.send(m).ok());
  ASSERT_TRUE(h.wait_done(1));
  std::this_thread::sleep_for(50ms);
  auto got = h.sink.got();
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].payload, m.payload);
  EXPECT_EQ(got[1].payload, m.payload);
  EXPECT_EQ(h.done.load(), 1);
}

TEST(FaultyTransport, CorruptFlipsExactlyOneBitOfACopy) {
  FaultOptions o;
  o.corrupt = 1;
  o.seed = 3;
  Harness h(o);
  for (int i = 0; i < 20; ++i) {
    Message m(static_cast<uint8_t>(i));
    const Message original = m;
    ASSERT_TRUE(h.send(m).ok());
    ASSERT_TRUE(h.wait_done(i + 1));
    EXPECT_EQ(m.header, original.header);  // the caller's buffers are untouched
    EXPECT_EQ(m.payload, original.payload);
    auto got = h.sink.got().back();
    int bits = 0;
    for (size_t b = 0; b < m.header.size(); ++b) bits += std::popcount(std::to_integer<unsigned>(got.header[b] ^ m.header[b]));
    for (size_t b = 0; b < m.payload.size(); ++b) bits += std::popcount(std::to_integer<unsigned>(got.payload[b] ^ m.payload[b]));
    EXPECT_EQ(bits, 1) << "message " << i;
  }
}

TEST(FaultyTransport, ReorderLetsTheNextMessageOvertake) {
  FaultOptions o;
  o.reorder = 1;
  o.delay_ms = 5000;  // only the next message releases it
  Harness h(o);
  Message first(1), second(2);
  ASSERT_TRUE(h.send(first).ok());
  ASSERT_TRUE(h.send(second).ok());  // a peer has at most one held: this one goes at once
  ASSERT_TRUE(h.wait_done(2));
  auto got = h.sink.got();
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[0].payload, second.payload);
  EXPECT_EQ(got[1].payload, first.payload);
}

TEST(FaultyTransport, KindsLimitTheFaults) {
  FaultOptions o;
  o.drop = 1;
  o.kinds = {1};
  Harness h(o);
  Message data(1, /*kind=*/1), decision(2, /*kind=*/5);
  ASSERT_TRUE(h.send(data).ok());
  ASSERT_TRUE(h.send(decision).ok());
  ASSERT_TRUE(h.wait_done(2));
  std::this_thread::sleep_for(50ms);
  auto got = h.sink.got();
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].payload, decision.payload);
}

// delay_ms is time on the switch's clock: a delayed message stays held while the (fake) clock
// stands still, however much real time passes, and goes out once the clock reaches its due time.
TEST(FaultyTransport, DelayIsMeasuredOnTheGivenClock) {
  FaultOptions o;
  o.delay = 1;
  o.delay_ms = 30;
  testing::FakeClock clock;
  Harness h(o, clock);
  Message m(5);
  ASSERT_TRUE(h.send(m).ok());
  EXPECT_EQ(h.faulty.counts().delayed, 1u);
  // More than delay_ms of real time: on real time it would have gone out by now.
  std::this_thread::sleep_for(100ms);
  EXPECT_EQ(h.done.load(), 0);
  clock.advance(29ms);
  std::this_thread::sleep_for(100ms);  // a slice of the fault thread's wait, and more
  EXPECT_EQ(h.done.load(), 0) << "sent 1 ms before its due time";
  EXPECT_TRUE(h.sink.got().empty());
  clock.advance(1ms);
  ASSERT_TRUE(h.wait_done(1)) << "not sent once the clock reached its due time";
  EXPECT_EQ(h.failed.load(), 0);
  const auto deadline = std::chrono::steady_clock::now() + 5s;
  while (h.sink.got().empty() && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  ASSERT_EQ(h.sink.got().size(), 1u);
  EXPECT_EQ(h.sink.got()[0].payload, m.payload);
}

TEST(FaultyTransport, StopFailsWhatIsStillDelayedExactlyOnce) {
  FaultOptions o;
  o.delay = 1;
  o.delay_ms = 60000;
  Harness h(o);
  Message m(4);
  ASSERT_TRUE(h.send(m).ok());
  h.faulty.stop();
  EXPECT_EQ(h.done.load(), 1);
  EXPECT_EQ(h.failed.load(), 1);
  EXPECT_TRUE(h.sink.got().empty());
  EXPECT_EQ(h.send(m).code(), Code::kUnavailable);
}

}  // namespace
}  // namespace sparsecar
