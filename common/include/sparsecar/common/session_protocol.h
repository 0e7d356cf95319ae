// Session protocol v1: the messages a trainer (client library) and its daemon exchange on the
// daemon's Unix stream socket. Data never moves here: gradients go through the shared mappings
// of shm_layout.h; this socket carries the handshake, registrations, metrics and errors, and
// its closing is how either side notices the other is gone.
//
// Framing: every message is a MsgHeader followed by exactly `length` payload bytes. Each type
// has one fixed payload size (kPayloadBytes); a header whose length differs is malformed. All
// integers are little-endian (both ends run on the same host; the static_assert pins it).
// Strings are fixed-size NUL-terminated fields; a field without a NUL is malformed.
//
//   client                                   daemon
//   Hello{version, shm_version, pid} ──────►  SO_PEERCRED check (daemon euid or root)
//                                   ◄──────  HelloAck{status, client id, message}
//                                            + SCM_RIGHTS [control memfd, submission eventfd,
//                                                          completion eventfd] when status == 0
//   Register{count, dtype, name} ──────────►
//   or RegisterShaped{count, dtype, ndim, dims, name}
//   or RegisterDevice{count, dtype, ndim, dims, CUDA IPC handles, name}
//                                   ◄──────  RegisterAck{status, tensor id, message}
//                                            + SCM_RIGHTS [tensor slot memfd] when status == 0
//                                              (no fd for RegisterDevice: the data stays on the GPU)
//   Metric{value, step, name} ─────────────►  (no reply)
//                                   ◄──────  Error{status, message}, then the daemon closes
//                                            (malformed message, protocol violation)
//
// Rules: the client sends Hello first and nothing else until its HelloAck; one Register is
// outstanding at a time (the daemon answers in order). Reserved fields and flags are 0. A
// framing error (bad magic, version, type or length) is answered with Error and the connection
// closed; a well-framed message with a bad field (name without NUL, count 0, ...) is answered
// with an error RegisterAck and the connection stays open.
// `status` fields carry sparsecar::Code numbers (status.h). Frozen for kProtocolVersion: golden
// tests pin the sizes and offsets; change the layout only with a new version.
//
// RegisterShaped (type 7) was added to v1 without changing any existing layout: it is Register
// plus the tensor's shape (1..kMaxShapeDims dims whose product is count; structured selectors
// read it). A client sends it only when the trainer gave a shape, so clients that never do stay
// byte-for-byte what they were and work with every v1 daemon; a daemon that predates type 7
// answers it with Error("unknown message type") and closes the session. Register is the same as
// registering without a shape (a 1-D tensor of count elements). Every local client registering a
// name must give the same shape (or none), and every node must agree at the first step.
//
// RegisterDevice (type 8) was added to v1 the same way: a tensor that lives in GPU memory (DESIGN
// §8). Instead of a shm slot the trainer hands the daemon CUDA IPC handles: the allocation that
// holds the tensor (cudaIpcMemHandle_t of the allocation's base + the tensor's byte offset in it),
// the device's UUID (the daemon may number its GPUs differently), and two interprocess events the
// trainer created (cudaEventInterprocess | cudaEventDisableTiming): `ready`, which the trainer
// records on its stream after writing the gradient and before it submits, and `done`, which the
// daemon records once the average is in the tensor and before it posts the Completion; the
// trainer's stream waits on `done` before it reads the tensor. Neither side's host waits for the
// other's GPU. The RegisterAck carries no fd (slot_bytes 0). A daemon built without CUDA, or
// without a GPU, answers kUnavailable saying so; the trainer then registers a host tensor instead.
// Submissions and completions of a device tensor use the same rings as host tensors.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <optional>
#include <string_view>

