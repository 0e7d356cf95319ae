// Codecs on an NVIDIA GPU: the CUDA backend of the codec registry's coo, coo_varint and bitmap
// rows (codecs.h), for every value type.
//
// Like cuda.h, this header compiles without nvcc and without the CUDA headers; the functions are
// built from kernels/src/cuda/codecs.cu when CMake finds nvcc, and otherwise answer kUnavailable
// (kernels/src/cuda_unavailable.cc). The contract is cuda.h's: buffers are device memory the
// caller owns, nothing is allocated inside, the host never waits (work is queued on `stream`,
// results land in device memory), the arguments are validated on the host before anything is
// queued and an error queues nothing; a workspace sized by its query belongs to one call at a
// time (calls queued on one stream may share it).
//
// Encoding: the selection a cuda.h selector wrote (DeviceSelection: pairs in increasing index
// order, the match count in device memory) becomes the payload the CPU encoder
// (kernels::encode) writes for the same pairs, byte for byte: the same layouts (WIRE.md
// "Payload layouts") and the same value conversions (detail/value_bits.h: round to nearest even,
// saturation, NaN/inf kept; int8's scale max|x| / 127 in float, NaN when a value is not
// finite). The payload's size and entry count are written to device memory, for the wire
// header. The selection is trusted (the selectors write it): one that is not strictly increasing
// or < dense_len gives unspecified bytes, but never a write outside the payload buffer.
//
// Decoding: W peers' payloads, each with the format, value type, nnz and payload_bytes of its
// wire header, are validated as the CPU decoders validate them (decode_accumulate in codec.h:
// sizes, every index strictly increasing and < dense_len, varints minimal and within 32 bits,
// no bytes after the last varint, bitmap bits past dense_len clear and popcount == nnz, int8
// scale not negative or infinite and no code -128) and added into one dense buffer, peer after
// peer in the given order, one float addition per entry (the CPU's order, so the sums equal
// the CPU's bit for bit, a NaN carrying the payload x86 gives it — except where two NaN
// operands meet at one element: x86 returns one of them and the compiler picks which). A
// payload that fails adds nothing; its DecodeStatus in device memory says why, and
// decode_status() turns that into the CPU decoder's kDataLoss message once the caller has
// synchronised.
//
// The codec registry's cuda_encode/cuda_decode slots stay null: their signatures return the
// size to the host (a host synchronisation) and the CPU library must not link CUDA. A caller
// picks the device path with has_device_codec(format).
//
// Thread-safety: the functions are reentrant; a workspace, a status array and the buffers belong
// to one call at a time.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "sparsecar/common/status.h"
#include "sparsecar/kernels/codec.h"
#include "sparsecar/kernels/codecs.h"
#include "sparsecar/kernels/cuda.h"

