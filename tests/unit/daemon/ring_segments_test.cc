// The dense ring in segments (collective.h): W nodes over the in-process FakeNetwork, each on its
// own thread. The result is checked against a plain reference written here from the ring's
// definition (chunk c starts at rank c and every later rank adds its own value in ring order, in
// float), so every segment size must give the bits of the one-message ring; and against float64.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <deque>
#include <mutex>
#include <thread>
#include <vector>

#include "daemon/collective/collective.h"
#include "daemon/collective/mailbox.h"
#include "tests/unit/daemon/fake_transport.h"
#include "tests/unit/daemon/pipeline_job.h"

namespace sparsecar {
namespace {

using namespace std::chrono_literals;

// Node r's chunk c is [n c / W, n (c + 1) / W): the ring's own split, restated.
std::vector<float> ring_reference(const std::vector<std::vector<float>>& in) {
  const size_t w = in.size(), n = in[0].size();
  std::vector<float> out(n);
  for (size_t c = 0; c < w; ++c) {
    for (size_t i = n * c / w; i < n * (c + 1) / w; ++i) {
      float acc = in[c][i];
      for (size_t k = 1; k < w; ++k) acc = in[(c + k) % w][i] + acc;
      out[i] = acc;
    }
  }
  return out;
}

struct RingRun {
  std::vector<Status> status;
  std::vector<ExchangeStats> stats;
};

// Runs one ring step on every node; node r's transport is transports[r] and its segment size
// segments[r]. `data[r]` becomes node r's result.
RingRun run_ring(std::vector<Transport*> transports, std::vector<Mailbox*> boxes, std::vector<size_t> segments,
                 std::vector<std::vector<float>>& data) {
  const uint32_t w = static_cast<uint32_t>(transports.size());
  RingRun run{std::vector<Status>(w), std::vector<ExchangeStats>(w)};
  std::vector<std::thread> threads;
  for (uint32_t r = 0; r < w; ++r) {
    threads.emplace_back([&, r] {
      ExchangeContext ctx;
      ctx.transport = transports[r];
      ctx.mailbox = boxes[r];
      ctx.rank = r;
      ctx.world_size = w;
      ctx.deadline = std::chrono::steady_clock::now() + 10s;
      ctx.ring_segment_elements = segments[r];
      run.status[r] = ring_allreduce(ctx, 0, 1, data[r], &run.stats[r]);
    });
  }
  for (auto& t : threads) t.join();
  return run;
}

struct Net {
  explicit Net(uint32_t w) : net(w) {
    for (uint32_t r = 0; r < w; ++r) {
      boxes.push_back(std::make_unique<Mailbox>(0, w, nullptr));
      net.attach(r, boxes.back().get());
    }
  }
  std::vector<Transport*> transports() {
    std::vector<Transport*> t;
    for (uint32_t r = 0; r < net.world(); ++r) t.push_back(net.transport(r));
    return t;
  }
  std::vector<Mailbox*> mailboxes() {
    std::vector<Mailbox*> b;
    for (auto& m : boxes) b.push_back(m.get());
    return b;
  }
  std::vector<std::unique_ptr<Mailbox>> boxes;  // outlive the network's delivery thread
  fakes::FakeNetwork net;
};

TEST(RingSegments, EverySegmentSizeGivesTheOneMessageRingsBitsAndTheFloat64Sum) {
  for (uint32_t w : {2u, 3u, 4u}) {
    for (size_t n : {size_t{2}, size_t{1003}, size_t{4099}}) {
      for (size_t segment : {size_t{1}, size_t{7}, size_t{64}, size_t{1000}, kRingSegmentElements}) {
        SCOPED_TRACE("W " + std::to_string(w) + ", n " + std::to_string(n) + ", segment " + std::to_string(segment));
        std::vector<std::vector<float>> in;
        for (uint32_t r = 0; r < w; ++r) in.push_back(fakes::random_vector(n, 31 * r + static_cast<uint32_t>(n)));
        auto data = in;
        Net net(w);
        RingRun run = run_ring(net.transports(), net.mailboxes(), std::vector<size_t>(w, segment), data);
        const std::vector<float> want = ring_reference(in);
        for (uint32_t r = 0; r < w; ++r) {
          ASSERT_TRUE(run.status[r].ok()) << "rank " << r << ": " << run.status[r].to_string();
          ASSERT_EQ(0, std::memcmp(data[r].data(), want.data(), n * sizeof(float))) << "rank " << r;
          EXPECT_EQ(run.stats[r].bytes_sent, ring_allreduce_bytes(n, w, r, segment)) << "rank " << r;
          // Every chunk of ~n/W elements goes 2 (W - 1) times, in ceil(len / segment) messages.
          uint64_t messages = 0;
          for (uint32_t c = 0; c < w; ++c) {
            const size_t len = n * (c + 1) / w - n * c / w;
            if (c != (r + 1) % w) messages += len <= segment ? 1 : (len + segment - 1) / segment;  // reduce-scatter
            if (c != (r + 2) % w) messages += len <= segment ? 1 : (len + segment - 1) / segment;  // all-gather
          }
          EXPECT_EQ(run.stats[r].messages_sent, messages) << "rank " << r;
        }
        for (size_t i = 0; i < n; ++i) {
          double sum = 0, abs_sum = 0;
          for (uint32_t r = 0; r < w; ++r) {
            sum += in[r][i];
            abs_sum += std::fabs(in[r][i]);
          }
          ASSERT_NEAR(data[0][i], sum, 1e-6 * abs_sum + 1e-30) << "element " << i;
        }
      }
    }
  }
}

// A transport that runs each send's completion a while after the fake delivered it, and checks
// then that the sender's payload is what it was when sent: a ring that overwrote a segment
// whose (zero-copy) send had not completed is caught.
class LateCompletions final : public Transport {
 public:
  explicit LateCompletions(Transport* inner) : inner_(inner), worker_([this] { run(); }) {}
  ~LateCompletions() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stopping_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }
  uint32_t rank() const override { return inner_->rank(); }
  uint32_t world_size() const override { return inner_->world_size(); }
  std::string peer_name(uint32_t peer) const override { return inner_->peer_name(peer); }
  Status send(uint32_t peer, std::span<const std::byte> header, std::span<const std::byte> payload,
              SendCallback done) override {
    std::vector<std::byte> sent(payload.begin(), payload.end());
    return inner_->send(peer, header, payload, [this, payload, sent = std::move(sent), done](const Status& s) {
      std::lock_guard<std::mutex> lock(mu_);
      late_.push_back({std::chrono::steady_clock::now() + 20ms, [this, payload, sent, done, s] {
                         if (!std::equal(payload.begin(), payload.end(), sent.begin(), sent.end())) ++rewritten_;
                         done(s);
                       }});
      cv_.notify_all();
    });
  }
  void stop() override {}
  int rewritten() {
    std::lock_guard<std::mutex> lock(mu_);
    return rewritten_;
  }

