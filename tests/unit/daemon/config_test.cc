// The knob table and start-up configuration: precedence (defaults < env < file < flags), range
// checks with messages that name the knob, and --help listing every knob.
#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <set>

#include "daemon/config/config.h"
#include "daemon/config/knobs.h"
#include "daemon/pipeline/settings.h"
#include "sparsecar/policies/controllers.h"
#include "sparsecar/policies/overrides.h"
#include "sparsecar/policies/plan.h"
#include "sparsecar/policies/tensor_plan.h"

namespace sparsecar {
namespace {

struct Env {
  std::map<std::string, std::string> vars;
  EnvLookup lookup() const {
    return [this](const char* name) -> const char* {
      auto it = vars.find(name);
      return it == vars.end() ? nullptr : it->second.c_str();
    };
  }
};

Expected<CommandLine> parse(std::vector<std::string> args, const Env& env = {}, std::string* out = nullptr) {
  std::vector<const char*> argv{"sparsecard"};
  for (auto& a : args) argv.push_back(a.c_str());
  std::string text;
  return parse_command_line(static_cast<int>(argv.size()), argv.data(), out ? out : &text, env.lookup());
}

std::string write_temp(const std::string& content) {
  char path[] = "/tmp/sparsecar-config-XXXXXX";
  int fd = mkstemp(path);
  EXPECT_GE(fd, 0);
  close(fd);
  std::ofstream(path) << content;
  return path;
}

TEST(KnobsTest, EveryKnobRoundTripsItsDefault) {
  Config c;
  for (const auto& k : knob_table()) {
    auto v = get_knob(c, k.name);
    ASSERT_TRUE(v.ok()) << k.name;
    EXPECT_TRUE(set_knob(c, k.name, *v).ok()) << k.name << " = " << *v;
  }
}

TEST(KnobsTest, RangesAndTypesAreEnforcedWithTheKnobNamed) {
  Config c;
  auto s = set_knob(c, "density", "1.5");
  EXPECT_EQ(s.code(), Code::kInvalidArgument);
  EXPECT_NE(s.message().find("density"), std::string::npos);
  EXPECT_FALSE(set_knob(c, "density", "0").ok());
  EXPECT_FALSE(set_knob(c, "density", "abc").ok());
  EXPECT_FALSE(set_knob(c, "density", "nan").ok());
  EXPECT_FALSE(set_knob(c, "world_size", "-1").ok());
  EXPECT_FALSE(set_knob(c, "world_size", "0").ok());
  EXPECT_FALSE(set_knob(c, "world_size", "2x").ok());
  EXPECT_FALSE(set_knob(c, "selector", "magic").ok());
  EXPECT_FALSE(set_knob(c, "compression", "maybe").ok());
  EXPECT_EQ(set_knob(c, "no_such_knob", "1").code(), Code::kNotFound);
  EXPECT_TRUE(set_knob(c, "selector", "threshold").ok());
  EXPECT_EQ(c.selector, kernels::Selector::kThreshold);
  EXPECT_TRUE(set_knob(c, "compression", "off").ok());
  EXPECT_FALSE(c.compression);
  EXPECT_TRUE(set_knob(c, "density", "0.002").ok());
  EXPECT_EQ(c.selector_params.density, 0.002);
}

TEST(KnobsTest, AgreedKnobsListExactlyTheAgreedOnes) {
  Config c;
  c.selector_params.density = 0.25;
  std::string a = agreed_knobs(c);
  EXPECT_NE(a.find("density=0.25"), std::string::npos) << a;
  EXPECT_NE(a.find("compression=on"), std::string::npos) << a;
  EXPECT_EQ(a.find("rank="), std::string::npos) << a;  // rank differs per node by design
  c.rank = 3;
  EXPECT_EQ(a, agreed_knobs(c));
}

// The agreed text nodes compare at the first step, pinned for the defaults: a change here makes
// nodes of different versions refuse each other.
TEST(KnobsTest, AgreedKnobsTextOfTheDefaults) {
  EXPECT_EQ(agreed_knobs(Config{}),
            "world_size=1 job_id=0 compression=on selector=topk density=0.01 threshold=0.001 block_size=64 "
            "group_norm=l2 heads=8 mask_period=100 hybrid_density=0.001 quantile=0.99 approx_tolerance=0.1 "
            "random_seed=0 error_feedback=residual momentum=0.9 clip_norm=0 lr_rescale=off dense_collective=ring "
            "tensor_overrides= "
            "controller=static density_min=1e-05 density_max=1 density_cap=1 tensor_density_scale= "
            "schedule_warmup_steps=0 schedule_ramp_steps=0 schedule_start_density=0.25 schedule_end_density=0 "
            "schedule_shape=exp schedule_dense_every=0 schedule_dense_from=0 layerwise_dense_below=4096 layerwise_small_scale=1e+01 "
            "layerwise_embedding_scale=0.1 layerwise_sensitivity= dense_above=0.5");
}

// All four settings the knob table writes (daemon/pipeline/settings.h).
struct AllSettings {
  policies::PlanSettings plan;  // its base is settings_from_config's StaticSettings
  policies::ControllerSettings controllers;
  policies::ControlKnobs control;
  bool operator==(const AllSettings&) const = default;
};
AllSettings all_settings(const Config& c) {
  return {plan_settings_from_config(c), controller_settings_from_config(c), control_knobs_from_config(c)};
}

// The knob defaults (Config) and the settings structs' own defaults are written in two places;
// they must agree, or a daemon would run with values its --help does not show.
TEST(KnobSettingsTest, DefaultConfigGivesTheSettingsDefaults) {
  const Config c;
  EXPECT_TRUE(settings_from_config(c) == policies::StaticSettings{});
  EXPECT_TRUE(plan_settings_from_config(c) == policies::PlanSettings{});
  EXPECT_TRUE(controller_settings_from_config(c) == policies::ControllerSettings{});
  EXPECT_TRUE(control_knobs_from_config(c) == policies::ControlKnobs{});
}

// A valid value of `spec` other than its default.
std::string other_value(const KnobSpec& spec) {
  static const std::map<std::string, std::string> kText = {
      {"tensor_overrides", "w*: density=0.5"}, {"controller", "schedule"}, {"tensor_density_scale", "3:2"},
      {"layerwise_sensitivity", "bias:dense"}};
  const std::string def = knob_default(spec);
  switch (spec.type) {
    case KnobType::kBool:
      return def == "on" ? "off" : "on";
    case KnobType::kUint: {
      const std::string max = std::to_string(static_cast<uint64_t>(spec.max));
      return max != def ? max : std::to_string(static_cast<uint64_t>(spec.min));
    }
    case KnobType::kDouble: {
      char buf[64];
      std::snprintf(buf, sizeof buf, "%.17g", spec.max == std::stod(def) ? spec.min : spec.max);
      return buf;
    }
    case KnobType::kChoice: {
      const std::string choices = spec.choices;
      const size_t bar = choices.find('|');
      const std::string first = choices.substr(0, bar);
      if (first != def) return first;
      const size_t next = choices.find('|', bar + 1);
      return choices.substr(bar + 1, next == std::string::npos ? std::string::npos : next - bar - 1);
    }
    case KnobType::kString: {
      auto it = kText.find(spec.name);
      return it == kText.end() ? "other" : it->second;
    }
  }
  return "";
}

// Every knob but the daemon's own (listed here by hand) feeds some policy setting: changing it
// changes what the policies see. And the daemon's own change none.
TEST(KnobSettingsTest, EveryPolicyKnobReachesTheSettings) {
  const std::set<std::string> daemon_only = {
      "rank", "coordinator", "job_id", "job_secret_file", "local_clients", "socket", "control", "control_group",
      "control_token", "control_curve_secret_key", "control_max_message_bytes", "drain_timeout_ms", "metrics_listen",
      "log_level", "progress_log_seconds", "ucx_tls", "ucx_net_devices", "kernel_threads", "mailbox_max_bytes",
      "tensor_memory_budget_bytes",
      "session_handshake_timeout_ms", "controller_metric", "step_timeout_ms", "join_timeout_ms",
      "peer_down_grace_ms", "accept_replacements",
      "trainer_lease",      // the pipeline reads it from the decision in force (Pipeline::trainer_lease)
      "step_probe_share",        // the link probe's sender reads it from the decision in force (LinkProbe)
      "step_timed_send_every"};  // the observation collector hands it to the transport (set_timed_sends)
  const AllSettings defaults = all_settings(Config{});
  for (const KnobSpec& spec : knob_table()) {
    SCOPED_TRACE(spec.name);
    Config c;
    const std::string value = other_value(spec);
    ASSERT_TRUE(set_knob(c, spec.name, value).ok()) << value;
    ASSERT_NE(get_knob(c, spec.name).value(), knob_default(spec)) << value;
    EXPECT_EQ(all_settings(c) == defaults, daemon_only.count(spec.name) == 1) << value;
  }
}

// Where the renamed and the new knobs land (the field names now match the knobs').
TEST(KnobSettingsTest, KnobsLandInTheFieldsOfTheirNames) {
  Config c;
  for (const auto& [name, value] :
       std::vector<std::pair<std::string, std::string>>{{"goodput_smoothing", "0.5"},
                                                        {"controller_interval_steps", "7"},
                                                        {"controller_hysteresis", "0.3"},
                                                        {"schedule_warmup_steps", "9"},
                                                        {"random_seed", "42"},
                                                        {"layerwise_small_scale", "3"},
                                                        {"frequency_alpha", "0.6"},
                                                        {"accuracy_alpha", "0.125"},
                                                        {"budget_settle_steps", "8"},
                                                        {"dense_above", "0.25"},
                                                        {"world_size", "4"},
                                                        {"rank", "1"},
                                                        {"controller", "bandwidth, schedule"},
                                                        {"tensor_density_scale", "3:2"},
                                                        {"schedule_shape", "linear"},
                                                        {"format", "bitmap"}}) {
    ASSERT_TRUE(set_knob(c, name, value).ok()) << name;
  }
  const AllSettings s = all_settings(c);
  EXPECT_EQ(s.controllers.goodput_smoothing, 0.5);
  EXPECT_EQ(s.controllers.controller_interval_steps, 7u);
  EXPECT_EQ(s.controllers.controller_hysteresis, 0.3);
  EXPECT_EQ(s.controllers.schedule_warmup_steps, 9u);
  EXPECT_EQ(s.plan.schedule.warmup_steps, 9u);
  EXPECT_EQ(s.plan.base.params.seed, 42u);
  EXPECT_EQ(settings_from_config(c).params.seed, 42u);
  EXPECT_EQ(s.plan.layerwise.small_scale, 3.0);
  EXPECT_EQ(s.controllers.frequency.alpha, 0.6);
  EXPECT_EQ(s.controllers.accuracy.alpha, 0.125);
  EXPECT_EQ(s.controllers.budget.settle_steps, 8u);
  EXPECT_EQ(s.plan.dense_above, 0.25);
  EXPECT_EQ(s.controllers.world_size, 4u);
  const policies::ControllerSet active =
      policies::bit(policies::ControllerKind::kSchedule) | policies::bit(policies::ControllerKind::kBandwidth);
  EXPECT_EQ(s.plan.active, active);
  EXPECT_EQ(s.controllers.active, active);
  EXPECT_EQ(s.plan.tensor_scale, (policies::TensorScales{{3, 2.0}}));
  EXPECT_EQ(s.control.tensor_scale, (policies::TensorScales{{3, 2.0}}));
  EXPECT_FALSE(s.plan.schedule.exponential);
  EXPECT_EQ(s.plan.base.format, kernels::Format::kBitmap);
  EXPECT_FALSE(s.plan.base.auto_format);
  EXPECT_EQ(s.control.format, kernels::Format::kBitmap);
  // `auto` is a flag of the static settings; the controllers' format stays a concrete one.
  ASSERT_TRUE(set_knob(c, "format", "auto").ok());
  EXPECT_TRUE(settings_from_config(c).auto_format);
  EXPECT_EQ(control_knobs_from_config(c).format, kernels::Format::kCoo);
}

// The knobs a controller row names (policies::controller_registry) exist, and no knob belongs
// to two controllers.
TEST(KnobSettingsTest, ControllerRowsNameTheirKnobs) {
  auto matches = [](const std::string& word, const std::string& knob) {
    return word.back() == '*' ? knob.rfind(word.substr(0, word.size() - 1), 0) == 0 : knob == word;
  };
  std::map<std::string, std::string> owner;  // knob -> controller
  for (const policies::ControllerInfo& row : policies::controller_registry()) {
    std::string words = row.knobs;
    for (size_t from = 0; from < words.size();) {
      const size_t space = std::min(words.find(' ', from), words.size());
      const std::string word = words.substr(from, space - from);
      from = space + 1;
      int found = 0;
      for (const KnobSpec& spec : knob_table()) {
        if (!matches(word, spec.name)) continue;
        ++found;
        EXPECT_TRUE(owner.emplace(spec.name, row.name).second) << spec.name << " in " << row.name;
      }
      EXPECT_GT(found, 0) << row.name << ": " << word;
    }
  }
  EXPECT_EQ(owner["budget_settle_steps"], "budget");
  EXPECT_EQ(owner["goodput_smoothing"], "bandwidth");
  EXPECT_EQ(owner["controller_metric"], "accuracy");
}

TEST(ConfigTest, FlagsOverrideFileOverridesEnvOverridesDefaults) {
  std::string file = write_temp("density = 0.05\nselector = \"threshold\"\nworld_size = 4\n");
  Env env;
  env.vars = {{"SPARSECAR_NODE_RANK", "2"}, {"SPARSECAR_NNODES", "8"}, {"MASTER_ADDR", "10.1.2.3"},
              {"MASTER_PORT", "29500"}};
  auto cmd = parse({"--config", file, "--density", "0.003"}, env);
  ASSERT_TRUE(cmd.ok()) << cmd.status().to_string();
  EXPECT_EQ(cmd->config.rank, 2u);                          // env
  EXPECT_EQ(cmd->config.world_size, 4u);                    // file beats env
  EXPECT_EQ(cmd->config.selector_params.density, 0.003);                    // flag beats file
  EXPECT_EQ(cmd->config.selector, kernels::Selector::kThreshold);
  EXPECT_EQ(cmd->config.coordinator, "10.1.2.3:29501");     // MASTER_PORT + 1
  std::remove(file.c_str());
}

// The node-level placement comes from SPARSECAR_NODE_RANK / SPARSECAR_NNODES (else NODE_RANK /
// NNODES) and SPARSECAR_LOCAL_WORLD_SIZE; torchrun's per-process RANK / WORLD_SIZE /
// LOCAL_WORLD_SIZE are never read (a daemon beside trainers would take a trainer's rank).
TEST(ConfigTest, LauncherEnvironmentMapsToNodeLevelKnobsOnly) {
  Env launcher;  // what torchrun --nnodes 2 --nproc-per-node 4 sets for trainer 5 on node 1
  launcher.vars = {{"RANK", "5"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "4"}};
  auto a = parse({}, launcher);
  ASSERT_TRUE(a.ok()) << a.status().to_string();
  EXPECT_EQ(a->config.rank, 0u);
  EXPECT_EQ(a->config.world_size, 1u);
  EXPECT_EQ(a->config.local_clients, 1u);

  Env plain = launcher;  // the launcher's node-level names
  plain.vars.insert({{"NODE_RANK", "1"}, {"NNODES", "2"}});
  auto b = parse({}, plain);
  ASSERT_TRUE(b.ok()) << b.status().to_string();
  EXPECT_EQ(b->config.rank, 1u);
  EXPECT_EQ(b->config.world_size, 2u);

  Env ours = plain;  // SPARSECAR_* win over the plain names
  ours.vars.insert({{"SPARSECAR_NODE_RANK", "2"}, {"SPARSECAR_NNODES", "3"}, {"SPARSECAR_LOCAL_WORLD_SIZE", "4"}});
  auto c = parse({}, ours);
  ASSERT_TRUE(c.ok()) << c.status().to_string();
  EXPECT_EQ(c->config.rank, 2u);
  EXPECT_EQ(c->config.world_size, 3u);
  EXPECT_EQ(c->config.local_clients, 4u);

  Env empty_ours = plain;  // an empty variable is not set
  empty_ours.vars.insert({{"SPARSECAR_NODE_RANK", ""}});
  auto d = parse({}, empty_ours);
  ASSERT_TRUE(d.ok()) << d.status().to_string();
  EXPECT_EQ(d->config.rank, 1u);

  auto e = parse({"--rank", "0"}, plain);  // a flag beats every variable
  ASSERT_TRUE(e.ok()) << e.status().to_string();
  EXPECT_EQ(e->config.rank, 0u);

  std::string help;
  ASSERT_TRUE(parse({"--help"}, {}, &help).ok());
  EXPECT_NE(help.find("env SPARSECAR_NODE_RANK, else NODE_RANK"), std::string::npos);
  EXPECT_NE(help.find("env SPARSECAR_NNODES, else NNODES"), std::string::npos);
}

TEST(ConfigTest, BadInputsGiveClearErrors) {
  Env env;
  auto a = parse({"--rank", "4", "--world-size", "4"}, env);
  EXPECT_FALSE(a.ok());
  EXPECT_NE(a.status().message().find("rank 4"), std::string::npos) << a.status().message();
  EXPECT_FALSE(parse({"--bogus"}, env).ok());
  EXPECT_FALSE(parse({"--density", "2"}, env).ok());
  std::string bad = write_temp("densty = 0.1\n");
  auto b = parse({"--config", bad}, env);
  ASSERT_FALSE(b.ok());
  EXPECT_NE(b.status().message().find("densty"), std::string::npos);
  EXPECT_NE(b.status().message().find(":1"), std::string::npos) << b.status().message();
  std::string broken = write_temp("density = = 1\n");
  EXPECT_FALSE(parse({"--config", broken}, env).ok());
  EXPECT_FALSE(parse({"--config", "/nonexistent/sparsecar.toml"}, env).ok());
  Env bad_env;
  bad_env.vars = {{"NODE_RANK", "two"}};
  auto c = parse({}, bad_env);
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.status().message().find("NODE_RANK"), std::string::npos);
  std::remove(bad.c_str());
  std::remove(broken.c_str());
}

TEST(ConfigTest, HelpListsEveryKnobAndVersionPrints) {
  std::string out;
  auto h = parse({"--help"}, {}, &out);
  ASSERT_TRUE(h.ok());
  EXPECT_TRUE(h->exit_now);
  for (const auto& k : knob_table()) {
    std::string flag = std::string("--") + k.name;
    std::replace(flag.begin(), flag.end(), '_', '-');
    EXPECT_NE(out.find(flag), std::string::npos) << flag;
  }
  auto v = parse({"--version"}, {}, &out);
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(out, version_string() + "\n");
}

TEST(ConfigTest, CheckConfigValidatesAFile) {
  std::string good = write_temp("compression = false\nstep_timeout_ms = 1000\n");
  std::string out;
  auto g = parse({"--check-config", good}, {}, &out);
  ASSERT_TRUE(g.ok()) << g.status().to_string();
  EXPECT_TRUE(g->exit_now);
  EXPECT_FALSE(g->config.compression);
  std::string bad = write_temp("step_timeout_ms = 1\n");
  EXPECT_FALSE(parse({"--check-config", bad}, {}, &out).ok());
  std::remove(good.c_str());
  std::remove(bad.c_str());
}

// --check-config refuses everything start would refuse (Daemon::start calls the same validate()).
TEST(ConfigTest, CheckConfigRefusesWhatStartRefuses) {
  std::string out;
  auto expect_refused = [&](const std::string& content, const std::string& needle) {
    std::string file = write_temp(content);
    auto r = parse({"--check-config", file}, {}, &out);
    std::remove(file.c_str());
    ASSERT_FALSE(r.ok()) << content;
    EXPECT_NE(r.status().message().find(needle), std::string::npos) << r.status().message();
  };
  expect_refused("control = \"tcp://127.0.0.1:0\"\ncontrol_token = \"short\"\n", "control_token has 5");
  expect_refused("control_token = \"short\"\n", "at least 16");
  expect_refused("control_curve_secret_key = \"abc\"\n", "40");
  expect_refused("metrics_listen = \"not an address\"\n", "metrics_listen");
  expect_refused("metrics_listen = \"localhost:9464\"\n", "names are not resolved");
  expect_refused("metrics_listen = \"127.0.0.1:70000\"\n", "0..65535");
  expect_refused("metrics_listen = \"127.0.0.1:\"\n", "port");
  for (const char* fine : {"127.0.0.1:0", "[::1]:9464", "9464", "0.0.0.0:9464", "off", "auto"}) {
    std::string file = write_temp(std::string("metrics_listen = \"") + fine + "\"\n");
    auto r = parse({"--check-config", file}, {}, &out);
    std::remove(file.c_str());
    EXPECT_TRUE(r.ok()) << fine << ": " << r.status().to_string();
  }
  // The same holds for flags, which start reads too.
  EXPECT_FALSE(parse({"--control-token", "0123456789"}).ok());
  EXPECT_FALSE(parse({"--metrics-listen", "nowhere"}).ok());
}

TEST(ConfigTest, ADirectoryOrUnreadableConfigFailsLoudly) {
  char dir[] = "/tmp/sparsecar-config-dir-XXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  std::string out;
  for (const char* flag : {"--config", "--check-config"}) {
    auto r = parse({flag, dir}, {}, &out);
    ASSERT_FALSE(r.ok()) << flag;
    EXPECT_NE(r.status().message().find("is a directory"), std::string::npos) << r.status().message();
  }
  auto fifo = std::string(dir) + "/fifo";
  ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
  auto f = parse({"--config", fifo}, {}, &out);  // must not block on the FIFO
  ASSERT_FALSE(f.ok());
  EXPECT_NE(f.status().message().find("not a regular file"), std::string::npos) << f.status().message();
  auto missing = parse({"--config", std::string(dir) + "/missing.toml"}, {}, &out);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("missing.toml"), std::string::npos) << missing.status().message();
  std::remove(fifo.c_str());
  rmdir(dir);
}

