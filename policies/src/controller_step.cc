// The step controller: prices every candidate plan as the time a step takes under it and keeps
// the ring where it is the cheapest, else the sparsest plan within `step_slack` of the cheapest.
// Its row: controllers.cc.
//
// Prices, v3:
//   - a plan that ran is priced by what its steps MEASURED (the trainer's compute + the slowest
//     node's encode + exchange, smoothed): a record per plan, kept until the link changes rate;
//   - every price adds the step's overhead: what the daemons' parts miss of the whole step (the
//     median of the last steps' JobObservation::period_s - compute - encode - exchange: the hook
//     and its copies), which every plan pays;
//   - a plan that has not run (or whose record a rate change voided) by the model: one LinkFit
//     (link_model.h) per pair of nodes, t = alpha + beta * bytes, from the receivers' timing of
//     the messages they time (JobObservation::link_samples: one small send in
//     step_timed_send_every to each peer, every large one), and this job's compute costs per node (the
//     slowest node's, smoothed: encode per element and decode per entry received for sparse steps,
//     EF + copy + reduce per element for the ring; a prior until a kind of step has run), plus the
//     model's error on the path's plans that ran (measured - predicted, smoothed, sparse and ring
//     apart): what the model does not see, e.g. waiting for a peer, an overhead of the ring.
// Records exist because a link is not linear: a shaper's burst (tbf) serves small messages at
// line rate and large ones at its rate, so a fit made from the sparse messages prices the ring
// far too low, and one made from the ring's chunks prices sparse plans too high. v1 priced every
// plan by the fit and flipped between the ring and sparse on real jobs; a measured plan is now
// what it measured, and a model that was wrong about it is wrong once.
//
// Quality: a sparse step does less for the model than a dense one (error feedback delays what
// it leaves out), so a sparse plan's price is its step time x `step_dense_worth` (the dense steps
// one is worth; 1 = step time alone). The worth belongs to the model and to the phase of
// training: over whole real jobs a dense step did the work of ~1.9 top-k 0.5 % steps on the small
// digits MLP, <= 1.4 on the large one and ~1.05 on a Fashion-MNIST MLP, and early dense steps are
// worth more than late ones (docs/controllers.md, "A job the controllers were not tuned on").
// The default, 1.3, keeps the ring only where it costs little more than a sparse step: a ring
// kept all job at 1.7x a sparse step's time cost the Fashion-MNIST job up to 2.7x the time. The
// early steps' greater worth is the schedule's dense warm-up's, which v6 ends early where the
// ring is dear (step_warmup_cut, below). Among sparse plans a denser one is not a better one: on
// the digits MLP top-k 2 % never reached the accuracy 0.1 % did in 400 steps, so within the slack
// the controller keeps the density asked for (the operator's or the accuracy controller's) and
// goes denser only where that is cheaper.
//
// Candidates: sparse at the density asked for (the quality floor: the operator's, or what the
// accuracy controller made of it) and at 2x, 4x, ... that, up to density_max and 0.5; the dense
// ring (`step_allow_dense`). With the ring allowed the first decision is the ring: the early steps
// are those error feedback hurts most, and the ring's messages teach the link fits a large size.
// v4: under the schedule's dense warm-up (>= 6 steps) that decision is not made: the warm-up runs
// and measures the ring on every node; the operator's plan after it may still go up to the ring,
// v5: once it is measured too (both sides of the first answer measured, not modelled).
// Without it, a start-up probe (4x the density asked for, until some link has seen two message
// sizes) separates alpha from beta for a one-bucket job.
//
// No flip-flops: the plan in force is kept while its price stays within 3 x slack of the
// cheapest, and is measured before it is left; a move down (too slow) or — as the first answer
// after the start or a rate change only — up (the ring, or a sparse plan at least 4x denser,
// within the slack) needs `step_confirm_steps` consecutive observations that want it, and
// `step_hold_steps` steps since the last decision (not after the start-up decision: its answer
// comes as soon as the ring is measured). A rate change voids the other plans' records: seen as
// kChangeConfirmSteps steps in a row whose measured time is 2x off the plan in force's record, or
// as a restart of a link fit (LinkFit: the same, on message sizes it has seen) away from a
// decision that the plan in force's own time followed. A move to a plan that has not run (or
// whose record was voided) is a trial: once that plan is measured, a price above the measured
// plan it left takes the job back at once (without the hold), so a model that underprices a path
// it has never seen (after a dense warm-up, nothing sparse has run) costs one short excursion,
// not the rest of the job behind the hysteresis. A change that the trainer's compute time
// followed is the host's load, not the link's rate, and voids nothing (v10). A rise that none of
// the sparse plan's own messages shows (a shaper whose burst covers them) is seen by the link
// probe (v14, watch_probes: a ring step's bytes sent to the successor now and then,
// link_model.h); a drop that only the probe shows is not acted on (the ring is not in force).
// v15: the probe's own costs are no plan's: the step it crossed and the next (the shaper's bucket
// it drained) stay out of the records, and its samples out of the link fits; and no ring whose
// record is gone costs less than its bytes take at the last probe's rate (probe_floor()).
// v16: nor at the rate the ring's own steps met (its quickest since the last probe; the ring or
// the probe, whichever came last): the warm-up's ring runs too few steps for a record, and the sparse plan's messages that
// follow cross a shaper's burst fast enough to restart the link fits at twice the link's rate.
// v17: a slowdown the plan in force's own steps showed is answered at once (no confirmation
// steps, no hold): those steps were its confirmation.
// v18: before the first step a sparse step is priced at 2.5x the trainer's dense step's rest (v8: 3).
// v19: 2x, for the DDP hook's hint of two dense iterations (2026-12-03; it ran three before).
// v21: where the hint says the hook corrects momentum (DGC's momentum correction), a sparse step
// is priced x step_dense_worth_corrected (1.6), not x step_dense_worth (1.3): without the
// correction a ring -> sparse switch forfeited the ring's lead (the trainer's momentum holds the
// ring's steps, error feedback then delays them again; 1.01-1.13x top-k's steps from the start),
// with it the ring's steps banked: 100 of them, then top-k, took 0.68x (small digits MLP) and
// 0.64x (large) top-k's steps, each ring step doing the work of 1.6 and 1.9 top-k 0.5 % steps
// (docs/controllers.md, "What a dense step is worth, in steps").
// v22: a ring whose record holds only its first steps (the warm-up's 3, or the trainer's hint)
// and that lost the first answer by less than 1.25x is measured again step_hold_steps later, as a
// trial: a job's first ring steps run slower than its later ones (docs/controllers.md, "Step v22").
// v23: the mirror of v22: the first answer does not leave the sparse plan for the ring by less
// than 1.25x on a sparse record of its first steps only (fewer than 8): it waits until the record
// holds 8. A job's first sparse steps run slower than its later ones, too: two `steady` jobs at
// 200 Mbit/s on the 2-core box went to the ring at step 7 on sparse records of 34 and 16.8 ms
// (x1.6: 1.06x and 1.02x the ring's price) where top-k's steady steps took ~12 and ~10 ms, and
// took 2.1x and 1.1x top-k's time to the target (docs/controllers.md, "`up`'s ceiling, and step v23").
#include "controller_internal.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "sparsecar/policies/link_model.h"

