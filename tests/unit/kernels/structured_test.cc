// Structured selectors against plain loop references written here: every group is scored by a
// loop in index order (float64), groups are sorted by (NaN first, score desc, index asc) with
// std::sort, the best `keep` are expanded to their element indices and sorted. Random tensors of
// random shapes, ragged last blocks, ties (small-integer data) and NaN/inf inputs. randblock
// against its rule written plainly, plus a float64 check that its unbiased values average to x.
#include "sparsecar/kernels/structured.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <vector>

#include "sparsecar/kernels/select.h"
#include "sparsecar/kernels/selectors.h"
#include "sparsecar/kernels/types.h"
#include "tests/unit/kernels/test_util.h"

namespace sparsecar::kernels {
namespace {

using testing::normal_floats;
using testing::same_bits;

struct Selection {
  std::vector<uint32_t> index;
  std::vector<float> value;
};

// groups[g] = the element indices of group g.
Selection reference_groups(const std::vector<float>& x, const std::vector<std::vector<size_t>>& groups, size_t keep,
                           GroupNorm norm) {
  std::vector<double> score(groups.size(), 0.0);
  for (size_t g = 0; g < groups.size(); ++g) {
    for (size_t i : groups[g]) {
      double d = x[i];
      score[g] += norm == GroupNorm::kL2 ? d * d : std::fabs(d);
    }
  }
  std::vector<size_t> order(groups.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    bool na = std::isnan(score[a]), nb = std::isnan(score[b]);
    if (na != nb) return na;
    if (!na && score[a] != score[b]) return score[a] > score[b];
    return a < b;
  });
  order.resize(std::min(keep, order.size()));
  std::vector<uint32_t> idx;
  for (size_t g : order) {
    for (size_t i : groups[g]) idx.push_back(static_cast<uint32_t>(i));
  }
  std::sort(idx.begin(), idx.end());
  Selection s;
  s.index = idx;
  for (uint32_t i : idx) s.value.push_back(x[i]);
  return s;
}

std::vector<std::vector<size_t>> contiguous(size_t n, size_t size) {
  std::vector<std::vector<size_t>> g;
  for (size_t begin = 0; begin < n; begin += size) {
    auto& grp = g.emplace_back();
    for (size_t i = begin; i < std::min(n, begin + size); ++i) grp.push_back(i);
  }
  return g;
}

std::vector<std::vector<size_t>> columns(size_t rows, size_t cols) {
  std::vector<std::vector<size_t>> g(cols);
  for (size_t r = 0; r < rows; ++r) {
    for (size_t c = 0; c < cols; ++c) g[c].push_back(r * cols + c);
  }
  return g;
}

// Small integers: many groups tie exactly, so the index tie rule decides.
std::vector<float> tie_floats(size_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<int> v(-2, 2);
  std::vector<float> x(n);
  for (float& f : x) f = static_cast<float>(v(rng));
  return x;
}

std::vector<float> data_for(int kind, size_t n, uint64_t seed) {
  switch (kind) {
    case 0: return normal_floats(n, seed);
    case 1: return tie_floats(n, seed);
    default: return testing::special_floats(n, seed);
  }
}

void expect_same(const Selection& want, const std::vector<uint32_t>& idx, const std::vector<float>& val, size_t got,
                 const std::string& what) {
  ASSERT_EQ(got, want.index.size()) << what;
  for (size_t j = 0; j < got; ++j) {
    ASSERT_EQ(idx[j], want.index[j]) << what << " pair " << j;
    ASSERT_TRUE(same_bits(val[j], want.value[j])) << what << " pair " << j;
  }
}

struct Out {
  explicit Out(size_t n, size_t groups) : idx(n + 1), val(n + 1), scratch(group_scratch_bytes(groups)) {}
  std::vector<uint32_t> idx;
  std::vector<float> val;
  std::vector<std::byte> scratch;
};

TEST(StructuredSelectors, IdsAreFrozenAndNamesParseBack) {
  const std::pair<Selector, int> ids[] = {{Selector::kBlockTopk, 7},   {Selector::kRowTopk, 8},
                                          {Selector::kColumnTopk, 9},  {Selector::kChannelTopk, 10},
                                          {Selector::kHeadTopk, 11},   {Selector::kPeriodicMask, 12},
                                          {Selector::kHybrid, 13}};
  for (auto [s, id] : ids) {
    EXPECT_EQ(static_cast<int>(s), id);
    Selector back = Selector::kNone;
    ASSERT_TRUE(parse_selector(selector_name(s), &back)) << selector_name(s);
    EXPECT_EQ(back, s);
  }
}

TEST(GroupNorm, NamesRoundTrip) {
  for (GroupNorm g : {GroupNorm::kL2, GroupNorm::kL1}) {
    GroupNorm back = GroupNorm::kL1;
    ASSERT_TRUE(parse_group_norm(group_norm_name(g), &back));
    EXPECT_EQ(back, g);
  }
  GroupNorm unchanged = GroupNorm::kL1;
  EXPECT_FALSE(parse_group_norm("l3", &unchanged));
  EXPECT_EQ(unchanged, GroupNorm::kL1);
  EXPECT_EQ(static_cast<int>(GroupNorm::kL1), 1);  // frozen
}

TEST(BlockTopk, MatchesTheReferenceOnRandomSizesWithRaggedLastBlocks) {
  std::mt19937_64 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const size_t n = std::uniform_int_distribution<size_t>(0, 5000)(rng);
    const size_t block = std::uniform_int_distribution<size_t>(kMinBlock, kMaxBlock)(rng);
    const size_t groups = (n + block - 1) / block;
    const size_t keep = std::uniform_int_distribution<size_t>(0, groups + 2)(rng);
    const auto norm = trial % 2 ? GroupNorm::kL1 : GroupNorm::kL2;
    const int kind = trial % 3;
    auto x = data_for(kind, n, 1000 + trial);
    Out o(n, groups);
    auto got = block_topk(x, block, keep, norm, o.scratch, o.idx.data(), o.val.data());
    ASSERT_TRUE(got.ok()) << got.status().to_string();
    expect_same(reference_groups(x, contiguous(n, block), keep, norm), o.idx, o.val, *got,
                "n=" + std::to_string(n) + " block=" + std::to_string(block) + " keep=" + std::to_string(keep) +
                    " kind=" + std::to_string(kind));
  }
}

