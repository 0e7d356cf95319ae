#include "daemon/collective/mailbox.h"

#include <algorithm>

#include "daemon/metrics/metrics.h"
#include "sparsecar/common/clock_wait.h"
#include "sparsecar/common/log.h"

namespace sparsecar {

Mailbox::Mailbox(uint64_t job_id, uint32_t world_size, Metrics* metrics, uint64_t max_bytes_per_peer,
                 const Clock& clock)
    : job_id_(job_id),
      world_size_(world_size),
      metrics_(metrics),
      max_bytes_per_peer_(max_bytes_per_peer),
      clock_(clock),
      peer_failures_(world_size),
      down_since_(world_size),
      rejoins_(world_size, 0),
      buffered_(world_size, 0) {}

std::map<Mailbox::Key, Envelope>::iterator Mailbox::erase_message(std::map<Key, Envelope>::iterator it) {
  const uint32_t peer = std::get<1>(it->first);
  if (peer < buffered_.size()) buffered_[peer] -= it->second.payload.size();
  return messages_.erase(it);
}

uint64_t Mailbox::buffered_bytes(uint32_t peer) const {
  std::lock_guard<std::mutex> lock(mu_);
  return peer < buffered_.size() ? buffered_[peer] : 0;
}

void Mailbox::reject(uint32_t peer, const Status& why, const wire::WireHeader* trusted_header) {
  rejected_.fetch_add(1);
  if (metrics_) metrics_->messages_rejected.Increment();
  SC_LOG_WARN("rejected message from rank {}: {}", peer, why.to_string());
  if (trusted_header == nullptr) return;
  std::lock_guard<std::mutex> lock(mu_);
  // A message of another job must not fail a step of this one.
  if (incarnation_ != 0 && trusted_header->incarnation != incarnation_) return;
  // The step fails with the reason's code: kDataLoss for a corrupt message, kResourceExhausted
  // for one over the peer's byte limit.
  step_failures_[{peer, trusted_header->tensor_id, trusted_header->step, trusted_header->incarnation}] =
      Status(why.code(), "rank " + std::to_string(peer) + " sent a message for tensor " +
                             std::to_string(trusted_header->tensor_id) + " step " +
                             std::to_string(trusted_header->step) + " that was rejected: " + why.message());
  cv_.notify_all();
}

void Mailbox::on_message(uint32_t peer, std::span<const std::byte> header_bytes,
                         std::span<const std::byte> payload) {
  if (metrics_) metrics_->add_bytes_received(peer, header_bytes.size() + payload.size());
  if (header_bytes.size() != wire::kHeaderBytes) {
    reject(peer, data_loss("header is " + std::to_string(header_bytes.size()) + " bytes, expected " +
                               std::to_string(wire::kHeaderBytes)),
           nullptr);
    return;
  }
  std::span<const std::byte, wire::kHeaderBytes> fixed(header_bytes.data(), wire::kHeaderBytes);
  wire::WireHeader h = wire::decode_header(fixed);
  wire::Expectations expect;
  expect.job_id = job_id_;
  expect.world_size = world_size_;
  expect.sender_rank = peer;
  Status valid = wire::validate_header(h, expect, payload.size());
  if (!valid.ok()) {
    reject(peer, valid, nullptr);
    return;
  }
  Status checksum = wire::verify_checksum(fixed, payload);
  if (!checksum.ok()) {
    // The header passed every field check; its (tensor, step) most likely is what the sender
    // meant, so fail that step at once rather than let it run into the deadline.
    reject(peer, checksum, &h);
    return;
  }
  auto kind = static_cast<wire::Kind>(h.kind);
  if (kind == wire::Kind::kProbe) {  // timed by the transport on its way in; nothing to keep
    SC_LOG_DEBUG("link probe from rank {}: {} bytes", peer, payload.size());
    if (metrics_) metrics_->probes_received.Increment();
    return;
  }
  if (h.kind >= static_cast<uint16_t>(wire::Kind::kDecision)) {
    ControlHandler handler;
    {
      std::lock_guard<std::mutex> lock(mu_);
      handler = control_;
    }
    if (handler) {
      handler(peer, h, payload);
    } else {
      SC_LOG_WARN("dropping a control message (kind {}) from rank {}: no handler", h.kind, peer);
    }
    return;
  }
  if (peer >= world_size_) {  // validate_header ties the sender to the peer; stay defensive
    reject(peer, data_loss("message from rank " + std::to_string(peer) + " outside the job"), nullptr);
    return;
  }
  if (kind == wire::Kind::kManifest) {
    ManifestHandler handler;
    {
      std::lock_guard<std::mutex> lock(mu_);
      handler = manifests_;
    }
    if (handler && handler(peer, h, payload)) return;
  }
  const bool job_scoped = kind == wire::Kind::kData || kind == wire::Kind::kAbort;
  std::unique_lock<std::mutex> lock(mu_);
  if (job_scoped && incarnation_ != 0 && h.incarnation != incarnation_) {
    lock.unlock();
    count_stale(1, "a message of another job incarnation arrived");
    return;
  }
  // Job-scoped messages are kept under their incarnation; the formation-level kinds under 0, so
  // a peer's newest manifest (always step 0) replaces its older one, whatever attempt it was for.
  const uint64_t key_incarnation = job_scoped ? h.incarnation : 0;
  if (kind != wire::Kind::kAbort) {
    // A repeated key replaces the stored message: only the difference counts.
    const Key key{h.kind, peer, h.tensor_id, h.step, h.chunk, key_incarnation};
    auto old = messages_.find(key);
    const uint64_t replaced = old != messages_.end() ? old->second.payload.size() : 0;
    if (buffered_[peer] - replaced + payload.size() > max_bytes_per_peer_) {
      const uint64_t waiting = buffered_[peer];
      lock.unlock();
      reject(peer,
             resource_exhausted("rank " + std::to_string(peer) + " has " + std::to_string(waiting) +
                                " bytes waiting; a message of " + std::to_string(payload.size()) +
                                " bytes would exceed mailbox_max_bytes = " + std::to_string(max_bytes_per_peer_)),
             &h);
      return;
    }
  }
  if (kind == wire::Kind::kAbort) {
    std::string reason(reinterpret_cast<const char*>(payload.data()), payload.size());
    step_failures_[{peer, h.tensor_id, h.step, h.incarnation}] =
        aborted("rank " + std::to_string(peer) + " aborted tensor " + std::to_string(h.tensor_id) + " step " +
                std::to_string(h.step) + ": " + reason);
  } else {
    Envelope& e = messages_[{h.kind, peer, h.tensor_id, h.step, h.chunk, key_incarnation}];
    buffered_[peer] -= e.payload.size();
    e.header = h;
    e.payload.assign(payload.begin(), payload.end());
    buffered_[peer] += e.payload.size();
  }
  cv_.notify_all();
}

void Mailbox::set_manifest_handler(ManifestHandler handler) {
  std::lock_guard<std::mutex> lock(mu_);
  manifests_ = std::move(handler);
}

void Mailbox::set_control_handler(ControlHandler handler) {
  std::lock_guard<std::mutex> lock(mu_);
  control_ = std::move(handler);
}

void Mailbox::on_rejected(uint32_t /*peer*/, const Status& /*why*/) {
  if (metrics_) metrics_->count_error(ErrorKind::kTransportRejected);
}

void Mailbox::on_peer_failed(uint32_t peer, const Status& why) {
  std::lock_guard<std::mutex> lock(mu_);
  if (peer < peer_failures_.size() && peer_failures_[peer].ok()) {
    peer_failures_[peer] = unavailable("rank " + std::to_string(peer) + " failed: " + why.message());
    down_since_[peer] = clock_.now();
    // What the lost process sent is of no use to anyone now (every take from it fails), and must
    // not be taken once a replacement of that rank is back.
    for (auto it = messages_.begin(); it != messages_.end();) {
      it = std::get<1>(it->first) == peer ? erase_message(it) : std::next(it);
    }
    std::erase_if(step_failures_, [&](const auto& f) { return std::get<0>(f.first) == peer; });
  }
  cv_.notify_all();
}

void Mailbox::on_peer_rejoined(uint32_t peer) {
  std::lock_guard<std::mutex> lock(mu_);
  if (peer >= peer_failures_.size() || peer_failures_[peer].ok()) return;
  SC_LOG_INFO("rank {} is back (a replacement process) after {:.1f} s down", peer,
              std::chrono::duration<double>(clock_.now() - down_since_[peer]).count());
  peer_failures_[peer] = Status::Ok();
  rejoins_[peer] += 1;
  cv_.notify_all();
}

Expected<Envelope> Mailbox::take(wire::Kind kind, uint32_t peer, uint32_t tensor, uint64_t step,
                                 uint32_t chunk, uint64_t incarnation, Clock::time_point deadline,
                                 const std::string& peer_name) {
  std::unique_lock<std::mutex> lock(mu_);
  Key key{static_cast<uint16_t>(kind), peer, tensor, step, chunk, incarnation};
  for (;;) {
    auto it = messages_.find(key);
    if (it != messages_.end()) {
      Envelope e = std::move(it->second);
      it->second.payload.clear();  // moved-from: make the account's arithmetic independent of it
      buffered_[peer] -= e.payload.size();
      messages_.erase(it);
      return e;
    }
    if (cancelled_) return aborted("step cancelled (daemon resetting or stopping)");
    if (peer < peer_failures_.size() && !peer_failures_[peer].ok()) {
      return Status(Code::kUnavailable, peer_name + " is down: " + peer_failures_[peer].message());
    }
    auto failed = step_failures_.find({peer, tensor, step, incarnation});
    if (failed != step_failures_.end()) return failed->second;
    // The deadline is the clock's: wait in bounded real-time slices and look again after each.
    // Everything above has just been looked at, so a passed deadline is the answer.
    const Clock::duration slice = wait_slice(clock_, deadline);
    if (slice == Clock::duration::zero()) {
      return deadline_exceeded(peer_name + " did not deliver tensor " + std::to_string(tensor) + " step " +
                               std::to_string(step) + " in time");
    }
    cv_.wait_for(lock, slice);
  }
}

void Mailbox::drop_before(uint32_t tensor, uint64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto it = messages_.begin(); it != messages_.end();) {
    if (std::get<2>(it->first) == tensor && std::get<3>(it->first) < step &&
        std::get<0>(it->first) == static_cast<uint16_t>(wire::Kind::kData)) {
      it = erase_message(it);
    } else {
      ++it;
    }
  }
  for (auto it = step_failures_.begin(); it != step_failures_.end();) {
    if (std::get<1>(it->first) == tensor && std::get<2>(it->first) < step) {
      it = step_failures_.erase(it);
    } else {
      ++it;
    }
  }
}

