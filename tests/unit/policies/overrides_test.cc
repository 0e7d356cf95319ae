// Per-tensor overrides: the text parser (every key, its range or names, errors that name the
// rule, key and value) and what the rules do to static_plan / plan_tensor: only tensors whose
// name matches change, later rules override earlier ones key by key.
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

#include "sparsecar/policies/overrides.h"
#include "sparsecar/policies/plan.h"
#include "sparsecar/policies/tensor_plan.h"

namespace sparsecar::policies {
namespace {

using kernels::Format;
using kernels::GroupNorm;
using kernels::SelectorParams;
using kernels::ValueType;

TensorOverride only_rule(const std::string& text) {
  auto rules = parse_tensor_overrides(text);
  EXPECT_TRUE(rules.ok()) << text << ": " << rules.status().to_string();
  if (!rules.ok() || rules->size() != 1) {
    ADD_FAILURE() << text << ": expected one rule";
    return {};
  }
  return (*rules)[0];
}

// What a rule sets the selector parameter in `field` to; none if the rule leaves it to the global
// knob (TensorOverride::params_set).
template <typename T>
std::optional<T> rule_value(const TensorOverride& o, T SelectorParams::*field) {
  for (const kernels::ParamInfo& p : kernels::kSelectorParams) {
    if (p.field != kernels::ParamField(field)) continue;
    return o.sets(p.param) ? std::optional<T>(o.params.*field) : std::nullopt;
  }
  ADD_FAILURE() << "no row of kSelectorParams names this field";
  return std::nullopt;
}

std::vector<std::string> names_of(const char* choices) {
  std::vector<std::string> out;
  std::string rest(choices);
  for (size_t bar; (bar = rest.find('|')) != std::string::npos; rest.erase(0, bar + 1)) {
    out.push_back(rest.substr(0, bar));
  }
  out.push_back(rest);
  return out;
}

TEST(OverridesParse, AcceptsEveryCompressionKey) {
  const TensorOverride o = only_rule(
      " w* : format=bitmap, value_type=fp16, block_size=128, group_norm=l1, heads=16, mask_period=200,"
      " error_feedback=momentum, momentum=0.5, clip_norm=2.5 ");
  EXPECT_EQ(o.glob, "w*");
  EXPECT_EQ(o.format, Format::kBitmap);
  EXPECT_EQ(o.auto_format, false);
  EXPECT_EQ(o.value_type, ValueType::kF16);
  EXPECT_EQ(rule_value(o, &SelectorParams::block_size), 128u);
  EXPECT_EQ(rule_value(o, &SelectorParams::group_norm), GroupNorm::kL1);
  EXPECT_EQ(rule_value(o, &SelectorParams::heads), 16u);
  EXPECT_EQ(rule_value(o, &SelectorParams::mask_period), 200u);
  EXPECT_EQ(o.error_feedback, ErrorFeedback::kMomentum);
  EXPECT_EQ(o.momentum, 0.5);
  EXPECT_EQ(o.clip_norm, 2.5);
  // Keys not given stay unset (the global knob applies).
  EXPECT_FALSE(o.compression);
  EXPECT_FALSE(o.selector);
  EXPECT_FALSE(rule_value(o, &SelectorParams::density));
}

TEST(OverridesParse, FormatAutoAndTheLastFormatOfARuleWins) {
  TensorOverride o = only_rule("w*: format=auto");
  EXPECT_EQ(o.auto_format, true);
  EXPECT_FALSE(o.format);
  o = only_rule("w*: format=auto, format=csr");
  EXPECT_EQ(o.auto_format, false);
  EXPECT_EQ(o.format, Format::kCsr);
  o = only_rule("w*: format=rle, format=auto");
  EXPECT_EQ(o.auto_format, true);
  EXPECT_FALSE(o.format);
}

TEST(OverridesParse, AcceptsEveryNameOfTheChoiceKnobs) {
  for (const std::string& name : names_of(kFormatChoices)) {
    const TensorOverride o = only_rule("w: format=" + name);
    if (name == "auto") continue;
    Format f;
    ASSERT_TRUE(kernels::parse_format(name, &f)) << name;
    EXPECT_EQ(o.format, f) << name;
  }
  for (const std::string& name : names_of(kValueTypeChoices)) {
    ValueType v;
    ASSERT_TRUE(kernels::parse_value_type(name, &v)) << name;
    EXPECT_EQ(only_rule("w: value_type=" + name).value_type, v) << name;
  }
  for (const std::string& name : names_of(kernels::selector_param(kernels::SelectorParam::kGroupNorm).choices)) {
    GroupNorm g;
    ASSERT_TRUE(kernels::parse_group_norm(name, &g)) << name;
    EXPECT_EQ(rule_value(only_rule("w: group_norm=" + name), &SelectorParams::group_norm), g) << name;
  }
  for (const std::string& name : names_of(kErrorFeedbackChoices)) {
    ErrorFeedback e;
    ASSERT_TRUE(parse_error_feedback(name, &e)) << name;
    EXPECT_EQ(only_rule("w: error_feedback=" + name).error_feedback, e) << name;
  }
}

TEST(OverridesParse, RangeEndsAreAccepted) {
  EXPECT_EQ(rule_value(only_rule("w: block_size=32"), &SelectorParams::block_size), 32u);
  EXPECT_EQ(rule_value(only_rule("w: block_size=256"), &SelectorParams::block_size), 256u);
  EXPECT_EQ(rule_value(only_rule("w: heads=1"), &SelectorParams::heads), 1u);
  EXPECT_EQ(rule_value(only_rule("w: heads=65536"), &SelectorParams::heads), 65536u);
  EXPECT_EQ(rule_value(only_rule("w: mask_period=100"), &SelectorParams::mask_period), 100u);
  EXPECT_EQ(rule_value(only_rule("w: mask_period=1000"), &SelectorParams::mask_period), 1000u);
  EXPECT_EQ(only_rule("w: momentum=0").momentum, 0.0);
  EXPECT_EQ(only_rule("w: momentum=0.999999").momentum, 0.999999);
  EXPECT_EQ(only_rule("w: clip_norm=0").clip_norm, 0.0);
  EXPECT_EQ(only_rule("w: clip_norm=1e30").clip_norm, 1e30);
  EXPECT_EQ(rule_value(only_rule("w: quantile=1e-6"), &SelectorParams::quantile), 1e-6);
}

TEST(OverridesParse, RejectsBadValuesNamingRuleKeyAndValue) {
  struct Case {
    const char* key;
    const char* value;
  };
  const Case cases[] = {
      {"format", "json"},         {"format", "COO"},          {"format", ""},
      {"value_type", "fp64"},     {"value_type", "int4"},     {"block_size", "31"},
      {"block_size", "257"},      {"block_size", "64.0"},     {"block_size", "-64"},
      {"block_size", "+64"},      {"block_size", "0x40"},     {"block_size", "99999999999999999999"},
      {"group_norm", "linf"},     {"group_norm", "L2"},       {"heads", "0"},
      {"heads", "65537"},         {"heads", "eight"},         {"mask_period", "99"},
      {"mask_period", "1001"},    {"error_feedback", "sometimes"}, {"error_feedback", "dgc"},
      {"momentum", "1"},          {"momentum", "-0.1"},       {"momentum", "nan"},
      {"clip_norm", "-1"},        {"clip_norm", "inf"},       {"clip_norm", "2e30"},
      {"clip_norm", "1.0x"},      {"quantile", "0"},          {"quantile", "5e-7"},
  };
  for (const Case& c : cases) {
    const std::string rule = std::string("emb*: density=0.01, ") + c.key + "=" + c.value;
    auto r = parse_tensor_overrides("*.bias: compression=off; " + rule);
    ASSERT_FALSE(r.ok()) << rule;
    EXPECT_EQ(r.status().code(), Code::kInvalidArgument) << rule;
    const std::string m = r.status().message();
    EXPECT_NE(m.find("tensor override '" + rule + "'"), std::string::npos) << m;
    EXPECT_NE(m.find(std::string("invalid ") + c.key + " '" + c.value + "'"), std::string::npos) << m;
  }
  // The allowed values are in the message.
  auto r = parse_tensor_overrides("w: block_size=16");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("[32, 256]"), std::string::npos) << r.status().message();
  r = parse_tensor_overrides("w: format=json");
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find(kFormatChoices), std::string::npos) << r.status().message();
}

