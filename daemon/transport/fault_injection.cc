#include "daemon/transport/fault_injection.h"

#include <charconv>
#include <memory>

#include "sparsecar/common/clock_wait.h"
#include "sparsecar/common/log.h"

namespace sparsecar {
namespace {

Expected<double> parse_rate(std::string_view key, std::string_view text) {
  double v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || !(v >= 0.0 && v <= 1.0)) {
    return invalid_argument("SPARSECAR_TEST_FAULTS: " + std::string(key) + "=" + std::string(text) +
                            " is not a probability in [0, 1]");
  }
  return v;
}

Expected<uint64_t> parse_uint(std::string_view key, std::string_view text, uint64_t max) {
  uint64_t v = 0;
  auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (ec != std::errc() || end != text.data() + text.size() || v > max) {
    return invalid_argument("SPARSECAR_TEST_FAULTS: " + std::string(key) + "=" + std::string(text) +
                            " is not an integer in 0.." + std::to_string(max));
  }
  return v;
}

}  // namespace

Expected<FaultOptions> parse_fault_spec(std::string_view spec) {
  FaultOptions o;
  while (!spec.empty()) {
    const size_t comma = spec.find(',');
    std::string_view item = spec.substr(0, comma);
    spec.remove_prefix(comma == std::string_view::npos ? spec.size() : comma + 1);
    if (item.empty()) continue;
    const size_t eq = item.find('=');
    if (eq == std::string_view::npos) {
      return invalid_argument("SPARSECAR_TEST_FAULTS: '" + std::string(item) + "' is not key=value");
    }
    const std::string_view key = item.substr(0, eq), value = item.substr(eq + 1);
    if (key == "drop") {
      SC_ASSIGN_OR_RETURN(o.drop, parse_rate(key, value));
    } else if (key == "corrupt") {
      SC_ASSIGN_OR_RETURN(o.corrupt, parse_rate(key, value));
    } else if (key == "duplicate") {
      SC_ASSIGN_OR_RETURN(o.duplicate, parse_rate(key, value));
    } else if (key == "delay") {
      SC_ASSIGN_OR_RETURN(o.delay, parse_rate(key, value));
    } else if (key == "reorder") {
      SC_ASSIGN_OR_RETURN(o.reorder, parse_rate(key, value));
    } else if (key == "delay_ms") {
      SC_ASSIGN_OR_RETURN(uint64_t ms, parse_uint(key, value, 60000));
      o.delay_ms = static_cast<uint32_t>(ms);
    } else if (key == "seed") {
      SC_ASSIGN_OR_RETURN(o.seed, parse_uint(key, value, UINT64_MAX));
    } else if (key == "kinds") {
      std::string_view rest = value;
      while (!rest.empty()) {
        const size_t plus = rest.find('+');
        SC_ASSIGN_OR_RETURN(uint64_t kind, parse_uint(key, rest.substr(0, plus), UINT16_MAX));
        o.kinds.insert(static_cast<uint16_t>(kind));
        rest.remove_prefix(plus == std::string_view::npos ? rest.size() : plus + 1);
      }
    } else {
      return invalid_argument("SPARSECAR_TEST_FAULTS: unknown key '" + std::string(key) +
                              "' (drop, corrupt, duplicate, delay, reorder, delay_ms, seed, kinds)");
    }
  }
  if (o.drop + o.corrupt + o.duplicate + o.delay + o.reorder > 1.0) {
    return invalid_argument("SPARSECAR_TEST_FAULTS: the rates add up to more than 1");
  }
  return o;
}

FaultyTransport::FaultyTransport(Transport* inner, const FaultOptions& options, const Clock& clock)
    : inner_(inner), options_(options), clock_(clock), rng_(options.seed) {
  thread_ = std::thread([this] { run(); });
}

FaultyTransport::~FaultyTransport() { stop(); }

FaultyTransport::Counts FaultyTransport::counts() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counts_;
}

void FaultyTransport::schedule(Clock::time_point due, Action action) {
  pending_.emplace(due, std::move(action));
  cv_.notify_all();
}

