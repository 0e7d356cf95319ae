// sparsecarctl: the operator's tool for a running sparsecard, over its ZeroMQ control socket
// (daemon/control/protocol.h). Human-readable tables by default, the daemon's JSON reply with
// --json. Exit status: 0 success, 1 the daemon refused the command, 2 usage error, 3 the
// daemon could not be reached or did not answer in time.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "daemon/config/config.h"
#include "daemon/config/knobs.h"
#include "daemon/control/client.h"

namespace {

using json = nlohmann::json;
constexpr const char* kDefaultEndpoint = "ipc:///run/sparsecar/sparsecard-control.sock";

void usage(FILE* out) {
  std::fprintf(out,
               "usage: sparsecarctl [options] <command> [arguments]\n"
               "\n"
               "commands (sent to the daemon):\n"
               "  status                          job, rank, peers, step, decision epoch, plan per tensor group\n"
               "  get [KNOB]                      one knob or every knob\n"
               "  set KNOB=VALUE [KNOB=VALUE...]  change live knobs job-wide (also: set KNOB VALUE)\n"
               "  policy CONTROLLER               switch the controller\n"
               "  report-metric NAME VALUE [STEP] report a scalar (e.g. val_accuracy)\n"
               "  pause | resume                  compression off (dense) / on, job-wide\n"
               "  drain [TIMEOUT_MS] | drain cancel  finish queued steps, refuse new ones / accept again\n"
               "  checkpoint FILE | restore FILE  save / load every tensor's residual\n"
               "  commands                        the daemon's command list\n"
               "  call COMMAND [JSON_ARGS]        any command with raw JSON arguments\n"
               "local commands:\n"
               "  knobs                           every knob: default, range/choices, live, agreed, doc\n"
               "  version                         print the version\n"
               "\n"
               "options:\n"
               "  --endpoint EP        control endpoint [env SPARSECAR_CONTROL, default %s]\n"
               "  --json               print the daemon's JSON reply instead of a table\n"
               "  --timeout-ms N       how long to wait for the reply (default 10000)\n"
               "  --token T            token for a tcp:// endpoint [env SPARSECAR_CONTROL_TOKEN]\n"
               "  --curve-server-key K the daemon's Z85 CURVE public key for a tcp:// endpoint\n"
               "  -h, --help           this text\n"
               "exit status: 0 ok, 1 refused by the daemon, 2 usage, 3 daemon unreachable or silent\n",
               kDefaultEndpoint);
}

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

// A command-line value as JSON: numbers and on/off stay text for knobs (the daemon parses them).
json number_or_text(const std::string& s) {
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  if (!s.empty() && end == s.c_str() + s.size()) return v;
  return s;
}

std::string absolute(const std::string& path) {
  if (!path.empty() && path[0] == '/') return path;
  char cwd[4096];
  if (::getcwd(cwd, sizeof cwd) == nullptr) return path;
  return std::string(cwd) + "/" + path;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace sparsecar;
  control::ClientOptions opts;
  opts.endpoint = std::getenv("SPARSECAR_CONTROL") ? std::getenv("SPARSECAR_CONTROL") : kDefaultEndpoint;
  if (opts.endpoint == "auto" || opts.endpoint.empty()) opts.endpoint = kDefaultEndpoint;
  if (const char* t = std::getenv("SPARSECAR_CONTROL_TOKEN")) opts.token = t;
  bool as_json = false;
  std::vector<std::string> rest;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto value = [&](const char* name) -> const char* {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "sparsecarctl: %s needs a value\n", name);
        std::exit(2);
      }
      return argv[++i];
    };
    if (!rest.empty()) {
      rest.push_back(a);  // after the command everything is its arguments
    } else if (a == "-h" || a == "--help") {
      usage(stdout);
      return 0;
    } else if (a == "--json") {
      as_json = true;
    } else if (a == "--endpoint") {
      opts.endpoint = value("--endpoint");
    } else if (a == "--timeout-ms") {
      opts.timeout = std::chrono::milliseconds(std::atol(value("--timeout-ms")));
    } else if (a == "--token") {
      opts.token = value("--token");
    } else if (a == "--curve-server-key") {
      opts.curve_server_key = value("--curve-server-key");
    } else if (a.size() > 1 && a[0] == '-') {
      std::fprintf(stderr, "sparsecarctl: unknown option '%s'\n", a.c_str());
      usage(stderr);
      return 2;
    } else {
      rest.push_back(a);
    }
  }
  if (rest.empty()) {
    usage(stderr);
    return 2;
  }
  const std::string cmd = rest[0];
  const std::vector<std::string> pos(rest.begin() + 1, rest.end());
  if (cmd == "version") {
    std::printf("%s\n", version_string().c_str());
    return 0;
  }
  if (cmd == "knobs") return list_knobs();

  auto bad_usage = [&](const char* what) {
    std::fprintf(stderr, "sparsecarctl %s: %s (see --help)\n", cmd.c_str(), what);
    return 2;
  };
  std::string wire_cmd = cmd;
  json args = json::object();
  if (cmd == "status" || cmd == "commands" || cmd == "pause" || cmd == "resume") {
    if (!pos.empty()) return bad_usage("takes no arguments");
  } else if (cmd == "get") {
    if (pos.size() > 1) return bad_usage("takes at most one knob name");
    if (pos.size() == 1) args["knob"] = pos[0];
  } else if (cmd == "set") {
    if (pos.empty()) return bad_usage("needs KNOB=VALUE");
    if (pos.size() == 2 && pos[0].find('=') == std::string::npos) {
      args["knob"] = pos[0];
      args["value"] = pos[1];
    } else {
      json knobs = json::object();
      for (const auto& p : pos) {
        auto eq = p.find('=');
        if (eq == std::string::npos || eq == 0) return bad_usage("arguments are KNOB=VALUE");
        knobs[p.substr(0, eq)] = p.substr(eq + 1);
      }
      args["knobs"] = knobs;
    }
  } else if (cmd == "policy") {
    if (pos.size() != 1) return bad_usage("needs one controller name");
    args["controller"] = pos[0];
  } else if (cmd == "report-metric") {
    if (pos.size() < 2 || pos.size() > 3) return bad_usage("needs NAME VALUE [STEP]");
    json v = number_or_text(pos[1]);
    if (!v.is_number()) return bad_usage("VALUE must be a number");
    args["name"] = pos[0];
    args["value"] = v;
    if (pos.size() == 3) args["step"] = std::strtoull(pos[2].c_str(), nullptr, 10);
  } else if (cmd == "drain") {
    if (pos.size() > 1) return bad_usage("takes [TIMEOUT_MS] or 'cancel'");
    if (pos.size() == 1 && pos[0] == "cancel") {
      args["cancel"] = true;
    } else if (pos.size() == 1) {
      args["timeout_ms"] = std::strtoull(pos[0].c_str(), nullptr, 10);
    }
    const uint64_t wait = args.value("timeout_ms", uint64_t{30000});
    if (opts.timeout.count() < static_cast<int64_t>(wait) + 5000) opts.timeout = std::chrono::milliseconds(wait + 5000);
  } else if (cmd == "checkpoint" || cmd == "restore") {
    if (pos.size() != 1) return bad_usage("needs one FILE");
    args["path"] = absolute(pos[0]);
  } else if (cmd == "call") {
    if (pos.empty() || pos.size() > 2) return bad_usage("needs COMMAND [JSON_ARGS]");
    wire_cmd = pos[0];
    if (pos.size() == 2) {
      args = json::parse(pos[1], nullptr, false);
      if (args.is_discarded() || !args.is_object()) return bad_usage("JSON_ARGS must be a JSON object");
    }
  } else {
    std::fprintf(stderr, "sparsecarctl: unknown command '%s'\n", cmd.c_str());
    usage(stderr);
    return 2;
  }

  auto client = control::ControlClient::connect(opts);
  if (!client.ok()) {
    std::fprintf(stderr, "sparsecarctl: cannot reach the daemon at %s: %s\n", opts.endpoint.c_str(),
                 client.status().to_string().c_str());
    return 3;
  }
  auto reply = (*client)->call(wire_cmd, args);
  if (!reply.ok()) {
    std::fprintf(stderr, "sparsecarctl: %s: %s\n", opts.endpoint.c_str(), reply.status().to_string().c_str());
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
