// The CUDA codecs (cuda_codecs.h) against the CPU codecs (codec.h), the independent reference:
// every device format x value type encodes the CPU encoder's bytes (memcmp) on selections of many
// sizes and values (0 and 1 entries, sizes that are not multiples of the block or scan tile, a
// dense length of 2^32 - 1, NaN/inf, all-equal, saturating, subnormal and all-zero values); W = 1..4
// peers' payloads decode into the CPU's sums bit for bit, NaN payloads included, with the same
// 1/W scaling (one exception, as cuda.h's: where two NaN operands meet at an element, either
// may come out); malformed payloads are rejected with
// the CPU decoder's message and add nothing while the other peers' payloads still add.
// The device tests skip (with a message) where no GPU is present; CudaCodecStatus (the host-side
// message text of every DecodeError against the CPU decoder's) runs everywhere. Uses only
// cuda.h's wrappers, so it compiles without the CUDA headers.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "sparsecar/kernels/codec.h"
#include "sparsecar/kernels/cuda.h"
#include "sparsecar/kernels/cuda_codecs.h"
#include "sparsecar/kernels/select.h"
#include "tests/unit/kernels/test_util.h"

namespace sparsecar::kernels {
namespace {

namespace cu = kernels::cuda;

constexpr Format kDeviceFormats[] = {Format::kCoo, Format::kCooVarint, Format::kBitmap};
constexpr ValueType kValueTypes[] = {ValueType::kF32, ValueType::kF16, ValueType::kBf16, ValueType::kI8};
constexpr size_t kMax32 = 0xFFFFFFFFull;

// SPARSECAR_GPU_TEST_MAX_N caps the dense lengths (compute-sanitizer runs are 10-100x slower);
// the tests above it skip.
size_t max_n() {
  static const size_t cap = [] {
    const char* text = std::getenv("SPARSECAR_GPU_TEST_MAX_N");
    return text != nullptr ? static_cast<size_t>(std::strtoull(text, nullptr, 10)) : ~size_t{0};
  }();
  return cap;
}

std::string name_of(Format f, ValueType vt) {
  return std::string(format_name(f)) + "/" + std::string(value_type_name(vt));
}

// Device memory owned by a test (cuda.h's wrappers only).
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t bytes) {
    if (bytes == 0) return;
    Expected<void*> p = cu::device_alloc(bytes);
    EXPECT_TRUE(p.ok()) << p.status().message();
    if (p.ok()) ptr_ = *p;
  }
  ~DeviceBuffer() { cu::device_free(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }

 private:
  void* ptr_ = nullptr;
};

// Asynchronous copies on the test's stream (either direction).
void copy(void* dst, const void* src, size_t bytes, cu::Stream s) {
  if (bytes == 0) return;
  const Status st = cu::copy_async(dst, src, bytes, s);
  EXPECT_TRUE(st.ok()) << st.message();
}
void upload(void* dst, const void* src, size_t bytes, cu::Stream s) { copy(dst, src, bytes, s); }
void download(void* dst, const void* src, size_t bytes, cu::Stream s) { copy(dst, src, bytes, s); }


// About k sorted indices below n, fast for large k: gaps uniform in [0, 2n/k - 2].
std::vector<uint32_t> spread_indices(size_t n, size_t k, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_int_distribution<size_t> gap(0, 2 * (n / k) - 2);
  std::vector<uint32_t> out;
  for (size_t i = gap(rng); i < n; i += 1 + gap(rng)) out.push_back(static_cast<uint32_t>(i));
  return out;
}

// k distinct sorted indices below n.
std::vector<uint32_t> random_indices(size_t n, size_t k, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<uint32_t> out;
  out.reserve(k);
  if (2 * k > n) {  // selection sampling (Knuth's S): every index with the right probability
    size_t need = k;
    for (size_t i = 0; i < n && need > 0; ++i) {
      if (std::uniform_int_distribution<size_t>(0, n - i - 1)(rng) < need) {
        out.push_back(static_cast<uint32_t>(i));
        --need;
      }
    }
    return out;
  }
  std::set<uint32_t> chosen;
  std::uniform_int_distribution<uint64_t> pick(0, n - 1);
  while (chosen.size() < k) chosen.insert(static_cast<uint32_t>(pick(rng)));
  return {chosen.begin(), chosen.end()};
}

enum class Values { kNormal, kSpecial, kEqual, kLarge, kTiny, kZero };
constexpr Values kAllValues[] = {Values::kNormal, Values::kSpecial, Values::kEqual,
                                 Values::kLarge,  Values::kTiny,    Values::kZero};

std::vector<float> make_values(Values kind, size_t k, uint64_t seed) {
  switch (kind) {
    case Values::kNormal: return testing::normal_floats(k, seed);
    case Values::kSpecial: return testing::special_floats(k, seed);
    case Values::kEqual: return std::vector<float>(k, -0.3f);
    case Values::kLarge: return testing::normal_floats(k, seed, 1e5f);    // fp16 saturates at 65504
    case Values::kTiny: return testing::normal_floats(k, seed, 1e-6f);    // fp16 subnormals
    case Values::kZero: return std::vector<float>(k, 0.0f);               // int8 scale 0
  }
  return {};
}

std::vector<std::byte> cpu_encode(Format f, ValueType vt, size_t dense_len, std::span<const uint32_t> index,
                                  std::span<const float> value) {
  EncodeParams params;
  params.format = f;
  params.value_type = vt;
  Expected<size_t> size = encoded_size(params, dense_len, index);
  EXPECT_TRUE(size.ok()) << size.status().message();
  if (!size.ok()) return {};
  std::vector<std::byte> out(*size);
  Expected<size_t> wrote = encode(params, dense_len, index, value, out);
  EXPECT_TRUE(wrote.ok()) << wrote.status().message();
  return out;
}

// A payload as it arrived, with its wire header's format, value type and nnz.
struct HostPayload {
  Format format;
  ValueType value_type;
  uint64_t nnz;
  std::vector<std::byte> bytes;
};

class CudaCodecs : public ::testing::Test {
 protected:
  void SetUp() override {
    if (cu::device_count() == 0) {
      GTEST_SKIP() << "no CUDA device: the CUDA codecs are checked on a GPU machine ("
                   << (cu::built() ? "built with CUDA" : "built without CUDA") << ")";
    }
    Expected<cu::Stream> s = cu::stream_create();
    ASSERT_TRUE(s.ok()) << s.status().message();
    stream_ = *s;
  }
  void TearDown() override { cu::stream_destroy(stream_); }

