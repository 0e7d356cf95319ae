#include "sparsecar/policies/controllers.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <deque>
#include <iterator>
#include <limits>
#include <map>

#include "sparsecar/kernels/codec.h"

namespace sparsecar::policies {
namespace {

double clamp_density(double d, const ControllerSettings& s) {
  return std::clamp(d, std::min(s.density_min, s.density_max), s.density_max);
}

uint64_t topk_count(uint64_t n, double density) {
  if (n == 0) return 0;
  const double k = std::round(density * static_cast<double>(n));
  return std::clamp<uint64_t>(k < 1 ? 1 : static_cast<uint64_t>(k), 1, n);
}

// 3 significant digits, rounded down: proposals stay readable and do not creep.
double round_down3(double v) {
  if (!(v > 0) || !std::isfinite(v)) return v;
  const double p = std::pow(10.0, std::floor(std::log10(v)) - 2);
  return std::floor(v / p) * p;
}

double rel_diff(double a, double b) {
  const double m = std::max(std::fabs(a), std::fabs(b));
  return m == 0 ? 0 : std::fabs(a - b) / m;
}

std::string fmt(const char* f, double a, double b = 0, double c = 0) {
  char buf[160];
  std::snprintf(buf, sizeof buf, f, a, b, c);
  return buf;
}

// ---- accuracy ---------------------------------------------------------------------------------
class AccuracyController final : public Controller {
 public:
  ControllerKind kind() const override { return ControllerKind::kAccuracy; }
  uint32_t version() const override { return 1; }
  Status update(const ControlContext& ctx, ControlKnobs* knobs) override {
    const auto& s = ctx.settings;
    const auto& o = ctx.obs;
    if (o.has_loss && std::isfinite(o.loss)) {
      double target = 0;
      bool has_target = false;
      if (o.has_loss_target && std::isfinite(o.loss_target)) {
        target = o.loss_target;
        has_target = true;
      } else if (s.schedule_warmup_steps > 0) {
        if (o.step < s.schedule_warmup_steps) {
          warm_.emplace_back(static_cast<double>(o.step), o.loss);
        } else {
          fit_trend();
          if (fitted_) {
            target = a_ + b_ / (static_cast<double>(o.step) + 1.0);
            has_target = true;
          }
        }
      }
      if (has_target) {
        const double gap = (o.loss - target) / std::max(std::fabs(target), 1e-12);
        gap_ = has_gap_ ? s.accuracy_alpha * gap + (1 - s.accuracy_alpha) * gap_ : gap;
        has_gap_ = true;
        ctx.status->accuracy_gap = gap_;
        ctx.status->accuracy_target = target;
        if (!moved_ || o.step >= last_move_ + s.accuracy_hold_steps) {
          double next = multiplier_;
          if (gap_ > s.accuracy_tolerance) {
            next *= s.accuracy_backoff;
          } else if (gap_ < s.accuracy_tolerance / 2) {
            next *= s.accuracy_tighten;
          }
          // Bounds: the density this multiplier gives stays within [density_min, density_max].
          const double d0 = std::max(ctx.base.density, 1e-12);
          next = std::clamp(next, s.density_min / d0, s.density_max / d0);
          if (next != multiplier_) {
            multiplier_ = next;
            moved_ = true;
            last_move_ = o.step;
          }
        }
      }
    }
    knobs->density = clamp_density(knobs->density * multiplier_, s);
    knobs->threshold /= multiplier_;
    return Status::Ok();
  }

 private:
  // Least squares of loss = a + b / (t + 1) over the dense warm-up.
  void fit_trend() {
    if (fitted_ || warm_.size() < 3) return;
    double sx = 0, sy = 0, sxx = 0, sxy = 0;
    const double n = static_cast<double>(warm_.size());
    for (auto [t, y] : warm_) {
      const double x = 1.0 / (t + 1.0);
      sx += x;
      sy += y;
      sxx += x * x;
      sxy += x * y;
    }
    const double den = n * sxx - sx * sx;
    if (std::fabs(den) < 1e-300) return;
    b_ = (n * sxy - sx * sy) / den;
    a_ = (sy - b_ * sx) / n;
    fitted_ = std::isfinite(a_) && std::isfinite(b_);
  }

