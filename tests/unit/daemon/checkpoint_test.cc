// The residual checkpoint format, byte by byte (daemon/pipeline/CHECKPOINT.md): the golden bytes
// are built here from the spec — little-endian integers, IEEE-754 float bits, and a CRC-32C from
// a plain bitwise reference — not from the writer.
#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "daemon/pipeline/checkpoint.h"

namespace sparsecar {
namespace {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78, initial and final XOR 0xFFFFFFFF), one bit
// at a time: the slow reference.
uint32_t crc32c_reference(const std::string& bytes) {
  uint32_t crc = 0xFFFFFFFFu;
  for (unsigned char byte : bytes) {
    crc ^= byte;
    for (int bit = 0; bit < 8; ++bit) crc = (crc & 1u) ? (crc >> 1) ^ 0x82F63B78u : crc >> 1;
  }
  return crc ^ 0xFFFFFFFFu;
}

std::string le(uint64_t v, int bytes) {
  std::string out;
  for (int i = 0; i < bytes; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
  return out;
}

TEST(CheckpointFormat, TheCrcReferenceIsCrc32c) {
  EXPECT_EQ(crc32c_reference("123456789"), 0xE3069283u);  // the published CRC-32C check value
}

TEST(CheckpointFormat, GoldenBytesOfTwoTensors) {
  // Tensor "w" = {1.0, -2.5}, tensor "bias" = {0.5}; job 0x0102030405060708, rank 2 of 3.
  std::string golden = "SCRESID1";
  golden += le(1, 4);                   // version
  golden += le(2, 4);                   // tensors
  golden += le(0x0102030405060708, 8);  // job id
  golden += le(2, 4) + le(3, 4);        // rank, world size
  golden += le(1, 4) + "w" + le(2, 8) + le(0x3F800000, 4) + le(0xC0200000, 4);
  golden += le(4, 4) + "bias" + le(1, 8) + le(0x3F000000, 4);
  golden += le(crc32c_reference(golden), 4);

  const std::vector<float> w = {1.0f, -2.5f};
  const std::vector<float> bias = {0.5f};
  const std::vector<CheckpointEntry> entries = {{"w", w}, {"bias", bias}};
  const std::string bytes = encode_checkpoint(0x0102030405060708, 2, 3, entries);
  EXPECT_EQ(bytes, golden);

  const std::vector<TensorSpec> specs = {{"w", 2}, {"bias", 1}};
  EXPECT_EQ(checkpoint_bytes(specs), golden.size());
  auto loaded = parse_checkpoint(golden, specs, 2, 3);
  ASSERT_TRUE(loaded.ok()) << loaded.status().to_string();
  EXPECT_EQ(loaded->job_id, 0x0102030405060708u);
  ASSERT_EQ(loaded->offsets.size(), 2u);
  EXPECT_EQ(loaded->offsets[0], 32u + 4 + 1 + 8);
  EXPECT_EQ(loaded->offsets[1], 32u + 4 + 1 + 8 + 8 + 4 + 4 + 8);
}

TEST(CheckpointFormat, EveryFlippedByteIsRefused) {
  const std::vector<float> w = {1.0f, -2.5f, 3.0f};
  const std::vector<CheckpointEntry> entries = {{"w", w}};
  const std::string good = encode_checkpoint(9, 0, 2, entries);
  const std::vector<TensorSpec> specs = {{"w", 3}};
  ASSERT_TRUE(parse_checkpoint(good, specs, 0, 2).ok());
  for (size_t i = 0; i < good.size(); ++i) {
    std::string bad = good;
    bad[i] = static_cast<char>(bad[i] ^ 0x10);
    EXPECT_FALSE(parse_checkpoint(bad, specs, 0, 2).ok()) << "byte " << i;
  }
  EXPECT_FALSE(parse_checkpoint(good, specs, 1, 2).ok()) << "another rank's checkpoint";
  EXPECT_FALSE(parse_checkpoint(good + "x", specs, 0, 2).ok()) << "trailing byte";
}

}  // namespace
}  // namespace sparsecar
