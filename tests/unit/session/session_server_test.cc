// SessionServer + client library against a fake pipeline: handshake, registration, the local
// sum of L clients, every error path, dead clients, a dead daemon, uid refusal and malformed
// protocol input. Every wait is bounded; nothing sleeps to wait for a condition.
#include "daemon/session/session_server.h"

#include <gtest/gtest.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>

#include <random>

#include "sparsecar/client.h"
#include "tests/unit/common/fake_clock.h"
#include "tests/unit/session/session_test_util.h"

namespace sparsecar {
namespace {

using namespace std::chrono_literals;
using testing::FakePipeline;
using testing::RawSession;
using testing::TempSocket;
using testing::wait_until;
// Real elapsed time of what the client library does (the server's own clock is a parameter).
using WallClock = std::chrono::steady_clock;

class SessionServerTest : public ::testing::Test {
 protected:
  void start(uint32_t local_clients, FakePipeline::Mode mode = FakePipeline::Mode::kHalf,
             SessionServerOptions options = {}, const sparsecar::Clock& clock = steady_clock()) {
    pipeline_ = std::make_unique<FakePipeline>(mode);
    options.socket_path = sock_.path();
    options.local_clients = local_clients;
    auto server = SessionServer::start(options, pipeline_.get(), clock);
    ASSERT_TRUE(server.ok()) << server.status().to_string();
    server_ = std::move(server).value();
    pipeline_->attach(server_.get());
  }
  std::unique_ptr<Client> connect() {
    auto c = Client::connect(sock_.path(), ConnectOptions{2000ms});
    EXPECT_TRUE(c.ok()) << c.status().to_string();
    return c.ok() ? std::move(c).value() : nullptr;
  }
  void TearDown() override {
    if (server_) server_->stop();
  }

  TempSocket sock_;
  testing::FakeClock fake_clock_;  // outlives the server: pass it to start() to drive time
  std::unique_ptr<FakePipeline> pipeline_;
  std::unique_ptr<SessionServer> server_;
};

// Waits for a child to exit within `timeout` (pidfd + poll); returns its exit code, or -1.
int wait_child(pid_t pid, std::chrono::milliseconds timeout) {
  int pidfd = static_cast<int>(::syscall(SYS_pidfd_open, pid, 0));
  if (pidfd >= 0) {
    pollfd p{pidfd, POLLIN, 0};
    int r = ::poll(&p, 1, static_cast<int>(timeout.count()));
    ::close(pidfd);
    if (r <= 0) {
      ::kill(pid, SIGKILL);
    }
  }
  int status = 0;
  if (::waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

// Kills and reaps a forked child on every way out of a test (an ASSERT included).
struct ChildGuard {
  pid_t pid = -1;
  ~ChildGuard() {
    if (pid > 0) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, nullptr, 0);
    }
  }
};

bool read_byte(int fd, std::chrono::milliseconds timeout) {
  pollfd p{fd, POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(timeout.count())) != 1) return false;
  char b;
  return ::read(fd, &b, 1) == 1;
}

TEST_F(SessionServerTest, OneClientRoundTrip) {
  start(1);
  auto client = connect();
  ASSERT_NE(client, nullptr);
  EXPECT_TRUE(wait_until([&] { return server_->connected_clients() == 1; }));
  auto w = client->register_tensor("fc.weight", 1000);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  EXPECT_EQ((*w)->size(), 1000u);
  EXPECT_EQ((*w)->id(), 0u);
  // The same name and size again is the same tensor.
  auto again = client->register_tensor("fc.weight", 1000);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *w);

  for (uint64_t step = 0; step < 3; ++step) {
    float* data = (*w)->data();
    for (size_t i = 0; i < 1000; ++i) data[i] = static_cast<float>(i) * 0.25f - 3.0f + float(step);
    ASSERT_TRUE(client->submit(**w, step, {.lr = 0.1f}).ok());
    auto info = client->wait(**w, step, 5000ms);
    ASSERT_TRUE(info.ok()) << info.status().to_string();
    EXPECT_EQ(info->step, step);
    EXPECT_EQ(info->nnz, 1000u);
    EXPECT_EQ(info->bytes_sent, 8000u);
    for (size_t i = 0; i < 1000; ++i) {
      ASSERT_EQ(data[i], (static_cast<float>(i) * 0.25f - 3.0f + float(step)) * 0.5f) << i;
    }
  }
  ASSERT_EQ(pipeline_->job_count(), 3u);
  EXPECT_FLOAT_EQ(pipeline_->jobs[0].lr, 0.1f);
  EXPECT_EQ(pipeline_->jobs[2].local_sum[4], 4 * 0.25f - 3.0f + 2.0f);

  ASSERT_TRUE(client->report_metric("loss", 0.75, 2).ok());
  ASSERT_TRUE(wait_until([&] { return pipeline_->metric_count() == 1; }));
  EXPECT_EQ(pipeline_->metrics[0].name, "loss");
  EXPECT_EQ(pipeline_->metrics[0].value, 0.75);
  EXPECT_EQ(pipeline_->metrics[0].step, 2u);
  EXPECT_EQ(server_->stats().steps_completed, 3u);
}

