// The control socket on a real 2-node job: `set` from rank 1 takes effect on both nodes at the
// step in the reply; pause/resume switch to dense and back; checkpoint/restore of residuals;
// drain; SIGHUP reload of live knobs (structural ones refused); sparsecarctl's output and exit
// codes; SIGTERM drains and exits 0.
#include <gtest/gtest.h>
#include <sys/stat.h>

#include <array>
#include <cstdio>
#include <fstream>
#include <thread>

#include "daemon/control/client.h"
#include "sparsecar/client.h"
#include "tests/integration/daemon_harness.h"

namespace sparsecar {
namespace {

using json = nlohmann::json;
using namespace std::chrono_literals;

constexpr size_t kElements = 1000;

// One trainer per node, stepping in lock-step from the test thread.
class Trainers {
 public:
  explicit Trainers(const std::vector<std::string>& sockets) {
    for (const auto& s : sockets) {
      auto c = Client::connect(s);
      EXPECT_TRUE(c.ok()) << c.status().to_string();
      clients_.push_back(std::move(c).value());
      auto t = clients_.back()->register_tensor("w", kElements);
      EXPECT_TRUE(t.ok());
      tensors_.push_back(*t);
    }
  }
  // Runs `step` on every node; returns each node's nnz (or -1 on failure).
  std::vector<int64_t> step(uint64_t step) {
    std::vector<int64_t> nnz(clients_.size(), -1);
    for (size_t r = 0; r < clients_.size(); ++r) {
      for (size_t i = 0; i < kElements; ++i) tensors_[r]->data()[i] = static_cast<float>((i * 7919 + step * 31 + r) % 1000) - 500.0f;
      EXPECT_TRUE(clients_[r]->submit(*tensors_[r], step).ok());
    }
    for (size_t r = 0; r < clients_.size(); ++r) {
      auto info = clients_[r]->wait(*tensors_[r], step, 20s);
      if (info.ok()) nnz[r] = static_cast<int64_t>(info->nnz);
      last_error_ = info.ok() ? "" : info.status().to_string();
    }
    return nnz;
  }
  const std::string& last_error() const { return last_error_; }

