#include "sparsecar/kernels/types.h"

#include <gtest/gtest.h>

namespace sparsecar::kernels {
namespace {

TEST(kernelsTypes, WireValuesAreFrozen) {
  // These numbers travel on the wire and in shm; a change here breaks peers of other versions.
  EXPECT_EQ(static_cast<int>(Selector::kNone), 0);
  EXPECT_EQ(static_cast<int>(Selector::kTopk), 1);
  EXPECT_EQ(static_cast<int>(Selector::kThreshold), 2);
  EXPECT_EQ(static_cast<int>(Format::kDense), 0);
  EXPECT_EQ(static_cast<int>(Format::kCoo), 1);
  EXPECT_EQ(static_cast<int>(Format::kCooVarint), 2);
  EXPECT_EQ(static_cast<int>(Format::kBitmap), 3);
  EXPECT_EQ(static_cast<int>(Format::kCsr), 4);
  EXPECT_EQ(static_cast<int>(Format::kRle), 5);
  EXPECT_EQ(static_cast<int>(ValueType::kF32), 0);
  EXPECT_EQ(static_cast<int>(ValueType::kF16), 1);
  EXPECT_EQ(static_cast<int>(ValueType::kBf16), 2);
  EXPECT_EQ(static_cast<int>(ValueType::kI8), 3);
}

TEST(kernelsTypes, NamesParseBack) {
  Selector s = Selector::kNone;
  ASSERT_TRUE(parse_selector("topk", &s));
  EXPECT_EQ(s, Selector::kTopk);
  ASSERT_TRUE(parse_selector("threshold", &s));
  EXPECT_EQ(s, Selector::kThreshold);
  ASSERT_TRUE(parse_selector("none", &s));
  EXPECT_EQ(s, Selector::kNone);
  Format f = Format::kDense;
  ASSERT_TRUE(parse_format("coo", &f));
  EXPECT_EQ(f, Format::kCoo);
  ASSERT_TRUE(parse_format("dense", &f));
  EXPECT_EQ(f, Format::kDense);
  for (Format each : {Format::kDense, Format::kCoo, Format::kCooVarint, Format::kBitmap, Format::kCsr, Format::kRle}) {
    ASSERT_TRUE(parse_format(format_name(each), &f));
    EXPECT_EQ(f, each);
  }
  ValueType v = ValueType::kF32;
  ASSERT_TRUE(parse_value_type("fp32", &v));
  EXPECT_EQ(v, ValueType::kF32);
  for (ValueType each : {ValueType::kF32, ValueType::kF16, ValueType::kBf16, ValueType::kI8}) {
    ASSERT_TRUE(parse_value_type(value_type_name(each), &v));
    EXPECT_EQ(v, each);
  }

  EXPECT_EQ(selector_name(Selector::kTopk), "topk");
  EXPECT_EQ(selector_name(Selector::kThreshold), "threshold");
  EXPECT_EQ(selector_name(Selector::kNone), "none");
  EXPECT_EQ(format_name(Format::kCoo), "coo");
  EXPECT_EQ(format_name(Format::kDense), "dense");
  EXPECT_EQ(value_type_name(ValueType::kF32), "fp32");
}

TEST(kernelsTypes, UnknownNamesAndValues) {
  Selector s = Selector::kThreshold;
  EXPECT_FALSE(parse_selector("TopK", &s));
  EXPECT_FALSE(parse_selector("", &s));
  EXPECT_FALSE(parse_selector("topk ", &s));
  EXPECT_EQ(s, Selector::kThreshold);  // untouched
  Format f = Format::kCoo;
  EXPECT_FALSE(parse_format("auto", &f));  // a plan choice, not a wire format
  EXPECT_FALSE(parse_format("Bitmap", &f));
  EXPECT_EQ(f, Format::kCoo);
  ValueType v = ValueType::kF32;
  EXPECT_FALSE(parse_value_type("fp8", &v));
  EXPECT_EQ(selector_name(static_cast<Selector>(99)), "unknown");
  EXPECT_EQ(format_name(static_cast<Format>(99)), "unknown");
  EXPECT_EQ(value_type_name(static_cast<ValueType>(99)), "unknown");
}

}  // namespace
}  // namespace sparsecar::kernels
