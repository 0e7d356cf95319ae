// LinkProbe: the sender's side of the step controller's link probe (policies/link_model.h).
//
// While the step controller is active, the dense ring is one of its candidates and this node's
// steps run a sparse plan, the node now and then sends its ring successor (rank + 1 mod W) one
// wire::Kind::kProbe message of the bytes the ring sends it in a step (zeros; at most
// policies::kProbePayloadCapBytes). The receiving transport times it like every rendezvous message
// (a ReceiveSample, which reaches the controller as a link sample); the receiver's mailbox
// validates, counts and drops it. The controller compares those samples, per byte, with the first
// one since the ring's price was last set, and prices the ring anew where the link got faster for
// the ring's chunks: a rise that none of a sparse plan's few-KB messages shows behind a shaper's
// burst.
//
// Cost: at most `share` of the link's time (the `step_probe_share` knob).
// - The first comes kStartAfterSteps steps into the sparse plan, and kStartAfter or, where it is
//   longer, the probe's expected time / share after the plan started: what a ring step over this
//   node's link took lately (StepFacts::ring_probe_s, the median of the last three: the daemons'
//   ring steps, or the trainers' dense iterations before the first step), so that the first probe
//   keeps to the share too (at 1 s, a probe at 50 Mbit/s took ~50-80 ms: 3-5 % of the real small
//   jobs' 1-2.5 s).
// - After a probe that took d, the next one waits d / share from its post, and at least
//   kMinProbeInterval and kMinProbeSteps steps. d is the longest of the send's post -> completion,
//   the receiver-side time of the last probe that came from the ring predecessor
//   (StepFacts::received_s), and what the kStallSteps steps after the post took over this node's
//   pace (StepFacts::step_s against the median of the last kPaceSteps others): a send completes
//   once its bytes are in the kernel's queues, ahead of a shaper, so on its own it said 250 ms
//   where a probe took ~35 ms of a 50 Mbit/s link, and the real small jobs ran 20-47 % slower a
//   step at 50 Mbit/s than top-k's; and the steps a probe delays pay for the messages held behind
//   it and the pipeline refilling, more than its own time (the large real job at 1 Gbit/s: the
//   steps at and after its probes 2.6-4.7 % of the job's time where the share was 2 %).
// - Once due, it goes at the next step divisible by its grid, a power of two of steps at least as
//   long as the wait (grid_for; kept while the waits stay within 4x below it; the plan's first
//   probe hands its grid on to none), and so do the other nodes' probes: their waits are alike,
//   so their grids are the same or powers of two apart, and the coarser grid's steps are the finer
//   one's. A step then waits for every link's probe at once: unaligned, each node's probes delayed
//   the job on their own, W x share in all (2 nodes behind a 200 Mbit/s shaper: 52 us a step,
//   x1.029, where the share was 2 %; aligned 12 us). The grid spaces probes up to 2x (4x while the
//   waits shrink) wider than the share asks.
// - The back-off (2026-12-02): the waits after a sparse plan's probes are 2x, 4x, then 8x
//   (kMaxBackoff) the share's: each probe that left the plan in force says the link changes
//   seldom, and each probe risks a rate change since the last one, which makes it dearer than
//   the share planned (the large real job's probe after a drop from 1 Gbit/s to 50 Mbit/s cost
//   0.10-0.31 s of a 4-9 s time to the target on each of 8 seeds; top-k's jobs had no such step).
//   A predecessor's probe received here in half the time of the one before (a rise: the
//   controller wants a second probe to confirm it) makes the next wait the share's again, and a
//   new sparse plan starts over.
// - The ring's distance (2026-12-02): every wait, the first's too, is also times how much dearer
//   than the sparse plan's priced step a ring step was when it last ran here (its whole step, the
//   median of the last three: the daemons' ring steps' periods, or the trainers' dense iterations
//   before the first step; over this node's pace times step_dense_worth), from 1 to
//   kMaxDistance: a ring 2x the sparse price needs a link ~2x faster (more: its own work does not
//   shrink) before a probe can find it cheaper, and the further the ring is, the less likely a
//   rise brings it within reach before the next probe. The large real job's ring at 1 Gbit/s
//   was ~2x its sparse price (its probes 2x apart), on the box at 50 Mbit/s ~12x (8x); the small
//   job's at 1 Gbit/s within it (1x). The nodes run the same steps, so their distances are alike
//   and so are their grids.
// - The hint's ring (2026-12-04): where the daemons have not run the ring this job (the warm-up
//   was cut before it started), the ring's price is the trainers' dense iterations only, and
//   those read 0.45-2.2x the daemons' ring steps at 1 Gbit/s on the 2-core box (36 jobs of the
//   small model: gloo's first all-reduces). There the job's first kEarlyProbes probes go early,
//   where the ring's distance is at most kEarlyDistance: the first kEarlySteps into its first
//   sparse plan, the second kMinProbeSteps after it, each on its wait's grid, with no wait for
//   kStartAfter or the share: the price they test decides the start (a rise needs two probes at
//   half the price's time, or one at a quarter), and at that distance the link is fast (the small
//   job's ring at 50 Mbit/s was 4.5-6x; a probe at 1 Gbit/s ~3 ms). At kStartAfter (1 s: step 128
//   on the box) the probe-made ring trials of those jobs fell outside the start.
// - One probe in flight at a time; a send that fails waits kRetryAfterFailure.
// Counted in sparsecar_link_probes_total{direction="sent"}, its bytes in wire_bytes_sent_total.
//
// Time: read only through the Clock it is given (which must outlive the transport's callbacks).
// Threads: after_step()/reset() on the pipeline thread; a probe's completion on the transport's
// progress thread (shared state under atomics, kept alive by the callback).
#pragma once

