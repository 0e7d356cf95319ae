// Observation text from peers (rank 0's controllers read it): what a node formats parses back to
// the same values, and values no honest peer sends — negative counts, counts beyond 2^53, ranks
// beyond 2^32, impossible tensor lines — are refused instead of cast (a negative double cast to
// an unsigned integer is undefined behaviour).
#include "daemon/pipeline/observations.h"

#include <gtest/gtest.h>

#include <bit>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <limits>
#include <mutex>
#include <sstream>
#include <string>
#include <vector>

#include "daemon/config/config.h"
#include "daemon/transport/wire.h"
#include "sparsecar/policies/cost_model.h"
#include "tests/unit/common/fake_clock.h"
#include "tests/unit/daemon/fake_transport.h"

namespace sparsecar {
namespace {

TEST(ObservationText, RoundTrip) {
  policies::NodeObservation o;
  o.rank = 3;
  o.step = 123456789;
  o.elements = 1u << 20;
  o.nnz = 1048;
  o.bytes_sent = 9000;
  o.dense_bytes = 8u << 20;
  o.exchange_s = 0.25;
  o.link_bytes = 77;
  o.link_s = 0.5;
  o.loss = -1.5;  // a loss may be negative (e.g. a log-likelihood)
  o.has_loss = true;
  o.tensors.push_back({7, 1000, 10, 0.5});
  o.tensors.push_back({8, 10, 10, -1.0});  // -1: repeat fraction unknown
  auto back = parse_observation(format_observation(o));
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->rank, 3u);
  EXPECT_EQ(back->step, 123456789u);
  EXPECT_EQ(back->elements, 1u << 20);
  EXPECT_EQ(back->nnz, 1048u);
  EXPECT_EQ(back->bytes_sent, 9000u);
  EXPECT_EQ(back->dense_bytes, 8u << 20);
  EXPECT_EQ(back->link_bytes, 77u);
  EXPECT_DOUBLE_EQ(back->exchange_s, 0.25);
  EXPECT_DOUBLE_EQ(back->loss, -1.5);
  ASSERT_EQ(back->tensors.size(), 2u);
  EXPECT_EQ(back->tensors[0].tensor_id, 7u);
  EXPECT_EQ(back->tensors[0].nnz, 10u);
  EXPECT_DOUBLE_EQ(back->tensors[1].repeat_fraction, -1.0);
}

TEST(ObservationText, OutOfRangeValuesAreRefusedNotCast) {
  for (const char* text : {"step -1\n", "nnz -0.5\n", "rank 4294967296\n", "rank 1e300\n", "bytes_sent 1e30\n",
                           "step 9007199254740994\n" /* 2^53 + 2 */, "exchange_s -2\n", "link_s nan\n",
                           "tensor -1 5 1 0.5\n", "tensor 1 5 9 0.5\n", "tensor 1 -5 0 0.5\n", "tensor 1 5 1 2\n",
                           "tensor 1 5 1 -3\n", "tensor 4294967296 5 1 0.5\n"}) {
    auto o = parse_observation(text);
    EXPECT_FALSE(o.ok()) << "accepted: " << text;
    if (!o.ok()) {
      EXPECT_EQ(o.status().code(), Code::kDataLoss) << text;
    }
  }
  // The limits themselves are fine.
  auto o = parse_observation("rank 4294967295\nstep 9007199254740992\n");
  ASSERT_TRUE(o.ok()) << o.status().to_string();
  EXPECT_EQ(o->rank, 4294967295u);
  EXPECT_EQ(o->step, uint64_t{1} << 53);
}

TEST(ObservationText, MagnitudeHistogramsRoundTripAsKeysOlderPeersSkip) {
  policies::NodeObservation o;
  o.elements = 6;
  o.nnz = 2;
  o.magnitude_hist.assign(policies::kMagnitudeBins, 0);
  o.gradient_hist.assign(policies::kMagnitudeBins, 0);
  const std::vector<float> e = {0.0f, 1e-3f, -2.5f, 3e4f, 7.0f, -7.0f};
  const std::vector<float> g = {1e-9f, 0.5f};
  policies::magnitude_hist_add(o.magnitude_hist, e);
  policies::magnitude_hist_add(o.gradient_hist, g);
  o.magnitude_elements = 6;
  o.threshold = 2.0;
  const std::string text = format_observation(o);
  auto back = parse_observation(text);
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->magnitude_hist, o.magnitude_hist);
  EXPECT_EQ(back->gradient_hist, o.gradient_hist);
  EXPECT_EQ(back->magnitude_elements, 6u);
  EXPECT_DOUBLE_EQ(back->threshold, 2.0);
  // Only nonzero bins travel, each as one "key value" line: a parser that predates them reads
  // them as unknown keys and skips them.
  size_t bin_lines = 0;
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.rfind("mh", 0) != 0 && line.rfind("gh", 0) != 0) continue;
    ++bin_lines;
    std::istringstream words(line);
    std::string key, value, extra;
    EXPECT_TRUE(words >> key >> value) << line;
    EXPECT_FALSE(words >> extra) << line;
  }
  EXPECT_EQ(bin_lines, 5u + 2u) << text;  // 7.0 and -7.0 share a bin
  // Without histograms nothing is added.
  policies::NodeObservation plain;
  EXPECT_EQ(format_observation(plain).find("mh"), std::string::npos);
  auto none = parse_observation(format_observation(plain));
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->magnitude_hist.empty());
}