TEST_F(SessionServerTest, ATrainerThatReducesDenseStepsSaysSoAndIsAnsweredSo) {
  // The client sends kSubmitTrainerReduces to this tree's daemon (its mapping says it takes it;
  // ShmLayout.ATrainerReducesFlagGoesOnlyToADaemonThatSaysItTakesIt has the older daemon's).
  start(1);
  pipeline_->answer_trainer_reduces = true;
  auto client = connect();
  ASSERT_NE(client, nullptr);
  auto w = client->register_tensor("fc.weight", 8);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  for (uint64_t step = 0; step < 2; ++step) {
    const bool reduces = step == 0;
    ASSERT_TRUE(client->submit(**w, step, {.trainer_reduces = reduces}).ok());
    auto info = client->wait(**w, step, 5000ms);
    ASSERT_TRUE(info.ok()) << info.status().to_string();
    EXPECT_EQ(info->trainer_reduces, reduces) << step;
  }
  ASSERT_EQ(pipeline_->job_count(), 2u);
  EXPECT_TRUE(pipeline_->jobs[0].trainer_reduces);
  EXPECT_FALSE(pipeline_->jobs[1].trainer_reduces);
}

// A lease reaches a trainer that takes one (and only with a step it reduces); a daemon that sends
// one unasked is refused by the client (an older client refuses any such field, so the daemon
// must never send it unasked).
TEST_F(SessionServerTest, ALeaseGoesOnlyToATrainerThatTakesOne) {
  start(1);
  pipeline_->answer_trainer_reduces = true;
  pipeline_->answer_lease = 7;
  auto client = connect();
  ASSERT_NE(client, nullptr);
  auto w = client->register_tensor("fc.weight", 8);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  struct Case {
    SubmitOptions options;
    bool reduces;
    uint32_t lease;
  };
  const Case cases[] = {{{.trainer_reduces = true, .takes_lease = true}, true, 7},
                        {{.trainer_reduces = true}, true, 0},
                        {{.takes_lease = true}, false, 0}};  // a lease without reducing is not asked for
  uint64_t step = 0;
  for (const Case& c : cases) {
    ASSERT_TRUE(client->submit(**w, step, c.options).ok());
    auto info = client->wait(**w, step, 5000ms);
    ASSERT_TRUE(info.ok()) << info.status().to_string();
    EXPECT_EQ(info->trainer_reduces, c.reduces) << step;
    EXPECT_EQ(info->lease_steps, c.lease) << step;
    EXPECT_EQ(pipeline_->jobs[step].takes_lease, c.options.trainer_reduces && c.options.takes_lease) << step;
    ++step;
  }
  // 11 steps may be skipped: the client gets the next one at any later number.
  step += 10;
  ASSERT_TRUE(client->submit(**w, step, {.trainer_reduces = true, .takes_lease = true}).ok());
  ASSERT_TRUE(client->wait(**w, step, 5000ms).ok());
  pipeline_->lease_unasked = true;
  ASSERT_TRUE(client->submit(**w, ++step, {.trainer_reduces = true}).ok());
  auto info = client->wait(**w, step, 5000ms);
  ASSERT_FALSE(info.ok());
  EXPECT_EQ(info.status().code(), Code::kDataLoss) << info.status().to_string();
  EXPECT_NE(info.status().message().find("lease 7"), std::string::npos) << info.status().message();
}

TEST_F(SessionServerTest, TwoLocalClientsAreSummedInFloat64) {
  start(2);
  auto a = connect();
  auto b = connect();
  ASSERT_TRUE(a && b);
  constexpr size_t kW = 4097, kB = 3;
  auto wa = a->register_tensor("w", kW);
  auto ba = a->register_tensor("b", kB);
  auto wb = b->register_tensor("w", kW);
  auto bb = b->register_tensor("b", kB);
  ASSERT_TRUE(wa.ok() && ba.ok() && wb.ok() && bb.ok());
  EXPECT_EQ((*wa)->id(), (*wb)->id());
  EXPECT_EQ((*ba)->id(), (*bb)->id());
  EXPECT_NE((*wa)->data(), (*wb)->data());  // one slot per client

  std::mt19937 rng(42);
  std::normal_distribution<float> dist(0.0f, 3.0f);
  std::vector<float> in_a(kW), in_b(kW);
  for (size_t i = 0; i < kW; ++i) {
    in_a[i] = (*wa)->data()[i] = dist(rng);
    in_b[i] = (*wb)->data()[i] = dist(rng) * 1e-3f;
  }
  for (size_t i = 0; i < kB; ++i) (*ba)->data()[i] = (*bb)->data()[i] = float(i);

  const uint64_t step = 7;
  ASSERT_TRUE(a->submit(**wa, step).ok());
  ASSERT_TRUE(a->submit(**ba, step).ok());
  ASSERT_TRUE(b->submit(**wb, step).ok());
  ASSERT_TRUE(b->submit(**bb, step).ok());
  // Wait in the other order: the completion of w is stashed while waiting for b.
  for (Client* c : {a.get(), b.get()}) {
    Tensor* bt = c == a.get() ? *ba : *bb;
    Tensor* wt = c == a.get() ? *wa : *wb;
    auto rb = c->wait(*bt, step, 5000ms);
    ASSERT_TRUE(rb.ok()) << rb.status().to_string();
    auto rw = c->wait(*wt, step, 5000ms);
    ASSERT_TRUE(rw.ok()) << rw.status().to_string();
  }
  std::vector<float> expected_sum(kW);
  for (size_t i = 0; i < kW; ++i) {
    expected_sum[i] = static_cast<float>(static_cast<double>(in_a[i]) + static_cast<double>(in_b[i]));
  }
  std::lock_guard<std::mutex> lock(pipeline_->mu_);
  ASSERT_EQ(pipeline_->jobs.size(), 2u);
  const auto& job = pipeline_->jobs[0].tensor_id == (*wa)->id() ? pipeline_->jobs[0] : pipeline_->jobs[1];
  ASSERT_EQ(job.local_sum.size(), kW);
  for (size_t i = 0; i < kW; ++i) {
    ASSERT_EQ(job.local_sum[i], expected_sum[i]) << i;
    ASSERT_EQ((*wa)->data()[i], expected_sum[i] * 0.5f) << i;
    ASSERT_EQ((*wb)->data()[i], expected_sum[i] * 0.5f) << i;
  }
  EXPECT_EQ((*ba)->data()[2], 2.0f);  // (2 + 2) * 0.5
}