#include <array>
#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "daemon/transport/transport.h"
#include "daemon/transport/wire.h"
#include "sparsecar/common/clock.h"

namespace sparsecar {

class Metrics;

class LinkProbe {
 public:
  static constexpr std::chrono::milliseconds kMinProbeInterval{250};
  static constexpr std::chrono::seconds kRetryAfterFailure{5};
  static constexpr uint64_t kMinProbeSteps = 10;
  static constexpr uint64_t kStartAfterSteps = 3;
  static constexpr std::chrono::seconds kStartAfter{1};
  static constexpr uint64_t kMaxBackoff = 8;
  static constexpr double kMaxDistance = 8;  // the most the ring's distance stretches a wait
  static constexpr uint64_t kEarlyProbes = 2;    // the hint's ring: its job's first probes go early,
  static constexpr uint64_t kEarlySteps = 8;     // the first this many steps into the plan,
  static constexpr double kEarlyDistance = 2.5;  // where the ring's distance is at most this

  // What the step that just finished says about probing.
  struct StepFacts {
    uint64_t step = 0;
    // The step controller is active and allows the ring, and the step ran a sparse plan through
    // the daemons (not a dense step, not one the trainers reduced).
    bool wanted = false;
    double share = 0;            // step_probe_share (0: off)
    uint64_t payload_bytes = 0;  // policies::link_probe_payload_bytes (0: no probe for these tensors)
    // The receiver-side time of a message of a probe's size from the ring predecessor that arrived
    // during the step (its probe: the links of a ring are alike), 0 when none did.
    double received_s = 0;
    // What a ring step over this node's link took, scaled to the probe's bytes (s), where this step
    // tells it: the step ran the daemons' ring (its exchange), or the trainers' dense iterations
    // before the first step were reported (their wait on the all-reduce); 0 otherwise.
    double ring_probe_s = 0;
    // The step's wall time on this node (the period between two steps finishing; s), 0 unknown.
    double step_s = 0;
    // A ring step's whole time on this node (s), where this step tells it: its period, where it ran
    // the daemons' ring, or the trainers' dense step before the first step; 0 otherwise.
    double ring_step_s = 0;
    double dense_worth = 1.0;  // step_dense_worth: the factor on a sparse step's time in its price
    bool ring_ran = false;     // the step ran the daemons' ring (its exchange, not the trainers')
  };
  static constexpr uint64_t kStallSteps = 2;  // the steps after a probe's post that it may delay
  static constexpr size_t kPaceSteps = 15;    // the steps whose median is this node's pace

  // `transport` may be null (one node); `metrics` may be null.
  LinkProbe(uint32_t rank, uint64_t job_id, Transport* transport, Metrics* metrics, const Clock& clock);

