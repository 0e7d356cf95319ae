// libFuzzer target: rank 0's checks of a rendezvous hello (rendezvous::check_hello) and the
// joiner's parser of rank 0's welcome table (rendezvous::parse_welcome_body), on what anyone who
// can reach the rendezvous port (or sit between a joiner and rank 0) sends. Spec: RENDEZVOUS.md.
//
// Input: byte 0 = mode, the rest as the mode says.
//   mode & 3 == 0: the rest is a hello, checked as is;
//   mode & 3 == 1: the rest is a hello whose MAC (bytes 44..75) is recomputed first, so mutations
//                  of the body get past the MAC to the body parser;
//   mode & 3 == 2: the rest is a welcome body: byte 1 picks rank (and world size when the body's
//                  own is out of range), the table parsed with parse_welcome_body;
//   mode & 3 == 3: the rest are hello fields (job id, world size, rank, nonce, label length,
//                  label, address), encoded with encode_hello as a joiner does, then checked.
//   mode & 4: the job key is the open-job key instead of a secret's.
// Properties checked beyond "no crash, no sanitizer report":
//   - check_hello answers OK, PERMISSION_DENIED or INVALID_ARGUMENT, never naming the job id the
//     hello carries;
//   - a hello accepted under key K and challenge C carries a MAC that libsodium, called here
//     directly with keys derived here from the secret, verifies for K and C, and a well-formed
//     body (lengths add up, address non-empty, label ≤ 256 bytes); the same hello is refused
//     (PERMISSION_DENIED) under another key and under another challenge;
//   - an encoded hello is accepted iff its address is non-empty (and then refused under another
//     key or challenge);
//   - a welcome body parses into exactly world_size entries with our address at our rank and
//     re-encodes (encode_welcome_body) to the same bytes; otherwise DATA_LOSS naming rank 0.
// Built by the clang fuzz project (tests/fuzz/CMakeLists.txt: fuzz_rendezvous_hello); seeds in
// corpus/rendezvous_hello/ (written by fuzz_make_parser_seeds with encode_hello and
// encode_welcome_body).
#include <sodium.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <span>
#include <string>
#include <string_view>

#include "daemon/transport/auth.h"
#include "daemon/transport/rendezvous.h"

