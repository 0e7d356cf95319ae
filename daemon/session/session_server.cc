// SessionServer: see session_server.h. The session thread's poll loop and the wiring of its
// parts: Connection (one client's socket, handshake and rings), StepCollector (tensors, steps,
// local sums, disconnects, the memory budget) and ShmMapping (the memfds the clients map).
// Everything but complete()/stats()/connected_clients() runs on the session thread, so the state
// below needs no locks.
#include "daemon/session/session_server.h"

#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <span>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "daemon/session/connection.h"
#include "daemon/session/frames.h"
#include "daemon/session/shm_mapping.h"
#include "daemon/session/step_collector.h"
#include "sparsecar/common/fd.h"
#include "sparsecar/common/log.h"
#include "sparsecar/common/session_protocol.h"
#include "sparsecar/common/shm_layout.h"

namespace sparsecar {
namespace {

constexpr int kPollTimeoutMs = 100;

// What the connections saw (the steps' counters are the StepCollector's).
struct Counters {
  std::atomic<uint64_t> clients_accepted{0}, clients_rejected{0}, clients_disconnected{0}, protocol_errors{0},
      registrations{0}, registrations_rejected{0}, metrics{0}, handshakes_evicted{0},
      registrations_device_refused{0};
};

void bump(std::atomic<uint64_t>& c) { c.fetch_add(1, std::memory_order_relaxed); }

}  // namespace

class SessionServer::Impl final : public CompletionSink {
 public:
  Impl(SessionServerOptions options, StepSink* pipeline, const Clock& clock, DeviceRuntime* devices)
      : options_(std::move(options)), pipeline_(pipeline), clock_(clock), devices_(devices) {}
  ~Impl() override { stop(); }

  Status start();
  void stop();
  void complete(const StepResult& result);
  uint32_t connected_clients() const { return ready_clients_.load(std::memory_order_relaxed); }
  SessionStats stats() const;

  // CompletionSink (session thread): the collector's answers go on the clients' rings.
  bool reachable(uint32_t client) const override;
  void post(uint32_t client, uint32_t tensor_id, uint64_t step, const Status& st,
            const StepResult* info) override;

 private:
  void run();
  void accept_clients();
  void read_socket(Connection& c);
  void handle_message(Connection& c, const proto::MsgHeader& h, const uint8_t* payload);
  void handle_hello(Connection& c, const proto::Hello& m);
  void handle_register(Connection& c, const RegisterRequest& m);
  void handle_register_device(Connection& c, const RegisterRequest& m);
  void handle_metric(Connection& c, const proto::Metric& m);
  void drain_submissions(Connection& c);
  void process_results();
  void push_completion(Connection& c, uint32_t tensor_id, uint64_t step, const Status& st,
                       const StepResult* info = nullptr);
  void protocol_error(Connection& c, const std::string& what);
  void reject_hello(Connection& c, const Status& st);
  void sweep();
  void free_conn(Connection& c);
  void reset_job();
  Connection* find_conn(uint32_t id) const;

  SessionServerOptions options_;
  StepSink* pipeline_;
  const Clock& clock_;
  DeviceRuntime* devices_;  // may be null: device tensors refused
  Fd listen_fd_;
  Fd wake_efd_;
  std::thread thread_;
  std::atomic<bool> stopping_{false};
  bool stopped_ = false;
  std::mutex stop_mu_;

  std::mutex results_mu_;
  std::deque<StepResult> results_;  // guarded by results_mu_

  // Session thread only.
  std::map<uint32_t, std::unique_ptr<Connection>> conns_;  // by client id (accept order)
  uint32_t next_client_id_ = 1;
  std::unique_ptr<StepCollector> collector_;  // created by start(), once the options are checked
  std::vector<pollfd> pollfds_;
  std::vector<uint32_t> poll_owner_;  // client id per pollfd (0: not a client)
  std::deque<StepResult> taken_;

