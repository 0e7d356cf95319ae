#include "daemon/transport/wire.h"

#include <cstdio>
#include <string>

#include "sparsecar/kernels/codec.h"

namespace sparsecar::wire {
namespace {

// Explicit little-endian stores/loads: the struct's in-memory layout is never put on the wire.
template <typename T>
void store_le(std::byte* out, T value) {
  for (size_t i = 0; i < sizeof(T); ++i) {
    out[i] = static_cast<std::byte>((static_cast<uint64_t>(value) >> (8 * i)) & 0xFFu);
  }
}

template <typename T>
T load_le(const std::byte* in) {
  uint64_t value = 0;
  for (size_t i = 0; i < sizeof(T); ++i) {
    value |= static_cast<uint64_t>(std::to_integer<uint8_t>(in[i])) << (8 * i);
  }
  return static_cast<T>(value);
}

// Field offsets, as in WIRE.md (and the comments of WireHeader).
constexpr size_t kOffMagic = 0;
constexpr size_t kOffVersion = 4;
constexpr size_t kOffKind = 6;
constexpr size_t kOffJobId = 8;
constexpr size_t kOffSenderRank = 16;
constexpr size_t kOffTensorId = 20;
constexpr size_t kOffStep = 24;
constexpr size_t kOffEpoch = 32;
constexpr size_t kOffFormat = 36;
constexpr size_t kOffValueType = 38;
constexpr size_t kOffDenseLen = 40;
constexpr size_t kOffNnz = 48;
constexpr size_t kOffPayloadBytes = 56;
constexpr size_t kOffChunk = 64;
constexpr size_t kOffChecksum = 68;
constexpr size_t kOffIncarnation = 72;
static_assert(kOffIncarnation + 8 == kHeaderBytes);

bool known_kind(uint16_t kind) {
  return kind >= static_cast<uint16_t>(Kind::kData) && kind <= kMaxKind;
}
// Rows of the codec registry (kernels/codecs.h).
bool known_format(uint16_t format) { return kernels::find_codec(static_cast<kernels::Format>(format)) != nullptr; }
bool known_value_type(uint16_t value_type) {
  return kernels::find_value_type(static_cast<kernels::ValueType>(value_type)) != nullptr;
}

std::string hex32(uint32_t v) {
  char text[16];
  std::snprintf(text, sizeof text, "0x%08x", v);
  return text;
}

Status bad(const char* field, const std::string& detail) {
  return data_loss(std::string("bad wire header: ") + field + " " + detail);
}

uint32_t header_crc(std::span<const std::byte, kHeaderBytes> header_bytes) {
  // The checksum field itself is covered as four zero bytes.
  std::byte copy[kHeaderBytes];
  for (size_t i = 0; i < kHeaderBytes; ++i) copy[i] = header_bytes[i];
  store_le<uint32_t>(copy + kOffChecksum, 0);
  return kernels::crc32c(0, copy, kHeaderBytes);
}

}  // namespace

void encode_header(const WireHeader& h, std::span<std::byte, kHeaderBytes> out) {
  std::byte* p = out.data();
  store_le(p + kOffMagic, h.magic);
  store_le(p + kOffVersion, h.version);
  store_le(p + kOffKind, h.kind);
  store_le(p + kOffJobId, h.job_id);
  store_le(p + kOffSenderRank, h.sender_rank);
  store_le(p + kOffTensorId, h.tensor_id);
  store_le(p + kOffStep, h.step);
  store_le(p + kOffEpoch, h.epoch);
  store_le(p + kOffFormat, h.format);
  store_le(p + kOffValueType, h.value_type);
  store_le(p + kOffDenseLen, h.dense_len);
  store_le(p + kOffNnz, h.nnz);
  store_le(p + kOffPayloadBytes, h.payload_bytes);
  store_le(p + kOffChunk, h.chunk);
  store_le(p + kOffChecksum, h.checksum);
  store_le(p + kOffIncarnation, h.incarnation);
}

WireHeader decode_header(std::span<const std::byte, kHeaderBytes> in) {
  const std::byte* p = in.data();
  WireHeader h{};
  h.magic = load_le<uint32_t>(p + kOffMagic);
  h.version = load_le<uint16_t>(p + kOffVersion);
  h.kind = load_le<uint16_t>(p + kOffKind);
  h.job_id = load_le<uint64_t>(p + kOffJobId);
  h.sender_rank = load_le<uint32_t>(p + kOffSenderRank);
  h.tensor_id = load_le<uint32_t>(p + kOffTensorId);
  h.step = load_le<uint64_t>(p + kOffStep);
  h.epoch = load_le<uint32_t>(p + kOffEpoch);
  h.format = load_le<uint16_t>(p + kOffFormat);
  h.value_type = load_le<uint16_t>(p + kOffValueType);
  h.dense_len = load_le<uint64_t>(p + kOffDenseLen);
  h.nnz = load_le<uint64_t>(p + kOffNnz);
  h.payload_bytes = load_le<uint64_t>(p + kOffPayloadBytes);
  h.chunk = load_le<uint32_t>(p + kOffChunk);
  h.checksum = load_le<uint32_t>(p + kOffChecksum);
  h.incarnation = load_le<uint64_t>(p + kOffIncarnation);
  return h;
}

void seal(WireHeader& h, std::span<const std::byte> payload, std::span<std::byte, kHeaderBytes> out) {
  h.checksum = 0;
  encode_header(h, out);
  uint32_t crc = kernels::crc32c(0, out.data(), kHeaderBytes);
  crc = kernels::crc32c(crc, payload.data(), payload.size());
  h.checksum = crc;
  store_le(out.data() + kOffChecksum, crc);
}

Status validate_header(const WireHeader& h, const Expectations& expect, size_t actual_payload_bytes) {
  if (h.magic != kMagic) return bad("magic", "is " + hex32(h.magic) + ", expected " + hex32(kMagic));
  if (h.version != kVersion) {
    return bad("version", "is " + std::to_string(h.version) + ", this build speaks " + std::to_string(kVersion));
  }
  if (!known_kind(h.kind)) return bad("kind", std::to_string(h.kind) + " is unknown");
  if (expect.job_id != 0 && h.job_id != expect.job_id) {
    return bad("job_id", std::to_string(h.job_id) + " is not this job's");
  }
  if (expect.world_size != 0 && h.sender_rank >= expect.world_size) {
    return bad("sender_rank", std::to_string(h.sender_rank) + " >= world size " + std::to_string(expect.world_size));
  }
  if (expect.sender_rank != ~0u && h.sender_rank != expect.sender_rank) {
    return bad("sender_rank", std::to_string(h.sender_rank) + " but the message came from rank " +
                                  std::to_string(expect.sender_rank));
  }
  if (h.payload_bytes > kMaxPayloadBytes) {
    return bad("payload_bytes", std::to_string(h.payload_bytes) + " exceeds the limit of " +
                                    std::to_string(kMaxPayloadBytes));
  }
  if (h.kind == static_cast<uint16_t>(Kind::kProbe) && h.payload_bytes > kMaxProbePayloadBytes) {
    return bad("payload_bytes", std::to_string(h.payload_bytes) + " exceeds a probe's limit of " +
                                    std::to_string(kMaxProbePayloadBytes));
  }
  if (h.kind == static_cast<uint16_t>(Kind::kData)) {
    if (!known_format(h.format)) return bad("format", std::to_string(h.format) + " is unknown");
    if (!known_value_type(h.value_type)) return bad("value_type", std::to_string(h.value_type) + " is unknown");
    if (h.dense_len > kMaxDenseLen) {
      return bad("dense_len", std::to_string(h.dense_len) + " exceeds " + std::to_string(kMaxDenseLen));
    }
    if (h.nnz > h.dense_len) {
      return bad("nnz", std::to_string(h.nnz) + " > dense_len " + std::to_string(h.dense_len));
    }
    // Fixed-size formats (dense, coo, bitmap) imply one size; variable-size ones (coo_varint,
    // csr, rle) a range: the row's size_range. The decoder checks the exact size against the
    // payload's contents.
    // dense_len < 2^32 and nnz <= dense_len, so the sizes cannot overflow 64 bits.
    const kernels::SizeRange range = kernels::payload_size_range(
        static_cast<kernels::Format>(h.format), static_cast<kernels::ValueType>(h.value_type), h.dense_len, h.nnz);
    if (!range.contains(static_cast<size_t>(h.payload_bytes))) {
      const std::string implied = range.min > range.max   ? std::string("no valid size")
                                  : range.min == range.max ? std::to_string(range.min)
                                                           : std::to_string(range.min) + ".." + std::to_string(range.max);
      return bad("payload_bytes", std::to_string(h.payload_bytes) + " but format " +
                                      std::string(kernels::format_name(static_cast<kernels::Format>(h.format))) + "/" +
                                      std::string(kernels::value_type_name(static_cast<kernels::ValueType>(h.value_type))) +
                                      " with dense_len " + std::to_string(h.dense_len) + " and nnz " +
                                      std::to_string(h.nnz) + " implies " + implied);
    }
  }
  if (h.payload_bytes != actual_payload_bytes) {
    return bad("payload_bytes", std::to_string(h.payload_bytes) + " but " + std::to_string(actual_payload_bytes) +
                                    " bytes arrived");
  }
  return Status::Ok();
}

Status verify_checksum(std::span<const std::byte, kHeaderBytes> header_bytes, std::span<const std::byte> payload) {
  const uint32_t stored = load_le<uint32_t>(header_bytes.data() + kOffChecksum);
  uint32_t crc = header_crc(header_bytes);
  crc = kernels::crc32c(crc, payload.data(), payload.size());
  if (crc != stored) {
    return data_loss("wire checksum mismatch: header says " + hex32(stored) + ", computed " + hex32(crc) + " over " + std::to_string(kHeaderBytes + payload.size()) + " bytes");
  }
  return Status::Ok();
}

}  // namespace sparsecar::wire