TEST(ObservationText, StepCostsAndLinkSamplesRoundTrip) {
  policies::NodeObservation o;
  o.rank = 1;
  o.decode_s = 0.003;
  o.reduce_s = 0.0005;
  o.link_samples.push_back({.peer = 0, .bytes = 4096, .seconds = 1.25e-4});
  o.link_samples.push_back({.peer = 2, .bytes = 2'400'080, .seconds = 0.0192});
  o.period_s = 0.0421;
  auto back = parse_observation(format_observation(o));
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_DOUBLE_EQ(back->period_s, 0.0421);
  EXPECT_DOUBLE_EQ(back->decode_s, 0.003);
  EXPECT_DOUBLE_EQ(back->reduce_s, 0.0005);
  ASSERT_EQ(back->link_samples.size(), 2u);
  EXPECT_EQ(back->link_samples[1].peer, 2u);
  EXPECT_EQ(back->link_samples[1].bytes, 2'400'080u);
  EXPECT_NEAR(back->link_samples[1].seconds, 0.0192, 1e-12);
  // rank 0 merges them as links peer -> rank; its own rank and ranks beyond the job are dropped.
  policies::NodeObservation self = *back;
  self.link_samples.push_back({.peer = 1, .bytes = 10, .seconds = 1.0});
  self.link_samples.push_back({.peer = 9, .bytes = 10, .seconds = 1.0});
  policies::NodeObservation other;
  other.rank = 0;
  other.link_samples.push_back({.peer = 1, .bytes = 100, .seconds = 0.5});
  other.period_s = 0.05;
  const auto j = policies::merge_observations(std::vector<policies::NodeObservation>{self, other}, 3);
  ASSERT_EQ(j.link_samples.size(), 3u);
  EXPECT_EQ(j.link_samples[0].from, 0u);
  EXPECT_EQ(j.link_samples[0].to, 1u);
  EXPECT_EQ(j.link_samples[2].from, 1u);
  EXPECT_EQ(j.link_samples[2].to, 0u);
  EXPECT_DOUBLE_EQ(j.decode_s, 0.003);
  EXPECT_DOUBLE_EQ(j.period_s, 0.05) << "the longest node's";
}

