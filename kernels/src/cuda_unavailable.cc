// cuda.h and cuda_codecs.h without CUDA: the library was built where CMake found no nvcc (or
// SPARSECAR_CUDA=OFF). Every call answers kUnavailable (no device codec, workspaces of 0 bytes),
// so callers link and fall back to the CPU path. decode_status() is host-only and comes from
// cuda_codecs_host.cc in both builds.
#include "sparsecar/kernels/cuda.h"
#include "sparsecar/kernels/cuda_codecs.h"

namespace sparsecar::kernels::cuda {
namespace {

Status unavailable_here(const char* what) {
  return unavailable(std::string(what) + ": sparsecar was built without CUDA (no nvcc found, or SPARSECAR_CUDA=OFF)");
}

}  // namespace

bool built() { return false; }
int device_count() { return 0; }
std::string device_description(int) { return "built without CUDA"; }
Expected<void*> device_alloc(size_t) { return unavailable_here("cuda::device_alloc"); }
void device_free(void*) {}
Status copy_async(void*, const void*, size_t, Stream) { return unavailable_here("cuda::copy_async"); }
Status zero_async(void*, size_t, Stream) { return unavailable_here("cuda::zero_async"); }
Status synchronize(Stream) { return unavailable_here("cuda::synchronize"); }
Expected<Stream> stream_create() { return unavailable_here("cuda::stream_create"); }
void stream_destroy(Stream) {}
Status set_device(int) { return unavailable_here("cuda::set_device"); }
Expected<bool> enable_peer_access(int, int) { return unavailable_here("cuda::enable_peer_access"); }
Expected<void*> host_alloc_pinned(size_t) { return unavailable_here("cuda::host_alloc_pinned"); }
void host_free_pinned(void*) {}
Status stream_wait_event(Stream, void*) { return unavailable_here("cuda::stream_wait_event"); }
Status event_record(void*, Stream) { return unavailable_here("cuda::event_record"); }
Expected<void*> event_create() { return unavailable_here("cuda::event_create"); }
void event_destroy(void*) {}
Status local_sum(float*, std::span<const float* const>, size_t, Stream) { return unavailable_here("cuda::local_sum"); }
Status scatter_add(const DeviceSelection&, float*, size_t, Stream) { return unavailable_here("cuda::scatter_add"); }
Status scale(float*, size_t, float, Stream) { return unavailable_here("cuda::scale"); }
Status norm2(const float*, size_t, double*, Stream) { return unavailable_here("cuda::norm2"); }
Status magnitude_histogram_add(const float*, size_t, const uint64_t*, uint64_t*, Stream) {
  return unavailable_here("cuda::magnitude_histogram_add");
}
size_t select_workspace_bytes(size_t) { return 0; }

Status ef_threshold(float*, const float*, size_t, float, bool, const DeviceSelection&, Workspace, Stream) {
  return unavailable_here("cuda::ef_threshold");
}
Status ef_momentum_threshold(float*, float*, const float*, size_t, float, float, float, const DeviceSelection&,
                             Workspace, Stream) {
  return unavailable_here("cuda::ef_momentum_threshold");
}
Status ef_topk(float*, const float*, size_t, size_t, bool, const DeviceSelection&, Workspace, Stream) {
  return unavailable_here("cuda::ef_topk");
}
Status ef_topk_approx(float*, const float*, size_t, size_t, double, bool, const DeviceSelection&, Workspace, Stream) {
  return unavailable_here("cuda::ef_topk_approx");
}
Status ef_percentile(float*, const float*, size_t, double, bool, const DeviceSelection&, Workspace, Stream) {
  return unavailable_here("cuda::ef_percentile");
}
Status randomk(const float*, size_t, double, uint64_t, bool, const DeviceSelection&, Workspace, Stream) {
  return unavailable_here("cuda::randomk");
}
Status randblock(const float*, size_t, size_t, double, uint64_t, bool, const DeviceSelection&, Workspace, Stream) {
  return unavailable_here("cuda::randblock");
}

Status ef_importance(float*, const float*, size_t, size_t, uint64_t, bool, bool, const DeviceSelection&, Workspace,
                     Stream) {
  return unavailable_here("cuda::ef_importance");
}
size_t importance_workspace_bytes(size_t) { return 0; }

size_t structured_workspace_bytes(size_t, size_t) { return 0; }
size_t select_workspace_bytes(size_t, std::span<const uint64_t>) { return 0; }
Status ef_block_topk(float*, const float*, size_t, size_t, size_t, GroupNorm, bool, const DeviceSelection&, Workspace,
                     Stream) {
  return unavailable_here("cuda::ef_block_topk");
}
Status ef_row_topk(float*, const float*, size_t, size_t, size_t, size_t, GroupNorm, bool, const DeviceSelection&,
                   Workspace, Stream) {
  return unavailable_here("cuda::ef_row_topk");
}
Status ef_column_topk(float*, const float*, size_t, size_t, size_t, size_t, GroupNorm, bool, const DeviceSelection&,
                      Workspace, Stream) {
  return unavailable_here("cuda::ef_column_topk");
}
Status ef_channel_topk(float*, const float*, size_t, std::span<const uint64_t, 4>, size_t, GroupNorm, bool,
                       const DeviceSelection&, Workspace, Stream) {
  return unavailable_here("cuda::ef_channel_topk");
}
Status ef_head_topk(float*, const float*, size_t, size_t, size_t, size_t, GroupNorm, bool, const DeviceSelection&,
                    Workspace, Stream) {
  return unavailable_here("cuda::ef_head_topk");
}

SelectFn find_select(Selector) { return nullptr; }

bool has_device_codec(Format) { return false; }
size_t encode_bound_bytes(Format, ValueType, size_t, size_t) { return 0; }
size_t encode_workspace_bytes(Format, ValueType, size_t) { return 0; }
Status encode(const EncodeParams&, size_t, const DeviceSelection&, const DevicePayloadOut&, Workspace, Stream) {
  return unavailable_here("cuda::encode");
}
size_t decode_workspace_bytes(size_t, size_t, size_t) { return 0; }
Status decode_accumulate(std::span<const DevicePayload>, float*, size_t, uint32_t, DecodeStatus*, Workspace, Stream,
                         DecodePath) {
  return unavailable_here("cuda::decode_accumulate");
}

}  // namespace sparsecar::kernels::cuda
