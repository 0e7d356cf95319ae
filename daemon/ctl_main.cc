// sparsecarctl: the operator's tool for a running sparsecard, over its ZeroMQ control socket
// (daemon/control/protocol.h). Human-readable tables by default, the daemon's JSON reply with
// --json. The command line is CLI11's (options anywhere, numbers checked, --help for the tool and
// every command). Exit status: 0 success, 1 the daemon refused the command, 2 usage error, 3 the
// daemon could not be reached or did not answer in time.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include "daemon/config/config.h"
#include "daemon/config/knobs.h"
#include "daemon/control/client.h"
#include "daemon/pipeline/progress.h"

namespace {

using json = nlohmann::json;
constexpr const char* kDefaultEndpoint = "ipc:///run/sparsecar/sparsecard-control.sock";

int list_knobs() {
  using namespace sparsecar;
  std::printf("%-26s %-22s %-24s %-5s %-6s %s\n", "KNOB", "DEFAULT", "RANGE", "LIVE", "AGREED", "DOC");
  for (const auto& k : knob_table()) {
    // Choice lists are printed whole (the selector registry's grows with every selector).
    std::string range;
    if (k.choices[0] != '\0') {
      range = k.choices;
    } else if (k.type == KnobType::kUint || k.type == KnobType::kDouble) {
      char buf[64];
      std::snprintf(buf, sizeof buf, "[%g, %g]", k.min, k.max);
      range = buf;
    } else if (k.type == KnobType::kBool) {
      range = "on|off";
    }
    std::printf("%-26s %-22s %-24s %-5s %-6s %s\n", k.name, knob_default(k).c_str(), range.c_str(),
                k.live ? "yes" : "no", k.agreed ? "yes" : "no", k.doc);
  }
  return 0;
}

std::string text(const json& v) {
  if (v.is_string()) return v.get<std::string>();
  if (v.is_null()) return "-";
  return v.dump();
}

void print_decision(const json& r) {
  std::string changes;
  const json all = r.value("changes", json::object());
  for (const auto& [k, v] : all.items()) {
    if (!changes.empty()) changes += ' ';
    changes += k + "=" + text(v);
  }
  std::printf("epoch %s takes effect at step %s on every node: %s\n", text(r["epoch"]).c_str(),
              text(r["effective_step"]).c_str(), changes.c_str());
}

void print_status(const json& r) {
  std::printf("job %s  rank %s of %s%s  step %s  epoch %s (from step %s)\n", text(r["job_id"]).c_str(),
              text(r["rank"]).c_str(), text(r["world_size"]).c_str(), r.value("leader", false) ? " (leader)" : "",
              text(r["step"]).c_str(), text(r["epoch"]).c_str(), text(r["effective_step"]).c_str());
  std::printf("compression %s  plan: %s%s\n", r.value("compression", false) ? "on" : "off (paused)",
              text(r["plan"]).c_str(), r.value("draining", false) ? "  DRAINING" : "");
  const json& c = r["clients"];
  std::printf("trainers %s/%s connected here, %s in the job; steps ok %s, failed %s; queued %s\n",
              text(c["connected"]).c_str(), text(c["expected"]).c_str(), text(r["total_trainers"]).c_str(),
              text(c["steps_completed"]).c_str(), text(c["steps_failed"]).c_str(), text(r["queued"]).c_str());
  std::printf("job incarnation %s; stale messages dropped %s; lost peers replaced %s\n",
              r.contains("incarnation") && !r["incarnation"].is_null() ? text(r["incarnation"]).c_str() : "none yet",
              text(r.value("stale_messages", json(0))).c_str(), text(r.value("peers_rejoined", json(0))).c_str());
  if (r.contains("traffic")) {
    // bytes this node sent vs what a dense exchange would have sent
    auto line = [](const json& t) {
      const double sent = t.value("bytes_sent", 0.0), dense = t.value("dense_bytes", 0.0);
      const double saved = t.value("bytes_saved", 0.0);
      std::string ratio = "n/a";
      if (t.contains("compression_ratio") && t["compression_ratio"].is_number()) {
        char buf[32];
        std::snprintf(buf, sizeof buf, "%.1fx", t["compression_ratio"].get<double>());
        ratio = buf;
      }
      return "sent " + sparsecar::JobProgress::human_bytes(sent) + " vs " + sparsecar::JobProgress::human_bytes(dense) + " dense, ratio " +
             ratio + ", saved " + (saved < 0 ? "-" : "") + sparsecar::JobProgress::human_bytes(saved < 0 ? -saved : saved) +
             " over " + text(t.value("steps", json(0))) + " steps";
    };
    const json& t = r["traffic"];
    std::printf("traffic this job: %s\n", line(t.value("job", json::object())).c_str());
    std::printf("since start: %s\n", line(t.value("since_start", json::object())).c_str());
  }
  if (r.contains("controllers")) {  // rank 0 only
    const json& k = r["controllers"];
    std::printf("controllers %s: %s steps observed, %s proposals%s\n", text(k["active"]).c_str(),
                text(k["steps_observed"]).c_str(), text(k["proposals"]).c_str(),
                k.value("failed", false) ? (", FAILED: " + text(k["failure"])).c_str() : "");
    if (!k["accuracy_signal"].is_null()) {
      std::printf("accuracy signal: %s; compression error %s (bound %s)\n", text(k["accuracy_signal"]).c_str(),
                  text(k["compression_error"]).c_str(), text(k["compression_error_bound"]).c_str());
    }
    if (!k["step_model"].is_null()) std::printf("step model: %s\n", text(k["step_model"]).c_str());
  }
  if (r.value("job_open", false)) {
    std::printf("WARNING: the job is open (no job_secret_file): any host that reaches the coordinator port can join\n");
  }
  if (r.contains("metrics_port")) std::printf("metrics port %s\n", text(r["metrics_port"]).c_str());
  std::printf("\n%-6s %-6s %-28s %s\n", "PEER", "STATE", "NAME", "ERROR");
  for (const auto& p : r["peers"]) {
    std::printf("%-6s %-6s %-28s %s\n", text(p["rank"]).c_str(), text(p["state"]).c_str(),
                text(p.value("name", json("-"))).c_str(), text(p.value("error", json(""))).c_str());
  }
  std::printf("\n%-8s %-8s %-12s %-10s %-14s %s\n", "GROUP", "TENSORS", "ELEMENTS", "DENSITY", "RESIDUAL_NORM", "PLAN");
  for (const auto& g : r["groups"]) {
    std::string plans;
    for (const auto& [desc, n] : g["plans"].items()) plans += (plans.empty() ? "" : "; ") + desc + " x" + text(n);
    std::printf("%-8s %-8s %-12s %-10.4g %-14.6g %s\n", text(g["group"]).c_str(), text(g["tensors"]).c_str(),
                text(g["elements"]).c_str(), g.value("density", 0.0), g.value("residual_norm", 0.0), plans.c_str());
  }
}

void print_result(const std::string& cmd, const json& r) {
  if (cmd == "status") return print_status(r);
  if (cmd == "set" || cmd == "pause" || cmd == "resume" || (cmd == "policy" && r.contains("effective_step"))) {
    return print_decision(r);
  }
  if (cmd == "get" && r.contains("knobs")) {
    std::printf("epoch %s\n%-26s %-24s %-5s %s\n", text(r["epoch"]).c_str(), "KNOB", "VALUE", "LIVE", "AGREED");
    for (const auto& k : r["knobs"]) {
      std::printf("%-26s %-24s %-5s %s\n", text(k["name"]).c_str(), text(k["value"]).c_str(),
                  k.value("live", false) ? "yes" : "no", k.value("agreed", false) ? "yes" : "no");
    }
    return;
  }
  if (cmd == "get") {
    std::printf("%s = %s\n", text(r["name"]).c_str(), text(r["value"]).c_str());
    return;
  }
  if (cmd == "commands") {
    for (const auto& c : r["commands"]) {
      std::string args;
      for (const auto& a : c["args"]) {
        const bool req = a.value("required", false);
        args += std::string(" ") + (req ? "" : "[") + text(a["name"]) + (req ? "" : "]");
      }
      std::printf("%-14s %-34s %s\n", text(c["name"]).c_str(), args.c_str(), text(c["doc"]).c_str());
    }
    return;
  }
  if (r.is_object()) {
    for (const auto& [k, v] : r.items()) std::printf("%-16s %s\n", k.c_str(), text(v).c_str());
  } else {
    std::printf("%s\n", r.dump(2).c_str());
  }
}

std::string absolute(const std::string& path) {
  if (!path.empty() && path[0] == '/') return path;
  char cwd[4096];
  if (::getcwd(cwd, sizeof cwd) == nullptr) return path;
  return std::string(cwd) + "/" + path;
}

// Where the endpoint came from, for errors: the user must know what to change.
std::string endpoint_origin(const std::string& source) {
  if (source == "flag") return "from --endpoint";
  if (source == "env") return "from SPARSECAR_CONTROL";
  return std::string("the default; sparsecard's control socket sits beside its --socket as ") +
         "<socket minus .sock>-control.sock";
}

constexpr const char* kSetHelp =
    "Change live knobs job-wide (KNOB=VALUE ..., or KNOB VALUE). The change goes to rank 0 and takes "
    "effect on every node at the step in the reply. Live changes last for the current job only: when "
    "every trainer has left and the next job starts on the same daemons, every knob reverts to the "
    "configured value (flags, config file, the last SIGHUP reload) and the daemon logs which ones "
    "reverted. Put lasting changes in the config file and reload (SIGHUP).";

}  // namespace