TEST(BlockTopk, TiesGoToTheLowerBlockAndRaggedBlocksScoreWhatTheyHave) {
  // Blocks of 32: block 0 zeros, blocks 1 (+1s) and 2 (-1s) tie, the ragged last block has 8
  // elements of 4 (L2: 128 beats 32; L1: 32 ties with the full blocks and loses on index).
  std::vector<float> x(32 * 3 + 8, 0.0f);
  for (size_t i = 32; i < 64; ++i) x[i] = 1.0f;
  for (size_t i = 64; i < 96; ++i) x[i] = -1.0f;
  for (size_t i = 96; i < x.size(); ++i) x[i] = 4.0f;
  Out o(x.size(), 4);
  auto got = block_topk(x, 32, 2, GroupNorm::kL2, o.scratch, o.idx.data(), o.val.data());
  ASSERT_TRUE(got.ok());
  ASSERT_EQ(*got, 32u + 8u);
  EXPECT_EQ(o.idx[0], 32u);   // block 1 wins the tie with block 2
  EXPECT_EQ(o.idx[32], 96u);  // the ragged block
  // L1: 8 * 4 = 32 ties with the full blocks of +-1 (32); the lower indices win.
  got = block_topk(x, 32, 2, GroupNorm::kL1, o.scratch, o.idx.data(), o.val.data());
  ASSERT_TRUE(got.ok());
  ASSERT_EQ(*got, 64u);
  EXPECT_EQ(o.idx[0], 32u);
  EXPECT_EQ(o.idx[63], 95u);
}