TEST(ObservationText, DeviceElementsRoundTripAndTheJobsAreTheLeastOfItsNodes) {
  // The elements a node compressed on a GPU (the step controller prices their encode by a GPU's
  // prior); the job's: those every node compressed there (a host node's cores set the pace).
  policies::NodeObservation gpu;
  gpu.rank = 0;
  gpu.elements = 3000;
  gpu.device_elements = 3000;
  auto back = parse_observation(format_observation(gpu));
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->device_elements, 3000u);
  policies::NodeObservation host = gpu;
  host.rank = 1;
  host.device_elements = 0;
  back = parse_observation(format_observation(host));
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->device_elements, 0u);
  EXPECT_EQ(policies::merge_observations(std::vector<policies::NodeObservation>{gpu, *back}, 2).device_elements, 0u);
  EXPECT_EQ(policies::merge_observations(std::vector<policies::NodeObservation>{gpu, gpu}, 2).device_elements, 3000u);
  auto bad = parse_observation("elements 10\ndevice_elements 11\n");
  ASSERT_FALSE(bad.ok()) << "more elements on the GPU than the node has";
  EXPECT_EQ(bad.status().code(), Code::kDataLoss);
}

TEST(ObservationText, TrainerElementsRoundTripAndTheJobsAreTheLeastOfItsNodes) {
  // Elements of dense steps the trainers all-reduced (dense_collective=trainer): their exchange
  // is in the step's period, not in exchange_s (the step controller times them by the period).
  policies::NodeObservation n;
  n.elements = 500;
  n.trainer_elements = 500;
  auto back = parse_observation(format_observation(n));
  ASSERT_TRUE(back.ok()) << back.status().to_string();
  EXPECT_EQ(back->trainer_elements, 500u);
  policies::NodeObservation ring = n;
  ring.rank = 1;
  ring.trainer_elements = 0;
  EXPECT_EQ(policies::merge_observations(std::vector<policies::NodeObservation>{n, ring}, 2).trainer_elements, 0u);
  EXPECT_EQ(policies::merge_observations(std::vector<policies::NodeObservation>{n, n}, 2).trainer_elements, 500u);
  auto bad = parse_observation("elements 10\ntrainer_elements 11\n");
  ASSERT_FALSE(bad.ok()) << "more elements reduced by the trainers than the node has";
  EXPECT_EQ(bad.status().code(), Code::kDataLoss);
}

TEST(StepPeriod, SecondsBetweenConsecutiveStepsOnly) {
  StepPeriod p;
  const Clock::time_point t0{std::chrono::seconds(100)};
  EXPECT_EQ(p.on_finish(7, t0), 0.0) << "the first step seen";
  EXPECT_DOUBLE_EQ(p.on_finish(8, t0 + std::chrono::milliseconds(40)), 0.040);
  EXPECT_EQ(p.on_finish(10, t0 + std::chrono::milliseconds(90)), 0.0) << "step 9 never finished here";
  EXPECT_DOUBLE_EQ(p.on_finish(11, t0 + std::chrono::milliseconds(105)), 0.015);
  EXPECT_EQ(p.on_finish(12, t0 + std::chrono::milliseconds(105)), 0.0) << "no time passed";
  p.reset();
  EXPECT_EQ(p.on_finish(13, t0 + std::chrono::milliseconds(200)), 0.0) << "a reset: a new job";
  // On the wire: a bad period is refused, an unknown one not sent.
  EXPECT_FALSE(parse_observation("period_s -0.5\n").ok());
  EXPECT_FALSE(parse_observation("period_s 1e9\n").ok());
  EXPECT_EQ(format_observation(policies::NodeObservation{}).find("period_s"), std::string::npos)
      << "unknown periods are not sent";
}

// A step that leased the trainers its next steps (StepResult::lease_steps): the next step seen
// may come after any of them, and the period is the mean per step since the last one seen.
TEST(StepPeriod, AcrossALeaseTheMeanPerStep) {
  StepPeriod p;
  const Clock::time_point t0{std::chrono::seconds(100)};
  EXPECT_EQ(p.on_finish(2, t0, 5), 0.0);
  EXPECT_DOUBLE_EQ(p.on_finish(8, t0 + std::chrono::milliseconds(60), 5), 0.010) << "steps 3-7 leased: 60 ms / 6";
  EXPECT_DOUBLE_EQ(p.on_finish(11, t0 + std::chrono::milliseconds(90), 0), 0.010) << "took 2 of the 5: 30 ms / 3";
  EXPECT_EQ(p.on_finish(13, t0 + std::chrono::milliseconds(110), 0), 0.0) << "step 11 leased nothing: 12 is lost";
  EXPECT_EQ(p.on_finish(20, t0 + std::chrono::milliseconds(200), 2), 0.0) << "past the lease of step 13 (none)";
  EXPECT_EQ(p.on_finish(24, t0 + std::chrono::milliseconds(240), 0), 0.0) << "past the lease of step 20 (2)";
}

