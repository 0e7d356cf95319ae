// The TCP rendezvous through rank 0 (protocol v2, RENDEZVOUS.md), without UCX: opaque strings
// stand in for worker addresses. Every rank runs in its own thread; rank 0 listens on port 0 and
// publishes the port it got. Outsiders are played by raw sockets that speak the bytes of the spec.
#include "daemon/transport/rendezvous.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <atomic>
#include <cstring>
#include <mutex>
#include <fstream>
#include <future>
#include <thread>

namespace sparsecar::rendezvous {
namespace {

using namespace std::chrono_literals;
using Result = Expected<Formation>;
using Clock = std::chrono::steady_clock;

constexpr auto kWait = 30s;  // bound on any single wait in these tests
const char kSecret[] = "correct horse battery staple, twice";
const char kOtherSecret[] = "a different secret of enough length";

auth::JobKey key_of(const char* secret) { return secret ? auth::job_key_from_secret(secret) : auth::open_job_key(); }

Options options(uint32_t rank, uint32_t world, uint64_t job, std::string coordinator,
                std::chrono::milliseconds timeout = 20s, const char* secret = kSecret) {
  Options o;
  o.rank = rank;
  o.world_size = world;
  o.job_id = job;
  o.coordinator = std::move(coordinator);
  o.timeout = timeout;
  o.key = key_of(secret);
  o.label = "test-rank-" + std::to_string(rank);
  return o;
}

std::string address_of(uint32_t rank) { return "worker-address-of-rank-" + std::to_string(rank); }

// Starts rank 0 of a job in the background; returns its result and the coordinator address.
struct Leader {
  std::future<Result> result;
  std::string coordinator;
  std::shared_ptr<Stats> stats = std::make_shared<Stats>();
};
Leader start_leader(uint32_t world, uint64_t job, std::chrono::milliseconds timeout = 20s, const char* secret = kSecret,
                    std::function<void(Options&)> tweak = {}) {
  auto port = std::make_shared<std::promise<uint16_t>>();
  auto port_future = port->get_future();
  Leader leader;
  Options o = options(0, world, job, "127.0.0.1:0", timeout, secret);
  o.on_listening = [port](uint16_t p) { port->set_value(p); };
  o.stats = leader.stats.get();
  if (tweak) tweak(o);
  leader.result = std::async(std::launch::async, [o, stats = leader.stats] { return run(o, address_of(0)); });
  if (port_future.wait_for(kWait) != std::future_status::ready) {
    ADD_FAILURE() << "rank 0 did not start listening";
    return leader;
  }
  leader.coordinator = "127.0.0.1:" + std::to_string(port_future.get());
  return leader;
}

std::future<Result> start_rank(uint32_t rank, uint32_t world, uint64_t job, const std::string& coordinator,
                               std::chrono::milliseconds timeout = 20s, const char* secret = kSecret) {
  Options o = options(rank, world, job, coordinator, timeout, secret);
  return std::async(std::launch::async, [o, rank] { return run(o, address_of(rank)); });
}

Result await(std::future<Result>& f) {
  if (f.wait_for(kWait) != std::future_status::ready) {
    ADD_FAILURE() << "rendezvous did not return within the test bound";
    std::abort();  // a hung thread cannot be joined; fail loudly instead of hanging ctest
  }
  return f.get();
}

void expect_full_table(Result& t, uint32_t world) {
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  ASSERT_EQ(t->peers.size(), world);
  for (uint32_t r = 0; r < world; ++r) {
    EXPECT_EQ(t->peers[r].address, address_of(r));
    EXPECT_NE(t->peers[r].label.find("test-rank-" + std::to_string(r)), std::string::npos) << t->peers[r].label;
  }
}

// The job completes with rank 1 of a world of 2 (the usual end of a test).
void finish_with_rank_one(Leader& leader, uint64_t job, const char* secret = kSecret) {
  auto good = start_rank(1, 2, job, leader.coordinator, 20s, secret);
  Result t1 = await(good);
  expect_full_table(t1, 2);
  Result t0 = await(leader.result);
  expect_full_table(t0, 2);
  if (t0.ok() && t1.ok()) {
    EXPECT_EQ(t0->formation_id, t1->formation_id);
  }
}

std::string le(uint64_t v, int bytes) {
  std::string out;
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
  return out;
}
uint64_t get_le(const std::string& s, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t{static_cast<unsigned char>(s[at + static_cast<size_t>(i)])} << (8 * i);
  return v;
}
std::span<const uint8_t> u8(const std::string& s) { return auth::bytes_of(std::string_view(s)); }
template <size_t N>
std::string text(const std::array<uint8_t, N>& a) {
  return std::string(reinterpret_cast<const char*>(a.data()), N);
}

// A raw TCP client of rank 0, as an outsider (or a test playing a rank by the spec) sees it.
class RawClient {
 public:
  explicit RawClient(const std::string& coordinator) {
    fd_ = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    a.sin_port = htons(static_cast<uint16_t>(std::stoi(coordinator.substr(coordinator.rfind(':') + 1))));
    timeval tv{10, 0};  // bound every read
    ::setsockopt(fd_, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    connected_ = ::connect(fd_, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  }
  ~RawClient() {
    if (fd_ >= 0) ::close(fd_);
  }
  bool connected() const { return connected_; }
  int fd() const { return fd_; }

  // Reads rank 0's 40-byte challenge; returns its 32 random bytes ("" on failure).
  std::string challenge() {
    std::string c = read_n(40);
    if (c.size() != 40 || get_le(c, 0, 4) != 0x5A524353 || get_le(c, 4, 2) != 3) return "";
    return c.substr(8);
  }
  void send(const std::string& bytes) { EXPECT_EQ(::write(fd_, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size())); }
  std::string read_n(size_t n) {
    std::string out;
    char buf[256];
    while (out.size() < n) {
      ssize_t got = ::read(fd_, buf, std::min(sizeof buf, n - out.size()));
      if (got <= 0) break;
      out.append(buf, static_cast<size_t>(got));
    }
    return out;
  }
  // Everything until rank 0 closes (bounded by the receive timeout).
  std::string read_all() {
    std::string out;
    char buf[256];
    ssize_t n;
    while ((n = ::read(fd_, buf, sizeof buf)) > 0) out.append(buf, static_cast<size_t>(n));
    return out;
  }

 private:
  int fd_ = -1;
  bool connected_ = false;
};

// A listening socket on a free loopback port, for a test that plays rank 0 by hand; -1 on failure.
int listen_on_loopback(std::string* coordinator) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof a;
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(fd, 4) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    if (fd >= 0) ::close(fd);
    return -1;
  }
  *coordinator = "127.0.0.1:" + std::to_string(ntohs(a.sin_port));
  return fd;
}

// A hello by the spec (RENDEZVOUS.md), MACed with `secret`'s rendezvous key over `challenge`.
std::string make_hello(const std::string& challenge, const char* secret, uint64_t job, uint32_t world, uint32_t rank,
                       const std::string& address = "forged-address", const std::string& nonce = std::string(32, 'n')) {
  const std::string label = "outsider";
  std::string body = le(job, 8) + le(world, 4) + le(rank, 4) + le(label.size(), 4) + le(address.size(), 4) + label + address;
  std::string head = le(0x5A524353, 4) + le(3, 2) + le(0, 2) + le(body.size(), 4) + nonce;
  const std::string domain = "sparsecar rendezvous hello v3";
  auth::Mac256 mac = auth::mac256(auth::rendezvous_key(key_of(secret)), {u8(domain), u8(challenge), u8(head), u8(body)});
  return head + text(mac) + body;
}

// Parses a refusal; returns its reason ("" when the bytes are not a refusal).
std::string refusal_reason(const std::string& reply) {
  if (reply.size() < 12 || get_le(reply, 0, 4) != 0x5A524353 || get_le(reply, 6, 2) != 1) return "";
  return reply.substr(12, get_le(reply, 8, 4));
}

TEST(RendezvousTest, SplitHostPort) {
  std::string host, port;
  EXPECT_TRUE(split_host_port("127.0.0.1:29500", &host, &port));
  EXPECT_EQ(host, "127.0.0.1");
  EXPECT_EQ(port, "29500");
  EXPECT_TRUE(split_host_port("[::1]:80", &host, &port));
  EXPECT_EQ(host, "::1");
  EXPECT_FALSE(split_host_port("nohost", &host, &port));
  EXPECT_FALSE(split_host_port("h:99999", &host, &port));
  EXPECT_FALSE(split_host_port("h:12a", &host, &port));
  EXPECT_FALSE(split_host_port("h:", &host, &port));
}

TEST(RendezvousTest, FourRanksGetTheSameTableAndFormationId) {
  Leader leader = start_leader(4, 11);
  std::vector<std::future<Result>> others;
  for (uint32_t r = 1; r < 4; ++r) others.push_back(start_rank(r, 4, 11, leader.coordinator));
  Result t0 = await(leader.result);
  expect_full_table(t0, 4);
  ASSERT_TRUE(t0.ok());
  EXPECT_NE(t0->formation_id, auth::Nonce{});
  for (auto& f : others) {
    Result t = await(f);
    expect_full_table(t, 4);
    if (t.ok()) {
      EXPECT_EQ(t->formation_id, t0->formation_id);
    }
  }
}

TEST(RendezvousTest, EachFormationHasItsOwnId) {
  Leader a = start_leader(2, 11);
  auto a1 = start_rank(1, 2, 11, a.coordinator);
  Result ra = await(a.result);
  ASSERT_TRUE(await(a1).ok());
  Leader b = start_leader(2, 11);
  auto b1 = start_rank(1, 2, 11, b.coordinator);
  Result rb = await(b.result);
  ASSERT_TRUE(await(b1).ok());
  ASSERT_TRUE(ra.ok() && rb.ok());
  EXPECT_NE(ra->formation_id, rb->formation_id);
}

TEST(RendezvousTest, OpenJobWithoutSecretStillWorks) {
  Leader leader = start_leader(2, 12, 20s, nullptr);
  finish_with_rank_one(leader, 12, nullptr);
}

TEST(RendezvousTest, WorldOfOneNeedsNoCoordinator) {
  Result t = run(options(0, 1, 1, "unused:1"), address_of(0));
  expect_full_table(t, 1);
}

// An authenticated rank with the wrong job id or world size is refused with a reason that does
// not reveal rank 0's values; the job then completes.
TEST(RendezvousTest, WrongWorldSizeAndJobIdAreRefusedWithoutNamingRankZerosValues) {
  Leader leader = start_leader(2, 424242);
  auto bad_world = start_rank(1, 3, 424242, leader.coordinator);
  Result t = await(bad_world);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(t.status().message().find("world size differs"), std::string::npos) << t.status().message();

  auto bad_job = start_rank(1, 2, 515151, leader.coordinator);
  t = await(bad_job);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(t.status().message().find("job id differs"), std::string::npos) << t.status().message();
  EXPECT_EQ(t.status().message().find("424242"), std::string::npos) << t.status().message();
  EXPECT_EQ(leader.stats->refused.load(), 2u);
  finish_with_rank_one(leader, 424242);
}

TEST(RendezvousTest, RankOutOfRangeIsRefused) {
  Leader next = start_leader(2, 7);
  RawClient c(next.coordinator);
  ASSERT_TRUE(c.connected());
  std::string challenge = c.challenge();
  ASSERT_EQ(challenge.size(), 32u);
  c.send(make_hello(challenge, kSecret, 7, 2, 5));
  std::string reason = refusal_reason(c.read_all());
  EXPECT_NE(reason.find("rank 5 is out of range"), std::string::npos) << reason;
  finish_with_rank_one(next, 7);
}

TEST(RendezvousTest, DuplicateRankIsRefused) {
  Leader leader = start_leader(3, 5);
  auto first = start_rank(1, 3, 5, leader.coordinator);
  auto second = start_rank(1, 3, 5, leader.coordinator);
  // The job cannot complete without rank 2, so the first of the two to return is the refused
  // duplicate.
  std::future<Result>* refused = nullptr;
  std::future<Result>* accepted = nullptr;
  const auto until = Clock::now() + kWait;
  while (refused == nullptr && Clock::now() < until) {
    if (first.wait_for(10ms) == std::future_status::ready) {
      refused = &first;
      accepted = &second;
    } else if (second.wait_for(10ms) == std::future_status::ready) {
      refused = &second;
      accepted = &first;
    }
  }
  ASSERT_NE(refused, nullptr) << "neither duplicate was refused";
  Result t = refused->get();
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(t.status().message().find("already joined"), std::string::npos) << t.status().message();

  auto third = start_rank(2, 3, 5, leader.coordinator);
  Result t2 = await(third);
  expect_full_table(t2, 3);
  Result t1 = await(*accepted);
  expect_full_table(t1, 3);
  Result t0 = await(leader.result);
  expect_full_table(t0, 3);
}

// Rank 0 as a Coordinator: once the job has formed it admits a replacement for a rank it is told
// is lost — the same formation id, the replacement's address in the table, the generation admit()
// gave — and refuses a hello for a live rank, one that admit() refuses (with its reason) and one
// with another secret.
TEST(RendezvousTest, CoordinatorAdmitsAReplacementOnlyForALostRank) {
  auto port = std::make_shared<std::promise<uint16_t>>();
  auto port_future = port->get_future();
  Options o = options(0, 3, 21, "127.0.0.1:0");
  o.on_listening = [port](uint16_t p) { port->set_value(p); };
  Formation f0;
  auto formed = std::async(std::launch::async, [&] { return Coordinator::form(o, address_of(0), &f0); });
  ASSERT_EQ(port_future.wait_for(kWait), std::future_status::ready);
  const std::string coordinator = "127.0.0.1:" + std::to_string(port_future.get());
  auto r1 = start_rank(1, 3, 21, coordinator);
  auto r2 = start_rank(2, 3, 21, coordinator);
  ASSERT_TRUE(await(r1).ok());
  ASSERT_TRUE(await(r2).ok());
  ASSERT_EQ(formed.wait_for(kWait), std::future_status::ready);
  auto coord = formed.get();
  ASSERT_TRUE(coord.ok()) << coord.status().to_string();
  EXPECT_EQ(f0.generation, 0u);

  std::atomic<bool> rank1_lost{false};
  std::atomic<bool> refuse{false};
  std::mutex mu;
  std::vector<Replacement> admitted;
  (*coord)->serve([&](uint32_t rank) { return rank == 1 && rank1_lost.load(); },
                  [&](const Replacement& r) -> Expected<uint64_t> {
                    if (refuse.load()) return failed_precondition("not now, for a reason of rank 0's");
                    std::lock_guard<std::mutex> lock(mu);
                    admitted.push_back(r);
                    return uint64_t{7};
                  });
  auto replace = [&](uint32_t rank, const char* secret = kSecret) {
    Options ro = options(rank, 3, 21, coordinator, 10s, secret);
    auto f = std::async(std::launch::async, [ro] { return run(ro, "replacement-address"); });
    return await(f);
  };
  Result alive = replace(2);
  ASSERT_FALSE(alive.ok());
  EXPECT_EQ(alive.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(alive.status().message().find("alive in the running job"), std::string::npos) << alive.status().message();
  Result not_yet = replace(1);
  EXPECT_NE(not_yet.status().message().find("alive in the running job"), std::string::npos) << not_yet.status().to_string();

  rank1_lost = true;
  Result wrong_secret = replace(1, kOtherSecret);
  EXPECT_EQ(wrong_secret.status().code(), Code::kPermissionDenied) << wrong_secret.status().to_string();
  refuse = true;
  Result refused = replace(1);
  EXPECT_EQ(refused.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(refused.status().message().find("a reason of rank 0's"), std::string::npos) << refused.status().to_string();
  refuse = false;

  Result joined = replace(1);
  ASSERT_TRUE(joined.ok()) << joined.status().to_string();
  EXPECT_EQ(joined->generation, 7u);
  EXPECT_EQ(joined->formation_id, f0.formation_id);
  ASSERT_EQ(joined->peers.size(), 3u);
  EXPECT_EQ(joined->peers[0].address, address_of(0));
  EXPECT_EQ(joined->peers[1].address, "replacement-address");
  EXPECT_EQ(joined->peers[2].address, address_of(2));
  std::lock_guard<std::mutex> lock(mu);
  ASSERT_EQ(admitted.size(), 1u);
  EXPECT_EQ(admitted[0].rank, 1u);
  EXPECT_EQ(admitted[0].address, "replacement-address");
  (*coord)->stop();
}

// A joiner with another secret is refused ("authentication failed", counted) and learns nothing;
// the real rank then joins.
TEST(RendezvousTest, WrongSecretIsRefusedByRankZero) {
  Leader leader = start_leader(2, 31);
  auto intruder = start_rank(1, 2, 31, leader.coordinator, 20s, kOtherSecret);
  Result t = await(intruder);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), Code::kPermissionDenied) << t.status().to_string();
  EXPECT_NE(t.status().message().find("authentication failed"), std::string::npos) << t.status().message();
  EXPECT_EQ(leader.stats->auth_failures.load(), 1u);

  auto open_rank = start_rank(1, 2, 31, leader.coordinator, 20s, nullptr);  // no secret at all
  t = await(open_rank);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), Code::kPermissionDenied) << t.status().to_string();
  EXPECT_EQ(leader.stats->auth_failures.load(), 2u);
  finish_with_rank_one(leader, 31);
}

