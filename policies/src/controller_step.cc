// The step controller: prices every candidate plan as the time it adds to a step, from a
// model of the whole step measured online, and keeps the densest plan that costs at most
// `step_slack` more than the cheapest. Its row: controllers.cc.
//
// The model, all of it measured on the job's own steps:
//   - the links: one LinkFit (link_model.h) per pair of nodes, t = alpha + beta * bytes, from
//     the receivers' timing of every message (JobObservation::link_samples);
//   - this job's compute costs per node (the slowest node's, smoothed): sparse steps cost
//     encode (EF + select + encode) per element and decode per entry received; the dense ring
//     costs EF + copy + reduce per element. Until a kind of step has run, a prior stands in
//     (said in the status);
//   - the trainer's compute time per step (`compute_time` metric), which every plan pays.
// Candidates: sparse at the density asked for (the quality floor: the operator's, or what the
// accuracy controller made of it) and at 2x, 4x, ... that, up to density_max and 0.5; the dense
// ring. Price = compute + Σ over tensors of (compute costs + link time of its messages): a
// sparse all-gather sends one message per peer of the encoded selection, the ring 2(W-1) chunks.
// Denser is never worse for the model, so among the plans within `step_slack` of the cheapest
// the densest wins.
//
// Start-up probe: until some link has shown two message sizes (a one-bucket job sends one),
// alpha and beta cannot be told apart, so the first decision runs 4x the density asked for (at
// most kProbeSteps steps); the decision after it is not held back.
//
// No flip-flops: a plan that proved too slow in force (and anything denser) is not chosen again
// until a link gets faster (a shaper's burst makes small messages predict large ones badly); the
// plan in force is kept while its price stays within 3 x slack of the cheapest; a move down (it
// is too slow) or up (a plan at least 4x denser, or the dense ring, fits the slack) needs `step_confirm_steps` consecutive observations that want it, and
// `step_hold_steps` steps since the last decision. A link rate change moves the fits at once
// (LinkFit restarts after 3 steps off by 2x), so it gives one decision, or two when the first
// plan's own samples correct the fit (e.g. the dense ring's large messages meet a rate that
// small messages, served from a shaper's burst, hid).
#include "controller_internal.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "sparsecar/policies/link_model.h"

namespace sparsecar::policies {
namespace {

// Priors for a kind of step not yet seen (seconds per element / per entry): a pass of a few
// arithmetic operations per element on one core. Replaced by the measurement once it runs.
constexpr double kPriorEncodePerElement = 10e-9;
constexpr double kPriorDecodePerEntry = 5e-9;
constexpr double kPriorRingPerElement = 2e-9;
constexpr double kCostSmoothing = 0.2;  // EMA weight of a new compute-cost sample (log domain)
constexpr uint64_t kProbeSteps = 20;    // the start-up probe's longest run
// Steps in a row off the link fit by 2x that make a rate change: 3, so that the scheduling noise
// of a loaded host on small messages (two slow steps) restarts no fit.
constexpr uint64_t kChangeConfirmSteps = 3;

double smooth_log(double mean, double sample, double alpha) {
  if (!(mean > 0)) return sample;
  return std::exp(alpha * std::log(sample) + (1 - alpha) * std::log(mean));
}

struct Candidate {
  bool dense = false;
  double density = 1.0;
  double price = 0;  // seconds per step, compute included
};

class StepController final : public Controller {
 public:
  ControllerKind kind() const override { return ControllerKind::kStep; }
  uint32_t version() const override { return 1; }

