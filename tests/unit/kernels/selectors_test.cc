// The selector registry (kernels/selectors.h): frozen ids and names, the rows' invariants, and
// the contract every row's CPU function keeps (sorted unique indices, values of x, the count).
#include "sparsecar/kernels/selectors.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "sparsecar/kernels/select.h"

namespace sparsecar::kernels {
namespace {

TEST(kernelsSelectors, IdsAndNamesAreFrozen) {
  // Written out by hand: a renumbered or renamed row fails here.
  const std::vector<std::pair<int, std::string>> frozen = {
      {0, "none"},         {1, "topk"},       {2, "threshold"},   {3, "topk_approx"},   {4, "percentile"},
      {5, "randomk"},      {6, "importance"}, {7, "block_topk"},  {8, "row_topk"},      {9, "column_topk"},
      {10, "channel_topk"}, {11, "head_topk"}, {12, "periodic_mask"}, {13, "hybrid"}};
  const auto rows = selector_registry();
  ASSERT_GE(rows.size(), frozen.size());
  for (const auto& [id, name] : frozen) {
    EXPECT_EQ(static_cast<int>(rows[static_cast<size_t>(id)].id), id);
    EXPECT_EQ(rows[static_cast<size_t>(id)].name, name);
    EXPECT_EQ(selector_name(static_cast<Selector>(id)), name);
  }
}

TEST(kernelsSelectors, RowsAreInIdOrderWithUniqueNamesThatParseBack) {
  std::set<std::string> names;
  const auto rows = selector_registry();
  for (size_t i = 0; i < rows.size(); ++i) {
    const SelectorInfo& row = rows[i];
    EXPECT_EQ(static_cast<size_t>(row.id), i);
    EXPECT_TRUE(names.insert(row.name).second) << row.name;
    EXPECT_EQ(find_selector(row.id), &row);
    EXPECT_EQ(find_selector(std::string_view(row.name)), &row);
    Selector parsed = Selector::kNone;
    ASSERT_TRUE(parse_selector(row.name, &parsed)) << row.name;
    EXPECT_EQ(parsed, row.id);
    EXPECT_GT(std::string(row.doc).size(), 10u) << row.name;
    EXPECT_EQ(row.cpu == nullptr, row.id == Selector::kNone) << row.name;
    EXPECT_EQ(row.params >> kSelectorParamCount, 0u) << row.name << ": a parameter bit no row of kSelectorParams has";
  }
  EXPECT_EQ(find_selector(static_cast<Selector>(rows.size())), nullptr);
  EXPECT_EQ(find_selector(std::string_view("TopK")), nullptr);
  EXPECT_EQ(selector_name(static_cast<Selector>(rows.size())), "unknown");
}

TEST(kernelsSelectors, ChoicesListEveryRowButNone) {
  std::string expected;
  for (const SelectorInfo& row : selector_registry()) {
    if (row.id == Selector::kNone) continue;
    expected += expected.empty() ? "" : "|";
    expected += row.name;
  }
  EXPECT_EQ(selector_choices(), expected);
  EXPECT_EQ(selector_choices().rfind("topk|threshold|", 0), 0u);
  EXPECT_EQ(selector_choices().find("none"), std::string::npos);
}

TEST(kernelsSelectors, ParametersHaveUniqueNamesAndDefaultsInRange) {
  std::set<std::string> names;
  for (int i = 0; i < kSelectorParamCount; ++i) {
    const ParamInfo& p = kSelectorParams[i];
    EXPECT_EQ(static_cast<int>(p.param), i);
    EXPECT_EQ(&selector_param(p.param), &p);
    EXPECT_TRUE(names.insert(p.name).second) << p.name;
    if (p.type == ParamType::kChoice) {
      EXPECT_NE(std::string(p.choices), "") << p.name;
    } else {
      EXPECT_LE(p.min, p.default_value) << p.name;
      EXPECT_LE(p.default_value, p.max) << p.name;
    }
  }
  // The defaults of SelectorParams are the table's.
  const SelectorParams d;
  EXPECT_EQ(d.density, selector_param(SelectorParam::kDensity).default_value);
  EXPECT_EQ(d.block_size, selector_param(SelectorParam::kBlockSize).default_value);
  EXPECT_EQ(d.heads, selector_param(SelectorParam::kHeads).default_value);
  EXPECT_EQ(d.mask_period, selector_param(SelectorParam::kMaskPeriod).default_value);
  EXPECT_EQ(d.quantile, selector_param(SelectorParam::kQuantile).default_value);
}

// get_param / set_param (the accessors the knobs, overrides and plans use) reach the field each
// row names and no other, exactly (a uint64_t seed above 2^53 included).
TEST(kernelsSelectors, ParamAccessorsReachTheRowsFieldAlone) {
  const SelectorParams defaults;
  for (const ParamInfo& p : kSelectorParams) {
    SCOPED_TRACE(p.name);
    const ParamValue d = get_param(defaults, p.param);
    if (p.type == ParamType::kNumber) {
      EXPECT_EQ(d.number, p.default_value);
    } else {
      EXPECT_EQ(static_cast<double>(d.integer), p.default_value);
    }
    ParamValue v;
    if (p.type == ParamType::kNumber) v.number = p.max;
    if (p.type == ParamType::kUint) v.integer = static_cast<uint64_t>(p.max);
    if (p.type == ParamType::kChoice) v.integer = 1;
    SelectorParams changed;
    set_param(changed, p.param, v);
    EXPECT_EQ(get_param(changed, p.param), v);
    EXPECT_FALSE(changed == defaults);
    for (const ParamInfo& other : kSelectorParams) {
      if (other.param == p.param) continue;
      EXPECT_EQ(get_param(changed, other.param), get_param(defaults, other.param)) << other.name;
    }
  }
  // The fields, written out by hand.
  SelectorParams s;
  set_param(s, SelectorParam::kRandomSeed, {.number = 0, .integer = 18'000'000'000'000'000'001ull});
  EXPECT_EQ(s.seed, 18'000'000'000'000'000'001ull);
  set_param(s, SelectorParam::kThreshold, {.number = 0.25, .integer = 0});
  EXPECT_EQ(s.threshold, 0.25);
  set_param(s, SelectorParam::kBlockSize, {.number = 0, .integer = 128});
  EXPECT_EQ(s.block_size, 128u);
  set_param(s, SelectorParam::kQuantile, {.number = 0.5, .integer = 0});
  EXPECT_EQ(s.quantile, 0.5);
  EXPECT_EQ(s.density, 0.01);
}

// A choice is stored as its index in the row's `choices`: the index is the enum's value, so each
// choice's name is the enum's own name for it.
TEST(kernelsSelectors, ChoiceIndicesAreTheEnumsValues) {
  const ParamInfo& row = selector_param(SelectorParam::kGroupNorm);
  for (const char* name : {"l2", "l1"}) {
    uint64_t index = 99;
    ASSERT_TRUE(parse_param_choice(row, name, &index)) << name;
    EXPECT_EQ(param_choice(row, index), name);
    GroupNorm g;
    ASSERT_TRUE(parse_group_norm(name, &g));
    SelectorParams s;
    set_param(s, SelectorParam::kGroupNorm, {.number = 0, .integer = index});
    EXPECT_EQ(s.group_norm, g) << name;
    EXPECT_EQ(group_norm_name(s.group_norm), name);
  }
  uint64_t index = 7;
  EXPECT_FALSE(parse_param_choice(row, "L2", &index));
  EXPECT_FALSE(parse_param_choice(row, "", &index));
  EXPECT_EQ(index, 7u);
  EXPECT_EQ(param_choice(row, 2), "");
}

TEST(kernelsSelectors, ScratchCoversTopkAndTheFinestGrouping) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{1000}, size_t{1} << 20}) {
    EXPECT_GE(selector_scratch_bytes(n, {}), topk_scratch_bytes(n));
    EXPECT_GE(selector_scratch_bytes(n, {}), group_scratch_bytes((n + kMinBlock - 1) / kMinBlock));
  }
  const std::vector<uint64_t> shape = {3, 100000};  // 100000 columns: more groups than blocks of 32
  EXPECT_GE(selector_scratch_bytes(300000, shape), group_scratch_bytes(100000));
}

