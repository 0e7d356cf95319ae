// The daemon's seam for time: its parts read "now" through a Clock they are given, never through
// std::chrono directly, so tests can drive deadlines, grace periods and rate measurements with a
// fake (tests/unit/common/fake_clock.h) instead of sleeping.
//
// Only the readings go through the Clock. Waits (condition variables, poll timeouts, UCX
// progress) stay on real time and are always bounded; a part that computes a deadline from
// clock.now() and waits for it re-checks against the clock after every bounded wait.
//
// Thread-safety: now() may be called from any thread; the real clock is stateless.
#pragma once

#include <chrono>

namespace sparsecar {

class Clock {
 public:
  using duration = std::chrono::steady_clock::duration;
  using time_point = std::chrono::steady_clock::time_point;

  virtual ~Clock() = default;
  // Monotonic time (the epoch is unspecified; only differences mean something).
  virtual time_point now() const = 0;
};

// The production clock: std::chrono::steady_clock. One shared instance for the process.
const Clock& steady_clock();

}  // namespace sparsecar
