// The optional thread count: ThreadPool runs every task exactly once, and every kernel that takes
// a pool gives bit-identical output (pairs and residual) to its single-threaded call, which the
// other kernel tests check against plain references; one case per kernel is also checked
// against the reference directly.
#include "sparsecar/kernels/parallel.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <numeric>
#include <vector>

#include "sparsecar/kernels/codec.h"
#include "sparsecar/kernels/select.h"
#include "tests/unit/kernels/test_util.h"

namespace sparsecar::kernels {
namespace {

TEST(kernelsParallel, PoolRunsEveryTaskOnceAcrossRuns) {
  for (unsigned threads : {1u, 2u, 3u, 8u}) {
    ThreadPool pool(threads);
    EXPECT_EQ(pool.size(), threads);
    for (unsigned tasks : {0u, 1u, 2u, 5u, 64u}) {
      std::vector<std::atomic<int>> hits(tasks);
      pool.run(tasks, [&](unsigned t) { hits[t].fetch_add(1); });
      for (unsigned t = 0; t < tasks; ++t) ASSERT_EQ(hits[t].load(), 1) << threads << "/" << tasks;
    }
  }
  EXPECT_EQ(ThreadPool(0).size(), 1u);
  EXPECT_EQ(ThreadPool(1000).size(), kMaxKernelThreads);
}

TEST(kernelsParallel, ChunksCoverTheInputInAlignedPieces) {
  ThreadPool pool(4);
  EXPECT_EQ(chunk_count(nullptr, size_t{1} << 30), 1u);
  EXPECT_EQ(chunk_count(&pool, kParallelMinElements - 1), 1u);
  EXPECT_EQ(chunk_count(&pool, 3 * kParallelMinElements), 3u);
  EXPECT_EQ(chunk_count(&pool, 100 * kParallelMinElements), 4u);
  for (size_t n : {size_t{1000003}, size_t{1} << 20, size_t{17}}) {
    for (unsigned chunks : {1u, 2u, 3u, 4u}) {
      EXPECT_EQ(chunk_begin(n, chunks, 0), 0u);
      EXPECT_EQ(chunk_begin(n, chunks, chunks), n);
      for (unsigned c = 1; c < chunks; ++c) {
        EXPECT_EQ(chunk_begin(n, chunks, c) % 16, 0u);
        EXPECT_LE(chunk_begin(n, chunks, c - 1), chunk_begin(n, chunks, c));
      }
    }
  }
}

struct Pairs {
  std::vector<uint32_t> index;
  std::vector<float> value;
  size_t count = 0;
  bool operator==(const Pairs& o) const {
    if (count != o.count) return false;
    for (size_t j = 0; j < count; ++j) {
      if (index[j] != o.index[j] || !testing::same_bits(value[j], o.value[j])) return false;
    }
    return true;
  }
};

// Large enough for 4 chunks; data with exact ties so tie-breaking across chunks is exercised.
std::vector<float> tied_normals(size_t n, uint64_t seed) {
  auto x = testing::normal_floats(n, seed);
  for (size_t i = 0; i < n; i += 97) x[i] = 1.75f;  // ~1 % of the tensor on one key near the top
  return x;
}

TEST(kernelsParallel, TopkExactIsIdenticalForEveryThreadCount) {
  const size_t n = 4 * kParallelMinElements + 1234;
  const auto x = tied_normals(n, 9);
  std::vector<std::byte> scratch(topk_scratch_bytes(n));
  for (double d : {0.001, 0.01, 0.05, 0.1, 0.3}) {
    const size_t k = topk_count(n, d);
    Pairs serial{std::vector<uint32_t>(k), std::vector<float>(k)};
    auto got = topk_exact(x, k, scratch, serial.index.data(), serial.value.data());
    ASSERT_TRUE(got.ok());
    serial.count = *got;
    // The reference: the k largest |x| with ties to the lower index, by a stable sort.
    if (d == 0.05) {
      std::vector<uint32_t> order(n);
      std::iota(order.begin(), order.end(), 0u);
      std::stable_sort(order.begin(), order.end(),
                       [&](uint32_t a, uint32_t b) { return std::fabs(x[a]) > std::fabs(x[b]); });
      order.resize(k);
      std::sort(order.begin(), order.end());
      ASSERT_EQ(serial.index, order);
    }
    for (unsigned threads : {2u, 3u, 4u}) {
      ThreadPool pool(threads);
      Pairs par{std::vector<uint32_t>(k), std::vector<float>(k)};
      auto pgot = topk_exact(x, k, scratch, par.index.data(), par.value.data(), &pool);
      ASSERT_TRUE(pgot.ok());
      par.count = *pgot;
      EXPECT_TRUE(par == serial) << "density " << d << ", " << threads << " threads";
    }
  }
}

TEST(kernelsParallel, TopkApproxIsIdenticalForEveryThreadCount) {
  const size_t n = 3 * kParallelMinElements + 77;
  const auto x = testing::normal_floats(n, 10);
  std::vector<std::byte> scratch(topk_scratch_bytes(n));
  for (double tol : {0.0, 0.1}) {
    const size_t k = topk_count(n, 0.01);
    Pairs serial{std::vector<uint32_t>(n), std::vector<float>(n)};
    serial.count = *topk_approx(x, k, tol, scratch, serial.index.data(), serial.value.data(), n);
    ThreadPool pool(3);
    Pairs par{std::vector<uint32_t>(n), std::vector<float>(n)};
    par.count = *topk_approx(x, k, tol, scratch, par.index.data(), par.value.data(), n, &pool);
    EXPECT_TRUE(par == serial) << "tolerance " << tol;
  }
}

TEST(kernelsParallel, ThresholdAndFusedEfAreIdenticalForEveryThreadCount) {
  const size_t n = 4 * kParallelMinElements + 5;
  const auto g = testing::normal_floats(n, 11);
  const auto r0 = testing::normal_floats(n, 12, 0.5f);
  for (float lambda : {0.5f, 2.0f, 3.5f}) {
    // Reference: a plain loop.
    std::vector<uint32_t> want;
    for (size_t i = 0; i < n; ++i) {
      if (std::fabs(g[i]) >= lambda) want.push_back(static_cast<uint32_t>(i));
    }
    for (unsigned threads : {1u, 2u, 4u}) {
      ThreadPool pool(threads);
      Pairs t{std::vector<uint32_t>(n), std::vector<float>(n)};
      t.count = threshold_select(g, lambda, t.index.data(), t.value.data(), n, &pool);
      ASSERT_EQ(t.count, want.size());
      t.index.resize(t.count);
      EXPECT_EQ(t.index, want) << threads << " threads";

      std::vector<float> r_serial = r0;
      std::vector<float> r_par = r0;
      Pairs s{std::vector<uint32_t>(n), std::vector<float>(n)};
      Pairs p{std::vector<uint32_t>(n), std::vector<float>(n)};
      s.count = ef_threshold(r_serial, g, lambda, s.index.data(), s.value.data(), n);
      p.count = ef_threshold(r_par, g, lambda, p.index.data(), p.value.data(), n, &pool);
      EXPECT_TRUE(p == s) << lambda << ", " << threads << " threads";
      EXPECT_EQ(0, std::memcmp(r_serial.data(), r_par.data(), n * sizeof(float)));
    }
  }
  // capacity < n: the pool is not used, the count and the kept residual match the serial call.
  ThreadPool pool(4);
  std::vector<float> r_serial = r0;
  std::vector<float> r_par = r0;
  Pairs s{std::vector<uint32_t>(100), std::vector<float>(100)};
  Pairs p{std::vector<uint32_t>(100), std::vector<float>(100)};
  s.count = ef_threshold(r_serial, g, 1.0f, s.index.data(), s.value.data(), 100);
  p.count = ef_threshold(r_par, g, 1.0f, p.index.data(), p.value.data(), 100, &pool);
  EXPECT_EQ(s.count, p.count);
  EXPECT_EQ(0, std::memcmp(s.index.data(), p.index.data(), 100 * sizeof(uint32_t)));
  EXPECT_EQ(0, std::memcmp(r_serial.data(), r_par.data(), n * sizeof(float)));
}

// decode_accumulate with a pool: the same sums, bit for bit, for every format and value type
// (the scatters split; the other formats ignore the pool), and the same rejections. Dense carries
// every element whatever the density, so it is checked once (with the first density): its payload
// would be the same bytes for the other two.
TEST(kernelsParallel, DecodeIsIdenticalForEveryThreadCount) {
  const size_t n = 8 * kParallelMinElements + 4099;  // bitmap: 2 chunks and a partial last word
  const auto x = testing::normal_floats(n, 13);
  const auto base = testing::normal_floats(n, 14);
  // Two 8 MiB buffers, refilled from `base` for each decode (fresh vectors cost a large ASan
  // allocation and its page faults every time).
  std::vector<float> serial(n), par(n);
  for (double d : {0.002, 0.05, 0.4}) {
    const size_t k = topk_count(n, d);
    std::vector<std::byte> scratch(topk_scratch_bytes(n));
    std::vector<uint32_t> index(k);
    std::vector<float> value(k);
    ASSERT_TRUE(topk_exact(x, k, scratch, index.data(), value.data()).ok());
    for (Format f : {Format::kCoo, Format::kBitmap, Format::kRle, Format::kDense}) {
      if (f == Format::kDense && d != 0.002) continue;  // the same payload as at the first density
      for (ValueType vt : {ValueType::kF32, ValueType::kF16, ValueType::kI8}) {
        EncodeParams p;
        p.format = f;
        p.value_type = vt;
        std::vector<uint32_t> idx = index;
        std::vector<float> val = value;
        if (f == Format::kDense) {  // dense carries every element
          idx.resize(n);
          std::iota(idx.begin(), idx.end(), 0u);
          val = x;
        }
        auto size = encoded_size(p, n, idx);
        ASSERT_TRUE(size.ok());
        std::vector<std::byte> payload(*size);
        ASSERT_TRUE(encode(p, n, idx, val, payload).ok());
        std::copy(base.begin(), base.end(), serial.begin());
        ASSERT_TRUE(decode_accumulate(f, vt, payload, idx.size(), serial).ok());
        // Independent check of the serial result at the kept indices (fp32: exact sums).
        if (vt == ValueType::kF32) {
          for (size_t j = 0; j < idx.size(); j += 97) {
            ASSERT_EQ(serial[idx[j]], base[idx[j]] + val[j]) << j;
          }
        }
        for (unsigned threads : {2u, 3u}) {
          ThreadPool pool(threads);
          std::copy(base.begin(), base.end(), par.begin());
          ASSERT_TRUE(decode_accumulate(f, vt, payload, idx.size(), par, &pool).ok());
          ASSERT_EQ(0, std::memcmp(serial.data(), par.data(), n * sizeof(float)))
              << "format " << static_cast<int>(f) << " value type " << static_cast<int>(vt) << " density " << d
              << " threads " << threads;
          // A wrong count is still rejected, and nothing is written: `par` (now equal to `serial`)
          // stays byte for byte what it was.
          EXPECT_FALSE(decode_accumulate(f, vt, payload, idx.size() + 1, par, &pool).ok());
          EXPECT_EQ(0, std::memcmp(par.data(), serial.data(), n * sizeof(float)));
        }
      }
    }
  }
}

}  // namespace
}  // namespace sparsecar::kernels