namespace {

namespace auth = sparsecar::auth;
namespace rdv = sparsecar::rendezvous;
using sparsecar::Code;

#define CHECK(cond)                \
  do {                             \
    if (!(cond)) __builtin_trap(); \
  } while (0)

// Shared with make_parser_seeds.cc (the seeds are MACed with these).
constexpr char kSecret[] = "fuzz-job-secret-0123456789";
constexpr char kOtherSecret[] = "fuzz-job-secret-9876543210";
constexpr size_t kHeadBytes = 76;  // magic, version, flags, body length, nonce, mac
constexpr size_t kMacOffset = 44;
constexpr char kHelloDomain[] = "sparsecar rendezvous hello v3";
constexpr char kWho[] = "rank 0 at fuzz:1";

uint64_t le(const uint8_t* p, int n) {
  uint64_t v = 0;
  for (int i = n - 1; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

auth::Nonce challenge_of(uint8_t fill) {
  auth::Nonce c{};
  for (size_t i = 0; i < c.size(); ++i) c[i] = static_cast<uint8_t>(fill + i);
  return c;
}

// The keys, derived here with libsodium from the spec (auth.h), not with auth.cc.
struct Keys {
  auth::JobKey job;        // as the daemon derives it (auth.cc)
  auth::Key rendezvous{};  // derived here
};

auth::Key blake(const uint8_t* key, size_t key_len, std::initializer_list<std::string_view> parts) {
  auth::Key out{};
  crypto_generichash_state st;
  CHECK(crypto_generichash_init(&st, key, key_len, out.size()) == 0);
  for (std::string_view p : parts) crypto_generichash_update(&st, reinterpret_cast<const uint8_t*>(p.data()), p.size());
  crypto_generichash_final(&st, out.data(), out.size());
  return out;
}

Keys make_keys(bool open, const char* secret) {
  Keys k;
  auth::Key root;
  if (open) {
    k.job = auth::open_job_key();
    root = blake(nullptr, 0, {"sparsecar open job v1"});
  } else {
    k.job = auth::job_key_from_secret(secret);
    root = blake(nullptr, 0, {std::string_view("sparsecar job secret v1", sizeof "sparsecar job secret v1"), secret});
  }
  CHECK(root == k.job.root);
  k.rendezvous = blake(root.data(), root.size(), {"sparsecar/rendezvous/v2"});
  CHECK(k.rendezvous == auth::rendezvous_key(k.job));
  return k;
}

Keys g_secret, g_other, g_open;

std::array<uint8_t, 32> hello_mac(const auth::Key& rendezvous, const auth::Nonce& challenge, std::string_view hello) {
  std::string_view c(reinterpret_cast<const char*>(challenge.data()), challenge.size());
  return blake(rendezvous.data(), rendezvous.size(),
               {kHelloDomain, c, hello.substr(0, kMacOffset), hello.substr(kHeadBytes)});
}

sparsecar::Status check(std::string_view hello, const Keys& k, const auth::Nonce& c) {
  return rdv::check_hello({reinterpret_cast<const uint8_t*>(hello.data()), hello.size()}, k.job, c);
}

// Every verdict on `hello` under (k, c), and what an acceptance promises.
bool check_verdict(std::string_view hello, const Keys& k, const Keys& other, const auth::Nonce& c) {
  const sparsecar::Status s = check(hello, k, c);
  CHECK(s.ok() || s.code() == Code::kPermissionDenied || s.code() == Code::kInvalidArgument);
  const auto* p = reinterpret_cast<const uint8_t*>(hello.data());
  if (!s.ok()) {
    CHECK(!s.message().empty());
    if (hello.size() >= kHeadBytes + 8) {
      const uint64_t job_id = le(p + kHeadBytes, 8);
      char text[32];
      std::snprintf(text, sizeof text, "%llu", static_cast<unsigned long long>(job_id));
      if (job_id >= 100) CHECK(s.message().find(text) == std::string::npos);
      std::snprintf(text, sizeof text, "%llx", static_cast<unsigned long long>(job_id));
      if (job_id >= 0x100) CHECK(s.message().find(text) == std::string::npos);
    }
    return false;
  }
  // Accepted: the framing and body are what the spec says, and the MAC is K's over C.
  CHECK(hello.size() >= kHeadBytes + 24);
  CHECK(le(p, 4) == 0x5A524353 && le(p + 4, 2) == 3);
  const uint64_t body_len = le(p + 8, 4);
  CHECK(body_len == hello.size() - kHeadBytes);
  const uint64_t label_len = le(p + kHeadBytes + 16, 4);
  const uint64_t address_len = le(p + kHeadBytes + 20, 4);
  CHECK(label_len <= 256 && address_len > 0 && 24 + label_len + address_len == body_len);
  const auto mac = hello_mac(k.rendezvous, c, hello);
  CHECK(std::memcmp(mac.data(), p + kMacOffset, mac.size()) == 0);
  // Bound to the key and to the challenge.
  CHECK(check(hello, other, c).code() == Code::kPermissionDenied);
  auth::Nonce c2 = c;
  c2[hello.size() % c2.size()] ^= 0x01;
  CHECK(check(hello, k, c2).code() == Code::kPermissionDenied);
  return true;
}

void fuzz_welcome(const uint8_t* data, size_t size) {
  if (size < 1) return;
  const uint8_t pick = data[0];
  const std::string_view body(reinterpret_cast<const char*>(data + 1), size - 1);
  uint32_t world = 1 + pick % 8;
  if (body.size() >= 36) {
    const uint64_t declared = le(reinterpret_cast<const uint8_t*>(body.data()) + 32, 4);
    if (declared >= 1 && declared <= 64) world = static_cast<uint32_t>(declared);
  }
  const uint32_t rank = (pick >> 3) % world;
  // Our address: the one the table holds for our rank when the table is walkable, so that the
  // success path is reachable; else what the seeds use.
  std::string my_address = "ucx-worker-address-" + std::to_string(rank);
  {
    size_t pos = 36;
    for (uint32_t r = 0; r <= rank && body.size() >= pos + 8; ++r) {
      const uint64_t l = le(reinterpret_cast<const uint8_t*>(body.data()) + pos, 4);
      const uint64_t a = le(reinterpret_cast<const uint8_t*>(body.data()) + pos + 4, 4);
      pos += 8;
      if (body.size() - pos < l || body.size() - pos - l < a) break;
      if (r == rank) my_address = std::string(body.substr(pos + l, a));
      pos += l + a;
    }
  }
  auto f = rdv::parse_welcome_body(body, world, rank, my_address, kWho);
  if (!f.ok()) {
    CHECK(f.status().code() == Code::kDataLoss);
    CHECK(f.status().message().find(kWho) != std::string::npos);
    return;
  }
  CHECK(f->peers.size() == world);
  CHECK(f->peers[rank].address == my_address);
  CHECK(std::memcmp(f->formation_id.data(), body.data(), f->formation_id.size()) == 0);
  CHECK(rdv::encode_welcome_body(*f) == body);
}

void fuzz_encoded(const uint8_t* data, size_t size, const Keys& k, const Keys& other, const auth::Nonce& c) {
  constexpr size_t kFixed = 8 + 4 + 4 + 32 + 2;
  if (size < kFixed) return;
  rdv::HelloFields h;
  h.job_id = le(data, 8);
  h.world_size = static_cast<uint32_t>(le(data + 8, 4));
  h.rank = static_cast<uint32_t>(le(data + 12, 4));
  std::memcpy(h.nonce.data(), data + 16, h.nonce.size());
  const size_t label_len = static_cast<size_t>(le(data + 48, 2));
  const std::string_view rest(reinterpret_cast<const char*>(data + kFixed), size - kFixed);
  h.label = std::string(rest.substr(0, label_len));
  h.address = std::string(rest.substr(std::min(label_len, rest.size())));
  const std::string hello = rdv::encode_hello(h, k.job, c);
  const bool accepted = check_verdict(hello, k, other, c);
  CHECK(accepted == !h.address.empty());
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  CHECK(sodium_init() >= 0);
  g_secret = make_keys(false, kSecret);
  g_other = make_keys(false, kOtherSecret);
  g_open = make_keys(true, nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const uint8_t mode = data[0];
  const Keys& k = (mode & 4) ? g_open : g_secret;
  const Keys& other = (mode & 4) ? g_secret : g_other;
  const auth::Nonce c = challenge_of(0xC0);  // make_parser_seeds.cc uses the same challenge
  ++data;
  --size;
  switch (mode & 3) {
    case 0:
      check_verdict({reinterpret_cast<const char*>(data), size}, k, other, c);
      break;
    case 1: {
      std::string hello(reinterpret_cast<const char*>(data), size);
      if (hello.size() >= kHeadBytes) {
        const auto mac = hello_mac(k.rendezvous, c, hello);
        std::memcpy(hello.data() + kMacOffset, mac.data(), mac.size());
      }
      const bool accepted = check_verdict(hello, k, other, c);
      // A correctly MACed hello is refused only as malformed (the framing or the body).
      if (!accepted && hello.size() >= kHeadBytes) {
        CHECK(check(hello, k, c).code() == Code::kInvalidArgument);
      }
      break;
    }
    case 2:
      fuzz_welcome(data, size);
      break;
    case 3:
      fuzz_encoded(data, size, k, other, c);
      break;
  }
  return 0;
}