TEST(ConfigTest, TensorTablesBecomeAgreedOverridesAndBadOnesAreRejected) {
  std::string file = write_temp(
      "selector = \"topk\"\n"
      "[tensor.\"embed*\"]\nselector = \"randomk\"\ndensity = 0.001\n"
      "[tensor.\"*.bias\"]\ncompression = false\n");
  auto cmd = parse({"--config", file});
  ASSERT_TRUE(cmd.ok()) << cmd.status().to_string();
  EXPECT_EQ(cmd->config.tensor_overrides, "embed*: selector=randomk, density=0.001; *.bias: compression=off");
  // Part of the first-step agreement fingerprint.
  EXPECT_NE(agreed_knobs(cmd->config).find("tensor_overrides=embed*: selector=randomk"), std::string::npos);
  std::remove(file.c_str());
  std::string bad = write_temp("[tensor.\"x\"]\ndensity = 7\n");
  auto err = parse({"--config", bad});
  ASSERT_FALSE(err.ok());
  EXPECT_NE(err.status().message().find("density"), std::string::npos) << err.status().message();
  std::remove(bad.c_str());
  EXPECT_FALSE(parse({"--tensor-overrides", "w*: selector=bogus"}).ok());
  auto flag = parse({"--tensor-overrides", "w*: selector=importance", "--error-feedback", "momentum",
                     "--selector", "percentile", "--quantile", "0.995"});
  ASSERT_TRUE(flag.ok()) << flag.status().to_string();
  EXPECT_EQ(flag->config.selector, kernels::Selector::kPercentile);
  EXPECT_EQ(flag->config.error_feedback, "momentum");
  EXPECT_FALSE(parse({"--error-feedback", "sometimes"}).ok());
  EXPECT_FALSE(parse({"--lr-rescale", "double"}).ok());
}