  Status update(const ControlContext& ctx, ControlKnobs* knobs) override {
    const auto& s = ctx.settings;
    const auto& o = ctx.obs;
    const uint32_t w = s.world_size;
    feed_links(o, s.step.forget);
    observe_compute(o, w);
    if (o.compute_s > 0) compute_s_ = smooth_log(compute_s_, o.compute_s, kCostSmoothing);
    const double q = clamp_density(knobs->density, s);
    if (w < 2 || o.tensors.empty()) return hold(ctx, "one node or no tensors: nothing to price");
    if (!knobs->compression) return hold(ctx, "compression is off: the operator chose the dense ring");
    if (knobs->selector == kernels::Selector::kThreshold) {
      return hold(ctx, "the hard threshold's volume is the budget controller's: use top-k");
    }
    if (!any_link_known()) return hold(ctx, "no link samples yet");
    tensors_.assign(o.tensors.begin(), o.tensors.end());

    // Candidates, sparse ones ascending in density, then the ring.
    std::vector<Candidate> c;
    const double top = std::min(s.density_max, 0.5);
    // A ceiling set when a plan proved too slow in force keeps it (and anything denser) out until
    // a link gets faster: the fits are linear, a shaper is not (its burst serves small messages
    // faster than its rate), so what the small messages predict for a plan already tried loses
    // against what it measured.
    const uint64_t changes = total_link_changes();
    if (o.step <= last_decision_step_ + 2 * s.step.hold_steps) {
      ceiling_changes_ = changes;  // the fits settling on the new plan's sizes: not a rate change
    } else if (changes > ceiling_changes_) {
      ceiling_ = 2.0;
    }
    for (double d = q; d <= top * (1 + 1e-9) && c.size() < 24; d *= 2) {
      if (d >= ceiling_ && !c.empty()) break;
      c.push_back({false, d, price_sparse(d, w, knobs->format)});
    }
    if (s.step.allow_dense && ceiling_ > 1.0) c.push_back({true, 1.0, price_dense(w)});
    if (c.empty()) return hold(ctx, "no candidate plan");
    double cheapest = c.front().price;
    for (const Candidate& x : c) cheapest = std::min(cheapest, x.price);
    Candidate best = c.front();
    for (const Candidate& x : c) {
      if (x.price <= cheapest * (1 + s.step.slack)) best = x;  // the densest within the slack
    }

    // Start-up probe: while no link has shown two message sizes, alpha and beta cannot be told
    // apart (a one-bucket job sends one size), so a plan 4x denser runs until one does (at most
    // kProbeSteps steps); the decision after it is made without waiting for the hold.
    if (!probed_ && !any_link_separated() && 4 * q <= top * (1 + 1e-9)) {
      probed_ = probing_ = decided_ = true;
      dense_ = false;
      density_ = 4 * q;
      last_decision_step_ = o.step;
      ctx.status->step_model = "probing a second message size: density " + plan_name(true, false, density_).substr(8);
      knobs->density = density_;
      return Status::Ok();
    }
    if (probing_) {
      if (!any_link_separated() && o.step < last_decision_step_ + kProbeSteps) {
        ctx.status->step_model = "probing a second message size: density " + plan_name(true, false, density_).substr(8);
        knobs->density = std::max(density_, q);
        return Status::Ok();
      }
      probing_ = false;
      probe_ended_ = true;
    }

    // The plan in force: this controller's last decision, else what the chain asked for.
    if (decided_ && !dense_) density_ = std::max(density_, q);  // the floor moved up under it
    const bool in_dense = decided_ ? dense_ : false;
    const double in_density = decided_ ? density_ : q;
    const double in_price = in_dense ? price_dense(w) : price_sparse(in_density, w, knobs->format);
    const bool too_slow = in_price > cheapest * (1 + 3 * s.step.slack);
    const bool room = !in_dense && (best.dense || best.density >= 4 * in_density);
    const int want = too_slow ? -1 : room ? 1 : 0;
    if (want != 0 && want == want_) {
      ++wanted_;
    } else {
      want_ = want;
      wanted_ = want != 0 ? 1 : 0;
    }
    const bool may = !decided_ || probe_ended_ || o.step >= last_decision_step_ + s.step.hold_steps;
    if (want_ != 0 && wanted_ >= std::max<uint64_t>(s.step.confirm_steps, 1) && may) {
      if (want_ < 0) {
        ceiling_ = in_dense ? 1.0 : in_density;  // proved too slow: not again before a faster link
        ceiling_changes_ = changes;
      }
      decided_ = true;
      dense_ = best.dense;
      density_ = best.dense ? in_density : best.density;
      last_decision_step_ = o.step;
      want_ = 0;
      wanted_ = 0;
      probe_ended_ = false;
    }
    const double now_price = !decided_ ? in_price : dense_ ? price_dense(w) : price_sparse(density_, w, knobs->format);
    describe(ctx, now_price, cheapest, best);
    if (decided_) {
      knobs->compression = !dense_;
      if (!dense_) knobs->density = density_;
    }
    return Status::Ok();
  }

 private:
  void feed_links(const JobObservation& o, double forget) {
    std::map<std::pair<uint32_t, uint32_t>, std::vector<LinkFit::Sample>> batches;
    for (const LinkPairSample& l : o.link_samples) batches[{l.from, l.to}].push_back({l.bytes, l.seconds});
    for (auto& [pair, batch] : batches) links_[pair].add_step(batch, forget, kChangeConfirmSteps);
  }

  // Rate changes after which a link got faster: what may make a plan that proved too slow cheap.
  uint64_t total_link_changes() const {
    uint64_t n = 0;
    for (const auto& [pair, fit] : links_) n += fit.faster_changes();
    return n;
  }

  bool any_link_separated() const {
    for (const auto& [pair, fit] : links_) {
      if (fit.separated()) return true;
    }
    return false;
  }

