// StepCollector without any socket: client slots are plain float buffers, the pipeline and the
// clients' completion rings are recording fakes. Sums are checked against a reference computed
// here (exact small integers, or a plain float64 loop over the same inputs); every expected
// message fragment and counter is what session_server.h promises, not what the code printed.
#include "daemon/session/step_collector.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <array>
#include <cmath>
#include <cstring>
#include <deque>
#include <random>
#include <set>
#include <string>
#include <vector>

namespace sparsecar {
namespace {

// The pipeline as the collector sees it: records jobs (the test answers them through
// on_result), registrations, failed steps and resets.
class RecordingPipeline : public StepSink {
 public:
  struct Job {
    uint32_t tensor_id;
    uint64_t step;
    float lr;
    uint64_t generation;
    std::vector<float> local_sum;
    std::span<float> result;
    bool trainer_reduces = false;
    bool takes_lease = false;
  };
  struct Failed {
    uint32_t tensor_id;
    uint64_t step;
    std::string reason;
  };
  Status register_tensor(uint32_t tensor_id, const TensorSpec& spec) override {
    if (refuse) return failed_precondition("the job already started");
    registered.emplace_back(tensor_id, spec.name);
    return Status::Ok();
  }
  void submit(const StepJob& job) override {
    jobs.push_back({job.tensor_id, job.step, job.lr, job.generation, {job.local_sum.begin(), job.local_sum.end()},
                    job.result, job.trainer_reduces, job.takes_lease});
  }
  void report_metric(const std::string&, double, uint64_t) override {}
  void reset() override {}
  uint64_t tensor_footprint_bytes(const TensorSpec& spec) const override { return footprint_per_element * spec.count; }
  void fail_step(uint32_t tensor_id, uint64_t step, const std::string& reason) override {
    failed.push_back({tensor_id, step, reason});
  }

  bool refuse = false;
  uint64_t footprint_per_element = 0;
  std::vector<std::pair<uint32_t, std::string>> registered;
  std::vector<Job> jobs;
  std::vector<Failed> failed;
};

// The clients' completion rings: records every completion; a client in `unreachable` is being
// closed (takes no results).
class RecordingClients : public CompletionSink {
 public:
  struct Posted {
    uint32_t client;
    uint32_t tensor_id;
    uint64_t step;
    Code code;
    std::string message;
    bool has_info;
  };
  bool reachable(uint32_t client) const override { return unreachable.count(client) == 0; }
  void post(uint32_t client, uint32_t tensor_id, uint64_t step, const Status& st, const StepResult* info) override {
    posted.push_back({client, tensor_id, step, st.code(), st.message(), info != nullptr});
  }
  std::vector<Posted> to(uint32_t client) const {
    std::vector<Posted> out;
    for (const auto& p : posted) {
      if (p.client == client) out.push_back(p);
    }
    return out;
  }

  std::set<uint32_t> unreachable;
  std::vector<Posted> posted;
};

uint64_t page_rounded(uint64_t bytes) {
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  return (bytes + page - 1) / page * page;
}

class StepCollectorTest : public ::testing::Test {
 protected:
  void make(uint32_t local_clients, uint64_t budget = uint64_t{1} << 30, uint32_t max_tensors = 16,
            uint64_t max_elements = uint64_t{1} << 20) {
    collector_ = std::make_unique<StepCollector>(StepCollectorOptions{.local_clients = local_clients,
                                                                      .max_tensor_elements = max_elements,
                                                                      .max_tensors = max_tensors,
                                                                      .budget_bytes = budget},
                                                 &pipeline_, &clients_);
  }
  void join(uint32_t client) { collector_->client_joined(client, "client " + std::to_string(client) + " (pid 7)"); }

