// ShmMapping: a shared, read-write mapping of a sealed memfd — a client's control mapping (rings)
// or one of its tensor slots. The session server creates it, passes the fd to the client with
// SCM_RIGHTS and then closes the fd (close_fd); the mapping stays until the ShmMapping goes.
//
// Thread-safety: a plain value; one owner at a time (the session thread).
#pragma once

#include <cstddef>
#include <string>

#include "sparsecar/common/fd.h"
#include "sparsecar/common/status.h"

namespace sparsecar {

class ShmMapping {
 public:
  ShmMapping() = default;
  ShmMapping(const ShmMapping&) = delete;
  ShmMapping& operator=(const ShmMapping&) = delete;
  ShmMapping(ShmMapping&& other) noexcept;
  ShmMapping& operator=(ShmMapping&& other) noexcept;
  ~ShmMapping() { reset(); }

  // memfd_create(name) + ftruncate(bytes) + seals (the client must not shrink or grow it under
  // our mapping) + a pre-faulted MAP_SHARED mapping. Each failing call is logged once, here.
  static Expected<ShmMapping> create(const std::string& name, size_t bytes);

  int fd() const { return fd_.get(); }  // -1 once closed
  void* addr() const { return addr_; }
  size_t bytes() const { return bytes_; }

  // Closes the memfd (once it has been sent); the mapping stays.
  void close_fd() { fd_.reset(); }
  // Closes the memfd and unmaps.
  void reset();

 private:
  Fd fd_;
  void* addr_ = nullptr;
  size_t bytes_ = 0;
};

}  // namespace sparsecar