namespace sparsecar::policies {
namespace {

// Priors for a kind of step not yet seen (seconds per element / per entry): a pass of a few
// arithmetic operations per element on one core. Replaced by the measurement once it runs.
constexpr double kPriorEncodePerElement = 10e-9;
// v9: where every node compresses every tensor on a GPU (the device path, JobObservation::
// device_elements), a sparse step's encode is a few passes over device memory: 0.1 ns per
// element (on two H200 nodes of two GPUs each, a 50 M-parameter MLP's sparse steps took ~6 ms
// over NCCL's dense 3.3 ms, the hook's copies and the node-local sum included). The host's prior
// priced them at 500 ms there: after the warm-up the job went to the daemons' ring (420 ms a
// step over loopback TCP) for 11 steps before a sparse step was measured.
constexpr double kPriorDeviceEncodePerElement = 0.1e-9;
constexpr double kPriorDecodePerEntry = 5e-9;
constexpr double kPriorRingPerElement = 2e-9;
constexpr double kCostSmoothing = 0.2;  // EMA weight of a new compute-cost sample (log domain)
constexpr double kRecordSmoothing = 0.3;  // EMA weight of a plan's new measured step time (log)
constexpr uint64_t kRecordTrusted = 3;  // measured steps before a record prices its plan
constexpr uint64_t kProbeSteps = 20;    // the start-up probe's longest run
constexpr uint64_t kStartSteps = 3;     // the job's first steps: no record of their times
// v22: a ring record of fewer steps than this is its first steps' only (the warm-up's, or the
// trainer's hint); one that lost the first answer by less than kRingRetryWithin is measured again.
// v23: so is a sparse record; the first answer does not leave it for a ring that wins by less.
constexpr uint64_t kRingRetrySteps = 8;
constexpr double kRingRetryWithin = 1.25;
// Steps in a row off a link fit by 2x that make it restart: 3, so that the scheduling noise of a
// loaded host on small messages (two slow steps) restarts nothing.
constexpr uint64_t kLinkConfirmSteps = 3;
// Steps that make a rate change of the plan in force: 5 in a row 2x off its record, or a mean of
// the last 5 that moved >= kFollowed as a link fit's restart predicts. A sparse step of a small
// model costs a few ms, and a loaded host moves that by 50 % for several steps (the real jobs
// voided their records on such noise with 3 steps and 25 %).
constexpr uint64_t kChangeConfirmSteps = 5;
// v5: a change of the ring's time by 4x or more needs fewer steps in a row: on the large real job
// each ring step after a drop to 50 Mbit/s cost ~1 s. Not for sparse plans: their steps of a few
// ms are the ones a loaded host moves most (with the rule on every plan one of 12 real adaptive
// jobs made a stray ring trial at a steady 500 Mbit/s; its log was not kept, so the cause is
// unconfirmed, and no run without the rule showed one).
// v7: 2 steps (v5: 3): a ring step 4x off twice in a row is no host's noise (a trainer's
// evaluation delays one step), and each step it waits costs a slow ring step.
constexpr double kFarOff = 4.0;
constexpr uint64_t kFarConfirmSteps = 2;
constexpr double kFollowed = 1.5;
// v10: a loaded host is no link change. Another process on the trainers' cores slows the
// receivers' timing of messages and every part of a step alike, the trainer's compute too, which
// no link changes: a change of the plan in force's time (or a link fit's restart) that the
// trainer's compute followed, >= kFollowed the same way over the same kChangeConfirmSteps steps
// (their median against the median of up to kComputeBaseSteps before them), voids no record (a
// real Fashion-MNIST job at a steady 50 Mbit/s voided them on a loaded host, priced the ring by a
// fit of small messages that cross within a shaper's burst, and tried it: two decisions). A load
// that lasts moves the baseline within kComputeBaseSteps steps. The compute time is the trainer's
// `compute_time` metric, else the DDP hook's own timing (`hook_compute_time`, CPU buckets and the
// device path); a trainer with neither gets no such guard.
constexpr size_t kComputeBaseSteps = 30;
// v11: dense steps the trainers all-reduce themselves (dense_collective=trainer; the DDP hook over
// NCCL or gloo) send nothing through the daemons: their exchange is in the step's period, not in
// JobObservation::exchange_s. Such a ring step's record is its period less the overhead the
// other steps measured (the hook and its copies), and it neither feeds that overhead nor the
// daemons' ring cost per element. On NVLink the daemons' own ring cost ~420 ms a step where the
// trainers' NCCL all-reduce costs a few: the ring candidate is then the trainers'.
// v12: no link samples from a step the trainers reduced (any of its tensors): the daemons' small
// messages then queue behind the trainers' all-reduce on the same link (~40 ms at 1 Gbit/s on a
// GPU job), and a fit of them priced every sparse plan 10x over.
// v13: a ring whose record a void dropped is priced by the model times what the model missed of
// it, as a ratio, not by the model alone. The model's ring is wrong by a factor: behind a shaper's
// burst the fit of few-KB sparse messages says the ring's chunks are nearly free (a real small
// job at a steady 50 Mbit/s priced its ring at 12.8 ms after a void on noise, tried it and
// measured 70.2 ms), and the trainers' ring (dense_collective=trainer: gloo or NCCL over the
// trainers' ranks) moves other bytes in other rounds than the daemons' (one priced at 9.4 ms,
// measured 24.6). While the ring's record is trusted (and no link fit changed for
// kChangeConfirmSteps steps) the controller keeps the ratio of that record to the model, both
// less the trainer's compute; a void drops the record, not the ratio, and a void on a slower link
// floors the ring's price (void_records_but). The additive model error (v3, voided with the
// records) stays for sparse plans, and for the ring until a ratio is known.
// v5: the first answer after the dense warm-up goes to the ring on the model's word about the
// sparse plan only where the ring is cheaper by more than this (the model's sparse price was 13 %
// off a real small job's measured one); else the sparse plan is measured first.
constexpr double kModelMargin = 0.3;
constexpr size_t kOverheadSteps = 15;  // steps whose median is the step's overhead
constexpr double kStartSparseFactor = 2.0;  // v8, v18, v19: a sparse step before any ran, x a dense step's rest
// v14: probe samples in a row, on every link that had one, at kProbeFaster or less of the time the
// ring's price holds for those bytes make a rise of the link where the ring's chunks cross; one at
// kProbeFarFaster or less does. A message cannot cross faster than the link lets it (a slow one
// is the noise a loaded host makes): no noise makes one 4x faster. One probe is what a rise costs
// in waiting: at 50 Mbit/s the small real job's probe took ~50 ms, so at a share of 2 % the next
// came ~2.5 s later.
constexpr uint64_t kProbeConfirm = 2;
constexpr double kProbeFaster = 0.5;
constexpr double kProbeFarFaster = 0.25;
// v20: a ring's record is no cheaper than it measured times the sparse plan in force's slowdown
// since then (its record now over its record when the ring last ran, or when it was first
// trusted after that): a ring is at least as bound to the link as a sparse step, v13's floor
// without a void. A real small job's `down` on the 2-core box (seed 1, 2026-12-03) measured the
// ring at 1 Gbit/s in a trial a probe made (14.1 ms against a sparse price of 13.5), went back,
// and after the drop to 50 Mbit/s its sparse steps slowed 1.5x, under the 2x of a void: at step
// 579 the ring's record from 1 Gbit/s (14.7 ms) undercut the sparse price (20.3 ms), the ring
// ran at 50 Mbit/s (60.9 ms) and was left 4 steps later, two decisions on a steady link.

// The upper median of a non-empty sample (taken by value: it is reordered).
double median(std::vector<double> v) {
  std::nth_element(v.begin(), v.begin() + static_cast<std::ptrdiff_t>(v.size() / 2), v.end());
  return v[v.size() / 2];
}

double smooth_log(double mean, double sample, double alpha) {
  if (!(mean > 0)) return sample;
  return std::exp(alpha * std::log(sample) + (1 - alpha) * std::log(mean));
}

struct Plan {
  bool dense = false;
  double density = 1.0;  // sparse only
  bool same(const Plan& o) const {
    return dense == o.dense && (dense || std::fabs(std::log(density / o.density)) < 0.05);
  }
};

struct Candidate {
  Plan plan;
  double seconds = 0;  // step time, measured or modelled
  bool measured = false;
  double price = 0;    // seconds x dense_worth for sparse plans
};

// What one plan's steps measured.
struct Record {
  Plan plan;
  double seconds = 0;  // smoothed step time
  uint64_t steps = 0;
  int off_side = 0;    // consecutive steps 2x off: +1 slower, -1 faster
  uint64_t off_steps = 0;
  uint64_t far_steps = 0;  // of those, the last ones in a row kFarOff or more off
  double off_sum_log = 0;
};

class StepController final : public Controller {
 public:
  ControllerKind kind() const override { return ControllerKind::kStep; }
  uint32_t version() const override { return 23; }  // the vN of the notes in this file

