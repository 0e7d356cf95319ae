#include "daemon/collective/collective.h"

#include <algorithm>
#include <array>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <limits>
#include <mutex>

#include "daemon/metrics/metrics.h"
#include "daemon/transport/wire.h"
#include "sparsecar/common/clock_wait.h"
#include "sparsecar/common/log.h"
#include "sparsecar/kernels/codec.h"
#include "sparsecar/kernels/select.h"

namespace sparsecar {
namespace {

using HeaderBytes = std::array<std::byte, wire::kHeaderBytes>;

double seconds_since(const Clock& clock, Clock::time_point t0) {
  return std::chrono::duration<double>(clock.now() - t0).count();
}

// Adds the time the enclosing scope took on `clock` to `*sink`.
class StageTimer {
 public:
  StageTimer(const Clock& clock, double* sink) : clock_(clock), sink_(sink), t0_(clock.now()) {}
  ~StageTimer() { *sink_ += seconds_since(clock_, t0_); }
  StageTimer(const StageTimer&) = delete;
  StageTimer& operator=(const StageTimer&) = delete;

 private:
  const Clock& clock_;
  double* sink_;
  Clock::time_point t0_;
};

// Tracks the sends of one step. Shared with the transport's callbacks, so it outlives an
// early return; it also keeps the caller's buffers (keepalive) and the headers alive.
class SendGroup {
 public:
  explicit SendGroup(std::shared_ptr<const void> keepalive) : keepalive_(std::move(keepalive)) {}

  // `ticket`, when given, names this send for wait_for(); `bulk`: through Transport::send_bulk.
  static Status send(const std::shared_ptr<SendGroup>& group, const ExchangeContext& ctx, uint32_t peer,
                     wire::WireHeader header, std::span<const std::byte> payload, ExchangeStats* stats,
                     size_t* ticket = nullptr, bool bulk = false) {
    HeaderBytes* bytes;
    size_t id;
    {
      std::lock_guard<std::mutex> lock(group->mu_);
      bytes = &group->headers_.emplace_back();
      ++group->outstanding_;
      id = group->done_.size();
      group->done_.push_back(false);
    }
    if (ticket != nullptr) *ticket = id;
    wire::seal(header, payload, std::span<std::byte, wire::kHeaderBytes>(*bytes));
    const uint64_t size = wire::kHeaderBytes + payload.size();
    const bool sample = size >= kLinkSampleMinBytes;
    Metrics* metrics = ctx.metrics;
    const Clock* clock = ctx.clock;
    const auto started = clock->now();
    if (sample) {
      std::lock_guard<std::mutex> lock(group->mu_);
      if (group->link_in_flight_++ == 0) group->link_busy_since_ = started;
    }
    auto on_done = [group, peer, &ctx_name = *ctx.transport, metrics, clock, size, sample, started,
                    id](const Status& s) {
      const auto now = clock->now();
      if (metrics && s.ok()) metrics->observe_link(peer, size, std::chrono::duration<double>(now - started).count());
      std::lock_guard<std::mutex> lock(group->mu_);
      if (!s.ok() && group->first_error_.ok()) {
        group->first_error_ = s.with_context("sending to " + ctx_name.peer_name(peer));
      }
      if (sample) group->link_done(s.ok() ? size : 0, now);
      --group->outstanding_;
      group->done_[id] = true;
      group->cv_.notify_all();
    };
    Status queued = bulk ? ctx.transport->send_bulk(peer, *bytes, payload, std::move(on_done))
                         : ctx.transport->send(peer, *bytes, payload, std::move(on_done));
    if (!queued.ok()) {
      std::lock_guard<std::mutex> lock(group->mu_);
      if (sample) group->link_done(0, clock->now());
      --group->outstanding_;
      group->done_[id] = true;
      return queued.with_context("sending to " + ctx.transport->peer_name(peer));
    }
    stats->bytes_sent += size;
    stats->messages_sent += 1;
    if (metrics) metrics->add_bytes_sent(peer, size);
    return Status::Ok();
  }

