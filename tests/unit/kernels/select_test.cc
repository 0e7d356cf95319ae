// Top-k and threshold selection against slow references: a full stable sort for top-k, a plain
// loop for threshold. Every test runs on each ISA variant (portable, AVX-512).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "kernels/src/detail/topk.h"
#include "sparsecar/kernels/select.h"
#include "tests/unit/kernels/test_util.h"

namespace sparsecar::kernels {
namespace {

using testing::all_isas;
using testing::Isa;
using testing::same_bits;

// The documented order: any NaN is above every number and NaNs tie with each other; otherwise
// by |x| in float64 (so -0 == +0, and denormals order like their values).
bool ref_larger(float a, float b) {
  const bool na = std::isnan(a);
  const bool nb = std::isnan(b);
  if (na != nb) return na;
  if (na) return false;
  return std::fabs(static_cast<double>(a)) > std::fabs(static_cast<double>(b));
}

// The k largest by ref_larger, ties to the lower index, returned in increasing index order.
std::vector<uint32_t> ref_topk(const std::vector<float>& x, size_t k) {
  std::vector<uint32_t> order(x.size());
  std::iota(order.begin(), order.end(), 0u);
  std::stable_sort(order.begin(), order.end(),
                   [&](uint32_t a, uint32_t b) { return ref_larger(x[a], x[b]); });
  order.resize(std::min(k, x.size()));
  std::sort(order.begin(), order.end());
  return order;
}

bool ref_selected(float v, float lambda) {
  return std::isnan(v) || std::fabs(static_cast<double>(v)) >= static_cast<double>(lambda);
}

class SelectTest : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (!testing::isa_available(GetParam())) GTEST_SKIP() << "CPU lacks this ISA";
  }

  // Runs top-k with exactly-sized outputs (so ASan sees any overrun) and a deliberately
  // misaligned scratch, and compares with the sort.
  void check_topk(const std::vector<float>& x, size_t k, const char* what) {
    SCOPED_TRACE(::testing::Message() << what << " n=" << x.size() << " k=" << k);
    const size_t m = std::min(k, x.size());
    std::vector<std::byte> scratch_store(topk_scratch_bytes(x.size()) + 1);
    std::span<std::byte> scratch(scratch_store.data() + 1, topk_scratch_bytes(x.size()));
    std::vector<uint32_t> index(m);
    std::vector<float> value(m);
    auto got = detail::topk_exact_isa(GetParam(), x, k, scratch, index.data(), value.data());
    ASSERT_TRUE(got.ok()) << got.status().to_string();
    ASSERT_EQ(*got, m);
    const std::vector<uint32_t> want = ref_topk(x, k);
    ASSERT_EQ(index, want);
    for (size_t j = 0; j < m; ++j) {
      ASSERT_TRUE(same_bits(value[j], x[index[j]])) << "value " << j << " of index " << index[j];
    }
    // Outputs with room for n entries (as the daemon passes): the in-place variant.
    std::vector<uint32_t> big_index(x.size() + 1);
    std::vector<float> big_value(x.size() + 1);
    auto big = detail::topk_exact_isa(GetParam(), x, k, scratch, big_index.data(), big_value.data(),
                                      nullptr, x.size() + 1);
    ASSERT_TRUE(big.ok()) << big.status().to_string();
    ASSERT_EQ(*big, m);
    big_index.resize(m);
    ASSERT_EQ(big_index, want) << "capacity n";
    for (size_t j = 0; j < m; ++j) ASSERT_TRUE(same_bits(big_value[j], value[j])) << "capacity n, value " << j;
  }
};

std::vector<size_t> ks_for(size_t n) {
  std::vector<size_t> ks = {0, 1, 2, n / 2, n, n + 7};
  if (n >= 1) ks.push_back(n - 1);
  for (double d : {0.001, 0.01, 0.1}) ks.push_back(topk_count(n, d));
  return ks;
}

TEST_P(SelectTest, TopkMatchesSortOnNormalData) {
  uint64_t seed = 1;
  for (size_t n : {size_t{0}, size_t{1}, size_t{2}, size_t{15}, size_t{16}, size_t{17},
                   size_t{33}, size_t{1000}, size_t{4097}, size_t{100003}}) {
    const auto x = testing::normal_floats(n, seed++);
    for (size_t k : ks_for(n)) check_topk(x, k, "normal");
  }
}

TEST_P(SelectTest, TopkMatchesSortOnSpecialValuesAndTies) {
  uint64_t seed = 100;
  for (size_t n : {size_t{1}, size_t{7}, size_t{16}, size_t{31}, size_t{257}, size_t{5000}}) {
    const auto x = testing::special_floats(n, seed++);
    for (size_t k : ks_for(n)) check_topk(x, k, "special");
  }
}

TEST_P(SelectTest, TopkResolvesTheLowDigitsAndTheirTies) {
  uint64_t seed = 200;
  for (size_t n : {size_t{64}, size_t{999}, size_t{20000}}) {
    const auto x = testing::same_bin_floats(n, seed++);
    for (size_t k : ks_for(n)) check_topk(x, k, "same-bin");
  }
}

