// The trainer of device_ipc_test, in its own process: puts a gradient in a cudaMalloc'd buffer
// (at an offset, with guard values before it), registers it with the daemon by CUDA IPC
// (register_device_tensor), records `ready`, submits, waits, makes its stream wait on `done` and
// checks that the daemon's pattern is in the buffer and the guards are untouched.
//   device_ipc_trainer SOCKET COUNT              exit 0: checked; else a line on stderr says what failed
//   device_ipc_trainer SOCKET COUNT GPU K        trainer K (0 or 1) of two on GPU GPU: its gradient
//                                                is (K + 1) * 2 * i, the result must be their mean, 3 * i
#include <cuda_runtime.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "sparsecar/client.h"

namespace {

constexpr size_t kGuard = 64;  // floats before the tensor: offset 256 bytes into the allocation

#define CHECK_CUDA(call)                                                                    \
  do {                                                                                      \
    const cudaError_t err_ = (call);                                                        \
    if (err_ != cudaSuccess) {                                                              \
      std::fprintf(stderr, "trainer: %s: %s\n", #call, cudaGetErrorString(err_));          \
      return 2;                                                                             \
    }                                                                                       \
  } while (0)

int run(const std::string& socket, size_t count, int gpu, int k) {
  CHECK_CUDA(cudaSetDevice(gpu));
  cudaDeviceProp prop{};
  CHECK_CUDA(cudaGetDeviceProperties(&prop, gpu));
  float* base = nullptr;
  CHECK_CUDA(cudaMalloc(reinterpret_cast<void**>(&base), (kGuard + count) * sizeof(float)));
  cudaStream_t stream = nullptr;
  CHECK_CUDA(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  cudaEvent_t ready = nullptr, done = nullptr;
  CHECK_CUDA(cudaEventCreateWithFlags(&ready, cudaEventInterprocess | cudaEventDisableTiming));
  CHECK_CUDA(cudaEventCreateWithFlags(&done, cudaEventInterprocess | cudaEventDisableTiming));

  sparsecar::DeviceHandles h;
  cudaIpcMemHandle_t mem;
  cudaIpcEventHandle_t ev;
  CHECK_CUDA(cudaIpcGetMemHandle(&mem, base));
  std::memcpy(h.mem_handle.data(), &mem, h.mem_handle.size());
  CHECK_CUDA(cudaIpcGetEventHandle(&ev, ready));
  std::memcpy(h.ready_event.data(), &ev, h.ready_event.size());
  CHECK_CUDA(cudaIpcGetEventHandle(&ev, done));
  std::memcpy(h.done_event.data(), &ev, h.done_event.size());
  std::memcpy(h.device_uuid.data(), &prop.uuid, h.device_uuid.size());
  h.offset = kGuard * sizeof(float);

  auto client = sparsecar::Client::connect(socket);
  if (!client.ok()) {
    std::fprintf(stderr, "trainer: connect: %s\n", client.status().to_string().c_str());
    return 3;
  }
  auto t = (*client)->register_device_tensor("g", count, h);
  if (!t.ok()) {
    std::fprintf(stderr, "trainer: register_device_tensor: %s\n", t.status().to_string().c_str());
    return 3;
  }
  // Guards -1, the gradient (k + 1) * 2 * i, written on the trainer's stream, then `ready`.
  const float scale = k < 0 ? 1.0f : static_cast<float>(k + 1);
  std::vector<float> host(kGuard + count, -1.0f);
  for (size_t i = 0; i < count; ++i) host[kGuard + i] = scale * 2.0f * static_cast<float>(i);
  CHECK_CUDA(cudaMemcpyAsync(base, host.data(), host.size() * sizeof(float), cudaMemcpyHostToDevice, stream));
  CHECK_CUDA(cudaEventRecord(ready, stream));
  if (auto st = (*client)->submit(**t, 1); !st.ok()) {
    std::fprintf(stderr, "trainer: submit: %s\n", st.to_string().c_str());
    return 3;
  }
  auto info = (*client)->wait(**t, 1, std::chrono::seconds(30));
  if (!info.ok()) {
    std::fprintf(stderr, "trainer: wait: %s\n", info.status().to_string().c_str());
    return 3;
  }
  CHECK_CUDA(cudaStreamWaitEvent(stream, done, 0));
  std::vector<float> out(kGuard + count, 0.0f);
  CHECK_CUDA(cudaMemcpyAsync(out.data(), base, out.size() * sizeof(float), cudaMemcpyDeviceToHost, stream));
  CHECK_CUDA(cudaStreamSynchronize(stream));
  for (size_t i = 0; i < kGuard; ++i) {
    if (out[i] != -1.0f) {
      std::fprintf(stderr, "trainer: guard %zu is %g, not -1: the daemon wrote before the tensor\n", i,
                   static_cast<double>(out[i]));
      return 4;
    }
  }
  for (size_t i = 0; i < count; ++i) {
    // The test's pattern, or the two trainers' mean (exact: small integers).
    const float want = k < 0 ? 0.5f * static_cast<float>(i) + 1.0f : 3.0f * static_cast<float>(i);
    if (out[kGuard + i] != want) {
      std::fprintf(stderr, "trainer: element %zu is %g, not %g\n", i, static_cast<double>(out[kGuard + i]),
                   static_cast<double>(want));
      return 4;
    }
  }
  client->reset();  // the session ends before the events and the memory go
  cudaEventDestroy(ready);
  cudaEventDestroy(done);
  cudaStreamDestroy(stream);
  cudaFree(base);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3 && argc != 5) {
    std::fprintf(stderr, "usage: device_ipc_trainer SOCKET COUNT [GPU K]\n");
    return 1;
  }
  const size_t count = static_cast<size_t>(std::strtoull(argv[2], nullptr, 10));
  if (argc == 3) return run(argv[1], count, 0, -1);
  return run(argv[1], count, std::atoi(argv[3]), std::atoi(argv[4]));
}
