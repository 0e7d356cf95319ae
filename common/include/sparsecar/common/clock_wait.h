// Waiting for a deadline read from a Clock (clock.h). A deadline is a Clock::time_point; with a
// fake clock its value has nothing to do with real time, so a part never hands it to
// condition_variable::wait_until or poll() as it is. It waits in real time for at most
// kClockWaitSlice at once instead, and reads its Clock again after each slice: a test that
// advances a fake clock past the deadline sees the wait end within one slice, and with the real
// clock the slices only add a wake-up every kClockWaitSlice to a long wait.
//
// Thread-safety: stateless; the Clock is read from the calling thread.
#pragma once

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <mutex>

#include "sparsecar/common/clock.h"

namespace sparsecar {

// The longest a part waits in real time before it looks at its Clock again.
inline constexpr std::chrono::milliseconds kClockWaitSlice{50};

// The real time to wait next for `deadline` on `clock`: what is left of it, at most
// kClockWaitSlice; zero once the deadline has passed.
inline Clock::duration wait_slice(const Clock& clock, Clock::time_point deadline) {
  const Clock::duration left = deadline - clock.now();
  if (left <= Clock::duration::zero()) return Clock::duration::zero();
  return std::min<Clock::duration>(left, kClockWaitSlice);
}

// Waits on `cv` (its mutex held through `lock`) until `done()` is true or `deadline` on `clock`
// has passed, in slices of at most kClockWaitSlice; returns done(). Like
// condition_variable::wait_until with a predicate, but the deadline is the Clock's.
template <typename Predicate>
bool wait_until(std::condition_variable& cv, std::unique_lock<std::mutex>& lock, const Clock& clock,
                Clock::time_point deadline, Predicate done) {
  while (!done()) {
    const Clock::duration slice = wait_slice(clock, deadline);
    if (slice == Clock::duration::zero()) return false;
    cv.wait_for(lock, slice);
  }
  return true;
}

}  // namespace sparsecar
