// Job rendezvous over plain TCP through rank 0, authenticated both ways with the job secret:
// every rank learns every other rank's UCX worker address and the job's random formation id
// before any UCX traffic flows. Used by UcxTransport::start(); separate so it can be tested (and
// reasoned about) without UCX. The byte-level spec is RENDEZVOUS.md beside this file.
//
// Protocol v3 in short (all integers little-endian, K = auth::rendezvous_key(job key)):
//   1. rank 0 accepts a connection and speaks first: challenge {magic "SCRZ", u16 3, u16 0,
//      c0[32]} with c0 fresh random bytes per connection.
//   2. the joiner answers with hello {magic, u16 3, u16 0, u32 body_len, nonce[32], mac[32], body}
//      where body = {u64 job_id, u32 world_size, u32 rank, u32 label_len, u32 address_len, label,
//      address} and mac = BLAKE2b-256_K("sparsecar rendezvous hello v3" || c0 || the 44 bytes
//      before mac || body).
//   3. rank 0 checks magic/version/body_len (framing only), then the MAC, before it interprets
//      anything else. A bad MAC is refused with the generic "authentication failed" (counted,
//      logged with the remote IP); a valid hello with another job id / world size / a rank out of
//      range or taken is refused with a reason that never states rank 0's values.
//   4. when every rank has joined, rank 0 draws a random formation id F[32] and sends each rank
//      welcome {magic, u16 3, u16 0 (accepted), u32 body_len, body, mac[32]}, body = {F,
//      u32 world_size, per rank: u32 label_len, u32 address_len, label, address}, mac =
//      BLAKE2b-256_K("sparsecar rendezvous welcome v3" || c0 || nonce || the 12 header bytes ||
//      body). The joiner verifies it before reading the body: rank 0 proves the secret too.
//      A refusal is {magic, u16 3, u16 1 (refused), u32 reason_len, reason, mac[32]} with the
//      MAC over ("sparsecar rendezvous refusal v3" || c0 || nonce || header || reason); a
//      refusal whose MAC does not verify is reported to the caller as unauthenticated.
// A job without a secret runs the same protocol with the public open-job key: nothing but the
// authentication is lost. A replayed hello fails (the challenge differs); a replayed welcome
// fails (the joiner's nonce differs).
//
// Rank 0 is robust against outsiders: at most `max_pending` connections may wait for their
// hello (the oldest is closed first), each for at most `hello_timeout`; accept() running out of
// file descriptors frees a reserve descriptor to accept-and-close instead of spinning; malformed,
// oversized and unauthenticated hellos are refused without touching the job. A joiner whose
// connection is closed before its verdict (rank 0 shedding load) reconnects until its deadline.
//
// A replacement for a lost rank joins a running formation through the same protocol (Coordinator
// below): the hello is the same; rank 0 answers it with verdict 2, whose body is the welcome body
// followed by the u64 generation of the replacement.
//
// Time: deadlines (the job's timeout, hello_timeout, a paused listener) are read only through
// Options::clock; sockets are polled in bounded real-time slices and the clock read after each.
//
// Threads: run() is a blocking call on the caller's thread; no shared state. Coordinator: see there.
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "daemon/transport/auth.h"
#include "sparsecar/common/clock.h"
#include "sparsecar/common/status.h"

