// The command table against a fake backend: arguments are type-checked, knob changes become
// proposals with the right reason, errors carry codes, and every outcome is counted.
#include <gtest/gtest.h>

#include <set>

#include "daemon/control/commands.h"
#include "daemon/metrics/metrics.h"

namespace sparsecar::control {
namespace {

using json = nlohmann::json;

class FakeBackend final : public ControlBackend {
 public:
  FakeBackend() {
    Decision d;
    d.config = std::make_shared<const Config>();
    decisions.push_back(d);
  }
  json status() override { return json{{"rank", 0}}; }
  Decision latest_decision() override { return decisions.back(); }
  Expected<Decision> propose(const KnobChanges& changes, const std::string& reason) override {
    proposals.emplace_back(changes, reason);
    auto next = std::make_shared<Config>(*decisions.back().config);
    for (const auto& [k, v] : changes) {
      const KnobSpec* spec = find_knob(k);
      if (!spec) return not_found("unknown knob '" + k + "'");
      if (!spec->live) return failed_precondition("knob '" + k + "' cannot change while the daemon runs");
      SC_RETURN_IF_ERROR(set_knob(*next, k, v));
    }
    SC_RETURN_IF_ERROR(validate(*next));  // as DecisionBoard does
    Decision d;
    d.epoch = decisions.back().epoch + 1;
    d.effective_step = 42;
    d.config = next;
    d.changes = format_changes(changes);
    d.reason = reason;
    decisions.push_back(d);
    return d;
  }
  Status report_metric(const std::string& name, double value, uint64_t step) override {
    metrics.emplace_back(name, value, step);
    return Status::Ok();
  }
  Expected<json> drain(std::chrono::milliseconds timeout, bool cancel) override {
    drains.emplace_back(timeout.count(), cancel);
    return json{{"draining", !cancel}};
  }
  Expected<json> checkpoint(const std::string& path) override { return json{{"path", path}}; }
  Expected<json> restore(const std::string& path) override {
    return failed_precondition("no tensors are registered yet (" + path + ")");
  }

  std::vector<Decision> decisions;
  std::vector<std::pair<KnobChanges, std::string>> proposals;
  std::vector<std::tuple<std::string, double, uint64_t>> metrics;
  std::vector<std::pair<int64_t, bool>> drains;
};

class CommandsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    metrics_ = Metrics::create("off").value();
    dispatcher_ = std::make_unique<Dispatcher>(&backend_, metrics_.get());
  }
  json call(const std::string& cmd, const json& args = json::object()) {
    return json::parse(dispatcher_->handle(make_request(json(++id_), cmd, args)));
  }
  std::string code(const json& reply) { return reply["error"]["code"].get<std::string>(); }
  bool scraped(const std::string& needle) { return metrics_->scrape_text().find(needle) != std::string::npos; }

  FakeBackend backend_;
  std::unique_ptr<Metrics> metrics_;
  std::unique_ptr<Dispatcher> dispatcher_;
  int id_ = 0;
};

TEST_F(CommandsTest, StatusAndCommands) {
  json r = call("status");
  ASSERT_TRUE(r["ok"].get<bool>());
  EXPECT_EQ(r["result"]["rank"], 0);
  EXPECT_EQ(r["id"], 1);
  r = call("commands");
  ASSERT_TRUE(r["ok"].get<bool>());
  std::set<std::string> names;
  for (const auto& c : r["result"]["commands"]) names.insert(c["name"].get<std::string>());
  for (const char* want : {"status", "get", "set", "policy", "report-metric", "pause", "resume", "drain", "checkpoint",
                           "restore", "commands"}) {
    EXPECT_TRUE(names.count(want)) << want;
  }
  EXPECT_TRUE(scraped(R"(sparsecar_control_requests_total{command="status",result="ok"} 1)"));
}

