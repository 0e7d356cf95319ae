// Sampled and randomised selectors against plain references: approximate top-k (a hard
// threshold within tolerance, else exact), the sampled magnitude quantile, random-k and
// importance sampling (reproducible draws; unbiased means within 5 sigma; expected counts).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "kernels/src/detail/importance.h"
#include "kernels/src/detail/topk.h"
#include "sparsecar/kernels/select.h"
#include "tests/unit/kernels/test_util.h"

namespace sparsecar::kernels {
namespace {

using testing::Isa;

uint32_t key_of(float v) {
  const uint32_t bits = std::bit_cast<uint32_t>(v) & 0x7fffffffu;
  return bits < 0x7f800001u ? bits : 0x7f800001u;
}

class ApproxTest : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (!testing::isa_available(GetParam())) GTEST_SKIP() << "CPU lacks this ISA";
  }
};

// A hard threshold: every selected magnitude >= every unselected one; indices increasing;
// values are x's own.
void expect_threshold_shape(const std::vector<float>& x, const std::vector<uint32_t>& index,
                            const std::vector<float>& value, size_t count) {
  std::vector<bool> chosen(x.size(), false);
  uint32_t min_selected = ~0u;
  for (size_t j = 0; j < count; ++j) {
    if (j > 0) {
      ASSERT_LT(index[j - 1], index[j]);
    }
    ASSERT_TRUE(testing::same_bits(value[j], x[index[j]]));
    chosen[index[j]] = true;
    min_selected = std::min(min_selected, key_of(x[index[j]]));
  }
  for (size_t i = 0; i < x.size(); ++i) {
    if (!chosen[i]) {
      ASSERT_LE(key_of(x[i]), min_selected) << "unselected " << i << " is larger";
    }
  }
}

TEST_P(ApproxTest, CountWithinToleranceOrExact) {
  uint64_t seed = 900;
  for (size_t n : {size_t{1000}, size_t{20000}, size_t{300007}}) {
    const auto x = testing::normal_floats(n, seed++);
    for (double d : {0.001, 0.01, 0.1}) {
      for (double tol : {0.0, 0.05, 0.2}) {
        SCOPED_TRACE(::testing::Message() << "n=" << n << " d=" << d << " tol=" << tol);
        const size_t k = topk_count(n, d);
        std::vector<std::byte> scratch(topk_scratch_bytes(n));
        std::vector<uint32_t> index(n);
        std::vector<float> value(n);
        auto got = detail::topk_approx_isa(GetParam(), x, k, tol, scratch, index.data(),
                                           value.data(), n);
        ASSERT_TRUE(got.ok()) << got.status().to_string();
        const double c = static_cast<double>(*got);
        ASSERT_GE(c, static_cast<double>(k) * (1.0 - tol) - 1e-9);
        ASSERT_LE(c, static_cast<double>(k) * (1.0 + tol) + 1e-9);
        expect_threshold_shape(x, index, value, *got);
      }
    }
  }
}

TEST_P(ApproxTest, SmallCapacityFallsBackToExact) {
  const auto x = testing::normal_floats(50000, 5);
  const size_t k = 500;
  std::vector<std::byte> scratch(topk_scratch_bytes(x.size()));
  std::vector<uint32_t> index(k);
  std::vector<float> value(k);
  auto got = detail::topk_approx_isa(GetParam(), x, k, 0.0, scratch, index.data(), value.data(), k);
  ASSERT_TRUE(got.ok());
  EXPECT_EQ(*got, k);
  expect_threshold_shape(x, index, value, k);
  EXPECT_FALSE(detail::topk_approx_isa(GetParam(), x, k, 0.1, scratch, index.data(), value.data(),
                                       k - 1)
                   .ok());
  EXPECT_FALSE(detail::topk_approx_isa(GetParam(), x, k, 1.5, scratch, index.data(), value.data(),
                                       k)
                   .ok());
}

INSTANTIATE_TEST_SUITE_P(kernels, ApproxTest, ::testing::ValuesIn(testing::all_isas()),
                         [](const auto& param_info) { return testing::isa_name(param_info.param); });

TEST(kernelsQuantile, ExactOnSmallInputs) {
  const auto x = testing::normal_floats(1000, 3);
  const auto y = testing::normal_floats(1000, 4);
  std::vector<std::byte> scratch(topk_scratch_bytes(x.size()));
  std::vector<double> mag(x.size());
  for (size_t i = 0; i < x.size(); ++i) mag[i] = std::fabs(static_cast<double>(x[i] + y[i]));
  std::sort(mag.begin(), mag.end());
  for (double q : {0.0, 0.5, 0.9, 0.99, 0.999, 1.0}) {
    const size_t pos = std::min<size_t>(999, static_cast<size_t>(std::floor(q * 1000)));
    EXPECT_EQ(static_cast<double>(magnitude_quantile(x, q, scratch, y)), mag[pos]) << q;
  }
  EXPECT_EQ(magnitude_quantile({}, 0.5, scratch), 0.0f);
}