  double multiplier_ = 1.0;
  double gap_ = 0;
  bool has_gap_ = false;
  bool moved_ = false;
  uint64_t last_move_ = 0;
  std::vector<std::pair<double, double>> warm_;
  bool fitted_ = false;
  double a_ = 0, b_ = 0;
};

// ---- gradient norm ------------------------------------------------------------------------------
class GradNormController final : public Controller {
 public:
  ControllerKind kind() const override { return ControllerKind::kGradNorm; }
  uint32_t version() const override { return 1; }
  Status update(const ControlContext& ctx, ControlKnobs* knobs) override {
    const auto& s = ctx.settings;
    const double g = std::sqrt(std::max(ctx.obs.grad_norm2, 0.0));
    if (g > 0 && std::isfinite(g)) {
      if (has_mean_ && g > s.gradnorm_jump * mean_) {
        boost_left_ = s.gradnorm_boost_steps;
        window_.clear();
      }
      mean_ = has_mean_ ? 0.9 * mean_ + 0.1 * g : g;
      has_mean_ = true;
      window_.push_back(g);
      while (window_.size() > std::max<uint64_t>(s.gradnorm_window, 2)) window_.pop_front();
    }
    double mult = 1.0;
    if (boost_left_ > 0) {
      mult = s.gradnorm_boost;
      --boost_left_;
    } else if (window_.size() >= std::max<uint64_t>(s.gradnorm_window, 2)) {
      double sum = 0, sum2 = 0;
      for (double v : window_) {
        sum += v;
        sum2 += v * v;
      }
      const double n = static_cast<double>(window_.size());
      const double mean = sum / n;
      const double var = std::max(sum2 / n - mean * mean, 0.0);
      if (mean > 0 && std::sqrt(var) / mean < s.gradnorm_steady_cv) mult = s.gradnorm_steady_scale;
    }
    knobs->density = clamp_density(knobs->density * mult, s);
    knobs->threshold /= mult;
    return Status::Ok();
  }

 private:
  bool has_mean_ = false;
  double mean_ = 0;
  uint64_t boost_left_ = 0;
  std::deque<double> window_;
};

// ---- total-error budget (hard threshold) ------------------------------------------------------
class BudgetController final : public Controller {
 public:
  ControllerKind kind() const override { return ControllerKind::kBudget; }
  uint32_t version() const override { return 1; }
  Status update(const ControlContext& ctx, ControlKnobs* knobs) override {
    const auto& s = ctx.settings;
    const auto& o = ctx.obs;
    if (s.budget_total_elements <= 0 || s.budget_steps == 0) return Status::Ok();
    knobs->selector = kernels::Selector::kThreshold;
    if (!init_) {
      lambda_ = initial_ = knobs->threshold;
      init_ = true;
      // Taking over (selector -> threshold) is a change too: what was sent before says nothing
      // about this lambda.
      changed_ = true;
      last_change_ = o.step;
    }
    used_ += o.nnz;
    ctx.status->budget_used_elements = used_;
    // Rate of the lambda in force: an EMA of nnz (error feedback makes the first steps after a
    // change a transient: a higher lambda sends little until the residual has grown).
    // Observations of the two steps after a change still ran under the old lambda (decision latency).
    if (!changed_ || o.step >= last_change_ + 2) {
      rate_ = rate_n_ == 0 ? o.nnz : 0.4 * o.nnz + 0.6 * rate_;
      ++rate_n_;
    }
    const uint64_t done = o.step + 1;
    const bool settling = changed_ && o.step < last_change_ + std::max<uint64_t>(s.budget_settle_steps, 2);
    if (done < s.budget_steps && !settling && rate_n_ > 0) {
      // What is left of the budget, spread over what is left of the run: cumulative volume
      // tracks the budget because every overshoot or undershoot is paid back over the rest.
      const double remaining = static_cast<double>(s.budget_steps - done);
      const double target_rate = std::max(s.budget_total_elements - used_, 0.0) / remaining;
      // Newton steps in log(lambda) on log(rate / wanted rate). The slope of log nnz against
      // log lambda is measured from the last two lambdas (secant; it is about -1 for error
      // feedback in steady state, steeper on a real gradient's tail) so a steep curve does not
      // make the loop oscillate. Full steps until within 1.5x (calibration), then half steps of
      // at most 10 %.
      double log_ratio;
      if (target_rate <= 0) {
        log_ratio = 2.0;  // budget spent: send as little as possible
      } else if (rate_ <= 0) {
        log_ratio = -2.0;
      } else {
        log_ratio = std::clamp(std::log(rate_ / target_rate), -3.0, 3.0);
      }
      if (has_prev_ && rate_ > 0) {
        const double dl = std::log(lambda_) - prev_log_lambda_;
        if (std::fabs(dl) > 1e-3) {
          const double measured = -(std::log(rate_) - prev_log_rate_) / dl;
          if (std::isfinite(measured)) elasticity_ = std::clamp(0.5 * elasticity_ + 0.5 * measured, 0.5, 5.0);
        }
      }
      if (!calibrated_ && std::fabs(log_ratio) < std::log(1.5)) calibrated_ = true;
      double factor = std::exp((calibrated_ ? 0.5 : 1.0) * log_ratio / elasticity_);
      if (calibrated_) factor = std::clamp(factor, 1.0 / 1.1, 1.1);
      if (std::fabs(std::log(factor)) > std::log1p(s.controller_hysteresis / 4)) {
        if (rate_ > 0) {
          has_prev_ = true;
          prev_log_lambda_ = std::log(lambda_);
          prev_log_rate_ = std::log(rate_);
        }
        lambda_ = std::clamp(lambda_ * factor, initial_ * 1e-6, initial_ * 1e6);
        changed_ = true;
        last_change_ = o.step;
        rate_n_ = 0;
      }
    }
    knobs->threshold = lambda_;
    return Status::Ok();
  }

