#include "daemon/pipeline/decisions.h"

#include <array>
#include <cstdio>
#include <sstream>

#include "daemon/transport/text_message.h"
#include "sparsecar/common/clock_wait.h"
#include "sparsecar/common/log.h"

namespace sparsecar {

std::string format_changes(const KnobChanges& changes) {
  std::string out;
  for (const auto& [name, value] : changes) {
    out += name;
    out += '=';
    out += value;
    out += '\n';
  }
  return out;
}

Expected<KnobChanges> parse_changes(std::string_view text) {
  KnobChanges out;
  while (!text.empty()) {
    size_t nl = text.find('\n');
    std::string_view line = text.substr(0, nl);
    text.remove_prefix(nl == std::string_view::npos ? text.size() : nl + 1);
    if (line.empty()) continue;
    size_t eq = line.find('=');
    if (eq == std::string_view::npos || eq == 0) {
      return invalid_argument("bad knob change line '" + std::string(line) + "' (want knob=value)");
    }
    out.emplace_back(std::string(line.substr(0, eq)), std::string(line.substr(eq + 1)));
  }
  return out;
}

DecisionBoard::DecisionBoard(const Config& initial, Transport* transport, const Clock& clock)
    : rank_(initial.rank), world_size_(initial.world_size), job_id_(initial.job_id), transport_(transport),
      clock_(clock) {
  Decision base;
  base.config = std::make_shared<const Config>(initial);
  base.reason = "start-up configuration";
  configured_ = base.config;
  decisions_.push_back(std::move(base));
}

void DecisionBoard::set_configured(const Config& config) {
  std::lock_guard<std::mutex> lock(mu_);
  auto next = std::make_shared<Config>(*configured_);
  for (const KnobSpec& spec : knob_table()) {
    if (spec.live) set_knob(*next, spec.name, get_knob(config, spec.name).value()).ignore();
  }
  configured_ = std::move(next);
}

Expected<Decision> DecisionBoard::decide_locked(const KnobChanges& changes, const std::string& reason) {
  if (changes.empty()) return invalid_argument("no knob to change");
  auto next = std::make_shared<Config>(*decisions_.back().config);
  for (const auto& [name, value] : changes) {
    const KnobSpec* spec = find_knob(name);
    if (spec == nullptr) return not_found("unknown knob '" + name + "'");
    if (!spec->live) return failed_precondition("knob '" + name + "' cannot change while the daemon runs");
    SC_RETURN_IF_ERROR(set_knob(*next, name, value));
  }
  SC_RETURN_IF_ERROR(validate(*next));
  Decision d;
  d.epoch = decisions_.back().epoch + 1;
  // Not before any step a node may already have started (see the header), nor before a
  // previous decision.
  d.effective_step = std::max(started_ ? max_started_step_ + 2 : 0, decisions_.back().effective_step);
  d.config = std::move(next);
  d.changes = format_changes(changes);
  d.reason = reason;
  decisions_.push_back(d);
  SC_LOG_INFO("decision epoch {} from step {} ({}): {}", d.epoch, static_cast<unsigned long long>(d.effective_step),
              reason, d.changes);
  cv_.notify_all();
  return d;
}

Expected<Decision> DecisionBoard::propose(const KnobChanges& changes, const std::string& reason,
                                          Clock::time_point deadline) {
  if (rank_ == 0) {
    std::lock_guard<std::mutex> lock(mu_);
    Expected<Decision> d = decide_locked(changes, reason);
    if (d.ok()) broadcast(*d);  // under the lock: see the header
    return d;
  }
  // Validate here first so obvious mistakes fail without a round trip.
  {
    Config scratch;
    for (const auto& [name, value] : changes) {
      const KnobSpec* spec = find_knob(name);
      if (spec == nullptr) return not_found("unknown knob '" + name + "'");
      if (!spec->live) return failed_precondition("knob '" + name + "' cannot change while the daemon runs");
      SC_RETURN_IF_ERROR(set_knob(scratch, name, value));
    }
  }
  uint64_t request;
  {
    std::lock_guard<std::mutex> lock(mu_);
    request = next_request_++;
  }
  send_text(0, wire::Kind::kKnobRequest, request, 0, format_changes(changes));
  std::unique_lock<std::mutex> lock(mu_);
  if (!wait_until(cv_, lock, clock_, deadline, [&] { return replies_.count(request) > 0; })) {
    return deadline_exceeded("rank 0 did not answer the knob change in time");
  }
  std::string reply = std::move(replies_[request]);
  replies_.erase(request);
  if (reply.rfind("error ", 0) == 0) return failed_precondition("rank 0 refused: " + reply.substr(6));
  std::istringstream is(reply);
  std::string ok;
  uint32_t epoch = 0;
  is >> ok >> epoch;
  // The decision itself arrives as a kDecision before the reply (same endpoint, in order).
  for (const auto& d : decisions_) {
    if (d.epoch == epoch) return d;
  }
  return internal_error("rank 0 accepted epoch " + std::to_string(epoch) + " but its decision has not arrived");
}

Decision DecisionBoard::at_step(uint64_t step) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!started_ || step > max_started_step_) max_started_step_ = step;
  started_ = true;
  for (auto it = decisions_.rbegin(); it != decisions_.rend(); ++it) {
    if (it->effective_step <= step) return *it;
  }
  return decisions_.front();
}