  RegisterRequest request(const std::string& name, uint64_t count, std::vector<uint64_t> shape = {}) {
    auto& buf = names_.emplace_back();
    buf.fill(0);
    std::memcpy(buf.data(), name.data(), std::min(name.size(), buf.size()));
    RegisterRequest r;
    r.count = count;
    r.dtype = 0;
    r.name = buf.data();
    r.shape = std::move(shape);
    return r;
  }
  // Registers `name` for `client` and attaches a slot of its own; returns the tensor id.
  uint32_t registered(uint32_t client, const std::string& name, uint64_t count) {
    auto reg = collector_->register_tensor(client, request(name, count));
    EXPECT_TRUE(reg.ok()) << reg.status().to_string();
    if (!reg.ok()) return UINT32_MAX;
    auto& slot = slots_[{client, reg->tensor_id}];
    slot.assign(count, 0.0f);
    collector_->attach_slot(client, reg->tensor_id, std::span<float>(slot));
    return reg->tensor_id;
  }
  std::vector<float>& slot(uint32_t client, uint32_t tensor) { return slots_.at({client, tensor}); }
  void submit(uint32_t client, uint32_t tensor, uint64_t step, float lr = 0.0f, uint32_t flags = 0) {
    shm::Submission s{};
    s.step = step;
    s.tensor_id = tensor;
    s.lr = lr;
    s.flags = flags;
    collector_->submit(client, s);
  }
  // Answers pipeline job `index` with `st`; on success the result is local_sum * 0.5.
  void answer(size_t index, Status st = Status::Ok()) {
    auto& job = pipeline_.jobs.at(index);
    StepResult r;
    r.tensor_id = job.tensor_id;
    r.step = job.step;
    r.generation = job.generation;
    r.status = std::move(st);
    if (r.status.ok()) {
      for (size_t i = 0; i < job.result.size(); ++i) job.result[i] = job.local_sum[i] * 0.5f;
      r.nnz = job.result.size();
    }
    collector_->on_result(r);
  }
  const StepCounters& counters() const { return collector_->counters(); }

