#include "sparsecar/policies/link_model.h"

#include <cmath>

namespace sparsecar::policies {

void LinkFit::accumulate(std::span<const Sample> batch, double weight_of_old) {
  w_ *= weight_of_old;
  sb_ *= weight_of_old;
  st_ *= weight_of_old;
  sbb_ *= weight_of_old;
  sbt_ *= weight_of_old;
  for (const Sample& s : batch) {
    const double b = static_cast<double>(s.bytes);
    w_ += 1;
    sb_ += b;
    st_ += s.seconds;
    sbb_ += b * b;
    sbt_ += b * s.seconds;
    ++samples_;
  }
}

void LinkFit::refit() {
  if (!(w_ > 0) || !(sb_ > 0)) return;
  const double mean_b = sb_ / w_;
  const double var_b = sbb_ / w_ - mean_b * mean_b;
  double beta = 0, alpha = 0;
  // Sizes spread by at least 20 % (standard deviation over mean): the slope means something.
  if (w_ >= 2 && var_b > 0.04 * mean_b * mean_b) {
    beta = (w_ * sbt_ - sb_ * st_) / (w_ * sbb_ - sb_ * sb_);
    alpha = (st_ - beta * sb_) / w_;
  }
  if (!(beta > 0) || !std::isfinite(beta) || !(alpha >= 0) || !std::isfinite(alpha)) {
    alpha = 0;
    beta = st_ / sb_;  // the bytes-weighted mean time per byte
  }
  alpha_ = alpha;
  beta_ = beta;
  known_ = beta_ > 0 && std::isfinite(beta_);
}

void LinkFit::add_step(std::span<const Sample> batch, double forget, uint64_t confirm) {
  std::vector<Sample> valid;
  valid.reserve(batch.size());
  for (const Sample& s : batch) {
    if (s.bytes > 0 && s.seconds > 0 && std::isfinite(s.seconds)) valid.push_back(s);
  }
  if (valid.empty()) return;
  if (!(forget > 0) || forget > 1) forget = 1;
  if (known_) {
    double measured = 0, predicted = 0;
    for (const Sample& s : valid) {
      measured += s.seconds;
      predicted += predict(s.bytes);
    }
    const int side = measured > 2 * predicted ? 1 : measured < predicted / 2 ? -1 : 0;
    if (side != 0) {
      if (side != outlier_side_) outliers_.clear();
      outlier_side_ = side;
      outliers_.push_back(std::move(valid));
      if (outliers_.size() < std::max<uint64_t>(confirm, 1)) return;  // noise until it persists
      // A step change: start again from the batches that showed it.
      w_ = sb_ = st_ = sbb_ = sbt_ = 0;
      samples_ = 0;
      for (const auto& b : outliers_) accumulate(b, 1.0);
      outliers_.clear();
      outlier_side_ = 0;
      ++changes_;
      refit();
      return;
    }
    outliers_.clear();
    outlier_side_ = 0;
  }
  accumulate(valid, forget);
  refit();
}

}  // namespace sparsecar::policies