TEST(TrainerCompute, TheTrainersOwnReportWinsOverTheHooksTiming) {
  EXPECT_EQ(trainer_compute_s({}), -1) << "nothing reported: unknown";
  EXPECT_EQ(trainer_compute_s({{"loss", 0.3}}), -1);
  EXPECT_DOUBLE_EQ(trainer_compute_s({{"hook_compute_time", 0.012}}), 0.012) << "the hook's alone";
  EXPECT_DOUBLE_EQ(trainer_compute_s({{"hook_compute_time", 0.012}, {"step_time_ms", 9}}), 0.009);
  EXPECT_DOUBLE_EQ(trainer_compute_s({{"hook_compute_time", 0.012}, {"compute_time_ms", 7}, {"step_time_ms", 9}}),
                   0.007);
  EXPECT_DOUBLE_EQ(trainer_compute_s({{"hook_compute_time", 0.012}, {"compute_time", 0.005}, {"compute_time_ms", 7}}),
                   0.005);
  // A time no step takes is unknown, not a price: the hook's timing is not used in its place.
  for (double bad : {-0.5, 4000.0, std::numeric_limits<double>::infinity(), std::nan("")}) {
    EXPECT_EQ(trainer_compute_s({{"compute_time", bad}, {"hook_compute_time", 0.012}}), -1) << bad;
  }
}

TEST(ObservationText, BadLinkSamplesAreRefused) {
  for (const char* text : {"lk -1 5 0.1\n", "lk 1 0 0.1\n", "lk 1 5 -0.1\n", "lk 1 5 nan\n", "lk 1 5\n",
                           "lk 1 5 1e9\n", "lk 4294967296 5 0.1\n", "lk 1 -5 0.1\n", "decode_s -1\n"}) {
    auto o = parse_observation(text);
    EXPECT_FALSE(o.ok()) << "accepted: " << text;
  }
}

TEST(ObservationText, BadHistogramBinsAreRefused) {
  for (const char* text : {"mh2048 1\n", "mhx 1\n", "mh5 -1\n", "gh-1 3\n", "gh3x 1\n", "mh1 1e300\n",
                           "threshold -1\n"}) {
    auto o = parse_observation(text);
    EXPECT_FALSE(o.ok()) << "accepted: " << text;
  }
  // Bins without the elements they cover are dropped, not guessed at.
  auto o = parse_observation("mh5 3\ngh5 1\n");
  ASSERT_TRUE(o.ok());
  EXPECT_TRUE(o->magnitude_hist.empty());
}

