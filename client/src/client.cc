// The trainer side of the session protocol (common/.../session_protocol.h, shm_layout.h).
// Blocking socket with poll() deadlines for the handshake and registrations; the data path
// (submit/wait) only touches the shared rings and eventfds, plus the socket to notice a daemon
// that went away.
#include "sparsecar/client.h"

#include <poll.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <optional>
#include <thread>
#include <unordered_map>
#include <vector>

#include "sparsecar/common/log.h"
#include "sparsecar/common/session_protocol.h"
#include "sparsecar/common/shm_layout.h"

namespace sparsecar {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;


void close_fd(int& fd) {
  if (fd >= 0) ::close(fd);
  fd = -1;
}

// Milliseconds left until `deadline`, rounded up, clamped to [0, INT_MAX].
int ms_left(Clock::time_point deadline) {
  auto left = deadline - Clock::now();
  if (left <= Clock::duration::zero()) return 0;
  auto ms = std::chrono::ceil<milliseconds>(left).count();
  return ms > INT32_MAX ? INT32_MAX : static_cast<int>(ms);
}

// A daemon-sent status number, validated.
Status wire_status(int32_t code, const char* text, size_t cap) {
  if (code < 0 || code > static_cast<int32_t>(Code::kResourceExhausted)) {
    return data_loss(fmt::format("daemon sent an unknown status code {}", code));
  }
  auto message = proto::field_string(text, cap);
  return Status(static_cast<Code>(code), message ? std::string(*message) : std::string("(bad message)"));
}

struct Received {
  proto::MsgHeader header{};
  std::array<uint8_t, proto::kMaxPayloadBytes> payload{};
  std::vector<int> fds;  // owned by the caller
};

// "[2, 3]" or "none".
std::string shape_string(const std::vector<uint64_t>& shape) {
  if (shape.empty()) return "none";
  std::string out = "[";
  for (size_t i = 0; i < shape.size(); ++i) out += (i ? ", " : "") + std::to_string(shape[i]);
  return out + "]";
}

static_assert(Client::kMaxDims == proto::kMaxShapeDims);
static_assert(sizeof(DeviceHandles::device_uuid) == proto::kDeviceUuidBytes);
static_assert(sizeof(DeviceHandles::mem_handle) == proto::kIpcHandleBytes);
static_assert(sizeof(DeviceHandles::ready_event) == proto::kIpcHandleBytes);

}  // namespace

class Client::Impl {
 public:
  struct Entry {
    Tensor tensor;
    void* addr = nullptr;
    size_t bytes = 0;
    std::optional<uint64_t> pending;      // step submitted and not yet answered
    std::optional<shm::Completion> done;  // its completion, popped while waiting for another
    bool trainer_reduces = false;         // the pending submission's SubmitOptions::trainer_reduces
    bool takes_lease = false;             // ... and its takes_lease, as sent
  };

  ~Impl();
  Status connect(const std::string& path, const ConnectOptions& options);
  // A host tensor (device == null) or a device tensor.
  Expected<Tensor*> register_tensor(std::string_view name, size_t count, DType dtype,
                                    const std::vector<uint64_t>& shape, const DeviceHandles* device = nullptr);
  Status submit(const Tensor& tensor, uint64_t step, const SubmitOptions& options);
  Expected<StepInfo> wait(const Tensor& tensor, uint64_t step, milliseconds timeout);
  bool await_activity(milliseconds timeout);
  bool in_flight(const Tensor& tensor, uint64_t step) {
    Entry* e = find(tensor);
    return e != nullptr && e->pending && *e->pending == step;
  }
  Status report_metric(std::string_view name, double value, uint64_t step);

 private:
  Status send(proto::MsgType type, const void* payload);
  Expected<Received> receive(Clock::time_point deadline);
  Status read_exact(void* buf, size_t len, Clock::time_point deadline, std::vector<int>* fds);
  Status fail(Status st);  // marks the session dead
  Status handle_socket_readable();
  Status drain_completions();
  Entry* find(const Tensor& tensor);