Status FaultyTransport::send(uint32_t peer, std::span<const std::byte> header, std::span<const std::byte> payload,
                             SendCallback done) {
  std::unique_lock<std::mutex> lock(mu_);
  if (stopping_) return unavailable("transport stopped");
  ++counts_.sent;
  const uint16_t kind = header.size() >= 8 ? static_cast<uint16_t>(std::to_integer<uint16_t>(header[6]) |
                                                                   std::to_integer<uint16_t>(header[7]) << 8)
                                           : 0;
  const bool eligible = options_.kinds.empty() || options_.kinds.count(kind) > 0;
  const double u = eligible ? std::uniform_real_distribution<double>(0.0, 1.0)(rng_) : 1.0;
  double edge = options_.drop;
  const auto later = clock_.now() + std::chrono::milliseconds(options_.delay_ms);

  if (u < edge) {  // lost on the wire: the sender sees a completed send
    ++counts_.dropped;
    schedule(clock_.now(), [done = std::move(done)](bool) { done(Status::Ok()); });
    return Status::Ok();
  }
  if (u < (edge += options_.corrupt)) {  // one bit of a copy flipped; the caller's bytes untouched
    ++counts_.corrupted;
    auto copy = std::make_shared<std::vector<std::byte>>(header.begin(), header.end());
    copy->insert(copy->end(), payload.begin(), payload.end());
    const size_t bit = std::uniform_int_distribution<size_t>(0, copy->size() * 8 - 1)(rng_);
    (*copy)[bit / 8] ^= static_cast<std::byte>(1u << (bit % 8));
    const std::span<const std::byte> all(*copy);
    return inner_->send(peer, all.first(header.size()), all.subspan(header.size()),
                        [copy, done = std::move(done)](const Status& s) { done(s); });
  }
  if (u < (edge += options_.duplicate)) {  // sent twice; `done` after both completed
    ++counts_.duplicated;
    struct Both {
      std::mutex mu;
      int left = 2;
      Status first_error;
      SendCallback done;
    };
    auto both = std::make_shared<Both>();
    both->done = std::move(done);
    auto one_done = [both](const Status& s) {
      std::unique_lock<std::mutex> l(both->mu);
      if (!s.ok() && both->first_error.ok()) both->first_error = s;
      if (--both->left == 0) {
        Status result = both->first_error;
        l.unlock();
        both->done(result);
      }
    };
    for (int copy = 0; copy < 2; ++copy) {
      Status s = inner_->send(peer, header, payload, one_done);
      if (!s.ok()) {
        if (copy == 0) return s;  // nothing queued: the caller handles it, `done` never runs
        one_done(s);
      }
    }
    return Status::Ok();
  }
  if (u < (edge += options_.delay)) {
    ++counts_.delayed;
    schedule(later, [this, peer, header, payload, done = std::move(done)](bool cancelled) mutable {
      if (cancelled) return done(unavailable("transport stopped with the message delayed"));
      Status s = inner_->send(peer, header, payload, done);
      if (!s.ok()) done(s);
    });
    return Status::Ok();
  }
  if (u < (edge += options_.reorder) && held_.count(peer) == 0) {
    // Held until the next message to this peer has gone out (or delay_ms passed).
    ++counts_.reordered;
    const uint64_t token = next_token_++;
    held_[peer] = token;
    held_actions_[token] = [this, peer, header, payload, done = std::move(done)](bool cancelled) mutable {
      if (cancelled) return done(unavailable("transport stopped with the message held back"));
      Status s = inner_->send(peer, header, payload, done);
      if (!s.ok()) done(s);
    };
    schedule(later, [this, peer, token](bool cancelled) {
      Action held;
      {
        std::lock_guard<std::mutex> l(mu_);
        auto it = held_actions_.find(token);
        if (it == held_actions_.end()) return;  // overtaken and sent already
        held = std::move(it->second);
        held_actions_.erase(it);
        held_.erase(peer);
      }
      held(cancelled);
    });
    return Status::Ok();
  }
  // Sent now; a message held back for this peer follows it (it has been overtaken).
  Status s = inner_->send(peer, header, payload, std::move(done));
  auto h = held_.find(peer);
  if (h != held_.end()) {
    Action overtaken = std::move(held_actions_[h->second]);
    held_actions_.erase(h->second);
    held_.erase(h);
    lock.unlock();
    overtaken(false);
  }
  return s;
}

void FaultyTransport::run() {
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    if (stopping_) return;
    if (pending_.empty()) {
      cv_.wait(lock);
      continue;
    }
    auto first = pending_.begin();
    if (first->first > clock_.now()) {
      // Due on the clock, which need not be real time: wait a bounded slice and look again.
      const Clock::duration slice = wait_slice(clock_, first->first);
      if (slice > Clock::duration::zero()) cv_.wait_for(lock, slice);
      continue;
    }
    Action action = std::move(first->second);
    pending_.erase(first);
    lock.unlock();
    action(false);
    lock.lock();
  }
}

void FaultyTransport::stop() {
  std::multimap<Clock::time_point, Action> pending;
  std::map<uint64_t, Action> held;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (stopping_ && !thread_.joinable()) return;
    stopping_ = true;
    pending.swap(pending_);
    held.swap(held_actions_);
    held_.clear();
    cv_.notify_all();
  }
  if (thread_.joinable()) thread_.join();
  for (auto& [token, action] : held) action(true);
  for (auto& [due, action] : pending) action(true);
  inner_->stop();
}

}  // namespace sparsecar
