// The pipeline's bounded operations: restore reads only regular files of exactly the size the
// registered tensors imply, on the caller's thread; a control operation that never started is
// never run; a step this node will never hand over (a local trainer died) fails on every peer at
// once through fail_step().
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "daemon/pipeline/checkpoint.h"
#include "daemon/pipeline/pipeline.h"
#include "tests/unit/daemon/pipeline_job.h"

namespace sparsecar {
namespace {

using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;
using Job = fakes::PipelineJob;
using fakes::random_vector;
using fakes::run_step;

PipelineOptions sparse_options() {
  PipelineOptions o;
  o.settings.compression = true;
  o.settings.selector = kernels::Selector::kTopk;
  o.settings.params.density = 0.1;
  o.step_timeout = 10000ms;
  o.join_timeout = 5000ms;
  return o;
}

class TempDir {
 public:
  TempDir() {
    char tmpl[] = "/tmp/sc-bounds-XXXXXX";
    path_ = ::mkdtemp(tmpl);
  }
  ~TempDir() { std::system(("rm -rf " + path_).c_str()); }
  std::string file(const std::string& name) const { return path_ + "/" + name; }

 private:
  std::string path_;
};

// One node with tensor "w" (100 elements) and a non-zero residual after one sparse step.
struct OneNode {
  OneNode() : job(1, sparse_options()) {
    EXPECT_TRUE(pipeline().register_tensor(0, {"w", 100}).ok());
    std::vector<std::vector<float>> in{random_vector(100, 3)}, out;
    for (auto& r : run_step(job, 0, 1, in, out)) EXPECT_TRUE(r.status.ok()) << r.status.to_string();
  }
  Pipeline& pipeline() { return *job.nodes[0]->pipeline; }
  // A step still runs (the pipeline thread was not stalled).
  void expect_step_runs(uint64_t step) {
    std::vector<std::vector<float>> in{random_vector(100, static_cast<uint32_t>(step))}, out;
    for (auto& r : run_step(job, 0, step, in, out)) EXPECT_TRUE(r.status.ok()) << r.status.to_string();
  }
  Job job;
};

TEST(RestoreTest, RoundTripAndSymlinkToARegularFile) {
  TempDir dir;
  OneNode node;
  auto written = node.pipeline().checkpoint(dir.file("ck"), Clock::now() + 5s);
  ASSERT_TRUE(written.ok()) << written.status().to_string();
  EXPECT_EQ(written->bytes, checkpoint_bytes(std::vector<TensorSpec>{{"w", 100}}));
  auto restored = node.pipeline().restore(dir.file("ck"), Clock::now() + 5s);
  ASSERT_TRUE(restored.ok()) << restored.status().to_string();
  EXPECT_EQ(restored->tensors, 1u);
  EXPECT_DOUBLE_EQ(restored->residual_norm, written->residual_norm);
  ASSERT_EQ(::symlink(dir.file("ck").c_str(), dir.file("link").c_str()), 0);
  EXPECT_TRUE(node.pipeline().restore(dir.file("link"), Clock::now() + 5s).ok());
}

// A FIFO used to stall the pipeline thread (and the control socket) in open(); /dev/zero was read
// until memory ran out. Both are refused at once, and training goes on.
TEST(RestoreTest, FifosDevicesAndDirectoriesAreRefusedWithoutBlocking) {
  TempDir dir;
  OneNode node;
  ASSERT_EQ(::mkfifo(dir.file("fifo").c_str(), 0600), 0);
  struct Case {
    std::string path, says;
  };
  for (const Case& c : {Case{dir.file("fifo"), "is a FIFO"}, Case{"/dev/zero", "is a character device"},
                        Case{"/dev/null", "is a character device"}, Case{"/tmp", "is a directory"}}) {
    const auto t0 = Clock::now();
    auto r = node.pipeline().restore(c.path, Clock::now() + 5s);
    EXPECT_LT(Clock::now() - t0, 1s) << c.path;
    ASSERT_FALSE(r.ok()) << c.path;
    EXPECT_EQ(r.status().code(), Code::kFailedPrecondition) << r.status().to_string();
    EXPECT_NE(r.status().message().find(c.says), std::string::npos) << r.status().message();
    EXPECT_NE(r.status().message().find("regular files only"), std::string::npos) << r.status().message();
  }
  node.expect_step_runs(2);
}

TEST(RestoreTest, AFileOfAnyOtherSizeIsRefusedBeforeItIsRead) {
  TempDir dir;
  OneNode node;
  const uint64_t want = checkpoint_bytes(std::vector<TensorSpec>{{"w", 100}});
  for (uint64_t size : {uint64_t{0}, want - 1, want + 1, uint64_t{64} << 30}) {  // 64 GiB: sparse, never read
    const std::string path = dir.file("big");
    int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::ftruncate(fd, static_cast<off_t>(size)), 0);
    ::close(fd);
    const auto t0 = Clock::now();
    auto r = node.pipeline().restore(path, Clock::now() + 5s);
    EXPECT_LT(Clock::now() - t0, 1s);
    ASSERT_FALSE(r.ok());
    EXPECT_EQ(r.status().code(), Code::kFailedPrecondition);
    EXPECT_NE(r.status().message().find("is " + std::to_string(size) + " bytes"), std::string::npos)
        << r.status().message();
    EXPECT_NE(r.status().message().find("exactly " + std::to_string(want) + " bytes"), std::string::npos)
        << r.status().message();
  }
  // Right size, wrong bytes: the checksum says so; nothing is applied.
  {
    std::string junk(want, 'x');
    FILE* f = std::fopen(dir.file("junk").c_str(), "wb");
    ASSERT_NE(f, nullptr);
    std::fwrite(junk.data(), 1, junk.size(), f);
    std::fclose(f);
  }
  auto r = node.pipeline().restore(dir.file("junk"), Clock::now() + 5s);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), Code::kDataLoss);
  node.expect_step_runs(2);
}