  // The device encoder on a selection buffer of index.size() entries with `count` written as
  // the selector's count; checks size, nnz and bytes against the CPU encoder of the first
  // min(count, capacity) pairs, and that nothing past the size was written.
  void expect_encode(Format f, ValueType vt, size_t dense_len, const std::vector<uint32_t>& index,
                     const std::vector<float>& value, uint64_t count, const std::string& what) {
    SCOPED_TRACE(name_of(f, vt) + " " + what);
    const size_t capacity = index.size();
    const size_t m = std::min<uint64_t>(count, capacity);
    const std::vector<std::byte> want =
        cpu_encode(f, vt, dense_len, std::span(index).first(m), std::span(value).first(m));

    const size_t bound = cu::encode_bound_bytes(f, vt, dense_len, capacity);
    ASSERT_GE(bound, want.size());
    const size_t slack = 64;  // canary bytes after the bound
    DeviceBuffer d_index(capacity * 4), d_value(capacity * 4), d_count(8), d_out(bound + slack), d_sizes(16);
    const size_t ws_bytes = cu::encode_workspace_bytes(f, vt, capacity);
    DeviceBuffer ws(ws_bytes);
    upload(d_index.as<void>(), index.data(), capacity * 4, stream_);
    upload(d_value.as<void>(), value.data(), capacity * 4, stream_);
    upload(d_count.as<void>(), &count, 8, stream_);
    const std::vector<std::byte> canary(bound + slack, std::byte{0xA5});
    upload(d_out.as<void>(), canary.data(), canary.size(), stream_);

    cu::DeviceSelection sel;
    sel.index = d_index.as<uint32_t>();
    sel.value = d_value.as<float>();
    sel.capacity = capacity;
    sel.count = d_count.as<uint64_t>();
    cu::DevicePayloadOut out;
    out.data = d_out.as<std::byte>();
    out.capacity_bytes = bound;
    out.bytes = d_sizes.as<uint64_t>();
    out.nnz = d_sizes.as<uint64_t>() + 1;
    EncodeParams params;
    params.format = f;
    params.value_type = vt;
    const Status s = cu::encode(params, dense_len, sel, out, cu::Workspace{ws.as<void>(), ws_bytes}, stream_);
    ASSERT_TRUE(s.ok()) << s.message();
    uint64_t sizes[2] = {0, 0};
    std::vector<std::byte> got(bound + slack);
    download(sizes, d_sizes.as<void>(), 16, stream_);
    download(got.data(), d_out.as<void>(), got.size(), stream_);
    ASSERT_TRUE(cu::synchronize(stream_).ok());

    EXPECT_EQ(sizes[0], want.size());
    EXPECT_EQ(sizes[1], m);
    ASSERT_LE(sizes[0], bound);
    size_t first_diff = want.size();
    for (size_t b = 0; b < want.size(); ++b) {
      if (got[b] != want[b]) {
        first_diff = b;
        break;
      }
    }
    EXPECT_EQ(first_diff, want.size()) << "bytes differ from byte " << first_diff << " of " << want.size()
                                       << " (device " << std::to_integer<int>(got[first_diff]) << ", cpu "
                                       << std::to_integer<int>(want[first_diff]) << ")";
    EXPECT_EQ(std::memcmp(got.data(), want.data(), want.size()), 0);
    for (size_t b = want.size(); b < got.size(); ++b) {
      if (got[b] != std::byte{0xA5}) {
        ADD_FAILURE() << "byte " << b << " past the payload's " << want.size() << " bytes was written";
        break;
      }
    }
  }