TEST(BlockTopk, NanBlocksRankFirst) {
  std::vector<float> x(128, 100.0f);
  x[100] = std::numeric_limits<float>::quiet_NaN();
  Out o(x.size(), 4);
  auto got = block_topk(x, 32, 1, GroupNorm::kL2, o.scratch, o.idx.data(), o.val.data());
  ASSERT_TRUE(got.ok());
  ASSERT_EQ(*got, 32u);
  EXPECT_EQ(o.idx[0], 96u);
}

TEST(BlockTopk, RejectsBadArguments) {
  std::vector<float> x(100, 1.0f);
  Out o(x.size(), 100);
  EXPECT_EQ(block_topk(x, 31, 1, GroupNorm::kL2, o.scratch, o.idx.data(), o.val.data()).status().code(),
            Code::kInvalidArgument);
  EXPECT_EQ(block_topk(x, 257, 1, GroupNorm::kL2, o.scratch, o.idx.data(), o.val.data()).status().code(),
            Code::kInvalidArgument);
  std::vector<std::byte> small(group_scratch_bytes(4) - 1);
  EXPECT_EQ(block_topk(x, 32, 1, GroupNorm::kL2, small, o.idx.data(), o.val.data()).status().code(),
            Code::kInvalidArgument);
  EXPECT_EQ(block_topk(x, 32, 1, GroupNorm::kL2, o.scratch, nullptr, o.val.data()).status().code(),
            Code::kInvalidArgument);
  auto none = block_topk({}, 32, 5, GroupNorm::kL2, o.scratch, nullptr, nullptr);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(*none, 0u);
}

TEST(RowColumnTopk, MatchTheReferenceOnRandomShapes) {
  std::mt19937_64 rng(11);
  for (int trial = 0; trial < 300; ++trial) {
    const size_t rows = std::uniform_int_distribution<size_t>(1, 70)(rng);
    const size_t cols = std::uniform_int_distribution<size_t>(1, 70)(rng);
    const size_t n = rows * cols;
    const auto norm = trial % 2 ? GroupNorm::kL1 : GroupNorm::kL2;
    auto x = data_for(trial % 3, n, 2000 + trial);
    {
      const size_t keep = std::uniform_int_distribution<size_t>(0, rows + 1)(rng);
      Out o(n, rows);
      auto got = row_topk(x, rows, cols, keep, norm, o.scratch, o.idx.data(), o.val.data());
      ASSERT_TRUE(got.ok()) << got.status().to_string();
      expect_same(reference_groups(x, contiguous(n, cols), keep, norm), o.idx, o.val, *got,
                  "rows " + std::to_string(rows) + "x" + std::to_string(cols) + " keep " + std::to_string(keep));
    }
    {
      const size_t keep = std::uniform_int_distribution<size_t>(0, cols + 1)(rng);
      Out o(n, cols);
      auto got = column_topk(x, rows, cols, keep, norm, o.scratch, o.idx.data(), o.val.data());
      ASSERT_TRUE(got.ok()) << got.status().to_string();
      expect_same(reference_groups(x, columns(rows, cols), keep, norm), o.idx, o.val, *got,
                  "cols " + std::to_string(rows) + "x" + std::to_string(cols) + " keep " + std::to_string(keep));
    }
  }
}

TEST(RowColumnTopk, RejectShapesThatDoNotHoldTheTensor) {
  std::vector<float> x(12, 1.0f);
  Out o(12, 12);
  EXPECT_FALSE(row_topk(x, 5, 2, 1, GroupNorm::kL2, o.scratch, o.idx.data(), o.val.data()).ok());
  EXPECT_FALSE(row_topk(x, 0, 12, 1, GroupNorm::kL2, o.scratch, o.idx.data(), o.val.data()).ok());
  EXPECT_FALSE(column_topk(x, 3, 5, 1, GroupNorm::kL2, o.scratch, o.idx.data(), o.val.data()).ok());
  std::vector<std::byte> small(group_scratch_bytes(3) - 1);
  EXPECT_FALSE(column_topk(x, 4, 3, 1, GroupNorm::kL2, small, o.idx.data(), o.val.data()).ok());
  EXPECT_TRUE(column_topk(x, 4, 3, 1, GroupNorm::kL2, o.scratch, o.idx.data(), o.val.data()).ok());
}

