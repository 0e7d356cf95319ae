// Every format x value type x selection pattern: round trips against a plain reference (exact for
// fp32, within the documented bound otherwise), exact sizes, `auto` picking the smallest, golden
// bytes written by hand from the layouts in codec.h, and every decoder rejecting malformed
// payloads with kDataLoss while leaving the output untouched.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "sparsecar/kernels/codec.h"
#include "tests/unit/kernels/test_util.h"

namespace sparsecar::kernels {
namespace {

constexpr Format kFormats[] = {Format::kDense, Format::kCoo, Format::kCooVarint,
                               Format::kBitmap, Format::kCsr, Format::kRle};
constexpr ValueType kValueTypes[] = {ValueType::kF32, ValueType::kF16, ValueType::kBf16, ValueType::kI8};

std::vector<std::byte> bytes_of(std::initializer_list<int> b) {
  std::vector<std::byte> out;
  for (int v : b) out.push_back(static_cast<std::byte>(v));
  return out;
}
std::vector<std::byte> cat(std::vector<std::byte> a, const std::vector<std::byte>& b) {
  a.insert(a.end(), b.begin(), b.end());
  return a;
}

struct Pattern {
  std::string name;
  size_t n;
  uint32_t rows;  // for CSR (n % rows == 0)
  std::vector<uint32_t> index;
};

std::vector<uint32_t> random_subset(size_t n, double density, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::bernoulli_distribution keep(density);
  std::vector<uint32_t> out;
  for (size_t i = 0; i < n; ++i) {
    if (keep(rng)) out.push_back(static_cast<uint32_t>(i));
  }
  return out;
}

std::vector<Pattern> patterns() {
  std::vector<Pattern> p;
  p.push_back({"empty", 1000, 10, {}});
  p.push_back({"empty_tensor", 0, 1, {}});
  p.push_back({"first", 1000, 10, {0}});
  p.push_back({"last", 1001, 7, {1000}});
  p.push_back({"first_and_last", 1003, 17, {0, 1002}});
  p.push_back({"all", 257, 1, [] {
                 std::vector<uint32_t> v(257);
                 for (uint32_t i = 0; i < 257; ++i) v[i] = i;
                 return v;
               }()});
  p.push_back({"alternate", 999, 9, [] {
                 std::vector<uint32_t> v;
                 for (uint32_t i = 1; i < 999; i += 2) v.push_back(i);
                 return v;
               }()});
  p.push_back({"blocks_of_32", 4096, 16, [] {
                 std::vector<uint32_t> v;
                 for (uint32_t b = 0; b < 128; b += 5) {
                   for (uint32_t i = 0; i < 32; ++i) v.push_back(32 * b + i);
                 }
                 return v;
               }()});
  // Gaps of 1, 2 and 3 varint bytes; CSR with uint32 columns (2 rows of 2^20 + 1).
  p.push_back({"wide_gaps", (size_t{1} << 21) + 2, 2, {0, 127, 128, 16383, 16384 + 16383, 2097151, 1u << 21}});
  p.push_back({"random_0.1pct", 100000, 100, random_subset(100000, 0.001, 1)});
  p.push_back({"random_1pct", 100000, 1000, random_subset(100000, 0.01, 2)});
  p.push_back({"random_10pct", 50000, 50, random_subset(50000, 0.1, 3)});
  p.push_back({"random_60pct", 10000, 100, random_subset(10000, 0.6, 4)});
  p.push_back({"wide_rows_u32_columns", 3 * 70000, 3, random_subset(3 * 70000, 0.01, 5)});
  return p;
}

std::vector<float> values_for(size_t k, uint64_t seed) {
  auto v = testing::normal_floats(k, seed, 3.0f);
  // A few magnitudes across the fp16 range and its edges.
  if (k > 3) {
    v[0] = 70000.0f;  // saturates in fp16
    v[1] = -1e-6f;    // fp16 subnormal
    v[2] = 0.0f;
  }
  return v;
}

// The documented bound on |decoded - x|, for value type vt, given every value of the message.
float bound(ValueType vt, float x, float max_abs) {
  const float ax = std::fabs(x);
  switch (vt) {
    case ValueType::kF32: return 0.0f;
    case ValueType::kF16:
      if (ax > 65504.0f) return ax - 65504.0f;
      return ax >= 6.103515625e-05f ? std::ldexp(ax, -11) : std::ldexp(1.0f, -25);
    case ValueType::kBf16: return ax >= std::numeric_limits<float>::min() ? std::ldexp(ax, -8) : std::ldexp(1.0f, -134);
    case ValueType::kI8: return (0.5f + std::ldexp(1.0f, -12)) * (max_abs / 127.0f) + std::ldexp(1.0f, -140);
  }
  return 0.0f;
}

EncodeParams params(Format f, ValueType vt, uint32_t rows = 1) {
  EncodeParams p;
  p.format = f;
  p.value_type = vt;
  p.rows = rows;
  return p;
}

std::vector<std::byte> must_encode(const EncodeParams& p, size_t n, const std::vector<uint32_t>& index,
                                   const std::vector<float>& value) {
  auto size = encoded_size(p, n, index);
  EXPECT_TRUE(size.ok()) << size.status().to_string();
  std::vector<std::byte> out(size.ok() ? *size : 0);
  auto wrote = encode(p, n, index, value, out);
  EXPECT_TRUE(wrote.ok()) << wrote.status().to_string();
  if (wrote.ok()) {
    EXPECT_EQ(*wrote, out.size());
  }
  return out;
}

TEST(kernelsCodecFormats, EveryPatternFormatAndValueTypeRoundTrips) {
  for (const Pattern& pat : patterns()) {
    const auto value = values_for(pat.index.size(), pat.n + 7);
    const auto base = testing::normal_floats(pat.n, pat.n + 11);
    // Reference per value type (it does not depend on the format): a plain scatter of what
    // quantize_roundtrip says every receiver decodes, onto base. Built once per pattern and value
    // type rather than once per format, and `got` is one buffer refilled from base (fresh copies
    // of the 8 MiB patterns, with ASan's allocations and page faults, were half the test's time).
    std::vector<std::vector<float>> expect_values(std::size(kValueTypes)), want(std::size(kValueTypes));
    for (size_t v = 0; v < std::size(kValueTypes); ++v) {
      SCOPED_TRACE(pat.name + " " + std::string(value_type_name(kValueTypes[v])));
      expect_values[v].resize(value.size());
      ASSERT_TRUE(quantize_roundtrip(kValueTypes[v], value, expect_values[v]).ok());
      want[v] = base;
      for (size_t j = 0; j < pat.index.size(); ++j) want[v][pat.index[j]] += expect_values[v][j];
    }
    std::vector<float> got(pat.n);
    for (Format f : kFormats) {
      for (size_t v = 0; v < std::size(kValueTypes); ++v) {
        const ValueType vt = kValueTypes[v];
        SCOPED_TRACE(pat.name + " " + std::string(format_name(f)) + "/" + std::string(value_type_name(vt)));
        const auto p = params(f, vt, pat.rows);
        const auto payload = must_encode(p, pat.n, pat.index, value);
        const uint64_t nnz = f == Format::kDense ? pat.n : pat.index.size();
        EXPECT_TRUE(payload_size_range(f, vt, pat.n, nnz).contains(payload.size()))
            << payload.size() << " not in the range the wire layer allows";
        EXPECT_LE(payload.size(), max_encoded_bytes(pat.n));

        std::copy(base.begin(), base.end(), got.begin());
        const Status s = decode_accumulate(f, vt, payload, nnz, got);
        ASSERT_TRUE(s.ok()) << s.to_string();
        size_t first_diff = pat.n;
        const std::vector<float>& w = want[v];
        for (size_t i = 0; i < pat.n && first_diff == pat.n; ++i) {
          if (!testing::same_bits(got[i], w[i]) && !(std::isnan(got[i]) && std::isnan(w[i]))) first_diff = i;
        }
        ASSERT_EQ(first_diff, pat.n) << "element " << first_diff << ": " << got[first_diff] << " vs "
                                     << w[first_diff];
        // The quantisation bound itself.
        float max_abs = 0.0f;
        for (float x : value) max_abs = std::max(max_abs, std::fabs(x));
        for (size_t j = 0; j < value.size(); ++j) {
          ASSERT_LE(std::fabs(expect_values[v][j] - value[j]), bound(vt, value[j], max_abs))
              << "value " << j << " = " << value[j] << " decodes to " << expect_values[v][j];
        }
      }
    }
  }
}

TEST(kernelsCodecFormats, Fp32IsExactIncludingSpecialValues) {
  const size_t n = 512;
  const auto index = random_subset(n, 0.5, 9);
  const auto value = testing::special_floats(index.size(), 10);
  for (Format f : kFormats) {
    SCOPED_TRACE(format_name(f));
    const auto payload = must_encode(params(f, ValueType::kF32, 8), n, index, value);
    std::vector<float> got(n, 0.0f);
    ASSERT_TRUE(decode_accumulate(f, ValueType::kF32, payload, f == Format::kDense ? n : index.size(), got).ok());
    for (size_t j = 0; j < index.size(); ++j) {
      const float want = 0.0f + value[j];
      ASSERT_TRUE(testing::same_bits(got[index[j]], want) || (std::isnan(want) && std::isnan(got[index[j]]))) << j;
    }
  }
}

TEST(kernelsCodecFormats, HalfAndBfloatConversions) {
  EXPECT_EQ(float_to_half(1.0f), 0x3c00);
  EXPECT_EQ(float_to_half(-2.0f), 0xc000);
  EXPECT_EQ(float_to_half(65504.0f), 0x7bff);
  EXPECT_EQ(float_to_half(1e9f), 0x7bff);    // saturates
  EXPECT_EQ(float_to_half(-1e9f), 0xfbff);
  EXPECT_EQ(float_to_half(std::numeric_limits<float>::infinity()), 0x7c00);
  EXPECT_EQ(float_to_half(5.9604644775390625e-8f), 0x0001);  // smallest subnormal
  EXPECT_EQ(float_to_half(2.9802322387695312e-8f), 0x0000);  // half of it: ties to even (0)
  EXPECT_EQ(float_to_half(1.0f + std::ldexp(1.0f, -11)), 0x3c00);  // tie -> even
  EXPECT_EQ(float_to_half(1.0f + 3 * std::ldexp(1.0f, -11)), 0x3c02);  // tie -> even (up)
  EXPECT_TRUE(std::isnan(half_to_float(float_to_half(std::nanf("")))));
  EXPECT_EQ(float_to_bf16(1.0f), 0x3f80);
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7f7f);  // saturates, not inf
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
  // Every half converts back exactly (no double rounding in the round trip).
  for (uint32_t h = 0; h < 0x10000; ++h) {
    const float f = half_to_float(static_cast<uint16_t>(h));
    if (std::isnan(f)) continue;
    ASSERT_EQ(float_to_half(f), h) << std::hex << h;
  }
}

// fp32 -> fp16 against WIRE.md's rule computed independently of the code under test (which is the
// compiler's _Float16 conversion on GCC, integer code elsewhere): the nearest value of the half
// grid, ties to the even pattern; |x| >= 65504 saturates; inf kept; NaN quiet with the top
// payload bits. Inputs: ~1M patterns spread over every exponent, every tie between adjacent
// halves and its neighbours one float ulp away, and the whole fp16 encode/decode path.
TEST(kernelsCodecFormats, HalfConversionFollowsTheWireRule) {
  std::vector<double> grid;  // the non-negative finite halves, ascending by pattern and value
  for (uint32_t h = 0; h < 0x7c00; ++h) grid.push_back(std::ldexp(double(h & 0x3ff) + (h >> 10 ? 1024 : 0), (h >> 10 ? int(h >> 10) : 1) - 25));
  auto expected = [&](float x) -> uint16_t {
    const uint32_t bits = std::bit_cast<uint32_t>(x);
    const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
    const uint32_t ax = bits & 0x7fffffffu;
    if (ax > 0x7f800000u) return static_cast<uint16_t>(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
    if (ax == 0x7f800000u) return static_cast<uint16_t>(sign | 0x7c00u);
    const double a = std::fabs(double(x));
    if (a >= 65504.0) return static_cast<uint16_t>(sign | 0x7bffu);
    const size_t hi = static_cast<size_t>(std::lower_bound(grid.begin(), grid.end(), a) - grid.begin());
    if (grid[hi] == a) return static_cast<uint16_t>(sign | hi);
    const size_t lo = hi - 1;
    const double dlo = a - grid[lo], dhi = grid[hi] - a;
    const size_t pick = dlo < dhi ? lo : dhi < dlo ? hi : (lo % 2 == 0 ? lo : hi);
    return static_cast<uint16_t>(sign | pick);
  };
  std::vector<float> inputs;
  for (uint64_t b = 0; b <= 0xffffffffull; b += 4099) inputs.push_back(std::bit_cast<float>(static_cast<uint32_t>(b)));
  for (size_t h = 0; h + 1 < grid.size(); ++h) {
    const float tie = static_cast<float>((grid[h] + grid[h + 1]) / 2);  // exact: 12 significant bits
    for (float x : {tie, std::nextafter(tie, 0.0f), std::nextafter(tie, 1e9f)}) {
      inputs.push_back(x);
      inputs.push_back(-x);
    }
  }
  for (float x : {65504.0f, 65519.99f, 65520.0f, 1e30f, 6.1035156e-05f, 6.1035153e-05f}) inputs.push_back(x);
  for (float x : inputs) ASSERT_EQ(float_to_half(x), expected(x)) << std::hexfloat << x;
  // The encoders' loops (an F16C clone where the CPU has one) give the same bits.
  std::vector<float> out(inputs.size());
  ASSERT_TRUE(quantize_roundtrip(ValueType::kF16, inputs, out).ok());
  for (size_t i = 0; i < inputs.size(); ++i) {
    const float want = half_to_float(expected(inputs[i]));
    ASSERT_EQ(std::bit_cast<uint32_t>(out[i]), std::bit_cast<uint32_t>(want)) << std::hexfloat << inputs[i];
  }
}

TEST(kernelsCodecFormats, Int8NonFiniteValuesMakeTheWholeMessageNaN) {
  const std::vector<uint32_t> index = {1, 4};
  const std::vector<float> value = {1.0f, std::numeric_limits<float>::infinity()};
  const auto payload = must_encode(params(Format::kCoo, ValueType::kI8), 8, index, value);
  std::vector<float> got(8, 0.0f);
  ASSERT_TRUE(decode_accumulate(Format::kCoo, ValueType::kI8, payload, 2, got).ok());
  EXPECT_TRUE(std::isnan(got[1]));
  EXPECT_TRUE(std::isnan(got[4]));
  EXPECT_EQ(got[0], 0.0f);
}

TEST(kernelsCodecFormats, AutoNeverPicksALargerFormatThanAnyCandidate) {
  for (const Pattern& pat : patterns()) {
    for (ValueType vt : kValueTypes) {
      for (uint32_t rows : {1u, pat.rows, 3u}) {
        SCOPED_TRACE(pat.name + " " + std::string(value_type_name(vt)) + " rows " + std::to_string(rows));
        auto choice = choose_format(vt, rows, pat.n, pat.index);
        ASSERT_TRUE(choice.ok()) << choice.status().to_string();
        for (Format f : kFormats) {
          auto size = encoded_size(params(f, vt, rows), pat.n, pat.index);
          if (!size.ok()) {
            EXPECT_EQ(f, Format::kCsr);  // only CSR can be unusable (rows not dividing n)
            EXPECT_EQ(choice->bytes_by_format[static_cast<int>(f)], std::numeric_limits<size_t>::max());
            continue;
          }
          EXPECT_EQ(choice->bytes_by_format[static_cast<int>(f)], *size) << format_name(f);
          EXPECT_LE(choice->bytes, *size) << "auto chose " << format_name(choice->format) << " over "
                                          << format_name(f);
        }
        // The picked size is the real size of the picked encoding.
        const auto value = values_for(pat.index.size(), 1);
        EXPECT_EQ(must_encode(params(choice->format, vt, rows), pat.n, pat.index, value).size(), choice->bytes);
      }
    }
  }
}

TEST(kernelsCodecFormats, AutoPicksTheExpectedFormatForTypicalSelections) {
  const size_t n = 1 << 20;
  auto pick = [&](const std::vector<uint32_t>& index) {
    return choose_format(ValueType::kF32, 1, n, index).value().format;
  };
  EXPECT_EQ(pick(random_subset(n, 0.001, 1)), Format::kCooVarint);  // sparse: 1-2 byte gaps
  EXPECT_EQ(pick(random_subset(n, 0.5, 2)), Format::kBitmap);
  // Nearly everything: one run per zero beats a dense payload; only "all" is dense.
  EXPECT_EQ(pick(random_subset(n, 0.97, 3)), Format::kRle);
  std::vector<uint32_t> all(n);
  for (uint32_t i = 0; i < n; ++i) all[i] = i;
  EXPECT_EQ(pick(all), Format::kDense);
  std::vector<uint32_t> blocks;
  for (uint32_t b = 0; b < n / 256; b += 10) {
    for (uint32_t i = 0; i < 256; ++i) blocks.push_back(256 * b + i);
  }
  EXPECT_EQ(pick(blocks), Format::kRle);
}

// ---- golden bytes: dense length 10, index {1, 2, 3, 7}, values {1, -2, 0.5, 4} ----------------
const std::vector<uint32_t> kGoldIndex = {1, 2, 3, 7};
const std::vector<float> kGoldValue = {1.0f, -2.0f, 0.5f, 4.0f};
const std::vector<std::byte> kGoldF32 = bytes_of({0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x00, 0xc0,
                                                  0x00, 0x00, 0x00, 0x3f, 0x00, 0x00, 0x80, 0x40});

TEST(kernelsCodecFormats, GoldenBytesOfEveryFormat) {
  const size_t n = 10;
  struct Golden {
    Format format;
    uint32_t rows;
    std::vector<std::byte> bytes;
  };
  const std::vector<Golden> golden = {
      {Format::kCoo, 1,
       cat(bytes_of({0x01, 0, 0, 0, 0x02, 0, 0, 0, 0x03, 0, 0, 0, 0x07, 0, 0, 0}), kGoldF32)},
      // values, then gaps 1, 0, 0, 3 (index - previous index - 1)
      {Format::kCooVarint, 1, cat(kGoldF32, bytes_of({0x01, 0x00, 0x00, 0x03}))},
      // bits 1, 2, 3, 7 -> 0b1000'1110; bits 8, 9 clear
      {Format::kBitmap, 1, cat(bytes_of({0x8e, 0x00}), kGoldF32)},
      // rows 2, cols 5, row ends {3, 4}, uint16 columns {1, 2, 3, 2}
      {Format::kCsr, 2,
       cat(bytes_of({0x02, 0, 0, 0, 0x05, 0, 0, 0, 0x03, 0, 0, 0, 0x04, 0, 0, 0, 0x01, 0, 0x02, 0, 0x03, 0, 0x02, 0}),
           kGoldF32)},
      // runs [1, 4) and [7, 8): (gap 1, length 3), (gap 3, length 1)
      {Format::kRle, 1, cat(kGoldF32, bytes_of({0x01, 0x03, 0x03, 0x01}))},
      {Format::kDense, 1,
       bytes_of({0, 0, 0, 0, 0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x00, 0xc0, 0x00, 0x00, 0x00, 0x3f, 0, 0, 0, 0,
                 0, 0, 0, 0, 0, 0, 0, 0, 0x00, 0x00, 0x80, 0x40, 0, 0, 0, 0, 0, 0, 0, 0})},
  };
  for (const Golden& g : golden) {
    SCOPED_TRACE(format_name(g.format));
    EXPECT_EQ(must_encode(params(g.format, ValueType::kF32, g.rows), n, kGoldIndex, kGoldValue), g.bytes);
    std::vector<float> got(n, 0.0f);
    ASSERT_TRUE(
        decode_accumulate(g.format, ValueType::kF32, g.bytes, g.format == Format::kDense ? n : 4, got).ok());
    EXPECT_EQ(got, (std::vector<float>{0, 1, -2, 0.5f, 0, 0, 0, 4, 0, 0}));
  }
}

TEST(kernelsCodecFormats, GoldenBytesOfEveryValueType) {
  const auto coo_index = bytes_of({0x01, 0, 0, 0, 0x02, 0, 0, 0, 0x03, 0, 0, 0, 0x07, 0, 0, 0});
  // fp16: 1 = 0x3c00, -2 = 0xc000, 0.5 = 0x3800, 4 = 0x4400
  EXPECT_EQ(must_encode(params(Format::kCoo, ValueType::kF16), 10, kGoldIndex, kGoldValue),
            cat(coo_index, bytes_of({0x00, 0x3c, 0x00, 0xc0, 0x00, 0x38, 0x00, 0x44})));
  // bf16: the top halves of the fp32 values
  EXPECT_EQ(must_encode(params(Format::kCoo, ValueType::kBf16), 10, kGoldIndex, kGoldValue),
            cat(coo_index, bytes_of({0x80, 0x3f, 0x00, 0xc0, 0x00, 0x3f, 0x80, 0x40})));
  // int8: scale = 4 / 127 = 0x3d010204; codes 32, -64 (-63.5 ties to even), 16, 127
  EXPECT_EQ(must_encode(params(Format::kCoo, ValueType::kI8), 10, kGoldIndex, kGoldValue),
            cat(coo_index, bytes_of({0x04, 0x02, 0x01, 0x3d, 0x20, 0xc0, 0x10, 0x7f})));
  // A two-byte varint: indices {5, 300} -> gaps 5, 294 = 0xa6 0x02.
  EXPECT_EQ(must_encode(params(Format::kCooVarint, ValueType::kBf16), 1000, {5, 300}, {1.0f, 1.0f}),
            bytes_of({0x80, 0x3f, 0x80, 0x3f, 0x05, 0xa6, 0x02}));
}

// ---- rejection of malformed payloads ---------------------------------------------------------
struct Bad {
  std::string what;
  Format format;
  ValueType value_type;
  std::vector<std::byte> payload;
  uint64_t nnz;
  std::string field;  // must appear in the message
};

void expect_rejected(const Bad& b, size_t n) {
  SCOPED_TRACE(std::string(format_name(b.format)) + ": " + b.what);
  auto out = testing::normal_floats(n, 77);
  const auto before = out;
  const Status s = decode_accumulate(b.format, b.value_type, b.payload, b.nnz, out);
  EXPECT_EQ(s.code(), Code::kDataLoss) << s.to_string();
  EXPECT_NE(s.message().find(b.field), std::string::npos) << s.message();
  if (n > 0) {
    EXPECT_EQ(std::memcmp(out.data(), before.data(), n * sizeof(float)), 0) << "output was touched";
  }
}

std::vector<std::byte> good(Format f, ValueType vt = ValueType::kF32) {
  return must_encode(params(f, vt, 2), 10, kGoldIndex, kGoldValue);
}
std::vector<std::byte> with(std::vector<std::byte> b, size_t at, int v) {
  b.at(at) = static_cast<std::byte>(v);
  return b;
}
std::vector<std::byte> dropped(std::vector<std::byte> b, size_t count = 1) {
  b.resize(b.size() - count);
  return b;
}
std::vector<std::byte> grown(std::vector<std::byte> b, size_t count = 1) {
  b.resize(b.size() + count, std::byte{0});
  return b;
}

TEST(kernelsCodecFormats, EveryDecoderRejectsMalformedPayloadsAndWritesNothing) {
  const auto F = ValueType::kF32;
  std::vector<Bad> bad;
  // Generic: truncated, oversized, wrong count, for every format and value type.
  for (Format f : kFormats) {
    for (ValueType vt : kValueTypes) {
      const auto g = good(f, vt);
      const uint64_t nnz = f == Format::kDense ? 10 : 4;
      bad.push_back({"truncated", f, vt, dropped(g), nnz, ""});
      bad.push_back({"oversized", f, vt, grown(g), nnz, ""});
      bad.push_back({"nnz one less", f, vt, g, nnz - 1, ""});
      bad.push_back({"nnz one more", f, vt, g, nnz + 1, ""});
      bad.push_back({"nnz huge", f, vt, g, std::numeric_limits<uint64_t>::max(), "nnz"});
      bad.push_back({"empty payload", f, vt, {}, nnz, ""});
    }
  }
  bad.push_back({"unknown value type", Format::kCoo, static_cast<ValueType>(9), good(Format::kCoo), 4, "value_type"});
  bad.push_back({"unknown format", static_cast<Format>(6), F, good(Format::kCoo), 4, "format"});
  // COO
  bad.push_back({"index == dense length", Format::kCoo, F, with(good(Format::kCoo), 12, 10), 4, "index[3]"});
  bad.push_back({"index far out", Format::kCoo, F, with(good(Format::kCoo), 3, 0x80), 4, "index[0]"});
  bad.push_back({"repeated index", Format::kCoo, F, with(good(Format::kCoo), 4, 1), 4, "index[1]"});
  bad.push_back({"decreasing index", Format::kCoo, F, with(good(Format::kCoo), 8, 0), 4, "index[2]"});
  // COO varint (varints start at byte 16)
  const auto cv = good(Format::kCooVarint);
  bad.push_back({"index out of range", Format::kCooVarint, F, with(cv, 19, 6), 4, "index[3]"});
  bad.push_back({"overlong varint", Format::kCooVarint, F, cat(dropped(cv), bytes_of({0x83, 0x00})), 4, "varint"});
  bad.push_back({"varint over 32 bits", Format::kCooVarint, F,
                 cat(dropped(cv), bytes_of({0xff, 0xff, 0xff, 0xff, 0x1f})), 4, "varint"});
  bad.push_back({"varint of 6 bytes", Format::kCooVarint, F,
                 cat(dropped(cv), bytes_of({0x80, 0x80, 0x80, 0x80, 0x80, 0x01})), 4, "varint"});
  bad.push_back({"truncated varint", Format::kCooVarint, F, with(cv, 19, 0x83), 4, "varint"});
  bad.push_back({"bytes after the indices", Format::kCooVarint, F, cat(cv, bytes_of({0x00})), 4, "bytes after"});
  // Bitmap
  const auto bm = good(Format::kBitmap);
  bad.push_back({"bit past the dense length", Format::kBitmap, F, with(with(bm, 1, 0x04), 0, 0x0e), 4, "past the dense"});
  bad.push_back({"more bits than nnz", Format::kBitmap, F, with(bm, 0, 0x8f), 4, "bits set"});
  bad.push_back({"fewer bits than nnz", Format::kBitmap, F, with(bm, 0, 0x0e), 4, "bits set"});
  // CSR (rows 2, cols 5): rows at 0, cols at 4, row ends at 8 and 12, columns at 16..23
  const auto csr = good(Format::kCsr);
  bad.push_back({"rows x cols != n", Format::kCsr, F, with(csr, 4, 4), 4, "rows"});
  bad.push_back({"zero rows", Format::kCsr, F, with(csr, 0, 0), 4, "rows"});
  bad.push_back({"row ends decrease", Format::kCsr, F, with(with(csr, 8, 4), 12, 3), 4, "row_end"});
  bad.push_back({"last row end != nnz", Format::kCsr, F, with(csr, 12, 3), 4, "row_end"});
  bad.push_back({"column out of range", Format::kCsr, F, with(csr, 22, 5), 4, "column index[3]"});
  bad.push_back({"columns not increasing", Format::kCsr, F, with(csr, 18, 1), 4, "column index[1]"});
  // RLE (runs at byte 16: 01 03 03 01)
  const auto rle = good(Format::kRle);
  bad.push_back({"run of length 0", Format::kRle, F, with(rle, 17, 0), 4, "length 0"});
  bad.push_back({"gap 0 after a run", Format::kRle, F, with(with(with(rle, 17, 2), 18, 0), 19, 2), 4, "gap 0"});
  bad.push_back({"run past the end", Format::kRle, F, with(rle, 18, 6), 4, "ends past"});
  bad.push_back({"runs hold fewer than nnz", Format::kRle, F, with(rle, 17, 2), 4, "runs hold"});
  bad.push_back({"runs hold more than nnz", Format::kRle, F, with(rle, 19, 2), 4, "more than nnz"});
  bad.push_back({"truncated run", Format::kRle, F, dropped(rle), 4, "length varint"});
  // Dense
  bad.push_back({"nnz != dense length", Format::kDense, F, good(Format::kDense), 4, "nnz"});
  // int8 value blocks (COO: scale at byte 16, codes 20..23)
  const auto i8 = good(Format::kCoo, ValueType::kI8);
  bad.push_back({"negative scale", Format::kCoo, ValueType::kI8, with(i8, 19, 0xbd), 4, "scale"});
  bad.push_back({"infinite scale", Format::kCoo, ValueType::kI8,
                 cat(dropped(i8, 8), bytes_of({0x00, 0x00, 0x80, 0x7f, 1, 1, 1, 1})), 4, "scale"});
  bad.push_back({"code -128", Format::kCoo, ValueType::kI8, with(i8, 21, 0x80), 4, "-128"});
  for (const Bad& b : bad) expect_rejected(b, 10);
}

// An empty tensor's CSR payload has one row (the encoder's rule); rows * cols = 0 holds for any
// row count once cols is 0, so the decoder must check the count itself. A fuzzer found a payload of
// 3 empty rows that the decoder took and the wire's size pre-check did not.
TEST(kernelsCodecFormats, AnEmptyTensorsCsrPayloadHasOneRow) {
  for (ValueType vt : kValueTypes) {
    SCOPED_TRACE(static_cast<int>(vt));
    const auto one_row = must_encode(params(Format::kCsr, vt, 1), 0, {}, {});
    ASSERT_GE(one_row.size(), 12u);
    std::vector<float> out;
    EXPECT_TRUE(decode_accumulate(Format::kCsr, vt, one_row, 0, out).ok());
    EXPECT_TRUE(payload_size_range(Format::kCsr, vt, 0, 0).contains(one_row.size()));
    // Three rows of nothing: rows = 3, two more zero row ends before the (empty) columns.
    auto three_rows = with(one_row, 0, 3);
    three_rows.insert(three_rows.begin() + 12, 8, std::byte{0});
    expect_rejected({"rows for an empty tensor", Format::kCsr, vt, three_rows, 0, "empty tensor"}, 0);
    EXPECT_FALSE(payload_size_range(Format::kCsr, vt, 0, 0).contains(three_rows.size()));
  }
}

// Random single-byte corruptions and truncations of valid payloads: every decoder either accepts
// (the bytes still form a valid payload) or rejects with kDataLoss and writes nothing. A small,
// deterministic cousin of the fuzzers in tests/fuzz/.
TEST(kernelsCodecFormats, RandomCorruptionsNeverCrashAndNeverHalfWrite) {
  std::mt19937_64 rng(5);
  const size_t n = 300;
  const auto index = random_subset(n, 0.1, 6);
  const auto value = values_for(index.size(), 7);
  for (Format f : kFormats) {
    for (ValueType vt : kValueTypes) {
      const auto g = must_encode(params(f, vt, 3), n, index, value);
      const uint64_t nnz = f == Format::kDense ? n : index.size();
      for (int trial = 0; trial < 300; ++trial) {
        auto b = g;
        const int kind = static_cast<int>(rng() % 3);
        if (kind == 0 && !b.empty()) {
          b[rng() % b.size()] = static_cast<std::byte>(rng());
        } else if (kind == 1 && !b.empty()) {
          b.resize(rng() % b.size());
        } else {
          b.push_back(static_cast<std::byte>(rng()));
        }
        std::vector<float> out(n, 1.0f);
        const Status s = decode_accumulate(f, vt, b, nnz, out);
        if (!s.ok()) {
          ASSERT_EQ(s.code(), Code::kDataLoss);
          ASSERT_TRUE(std::all_of(out.begin(), out.end(), [](float v) { return v == 1.0f; }));
        }
      }
    }
  }
}

TEST(kernelsCodecFormats, EncodersRejectBadSelections) {
  std::vector<std::byte> out(1024);
  for (Format f : kFormats) {
    SCOPED_TRACE(format_name(f));
    EXPECT_EQ(encode(params(f, ValueType::kF32), 10, std::vector<uint32_t>{1, 10}, std::vector<float>{1, 2}, out)
                  .status()
                  .code(),
              Code::kInvalidArgument);
    EXPECT_EQ(encode(params(f, ValueType::kF32), 10, std::vector<uint32_t>{3, 3}, std::vector<float>{1, 2}, out)
                  .status()
                  .code(),
              Code::kInvalidArgument);
    EXPECT_EQ(encode(params(f, ValueType::kF32), 10, std::vector<uint32_t>{3}, std::vector<float>{1, 2}, out)
                  .status()
                  .code(),
              Code::kInvalidArgument);
    EXPECT_EQ(encode(params(f, ValueType::kF32), 10, kGoldIndex, kGoldValue, std::span<std::byte>(out.data(), 5))
                  .status()
                  .code(),
              Code::kInvalidArgument);
  }
  EXPECT_EQ(encoded_size(params(Format::kCsr, ValueType::kF32, 3), 10, kGoldIndex).status().code(),
            Code::kInvalidArgument);
  EXPECT_EQ(encoded_size(params(Format::kCsr, ValueType::kF32, 0), 10, kGoldIndex).status().code(),
            Code::kInvalidArgument);
  EXPECT_EQ(encoded_size(params(static_cast<Format>(6), ValueType::kF32), 10, kGoldIndex).status().code(),
            Code::kInvalidArgument);
}

TEST(kernelsCodecFormats, PayloadSizeRanges) {
  EXPECT_EQ(payload_size_range(Format::kCoo, ValueType::kF32, 1000, 10).min, 80u);
  EXPECT_EQ(payload_size_range(Format::kCoo, ValueType::kF32, 1000, 10).max, 80u);
  EXPECT_EQ(payload_size_range(Format::kCoo, ValueType::kI8, 1000, 10).max, 54u);
  EXPECT_EQ(payload_size_range(Format::kBitmap, ValueType::kF16, 1001, 10).max, 126u + 20u);
  EXPECT_EQ(payload_size_range(Format::kCooVarint, ValueType::kF32, 1000, 10).min, 50u);
  EXPECT_EQ(payload_size_range(Format::kCooVarint, ValueType::kF32, 1000, 10).max, 90u);
  EXPECT_FALSE(payload_size_range(Format::kDense, ValueType::kF32, 10, 9).contains(40));
  EXPECT_FALSE(payload_size_range(Format::kCoo, ValueType::kF32, 10, 11).contains(88));
  EXPECT_FALSE(payload_size_range(static_cast<Format>(6), ValueType::kF32, 10, 1).contains(8));
  EXPECT_EQ(max_encoded_bytes(0), 16u);  // csr: rows, cols, one row end, int8 scale
}

}  // namespace
}  // namespace sparsecar::kernels
