// The device kernels behind cuda_codecs.h (the bottom layer; codecs.cu validates and launches
// them). They assume valid arguments; payload bytes are hostile and read only inside
// [data, data + bytes).
//
// Building blocks:
// - byte access: payloads have no alignment (a bitmap's value block starts at any byte), so
//   every multi-byte field is read and written a byte at a time, little-endian.
// - a three-kernel exclusive scan over a functor (scan_reduce_kernel: one sum per tile of
//   kScanTile items; scan_tiles_kernel: one block scans the tile sums and writes the total;
//   scan_apply_kernel: each tile rescans its items and calls sink(i, offset, len) in order).
//   It is deterministic and reads the items twice; a decoupled look-back (select_kernels.cuh's
//   compact_kernel) would read them once — the first place to look when the encoders' speed
//   matters. Used for the varint byte offsets (encode), the bitmap's value ranks (decode) and
//   the varint terminators and index sums (decode).
// - per-payload validation kernels that record the first bad entry as ~key with atomicMax (the
//   smallest key wins, as the CPU's sequential first pass would report it), a one-thread
//   finish kernel per payload that turns that into its DecodeStatus, then a scatter gated on
//   the status. Peers are decoded one after another on the stream, so each element receives
//   its peers' values in the CPU's order, one addition each (no atomics in the sums).
// Float arithmetic is detail/bits.h's cpu_add / cpu_mul (round to nearest, never contracted into
// an FMA, which would round once where the CPU rounds twice; a NaN result carries the NaN x86
// gives) and __fdiv_rn.
//
// Written to be obviously right first, not fast. Where the speed would come from (none of it
// changes a byte or a sum):
// - byte loads and stores everywhere: the host knows each payload's alignment and could pick
//   word-wide variants for the aligned case (coo indices and fp32 values almost always are);
// - coo decode reads the indices twice (check, then scatter) and runs ~4 launches per peer: a
//   validation pass over all W payloads first, then one scatter kernel that loops over the
//   peers per entry range (peers still in order per element) would read them once;
// - the scan reads its items twice (see above), and coo_varint decode runs two scans;
// - bitmap decode gives a thread 32 elements and loops over set bits; a warp per 32-bit word
//   group with ballots would coalesce the value reads.
#pragma once

#include <cub/block/block_reduce.cuh>
#include <cub/block/block_scan.cuh>

#include <cstddef>
#include <cstdint>

#include "detail/bits.h"
#include "detail/value_bits.h"
#include "sparsecar/kernels/codecs.h"
#include "sparsecar/kernels/cuda_codecs.h"

