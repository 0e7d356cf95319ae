// Golden bytes, round trips, field-by-field validation and checksum coverage of the wire header.
// The expected bytes below are written out by hand from daemon/transport/WIRE.md, not produced
// by the code under test.
#include "daemon/transport/wire.h"

#include <gtest/gtest.h>

#include <array>
#include <cstring>
#include <vector>

#include "sparsecar/kernels/codec.h"

namespace sparsecar::wire {
namespace {

using Bytes = std::array<std::byte, kHeaderBytes>;

Bytes from_hex(std::initializer_list<unsigned> values) {
  Bytes out{};
  size_t i = 0;
  for (unsigned v : values) out.at(i++) = static_cast<std::byte>(v);
  EXPECT_EQ(i, kHeaderBytes);
  return out;
}

WireHeader example_header() {
  WireHeader h{};
  h.magic = kMagic;
  h.version = kVersion;
  h.kind = static_cast<uint16_t>(Kind::kData);
  h.job_id = 0x0102030405060708ull;
  h.sender_rank = 3;
  h.tensor_id = 5;
  h.step = 0x1122334455667788ull;
  h.epoch = 9;
  h.format = static_cast<uint16_t>(kernels::Format::kCoo);
  h.value_type = static_cast<uint16_t>(kernels::ValueType::kF32);
  h.dense_len = 1000;
  h.nnz = 10;
  h.payload_bytes = 80;
  h.chunk = 0;
  h.checksum = 0xDEADBEEF;
  h.incarnation = 0xF1E2D3C4B5A69788ull;
  return h;
}

// The example of WIRE.md, byte by byte.
const Bytes kGolden = from_hex({
    0x53, 0x50, 0x43, 0x52, 0x02, 0x00, 0x01, 0x00,  // magic "SPCR", version 2, kind 1
    0x08, 0x07, 0x06, 0x05, 0x04, 0x03, 0x02, 0x01,  // job_id
    0x03, 0x00, 0x00, 0x00, 0x05, 0x00, 0x00, 0x00,  // sender_rank 3, tensor_id 5
    0x88, 0x77, 0x66, 0x55, 0x44, 0x33, 0x22, 0x11,  // step
    0x09, 0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x00,  // epoch 9, format COO, value_type fp32
    0xe8, 0x03, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // dense_len 1000
    0x0a, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // nnz 10
    0x50, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00,  // payload_bytes 80
    0x00, 0x00, 0x00, 0x00, 0xef, 0xbe, 0xad, 0xde,  // chunk 0, checksum 0xDEADBEEF
    0x88, 0x97, 0xa6, 0xb5, 0xc4, 0xd3, 0xe2, 0xf1,  // incarnation 0xF1E2D3C4B5A69788
});

// Bitwise CRC-32C, independent of the kernels' implementation.
uint32_t reference_crc32c(const std::vector<std::byte>& bytes) {
  uint32_t crc = 0xFFFFFFFFu;
  for (std::byte b : bytes) {
    crc ^= std::to_integer<uint8_t>(b);
    for (int k = 0; k < 8; ++k) crc = (crc >> 1) ^ (0x82F63B78u & (0u - (crc & 1u)));
  }
  return ~crc;
}

bool operator==(const WireHeader& a, const WireHeader& b) { return std::memcmp(&a, &b, sizeof a) == 0; }

TEST(WireTest, GoldenBytes) {
  Bytes out{};
  encode_header(example_header(), out);
  EXPECT_EQ(out, kGolden);
}

TEST(WireTest, DecodeGolden) {
  EXPECT_TRUE(decode_header(kGolden) == example_header());
}

TEST(WireTest, RoundTripExtremes) {
  WireHeader h{};
  h.magic = 0xFFFFFFFFu;
  h.version = 0xFFFF;
  h.kind = 0xFFFF;
  h.job_id = ~0ull;
  h.sender_rank = 0x80000001u;
  h.tensor_id = 0x7FFFFFFFu;
  h.step = 0x8000000000000001ull;
  h.epoch = 0xFEDCBA98u;
  h.format = 0x8001;
  h.value_type = 0x7FFE;
  h.dense_len = 0xFFFFFFFFull;
  h.nnz = 0x0123456789ABCDEFull;
  h.payload_bytes = 0xFEDCBA9876543210ull;
  h.chunk = 0xA5A5A5A5u;
  h.checksum = 0x5A5A5A5Au;
  h.incarnation = 0x8000000000000002ull;
  Bytes out{};
  encode_header(h, out);
  EXPECT_TRUE(decode_header(out) == h);
}

TEST(WireTest, CrcMatchesReference) {
  const char* text = "123456789";
  EXPECT_EQ(kernels::crc32c(0, text, 9), 0xE3069283u);
}

TEST(WireTest, SealWritesCrcOfHeaderWithZeroedChecksumAndPayload) {
  WireHeader h = example_header();
  std::vector<std::byte> payload(80);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<std::byte>(i * 7 + 1);
  Bytes out{};
  seal(h, payload, out);

  std::vector<std::byte> covered(kGolden.begin(), kGolden.end());
  for (size_t i = 68; i < 72; ++i) covered[i] = std::byte{0};
  covered.insert(covered.end(), payload.begin(), payload.end());
  const uint32_t expected = reference_crc32c(covered);
  EXPECT_EQ(h.checksum, expected);
  // Every byte but the checksum equals the golden header; the checksum is little-endian.
  for (size_t i = 0; i < kHeaderBytes; ++i) {
    if (i < 68 || i >= 72) {
      EXPECT_EQ(out[i], kGolden[i]) << "byte " << i;
    }
  }
  EXPECT_EQ(std::to_integer<uint32_t>(out[68]) | std::to_integer<uint32_t>(out[69]) << 8 |
                std::to_integer<uint32_t>(out[70]) << 16 | std::to_integer<uint32_t>(out[71]) << 24,
            expected);
  EXPECT_TRUE(verify_checksum(out, payload).ok());
}

TEST(WireTest, ChecksumDetectsEveryFlippedBit) {
  WireHeader h = example_header();
  std::vector<std::byte> payload(80);
  for (size_t i = 0; i < payload.size(); ++i) payload[i] = static_cast<std::byte>(255 - i);
  Bytes sealed{};
  seal(h, payload, sealed);
  ASSERT_TRUE(verify_checksum(sealed, payload).ok());

  for (size_t byte = 0; byte < kHeaderBytes; ++byte) {
    for (int bit = 0; bit < 8; ++bit) {
      Bytes bad = sealed;
      bad[byte] ^= static_cast<std::byte>(1u << bit);
      Status s = verify_checksum(bad, payload);
      EXPECT_EQ(s.code(), Code::kDataLoss) << "header byte " << byte << " bit " << bit;
    }
  }
  for (size_t byte = 0; byte < payload.size(); ++byte) {
    for (int bit = 0; bit < 8; ++bit) {
      std::vector<std::byte> bad = payload;
      bad[byte] ^= static_cast<std::byte>(1u << bit);
      Status s = verify_checksum(sealed, bad);
      EXPECT_EQ(s.code(), Code::kDataLoss) << "payload byte " << byte << " bit " << bit;
    }
  }
  // A truncated payload is a mismatch too.
  std::vector<std::byte> shorter(payload.begin(), payload.end() - 1);
  EXPECT_EQ(verify_checksum(sealed, shorter).code(), Code::kDataLoss);
}

Expectations expect_job() {
  Expectations e;
  e.job_id = 0x0102030405060708ull;
  e.world_size = 4;
  e.sender_rank = 3;
  return e;
}

TEST(WireTest, ValidHeaderPasses) {
  EXPECT_TRUE(validate_header(example_header(), expect_job(), 80).ok());
  // A dense message of the same tensor.
  WireHeader d = example_header();
  d.format = static_cast<uint16_t>(kernels::Format::kDense);
  d.nnz = 1000;
  d.payload_bytes = 4000;
  EXPECT_TRUE(validate_header(d, expect_job(), 4000).ok());
  // "Any" expectations.
  EXPECT_TRUE(validate_header(example_header(), Expectations{}, 80).ok());
  // Every format and value type; variable-size formats anywhere in their range (the decoder
  // checks the exact size against the contents).
  struct Sized {
    kernels::Format format;
    kernels::ValueType value_type;
    uint64_t payload_bytes;
  };
  for (const Sized& z : {Sized{kernels::Format::kCoo, kernels::ValueType::kI8, 54},
                         Sized{kernels::Format::kCoo, kernels::ValueType::kF16, 60},
                         Sized{kernels::Format::kBitmap, kernels::ValueType::kBf16, 125 + 20},
                         Sized{kernels::Format::kCooVarint, kernels::ValueType::kF32, 50},
                         Sized{kernels::Format::kCooVarint, kernels::ValueType::kF32, 90},
                         Sized{kernels::Format::kRle, kernels::ValueType::kF32, 42},
                         Sized{kernels::Format::kCsr, kernels::ValueType::kF32, 8 + 4 + 20 + 40}}) {
    WireHeader v = example_header();
    v.format = static_cast<uint16_t>(z.format);
    v.value_type = static_cast<uint16_t>(z.value_type);
    v.payload_bytes = z.payload_bytes;
    EXPECT_TRUE(validate_header(v, expect_job(), z.payload_bytes).ok())
        << kernels::format_name(z.format) << "/" << kernels::value_type_name(z.value_type) << " "
        << validate_header(v, expect_job(), z.payload_bytes).to_string();
  }
  // Non-data kinds do not interpret format/dense_len/nnz.
  WireHeader a = example_header();
  a.kind = static_cast<uint16_t>(Kind::kAbort);
  a.format = 77;
  a.dense_len = 0;
  a.payload_bytes = 12;
  EXPECT_TRUE(validate_header(a, expect_job(), 12).ok());
  // A link probe: up to 4 MiB of payload (the ring chunk it stands for is capped there).
  WireHeader p = example_header();
  p.kind = static_cast<uint16_t>(Kind::kProbe);
  p.format = 0;
  p.payload_bytes = kMaxProbePayloadBytes;
  EXPECT_TRUE(validate_header(p, expect_job(), kMaxProbePayloadBytes).ok());
  p.payload_bytes = kMaxProbePayloadBytes + 1;
  const Status big = validate_header(p, expect_job(), kMaxProbePayloadBytes + 1);
  EXPECT_EQ(big.code(), Code::kDataLoss);
  EXPECT_NE(big.message().find("payload_bytes"), std::string::npos) << big.to_string();
}

struct Corruption {
  const char* name;       // also the field the error must name
  void (*corrupt)(WireHeader&);
  size_t actual_payload;  // what "arrived"
};

class WireValidateTest : public ::testing::TestWithParam<Corruption> {};

TEST_P(WireValidateTest, RejectsCorruptedField) {
  const Corruption& c = GetParam();
  WireHeader h = example_header();
  c.corrupt(h);
  Status s = validate_header(h, expect_job(), c.actual_payload);
  ASSERT_FALSE(s.ok()) << c.name;
  EXPECT_EQ(s.code(), Code::kDataLoss);
  EXPECT_NE(s.message().find(c.name), std::string::npos) << s.message();
}

INSTANTIATE_TEST_SUITE_P(
    EachField, WireValidateTest,
    ::testing::Values(
        Corruption{"magic", [](WireHeader& h) { h.magic = 0x52435054; }, 80},
        Corruption{"version", [](WireHeader& h) { h.version = 1; }, 80},  // v1 (72-byte header) is not spoken
        Corruption{"kind", [](WireHeader& h) { h.kind = 0; }, 80},
        Corruption{"kind", [](WireHeader& h) { h.kind = kMaxKind + 1; }, 80},
        Corruption{"job_id", [](WireHeader& h) { h.job_id = 42; }, 80},
        Corruption{"sender_rank", [](WireHeader& h) { h.sender_rank = 4; }, 80},   // >= world size
        Corruption{"sender_rank", [](WireHeader& h) { h.sender_rank = 2; }, 80},   // not who sent it
        Corruption{"format", [](WireHeader& h) { h.format = 9; }, 80},
        Corruption{"format", [](WireHeader& h) { h.format = kernels::kFormatCount; }, 80},
        Corruption{"value_type", [](WireHeader& h) { h.value_type = kernels::kValueTypeCount; }, 80},
        // Variable-size formats: outside [min, max] for (dense_len 1000, nnz 10).
        Corruption{"payload_bytes",
                   [](WireHeader& h) {
                     h.format = static_cast<uint16_t>(kernels::Format::kCooVarint);  // 50..90
                     h.payload_bytes = 49;
                   },
                   49},
        Corruption{"payload_bytes",
                   [](WireHeader& h) {
                     h.format = static_cast<uint16_t>(kernels::Format::kRle);  // 42..140
                     h.payload_bytes = 141;
                   },
                   141},
        Corruption{"payload_bytes",
                   [](WireHeader& h) {
                     h.format = static_cast<uint16_t>(kernels::Format::kCoo);
                     h.value_type = static_cast<uint16_t>(kernels::ValueType::kI8);  // 40 + 4 + 10
                   },
                   80},
        Corruption{"nnz", [](WireHeader& h) { h.nnz = 1001; h.payload_bytes = 8008; }, 8008},
        Corruption{"dense_len", [](WireHeader& h) { h.dense_len = 0x100000000ull; }, 80},
        Corruption{"payload_bytes", [](WireHeader& h) { h.payload_bytes = 88; }, 88},  // != nnz*8
        Corruption{"payload_bytes", [](WireHeader&) {}, 79},                         // != arrived
        Corruption{"payload_bytes",
                   [](WireHeader& h) {
                     h.format = static_cast<uint16_t>(kernels::Format::kDense);
                     h.dense_len = (kMaxPayloadBytes / 4) + 1;  // implies 1 GiB + 4
                     h.nnz = h.dense_len;
                     h.payload_bytes = h.dense_len * 4;
                   },
                   0},
        Corruption{"payload_bytes",
                   [](WireHeader& h) {
                     h.kind = static_cast<uint16_t>(Kind::kAbort);
                     h.payload_bytes = kMaxPayloadBytes + 1;  // too large for any kind
                   },
                   0}),
    [](const ::testing::TestParamInfo<Corruption>& param_info) {
      return std::string(param_info.param.name) + "_" + std::to_string(param_info.index);
    });

}  // namespace
}  // namespace sparsecar::wire
