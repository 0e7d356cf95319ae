// The cost model: bytes one node sends for a step, sparse (all-gather of the encoded selection)
// or dense (ring all-reduce), from exact encoded sizes (kernels/codecs.h) and the wire header.
//
// The bandwidth and cost controllers (controllers.h) predict exchange times with it; the daemon
// uses it for what a dense ring would have sent (NodeObservation::dense_bytes). Pure functions.
#pragma once

#include <cstdint>
#include <span>

#include "sparsecar/kernels/codecs.h"
#include "sparsecar/policies/observations.h"

namespace sparsecar::policies {

inline constexpr uint64_t kWireHeaderBytes = 80;
// Bytes one node sends for a sparse all-gather of a tensor with nnz kept, in the smallest format
// of the codec registry (kernels/codecs.h; rows that carry every element aside) by its largest
// size (kernels::encoded_bytes, fp32 values); *format gets that format (ties: the lower id).
uint64_t sparse_allgather_bytes(uint64_t elements, uint64_t nnz, uint32_t world, kernels::Format* format);
// The same in a given format (the largest size for formats whose size varies).
uint64_t sparse_allgather_bytes_as(uint64_t elements, uint64_t nnz, uint32_t world, kernels::Format format);
// Bytes one node sends in a dense ring all-reduce (2(W-1) chunks of about n/W fp32).
uint64_t ring_allreduce_bytes(uint64_t elements, uint32_t world);
// Per node bytes of a whole step at `density` (top-k counts per tensor), sparse vs dense.
uint64_t step_sparse_bytes(std::span<const TensorStepObservation> tensors, double density, uint32_t world,
                           kernels::Format format = kernels::Format::kCoo);
uint64_t step_dense_bytes(std::span<const TensorStepObservation> tensors, uint32_t world);

}  // namespace sparsecar::policies