TEST(ConfigTest, TensorTablesCarryFormatAndBlockSize) {
  std::string file = write_temp(
      "selector = \"block_topk\"\nformat = \"coo\"\n"
      "[tensor.\"emb*\"]\nformat = \"bitmap\"\nblock_size = 128\n");
  auto cmd = parse({"--config", file});
  std::remove(file.c_str());
  ASSERT_TRUE(cmd.ok()) << cmd.status().to_string();
  EXPECT_EQ(cmd->config.tensor_overrides, "emb*: format=bitmap, block_size=128");
  // And the daemon's settings give it to the matching tensor only.
  const policies::StaticSettings s = settings_from_config(cmd->config);
  policies::TensorObservation o;
  o.name = "emb.tok";
  const policies::Plan emb = policies::static_plan(s, o);
  EXPECT_EQ(emb.format, kernels::Format::kBitmap);
  EXPECT_EQ(emb.params.block_size, 128u);
  o.name = "fc.weight";
  const policies::Plan fc = policies::static_plan(s, o);
  EXPECT_EQ(fc.format, kernels::Format::kCoo);
  EXPECT_EQ(fc.params.block_size, 64u);

  std::string bad = write_temp("[tensor.\"emb*\"]\nblock_size = 16\n");
  auto err = parse({"--config", bad});
  std::remove(bad.c_str());
  ASSERT_FALSE(err.ok());
  EXPECT_NE(err.status().message().find("invalid block_size '16'"), std::string::npos) << err.status().message();
}

