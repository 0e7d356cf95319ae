// UcxTransport end to end inside one process (one thread per rank for the rendezvous), over TCP on
// loopback and over shared memory; plus a peer in a child process that gets SIGKILLed.
// Every wait is bounded; nothing sleeps to synchronise.
#include "daemon/transport/ucx_transport.h"

#include <gtest/gtest.h>
#include <net/if.h>
#include <poll.h>
#include <sched.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <future>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

namespace sparsecar {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

constexpr auto kWait = 60s;  // bound on any single wait
constexpr char kTestSecret[] = "ucx transport test secret, 32+ bytes";

struct TransportParam {
  const char* name;
  const char* tls;
  const char* net_devices;
};

// Test message header: {u32 magic, u32 sender, u32 seq, u32 pad, u64 payload size}.
constexpr uint32_t kTestMagic = 0x54534554;  // "TEST"
struct TestHeader {
  uint32_t magic;
  uint32_t sender;
  uint32_t seq;
  uint32_t pad;
  uint64_t size;
};

// Payload word i of message (sender, seq): cheap to generate and to check.
uint64_t pattern(uint32_t sender, uint32_t seq, size_t i) {
  return (uint64_t{sender} << 56) ^ (uint64_t{seq} << 32) ^ (i * 0x9E3779B97F4A7C15ull);
}

std::vector<std::byte> make_payload(uint32_t sender, uint32_t seq, size_t size) {
  std::vector<std::byte> out(size);
  size_t words = size / 8;
  for (size_t i = 0; i < words; ++i) {
    uint64_t w = pattern(sender, seq, i);
    std::memcpy(out.data() + i * 8, &w, 8);
  }
  for (size_t i = words * 8; i < size; ++i) out[i] = static_cast<std::byte>(i);
  return out;
}

bool payload_ok(uint32_t sender, uint32_t seq, std::span<const std::byte> p) {
  size_t words = p.size() / 8;
  for (size_t i = 0; i < words; ++i) {
    uint64_t w;
    std::memcpy(&w, p.data() + i * 8, 8);
    if (w != pattern(sender, seq, i)) return false;
  }
  for (size_t i = words * 8; i < p.size(); ++i) {
    if (p[i] != static_cast<std::byte>(i)) return false;
  }
  return true;
}

// Records what arrives; verifies payload content on the progress thread (no copy kept).
class RecordingSink : public MessageSink {
 public:
  struct Received {
    uint32_t peer;
    uint32_t seq;
    size_t size;
    bool content_ok;
  };

  void on_message(uint32_t peer, std::span<const std::byte> header, std::span<const std::byte> payload) override {
    Received r{peer, ~0u, payload.size(), false};
    if (header.size() == sizeof(TestHeader)) {
      TestHeader h;
      std::memcpy(&h, header.data(), sizeof h);
      r.seq = h.seq;
      r.content_ok = h.magic == kTestMagic && h.sender == peer && h.size == payload.size() &&
                     payload_ok(h.sender, h.seq, payload);
    } else {
      r.content_ok = header.size() == 4 && std::memcmp(header.data(), "pong", 4) == 0;
    }
    std::lock_guard<std::mutex> lock(mu_);
    received_.push_back(r);
    cv_.notify_all();
  }

  void on_peer_failed(uint32_t peer, const Status& why) override {
    std::lock_guard<std::mutex> lock(mu_);
    failures_[peer]++;
    last_failure_ = why;
    cv_.notify_all();
  }

  void on_peer_rejoined(uint32_t peer) override {
    std::lock_guard<std::mutex> lock(mu_);
    rejoined_[peer]++;
    cv_.notify_all();
  }
  bool wait_rejoined(uint32_t peer, std::chrono::milliseconds bound = kWait) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, bound, [&] { return rejoined_.count(peer) != 0; });
  }

  void on_rejected(uint32_t peer, const Status& why) override {
    std::lock_guard<std::mutex> lock(mu_);
    rejected_.push_back({peer, why});
    cv_.notify_all();
  }
  bool wait_rejected(size_t count, std::chrono::milliseconds bound = kWait) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, bound, [&] { return rejected_.size() >= count; });
  }
  std::vector<std::pair<uint32_t, Status>> rejected() {
    std::lock_guard<std::mutex> lock(mu_);
    return rejected_;
  }

  bool wait_messages(size_t count, std::chrono::milliseconds bound = kWait) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, bound, [&] { return received_.size() >= count; });
  }
  bool wait_failure(uint32_t peer, std::chrono::milliseconds bound = kWait) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, bound, [&] { return failures_.count(peer) != 0; });
  }
  std::vector<Received> received() {
    std::lock_guard<std::mutex> lock(mu_);
    return received_;
  }
  std::map<uint32_t, int> failures() {
    std::lock_guard<std::mutex> lock(mu_);
    return failures_;
  }
  Status last_failure() {
    std::lock_guard<std::mutex> lock(mu_);
    return last_failure_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<Received> received_;
  std::map<uint32_t, int> failures_;
  std::map<uint32_t, int> rejoined_;
  Status last_failure_;
  std::vector<std::pair<uint32_t, Status>> rejected_;
};

// Counts send completions.
class Completions {
 public:
  SendCallback callback() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++expected_;
    }
    return [this](const Status& s) {
      std::lock_guard<std::mutex> lock(mu_);
      statuses_.push_back(s);
      cv_.notify_all();
    };
  }
  bool wait_all(std::chrono::milliseconds bound = kWait) {
    std::unique_lock<std::mutex> lock(mu_);
    return cv_.wait_for(lock, bound, [&] { return statuses_.size() >= expected_; });
  }
  std::vector<Status> statuses() {
    std::lock_guard<std::mutex> lock(mu_);
    return statuses_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  size_t expected_ = 0;
  std::vector<Status> statuses_;
};

