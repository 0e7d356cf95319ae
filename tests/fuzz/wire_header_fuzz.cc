// libFuzzer target: the daemon-to-daemon wire header (daemon/transport/wire.h, WIRE.md) and the
// mailbox's acceptance path (daemon/collective/mailbox.h), on what a peer (or anything that can
// reach the transport) sends.
//
// Input: byte 0 = mode bits, then the 80 header bytes, then the payload.
//   bit 0: re-seal (wire::seal) the header over the payload first, so mutations get past the CRC;
//   bits 1-2: how many copies (1..4) go to the mailbox, each at the next step (re-sealed);
//   bit 3: the mailbox agrees on the message's incarnation before delivery;
//   bits 4-5: after delivery: 0 nothing, 1 begin_job(), 2 set_incarnation(another), 3 both;
//   bits 6-7: the mailbox's per-peer byte limit (256 B, 4 KiB, 64 KiB, 4 GiB).
// Properties checked beyond "no crash, no sanitizer report":
//   - decode_header → encode_header gives back the 80 bytes;
//   - seal → verify_checksum accepts, and seal changes nothing but the checksum field;
//   - validate_header + verify_checksum accepting implies every field within WIRE.md's limits and,
//     for kData, payload_bytes within kernels::payload_size_range; every error is kDataLoss;
//   - an accepted kData payload (dense_len ≤ 2^16) decodes into a scratch tensor or fails with
//     kDataLoss, and a failed decode leaves the scratch untouched;
//   - the mailbox rejects exactly what validate_header (with its expectations) + verify_checksum
//     reject, or what would take a peer over its byte limit; buffered_bytes never exceeds the
//     limit; what it accepted is taken back bit for bit (payload and header) and its account
//     returns to 0; control kinds go to the control handler, never into take(); a link probe goes
//     to neither (counted and dropped);
//   - after begin_job() or set_incarnation(another), nothing of the old incarnation is takeable
//     (take says DEADLINE_EXCEEDED, not the message and not its abort), and the old message
//     arriving again while another incarnation is in force is counted stale and not takeable.
// Built by the clang fuzz project (tests/fuzz/CMakeLists.txt: fuzz_wire_header); seeds in
// corpus/wire_header/ (written by fuzz_make_parser_seeds with the real encoders).
#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <vector>

#include "daemon/collective/mailbox.h"
#include "daemon/transport/wire.h"
#include "sparsecar/common/log.h"
#include "sparsecar/kernels/codec.h"

