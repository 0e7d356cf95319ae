// The CUDA selections' speed on this machine's GPU, against a device-to-device copy of the bytes
// the fused pass must move at least (its memory-speed floor), measured in the same run.
//
//   sparsecar_cuda_bench [--n N] [--density D] [--reps R] [--json FILE]
//
// --json FILE appends one JSON object a line per row (bench/gpu/run merges them into
// bench-gpu-kernels.json): {"kernel", "elements", "density", "ms", "gbps", "ratio_to_copy",
// "card"}, gbps = floor bytes / time, ratio_to_copy = gbps / the copy's GB/s.
//
// Timing: CUDA events around each call, after warm-up, median of R runs; inputs rotate among
// three buffer sets larger than L2 so repeated runs do not measure the cache. Every timed call
// starts from the same data (the residual is restored by a copy outside the timed region).
// "floor" is the minimum traffic of the operation (e.g. EF + threshold: read residual and grad,
// write residual = 12 bytes an element, plus the pairs) at the copy's measured bandwidth;
// "x floor" = time / floor. Prints a table; nothing is asserted.
//
// Codecs (cuda_codecs.h): the randomk selection at `density` encoded in each device format
// (floor: read the pairs, write the payload), and W = 8 peers' COO fp32 payloads (8 seeds)
// decoded and added into n floats (floor, as issue 12 counts it: read the payloads, read and
// write every 64-byte line a peer touches; the 1/W scaling is left out: a plain scale pass).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "sparsecar/kernels/cuda.h"
#include "sparsecar/kernels/cuda_codecs.h"
#include "sparsecar/kernels/select.h"

namespace {

namespace cu = sparsecar::kernels::cuda;

#define CHECK_CUDA(expr)                                                                      \
  do {                                                                                        \
    const cudaError_t e_ = (expr);                                                            \
    if (e_ != cudaSuccess) {                                                                  \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                           \
    }                                                                                         \
  } while (0)
#define CHECK_OK(expr)                                                                          \
  do {                                                                                          \
    const sparsecar::Status s_ = (expr);                                                        \
    if (!s_.ok()) {                                                                             \
      std::fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, s_.to_string().c_str());          \
      std::exit(1);                                                                             \
    }                                                                                           \
  } while (0)

constexpr int kSets = 3;