 private:
  bool init_ = false;
  bool calibrated_ = false;
  bool changed_ = false;
  double lambda_ = 0;
  double initial_ = 0;
  double elasticity_ = 1.0;  // -d log nnz / d log lambda
  bool has_prev_ = false;
  double prev_log_lambda_ = 0, prev_log_rate_ = 0;
  double used_ = 0;
  double rate_ = 0;
  uint64_t rate_n_ = 0;
  uint64_t last_change_ = 0;
};

// ---- frequency ----------------------------------------------------------------------------------
class FrequencyController final : public Controller {
 public:
  ControllerKind kind() const override { return ControllerKind::kFrequency; }
  uint32_t version() const override { return 1; }
  Status update(const ControlContext& ctx, ControlKnobs* knobs) override {
    const auto& s = ctx.settings;
    for (const auto& t : ctx.obs.tensors) {
      if (t.repeat_fraction < 0 || !std::isfinite(t.repeat_fraction)) continue;
      auto [it, fresh] = ema_.try_emplace(t.tensor_id, t.repeat_fraction);
      if (!fresh) it->second = s.frequency_alpha * t.repeat_fraction + (1 - s.frequency_alpha) * it->second;
      weight_[t.tensor_id] = static_cast<double>(std::max<uint64_t>(t.nnz, 1));
    }
    double sw = 0, swr = 0;
    for (const auto& [id, r] : ema_) {
      sw += weight_[id];
      swr += weight_[id] * r;
    }
    TensorScales scales;
    if (sw > 0 && swr > 0) {
      const double mean = swr / sw;
      const double max_scale = std::max(s.frequency_max_scale, 1.0);
      for (const auto& [id, r] : ema_) {
        double scale = std::clamp(r / mean, 1.0 / max_scale, max_scale);
        // Half powers of two: small wobbles of the repeat rate do not churn decisions.
        scale = std::exp2(std::round(2 * std::log2(scale)) / 2);
        if (scale != 1.0) scales[id] = scale;
      }
    }
    knobs->tensor_scale = std::move(scales);
    return Status::Ok();
  }