TEST_F(CommandsTest, GetOneOrEveryKnob) {
  json r = call("get", {{"knob", "density"}});
  ASSERT_TRUE(r["ok"].get<bool>()) << r.dump();
  EXPECT_EQ(r["result"]["value"], "0.01");
  EXPECT_EQ(r["result"]["live"], true);
  r = call("get");
  ASSERT_TRUE(r["ok"].get<bool>());
  EXPECT_EQ(r["result"]["knobs"].size(), knob_table().size());
  r = call("get", {{"knob", "nope"}});
  EXPECT_EQ(code(r), "NOT_FOUND");
  r = call("get", {{"knob", 3}});
  EXPECT_EQ(code(r), "WRONG_TYPE");
}

TEST_F(CommandsTest, SecretsAreNeverShown) {
  auto c = std::make_shared<Config>();
  c->control_token = "a-very-secret-token";
  backend_.decisions.back().config = c;
  json r = call("get");
  EXPECT_EQ(r.dump().find("a-very-secret-token"), std::string::npos);
  r = call("get", {{"knob", "control_token"}});
  EXPECT_EQ(r["result"]["value"], "<redacted>");
}

TEST_F(CommandsTest, SetProposesLiveKnobsAndRepliesWithTheStep) {
  json r = call("set", {{"knob", "density"}, {"value", 0.05}});
  ASSERT_TRUE(r["ok"].get<bool>()) << r.dump();
  EXPECT_EQ(r["result"]["epoch"], 1);
  EXPECT_EQ(r["result"]["effective_step"], 42);
  EXPECT_EQ(r["result"]["changes"]["density"], "0.05");
  ASSERT_EQ(backend_.proposals.size(), 1u);
  EXPECT_EQ(backend_.proposals[0].second, "control: set");

  r = call("set", {{"knobs", {{"selector", "threshold"}, {"threshold", 0.5}, {"compression", true}}}});
  ASSERT_TRUE(r["ok"].get<bool>()) << r.dump();
  EXPECT_EQ(r["result"]["changes"]["compression"], "on");
  EXPECT_TRUE(scraped(R"(sparsecar_controller_decisions_total{controller="control",reason="set"} 2)"));

  EXPECT_EQ(code(call("set", {{"knob", "world_size"}, {"value", 3}})), "FAILED_PRECONDITION");
  EXPECT_EQ(code(call("set", {{"knob", "density"}, {"value", 7}})), "INVALID_ARGUMENT");
  EXPECT_EQ(code(call("set", {{"knob", "density"}})), "INVALID_ARGUMENT");
  EXPECT_EQ(code(call("set", {{"knob", "density"}, {"value", {1, 2}}})), "WRONG_TYPE");
  EXPECT_EQ(code(call("set", {{"knobs", {{"density", json::array()}}}})), "INVALID_ARGUMENT");
  EXPECT_EQ(code(call("set", {{"knob", "density"}, {"value", 0.1}, {"knobs", json::object()}})), "INVALID_ARGUMENT");
  EXPECT_EQ(code(call("set", {{"bogus", 1}})), "INVALID_ARGUMENT");
}

TEST_F(CommandsTest, PauseResumeAndPolicy) {
  json r = call("pause");
  ASSERT_TRUE(r["ok"].get<bool>());
  EXPECT_EQ(backend_.proposals.back().first, (KnobChanges{{"compression", "off"}}));
  EXPECT_EQ(backend_.proposals.back().second, "control: pause");
  r = call("resume");
  ASSERT_TRUE(r["ok"].get<bool>());
  EXPECT_EQ(backend_.proposals.back().first, (KnobChanges{{"compression", "on"}}));
  if (find_knob("controller") == nullptr) {
    r = call("policy", {{"controller", "static"}});
    ASSERT_TRUE(r["ok"].get<bool>());
    EXPECT_EQ(r["result"]["changed"], false);
    r = call("policy", {{"controller", "bandit"}});
    EXPECT_EQ(code(r), "NOT_FOUND");
    EXPECT_NE(r["error"]["message"].get<std::string>().find("static"), std::string::npos);
  } else {
    r = call("policy", {{"controller", "no-such-controller"}});
    EXPECT_FALSE(r["ok"].get<bool>());
  }
  EXPECT_EQ(code(call("policy")), "INVALID_ARGUMENT");
}

