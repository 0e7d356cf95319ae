#include "sparsecar/policies/cost_model.h"

#include <limits>

#include "controller_internal.h"
#include "sparsecar/kernels/codec.h"

namespace sparsecar::policies {

uint64_t sparse_allgather_bytes(uint64_t elements, uint64_t nnz, uint32_t world, kernels::Format* format) {
  uint64_t best = std::numeric_limits<uint64_t>::max();
  kernels::Format best_format = kernels::Format::kCoo;
  // Every row of the codec registry but those that carry every element (dense), in id order.
  for (const kernels::CodecInfo& row : kernels::codec_registry()) {
    if (row.dense) continue;
    const size_t b = kernels::encoded_bytes(row.id, kernels::ValueType::kF32, elements, nnz);
    if (b > 0 && b < best) {
      best = b;
      best_format = row.id;
    }
  }
  if (best == std::numeric_limits<uint64_t>::max()) best = nnz * 8;
  if (format) *format = best_format;
  return static_cast<uint64_t>(world > 0 ? world - 1 : 0) * (kWireHeaderBytes + best);
}

uint64_t sparse_allgather_bytes_as(uint64_t elements, uint64_t nnz, uint32_t world, kernels::Format format) {
  size_t b = kernels::encoded_bytes(format, kernels::ValueType::kF32, elements, nnz);
  if (b == 0) b = kernels::encoded_bytes(kernels::Format::kCoo, kernels::ValueType::kF32, elements, nnz);
  return static_cast<uint64_t>(world > 0 ? world - 1 : 0) * (kWireHeaderBytes + b);
}

uint64_t ring_allreduce_bytes(uint64_t elements, uint32_t world) {
  if (world < 2) return 0;
  const uint64_t chunk = (elements + world - 1) / world;
  return 2ull * (world - 1) * (kWireHeaderBytes + 4 * chunk);
}

uint64_t step_sparse_bytes(std::span<const TensorStepObservation> tensors, double density, uint32_t world,
                           kernels::Format format) {
  uint64_t total = 0;
  for (const auto& t : tensors) total += sparse_allgather_bytes_as(t.elements, topk_count(t.elements, density), world, format);
  return total;
}

uint64_t step_dense_bytes(std::span<const TensorStepObservation> tensors, uint32_t world) {
  uint64_t total = 0;
  for (const auto& t : tensors) total += ring_allreduce_bytes(t.elements, world);
  return total;
}
}  // namespace sparsecar::policies