TEST(OverridesParse, UnknownAndJobWideKeysAreRejectedByName) {
  for (const char* key : {"block", "hybrid_density", "random_seed", "lr_rescale", "colour"}) {
    auto r = parse_tensor_overrides(std::string("w*: ") + key + "=1");
    ASSERT_FALSE(r.ok()) << key;
    EXPECT_NE(r.status().message().find(std::string("unknown key '") + key + "'"), std::string::npos)
        << r.status().message();
    EXPECT_NE(r.status().message().find("block_size"), std::string::npos) << "the message lists the keys";
  }
}

StaticSettings block_topk_settings(const std::string& overrides) {
  StaticSettings s;
  s.compression = true;
  s.selector = kernels::Selector::kBlockTopk;
  s.params.density = 0.01;
  s.params.block_size = 64;
  s.params.group_norm = GroupNorm::kL2;
  s.params.heads = 8;
  s.params.mask_period = 100;
  s.format = Format::kCoo;
  s.value_type = ValueType::kF32;
  s.error_feedback = ErrorFeedback::kResidual;
  s.momentum = 0.9;
  s.clip_norm = 0.0;
  auto rules = parse_tensor_overrides(overrides);
  EXPECT_TRUE(rules.ok()) << rules.status().to_string();
  if (rules.ok()) s.overrides = *rules;
  return s;
}

