// ShmMapping: see shm_mapping.h.
#include "daemon/session/shm_mapping.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "sparsecar/common/log.h"

namespace sparsecar {

ShmMapping::ShmMapping(ShmMapping&& other) noexcept
    : fd_(std::move(other.fd_)),
      addr_(std::exchange(other.addr_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)) {}

ShmMapping& ShmMapping::operator=(ShmMapping&& other) noexcept {
  if (this != &other) {
    reset();
    fd_ = std::move(other.fd_);
    addr_ = std::exchange(other.addr_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void ShmMapping::reset() {
  close_fd();
  if (addr_ != nullptr) ::munmap(addr_, bytes_);
  addr_ = nullptr;
  bytes_ = 0;
}

Expected<ShmMapping> ShmMapping::create(const std::string& name, size_t bytes) {
  ShmMapping m;
  m.fd_.reset(::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING));
  if (m.fd_.get() < 0) {
    int err = errno;
    SC_LOG_ERROR("memfd_create({}): {}", name, std::strerror(err));
    return errno_status("memfd_create " + name, err);
  }
  if (::ftruncate(m.fd_.get(), static_cast<off_t>(bytes)) != 0) {
    int err = errno;
    SC_LOG_ERROR("ftruncate({}, {}): {}", name, bytes, std::strerror(err));
    return errno_status("ftruncate " + name, err);
  }
  if (::fcntl(m.fd_.get(), F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    int err = errno;
    SC_LOG_ERROR("F_ADD_SEALS({}): {}", name, std::strerror(err));
    return errno_status("sealing " + name, err);
  }
  void* addr = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, m.fd_.get(), 0);
  if (addr == MAP_FAILED) {
    int err = errno;
    SC_LOG_ERROR("mmap({}, {}): {}", name, bytes, std::strerror(err));
    return errno_status("mmap " + name, err);
  }
  m.addr_ = addr;
  m.bytes_ = bytes;
  return m;
}

}  // namespace sparsecar
