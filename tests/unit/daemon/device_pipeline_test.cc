// The pipeline's device path (DESIGN §8, device_compressor.h) against its host path: W nodes joined
// by the in-process FakeNetwork run the same steps twice, once with host tensors (the CPU
// kernels) and once with device tensors in GPU memory (the CUDA kernels, pinned staging, device
// decode), and every node's averaged gradient must be the same bits. The CUDA kernels equal the
// CPU ones bit for bit (cuda.h), the local sum is the session's float64 sum, so any difference is
// a bug of the device path. Label gpu: the tests that need a GPU skip without one; the refusal
// test runs everywhere.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <ostream>
#include <string>
#include <vector>

#include "daemon/pipeline/device_compressor.h"
#include "sparsecar/kernels/cuda.h"
#include "sparsecar/kernels/select.h"
#include "sparsecar/policies/observations.h"
#include "tests/unit/common/fake_clock.h"
#include "tests/unit/daemon/pipeline_job.h"

namespace sparsecar {
namespace {

namespace cu = kernels::cuda;
using fakes::PipelineJob;

#define SKIP_WITHOUT_GPU()                                                                            \
  do {                                                                                                \
    if (cu::device_count() == 0) {                                                                    \
      GTEST_SKIP() << "no CUDA GPU here (" << (cu::built() ? "built with CUDA" : "built without CUDA") \
                   << "): the device path runs on a GPU machine (docs/gpu.md)";                        \
    }                                                                                                 \
  } while (0)

// One trainer's tensor in GPU memory with its two events (in-process: no IPC needed here).
struct DeviceTensor {
  explicit DeviceTensor(size_t n, int device = 0) : count(n) {
    if (!cu::set_device(device).ok()) return;
    auto p = cu::device_alloc(n * sizeof(float));
    auto r = cu::event_create();
    auto d = cu::event_create();
    auto s = cu::stream_create();
    if (!p.ok() || !r.ok() || !d.ok() || !s.ok()) return;
    buffer = DeviceBuffer{static_cast<float*>(*p), device, *r, *d};
    stream = *s;
  }
  ~DeviceTensor() {
    cu::set_device(buffer.device).ignore();
    cu::synchronize(stream).ignore();
    cu::device_free(buffer.data);
    cu::event_destroy(buffer.ready_event);
    cu::event_destroy(buffer.done_event);
    cu::stream_destroy(stream);
  }
  // The trainer's side of a step: write the gradient on its stream, record ready.
  void write(const std::vector<float>& host) {
    ASSERT_TRUE(cu::set_device(buffer.device).ok());
    ASSERT_TRUE(cu::copy_async(buffer.data, host.data(), count * sizeof(float), stream).ok());
    ASSERT_TRUE(cu::event_record(buffer.ready_event, stream).ok());
  }
  // After the completion: wait for done on the trainer's stream, read the average.
  std::vector<float> read() {
    std::vector<float> out(count, std::nanf(""));
    EXPECT_TRUE(cu::set_device(buffer.device).ok());
    EXPECT_TRUE(cu::stream_wait_event(stream, buffer.done_event).ok());
    EXPECT_TRUE(cu::copy_async(out.data(), buffer.data, count * sizeof(float), stream).ok());
    EXPECT_TRUE(cu::synchronize(stream).ok());
    return out;
  }
  size_t count;
  DeviceBuffer buffer;
  cu::Stream stream = nullptr;
};

PipelineOptions options(bool compression, kernels::Selector selector, double density, double threshold) {
  PipelineOptions o;
  o.settings.compression = compression;
  o.settings.selector = selector;
  o.settings.params.density = density;
  o.settings.params.threshold = threshold;
  o.step_timeout = std::chrono::milliseconds(20000);
  return o;
}

struct Case {
  const char* name;
  bool compression;
  kernels::Selector selector;
  double density;
  double threshold;
  kernels::Format format;
  bool trainers_reduce = false;  // dense_collective=trainer, every trainer reducing
};

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

class DevicePipeline : public ::testing::TestWithParam<Case> {};

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

TEST_P(DevicePipeline, EqualsTheHostPathBitForBit) {
  SKIP_WITHOUT_GPU();
  const Case c = GetParam();
  constexpr uint32_t kWorld = 3;
  const size_t n = 200003;  // odd: no chunk or vector width divides it
  PipelineOptions o = options(c.compression, c.selector, c.density, c.threshold);
  o.settings.format = c.format;
  if (c.trainers_reduce) o.settings.dense_collective = policies::Collective::kTrainerAllReduce;
  o.trainer_lease = 3;  // trainer-reduced steps 1-4 in a row lease 1, 2, 3, 3 (doubling, the knob)
  // A clock that does not move: no trainers' pace, so no restart of the leases' slow start.
  testing::FakeClock clock;
  PipelineJob host(kWorld, o, {}, clock);
  PipelineJob device(kWorld, o, {}, clock);
  for (uint32_t r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(host.nodes[r]->pipeline->register_tensor(0, TensorSpec{"fc.weight", n}).ok());
    TensorSpec spec{"fc.weight", n};
    spec.on_device = true;
    ASSERT_TRUE(device.nodes[r]->pipeline->register_tensor(0, spec).ok());
  }
  std::vector<std::unique_ptr<DeviceTensor>> tensors;
  for (uint32_t r = 0; r < kWorld; ++r) {
    tensors.push_back(std::make_unique<DeviceTensor>(n));
    ASSERT_NE(tensors.back()->buffer.data, nullptr);
  }
  for (uint64_t step = 1; step <= 4; ++step) {
    std::vector<std::vector<float>> inputs;
    for (uint32_t r = 0; r < kWorld; ++r) inputs.push_back(fakes::random_vector(n, 1000 * static_cast<uint32_t>(step) + r));
    std::vector<std::vector<float>> expected;
    auto host_results =
        fakes::run_step(host, 0, step, inputs, expected, std::vector<bool>(kWorld, c.trainers_reduce), true);
    for (auto& res : host_results) ASSERT_TRUE(res.status.ok()) << res.status.to_string();

    for (uint32_t r = 0; r < kWorld; ++r) {
      tensors[r]->write(inputs[r]);
      StepJob j;
      j.tensor_id = 0;
      j.step = step;
      j.device = std::span<const DeviceBuffer>(&tensors[r]->buffer, 1);
      j.trainer_reduces = c.trainers_reduce;
      j.takes_lease = c.trainers_reduce;
      device.nodes[r]->pipeline->submit(j);
    }
    for (uint32_t r = 0; r < kWorld; ++r) {
      StepResult res = device.nodes[r]->results.wait(0, step);
      ASSERT_TRUE(res.status.ok()) << "rank " << r << ": " << res.status.to_string();
      EXPECT_EQ(res.trainer_reduces, host_results[r].trainer_reduces);
      EXPECT_EQ(res.trainer_reduces, c.trainers_reduce && !c.compression);
      EXPECT_EQ(res.lease_steps, host_results[r].lease_steps);
      EXPECT_EQ(res.lease_steps, res.trainer_reduces ? std::min<uint32_t>(3, 1u << (step - 1)) : 0u) << step;
      EXPECT_EQ(res.nnz, host_results[r].nnz) << "rank " << r << " step " << step;
      EXPECT_EQ(res.bytes_sent, host_results[r].bytes_sent) << "rank " << r << " step " << step;
      const std::vector<float> got = tensors[r]->read();
      EXPECT_TRUE(same_bits(got, expected[r])) << c.name << ": rank " << r << " step " << step
                                               << " differs from the host path";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Plans, DevicePipeline,
    ::testing::Values(Case{"topk_coo", true, kernels::Selector::kTopk, 0.01, 0.0, kernels::Format::kCoo},
                      Case{"topk_bitmap", true, kernels::Selector::kTopk, 0.05, 0.0, kernels::Format::kBitmap},
                      Case{"threshold_varint", true, kernels::Selector::kThreshold, 0.0, 2.5,
                           kernels::Format::kCooVarint},
                      Case{"dense_ring", false, kernels::Selector::kTopk, 0.01, 0.0, kernels::Format::kCoo},
                      // Each trainer's share on the GPU (dense_share), nothing staged through the host.
                      Case{"dense_trainer", false, kernels::Selector::kTopk, 0.01, 0.0, kernels::Format::kCoo, true},
                      Case{"topk_trainer", true, kernels::Selector::kTopk, 0.01, 0.0, kernels::Format::kCoo, true}),
    [](const ::testing::TestParamInfo<Case>& p) { return std::string(p.param.name); });

// Several device tensors queued at once (DDP's buckets of one backward): each step after the first
// is compressed while the one before it waits for its peers (Pipeline::prepare_next_device_step),
// and the averages are still the host path's, bit for bit.
TEST(DevicePipelineOverlap, BucketsQueuedTogetherEqualTheHostPath) {
  SKIP_WITHOUT_GPU();
  constexpr uint32_t kWorld = 2, kTensors = 4;
  const size_t n = 100003;
  PipelineOptions o = options(true, kernels::Selector::kTopk, 0.01, 0.0);
  PipelineJob host(kWorld, o);
  PipelineJob device(kWorld, o);
  std::vector<std::vector<std::unique_ptr<DeviceTensor>>> tensors(kWorld);
  for (uint32_t r = 0; r < kWorld; ++r) {
    for (uint32_t i = 0; i < kTensors; ++i) {
      const std::string name = "bucket." + std::to_string(i);
      ASSERT_TRUE(host.nodes[r]->pipeline->register_tensor(i, TensorSpec{name, n}).ok());
      TensorSpec spec{name, n};
      spec.on_device = true;
      ASSERT_TRUE(device.nodes[r]->pipeline->register_tensor(i, spec).ok());
      tensors[r].push_back(std::make_unique<DeviceTensor>(n));
      ASSERT_NE(tensors[r].back()->buffer.data, nullptr);
    }
  }
  for (uint64_t step = 1; step <= 3; ++step) {
    std::vector<std::vector<std::vector<float>>> inputs(kTensors), expected(kTensors);
    for (uint32_t i = 0; i < kTensors; ++i) {
      for (uint32_t r = 0; r < kWorld; ++r) {
        inputs[i].push_back(fakes::random_vector(n, 7919 * static_cast<uint32_t>(step) + 31 * i + r));
      }
      for (auto& res : fakes::run_step(host, i, step, inputs[i], expected[i])) {
        ASSERT_TRUE(res.status.ok()) << res.status.to_string();
      }
    }
    // Every bucket of the step queued before the pipeline gets to the first one's exchange.
    for (uint32_t r = 0; r < kWorld; ++r) {
      for (uint32_t i = 0; i < kTensors; ++i) {
        tensors[r][i]->write(inputs[i][r]);
        StepJob j;
        j.tensor_id = i;
        j.step = step;
        j.device = std::span<const DeviceBuffer>(&tensors[r][i]->buffer, 1);
        device.nodes[r]->pipeline->submit(j);
      }
    }
    for (uint32_t r = 0; r < kWorld; ++r) {
      for (uint32_t i = 0; i < kTensors; ++i) {
        StepResult res = device.nodes[r]->results.wait(i, step);
        ASSERT_TRUE(res.status.ok()) << "rank " << r << " tensor " << i << ": " << res.status.to_string();
        EXPECT_TRUE(same_bits(tensors[r][i]->read(), expected[i][r]))
            << "rank " << r << " tensor " << i << " step " << step << " differs from the host path";
      }
    }
  }
}

// A node of two trainers on two GPUs: the daemon works on the first trainer's GPU, brings the
// second's buffer over (a peer copy), sums both in float64 (the session's host sum), and writes
// the average back into both buffers, recording each trainer's done event on its own GPU.
// With dense_collective=trainer and compression off, each trainer's share, (local sum) / 2, on
// the GPU (cuda::scale), equal to the host path's.
void two_trainers_on_two_gpus(bool compression, bool trainers_reduce) {
  constexpr uint32_t kWorld = 2;
  const size_t n = 65537;
  PipelineOptions o = options(compression, kernels::Selector::kTopk, 0.02, 0.0);
  o.local_clients = 2;
  if (trainers_reduce) o.settings.dense_collective = policies::Collective::kTrainerAllReduce;
  PipelineJob host(kWorld, o);
  PipelineJob device(kWorld, o);
  std::vector<std::vector<std::unique_ptr<DeviceTensor>>> tensors(kWorld);
  for (uint32_t r = 0; r < kWorld; ++r) {
    ASSERT_TRUE(host.nodes[r]->pipeline->register_tensor(0, TensorSpec{"w", n}).ok());
    TensorSpec spec{"w", n};
    spec.on_device = true;
    ASSERT_TRUE(device.nodes[r]->pipeline->register_tensor(0, spec).ok());
    for (int gpu = 0; gpu < 2; ++gpu) {
      tensors[r].push_back(std::make_unique<DeviceTensor>(n, gpu));
      ASSERT_NE(tensors[r].back()->buffer.data, nullptr);
    }
  }
  for (uint64_t step = 1; step <= 3; ++step) {
    std::vector<std::vector<std::vector<float>>> grads(kWorld);  // [node][trainer]
    std::vector<std::vector<float>> sums(kWorld, std::vector<float>(n));
    for (uint32_t r = 0; r < kWorld; ++r) {
      for (uint32_t c = 0; c < 2; ++c) grads[r].push_back(fakes::random_vector(n, 100 * static_cast<uint32_t>(step) + 10 * r + c));
      for (size_t i = 0; i < n; ++i) {
        sums[r][i] = static_cast<float>(static_cast<double>(grads[r][0][i]) + static_cast<double>(grads[r][1][i]));
      }
    }
    std::vector<std::vector<float>> expected;
    for (auto& res : fakes::run_step(host, 0, step, sums, expected, std::vector<bool>(kWorld, trainers_reduce))) {
      ASSERT_TRUE(res.status.ok()) << res.status.to_string();
      ASSERT_EQ(res.trainer_reduces, trainers_reduce && !compression);
    }
    std::vector<std::vector<DeviceBuffer>> buffers(kWorld);
    for (uint32_t r = 0; r < kWorld; ++r) {
      for (uint32_t c = 0; c < 2; ++c) {
        tensors[r][c]->write(grads[r][c]);
        buffers[r].push_back(tensors[r][c]->buffer);
      }
      StepJob j;
      j.tensor_id = 0;
      j.step = step;
      j.device = buffers[r];
      j.trainer_reduces = trainers_reduce;
      device.nodes[r]->pipeline->submit(j);
    }
    for (uint32_t r = 0; r < kWorld; ++r) {
      StepResult res = device.nodes[r]->results.wait(0, step);
      ASSERT_TRUE(res.status.ok()) << "rank " << r << ": " << res.status.to_string();
      for (uint32_t c = 0; c < 2; ++c) {
        EXPECT_TRUE(same_bits(tensors[r][c]->read(), expected[r]))
            << "rank " << r << " trainer " << c << " (GPU " << c << ") step " << step << " differs from the host path";
      }
    }
  }
}

TEST(DevicePipelineNode, TwoTrainersOnTwoGpusEqualTheHostPath) {
  if (cu::device_count() < 2) GTEST_SKIP() << "needs 2 GPUs (" << cu::device_count() << " here)";
  two_trainers_on_two_gpus(true, false);
}

TEST(DevicePipelineNode, TwoTrainersOnTwoGpusGetTheirSharesAsOnTheHost) {
  if (cu::device_count() < 2) GTEST_SKIP() << "needs 2 GPUs (" << cu::device_count() << " here)";
  two_trainers_on_two_gpus(false, true);
}

// The budget controller's histograms measured on the GPU (DeviceCompressor::measure_magnitudes)
// against the plain count: before the selection every coordinate has |residual + g|; after it the
// selected ones sit in the residual as zeros and their values in the selection, so the magnitude
// histogram is the count of |residual + g| plus k zeros, whichever k were taken, and the gradient
// histogram the count of |g|. Two steps: the second's residual is the first's unsent part.
std::vector<uint64_t> plain_bins(const std::vector<float>& x) {
  std::vector<uint64_t> h(policies::kMagnitudeBins, 0);
  for (float v : x) {
    uint32_t bits;
    std::memcpy(&bits, &v, sizeof bits);
    ++h[(bits & 0x7fffffffu) >> 20];
  }
  return h;
}

TEST(DeviceCompressorHistograms, EqualThePlainCountOfTheStep) {
  SKIP_WITHOUT_GPU();
  const size_t n = 100003;
  const double density = 0.01;
  const size_t k = kernels::topk_count(n, density);
  DeviceCompressor d(0, TensorSpec{"fc.weight", n}, 1);
  DeviceTensor t(n);
  ASSERT_NE(t.buffer.data, nullptr);
  policies::Plan plan;
  plan.dense = false;
  plan.selector = kernels::Selector::kTopk;
  plan.params.density = density;
  plan.format = kernels::Format::kCoo;
  std::vector<float> residual(n, 0.0f);  // the host's copy of what the device's should hold
  for (uint64_t step = 1; step <= 3; ++step) {
    const std::vector<float> g = fakes::random_vector(n, 77 + static_cast<uint32_t>(step));
    t.write(g);
    d.measure_magnitudes(step != 3);  // step 3: not measured, nothing to read
    const std::span<const DeviceBuffer> bufs(&t.buffer, 1);
    ASSERT_TRUE(d.begin(bufs).ok());
    auto e = d.compress(plan);
    ASSERT_TRUE(e.ok()) << e.status().to_string();
    ASSERT_EQ(e->selected, k);
    d.commit();
    ASSERT_TRUE(d.end(bufs, true).ok());
    std::vector<float> acc(n);
    for (size_t i = 0; i < n; ++i) acc[i] = residual[i] + g[i];
    if (step == 3) {
      EXPECT_TRUE(d.last_magnitude_hist().empty());
      EXPECT_TRUE(d.last_gradient_hist().empty());
      continue;
    }
    std::vector<uint64_t> want = plain_bins(acc);
    want[0] += k;
    const auto mh = d.last_magnitude_hist();
    const auto gh = d.last_gradient_hist();
    EXPECT_EQ(std::vector<uint64_t>(mh.begin(), mh.end()), want) << "step " << step;
    EXPECT_EQ(std::vector<uint64_t>(gh.begin(), gh.end()), plain_bins(g)) << "step " << step;
    // The next step's residual: acc without its k largest magnitudes (random normals: no ties).
    std::vector<size_t> order(n);
    for (size_t i = 0; i < n; ++i) order[i] = i;
    std::nth_element(order.begin(), order.begin() + static_cast<std::ptrdiff_t>(k), order.end(),
                     [&](size_t a, size_t b) { return std::fabs(acc[a]) > std::fabs(acc[b]); });
    residual = acc;
    for (size_t j = 0; j < k; ++j) residual[order[j]] = 0.0f;
  }
}

// Without a GPU a device step fails at once with an error that says why, on every node (the peers
// are told), and does not wait for its deadline.
TEST(DevicePipelineRefusal, ADeviceStepWithoutAGpuFailsClearly) {
  if (cu::device_count() > 0) GTEST_SKIP() << "a GPU is present: the refusal is for machines without one";
  PipelineOptions o = options(true, kernels::Selector::kTopk, 0.01, 0.0);
  PipelineJob job(2, o);
  TensorSpec spec{"fc.weight", 1000};
  spec.on_device = true;
  for (auto& node : job.nodes) ASSERT_TRUE(node->pipeline->register_tensor(0, spec).ok());
  // Non-null stand-ins: nothing may dereference them when no GPU is there.
  alignas(64) static float fake_memory[16];
  int fake_event_a = 0, fake_event_b = 0;
  const DeviceBuffer buf{fake_memory, 0, &fake_event_a, &fake_event_b};
  const auto started = std::chrono::steady_clock::now();
  for (auto& node : job.nodes) {
    StepJob j;
    j.tensor_id = 0;
    j.step = 1;
    j.device = std::span<const DeviceBuffer>(&buf, 1);
    node->pipeline->submit(j);
  }
  for (auto& node : job.nodes) {
    StepResult r = node->results.wait(0, 1);
    EXPECT_FALSE(r.status.ok());
    EXPECT_NE(r.status.message().find("GPU"), std::string::npos) << r.status.to_string();
  }
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(10));
}

TEST(DevicePlan, SubstitutesWhatTheDeviceDoesNotRunAndSaysSo) {
  policies::Plan p;
  p.dense = false;
  p.selector = kernels::Selector::kTopk;
  p.format = kernels::Format::kCoo;
  std::string why;
  policies::Plan q = DeviceCompressor::device_plan(p, &why);
  if (cu::built()) {  // without CUDA nothing runs on a device and everything is substituted
    EXPECT_TRUE(why.empty()) << why;
  }
  EXPECT_EQ(q.selector, p.selector);
  p.value_type = kernels::ValueType::kF16;
  p.error_feedback = policies::ErrorFeedback::kMomentum;
  q = DeviceCompressor::device_plan(p, &why);
  EXPECT_EQ(q.value_type, kernels::ValueType::kF32);
  EXPECT_EQ(q.error_feedback, policies::ErrorFeedback::kResidual);
  EXPECT_NE(why.find("fp32"), std::string::npos) << why;
  EXPECT_NE(why.find("momentum"), std::string::npos) << why;
  EXPECT_EQ(DeviceCompressor::capacity(100), 100u);
  EXPECT_EQ(DeviceCompressor::capacity(800000), 100000u + 4096u);
}

}  // namespace
}  // namespace sparsecar
