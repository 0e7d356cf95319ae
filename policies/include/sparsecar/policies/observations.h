// Observations of finished steps: what one node measured (NodeObservation) and the whole job's
// step merged from every node's (JobObservation), the job-level controllers' input.
//
// Every node fills a NodeObservation per step (daemon/pipeline/observations.h) and piggybacks it
// to rank 0 (kObservation messages), where merge_observations makes the JobObservation the
// ControlLoop (controllers.h) is fed. Plain structs; merge_observations is a pure function.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace sparsecar::policies {

// ---- the magnitude histogram ---------------------------------------------------------------------
// What the budget controller calibrates lambda from: a histogram of a step's pre-selection
// magnitudes |e_i| = |residual_i + g_i| (what the hard threshold compares with lambda). A bin is
// the top bits of |x|'s IEEE pattern: 8 exponent bits and 3 mantissa bits, so 8 bins per octave
// (< 12.5 % relative width) over the whole float range, zeros in bin 0, inf/NaN in the top bins.
// Nodes add their thresholded tensors' magnitudes up; rank 0 sums the nodes' histograms.
inline constexpr uint32_t kMagnitudeBins = 2048;
inline constexpr uint32_t kMagnitudeBinShift = 20;  // (bits & 0x7fffffff) >> 20
// The bin of |v|.
uint32_t magnitude_bin(float v);
// The smallest magnitude of `bin` (its lower edge; bin 0: 0).
double magnitude_bin_lower(uint32_t bin);
// hist[magnitude_bin(x_i)] += 1 for every i (hist.size() == kMagnitudeBins; checked by the caller).
void magnitude_hist_add(std::span<uint64_t> hist, std::span<const float> x);
// The lambda at which about `density` x `elements` of the histogram's values have |x| >= lambda:
// the running count from the top bin down reaches the wanted count inside a bin, and lambda is
// interpolated geometrically between that bin's edges (values are taken as spread evenly in log
// magnitude within a bin). `elements` is the population the density refers to (it may exceed the
// histogram's total, e.g. when selected values were counted but the rest was not). Returns 0 when
// the histogram is empty or the wanted count is not reached above bin 0 (lambda 0 keeps
// everything), +inf never: a wanted count below one element gives the top nonzero bin's upper edge.
double magnitude_quantile(std::span<const uint64_t> hist, double elements, double density);

// One busy period of the link from `peer` into this node, timed by the receiver: from the first
// rendezvous announcement of a message from `peer` until the last byte of every message announced
// meanwhile arrived (overlapping messages count once, their bytes add up). Messages of any size
// give one while the step controller is active (it makes every data send rendezvous); otherwise
// only the messages UCX sends rendezvous anyway (large ones).
struct LinkSample {
  uint32_t peer = 0;  // the sender
  uint64_t bytes = 0;
  double seconds = 0;
};
// The same merged on rank 0: the link from -> to.
struct LinkPairSample {
  uint32_t from = 0;
  uint32_t to = 0;
  uint64_t bytes = 0;
  double seconds = 0;
};

struct TensorStepObservation {
  uint32_t tensor_id = 0;
  uint64_t elements = 0;
  uint64_t nnz = 0;               // selected this step (elements for a dense step)
  double repeat_fraction = -1.0;  // share of this step's selection also selected last step; < 0 unknown
};