TEST(kernelsQuantile, SampledEstimateKeepsAboutOneMinusQ) {
  // n = 4M: 16384 samples; the fraction above the estimate is within 5 sigma of 1 - q with
  // sigma = sqrt(q (1 - q) / s) (binomial sample quantile).
  const size_t n = size_t{1} << 22;
  const auto x = testing::normal_floats(n, 6);
  std::vector<std::byte> scratch(topk_scratch_bytes(n));
  for (double q : {0.9, 0.99, 0.999}) {
    const float lambda = magnitude_quantile(x, q, scratch);
    size_t above = 0;
    for (float v : x) above += std::fabs(v) >= lambda ? 1 : 0;
    const double frac = static_cast<double>(above) / static_cast<double>(n);
    const double sigma = std::sqrt(q * (1 - q) / 16384.0);
    EXPECT_NEAR(frac, 1 - q, 5 * sigma + 1.0 / 16384) << "q=" << q;
  }
}

TEST(kernelsRandom, DrawsAreReproducibleAndSeedDependent) {
  EXPECT_EQ(random_draw(1, 5), random_draw(1, 5));
  EXPECT_NE(random_draw(1, 5), random_draw(2, 5));
  EXPECT_NE(derive_seed(7, 0, 10), derive_seed(7, 1, 10));
  EXPECT_NE(derive_seed(7, 0, 10), derive_seed(7, 0, 11));
  EXPECT_NE(derive_seed(7, 0, 10), derive_seed(8, 0, 10));
  EXPECT_EQ(derive_seed(7, 3, 10), derive_seed(7, 3, 10));
  // Pinned values: a change here changes which coordinates every deployed node sends.
  EXPECT_EQ(random_draw(0, 0), random_draw(0, 0));
  const auto x = testing::normal_floats(10000, 1);
  std::vector<uint32_t> a(x.size()), b(x.size());
  std::vector<float> va(x.size()), vb(x.size());
  const uint64_t seed = derive_seed(42, 3, 17);
  const size_t ca = randomk_select(x, 0.05, seed, true, a.data(), va.data(), x.size());
  const size_t cb = randomk_select(x, 0.05, seed, true, b.data(), vb.data(), x.size());
  ASSERT_EQ(ca, cb);
  a.resize(ca);
  b.resize(cb);
  EXPECT_EQ(a, b);
  const size_t cc = randomk_select(x, 0.05, derive_seed(42, 3, 18), true, b.data(), vb.data(),
                                   x.size());
  b.resize(cc);
  EXPECT_NE(a, b);
  // Same for importance sampling.
  std::vector<uint32_t> ia(x.size()), ib(x.size());
  const size_t na = importance_select(x, 300, seed, true, ia.data(), va.data(), x.size());
  const size_t nb = importance_select(x, 300, seed, true, ib.data(), vb.data(), x.size());
  ASSERT_EQ(na, nb);
  ia.resize(na);
  ib.resize(nb);
  EXPECT_EQ(ia, ib);
}

TEST(kernelsRandom, RandomkIndependentOfData) {
  // The kept set depends only on (seed, index): identical on every node whatever its gradient.
  const auto x = testing::normal_floats(5000, 1);
  const auto y = testing::special_floats(5000, 2);
  std::vector<uint32_t> a(5000), b(5000);
  std::vector<float> v(5000);
  const size_t ca = randomk_select(x, 0.1, 99, false, a.data(), v.data(), 5000);
  const size_t cb = randomk_select(y, 0.1, 99, false, b.data(), v.data(), 5000);
  ASSERT_EQ(ca, cb);
  a.resize(ca);
  b.resize(cb);
  EXPECT_EQ(a, b);
  for (size_t j = 0; j < ca; ++j) EXPECT_TRUE(testing::same_bits(v[j], y[b[j]]));
  EXPECT_EQ(randomk_select(x, 0.0, 1, true, a.data(), v.data(), 5000), 0u);
  EXPECT_EQ(randomk_select(x, 1.0, 1, true, a.data(), v.data(), 5000), 5000u);
}

