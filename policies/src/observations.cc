#include "sparsecar/policies/observations.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <limits>
#include <map>

namespace sparsecar::policies {

uint32_t magnitude_bin(float v) { return (std::bit_cast<uint32_t>(v) & 0x7fffffffu) >> kMagnitudeBinShift; }

double magnitude_bin_lower(uint32_t bin) {
  if (bin == 0) return 0.0;
  return static_cast<double>(std::bit_cast<float>(bin << kMagnitudeBinShift));
}

void magnitude_hist_add(std::span<uint64_t> hist, std::span<const float> x) {
  for (float v : x) ++hist[magnitude_bin(v)];
}

double magnitude_quantile(std::span<const uint64_t> hist, double elements, double density) {
  if (hist.size() != kMagnitudeBins || !(elements > 0) || !(density >= 0)) return 0;
  const double wanted = density * elements;
  // inf and NaN (the bins from +inf's up) pass every finite lambda: counted first, never returned.
  const uint32_t inf_bin = magnitude_bin(std::numeric_limits<float>::infinity());
  double above = 0;
  for (uint32_t b = inf_bin; b < kMagnitudeBins; ++b) above += static_cast<double>(hist[b]);
  for (uint32_t b = inf_bin; b-- > 1;) {
    const double c = static_cast<double>(hist[b]);
    if (c == 0) continue;
    if (above + c >= wanted) {
      const double lo = magnitude_bin_lower(b);
      const double hi = b + 1 < inf_bin ? magnitude_bin_lower(b + 1) : std::numeric_limits<float>::max();
      const double f = std::clamp((wanted - above) / c, 0.0, 1.0);  // share of the bin above lambda
      return hi * std::pow(lo / hi, f);
    }
    above += c;
  }
  return 0;
}

JobObservation merge_observations(std::span<const NodeObservation> nodes, uint32_t world_size) {
  JobObservation j;
  j.world_size = world_size;
  j.nodes = static_cast<uint32_t>(nodes.size());
  if (nodes.empty()) return j;
  j.step = nodes.front().step;
  j.elements = nodes.front().elements;
  j.device_elements = nodes.front().device_elements;
  j.trainer_elements = nodes.front().trainer_elements;
  double loss_sum = 0, target_sum = 0;
  int losses = 0, targets = 0;
  double goodput = std::numeric_limits<double>::infinity();
  double wall_goodput = std::numeric_limits<double>::infinity();
  std::map<uint32_t, TensorStepObservation> tensors;
  std::map<uint32_t, int> repeats;
  for (const auto& n : nodes) {
    if (n.magnitude_hist.size() == kMagnitudeBins && n.gradient_hist.size() == kMagnitudeBins &&
        n.magnitude_elements > 0) {
      if (j.magnitude_hist.empty()) {
        j.magnitude_hist.assign(kMagnitudeBins, 0);
        j.gradient_hist.assign(kMagnitudeBins, 0);
      }
      for (uint32_t b = 0; b < kMagnitudeBins; ++b) {
        j.magnitude_hist[b] += n.magnitude_hist[b];
        j.gradient_hist[b] += n.gradient_hist[b];
      }
      j.magnitude_elements += n.magnitude_elements;
      j.threshold = std::max(j.threshold, n.threshold);
    }
    j.device_elements = std::min(j.device_elements, n.device_elements);
    j.trainer_elements = std::min(j.trainer_elements, n.trainer_elements);
    j.nnz += static_cast<double>(n.nnz) / static_cast<double>(nodes.size());
    j.bytes_sent = std::max(j.bytes_sent, n.bytes_sent);
    j.exchange_s = std::max(j.exchange_s, n.exchange_s);
    j.encode_s = std::max(j.encode_s, n.encode_s);
    j.decode_s = std::max(j.decode_s, n.decode_s);
    j.reduce_s = std::max(j.reduce_s, n.reduce_s);
    for (const LinkSample& l : n.link_samples) {
      if (l.peer != n.rank && l.peer < world_size && l.seconds > 0 && std::isfinite(l.seconds) && l.bytes > 0) {
        j.link_samples.push_back({.from = l.peer, .to = n.rank, .bytes = l.bytes, .seconds = l.seconds});
      }
    }
    if (n.compute_s >= 0) j.compute_s = std::max(j.compute_s, n.compute_s);
    j.period_s = std::max(j.period_s, n.period_s);
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

}  // namespace sparsecar::policies