  Status update(const ControlContext& ctx, ControlKnobs* knobs) override {
    const auto& s = ctx.settings;
    const auto& o = ctx.obs;
    if (cut_.on) knobs->schedule_warmup_steps = std::min(knobs->schedule_warmup_steps, cut_.at);
    const uint32_t w = s.world_size;
    const uint64_t changes_before = link_changes();
    const double in_force_modelled_before =
        (decided_ || has_ran_) && !tensors_.empty() ? model_seconds(running(), w, knobs->format) : 0;
    // v12: a step the trainers reduced put their all-reduce on the link; what the daemons sent
    // meanwhile (observations, decisions: small messages) waited behind it in the queue, and is
    // not what their own exchange meets (a fit of it priced a 12 ms sparse step at 131 ms).
    if (o.trainer_elements == 0) feed_links(o, w, knobs->format, s.step.forget);
    if (link_changes() != changes_before) last_link_change_step_ = o.step;
    on_device_ = o.elements > 0 && o.device_elements >= o.elements;
    observe_compute(o, w);
    if (o.compute_s > 0) {
      compute_s_ = smooth_log(compute_s_, o.compute_s, kCostSmoothing);
      if (computes_.size() == kComputeBaseSteps + kChangeConfirmSteps) computes_.erase(computes_.begin());
      computes_.push_back(o.compute_s);
    }
    const double q = clamp_density(knobs->density, s);
    if (w < 2 || o.tensors.empty()) return hold(ctx, "one node or no tensors: nothing to price");
    if (!knobs->compression) return hold(ctx, "compression is off: the operator chose the dense ring");
    if (knobs->selector == kernels::Selector::kThreshold) {
      return hold(ctx, "the hard threshold's volume is the budget controller's: use top-k");
    }
    tensors_.assign(o.tensors.begin(), o.tensors.end());
    const double top = std::min(s.density_max, 0.5);
    observe_step(o, q, top, knobs->format, w);
    // A link fit restarted, away from a decision (right after one it is the fit meeting the new
    // plan's sizes): the link changed rate and the other plans' records are stale — if, within
    // kChangeConfirmSteps steps, the plan in force's own time moved as the new fit says it
    // should. A fit of small messages restarts behind a shaper's burst (its bucket running dry
    // and refilling) while no step costs more. v13: also before any decision (a job whose warm-up
    // was cut before it started runs the operator's plan without one; a rise then voided nothing
    // unless that plan's own time halved, and the trainers' ring kept its record from the slow link).
    if (link_changes() != changes_before && (decided_ || has_ran_) &&
        o.step > last_decision_step_ + 2 * s.step.hold_steps &&
        in_force_modelled_before > 0) {
      restart_ = {true, o.step, in_force_modelled_before};
    }
    if (restart_.pending && (o.step > restart_.step + kChangeConfirmSteps || last_decision_step_ > restart_.step)) {
      restart_.pending = false;
    }
    if (restart_.pending) {
      const double predicted = std::log(model_seconds(running(), w, knobs->format) / restart_.modelled_before);
      const double seen = recent_change();
      if (std::fabs(predicted) >= std::log(kFollowed) && seen * predicted > 0 &&
          std::fabs(seen) >= std::max(0.5 * std::fabs(predicted), std::log(kFollowed))) {
        if (!host_load_moved(seen > 0 ? 1 : -1)) {
          void_records_but(running(), o.step, std::exp(seen),
                           "a link fit restarted and the plan in force's time followed");
          if (seen > 0) slowed_at_ = o.step;  // v17: its own steps showed it
        }
        restart_.pending = false;
      }
    }
    watch_probes(s, o, knobs->format);
    learn_ring_ratio(s, o.step, knobs->format);

    // Start-up: the ring first where it is allowed (the link fits learn a large size from it);
    // else, once a link is known, a probe of a second size if none separated alpha from beta.
    // The schedule's dense warm-up runs the ring on every node without a decision, long enough to
    // measure it: no start-up decision then. Unless the ring wins clearly on the model (v5,
    // kModelMargin, below: then it is decided over the warm-up's last steps), the operator's
    // sparse plan that follows runs until it is measured as well; then the two records are
    // weighed, and the first answer may go up to the ring (`explore_`). (v4 always weighed them
    // at the warm-up's end, the sparse plan by the model: on the real small job it priced a
    // sparse step at 12.6 ms where its steps measured 11.1 ms, and kept the ring where sparse was
    // faster to the target.)
    // (Once cut, the knob in force holds the cut's step, below the configured length.)
    const bool warm_up = has(s.active, ControllerKind::kSchedule) &&
                         (cut_.on || s.schedule_warmup_steps >= kStartSteps + kRecordTrusted);
    const uint64_t warmup_end = cut_.on ? std::min(cut_.at, s.schedule_warmup_steps) : s.schedule_warmup_steps;
    if (warm_up && !decided_ && o.step + std::max<uint64_t>(s.step.confirm_steps, 1) < warmup_end) {
      if (cut_warm_up(ctx, q, knobs)) return Status::Ok();
      return hold(ctx, warmup_seen_.empty() ? std::string("the schedule's dense warm-up: measuring the ring")
                                            : "the schedule's dense warm-up: " + warmup_seen_);
    }
    // v5: unless the ring wins by more than the model's known error, the first answer waits until
    // the operator's plan is measured too (at most kProbeSteps: a plan this controller cannot
    // tell, e.g. a floor that moves, is then priced by the model).
    const bool await_sparse = warm_up && !decided_ && trusted_record({false, q}) == nullptr &&
                              o.step < warmup_end + kProbeSteps;
    if (!decided_ && s.step.allow_dense && !warm_up) {
      decide({true, 1.0}, o.step, /*answer_now=*/true);
      add_decision_note(ctx.status, "step: starts with the dense ring");
      apply(knobs);
      ctx.status->step_model = "starts with the dense ring: the first steps are the ones compression hurts most";
      return Status::Ok();
    }
    if (!any_link_known()) {
      apply(knobs);
      return hold(ctx, "no link samples yet");
    }
    if (!s.step.allow_dense && probe(o.step, q, top)) {
      ctx.status->step_model = "probing a second message size: " + plan_name(in_force_);
      knobs->density = in_force_.density;
      return Status::Ok();
    }

    // Candidates, sparse ones ascending in density, then the ring.
    std::vector<Candidate> c;
    for (double d = q; d <= top * (1 + 1e-9) && c.size() < 24; d *= 2) c.push_back(candidate({false, d}, w, knobs->format, s));
    if (s.step.allow_dense) c.push_back(candidate({true, 1.0}, w, knobs->format, s));
    if (c.empty()) {
      apply(knobs);
      return hold(ctx, "no candidate plan");
    }
    double cheapest = c.front().price;
    for (const Candidate& x : c) cheapest = std::min(cheapest, x.price);
    // The ring where it is the cheapest; else, within the slack of the cheapest, the sparse plan
    // nearest the density asked for (the sparsest; a denser one is not a better one, below). v5:
    // a tie with the ring goes to the sparse plan, whose price already holds its quality
    // (`step_dense_worth`); v4 gave ties to the ring, so a sparse step priced at 22.2 ms lost to
    // a 22.4 ms ring on the real small job at 200 Mbit/s, where sparse was faster to the target.
    const Candidate* pick = nullptr;
    for (const Candidate& x : c) {
      if (x.plan.dense ? x.price <= cheapest : (x.price <= cheapest * (1 + s.step.slack) && pick == nullptr)) pick = &x;
    }
    const Candidate best = *pick;

    // The plan in force: this controller's last decision, else what the chain asked for.
    if (decided_ && !in_force_.dense) in_force_.density = std::max(in_force_.density, q);  // the floor moved up
    const Plan now = decided_ ? in_force_ : Plan{false, q};
    const Candidate in = candidate(now, w, knobs->format, s);
    if (await_sparse && !(best.plan.dense && best.price * (1 + kModelMargin) <= in.price)) {
      return hold(ctx, "after the dense warm-up: measuring the plan asked for before weighing it against the ring");
    }
    const bool too_slow = in.price > cheapest * (1 + 3 * s.step.slack);
    // Up (to the ring, or a sparse plan 4x denser) only as the first answer after the start or a
    // rate change: between near-equal plans the noise of a loaded host flips the comparison of
    // records taken at different times (the real jobs went 0.004 -> 0.064 -> 0.256 -> 0.064 ...
    // and ring -> sparse -> ring ... on a steady link). Down (too slow) stays open.
    const bool up = explore_ && !now.dense && (best.plan.dense || best.plan.density >= 4 * now.density);
    // v23: not to the ring, by less than kRingRetryWithin, on the first steps of the sparse plan in
    // force: its record waits for kRingRetrySteps of them (and the first answer stays open).
    const bool young = up && best.plan.dense && sparse_record_young(in, best);
    const bool room = up && !young;
    const int want = too_slow ? -1 : room ? 1 : 0;
    if (want != 0 && want == want_) {
      ++wanted_;
    } else {
      want_ = want;
      wanted_ = want != 0 ? 1 : 0;
    }
    // v5: after the dense warm-up the first answer may be "keep the operator's plan": made once
    // step_confirm_steps measured observations in a row want nothing, it closes the exploration
    // as a decision would (until a rate change). Without it the answer stayed open all job, and
    // a near tie that drifted (the sparse record rising a few % late in a steady job) took a
    // real `steady` job to the ring at step 471.
    if (warm_up && !decided_ && explore_ && in.measured && !young) {
      kept_ = want == 0 ? kept_ + 1 : 0;
      if (kept_ >= std::max<uint64_t>(s.step.confirm_steps, 1)) {
        explore_ = false;
        if (ring_worth_retrying(c.back(), in)) retry_at_ = o.step + s.step.hold_steps;  // v22
      }
    }
    // v22: the ring that lost the first answer on its first steps' record, by a little, is
    // measured again hold_steps later: its record goes, and the move is a trial (back at once if
    // the ring then measures dearer than the sparse plan it left). On the 2-core box the small
    // model's warm-up ring record read 11.3 ms where its steady steps took ~8 (the dense job's
    // median), and lost a first answer its steady steps would have won (docs/controllers.md,
    // "Step v22"). Once a job, inside the start's settle window.
    if (retry_at_ > 0 && o.step >= retry_at_) {
      retry_at_ = 0;
      if (!decided_ && !trial_.on && in.measured && !now.dense && ring_worth_retrying(c.back(), in)) {
        const Candidate& ring = c.back();
        char note[256];
        std::snprintf(note, sizeof note,
                      "step: the ring again: its record of its first %llu steps %.3g ms, price %.3g ms against "
                      "%.3g ms of %s (within %gx)",
                      static_cast<unsigned long long>(trusted_record({true, 1.0})->steps), ring.seconds * 1e3,
                      ring.price * 1e3, in.price * 1e3, plan_name(in.plan).c_str(), kRingRetryWithin);
        add_decision_note(ctx.status, note);
        retried_ = true;
        std::erase_if(records_, [](const Record& r) { return r.plan.dense; });
        decide({true, 1.0}, o.step, /*answer_now=*/false);
        trial_ = {true, o.step, now};
        const Candidate again = candidate({true, 1.0}, w, knobs->format, s);
        describe(ctx, again, cheapest, best, worth(s));
        apply(knobs);
        return Status::Ok();
      }
    }
    // Never leave a plan on a model's word about itself: it is measured within a few steps.
    const bool in_unmeasured = decided_ && !in.measured && o.step < last_decision_step_ + kProbeSteps;
    const bool may = !in_unmeasured && (!decided_ || answer_now_ || o.step >= last_decision_step_ + s.step.hold_steps);
    Candidate chosen = in;
    // A move made on the model's word is a trial: once the plan it chose is measured, a price above
    // that of the plan it left (still measured: no rate change since) takes it back at once.
    if (trial_.on && (o.step > trial_.step + kProbeSteps || trusted_record(trial_.left) == nullptr)) trial_.on = false;
    if (trial_.on && in.measured) {
      trial_.on = false;
      const Candidate back = candidate(trial_.left, w, knobs->format, s);
      if (in.price > back.price) {
        char note[256];
        std::snprintf(note, sizeof note, "step: trial failed: %s %.3g ms measured, price %.3g ms vs %.3g ms of %s",
                      plan_name(in.plan).c_str(), in.seconds * 1e3, in.price * 1e3, back.price * 1e3,
                      plan_name(back.plan).c_str());
        add_decision_note(ctx.status, note);
        decide(back.plan, o.step, /*answer_now=*/false);
        describe(ctx, back, cheapest, best, worth(s));
        apply(knobs);
        return Status::Ok();
      }
    }
    // v17: a slowdown that the plan in force's own steps showed (records voided this step) is the
    // confirmation of the move down it calls for: it is answered now, without the observations
    // that want it nor the hold. The ring's far change took kFarConfirmSteps steps, a 2x change
    // kChangeConfirmSteps; waiting step_confirm_steps more cost a 2-core box's large `down` job two
    // ring steps at 50 Mbit/s (0.86-1.08 s each, against 0.13-0.18 s sparse) after a ring trial
    // made at 1 Gbit/s met the drop.
    const bool slowed_now = too_slow && slowed_at_ == o.step && slowed_at_ > 0;
    if (want_ != 0 && (slowed_now || (wanted_ >= std::max<uint64_t>(s.step.confirm_steps, 1) && may))) {
      char note[256];
      std::snprintf(note, sizeof note, "step: %s %.3g ms%s, price %.3g ms vs cheapest %.3g ms; to %s %.3g ms%s",
                    want_ < 0 ? "too slow:" : "room:", in.seconds * 1e3, in.measured ? " measured" : " modelled",
                    in.price * 1e3, cheapest * 1e3, plan_name(best.plan).c_str(), best.seconds * 1e3,
                    best.measured ? " measured" : " modelled");
      add_decision_note(ctx.status, note);
      if (!voided_.empty()) add_decision_note(ctx.status, voided_);
      decide(best.plan, o.step, /*answer_now=*/false);
      if (!best.measured && in.measured) trial_ = {true, o.step, now};
      chosen = best;
    }
    describe(ctx, chosen, cheapest, best, worth(s));
    apply(knobs);
    return Status::Ok();
  }