// Rank 0's side of a FakeNetwork: the observations its peers send, parsed.
class ObservationInbox final : public MessageSink {
 public:
  void on_message(uint32_t, std::span<const std::byte> header, std::span<const std::byte> payload) override {
    wire::WireHeader h{};
    ASSERT_GE(header.size(), sizeof h);
    std::memcpy(&h, header.data(), sizeof h);
    if (h.kind != static_cast<uint16_t>(wire::Kind::kObservation)) return;
    auto o = parse_observation(std::string_view(reinterpret_cast<const char*>(payload.data()), payload.size()));
    ASSERT_TRUE(o.ok()) << o.status().to_string();
    std::lock_guard<std::mutex> lock(mu_);
    got_.push_back(*o);
    cv_.notify_all();
  }
  void on_peer_failed(uint32_t, const Status&) override {}
  std::vector<policies::NodeObservation> wait_for(size_t n, std::chrono::milliseconds within = std::chrono::seconds(10)) {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait_for(lock, within, [&] { return got_.size() >= n; });
    return got_;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<policies::NodeObservation> got_;
};

TEST(ObservationCollector, BudgetHistogramsFromTheGpuAddUpAsTheHostsDo) {
  // A node with two tensors under `budget`: one compressed by the host (the collector bins its
  // spans), one on a GPU (the record carries the bins the device measured). The node's
  // observation holds both: here the device's bins are the plain count of the same values, so
  // the sum must equal binning every span on the host. A device step without its bins (measured
  // off, or a failed histogram) drops the step's histograms, as any tensor the collector cannot
  // bin does.
  fakes::FakeNetwork net(2);
  ObservationInbox inbox;
  net.attach(0, &inbox);
  ObservationCollector collector(1, 7, net.transport(1), nullptr);
  auto config = std::make_shared<Config>();
  config->controller = "budget";
  Decision decision;
  decision.config = config;

  const std::vector<float> host_residual = {0.0f, -0.25f, 3.0f, 0.0f};  // after the commit
  const std::vector<float> host_selected = {-7.5f, 12.0f};
  const std::vector<float> host_sum = {1.0f, -0.5f, 2.0f, 9.0f};
  const std::vector<float> dev_residual = {0.125f, 0.0f, -1e-3f, 5.0f, 0.0f, 2.5f};
  const std::vector<float> dev_selected = {40.0f};
  const std::vector<float> dev_sum = {0.5f, -8.0f, 1e-30f, 4.0f, 3.0f, -2.0f};
  std::vector<uint64_t> dev_mh(policies::kMagnitudeBins, 0), dev_gh(policies::kMagnitudeBins, 0);
  for (const auto* v : {&dev_residual, &dev_selected}) {
    for (float x : *v) ++dev_mh[(std::bit_cast<uint32_t>(x) & 0x7fffffffu) >> 20];
  }
  for (float x : dev_sum) ++dev_gh[(std::bit_cast<uint32_t>(x) & 0x7fffffffu) >> 20];

  auto record = [&](uint32_t id, uint64_t step, bool device, bool with_bins) {
    TensorStepRecord r;
    r.tensor_id = id;
    r.step = step;
    r.tensors_in_job = 2;
    r.plan.dense = false;
    r.plan.selector = kernels::Selector::kThreshold;
    if (!device) {
      r.elements = host_sum.size();
      r.nnz = host_selected.size();
      r.local_sum = host_sum;
      r.residual = host_residual;
      r.selected = host_selected;
    } else {
      r.elements = dev_sum.size();
      r.nnz = dev_selected.size();
      r.on_device = true;
      r.grad_norm2 = 1;
      r.residual_norm2 = 1;
      if (with_bins) {
        r.magnitude_hist = dev_mh;
        r.gradient_hist = dev_gh;
      }
    }
    collector.on_tensor_step(r, decision);
    collector.after_complete();  // as the pipeline does once the step's result went out
  };
  record(0, 5, false, false);
  record(1, 5, true, true);
  record(0, 6, false, false);
  record(1, 6, true, false);
  const auto got = inbox.wait_for(2);
  ASSERT_EQ(got.size(), 2u);

  std::vector<uint64_t> want_mh(policies::kMagnitudeBins, 0), want_gh(policies::kMagnitudeBins, 0);
  for (const auto* v : {&host_residual, &host_selected, &dev_residual, &dev_selected}) {
    policies::magnitude_hist_add(want_mh, *v);
  }
  for (const auto* v : {&host_sum, &dev_sum}) policies::magnitude_hist_add(want_gh, *v);
  EXPECT_EQ(got[0].step, 5u);
  EXPECT_EQ(got[0].magnitude_elements, host_sum.size() + dev_sum.size());
  EXPECT_EQ(got[0].magnitude_hist, want_mh);
  EXPECT_EQ(got[0].gradient_hist, want_gh);
  EXPECT_EQ(got[0].device_elements, dev_sum.size());
  EXPECT_EQ(got[1].step, 6u);
  EXPECT_EQ(got[1].magnitude_elements, 0u) << "a device step without its bins: no histograms for the step";
  EXPECT_TRUE(got[1].magnitude_hist.empty());
}


// A dense tensor step of 4 elements, one of a job's 2 tensors.
TensorStepRecord dense_record(uint32_t id, uint64_t step) {
  TensorStepRecord r;
  r.tensor_id = id;
  r.step = step;
  r.tensors_in_job = 2;
  r.elements = 4;
  r.nnz = 4;
  r.plan.dense = true;
  return r;
}

// A node's observation of a step leaves for rank 0 only in after_complete(), which the pipeline
// calls once the step's result went to its trainer: the step does not wait for it.
TEST(ObservationCollector, AnObservationLeavesAfterTheStepsResultNotBefore) {
  fakes::FakeNetwork net(2);
  ObservationInbox inbox;
  net.attach(0, &inbox);
  ObservationCollector collector(1, 7, net.transport(1), nullptr);
  Decision decision;
  decision.config = std::make_shared<Config>();
  auto record = [&](uint32_t id, uint64_t step) { collector.on_tensor_step(dense_record(id, step), decision); };
  record(0, 3);
  record(1, 3);  // the step's last tensor: the observation is finished ...
  EXPECT_EQ(collector.finished(), 1u);
  EXPECT_TRUE(inbox.wait_for(1, std::chrono::milliseconds(200)).empty()) << "... but not sent yet";
  collector.after_complete();
  auto got = inbox.wait_for(1);
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].step, 3u);
  EXPECT_EQ(got[0].elements, 8u);
  collector.after_complete();  // nothing new: nothing sent
  record(0, 4);
  record(1, 4);                // step 4 finished, not yet sent, when its job ends:
  collector.on_reset();        // a reset drops what the finished job left ...
  record(0, 0);
  record(1, 0);
  collector.after_complete();  // ... and the next job's first step goes alone
  got = inbox.wait_for(2);
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[1].step, 0u);
  EXPECT_TRUE(inbox.wait_for(3, std::chrono::milliseconds(200)).size() == 2u);
}

