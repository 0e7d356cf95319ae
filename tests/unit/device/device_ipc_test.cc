// A real CUDA IPC hand-off (label gpu; skips without a GPU): a trainer process
// (device_ipc_trainer, exec'd) registers a cudaMalloc'd tensor with a SessionServer in this
// process that uses the real DeviceRuntime; the StepSink here waits on the trainer's `ready`
// event, checks the gradient, writes a known pattern into the trainer's buffer, records `done`
// and answers. The trainer checks the pattern after its stream waited on `done`.
// Two trainer processes on two GPUs (needs 2 GPUs): the real DeviceCompressor sums their buffers
// (the second one's peer-copied), keeps everything (density 1) and writes the mean back into both;
// each trainer checks it. Interprocess events of another GPU must be waited on a stream of their
// own GPU: a stream of the other GPU waiting on them crashed the driver on 2 x 2 H100.
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "daemon/device/device_runtime.h"
#include "daemon/pipeline/device_compressor.h"
#include "daemon/session/session_server.h"
#include "sparsecar/kernels/cuda.h"
#include "tests/unit/session/session_test_util.h"

extern char** environ;

namespace sparsecar {
namespace {

using namespace std::chrono_literals;

// The trainer binary: $SPARSECAR_DEVICE_IPC_TRAINER, else next to this test (a bundle copied to
// the GPU machine holds both), else where this build put it.
std::string trainer_path() {
  if (const char* env = std::getenv("SPARSECAR_DEVICE_IPC_TRAINER"); env != nullptr && *env != '\0') return env;
  char self[4096];
  const ssize_t n = ::readlink("/proc/self/exe", self, sizeof self - 1);
  if (n > 0) {
    const std::string exe(self, static_cast<size_t>(n));
    const std::string beside = exe.substr(0, exe.rfind('/') + 1) + "device_ipc_trainer";
    if (::access(beside.c_str(), X_OK) == 0) return beside;
  }
  return SPARSECAR_DEVICE_IPC_TRAINER;
}

// A sink that answers every job at once with what run() says.
class AnsweringSink : public StepSink {
 public:
  void attach(StepResultSink* sink) { sink_ = sink; }
  void submit(const StepJob& job) override {
    StepResult r;
    r.tensor_id = job.tensor_id;
    r.step = job.step;
    r.generation = job.generation;
    r.status = run(job);
    sink_->complete(r);
  }
  void report_metric(const std::string&, double, uint64_t) override {}
  void reset() override {}

 protected:
  virtual Status run(const StepJob& job) = 0;

 private:
  StepResultSink* sink_ = nullptr;
};

// The pipeline's part, done by hand: wait on ready, check, write the pattern, record done.
class GpuSink : public AnsweringSink {
 public:
  Status register_tensor(uint32_t tensor_id, const TensorSpec& spec) override {
    std::lock_guard<std::mutex> lock(mu_);
    counts_[tensor_id] = spec.count;
    on_device = spec.on_device;
    return Status::Ok();
  }

  std::atomic<bool> on_device{false};
  std::atomic<bool> saw_gradient{false};
  std::string error;  // guarded by mu_

 private:
  Status run(const StepJob& job) override {
    std::lock_guard<std::mutex> lock(mu_);
    const size_t count = counts_[job.tensor_id];
    for (const DeviceBuffer& b : job.device) {
      auto fail = [&](const char* call, cudaError_t e) {
        error = std::string(call) + ": " + cudaGetErrorString(e);
        return internal_error(error);
      };
      cudaError_t e = cudaSetDevice(b.device);
      if (e != cudaSuccess) return fail("cudaSetDevice", e);
      cudaStream_t stream = nullptr;
      if ((e = cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)) != cudaSuccess) return fail("cudaStreamCreate", e);
      std::vector<float> grad(count), pattern(count);
      for (size_t i = 0; i < count; ++i) pattern[i] = 0.5f * static_cast<float>(i) + 1.0f;
      e = cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(b.ready_event), 0);
      if (e == cudaSuccess) e = cudaMemcpyAsync(grad.data(), b.data, count * 4, cudaMemcpyDeviceToHost, stream);
      if (e == cudaSuccess) e = cudaMemcpyAsync(b.data, pattern.data(), count * 4, cudaMemcpyHostToDevice, stream);
      if (e == cudaSuccess) e = cudaEventRecord(static_cast<cudaEvent_t>(b.done_event), stream);
      if (e == cudaSuccess) e = cudaStreamSynchronize(stream);
      cudaStreamDestroy(stream);
      if (e != cudaSuccess) return fail("the device step", e);
      bool good = true;
      for (size_t i = 0; i < count; ++i) good = good && grad[i] == 2.0f * static_cast<float>(i);
      saw_gradient = good;
    }
    return Status::Ok();
  }

