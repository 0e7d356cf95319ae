// The CUDA selections (cuda.h) against the CPU functions they must equal bit for bit: the same
// pairs in the same order, the same values, the same residual (and velocity) afterwards, the
// same count. Inputs are drawn fresh per case: normal values, NaN/+-inf sprinkled in, all-equal
// magnitudes (every element ties), many exact zeros; sizes 0, 1, around the tile size (4096)
// and large ones, and one tensor above 2^31 bytes where the GPU has the memory.
// Without a GPU (CI) every test skips with a message.
#include "sparsecar/kernels/cuda.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "sparsecar/kernels/ef.h"
#include "sparsecar/kernels/select.h"
#include "sparsecar/kernels/selectors.h"
#include "sparsecar/kernels/structured.h"

namespace sparsecar::kernels {
namespace {

namespace cu = sparsecar::kernels::cuda;

#define SKIP_WITHOUT_GPU()                                                                        \
  do {                                                                                            \
    if (cu::device_count() == 0) {                                                                \
      GTEST_SKIP() << "no CUDA GPU here (" << (cu::built() ? "built with CUDA" : "built without CUDA") \
                   << "): the CUDA kernels are checked on a GPU machine";                         \
    }                                                                                             \
  } while (0)

// A device buffer of T, freed at scope exit.
template <class T>
class DeviceBuffer {
 public:
  explicit DeviceBuffer(size_t count) : count_(count) {
    auto p = cu::device_alloc(std::max<size_t>(count, 1) * sizeof(T));
    EXPECT_TRUE(p.ok()) << p.status().to_string();
    if (p.ok()) ptr_ = static_cast<T*>(*p);
  }
  ~DeviceBuffer() { cu::device_free(ptr_); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  T* get() const { return ptr_; }
  void upload(const std::vector<T>& v) {
    ASSERT_EQ(v.size(), count_);
    ASSERT_TRUE(cu::copy_async(ptr_, v.data(), v.size() * sizeof(T), nullptr).ok());
  }
  std::vector<T> download(size_t count) const {
    std::vector<T> v(count);
    EXPECT_TRUE(cu::copy_async(v.data(), ptr_, count * sizeof(T), nullptr).ok());
    EXPECT_TRUE(cu::synchronize(nullptr).ok());
    return v;
  }
  // Fills with a byte pattern (poison) so unwritten entries show.
  void poison() {
    std::vector<unsigned char> bytes(std::max<size_t>(count_, 1) * sizeof(T), 0xA5);
    ASSERT_TRUE(cu::copy_async(ptr_, bytes.data(), bytes.size(), nullptr).ok());
  }

 private:
  size_t count_;
  T* ptr_ = nullptr;
};

enum class Data { kNormal, kSpecials, kAllEqual, kZeros };

std::vector<float> make_data(size_t n, Data kind, std::mt19937_64& rng) {
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> coin(0, 1);
  std::uniform_int_distribution<int> pick(0, 99);
  std::vector<float> x(n);
  for (size_t i = 0; i < n; ++i) {
    switch (kind) {
      case Data::kNormal:
        x[i] = normal(rng);
        break;
      case Data::kSpecials: {
        const int p = pick(rng);
        x[i] = p == 0   ? std::numeric_limits<float>::quiet_NaN()
               : p == 1 ? (coin(rng) ? 1.0f : -1.0f) * std::numeric_limits<float>::infinity()
               : p == 2 ? -0.0f
               : p == 3 ? std::numeric_limits<float>::denorm_min() * static_cast<float>(pick(rng) + 1)
                        : normal(rng);
        break;
      }
      case Data::kAllEqual:
        x[i] = coin(rng) ? 0.5f : -0.5f;
        break;
      case Data::kZeros:
        x[i] = pick(rng) < 90 ? 0.0f : normal(rng);
        break;
    }
  }
  return x;
}

std::string name_of(Data d) {
  switch (d) {
    case Data::kNormal: return "normal";
    case Data::kSpecials: return "nan/inf/denormal";
    case Data::kAllEqual: return "all-equal magnitudes";
    case Data::kZeros: return "90% zeros";
  }
  return "?";
}

// SPARSECAR_GPU_TEST_MAX_N caps the sizes (compute-sanitizer runs are 10-100x slower).
const std::vector<size_t>& sizes() {
  static const std::vector<size_t> s = [] {
    std::vector<size_t> all = {0, 1, 2, 31, 4095, 4096, 4097, 65537, 100003, (size_t{1} << 20) + 7,
                               (size_t{1} << 24) + 3};
    if (const char* cap = std::getenv("SPARSECAR_GPU_TEST_MAX_N")) {
      const size_t max_n = std::strtoull(cap, nullptr, 10);
      std::erase_if(all, [&](size_t n) { return n > max_n; });
    }
    return all;
  }();
  return s;
}
// The largest sizes run the normal data only (the special patterns are covered below them).
bool skip_case(size_t n, int kind) { return n > (size_t{1} << 21) && kind != 0; }
const Data kKinds[] = {Data::kNormal, Data::kSpecials, Data::kAllEqual, Data::kZeros};

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }

// Element i's result may be any NaN (not necessarily the CPU's bits): where two NaN operands
// meet, x86 returns one of them and the compiler picks the operand order (cuda.h says so).
using NanChoice = std::function<bool(size_t i)>;
bool same_value(float got, float want, size_t i, const NanChoice& either_nan) {
  if (same_bits(got, want)) return true;
  return either_nan && either_nan(i) && std::isnan(got) && std::isnan(want);
}

// Compares pairs and (optionally) a residual bit for bit; reports the first difference.
void expect_same(const std::string& what, const std::vector<uint32_t>& ref_index, const std::vector<float>& ref_value,
                 size_t ref_count, const std::vector<uint32_t>& index, const std::vector<float>& value, uint64_t count,
                 size_t written, const NanChoice& either_nan = {}) {
  ASSERT_EQ(count, ref_count) << what;
  for (size_t j = 0; j < written; ++j) {
    ASSERT_EQ(index[j], ref_index[j]) << what << ": pair " << j;
    ASSERT_TRUE(same_value(value[j], ref_value[j], index[j], either_nan))
        << what << ": value of pair " << j << " (index " << index[j] << "): " << value[j] << " vs " << ref_value[j];
  }
}
void expect_same_floats(const std::string& what, const std::vector<float>& got, const std::vector<float>& want,
                        const NanChoice& either_nan = {}) {
  ASSERT_EQ(got.size(), want.size()) << what;
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_TRUE(same_value(got[i], want[i], i, either_nan))
        << what << ": element " << i << ": " << got[i] << " vs " << want[i];
  }
}

// One GPU run's buffers for a tensor of n elements.
// ws_bytes 0: select_workspace_bytes(elements).
struct GpuRun {
  GpuRun(size_t elements, size_t pairs, size_t ws_bytes = 0)
      : n(elements), capacity(pairs), ws_size(ws_bytes != 0 ? ws_bytes : cu::select_workspace_bytes(elements)),
        residual(elements), grad(elements), index(pairs), value(pairs), count(1), ws(ws_size) {
    index.poison();
    value.poison();
  }
  cu::DeviceSelection out() const { return {index.get(), value.get(), capacity, count.get()}; }
  cu::Workspace workspace() const { return {ws.get(), ws_size}; }
  uint64_t fetch_count() const { return count.download(1)[0]; }
  size_t n;
  size_t capacity;
  size_t ws_size;
  DeviceBuffer<float> residual;
  DeviceBuffer<float> grad;
  DeviceBuffer<uint32_t> index;
  DeviceBuffer<float> value;
  DeviceBuffer<uint64_t> count;
  DeviceBuffer<unsigned char> ws;
};

TEST(CudaSelect, DeviceIsNamed) {
  SKIP_WITHOUT_GPU();
  const std::string d = cu::device_description(0);
  std::printf("GPU 0: %s\n", d.c_str());
  EXPECT_NE(d.find("SMs"), std::string::npos) << d;
}

TEST(CudaElementwise, Norm2EqualsTheFloat64SumOfSquares) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(7);
  for (size_t n : {size_t{0}, size_t{1}, size_t{4095}, size_t{1} << 20, (size_t{1} << 22) + 3}) {
    const std::vector<float> x = make_data(n, Data::kNormal, rng);
    double want = 0;  // the plain reference, in order
    for (float v : x) want += static_cast<double>(v) * static_cast<double>(v);
    DeviceBuffer<float> dx(n);
    DeviceBuffer<double> out(1);
    if (n > 0) dx.upload(x);
    out.poison();
    ASSERT_TRUE(cu::norm2(dx.get(), n, out.get(), nullptr).ok());
    const double got = out.download(1)[0];
    // Only the order of the float64 additions differs (blocks add atomically).
    EXPECT_NEAR(got, want, 1e-12 * std::max(want, 1.0)) << "n=" << n;
  }
  EXPECT_FALSE(cu::norm2(nullptr, 4, nullptr, nullptr).ok());
}

