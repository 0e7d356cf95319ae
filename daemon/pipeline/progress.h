// JobProgress: what a user watching the daemon's log sees while a job runs and when it ends.
//
//   progress: step 1200 (+118 in 10.0 s), density 0.0100, ratio 48.2x, saved 1.1 GiB, step latency 3.2 ms
//   job summary: 5000 steps (0 failed) in 412.3 s, sent 98.4 MiB vs 4.6 GiB dense, ratio 47.9x,
//                saved 4.5 GiB, mean step latency 3.1 ms
//
// Density and step latency are over the tensor steps since the previous line; ratio and bytes saved
// over the whole job. The ratio is dense bytes / bytes sent by this node (the dense exchange is a
// ring all-reduce: pipeline.cc, ring_allreduce_bytes); a single-node job sends nothing and shows
// "n/a". Step latency is the daemon's processing time of one step (the sum over its tensors, which
// the pipeline thread runs one after the other).
//
// The same totals feed `sparsecarctl status` (PipelineSnapshot). Time comes only from the Clock it
// is given, so tests drive the interval with a FakeClock.
//
// Thread-safety: none; owned and called by the pipeline thread (its totals are copied into the
// pipeline's snapshot under the snapshot's lock).
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>

#include "sparsecar/common/clock.h"

namespace sparsecar {

struct ProgressTotals {
  uint64_t steps = 0;         // distinct step numbers seen
  uint64_t tensor_steps = 0;  // completed ok
  uint64_t failed_tensor_steps = 0;
  uint64_t elements = 0;      // dense elements of the ok tensor steps
  uint64_t selected = 0;      // elements this node selected in them
  uint64_t bytes_sent = 0;    // bytes this node sent for them
  uint64_t dense_bytes = 0;   // bytes a dense exchange would have sent
  double busy_seconds = 0;    // pipeline time spent on every tensor step, failed ones included

  // dense_bytes / bytes_sent; 0 when nothing was sent (a single-node job).
  double ratio() const;
  // dense_bytes - bytes_sent (negative if compression cost more than it saved).
  int64_t bytes_saved() const;
  void add(const ProgressTotals& other);
};

class JobProgress {
 public:
  // `interval` zero: no progress lines (the summary still comes).
  JobProgress(const Clock& clock, std::chrono::milliseconds interval);

  // The live knob progress_log_seconds; takes effect from the next line on.
  void set_interval(std::chrono::milliseconds interval) { interval_ = interval; }

  // One tensor step finished (ok or not) after `seconds` of processing.
  void on_tensor_step(uint64_t step, bool ok, uint64_t elements, uint64_t selected, uint64_t bytes_sent,
                      uint64_t dense_bytes, double seconds);
  // The progress line when one is due (the interval has passed since the last line or the job's
  // start, and a step ran since), else nothing.
  std::optional<std::string> due_line();
  // The job's summary line (nothing when no step ran); starts a fresh job.
  std::optional<std::string> end_job();

  const ProgressTotals& job() const { return job_; }

  // "1.5 GiB", "312 B": bytes for a person.
  static std::string human_bytes(double bytes);

 private:
  const Clock& clock_;
  std::chrono::milliseconds interval_;
  ProgressTotals job_;
  ProgressTotals window_;  // since the last line
  bool has_step_ = false;
  uint64_t last_step_ = 0;
  bool started_ = false;
  Clock::time_point job_started_{};
  Clock::time_point window_started_{};
};

}  // namespace sparsecar
