// The link between two nodes as the step controller prices it: t(bytes) = alpha + beta * bytes,
// fitted online from receiver-side samples (observations.h, LinkSample: one busy period of the
// link, its bytes and its duration), for messages of any size.
//
// Least squares over the samples with exponential forgetting (each step's batch of samples
// weighs `forget` times less at the next step). A step change of the link (a tbf rate change,
// another job starting) shows as `confirm` consecutive batches whose measured time is off the
// prediction by more than 2x on the same side (judged on sizes within 2x of those fitted: a new
// size teaches the fit, it is no change of the link): the fit then restarts from those batches.
// When the sizes seen do not spread enough to separate alpha from beta (or the slope comes out
// non-positive), alpha is the one of the last fit that could separate them (a rate change moves
// beta, not the per-message latency), capped so that beta stays positive, and beta the rest of the
// mean time per byte; with no such fit ever, alpha is 0 (exact at the sizes seen, conservative for
// larger ones) and separated() says so, so that the step controller can probe a second size.
//
// Pure: no clock; fed the same batches it gives the same fit. Thread-safety: none.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <utility>
#include <vector>

namespace sparsecar::policies {

// The link probe (v14 of the step controller): while a sparse plan is in force its few-KB messages
// cross a shaper's burst at line rate and say nothing of the rate the dense ring's chunks would
// meet, so each node sends its ring successor one message of a ring chunk's size now and then
// (the daemon's LinkProbe; at most `step_probe_share` of the time), which the receiver times like
// any other. Its payload: what the ring sends its successor in a step for the largest tensor,
// 2 (world_size - 1) chunks of 4 bytes per element, elements / world_size rounded up (a shaper's
// burst covers one chunk of a small model: the real jobs' tbf let 128 KiB through at line rate,
// and a 170 KB probe at 50 Mbit/s measured ~0.4x what it would without), at most
// kProbePayloadCapBytes; 0 (no probe) where that is below kMinProbePayloadBytes (a message the
// transport would not time by its size alone, of a ring cheap enough to need no probe) or
// world_size < 2. The cap: a probe holds the messages behind it to its peer back for as long as it
// takes, and a link that got slower unseen (a shaper's burst covers the sparse messages) makes it
// dear: a 1.1 M-parameter job's 4 MiB probes, due by a ring step's time at 1 Gbit/s, went after a
// drop to 50 Mbit/s and stalled a step for 0.7-1.4 s of a ~10 s job; 1 MiB is still 8x a 128 KiB
// burst. The controller compares a probe's time per byte, so its size is free below the ring's.
// kMaxProbePayloadBytes: the most a receiver accepts (wire::kMaxProbePayloadBytes).
inline constexpr uint64_t kMinProbePayloadBytes = 64 * 1024;
inline constexpr uint64_t kProbePayloadCapBytes = 1024 * 1024;
inline constexpr uint64_t kMaxProbePayloadBytes = 4 * 1024 * 1024;
uint64_t link_probe_payload_bytes(std::span<const uint64_t> tensor_elements, uint32_t world_size);
// A receiver's sample of `sample_bytes` (a busy period: headers included, overlapping messages
// added) stands for a probe of `payload_bytes`: within 2x of it with its wire header. False for
// payload 0 (no probe).
bool link_probe_sized(uint64_t sample_bytes, uint64_t payload_bytes);

class LinkFit {
 public:
  struct Sample {
    uint64_t bytes = 0;
    double seconds = 0;
  };
  // One step's samples of this link (an empty batch changes nothing). forget in (0, 1].
  void add_step(std::span<const Sample> batch, double forget = 0.8, uint64_t confirm = 2);

  bool known() const { return known_; }
  double alpha() const { return alpha_; }  // seconds per message
  double beta() const { return beta_; }    // seconds per byte
  double predict(uint64_t bytes) const { return alpha_ + beta_ * static_cast<double>(bytes); }
  uint64_t changes() const { return changes_; }  // step changes detected so far
  uint64_t faster_changes() const { return faster_changes_; }  // of which the link got faster
  uint64_t samples() const { return samples_; }  // samples used since the last restart
  // Some fit so far had sizes spread enough to separate alpha from beta.
  bool separated() const { return separated_; }

 private:
  void accumulate(std::span<const Sample> batch, double weight_of_old);
  void refit();

  bool known_ = false;
  bool separated_ = false;
  double alpha_ = 0, beta_ = 0;
  double separated_alpha_ = 0;  // alpha of the last fit that separated it
  // Weighted sums: count, Σb, Σt, Σb², Σbt.
  double w_ = 0, sb_ = 0, st_ = 0, sbb_ = 0, sbt_ = 0;
  uint64_t samples_ = 0;
  uint64_t min_bytes_ = 0, max_bytes_ = 0;  // sizes seen since the last restart
  uint64_t changes_ = 0;
  uint64_t faster_changes_ = 0;
  int outlier_side_ = 0;
  std::vector<std::vector<Sample>> outliers_;  // consecutive batches off the fit on one side
};

}  // namespace sparsecar::policies