TEST(ChannelTopk, MatchesTheReferenceOnRandomConvShapes) {
  std::mt19937_64 rng(13);
  for (int trial = 0; trial < 200; ++trial) {
    std::array<uint64_t, 4> shape = {std::uniform_int_distribution<uint64_t>(1, 40)(rng),
                                     std::uniform_int_distribution<uint64_t>(1, 16)(rng),
                                     std::uniform_int_distribution<uint64_t>(1, 3)(rng),
                                     std::uniform_int_distribution<uint64_t>(1, 3)(rng)};
    const size_t n = shape[0] * shape[1] * shape[2] * shape[3];
    const size_t keep = std::uniform_int_distribution<size_t>(0, shape[0] + 1)(rng);
    const auto norm = trial % 2 ? GroupNorm::kL1 : GroupNorm::kL2;
    auto x = data_for(trial % 3, n, 3000 + trial);
    Out o(n, shape[0]);
    auto got = channel_topk(x, shape, keep, norm, o.scratch, o.idx.data(), o.val.data());
    ASSERT_TRUE(got.ok()) << got.status().to_string();
    // Output channel o holds [o * c_in*kh*kw, (o + 1) * c_in*kh*kw).
    std::vector<std::vector<size_t>> channels(shape[0]);
    for (size_t i = 0; i < n; ++i) channels[i / (shape[1] * shape[2] * shape[3])].push_back(i);
    expect_same(reference_groups(x, channels, keep, norm), o.idx, o.val, *got, "trial " + std::to_string(trial));
  }
  std::vector<float> x(24, 1.0f);
  Out o(24, 4);
  const std::array<uint64_t, 4> wrong = {2, 3, 2, 3};
  EXPECT_EQ(channel_topk(x, wrong, 1, GroupNorm::kL2, o.scratch, o.idx.data(), o.val.data()).status().code(),
            Code::kInvalidArgument);
  const std::array<uint64_t, 4> zero = {0, 3, 2, 2};
  EXPECT_FALSE(channel_topk(x, zero, 1, GroupNorm::kL2, o.scratch, o.idx.data(), o.val.data()).ok());
}

TEST(HeadTopk, MatchesTheReferenceOnRandomHeadLayouts) {
  std::mt19937_64 rng(17);
  for (int trial = 0; trial < 200; ++trial) {
    const size_t heads = std::uniform_int_distribution<size_t>(1, 16)(rng);
    const size_t d_head = std::uniform_int_distribution<size_t>(1, 8)(rng);
    const size_t d_model = std::uniform_int_distribution<size_t>(1, 40)(rng);
    const size_t leading = heads * d_head, n = leading * d_model;
    const size_t keep = std::uniform_int_distribution<size_t>(0, heads + 1)(rng);
    const auto norm = trial % 2 ? GroupNorm::kL1 : GroupNorm::kL2;
    auto x = data_for(trial % 3, n, 4000 + trial);
    Out o(n, heads);
    auto got = head_topk(x, leading, heads, keep, norm, o.scratch, o.idx.data(), o.val.data());
    ASSERT_TRUE(got.ok()) << got.status().to_string();
    std::vector<std::vector<size_t>> groups(heads);
    for (size_t i = 0; i < n; ++i) groups[(i / d_model) / d_head].push_back(i);  // row -> head
    expect_same(reference_groups(x, groups, keep, norm), o.idx, o.val, *got, "trial " + std::to_string(trial));
  }
  std::vector<float> x(24, 1.0f);
  Out o(24, 5);
  EXPECT_FALSE(head_topk(x, 6, 4, 1, GroupNorm::kL2, o.scratch, o.idx.data(), o.val.data()).ok());  // 4 !| 6
  EXPECT_FALSE(head_topk(x, 5, 5, 1, GroupNorm::kL2, o.scratch, o.idx.data(), o.val.data()).ok());  // 5 !| 24
  EXPECT_TRUE(head_topk(x, 6, 3, 1, GroupNorm::kL2, o.scratch, o.idx.data(), o.val.data()).ok());
}