TEST_P(SelectTest, TopkTieRuleTakesLowerIndices) {
  // Hand-checked: magnitudes 3 at 1 and 4, 5 at 6 (as -5), NaN at 8; ties of 2 at 0, 3, 7.
  const float nan = std::numeric_limits<float>::quiet_NaN();
  const std::vector<float> x = {2, 0, -0.0f, 2, -3, 1, -5, -2, nan, 3};
  check_topk(x, 1, "nan first");
  check_topk(x, 5, "k=5");
  std::vector<std::byte> scratch(topk_scratch_bytes(x.size()));
  std::vector<uint32_t> index(6);
  std::vector<float> value(6);
  auto got = detail::topk_exact_isa(GetParam(), x, 6, scratch, index.data(), value.data());
  ASSERT_TRUE(got.ok());
  // NaN(8), -5(6), -3(4), 3(9), then two of the three 2s: indices 0 and 3 (not 7).
  EXPECT_EQ(index, (std::vector<uint32_t>{0, 3, 4, 6, 8, 9}));
}

TEST_P(SelectTest, TopkAllEqualAndAllZero) {
  for (float fill : {0.0f, -0.0f, 1.5f, std::numeric_limits<float>::infinity()}) {
    const std::vector<float> x(1000, fill);
    for (size_t k : {size_t{1}, size_t{10}, size_t{999}}) check_topk(x, k, "constant");
  }
}

TEST_P(SelectTest, TopkRandomSizes) {
  std::mt19937_64 rng(7);
  for (int round = 0; round < 60; ++round) {
    const size_t n = std::uniform_int_distribution<size_t>(0, 3000)(rng);
    const size_t k = std::uniform_int_distribution<size_t>(0, n + 2)(rng);
    auto x = (round % 3 == 0)   ? testing::special_floats(n, rng())
             : (round % 3 == 1) ? testing::same_bin_floats(n, rng())
                                : testing::normal_floats(n, rng(), 1e-3f);
    check_topk(x, k, "random");
  }
}

TEST_P(SelectTest, TopkRejectsSmallScratch) {
  const auto x = testing::normal_floats(100, 3);
  std::vector<std::byte> scratch(topk_scratch_bytes(x.size()) - 1);
  std::vector<uint32_t> index(10);
  std::vector<float> value(10);
  auto got = detail::topk_exact_isa(GetParam(), x, 10, scratch, index.data(), value.data());
  ASSERT_FALSE(got.ok());
  EXPECT_EQ(got.status().code(), Code::kInvalidArgument);
  EXPECT_NE(got.status().message().find("scratch"), std::string::npos);
}

// The sampled path (n >= 32 Ki; candidates + band, compaction) from k = n/10000 up to k where
// the candidates no longer fit its scratch (0.49, 0.6: the two-pass fallback): all must equal
// the sort.
TEST_P(SelectTest, TopkSampledPathMatchesSortOnLargeInputs) {
  uint64_t seed = 500;
  for (size_t n : {size_t{32768}, size_t{100003}, size_t{262161}}) {
    const auto x = testing::normal_floats(n, seed++);
    for (double d : {0.0001, 0.001, 0.01, 0.1, 0.124, 0.126, 0.3, 0.49, 0.6}) {
      check_topk(x, topk_count(n, d), "normal-large");
    }
  }
  // Heavy exact ties and special values make the bracket miss: the fallback must still agree.
  const auto same = testing::same_bin_floats(70001, seed++);
  for (double d : {0.001, 0.05, 0.2}) check_topk(same, topk_count(same.size(), d), "same-bin");
  const auto special = testing::special_floats(65536, seed++);
  for (double d : {0.001, 0.05, 0.2}) check_topk(special, topk_count(special.size(), d), "special");
  // Mostly zeros (a sparse gradient): the k-th key may be 0 with a huge tie.
  auto sparse = testing::normal_floats(50000, seed++);
  for (size_t i = 0; i < sparse.size(); ++i) {
    if (i % 7 != 0) sparse[i] = 0.0f;
  }
  for (double d : {0.01, 0.14, 0.5}) check_topk(sparse, topk_count(sparse.size(), d), "sparse");
  // Sorted magnitudes (structure a strided sample could alias with).
  auto ramp = testing::normal_floats(40000, seed++);
  std::sort(ramp.begin(), ramp.end(), [](float a, float b) { return std::fabs(a) < std::fabs(b); });
  for (double d : {0.001, 0.02, 0.2}) check_topk(ramp, topk_count(ramp.size(), d), "ramp");
}

TEST_P(SelectTest, TopkTwoPassPathMatchesSort) {
  const auto x = testing::normal_floats(70000, 77);
  for (double d : {0.001, 0.05}) {
    const size_t k = topk_count(x.size(), d);
    std::vector<std::byte> scratch(topk_scratch_bytes(x.size()));
    std::vector<uint32_t> index(k);
    std::vector<float> value(k);
    auto got = detail::topk_exact_two_pass_isa(GetParam(), x, k, scratch, index.data(),
                                               value.data());
    ASSERT_TRUE(got.ok());
    EXPECT_EQ(index, ref_topk(x, k));
  }
}

