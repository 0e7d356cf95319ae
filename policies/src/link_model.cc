#include "sparsecar/policies/link_model.h"

#include <algorithm>
#include <cmath>

#include "sparsecar/policies/cost_model.h"

namespace sparsecar::policies {

uint64_t link_probe_payload_bytes(std::span<const uint64_t> tensor_elements, uint32_t world_size) {
  if (world_size < 2) return 0;
  uint64_t chunk = 0;
  for (const uint64_t n : tensor_elements) chunk = std::max(chunk, 4 * ((n + world_size - 1) / world_size));
  const uint64_t step = 2 * uint64_t{world_size - 1} * chunk;  // < 2^36: no overflow for any tensor on the wire
  return step < kMinProbePayloadBytes ? 0 : std::min(step, kProbePayloadCapBytes);
}

bool link_probe_sized(uint64_t sample_bytes, uint64_t payload_bytes) {
  const uint64_t size = payload_bytes + kWireHeaderBytes;
  return payload_bytes > 0 && 2 * sample_bytes >= size && sample_bytes <= 2 * size;
}

void LinkFit::accumulate(std::span<const Sample> batch, double weight_of_old) {
  w_ *= weight_of_old;
  sb_ *= weight_of_old;
  st_ *= weight_of_old;
  sbb_ *= weight_of_old;
  sbt_ *= weight_of_old;
  for (const Sample& s : batch) {
    const double b = static_cast<double>(s.bytes);
    min_bytes_ = samples_ == 0 ? s.bytes : std::min(min_bytes_, s.bytes);
    max_bytes_ = samples_ == 0 ? s.bytes : std::max(max_bytes_, s.bytes);
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
  bool fitted = false;
  // Sizes spread by at least 20 % (standard deviation over mean): the slope means something.
  if (samples_ >= 2 && var_b > 0.04 * mean_b * mean_b) {
    beta = (w_ * sbt_ - sb_ * st_) / (w_ * sbb_ - sb_ * sb_);
    alpha = (st_ - beta * sb_) / w_;
    fitted = beta > 0 && std::isfinite(beta) && alpha >= 0 && std::isfinite(alpha);
  }
  if (fitted) {
    separated_ = true;
    separated_alpha_ = alpha;
  } else {
    // The latency of the last separating fit, at most 99 % of the mean time (beta stays > 0).
    alpha = separated_ ? std::min(separated_alpha_, 0.99 * st_ / w_) : 0.0;
    beta = (st_ - alpha * w_) / sb_;  // the rest of the mean time, per byte
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
    // Judged only on sizes like those fitted: a new size says something new about alpha and beta
    // (that is how a one-size fit learns them), not about a change of the link.
    double measured = 0, predicted = 0;
    for (const Sample& s : valid) {
      if (s.bytes * 2 < min_bytes_ || s.bytes > 2 * max_bytes_) continue;
      measured += s.seconds;
      predicted += predict(s.bytes);
    }
    const int side = !(predicted > 0) ? 0 : measured > 2 * predicted ? 1 : measured < predicted / 2 ? -1 : 0;
    if (side != 0) {
      if (side != outlier_side_) outliers_.clear();
      outlier_side_ = side;
      outliers_.push_back(std::move(valid));
      if (outliers_.size() < std::max<uint64_t>(confirm, 1)) return;  // noise until it persists
      // A step change: start again from the batches that showed it.
      w_ = sb_ = st_ = sbb_ = sbt_ = 0;
      samples_ = 0;
      for (const auto& b : outliers_) accumulate(b, 1.0);
      if (outlier_side_ < 0) ++faster_changes_;
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
