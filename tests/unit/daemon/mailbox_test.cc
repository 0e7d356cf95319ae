// Mailbox: the per-peer byte limit (mailbox_max_bytes). A peer may have up to the limit of payload
// bytes waiting; the message that would go over is rejected, counted and fails its step at once
// (kResourceExhausted) instead of the daemon buffering without bound; taking, dropping and
// replacing messages give their bytes back.
// Job incarnations: a message of another job is never handed out for this one, whether it
// arrived before or after the job was agreed, and each one dropped is counted.
// Time: the peer-down grace period and take()'s deadline run on the Clock the mailbox is given
// (a FakeClock here), not on real time.
#include "daemon/collective/mailbox.h"

#include <gtest/gtest.h>

#include <thread>

#include <array>
#include <atomic>
#include <future>
#include <utility>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

#include "daemon/metrics/metrics.h"
#include "sparsecar/kernels/types.h"
#include "tests/unit/common/fake_clock.h"

namespace sparsecar {
namespace {

using namespace std::chrono_literals;

constexpr uint64_t kJob = 7;

struct Message {
  std::array<std::byte, wire::kHeaderBytes> header{};
  std::vector<std::byte> payload;
};

// `h`'s common fields filled in (magic, version, kind, job, sender) and sealed with `payload`.
Message sealed(wire::Kind kind, uint32_t rank, wire::WireHeader h, std::vector<std::byte> payload) {
  Message m;
  m.payload = std::move(payload);
  h.magic = wire::kMagic;
  h.version = wire::kVersion;
  h.kind = static_cast<uint16_t>(kind);
  h.job_id = kJob;
  h.sender_rank = rank;
  h.payload_bytes = m.payload.size();
  wire::seal(h, m.payload, m.header);
  return m;
}

std::vector<std::byte> text_bytes(const std::string& text) {
  std::vector<std::byte> out;
  for (char c : text) out.push_back(static_cast<std::byte>(c));
  return out;
}

// A valid dense fp32 data message of `floats` values equal to `fill` from `rank`.
Message data_message(uint32_t rank, uint32_t tensor, uint64_t step, size_t floats, uint64_t incarnation = 0,
                     float fill = 0.0f) {
  std::vector<std::byte> payload(4 * floats);
  for (size_t i = 0; i < floats; ++i) std::memcpy(payload.data() + 4 * i, &fill, 4);
  wire::WireHeader h{};
  h.tensor_id = tensor;
  h.step = step;
  h.format = static_cast<uint16_t>(kernels::Format::kDense);
  h.value_type = static_cast<uint16_t>(kernels::ValueType::kF32);
  h.dense_len = floats;
  h.nnz = floats;
  h.incarnation = incarnation;
  return sealed(wire::Kind::kData, rank, h, std::move(payload));
}

Message abort_message(uint32_t rank, uint32_t tensor, uint64_t step, uint64_t incarnation) {
  wire::WireHeader h{};
  h.tensor_id = tensor;
  h.step = step;
  h.incarnation = incarnation;
  return sealed(wire::Kind::kAbort, rank, h, text_bytes("trainer died"));
}

float first_value(const Envelope& e) {
  float v;
  std::memcpy(&v, e.payload.data(), 4);
  return v;
}

void deliver(Mailbox& box, uint32_t rank, const Message& m) { box.on_message(rank, m.header, m.payload); }

std::chrono::steady_clock::time_point soon() { return std::chrono::steady_clock::now() + std::chrono::seconds(2); }

TEST(MailboxLimit, APeerMayFillItsLimitButNotGoOver) {
  Mailbox box(kJob, 3, nullptr, 4000);  // bytes per peer
  deliver(box, 1, data_message(1, 0, 0, 500));  // 2000 bytes
  deliver(box, 1, data_message(1, 1, 0, 500));  // 4000: exactly the limit
  EXPECT_EQ(box.buffered_bytes(1), 4000u);
  EXPECT_EQ(box.rejected(), 0u);
  deliver(box, 1, data_message(1, 2, 0, 1));  // 4004: over
  EXPECT_EQ(box.rejected(), 1u);
  EXPECT_EQ(box.buffered_bytes(1), 4000u);
  // The rejected message's step fails at once, naming the limit.
  auto failed = box.take(wire::Kind::kData, 1, 2, 0, 0, 0, soon(), "rank 1");
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.status().code(), Code::kResourceExhausted);
  EXPECT_NE(failed.status().message().find("mailbox_max_bytes"), std::string::npos) << failed.status().to_string();
  // Another peer has its own account.
  deliver(box, 2, data_message(2, 0, 0, 1000));
  EXPECT_EQ(box.buffered_bytes(2), 4000u);
  EXPECT_EQ(box.rejected(), 1u);
}

TEST(MailboxLimit, TakingDroppingAndReplacingGiveBytesBack) {
  Mailbox box(kJob, 2, nullptr, 4000);
  deliver(box, 1, data_message(1, 0, 0, 500));
  deliver(box, 1, data_message(1, 0, 1, 500));
  auto got = box.take(wire::Kind::kData, 1, 0, 0, 0, 0, soon(), "rank 1");
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_EQ(got->payload.size(), 2000u);
  EXPECT_EQ(box.buffered_bytes(1), 2000u);
  // A repeated message replaces the stored one: only the difference counts.
  deliver(box, 1, data_message(1, 0, 1, 1000));
  EXPECT_EQ(box.buffered_bytes(1), 4000u);
  EXPECT_EQ(box.rejected(), 0u);
  box.drop_before(0, 2);
  EXPECT_EQ(box.buffered_bytes(1), 0u);
  deliver(box, 1, data_message(1, 3, 5, 1000));
  EXPECT_EQ(box.buffered_bytes(1), 4000u);
  box.begin_job();
  EXPECT_EQ(box.buffered_bytes(1), 0u);
  deliver(box, 1, data_message(1, 3, 6, 1000));  // fits again after begin_job()
  EXPECT_EQ(box.rejected(), 0u);
}

std::chrono::steady_clock::time_point now() { return std::chrono::steady_clock::now(); }

// The bug this guards against: job 1's step-5 message from rank 1 arrived after this node reset,
// stayed in the mailbox, and was summed into job 2's step 5 (500.5 instead of 1.5).
TEST(MailboxIncarnation, AMessageOfAFinishedJobIsNeverTakenByTheNext) {
  constexpr uint64_t kJob1 = 0x1111, kJob2 = 0x2222;
  Mailbox box(kJob, 2, nullptr);
  box.set_incarnation(kJob1);
  box.begin_job();                                          // job 1 ends here...
  deliver(box, 1, data_message(1, 0, 5, 4, kJob1, 500.0f));  // ...and its late message arrives
  box.set_incarnation(kJob2);
  EXPECT_EQ(box.stale(), 1u);
  EXPECT_EQ(box.buffered_bytes(1), 0u);
  // Job 2's own message for the same (tensor, step) is the one taken.
  deliver(box, 1, data_message(1, 0, 5, 4, kJob2, 1.0f));
  auto got = box.take(wire::Kind::kData, 1, 0, 5, 0, kJob2, soon(), "rank 1");
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_EQ(first_value(*got), 1.0f);
}

TEST(MailboxIncarnation, OnceAgreedAMessageOfAnotherIncarnationIsDroppedOnArrival) {
  Mailbox box(kJob, 2, nullptr);
  box.set_incarnation(7);
  deliver(box, 1, data_message(1, 0, 5, 4, 6, 500.0f));
  EXPECT_EQ(box.stale(), 1u);
  EXPECT_EQ(box.buffered_bytes(1), 0u);
  EXPECT_EQ(box.rejected(), 0u);  // stale is not corrupt: counted apart
  // An abort of another job does not fail this job's step either.
  deliver(box, 1, abort_message(1, 0, 5, 6));
  EXPECT_EQ(box.stale(), 2u);
  auto got = box.take(wire::Kind::kData, 1, 0, 5, 0, 7, now() + std::chrono::milliseconds(50), "rank 1");
  EXPECT_EQ(got.status().code(), Code::kDeadlineExceeded) << got.status().to_string();
  // This job's abort does.
  deliver(box, 1, abort_message(1, 0, 5, 7));
  got = box.take(wire::Kind::kData, 1, 0, 5, 0, 7, soon(), "rank 1");
  EXPECT_EQ(got.status().code(), Code::kAborted) << got.status().to_string();
}

// Before this node has learnt the new incarnation, a fast peer's message of the new job and a
// late one of the old job can both be waiting, in either order; the agreement keeps the right one.
TEST(MailboxIncarnation, BetweenJobsBothAreKeptAndTheAgreementPicks) {
  for (bool new_first : {true, false}) {
    Mailbox box(kJob, 2, nullptr);
    box.begin_job();
    Message old_job = data_message(1, 0, 0, 4, 0xAAAA, 500.0f);
    Message new_job = data_message(1, 0, 0, 4, 0xBBBB, 1.0f);
    deliver(box, 1, new_first ? new_job : old_job);
    deliver(box, 1, new_first ? old_job : new_job);
    box.set_incarnation(0xBBBB);
    EXPECT_EQ(box.stale(), 1u);
    auto got = box.take(wire::Kind::kData, 1, 0, 0, 0, 0xBBBB, soon(), "rank 1");
    ASSERT_TRUE(got.ok()) << got.status().to_string();
    EXPECT_EQ(first_value(*got), 1.0f) << "new_first " << new_first;
  }
}

// A peer may start its next job (and send its manifest) before this node has reset.
TEST(MailboxIncarnation, AManifestSurvivesTheResetAndTheNewestWins) {
  auto manifest = [](uint64_t nonce, const std::string& text) {
    wire::WireHeader h{};
    h.incarnation = nonce;
    return sealed(wire::Kind::kManifest, 1, h, text_bytes(text));
  };
  Mailbox box(kJob, 2, nullptr);
  box.set_incarnation(5);
  deliver(box, 1, manifest(0x10, "first"));
  deliver(box, 1, manifest(0x11, "second"));
  box.begin_job();
  auto got = box.take(wire::Kind::kManifest, 1, 0, 0, 0, 0, soon(), "rank 1");
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_EQ(got->header.incarnation, 0x11u);
  EXPECT_EQ(std::string(reinterpret_cast<const char*>(got->payload.data()), got->payload.size()), "second");
}

// The link probe (link_probe.h): counted and dropped after its validation, never kept, never
// handed to the control handler; one over its size limit is rejected like any bad message.
TEST(MailboxProbe, AProbeIsCountedAndDroppedAndAnOversizedOneRejected) {
  auto metrics = Metrics::create("off").value();
  Mailbox box(kJob, 2, metrics.get());
  std::atomic<int> control_messages{0};
  box.set_control_handler([&](uint32_t, const wire::WireHeader&, std::span<const std::byte>) { ++control_messages; });
  deliver(box, 1, sealed(wire::Kind::kProbe, 1, wire::WireHeader{}, std::vector<std::byte>(128 * 1024)));
  EXPECT_EQ(box.buffered_bytes(1), 0u);
  EXPECT_EQ(box.rejected(), 0u);
  EXPECT_EQ(control_messages.load(), 0);
  deliver(box, 1, sealed(wire::Kind::kProbe, 1, wire::WireHeader{},
                         std::vector<std::byte>(wire::kMaxProbePayloadBytes + 1)));
  EXPECT_EQ(box.rejected(), 1u);
  Message corrupt = sealed(wire::Kind::kProbe, 1, wire::WireHeader{}, std::vector<std::byte>(64 * 1024));
  corrupt.payload[100] = std::byte{1};  // the checksum no longer holds
  deliver(box, 1, corrupt);
  EXPECT_EQ(box.rejected(), 2u);
  EXPECT_EQ(box.buffered_bytes(1), 0u);
  const std::string text = metrics->scrape_text();
  EXPECT_NE(text.find(R"(sparsecar_link_probes_total{direction="received"} 1)"), std::string::npos) << text;
}

}  // namespace
}  // namespace sparsecar