// The plain count, one value at a time: the bin is the top 11 bits of |x|'s IEEE pattern.
std::vector<uint64_t> plain_magnitude_histogram(const std::vector<float>& x, size_t m) {
  std::vector<uint64_t> h(cu::kMagnitudeHistogramBins, 0);
  for (size_t i = 0; i < m; ++i) {
    uint32_t bits;
    std::memcpy(&bits, &x[i], sizeof bits);
    ++h[(bits & 0x7fffffffu) >> 20];
  }
  return h;
}

TEST(CudaElementwise, MagnitudeHistogramEqualsThePlainCount) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(11);
  const float specials[] = {0.0f, -0.0f, std::numeric_limits<float>::denorm_min(), -1e-40f,
                            std::numeric_limits<float>::min(), 1.0f, -1.0f, 1.1f, 1.2f, -3e38f,
                            std::numeric_limits<float>::max(), std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(), std::numeric_limits<float>::quiet_NaN()};
  for (size_t n : {size_t{1}, size_t{14}, size_t{4095}, size_t{1} << 20, (size_t{1} << 22) + 3}) {
    std::vector<float> x = make_data(n, Data::kNormal, rng);
    for (size_t j = 0; j < std::size(specials) && j < n; ++j) x[(j * 7919) % n] = specials[j];
    DeviceBuffer<float> dx(n);
    DeviceBuffer<uint64_t> hist(cu::kMagnitudeHistogramBins);
    DeviceBuffer<uint64_t> count(1);
    dx.upload(x);
    hist.upload(std::vector<uint64_t>(cu::kMagnitudeHistogramBins, 0));
    // Whole array, then (added) its first m by a device count: the histograms pool.
    const size_t m = n / 3;
    count.upload({static_cast<uint64_t>(m)});
    ASSERT_TRUE(cu::magnitude_histogram_add(dx.get(), n, nullptr, hist.get(), nullptr).ok());
    ASSERT_TRUE(cu::magnitude_histogram_add(dx.get(), n, count.get(), hist.get(), nullptr).ok());
    std::vector<uint64_t> want = plain_magnitude_histogram(x, n);
    const std::vector<uint64_t> first = plain_magnitude_histogram(x, m);
    for (size_t b = 0; b < want.size(); ++b) want[b] += first[b];
    EXPECT_EQ(hist.download(cu::kMagnitudeHistogramBins), want) << "n=" << n;
    // A count above n stops at n.
    hist.upload(std::vector<uint64_t>(cu::kMagnitudeHistogramBins, 0));
    count.upload({static_cast<uint64_t>(n) + 5});
    ASSERT_TRUE(cu::magnitude_histogram_add(dx.get(), n, count.get(), hist.get(), nullptr).ok());
    EXPECT_EQ(hist.download(cu::kMagnitudeHistogramBins), plain_magnitude_histogram(x, n)) << "n=" << n;
  }
  EXPECT_FALSE(cu::magnitude_histogram_add(nullptr, 4, nullptr, nullptr, nullptr).ok());
  EXPECT_TRUE(cu::magnitude_histogram_add(nullptr, 0, nullptr, reinterpret_cast<uint64_t*>(8), nullptr).ok());
}

