#include "daemon/session/frames.h"

#include <algorithm>
#include <cstring>

#include "sparsecar/common/log.h"

namespace sparsecar {

FrameScan scan_frame(std::span<const uint8_t> in) {
  FrameScan f;
  if (in.size() < sizeof f.header) return f;
  std::memcpy(&f.header, in.data(), sizeof f.header);
  if (const char* err = proto::header_error(f.header)) {
    f.kind = FrameScan::Kind::kMalformed;
    f.error = err;
    return f;
  }
  if (in.size() - sizeof f.header < f.header.length) return f;
  f.kind = FrameScan::Kind::kFrame;
  f.payload = in.subspan(sizeof f.header, f.header.length);
  return f;
}

namespace {

// The fields Register and RegisterShaped share; `m` is the message copied out of `payload`.
template <typename Message>
RegisterRequest decode_common(const uint8_t* payload, Message* m) {
  std::memcpy(m, payload, sizeof *m);
  RegisterRequest req;
  req.count = m->count;
  req.dtype = m->dtype;
  req.name = reinterpret_cast<const char*>(payload) + offsetof(Message, name);
  return req;
}

}  // namespace

RegisterRequest decode_register(const uint8_t* payload) {
  proto::Register m;
  RegisterRequest req = decode_common(payload, &m);
  if (m.reserved != 0) req.malformed = "reserved field of Register is not 0";
  return req;
}

RegisterRequest decode_register_shaped(const uint8_t* payload) {
  proto::RegisterShaped m;
  RegisterRequest req = decode_common(payload, &m);
  if (m.ndim == 0 || m.ndim > proto::kMaxShapeDims) {
    req.malformed = fmt::format("shape has {} dims; 1..{} are allowed", m.ndim, proto::kMaxShapeDims);
  } else {
    req.shape.assign(m.dims, m.dims + m.ndim);
    for (size_t i = m.ndim; i < proto::kMaxShapeDims; ++i) {
      if (m.dims[i] != 0) req.malformed = "unused dims of RegisterShaped are not 0";
    }
  }
  return req;
}

RegisterRequest decode_register_device(const uint8_t* payload) {
  proto::RegisterDevice m;
  RegisterRequest req = decode_common(payload, &m);
  DeviceRegion region;
  std::copy(std::begin(m.device_uuid), std::end(m.device_uuid), region.device_uuid.begin());
  std::copy(std::begin(m.mem_handle), std::end(m.mem_handle), region.mem_handle.begin());
  std::copy(std::begin(m.ready_event), std::end(m.ready_event), region.ready_event.begin());
  std::copy(std::begin(m.done_event), std::end(m.done_event), region.done_event.begin());
  region.offset = m.offset;
  // The first rule broken is the one reported (the message field is short).
  auto broken = [&](std::string what) {
    if (req.malformed.empty()) req.malformed = std::move(what);
  };
  if (m.ndim > proto::kMaxShapeDims) {
    broken(fmt::format("shape has {} dims; 0 (no shape) or 1..{} are allowed", m.ndim, proto::kMaxShapeDims));
  } else {
    req.shape.assign(m.dims, m.dims + m.ndim);
    for (size_t i = m.ndim; i < proto::kMaxShapeDims; ++i) {
      if (m.dims[i] != 0) broken("unused dims of RegisterDevice are not 0");
    }
  }
  if (m.flags != 0 || m.reserved != 0) broken("flags/reserved fields of RegisterDevice are not 0");
  if (m.offset % sizeof(float) != 0) {
    broken(fmt::format("device offset {} is not a multiple of 4", static_cast<unsigned long long>(m.offset)));
  }
  if (m.count > (UINT64_MAX - m.offset) / sizeof(float)) {
    broken(fmt::format("device region of {} elements at offset {} overflows", static_cast<unsigned long long>(m.count),
                       static_cast<unsigned long long>(m.offset)));
  } else {
    region.bytes = m.count * sizeof(float);
  }
  if (!proto::field_string(m.name, sizeof m.name)) broken("tensor name is not NUL-terminated within 256 bytes");
  req.device = region;
  return req;
}

}  // namespace sparsecar
