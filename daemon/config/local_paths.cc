#include "daemon/config/local_paths.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

namespace sparsecar {
namespace {

std::string parent_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  if (slash == std::string::npos) return ".";
  if (slash == 0) return "/";
  return path.substr(0, slash);
}

std::string base_of(const std::string& path) {
  const size_t slash = path.rfind('/');
  return slash == std::string::npos ? path : path.substr(slash + 1);
}

bool is_dir(const std::string& path) {
  struct stat st{};
  return ::stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// Ours to create: the default directory, or "sparsecar*" in an existing directory.
bool ours_to_create(const std::string& dir) {
  if (dir == kDefaultSocketDir) return true;
  return base_of(dir).rfind("sparsecar", 0) == 0 && is_dir(parent_of(dir));
}

std::string ipc_path(const std::string& endpoint) {
  return endpoint.rfind("ipc://", 0) == 0 ? endpoint.substr(6) : std::string();
}

}  // namespace

std::string resolved_control_endpoint(const Config& config) {
  if (config.control != "auto") return config.control;
  std::string base = config.socket;
  if (base.size() > 5 && base.compare(base.size() - 5, 5, ".sock") == 0) base.resize(base.size() - 5);
  return "ipc://" + base + "-control.sock";
}

std::string resolved_metrics_listen(const Config& config) {
  if (config.metrics_listen != "auto") return config.metrics_listen;
  return "127.0.0.1:" + std::to_string(kMetricsBasePort + config.rank);
}

Status prepare_socket_dir(const std::string& path, std::string_view flag) {
  const std::string dir = parent_of(path);
  const std::string hint = "; pass " + std::string(flag) + " PATH in a directory this user can write";
  struct stat st{};
  if (::stat(dir.c_str(), &st) == 0) {
    if (!S_ISDIR(st.st_mode)) return failed_precondition("socket directory " + dir + " of " + path + " is not a directory" + hint);
    if (::access(dir.c_str(), W_OK | X_OK) != 0) {
      return failed_precondition("cannot create sockets in " + dir + " (" + std::strerror(errno) + ")" + hint);
    }
    return Status::Ok();
  }
  if (errno != ENOENT || !ours_to_create(dir)) {
    return failed_precondition("socket directory " + dir + " of " + path + " does not exist (" +
                               std::strerror(errno) + "); create it" + hint +
                               " (sparsecard creates only /run/sparsecar or a missing sparsecar* directory "
                               "inside an existing one)");
  }
  if (::mkdir(dir.c_str(), 0750) != 0 && errno != EEXIST) {
    return failed_precondition("cannot create socket directory " + dir + " (" + std::strerror(errno) + ")" + hint +
                               (dir == kDefaultSocketDir ? " (systemd's unit creates /run/sparsecar)" : ""));
  }
  return Status::Ok();
}

Expected<LocalClaims> claim_local_paths(const Config& config) {
  LocalClaims claims;
  SC_RETURN_IF_ERROR(prepare_socket_dir(config.socket, "--socket"));
  auto socket_lock = LockFile::acquire(config.socket + ".lock");
  if (!socket_lock.ok()) {
    if (socket_lock.status().code() != Code::kFailedPrecondition) return socket_lock.status();
    return failed_precondition("another sparsecard on this host uses the trainer socket " + config.socket + " (" +
                               socket_lock.status().message() +
                               "); give every daemon on one host its own --socket (and --control, unless it is "
                               "'auto')");
  }
  claims.socket_lock = std::move(socket_lock).value();

  const std::string control = ipc_path(resolved_control_endpoint(config));
  // An 'auto' path too long for a Unix socket means no control socket (the daemon warns).
  if (!control.empty() && control[0] == '/' && control.size() + 5 < 108) {
    SC_RETURN_IF_ERROR(prepare_socket_dir(control, "--control"));
    auto control_lock = LockFile::acquire(control + ".lock");
    if (!control_lock.ok()) {
      if (control_lock.status().code() != Code::kFailedPrecondition) return control_lock.status();
      return failed_precondition("another sparsecard on this host serves the control socket " + control + " (" +
                                 control_lock.status().message() + "); give every daemon on one host its own " +
                                 (config.control == "auto" ? "--socket (the control socket 'auto' sits beside it)"
                                                           : "--control"));
    }
    claims.control_lock = std::move(control_lock).value();
  }
  return claims;
}

}  // namespace sparsecar