Decision DecisionBoard::latest() const {
  std::lock_guard<std::mutex> lock(mu_);
  return decisions_.back();
}

std::vector<Decision> DecisionBoard::history() const {
  std::lock_guard<std::mutex> lock(mu_);
  return decisions_;
}

void DecisionBoard::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  Decision base = decisions_.back();
  // Which live knobs the finished job changed (by `set`, a controller or a reload's proposal).
  std::string reverted;
  for (const KnobSpec& spec : knob_table()) {
    if (!spec.live) continue;
    const std::string now = get_knob(*base.config, spec.name).value();
    const std::string configured = get_knob(*configured_, spec.name).value();
    if (now == configured) continue;
    reverted += (reverted.empty() ? "" : ", ") + std::string(spec.name) + " " + now + " -> " + configured;
  }
  if (decisions_.size() > 1 || !reverted.empty()) {
    // Keep only the new base: earlier epochs belong to the finished job.
    KnobChanges changes;
    for (const KnobSpec& spec : knob_table()) {
      if (spec.live) changes.emplace_back(spec.name, get_knob(*configured_, spec.name).value());
    }
    base.epoch += 1;
    base.config = configured_;
    base.changes = format_changes(changes);
    base.reason = "new job: the configured values";
    base.error = Status::Ok();
  }
  base.effective_step = 0;
  if (!reverted.empty()) {
    SC_LOG_INFO("new job: live settings last one job; back to the configured values (epoch {}): {}", base.epoch,
                reverted);
  }
  decisions_.clear();
  decisions_.push_back(std::move(base));
  started_ = false;
  max_started_step_ = 0;
}

