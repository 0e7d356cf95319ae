// Connection: see connection.h.
#include "daemon/session/connection.h"

#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <span>

#include "daemon/session/frames.h"
#include "sparsecar/common/log.h"

namespace sparsecar {

std::string Connection::label() const { return fmt::format("client {} (pid {})", id_, static_cast<int>(peer_pid_)); }

void Connection::mark_drop(std::string reason) {
  if (drop_) return;
  drop_ = true;
  drop_reason_ = std::move(reason);
}

void Connection::shutdown() { ::shutdown(sock_.get(), SHUT_RDWR); }

void Connection::release_memory() {
  slots.clear();  // unmaps
  ctl_ = nullptr;
  control_.reset();
}

bool Connection::send(proto::MsgType type, const void* payload, const int* fds, size_t nfds) {
  std::array<uint8_t, proto::kMaxMessageBytes> buf;
  proto::MsgHeader h = proto::make_header(type);
  std::memcpy(buf.data(), &h, sizeof h);
  std::memcpy(buf.data() + sizeof h, payload, h.length);
  iovec iov{buf.data(), sizeof h + h.length};
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int) * proto::kHelloFds)];
  if (nfds > 0) {
    SC_CHECK(nfds <= proto::kHelloFds, "too many fds ({}) for one message", nfds);
    std::memset(cbuf, 0, sizeof cbuf);
    msg.msg_control = cbuf;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * nfds);
    cmsghdr* cm = CMSG_FIRSTHDR(&msg);
    cm->cmsg_level = SOL_SOCKET;
    cm->cmsg_type = SCM_RIGHTS;
    cm->cmsg_len = CMSG_LEN(sizeof(int) * nfds);
    std::memcpy(CMSG_DATA(cm), fds, sizeof(int) * nfds);
  }
  ssize_t n;
  do {
    n = ::sendmsg(sock_.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
  } while (n < 0 && errno == EINTR);
  if (n != static_cast<ssize_t>(iov.iov_len)) {
    // A client that does not read its socket is broken; a partial message cannot be resumed.
    mark_drop(n < 0 ? fmt::format("send failed: {}", std::strerror(errno))
                    : std::string("send buffer full (client does not read its socket)"));
    return false;
  }
  return true;
}

std::optional<std::string> Connection::receive(const MessageHandler& on_message) {
  if (in_used_ >= in_.size()) {  // cannot happen: complete messages are consumed below
    return std::string("input buffer full");
  }
  iovec iov{in_.data() + in_used_, in_.size() - in_used_};
  alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int) * 8)];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = cbuf;
  msg.msg_controllen = sizeof cbuf;
  ssize_t n = ::recvmsg(sock_.get(), &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (n < 0) {
    if (errno == EAGAIN || errno == EINTR) return std::nullopt;
    mark_drop(fmt::format("socket error: {}", std::strerror(errno)));
    return std::nullopt;
  }
  bool stray_fds = false;
  for (cmsghdr* cm = CMSG_FIRSTHDR(&msg); cm != nullptr; cm = CMSG_NXTHDR(&msg, cm)) {
    if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
      size_t nfds = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t k = 0; k < nfds; ++k) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(cm) + k * sizeof(int), sizeof fd);
        ::close(fd);
      }
      stray_fds = true;
    }
  }
  if (stray_fds || (msg.msg_flags & MSG_CTRUNC)) return std::string("client sent file descriptors");
  if (n == 0) {
    mark_drop("closed the connection");
    return std::nullopt;
  }
  in_used_ += static_cast<size_t>(n);
  size_t off = 0;
  while (!drop_) {
    FrameScan f = scan_frame(std::span<const uint8_t>(in_.data() + off, in_used_ - off));
    if (f.kind == FrameScan::Kind::kMalformed) return std::string(f.error);
    if (f.kind == FrameScan::Kind::kIncomplete) break;
    on_message(f.header, f.payload.data());
    off += f.bytes();
  }
  if (off > 0 && !drop_) {
    std::memmove(in_.data(), in_.data() + off, in_used_ - off);
    in_used_ -= off;
  }
  return std::nullopt;
}

Status Connection::check_hello(const proto::Hello& m) const {
  if (m.version != proto::kProtocolVersion || m.shm_version != shm::kShmVersion) {
    return failed_precondition(fmt::format("client speaks protocol {} / shm {}; the daemon speaks {} / {}",
                                      m.version, m.shm_version, proto::kProtocolVersion, shm::kShmVersion));
  }
  if (m.flags != 0) return invalid_argument(fmt::format("unknown Hello flags 0x{:x}", m.flags));
  uid_t self = ::geteuid();
  if (peer_uid_ != self && peer_uid_ != 0) {
    return permission_denied(fmt::format("uid {} may not open a session (the daemon runs as uid {})",
                                    static_cast<unsigned>(peer_uid_), static_cast<unsigned>(self)));
  }
  return Status::Ok();
}

void Connection::refuse_hello(const Status& st) {
  proto::HelloAck ack{};
  ack.status = static_cast<int32_t>(st.code());
  ack.shm_version = shm::kShmVersion;
  proto::set_field(ack.message, sizeof ack.message, st.message());
  send(proto::MsgType::kHelloAck, &ack, nullptr, 0);
  mark_drop("refused: " + st.message());
}

Status Connection::open_session(uint32_t local_clients) {
  auto control = ShmMapping::create(fmt::format("sparsecar-c{}-control", id_), shm::kControlBytes);
  if (!control.ok()) return control.status().with_context("creating the control mapping");
  Fd sub(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  Fd comp(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (sub.get() < 0 || comp.get() < 0) {
    int err = errno;
    SC_LOG_ERROR("eventfd for {}: {}", label(), std::strerror(err));
    return errno_status("eventfd", err);
  }
  control_ = std::move(control).value();
  ctl_ = shm::init_control(control_.addr());
  sub_efd_ = std::move(sub);
  comp_efd_ = std::move(comp);
  proto::HelloAck ack{};
  ack.status = 0;
  ack.client_id = id_;
  ack.local_clients = local_clients;
  ack.shm_version = shm::kShmVersion;
  ack.control_bytes = control_.bytes();
  proto::set_field(ack.message, sizeof ack.message, "");
  int fds[proto::kHelloFds] = {control_.fd(), sub_efd_.get(), comp_efd_.get()};
  if (!send(proto::MsgType::kHelloAck, &ack, fds, proto::kHelloFds)) return Status::Ok();
  control_.close_fd();
  state_ = State::kReady;
  return Status::Ok();
}

bool Connection::take_submission_wakeup() {
  uint64_t v;
  if (::read(sub_efd_.get(), &v, sizeof v) < 0 && errno != EAGAIN) {
    mark_drop(fmt::format("reading its submission eventfd: {}", std::strerror(errno)));
    return false;
  }
  return true;
}

bool Connection::post_completion(const shm::Completion& comp) {
  if (drop_ || ctl_ == nullptr) return true;
  if (!shm::ring_push(ctl_->completions, comp)) return false;
  uint64_t one = 1;
  if (::write(comp_efd_.get(), &one, sizeof one) < 0 && errno != EAGAIN) {
    mark_drop(fmt::format("signalling its completion eventfd: {}", std::strerror(errno)));
  }
  return true;
}

}  // namespace sparsecar
