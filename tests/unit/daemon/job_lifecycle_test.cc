// Jobs on long-lived daemons: one job after another on the same pipelines and mailboxes.
//  - A message of a finished job that arrives late is never summed into the next job, even when
//    the next job reaches the same (tensor, step): the expected sums are the plain averages of
//    what each job's trainers submitted.
//  - A reset never leaves the next job cancelled (reset() used to cancel the mailbox after
//    queueing the Reset, so the pipeline thread could resume it first).
//  - A collective that fails does not return while its zero-copy sends are still in flight.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <thread>

#include "daemon/collective/collective.h"
#include "tests/unit/daemon/pipeline_job.h"

namespace sparsecar {
namespace {

using namespace std::chrono_literals;
using fakes::PipelineJob;

constexpr size_t kN = 8;

StepJob step_job(uint64_t step, std::vector<float>& in, std::vector<float>& out) {
  StepJob j;
  j.tensor_id = 0;
  j.step = step;
  j.local_sum = in;
  j.result = out;
  return j;
}

void register_everywhere(PipelineJob& job) {
  for (auto& n : job.nodes) ASSERT_TRUE(n->pipeline->register_tensor(0, {"w", kN}).ok());
}

// Every node submits `value` everywhere for `step`; returns the results.
std::vector<StepResult> uniform_step(PipelineJob& job, uint64_t step, float value,
                                     std::vector<std::vector<float>>& outputs) {
  std::vector<std::vector<float>> inputs(job.nodes.size(), std::vector<float>(kN, value));
  return fakes::run_step(job, 0, step, inputs, outputs);
}

bool wait_until(const std::function<bool()>& done) {
  const auto deadline = std::chrono::steady_clock::now() + 10s;
  while (!done()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::yield();
  }
  return true;
}

class StaleAcrossJobsTest : public ::testing::TestWithParam<bool> {};

TEST_P(StaleAcrossJobsTest, ALateMessageOfTheFinishedJobIsNeverSummedIntoTheNext) {
  PipelineOptions o;
  o.settings.compression = GetParam();  // sparse all-gather of every element, or the dense ring
  o.settings.params.density = 1.0;
  o.step_timeout = 10000ms;
  o.join_timeout = 10000ms;
  PipelineJob job(2, o);
  std::vector<std::vector<float>> out;

  // Job 1: steps 0..4 agree.
  register_everywhere(job);
  for (uint64_t s = 0; s < 5; ++s) {
    for (const auto& r : uniform_step(job, s, 1.0f, out)) ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  }
  // Rank 1's trainer submits step 5 (500 everywhere) while rank 0's trainer has already left.
  // Rank 1's messages are held on the wire until both nodes have reset.
  job.net.hold(1);
  const uint64_t delivered_before = job.net.delivered();
  std::vector<float> in1(kN, 500.0f), out1(kN);
  job.nodes[1]->pipeline->submit(step_job(5, in1, out1));
  ASSERT_TRUE(wait_until([&] { return job.net.queued() > 0; })) << "rank 1 never sent its step-5 message";
  job.nodes[0]->pipeline->reset();
  job.nodes[1]->pipeline->reset();
  // Now the late step-5 message (and rank 1's abort of it) reach rank 0, between its jobs.
  job.net.release();
  EXPECT_FALSE(job.nodes[1]->results.wait(0, 5).status.ok());
  ASSERT_TRUE(wait_until([&] { return job.net.delivered() > delivered_before; }));

  // Job 2 on the same pipelines: step 0, then step 5 again; the trainers submit 1 and 3.
  register_everywhere(job);
  std::vector<std::vector<float>> inputs{std::vector<float>(kN, 1.0f), std::vector<float>(kN, 3.0f)};
  for (uint64_t s : {0u, 5u}) {
    auto res = fakes::run_step(job, 0, s, inputs, out);
    for (uint32_t r = 0; r < 2; ++r) {
      ASSERT_TRUE(res[r].status.ok()) << "rank " << r << " step " << s << ": " << res[r].status.to_string();
      for (float v : out[r]) ASSERT_EQ(v, 2.0f) << "rank " << r << " step " << s << " summed something else";
    }
  }
  EXPECT_GE(job.nodes[0]->mailbox->stale(), 1u) << "the late message was dropped and counted";
}

INSTANTIATE_TEST_SUITE_P(SparseAndDense, StaleAcrossJobsTest, ::testing::Bool(),
                         [](const auto& p) { return p.param ? "sparse" : "dense_ring"; });

TEST(ResetTest, EveryJobAfterAResetRuns) {
  PipelineOptions o;
  o.step_timeout = 10000ms;
  o.join_timeout = 10000ms;
  PipelineJob job(2, o);
  std::vector<std::vector<float>> out;
  for (int j = 0; j < 100; ++j) {
    register_everywhere(job);
    for (const auto& r : uniform_step(job, 0, 1.0f, out)) {
      ASSERT_TRUE(r.status.ok()) << "job " << j << ": " << r.status.to_string();
    }
    for (auto& n : job.nodes) n->pipeline->reset();
  }
}

// Registrations still queued when the job ends would only allocate buffers the Reset frees.
TEST(ResetTest, QueuedRegistrationsOfTheFinishedJobAreDropped) {
  Mailbox box(0, 1, nullptr);
  PipelineOptions o;
  Pipeline p(o, nullptr, &box, nullptr);  // not started: every command stays queued
  for (uint32_t t = 0; t < 3; ++t) ASSERT_TRUE(p.register_tensor(t, {"w" + std::to_string(t), 1u << 20}).ok());
  EXPECT_EQ(p.snapshot().queued, 3u);
  p.reset();
  EXPECT_EQ(p.snapshot().queued, 1u) << "only the Reset itself";
}

// Rank 1 sends a step-0 message of the wrong size, so rank 0's all-gather fails while its own
// send to rank 1 is still held on the wire. The collective must not return before that send
// completed: the caller rewrites the payload as soon as it returns.
TEST(CollectiveTest, AFailedAllGatherWaitsForItsSendsBeforeReturning) {
  fakes::FakeNetwork net(2);
  Mailbox box0(0, 2, nullptr), box1(0, 2, nullptr);
  net.attach(0, &box0);
  net.attach(1, &box1);
  std::atomic<bool> rank0_send_delivered{false};
  net.set_tap([&](uint32_t from, uint32_t, std::span<const std::byte>, std::span<const std::byte>) {
    if (from == 0) rank0_send_delivered = true;
  });
  net.hold(0);

  // Rank 1's bad message: 4 elements where rank 0 has 8.
  std::vector<float> small(4, 1.0f);
  ExchangeContext c1;
  c1.transport = net.transport(1);
  c1.mailbox = &box1;
  c1.rank = 1;
  c1.world_size = 2;
  c1.deadline = std::chrono::steady_clock::now() + 10s;
  std::vector<float> out1(4);
  ExchangeStats stats1;
  std::thread rank1([&] {
    auto payload = std::as_bytes(std::span<const float>(small));
    sparse_allgather(c1, 0, 0, kernels::Format::kDense, kernels::ValueType::kF32, 4, payload, out1, &stats1)
        .ignore();  // it fails too (rank 0's message is the wrong size for it): not under test
  });

  std::vector<float> mine(kN, 2.0f), out0(kN);
  ExchangeContext c0 = c1;
  c0.transport = net.transport(0);
  c0.mailbox = &box0;
  c0.rank = 0;
  std::thread releaser([&] {
    std::this_thread::sleep_for(200ms);  // long enough for an early return to show
    net.release();
  });
  ExchangeStats stats0;
  Status s = sparse_allgather(c0, 0, 0, kernels::Format::kDense, kernels::ValueType::kF32, kN,
                              std::as_bytes(std::span<const float>(mine)), out0, &stats0);
  const bool delivered_at_return = rank0_send_delivered.load();
  releaser.join();
  rank1.join();
  EXPECT_EQ(s.code(), Code::kDataLoss) << s.to_string();
  EXPECT_TRUE(delivered_at_return) << "returned while its send to rank 1 was still in flight";
}

}  // namespace
}  // namespace sparsecar
