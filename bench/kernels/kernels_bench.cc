// Throughput of the CPU kernels, in GB/s counting the bytes each kernel must read and write,
// next to a memcpy of n floats (8n bytes moved) measured in the same run as the ceiling.
//
//   sparsecar_kernels_bench [--benchmark_filter=...]      (scripts/bench kernels: table + JSON)
//
// Arguments of every case: /<elements>/<density in per mille>. Data: N(0, 1) floats, seed 42.
// Bytes counted per call (k = selected count, n = elements):
//   memcpy            read 4n + write 4n
//   ef_threshold      read residual + grad (8n), write residual (4n) + pairs (8k)
//   topk_exact        read 4n, write pairs (8k)
//   topk_approx       read 4n, write pairs (8 * selected; tolerance 0.1)
//   nth_element       same bytes as topk_exact (the baseline it replaces: copy |x|,
//                     std::nth_element for the k-th magnitude, then a threshold pass)
//   <format>_encode   read pairs (8k), write the payload      (encode(): checks + layout)
//   <format>_decode   read the payload, read + write the touched floats (8 * nnz; nnz = n for dense)
//                     e.g. coo: 8k + 8k; bitmap: n/8 + 4k + 8k; coo_varint: 4k + ~k..2k + 8k
//                     One encode and one decode case per row of the codec registry
//                     (kernels/codecs.h; encode_case, decode_case), so a codec added to the
//                     registry gets its benchmark rows here without an edit; csr reads the 2-D
//                     view [n / 1024, 1024].
// Encoders/decoders run on a top-k selection of the data (the pipeline's common case).
// Buffers are LargeVectors (huge-page advised, as the daemon allocates them); the memcpy baseline
// copies between two such buffers.
//   select_<selector> read 4n, write pairs (8 * selected): every row of the selector registry
//                     through its CPU function (see select_case)
// The *_threads cases (/<elements>/<per mille>/<threads>; ef_threshold, topk_exact and the decode
// of every codec row with .parallel_decode: dense, coo, bitmap) run the same kernel with a
// kernels::ThreadPool of that many threads (the daemon's kernel_threads knob), default: every CPU.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "sparsecar/common/large_vector.h"
#include "sparsecar/kernels/codec.h"
#include "sparsecar/kernels/ef.h"
#include "sparsecar/kernels/parallel.h"
#include "sparsecar/kernels/select.h"
#include "sparsecar/kernels/selectors.h"

namespace sk = sparsecar::kernels;