TEST_F(SessionServerTest, UnknownTensorIdIsRejected) {
  start(1);
  RawSession raw;
  ASSERT_TRUE(raw.connect(sock_.path()));
  ASSERT_EQ(raw.handshake(), 0);
  ASSERT_TRUE(raw.submit(99, 1));
  shm::Completion c;
  ASSERT_TRUE(raw.next_completion(&c));
  EXPECT_EQ(c.code, static_cast<int32_t>(Code::kNotFound));
  EXPECT_EQ(c.tensor_id, 99u);
  EXPECT_NE(std::string(c.message).find("unknown tensor id 99"), std::string::npos) << c.message;
  EXPECT_EQ(server_->stats().submissions_rejected, 1u);
}

TEST_F(SessionServerTest, StepOutOfOrderIsRejected) {
  start(1);
  auto client = connect();
  ASSERT_NE(client, nullptr);
  auto w = client->register_tensor("w", 16);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE(client->submit(**w, 5).ok());
  ASSERT_TRUE(client->wait(**w, 5, 5000ms).ok());
  for (uint64_t bad : {5u, 3u}) {
    ASSERT_TRUE(client->submit(**w, bad).ok());
    auto r = client->wait(**w, bad, 5000ms);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), Code::kOutOfRange);
    EXPECT_NE(r.status().message().find("not greater than its last step 5"), std::string::npos)
        << r.status().message();
  }
  ASSERT_TRUE(client->submit(**w, 6).ok());
  EXPECT_TRUE(client->wait(**w, 6, 5000ms).ok());
  EXPECT_EQ(server_->stats().submissions_rejected, 2u);
  // A second submit before waiting is refused locally.
  ASSERT_TRUE(client->submit(**w, 7).ok());
  EXPECT_EQ(client->submit(**w, 8).code(), Code::kFailedPrecondition);
}

TEST_F(SessionServerTest, LocalClientsDisagreeingOnTheStepFailBoth) {
  start(2);
  auto a = connect();
  auto b = connect();
  ASSERT_TRUE(a && b);
  auto wa = a->register_tensor("w", 8);
  auto wb = b->register_tensor("w", 8);
  ASSERT_TRUE(wa.ok() && wb.ok());
  ASSERT_TRUE(a->submit(**wa, 1).ok());
  ASSERT_TRUE(b->submit(**wb, 2).ok());
  auto ra = a->wait(**wa, 1, 5000ms);
  auto rb = b->wait(**wb, 2, 5000ms);
  ASSERT_FALSE(ra.ok());
  ASSERT_FALSE(rb.ok());
  EXPECT_EQ(ra.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(ra.status().message().find("disagree"), std::string::npos) << ra.status().message();
  EXPECT_EQ(rb.status().code(), Code::kFailedPrecondition);
  EXPECT_EQ(pipeline_->job_count(), 0u);
}

TEST_F(SessionServerTest, SizeMismatchBetweenClientsIsRejected) {
  start(2);
  auto a = connect();
  auto b = connect();
  ASSERT_TRUE(a && b);
  ASSERT_TRUE(a->register_tensor("w", 100).ok());
  auto r = b->register_tensor("w", 101);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
  EXPECT_NE(r.status().message().find("registered with 100 elements"), std::string::npos)
      << r.status().message();
  EXPECT_EQ(server_->stats().registrations_rejected, 1u);
  // The session stays usable.
  EXPECT_TRUE(b->register_tensor("w", 100).ok());
}

TEST_F(SessionServerTest, LimitsOnTensorsAndSizes) {
  SessionServerOptions options;
  options.max_tensor_elements = 1000;
  options.max_tensors = 2;
  start(1, FakePipeline::Mode::kHalf, options);
  auto client = connect();
  ASSERT_NE(client, nullptr);
  auto big = client->register_tensor("big", 1001);
  ASSERT_FALSE(big.ok());
  EXPECT_EQ(big.status().code(), Code::kResourceExhausted);
  ASSERT_TRUE(client->register_tensor("a", 1000).ok());
  ASSERT_TRUE(client->register_tensor("b", 1).ok());
  auto third = client->register_tensor("c", 1);
  ASSERT_FALSE(third.ok());
  EXPECT_EQ(third.status().code(), Code::kResourceExhausted);
  // The pipeline refusing a late registration reaches the client.
  server_->stop();
  start(1, FakePipeline::Mode::kHalf);
  {
    std::lock_guard<std::mutex> lock(pipeline_->mu_);
    pipeline_->refuse_registration = true;
  }
  auto c2 = connect();
  ASSERT_NE(c2, nullptr);
  auto late = c2->register_tensor("w", 4);
  ASSERT_FALSE(late.ok());
  EXPECT_EQ(late.status().code(), Code::kFailedPrecondition);
}

TEST_F(SessionServerTest, TooManyLocalClientsAreRefused) {
  start(1);
  auto a = connect();
  ASSERT_NE(a, nullptr);
  auto b = Client::connect(sock_.path(), ConnectOptions{2000ms});
  ASSERT_FALSE(b.ok());
  EXPECT_EQ(b.status().code(), Code::kResourceExhausted);
  EXPECT_EQ(server_->stats().clients_rejected, 1u);
}

TEST_F(SessionServerTest, PipelineErrorReachesTheClient) {
  start(1, FakePipeline::Mode::kFail);
  auto client = connect();
  ASSERT_NE(client, nullptr);
  auto w = client->register_tensor("w", 4);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE(client->submit(**w, 1).ok());
  auto r = client->wait(**w, 1, 5000ms);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kAborted);
  EXPECT_NE(r.status().message().find("injected pipeline failure for step 1"), std::string::npos);
  EXPECT_EQ(server_->stats().steps_failed, 1u);
}

