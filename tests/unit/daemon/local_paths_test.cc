// What a daemon claims on its host before it joins: socket directories (checked, created only when
// clearly ours), the sockets' lock files (a second daemon with the same paths is refused at once,
// naming the flag, and removes nothing of the first), and the per-rank default metrics port.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>

#include "daemon/config/local_paths.h"

namespace sparsecar {
namespace {

bool exists(const std::string& path) {
  struct stat st{};
  return ::stat(path.c_str(), &st) == 0;
}

class LocalPathsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/sparsecar-paths-XXXXXX";
    dir_ = ::mkdtemp(tmpl);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  Config config_at(const std::string& socket) {
    Config c;
    c.socket = socket;
    return c;
  }
  std::string dir_;
};

TEST_F(LocalPathsTest, MetricsPortDefaultsToBasePlusRank) {
  Config c;
  EXPECT_EQ(c.metrics_listen, "auto");
  EXPECT_EQ(resolved_metrics_listen(c), "127.0.0.1:9464");
  c.rank = 1;
  EXPECT_EQ(resolved_metrics_listen(c), "127.0.0.1:9465");
  c.metrics_listen = "0.0.0.0:9000";
  EXPECT_EQ(resolved_metrics_listen(c), "0.0.0.0:9000");
  c.metrics_listen = "off";
  EXPECT_EQ(resolved_metrics_listen(c), "off");
}

TEST_F(LocalPathsTest, ControlEndpointAutoSitsBesideTheSocket) {
  Config c = config_at("/x/y/sparsecard.sock");
  EXPECT_EQ(resolved_control_endpoint(c), "ipc:///x/y/sparsecard-control.sock");
  c.control = "off";
  EXPECT_EQ(resolved_control_endpoint(c), "off");
}

TEST_F(LocalPathsTest, SocketDirectoryCreatedOnlyWhenClearlyOurs) {
  // sparsecar* inside an existing directory: created, 0750.
  const std::string ours = dir_ + "/sparsecar-rank0";
  ASSERT_TRUE(prepare_socket_dir(ours + "/s.sock", "--socket").ok());
  struct stat st{};
  ASSERT_EQ(::stat(ours.c_str(), &st), 0);
  EXPECT_TRUE(S_ISDIR(st.st_mode));
  EXPECT_EQ(st.st_mode & 0777, 0750u);
  // Existing: fine, untouched.
  EXPECT_TRUE(prepare_socket_dir(ours + "/s.sock", "--socket").ok());
  // Another name, or more than one level missing: refused with the flag and the directory.
  Status other = prepare_socket_dir(dir_ + "/typo/s.sock", "--socket");
  ASSERT_FALSE(other.ok());
  EXPECT_NE(other.message().find("--socket"), std::string::npos) << other.message();
  EXPECT_NE(other.message().find(dir_ + "/typo"), std::string::npos) << other.message();
  EXPECT_FALSE(exists(dir_ + "/typo"));
  Status deep = prepare_socket_dir(dir_ + "/a/sparsecar/s.sock", "--control");
  ASSERT_FALSE(deep.ok());
  EXPECT_NE(deep.message().find("--control"), std::string::npos) << deep.message();
  // A file where the directory should be.
  const std::string file = dir_ + "/sparsecar-file";
  std::fclose(std::fopen(file.c_str(), "w"));
  Status not_dir = prepare_socket_dir(file + "/s.sock", "--socket");
  ASSERT_FALSE(not_dir.ok());
  EXPECT_NE(not_dir.message().find("not a directory"), std::string::npos) << not_dir.message();
}

TEST_F(LocalPathsTest, SecondDaemonWithTheSamePathsIsRefusedAndRemovesNothing) {
  const Config c = config_at(dir_ + "/sparsecard.sock");
  auto first = claim_local_paths(c);
  ASSERT_TRUE(first.ok()) << first.status().to_string();
  EXPECT_TRUE(exists(dir_ + "/sparsecard.sock.lock"));
  EXPECT_TRUE(exists(dir_ + "/sparsecard-control.sock.lock"));
  EXPECT_TRUE(first->control_lock.held());

  auto second = claim_local_paths(c);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(second.status().message().find("--socket"), std::string::npos) << second.status().message();
  EXPECT_TRUE(exists(dir_ + "/sparsecard.sock.lock")) << "the refused daemon removed the live one's lock";

  // Own trainer socket, same explicit control socket: refused naming --control.
  Config same_control = config_at(dir_ + "/other.sock");
  same_control.control = "ipc://" + dir_ + "/sparsecard-control.sock";
  auto third = claim_local_paths(same_control);
  ASSERT_FALSE(third.ok());
  EXPECT_NE(third.status().message().find("--control"), std::string::npos) << third.status().message();
  EXPECT_FALSE(exists(dir_ + "/other.sock.lock")) << "a refused claim keeps no lock";

  first = LocalClaims{};  // clean exit: both lock files go
  EXPECT_FALSE(exists(dir_ + "/sparsecard.sock.lock"));
  EXPECT_FALSE(exists(dir_ + "/sparsecard-control.sock.lock"));
}

TEST_F(LocalPathsTest, TcpOrOffControlTakesNoControlLock) {
  Config c = config_at(dir_ + "/sparsecard.sock");
  c.control = "off";
  auto claims = claim_local_paths(c);
  ASSERT_TRUE(claims.ok()) << claims.status().to_string();
  EXPECT_FALSE(claims->control_lock.held());
  EXPECT_FALSE(exists(dir_ + "/sparsecard-control.sock.lock"));
}

}  // namespace
}  // namespace sparsecar