  std::string path_;
  milliseconds timeout_{10000};
  int sock_ = -1;
  int sub_efd_ = -1;
  int comp_efd_ = -1;
  shm::ShmControl* ctl_ = nullptr;
  size_t ctl_bytes_ = 0;
  uint32_t client_id_ = 0;
  uint64_t seq_ = 0;
  uint64_t outstanding_ = 0;  // submissions pushed minus completions popped
  Status dead_;               // not OK once the session is unusable
  std::vector<std::unique_ptr<Entry>> entries_;
  std::unordered_map<uint32_t, Entry*> by_id_;
};

Client::Impl::~Impl() {
  for (auto& e : entries_) {
    if (e->addr != nullptr) ::munmap(e->addr, e->bytes);
  }
  if (ctl_ != nullptr) ::munmap(ctl_, ctl_bytes_);
  close_fd(sock_);
  close_fd(sub_efd_);
  close_fd(comp_efd_);
}

Status Client::Impl::fail(Status st) {
  if (dead_.ok()) {
    SC_LOG_ERROR("sparsecar session with {} lost: {}", path_, st.to_string());
    dead_ = st;
  }
  return dead_;
}

// ---- socket I/O ----------------------------------------------------------------------------------

Status Client::Impl::send(proto::MsgType type, const void* payload) {
  std::array<uint8_t, proto::kMaxMessageBytes> buf;
  proto::MsgHeader h = proto::make_header(type);
  std::memcpy(buf.data(), &h, sizeof h);
  std::memcpy(buf.data() + sizeof h, payload, h.length);
  size_t len = sizeof h + h.length;
  size_t off = 0;
  while (off < len) {
    ssize_t n = ::send(sock_, buf.data() + off, len - off, MSG_NOSIGNAL);
    if (n < 0) {
      if (errno == EINTR) continue;
      return fail(errno_status("sending to the daemon at " + path_, errno));
    }
    off += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Status Client::Impl::read_exact(void* buf, size_t len, Clock::time_point deadline,
                                std::vector<int>* fds) {
  size_t got = 0;
  while (got < len) {
    pollfd p{sock_, POLLIN, 0};
    int r = ::poll(&p, 1, ms_left(deadline));
    if (r < 0) {
      if (errno == EINTR) continue;
      return errno_status("poll on the daemon socket", errno);
    }
    if (r == 0) return deadline_exceeded(fmt::format("the daemon at {} did not answer in time", path_));
    iovec iov{static_cast<uint8_t*>(buf) + got, len - got};
    alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int) * proto::kHelloFds)];
    msghdr msg{};
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf;
    msg.msg_controllen = sizeof cbuf;
    ssize_t n = ::recvmsg(sock_, &msg, MSG_CMSG_CLOEXEC | MSG_DONTWAIT);
    if (n < 0) {
      if (errno == EINTR || errno == EAGAIN) continue;
      return errno_status("receiving from the daemon at " + path_, errno);
    }
    for (cmsghdr* cm = CMSG_FIRSTHDR(&msg); cm != nullptr; cm = CMSG_NXTHDR(&msg, cm)) {
      if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS) continue;
      size_t nfds = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
      for (size_t k = 0; k < nfds; ++k) {
        int fd;
        std::memcpy(&fd, CMSG_DATA(cm) + k * sizeof(int), sizeof fd);
        fds->push_back(fd);
      }
    }
    if (msg.msg_flags & MSG_CTRUNC) return data_loss("the daemon sent too many file descriptors");
    if (n == 0) return unavailable(fmt::format("the daemon at {} closed the connection", path_));
    got += static_cast<size_t>(n);
  }
  return Status::Ok();
}

Expected<Received> Client::Impl::receive(Clock::time_point deadline) {
  Received r;
  auto close_all = [&] {
    for (int& fd : r.fds) close_fd(fd);
  };
  Status st = read_exact(&r.header, sizeof r.header, deadline, &r.fds);
  if (st.ok()) {
    if (const char* err = proto::header_error(r.header)) {
      st = data_loss(fmt::format("malformed message from the daemon: {}", err));
    } else {
      st = read_exact(r.payload.data(), r.header.length, deadline, &r.fds);
    }
  }
  if (!st.ok()) {
    close_all();
    if (st.code() == Code::kDeadlineExceeded) return st;  // session still usable
    return fail(st);
  }
  if (static_cast<proto::MsgType>(r.header.type) == proto::MsgType::kError) {
    close_all();
    proto::Error e;
    std::memcpy(&e, r.payload.data(), sizeof e);
    Status why = wire_status(e.status, e.message, sizeof e.message);
    return fail(Status(Code::kUnavailable, "the daemon closed the session: " + why.to_string()));
  }
  return r;
}