TEST_F(SessionServerTest, WaitDeadlineWhenThePipelineNeverAnswers) {
  start(1, FakePipeline::Mode::kHold);
  auto client = connect();
  ASSERT_NE(client, nullptr);
  auto w = client->register_tensor("w", 4);
  ASSERT_TRUE(w.ok());
  (*w)->data()[0] = 2.0f;
  ASSERT_TRUE(client->submit(**w, 1).ok());
  auto t0 = WallClock::now();
  auto r = client->wait(**w, 1, 200ms);
  auto elapsed = WallClock::now() - t0;
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kDeadlineExceeded);
  EXPECT_GE(elapsed, 200ms);
  EXPECT_LT(elapsed, 2000ms);
  // The step is still in flight; once the pipeline answers, waiting again succeeds.
  ASSERT_TRUE(wait_until([&] { return pipeline_->job_count() == 1; }));
  pipeline_->release();
  auto again = client->wait(**w, 1, 5000ms);
  ASSERT_TRUE(again.ok()) << again.status().to_string();
  EXPECT_EQ((*w)->data()[0], 1.0f);
}

TEST_F(SessionServerTest, DaemonStopMakesWaitUnavailableAtOnce) {
  start(1, FakePipeline::Mode::kHold);
  auto client = connect();
  ASSERT_NE(client, nullptr);
  auto w = client->register_tensor("w", 4);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE(client->submit(**w, 1).ok());
  ASSERT_TRUE(wait_until([&] { return pipeline_->job_count() == 1; }));
  server_->stop();
  EXPECT_EQ(pipeline_->reset_count(), 1);
  auto t0 = WallClock::now();
  auto r = client->wait(**w, 1, 30000ms);
  EXPECT_LT(WallClock::now() - t0, 2000ms);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kUnavailable);
  EXPECT_NE(r.status().message().find("shutting down"), std::string::npos) << r.status().message();
  EXPECT_EQ(client->submit(**w, 2).code(), Code::kUnavailable);
  struct stat st{};
  EXPECT_NE(::lstat(sock_.path().c_str(), &st), 0) << "socket file left behind";
}

// await_activity(): what a binding blocks on outside its own lock, so that a trainer thread can
// submit() meanwhile (the Python binding's wait()). It wakes on the completion doorbell, consumes
// no completion, and says when the daemon's socket has something to read.
TEST_F(SessionServerTest, AwaitActivityWakesOnACompletionAndSaysWhenTheDaemonCloses) {
  start(1, FakePipeline::Mode::kHold);
  auto client = connect();
  ASSERT_NE(client, nullptr);
  auto w = client->register_tensor("w", 4);
  auto v = client->register_tensor("v", 4);
  ASSERT_TRUE(w.ok() && v.ok());
  (*w)->data()[0] = 2.0f;
  (*v)->data()[0] = 6.0f;
  ASSERT_TRUE(client->submit(**w, 1).ok());
  ASSERT_TRUE(wait_until([&] { return pipeline_->job_count() == 1; }));
  EXPECT_FALSE(client->await_activity(20ms)) << "nothing happened: a timeout, not the socket";

  std::atomic<bool> woke{false}, said_socket{true};
  std::thread waiter([&] {
    said_socket = client->await_activity(10000ms);
    woke = true;
  });
  // The other thread blocks in await_activity(); a submit from this one goes through meanwhile.
  ASSERT_TRUE(client->submit(**v, 1).ok());
  ASSERT_TRUE(wait_until([&] { return pipeline_->job_count() == 2; }));
  std::this_thread::sleep_for(20ms);
  EXPECT_FALSE(woke.load()) << "woke before any completion";
  pipeline_->release();
  EXPECT_TRUE(wait_until([&] { return woke.load(); }, 2000ms)) << "the doorbell did not wake it";
  waiter.join();
  EXPECT_FALSE(said_socket.load());
  // The first completion is still there for wait(), which need not block. The second may reach
  // the ring a moment later: the session thread can drain the pipeline's results between them.
  auto rw = client->wait(**w, 1, 0ms);
  ASSERT_TRUE(rw.ok()) << rw.status().to_string();
  auto rv = client->wait(**v, 1, 2000ms);
  ASSERT_TRUE(rv.ok()) << rv.status().to_string();
  EXPECT_EQ((*w)->data()[0], 1.0f);
  EXPECT_EQ((*v)->data()[0], 3.0f);

  ASSERT_TRUE(client->submit(**w, 2).ok());
  ASSERT_TRUE(wait_until([&] { return pipeline_->job_count() == 3; }));
  server_->stop();
  auto t0 = WallClock::now();
  EXPECT_TRUE(client->await_activity(10000ms)) << "the daemon closing is the socket's";
  EXPECT_LT(WallClock::now() - t0, 2000ms);
  auto r = client->wait(**w, 2, 1ms);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kUnavailable) << r.status().to_string();
}

