// Session frames: the pure part of reading the session socket (session_protocol.h). Splits a
// connection's input bytes into messages and decodes the client's Register/RegisterShaped/
// RegisterDevice payloads into one plain request. No I/O and no state, so the same code runs in Connection's
// read loop (connection.h) and under the fuzzer (tests/fuzz/session_frames_fuzz.cc).
//
// What is checked here is what the bytes alone can tell: framing (magic, version, reserved,
// type, length) and the fixed-field rules of RegisterShaped (ndim, unused dims) and RegisterDevice
// (ndim 0..4, unused dims, flags/reserved, a 4-aligned offset whose region does not overflow, a
// NUL-terminated name). Everything that
// needs the daemon's state or limits (name rules, dtype, count limits, shape product, duplicate
// names) stays in StepCollector::register_tensor (step_collector.h).
//
// Thread-safety: pure functions over caller-owned bytes.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "daemon/device/device_runtime.h"
#include "sparsecar/common/session_protocol.h"

namespace sparsecar {

// What the front of a connection's input holds.
struct FrameScan {
  enum class Kind {
    kIncomplete,  // the header or its payload has not fully arrived; read more
    kFrame,       // one well-framed message: `header` and exactly header.length payload bytes
    kMalformed,   // a complete header that breaks the framing rules: `error` says which
  };
  Kind kind = Kind::kIncomplete;
  proto::MsgHeader header{};
  std::span<const uint8_t> payload;  // kFrame only; points into the scanned input
  const char* error = nullptr;       // kMalformed only; static text (proto::header_error)

  // Bytes the frame occupies at the front of the input (kFrame only).
  size_t bytes() const { return sizeof(proto::MsgHeader) + payload.size(); }
};

// Scans the first message of `in`. A bad header is reported as soon as its 16 bytes are there,
// before any payload. A kFrame's size is at most proto::kMaxMessageBytes, so an input buffer
// of that size always has room for the rest of an incomplete frame.
FrameScan scan_frame(std::span<const uint8_t> in);

// Register, RegisterShaped and RegisterDevice, decoded into one request.
struct RegisterRequest {
  uint64_t count = 0;
  uint32_t dtype = 0;
  const char* name = nullptr;   // the message's kNameBytes field (in the payload; maybe no NUL)
  std::vector<uint64_t> shape;  // empty for Register (and a RegisterDevice with ndim 0)
  std::string malformed;        // a field rule the message broke (answered before anything else)
  // RegisterDevice only: where the tensor lives on the trainer's GPU (bytes = count * 4 when the
  // request is not malformed). Untrusted until DeviceRuntime::open checked it.
  std::optional<DeviceRegion> device;
};

// `payload` is the kFrame payload of a kRegister / kRegisterShaped / kRegisterDevice message
// (proto::payload_bytes of that type); the request's `name` points into it.
RegisterRequest decode_register(const uint8_t* payload);
RegisterRequest decode_register_shaped(const uint8_t* payload);
RegisterRequest decode_register_device(const uint8_t* payload);

}  // namespace sparsecar