 private:
  std::map<uint32_t, double> ema_;
  std::map<uint32_t, double> weight_;
};

// ---- bandwidth ------------------------------------------------------------------------------------
// Fits the exchange into the budget (a fixed one, or a fraction of the trainer's compute time)
// at the link goodput the loop estimated from send completions. Damped so that it cannot flap:
//   - the budget (from a noisy compute time) is smoothed like the goodput;
//   - it moves only after `bandwidth_confirm_steps` consecutive observations in which the plan in
//     force is predicted over the budget (lower), or in which a plan at least 2 x hysteresis
//     denser (or the dense ring) fits the aim of (1 - margin) x budget (raise) — a dead band
//     between the two, so an estimate wobbling around the aim does nothing;
//   - at least `bandwidth_hold_steps` between decisions, and a decision moves the cap by at most
//     bandwidth_raise_max up / bandwidth_lower_max down;
//   - the dense ring whenever it fits the aim (or is cheaper than any allowed sparse plan).
// The first decision (nothing in force to flap against) goes straight to the fitting plan.
class BandwidthController final : public Controller {
 public:
  ControllerKind kind() const override { return ControllerKind::kBandwidth; }
  uint32_t version() const override { return 2; }
  Status update(const ControlContext& ctx, ControlKnobs* knobs) override {
    const auto& s = ctx.settings;
    const auto& o = ctx.obs;
    double budget_sample = 0;
    if (s.exchange_budget_ms > 0) {
      budget_sample = s.exchange_budget_ms / 1e3;
    } else if (o.compute_s > 0) {
      budget_sample = o.compute_s * s.exchange_budget_fraction;
    }
    // Decisions look at slow averages (a third of the loop's EMA weight) of the loop's goodput
    // estimate and of the budget: a stationary link's noise averages out, and a step change of
    // the link (the loop's estimate moved 2x) is taken at once.
    const double slow = std::clamp(s.goodput_smoothing / 3, 1e-3, 1.0);
    if (budget_sample > 0) {
      budget_ = budget_ > 0 && s.exchange_budget_ms <= 0 ? smooth(budget_, budget_sample, slow) : budget_sample;
    }
    if (ctx.goodput_Bps > 0) {
      goodput_ = goodput_ > 0 && ctx.goodput_Bps < goodput_ * 2 && ctx.goodput_Bps > goodput_ / 2
                     ? smooth(goodput_, ctx.goodput_Bps, slow)
                     : ctx.goodput_Bps;
    }
    const double budget = budget_;
    ctx.status->exchange_budget_s = budget;
    if (!init_) {
      init_ = true;
      dense_ = !knobs->compression;
    }
    const double g = goodput_;
    if (budget <= 0 || g <= 0 || o.tensors.empty() || s.world_size < 2) return apply(knobs);
    const double target = budget * (1 - s.bandwidth_margin);
    const uint32_t w = s.world_size;
    const double dense_s = static_cast<double>(step_dense_bytes(o.tensors, w)) / g;
    if (knobs->selector == kernels::Selector::kThreshold) {
      // Lambda: nnz ~ 1/lambda, so scale lambda by how far the measured volume is over.
      const double now_s = static_cast<double>(o.bytes_sent) / g;
      knobs->compression = true;
      if (now_s > target) knobs->threshold *= now_s / target;
      ctx.status->predicted_exchange_s = std::min(now_s, target);
      return Status::Ok();
    }
    // Predict in the format that will be sent (the cost controller may change it afterwards).
    auto time_at = [&](double d) { return static_cast<double>(step_sparse_bytes(o.tensors, d, w, knobs->format)) / g; };
    const double desired = std::min(knobs->density, s.density_max);
    const double floor = std::min(s.density_min, desired);
    // The densest sparse plan that fits the aim (the floor when none does).
    double fit = desired;
    if (time_at(desired) > target) {
      double lo = floor, hi = desired;
      if (time_at(lo) > target) {
        hi = lo;
      } else {
        for (int i = 0; i < 50; ++i) {
          const double mid = std::sqrt(lo * hi);
          (time_at(mid) <= target ? lo : hi) = mid;
        }
        hi = lo;
      }
      fit = std::max(round_down3(hi), floor);
    }
    const bool dense_fits = s.bandwidth_allow_dense && (dense_s <= target || time_at(fit) >= dense_s);
    const double held = std::min(desired, cap_);
    const double held_s = dense_ ? dense_s : time_at(held);
    const bool over = held_s > budget && (dense_ ? true : held > floor || dense_fits);
    const bool room = !dense_ && (dense_fits || fit > held * (1 + 2 * s.controller_hysteresis));
    over_ = over ? over_ + 1 : 0;
    room_ = room ? room_ + 1 : 0;
    const bool first = !decided_;
    const bool may = first || o.step >= last_decision_step_ + s.bandwidth_hold_steps;
    const uint64_t confirm = first ? 1 : std::max<uint64_t>(s.bandwidth_confirm_steps, 1);
    if (may && (over_ >= confirm || room_ >= confirm)) {
      if (dense_fits) {
        dense_ = true;
        cap_ = 1.0;
      } else if (dense_ || first) {
        dense_ = false;
        cap_ = fit >= desired ? 1.0 : fit;
      } else {
        // Bounded move from the density in force towards the fitting one.
        double next = std::clamp(fit, held / std::max(s.bandwidth_lower_max, 1.0),
                                 held * std::max(s.bandwidth_raise_max, 1.0));
        next = std::max(round_down3(next), floor);
        cap_ = next >= desired ? 1.0 : next;
      }
      decided_ = true;
      last_decision_step_ = o.step;
      over_ = room_ = 0;
    }
    return apply(knobs, decided_ ? (dense_ ? dense_s : time_at(std::min(desired, cap_))) : held_s, ctx.status);
  }

