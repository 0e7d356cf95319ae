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
  uint64_t nnz = 0;             // Σ selected elements
  uint64_t bytes_sent = 0;      // Σ bytes this node sent for the step, headers included
  uint64_t dense_bytes = 0;     // what a dense ring would have sent
  double exchange_s = 0;        // Σ wall time of the collectives (send to last receive)
  double encode_s = 0;          // Σ time in EF + select + encode
  // The link, from the transport's own send completions (daemon/collective/collective.h,
  // ExchangeStats::link_*): bytes of the sends large enough to cross the link before they
  // complete, and the time at least one of them was in flight. Unlike exchange_s it excludes
  // waiting for slow peers to reach the step, so link_bytes / link_s is the link's goodput.
  uint64_t link_bytes = 0;
  double link_s = 0;            // 0: no such send this step (all small, eager: goodput unknown)
  double grad_norm2 = 0;        // Σ ||local sum||^2 (this node's gradient)
  double residual_norm2 = 0;    // Σ ||residual||^2 after the step (the compression error e_t)
  double compute_s = -1;        // trainer-reported compute time of the step; < 0 unknown
  double loss = 0;              // trainer-reported metric (controller_metric), if has_loss
  bool has_loss = false;
  double loss_target = 0;       // trainer-reported "<metric>_target", if has_loss_target
  bool has_loss_target = false;
  std::vector<TensorStepObservation> tensors;
};

// One step of the whole job (merge_observations of every node's NodeObservation).
struct JobObservation {
  uint64_t step = 0;
  uint32_t world_size = 1;
  uint32_t nodes = 0;           // observations merged (== world_size when complete)
  uint64_t elements = 0;        // per node
  double nnz = 0;               // mean selected elements per node
  uint64_t bytes_sent = 0;      // the most any node sent
  double exchange_s = 0;        // the slowest node's exchange time
  double goodput_Bps = 0;       // min over nodes of link_bytes / link_s (0 unknown)
  double wall_goodput_Bps = 0;  // min over nodes of bytes_sent / exchange_s: a lower bound of the
                                // link's goodput (wall time includes waiting for peers); 0 unknown
  double encode_s = 0;          // the slowest node's encode time
  double compute_s = -1;        // the slowest trainer's compute time; < 0 unknown
  double grad_norm2 = 0;        // Σ over nodes
  double residual_norm2 = 0;    // Σ over nodes: this step's ||e_t||^2
  double loss = 0;              // mean over nodes that reported
  bool has_loss = false;
  double loss_target = 0;
  bool has_loss_target = false;
  std::vector<TensorStepObservation> tensors;  // per tensor: nnz and repeat averaged over nodes
};

JobObservation merge_observations(std::span<const NodeObservation> nodes, uint32_t world_size);

}  // namespace sparsecar::policies
