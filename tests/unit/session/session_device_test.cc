// Device tensors through the session socket (RegisterDevice) with a fake DeviceRuntime: the
// client API and C ABI, the StepJob the pipeline gets, the daemon's refusals (no CUDA/GPU, a
// handle that does not open, malformed fields, host and device mixed) as the client's error
// values, and the session staying usable after a refusal.
#include <gtest/gtest.h>

#include <atomic>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "daemon/device/device_runtime.h"
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

// Opens every region as a recognisable fake pointer (0x10000 * client + offset); `refuse` makes
// available() fail, `open_error` makes open() fail. Counts the keepalives alive.
class FakeDeviceRuntime : public DeviceRuntime {
 public:
  Status available() const override {
    std::lock_guard<std::mutex> lock(mu);
    return refuse;
  }
  Expected<OpenedDevice> open(uint32_t client, const DeviceRegion& region) override {
    std::lock_guard<std::mutex> lock(mu);
    if (!open_error.ok()) return open_error;
    opened.emplace_back(client, region);
    OpenedDevice d;
    d.buffer.data = reinterpret_cast<float*>(uintptr_t{0x10000} * client + region.offset);
    d.buffer.device = 0;
    d.buffer.ready_event = reinterpret_cast<void*>(uintptr_t{0x100} * client + 1);
    d.buffer.done_event = reinterpret_cast<void*>(uintptr_t{0x100} * client + 2);
    ++*live;
    d.keepalive = std::shared_ptr<const void>(new int(0), [alive = live](const void* p) {
      delete static_cast<const int*>(p);
      --*alive;
    });
    return d;
  }

  mutable std::mutex mu;
  Status refuse;      // guarded by mu
  Status open_error;  // guarded by mu
  std::vector<std::pair<uint32_t, DeviceRegion>> opened;  // guarded by mu
  std::shared_ptr<std::atomic<int>> live = std::make_shared<std::atomic<int>>(0);
};

DeviceHandles handles(uint8_t seed, uint64_t offset = 0) {
  DeviceHandles h;
  for (size_t i = 0; i < h.mem_handle.size(); ++i) {
    h.mem_handle[i] = static_cast<uint8_t>(seed + i);
    h.ready_event[i] = static_cast<uint8_t>(seed + 2 * i);
    h.done_event[i] = static_cast<uint8_t>(seed + 3 * i);
  }
  h.device_uuid.fill(seed);
  h.offset = offset;
  return h;
}

class SessionDeviceTest : public ::testing::Test {
 protected:
  void start(uint32_t local_clients, bool with_runtime = true) {
    pipeline_ = std::make_unique<FakePipeline>(FakePipeline::Mode::kHalf);
    SessionServerOptions options;
    options.socket_path = sock_.path();
    options.local_clients = local_clients;
    auto server = SessionServer::start(options, pipeline_.get(), steady_clock(), with_runtime ? &runtime_ : nullptr);
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
  FakeDeviceRuntime runtime_;
  std::unique_ptr<FakePipeline> pipeline_;
  std::unique_ptr<SessionServer> server_;
};

TEST_F(SessionDeviceTest, RegisteredDeviceTensorsStepWithTheirBuffersInClientOrder) {
  start(2);
  auto a = connect();
  auto b = connect();
  ASSERT_TRUE(a && b);
  const uint64_t shape[] = {4, 8};
  auto ta = a->register_device_tensor("g", 32, handles(1, 256), shape);
  ASSERT_TRUE(ta.ok()) << ta.status().to_string();
  auto tb = b->register_device_tensor("g", 32, handles(2, 512), shape);
  ASSERT_TRUE(tb.ok()) << tb.status().to_string();
  EXPECT_TRUE((*ta)->on_device());
  EXPECT_EQ((*ta)->data(), nullptr);
  EXPECT_EQ((*ta)->shape(), (std::vector<uint64_t>{4, 8}));
  EXPECT_EQ((*ta)->id(), (*tb)->id());
  // The same registration again is the same tensor; other handles are refused by the client.
  auto again = a->register_device_tensor("g", 32, handles(1, 256), shape);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, *ta);
  EXPECT_EQ(a->register_device_tensor("g", 32, handles(9, 256), shape).status().code(), Code::kInvalidArgument);
  {
    std::lock_guard<std::mutex> lock(runtime_.mu);
    ASSERT_EQ(runtime_.opened.size(), 2u);
    EXPECT_EQ(runtime_.opened[0].second.bytes, 128u);
    EXPECT_EQ(runtime_.opened[0].second.offset, 256u);
    EXPECT_EQ(runtime_.opened[0].second.mem_handle, handles(1).mem_handle);
    EXPECT_EQ(runtime_.opened[1].second.done_event, handles(2).done_event);
    EXPECT_EQ(runtime_.opened[1].second.device_uuid, handles(2).device_uuid);
  }
  {
    std::lock_guard<std::mutex> lock(pipeline_->mu_);
    ASSERT_EQ(pipeline_->specs.size(), 1u);
    EXPECT_TRUE(pipeline_->specs[0].on_device);
  }
  EXPECT_EQ(server_->stats().tensor_bytes_in_use, 0u);  // no slot, no host buffers