  std::atomic<uint32_t> ready_clients_{0};
  Counters counters_;
};

// ---- start / stop ------------------------------------------------------------------------------

Status SessionServer::Impl::start() {
  const std::string& path = options_.socket_path;
  sockaddr_un addr{};
  if (path.empty() || path.size() >= sizeof(addr.sun_path)) {
    return invalid_argument(fmt::format("socket path '{}' is empty or longer than {} bytes",
                                path, sizeof(addr.sun_path) - 1));
  }
  if (options_.local_clients == 0) return invalid_argument("local_clients must be at least 1");
  if (pipeline_ == nullptr) return invalid_argument("no pipeline given to the session server");
  if (options_.max_handshakes_per_uid == 0) return invalid_argument("max_handshakes_per_uid must be at least 1");
  const uint64_t budget = options_.tensor_memory_budget_bytes != 0 ? options_.tensor_memory_budget_bytes
                                                                  : default_tensor_memory_budget();
  collector_ = std::make_unique<StepCollector>(StepCollectorOptions{.local_clients = options_.local_clients,
                                                                    .max_tensor_elements = options_.max_tensor_elements,
                                                                    .max_tensors = options_.max_tensors,
                                                                    .budget_bytes = budget},
                                               pipeline_, this);
  addr.sun_family = AF_UNIX;
  std::memcpy(addr.sun_path, path.data(), path.size());
  auto* sa = reinterpret_cast<sockaddr*>(&addr);

  struct stat st{};
  if (::lstat(path.c_str(), &st) == 0) {
    if (!S_ISSOCK(st.st_mode)) {
      return failed_precondition(fmt::format("'{}' exists and is not a socket", path));
    }
    Fd probe(::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0));
    if (probe.get() < 0) return errno_status("socket", errno);
    if (::connect(probe.get(), sa, sizeof addr) == 0) {
      return Status(Code::kAlreadyExists,
                    fmt::format("another daemon is listening on '{}'", path));
    }
    if (::unlink(path.c_str()) != 0 && errno != ENOENT) {
      return errno_status("removing stale socket " + path, errno);
    }
    SC_LOG_INFO("removed stale socket {}", path);
  }