  // v8: before the first step, the trainer's own dense iterations (StartHint: the DDP hook runs
  // the first ones through torch.distributed over the same link) price the ring, and the warm-up
  // is cut before it starts where a dense step costs more than step_warmup_cut sparse ones. No
  // sparse step has run and neither the daemon's work nor the hook's copies are measured yet: a
  // sparse step is priced at kStartSparseFactor (2; v8-v17: 3, v18: 2.5) times the dense step without its exchange
  // wait (its "rest": the trainer's compute and what the hook does around it). On the 2-core box a
  // sparse step took 8.5-9 ms where the rest was 2.5-3.3 ms; the trainer's dense step measured
  // 65-84 ms (11-22x its rest) at 50 Mbit/s, 21-27 ms (4-9x) at 200 Mbit/s, 11-16 ms at 500
  // Mbit/s and 1 Gbit/s: with step_warmup_cut 3 the cut was made at the first only (2 since
  // 2026-12-02: at 200 Mbit/s where over 6x, and the large model's ring at 1 Gbit/s on a lent
  // machine's 16 cores, 1.8-2.6 sparse steps that saved none). The ring's record starts from the
  // hint (a whole step: the overhead it already holds is priced twice, against
  // the ring; set only on a cut), so the first answer after the cut weighs a measured ring, not a
  // model of it.
  // v18: 2.5, from 67 real jobs' hints replayed against their seeds' static top-k steps
  // (bench/controllers/start_price.py): at 3 the cut was wrongly withheld on 10 (6 of them the
  // large model's at 1 Gbit/s on a 16-core machine, priced 1.8-1.97 where the dense step was
  // 2.6-3.6x a sparse one), at 2.5 on 4 (none of those 6), and no cut was wrongly made at either;
  // at 2.25 one was.
  // v19: 2. The hook now runs two dense iterations where DDP's rebuild changed its buckets (the
  // large model's; it ran three), and the rest of the second, the first after the rebuild, is
  // larger than the third's was (the lent machine: ~12 ms against ~8). Its hint is the least rest
  // of two. Replayed on 103 seeds with each job's first two dense iterations
  // (docs/controllers.md, "Step v19"): at 2.5 the cut was wrongly withheld on 22 (18 of 60 on the
  // lent large model), at 2 on 4, and wrongly made on 1 (the box's small model, which had two
  // iterations before too); with all three iterations at 2.5, 0 and 4.
  Status before_start(const ControlContext& ctx, const StartHint& h, ControlKnobs* knobs) override {
    const auto& s = ctx.settings;
    corrected_ = h.momentum_corrected;  // v21: the whole job's worth of a sparse step
    if (decided_ || cut_.on || has_ran_ || s.world_size < 2 || !knobs->compression ||
        knobs->selector != kernels::Selector::kTopk || !has(s.active, ControllerKind::kSchedule) ||
        s.schedule_warmup_steps < kStartSteps + kRecordTrusted || h.step >= s.schedule_warmup_steps) {
      return Status::Ok();
    }
    if (!std::isfinite(h.dense_step_s) || !std::isfinite(h.dense_wait_s) || h.dense_step_s <= 0 ||
        h.dense_wait_s < 0 || h.dense_wait_s >= h.dense_step_s) {
      return Status::Ok();  // not a step's timing: nothing to weigh
    }
    const double sparse = kStartSparseFactor * (h.dense_step_s - h.dense_wait_s);
    char seen[200];
    std::snprintf(seen, sizeof seen,
                  "the trainer's dense step %.3g ms (%.3g ms of it waiting on the exchange), %.2gx a sparse step "
                  "priced at %.3g ms (%gx the rest)",
                  h.dense_step_s * 1e3, h.dense_wait_s * 1e3, h.dense_step_s / sparse, sparse * 1e3,
                  kStartSparseFactor);
    warmup_seen_ = seen;
    const bool cut = h.dense_step_s > s.step.warmup_cut * sparse;
    // The ring's record from the hint: on a cut (a ring the daemons run measures itself), and
    // (v11) where the trainers reduce dense steps themselves: the hook's dense iterations are
    // that all-reduce, and a warm-up its own iterations shortened leaves the daemons too few ring
    // steps to trust a record of them (the GPU jobs: 2 of the 6).
    if (cut || s.dense_collective == Collective::kTrainerAllReduce) {
      Record& ring = record_of({true, 1.0});
      ring.seconds = h.dense_step_s;
      ring.steps = kRecordTrusted;
    }
    if (!cut) return Status::Ok();
    cut_ = {true, h.step};
    knobs->schedule_warmup_steps = std::min(knobs->schedule_warmup_steps, cut_.at);
    char note[320];
    std::snprintf(note, sizeof note, "step: warm-up cut before it starts: %s; step_warmup_cut %.3g", seen,
                  s.step.warmup_cut);
    add_decision_note(ctx.status, note);
    ctx.status->step_model = std::string("ends the schedule's dense warm-up at step ") + std::to_string(cut_.at) +
                             " (before it started)";
    return Status::Ok();
  }

 private:
  struct Link {
    uint32_t from = 0, to = 0;
    LinkFit fit;
    // v14: the link probe's samples on this link since the ring's price was last set (watch_probes).
    bool probe_any = false;   // a probe-sized sample since the ring's price was last set
    bool after_ring = false;  // set by the ring running: the first sample is the reference only
    double probe_ref = 0;     // the fastest of them not counted faster (seconds per byte; 0: none)
    uint64_t probe_faster = 0;
    double probe_ratio = 0;   // of those counted faster in a row, the largest ratio to its base
    double probe_last = 0;    // v15: its last probe's seconds per byte (0: none since the ring ran)
  };

  // v6: under the schedule's dense warm-up, once the ring is measured (and again whenever a rate
  // change updates its record), the warm-up ends early if a ring step costs more than
  // step_warmup_cut sparse steps of the density asked for (modelled: none has run). The early
  // dense steps can be worth more than later ones (100 dense steps then top-k 0.5 % took 0.57-0.88x
  // top-k's time on the small digits jobs at 1 Gbit/s - 200 Mbit/s, 0.83-1.08x on Fashion-MNIST;
  // nothing on the large digits model), but a ring at 50 Mbit/s costs ~6 sparse steps a step.
  // The knob, not a plan decision: the schedule's plan on every node takes the shorter warm-up
  // from the decision's step on, and what follows is the first answer after a warm-up. Returns
  // true when it cut (the knob is set).
  bool cut_warm_up(const ControlContext& ctx, double q, ControlKnobs* knobs) {
    const auto& s = ctx.settings;
    if (cut_.on || !any_link_known() || trusted_record({true, 1.0}) == nullptr) return false;
    const Candidate ring = candidate({true, 1.0}, s.world_size, knobs->format, s);
    const Candidate sparse = candidate({false, q}, s.world_size, knobs->format, s);
    char seen[200];
    std::snprintf(seen, sizeof seen,
                  "a ring step %.3g ms measured, %.2gx a sparse step of %s (%.3g ms modelled: trainer %.3g ms, "
                  "overhead %.3g ms)",
                  ring.seconds * 1e3, ring.seconds / sparse.seconds, plan_name(sparse.plan).c_str(),
                  sparse.seconds * 1e3, compute() * 1e3, overhead_ * 1e3);
    warmup_seen_ = seen;  // v7: the status says what was weighed while the warm-up goes on
    if (!(ring.seconds > s.step.warmup_cut * sparse.seconds)) return false;
    cut_ = {true, ctx.obs.step + 1};
    knobs->schedule_warmup_steps = std::min(knobs->schedule_warmup_steps, cut_.at);
    char note[256];
    std::snprintf(note, sizeof note, "step: warm-up cut: %s; step_warmup_cut %.3g", seen, s.step.warmup_cut);
    add_decision_note(ctx.status, note);
    ctx.status->step_model = std::string("ends the schedule's dense warm-up at step ") + std::to_string(cut_.at);
    return true;
  }

