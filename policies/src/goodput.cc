#include "sparsecar/policies/goodput.h"

#include <algorithm>
#include <cmath>

namespace sparsecar::policies {

double GoodputEstimator::update(double link_Bps, double wall_Bps, double smoothing, uint64_t confirm_steps) {
  const double link = link_Bps > 0 && std::isfinite(link_Bps) ? link_Bps : 0;
  const double wall = wall_Bps > 0 && std::isfinite(wall_Bps) ? wall_Bps : 0;
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
      outliers_ = 0;
    } else if (g < goodput_ / 2 || g > goodput_ * 2) {
      // Beyond 2x: noise unless it persists; a step change of the link once it does.
      const int side = g < goodput_ ? -1 : 1;
      if (side != outlier_side_) {
        outlier_side_ = side;
        outliers_ = 0;
        outlier_log_sum_ = 0;
      }
      ++outliers_;
      outlier_log_sum_ += std::log(g);
      if (outliers_ >= std::max<uint64_t>(confirm_steps, 1)) {
        goodput_ = std::exp(outlier_log_sum_ / static_cast<double>(outliers_));
        outliers_ = 0;
      }
    } else {
      goodput_ = std::exp(smoothing * std::log(g) + (1 - smoothing) * std::log(goodput_));
      outliers_ = 0;
    }
    if (outliers_ == 0) {
      outlier_side_ = 0;
      outlier_log_sum_ = 0;
    }
    has_goodput_ = true;
  }
  return goodput_;
}

}  // namespace sparsecar::policies
