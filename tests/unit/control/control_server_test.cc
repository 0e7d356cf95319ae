// The ZeroMQ control socket: ipc:// with a lock file and mode 0600, DEALER and REQ clients,
// oversized requests answered with TOO_LARGE, tcp:// refused without a token or CURVE key and
// served with either.
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <zmq.hpp>

#include "daemon/control/client.h"
#include "daemon/control/control_server.h"

namespace sparsecar::control {
namespace {

using json = nlohmann::json;
using namespace std::chrono_literals;

ClientOptions at(std::string endpoint, std::string token = "", std::string curve_key = "",
                 std::chrono::milliseconds timeout = 10000ms) {
  ClientOptions o;
  o.endpoint = std::move(endpoint);
  o.token = std::move(token);
  o.curve_server_key = std::move(curve_key);
  o.timeout = timeout;
  return o;
}

class EchoBackend final : public ControlBackend {
 public:
  EchoBackend() { decision.config = std::make_shared<const Config>(); }
  json status() override { return json{{"rank", 0}, {"calls", ++calls}}; }
  Decision latest_decision() override { return decision; }
  Expected<Decision> propose(const KnobChanges&, const std::string&) override { return decision; }
  Status report_metric(const std::string&, double, uint64_t) override { return Status::Ok(); }
  Expected<json> drain(std::chrono::milliseconds, bool) override { return json::object(); }
  Expected<json> checkpoint(const std::string&) override { return json::object(); }
  Expected<json> restore(const std::string&) override { return json::object(); }
  Decision decision;
  int calls = 0;
};

class ControlServerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    char tmpl[] = "/tmp/sparsecar-ctl-XXXXXX";
    dir_ = ::mkdtemp(tmpl);
    endpoint_ = "ipc://" + dir_ + "/control.sock";
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }

  std::string dir_, endpoint_;
  EchoBackend backend_;
  Dispatcher dispatcher_{&backend_, nullptr};
};

TEST_F(ControlServerTest, ServesIpcOwnerOnlyAndCleansUp) {
  ControlServerOptions o;
  o.endpoint = endpoint_;
  o.poll_interval = 20ms;
  auto server = ControlServer::start(o, &dispatcher_);
  ASSERT_TRUE(server.ok()) << server.status().to_string();
  struct stat st{};
  ASSERT_EQ(::stat((dir_ + "/control.sock").c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u);

  auto client = ControlClient::connect(at(endpoint_));
  ASSERT_TRUE(client.ok()) << client.status().to_string();
  for (int i = 1; i <= 3; ++i) {
    auto reply = (*client)->call("status");
    ASSERT_TRUE(reply.ok()) << reply.status().to_string();
    EXPECT_TRUE((*reply)["ok"].get<bool>());
    EXPECT_EQ((*reply)["result"]["calls"], i);
  }
  EXPECT_EQ(::stat((dir_ + "/control.sock.lock").c_str(), &st), 0) << "the lock is taken while serving";
  (*server)->stop();
  EXPECT_NE(::stat((dir_ + "/control.sock").c_str(), &st), 0) << "socket file left behind";
  EXPECT_NE(::stat((dir_ + "/control.sock.lock").c_str(), &st), 0) << "lock file left behind";
}

TEST_F(ControlServerTest, SecondBindIsRefusedByTheLock) {
  ControlServerOptions o;
  o.endpoint = endpoint_;
  auto first = ControlServer::start(o, &dispatcher_);
  ASSERT_TRUE(first.ok());
  auto second = ControlServer::start(o, &dispatcher_);
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), Code::kFailedPrecondition);
  EXPECT_NE(second.status().message().find("another process"), std::string::npos);
  // The first server still answers: nobody stole its path.
  auto client = ControlClient::connect(at(endpoint_));
  ASSERT_TRUE(client.ok());
  auto reply = (*client)->call("status");
  ASSERT_TRUE(reply.ok()) << reply.status().to_string();
  // The refused server removed nothing of the first one's.
  struct stat st{};
  EXPECT_EQ(::stat((dir_ + "/control.sock.lock").c_str(), &st), 0) << "the live server's lock was removed";
  (*first)->stop();
  // Once released, a new server may take it.
  auto third = ControlServer::start(o, &dispatcher_);
  EXPECT_TRUE(third.ok()) << third.status().to_string();
}