  listen_fd_.reset(::socket(AF_UNIX, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0));
  if (listen_fd_.get() < 0) return errno_status("socket(AF_UNIX)", errno);
  if (::bind(listen_fd_.get(), sa, sizeof addr) != 0) {
    int err = errno;
    SC_LOG_ERROR("bind({}): {}", path, std::strerror(err));
    return errno_status("bind " + path, err);
  }
  if (::chmod(path.c_str(), 0660) != 0) {
    int err = errno;
    SC_LOG_ERROR("chmod({}): {}", path, std::strerror(err));
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
  SC_LOG_INFO("session server listening on {} ({} local clients)", path,
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
      SC_LOG_WARN("waking the session thread: {}", std::strerror(errno));
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
    SC_LOG_ERROR("waking the session thread for a step result: {}", std::strerror(errno));
  }
}

SessionStats SessionServer::Impl::stats() const {
  auto r = [](const std::atomic<uint64_t>& a) { return a.load(std::memory_order_relaxed); };
  const StepCounters& steps = collector_->counters();
  SessionStats s;
  s.clients_accepted = r(counters_.clients_accepted);
  s.clients_rejected = r(counters_.clients_rejected);
  s.clients_disconnected = r(counters_.clients_disconnected);
  s.protocol_errors = r(counters_.protocol_errors);
  s.registrations = r(counters_.registrations);
  s.registrations_rejected = r(counters_.registrations_rejected);
  s.submissions = r(steps.submissions);
  s.submissions_rejected = r(steps.submissions_rejected);
  s.steps_dispatched = r(steps.steps_dispatched);
  s.steps_completed = r(steps.steps_completed);
  s.steps_failed = r(steps.steps_failed);
  s.stale_results = r(steps.stale_results);
  s.metrics = r(counters_.metrics);
  s.registrations_over_budget = r(steps.registrations_over_budget);
  s.registrations_device_refused = r(counters_.registrations_device_refused);
  s.handshakes_evicted = r(counters_.handshakes_evicted);
  s.steps_failed_job_wide = r(steps.steps_failed_job_wide);
  s.tensor_bytes_in_use = r(steps.tensor_bytes_in_use);
  s.orphaned_tensors = r(steps.orphaned_tensors);
  s.tensor_memory_budget = collector_->budget();
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
      pollfds_.push_back({c->sock(), POLLIN, 0});
      poll_owner_.push_back(id);
      if (c->ready()) {
        pollfds_.push_back({c->submission_efd(), POLLIN, 0});
        poll_owner_.push_back(id);
        busy = busy || c->more_submissions;
      }
    }
    int n = ::poll(pollfds_.data(), pollfds_.size(), busy ? 0 : kPollTimeoutMs);
    if (n < 0) {
      if (errno == EINTR) continue;
      SC_LOG_ERROR("session thread: poll: {}; the session server stops", std::strerror(errno));
      break;
    }
    if (pollfds_[0].revents & POLLIN) {
      uint64_t v;
      if (::read(wake_efd_.get(), &v, sizeof v) < 0 && errno != EAGAIN) {
        SC_LOG_ERROR("reading the wake eventfd: {}", std::strerror(errno));
      }
    }
    process_results();
    if (pollfds_[1].revents & POLLIN) accept_clients();
    for (size_t i = 2; i < pollfds_.size(); ++i) {
      Connection* c = find_conn(poll_owner_[i]);
      if (c == nullptr || c->dropped()) continue;
      short ev = pollfds_[i].revents;
      if (pollfds_[i].fd == c->sock()) {
        if (ev & (POLLIN | POLLHUP | POLLERR | POLLNVAL)) read_socket(*c);
      } else if ((ev & POLLIN) || c->more_submissions) {
        drain_submissions(*c);
      }
    }
    sweep();
  }
  for (auto& [id, c] : conns_) {
    if (c->dropped()) continue;
    // Tell the client why before closing, so its wait() reports more than a closed socket.
    proto::Error e{};
    e.status = static_cast<int32_t>(Code::kUnavailable);
    proto::set_field(e.message, sizeof e.message, "the daemon is shutting down");
    if (c->send(proto::MsgType::kError, &e, nullptr, 0)) c->mark_drop("the daemon is shutting down");
  }
  sweep();
  process_results();
  listen_fd_.reset();
  if (::unlink(options_.socket_path.c_str()) != 0 && errno != ENOENT) {
    SC_LOG_WARN("removing {}: {}", options_.socket_path, std::strerror(errno));
  }
}

Connection* SessionServer::Impl::find_conn(uint32_t id) const {
  auto it = conns_.find(id);
  return it == conns_.end() ? nullptr : it->second.get();
}

void SessionServer::Impl::accept_clients() {
  for (int i = 0; i < 64; ++i) {
    int fd = ::accept4(listen_fd_.get(), nullptr, nullptr, SOCK_NONBLOCK | SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EAGAIN || errno == EINTR || errno == ECONNABORTED) return;
      SC_LOG_WARN("accept on {}: {}", options_.socket_path, std::strerror(errno));
      return;
    }
    Fd sock(fd);
    ucred cred{};
    socklen_t len = sizeof cred;
    if (::getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
      SC_LOG_WARN("SO_PEERCRED: {}; closing the connection", std::strerror(errno));
      bump(counters_.clients_rejected);
      continue;
    }
    // Silent connections of this uid may not pile up: the oldest one waiting for its handshake
    // gives way to the new one (a real trainer says Hello at once).
    Connection* oldest = nullptr;
    uint32_t waiting = 0;
    for (auto& [cid, other] : conns_) {
      if (other->dropped() || other->ready() || other->peer_uid() != cred.uid) continue;
      ++waiting;
      if (oldest == nullptr) oldest = other.get();  // ids grow with accept order
    }
    if (waiting >= options_.max_handshakes_per_uid && oldest != nullptr) {
      bump(counters_.clients_rejected);
      bump(counters_.handshakes_evicted);
      SC_LOG_WARN("connection {} (pid {}, uid {}) closed: {} connections of uid {} wait for their handshake "
                  "(at most {})", oldest->id(), static_cast<int>(oldest->peer_pid()), static_cast<unsigned>(cred.uid),
                  waiting, static_cast<unsigned>(cred.uid), options_.max_handshakes_per_uid);
      oldest->mark_drop("no Hello while newer connections of its uid arrived");
      oldest->shutdown();
    }
    size_t open = 0;
    for (auto& [cid, other] : conns_) open += other->dropped() ? 0 : 1;
    if (open >= options_.local_clients + kMaxPendingConnections) {
      bump(counters_.clients_rejected);
      SC_LOG_WARN("refusing a connection of uid {}: {} connections open already",
                  static_cast<unsigned>(cred.uid), open);
      continue;
    }
    auto c = std::make_unique<Connection>(next_client_id_++, std::move(sock), cred.pid, cred.uid, clock_.now());
    SC_LOG_DEBUG("connection {} from pid {} uid {}", c->id(), static_cast<int>(cred.pid),
                 static_cast<unsigned>(cred.uid));
    conns_.emplace(c->id(), std::move(c));
  }
}