// The period after a leased step: the trainers skip the least lease of the step's tensors (the
// DDP hook takes the least over its slices), so a gap longer than that is no lease's.
TEST(ObservationCollector, APeriodAcrossALeaseIsTheMeanOverTheStepsOfTheLeastTensorsLease) {
  fakes::FakeNetwork net(2);
  ObservationInbox inbox;
  net.attach(0, &inbox);
  testing::FakeClock clock;
  ObservationCollector collector(1, 7, net.transport(1), nullptr, clock);
  Decision decision;
  decision.config = std::make_shared<Config>();
  auto step = [&](uint64_t s, uint32_t lease0, uint32_t lease1) {
    for (uint32_t id = 0; id < 2; ++id) {
      TensorStepRecord r = dense_record(id, s);
      r.trainer_reduced = true;
      r.lease_steps = id == 0 ? lease0 : lease1;
      collector.on_tensor_step(r, decision);
      collector.after_complete();
    }
  };
  step(2, 9, 4);                                 // tensor 1 leases steps 3-6 only
  clock.advance(std::chrono::milliseconds(50));
  step(7, 4, 4);                                 // 50 ms over 5 steps
  clock.advance(std::chrono::milliseconds(60));
  step(13, 0, 0);                                // 8-11 leased, 12 not: not a period
  const auto got = inbox.wait_for(3);
  ASSERT_EQ(got.size(), 3u);
  EXPECT_EQ(got[0].period_s, 0.0);
  EXPECT_DOUBLE_EQ(got[1].period_s, 0.010);
  EXPECT_EQ(got[2].period_s, 0.0) << "step 13 came after step 7's least lease (4) ran out";
}

// A node's observation carries ||local sum||^2 only for the controllers that read it (accuracy,
// gradnorm): on the host it is a pass over the gradient before the step's result goes out. The
// residual's norm (the total error in status) is there for every job-level controller.
// Rank 1's collector under `controller`, whose observations reach `inbox` (rank 0's).
struct RankOneCollector {
  explicit RankOneCollector(const char* controller) : collector(1, 7, net.transport(1), nullptr) {
    net.attach(0, &inbox);
    auto config = std::make_shared<Config>();
    config->controller = controller;
    decision.config = config;
  }
  ObservationInbox inbox;
  fakes::FakeNetwork net{2};
  ObservationCollector collector;
  Decision decision;
};

