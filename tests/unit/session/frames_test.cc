// daemon/session/frames.h: splitting the session socket's bytes into messages and decoding
// Register/RegisterShaped (the pure part of Connection's read loop; fuzzed by
// tests/fuzz/session_frames_fuzz.cc).
#include "daemon/session/frames.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

namespace sparsecar {
namespace {

template <typename T>
std::vector<uint8_t> message(proto::MsgType type, const T& payload) {
  const proto::MsgHeader h = proto::make_header(type);
  std::vector<uint8_t> out(sizeof h + sizeof payload);
  std::memcpy(out.data(), &h, sizeof h);
  std::memcpy(out.data() + sizeof h, &payload, sizeof payload);
  return out;
}

TEST(Frames, SplitsWholeMessagesAndWaitsForPartialOnes) {
  proto::Hello hello{};
  std::vector<uint8_t> in = message(proto::MsgType::kHello, hello);
  proto::Metric metric{};
  proto::set_field(metric.name, sizeof metric.name, "loss");
  const std::vector<uint8_t> second = message(proto::MsgType::kMetric, metric);
  in.insert(in.end(), second.begin(), second.end() - 1);  // last byte not here yet

  FrameScan f = scan_frame(in);
  ASSERT_EQ(f.kind, FrameScan::Kind::kFrame);
  EXPECT_EQ(f.header.type, static_cast<uint16_t>(proto::MsgType::kHello));
  EXPECT_EQ(f.payload.size(), sizeof(proto::Hello));
  EXPECT_EQ(f.bytes(), sizeof(proto::MsgHeader) + sizeof(proto::Hello));
  EXPECT_EQ(scan_frame(std::span<const uint8_t>(in).subspan(f.bytes())).kind, FrameScan::Kind::kIncomplete);
  EXPECT_EQ(scan_frame(std::span<const uint8_t>(in).first(10)).kind, FrameScan::Kind::kIncomplete);
  in.push_back(second.back());
  f = scan_frame(std::span<const uint8_t>(in).subspan(f.bytes()));
  ASSERT_EQ(f.kind, FrameScan::Kind::kFrame);
  EXPECT_EQ(f.header.type, static_cast<uint16_t>(proto::MsgType::kMetric));
}

TEST(Frames, BadHeaderIsReportedBeforeItsPayload) {
  proto::MsgHeader h = proto::make_header(proto::MsgType::kRegister);
  h.length = 1 << 30;
  std::vector<uint8_t> in(sizeof h);
  std::memcpy(in.data(), &h, sizeof h);
  const FrameScan f = scan_frame(in);
  ASSERT_EQ(f.kind, FrameScan::Kind::kMalformed);
  EXPECT_STREQ(f.error, "payload length does not match the message type");
}

TEST(Frames, DecodesRegisterShaped) {
  proto::RegisterShaped m{};
  m.count = 6;
  m.ndim = 2;
  m.dims[0] = 2;
  m.dims[1] = 3;
  proto::set_field(m.name, sizeof m.name, "w");
  const std::vector<uint8_t> bytes = message(proto::MsgType::kRegisterShaped, m);
  const FrameScan f = scan_frame(bytes);
  ASSERT_EQ(f.kind, FrameScan::Kind::kFrame);
  RegisterRequest r = decode_register_shaped(f.payload.data());
  EXPECT_EQ(r.count, 6u);
  EXPECT_EQ(r.shape, (std::vector<uint64_t>{2, 3}));
  EXPECT_STREQ(r.name, "w");
  EXPECT_TRUE(r.malformed.empty());

  m.dims[3] = 7;  // an unused dim
  std::vector<uint8_t> bad = message(proto::MsgType::kRegisterShaped, m);
  r = decode_register_shaped(bad.data() + sizeof(proto::MsgHeader));
  EXPECT_EQ(r.malformed, "unused dims of RegisterShaped are not 0");
  m.ndim = 5;
  bad = message(proto::MsgType::kRegisterShaped, m);
  r = decode_register_shaped(bad.data() + sizeof(proto::MsgHeader));
  EXPECT_EQ(r.malformed, "shape has 5 dims; 1..4 are allowed");
  EXPECT_TRUE(r.shape.empty());
}

TEST(Frames, DecodesRegister) {
  proto::Register m{};
  m.count = 10;
  m.dtype = 0;
  proto::set_field(m.name, sizeof m.name, "bias");
  std::vector<uint8_t> bytes = message(proto::MsgType::kRegister, m);
  RegisterRequest r = decode_register(bytes.data() + sizeof(proto::MsgHeader));
  EXPECT_EQ(r.count, 10u);
  EXPECT_STREQ(r.name, "bias");
  EXPECT_TRUE(r.shape.empty());
  EXPECT_TRUE(r.malformed.empty());
  m.reserved = 1;
  bytes = message(proto::MsgType::kRegister, m);
  r = decode_register(bytes.data() + sizeof(proto::MsgHeader));
  EXPECT_EQ(r.malformed, "reserved field of Register is not 0");
}

proto::RegisterDevice device_message() {
  proto::RegisterDevice m{};
  m.count = 6;
  m.ndim = 2;
  m.dims[0] = 2;
  m.dims[1] = 3;
  m.offset = 256;
  for (uint8_t i = 0; i < 16; ++i) m.device_uuid[i] = i;
  for (uint8_t i = 0; i < 64; ++i) {
    m.mem_handle[i] = static_cast<uint8_t>(i + 1);
    m.ready_event[i] = static_cast<uint8_t>(i + 2);
    m.done_event[i] = static_cast<uint8_t>(i + 3);
  }
  proto::set_field(m.name, sizeof m.name, "g");
  return m;
}

RegisterRequest decode_device(const proto::RegisterDevice& m) {
  // Kept alive for the request's name pointer.
  static std::vector<uint8_t> bytes;
  bytes = message(proto::MsgType::kRegisterDevice, m);
  const FrameScan f = scan_frame(bytes);
  EXPECT_EQ(f.kind, FrameScan::Kind::kFrame);
  return decode_register_device(bytes.data() + sizeof(proto::MsgHeader));
}

TEST(Frames, DecodesRegisterDevice) {
  const proto::RegisterDevice m = device_message();
  RegisterRequest r = decode_device(m);
  EXPECT_TRUE(r.malformed.empty()) << r.malformed;
  EXPECT_EQ(r.count, 6u);
  EXPECT_EQ(r.shape, (std::vector<uint64_t>{2, 3}));
  EXPECT_STREQ(r.name, "g");
  ASSERT_TRUE(r.device.has_value());
  EXPECT_EQ(r.device->offset, 256u);
  EXPECT_EQ(r.device->bytes, 24u);
  EXPECT_EQ(r.device->device_uuid[15], 15);
  EXPECT_EQ(r.device->mem_handle[0], 1);
  EXPECT_EQ(r.device->ready_event[63], 65);
  EXPECT_EQ(r.device->done_event[0], 3);

  proto::RegisterDevice flat = m;  // ndim 0: no shape, every dim 0
  flat.ndim = 0;
  flat.dims[0] = flat.dims[1] = 0;
  r = decode_device(flat);
  EXPECT_TRUE(r.malformed.empty()) << r.malformed;
  EXPECT_TRUE(r.shape.empty());
  // Host registrations carry no device region.
  EXPECT_FALSE(decode_register(message(proto::MsgType::kRegister, proto::Register{}).data() +
                               sizeof(proto::MsgHeader)).device.has_value());
}

TEST(Frames, RefusesMalformedRegisterDevice) {
  struct Case {
    const char* what;
    void (*edit)(proto::RegisterDevice&);
    const char* expect;
  };
  const Case cases[] = {
      {"5 dims", [](proto::RegisterDevice& m) { m.ndim = 5; }, "shape has 5 dims; 0 (no shape) or 1..4 are allowed"},
      {"unused dim", [](proto::RegisterDevice& m) { m.dims[2] = 1; }, "unused dims of RegisterDevice are not 0"},
      {"ndim 0 with a dim", [](proto::RegisterDevice& m) { m.ndim = 0; }, "unused dims of RegisterDevice are not 0"},
      {"flags", [](proto::RegisterDevice& m) { m.flags = 1; }, "flags/reserved fields of RegisterDevice are not 0"},
      {"reserved", [](proto::RegisterDevice& m) { m.reserved = 2; }, "flags/reserved fields of RegisterDevice are not 0"},
      {"offset", [](proto::RegisterDevice& m) { m.offset = 258; }, "device offset 258 is not a multiple of 4"},
      {"overflow",
       [](proto::RegisterDevice& m) {
         m.ndim = 0;
         m.dims[0] = m.dims[1] = 0;
         m.count = uint64_t{1} << 62;
         m.offset = 4;
       },
       "device region of 4611686018427387904 elements at offset 4 overflows"},
      {"name", [](proto::RegisterDevice& m) { std::memset(m.name, 'x', sizeof m.name); },
       "tensor name is not NUL-terminated within 256 bytes"},
  };
  for (const Case& c : cases) {
    proto::RegisterDevice m = device_message();
    c.edit(m);
    const RegisterRequest r = decode_device(m);
    EXPECT_EQ(r.malformed, c.expect) << c.what;
    EXPECT_TRUE(r.device.has_value()) << c.what;
  }
}

}  // namespace
}  // namespace sparsecar