TEST(CheckpointParseTest, EveryRuleOfTheFormatIsChecked) {
  TempDir dir;
  OneNode node;
  ASSERT_TRUE(node.pipeline().checkpoint(dir.file("ck"), Clock::now() + 5s).ok());
  std::string good;
  {
    FILE* f = std::fopen(dir.file("ck").c_str(), "rb");
    ASSERT_NE(f, nullptr);
    char buf[4096];
    for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) good.append(buf, n);
    std::fclose(f);
  }
  const std::vector<TensorSpec> specs{{"w", 100}};
  ASSERT_TRUE(parse_checkpoint(good, specs, 0, 1).ok());
  EXPECT_EQ(parse_checkpoint(good.substr(0, 10), specs, 0, 1).status().code(), Code::kDataLoss);
  EXPECT_EQ(parse_checkpoint(good, specs, 1, 2).status().code(), Code::kFailedPrecondition);  // other rank
  EXPECT_EQ(parse_checkpoint(good, std::vector<TensorSpec>{{"v", 100}}, 0, 1).status().code(),
            Code::kFailedPrecondition);
  std::string flipped = good;
  flipped[40] ^= 1;
  EXPECT_EQ(parse_checkpoint(flipped, specs, 0, 1).status().code(), Code::kDataLoss);  // CRC
}

// encode_checkpoint is what the pipeline writes, byte for byte, and parse_checkpoint accepts it back.
TEST(CheckpointParseTest, EncodeCheckpointIsWhatThePipelineWrites) {
  TempDir dir;
  OneNode node;
  ASSERT_TRUE(node.pipeline().checkpoint(dir.file("ck"), Clock::now() + 5s).ok());
  std::string written;
  {
    FILE* f = std::fopen(dir.file("ck").c_str(), "rb");
    ASSERT_NE(f, nullptr);
    char buf[4096];
    for (size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) written.append(buf, n);
    std::fclose(f);
  }
  const std::vector<TensorSpec> specs{{"w", 100}};
  auto parsed = parse_checkpoint(written, specs, 0, 1);
  ASSERT_TRUE(parsed.ok()) << parsed.status().to_string();
  std::vector<float> residual(100);
  std::memcpy(residual.data(), written.data() + parsed->offsets[0], residual.size() * sizeof(float));
  const CheckpointEntry entry{"w", residual};
  EXPECT_EQ(encode_checkpoint(parsed->job_id, 0, 1, std::span(&entry, 1)), written);
  EXPECT_EQ(checkpoint_bytes(specs), written.size());
}

TEST(RestoreTest, NothingRegisteredIsRefused) {
  TempDir dir;
  Job job(1, sparse_options());
  auto r = job.nodes[0]->pipeline->restore(dir.file("none"), Clock::now() + 1s);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("no tensors are registered"), std::string::npos) << r.status().message();
}