  bool any_link_known() const {
    for (const auto& [pair, fit] : links_) {
      if (fit.known()) return true;
    }
    return false;
  }

  // The slowest known link's time for a message of `bytes`.
  double link_time(uint64_t bytes) const {
    double t = 0;
    for (const auto& [pair, fit] : links_) {
      if (fit.known()) t = std::max(t, fit.predict(bytes));
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
    } else if (all_dense) {
      const double ring = o.encode_s + o.decode_s + o.reduce_s;
      if (ring > 0) ring_ = smooth_log(ring_, ring / n, kCostSmoothing);
    }
  }

  double encode_cost() const { return encode_ > 0 ? encode_ : kPriorEncodePerElement; }
  double decode_cost() const { return decode_ > 0 ? decode_ : kPriorDecodePerEntry; }
  double ring_cost() const { return ring_ > 0 ? ring_ : kPriorRingPerElement; }
  double compute() const { return compute_s_ > 0 ? compute_s_ : 0; }

  double price_sparse(double density, uint32_t w, kernels::Format format) const {
    double t = compute();
    for (const auto& x : tensors_) {
      const uint64_t k = topk_count(x.elements, density);
      const uint64_t message = sparse_allgather_bytes_as(x.elements, k, 2, format);  // one copy
      t += encode_cost() * static_cast<double>(x.elements) + link_time(message) +
           decode_cost() * static_cast<double>(w - 1) * static_cast<double>(k);
    }
    return t;
  }

  double price_dense(uint32_t w) const {
    double t = compute();
    for (const auto& x : tensors_) {
      const uint64_t chunk = kWireHeaderBytes + 4 * ((x.elements + w - 1) / w);
      t += ring_cost() * static_cast<double>(x.elements) + 2.0 * (w - 1) * link_time(chunk);
    }
    return t;
  }

  static std::string plan_name(bool decided, bool dense, double density) {
    if (!decided) return "as asked";
    if (dense) return "dense ring";
    char buf[48];
    std::snprintf(buf, sizeof buf, "density %.3g", density);
    return buf;
  }

  Status hold(const ControlContext& ctx, const char* why) {
    ctx.status->step_model = std::string("holds: ") + why;
    return Status::Ok();
  }

  void describe(const ControlContext& ctx, double now_price, double cheapest, const Candidate& best) const {
    double alpha = 0, beta = 0;
    uint64_t changes = 0;
    for (const auto& [pair, fit] : links_) {
      if (!fit.known()) continue;
      alpha = std::max(alpha, fit.alpha());
      beta = std::max(beta, fit.beta());
      changes += fit.changes();
    }
    char buf[512];
    std::snprintf(buf, sizeof buf,
                  "links: alpha %.3g ms, %.4g MB/s (slowest of %zu, %llu rate changes); per element: encode "
                  "%.3g ns%s, ring %.3g ns%s; decode %.3g ns/entry%s; trainer %.3g ms; in force %s (%.3g ms/step); "
                  "best %s (%.3g ms, cheapest %.3g ms)",
                  alpha * 1e3, beta > 0 ? 1e-6 / beta : 0.0, links_.size(), static_cast<unsigned long long>(changes),
                  encode_cost() * 1e9, encode_ > 0 ? "" : " (prior)", ring_cost() * 1e9, ring_ > 0 ? "" : " (prior)",
                  decode_cost() * 1e9, decode_ > 0 ? "" : " (prior)", compute() * 1e3,
                  plan_name(decided_, dense_, density_).c_str(), now_price * 1e3,
                  plan_name(true, best.dense, best.density).c_str(),
                  best.price * 1e3, cheapest * 1e3);
    ctx.status->step_model = buf;
    ctx.status->predicted_step_s = now_price;
    ctx.status->predicted_exchange_s = std::max(0.0, now_price - compute());
  }

  std::map<std::pair<uint32_t, uint32_t>, LinkFit> links_;  // (from, to) -> fit
  std::vector<TensorStepObservation> tensors_;
  double encode_ = 0, decode_ = 0, ring_ = 0;  // seconds per element / entry; 0: not measured
  double compute_s_ = 0;
  bool decided_ = false;
  bool probed_ = false, probing_ = false, probe_ended_ = false;
  bool dense_ = false;
  double density_ = 0;
  int want_ = 0;
  uint64_t wanted_ = 0;
  double ceiling_ = 2.0;  // plans of this density or more (dense: 1) are out; > 1: none
  uint64_t ceiling_changes_ = 0;
  uint64_t last_decision_step_ = 0;
};

}  // namespace

std::unique_ptr<Controller> make_step_controller() { return std::make_unique<StepController>(); }

}  // namespace sparsecar::policies