TEST(kernelsSelect, TopkCount) {
  EXPECT_EQ(topk_count(0, 0.5), 0u);
  EXPECT_EQ(topk_count(1000, 0.001), 1u);
  EXPECT_EQ(topk_count(1000, 0.0001), 1u);  // never 0 for n > 0
  EXPECT_EQ(topk_count(1001, 0.5), 501u);  // round(500.5): halves round away from zero
  EXPECT_EQ(topk_count(3, 0.5), 2u);
  EXPECT_EQ(topk_count(1000, 0.25), 250u);
  EXPECT_EQ(topk_count(1000, 1.0), 1000u);
  EXPECT_EQ(topk_count(1000, 2.0), 1000u);
  EXPECT_EQ(topk_count(3, 0.9), 3u);
}

void check_threshold(Isa isa, const std::vector<float>& x, float lambda, size_t capacity) {
  SCOPED_TRACE(::testing::Message() << "n=" << x.size() << " lambda=" << lambda
                                    << " capacity=" << capacity);
  std::vector<uint32_t> want;
  for (size_t i = 0; i < x.size(); ++i) {
    if (!(lambda > 0.0f) || ref_selected(x[i], lambda)) want.push_back(static_cast<uint32_t>(i));
  }
  std::vector<uint32_t> index(capacity);
  std::vector<float> value(capacity);
  const size_t count =
      detail::threshold_select_isa(isa, x, lambda, index.data(), value.data(), capacity);
  ASSERT_EQ(count, want.size());
  const size_t written = std::min(count, capacity);
  for (size_t j = 0; j < written; ++j) {
    ASSERT_EQ(index[j], want[j]) << j;
    ASSERT_TRUE(same_bits(value[j], x[want[j]])) << j;
  }
}

TEST_P(SelectTest, ThresholdMatchesLoop) {
  uint64_t seed = 300;
  for (size_t n : {size_t{0}, size_t{1}, size_t{15}, size_t{16}, size_t{17}, size_t{1000},
                   size_t{65537}}) {
    const auto x = testing::normal_floats(n, seed++);
    for (float lambda : {0.5f, 2.0f, 3.29f, 100.0f}) {
      check_threshold(GetParam(), x, lambda, n);               // room for all
      check_threshold(GetParam(), x, lambda, n / 100);          // truncated
    }
    const auto s = testing::special_floats(n, seed++);
    for (float lambda : {std::numeric_limits<float>::denorm_min(), 1.0f, 2.0f,
                         std::numeric_limits<float>::infinity()}) {
      check_threshold(GetParam(), s, lambda, n);
      check_threshold(GetParam(), s, lambda, 3);
    }
  }
}

TEST_P(SelectTest, ThresholdNonPositiveLambdaSelectsEverything) {
  const auto x = testing::special_floats(100, 9);
  for (float lambda : {0.0f, -0.0f, -1.0f, std::numeric_limits<float>::quiet_NaN()}) {
    std::vector<uint32_t> index(x.size());
    std::vector<float> value(x.size());
    EXPECT_EQ(detail::threshold_select_isa(GetParam(), x, lambda, index.data(), value.data(),
                                           x.size()),
              x.size());
    for (size_t i = 0; i < x.size(); ++i) EXPECT_EQ(index[i], i);
  }
}

TEST_P(SelectTest, AddAndScale) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{16}, size_t{37}, size_t{10000}}) {
    auto a = testing::normal_floats(n, 11 + n);
    const auto b = testing::normal_floats(n, 12 + n);
    auto want = a;
    for (size_t i = 0; i < n; ++i) want[i] = a[i] + b[i];
    detail::add_isa(GetParam(), a, b);
    for (size_t i = 0; i < n; ++i) ASSERT_TRUE(same_bits(a[i], want[i])) << i;
    for (size_t i = 0; i < n; ++i) want[i] = a[i] * 0.25f;
    detail::scale_isa(GetParam(), a, 0.25f);
    for (size_t i = 0; i < n; ++i) ASSERT_TRUE(same_bits(a[i], want[i])) << i;
  }
}

TEST(kernelsSelect, ClearSelected) {
  std::vector<float> r = {1, 2, 3, 4, 5};
  const std::vector<uint32_t> idx = {0, 3, 4};
  clear_selected(r, idx);
  EXPECT_EQ(r, (std::vector<float>{0, 2, 3, 0, 0}));
}

TEST(kernelsSelect, PublicFunctionsUseAWorkingVariant) {
  const auto x = testing::same_bin_floats(5000, 21);
  std::vector<std::byte> scratch(topk_scratch_bytes(x.size()));
  std::vector<uint32_t> index(50);
  std::vector<float> value(50);
  auto got = topk_exact(x, 50, scratch, index.data(), value.data());
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(index, ref_topk(x, 50));
}

INSTANTIATE_TEST_SUITE_P(kernels, SelectTest, ::testing::ValuesIn(all_isas()),
                         [](const auto& param_info) { return testing::isa_name(param_info.param); });

}  // namespace
}  // namespace sparsecar::kernels