Plan plan_of(const StaticSettings& s, std::string_view name) {
  TensorObservation o;
  o.name = name;
  o.elements = 1 << 16;
  return static_plan(s, o);
}

TEST(OverridesPlan, OnlyMatchingTensorsChange) {
  const StaticSettings s = block_topk_settings(
      "emb*: format=bitmap, value_type=fp16, block_size=128; attn.*: group_norm=l1, heads=16, mask_period=500;"
      " fc*: error_feedback=momentum, momentum=0.5, clip_norm=1.5");
  const Plan global = plan_of(s, "head.weight");
  EXPECT_EQ(global.format, Format::kCoo);
  EXPECT_FALSE(global.auto_format);
  EXPECT_EQ(global.value_type, ValueType::kF32);
  EXPECT_EQ(global.params.block_size, 64u);
  EXPECT_EQ(global.params.group_norm, GroupNorm::kL2);
  EXPECT_EQ(global.params.heads, 8u);
  EXPECT_EQ(global.params.mask_period, 100u);
  EXPECT_EQ(global.error_feedback, ErrorFeedback::kResidual);
  EXPECT_FLOAT_EQ(global.momentum, 0.9f);
  EXPECT_EQ(global.clip_norm, 0.0f);

  const Plan emb = plan_of(s, "emb.tok");
  EXPECT_EQ(emb.format, Format::kBitmap);
  EXPECT_EQ(emb.value_type, ValueType::kF16);
  EXPECT_EQ(emb.params.block_size, 128u);
  EXPECT_EQ(emb.params.group_norm, GroupNorm::kL2);  // not set by its rule
  EXPECT_EQ(emb.error_feedback, ErrorFeedback::kResidual);

  const Plan attn = plan_of(s, "attn.qkv");
  EXPECT_EQ(attn.params.group_norm, GroupNorm::kL1);
  EXPECT_EQ(attn.params.heads, 16u);
  EXPECT_EQ(attn.params.mask_period, 500u);
  EXPECT_EQ(attn.format, Format::kCoo);
  EXPECT_EQ(attn.params.block_size, 64u);

  const Plan fc = plan_of(s, "fc1.weight");
  EXPECT_EQ(fc.error_feedback, ErrorFeedback::kMomentum);
  EXPECT_FLOAT_EQ(fc.momentum, 0.5f);
  EXPECT_FLOAT_EQ(fc.clip_norm, 1.5f);
  EXPECT_EQ(fc.format, Format::kCoo);
  EXPECT_EQ(fc.selector, kernels::Selector::kBlockTopk);
  EXPECT_EQ(fc.params.density, 0.01);
}

