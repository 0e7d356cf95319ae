#include "daemon/pipeline/controller_runner.h"

#include <cstdio>

#include "daemon/pipeline/settings.h"
#include "sparsecar/common/log.h"

namespace sparsecar {
namespace {

// Steps kept waiting for a slow node's observation before they are given up.
constexpr uint64_t kMaxPendingSteps = 16;

std::string number(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

bool from_controller(const Decision& d) { return d.reason.rfind("controller", 0) == 0; }

}  // namespace

KnobChanges knob_changes(const Config& config, const policies::ControlKnobs& k) {
  const policies::ControlKnobs now = control_knobs_from_config(config);
  KnobChanges out;
  if (k.compression != now.compression) out.emplace_back("compression", k.compression ? "on" : "off");
  if (k.selector != now.selector) out.emplace_back("selector", std::string(kernels::selector_name(k.selector)));
  if (k.density != now.density) out.emplace_back("density", number(k.density));
  if (k.threshold != now.threshold) out.emplace_back("threshold", number(k.threshold));
  if (k.density_cap != now.density_cap) out.emplace_back("density_cap", number(k.density_cap));
  if (k.tensor_scale != now.tensor_scale) {
    out.emplace_back("tensor_density_scale", policies::format_tensor_scales(k.tensor_scale));
  }
  if (k.schedule_warmup_steps != now.schedule_warmup_steps) {
    out.emplace_back("schedule_warmup_steps", std::to_string(k.schedule_warmup_steps));
  }
  if (k.format != now.format && find_knob("format") != nullptr) {
    out.emplace_back("format", std::string(kernels::format_name(k.format)));
  }
  return out;
}

ControllerRunner::ControllerRunner(const Config& initial, DecisionBoard* board, const Clock& clock)
    : board_(board), clock_(clock), world_size_(initial.world_size), base_(initial) {}

void ControllerRunner::add(const policies::NodeObservation& o) {
  std::lock_guard<std::mutex> lock(mu_);
  if (has_last_step_ && o.step <= last_step_) return;  // that step was already decided on
  auto& v = pending_[o.step];
  for (const auto& have : v) {
    if (have.rank == o.rank) return;  // duplicate
  }
  v.push_back(o);
  while (pending_.size() > kMaxPendingSteps) {
    pending_.erase(pending_.begin());
    ++dropped_;
  }
}

void ControllerRunner::start_hint(const policies::StartHint& hint) {
  std::lock_guard<std::mutex> lock(mu_);
  if (hinted_ || has_last_step_) return;  // one per job, and only before its first observation
  hinted_ = true;
  refresh_base_locked();
  const Decision latest = board_->latest();
  const Config& in_force = *latest.config;
  SC_LOG_INFO("the trainer's dense steps before step {}: {:.3g} ms a step, {:.3g} ms of it waiting on the exchange; "
              "momentum {}",
              static_cast<unsigned long long>(hint.step), hint.dense_step_s * 1e3, hint.dense_wait_s * 1e3,
              hint.momentum_corrected ? "corrected by the hook" : "not corrected");
  auto proposal = loop_.before_start(controller_settings_from_config(in_force), hint, control_knobs_from_config(base_),
                                     control_knobs_from_config(in_force));
  if (!loop_.status().step_model.empty()) {
    SC_LOG_DEBUG("before step {}: step model: {}", static_cast<unsigned long long>(hint.step), loop_.status().step_model);
  }
  if (proposal) propose_locked(*proposal, in_force);
}

void ControllerRunner::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  pending_.clear();
  has_last_step_ = false;
  hinted_ = false;
  // The controllers' records, fits and step numbers belong to the finished job (the next one's
  // steps start again at 0; a last proposal at step 900 would hold the next job's first ones).
  loop_ = policies::ControlLoop();
}

void ControllerRunner::refresh_base_locked() {
  for (const Decision& d : board_->history()) {
    if (d.epoch <= base_epoch_) continue;
    base_epoch_ = d.epoch;
    if (from_controller(d)) continue;
    // An operator (or start-up) change: it becomes part of the base the controllers start from.
    auto changes = parse_changes(d.changes);
    if (!changes.ok()) continue;
    for (const auto& [name, value] : *changes) set_knob(base_, name, value).ignore();
  }
}

void ControllerRunner::poll() {
  std::lock_guard<std::mutex> lock(mu_);
  while (!pending_.empty()) {
    auto it = pending_.begin();
    // The oldest step waits for every node, unless a later step is already complete (then the
    // oldest lost an observation and is given up).
    if (it->second.size() < world_size_) {
      bool later_complete = false;
      for (auto j = std::next(it); j != pending_.end(); ++j) later_complete |= j->second.size() >= world_size_;
      if (!later_complete) return;
      pending_.erase(it);
      ++dropped_;
      continue;
    }
    const policies::JobObservation job = policies::merge_observations(it->second, world_size_);
    has_last_step_ = true;
    last_step_ = it->first;
    pending_.erase(it);
    ++observed_;

    refresh_base_locked();
    const Decision latest = board_->latest();
    const Config& in_force = *latest.config;
    policies::ControllerSettings settings = controller_settings_from_config(in_force);
    policies::ControlKnobs base = control_knobs_from_config(base_);
    auto proposal = loop_.update(settings, job, base, control_knobs_from_config(in_force));
    log_accuracy_signal_locked();
    if (!loop_.status().step_model.empty()) SC_LOG_DEBUG("step {}: step model: {}", job.step, loop_.status().step_model);
    if (proposal) propose_locked(*proposal, in_force);
  }
}

void ControllerRunner::propose_locked(const policies::ControlLoop::Proposal& proposal, const Config& in_force) {
  KnobChanges changes = knob_changes(in_force, proposal.knobs);
  if (changes.empty()) return;
  auto d = board_->propose(changes, proposal.reason, clock_.now() + std::chrono::seconds(1));
  if (!d.ok()) {
    SC_LOG_WARN("{}: not applied: {}", proposal.reason, d.status().to_string());
  }
  if (listener_) {
    // The reason reads "controller <names> at step ..." (or "before step"): the names are the label.
    const std::string& why = proposal.reason;
    const size_t from = why.rfind("controller ", 0) == 0 ? 11 : std::string::npos;
    const size_t to = from == std::string::npos ? std::string::npos : why.find(' ', from);
    listener_(from == std::string::npos ? std::string("controllers") : why.substr(from, to - from),
              d.ok() ? "applied" : "refused");
  }
}

// The accuracy controller's signal, logged when it changes: a WARN when it has none (it then
// holds the density), so a job that reports no metric hears it once instead of a silent no-op.
void ControllerRunner::log_accuracy_signal_locked() {
  const std::string& signal = loop_.status().accuracy_signal;
  if (signal == logged_signal_) return;
  logged_signal_ = signal;
  if (signal.rfind("none", 0) == 0) {
    SC_LOG_WARN("accuracy controller has no usable signal ({}); it holds the density", signal);
  } else if (!signal.empty()) {
    SC_LOG_INFO("accuracy controller acts on the {}", signal);
  }
}

ControllerRunner::Snapshot ControllerRunner::snapshot() const {
  std::lock_guard<std::mutex> lock(mu_);
  Snapshot s;
  s.status = loop_.status();
  s.active = board_->latest().config->controller;
  s.steps_observed = observed_;
  s.steps_dropped = dropped_;
  return s;
}

}  // namespace sparsecar