namespace {

namespace wire = sparsecar::wire;
namespace kernels = sparsecar::kernels;
using sparsecar::Code;

#define CHECK(cond)                \
  do {                             \
    if (!(cond)) __builtin_trap(); \
  } while (0)

constexpr uint64_t kJobId = 0x0102030405060708ull;  // the seeds' job (make_parser_seeds.cc)
constexpr uint32_t kWorld = 4;
constexpr uint64_t kMaxFuzzDenseLen = uint64_t{1} << 16;  // scratch cap for the decode check
constexpr uint64_t kLimits[4] = {256, 4096, 65536, uint64_t{4} << 30};

using HeaderBytes = std::array<std::byte, wire::kHeaderBytes>;

HeaderBytes encode(const wire::WireHeader& h) {
  HeaderBytes out{};
  wire::encode_header(h, out);
  return out;
}

// What validate_header + verify_checksum promise about a message they both accepted.
void check_accepted(const wire::WireHeader& h, size_t payload_bytes) {
  CHECK(h.magic == wire::kMagic);
  CHECK(h.version == wire::kVersion);
  CHECK(h.kind >= 1 && h.kind <= wire::kMaxKind);
  CHECK(h.payload_bytes <= wire::kMaxPayloadBytes);
  CHECK(h.payload_bytes == payload_bytes);
  if (h.kind == static_cast<uint16_t>(wire::Kind::kProbe)) CHECK(payload_bytes <= wire::kMaxProbePayloadBytes);
  if (h.kind != static_cast<uint16_t>(wire::Kind::kData)) return;
  CHECK(h.format < static_cast<uint16_t>(kernels::kFormatCount));
  CHECK(h.value_type <= 3);
  CHECK(h.dense_len <= wire::kMaxDenseLen);
  CHECK(h.nnz <= h.dense_len);
  const auto range = kernels::payload_size_range(static_cast<kernels::Format>(h.format),
                                                 static_cast<kernels::ValueType>(h.value_type), h.dense_len, h.nnz);
  CHECK(range.contains(payload_bytes));
}

// An accepted data payload decodes, or fails with kDataLoss writing nothing.
void check_decode(const wire::WireHeader& h, std::span<const std::byte> payload) {
  if (h.kind != static_cast<uint16_t>(wire::Kind::kData) || h.dense_len > kMaxFuzzDenseLen) return;
  std::vector<float> scratch(h.dense_len);
  for (size_t i = 0; i < scratch.size(); ++i) scratch[i] = static_cast<float>(i % 7) - 3.0f;
  const std::vector<float> before = scratch;
  sparsecar::Status s = kernels::decode_accumulate(static_cast<kernels::Format>(h.format),
                                                   static_cast<kernels::ValueType>(h.value_type), payload, h.nnz,
                                                   scratch);
  if (s.ok()) return;
  CHECK(s.code() == Code::kDataLoss);
  CHECK(!s.message().empty());
  CHECK(std::memcmp(scratch.data(), before.data(), scratch.size() * sizeof(float)) == 0);
}

bool takeable_kind(uint16_t kind) {
  return kind == static_cast<uint16_t>(wire::Kind::kData) || kind == static_cast<uint16_t>(wire::Kind::kManifest) ||
         kind == static_cast<uint16_t>(wire::Kind::kManifestAck);
}

// Delivers `copies` versions of the message (step + i, re-sealed when the original verified) to a
// mailbox of kWorld peers and checks what it keeps and gives back.
void check_mailbox(uint8_t mode, const wire::WireHeader& first, std::span<const std::byte> payload) {
  const int copies = 1 + ((mode >> 1) & 3);
  const bool agree_first = (mode >> 3) & 1;
  const int reset = (mode >> 4) & 3;
  const uint64_t limit = kLimits[(mode >> 6) & 3];
  const uint32_t peer = first.sender_rank < kWorld ? first.sender_rank : 0;
  const uint64_t other_incarnation = first.incarnation ^ 0x5A5A5A5A5A5A5A5Bull;  // never equal, and non-zero
                                                                              // unless equal to that constant

  sparsecar::Mailbox box(kJobId, kWorld, nullptr, limit);
  int control_calls = 0;
  box.set_control_handler([&](uint32_t from, const wire::WireHeader& h, std::span<const std::byte> p) {
    CHECK(from == peer);
    CHECK(h.kind >= static_cast<uint16_t>(wire::Kind::kDecision));
    CHECK(p.size() == payload.size());
    ++control_calls;
  });
  if (agree_first && first.incarnation != 0) box.set_incarnation(first.incarnation);

  wire::Expectations expect;
  expect.job_id = kJobId;
  expect.world_size = kWorld;
  expect.sender_rank = peer;
  const bool first_sealed_ok = wire::verify_checksum(encode(first), payload).ok();

  struct Delivered {
    wire::WireHeader h;
    bool kept;  // stored for take()
  };
  std::vector<Delivered> delivered;
  uint64_t expect_buffered = 0;
  int expect_control = 0;
  for (int i = 0; i < copies; ++i) {
    wire::WireHeader h = first;
    h.step += static_cast<uint64_t>(i);
    HeaderBytes bytes = encode(h);
    if (i > 0 && first_sealed_ok) wire::seal(h, payload, bytes);
    const bool valid = wire::validate_header(h, expect, payload.size()).ok() && wire::verify_checksum(bytes, payload).ok();
    const uint64_t rejected_before = box.rejected();
    const uint64_t stale_before = box.stale();
    box.on_message(peer, bytes, payload);
    const bool rejected = box.rejected() != rejected_before;
    const bool stale = box.stale() != stale_before;
    CHECK(box.buffered_bytes(peer) <= limit);
    if (!valid) {
      CHECK(rejected && !stale);
      continue;
    }
    if (h.kind == static_cast<uint16_t>(wire::Kind::kProbe)) {  // counted and dropped: nothing kept
      CHECK(!rejected && !stale);
      continue;
    }
    if (h.kind >= static_cast<uint16_t>(wire::Kind::kDecision)) {
      CHECK(!rejected && !stale);
      ++expect_control;
      continue;
    }
    const bool job_scoped = h.kind == static_cast<uint16_t>(wire::Kind::kData) ||
                            h.kind == static_cast<uint16_t>(wire::Kind::kAbort);
    if (job_scoped && box.incarnation() != 0 && h.incarnation != box.incarnation()) {
      CHECK(stale && !rejected);
      continue;
    }
    if (h.kind == static_cast<uint16_t>(wire::Kind::kAbort)) {
      CHECK(!rejected && !stale);
      delivered.push_back({h, false});
      continue;
    }
    // Manifests are all step 0 in practice, but the key holds whatever step came: a copy at
    // another step is another message. Over the limit: rejected, nothing kept.
    if (expect_buffered + payload.size() > limit) {
      CHECK(rejected);
      continue;
    }
    CHECK(!rejected && !stale);
    expect_buffered += payload.size();
    delivered.push_back({h, true});
  }
  CHECK(control_calls == expect_control);
  CHECK(box.buffered_bytes(peer) == expect_buffered);

  const auto now = std::chrono::steady_clock::now();  // the mailbox's default clock
  auto take = [&](const wire::WireHeader& h) {
    const bool job_scoped = h.kind == static_cast<uint16_t>(wire::Kind::kData) ||
                            h.kind == static_cast<uint16_t>(wire::Kind::kAbort);
    const auto kind = h.kind == static_cast<uint16_t>(wire::Kind::kAbort) ? wire::Kind::kData
                                                                           : static_cast<wire::Kind>(h.kind);
    return box.take(kind, peer, h.tensor_id, h.step, h.chunk, job_scoped ? h.incarnation : 0, now, "fuzz peer");
  };

  if (reset != 0) {
    if (reset & 1) box.begin_job();
    if (reset & 2) box.set_incarnation(other_incarnation == 0 ? 1 : other_incarnation);
    for (const Delivered& d : delivered) {
      const bool job_scoped = d.h.kind == static_cast<uint16_t>(wire::Kind::kData) ||
                              d.h.kind == static_cast<uint16_t>(wire::Kind::kAbort);
      const bool survives = d.h.kind == static_cast<uint16_t>(wire::Kind::kManifest) ||
                            (d.h.kind == static_cast<uint16_t>(wire::Kind::kManifestAck) && !(reset & 1));
      if (!job_scoped && survives) continue;
      if (job_scoped && !(reset & 1) && d.h.incarnation == box.incarnation()) continue;
      auto got = take(d.h);
      CHECK(!got.ok());
      CHECK(got.status().code() == Code::kDeadlineExceeded);
    }
    // The old message arriving again (late) under another incarnation in force: dropped as stale,
    // never takeable. Between jobs (begin_job() alone) it is kept under its own incarnation.
    if (!delivered.empty() && box.incarnation() != 0) {
      const wire::WireHeader& h = delivered.front().h;
      const bool job_scoped = h.kind == static_cast<uint16_t>(wire::Kind::kData) ||
                              h.kind == static_cast<uint16_t>(wire::Kind::kAbort);
      if (job_scoped) {
        const uint64_t stale_before = box.stale();
        HeaderBytes again = encode(h);
        box.on_message(peer, again, payload);
        CHECK(box.stale() == stale_before + 1);
        auto got = take(h);
        CHECK(!got.ok() && got.status().code() == Code::kDeadlineExceeded);
        CHECK(box.buffered_bytes(peer) <= limit);
      }
    }
    return;
  }
  uint64_t taken = 0;
  for (const Delivered& d : delivered) {
    auto got = take(d.h);
    if (!d.kept) {  // an abort: the step fails with kAborted
      CHECK(!got.ok() && got.status().code() == Code::kAborted);
      continue;
    }
    if (!takeable_kind(d.h.kind)) continue;
    CHECK(got.ok());
    CHECK(encode(got->header) == encode(d.h));
    CHECK(got->payload.size() == payload.size());
    CHECK(payload.empty() || std::memcmp(got->payload.data(), payload.data(), payload.size()) == 0);
    taken += got->payload.size();
  }
  CHECK(taken == expect_buffered);
  CHECK(box.buffered_bytes(peer) == 0);
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  sparsecar::set_log_level(sparsecar::LogLevel::kError);  // rejections warn; keep the run quiet
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1 + wire::kHeaderBytes) return 0;
  const uint8_t mode = data[0];
  HeaderBytes bytes;
  std::memcpy(bytes.data(), data + 1, wire::kHeaderBytes);
  const std::span<const std::byte> payload(reinterpret_cast<const std::byte*>(data + 1 + wire::kHeaderBytes),
                                           size - 1 - wire::kHeaderBytes);

