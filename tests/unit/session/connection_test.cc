// daemon/session/connection.h over a socketpair, without a server: the handshake deadline (times
// as arguments), messages split across reads and several in one read, fds passed with
// SCM_RIGHTS, fds from the client refused, malformed frames, a closed peer, the Hello rules and
// the HelloAck that opens a session.
#include "daemon/session/connection.h"

#include <gtest/gtest.h>

#include <fcntl.h>
#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstring>
#include <vector>

namespace sparsecar {
namespace {

using namespace std::chrono_literals;

template <typename T>
std::vector<uint8_t> message(proto::MsgType type, const T& payload) {
  const proto::MsgHeader h = proto::make_header(type);
  std::vector<uint8_t> out(sizeof h + sizeof payload);
  std::memcpy(out.data(), &h, sizeof h);
  std::memcpy(out.data() + sizeof h, &payload, sizeof payload);
  return out;
}

// Sends `bytes` (and `fd`, when >= 0, as SCM_RIGHTS) from the client's end.
bool send_raw(int sock, const std::vector<uint8_t>& bytes, int fd = -1) {
  iovec iov{const_cast<uint8_t*>(bytes.data()), bytes.size()};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int))] = {};
  if (fd >= 0) {
    msg.msg_control = cbuf;
    msg.msg_controllen = sizeof cbuf;
    cmsghdr* cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int));
    std::memcpy(CMSG_DATA(cm), &fd, sizeof fd);
  }
  return ::sendmsg(sock, &msg, MSG_NOSIGNAL) == static_cast<ssize_t>(bytes.size());
}

// Reads one message at the client's end: the header, the payload and the fds that came with it.
struct Received {
  proto::MsgHeader header{};
  std::vector<uint8_t> payload;
  std::vector<int> fds;
};
bool receive_raw(int sock, Received* out) {
  uint8_t buf[proto::kMaxMessageBytes];
  iovec iov{buf, sizeof buf};
  alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int) * 8)];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = cbuf;
  msg.msg_controllen = sizeof cbuf;
  ssize_t n = ::recvmsg(sock, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (n < static_cast<ssize_t>(sizeof(proto::MsgHeader))) return false;
  std::memcpy(&out->header, buf, sizeof out->header);
  out->payload.assign(buf + sizeof out->header, buf + n);
  for (cmsghdr* cm = CMSG_FIRSTHDR(&msg); cm != nullptr; cm = CMSG_NXTHDR(&msg, cm)) {
    size_t nfds = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
    for (size_t k = 0; k < nfds; ++k) {
      int fd;
      std::memcpy(&fd, CMSG_DATA(cm) + k * sizeof(int), sizeof fd);
      out->fds.push_back(fd);
    }
  }
  return true;
}

class ConnectionTest : public ::testing::Test {
 protected:
  void SetUp() override {
    int sv[2];
    ASSERT_EQ(::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv), 0);
    conn_ = std::make_unique<Connection>(5, Fd(sv[0]), ::getpid(), ::geteuid(), accepted_);
    peer_.reset(sv[1]);
  }
  // The messages conn_ delivers from one receive().
  std::vector<proto::MsgType> receive(std::optional<std::string>* error = nullptr) {
    std::vector<proto::MsgType> got;
    auto e = conn_->receive([&](const proto::MsgHeader& h, const uint8_t*) {
      got.push_back(static_cast<proto::MsgType>(h.type));
    });
    if (error != nullptr) *error = e;
    return got;
  }

  Clock::time_point accepted_ = Clock::time_point(1h);
  std::unique_ptr<Connection> conn_;
  Fd peer_;
};

TEST_F(ConnectionTest, LabelNamesTheClientAndItsPid) {
  EXPECT_EQ(conn_->label(), "client 5 (pid " + std::to_string(::getpid()) + ")");
}

TEST_F(ConnectionTest, TheHandshakeIsOverdueOnlyAfterTheTimeoutAndOnlyBeforeHello) {
  EXPECT_FALSE(conn_->handshake_overdue(accepted_ + 2000ms, 2000ms));
  EXPECT_TRUE(conn_->handshake_overdue(accepted_ + 2001ms, 2000ms));
  proto::Hello hello{};
  hello.version = proto::kProtocolVersion;
  hello.shm_version = shm::kShmVersion;
  ASSERT_TRUE(conn_->check_hello(hello).ok());
  ASSERT_TRUE(conn_->open_session(2).ok());
  ASSERT_TRUE(conn_->ready());
  EXPECT_FALSE(conn_->handshake_overdue(accepted_ + 1h, 2000ms));
}

TEST_F(ConnectionTest, DeliversWholeMessagesWhateverTheReadsSplit) {
  proto::Hello hello{};
  proto::Metric metric{};
  std::vector<uint8_t> bytes = message(proto::MsgType::kHello, hello);
  std::vector<uint8_t> second = message(proto::MsgType::kMetric, metric);
  bytes.insert(bytes.end(), second.begin(), second.end());
  const size_t cut = bytes.size() - 3;  // the Metric's last 3 bytes come later
  ASSERT_TRUE(send_raw(peer_.get(), std::vector<uint8_t>(bytes.begin(), bytes.begin() + cut)));
  EXPECT_EQ(receive(), std::vector<proto::MsgType>{proto::MsgType::kHello});
  ASSERT_TRUE(send_raw(peer_.get(), std::vector<uint8_t>(bytes.begin() + cut, bytes.end())));
  EXPECT_EQ(receive(), std::vector<proto::MsgType>{proto::MsgType::kMetric});
  EXPECT_FALSE(conn_->dropped());
}