// ---- connect ---------------------------------------------------------------------------------------

Status Client::Impl::connect(const std::string& path, const ConnectOptions& options) {
  path_ = path;
  timeout_ = options.timeout;
  sockaddr_un addr{};
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return invalid_argument(fmt::format("socket path '{}' is empty or longer than {} bytes", path,
                                sizeof(addr.sun_path) - 1));
  }
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  const auto deadline = Clock::now() + options.timeout;
  milliseconds backoff{5};
  Status last;
  for (;;) {
    sock_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (sock_ < 0) return errno_status("socket(AF_UNIX)", errno);
    if (::connect(sock_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0) break;
    int err = errno;
    close_fd(sock_);
    last = errno_status("connect " + path, err);
    // Missing or not yet listening: the daemon may still be starting. Anything else is final.
    if (err != ENOENT && err != ECONNREFUSED && err != EAGAIN && err != EINTR) return last;
    int left = ms_left(deadline);
    if (left == 0) {
      return unavailable(fmt::format("no sparsecar daemon on {} within {} ms ({})", path,
                             static_cast<long long>(options.timeout.count()),
                             last.message()));
    }
    std::this_thread::sleep_for(std::min(backoff, milliseconds(left)));
    backoff = std::min(backoff * 2, milliseconds(100));
  }

  proto::Hello hello{};
  hello.version = proto::kProtocolVersion;
  hello.shm_version = shm::kShmVersion;
  hello.pid = static_cast<uint32_t>(::getpid());
  SC_RETURN_IF_ERROR(send(proto::MsgType::kHello, &hello));
  // The handshake gets at least a second even when connect() used up most of the timeout.
  auto reply_deadline = std::max(deadline, Clock::now() + milliseconds(1000));
  SC_ASSIGN_OR_RETURN(Received r, receive(reply_deadline));
  auto close_all = [&] {
    for (int& fd : r.fds) close_fd(fd);
  };
  if (static_cast<proto::MsgType>(r.header.type) != proto::MsgType::kHelloAck) {
    close_all();
    return fail(data_loss(fmt::format("expected HelloAck, the daemon sent message type {}", r.header.type)));
  }
  proto::HelloAck ack;
  std::memcpy(&ack, r.payload.data(), sizeof ack);
  if (ack.status != 0) {
    close_all();
    return wire_status(ack.status, ack.message, sizeof ack.message);
  }
  if (r.fds.size() != proto::kHelloFds || ack.shm_version != shm::kShmVersion ||
      ack.control_bytes < sizeof(shm::ShmControl) || ack.control_bytes > (size_t{1} << 30)) {
    close_all();
    return fail(data_loss(fmt::format("malformed HelloAck ({} fds, shm version {}, {} bytes)",
                              r.fds.size(), ack.shm_version,
                              static_cast<unsigned long long>(ack.control_bytes))));
  }
  int control_fd = r.fds[0];
  sub_efd_ = r.fds[1];
  comp_efd_ = r.fds[2];
  struct stat st{};
  if (::fstat(control_fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < ack.control_bytes) {
    int err = errno;
    ::close(control_fd);
    return fail(data_loss(fmt::format("control mapping is smaller than announced ({})", std::strerror(err))));
  }
  void* mapped = ::mmap(nullptr, ack.control_bytes, PROT_READ | PROT_WRITE,
                        MAP_SHARED | MAP_POPULATE, control_fd, 0);
  int err = errno;
  ::close(control_fd);
  if (mapped == MAP_FAILED) {
    SC_LOG_ERROR("mmap of the control mapping ({} bytes): {}",
                 static_cast<unsigned long long>(ack.control_bytes), std::strerror(err));
    return fail(errno_status("mmap control mapping", err));
  }
  ctl_ = static_cast<shm::ShmControl*>(mapped);
  ctl_bytes_ = ack.control_bytes;
  if (!shm::control_valid(*ctl_)) return fail(data_loss("control mapping has a bad header"));
  client_id_ = ack.client_id;
  SC_LOG_DEBUG("connected to {} as client {}", path, client_id_);
  return Status::Ok();
}

// ---- registration ------------------------------------------------------------------------------------

Expected<Tensor*> Client::Impl::register_tensor(std::string_view name, size_t count, DType dtype,
                                                const std::vector<uint64_t>& shape, const DeviceHandles* device) {
  if (!dead_.ok()) return dead_;
  if (name.empty() || name.size() > proto::kMaxNameLength || name.find('\0') != name.npos) {
    return invalid_argument(fmt::format("tensor name must be 1..{} bytes without NUL", proto::kMaxNameLength));
  }
  if (count == 0) return invalid_argument(fmt::format("tensor '{}' has 0 elements", name));
  if (dtype != DType::kF32) return invalid_argument("only fp32 tensors are supported");
  if (shape.size() > proto::kMaxShapeDims) {
    return invalid_argument(fmt::format("tensor '{}': shape {} has {} dims; at most {} are allowed",
                                   name, shape_string(shape), shape.size(), proto::kMaxShapeDims));
  }
  if (!shape.empty()) {
    uint64_t product = 1;
    bool overflow = false;
    for (uint64_t d : shape) overflow |= __builtin_mul_overflow(product, d, &product);
    if (overflow || product != count) {
      return invalid_argument(fmt::format("tensor '{}': shape {} does not hold {} elements",
                                     name, shape_string(shape), count));
    }
  }
  if (device != nullptr) {
    if (device->offset % sizeof(float) != 0) {
      return invalid_argument(fmt::format("tensor '{}': device offset {} is not a multiple of 4", name,
                                          static_cast<unsigned long long>(device->offset)));
    }
    if (count > (UINT64_MAX - device->offset) / sizeof(float)) {
      return invalid_argument(fmt::format("tensor '{}': {} elements at offset {} overflow", name, count,
                                          static_cast<unsigned long long>(device->offset)));
    }
  }
  for (auto& e : entries_) {
    if (e->tensor.name_ == name) {
      const bool same_place = device == nullptr ? !e->tensor.on_device_
                                                : e->tensor.on_device_ && e->tensor.handles_ == *device;
      if (e->tensor.count_ == count && e->tensor.shape_ == shape && same_place) return &e->tensor;
      if (e->tensor.on_device_ != (device != nullptr)) {
        return invalid_argument(fmt::format("tensor '{}' is already registered as a {} tensor, not a {} one",
                                            e->tensor.name_, e->tensor.on_device_ ? "device" : "host",
                                            device != nullptr ? "device" : "host"));
      }
      if (device != nullptr && e->tensor.count_ == count && e->tensor.shape_ == shape) {
        return invalid_argument(fmt::format("device tensor '{}' is already registered with other CUDA handles",
                                            e->tensor.name_));
      }
      return invalid_argument(fmt::format("tensor '{}' is already registered with {} elements and shape {}, not {} and {}",
                                  e->tensor.name_, e->tensor.count_, shape_string(e->tensor.shape_),
                                  count, shape_string(shape)));
    }
  }
  if (device != nullptr) {
    proto::RegisterDevice reg{};
    reg.count = count;
    reg.dtype = static_cast<uint32_t>(dtype);
    reg.ndim = static_cast<uint32_t>(shape.size());
    for (size_t i = 0; i < shape.size(); ++i) reg.dims[i] = shape[i];
    reg.offset = device->offset;
    std::memcpy(reg.device_uuid, device->device_uuid.data(), sizeof reg.device_uuid);
    std::memcpy(reg.mem_handle, device->mem_handle.data(), sizeof reg.mem_handle);
    std::memcpy(reg.ready_event, device->ready_event.data(), sizeof reg.ready_event);
    std::memcpy(reg.done_event, device->done_event.data(), sizeof reg.done_event);
    proto::set_field(reg.name, sizeof reg.name, name);
    SC_RETURN_IF_ERROR(send(proto::MsgType::kRegisterDevice, &reg));
  } else if (shape.empty()) {
    proto::Register reg{};  // the original message: unchanged bytes for trainers without shapes
    reg.count = count;
    reg.dtype = static_cast<uint32_t>(dtype);
    proto::set_field(reg.name, sizeof reg.name, name);
    SC_RETURN_IF_ERROR(send(proto::MsgType::kRegister, &reg));
  } else {
    proto::RegisterShaped reg{};
    reg.count = count;
    reg.dtype = static_cast<uint32_t>(dtype);
    reg.ndim = static_cast<uint32_t>(shape.size());
    for (size_t i = 0; i < shape.size(); ++i) reg.dims[i] = shape[i];
    proto::set_field(reg.name, sizeof reg.name, name);
    SC_RETURN_IF_ERROR(send(proto::MsgType::kRegisterShaped, &reg));
  }
  auto received = receive(Clock::now() + timeout_);
  if (!received.ok()) {
    // A lost reply leaves the socket out of step: the session cannot be used any more.
    return fail(received.status().with_context("registering tensor '" + std::string(name) + "'"));
  }
  Received& r = received.value();
  auto close_all = [&] {
    for (int& fd : r.fds) close_fd(fd);
  };
  if (static_cast<proto::MsgType>(r.header.type) != proto::MsgType::kRegisterAck) {
    close_all();
    return fail(data_loss(fmt::format("expected RegisterAck, the daemon sent message type {}", r.header.type)));
  }
  proto::RegisterAck ack;
  std::memcpy(&ack, r.payload.data(), sizeof ack);
  if (ack.status != 0) {
    close_all();
    return wire_status(ack.status, ack.message, sizeof ack.message);
  }
  if (device != nullptr) {
    // No slot: the daemon mapped the trainer's GPU memory.
    if (!r.fds.empty() || ack.count != count || ack.slot_bytes != 0 || by_id_.count(ack.tensor_id) != 0) {
      close_all();
      return fail(data_loss(fmt::format("malformed RegisterAck for device tensor '{}'", name)));
    }
    auto e = std::make_unique<Entry>();
    e->tensor.id_ = ack.tensor_id;
    e->tensor.name_ = std::string(name);
    e->tensor.count_ = count;
    e->tensor.shape_ = shape;
    e->tensor.on_device_ = true;
    e->tensor.handles_ = *device;
    Tensor* t = &e->tensor;
    by_id_.emplace(ack.tensor_id, e.get());
    entries_.push_back(std::move(e));
    return t;
  }
  size_t bytes = count * sizeof(float);
  if (r.fds.size() != 1 || ack.count != count || ack.slot_bytes < bytes ||
      by_id_.count(ack.tensor_id) != 0) {
    close_all();
    return fail(data_loss(fmt::format("malformed RegisterAck for '{}'", name)));
  }
  int fd = r.fds[0];
  struct stat st{};
  if (::fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) < bytes) {
    ::close(fd);
    return fail(data_loss("tensor slot is smaller than announced"));
  }
  void* addr = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  int err = errno;
  ::close(fd);
  if (addr == MAP_FAILED) {
    SC_LOG_ERROR("mmap of the slot of tensor '{}' ({} bytes): {}", name,
                 bytes, std::strerror(err));
    return errno_status("mmap tensor slot", err);
  }
  auto e = std::make_unique<Entry>();
  e->tensor.id_ = ack.tensor_id;
  e->tensor.name_ = std::string(name);
  e->tensor.count_ = count;
  e->tensor.shape_ = shape;
  e->tensor.data_ = static_cast<float*>(addr);
  e->addr = addr;
  e->bytes = bytes;
  Tensor* t = &e->tensor;
  by_id_.emplace(ack.tensor_id, e.get());
  entries_.push_back(std::move(e));
  return t;
}