TEST_F(SessionServerTest, LastClientLeavingResetsThePipeline) {
  start(1);
  {
    auto client = connect();
    ASSERT_NE(client, nullptr);
    ASSERT_TRUE(client->register_tensor("w", 4).ok());
  }
  ASSERT_TRUE(wait_until([&] { return pipeline_->reset_count() == 1; }));
  EXPECT_EQ(server_->connected_clients(), 0u);
  // The next job starts from tensor id 0 again.
  auto client = connect();
  ASSERT_NE(client, nullptr);
  auto v = client->register_tensor("v", 4);
  ASSERT_TRUE(v.ok());
  EXPECT_EQ((*v)->id(), 0u);
}

TEST_F(SessionServerTest, ConnectRetriesUntilTheDaemonListens) {
  Expected<std::unique_ptr<Client>> result = unavailable("not run");
  std::thread t([&] { result = Client::connect(sock_.path(), ConnectOptions{5000ms}); });
  start(1);
  t.join();
  ASSERT_TRUE(result.ok()) << result.status().to_string();
}

TEST_F(SessionServerTest, ConnectGivesUpAtItsTimeout) {
  auto t0 = WallClock::now();
  auto r = Client::connect(sock_.path(), ConnectOptions{150ms});
  EXPECT_LT(WallClock::now() - t0, 2000ms);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kUnavailable);
  EXPECT_NE(r.status().message().find(sock_.path()), std::string::npos);
}

TEST_F(SessionServerTest, KilledClientFailsThePendingStepAndTheServerGoesOn) {
  int ready[2];
  ASSERT_EQ(::pipe2(ready, O_CLOEXEC), 0);
  // Fork before any thread exists in this process; the child finds the socket by retrying.
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    auto c = Client::connect(sock_.path(), ConnectOptions{10000ms});
    if (!c.ok()) ::_exit(2);
    auto w = (*c)->register_tensor("w", 16);
    if (!w.ok()) ::_exit(3);
    char b = 1;
    if (::write(ready[1], &b, 1) != 1) ::_exit(4);
    for (;;) ::pause();
  }
  ChildGuard guard{child};
  ::close(ready[1]);
  start(2);
  auto a = connect();
  ASSERT_NE(a, nullptr);
  auto w = a->register_tensor("w", 16);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE(read_byte(ready[0], 10000ms)) << "child did not register";
  ::close(ready[0]);
  ASSERT_TRUE(a->submit(**w, 1).ok());
  ASSERT_TRUE(wait_until([&] { return server_->stats().submissions == 1; }));
  ASSERT_EQ(::kill(child, SIGKILL), 0);
  EXPECT_EQ(wait_child(child, 5000ms), -1);  // killed, not exited
  guard.pid = -1;

  auto r = a->wait(**w, 1, 5000ms);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kAborted);
  EXPECT_NE(r.status().message().find("pid " + std::to_string(child)), std::string::npos)
      << r.status().message();
  EXPECT_NE(r.status().message().find("disconnected"), std::string::npos);
  EXPECT_EQ(server_->stats().clients_disconnected, 1u);
  EXPECT_EQ(pipeline_->reset_count(), 0);  // a is still there

  // Until a replacement connects, new steps fail at once instead of waiting for the deadline.
  ASSERT_TRUE(a->submit(**w, 2).ok());
  auto t0 = WallClock::now();
  auto early = a->wait(**w, 2, 5000ms);
  EXPECT_LT(WallClock::now() - t0, 2000ms);
  ASSERT_FALSE(early.ok());
  EXPECT_EQ(early.status().code(), Code::kAborted);
  EXPECT_NE(early.status().message().find("cannot complete steps"), std::string::npos)
      << early.status().message();

  // A new trainer takes the free place and the job goes on.
  auto c = connect();
  ASSERT_NE(c, nullptr);
  auto wc = c->register_tensor("w", 16);
  ASSERT_TRUE(wc.ok());
  for (size_t i = 0; i < 16; ++i) {
    (*w)->data()[i] = 1.0f;
    (*wc)->data()[i] = 3.0f;
  }
  ASSERT_TRUE(a->submit(**w, 3).ok());
  ASSERT_TRUE(c->submit(**wc, 3).ok());
  auto ra = a->wait(**w, 3, 5000ms);
  auto rc = c->wait(**wc, 3, 5000ms);
  ASSERT_TRUE(ra.ok()) << ra.status().to_string();
  ASSERT_TRUE(rc.ok()) << rc.status().to_string();
  EXPECT_EQ((*w)->data()[15], 2.0f);
  EXPECT_EQ((*wc)->data()[0], 2.0f);
}

TEST_F(SessionServerTest, OtherUidIsRefused) {
  ASSERT_EQ(::geteuid(), 0u) << "this test needs root (it setuid()s a child to nobody)";
  int go[2];
  ASSERT_EQ(::pipe2(go, O_CLOEXEC), 0);
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(go[1]);
    if (!read_byte(go[0], 10000ms)) ::_exit(101);
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) ::_exit(100);
    auto c = Client::connect(sock_.path(), ConnectOptions{5000ms});
    ::_exit(c.ok() ? 0 : static_cast<int>(c.status().code()));
  }
  ChildGuard guard{child};
  ::close(go[0]);
  start(1);
  // Let nobody reach the socket, so the refusal comes from SO_PEERCRED, not file modes.
  ASSERT_EQ(::chmod(sock_.dir().c_str(), 0755), 0);
  ASSERT_EQ(::chmod(sock_.path().c_str(), 0666), 0);
  char b = 1;
  ASSERT_EQ(::write(go[1], &b, 1), 1);
  ::close(go[1]);
  EXPECT_EQ(wait_child(child, 10000ms), static_cast<int>(Code::kPermissionDenied));
  guard.pid = -1;
  EXPECT_EQ(server_->stats().clients_rejected, 1u);
  EXPECT_EQ(server_->stats().clients_accepted, 0u);
  EXPECT_NE(connect(), nullptr);  // root still gets in
}

