// libFuzzer target: the session socket's frame parser (daemon/session/frames.h) on the bytes a
// trainer (or anything that can connect to the Unix socket) sends.
//
// Input: byte 0 seeds the chunking; the rest is the byte stream of one connection.
// Properties checked beyond "no crash, no sanitizer report":
//   - the stream splits into the same frames and stops at the same point (incomplete tail or the
//     same malformed header) whether it arrives whole or in arbitrary chunks through a buffer
//     run exactly like SessionServer::read_socket's (2 * kMaxMessageBytes, consume, memmove),
//     and that buffer never fills up;
//   - every frame passes header_error, is canonical (its header is make_header(type)) and has
//     exactly payload_bytes(type) > 0 bytes;
//   - Register / RegisterShaped / RegisterDevice decode → encode gives back the payload bytes
//     when the request is not malformed; a shape has 1..kMaxShapeDims dims (0..kMaxShapeDims for
//     RegisterDevice); a well-formed RegisterDevice region is 4-aligned and does not overflow; check_shape's verdict agrees with the
//     product of the dims; name fields round-trip through field_string / set_field.
// Built by the clang fuzz project (tests/fuzz/CMakeLists.txt: fuzz_session_frames); seeds in
// corpus/session_frames/ (written by fuzz_make_parser_seeds).
#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>
#include <string_view>
#include <vector>

#include "daemon/pipeline/step.h"
#include "daemon/session/frames.h"