 private:
  // The plan in force for this controller (nothing until its first decision).
  Status apply(ControlKnobs* knobs, double predicted_s = 0, ControlStatus* status = nullptr) const {
    if (!decided_) return Status::Ok();
    knobs->compression = !dense_;
    knobs->density_cap = dense_ ? 1.0 : cap_;
    if (status) status->predicted_exchange_s = predicted_s;
    return Status::Ok();
  }

  static double smooth(double mean, double sample, double alpha) {
    return std::exp(alpha * std::log(sample) + (1 - alpha) * std::log(mean));
  }

  bool init_ = false;
  bool decided_ = false;
  bool dense_ = false;
  double cap_ = 1.0;
  double budget_ = 0;   // smoothed
  double goodput_ = 0;  // smoothed again
  uint64_t over_ = 0, room_ = 0;
  uint64_t last_decision_step_ = 0;
};

// ---- cost model: collective and format --------------------------------------------------------
class CostController final : public Controller {
 public:
  ControllerKind kind() const override { return ControllerKind::kCost; }
  uint32_t version() const override { return 1; }
  Status update(const ControlContext& ctx, ControlKnobs* knobs) override {
    const auto& s = ctx.settings;
    const auto& o = ctx.obs;
    if (s.world_size < 2 || o.tensors.empty() || !ctx.base.compression) return Status::Ok();
    double d = std::min(knobs->density, knobs->density_cap);
    if (knobs->selector == kernels::Selector::kThreshold && o.elements > 0) {
      d = std::max(o.nnz / static_cast<double>(o.elements), 1e-9);
    }
    // Format of the largest tensor's selection (exact sizes from the codec).
    const auto* largest = &o.tensors.front();
    for (const auto& t : o.tensors) {
      if (t.elements > largest->elements) largest = &t;
    }
    kernels::Format f = kernels::Format::kCoo;
    sparse_allgather_bytes(largest->elements, topk_count(largest->elements, d), s.world_size, &f);
    const double g = ctx.goodput_Bps > 0 ? ctx.goodput_Bps : 1.0;  // unknown: compare bytes
    const double sparse_s = static_cast<double>(step_sparse_bytes(o.tensors, d, s.world_size, f)) / g +
                            (ctx.goodput_Bps > 0 ? std::max(o.encode_s, 0.0) : 0.0);
    const double dense_s = static_cast<double>(step_dense_bytes(o.tensors, s.world_size)) / g;
    if (!dense_) {
      if (dense_s < sparse_s * (1 - s.controller_hysteresis)) dense_ = true;
    } else if (sparse_s < dense_s * (1 - s.controller_hysteresis)) {
      dense_ = false;
    }
    if (dense_) {
      knobs->compression = false;
      return Status::Ok();
    }
    knobs->format = f;
    return Status::Ok();
  }