TEST_F(ControlServerTest, ReqClientsAndOversizedRequests) {
  ControlServerOptions o;
  o.endpoint = endpoint_;
  o.max_message_bytes = 2048;
  Dispatcher small(&backend_, nullptr, DispatcherOptions{2048, ""});
  auto server = ControlServer::start(o, &small);
  ASSERT_TRUE(server.ok());
  zmq::context_t ctx;
  zmq::socket_t req(ctx, zmq::socket_type::req);
  req.set(zmq::sockopt::linger, 0);
  req.set(zmq::sockopt::rcvtimeo, 5000);
  req.connect(endpoint_);
  std::string request = make_request(json("r1"), "status", json::object());
  ASSERT_TRUE(req.send(zmq::buffer(request)));
  zmq::message_t reply;
  ASSERT_TRUE(req.recv(reply));
  json r = json::parse(reply.to_string());
  EXPECT_EQ(r["id"], "r1");
  EXPECT_TRUE(r["ok"].get<bool>());

  auto client = ControlClient::connect(at(endpoint_));
  ASSERT_TRUE(client.ok());
  auto big = (*client)->call_raw(std::string(4000, '{'));
  ASSERT_TRUE(big.ok()) << big.status().to_string();
  EXPECT_EQ(json::parse(*big)["error"]["code"], "TOO_LARGE");
  // Still serving afterwards.
  EXPECT_TRUE((*client)->call("status").ok());
}

// Requests of a megabyte and more used to exceed ZMQ_MAXMSGSIZE (16 x the default limit = 1 MiB)
// and were dropped without a reply; below the hard cap they are answered TOO_LARGE now.
TEST_F(ControlServerTest, MegabyteRequestsGetATooLargeReplyNamingTheLimit) {
  ControlServerOptions o;
  o.endpoint = endpoint_;  // default max_message_bytes (control_max_message_bytes' default)
  Dispatcher dispatcher(&backend_, nullptr, DispatcherOptions{});
  auto server = ControlServer::start(o, &dispatcher);
  ASSERT_TRUE(server.ok());
  auto client = ControlClient::connect(at(endpoint_));
  ASSERT_TRUE(client.ok());
  for (size_t bytes : {size_t{1} << 20, (size_t{1} << 20) + 1, size_t{4} << 20, hard_cap_bytes(o.max_message_bytes)}) {
    auto big = (*client)->call_raw(std::string(bytes, ' '), std::chrono::milliseconds(5000));
    ASSERT_TRUE(big.ok()) << bytes << ": " << big.status().to_string();
    json r = json::parse(*big);
    EXPECT_EQ(r["error"]["code"], "TOO_LARGE");
    EXPECT_EQ(r["error"]["message"], "request of " + std::to_string(bytes) +
                                         " bytes exceeds control_max_message_bytes = " +
                                         std::to_string(kDefaultMaxMessageBytes));
  }
  EXPECT_TRUE((*client)->call("status").ok());
  // Above the hard cap libzmq drops the frame: the client times out and says why that may be.
  auto huge = ControlClient::connect(at(endpoint_));
  ASSERT_TRUE(huge.ok());
  auto dropped = (*huge)->call_raw(std::string(hard_cap_bytes(o.max_message_bytes) + 1, ' '),
                                   std::chrono::milliseconds(500));
  ASSERT_FALSE(dropped.ok());
  EXPECT_NE(dropped.status().message().find("without a reply"), std::string::npos) << dropped.status().message();
}