TEST_F(ConnectionTest, FdsFromTheClientAreAProtocolErrorAndAreClosed) {
  int pipefd[2];
  ASSERT_EQ(::pipe2(pipefd, O_CLOEXEC), 0);
  proto::Metric metric{};
  ASSERT_TRUE(send_raw(peer_.get(), message(proto::MsgType::kMetric, metric), pipefd[0]));
  ::close(pipefd[0]);
  std::optional<std::string> error;
  EXPECT_TRUE(receive(&error).empty());
  ASSERT_TRUE(error.has_value());
  EXPECT_EQ(*error, "client sent file descriptors");
  // The received copy was closed too: the pipe has no reader left (POLLERR on its write end).
  pollfd p{pipefd[1], POLLOUT, 0};
  ASSERT_EQ(::poll(&p, 1, 0), 1);
  EXPECT_TRUE(p.revents & POLLERR);
  ::close(pipefd[1]);
}

TEST_F(ConnectionTest, AMalformedHeaderStopsTheReading) {
  proto::Hello hello{};
  std::vector<uint8_t> bytes = message(proto::MsgType::kHello, hello);
  bytes[0] ^= 0xff;  // magic
  ASSERT_TRUE(send_raw(peer_.get(), bytes));
  std::optional<std::string> error;
  EXPECT_TRUE(receive(&error).empty());
  ASSERT_TRUE(error.has_value());
  EXPECT_EQ(*error, "bad magic");
}

TEST_F(ConnectionTest, APeerThatClosesIsDropped) {
  peer_.reset();
  std::optional<std::string> error;
  EXPECT_TRUE(receive(&error).empty());
  EXPECT_FALSE(error.has_value());
  EXPECT_TRUE(conn_->dropped());
  EXPECT_EQ(conn_->drop_reason(), "closed the connection");
  conn_->mark_drop("second reason");
  EXPECT_EQ(conn_->drop_reason(), "closed the connection");  // the first reason sticks
}

TEST_F(ConnectionTest, HelloRules) {
  proto::Hello hello{};
  hello.version = proto::kProtocolVersion;
  hello.shm_version = shm::kShmVersion;
  EXPECT_TRUE(conn_->check_hello(hello).ok());
  proto::Hello old = hello;
  old.version = proto::kProtocolVersion + 1;
  EXPECT_EQ(conn_->check_hello(old).code(), Code::kFailedPrecondition);
  proto::Hello shm = hello;
  shm.shm_version = shm::kShmVersion + 1;
  EXPECT_EQ(conn_->check_hello(shm).code(), Code::kFailedPrecondition);
  proto::Hello flags = hello;
  flags.flags = 2;
  EXPECT_EQ(conn_->check_hello(flags).code(), Code::kInvalidArgument);
}

TEST_F(ConnectionTest, RefusingAHelloAnswersWithTheStatusAndDrops) {
  conn_->refuse_hello(resource_exhausted("the daemon already serves its 1 local clients"));
  Received r;
  ASSERT_TRUE(receive_raw(peer_.get(), &r));
  EXPECT_EQ(r.header.type, static_cast<uint16_t>(proto::MsgType::kHelloAck));
  proto::HelloAck ack;
  ASSERT_EQ(r.payload.size(), sizeof ack);
  std::memcpy(&ack, r.payload.data(), sizeof ack);
  EXPECT_EQ(ack.status, static_cast<int32_t>(Code::kResourceExhausted));
  EXPECT_EQ(proto::field_string(ack.message, sizeof ack.message).value_or(""),
            "the daemon already serves its 1 local clients");
  EXPECT_TRUE(r.fds.empty());
  EXPECT_TRUE(conn_->dropped());
}

TEST_F(ConnectionTest, OpeningASessionSendsTheControlMappingAndTwoEventfds) {
  ASSERT_TRUE(conn_->open_session(3).ok());
  EXPECT_TRUE(conn_->ready());
  Received r;
  ASSERT_TRUE(receive_raw(peer_.get(), &r));
  proto::HelloAck ack;
  ASSERT_EQ(r.payload.size(), sizeof ack);
  std::memcpy(&ack, r.payload.data(), sizeof ack);
  EXPECT_EQ(ack.status, 0);
  EXPECT_EQ(ack.client_id, 5u);
  EXPECT_EQ(ack.local_clients, 3u);
  EXPECT_EQ(ack.control_bytes, shm::kControlBytes);
  ASSERT_EQ(r.fds.size(), proto::kHelloFds);
  // The control memfd is sealed against resizing and maps what the daemon initialised.
  EXPECT_EQ(::fcntl(r.fds[0], F_GET_SEALS) & (F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL),
            F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL);
  void* addr = ::mmap(nullptr, shm::kControlBytes, PROT_READ | PROT_WRITE, MAP_SHARED, r.fds[0], 0);
  ASSERT_NE(addr, MAP_FAILED);
  auto* ctl = static_cast<shm::ShmControl*>(addr);
  // A completion posted by the daemon shows up in the client's mapping and wakes its eventfd.
  shm::Completion comp{};
  comp.tensor_id = 7;
  comp.step = 11;
  ASSERT_TRUE(conn_->post_completion(comp));
  shm::Completion got{};
  bool corrupt = false;
  ASSERT_TRUE(shm::ring_pop(ctl->completions, &got, &corrupt));
  EXPECT_EQ(got.tensor_id, 7u);
  EXPECT_EQ(got.step, 11u);
  uint64_t wakeups = 0;
  EXPECT_EQ(::read(r.fds[2], &wakeups, sizeof wakeups), static_cast<ssize_t>(sizeof wakeups));
  EXPECT_EQ(wakeups, 1u);
  ::munmap(addr, shm::kControlBytes);
  for (int fd : r.fds) ::close(fd);
}

}  // namespace
}  // namespace sparsecar