  // The plan in force: this controller's decision, else the plan the last observed step ran.
  const Plan& running() const { return decided_ ? in_force_ : last_ran_; }

  // This controller's plan, once it decided one, over what the chain asked for.
  void apply(ControlKnobs* knobs) const {
    if (!decided_) return;
    knobs->compression = !in_force_.dense;
    if (!in_force_.dense) knobs->density = in_force_.density;
  }

  void decide(const Plan& p, uint64_t step, bool answer_now) {
    decided_ = true;
    in_force_ = p;
    last_decision_step_ = step;
    answer_now_ = answer_now;
    trial_.on = false;
    explore_ = answer_now;  // the start-up ring's answer may still go up; later moves may not
    want_ = 0;
    wanted_ = 0;
  }

  // The start-up probe (ring not allowed): while no link has shown two message sizes, alpha and
  // beta cannot be told apart (a one-bucket job sends one size), so a plan 4x denser runs until
  // one does (at most kProbeSteps steps); the decision after it is made without the hold.
  bool probe(uint64_t step, double q, double top) {
    if (!probed_ && !any_link_separated() && 4 * q <= top * (1 + 1e-9)) {
      probed_ = probing_ = true;
      decide({false, 4 * q}, step, /*answer_now=*/false);
      return true;
    }
    if (!probing_) return false;
    if (!any_link_separated() && step < last_decision_step_ + kProbeSteps) {
      in_force_.density = std::max(in_force_.density, q);
      return true;
    }
    probing_ = false;
    answer_now_ = true;
    explore_ = true;
    return false;
  }

  // v15: not the link probe's samples (a sparse step's sample of the probe's size): the fits
  // price the plans' own messages, and watch_probes and probe_floor() read the probes. A probe in
  // a fit of few-KB messages moved its slope for the steps it took to fade, and the ring's ratio
  // to its model was learned against that slope (the ring's price then fell with the fit).
  void feed_links(const JobObservation& o, uint32_t w, kernels::Format format, double forget) {
    const uint64_t payload = distinct_probe_payload(o, w, format);
    std::vector<std::pair<size_t, LinkFit::Sample>> batch;  // (link index, sample)
    for (const LinkPairSample& l : o.link_samples) {
      if (payload > 0 && link_probe_sized(l.bytes, payload)) continue;
      batch.push_back({link_index(l.from, l.to), {l.bytes, l.seconds}});
    }
    std::vector<LinkFit::Sample> one;
    for (size_t i = 0; i < links_.size(); ++i) {
      one.clear();
      for (const auto& [index, sample] : batch) {
        if (index == i) one.push_back(sample);
      }
      if (!one.empty()) links_[i].fit.add_step(one, forget, kLinkConfirmSteps);
    }
  }

  size_t link_index(uint32_t from, uint32_t to) {
    for (size_t i = 0; i < links_.size(); ++i) {
      if (links_[i].from == from && links_[i].to == to) return i;
    }
    links_.push_back({from, to, {}});
    return links_.size() - 1;
  }

  uint64_t link_changes() const {
    uint64_t n = 0;
    for (const Link& l : links_) n += l.fit.changes();
    return n;
  }

  bool any_link_separated() const {
    return std::any_of(links_.begin(), links_.end(), [](const Link& l) { return l.fit.separated(); });
  }

  bool any_link_known() const {
    return std::any_of(links_.begin(), links_.end(), [](const Link& l) { return l.fit.known(); });
  }

  // The size of the link probe of this step's tensors (link_model.h; 0: none).
  static uint64_t probe_payload(const JobObservation& o, uint32_t w) {
    std::vector<uint64_t> elements;
    for (const auto& t : o.tensors) elements.push_back(t.elements);
    return link_probe_payload_bytes(elements, w);
  }
  static bool is_probe(const LinkPairSample& l, uint64_t payload) {
    return link_probe_sized(l.bytes, payload) && l.seconds > 0 && std::isfinite(l.seconds);
  }
  // v15: the probe's size where a sample of it cannot be this sparse step's own messages: all of
  // them to a peer together (a receiver's busy period may hold several) below the probe's window
  // (link_probe_sized); 0 otherwise, or for a dense step or no probe. (A tensor of 25 M elements at
  // 0.5 % sends ~1 MB a step, the size of a capped probe.)
  static uint64_t distinct_probe_payload(const JobObservation& o, uint32_t w, kernels::Format format) {
    const uint64_t payload = probe_payload(o, w);
    if (payload == 0) return 0;
    uint64_t own = 0;
    for (const auto& t : o.tensors) {
      if (t.nnz >= t.elements) return 0;  // a dense tensor's ring chunks are probe-sized
      own += sparse_allgather_bytes_as(t.elements, t.nnz, 2, format);
    }
    return 2 * own < payload + kWireHeaderBytes ? payload : 0;
  }
  // A sample of the probe's size reached a receiver in this sparse step.
  static bool probe_crossed(const JobObservation& o, uint32_t w, kernels::Format format) {
    const uint64_t payload = distinct_probe_payload(o, w, format);
    return payload > 0 && std::any_of(o.link_samples.begin(), o.link_samples.end(),
                                      [&](const LinkPairSample& l) { return is_probe(l, payload); });
  }

  // v14: the link probe. While a sparse plan is in force (and the ring is a candidate), the samples
  // of a probe's size (link_model.h: within 2x of it; a probe, or a sparse message that large: the
  // bytes the ring sends a successor in a step) are compared, per link, with what the ring's price
  // says those bytes take (its link part: the price less the trainer's compute and the ring's work
  // per element), or with the fastest probe since that price was last set (its record made, or
  // the records voided) where that is less (a ring step that waits on more than its link). Two in
  // a row at kProbeFaster of that time per byte or less (one at kProbeFarFaster), on every link
  // that had one, say the link got faster where the ring's chunks cross, which no few-KB message
  // of the sparse plan shows behind a shaper's burst. The ring's price is then scaled: its link
  // part by the slowest link's ratio; the records are voided as on any rate change, so the first
  // answer may go up to the ring — a move on the model's word, i.e. a trial that the ring's first
  // measured steps keep or take back. The ring then runs, and the first probe after it is the
  // reference only (a ring step may wait on more than its link: one that pays 15 ms no link
  // sample shows would otherwise look slow to every probe, and be tried after each). (A reference
  // of probes alone was wrong twice: one slow probe on a loaded host made the next look faster, and
  // a rise between the first two left none slower to compare with.)
  void watch_probes(const ControllerSettings& s, const JobObservation& o, kernels::Format format) {
    if (!has_ran_ || last_ran_.dense || running().dense) {
      if (has_ran_ && last_ran_.dense) clear_probe_refs(/*ring_ran=*/true);
      return;
    }
    if (!s.step.allow_dense || o.trainer_elements > 0 || o.link_samples.empty()) return;
    const uint64_t payload = probe_payload(o, s.world_size);
    const auto probe = [&](const LinkPairSample& l) { return is_probe(l, payload); };
    if (std::none_of(o.link_samples.begin(), o.link_samples.end(), probe)) return;
    // What the ring's price says a probe's byte takes: its link part (the price less the trainer's
    // compute and the ring's work per element) is the time of the ring's bytes to a successor
    // (every tensor's chunks) on the slowest link. Per byte, so that a probe smaller than a ring
    // step (kProbePayloadCapBytes, or the largest tensor's of several) reads as the same rate.
    const Candidate before = candidate({true, 1.0}, s.world_size, format, s);
    const double fixed = compute() + ring_cost() * static_cast<double>(o.elements);
    const double was = before.seconds - overhead_;
    const uint64_t ring_bytes = step_dense_bytes(o.tensors, s.world_size);
    if (!(was - fixed > 0) || ring_bytes == 0) return;
    const double implied = (was - fixed) / static_cast<double>(ring_bytes);  // seconds per byte
    for (const LinkPairSample& l : o.link_samples) {
      if (!probe(l)) continue;
      Link& link = links_[link_index(l.from, l.to)];
      const double per_byte = l.seconds / static_cast<double>(l.bytes);
      link.probe_last = per_byte;
      last_probe_ = {o.step, per_byte / implied};
      ring_per_byte_ = 0;  // v16: the probe is the newer word on a ring step's bytes
      const double base = link.probe_ref > 0 ? std::min(implied, link.probe_ref) : implied;
      const bool first_after_ring = link.after_ring && !link.probe_any;
      link.probe_any = true;
      if (!first_after_ring && per_byte <= kProbeFaster * base) {
        const double r = per_byte / base;
        link.probe_ratio = link.probe_faster == 0 ? r : std::max(link.probe_ratio, r);
        link.probe_faster += per_byte <= kProbeFarFaster * base ? kProbeConfirm : 1;
      } else {
        link.probe_ref = link.probe_ref > 0 ? std::min(link.probe_ref, per_byte) : per_byte;
        link.probe_faster = 0;
      }
    }
    double ratio = 0;  // the slowest link's: the ring waits for it
    for (const Link& l : links_) {
      if (!l.probe_any) continue;
      if (l.probe_faster < kProbeConfirm) return;
      ratio = std::max(ratio, l.probe_ratio);
    }
    if (!(ratio > 0)) return;
    const double now = fixed + (was - fixed) * ratio;
    char why[200];
    std::snprintf(why, sizeof why,
                  "the link probe: a ring step's bytes cross in %.3gx the time the ring's price holds; the ring "
                  "%.3g ms%s before, %.3g ms now (modelled)",
                  ratio, was * 1e3, before.measured ? " measured" : " modelled", now * 1e3);
    void_records_but(running(), o.step, /*moved=*/1.0, why);
    ring_probed_ = now;
  }

