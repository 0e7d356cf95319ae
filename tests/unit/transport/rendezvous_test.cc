// The TCP rendezvous through rank 0, without UCX: opaque strings stand in for worker addresses.
// Every rank runs in its own thread; rank 0 listens on port 0 and publishes the port it got.
#include "daemon/transport/rendezvous.h"

#include <gtest/gtest.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <future>
#include <thread>

namespace sparsecar::rendezvous {
namespace {

using namespace std::chrono_literals;
using Table = Expected<std::vector<Peer>>;

constexpr auto kWait = 30s;  // bound on any single wait in these tests

Options options(uint32_t rank, uint32_t world, uint64_t job, std::string coordinator,
                std::chrono::milliseconds timeout = 20s) {
  Options o;
  o.rank = rank;
  o.world_size = world;
  o.job_id = job;
  o.coordinator = std::move(coordinator);
  o.timeout = timeout;
  o.label = "test-rank-" + std::to_string(rank);
  return o;
}

std::string address_of(uint32_t rank) { return "worker-address-of-rank-" + std::to_string(rank); }

// Starts rank 0 of a job in the background; returns its result and the coordinator address.
struct Leader {
  std::future<Table> result;
  std::string coordinator;
};
Leader start_leader(uint32_t world, uint64_t job, std::chrono::milliseconds timeout = 20s) {
  auto port = std::make_shared<std::promise<uint16_t>>();
  auto port_future = port->get_future();
  Options o = options(0, world, job, "127.0.0.1:0", timeout);
  o.on_listening = [port](uint16_t p) { port->set_value(p); };
  Leader leader;
  leader.result = std::async(std::launch::async, [o] { return run(o, address_of(0)); });
  if (port_future.wait_for(kWait) != std::future_status::ready) {
    ADD_FAILURE() << "rank 0 did not start listening";
    return leader;
  }
  leader.coordinator = "127.0.0.1:" + std::to_string(port_future.get());
  return leader;
}

std::future<Table> start_rank(uint32_t rank, uint32_t world, uint64_t job, const std::string& coordinator,
                              std::chrono::milliseconds timeout = 20s) {
  Options o = options(rank, world, job, coordinator, timeout);
  return std::async(std::launch::async, [o, rank] { return run(o, address_of(rank)); });
}

Table await(std::future<Table>& f) {
  if (f.wait_for(kWait) != std::future_status::ready) {
    ADD_FAILURE() << "rendezvous did not return within the test bound";
    std::abort();  // a hung thread cannot be joined; fail loudly instead of hanging ctest
  }
  return f.get();
}

void expect_full_table(Table& t, uint32_t world) {
  ASSERT_TRUE(t.ok()) << t.status().to_string();
  ASSERT_EQ(t->size(), world);
  for (uint32_t r = 0; r < world; ++r) {
    EXPECT_EQ((*t)[r].address, address_of(r));
    EXPECT_NE((*t)[r].label.find("test-rank-" + std::to_string(r)), std::string::npos) << (*t)[r].label;
  }
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

TEST(RendezvousTest, FourRanksGetTheSameTable) {
  Leader leader = start_leader(4, 11);
  std::vector<std::future<Table>> others;
  for (uint32_t r = 1; r < 4; ++r) others.push_back(start_rank(r, 4, 11, leader.coordinator));
  Table t0 = await(leader.result);
  expect_full_table(t0, 4);
  for (auto& f : others) {
    Table t = await(f);
    expect_full_table(t, 4);
  }
}

TEST(RendezvousTest, WorldOfOneNeedsNoCoordinator) {
  Table t = run(options(0, 1, 1, "unused:1"), address_of(0));
  expect_full_table(t, 1);
}

TEST(RendezvousTest, WrongWorldSizeAndJobIdAreRefusedThenTheJobCompletes) {
  Leader leader = start_leader(2, 7);
  auto bad_world = start_rank(1, 3, 7, leader.coordinator);
  Table t = await(bad_world);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(t.status().message().find("world size 3 but rank 0 has 2"), std::string::npos) << t.status().message();

  auto bad_job = start_rank(1, 2, 8, leader.coordinator);
  t = await(bad_job);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(t.status().message().find("job id 8 but rank 0 runs job 7"), std::string::npos) << t.status().message();

  auto good = start_rank(1, 2, 7, leader.coordinator);
  Table t1 = await(good);
  expect_full_table(t1, 2);
  Table t0 = await(leader.result);
  expect_full_table(t0, 2);
}

// Connects to the leader, sends `bytes`, returns everything it answers until it closes.
std::string exchange_raw(const std::string& coordinator, const std::string& bytes) {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  a.sin_port = htons(static_cast<uint16_t>(std::stoi(coordinator.substr(coordinator.rfind(':') + 1))));
  timeval tv{10, 0};  // bound every read
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  EXPECT_EQ(::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  EXPECT_EQ(::write(fd, bytes.data(), bytes.size()), static_cast<ssize_t>(bytes.size()));
  std::string reply;
  char buf[256];
  ssize_t n;
  while ((n = ::read(fd, buf, sizeof buf)) > 0) reply.append(buf, static_cast<size_t>(n));
  ::close(fd);
  return reply;
}

std::string le(uint64_t v, int bytes) {
  std::string out;
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
  return out;
}

TEST(RendezvousTest, RankOutOfRangeIsRefused) {
  Leader leader = start_leader(2, 7);
  // A hand-written hello (protocol v1 of rendezvous.h) claiming rank 5 of a world of 2.
  std::string hello = le(0x5A524353, 4) + le(1, 2) + le(0, 2) + le(7, 8) + le(2, 4) + le(5, 4) + le(0, 4) +
                      le(1, 4) + "x";
  std::string reply = exchange_raw(leader.coordinator, hello);
  ASSERT_GE(reply.size(), 12u);
  EXPECT_EQ(reply.substr(0, 4), le(0x5A524353, 4));
  EXPECT_EQ(reply.substr(4, 4), le(1, 4)) << "verdict must be 'refused'";
  EXPECT_NE(reply.find("rank must be in 1..1"), std::string::npos) << reply;

  auto good = start_rank(1, 2, 7, leader.coordinator);
  Table t1 = await(good);
  expect_full_table(t1, 2);
  Table t0 = await(leader.result);
  expect_full_table(t0, 2);
}

TEST(RendezvousTest, DuplicateRankIsRefused) {
  Leader leader = start_leader(3, 5);
  auto first = start_rank(1, 3, 5, leader.coordinator);
  auto second = start_rank(1, 3, 5, leader.coordinator);
  // The job cannot complete without rank 2, so the first of the two to return is the refused
  // duplicate.
  std::future<Table>* refused = nullptr;
  std::future<Table>* accepted = nullptr;
  const auto until = std::chrono::steady_clock::now() + kWait;
  while (refused == nullptr && std::chrono::steady_clock::now() < until) {
    if (first.wait_for(10ms) == std::future_status::ready) {
      refused = &first;
      accepted = &second;
    } else if (second.wait_for(10ms) == std::future_status::ready) {
      refused = &second;
      accepted = &first;
    }
  }
  ASSERT_NE(refused, nullptr) << "neither duplicate was refused";
  Table t = refused->get();
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(t.status().message().find("already joined"), std::string::npos) << t.status().message();

  auto third = start_rank(2, 3, 5, leader.coordinator);
  Table t2 = await(third);
  expect_full_table(t2, 3);
  Table t1 = await(*accepted);
  expect_full_table(t1, 3);
  Table t0 = await(leader.result);
  expect_full_table(t0, 3);
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
  Table t = run(options(1, 2, 1, "127.0.0.1:" + std::to_string(dead.port), 400ms), address_of(1));
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
  Table t = await(leader.result);
  const auto took = std::chrono::steady_clock::now() - begin;
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), Code::kDeadlineExceeded);
  EXPECT_NE(t.status().message().find("missing rank(s) 1, 2"), std::string::npos) << t.status().message();
  EXPECT_LT(took, 3s);
}

TEST(RendezvousTest, GarbageClientIsRefusedAndTheJobStillCompletes) {
  Leader leader = start_leader(2, 3);
  std::string reply = exchange_raw(leader.coordinator, std::string("GET / HTTP/1.0\r\n\r\n") + std::string(40, ' '));
  ASSERT_GE(reply.size(), 12u);
  EXPECT_EQ(reply.substr(4, 4), le(1, 4)) << "verdict must be 'refused'";
  EXPECT_NE(reply.find("bad magic"), std::string::npos) << reply;
  auto good = start_rank(1, 2, 3, leader.coordinator);
  Table t1 = await(good);
  expect_full_table(t1, 2);
  Table t0 = await(leader.result);
  expect_full_table(t0, 2);
}

}  // namespace
}  // namespace sparsecar::rendezvous