namespace {

const sparsecar::LargeVector<float>& data(size_t n) {
  static std::map<size_t, sparsecar::LargeVector<float>> cache;
  auto it = cache.find(n);
  if (it == cache.end()) {
    std::mt19937_64 rng(42);
    std::normal_distribution<float> dist(0.0f, 1.0f);
    sparsecar::LargeVector<float> x(n);
    for (float& v : x) v = dist(rng);
    it = cache.emplace(n, std::move(x)).first;
  }
  return it->second;
}

size_t elements(const benchmark::State& s) { return static_cast<size_t>(s.range(0)); }
double density(const benchmark::State& s) { return static_cast<double>(s.range(1)) / 1000.0; }

// The magnitude of the k-th largest element: the lambda that makes a threshold keep ~k.
float lambda_for(const sparsecar::LargeVector<float>& x, size_t k) {
  sparsecar::LargeVector<float> mag(x.size());
  for (size_t i = 0; i < x.size(); ++i) mag[i] = std::fabs(x[i]);
  std::nth_element(mag.begin(), mag.begin() + static_cast<std::ptrdiff_t>(k - 1), mag.end(),
                   std::greater<>());
  return mag[k - 1];
}

void set_bytes(benchmark::State& s, double bytes_per_call) {
  s.SetBytesProcessed(static_cast<int64_t>(bytes_per_call * static_cast<double>(s.iterations())));
}

void BM_memcpy(benchmark::State& s) {
  const auto& x = data(elements(s));
  sparsecar::LargeVector<float> dst(x.size(), 0.0f);
  for (auto _ : s) {
    std::memcpy(dst.data(), x.data(), x.size() * sizeof(float));
    benchmark::ClobberMemory();
  }
  set_bytes(s, 8.0 * static_cast<double>(x.size()));
}

// The daemon's ||x||^2 (float64; three a step per tensor while a controller listens) against
// the plain serial sum it replaced, which waits on each add's latency. Bytes: read 4n.
void BM_norm2(benchmark::State& s) {
  const auto& x = data(elements(s));
  double sum = 0;
  for (auto _ : s) {
    sum = sk::norm2(x);
    benchmark::DoNotOptimize(sum);
  }
  set_bytes(s, 4.0 * static_cast<double>(x.size()));
}

void BM_norm2_serial(benchmark::State& s) {
  const auto& x = data(elements(s));
  double sum = 0;
  for (auto _ : s) {
    sum = 0;
    for (const float v : x) sum += static_cast<double>(v) * static_cast<double>(v);
    benchmark::DoNotOptimize(sum);
  }
  set_bytes(s, 4.0 * static_cast<double>(x.size()));
}

void ef_threshold_case(benchmark::State& s, sk::ThreadPool* pool) {
  const auto& g = data(elements(s));
  const size_t n = g.size();
  const float lambda = lambda_for(g, sk::topk_count(n, density(s)));
  sparsecar::LargeVector<float> residual(n, 0.0f);
  sparsecar::LargeVector<uint32_t> index(n);
  sparsecar::LargeVector<float> value(n);
  size_t selected = 0;
  for (auto _ : s) {
    // Zero the residual before each call so every call sees the same density (not timed).
    s.PauseTiming();
    std::fill(residual.begin(), residual.end(), 0.0f);
    s.ResumeTiming();
    selected = sk::ef_threshold(residual, g, lambda, index.data(), value.data(), n, pool);
    benchmark::DoNotOptimize(selected);
    benchmark::ClobberMemory();
  }
  s.counters["selected"] = static_cast<double>(selected);
  set_bytes(s, 12.0 * static_cast<double>(n) + 8.0 * static_cast<double>(selected));
}

// The input and buffers of a top-k case: outputs of n entries, as the daemon's (a
// single-threaded exact top-k then compacts in place).
struct TopkCase {
  explicit TopkCase(const benchmark::State& s)
      : x(data(elements(s))), n(x.size()), k(sk::topk_count(n, density(s))),
        scratch(sk::topk_scratch_bytes(n)), index(n), value(n) {}
  const sparsecar::LargeVector<float>& x;
  const size_t n;
  const size_t k;
  sparsecar::LargeVector<std::byte> scratch;
  sparsecar::LargeVector<uint32_t> index;
  sparsecar::LargeVector<float> value;
};

void topk_exact_case(benchmark::State& s, sk::ThreadPool* pool) {
  TopkCase c(s);
  const size_t n = c.n;
  const size_t k = c.k;
  for (auto _ : s) {
    auto got = sk::topk_exact(c.x, k, c.scratch, c.index.data(), c.value.data(), pool, n);
    if (!got.ok()) {
      s.SkipWithError(got.status().to_string().c_str());
      break;
    }
    benchmark::DoNotOptimize(*got);
    benchmark::ClobberMemory();
  }
  set_bytes(s, 4.0 * static_cast<double>(n) + 8.0 * static_cast<double>(k));
}

void BM_ef_threshold(benchmark::State& s) { ef_threshold_case(s, nullptr); }
void BM_topk_exact(benchmark::State& s) { topk_exact_case(s, nullptr); }
void BM_ef_threshold_threads(benchmark::State& s) {
  sk::ThreadPool pool(static_cast<unsigned>(s.range(2)));
  ef_threshold_case(s, &pool);
}
void BM_topk_exact_threads(benchmark::State& s) {
  sk::ThreadPool pool(static_cast<unsigned>(s.range(2)));
  topk_exact_case(s, &pool);
}

void BM_topk_approx(benchmark::State& s) {
  TopkCase c(s);
  const size_t n = c.n;
  const size_t k = c.k;
  size_t selected = 0;
  for (auto _ : s) {
    auto got = sk::topk_approx(c.x, k, 0.1, c.scratch, c.index.data(), c.value.data(), n);
    if (!got.ok()) {
      s.SkipWithError(got.status().to_string().c_str());
      break;
    }
    selected = *got;
    // Not DoNotOptimize(selected): GCC 13 with Google Benchmark 1.8's "+m,r" constraint handed
    // back a garbage count on the lent machine (google/benchmark#903 is the same family).
    benchmark::DoNotOptimize(c.index.data());
    benchmark::ClobberMemory();
  }
  s.counters["selected"] = static_cast<double>(selected);
  set_bytes(s, 4.0 * static_cast<double>(n) + 8.0 * static_cast<double>(selected));
}

void BM_nth_element(benchmark::State& s) {
  const auto& x = data(elements(s));
  const size_t n = x.size();
  const size_t k = sk::topk_count(n, density(s));
  sparsecar::LargeVector<float> mag(n);
  sparsecar::LargeVector<uint32_t> index(n);
  sparsecar::LargeVector<float> value(n);
  for (auto _ : s) {
    for (size_t i = 0; i < n; ++i) mag[i] = std::fabs(x[i]);
    std::nth_element(mag.begin(), mag.begin() + static_cast<std::ptrdiff_t>(k - 1), mag.end(),
                     std::greater<>());
    const size_t got = sk::threshold_select(x, mag[k - 1], index.data(), value.data(), n);
    benchmark::DoNotOptimize(got);
    benchmark::ClobberMemory();
  }
  set_bytes(s, 4.0 * static_cast<double>(n) + 8.0 * static_cast<double>(k));
}

struct Selection {
  sparsecar::LargeVector<uint32_t> index;
  sparsecar::LargeVector<float> value;
};

Selection select_topk(const sparsecar::LargeVector<float>& x, size_t k) {
  Selection sel{sparsecar::LargeVector<uint32_t>(k), sparsecar::LargeVector<float>(k)};
  sparsecar::LargeVector<std::byte> scratch(sk::topk_scratch_bytes(x.size()));
  if (!sk::topk_exact(x, k, scratch, sel.index.data(), sel.value.data()).ok()) std::abort();
  return sel;
}

// Selections are cached per (n, density): several benchmarks share them.
const Selection& cached_selection(size_t n, double d) {
  static std::map<std::pair<size_t, int64_t>, Selection> cache;
  const auto key = std::make_pair(n, static_cast<int64_t>(d * 1e6));
  auto it = cache.find(key);
  if (it == cache.end()) it = cache.emplace(key, select_topk(data(n), sk::topk_count(n, d))).first;
  return it->second;
}

// Bytes an encoder or decoder moves (the table at the top): the payload plus the 8 bytes per
// entry on the other side (pairs read by an encoder; touched floats read and written by a
// decoder: the header's nnz of them). For COO that is 16k, for bitmap n/8 + 12k.
double codec_bytes(size_t entries, size_t payload) {
  return static_cast<double>(payload) + 8.0 * static_cast<double>(entries);
}

sk::EncodeParams codec_params(const sk::CodecInfo* row, size_t n) {
  sk::EncodeParams p;
  p.format = row->id;
  p.rows = row->needs_rows ? static_cast<uint32_t>(n / 1024) : 1;
  return p;
}

// One row of the codec registry (kernels/codecs.h) through the public encode() (checks + the
// row's layout), fp32 values.
void encode_case(benchmark::State& s, const sk::CodecInfo* row) {
  const size_t n = elements(s);
  const Selection& sel = cached_selection(n, density(s));
  const sk::EncodeParams p = codec_params(row, n);
  sparsecar::LargeVector<std::byte> payload(sk::encoded_size(p, n, sel.index).value());
  for (auto _ : s) {
    auto wrote = sk::encode(p, n, sel.index, sel.value, payload);
    if (!wrote.ok()) {
      s.SkipWithError(wrote.status().to_string().c_str());
      break;
    }
    benchmark::DoNotOptimize(*wrote);
    benchmark::ClobberMemory();
  }
  set_bytes(s, codec_bytes(sel.index.size(), payload.size()));
}

// The receiver's decode_accumulate of that payload; with a ThreadPool of range(2) threads for the
// *_threads cases.
void decode_case(benchmark::State& s, const sk::CodecInfo* row, bool threads) {
  const size_t n = elements(s);
  const Selection& sel = cached_selection(n, density(s));
  const sk::EncodeParams p = codec_params(row, n);
  sparsecar::LargeVector<std::byte> payload(sk::encoded_size(p, n, sel.index).value());
  if (!sk::encode(p, n, sel.index, sel.value, payload).ok()) std::abort();
  const size_t nnz = row->dense ? n : sel.index.size();
  std::unique_ptr<sk::ThreadPool> pool;
  if (threads) pool = std::make_unique<sk::ThreadPool>(static_cast<unsigned>(s.range(2)));
  sparsecar::LargeVector<float> dense(n, 0.0f);
  for (auto _ : s) {
    const sparsecar::Status st = sk::decode_accumulate(row->id, sk::ValueType::kF32, payload, nnz, dense, pool.get());
    if (!st.ok()) {
      s.SkipWithError(st.to_string().c_str());
      break;
    }
    benchmark::ClobberMemory();
  }
  set_bytes(s, codec_bytes(nnz, payload.size()));
}

void sizes_only(benchmark::internal::Benchmark* b) {
  for (int64_t n : {int64_t{1} << 20, int64_t{1} << 24, int64_t{1} << 26}) b->Args({n, 10});
}
void sizes_and_densities(benchmark::internal::Benchmark* b) {
  for (int64_t n : {int64_t{1} << 20, int64_t{1} << 24, int64_t{1} << 26}) {
    for (int64_t permille : {1, 10, 100}) b->Args({n, permille});
  }
}

void sizes_densities_threads(benchmark::internal::Benchmark* b) {
  const char* env = std::getenv("SPARSECAR_BENCH_THREADS");
  const int64_t threads = env != nullptr ? std::atoll(env) : std::max(2u, std::thread::hardware_concurrency());
  for (int64_t n : {int64_t{1} << 20, int64_t{1} << 24, int64_t{1} << 26}) {
    for (int64_t permille : {1, 10, 100}) b->Args({n, permille, threads});
  }
}

}  // namespace