 private:
  std::vector<std::unique_ptr<Client>> clients_;
  std::vector<Tensor*> tensors_;
  std::string last_error_;
};

std::string control_endpoint(const itest::LocalJob& job, uint32_t rank) {
  return "ipc://" + job.dir() + "/rank-" + std::to_string(rank) + "-control.sock";
}

json call(const itest::LocalJob& job, uint32_t rank, const std::string& cmd, const json& args = json::object()) {
  control::ClientOptions options;
  options.endpoint = control_endpoint(job, rank);
  auto client = control::ControlClient::connect(options);
  EXPECT_TRUE(client.ok()) << client.status().to_string();
  if (!client.ok()) return json::object();
  auto reply = (*client)->call(cmd, args);
  EXPECT_TRUE(reply.ok()) << reply.status().to_string();
  return reply.ok() ? *reply : json::object();
}

struct CtlRun {
  int code = -1;
  std::string out;
};

// `env` is "NAME=value ..." put before the command ("" none); SPARSECAR_CONTROL is unset otherwise.
CtlRun ctl(const std::string& args, const std::string& env = "") {
  CtlRun r;
  std::string cmd = "env -u SPARSECAR_CONTROL " + env + " " + std::string(SPARSECARCTL_PATH) + " " + args + " 2>&1";
  FILE* p = ::popen(cmd.c_str(), "r");
  std::array<char, 4096> buf{};
  size_t n;
  while ((n = std::fread(buf.data(), 1, buf.size(), p)) > 0) r.out.append(buf.data(), n);
  int status = ::pclose(p);
  r.code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return r;
}

class ControlJob : public ::testing::Test {
 protected:
  void start(std::vector<std::string> extra = {}) {
    itest::JobSpec spec;
    spec.world = 2;
    spec.extra = std::move(extra);
    job_ = std::make_unique<itest::LocalJob>(spec);
    ASSERT_TRUE(job_->wait_ready()) << job_->logs();
    trainers_ = std::make_unique<Trainers>(job_->sockets());
  }
  void TearDown() override {
    trainers_.reset();
    job_.reset();
  }
  std::unique_ptr<itest::LocalJob> job_;
  std::unique_ptr<Trainers> trainers_;
};

TEST_F(ControlJob, SetFromAnyRankTakesEffectEverywhereAtTheRepliedStep) {
  start({"--density", "0.01"});
  uint64_t s = 0;
  for (; s < 3; ++s) EXPECT_EQ(trainers_->step(s), (std::vector<int64_t>{10, 10})) << job_->logs();

  json r = call(*job_, 1, "set", {{"knob", "density"}, {"value", 0.05}});
  ASSERT_TRUE(r["ok"].get<bool>()) << r.dump();
  const uint64_t effective = r["result"]["effective_step"].get<uint64_t>();
  EXPECT_EQ(r["result"]["epoch"], 1);
  EXPECT_GE(effective, s);
  for (; s < effective + 3; ++s) {
    auto nnz = trainers_->step(s);
    const int64_t want = s < effective ? 10 : 50;
    EXPECT_EQ(nnz, (std::vector<int64_t>{want, want})) << "step " << s << "\n" << job_->logs();
  }
  // Both nodes report the same newest decision.
  for (uint32_t rank : {0u, 1u}) {
    json g = call(*job_, rank, "get", {{"knob", "density"}});
    EXPECT_EQ(g["result"]["value"], "0.05");
    EXPECT_EQ(g["result"]["epoch"], 1);
  }

  // pause -> dense on both nodes, resume -> sparse again.
  r = call(*job_, 0, "pause");
  ASSERT_TRUE(r["ok"].get<bool>()) << r.dump();
  uint64_t at = r["result"]["effective_step"].get<uint64_t>();
  for (; s <= at + 1; ++s) trainers_->step(s);
  EXPECT_EQ(trainers_->step(s++), (std::vector<int64_t>{1000, 1000}));
  r = call(*job_, 1, "resume");
  ASSERT_TRUE(r["ok"].get<bool>()) << r.dump();
  at = r["result"]["effective_step"].get<uint64_t>();
  for (; s <= at + 1; ++s) trainers_->step(s);
  EXPECT_EQ(trainers_->step(s++), (std::vector<int64_t>{50, 50}));

  // Refusals carry codes.
  r = call(*job_, 1, "set", {{"knob", "world_size"}, {"value", 4}});
  EXPECT_EQ(r["error"]["code"], "FAILED_PRECONDITION");
  r = call(*job_, 1, "set", {{"knob", "density"}, {"value", "lots"}});
  EXPECT_EQ(r["error"]["code"], "INVALID_ARGUMENT");

  // status: job, peers, step, plan per group.
  json st = call(*job_, 0, "status");
  ASSERT_TRUE(st["ok"].get<bool>());
  EXPECT_EQ(st["result"]["world_size"], 2);
  EXPECT_EQ(st["result"]["peers"][0]["state"], "up");
  EXPECT_EQ(st["result"]["step"], s - 1);
  EXPECT_EQ(st["result"]["groups"][0]["group"], "small");
  EXPECT_NEAR(st["result"]["groups"][0]["density"].get<double>(), 0.05, 1e-9);
  // The job's incarnation: 16 hex digits, the same on both nodes (rank 0 drew it).
  json st1 = call(*job_, 1, "status");
  ASSERT_TRUE(st["result"]["incarnation"].is_string()) << st.dump();
  EXPECT_EQ(st["result"]["incarnation"].get<std::string>().size(), 16u);
  EXPECT_EQ(st["result"]["incarnation"], st1["result"]["incarnation"]);
}

TEST_F(ControlJob, CheckpointRestoreAndDrain) {
  start({"--density", "0.01"});
  for (uint64_t s = 0; s < 3; ++s) trainers_->step(s);
  const std::string f0 = job_->dir() + "/r0.ckpt", f1 = job_->dir() + "/r1.ckpt";
  json r = call(*job_, 0, "checkpoint", {{"path", f0}});
  ASSERT_TRUE(r["ok"].get<bool>()) << r.dump();
  EXPECT_EQ(r["result"]["tensors"], 1);
  EXPECT_GT(r["result"]["residual_norm"].get<double>(), 0.0);
  const double norm0 = r["result"]["residual_norm"].get<double>();
  ASSERT_TRUE(call(*job_, 1, "checkpoint", {{"path", f1}})["ok"].get<bool>());
  trainers_->step(3);  // the residual moves on
  r = call(*job_, 0, "restore", {{"path", f0}});
  ASSERT_TRUE(r["ok"].get<bool>()) << r.dump();
  EXPECT_DOUBLE_EQ(r["result"]["residual_norm"].get<double>(), norm0);
  // Rank 1's file on rank 0, a corrupt file, a missing file: refused, nothing changed.
  r = call(*job_, 0, "restore", {{"path", f1}});
  EXPECT_EQ(r["error"]["code"], "FAILED_PRECONDITION") << r.dump();
  {
    std::fstream f(f0, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(60);
    f.put('\x7f');
  }
  r = call(*job_, 0, "restore", {{"path", f0}});
  EXPECT_EQ(r["error"]["code"], "DATA_LOSS") << r.dump();
  r = call(*job_, 0, "restore", {{"path", job_->dir() + "/none"}});
  EXPECT_FALSE(r["ok"].get<bool>());
  // A FIFO stalled training and the control socket; /dev/zero exhausted memory. Both are refused
  // at once, and the daemon steps on.
  const std::string fifo = job_->dir() + "/fifo";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  for (const std::string& path : {fifo, std::string("/dev/zero")}) {
    const auto t0 = std::chrono::steady_clock::now();
    r = call(*job_, 0, "restore", {{"path", path}});
    EXPECT_LT(std::chrono::steady_clock::now() - t0, 2s) << path;
    EXPECT_EQ(r["error"]["code"], "FAILED_PRECONDITION") << r.dump();
    EXPECT_NE(r["error"]["message"].get<std::string>().find("regular files only"), std::string::npos) << r.dump();
  }
  EXPECT_EQ(trainers_->step(4), (std::vector<int64_t>{10, 10}));

  // drain: new steps fail at once with a clear error; cancel accepts them again.
  for (uint32_t rank : {0u, 1u}) {
    r = call(*job_, rank, "drain", {{"timeout_ms", 2000}});
    ASSERT_TRUE(r["ok"].get<bool>()) << r.dump();
  }
  EXPECT_EQ(call(*job_, 0, "status")["result"]["draining"], true);
  EXPECT_EQ(trainers_->step(5), (std::vector<int64_t>{-1, -1}));
  EXPECT_NE(trainers_->last_error().find("draining"), std::string::npos) << trainers_->last_error();
  for (uint32_t rank : {0u, 1u}) ASSERT_TRUE(call(*job_, rank, "drain", {{"cancel", true}})["ok"].get<bool>());
}

TEST_F(ControlJob, SparsecarctlTablesJsonAndExitCodes) {
  start();
  trainers_->step(0);
  const std::string ep = "--endpoint " + control_endpoint(*job_, 1);
  CtlRun r = ctl(ep + " status");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("rank 1 of 2"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("PEER"), std::string::npos);
  EXPECT_NE(r.out.find("job incarnation"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("WARNING: the job is open"), std::string::npos) << "no job_secret_file here\n" << r.out;
  r = ctl(ep + " --json status");
  EXPECT_EQ(r.code, 0);
  json j = json::parse(r.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  EXPECT_EQ(j["result"]["rank"], 1);
  r = ctl(ep + " set density=0.02");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_NE(r.out.find("takes effect at step"), std::string::npos) << r.out;
  r = ctl(ep + " get density");
  EXPECT_EQ(r.out, "density = 0.02\n");
  r = ctl(ep + " get no_such_knob");
  EXPECT_EQ(r.code, 1) << r.out;
  EXPECT_NE(r.out.find("NOT_FOUND"), std::string::npos);
  r = ctl(ep + " call frobnicate");
  EXPECT_EQ(r.code, 1);
  EXPECT_NE(r.out.find("UNKNOWN_COMMAND"), std::string::npos);
  r = ctl(ep + " set");
  EXPECT_EQ(r.code, 2);
  r = ctl("--endpoint ipc://" + job_->dir() + "/nobody.sock status");
  EXPECT_EQ(r.code, 3) << r.out;
  r = ctl("--help");
  EXPECT_EQ(r.code, 0);
  EXPECT_NE(r.out.find("checkpoint"), std::string::npos);
}

TEST_F(ControlJob, SighupReloadsLiveKnobsAndSigtermDrains) {
  char tmpl[] = "/tmp/sparsecar-reload-XXXXXX";
  const std::string dir = ::mkdtemp(tmpl);
  const std::string file = dir + "/sparsecard.toml";
  std::ofstream(file) << "density = 0.01\njob_id = 0\n";
  start({"--config", file});
  trainers_->step(0);
  std::ofstream(file) << "density = 0.03\njob_id = 5\n";
  ::kill(job_->daemon(1).pid(), SIGHUP);
  std::string value;
  for (int i = 0; i < 200 && value != "0.03"; ++i) {
    std::this_thread::sleep_for(20ms);
    value = call(*job_, 0, "get", {{"knob", "density"}})["result"].value("value", "");
  }
  EXPECT_EQ(value, "0.03") << job_->logs();
  EXPECT_EQ(call(*job_, 1, "get", {{"knob", "job_id"}})["result"]["value"], "0");
  EXPECT_NE(job_->daemon(1).log().find("'job_id' changed but cannot change while the daemon runs"),
            std::string::npos)
      << job_->logs();
  EXPECT_NE(job_->daemon(1).log().find("reload"), std::string::npos);

  trainers_.reset();  // trainers leave first, as in a real shutdown
  EXPECT_EQ(job_->daemon(1).stop(), 0) << job_->logs();
  EXPECT_NE(job_->daemon(1).log().find("draining"), std::string::npos);
  struct stat st{};
  EXPECT_NE(::stat((job_->dir() + "/rank-1-control.sock").c_str(), &st), 0) << "control socket left behind";
  EXPECT_NE(::stat((job_->dir() + "/rank-1-control.sock.lock").c_str(), &st), 0) << "control lock left behind";
  EXPECT_NE(::stat((job_->dir() + "/rank-1.sock.lock").c_str(), &st), 0) << "trainer socket lock left behind";
  EXPECT_NE(::stat((job_->dir() + "/rank-1.sock").c_str(), &st), 0) << "trainer socket left behind";
  EXPECT_EQ(::stat((job_->dir() + "/rank-0-control.sock.lock").c_str(), &st), 0) << "a live daemon's lock was removed";
  std::filesystem::remove_all(dir);
}

bool has(const std::string& text, const std::string& what) { return text.find(what) != std::string::npos; }

TEST_F(ControlJob, SparsecarctlOptionsAnywhereNumbersCheckedAndErrorsNameTheEndpoint) {
  start();
  trainers_->step(0);
  const std::string ep = control_endpoint(*job_, 1);
  CtlRun r = ctl("status --json --endpoint " + ep);  // options after the command
  EXPECT_EQ(r.code, 0) << r.out;
  json j = json::parse(r.out, nullptr, false);
  ASSERT_FALSE(j.is_discarded()) << r.out;
  EXPECT_EQ(j["result"]["rank"], 1);
  r = ctl("get density", "SPARSECAR_CONTROL=" + ep);  // the environment
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_EQ(r.out.rfind("density = ", 0), 0u) << r.out;
  r = ctl("report-metric loss -0.5 3 --endpoint " + ep);  // a negative value is a value
  EXPECT_EQ(r.code, 0) << r.out;

  // Numbers are checked and the error names what is wrong.
  r = ctl("--endpoint " + ep + " status --timeout-ms abc");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "--timeout-ms")) << r.out;
  r = ctl("--endpoint " + ep + " report-metric loss lots");
  EXPECT_EQ(r.code, 2) << r.out;
  EXPECT_TRUE(has(r.out, "VALUE")) << r.out;
  r = ctl("--endpoint " + ep + " drain soon");
  EXPECT_EQ(r.code, 2) << r.out;
  r = ctl("--endpoint " + ep + " status extra");
  EXPECT_EQ(r.code, 2) << r.out;
  r = ctl("--endpoint " + ep + " frobnicate");
  EXPECT_EQ(r.code, 2) << r.out;

  // A daemon that is not there: the endpoint tried, where it came from and how to change it.
  const std::string nobody = "ipc://" + job_->dir() + "/nobody.sock";
  r = ctl("status --endpoint " + nobody);
  EXPECT_EQ(r.code, 3) << r.out;
  for (const char* what : {"from --endpoint", "--endpoint ipc:///PATH", "SPARSECAR_CONTROL"}) {
    EXPECT_TRUE(has(r.out, what)) << what << "\n" << r.out;
  }
  EXPECT_TRUE(has(r.out, nobody)) << r.out;
  r = ctl("status", "SPARSECAR_CONTROL=" + nobody);
  EXPECT_EQ(r.code, 3) << r.out;
  EXPECT_TRUE(has(r.out, "from SPARSECAR_CONTROL")) << r.out;

  // --help for the tool and for each command.
  r = ctl("--help");
  EXPECT_EQ(r.code, 0) << r.out;
  for (const char* cmd : {"status", "get", "set", "policy", "report-metric", "pause", "resume", "drain", "checkpoint",
                          "restore", "commands", "call", "knobs", "version"}) {
    EXPECT_TRUE(has(r.out, cmd)) << cmd;
    CtlRun sub = ctl(std::string(cmd) + " --help");
    EXPECT_EQ(sub.code, 0) << cmd << ": " << sub.out;
  }
  r = ctl("set --help");
  EXPECT_TRUE(has(r.out, "current job only")) << r.out;
}

TEST_F(ControlJob, StatusShowsBytesSavedAndRatioAndTheLogShowsProgressAndASummary) {
  start({"--density", "0.01", "--progress-log-seconds", "0.05"});
  trainers_->step(0);
  std::this_thread::sleep_for(100ms);  // past the progress interval (real time: real daemons)
  trainers_->step(1);
  trainers_->step(2);
  json st = call(*job_, 0, "status");
  ASSERT_TRUE(st["ok"].get<bool>()) << st.dump();
  const json t = st["result"]["traffic"]["job"];
  EXPECT_EQ(t["steps"], 3) << st.dump();
  EXPECT_LT(t["bytes_sent"].get<uint64_t>(), t["dense_bytes"].get<uint64_t>()) << t.dump();
  EXPECT_EQ(t["bytes_saved"].get<int64_t>(),
            static_cast<int64_t>(t["dense_bytes"].get<uint64_t>() - t["bytes_sent"].get<uint64_t>()));
  EXPECT_GT(t["compression_ratio"].get<double>(), 5.0) << t.dump();  // 1 % of 1000 floats as COO
  CtlRun r = ctl("--endpoint " + control_endpoint(*job_, 0) + " status");
  EXPECT_EQ(r.code, 0) << r.out;
  EXPECT_TRUE(has(r.out, "traffic this job: sent ")) << r.out;
  EXPECT_TRUE(has(r.out, " dense, ratio ")) << r.out;
  EXPECT_TRUE(has(r.out, "saved ")) << r.out;
  EXPECT_TRUE(has(job_->daemon(0).log(), "progress: step ")) << job_->logs();

  // Job end: one summary line, and the daemon's totals outlive the job.
  trainers_.reset();
  std::string log;
  for (int i = 0; i < 250 && !has(log, "job summary: 3 steps"); ++i) {
    std::this_thread::sleep_for(20ms);
    log = job_->daemon(1).log();
  }
  EXPECT_TRUE(has(log, "job summary: 3 steps")) << job_->logs();
  EXPECT_TRUE(has(log, "ratio ")) << log;
  st = call(*job_, 1, "status");
  EXPECT_EQ(st["result"]["traffic"]["job"]["steps"], 0) << st.dump();
  EXPECT_EQ(st["result"]["traffic"]["since_start"]["steps"], 3) << st.dump();
}

// The case: `set selector=threshold` must not carry over into the next job.
TEST_F(ControlJob, LiveSettingsLastOneJobAndRevertWithALogLine) {
  start({"--density", "0.01"});
  uint64_t s = 0;
  EXPECT_EQ(trainers_->step(s++), (std::vector<int64_t>{10, 10}));
  CtlRun r = ctl("--endpoint " + control_endpoint(*job_, 1) + " set selector=threshold density=0.05");
  ASSERT_EQ(r.code, 0) << r.out;
  for (int i = 0; i < 4; ++i) trainers_->step(s++);
  EXPECT_EQ(ctl("--endpoint " + control_endpoint(*job_, 0) + " get selector").out, "selector = threshold\n");

  // Every trainer leaves; the next job on the same daemons starts from the configured values.
  trainers_.reset();
  std::string log;
  for (int i = 0; i < 250 && !has(log, "back to the configured values"); ++i) {
    std::this_thread::sleep_for(20ms);
    log = job_->daemon(0).log();
  }
  EXPECT_TRUE(has(log, "selector threshold -> topk")) << job_->logs();
  trainers_ = std::make_unique<Trainers>(job_->sockets());
  EXPECT_EQ(trainers_->step(0), (std::vector<int64_t>{10, 10})) << job_->logs();
  for (uint32_t rank : {0u, 1u}) {
    EXPECT_EQ(ctl("--endpoint " + control_endpoint(*job_, rank) + " get selector").out, "selector = topk\n");
    EXPECT_EQ(ctl("--endpoint " + control_endpoint(*job_, rank) + " get density").out, "density = 0.01\n");
  }
}

}  // namespace
}  // namespace sparsecar
