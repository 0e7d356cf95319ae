// Error feedback: the fused ef_threshold against the unfused kernels and a plain loop, and
// conservation over many steps (nothing is lost: sent + residual == sum of gradients).
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "sparsecar/kernels/ef.h"
#include "sparsecar/kernels/select.h"
#include "tests/unit/kernels/test_util.h"

namespace sparsecar::kernels {
namespace {

using testing::Isa;
using testing::same_bits;

class EfTest : public ::testing::TestWithParam<Isa> {
 protected:
  void SetUp() override {
    if (!testing::isa_available(GetParam())) GTEST_SKIP() << "CPU lacks this ISA";
  }
};

struct Selection {
  std::vector<uint32_t> index;
  std::vector<float> value;
  size_t count = 0;
};

// The plain loop the fused kernel must equal: r = fl(r + g); the first `capacity` i with
// |r_i| >= lambda (or NaN) are sent and zeroed, the rest stay.
Selection ref_ef_threshold(std::vector<float>& r, const std::vector<float>& g, float lambda,
                           size_t capacity) {
  Selection s;
  for (size_t i = 0; i < r.size(); ++i) {
    const float v = r[i] + g[i];
    r[i] = v;
    if (std::isnan(v) || std::fabs(static_cast<double>(v)) >= static_cast<double>(lambda)) {
      if (s.index.size() < capacity) {
        s.index.push_back(static_cast<uint32_t>(i));
        s.value.push_back(v);
        r[i] = 0.0f;
      }
      ++s.count;
    }
  }
  return s;
}

void expect_same(const std::vector<float>& a, const std::vector<float>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) ASSERT_TRUE(same_bits(a[i], b[i])) << "element " << i;
}

TEST_P(EfTest, FusedEqualsReferenceLoop) {
  uint64_t seed = 40;
  for (size_t n : {size_t{0}, size_t{1}, size_t{17}, size_t{1024}, size_t{30001}}) {
    for (size_t capacity : {n, n / 50, size_t{0}, size_t{1}}) {
      auto r = testing::normal_floats(n, seed++, 0.5f);
      const auto g = testing::special_floats(n, seed++);
      const auto g2 = testing::normal_floats(n, seed++);
      for (const auto* grad : {&g2, &g}) {
        SCOPED_TRACE(::testing::Message() << "n=" << n << " capacity=" << capacity);
        auto r_ref = r;
        const Selection want = ref_ef_threshold(r_ref, *grad, 1.5f, capacity);
        std::vector<uint32_t> index(capacity);
        std::vector<float> value(capacity);
        const size_t count = detail::ef_threshold_isa(GetParam(), r, *grad, 1.5f, index.data(),
                                                      value.data(), capacity);
        ASSERT_EQ(count, want.count);
        index.resize(std::min(count, capacity));
        value.resize(index.size());
        EXPECT_EQ(index, want.index);
        expect_same(value, want.value);
        expect_same(r, r_ref);
      }
    }
  }
}

TEST_P(EfTest, FusedEqualsUnfusedKernels) {
  const size_t n = 50000;
  auto r_fused = testing::normal_floats(n, 1, 0.3f);
  auto r_unfused = r_fused;
  for (int step = 0; step < 5; ++step) {
    const auto g = testing::normal_floats(n, 100 + step);
    std::vector<uint32_t> fi(n), ui(n);
    std::vector<float> fv(n), uv(n);
    const size_t fc =
        detail::ef_threshold_isa(GetParam(), r_fused, g, 2.0f, fi.data(), fv.data(), n);
    detail::add_isa(GetParam(), r_unfused, g);
    const size_t uc =
        detail::threshold_select_isa(GetParam(), r_unfused, 2.0f, ui.data(), uv.data(), n);
    clear_selected(r_unfused, std::span<const uint32_t>(ui.data(), uc));
    ASSERT_EQ(fc, uc);
    ASSERT_GT(fc, 0u);
    fi.resize(fc);
    ui.resize(uc);
    fv.resize(fc);
    uv.resize(uc);
    EXPECT_EQ(fi, ui);
    expect_same(fv, uv);
    expect_same(r_fused, r_unfused);
  }
}

// Conservation. For one coordinate and step, the kernel computes s = fl(r + g) and then either
// sends s (residual 0) or keeps it (residual s), so sent + r_new == s exactly, and
// |s - (r + g)| <= u * |r + g| <= u * (|r| + |g|) with u = 2^-24 (round to nearest). Summing
// over T steps telescopes: |sum(sent) + r_T - sum(g)| <= u * sum_t (|r_{t-1}| + |g_t|).
// The test's own float64 sums add at most T * 2^-53 * sum(|terms|), covered by the 1e-12 slack.
enum class Path { kFusedThreshold, kTopk };

void run_conservation(Isa isa, Path path) {
  const size_t n = 4099;
  const int steps = 200;
  const double u = std::ldexp(1.0, -24);
  std::vector<float> r(n, 0.0f);
  std::vector<double> sum_sent(n, 0.0), sum_grad(n, 0.0), bound(n, 0.0), magnitude(n, 0.0);
  std::vector<uint32_t> index(n);
  std::vector<float> value(n);
  std::vector<std::byte> scratch(topk_scratch_bytes(n));
  std::mt19937_64 rng(2024);
  size_t total_sent = 0;
  for (int t = 0; t < steps; ++t) {
    // Gradients whose scale drifts over three orders of magnitude, so rounding really happens.
    const float sigma = std::ldexp(1.0f, static_cast<int>(rng() % 11) - 5);
    const auto g = testing::normal_floats(n, rng(), sigma);
    std::vector<float> expect_s(n);
    for (size_t i = 0; i < n; ++i) {
      expect_s[i] = r[i] + g[i];
      bound[i] += u * (std::fabs(static_cast<double>(r[i])) + std::fabs(static_cast<double>(g[i])));
      sum_grad[i] += static_cast<double>(g[i]);
      magnitude[i] += std::fabs(static_cast<double>(g[i]));
    }
    size_t count = 0;
    if (path == Path::kFusedThreshold) {
      count = detail::ef_threshold_isa(isa, r, g, 0.8f, index.data(), value.data(), n);
    } else {
      detail::add_isa(isa, r, g);
      auto got = detail::topk_exact_isa(isa, r, topk_count(n, 0.01), scratch, index.data(),
                                        value.data());
      ASSERT_TRUE(got.ok());
      count = *got;
      clear_selected(r, std::span<const uint32_t>(index.data(), count));
    }
    ASSERT_LE(count, n);
    std::vector<float> sent_now(n, 0.0f);
    for (size_t j = 0; j < count; ++j) {
      sent_now[index[j]] = value[j];
      sum_sent[index[j]] += static_cast<double>(value[j]);
      magnitude[index[j]] += std::fabs(static_cast<double>(value[j]));
    }
    total_sent += count;
    // Per step and exactly: sent + residual == fl(r_prev + g).
    for (size_t i = 0; i < n; ++i) {
      ASSERT_TRUE(same_bits(sent_now[i] + r[i], expect_s[i]) ||
                  (sent_now[i] + r[i] == expect_s[i]))
          << "step " << t << " element " << i;
    }
  }
  ASSERT_GT(total_sent, 0u);
  ASSERT_LT(total_sent, n * steps);  // really sparse, residuals carry mass between steps
  double worst_ratio = 0.0;
  double total_sent_sum = 0.0, total_grad_sum = 0.0, total_residual = 0.0, total_bound = 0.0;
  for (size_t i = 0; i < n; ++i) {
    const double err = std::fabs(sum_sent[i] + static_cast<double>(r[i]) - sum_grad[i]);
    const double allowed = bound[i] + 1e-12 * magnitude[i];
    ASSERT_LE(err, allowed) << "element " << i;
    worst_ratio = std::max(worst_ratio, err / allowed);
    total_sent_sum += sum_sent[i];
    total_grad_sum += sum_grad[i];
    total_residual += static_cast<double>(r[i]);
    total_bound += allowed;
  }
  EXPECT_LE(std::fabs(total_sent_sum + total_residual - total_grad_sum), total_bound);
  ::testing::Test::RecordProperty("worst_error_over_bound", std::to_string(worst_ratio));
}

TEST_P(EfTest, ConservationFusedThreshold) { run_conservation(GetParam(), Path::kFusedThreshold); }
TEST_P(EfTest, ConservationTopk) { run_conservation(GetParam(), Path::kTopk); }

INSTANTIATE_TEST_SUITE_P(kernels, EfTest, ::testing::ValuesIn(testing::all_isas()),
                         [](const auto& param_info) { return testing::isa_name(param_info.param); });

// DGC momentum correction against the update rule in float64 over many steps, with
// momentum-factor masking applied at the coordinates a top-k sends:
//   u = m u + g; v += u; send top-k of v; u[sent] = v[sent] = 0.
TEST(kernelsEf, MomentumCorrectionMatchesFloat64Rule) {
  const size_t n = 2000;
  const float m = 0.9f;
  std::vector<float> u(n, 0.0f), v(n, 0.0f);
  std::vector<double> u64(n, 0.0), v64(n, 0.0);
  std::vector<std::byte> scratch(topk_scratch_bytes(n));
  std::vector<uint32_t> index(20);
  std::vector<float> value(20);
  for (uint64_t step = 0; step < 50; ++step) {
    const auto g = testing::normal_floats(n, 1000 + step);
    momentum_accumulate(u, v, g, m, 1.0f);
    for (size_t i = 0; i < n; ++i) {
      u64[i] = 0.9 * u64[i] + g[i];
      v64[i] += u64[i];
    }
    // Same values up to float rounding: |u| <= 10 max|g| and v grows at most ~50 * 10 * 5.
    for (size_t i = 0; i < n; ++i) {
      ASSERT_NEAR(u[i], u64[i], 1e-4 * (1 + std::fabs(u64[i]))) << i;
      ASSERT_NEAR(v[i], v64[i], 1e-4 * (1 + std::fabs(v64[i]))) << i;
    }
    auto got = topk_exact(v, 20, scratch, index.data(), value.data());
    ASSERT_TRUE(got.ok());
    for (size_t j = 0; j < *got; ++j) {
      u[index[j]] = v[index[j]] = 0.0f;
      u64[index[j]] = v64[index[j]] = 0.0;
    }
  }
}

TEST(kernelsEf, ScaledAccumulateSubtractAddNormClip) {
  std::vector<float> r = {1, 2, 3, 4};
  const std::vector<float> g = {1, 1, 1, 1};
  ef_accumulate_scaled(r, g, 0.5f);
  EXPECT_EQ(r, (std::vector<float>{1.5f, 2.5f, 3.5f, 4.5f}));
  ef_accumulate_scaled(r, g, 1.0f);
  EXPECT_EQ(r, (std::vector<float>{2.5f, 3.5f, 4.5f, 5.5f}));
  const std::vector<uint32_t> idx = {1, 3};
  const std::vector<float> val = {0.5f, 10.0f};
  subtract_selected(r, idx, val);
  EXPECT_EQ(r, (std::vector<float>{2.5f, 3.0f, 4.5f, -4.5f}));
  add_selected(r, idx, val);
  EXPECT_EQ(r, (std::vector<float>{2.5f, 3.5f, 4.5f, 5.5f}));
  EXPECT_DOUBLE_EQ(norm2(std::vector<float>{3, 4}), 25.0);
  EXPECT_EQ(clip_factor(10.0, 0.0), 1.0f);    // off
  EXPECT_EQ(clip_factor(10.0, 20.0), 1.0f);   // below the cap
  EXPECT_EQ(clip_factor(10.0, 5.0), 0.5f);
  EXPECT_EQ(clip_factor(0.0, 5.0), 1.0f);
  EXPECT_EQ(clip_factor(std::nan(""), 5.0), 1.0f);
  EXPECT_EQ(clip_factor(INFINITY, 5.0), 1.0f);
}

TEST(kernelsEf, Norm2MatchesASerialLongDoubleSumAtEveryLength) {
  // norm2 sums in eight lanes; the reference is the plain serial sum in long double. Small
  // integers square and add exactly in float64, so short vectors of them (every tail length of
  // the lanes) must match exactly; a long vector of magnitudes over 12 decades to 1e-12.
  for (size_t n = 0; n <= 19; ++n) {
    std::vector<float> x(n);
    long double ref = 0;
    for (size_t i = 0; i < n; ++i) {
      x[i] = static_cast<float>(static_cast<int>(i % 7) - 3) * static_cast<float>(i + 1);
      ref += static_cast<long double>(x[i]) * x[i];
    }
    EXPECT_EQ(norm2(x), static_cast<double>(ref)) << "n " << n;
  }
  std::mt19937_64 rng(7);
  std::uniform_real_distribution<float> mant(-1.0f, 1.0f);
  std::uniform_int_distribution<int> exp10(-8, 4);
  std::vector<float> x(100003);
  long double ref = 0;
  for (float& v : x) {
    v = mant(rng) * std::pow(10.0f, static_cast<float>(exp10(rng)));
    ref += static_cast<long double>(v) * v;
  }
  EXPECT_NEAR(norm2(x), static_cast<double>(ref), 1e-12 * static_cast<double>(ref));
  x[50001] = std::nanf("");
  EXPECT_TRUE(std::isnan(norm2(x)));
  x[50001] = INFINITY;
  EXPECT_TRUE(std::isinf(norm2(x)));
}

}  // namespace
}  // namespace sparsecar::kernels