// Every row's CPU function, on random data with a 2-D shape: indices strictly increasing and in
// range, values x[i] (the biased, error-feedback form), a count within capacity, and the same
// answer twice (deterministic).
TEST(kernelsSelectors, EveryRowKeepsTheSelectionContract) {
  const size_t rows_ = 64, cols = 96, n = rows_ * cols;
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> x(n), g(n);
  for (float& v : x) v = dist(rng);
  for (float& v : g) v = dist(rng);
  const std::vector<uint64_t> shape = {rows_, cols};
  std::vector<std::byte> scratch(selector_scratch_bytes(n, shape));
  for (const SelectorInfo& row : selector_registry()) {
    if (row.cpu == nullptr) continue;
    SCOPED_TRACE(row.name);
    SelectorParams params;
    params.density = 0.05;
    params.threshold = 1.5f;
    params.heads = 4;
    params.seed = 1234;
    auto run = [&](std::vector<uint32_t>& index, std::vector<float>& value, SelectorState* state,
                   std::vector<float>& imp, std::vector<uint32_t>& mask, std::vector<float>& mv) {
      if (row.stateful) {
        imp.assign(n, 0.0f);
        mask.assign(n, 0);
        mv.assign(n, 0.0f);
        *state = SelectorState{};
        state->importance = imp;
        state->mask = mask;
        state->mask_values = mv;
      }
      SelectInput in;
      in.x = x;
      in.grad = g;
      in.shape = shape;
      in.params = &params;
      in.scratch = scratch;
      in.state = row.stateful ? state : nullptr;
      index.assign(n, 0);
      value.assign(n, 0.0f);
      return row.cpu(in, SelectOutput{index.data(), value.data(), n});
    };
    std::vector<uint32_t> i1, i2, m1, m2;
    std::vector<float> v1, v2, a1, a2, b1, b2;
    SelectorState s1, s2;
    auto c1 = run(i1, v1, &s1, a1, m1, b1);
    auto c2 = run(i2, v2, &s2, a2, m2, b2);
    ASSERT_TRUE(c1.ok()) << c1.status().to_string();
    ASSERT_TRUE(c2.ok());
    ASSERT_EQ(*c1, *c2);
    ASSERT_GT(*c1, 0u);
    ASSERT_LE(*c1, n);
    for (size_t j = 0; j < *c1; ++j) {
      ASSERT_LT(i1[j], n);
      if (j > 0) {
        ASSERT_LT(i1[j - 1], i1[j]);
      }
      ASSERT_EQ(i1[j], i2[j]);
      ASSERT_EQ(v1[j], x[i1[j]]);
    }
  }
}

TEST(kernelsSelectors, AStatefulRowWithoutStateIsAnErrorNotACrash) {
  for (const SelectorInfo& row : selector_registry()) {
    if (!row.stateful) continue;
    std::vector<float> x(100, 1.0f);
    std::vector<std::byte> scratch(selector_scratch_bytes(x.size(), {}));
    std::vector<uint32_t> index(x.size());
    std::vector<float> value(x.size());
    SelectorParams params;
    SelectInput in;
    in.x = x;
    in.grad = x;
    in.params = &params;
    in.scratch = scratch;
    auto r = row.cpu(in, SelectOutput{index.data(), value.data(), x.size()});
    EXPECT_FALSE(r.ok()) << row.name;
  }
}

}  // namespace
}  // namespace sparsecar::kernels
