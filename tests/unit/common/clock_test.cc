#include "sparsecar/common/clock.h"

#include <gtest/gtest.h>

#include <condition_variable>
#include <mutex>
#include <thread>

#include "fake_clock.h"
#include "sparsecar/common/clock_wait.h"

namespace sparsecar {
namespace {

using namespace std::chrono_literals;

TEST(Clock, SteadyClockIsStdSteadyClockAndMonotonic) {
  const Clock& clock = steady_clock();
  const auto before = std::chrono::steady_clock::now();
  const auto a = clock.now();
  std::this_thread::sleep_for(2ms);
  const auto b = clock.now();
  const auto after = std::chrono::steady_clock::now();
  EXPECT_LE(before, a);
  EXPECT_GE(b - a, 2ms);
  EXPECT_LE(b, after);
  EXPECT_EQ(&clock, &steady_clock());  // one shared instance
}

TEST(Clock, FakeClockMovesOnlyWhenTold) {
  testing::FakeClock clock;
  const auto t0 = clock.now();
  std::this_thread::sleep_for(1ms);
  EXPECT_EQ(clock.now(), t0);
  clock.advance(250ms);
  EXPECT_EQ(clock.now() - t0, 250ms);
  clock.set(t0 + 10s);
  EXPECT_EQ(clock.now() - t0, 10s);
}

// A deadline on a fake clock: the real wait is at most one slice, the time left when that is
// less, and nothing once the clock has passed it.
TEST(ClockWait, SliceIsWhatIsLeftAtMostOneSlice) {
  testing::FakeClock clock;
  const auto deadline = clock.now() + 1h;
  EXPECT_EQ(wait_slice(clock, deadline), kClockWaitSlice);
  clock.set(deadline - 3ms);
  EXPECT_EQ(wait_slice(clock, deadline), 3ms);
  clock.set(deadline);
  EXPECT_EQ(wait_slice(clock, deadline), Clock::duration::zero());
  clock.advance(1h);
  EXPECT_EQ(wait_slice(clock, deadline), Clock::duration::zero());
}

// wait_until ends when the condition holds, or once the fake clock passed the deadline (and not
// while it stands still, however long that is in real time).
TEST(ClockWait, WaitUntilFollowsTheClockNotRealTime) {
  testing::FakeClock clock;
  std::mutex mu;
  std::condition_variable cv;
  std::unique_lock<std::mutex> lock(mu);
  EXPECT_TRUE(wait_until(cv, lock, clock, clock.now(), [] { return true; }));  // already true: no wait
  EXPECT_FALSE(wait_until(cv, lock, clock, clock.now(), [] { return false; }));  // deadline now: no wait
  int looks = 0;
  const auto deadline = clock.now() + 10s;
  // The condition advances the fake clock 1 s per look: the wait ends after the 10th second,
  // whatever real time that took (each slice is at most kClockWaitSlice of it).
  EXPECT_FALSE(wait_until(cv, lock, clock, deadline, [&] {
    ++looks;
    clock.advance(1s);
    return false;
  }));
  EXPECT_EQ(looks, 10);
  EXPECT_EQ(clock.now(), deadline);
}

}  // namespace
}  // namespace sparsecar