UcxTransportOptions base_options(const TransportParam& p, uint32_t rank, uint32_t world, uint64_t job) {
  UcxTransportOptions o;
  o.rank = rank;
  o.world_size = world;
  o.job_id = job;
  o.tls = p.tls;
  o.net_devices = p.net_devices;
  o.rendezvous_timeout = 30s;
  o.label = "test-rank-" + std::to_string(rank);
  o.key = auth::job_key_from_secret(kTestSecret);
  return o;
}

struct Job {
  std::vector<std::unique_ptr<RecordingSink>> sinks;
  std::vector<std::unique_ptr<UcxTransport>> transports;
  ~Job() {
    for (auto& t : transports) {
      if (t) t->stop();
    }
  }
};

// Starts `world` transports in threads; rank 0 listens on port 0. `external` ranks (at the top of
// the range) are not started here; `on_port` learns the coordinator port for them.
void start_job(Job& job, const TransportParam& p, uint32_t world, uint64_t job_id, uint32_t external = 0,
               std::function<void(uint16_t)> on_port = {},
               std::function<void(UcxTransportOptions&)> tweak = {}) {
  const uint32_t local = world - external;
  job.sinks.clear();
  job.transports.clear();
  for (uint32_t r = 0; r < local; ++r) job.sinks.push_back(std::make_unique<RecordingSink>());
  job.transports.resize(local);

  auto port = std::make_shared<std::promise<uint16_t>>();
  std::shared_future<uint16_t> port_future = port->get_future().share();
  std::vector<std::future<Status>> results;
  for (uint32_t r = 0; r < local; ++r) {
    results.push_back(std::async(std::launch::async, [&, r]() -> Status {
      UcxTransportOptions o = base_options(p, r, world, job_id);
      if (tweak) tweak(o);
      if (r == 0) {
        o.coordinator = "127.0.0.1:0";
        o.on_listening = [port, on_port](uint16_t got) {
          if (on_port) on_port(got);
          port->set_value(got);
        };
      } else {
        if (port_future.wait_for(kWait) != std::future_status::ready) return deadline_exceeded("no port");
        o.coordinator = "127.0.0.1:" + std::to_string(port_future.get());
      }
      auto t = UcxTransport::start(o, job.sinks[r].get());
      if (!t.ok()) return t.status();
      job.transports[r] = std::move(*t);
      return Status::Ok();
    }));
  }
  for (uint32_t r = 0; r < local; ++r) {
    ASSERT_EQ(results[r].wait_for(kWait), std::future_status::ready) << "rank " << r << " did not start";
    Status s = results[r].get();
    ASSERT_TRUE(s.ok()) << "rank " << r << ": " << s.to_string();
  }
}

class UcxTransportTest : public ::testing::TestWithParam<TransportParam> {};

// Every rank sends every size to every other rank; every message arrives intact exactly once.
void exchange_all(const TransportParam& p, uint32_t world, const std::vector<size_t>& sizes) {
  Job job;
  start_job(job, p, world, 42);
  if (::testing::Test::HasFatalFailure()) return;

  // Payloads stay alive (and unchanged) until every send has completed.
  std::vector<std::vector<std::byte>> payloads;
  std::vector<TestHeader> headers;
  payloads.reserve(world * world * sizes.size());
  headers.reserve(world * world * sizes.size());
  Completions done;
  uint32_t seq = 0;
  for (uint32_t from = 0; from < world; ++from) {
    for (uint32_t to = 0; to < world; ++to) {
      if (to == from) continue;
      for (size_t size : sizes) {
        headers.push_back(TestHeader{kTestMagic, from, seq, 0, size});
        payloads.push_back(make_payload(from, seq, size));
        ++seq;
        Status s = job.transports[from]->send(
            to, std::as_bytes(std::span<const TestHeader>(&headers.back(), 1)), payloads.back(), done.callback());
        ASSERT_TRUE(s.ok()) << s.to_string();
      }
    }
  }
  ASSERT_TRUE(done.wait_all()) << "sends did not complete";
  for (const Status& s : done.statuses()) EXPECT_TRUE(s.ok()) << s.to_string();

  const size_t per_rank = (world - 1) * sizes.size();
  for (uint32_t r = 0; r < world; ++r) {
    ASSERT_TRUE(job.sinks[r]->wait_messages(per_rank)) << "rank " << r << " got only "
                                                        << job.sinks[r]->received().size();
    auto got = job.sinks[r]->received();
    EXPECT_EQ(got.size(), per_rank);
    std::set<uint32_t> seqs;
    for (const auto& m : got) {
      EXPECT_TRUE(m.content_ok) << "rank " << r << " from " << m.peer << " seq " << m.seq << " size " << m.size;
      EXPECT_TRUE(seqs.insert(m.seq).second) << "duplicate seq " << m.seq;
    }
    EXPECT_TRUE(job.sinks[r]->failures().empty());
    // Large (rendezvous-protocol) and small messages interleave: none may look like a replay.
    EXPECT_EQ(job.transports[r]->stats().messages_rejected, 0u);
    std::printf("[ info     ] %s rank %u: %llu of %zu messages arrived out of sequence order\n", p.name, r,
                static_cast<unsigned long long>(job.transports[r]->stats().messages_out_of_order), per_rank);
    EXPECT_TRUE(job.sinks[r]->rejected().empty());
  }
}

