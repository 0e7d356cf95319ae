#include "daemon/control/client.h"

#include <sys/stat.h>

#include <zmq.hpp>

#include "daemon/control/protocol.h"

namespace sparsecar::control {

struct ControlClient::Impl {
  ClientOptions options;
  zmq::context_t context{1};
  zmq::socket_t socket;
  uint64_t next_id = 1;
};

ControlClient::ControlClient(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
ControlClient::~ControlClient() {
  if (impl_) {
    impl_->socket.close();
    impl_->context.close();
  }
}

Expected<std::unique_ptr<ControlClient>> ControlClient::connect(const ClientOptions& options) {
  const std::string& ep = options.endpoint;
  if (ep.rfind("ipc://", 0) == 0) {
    // ZeroMQ connects lazily and would wait for ever for a socket that is not there: check first.
    struct stat st{};
    const std::string path = ep.substr(6);
    if (::stat(path.c_str(), &st) != 0) return errno_status("control socket " + path, errno);
  } else if (ep.rfind("tcp://", 0) != 0) {
    return invalid_argument("endpoint '" + ep + "' is neither ipc://PATH nor tcp://HOST:PORT");
  }
  auto impl = std::make_unique<Impl>();
  impl->options = options;
  try {
    impl->socket = zmq::socket_t(impl->context, zmq::socket_type::dealer);
    impl->socket.set(zmq::sockopt::linger, 0);
    if (!options.curve_server_key.empty()) {
      char pub[41], sec[41];
      if (zmq_curve_keypair(pub, sec) != 0) return internal_error("cannot make a CURVE key pair");
      impl->socket.set(zmq::sockopt::curve_serverkey, options.curve_server_key);
      impl->socket.set(zmq::sockopt::curve_publickey, std::string(pub));
      impl->socket.set(zmq::sockopt::curve_secretkey, std::string(sec));
    }
    impl->socket.connect(ep);
  } catch (const zmq::error_t& e) {
    return unavailable("cannot connect to " + ep + ": " + e.what());
  }
  return std::unique_ptr<ControlClient>(new ControlClient(std::move(impl)));
}

Expected<std::string> ControlClient::call_raw(const std::string& bytes, std::chrono::milliseconds timeout) {
  if (timeout.count() <= 0) timeout = impl_->options.timeout;
  try {
    if (!impl_->socket.send(zmq::buffer(bytes), zmq::send_flags::dontwait)) {
      // Not connected yet: wait for the pipe within the deadline.
      zmq::pollitem_t out[] = {{static_cast<void*>(impl_->socket), 0, ZMQ_POLLOUT, 0}};
      zmq::poll(out, 1, timeout);
      if (!(out[0].revents & ZMQ_POLLOUT) || !impl_->socket.send(zmq::buffer(bytes), zmq::send_flags::dontwait)) {
        return unavailable("cannot reach the daemon at " + impl_->options.endpoint);
      }
    }
    zmq::pollitem_t in[] = {{static_cast<void*>(impl_->socket), 0, ZMQ_POLLIN, 0}};
    zmq::poll(in, 1, timeout);
    if (!(in[0].revents & ZMQ_POLLIN)) {
      std::string hint;
      if (bytes.size() > (size_t{16} << 20)) {
        hint = " (the request is " + std::to_string(bytes.size()) +
               " bytes: a daemon drops requests above 16 x control_max_message_bytes, at least 16 MiB, "
               "without a reply)";
      }
      return deadline_exceeded("no reply from " + impl_->options.endpoint + " within " +
                               std::to_string(timeout.count()) + " ms" + hint);
    }
    zmq::message_t reply;
    if (!impl_->socket.recv(reply, zmq::recv_flags::dontwait)) return deadline_exceeded("reply vanished");
    return reply.to_string();
  } catch (const zmq::error_t& e) {
    return unavailable(std::string("control socket: ") + e.what());
  }
}

Expected<nlohmann::json> ControlClient::call(const std::string& cmd, const nlohmann::json& args,
                                             std::chrono::milliseconds timeout) {
  const uint64_t id = impl_->next_id++;
  SC_ASSIGN_OR_RETURN(std::string raw, call_raw(make_request(id, cmd, args, impl_->options.token), timeout));
  nlohmann::json reply = nlohmann::json::parse(raw, nullptr, false);
  if (reply.is_discarded() || !reply.is_object() || !reply.contains("ok") || !reply["ok"].is_boolean()) {
    return data_loss("the daemon's reply is not a control protocol reply: " + raw.substr(0, 200));
  }
  if (!reply.contains("id") || reply["id"] != nlohmann::json(id)) {
    return data_loss("reply for another request (id " + reply.value("id", nlohmann::json()).dump() + ")");
  }
  return reply;
}

}  // namespace sparsecar::control