TEST(CudaSelect, EfThresholdEqualsCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(1);
  for (size_t n : sizes()) {
    for (Data kind : kKinds) {
      if (skip_case(n, static_cast<int>(kind))) continue;
      for (bool with_grad : {true, false}) {
        const auto r0 = make_data(n, kind, rng);
        const auto g = make_data(n, kind, rng);
        const float lambda = kind == Data::kAllEqual ? 0.5f : 1.5f;
        const std::string what = "n=" + std::to_string(n) + " " + name_of(kind) + (with_grad ? " ef" : " plain");
        // CPU: ef_threshold (clears what it wrote) or threshold_select (no grad, residual untouched).
        std::vector<float> ref_r = r0;
        std::vector<uint32_t> ref_index(n + 1);
        std::vector<float> ref_value(n + 1);
        const size_t ref_count = with_grad ? ef_threshold(ref_r, g, lambda, ref_index.data(), ref_value.data(), n)
                                           : threshold_select(ref_r, lambda, ref_index.data(), ref_value.data(), n);
        GpuRun run(n, n);
        run.residual.upload(r0);
        run.grad.upload(g);
        ASSERT_TRUE(cu::ef_threshold(run.residual.get(), with_grad ? run.grad.get() : nullptr, n, lambda, with_grad,
                                     run.out(), run.workspace(), nullptr)
                        .ok());
        const uint64_t count = run.fetch_count();
        expect_same(what, ref_index, ref_value, ref_count, run.index.download(n), run.value.download(n), count,
                    std::min<size_t>(count, n));
        expect_same_floats(what + " residual", run.residual.download(n), ref_r);
      }
    }
  }
}

TEST(CudaSelect, EfThresholdOverCapacityKeepsTheRestInTheResidual) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(2);
  const size_t n = 100003;
  const auto r0 = make_data(n, Data::kNormal, rng);
  const auto g = make_data(n, Data::kNormal, rng);
  const size_t capacity = 1000;  // about 16 % of the elements pass |r| >= 1.5: far more than 1000
  std::vector<float> ref_r = r0;
  std::vector<uint32_t> ref_index(capacity);
  std::vector<float> ref_value(capacity);
  const size_t ref_count = ef_threshold(ref_r, g, 1.5f, ref_index.data(), ref_value.data(), capacity);
  ASSERT_GT(ref_count, capacity);
  GpuRun run(n, capacity);
  run.residual.upload(r0);
  run.grad.upload(g);
  ASSERT_TRUE(cu::ef_threshold(run.residual.get(), run.grad.get(), n, 1.5f, true, run.out(), run.workspace(), nullptr)
                  .ok());
  expect_same("capacity 1000", ref_index, ref_value, ref_count, run.index.download(capacity),
              run.value.download(capacity), run.fetch_count(), capacity);
  expect_same_floats("capacity 1000 residual", run.residual.download(n), ref_r);
}

TEST(CudaSelect, MomentumThresholdEqualsCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(3);
  for (size_t n : sizes()) {
    for (Data kind : {Data::kNormal, Data::kSpecials}) {
      if (skip_case(n, static_cast<int>(kind))) continue;
      const auto u0 = make_data(n, kind, rng);
      const auto r0 = make_data(n, kind, rng);
      const auto g = make_data(n, kind, rng);
      const float momentum = 0.9f;
      const float factor = 0.37f;
      const float lambda = 1.2f;
      // CPU: momentum_accumulate, threshold_select, clear_selected on both.
      std::vector<float> ref_u = u0;
      std::vector<float> ref_r = r0;
      momentum_accumulate(ref_u, ref_r, g, momentum, factor);
      std::vector<uint32_t> ref_index(n + 1);
      std::vector<float> ref_value(n + 1);
      const size_t ref_count = threshold_select(ref_r, lambda, ref_index.data(), ref_value.data(), n);
      const std::span<const uint32_t> sent(ref_index.data(), ref_count);
      clear_selected(ref_r, sent);
      clear_selected(ref_u, sent);

      GpuRun run(n, n);
      DeviceBuffer<float> velocity(n);
      velocity.upload(u0);
      run.residual.upload(r0);
      run.grad.upload(g);
      ASSERT_TRUE(cu::ef_momentum_threshold(velocity.get(), run.residual.get(), run.grad.get(), n, momentum, factor,
                                            lambda, run.out(), run.workspace(), nullptr)
                      .ok());
      const std::string what = "momentum n=" + std::to_string(n) + " " + name_of(kind);
      const uint64_t count = run.fetch_count();
      // m u + f g and r + u: where both operands of an addition are NaN (inputs, or inf - inf),
      // either NaN may come out.
      const NanChoice two_nans = [&](size_t i) {
        const float a = momentum * u0[i];
        const float b = factor * g[i];
        const float ui = a + b;
        return (std::isnan(a) && std::isnan(b)) || (std::isnan(r0[i]) && std::isnan(ui));
      };
      expect_same(what, ref_index, ref_value, ref_count, run.index.download(n), run.value.download(n), count, count,
                  two_nans);
      expect_same_floats(what + " residual", run.residual.download(n), ref_r, two_nans);
      expect_same_floats(what + " velocity", velocity.download(n), ref_u, two_nans);
    }
  }
}

// CPU: ef_accumulate, then `select`, then clear_selected: the composition the fused GPU
// functions must equal.
template <class CpuSelect>
void check_topk_like(const std::string& name, size_t n, Data kind, size_t k, bool with_grad, std::mt19937_64& rng,
                     const CpuSelect& cpu_select,
                     const std::function<Status(GpuRun&, bool)>& gpu_select) {
  const auto r0 = make_data(n, kind, rng);
  const auto g = make_data(n, kind, rng);
  std::vector<float> ref_r = r0;
  if (with_grad) ef_accumulate(ref_r, g);
  std::vector<uint32_t> ref_index(n + 1);
  std::vector<float> ref_value(n + 1);
  const size_t ref_count = cpu_select(ref_r, k, ref_index.data(), ref_value.data());
  clear_selected(ref_r, std::span<const uint32_t>(ref_index.data(), ref_count));

  GpuRun run(n, n);
  run.residual.upload(r0);
  run.grad.upload(g);
  const Status st = gpu_select(run, with_grad);
  ASSERT_TRUE(st.ok()) << st.to_string();
  const std::string what = name + " n=" + std::to_string(n) + " k=" + std::to_string(k) + " " + name_of(kind) +
                           (with_grad ? " ef" : " plain");
  const uint64_t count = run.fetch_count();
  expect_same(what, ref_index, ref_value, ref_count, run.index.download(n), run.value.download(n), count,
              std::min<size_t>(count, n));
  expect_same_floats(what + " residual", run.residual.download(n), ref_r);
}