void DecisionBoard::on_message(uint32_t peer, const wire::WireHeader& h, std::span<const std::byte> payload) {
  std::string text(reinterpret_cast<const char*>(payload.data()), payload.size());
  switch (static_cast<wire::Kind>(h.kind)) {
    case wire::Kind::kDecision: {
      if (peer != 0) {
        SC_LOG_WARN("ignoring a decision from rank {}: only rank 0 decides", peer);
        return;
      }
      std::lock_guard<std::mutex> lock(mu_);
      const uint32_t expected = decisions_.back().epoch + 1;
      if (h.epoch > expected) {
        // A node that has not adopted rank 0's snapshot yet (a replacement joining a running job):
        // kept until its predecessors are here.
        if (early_.size() < 256) early_[h.epoch] = {h.step, text};
        return;
      }
      if (h.epoch != expected) {
        SC_LOG_WARN("decision epoch {} from rank 0 is not newer than epoch {} here; ignored", h.epoch,
                    decisions_.back().epoch);
        return;
      }
      apply_locked(h.epoch, h.step, text, "rank 0");
      apply_early_locked();
      return;
    }
    case wire::Kind::kKnobRequest: {
      if (rank_ != 0) return;
      auto changes = parse_changes(text);
      Expected<Decision> d = changes.status();
      if (changes.ok()) {
        std::lock_guard<std::mutex> lock(mu_);
        d = decide_locked(*changes, "request from rank " + std::to_string(peer));
        // Under the lock (see the header), and before the reply: the requester must know the
        // decision when the reply lands.
        if (d.ok()) broadcast(*d);
      }
      send_text(peer, wire::Kind::kKnobReply, h.step, 0,
                d.ok() ? "ok " + std::to_string(d->epoch) + " " + std::to_string(d->effective_step)
                       : "error " + d.status().message());
      return;
    }
    case wire::Kind::kKnobReply: {
      std::lock_guard<std::mutex> lock(mu_);
      replies_[h.step] = text;
      cv_.notify_all();
      return;
    }
    default:
      return;
  }
}

void DecisionBoard::apply_locked(uint32_t epoch, uint64_t effective_step, const std::string& text,
                                 const std::string& reason) {
  auto changes = parse_changes(text);
  auto next = std::make_shared<Config>(*decisions_.back().config);
  Status applied = changes.status();
  for (const auto& [name, value] : changes.ok() ? *changes : KnobChanges{}) {
    const KnobSpec* spec = find_knob(name);
    applied = spec == nullptr ? not_found("unknown knob '" + name + "'") : set_knob(*next, name, value);
    if (!applied.ok()) break;
  }
  if (applied.ok()) applied = validate(*next);
  Decision d;
  if (!applied.ok()) {
    // Keep the epoch sequence (later epochs must still follow) but never run half of it.
    d.error = failed_precondition("this node cannot apply decision epoch " + std::to_string(epoch) +
                                  " from rank 0: " + applied.message());
    SC_LOG_ERROR("{}; steps under it fail here", d.error.message());
    next = std::make_shared<Config>(*decisions_.back().config);
  }
  d.epoch = epoch;
  d.effective_step = effective_step;
  d.config = std::move(next);
  d.changes = text;
  d.reason = reason;
  SC_LOG_INFO("decision epoch {} from step {}: {}", d.epoch, static_cast<unsigned long long>(d.effective_step),
              text);
  decisions_.push_back(std::move(d));
  cv_.notify_all();
}

void DecisionBoard::apply_early_locked() {
  std::erase_if(early_, [&](const auto& e) { return e.first <= decisions_.back().epoch; });
  for (auto it = early_.begin(); it != early_.end() && it->first == decisions_.back().epoch + 1;) {
    apply_locked(it->first, it->second.first, it->second.second, "rank 0");
    it = early_.erase(it);
  }
}

void DecisionBoard::with_snapshot(const std::function<void(const std::string&)>& fn) const {
  std::lock_guard<std::mutex> lock(mu_);
  std::string out;
  for (size_t i = 0; i < decisions_.size(); ++i) {
    const Decision& d = decisions_[i];
    std::string state;
    if (i == 0) {
      for (const KnobSpec& spec : knob_table()) {
        if (!spec.live || spec.secret) continue;
        auto value = get_knob(*d.config, spec.name);
        if (value.ok()) state += std::string(spec.name) + "=" + *value + "\n";
      }
    }
    out += "epoch " + std::to_string(d.epoch) + " step " + std::to_string(d.effective_step) + " state " +
           std::to_string(state.size()) + " changes " + std::to_string(d.changes.size()) + "\n" + state + d.changes;
  }
  fn(out);
}

