#include "sparsecar/common/checked_file.h"

#include <fcntl.h>
#include <string.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <new>

namespace sparsecar {

std::string file_kind(mode_t mode) {
  if (S_ISREG(mode)) return "a regular file";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a regular file";
}

Expected<std::string> read_checked_file(const std::string& path, const std::string& what, size_t max_bytes,
                                        const std::function<Status(const struct stat&)>& check) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0) return errno_status(what + ": cannot open", errno);
  struct Closer {
    int fd;
    ~Closer() { ::close(fd); }
  } closer{fd};
  struct stat st {};
  if (::fstat(fd, &st) != 0) return errno_status("fstat of " + what, errno);
  SC_RETURN_IF_ERROR(check(st));
  if (!S_ISREG(st.st_mode)) return invalid_argument(what + " is " + file_kind(st.st_mode));  // `check` must refuse it
  const size_t want = std::min(max_bytes, static_cast<size_t>(st.st_size) + 1);  // + 1: notice growth
  std::string bytes;
  try {
    bytes.resize(want);
  } catch (const std::bad_alloc&) {
    return resource_exhausted(what + ": cannot allocate " + std::to_string(want) + " bytes to read it");
  }
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::read(fd, bytes.data() + done, bytes.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      const int err = errno;
      ::explicit_bzero(bytes.data(), bytes.size());
      return errno_status("reading " + what, err);
    }
    if (n == 0) break;
    done += static_cast<size_t>(n);
  }
  bytes.resize(done);
  return bytes;
}

}  // namespace sparsecar
