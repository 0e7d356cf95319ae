// cuda.h's device queries and the thin memory/stream wrappers.
#include <cuda_runtime.h>

#include <cstdio>
#include <string>

#include "cuda/detail/status.h"
#include "sparsecar/kernels/cuda.h"

namespace sparsecar::kernels::cuda {

using detail::cuda_status;

bool built() { return true; }

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver / no device" error
    return 0;
  }
  return count;
}

std::string device_description(int device) {
  cudaDeviceProp prop{};
  const cudaError_t err = cudaGetDeviceProperties(&prop, device);
  if (err != cudaSuccess) return cuda_status("cudaGetDeviceProperties", err).message();
  char text[512];
  std::snprintf(text, sizeof text, "%s, %d SMs, compute %d.%d, %.1f GiB", prop.name, prop.multiProcessorCount,
                prop.major, prop.minor, static_cast<double>(prop.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0));
  return text;
}

Expected<void*> device_alloc(size_t bytes) {
  void* ptr = nullptr;
  SC_RETURN_IF_ERROR(cuda_status("cudaMalloc", cudaMalloc(&ptr, bytes)));
  return ptr;
}

void device_free(void* ptr) {
  if (ptr != nullptr) cudaFree(ptr);
}

Status copy_async(void* dst, const void* src, size_t bytes, Stream stream) {
  return cuda_status("cudaMemcpyAsync", cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream));
}

Status zero_async(void* ptr, size_t bytes, Stream stream) {
  return cuda_status("cudaMemsetAsync", cudaMemsetAsync(ptr, 0, bytes, stream));
}

Status synchronize(Stream stream) { return cuda_status("cudaStreamSynchronize", cudaStreamSynchronize(stream)); }

Expected<Stream> stream_create() {
  cudaStream_t stream = nullptr;
  SC_RETURN_IF_ERROR(cuda_status("cudaStreamCreate", cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking)));
  return stream;
}

void stream_destroy(Stream stream) {
  if (stream != nullptr) cudaStreamDestroy(stream);
}

Status set_device(int device) { return cuda_status("cudaSetDevice", cudaSetDevice(device)); }

Expected<bool> enable_peer_access(int device, int peer) {
  if (device == peer) return true;
  int can = 0;
  SC_RETURN_IF_ERROR(cuda_status("cudaDeviceCanAccessPeer", cudaDeviceCanAccessPeer(&can, device, peer)));
  if (can == 0) return false;
  int current = 0;
  SC_RETURN_IF_ERROR(cuda_status("cudaGetDevice", cudaGetDevice(&current)));
  SC_RETURN_IF_ERROR(cuda_status("cudaSetDevice", cudaSetDevice(device)));
  cudaError_t e = cudaDeviceEnablePeerAccess(peer, 0);
  if (e == cudaErrorPeerAccessAlreadyEnabled) {
    cudaGetLastError();  // not sticky, but leave nothing behind for the next call's check
    e = cudaSuccess;
  }
  const cudaError_t back = cudaSetDevice(current);
  SC_RETURN_IF_ERROR(cuda_status("cudaDeviceEnablePeerAccess", e));
  SC_RETURN_IF_ERROR(cuda_status("cudaSetDevice", back));
  return true;
}

Expected<void*> host_alloc_pinned(size_t bytes) {
  void* ptr = nullptr;
  SC_RETURN_IF_ERROR(cuda_status("cudaHostAlloc", cudaHostAlloc(&ptr, bytes, cudaHostAllocPortable)));
  return ptr;
}

void host_free_pinned(void* ptr) {
  if (ptr != nullptr) cudaFreeHost(ptr);
}

Status stream_wait_event(Stream stream, void* event) {
  return cuda_status("cudaStreamWaitEvent", cudaStreamWaitEvent(stream, static_cast<cudaEvent_t>(event), 0));
}

Status event_record(void* event, Stream stream) {
  return cuda_status("cudaEventRecord", cudaEventRecord(static_cast<cudaEvent_t>(event), stream));
}

Expected<void*> event_create() {
  cudaEvent_t event = nullptr;
  SC_RETURN_IF_ERROR(cuda_status("cudaEventCreate", cudaEventCreateWithFlags(&event, cudaEventDisableTiming)));
  return static_cast<void*>(event);
}

void event_destroy(void* event) {
  if (event != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(event));
}

}  // namespace sparsecar::kernels::cuda
