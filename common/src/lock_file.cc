#include "sparsecar/common/lock_file.h"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>

namespace sparsecar {

LockFile& LockFile::operator=(LockFile&& other) noexcept {
  if (this != &other) {
    release();
    fd_ = std::move(other.fd_);
    path_ = std::move(other.path_);
  }
  return *this;
}

Expected<LockFile> LockFile::acquire(const std::string& path) {
  // A holder that releases between our open() and flock() leaves us a lock on an unlinked file:
  // try again on the new one (bounded: each round needs another process to release meanwhile).
  for (int attempt = 0; attempt < 16; ++attempt) {
    Fd fd(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600));
    if (fd.get() < 0) return errno_status("opening lock file " + path, errno);
    if (::flock(fd.get(), LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      if (err == EWOULDBLOCK) return failed_precondition(path + " is locked by another live process");
      return errno_status("locking " + path, err);
    }
    struct stat held{}, named{};
    if (::fstat(fd.get(), &held) != 0) return errno_status("fstat of lock file " + path, errno);
    if (::stat(path.c_str(), &named) == 0 && named.st_dev == held.st_dev && named.st_ino == held.st_ino) {
      LockFile lock;
      lock.fd_ = std::move(fd);
      lock.path_ = path;
      return lock;
    }
  }
  return failed_precondition(path + " keeps being replaced by other processes");
}

void LockFile::release() {
  if (fd_.get() < 0) return;
  ::unlink(path_.c_str());  // still locked: nobody else can hold this file now
  fd_.reset();
}

}  // namespace sparsecar
