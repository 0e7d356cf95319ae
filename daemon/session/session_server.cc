// SessionServer: see session_server.h. Everything but complete()/stats() runs on the session
// thread, so the per-client and per-tensor state below needs no locks.
#include "daemon/session/session_server.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <new>
#include <string>
#include <system_error>
#include <thread>
#include <unordered_map>
#include <vector>

#include "daemon/session/frames.h"
#include "sparsecar/common/large_vector.h"
#include "sparsecar/common/fd.h"
#include "sparsecar/common/log.h"
#include "sparsecar/common/session_protocol.h"
#include "sparsecar/common/shm_layout.h"

namespace sparsecar {
namespace {

using Clock = std::chrono::steady_clock;
constexpr int kPollTimeoutMs = 100;


// A shared mapping of a sealed memfd. The fd is kept only until it has been sent.
struct Mapping {
  int fd = -1;
  void* addr = nullptr;
  size_t bytes = 0;

  Mapping() = default;
  Mapping(const Mapping&) = delete;
  Mapping& operator=(const Mapping&) = delete;
  Mapping(Mapping&& o) noexcept : fd(o.fd), addr(o.addr), bytes(o.bytes) {
    o.fd = -1;
    o.addr = nullptr;
    o.bytes = 0;
  }
  Mapping& operator=(Mapping&& o) noexcept {
    if (this != &o) {
      reset();
      std::swap(fd, o.fd);
      std::swap(addr, o.addr);
      std::swap(bytes, o.bytes);
    }
    return *this;
  }
  ~Mapping() { reset(); }
  void close_fd() {
    if (fd >= 0) ::close(fd);
    fd = -1;
  }
  void reset() {
    close_fd();
    if (addr != nullptr) ::munmap(addr, bytes);
    addr = nullptr;
    bytes = 0;
  }
};

// memfd_create + ftruncate + seals (the client must not shrink it under our mapping) + a
// pre-faulted shared mapping.
Expected<Mapping> make_shared_memfd(const std::string& name, size_t bytes) {
  Mapping m;
  m.fd = ::memfd_create(name.c_str(), MFD_CLOEXEC | MFD_ALLOW_SEALING);
  if (m.fd < 0) {
    int err = errno;
    SC_LOG_ERROR("memfd_create(%s): %s", name.c_str(), std::strerror(err));
    return errno_status("memfd_create " + name, err);
  }
  if (::ftruncate(m.fd, static_cast<off_t>(bytes)) != 0) {
    int err = errno;
    SC_LOG_ERROR("ftruncate(%s, %zu): %s", name.c_str(), bytes, std::strerror(err));
    return errno_status("ftruncate " + name, err);
  }
  if (::fcntl(m.fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) != 0) {
    int err = errno;
    SC_LOG_ERROR("F_ADD_SEALS(%s): %s", name.c_str(), std::strerror(err));
    return errno_status("sealing " + name, err);
  }
  void* addr = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, m.fd, 0);
  if (addr == MAP_FAILED) {
    int err = errno;
    SC_LOG_ERROR("mmap(%s, %zu): %s", name.c_str(), bytes, std::strerror(err));
    return errno_status("mmap " + name, err);
  }
  m.addr = addr;
  m.bytes = bytes;
  return m;
}

struct Conn {
  enum class State { kAwaitHello, kReady };
  uint32_t id = 0;
  Fd sock;
  pid_t peer_pid = 0;
  uid_t peer_uid = 0;
  State state = State::kAwaitHello;
  Clock::time_point accepted;
  std::array<uint8_t, 2 * proto::kMaxMessageBytes> in{};
  size_t in_used = 0;
  Mapping control;
  shm::ShmControl* ctl = nullptr;
  Fd sub_efd;
  Fd comp_efd;
  std::map<uint32_t, Mapping> slots;  // tensor id -> this client's slot
  bool more_submissions = false;      // ring not drained last round
  bool drop = false;
  std::string drop_reason;

  std::string label() const { return strfmt("client %u (pid %d)", id, static_cast<int>(peer_pid)); }
};

struct TensorState {
  uint32_t id = 0;
  std::string name;
  uint64_t count = 0;
  std::vector<uint64_t> shape;  // empty: registered without a shape
  LargeVector<float> local_sum;  // huge-page backed: the pipeline streams over it
  LargeVector<float> result;     // the decoders scatter into it
  bool has_last = false;
  uint64_t last_step = 0;  // last step handed to the pipeline
  // Being collected from the local clients.
  bool collecting = false;
  uint64_t collect_step = 0;
  std::vector<std::pair<uint32_t, float>> submitters;  // client id, lr
  // Handed to the pipeline.
  bool in_flight = false;
  uint64_t flight_step = 0;
  std::vector<uint32_t> participants;
  uint64_t flight_generation = 0;  // generation_ when it was handed over (orphans are matched by it)
  // Charged to the tensor memory budget: local_sum + result + the pipeline's buffers.
  uint64_t bytes = 0;
  // Newest step failed job-wide through StepSink::fail_step (no duplicates).
  bool failed_job_wide = false;
  uint64_t failed_step = 0;
};

struct Counters {
  std::atomic<uint64_t> clients_accepted{0}, clients_rejected{0}, clients_disconnected{0},
      protocol_errors{0}, registrations{0}, registrations_rejected{0}, submissions{0},
      submissions_rejected{0}, steps_dispatched{0}, steps_completed{0}, steps_failed{0},
      stale_results{0}, metrics{0}, registrations_over_budget{0}, handshakes_evicted{0},
      steps_failed_job_wide{0}, tensor_bytes_in_use{0}, orphaned_tensors{0};
};

// A shm slot as the kernel allocates it (whole pages).
uint64_t slot_footprint(uint64_t count) {
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  return (count * sizeof(float) + page - 1) / page * page;
}

std::string mib(uint64_t bytes) { return strfmt("%.1f MiB", static_cast<double>(bytes) / (1 << 20)); }

void bump(std::atomic<uint64_t>& c) { c.fetch_add(1, std::memory_order_relaxed); }

}  // namespace

class SessionServer::Impl {
 public:
  Impl(SessionServerOptions options, StepSink* pipeline)
      : options_(std::move(options)), pipeline_(pipeline) {}
  ~Impl() { stop(); }

