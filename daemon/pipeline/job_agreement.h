// JobAgreement: how the nodes agree on a job at its first step, and how rank 0 lets a replacement
// join a job that is already running.
//
// At the first step of a job every rank sends rank 0 a manifest (its local trainer count, its
// agreed knobs, its tensor list) under a fresh attempt nonce; rank 0 gathers all of them,
// compares them with its own and answers every rank with "ok <total trainers>\n" + its live
// decisions (DecisionBoard snapshot, adopted by the rank) and the job's new random incarnation,
// or "error <first difference>". Manifests must match but for two lines: `local_clients` (per
// node) and `trainers_reduce` (whether this node's trainers all-reduce dense steps themselves):
// the job's is the AND over the nodes, said in the ack ("ok <total> trainers_reduce"), so a job
// whose trainers do so on some nodes only runs the daemons' ring. The ack echoes the attempt
// nonce, so an ack of an earlier attempt is never taken. While the job runs, rank 0 answers the
// manifest of a rank that was replaced since the agreement (Mailbox::rejoined) the same way from
// the running job ("ok <total> running[ trainers_reduce]\n" + decisions, the same incarnation;
// refused if its trainers do not reduce where the job's do); any other manifest is kept for the
// next agreement, as before.
//
// Threads: agree() on the pipeline thread; answer_late_manifest() on the transport thread (the
// mailbox's manifest handler); reset() on the pipeline thread. The running job is guarded by a
// mutex; rank 0's ack is sent under the decision board's lock (with_snapshot), so no decision can
// overtake the snapshot it carries.
//
// Time: agree()'s deadline is a time on the Clock it is given (the mailbox's); it reads time only
// through it.
#pragma once

#include <chrono>
#include <cstdint>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "daemon/collective/mailbox.h"
#include "daemon/pipeline/decisions.h"
#include "daemon/transport/transport.h"
#include "daemon/transport/wire.h"
#include "sparsecar/common/clock.h"
#include "sparsecar/common/status.h"

namespace sparsecar {

struct AgreedJob {
  uint64_t incarnation = 0;
  uint32_t total_trainers = 0;
  bool joined_running = false;  // this rank is a replacement that joined a job already running
  bool trainers_reduce = false;  // every node's trainers all-reduce dense steps themselves
};

class JobAgreement {
 public:
  struct Options {
    uint32_t rank = 0;
    uint32_t world_size = 1;
    uint64_t job_id = 0;
    uint32_t local_clients = 1;
  };

  // `transport` may be null only when world_size == 1; `decisions` may be null (no snapshot).
  // `clock` (the mailbox's) must outlive the agreement.
  JobAgreement(const Options& options, Transport* transport, Mailbox* mailbox, DecisionBoard* decisions,
               const Clock& clock = steady_clock());

  // Agrees on the job this node's `manifest` describes (Pipeline::manifest()); on success the
  // mailbox holds the incarnation. Errors: FAILED_PRECONDITION (the nodes disagree: the first
  // difference), DATA_LOSS (a malformed ack or snapshot), what the mailbox's take() returns.
  Expected<AgreedJob> agree(const std::string& manifest, Clock::time_point deadline);

  // Rank 0 (Mailbox::ManifestHandler): answers the manifest of a replacement joining the running
  // job; false when it is not one (keep it for the next agreement).
  bool answer_late_manifest(uint32_t peer, const wire::WireHeader& header, std::span<const std::byte> payload);

  // The job ended on this node: no running job to join until the next agreement.
  void reset();

 private:
  Status send(uint32_t peer, wire::Kind kind, uint64_t step, uint64_t incarnation, std::string text);
  Expected<AgreedJob> agree_as_leader(const std::string& mine, Clock::time_point deadline);
  Expected<AgreedJob> agree_as_member(const std::string& mine, Clock::time_point deadline);

  const Options options_;
  Transport* const transport_;
  Mailbox* const mailbox_;
  DecisionBoard* const decisions_;
  const Clock& clock_;

  // Rank 0: the job as agreed.
  struct RunningJob {
    bool agreed = false;
    uint64_t incarnation = 0;
    uint32_t total_trainers = 0;
    std::string manifest;                 // rank 0's
    std::vector<uint32_t> local_clients;  // per rank, as each manifest said
    std::vector<uint64_t> rejoins;        // per rank: Mailbox::rejoined(rank) when agreed
    bool trainers_reduce = false;         // AgreedJob::trainers_reduce
  };
  std::mutex mu_;
  RunningJob running_;  // guarded by mu_
};

// A job incarnation or attempt nonce: 64 random bits from the kernel, never 0 (0 means "none").
uint64_t random_nonzero_u64();

}  // namespace sparsecar
