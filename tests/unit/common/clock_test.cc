#include "sparsecar/common/clock.h"

#include <gtest/gtest.h>

#include <thread>

#include "fake_clock.h"

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

}  // namespace
}  // namespace sparsecar
