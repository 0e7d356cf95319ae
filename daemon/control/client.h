// ControlClient: one request/reply over the control socket (sparsecarctl and tests).
// A DEALER socket (LINGER 0) connects, sends one request and waits for its reply up to a
// deadline; a daemon that is not there or does not answer is an error value, never a hang.
// Thread-safety: one client per thread.
#pragma once

#include <chrono>
#include <memory>
#include <string>

#include <nlohmann/json.hpp>

#include "sparsecar/common/status.h"

namespace sparsecar::control {

struct ClientOptions {
  std::string endpoint;
  std::string token;              // tcp:// with a token
  std::string curve_server_key;   // tcp:// with CURVE: the daemon's Z85 public key
  std::chrono::milliseconds timeout{10000};
};

class ControlClient {
 public:
  static Expected<std::unique_ptr<ControlClient>> connect(const ClientOptions& options);
  ~ControlClient();
  // Sends `cmd` with `args`; returns the whole reply object ({"ok":..., "result"|"error"}).
  // Errors: kUnavailable (cannot connect), kDeadlineExceeded (no reply in time), kDataLoss (the
  // reply is not a protocol reply).
  Expected<nlohmann::json> call(const std::string& cmd, const nlohmann::json& args = nlohmann::json::object(),
                                std::chrono::milliseconds timeout = std::chrono::milliseconds(0));
  // Sends raw bytes (tests of malformed requests) and returns the raw reply.
  Expected<std::string> call_raw(const std::string& bytes, std::chrono::milliseconds timeout = std::chrono::milliseconds(0));

  struct Impl;

 private:
  explicit ControlClient(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace sparsecar::control
