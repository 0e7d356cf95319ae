// The C ABI: a round trip driven from C, status numbers, error messages, NULL handles.
#include "sparsecar/sparsecar.h"

#include <gtest/gtest.h>

#include <string>

#include "daemon/session/session_server.h"
#include "tests/unit/session/session_test_util.h"

extern "C" int sc_test_c_roundtrip(const char* socket_path, uint64_t step);

namespace sparsecar {
namespace {

using namespace std::chrono_literals;

class CApiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    SessionServerOptions options;
    options.socket_path = sock_.path();
    auto server = SessionServer::start(options, &pipeline_);
    ASSERT_TRUE(server.ok()) << server.status().to_string();
    server_ = std::move(server).value();
    pipeline_.attach(server_.get());
  }
  void TearDown() override { server_->stop(); }

  testing::TempSocket sock_;
  testing::FakePipeline pipeline_;
  std::unique_ptr<SessionServer> server_;
};

TEST_F(CApiTest, RoundTripFromC) {
  EXPECT_EQ(sc_test_c_roundtrip(sock_.path().c_str(), 3), 0);
  ASSERT_TRUE(testing::wait_until([&] { return pipeline_.metric_count() == 1; }));
  EXPECT_EQ(pipeline_.metrics[0].name, "loss");
  std::lock_guard<std::mutex> lock(pipeline_.mu_);
  ASSERT_EQ(pipeline_.jobs.size(), 1u);
  EXPECT_FLOAT_EQ(pipeline_.jobs[0].lr, 0.5f);
}

// ABI version 4: a trainer that all-reduces dense steps itself says so per submit, and reads
// per step whether the slot holds its share (the daemon asked) or the average.
TEST_F(CApiTest, ATrainerThatReducesDenseStepsSaysSoAndReadsWhichItGot) {
  pipeline_.answer_trainer_reduces = true;
  sc_client* client = nullptr;
  ASSERT_EQ(sc_connect(sock_.path().c_str(), 2000, &client), SC_OK);
  sc_tensor* w = nullptr;
  ASSERT_EQ(sc_register_tensor(client, "w", 8, SC_DTYPE_F32, &w), SC_OK);
  uint32_t flags = 99;
  ASSERT_EQ(sc_submit_flags(client, w, 0, 0.1f, SC_SUBMIT_TRAINER_REDUCES), SC_OK);
  ASSERT_EQ(sc_wait_flags(client, w, 0, 5000, nullptr, &flags), SC_OK) << sc_client_last_error(client);
  EXPECT_EQ(flags, SC_STEP_TRAINER_REDUCES);
  ASSERT_EQ(sc_submit(client, w, 1, 0.1f), SC_OK);
  ASSERT_EQ(sc_wait_flags(client, w, 1, 5000, nullptr, &flags), SC_OK) << sc_client_last_error(client);
  EXPECT_EQ(flags, 0u);
  {
    std::lock_guard<std::mutex> lock(pipeline_.mu_);
    ASSERT_EQ(pipeline_.jobs.size(), 2u);
    EXPECT_TRUE(pipeline_.jobs[0].trainer_reduces);
    EXPECT_FALSE(pipeline_.jobs[1].trainer_reduces);
  }
  // Bits this library does not know are refused before anything is submitted.
  EXPECT_EQ(sc_submit_flags(client, w, 2, 0.1f, 2u), SC_INVALID_ARGUMENT);
  EXPECT_NE(std::string(sc_client_last_error(client)).find("unknown flag"), std::string::npos);
  EXPECT_EQ(sc_step_in_flight(client, w, 2), 0);
  EXPECT_EQ(sc_submit_flags(nullptr, w, 2, 0.1f, 0), SC_INVALID_ARGUMENT);
  EXPECT_EQ(sc_wait_flags(client, nullptr, 2, 10, nullptr, &flags), SC_INVALID_ARGUMENT);
  sc_client_close(client);
}