  void clear_probe_refs(bool ring_ran) {
    for (Link& l : links_) {
      if (ring_ran) l.probe_last = 0;  // a void keeps it: the probe measured the link since
      l.after_ring = ring_ran;
      l.probe_any = false;
      l.probe_ref = 0;
      l.probe_faster = 0;
      l.probe_ratio = 0;
    }
  }

  // The slowest known link's time for a message of `bytes`.
  double link_time(uint64_t bytes) const {
    double t = 0;
    for (const Link& l : links_) {
      if (l.fit.known()) t = std::max(t, l.fit.predict(bytes));
    }
    return t;
  }

  void observe_compute(const JobObservation& o, uint32_t w) {
    if (o.tensors.empty() || o.elements == 0) return;
    bool all_dense = true, all_sparse = true;
    for (const auto& t : o.tensors) {
      const bool dense = t.nnz >= t.elements;
      all_dense = all_dense && dense;
      all_sparse = all_sparse && !dense;
    }
    const double n = static_cast<double>(o.elements);
    if (all_sparse && o.encode_s > 0) {
      encode_ = smooth_log(encode_, o.encode_s / n, kCostSmoothing);
      const double entries = static_cast<double>(w > 1 ? w - 1 : 0) * o.nnz;
      if (o.decode_s > 0 && entries > 0) decode_ = smooth_log(decode_, o.decode_s / entries, kCostSmoothing);
    } else if (all_dense && o.trainer_elements < o.elements) {  // v11: the daemons' own ring only
      const double ring = o.encode_s + o.decode_s + o.reduce_s;
      if (ring > 0) ring_ = smooth_log(ring_, ring / n, kCostSmoothing);
    }
  }

  // The plan this step ran (from its selected counts: dense, or the candidate density whose top-k
  // counts match), its measured time into that plan's record, and the model's error on it.
  void observe_step(const JobObservation& o, double q, double top, kernels::Format format, uint32_t w) {
    const bool by_trainers = o.elements > 0 && o.trainer_elements >= o.elements;  // v11
    if (o.nodes < w || (o.exchange_s <= 0 && !by_trainers)) return;  // incomplete: not a whole step's time
    Plan ran;
    if (std::all_of(o.tensors.begin(), o.tensors.end(), [](const auto& t) { return t.nnz >= t.elements; })) {
      ran = {true, 1.0};
    } else {
      bool found = false;
      for (double d = q; d <= top * (1 + 1e-9) && !found; d *= 2) {
        double nnz = 0;
        for (const auto& t : o.tensors) nnz += static_cast<double>(topk_count(t.elements, d));
        if (std::fabs(o.nnz - nnz) <= 0.02 * nnz + 0.5) {
          ran = {false, d};
          found = true;
        }
      }
      if (!found) return;  // not a plan of this grid (another selector, the floor moving)
    }
    // The first steps of the job and the first step of a plan after a switch carry one-off costs
    // (connections, buffers, the pipeline refilling): no record of them.
    const bool transition = !has_ran_ || !ran.same(last_ran_) || o.step < kStartSteps;
    has_ran_ = true;
    last_ran_ = ran;
    if (transition) {
      recent_.clear();
      return;
    }
    // A record holds the parts of a step the daemons time (the trainer's compute, encode,
    // exchange); the whole step (period_s: the wall time between steps, with the hook and its
    // copies) adds the step's overhead, which every plan pays: prices add it to records and
    // model alike. Records stay on the parts: the period also holds the trainer's evaluations
    // and a loaded host's pauses, which would void records on noise.
    double measured = compute() + o.encode_s + o.exchange_s;
    if (by_trainers) {
      if (!(o.period_s > 0)) return;  // the exchange is in the period only
      measured = std::max(o.period_s - overhead_, measured);
    } else if (o.period_s > 0) {
      // The median of the last kOverheadSteps: a trainer's evaluation every few steps is not a
      // cost of any plan.
      if (gaps_.size() == kOverheadSteps) gaps_.erase(gaps_.begin());
      gaps_.push_back(std::max(o.period_s - (std::max(o.compute_s, 0.0) + o.encode_s + o.exchange_s), 0.0));
      overhead_ = median(gaps_);
    }
    // v15: a sparse step that a link probe crossed waited for it (the probe holds back the
    // messages behind it to its peer: 0.27-0.30 s among ~30 ms steps for the large real job's
    // 1 MiB probe at 50 Mbit/s), and the next step's messages meet the shaper's bucket the probe
    // drained. Neither is what the plan costs (the probe's cost is the share's): no record, no
    // model error, and no place in recent_change()'s mean (where one such stall read as the plan
    // in force's time following a link fit's restart, x3, and voided the records).
    if (!ran.dense && probe_crossed(o, w, format)) probe_quiet_until_ = o.step + 1;
    if (probe_quiet_until_ > 0 && o.step <= probe_quiet_until_) return;
    // v16: what a ring step's bytes took, the ring's own word (probe_floor()), record or none;
    // the least of its steps since a probe (a floor: one slow step is no rate). After the large
    // real job's 6-step warm-up two ring steps were recorded (52 ms a step at 1 Gbit/s), too few
    // to price the ring, and a fit of the sparse plan's messages restarted at 271 MB/s: the ring
    // modelled at 27 ms was tried, and measured 52-59 ms.
    if (ran.dense && !by_trainers) {
      const uint64_t bytes = step_dense_bytes(o.tensors, w);
      const double link = measured - compute() - ring_cost() * static_cast<double>(o.elements);
      if (bytes > 0 && link > 0) {
        const double per_byte = link / static_cast<double>(bytes);
        ring_per_byte_ = ring_per_byte_ > 0 ? std::min(ring_per_byte_, per_byte) : per_byte;
      }
    }
    Record& r = record_of(ran);
    // The last steps' times and the record before them: what recent_change() compares.
    if (recent_.size() > kChangeConfirmSteps) recent_.erase(recent_.begin());
    recent_.push_back({measured, r.seconds});
    if (r.steps >= kRecordTrusted) {
      const double ratio = measured / r.seconds;
      const int side = ratio > 2 ? 1 : ratio < 0.5 ? -1 : 0;
      const bool far = ran.dense && (ratio >= kFarOff || ratio <= 1 / kFarOff);
      if (side != 0 && side == r.off_side) {
        ++r.off_steps;
        r.far_steps = far ? r.far_steps + 1 : 0;
        r.off_sum_log += std::log(measured);
      } else {
        r.off_side = side;
        r.off_steps = side != 0 ? 1 : 0;
        r.far_steps = side != 0 && far ? 1 : 0;
        r.off_sum_log = side != 0 ? std::log(measured) : 0;
      }
      if (r.off_steps >= kChangeConfirmSteps || r.far_steps >= kFarConfirmSteps) {
        // The plan in force runs 2x off its record, steps in a row (the ring 4x, fewer): the link
        // changed rate.
        const double off_seconds = std::exp(r.off_sum_log / static_cast<double>(r.off_steps));
        const bool by_far = r.off_steps < kChangeConfirmSteps;
        r.off_side = 0;
        r.off_steps = 0;
        r.far_steps = 0;
        if (host_load_moved(side)) return;  // the host, not the link: outliers, the record stays
        const double moved = off_seconds / r.seconds;
        r.seconds = off_seconds;
        if (side > 0 && ran.same(running())) slowed_at_ = o.step;
        void_records_but(ran, o.step, moved,
                         side > 0 ? (by_far ? "the ring got 4x slower" : "the plan in force got 2x slower")
                                  : (by_far ? "the ring got 4x faster" : "the plan in force got 2x faster"));
        return;
      }
      if (side != 0) return;  // an outlier until it persists
    }
    r.seconds = smooth_log(r.seconds, measured, r.steps == 0 ? 1.0 : kRecordSmoothing);
    ++r.steps;
    note_ring_peers(r);
    ModelError& e = ran.dense ? ring_error_ : sparse_error_;
    const double miss = measured - model_seconds(ran, w, format);
    e.seconds = e.steps == 0 ? miss : 0.7 * e.seconds + 0.3 * miss;
    ++e.steps;
  }