BENCHMARK(BM_memcpy)->Apply(sizes_only)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_norm2)->Apply(sizes_only)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_norm2_serial)->Apply(sizes_only)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_ef_threshold)->Apply(sizes_and_densities)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_topk_exact)->Apply(sizes_and_densities)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_ef_threshold_threads)->Apply(sizes_densities_threads)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_topk_exact_threads)->Apply(sizes_densities_threads)->Unit(benchmark::kMicrosecond)->UseRealTime();
BENCHMARK(BM_topk_approx)->Apply(sizes_and_densities)->Unit(benchmark::kMicrosecond);
BENCHMARK(BM_nth_element)->Apply(sizes_and_densities)->Unit(benchmark::kMicrosecond);

// One case per row of the selector registry (kernels/selectors.h), named select_<selector>: the
// row's CPU function as the compressor calls it (biased form, outputs of n entries, a 2-D shape
// [n / 1024, 1024] for the shaped rows, the stateful rows' state allocated once), so a selector
// added to the registry gets its benchmark row here without an edit.
// Bytes: read 4n, write pairs (8 * selected).
void select_case(benchmark::State& s, const sk::SelectorInfo* row) {
  const auto& x = data(elements(s));
  const size_t n = x.size();
  const std::vector<uint64_t> shape = {n / 1024, 1024};
  sk::SelectorParams params;
  params.density = density(s);
  params.threshold = lambda_for(x, sk::topk_count(n, params.density));
  params.quantile = 1.0 - params.density;
  params.seed = sk::derive_seed(42, 0, 1);
  sparsecar::LargeVector<std::byte> scratch(sk::selector_scratch_bytes(n, shape));
  sparsecar::LargeVector<uint32_t> index(n);
  sparsecar::LargeVector<float> value(n);
  std::vector<float> importance, mask_values;
  std::vector<uint32_t> mask;
  sk::SelectorState state;
  if (row->stateful) {
    importance.assign(n, 0.0f);
    mask.assign(n, 0);
    mask_values.assign(n, 0.0f);
    state.importance = importance;
    state.mask = mask;
    state.mask_values = mask_values;
  }
  sk::SelectInput in;
  in.x = x;
  in.grad = x;
  in.shape = shape;
  in.params = &params;
  in.scratch = scratch;
  in.state = row->stateful ? &state : nullptr;
  size_t selected = 0;
  for (auto _ : s) {
    auto got = row->cpu(in, sk::SelectOutput{index.data(), value.data(), n});
    if (!got.ok()) {
      s.SkipWithError(got.status().to_string().c_str());
      break;
    }
    selected = *got;
    benchmark::DoNotOptimize(selected);
    benchmark::ClobberMemory();
  }
  s.counters["selected"] = static_cast<double>(selected);
  set_bytes(s, 4.0 * static_cast<double>(n) + 8.0 * static_cast<double>(selected));
}

int main(int argc, char** argv) {
  for (const sk::CodecInfo& row : sk::codec_registry()) {
    const std::string name = std::string("BM_") + row.name;
    benchmark::RegisterBenchmark((name + "_encode").c_str(), encode_case, &row)
        ->Apply(sizes_and_densities)
        ->Unit(benchmark::kMicrosecond);
    benchmark::RegisterBenchmark((name + "_decode").c_str(), decode_case, &row, false)
        ->Apply(sizes_and_densities)
        ->Unit(benchmark::kMicrosecond);
    if (row.parallel_decode) {
      benchmark::RegisterBenchmark((name + "_decode_threads").c_str(), decode_case, &row, true)
          ->Apply(sizes_densities_threads)
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime();
    }
  }
  for (const sk::SelectorInfo& row : sk::selector_registry()) {
    if (row.cpu == nullptr) continue;
    benchmark::RegisterBenchmark((std::string("BM_select_") + row.name).c_str(), select_case, &row)
        ->Apply(sizes_and_densities)
        ->Unit(benchmark::kMicrosecond);
  }
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
