// LargeVector: alignment, contents, and the huge-page advice as the kernel records it
// (/proc/self/smaps shows `hg` in VmFlags for a range given MADV_HUGEPAGE).
#include "sparsecar/common/large_vector.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <fstream>
#include <sstream>
#include <string>

namespace sparsecar {
namespace {

// The VmFlags line of the mapping that contains `p`, or "" when not found.
std::string vm_flags_of(const void* p) {
  std::ifstream smaps("/proc/self/smaps");
  const auto addr = reinterpret_cast<uintptr_t>(p);
  std::string line;
  bool inside = false;
  while (std::getline(smaps, line)) {
    uintptr_t lo = 0;
    uintptr_t hi = 0;
    char dash = 0;
    std::istringstream head(line);
    if (head >> std::hex >> lo >> dash >> hi && dash == '-') {
      inside = lo <= addr && addr < hi;
      continue;
    }
    if (inside && line.rfind("VmFlags:", 0) == 0) return line;
  }
  return "";
}

bool thp_configurable() {
  std::ifstream f("/sys/kernel/mm/transparent_hugepage/enabled");
  std::string mode;
  std::getline(f, mode);
  return mode.find("[never]") == std::string::npos && !mode.empty();
}

TEST(commonLargeVector, LargeAllocationsAreHugePageAlignedAndZeroed) {
  const size_t n = (size_t{3} << 20) / sizeof(float) + 5;  // a bit over 3 MiB
  LargeVector<float> v(n);
  ASSERT_EQ(v.size(), n);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(v.data()) % detail::kHugePageBytes, 0u);
  for (size_t i = 0; i < n; ++i) ASSERT_EQ(v[i], 0.0f) << i;
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<float>(i % 1000);
  double sum = 0;
  for (float x : v) sum += x;
  // sum of i % 1000 over n elements, by formula
  const size_t full = n / 1000;
  const size_t rest = n % 1000;
  EXPECT_EQ(sum, static_cast<double>(full) * 499500.0 + static_cast<double>(rest * (rest - 1) / 2));
}

TEST(commonLargeVector, SmallAllocationsAreCacheLineAligned) {
  for (size_t n : {size_t{1}, size_t{17}, size_t{1000}, (size_t{2} << 20) / sizeof(float) - 1}) {
    LargeVector<float> v(n, 1.5f);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(v.data()) % 64, 0u) << n;
    EXPECT_EQ(v.back(), 1.5f);
  }
}

TEST(commonLargeVector, LargeAllocationsCarryTheHugePageAdvice) {
  if (!thp_configurable()) GTEST_SKIP() << "transparent huge pages are off on this kernel";
  LargeVector<float> v((size_t{4} << 20) / sizeof(float));
  const std::string flags = vm_flags_of(v.data());
  ASSERT_FALSE(flags.empty()) << "no mapping found for the buffer in /proc/self/smaps";
  EXPECT_NE(flags.find(" hg"), std::string::npos) << flags;
}

TEST(commonLargeVector, GrowsAcrossTheThresholdAndKeepsContents) {
  LargeVector<uint32_t> v;
  for (uint32_t i = 0; i < (1u << 20); ++i) v.push_back(i * 3u);  // 4 MiB: crosses 2 MiB
  for (uint32_t i = 0; i < (1u << 20); ++i) ASSERT_EQ(v[i], i * 3u);
}

}  // namespace
}  // namespace sparsecar
