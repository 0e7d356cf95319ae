// The logger (common/log.h): line shape, levels, the per-process tag, no truncation, whole lines
// from many threads, fmt-style formatting (compile-time checked), SC_CHECK's crash with a reason.
#include "sparsecar/common/log.h"

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <regex>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace sparsecar {
namespace {

// Sends stderr to a temp file while alive; lines() reads what was written.
class CapturedStderr {
 public:
  CapturedStderr() {
    char path[] = "/tmp/sparsecar-log-test-XXXXXX";
    fd_ = ::mkstemp(path);
    path_ = path;
    saved_ = ::dup(STDERR_FILENO);
    ::dup2(fd_, STDERR_FILENO);
  }
  ~CapturedStderr() {
    restore();
    ::close(fd_);
    ::unlink(path_.c_str());
  }
  void restore() {
    if (saved_ < 0) return;
    ::dup2(saved_, STDERR_FILENO);
    ::close(saved_);
    saved_ = -1;
  }
  std::vector<std::string> lines() {
    restore();
    std::string text;
    char buf[65536];
    ssize_t n;
    ::lseek(fd_, 0, SEEK_SET);
    while ((n = ::read(fd_, buf, sizeof buf)) > 0) text.append(buf, static_cast<size_t>(n));
    std::vector<std::string> out;
    std::istringstream in(text);
    for (std::string line; std::getline(in, line);) out.push_back(line);
    return out;
  }

 private:
  int fd_ = -1;
  int saved_ = -1;
  std::string path_;
};

class LogTest : public ::testing::Test {
 protected:
  void SetUp() override { saved_ = log_level(); }
  void TearDown() override {
    set_log_level(saved_);
    set_log_tag("");
  }
  LogLevel saved_ = LogLevel::kInfo;
};

TEST_F(LogTest, LineShapeLevelsAndTag) {
  set_log_level(LogLevel::kInfo);
  CapturedStderr cap;
  SC_LOG_INFO("tensor '{}' registered ({} elements, {:.3f} s)", "w", 42, 0.25);
  SC_LOG_DEBUG("not shown at info {}", 1);
  set_log_tag("rank 2");
  SC_LOG_WARN("peer {} is {}", 3, "gone");
  SC_LOG_ERROR("literal braces {{}} and 100% kept");
  const auto lines = cap.lines();
  ASSERT_EQ(lines.size(), 3u);
  EXPECT_TRUE(std::regex_match(lines[0], std::regex(R"(\d\d:\d\d:\d\d\.\d{3} INFO  log_test\.cc:\d+ tensor 'w' registered \(42 elements, 0\.250 s\))")))
      << lines[0];
  EXPECT_TRUE(std::regex_match(lines[1], std::regex(R"(\d\d:\d\d:\d\d\.\d{3} WARN  \[rank 2\] log_test\.cc:\d+ peer 3 is gone)")))
      << lines[1];
  EXPECT_TRUE(std::regex_match(lines[2], std::regex(R"(.* ERROR \[rank 2\] log_test\.cc:\d+ literal braces \{\} and 100% kept)")))
      << lines[2];
}

TEST_F(LogTest, LevelsParse) {
  LogLevel l = LogLevel::kInfo;
  EXPECT_TRUE(parse_log_level("trace", &l));
  EXPECT_EQ(l, LogLevel::kTrace);
  EXPECT_FALSE(parse_log_level("verbose", &l));
  EXPECT_EQ(l, LogLevel::kTrace);
  set_log_level(LogLevel::kError);
  EXPECT_FALSE(log_enabled(LogLevel::kWarn));
  EXPECT_TRUE(log_enabled(LogLevel::kError));
}

TEST_F(LogTest, NothingIsTruncated) {
  set_log_level(LogLevel::kInfo);
  const std::string big(5000, 'x');
  EXPECT_EQ(fmt::format("<{}>", big).size(), big.size() + 2);
  EXPECT_EQ(strfmt("<%s>", big.c_str()).size(), big.size() + 2);  // the legacy helper too
  CapturedStderr cap;
  SC_LOG_INFO("{}|end", big);
  const auto lines = cap.lines();
  ASSERT_EQ(lines.size(), 1u);
  EXPECT_NE(lines[0].find(big + "|end"), std::string::npos);
}

TEST_F(LogTest, LinesFromManyThreadsStayWhole) {
  set_log_level(LogLevel::kInfo);
  CapturedStderr cap;
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([t] {
      for (int i = 0; i < 200; ++i) SC_LOG_INFO("thread {} line {} {}", t, i, std::string(100, 'a' + t));
    });
  }
  for (auto& th : threads) th.join();
  const auto lines = cap.lines();
  ASSERT_EQ(lines.size(), 1600u);
  const std::regex whole(R"(.* INFO  log_test\.cc:\d+ thread (\d) line \d+ ([a-h])\2{99})");
  for (const auto& line : lines) {
    std::smatch m;
    ASSERT_TRUE(std::regex_match(line, m, whole)) << line;
    EXPECT_EQ(m[2].str()[0], 'a' + (m[1].str()[0] - '0')) << line;
  }
}

TEST_F(LogTest, CheckCrashesWithTheConditionAndTheReason) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  const int n = 3;
  EXPECT_DEATH(SC_CHECK(n == 4, "n is {}, {} expected", n, 4),
               "ERROR .*log_test\\.cc:[0-9]+ check failed: n == 4.* ERROR .*log_test\\.cc:[0-9]+ n is 3, 4 expected");
  SC_CHECK(n == 3, "not reached {}", n);
}

}  // namespace
}  // namespace sparsecar