  RecordingPipeline pipeline_;
  RecordingClients clients_;
  std::unique_ptr<StepCollector> collector_;
  std::deque<std::array<char, proto::kNameBytes>> names_;
  std::map<std::pair<uint32_t, uint32_t>, std::vector<float>> slots_;
};

// ---- summing -------------------------------------------------------------------------------------

TEST_F(StepCollectorTest, SumsSmallIntegersExactly) {
  make(3);
  for (uint32_t c : {1u, 2u, 3u}) join(c);
  uint32_t t = 0;
  for (uint32_t c : {1u, 2u, 3u}) t = registered(c, "w", 5);
  // Client c holds c * (i + 1) - 4: the sum is 6 * (i + 1) - 12, exact in fp32.
  for (uint32_t c : {1u, 2u, 3u}) {
    for (size_t i = 0; i < 5; ++i) slot(c, t)[i] = static_cast<float>(static_cast<int>(c) * static_cast<int>(i + 1) - 4);
  }
  submit(2, t, 10, 0.5f);
  submit(3, t, 10, 0.25f);
  EXPECT_TRUE(pipeline_.jobs.empty()) << "dispatched before every local client submitted";
  submit(1, t, 10, 0.125f);
  ASSERT_EQ(pipeline_.jobs.size(), 1u);
  const auto& job = pipeline_.jobs[0];
  EXPECT_EQ(job.tensor_id, t);
  EXPECT_EQ(job.step, 10u);
  EXPECT_EQ(job.lr, 0.125f);  // the lowest client id's
  EXPECT_EQ(job.local_sum, (std::vector<float>{-6, 0, 6, 12, 18}));
  EXPECT_EQ(counters().steps_dispatched.load(), 1u);
  EXPECT_EQ(counters().submissions.load(), 3u);
}

TEST_F(StepCollectorTest, SumIsTheFloat64SumRoundedOnceWhateverTheSubmissionOrder) {
  constexpr size_t kCount = 4099;
  constexpr uint32_t kClients = 4;
  make(kClients);
  for (uint32_t c = 1; c <= kClients; ++c) join(c);
  uint32_t t = 0;
  for (uint32_t c = 1; c <= kClients; ++c) t = registered(c, "big", kCount);
  std::mt19937 rng(1234);
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> expo(-20, 20);  // wide magnitudes: fp32 accumulation would differ
  std::vector<std::vector<float>> inputs(kClients + 1, std::vector<float>(kCount));
  for (uint32_t c = 1; c <= kClients; ++c) {
    for (float& v : inputs[c]) v = std::ldexp(mant(rng), expo(rng));
  }
  std::vector<float> reference(kCount);
  size_t fp32_differs = 0;
  for (size_t i = 0; i < kCount; ++i) {
    double acc = 0.0;
    float naive = 0.0f;
    for (uint32_t c = 1; c <= kClients; ++c) {
      acc += static_cast<double>(inputs[c][i]);
      naive += inputs[c][i];
    }
    reference[i] = static_cast<float>(acc);
    fp32_differs += naive != reference[i] ? 1 : 0;
  }
  ASSERT_GT(fp32_differs, 0u) << "the inputs do not tell float64 from float32 accumulation";

  for (uint64_t step : {1u, 2u}) {
    // Step 1 in client order, step 2 in reverse: the same bytes. (Each step's result overwrote
    // the slots: the trainers write their next gradient.)
    for (uint32_t c = 1; c <= kClients; ++c) slot(c, t) = inputs[c];
    for (uint32_t k = 0; k < kClients; ++k) submit(step == 1 ? k + 1 : kClients - k, t, step);
    ASSERT_EQ(pipeline_.jobs.size(), step);
    const auto& sum = pipeline_.jobs.back().local_sum;
    ASSERT_EQ(sum.size(), kCount);
    EXPECT_EQ(std::memcmp(sum.data(), reference.data(), kCount * sizeof(float)), 0) << "step " << step;
    answer(pipeline_.jobs.size() - 1);
  }
}

TEST_F(StepCollectorTest, OneClientsSlotIsCopiedBitForBit) {
  make(1);
  join(1);
  uint32_t t = registered(1, "w", 4);
  const std::array<uint32_t, 4> bits = {0x80000000u /* -0 */, 0x7fc00001u /* NaN */, 0x00000001u /* denormal */,
                                        0x3f800000u /* 1 */};
  std::memcpy(slot(1, t).data(), bits.data(), sizeof bits);
  submit(1, t, 0);
  ASSERT_EQ(pipeline_.jobs.size(), 1u);
  EXPECT_EQ(std::memcmp(pipeline_.jobs[0].local_sum.data(), bits.data(), sizeof bits), 0);
}

// ---- completion ----------------------------------------------------------------------------------

TEST_F(StepCollectorTest, TheResultReachesEverySlotAndEachClientGetsOneCompletion) {
  make(2);
  join(1);
  join(2);
  uint32_t t = registered(1, "w", 3);
  registered(2, "w", 3);
  slot(1, t) = {1, 2, 3};
  slot(2, t) = {3, 4, 5};
  submit(1, t, 7);
  submit(2, t, 7);
  ASSERT_EQ(pipeline_.jobs.size(), 1u);
  EXPECT_TRUE(clients_.posted.empty()) << "a completion before the pipeline answered";
  answer(0);
  // (1 + 3) / 2 etc.: the fake pipeline halves the local sum.
  EXPECT_EQ(slot(1, t), (std::vector<float>{2, 3, 4}));
  EXPECT_EQ(slot(2, t), (std::vector<float>{2, 3, 4}));
  for (uint32_t c : {1u, 2u}) {
    auto got = clients_.to(c);
    ASSERT_EQ(got.size(), 1u) << "client " << c;
    EXPECT_EQ(got[0].code, Code::kOk);
    EXPECT_EQ(got[0].step, 7u);
    EXPECT_EQ(got[0].tensor_id, t);
    EXPECT_TRUE(got[0].has_info);
  }
  EXPECT_EQ(counters().steps_completed.load(), 1u);
  // The next step is collected afresh.
  submit(2, t, 8);
  EXPECT_EQ(pipeline_.jobs.size(), 1u);
  submit(1, t, 8);
  EXPECT_EQ(pipeline_.jobs.size(), 2u);
}

TEST_F(StepCollectorTest, AFailedStepLeavesTheSlotsAloneAndTellsEveryClient) {
  make(2);
  join(1);
  join(2);
  uint32_t t = registered(1, "w", 2);
  registered(2, "w", 2);
  slot(1, t) = {1, 1};
  slot(2, t) = {5, 5};
  submit(1, t, 0);
  submit(2, t, 0);
  answer(0, deadline_exceeded("rank 1 did not deliver"));
  EXPECT_EQ(slot(1, t), (std::vector<float>{1, 1}));
  EXPECT_EQ(slot(2, t), (std::vector<float>{5, 5}));
  ASSERT_EQ(clients_.posted.size(), 2u);
  for (const auto& p : clients_.posted) {
    EXPECT_EQ(p.code, Code::kDeadlineExceeded);
    EXPECT_NE(p.message.find("rank 1 did not deliver"), std::string::npos);
  }
  EXPECT_EQ(counters().steps_failed.load(), 1u);
}

TEST_F(StepCollectorTest, ResultsThatMatchNoStepInFlightAreCountedAndDropped) {
  make(1);
  join(1);
  uint32_t t = registered(1, "w", 2);
  StepResult r;
  r.tensor_id = t;
  r.step = 3;
  collector_->on_result(r);  // nothing in flight
  r.tensor_id = 99;          // no such tensor
  collector_->on_result(r);
  submit(1, t, 4);
  answer(0);
  collector_->on_result(r);
  r.tensor_id = t;
  r.step = 4;
  collector_->on_result(r);  // answered already
  EXPECT_EQ(counters().stale_results.load(), 4u);
  EXPECT_EQ(clients_.posted.size(), 1u);
}

// A step goes to the trainers' own all-reduce only if every local trainer said it does that.
TEST_F(StepCollectorTest, TrainerReducesIsSaidByEveryLocalSubmitter) {
  make(2);
  join(1);
  join(2);
  uint32_t t = registered(1, "w", 2);
  registered(2, "w", 2);
  submit(1, t, 0, 0.0f, shm::kSubmitTrainerReduces);
  submit(2, t, 0, 0.0f, shm::kSubmitTrainerReduces);
  ASSERT_EQ(pipeline_.jobs.size(), 1u);
  EXPECT_TRUE(pipeline_.jobs[0].trainer_reduces);
  answer(0);
  submit(1, t, 1, 0.0f, shm::kSubmitTrainerReduces);
  submit(2, t, 1);
  ASSERT_EQ(pipeline_.jobs.size(), 2u);
  EXPECT_FALSE(pipeline_.jobs[1].trainer_reduces);
  answer(1);
  submit(2, t, 2);
  submit(1, t, 2, 0.0f, shm::kSubmitTrainerReduces);
  ASSERT_EQ(pipeline_.jobs.size(), 3u);
  EXPECT_FALSE(pipeline_.jobs[2].trainer_reduces);
}

// A step is leased (StepJob::takes_lease) only if every local trainer reduces it and takes leases.
TEST_F(StepCollectorTest, TakesLeaseIsSaidByEveryLocalSubmitter) {
  make(2);
  join(1);
  join(2);
  uint32_t t = registered(1, "w", 2);
  registered(2, "w", 2);
  const uint32_t both = shm::kSubmitTrainerReduces | shm::kSubmitTakesLease;
  const uint32_t flags[][2] = {{both, both}, {both, shm::kSubmitTrainerReduces}, {shm::kSubmitTrainerReduces, both},
                               {both, 0}};
  const bool leased[] = {true, false, false, false};
  for (uint64_t step = 0; step < 4; ++step) {
    submit(1, t, step, 0.0f, flags[step][0]);
    submit(2, t, step, 0.0f, flags[step][1]);
    ASSERT_EQ(pipeline_.jobs.size(), step + 1);
    EXPECT_EQ(pipeline_.jobs[step].takes_lease, leased[step]) << step;
    answer(step);
  }
  // The next step may be any later one (the trainers ran the leased ones themselves).
  submit(1, t, 20, 0.0f, both);
  submit(2, t, 20, 0.0f, both);
  ASSERT_EQ(pipeline_.jobs.size(), 5u);
  EXPECT_EQ(pipeline_.jobs[4].step, 20u);
}

// ---- bad submissions -----------------------------------------------------------------------------

TEST_F(StepCollectorTest, BadSubmissionsAreRefusedWithTheirReason) {
  make(2);
  join(1);
  join(2);
  uint32_t t = registered(1, "w", 2);
  uint32_t only1 = registered(1, "only-client-1", 2);
  registered(2, "w", 2);
  auto last = [&] { return clients_.posted.back(); };

  submit(1, 42, 0);
  EXPECT_EQ(last().code, Code::kNotFound);
  submit(2, only1, 0);  // registered, but not by client 2
  EXPECT_EQ(last().code, Code::kNotFound);
  EXPECT_EQ(last().client, 2u);

  shm::Submission s{};
  s.tensor_id = t;
  for (uint32_t flags : {shm::kSubmitTakesLease, 4u, 0x80000000u}) {  // a lease without reducing; not flags
    s.flags = flags;
    collector_->submit(1, s);
    EXPECT_EQ(last().code, Code::kInvalidArgument) << flags;
  }
  s.flags = 0;
  s.reserved = 5;
  collector_->submit(1, s);
  EXPECT_EQ(last().code, Code::kInvalidArgument);
  for (float lr : {-0.5f, std::nanf(""), INFINITY}) {
    submit(1, t, 0, lr);
    EXPECT_EQ(last().code, Code::kInvalidArgument) << lr;
  }
  EXPECT_EQ(counters().submissions_rejected.load(), 9u);  // 2 unknown tensors, 3 flags, reserved, 3 lr
  EXPECT_TRUE(pipeline_.jobs.empty());

  submit(1, t, 5);
  submit(1, t, 5);
  EXPECT_EQ(last().code, Code::kFailedPrecondition);
  EXPECT_NE(last().message.find("twice"), std::string::npos);
  submit(2, t, 5);
  ASSERT_EQ(pipeline_.jobs.size(), 1u);
  submit(1, t, 6);  // step 5 still in flight
  EXPECT_EQ(last().code, Code::kFailedPrecondition);
  EXPECT_NE(last().message.find("in flight"), std::string::npos);
  answer(0);
  submit(1, t, 5);  // not greater than the last step
  EXPECT_EQ(last().code, Code::kOutOfRange);
  submit(2, t, 4);
  EXPECT_EQ(last().code, Code::kOutOfRange);
  EXPECT_EQ(pipeline_.jobs.size(), 1u);
}

TEST_F(StepCollectorTest, ClientsDisagreeingOnTheStepFailBoth) {
  make(2);
  join(1);
  join(2);
  uint32_t t = registered(1, "w", 2);
  registered(2, "w", 2);
  submit(1, t, 3);
  submit(2, t, 4);
  ASSERT_EQ(clients_.posted.size(), 2u);
  for (uint32_t c : {1u, 2u}) {
    auto got = clients_.to(c);
    ASSERT_EQ(got.size(), 1u);
    EXPECT_EQ(got[0].code, Code::kFailedPrecondition);
    EXPECT_NE(got[0].message.find("disagree"), std::string::npos);
  }
  EXPECT_TRUE(pipeline_.jobs.empty());
  EXPECT_EQ(counters().steps_failed.load(), 1u);
  submit(1, t, 4);  // a fresh start is possible
  submit(2, t, 4);
  EXPECT_EQ(pipeline_.jobs.size(), 1u);
}

// ---- disconnects ---------------------------------------------------------------------------------

TEST_F(StepCollectorTest, AClientLeavingMidCollectionAbortsTheStepAndFailsItJobWide) {
  make(2);
  join(1);
  join(2);
  uint32_t t = registered(1, "w", 2);
  registered(2, "w", 2);
  submit(1, t, 9);
  collector_->client_left(2, "closed the connection", /*fail_owed=*/true);
  auto got = clients_.to(1);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].code, Code::kAborted);
  EXPECT_EQ(got[0].step, 9u);
  EXPECT_NE(got[0].message.find("client 2 (pid 7) disconnected (closed the connection)"), std::string::npos)
      << got[0].message;
  ASSERT_EQ(pipeline_.failed.size(), 1u);
  EXPECT_EQ(pipeline_.failed[0].tensor_id, t);
  EXPECT_EQ(pipeline_.failed[0].step, 9u);
  EXPECT_TRUE(pipeline_.jobs.empty());

