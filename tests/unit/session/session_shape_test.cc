// Tensor shapes at registration: the client API and C ABI, the RegisterShaped message, the
// daemon's validation (product, dims, unused fields), agreement between local clients, and the
// old shapeless path (Register) unchanged.
#include <gtest/gtest.h>

#include "daemon/session/session_server.h"
#include "sparsecar/client.h"
#include "sparsecar/sparsecar.h"
#include "tests/unit/session/session_test_util.h"

namespace sparsecar {
namespace {

using namespace std::chrono_literals;
using testing::FakePipeline;
using testing::RawSession;
using testing::TempSocket;

class SessionShapeTest : public ::testing::Test {
 protected:
  void start(uint32_t local_clients) {
    pipeline_ = std::make_unique<FakePipeline>(FakePipeline::Mode::kHalf);
    SessionServerOptions options;
    options.socket_path = sock_.path();
    options.local_clients = local_clients;
    auto server = SessionServer::start(options, pipeline_.get());
    ASSERT_TRUE(server.ok()) << server.status().to_string();
    server_ = std::move(server).value();
    pipeline_->attach(server_.get());
  }
  std::unique_ptr<Client> connect() {
    auto c = Client::connect(sock_.path(), ConnectOptions{2000ms});
    EXPECT_TRUE(c.ok()) << c.status().to_string();
    return c.ok() ? std::move(c).value() : nullptr;
  }
  std::vector<TensorSpec> specs() {
    std::lock_guard<std::mutex> lock(pipeline_->mu_);
    return pipeline_->specs;
  }
  void TearDown() override {
    if (server_) server_->stop();
  }

  TempSocket sock_;
  std::unique_ptr<FakePipeline> pipeline_;
  std::unique_ptr<SessionServer> server_;
};

TEST_F(SessionShapeTest, ShapeReachesThePipelineAndTheOldSignatureStillWorks) {
  start(1);
  auto client = connect();
  ASSERT_NE(client, nullptr);
  auto conv = client->register_tensor("conv1.weight", 64 * 3 * 3 * 3, DType::kF32, {64, 3, 3, 3});
  ASSERT_TRUE(conv.ok()) << conv.status().to_string();
  auto bias = client->register_tensor("conv1.bias", 64);  // the v1 signature: no shape
  ASSERT_TRUE(bias.ok()) << bias.status().to_string();
  auto fc = client->register_tensor("fc.weight", 50, DType::kF32, {10, 5});
  ASSERT_TRUE(fc.ok());
  EXPECT_EQ((*conv)->shape(), (std::vector<uint64_t>{64, 3, 3, 3}));
  EXPECT_TRUE((*bias)->shape().empty());
  auto seen = specs();
  ASSERT_EQ(seen.size(), 3u);
  EXPECT_EQ(seen[0].shape, (std::vector<uint64_t>{64, 3, 3, 3}));
  EXPECT_EQ(seen[0].count, 64u * 27u);
  EXPECT_TRUE(seen[1].shape.empty());
  EXPECT_EQ(seen[2].shape, (std::vector<uint64_t>{10, 5}));
  // Registering again with the same shape returns the same tensor; another shape is refused.
  auto again = client->register_tensor("fc.weight", 50, DType::kF32, {10, 5});
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *fc);
  auto other = client->register_tensor("fc.weight", 50, DType::kF32, {5, 10});
  ASSERT_FALSE(other.ok());
  EXPECT_EQ(other.status().code(), Code::kInvalidArgument);
  // Steps run as before.
  for (size_t i = 0; i < 50; ++i) (*fc)->data()[i] = static_cast<float>(i);
  ASSERT_TRUE(client->submit(**fc, 1).ok());
  ASSERT_TRUE(client->wait(**fc, 1, 5000ms).ok());
  EXPECT_EQ((*fc)->data()[10], 5.0f);
}

TEST_F(SessionShapeTest, TheClientRejectsBadShapesBeforeAskingTheDaemon) {
  start(1);
  auto client = connect();
  ASSERT_NE(client, nullptr);
  struct Case {
    const char* what;
    size_t count;
    std::vector<uint64_t> shape;
  };
  const Case cases[] = {
      {"product mismatch", 12, {3, 5}},
      {"too many dims", 32, {2, 2, 2, 2, 2}},
      {"zero dim", 0 + 12, {12, 0}},
      {"overflowing product", 12, {uint64_t{1} << 40, uint64_t{1} << 40}},
  };
  for (const Case& c : cases) {
    auto t = client->register_tensor("w", c.count, DType::kF32, c.shape);
    ASSERT_FALSE(t.ok()) << c.what;
    EXPECT_EQ(t.status().code(), Code::kInvalidArgument) << c.what;
  }
  EXPECT_EQ(server_->stats().registrations_rejected, 0u);  // nothing reached the daemon
  EXPECT_TRUE(client->register_tensor("w", 12, DType::kF32, {3, 4}).ok());
}

TEST_F(SessionShapeTest, TheDaemonValidatesRegisterShaped) {
  start(1);
  RawSession raw;
  ASSERT_TRUE(raw.connect(sock_.path()));
  ASSERT_EQ(raw.handshake(), 0);
  auto message = [](uint64_t count, std::vector<uint64_t> dims, uint32_t ndim) {
    proto::RegisterShaped m{};
    m.count = count;
    m.ndim = ndim;
    for (size_t i = 0; i < dims.size() && i < proto::kMaxShapeDims; ++i) m.dims[i] = dims[i];
    proto::set_field(m.name, sizeof m.name, "w");
    return m;
  };
  struct Case {
    const char* what;
    proto::RegisterShaped m;
    const char* says;
  };
  const Case cases[] = {
      {"product mismatch", message(12, {3, 5}, 2), "holds 15 elements, not 12"},
      {"too many dims", message(16, {2, 2, 2, 2}, 5), "5 dims"},
      {"no dims", message(16, {}, 0), "0 dims"},
      {"zero dim", message(12, {12, 0}, 2), "dim of 0"},
      {"unused dim set", message(12, {3, 4, 7}, 2), "unused dims"},
      {"overflow", message(12, {uint64_t{1} << 40, uint64_t{1} << 40}, 2), "2^64"},
  };
  uint64_t rejected = 0;
  for (const Case& c : cases) {
    proto::RegisterAck ack = raw.register_raw(c.m);
    EXPECT_EQ(ack.status, int32_t(Code::kInvalidArgument)) << c.what;
    EXPECT_NE(std::string(ack.message).find(c.says), std::string::npos) << c.what << ": " << ack.message;
    EXPECT_EQ(server_->stats().registrations_rejected, ++rejected);
  }
  // The session stays usable and a good shape registers.
  proto::RegisterAck ack = raw.register_raw(message(12, {3, 4}, 2));
  ASSERT_EQ(ack.status, 0) << ack.message;
  EXPECT_EQ(ack.count, 12u);
  // The old message still registers a shapeless tensor on the same session.
  proto::Register old{};
  old.count = 7;
  proto::set_field(old.name, sizeof old.name, "b");
  ack = raw.register_raw(old);
  ASSERT_EQ(ack.status, 0) << ack.message;
  auto seen = specs();
  ASSERT_EQ(seen.size(), 2u);
  EXPECT_EQ(seen[0].shape, (std::vector<uint64_t>{3, 4}));
  EXPECT_TRUE(seen[1].shape.empty());
}

TEST_F(SessionShapeTest, LocalClientsMustAgreeOnTheShape) {
  start(2);
  auto a = connect();
  auto b = connect();
  ASSERT_TRUE(a && b);
  ASSERT_TRUE(a->register_tensor("w", 100, DType::kF32, {10, 10}).ok());
  for (const std::vector<uint64_t>& shape : {std::vector<uint64_t>{20, 5}, std::vector<uint64_t>{}}) {
    auto r = b->register_tensor("w", 100, DType::kF32, shape);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument);
    EXPECT_NE(r.status().message().find("registered with shape [10, 10]"), std::string::npos)
        << r.status().message();
  }
  EXPECT_EQ(server_->stats().registrations_rejected, 2u);
  EXPECT_TRUE(b->register_tensor("w", 100, DType::kF32, {10, 10}).ok());
}

