// Chaos: real sparsecard daemons on loopback (UCX over tcp), real trainers through the client
// library, under failures. Every result that comes back OK is checked against the float64 mean
// computed here from the same seeded gradients; every failure must name its cause and arrive
// within a bound. Nothing may hang: every wait is bounded, and so is each test (ctest timeout).
#include <gtest/gtest.h>
#include <signal.h>

#include <cmath>
#include <numeric>
#include <random>
#include <thread>

#include "daemon/control/client.h"
#include "sparsecar/client.h"
#include "tests/integration/daemon_harness.h"

namespace sparsecar {
namespace {

using namespace std::chrono_literals;
using itest::JobSpec;
using itest::LocalJob;
using Clock = std::chrono::steady_clock;

constexpr size_t kN = 1000;

// Trainer `node`'s gradient for `step` of job `job`: seeded, so the reference can recompute it.
std::vector<float> gradient(uint32_t job, uint32_t node, uint64_t step) {
  std::mt19937 rng(1000003u * static_cast<uint32_t>(step) + 1009u * node + 7919u * job);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(kN);
  for (auto& x : v) x = dist(rng);
  return v;
}

// Asserts `got` is the float64 mean over the world's nodes of gradient(job, *, step).
void expect_mean(const float* got, uint32_t world, uint32_t job, uint64_t step, const std::string& who) {
  std::vector<double> sum(kN, 0.0), abs_sum(kN, 0.0);
  for (uint32_t node = 0; node < world; ++node) {
    auto g = gradient(job, node, step);
    for (size_t i = 0; i < kN; ++i) {
      sum[i] += g[i];
      abs_sum[i] += std::fabs(g[i]);
    }
  }
  for (size_t i = 0; i < kN; ++i) {
    ASSERT_NEAR(got[i], sum[i] / world, 1e-6 * abs_sum[i] / world + 1e-30)
        << who << " job " << job << " step " << step << " element " << i << ": not the mean of this job's gradients";
  }
}

// Asserts `got` is the float64 sum of gradient(job, node, step) over `parts` ({node, step}) / world.
void expect_average_of(const float* got, const std::vector<std::pair<uint32_t, uint64_t>>& parts, uint32_t world,
                       uint32_t job, const std::string& who) {
  std::vector<double> sum(kN, 0.0), abs_sum(kN, 0.0);
  for (const auto& [node, step] : parts) {
    auto g = gradient(job, node, step);
    for (size_t i = 0; i < kN; ++i) {
      sum[i] += g[i];
      abs_sum[i] += std::fabs(g[i]);
    }
  }
  for (size_t i = 0; i < kN; ++i) {
    ASSERT_NEAR(got[i], sum[i] / world, 1e-6 * abs_sum[i] / world + 1e-30) << who << " element " << i;
  }
}

// A trainer connected to one daemon with one registered tensor.
struct Trainer {
  std::unique_ptr<Client> client;
  Tensor* tensor = nullptr;