  // Until a replacement joins, every submission fails at once naming the client that left.
  submit(1, t, 10);
  ASSERT_EQ(clients_.to(1).size(), 2u);
  EXPECT_EQ(clients_.to(1).back().code, Code::kAborted);
  EXPECT_NE(clients_.to(1).back().message.find("client 2 (pid 7) disconnected"), std::string::npos);
  EXPECT_EQ(pipeline_.failed.size(), 2u);  // step 10 failed job-wide too

  join(3);
  registered(3, "w", 2);
  submit(3, t, 11);
  submit(1, t, 11);
  ASSERT_EQ(pipeline_.jobs.size(), 1u);
  EXPECT_EQ(pipeline_.jobs[0].step, 11u);
}

TEST_F(StepCollectorTest, NotFailedJobWideWhenTheDaemonStops) {
  make(2);
  join(1);
  join(2);
  uint32_t t = registered(1, "w", 2);
  registered(2, "w", 2);
  submit(1, t, 1);
  collector_->client_left(2, "the daemon is shutting down", /*fail_owed=*/false);
  EXPECT_TRUE(pipeline_.failed.empty());
  ASSERT_EQ(clients_.to(1).size(), 1u);  // the local step is still aborted
  EXPECT_EQ(clients_.to(1)[0].code, Code::kAborted);
}