// ---- steps -------------------------------------------------------------------------------------------

Client::Impl::Entry* Client::Impl::find(const Tensor& tensor) {
  auto it = by_id_.find(tensor.id_);
  if (it == by_id_.end() || &it->second->tensor != &tensor) return nullptr;
  return it->second;
}

Status Client::Impl::submit(const Tensor& tensor, uint64_t step, const SubmitOptions& options) {
  if (!dead_.ok()) return dead_;
  Entry* e = find(tensor);
  if (e == nullptr) return invalid_argument("tensor was not registered by this client");
  if (e->pending) {
    return failed_precondition(fmt::format("tensor '{}': step {} is still in flight; wait() for it first",
                                   tensor.name_, static_cast<unsigned long long>(*e->pending)));
  }
  if (!std::isfinite(options.lr) || options.lr < 0.0f) {
    return invalid_argument(fmt::format("learning rate {:g} is not a finite value >= 0", double(options.lr)));
  }
  if (outstanding_ >= shm::kRingSlots) {
    return would_block(fmt::format("{} steps are waiting for completion; wait() for some first", shm::kRingSlots));
  }
  shm::Submission s{};
  s.seq = ++seq_;
  s.step = step;
  s.tensor_id = tensor.id_;
  s.lr = options.lr;
  s.flags = shm::submission_flags(*ctl_, options.trainer_reduces, options.takes_lease);  // not to a daemon that would refuse it
  if (!shm::ring_push(ctl_->submissions, s)) return would_block("submission ring full");
  ++outstanding_;
  e->pending = step;
  e->trainer_reduces = (s.flags & shm::kSubmitTrainerReduces) != 0;
  e->takes_lease = (s.flags & shm::kSubmitTakesLease) != 0;
  e->done.reset();
  uint64_t one = 1;
  if (::write(sub_efd_, &one, sizeof one) < 0 && errno != EAGAIN) {
    return fail(errno_status("signalling the submission eventfd", errno));
  }
  return Status::Ok();
}