TEST_P(UcxTransportTest, TwoRanksExchangeEmptySmallAndLargeMessages) {
  exchange_all(GetParam(), 2, {0, 1, 100, 4096, 300 * 1024, 64u << 20});
}

TEST_P(UcxTransportTest, FourRanksExchangeEmptySmallAndLargeMessages) {
  exchange_all(GetParam(), 4, {0, 72, 16u << 20});
}

// The step controller's link samples: with timed sends one message in `every` to a peer,
// however small, goes rendezvous and its receiver times it (one busy period per message sent
// alone, its bytes the header and payload); the others, and every small message without timed
// sends, go eagerly and give no sample.
// Rank 0 sends rank 1 one message at a time, each sent and received before the next; the
// buffers live as long as the sender.
class OneByOne {
 public:
  OneByOne(Job& job, size_t messages) : job_(job) {
    headers_.reserve(messages);
    payloads_.reserve(messages);
  }
  // `bulk`: through send_bulk().
  void send(size_t size, bool bulk = false) {
    ASSERT_LT(headers_.size(), headers_.capacity()) << "the buffers would move";
    headers_.push_back(TestHeader{kTestMagic, 0, seq_, 0, size});
    payloads_.push_back(make_payload(0, seq_, size));
    ++seq_;
    Completions done;
    auto header = std::as_bytes(std::span<const TestHeader>(&headers_.back(), 1));
    Transport* t = job_.transports[0].get();
    ASSERT_TRUE((bulk ? t->send_bulk(1, header, payloads_.back(), done.callback())
                      : t->send(1, header, payloads_.back(), done.callback()))
                    .ok());
    ASSERT_TRUE(done.wait_all());
    ASSERT_TRUE(job_.sinks[1]->wait_messages(seq_)) << "message " << seq_ << " did not arrive";
  }

 private:
  Job& job_;
  std::vector<TestHeader> headers_;
  std::vector<std::vector<std::byte>> payloads_;
  uint32_t seq_ = 0;
};

TEST_P(UcxTransportTest, TimedSendsLetTheReceiverTimeMessagesOfAnySize) {
  Job job;
  start_job(job, GetParam(), 2, 42);
  if (HasFatalFailure()) return;
  // Two cadences (the step_timed_send_every knob), each over 2 * every + 1 sends, then off.
  constexpr uint32_t kEvery[] = {4, 3};
  OneByOne sender(job, 2 + (2 * kEvery[0] + 1) + (2 * kEvery[1] + 1) + 2);
  auto send_one = [&](size_t size) { sender.send(size); };
  send_one(100);
  send_one(4096);
  EXPECT_TRUE(job.transports[1]->drain_receive_samples().empty()) << "small eager messages are not timed";
  for (const uint32_t every : kEvery) {
    job.transports[0]->set_timed_sends(every);
    // One small send in `every` is timed, the first one after the change included: sizes
    // 100 + i, so that each sample names the message it timed.
    for (uint32_t i = 0; i < 2 * every + 1; ++i) send_one(100 + i);
    const std::vector<ReceiveSample> samples = job.transports[1]->drain_receive_samples();
    ASSERT_EQ(samples.size(), 3u) << "one in " << every;
    for (size_t i = 0; i < 3; ++i) {
      EXPECT_EQ(samples[i].peer, 0u);
      EXPECT_EQ(samples[i].bytes, 100 + i * every + sizeof(TestHeader)) << "one in " << every << ", sample " << i;
      EXPECT_GT(samples[i].seconds, 0.0);
      EXPECT_LT(samples[i].seconds, 10.0);
    }
  }
  job.transports[0]->set_timed_sends(0);
  send_one(100);
  send_one(4096);
  EXPECT_TRUE(job.transports[1]->drain_receive_samples().empty()) << "timed sends off";
  for (const auto& m : job.sinks[1]->received()) EXPECT_TRUE(m.content_ok) << "seq " << m.seq;
}

// The step controller's link probe (daemon/pipeline/link_probe.h) is at least 64 KiB: its
// receiver times it on its size alone, timed sends on or off (the daemons turn them on with the
// step controller, one small send in step_timed_send_every).
TEST_P(UcxTransportTest, AMessageOfAProbesSizeIsTimedWithoutTimedSends) {
  Job job;
  start_job(job, GetParam(), 2, 42);
  if (HasFatalFailure()) return;
  OneByOne sender(job, 2);
  sender.send(64u << 10);  // the least probe
  sender.send(128u << 10);
  const std::vector<ReceiveSample> samples = job.transports[1]->drain_receive_samples();
  ASSERT_EQ(samples.size(), 2u);
  for (uint32_t i = 0; i < 2; ++i) {
    EXPECT_EQ(samples[i].peer, 0u);
    EXPECT_EQ(samples[i].bytes, (64u << 10) * (i + 1) + sizeof(TestHeader)) << "sample " << i;
    EXPECT_GT(samples[i].seconds, 0.0);
    EXPECT_LT(samples[i].seconds, 10.0);
  }
}

