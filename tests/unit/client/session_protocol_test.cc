// Golden layout of the session protocol v1 and its header/field validation.
#include "sparsecar/common/session_protocol.h"

#include <gtest/gtest.h>

#include <cstddef>
#include <cstring>

namespace sparsecar::proto {
namespace {

TEST(SessionProtocol, FrozenLayout) {
  EXPECT_EQ(sizeof(MsgHeader), 16u);
  EXPECT_EQ(offsetof(MsgHeader, type), 6u);
  EXPECT_EQ(offsetof(MsgHeader, length), 8u);
  EXPECT_EQ(sizeof(Hello), 16u);
  EXPECT_EQ(offsetof(Hello, pid), 8u);
  EXPECT_EQ(sizeof(HelloAck), 216u);
  EXPECT_EQ(offsetof(HelloAck, control_bytes), 16u);
  EXPECT_EQ(offsetof(HelloAck, message), 24u);
  EXPECT_EQ(sizeof(Register), 272u);
  EXPECT_EQ(offsetof(Register, name), 16u);
  EXPECT_EQ(sizeof(RegisterAck), 216u);
  EXPECT_EQ(offsetof(RegisterAck, message), 24u);
  EXPECT_EQ(sizeof(Metric), 272u);
  EXPECT_EQ(sizeof(Error), 200u);
  EXPECT_EQ(static_cast<int>(MsgType::kError), 6);
  // RegisterShaped (type 7) joined v1 later; the layouts above did not move.
  EXPECT_EQ(static_cast<int>(MsgType::kRegisterShaped), 7);
  EXPECT_EQ(sizeof(RegisterShaped), 304u);
  EXPECT_EQ(offsetof(RegisterShaped, count), 0u);
  EXPECT_EQ(offsetof(RegisterShaped, dtype), 8u);
  EXPECT_EQ(offsetof(RegisterShaped, ndim), 12u);
  EXPECT_EQ(offsetof(RegisterShaped, dims), 16u);
  EXPECT_EQ(offsetof(RegisterShaped, name), 48u);
  EXPECT_EQ(kMaxShapeDims, 4u);
  // RegisterDevice (type 8) joined v1 after that; again nothing above moved.
  EXPECT_EQ(static_cast<int>(MsgType::kRegisterDevice), 8);
  EXPECT_EQ(sizeof(RegisterDevice), 528u);
  EXPECT_EQ(offsetof(RegisterDevice, count), 0u);
  EXPECT_EQ(offsetof(RegisterDevice, dtype), 8u);
  EXPECT_EQ(offsetof(RegisterDevice, ndim), 12u);
  EXPECT_EQ(offsetof(RegisterDevice, dims), 16u);
  EXPECT_EQ(offsetof(RegisterDevice, offset), 48u);
  EXPECT_EQ(offsetof(RegisterDevice, device_uuid), 56u);
  EXPECT_EQ(offsetof(RegisterDevice, mem_handle), 72u);
  EXPECT_EQ(offsetof(RegisterDevice, ready_event), 136u);
  EXPECT_EQ(offsetof(RegisterDevice, done_event), 200u);
  EXPECT_EQ(offsetof(RegisterDevice, flags), 264u);
  EXPECT_EQ(offsetof(RegisterDevice, reserved), 268u);
  EXPECT_EQ(offsetof(RegisterDevice, name), 272u);
  EXPECT_EQ(kDeviceUuidBytes, 16u);
  EXPECT_EQ(kIpcHandleBytes, 64u);
  EXPECT_EQ(payload_bytes(static_cast<uint16_t>(MsgType::kRegisterDevice)), 528u);
  EXPECT_EQ(kMaxPayloadBytes, 528u);
  EXPECT_EQ(kMaxMessageBytes, 544u);
  EXPECT_EQ(kProtocolVersion, 1);
}

TEST(SessionProtocol, RegisterDeviceGoldenBytes) {
  MsgHeader h = make_header(MsgType::kRegisterDevice);
  const uint8_t header[16] = {'S', 'C', 'S', 'P', 1, 0, 8, 0, 0x10, 0x02, 0, 0, 0, 0, 0, 0};
  EXPECT_EQ(std::memcmp(&h, header, sizeof header), 0);
  RegisterDevice m{};
  m.count = 0x0102;
  m.ndim = 1;
  m.dims[0] = 0x0102;
  m.offset = 0x0a0b0c00;
  for (uint8_t i = 0; i < 16; ++i) m.device_uuid[i] = static_cast<uint8_t>(0xa0 + i);
  for (uint8_t i = 0; i < 64; ++i) {
    m.mem_handle[i] = i;
    m.ready_event[i] = static_cast<uint8_t>(0x40 + i);
    m.done_event[i] = static_cast<uint8_t>(0x80 + i);
  }
  set_field(m.name, sizeof m.name, "g");
  const auto* b = reinterpret_cast<const uint8_t*>(&m);
  const uint8_t head[24] = {0x02, 0x01, 0, 0, 0, 0, 0, 0,  0, 0, 0, 0,  1, 0, 0, 0,
                            0x02, 0x01, 0, 0, 0, 0, 0, 0};
  EXPECT_EQ(std::memcmp(b, head, sizeof head), 0);
  for (size_t i = 24; i < 48; ++i) EXPECT_EQ(b[i], 0) << i;  // unused dims
  const uint8_t offset[8] = {0x00, 0x0c, 0x0b, 0x0a, 0, 0, 0, 0};
  EXPECT_EQ(std::memcmp(b + 48, offset, sizeof offset), 0);
  EXPECT_EQ(b[56], 0xa0);
  EXPECT_EQ(b[71], 0xaf);
  EXPECT_EQ(b[72], 0x00);
  EXPECT_EQ(b[135], 0x3f);
  EXPECT_EQ(b[136], 0x40);
  EXPECT_EQ(b[200], 0x80);
  EXPECT_EQ(b[263], 0xbf);
  for (size_t i = 264; i < 272; ++i) EXPECT_EQ(b[i], 0) << i;  // flags, reserved
  EXPECT_EQ(b[272], 'g');
  EXPECT_EQ(b[273], 0);
}

TEST(SessionProtocol, RegisterShapedGoldenBytes) {
  MsgHeader h = make_header(MsgType::kRegisterShaped);
  const uint8_t header[16] = {'S', 'C', 'S', 'P', 1, 0, 7, 0, 0x30, 0x01, 0, 0, 0, 0, 0, 0};
  EXPECT_EQ(std::memcmp(&h, header, sizeof header), 0);
  RegisterShaped m{};
  m.count = 0x1b0;  // 24 x 18
  m.dtype = 0;
  m.ndim = 2;
  m.dims[0] = 0x18;
  m.dims[1] = 0x12;
  set_field(m.name, sizeof m.name, "w");
  const auto* b = reinterpret_cast<const uint8_t*>(&m);
  const uint8_t head[48] = {0xb0, 0x01, 0, 0, 0, 0, 0, 0,  0, 0, 0, 0,  2, 0, 0, 0,
                            0x18, 0,    0, 0, 0, 0, 0, 0,  0x12, 0, 0, 0, 0, 0, 0, 0,
                            0,    0,    0, 0, 0, 0, 0, 0,  0, 0, 0, 0,  0, 0, 0, 0};
  EXPECT_EQ(std::memcmp(b, head, sizeof head), 0);
  EXPECT_EQ(b[48], 'w');
  EXPECT_EQ(b[49], 0);
}

TEST(SessionProtocol, HeaderBytesAreLittleEndian) {
  MsgHeader h = make_header(MsgType::kRegister);
  const uint8_t expected[16] = {'S', 'C', 'S', 'P', 1, 0, 3, 0, 0x10, 0x01, 0, 0, 0, 0, 0, 0};
  EXPECT_EQ(std::memcmp(&h, expected, sizeof expected), 0);
}

TEST(SessionProtocol, HeaderValidationRejectsEveryBadField) {
  for (auto type : {MsgType::kHello, MsgType::kHelloAck, MsgType::kRegister, MsgType::kRegisterAck,
                    MsgType::kMetric, MsgType::kError, MsgType::kRegisterShaped, MsgType::kRegisterDevice}) {
    EXPECT_EQ(header_error(make_header(type)), nullptr);
  }
  MsgHeader h = make_header(MsgType::kHello);
  h.magic ^= 1;
  EXPECT_STREQ(header_error(h), "bad magic");
  h = make_header(MsgType::kHello);
  h.version = 2;
  EXPECT_NE(header_error(h), nullptr);
  h = make_header(MsgType::kHello);
  h.type = 0;
  EXPECT_NE(header_error(h), nullptr);
  h.type = 9;
  EXPECT_NE(header_error(h), nullptr);
  h = make_header(MsgType::kHello);
  h.length += 1;
  EXPECT_NE(header_error(h), nullptr);
  h = make_header(MsgType::kHello);
  h.reserved = 1;
  EXPECT_NE(header_error(h), nullptr);
}

TEST(SessionProtocol, FixedStringFields) {
  char field[8];
  set_field(field, sizeof field, "abc");
  EXPECT_EQ(field_string(field, sizeof field).value(), "abc");
  set_field(field, sizeof field, "much too long");
  EXPECT_EQ(field_string(field, sizeof field).value(), "much to");
  std::memset(field, 'x', sizeof field);
  EXPECT_FALSE(field_string(field, sizeof field).has_value());
}

}  // namespace
}  // namespace sparsecar::proto
