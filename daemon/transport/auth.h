// Peer authentication primitives: the job key, the keys derived from it and keyed MACs.
//
// Every daemon of a job holds the same job secret (the knob `job_secret_file`). Nothing here
// ever logs or returns the secret's bytes. From the secret one 32-byte root key is derived; the
// rendezvous and the transport use keys derived from the root (RENDEZVOUS.md, WIRE.md "Transport
// framing"), each with its own domain-separation label, so a MAC made for one purpose is never
// valid for another:
//
//   root            = BLAKE2b-256( "sparsecar job secret v1" || 0x00 || secret )
//                     (an open job, without a secret, uses the public constant
//                      BLAKE2b-256( "sparsecar open job v1" ): integrity only, no authentication)
//   rendezvous key  = BLAKE2b-256_{key=root}( "sparsecar/rendezvous/v2" )
//   transport key   = BLAKE2b-256_{key=root}( "sparsecar/transport/v2" || u64le job_id || formation_id[32] )
//
// MACs are keyed BLAKE2b (libsodium crypto_generichash) over the concatenation of the parts
// given; comparisons are constant-time (sodium_memcmp).
//
// Thread-safety: plain values and pure functions; safe from any thread.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <span>
#include <string>
#include <string_view>

#include "sparsecar/common/status.h"

namespace sparsecar::auth {

inline constexpr size_t kKeyBytes = 32;
inline constexpr size_t kNonceBytes = 32;
inline constexpr size_t kMac256Bytes = 32;
inline constexpr size_t kMac128Bytes = 16;
// Limits of a job secret file's contents (after trimming one trailing newline).
inline constexpr size_t kMinSecretBytes = 16;
inline constexpr size_t kMaxSecretBytes = 4096;

using Key = std::array<uint8_t, kKeyBytes>;
using Nonce = std::array<uint8_t, kNonceBytes>;
using Mac256 = std::array<uint8_t, kMac256Bytes>;
using Mac128 = std::array<uint8_t, kMac128Bytes>;

// The job's root key and whether it is the public "open job" key.
struct JobKey {
  Key root{};
  bool open = true;
};

// The public key of a job without a secret.
JobKey open_job_key();
// The root key of `secret` (any bytes; callers enforce the length limits).
JobKey job_key_from_secret(std::string_view secret);

// Reads and checks a job secret file: a regular file (symlinks are followed) owned by this
// process's effective uid, without group/other permission bits, at most 4 KiB, holding at least
// 16 bytes after one trailing "\n" or "\r\n" is trimmed. Errors name the path and the rule broken,
// never the contents (PERMISSION_DENIED for ownership/mode, INVALID_ARGUMENT otherwise).
Expected<std::string> read_job_secret_file(const std::string& path);
// open_job_key() for an empty path, else the key of read_job_secret_file(path).
Expected<JobKey> load_job_key(const std::string& path);

Key rendezvous_key(const JobKey& job);
Key transport_key(const JobKey& job, uint64_t job_id, std::span<const uint8_t, kNonceBytes> formation_id);

using Parts = std::initializer_list<std::span<const uint8_t>>;
Mac256 mac256(const Key& key, Parts parts);
Mac128 mac128(const Key& key, Parts parts);
// Constant-time equality of two equally long byte strings.
bool equal(std::span<const uint8_t> a, std::span<const uint8_t> b);
// Cryptographically random bytes (libsodium's randombytes).
void random_bytes(std::span<uint8_t> out);
template <size_t N>
std::array<uint8_t, N> random_array() {
  std::array<uint8_t, N> a{};
  random_bytes(a);
  return a;
}

// Byte views of text / std::byte buffers, for Parts.
inline std::span<const uint8_t> bytes_of(std::string_view s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}
inline std::span<const uint8_t> bytes_of(std::span<const std::byte> s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

}  // namespace sparsecar::auth
