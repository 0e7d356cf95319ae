// Integration: real sparsecard daemons on loopback (UCX over tcp and over shared memory), real
// trainers through the client library (threads of this process, or forked processes where a
// trainer must die). Results are compared with references computed here, independently of the
// daemon: the float64 mean for dense, and a sort-based top-k with error feedback per node.
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <thread>

#include "sparsecar/client.h"
#include "tests/integration/daemon_harness.h"

namespace sparsecar {
namespace {

using namespace std::chrono_literals;
using itest::JobSpec;
using itest::LocalJob;

std::vector<float> gradient(size_t n, uint32_t node, uint32_t client, uint64_t step, uint32_t tensor) {
  std::mt19937 rng(static_cast<uint32_t>(1000003 * step + 1009 * node + 101 * client + tensor));
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

struct TrainerResult {
  Status status;
  std::vector<std::vector<std::vector<float>>> outputs;  // [step][tensor] -> averaged gradient
  uint64_t bytes_sent = 0;
};

// One trainer: registers `sizes`, runs `steps` steps, keeps every averaged gradient.
TrainerResult run_trainer(const std::string& socket, uint32_t node, uint32_t client, const std::vector<size_t>& sizes,
                          uint64_t steps, std::chrono::milliseconds wait_timeout = 20s) {
  TrainerResult out;
  auto c = Client::connect(socket);
  if (!c.ok()) {
    out.status = c.status();
    return out;
  }
  std::vector<Tensor*> tensors;
  for (size_t t = 0; t < sizes.size(); ++t) {
    auto reg = (*c)->register_tensor("tensor" + std::to_string(t), sizes[t]);
    if (!reg.ok()) {
      out.status = reg.status();
      return out;
    }
    tensors.push_back(*reg);
  }
  for (uint64_t step = 0; step < steps; ++step) {
    for (size_t t = 0; t < sizes.size(); ++t) {
      auto g = gradient(sizes[t], node, client, step, static_cast<uint32_t>(t));
      std::copy(g.begin(), g.end(), tensors[t]->data());
      Status s = (*c)->submit(*tensors[t], step, {.lr = 0.1f});
      if (!s.ok()) {
        out.status = s;
        return out;
      }
    }
    auto& per_step = out.outputs.emplace_back();
    for (size_t t = 0; t < sizes.size(); ++t) {
      auto done = (*c)->wait(*tensors[t], step, wait_timeout);
      if (!done.ok()) {
        out.status = done.status();
        return out;
      }
      out.bytes_sent += done->bytes_sent;
      per_step.emplace_back(tensors[t]->data(), tensors[t]->data() + sizes[t]);
    }
  }
  return out;
}

// Runs W x L trainers concurrently; results[node * L + client].
std::vector<TrainerResult> run_job(LocalJob& job, const JobSpec& spec, const std::vector<size_t>& sizes,
                                   uint64_t steps) {
  std::vector<TrainerResult> results(spec.world * spec.local_clients);
  std::vector<std::thread> threads;
  for (uint32_t node = 0; node < spec.world; ++node) {
    for (uint32_t client = 0; client < spec.local_clients; ++client) {
      threads.emplace_back([&, node, client] {
        results[node * spec.local_clients + client] =
            run_trainer(job.sockets()[node], node, client, sizes, steps);
      });
    }
  }
  for (auto& t : threads) t.join();
  return results;
}

std::vector<uint32_t> reference_topk(const std::vector<float>& x, size_t k) {
  std::vector<uint32_t> idx(x.size());
  std::iota(idx.begin(), idx.end(), 0u);
  std::sort(idx.begin(), idx.end(), [&](uint32_t a, uint32_t b) {
    float fa = std::fabs(x[a]), fb = std::fabs(x[b]);
    return fa != fb ? fa > fb : a < b;
  });
  idx.resize(std::min(k, x.size()));
  return idx;
}

struct Case {
  uint32_t world;
  uint32_t local_clients;
  const char* tls;
};

std::string case_name(const ::testing::TestParamInfo<Case>& info) {
  return "W" + std::to_string(info.param.world) + "L" + std::to_string(info.param.local_clients) + "_" + info.param.tls;
}

class ExchangeTest : public ::testing::TestWithParam<Case> {};

TEST_P(ExchangeTest, CompressionOffEqualsTheFloat64Mean) {
  JobSpec spec{GetParam().world, GetParam().local_clients, GetParam().tls, {"--compression", "off"}, {}, {}};
  LocalJob job(spec);
  ASSERT_TRUE(job.wait_ready()) << job.logs();
  const std::vector<size_t> sizes{1000, 3};
  const uint64_t steps = 3;
  auto results = run_job(job, spec, sizes, steps);
  const uint32_t trainers = spec.world * spec.local_clients;
  for (uint32_t i = 0; i < trainers; ++i) ASSERT_TRUE(results[i].status.ok()) << results[i].status.to_string() << job.logs();
  for (uint64_t step = 0; step < steps; ++step) {
    for (size_t t = 0; t < sizes.size(); ++t) {
      std::vector<double> sum(sizes[t], 0.0), abs_sum(sizes[t], 0.0);
      for (uint32_t node = 0; node < spec.world; ++node) {
        for (uint32_t c = 0; c < spec.local_clients; ++c) {
          auto g = gradient(sizes[t], node, c, step, static_cast<uint32_t>(t));
          for (size_t i = 0; i < sizes[t]; ++i) {
            sum[i] += g[i];
            abs_sum[i] += std::fabs(g[i]);
          }
        }
      }
      for (uint32_t tr = 0; tr < trainers; ++tr) {
        const auto& got = results[tr].outputs[step][t];
        for (size_t i = 0; i < sizes[t]; ++i) {
          // 1e-6 relative to the magnitude of the summands (the mean itself may cancel to ~0).
          ASSERT_NEAR(got[i], sum[i] / trainers, 1e-6 * abs_sum[i] / trainers)
              << "trainer " << tr << " step " << step << " tensor " << t << " element " << i;
        }
      }
    }
  }
}

TEST_P(ExchangeTest, TopkEqualsTheMeanOfEachNodesSelection) {
  const double density = 0.01;
  JobSpec spec{GetParam().world, GetParam().local_clients, GetParam().tls,
               {"--compression", "on", "--selector", "topk", "--density", "0.01"}, {}, {}};
  LocalJob job(spec);
  ASSERT_TRUE(job.wait_ready()) << job.logs();
  const size_t n = 4000;
  const size_t k = static_cast<size_t>(std::llround(density * n));
  const uint64_t steps = 4;
  auto results = run_job(job, spec, {n}, steps);
  const uint32_t trainers = spec.world * spec.local_clients;
  for (uint32_t i = 0; i < trainers; ++i) ASSERT_TRUE(results[i].status.ok()) << results[i].status.to_string() << job.logs();
  // Each node: local sum of its clients (float, in client order), error feedback, top-k.
  std::vector<std::vector<float>> residual(spec.world, std::vector<float>(n, 0.0f));
  for (uint64_t step = 0; step < steps; ++step) {
    std::vector<double> expected(n, 0.0);
    for (uint32_t node = 0; node < spec.world; ++node) {
      std::vector<float> local(n, 0.0f);
      for (uint32_t c = 0; c < spec.local_clients; ++c) {
        auto g = gradient(n, node, c, step, 0);
        for (size_t i = 0; i < n; ++i) local[i] += g[i];
      }
      for (size_t i = 0; i < n; ++i) residual[node][i] += local[i];
      for (uint32_t i : reference_topk(residual[node], k)) {
        expected[i] += residual[node][i];
        residual[node][i] = 0.0f;
      }
    }
    for (uint32_t tr = 0; tr < trainers; ++tr) {
      const auto& got = results[tr].outputs[step][0];
      for (size_t i = 0; i < n; ++i) {
        ASSERT_NEAR(got[i], expected[i] / trainers, 1e-6 * std::fabs(expected[i]) / trainers + 1e-12)
            << "trainer " << tr << " step " << step << " element " << i;
      }
    }
  }
  // Sparse all-gather: (W-1) messages of 72 + 8k bytes per node per step.
  EXPECT_EQ(results[0].bytes_sent, steps * (spec.world - 1) * (80 + 8 * k));
}

INSTANTIATE_TEST_SUITE_P(Loopback, ExchangeTest,
                         ::testing::Values(Case{2, 1, "tcp"}, Case{2, 2, "tcp"}, Case{4, 1, "tcp"}, Case{4, 2, "tcp"},
                                           Case{2, 1, "shm"}, Case{4, 2, "shm"}),
                         case_name);

TEST(FailureTest, WrongSizeRegistrationFailsTheFirstStepOnEveryNode) {
  JobSpec spec{2, 1, "tcp", {"--step-timeout-ms", "5000"}, {}, {}};
  LocalJob job(spec);
  ASSERT_TRUE(job.wait_ready()) << job.logs();
  TrainerResult a, b;
  auto start = std::chrono::steady_clock::now();
  std::thread ta([&] { a = run_trainer(job.sockets()[0], 0, 0, {100}, 1); });
  std::thread tb([&] { b = run_trainer(job.sockets()[1], 1, 0, {120}, 1); });
  ta.join();
  tb.join();
  for (auto* r : {&a, &b}) {
    EXPECT_EQ(r->status.code(), Code::kFailedPrecondition) << r->status.to_string();
    EXPECT_NE(r->status.message().find("tensor0"), std::string::npos) << r->status.message();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - start, 15s);
}

TEST(FailureTest, KilledPeerDaemonFailsTheStepNamingItWithinTheDeadline) {
  JobSpec spec{2, 1, "tcp", {"--step-timeout-ms", "4000"}, {}, {}};
  LocalJob job(spec);
  ASSERT_TRUE(job.wait_ready()) << job.logs();
  // One good step, then rank 1's daemon is killed while rank 0's trainer goes on.
  TrainerResult warm0, warm1;
  std::thread t1([&] { warm1 = run_trainer(job.sockets()[1], 1, 0, {100}, 1); });
  auto c = Client::connect(job.sockets()[0]);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  auto t = (*c)->register_tensor("tensor0", 100);
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE((*c)->submit(**t, 0).ok());
  ASSERT_TRUE((*c)->wait(**t, 0, 20s).ok());
  t1.join();
  job.daemon(1).kill9();
  auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE((*c)->submit(**t, 1).ok());
  auto done = (*c)->wait(**t, 1, 20s);
  ASSERT_FALSE(done.ok());
  EXPECT_TRUE(done.status().code() == Code::kUnavailable || done.status().code() == Code::kDeadlineExceeded)
      << done.status().to_string();
  EXPECT_NE(done.status().message().find("rank 1"), std::string::npos) << done.status().message();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 6s);
  // The surviving daemon keeps serving.
  EXPECT_TRUE(job.daemon(0).running());
}

// Node 0's only trainer dies in the middle of step 1 (tensor0 done, tensor1 not submitted). Node
// 1's trainer waits for tensor1 step 1: it used to wait the full step timeout (30 s, no abort was
// sent); node 0 now fails that step job-wide and node 1's trainer errors at once, naming rank 0
// and the cause.
TEST(FailureTest, TrainerDyingMidStepAbortsThePeersStepAtOnce) {
  JobSpec spec{2, 1, "tcp", {"--step-timeout-ms", "30000"}, {}, {}};
  LocalJob job(spec);
  ASSERT_TRUE(job.wait_ready()) << job.logs();
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  pid_t child = fork();
  if (child == 0) {
    auto c = Client::connect(job.sockets()[0]);
    char ok = 0;
    if (c.ok()) {
      auto t0 = (*c)->register_tensor("tensor0", 64);
      auto t1 = (*c)->register_tensor("tensor1", 64);
      ok = t0.ok() && t1.ok() && (*c)->submit(**t0, 0).ok() && (*c)->submit(**t1, 0).ok() &&
           (*c)->wait(**t0, 0, 20s).ok() && (*c)->wait(**t1, 0, 20s).ok() && (*c)->submit(**t0, 1).ok() &&
           (*c)->wait(**t0, 1, 20s).ok();
    }
    (void)!write(ready[1], &ok, 1);
    pause();
    _exit(0);
  }
  struct KillOnExit {
    pid_t pid;
    ~KillOnExit() {
      if (pid > 0) {
        kill(pid, SIGKILL);
        waitpid(pid, nullptr, 0);
      }
    }
  } guard{child};
  auto other = Client::connect(job.sockets()[1]);
  ASSERT_TRUE(other.ok());
  auto t0 = (*other)->register_tensor("tensor0", 64);
  auto t1 = (*other)->register_tensor("tensor1", 64);
  ASSERT_TRUE(t0.ok() && t1.ok());
  ASSERT_TRUE((*other)->submit(**t0, 0).ok());
  ASSERT_TRUE((*other)->submit(**t1, 0).ok());
  ASSERT_TRUE((*other)->wait(**t0, 0, 20s).ok()) << job.logs();
  ASSERT_TRUE((*other)->wait(**t1, 0, 20s).ok()) << job.logs();
  ASSERT_TRUE((*other)->submit(**t0, 1).ok());
  ASSERT_TRUE((*other)->submit(**t1, 1).ok());
  ASSERT_TRUE((*other)->wait(**t0, 1, 20s).ok()) << job.logs();
  char ok = 0;
  ASSERT_EQ(read(ready[0], &ok, 1), 1);
  ASSERT_EQ(ok, 1) << job.logs();
  const auto start = std::chrono::steady_clock::now();
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);
  guard.pid = -1;
  auto done = (*other)->wait(**t1, 1, 20s);
  const auto elapsed = std::chrono::steady_clock::now() - start;
  ASSERT_FALSE(done.ok());
  EXPECT_EQ(done.status().code(), Code::kAborted) << done.status().to_string();
  EXPECT_NE(done.status().message().find("rank 0"), std::string::npos) << done.status().to_string();
  EXPECT_NE(done.status().message().find("disconnected"), std::string::npos) << done.status().to_string();
  EXPECT_LT(elapsed, 3s) << job.logs();
  EXPECT_TRUE(job.daemon(0).running());
  EXPECT_TRUE(job.daemon(1).running());
  close(ready[0]);
  close(ready[1]);
}

TEST(FailureTest, KilledTrainerIsNoticedAndEveryoneElseGetsAnErrorWithinTheDeadline) {
  // Node 0 has two trainers: A (a child process, killed after step 0) and B (a thread).
  JobSpec spec{2, 1, "tcp", {"--step-timeout-ms", "3000"}, {{"--local-clients", "2"}}, {}};
  LocalJob job(spec);
  ASSERT_TRUE(job.wait_ready()) << job.logs();
  int ready[2];
  ASSERT_EQ(pipe(ready), 0);
  pid_t child = fork();
  if (child == 0) {
    auto c = Client::connect(job.sockets()[0]);
    char ok = 0;
    if (c.ok()) {
      auto t = (*c)->register_tensor("tensor0", 64);
      ok = t.ok() && (*c)->submit(**t, 0).ok() && (*c)->wait(**t, 0, 20s).ok();
    }
    (void)!write(ready[1], &ok, 1);
    pause();
    _exit(0);
  }
  auto b = Client::connect(job.sockets()[0]);
  auto other = Client::connect(job.sockets()[1]);
  ASSERT_TRUE(b.ok() && other.ok());
  auto tb = (*b)->register_tensor("tensor0", 64);
  auto to = (*other)->register_tensor("tensor0", 64);
  ASSERT_TRUE(tb.ok() && to.ok()) << tb.status().to_string() << to.status().to_string();
  ASSERT_TRUE((*b)->submit(**tb, 0).ok());
  ASSERT_TRUE((*other)->submit(**to, 0).ok());
  ASSERT_TRUE((*b)->wait(**tb, 0, 20s).ok()) << job.logs();
  ASSERT_TRUE((*other)->wait(**to, 0, 20s).ok()) << job.logs();
  char ok = 0;
  ASSERT_EQ(read(ready[0], &ok, 1), 1);
  ASSERT_EQ(ok, 1);
  kill(child, SIGKILL);
  waitpid(child, nullptr, 0);

  auto start = std::chrono::steady_clock::now();
  ASSERT_TRUE((*other)->submit(**to, 1).ok());
  Status b_submit = (*b)->submit(**tb, 1);
  if (b_submit.ok()) {
    auto done_b = (*b)->wait(**tb, 1, 20s);
    EXPECT_FALSE(done_b.ok()) << "node 0 cannot complete step 1 without trainer A";
  }
  auto done_other = (*other)->wait(**to, 1, 20s);
  EXPECT_FALSE(done_other.ok());
  EXPECT_NE(done_other.status().message().find("rank 0"), std::string::npos) << done_other.status().to_string();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 10s);
  EXPECT_TRUE(job.daemon(0).running());
  EXPECT_TRUE(job.daemon(1).running());
  close(ready[0]);
  close(ready[1]);
}

}  // namespace
}  // namespace sparsecar
