#include "daemon/session/frames.h"

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

}  // namespace sparsecar