  // The trainer's compute over the last kChangeConfirmSteps steps moved by kFollowed or more to
  // `side` (+1 slower, -1 faster) against the steps before them: the host's load changed.
  bool host_load_moved(int side) const {
    if (computes_.size() < 2 * kChangeConfirmSteps) return false;
    const auto split = computes_.end() - static_cast<std::ptrdiff_t>(kChangeConfirmSteps);
    const double moved = std::log(median({split, computes_.end()}) / median({computes_.begin(), split}));
    return moved * side >= std::log(kFollowed);
  }

  // log(mean of the last kChangeConfirmSteps measured times / the record before them) of the plan
  // that ran last; 0 until there are that many.
  double recent_change() const {
    if (recent_.size() <= kChangeConfirmSteps || !(recent_[1].record > 0)) return 0;
    double sum = 0;
    for (size_t i = 1; i < recent_.size(); ++i) sum += recent_[i].measured;
    return std::log(sum / static_cast<double>(recent_.size() - 1) / recent_[1].record);
  }

  Record& record_of(const Plan& p) {
    for (Record& r : records_) {
      if (r.plan.same(p)) return r;
    }
    records_.push_back({p, 0, 0, 0, 0, 0});
    return records_.back();
  }

  const Record* trusted_record(const Plan& p) const {
    for (const Record& r : records_) {
      if (r.plan.same(p) && r.steps >= kRecordTrusted) return &r;
    }
    return nullptr;
  }

  // A link changed rate: what the other plans measured is stale, and so is the model's error.
  // v13: `moved` is the plan in force's time after / before the change. A link that got slower
  // makes no ring faster than it measured before, times the plan in force's slowdown (a ring is
  // at least as bound to the link as a sparse step): that floors the ring's price until it is
  // measured again or the link gets faster. Behind a shaper's burst the model's ring barely moves
  // with the rate (a real small job's `down`: 9.1 ms modelled at 50 Mbit/s, 65.7 ms measured).
  void void_records_but(const Plan& keep, uint64_t step, double moved, const char* why) {
    const Record* ring = trusted_record({true, 1.0});
    if (keep.dense || !(moved > 1)) {
      ring_floor_ = 0;
    } else {
      // v20: since the ring ran the plan in force may have slowed before this change, too (its
      // record already holds the change where the plan's own steps showed it: no product).
      ring_floor_ = ring != nullptr ? ring->seconds * std::max(moved, ring_slowdown()) : ring_floor_ * moved;
    }
    if (moved < 1) ring_per_byte_ = 0;  // v16: a faster link: what the ring met before is no floor
    std::erase_if(records_, [&](const Record& r) { return !r.plan.same(keep); });
    ring_peers_.clear();  // the ring's record or every sparse one went with the others
    ring_probed_ = 0;
    clear_probe_refs(/*ring_ran=*/false);
    explore_ = true;
    kept_ = 0;
    sparse_error_ = ring_error_ = {};
    voided_ = std::string("records voided at step ") + std::to_string(step) + ": " + why;
  }

  double encode_cost() const {
    return encode_ > 0 ? encode_ : on_device_ ? kPriorDeviceEncodePerElement : kPriorEncodePerElement;
  }
  double decode_cost() const { return decode_ > 0 ? decode_ : kPriorDecodePerEntry; }
  double ring_cost() const { return ring_ > 0 ? ring_ : kPriorRingPerElement; }
  double compute() const { return compute_s_ > 0 ? compute_s_ : 0; }
  // v22: `ring` (the last candidate) lost to the sparse plan in force `in` by less than
  // kRingRetryWithin on a record of its first steps only; once a job.
  bool ring_worth_retrying(const Candidate& ring, const Candidate& in) const {
    return !retried_ && ring.plan.dense && ring.measured && lost_on_first_steps(ring, in);
  }
  // v22, v23: `loser`'s record holds its first steps only (fewer than kRingRetrySteps) and
  // `winner` beats its price by less than kRingRetryWithin: that record may yet say otherwise.
  bool lost_on_first_steps(const Candidate& loser, const Candidate& winner) const {
    const Record* r = trusted_record(loser.plan);
    return r != nullptr && r->steps < kRingRetrySteps && loser.price > winner.price &&
           loser.price <= winner.price * kRingRetryWithin;
  }

  // v23: the sparse plan in force `in` is measured on fewer than kRingRetrySteps steps, and the
  // ring beats its price by less than kRingRetryWithin.
  bool sparse_record_young(const Candidate& in, const Candidate& ring) const {
    return !in.plan.dense && in.measured && lost_on_first_steps(in, ring);
  }

  // The dense steps a sparse one is worth in this job (v21: corrected by the trainer's hook or not).
  double worth(const ControllerSettings& s) const {
    return sparse_step_worth(s.step.dense_worth, s.step.dense_worth_corrected, corrected_);
  }

  // The model's step time for a plan (the trainer's compute included; the model's error not).
  double model_seconds(const Plan& p, uint32_t w, kernels::Format format) const {
    double t = compute();
    for (const auto& x : tensors_) {
      if (p.dense) {
        const uint64_t chunk = kWireHeaderBytes + 4 * ((x.elements + w - 1) / w);
        t += ring_cost() * static_cast<double>(x.elements) + 2.0 * (w - 1) * link_time(chunk);
      } else {
        const uint64_t k = topk_count(x.elements, p.density);
        const uint64_t message = sparse_allgather_bytes_as(x.elements, k, 2, format);  // one copy
        t += encode_cost() * static_cast<double>(x.elements) + link_time(message) +
             decode_cost() * static_cast<double>(w - 1) * static_cast<double>(k);
      }
    }
    return t;
  }

  // v13: the ratio of the ring's record to its model (both less the trainer's compute), taken
  // while both stand for the same link: a trusted record and no link fit change for
  // kChangeConfirmSteps steps (a restart may be a rate change whose void comes later).
  void learn_ring_ratio(const ControllerSettings& s, uint64_t step, kernels::Format format) {
    if (!any_link_known() || restart_.pending) return;
    if (link_changes() > 0 && step <= last_link_change_step_ + kChangeConfirmSteps) return;
    const Record* r = trusted_record({true, 1.0});
    if (r == nullptr) return;
    const double modelled = model_seconds({true, 1.0}, s.world_size, format) - compute();
    if (modelled > 0) ring_ratio_ = std::max(r->seconds - compute(), 0.0) / modelled;
  }

  Candidate candidate(const Plan& p, uint32_t w, kernels::Format format, const ControllerSettings& s) const {
    Candidate c{p, 0, false, 0};
    if (const Record* r = trusted_record(p)) {
      c.seconds = r->seconds * (p.dense ? ring_slowdown() : 1.0);  // v20
      c.measured = true;
    } else if (p.dense && ring_probed_ > 0) {  // v14
      c.seconds = ring_probed_;
    } else if (p.dense && ring_ratio_ >= 0) {
      c.seconds = compute() + ring_ratio_ * std::max(model_seconds(p, w, format) - compute(), 0.0);
    } else {
      const double m = model_seconds(p, w, format);
      c.seconds = std::max(m + (p.dense ? ring_error_ : sparse_error_).seconds, 0.5 * m);
      if (!p.dense) c.seconds = std::max(c.seconds, bound_from_records(p.density));
    }
    if (!c.measured && p.dense) c.seconds = std::max({c.seconds, ring_floor_, probe_floor(w)});  // v13, v15
    c.seconds += overhead_;
    c.price = c.seconds * (p.dense ? 1.0 : worth(s));
    return c;
  }

  // v20: the sparse plan in force's record now over its record as the ring last measured (>= 1;
  // 1 where the ring runs or either is unknown).
  double ring_slowdown() const {
    const Plan& in = running();
    const Record* now = in.dense ? nullptr : trusted_record(in);
    if (now == nullptr) return 1;
    for (const Record& then : ring_peers_) {
      if (then.plan.same(in) && then.seconds > 0) return std::max(1.0, now->seconds / then.seconds);
    }
    return 1;
  }

  // v20: what the sparse records held as the ring's record was last updated; a sparse record
  // trusted only later (the ring ran first) joins with its first trusted time.
  void note_ring_peers(const Record& updated) {
    if (updated.plan.dense) {
      ring_peers_.clear();
      for (const Record& r : records_) {
        if (!r.plan.dense && r.steps >= kRecordTrusted) ring_peers_.push_back(r);
      }
      return;
    }
    if (updated.steps != kRecordTrusted || trusted_record({true, 1.0}) == nullptr) return;
    for (const Record& then : ring_peers_) {
      if (then.plan.same(updated.plan)) return;
    }
    ring_peers_.push_back(updated);
  }

  // v15: no ring costs less than its bytes to a successor take at the last probe's rate on the
  // slowest link, plus the trainer's compute and the ring's work per element (0: no probe since
  // the ring ran). A void keeps it: after one, a fit of a sparse plan's few-KB messages (behind
  // a shaper's burst they cross at line rate) prices the ring's chunks as nearly free, and the
  // large real job's ring, priced so at 31 ms after a drop to 50 Mbit/s, measured 1.32 s, where
  // its last probe had crossed at 50 Mbit/s. A slower probe (a loaded host) keeps the ring out
  // until the next one; a rise lowers it with the probe that shows it (watch_probes).
  // v16: or, where the ring ran since the last probe, the rate its quickest step met.
  double probe_floor(uint32_t w) const {
    double per_byte = ring_per_byte_;
    for (const Link& l : links_) per_byte = std::max(per_byte, l.probe_last);
    if (!(per_byte > 0) || tensors_.empty()) return 0;
    double elements = 0;
    for (const auto& t : tensors_) elements += static_cast<double>(t.elements);
    return compute() + ring_cost() * elements + per_byte * static_cast<double>(step_dense_bytes(tensors_, w));
  }