  // After a finished step: sends a probe when one is due. Returns true when it sent one.
  bool after_step(const StepFacts& f);
  // A new job: the next probe waits for its sparse steps again.
  void reset();
  // The grid of a probe due `waited` steps after the last one (or after its sparse plan's start)
  // where the last grid was `grid` (0: none): `grid` while waited is in [grid / 4, grid], else the
  // least power of two >= waited (at most kMaxGrid).
  static uint64_t grid_for(uint64_t waited, uint64_t grid);
  // The first step >= due divisible by grid (due itself for a grid of 0, or where that step would
  // pass the largest uint64_t).
  static uint64_t next_on_grid(uint64_t due, uint64_t grid);
  static constexpr uint64_t kMaxGrid = uint64_t{1} << 40;
  uint64_t sent() const { return sent_; }
  // This job's probes (since the last reset()): how many were sent, and the steps of the first
  // kJobStepsKept; job_summary() says both in a line for the log ("" when none was sent), which
  // the daemon writes as the job ends (ObservationCollector::on_reset) and
  // bench/controllers/real_metrics.parse_probes reads.
  static constexpr size_t kJobStepsKept = 32;
  uint64_t job_sent() const { return job_sent_; }
  const std::vector<uint64_t>& job_steps() const { return job_steps_; }
  std::string job_summary() const;

 private:
  struct Shared {
    std::atomic<bool> in_flight{false};
    std::atomic<bool> failed{false};     // the last probe's completion was a failure
    std::atomic<int64_t> done_at{-1};    // its completion's clock reading (ticks); -1: none new
    std::array<std::byte, wire::kHeaderBytes> header{};
    std::vector<std::byte> payload;  // zeros; resized only while no probe is in flight
  };

  uint32_t rank_;
  uint64_t job_id_;
  Transport* transport_;
  Metrics* metrics_;
  const Clock& clock_;
  std::shared_ptr<Shared> shared_ = std::make_shared<Shared>();
  bool posted_any_ = false;
  Clock::time_point posted_{};
  double took_ = 0;              // the last probe's post -> completion (s)
  double received_ = 0;          // the predecessor's last probe, timed here (s)
  // The last StepFacts::ring_probe_s values (s), oldest first; the first probe of a sparse plan
  // takes their median (of two, the shorter), so that one stalled ring step (a connection's
  // set-up, a loaded host) does not hold the probe off for 50x its time.
  std::array<double, 3> ring_recent_{};
  size_t ring_count_ = 0;
  double expected_probe_s() const;
  // The last StepFacts::ring_step_s values (s), oldest first, and the last step_dense_worth: the
  // ring's distance, distance(), in [1, kMaxDistance].
  std::array<double, 3> ring_step_recent_{};
  size_t ring_step_count_ = 0;
  double dense_worth_ = 1.0;
  double distance() const;
  // This node's pace: the last kPaceSteps step times that no probe delayed (a ring); the last
  // probe's step and what the kStallSteps steps after it took over that pace (s).
  std::array<double, kPaceSteps> pace_{};
  size_t pace_count_ = 0, pace_at_ = 0;
  double pace() const;
  void observe_step_time(const StepFacts& f);
  uint64_t posted_step_ = 0;
  double stall_ = 0;
  Clock::time_point retry_at_{};  // after a failure, the next probe not before this
  Clock::time_point plan_start_{};  // nor before kStartAfter (or the expected probe's wait) after this
  uint64_t next_step_ = 0;       // nor before this step
  uint64_t from_step_ = 0;       // the step its wait counts from: the last probe's, or the plan's first
  uint64_t fire_step_ = 0;       // once due, the step of the grid it goes at (0: not due yet)
  uint64_t grid_ = 0;            // the last probe's grid (grid_for; 0: none, or the plan's first probe's)
  bool first_of_plan_ = false;   // the next probe is its sparse plan's first
  bool ring_ran_ = false;        // the daemons ran the ring this job (else its price is the hint's)
  bool early_plan_ = false;      // this sparse plan is the job's first, and started before any ring
  bool fire_early_ = false;      // the probe due (fire_step_) is an early one
  bool early(uint64_t step) const;  // an early probe is due at `step`
  uint64_t plan_probes_ = 0;     // probes of this sparse plan since it started or a rise (the back-off)
  // The back-off's factor on the wait after the last probe: 2 after a plan's first, then 4, up to
  // kMaxBackoff; 1 where a rise was seen since it.
  uint64_t backoff() const;
  bool was_wanted_ = false;
  uint64_t sent_ = 0;
  uint64_t job_sent_ = 0;
  std::vector<uint64_t> job_steps_;  // the first kJobStepsKept of this job's
};

}  // namespace sparsecar