// A job of mixed releases (v2 daemons send a dense ring phase as one message, v3 ones in
// segments: such a job would fail at its first ring step) is refused before it forms, both ways,
// with a reason that says so, and the real rank still gets in.
TEST(RendezvousTest, AV2RankIsRefusedBeforeTheJobForms) {
  const uint64_t job = 71;
  Leader leader = start_leader(2, job);
  {
    RawClient c(leader.coordinator);  // a v2 joiner's hello: the bytes of v3's with version 2
    const std::string challenge = c.challenge();
    ASSERT_EQ(challenge.size(), 32u);
    std::string v2 = make_hello(challenge, kSecret, job, 2, 1);
    v2[4] = 2;
    c.send(v2);
    const std::string reason = refusal_reason(c.read_all());
    EXPECT_NE(reason.find("rendezvous v2 hello"), std::string::npos) << reason;
    EXPECT_NE(reason.find("same sparsecar release"), std::string::npos) << reason;
  }
  EXPECT_EQ(leader.stats->malformed.load(), 1u);
  finish_with_rank_one(leader, job);

  // A v3 joiner of a v2 rank 0 (a fake that sends v2's challenge) stops at once, naming both.
  std::string coordinator;
  const int listener = listen_on_loopback(&coordinator);
  ASSERT_GE(listener, 0);
  auto joiner = start_rank(1, 2, job, coordinator, 10s);
  pollfd p{listener, POLLIN, 0};
  ASSERT_EQ(::poll(&p, 1, 10000), 1);
  const int c = ::accept(listener, nullptr, nullptr);
  const std::string challenge = le(0x5A524353, 4) + le(2, 2) + le(0, 2) + std::string(32, 'c');
  EXPECT_EQ(::write(c, challenge.data(), challenge.size()), static_cast<ssize_t>(challenge.size()));
  const auto begin = Clock::now();
  Result t = await(joiner);
  EXPECT_LT(Clock::now() - begin, 5s) << "the joiner waited for its deadline instead of stopping";
  ::close(c);
  ::close(listener);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), Code::kFailedPrecondition) << t.status().to_string();
  EXPECT_NE(t.status().message().find("speaks sparsecar rendezvous v2, this daemon v3"), std::string::npos)
      << t.status().message();
}

