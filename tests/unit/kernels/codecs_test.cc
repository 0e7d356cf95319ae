// The codec registry (kernels/codecs.h): frozen ids and names, the rows' invariants, every row's
// functions agreeing with each other and with a plain reference over every value type, the
// public API routing to the row, and `auto` against a brute-force reference.
#include "sparsecar/kernels/codecs.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "sparsecar/kernels/codec.h"
#include "sparsecar/kernels/parallel.h"
#include "tests/unit/kernels/test_util.h"

namespace sparsecar::kernels {
namespace {

using testing::same_bits;

TEST(kernelsCodecs, IdsAndNamesAreFrozen) {
  // Written out by hand: a renumbered or renamed row fails here (WIRE.md "Payload layouts").
  const std::vector<std::pair<int, std::string>> formats = {{0, "dense"}, {1, "coo"}, {2, "coo_varint"},
                                                            {3, "bitmap"}, {4, "csr"}, {5, "rle"}};
  const auto rows = codec_registry();
  ASSERT_GE(rows.size(), formats.size());
  for (const auto& [id, name] : formats) {
    EXPECT_EQ(static_cast<int>(rows[static_cast<size_t>(id)].id), id);
    EXPECT_EQ(rows[static_cast<size_t>(id)].name, name);
    EXPECT_EQ(format_name(static_cast<Format>(id)), name);
  }
  const std::vector<std::pair<int, std::string>> types = {{0, "fp32"}, {1, "fp16"}, {2, "bf16"}, {3, "int8"}};
  const auto vts = value_type_registry();
  ASSERT_EQ(vts.size(), types.size());
  for (const auto& [id, name] : types) {
    EXPECT_EQ(static_cast<int>(vts[static_cast<size_t>(id)].id), id);
    EXPECT_EQ(value_type_name(static_cast<ValueType>(id)), name);
  }
  EXPECT_EQ(rows.size(), static_cast<size_t>(kFormatCount));
  EXPECT_EQ(vts.size(), static_cast<size_t>(kValueTypeCount));
}

TEST(kernelsCodecs, RowsAreInIdOrderWithUniqueNamesThatParseBack) {
  std::set<std::string> names;
  std::set<int> ranks;
  const auto rows = codec_registry();
  for (size_t i = 0; i < rows.size(); ++i) {
    const CodecInfo& row = rows[i];
    EXPECT_EQ(static_cast<size_t>(row.id), i);
    EXPECT_TRUE(names.insert(row.name).second) << row.name;
    EXPECT_TRUE(ranks.insert(row.auto_rank).second) << row.name << ": auto_rank " << int{row.auto_rank} << " taken";
    EXPECT_EQ(find_codec(row.id), &row);
    EXPECT_EQ(find_codec(std::string_view(row.name)), &row);
    Format parsed = Format::kCoo;
    ASSERT_TRUE(parse_format(row.name, &parsed)) << row.name;
    EXPECT_EQ(parsed, row.id);
    EXPECT_GT(std::string(row.doc).size(), 10u) << row.name;
    EXPECT_NE(row.size, nullptr) << row.name;
    EXPECT_NE(row.encode, nullptr) << row.name;
    EXPECT_NE(row.size_range, nullptr) << row.name;
    EXPECT_NE(row.decode, nullptr) << row.name;
  }
  EXPECT_EQ(find_codec(static_cast<Format>(rows.size())), nullptr);
  EXPECT_EQ(find_codec(std::string_view("auto")), nullptr);  // a plan's choice, not a format
  EXPECT_EQ(format_name(static_cast<Format>(rows.size())), "unknown");
  EXPECT_EQ(find_value_type(static_cast<ValueType>(kValueTypeCount)), nullptr);
  ValueType vt = ValueType::kBf16;
  EXPECT_FALSE(parse_value_type("fp8", &vt));
  EXPECT_EQ(vt, ValueType::kBf16);
}

TEST(kernelsCodecs, ChoicesListEveryRowInIdOrder) {
  std::string formats, types;
  for (const CodecInfo& row : codec_registry()) formats += (formats.empty() ? "" : "|") + std::string(row.name);
  for (const ValueTypeInfo& row : value_type_registry()) types += (types.empty() ? "" : "|") + std::string(row.name);
  EXPECT_EQ(std::string(format_choices()), formats);
  EXPECT_EQ(std::string(format_choices()).rfind("dense|coo|coo_varint|bitmap|csr|rle", 0), 0u);
  EXPECT_EQ(std::string(value_type_choices()), types);
  EXPECT_EQ(std::string(value_type_choices()).rfind("fp32|fp16|bf16|int8", 0), 0u);
  EXPECT_EQ(format_choices(), format_choices());  // one string for the program's life
}

TEST(kernelsCodecs, AutoTieOrderIsFrozen) {
  // Of equal sizes `auto` takes the faster decoder; this order is part of what a node sends.
  std::vector<const CodecInfo*> by_rank;
  for (const CodecInfo& row : codec_registry()) by_rank.push_back(&row);
  std::sort(by_rank.begin(), by_rank.end(), [](auto* a, auto* b) { return a->auto_rank < b->auto_rank; });
  const std::vector<std::string> frozen = {"coo", "bitmap", "dense", "csr", "coo_varint", "rle"};
  ASSERT_GE(by_rank.size(), frozen.size());
  for (size_t i = 0; i < frozen.size(); ++i) EXPECT_EQ(by_rank[i]->name, frozen[i]) << i;
}

struct Case {
  size_t n;
  uint32_t rows;
  std::vector<uint32_t> index;
};

std::vector<Case> cases() {
  std::vector<Case> out;
  std::mt19937_64 rng(11);
  out.push_back({0, 1, {}});
  out.push_back({1, 1, {0}});
  out.push_back({64, 8, {}});
  struct Random {
    size_t n;
    uint32_t rows;
    double density;
  };
  for (const Random& r : {Random{1000, 10, 0.01}, Random{4099, 1, 0.3}, Random{8192, 64, 0.9},
                          Random{65536, 256, 0.001}}) {
    std::bernoulli_distribution keep(r.density);
    Case c{r.n, r.rows, {}};
    for (uint32_t i = 0; i < c.n; ++i) {
      if (keep(rng)) c.index.push_back(i);
    }
    out.push_back(std::move(c));
  }
  Case blocks{5000, 50, {}};
  for (uint32_t i = 0; i < 5000; ++i) {
    if ((i / 37) % 4 == 1) blocks.index.push_back(i);
  }
  out.push_back(std::move(blocks));
  Case all{300, 3, {}};
  for (uint32_t i = 0; i < 300; ++i) all.index.push_back(i);
  out.push_back(std::move(all));
  return out;
}

// Every row, every value type: the row's size is what encode() writes and what encoded_size()
// says, within the size range a header allows; the row's encoder writes the same bytes as the
// public encode(); decoding adds, at the selected indices only, exactly what quantize_roundtrip
// says every receiver decodes (for fp32: the values themselves, bit for bit).
TEST(kernelsCodecs, EveryRowRoundTripsEveryValueTypeAgainstAPlainReference) {
  for (const CodecInfo& row : codec_registry()) {
    for (const ValueTypeInfo& vt : value_type_registry()) {
      for (const Case& c : cases()) {
        const auto value = testing::normal_floats(c.index.size(), c.n + 3, 2.0f);
        EncodeParams p;
        p.format = row.id;
        p.value_type = vt.id;
        p.rows = c.rows;
        auto size = encoded_size(p, c.n, c.index);
        ASSERT_TRUE(size.ok()) << row.name << "/" << vt.name << " n=" << c.n << ": " << size.status().to_string();
        std::vector<std::byte> payload(*size);
        auto wrote = encode(p, c.n, c.index, value, payload);
        ASSERT_TRUE(wrote.ok()) << wrote.status().to_string();
        EXPECT_EQ(*wrote, *size) << row.name;
        CodecSelection sel{vt.id, c.n, c.rows, c.index, value};
        EXPECT_EQ(row.size(sel), *size) << row.name;
        std::vector<std::byte> direct(*size);
        EXPECT_EQ(row.encode(sel, direct.data()), *size) << row.name;
        EXPECT_EQ(direct, payload) << row.name << "/" << vt.name << " n=" << c.n;

        const uint64_t nnz = row.dense ? c.n : c.index.size();
        EXPECT_TRUE(payload_size_range(row.id, vt.id, c.n, nnz).contains(payload.size()))
            << row.name << "/" << vt.name << " n=" << c.n;
        EXPECT_LE(payload.size(), encoded_bytes(row.id, vt.id, c.n, nnz)) << row.name;
        EXPECT_LE(payload.size(), max_encoded_bytes(c.n)) << row.name;

        std::vector<float> decoded(value.size());
        ASSERT_TRUE(quantize_roundtrip(vt.id, value, decoded).ok());
        if (vt.id == ValueType::kF32) {
          for (size_t j = 0; j < value.size(); ++j) ASSERT_TRUE(same_bits(decoded[j], value[j]));
        }
        std::vector<float> base(c.n);
        for (size_t i = 0; i < c.n; ++i) base[i] = 1.0f + static_cast<float>(i % 13);
        std::vector<float> want = base;
        for (size_t j = 0; j < c.index.size(); ++j) want[c.index[j]] += decoded[j];
        std::vector<float> got = base;
        const Status st = decode_accumulate(row.id, vt.id, payload, nnz, got);
        ASSERT_TRUE(st.ok()) << row.name << "/" << vt.name << ": " << st.to_string();
        for (size_t i = 0; i < c.n; ++i) {
          ASSERT_TRUE(same_bits(got[i], want[i])) << row.name << "/" << vt.name << " n=" << c.n << " at " << i;
        }
      }
    }
  }
}

TEST(kernelsCodecs, RowsThatNeedRowsRejectRowsThatDoNotDivide) {
  for (const CodecInfo& row : codec_registry()) {
    EncodeParams p;
    p.format = row.id;
    p.rows = 3;
    const auto size = encoded_size(p, 10, std::vector<uint32_t>{1, 2});
    EXPECT_EQ(size.ok(), !row.needs_rows) << row.name;
    if (row.needs_rows) {
      EXPECT_EQ(size.status().code(), Code::kInvalidArgument) << row.name;
      EXPECT_NE(size.status().message().find(row.name), std::string::npos) << size.status().message();
    }
  }
}

// Decoding with a pool gives the same bits as without, for every row (rows without
// .parallel_decode ignore the pool); large enough that the parallel rows split.
TEST(kernelsCodecs, DecodeWithAPoolMatchesOneThread) {
  ThreadPool pool(4);
  const size_t n = size_t{1} << 21;
  std::vector<uint32_t> index;
  for (uint32_t i = 0; i < n; i += 7) index.push_back(i);
  const auto value = testing::normal_floats(index.size(), 5);
  for (const CodecInfo& row : codec_registry()) {
    EncodeParams p;
    p.format = row.id;
    p.rows = 1024;
    auto size = encoded_size(p, n, index);
    ASSERT_TRUE(size.ok()) << row.name;
    std::vector<std::byte> payload(*size);
    ASSERT_TRUE(encode(p, n, index, value, payload).ok()) << row.name;
    const uint64_t nnz = row.dense ? n : index.size();
    std::vector<float> one = testing::normal_floats(n, 6);
    std::vector<float> many = one;
    ASSERT_TRUE(decode_accumulate(row.id, ValueType::kF32, payload, nnz, one).ok()) << row.name;
    ASSERT_TRUE(decode_accumulate(row.id, ValueType::kF32, payload, nnz, many, &pool).ok()) << row.name;
    for (size_t i = 0; i < n; ++i) ASSERT_TRUE(same_bits(one[i], many[i])) << row.name << " at " << i;
  }
}

TEST(kernelsCodecs, UnknownFormatsAndValueTypesAreRejectedEverywhere) {
  const auto unknown = static_cast<Format>(kFormatCount);
  const auto bad_type = static_cast<ValueType>(kValueTypeCount);
  std::vector<float> out(4, 1.0f);
  EXPECT_EQ(decode_accumulate(unknown, ValueType::kF32, {}, 0, out).code(), Code::kDataLoss);
  EXPECT_EQ(decode_accumulate(Format::kCoo, bad_type, {}, 0, out).code(), Code::kDataLoss);
  EncodeParams p;
  p.format = unknown;
  EXPECT_EQ(encoded_size(p, 4, {}).status().code(), Code::kInvalidArgument);
  EXPECT_EQ(encoded_bytes(unknown, ValueType::kF32, 4, 1), 0u);
  EXPECT_FALSE(payload_size_range(unknown, ValueType::kF32, 4, 1).contains(8));
  EXPECT_FALSE(payload_size_range(Format::kCoo, bad_type, 4, 1).contains(8));
  EXPECT_EQ(choose_format(bad_type, 1, 4, {}).status().code(), Code::kInvalidArgument);
}

// `auto` against brute force: every subset of small tensors, every value type; the reference
// encodes each format for real and takes the smallest, ties to the frozen preference order.
TEST(kernelsCodecs, AutoIsTheSmallestRealEncodingWithTiesToThePreferenceOrder) {
  const std::vector<std::string> preference = {"coo", "bitmap", "dense", "csr", "coo_varint", "rle"};
  auto rank_of = [&](const char* name) {
    const auto it = std::find(preference.begin(), preference.end(), name);
    return static_cast<size_t>(it - preference.begin());  // a row added later ranks after these
  };
  int ties = 0;
  for (size_t n : {size_t{6}, size_t{9}, size_t{16}}) {
    for (uint32_t rows : {1u, 2u, 3u}) {
      for (const ValueTypeInfo& vt : value_type_registry()) {
        for (uint32_t mask = 0; mask < (1u << n); mask += (n == 16 ? 97 : 1)) {
          std::vector<uint32_t> index;
          for (uint32_t i = 0; i < n; ++i) {
            if (mask & (1u << i)) index.push_back(i);
          }
          const std::vector<float> value(index.size(), 0.5f);
          std::string want;
          size_t want_bytes = SIZE_MAX;
          size_t at_min = 0;
          for (const CodecInfo& row : codec_registry()) {
            EncodeParams p;
            p.format = row.id;
            p.value_type = vt.id;
            p.rows = rows;
            std::vector<std::byte> out(max_encoded_bytes(n));
            auto wrote = encode(p, n, index, value, out);
            if (!wrote.ok()) continue;  // rows that do not divide n
            if (*wrote < want_bytes || (*wrote == want_bytes && rank_of(row.name) < rank_of(want.c_str()))) {
              at_min = *wrote < want_bytes ? 1 : at_min + 1;
              want = row.name;
              want_bytes = *wrote;
            } else if (*wrote == want_bytes) {
              ++at_min;
            }
          }
          ties += at_min > 1;
          auto got = choose_format(vt.id, rows, n, index);
          ASSERT_TRUE(got.ok()) << got.status().to_string();
          ASSERT_EQ(format_name(got->format), want) << "n=" << n << " rows=" << rows << " mask=" << mask << " "
                                                   << vt.name;
          ASSERT_EQ(got->bytes, want_bytes);
        }
      }
    }
  }
  EXPECT_GT(ties, 0);  // the tie-break was exercised
}

}  // namespace
}  // namespace sparsecar::kernels
