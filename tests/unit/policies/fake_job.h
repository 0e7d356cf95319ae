// Rank 0's view of a job for the controller tests: the decisions made so far, each effective two
// steps after the observation it was made on, as decision epochs are in the daemon.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "sparsecar/policies/controllers.h"

namespace sparsecar::policies::testing {

struct FakeJob {
  FakeJob(ControllerSettings s, ControlKnobs b) : settings(s), base(b) { decisions.push_back({0, b}); }

  ControlKnobs at(uint64_t step) const {
    ControlKnobs k = decisions.front().second;
    for (const auto& [eff, d] : decisions) {
      if (eff <= step) k = d;
    }
    return k;
  }
  const ControlKnobs& latest() const { return decisions.back().second; }

  // The trainer's hint before step hint.step; a decision on it is in force from step 0 (no step
  // has started).
  std::optional<ControlLoop::Proposal> start(const StartHint& hint) {
    auto p = loop.before_start(in_force_settings(), hint, base, latest());
    if (p) {
      decisions.push_back({0, p->knobs});
      proposal_steps.push_back(hint.step);
    }
    return p;
  }

  // As in the daemon, the settings come from the config in force: a decided warm-up length is
  // the one the controllers read.
  ControllerSettings in_force_settings() const {
    ControllerSettings s = settings;
    if (latest().schedule_warmup_steps != base.schedule_warmup_steps) {
      s.schedule_warmup_steps = latest().schedule_warmup_steps;
    }
    return s;
  }

  std::optional<ControlLoop::Proposal> feed(const JobObservation& o) {
    auto p = loop.update(in_force_settings(), o, base, latest());
    if (p) {
      decisions.push_back({o.step + 2, p->knobs});
      proposal_steps.push_back(o.step);
    }
    return p;
  }

  ControllerSettings settings;
  ControlKnobs base;
  ControlLoop loop;
  std::vector<std::pair<uint64_t, ControlKnobs>> decisions;
  std::vector<uint64_t> proposal_steps;
};

}  // namespace sparsecar::policies::testing
