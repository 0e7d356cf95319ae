#include "daemon/collective/collective.h"

#include <array>
#include <condition_variable>
#include <cstring>
#include <deque>
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

  static Status send(const std::shared_ptr<SendGroup>& group, const ExchangeContext& ctx, uint32_t peer,
                     wire::WireHeader header, std::span<const std::byte> payload, ExchangeStats* stats) {
    HeaderBytes* bytes;
    {
      std::lock_guard<std::mutex> lock(group->mu_);
      bytes = &group->headers_.emplace_back();
      ++group->outstanding_;
    }
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
    Status queued = ctx.transport->send(peer, *bytes, payload, [group, peer, &ctx_name = *ctx.transport, metrics, clock,
                                                                 size, sample, started](const Status& s) {
      const auto now = clock->now();
      if (metrics && s.ok()) metrics->observe_link(peer, size, std::chrono::duration<double>(now - started).count());
      std::lock_guard<std::mutex> lock(group->mu_);
      if (!s.ok() && group->first_error_.ok()) {
        group->first_error_ = s.with_context("sending to " + ctx_name.peer_name(peer));
      }
      if (sample) group->link_done(s.ok() ? size : 0, now);
      --group->outstanding_;
      group->cv_.notify_all();
    });
    if (!queued.ok()) {
      std::lock_guard<std::mutex> lock(group->mu_);
      if (sample) group->link_done(0, clock->now());
      --group->outstanding_;
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

Status ring_allreduce_body(const ExchangeContext& ctx, const std::shared_ptr<SendGroup>& group, uint32_t tensor_id,
                           uint64_t step, std::span<float> data, ExchangeStats* stats) {
  const uint32_t w = ctx.world_size;
  const uint32_t right = (ctx.rank + 1) % w;
  const uint32_t left = (ctx.rank + w - 1) % w;
  const std::string left_name = ctx.transport->peer_name(left);
  const size_t n = data.size();

  // Phases 0 .. w-2 reduce-scatter, w-1 .. 2w-3 all-gather. In phase p this rank sends chunk
  // `send_c` to the right and receives chunk `recv_c` from the left.
  for (uint32_t phase = 0; phase < 2 * (w - 1); ++phase) {
    const bool reduce = phase < w - 1;
    const uint32_t s = reduce ? phase : phase - (w - 1);
    const uint32_t send_c = reduce ? (ctx.rank + w - s) % w : (ctx.rank + 1 + w - s) % w;
    const uint32_t recv_c = reduce ? (ctx.rank + 2 * w - s - 1) % w : (ctx.rank + w - s) % w;
    auto [sb, se] = chunk_range(n, w, send_c);
    auto send_span = as_bytes(std::span<const float>(data.data() + sb, se - sb));
    wire::WireHeader h = make_header(ctx, wire::Kind::kData, tensor_id, step);
    h.format = static_cast<uint16_t>(kernels::Format::kDense);
    h.value_type = static_cast<uint16_t>(kernels::ValueType::kF32);
    h.dense_len = se - sb;
    h.nnz = se - sb;
    h.payload_bytes = send_span.size();
    h.chunk = phase;
    {
      StageTimer timer(*ctx.clock, &stats->send_seconds);
      SC_RETURN_IF_ERROR(SendGroup::send(group, ctx, right, h, send_span, stats));
    }
    auto waited = ctx.clock->now();
    auto taken = ctx.mailbox->take(wire::Kind::kData, left, tensor_id, step, phase, ctx.incarnation, ctx.deadline,
                                     left_name);
    stats->wait_seconds += seconds_since(*ctx.clock, waited);
    SC_ASSIGN_OR_RETURN(Envelope e, std::move(taken));
    auto [rb, re] = chunk_range(n, w, recv_c);
    if (e.header.dense_len != re - rb || e.header.format != static_cast<uint16_t>(kernels::Format::kDense)) {
      return data_loss(left_name + " sent ring phase " + std::to_string(phase) + " of tensor " +
                       std::to_string(tensor_id) + " with " + std::to_string(e.header.dense_len) +
                       " dense elements; expected " + std::to_string(re - rb));
    }
    if (e.header.epoch != ctx.epoch) {
      return failed_precondition(left_name + " is at decision epoch " + std::to_string(e.header.epoch) +
                                 "; this node is at epoch " + std::to_string(ctx.epoch));
    }
    // The chunk we are about to overwrite was sent in an earlier phase: make sure that send is
    // complete before touching it.
    {
      StageTimer timer(*ctx.clock, &stats->send_seconds);
      SC_RETURN_IF_ERROR(group->wait(*ctx.clock, ctx.deadline));
    }
    std::span<float> target(data.data() + rb, re - rb);
    if (target.empty()) continue;  // more nodes than elements: this chunk is empty
    StageTimer timer(*ctx.clock, reduce ? &stats->reduce_seconds : &stats->decode_seconds);
    if (reduce) {
      SC_RETURN_IF_ERROR(kernels::decode_accumulate(kernels::Format::kDense, kernels::ValueType::kF32, e.payload,
                                                    e.header.nnz, target, ctx.kernel_pool)
                             .with_context("reducing ring chunk from " + left_name));
    } else {
      std::memcpy(target.data(), e.payload.data(), target.size_bytes());
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

uint64_t ring_allreduce_bytes(uint64_t n, uint32_t world, uint32_t rank) {
  if (world <= 1) return 0;
  uint64_t total = 0;
  for (uint32_t phase = 0; phase < 2 * (world - 1); ++phase) {
    const bool reduce = phase < world - 1;
    const uint32_t s = reduce ? phase : phase - (world - 1);
    const uint32_t send_c = reduce ? (rank + world - s) % world : (rank + 1 + world - s) % world;
    auto [b, e] = chunk_range(n, world, send_c);
    total += wire::kHeaderBytes + (e - b) * sizeof(float);
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