TEST_F(SessionServerTest, MalformedFramesAreCountedAndCloseTheSession) {
  start(1);
  struct Case {
    const char* name;
    proto::MsgHeader header;
  };
  const Case cases[] = {
      {"bad magic", {0xdeadbeef, proto::kProtocolVersion, 1, sizeof(proto::Hello), 0}},
      {"bad length", {proto::kMsgMagic, proto::kProtocolVersion, 1, 1000, 0}},
      {"bad version", {proto::kMsgMagic, 77, 1, sizeof(proto::Hello), 0}},
      {"unknown type", {proto::kMsgMagic, proto::kProtocolVersion, 99, 16, 0}},
      {"Register before Hello",
       {proto::kMsgMagic, proto::kProtocolVersion, 3, sizeof(proto::Register), 0}},
  };
  uint64_t expected_errors = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    RawSession raw;
    ASSERT_TRUE(raw.connect(sock_.path()));
    std::vector<uint8_t> bytes(sizeof c.header + 1024, 0);
    std::memcpy(bytes.data(), &c.header, sizeof c.header);
    size_t len = sizeof c.header + std::min<size_t>(c.header.length, 1024);
    ASSERT_TRUE(raw.send_bytes(bytes.data(), len));
    EXPECT_TRUE(raw.closed_by_daemon());
    EXPECT_EQ(raw.last_error_type, uint16_t(proto::MsgType::kError));
    EXPECT_EQ(raw.last_error_status, int32_t(Code::kDataLoss));
    EXPECT_NE(raw.last_error_text.find("protocol error"), std::string::npos);
    EXPECT_EQ(server_->stats().protocol_errors, ++expected_errors);
  }
  // A peer that sends half a header and hangs up is just gone.
  {
    RawSession raw;
    ASSERT_TRUE(raw.connect(sock_.path()));
    ASSERT_TRUE(raw.send_bytes("SCS", 3));
  }
  // A well-framed Register with an unterminated name gets an error reply; the session stays.
  RawSession raw;
  ASSERT_TRUE(raw.connect(sock_.path()));
  ASSERT_EQ(raw.handshake(), 0);
  proto::Register reg{};
  reg.count = 4;
  std::memset(reg.name, 'x', sizeof reg.name);
  proto::RegisterAck ack = raw.register_raw(reg);
  EXPECT_EQ(ack.status, int32_t(Code::kInvalidArgument));
  EXPECT_NE(std::string(ack.message).find("NUL"), std::string::npos) << ack.message;
  reg.count = 0;
  proto::set_field(reg.name, sizeof reg.name, "w");
  EXPECT_EQ(raw.register_raw(reg).status, int32_t(Code::kInvalidArgument));
  reg.count = 4;
  reg.dtype = 7;
  EXPECT_EQ(raw.register_raw(reg).status, int32_t(Code::kInvalidArgument));
  reg.dtype = 0;
  ack = raw.register_raw(reg);
  ASSERT_EQ(ack.status, 0) << ack.message;
  EXPECT_EQ(server_->stats().registrations_rejected, 3u);
  // A metric with an unterminated name is a protocol error.
  proto::Metric m{};
  std::memset(m.name, 'y', sizeof m.name);
  ASSERT_TRUE(raw.send_msg(proto::MsgType::kMetric, &m));
  EXPECT_TRUE(raw.closed_by_daemon());
  EXPECT_EQ(server_->stats().protocol_errors, expected_errors + 1);
  // The daemon keeps serving.
  ASSERT_TRUE(wait_until([&] { return server_->connected_clients() == 0; }));
  auto client = connect();
  ASSERT_NE(client, nullptr);
  auto w = client->register_tensor("w", 4);
  ASSERT_TRUE(w.ok());
  ASSERT_TRUE(client->submit(**w, 1).ok());
  EXPECT_TRUE(client->wait(**w, 1, 5000ms).ok());
}

TEST_F(SessionServerTest, CorruptSubmissionRingDropsTheSession) {
  start(1);
  RawSession raw;
  ASSERT_TRUE(raw.connect(sock_.path()));
  ASSERT_EQ(raw.handshake(), 0);
  raw.ctl->submissions.head.store(raw.ctl->submissions.tail.load() + shm::kRingSlots + 5);
  uint64_t one = 1;
  ASSERT_EQ(::write(raw.sub_efd, &one, sizeof one), 8);
  EXPECT_TRUE(raw.closed_by_daemon());
  EXPECT_NE(raw.last_error_text.find("corrupt submission ring"), std::string::npos)
      << raw.last_error_text;
  EXPECT_EQ(server_->stats().protocol_errors, 1u);
  ASSERT_TRUE(wait_until([&] { return server_->connected_clients() == 0; }));
}

TEST_F(SessionServerTest, SecondDaemonOnTheSameSocketIsRefused) {
  start(1);
  FakePipeline other;
  SessionServerOptions options;
  options.socket_path = sock_.path();
  auto second = SessionServer::start(options, &other);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), Code::kAlreadyExists);
}

}  // namespace
}  // namespace sparsecar