  // The CPU's sum (decode_accumulate per payload in order, then scale by 1/average_over) against
  // the device's, element by element, and each payload's verdict (code and message). Payloads
  // at odd positions are placed one byte off alignment. Three times: kAuto with a workspace for
  // one payload at a time (peer-by-peer scatters), kChunked with one sized for every payload
  // (all-coo calls then add them in one chunked pass), and kChunked with too small a workspace
  // (falls back to peer by peer).
  void expect_decode(size_t dense_len, const std::vector<HostPayload>& payloads, uint32_t average_over,
                     uint64_t seed, const std::string& what) {
    expect_decode_with(dense_len, payloads, average_over, seed, what + ", auto", 1, cu::DecodePath::kAuto);
    if (payloads.size() > 1) {
      expect_decode_with(dense_len, payloads, average_over, seed, what + ", chunked", payloads.size(),
                         cu::DecodePath::kChunked);
      expect_decode_with(dense_len, payloads, average_over, seed, what + ", chunked without room", 1,
                         cu::DecodePath::kChunked);
    }
  }

  void expect_decode_with(size_t dense_len, const std::vector<HostPayload>& payloads, uint32_t average_over,
                          uint64_t seed, const std::string& what, size_t ws_peers, cu::DecodePath path) {
    SCOPED_TRACE(what);
    std::vector<float> initial = testing::normal_floats(dense_len, seed);
    std::vector<float> want = initial;
    std::vector<Status> want_status;
    for (const HostPayload& p : payloads) {
      want_status.push_back(decode_accumulate(p.format, p.value_type, p.bytes, p.nnz, want));
    }
    if (average_over > 0) kernels::scale(want, 1.0f / static_cast<float>(average_over));

    std::vector<std::unique_ptr<DeviceBuffer>> buffers;
    std::vector<cu::DevicePayload> views;
    size_t max_bytes = 0;
    for (size_t j = 0; j < payloads.size(); ++j) {
      const HostPayload& p = payloads[j];
      const size_t shift = j % 2;
      buffers.push_back(std::make_unique<DeviceBuffer>(p.bytes.size() + shift));
      std::byte* at = buffers.back()->as<std::byte>() + shift;
      upload(at, p.bytes.data(), p.bytes.size(), stream_);
      cu::DevicePayload v;
      v.format = p.format;
      v.value_type = p.value_type;
      v.data = p.bytes.empty() ? nullptr : at;
      v.bytes = p.bytes.size();
      v.nnz = p.nnz;
      views.push_back(v);
      max_bytes = std::max(max_bytes, p.bytes.size());
    }
    DeviceBuffer d_dense(dense_len * 4), d_status(payloads.size() * sizeof(cu::DecodeStatus));
    const size_t ws_bytes = cu::decode_workspace_bytes(dense_len, max_bytes, ws_peers);
    DeviceBuffer ws(ws_bytes);
    upload(d_dense.as<void>(), initial.data(), dense_len * 4, stream_);
    const Status s = cu::decode_accumulate(views, d_dense.as<float>(), dense_len, average_over,
                                           d_status.as<cu::DecodeStatus>(), cu::Workspace{ws.as<void>(), ws_bytes},
                                           stream_, path);
    ASSERT_TRUE(s.ok()) << s.message();
    std::vector<float> got(dense_len);
    std::vector<cu::DecodeStatus> status(payloads.size());
    download(got.data(), d_dense.as<void>(), dense_len * 4, stream_);
    download(status.data(), d_status.as<void>(), status.size() * sizeof(cu::DecodeStatus), stream_);
    ASSERT_TRUE(cu::synchronize(stream_).ok());

    for (size_t j = 0; j < payloads.size(); ++j) {
      const Status verdict = cu::decode_status(views[j], dense_len, status[j]);
      EXPECT_EQ(verdict.code(), want_status[j].code()) << "payload " << j << ": device says '" << verdict.message()
                                                       << "', cpu says '" << want_status[j].message() << "'";
      EXPECT_EQ(verdict.message(), want_status[j].message()) << "payload " << j;
    }
    // Bits must be equal; where both are NaN but differ, two NaN operands must have met there
    // (x86 returns one of them, the compiler picks which) and the device's NaN must be one that
    // reached the element: a payload's value there (decoded alone: 0 + NaN is the NaN,
    // quieted) or x86's default NaN (inf - inf).
    std::vector<size_t> both_nan;
    size_t bad = 0;
    auto report = [&](size_t i, const char* why) {
      if (bad++ < 5) {
        ADD_FAILURE() << "element " << i << ": device " << got[i] << " (0x" << std::hex
                      << std::bit_cast<uint32_t>(got[i]) << "), cpu " << want[i] << " (0x"
                      << std::bit_cast<uint32_t>(want[i]) << std::dec << ")" << why;
      }
    };
    for (size_t i = 0; i < dense_len; ++i) {
      if (testing::same_bits(got[i], want[i])) continue;
      if (std::isnan(got[i]) && std::isnan(want[i])) {
        both_nan.push_back(i);
      } else {
        report(i, "");
      }
    }
    if (!both_nan.empty()) {
      std::vector<std::vector<uint32_t>> reached(both_nan.size());
      std::vector<unsigned> sources(both_nan.size(), 0);
      for (size_t j = 0; j < payloads.size(); ++j) {
        if (!want_status[j].ok()) continue;
        std::vector<float> alone(dense_len, 0.0f);
        ASSERT_TRUE(decode_accumulate(payloads[j].format, payloads[j].value_type, payloads[j].bytes,
                                      payloads[j].nnz, alone)
                        .ok());
        for (size_t q = 0; q < both_nan.size(); ++q) {
          const float v = alone[both_nan[q]];
          if (std::isnan(v)) reached[q].push_back(std::bit_cast<uint32_t>(v));
          if (std::isnan(v) || std::isinf(v)) ++sources[q];
        }
      }
      for (size_t q = 0; q < both_nan.size(); ++q) {
        const uint32_t bits = std::bit_cast<uint32_t>(got[both_nan[q]]);
        const bool known =
            bits == 0xffc00000u || std::find(reached[q].begin(), reached[q].end(), bits) != reached[q].end();
        if (sources[q] < 2 || !known) report(both_nan[q], " (a NaN no two NaN operands explain)");
      }
    }
    EXPECT_EQ(bad, 0u) << "elements differ";
  }