// A fake rank 0 that does not hold the secret cannot hand a joiner its table: the joiner checks
// the welcome's MAC and refuses it. The fake speaks the spec with its own key.
TEST(RendezvousTest, FakeRankZeroWithAnotherSecretIsRefusedByTheJoiner) {
  std::string coordinator;
  const int listener = listen_on_loopback(&coordinator);
  ASSERT_GE(listener, 0);

  auto joiner = start_rank(1, 2, 41, coordinator, 10s);
  auto fake = std::async(std::launch::async, [listener] {
    pollfd p{listener, POLLIN, 0};
    if (::poll(&p, 1, 10000) != 1) return std::string("no connection");
    int c = ::accept(listener, nullptr, nullptr);
    timeval tv{10, 0};
    ::setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
    const std::string challenge(32, 'c');
    std::string out = le(0x5A524353, 4) + le(3, 2) + le(0, 2) + challenge;
    [[maybe_unused]] ssize_t w = ::write(c, out.data(), out.size());
    char head[76];
    size_t got = 0;
    while (got < sizeof head) {
      ssize_t n = ::read(c, head + got, sizeof head - got);
      if (n <= 0) break;
      got += static_cast<size_t>(n);
    }
    if (got != sizeof head) {
      ::close(c);
      return std::string("short hello");
    }
    const std::string hello_head(head, sizeof head);
    const std::string nonce = hello_head.substr(12, 32);
    std::string body_rest(get_le(hello_head, 8, 4), '\0');
    for (size_t done = 0; done < body_rest.size();) {
      ssize_t n = ::read(c, body_rest.data() + done, body_rest.size() - done);
      if (n <= 0) break;
      done += static_cast<size_t>(n);
    }
    // A well-formed welcome with a table pointing rank 1 at an attacker, MACed with the wrong key.
    std::string body = std::string(32, 'F') + le(2, 4);
    for (const std::string& addr : {std::string("attacker-address"), address_of(1)}) {
      body += le(1, 4) + le(addr.size(), 4) + "x" + addr;
    }
    std::string welcome_head = le(0x5A524353, 4) + le(3, 2) + le(0, 2) + le(body.size(), 4);
    const std::string domain = "sparsecar rendezvous welcome v3";
    auth::Mac256 mac = auth::mac256(auth::rendezvous_key(key_of(kOtherSecret)),
                                    {u8(domain), u8(challenge), u8(nonce), u8(welcome_head), u8(body)});
    std::string welcome = welcome_head + body + text(mac);
    w = ::write(c, welcome.data(), welcome.size());
    char buf[16];
    while (::read(c, buf, sizeof buf) > 0) {
    }
    ::close(c);
    return std::string("sent");
  });
  Result t = await(joiner);
  ::close(listener);
  ASSERT_EQ(fake.wait_for(kWait), std::future_status::ready);
  EXPECT_EQ(fake.get(), "sent");
  ASSERT_FALSE(t.ok()) << "the joiner accepted a table from a rank 0 that does not hold the secret";
  EXPECT_EQ(t.status().code(), Code::kPermissionDenied) << t.status().to_string();
  EXPECT_NE(t.status().message().find("could not prove it holds the job secret"), std::string::npos)
      << t.status().message();
}