std::vector<size_t> ks_for(size_t n) {
  std::vector<size_t> ks = {0, 1, n / 1000 + 1, n / 100 + 1, n / 3, n, n + 5};
  std::sort(ks.begin(), ks.end());
  ks.erase(std::unique(ks.begin(), ks.end()), ks.end());
  return ks;
}

TEST(CudaSelect, EfTopkEqualsCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(4);
  for (size_t n : sizes()) {
    std::vector<std::byte> scratch(topk_scratch_bytes(n));
    for (Data kind : kKinds) {
      if (skip_case(n, static_cast<int>(kind))) continue;
      for (size_t k : ks_for(n)) {
        for (bool with_grad : {true, false}) {
          check_topk_like(
              "topk", n, kind, k, with_grad, rng,
              [&](std::span<const float> x, size_t kk, uint32_t* idx, float* val) {
                return *topk_exact(x, kk, scratch, idx, val);
              },
              [&](GpuRun& run, bool grad) {
                return cu::ef_topk(run.residual.get(), grad ? run.grad.get() : nullptr, n, k, true, run.out(),
                                   run.workspace(), nullptr);
              });
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

TEST(CudaSelect, EfTopkApproxEqualsCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(5);
  for (size_t n : sizes()) {
    std::vector<std::byte> scratch(topk_scratch_bytes(n));
    for (Data kind : kKinds) {
      if (skip_case(n, static_cast<int>(kind))) continue;
      for (size_t k : ks_for(n)) {
        for (double tol : {0.0, 0.1, 0.5}) {
          check_topk_like(
              "topk_approx tol=" + std::to_string(tol), n, kind, k, true, rng,
              [&](std::span<const float> x, size_t kk, uint32_t* idx, float* val) {
                return *topk_approx(x, kk, tol, scratch, idx, val, n);
              },
              [&](GpuRun& run, bool grad) {
                return cu::ef_topk_approx(run.residual.get(), grad ? run.grad.get() : nullptr, n, k, tol, true,
                                          run.out(), run.workspace(), nullptr);
              });
          if (HasFatalFailure()) return;
        }
      }
    }
  }
}

TEST(CudaSelect, EfPercentileEqualsCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(6);
  for (size_t n : sizes()) {
    std::vector<std::byte> scratch(topk_scratch_bytes(n));
    for (Data kind : kKinds) {
      if (skip_case(n, static_cast<int>(kind))) continue;
      for (double q : {0.0, 0.5, 0.99, 0.999, 1.0}) {
        const auto r0 = make_data(n, kind, rng);
        const auto g = make_data(n, kind, rng);
        // CPU: lambda from the sample of residual + grad, then ef_threshold.
        std::vector<float> ref_r = r0;
        const float lambda = magnitude_quantile(ref_r, q, scratch, g);
        std::vector<uint32_t> ref_index(n + 1);
        std::vector<float> ref_value(n + 1);
        const size_t ref_count = ef_threshold(ref_r, g, lambda, ref_index.data(), ref_value.data(), n);
        GpuRun run(n, n);
        run.residual.upload(r0);
        run.grad.upload(g);
        ASSERT_TRUE(
            cu::ef_percentile(run.residual.get(), run.grad.get(), n, q, true, run.out(), run.workspace(), nullptr).ok());
        const std::string what = "percentile q=" + std::to_string(q) + " n=" + std::to_string(n) + " " + name_of(kind);
        const uint64_t count = run.fetch_count();
        expect_same(what, ref_index, ref_value, ref_count, run.index.download(n), run.value.download(n), count,
                    std::min<size_t>(count, n));
        expect_same_floats(what + " residual", run.residual.download(n), ref_r);
      }
    }
  }
}

TEST(CudaSelect, RandomSelectorsEqualCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(7);
  for (size_t n : sizes()) {
    const auto x = make_data(n, Data::kSpecials, rng);
    for (double p : {0.0, 1e-4, 0.01, 0.3, 1.0}) {
      for (bool unbiased : {false, true}) {
        const uint64_t seed = derive_seed(42, 3, n);
        std::vector<uint32_t> ref_index(n + 1);
        std::vector<float> ref_value(n + 1);
        const size_t ref_count = randomk_select(x, p, seed, unbiased, ref_index.data(), ref_value.data(), n);
        GpuRun run(n, n);
        run.residual.upload(x);
        ASSERT_TRUE(cu::randomk(run.residual.get(), n, p, seed, unbiased, run.out(), run.workspace(), nullptr).ok());
        const std::string what = "randomk p=" + std::to_string(p) + " n=" + std::to_string(n);
        const uint64_t count = run.fetch_count();
        expect_same(what, ref_index, ref_value, ref_count, run.index.download(n), run.value.download(n), count,
                    std::min<size_t>(count, n));
        for (size_t block : {size_t{kMinBlock}, size_t{64}, size_t{kMaxBlock}}) {
          const auto ref_blocks =
              randblock_select(x, block, p, seed, unbiased, ref_index.data(), ref_value.data(), n);
          ASSERT_TRUE(ref_blocks.ok());
          GpuRun rb(n, n);
          rb.residual.upload(x);
          ASSERT_TRUE(
              cu::randblock(rb.residual.get(), n, block, p, seed, unbiased, rb.out(), rb.workspace(), nullptr).ok());
          const uint64_t c = rb.fetch_count();
          expect_same(what + " randblock " + std::to_string(block), ref_index, ref_value, *ref_blocks,
                      rb.index.download(n), rb.value.download(n), c, std::min<size_t>(c, n));
        }
      }
    }
  }
}

// Importance sampling: c from the fixed point in the blocked tree order (detail/importance.h),
// then the CPU's draws. CPU: ef_accumulate (with grad), importance_select, clear_selected (with
// grad: error feedback clears what it sent). Sizes around the tree's chunk (1024) and level
// (1024^2) boundaries; k from none to more than the non-zeros (c = +inf).
TEST(CudaSelect, EfImportanceEqualsCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(17);
  std::vector<size_t> ns = {0, 1, 1023, 1025, 100003, (size_t{1} << 20) + 7};
  const size_t max_n = sizes().empty() ? 0 : sizes().back();  // SPARSECAR_GPU_TEST_MAX_N
  std::erase_if(ns, [&](size_t n) { return n > max_n; });
  for (size_t n : ns) {
    for (Data kind : kKinds) {
      for (bool with_grad : {true, false}) {
        const auto r0 = make_data(n, kind, rng);
        const auto g = make_data(n, kind, rng);
        for (size_t k : {size_t{0}, size_t{1}, n / 100 + 1, n / 3, n + 5}) {
          for (bool unbiased : {false, true}) {
            const uint64_t seed = derive_seed(7, 2, n + k);
            std::vector<float> ref_r = r0;
            if (with_grad) ef_accumulate(ref_r, g);
            std::vector<uint32_t> ref_index(n + 1);
            std::vector<float> ref_value(n + 1);
            const size_t ref_count =
                importance_select(ref_r, k, seed, unbiased, ref_index.data(), ref_value.data(), n);
            if (with_grad) clear_selected(ref_r, std::span<const uint32_t>(ref_index.data(), ref_count));

            GpuRun run(n, n, cu::importance_workspace_bytes(n));
            run.residual.upload(r0);
            run.grad.upload(g);
            const Status st = cu::ef_importance(run.residual.get(), with_grad ? run.grad.get() : nullptr, n, k, seed,
                                                unbiased, with_grad, run.out(), run.workspace(), nullptr);
            const std::string what = "importance n=" + std::to_string(n) + " k=" + std::to_string(k) + " " +
                                     name_of(kind) + (with_grad ? " ef" : " plain") +
                                     (unbiased ? " unbiased" : "");
            ASSERT_TRUE(st.ok()) << what << ": " << st.to_string();
            const uint64_t count = run.fetch_count();
            expect_same(what, ref_index, ref_value, ref_count, run.index.download(n), run.value.download(n), count,
                        std::min<size_t>(count, n));
            expect_same_floats(what + " residual", run.residual.download(n), ref_r);
          }
        }
      }
    }
  }
}

// A capacity below the count: the first pairs, the count of all, and (error feedback) only the
// written ones cleared.
TEST(CudaSelect, EfImportanceOverCapacityKeepsTheRestInTheResidual) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(18);
  const size_t n = 100003;
  const size_t k = 5000;
  const size_t capacity = 1000;
  const auto r0 = make_data(n, Data::kSpecials, rng);
  const auto g = make_data(n, Data::kNormal, rng);
  std::vector<float> ref_r = r0;
  ef_accumulate(ref_r, g);
  std::vector<uint32_t> ref_index(capacity);
  std::vector<float> ref_value(capacity);
  const size_t ref_count = importance_select(ref_r, k, 99, false, ref_index.data(), ref_value.data(), capacity);
  ASSERT_GT(ref_count, capacity);
  clear_selected(ref_r, std::span<const uint32_t>(ref_index.data(), capacity));
  GpuRun run(n, capacity, cu::importance_workspace_bytes(n));
  run.residual.upload(r0);
  run.grad.upload(g);
  ASSERT_TRUE(cu::ef_importance(run.residual.get(), run.grad.get(), n, k, 99, false, true, run.out(), run.workspace(),
                                nullptr)
                  .ok());
  expect_same("importance capacity 1000", ref_index, ref_value, ref_count, run.index.download(capacity),
              run.value.download(capacity), run.fetch_count(), capacity);
  expect_same_floats("importance capacity 1000 residual", run.residual.download(n), ref_r);
}

// The registry rows get select_workspace_bytes(n, shape): importance must fit in it. Host-side
// size queries only, so this runs without a GPU too (the stub's sizes are 0).
TEST(CudaSelect, ImportanceWorkspaceFitsTheSelectWorkspace) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{1025}, size_t{100003}, (size_t{1} << 20) + 7, size_t{1} << 30,
                   size_t{std::numeric_limits<uint32_t>::max()}}) {
    EXPECT_LE(cu::importance_workspace_bytes(n), cu::select_workspace_bytes(n)) << n;
  }
}

// ---- structured selections -------------------------------------------------------------------

// CPU: ef_accumulate (with grad), the structured function, clear_selected; the GPU function runs
// on residual (+ grad) with clear_sent, capacity n, workspace structured_workspace_bytes(n, groups).
using CpuGroups = std::function<Expected<size_t>(std::span<const float> x, std::span<std::byte> scratch, uint32_t* idx,
                                                 float* val)>;
using GpuGroups = std::function<Status(GpuRun& run, const float* grad)>;
void check_structured(const std::string& name, size_t n, size_t groups, Data kind, bool with_grad,
                      std::mt19937_64& rng, const CpuGroups& cpu, const GpuGroups& gpu) {
  const auto r0 = make_data(n, kind, rng);
  const auto g = make_data(n, kind, rng);
  std::vector<float> ref_r = r0;
  if (with_grad) ef_accumulate(ref_r, g);
  std::vector<std::byte> scratch(group_scratch_bytes(groups));
  std::vector<uint32_t> ref_index(n + 1);
  std::vector<float> ref_value(n + 1);
  const auto ref = cpu(ref_r, scratch, ref_index.data(), ref_value.data());
  const std::string what = name + " n=" + std::to_string(n) + " groups=" + std::to_string(groups) + " " +
                           name_of(kind) + (with_grad ? " ef" : " plain");
  ASSERT_TRUE(ref.ok()) << what << ": " << ref.status().to_string();
  clear_selected(ref_r, std::span<const uint32_t>(ref_index.data(), *ref));

  GpuRun run(n, n, cu::structured_workspace_bytes(n, groups));
  run.residual.upload(r0);
  run.grad.upload(g);
  const Status st = gpu(run, with_grad ? run.grad.get() : nullptr);
  ASSERT_TRUE(st.ok()) << what << ": " << st.to_string();
  const uint64_t count = run.fetch_count();
  expect_same(what, ref_index, ref_value, *ref, run.index.download(n), run.value.download(n), count,
              std::min<size_t>(count, n));
  expect_same_floats(what + " residual", run.residual.download(n), ref_r);
}

// keep = 0, 1, half, all but one, all, more than all.
std::vector<size_t> keeps_for(size_t groups) {
  std::vector<size_t> ks = {0, 1, groups / 2, groups > 0 ? groups - 1 : 0, groups, groups + 3};
  std::sort(ks.begin(), ks.end());
  ks.erase(std::unique(ks.begin(), ks.end()), ks.end());
  return ks;
}

const GroupNorm kNorms[] = {GroupNorm::kL2, GroupNorm::kL1};

// Blocks of 32, 100 (n not a multiple: a short last block) and 256 over every test size; all
// four data kinds (NaN groups rank first; all-equal magnitudes tie every full block).
TEST(CudaStructured, BlockTopkEqualsCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(11);
  for (size_t n : sizes()) {
    for (Data kind : kKinds) {
      if (skip_case(n, static_cast<int>(kind))) continue;
      for (size_t block : {size_t{32}, size_t{100}, size_t{256}}) {
        const size_t groups = (n + block - 1) / block;
        for (size_t keep : keeps_for(groups)) {
          for (GroupNorm norm : kNorms) {
            for (bool with_grad : {true, false}) {
              check_structured(
                  "block_topk block=" + std::to_string(block) + " keep=" + std::to_string(keep) + " " +
                      std::string(group_norm_name(norm)),
                  n, groups, kind, with_grad, rng,
                  [&](std::span<const float> x, std::span<std::byte> sc, uint32_t* idx, float* val) {
                    return block_topk(x, block, keep, norm, sc, idx, val);
                  },
                  [&](GpuRun& run, const float* grad) {
                    return cu::ef_block_topk(run.residual.get(), grad, n, block, keep, norm, true, run.out(),
                                             run.workspace(), nullptr);
                  });
              if (HasFatalFailure()) return;
            }
          }
        }
      }
    }
  }
}

// [rows, cols] shapes: single rows and columns, square, tall, wide, and one of about 2^20.
struct Shape2 {
  size_t rows;
  size_t cols;
};
const Shape2 kShapes2[] = {{1, 1}, {1, 4097}, {4097, 1}, {3, 5}, {64, 64}, {100, 37}, {37, 1000}, {1000, 65},
                           {513, 2049}};

TEST(CudaStructured, RowAndColumnTopkEqualCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(12);
  for (const Shape2 shape : kShapes2) {
    const size_t n = shape.rows * shape.cols;
    const size_t rows = shape.rows;
    const size_t cols = shape.cols;
    for (Data kind : kKinds) {
      for (GroupNorm norm : kNorms) {
        for (bool with_grad : {true, false}) {
          const std::string dims = " [" + std::to_string(rows) + ", " + std::to_string(cols) + "] " +
                                   std::string(group_norm_name(norm));
          for (size_t keep : keeps_for(rows)) {
            check_structured(
                "row_topk keep=" + std::to_string(keep) + dims, n, rows, kind, with_grad, rng,
                [&](std::span<const float> x, std::span<std::byte> sc, uint32_t* idx, float* val) {
                  return row_topk(x, rows, cols, keep, norm, sc, idx, val);
                },
                [&](GpuRun& run, const float* grad) {
                  return cu::ef_row_topk(run.residual.get(), grad, n, rows, cols, keep, norm, true, run.out(),
                                         run.workspace(), nullptr);
                });
            if (HasFatalFailure()) return;
          }
          for (size_t keep : keeps_for(cols)) {
            check_structured(
                "column_topk keep=" + std::to_string(keep) + dims, n, cols, kind, with_grad, rng,
                [&](std::span<const float> x, std::span<std::byte> sc, uint32_t* idx, float* val) {
                  return column_topk(x, rows, cols, keep, norm, sc, idx, val);
                },
                [&](GpuRun& run, const float* grad) {
                  return cu::ef_column_topk(run.residual.get(), grad, n, rows, cols, keep, norm, true, run.out(),
                                            run.workspace(), nullptr);
                });
            if (HasFatalFailure()) return;
          }
        }
      }
    }
  }
}

TEST(CudaStructured, ChannelAndHeadTopkEqualCpu) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(13);
  const std::array<uint64_t, 4> conv_shapes[] = {{1, 1, 1, 1}, {3, 1, 1, 1}, {8, 3, 3, 3}, {64, 16, 3, 3},
                                                 {256, 64, 3, 3}};
  for (const auto& shape : conv_shapes) {
    const size_t n = shape[0] * shape[1] * shape[2] * shape[3];
    for (Data kind : kKinds) {
      for (GroupNorm norm : kNorms) {
        for (bool with_grad : {true, false}) {
          for (size_t keep : keeps_for(shape[0])) {
            check_structured(
                "channel_topk keep=" + std::to_string(keep) + " c_out=" + std::to_string(shape[0]) + " " +
                    std::string(group_norm_name(norm)),
                n, shape[0], kind, with_grad, rng,
                [&](std::span<const float> x, std::span<std::byte> sc, uint32_t* idx, float* val) {
                  return channel_topk(x, shape, keep, norm, sc, idx, val);
                },
                [&](GpuRun& run, const float* grad) {
                  return cu::ef_channel_topk(run.residual.get(), grad, n, shape, keep, norm, true, run.out(),
                                             run.workspace(), nullptr);
                });
            if (HasFatalFailure()) return;
          }
        }
      }
    }
  }
  // [leading, d] projections split into heads; the largest has heads of 2^18 + elements.
  struct HeadCase {
    size_t leading;
    size_t d;
    size_t heads;
  };
  for (const HeadCase c : {HeadCase{2, 3, 2}, HeadCase{96, 50, 3}, HeadCase{96, 50, 12}, HeadCase{96, 50, 96},
                           HeadCase{768, 768, 12}, HeadCase{64, 1, 8}}) {
    const size_t n = c.leading * c.d;
    for (Data kind : kKinds) {
      for (GroupNorm norm : kNorms) {
        for (bool with_grad : {true, false}) {
          for (size_t keep : keeps_for(c.heads)) {
            check_structured(
                "head_topk keep=" + std::to_string(keep) + " leading=" + std::to_string(c.leading) + " heads=" +
                    std::to_string(c.heads) + " " + std::string(group_norm_name(norm)),
                n, c.heads, kind, with_grad, rng,
                [&](std::span<const float> x, std::span<std::byte> sc, uint32_t* idx, float* val) {
                  return head_topk(x, c.leading, c.heads, keep, norm, sc, idx, val);
                },
                [&](GpuRun& run, const float* grad) {
                  return cu::ef_head_topk(run.residual.get(), grad, n, c.leading, c.heads, keep, norm, true,
                                          run.out(), run.workspace(), nullptr);
                });
            if (HasFatalFailure()) return;
          }
        }
      }
    }
  }
}