namespace {

using sparsecar::FrameScan;
namespace proto = sparsecar::proto;

#define CHECK(cond)                   \
  do {                                \
    if (!(cond)) __builtin_trap();    \
  } while (0)

struct Seen {
  size_t offset;  // in the stream
  uint16_t type;
  bool operator==(const Seen&) const = default;
};

struct Outcome {
  std::vector<Seen> frames;
  const char* malformed = nullptr;  // static text of the first bad header
  size_t malformed_at = 0;
  bool operator==(const Outcome& o) const {
    return frames == o.frames && malformed == o.malformed && malformed_at == o.malformed_at;
  }
};

void check_name_field(const char* field) {
  auto name = proto::field_string(field, proto::kNameBytes);
  if (!name) return;
  CHECK(name->size() <= proto::kMaxNameLength);
  CHECK(name->find('\0') == std::string_view::npos);
  char copy[proto::kNameBytes];
  proto::set_field(copy, sizeof copy, *name);
  auto again = proto::field_string(copy, sizeof copy);
  CHECK(again && *again == *name);
}

void check_frame(const FrameScan& f) {
  CHECK(proto::header_error(f.header) == nullptr);
  const uint32_t want = proto::payload_bytes(f.header.type);
  CHECK(want > 0 && f.payload.size() == want && f.header.length == want);
  CHECK(f.bytes() <= proto::kMaxMessageBytes);
  const proto::MsgHeader canonical = proto::make_header(static_cast<proto::MsgType>(f.header.type));
  CHECK(std::memcmp(&canonical, &f.header, sizeof canonical) == 0);

  switch (static_cast<proto::MsgType>(f.header.type)) {
    case proto::MsgType::kRegister: {
      const sparsecar::RegisterRequest r = sparsecar::decode_register(f.payload.data());
      CHECK(r.shape.empty());
      CHECK(r.name == reinterpret_cast<const char*>(f.payload.data()) + offsetof(proto::Register, name));
      check_name_field(r.name);
      if (r.malformed.empty()) {
        proto::Register m{};
        m.count = r.count;
        m.dtype = r.dtype;
        std::memcpy(m.name, r.name, sizeof m.name);
        CHECK(std::memcmp(&m, f.payload.data(), sizeof m) == 0);
      }
      return;
    }
    case proto::MsgType::kRegisterShaped: {
      const sparsecar::RegisterRequest r = sparsecar::decode_register_shaped(f.payload.data());
      CHECK(r.name == reinterpret_cast<const char*>(f.payload.data()) + offsetof(proto::RegisterShaped, name));
      check_name_field(r.name);
      CHECK(r.shape.size() <= proto::kMaxShapeDims);
      if (r.malformed.empty()) {
        CHECK(!r.shape.empty());
        proto::RegisterShaped m{};
        m.count = r.count;
        m.dtype = r.dtype;
        m.ndim = static_cast<uint32_t>(r.shape.size());
        std::copy(r.shape.begin(), r.shape.end(), m.dims);
        std::memcpy(m.name, r.name, sizeof m.name);
        CHECK(std::memcmp(&m, f.payload.data(), sizeof m) == 0);
      }
      // The daemon's next check (StepCollector::register_tensor): OK exactly when every dim is >= 1 and the
      // product (without overflow) is the count.
      if (!r.shape.empty()) {
        uint64_t product = 1;
        bool good = true;
        for (uint64_t d : r.shape) good = good && d != 0 && !__builtin_mul_overflow(product, d, &product);
        good = good && product == r.count;
        CHECK(sparsecar::check_shape(r.count, r.shape).ok() == good);
      }
      return;
    }
    case proto::MsgType::kRegisterDevice: {
      const sparsecar::RegisterRequest r = sparsecar::decode_register_device(f.payload.data());
      CHECK(r.name == reinterpret_cast<const char*>(f.payload.data()) + offsetof(proto::RegisterDevice, name));
      CHECK(r.device.has_value());
      check_name_field(r.name);
      CHECK(r.shape.size() <= proto::kMaxShapeDims);
      if (r.malformed.empty()) {
        const sparsecar::DeviceRegion& d = *r.device;
        CHECK(d.offset % 4 == 0);
        CHECK(d.bytes == r.count * 4 && d.bytes / 4 == r.count && d.offset + d.bytes >= d.offset);
        CHECK(proto::field_string(r.name, proto::kNameBytes).has_value());
        proto::RegisterDevice m{};
        m.count = r.count;
        m.dtype = r.dtype;
        m.ndim = static_cast<uint32_t>(r.shape.size());
        std::copy(r.shape.begin(), r.shape.end(), m.dims);
        m.offset = d.offset;
        std::copy(d.device_uuid.begin(), d.device_uuid.end(), m.device_uuid);
        std::copy(d.mem_handle.begin(), d.mem_handle.end(), m.mem_handle);
        std::copy(d.ready_event.begin(), d.ready_event.end(), m.ready_event);
        std::copy(d.done_event.begin(), d.done_event.end(), m.done_event);
        std::memcpy(m.name, r.name, sizeof m.name);
        CHECK(std::memcmp(&m, f.payload.data(), sizeof m) == 0);
      }
      return;
    }
    case proto::MsgType::kMetric: {
      proto::Metric m;
      std::memcpy(&m, f.payload.data(), sizeof m);
      check_name_field(m.name);
      return;
    }
    case proto::MsgType::kHelloAck:
    case proto::MsgType::kRegisterAck:
    case proto::MsgType::kError: {
      // Daemon -> client messages: the client reads their message field with field_string.
      const size_t at = f.payload.size() - proto::kMessageBytes;  // the text field ends each one
      auto text = proto::field_string(reinterpret_cast<const char*>(f.payload.data()) + at, proto::kMessageBytes);
      if (text) CHECK(text->size() < proto::kMessageBytes);
      return;
    }
    case proto::MsgType::kHello:
      return;
  }
  __builtin_trap();  // header_error accepted a type payload_bytes does not know
}

// The whole stream at once.
Outcome scan_whole(std::span<const uint8_t> stream) {
  Outcome out;
  size_t off = 0;
  for (;;) {
    const FrameScan f = sparsecar::scan_frame(stream.subspan(off));
    if (f.kind == FrameScan::Kind::kIncomplete) {
      CHECK(stream.size() - off < proto::kMaxMessageBytes);
      return out;
    }
    if (f.kind == FrameScan::Kind::kMalformed) {
      CHECK(f.error != nullptr && f.payload.empty());
      out.malformed = f.error;
      out.malformed_at = off;
      return out;
    }
    check_frame(f);
    out.frames.push_back({off, f.header.type});
    off += f.bytes();
  }
}

// The stream in chunks, through a buffer handled like SessionServer::read_socket's.
Outcome scan_chunked(std::span<const uint8_t> stream, uint8_t seed) {
  Outcome out;
  std::array<uint8_t, 2 * proto::kMaxMessageBytes> in{};
  size_t in_used = 0;
  size_t consumed = 0;  // stream offset of in[0]
  size_t pos = 0;
  uint32_t x = seed * 2654435761u + 1;
  while (pos < stream.size()) {
    CHECK(in_used < in.size());  // read_socket's "cannot happen: input buffer full"
    x = x * 1664525u + 1013904223u;
    const size_t want = 1 + (x >> 16) % (seed & 1 ? 7 : 700);
    const size_t n = std::min<size_t>({want, stream.size() - pos, in.size() - in_used});
    std::memcpy(in.data() + in_used, stream.data() + pos, n);
    in_used += n;
    pos += n;
    size_t off = 0;
    for (;;) {
      const FrameScan f = sparsecar::scan_frame(std::span<const uint8_t>(in.data() + off, in_used - off));
      if (f.kind == FrameScan::Kind::kMalformed) {
        out.malformed = f.error;
        out.malformed_at = consumed + off;
        return out;
      }
      if (f.kind == FrameScan::Kind::kIncomplete) break;
      out.frames.push_back({consumed + off, f.header.type});
      off += f.bytes();
    }
    std::memmove(in.data(), in.data() + off, in_used - off);
    in_used -= off;
    consumed += off;
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::span<const uint8_t> stream(data + 1, size - 1);
  const Outcome whole = scan_whole(stream);
  CHECK(scan_chunked(stream, data[0]) == whole);
  return 0;
}