TEST_F(StepCollectorTest, AClientLeavingBetweenStepsFailsNothingJobWide) {
  make(2);
  join(1);
  join(2);
  uint32_t a = registered(1, "a", 1);
  uint32_t b = registered(1, "b", 1);
  registered(2, "a", 1);
  registered(2, "b", 1);
  for (uint32_t t : {a, b}) {
    submit(1, t, 1);
    submit(2, t, 1);
  }
  answer(0);
  answer(1);
  collector_->client_left(2, "closed the connection", true);
  EXPECT_TRUE(pipeline_.failed.empty());
}

TEST_F(StepCollectorTest, AClientDyingMidStepFailsTheTensorsItOwedJobWide) {
  make(2);
  join(1);
  join(2);
  uint32_t a = registered(1, "a", 1);
  uint32_t b = registered(1, "b", 1);
  registered(2, "a", 1);
  registered(2, "b", 1);
  submit(1, a, 4);
  submit(2, a, 4);  // a reached step 4, b is still at nothing: client 2 died mid step 4
  answer(0);
  collector_->client_left(2, "killed", true);
  ASSERT_EQ(pipeline_.failed.size(), 1u);
  EXPECT_EQ(pipeline_.failed[0].tensor_id, b);
  EXPECT_EQ(pipeline_.failed[0].step, 4u);
}