// A sparse step's record of one tensor of `tensors` (residual and local sum left to the caller).
TensorStepRecord sparse_record(uint32_t tensor_id, uint64_t step, uint32_t tensors, uint64_t elements, uint64_t nnz) {
  TensorStepRecord r;
  r.tensor_id = tensor_id;
  r.step = step;
  r.tensors_in_job = tensors;
  r.elements = elements;
  r.nnz = nnz;
  r.plan.dense = false;
  return r;
}

TEST(ObservationCollector, TheGradientsNormIsMeasuredOnlyForTheControllersThatReadIt) {
  const std::vector<float> sum = {3.0f, -4.0f, 0.5f, 2.0f};
  const std::vector<float> residual = {0.0f, -0.25f, 0.5f, 0.0f};
  const double want_g = 9.0 + 16.0 + 0.25 + 4.0, want_e = 0.0625 + 0.25;
  for (const char* controller : {"step", "bandwidth", "accuracy", "gradnorm", "step,accuracy"}) {
    SCOPED_TRACE(controller);
    RankOneCollector node(controller);
    auto& [inbox, net, collector, decision] = node;
    TensorStepRecord r = sparse_record(0, 4, 1, sum.size(), 2);
    r.local_sum = sum;
    r.residual = residual;
    collector.on_tensor_step(r, decision);
    collector.after_complete();
    const auto got = inbox.wait_for(1);
    ASSERT_EQ(got.size(), 1u);
    const std::string c = controller;
    const bool reads = c.find("accuracy") != std::string::npos || c == "gradnorm";
    EXPECT_DOUBLE_EQ(got[0].grad_norm2, reads ? want_g : 0.0);
    EXPECT_DOUBLE_EQ(got[0].residual_norm2, want_e);
  }
}

// A host step's residual norm comes after its result went out (TensorStepRecord::kNormLater, then
// on_residual_norm2, before after_complete): the observation holds the sum over the step's
// tensors, whether the step's last record finished it already or not; a controller that is not a
// job-level one gets none.
TEST(ObservationCollector, AResidualNormThatComesAfterTheResultJoinsItsStepsObservation) {
  for (const char* controller : {"step", "static"}) {
    SCOPED_TRACE(controller);
    RankOneCollector node(controller);
    auto& [inbox, net, collector, decision] = node;
    const std::vector<float> residual = {100.0f, 100.0f};  // not read: the norm comes later
    for (uint32_t id = 0; id < 2; ++id) {
      TensorStepRecord r = sparse_record(id, 5, 2, residual.size(), 1);
      r.residual = residual;
      r.residual_norm2 = TensorStepRecord::kNormLater;
      collector.on_tensor_step(r, decision);          // the second finishes the step's observation
      collector.on_residual_norm2(id, 5, 0.25 + id);  // as the pipeline: after the result
      collector.on_residual_norm2(id, 4, 1000.0);     // another step's: not this one's
      collector.after_complete();
    }
    const auto got = inbox.wait_for(1);
    ASSERT_EQ(got.size(), 1u);
    EXPECT_DOUBLE_EQ(got[0].residual_norm2, std::string(controller) == "step" ? 0.25 + 1.25 : 0.0);
  }
}