uint64_t Mailbox::drop_other_incarnations(uint64_t keep) {
  uint64_t dropped = 0;
  for (auto it = messages_.begin(); it != messages_.end();) {
    const auto kind = static_cast<wire::Kind>(std::get<0>(it->first));
    const bool job_scoped = kind == wire::Kind::kData || kind == wire::Kind::kAbort;
    if (job_scoped && std::get<5>(it->first) != keep) {
      it = erase_message(it);
      ++dropped;
    } else {
      ++it;
    }
  }
  std::erase_if(step_failures_, [&](const auto& f) { return std::get<3>(f.first) != keep; });
  return dropped;
}

void Mailbox::begin_job() {
  uint64_t dropped = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    incarnation_ = 0;
    // Nothing of the next job can be here yet (it needs this node's manifest first), so every
    // data message, abort and ack belongs to a job that is over. Manifests stay.
    for (auto it = messages_.begin(); it != messages_.end();) {
      const auto kind = static_cast<wire::Kind>(std::get<0>(it->first));
      if (kind == wire::Kind::kManifest) {
        ++it;
        continue;
      }
      dropped += kind == wire::Kind::kManifestAck ? 0 : 1;
      it = erase_message(it);
    }
    step_failures_.clear();
  }
  count_stale(dropped, "messages of the finished job were still waiting at its reset");
}