  // Waits until every send completed or `deadline` on `clock` passed.
  Status wait(const Clock& clock, Clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!wait_until(cv_, lock, clock, deadline, [&] { return outstanding_ == 0; })) {
      return deadline_exceeded(std::to_string(outstanding_) + " send(s) did not complete in time");
    }
    return first_error_;
  }

  // Waits until the send `ticket` names completed (or failed: the error is the group's first)
  // or `deadline` on `clock` passed.
  Status wait_for(size_t ticket, const Clock& clock, Clock::time_point deadline) {
    std::unique_lock<std::mutex> lock(mu_);
    if (!wait_until(cv_, lock, clock, deadline, [&] { return done_[ticket]; })) {
      return deadline_exceeded("a ring segment's send did not complete in time");
    }
    return first_error_;
  }

  // Adds the link bytes and busy time of the sends completed so far to *stats (call after wait).
  void add_link(ExchangeStats* stats) {
    std::lock_guard<std::mutex> lock(mu_);
    stats->link_bytes += link_bytes_;
    stats->link_seconds += link_seconds_;
    link_bytes_ = 0;
    link_seconds_ = 0;
  }

 private:
  // A sampled send finished (`bytes` 0 when it failed). Caller holds mu_.
  void link_done(uint64_t bytes, Clock::time_point now) {
    link_bytes_ += bytes;
    if (--link_in_flight_ == 0) link_seconds_ += std::chrono::duration<double>(now - link_busy_since_).count();
  }