// The daemon's DEADLINE_EXCEEDED (a peer did not deliver) ends the step and keeps its message;
// the wait's own timeout leaves the step in flight. sc_step_in_flight tells them apart.
TEST_F(CApiTest, TheDaemonsDeadlineIsNotTheWaitsOwn) {
  sc_client* client = nullptr;
  ASSERT_EQ(sc_connect(sock_.path().c_str(), 2000, &client), SC_OK);
  sc_tensor* w = nullptr;
  ASSERT_EQ(sc_register_tensor(client, "w", 8, SC_DTYPE_F32, &w), SC_OK);
  pipeline_.fail_with_deadline.store(true);
  ASSERT_EQ(sc_submit(client, w, 1, 0.0f), SC_OK);
  EXPECT_EQ(sc_step_in_flight(client, w, 1), 1);
  EXPECT_EQ(sc_wait(client, w, 1, 5000, nullptr), SC_DEADLINE_EXCEEDED);
  EXPECT_NE(std::string(sc_client_last_error(client)).find("rank 1 did not deliver"), std::string::npos)
      << sc_client_last_error(client);
  EXPECT_EQ(sc_step_in_flight(client, w, 1), 0);  // over: do not wait again
  EXPECT_EQ(sc_step_in_flight(nullptr, w, 1), 0);
  sc_client_close(client);
}

TEST_F(CApiTest, ErrorsCarryCodesAndMessages) {
  EXPECT_EQ(sc_abi_version(), SPARSECAR_C_ABI_VERSION);
  EXPECT_STREQ(sc_status_name(SC_DEADLINE_EXCEEDED), "DEADLINE_EXCEEDED");
  EXPECT_STREQ(sc_status_name(99), "UNKNOWN");

  sc_client* client = nullptr;
  ASSERT_EQ(sc_connect(sock_.path().c_str(), 2000, &client), SC_OK);
  sc_tensor* w = nullptr;
  ASSERT_EQ(sc_register_tensor(client, "w", 8, SC_DTYPE_F32, &w), SC_OK);
  EXPECT_EQ(sc_tensor_id(w), 0u);
  // Another size under the same name.
  sc_tensor* w2 = nullptr;
  EXPECT_EQ(sc_register_tensor(client, "w", 9, SC_DTYPE_F32, &w2), SC_INVALID_ARGUMENT);
  EXPECT_EQ(w2, nullptr);
  EXPECT_NE(std::string(sc_client_last_error(client)).find("already registered"), std::string::npos);
  EXPECT_STREQ(sc_last_error(), sc_client_last_error(client));
  // Waiting for a step that was never submitted.
  EXPECT_EQ(sc_wait(client, w, 1, 100, nullptr), SC_FAILED_PRECONDITION);
  // Out of order, reported by the daemon.
  ASSERT_EQ(sc_submit(client, w, 5, 0.0f), SC_OK);
  ASSERT_EQ(sc_wait(client, w, 5, 5000, nullptr), SC_OK);
  ASSERT_EQ(sc_submit(client, w, 4, 0.0f), SC_OK);
  EXPECT_EQ(sc_wait(client, w, 4, 5000, nullptr), SC_OUT_OF_RANGE);
  EXPECT_NE(std::string(sc_client_last_error(client)).find("not greater"), std::string::npos);
  // NULL handles and bad arguments never crash.
  EXPECT_EQ(sc_submit(nullptr, w, 6, 0.0f), SC_INVALID_ARGUMENT);
  EXPECT_EQ(sc_submit(client, nullptr, 6, 0.0f), SC_INVALID_ARGUMENT);
  EXPECT_EQ(sc_submit(client, w, 6, -1.0f), SC_INVALID_ARGUMENT);
  EXPECT_EQ(sc_register_tensor(client, nullptr, 8, SC_DTYPE_F32, &w2), SC_INVALID_ARGUMENT);
  EXPECT_EQ(sc_register_tensor(client, "h", 8, 5, &w2), SC_INVALID_ARGUMENT);
  EXPECT_EQ(sc_report_metric(client, "", 1.0, 1), SC_INVALID_ARGUMENT);
  EXPECT_EQ(sc_tensor_data(nullptr), nullptr);
  EXPECT_STREQ(sc_client_last_error(nullptr), "");
  sc_client_close(client);
  sc_client_close(nullptr);
}

TEST_F(CApiTest, ConnectFailureIsReportedPerThread) {
  sc_client* client = reinterpret_cast<sc_client*>(0x1);
  std::string missing = sock_.dir() + "/nobody-here.sock";
  EXPECT_EQ(sc_connect(missing.c_str(), 100, &client), SC_UNAVAILABLE);
  EXPECT_EQ(client, nullptr);
  EXPECT_NE(std::string(sc_last_error()).find("nobody-here.sock"), std::string::npos) << sc_last_error();
  EXPECT_EQ(sc_connect(nullptr, 100, &client), SC_INVALID_ARGUMENT);
}

}  // namespace
}  // namespace sparsecar