Status DecisionBoard::adopt(std::string_view snapshot) {
  auto bad = [](const std::string& why) { return data_loss("rank 0's decisions do not parse: " + why); };
  struct Entry {
    uint32_t epoch;
    uint64_t step;
    std::string state;
    std::string changes;
  };
  std::vector<Entry> entries;
  while (!snapshot.empty()) {
    const size_t nl = snapshot.find('\n');
    if (nl == std::string_view::npos || nl > 128) return bad("no decision line");
    const std::string line(snapshot.substr(0, nl));
    snapshot.remove_prefix(nl + 1);
    unsigned long long epoch = 0, step = 0, state = 0, changes = 0;
    int used = 0;
    if (std::sscanf(line.c_str(), "epoch %llu step %llu state %llu changes %llu%n", &epoch, &step, &state, &changes,
                    &used) != 4 ||
        static_cast<size_t>(used) != line.size() || epoch > UINT32_MAX || state > snapshot.size() ||
        changes > snapshot.size() - state || (!entries.empty() && state != 0)) {
      return bad("'" + line + "'");
    }
    if (!entries.empty() && epoch != entries.back().epoch + 1) return bad("epochs out of order");
    entries.push_back({static_cast<uint32_t>(epoch), step, std::string(snapshot.substr(0, state)),
                       std::string(snapshot.substr(state, changes))});
    snapshot.remove_prefix(state + changes);
  }
  if (entries.empty()) return bad("no decision");
  SC_ASSIGN_OR_RETURN(KnobChanges all, parse_changes(entries[0].state));
  SC_RETURN_IF_ERROR(parse_changes(entries[0].changes).status());

  std::lock_guard<std::mutex> lock(mu_);
  // Built aside: the board changes only if every decision applies.
  auto config = std::make_shared<Config>(*decisions_.front().config);
  Status applied = Status::Ok();
  for (const auto& [name, value] : all) {
    const KnobSpec* spec = find_knob(name);
    applied = spec == nullptr ? not_found("unknown knob '" + name + "'")
              : !spec->live  ? failed_precondition("knob '" + name + "' is not live")
                             : set_knob(*config, name, value);
    if (!applied.ok()) break;
  }
  if (applied.ok()) applied = validate(*config);
  if (!applied.ok()) return failed_precondition("this node cannot take rank 0's decisions: " + applied.message());
  std::vector<Decision> mine;
  mine.swap(decisions_);
  Decision base;
  base.epoch = entries[0].epoch;
  base.effective_step = entries[0].step;
  base.config = std::move(config);
  base.changes = entries[0].changes;
  base.reason = "rank 0 (joined)";
  decisions_.push_back(std::move(base));
  for (size_t i = 1; i < entries.size(); ++i) {
    apply_locked(entries[i].epoch, entries[i].step, entries[i].changes, "rank 0 (joined)");
  }
  // Decisions this node already took from rank 0 beyond the snapshot (sent after it, arrived
  // first) follow; its own earlier history is replaced.
  for (Decision& d : mine) {
    if (d.epoch == decisions_.back().epoch + 1 && d.reason == "rank 0") decisions_.push_back(std::move(d));
  }
  apply_early_locked();
  cv_.notify_all();
  return Status::Ok();
}

void DecisionBoard::broadcast(const Decision& d) {
  for (uint32_t peer = 0; peer < world_size_; ++peer) {
    if (peer == rank_) continue;
    send_text(peer, wire::Kind::kDecision, d.effective_step, d.epoch, d.changes);
  }
}

void DecisionBoard::send_text(uint32_t peer, wire::Kind kind, uint64_t step, uint32_t epoch, std::string text) {
  if (transport_ == nullptr) return;
  wire::WireHeader h{};
  h.kind = static_cast<uint16_t>(kind);
  h.job_id = job_id_;
  h.sender_rank = rank_;
  h.step = step;
  h.epoch = epoch;
  Status s = send_text_message(*transport_, peer, h, std::move(text),
                               kind == wire::Kind::kDecision ? "a decision" : "a knob message");
  if (!s.ok()) SC_LOG_WARN("cannot send to rank {}: {}", peer, s.to_string());
}

}  // namespace sparsecar