// A hello captured from one connection is worthless on another: the challenge differs.
TEST(RendezvousTest, ReplayedHelloFails) {
  Leader leader = start_leader(2, 51);
  std::string captured;
  {
    RawClient first(leader.coordinator);
    ASSERT_TRUE(first.connected());
    std::string challenge = first.challenge();
    ASSERT_EQ(challenge.size(), 32u);
    captured = make_hello(challenge, kSecret, 51, 2, 1);  // valid, but never sent on `first`
  }
  RawClient second(leader.coordinator);
  ASSERT_TRUE(second.connected());
  ASSERT_EQ(second.challenge().size(), 32u);
  second.send(captured);
  std::string reason = refusal_reason(second.read_all());
  EXPECT_EQ(reason, "authentication failed");
  EXPECT_EQ(leader.stats->auth_failures.load(), 1u);
  finish_with_rank_one(leader, 51);
}

// Garbage, a short hello, an oversized length and a forged MAC are refused one by one without
// ending the rendezvous; no refusal carries the job id or an address.
TEST(RendezvousTest, ForgedShortAndGarbageHellosDoNotHarmTheJob) {
  const uint64_t job = 0x1234567890ull;
  Leader leader = start_leader(2, job, 20s, kSecret, [](Options& o) { o.hello_timeout = 500ms; });
  auto check_reply = [&](const std::string& reply) {
    EXPECT_EQ(reply.find(std::to_string(job)), std::string::npos) << reply;
    EXPECT_EQ(reply.find("1234567890"), std::string::npos) << reply;
    EXPECT_EQ(reply.find("worker-address"), std::string::npos) << reply;
    EXPECT_EQ(reply.find("test-rank"), std::string::npos) << reply;
  };
  {
    RawClient c(leader.coordinator);
    ASSERT_EQ(c.challenge().size(), 32u);
    c.send(std::string("GET / HTTP/1.0\r\n\r\n") + std::string(60, ' '));
    std::string reply = c.read_all();
    EXPECT_FALSE(refusal_reason(reply).empty()) << reply;
    check_reply(reply);
  }
  {
    RawClient c(leader.coordinator);  // a forged hello for rank 1 with a made-up MAC
    std::string challenge = c.challenge();
    ASSERT_EQ(challenge.size(), 32u);
    std::string forged = make_hello(challenge, kSecret, job, 2, 1);
    forged[44] = static_cast<char>(forged[44] ^ 1);
    c.send(forged);
    std::string reply = c.read_all();
    EXPECT_EQ(refusal_reason(reply), "authentication failed");
    check_reply(reply);
  }
  {
    RawClient c(leader.coordinator);  // 1 GiB body announced
    ASSERT_EQ(c.challenge().size(), 32u);
    c.send(le(0x5A524353, 4) + le(3, 2) + le(0, 2) + le(1u << 30, 4));
    std::string reply = c.read_all();
    EXPECT_EQ(refusal_reason(reply), "malformed hello");
    check_reply(reply);
  }
  {
    RawClient c(leader.coordinator);  // 60 bytes of a hello, then silence: closed at the hello deadline
    std::string challenge = c.challenge();
    ASSERT_EQ(challenge.size(), 32u);
    c.send(make_hello(challenge, kSecret, job, 2, 1).substr(0, 60));
    const auto begin = Clock::now();
    EXPECT_EQ(c.read_all(), "");
    EXPECT_LT(Clock::now() - begin, 5s);
  }
  EXPECT_EQ(leader.stats->auth_failures.load(), 1u);
  EXPECT_EQ(leader.stats->malformed.load(), 2u);
  EXPECT_GE(leader.stats->shed.load(), 1u);
  finish_with_rank_one(leader, job);
}