TEST(OverridesPlan, LaterRulesOverrideEarlierOnesKeyByKey) {
  const StaticSettings s = block_topk_settings(
      "*: format=auto, block_size=32, value_type=bf16, error_feedback=off;"
      " emb*: format=csr, block_size=256;"
      " emb.pos*: format=auto, error_feedback=momentum, momentum=0.25");
  const Plan other = plan_of(s, "fc.weight");  // the catch-all alone
  EXPECT_TRUE(other.auto_format);
  EXPECT_EQ(other.params.block_size, 32u);
  EXPECT_EQ(other.value_type, ValueType::kBf16);
  EXPECT_EQ(other.error_feedback, ErrorFeedback::kOff);

  const Plan tok = plan_of(s, "emb.tok");  // catch-all, then emb*
  EXPECT_FALSE(tok.auto_format);
  EXPECT_EQ(tok.format, Format::kCsr);
  EXPECT_EQ(tok.params.block_size, 256u);
  EXPECT_EQ(tok.value_type, ValueType::kBf16);  // from the catch-all
  EXPECT_EQ(tok.error_feedback, ErrorFeedback::kOff);

  const Plan pos = plan_of(s, "emb.pos");  // all three in order
  EXPECT_TRUE(pos.auto_format);
  EXPECT_EQ(pos.params.block_size, 256u);
  EXPECT_EQ(pos.value_type, ValueType::kBf16);
  EXPECT_EQ(pos.error_feedback, ErrorFeedback::kMomentum);
  EXPECT_FLOAT_EQ(pos.momentum, 0.25f);

  // Order matters: the same rules reversed let the catch-all win everywhere.
  const StaticSettings reversed =
      block_topk_settings("emb*: format=csr, block_size=256; *: format=auto, block_size=32");
  const Plan r = plan_of(reversed, "emb.tok");
  EXPECT_TRUE(r.auto_format);
  EXPECT_EQ(r.params.block_size, 32u);
}

TEST(OverridesPlan, AGlobalAutoFormatCanBePinnedPerTensor) {
  StaticSettings s = block_topk_settings("emb*: format=dense");
  s.auto_format = true;
  EXPECT_TRUE(plan_of(s, "fc.weight").auto_format);
  const Plan emb = plan_of(s, "emb.tok");
  EXPECT_FALSE(emb.auto_format);
  EXPECT_EQ(emb.format, Format::kDense);
}