namespace sparsecar {
namespace {

// ---- bounded resources ---------------------------------------------------------------------------

// Registering the allowed maximum (2^31 elements) used to get the daemon OOM-killed: every
// registration is charged against the node's budget before anything is allocated.
TEST_F(SessionServerTest, RegistrationsOverTheMemoryBudgetAreRefusedBeforeAllocating) {
  SessionServerOptions options;
  options.tensor_memory_budget_bytes = uint64_t{1} << 20;
  start(1, FakePipeline::Mode::kHalf, options);
  pipeline_->footprint_per_element = 16;
  auto client = connect();
  ASSERT_NE(client, nullptr);
  auto small = client->register_tensor("small", 10000);
  ASSERT_TRUE(small.ok()) << small.status().to_string();
  // slot 40000 -> 40960 (pages) + local_sum/result 80000 + pipeline 160000
  const uint64_t charged = 40960 + 80000 + 160000;
  EXPECT_EQ(server_->stats().tensor_bytes_in_use, charged);
  EXPECT_EQ(server_->stats().tensor_memory_budget, uint64_t{1} << 20);
  auto huge = client->register_tensor("huge", size_t{1} << 31);
  ASSERT_FALSE(huge.ok());
  EXPECT_EQ(huge.status().code(), Code::kResourceExhausted);
  const std::string msg = huge.status().message();
  EXPECT_NE(msg.find("tensor_memory_budget_bytes = 1048576"), std::string::npos) << msg;
  EXPECT_NE(msg.find(std::to_string(charged) + " are in use"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'huge' (2147483648 elements) needs 60129542144 bytes"), std::string::npos) << msg;
  EXPECT_EQ(server_->stats().registrations_over_budget, 1u);
  EXPECT_EQ(server_->stats().tensor_bytes_in_use, charged);  // nothing charged for the refusal
  // Just over what is left: refused too; within it: fine.
  auto medium = client->register_tensor("medium", 30000);  // 122880 + 240000 + 480000 > what is left
  ASSERT_FALSE(medium.ok());
  EXPECT_EQ(medium.status().code(), Code::kResourceExhausted);
  // The job reset (last client gone) releases everything.
  client.reset();
  ASSERT_TRUE(wait_until([&] { return pipeline_->reset_count() == 1; }));
  ASSERT_TRUE(wait_until([&] { return server_->stats().tensor_bytes_in_use == 0; }));
  auto again = connect();
  ASSERT_NE(again, nullptr);
  EXPECT_TRUE(again->register_tensor("medium", 30000).ok());
}

TEST_F(SessionServerTest, TheMaximumTensorIsRefusedByTheDefaultSizedBudget) {
  SessionServerOptions options;
  options.tensor_memory_budget_bytes = uint64_t{4} << 30;  // what a small node's default would be
  start(1, FakePipeline::Mode::kHalf, options);
  auto client = connect();
  ASSERT_NE(client, nullptr);
  auto max = client->register_tensor("embedding", size_t{1} << 31);
  ASSERT_FALSE(max.ok());
  EXPECT_EQ(max.status().code(), Code::kResourceExhausted);
  EXPECT_EQ(server_->stats().tensor_bytes_in_use, 0u);
  EXPECT_GT(default_tensor_memory_budget(), uint64_t{64} << 20);
}

// 65 silent connections used to fill every pending place until the 5 s handshake timeout.
TEST_F(SessionServerTest, SilentConnectionsDoNotLockATrainerOut) {
  SessionServerOptions options;
  options.handshake_timeout = 10000ms;  // long: the trainer must not get in by the timeout
  start(1, FakePipeline::Mode::kHalf, options);
  std::vector<int> silent;
  for (size_t i = 0; i < kMaxPendingConnections + 6; ++i) {
    int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    ASSERT_GE(fd, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, sock_.path().c_str(), sizeof addr.sun_path - 1);
    ASSERT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    silent.push_back(fd);
  }
  const uint64_t evicted = kMaxPendingConnections + 6 - options.max_handshakes_per_uid;
  ASSERT_TRUE(wait_until([&] { return server_->stats().handshakes_evicted >= evicted; }))
      << server_->stats().handshakes_evicted;
  auto t0 = WallClock::now();
  auto c = Client::connect(sock_.path(), ConnectOptions{3000ms});
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_LT(WallClock::now() - t0, 1000ms);
  EXPECT_TRUE(wait_until([&] { return server_->connected_clients() == 1; }));
  for (int fd : silent) ::close(fd);
}

TEST_F(SessionServerTest, ASilentConnectionIsClosedAfterTheShortHandshakeTimeout) {
  start(1);  // default handshake_timeout
  EXPECT_LE(SessionServerOptions{}.handshake_timeout, 2000ms);
  RawSession raw;
  ASSERT_TRUE(raw.connect(sock_.path()));
  auto t0 = WallClock::now();
  pollfd p{raw.sock, POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 5000), 1);
  char b;
  EXPECT_LE(::read(raw.sock, &b, 1), 0);  // closed, nothing sent
  EXPECT_LT(WallClock::now() - t0, 3000ms);
}

TEST_F(SessionServerTest, TheHandshakeTimeoutRunsOnTheGivenClock) {
  SessionServerOptions options;
  options.handshake_timeout = 1ms;  // on a real clock the silent connection would go at once
  start(1, FakePipeline::Mode::kHalf, options, fake_clock_);
  RawSession silent;
  ASSERT_TRUE(silent.connect(sock_.path()));
  // A trainer connecting after it and finishing a step means the server ran poll rounds (and its
  // handshake sweep) after it accepted the silent connection; the fake clock did not move.
  auto trainer = connect();
  ASSERT_NE(trainer, nullptr);
  auto w = trainer->register_tensor("w", 4);
  ASSERT_TRUE(w.ok()) << w.status().to_string();
  ASSERT_TRUE(trainer->submit(**w, 0, {}).ok());
  ASSERT_TRUE(trainer->wait(**w, 0, 5000ms).ok());
  pollfd p{silent.sock, POLLIN, 0};
  EXPECT_EQ(::poll(&p, 1, 0), 0) << "closed although the clock did not move";
  EXPECT_EQ(server_->stats().protocol_errors, 0u);

  fake_clock_.advance(2ms);
  ASSERT_EQ(::poll(&p, 1, 5000), 1);
  char b;
  EXPECT_LE(::read(silent.sock, &b, 1), 0);  // closed, nothing sent
  EXPECT_TRUE(wait_until([&] { return server_->stats().protocol_errors == 1; }));
  EXPECT_EQ(server_->connected_clients(), 1u);  // a ready trainer has no handshake deadline
}

// ---- a trainer dying mid-step --------------------------------------------------------------------

TEST_F(SessionServerTest, ATrainerDyingMidCollectionFailsThatStepJobWide) {
  start(2);
  auto a = connect();
  auto b = connect();
  ASSERT_TRUE(a && b);
  auto wa = a->register_tensor("w", 8);
  auto wb = b->register_tensor("w", 8);
  ASSERT_TRUE(wa.ok() && wb.ok());
  ASSERT_TRUE(a->submit(**wa, 1).ok());
  ASSERT_TRUE(wait_until([&] { return server_->stats().submissions == 1; }));
  b.reset();  // dies before submitting step 1
  auto r = a->wait(**wa, 1, 5000ms);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kAborted);
  ASSERT_TRUE(wait_until([&] { return pipeline_->failed_count() == 1; }));
  {
    std::lock_guard<std::mutex> lock(pipeline_->mu_);
    EXPECT_EQ(pipeline_->failed[0].tensor_id, 0u);
    EXPECT_EQ(pipeline_->failed[0].step, 1u);
    EXPECT_NE(pipeline_->failed[0].reason.find("disconnected"), std::string::npos) << pipeline_->failed[0].reason;
  }
  // The survivor's next step cannot complete here either: failed job-wide once, not twice.
  ASSERT_TRUE(a->submit(**wa, 2).ok());
  EXPECT_FALSE(a->wait(**wa, 2, 5000ms).ok());
  ASSERT_TRUE(wait_until([&] { return pipeline_->failed_count() == 2; }));
  EXPECT_EQ(server_->stats().steps_failed_job_wide, 2u);
  std::lock_guard<std::mutex> lock(pipeline_->mu_);
  EXPECT_EQ(pipeline_->failed[1].step, 2u);
}

// The only trainer dies with tensor a's step in the pipeline and b not yet submitted: b's step is
// failed job-wide, and a's buffers (lent to the pipeline) are freed once the pipeline answers.
TEST_F(SessionServerTest, TheLastTrainerDyingMidStepFailsTheRestAndFreesTheOrphanWhenAnswered) {
  start(1, FakePipeline::Mode::kHold);
  {
    std::lock_guard<std::mutex> lock(pipeline_->mu_);
    pipeline_->keep_held_on_reset = true;  // like a real pipeline whose step is still running
  }
  auto client = connect();
  ASSERT_NE(client, nullptr);
  auto a = client->register_tensor("a", 1 << 20);
  auto b = client->register_tensor("b", 16);
  ASSERT_TRUE(a.ok() && b.ok());
  const uint64_t in_use = server_->stats().tensor_bytes_in_use;
  ASSERT_TRUE(client->submit(**a, 3).ok());
  ASSERT_TRUE(wait_until([&] { return pipeline_->job_count() == 1; }));
  client.reset();
  ASSERT_TRUE(wait_until([&] { return pipeline_->reset_count() == 1; }));
  ASSERT_TRUE(wait_until([&] { return server_->stats().orphaned_tensors == 1; }));
  {
    std::lock_guard<std::mutex> lock(pipeline_->mu_);
    ASSERT_EQ(pipeline_->failed.size(), 1u);
    EXPECT_EQ(pipeline_->failed[0].tensor_id, 1u);
    EXPECT_EQ(pipeline_->failed[0].step, 3u);
  }
  // a's local_sum and result stay allocated and charged while the pipeline holds them.
  EXPECT_EQ(server_->stats().tensor_bytes_in_use, 2 * (uint64_t{1} << 20) * sizeof(float));
  EXPECT_LT(server_->stats().tensor_bytes_in_use, in_use);
  pipeline_->release();  // the pipeline answers (late, from the reset job)
  ASSERT_TRUE(wait_until([&] { return server_->stats().orphaned_tensors == 0; }));
  EXPECT_EQ(server_->stats().tensor_bytes_in_use, 0u);
  EXPECT_EQ(server_->stats().stale_results, 0u);
}

// Leaving between steps is also how every job ends: nothing is failed job-wide then.
TEST_F(SessionServerTest, ATrainerLeavingBetweenStepsFailsNothingJobWide) {
  start(1);
  auto client = connect();
  ASSERT_NE(client, nullptr);
  auto a = client->register_tensor("a", 4);
  auto b = client->register_tensor("b", 4);
  ASSERT_TRUE(a.ok() && b.ok());
  for (auto* t : {*a, *b}) {
    ASSERT_TRUE(client->submit(*t, 7).ok());
    ASSERT_TRUE(client->wait(*t, 7, 5000ms).ok());
  }
  client.reset();
  ASSERT_TRUE(wait_until([&] { return pipeline_->reset_count() == 1; }));
  EXPECT_EQ(pipeline_->failed_count(), 0u);
  EXPECT_EQ(server_->stats().steps_failed_job_wide, 0u);
}

}  // namespace
}  // namespace sparsecar