  static Trainer connect(const std::string& socket) {
    Trainer t;
    auto c = Client::connect(socket);
    EXPECT_TRUE(c.ok()) << c.status().to_string();
    if (!c.ok()) return t;
    t.client = std::move(*c);
    auto reg = t.client->register_tensor("w", kN);
    EXPECT_TRUE(reg.ok()) << reg.status().to_string();
    if (reg.ok()) t.tensor = *reg;
    return t;
  }
  Status submit(uint32_t job, uint32_t node, uint64_t step) {
    if (tensor == nullptr) return failed_precondition("not connected");
    auto g = gradient(job, node, step);
    std::copy(g.begin(), g.end(), tensor->data());
    return client->submit(*tensor, step);
  }
  Status wait(uint64_t step, std::chrono::milliseconds timeout = 20s) {
    auto done = client->wait(*tensor, step, timeout);
    return done.ok() ? Status::Ok() : done.status();
  }
};

std::vector<Trainer> connect_all(LocalJob& job, uint32_t world) {
  std::vector<Trainer> out;
  for (uint32_t r = 0; r < world; ++r) out.push_back(Trainer::connect(job.sockets()[r]));
  return out;
}

// Runs `steps` (in order) on every node at once; checks each result against the mean.
void run_checked_steps(LocalJob& job, uint32_t world, uint32_t job_no, std::vector<Trainer>& trainers,
                       const std::vector<uint64_t>& steps) {
  for (uint64_t step : steps) {
    for (uint32_t r = 0; r < world; ++r) ASSERT_TRUE(trainers[r].submit(job_no, r, step).ok());
    for (uint32_t r = 0; r < world; ++r) {
      Status s = trainers[r].wait(step);
      ASSERT_TRUE(s.ok()) << "rank " << r << " job " << job_no << " step " << step << ": " << s.to_string() << "\n"
                          << job.logs();
      expect_mean(trainers[r].tensor->data(), world, job_no, step, "rank " + std::to_string(r));
    }
  }
}

bool wait_for_log(LocalJob& job, uint32_t rank, const std::string& text, std::chrono::milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  while (job.daemon(rank).log().find(text) == std::string::npos) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(20ms);
  }
  return true;
}

// The reproduction: rank 0's trainer leaves while rank 1's trainer submits step 5, so
// rank 1's step-5 message reaches rank 0 after its reset. The next job on the same daemons runs
// steps 0..5 again; its step 5 must be that job's mean (it was 500.5 instead of 1.5 once).
class StaleAcrossJobs : public ::testing::TestWithParam<const char*> {};

TEST_P(StaleAcrossJobs, ALateMessageOfTheLastJobIsNeverSummedIntoTheNext) {
  JobSpec spec{2, 1, "tcp", {"--compression", GetParam(), "--density", "1", "--step-timeout-ms", "3000"}, {}, {}};
  LocalJob job(spec);
  ASSERT_TRUE(job.wait_ready()) << job.logs();
  {
    std::vector<Trainer> trainers = connect_all(job, 2);
    run_checked_steps(job, 2, 1, trainers, {0, 1, 2, 3, 4});
    trainers[0] = Trainer{};  // rank 0's trainer leaves; its daemon resets
    ASSERT_TRUE(wait_for_log(job, 0, "job reset", 10s)) << job.logs();
    ASSERT_TRUE(trainers[1].submit(1, 1, 5).ok());
    Status late = trainers[1].wait(5);
    EXPECT_FALSE(late.ok()) << "rank 1's step 5 cannot complete without rank 0";
  }
  std::vector<Trainer> trainers = connect_all(job, 2);
  run_checked_steps(job, 2, 2, trainers, {0, 5});
  EXPECT_NE(job.daemon(0).log().find("stale"), std::string::npos) << "the late message was not counted as stale\n"
                                                                    << job.logs();
}

INSTANTIATE_TEST_SUITE_P(SparseAndDense, StaleAcrossJobs, ::testing::Values("on", "off"),
                         [](const auto& p) { return std::string(p.param) == "on" ? "sparse" : "dense_ring"; });

// Long-lived daemons serve one job after another; every job's every step is its own mean.
TEST(BackToBackJobs, TwentyJobsOnTheSameDaemonsAllSucceed) {
  JobSpec spec{2, 1, "tcp", {"--compression", "on", "--density", "1", "--step-timeout-ms", "5000"}, {}, {}};
  LocalJob job(spec);
  ASSERT_TRUE(job.wait_ready()) << job.logs();
  for (uint32_t j = 0; j < 20; ++j) {
    std::vector<Trainer> trainers = connect_all(job, 2);
    run_checked_steps(job, 2, 100 + j, trainers, {0, 1, 2});
    if (HasFatalFailure()) return;
  }
}

// kill -9 of a peer daemon: the survivor's trainer learns within a moment, naming the peer (UCX
// sees the connection break); after peer_down_grace_ms the survivor exits with status 3 so that
// the service manager restarts the job.
TEST(PeerFailure, KilledPeerFailsStepsAtOnceAndTheSurvivorExitsAfterTheGrace) {
  JobSpec spec{2, 1, "tcp", {"--compression", "on", "--density", "1", "--step-timeout-ms", "10000", "--peer-down-grace-ms", "1500"}, {}, {}};
  LocalJob job(spec);
  ASSERT_TRUE(job.wait_ready()) << job.logs();
  std::vector<Trainer> trainers = connect_all(job, 2);
  run_checked_steps(job, 2, 1, trainers, {0});
  job.daemon(1).kill9();
  const auto killed = Clock::now();
  ASSERT_TRUE(trainers[0].submit(1, 0, 1).ok());
  Status s = trainers[0].wait(1);
  EXPECT_FALSE(s.ok());
  EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s.to_string();
  EXPECT_LT(Clock::now() - killed, 5s) << "the survivor waited for its step deadline instead";
  const int code = job.daemon(0).wait_exit(10s);
  EXPECT_EQ(code, 3) << job.logs();
  EXPECT_NE(job.daemon(0).log().find("peer_down_grace_ms"), std::string::npos) << job.logs();
}

// `cmd` on rank `r`'s control socket; its "result" (null on failure, which the test reports).
nlohmann::json control_call(LocalJob& job, uint32_t r, const std::string& cmd, const nlohmann::json& args = nlohmann::json::object()) {
  control::ClientOptions options;
  options.endpoint = "ipc://" + job.dir() + "/rank-" + std::to_string(r) + "-control.sock";
  auto client = control::ControlClient::connect(options);
  EXPECT_TRUE(client.ok()) << client.status().to_string();
  if (!client.ok()) return nullptr;
  auto reply = (*client)->call(cmd, args);
  EXPECT_TRUE(reply.ok()) << cmd << " on rank " << r << ": " << reply.status().to_string();
  return reply.ok() ? (*reply)["result"] : nlohmann::json();
}

// Recovery by replacement: kill -9 of rank 1 in a job of three. The survivors' steps fail at once
// naming it; a new rank-1 daemon started like the lost one is admitted by rank 0 into the running
// job (rank 2 learns it from rank 0), takes rank 0's live decisions, restores the lost process's
// last checkpoint, its new trainer joins, and every later step on every rank is the exact mean.
class Replacement : public ::testing::TestWithParam<const char*> {};

TEST_P(Replacement, AReplacementForAKilledRankRejoinsTheRunningJob) {
  JobSpec spec{3, 1, GetParam(), {"--compression", "on", "--density", "1", "--step-timeout-ms", "10000", "--peer-down-grace-ms", "4000"}, {}, {}};
  LocalJob job(spec);
  ASSERT_TRUE(job.wait_ready()) << job.logs();
  std::vector<Trainer> trainers = connect_all(job, 3);
  run_checked_steps(job, 3, 1, trainers, {0, 1});
  // A live decision before the loss: the replacement must run under it too.
  nlohmann::json set = control_call(job, 0, "set", {{"knob", "step_timeout_ms"}, {"value", 9000}});
  ASSERT_FALSE(set.is_null()) << job.logs();
  run_checked_steps(job, 3, 1, trainers, {2, 3, 4});
  // Rank 1's residuals as of step 4, for its replacement.
  const std::string checkpoint = job.dir() + "/rank-1.ckpt";
  ASSERT_FALSE(control_call(job, 1, "checkpoint", {{"path", checkpoint}}).is_null()) << job.logs();

  job.daemon(1).kill9();
  const auto killed = Clock::now();
  trainers[1] = Trainer{};  // its trainer went with it
  for (uint32_t r : {0u, 2u}) ASSERT_TRUE(trainers[r].submit(1, r, 5).ok());
  for (uint32_t r : {0u, 2u}) {
    Status s = trainers[r].wait(5);
    EXPECT_FALSE(s.ok()) << "rank " << r << "'s step 5 cannot complete without rank 1";
    EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s.to_string();
  }

  job.restart(1);
  ASSERT_TRUE(wait_for_log(job, 1, "ready: trainers connect to", 20s)) << job.logs();
  EXPECT_NE(job.daemon(1).log().find("as a replacement (generation 1)"), std::string::npos) << job.logs();
  trainers[1] = Trainer::connect(job.sockets()[1]);
  ASSERT_FALSE(control_call(job, 1, "restore", {{"path", checkpoint}}).is_null()) << job.logs();
  // Step 6: the survivors' failed step 5 was rolled back into their error-feedback residuals, so
  // their step-6 messages carry gradients 5 and 6; the replacement starts with nothing carried.
  for (uint32_t r = 0; r < 3; ++r) ASSERT_TRUE(trainers[r].submit(1, r, 6).ok());
  for (uint32_t r = 0; r < 3; ++r) {
    Status s = trainers[r].wait(6);
    ASSERT_TRUE(s.ok()) << "rank " << r << " step 6: " << s.to_string() << "\n" << job.logs();
    expect_average_of(trainers[r].tensor->data(), {{0, 5}, {0, 6}, {1, 6}, {2, 5}, {2, 6}}, 3, 1,
                      "rank " + std::to_string(r) + " step 6");
  }
  run_checked_steps(job, 3, 1, trainers, {7, 8, 9});
  if (HasFatalFailure()) return;
  EXPECT_NE(job.daemon(0).log().find("as the replacement for lost rank 1"), std::string::npos) << job.logs();
  EXPECT_NE(job.daemon(2).log().find("rejoined the job (generation 1)"), std::string::npos) << job.logs();
  EXPECT_NE(job.daemon(1).log().find("start at zero except those restored from a checkpoint"), std::string::npos)
      << "the replacement did not say what it lost and what it restored\n"
      << job.logs();
  for (uint32_t r = 0; r < 3; ++r) {
    nlohmann::json st = control_call(job, r, "status");
    ASSERT_FALSE(st.is_null());
    EXPECT_EQ(st["epoch"], 1) << "rank " << r << " does not hold rank 0's decision\n" << st.dump();
    if (r != 1) {
      EXPECT_EQ(st["peers_rejoined"], 1) << "rank " << r << "\n" << st.dump();
    }
  }
  // The replacement came within peer_down_grace_ms: past it, the survivors are still serving.
  std::this_thread::sleep_until(killed + 5s);
  for (uint32_t r : {0u, 2u}) EXPECT_TRUE(job.daemon(r).running()) << job.logs();
  run_checked_steps(job, 3, 1, trainers, {10});
}

// Over TCP UCX sees the kill at once; over shared memory the daemon's pidfd watch does.
INSTANTIATE_TEST_SUITE_P(PeerFailure, Replacement, ::testing::Values("tcp", "shm"),
                         [](const auto& p) { return std::string(p.param); });

// With accept_replacements off, rank 0 refuses the replacement with a reason that says so (it
// exits at once instead of waiting out its join timeout); the survivor exits after the grace.
TEST(PeerFailure, WithReplacementsOffAReplacementIsRefusedAndTheSurvivorExits) {
  JobSpec spec{2, 1, "tcp",
               {"--compression", "on", "--density", "1", "--step-timeout-ms", "10000", "--peer-down-grace-ms", "4000"},
               {{"--accept-replacements", "off"}}, {}};
  LocalJob job(spec);
  ASSERT_TRUE(job.wait_ready()) << job.logs();
  std::vector<Trainer> trainers = connect_all(job, 2);
  run_checked_steps(job, 2, 1, trainers, {0});
  job.daemon(1).kill9();
  trainers[1] = Trainer{};
  ASSERT_TRUE(wait_for_log(job, 0, "rank 1", 5s)) << job.logs();
  const auto restarted = Clock::now();
  job.restart(1);
  const int refused = job.daemon(1).wait_exit(15s);
  EXPECT_GT(refused, 0) << job.logs();
  EXPECT_LT(Clock::now() - restarted, 10s) << "the replacement waited for its join timeout instead of being refused";
  EXPECT_NE(job.daemon(1).log().find("does not admit replacements"), std::string::npos) << job.logs();
  EXPECT_EQ(job.daemon(0).wait_exit(15s), 3) << job.logs();
}

// SIGSTOP of a peer: no connection breaks, so only the daemon's own deadline can notice. The
// survivor's step fails at step_timeout naming the silent peer; nothing hangs, nothing exits.
TEST(PeerFailure, StoppedPeerFailsTheStepAtTheDeadlineNamingIt) {
  JobSpec spec{2, 1, "tcp", {"--compression", "on", "--density", "1", "--step-timeout-ms", "2000", "--peer-down-grace-ms", "0"}, {}, {}};
  LocalJob job(spec);
  ASSERT_TRUE(job.wait_ready()) << job.logs();
  std::vector<Trainer> trainers = connect_all(job, 2);
  run_checked_steps(job, 2, 1, trainers, {0});
  job.daemon(1).signal(SIGSTOP);
  const auto stopped = Clock::now();
  ASSERT_TRUE(trainers[0].submit(1, 0, 1).ok());
  Status s = trainers[0].wait(1);
  EXPECT_EQ(s.code(), Code::kDeadlineExceeded) << s.to_string();
  EXPECT_NE(s.message().find("rank 1"), std::string::npos) << s.to_string();
  EXPECT_LT(Clock::now() - stopped, 6s);
  EXPECT_TRUE(job.daemon(0).running());
  job.daemon(1).signal(SIGCONT);
}

// The transport's fault switch on every daemon, for data messages: duplicated, delayed and
// reordered messages must change nothing — every step succeeds with exactly this job's mean.
TEST(FaultMix, DuplicatedDelayedAndReorderedMessagesChangeNothing) {
  JobSpec spec{2, 1, "tcp", {"--compression", "on", "--density", "1", "--step-timeout-ms", "5000"}, {},
               {"SPARSECAR_TEST_FAULTS=duplicate=0.2,delay=0.2,reorder=0.2,delay_ms=20,seed=11,kinds=1"}};
  LocalJob job(spec);
  ASSERT_TRUE(job.wait_ready()) << job.logs();
  std::vector<Trainer> trainers = connect_all(job, 2);
  std::vector<uint64_t> steps(30);
  std::iota(steps.begin(), steps.end(), 0);
  run_checked_steps(job, 2, 1, trainers, steps);
  EXPECT_NE(job.daemon(0).log().find("SPARSECAR_TEST_FAULTS is set"), std::string::npos);
}

// Lost and corrupted data messages: a step either returns exactly this job's mean or fails
// with an error naming a peer — never OK with anything else — and each failure comes within
// the step deadline. Seeded: which messages are hit is the same every run. Error feedback is
// off so that an OK step's result is exactly this step's mean: with it on, what a failed step
// did not deliver goes out with the next one (nothing lost), and the reference would have to
// know which node failed which step.
TEST(FaultMix, LostAndCorruptedMessagesFailStepsLoudlyAndNothingElse) {
  JobSpec spec{2, 1, "tcp",
               {"--compression", "on", "--density", "1", "--error-feedback", "off", "--step-timeout-ms", "1500"}, {},
               {"SPARSECAR_TEST_FAULTS=drop=0.1,corrupt=0.1,seed=5,kinds=1"}};
  LocalJob job(spec);
  ASSERT_TRUE(job.wait_ready()) << job.logs();
  std::vector<Trainer> trainers = connect_all(job, 2);
  int ok = 0, failed = 0;
  for (uint64_t step = 0; step < 20; ++step) {
    for (uint32_t r = 0; r < 2; ++r) ASSERT_TRUE(trainers[r].submit(1, r, step).ok());
    for (uint32_t r = 0; r < 2; ++r) {
      const auto started = Clock::now();
      Status s = trainers[r].wait(step);
      EXPECT_LT(Clock::now() - started, 5s) << "rank " << r << " step " << step;
      if (s.ok()) {
        ++ok;
        expect_mean(trainers[r].tensor->data(), 2, 1, step, "rank " + std::to_string(r));
        if (HasFatalFailure()) return;
      } else {
        ++failed;
        EXPECT_NE(s.message().find("rank"), std::string::npos) << s.to_string();
      }
    }
  }
  EXPECT_GT(failed, 0) << "the faults never hit: the test tested nothing";
  EXPECT_GT(ok, 0);
}

}  // namespace
}  // namespace sparsecar