namespace sparsecar::rendezvous {

// What rank 0 refused or shed, for counters (filled while run() is in progress).
struct Stats {
  std::atomic<uint64_t> auth_failures{0};   // hellos whose MAC did not verify
  std::atomic<uint64_t> refused{0};         // authenticated hellos refused (job id, world size, rank)
  std::atomic<uint64_t> malformed{0};       // bad magic/version/length or a body that does not parse
  std::atomic<uint64_t> shed{0};            // connections closed: over the cap, hello deadline, no fds
};

struct Options {
  uint32_t rank = 0;
  uint32_t world_size = 1;
  uint64_t job_id = 0;
  std::string coordinator;  // "HOST:PORT" ("[v6addr]:PORT" for IPv6); rank 0 may use port 0
  std::chrono::milliseconds timeout{60000};
  // The job key (auth::load_job_key); default: the open-job key.
  auth::JobKey key = auth::open_job_key();
  // Human label of this rank for error messages (e.g. "host:pid").
  std::string label;
  // Rank 0 only: called with the bound port once listening (useful with port 0 in tests).
  std::function<void(uint16_t port)> on_listening;
  // Rank 0 only: connections that may wait for their hello at once, and how long each may take.
  size_t max_pending = 64;
  std::chrono::milliseconds hello_timeout{5000};
  // Rank 0 only: optional counters (owned by the caller, outlives run()).
  Stats* stats = nullptr;
  // What the deadlines are read on; must outlive run() and the Coordinator.
  const Clock* clock = &steady_clock();
};

struct Peer {
  std::string label;    // as the peer described itself, plus its address seen by rank 0
  std::string address;  // opaque (the UCX worker address)
};

// The outcome of a rendezvous: the table indexed by rank (including this rank's own entry) and
// the formation id rank 0 drew for this formation of the job.
struct Formation {
  std::vector<Peer> peers;
  auth::Nonce formation_id{};
  // This rank's generation: 0 in the formation itself; n > 0 when rank 0 admitted this rank as
  // the n-th replacement of a lost rank into the running formation (Coordinator).
  uint64_t generation = 0;
};

// A replacement asking to take a lost rank's place, authenticated and checked like a join.
struct Replacement {
  uint32_t rank = 0;
  std::string label;    // as the replacement described itself, plus its address seen by rank 0
  std::string address;  // opaque (the UCX worker address)
};

// Rank 0 of a job that admits replacements. form() runs the formation exactly as run() does on
// rank 0 but keeps the rendezvous socket open; serve() then admits, on a thread of its own, a
// replacement for a rank that `is_down` reports lost: its hello passes every check a join does
// (MAC first, job id, world size, rank in range), then `admit` makes rank 0 ready for it (its
// endpoint, the other ranks told) and returns the replacement's generation; rank 0 answers with a
// welcome of verdict 2 (RENDEZVOUS.md, "Replacements"): the current table, the same formation id
// and the generation. A hello for a rank that is alive is refused ("rank R is alive in the running
// job"), as is one `admit` refuses (its error message is the reason). The destructor stops the
// thread and closes the socket.
class Coordinator {
 public:
  using IsDown = std::function<bool(uint32_t rank)>;
  using Admit = std::function<Expected<uint64_t>(const Replacement&)>;

  static Expected<std::unique_ptr<Coordinator>> form(const Options& options, const std::string& my_address,
                                                     Formation* formation);
  // Starts admitting replacements; `is_down` and `admit` run on the coordinator's thread.
  void serve(IsDown is_down, Admit admit);
  // Stops admitting (joins the thread); idempotent.
  void stop();
  ~Coordinator();

 private:
  struct State;
  explicit Coordinator(std::unique_ptr<State> state);
  std::unique_ptr<State> state_;
};

// Errors: INVALID_ARGUMENT (options), DEADLINE_EXCEEDED (the job did not gather in time),
// FAILED_PRECONDITION (rank 0 refused this rank with an authenticated reason), PERMISSION_DENIED
// (authentication failed in either direction), UNAVAILABLE (sockets).
Expected<Formation> run(const Options& options, const std::string& my_address);

// Rank 0's checks of one complete hello received on a connection whose challenge was `challenge`
// (framing, then the MAC, then the body), exactly as run() makes them; for fuzz targets and tests.
// OK, PERMISSION_DENIED ("authentication failed") or INVALID_ARGUMENT (malformed / incomplete).
Status check_hello(std::span<const uint8_t> bytes, const auth::JobKey& key, const auth::Nonce& challenge);

// The hello a joiner sends on a connection whose challenge was `challenge`, exactly as run()
// builds it (label cut to its 256-byte limit); pure, for fuzz seeds and tests.
struct HelloFields {
  uint64_t job_id = 0;
  uint32_t world_size = 0;
  uint32_t rank = 0;
  std::string label;
  std::string address;
  auth::Nonce nonce{};  // the joiner's fresh random nonce
};
std::string encode_hello(const HelloFields& hello, const auth::JobKey& key, const auth::Nonce& challenge);

// The welcome body (formation id, world size, the table) rank 0 sends, and the joiner's parser of
// it (after the welcome's MAC has verified). parse_welcome_body checks the table has exactly
// `world_size` entries within the size limits, nothing trailing, and that entry `rank` holds
// `my_address`; errors are DATA_LOSS "rendezvous: <who> sent a malformed table".
std::string encode_welcome_body(const Formation& formation);
Expected<Formation> parse_welcome_body(std::string_view body, uint32_t world_size, uint32_t rank,
                                       std::string_view my_address, const std::string& who);

// Splits "HOST:PORT" / "[HOST]:PORT"; false on malformed input.
bool split_host_port(const std::string& text, std::string* host, std::string* port);

}  // namespace sparsecar::rendezvous
