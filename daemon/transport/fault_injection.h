// FaultyTransport: a test-only fault switch in front of any Transport. It drops, duplicates,
// delays, corrupts and reorders the messages this daemon sends, each at its own rate, drawn from
// a seeded generator — so chaos tests can show that nothing corrupt, duplicated or out of order
// is ever summed and that nothing hangs, with the real UCX transport and real daemons (netem is
// not available, and preload shims would test something else).
//
// It is switched on only by the environment variable SPARSECAR_TEST_FAULTS (never by a knob or
// the config file), e.g.
//   SPARSECAR_TEST_FAULTS="drop=0.01,duplicate=0.05,delay=0.05,delay_ms=30,corrupt=0.01,reorder=0.05,seed=7,kinds=1"
// rates are probabilities per message (at most one fault per message, tried in the order drop,
// corrupt, duplicate, delay, reorder); `kinds` limits the faults to those wire kinds (a
// comma-free list joined by '+', e.g. kinds=1+2; default: every kind). The daemon logs a warning
// at start when it is on. A "reordered" message is held until this daemon's next message to the
// same peer has been sent (or delay_ms passed), so that one overtakes it.
//
// Contract kept: the caller's buffers stay untouched and alive until `done` runs, `done` runs
// exactly once (after the last copy of a duplicated message completed; at once — on the fault
// thread — for a dropped one), and stop() fails what is still held.
//
// Time: delays are measured on the Clock it is given (when a message is due); the fault thread
// waits for the next due message in bounded real-time slices and reads the clock after each.
//
// Threads: send() from any thread; delayed and held messages go out from one fault thread.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "daemon/transport/transport.h"
#include "sparsecar/common/clock.h"

namespace sparsecar {

struct FaultOptions {
  double drop = 0, corrupt = 0, duplicate = 0, delay = 0, reorder = 0;
  uint32_t delay_ms = 20;
  uint64_t seed = 1;
  std::set<uint16_t> kinds;  // empty: every kind
};

// Parses the SPARSECAR_TEST_FAULTS syntax above; kInvalidArgument naming the bad item.
Expected<FaultOptions> parse_fault_spec(std::string_view spec);

class FaultyTransport final : public Transport {
 public:
  // `inner` and `clock` must outlive this object.
  FaultyTransport(Transport* inner, const FaultOptions& options, const Clock& clock = steady_clock());
  ~FaultyTransport() override;

  uint32_t rank() const override { return inner_->rank(); }
  uint32_t world_size() const override { return inner_->world_size(); }
  std::string peer_name(uint32_t peer) const override { return inner_->peer_name(peer); }
  Status send(uint32_t peer, std::span<const std::byte> header, std::span<const std::byte> payload,
              SendCallback done) override;
  // Fails every delayed or held message, stops the fault thread, then stops `inner`.
  void stop() override;
  std::vector<ReceiveSample> drain_receive_samples() override { return inner_->drain_receive_samples(); }
  void set_timed_sends(uint32_t every) override { inner_->set_timed_sends(every); }

  struct Counts {
    uint64_t sent = 0, dropped = 0, corrupted = 0, duplicated = 0, delayed = 0, reordered = 0;
  };
  Counts counts() const;

 private:
  using Action = std::function<void(bool cancelled)>;
  void schedule(Clock::time_point due, Action action);  // mu_ held
  void run();

  Transport* const inner_;
  const FaultOptions options_;
  const Clock& clock_;

  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::mt19937_64 rng_;                                                    // guarded by mu_
  std::multimap<Clock::time_point, Action> pending_;  // guarded by mu_: by the time each is due
  std::map<uint32_t, uint64_t> held_;  // guarded by mu_: peer -> token of its held message
  uint64_t next_token_ = 1;            // guarded by mu_
  std::map<uint64_t, Action> held_actions_;  // guarded by mu_: token -> send it
  Counts counts_;                      // guarded by mu_
  bool stopping_ = false;              // guarded by mu_
  std::thread thread_;
};

}  // namespace sparsecar