  Status start();
  void stop();
  void complete(const StepResult& result);
  uint32_t connected_clients() const { return ready_clients_.load(std::memory_order_relaxed); }
  SessionStats stats() const;

 private:
  void run();
  void accept_clients();
  void read_socket(Conn& c);
  void handle_message(Conn& c, const proto::MsgHeader& h, const uint8_t* payload);
  void handle_hello(Conn& c, const proto::Hello& m);
  void handle_register(Conn& c, const RegisterRequest& m);
  void handle_metric(Conn& c, const proto::Metric& m);
  void drain_submissions(Conn& c);
  void handle_submission(Conn& c, const shm::Submission& s);
  void dispatch(TensorState& t);
  void process_results();
  void push_completion(Conn& c, uint32_t tensor_id, uint64_t step, const Status& st,
                       const StepResult* info = nullptr);
  void fail_collecting(TensorState& t, const Status& st, uint32_t except_client);
  void protocol_error(Conn& c, const std::string& what);
  void reject_hello(Conn& c, const Status& st);
  bool send_msg(Conn& c, proto::MsgType type, const void* payload, const int* fds, size_t nfds);
  void mark_drop(Conn& c, std::string reason);
  void sweep();
  void free_conn(Conn& c);
  void reset_job();
  Conn* find_conn(uint32_t id);
  // Budget accounting (session thread; the atomic is for stats()).
  void charge(uint64_t bytes) { bytes_in_use_ += bytes; counters_.tensor_bytes_in_use.store(bytes_in_use_); }
  void release(uint64_t bytes) {
    bytes_in_use_ -= std::min(bytes, bytes_in_use_);
    counters_.tensor_bytes_in_use.store(bytes_in_use_);
  }
  // Tells the pipeline this node will never hand over (t, step); once per (tensor, step).
  void fail_job_wide(TensorState& t, uint64_t step, const std::string& reason);
  // A ready client died: fail job-wide what this node now owes its peers (see the header).
  void fail_owed_steps(const Conn& dead, const std::string& why);
  void free_orphan(size_t index);

  SessionServerOptions options_;
  StepSink* pipeline_;
  Fd listen_fd_;
  Fd wake_efd_;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  bool stopped_ = false;
  std::mutex stop_mu_;

  std::mutex results_mu_;
  std::deque<StepResult> results_;  // guarded by results_mu_

  // Session thread only.
  std::map<uint32_t, std::unique_ptr<Conn>> conns_;  // by client id: the local-sum order
  uint32_t next_client_id_ = 1;
  std::vector<std::unique_ptr<TensorState>> tensors_;  // by tensor id
  std::unordered_map<std::string, uint32_t> tensor_ids_;
  std::vector<std::unique_ptr<TensorState>> orphans_;  // in flight when the job was reset
  uint64_t budget_ = 0;        // tensor_memory_budget_bytes resolved
  uint64_t bytes_in_use_ = 0;  // charged to the budget
  uint64_t generation_ = 0;  // bumped by every job reset; stamped on StepJobs
  // Set when a local client left while others stay: steps fail at once until L are back.
  std::string lost_client_;
  std::vector<pollfd> pollfds_;
  std::vector<uint32_t> poll_owner_;  // client id per pollfd (0: not a client)
  std::vector<const float*> sum_inputs_;
  std::deque<StepResult> taken_;

  std::atomic<uint32_t> ready_clients_{0};
  Counters counters_;
};

// ---- start / stop ------------------------------------------------------------------------------

Status SessionServer::Impl::start() {
  const std::string& path = options_.socket_path;
  sockaddr_un addr{};
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return invalid_argument(strfmt("socket path '%s' is empty or longer than %zu bytes",
                                path.c_str(), sizeof(addr.sun_path) - 1));
  }
  if (options_.local_clients == 0) return invalid_argument("local_clients must be at least 1");
  if (pipeline_ == nullptr) return invalid_argument("no pipeline given to the session server");
  if (options_.max_handshakes_per_uid == 0) return invalid_argument("max_handshakes_per_uid must be at least 1");
  budget_ = options_.tensor_memory_budget_bytes != 0 ? options_.tensor_memory_budget_bytes
                                                     : default_tensor_memory_budget();
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  auto* sa = reinterpret_cast<sockaddr*>(&addr);

  struct stat st{};
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return failed_precondition(strfmt("'%s' exists and is not a socket", path.c_str()));
    }
    Fd probe(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (probe.get() < 0) return errno_status("socket", errno);
    if (::connect(probe.get(), sa, sizeof addr) == 0) {
      return Status(Code::kAlreadyExists,
                    strfmt("another daemon is listening on '%s'", path.c_str()));
    }
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
      return errno_status("removing stale socket " + path, errno);
    }
    SC_LOG_INFO("removed stale socket %s", path.c_str());
  }

  listen_fd_.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (listen_fd_.get() < 0) return errno_status("socket(AF_UNIX)", errno);
  if (::bind(listen_fd_.get(), sa, sizeof addr) != 0) {
    int err = errno;
    SC_LOG_ERROR("bind(%s): %s", path.c_str(), std::strerror(err));
    return errno_status("bind " + path, err);
  }
  if (::chmod(path.c_str(), 0660) != 0) {
    int err = errno;
    SC_LOG_ERROR("chmod(%s): %s", path.c_str(), std::strerror(err));
    ::unlink(path.c_str());
    return errno_status("chmod " + path, err);
  }
  if (::listen(listen_fd_.get(), 64) != 0) {
    int err = errno;
    ::unlink(path.c_str());
    return errno_status("listen " + path, err);
  }
  wake_efd_.reset(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (wake_efd_.get() < 0) {
    int err = errno;
    ::unlink(path.c_str());
    return errno_status("eventfd", err);
  }
  try {
    thread_ = std::thread([this] { run(); });
  } catch (const std::system_error& e) {
    ::unlink(path.c_str());
    return internal_error(std::string("starting the session thread: ") + e.what());
  }
  SC_LOG_INFO("session server listening on %s (%u local clients)", path.c_str(),
              options_.local_clients);
  return Status::Ok();
}

