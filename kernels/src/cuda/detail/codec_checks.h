// The checks of a received payload that its wire header alone decides (no CUDA): shared by
// codecs.cu, which skips a payload that fails them, and cuda_codecs_host.cc, whose
// decode_status() gives their message.
#pragma once

#include <cstddef>

#include "sparsecar/common/status.h"
#include "sparsecar/kernels/cuda_codecs.h"

namespace sparsecar::kernels::cuda::detail {

// Ok, or the kDataLoss the CPU decoder (codec.h's decode_accumulate) returns for the same
// header before it reads a byte: value type or format unknown, nnz > dense_len, a payload size
// the format cannot have for that nnz. A known format without a device decoder passes (the
// caller rejects it before).
Status header_check(const DevicePayload& payload, size_t dense_len);

}  // namespace sparsecar::kernels::cuda::detail
