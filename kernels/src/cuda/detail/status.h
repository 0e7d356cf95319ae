// A CUDA runtime error as a Status: "<what>: CUDA error <name>: <description>".
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "sparsecar/common/status.h"

namespace sparsecar::kernels::cuda::detail {

inline Status cuda_status(const char* what, cudaError_t err) {
  if (err == cudaSuccess) return Status::Ok();
  const std::string text = std::string(what) + ": CUDA error " + cudaGetErrorName(err) + ": " + cudaGetErrorString(err);
  if (err == cudaErrorMemoryAllocation) return resource_exhausted(text);
  if (err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver) return unavailable(text);
  return internal_error(text);
}

}  // namespace sparsecar::kernels::cuda::detail
