// What authenticating daemon-to-daemon messages costs (daemon/transport/WIRE.md, "Transport
// framing"), against baselines measured in the same run:
//   BM_header_mac       the MAC every UCX message carries: BLAKE2b-128 over the 16 prefix bytes,
//                       8 bytes of receiver/AM id and the 80-byte wire header (auth::mac128)
//   BM_header_crc       baseline: the CRC-32C of the same 80-byte header (wire::seal's checksum)
//   BM_payload_blake2b  a MAC over a whole payload (keyed BLAKE2b) — not offered: see the ratio
//   BM_payload_poly1305 the fastest libsodium MAC over a whole payload — not offered either
//   BM_payload_crc      baseline: the CRC-32C the receiver already computes over every payload
//   BM_payload_memcpy   baseline: copying the payload once
// Reproduce: scripts/bench transport (a Release build; medians of 3 repetitions).
#include <benchmark/benchmark.h>
#include <sodium.h>

#include <cstring>
#include <vector>

#include "daemon/transport/auth.h"
#include "sparsecar/kernels/codec.h"

namespace {

using namespace sparsecar;

constexpr size_t kHeader = 80;

void BM_header_mac(benchmark::State& state) {
  const auth::Key key = auth::transport_key(auth::open_job_key(), 7, auth::random_array<auth::kNonceBytes>());
  std::vector<uint8_t> prefix(16, 1), ids(8, 2), header(kHeader, 3);
  for (auto _ : state) {
    auth::Mac128 mac = auth::mac128(key, {prefix, ids, header});
    benchmark::DoNotOptimize(mac);
    header[24] ^= mac[0];  // a new header each time
  }
  state.SetItemsProcessed(state.iterations());
}

void BM_header_crc(benchmark::State& state) {
  std::vector<uint8_t> header(kHeader, 3);
  for (auto _ : state) {
    uint32_t crc = kernels::crc32c(0, header.data(), header.size());
    benchmark::DoNotOptimize(crc);
    header[24] ^= static_cast<uint8_t>(crc);
  }
  state.SetItemsProcessed(state.iterations());
}

std::vector<uint8_t> payload(benchmark::State& state) {
  std::vector<uint8_t> p(static_cast<size_t>(state.range(0)));
  for (size_t i = 0; i < p.size(); ++i) p[i] = static_cast<uint8_t>(i * 131);
  return p;
}

void BM_payload_blake2b(benchmark::State& state) {
  auto p = payload(state);
  uint8_t key[32] = {1};
  uint8_t out[16];
  for (auto _ : state) {
    crypto_generichash(out, sizeof out, p.data(), p.size(), key, sizeof key);
    benchmark::DoNotOptimize(out);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * state.range(0));
}

void BM_payload_poly1305(benchmark::State& state) {
  auto p = payload(state);
  uint8_t key[crypto_onetimeauth_KEYBYTES] = {1};
  uint8_t out[crypto_onetimeauth_BYTES];
  for (auto _ : state) {
    crypto_onetimeauth(out, p.data(), p.size(), key);
    benchmark::DoNotOptimize(out);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * state.range(0));
}

void BM_payload_crc(benchmark::State& state) {
  auto p = payload(state);
  for (auto _ : state) {
    uint32_t crc = kernels::crc32c(0, p.data(), p.size());
    benchmark::DoNotOptimize(crc);
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * state.range(0));
}

void BM_payload_memcpy(benchmark::State& state) {
  auto p = payload(state);
  std::vector<uint8_t> q(p.size());
  for (auto _ : state) {
    std::memcpy(q.data(), p.data(), p.size());
    benchmark::DoNotOptimize(q.data());
  }
  state.SetBytesProcessed(static_cast<int64_t>(state.iterations()) * state.range(0));
}

}  // namespace

BENCHMARK(BM_header_mac);
BENCHMARK(BM_header_crc);
BENCHMARK(BM_payload_blake2b)->Arg(1 << 20)->Arg(64 << 20)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_payload_poly1305)->Arg(1 << 20)->Arg(64 << 20)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_payload_crc)->Arg(1 << 20)->Arg(64 << 20)->Unit(benchmark::kMillisecond);
BENCHMARK(BM_payload_memcpy)->Arg(1 << 20)->Arg(64 << 20)->Unit(benchmark::kMillisecond);
BENCHMARK_MAIN();
