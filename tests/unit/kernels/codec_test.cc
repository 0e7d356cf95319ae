// COO/dense encoding round trips, golden bytes, and the receiver's validation: every malformed
// payload is rejected with kDataLoss naming the field, and the output is left untouched.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <vector>

#include "sparsecar/kernels/codec.h"
#include "sparsecar/kernels/select.h"
#include "tests/unit/kernels/test_util.h"

namespace sparsecar::kernels {
namespace {

using testing::same_bits;

std::vector<std::byte> bytes_of(std::initializer_list<int> b) {
  std::vector<std::byte> out;
  for (int v : b) out.push_back(static_cast<std::byte>(v));
  return out;
}

// Builds a COO payload by hand (little-endian, as the format says), without the encoder.
std::vector<std::byte> coo_payload(const std::vector<uint32_t>& index,
                                   const std::vector<float>& value) {
  std::vector<std::byte> out;
  auto put = [&](uint32_t w) {
    for (int s = 0; s < 32; s += 8) out.push_back(static_cast<std::byte>((w >> s) & 0xffu));
  };
  for (uint32_t i : index) put(i);
  for (float v : value) put(std::bit_cast<uint32_t>(v));
  return out;
}

TEST(kernelsCodec, EncodedBytes) {
  EXPECT_EQ(encoded_bytes(Format::kCoo, ValueType::kF32, 1000, 10), 80u);
  EXPECT_EQ(encoded_bytes(Format::kCoo, ValueType::kF32, 1000, 0), 0u);
  EXPECT_EQ(encoded_bytes(Format::kDense, ValueType::kF32, 7, 3), 28u);
  EXPECT_EQ(encoded_bytes(static_cast<Format>(9), ValueType::kF32, 7, 3), 0u);
  EXPECT_EQ(encoded_bytes(Format::kCoo, static_cast<ValueType>(9), 7, 3), 0u);
  EXPECT_EQ(encoded_bytes(Format::kCoo, ValueType::kF32, 1, std::numeric_limits<size_t>::max()),
            std::numeric_limits<size_t>::max());  // saturates instead of wrapping
}

TEST(kernelsCodec, CooGoldenBytes) {
  const std::vector<uint32_t> index = {1, 258};
  const std::vector<float> value = {1.0f, -2.0f};
  std::vector<std::byte> out(16);
  ASSERT_TRUE(coo_encode(index, value, out).ok());
  EXPECT_EQ(out, bytes_of({0x01, 0x00, 0x00, 0x00, 0x02, 0x01, 0x00, 0x00,    // indices
                           0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x00, 0xc0}));  // 1.0f, -2.0f
}

TEST(kernelsCodec, CooRoundTripOfATopkSelection) {
  for (size_t n : {size_t{1}, size_t{100}, size_t{65536}}) {
    const auto x = testing::normal_floats(n, n);
    const size_t k = topk_count(n, 0.01);
    std::vector<std::byte> scratch(topk_scratch_bytes(n));
    std::vector<uint32_t> index(k);
    std::vector<float> value(k);
    ASSERT_TRUE(topk_exact(x, k, scratch, index.data(), value.data()).ok());

    std::vector<std::byte> payload(encoded_bytes(Format::kCoo, ValueType::kF32, n, k));
    ASSERT_TRUE(coo_encode(index, value, payload).ok());
    EXPECT_EQ(payload, coo_payload(index, value));

    auto base = testing::normal_floats(n, n + 1);
    auto want = base;
    for (size_t j = 0; j < k; ++j) want[index[j]] += value[j];
    ASSERT_TRUE(decode_accumulate(Format::kCoo, ValueType::kF32, payload, k, base).ok());
    for (size_t i = 0; i < n; ++i) ASSERT_TRUE(same_bits(base[i], want[i])) << i;
  }
}

TEST(kernelsCodec, CooEmptySelection) {
  std::vector<float> out = {1, 2, 3};
  ASSERT_TRUE(decode_accumulate(Format::kCoo, ValueType::kF32, {}, 0, out).ok());
  EXPECT_EQ(out, (std::vector<float>{1, 2, 3}));
  std::vector<std::byte> payload;
  EXPECT_TRUE(coo_encode({}, {}, payload).ok());
}

TEST(kernelsCodec, DenseRoundTrip) {
  const auto x = testing::special_floats(1001, 5);
  std::vector<std::byte> payload(encoded_bytes(Format::kDense, ValueType::kF32, x.size(), 0));
  ASSERT_EQ(payload.size(), x.size() * 4);
  ASSERT_TRUE(dense_encode(x, payload).ok());
  EXPECT_EQ(std::memcmp(payload.data(), x.data(), payload.size()), 0);
  std::vector<float> out(x.size(), 0.0f);
  ASSERT_TRUE(decode_accumulate(Format::kDense, ValueType::kF32, payload, x.size(), out).ok());
  for (size_t i = 0; i < x.size(); ++i) {
    const float want = 0.0f + x[i];
    ASSERT_TRUE(same_bits(out[i], want) || (std::isnan(out[i]) && std::isnan(want))) << i;
  }
}

TEST(kernelsCodec, EncodersRejectBadArguments) {
  std::vector<std::byte> out(64);
  const std::vector<uint32_t> index = {1, 5, 9};
  const std::vector<float> value = {1, 2, 3};
  EXPECT_EQ(coo_encode(index, std::span<const float>(value.data(), 2), out).code(),
            Code::kInvalidArgument);
  EXPECT_EQ(coo_encode(index, value, std::span<std::byte>(out.data(), 23)).code(),
            Code::kInvalidArgument);
  const std::vector<uint32_t> dup = {1, 5, 5};
  EXPECT_EQ(coo_encode(dup, value, out).code(), Code::kInvalidArgument);
  const std::vector<uint32_t> down = {4, 2, 9};
  EXPECT_EQ(coo_encode(down, value, out).code(), Code::kInvalidArgument);
  EXPECT_EQ(dense_encode(value, std::span<std::byte>(out.data(), 11)).code(),
            Code::kInvalidArgument);
}

struct BadPayload {
  const char* what;
  Format format;
  ValueType value_type;
  std::vector<std::byte> payload;
  uint64_t nnz;
  const char* field;  // must appear in the error message
};

TEST(kernelsCodec, DecodeRejectsMalformedPayloadsAndWritesNothing) {
  const size_t dense_len = 10;
  const std::vector<uint32_t> good_index = {0, 3, 9};
  const std::vector<float> good_value = {1.5f, -2.0f, 4.0f};
  const auto good = coo_payload(good_index, good_value);
  auto truncated = good;
  truncated.pop_back();
  auto short_entry = good;
  short_entry.resize(good.size() - 4);
  auto oversized = good;
  oversized.push_back(std::byte{0});
  auto one_more = good;
  one_more.resize(good.size() + 8);

  const std::vector<BadPayload> cases = {
      {"truncated by one byte", Format::kCoo, ValueType::kF32, truncated, 3, "payload_bytes"},
      {"missing a value", Format::kCoo, ValueType::kF32, short_entry, 3, "payload_bytes"},
      {"one byte too many", Format::kCoo, ValueType::kF32, oversized, 3, "payload_bytes"},
      {"an entry too many", Format::kCoo, ValueType::kF32, one_more, 3, "payload_bytes"},
      {"nnz says 2", Format::kCoo, ValueType::kF32, good, 2, "payload_bytes"},
      {"nnz says 4", Format::kCoo, ValueType::kF32, good, 4, "payload_bytes"},
      {"nnz above dense length", Format::kCoo, ValueType::kF32,
       coo_payload(std::vector<uint32_t>(11, 0), std::vector<float>(11, 0.0f)), 11, "nnz"},
      {"huge nnz", Format::kCoo, ValueType::kF32, good, std::numeric_limits<uint64_t>::max(),
       "nnz"},
      {"index == dense length", Format::kCoo, ValueType::kF32,
       coo_payload({0, 3, 10}, good_value), 3, "index[2]"},
      {"index far out", Format::kCoo, ValueType::kF32,
       coo_payload({0xffffffffu, 3, 9}, good_value), 3, "index[0]"},
      {"index out but increasing", Format::kCoo, ValueType::kF32,
       coo_payload({1, 2, 4000000000u}, good_value), 3, "index[2]"},
      {"duplicate index", Format::kCoo, ValueType::kF32, coo_payload({0, 3, 3}, good_value), 3,
       "index[2]"},
      {"decreasing index", Format::kCoo, ValueType::kF32, coo_payload({5, 3, 9}, good_value), 3,
       "index[1]"},
      {"unknown format", static_cast<Format>(7), ValueType::kF32, good, 3, "format"},
      {"unknown value type", Format::kCoo, static_cast<ValueType>(9), good, 3, "value_type"},
      {"dense with nnz != length", Format::kDense, ValueType::kF32,
       std::vector<std::byte>(40), 9, "nnz"},
      {"dense truncated", Format::kDense, ValueType::kF32, std::vector<std::byte>(39), 10,
       "payload_bytes"},
      {"dense oversized", Format::kDense, ValueType::kF32, std::vector<std::byte>(44), 10,
       "payload_bytes"},
  };
  // The good payload itself decodes, so each case fails only by what it changed.
  {
    std::vector<float> out(dense_len, 1.0f);
    ASSERT_TRUE(decode_accumulate(Format::kCoo, ValueType::kF32, good, 3, out).ok());
    EXPECT_EQ(out, (std::vector<float>{2.5f, 1, 1, -1.0f, 1, 1, 1, 1, 1, 5.0f}));
  }
  for (const BadPayload& c : cases) {
    SCOPED_TRACE(c.what);
    std::vector<float> out = testing::normal_floats(dense_len, 77);
    const std::vector<float> before = out;
    const Status s = decode_accumulate(c.format, c.value_type, c.payload, c.nnz, out);
    EXPECT_EQ(s.code(), Code::kDataLoss) << s.to_string();
    EXPECT_NE(s.message().find(c.field), std::string::npos) << s.message();
    EXPECT_EQ(std::memcmp(out.data(), before.data(), dense_len * sizeof(float)), 0);
  }
}

TEST(kernelsCodec, DecodeOfRandomBytesNeverWritesOnError) {
  // Random payloads: most are rejected; whatever is accepted must be a valid COO selection.
  std::mt19937_64 rng(99);
  for (int round = 0; round < 2000; ++round) {
    const size_t dense_len = rng() % 64;
    const size_t nnz = rng() % 8;
    std::vector<std::byte> payload(nnz * 8 + (rng() % 4 == 0 ? rng() % 3 : 0));
    for (auto& b : payload) b = static_cast<std::byte>(rng() % 4 == 0 ? rng() : rng() % 8);
    std::vector<float> out(dense_len, 0.0f);
    const Status s = decode_accumulate(Format::kCoo, ValueType::kF32, payload, nnz, out);
    if (!s.ok()) {
      for (float v : out) ASSERT_EQ(v, 0.0f);
      continue;
    }
    ASSERT_EQ(payload.size(), nnz * 8);
    ASSERT_LE(nnz, dense_len);
  }
}

}  // namespace
}  // namespace sparsecar::kernels