void SessionServer::Impl::read_socket(Connection& c) {
  auto error = c.receive([&](const proto::MsgHeader& h, const uint8_t* payload) { handle_message(c, h, payload); });
  if (error) protocol_error(c, *error);
}

void SessionServer::Impl::handle_message(Connection& c, const proto::MsgHeader& h, const uint8_t* payload) {
  auto type = static_cast<proto::MsgType>(h.type);
  if (!c.ready()) {
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
    case proto::MsgType::kRegisterDevice:
      handle_register_device(c, decode_register_device(payload));
      return;
    case proto::MsgType::kMetric: {
      proto::Metric m;
      std::memcpy(&m, payload, sizeof m);
      handle_metric(c, m);
      return;
    }
    default:
      protocol_error(c, fmt::format("unexpected message type {}", static_cast<unsigned>(h.type)));
  }
}

void SessionServer::Impl::protocol_error(Connection& c, const std::string& what) {
  bump(counters_.protocol_errors);
  SC_LOG_WARN("{}: protocol error: {}; closing the session", c.label(), what);
  proto::Error e{};
  e.status = static_cast<int32_t>(Code::kDataLoss);
  proto::set_field(e.message, sizeof e.message, "protocol error: " + what);
  c.send(proto::MsgType::kError, &e, nullptr, 0);
  c.mark_drop("protocol error: " + what);
}

void SessionServer::Impl::reject_hello(Connection& c, const Status& st) {
  bump(counters_.clients_rejected);
  SC_LOG_WARN("{} (uid {}) refused: {}", c.label(), static_cast<unsigned>(c.peer_uid()),
              st.message());
  c.refuse_hello(st);
}

void SessionServer::Impl::handle_hello(Connection& c, const proto::Hello& m) {
  if (Status st = c.check_hello(m); !st.ok()) {
    reject_hello(c, st);
    return;
  }
  if (ready_clients_.load() >= options_.local_clients) {
    reject_hello(c, resource_exhausted(fmt::format("the daemon already serves its {} local clients",
                                           options_.local_clients)));
    return;
  }
  if (Status st = c.open_session(options_.local_clients); !st.ok()) {
    reject_hello(c, st);
    return;
  }
  if (!c.ready()) return;  // the HelloAck could not be sent: dropped
  ready_clients_.fetch_add(1);
  collector_->client_joined(c.id(), c.label());
  bump(counters_.clients_accepted);
  SC_LOG_INFO("{} connected (uid {}, {} of {} local clients)", c.label(),
              static_cast<unsigned>(c.peer_uid()), ready_clients_.load(), options_.local_clients);
}

