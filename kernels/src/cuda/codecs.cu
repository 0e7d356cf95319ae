// cuda_codecs.h: validate on the host, then queue the kernels of detail/codec_kernels.cuh on the
// caller's stream (no allocation, no host synchronisation). One row per format with a device
// codec (kDeviceCodecs): what a format means on the device is said there and nowhere else.
#include <cuda_runtime.h>

#include <algorithm>
#include <limits>
#include <string>

#include "cuda/detail/codec_checks.h"
#include "cuda/detail/codec_kernels.cuh"
#include "cuda/detail/launch.h"
#include "cuda/detail/status.h"
#include "sparsecar/kernels/codec.h"
#include "sparsecar/kernels/cuda_codecs.h"

namespace sparsecar::kernels::cuda {
namespace {

using namespace detail;  // NOLINT: the kernels of this backend

constexpr size_t kMaxElements = std::numeric_limits<uint32_t>::max();
size_t scan_tiles(size_t items) { return (items + kScanTile - 1) / kScanTile; }
size_t bitmap_bytes(size_t n) { return n / 8 + (n % 8 != 0); }

unsigned stride_blocks(size_t n) { return detail::stride_blocks(n, kCodecThreads); }

// The scan of codec_kernels.cuh over `items`: tile sums, tile offsets (+ *total), apply.
template <class Len, class Sink>
void scan(const Len& len, const Sink& sink, size_t items, unsigned long long* tile_sums, unsigned long long* total,
          Stream stream) {
  const size_t tiles = scan_tiles(items);
  if (tiles > 0) {
    scan_reduce_kernel<Len><<<static_cast<unsigned>(tiles), kCodecThreads, 0, stream>>>(len, items, tile_sums);
  }
  scan_tiles_kernel<<<1, kScanTilesThreads, 0, stream>>>(tile_sums, tiles, total);
  if (tiles > 0) {
    scan_apply_kernel<Len, Sink><<<static_cast<unsigned>(tiles), kCodecThreads, 0, stream>>>(len, sink, items,
                                                                                              tile_sums);
  }
}

// ---- encode --------------------------------------------------------------------------------------

// The encode workspace: the scratch (zeroed per call), then the varint scan's tile sums.
struct EncodeLayout {
  EncodeScratch* scratch;
  unsigned long long* tile_sums;
  size_t bytes;
};
EncodeLayout encode_layout(void* base, size_t capacity) {
  EncodeLayout l{};
  WorkspaceCarver carve(base);
  l.scratch = carve.take<EncodeScratch>(sizeof(EncodeScratch));
  l.tile_sums = carve.take<unsigned long long>(std::max<size_t>(scan_tiles(capacity), 1) * sizeof(unsigned long long));
  l.bytes = carve.bytes();
  return l;
}

void encode_coo(const EncodeArgs& a, const EncodeLayout&, size_t capacity, Stream stream) {
  coo_encode_kernel<<<stride_blocks(capacity), kCodecThreads, 0, stream>>>(a);
}
void encode_varint(const EncodeArgs& a, const EncodeLayout& l, size_t capacity, Stream stream) {
  scan(VarintLenOp{a}, VarintPutOp{a}, capacity, l.tile_sums, &l.scratch->total, stream);
}
void encode_bitmap(const EncodeArgs& a, const EncodeLayout&, size_t capacity, Stream stream) {
  bitmap_encode_kernel<<<stride_blocks(capacity), kCodecThreads, 0, stream>>>(a);
}

// ---- decode --------------------------------------------------------------------------------------

// The decode workspace for one payload of `bytes` (payloads run one after another and reuse
// it): the scratch (zeroed per payload), the scan's tile sums, and for coo_varint the
// terminator positions and the gaps / indices of its entries (at most min(bytes, dense_len)).
struct DecodeLayout {
  DecodeScratch* scratch;
  unsigned long long* tile_sums;
  uint32_t* term_pos;
  unsigned long long* index;
  size_t bytes;
};
DecodeLayout decode_layout(void* base, size_t dense_len, size_t payload_bytes) {
  DecodeLayout l{};
  WorkspaceCarver carve(base);
  const size_t words = (bitmap_bytes(dense_len) + 3) / 4;
  const size_t tiles = std::max<size_t>({scan_tiles(words), scan_tiles(payload_bytes), 1});
  const size_t entries = std::min(payload_bytes, dense_len);
  l.scratch = carve.take<DecodeScratch>(sizeof(DecodeScratch));
  l.tile_sums = carve.take<unsigned long long>(tiles * sizeof(unsigned long long));
  l.term_pos = carve.take<uint32_t>(entries * sizeof(uint32_t));
  l.index = carve.take<unsigned long long>(entries * sizeof(unsigned long long));
  l.bytes = carve.bytes();
  return l;
}

void int8_codes(const PayloadArgs& a, Stream stream) {
  if (a.vt == ValueType::kI8 && a.n > 0) int8_codes_kernel<<<stride_blocks(a.n), kCodecThreads, 0, stream>>>(a);
}

// The coo checks and verdict (a.values set).
void check_coo(PayloadArgs& a, Stream stream) {
  a.values = a.data + 4 * a.n;
  if (a.n > 0) coo_check_kernel<<<stride_blocks(a.n), kCodecThreads, 0, stream>>>(a);
  int8_codes(a, stream);
  coo_finish_kernel<<<1, 1, 0, stream>>>(a);
}

void decode_coo(PayloadArgs a, const DecodeLayout&, Stream stream) {
  check_coo(a, stream);
  if (a.n > 0) coo_scatter_kernel<<<stride_blocks(a.n), kCodecThreads, 0, stream>>>(a);
}

// The fused path's chunk starts: `peers` rows of chunks + 1, ahead of the per-payload layout.
size_t scatter_chunks(size_t dense_len) { return (dense_len + kScatterChunk - 1) / kScatterChunk; }
size_t fused_bytes(size_t dense_len, size_t peers) {
  return align_up(peers * (scatter_chunks(dense_len) + 1) * sizeof(uint32_t));
}

void decode_varint(PayloadArgs a, const DecodeLayout& l, Stream stream) {
  const unsigned long long values = value_block_bytes_of(a.vt, a.n);
  a.values = a.data;
  a.region_at = a.data + values;
  a.region = a.bytes - values;
  scan(VarintTermOp{a}, VarintTermPosOp{a, l.term_pos}, a.region, l.tile_sums, &l.scratch->total, stream);
  if (a.n > 0) {
    varint_parse_kernel<<<stride_blocks(a.n), kCodecThreads, 0, stream>>>(a, l.term_pos, l.index);
    scan(VarintGapOp{l.index}, VarintIndexOp{a, l.index}, a.n, l.tile_sums, &l.scratch->index_total, stream);
  }
  int8_codes(a, stream);
  varint_finish_kernel<<<1, 1, 0, stream>>>(a, l.term_pos, l.index);
  if (a.n > 0) varint_scatter_kernel<<<stride_blocks(a.n), kCodecThreads, 0, stream>>>(a, l.index);
}

void decode_bitmap(PayloadArgs a, const DecodeLayout& l, Stream stream) {
  a.region_at = a.data;
  a.region = bitmap_bytes(a.dense_len);
  a.values = a.data + a.region;
  const size_t words = (a.region + 3) / 4;
  const size_t tiles = scan_tiles(words);
  // The scan in two halves: the popcounts' offsets and total first, the scatter (gated on the
  // verdict) after the checks.
  if (tiles > 0) {
    scan_reduce_kernel<BitmapCountOp><<<static_cast<unsigned>(tiles), kCodecThreads, 0, stream>>>(BitmapCountOp{a},
                                                                                                  words, l.tile_sums);
  }
  scan_tiles_kernel<<<1, kScanTilesThreads, 0, stream>>>(l.tile_sums, tiles, &l.scratch->total);
  int8_codes(a, stream);
  bitmap_finish_kernel<<<1, 1, 0, stream>>>(a);
  if (tiles > 0) {
    scan_apply_kernel<BitmapCountOp, BitmapScatterOp><<<static_cast<unsigned>(tiles), kCodecThreads, 0, stream>>>(
        BitmapCountOp{a}, BitmapScatterOp{a}, words, l.tile_sums);
  }
}

// ---- the rows ------------------------------------------------------------------------------------

struct DeviceCodec {
  Format id;
  void (*encode)(const EncodeArgs& a, const EncodeLayout& l, size_t capacity, Stream stream);
  void (*decode)(PayloadArgs a, const DecodeLayout& l, Stream stream);
};

constexpr DeviceCodec kDeviceCodecs[] = {
    {.id = Format::kCoo, .encode = encode_coo, .decode = decode_coo},
    {.id = Format::kCooVarint, .encode = encode_varint, .decode = decode_varint},
    {.id = Format::kBitmap, .encode = encode_bitmap, .decode = decode_bitmap},
};

const DeviceCodec* find_device_codec(Format f) {
  for (const DeviceCodec& row : kDeviceCodecs) {
    if (row.id == f) return &row;
  }
  return nullptr;
}


}  // namespace

bool has_device_codec(Format format) { return find_device_codec(format) != nullptr; }

size_t encode_bound_bytes(Format format, ValueType value_type, size_t dense_len, size_t capacity) {
  if (!has_device_codec(format) || find_value_type(value_type) == nullptr) return 0;
  const SizeRange r = payload_size_range(format, value_type, dense_len, std::min(capacity, dense_len));
  return r.min <= r.max ? r.max : 0;
}

size_t encode_workspace_bytes(Format, ValueType, size_t capacity) { return encode_layout(nullptr, capacity).bytes; }

Status encode(const EncodeParams& params, size_t dense_len, const DeviceSelection& sel, const DevicePayloadOut& out,
              Workspace ws, Stream stream) {
  const std::string name = "cuda::encode";
  const DeviceCodec* row = find_device_codec(params.format);
  if (row == nullptr) {
    return invalid_argument(name + ": format " + std::string(format_name(params.format)) + " has no CUDA encoder");
  }
  if (find_value_type(params.value_type) == nullptr) {
    return invalid_argument(name + ": value type " + std::to_string(static_cast<unsigned>(params.value_type)) +
                            " is unknown");
  }
  if (dense_len > kMaxElements) {
    return invalid_argument(name + ": dense length " + std::to_string(dense_len) + " exceeds 2^32 - 1");
  }
  if (sel.count == nullptr || (sel.capacity > 0 && (sel.index == nullptr || sel.value == nullptr))) {
    return invalid_argument(name + ": null selection buffer");
  }
  const size_t bound = encode_bound_bytes(params.format, params.value_type, dense_len, sel.capacity);
  if (out.data == nullptr || out.bytes == nullptr || out.capacity_bytes < bound) {
    return invalid_argument(name + ": output of " + std::to_string(out.capacity_bytes) + " bytes (or null); " +
                            std::string(format_name(params.format)) + "/" +
                            std::string(value_type_name(params.value_type)) + " needs " + std::to_string(bound));
  }
  SC_RETURN_IF_ERROR(check_workspace(name, ws, encode_workspace_bytes(params.format, params.value_type, sel.capacity)));

  const EncodeLayout l = encode_layout(ws.ptr, sel.capacity);
  EncodeArgs a{};
  a.index = sel.index;
  a.value = sel.value;
  a.count = reinterpret_cast<const unsigned long long*>(sel.count);
  a.limit = std::min(sel.capacity, dense_len);
  a.vt = params.value_type;
  a.dense_len = dense_len;
  a.bitmap_bytes = bitmap_bytes(dense_len);
  a.out = reinterpret_cast<uint8_t*>(out.data);
  a.scratch = l.scratch;
  SC_RETURN_IF_ERROR(cuda_status("cuda::encode", cudaMemsetAsync(l.scratch, 0, sizeof(EncodeScratch), stream)));
  if (params.format == Format::kBitmap && a.bitmap_bytes > 0) {
    SC_RETURN_IF_ERROR(cuda_status("cuda::encode", cudaMemsetAsync(out.data, 0, a.bitmap_bytes, stream)));
  }
  if (params.value_type == ValueType::kI8 && a.limit > 0) {
    int8_max_kernel<<<stride_blocks(a.limit), kCodecThreads, 0, stream>>>(a);
  }
  if (a.limit > 0) row->encode(a, l, a.limit, stream);
  encode_finish_kernel<<<1, 1, 0, stream>>>(a, params.format, reinterpret_cast<unsigned long long*>(out.bytes),
                                            reinterpret_cast<unsigned long long*>(out.nnz));
  return cuda_status("cuda::encode", cudaGetLastError());
}

size_t decode_workspace_bytes(size_t dense_len, size_t max_payload_bytes, size_t peers) {
  const size_t fused = peers > 1 ? fused_bytes(dense_len, peers) : 0;
  return fused + decode_layout(nullptr, dense_len, max_payload_bytes).bytes;
}

Status decode_accumulate(std::span<const DevicePayload> payloads, float* dense, size_t dense_len,
                         uint32_t average_over, DecodeStatus* status, Workspace ws, Stream stream,
                         DecodePath path) {
  const std::string name = "cuda::decode_accumulate";
  if (dense_len > kMaxElements) {
    return invalid_argument(name + ": dense length " + std::to_string(dense_len) + " exceeds 2^32 - 1");
  }
  if (dense_len > 0 && dense == nullptr) return invalid_argument(name + ": null dense buffer");
  if (!payloads.empty() && status == nullptr) return invalid_argument(name + ": null status array");
  for (size_t j = 0; j < payloads.size(); ++j) {
    const DevicePayload& p = payloads[j];
    const std::string which = name + ": payload " + std::to_string(j) + " ";
    if (find_codec(p.format) != nullptr && !has_device_codec(p.format)) {
      return invalid_argument(which + "is " + std::string(format_name(p.format)) + ", which has no CUDA decoder");
    }
    if (p.bytes > kMaxElements) {
      return invalid_argument(which + "has " + std::to_string(p.bytes) + " bytes; the device decoders take < 2^32");
    }
    if (p.bytes > 0 && p.data == nullptr) return invalid_argument(which + "is null");
    SC_RETURN_IF_ERROR(check_workspace(which, ws, decode_workspace_bytes(dense_len, p.bytes)));
  }
  // Several coo payloads and room for their chunk starts: checked one by one, added in one pass.
  size_t max_bytes = 0;
  bool all_coo = payloads.size() > 1;
  for (const DevicePayload& p : payloads) {
    max_bytes = std::max<size_t>(max_bytes, p.bytes);
    all_coo = all_coo && p.format == Format::kCoo;
  }
  // kAuto: worth it when the dense buffer overflows L2, so that peer-by-peer scatters fetch a
  // line from memory once per peer, and the peers touch enough of it. One H100
  // (docs/benchmarks.md): 8 peers at 1 % into 64 Mi floats 0.499 -> 0.397 ms; at 0.1 %, or into
  // 16 Mi floats (64 MiB, mostly in L2), it was slower.
  bool chunked = path == DecodePath::kChunked;
  if (path == DecodePath::kAuto) {
    unsigned long long entries = 0;
    for (const DevicePayload& p : payloads) entries += p.nnz;
    int device = 0;
    int l2_bytes = 0;
    if (cudaGetDevice(&device) == cudaSuccess) cudaDeviceGetAttribute(&l2_bytes, cudaDevAttrL2CacheSize, device);
    chunked = dense_len * sizeof(float) > 2 * static_cast<size_t>(l2_bytes) && entries * 32 >= dense_len;
  }
  const bool fused = chunked && all_coo && dense_len > 0 &&
                     ws.bytes >= decode_workspace_bytes(dense_len, max_bytes, payloads.size());
  const size_t chunks = scatter_chunks(dense_len);
  auto* starts = static_cast<uint32_t*>(ws.ptr);
  void* per_payload = fused ? static_cast<char*>(ws.ptr) + fused_bytes(dense_len, payloads.size()) : ws.ptr;
  ScatterPeers group{};
  const auto flush = [&] {
    if (group.count == 0) return;
    coo_fused_scatter_kernel<<<stride_blocks(chunks * kCodecThreads), kCodecThreads, 0, stream>>>(group, dense,
                                                                                                  chunks);
    group = ScatterPeers{};
  };
  for (size_t j = 0; j < payloads.size(); ++j) {
    const DevicePayload& p = payloads[j];
    ScatterPeer* peer = fused ? &group.peer[group.count++] : nullptr;
    if (peer != nullptr) *peer = ScatterPeer{nullptr, nullptr, nullptr, status + j, 0, p.value_type};
    const bool header_ok = header_check(p, dense_len).ok();
    if (!header_ok) {
      set_status_kernel<<<1, 1, 0, stream>>>(status + j, static_cast<uint32_t>(DecodeError::kHeader));
    }
    if (header_ok) {
      const DecodeLayout l = decode_layout(per_payload, dense_len, p.bytes);
    SC_RETURN_IF_ERROR(
        cuda_status("cuda::decode_accumulate", cudaMemsetAsync(l.scratch, 0, sizeof(DecodeScratch), stream)));
    PayloadArgs a{};
    a.data = reinterpret_cast<const uint8_t*>(p.data);
    a.bytes = p.bytes;
    a.n = p.nnz;
    a.dense_len = dense_len;
    a.vt = p.value_type;
    a.scratch = l.scratch;
    a.status = status + j;
    a.dense = dense;
    if (peer != nullptr) {
      check_coo(a, stream);
      uint32_t* row = starts + j * (chunks + 1);
      if (a.n > 0) coo_chunks_kernel<<<stride_blocks(a.n), kCodecThreads, 0, stream>>>(a, row, chunks);
      *peer = ScatterPeer{a.data, a.values, row, status + j, a.n, p.value_type};
    } else {
      find_device_codec(p.format)->decode(a, l, stream);
    }
    }
    if (peer != nullptr && group.count == kFusedPeers) flush();
  }
  flush();
  if (average_over > 0 && dense_len > 0) {
    const float factor = 1.0f / static_cast<float>(average_over);  // the pipeline's inv_trainers
    scale_kernel<<<stride_blocks(dense_len), kCodecThreads, 0, stream>>>(dense, dense_len, factor);
  }
  return cuda_status("cuda::decode_accumulate", cudaGetLastError());
}

}  // namespace sparsecar::kernels::cuda