// More idle connections than rank 0 lets wait: the oldest are closed, the real rank gets in.
TEST(RendezvousTest, IdleConnectionsBeyondTheCapDoNotKeepTheRealRankOut) {
  Leader leader = start_leader(2, 61, 20s, kSecret, [](Options& o) { o.max_pending = 8; });
  std::vector<std::unique_ptr<RawClient>> idle;
  for (int i = 0; i < 40; ++i) {
    idle.push_back(std::make_unique<RawClient>(leader.coordinator));
    ASSERT_TRUE(idle.back()->connected());
  }
  // Every idle connection got its challenge (it was accepted), none sends a hello.
  for (auto& c : idle) ASSERT_EQ(c->challenge().size(), 32u);
  const auto begin = Clock::now();
  finish_with_rank_one(leader, 61);
  EXPECT_LT(Clock::now() - begin, 3s);
  EXPECT_GE(leader.stats->shed.load(), 32u);
}

// Rank 0 in a child process whose descriptor limit (48) is far below the idle connections held
// open against it (200): accept() fails with EMFILE. Rank 0 must neither spin nor lock the real
// rank out. The child is this test binary, re-run with a filter and an environment variable.
TEST(RendezvousTest, IdleFloodPastTheDescriptorLimit) {
  char port_file[] = "/tmp/sparsecar-rdv-XXXXXX";
  int pf = ::mkstemp(port_file);
  ASSERT_GE(pf, 0);
  ::close(pf);
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::setenv("SPARSECAR_RDV_LEADER_PORT_FILE", port_file, 1);
    ::execl("/proc/self/exe", "rendezvous_test", "--gtest_filter=RendezvousChild.LeaderWithFewDescriptors",
            static_cast<char*>(nullptr));
    ::_exit(127);
  }
  struct Reaper {
    pid_t pid;
    std::string path;
    ~Reaper() {
      if (pid > 0) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, nullptr, 0);
      }
      ::unlink(path.c_str());
    }
  } reaper{child, port_file};
  std::string port;
  for (const auto until = Clock::now() + kWait; port.empty() && Clock::now() < until;) {
    std::ifstream in(port_file);
    std::getline(in, port);
    if (port.empty() || port.back() != '.') {
      port.clear();
      std::this_thread::sleep_for(20ms);  // polling a file the child writes; bounded above
    }
  }
  ASSERT_FALSE(port.empty()) << "the child rank 0 did not start";
  port.pop_back();
  const std::string coordinator = "127.0.0.1:" + port;

  std::vector<std::unique_ptr<RawClient>> idle;
  for (int i = 0; i < 200; ++i) idle.push_back(std::make_unique<RawClient>(coordinator));
  // CPU time of the child before and after: an EMFILE spin would burn a whole core.
  auto cpu_ticks = [&] {
    std::ifstream stat("/proc/" + std::to_string(child) + "/stat");
    std::string s((std::istreambuf_iterator<char>(stat)), std::istreambuf_iterator<char>());
    size_t pos = s.rfind(')') + 2;
    for (int field = 3; field < 14; ++field) pos = s.find(' ', pos) + 1;
    return std::strtoull(s.c_str() + pos, nullptr, 10) + std::strtoull(s.c_str() + s.find(' ', pos) + 1, nullptr, 10);
  };
  // Give rank 0 a second with the flood against it: an EMFILE busy loop would burn ~100 ticks.
  const auto ticks_before = cpu_ticks();
  std::this_thread::sleep_for(1s);
  const auto spent = cpu_ticks() - ticks_before;
  EXPECT_LT(spent, 30u) << "rank 0 used " << spent << " clock ticks in 1 s with idle connections against it";
  const auto begin = Clock::now();
  auto real = start_rank(1, 2, 71, coordinator, 20s);
  Result t = await(real);
  const auto took = Clock::now() - begin;
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  EXPECT_LT(took, 10s);
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  reaper.pid = 0;
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child status " << status;
}

