// LockFile: an exclusive flock(2) on a file beside something one process must own alone (a
// socket path), removed again when its owner lets go.
//
// Why a lock and not the socket itself: a second bind to a ZeroMQ ipc:// path silently steals it,
// and a Unix socket can only be probed once somebody listens on it. A lock is taken before anything
// is bound (sparsecard takes its sockets' locks before it joins the job) and vanishes with the
// process even when it is killed.
//
// Removal without races: release() unlinks the path while still holding the lock, and acquire()
// checks after flock() that the path still names the file it locked (a process that opened the
// file just before the unlink would otherwise hold a lock on a file nobody else can see). So a
// lock file is removed only by the process that holds it, never under another live holder.
//
// Thread-safety: a plain value; one owner at a time.
#pragma once

#include <string>

#include "sparsecar/common/fd.h"
#include "sparsecar/common/status.h"

namespace sparsecar {

class LockFile {
 public:
  LockFile() = default;
  LockFile(LockFile&&) noexcept = default;
  LockFile& operator=(LockFile&& other) noexcept;
  ~LockFile() { release(); }

  // Creates `path` (mode 0600) if needed and locks it without waiting. Errors:
  // kFailedPrecondition when another process holds it (the message names the path), the errno
  // status (with the path) when it cannot be created or locked.
  static Expected<LockFile> acquire(const std::string& path);

  bool held() const { return fd_.get() >= 0; }
  const std::string& path() const { return path_; }
  // Removes the file and drops the lock; a no-op when nothing is held.
  void release();

 private:
  Fd fd_;
  std::string path_;
};

}  // namespace sparsecar
