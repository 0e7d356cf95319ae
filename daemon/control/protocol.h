// The control protocol: versioned JSON requests and replies carried by the ZeroMQ control socket
// (one JSON object per message; ROUTER on the daemon side, DEALER in sparsecarctl).
//
//   request   {"v":1, "id":<string|number>, "cmd":"<command>", "args":{...}}
//   success   {"v":1, "id":<id>, "ok":true,  "result":{...}}
//   failure   {"v":1, "id":<id|null>, "ok":false, "error":{"code":"<CODE>", "message":"<text>"}}
//
// `v` must be 1; `id` is echoed unchanged (null when the request was too broken to read it);
// `args` may be omitted (= {}). Error codes are the Status code names (INVALID_ARGUMENT,
// NOT_FOUND, FAILED_PRECONDITION, ...) plus the protocol's own:
//   MALFORMED            not JSON, not an object, nested deeper than kMaxDepth, bad field types
//   TOO_LARGE            message over the configured size cap
//   UNSUPPORTED_VERSION  v is not 1
//   UNKNOWN_COMMAND      cmd is not in the command table
//   WRONG_TYPE           an argument has the wrong JSON type
//   UNAUTHENTICATED      tcp:// with a token: the token is missing or wrong
//
// parse_request() is a pure function of the bytes (no I/O, no exceptions escape); it is the
// libFuzzer target's entry point (tests/fuzz/control_request_fuzz.cc).
// Thread-safety: free functions over values.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "sparsecar/common/status.h"

namespace sparsecar::control {

inline constexpr int kProtocolVersion = 1;
inline constexpr size_t kDefaultMaxMessageBytes = 64 * 1024;
inline constexpr int kMaxDepth = 16;  // nesting of arrays/objects in one request

// Protocol error kinds; also the `reason` label of sparsecar_control_rejected_total.
enum class Rejection { kMalformed, kTooLarge, kUnsupportedVersion, kUnknownCommand, kWrongType, kUnauthenticated };
inline constexpr Rejection kAllRejections[] = {Rejection::kMalformed,      Rejection::kTooLarge,
                                               Rejection::kUnsupportedVersion, Rejection::kUnknownCommand,
                                               Rejection::kWrongType,      Rejection::kUnauthenticated};
// "MALFORMED", "TOO_LARGE", ... (the error code on the wire)
std::string_view rejection_code(Rejection r);
// "malformed", "too_large", ... (the metric label)
std::string_view rejection_label(Rejection r);

struct Request {
  nlohmann::json id;    // string or number (null when absent)
  std::string cmd;
  nlohmann::json args = nlohmann::json::object();
  std::string token;    // "token" field, only used on tcp:// endpoints
};

struct ProtocolError {
  Rejection kind = Rejection::kMalformed;
  std::string message;
  nlohmann::json id;  // echoed when it could be read
};

// Either a Request or the reason it is not one.
struct ParseResult {
  bool ok = false;
  Request request;
  ProtocolError error;
};

// Parses and checks the envelope (size, JSON, depth, v, id, cmd, args types). Does not look at
// the command table: unknown commands are the dispatcher's call.
ParseResult parse_request(std::string_view bytes, size_t max_bytes = kDefaultMaxMessageBytes);

// Reply builders (serialised with dump(); invalid UTF-8 from a peer is replaced, never thrown).
std::string ok_reply(const nlohmann::json& id, const nlohmann::json& result);
std::string error_reply(const nlohmann::json& id, std::string_view code, std::string_view message);
std::string error_reply(const ProtocolError& e);
std::string error_reply(const nlohmann::json& id, const Status& status);

// Request builder (sparsecarctl, tests).
std::string make_request(const nlohmann::json& id, std::string_view cmd, const nlohmann::json& args,
                         std::string_view token = {});

}  // namespace sparsecar::control