// EF conservation for every group selector: residual += g; select; residual[selected] = 0.
// After each step, selected + residual equals the accumulated input exactly, element by element.
TEST(StructuredEf, EverySelectorConservesTheResidual) {
  const size_t rows = 48, cols = 40, n = rows * cols;
  const std::array<uint64_t, 4> conv = {12, 4, 5, 8};  // 12 * 160 = 1920 = n
  std::vector<std::byte> scratch(group_scratch_bytes(n));
  for (int which = 0; which < 5; ++which) {
    std::vector<float> residual(n, 0.0f), idx_val(n);
    std::vector<uint32_t> idx(n);
    std::vector<double> sent(n, 0.0), input(n, 0.0);
    for (int step = 0; step < 20; ++step) {
      auto g = normal_floats(n, 50 * which + step);
      ef_accumulate(residual, g);
      std::vector<float> before = residual;
      for (size_t i = 0; i < n; ++i) input[i] += g[i];
      Expected<size_t> got = size_t{0};
      switch (which) {
        case 0: got = block_topk(residual, 64, 3, GroupNorm::kL2, scratch, idx.data(), idx_val.data()); break;
        case 1: got = row_topk(residual, rows, cols, 4, GroupNorm::kL1, scratch, idx.data(), idx_val.data()); break;
        case 2: got = column_topk(residual, rows, cols, 4, GroupNorm::kL2, scratch, idx.data(), idx_val.data()); break;
        case 3: got = channel_topk(residual, conv, 2, GroupNorm::kL2, scratch, idx.data(), idx_val.data()); break;
        default: got = head_topk(residual, rows, 8, 2, GroupNorm::kL2, scratch, idx.data(), idx_val.data()); break;
      }
      ASSERT_TRUE(got.ok()) << got.status().to_string();
      clear_selected(residual, std::span<const uint32_t>(idx.data(), *got));
      std::vector<float> check = residual;
      for (size_t j = 0; j < *got; ++j) {
        ASSERT_EQ(check[idx[j]], 0.0f);
        check[idx[j]] = idx_val[j];
        sent[idx[j]] += idx_val[j];
      }
      for (size_t i = 0; i < n; ++i) ASSERT_TRUE(same_bits(check[i], before[i])) << "selector " << which;
    }
    for (size_t i = 0; i < n; ++i) ASSERT_NEAR(sent[i] + residual[i], input[i], 1e-4) << "selector " << which;
  }
}

TEST(PeriodicMask, ImportanceAccumulatesMagnitudesAndGatherReadsTheMask) {
  std::vector<float> acc(5, 0.0f);
  importance_accumulate(acc, std::vector<float>{1.0f, -2.0f, 0.0f, -0.5f, 3.0f});
  importance_accumulate(acc, std::vector<float>{-1.0f, 2.0f, 0.25f, 0.5f, -3.0f});
  EXPECT_EQ(acc, (std::vector<float>{2.0f, 4.0f, 0.25f, 1.0f, 6.0f}));
  std::vector<float> x = {10, 11, 12, 13, 14};
  std::vector<uint32_t> mask = {1, 4};
  float out[2];
  gather(x, mask, out);
  EXPECT_EQ(out[0], 11.0f);
  EXPECT_EQ(out[1], 14.0f);
}