// The child side of IdleFloodPastTheDescriptorLimit (runs only when re-executed by it).
TEST(RendezvousChild, LeaderWithFewDescriptors) {
  const char* port_file = std::getenv("SPARSECAR_RDV_LEADER_PORT_FILE");
  if (port_file == nullptr) GTEST_SKIP() << "run by IdleFloodPastTheDescriptorLimit only";
  rlimit lim{48, 48};
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &lim), 0);
  Options o = options(0, 2, 71, "127.0.0.1:0", 25s);
  o.on_listening = [port_file](uint16_t p) {
    std::ofstream out(port_file);
    out << p << ".\n";
  };
  Result t = run(o, address_of(0));
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  std::_Exit(::testing::Test::HasFailure() ? 1 : 0);
}

// The hello checks as a function (the seam for fuzz targets) agree with the bytes of the spec.
TEST(RendezvousTest, CheckHelloVerifiesTheMacBeforeTheBody) {
  const std::string challenge(32, 'c');
  auth::Nonce c{};
  std::memcpy(c.data(), challenge.data(), c.size());
  auto check = [&](const std::string& bytes, const char* secret = kSecret) {
    return check_hello(u8(bytes), key_of(secret), c);
  };
  const std::string good = make_hello(challenge, kSecret, 9, 2, 1);
  EXPECT_TRUE(check(good).ok()) << check(good).to_string();
  EXPECT_EQ(check(good, kOtherSecret).code(), Code::kPermissionDenied);
  EXPECT_EQ(check(good, nullptr).code(), Code::kPermissionDenied);
  EXPECT_EQ(check(good.substr(0, good.size() - 1)).code(), Code::kInvalidArgument);
  EXPECT_EQ(check(good + "x").code(), Code::kInvalidArgument);
  // A body whose lengths do not add up, correctly MACed: malformed, found after the MAC.
  std::string body = le(9, 8) + le(2, 4) + le(1, 4) + le(100, 4) + le(1, 4) + "ab";
  std::string head = le(0x5A524353, 4) + le(3, 2) + le(0, 2) + le(body.size(), 4) + std::string(32, 'n');
  auth::Mac256 mac = auth::mac256(auth::rendezvous_key(key_of(kSecret)),
                                  {u8(std::string("sparsecar rendezvous hello v3")), u8(challenge), u8(head), u8(body)});
  EXPECT_EQ(check(head + text(mac) + body).code(), Code::kInvalidArgument);
  EXPECT_EQ(check(head + std::string(32, 'm') + body).code(), Code::kPermissionDenied);
}