namespace sparsecar {
namespace {

// What the mailbox drops shows up in errors_total by kind: a stale message (another job) and a
// message the transport refused before it got here (bad MAC, replay, forged bye).
// A lost peer's messages go with it; its replacement's are taken, and the peer no longer counts
// as down (the grace clock of peer_down_grace_ms stops for it).
TEST(MailboxPeers, ALostPeersMessagesAreDroppedAndItsReplacementIsTaken) {
  constexpr uint64_t kInc = 0x3333;
  Mailbox box(kJob, 3, nullptr);
  box.set_incarnation(kInc);
  deliver(box, 1, data_message(1, 0, 7, 4, kInc, 500.0f));  // the lost process's step 7
  deliver(box, 2, data_message(2, 0, 7, 4, kInc, 2.0f));
  EXPECT_FALSE(box.first_peer_down().has_value());
  box.on_peer_failed(1, unavailable("killed"));
  EXPECT_EQ(box.buffered_bytes(1), 0u);
  EXPECT_EQ(box.buffered_bytes(2), 16u);
  auto down = box.first_peer_down();
  ASSERT_TRUE(down.has_value());
  EXPECT_EQ(down->peer, 1u);
  auto failed = box.take(wire::Kind::kData, 1, 0, 7, 0, kInc, soon(), "rank 1");
  EXPECT_EQ(failed.status().code(), Code::kUnavailable) << failed.status().to_string();

  box.on_peer_rejoined(1);
  EXPECT_FALSE(box.first_peer_down().has_value());
  EXPECT_EQ(box.rejoined(), 1u);
  // Nothing of the lost process is left to take: the replacement's own step 7 is what comes.
  auto early = box.take(wire::Kind::kData, 1, 0, 7, 0, kInc, std::chrono::steady_clock::now() + 50ms, "rank 1");
  EXPECT_EQ(early.status().code(), Code::kDeadlineExceeded) << early.status().to_string();
  deliver(box, 1, data_message(1, 0, 7, 4, kInc, 1.5f));
  auto got = box.take(wire::Kind::kData, 1, 0, 7, 0, kInc, soon(), "rank 1");
  ASSERT_TRUE(got.ok()) << got.status().to_string();
  EXPECT_EQ(first_value(*got), 1.5f);
  // Another peer's messages were never touched.
  auto other = box.take(wire::Kind::kData, 2, 0, 7, 0, kInc, soon(), "rank 2");
  ASSERT_TRUE(other.ok());
  EXPECT_EQ(first_value(*other), 2.0f);
}

// With two peers down, the one down longest is reported; once it is back, the other.
TEST(MailboxPeers, FirstPeerDownIsTheEarliestOfThoseStillDown) {
  testing::FakeClock clock;
  Mailbox box(kJob, 3, nullptr, Mailbox::kDefaultMaxBytesPerPeer, clock);
  box.on_peer_failed(2, unavailable("first"));
  const auto first_down = clock.now();
  clock.advance(5ms);
  box.on_peer_failed(1, unavailable("second"));
  ASSERT_TRUE(box.first_peer_down().has_value());
  EXPECT_EQ(box.first_peer_down()->peer, 2u);
  EXPECT_EQ(box.first_peer_down()->since, first_down);
  box.on_peer_rejoined(2);
  ASSERT_TRUE(box.first_peer_down().has_value());
  EXPECT_EQ(box.first_peer_down()->peer, 1u);
  box.on_peer_rejoined(0);  // alive: nothing to do
  EXPECT_EQ(box.rejoined(), 1u);
}

// The daemon gives up on a lost peer once it has been down for peer_down_grace_ms, measured on the
// mailbox's clock: not a moment before, at once after, and the grace starts again when a rank that
// came back fails again.
TEST(MailboxClock, PeerDownGraceExpiresOnTheGivenClock) {
  testing::FakeClock clock;
  Mailbox box(kJob, 3, nullptr, Mailbox::kDefaultMaxBytesPerPeer, clock);
  constexpr auto kGrace = 10s;
  EXPECT_FALSE(box.peer_down_past(0s).has_value());  // nobody is down
  box.on_peer_failed(1, unavailable("killed"));
  const auto failed_at = clock.now();
  ASSERT_TRUE(box.first_peer_down().has_value());
  EXPECT_EQ(box.first_peer_down()->since, failed_at);
  EXPECT_FALSE(box.peer_down_past(kGrace).has_value());
  clock.advance(kGrace - 1ms);
  EXPECT_FALSE(box.peer_down_past(kGrace).has_value());
  clock.advance(1ms);
  auto expired = box.peer_down_past(kGrace);
  ASSERT_TRUE(expired.has_value());
  EXPECT_EQ(expired->peer, 1u);
  EXPECT_EQ(expired->since, failed_at);
  EXPECT_EQ(expired->why.code(), Code::kUnavailable);

  // Back: no longer down, however long ago it failed.
  box.on_peer_rejoined(1);
  clock.advance(1h);
  EXPECT_FALSE(box.peer_down_past(kGrace).has_value());
  // Down again: a fresh grace period from the new failure.
  box.on_peer_failed(1, unavailable("killed again"));
  clock.advance(kGrace / 2);
  EXPECT_FALSE(box.peer_down_past(kGrace).has_value());
  clock.advance(kGrace / 2);
  EXPECT_TRUE(box.peer_down_past(kGrace).has_value());
}

// take()'s deadline is a time on the mailbox's clock: with a fake clock it passes when the clock
// is advanced past it, and not before (however much real time goes by in between).
TEST(MailboxClock, TakeDeadlineIsOnTheGivenClock) {
  testing::FakeClock clock;
  Mailbox box(kJob, 2, nullptr, Mailbox::kDefaultMaxBytesPerPeer, clock);
  std::atomic<bool> advanced{false};
  std::promise<std::pair<Code, bool>> result;  // take()'s code, and whether the clock had moved
  auto done = result.get_future();
  std::thread taker([&] {
    auto got = box.take(wire::Kind::kData, 1, 0, 3, 0, 0, clock.now() + 1h, "rank 1");
    result.set_value({got.status().code(), advanced.load()});
  });
  // Not needed for the outcome: gives the taker time to block, so the advance meets a wait.
  EXPECT_EQ(done.wait_for(100ms), std::future_status::timeout) << "take() returned before its deadline";
  advanced = true;
  clock.advance(1h);
  ASSERT_EQ(done.wait_for(10s), std::future_status::ready) << "take() missed its deadline on the fake clock";
  const auto [code, after_advance] = done.get();
  EXPECT_EQ(code, Code::kDeadlineExceeded);
  EXPECT_TRUE(after_advance);
  taker.join();
}

TEST(MailboxMetrics, StaleAndTransportRejectedMessagesAreCountedByKind) {
  auto metrics = Metrics::create("off").value();
  Mailbox box(kJob, 2, metrics.get());
  box.set_incarnation(7);
  deliver(box, 1, data_message(1, 0, 5, 4, /*incarnation=*/6));
  box.on_rejected(1, data_loss("bad MAC"));
  box.on_rejected(1, data_loss("replayed sequence number"));
  const std::string text = metrics->scrape_text();
  EXPECT_NE(text.find(R"(sparsecar_errors_total{kind="wire_stale"} 1)"), std::string::npos) << text;
  EXPECT_NE(text.find(R"(sparsecar_errors_total{kind="transport_rejected"} 2)"), std::string::npos) << text;
}

}  // namespace
}  // namespace sparsecar