  // What the measured sparse plans say of an unmeasured density: a denser plan sends more and
  // selects, encodes and decodes as much or more, so it is at least as slow as the nearest sparser
  // plan measured, and between two measured plans at least the straight line between them (time
  // is affine in bytes on a plain link and convex behind a shaper's burst, whose small messages
  // cross at line rate; a linear fit made from those says larger ones are nearly free).
  double bound_from_records(double density) const {
    const Record* lo = nullptr;
    const Record* hi = nullptr;
    for (const Record& r : records_) {
      if (r.plan.dense || r.steps < kRecordTrusted) continue;
      if (r.plan.density < density && (lo == nullptr || r.plan.density > lo->plan.density)) lo = &r;
      if (r.plan.density > density && (hi == nullptr || r.plan.density < hi->plan.density)) hi = &r;
    }
    if (lo == nullptr) return 0;
    if (hi == nullptr) return lo->seconds;
    const double f = (density - lo->plan.density) / (hi->plan.density - lo->plan.density);
    return std::max(lo->seconds, lo->seconds + f * (hi->seconds - lo->seconds));
  }

  static std::string plan_name(const Plan& p) {
    if (p.dense) return "dense ring";
    char buf[48];
    std::snprintf(buf, sizeof buf, "density %.3g", p.density);
    return buf;
  }

  Status hold(const ControlContext& ctx, const std::string& why) {
    ctx.status->step_model = std::string("holds: ") + why;
    return Status::Ok();
  }

  void describe(const ControlContext& ctx, const Candidate& now, double cheapest, const Candidate& best,
                double dense_worth) const {
    double alpha = 0, beta = 0;
    for (const Link& l : links_) {
      if (!l.fit.known()) continue;
      alpha = std::max(alpha, l.fit.alpha());
      beta = std::max(beta, l.fit.beta());
    }
    std::string measured;
    for (const Record& r : records_) {
      if (r.steps < kRecordTrusted) continue;
      char buf[80];
      std::snprintf(buf, sizeof buf, "%s%s %.3g ms", measured.empty() ? "" : ", ", plan_name(r.plan).c_str(),
                    r.seconds * 1e3);
      measured += buf;
    }
    char ratio[320] = "";  // v13, v14, v15: what prices a ring without a record; the last probe
    int at = 0;
    if (ring_ratio_ >= 0) at = std::snprintf(ratio, sizeof ratio, "; the ring %.3gx its model", ring_ratio_);
    if (ring_floor_ > 0) {
      at += std::snprintf(ratio + at, sizeof ratio - static_cast<size_t>(at), "%s >= %.3g ms", at > 0 ? "," : "; the ring",
                          ring_floor_ * 1e3);
    }
    if (ring_probed_ > 0 && at < static_cast<int>(sizeof ratio)) {
      at += std::snprintf(ratio + at, sizeof ratio - static_cast<size_t>(at), "; the ring %.3g ms by the link probe",
                          ring_probed_ * 1e3);
    }
    if (const double floor = probe_floor(ctx.settings.world_size); floor > 0 && at < static_cast<int>(sizeof ratio)) {
      at += std::snprintf(ratio + at, sizeof ratio - static_cast<size_t>(at), "; the ring >= %.3g ms by %s",
                          floor * 1e3, ring_per_byte_ > 0 ? "its own steps" : "the last probe");
    }
    if (last_probe_.of_price > 0 && at < static_cast<int>(sizeof ratio)) {
      std::snprintf(ratio + at, sizeof ratio - static_cast<size_t>(at), "; the probe of step %llu %.3gx the ring's price",
                    static_cast<unsigned long long>(last_probe_.step), last_probe_.of_price);
    }
    char buf[896];
    std::snprintf(buf, sizeof buf,
                  "links: alpha %.3g ms, %.4g MB/s (slowest of %zu, %llu rate changes); per element: encode "
                  "%.3g ns%s, ring %.3g ns%s; decode %.3g ns/entry%s; trainer %.3g ms, overhead %.3g ms%s; measured: %s; "
                  "sparse steps worth 1/%.3g; in force %s (%.3g ms/step%s); best %s (%.3g ms%s, price %.3g ms, "
                  "cheapest %.3g ms)",
                  alpha * 1e3, beta > 0 ? 1e-6 / beta : 0.0, links_.size(), static_cast<unsigned long long>(link_changes()),
                  encode_cost() * 1e9, encode_ > 0 ? "" : " (prior)", ring_cost() * 1e9, ring_ > 0 ? "" : " (prior)",
                  decode_cost() * 1e9, decode_ > 0 ? "" : " (prior)", compute() * 1e3, overhead_ * 1e3, ratio,
                  measured.empty() ? "nothing yet" : measured.c_str(), std::max(dense_worth, 1.0),
                  decided_ ? plan_name(now.plan).c_str() : "as asked", now.seconds * 1e3, now.measured ? "" : ", modelled",
                  plan_name(best.plan).c_str(), best.seconds * 1e3, best.measured ? "" : ", modelled", best.price * 1e3,
                  cheapest * 1e3);
    ctx.status->step_model = buf;
    ctx.status->predicted_step_s = now.seconds;
    ctx.status->predicted_exchange_s = std::max(0.0, now.seconds - compute() - overhead_);
  }

  std::vector<Link> links_;
  std::vector<TensorStepObservation> tensors_;
  std::vector<Record> records_;
  std::string voided_;  // when and why records were last voided (for the decision notes)
  bool has_ran_ = false;
  bool corrected_ = false;  // v21: the trainer's hook corrects momentum (StartHint)
  Plan last_ran_;       // the plan the last observed step ran
  struct Recent {
    double measured = 0;  // a step's time
    double record = 0;    // its plan's record before it
  };
  std::vector<Recent> recent_;  // the last kChangeConfirmSteps + 1 recorded steps of last_ran_
  struct Trial {
    bool on = false;
    uint64_t step = 0;  // of the move
    Plan left;          // the measured plan it left
  } trial_;
  struct Restart {
    bool pending = false;
    uint64_t step = 0;           // when a link fit restarted
    double modelled_before = 0;  // the plan in force's modelled time before it
  } restart_;
  // Smoothed measured - modelled step time of the sparse plans / the ring that ran: what the
  // model misses on that path (a peer's wait, an overhead of the ring), charged to its unrun plans.
  struct ModelError {
    double seconds = 0;
    uint64_t steps = 0;
  };
  ModelError sparse_error_, ring_error_;
  double encode_ = 0, decode_ = 0, ring_ = 0;  // seconds per element / entry; 0: not measured
  bool on_device_ = false;  // every node compresses every tensor on a GPU (the encode prior's)
  double compute_s_ = 0;
  double ring_ratio_ = -1;  // v13: the ring's record / its model, less compute; < 0: not known
  double ring_floor_ = 0;   // v13: no voided ring costs less after the link got slower
  double ring_per_byte_ = 0;  // v16: seconds per byte of the ring's quickest step since a probe (probe_floor)
  double ring_probed_ = 0;  // v14: the ring's step time as the link probe scaled it (0: none)
  // The last probe sample seen: its step and its time per byte over what the ring's price then held
  // (what describe() says, for the operator and the debug log; a rise needs 0.5x or less of that,
  // or of the fastest probe since the ring's price was set: watch_probes).
  struct {
    uint64_t step = 0;
    double of_price = 0;
  } last_probe_;
  std::vector<Record> ring_peers_;  // v20: the sparse records as the ring was last measured
  uint64_t last_link_change_step_ = 0;
  uint64_t slowed_at_ = 0;  // v17: the step the plan in force's own steps voided the records, slower
  uint64_t probe_quiet_until_ = 0;  // v15: the last step a link probe's crossing keeps out of the records
  std::vector<double> computes_;  // the trainer's compute time of the last steps (host_load_moved)
  double overhead_ = 0;      // median period_s - (compute + encode + exchange): what every step pays
  std::vector<double> gaps_;  // the last kOverheadSteps of those differences
  bool decided_ = false;
  bool probed_ = false, probing_ = false;
  bool answer_now_ = false;  // the next decision needs no hold (after the start-up one)
  bool explore_ = true;      // a move up to a denser sparse plan is allowed (reset by a rate change)
  uint64_t kept_ = 0;        // after the warm-up: measured observations in a row that want no move
  uint64_t retry_at_ = 0;    // v22: the step the ring is measured again (0: not planned)
  bool retried_ = false;     // v22: it was, this job
  struct {
    bool on = false;
    uint64_t at = 0;         // the warm-up's new end (a step number)
  } cut_;
  std::string warmup_seen_;  // what the warm-up cut weighed last (for the status)
  Plan in_force_;
  int want_ = 0;
  uint64_t wanted_ = 0;
  uint64_t last_decision_step_ = 0;
};

}  // namespace

std::unique_ptr<Controller> make_step_controller() { return std::make_unique<StepController>(); }

}  // namespace sparsecar::policies
