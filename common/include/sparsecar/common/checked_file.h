// read_checked_file: reads a file named by a user (config, job secret, checkpoint) without ever
// blocking on it or reading more than a bound.
//
// The file is opened O_NONBLOCK (a FIFO without a writer must not stall the calling thread), and
// `check` sees the fstat of the *opened* file, so the file read is the file checked. `check`
// refuses what its caller does not want; it must refuse anything that is not a regular file
// (file_kind() names the others for messages). At most `max_bytes` are read: fewer when the file
// ends first. A read or allocation failure names `what`; the buffer is wiped on every error (the
// file may hold a secret).
//
// Thread-safety: a plain function; no shared state.
#pragma once

#include <sys/stat.h>

#include <functional>
#include <string>

#include "sparsecar/common/status.h"

namespace sparsecar {

Expected<std::string> read_checked_file(const std::string& path, const std::string& what, size_t max_bytes,
                                        const std::function<Status(const struct stat&)>& check);

// "a FIFO", "a directory", ... for a mode that is not a regular file.
std::string file_kind(mode_t mode);

}  // namespace sparsecar