  ASSERT_TRUE(b->submit(**tb, 1).ok());
  ASSERT_TRUE(a->submit(**ta, 1).ok());
  auto wa = a->wait(**ta, 1, 5000ms);
  auto wb = b->wait(**tb, 1, 5000ms);
  ASSERT_TRUE(wa.ok()) << wa.status().to_string();
  ASSERT_TRUE(wb.ok()) << wb.status().to_string();
  std::lock_guard<std::mutex> lock(pipeline_->mu_);
  ASSERT_EQ(pipeline_->jobs.size(), 1u);
  const auto& job = pipeline_->jobs[0];
  EXPECT_TRUE(job.local_sum.empty());
  EXPECT_TRUE(job.keepalive);
  ASSERT_EQ(job.device.size(), 2u);
  // Client ids follow the connection order: a is 1, b is 2.
  EXPECT_EQ(job.device[0].data, reinterpret_cast<float*>(0x10000 + 256));
  EXPECT_EQ(job.device[1].data, reinterpret_cast<float*>(0x20000 + 512));
  EXPECT_EQ(job.device[1].ready_event, reinterpret_cast<void*>(0x201));
}

TEST_F(SessionDeviceTest, RefusalReachesTheClientAndTheSessionStaysUsable) {
  start(1);
  {
    std::lock_guard<std::mutex> lock(runtime_.mu);
    runtime_.refuse = unavailable("no GPU visible to sparsecard (fake): device tensors are refused");
  }
  auto c = connect();
  ASSERT_TRUE(c);
  auto t = c->register_device_tensor("g", 8, handles(1));
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), Code::kUnavailable);
  EXPECT_NE(t.status().message().find("no GPU visible to sparsecard (fake)"), std::string::npos)
      << t.status().message();
  auto host = c->register_tensor("g", 8);  // the fallback: the same name as a host tensor
  ASSERT_TRUE(host.ok()) << host.status().to_string();
  EXPECT_FALSE((*host)->on_device());
  for (int i = 0; i < 8; ++i) (*host)->data()[i] = 2.0f;
  ASSERT_TRUE(c->submit(**host, 1).ok());
  ASSERT_TRUE(c->wait(**host, 1, 5000ms).ok());
  EXPECT_EQ((*host)->data()[0], 1.0f);
  const SessionStats s = server_->stats();
  EXPECT_EQ(s.registrations_device_refused, 1u);
  EXPECT_EQ(s.registrations_rejected, 1u);
  EXPECT_EQ(s.protocol_errors, 0u);
}

TEST_F(SessionDeviceTest, WithoutARuntimeDeviceTensorsAreUnavailable) {
  start(1, /*with_runtime=*/false);
  auto c = connect();
  ASSERT_TRUE(c);
  auto t = c->register_device_tensor("g", 8, handles(1));
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), Code::kUnavailable);
  EXPECT_NE(t.status().message().find("device tensors are refused"), std::string::npos);
}

TEST_F(SessionDeviceTest, AHandleThatDoesNotOpenIsRefusedAndNothingIsRegistered) {
  start(1);
  {
    std::lock_guard<std::mutex> lock(runtime_.mu);
    runtime_.open_error = not_found("no GPU with UUID GPU-01010101-0101-0101-0101-010101010101 is visible");
  }
  auto c = connect();
  ASSERT_TRUE(c);
  auto t = c->register_device_tensor("g", 8, handles(1));
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), Code::kNotFound);
  EXPECT_NE(t.status().message().find("tensor 'g'"), std::string::npos) << t.status().message();
  EXPECT_NE(t.status().message().find("GPU-0101"), std::string::npos) << t.status().message();
  std::lock_guard<std::mutex> lock(pipeline_->mu_);
  EXPECT_TRUE(pipeline_->specs.empty()) << "a refused device registration registers nothing";
}

TEST_F(SessionDeviceTest, HostAndDeviceOfOneNameAreRefusedNamingBoth) {
  start(2);
  auto a = connect();
  auto b = connect();
  ASSERT_TRUE(a && b);
  ASSERT_TRUE(a->register_tensor("w", 8).ok());
  auto d = b->register_device_tensor("w", 8, handles(1));
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().code(), Code::kInvalidArgument);
  EXPECT_NE(d.status().message().find("host tensor"), std::string::npos) << d.status().message();
  EXPECT_NE(d.status().message().find("GPU tensor"), std::string::npos) << d.status().message();
  std::lock_guard<std::mutex> lock(runtime_.mu);
  EXPECT_TRUE(runtime_.opened.empty()) << "refused before its handles are opened";
}