// An operation that the pipeline thread did not start before its deadline is never run, and the
// caller is told so; the pipeline thread is busy with a step waiting for a silent peer here.
TEST(CallOnThreadTest, AnOperationNotStartedByItsDeadlineIsNeverRun) {
  TempDir dir;
  PipelineOptions o = sparse_options();
  o.step_timeout = 1500ms;
  Job job(2, o);
  for (auto& n : job.nodes) ASSERT_TRUE(n->pipeline->register_tensor(0, {"w", 100}).ok());
  std::vector<std::vector<float>> in(2, random_vector(100, 4)), out;
  for (auto& r : run_step(job, 0, 1, in, out)) ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  // Only rank 0 submits step 2: its pipeline thread waits for rank 1 until step_timeout.
  std::vector<float> result(100);
  job.nodes[0]->pipeline->submit({0, 2, 0.f, in[0], result});
  std::this_thread::sleep_for(100ms);
  auto late = job.nodes[0]->pipeline->checkpoint(dir.file("late"), Clock::now() + 200ms);
  ASSERT_FALSE(late.ok());
  EXPECT_EQ(late.status().code(), Code::kDeadlineExceeded);
  EXPECT_NE(late.status().message().find("not run"), std::string::npos) << late.status().message();
  EXPECT_FALSE(job.nodes[0]->results.wait(0, 2).status.ok());  // the step ran into its deadline
  std::this_thread::sleep_for(100ms);
  EXPECT_NE(::access(dir.file("late").c_str(), F_OK), 0) << "the abandoned checkpoint was written later";
}

// The old waiter gave up at its deadline even while the pipeline thread was running the
// operation, so the caller got DEADLINE_EXCEEDED for a checkpoint that was then written. Once
// started, an operation is waited for and its real outcome returned.
TEST(CallOnThreadTest, AnOperationStartedBeforeItsDeadlineReportsItsRealOutcome) {
  TempDir dir;
  Job job(1, sparse_options(), [](Pipeline& p) {
    p.set_call_started_hook_for_test([] { std::this_thread::sleep_for(400ms); });  // outlasts the deadline
  });
  ASSERT_TRUE(job.nodes[0]->pipeline->register_tensor(0, {"w", 100}).ok());
  std::vector<std::vector<float>> in{random_vector(100, 6)}, out;
  for (auto& r : run_step(job, 0, 1, in, out)) ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  const auto t0 = Clock::now();
  auto written = job.nodes[0]->pipeline->checkpoint(dir.file("ck"), t0 + 100ms);
  EXPECT_GE(Clock::now() - t0, 400ms);
  ASSERT_TRUE(written.ok()) << written.status().to_string();
  EXPECT_EQ(::access(dir.file("ck").c_str(), F_OK), 0);
}

// A local trainer died on rank 1 before it submitted step 2: rank 0, which submitted, must fail at
// once naming rank 1 and the cause, not at its 10 s step deadline.
TEST(FailStepTest, PeersFailTheStepAtOnceNamingTheNodeAndTheCause) {
  Job job(2, sparse_options());
  for (auto& n : job.nodes) ASSERT_TRUE(n->pipeline->register_tensor(0, {"w", 100}).ok());
  std::vector<std::vector<float>> in(2, random_vector(100, 5)), out;
  for (auto& r : run_step(job, 0, 1, in, out)) ASSERT_TRUE(r.status.ok()) << r.status.to_string();
  std::vector<float> result(100);
  const auto t0 = Clock::now();
  job.nodes[0]->pipeline->submit({0, 2, 0.f, in[0], result});
  job.nodes[1]->pipeline->fail_step(0, 2, "local trainer client 1 (pid 42) disconnected (closed the connection)");
  StepResult r = job.nodes[0]->results.wait(0, 2);
  EXPECT_LT(Clock::now() - t0, 2s);
  EXPECT_EQ(r.status.code(), Code::kAborted) << r.status.to_string();
  EXPECT_NE(r.status.message().find("rank 1"), std::string::npos) << r.status.message();
  EXPECT_NE(r.status.message().find("pid 42"), std::string::npos) << r.status.message();
  // Fine afterwards: the next step completes on both.
  for (auto& s : run_step(job, 0, 3, in, out)) EXPECT_TRUE(s.status.ok()) << s.status.to_string();
}

TEST(FootprintTest, CoversTheCompressorsBuffers) {
  Job job(1, sparse_options());
  const uint64_t n = 1 << 20;
  const uint64_t bytes = job.nodes[0]->pipeline->tensor_footprint_bytes({"w", n});
  EXPECT_GE(bytes, 8 * n * sizeof(float));  // residual, work, index, value + velocity, mask state
  EXPECT_LT(bytes, 40 * n * sizeof(float));
}

}  // namespace
}  // namespace sparsecar