TEST(OverridesPlan, ADenseTensorKeepsItsOwnErrorCompensation) {
  // compression=off per tensor: dense ring, but the compressor still clips and folds per the
  // tensor's own settings (Plan: "set on every plan").
  const StaticSettings s = block_topk_settings("*.bias: compression=off, clip_norm=3, error_feedback=momentum");
  const Plan bias = plan_of(s, "fc.bias");
  EXPECT_TRUE(bias.dense);
  EXPECT_FLOAT_EQ(bias.clip_norm, 3.0f);
  EXPECT_EQ(bias.error_feedback, ErrorFeedback::kMomentum);
  // The same through the plan controllers when the schedule makes a step dense (warm-up).
  PlanSettings p;
  p.base = block_topk_settings("fc*: clip_norm=2, error_feedback=off");
  p.active = bit(ControllerKind::kSchedule);
  p.schedule.warmup_steps = 5;
  TensorObservation o;
  o.name = "fc.weight";
  o.elements = 1 << 16;
  o.step = 0;
  const Plan warm = plan_tensor(p, o);
  EXPECT_TRUE(warm.dense);
  EXPECT_FLOAT_EQ(warm.clip_norm, 2.0f);
  EXPECT_EQ(warm.error_feedback, ErrorFeedback::kOff);
  o.step = 5;
  const Plan after = plan_tensor(p, o);
  EXPECT_FALSE(after.dense);
  EXPECT_FLOAT_EQ(after.clip_norm, 2.0f);
  EXPECT_EQ(after.error_feedback, ErrorFeedback::kOff);
}

TEST(GlobMatch, StarAndQuestionMark) {
  EXPECT_TRUE(glob_match("*", ""));
  EXPECT_TRUE(glob_match("embed*", "embed.weight"));
  EXPECT_TRUE(glob_match("*.bias", "layer1.bias"));
  EXPECT_FALSE(glob_match("*.bias", "layer1.bias2"));
  EXPECT_TRUE(glob_match("layer?.w*", "layer3.weight"));
  EXPECT_FALSE(glob_match("layer?.w*", "layer10.weight"));
  EXPECT_TRUE(glob_match("a*b*c", "aXbYbZc"));
}

// Found by tests/fuzz (fuzz_tensor_overrides): a '*' in the glob was matched as a literal
// against a '*' in the name and lost its wildcard meaning.
TEST(GlobMatch, StarStaysAWildcardAgainstALiteralStar) {
  EXPECT_TRUE(glob_match("a*", "a*b"));
  EXPECT_TRUE(glob_match("x*", "x*"));
  EXPECT_TRUE(glob_match("*", "*b"));
  EXPECT_TRUE(glob_match("a*c", "a*bc"));
}

// The fnmatch(3) syntax beyond '*' and '?' (flags 0), against hand-written expectations.
TEST(GlobMatch, BracketSetsAndEscapes) {
  EXPECT_TRUE(glob_match("layer[0-3].weight", "layer2.weight"));
  EXPECT_FALSE(glob_match("layer[0-3].weight", "layer7.weight"));
  EXPECT_TRUE(glob_match("layer[!0-3].weight", "layer7.weight"));
  EXPECT_FALSE(glob_match("layer[!0-3].weight", "layer2.weight"));
  EXPECT_TRUE(glob_match("[qkv]_proj", "k_proj"));
  EXPECT_FALSE(glob_match("[qkv]_proj", "o_proj"));
  EXPECT_TRUE(glob_match("a\\*", "a*"));   // an escaped star is a literal '*'
  EXPECT_FALSE(glob_match("a\\*", "ab"));
  EXPECT_TRUE(glob_match("a\\?", "a?"));
  EXPECT_FALSE(glob_match("a\\?", "ab"));
  EXPECT_TRUE(glob_match("x[", "x["));      // '[' without ']' is literal
}

TEST(GlobMatch, TensorNamesAreNotPaths) {
  EXPECT_TRUE(glob_match("*weight", "module/layer.0/.weight"));  // '*' crosses '/' and '.'
  EXPECT_TRUE(glob_match("?bias", ".bias"));
  EXPECT_TRUE(glob_match("encoder.*.attn", "encoder.layers.0.attn"));
}

TEST(GlobMatch, AnEmbeddedNulNeverMatches) {
  using namespace std::string_view_literals;
  EXPECT_FALSE(glob_match("a*"sv, "a\0b"sv));
  EXPECT_FALSE(glob_match("a\0*"sv, "a"sv));
}

}  // namespace
}  // namespace sparsecar::policies