void Mailbox::set_incarnation(uint64_t incarnation) {
  uint64_t dropped;
  {
    std::lock_guard<std::mutex> lock(mu_);
    incarnation_ = incarnation;
    dropped = drop_other_incarnations(incarnation);
    cv_.notify_all();
  }
  count_stale(dropped, "messages of another job incarnation were waiting when this one was agreed");
}

uint64_t Mailbox::incarnation() const {
  std::lock_guard<std::mutex> lock(mu_);
  return incarnation_;
}

void Mailbox::count_stale(uint64_t n, const char* why) {
  if (n == 0) return;
  const uint64_t before = stale_.fetch_add(n);
  if (metrics_) metrics_->count_error(ErrorKind::kWireStale, static_cast<double>(n));
  // The first few, then every 1000th: a flood of stale messages must not flood the log.
  if (before < 10 || (before + n) / 1000 != before / 1000) {
    SC_LOG_WARN("dropped {} stale message(s) ({} in all): {}", static_cast<unsigned long long>(n),
                static_cast<unsigned long long>(before + n), why);
  }
}

void Mailbox::cancel() {
  std::lock_guard<std::mutex> lock(mu_);
  cancelled_ = true;
  cv_.notify_all();
}

void Mailbox::resume() {
  std::lock_guard<std::mutex> lock(mu_);
  cancelled_ = false;
}

std::optional<Mailbox::PeerDown> Mailbox::first_peer_down() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::optional<PeerDown> first;
  for (uint32_t peer = 0; peer < peer_failures_.size(); ++peer) {
    if (peer_failures_[peer].ok()) continue;
    if (!first || down_since_[peer] < first->since) first = PeerDown{peer, peer_failures_[peer], down_since_[peer]};
  }
  return first;
}

std::optional<Mailbox::PeerDown> Mailbox::peer_down_past(Clock::duration grace) const {
  std::optional<PeerDown> down = first_peer_down();
  if (!down || clock_.now() - down->since < grace) return std::nullopt;
  return down;
}

uint64_t Mailbox::rejoined() const {
  std::lock_guard<std::mutex> lock(mu_);
  uint64_t all = 0;
  for (uint64_t n : rejoins_) all += n;
  return all;
}

uint64_t Mailbox::rejoined(uint32_t peer) const {
  std::lock_guard<std::mutex> lock(mu_);
  return peer < rejoins_.size() ? rejoins_[peer] : 0;
}

Status Mailbox::peer_status(uint32_t peer) const {
  std::lock_guard<std::mutex> lock(mu_);
  return peer < peer_failures_.size() ? peer_failures_[peer] : not_found("no such peer");
}

}  // namespace sparsecar