// Bulk sends (the dense ring's segments) that are not the timed one in `every` go eagerly
// while timed sends are on: the receiver times 1 in 4 of them, and every plain send of the same
// size (a probe's, a large sparse message's) still goes rendezvous and is timed. With timed
// sends off the transport chooses as for any send: rendezvous, timed.
TEST_P(UcxTransportTest, UntimedBulkSendsGoEagerlyWhileTimedSendsAreOn) {
  Job job;
  start_job(job, GetParam(), 2, 42);
  if (HasFatalFailure()) return;
  constexpr size_t kSize = 128u << 10;
  OneByOne sender(job, 8 + 4 + 4);
  job.transports[0]->set_timed_sends(4);
  for (int i = 0; i < 8; ++i) sender.send(kSize, /*bulk=*/true);
  EXPECT_EQ(job.transports[1]->drain_receive_samples().size(), 2u) << "the timed 1 in 4 of 8 bulk sends";
  for (int i = 0; i < 4; ++i) sender.send(kSize);
  EXPECT_EQ(job.transports[1]->drain_receive_samples().size(), 4u) << "plain sends of that size, all timed";
  job.transports[0]->set_timed_sends(0);
  for (int i = 0; i < 4; ++i) sender.send(kSize, /*bulk=*/true);
  EXPECT_EQ(job.transports[1]->drain_receive_samples().size(), 4u) << "timed sends off: rendezvous, timed";
  for (const auto& m : job.sinks[1]->received()) EXPECT_TRUE(m.content_ok) << "seq " << m.seq;
}

TEST_P(UcxTransportTest, ConcurrentSendersFromManyThreads) {
  Job job;
  start_job(job, GetParam(), 2, 43);
  if (HasFatalFailure()) return;
  constexpr int kThreads = 4;
  constexpr int kPerThread = 250;
  std::vector<TestHeader> headers(kThreads * kPerThread);
  std::vector<std::vector<std::byte>> payloads(kThreads * kPerThread);
  Completions done;
  std::vector<SendCallback> callbacks;
  for (int i = 0; i < kThreads * kPerThread; ++i) {
    const uint32_t seq = static_cast<uint32_t>(i);
    headers[i] = TestHeader{kTestMagic, 0, seq, 0, 256};
    payloads[i] = make_payload(0, seq, 256);
    callbacks.push_back(done.callback());
  }
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int k = 0; k < kPerThread; ++k) {
        int i = t * kPerThread + k;
        Status s = job.transports[0]->send(1, std::as_bytes(std::span<const TestHeader>(&headers[i], 1)), payloads[i],
                                           std::move(callbacks[i]));
        EXPECT_TRUE(s.ok()) << s.to_string();
      }
    });
  }
  for (auto& th : threads) th.join();
  ASSERT_TRUE(done.wait_all());
  for (const Status& s : done.statuses()) EXPECT_TRUE(s.ok()) << s.to_string();
  ASSERT_TRUE(job.sinks[1]->wait_messages(kThreads * kPerThread));
  for (const auto& m : job.sinks[1]->received()) EXPECT_TRUE(m.content_ok);
}

TEST_P(UcxTransportTest, InvalidSendsAreRejectedAndStopIsIdempotent) {
  Job job;
  start_job(job, GetParam(), 2, 44);
  if (HasFatalFailure()) return;
  UcxTransport& t = *job.transports[0];
  EXPECT_EQ(t.rank(), 0u);
  EXPECT_EQ(t.world_size(), 2u);
  EXPECT_NE(t.peer_name(1).find("rank 1 (test-rank-1"), std::string::npos) << t.peer_name(1);
  auto noop = [](const Status&) {};
  EXPECT_EQ(t.send(0, {}, {}, noop).code(), Code::kInvalidArgument);  // self
  EXPECT_EQ(t.send(2, {}, {}, noop).code(), Code::kInvalidArgument);  // outside the job
  std::vector<std::byte> huge_header(1024);
  EXPECT_EQ(t.send(1, huge_header, {}, noop).code(), Code::kInvalidArgument);
  EXPECT_EQ(t.send(1, {}, {}, nullptr).code(), Code::kInvalidArgument);

  const auto begin = Clock::now();
  t.stop();
  t.stop();
  EXPECT_LT(Clock::now() - begin, 10s);
  EXPECT_EQ(t.send(1, {}, {}, noop).code(), Code::kUnavailable);
}

TEST_P(UcxTransportTest, WrongJobIdIsRefusedAtStart) {
  RecordingSink sink0, sink1;
  auto port = std::make_shared<std::promise<uint16_t>>();
  auto port_future = port->get_future();
  auto leader = std::async(std::launch::async, [&] {
    UcxTransportOptions o = base_options(GetParam(), 0, 2, 1);
    o.coordinator = "127.0.0.1:0";
    o.rendezvous_timeout = 2s;  // nobody valid comes: rank 0 gives up on its own
    o.on_listening = [port](uint16_t p) { port->set_value(p); };
    return UcxTransport::start(o, &sink0).status();
  });
  ASSERT_EQ(port_future.wait_for(kWait), std::future_status::ready);
  UcxTransportOptions o = base_options(GetParam(), 1, 2, 2);
  o.coordinator = "127.0.0.1:" + std::to_string(port_future.get());
  auto t = UcxTransport::start(o, &sink1);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(t.status().message().find("job id differs from rank 0's"), std::string::npos) << t.status().message();
  ASSERT_EQ(leader.wait_for(kWait), std::future_status::ready);
  Status s = leader.get();
  EXPECT_EQ(s.code(), Code::kDeadlineExceeded) << s.to_string();
}