// Reference hybrid: i selected when in the reference top-k or |x_i| >= lambda.
TEST(Hybrid, TopkOrThresholdIsTheUnionOfBoth) {
  std::mt19937_64 rng(19);
  for (int trial = 0; trial < 300; ++trial) {
    const size_t n = std::uniform_int_distribution<size_t>(0, 3000)(rng);
    const size_t k = std::uniform_int_distribution<size_t>(0, n + 1)(rng);
    auto x = data_for(trial % 3, n, 5000 + trial);
    const float lambdas[] = {0.0f, 0.5f, 1.0f, 1.5f, 2.5f, 3.0f, std::numeric_limits<float>::infinity(), -1.0f};
    const float lambda = lambdas[trial % std::size(lambdas)];
    // reference top-k: sort by (key desc, index asc)
    std::vector<uint32_t> order(n);
    std::iota(order.begin(), order.end(), 0u);
    auto key = [&](uint32_t i) { return detail::magnitude_key(x[i]); };
    std::sort(order.begin(), order.end(), [&](uint32_t a, uint32_t b) { return key(a) != key(b) ? key(a) > key(b) : a < b; });
    std::vector<bool> want(n, false);
    for (size_t j = 0; j < std::min(k, n); ++j) want[order[j]] = true;
    for (size_t i = 0; i < n; ++i) {
      if (!(lambda > 0.0f) || key(static_cast<uint32_t>(i)) >= detail::magnitude_key(lambda)) want[i] = true;
    }
    std::vector<uint32_t> idx(n + 1);
    std::vector<float> val(n + 1);
    std::vector<std::byte> scratch(topk_scratch_bytes(n));
    auto got = topk_or_threshold(x, k, lambda, scratch, idx.data(), val.data());
    ASSERT_TRUE(got.ok());
    std::vector<uint32_t> want_idx;
    for (size_t i = 0; i < n; ++i) {
      if (want[i]) want_idx.push_back(static_cast<uint32_t>(i));
    }
    ASSERT_EQ(*got, want_idx.size()) << "trial " << trial << " n=" << n << " k=" << k << " lambda=" << lambda;
    for (size_t j = 0; j < *got; ++j) {
      ASSERT_EQ(idx[j], want_idx[j]);
      ASSERT_TRUE(same_bits(val[j], x[idx[j]]));
    }
  }
}

TEST(Hybrid, PooledHistogramThresholdKeepsAtLeastTheBudget) {
  std::vector<uint64_t> hist(kMagnitudeBins, 0);
  std::span<uint64_t, kMagnitudeBins> h(hist.data(), kMagnitudeBins);
  auto a = normal_floats(10000, 1);
  auto b = normal_floats(3000, 2, 10.0f);
  magnitude_histogram_add(h, a);
  magnitude_histogram_add(h, b);
  std::vector<float> all = a;
  all.insert(all.end(), b.begin(), b.end());
  for (uint64_t count : {uint64_t{1}, uint64_t{13}, uint64_t{130}, uint64_t{1300}, uint64_t{12999}, uint64_t{13000}}) {
    const float lambda = magnitude_histogram_threshold(h, count);
    size_t at_or_above = 0;
    for (float v : all) at_or_above += std::fabs(v) >= lambda;
    EXPECT_GE(at_or_above, count);
    // The bin is narrow: the next float bin up keeps fewer than `count`.
    const float next = std::bit_cast<float>(std::bit_cast<uint32_t>(lambda) + (1u << 15));
    size_t above_next = 0;
    for (float v : all) above_next += std::fabs(v) >= next;
    EXPECT_LT(above_next, count) << "count " << count;
  }
  EXPECT_EQ(magnitude_histogram_threshold(h, 0), std::numeric_limits<float>::infinity());
  EXPECT_EQ(magnitude_histogram_threshold(h, 20000), 0.0f);
}

// ---- randblock ---------------------------------------------------------------------------------