void SessionServer::Impl::stop() {
  std::lock_guard<std::mutex> lock(stop_mu_);
  if (stopped_) return;
  stopped_ = true;
  stopping_.store(true);
  if (thread_.joinable()) {
    uint64_t one = 1;
    if (::write(wake_efd_.get(), &one, sizeof one) < 0 && errno != EAGAIN) {
      SC_LOG_WARN("waking the session thread: %s", std::strerror(errno));
    }
    thread_.join();
  }
}

void SessionServer::Impl::complete(const StepResult& result) {
  {
    std::lock_guard<std::mutex> lock(results_mu_);
    results_.push_back(result);
  }
  uint64_t one = 1;
  if (::write(wake_efd_.get(), &one, sizeof one) < 0 && errno != EAGAIN) {
    SC_LOG_ERROR("waking the session thread for a step result: %s", std::strerror(errno));
  }
}

SessionStats SessionServer::Impl::stats() const {
  auto r = [](const std::atomic<uint64_t>& a) { return a.load(std::memory_order_relaxed); };
  SessionStats s;
  s.clients_accepted = r(counters_.clients_accepted);
  s.clients_rejected = r(counters_.clients_rejected);
  s.clients_disconnected = r(counters_.clients_disconnected);
  s.protocol_errors = r(counters_.protocol_errors);
  s.registrations = r(counters_.registrations);
  s.registrations_rejected = r(counters_.registrations_rejected);
  s.submissions = r(counters_.submissions);
  s.submissions_rejected = r(counters_.submissions_rejected);
  s.steps_dispatched = r(counters_.steps_dispatched);
  s.steps_completed = r(counters_.steps_completed);
  s.steps_failed = r(counters_.steps_failed);
  s.stale_results = r(counters_.stale_results);
  s.metrics = r(counters_.metrics);
  s.registrations_over_budget = r(counters_.registrations_over_budget);
  s.handshakes_evicted = r(counters_.handshakes_evicted);
  s.steps_failed_job_wide = r(counters_.steps_failed_job_wide);
  s.tensor_bytes_in_use = r(counters_.tensor_bytes_in_use);
  s.orphaned_tensors = r(counters_.orphaned_tensors);
  s.tensor_memory_budget = budget_;
  return s;
}

// ---- the session thread --------------------------------------------------------------------------

void SessionServer::Impl::run() {
  while (!stopping_.load()) {
    pollfds_.clear();
    poll_owner_.clear();
    pollfds_.push_back({wake_efd_.get(), POLLIN, 0});
    poll_owner_.push_back(0);
    pollfds_.push_back({listen_fd_.get(), POLLIN, 0});
    poll_owner_.push_back(0);
    bool busy = false;
    for (auto& [id, c] : conns_) {
      pollfds_.push_back({c->sock.get(), POLLIN, 0});
      poll_owner_.push_back(id);
      if (c->state == Conn::State::kReady) {
        pollfds_.push_back({c->sub_efd.get(), POLLIN, 0});
        poll_owner_.push_back(id);
        busy = busy || c->more_submissions;
      }
    }
    int n = ::poll(pollfds_.data(), pollfds_.size(), busy ? 0 : kPollTimeoutMs);
    if (n < 0) {
      if (errno == EINTR) continue;
      SC_LOG_ERROR("session thread: poll: %s; the session server stops", std::strerror(errno));
      break;
    }
    if (pollfds_[0].revents & POLLIN) {
      uint64_t v;
      if (::read(wake_efd_.get(), &v, sizeof v) < 0 && errno != EAGAIN) {
        SC_LOG_ERROR("reading the wake eventfd: %s", std::strerror(errno));
      }
    }
    process_results();
    if (pollfds_[1].revents & POLLIN) accept_clients();
    for (size_t i = 2; i < pollfds_.size(); ++i) {
      Conn* c = find_conn(poll_owner_[i]);
      if (c == nullptr || c->drop) continue;
      short ev = pollfds_[i].revents;
      if (pollfds_[i].fd == c->sock.get()) {
        if (ev & (POLLIN | POLLHUP | POLLERR | POLLNVAL)) read_socket(*c);
      } else if ((ev & POLLIN) || c->more_submissions) {
        drain_submissions(*c);
      }
    }
    sweep();
  }
  for (auto& [id, c] : conns_) {
    if (c->drop) continue;
    // Tell the client why before closing, so its wait() reports more than a closed socket.
    proto::Error e{};
    e.status = static_cast<int32_t>(Code::kUnavailable);
    proto::set_field(e.message, sizeof e.message, "the daemon is shutting down");
    if (send_msg(*c, proto::MsgType::kError, &e, nullptr, 0)) mark_drop(*c, "the daemon is shutting down");
  }
  sweep();
  process_results();
  listen_fd_.reset();
  if (::unlink(options_.socket_path.c_str()) != 0 && errno != ENOENT) {
    SC_LOG_WARN("removing %s: %s", options_.socket_path.c_str(), std::strerror(errno));
  }
}

Conn* SessionServer::Impl::find_conn(uint32_t id) {
  auto it = conns_.find(id);
  return it == conns_.end() ? nullptr : it->second.get();
}

void SessionServer::Impl::accept_clients() {
  for (int i = 0; i < 64; ++i) {
    int fd = ::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EAGAIN || errno == EINTR || errno == ECONNABORTED) return;
      SC_LOG_WARN("accept on %s: %s", options_.socket_path.c_str(), std::strerror(errno));
      return;
    }
    Fd sock(fd);
    ucred cred{};
    socklen_t len = sizeof cred;
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      SC_LOG_WARN("SO_PEERCRED: %s; closing the connection", std::strerror(errno));
      bump(counters_.clients_rejected);
      continue;
    }
    // Silent connections of this uid may not pile up: the oldest one waiting for its handshake
    // gives way to the new one (a real trainer says Hello at once).
    Conn* oldest = nullptr;
    uint32_t waiting = 0;
    for (auto& [cid, other] : conns_) {
      if (other->drop || other->state != Conn::State::kAwaitHello || other->peer_uid != cred.uid) continue;
      ++waiting;
      if (oldest == nullptr) oldest = other.get();  // ids grow with accept order
    }
    if (waiting >= options_.max_handshakes_per_uid && oldest != nullptr) {
      bump(counters_.clients_rejected);
      bump(counters_.handshakes_evicted);
      SC_LOG_WARN("connection %u (pid %d, uid %u) closed: %u connections of uid %u wait for their handshake "
                  "(at most %u)", oldest->id, static_cast<int>(oldest->peer_pid), static_cast<unsigned>(cred.uid),
                  waiting, static_cast<unsigned>(cred.uid), options_.max_handshakes_per_uid);
      mark_drop(*oldest, "no Hello while newer connections of its uid arrived");
      ::shutdown(oldest->sock.get(), SHUT_RDWR);
    }
    size_t open = 0;
    for (auto& [cid, other] : conns_) open += other->drop ? 0 : 1;
    if (open >= options_.local_clients + kMaxPendingConnections) {
      bump(counters_.clients_rejected);
      SC_LOG_WARN("refusing a connection of uid %u: %zu connections open already",
                  static_cast<unsigned>(cred.uid), open);
      continue;
    }
    auto c = std::make_unique<Conn>();
    c->id = next_client_id_++;
    c->sock = std::move(sock);
    c->peer_pid = cred.pid;
    c->peer_uid = cred.uid;
    c->accepted = Clock::now();
    SC_LOG_DEBUG("connection %u from pid %d uid %u", c->id, static_cast<int>(cred.pid),
                 static_cast<unsigned>(cred.uid));
    conns_.emplace(c->id, std::move(c));
  }
}