Status Client::Impl::drain_completions() {
  for (;;) {
    shm::Completion c;
    bool corrupt = false;
    if (!shm::ring_pop(ctl_->completions, &c, &corrupt)) {
      if (corrupt) return fail(data_loss("corrupt completion ring (head too far ahead of tail)"));
      return Status::Ok();
    }
    if (outstanding_ > 0) --outstanding_;
    auto it = by_id_.find(c.tensor_id);
    if (it == by_id_.end() || !it->second->pending || *it->second->pending != c.step) {
      SC_LOG_WARN("dropping a completion for tensor {} step {} that was not submitted",
                  c.tensor_id, static_cast<unsigned long long>(c.step));
      continue;
    }
    it->second->done = c;
  }
}

Status Client::Impl::handle_socket_readable() {
  // The daemon only writes to the socket unprompted to say why it closes it.
  auto r = receive(Clock::now() + milliseconds(1000));
  if (!r.ok()) return fail(r.status());
  for (int& fd : r->fds) close_fd(fd);
  return fail(data_loss(fmt::format("unexpected message type {} from the daemon", r->header.type)));
}

Expected<StepInfo> Client::Impl::wait(const Tensor& tensor, uint64_t step, milliseconds timeout) {
  Entry* e = find(tensor);
  if (e == nullptr) return invalid_argument("tensor was not registered by this client");
  if (!e->pending || *e->pending != step) {
    return failed_precondition(fmt::format("tensor '{}': step {} was not submitted", tensor.name_,
                                   static_cast<unsigned long long>(step)));
  }
  const auto deadline = Clock::now() + timeout;
  for (;;) {
    // Completions already pushed count even when the daemon is gone since.
    Status st = drain_completions();
    if (e->done) {
      shm::Completion c = *e->done;
      e->done.reset();
      e->pending.reset();
      if (c.code != 0) return wire_status(c.code, c.message, sizeof c.message);
      const bool reduces = (c.flags & shm::kCompletionTrainerReduces) != 0;
      if ((c.flags & ~shm::kCompletionTrainerReduces) != 0 || (reduces && !e->trainer_reduces) ||
          (c.lease_steps != 0 && !(reduces && e->takes_lease))) {
        return fail(data_loss(fmt::format("tensor '{}': step {}: completion flags {:#x} (lease {}) were not asked for",
                                          tensor.name_, static_cast<unsigned long long>(step), c.flags, c.lease_steps)));
      }
      return StepInfo{c.step, c.bytes_sent, c.dense_bytes, c.nnz, reduces, c.lease_steps};
    }
    if (!st.ok()) return st;
    if (!dead_.ok()) return dead_;
    int left = ms_left(deadline);
    if (left == 0) {
      return deadline_exceeded(fmt::format("tensor '{}': step {} not completed within {} ms",
                                   tensor.name_, static_cast<unsigned long long>(step),
                                   static_cast<long long>(timeout.count())));
    }
    pollfd p[2] = {{comp_efd_, POLLIN, 0}, {sock_, POLLIN, 0}};
    int n = ::poll(p, 2, left);
    if (n < 0) {
      if (errno == EINTR) continue;
      return fail(errno_status("poll on the completion eventfd", errno));
    }
    if (p[0].revents & POLLIN) {
      uint64_t v;
      if (::read(comp_efd_, &v, sizeof v) < 0 && errno != EAGAIN) {
        return fail(errno_status("reading the completion eventfd", errno));
      }
    }
    if (p[1].revents & (POLLIN | POLLHUP | POLLERR)) {
      drain_completions().ignore();
      if (e->done) continue;  // delivered just before the daemon went away
      return handle_socket_readable();
    }
  }
}