// The documented rule, written plainly: block b of [b*block, min((b+1)*block, n)) is kept when
// random_draw(seed, b) < t, t = ceil(p 2^32) (0 for p <= 0, 2^32 for p >= 1); kept elements are
// x_i, or x_i * 2^32 / t in float64 rounded once to float when unbiased.
Selection reference_randblock(const std::vector<float>& x, size_t block, double p, uint64_t seed, bool unbiased) {
  const double two32 = 4294967296.0;
  const double t = p <= 0.0 ? 0.0 : p >= 1.0 ? two32 : std::ceil(p * two32);
  Selection out;
  for (size_t start = 0, b = 0; start < x.size(); start += block, ++b) {
    if (!(static_cast<double>(random_draw(seed, static_cast<uint32_t>(b))) < t)) continue;
    for (size_t i = start; i < std::min(x.size(), start + block); ++i) {
      out.index.push_back(static_cast<uint32_t>(i));
      out.value.push_back(unbiased ? static_cast<float>(static_cast<double>(x[i]) * two32 / t) : x[i]);
    }
  }
  return out;
}

Selection run_randblock(const std::vector<float>& x, size_t block, double p, uint64_t seed, bool unbiased) {
  Selection s;
  s.index.assign(x.size(), 0);
  s.value.assign(x.size(), 0.0f);
  auto c = randblock_select(x, block, p, seed, unbiased, s.index.data(), s.value.data(), x.size());
  EXPECT_TRUE(c.ok()) << c.status().to_string();
  s.index.resize(c.ok() ? *c : 0);
  s.value.resize(s.index.size());
  return s;
}

TEST(kernelsRandblock, MatchesThePlainReference) {
  for (size_t n : {size_t{1}, size_t{31}, size_t{1000}, size_t{4096}, size_t{100003}}) {
    for (size_t block : {kMinBlock, size_t{50}, size_t{64}, kMaxBlock}) {
      for (double p : {0.0, 1e-4, 0.05, 0.3, 0.999, 1.0}) {
        for (bool unbiased : {false, true}) {
          const auto x = normal_floats(n, n + block);
          const uint64_t seed = derive_seed(7, static_cast<uint32_t>(block), n);
          SCOPED_TRACE(::testing::Message() << "n " << n << " block " << block << " p " << p << " unbiased "
                                            << unbiased);
          const Selection want = reference_randblock(x, block, p, seed, unbiased);
          const Selection got = run_randblock(x, block, p, seed, unbiased);
          ASSERT_EQ(got.index, want.index);
          for (size_t j = 0; j < want.value.size(); ++j) ASSERT_TRUE(same_bits(got.value[j], want.value[j])) << j;
        }
      }
    }
  }
}

TEST(kernelsRandblock, SameBlocksOnEveryNodeWhateverTheData) {
  const size_t n = 20000, block = 64;
  const auto a = normal_floats(n, 1), b = normal_floats(n, 2);
  const uint64_t seed = derive_seed(3, 4, 5);
  const Selection sa = run_randblock(a, block, 0.1, seed, true);
  const Selection sb = run_randblock(b, block, 0.1, seed, false);
  ASSERT_FALSE(sa.index.empty());
  EXPECT_EQ(sa.index, sb.index);  // the data and the mode never move the blocks
  EXPECT_NE(run_randblock(a, block, 0.1, derive_seed(3, 4, 6), true).index, sa.index);  // the step does
  // Whole blocks: every kept index's block is kept entirely.
  for (size_t j = 0; j < sa.index.size(); j += block) {
    ASSERT_EQ(sa.index[j] % block, 0u);
    ASSERT_EQ(sa.index[j + block - 1], sa.index[j] + block - 1);
  }
}

