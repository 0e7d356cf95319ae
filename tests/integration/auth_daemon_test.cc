// Peer authentication with real daemons: an outsider `sparsecard --rank 1` that does not hold the
// job secret cannot take rank 1 (it is refused, learns nothing, rank 0 stays up) and the real
// rank 1 then joins; a job without a secret runs but warns that it is open.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <chrono>
#include <fstream>
#include <thread>

#include "daemon/control/client.h"
#include "tests/integration/daemon_harness.h"

namespace sparsecar {
namespace {

using namespace std::chrono_literals;
using itest::DaemonProcess;
using itest::JobSpec;
using itest::LocalJob;

std::string secret_file(const std::string& dir, const std::string& name, const std::string& secret) {
  const std::string path = dir + "/" + name;
  std::ofstream(path) << secret << "\n";
  EXPECT_EQ(::chmod(path.c_str(), 0600), 0);
  return path;
}

// `status` of the daemon whose control socket is `endpoint` (its "result" object, or null).
nlohmann::json status_of(const std::string& endpoint) {
  // The control socket opens just after the trainer socket.
  const std::string path = endpoint.substr(6);
  for (const auto until = std::chrono::steady_clock::now() + 20s; std::chrono::steady_clock::now() < until;) {
    struct stat st {};
    if (::stat(path.c_str(), &st) == 0) break;
    std::this_thread::sleep_for(20ms);  // bounded poll for a file another process creates
  }
  control::ClientOptions options;
  options.endpoint = endpoint;
  auto client = control::ControlClient::connect(options);
  EXPECT_TRUE(client.ok()) << client.status().to_string();
  if (!client.ok()) return nullptr;
  auto reply = (*client)->call("status", nlohmann::json::object());
  EXPECT_TRUE(reply.ok()) << reply.status().to_string();
  return reply.ok() ? (*reply)["result"] : nlohmann::json();
}

bool wait_exit(DaemonProcess& d, std::chrono::milliseconds bound) {
  const auto until = std::chrono::steady_clock::now() + bound;
  while (std::chrono::steady_clock::now() < until) {
    if (!d.running()) return true;
    std::this_thread::sleep_for(20ms);  // polling a child process; bounded
  }
  return false;
}

bool wait_file(const std::string& path, std::chrono::milliseconds bound) {
  const auto until = std::chrono::steady_clock::now() + bound;
  struct stat st {};
  while (std::chrono::steady_clock::now() < until) {
    if (::stat(path.c_str(), &st) == 0) return true;
    std::this_thread::sleep_for(20ms);
  }
  return false;
}

TEST(AuthDaemonTest, OutsiderWithoutTheSecretCannotTakeARankAndTheRealRankJoins) {
  char tmpl[] = "/tmp/sparsecar-auth-itest-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  const std::string good = secret_file(dir, "job.secret", "the real job secret 0123456789abcdef");
  const std::string bad = secret_file(dir, "outsider.secret", "an outsider's guess 0123456789abcdef");
  const std::string coordinator = "127.0.0.1:" + std::to_string(itest::free_tcp_port());
  JobSpec spec;
  spec.world = 2;
  spec.extra = {"--coordinator", coordinator, "--job-id", "987654321"};
  // The outsider guesses another job id too: nothing may tell it rank 0's.
  spec.per_rank_extra = {{"--job-secret-file", good}, {"--job-secret-file", bad, "--job-id", "111"}};
  LocalJob job(spec);

  ASSERT_TRUE(wait_exit(job.daemon(1), 20s)) << "the outsider was not refused\n" << job.logs();
  const std::string outsider_log = job.daemon(1).log();
  EXPECT_NE(outsider_log.find("authentication failed"), std::string::npos) << outsider_log;
  EXPECT_EQ(outsider_log.find("987654321"), std::string::npos) << "job id leaked to the outsider:\n" << outsider_log;
  EXPECT_EQ(outsider_log.find("rank-0.sock"), std::string::npos) << outsider_log;
  ASSERT_TRUE(job.daemon(0).running()) << job.logs();
  EXPECT_NE(job.daemon(0).log().find("authentication failed for a hello from 127.0.0.1"), std::string::npos)
      << job.daemon(0).log();
  EXPECT_EQ(job.daemon(0).log().find("the job is open"), std::string::npos);

  // A forged 60-byte join and an idle connection do not end rank 0 either.
  {
    int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(std::stoi(coordinator.substr(coordinator.rfind(':') + 1))));
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    const std::string forged = "SCRZ" + std::string("\x02\x00\x00\x00\x18\x00\x00\x00", 8) + std::string(48, 'x');
    ASSERT_EQ(::write(fd, forged.data(), forged.size()), static_cast<ssize_t>(forged.size()));
    int idle = ::socket(AF_INET, SOCK_STREAM, 0);
    ASSERT_EQ(::connect(idle, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    std::this_thread::sleep_for(1500ms);  // give a broken rank 0 the time to fall over (it took 1 s)
    EXPECT_TRUE(job.daemon(0).running()) << job.daemon(0).log();
    ::close(fd);
    ::close(idle);
  }

  // The real rank 1, with the real secret.
  const std::string socket1 = dir + "/real-rank-1.sock";
  DaemonProcess real(SPARSECARD_PATH,
                     {"--rank", "1", "--world-size", "2", "--coordinator", coordinator, "--job-id", "987654321",
                      "--socket", socket1, "--metrics-listen", "off", "--join-timeout-ms", "20000", "--ucx-tls", "tcp",
                      "--ucx-net-devices", "lo", "--job-secret-file", good},
                     dir + "/real-rank-1.log", {});
  EXPECT_TRUE(wait_file(socket1, 30s)) << real.log() << job.logs();
  EXPECT_TRUE(wait_file(job.sockets()[0], 30s)) << job.logs();
  EXPECT_TRUE(real.running()) << real.log();
  nlohmann::json st = status_of("ipc://" + job.dir() + "/rank-0-control.sock");
  EXPECT_EQ(st["job_open"], false) << st.dump();
  EXPECT_EQ(st["peers"][0]["state"], "up") << st.dump();
  EXPECT_EQ(real.stop(), 0) << real.log();
  std::filesystem::remove_all(dir);
}

TEST(AuthDaemonTest, JobWithoutSecretRunsButWarnsThatItIsOpen) {
  JobSpec spec;
  spec.world = 2;
  LocalJob job(spec);
  ASSERT_TRUE(job.wait_ready()) << job.logs();
  for (uint32_t r = 0; r < 2; ++r) {
    EXPECT_NE(job.daemon(r).log().find("the job is open: any host that reaches the coordinator port"),
              std::string::npos)
        << job.daemon(r).log();
    nlohmann::json st = status_of("ipc://" + job.dir() + "/rank-" + std::to_string(r) + "-control.sock");
    EXPECT_EQ(st["job_open"], true) << st.dump();
  }
}

TEST(AuthDaemonTest, UnsafeSecretFileStopsTheStart) {
  char tmpl[] = "/tmp/sparsecar-auth-itest-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  const std::string loose = secret_file(dir, "loose.secret", "a secret that others may read 0123");
  ASSERT_EQ(::chmod(loose.c_str(), 0644), 0);
  DaemonProcess d(SPARSECARD_PATH,
                  {"--rank", "0", "--world-size", "2", "--coordinator", "127.0.0.1:0", "--socket", dir + "/s.sock",
                   "--metrics-listen", "off", "--job-secret-file", loose},
                  dir + "/d.log", {});
  ASSERT_TRUE(wait_exit(d, 20s)) << d.log();
  EXPECT_NE(d.stop(), 0);
  EXPECT_NE(d.log().find("mode 0644"), std::string::npos) << d.log();
  EXPECT_EQ(d.log().find("a secret that others"), std::string::npos) << d.log();
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace sparsecar
