// JobProgress: the periodic progress line comes once per interval (never without new steps, never
// when off), carries step, density, ratio, bytes saved and step latency, and the job summary line
// totals the job and starts a fresh one. Time is a FakeClock: no sleeping.
#include <gtest/gtest.h>

#include "daemon/pipeline/progress.h"
#include "tests/unit/common/fake_clock.h"

namespace sparsecar {
namespace {

using namespace std::chrono_literals;

bool has(const std::string& s, const std::string& what) { return s.find(what) != std::string::npos; }

// One step of two tensors: 1000 elements each, 10 selected, 100 bytes sent vs 4800 dense.
void one_step(JobProgress& p, uint64_t step, double seconds_per_tensor = 0.001) {
  for (int t = 0; t < 2; ++t) p.on_tensor_step(step, true, 1000, 10, 100, 4800, seconds_per_tensor);
}

TEST(JobProgressTest, OneLinePerIntervalWithTheNumbers) {
  testing::FakeClock clock;
  JobProgress p(clock, 10s);
  EXPECT_FALSE(p.due_line()) << "no step yet";
  one_step(p, 0);
  EXPECT_FALSE(p.due_line()) << "the interval has not passed";
  clock.advance(5s);
  one_step(p, 1);
  EXPECT_FALSE(p.due_line());
  clock.advance(5s);
  one_step(p, 2);
  auto line = p.due_line();
  ASSERT_TRUE(line);
  EXPECT_TRUE(has(*line, "progress: step 2 (+3 in 10.0 s)")) << *line;
  EXPECT_TRUE(has(*line, "density 0.01,")) << *line;
  EXPECT_TRUE(has(*line, "ratio 48.0x")) << *line;
  EXPECT_TRUE(has(*line, "saved 27.5 KiB")) << *line;  // 3 steps x 2 x (4800 - 100) bytes
  EXPECT_TRUE(has(*line, "step latency 2.0 ms")) << *line;  // two tensors of 1 ms each
  EXPECT_FALSE(p.due_line()) << "one line per interval";
  clock.advance(20s);
  EXPECT_FALSE(p.due_line()) << "no line without a new step";
  one_step(p, 3);
  line = p.due_line();
  ASSERT_TRUE(line);
  EXPECT_TRUE(has(*line, "step 3 (+1 in 20.0 s)")) << *line;
}

TEST(JobProgressTest, ZeroIntervalIsOffAndLiveChangesApply) {
  testing::FakeClock clock;
  JobProgress p(clock, 0ms);
  one_step(p, 0);
  clock.advance(1h);
  one_step(p, 1);
  EXPECT_FALSE(p.due_line());
  p.set_interval(1s);
  EXPECT_TRUE(p.due_line());
}

TEST(JobProgressTest, SummaryTotalsTheJobAndStartsAFreshOne) {
  testing::FakeClock clock;
  JobProgress p(clock, 10s);
  EXPECT_FALSE(p.end_job()) << "no summary for a job without steps";
  for (uint64_t s = 0; s < 4; ++s) {
    one_step(p, s, 0.002);
    clock.advance(1s);
  }
  p.on_tensor_step(4, false, 1000, 0, 0, 0, 0.004);  // a failed tensor step
  EXPECT_EQ(p.job().steps, 5u);
  EXPECT_EQ(p.job().bytes_sent, 800u);
  EXPECT_EQ(p.job().dense_bytes, 38400u);
  auto summary = p.end_job();
  ASSERT_TRUE(summary);
  EXPECT_TRUE(has(*summary, "job summary: 5 steps (1 tensor steps failed) in 4.0 s")) << *summary;
  EXPECT_TRUE(has(*summary, "sent 800 B vs 37.5 KiB dense, ratio 48.0x")) << *summary;
  EXPECT_TRUE(has(*summary, "mean step latency 4.0 ms")) << *summary;  // (8 x 2 ms + 4 ms) / 5 steps
  EXPECT_EQ(p.job().steps, 0u);
  EXPECT_FALSE(p.end_job());
}

TEST(JobProgressTest, SingleNodeSendsNothingAndSaysSo) {
  testing::FakeClock clock;
  JobProgress p(clock, 1s);
  p.on_tensor_step(0, true, 1000, 10, 0, 0, 0.001);
  clock.advance(1s);
  auto line = p.due_line();
  ASSERT_TRUE(line);
  EXPECT_TRUE(has(*line, "ratio n/a")) << *line;
  EXPECT_EQ(p.job().ratio(), 0.0);
}

TEST(JobProgressTest, HumanBytes) {
  EXPECT_EQ(JobProgress::human_bytes(312), "312 B");
  EXPECT_EQ(JobProgress::human_bytes(1536), "1.5 KiB");
  EXPECT_EQ(JobProgress::human_bytes(3.0 * (1 << 30)), "3.0 GiB");
}

}  // namespace
}  // namespace sparsecar
