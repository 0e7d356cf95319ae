// ReceiveTimer (daemon/transport/receive_timer.h): the busy periods a receiver times, on a clock
// the test moves. Expected samples are the period's length and the bytes that crossed in it.
#include "daemon/transport/receive_timer.h"

#include <gtest/gtest.h>

namespace sparsecar {
namespace {

using namespace std::chrono_literals;
using Tp = ReceiveTimer::time_point;

TEST(ReceiveTimer, EagerBytesThatArriveWhileATimedReceiveIsOpenCountInItsSample) {
  ReceiveTimer t(2);
  const Tp t0{};
  t.add(1, 1000);  // before any period: not counted
  t.begin(1, t0);
  t.add(1, 262224);  // an eager segment behind the timed one
  t.add(0, 5000);    // another peer's: not this link's
  auto s = t.end(1, 262224, true, t0 + 4ms);
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->peer, 1u);
  EXPECT_EQ(s->bytes, 2u * 262224);
  EXPECT_DOUBLE_EQ(s->seconds, 0.004);
  t.add(1, 777);  // after it closed: not counted in the next one
  t.begin(1, t0 + 10ms);
  s = t.end(1, 100, true, t0 + 11ms);
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->bytes, 100u);
}

TEST(ReceiveTimer, OverlappingTimedReceivesMakeOnePeriodAndAFailedOneAddsNoBytes) {
  ReceiveTimer t(3);
  const Tp t0{};
  t.begin(2, t0);
  t.begin(2, t0 + 1ms);
  EXPECT_FALSE(t.end(2, 500, false, t0 + 2ms).has_value()) << "one still in flight";
  auto s = t.end(2, 300, true, t0 + 5ms);
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->bytes, 300u);
  EXPECT_DOUBLE_EQ(s->seconds, 0.005);
  // A period with nothing completed says nothing; an end without a begin neither.
  t.begin(2, t0 + 6ms);
  EXPECT_FALSE(t.end(2, 400, false, t0 + 7ms).has_value());
  EXPECT_FALSE(t.end(2, 400, true, t0 + 8ms).has_value());
  EXPECT_FALSE(t.end(7, 400, true, t0 + 8ms).has_value()) << "not a peer";
}

TEST(ReceiveTimer, APeriodThatNeverEndedIsStartedAfreshAfterThirtySeconds) {
  ReceiveTimer t(1);
  const Tp t0{};
  t.begin(0, t0);  // its end never comes
  t.begin(0, t0 + 31s);
  auto s = t.end(0, 64, true, t0 + 31s + 2ms);
  ASSERT_TRUE(s.has_value());
  EXPECT_NEAR(s->seconds, 0.002, 1e-12);
}

}  // namespace
}  // namespace sparsecar
