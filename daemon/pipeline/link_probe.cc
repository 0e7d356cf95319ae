#include "daemon/pipeline/link_probe.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>
#include <utility>

#include "daemon/metrics/metrics.h"
#include "sparsecar/common/log.h"
#include "sparsecar/policies/link_model.h"

namespace sparsecar {

static_assert(policies::kMaxProbePayloadBytes == wire::kMaxProbePayloadBytes,
              "the probe's size (policies) must pass the receiver's validation (wire)");

LinkProbe::LinkProbe(uint32_t rank, uint64_t job_id, Transport* transport, Metrics* metrics, const Clock& clock)
    : rank_(rank), job_id_(job_id), transport_(transport), metrics_(metrics), clock_(clock) {}

void LinkProbe::reset() {
  posted_any_ = false;
  took_ = received_ = 0;
  pace_count_ = pace_at_ = 0;
  posted_step_ = 0;
  stall_ = 0;
  ring_count_ = ring_step_count_ = 0;
  dense_worth_ = 1.0;
  retry_at_ = {};
  next_step_ = 0;
  from_step_ = fire_step_ = grid_ = 0;
  plan_probes_ = 0;
  was_wanted_ = false;
  ring_ran_ = early_plan_ = fire_early_ = false;
  job_sent_ = 0;
  job_steps_.clear();
}

std::string LinkProbe::job_summary() const {
  if (job_sent_ == 0) return {};
  std::string steps;
  for (uint64_t s : job_steps_) steps += (steps.empty() ? "" : ",") + std::to_string(s);
  // A probe was sent: there is a transport of at least 2 nodes.
  return fmt::format("link probes this job: {} sent to rank {}, at steps {}{}", job_sent_,
                     (rank_ + 1) % transport_->world_size(), steps, job_sent_ > job_steps_.size() ? ",..." : "");
}

uint64_t LinkProbe::backoff() const {
  return std::min<uint64_t>(kMaxBackoff, uint64_t{1} << std::min<uint64_t>(plan_probes_, 62));
}

uint64_t LinkProbe::grid_for(uint64_t waited, uint64_t grid) {
  if (grid > 0 && waited <= grid && waited >= grid / 4) return grid;
  uint64_t g = 1;
  while (g < waited && g < kMaxGrid) g *= 2;  // the least power of two >= waited
  return g;
}

uint64_t LinkProbe::next_on_grid(uint64_t due, uint64_t grid) {
  if (grid == 0 || due % grid == 0 || due > std::numeric_limits<uint64_t>::max() - grid) return due;
  return due + (grid - due % grid);
}

namespace {

// Of the last three values (oldest first; `n` of them known): the median; of two, the shorter.
double recent_median(const std::array<double, 3>& v, size_t n) {
  switch (n) {
    case 0: return 0;
    case 1: return v[0];
    case 2: return std::min(v[0], v[1]);
    default: return std::max(std::min(v[0], v[1]), std::min(std::max(v[0], v[1]), v[2]));
  }
}

// Keeps x as the latest of the last three values.
void push_recent(std::array<double, 3>& v, size_t& n, double x) {
  if (n == v.size()) {
    std::rotate(v.begin(), v.begin() + 1, v.end());
    --n;
  }
  v[n++] = x;
}

}  // namespace

double LinkProbe::expected_probe_s() const { return recent_median(ring_recent_, ring_count_); }

double LinkProbe::distance() const {
  const double ring = recent_median(ring_step_recent_, ring_step_count_), sparse = pace() * dense_worth_;
  if (!(ring > 0) || !(sparse > 0)) return 1;
  return std::clamp(ring / sparse, 1.0, kMaxDistance);
}

bool LinkProbe::early(uint64_t step) const {
  return early_plan_ && !ring_ran_ && job_sent_ < kEarlyProbes && ring_step_count_ > 0 && pace() > 0 &&
         distance() <= kEarlyDistance && step >= from_step_ + kEarlySteps;
}

double LinkProbe::pace() const {
  if (pace_count_ < 3) return 0;  // too few to tell a stall from the pace
  std::array<double, kPaceSteps> v = pace_;
  const auto mid = v.begin() + static_cast<std::ptrdiff_t>(pace_count_ / 2);
  std::nth_element(v.begin(), mid, v.begin() + static_cast<std::ptrdiff_t>(pace_count_));
  return *mid;
}

void LinkProbe::observe_step_time(const StepFacts& f) {
  // The sparse plan's steps only: a ring step after a probe is no stall of it.
  if (!f.wanted || !(f.step_s > 0) || !std::isfinite(f.step_s)) return;
  if (posted_any_ && f.step > posted_step_ && f.step <= posted_step_ + kStallSteps) {
    if (const double p = pace(); p > 0) stall_ += std::max(0.0, f.step_s - p);
    return;
  }
  pace_[pace_at_] = f.step_s;
  pace_at_ = (pace_at_ + 1) % kPaceSteps;
  pace_count_ = std::min(pace_count_ + 1, kPaceSteps);
}

bool LinkProbe::after_step(const StepFacts& f) {
  observe_step_time(f);
  if (f.received_s > 0 && std::isfinite(f.received_s)) {
    // The back-off: the link got faster for a probe (half the time: the controller's rise needs a second
    // such probe): the next one waits the share's time again.
    if (received_ > 0 && f.received_s <= 0.5 * received_) plan_probes_ = 0;
    received_ = f.received_s;
  }
  if (f.ring_probe_s > 0 && std::isfinite(f.ring_probe_s)) push_recent(ring_recent_, ring_count_, f.ring_probe_s);
  if (f.ring_step_s > 0 && std::isfinite(f.ring_step_s)) push_recent(ring_step_recent_, ring_step_count_, f.ring_step_s);
  if (f.dense_worth >= 1 && std::isfinite(f.dense_worth)) dense_worth_ = f.dense_worth;
  ring_ran_ = ring_ran_ || f.ring_ran;
  const bool wanted = f.wanted && f.share > 0 && f.share <= 1 && f.payload_bytes > 0 &&
                      f.payload_bytes <= wire::kMaxProbePayloadBytes && transport_ != nullptr &&
                      transport_->world_size() > 1;
  if (!wanted) {
    was_wanted_ = false;
    return false;
  }
  if (!was_wanted_) {  // a sparse plan starts
    next_step_ = std::max(next_step_, f.step + kStartAfterSteps);
    from_step_ = f.step;
    fire_step_ = grid_ = 0;
    first_of_plan_ = true;
    early_plan_ = !ring_ran_ && job_sent_ == 0;
    plan_probes_ = 0;
    plan_start_ = clock_.now();
  }
  was_wanted_ = true;
  Shared& s = *shared_;
  if (s.in_flight.load(std::memory_order_acquire)) return false;
  if (const int64_t done = s.done_at.exchange(-1, std::memory_order_acq_rel); done >= 0) {
    const Clock::time_point done_at{Clock::duration(done)};
    if (s.failed.exchange(false, std::memory_order_acq_rel)) {
      retry_at_ = done_at + kRetryAfterFailure;
    } else {
      took_ = std::chrono::duration<double>(done_at - posted_).count();
    }
  }
  const Clock::time_point now = clock_.now();
  if (now < retry_at_ || f.step < next_step_) return false;
  // The first probe keeps to the share as well, by what a probe is expected to take (a ring
  // step lately), times the ring's distance; one hour at most, whatever that said. Neither it nor
  // the share's wait after a probe holds an early one (once due, it stays so).
  const double dist = distance();
  const bool hint_early = fire_step_ != 0 ? fire_early_ : early(f.step);
  const double wait = std::min(3600.0, expected_probe_s() / f.share * dist);
  if (!hint_early &&
      now < plan_start_ + std::max<Clock::duration>(kStartAfter, std::chrono::duration_cast<Clock::duration>(
                                                                     std::chrono::duration<double>(wait)))) {
    return false;
  }
  if (posted_any_ && !hint_early) {
    const auto spent = std::chrono::duration_cast<Clock::duration>(
        std::chrono::duration<double>(std::min(3600.0, std::max({took_, received_, stall_}) / f.share *
                                                           static_cast<double>(backoff()) * dist)));
    if (now < posted_ + std::max<Clock::duration>(spent, kMinProbeInterval)) return false;
  }
  // Due: it goes at the next step of its grid, where the other nodes' probes go too.
  if (fire_step_ == 0) {
    grid_ = grid_for(f.step >= from_step_ ? f.step - from_step_ : 0, grid_);
    fire_step_ = next_on_grid(f.step, grid_);
    fire_early_ = hint_early;
  }
  if (f.step < fire_step_) return false;

  if (s.payload.size() != f.payload_bytes) s.payload.assign(f.payload_bytes, std::byte{0});
  wire::WireHeader h{};
  h.magic = wire::kMagic;
  h.version = wire::kVersion;
  h.kind = static_cast<uint16_t>(wire::Kind::kProbe);
  h.job_id = job_id_;
  h.sender_rank = rank_;
  h.payload_bytes = s.payload.size();
  wire::seal(h, s.payload, std::span<std::byte, wire::kHeaderBytes>(s.header));
  const uint32_t to = (rank_ + 1) % transport_->world_size();
  s.in_flight.store(true, std::memory_order_release);
  posted_any_ = true;
  posted_ = now;
  posted_step_ = f.step;
  ++plan_probes_;
  stall_ = 0;  // until the steps after it say
  took_ = 0;  // until its completion says
  next_step_ = f.step + kMinProbeSteps;
  from_step_ = f.step;
  fire_step_ = 0;
  // The first probe of a plan waited at least kStartAfter, often far longer than the ones after it
  // wait: those set their own grid.
  if (std::exchange(first_of_plan_, false)) grid_ = 0;
  const Clock* clock = &clock_;
  Status st = transport_->send(to, s.header, s.payload, [shared = shared_, clock](const Status& done) {
    if (!done.ok()) {
      SC_LOG_DEBUG("a link probe was not delivered: {}", done.to_string());
      shared->failed.store(true, std::memory_order_release);
    }
    shared->done_at.store(clock->now().time_since_epoch().count(), std::memory_order_release);
    shared->in_flight.store(false, std::memory_order_release);
  });
  if (!st.ok()) {
    s.in_flight.store(false, std::memory_order_release);
    retry_at_ = now + kRetryAfterFailure;
    SC_LOG_DEBUG("cannot send a link probe to rank {}: {}", to, st.to_string());
    return false;
  }
  ++sent_;
  ++job_sent_;
  if (job_steps_.size() < kJobStepsKept) job_steps_.push_back(f.step);
  SC_LOG_DEBUG("link probe {} at step {}: {} bytes to rank {}{}", sent_, f.step, s.payload.size(), to,
               std::exchange(fire_early_, false) ? " (early: the ring's price is the trainers' dense iterations')" : "");
  if (metrics_ != nullptr) {
    metrics_->probes_sent.Increment();
    metrics_->add_bytes_sent(to, wire::kHeaderBytes + s.payload.size());
  }
  return true;
}

}  // namespace sparsecar