// The overrides accept exactly what the knobs of the same names accept: both ends of every
// range, every name of every choice; and both refuse the values just outside.
TEST(ConfigTest, OverrideKeysAcceptExactlyTheKnobsValues) {
  auto override_ok = [](const std::string& key, const std::string& value) {
    return policies::parse_tensor_overrides("w*: " + key + "=" + value).ok();
  };
  auto knob_ok = [](const std::string& key, const std::string& value) {
    Config c;
    return set_knob(c, key, value).ok();
  };
  auto text = [](double v) {
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.17g", v);
    return std::string(buf);
  };
  for (const char* key : {"density", "threshold", "quantile", "approx_tolerance", "block_size", "heads", "mask_period",
                          "momentum", "clip_norm"}) {
    SCOPED_TRACE(key);
    const KnobSpec* spec = find_knob(key);
    ASSERT_NE(spec, nullptr);
    const bool integer = spec->type == KnobType::kUint;
    std::vector<std::string> inside = {text(spec->min), text(spec->max)};
    std::vector<std::string> outside = {integer ? text(spec->max + 1) : text(spec->max * 2), "x"};
    if (spec->min > 0) outside.push_back(integer ? text(spec->min - 1) : text(spec->min / 2));
    if (spec->min == 0) outside.push_back("-1");
    if (!integer) inside.push_back(text((spec->min + spec->max) / 2));
    for (const auto& v : inside) {
      EXPECT_TRUE(knob_ok(key, v)) << v;
      EXPECT_TRUE(override_ok(key, v)) << v;
    }
    for (const auto& v : outside) {
      EXPECT_FALSE(knob_ok(key, v)) << v;
      EXPECT_FALSE(override_ok(key, v)) << v;
    }
  }
  for (const char* key : {"format", "value_type", "group_norm", "error_feedback", "selector", "compression"}) {
    SCOPED_TRACE(key);
    const KnobSpec* spec = find_knob(key);
    ASSERT_NE(spec, nullptr);
    std::string choices = spec->type == KnobType::kBool ? "on|off|true|false|1|0|yes|no" : spec->choices;
    for (size_t from = 0;;) {
      const size_t bar = choices.find('|', from);
      const std::string name = choices.substr(from, bar == std::string::npos ? std::string::npos : bar - from);
      EXPECT_TRUE(knob_ok(key, name)) << name;
      EXPECT_TRUE(override_ok(key, name)) << name;
      if (bar == std::string::npos) break;
      from = bar + 1;
    }
    for (const char* bad : {"bogus", "none", "AUTO", ""}) {
      EXPECT_EQ(knob_ok(key, bad), override_ok(key, bad)) << bad;
    }
  }
}