// A child process runs rank 2 and gets SIGKILLed: ranks 0 and 1 learn about it within a bound,
// sends to it fail instead of hanging (including one in flight), and 0 <-> 1 keeps working.
TEST_P(UcxTransportTest, KilledPeerIsReportedAndSendsToItFail) {
  const TransportParam& p = GetParam();
  int to_child[2], from_child[2];
  ASSERT_EQ(::pipe(to_child), 0);
  ASSERT_EQ(::pipe(from_child), 0);
  // Everything the child needs is prepared before fork(): between fork and exec it only calls
  // async-signal-safe functions. transport_peer reads the coordinator port from stdin.
  // (If this test must ever run inside a PID namespace, give it its own /proc: UCX's posix
  // shared memory attaches through /proc/<pid>/fd of the peer.)
  const std::string tls = *p.tls ? p.tls : "-";
  const std::string dev = *p.net_devices ? p.net_devices : "-";
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::dup2(to_child[0], 0);
    ::dup2(from_child[1], 3);  // transport_peer reports "ready" on fd 3
    ::close(to_child[1]);
    ::close(from_child[0]);
    ::execl(SPARSECAR_TRANSPORT_PEER, SPARSECAR_TRANSPORT_PEER, "2", "3", "77", "127.0.0.1", tls.c_str(), dev.c_str(),
            kTestSecret, static_cast<char*>(nullptr));
    ::_exit(127);
  }
  ::close(to_child[0]);
  ::close(from_child[1]);
  struct Reaper {
    pid_t pid;
    int fds[2];
    ~Reaper() {
      // Never kill(-1) or kill(0): only the child we forked, and only if not yet reaped.
      if (pid > 0) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, nullptr, 0);
      }
      ::close(fds[0]);
      ::close(fds[1]);
    }
  } reaper{child, {to_child[1], from_child[0]}};

  Job job;
  const int port_fd = to_child[1];
  start_job(job, p, 3, 77, /*external=*/1, [port_fd](uint16_t port) {
    std::string line = std::to_string(port) + "\n";
    EXPECT_EQ(::write(port_fd, line.data(), line.size()), static_cast<ssize_t>(line.size()));
  });
  if (HasFatalFailure()) return;

  // The child is up once it says so (bounded read), and answers pings from both ranks.
  {
    pollfd pfd{from_child[0], POLLIN, 0};
    ASSERT_EQ(::poll(&pfd, 1, 30000), 1) << "child did not report ready";
    char ready[6] = {};
    ASSERT_EQ(::read(from_child[0], ready, 6), 6);
    ASSERT_EQ(std::string(ready, 5), "ready");
  }
  Completions pings;
  static const TestHeader ping{kTestMagic, 0, 0, 0, 0};
  for (uint32_t r = 0; r < 2; ++r) {
    ASSERT_TRUE(job.transports[r]->send(2, std::as_bytes(std::span<const TestHeader>(&ping, 1)), {}, pings.callback()).ok());
  }
  ASSERT_TRUE(pings.wait_all());
  ASSERT_TRUE(job.sinks[0]->wait_messages(1));
  ASSERT_TRUE(job.sinks[1]->wait_messages(1));

  // Stop the child so a large send to it stays in flight, then kill it.
  ASSERT_EQ(::kill(child, SIGSTOP), 0);
  std::vector<std::byte> big = make_payload(0, 1, 32u << 20);
  static const TestHeader big_header{kTestMagic, 0, 1, 0, 32u << 20};
  Completions in_flight;
  ASSERT_TRUE(job.transports[0]->send(2, std::as_bytes(std::span<const TestHeader>(&big_header, 1)), big,
                                      in_flight.callback()).ok());
  const auto killed_at = Clock::now();
  ASSERT_EQ(::kill(child, SIGKILL), 0);
  ASSERT_EQ(::waitpid(child, nullptr, 0), child);
  reaper.pid = 0;  // reaped: the destructor must not signal anything

  for (uint32_t r = 0; r < 2; ++r) {
    ASSERT_TRUE(job.sinks[r]->wait_failure(2, 30s)) << "rank " << r << " was not told that rank 2 died";
    EXPECT_EQ(job.sinks[r]->last_failure().code(), Code::kUnavailable) << job.sinks[r]->last_failure().to_string();
    EXPECT_NE(job.sinks[r]->last_failure().message().find("rank 2"), std::string::npos);
  }
  const auto noticed = Clock::now() - killed_at;
  std::printf("[ info     ] %s: peer death noticed by both survivors after %lld ms\n", p.name,
              static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(noticed).count()));
  ASSERT_TRUE(in_flight.wait_all(30s)) << "the in-flight send to the dead peer never completed";
  EXPECT_FALSE(in_flight.statuses()[0].ok());

  // New sends to the dead peer fail at once or through their callback, never hang.
  for (uint32_t r = 0; r < 2; ++r) {
    auto result = std::make_shared<std::promise<Status>>();
    auto future = result->get_future();
    Status s = job.transports[r]->send(2, std::as_bytes(std::span<const TestHeader>(&ping, 1)), {},
                                       [result](const Status& st) { result->set_value(st); });
    if (s.ok()) {
      ASSERT_EQ(future.wait_for(10s), std::future_status::ready) << "send to a dead peer hangs";
      Status st = future.get();
      EXPECT_FALSE(st.ok());
    } else {
      EXPECT_EQ(s.code(), Code::kUnavailable) << s.to_string();
      EXPECT_NE(s.message().find("rank 2"), std::string::npos) << s.message();
    }
  }
  // The survivors still talk to each other.
  static const TestHeader hello{kTestMagic, 0, 5, 0, 0};
  Completions alive;
  ASSERT_TRUE(job.transports[0]->send(1, std::as_bytes(std::span<const TestHeader>(&hello, 1)), {}, alive.callback()).ok());
  ASSERT_TRUE(alive.wait_all());
  EXPECT_TRUE(alive.statuses()[0].ok());
  for (uint32_t r = 0; r < 2; ++r) EXPECT_EQ(job.sinks[r]->failures().at(2), 1) << "reported once";
}