// Ties of group scores: nine in ten blocks are exact copies of one pattern (equal sums), the
// rest scale it; among the copies the lower block index must win, at every keep.
TEST(CudaStructured, TiedGroupsGoToTheLowerIndex) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(14);
  const size_t block = 64;
  const size_t groups = 1000;
  const size_t n = block * groups;
  const auto pattern = make_data(block, Data::kNormal, rng);
  std::vector<float> x(n);
  std::uniform_int_distribution<int> pick(0, 9);
  for (size_t b = 0; b < groups; ++b) {
    // Nine in ten blocks copy the pattern (equal scores); the rest scale it by 0.5 or 2.
    const float scale = pick(rng) == 0 ? (pick(rng) < 5 ? 0.5f : 2.0f) : 1.0f;
    for (size_t j = 0; j < block; ++j) x[b * block + j] = pattern[j] * scale;
  }
  for (size_t keep : {size_t{1}, size_t{50}, size_t{500}, size_t{999}}) {
    std::vector<std::byte> scratch(group_scratch_bytes(groups));
    std::vector<uint32_t> ref_index(n);
    std::vector<float> ref_value(n);
    const auto ref = block_topk(x, block, keep, GroupNorm::kL2, scratch, ref_index.data(), ref_value.data());
    ASSERT_TRUE(ref.ok());
    GpuRun run(n, n, cu::structured_workspace_bytes(n, groups));
    run.residual.upload(x);
    ASSERT_TRUE(cu::ef_block_topk(run.residual.get(), nullptr, n, block, keep, GroupNorm::kL2, false, run.out(),
                                  run.workspace(), nullptr)
                    .ok());
    const uint64_t count = run.fetch_count();
    expect_same("tied blocks keep=" + std::to_string(keep), ref_index, ref_value, *ref, run.index.download(n),
                run.value.download(n), count, std::min<size_t>(count, n));
    expect_same_floats("tied blocks residual untouched", run.residual.download(n), x);
  }
}