// The first link probe of a sparse plan keeps to step_probe_share too: it waits for what a ring
// step over the link took lately (the probe's bytes are a ring step's here) / the share, and at
// least LinkProbe::kStartAfter. What the ring took: the trainers' dense iterations before the
// first step (their wait on the all-reduce, the DDP hook's start hint), or the daemons' last ring
// step; neither known: kStartAfter. Times the ring's distance (LinkProbe): the hint's whole dense
// step over the sparse steps' price (10 ms a step here, step_dense_worth 1), from 1 to 8. But
// where the hint's is the only ring the job has (no daemons' ring step) and it is within
// LinkProbe::kEarlyDistance of the sparse price, the job's first probe goes
// LinkProbe::kEarlySteps into the plan (the early probe, tested in link_probe_test).
TEST(ObservationCollector, TheFirstLinkProbeWaitsForARingStepsTimeOverTheShare) {
  struct Case {
    const char* name;
    double hint_wait_s;   // > 0: the trainers report their dense iterations before step 0
    double hint_step_s;   // and their whole step
    double ring_exchange_s;  // > 0: step 0 runs the daemons' ring and took this
    std::chrono::milliseconds first;  // the first probe, from the sparse plan's start
    bool early = false;               // ... or the early probe's step instead
  };
  using std::chrono::milliseconds;
  const Case cases[] = {
      {"a slow link's hint: 80 ms / 2 %, its 90 ms step 9x the sparse price: 8x", 0.08, 0.09, 0, milliseconds(32000)},
      {"a slow link's hint: 30 ms / 2 %, its 40 ms step 4x the sparse price", 0.03, 0.04, 0, milliseconds(6000)},
      {"a slow ring step: 50 ms / 2 % (its step's period unknown: the job's first)", 0, 0, 0.05, milliseconds(2500)},
      {"a fast link's hint, its 14 ms step 1.4x the sparse price: early", 0.004, 0.014, 0, milliseconds(0), true},
      {"the same hint, then the daemons' ring (4 ms): 4 ms / 2 % x 1.4, at least 1 s", 0.004, 0.014, 0.004,
       milliseconds(1000)},
      {"nothing known: 1 s", 0, 0, 0, milliseconds(1000)},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    // The inbox and the clock (read by a probe's completion) outlive the network's delivery thread.
    testing::FakeClock clock;
    ObservationInbox inbox;
    fakes::FakeNetwork net(2);
    net.attach(0, &inbox);
    ObservationCollector collector(1, 7, net.transport(1), nullptr, clock);
    auto config = std::make_shared<Config>();
    config->controller = "step";
    config->step_probe_share = 0.02;
    config->step_dense_worth = 1.0;
    Decision decision;
    decision.config = config;
    // One tensor of 65 536 elements over 2 nodes: the ring sends the successor 2 chunks of 32 768
    // floats a step, and so does the probe (256 KiB).
    auto step = [&](uint64_t s, bool dense, double exchange_s) {
      TensorStepRecord r;
      r.tensor_id = 0;
      r.step = s;
      r.tensors_in_job = 1;
      r.elements = 65'536;
      r.nnz = dense ? r.elements : 300;
      r.plan.dense = dense;
      r.exchange_s = exchange_s;
      r.dense_bytes = policies::ring_allreduce_bytes(r.elements, 2);  // as the pipeline fills it
      collector.on_tensor_step(r, decision);
      collector.after_complete();
    };
    uint64_t s = 0;
    if (c.hint_wait_s > 0) {
      collector.on_metric("dense_wait_s", c.hint_wait_s, 0);
      collector.on_metric("dense_step_s", c.hint_step_s, 0);
    }
    if (c.ring_exchange_s > 0) step(s++, true, c.ring_exchange_s);
    const auto start = clock.now();
    const uint64_t plan = s;
    step(s++, false, 0.001);  // the sparse plan's first step
    while (clock.now() - start < c.first) {
      EXPECT_EQ(collector.probes_sent(), 0u) << "at " << (clock.now() - start).count() << " ns";
      clock.advance(milliseconds(10));
      step(s++, false, 0.001);
    }
    // Due at the step of `first` (10 ms a step); it goes at the next step of its grid
    // (LinkProbe::grid_for, tested in link_probe_test), where the other nodes' probes go too.
    const uint64_t due = c.early ? plan + LinkProbe::kEarlySteps : s - 1, waited = due - plan;
    const uint64_t at = LinkProbe::next_on_grid(due, LinkProbe::grid_for(waited, 0));
    while (s <= at) {
      EXPECT_EQ(collector.probes_sent(), 0u) << "step " << s - 1 << ": due at " << due << ", goes at " << at;
      clock.advance(milliseconds(10));
      step(s++, false, 0.001);
    }
    EXPECT_EQ(collector.probes_sent(), 1u) << "at step " << s - 1 << ", " << (clock.now() - start).count() << " ns";
  }
}

}  // namespace
}  // namespace sparsecar