// Over many steps' seeds, the unbiased values average to x (float64 sums; 5 sigma of the
// Bernoulli(p) estimator x B / p), and blocks are kept with frequency p.
TEST(kernelsRandblock, UnbiasedValuesAverageToX) {
  const size_t n = 1000, block = 64;  // 16 blocks, the last one of 40
  const double p = 0.25;
  const int draws = 4000;
  const auto x = normal_floats(n, 11);
  std::vector<double> mean(n, 0.0);
  size_t kept_blocks = 0;
  for (int d = 0; d < draws; ++d) {
    const Selection s = run_randblock(x, block, p, derive_seed(99, 0, static_cast<uint64_t>(d)), true);
    for (size_t j = 0; j < s.index.size(); ++j) {
      mean[s.index[j]] += static_cast<double>(s.value[j]) / draws;
      if (s.index[j] % block == 0) ++kept_blocks;
    }
  }
  for (size_t i = 0; i < n; ++i) {
    const double sigma = std::fabs(static_cast<double>(x[i])) * std::sqrt((1 - p) / p / draws);
    ASSERT_NEAR(mean[i], x[i], 5 * sigma + 1e-9) << i;
  }
  const double trials = 16.0 * draws;
  EXPECT_NEAR(static_cast<double>(kept_blocks) / trials, p, 5 * std::sqrt(p * (1 - p) / trials));
}

TEST(kernelsRandblock, RegistryRow) {
  const SelectorInfo* row = find_selector(std::string_view("randblock"));
  ASSERT_NE(row, nullptr);
  EXPECT_EQ(static_cast<int>(row->id), 14);  // frozen
  EXPECT_EQ(row->id, Selector::kRandblock);
  EXPECT_TRUE(row->unbiased);
  EXPECT_FALSE(row->needs_shape);
  EXPECT_EQ(row->params, param_bit(SelectorParam::kDensity) | param_bit(SelectorParam::kBlockSize) |
                             param_bit(SelectorParam::kRandomSeed));
  // The row runs the kernel with the plan's parameters (unbiased only when asked).
  const auto x = normal_floats(3000, 8);
  SelectorParams params;
  params.density = 0.2;
  params.block_size = 96;
  params.seed = derive_seed(1, 2, 3);
  std::vector<std::byte> scratch(selector_scratch_bytes(x.size(), {}));
  for (bool unbiased : {false, true}) {
    SelectInput in;
    in.x = x;
    in.grad = x;
    in.params = &params;
    in.unbiased = unbiased;
    in.scratch = scratch;
    Selection got;
    got.index.assign(x.size(), 0);
    got.value.assign(x.size(), 0.0f);
    auto c = row->cpu(in, SelectOutput{got.index.data(), got.value.data(), x.size()});
    ASSERT_TRUE(c.ok());
    got.index.resize(*c);
    got.value.resize(*c);
    const Selection want = reference_randblock(x, 96, 0.2, params.seed, unbiased);
    EXPECT_EQ(got.index, want.index);
    EXPECT_EQ(got.value, want.value);
  }
}

TEST(kernelsRandblock, CapacityAndErrors) {
  const auto x = normal_floats(1000, 5);
  std::vector<uint32_t> index(1000);
  std::vector<float> value(1000);
  // Capacity: the count is returned, only `capacity` pairs written (the first ones).
  auto all = randblock_select(x, 32, 1.0, 1, false, index.data(), value.data(), 10);
  ASSERT_TRUE(all.ok());
  EXPECT_EQ(*all, 1000u);
  for (uint32_t j = 0; j < 10; ++j) EXPECT_EQ(index[j], j);
  EXPECT_FALSE(randblock_select(x, kMinBlock - 1, 0.5, 1, false, index.data(), value.data(), 1000).ok());
  EXPECT_FALSE(randblock_select(x, kMaxBlock + 1, 0.5, 1, false, index.data(), value.data(), 1000).ok());
  EXPECT_FALSE(randblock_select(x, 64, 0.5, 1, false, nullptr, nullptr, 1000).ok());
  auto none = randblock_select(x, 64, std::nan(""), 1, true, index.data(), value.data(), 1000);
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(*none, 0u);
}

}  // namespace
}  // namespace sparsecar::kernels