TEST_F(SessionShapeTest, CAbiRegistersShapes) {
  start(1);
  sc_client* client = nullptr;
  ASSERT_EQ(sc_connect(sock_.path().c_str(), 2000, &client), SC_OK) << sc_last_error();
  EXPECT_GE(sc_abi_version(), 2);
  const uint64_t shape[] = {4, 2, 3};
  sc_tensor* t = nullptr;
  ASSERT_EQ(sc_register_tensor_shaped(client, "t", 24, SC_DTYPE_F32, shape, 3, &t), SC_OK)
      << sc_client_last_error(client);
  EXPECT_EQ(sc_tensor_ndim(t), 3u);
  EXPECT_EQ(sc_tensor_dim(t, 0), 4u);
  EXPECT_EQ(sc_tensor_dim(t, 2), 3u);
  EXPECT_EQ(sc_tensor_dim(t, 3), 0u);
  sc_tensor* plain = nullptr;
  ASSERT_EQ(sc_register_tensor(client, "p", 5, SC_DTYPE_F32, &plain), SC_OK);
  EXPECT_EQ(sc_tensor_ndim(plain), 0u);
  sc_tensor* bad = nullptr;
  const uint64_t five[] = {1, 1, 1, 1, 24};
  EXPECT_EQ(sc_register_tensor_shaped(client, "x", 24, SC_DTYPE_F32, five, 5, &bad), SC_INVALID_ARGUMENT);
  EXPECT_EQ(bad, nullptr);
  EXPECT_EQ(sc_register_tensor_shaped(client, "x", 24, SC_DTYPE_F32, nullptr, 2, &bad), SC_INVALID_ARGUMENT);
  const uint64_t wrong[] = {5, 5};
  EXPECT_EQ(sc_register_tensor_shaped(client, "x", 24, SC_DTYPE_F32, wrong, 2, &bad), SC_INVALID_ARGUMENT);
  EXPECT_NE(std::string(sc_client_last_error(client)).find("does not hold 24"), std::string::npos);
  EXPECT_EQ(sc_tensor_ndim(nullptr), 0u);
  sc_client_close(client);
}

}  // namespace
}  // namespace sparsecar
