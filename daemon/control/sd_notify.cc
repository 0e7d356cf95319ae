#include "daemon/control/sd_notify.h"

#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cerrno>
#include <cstddef>
#include <cstdlib>
#include <cstring>

#include "sparsecar/common/log.h"

namespace sparsecar {

bool sd_notify_state(const std::string& state) {
  const char* path = std::getenv("NOTIFY_SOCKET");
  if (path == nullptr || path[0] == '\0') return false;
  const size_t len = std::strlen(path);
  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if ((path[0] != '/' && path[0] != '@') || len >= sizeof addr.sun_path) {
    SC_LOG_WARN("NOTIFY_SOCKET '{}' is not a socket path; not notifying systemd", path);
    return false;
  }
  std::memcpy(addr.sun_path, path, len);
  if (path[0] == '@') addr.sun_path[0] = '\0';  // abstract namespace
  int fd = ::socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    SC_LOG_WARN("sd_notify: socket: {}", std::strerror(errno));
    return false;
  }
  const socklen_t addr_len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + len);
  ssize_t sent = ::sendto(fd, state.data(), state.size(), MSG_NOSIGNAL, reinterpret_cast<sockaddr*>(&addr), addr_len);
  const int err = errno;
  ::close(fd);
  if (sent < 0) {
    SC_LOG_WARN("sd_notify to {}: {}", path, std::strerror(err));
    return false;
  }
  return true;
}

}  // namespace sparsecar
