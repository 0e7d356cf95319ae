// A real CUDA IPC hand-off (label gpu; skips without a GPU): a trainer process
// (device_ipc_trainer, exec'd) registers a cudaMalloc'd tensor with a SessionServer in this
// process that uses the real DeviceRuntime; the StepSink here waits on the trainer's `ready`
// event, checks the gradient, writes a known pattern into the trainer's buffer, records `done`
// and answers. The trainer checks the pattern after its stream waited on `done`.
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
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "daemon/device/device_runtime.h"
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

// The pipeline's part, done by hand: wait on ready, check, write the pattern, record done.
class GpuSink : public StepSink {
 public:
  void attach(StepResultSink* sink) { sink_ = sink; }
  Status register_tensor(uint32_t tensor_id, const TensorSpec& spec) override {
    std::lock_guard<std::mutex> lock(mu_);
    counts_[tensor_id] = spec.count;
    on_device = spec.on_device;
    return Status::Ok();
  }
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

  std::atomic<bool> on_device{false};
  std::atomic<bool> saw_gradient{false};
  std::string error;  // guarded by mu_

 private:
  Status run(const StepJob& job) {
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
  StepResultSink* sink_ = nullptr;
};

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