  std::shared_ptr<const void> keepalive_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<HeaderBytes> headers_;  // guarded by mu_; deque: stable addresses
  int outstanding_ = 0;              // guarded by mu_
  std::deque<bool> done_;            // guarded by mu_: by ticket, whether that send completed
  Status first_error_;               // guarded by mu_
  int link_in_flight_ = 0;           // guarded by mu_: sampled sends posted, not completed
  Clock::time_point link_busy_since_;  // guarded by mu_
  uint64_t link_bytes_ = 0;          // guarded by mu_
  double link_seconds_ = 0;          // guarded by mu_
};

wire::WireHeader make_header(const ExchangeContext& ctx, wire::Kind kind, uint32_t tensor_id, uint64_t step) {
  wire::WireHeader h{};
  h.magic = wire::kMagic;
  h.version = wire::kVersion;
  h.kind = static_cast<uint16_t>(kind);
  h.job_id = ctx.job_id;
  h.sender_rank = ctx.rank;
  h.tensor_id = tensor_id;
  h.step = step;
  h.epoch = ctx.epoch;
  h.incarnation = ctx.incarnation;
  return h;
}

std::span<const std::byte> as_bytes(std::span<const float> v) { return std::as_bytes(v); }

// Element range of ring chunk c.
std::pair<size_t, size_t> chunk_range(size_t n, uint32_t world, uint32_t c) {
  return {n * c / world, n * (c + 1) / world};
}

// A ring chunk goes as ring_segments() messages of at most `segment` elements each (one message
// for an empty chunk); the sender and the receiver of a chunk count them from its length alone.
size_t ring_segments(size_t len, size_t segment) { return len <= segment ? 1 : (len + segment - 1) / segment; }

// Element range of segment j of the `count` segments of [b, e).
std::pair<size_t, size_t> segment_range(size_t b, size_t e, size_t count, size_t j) {
  const size_t len = e - b;
  return {b + len * j / count, b + len * (j + 1) / count};
}

// The chunks rank `rank` sends and receives in ring phase `phase` (0 .. 2w-3): reduce-scatter
// first, then all-gather. What it receives in phase p is what it sends in phase p + 1.
struct RingPhase {
  bool reduce;
  uint32_t send_c, recv_c;
};
RingPhase ring_phase(uint32_t rank, uint32_t w, uint32_t phase) {
  const bool reduce = phase < w - 1;
  const uint32_t s = reduce ? phase : phase - (w - 1);
  return {reduce, reduce ? (rank + w - s) % w : (rank + 1 + w - s) % w,
          reduce ? (rank + 2 * w - s - 1) % w : (rank + w - s) % w};
}

// Waits for every send of `group` (bounded by the step deadline) whatever `body` returned: a
// zero-copy send owns its buffers until it completes, on error paths too.
Status finish_sends(const ExchangeContext& ctx, SendGroup& group, Status body, ExchangeStats* stats) {
  StageTimer timer(*ctx.clock, &stats->send_seconds);
  Status sent = group.wait(*ctx.clock, ctx.deadline);
  group.add_link(stats);
  if (body.ok()) return sent;
  if (sent.code() == Code::kDeadlineExceeded) {
    SC_LOG_ERROR("a failed step left sends in flight past its deadline: {}", sent.message());
    return body.with_context(sent.message());
  }
  return body;
}

Status sparse_allgather_body(const ExchangeContext& ctx, const std::shared_ptr<SendGroup>& group, uint32_t tensor_id,
                             uint64_t step, kernels::Format format, kernels::ValueType value_type, uint64_t nnz,
                             uint64_t dense_len, std::span<const std::byte> payload, const PayloadConsumer& consume,
                             ExchangeStats* stats) {
  wire::WireHeader h = make_header(ctx, wire::Kind::kData, tensor_id, step);
  h.format = static_cast<uint16_t>(format);
  h.value_type = static_cast<uint16_t>(value_type);
  h.dense_len = dense_len;
  h.nnz = nnz;
  h.payload_bytes = payload.size();
  {
    StageTimer timer(*ctx.clock, &stats->send_seconds);
    for (uint32_t peer = 0; peer < ctx.world_size; ++peer) {
      if (peer == ctx.rank) continue;
      SC_RETURN_IF_ERROR(SendGroup::send(group, ctx, peer, h, payload, stats));
    }
  }
  if (ctx.while_waiting) ctx.while_waiting();
  // In rank order, so that every node computes the same bits.
  GatheredPayload g;
  for (uint32_t r = 0; r < ctx.world_size; ++r) {
    g.rank = r;
    if (r == ctx.rank) {
      g.format = format;
      g.value_type = value_type;
      g.nnz = nnz;
      g.payload = payload;
      g.from = "own selection";
      StageTimer timer(*ctx.clock, &stats->decode_seconds);
      SC_RETURN_IF_ERROR(consume(g).with_context("decoding own selection"));
      continue;
    }
    std::string name = ctx.transport->peer_name(r);
    auto waited = ctx.clock->now();
    auto taken = ctx.mailbox->take(wire::Kind::kData, r, tensor_id, step, 0, ctx.incarnation, ctx.deadline, name);
    stats->wait_seconds += seconds_since(*ctx.clock, waited);
    SC_ASSIGN_OR_RETURN(Envelope e, std::move(taken));
    if (e.header.dense_len != dense_len) {
      return data_loss(name + " sent tensor " + std::to_string(tensor_id) + " with " +
                       std::to_string(e.header.dense_len) + " elements; this node has " + std::to_string(dense_len));
    }
    if (e.header.epoch != ctx.epoch) {
      return failed_precondition(name + " sent step " + std::to_string(step) + " under decision epoch " +
                                 std::to_string(e.header.epoch) + "; this node is at epoch " +
                                 std::to_string(ctx.epoch));
    }
    g.format = static_cast<kernels::Format>(e.header.format);
    g.value_type = static_cast<kernels::ValueType>(e.header.value_type);
    g.nnz = e.header.nnz;
    g.payload = e.payload;
    g.from = name;
    StageTimer timer(*ctx.clock, &stats->decode_seconds);
    SC_RETURN_IF_ERROR(consume(g).with_context("decoding from " + name));
  }
  return Status::Ok();
}

// The ring, in segments: rank r sends phase 0's chunk at once, and every segment it receives in
// phase p is reduced (or copied) and, unless p is the last phase, sent on as phase p + 1's
// segment straight away. So both of a node's links carry the step's bytes back to back rather
// than one phase at a time behind the slower neighbour: on a shaped link a rendezvous send's
// reply and the transport's acknowledgements queue behind the reverse direction's bulk data,
// and two phases of one message each took twice the link's time ("The dense ring in segments",
// docs/benchmarks.md). Every element is still summed once, in the same order, whatever the
// segment size: the bits are those of a one-message ring.
Status ring_allreduce_body(const ExchangeContext& ctx, const std::shared_ptr<SendGroup>& group, uint32_t tensor_id,
                           uint64_t step, std::span<float> data, ExchangeStats* stats) {
  const uint32_t w = ctx.world_size;
  const uint32_t right = (ctx.rank + 1) % w;
  const uint32_t left = (ctx.rank + w - 1) % w;
  const std::string left_name = ctx.transport->peer_name(left);
  const size_t n = data.size();
  const size_t segment = std::max<size_t>(ctx.ring_segment_elements, 1);
  const uint32_t phases = 2 * (w - 1);
  // A message's `chunk` field: phase * per_phase + segment (every chunk has at most per_phase).
  const uint64_t per_phase = ring_segments((n + w - 1) / w, segment);
  if (per_phase * phases > std::numeric_limits<uint32_t>::max()) {
    return invalid_argument("a ring of " + std::to_string(w) + " nodes cannot segment " + std::to_string(n) +
                            " elements in 2^32 messages");
  }
  // The ticket of each segment's send, by phase: the all-gather overwrites what the
  // reduce-scatter sent (zero-copy) only once that send completed.
  std::vector<std::vector<size_t>> tickets(phases);

  auto post = [&](uint32_t phase, size_t j) -> Status {
    const RingPhase rp = ring_phase(ctx.rank, w, phase);
    auto [cb, ce] = chunk_range(n, w, rp.send_c);
    const size_t count = ring_segments(ce - cb, segment);
    auto [sb, se] = segment_range(cb, ce, count, j);
    auto send_span = as_bytes(std::span<const float>(data.data() + sb, se - sb));
    wire::WireHeader h = make_header(ctx, wire::Kind::kData, tensor_id, step);
    h.format = static_cast<uint16_t>(kernels::Format::kDense);
    h.value_type = static_cast<uint16_t>(kernels::ValueType::kF32);
    h.dense_len = se - sb;
    h.nnz = se - sb;
    h.payload_bytes = send_span.size();
    h.chunk = static_cast<uint32_t>(phase * per_phase + j);
    tickets[phase].resize(count);
    StageTimer timer(*ctx.clock, &stats->send_seconds);
    return SendGroup::send(group, ctx, right, h, send_span, stats, &tickets[phase][j], /*bulk=*/true);
  };

  {
    auto [cb, ce] = chunk_range(n, w, ring_phase(ctx.rank, w, 0).send_c);
    for (size_t j = 0, count = ring_segments(ce - cb, segment); j < count; ++j) SC_RETURN_IF_ERROR(post(0, j));
  }
  for (uint32_t phase = 0; phase < phases; ++phase) {
    const RingPhase rp = ring_phase(ctx.rank, w, phase);
    auto [rb, re] = chunk_range(n, w, rp.recv_c);
    const size_t count = ring_segments(re - rb, segment);
    for (size_t j = 0; j < count; ++j) {
      auto [sb, se] = segment_range(rb, re, count, j);
      const uint32_t id = static_cast<uint32_t>(phase * per_phase + j);
      auto waited = ctx.clock->now();
      auto taken = ctx.mailbox->take(wire::Kind::kData, left, tensor_id, step, id, ctx.incarnation, ctx.deadline,
                                     left_name);
      stats->wait_seconds += seconds_since(*ctx.clock, waited);
      SC_ASSIGN_OR_RETURN(Envelope e, std::move(taken));
      if (e.header.dense_len != se - sb || e.header.format != static_cast<uint16_t>(kernels::Format::kDense) ||
          e.header.value_type != static_cast<uint16_t>(kernels::ValueType::kF32) ||
          e.payload.size() != (se - sb) * sizeof(float)) {
        return data_loss(left_name + " sent ring phase " + std::to_string(phase) + " segment " + std::to_string(j) +
                         " of tensor " + std::to_string(tensor_id) + " with " + std::to_string(e.header.dense_len) +
                         " dense elements; expected " + std::to_string(se - sb));
      }
      if (e.header.epoch != ctx.epoch) {
        return failed_precondition(left_name + " is at decision epoch " + std::to_string(e.header.epoch) +
                                   "; this node is at epoch " + std::to_string(ctx.epoch));
      }
      std::span<float> target(data.data() + sb, se - sb);
      if (!rp.reduce) {
        // This segment went out in reduce-scatter phase `phase - (w - 1)` (the same chunk and
        // the same segments): that send must be done before it is overwritten.
        StageTimer timer(*ctx.clock, &stats->send_seconds);
        SC_RETURN_IF_ERROR(group->wait_for(tickets[phase - (w - 1)][j], *ctx.clock, ctx.deadline));
      }
      if (!target.empty()) {
        StageTimer timer(*ctx.clock, rp.reduce ? &stats->reduce_seconds : &stats->decode_seconds);
        if (rp.reduce) {
          SC_RETURN_IF_ERROR(kernels::decode_accumulate(kernels::Format::kDense, kernels::ValueType::kF32,
                                                        e.payload, e.header.nnz, target, ctx.kernel_pool)
                                 .with_context("reducing ring chunk from " + left_name));
        } else {
          std::memcpy(target.data(), e.payload.data(), target.size_bytes());
        }
      }
      if (phase + 1 < phases) SC_RETURN_IF_ERROR(post(phase + 1, j));
    }
  }
  return Status::Ok();
}

}  // namespace