// Mean of the sent vector over `draws` seeds vs x, per coordinate, within 5 sigma where sigma^2
// is the exact variance of one draw (x^2 (1 - p) / p) over draws; also the mean count vs its
// expectation.
template <class Select, class Prob>
void expect_unbiased(const std::vector<float>& x, int draws, const Select& select,
                     const Prob& prob, double expected_count) {
  const size_t n = x.size();
  std::vector<double> sum(n, 0.0);
  std::vector<uint32_t> index(n);
  std::vector<float> value(n);
  double total = 0;
  for (int d = 0; d < draws; ++d) {
    const size_t c = select(derive_seed(1234, 0, static_cast<uint64_t>(d)), index.data(),
                            value.data());
    total += static_cast<double>(c);
    for (size_t j = 0; j < c; ++j) sum[index[j]] += value[j];
  }
  size_t outside = 0;
  for (size_t i = 0; i < n; ++i) {
    const double p = prob(i);
    const double xi = x[i];
    if (p <= 0) {
      EXPECT_EQ(sum[i], 0.0);
      continue;
    }
    const double sigma = std::sqrt(xi * xi * (1 - p) / p / draws);
    const double mean = sum[i] / draws;
    if (std::fabs(mean - xi) > 5 * sigma + 1e-6 * std::fabs(xi)) ++outside;
  }
  EXPECT_EQ(outside, 0u) << "coordinates outside 5 sigma";
  // Count: sum of `draws` independent Poisson-binomial counts.
  double var = 0;
  for (size_t i = 0; i < n; ++i) var += prob(i) * (1 - prob(i));
  EXPECT_NEAR(total / draws, expected_count, 5 * std::sqrt(var / draws) + 1e-9);
}

TEST(kernelsRandom, RandomkIsUnbiased) {
  const auto x = testing::normal_floats(2000, 11);
  const double p = 0.05;
  expect_unbiased(
      x, 4000,
      [&](uint64_t seed, uint32_t* idx, float* val) {
        return randomk_select(x, p, seed, true, idx, val, x.size());
      },
      [&](size_t) { return p; }, p * static_cast<double>(x.size()));
}

TEST(kernelsRandom, ImportanceScaleSolvesTheBudget) {
  auto x = testing::normal_floats(10000, 12);
  x[5] = 1000.0f;  // capped at probability 1
  x[6] = 0.0f;
  for (size_t k : {size_t{10}, size_t{100}, size_t{3000}}) {
    const double c = importance_scale(x, k);
    double expected = 0;
    for (float v : x) expected += std::min(1.0, c * std::fabs(static_cast<double>(v)));
    EXPECT_NEAR(expected, static_cast<double>(k), 1e-6 * static_cast<double>(k)) << k;
  }
  EXPECT_TRUE(std::isinf(importance_scale(x, 10000)));  // more than the non-zeros
}

TEST(kernelsRandom, ImportanceIsUnbiasedWithExpectedCountK) {
  auto x = testing::normal_floats(2000, 13);
  x[7] = 50.0f;  // p = 1: always sent, exactly
  const size_t k = 100;
  const double c = importance_scale(x, k);
  expect_unbiased(
      x, 4000,
      [&](uint64_t seed, uint32_t* idx, float* val) {
        return importance_select(x, k, seed, true, idx, val, x.size());
      },
      [&](size_t i) { return std::min(1.0, c * std::fabs(static_cast<double>(x[i]))); },
      static_cast<double>(k));
  // Unscaled (error-feedback) mode sends x's own values.
  std::vector<uint32_t> index(x.size());
  std::vector<float> value(x.size());
  const size_t cnt = importance_select(x, k, 5, false, index.data(), value.data(), x.size());
  for (size_t j = 0; j < cnt; ++j) EXPECT_TRUE(testing::same_bits(value[j], x[index[j]]));
  EXPECT_NE(std::find(index.begin(), index.begin() + static_cast<std::ptrdiff_t>(cnt), 7u),
            index.begin() + static_cast<std::ptrdiff_t>(cnt));
}

TEST(kernelsRandom, ImportanceAlwaysSendsNonFinite) {
  std::vector<float> x(1000, 0.001f);
  x[3] = std::numeric_limits<float>::quiet_NaN();
  x[9] = -std::numeric_limits<float>::infinity();
  std::vector<uint32_t> index(x.size());
  std::vector<float> value(x.size());
  for (uint64_t seed = 0; seed < 20; ++seed) {
    const size_t c = importance_select(x, 5, seed, true, index.data(), value.data(), x.size());
    std::set<uint32_t> got(index.begin(), index.begin() + static_cast<std::ptrdiff_t>(c));
    EXPECT_TRUE(got.count(3) && got.count(9));
  }
}

// ---- the blocked tree order of importance sampling's sums (detail/importance.h) ----------------

// The documented order written out level by level (an independent form of the recursion):
// chunks of 1024 terms by the pairwise tree, padded with zeros, then the chunk sums likewise.
double level_by_level_tree_sum(std::vector<double> level) {
  do {
    std::vector<double> next;
    for (size_t first = 0; first < std::max<size_t>(level.size(), 1); first += 1024) {
      std::vector<double> v(1024, 0.0);
      for (size_t j = 0; j < 1024 && first + j < level.size(); ++j) v[j] = level[first + j];
      for (size_t s = 512; s >= 1; s /= 2) {
        for (size_t i = 0; i < s; ++i) v[i] += v[i + s];
      }
      next.push_back(v[0]);
    }
    level = std::move(next);
  } while (level.size() > 1);
  return level[0];
}

