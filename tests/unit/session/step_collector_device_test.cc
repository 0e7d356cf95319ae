// StepCollector with device tensors (RegisterDevice): no slots and no local sum, the
// participants' DeviceBuffers handed to the pipeline in client-id order with one keepalive that
// owns their mappings (a client that leaves mid-step does not unmap what the pipeline uses), host
// and device registrations of one name refused, and no host bytes charged to the budget.
#include <gtest/gtest.h>

#include <unistd.h>

#include <array>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "daemon/session/step_collector.h"

namespace sparsecar {
namespace {

class JobsPipeline : public StepSink {
 public:
  Status register_tensor(uint32_t, const TensorSpec& spec) override {
    specs.push_back(spec);
    return Status::Ok();
  }
  void submit(const StepJob& job) override { jobs.push_back(job); }  // holds the keepalive
  void report_metric(const std::string&, double, uint64_t) override {}
  void reset() override {}
  uint64_t tensor_footprint_bytes(const TensorSpec& spec) const override { return spec.on_device ? 1000 : 0; }

  std::vector<TensorSpec> specs;
  std::vector<StepJob> jobs;
};

class Posts : public CompletionSink {
 public:
  struct Posted {
    uint32_t client;
    uint64_t step;
    Code code;
  };
  bool reachable(uint32_t) const override { return true; }
  void post(uint32_t client, uint32_t, uint64_t step, const Status& st, const StepResult*) override {
    posted.push_back({client, step, st.code()});
  }
  std::vector<Posted> posted;
};

class StepCollectorDeviceTest : public ::testing::Test {
 protected:
  void SetUp() override {
    collector_ = std::make_unique<StepCollector>(StepCollectorOptions{.local_clients = 2,
                                                                      .max_tensor_elements = 1 << 20,
                                                                      .max_tensors = 16,
                                                                      .budget_bytes = uint64_t{1} << 30},
                                                 &pipeline_, &posts_);
    for (uint32_t c : {1u, 2u}) collector_->client_joined(c, "client " + std::to_string(c) + " (pid 7)");
  }
  RegisterRequest request(const std::string& name, uint64_t count, bool device) {
    auto& buf = names_.emplace_back();
    buf.fill(0);
    name.copy(buf.data(), name.size());
    RegisterRequest r;
    r.count = count;
    r.name = buf.data();
    if (device) r.device = DeviceRegion{.offset = 0, .bytes = count * 4};
    return r;
  }
  // A fake opened region of `client`: recognisable pointers, a keepalive that counts its owners.
  OpenedDevice opened(uint32_t client) {
    OpenedDevice d;
    d.buffer.data = reinterpret_cast<float*>(uintptr_t{0x10000} * client);
    d.buffer.device = static_cast<int>(client);
    d.buffer.ready_event = reinterpret_cast<void*>(uintptr_t{0x100} * client + 1);
    d.buffer.done_event = reinterpret_cast<void*>(uintptr_t{0x100} * client + 2);
    auto alive = live_;
    ++*alive;
    d.keepalive = std::shared_ptr<const void>(new int(0), [alive](const void* p) {
      delete static_cast<const int*>(p);
      --*alive;
    });
    return d;
  }
  uint32_t register_device(uint32_t client, const std::string& name, uint64_t count) {
    auto reg = collector_->register_tensor(client, request(name, count, true));
    EXPECT_TRUE(reg.ok()) << reg.status().to_string();
    collector_->attach_device(client, reg->tensor_id, opened(client));
    return reg->tensor_id;
  }
  void submit(uint32_t client, uint32_t tensor, uint64_t step) {
    shm::Submission s{};
    s.tensor_id = tensor;
    s.step = step;
    collector_->submit(client, s);
  }
  void answer(const StepJob& job) {
    StepResult r;
    r.tensor_id = job.tensor_id;
    r.step = job.step;
    r.generation = job.generation;
    collector_->on_result(r);
  }