  std::mutex mu_;
  std::map<uint32_t, uint64_t> counts_;  // guarded by mu_
};

// The pipeline's device path for one node of one: begin (sum), compress (density 1: everything),
// the own payload, finish (mean over the trainers), commit, end (written back, done recorded).
class CompressorSink : public AnsweringSink {
 public:
  Status register_tensor(uint32_t tensor_id, const TensorSpec& spec) override {
    std::lock_guard<std::mutex> lock(mu_);
    compressors_.try_emplace(tensor_id, std::make_unique<DeviceCompressor>(tensor_id, spec, 1));
    return Status::Ok();
  }

  std::atomic<size_t> trainers_in_step{0};
  std::string error_text() {
    std::lock_guard<std::mutex> lock(mu_);
    return error_;
  }

 private:
  Status run(const StepJob& job) override {
    std::lock_guard<std::mutex> lock(mu_);
    Status s = step(*compressors_.at(job.tensor_id), job);
    if (!s.ok()) error_ = s.to_string();
    return s;
  }
  Status step(DeviceCompressor& d, const StepJob& job) {
    trainers_in_step = job.device.size();
    policies::Plan plan;
    plan.dense = false;
    plan.selector = kernels::Selector::kTopk;
    plan.params.density = 1.0;
    plan.format = kernels::Format::kCoo;
    plan = DeviceCompressor::device_plan(plan);
    Status s = d.begin(job.device);
    if (s.ok()) {
      Expected<DeviceCompressor::Encoded> e = d.compress(plan);
      if (!e.ok()) {
        s = e.status();
      } else {
        GatheredPayload g;
        g.format = e->format;
        g.value_type = e->value_type;
        g.nnz = e->nnz;
        g.payload = e->payload;
        g.from = "own selection";
        s = d.add_payload(g);
        if (s.ok()) s = d.finish_sparse(static_cast<uint32_t>(job.device.size()));
        if (s.ok()) {
          d.commit();
        } else {
          d.rollback();
        }
      }
    }
    const Status ended = d.end(job.device, s.ok());
    return s.ok() ? ended : s;
  }

  std::mutex mu_;
  std::map<uint32_t, std::unique_ptr<DeviceCompressor>> compressors_;  // guarded by mu_
  std::string error_;                                                  // guarded by mu_
};

// Runs one trainer per entry of `runs` (its arguments) at once; success when all exited 0 within 60 s.
::testing::AssertionResult spawn_all_and_wait(const std::vector<std::vector<std::string>>& runs) {
  const std::string trainer = trainer_path();
  std::vector<pid_t> pids;
  for (const auto& args : runs) {
    std::vector<char*> argv{const_cast<char*>(trainer.c_str())};
    for (const std::string& a : args) argv.push_back(const_cast<char*>(a.c_str()));
    argv.push_back(nullptr);
    pid_t pid = 0;
    if (::posix_spawn(&pid, trainer.c_str(), nullptr, nullptr, argv.data(), environ) != 0) {
      return ::testing::AssertionFailure() << "cannot start " << trainer;
    }
    pids.push_back(pid);
  }
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  std::string failures;
  for (pid_t pid : pids) {
    int status = 0;
    while (::waitpid(pid, &status, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        ::kill(pid, SIGKILL);
        ::waitpid(pid, &status, 0);
        failures += " a trainer did not finish within 60 s;";
        break;
      }
      std::this_thread::sleep_for(10ms);
    }
    if (!(WIFEXITED(status) && WEXITSTATUS(status) == 0)) {
      failures += " trainer status " + std::to_string(status) + " (its stderr says why);";
    }
  }
  if (!failures.empty()) return ::testing::AssertionFailure() << failures;
  return ::testing::AssertionSuccess();
}