// Every registry row that has a CUDA function (find_select) against the row's CPU function,
// composed as the compressor does: residual += grad, select, clear what was sent.
TEST(CudaSelect, RegistryRowsEqualTheirCpuRows) {
  SKIP_WITHOUT_GPU();
  std::mt19937_64 rng(9);
  std::vector<std::string> with_cuda;
  for (const SelectorInfo& row : selector_registry()) {
    const cu::SelectFn gpu = cu::find_select(row.id);
    if (gpu == nullptr || row.cpu == nullptr) continue;
    with_cuda.push_back(row.name);
    // Multiples of 64 get a shape ([n/64, 64], channels [n/64, 4, 4, 4]) that the shaped rows
    // use; the other sizes have none, so those rows take their top-k fallback.
    for (size_t n : {size_t{0}, size_t{1}, size_t{4096}, size_t{4097}, size_t{65536}, size_t{100003}}) {
      std::vector<uint64_t> shape;
      if (n > 0 && n % 64 == 0) {
        shape = row.id == Selector::kChannelTopk ? std::vector<uint64_t>{n / 64, 4, 4, 4}
                                                 : std::vector<uint64_t>{n / 64, 64};
      }
      SelectorParams params;
      params.density = 0.02;
      params.threshold = 1.5f;
      params.quantile = 0.97;
      params.approx_tolerance = 0.2;
      params.block_size = 64;
      params.seed = derive_seed(5, 1, n);
      const auto r0 = make_data(n, Data::kSpecials, rng);
      const auto g = make_data(n, Data::kNormal, rng);
      std::vector<float> ref_r = r0;
      ef_accumulate(ref_r, g);
      std::vector<std::byte> scratch(selector_scratch_bytes(n, shape));
      std::vector<uint32_t> ref_index(n + 1);
      std::vector<float> ref_value(n + 1);
      SelectInput in;
      in.x = ref_r;
      in.grad = g;
      in.shape = shape;
      in.params = &params;
      in.scratch = scratch;
      const auto ref_count = row.cpu(in, {ref_index.data(), ref_value.data(), n});
      ASSERT_TRUE(ref_count.ok()) << row.name << ": " << ref_count.status().to_string();
      clear_selected(ref_r, std::span<const uint32_t>(ref_index.data(), std::min<size_t>(*ref_count, n)));

      GpuRun run(n, n, cu::select_workspace_bytes(n, shape));
      run.residual.upload(r0);
      run.grad.upload(g);
      cu::SelectArgs args;
      args.shape = shape;
      args.residual = run.residual.get();
      args.grad = run.grad.get();
      args.n = n;
      args.params = &params;
      args.clear_sent = true;
      args.out = run.out();
      args.ws = run.workspace();
      const Status st = gpu(args);
      ASSERT_TRUE(st.ok()) << row.name << ": " << st.to_string();
      const std::string what =
          std::string(row.name) + " (registry) n=" + std::to_string(n) + (shape.empty() ? " no shape" : " shaped");
      const uint64_t count = run.fetch_count();
      expect_same(what, ref_index, ref_value, *ref_count, run.index.download(n), run.value.download(n), count,
                  std::min<size_t>(count, n));
      expect_same_floats(what + " residual", run.residual.download(n), ref_r);
    }
  }
  std::string names;
  for (const auto& name : with_cuda) names += name + " ";
  std::printf("selectors with a CUDA function: %s\n", names.c_str());
  EXPECT_GE(with_cuda.size(), 12u) << names;
}

