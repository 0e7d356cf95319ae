// A Clock for tests: time moves only when the test says so (advance / set).
// Thread-safe: the daemon's threads may read it while the test advances it.
#pragma once

#include <atomic>

#include "sparsecar/common/clock.h"

namespace sparsecar::testing {

class FakeClock final : public Clock {
 public:
  // Starts at an arbitrary non-zero point, like a real steady clock.
  FakeClock() : ticks_(duration(std::chrono::hours(1)).count()) {}

  time_point now() const override { return time_point(duration(ticks_.load(std::memory_order_acquire))); }
  void advance(duration d) { ticks_.fetch_add(d.count(), std::memory_order_acq_rel); }
  void set(time_point t) { ticks_.store(t.time_since_epoch().count(), std::memory_order_release); }

 private:
  std::atomic<duration::rep> ticks_;
};

}  // namespace sparsecar::testing