  JobsPipeline pipeline_;
  Posts posts_;
  std::unique_ptr<StepCollector> collector_;
  std::vector<std::array<char, proto::kNameBytes>> names_;
  std::shared_ptr<int> live_ = std::make_shared<int>(0);  // keepalives not yet destroyed
};

TEST_F(StepCollectorDeviceTest, StepHandsTheBuffersInClientOrderWithoutASlot) {
  const uint32_t t = register_device(2, "g", 64);  // client 2 registers first
  EXPECT_EQ(register_device(1, "g", 64), t);
  ASSERT_EQ(pipeline_.specs.size(), 1u);
  EXPECT_TRUE(pipeline_.specs[0].on_device);
  // No shm slot, no local_sum/result: only the pipeline's footprint is charged.
  EXPECT_EQ(collector_->counters().tensor_bytes_in_use.load(), 1000u);

  submit(2, t, 1);  // in submission order 2, 1: the job is in client-id order anyway
  submit(1, t, 1);
  ASSERT_EQ(pipeline_.jobs.size(), 1u);
  const StepJob& job = pipeline_.jobs[0];
  EXPECT_TRUE(job.local_sum.empty());
  EXPECT_TRUE(job.result.empty());
  ASSERT_EQ(job.device.size(), 2u);
  EXPECT_EQ(job.device[0].data, reinterpret_cast<float*>(0x10000));
  EXPECT_EQ(job.device[0].ready_event, reinterpret_cast<void*>(0x101));
  EXPECT_EQ(job.device[1].data, reinterpret_cast<float*>(0x20000));
  EXPECT_EQ(job.device[1].done_event, reinterpret_cast<void*>(0x202));
  EXPECT_NE(job.keepalive, nullptr);

  answer(job);
  ASSERT_EQ(posts_.posted.size(), 2u);
  EXPECT_EQ(posts_.posted[0].client, 1u);
  EXPECT_EQ(posts_.posted[0].code, Code::kOk);
  EXPECT_EQ(posts_.posted[1].client, 2u);
  // The next step reuses nothing stale: new job, same buffers.
  pipeline_.jobs.clear();
  submit(1, t, 2);
  submit(2, t, 2);
  ASSERT_EQ(pipeline_.jobs.size(), 1u);
  EXPECT_EQ(pipeline_.jobs[0].device.size(), 2u);
  answer(pipeline_.jobs[0]);
  EXPECT_EQ(collector_->counters().steps_completed.load(), 2u);
}

TEST_F(StepCollectorDeviceTest, AClientThatLeavesMidStepKeepsItsMappingUntilTheResult) {
  const uint32_t t = register_device(1, "g", 16);
  register_device(2, "g", 16);
  EXPECT_EQ(*live_, 2);
  submit(1, t, 1);
  submit(2, t, 1);
  ASSERT_EQ(pipeline_.jobs.size(), 1u);
  collector_->client_left(2, "socket closed", /*fail_owed=*/false);
  EXPECT_EQ(*live_, 2) << "the step in flight still uses client 2's mapping";
  answer(pipeline_.jobs[0]);
  EXPECT_EQ(*live_, 2) << "the pipeline has not dropped its keepalive yet";
  pipeline_.jobs.clear();  // the pipeline lets go of the job
  EXPECT_EQ(*live_, 1) << "client 2's mapping closes with the last owner";
  ASSERT_EQ(posts_.posted.size(), 1u);  // only client 1 is told
  EXPECT_EQ(posts_.posted[0].client, 1u);
  collector_->client_left(1, "socket closed", false);
  EXPECT_EQ(*live_, 0);
}

TEST_F(StepCollectorDeviceTest, HostAndDeviceRegistrationsOfOneNameAreRefused) {
  register_device(1, "g", 16);
  auto host = collector_->register_tensor(2, request("g", 16, false));
  ASSERT_FALSE(host.ok());
  EXPECT_EQ(host.status().code(), Code::kInvalidArgument);
  const std::string m = host.status().message();
  EXPECT_NE(m.find("a GPU tensor (RegisterDevice) by client 1 (pid 7)"), std::string::npos) << m;
  EXPECT_NE(m.find("client 2 (pid 7) asked for a host tensor"), std::string::npos) << m;

  auto h = collector_->register_tensor(1, request("w", 16, false));
  ASSERT_TRUE(h.ok());
  auto dev = collector_->register_tensor(2, request("w", 16, true));
  ASSERT_FALSE(dev.ok());
  EXPECT_NE(dev.status().message().find("registered as a host tensor"), std::string::npos) << dev.status().message();
  // check_registration says the same and registers nothing.
  EXPECT_EQ(collector_->check_registration(2, request("w", 16, true)).code(), Code::kInvalidArgument);
  EXPECT_TRUE(collector_->check_registration(2, request("new", 16, true)).ok());
  EXPECT_EQ(collector_->tensor_count(), 2u);
}

TEST_F(StepCollectorDeviceTest, UnknownToASubmitterWithoutTheDeviceTensor) {
  const uint32_t t = register_device(1, "g", 16);
  submit(2, t, 1);  // client 2 never registered it
  ASSERT_EQ(posts_.posted.size(), 1u);
  EXPECT_EQ(posts_.posted[0].code, Code::kNotFound);
}

}  // namespace
}  // namespace sparsecar