TEST_F(StepCollectorTest, AClientLeavingWhileInFlightGetsNoResult) {
  make(2);
  join(1);
  join(2);
  uint32_t t = registered(1, "w", 1);
  registered(2, "w", 1);
  submit(1, t, 0);
  submit(2, t, 0);
  collector_->client_left(2, "closed", true);
  answer(0);
  EXPECT_TRUE(clients_.to(2).empty());
  EXPECT_EQ(clients_.to(1).size(), 1u);
}

TEST_F(StepCollectorTest, AnUnreachableClientGetsNeitherTheResultNorACompletion) {
  make(2);
  join(1);
  join(2);
  uint32_t t = registered(1, "w", 1);
  registered(2, "w", 1);
  slot(1, t) = {2};
  slot(2, t) = {4};
  submit(1, t, 0);
  submit(2, t, 0);
  clients_.unreachable.insert(2);  // being closed, not freed yet
  answer(0);
  EXPECT_EQ(slot(1, t), std::vector<float>{3});
  EXPECT_EQ(slot(2, t), std::vector<float>{4});
  EXPECT_TRUE(clients_.to(2).empty());
}

// ---- registration and the budget -----------------------------------------------------------------

TEST_F(StepCollectorTest, BadRegistrationsAreRefused) {
  make(2, uint64_t{1} << 30, /*max_tensors=*/2, /*max_elements=*/1000);
  join(1);
  join(2);
  auto code = [&](uint32_t client, RegisterRequest r) {
    auto reg = collector_->register_tensor(client, r);
    return reg.ok() ? Code::kOk : reg.status().code();
  };
  EXPECT_EQ(code(1, request("", 4)), Code::kInvalidArgument);
  RegisterRequest unterminated = request(std::string(proto::kNameBytes, 'x'), 4);
  EXPECT_EQ(code(1, unterminated), Code::kInvalidArgument);
  RegisterRequest dtype = request("w", 4);
  dtype.dtype = 1;
  EXPECT_EQ(code(1, dtype), Code::kInvalidArgument);
  RegisterRequest malformed = request("w", 4);
  malformed.malformed = "ndim 9";
  EXPECT_EQ(code(1, malformed), Code::kInvalidArgument);
  EXPECT_EQ(code(1, request("w", 0)), Code::kInvalidArgument);
  EXPECT_EQ(code(1, request("w", 1001)), Code::kResourceExhausted);
  EXPECT_EQ(code(1, request("w", 6, {2, 2})), Code::kInvalidArgument);  // 4 != 6
  EXPECT_TRUE(pipeline_.registered.empty());

  registered(1, "w", 6);
  EXPECT_EQ(code(2, request("w", 7)), Code::kInvalidArgument);          // size mismatch
  EXPECT_EQ(code(2, request("w", 6, {2, 3})), Code::kInvalidArgument);  // shape mismatch
  EXPECT_EQ(code(1, request("w", 6)), Code::kAlreadyExists);
  EXPECT_EQ(code(2, request("w", 6)), Code::kOk);
  registered(1, "v", 1);
  EXPECT_EQ(code(1, request("u", 1)), Code::kResourceExhausted);  // max_tensors = 2
  pipeline_.refuse = true;
  make(1);
  join(1);
  EXPECT_EQ(code(1, request("late", 1)), Code::kFailedPrecondition);
}

