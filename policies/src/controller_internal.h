// Internals shared by the job-level controllers (controller_*.cc: one controller each),
// their registry rows and the ControlLoop (controllers.cc) and the cost model (cost_model.cc).
//
// A controller's file holds its class in an anonymous namespace and defines its factory below;
// the registry row in controllers.cc is the only place that names the factory. Nothing here is
// public: tests and the daemon reach a controller through make_controller / the ControlLoop.
// Thread-safety: pure functions; a controller object belongs to one ControlLoop.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>
#include <string_view>

#include "sparsecar/policies/controllers.h"

namespace sparsecar::policies {

// The factories of the job-level controllers (their registry rows' `make`).
std::unique_ptr<Controller> make_accuracy_controller();
std::unique_ptr<Controller> make_gradnorm_controller();
std::unique_ptr<Controller> make_budget_controller();
std::unique_ptr<Controller> make_frequency_controller();
std::unique_ptr<Controller> make_bandwidth_controller();
std::unique_ptr<Controller> make_cost_controller();
std::unique_ptr<Controller> make_step_controller();

// `d` within the controllers' bounds [density_min, density_max] (density_max wins if they cross).
inline double clamp_density(double d, const ControllerSettings& s) {
  return std::clamp(d, std::min(s.density_min, s.density_max), s.density_max);
}

// Elements top-k keeps of n at `density` (at least one of a non-empty tensor): what the cost
// model and the cost controller assume a step at that density sends.
inline uint64_t topk_count(uint64_t n, double density) {
  if (n == 0) return 0;
  const double k = std::round(density * static_cast<double>(n));
  return std::clamp<uint64_t>(k < 1 ? 1 : static_cast<uint64_t>(k), 1, n);
}

// Adds `note` to what the decision's log line says (ControlStatus::decision_note): several
// controllers of the chain may each say why they changed something.
inline void add_decision_note(ControlStatus* status, std::string_view note) {
  if (!status->decision_note.empty()) status->decision_note.append("; ");
  status->decision_note.append(note);
}

}  // namespace sparsecar::policies