void SessionServer::Impl::read_socket(Conn& c) {
  if (c.in_used >= c.in.size()) {  // cannot happen: complete messages are consumed below
    protocol_error(c, "input buffer full");
    return;
  }
  iovec iov{c.in.data() + c.in_used, c.in.size() - c.in_used};
  alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int) * 8)];
  msghdr msg{};
  msg.msg_iov = &iov;
  msg.msg_iovlen = 1;
  msg.msg_control = cbuf;
  msg.msg_controllen = sizeof cbuf;
  ssize_t n = ::recvmsg(c.sock.get(), &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
  if (n < 0) {
    if (errno == EAGAIN || errno == EINTR) return;
    mark_drop(c, strfmt("socket error: %s", std::strerror(errno)));
    return;
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
  if (stray_fds || (msg.msg_flags & MSG_CTRUNC)) {
    protocol_error(c, "client sent file descriptors");
    return;
  }
  if (n == 0) {
    mark_drop(c, "closed the connection");
    return;
  }
  c.in_used += static_cast<size_t>(n);
  size_t off = 0;
  while (!c.drop) {
    FrameScan f = scan_frame(std::span<const uint8_t>(c.in.data() + off, c.in_used - off));
    if (f.kind == FrameScan::Kind::kMalformed) {
      protocol_error(c, f.error);
      return;
    }
    if (f.kind == FrameScan::Kind::kIncomplete) break;
    handle_message(c, f.header, f.payload.data());
    off += f.bytes();
  }
  if (off > 0 && !c.drop) {
    std::memmove(c.in.data(), c.in.data() + off, c.in_used - off);
    c.in_used -= off;
  }
}

void SessionServer::Impl::handle_message(Conn& c, const proto::MsgHeader& h,
                                         const uint8_t* payload) {
  auto type = static_cast<proto::MsgType>(h.type);
  if (c.state == Conn::State::kAwaitHello) {
    if (type != proto::MsgType::kHello) {
      protocol_error(c, "first message is not Hello");
      return;
    }
    proto::Hello m;
    std::memcpy(&m, payload, sizeof m);
    handle_hello(c, m);
    return;
  }
  switch (type) {
    case proto::MsgType::kRegister:
      handle_register(c, decode_register(payload));
      return;
    case proto::MsgType::kRegisterShaped:
      handle_register(c, decode_register_shaped(payload));
      return;
    case proto::MsgType::kMetric: {
      proto::Metric m;
      std::memcpy(&m, payload, sizeof m);
      handle_metric(c, m);
      return;
    }
    default:
      protocol_error(c, strfmt("unexpected message type %u", static_cast<unsigned>(h.type)));
  }
}

bool SessionServer::Impl::send_msg(Conn& c, proto::MsgType type, const void* payload,
                                   const int* fds, size_t nfds) {
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
    SC_CHECK(nfds <= proto::kHelloFds, "too many fds (%zu) for one message", nfds);
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
    n = ::sendmsg(c.sock.get(), &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
  } while (n < 0 && errno == EINTR);
  if (n != static_cast<ssize_t>(iov.iov_len)) {
    // A client that does not read its socket is broken; a partial message cannot be resumed.
    mark_drop(c, n < 0 ? strfmt("send failed: %s", std::strerror(errno))
                       : std::string("send buffer full (client does not read its socket)"));
    return false;
  }
  return true;
}

void SessionServer::Impl::protocol_error(Conn& c, const std::string& what) {
  bump(counters_.protocol_errors);
  SC_LOG_WARN("%s: protocol error: %s; closing the session", c.label().c_str(), what.c_str());
  proto::Error e{};
  e.status = static_cast<int32_t>(Code::kDataLoss);
  proto::set_field(e.message, sizeof e.message, "protocol error: " + what);
  send_msg(c, proto::MsgType::kError, &e, nullptr, 0);
  mark_drop(c, "protocol error: " + what);
}

void SessionServer::Impl::reject_hello(Conn& c, const Status& st) {
  bump(counters_.clients_rejected);
  SC_LOG_WARN("%s (uid %u) refused: %s", c.label().c_str(), static_cast<unsigned>(c.peer_uid),
              st.message().c_str());
  proto::HelloAck ack{};
  ack.status = static_cast<int32_t>(st.code());
  ack.shm_version = shm::kShmVersion;
  proto::set_field(ack.message, sizeof ack.message, st.message());
  send_msg(c, proto::MsgType::kHelloAck, &ack, nullptr, 0);
  mark_drop(c, "refused: " + st.message());
}

void SessionServer::Impl::handle_hello(Conn& c, const proto::Hello& m) {
  if (m.version != proto::kProtocolVersion || m.shm_version != shm::kShmVersion) {
    reject_hello(c, failed_precondition(strfmt(
                        "client speaks protocol %u / shm %u; the daemon speaks %u / %u",
                        m.version, m.shm_version, proto::kProtocolVersion, shm::kShmVersion)));
    return;
  }
  if (m.flags != 0) {
    reject_hello(c, invalid_argument(strfmt("unknown Hello flags 0x%x", m.flags)));
    return;
  }
  uid_t self = ::geteuid();
  if (c.peer_uid != self && c.peer_uid != 0) {
    reject_hello(c, permission_denied(strfmt("uid %u may not open a session (the daemon runs as uid %u)",
                                          static_cast<unsigned>(c.peer_uid),
                                          static_cast<unsigned>(self))));
    return;
  }
  if (ready_clients_.load() >= options_.local_clients) {
    reject_hello(c, resource_exhausted(strfmt("the daemon already serves its %u local clients",
                                           options_.local_clients)));
    return;
  }
  auto control = make_shared_memfd(strfmt("sparsecar-c%u-control", c.id), shm::kControlBytes);
  if (!control.ok()) {
    reject_hello(c, control.status().with_context("creating the control mapping"));
    return;
  }
  Fd sub(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  Fd comp(::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC));
  if (sub.get() < 0 || comp.get() < 0) {
    int err = errno;
    SC_LOG_ERROR("eventfd for %s: %s", c.label().c_str(), std::strerror(err));
    reject_hello(c, errno_status("eventfd", err));
    return;
  }
  c.control = std::move(control).value();
  c.ctl = shm::init_control(c.control.addr);
  c.sub_efd = std::move(sub);
  c.comp_efd = std::move(comp);
  proto::HelloAck ack{};
  ack.status = 0;
  ack.client_id = c.id;
  ack.local_clients = options_.local_clients;
  ack.shm_version = shm::kShmVersion;
  ack.control_bytes = c.control.bytes;
  proto::set_field(ack.message, sizeof ack.message, "");
  int fds[proto::kHelloFds] = {c.control.fd, c.sub_efd.get(), c.comp_efd.get()};
  if (!send_msg(c, proto::MsgType::kHelloAck, &ack, fds, proto::kHelloFds)) return;
  c.control.close_fd();
  c.state = Conn::State::kReady;
  if (ready_clients_.fetch_add(1) + 1 == options_.local_clients && !lost_client_.empty()) {
    SC_LOG_INFO("%s replaces %s", c.label().c_str(), lost_client_.c_str());
    lost_client_.clear();
  }
  bump(counters_.clients_accepted);
  SC_LOG_INFO("%s connected (uid %u, %u of %u local clients)", c.label().c_str(),
              static_cast<unsigned>(c.peer_uid), ready_clients_.load(), options_.local_clients);
}

void SessionServer::Impl::handle_register(Conn& c, const RegisterRequest& m) {
  proto::RegisterAck ack{};
  auto reject = [&](const Status& st) {
    bump(counters_.registrations_rejected);
    SC_LOG_WARN("%s: registration refused: %s", c.label().c_str(), st.message().c_str());
    ack.status = static_cast<int32_t>(st.code());
    proto::set_field(ack.message, sizeof ack.message, st.message());
    send_msg(c, proto::MsgType::kRegisterAck, &ack, nullptr, 0);
  };
  auto name_field = proto::field_string(m.name, proto::kNameBytes);
  if (!name_field) {
    reject(invalid_argument("tensor name is not NUL-terminated within 256 bytes"));
    return;
  }
  std::string name(*name_field);
  if (name.empty()) return reject(invalid_argument("tensor name is empty"));
  if (!m.malformed.empty()) {
    return reject(invalid_argument(strfmt("tensor '%s': %s", name.c_str(), m.malformed.c_str())));
  }
  if (m.dtype != 0) {
    return reject(invalid_argument(strfmt("tensor '%s': unsupported dtype %u (only fp32 = 0)",
                                       name.c_str(), m.dtype)));
  }
  if (m.count == 0) return reject(invalid_argument(strfmt("tensor '%s' has 0 elements", name.c_str())));
  if (m.count > options_.max_tensor_elements || m.count > SIZE_MAX / sizeof(float)) {
    return reject(resource_exhausted(
        strfmt("tensor '%s' has %llu elements; the daemon allows at most %llu", name.c_str(),
            static_cast<unsigned long long>(m.count),
            static_cast<unsigned long long>(options_.max_tensor_elements))));
  }
  if (Status st = check_shape(m.count, m.shape); !st.ok()) {
    return reject(st.with_context(strfmt("tensor '%s'", name.c_str())));
  }
  // Charged before anything is allocated; over the budget is kResourceExhausted, not an OOM kill.
  const uint64_t slot_bytes = slot_footprint(m.count);
  auto over_budget = [&](uint64_t tensor_bytes, uint64_t pipeline_bytes) -> Status {
    const uint64_t need = slot_bytes + tensor_bytes + pipeline_bytes;
    if (need <= budget_ && bytes_in_use_ <= budget_ - need) return Status::Ok();
    bump(counters_.registrations_over_budget);
    size_t slots = 0;
    for (const auto& [cid, other] : conns_) slots += other->slots.size();
    // Most telling first: the client's message field is short (the log line has all of it).
    return resource_exhausted(strfmt(
        "tensor_memory_budget_bytes = %llu exceeded: tensor '%s' (%llu elements) needs %llu bytes, %llu are in "
        "use (%zu tensors, %zu slots); needs = shm slot %s + session %s + pipeline %s",
        static_cast<unsigned long long>(budget_), name.c_str(), static_cast<unsigned long long>(m.count),
        static_cast<unsigned long long>(need), static_cast<unsigned long long>(bytes_in_use_),
        tensors_.size() + orphans_.size(), slots, mib(slot_bytes).c_str(), mib(tensor_bytes).c_str(),
        mib(pipeline_bytes).c_str()));
  };
  TensorState* t = nullptr;
  if (auto it = tensor_ids_.find(name); it != tensor_ids_.end()) {
    t = tensors_[it->second].get();
    if (t->count != m.count) {
      return reject(invalid_argument(strfmt(
          "tensor '%s' is registered with %llu elements; %s asked for %llu", name.c_str(),
          static_cast<unsigned long long>(t->count), c.label().c_str(),
          static_cast<unsigned long long>(m.count))));
    }
    if (t->shape != m.shape) {
      return reject(invalid_argument(strfmt("tensor '%s' is registered with shape %s; %s asked for %s",
                                            name.c_str(), shape_text(t->shape).c_str(), c.label().c_str(),
                                            shape_text(m.shape).c_str())));
    }
    if (c.slots.count(t->id) != 0) {
      return reject(Status(Code::kAlreadyExists,
                           strfmt("tensor '%s' is already registered by this client", name.c_str())));
    }
    if (Status budget = over_budget(0, 0); !budget.ok()) return reject(budget);
  } else {
    if (tensors_.size() >= options_.max_tensors) {
      return reject(resource_exhausted(strfmt("tensor '%s': the daemon allows at most %u tensors",
                                           name.c_str(), options_.max_tensors)));
    }
    const TensorSpec spec{name, m.count, m.shape};
    const uint64_t session_bytes = 2 * m.count * sizeof(float);  // local_sum + result
    const uint64_t pipeline_bytes = pipeline_->tensor_footprint_bytes(spec);
    if (Status budget = over_budget(session_bytes, pipeline_bytes); !budget.ok()) return reject(budget);
    auto fresh = std::make_unique<TensorState>();
    fresh->id = static_cast<uint32_t>(tensors_.size());
    fresh->name = name;
    fresh->count = m.count;
    fresh->shape = m.shape;
    fresh->bytes = session_bytes + pipeline_bytes;
    try {
      fresh->local_sum.resize(m.count);
      fresh->result.resize(m.count);
    } catch (const std::bad_alloc&) {
      return reject(resource_exhausted(strfmt("tensor '%s': cannot allocate 2 x %llu floats",
                                           name.c_str(), static_cast<unsigned long long>(m.count))));
    }
    Status st = pipeline_->register_tensor(fresh->id, spec);
    if (!st.ok()) return reject(st.with_context(strfmt("tensor '%s'", name.c_str())));
    charge(fresh->bytes);
    t = fresh.get();
    tensor_ids_.emplace(name, fresh->id);
    tensors_.push_back(std::move(fresh));
  }
  size_t bytes = static_cast<size_t>(m.count) * sizeof(float);
  auto slot = make_shared_memfd(strfmt("sparsecar-c%u-t%u", c.id, t->id), bytes);
  if (!slot.ok()) return reject(slot.status().with_context(strfmt("slot of tensor '%s'", name.c_str())));
  ack.status = 0;
  ack.tensor_id = t->id;
  ack.count = t->count;
  ack.slot_bytes = bytes;
  proto::set_field(ack.message, sizeof ack.message, "");
  int fd = slot->fd;
  charge(slot_bytes);  // before the ack: a client that reads its ack sees it charged
  if (!send_msg(c, proto::MsgType::kRegisterAck, &ack, &fd, 1)) {
    release(slot_bytes);
    return;
  }
  slot->close_fd();
  c.slots.emplace(t->id, std::move(slot).value());
  bump(counters_.registrations);
  SC_LOG_DEBUG("%s registered tensor '%s' (id %u, %llu elements, shape %s)", c.label().c_str(),
               name.c_str(), t->id, static_cast<unsigned long long>(t->count), shape_text(t->shape).c_str());
}

void SessionServer::Impl::handle_metric(Conn& c, const proto::Metric& m) {
  auto name = proto::field_string(m.name, sizeof m.name);
  if (!name || name->empty()) {
    protocol_error(c, "metric name is empty or not NUL-terminated");
    return;
  }
  bump(counters_.metrics);
  pipeline_->report_metric(std::string(*name), m.value, m.step);
}

// ---- steps ---------------------------------------------------------------------------------------

void SessionServer::Impl::drain_submissions(Conn& c) {
  uint64_t v;
  if (::read(c.sub_efd.get(), &v, sizeof v) < 0 && errno != EAGAIN) {
    mark_drop(c, strfmt("reading its submission eventfd: %s", std::strerror(errno)));
    return;
  }
  c.more_submissions = false;
  for (uint32_t i = 0; i < shm::kRingSlots; ++i) {
    shm::Submission s;
    bool corrupt = false;
    if (!shm::ring_pop(c.ctl->submissions, &s, &corrupt)) {
      if (corrupt) protocol_error(c, "corrupt submission ring (head too far ahead of tail)");
      return;
    }
    handle_submission(c, s);
    if (c.drop) return;
  }
  c.more_submissions = true;  // a full ring's worth handled; let other clients go first
}

void SessionServer::Impl::handle_submission(Conn& c, const shm::Submission& s) {
  bump(counters_.submissions);
  auto reject = [&](const Status& st) {
    bump(counters_.submissions_rejected);
    SC_LOG_WARN("%s: submission refused: %s", c.label().c_str(), st.message().c_str());
    push_completion(c, s.tensor_id, s.step, st);
  };
  if (s.flags != 0 || s.reserved != 0) {
    return reject(invalid_argument("submission has non-zero flags/reserved fields"));
  }
  if (!std::isfinite(s.lr) || s.lr < 0.0f) {
    return reject(invalid_argument(strfmt("learning rate %g is not a finite value >= 0",
                                       static_cast<double>(s.lr))));
  }
  if (c.slots.count(s.tensor_id) == 0 || s.tensor_id >= tensors_.size()) {
    return reject(not_found(strfmt("unknown tensor id %u (not registered by this client)", s.tensor_id)));
  }
  TensorState& t = *tensors_[s.tensor_id];
  auto step = static_cast<unsigned long long>(s.step);
  if (!lost_client_.empty() && ready_clients_.load() < options_.local_clients) {
    Status st = aborted(strfmt("tensor '%s' step %llu: local %s; this node cannot complete steps "
                               "until %u local clients are connected again",
                               t.name.c_str(), step, lost_client_.c_str(), options_.local_clients));
    if (!t.in_flight && !(t.has_last && s.step <= t.last_step)) fail_job_wide(t, s.step, st.message());
    return reject(st);
  }
  if (t.in_flight) {
    return reject(failed_precondition(
        strfmt("tensor '%s': step %llu is still in flight; wait for it before submitting step %llu",
            t.name.c_str(), static_cast<unsigned long long>(t.flight_step), step)));
  }
  if (t.collecting) {
    for (const auto& sub : t.submitters) {
      if (sub.first == c.id) {
        return reject(failed_precondition(strfmt("tensor '%s': step %llu submitted twice",
                                              t.name.c_str(), step)));
      }
    }
    if (s.step != t.collect_step) {
      Status st = failed_precondition(strfmt(
          "local clients disagree on the step of tensor '%s': %s submitted step %llu, "
          "client %u submitted step %llu",
          t.name.c_str(), c.label().c_str(), step, t.submitters.front().first,
          static_cast<unsigned long long>(t.collect_step)));
      fail_collecting(t, st, 0);
      return reject(st);
    }
  } else {
    if (t.has_last && s.step <= t.last_step) {
      return reject(out_of_range(strfmt("tensor '%s': step %llu is not greater than its last step %llu",
                                     t.name.c_str(), step,
                                     static_cast<unsigned long long>(t.last_step))));
    }
    t.collecting = true;
    t.collect_step = s.step;
    t.submitters.clear();
  }
  t.submitters.emplace_back(c.id, s.lr);
  if (t.submitters.size() >= options_.local_clients) dispatch(t);
}

void SessionServer::Impl::fail_collecting(TensorState& t, const Status& st, uint32_t except_client) {
  for (const auto& sub : t.submitters) {
    if (sub.first == except_client) continue;
    Conn* other = find_conn(sub.first);
    if (other != nullptr) push_completion(*other, t.id, t.collect_step, st);
  }
  bump(counters_.steps_failed);
  t.collecting = false;
  t.submitters.clear();
}

void SessionServer::Impl::dispatch(TensorState& t) {
  std::sort(t.submitters.begin(), t.submitters.end());
  sum_inputs_.clear();
  for (const auto& sub : t.submitters) {
    Conn* c = find_conn(sub.first);
    SC_CHECK(c != nullptr && c->slots.count(t.id) == 1, "submitter %u of tensor %u vanished",
             sub.first, t.id);
    sum_inputs_.push_back(static_cast<const float*>(c->slots[t.id].addr));
  }
  float* out = t.local_sum.data();
  const size_t count = t.count;
  if (sum_inputs_.size() == 1) {
    std::memcpy(out, sum_inputs_[0], count * sizeof(float));
  } else {
    // float64 accumulation in client order, rounded once: the same sum whatever L is.
    for (size_t i = 0; i < count; ++i) {
      double acc = 0.0;
      for (const float* in : sum_inputs_) acc += static_cast<double>(in[i]);
      out[i] = static_cast<float>(acc);
    }
  }
  StepJob job;
  job.tensor_id = t.id;
  job.step = t.collect_step;
  job.lr = t.submitters.front().second;
  job.generation = generation_;
  job.local_sum = std::span<const float>(out, count);
  job.result = std::span<float>(t.result.data(), count);
  t.in_flight = true;
  t.flight_step = t.collect_step;
  t.flight_generation = generation_;
  t.participants.clear();
  for (const auto& sub : t.submitters) t.participants.push_back(sub.first);
  t.has_last = true;
  t.last_step = t.collect_step;
  t.collecting = false;
  t.submitters.clear();
  bump(counters_.steps_dispatched);
  pipeline_->submit(job);  // may call complete() right away; that only queues
}

void SessionServer::Impl::process_results() {
  {
    std::lock_guard<std::mutex> lock(results_mu_);
    taken_.swap(results_);
  }
  for (const StepResult& r : taken_) {
    if (r.generation != generation_) {
      // The pipeline is done with the buffers of that step: free the orphan that lent them.
      auto orphan = std::find_if(orphans_.begin(), orphans_.end(), [&](const auto& o) {
        return o->id == r.tensor_id && o->flight_step == r.step && o->flight_generation == r.generation;
      });
      if (orphan != orphans_.end()) {
        free_orphan(static_cast<size_t>(orphan - orphans_.begin()));
        continue;
      }
    }
    TensorState* t = r.tensor_id < tensors_.size() ? tensors_[r.tensor_id].get() : nullptr;
    if (r.generation != generation_ || t == nullptr || !t->in_flight || t->flight_step != r.step) {
      bump(counters_.stale_results);
      SC_LOG_WARN("dropping a result for tensor %u step %llu: no such step in flight",
                  r.tensor_id, static_cast<unsigned long long>(r.step));
      continue;
    }
    t->in_flight = false;
    bump(r.status.ok() ? counters_.steps_completed : counters_.steps_failed);
    for (uint32_t id : t->participants) {
      Conn* c = find_conn(id);
      if (c == nullptr || c->drop) continue;
      auto slot = c->slots.find(t->id);
      if (slot == c->slots.end()) continue;
      if (r.status.ok()) std::memcpy(slot->second.addr, t->result.data(), t->count * sizeof(float));
      push_completion(*c, t->id, r.step, r.status, &r);
    }
    t->participants.clear();
  }
  taken_.clear();
}

void SessionServer::Impl::push_completion(Conn& c, uint32_t tensor_id, uint64_t step,
                                          const Status& st, const StepResult* info) {
  if (c.drop || c.ctl == nullptr) return;
  shm::Completion comp{};
  comp.step = step;
  comp.tensor_id = tensor_id;
  comp.code = static_cast<int32_t>(st.code());
  if (info != nullptr) {
    comp.bytes_sent = info->bytes_sent;
    comp.dense_bytes = info->dense_bytes;
    comp.nnz = info->nnz;
  }
  proto::set_field(comp.message, sizeof comp.message, st.message());
  if (!shm::ring_push(c.ctl->completions, comp)) {
    protocol_error(c, "completion ring full (the client does not consume its completions)");
    return;
  }
  uint64_t one = 1;
  if (::write(c.comp_efd.get(), &one, sizeof one) < 0 && errno != EAGAIN) {
    mark_drop(c, strfmt("signalling its completion eventfd: %s", std::strerror(errno)));
  }
}

// ---- disconnects ---------------------------------------------------------------------------------

void SessionServer::Impl::mark_drop(Conn& c, std::string reason) {
  if (c.drop) return;
  c.drop = true;
  c.drop_reason = std::move(reason);
}

void SessionServer::Impl::sweep() {
  auto now = Clock::now();
  for (auto& [id, c] : conns_) {
    if (!c->drop && c->state == Conn::State::kAwaitHello &&
        now - c->accepted > options_.handshake_timeout) {
      bump(counters_.protocol_errors);
      mark_drop(*c, "no Hello within the handshake timeout");
    }
  }
  bool ready_left = false;
  for (auto it = conns_.begin(); it != conns_.end();) {
    if (!it->second->drop) {
      ++it;
      continue;
    }
    std::unique_ptr<Conn> c = std::move(it->second);
    it = conns_.erase(it);
    if (c->state == Conn::State::kReady) ready_left = true;
    free_conn(*c);
  }
  if (ready_left && ready_clients_.load() == 0) reset_job();
}

void SessionServer::Impl::free_conn(Conn& c) {
  if (c.state == Conn::State::kReady) {
    SC_LOG_INFO("%s disconnected: %s", c.label().c_str(), c.drop_reason.c_str());
    bump(counters_.clients_disconnected);
    if (ready_clients_.fetch_sub(1) > 1) {
      lost_client_ = c.label() + " disconnected (" + c.drop_reason + ")";
    }
    // Not while the daemon stops: the trainer did not die, and the peers see this node go.
    if (!stopping_.load()) fail_owed_steps(c, c.drop_reason);
    for (auto& t : tensors_) {
      if (t->collecting) {
        Status st = aborted(strfmt("local %s disconnected (%s) before step %llu of tensor '%s' "
                                "completed", c.label().c_str(), c.drop_reason.c_str(),
                                static_cast<unsigned long long>(t->collect_step), t->name.c_str()));
        fail_collecting(*t, st, c.id);
      }
      if (t->in_flight) std::erase(t->participants, c.id);
    }
  } else {
    SC_LOG_DEBUG("connection %u closed before its handshake: %s", c.id, c.drop_reason.c_str());
  }
  for (const auto& [tid, slot] : c.slots) release(slot_footprint(slot.bytes / sizeof(float)));
  c.slots.clear();  // unmaps
  c.ctl = nullptr;
  c.control.reset();
}

void SessionServer::Impl::fail_job_wide(TensorState& t, uint64_t step, const std::string& reason) {
  if (t.failed_job_wide && t.failed_step >= step) return;
  t.failed_job_wide = true;
  t.failed_step = step;
  bump(counters_.steps_failed_job_wide);
  SC_LOG_WARN("failing tensor '%s' step %llu job-wide: %s", t.name.c_str(), static_cast<unsigned long long>(step),
              reason.c_str());
  pipeline_->fail_step(t.id, step, reason);
}

void SessionServer::Impl::fail_owed_steps(const Conn& dead, const std::string& why) {
  // The step the dead trainer was in: the newest one any tensor of this node reached.
  bool any = false;
  uint64_t current = 0;
  auto reached = [&](uint64_t step) {
    current = any ? std::max(current, step) : step;
    any = true;
  };
  for (const auto& t : tensors_) {
    if (t->collecting) reached(t->collect_step);
    if (t->has_last) reached(t->last_step);
  }
  if (!any) return;  // no step yet: the peers wait for nothing of ours
  bool mid_step = false;
  for (const auto& t : tensors_) {
    const bool at_current = (t->collecting && t->collect_step == current) || (t->has_last && t->last_step == current);
    mid_step = mid_step || !at_current;
  }
  const std::string who = strfmt("local trainer %s disconnected (%s)", dead.label().c_str(), why.c_str());
  for (auto& t : tensors_) {
    if (t->collecting) {
      fail_job_wide(*t, t->collect_step, strfmt("%s before every local trainer submitted step %llu of tensor '%s'",
                                                who.c_str(), static_cast<unsigned long long>(t->collect_step),
                                                t->name.c_str()));
    } else if (mid_step && !(t->has_last && t->last_step >= current)) {
      fail_job_wide(*t, current, strfmt("%s in step %llu before it submitted tensor '%s'", who.c_str(),
                                        static_cast<unsigned long long>(current), t->name.c_str()));
    }
    // Between steps (every tensor reached `current`) nothing is failed: that is also how every
    // job ends, and the next step number is only a guess.
  }
}

void SessionServer::Impl::free_orphan(size_t index) {
  std::unique_ptr<TensorState> t = std::move(orphans_[index]);
  orphans_.erase(orphans_.begin() + static_cast<std::ptrdiff_t>(index));
  counters_.orphaned_tensors.store(orphans_.size());
  release(t->bytes);
  SC_LOG_DEBUG("freed tensor '%s' of a reset job: the pipeline answered its step %llu", t->name.c_str(),
               static_cast<unsigned long long>(t->flight_step));
}

void SessionServer::Impl::reset_job() {
  SC_LOG_INFO("no local client left: resetting the job (%zu tensors)", tensors_.size());
  pipeline_->reset();
  process_results();  // answers of the aborted jobs
  for (auto& t : tensors_) {
    if (t->in_flight) {
      orphans_.push_back(std::move(t));  // the pipeline still holds its buffers until it answers
    } else {
      release(t->bytes);
    }
  }
  counters_.orphaned_tensors.store(orphans_.size());
  ++generation_;  // a late answer of this job never matches a step of the next one
  tensors_.clear();
  tensor_ids_.clear();
  lost_client_.clear();
}

// ---- public face ---------------------------------------------------------------------------------

uint64_t default_tensor_memory_budget() {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page = ::sysconf(_SC_PAGESIZE);
  uint64_t physical = pages > 0 && page > 0 ? static_cast<uint64_t>(pages) * static_cast<uint64_t>(page)
                                            : uint64_t{8} << 30;
  // A cgroup (container, systemd MemoryMax=) may allow less than the machine has.
  if (FILE* f = std::fopen("/sys/fs/cgroup/memory.max", "re")) {
    unsigned long long limit = 0;
    if (std::fscanf(f, "%llu", &limit) == 1 && limit > 0 && limit < physical) physical = limit;
    std::fclose(f);
  }
  return physical / 2;
}

Expected<std::unique_ptr<SessionServer>> SessionServer::start(const SessionServerOptions& options,
                                                              StepSink* pipeline) {
  auto impl = std::make_unique<Impl>(options, pipeline);
  SC_RETURN_IF_ERROR(impl->start());
  return std::unique_ptr<SessionServer>(new SessionServer(std::move(impl)));
}

SessionServer::SessionServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
SessionServer::~SessionServer() { stop(); }
void SessionServer::complete(const StepResult& result) { impl_->complete(result); }
uint32_t SessionServer::connected_clients() const { return impl_->connected_clients(); }
SessionStats SessionServer::stats() const { return impl_->stats(); }
void SessionServer::stop() { impl_->stop(); }

}  // namespace sparsecar
