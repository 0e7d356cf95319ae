#include "daemon/pipeline/job_agreement.h"

#include <sys/random.h>

#include <algorithm>
#include <cstdlib>
#include <sstream>

#include "daemon/transport/text_message.h"
#include "sparsecar/common/log.h"

namespace sparsecar {
namespace {

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream is(text);
  for (std::string line; std::getline(is, line);) out.push_back(line);
  return out;
}

// First difference between two manifests, described for humans; empty when they match.
std::string manifest_difference(const std::string& mine, const std::string& theirs, uint32_t their_rank) {
  auto a = lines_of(mine);
  auto b = lines_of(theirs);
  std::string who = "rank " + std::to_string(their_rank);
  for (size_t i = 0; i < std::max(a.size(), b.size()); ++i) {
    if (i >= a.size()) return who + " registered an extra tensor: '" + b[i] + "'";
    if (i >= b.size()) return who + " is missing a tensor rank 0 registered: '" + a[i] + "'";
    if (a[i].rfind("local_clients", 0) == 0) continue;    // may differ per node
    if (a[i].rfind("trainers_reduce", 0) == 0) continue;  // ANDed over the nodes
    if (a[i] != b[i]) return who + " has '" + b[i] + "' where rank 0 has '" + a[i] + "'";
  }
  return "";
}

uint32_t local_clients_of(const std::string& manifest) {
  auto lines = lines_of(manifest);
  if (lines.empty() || lines[0].rfind("local_clients ", 0) != 0) return 0;
  return static_cast<uint32_t>(std::strtoul(lines[0].c_str() + 14, nullptr, 10));
}

// The manifest's "trainers_reduce 1" (Pipeline::manifest()).
bool trainers_reduce_of(const std::string& manifest) {
  for (const std::string& line : lines_of(manifest)) {
    if (line.rfind("trainers_reduce ", 0) == 0) return line == "trainers_reduce 1";
  }
  return false;
}

// rank 0's ack head: "ok <total trainers>[ running][ trainers_reduce]".
std::string ack_head(uint32_t total, bool running, bool trainers_reduce) {
  return "ok " + std::to_string(total) + (running ? " running" : "") + (trainers_reduce ? " trainers_reduce" : "") +
         "\n";
}

std::string text_of(std::span<const std::byte> payload) {
  return std::string(reinterpret_cast<const char*>(payload.data()), payload.size());
}

}  // namespace

uint64_t random_nonzero_u64() {
  uint64_t v = 0;
  while (v == 0) {
    ssize_t got = ::getrandom(&v, sizeof v, 0);
    SC_CHECK(got == static_cast<ssize_t>(sizeof v), "getrandom failed");
  }
  return v;
}

JobAgreement::JobAgreement(const Options& options, Transport* transport, Mailbox* mailbox, DecisionBoard* decisions,
                           const Clock& clock)
    : options_(options), transport_(transport), mailbox_(mailbox), decisions_(decisions), clock_(clock) {}

// A manifest carries its attempt nonce in `incarnation` (step 0); an ack echoes it in `step` and
// carries the agreed job's incarnation (WIRE.md, "Job incarnations").
Status JobAgreement::send(uint32_t peer, wire::Kind kind, uint64_t step, uint64_t incarnation, std::string text) {
  wire::WireHeader h{};
  h.kind = static_cast<uint16_t>(kind);
  h.job_id = options_.job_id;
  h.sender_rank = options_.rank;
  h.step = step;
  h.incarnation = incarnation;
  return send_text_message(*transport_, peer, h, std::move(text), "a job agreement message");
}

void JobAgreement::reset() {
  std::lock_guard<std::mutex> lock(mu_);
  running_ = RunningJob{};
}

Expected<AgreedJob> JobAgreement::agree(const std::string& manifest, Clock::time_point deadline) {
  if (options_.world_size == 1) {
    AgreedJob job{random_nonzero_u64(), options_.local_clients, false, trainers_reduce_of(manifest)};
    mailbox_->set_incarnation(job.incarnation);
    return job;
  }
  return options_.rank == 0 ? agree_as_leader(manifest, deadline) : agree_as_member(manifest, deadline);
}

Expected<AgreedJob> JobAgreement::agree_as_member(const std::string& mine, Clock::time_point deadline) {
  const uint64_t attempt = random_nonzero_u64();
  SC_RETURN_IF_ERROR(send(0, wire::Kind::kManifest, 0, attempt, mine).with_context("sending the job manifest to rank 0"));
  SC_ASSIGN_OR_RETURN(Envelope ack, mailbox_->take(wire::Kind::kManifestAck, 0, 0, attempt, 0, /*incarnation=*/0,
                                                   deadline, transport_->peer_name(0)));
  const std::string text = text_of(ack.payload);
  if (text.rfind("ok ", 0) != 0) {
    return failed_precondition("nodes disagree: " + (text.rfind("error ", 0) == 0 ? text.substr(6) : text));
  }
  // ack_head() + rank 0's decisions (decisions.h, snapshot).
  const size_t nl = text.find('\n');
  std::istringstream head(text.substr(0, nl));
  std::string ok, word;
  AgreedJob job;
  head >> ok >> job.total_trainers;
  while (head >> word) {
    if (word == "running") {
      job.joined_running = true;
    } else if (word == "trainers_reduce") {
      job.trainers_reduce = true;
    } else {
      return data_loss("rank 0 sent a job agreement with an unknown word '" + word + "'");
    }
  }
  job.incarnation = ack.header.incarnation;
  if (job.total_trainers == 0) return data_loss("rank 0 sent a job agreement without a trainer count");
  if (job.incarnation == 0) return data_loss("rank 0 sent a job agreement without an incarnation");
  if (nl != std::string::npos && decisions_ != nullptr) {
    SC_RETURN_IF_ERROR(decisions_->adopt(std::string_view(text).substr(nl + 1)));
  }
  mailbox_->set_incarnation(job.incarnation);
  return job;
}