// encode_hello builds the bytes of the spec (the hand-made make_hello), and check_hello accepts
// them only under the same key and challenge.
TEST(RendezvousTest, EncodeHelloIsTheSpecsHello) {
  const std::string challenge(32, 'c');
  auth::Nonce c{};
  std::memcpy(c.data(), challenge.data(), c.size());
  HelloFields h;
  h.job_id = 9;
  h.world_size = 2;
  h.rank = 1;
  h.label = "outsider";
  h.address = "forged-address";
  std::memset(h.nonce.data(), 'n', h.nonce.size());
  const std::string bytes = encode_hello(h, key_of(kSecret), c);
  EXPECT_EQ(bytes, make_hello(challenge, kSecret, 9, 2, 1));
  EXPECT_TRUE(check_hello(u8(bytes), key_of(kSecret), c).ok());
  EXPECT_EQ(check_hello(u8(bytes), key_of(kOtherSecret), c).code(), Code::kPermissionDenied);
  auth::Nonce other = c;
  other[0] ^= 1;
  EXPECT_EQ(check_hello(u8(bytes), key_of(kSecret), other).code(), Code::kPermissionDenied);
  // The label is cut to its limit, as the joiner always did.
  h.label = std::string(300, 'L');
  const std::string cut = encode_hello(h, key_of(kSecret), c);
  EXPECT_EQ(get_le(cut, 76 + 16, 4), 256u);
  EXPECT_TRUE(check_hello(u8(cut), key_of(kSecret), c).ok());
}

