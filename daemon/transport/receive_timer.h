// ReceiveTimer: a receiver's busy periods of the link from each peer (transport.h, ReceiveSample).
//
// A period opens when a rendezvous announcement arrives while none of that peer's timed receives
// is in flight (begin) and closes when the last one in flight ends (end); the bytes of the timed
// receives that completed add up, and so do those of eager messages from that peer that arrive
// while it is open (add): they were sent after the announcement and crossed the link meanwhile.
// The dense ring's timed segment shares the link with the eager segments behind it
// (Transport::send_bulk); without them, 256 KiB timed over ~2 MB read as a tenth of the rate.
//
// Time is passed in. Thread-safety: none (the transport's progress thread owns it).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <vector>

#include "daemon/transport/transport.h"

namespace sparsecar {

class ReceiveTimer {
 public:
  using time_point = std::chrono::steady_clock::time_point;

  explicit ReceiveTimer(uint32_t peers = 0) : busy_(peers) {}
  void reset(uint32_t peers) { busy_.assign(peers, Busy{}); }

  // A timed receive from `peer` began (its announcement arrived at `now`).
  void begin(uint32_t peer, time_point now) {
    if (peer >= busy_.size()) return;
    Busy& b = busy_[peer];
    if (b.in_flight > 0 && now - b.start > kStale) b = Busy{};  // one never ended
    if (b.in_flight++ == 0) {
      b.start = now;
      b.bytes = 0;
    }
  }

  // An eager message of `bytes` from `peer` arrived: counted while a period is open.
  void add(uint32_t peer, uint64_t bytes) {
    if (peer < busy_.size() && busy_[peer].in_flight > 0) busy_[peer].bytes += bytes;
  }

  // A timed receive of `bytes` from `peer` ended at `now` (ok: it completed). Returns the
  // period's sample when it was the last one in flight and the period holds bytes.
  std::optional<ReceiveSample> end(uint32_t peer, uint64_t bytes, bool ok, time_point now) {
    if (peer >= busy_.size() || busy_[peer].in_flight == 0) return std::nullopt;
    Busy& b = busy_[peer];
    if (ok) b.bytes += bytes;
    if (--b.in_flight > 0 || b.bytes == 0) return std::nullopt;
    const double seconds = std::chrono::duration<double>(now - b.start).count();
    if (!(seconds > 0)) return std::nullopt;
    return ReceiveSample{.peer = peer, .bytes = b.bytes, .seconds = seconds};
  }

 private:
  static constexpr std::chrono::seconds kStale{30};
  struct Busy {
    uint32_t in_flight = 0;
    time_point start{};
    uint64_t bytes = 0;
  };
  std::vector<Busy> busy_;  // per peer rank
};

}  // namespace sparsecar
