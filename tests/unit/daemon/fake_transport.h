// FakeNetwork: an in-process Transport for unit tests. W endpoints; a delivery thread hands each
// sent message to the receiver's MessageSink (like a transport's progress thread would) and then
// runs the sender's completion. Fault injection: kill a rank, corrupt the next message from a
// rank, or hold back every message from a rank.
//
// Zero-copy like UCX: send() keeps only the caller's spans and the bytes are read at delivery
// time, so a sender that rewrites or frees a buffer before its completion ran is caught (the
// receiver sees the rewritten bytes, or ASan the freed ones). hold() keeps a sender's messages
// queued until release(), to widen that window in tests.
#pragma once

#include <algorithm>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <span>
#include <thread>
#include <vector>

#include "daemon/transport/transport.h"

namespace sparsecar::fakes {

class FakeNetwork {
 public:
  explicit FakeNetwork(uint32_t world) : sinks_(world, nullptr) {
    for (uint32_t r = 0; r < world; ++r) endpoints_.push_back(std::make_unique<Endpoint>(this, r));
    thread_ = std::thread([this] { run(); });
  }
  ~FakeNetwork() {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
      cv_.notify_all();
    }
    thread_.join();
  }

  void attach(uint32_t rank, MessageSink* sink) { sinks_[rank] = sink; }
  Transport* transport(uint32_t rank) { return endpoints_[rank].get(); }
  uint32_t world() const { return static_cast<uint32_t>(sinks_.size()); }

  // Rank `rank` dies: its queued and future messages vanish, everyone else is told.
  void kill(uint32_t rank) {
    std::vector<MessageSink*> others;
    {
      std::lock_guard<std::mutex> lock(mu_);
      dead_.insert(rank);
    }
    for (uint32_t r = 0; r < world(); ++r) {
      if (r != rank && sinks_[r]) sinks_[r]->on_peer_failed(rank, unavailable("killed by the test"));
    }
  }
  // Flip one byte at `offset` (header + payload concatenated) of the next message `rank` sends.
  void corrupt_next_from(uint32_t rank, size_t offset) {
    std::lock_guard<std::mutex> lock(mu_);
    corrupt_[rank] = offset;
  }
  // Messages from `rank` are silently dropped (a stopped peer).
  void silence(uint32_t rank) {
    std::lock_guard<std::mutex> lock(mu_);
    silenced_.insert(rank);
  }
  // Sees every delivered message (header and payload) on the delivery thread, before its
  // receiver does: for tests that check what went over the wire.
  using Tap = std::function<void(uint32_t from, uint32_t to, std::span<const std::byte> header,
                                 std::span<const std::byte> payload)>;
  void set_tap(Tap tap) {
    std::lock_guard<std::mutex> lock(mu_);
    tap_ = std::move(tap);
  }
  // Messages from `rank` stay queued (not delivered, not completed) until release(); the others
  // keep flowing, each sender's in order.
  void hold(uint32_t rank) {
    std::lock_guard<std::mutex> lock(mu_);
    held_.insert(rank);
  }
  void release() {
    std::lock_guard<std::mutex> lock(mu_);
    held_.clear();
    cv_.notify_all();
  }
  // Messages sent and not yet delivered (held ones included).
  size_t queued() const {
    std::lock_guard<std::mutex> lock(mu_);
    return queue_.size();
  }
  uint64_t delivered() const {
    std::lock_guard<std::mutex> lock(mu_);
    return delivered_;
  }

 private:
  struct Message {
    uint32_t from, to;
    std::span<const std::byte> header, payload;  // the sender's buffers, read at delivery
    SendCallback done;
    size_t corrupt_at = SIZE_MAX;  // byte of header + payload to flip at delivery
  };

  class Endpoint final : public Transport {
   public:
    Endpoint(FakeNetwork* net, uint32_t rank) : net_(net), rank_(rank) {}
    uint32_t rank() const override { return rank_; }
    uint32_t world_size() const override { return net_->world(); }
    std::string peer_name(uint32_t peer) const override { return "rank " + std::to_string(peer) + " (fake)"; }
    Status send(uint32_t peer, std::span<const std::byte> header, std::span<const std::byte> payload,
                SendCallback done) override {
      if (peer >= net_->world() || peer == rank_) return invalid_argument("bad peer");
      Message m{rank_, peer, header, payload, std::move(done)};
      std::lock_guard<std::mutex> lock(net_->mu_);
      if (net_->dead_.count(rank_)) return unavailable("this rank is dead");
      auto c = net_->corrupt_.find(rank_);
      if (c != net_->corrupt_.end()) {
        m.corrupt_at = c->second;
        net_->corrupt_.erase(c);
      }
      net_->queue_.push_back(std::move(m));
      net_->cv_.notify_all();
      return Status::Ok();
    }
    void stop() override {}

   private:
    FakeNetwork* net_;
    uint32_t rank_;
  };

  void run() {
    for (;;) {
      Message m;
      bool drop = false;
      bool to_dead = false;
      Tap tap;
      {
        std::unique_lock<std::mutex> lock(mu_);
        auto next = queue_.end();
        cv_.wait(lock, [&] {
          next = std::find_if(queue_.begin(), queue_.end(), [&](const Message& q) { return !held_.count(q.from); });
          return stopping_ || next != queue_.end();
        });
        if (next == queue_.end()) return;  // stopping, and nothing deliverable is left
        m = std::move(*next);
        queue_.erase(next);
        to_dead = dead_.count(m.to) > 0;
        drop = dead_.count(m.from) || to_dead || silenced_.count(m.from);
        if (!drop) ++delivered_;
        if (!drop) tap = tap_;
      }
      // Read the sender's buffers now, as a zero-copy transport would.
      std::vector<std::byte> header(m.header.begin(), m.header.end());
      std::vector<std::byte> payload(m.payload.begin(), m.payload.end());
      if (m.corrupt_at < header.size()) {
        header[m.corrupt_at] ^= std::byte{0x40};
      } else if (m.corrupt_at != SIZE_MAX && m.corrupt_at - header.size() < payload.size()) {
        payload[m.corrupt_at - header.size()] ^= std::byte{0x40};
      }
      if (tap) tap(m.from, m.to, header, payload);
      if (!drop && sinks_[m.to]) sinks_[m.to]->on_message(m.from, header, payload);
      if (m.done) m.done(to_dead ? unavailable("peer dead") : Status::Ok());
    }
  }

  std::vector<MessageSink*> sinks_;
  std::vector<std::unique_ptr<Endpoint>> endpoints_;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Message> queue_;
  std::set<uint32_t> dead_, silenced_;
  std::map<uint32_t, size_t> corrupt_;
  std::set<uint32_t> held_;
  uint64_t delivered_ = 0;
  Tap tap_;
  bool stopping_ = false;
  std::thread thread_;
};

}  // namespace sparsecar::fakes