Status sparse_allgather_each(const ExchangeContext& ctx, uint32_t tensor_id, uint64_t step, kernels::Format format,
                             kernels::ValueType value_type, uint64_t nnz, uint64_t dense_len,
                             std::span<const std::byte> payload, const PayloadConsumer& consume, ExchangeStats* stats) {
  auto group = std::make_shared<SendGroup>(ctx.keepalive);
  Status body = sparse_allgather_body(ctx, group, tensor_id, step, format, value_type, nnz, dense_len, payload,
                                      consume, stats);
  return finish_sends(ctx, *group, std::move(body), stats);
}

Status sparse_allgather(const ExchangeContext& ctx, uint32_t tensor_id, uint64_t step, kernels::Format format,
                        kernels::ValueType value_type, uint64_t nnz, std::span<const std::byte> payload,
                        std::span<float> out, ExchangeStats* stats) {
  std::fill(out.begin(), out.end(), 0.0f);
  auto decode = [&](const GatheredPayload& g) {
    return kernels::decode_accumulate(g.format, g.value_type, g.payload, g.nnz, out, ctx.kernel_pool);
  };
  return sparse_allgather_each(ctx, tensor_id, step, format, value_type, nnz, out.size(), payload, decode, stats);
}

Status ring_allreduce(const ExchangeContext& ctx, uint32_t tensor_id, uint64_t step, std::span<float> data,
                      ExchangeStats* stats) {
  if (ctx.world_size == 1) return Status::Ok();
  auto group = std::make_shared<SendGroup>(ctx.keepalive);
  Status body = ring_allreduce_body(ctx, group, tensor_id, step, data, stats);
  return finish_sends(ctx, *group, std::move(body), stats);
}