TEST(DeviceIpc, TwoTrainerProcessesOnTwoGpusGetTheirMeanFromTheDeviceCompressor) {
  if (kernels::cuda::device_count() < 2) {
    GTEST_SKIP() << "needs 2 CUDA GPUs (" << kernels::cuda::device_count() << " here)";
  }
  testing::TempSocket sock;
  auto runtime = make_device_runtime();
  ASSERT_TRUE(runtime->available().ok()) << runtime->available().to_string();
  CompressorSink sink;
  SessionServerOptions options;
  options.socket_path = sock.path();
  options.local_clients = 2;
  auto server = SessionServer::start(options, &sink, steady_clock(), runtime.get());
  ASSERT_TRUE(server.ok()) << server.status().to_string();
  sink.attach(server->get());
  EXPECT_TRUE(spawn_all_and_wait({{sock.path(), "4099", "0", "0"}, {sock.path(), "4099", "1", "1"}}));
  EXPECT_EQ(sink.trainers_in_step.load(), 2u);
  EXPECT_EQ(sink.error_text(), "");
  EXPECT_TRUE(testing::wait_until([&] { return (*server)->connected_clients() == 0; }));
  const SessionStats s = (*server)->stats();
  EXPECT_EQ(s.registrations, 2u);
  EXPECT_EQ(s.steps_completed, 1u);
  (*server)->stop();
}

TEST(DeviceIpc, TrainerBufferIsReadAndWrittenByTheDaemonProcess) {
  if (kernels::cuda::device_count() == 0) {
    GTEST_SKIP() << "no CUDA GPU here (" << (kernels::cuda::built() ? "built with CUDA" : "built without CUDA")
                 << "): the IPC hand-off is checked on a GPU machine";
  }
  testing::TempSocket sock;
  auto runtime = make_device_runtime();
  ASSERT_TRUE(runtime->available().ok()) << runtime->available().to_string();
  GpuSink sink;
  SessionServerOptions options;
  options.socket_path = sock.path();
  auto server = SessionServer::start(options, &sink, steady_clock(), runtime.get());
  ASSERT_TRUE(server.ok()) << server.status().to_string();
  sink.attach(server->get());

  const std::string count = "4099";
  const std::string trainer = trainer_path();
  char* argv[] = {const_cast<char*>(trainer.c_str()), const_cast<char*>(sock.path().c_str()),
                  const_cast<char*>(count.c_str()), nullptr};
  pid_t pid = 0;
  ASSERT_EQ(::posix_spawn(&pid, trainer.c_str(), nullptr, nullptr, argv, environ), 0) << trainer;
  int status = 0;
  const auto deadline = std::chrono::steady_clock::now() + 60s;
  while (::waitpid(pid, &status, WNOHANG) == 0) {
    if (std::chrono::steady_clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      FAIL() << "the trainer did not finish within 60 s";
    }
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "trainer status " << status << " (its stderr says why)";
  EXPECT_TRUE(sink.on_device.load());
  EXPECT_TRUE(sink.saw_gradient.load()) << "the daemon did not read the trainer's gradient";
  EXPECT_TRUE(testing::wait_until([&] { return (*server)->connected_clients() == 0; }));
  const SessionStats s = (*server)->stats();
  EXPECT_EQ(s.registrations, 1u);
  EXPECT_EQ(s.steps_completed, 1u);
  (*server)->stop();
}

}  // namespace
}  // namespace sparsecar
