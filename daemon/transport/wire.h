// The daemon-to-daemon message header (wire format v2). Spec: daemon/transport/WIRE.md.
//
// Every message between daemons is one WireHeader (80 bytes, little-endian, no padding) followed
// by `payload_bytes` of payload. The receiver validates every field with validate_header()
// before it touches the payload, and the checksum (CRC-32C over the header with the checksum
// field zeroed, then the payload) with verify_checksum(). This layout is frozen: new versions
// get a new `version`, never a reinterpretation.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>

#include "sparsecar/common/status.h"
#include "sparsecar/kernels/types.h"

namespace sparsecar::wire {

inline constexpr uint32_t kMagic = 0x52435053;  // "SPCR" read as little-endian bytes
inline constexpr uint16_t kVersion = 2;
inline constexpr size_t kHeaderBytes = 80;
// Hard cap on one message's payload (1 GiB); anything larger is rejected unread.
inline constexpr uint64_t kMaxPayloadBytes = uint64_t{1} << 30;
// Hard cap on a tensor's element count on the wire (2^32 - 1: COO indices are uint32).
inline constexpr uint64_t kMaxDenseLen = 0xFFFFFFFFull;

enum class Kind : uint16_t {
  kData = 1,         // a tensor payload for (tensor, step); `chunk` = collective phase
  kAbort = 2,        // sender failed (tensor, step); payload = UTF-8 reason
  kManifest = 3,     // job start: sender's tensors + knobs, sent to rank 0; payload = text
  kManifestAck = 4,  // rank 0's verdict on the manifests; payload = text
  kDecision = 5,     // rank 0 -> all: decision epoch `epoch` in force from step `step`; payload =
                     // "knob=value" lines changed relative to epoch - 1
  kKnobRequest = 6,  // any rank -> rank 0: please change live knobs; `step` = request id;
                     // payload = "knob=value" lines
  kKnobReply = 7,    // rank 0 -> requester: `step` = request id; payload = "ok <epoch> <step>" or
                     // "error <message>"
  kObservation = 8,  // any rank -> rank 0: measurements for the controllers; payload = text
  kProbe = 9,        // any rank -> its ring successor: the link probe, timed by the receiver and
                     // dropped; payload = zeros, at most kMaxProbePayloadBytes
};
inline constexpr uint16_t kMaxKind = 9;
// A probe's payload is what the ring sends a successor in a step for the largest tensor, capped
// (policies/link_model.h).
inline constexpr uint64_t kMaxProbePayloadBytes = uint64_t{4} << 20;

struct WireHeader {
  uint32_t magic;          //  0
  uint16_t version;        //  4
  uint16_t kind;           //  6  Kind
  uint64_t job_id;         //  8
  uint32_t sender_rank;    // 16
  uint32_t tensor_id;      // 20
  uint64_t step;           // 24
  uint32_t epoch;          // 32  decision epoch the payload was produced under
  uint16_t format;         // 36  kernels::Format
  uint16_t value_type;     // 38  kernels::ValueType
  uint64_t dense_len;      // 40  elements of the whole tensor (or of the chunk, for ring phases)
  uint64_t nnz;            // 48  entries in the payload
  uint64_t payload_bytes;  // 56
  uint32_t chunk;          // 64  collective phase / chunk index; 0 for all-gather
  uint32_t checksum;       // 68  CRC-32C, see above
  uint64_t incarnation;    // 72  the job formation this message belongs to (0: none yet)
};
static_assert(sizeof(WireHeader) == kHeaderBytes, "wire header must be 80 bytes");

// Serialises `h` (checksum field as given) to exactly kHeaderBytes little-endian bytes.
void encode_header(const WireHeader& h, std::span<std::byte, kHeaderBytes> out);
// Parses kHeaderBytes bytes; no validation.
WireHeader decode_header(std::span<const std::byte, kHeaderBytes> in);

// Fills in the checksum of (header, payload) and serialises the header into `out`.
void seal(WireHeader& h, std::span<const std::byte> payload, std::span<std::byte, kHeaderBytes> out);

// What the receiver expects; fields that are 0/"any" are not checked.
struct Expectations {
  uint64_t job_id = 0;
  uint32_t world_size = 0;       // sender_rank must be < world_size
  uint32_t sender_rank = ~0u;    // if not ~0u: must equal (the transport knows who sent it)
};

// Checks magic, version, kind, sender rank, format/value type known, nnz <= dense_len,
// dense_len <= kMaxDenseLen, payload_bytes <= kMaxPayloadBytes and == the size the format implies
// for (dense_len, nnz) on data messages, and payload_bytes == actual_payload_bytes.
// Returns kDataLoss naming the first bad field.
Status validate_header(const WireHeader& h, const Expectations& expect, size_t actual_payload_bytes);

// Recomputes the CRC-32C over the header bytes (checksum zeroed) and payload; kDataLoss on mismatch.
Status verify_checksum(std::span<const std::byte, kHeaderBytes> header_bytes,
                       std::span<const std::byte> payload);

}  // namespace sparsecar::wire