void SessionServer::Impl::handle_register(Connection& c, const RegisterRequest& m) {
  proto::RegisterAck ack{};
  auto reject = [&](const Status& st) {
    bump(counters_.registrations_rejected);
    SC_LOG_WARN("{}: registration refused: {}", c.label(), st.message());
    ack.status = static_cast<int32_t>(st.code());
    proto::set_field(ack.message, sizeof ack.message, st.message());
    c.send(proto::MsgType::kRegisterAck, &ack, nullptr, 0);
  };
  auto reg = collector_->register_tensor(c.id(), m);
  if (!reg.ok()) return reject(reg.status());
  const StepCollector::Registration& t = *reg;
  size_t bytes = static_cast<size_t>(t.count) * sizeof(float);
  auto slot = ShmMapping::create(fmt::format("sparsecar-c{}-t{}", c.id(), t.tensor_id), bytes);
  if (!slot.ok()) return reject(slot.status().with_context(fmt::format("slot of tensor '{}'", t.name)));
  ack.status = 0;
  ack.tensor_id = t.tensor_id;
  ack.count = t.count;
  ack.slot_bytes = bytes;
  proto::set_field(ack.message, sizeof ack.message, "");
  int fd = slot->fd();
  // Charged before the ack: a client that reads its ack sees it charged.
  collector_->attach_slot(c.id(), t.tensor_id, std::span<float>(static_cast<float*>(slot->addr()), t.count));
  if (!c.send(proto::MsgType::kRegisterAck, &ack, &fd, 1)) {
    collector_->detach_slot(c.id(), t.tensor_id);
    return;
  }
  slot->close_fd();
  c.slots.emplace(t.tensor_id, std::move(slot).value());
  bump(counters_.registrations);
  SC_LOG_DEBUG("{} registered tensor '{}' (id {}, {} elements, shape {})", c.label(), t.name,
               t.tensor_id, static_cast<unsigned long long>(t.count), shape_text(t.shape));
}

void SessionServer::Impl::handle_register_device(Connection& c, const RegisterRequest& m) {
  proto::RegisterAck ack{};
  auto reject = [&](const Status& st, bool device_refused) {
    bump(counters_.registrations_rejected);
    if (device_refused) bump(counters_.registrations_device_refused);
    SC_LOG_WARN("{}: device registration refused: {}", c.label(), st.message());
    ack.status = static_cast<int32_t>(st.code());
    proto::set_field(ack.message, sizeof ack.message, st.message());
    c.send(proto::MsgType::kRegisterAck, &ack, nullptr, 0);
  };
  // Malformed fields are told first, then whether this daemon can take GPU tensors at all.
  if (!m.malformed.empty()) {
    if (Status st = collector_->check_registration(c.id(), m); !st.ok()) return reject(st, false);
  }
  Status available = devices_ != nullptr
                         ? devices_->available()
                         : unavailable("this session server has no device runtime: device tensors are refused; "
                                       "register a host tensor");
  if (!available.ok()) return reject(available, true);
  if (Status st = collector_->check_registration(c.id(), m); !st.ok()) return reject(st, false);
  auto opened = devices_->open(c.id(), *m.device);
  if (!opened.ok()) {
    auto name = proto::field_string(m.name, proto::kNameBytes);
    return reject(opened.status().with_context(fmt::format("tensor '{}'", name ? *name : "?")), true);
  }
  auto reg = collector_->register_tensor(c.id(), m);
  if (!reg.ok()) return reject(reg.status(), false);  // `opened` closes its handles
  const StepCollector::Registration& t = *reg;
  collector_->attach_device(c.id(), t.tensor_id, std::move(opened).value());
  ack.status = 0;
  ack.tensor_id = t.tensor_id;
  ack.count = t.count;
  ack.slot_bytes = 0;  // no slot: the tensor stays on the GPU
  proto::set_field(ack.message, sizeof ack.message, "");
  if (!c.send(proto::MsgType::kRegisterAck, &ack, nullptr, 0)) {
    collector_->detach_device(c.id(), t.tensor_id);
    return;
  }
  bump(counters_.registrations);
  SC_LOG_DEBUG("{} registered device tensor '{}' (id {}, {} elements, shape {})", c.label(), t.name,
               t.tensor_id, static_cast<unsigned long long>(t.count), shape_text(t.shape));
}

void SessionServer::Impl::handle_metric(Connection& c, const proto::Metric& m) {
  auto name = proto::field_string(m.name, sizeof m.name);
  if (!name || name->empty()) {
    protocol_error(c, "metric name is empty or not NUL-terminated");
    return;
  }
  bump(counters_.metrics);
  pipeline_->report_metric(std::string(*name), m.value, m.step);
}