bool Client::Impl::await_activity(milliseconds timeout) {
  // Reads only the descriptors (set before the client is handed out, closed after it is gone).
  if (comp_efd_ < 0 || sock_ < 0) return false;
  pollfd p[2] = {{comp_efd_, POLLIN, 0}, {sock_, POLLIN, 0}};
  const int ms = static_cast<int>(std::clamp<int64_t>(timeout.count(), 0, INT32_MAX));
  if (::poll(p, 2, ms) <= 0) return false;  // timeout or EINTR: the caller's wait() looks anyway
  if (p[0].revents & POLLIN) {
    uint64_t v;
    // The doorbell is non-blocking (EFD_NONBLOCK): another thread that read it first leaves EAGAIN.
    if (::read(comp_efd_, &v, sizeof v) < 0) {
      // Nothing to do: the completions are in the ring either way, and wait() drains it.
    }
  }
  return (p[1].revents & (POLLIN | POLLHUP | POLLERR)) != 0;
}

Status Client::Impl::report_metric(std::string_view name, double value, uint64_t step) {
  if (!dead_.ok()) return dead_;
  if (name.empty() || name.size() > proto::kMaxNameLength || name.find('\0') != name.npos) {
    return invalid_argument(fmt::format("metric name must be 1..{} bytes without NUL", proto::kMaxNameLength));
  }
  proto::Metric m{};
  m.value = value;
  m.step = step;
  proto::set_field(m.name, sizeof m.name, name);
  return send(proto::MsgType::kMetric, &m);
}