// What one node measured for one step (all its tensors). Times are durations in seconds.
struct NodeObservation {
  uint32_t rank = 0;
  uint64_t step = 0;
  uint64_t elements = 0;        // Σ tensor elements
  uint64_t device_elements = 0; // of those, compressed on a GPU (the device path)
  // Of those, in dense steps the trainers all-reduced themselves (dense_collective=trainer): their
  // exchange is not in exchange_s (the daemons sent nothing) but in period_s.
  uint64_t trainer_elements = 0;
  uint64_t nnz = 0;             // Σ selected elements
  uint64_t bytes_sent = 0;      // Σ bytes this node sent for the step, headers included
  uint64_t dense_bytes = 0;     // what a dense ring would have sent
  double exchange_s = 0;        // Σ wall time of the collectives (send to last receive)
  double encode_s = 0;          // Σ time in EF + select + encode (dense ring: EF + copy)
  double decode_s = 0;          // Σ decoding peers' selections (ring: copying gathered chunks)
  double reduce_s = 0;          // Σ reducing ring chunks
  std::vector<LinkSample> link_samples;  // receiver-side timing, since this node's last observation
  // The link, from the transport's own send completions (daemon/collective/collective.h,
  // ExchangeStats::link_*): bytes of the sends large enough to cross the link before they
  // complete, and the time at least one of them was in flight. Unlike exchange_s it excludes
  // waiting for slow peers to reach the step, so link_bytes / link_s is the link's goodput.
  uint64_t link_bytes = 0;
  double link_s = 0;            // 0: no such send this step (all small, eager: goodput unknown)
  double grad_norm2 = 0;        // Σ ||local sum||^2 (this node's gradient)
  double residual_norm2 = 0;    // Σ ||residual||^2 after the step (the compression error e_t)
  double compute_s = -1;        // trainer-reported compute time of the step; < 0 unknown
  // Wall time from this node's previous step (step - 1) to this one, both finished in the daemon:
  // the whole step as the job lives it (the trainer's compute, the hook and copies, encode,
  // exchange); 0 unknown (the first step, a gap, a reset).
  double period_s = 0;
  double loss = 0;              // trainer-reported metric (controller_metric), if has_loss
  bool has_loss = false;
  double loss_target = 0;       // trainer-reported "<metric>_target", if has_loss_target
  bool has_loss_target = false;
  std::vector<TensorStepObservation> tensors;
  // Pre-selection magnitudes of this step's thresholded tensors (kMagnitudeBins counts; empty:
  // not measured, i.e. no budget controller active or a tensor of the step was not covered) and
  // how many elements they cover. Measured only while the budget controller is active.
  std::vector<uint64_t> magnitude_hist;
  std::vector<uint64_t> gradient_hist;  // the same elements' |g| (this step's gradient alone)
  uint64_t magnitude_elements = 0;
  double threshold = 0;  // lambda those tensors were selected with (hard threshold); 0: none
};

// One step of the whole job (merge_observations of every node's NodeObservation).
struct JobObservation {
  uint64_t step = 0;
  uint32_t world_size = 1;
  uint32_t nodes = 0;           // observations merged (== world_size when complete)
  uint64_t elements = 0;        // per node
  uint64_t device_elements = 0; // of those, compressed on a GPU on every node (min over nodes)
  uint64_t trainer_elements = 0; // of those, all-reduced by the trainers on every node (min over nodes)
  double nnz = 0;               // mean selected elements per node
  uint64_t bytes_sent = 0;      // the most any node sent
  double exchange_s = 0;        // the slowest node's exchange time
  double goodput_Bps = 0;       // min over nodes of link_bytes / link_s (0 unknown)
  double wall_goodput_Bps = 0;  // min over nodes of bytes_sent / exchange_s: a lower bound of the
                                // link's goodput (wall time includes waiting for peers); 0 unknown
  double encode_s = 0;          // the slowest node's encode time
  double decode_s = 0;          // the slowest node's decode time
  double reduce_s = 0;          // the slowest node's ring reduce time
  std::vector<LinkPairSample> link_samples;  // every node's receiver-side samples
  double compute_s = -1;        // the slowest trainer's compute time; < 0 unknown
  double period_s = 0;          // the longest node's NodeObservation::period_s; 0 unknown
  double grad_norm2 = 0;        // Σ over nodes
  double residual_norm2 = 0;    // Σ over nodes: this step's ||e_t||^2
  double loss = 0;              // mean over nodes that reported
  bool has_loss = false;
  double loss_target = 0;
  bool has_loss_target = false;
  std::vector<TensorStepObservation> tensors;  // per tensor: nnz and repeat averaged over nodes
  // Σ over the nodes that measured one of their magnitude histograms, and the elements those
  // cover (empty / 0: none did). Quantiles of it are the job's (magnitude_quantile).
  std::vector<uint64_t> magnitude_hist;
  std::vector<uint64_t> gradient_hist;
  uint64_t magnitude_elements = 0;
  double threshold = 0;  // the lambda the measured nodes' step ran under (the largest); 0: none
};

JobObservation merge_observations(std::span<const NodeObservation> nodes, uint32_t world_size);

}  // namespace sparsecar::policies
