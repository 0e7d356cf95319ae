// Collectives: how the nodes of a job combine one tensor step.
//
//   sparse_allgather: every node sends its encoded selection to every other node, then decodes
//     all W selections (its own included) into the output in rank order — so every node computes
//     bit-identical sums. Costs (W-1)(80 + payload) bytes sent per node.
//   ring_allreduce: dense reduce-scatter then all-gather around the ring r -> r+1; every chunk is
//     reduced once in a fixed order and then copied, so all nodes hold identical bits. Costs
//     2(W-1) chunks of about n/W elements per node, each sent in segments of at most
//     kRingSegmentElements (one message each), pipelined: a segment received in one phase goes
//     on in the next at once.
//
// Both run on the pipeline thread, send through the Transport (zero-copy: `keepalive` holds the
// buffers until UCX is done with them) and take peer messages from the Mailbox with one deadline
// for the whole step. Errors name the peer and the step. Neither returns, on any path, before
// every send it queued has completed or failed (or the step deadline passed, which the error
// then says): the caller may rewrite the payload and the data as soon as they return.
//
// Time: both read time (stage timings, link samples, the step deadline) only through the Clock of
// the ExchangeContext; waits for sends are bounded real-time slices (clock_wait.h).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>

#include "daemon/collective/mailbox.h"
#include "daemon/transport/transport.h"
#include "sparsecar/common/clock.h"
#include "sparsecar/common/status.h"
#include "sparsecar/kernels/types.h"

namespace sparsecar {

class Metrics;
namespace kernels {
class ThreadPool;  // sparsecar/kernels/parallel.h
}  // namespace kernels

// Elements of one ring message (256 KiB of fp32): a chunk of 2.25 MB goes as 9. Every node of a
// job must use the same value (a segment of another size is refused as data loss).
inline constexpr size_t kRingSegmentElements = size_t{64} * 1024;

struct ExchangeContext {
  Transport* transport = nullptr;  // null only when world_size == 1
  Mailbox* mailbox = nullptr;
  uint64_t job_id = 0;
  uint32_t rank = 0;
  uint32_t world_size = 1;
  uint32_t epoch = 0;
  uint64_t incarnation = 0;  // the job's incarnation (mailbox.h): carried by every message
  const Clock* clock = &steady_clock();  // what `deadline` and the stage timings are read on
  Clock::time_point deadline;
  std::shared_ptr<const void> keepalive;  // owner of every buffer handed to send()
  Metrics* metrics = nullptr;  // optional: bytes per peer and link bandwidth estimates
  kernels::ThreadPool* kernel_pool = nullptr;  // optional: the decoders split large scatters over it
  size_t ring_segment_elements = kRingSegmentElements;  // tests set it smaller, on every node alike
  // Optional: sparse_allgather(_each) calls it once, after its sends are queued and before it
  // waits for the peers (the pipeline compresses the next device step there).
  std::function<void()> while_waiting;
};

struct ExchangeStats {
  uint64_t bytes_sent = 0;  // headers included
  uint64_t messages_sent = 0;
  // Where the time went (seconds), for sparsecar_stage_duration_seconds: queueing sends and
  // waiting for their completion; waiting for peers' messages; decoding (sparse) or copying
  // gathered chunks (ring); reducing ring chunks.
  double send_seconds = 0;
  double wait_seconds = 0;
  double decode_seconds = 0;
  double reduce_seconds = 0;
  // Link goodput from the transport's completions: bytes of the sends of kLinkSampleMinBytes and
  // more that completed, and the time at least one of them was in flight (posted -> completed;
  // overlapping sends count once). Waiting for peers' messages is not in it: a ring phase that
  // waits for its left neighbour has no send of ours in flight, and a rendezvous send completes
  // when the peer's progress thread fetched it, whatever its pipeline is doing.
  uint64_t link_bytes = 0;
  double link_seconds = 0;
};

// `payload` is this node's selection encoded as (format, value_type) with `nnz` entries of a
// tensor of out.size() elements. On success `out` holds the sum over all nodes (not scaled).
Status sparse_allgather(const ExchangeContext& ctx, uint32_t tensor_id, uint64_t step,
                        kernels::Format format, kernels::ValueType value_type, uint64_t nnz,
                        std::span<const std::byte> payload, std::span<float> out, ExchangeStats* stats);

// One node's selection as sparse_allgather_each hands it on. The header fields are checked
// (dense_len and decision epoch agree with this node's; the wire layer checked the sizes); the
// payload bytes are not: the consumer's decoder validates them.
struct GatheredPayload {
  uint32_t rank = 0;  // whose selection: this node's own or a peer's
  kernels::Format format = kernels::Format::kCoo;
  kernels::ValueType value_type = kernels::ValueType::kF32;
  uint64_t nnz = 0;
  std::span<const std::byte> payload;  // valid during the call only
  std::string from;                    // "own selection" or the peer's name, for errors
};
using PayloadConsumer = std::function<Status(const GatheredPayload&)>;

// sparse_allgather without the decoding: sends `payload` to every peer and hands every node's
// selection (this node's own included) to `consume` in rank order, as it arrives; the time spent
// in `consume` counts as decoding. The first error (a peer's, a consumer's) ends it. What to
// decode into is the consumer's: the device path uploads and decodes on the GPU.
Status sparse_allgather_each(const ExchangeContext& ctx, uint32_t tensor_id, uint64_t step, kernels::Format format,
                             kernels::ValueType value_type, uint64_t nnz, uint64_t dense_len,
                             std::span<const std::byte> payload, const PayloadConsumer& consume, ExchangeStats* stats);

// In place: `data` becomes the sum over all nodes (not scaled).
Status ring_allreduce(const ExchangeContext& ctx, uint32_t tensor_id, uint64_t step, std::span<float> data,
                      ExchangeStats* stats);

// Bytes rank `rank` sends in a ring all-reduce of n fp32 elements over `world` nodes, headers
// (one per segment) included — the "dense equivalent" that compression ratios are quoted against.
uint64_t ring_allreduce_bytes(uint64_t n, uint32_t world, uint32_t rank, size_t segment = kRingSegmentElements);

// Sends a kAbort for (tensor, step) with `reason` to every peer (best effort, not awaited).
void broadcast_abort(const ExchangeContext& ctx, uint32_t tensor_id, uint64_t step, const std::string& reason);

}  // namespace sparsecar
