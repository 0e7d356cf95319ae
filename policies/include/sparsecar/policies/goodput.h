// The link goodput estimate the job-level controllers act on (ControlContext::goodput_Bps).
//
// Fed once per merged step with its two samples (JobObservation::goodput_Bps from the transport's
// send completions, and wall_goodput_Bps, a lower bound from wall time that counts waiting for
// peers). A completion-based sample wins; the wall-time one only lifts a lower estimate, or
// stands alone while no completion-based sample was ever seen (small, eager messages only).
// Smoothed in the log domain; a sample beyond 2x of the estimate is noise unless
// `confirm_steps` of them in a row agree on a side, which is a step change of the link and
// moves the estimate at once (to their geometric mean).
//
// Thread-safety: none; owned by the ControlLoop (controllers.h).
#pragma once

#include <cstdint>

namespace sparsecar::policies {

class GoodputEstimator {
 public:
  // One step's samples in bytes per second (<= 0 or non-finite: none). `smoothing`: EMA weight
  // of a new sample; `confirm_steps`: consecutive samples beyond 2x that move the estimate.
  // Returns the estimate (0 while unknown).
  double update(double link_Bps, double wall_Bps, double smoothing, uint64_t confirm_steps);
  double estimate() const { return goodput_; }

 private:
  bool has_goodput_ = false;
  bool has_link_goodput_ = false;  // a completion-based sample was seen (else: wall lower bound)
  double goodput_ = 0;
  int outlier_side_ = 0;           // -1 below est/2, +1 above 2 est
  uint64_t outliers_ = 0;
  double outlier_log_sum_ = 0;
};

}  // namespace sparsecar::policies