TEST_F(StepCollectorTest, TheBudgetCountsTensorsSlotsAndThePipelineAndRefusesBeforeAllocating) {
  const uint64_t n = 1000;
  const uint64_t tensor_bytes = 2 * 4 * n + 3 * n;  // local_sum + result + the pipeline's 3 bytes/element
  const uint64_t slot = page_rounded(4 * n);
  pipeline_.footprint_per_element = 3;
  make(2, /*budget=*/tensor_bytes + 2 * slot);
  join(1);
  join(2);
  uint32_t t = registered(1, "w", n);
  EXPECT_EQ(counters().tensor_bytes_in_use.load(), tensor_bytes + slot);
  registered(2, "w", n);
  EXPECT_EQ(counters().tensor_bytes_in_use.load(), tensor_bytes + 2 * slot);
  auto over = collector_->register_tensor(1, request("x", 1));
  ASSERT_FALSE(over.ok());
  EXPECT_EQ(over.status().code(), Code::kResourceExhausted);
  EXPECT_NE(over.status().message().find("tensor_memory_budget_bytes"), std::string::npos);
  EXPECT_EQ(counters().registrations_over_budget.load(), 1u);
  EXPECT_EQ(pipeline_.registered.size(), 1u);  // refused before the pipeline heard of it

  collector_->client_left(2, "closed", false);
  EXPECT_EQ(counters().tensor_bytes_in_use.load(), tensor_bytes + slot);
  collector_->detach_slot(1, t);
  EXPECT_EQ(counters().tensor_bytes_in_use.load(), tensor_bytes);
}

TEST_F(StepCollectorTest, AResetKeepsATensorInFlightChargedUntilThePipelineAnswers) {
  const uint64_t n = 10;
  make(1);
  join(1);
  uint32_t a = registered(1, "a", n);
  registered(1, "b", n);
  submit(1, a, 0);
  ASSERT_EQ(pipeline_.jobs.size(), 1u);
  collector_->client_left(1, "closed", true);
  EXPECT_EQ(counters().tensor_bytes_in_use.load(), 2 * (2 * 4 * n));
  collector_->reset_job();
  EXPECT_EQ(collector_->tensor_count(), 0u);
  EXPECT_EQ(counters().orphaned_tensors.load(), 1u);
  EXPECT_EQ(counters().tensor_bytes_in_use.load(), 2 * 4 * n);  // a's buffers, still lent out

  // The next job reuses the ids; the late answer of the old job frees the orphan and matches
  // nothing of the new one.
  join(2);
  uint32_t fresh = registered(2, "c", n);
  EXPECT_EQ(fresh, a);
  submit(2, fresh, 0);
  ASSERT_EQ(pipeline_.jobs.size(), 2u);
  EXPECT_NE(pipeline_.jobs[0].generation, pipeline_.jobs[1].generation);
  answer(0);
  EXPECT_EQ(counters().orphaned_tensors.load(), 0u);
  EXPECT_EQ(counters().stale_results.load(), 0u);
  EXPECT_TRUE(clients_.to(2).empty()) << "an answer of the old job reached the new one";
  answer(1);
  EXPECT_EQ(clients_.to(2).size(), 1u);
  EXPECT_EQ(counters().tensor_bytes_in_use.load(), 2 * 4 * n + page_rounded(4 * n));
}

}  // namespace
}  // namespace sparsecar