// The welcome table round-trips, and the joiner's parser refuses every table that is not exactly
// world_size entries ending at the body's end with our address at our rank.
TEST(RendezvousTest, WelcomeBodyRoundTripsAndMalformedTablesAreDataLoss) {
  Formation f;
  for (size_t i = 0; i < f.formation_id.size(); ++i) f.formation_id[i] = static_cast<uint8_t>(i);
  f.peers = {Peer{"rank0", "addr0"}, Peer{"", "addr1"}, Peer{"rank2 via 10.0.0.3", "addr2"}};
  const std::string body = encode_welcome_body(f);
  auto parsed = parse_welcome_body(body, 3, 1, "addr1", "rank 0");
  ASSERT_TRUE(parsed.ok()) << parsed.status().to_string();
  EXPECT_EQ(parsed->formation_id, f.formation_id);
  ASSERT_EQ(parsed->peers.size(), 3u);
  EXPECT_EQ(parsed->peers[2].label, "rank2 via 10.0.0.3");
  EXPECT_EQ(encode_welcome_body(*parsed), body);
  auto bad = [&](std::string_view b, uint32_t world, uint32_t rank, std::string_view address) {
    auto r = parse_welcome_body(b, world, rank, address, "rank 0");
    EXPECT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), Code::kDataLoss);
    EXPECT_NE(r.status().message().find("rank 0 sent a malformed table"), std::string::npos) << r.status().message();
  };
  bad(body, 3, 1, "addr2");                      // not our address at our rank
  bad(body, 4, 1, "addr1");                      // another world size
  bad(body, 3, 3, "addr1");                      // our rank outside the table
  bad(body + "x", 3, 1, "addr1");                // trailing bytes
  bad(body.substr(0, body.size() - 1), 3, 1, "addr1");  // truncated
  bad(body.substr(0, 35), 3, 1, "addr1");        // shorter than the fixed part
  std::string huge_world = body.substr(0, 32) + le(0xFFFFFFFF, 4);
  bad(huge_world, 0xFFFFFFFF, 0, "addr1");       // a world the body cannot hold: refused before allocating
}

// A port nobody listens on: bound (so nobody else takes it) but not listening.
struct DeadPort {
  int fd = -1;
  uint16_t port = 0;
  DeadPort() {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    EXPECT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
    socklen_t len = sizeof a;
    EXPECT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len), 0);
    port = ntohs(a.sin_port);
  }
  ~DeadPort() { ::close(fd); }
};

TEST(RendezvousTest, TimesOutWhenRankZeroNeverAppears) {
  DeadPort dead;
  const auto begin = std::chrono::steady_clock::now();
  Result t = run(options(1, 2, 1, "127.0.0.1:" + std::to_string(dead.port), 400ms), address_of(1));
  const auto took = std::chrono::steady_clock::now() - begin;
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), Code::kDeadlineExceeded);
  EXPECT_NE(t.status().message().find("could not reach rank 0"), std::string::npos) << t.status().message();
  EXPECT_GE(took, 350ms);  // waited about the deadline (poll rounds to whole ms), not gave up at once
  EXPECT_LT(took, 3s);
}

TEST(RendezvousTest, RankZeroTimesOutNamingTheMissingRanks) {
  const auto begin = std::chrono::steady_clock::now();
  Leader leader = start_leader(3, 1, 300ms);
  Result t = await(leader.result);
  const auto took = std::chrono::steady_clock::now() - begin;
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), Code::kDeadlineExceeded);
  EXPECT_NE(t.status().message().find("missing rank(s) 1, 2"), std::string::npos) << t.status().message();
  EXPECT_LT(took, 3s);
}

}  // namespace
}  // namespace sparsecar::rendezvous
