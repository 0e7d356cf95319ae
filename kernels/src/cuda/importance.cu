// cuda.h's importance sampling (ef_importance): validate on the host, then queue the kernels of
// detail/importance_kernels.cuh and one compaction (detail/select_kernels.cuh) on the caller's
// stream. No allocation and no host synchronisation: the fixed point's 8 rounds are all queued,
// and the rounds after it settles are gated off on the device.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>

#include "cuda/detail/importance_kernels.cuh"
#include "cuda/detail/launch.h"
#include "cuda/detail/select_kernels.cuh"
#include "cuda/detail/status.h"
#include "detail/importance.h"
#include "sparsecar/kernels/cuda.h"

namespace sparsecar::kernels::cuda {
namespace {

using namespace detail;  // NOLINT: the kernels of this backend

constexpr size_t kMaxElements = std::numeric_limits<uint32_t>::max();
constexpr size_t kWidth = kernels::detail::kTreeWidth;

size_t groups_of(size_t count) { return (count + kWidth - 1) / kWidth; }

// The blocked tree's partial sums above the elements: level 0 holds one sum per chunk of kWidth
// elements, level j + 1 one per kWidth entries of level j, up to a level of one entry (4 levels
// for 2^32 - 1 elements).
struct Levels {
  static constexpr int kMax = 6;
  size_t count[kMax];
  size_t offset[kMax];  // into the sums array
  int levels;
  size_t total;
};
Levels levels_of(size_t n) {
  Levels lv{};
  size_t count = groups_of(std::max<size_t>(n, 1));
  while (true) {
    lv.count[lv.levels] = count;
    lv.offset[lv.levels] = lv.total;
    lv.total += count;
    ++lv.levels;
    if (count == 1) break;
    count = groups_of(count);
  }
  return lv;
}

// The workspace, carved in this order; state and status are zeroed before every call.
struct Layout {
  ImportanceState* state;
  unsigned long long* status;  // one look-back word per compaction tile
  size_t zeroed_bytes;
  double* sums;                // Levels::total partial sums
  size_t bytes;
};
Layout layout(void* base, size_t n) {
  Layout l{};
  WorkspaceCarver carve(base);
  l.state = carve.take<ImportanceState>(sizeof(ImportanceState));
  l.status = carve.take<unsigned long long>(std::max<size_t>((n + kTile - 1) / kTile, 1) * sizeof(unsigned long long));
  l.zeroed_bytes = carve.bytes();
  l.sums = carve.take<double>(levels_of(n).total * sizeof(double));
  l.bytes = carve.bytes();
  return l;
}

unsigned grid_of(size_t groups) { return detail::stride_blocks(groups, 1); }

// Queues the levels above a leaf pass (each gated like it); returns where the total lands.
const double* queue_tree(const Layout& l, const Levels& lv, const unsigned* gate, Stream stream) {
  for (int j = 1; j < lv.levels; ++j) {
    tree_level_kernel<<<grid_of(lv.count[j]), kTreeThreads, 0, stream>>>(l.sums + lv.offset[j - 1], lv.count[j - 1],
                                                                        l.sums + lv.offset[j], gate);
  }
  return l.sums + lv.offset[lv.levels - 1];
}

// The selection: compact_kernel with ImportanceOp, pairs in index order. Its persistent grid as
// select.cu's: at most one block per tile, 4 per SM (the kernel's launch bounds).
void queue_selection(const ImportanceOp& op, size_t n, const DeviceSelection& out, const Layout& l, Stream stream) {
  const size_t tiles = (n + kTile - 1) / kTile;
  const size_t persistent = detail::stride_blocks(size_t{1} << 40, kThreads) / 2;
  const Output output{out.index, out.value, out.capacity, reinterpret_cast<unsigned long long*>(out.count)};
  compact_kernel<ImportanceOp><<<static_cast<unsigned>(std::min(tiles, persistent)), kThreads, 0, stream>>>(
      op, n, output, l.status, &l.state->tile_counter, nullptr, nullptr);
}

}  // namespace

size_t importance_workspace_bytes(size_t n) { return layout(nullptr, n).bytes; }

Status ef_importance(float* residual, const float* grad, size_t n, size_t k, uint64_t seed, bool unbiased,
                     bool clear_sent, const DeviceSelection& out, Workspace ws, Stream stream) {
  constexpr const char* kWhat = "cuda::ef_importance";
  const std::string name(kWhat);
  if (n > kMaxElements) return invalid_argument(name + ": " + std::to_string(n) + " elements exceed 2^32 - 1");
  if (n > 0 && residual == nullptr) return invalid_argument(name + ": null input");
  if (out.count == nullptr) return invalid_argument(name + ": null count");
  if (out.capacity > 0 && (out.index == nullptr || out.value == nullptr)) {
    return invalid_argument(name + ": null output with capacity " + std::to_string(out.capacity));
  }
  SC_RETURN_IF_ERROR(check_workspace(name, ws, importance_workspace_bytes(n)));

  if (n == 0 || k == 0) {  // the CPU sends nothing; the error feedback still happens
    if (grad != nullptr && n > 0) {
      importance_add_kernel<<<detail::stride_blocks(n, kThreads), kThreads, 0, stream>>>(residual, grad, n);
      SC_RETURN_IF_ERROR(cuda_status(kWhat, cudaGetLastError()));
    }
    return cuda_status(kWhat, cudaMemsetAsync(out.count, 0, sizeof(uint64_t), stream));
  }
  const Layout l = layout(ws.ptr, n);
  const Levels lv = levels_of(n);
  SC_RETURN_IF_ERROR(cuda_status(kWhat, cudaMemsetAsync(l.state, 0, l.zeroed_bytes, stream)));
  const unsigned leaf_grid = grid_of(lv.count[0]);
  // 1. residual += grad, the counts and the sum of |x|: c's start (or its final value at once).
  importance_leaf_kernel<true><<<leaf_grid, kTreeThreads, 0, stream>>>(residual, grad, n, l.state, l.sums, nullptr);
  importance_start_kernel<<<1, 1, 0, stream>>>(l.state, k, queue_tree(l, lv, nullptr, stream));
  // 2. The fixed point's rounds, each skipped on the device once it is done.
  const unsigned* running = &l.state->running;
  for (int round = 0; round < kernels::detail::kImportanceRounds; ++round) {
    importance_leaf_kernel<false><<<leaf_grid, kTreeThreads, 0, stream>>>(residual, nullptr, n, l.state, l.sums,
                                                                          running);
    importance_round_kernel<<<1, 1, 0, stream>>>(l.state, round, queue_tree(l, lv, running, stream));
  }
  SC_RETURN_IF_ERROR(cuda_status(kWhat, cudaGetLastError()));
  // 3. The draws under c, one compaction (the CPU's seed rule: splitmix64(seed) split in two).
  const uint64_t mixed = kernels::detail::splitmix64(seed);
  const ImportanceOp op{residual, l.state, static_cast<uint32_t>(mixed), static_cast<uint32_t>(mixed >> 32), unbiased,
                        clear_sent};
  queue_selection(op, n, out, l, stream);
  return cuda_status(kWhat, cudaGetLastError());
}

}  // namespace sparsecar::kernels::cuda