namespace sparsecar::kernels::cuda::detail {

using kernels::detail::bits_float;
using kernels::detail::cpu_add;
using kernels::detail::cpu_mul;
using kernels::detail::float_bits;

inline constexpr int kCodecThreads = 256;
inline constexpr int kScanItems = 16;  // consecutive items per thread in a scan tile
inline constexpr size_t kScanTile = size_t{kCodecThreads} * kScanItems;
inline constexpr int kScanTilesThreads = 1024;

// ---- scratch ---------------------------------------------------------------------------------

// Zeroed before every encode.
struct EncodeScratch {
  unsigned int max_bits;    // int8: the largest |v|'s bits among the finite values
  unsigned int nonfinite;   // int8: 1 when a value is inf or NaN
  unsigned long long total; // varint: bytes of the varints (the scan's total)
};

// Zeroed before every payload.
struct DecodeScratch {
  unsigned long long first_bad;   // ~(the smallest bad key), 0 for none
  unsigned long long first_code;  // int8: ~(the first entry with code -128), 0 for none
  unsigned long long total;       // the scan's total: set bits (bitmap), terminators (varint)
  unsigned long long index_total; // coo_varint: the index sums' total (not read)
};

// ---- bytes -----------------------------------------------------------------------------------

__device__ __forceinline__ uint16_t get_u16(const uint8_t* p) {
  return static_cast<uint16_t>(p[0] | (unsigned{p[1]} << 8));
}
__device__ __forceinline__ uint32_t get_u32(const uint8_t* p) {
  return uint32_t{p[0]} | (uint32_t{p[1]} << 8) | (uint32_t{p[2]} << 16) | (uint32_t{p[3]} << 24);
}
__device__ __forceinline__ void put_u16(uint8_t* p, uint16_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
}
__device__ __forceinline__ void put_u32(uint8_t* p, uint32_t v) {
  p[0] = static_cast<uint8_t>(v);
  p[1] = static_cast<uint8_t>(v >> 8);
  p[2] = static_cast<uint8_t>(v >> 16);
  p[3] = static_cast<uint8_t>(v >> 24);
}

// ---- value blocks (WIRE.md "Value blocks"; the conversions: detail/value_bits.h) -------------

__host__ __device__ __forceinline__ unsigned long long value_block_bytes_of(ValueType vt, unsigned long long m) {
  switch (vt) {
    case ValueType::kF32: return 4 * m;
    case ValueType::kF16:
    case ValueType::kBf16: return 2 * m;
    case ValueType::kI8: return 4 + m;
  }
  return 0;
}

// The CPU's int8_scale from the reduction: NaN (std::numeric_limits<float>::quiet_NaN()'s bits)
// when a value is not finite, else max|v| / 127 in float.
__device__ __forceinline__ float int8_scale_of(const EncodeScratch* s) {
  if (s->nonfinite != 0) return bits_float(0x7fc00000u);
  return __fdiv_rn(bits_float(s->max_bits), 127.0f);
}

// Writes value j of the block at `block` (int8: the code only; the scale is written once).
__device__ __forceinline__ void put_value(ValueType vt, uint8_t* block, unsigned long long j, float v, float scale) {
  switch (vt) {
    case ValueType::kF32: put_u32(block + 4 * j, float_bits(v)); return;
    case ValueType::kF16: put_u16(block + 2 * j, kernels::detail::float_to_half_bits(v)); return;
    case ValueType::kBf16: put_u16(block + 2 * j, kernels::detail::float_to_bf16_bits(v)); return;
    case ValueType::kI8: block[4 + j] = static_cast<uint8_t>(kernels::detail::int8_code_of(v, scale)); return;
  }
}

// Value j of a block (int8: `scale` is the block's, read by the caller).
__device__ __forceinline__ float get_value(ValueType vt, const uint8_t* block, unsigned long long j, float scale) {
  switch (vt) {
    case ValueType::kF32: return bits_float(get_u32(block + 4 * j));
    case ValueType::kF16: return kernels::detail::half_bits_to_float(get_u16(block + 2 * j));
    case ValueType::kBf16: return kernels::detail::bf16_bits_to_float(get_u16(block + 2 * j));
    case ValueType::kI8: return cpu_mul(static_cast<float>(static_cast<int8_t>(block[4 + j])), scale);
  }
  return 0.0f;
}

__device__ __forceinline__ float block_scale(ValueType vt, const uint8_t* block) {
  return vt == ValueType::kI8 ? bits_float(get_u32(block)) : 0.0f;
}

// ---- varints ---------------------------------------------------------------------------------

__device__ __forceinline__ unsigned varint_len(uint32_t v) {
  const unsigned width = 32u - static_cast<unsigned>(__clz(v | 1u));
  return 1u + (width - 1u) / 7u;
}
__device__ __forceinline__ void varint_put(uint8_t* p, uint32_t v) {
  while (v >= 0x80u) {
    *p++ = static_cast<uint8_t>((v & 0x7fu) | 0x80u);
    v >>= 7;
  }
  *p = static_cast<uint8_t>(v);
}

// ---- the scan --------------------------------------------------------------------------------

// Len: __device__ unsigned long long operator()(size_t i) const. Thread t of tile b sums items
// b * kScanTile + t * kScanItems + 0 .. kScanItems - 1.
template <class Len>
__global__ void __launch_bounds__(kCodecThreads) scan_reduce_kernel(Len len, size_t n, unsigned long long* tile_sums) {
  using Reduce = cub::BlockReduce<unsigned long long, kCodecThreads>;
  __shared__ typename Reduce::TempStorage temp;
  const size_t base = blockIdx.x * kScanTile + size_t{threadIdx.x} * kScanItems;
  unsigned long long mine = 0;
#pragma unroll
  for (int q = 0; q < kScanItems; ++q) {
    if (base + q < n) mine += len(base + q);
  }
  const unsigned long long total = Reduce(temp).Sum(mine);
  if (threadIdx.x == 0) tile_sums[blockIdx.x] = total;
}

// One block: tile_sums become exclusive tile offsets; *total receives the sum of all items.
__global__ void __launch_bounds__(kScanTilesThreads) scan_tiles_kernel(unsigned long long* tile_sums, size_t tiles,
                                                                       unsigned long long* total) {
  using Scan = cub::BlockScan<unsigned long long, kScanTilesThreads>;
  __shared__ typename Scan::TempStorage temp;
  unsigned long long running = 0;
  for (size_t chunk = 0; chunk < tiles; chunk += kScanTilesThreads) {
    const size_t t = chunk + threadIdx.x;
    const unsigned long long c = t < tiles ? tile_sums[t] : 0;
    unsigned long long excl = 0;
    unsigned long long chunk_total = 0;
    Scan(temp).ExclusiveSum(c, excl, chunk_total);
    if (t < tiles) tile_sums[t] = running + excl;
    running += chunk_total;
    __syncthreads();  // temp is reused by the next chunk
  }
  if (threadIdx.x == 0) *total = running;
}

// Sink: __device__ void operator()(size_t i, unsigned long long offset, unsigned long long len)
// const, called for every item i < n with its exclusive offset. A thread loads all its items'
// lengths before it calls the sink, so a sink may overwrite what len(i) read of item i (and of
// no other item).
template <class Len, class Sink>
__global__ void __launch_bounds__(kCodecThreads) scan_apply_kernel(Len len, Sink sink, size_t n,
                                                                   const unsigned long long* tile_offsets) {
  using Scan = cub::BlockScan<unsigned long long, kCodecThreads>;
  __shared__ typename Scan::TempStorage temp;
  const size_t base = blockIdx.x * kScanTile + size_t{threadIdx.x} * kScanItems;
  unsigned long long lens[kScanItems];
  unsigned long long mine = 0;
#pragma unroll
  for (int q = 0; q < kScanItems; ++q) {
    lens[q] = base + q < n ? len(base + q) : 0;
    mine += lens[q];
  }
  unsigned long long offset = 0;
  Scan(temp).ExclusiveSum(mine, offset);
  offset += tile_offsets[blockIdx.x];
#pragma unroll
  for (int q = 0; q < kScanItems; ++q) {
    if (base + q < n) sink(base + q, offset, lens[q]);
    offset += lens[q];
  }
}

// ---- encoders --------------------------------------------------------------------------------

// What every encode kernel reads. limit = min(capacity, dense_len): the entries encoded are
// min(*count, limit), so even a selection that breaks its contract stays inside the bound.
struct EncodeArgs {
  const uint32_t* index;
  const float* value;
  const unsigned long long* count;
  unsigned long long limit;
  ValueType vt;
  unsigned long long dense_len;
  unsigned long long bitmap_bytes;  // bitmap only
  uint8_t* out;
  EncodeScratch* scratch;
  __device__ unsigned long long entries() const {
    const unsigned long long c = *count;
    return c < limit ? c : limit;
  }
  __device__ float scale() const { return vt == ValueType::kI8 ? int8_scale_of(scratch) : 0.0f; }
  // index[j] - (index[j-1] + 1), the gap coo_varint writes (index[-1] + 1 is 0).
  __device__ uint32_t gap(unsigned long long j) const { return index[j] - (j == 0 ? 0u : index[j - 1] + 1u); }
};

// int8: the largest finite |v| (as bits: non-negative floats order as their bits) and whether
// any value is not finite.
__global__ void __launch_bounds__(kCodecThreads) int8_max_kernel(EncodeArgs a) {
  const unsigned long long n = a.entries();
  unsigned max_bits = 0;
  unsigned nonfinite = 0;
  for (size_t j = blockIdx.x * size_t{blockDim.x} + threadIdx.x; j < n; j += size_t{gridDim.x} * blockDim.x) {
    const uint32_t bits = float_bits(a.value[j]) & 0x7fffffffu;
    if (bits >= 0x7f800000u) {
      nonfinite = 1;
    } else if (bits > max_bits) {
      max_bits = bits;
    }
  }
  max_bits = __reduce_max_sync(0xffffffffu, max_bits);
  nonfinite = __reduce_or_sync(0xffffffffu, nonfinite);
  if ((threadIdx.x & 31u) == 0) {
    if (max_bits != 0) atomicMax(&a.scratch->max_bits, max_bits);
    if (nonfinite != 0) atomicOr(&a.scratch->nonfinite, 1u);
  }
}

// coo: index[j] at 4j, value j in the block at 4n.
__global__ void __launch_bounds__(kCodecThreads) coo_encode_kernel(EncodeArgs a) {
  const unsigned long long n = a.entries();
  const float scale = a.scale();
  uint8_t* block = a.out + 4 * n;
  for (size_t j = blockIdx.x * size_t{blockDim.x} + threadIdx.x; j < n; j += size_t{gridDim.x} * blockDim.x) {
    put_u32(a.out + 4 * j, a.index[j]);
    put_value(a.vt, block, j, a.value[j], scale);
  }
}

// bitmap: the entry that opens a bitmap byte (the first whose index falls in it) writes the
// whole byte (at most 8 entries share one); bytes without entries keep the zeros queued before.
// Plain byte stores: no atomics, no read-modify-write of bytes another thread owns.
__global__ void __launch_bounds__(kCodecThreads) bitmap_encode_kernel(EncodeArgs a) {
  const unsigned long long n = a.entries();
  const float scale = a.scale();
  uint8_t* block = a.out + a.bitmap_bytes;
  for (size_t j = blockIdx.x * size_t{blockDim.x} + threadIdx.x; j < n; j += size_t{gridDim.x} * blockDim.x) {
    const uint32_t i = a.index[j];
    if (j == 0 || (a.index[j - 1] >> 3) != (i >> 3)) {
      unsigned byte = 0;
      for (unsigned long long t = j; t < n && t < j + 8; ++t) {
        const uint32_t it = a.index[t];
        if ((it >> 3) != (i >> 3)) break;
        byte |= 1u << (it & 7u);
      }
      if (i < a.dense_len) a.out[i >> 3] = static_cast<uint8_t>(byte);
    }
    put_value(a.vt, block, j, a.value[j], scale);
  }
}

// coo_varint: the bytes of entry j's varint (0 past the entries).
struct VarintLenOp {
  EncodeArgs a;
  __device__ unsigned long long operator()(size_t j) const { return j < a.entries() ? varint_len(a.gap(j)) : 0; }
};
// coo_varint: value j at the front, varint j at the block's end + its offset.
struct VarintPutOp {
  EncodeArgs a;
  __device__ void operator()(size_t j, unsigned long long offset, unsigned long long) const {
    const unsigned long long n = a.entries();
    if (j >= n) return;
    varint_put(a.out + value_block_bytes_of(a.vt, n) + offset, a.gap(j));
    put_value(a.vt, a.out, j, a.value[j], a.scale());
  }
};

// One thread: the int8 scale into the block, the payload size and the entry count.
__global__ void encode_finish_kernel(EncodeArgs a, Format format, unsigned long long* bytes, unsigned long long* nnz) {
  const unsigned long long n = a.entries();
  const unsigned long long values = value_block_bytes_of(a.vt, n);
  unsigned long long block = 0;
  unsigned long long total = 0;
  switch (format) {
    case Format::kCoo:
      block = 4 * n;
      total = 4 * n + values;
      break;
    case Format::kCooVarint:
      block = 0;
      total = values + a.scratch->total;
      break;
    case Format::kBitmap:
      block = a.bitmap_bytes;
      total = a.bitmap_bytes + values;
      break;
    case Format::kDense:
    case Format::kCsr:
    case Format::kRle:
      return;  // no device encoder; the host never launches these
  }
  if (a.vt == ValueType::kI8) put_u32(a.out + block, float_bits(int8_scale_of(a.scratch)));
  *bytes = total;
  if (nnz != nullptr) *nnz = n;
}

// ---- decoders --------------------------------------------------------------------------------

// One payload, after the host's checks (sizes exact or in range, nnz <= dense_len).
struct PayloadArgs {
  const uint8_t* data;
  unsigned long long bytes;
  unsigned long long n;  // nnz
  unsigned long long dense_len;
  ValueType vt;
  const uint8_t* values;       // the value block
  const uint8_t* region_at;    // coo_varint: the varints; bitmap: the bitmap
  unsigned long long region;   // their bytes
  DecodeScratch* scratch;
  DecodeStatus* status;
  float* dense;
  __device__ bool rejected() const { return status->error != 0; }
};

__device__ __forceinline__ void flag_first(unsigned long long* slot, unsigned long long key) { atomicMax(slot, ~key); }

// int8: the first code -128 (check_values' scan; the scale is checked by the finish kernel).
__global__ void __launch_bounds__(kCodecThreads) int8_codes_kernel(PayloadArgs a) {
  for (size_t j = blockIdx.x * size_t{blockDim.x} + threadIdx.x; j < a.n; j += size_t{gridDim.x} * blockDim.x) {
    if (a.values[4 + j] == 0x80u) flag_first(&a.scratch->first_code, j);
  }
}

// check_values' verdict (after every other check of the format passed).
__device__ __forceinline__ void value_verdict(const PayloadArgs& a, DecodeStatus* st) {
  if (a.vt != ValueType::kI8) return;
  const uint32_t scale = get_u32(a.values);
  if ((scale >> 31) != 0 || (scale & 0x7fffffffu) == 0x7f800000u) {
    st->error = static_cast<uint32_t>(DecodeError::kInt8Scale);
    st->value = scale;
  } else if (a.scratch->first_code != 0) {
    st->error = static_cast<uint32_t>(DecodeError::kInt8Code);
    st->entry = ~a.scratch->first_code;
  }
}

__device__ __forceinline__ void write_status(DecodeStatus* out, const DecodeStatus& st) {
  out->error = st.error;
  out->reserved = 0;
  out->entry = st.entry;
  out->value = st.value;
  out->other = st.other;
}

__global__ void set_status_kernel(DecodeStatus* status, uint32_t error) {
  DecodeStatus st;
  st.error = error;
  write_status(status, st);
}

// coo: index[j] strictly above index[j-1] and < dense_len (first_bad_index's test).
__global__ void __launch_bounds__(kCodecThreads) coo_check_kernel(PayloadArgs a) {
  for (size_t j = blockIdx.x * size_t{blockDim.x} + threadIdx.x; j < a.n; j += size_t{gridDim.x} * blockDim.x) {
    const uint32_t at = get_u32(a.data + 4 * j);
    if (at >= a.dense_len || (j > 0 && at <= get_u32(a.data + 4 * (j - 1)))) flag_first(&a.scratch->first_bad, j);
  }
}

__global__ void coo_finish_kernel(PayloadArgs a) {
  DecodeStatus st;
  if (a.scratch->first_bad != 0) {
    const unsigned long long j = ~a.scratch->first_bad;
    const uint32_t at = get_u32(a.data + 4 * j);
    st.entry = j;
    st.value = at;
    if (at >= a.dense_len) {
      st.error = static_cast<uint32_t>(DecodeError::kIndexRange);
    } else {
      st.error = static_cast<uint32_t>(DecodeError::kIndexOrder);
      st.other = get_u32(a.data + 4 * (j - 1));
    }
  } else {
    value_verdict(a, &st);
  }
  write_status(a.status, st);
}

// One thread per entry: the indices are distinct (checked), so no two threads of one payload
// touch one element. The scatter is one 4-byte read-modify-write per entry, bound by the touched
// lines.
__global__ void __launch_bounds__(kCodecThreads) coo_scatter_kernel(PayloadArgs a) {
  if (a.rejected()) return;
  const float scale = block_scale(a.vt, a.values);
  for (size_t j = blockIdx.x * size_t{blockDim.x} + threadIdx.x; j < a.n; j += size_t{gridDim.x} * blockDim.x) {
    const uint32_t at = get_u32(a.data + 4 * j);
    a.dense[at] = cpu_add(a.dense[at], get_value(a.vt, a.values, j, scale));
  }
}

// ---- several coo payloads in one pass (decode_accumulate's fused path) --------------------------
// The dense buffer in chunks of kScatterChunk elements; for each peer, start[c] is its first
// entry with an index in chunk c or later (start[chunks] = n), so chunk c's entries are
// [start[c], start[c + 1]). One block a chunk adds every peer's entries there, peer after peer
// (a barrier between peers; within one peer the indices are distinct), so each element gets the
// same float additions in the same order as peer-by-peer scatters, while a touched line is
// fetched once for all peers instead of once per peer.
inline constexpr size_t kScatterChunk = 16384;
inline constexpr int kFusedPeers = 16;  // peers per launch (kernel parameters)

// start[] of one payload, one thread per entry: entry e sets start[c] = e for the chunks from
// the one after entry e-1's (0 for e = 0) to its own; the last entry fills the rest with n.
// Clamped to [0, chunks]: a payload the check rejects writes nothing outside its row (and the
// scatter skips it).
__global__ void __launch_bounds__(kCodecThreads) coo_chunks_kernel(PayloadArgs a, uint32_t* start, size_t chunks) {
  for (size_t e = blockIdx.x * size_t{blockDim.x} + threadIdx.x; e < a.n; e += size_t{gridDim.x} * blockDim.x) {
    const size_t own = std::min<size_t>(get_u32(a.data + 4 * e) / kScatterChunk, chunks);
    const size_t first = e == 0 ? 0 : std::min<size_t>(get_u32(a.data + 4 * (e - 1)) / kScatterChunk + 1, chunks + 1);
    for (size_t c = first; c <= own; ++c) start[c] = static_cast<uint32_t>(e);
    if (e + 1 == a.n) {
      for (size_t c = own + 1; c <= chunks; ++c) start[c] = static_cast<uint32_t>(a.n);
    }
  }
}

struct ScatterPeer {
  const uint8_t* index;    // the coo index block
  const uint8_t* values;   // the value block
  const uint32_t* start;   // chunks + 1 entries
  const DecodeStatus* status;
  unsigned long long n;    // 0: nothing to add (empty, or the header failed)
  ValueType vt;
};
struct ScatterPeers {
  ScatterPeer peer[kFusedPeers];
  int count;
};

__global__ void __launch_bounds__(kCodecThreads) coo_fused_scatter_kernel(ScatterPeers peers, float* dense,
                                                                          size_t chunks) {
  for (size_t c = blockIdx.x; c < chunks; c += gridDim.x) {
    for (int j = 0; j < peers.count; ++j) {
      const ScatterPeer& p = peers.peer[j];
      if (p.n == 0 || p.status->error != 0) continue;  // block-uniform
      const float scale = block_scale(p.vt, p.values);
      const uint32_t hi = p.start[c + 1];
      for (uint32_t e = p.start[c] + threadIdx.x; e < hi; e += blockDim.x) {
        const uint32_t at = get_u32(p.index + 4 * size_t{e});
        dense[at] = cpu_add(dense[at], get_value(p.vt, p.values, e, scale));
      }
      __syncthreads();  // this peer's additions land before the next peer's
    }
  }
}

// bitmap: word w is bitmap bytes 4w .. 4w+3 (zeros past the bitmap); its popcount is the scan
// item, so a word's first value is its exclusive offset.
__device__ __forceinline__ uint32_t bitmap_word(const PayloadArgs& a, size_t w) {
  uint32_t v = 0;
#pragma unroll
  for (int q = 0; q < 4; ++q) {
    const size_t b = 4 * w + q;
    if (b < a.region) v |= uint32_t{a.region_at[b]} << (8 * q);
  }
  return v;
}
struct BitmapCountOp {
  PayloadArgs a;
  __device__ unsigned long long operator()(size_t w) const {
    return static_cast<unsigned long long>(__popc(bitmap_word(a, w)));
  }
};
struct BitmapScatterOp {
  PayloadArgs a;
  __device__ void operator()(size_t w, unsigned long long rank, unsigned long long) const {
    if (a.rejected()) return;
    const float scale = block_scale(a.vt, a.values);
    uint32_t bits = bitmap_word(a, w);
    while (bits != 0) {
      const size_t at = 32 * w + static_cast<size_t>(__ffs(bits) - 1);
      a.dense[at] = cpu_add(a.dense[at], get_value(a.vt, a.values, rank++, scale));
      bits &= bits - 1u;
    }
  }
};

// bitmap_decode's order: bits past dense_len, then the count, then the values.
__global__ void bitmap_finish_kernel(PayloadArgs a) {
  DecodeStatus st;
  const unsigned tail = static_cast<unsigned>(a.dense_len % 8);
  if (tail != 0 && (a.region_at[a.region - 1] >> tail) != 0) {
    st.error = static_cast<uint32_t>(DecodeError::kBitmapTail);
  } else if (a.scratch->total != a.n) {
    st.error = static_cast<uint32_t>(DecodeError::kBitmapCount);
    st.value = a.scratch->total;
  } else {
    value_verdict(a, &st);
  }
  write_status(a.status, st);
}

// coo_varint, step 1: the varints' terminators (bytes without the continuation bit); the j-th
// terminator (j < nnz) ends entry j's varint: term_pos[j] = its byte in the region.
struct VarintTermOp {
  PayloadArgs a;
  __device__ unsigned long long operator()(size_t p) const { return (a.region_at[p] & 0x80u) == 0 ? 1 : 0; }
};
struct VarintTermPosOp {
  PayloadArgs a;
  uint32_t* term_pos;
  __device__ void operator()(size_t p, unsigned long long rank, unsigned long long is_term) const {
    if (is_term != 0 && rank < a.n) term_pos[rank] = static_cast<uint32_t>(p);
  }
};

// coo_varint, step 2 (one thread per entry j < nnz): entry j's varint runs from the byte after
// terminator j-1 to terminator j. varint_get rejects it when it is longer than 5 bytes, its
// fifth byte is above 0x0f, or it ends in a redundant zero byte; an entry without a terminator
// (j == the terminator count) is truncated. All three are one message; the key is 2j. gap1[j]
// receives gap + 1 (0 for a bad entry).
__global__ void __launch_bounds__(kCodecThreads) varint_parse_kernel(PayloadArgs a, const uint32_t* term_pos,
                                                                     unsigned long long* gap1) {
  const uint8_t* region = a.region_at;
  const unsigned long long terms = a.scratch->total;
  for (size_t j = blockIdx.x * size_t{blockDim.x} + threadIdx.x; j < a.n; j += size_t{gridDim.x} * blockDim.x) {
    if (j >= terms) {
      gap1[j] = 0;
      if (j == terms) flag_first(&a.scratch->first_bad, 2 * j);
      continue;
    }
    const size_t s = j == 0 ? 0 : size_t{term_pos[j - 1]} + 1;
    const size_t t = term_pos[j];
    const size_t len = t - s + 1;
    const uint8_t last = region[t];
    if (len > 5 || (len == 5 && last > 0x0fu) || (len > 1 && last == 0)) {
      gap1[j] = 0;
      flag_first(&a.scratch->first_bad, 2 * j);
      continue;
    }
    uint32_t gap = 0;
    for (size_t q = 0; q < len; ++q) gap |= uint32_t{region[s + q] & 0x7fu} << (7 * q);
    gap1[j] = static_cast<unsigned long long>(gap) + 1;
  }
}

// coo_varint, step 3: index[j] = (gap[0] + 1) + ... + (gap[j] + 1) - 1, written over gap1[j];
// the first index >= dense_len gets key 2j + 1 (after entry j's own varint, as the CPU checks
// them). A bad entry's (gap1 == 0) and the later ones' indices are meaningless: a smaller key
// already names the payload's first error then.
struct VarintGapOp {
  const unsigned long long* gap1;
  __device__ unsigned long long operator()(size_t j) const { return gap1[j]; }
};
struct VarintIndexOp {
  PayloadArgs a;
  unsigned long long* gap1;
  __device__ void operator()(size_t j, unsigned long long offset, unsigned long long len) const {
    if (len == 0) return;
    const unsigned long long at = offset + len - 1;
    gap1[j] = at;
    if (at >= a.dense_len) flag_first(&a.scratch->first_bad, 2 * j + 1);
  }
};

__global__ void varint_finish_kernel(PayloadArgs a, const uint32_t* term_pos, const unsigned long long* index) {
  DecodeStatus st;
  if (a.scratch->first_bad != 0) {
    const unsigned long long key = ~a.scratch->first_bad;
    const unsigned long long j = key >> 1;
    st.entry = j;
    if ((key & 1) == 0) {
      st.error = static_cast<uint32_t>(DecodeError::kVarint);
      st.value = static_cast<unsigned long long>(a.region_at - a.data) +
                 (j == 0 ? 0 : static_cast<unsigned long long>(term_pos[j - 1]) + 1);
    } else {
      st.error = static_cast<uint32_t>(DecodeError::kIndexRange);
      st.value = index[j];
    }
  } else {
    // Every entry has its terminator; what follows the last one is left over.
    const unsigned long long used = a.n == 0 ? 0 : static_cast<unsigned long long>(term_pos[a.n - 1]) + 1;
    if (used != a.region) {
      st.error = static_cast<uint32_t>(DecodeError::kTrailing);
      st.value = a.region - used;
    } else {
      value_verdict(a, &st);
    }
  }
  write_status(a.status, st);
}

__global__ void __launch_bounds__(kCodecThreads) varint_scatter_kernel(PayloadArgs a, const unsigned long long* index) {
  if (a.rejected()) return;
  const float scale = block_scale(a.vt, a.values);
  for (size_t j = blockIdx.x * size_t{blockDim.x} + threadIdx.x; j < a.n; j += size_t{gridDim.x} * blockDim.x) {
    const size_t at = index[j];
    a.dense[at] = cpu_add(a.dense[at], get_value(a.vt, a.values, j, scale));
  }
}

// The average: x *= factor, as kernels::scale.
__global__ void __launch_bounds__(kCodecThreads) scale_kernel(float* x, size_t n, float factor) {
  for (size_t i = blockIdx.x * size_t{blockDim.x} + threadIdx.x; i < n; i += size_t{gridDim.x} * blockDim.x) {
    x[i] = cpu_mul(x[i], factor);
  }
}

}  // namespace sparsecar::kernels::cuda::detail
