#include "daemon/transport/auth.h"

#include <fcntl.h>
#include <sodium.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "sparsecar/common/checked_file.h"
#include "sparsecar/common/log.h"

namespace sparsecar::auth {
namespace {

void ensure_sodium() {
  static const bool ready = [] {
    // sodium_init() is idempotent and thread-safe; < 0 only when no entropy source exists.
    SC_CHECK(sodium_init() >= 0, "libsodium cannot initialise (no entropy source?)");
    return true;
  }();
  (void)ready;
}

template <size_t N>
std::array<uint8_t, N> keyed_hash(const uint8_t* key, size_t key_len, Parts parts) {
  ensure_sodium();
  crypto_generichash_state state;
  crypto_generichash_init(&state, key, key_len, N);
  for (auto part : parts) crypto_generichash_update(&state, part.data(), part.size());
  std::array<uint8_t, N> out{};
  crypto_generichash_final(&state, out.data(), N);
  sodium_memzero(&state, sizeof state);
  return out;
}

void put_le64(uint8_t* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<uint8_t>(v >> (8 * i));
}

}  // namespace

JobKey open_job_key() {
  JobKey k;
  k.root = keyed_hash<kKeyBytes>(nullptr, 0, {bytes_of("sparsecar open job v1")});
  k.open = true;
  return k;
}

JobKey job_key_from_secret(std::string_view secret) {
  static constexpr char kLabel[] = "sparsecar job secret v1";  // + its terminating 0 as separator
  JobKey k;
  k.root = keyed_hash<kKeyBytes>(nullptr, 0, {std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(kLabel), sizeof kLabel),
                                              bytes_of(secret)});
  k.open = false;
  return k;
}

Expected<std::string> read_job_secret_file(const std::string& path) {
  const std::string what = "job_secret_file '" + path + "'";
  // Checked on the opened file (read_checked_file), so the file read is the file checked.
  SC_ASSIGN_OR_RETURN(std::string secret, read_checked_file(path, what, kMaxSecretBytes + 3,
                                                            [&](const struct stat& st) -> Status {
    if (!S_ISREG(st.st_mode)) return invalid_argument(what + " is not a regular file");
    if (st.st_uid != ::geteuid()) {
      return permission_denied(what + " is owned by uid " + std::to_string(st.st_uid) +
                               ", not by the daemon's uid " + std::to_string(::geteuid()));
    }
    if ((st.st_mode & 077) != 0) {
      char mode[8];
      std::snprintf(mode, sizeof mode, "%04o", static_cast<unsigned>(st.st_mode & 07777));
      return permission_denied(what + " has mode " + mode + ": group and others must have no access (chmod 600)");
    }
    if (st.st_size > static_cast<off_t>(kMaxSecretBytes) + 2) {
      return invalid_argument(what + " is larger than " + std::to_string(kMaxSecretBytes) + " bytes");
    }
    return Status::Ok();
  }));
  if (!secret.empty() && secret.back() == '\n') secret.pop_back();
  if (!secret.empty() && secret.back() == '\r') secret.pop_back();
  Status bad;
  if (secret.empty()) {
    bad = invalid_argument(what + " is empty");
  } else if (secret.size() < kMinSecretBytes) {
    bad = invalid_argument(what + " holds " + std::to_string(secret.size()) + " bytes; a job secret needs at least " +
                           std::to_string(kMinSecretBytes) + " (e.g. head -c 32 /dev/urandom | base64)");
  } else if (secret.size() > kMaxSecretBytes) {
    bad = invalid_argument(what + " is larger than " + std::to_string(kMaxSecretBytes) + " bytes");
  }
  if (!bad.ok()) {
    sodium_memzero(secret.data(), secret.size());
    return bad;
  }
  return secret;
}

Expected<JobKey> load_job_key(const std::string& path) {
  if (path.empty()) return open_job_key();
  SC_ASSIGN_OR_RETURN(std::string secret, read_job_secret_file(path));
  JobKey key = job_key_from_secret(secret);
  sodium_memzero(secret.data(), secret.size());
  return key;
}

Key rendezvous_key(const JobKey& job) {
  return keyed_hash<kKeyBytes>(job.root.data(), job.root.size(), {bytes_of("sparsecar/rendezvous/v2")});
}

Key transport_key(const JobKey& job, uint64_t job_id, std::span<const uint8_t, kNonceBytes> formation_id) {
  uint8_t id[8];
  put_le64(id, job_id);
  return keyed_hash<kKeyBytes>(job.root.data(), job.root.size(),
                               {bytes_of("sparsecar/transport/v2"), std::span<const uint8_t>(id, 8), formation_id});
}

Mac256 mac256(const Key& key, Parts parts) { return keyed_hash<kMac256Bytes>(key.data(), key.size(), parts); }
Mac128 mac128(const Key& key, Parts parts) { return keyed_hash<kMac128Bytes>(key.data(), key.size(), parts); }

bool equal(std::span<const uint8_t> a, std::span<const uint8_t> b) {
  return a.size() == b.size() && sodium_memcmp(a.data(), b.data(), a.size()) == 0;
}

void random_bytes(std::span<uint8_t> out) {
  ensure_sodium();
  randombytes_buf(out.data(), out.size());
}

}  // namespace sparsecar::auth