  HostPayload encoded(Format f, ValueType vt, size_t dense_len, size_t k, Values kind, uint64_t seed) {
    return encoded_at(f, vt, dense_len, random_indices(dense_len, k, seed), kind, seed);
  }
  HostPayload encoded_at(Format f, ValueType vt, size_t dense_len, const std::vector<uint32_t>& index, Values kind,
                         uint64_t seed) {
    const std::vector<float> value = make_values(kind, index.size(), seed + 1);
    return {f, vt, index.size(), cpu_encode(f, vt, dense_len, index, value)};
  }

  cu::Stream stream_ = nullptr;
};

struct Shape {
  size_t dense_len;
  size_t k;
};
// 0 and 1 entries, partial bitmap bytes and words, sizes around the 256-thread block and the
// 4096-item scan tile, and more than one tile of varint bytes and entries.
constexpr Shape kShapes[] = {{0, 0},       {1, 0},       {1, 1},        {7, 3},         {8, 8},
                             {9, 5},       {33, 33},     {100, 1},      {255, 200},     {257, 257},
                             {1000, 999},  {4095, 4095}, {4097, 4097},  {5000, 4097},   {100003, 1},
                             {100003, 9000}, {1 << 20, 70001}};

TEST_F(CudaCodecs, EncodeEqualsCpuBytes) {
  uint64_t seed = 1;
  for (Format f : kDeviceFormats) {
    for (ValueType vt : kValueTypes) {
      for (const Shape& sh : kShapes) {
        if (sh.dense_len > max_n()) continue;
        for (Values kind : kAllValues) {
          ++seed;
          const auto index = random_indices(sh.dense_len, sh.k, seed);
          const auto value = make_values(kind, sh.k, seed);
          expect_encode(f, vt, sh.dense_len, index, value, sh.k,
                        "n=" + std::to_string(sh.dense_len) + " k=" + std::to_string(sh.k) + " values " +
                            std::to_string(static_cast<int>(kind)));
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

// The selector's count may exceed the capacity (only the first capacity pairs were written) or
// fall short of it (the rest of the buffer is stale): the encoder takes min(count, capacity).
TEST_F(CudaCodecs, EncodeTakesMinOfCountAndCapacity) {
  for (Format f : kDeviceFormats) {
    for (ValueType vt : kValueTypes) {
      auto index = random_indices(50000, 3000, 7);
      auto value = make_values(Values::kNormal, 3000, 8);
      expect_encode(f, vt, 50000, index, value, 3000 + 77, "count above capacity");
      // Stale pairs after the count: out of order and out of range, values NaN.
      for (size_t j = 1000; j < index.size(); ++j) {
        index[j] = static_cast<uint32_t>(j % 7);
        value[j] = std::numeric_limits<float>::quiet_NaN();
      }
      expect_encode(f, vt, 50000, index, value, 1000, "count below capacity");
      expect_encode(f, vt, 50000, index, value, 0, "count 0");
    }
  }
}

// Indices up to 2^32 - 2 and gaps that need 5-byte varints; the bitmap's bytes past 2^31 bits.
TEST_F(CudaCodecs, EncodeAtTheLargestDenseLength) {
  if (max_n() < kMax32) GTEST_SKIP() << "sizes capped by SPARSECAR_GPU_TEST_MAX_N";
  std::vector<uint32_t> index = random_indices(kMax32, 3000, 11);
  index.front() = 0;
  index.back() = static_cast<uint32_t>(kMax32 - 1);
  const std::vector<float> value = make_values(Values::kNormal, index.size(), 12);
  for (ValueType vt : kValueTypes) {
    expect_encode(Format::kCoo, vt, kMax32, index, value, index.size(), "n=2^32-1");
    expect_encode(Format::kCooVarint, vt, kMax32, index, value, index.size(), "n=2^32-1");
  }
  // Two entries: a gap of 2^32 - 3 (5 bytes) and the last element.
  const std::vector<uint32_t> two = {0, static_cast<uint32_t>(kMax32 - 1)};
  expect_encode(Format::kCooVarint, ValueType::kF32, kMax32, two, {1.0f, 2.0f}, 2, "two far apart");
  // 512 MiB of bitmap.
  expect_encode(Format::kBitmap, ValueType::kF32, kMax32, index, value, index.size(), "n=2^32-1");
  expect_encode(Format::kBitmap, ValueType::kI8, kMax32, index, value, index.size(), "n=2^32-1");
}

TEST_F(CudaCodecs, DecodeEqualsCpuSums) {
  uint64_t seed = 100;
  for (Format f : kDeviceFormats) {
    for (ValueType vt : kValueTypes) {
      for (const Shape& sh : kShapes) {
        if (sh.dense_len > max_n()) continue;
        for (uint32_t w = 1; w <= 4; ++w) {
          std::vector<HostPayload> payloads;
          for (uint32_t r = 0; r < w; ++r) {
            const Values kind = kAllValues[(seed + r) % std::size(kAllValues)];
            payloads.push_back(encoded(f, vt, sh.dense_len, std::min(sh.k, sh.dense_len), kind, ++seed));
          }
          expect_decode(sh.dense_len, payloads, w, seed,
                        name_of(f, vt) + " n=" + std::to_string(sh.dense_len) + " k=" + std::to_string(sh.k) +
                            " W=" + std::to_string(w));
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

// Peers may send different formats and value types (`auto`, tensor overrides); without
// averaging the sum is left as it is.
TEST_F(CudaCodecs, DecodeMixedPeersAndNoAverage) {
  const size_t n = 70001;
  std::vector<HostPayload> payloads;
  uint64_t seed = 900;
  for (Format f : kDeviceFormats) {
    for (ValueType vt : kValueTypes) payloads.push_back(encoded(f, vt, n, 5000, Values::kNormal, ++seed));
  }
  expect_decode(n, payloads, 12, 5, "12 mixed peers, 1/12");
  expect_decode(n, payloads, 0, 6, "12 mixed peers, no average");
  expect_decode(n, {}, 3, 7, "no peers");
}

// More than 1024 scan tiles of 4096 items (the tile-offset kernel's chunk loop): ~4.5 MB of
// varints over ~4.5 M entries, and 2^22 + 3126 bitmap words.
TEST_F(CudaCodecs, DecodeLargeScans) {
  const size_t n = (size_t{1} << 27) + 100003;
  if (max_n() < n) GTEST_SKIP() << "sizes capped by SPARSECAR_GPU_TEST_MAX_N";
  std::vector<HostPayload> payloads;
  payloads.push_back(encoded_at(Format::kCooVarint, ValueType::kF32, n, spread_indices(n, 4500000, 31),
                                Values::kNormal, 31));
  payloads.push_back(encoded_at(Format::kBitmap, ValueType::kBf16, n, spread_indices(n, 2500000, 32),
                                Values::kNormal, 32));
  payloads.push_back(encoded_at(Format::kCoo, ValueType::kI8, n, spread_indices(n, 2500000, 33), Values::kSpecial, 33));
  payloads.push_back(encoded_at(Format::kCooVarint, ValueType::kI8, n, spread_indices(n, 4500000, 34),
                                Values::kNormal, 34));
  ASSERT_GT(payloads[0].bytes.size() - 4 * payloads[0].nnz, size_t{4096} * 1024);
  expect_decode(n, payloads, 4, 35, "large");
}

// ---- malformed payloads: each sits between two good ones, which still add ---------------------

std::vector<std::byte> varint_bytes(uint32_t v) {
  std::vector<std::byte> out;
  while (v >= 0x80u) {
    out.push_back(static_cast<std::byte>((v & 0x7fu) | 0x80u));
    v >>= 7;
  }
  out.push_back(static_cast<std::byte>(v));
  return out;
}

// A coo_varint payload with the given gaps' varint bytes replaced: the caller builds the region.
HostPayload varint_payload(ValueType vt, const std::vector<float>& value,
                                       const std::vector<std::vector<std::byte>>& varints) {
  std::vector<std::byte> bytes(value_block_bytes(vt, value.size()));
  // The value block as the CPU encodes it (any increasing indices give the same block).
  std::vector<uint32_t> index(value.size());
  for (size_t j = 0; j < index.size(); ++j) index[j] = static_cast<uint32_t>(j);
  const std::vector<std::byte> coo = cpu_encode(Format::kCoo, vt, std::max<size_t>(index.size(), 1), index, value);
  std::copy(coo.begin() + static_cast<std::ptrdiff_t>(4 * index.size()), coo.end(), bytes.begin());
  for (const auto& v : varints) bytes.insert(bytes.end(), v.begin(), v.end());
  return {Format::kCooVarint, vt, value.size(), bytes};
}

TEST_F(CudaCodecs, DecodeRejectsMalformedPayloads) {
  const size_t n = 1000;
  struct Case {
    std::string name;
    HostPayload bad;
  };
  std::vector<Case> cases;
  for (ValueType vt : kValueTypes) {
    const std::string t = std::string(value_type_name(vt)) + " ";
    // coo
    {
      HostPayload p = encoded(Format::kCoo, vt, n, 100, Values::kNormal, 41);
      HostPayload q = p;
      q.bytes.pop_back();
      cases.push_back({t + "coo truncated", q});
      q = p;
      q.bytes.push_back(std::byte{0});
      cases.push_back({t + "coo oversized", q});
      q = p;
      std::swap_ranges(q.bytes.begin() + 4 * 50, q.bytes.begin() + 4 * 51, q.bytes.begin() + 4 * 51);
      cases.push_back({t + "coo indices swapped", q});
      q = p;
      std::copy(q.bytes.begin() + 4 * 60, q.bytes.begin() + 4 * 61, q.bytes.begin() + 4 * 61);
      cases.push_back({t + "coo index repeated", q});
      q = p;
      const uint32_t big = n;
      std::memcpy(q.bytes.data() + 4 * 99, &big, 4);
      cases.push_back({t + "coo index == dense_len", q});
      q = p;
      q.nnz = n + 1;
      cases.push_back({t + "coo nnz > dense_len", q});
      q = p;
      q.value_type = static_cast<ValueType>(7);
      cases.push_back({t + "unknown value type", q});
      q = p;
      q.format = static_cast<Format>(9);
      cases.push_back({t + "unknown format", q});
      if (vt == ValueType::kI8) {
        q = p;
        q.bytes[4 * 100 + 4 + 17] = std::byte{0x80};
        q.bytes[4 * 100 + 4 + 30] = std::byte{0x80};
        cases.push_back({t + "coo int8 code -128", q});
        for (float scale : {-1.0f, std::numeric_limits<float>::infinity(), -0.0f}) {
          q = p;
          std::memcpy(q.bytes.data() + 4 * 100, &scale, 4);
          cases.push_back({t + "coo int8 scale " + std::to_string(scale), q});
        }
        // An index error is reported before a bad code, as on the CPU.
        q = p;
        q.bytes[4 * 100 + 4 + 3] = std::byte{0x80};
        std::memcpy(q.bytes.data() + 4 * 80, &big, 4);
        cases.push_back({t + "coo index and code both bad", q});
      }
    }
    // coo_varint
    {
      const std::vector<float> v3 = make_values(Values::kNormal, 3, 43);
      auto add = [&](const std::string& what, const std::vector<std::vector<std::byte>>& varints) {
        cases.push_back({t + "varint " + what, varint_payload(vt, v3, varints)});
      };
      const auto raw = [](std::initializer_list<int> b) {
        std::vector<std::byte> out;
        for (int v : b) out.push_back(static_cast<std::byte>(v));
        return out;
      };
      add("truncated", {varint_bytes(5), varint_bytes(300), raw({0x81})});
      add("overlong", {varint_bytes(5), raw({0x85, 0x00}), varint_bytes(1)});
      add("over 32 bits", {varint_bytes(1), raw({0xff, 0xff, 0xff, 0xff, 0x1f}), varint_bytes(1)});
      add("of 6 bytes", {raw({0x80, 0x80, 0x80, 0x80, 0x80, 0x01}), varint_bytes(1), varint_bytes(1)});
      add("trailing byte", {varint_bytes(5), varint_bytes(6), varint_bytes(7), varint_bytes(1)});
      add("index past dense_len", {varint_bytes(5), varint_bytes(994), varint_bytes(0)});
      add("index == dense_len", {varint_bytes(0), varint_bytes(0), varint_bytes(998)});
      add("far gap", {varint_bytes(0xFFFFFFF0u), varint_bytes(0), varint_bytes(0)});
      add("index bad before a bad varint", {varint_bytes(2000), raw({0x85, 0x00}), varint_bytes(1)});
      add("good", {varint_bytes(5), varint_bytes(300), varint_bytes(1)});
      HostPayload p = encoded(Format::kCooVarint, vt, n, 100, Values::kNormal, 44);
      HostPayload q = p;
      q.bytes.resize(value_block_bytes(vt, 100) + 99);
      cases.push_back({t + "varint too short for nnz", q});
      if (vt == ValueType::kI8) {
        q = p;
        q.bytes[4 + 50] = std::byte{0x80};
        cases.push_back({t + "varint int8 code -128", q});
      }
    }
    // bitmap
    {
      HostPayload p = encoded(Format::kBitmap, vt, n + 3, 100, Values::kNormal, 45);  // 1003: a partial byte
      HostPayload q = p;
      q.bytes.pop_back();
      cases.push_back({t + "bitmap truncated", q});
      q = p;
      // A bit the selection does not have: count 101 != nnz 100.
      for (size_t b = 0; b < 125; ++b) {
        if (q.bytes[b] != std::byte{0xff}) {
          const unsigned x = std::to_integer<unsigned>(q.bytes[b]);
          q.bytes[b] = static_cast<std::byte>(x | (~x & (x + 1)));  // its lowest clear bit set
          break;
        }
      }
      cases.push_back({t + "bitmap one bit too many", q});
      q = p;
      for (size_t b = 0; b < 125; ++b) {
        if (q.bytes[b] != std::byte{0}) {
          q.bytes[b] &= static_cast<std::byte>(std::to_integer<unsigned>(q.bytes[b]) - 1);
          break;
        }
      }
      cases.push_back({t + "bitmap one bit too few", q});
      q = p;
      q.bytes[125] |= std::byte{0x10};  // element 1004 of 1003
      cases.push_back({t + "bitmap bit past dense_len", q});
      if (vt == ValueType::kI8) {
        q = p;
        q.bytes[126 + 4 + 99] = std::byte{0x80};
        cases.push_back({t + "bitmap int8 code -128", q});
      }
    }
  }
  uint64_t seed = 4000;
  for (const Case& c : cases) {
    const size_t dense = c.bad.format == Format::kBitmap ? n + 3 : n;
    const HostPayload good1 = encoded(Format::kCoo, ValueType::kF32, dense, 300, Values::kNormal, ++seed);
    const HostPayload good2 = encoded(Format::kBitmap, ValueType::kF16, dense, 200, Values::kNormal, ++seed);
    expect_decode(dense, {good1, c.bad, good2}, 3, seed, c.name);
    if (HasFatalFailure()) return;
  }
}

TEST_F(CudaCodecs, RefusesFormatsWithoutDeviceCodec) {
  EXPECT_TRUE(cu::has_device_codec(Format::kCoo));
  EXPECT_TRUE(cu::has_device_codec(Format::kCooVarint));
  EXPECT_TRUE(cu::has_device_codec(Format::kBitmap));
  EXPECT_FALSE(cu::has_device_codec(Format::kCsr));
  EXPECT_EQ(cu::encode_bound_bytes(Format::kRle, ValueType::kF32, 100, 10), 0u);
  EncodeParams params;
  params.format = Format::kDense;
  DeviceBuffer count(8), out(1024), ws(1024);
  cu::DeviceSelection sel;
  sel.count = count.as<uint64_t>();
  cu::DevicePayloadOut o;
  o.data = out.as<std::byte>();
  o.capacity_bytes = 1024;
  o.bytes = count.as<uint64_t>();
  EXPECT_EQ(cu::encode(params, 100, sel, o, cu::Workspace{ws.as<void>(), 1024}, stream_).code(),
            Code::kInvalidArgument);
  cu::DevicePayload p;
  p.format = Format::kCsr;
  DeviceBuffer dense(400), status(sizeof(cu::DecodeStatus));
  const std::vector<cu::DevicePayload> ps = {p};
  EXPECT_EQ(cu::decode_accumulate(ps, dense.as<float>(), 100, 1, status.as<cu::DecodeStatus>(),
                                  cu::Workspace{ws.as<void>(), 1024}, stream_)
                .code(),
            Code::kInvalidArgument);
  ASSERT_TRUE(cu::synchronize(stream_).ok());
}

// ---- without a GPU: decode_status() is host code, in both builds --------------------------------

// Each DecodeError, as a kernel would fill it in, gives the CPU decoder's message for a payload
// that has that fault (the CPU decoder is run on the same bytes).
TEST(CudaCodecStatus, MessagesEqualTheCpuDecoders) {
  const size_t n = 1000;
  auto cpu = [&](const HostPayload& p, size_t dense) {
    std::vector<float> out(dense);
    return decode_accumulate(p.format, p.value_type, p.bytes, p.nnz, out);
  };
  auto view = [](const HostPayload& p) {
    cu::DevicePayload v;
    v.format = p.format;
    v.value_type = p.value_type;
    v.bytes = p.bytes.size();
    v.nnz = p.nnz;
    return v;
  };
  auto status = [](cu::DecodeError e, uint64_t entry, uint64_t value, uint64_t other) {
    cu::DecodeStatus s;
    s.error = static_cast<uint32_t>(e);
    s.entry = entry;
    s.value = value;
    s.other = other;
    return s;
  };
  auto expect_same = [&](const HostPayload& p, size_t dense, const cu::DecodeStatus& s, const char* what) {
    const Status want = cpu(p, dense);
    const Status got = cu::decode_status(view(p), dense, s);
    EXPECT_EQ(got.code(), want.code()) << what;
    EXPECT_EQ(got.message(), want.message()) << what;
  };
  const std::vector<uint32_t> index = {3, 9, 9, 1200};
  const std::vector<float> value = {1, 2, 3, 4};
  std::vector<std::byte> coo(4 * 4 + 4 * 4);
  std::memcpy(coo.data(), index.data(), 16);
  std::memcpy(coo.data() + 16, value.data(), 16);
  expect_same({Format::kCoo, ValueType::kF32, 4, coo}, n, status(cu::DecodeError::kIndexOrder, 2, 9, 9), "order");
  std::vector<std::byte> coo2 = coo;
  const uint32_t nine = 10;
  std::memcpy(coo2.data() + 8, &nine, 4);
  expect_same({Format::kCoo, ValueType::kF32, 4, coo2}, n, status(cu::DecodeError::kIndexRange, 3, 1200, 0), "range");
  expect_same({Format::kCoo, ValueType::kF32, 5, coo}, n, status(cu::DecodeError::kHeader, 0, 0, 0), "size");
  expect_same({Format::kCoo, ValueType::kF32, 2000, coo}, n, status(cu::DecodeError::kHeader, 0, 0, 0), "nnz");
  expect_same({static_cast<Format>(9), ValueType::kF32, 4, coo}, n, status(cu::DecodeError::kHeader, 0, 0, 0),
              "format");
  expect_same({Format::kCoo, static_cast<ValueType>(4), 4, coo}, n, status(cu::DecodeError::kHeader, 0, 0, 0),
              "value type");

  const HostPayload truncated = varint_payload(ValueType::kF32, {1, 2}, {varint_bytes(5), {std::byte{0x81}}});
  expect_same(truncated, n, status(cu::DecodeError::kVarint, 1, 9, 0), "varint");
  const HostPayload trailing =
      varint_payload(ValueType::kF32, {1, 2}, {varint_bytes(5), varint_bytes(6), varint_bytes(1)});
  expect_same(trailing, n, status(cu::DecodeError::kTrailing, 0, 1, 0), "trailing");
  const HostPayload far = varint_payload(ValueType::kF32, {1, 2}, {varint_bytes(5), varint_bytes(5000)});
  expect_same(far, n, status(cu::DecodeError::kIndexRange, 1, 5006, 0), "varint range");
  expect_same(varint_payload(ValueType::kF32, {1, 2}, {}), n, status(cu::DecodeError::kHeader, 0, 0, 0), "varint size");

  std::vector<std::byte> bitmap(2 + 4 * 3);  // dense 11: 2 bytes
  bitmap[0] = std::byte{0x07};
  bitmap[1] = std::byte{0x08};  // element 11 of 11
  expect_same({Format::kBitmap, ValueType::kF32, 3, bitmap}, 11, status(cu::DecodeError::kBitmapTail, 0, 0, 0), "tail");
  bitmap[1] = std::byte{0x01};
  expect_same({Format::kBitmap, ValueType::kF32, 3, bitmap}, 11, status(cu::DecodeError::kBitmapCount, 0, 4, 0),
              "count");

  std::vector<std::byte> i8(4 * 2 + 4 + 2);  // coo int8, 2 entries
  const uint32_t idx[2] = {1, 2};
  std::memcpy(i8.data(), idx, 8);
  for (float scale : {-2.5f, std::numeric_limits<float>::infinity(), -0.0f}) {
    std::memcpy(i8.data() + 8, &scale, 4);
    expect_same({Format::kCoo, ValueType::kI8, 2, i8}, n,
                status(cu::DecodeError::kInt8Scale, 0, std::bit_cast<uint32_t>(scale), 0), "scale");
  }
  const float one = 1.0f;
  std::memcpy(i8.data() + 8, &one, 4);
  i8[13] = std::byte{0x80};
  expect_same({Format::kCoo, ValueType::kI8, 2, i8}, n, status(cu::DecodeError::kInt8Code, 1, 0, 0), "code");
  i8[13] = std::byte{0x01};
  expect_same({Format::kCoo, ValueType::kI8, 2, i8}, n, status(cu::DecodeError::kNone, 0, 0, 0), "ok");
}

}  // namespace
}  // namespace sparsecar::kernels