int main(int argc, char** argv) {
  using namespace sparsecar;
  control::ClientOptions opts;
  std::string endpoint;
  bool as_json = false;
  uint64_t timeout_ms = 10000;
  CLI::App app{"sparsecarctl: the operator's tool for a running sparsecard, over its control socket.", "sparsecarctl"};
  app.footer("Options may come anywhere on the line (sparsecarctl status --json).\n"
             "exit status: 0 ok, 1 refused by the daemon, 2 usage, 3 daemon unreachable or silent");
  app.require_subcommand(1);
  app.fallthrough();  // the options above may follow the command too
  auto* endpoint_opt =
      app.add_option("--endpoint", endpoint,
                     std::string("control endpoint, ipc://PATH or tcp://HOST:PORT (sparsecard's --control) "
                                 "[env SPARSECAR_CONTROL; default ") + kDefaultEndpoint + "]")
          ->envname("SPARSECAR_CONTROL");
  app.add_flag("--json", as_json, "print the daemon's JSON reply instead of a table");
  app.add_option("--timeout-ms", timeout_ms, "how long to wait for the reply, in milliseconds")
      ->check(CLI::Range(uint64_t{1}, uint64_t{3600000}))
      ->capture_default_str();
  app.add_option("--token", opts.token, "token for a tcp:// endpoint [env SPARSECAR_CONTROL_TOKEN]")
      ->envname("SPARSECAR_CONTROL_TOKEN");
  app.add_option("--curve-server-key", opts.curve_server_key,
                 "the daemon's Z85 CURVE public key for a tcp:// endpoint");

  std::string knob, controller, metric_name, wire_name, path, drain_arg, json_args;
  std::vector<std::string> set_args;
  double metric_value = 0;
  uint64_t metric_step = 0;
  auto* status =
      app.add_subcommand("status", "job, rank, peers, step, decision epoch, bytes saved and ratio, plan per tensor group");
  auto* get = app.add_subcommand("get", "one knob's value (or every knob's)");
  get->add_option("KNOB", knob, "knob name (sparsecarctl knobs lists them)");
  auto* set = app.add_subcommand("set", kSetHelp);
  set->add_option("KNOB=VALUE", set_args, "one or more KNOB=VALUE, or KNOB VALUE")->required();
  auto* policy = app.add_subcommand("policy", "switch the controller (a comma list, as the `controller` knob)");
  policy->add_option("CONTROLLER", controller, "controller name(s)")->required();
  auto* report = app.add_subcommand("report-metric", "report a scalar (e.g. val_accuracy) to the controllers");
  report->add_option("NAME", metric_name, "metric name")->required();
  report->add_option("VALUE", metric_value, "a number")->required();
  auto* step_opt = report->add_option("STEP", metric_step, "the training step it belongs to");
  auto* pause = app.add_subcommand("pause", "compression off (dense), job-wide");
  auto* resume = app.add_subcommand("resume", "compression on again, job-wide");
  auto* drain = app.add_subcommand("drain", "finish queued steps and refuse new ones ('cancel': accept them again)");
  drain->add_option("TIMEOUT_MS|cancel", drain_arg, "how long to wait for the queued steps (default 30000), or cancel")
      ->check(CLI::IsMember({"cancel"}) | CLI::Range(uint64_t{0}, uint64_t{3600000}));
  auto* checkpoint = app.add_subcommand("checkpoint", "save every tensor's residual to FILE (on the daemon's host)");
  checkpoint->add_option("FILE", path, "regular file to write")->required();
  auto* restore = app.add_subcommand("restore", "load every tensor's residual from FILE");
  restore->add_option("FILE", path, "checkpoint file written by `checkpoint`")->required();
  auto* commands = app.add_subcommand("commands", "the daemon's command list");
  auto* call = app.add_subcommand("call", "any command with raw JSON arguments");
  call->add_option("COMMAND", wire_name, "command name")->required();
  call->add_option("JSON_ARGS", json_args, "a JSON object of arguments");
  auto* knobs = app.add_subcommand("knobs", "every knob: default, range/choices, live, agreed, doc (local, no daemon)");
  auto* version = app.add_subcommand("version", "print the version (local)");
  for (CLI::App* sub : app.get_subcommands({})) sub->fallthrough();

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);  // 0, help on stdout (the subcommand's own when it follows one)
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "sparsecarctl: %s (see sparsecarctl --help)\n", e.what());
    return 2;
  }
  if (version->parsed()) {
    std::printf("%s\n", version_string().c_str());
    return 0;
  }
  if (knobs->parsed()) return list_knobs();

  // CLI11 counts a value from the environment as given: look at the line itself.
  std::string source = "default";
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--endpoint") == 0 || std::strncmp(argv[i], "--endpoint=", 11) == 0) source = "flag";
  }
  if (source == "default" && endpoint_opt->count() > 0 && !endpoint.empty() && endpoint != "auto") source = "env";
  opts.endpoint = endpoint.empty() || endpoint == "auto" ? kDefaultEndpoint : endpoint;
  opts.timeout = std::chrono::milliseconds(timeout_ms);

  CLI::App* sub = app.get_subcommands().front();
  std::string cmd = sub->get_name();
  auto bad_usage = [&](const char* what) {
    std::fprintf(stderr, "sparsecarctl %s: %s (see sparsecarctl %s --help)\n", cmd.c_str(), what, cmd.c_str());
    return 2;
  };
  std::string wire_cmd = cmd;
  json args = json::object();
  if (sub == status || sub == commands || sub == pause || sub == resume) {
    // no arguments
  } else if (sub == get) {
    if (!knob.empty()) args["knob"] = knob;
  } else if (sub == set) {
    if (set_args.size() == 2 && set_args[0].find('=') == std::string::npos) {
      args["knob"] = set_args[0];
      args["value"] = set_args[1];
    } else {
      json values = json::object();
      for (const auto& p : set_args) {
        auto eq = p.find('=');
        if (eq == std::string::npos || eq == 0) return bad_usage("arguments are KNOB=VALUE");
        values[p.substr(0, eq)] = p.substr(eq + 1);
      }
      args["knobs"] = values;
    }
  } else if (sub == policy) {
    args["controller"] = controller;
  } else if (sub == report) {
    args["name"] = metric_name;
    args["value"] = metric_value;
    if (step_opt->count() > 0) args["step"] = metric_step;
  } else if (sub == drain) {
    if (drain_arg == "cancel") {
      args["cancel"] = true;
    } else if (!drain_arg.empty()) {
      args["timeout_ms"] = std::stoull(drain_arg);  // checked by the validator above
    }
    const uint64_t wait = args.value("timeout_ms", uint64_t{30000});
    if (opts.timeout.count() < static_cast<int64_t>(wait) + 5000) opts.timeout = std::chrono::milliseconds(wait + 5000);
  } else if (sub == checkpoint || sub == restore) {
    args["path"] = absolute(path);
  } else if (sub == call) {
    wire_cmd = wire_name;
    if (!json_args.empty()) {
      args = json::parse(json_args, nullptr, false);
      if (args.is_discarded() || !args.is_object()) return bad_usage("JSON_ARGS must be a JSON object");
    }
  }

  // Every connection error says which endpoint was tried, where it came from and how to change it.
  const std::string how = " (" + endpoint_origin(source) +
                          "); choose the daemon with --endpoint ipc:///PATH or SPARSECAR_CONTROL";
  auto client = control::ControlClient::connect(opts);
  if (!client.ok()) {
    std::fprintf(stderr, "sparsecarctl: cannot reach the daemon at %s: %s%s\n", opts.endpoint.c_str(),
                 client.status().to_string().c_str(), how.c_str());
    return 3;
  }
  auto reply = (*client)->call(wire_cmd, args);
  if (!reply.ok()) {
    std::fprintf(stderr, "sparsecarctl: %s: %s%s\n", opts.endpoint.c_str(), reply.status().to_string().c_str(),
                 how.c_str());
    return 3;
  }
  const json& r = *reply;
  if (as_json) std::printf("%s\n", r.dump(2, ' ', false, json::error_handler_t::replace).c_str());
  if (!r["ok"].get<bool>()) {
    const json& e = r.value("error", json::object());
    std::fprintf(stderr, "sparsecarctl %s: %s: %s\n", wire_cmd.c_str(), text(e.value("code", json("ERROR"))).c_str(),
                 text(e.value("message", json(""))).c_str());
    return 1;
  }
  if (!as_json) print_result(wire_cmd, r.value("result", json::object()));
  return 0;
}