  // decode → encode is the identity on the 80 bytes.
  wire::WireHeader h = wire::decode_header(bytes);
  CHECK(encode(h) == bytes);

  if (mode & 1) {
    HeaderBytes sealed{};
    wire::WireHeader resealed = h;
    wire::seal(resealed, payload, sealed);
    CHECK(wire::verify_checksum(sealed, payload).ok());
    // Only the checksum field (bytes 68..71) may differ.
    CHECK(std::memcmp(sealed.data(), bytes.data(), 68) == 0);
    CHECK(std::memcmp(sealed.data() + 72, bytes.data() + 72, 8) == 0);
    CHECK(wire::decode_header(sealed).checksum == resealed.checksum);
    bytes = sealed;
    h = resealed;
  }

  const sparsecar::Status valid = wire::validate_header(h, wire::Expectations{}, payload.size());
  const sparsecar::Status crc = wire::verify_checksum(bytes, payload);
  if (!valid.ok()) CHECK(valid.code() == Code::kDataLoss && !valid.message().empty());
  if (!crc.ok()) CHECK(crc.code() == Code::kDataLoss && !crc.message().empty());
  if (valid.ok() && crc.ok()) {
    check_accepted(h, payload.size());
    check_decode(h, payload);
  }
  check_mailbox(mode, h, payload);
  return 0;
}
