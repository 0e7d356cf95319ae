// JobAgreement over an in-process network: the nodes' manifests must match but for their local
// trainer counts (summed) and whether their trainers all-reduce dense steps themselves (ANDed:
// the job's `trainers_reduce`, which every node learns from rank 0's ack); a replacement joining
// the running job must not lack what the job agreed on.
#include "daemon/pipeline/job_agreement.h"

#include <gtest/gtest.h>

#include <chrono>
#include <future>
#include <memory>
#include <string>
#include <vector>

#include "daemon/collective/mailbox.h"
#include "tests/unit/daemon/fake_transport.h"

namespace sparsecar {
namespace {

using namespace std::chrono_literals;

// What Pipeline::manifest() writes, for one tensor.
std::string manifest(uint32_t local_clients, bool trainers_reduce, const std::string& knobs = "density=0.01") {
  return "local_clients " + std::to_string(local_clients) + "\nknobs " + knobs + "\ntrainers_reduce " +
         (trainers_reduce ? "1" : "0") + "\ntensor 0 64 shape=none w\n";
}

// Rank r has r + 1 local trainers. Rank 0's mailbox hands manifests to its agreement first, as
// the pipeline wires it (a replacement's request to join the running job).
class Nodes {
 public:
  explicit Nodes(uint32_t world) : net_(world) {
    for (uint32_t r = 0; r < world; ++r) {
      mailboxes_.push_back(std::make_unique<Mailbox>(0, world, nullptr));
      net_.attach(r, mailboxes_.back().get());
      JobAgreement::Options o{.rank = r, .world_size = world, .job_id = 0, .local_clients = r + 1};
      agreements_.push_back(std::make_unique<JobAgreement>(o, net_.transport(r), mailboxes_.back().get(), nullptr));
    }
    JobAgreement* leader = agreements_[0].get();
    mailboxes_[0]->set_manifest_handler(
        [leader](uint32_t peer, const wire::WireHeader& h, std::span<const std::byte> payload) {
          return leader->answer_late_manifest(peer, h, payload);
        });
  }

  // Every rank agrees on its manifest at once.
  std::vector<Expected<AgreedJob>> agree(const std::vector<std::string>& manifests) {
    std::vector<std::future<Expected<AgreedJob>>> pending;
    for (uint32_t r = 0; r < manifests.size(); ++r) {
      pending.push_back(std::async(std::launch::async, [this, r, m = manifests[r]] { return agree_one(r, m); }));
    }
    std::vector<Expected<AgreedJob>> out;
    for (auto& f : pending) out.push_back(f.get());
    return out;
  }
  Expected<AgreedJob> agree_one(uint32_t rank, const std::string& manifest) {
    return agreements_[rank]->agree(manifest, steady_clock().now() + 10s);
  }
  // Rank 0 sees `rank` fail and a replacement process take its place.
  void replace(uint32_t rank) {
    mailboxes_[0]->on_peer_failed(rank, unavailable("killed by the test"));
    mailboxes_[0]->on_peer_rejoined(rank);
  }

 private:
  std::vector<std::unique_ptr<Mailbox>> mailboxes_;
  std::vector<std::unique_ptr<JobAgreement>> agreements_;
  fakes::FakeNetwork net_;  // declared last: its delivery thread stops before the mailboxes go
};

TEST(JobAgreementTest, TheJobsTrainersReduceIsTheAndOverItsNodes) {
  struct Case {
    std::vector<bool> nodes;
    bool job;
  };
  for (const Case& c : {Case{{true, true, true}, true}, Case{{true, false, true}, false},
                        Case{{false, true, true}, false}, Case{{false, false, false}, false}}) {
    Nodes nodes(3);
    std::vector<std::string> manifests;
    for (uint32_t r = 0; r < 3; ++r) manifests.push_back(manifest(r + 1, c.nodes[r]));
    auto jobs = nodes.agree(manifests);
    for (uint32_t r = 0; r < 3; ++r) {
      ASSERT_TRUE(jobs[r].ok()) << "rank " << r << ": " << jobs[r].status().to_string();
      EXPECT_EQ(jobs[r]->trainers_reduce, c.job) << "rank " << r << " of " << c.nodes[0] << c.nodes[1] << c.nodes[2];
      EXPECT_EQ(jobs[r]->total_trainers, 6u);
      EXPECT_FALSE(jobs[r]->joined_running);
      EXPECT_EQ(jobs[r]->incarnation, jobs[0]->incarnation);
    }
  }
}

TEST(JobAgreementTest, ManifestsThatDifferElsewhereAreStillRefused) {
  Nodes nodes(2);
  auto jobs = nodes.agree({manifest(1, true), manifest(2, false, "density=0.02")});
  for (uint32_t r = 0; r < 2; ++r) {
    ASSERT_FALSE(jobs[r].ok()) << r;
    EXPECT_EQ(jobs[r].status().code(), Code::kFailedPrecondition) << jobs[r].status().to_string();
    EXPECT_NE(jobs[r].status().message().find("density=0.02"), std::string::npos) << jobs[r].status().to_string();
  }
}

// Two nodes agree (rank 0's trainers reducing or not, rank 1's reducing), then rank 1 is lost
// and a replacement process takes its place.
void agree_then_replace_rank_1(Nodes& nodes, bool rank0_reduces) {
  for (const auto& job : nodes.agree({manifest(1, rank0_reduces), manifest(2, true)})) {
    ASSERT_TRUE(job.ok()) << job.status().to_string();
    ASSERT_EQ(job->trainers_reduce, rank0_reduces);
  }
  nodes.replace(1);
}

TEST(JobAgreementTest, AReplacementMustReduceWhereTheRunningJobsTrainersDo) {
  Nodes nodes(2);
  agree_then_replace_rank_1(nodes, true);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  auto refused = nodes.agree_one(1, manifest(2, false));
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), Code::kFailedPrecondition) << refused.status().to_string();
  EXPECT_NE(refused.status().message().find("trainers_reduce 0"), std::string::npos) << refused.status().to_string();
  auto joined = nodes.agree_one(1, manifest(2, true));
  ASSERT_TRUE(joined.ok()) << joined.status().to_string();
  EXPECT_TRUE(joined->joined_running);
  EXPECT_TRUE(joined->trainers_reduce);
  EXPECT_EQ(joined->total_trainers, 3u);
}

TEST(JobAgreementTest, AReplacementThatReducesJoinsAJobThatDoesNotAsOneThatDoesNot) {
  Nodes nodes(2);
  agree_then_replace_rank_1(nodes, false);
  ASSERT_FALSE(::testing::Test::HasFatalFailure());
  auto joined = nodes.agree_one(1, manifest(2, true));
  ASSERT_TRUE(joined.ok()) << joined.status().to_string();
  EXPECT_TRUE(joined->joined_running);
  EXPECT_FALSE(joined->trainers_reduce);
}

}  // namespace
}  // namespace sparsecar
