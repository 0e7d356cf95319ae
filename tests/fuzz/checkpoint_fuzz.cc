// libFuzzer target: the residual checkpoint reader (daemon/pipeline/checkpoint.h,
// parse_checkpoint), on the bytes of a file that `sparsecarctl restore` is pointed at.
//
// Input: byte 0 = mode, the rest is the file.
//   bit 0: re-seal the trailing CRC-32C first, so mutations get past the checksum;
//   bit 1: the registered tensors are the ones the file itself declares (names and counts read
//          leniently, counts capped at 2^20), so the entry checks can pass; else bits 4-5 pick a
//          fixed set (the seeds' tensors);
//   bit 2: rank and world size are the file's own; else those of the seeds (rank 1 of 4).
// Properties checked beyond "no crash, no sanitizer report":
//   - errors are DATA_LOSS or FAILED_PRECONDITION, with a message;
//   - an accepted checkpoint matches the registered tensors: one offset per tensor, each
//     entry's name and count are the tensor's right before its offset, the residuals tile the
//     file up to the CRC, its size is checkpoint_bytes(tensors), and encode_checkpoint of what
//     was parsed (the real writer) gives back the same bytes.
// Allocation: the ctest runs it with -rss_limit_mb=512 and -malloc_limit_mb=64, so an allocation
// sized from a declared length would be reported.
// Built by the clang fuzz project (tests/fuzz/CMakeLists.txt: fuzz_checkpoint); seeds in
// corpus/checkpoint/ (written by fuzz_make_parser_seeds with encode_checkpoint).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <vector>

#include "daemon/pipeline/checkpoint.h"
#include "sparsecar/kernels/codec.h"

namespace {

using sparsecar::Code;
using sparsecar::TensorSpec;

#define CHECK(cond)                \
  do {                             \
    if (!(cond)) __builtin_trap(); \
  } while (0)

constexpr uint32_t kSeedRank = 1;  // make_parser_seeds.cc writes rank 1 of 4
constexpr uint32_t kSeedWorld = 4;
constexpr uint64_t kMaxDeclaredCount = uint64_t{1} << 20;
constexpr size_t kMaxDeclaredTensors = 64;

template <typename T>
T get(const std::string& s, size_t at) {
  T v{};
  std::memcpy(&v, s.data() + at, sizeof v);
  return v;
}

// The seeds' tensor sets (make_parser_seeds.cc checkpoint()).
std::vector<TensorSpec> fixed_specs(int which) {
  switch (which) {
    case 0:
      return {{"w", 100}};
    case 1:
      return {{"layer1.weight", 64}, {"layer1.bias", 8}, {"head.weight", 0}};
    case 2:
      return {{"embedding.weight", 1000}};
    default:
      return {{"", 1}, {"a", 1}};
  }
}

// The tensors the file declares, read leniently (stops at the first entry that does not fit).
std::vector<TensorSpec> declared_specs(const std::string& file) {
  std::vector<TensorSpec> specs;
  if (file.size() < sparsecar::kCheckpointHeaderBytes + 4) return specs;
  const uint32_t count = get<uint32_t>(file, 12);
  const size_t end = file.size() - 4;
  size_t pos = sparsecar::kCheckpointHeaderBytes;
  for (uint32_t i = 0; i < count && specs.size() < kMaxDeclaredTensors; ++i) {
    if (end - pos < 4) break;
    const uint32_t len = get<uint32_t>(file, pos);
    pos += 4;
    if (end - pos < len || end - pos - len < 8) break;
    TensorSpec t;
    t.name = file.substr(pos, len);
    pos += len;
    t.count = get<uint64_t>(file, pos) % (kMaxDeclaredCount + 1);
    pos += 8;
    specs.push_back(std::move(t));
    if ((end - pos) / 4 < specs.back().count) break;
    pos += specs.back().count * 4;
  }
  return specs;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t mode = data[0];
  std::string file(reinterpret_cast<const char*>(data + 1), size - 1);
  if ((mode & 1) && file.size() >= 4) {
    const uint32_t crc = sparsecar::kernels::crc32c(0, file.data(), file.size() - 4);
    std::memcpy(file.data() + file.size() - 4, &crc, 4);
  }
  const std::vector<TensorSpec> specs = (mode & 2) ? declared_specs(file) : fixed_specs((mode >> 4) & 3);
  uint32_t rank = kSeedRank, world = kSeedWorld;
  if ((mode & 4) && file.size() >= sparsecar::kCheckpointHeaderBytes) {
    rank = get<uint32_t>(file, 24);
    world = get<uint32_t>(file, 28);
  }

  auto parsed = sparsecar::parse_checkpoint(file, specs, rank, world, "fuzz checkpoint");
  if (!parsed.ok()) {
    const Code code = parsed.status().code();
    CHECK(code == Code::kDataLoss || code == Code::kFailedPrecondition);
    CHECK(parsed.status().message().find("fuzz checkpoint") != std::string::npos);
    return 0;
  }
  const sparsecar::LoadedCheckpoint& ck = *parsed;
  CHECK(ck.bytes == file);
  CHECK(ck.offsets.size() == specs.size());
  CHECK(file.size() == sparsecar::checkpoint_bytes(specs));
  CHECK(get<uint32_t>(file, 8) == sparsecar::kCheckpointVersion);
  CHECK(get<uint32_t>(file, 12) == specs.size());
  CHECK(get<uint32_t>(file, 24) == rank && get<uint32_t>(file, 28) == world);
  CHECK(ck.job_id == get<uint64_t>(file, 16));
  // Each entry: name length, name, count, then the residual at the offset; entries tile the file.
  size_t pos = sparsecar::kCheckpointHeaderBytes;
  std::vector<std::vector<float>> residuals;
  std::vector<sparsecar::CheckpointEntry> entries;
  residuals.reserve(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    const TensorSpec& t = specs[i];
    CHECK(get<uint32_t>(file, pos) == t.name.size());
    CHECK(file.compare(pos + 4, t.name.size(), t.name) == 0);
    CHECK(get<uint64_t>(file, pos + 4 + t.name.size()) == t.count);
    CHECK(ck.offsets[i] == pos + 4 + t.name.size() + 8);
    std::vector<float>& r = residuals.emplace_back(t.count);
    if (t.count > 0) std::memcpy(r.data(), file.data() + ck.offsets[i], t.count * sizeof(float));
    entries.push_back({t.name, r});
    pos = ck.offsets[i] + t.count * sizeof(float);
  }
  CHECK(pos == file.size() - 4);
  // The real writer, given what was parsed, writes the same bytes.
  CHECK(sparsecar::encode_checkpoint(ck.job_id, rank, world, entries) == file);
  return 0;
}