// Captures the AM headers one transport sends (its progress thread), for forging and replaying.
class SentHeaders {
 public:
  std::function<void(uint32_t, unsigned, std::span<const std::byte>)> observer() {
    return [this](uint32_t peer, unsigned am_id, std::span<const std::byte> h) {
      std::lock_guard<std::mutex> lock(mu_);
      sent_.push_back({peer, am_id, std::vector<std::byte>(h.begin(), h.end())});
    };
  }
  struct Sent {
    uint32_t peer;
    unsigned am_id;
    std::vector<std::byte> header;
  };
  std::vector<Sent> all() {
    std::lock_guard<std::mutex> lock(mu_);
    return sent_;
  }

 private:
  std::mutex mu_;
  std::vector<Sent> sent_;
};

void put64(std::vector<std::byte>& h, size_t at, uint64_t v) {
  for (int i = 0; i < 8; ++i) h[at + static_cast<size_t>(i)] = static_cast<std::byte>((v >> (8 * i)) & 0xFF);
}

// Sends one test message 0 -> 1 and waits until rank 1 has it (`count` messages in all).
void send_and_await(Job& job, uint32_t seq, size_t count) {
  static std::vector<TestHeader> headers(64);
  headers[seq] = TestHeader{kTestMagic, 0, seq, 0, 0};
  Completions done;
  ASSERT_TRUE(job.transports[0]->send(1, std::as_bytes(std::span<const TestHeader>(&headers[seq], 1)), {},
                                      done.callback()).ok());
  ASSERT_TRUE(done.wait_all());
  ASSERT_TRUE(job.sinks[1]->wait_messages(count)) << "rank 1 did not get message " << seq;
}

// A replayed message, one with a forged sequence number, one with a rewritten header, a forged
// bye and a data header replayed as a bye: each is dropped and counted by the receiving
// transport, the sink hears of it, nothing reaches on_message, the peer stays up, and good
// traffic flows before, between and after.
TEST_P(UcxTransportTest, ForgedAndReplayedMessagesAreDroppedAndCounted) {
  SentHeaders sent;  // outlives the job: its stop() reports the byes it sends
  Job job;
  start_job(job, GetParam(), 2, 45, 0, {}, [&](UcxTransportOptions& o) {
    if (o.rank == 0) o.observe_sent_for_test = sent.observer();
  });
  if (HasFatalFailure()) return;
  send_and_await(job, 1, 1);
  if (HasFatalFailure()) return;
  auto all = sent.all();
  ASSERT_EQ(all.size(), 1u);
  const std::vector<std::byte> captured = all[0].header;
  ASSERT_EQ(captured.size(), kUcxRouteBytes + sizeof(TestHeader));
  UcxTransport& t0 = *job.transports[0];
  size_t expected_rejections = 0;
  auto expect_rejected = [&](const char* what, const std::string& reason, uint32_t claimed = 0) {
    ++expected_rejections;
    ASSERT_TRUE(job.sinks[1]->wait_rejected(expected_rejections, 10s)) << what << " was not rejected";
    auto rejected = job.sinks[1]->rejected();
    EXPECT_EQ(rejected.back().first, claimed) << what;
    EXPECT_NE(rejected.back().second.message().find(reason), std::string::npos)
        << what << ": " << rejected.back().second.message();
    EXPECT_EQ(job.transports[1]->stats().messages_rejected, expected_rejections) << what;
  };

  // 1. The exact bytes again: a replay.
  ASSERT_TRUE(t0.send_raw_for_test(1, kUcxDataAmId, captured).ok());
  expect_rejected("a replayed message", "replayed sequence number");
  // 2. A fresh sequence number without the key to MAC it.
  std::vector<std::byte> forged_seq = captured;
  put64(forged_seq, 8, 1000);
  ASSERT_TRUE(t0.send_raw_for_test(1, kUcxDataAmId, forged_seq).ok());
  expect_rejected("a forged sequence number", "MAC does not verify");
  // 3. The caller's header rewritten (seq field of the test header), prefix kept.
  std::vector<std::byte> rewritten = captured;
  rewritten[kUcxRouteBytes + 8] ^= std::byte{0x01};
  ASSERT_TRUE(t0.send_raw_for_test(1, kUcxDataAmId, rewritten).ok());
  expect_rejected("a rewritten header", "MAC does not verify");
  send_and_await(job, 2, 2);  // good traffic between the attacks
  if (HasFatalFailure()) return;
  // 4. A forged bye: right shape, made-up MAC.
  std::vector<std::byte> bye(captured.begin(), captured.begin() + kUcxRouteBytes);
  put64(bye, 8, 5000);
  ASSERT_TRUE(t0.send_raw_for_test(1, kUcxByeAmId, bye).ok());
  expect_rejected("a forged bye", "MAC does not verify");
  // 5. A genuine data prefix replayed as a bye (the AM id is under the MAC).
  std::vector<std::byte> data_as_bye(captured.begin(), captured.begin() + kUcxRouteBytes);
  ASSERT_TRUE(t0.send_raw_for_test(1, kUcxByeAmId, data_as_bye).ok());
  expect_rejected("a data prefix sent as a bye", "MAC does not verify");
  // 6. Not even a route prefix.
  std::vector<std::byte> garbage(12, std::byte{0x5A});
  ASSERT_TRUE(t0.send_raw_for_test(1, kUcxDataAmId, garbage).ok());
  expect_rejected("a short header", "bad route header length", MessageSink::kUnknownPeer);

  send_and_await(job, 3, 3);
  if (HasFatalFailure()) return;
  auto got = job.sinks[1]->received();
  ASSERT_EQ(got.size(), 3u) << "a forged or replayed message reached the sink";
  for (uint32_t i = 0; i < 3; ++i) EXPECT_EQ(got[i].seq, i + 1);
  EXPECT_TRUE(job.sinks[1]->failures().empty()) << "a forged bye took rank 0 down";
  EXPECT_TRUE(job.sinks[0]->rejected().empty());
}