namespace sparsecar::proto {

static_assert(std::endian::native == std::endian::little, "session protocol is little-endian");

inline constexpr uint32_t kMsgMagic = 0x50534353;  // bytes "SCSP"
inline constexpr uint16_t kProtocolVersion = 1;
inline constexpr size_t kNameBytes = 256;          // field size; names are 1..255 bytes + NUL
inline constexpr size_t kMaxNameLength = kNameBytes - 1;
inline constexpr size_t kMessageBytes = 192;       // error text field, NUL-terminated, truncated
inline constexpr size_t kHelloFds = 3;             // control memfd, submission efd, completion efd
inline constexpr size_t kRegisterFds = 1;          // tensor slot memfd
inline constexpr size_t kMaxShapeDims = 4;         // RegisterShaped carries 1..4 dims
inline constexpr size_t kIpcHandleBytes = 64;      // cudaIpcMemHandle_t / cudaIpcEventHandle_t
inline constexpr size_t kDeviceUuidBytes = 16;     // cudaUUID_t

enum class MsgType : uint16_t {
  kHello = 1,        // client -> daemon
  kHelloAck = 2,     // daemon -> client, + 3 fds on success
  kRegister = 3,     // client -> daemon
  kRegisterAck = 4,  // daemon -> client, + 1 fd on success
  kMetric = 5,       // client -> daemon, no reply
  kError = 6,        // daemon -> client, then close
  kRegisterShaped = 7,  // client -> daemon, answered by RegisterAck like Register
  kRegisterDevice = 8,  // client -> daemon, answered by RegisterAck without an fd
};

struct MsgHeader {
  uint32_t magic;    // kMsgMagic
  uint16_t version;  // kProtocolVersion
  uint16_t type;     // MsgType
  uint32_t length;   // payload bytes that follow == kPayloadBytes(type)
  uint32_t reserved; // 0
};
static_assert(sizeof(MsgHeader) == 16);

struct Hello {
  uint32_t version;      // kProtocolVersion
  uint32_t shm_version;  // shm::kShmVersion the client understands
  uint32_t pid;          // the trainer's pid (diagnostics; the daemon trusts SO_PEERCRED)
  uint32_t flags;        // 0
};
static_assert(sizeof(Hello) == 16);

struct HelloAck {
  int32_t status;          // Code; 0 = accepted and the 3 fds are attached
  uint32_t client_id;      // this session's id (1, 2, ...; the local sum runs in id order)
  uint32_t local_clients;  // L: trainers per node the daemon sums per step
  uint32_t shm_version;    // shm::kShmVersion of the control mapping
  uint64_t control_bytes;  // size of the control memfd (>= sizeof(shm::ShmControl))
  char message[kMessageBytes];
};
static_assert(sizeof(HelloAck) == 216);

struct Register {
  uint64_t count;          // elements, 1 .. daemon's max_tensor_elements
  uint32_t dtype;          // sparsecar::DType (0 = fp32)
  uint32_t reserved;       // 0
  char name[kNameBytes];   // 1..255 bytes, NUL-terminated
};
static_assert(sizeof(Register) == 272);

struct RegisterShaped {
  uint64_t count;                // elements, == the product of dims[0..ndim)
  uint32_t dtype;                // sparsecar::DType (0 = fp32)
  uint32_t ndim;                 // 1..kMaxShapeDims
  uint64_t dims[kMaxShapeDims];  // dims[0..ndim) >= 1, row-major (dims[0] is the leading one);
                                 // the unused entries are 0
  char name[kNameBytes];         // 1..255 bytes, NUL-terminated
};
static_assert(sizeof(RegisterShaped) == 304);

struct RegisterDevice {
  uint64_t count;                // elements, 1 .. daemon's max_tensor_elements
  uint32_t dtype;                // sparsecar::DType (0 = fp32; the only one on the device so far)
  uint32_t ndim;                 // 0 (no shape) or 1..kMaxShapeDims
  uint64_t dims[kMaxShapeDims];  // as RegisterShaped; all 0 when ndim == 0
  uint64_t offset;               // bytes from the allocation's base to the tensor; multiple of 4
  uint8_t device_uuid[kDeviceUuidBytes];  // the GPU holding the allocation (cudaUUID_t)
  uint8_t mem_handle[kIpcHandleBytes];    // cudaIpcGetMemHandle of the allocation's base
  uint8_t ready_event[kIpcHandleBytes];   // cudaIpcGetEventHandle: the trainer records it per step
  uint8_t done_event[kIpcHandleBytes];    // cudaIpcGetEventHandle: the daemon records it per step
  uint32_t flags;                // 0
  uint32_t reserved;             // 0
  char name[kNameBytes];         // 1..255 bytes, NUL-terminated
};
static_assert(sizeof(RegisterDevice) == 528);

struct RegisterAck {
  int32_t status;          // Code; 0 = registered and the slot memfd is attached
  uint32_t tensor_id;      // job-wide id (same for every local client registering this name)
  uint64_t count;          // elements, as registered
  uint64_t slot_bytes;     // size of the slot memfd (>= count * 4)
  char message[kMessageBytes];
};
static_assert(sizeof(RegisterAck) == 216);

struct Metric {
  double value;
  uint64_t step;
  char name[kNameBytes];   // 1..255 bytes, NUL-terminated
};
static_assert(sizeof(Metric) == 272);

struct Error {
  int32_t status;          // Code
  uint32_t reserved;       // 0
  char message[kMessageBytes];
};
static_assert(sizeof(Error) == 200);

// The one payload size of each type; 0 for an unknown type.
inline constexpr uint32_t payload_bytes(uint16_t type) {
  switch (static_cast<MsgType>(type)) {
    case MsgType::kHello: return sizeof(Hello);
    case MsgType::kHelloAck: return sizeof(HelloAck);
    case MsgType::kRegister: return sizeof(Register);
    case MsgType::kRegisterAck: return sizeof(RegisterAck);
    case MsgType::kMetric: return sizeof(Metric);
    case MsgType::kError: return sizeof(Error);
    case MsgType::kRegisterShaped: return sizeof(RegisterShaped);
    case MsgType::kRegisterDevice: return sizeof(RegisterDevice);
  }
  return 0;
}
inline constexpr size_t kMaxPayloadBytes = sizeof(RegisterDevice);
static_assert(sizeof(RegisterShaped) <= kMaxPayloadBytes && sizeof(Register) <= kMaxPayloadBytes && sizeof(Metric) <= kMaxPayloadBytes &&
              sizeof(HelloAck) <= kMaxPayloadBytes);
inline constexpr size_t kMaxMessageBytes = sizeof(MsgHeader) + kMaxPayloadBytes;

inline MsgHeader make_header(MsgType type) {
  return MsgHeader{kMsgMagic, kProtocolVersion, static_cast<uint16_t>(type),
                   payload_bytes(static_cast<uint16_t>(type)), 0};
}

// nullptr when the header is well-formed, else a static description of what is wrong.
inline const char* header_error(const MsgHeader& h) {
  if (h.magic != kMsgMagic) return "bad magic";
  if (h.version != kProtocolVersion) return "unsupported protocol version";
  if (h.reserved != 0) return "reserved header field is not 0";
  uint32_t expected = payload_bytes(h.type);
  if (expected == 0) return "unknown message type";
  if (h.length != expected) return "payload length does not match the message type";
  return nullptr;
}

// The string in a fixed field of `cap` bytes, or nullopt when it has no NUL terminator.
inline std::optional<std::string_view> field_string(const char* field, size_t cap) {
  const void* nul = std::memchr(field, '\0', cap);
  if (nul == nullptr) return std::nullopt;
  return std::string_view(field, static_cast<size_t>(static_cast<const char*>(nul) - field));
}

// Copies `text` into a fixed field, truncating and always NUL-terminating.
inline void set_field(char* field, size_t cap, std::string_view text) {
  size_t n = text.size() < cap - 1 ? text.size() : cap - 1;
  std::memcpy(field, text.data(), n);
  std::memset(field + n, 0, cap - n);
}

}  // namespace sparsecar::proto