TEST_F(CommandsTest, ReportMetricDrainCheckpointRestore) {
  json r = call("report-metric", {{"name", "val_acc"}, {"value", 0.91}, {"step", 100}});
  ASSERT_TRUE(r["ok"].get<bool>()) << r.dump();
  ASSERT_EQ(backend_.metrics.size(), 1u);
  EXPECT_EQ(std::get<2>(backend_.metrics[0]), 100u);
  EXPECT_EQ(code(call("report-metric", {{"name", "x"}, {"value", "high"}})), "WRONG_TYPE");
  EXPECT_EQ(code(call("report-metric", {{"name", "x"}, {"value", 1}, {"step", -1}})), "WRONG_TYPE");

  ASSERT_TRUE(call("drain", {{"timeout_ms", 500}})["ok"].get<bool>());
  ASSERT_TRUE(call("drain", {{"cancel", true}})["ok"].get<bool>());
  EXPECT_EQ(backend_.drains, (std::vector<std::pair<int64_t, bool>>{{500, false}, {30000, true}}));

  EXPECT_TRUE(call("checkpoint", {{"path", "/tmp/x"}})["ok"].get<bool>());
  EXPECT_EQ(code(call("checkpoint", {{"path", "relative/x"}})), "INVALID_ARGUMENT");
  r = call("restore", {{"path", "/tmp/x"}});
  EXPECT_EQ(code(r), "FAILED_PRECONDITION");
  EXPECT_TRUE(scraped(R"(sparsecar_control_requests_total{command="restore",result="error"} 1)"));
}

TEST_F(CommandsTest, ProtocolErrorsAreAnsweredAndCounted) {
  json r = json::parse(dispatcher_->handle("garbage"));
  EXPECT_EQ(code(r), "MALFORMED");
  EXPECT_TRUE(r["id"].is_null());
  r = json::parse(dispatcher_->handle(R"({"v":1,"id":"q","cmd":"frobnicate"})"));
  EXPECT_EQ(code(r), "UNKNOWN_COMMAND");
  EXPECT_EQ(r["id"], "q");
  r = json::parse(dispatcher_->handle(std::string(kDefaultMaxMessageBytes + 1, ' ')));
  EXPECT_EQ(code(r), "TOO_LARGE");
  EXPECT_TRUE(scraped(R"(sparsecar_control_rejected_total{reason="malformed"} 1)"));
  EXPECT_TRUE(scraped(R"(sparsecar_control_rejected_total{reason="unknown_command"} 1)"));
  EXPECT_TRUE(scraped(R"(sparsecar_control_rejected_total{reason="too_large"} 1)"));
  EXPECT_TRUE(scraped(R"(sparsecar_errors_total{kind="control_rejected"} 3)"));
}

TEST_F(CommandsTest, TokenIsRequiredWhenConfigured) {
  DispatcherOptions o;
  o.token = "0123456789abcdef";
  Dispatcher d(&backend_, metrics_.get(), o);
  json r = json::parse(d.handle(make_request(json(1), "status", json::object())));
  EXPECT_EQ(code(r), "UNAUTHENTICATED");
  r = json::parse(d.handle(make_request(json(1), "status", json::object(), "wrong-token-xxxxxx")));
  EXPECT_EQ(code(r), "UNAUTHENTICATED");
  r = json::parse(d.handle(make_request(json(1), "status", json::object(), "0123456789abcdef")));
  EXPECT_TRUE(r["ok"].get<bool>());
}

TEST(ScalarText, MatchesWhatSetKnobParses) {
  EXPECT_EQ(scalar_text(json(true)), "on");
  EXPECT_EQ(scalar_text(json(false)), "off");
  EXPECT_EQ(scalar_text(json(3)), "3");
  EXPECT_EQ(scalar_text(json(0.001)), "0.001");
  EXPECT_EQ(scalar_text(json("topk")), "topk");
}

}  // namespace
}  // namespace sparsecar::control