 private:
  bool dense_ = false;
};

bool valid(const ControlKnobs& k) {
  auto ok = [](double v, double lo, double hi) { return std::isfinite(v) && v >= lo && v <= hi; };
  if (!ok(k.density, 1e-6, 1.0) || !ok(k.threshold, 1e-30, 1e30) || !ok(k.density_cap, 1e-6, 1.0)) return false;
  for (const auto& [id, s] : k.tensor_scale) {
    if (!ok(s, 1e-6, 1e6)) return false;
  }
  return true;
}

std::string describe_change(const ControlKnobs& from, const ControlKnobs& to) {
  std::string out;
  auto add = [&](const std::string& s) {
    if (!out.empty()) out += ' ';
    out += s;
  };
  if (from.compression != to.compression) add(to.compression ? "compression=on" : "compression=off");
  if (from.selector != to.selector) add(std::string("selector=").append(kernels::selector_name(to.selector)));
  if (from.density != to.density) add(fmt("density=%.4g", to.density));
  if (from.threshold != to.threshold) add(fmt("threshold=%.4g", to.threshold));
  if (from.density_cap != to.density_cap) add(fmt("density_cap=%.4g", to.density_cap));
  if (from.tensor_scale != to.tensor_scale) {
    add(std::string("tensor_density_scale=").append(format_tensor_scales(to.tensor_scale)));
  }
  if (from.format != to.format) add(std::string("format=").append(kernels::format_name(to.format)));
  return out;
}

}  // namespace

bool operator==(const ControlKnobs& a, const ControlKnobs& b) {
  return a.compression == b.compression && a.selector == b.selector && a.density == b.density &&
         a.threshold == b.threshold && a.density_cap == b.density_cap && a.tensor_scale == b.tensor_scale &&
         a.format == b.format;
}

JobObservation merge_observations(std::span<const NodeObservation> nodes, uint32_t world_size) {
  JobObservation j;
  j.world_size = world_size;
  j.nodes = static_cast<uint32_t>(nodes.size());
  if (nodes.empty()) return j;
  j.step = nodes.front().step;
  j.elements = nodes.front().elements;
  double loss_sum = 0, target_sum = 0;
  int losses = 0, targets = 0;
  double goodput = std::numeric_limits<double>::infinity();
  double wall_goodput = std::numeric_limits<double>::infinity();
  std::map<uint32_t, TensorStepObservation> tensors;
  std::map<uint32_t, int> repeats;
  for (const auto& n : nodes) {
    j.nnz += static_cast<double>(n.nnz) / static_cast<double>(nodes.size());
    j.bytes_sent = std::max(j.bytes_sent, n.bytes_sent);
    j.exchange_s = std::max(j.exchange_s, n.exchange_s);
    j.encode_s = std::max(j.encode_s, n.encode_s);
    if (n.compute_s >= 0) j.compute_s = std::max(j.compute_s, n.compute_s);
    j.grad_norm2 += n.grad_norm2;
    j.residual_norm2 += n.residual_norm2;
    if (n.link_s > 0 && n.link_bytes > 0) goodput = std::min(goodput, static_cast<double>(n.link_bytes) / n.link_s);
    if (n.exchange_s > 0 && n.bytes_sent > 0) {
      wall_goodput = std::min(wall_goodput, static_cast<double>(n.bytes_sent) / n.exchange_s);
    }
    if (n.has_loss) {
      loss_sum += n.loss;
      ++losses;
    }
    if (n.has_loss_target) {
      target_sum += n.loss_target;
      ++targets;
    }
    for (const auto& t : n.tensors) {
      auto& m = tensors[t.tensor_id];
      m.tensor_id = t.tensor_id;
      m.elements = t.elements;
      m.nnz += t.nnz;
      if (t.repeat_fraction >= 0) {
        m.repeat_fraction = (repeats[t.tensor_id] == 0 ? 0 : m.repeat_fraction) + t.repeat_fraction;
        ++repeats[t.tensor_id];
      }
    }
  }
  j.goodput_Bps = std::isfinite(goodput) ? goodput : 0;
  j.wall_goodput_Bps = std::isfinite(wall_goodput) ? wall_goodput : 0;
  if (losses > 0) {
    j.has_loss = true;
    j.loss = loss_sum / losses;
  }
  if (targets > 0) {
    j.has_loss_target = true;
    j.loss_target = target_sum / targets;
  }
  for (auto& [id, t] : tensors) {
    t.nnz /= nodes.size();
    if (repeats[id] > 0) t.repeat_fraction /= repeats[id];
    j.tensors.push_back(t);
  }
  return j;
}

uint64_t sparse_allgather_bytes(uint64_t elements, uint64_t nnz, uint32_t world, kernels::Format* format) {
  uint64_t best = std::numeric_limits<uint64_t>::max();
  kernels::Format best_format = kernels::Format::kCoo;
  // Every row of the codec registry but those that carry every element (dense), in id order.
  for (const kernels::CodecInfo& row : kernels::codec_registry()) {
    if (row.dense) continue;
    const size_t b = kernels::encoded_bytes(row.id, kernels::ValueType::kF32, elements, nnz);
    if (b > 0 && b < best) {
      best = b;
      best_format = row.id;
    }
  }
  if (best == std::numeric_limits<uint64_t>::max()) best = nnz * 8;
  if (format) *format = best_format;
  return static_cast<uint64_t>(world > 0 ? world - 1 : 0) * (kWireHeaderBytes + best);
}

uint64_t sparse_allgather_bytes_as(uint64_t elements, uint64_t nnz, uint32_t world, kernels::Format format) {
  size_t b = kernels::encoded_bytes(format, kernels::ValueType::kF32, elements, nnz);
  if (b == 0) b = kernels::encoded_bytes(kernels::Format::kCoo, kernels::ValueType::kF32, elements, nnz);
  return static_cast<uint64_t>(world > 0 ? world - 1 : 0) * (kWireHeaderBytes + b);
}

uint64_t ring_allreduce_bytes(uint64_t elements, uint32_t world) {
  if (world < 2) return 0;
  const uint64_t chunk = (elements + world - 1) / world;
  return 2ull * (world - 1) * (kWireHeaderBytes + 4 * chunk);
}

uint64_t step_sparse_bytes(std::span<const TensorStepObservation> tensors, double density, uint32_t world,
                           kernels::Format format) {
  uint64_t total = 0;
  for (const auto& t : tensors) total += sparse_allgather_bytes_as(t.elements, topk_count(t.elements, density), world, format);
  return total;
}

uint64_t step_dense_bytes(std::span<const TensorStepObservation> tensors, uint32_t world) {
  uint64_t total = 0;
  for (const auto& t : tensors) total += ring_allreduce_bytes(t.elements, world);
  return total;
}

// ---- the registry ------------------------------------------------------------------------------
namespace {

template <typename C>
std::unique_ptr<Controller> make() {
  return std::make_unique<C>();
}

// Every field is written out in every row. Job-level rows in the order the ControlLoop chains
// them (each refines the previous one's proposal).
constexpr ControllerInfo kRows[] = {
    {.kind = ControllerKind::kStatic, .name = "static", .doc = "fixed knobs (always the fallback)",
     .job_level = false, .make = nullptr, .knobs = ""},
    {.kind = ControllerKind::kSchedule, .name = "schedule",
     .doc = "per step: dense warm-up, density ramp or decay, periodic dense steps", .job_level = false,
     .make = nullptr, .knobs = "schedule_*"},
    {.kind = ControllerKind::kLayerwise, .name = "layerwise",
     .doc = "per tensor: small tensors dense, bias/norm/embedding tensors scaled, a sensitivity table",
     .job_level = false, .make = nullptr, .knobs = "layerwise_*"},
    {.kind = ControllerKind::kAccuracy, .name = "accuracy",
     .doc = "density multiplier from the reported metric against a target trajectory", .job_level = true,
     .make = make<AccuracyController>, .knobs = "accuracy_* controller_metric"},
    {.kind = ControllerKind::kGradNorm, .name = "gradnorm",
     .doc = "density up when the gradient norm jumps, down while it is small and steady", .job_level = true,
     .make = make<GradNormController>, .knobs = "gradnorm_*"},
    {.kind = ControllerKind::kBudget, .name = "budget",
     .doc = "hard threshold, lambda moved so that the run's volume tracks a budget", .job_level = true,
     .make = make<BudgetController>, .knobs = "budget_*"},
    {.kind = ControllerKind::kFrequency, .name = "frequency",
     .doc = "per-tensor density scales: often re-selected tensors get more", .job_level = true,
     .make = make<FrequencyController>, .knobs = "frequency_*"},
    {.kind = ControllerKind::kBandwidth, .name = "bandwidth",
     .doc = "density cap or dense ring so that the exchange fits the time budget", .job_level = true,
     .make = make<BandwidthController>, .knobs = "bandwidth_* exchange_budget_* goodput_*"},
    {.kind = ControllerKind::kCost, .name = "cost", .doc = "collective and format from the cost model",
     .job_level = true, .make = make<CostController>, .knobs = ""},
};
static_assert(std::size(kRows) == kControllerKindCount, "one row per ControllerKind");

}  // namespace

std::span<const ControllerInfo> controller_registry() { return kRows; }

const ControllerInfo* find_controller(ControllerKind kind) {
  for (const ControllerInfo& row : kRows) {
    if (row.kind == kind) return &row;
  }
  return nullptr;
}

std::string controller_choices() {
  std::string out;
  for (uint32_t i = 0; i < kControllerKindCount; ++i) {
    const ControllerInfo* row = find_controller(static_cast<ControllerKind>(i));
    if (row == nullptr) continue;
    out.append(out.empty() ? "" : "|").append(row->name);
  }
  return out;
}

std::unique_ptr<Controller> make_controller(ControllerKind kind) {
  const ControllerInfo* row = find_controller(kind);
  return row != nullptr && row->make != nullptr ? row->make() : nullptr;
}

std::optional<ControlLoop::Proposal> ControlLoop::update(const ControllerSettings& settings, const JobObservation& obs,
                                                         const ControlKnobs& base, const ControlKnobs& in_force) {
  if (status_.failed) {
    if (fallback_sent_ || in_force == base) return std::nullopt;
    fallback_sent_ = true;
    ++status_.proposals;
    status_.last_reason = std::string("controllers failed, back to static: ").append(status_.failure);
    return Proposal{base, status_.last_reason};
  }
  status_.last_step = obs.step;
  if (std::isfinite(obs.residual_norm2)) status_.total_error += obs.residual_norm2;
  // Goodput: the completion-based sample; the wall-time one is only a lower bound (it counts
  // waiting for peers), used to lift a lower estimate, or alone while no completion-based sample
  // was ever seen (small, eager messages only).
  {
    const double link = obs.goodput_Bps > 0 && std::isfinite(obs.goodput_Bps) ? obs.goodput_Bps : 0;
    const double wall = obs.wall_goodput_Bps > 0 && std::isfinite(obs.wall_goodput_Bps) ? obs.wall_goodput_Bps : 0;
    double g = 0;
    if (link > 0) {
      g = std::max(link, wall);
      if (!has_link_goodput_) has_goodput_ = false;  // forget a wall-time-only estimate
      has_link_goodput_ = true;
    } else if (!has_link_goodput_ || (has_goodput_ && wall > goodput_)) {
      g = wall;
    }
    if (g > 0) {
      if (!has_goodput_) {
        goodput_ = g;
        goodput_outliers_ = 0;
      } else if (g < goodput_ / 2 || g > goodput_ * 2) {
        // Beyond 2x: noise unless it persists; a step change of the link once it does.
        const int side = g < goodput_ ? -1 : 1;
        if (side != goodput_outlier_side_) {
          goodput_outlier_side_ = side;
          goodput_outliers_ = 0;
          goodput_outlier_log_sum_ = 0;
        }
        ++goodput_outliers_;
        goodput_outlier_log_sum_ += std::log(g);
        if (goodput_outliers_ >= std::max<uint64_t>(settings.goodput_confirm_steps, 1)) {
          goodput_ = std::exp(goodput_outlier_log_sum_ / static_cast<double>(goodput_outliers_));
          goodput_outliers_ = 0;
        }
      } else {
        const double smoothing = settings.goodput_smoothing;
        goodput_ = std::exp(smoothing * std::log(g) + (1 - smoothing) * std::log(goodput_));
        goodput_outliers_ = 0;
      }
      if (goodput_outliers_ == 0) {
        goodput_outlier_side_ = 0;
        goodput_outlier_log_sum_ = 0;
      }
      has_goodput_ = true;
    }
  }
  status_.goodput_Bps = goodput_;

  ControlKnobs k = base;
  k.density_cap = 1.0;
  k.tensor_scale.clear();
  ControlContext ctx{settings, obs, base, goodput_, &status_};
  std::string names;
  for (const ControllerInfo& row : controller_registry()) {
    if (!row.job_level) continue;
    const ControllerKind kind = row.kind;
    auto& c = controllers_[static_cast<uint32_t>(kind)];
    if (!has(settings.active, kind)) {
      c.reset();  // deactivated: its state goes; reactivating starts afresh
      continue;
    }
    if (!c) c = make_controller(kind);
    Status s = c->update(ctx, &k);
    if (s.ok() && !valid(k)) s = internal_error("proposed out-of-range knobs");
    if (!s.ok()) {
      status_.failed = true;
      status_.failure = std::string(controller_name(kind)) + " v" + std::to_string(c->version()) + " at step " +
                        std::to_string(obs.step) + ": " + s.message();
      return update(settings, obs, base, in_force);
    }
    if (!names.empty()) names += ',';
    names += controller_name(kind);
  }
  if (k.selector == kernels::Selector::kThreshold || !k.compression) k.format = in_force.format;

  const bool structural = k.compression != in_force.compression || k.selector != in_force.selector ||
                          k.tensor_scale != in_force.tensor_scale || k.format != in_force.format;
  const bool numeric = rel_diff(k.density, in_force.density) > settings.controller_hysteresis ||
                       rel_diff(k.density_cap, in_force.density_cap) > settings.controller_hysteresis ||
                       rel_diff(k.threshold, in_force.threshold) > settings.controller_hysteresis / 4;
  if (!structural && !numeric) return std::nullopt;
  if (proposed_ && obs.step < last_proposal_step_ + settings.controller_interval_steps) return std::nullopt;
  // Values that did not move past the hysteresis keep their value in force (no creeping).
  if (rel_diff(k.density, in_force.density) <= settings.controller_hysteresis) k.density = in_force.density;
  if (rel_diff(k.density_cap, in_force.density_cap) <= settings.controller_hysteresis) {
    k.density_cap = in_force.density_cap;
  }
  if (rel_diff(k.threshold, in_force.threshold) <= settings.controller_hysteresis / 4) k.threshold = in_force.threshold;
  if (k == in_force) return std::nullopt;
  proposed_ = true;
  last_proposal_step_ = obs.step;
  ++status_.proposals;
  status_.last_reason = "controller ";
  status_.last_reason.append(names.empty() ? std::string("static") : names)
      .append(" at step ")
      .append(std::to_string(obs.step))
      .append(": ")
      .append(describe_change(in_force, k));
  return Proposal{k, status_.last_reason};
}

}  // namespace sparsecar::policies
