// cuda.h's element-wise helpers of the daemon's device path: the node's local sum, giving a
// selection back to its residual, scaling, and what the controllers measure (the squared norm,
// the magnitude histogram). Grid-stride passes; validation on the host first.
#include <cuda_runtime.h>

#include <string>

#include "cuda/detail/launch.h"
#include "cuda/detail/status.h"
#include "sparsecar/kernels/cuda.h"

namespace sparsecar::kernels::cuda {
namespace {

using detail::cuda_status;

constexpr unsigned kThreads = 256;

struct SumInputs {
  const float* src[kMaxSumInputs];
  unsigned count;
};

// The session's local sum: float64 accumulation in input order, one rounding (step_collector.h).
__global__ void local_sum_kernel(SumInputs in, float* __restrict__ dst, size_t n) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    double s = 0.0;
    for (unsigned j = 0; j < in.count; ++j) s += static_cast<double>(in.src[j][i]);
    dst[i] = static_cast<float>(s);
  }
}

__global__ void scatter_add_kernel(const uint32_t* __restrict__ index, const float* __restrict__ value,
                                   const uint64_t* __restrict__ count, size_t capacity, float* __restrict__ dense,
                                   size_t n) {
  const uint64_t m = *count < capacity ? *count : capacity;
  for (size_t j = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; j < m;
       j += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const uint32_t i = index[j];
    if (i < n) dense[i] += value[j];
  }
}

__global__ void scale_kernel(float* __restrict__ x, size_t n, float factor) {
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    x[i] *= factor;
  }
}

// Σ x² in float64: each block reduces its grid-stride share in shared memory, then one atomic add.
__global__ void norm2_kernel(const float* __restrict__ x, size_t n, double* __restrict__ out) {
  __shared__ double part[kThreads];
  double s = 0.0;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    const double v = static_cast<double>(x[i]);
    s += v * v;
  }
  part[threadIdx.x] = s;
  __syncthreads();
  for (unsigned w = kThreads / 2; w > 0; w >>= 1) {
    if (threadIdx.x < w) part[threadIdx.x] += part[threadIdx.x + w];
    __syncthreads();
  }
  if (threadIdx.x == 0) atomicAdd(out, part[0]);
}

// Each block counts its grid-stride share in shared memory (8 KiB of 32-bit bins: a block sees
// far fewer than 2^32 values), then adds its nonzero bins to the 64-bit global ones.
constexpr unsigned kHistogramShift = 20;
__global__ void magnitude_histogram_kernel(const float* __restrict__ x, size_t n, const uint64_t* __restrict__ count,
                                           unsigned long long* __restrict__ hist) {
  __shared__ unsigned int bins[kMagnitudeHistogramBins];
  for (unsigned b = threadIdx.x; b < kMagnitudeHistogramBins; b += blockDim.x) bins[b] = 0;
  __syncthreads();
  const size_t m = count != nullptr && *count < n ? static_cast<size_t>(*count) : n;
  for (size_t i = blockIdx.x * static_cast<size_t>(blockDim.x) + threadIdx.x; i < m;
       i += static_cast<size_t>(gridDim.x) * blockDim.x) {
    atomicAdd(&bins[(__float_as_uint(x[i]) & 0x7fffffffu) >> kHistogramShift], 1u);
  }
  __syncthreads();
  for (unsigned b = threadIdx.x; b < kMagnitudeHistogramBins; b += blockDim.x) {
    if (bins[b] != 0) atomicAdd(&hist[b], static_cast<unsigned long long>(bins[b]));
  }
}

}  // namespace

Status magnitude_histogram_add(const float* x, size_t n, const uint64_t* count, uint64_t* hist, Stream stream) {
  static_assert((0x7fffffffu >> kHistogramShift) + 1 == kMagnitudeHistogramBins);
  static_assert(sizeof(unsigned long long) == sizeof(uint64_t));
  if (hist == nullptr || (n > 0 && x == nullptr)) return invalid_argument("cuda::magnitude_histogram_add: null buffer");
  if (n == 0) return Status::Ok();
  magnitude_histogram_kernel<<<detail::stride_blocks(n, kThreads), kThreads, 0, stream>>>(
      x, n, count, reinterpret_cast<unsigned long long*>(hist));
  return cuda_status("magnitude_histogram_kernel", cudaGetLastError());
}

Status norm2(const float* x, size_t n, double* out, Stream stream) {
  if (out == nullptr || (n > 0 && x == nullptr)) return invalid_argument("cuda::norm2: null buffer");
  SC_RETURN_IF_ERROR(cuda_status("cudaMemsetAsync", cudaMemsetAsync(out, 0, sizeof(double), stream)));
  if (n == 0) return Status::Ok();
  norm2_kernel<<<detail::stride_blocks(n, kThreads), kThreads, 0, stream>>>(x, n, out);
  return cuda_status("norm2_kernel", cudaGetLastError());
}

Status local_sum(float* dst, std::span<const float* const> src, size_t n, Stream stream) {
  if (src.empty() || src.size() > kMaxSumInputs) {
    return invalid_argument("cuda::local_sum: " + std::to_string(src.size()) + " inputs; 1.." +
                            std::to_string(kMaxSumInputs) + " are allowed");
  }
  if (dst == nullptr) return invalid_argument("cuda::local_sum: null output");
  for (const float* p : src) {
    if (p == nullptr) return invalid_argument("cuda::local_sum: null input");
  }
  if (n == 0) return Status::Ok();
  if (src.size() == 1) {
    if (src[0] == dst) return Status::Ok();
    return cuda_status("cudaMemcpyAsync",
                       cudaMemcpyAsync(dst, src[0], n * sizeof(float), cudaMemcpyDefault, stream));
  }
  SumInputs in{};
  for (size_t j = 0; j < src.size(); ++j) in.src[j] = src[j];
  in.count = static_cast<unsigned>(src.size());
  local_sum_kernel<<<detail::stride_blocks(n, kThreads), kThreads, 0, stream>>>(in, dst, n);
  return cuda_status("local_sum_kernel", cudaGetLastError());
}

Status scatter_add(const DeviceSelection& sel, float* dense, size_t n, Stream stream) {
  if (dense == nullptr || sel.count == nullptr || (sel.capacity > 0 && (sel.index == nullptr || sel.value == nullptr))) {
    return invalid_argument("cuda::scatter_add: null buffer");
  }
  if (sel.capacity == 0 || n == 0) return Status::Ok();
  scatter_add_kernel<<<detail::stride_blocks(sel.capacity, kThreads), kThreads, 0, stream>>>(
      sel.index, sel.value, sel.count, sel.capacity, dense, n);
  return cuda_status("scatter_add_kernel", cudaGetLastError());
}

Status scale(float* x, size_t n, float factor, Stream stream) {
  if (n == 0) return Status::Ok();
  if (x == nullptr) return invalid_argument("cuda::scale: null buffer");
  scale_kernel<<<detail::stride_blocks(n, kThreads), kThreads, 0, stream>>>(x, n, factor);
  return cuda_status("scale_kernel", cudaGetLastError());
}

}  // namespace sparsecar::kernels::cuda
