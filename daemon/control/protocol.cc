#include "daemon/control/protocol.h"

namespace sparsecar::control {
namespace {

using json = nlohmann::json;

std::string dump(const json& j) { return j.dump(-1, ' ', false, json::error_handler_t::replace); }

// Deepest nesting of arrays/objects, counted outside strings. Bounds the parser's recursion
// before it runs (a 64 KiB "[[[[..." must not reach the JSON library).
int nesting_depth(std::string_view s) {
  int depth = 0, deepest = 0;
  bool in_string = false, escaped = false;
  for (char c : s) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '[' || c == '{') {
      deepest = std::max(deepest, ++depth);
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  return deepest;
}

ParseResult fail(Rejection kind, std::string message, json id = nullptr) {
  ParseResult r;
  r.error.kind = kind;
  r.error.message = std::move(message);
  r.error.id = std::move(id);
  return r;
}

}  // namespace

std::string_view rejection_code(Rejection r) {
  switch (r) {
    case Rejection::kMalformed: return "MALFORMED";
    case Rejection::kTooLarge: return "TOO_LARGE";
    case Rejection::kUnsupportedVersion: return "UNSUPPORTED_VERSION";
    case Rejection::kUnknownCommand: return "UNKNOWN_COMMAND";
    case Rejection::kWrongType: return "WRONG_TYPE";
    case Rejection::kUnauthenticated: return "UNAUTHENTICATED";
  }
  return "MALFORMED";
}

std::string_view rejection_label(Rejection r) {
  switch (r) {
    case Rejection::kMalformed: return "malformed";
    case Rejection::kTooLarge: return "too_large";
    case Rejection::kUnsupportedVersion: return "unsupported_version";
    case Rejection::kUnknownCommand: return "unknown_command";
    case Rejection::kWrongType: return "wrong_type";
    case Rejection::kUnauthenticated: return "unauthenticated";
  }
  return "malformed";
}

ParseResult parse_request(std::string_view bytes, size_t max_bytes) {
  if (bytes.size() > max_bytes) {
    return fail(Rejection::kTooLarge, "request of " + std::to_string(bytes.size()) +
                                          " bytes exceeds control_max_message_bytes = " + std::to_string(max_bytes));
  }
  if (nesting_depth(bytes) > kMaxDepth) {
    return fail(Rejection::kMalformed, "request nests deeper than " + std::to_string(kMaxDepth) + " levels");
  }
  json doc = json::parse(bytes.begin(), bytes.end(), nullptr, /*allow_exceptions=*/false);
  if (doc.is_discarded()) return fail(Rejection::kMalformed, "request is not valid JSON");
  if (!doc.is_object()) return fail(Rejection::kMalformed, "request is not a JSON object");

  json id = nullptr;
  if (auto it = doc.find("id"); it != doc.end()) {
    if (it->is_string() && it->get_ref<const std::string&>().size() <= 256) {
      id = *it;
    } else if (it->is_number()) {
      id = *it;
    } else {
      return fail(Rejection::kMalformed, "\"id\" must be a string (up to 256 bytes) or a number");
    }
  }
  auto v = doc.find("v");
  if (v == doc.end()) return fail(Rejection::kMalformed, "missing \"v\" (protocol version, 1)", id);
  if (!v->is_number_integer() && !v->is_number_unsigned()) {
    return fail(Rejection::kMalformed, "\"v\" must be an integer", id);
  }
  if (v->get<int64_t>() != kProtocolVersion) {
    return fail(Rejection::kUnsupportedVersion,
                "protocol version " + std::to_string(v->get<int64_t>()) + " is not supported (this daemon speaks 1)", id);
  }
  auto cmd = doc.find("cmd");
  if (cmd == doc.end() || !cmd->is_string()) return fail(Rejection::kMalformed, "missing or non-string \"cmd\"", id);
  const auto& name = cmd->get_ref<const std::string&>();
  if (name.empty() || name.size() > 64) return fail(Rejection::kMalformed, "\"cmd\" must be 1..64 bytes", id);

  ParseResult r;
  r.request.id = id;
  r.request.cmd = name;
  if (auto args = doc.find("args"); args != doc.end()) {
    if (args->is_null()) {
      // same as absent
    } else if (!args->is_object()) {
      return fail(Rejection::kWrongType, "\"args\" must be an object", id);
    } else {
      r.request.args = std::move(*args);
    }
  }
  if (auto token = doc.find("token"); token != doc.end()) {
    if (!token->is_string()) return fail(Rejection::kMalformed, "\"token\" must be a string", id);
    r.request.token = token->get<std::string>();
  }
  for (const auto& [key, value] : doc.items()) {
    if (key != "v" && key != "id" && key != "cmd" && key != "args" && key != "token") {
      return fail(Rejection::kMalformed, "unknown field \"" + key.substr(0, 64) + "\"", id);
    }
  }
  r.ok = true;
  return r;
}

std::string ok_reply(const json& id, const json& result) {
  return dump(json{{"v", kProtocolVersion}, {"id", id}, {"ok", true}, {"result", result}});
}

std::string error_reply(const json& id, std::string_view code, std::string_view message) {
  return dump(json{{"v", kProtocolVersion},
                   {"id", id},
                   {"ok", false},
                   {"error", {{"code", std::string(code)}, {"message", std::string(message)}}}});
}

std::string error_reply(const ProtocolError& e) { return error_reply(e.id, rejection_code(e.kind), e.message); }

std::string error_reply(const json& id, const Status& status) {
  return error_reply(id, code_name(status.code()), status.message());
}

std::string make_request(const json& id, std::string_view cmd, const json& args, std::string_view token) {
  json j{{"v", kProtocolVersion}, {"id", id}, {"cmd", std::string(cmd)}, {"args", args}};
  if (!token.empty()) j["token"] = std::string(token);
  return dump(j);
}

}  // namespace sparsecar::control