// Above 2^31 bytes per array: 64-bit offsets everywhere (indices stay uint32).
TEST(CudaSelect, TensorAboveTwoGiB) {
  SKIP_WITHOUT_GPU();
  if (sizes().back() < (size_t{1} << 24)) GTEST_SKIP() << "sizes capped by SPARSECAR_GPU_TEST_MAX_N";
  const size_t n = (size_t{1} << 29) + 12345;  // 2 GiB + 48 KiB of floats
  std::mt19937_64 rng(8);
  auto r0 = make_data(n, Data::kNormal, rng);
  std::vector<float> ref_r = r0;
  const size_t k = 1000;
  std::vector<std::byte> scratch(topk_scratch_bytes(n));
  std::vector<uint32_t> ref_index(k);
  std::vector<float> ref_value(k);
  const size_t ref_count = *topk_exact(ref_r, k, scratch, ref_index.data(), ref_value.data());
  clear_selected(ref_r, std::span<const uint32_t>(ref_index.data(), ref_count));
  GpuRun run(n, k);
  if (run.residual.get() == nullptr || run.ws.get() == nullptr) GTEST_SKIP() << "not enough GPU memory";
  run.residual.upload(r0);
  ASSERT_TRUE(cu::ef_topk(run.residual.get(), nullptr, n, k, true, run.out(), run.workspace(), nullptr).ok());
  const uint64_t count = run.fetch_count();
  expect_same("topk n=2^29+12345", ref_index, ref_value, ref_count, run.index.download(k), run.value.download(k),
              count, count);
  // And the last element with a threshold that selects only it.
  r0.back() = 1e30f;
  GpuRun last(n, 4);
  last.residual.upload(r0);
  ASSERT_TRUE(cu::ef_threshold(last.residual.get(), nullptr, n, 1e29f, false, last.out(), last.workspace(), nullptr)
                  .ok());
  ASSERT_EQ(last.fetch_count(), 1u);
  EXPECT_EQ(last.index.download(1)[0], static_cast<uint32_t>(n - 1));
}