TEST(ConfigTest, SettingsParseTheOverridesOncePerText) {
  Config c;
  ASSERT_TRUE(set_knob(c, "tensor_overrides", "emb*: format=bitmap").ok());
  OverridesCache cache;
  const policies::StaticSettings first = settings_from_config(c, &cache);
  ASSERT_EQ(first.overrides.size(), 1u);
  EXPECT_EQ(cache.parses(), 1u);
  // A new epoch that changes another knob reuses the rules.
  ASSERT_TRUE(set_knob(c, "density", "0.02").ok());
  const policies::StaticSettings second = settings_from_config(c, &cache);
  EXPECT_EQ(cache.parses(), 1u);
  ASSERT_EQ(second.overrides.size(), 1u);
  EXPECT_EQ(second.overrides[0].format, kernels::Format::kBitmap);
  EXPECT_EQ(second.params.density, 0.02);
  // New text: parsed again, same result as without a cache.
  ASSERT_TRUE(set_knob(c, "tensor_overrides", "fc*: block_size=32; emb*: value_type=int8").ok());
  const policies::StaticSettings third = settings_from_config(c, &cache);
  EXPECT_EQ(cache.parses(), 2u);
  const policies::StaticSettings uncached = settings_from_config(c);
  ASSERT_EQ(third.overrides.size(), 2u);
  ASSERT_EQ(uncached.overrides.size(), 2u);
  for (size_t i = 0; i < 2; ++i) {
    EXPECT_EQ(third.overrides[i].glob, uncached.overrides[i].glob);
    EXPECT_EQ(third.overrides[i].sets(kernels::SelectorParam::kBlockSize),
              uncached.overrides[i].sets(kernels::SelectorParam::kBlockSize));
    EXPECT_EQ(third.overrides[i].params.block_size, uncached.overrides[i].params.block_size);
    EXPECT_EQ(third.overrides[i].value_type, uncached.overrides[i].value_type);
  }
}

}  // namespace
}  // namespace sparsecar
