#include "daemon/control/control_server.h"

#include <fcntl.h>
#include <grp.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <zmq.hpp>
#include <zmq_addon.hpp>

#include "sparsecar/common/lock_file.h"
#include "sparsecar/common/log.h"

namespace sparsecar::control {
namespace {

constexpr std::string_view kIpc = "ipc://";
constexpr std::string_view kTcp = "tcp://";

bool starts_with(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }

}  // namespace

size_t hard_cap_bytes(size_t max_message_bytes) {
  return std::max<size_t>(max_message_bytes * 16, size_t{16} << 20);
}

Status check_endpoint(const std::string& endpoint, const std::string& token, const std::string& curve_secret_key) {
  if (starts_with(endpoint, kIpc)) {
    std::string path = endpoint.substr(kIpc.size());
    if (path.empty() || path[0] != '/') return invalid_argument("control endpoint '" + endpoint + "': ipc:// needs an absolute path");
    if (path.size() + 5 >= 108) return invalid_argument("control endpoint '" + endpoint + "': path longer than a Unix socket allows");
    return Status::Ok();
  }
  if (starts_with(endpoint, kTcp)) {
    if (token.empty() && curve_secret_key.empty()) {
      return permission_denied("control endpoint '" + endpoint +
                               "': tcp:// is served only with control_curve_secret_key or control_token set");
    }
    if (!curve_secret_key.empty() && curve_secret_key.size() != 40) {
      return invalid_argument("control_curve_secret_key must be 40 Z85 characters");
    }
    if (!token.empty() && token.size() < 16) return invalid_argument("control_token must be at least 16 characters");
    return Status::Ok();
  }
  return invalid_argument("control endpoint '" + endpoint + "' is neither ipc://PATH nor tcp://HOST:PORT (or 'off')");
}

struct ControlServer::Impl {
  ControlServerOptions options;
  Dispatcher* dispatcher = nullptr;
  zmq::context_t context{1};
  zmq::socket_t socket;
  std::string ipc_path;
  LockFile lock;  // ipc: PATH.lock, unless the caller holds it (options.lock_held)
  std::atomic<bool> stopping{false};
  std::thread thread;