TEST(CudaSelect, BadArgumentsQueueNothing) {
  if (!cu::built()) {
    float x = 0;
    EXPECT_EQ(cu::ef_threshold(&x, nullptr, 1, 1.0f, false, {}, {}, nullptr).code(), Code::kUnavailable);
    EXPECT_EQ(cu::ef_importance(&x, nullptr, 1, 1, 1, false, false, {}, {}, nullptr).code(), Code::kUnavailable);
    return;
  }
  SKIP_WITHOUT_GPU();
  GpuRun run(100, 10);
  // Workspace too small, null count, capacity below k, tolerance out of range, block out of range.
  EXPECT_EQ(cu::ef_threshold(run.residual.get(), nullptr, 100, 1.0f, false, run.out(), {run.ws.get(), 16}, nullptr)
                .code(),
            Code::kInvalidArgument);
  cu::DeviceSelection no_count = run.out();
  no_count.count = nullptr;
  EXPECT_EQ(cu::ef_threshold(run.residual.get(), nullptr, 100, 1.0f, false, no_count, run.workspace(), nullptr).code(),
            Code::kInvalidArgument);
  EXPECT_EQ(cu::ef_topk(run.residual.get(), nullptr, 100, 11, false, run.out(), run.workspace(), nullptr).code(),
            Code::kInvalidArgument);
  EXPECT_EQ(cu::ef_topk_approx(run.residual.get(), nullptr, 100, 5, 1.5, false, run.out(), run.workspace(), nullptr)
                .code(),
            Code::kInvalidArgument);
  EXPECT_EQ(cu::randblock(run.residual.get(), 100, 1, 0.5, 1, false, run.out(), run.workspace(), nullptr).code(),
            Code::kInvalidArgument);
  EXPECT_EQ(cu::ef_threshold(nullptr, nullptr, 100, 1.0f, false, run.out(), run.workspace(), nullptr).code(),
            Code::kInvalidArgument);
  EXPECT_EQ(cu::ef_importance(run.residual.get(), nullptr, 100, 5, 1, false, false, no_count, run.workspace(), nullptr)
                .code(),
            Code::kInvalidArgument);
  EXPECT_EQ(cu::ef_importance(run.residual.get(), nullptr, 100, 5, 1, false, false, run.out(), {run.ws.get(), 16},
                              nullptr)
                .code(),
            Code::kInvalidArgument);
}

TEST(CudaStructured, BadArgumentsQueueNothing) {
  if (!cu::built()) {
    float x = 0;
    EXPECT_EQ(cu::ef_block_topk(&x, nullptr, 1, 32, 1, GroupNorm::kL2, false, {}, {}, nullptr).code(),
              Code::kUnavailable);
    EXPECT_EQ(cu::ef_column_topk(&x, nullptr, 1, 1, 1, 1, GroupNorm::kL2, false, {}, {}, nullptr).code(),
              Code::kUnavailable);
    return;
  }
  SKIP_WITHOUT_GPU();
  const size_t n = 100;
  GpuRun run(n, n, cu::structured_workspace_bytes(n, n));
  float* r = run.residual.get();
  const GroupNorm l2 = GroupNorm::kL2;
  // Block out of range; shapes that do not hold n; heads that do not split the leading dimension.
  EXPECT_EQ(cu::ef_block_topk(r, nullptr, n, 16, 1, l2, false, run.out(), run.workspace(), nullptr).code(),
            Code::kInvalidArgument);
  EXPECT_EQ(cu::ef_row_topk(r, nullptr, n, 7, 14, 1, l2, false, run.out(), run.workspace(), nullptr).code(),
            Code::kInvalidArgument);
  EXPECT_EQ(cu::ef_column_topk(r, nullptr, n, 0, 100, 1, l2, false, run.out(), run.workspace(), nullptr).code(),
            Code::kInvalidArgument);
  const std::array<uint64_t, 4> conv = {5, 5, 2, 3};
  EXPECT_EQ(cu::ef_channel_topk(r, nullptr, n, conv, 1, l2, false, run.out(), run.workspace(), nullptr).code(),
            Code::kInvalidArgument);
  EXPECT_EQ(cu::ef_head_topk(r, nullptr, n, 10, 3, 1, l2, false, run.out(), run.workspace(), nullptr).code(),
            Code::kInvalidArgument);
  // Capacity below the selection (2 rows of 50), a workspace too small, a null count.
  cu::DeviceSelection small = run.out();
  small.capacity = 99;
  EXPECT_EQ(cu::ef_row_topk(r, nullptr, n, 2, 50, 2, l2, false, small, run.workspace(), nullptr).code(),
            Code::kInvalidArgument);
  EXPECT_EQ(cu::ef_column_topk(r, nullptr, n, 2, 50, 1, l2, false, run.out(), {run.ws.get(), 16}, nullptr).code(),
            Code::kInvalidArgument);
  cu::DeviceSelection no_count = run.out();
  no_count.count = nullptr;
  EXPECT_EQ(cu::ef_block_topk(r, nullptr, n, 32, 1, l2, false, no_count, run.workspace(), nullptr).code(),
            Code::kInvalidArgument);
}

}  // namespace
}  // namespace sparsecar::kernels
