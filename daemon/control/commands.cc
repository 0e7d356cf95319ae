#include "daemon/control/commands.h"

#include <cmath>
#include <cstdio>
#include <optional>

#include "daemon/metrics/metrics.h"
#include "sparsecar/common/log.h"

namespace sparsecar::control {
namespace {

using json = nlohmann::json;

const char* type_name(ArgType t) {
  switch (t) {
    case ArgType::kString: return "a string";
    case ArgType::kNumber: return "a number";
    case ArgType::kInteger: return "a non-negative integer";
    case ArgType::kBool: return "a boolean";
    case ArgType::kScalar: return "a string, number or boolean";
    case ArgType::kObject: return "an object";
  }
  return "?";
}

bool has_type(const json& v, ArgType t) {
  switch (t) {
    case ArgType::kString: return v.is_string();
    case ArgType::kNumber: return v.is_number();
    case ArgType::kInteger: return v.is_number_unsigned() || (v.is_number_integer() && v.get<int64_t>() >= 0);
    case ArgType::kBool: return v.is_boolean();
    case ArgType::kScalar: return v.is_string() || v.is_number() || v.is_boolean();
    case ArgType::kObject: return v.is_object();
  }
  return false;
}

// Distinguishes a wrong JSON type (WRONG_TYPE) from other argument problems.
struct ArgError {
  bool wrong_type;
  std::string message;
};

std::optional<ArgError> check_args(const CommandSpec& spec, const json& args) {
  for (const auto& a : spec.args) {
    auto it = args.find(a.name);
    if (it == args.end()) {
      if (a.required) return ArgError{false, std::string(spec.name) + ": missing argument \"" + a.name + "\""};
      continue;
    }
    if (!has_type(*it, a.type)) {
      return ArgError{true, std::string(spec.name) + ": argument \"" + a.name + "\" must be " + type_name(a.type)};
    }
  }
  for (const auto& [key, value] : args.items()) {
    bool known = false;
    for (const auto& a : spec.args) known = known || key == a.name;
    if (!known) return ArgError{false, std::string(spec.name) + ": unknown argument \"" + key.substr(0, 64) + "\""};
  }
  return std::nullopt;
}

json decision_json(const Decision& d) {
  json changes = json::object();
  auto parsed = parse_changes(d.changes);
  if (parsed.ok()) {
    for (const auto& [k, v] : *parsed) changes[k] = v;
  }
  return json{{"epoch", d.epoch}, {"effective_step", d.effective_step}, {"changes", changes}, {"reason", d.reason}};
}

json knob_json(const Config& c, const KnobSpec& spec) {
  std::string value = get_knob(c, spec.name).value();
  if (spec.secret && !value.empty()) value = "<redacted>";
  return json{{"name", spec.name},   {"value", value}, {"live", spec.live},
              {"agreed", spec.agreed}, {"default", knob_default(spec)},         {"doc", spec.doc}};
}

}  // namespace

std::string scalar_text(const json& value) {
  if (value.is_string()) return value.get<std::string>();
  if (value.is_boolean()) return value.get<bool>() ? "on" : "off";
  if (value.is_number_unsigned()) return std::to_string(value.get<uint64_t>());
  if (value.is_number_integer()) return std::to_string(value.get<int64_t>());
  if (value.is_number_float()) {
    const double v = value.get<double>();
    char buf[64];
    for (int precision = 1; precision <= 17; ++precision) {
      std::snprintf(buf, sizeof buf, "%.*g", precision, v);
      if (std::strtod(buf, nullptr) == v) break;
    }
    return buf;
  }
  return value.dump();
}

const std::vector<CommandSpec>& command_table() {
  using A = ArgType;
  static const std::vector<CommandSpec> table = {
      {"status", "job, rank, peers and their state, step, decision epoch, plan per tensor group", {}, false},
      {"get", "a knob's value (or every knob) in the newest decision", {{"knob", A::kString, false, "knob name"}}, false},
      {"set",
       "change live knobs job-wide; applied by every node at the step in the reply",
       {{"knob", A::kString, false, "knob name"},
        {"value", A::kScalar, false, "new value"},
        {"knobs", A::kObject, false, "several knobs at once: {name: value}"}},
       true},
      {"policy", "switch the controller that plans compression", {{"controller", A::kString, true, "controller name"}}, true},
      {"report-metric",
       "report a scalar (e.g. validation accuracy) to the controllers and the dashboards",
       {{"name", A::kString, true, "metric name"},
        {"value", A::kNumber, true, "value"},
        {"step", A::kInteger, false, "training step it belongs to"}},
       true},
      {"pause", "compression off (exact dense average) job-wide", {}, true},
      {"resume", "compression on job-wide", {}, true},
      {"drain",
       "finish queued steps and refuse new ones (cancel: accept steps again)",
       {{"timeout_ms", A::kInteger, false, "how long to wait for queued steps (default 30000)"},
        {"cancel", A::kBool, false, "stop draining"}},
       true},
      {"checkpoint", "write every tensor's residual to a file", {{"path", A::kString, true, "absolute file path"}}, true},
      {"restore", "load residuals from a checkpoint file", {{"path", A::kString, true, "absolute file path"}}, true},
      {"commands", "list the commands and their arguments", {}, false},
  };
  return table;
}

const CommandSpec* find_command(std::string_view name) {
  for (const auto& c : command_table()) {
    if (name == c.name) return &c;
  }
  return nullptr;
}

Dispatcher::Dispatcher(ControlBackend* backend, Metrics* metrics, DispatcherOptions options)
    : options_(std::move(options)), backend_(backend), metrics_(metrics) {}

std::string Dispatcher::handle(std::string_view message) {
  auto reject = [&](const ProtocolError& e) {
    if (metrics_) metrics_->count_control_rejected(rejection_label(e.kind));
    SC_LOG_DEBUG("control: rejected request: {}", e.message);
    return error_reply(e);
  };
  try {
    ParseResult parsed = parse_request(message, options_.max_message_bytes);
    if (!parsed.ok) return reject(parsed.error);
    const Request& req = parsed.request;
    if (!options_.token.empty() && req.token != options_.token) {
      return reject({Rejection::kUnauthenticated, "missing or wrong token", req.id});
    }
    const CommandSpec* spec = find_command(req.cmd);
    if (spec == nullptr) {
      return reject({Rejection::kUnknownCommand,
                     "unknown command '" + req.cmd.substr(0, 64) + "' (try \"commands\")", req.id});
    }
    if (auto bad = check_args(*spec, req.args)) {
      if (bad->wrong_type) return reject({Rejection::kWrongType, bad->message, req.id});
      if (metrics_) metrics_->count_control(spec->name, false);
      return error_reply(req.id, invalid_argument(bad->message));
    }
    Expected<json> result = run(req);
    if (metrics_) metrics_->count_control(spec->name, result.ok());
    if (!result.ok()) {
      SC_LOG_INFO("control: {} failed: {}", spec->name, result.status().to_string());
      return error_reply(req.id, result.status());
    }
    if (spec->changes_state) SC_LOG_INFO("control: {} ok", spec->name);
    return ok_reply(req.id, *result);
  } catch (const std::exception& e) {
    // "Should not happen" (a JSON type error in a command): counted and answered, never fatal.
    if (metrics_) metrics_->count_control("unknown", false);
    return error_reply(nullptr, internal_error(std::string("control request failed: ") + e.what()));
  }
}

Expected<json> Dispatcher::run(const Request& req) {
  const json& args = req.args;
  const std::string& cmd = req.cmd;
  auto propose = [&](const KnobChanges& changes, std::string_view reason) -> Expected<json> {
    SC_ASSIGN_OR_RETURN(Decision d, backend_->propose(changes, "control: " + std::string(reason)));
    if (metrics_) metrics_->count_decision("control", reason);
    return decision_json(d);
  };

  if (cmd == "status") return backend_->status();
  if (cmd == "commands") {
    json out = json::array();
    for (const auto& c : command_table()) {
      json a = json::array();
      for (const auto& arg : c.args) {
        a.push_back({{"name", arg.name}, {"type", type_name(arg.type)}, {"required", arg.required}, {"doc", arg.doc}});
      }
      out.push_back({{"name", c.name}, {"doc", c.doc}, {"args", a}});
    }
    return json{{"commands", out}};
  }
  if (cmd == "get") {
    Decision d = backend_->latest_decision();
    const Config& c = *d.config;
    if (auto it = args.find("knob"); it != args.end()) {
      const std::string name = it->get<std::string>();
      const KnobSpec* spec = find_knob(name);
      if (spec == nullptr) return not_found("unknown knob '" + name.substr(0, 64) + "'");
      json k = knob_json(c, *spec);
      k["epoch"] = d.epoch;
      return k;
    }
    json knobs = json::array();
    for (const auto& spec : knob_table()) knobs.push_back(knob_json(c, spec));
    return json{{"epoch", d.epoch}, {"effective_step", d.effective_step}, {"knobs", knobs}};
  }
  if (cmd == "set") {
    KnobChanges changes;
    const bool single = args.contains("knob") || args.contains("value");
    if (single == args.contains("knobs")) {
      return invalid_argument("set: give either \"knob\" and \"value\" or \"knobs\": {name: value}");
    }
    if (single) {
      if (!args.contains("knob") || !args.contains("value")) return invalid_argument("set: needs both \"knob\" and \"value\"");
      changes.emplace_back(args["knob"].get<std::string>(), scalar_text(args["value"]));
    } else {
      for (const auto& [k, v] : args["knobs"].items()) {
        if (!(v.is_string() || v.is_number() || v.is_boolean())) {
          return invalid_argument("set: knob '" + k.substr(0, 64) + "' needs a string, number or boolean value");
        }
        changes.emplace_back(k, scalar_text(v));
      }
    }
    return propose(changes, "set");
  }
  if (cmd == "pause") return propose({{"compression", "off"}}, "pause");
  if (cmd == "resume") return propose({{"compression", "on"}}, "resume");
  if (cmd == "policy") {
    const std::string name = args["controller"].get<std::string>();
    if (find_knob("controller") == nullptr) {
      // This build plans with the static policy only (knobs compression/selector/density/threshold).
      if (name == "static") {
        Decision d = backend_->latest_decision();
        return json{{"controller", "static"}, {"changed", false}, {"epoch", d.epoch}};
      }
      return not_found("unknown controller '" + name.substr(0, 64) + "'; this daemon has: static");
    }
    SC_ASSIGN_OR_RETURN(json d, propose({{"controller", name}}, "policy"));
    d["controller"] = name;
    d["changed"] = true;
    return d;
  }
  if (cmd == "report-metric") {
    const std::string name = args["name"].get<std::string>();
    const double value = args["value"].get<double>();
    if (name.empty() || name.size() > 64) return invalid_argument("report-metric: name must be 1..64 bytes");
    if (!std::isfinite(value)) return invalid_argument("report-metric: value must be finite");
    const uint64_t step = args.contains("step") ? args["step"].get<uint64_t>() : 0;
    SC_RETURN_IF_ERROR(backend_->report_metric(name, value, step));
    return json{{"name", name}, {"value", value}, {"step", step}};
  }
  if (cmd == "drain") {
    const uint64_t timeout = args.contains("timeout_ms") ? args["timeout_ms"].get<uint64_t>() : 30000;
    if (timeout > 3600000) return invalid_argument("drain: timeout_ms must be at most 3600000");
    const bool cancel = args.contains("cancel") && args["cancel"].get<bool>();
    return backend_->drain(std::chrono::milliseconds(timeout), cancel);
  }
  if (cmd == "checkpoint" || cmd == "restore") {
    const std::string path = args["path"].get<std::string>();
    if (path.empty() || path[0] != '/' || path.size() > 4096 || path.find('\0') != std::string::npos) {
      return invalid_argument(cmd + ": path must be an absolute file path");
    }
    return cmd == "checkpoint" ? backend_->checkpoint(path) : backend_->restore(path);
  }
  return internal_error("command '" + cmd + "' is in the table but not implemented");
}

}  // namespace sparsecar::control