  void run();
  void serve_one();
};

ControlServer::ControlServer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ControlServer::~ControlServer() { stop(); }

Expected<std::unique_ptr<ControlServer>> ControlServer::start(const ControlServerOptions& options,
                                                              Dispatcher* dispatcher) {
  SC_RETURN_IF_ERROR(check_endpoint(options.endpoint, options.token, options.curve_secret_key));
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  impl->dispatcher = dispatcher;
  const bool ipc = starts_with(options.endpoint, kIpc);
  gid_t gid = static_cast<gid_t>(-1);
  if (ipc && !options.group.empty()) {
    struct group* g = ::getgrnam(options.group.c_str());
    if (g == nullptr) return not_found("control_group '" + options.group + "' does not exist");
    gid = g->gr_gid;
  }
  if (ipc) {
    impl->ipc_path = options.endpoint.substr(kIpc.size());
    if (!options.lock_held) {
      auto lock = LockFile::acquire(impl->ipc_path + ".lock");
      if (!lock.ok()) {
        if (lock.status().code() == Code::kFailedPrecondition) {
          return failed_precondition("control socket " + impl->ipc_path + " is served by another process (" +
                                     lock.status().message() + ")");
        }
        return lock.status();
      }
      impl->lock = std::move(lock).value();
    }
    ::unlink(impl->ipc_path.c_str());  // stale socket of a daemon that died: we hold the lock now
  }
  std::string bound;
  try {
    impl->socket = zmq::socket_t(impl->context, zmq::socket_type::router);
    impl->socket.set(zmq::sockopt::linger, 0);
    impl->socket.set(zmq::sockopt::maxmsgsize, static_cast<int64_t>(hard_cap_bytes(options.max_message_bytes)));
    impl->socket.set(zmq::sockopt::rcvhwm, kReceiveQueueMessages);
    impl->socket.set(zmq::sockopt::router_mandatory, 1);  // a reply to a vanished client fails, not blocks
    if (!options.curve_secret_key.empty()) {
      impl->socket.set(zmq::sockopt::curve_server, 1);
      impl->socket.set(zmq::sockopt::curve_secretkey, options.curve_secret_key);
    }
    impl->socket.bind(options.endpoint);
    bound = impl->socket.get(zmq::sockopt::last_endpoint);
  } catch (const zmq::error_t& e) {
    return unavailable("cannot bind control socket " + options.endpoint + ": " + e.what());
  }
  if (ipc) {
    const mode_t mode = options.group.empty() ? 0600 : 0660;
    if (gid != static_cast<gid_t>(-1) && ::chown(impl->ipc_path.c_str(), static_cast<uid_t>(-1), gid) != 0) {
      return errno_status("chown of control socket " + impl->ipc_path + " to group " + options.group, errno);
    }
    if (::chmod(impl->ipc_path.c_str(), mode) != 0) {
      return errno_status("chmod of control socket " + impl->ipc_path, errno);
    }
  }
  std::unique_ptr<ControlServer> server(new ControlServer(std::move(impl)));
  server->endpoint_ = bound.empty() ? options.endpoint : bound;
  Impl* raw = server->impl_.get();
  raw->thread = std::thread([raw] { raw->run(); });
  SC_LOG_INFO("control socket on {}{}", server->endpoint_,
              !options.curve_secret_key.empty() ? " (CURVE)" : !options.token.empty() ? " (token)" : "");
  return server;
}

void ControlServer::Impl::run() {
  while (!stopping.load()) {
    try {
      zmq::pollitem_t items[] = {{static_cast<void*>(socket), 0, ZMQ_POLLIN, 0}};
      zmq::poll(items, 1, options.poll_interval);
      if (items[0].revents & ZMQ_POLLIN) serve_one();
    } catch (const zmq::error_t& e) {
      if (e.num() == ETERM) return;
      SC_LOG_WARN("control socket: {}", e.what());
    }
  }
}

void ControlServer::Impl::serve_one() {
  std::vector<zmq::message_t> frames;
  if (!zmq::recv_multipart(socket, std::back_inserter(frames), zmq::recv_flags::dontwait)) return;
  if (frames.size() < 2) return;  // no routing id: cannot answer
  // [id, payload] from DEALER, [id, "", payload] from REQ.
  size_t payload_at = frames.size() == 3 && frames[1].size() == 0 ? 2 : 1;
  std::string reply;
  if (frames.size() - payload_at != 1) {
    reply = error_reply(nullptr, rejection_code(Rejection::kMalformed), "a request is exactly one message frame");
    dispatcher->handle("\x01");  // counts the rejection like any malformed request
  } else {
    reply = dispatcher->handle(std::string_view(static_cast<const char*>(frames[payload_at].data()),
                                                frames[payload_at].size()));
  }
  std::vector<zmq::message_t> out;
  for (size_t i = 0; i < payload_at; ++i) out.emplace_back(frames[i].data(), frames[i].size());
  out.emplace_back(reply.data(), reply.size());
  try {
    zmq::send_multipart(socket, out, zmq::send_flags::dontwait);
  } catch (const zmq::error_t& e) {
    SC_LOG_DEBUG("control reply not delivered (client gone?): {}", e.what());
  }
}

void ControlServer::stop() {
  if (!impl_) return;
  impl_->stopping.store(true);
  if (impl_->thread.joinable()) impl_->thread.join();
  try {
    impl_->socket.close();
    impl_->context.close();
  } catch (const zmq::error_t& e) {
    SC_LOG_WARN("closing control socket: {}", e.what());
  }
  if (!impl_->ipc_path.empty()) ::unlink(impl_->ipc_path.c_str());
  impl_->lock.release();  // after the socket file: a lock without a socket is never left behind
  impl_.reset();
}

}  // namespace sparsecar::control