// A message of an earlier formation of the same job (same job id, same secret) does not verify
// in the next one: the transport key includes the formation id.
TEST_P(UcxTransportTest, MessagesOfAnEarlierFormationAreRejected) {
  std::vector<std::byte> old_header;
  {
    SentHeaders sent;
    Job first;
    start_job(first, GetParam(), 2, 46, 0, {}, [&](UcxTransportOptions& o) {
      if (o.rank == 0) o.observe_sent_for_test = sent.observer();
    });
    if (HasFatalFailure()) return;
    send_and_await(first, 1, 1);
    if (HasFatalFailure()) return;
    old_header = sent.all().at(0).header;
  }
  Job second;
  start_job(second, GetParam(), 2, 46);
  if (HasFatalFailure()) return;
  ASSERT_TRUE(second.transports[0]->send_raw_for_test(1, kUcxDataAmId, old_header).ok());
  ASSERT_TRUE(second.sinks[1]->wait_rejected(1, 10s));
  EXPECT_NE(second.sinks[1]->rejected()[0].second.message().find("MAC does not verify"), std::string::npos);
  send_and_await(second, 1, 1);
  if (HasFatalFailure()) return;
  EXPECT_EQ(second.sinks[1]->received().size(), 1u);
  EXPECT_EQ(second.transports[1]->stats().messages_rejected, 1u);
}

// Recovery by replacement, at the transport: rank 1 of three leaves (its bye takes it down on the
// others); a new rank-1 transport started with the same coordinator is admitted by rank 0 as
// generation 1 and rank 2 learns it from rank 0; messages then flow both ways between the
// replacement and every rank; a message the first rank 1 sent, replayed now, is rejected.
TEST_P(UcxTransportTest, AReplacementOfALostRankJoinsTheRunningFormation) {
  SentHeaders sent1;  // outlives the job
  Job job;
  std::atomic<uint16_t> port{0};
  start_job(job, GetParam(), 3, 47, 0, [&](uint16_t p) { port = p; }, [&](UcxTransportOptions& o) {
    if (o.rank == 1) o.observe_sent_for_test = sent1.observer();
  });
  if (HasFatalFailure()) return;
  static std::vector<TestHeader> headers(16);
  auto send = [&](uint32_t from, uint32_t to, uint32_t seq) {
    headers[seq] = TestHeader{kTestMagic, from, seq, 0, 0};
    Completions done;
    ASSERT_TRUE(job.transports[from]->send(to, std::as_bytes(std::span<const TestHeader>(&headers[seq], 1)), {},
                                           done.callback()).ok());
    ASSERT_TRUE(done.wait_all());
    EXPECT_TRUE(done.statuses().at(0).ok()) << from << " -> " << to << ": " << done.statuses()[0].to_string();
  };
  send(1, 2, 1);
  ASSERT_TRUE(job.sinks[2]->wait_messages(1));
  const std::vector<std::byte> old = sent1.all().at(0).header;

  job.transports[1]->stop();
  ASSERT_TRUE(job.sinks[0]->wait_failure(1));
  ASSERT_TRUE(job.sinks[2]->wait_failure(1));
  auto sink = std::make_unique<RecordingSink>();
  UcxTransportOptions o = base_options(GetParam(), 1, 3, 47);
  o.coordinator = "127.0.0.1:" + std::to_string(port.load());
  auto replacement = UcxTransport::start(o, sink.get());
  ASSERT_TRUE(replacement.ok()) << replacement.status().to_string();
  job.transports[1] = std::move(*replacement);
  job.sinks[1] = std::move(sink);
  ASSERT_TRUE(job.sinks[0]->wait_rejoined(1)) << "rank 0 did not take the replacement";
  ASSERT_TRUE(job.sinks[2]->wait_rejoined(1)) << "rank 2 did not learn of the replacement from rank 0";
  EXPECT_EQ(job.transports[0]->stats().replacements_admitted, 1u);
  EXPECT_EQ(job.transports[2]->stats().peers_rejoined, 1u);

  send(1, 0, 2);
  send(1, 2, 3);
  send(0, 1, 4);
  send(2, 1, 5);
  if (HasFatalFailure()) return;
  ASSERT_TRUE(job.sinks[0]->wait_messages(1));
  ASSERT_TRUE(job.sinks[2]->wait_messages(2));
  ASSERT_TRUE(job.sinks[1]->wait_messages(2));
  for (uint32_t r = 0; r < 3; ++r) {
    for (const auto& m : job.sinks[r]->received()) EXPECT_TRUE(m.content_ok) << "rank " << r << " seq " << m.seq;
  }
  // The first process's message to rank 2, replayed: its sequence number is below generation 1's.
  ASSERT_TRUE(job.transports[1]->send_raw_for_test(2, kUcxDataAmId, old).ok());
  ASSERT_TRUE(job.sinks[2]->wait_rejected(1, 10s));
  EXPECT_NE(job.sinks[2]->rejected()[0].second.message().find("too old"), std::string::npos)
      << job.sinks[2]->rejected()[0].second.message();
  EXPECT_EQ(job.sinks[2]->received().size(), 2u);
}

