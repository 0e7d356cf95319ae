#include "daemon/transport/peer_watch.h"

#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace sparsecar {
namespace {

std::string read_first_line(const std::string& path) {
  std::string line;
  if (FILE* f = std::fopen(path.c_str(), "re")) {
    char buf[256];
    if (std::fgets(buf, sizeof buf, f) != nullptr) line = buf;
    std::fclose(f);
  }
  while (!line.empty() && (line.back() == '\n' || line.back() == '\r')) line.pop_back();
  return line;
}

uint64_t process_start_time(uint64_t pid) {
  std::string stat = read_first_line("/proc/" + std::to_string(pid) + "/stat");
  size_t close = stat.rfind(')');
  if (close == std::string::npos) return 0;
  // Fields after the command name start at field 3; start time is field 22.
  size_t pos = close + 2;
  for (int field = 3; field < 22 && pos != std::string::npos; ++field) {
    pos = stat.find(' ', pos);
    if (pos != std::string::npos) ++pos;
  }
  return pos == std::string::npos ? 0 : std::strtoull(stat.c_str() + pos, nullptr, 10);
}

}  // namespace

ProcessIdentity my_identity() {
  ProcessIdentity id;
  id.boot_id = read_first_line("/proc/sys/kernel/random/boot_id");
  char ns[128] = {};
  ssize_t n = ::readlink("/proc/self/ns/pid", ns, sizeof ns - 1);
  if (n > 0) id.pid_ns.assign(ns, static_cast<size_t>(n));
  id.pid = static_cast<uint64_t>(::getpid());
  id.start_time = process_start_time(id.pid);
  return id;
}

std::string pack_address(const ProcessIdentity& id, const std::string& ucx_address) {
  return "SCID1\n" + id.boot_id + "\n" + id.pid_ns + "\n" + std::to_string(id.pid) + "\n" +
         std::to_string(id.start_time) + "\n" + ucx_address;
}

bool unpack_address(const std::string& blob, ProcessIdentity* id, std::string* ucx_address) {
  std::vector<std::string> fields;
  size_t pos = 0;
  for (int i = 0; i < 5; ++i) {
    size_t nl = blob.find('\n', pos);
    if (nl == std::string::npos) return false;
    fields.push_back(blob.substr(pos, nl - pos));
    pos = nl + 1;
  }
  if (fields[0] != "SCID1") return false;
  id->boot_id = fields[1];
  id->pid_ns = fields[2];
  id->pid = std::strtoull(fields[3].c_str(), nullptr, 10);
  id->start_time = std::strtoull(fields[4].c_str(), nullptr, 10);
  *ucx_address = blob.substr(pos);
  return !ucx_address->empty();
}

int watch_process(const ProcessIdentity& mine, const ProcessIdentity& peer, bool* gone) {
  *gone = false;
  if (mine.boot_id.empty() || peer.boot_id != mine.boot_id || peer.pid_ns != mine.pid_ns || peer.pid == 0 ||
      peer.start_time == 0) {
    return -1;
  }
  // glibc 2.36's <sys/pidfd.h> does not link from C++: use the system call.
  int fd = static_cast<int>(::syscall(SYS_pidfd_open, static_cast<pid_t>(peer.pid), 0));
  if (fd < 0) {
    *gone = errno == ESRCH;
    return -1;
  }
  // Checked after opening: the pidfd pins the pid, so a matching start time means this is it.
  if (process_start_time(peer.pid) != peer.start_time) {
    ::close(fd);
    *gone = true;
    return -1;
  }
  return fd;
}

}  // namespace sparsecar