namespace sparsecar::kernels::cuda {

// True for the formats this backend encodes and decodes (coo, coo_varint, bitmap); the others
// (dense, csr, rle) stay on the CPU. False for every format when built without CUDA.
bool has_device_codec(Format format);

// ---- encoding ------------------------------------------------------------------------------------

// Payload bytes that hold any encoding of up to `capacity` pairs of a dense_len tensor as
// (format, value_type): payload_size_range(...).max at nnz = min(capacity, dense_len). Size the
// payload buffer by it once, when the tensor is registered. 0 for a format without a device
// codec or an unknown value type.
size_t encode_bound_bytes(Format format, ValueType value_type, size_t dense_len, size_t capacity);

// Workspace bytes encode() needs for selections of up to `capacity` pairs.
size_t encode_workspace_bytes(Format format, ValueType value_type, size_t capacity);

// Where an encoding goes.
struct DevicePayloadOut {
  std::byte* data = nullptr;  // device, capacity_bytes >= encode_bound_bytes(...)
  size_t capacity_bytes = 0;
  uint64_t* bytes = nullptr;  // device: receives the payload size (the header's payload_bytes)
  uint64_t* nnz = nullptr;    // device, may be null: receives the entries encoded (the header's nnz)
};

// Encodes the first min(*sel.count, sel.capacity) pairs of `sel` (what the selector wrote) as
// params.format / params.value_type for a tensor of dense_len elements (<= 2^32 - 1). CPU:
// kernels::encode(params, dense_len, index[0..n), value[0..n), out) gives the same bytes.
// Errors (kInvalidArgument, nothing queued): a format without a device codec, an unknown value
// type, dense_len too large, null buffers, an output or workspace below its query.
Status encode(const EncodeParams& params, size_t dense_len, const DeviceSelection& sel,
              const DevicePayloadOut& out, Workspace ws, Stream stream);

// ---- decoding ------------------------------------------------------------------------------------

// One received payload: device bytes and what its wire header says about them (hostile).
struct DevicePayload {
  Format format = Format::kCoo;
  ValueType value_type = ValueType::kF32;
  const std::byte* data = nullptr;  // device; may be null when bytes == 0
  uint64_t bytes = 0;               // payload_bytes
  uint64_t nnz = 0;
};

// Why a payload was rejected (DecodeStatus::error). Read it through decode_status().
enum class DecodeError : uint32_t {
  kNone = 0,
  kHeader = 1,       // the host's checks: format or value type unknown, nnz > dense_len, a size
                     // the payload cannot have (decode_status() recomputes the message)
  kIndexRange = 2,   // index[entry] = value >= dense_len
  kIndexOrder = 3,   // index[entry] = value <= index[entry - 1] = other
  kVarint = 4,       // the varint of index[entry], starting at payload byte `value`, is
                     // truncated, overlong or over 32 bits
  kTrailing = 5,     // `value` bytes after the nnz varints
  kBitmapTail = 6,   // bits past dense_len are set
  kBitmapCount = 7,  // `value` bits set, not nnz
  kInt8Scale = 8,    // the int8 scale (float bits in `value`) is negative or infinite
  kInt8Code = 9,     // int8 value[entry] is -128
};

// One per payload, in device memory; decode_accumulate writes it (kNone for a payload added).
struct DecodeStatus {
  uint32_t error = 0;  // a DecodeError
  uint32_t reserved = 0;
  uint64_t entry = 0;
  uint64_t value = 0;
  uint64_t other = 0;
};

// Workspace bytes decode_accumulate() needs for a tensor of dense_len elements and payloads of
// at most max_payload_bytes each (the receive limit the caller enforces; WIRE.md caps it at
// 2^30). With peers > 1, also room to add up to that many coo payloads in one pass over the
// dense buffer (chunk by chunk, every peer in order: a touched line is fetched once for all
// peers instead of once per peer; the sums are the same). See DecodePath.
size_t decode_workspace_bytes(size_t dense_len, size_t max_payload_bytes, size_t peers = 1);

// How decode_accumulate adds the payloads (the sums are equal bit for bit either way):
// kChunked adds all of them in one pass over the dense buffer when every payload is coo and the
// workspace has room for their count (decode_workspace_bytes' peers), else it is kPeerByPeer;
// kAuto picks kChunked where it was measured faster: the dense buffer is over twice the L2
// cache and the payloads' entries are at least 1/32 of its elements.
enum class DecodePath { kAuto, kPeerByPeer, kChunked };

// Validates each payload and adds the valid ones into dense[0..dense_len), in the order given
// (peer 0 first), dense[i] += value per entry; then, when average_over > 0, multiplies every
// element by the float 1.0f / average_over (the pipeline's 1/W: pass the trainer count; 0
// leaves the sum). status[j] (device, payloads.size() entries) receives payload j's verdict.
// CPU: decode_accumulate for each payload in order, then kernels::scale(dense, 1.0f / W).
// Errors (kInvalidArgument, nothing queued): dense_len > 2^32 - 1, null buffers, a known format
// without a device decoder, a payload above the workspace's max_payload_bytes or over
// 2^32 - 1 bytes, a workspace below its query. A hostile payload is not an error of the call:
// it is skipped and reported in its status.
Status decode_accumulate(std::span<const DevicePayload> payloads, float* dense, size_t dense_len,
                         uint32_t average_over, DecodeStatus* status, Workspace ws, Stream stream,
                         DecodePath path = DecodePath::kAuto);

// The verdict on one payload after the stream was synchronised and its DecodeStatus copied to
// the host: Ok, or the kDataLoss message the CPU decoder (codec.h's decode_accumulate) gives
// for the same payload ("coo payload: index[7]=12 is not greater than index[6]=12").
Status decode_status(const DevicePayload& payload, size_t dense_len, const DecodeStatus& status);

}  // namespace sparsecar::kernels::cuda