// send() racing stop(): a send that passed its checks just before stop() must either be refused
// or have its callback run; it must never be queued behind shutdown's last look at the queue.
TEST_P(UcxTransportTest, SendRacingStopIsNeverLost) {
  std::promise<void> in_send;
  std::promise<void> stopped;
  std::shared_future<void> stopped_future = stopped.get_future().share();
  std::atomic<bool> armed{false};
  Job job;
  start_job(job, GetParam(), 2, 47, 0, {}, [&](UcxTransportOptions& o) {
    if (o.rank != 0) return;
    o.before_enqueue_for_test = [&, stopped_future] {
      if (!armed.exchange(false)) return;
      in_send.set_value();
      // Hold this send between its checks and the queue until stop() has completed.
      stopped_future.wait_for(20s);
    };
  });
  if (HasFatalFailure()) return;
  armed = true;
  static const TestHeader header{kTestMagic, 0, 9, 0, 0};
  auto callback_ran = std::make_shared<std::promise<Status>>();
  auto callback_future = callback_ran->get_future();
  auto sender = std::async(std::launch::async, [&] {
    return job.transports[0]->send(1, std::as_bytes(std::span<const TestHeader>(&header, 1)), {},
                                   [callback_ran](const Status& s) { callback_ran->set_value(s); });
  });
  ASSERT_EQ(in_send.get_future().wait_for(kWait), std::future_status::ready);
  job.transports[0]->stop();
  stopped.set_value();
  ASSERT_EQ(sender.wait_for(kWait), std::future_status::ready);
  Status s = sender.get();
  if (s.ok()) {
    ASSERT_EQ(callback_future.wait_for(10s), std::future_status::ready) << "accepted send's callback never ran";
  } else {
    EXPECT_EQ(s.code(), Code::kUnavailable) << s.to_string();
    EXPECT_EQ(callback_future.wait_for(0s), std::future_status::timeout) << "refused send must not call back";
  }
}

INSTANTIATE_TEST_SUITE_P(Transports, UcxTransportTest,
                         ::testing::Values(TransportParam{"tcp", "tcp", "lo"},
                                           TransportParam{"shm", "posix,self", ""}),
                         [](const ::testing::TestParamInfo<TransportParam>& param_info) {
                           return std::string(param_info.param.name);
                         });

// A daemon started before its network device is up: start() retries creating UCX for
// device_wait instead of failing at once (here the device never comes, so it fails after it).
TEST(UcxTransportStartTest, RetriesWhileTheNetworkDeviceIsMissing) {
  RecordingSink sink;
  UcxTransportOptions o = base_options(TransportParam{"tcp", "tcp", "sc-nodev0"}, 0, 1, 1);
  o.device_wait = 700ms;
  const auto begin = Clock::now();
  auto t = UcxTransport::start(o, &sink);
  const auto took = Clock::now() - begin;
  ASSERT_FALSE(t.ok());
  EXPECT_NE(t.status().message().find("no usable network device"), std::string::npos) << t.status().to_string();
  EXPECT_GE(took, 500ms);
  EXPECT_LT(took, 10s);
}

// The device comes up while start() retries: in a fresh network namespace (a child process, so
// nothing outside the test is touched) `lo` is down and UCX finds no tcp device; a thread brings
// it up after 1 s and start() must then succeed. Skipped where namespaces are not allowed.
TEST(UcxTransportStartTest, StartsOnceTheNetworkDeviceComesUp) {
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::setenv("SPARSECAR_UCX_LATE_DEVICE_CHILD", "1", 1);
    ::execl("/proc/self/exe", "ucx_transport_test", "--gtest_filter=UcxTransportChild.LateDevice",
            static_cast<char*>(nullptr));
    ::_exit(127);
  }
  int status = 0;
  pid_t done = 0;
  for (const auto until = Clock::now() + kWait; done == 0 && Clock::now() < until;) {
    done = ::waitpid(child, &status, WNOHANG);
    if (done == 0) std::this_thread::sleep_for(20ms);  // waiting for a child process; bounded
  }
  if (done == 0) {
    ::kill(child, SIGKILL);
    ::waitpid(child, &status, 0);
    FAIL() << "the child did not finish";
  }
  ASSERT_TRUE(WIFEXITED(status)) << status;
  if (WEXITSTATUS(status) == 77) GTEST_SKIP() << "no permission for a network namespace here";
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(UcxTransportChild, LateDevice) {
  if (std::getenv("SPARSECAR_UCX_LATE_DEVICE_CHILD") == nullptr) GTEST_SKIP() << "run by StartsOnceTheNetworkDeviceComesUp";
  if (::unshare(CLONE_NEWNET) != 0) std::_Exit(77);
  std::thread up([] {
    std::this_thread::sleep_for(1s);  // the "device comes up later" of the scenario
    int fd = ::socket(AF_INET, SOCK_DGRAM, 0);
    ifreq ifr{};
    std::strncpy(ifr.ifr_name, "lo", IFNAMSIZ - 1);
    if (::ioctl(fd, SIOCGIFFLAGS, &ifr) == 0) {
      ifr.ifr_flags = static_cast<short>(ifr.ifr_flags | IFF_UP);
      ::ioctl(fd, SIOCSIFFLAGS, &ifr);
    }
    ::close(fd);
  });
  RecordingSink sink;
  UcxTransportOptions o = base_options(TransportParam{"tcp", "tcp", "lo"}, 0, 1, 1);
  o.device_wait = 20s;
  const auto begin = Clock::now();
  auto t = UcxTransport::start(o, &sink);
  const auto took = Clock::now() - begin;
  up.join();
  EXPECT_TRUE(t.ok()) << t.status().to_string();
  EXPECT_GE(took, 900ms) << "lo was up before the thread raised it?";
  if (t.ok()) (*t)->stop();
  std::_Exit(::testing::Test::HasFailure() ? 1 : 0);
}

}  // namespace
}  // namespace sparsecar