uint64_t ring_allreduce_bytes(uint64_t n, uint32_t world, uint32_t rank, size_t segment) {
  if (world <= 1) return 0;
  uint64_t total = 0;
  for (uint32_t phase = 0; phase < 2 * (world - 1); ++phase) {
    auto [b, e] = chunk_range(n, world, ring_phase(rank, world, phase).send_c);
    total += ring_segments(e - b, segment) * wire::kHeaderBytes + (e - b) * sizeof(float);
  }
  return total;
}

void broadcast_abort(const ExchangeContext& ctx, uint32_t tensor_id, uint64_t step, const std::string& reason) {
  if (ctx.transport == nullptr || ctx.world_size == 1) return;
  auto text = std::make_shared<std::string>(reason.substr(0, 1024));
  auto group = std::make_shared<SendGroup>(text);
  wire::WireHeader h = make_header(ctx, wire::Kind::kAbort, tensor_id, step);
  auto payload = std::as_bytes(std::span<const char>(text->data(), text->size()));
  h.payload_bytes = payload.size();
  ExchangeStats ignored;
  for (uint32_t peer = 0; peer < ctx.world_size; ++peer) {
    if (peer == ctx.rank) continue;
    SendGroup::send(group, ctx, peer, h, payload, &ignored).ignore();
  }
}

}  // namespace sparsecar