// ---- steps ---------------------------------------------------------------------------------------

void SessionServer::Impl::drain_submissions(Connection& c) {
  if (!c.take_submission_wakeup()) return;
  c.more_submissions = false;
  for (uint32_t i = 0; i < shm::kRingSlots; ++i) {
    shm::Submission s;
    bool corrupt = false;
    if (!c.pop_submission(&s, &corrupt)) {
      if (corrupt) protocol_error(c, "corrupt submission ring (head too far ahead of tail)");
      return;
    }
    collector_->submit(c.id(), s);
    if (c.dropped()) return;
  }
  c.more_submissions = true;  // a full ring's worth handled; let other clients go first
}

void SessionServer::Impl::process_results() {
  {
    std::lock_guard<std::mutex> lock(results_mu_);
    taken_.swap(results_);
  }
  for (const StepResult& r : taken_) collector_->on_result(r);
  taken_.clear();
}

bool SessionServer::Impl::reachable(uint32_t client) const {
  const Connection* c = find_conn(client);
  return c != nullptr && !c->dropped();
}

void SessionServer::Impl::post(uint32_t client, uint32_t tensor_id, uint64_t step, const Status& st,
                               const StepResult* info) {
  Connection* c = find_conn(client);
  if (c != nullptr) push_completion(*c, tensor_id, step, st, info);
}

void SessionServer::Impl::push_completion(Connection& c, uint32_t tensor_id, uint64_t step, const Status& st,
                                          const StepResult* info) {
  shm::Completion comp{};
  comp.step = step;
  comp.tensor_id = tensor_id;
  comp.code = static_cast<int32_t>(st.code());
  if (info != nullptr) {
    comp.bytes_sent = info->bytes_sent;
    comp.dense_bytes = info->dense_bytes;
    comp.nnz = info->nnz;
    comp.flags = info->trainer_reduces ? shm::kCompletionTrainerReduces : 0;
    comp.lease_steps = info->trainer_reduces ? info->lease_steps : 0;
  }
  proto::set_field(comp.message, sizeof comp.message, st.message());
  if (!c.post_completion(comp)) {
    protocol_error(c, "completion ring full (the client does not consume its completions)");
  }
}

// ---- disconnects ---------------------------------------------------------------------------------

void SessionServer::Impl::sweep() {
  auto now = clock_.now();
  for (auto& [id, c] : conns_) {
    if (!c->dropped() && c->handshake_overdue(now, options_.handshake_timeout)) {
      bump(counters_.protocol_errors);
      c->mark_drop("no Hello within the handshake timeout");
    }
  }
  bool ready_left = false;
  for (auto it = conns_.begin(); it != conns_.end();) {
    if (!it->second->dropped()) {
      ++it;
      continue;
    }
    std::unique_ptr<Connection> c = std::move(it->second);
    it = conns_.erase(it);
    if (c->ready()) ready_left = true;
    free_conn(*c);
  }
  if (ready_left && ready_clients_.load() == 0) reset_job();
}

void SessionServer::Impl::free_conn(Connection& c) {
  if (c.ready()) {
    SC_LOG_INFO("{} disconnected: {}", c.label(), c.drop_reason());
    bump(counters_.clients_disconnected);
    ready_clients_.fetch_sub(1);
    // Not failed job-wide while the daemon stops: the trainer did not die, and the peers see this
    // node go.
    collector_->client_left(c.id(), c.drop_reason(), /*fail_owed=*/!stopping_.load());
  } else {
    SC_LOG_DEBUG("connection {} closed before its handshake: {}", c.id(), c.drop_reason());
  }
  c.release_memory();
}

void SessionServer::Impl::reset_job() {
  SC_LOG_INFO("no local client left: resetting the job ({} tensors)", collector_->tensor_count());
  pipeline_->reset();
  process_results();  // answers of the aborted jobs
  collector_->reset_job();
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
                                                              StepSink* pipeline, const Clock& clock,
                                                              DeviceRuntime* devices) {
  auto impl = std::make_unique<Impl>(options, pipeline, clock, devices);
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
