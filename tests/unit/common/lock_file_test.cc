// LockFile: one holder at a time, the file removed by its holder only, and never by a process
// that failed to take it.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>

#include "sparsecar/common/lock_file.h"

namespace sparsecar {
namespace {

bool exists(const std::string& path) {
  struct stat st{};
  return ::stat(path.c_str(), &st) == 0;
}

class LockFileTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/sparsecar-lock-XXXXXX";
    dir_ = ::mkdtemp(tmpl);
    path_ = dir_ + "/x.sock.lock";
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::string dir_, path_;
};

TEST_F(LockFileTest, HolderRemovesItOnRelease) {
  auto lock = LockFile::acquire(path_);
  ASSERT_TRUE(lock.ok()) << lock.status().to_string();
  EXPECT_TRUE(lock->held());
  EXPECT_TRUE(exists(path_));
  lock->release();
  EXPECT_FALSE(lock->held());
  EXPECT_FALSE(exists(path_));
  {
    auto again = LockFile::acquire(path_);
    ASSERT_TRUE(again.ok());
  }  // the destructor releases too
  EXPECT_FALSE(exists(path_));
}

TEST_F(LockFileTest, AnotherProcessIsRefusedAndRemovesNothing) {
  auto lock = LockFile::acquire(path_);
  ASSERT_TRUE(lock.ok());
  // flock belongs to the open file: a child process's attempt stands for another daemon.
  const pid_t child = ::fork();
  if (child == 0) {
    auto second = LockFile::acquire(path_);
    const bool refused = !second.ok() && second.status().code() == Code::kFailedPrecondition &&
                         second.status().message().find(path_) != std::string::npos;
    std::_Exit(refused && exists(path_) ? 0 : 1);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  EXPECT_TRUE(exists(path_)) << "a refused process removed the holder's lock file";
}

TEST_F(LockFileTest, StaleFileOfADeadHolderIsTakenOver) {
  { FILE* f = std::fopen(path_.c_str(), "w"); std::fclose(f); }  // left by a killed daemon: not locked
  auto lock = LockFile::acquire(path_);
  ASSERT_TRUE(lock.ok()) << lock.status().to_string();
  lock->release();
  EXPECT_FALSE(exists(path_));
}

TEST_F(LockFileTest, MissingDirectoryNamesThePath) {
  auto lock = LockFile::acquire(dir_ + "/no/such/dir/x.lock");
  ASSERT_FALSE(lock.ok());
  EXPECT_NE(lock.status().message().find("/no/such/dir/x.lock"), std::string::npos);
}

}  // namespace
}  // namespace sparsecar
