// The shared-memory rings: order, full/empty, wraparound of the 64-bit counters, corruption.
#include <gtest/gtest.h>

#include <limits>
#include <memory>

#include "sparsecar/common/shm_layout.h"

namespace sparsecar::shm {
namespace {

std::unique_ptr<Ring<Submission>> make_ring(uint64_t start) {
  auto ring = std::make_unique<Ring<Submission>>();
  ring->head.store(start);
  ring->tail.store(start);
  return ring;
}

Submission entry(uint64_t i) {
  Submission s{};
  s.seq = i;
  s.step = i * 3;
  s.tensor_id = static_cast<uint32_t>(i % 7);
  return s;
}

TEST(ShmRing, FillsUpThenDrainsInOrder) {
  auto ring = make_ring(0);
  Submission out;
  EXPECT_FALSE(ring_pop(*ring, &out));
  for (uint64_t i = 0; i < kRingSlots; ++i) ASSERT_TRUE(ring_push(*ring, entry(i))) << i;
  EXPECT_FALSE(ring_push(*ring, entry(999))) << "a full ring must say would-block";
  for (uint64_t i = 0; i < kRingSlots; ++i) {
    ASSERT_TRUE(ring_pop(*ring, &out));
    EXPECT_EQ(out.seq, i);
    EXPECT_EQ(out.step, i * 3);
  }
  EXPECT_FALSE(ring_pop(*ring, &out));
}

TEST(ShmRing, WrapsAroundTheSlotsAndTheCounters) {
  // Start just below 2^64 so head and tail overflow during the test.
  auto ring = make_ring(std::numeric_limits<uint64_t>::max() - 300);
  uint64_t pushed = 0, popped = 0;
  Submission out;
  for (int round = 0; round < 40; ++round) {
    for (int k = 0; k < 33; ++k) ASSERT_TRUE(ring_push(*ring, entry(pushed++)));
    for (int k = 0; k < 30; ++k) {
      bool corrupt = false;
      ASSERT_TRUE(ring_pop(*ring, &out, &corrupt));
      ASSERT_FALSE(corrupt);
      ASSERT_EQ(out.seq, popped++);
    }
  }
  while (ring_pop(*ring, &out)) ASSERT_EQ(out.seq, popped++);
  EXPECT_EQ(pushed, popped);
  EXPECT_LT(ring->head.load(), 2000u) << "the counters should have wrapped";
}

TEST(ShmRing, CorruptHeadIsDetected) {
  auto ring = make_ring(100);
  Submission out;
  bool corrupt = false;
  ring->head.store(100 + kRingSlots + 1);  // further ahead than the ring holds
  EXPECT_FALSE(ring_pop(*ring, &out, &corrupt));
  EXPECT_TRUE(corrupt);
  EXPECT_EQ(ring->tail.load(), 100u) << "nothing consumed";
  corrupt = false;
  ring->head.store(50);  // behind the tail
  EXPECT_FALSE(ring_pop(*ring, &out, &corrupt));
  EXPECT_TRUE(corrupt);
  corrupt = false;
  ring->head.store(100 + kRingSlots);  // exactly full is fine
  EXPECT_TRUE(ring_pop(*ring, &out, &corrupt));
  EXPECT_FALSE(corrupt);
}

TEST(ShmLayout, ControlBlockIsInitialisedAndValid) {
  auto mem = std::make_unique<ShmControl>();
  ShmControl* ctl = init_control(mem.get());
  EXPECT_TRUE(control_valid(*ctl));
  EXPECT_EQ(ctl->submissions.head.load(), 0u);
  EXPECT_EQ(ctl->completions.tail.load(), 0u);
  ctl->version = 2;
  EXPECT_FALSE(control_valid(*ctl));
  EXPECT_EQ(kControlBytes % 4096, 0u);
  EXPECT_GE(kControlBytes, sizeof(ShmControl));
}

TEST(ShmLayout, ATrainerReducesFlagGoesOnlyToADaemonThatSaysItTakesIt) {
  // A daemon of this tree says so in the mapping it hands out.
  auto mem = std::make_unique<ShmControl>();
  ShmControl* ctl = init_control(mem.get());
  EXPECT_EQ(ctl->features & kFeatureTrainerReduces, kFeatureTrainerReduces);
  EXPECT_EQ(submission_flags(*ctl, true), kSubmitTrainerReduces);
  EXPECT_EQ(submission_flags(*ctl, false), 0u);
  // An older daemon's mapping: the same header, 0 where the features are (its `reserved`). It
  // refuses any flag, so none is sent; the mapping is still valid for every other use.
  ctl->features = 0;
  EXPECT_TRUE(control_valid(*ctl));
  EXPECT_EQ(submission_flags(*ctl, true), 0u);
  // Bits a client does not know say nothing about this one.
  ctl->features = ~kFeatureTrainerReduces;
  EXPECT_EQ(submission_flags(*ctl, true), 0u);
}

TEST(ShmLayout, ALeaseIsAskedForOnlyWithReducingAndFromADaemonThatSaysItGrantsThem) {
  auto mem = std::make_unique<ShmControl>();
  ShmControl* ctl = init_control(mem.get());
  EXPECT_EQ(ctl->features & kFeatureLease, kFeatureLease);
  EXPECT_EQ(submission_flags(*ctl, true, true), kSubmitTrainerReduces | kSubmitTakesLease);
  EXPECT_EQ(submission_flags(*ctl, false, true), 0u);  // a lease is of trainer-reduced steps only
  EXPECT_EQ(submission_flags(*ctl, true, false), kSubmitTrainerReduces);
  // A daemon that reduces by the trainers but grants no leases (the tree before them).
  ctl->features = kFeatureTrainerReduces;
  EXPECT_EQ(submission_flags(*ctl, true, true), kSubmitTrainerReduces);
  ctl->features = 0;
  EXPECT_EQ(submission_flags(*ctl, true, true), 0u);
  // The field was `reserved`: the completion's size and the message's offset are unchanged.
  static_assert(offsetof(Completion, lease_steps) == 44);
}

}  // namespace
}  // namespace sparsecar::shm
