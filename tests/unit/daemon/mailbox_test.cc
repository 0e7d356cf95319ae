// Mailbox: the per-peer byte limit (mailbox_max_bytes). A peer may have up to the limit of payload
// bytes waiting; the message that would go over is rejected, counted and fails its step at once
// (kResourceExhausted) instead of the daemon buffering without bound; taking, dropping and
// replacing messages give their bytes back.
#include "daemon/collective/mailbox.h"

#include <gtest/gtest.h>

#include <array>
#include <chrono>
#include <vector>

#include "sparsecar/kernels/types.h"

namespace sparsecar {
namespace {

constexpr uint64_t kJob = 7;

// A valid dense fp32 data message of `floats` values from `rank` (header sealed with its CRC).
struct Message {
  std::array<std::byte, wire::kHeaderBytes> header{};
  std::vector<std::byte> payload;
};
Message data_message(uint32_t rank, uint32_t tensor, uint64_t step, size_t floats) {
  Message m;
  m.payload.assign(4 * floats, std::byte{0});
  wire::WireHeader h{};
  h.magic = wire::kMagic;
  h.version = wire::kVersion;
  h.kind = static_cast<uint16_t>(wire::Kind::kData);
  h.job_id = kJob;
  h.sender_rank = rank;
  h.tensor_id = tensor;
  h.step = step;
  h.format = static_cast<uint16_t>(kernels::Format::kDense);
  h.value_type = static_cast<uint16_t>(kernels::ValueType::kF32);
  h.dense_len = floats;
  h.nnz = floats;
  h.payload_bytes = m.payload.size();
  wire::seal(h, m.payload, m.header);
  return m;
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
  auto failed = box.take(wire::Kind::kData, 1, 2, 0, 0, soon(), "rank 1");
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
  auto got = box.take(wire::Kind::kData, 1, 0, 0, 0, soon(), "rank 1");
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
  box.clear();
  EXPECT_EQ(box.buffered_bytes(1), 0u);
  deliver(box, 1, data_message(1, 3, 6, 1000));  // fits again after clear()
  EXPECT_EQ(box.rejected(), 0u);
}

}  // namespace
}  // namespace sparsecar