Expected<AgreedJob> JobAgreement::agree_as_leader(const std::string& mine, Clock::time_point deadline) {
  // Gather every manifest, compare, answer everyone.
  uint32_t total = options_.local_clients;
  std::string error;
  std::vector<uint64_t> attempts(options_.world_size, 0);
  std::vector<uint32_t> local_clients(options_.world_size, 0);
  local_clients[0] = options_.local_clients;
  bool trainers_reduce = trainers_reduce_of(mine);
  for (uint32_t peer = 1; peer < options_.world_size; ++peer) {
    auto got = mailbox_->take(wire::Kind::kManifest, peer, 0, 0, 0, /*incarnation=*/0, deadline,
                              transport_->peer_name(peer));
    if (!got.ok()) {
      error = "no job manifest from " + transport_->peer_name(peer) + ": " + got.status().message();
      break;
    }
    attempts[peer] = got->header.incarnation;
    const std::string theirs = text_of(got->payload);
    std::string diff = manifest_difference(mine, theirs, peer);
    if (!diff.empty() && error.empty()) error = diff;
    local_clients[peer] = local_clients_of(theirs);
    total += local_clients[peer];
    trainers_reduce = trainers_reduce && trainers_reduce_of(theirs);
  }
  if (!error.empty()) {
    // Answer the peers whose manifest is already here too, so they fail now, not at their deadline.
    for (uint32_t peer = 1; peer < options_.world_size; ++peer) {
      if (attempts[peer] != 0) continue;
      auto got = mailbox_->take(wire::Kind::kManifest, peer, 0, 0, 0, 0, clock_.now(), transport_->peer_name(peer));
      if (got.ok()) attempts[peer] = got->header.incarnation;
    }
  }
  // The incarnation is in force here before any peer can learn it and send under it.
  const uint64_t incarnation = error.empty() ? random_nonzero_u64() : 0;
  if (error.empty()) {
    mailbox_->set_incarnation(incarnation);
    // Ready for replacements before anyone can start the job (and lose a rank).
    std::lock_guard<std::mutex> lock(mu_);
    running_.agreed = true;
    running_.incarnation = incarnation;
    running_.total_trainers = total;
    running_.manifest = mine;
    running_.local_clients = local_clients;
    running_.trainers_reduce = trainers_reduce;
    running_.rejoins.resize(options_.world_size);
    for (uint32_t peer = 0; peer < options_.world_size; ++peer) running_.rejoins[peer] = mailbox_->rejoined(peer);
  }
  const std::string verdict = error.empty() ? ack_head(total, false, trainers_reduce) : "error " + error;
  auto answer_all = [&](const std::string& decisions) {
    for (uint32_t peer = 1; peer < options_.world_size; ++peer) {
      if (attempts[peer] == 0) continue;  // no manifest taken: nothing to answer
      send(peer, wire::Kind::kManifestAck, attempts[peer], incarnation, error.empty() ? verdict + decisions : verdict)
          .ignore();
    }
  };
  if (decisions_ != nullptr && error.empty()) {
    decisions_->with_snapshot(answer_all);
  } else {
    answer_all("");
  }
  if (!error.empty()) return failed_precondition("nodes disagree: " + error);
  return AgreedJob{incarnation, total, false, trainers_reduce};
}

bool JobAgreement::answer_late_manifest(uint32_t peer, const wire::WireHeader& h, std::span<const std::byte> payload) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!running_.agreed || peer == 0 || peer >= running_.local_clients.size()) return false;
  if (mailbox_->rejoined(peer) == running_.rejoins[peer]) return false;  // the agreed process itself
  const std::string theirs = text_of(payload);
  std::string error = manifest_difference(running_.manifest, theirs, peer);
  if (error.empty() && local_clients_of(theirs) != running_.local_clients[peer]) {
    error = "rank " + std::to_string(peer) + " has " + std::to_string(local_clients_of(theirs)) +
            " local trainer(s) where the rank it replaces had " + std::to_string(running_.local_clients[peer]);
  }
  if (error.empty() && running_.trainers_reduce && !trainers_reduce_of(theirs)) {
    error = "rank " + std::to_string(peer) + "'s trainers do not all-reduce dense steps themselves (trainers_reduce 0) "
            "where the running job's all do";
  }
  if (!error.empty()) {
    SC_LOG_ERROR("refusing rank {}'s request to join the running job: {}", peer, error);
    send(peer, wire::Kind::kManifestAck, h.incarnation, 0, "error " + error).ignore();
    return true;
  }
  const std::string verdict = ack_head(running_.total_trainers, true, running_.trainers_reduce);
  const uint64_t incarnation = running_.incarnation;
  if (decisions_ != nullptr) {
    decisions_->with_snapshot([&](const std::string& decisions) {
      send(peer, wire::Kind::kManifestAck, h.incarnation, incarnation, verdict + decisions).ignore();
    });
  } else {
    send(peer, wire::Kind::kManifestAck, h.incarnation, incarnation, verdict).ignore();
  }
  SC_LOG_INFO("rank {} joined the running job (incarnation {:016x})", peer, static_cast<unsigned long long>(incarnation));
  return true;
}

}  // namespace sparsecar