#define SC_BENCH_CHECK(cond)                                                  \
  do {                                                                        \
    if (!(cond)) {                                                            \
      std::fprintf(stderr, "%s:%d: check failed: %s\n", __FILE__, __LINE__, #cond); \
      std::exit(1);                                                           \
    }                                                                         \
  } while (0)

// The card's description without the characters JSON would need escaped.
std::string json_safe(std::string s) {
  for (char& c : s) {
    if (c == '"' || c == '\\' || static_cast<unsigned char>(c) < 0x20) c = ' ';
  }
  return s;
}

struct Buffers {
  float* pristine[kSets];  // the data each timed call starts from
  float* residual[kSets];
  float* grad[kSets];
  float* velocity;
  uint32_t* index;
  float* value;
  uint64_t* count;
  void* ws;
  size_t ws_bytes;
};

// Median milliseconds of `reps` calls of fn(set) (each preceded by an untimed reset(set)).
double time_ms(int reps, const std::function<void(int)>& reset, const std::function<void(int)>& fn) {
  cudaEvent_t start, stop;
  CHECK_CUDA(cudaEventCreate(&start));
  CHECK_CUDA(cudaEventCreate(&stop));
  for (int w = 0; w < 3; ++w) {  // warm-up
    reset(w % kSets);
    fn(w % kSets);
  }
  std::vector<float> ms;
  for (int r = 0; r < reps; ++r) {
    const int set = r % kSets;
    reset(set);
    CHECK_CUDA(cudaEventRecord(start));
    fn(set);
    CHECK_CUDA(cudaEventRecord(stop));
    CHECK_CUDA(cudaEventSynchronize(stop));
    float t = 0;
    CHECK_CUDA(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  CHECK_CUDA(cudaGetLastError());
  CHECK_CUDA(cudaEventDestroy(start));
  CHECK_CUDA(cudaEventDestroy(stop));
  std::sort(ms.begin(), ms.end());
  return ms[ms.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  size_t n = size_t{1} << 26;  // 64 Mi elements, 256 MiB a buffer
  double density = 0.001;
  int reps = 30;
  std::string json;
  const auto usage = [&] {
    std::fprintf(stderr, "usage: %s [--n N] [--density D] [--reps R] [--json FILE]\n", argv[0]);
    return 2;
  };
  for (int i = 1; i < argc; i += 2) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") return usage() - 2;
    if (i + 1 >= argc) return usage();
    char* end = nullptr;
    const char* v = argv[i + 1];
    if (a == "--n") {
      n = std::strtoull(v, &end, 10);
    } else if (a == "--density") {
      density = std::strtod(v, &end);
    } else if (a == "--reps") {
      reps = static_cast<int>(std::strtol(v, &end, 10));
    } else if (a == "--json") {
      json = v;
      continue;
    } else {
      return usage();
    }
    if (end == v || *end != '\0') {
      std::fprintf(stderr, "%s: %s is not a number: '%s'\n", argv[0], a.c_str(), v);
      return 2;
    }
  }
  if (n == 0 || n > 0xffffffffull || !(density > 0.0 && density <= 1.0) || reps < 1) {
    std::fprintf(stderr, "%s: need 0 < n < 2^32, 0 < density <= 1, reps >= 1\n", argv[0]);
    return 2;
  }
  if (cu::device_count() == 0) {
    std::printf("no CUDA GPU here: nothing to measure\n");
    return 0;
  }
  const std::string card = cu::device_description(0);
  std::printf("GPU: %s\n", card.c_str());
  const size_t k = sparsecar::kernels::topk_count(n, density);
  const size_t bytes = n * sizeof(float);

  Buffers b{};
  for (int s = 0; s < kSets; ++s) {
    CHECK_CUDA(cudaMalloc(&b.pristine[s], bytes));
    CHECK_CUDA(cudaMalloc(&b.residual[s], bytes));
    CHECK_CUDA(cudaMalloc(&b.grad[s], bytes));
  }
  CHECK_CUDA(cudaMalloc(&b.velocity, bytes));
  CHECK_CUDA(cudaMalloc(&b.index, n * sizeof(uint32_t)));
  CHECK_CUDA(cudaMalloc(&b.value, bytes));
  CHECK_CUDA(cudaMalloc(&b.count, sizeof(uint64_t)));
  b.ws_bytes = cu::select_workspace_bytes(n);
  CHECK_CUDA(cudaMalloc(&b.ws, b.ws_bytes));
  {
    // Normal data, generated on every CPU in chunks of 1 Mi elements (each its own seed, so the
    // data does not depend on the thread count): 256 Mi elements x 6 buffers in seconds.
    std::vector<float> host(n);
    const auto fill = [&](uint64_t stream_seed, float sigma) {
      const size_t chunks = (n + (size_t{1} << 20) - 1) >> 20;
      std::atomic<size_t> next{0};
      std::vector<std::thread> workers;
      for (unsigned t = 0; t < std::max(1u, std::thread::hardware_concurrency()); ++t) {
        workers.emplace_back([&] {
          for (size_t c; (c = next++) < chunks;) {
            std::mt19937_64 rng(stream_seed * 1000003 + c);
            std::normal_distribution<float> normal(0.0f, sigma);
            for (size_t i = c << 20; i < std::min(n, (c + 1) << 20); ++i) host[i] = normal(rng);
          }
        });
      }
      for (auto& w : workers) w.join();
    };
    for (int s = 0; s < kSets; ++s) {
      fill(2 * s + 1, 1.0f);
      CHECK_CUDA(cudaMemcpy(b.pristine[s], host.data(), bytes, cudaMemcpyHostToDevice));
      fill(2 * s + 2, 0.1f);
      CHECK_CUDA(cudaMemcpy(b.grad[s], host.data(), bytes, cudaMemcpyHostToDevice));
    }
  }
  // lambda that keeps about `density` of |r + g| (normal with sigma ~ 1.005): the two-sided
  // normal quantile, found by bisection on erfc.
  double lo = 0, hi = 10;
  for (int it = 0; it < 100; ++it) {
    const double mid = (lo + hi) / 2;
    (std::erfc(mid / (1.005 * std::sqrt(2.0))) > density ? lo : hi) = mid;
  }
  const auto lambda = static_cast<float>(lo);
  const cu::DeviceSelection out{b.index, b.value, n, b.count};
  const cu::Workspace ws{b.ws, b.ws_bytes};
  auto reset = [&](int s) { CHECK_CUDA(cudaMemcpyAsync(b.residual[s], b.pristine[s], bytes, cudaMemcpyDeviceToDevice)); };
  auto no_reset = [](int) {};

  // Baseline: a device-to-device copy of one buffer (read n + write n floats).
  const double copy_ms = time_ms(reps, no_reset, [&](int s) {
    CHECK_CUDA(cudaMemcpyAsync(b.residual[s], b.pristine[s], bytes, cudaMemcpyDeviceToDevice));
  });
  const double copy_gbps = 2.0 * static_cast<double>(bytes) / (copy_ms * 1e6);

  struct Row {
    std::string name;
    double ms;
    double floor_bytes;
  };
  std::vector<Row> rows;
  const double pairs = 8.0 * static_cast<double>(k);
  const auto N = static_cast<double>(n);
  rows.push_back({"device copy (baseline)", copy_ms, 8.0 * N});
  rows.push_back({"ef_threshold (fused EF)", time_ms(reps, reset, [&](int s) {
                    CHECK_OK(cu::ef_threshold(b.residual[s], b.grad[s], n, lambda, true, out, ws, nullptr));
                  }),
                  12.0 * N + pairs});
  rows.push_back({"threshold (no EF)", time_ms(reps, reset, [&](int s) {
                    CHECK_OK(cu::ef_threshold(b.residual[s], nullptr, n, lambda, false, out, ws, nullptr));
                  }),
                  4.0 * N + pairs});
  rows.push_back({"ef_momentum_threshold (DGC)", time_ms(reps, reset, [&](int s) {
                    CHECK_OK(cu::ef_momentum_threshold(b.velocity, b.residual[s], b.grad[s], n, 0.9f, 1.0f, lambda,
                                                       out, ws, nullptr));
                  }),
                  20.0 * N + pairs});
  rows.push_back({"ef_topk exact (fused EF)", time_ms(reps, reset, [&](int s) {
                    CHECK_OK(cu::ef_topk(b.residual[s], b.grad[s], n, k, true, out, ws, nullptr));
                  }),
                  12.0 * N + pairs});
  rows.push_back({"topk exact (no EF)", time_ms(reps, reset, [&](int s) {
                    CHECK_OK(cu::ef_topk(b.residual[s], nullptr, n, k, false, out, ws, nullptr));
                  }),
                  4.0 * N + pairs});
  rows.push_back({"ef_topk_approx tol 0.1", time_ms(reps, reset, [&](int s) {
                    CHECK_OK(cu::ef_topk_approx(b.residual[s], b.grad[s], n, k, 0.1, true, out, ws, nullptr));
                  }),
                  12.0 * N + pairs});
  rows.push_back({"ef_percentile", time_ms(reps, reset, [&](int s) {
                    CHECK_OK(cu::ef_percentile(b.residual[s], b.grad[s], n, 1.0 - density, true, out, ws, nullptr));
                  }),
                  12.0 * N + pairs});
  rows.push_back({"ef_importance (fused EF)", time_ms(reps, reset, [&](int s) {
                    CHECK_OK(cu::ef_importance(b.residual[s], b.grad[s], n, k, 7, false, true, out, ws, nullptr));
                  }),
                  12.0 * N + pairs});
  rows.push_back({"randomk", time_ms(reps, no_reset, [&](int s) {
                    CHECK_OK(cu::randomk(b.pristine[s], n, density, 7, false, out, ws, nullptr));
                  }),
                  4.0 * N + pairs});
  rows.push_back({"randblock 64", time_ms(reps, no_reset, [&](int s) {
                    CHECK_OK(cu::randblock(b.pristine[s], n, 64, density, 7, false, out, ws, nullptr));
                  }),
                  4.0 * N + pairs});
  // The same calls captured once into a CUDA graph per buffer set and replayed (what a caller
  // that repeats a tensor's call every step can do): the launches' overhead, not the kernels'.
  {
    cudaStream_t gs;
    CHECK_CUDA(cudaStreamCreate(&gs));
    const auto graphed = [&](const char* name, double floor_bytes, const std::function<void(int, cudaStream_t)>& call) {
      cudaGraphExec_t exec[kSets];
      for (int s = 0; s < kSets; ++s) {
        cudaGraph_t graph;
        CHECK_CUDA(cudaStreamBeginCapture(gs, cudaStreamCaptureModeThreadLocal));
        call(s, gs);
        CHECK_CUDA(cudaStreamEndCapture(gs, &graph));
        CHECK_CUDA(cudaGraphInstantiate(&exec[s], graph, 0));
        CHECK_CUDA(cudaGraphDestroy(graph));
      }
      // gs is a blocking stream: it waits on the legacy default stream's reset and the timing
      // events on the default stream wait on it.
      rows.push_back({name, time_ms(reps, reset, [&](int s) { CHECK_CUDA(cudaGraphLaunch(exec[s], gs)); }),
                      floor_bytes});
      for (auto& e : exec) CHECK_CUDA(cudaGraphExecDestroy(e));
    };
    graphed("ef_threshold, CUDA graph", 12.0 * N + pairs, [&](int s, cudaStream_t st) {
      CHECK_OK(cu::ef_threshold(b.residual[s], b.grad[s], n, lambda, true, out, ws, st));
    });
    graphed("ef_topk exact, CUDA graph", 12.0 * N + pairs, [&](int s, cudaStream_t st) {
      CHECK_OK(cu::ef_topk(b.residual[s], b.grad[s], n, k, true, out, ws, st));
    });
    graphed("topk exact (no EF), CUDA graph", 4.0 * N + pairs, [&](int s, cudaStream_t st) {
      CHECK_OK(cu::ef_topk(b.residual[s], nullptr, n, k, false, out, ws, st));
    });
    graphed("ef_topk_approx tol 0.1, CUDA graph", 12.0 * N + pairs, [&](int s, cudaStream_t st) {
      CHECK_OK(cu::ef_topk_approx(b.residual[s], b.grad[s], n, k, 0.1, true, out, ws, st));
    });
    CHECK_CUDA(cudaStreamDestroy(gs));
  }
  uint64_t count = 0;
  CHECK_CUDA(cudaMemcpy(&count, b.count, sizeof count, cudaMemcpyDeviceToHost));

  // ---- codecs --------------------------------------------------------------------------------
  namespace kn = sparsecar::kernels;
  constexpr int kPeers = 8;
  std::vector<void*> owned;
  auto dmalloc = [&](size_t size) {
    void* p = nullptr;
    CHECK_CUDA(cudaMalloc(&p, std::max<size_t>(size, 1)));
    owned.push_back(p);
    return p;
  };
  // The peers' selections: randomk with 8 seeds, each into its own pairs.
  std::vector<cu::DeviceSelection> peer_sel(kPeers);
  double touched_lines = 0;
  for (int r = 0; r < kPeers; ++r) {
    peer_sel[r] = {static_cast<uint32_t*>(dmalloc(n * 4)), static_cast<float*>(dmalloc(n * 4)), n,
                   static_cast<uint64_t*>(dmalloc(8))};
    CHECK_OK(cu::randomk(b.pristine[r % kSets], n, density, 100 + r, false, peer_sel[r], ws, nullptr));
    uint64_t c = 0;
    CHECK_CUDA(cudaMemcpy(&c, peer_sel[r].count, 8, cudaMemcpyDeviceToHost));
    std::vector<uint32_t> idx(c);
    CHECK_CUDA(cudaMemcpy(idx.data(), peer_sel[r].index, c * 4, cudaMemcpyDeviceToHost));
    uint64_t last = ~uint64_t{0};
    for (uint32_t i : idx) {
      if (i / 16 != last) ++touched_lines;
      last = i / 16;
    }
  }
  const cu::DeviceSelection& sel0 = peer_sel[0];
  uint64_t k0 = 0;
  CHECK_CUDA(cudaMemcpy(&k0, sel0.count, 8, cudaMemcpyDeviceToHost));
  auto* sizes = static_cast<uint64_t*>(dmalloc(2 * sizeof(uint64_t)));
  const struct {
    kn::Format f;
    kn::ValueType vt;
    const char* name;
  } encodes[] = {{kn::Format::kCoo, kn::ValueType::kF32, "encode coo fp32"},
                 {kn::Format::kCoo, kn::ValueType::kI8, "encode coo int8"},
                 {kn::Format::kCooVarint, kn::ValueType::kF32, "encode coo_varint fp32"},
                 {kn::Format::kBitmap, kn::ValueType::kF32, "encode bitmap fp32"}};
  for (const auto& e : encodes) {
    const size_t bound = cu::encode_bound_bytes(e.f, e.vt, n, n);
    const size_t ews = cu::encode_workspace_bytes(e.f, e.vt, n);
    const cu::DevicePayloadOut o{static_cast<std::byte*>(dmalloc(bound)), bound, sizes, sizes + 1};
    const cu::Workspace w{dmalloc(ews), ews};
    kn::EncodeParams params;
    params.format = e.f;
    params.value_type = e.vt;
    const double ms = time_ms(reps, no_reset, [&](int) { CHECK_OK(cu::encode(params, n, sel0, o, w, nullptr)); });
    uint64_t payload = 0;
    CHECK_CUDA(cudaMemcpy(&payload, sizes, 8, cudaMemcpyDeviceToHost));
    rows.push_back({e.name, ms, 8.0 * static_cast<double>(k0) + static_cast<double>(payload)});
  }
  {
    // The 8 peers' COO fp32 payloads, encoded once (untimed).
    std::vector<cu::DevicePayload> payloads(kPeers);
    double payload_bytes = 0;
    size_t max_bytes = 0;
    for (int r = 0; r < kPeers; ++r) {
      const size_t bound = cu::encode_bound_bytes(kn::Format::kCoo, kn::ValueType::kF32, n, n);
      const size_t ews = cu::encode_workspace_bytes(kn::Format::kCoo, kn::ValueType::kF32, n);
      auto* data = static_cast<std::byte*>(dmalloc(bound));
      CHECK_OK(cu::encode(kn::EncodeParams{}, n, peer_sel[r], {data, bound, sizes, sizes + 1}, {dmalloc(ews), ews},
                          nullptr));
      uint64_t meta[2] = {0, 0};
      CHECK_CUDA(cudaMemcpy(meta, sizes, 16, cudaMemcpyDeviceToHost));
      payloads[r] = {kn::Format::kCoo, kn::ValueType::kF32, data, meta[0], meta[1]};
      payload_bytes += static_cast<double>(meta[0]);
      max_bytes = std::max<size_t>(max_bytes, meta[0]);
    }
    auto* status = static_cast<cu::DecodeStatus*>(dmalloc(kPeers * sizeof(cu::DecodeStatus)));
    // Workspace for one payload: peer-by-peer scatters; for all 8: the chunked one-pass add.
    for (const size_t ws_peers : {size_t{1}, size_t{kPeers}}) {
      const size_t dws = cu::decode_workspace_bytes(n, max_bytes, ws_peers);
      const cu::Workspace w{dmalloc(dws), dws};
      const double ms = time_ms(reps, reset, [&](int s) {
        CHECK_OK(cu::decode_accumulate(payloads, b.residual[s], n, 0, status, w, nullptr,
                                       ws_peers == 1 ? cu::DecodePath::kPeerByPeer : cu::DecodePath::kChunked));
      });
      rows.push_back({ws_peers == 1 ? "decode + add 8 peers' coo fp32, peer by peer"
                                    : "decode + add 8 peers' coo fp32, one chunked pass",
                      ms, payload_bytes + 128.0 * touched_lines});
    }
  }
  for (void* p : owned) cudaFree(p);

  std::printf("n = %zu (%.0f MiB a buffer), density %.4g (k = %zu), %d reps, median\n", n,
              static_cast<double>(bytes) / 1048576.0, density, k, reps);
  std::printf("device copy: %.3f ms = %.0f GB/s (read + write)\n\n", copy_ms, copy_gbps);
  std::printf("| kernel | ms | GB/s (floor bytes / time) | x floor (floor = floor bytes at copy GB/s) |\n");
  std::printf("| --- | --- | --- | --- |\n");
  for (const Row& r : rows) {
    const double gbps = r.floor_bytes / (r.ms * 1e6);
    const double floor_ms = r.floor_bytes / (copy_gbps * 1e6);
    std::printf("| %s | %.3f | %.0f | %.2f |\n", r.name.c_str(), r.ms, gbps, r.ms / floor_ms);
  }
  if (!json.empty()) {
    FILE* f = std::fopen(json.c_str(), "a");
    if (f == nullptr) {
      std::fprintf(stderr, "%s: cannot open %s: %s\n", argv[0], json.c_str(), std::strerror(errno));
      return 1;
    }
    for (const Row& r : rows) {
      const double gbps = r.floor_bytes / (r.ms * 1e6);
      // Names and the card carry no quote or backslash (checked here rather than escaped).
      SC_BENCH_CHECK(r.name.find_first_of("\"\\") == std::string::npos);
      std::fprintf(f,
                   "{\"kernel\": \"%s\", \"elements\": %zu, \"density\": %.6g, \"ms\": %.5f, \"gbps\": %.1f, "
                   "\"ratio_to_copy\": %.4f, \"card\": \"%s\", \"source\": \"sparsecar\"}\n",
                   r.name.c_str(), n, density, r.ms, gbps, gbps / copy_gbps, json_safe(card).c_str());
    }
    std::fclose(f);
  }
  for (int s = 0; s < kSets; ++s) {
    cudaFree(b.pristine[s]);
    cudaFree(b.residual[s]);
    cudaFree(b.grad[s]);
  }
  cudaFree(b.velocity);
  cudaFree(b.index);
  cudaFree(b.value);
  cudaFree(b.count);
  cudaFree(b.ws);
  return 0;
}