 private:
  struct Late {
    std::chrono::steady_clock::time_point at;
    std::function<void()> run;
  };
  void run() {
    std::unique_lock<std::mutex> lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stopping_ || !late_.empty(); });
      if (late_.empty()) return;
      Late l = std::move(late_.front());
      late_.pop_front();
      cv_.wait_until(lock, l.at, [&] { return false; });
      lock.unlock();
      l.run();
      lock.lock();
    }
  }
  Transport* inner_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Late> late_;
  bool stopping_ = false;
  int rewritten_ = 0;
  std::thread worker_;
};

TEST(RingSegments, ASegmentIsOverwrittenOnlyAfterItsSendCompleted) {
  for (uint32_t w : {2u, 3u}) {
    SCOPED_TRACE("W " + std::to_string(w));
    const size_t n = 600;
    Net net(w);
    std::vector<std::unique_ptr<LateCompletions>> late;
    std::vector<Transport*> transports;
    for (Transport* t : net.transports()) {
      late.push_back(std::make_unique<LateCompletions>(t));
      transports.push_back(late.back().get());
    }
    std::vector<std::vector<float>> in;
    for (uint32_t r = 0; r < w; ++r) in.push_back(fakes::random_vector(n, 5 + r));
    auto data = in;
    RingRun run = run_ring(transports, net.mailboxes(), std::vector<size_t>(w, 50), data);
    for (uint32_t r = 0; r < w; ++r) {
      ASSERT_TRUE(run.status[r].ok()) << "rank " << r << ": " << run.status[r].to_string();
      EXPECT_EQ(late[r]->rewritten(), 0) << "rank " << r << " rewrote a segment before its send completed";
    }
    const std::vector<float> want = ring_reference(in);
    for (uint32_t r = 0; r < w; ++r) ASSERT_EQ(0, std::memcmp(data[r].data(), want.data(), n * sizeof(float)));
  }
}

// Nodes that segment differently (a build with another segment size) refuse each other's
// segments as data loss; no node sums a segment of the wrong length.
TEST(RingSegments, NodesThatSegmentDifferentlyFailAsDataLoss) {
  Net net(2);
  std::vector<std::vector<float>> data{std::vector<float>(1000, 1.0f), std::vector<float>(1000, 2.0f)};
  RingRun run = run_ring(net.transports(), net.mailboxes(), {100, 64}, data);
  for (uint32_t r = 0; r < 2; ++r) {
    EXPECT_EQ(run.status[r].code(), Code::kDataLoss) << "rank " << r << ": " << run.status[r].to_string();
  }
}

}  // namespace
}  // namespace sparsecar