TEST_F(ControlServerTest, ClientErrorsAreValuesNotHangs) {
  auto missing = ControlClient::connect(at("ipc://" + dir_ + "/nobody.sock"));
  EXPECT_FALSE(missing.ok());
  // A socket file with nobody answering: the call times out.
  ControlServerOptions o;
  o.endpoint = endpoint_;
  {
    auto server = ControlServer::start(o, &dispatcher_);
    ASSERT_TRUE(server.ok());
    auto client = ControlClient::connect(at(endpoint_, "", "", 300ms));
    ASSERT_TRUE(client.ok());
    (*server)->stop();
    auto t0 = std::chrono::steady_clock::now();
    auto reply = (*client)->call("status");
    EXPECT_FALSE(reply.ok());
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 3s);
  }
}

TEST_F(ControlServerTest, TcpNeedsATokenOrCurve) {
  ControlServerOptions o;
  o.endpoint = "tcp://127.0.0.1:0";
  auto refused = ControlServer::start(o, &dispatcher_);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), Code::kPermissionDenied);

  o.token = "0123456789abcdef-token";
  Dispatcher with_token(&backend_, nullptr, DispatcherOptions{kDefaultMaxMessageBytes, o.token});
  auto server = ControlServer::start(o, &with_token);
  ASSERT_TRUE(server.ok()) << server.status().to_string();
  EXPECT_NE((*server)->endpoint().find("tcp://127.0.0.1:"), std::string::npos);
  auto anonymous = ControlClient::connect(at((*server)->endpoint()));
  ASSERT_TRUE(anonymous.ok());
  auto r = (*anonymous)->call("status");
  ASSERT_TRUE(r.ok());
  EXPECT_EQ((*r)["error"]["code"], "UNAUTHENTICATED");
  auto authed = ControlClient::connect(at((*server)->endpoint(), o.token));
  ASSERT_TRUE(authed.ok());
  r = (*authed)->call("status");
  ASSERT_TRUE(r.ok());
  EXPECT_TRUE((*r)["ok"].get<bool>());
}

TEST_F(ControlServerTest, TcpWithCurve) {
  if (!zmq_has("curve")) GTEST_SKIP() << "libzmq without CURVE";
  char pub[41], sec[41];
  ASSERT_EQ(zmq_curve_keypair(pub, sec), 0);
  ControlServerOptions o;
  o.endpoint = "tcp://127.0.0.1:0";
  o.curve_secret_key = sec;
  auto server = ControlServer::start(o, &dispatcher_);
  ASSERT_TRUE(server.ok()) << server.status().to_string();
  auto client = ControlClient::connect(at((*server)->endpoint(), "", pub, 5000ms));
  ASSERT_TRUE(client.ok());
  auto r = (*client)->call("status");
  ASSERT_TRUE(r.ok()) << r.status().to_string();
  EXPECT_TRUE((*r)["ok"].get<bool>());
  // A plain-text client gets nothing (the handshake fails), within its deadline.
  auto plain = ControlClient::connect(at((*server)->endpoint(), "", "", 300ms));
  ASSERT_TRUE(plain.ok());
  EXPECT_FALSE((*plain)->call("status").ok());
}

TEST(ControlEndpoint, Validation) {
  EXPECT_TRUE(check_endpoint("ipc:///run/x.sock", "", "").ok());
  EXPECT_FALSE(check_endpoint("ipc://relative.sock", "", "").ok());
  EXPECT_FALSE(check_endpoint("ipc:///" + std::string(200, 'a'), "", "").ok());
  EXPECT_EQ(check_endpoint("tcp://0.0.0.0:1", "", "").code(), Code::kPermissionDenied);
  EXPECT_FALSE(check_endpoint("tcp://0.0.0.0:1", "short", "").ok());
  EXPECT_FALSE(check_endpoint("udp://x", "", "").ok());
}

}  // namespace
}  // namespace sparsecar::control
