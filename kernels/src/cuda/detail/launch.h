// Host-side helpers every CUDA entry point shares: workspace alignment and checks, and the grid
// size of a grid-stride pass.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>

#include "sparsecar/common/status.h"
#include "sparsecar/kernels/cuda.h"

namespace sparsecar::kernels::cuda::detail {

// Workspaces and the pieces carved from them are aligned to this many bytes.
inline constexpr size_t kWorkspaceAlign = 256;

inline size_t align_up(size_t v) { return (v + kWorkspaceAlign - 1) / kWorkspaceAlign * kWorkspaceAlign; }

// Carves aligned pieces off a workspace in order; with a null base it only adds up the bytes
// (the size query and the layout are one piece of code).
class WorkspaceCarver {
 public:
  explicit WorkspaceCarver(void* base) : base_(static_cast<char*>(base)) {}
  template <class T>
  T* take(size_t bytes) {
    char* at = base_ == nullptr ? nullptr : base_ + offset_;
    offset_ += align_up(bytes);
    return reinterpret_cast<T*>(at);
  }
  size_t bytes() const { return offset_; }

 private:
  char* base_;
  size_t offset_ = 0;
};

// Blocks of `threads` for a grid-stride pass over n items: enough to fill the device (8 per SM),
// no more than the work, at least 1.
inline unsigned stride_blocks(size_t n, unsigned threads) {
  int device = 0;
  int sms = 132;
  if (cudaGetDevice(&device) == cudaSuccess) cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  const size_t want = (n + threads - 1) / threads;
  return static_cast<unsigned>(std::clamp<size_t>(want, 1, static_cast<size_t>(sms) * 8));
}

// INVALID_ARGUMENT unless ws holds `need` bytes at an aligned address.
inline Status check_workspace(const std::string& name, Workspace ws, size_t need) {
  if (ws.bytes < need || (need > 0 && ws.ptr == nullptr)) {
    return invalid_argument(name + ": workspace of " + std::to_string(ws.bytes) + " bytes; " + std::to_string(need) +
                            " needed");
  }
  if (reinterpret_cast<uintptr_t>(ws.ptr) % kWorkspaceAlign != 0) {
    return invalid_argument(name + ": workspace not aligned to " + std::to_string(kWorkspaceAlign) + " bytes");
  }
  return Status::Ok();
}

}  // namespace sparsecar::kernels::cuda::detail
