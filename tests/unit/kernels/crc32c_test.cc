// CRC-32C against published vectors (RFC 3720 B.4), a bit-at-a-time reference, and the table
// path against the SSE4.2 path on random buffers, lengths and alignments.
#include <gtest/gtest.h>

#include <cstring>
#include <random>
#include <vector>

#include "kernels/src/detail/cpu.h"
#include "sparsecar/kernels/codec.h"

namespace sparsecar::kernels {
namespace {

// Textbook bitwise CRC-32C (reflected 0x82F63B78, init and final xor 0xFFFFFFFF).
uint32_t bitwise_crc32c(const unsigned char* p, size_t n) {
  uint32_t c = 0xffffffffu;
  for (size_t i = 0; i < n; ++i) {
    c ^= p[i];
    for (int b = 0; b < 8; ++b) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
  }
  return ~c;
}

TEST(kernelsCrc32c, KnownVectors) {
  EXPECT_EQ(crc32c(0, "123456789", 9), 0xE3069283u);
  EXPECT_EQ(crc32c(0, "", 0), 0u);
  unsigned char buf[32];
  std::memset(buf, 0, sizeof buf);
  EXPECT_EQ(crc32c(0, buf, 32), 0x8A9136AAu);
  std::memset(buf, 0xff, sizeof buf);
  EXPECT_EQ(crc32c(0, buf, 32), 0x62A8AB43u);
  for (int i = 0; i < 32; ++i) buf[i] = static_cast<unsigned char>(i);
  EXPECT_EQ(crc32c(0, buf, 32), 0x46DD794Eu);
  for (int i = 0; i < 32; ++i) buf[i] = static_cast<unsigned char>(31 - i);
  EXPECT_EQ(crc32c(0, buf, 32), 0x113FDB5Cu);
}

TEST(kernelsCrc32c, ChainsAcrossCalls) {
  const char* text = "sparsecar gradient payload, split anywhere";
  const size_t n = std::strlen(text);
  const uint32_t whole = crc32c(0, text, n);
  for (size_t cut = 0; cut <= n; ++cut) {
    EXPECT_EQ(crc32c(crc32c(0, text, cut), text + cut, n - cut), whole) << cut;
  }
}

TEST(kernelsCrc32c, BothPathsMatchTheBitwiseReference) {
  std::mt19937_64 rng(5);
  std::vector<unsigned char> buf(70000);
  for (auto& b : buf) b = static_cast<unsigned char>(rng());
  const bool hw = detail::has_sse42();
  for (int round = 0; round < 300; ++round) {
    const size_t offset = rng() % 16;
    const size_t len = round < 40 ? static_cast<size_t>(round) : rng() % (buf.size() - 16);
    const unsigned char* p = buf.data() + offset;
    const uint32_t want = bitwise_crc32c(p, len);
    ASSERT_EQ(~detail::crc32c_update_table(0xffffffffu, p, len), want) << len;
    if (hw) {
      ASSERT_EQ(~detail::crc32c_update_sse42(0xffffffffu, p, len), want) << len;
    }
    ASSERT_EQ(crc32c(0, p, len), want);
  }
  if (!hw) GTEST_SKIP() << "no SSE4.2: only the table path was checked";
}

}  // namespace
}  // namespace sparsecar::kernels