// ---- public face ---------------------------------------------------------------------------------

Expected<std::unique_ptr<Client>> Client::connect(const std::string& socket_path,
                                                  const ConnectOptions& options) {
  auto impl = std::make_unique<Impl>();
  SC_RETURN_IF_ERROR(impl->connect(socket_path, options));
  return std::unique_ptr<Client>(new Client(std::move(impl)));
}

Client::Client(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Client::~Client() = default;

Expected<Tensor*> Client::register_tensor(std::string_view name, size_t count, DType dtype) {
  return impl_->register_tensor(name, count, dtype, {});
}
Expected<Tensor*> Client::register_tensor(std::string_view name, size_t count, DType dtype,
                                          const std::vector<uint64_t>& shape) {
  return impl_->register_tensor(name, count, dtype, shape);
}
Expected<Tensor*> Client::register_device_tensor(std::string_view name, size_t count, const DeviceHandles& handles,
                                                 std::span<const uint64_t> shape) {
  return impl_->register_tensor(name, count, DType::kF32, std::vector<uint64_t>(shape.begin(), shape.end()),
                                &handles);
}
Status Client::submit(const Tensor& tensor, uint64_t step, const SubmitOptions& options) {
  return impl_->submit(tensor, step, options);
}
Expected<StepInfo> Client::wait(const Tensor& tensor, uint64_t step, std::chrono::milliseconds timeout) {
  return impl_->wait(tensor, step, timeout);
}

bool Client::in_flight(const Tensor& tensor, uint64_t step) { return impl_->in_flight(tensor, step); }
bool Client::await_activity(std::chrono::milliseconds timeout) { return impl_->await_activity(timeout); }
Status Client::report_metric(std::string_view name, double value, uint64_t step) {
  return impl_->report_metric(name, value, step);
}

}  // namespace sparsecar
