#include "daemon/pipeline/progress.h"

#include <cinttypes>
#include <cstdio>

namespace sparsecar {
namespace {

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

std::string ratio_text(const ProgressTotals& t) {
  if (t.bytes_sent == 0) return "n/a";
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.1fx", t.ratio());
  return buf;
}

std::string saved_text(const ProgressTotals& t) {
  const int64_t saved = t.bytes_saved();
  return (saved < 0 ? "-" : "") + JobProgress::human_bytes(static_cast<double>(saved < 0 ? -saved : saved));
}

std::string latency_text(double busy_seconds, uint64_t steps) {
  char buf[32];
  if (steps == 0) return "n/a";
  std::snprintf(buf, sizeof buf, "%.1f ms", 1e3 * busy_seconds / static_cast<double>(steps));
  return buf;
}

}  // namespace

double ProgressTotals::ratio() const {
  return bytes_sent == 0 ? 0.0 : static_cast<double>(dense_bytes) / static_cast<double>(bytes_sent);
}

int64_t ProgressTotals::bytes_saved() const {
  return static_cast<int64_t>(dense_bytes) - static_cast<int64_t>(bytes_sent);
}

void ProgressTotals::add(const ProgressTotals& o) {
  steps += o.steps;
  tensor_steps += o.tensor_steps;
  failed_tensor_steps += o.failed_tensor_steps;
  elements += o.elements;
  selected += o.selected;
  bytes_sent += o.bytes_sent;
  dense_bytes += o.dense_bytes;
  busy_seconds += o.busy_seconds;
}

std::string JobProgress::human_bytes(double bytes) {
  static const char* const kUnits[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB"};
  size_t unit = 0;
  while (bytes >= 1024.0 && unit + 1 < sizeof kUnits / sizeof kUnits[0]) {
    bytes /= 1024.0;
    ++unit;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, unit == 0 ? "%.0f %s" : "%.1f %s", bytes, kUnits[unit]);
  return buf;
}

JobProgress::JobProgress(const Clock& clock, std::chrono::milliseconds interval) : clock_(clock), interval_(interval) {}

void JobProgress::on_tensor_step(uint64_t step, bool ok, uint64_t elements, uint64_t selected, uint64_t bytes_sent,
                                 uint64_t dense_bytes, double busy) {
  if (!started_) {
    started_ = true;
    job_started_ = window_started_ = clock_.now();
  }
  ProgressTotals one;
  if (!has_step_ || step != last_step_) {
    one.steps = 1;
    has_step_ = true;
    last_step_ = step;
  }
  one.busy_seconds = busy;
  if (ok) {
    one.tensor_steps = 1;
    one.elements = elements;
    one.selected = selected;
    one.bytes_sent = bytes_sent;
    one.dense_bytes = dense_bytes;
  } else {
    one.failed_tensor_steps = 1;
  }
  job_.add(one);
  window_.add(one);
}

std::optional<std::string> JobProgress::due_line() {
  if (interval_.count() <= 0 || !started_ || window_.steps == 0) return std::nullopt;
  const Clock::time_point now = clock_.now();
  if (now - window_started_ < interval_) return std::nullopt;
  char line[256];
  std::snprintf(line, sizeof line,
                "progress: step %" PRIu64 " (+%" PRIu64 " in %.1f s), density %.4g, ratio %s, saved %s, step latency %s",
                last_step_, window_.steps, seconds(now - window_started_),
                window_.elements ? static_cast<double>(window_.selected) / static_cast<double>(window_.elements) : 0.0,
                ratio_text(job_).c_str(), saved_text(job_).c_str(),
                latency_text(window_.busy_seconds, window_.steps).c_str());
  window_ = ProgressTotals{};
  window_started_ = now;
  return std::string(line);
}

std::optional<std::string> JobProgress::end_job() {
  std::optional<std::string> out;
  if (started_ && job_.steps > 0) {
    char line[320];
    std::snprintf(line, sizeof line,
                  "job summary: %" PRIu64 " steps (%" PRIu64 " tensor steps failed) in %.1f s, sent %s vs %s dense, "
                  "ratio %s, saved %s, mean step latency %s",
                  job_.steps, job_.failed_tensor_steps, seconds(clock_.now() - job_started_),
                  human_bytes(static_cast<double>(job_.bytes_sent)).c_str(),
                  human_bytes(static_cast<double>(job_.dense_bytes)).c_str(), ratio_text(job_).c_str(),
                  saved_text(job_).c_str(), latency_text(job_.busy_seconds, job_.steps).c_str());
    out = line;
  }
  job_ = ProgressTotals{};
  window_ = ProgressTotals{};
  has_step_ = false;
  started_ = false;
  return out;
}

}  // namespace sparsecar