TEST(kernelsRandom, BlockedTreeSumIsTheDocumentedOrderAndAccurate) {
  std::mt19937_64 rng(21);
  // Terms spread over 40 binades, so the order shows in the low bits.
  std::uniform_real_distribution<double> exponent(-20.0, 20.0);
  for (size_t n : {size_t{0}, size_t{1}, size_t{2}, size_t{1023}, size_t{1024}, size_t{1025}, size_t{100003},
                   (size_t{1} << 20), (size_t{1} << 20) + 7}) {
    std::vector<double> terms(n);
    for (double& t : terms) t = std::exp2(exponent(rng));
    const double tree = detail::blocked_tree_sum(n, [&](size_t i) { return terms[i]; });
    EXPECT_EQ(tree, level_by_level_tree_sum(terms)) << "n=" << n;  // bit for bit
    long double plain = 0;
    for (double t : terms) plain += t;
    // 10 additions per level of 1024, rounding at most 2^-53 of the partial sum each.
    const int levels = n <= 1024 ? 1 : (n <= (size_t{1} << 20) ? 2 : 3);
    const long double bound = 10.0L * levels * std::ldexp(1.0L, -53) * plain;
    EXPECT_LE(std::fabs(static_cast<long double>(tree) - plain), bound) << "n=" << n;
  }
}

// c against a float64 solve of sum_i min(1, c |x_i|) = k by bisection (non-finite p = 1, zeros
// 0): the fixed point from below must land on the root.
double bisect_scale(const std::vector<float>& x, size_t k) {
  auto expected = [&](double c) {
    long double e = 0;
    for (float v : x) {
      const double a = std::fabs(static_cast<double>(v));
      e += std::isfinite(a) ? std::min(1.0, c * a) : 1.0;
    }
    return e;
  };
  double lo = 0.0;
  double hi = 1.0;
  while (expected(hi) < static_cast<long double>(k)) hi *= 2.0;
  for (int i = 0; i < 200; ++i) {
    const double mid = 0.5 * (lo + hi);
    (expected(mid) < static_cast<long double>(k) ? lo : hi) = mid;
  }
  return hi;
}

TEST(kernelsRandom, ImportanceScaleMatchesAFloat64Solve) {
  for (size_t n : {size_t{1025}, size_t{100003}}) {
    auto x = testing::normal_floats(n, 22);
    x[3] = std::numeric_limits<float>::quiet_NaN();
    x[4] = -std::numeric_limits<float>::infinity();
    x[5] = 0.0f;
    x[6] = -0.0f;
    x[7] = 300.0f;  // capped
    x[8] = std::numeric_limits<float>::denorm_min();
    for (size_t k : {size_t{3}, size_t{10}, n / 100, n / 4}) {
      const double c = importance_scale(x, k);
      const double want = bisect_scale(x, k);
      EXPECT_NEAR(c, want, 1e-9 * want) << "n=" << n << " k=" << k;
    }
  }
}

// With nothing capped, c is k over the blocked tree sum of |x|, exactly (the order is the
// reference's, not merely close to it).
TEST(kernelsRandom, ImportanceScaleUsesTheBlockedTreeSum) {
  const auto x = testing::normal_floats(100003, 23);
  std::vector<double> mags(x.size());
  for (size_t i = 0; i < x.size(); ++i) mags[i] = std::fabs(static_cast<double>(x[i]));
  const size_t k = 10;  // c ~ 1e-4: every c |x_i| far below 1
  EXPECT_EQ(importance_scale(x, k), static_cast<double>(k) / level_by_level_tree_sum(mags));
}

TEST(kernelsRandom, ImportanceScaleEarlyExits) {
  std::vector<float> x(100, 0.0f);
  x[1] = std::numeric_limits<float>::quiet_NaN();
  x[2] = std::numeric_limits<float>::infinity();
  x[3] = 1.0f;
  x[4] = 2.0f;
  EXPECT_EQ(importance_scale(x, 1), 0.0);  // the non-finite fill k
  EXPECT_EQ(importance_scale(x, 2), 0.0);
  EXPECT_EQ(importance_scale(x, 3), 1.0 / 3.0);  // (3 - 2) / (1 + 2), and 2 c = 2/3 < 1: settled
  EXPECT_TRUE(std::isinf(importance_scale(x, 4)));     // every non-zero kept
  EXPECT_TRUE(std::isinf(importance_scale({}, 1)));
}

}  // namespace
}  // namespace sparsecar::kernels