TEST_F(SessionDeviceTest, MalformedRegisterDeviceFieldsAreRefused) {
  start(1);
  RawSession raw;
  ASSERT_TRUE(raw.connect(sock_.path()));
  ASSERT_EQ(raw.handshake(), 0);
  auto base = [] {
    proto::RegisterDevice m{};
    m.count = 8;
    proto::set_field(m.name, sizeof m.name, "g");
    return m;
  };
  proto::RegisterDevice m = base();
  m.ndim = 5;
  proto::RegisterAck ack = raw.register_raw(m);
  EXPECT_EQ(ack.status, static_cast<int32_t>(Code::kInvalidArgument));
  EXPECT_NE(std::string(ack.message).find("5 dims"), std::string::npos) << ack.message;
  m = base();
  m.flags = 1;
  ack = raw.register_raw(m);
  EXPECT_EQ(ack.status, static_cast<int32_t>(Code::kInvalidArgument));
  EXPECT_NE(std::string(ack.message).find("flags/reserved"), std::string::npos) << ack.message;
  m = base();
  m.offset = 6;
  ack = raw.register_raw(m);
  EXPECT_NE(std::string(ack.message).find("not a multiple of 4"), std::string::npos) << ack.message;
  m = base();
  m.ndim = 2;
  m.dims[0] = 3;
  m.dims[1] = 3;  // 9 != 8
  ack = raw.register_raw(m);
  EXPECT_EQ(ack.status, static_cast<int32_t>(Code::kInvalidArgument));
  m = base();
  m.dtype = 1;
  ack = raw.register_raw(m);
  EXPECT_EQ(ack.status, static_cast<int32_t>(Code::kInvalidArgument));
  EXPECT_NE(std::string(ack.message).find("dtype"), std::string::npos) << ack.message;
  // A good one still works on the same session: no fd, no slot.
  ack = raw.register_raw(base());
  EXPECT_EQ(ack.status, 0) << ack.message;
  EXPECT_EQ(ack.slot_bytes, 0u);
  EXPECT_EQ(ack.count, 8u);
  EXPECT_EQ(server_->stats().protocol_errors, 0u);
  std::lock_guard<std::mutex> lock(runtime_.mu);
  EXPECT_EQ(runtime_.opened.size(), 1u) << "malformed registrations open nothing";
}

TEST_F(SessionDeviceTest, CAbiRegistersDeviceTensorsAndReportsRefusals) {
  start(1);
  sc_client* client = nullptr;
  ASSERT_EQ(sc_connect(sock_.path().c_str(), 2000, &client), SC_OK) << sc_last_error();
  EXPECT_GE(sc_abi_version(), 3);
  sc_device_handles h{};
  const DeviceHandles cpp = handles(3, 64);
  std::memcpy(h.device_uuid, cpp.device_uuid.data(), sizeof h.device_uuid);
  std::memcpy(h.mem_handle, cpp.mem_handle.data(), sizeof h.mem_handle);
  h.offset = 64;
  sc_tensor* t = nullptr;
  ASSERT_EQ(sc_register_device_tensor(client, "g", 16, SC_DTYPE_F32, nullptr, 0, &h, &t), SC_OK)
      << sc_client_last_error(client);
  EXPECT_EQ(sc_tensor_on_device(t), 1);
  EXPECT_EQ(sc_tensor_data(t), nullptr);
  EXPECT_EQ(sc_tensor_size(t), 16u);
  ASSERT_EQ(sc_submit(client, t, 1, 0.0f), SC_OK);
  ASSERT_EQ(sc_wait(client, t, 1, 5000, nullptr), SC_OK) << sc_client_last_error(client);
  sc_tensor* bad = nullptr;
  EXPECT_EQ(sc_register_device_tensor(client, "x", 16, SC_DTYPE_F32, nullptr, 0, nullptr, &bad), SC_INVALID_ARGUMENT);
  {
    std::lock_guard<std::mutex> lock(runtime_.mu);
    runtime_.refuse = unavailable("sparsecard was built without CUDA (fake)");
  }
  EXPECT_EQ(sc_register_device_tensor(client, "x", 16, SC_DTYPE_F32, nullptr, 0, &h, &bad), SC_UNAVAILABLE);
  EXPECT_EQ(bad, nullptr);
  EXPECT_NE(std::string(sc_client_last_error(client)).find("built without CUDA (fake)"), std::string::npos)
      << sc_client_last_error(client);
  sc_tensor* host = nullptr;
  EXPECT_EQ(sc_register_tensor(client, "x", 16, SC_DTYPE_F32, &host), SC_OK);
  EXPECT_EQ(sc_tensor_on_device(host), 0);
  EXPECT_EQ(sc_tensor_on_device(nullptr), 0);
  sc_client_close(client);
  EXPECT_TRUE(testing::wait_until([&] { return *runtime_.live == 0; })) << "the client's mapping closes when it goes";
}

}  // namespace
}  // namespace sparsecar
