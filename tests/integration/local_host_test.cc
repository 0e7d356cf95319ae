// A first hour on one host: what a daemon claims locally (socket directories, socket locks,
// metrics port) is checked before it joins, so a mistake fails that daemon at once with a message
// naming the flag, instead of after the rendezvous on every node; and nothing it claimed is left
// behind when it exits.
#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>

#include <filesystem>

#include "tests/integration/daemon_harness.h"

namespace sparsecar {
namespace {

using namespace std::chrono_literals;

bool exists(const std::string& path) {
  struct stat st{};
  return ::stat(path.c_str(), &st) == 0;
}

bool has(const std::string& text, const std::string& what) { return text.find(what) != std::string::npos; }

class LocalHostTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/sparsecar-localhost-XXXXXX";
    dir_ = ::mkdtemp(tmpl);
    coordinator_ = "127.0.0.1:" + std::to_string(itest::free_tcp_port());
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  // Rank `rank` of a 2-node job whose other node never comes: it waits in the rendezvous (up to
  // join_timeout_ms) unless a local check refuses it first.
  std::unique_ptr<itest::DaemonProcess> daemon(uint32_t rank, const std::string& socket,
                                               std::vector<std::string> extra, const std::string& log) {
    std::vector<std::string> args = {"--rank", std::to_string(rank), "--world-size", "2", "--coordinator",
                                     coordinator_, "--socket", socket, "--metrics-listen", "off",
                                     "--join-timeout-ms", "3000", "--ucx-tls", "tcp", "--ucx-net-devices", "lo"};
    args.insert(args.end(), extra.begin(), extra.end());
    return std::make_unique<itest::DaemonProcess>(SPARSECARD_PATH, args, dir_ + "/" + log, std::vector<std::string>{});
  }

  std::string dir_, coordinator_;
};

TEST_F(LocalHostTest, MissingSocketDirectoryIsRefusedBeforeJoiningNamingTheFlag) {
  auto d = daemon(0, dir_ + "/typo/rank-0.sock", {}, "typo.log");
  EXPECT_EQ(d->wait_exit(2s), 1) << "refused at once, not after the 3 s join timeout\n" << d->log();
  const std::string log = d->log();
  EXPECT_TRUE(has(log, "--socket")) << log;
  EXPECT_TRUE(has(log, dir_ + "/typo")) << log;
  EXPECT_FALSE(has(log, "joining the job")) << log;
  EXPECT_FALSE(exists(dir_ + "/typo"));

  // An explicit control socket in a missing directory: the same, naming --control.
  auto c = daemon(0, dir_ + "/rank-0.sock", {"--control", "ipc://" + dir_ + "/nope/ctl.sock"}, "control.log");
  EXPECT_EQ(c->wait_exit(2s), 1) << c->log();
  EXPECT_TRUE(has(c->log(), "--control")) << c->log();
  EXPECT_FALSE(exists(dir_ + "/rank-0.sock.lock")) << "the refused daemon left its socket lock behind";
}

TEST_F(LocalHostTest, SparsecarDirectoryIsCreatedAndEveryLockRemovedOnExit) {
  const std::string ours = dir_ + "/sparsecar-run";
  auto d = daemon(0, ours + "/rank-0.sock", {}, "ours.log");
  // It passed the local checks and now waits for its peer.
  for (int i = 0; i < 200 && !has(d->log(), "joining the job"); ++i) std::this_thread::sleep_for(10ms);
  ASSERT_TRUE(has(d->log(), "joining the job")) << d->log();
  struct stat st{};
  ASSERT_EQ(::stat(ours.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0750u);
  EXPECT_TRUE(exists(ours + "/rank-0.sock.lock"));
  EXPECT_TRUE(exists(ours + "/rank-0-control.sock.lock"));
  // The peer never comes: start fails at the join timeout, and the daemon leaves nothing behind.
  EXPECT_EQ(d->wait_exit(10s), 1) << d->log();
  EXPECT_FALSE(exists(ours + "/rank-0.sock.lock"));
  EXPECT_FALSE(exists(ours + "/rank-0-control.sock.lock"));
}

TEST_F(LocalHostTest, SecondDaemonOnTheSameSocketIsRefusedAtOnceAndRemovesNothing) {
  const std::string socket = dir_ + "/sparsecard.sock";
  auto first = daemon(0, socket, {}, "first.log");
  for (int i = 0; i < 200 && !has(first->log(), "joining the job"); ++i) std::this_thread::sleep_for(10ms);
  ASSERT_TRUE(first->running()) << first->log();
  auto second = daemon(1, socket, {}, "second.log");
  EXPECT_EQ(second->wait_exit(2s), 1) << second->log();
  EXPECT_TRUE(has(second->log(), "--socket")) << second->log();
  EXPECT_TRUE(has(second->log(), "another sparsecard")) << second->log();
  EXPECT_TRUE(exists(socket + ".lock")) << "the refused daemon removed the live one's lock";
  EXPECT_TRUE(first->running());
}

TEST_F(LocalHostTest, MetricsPortTakenIsRefusedBeforeJoiningNamingTheFlag) {
  // Hold a port the way another daemon's exposer would.
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
  ASSERT_EQ(::listen(fd, 4), 0);
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  const std::string taken = "127.0.0.1:" + std::to_string(ntohs(addr.sin_port));
  auto d = daemon(0, dir_ + "/rank-0.sock", {"--metrics-listen", taken}, "metrics.log");
  EXPECT_EQ(d->wait_exit(2s), 1) << d->log();
  EXPECT_TRUE(has(d->log(), "--metrics-listen")) << d->log();
  EXPECT_FALSE(has(d->log(), "joining the job")) << d->log();
  EXPECT_FALSE(exists(dir_ + "/rank-0.sock.lock"));
  ::close(fd);
}

}  // namespace
}  // namespace sparsecar
