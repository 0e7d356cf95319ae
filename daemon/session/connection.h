// Connection: one client of the session socket, from accept to close. Owns the client's socket,
// its control mapping (rings) and eventfds, and its tensor slots; does the socket side of the
// session protocol (session_protocol.h): reading and framing input (frames.h), refusing stray
// fds, sending a message with fds (SCM_RIGHTS), the Hello rules and the handshake's HelloAck, and
// posting Completions to the client's ring.
//
// What a message means for the daemon (client limits, registration, steps) is decided by the
// SessionServer and the StepCollector; a Connection only says what went wrong with this client.
// A broken client is not closed here: it is marked (mark_drop) and the server frees it at the
// end of its poll round.
//
// Thread-safety: none; the session thread owns every Connection.
#pragma once

#include <sys/types.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <utility>
#include <string>

#include "daemon/session/shm_mapping.h"
#include "sparsecar/common/clock.h"
#include "sparsecar/common/fd.h"
#include "sparsecar/common/session_protocol.h"
#include "sparsecar/common/shm_layout.h"
#include "sparsecar/common/status.h"

namespace sparsecar {

class Connection {
 public:
  enum class State { kAwaitHello, kReady };

  Connection(uint32_t id, Fd sock, pid_t peer_pid, uid_t peer_uid, Clock::time_point accepted)
      : id_(id), sock_(std::move(sock)), peer_pid_(peer_pid), peer_uid_(peer_uid), accepted_(accepted) {}
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  uint32_t id() const { return id_; }  // grows with accept order; the local-sum order
  pid_t peer_pid() const { return peer_pid_; }
  uid_t peer_uid() const { return peer_uid_; }
  State state() const { return state_; }
  bool ready() const { return state_ == State::kReady; }
  int sock() const { return sock_.get(); }
  int submission_efd() const { return sub_efd_.get(); }
  // "client 3 (pid 1234)": how logs and error messages name the client.
  std::string label() const;

  // Whether the handshake is overdue at `now`: no Hello more than `timeout` after the accept.
  bool handshake_overdue(Clock::time_point now, Clock::duration timeout) const {
    return state_ == State::kAwaitHello && now - accepted_ > timeout;
  }

  // ---- closing ----
  bool dropped() const { return drop_; }
  const std::string& drop_reason() const { return drop_reason_; }
  // Marks the connection to be freed at the end of the poll round; the first reason sticks.
  void mark_drop(std::string reason);
  // shutdown(SHUT_RDWR): the peer sees the close at once, before the server frees it.
  void shutdown();
  // Frees the client's shared memory (slots and control mapping); the socket stays until the
  // Connection goes.
  void release_memory();

  // ---- socket ----
  // Sends one message (`type`'s payload size, from session_protocol.h) with `nfds` fds
  // (SCM_RIGHTS, at most proto::kHelloFds). A send that fails or does not take the whole message
  // drops the connection (a partial message cannot be resumed); returns whether it was sent.
  bool send(proto::MsgType type, const void* payload, const int* fds, size_t nfds);
  // Reads what the socket has and calls `on_message` for each complete message, in order, until
  // the input is used up or the connection is dropped (on_message may drop it). A closed socket or
  // a socket error drops the connection. Returns the protocol error that stopped the reading (a
  // malformed frame, fds from the client): the caller reports it and drops the connection.
  using MessageHandler = std::function<void(const proto::MsgHeader&, const uint8_t* payload)>;
  std::optional<std::string> receive(const MessageHandler& on_message);

  // ---- handshake ----
  // What a Hello alone can break: protocol and shm versions, flags, and the peer's uid (only
  // the daemon's own uid or root). OK, or the status to refuse the client with.
  Status check_hello(const proto::Hello& hello) const;
  // Answers the Hello with a HelloAck carrying `st` and drops the connection.
  void refuse_hello(const Status& st);
  // Creates the control mapping and the two eventfds and sends them with an OK HelloAck. An
  // error means nothing was sent (refuse the client with it); OK means the client is ready(),
  // unless the send failed (then it is dropped).
  Status open_session(uint32_t local_clients);

  // ---- rings (ready connections) ----
  // Clears the submission eventfd before the ring is drained; false (and dropped) on an error.
  bool take_submission_wakeup();
  // Pops the next submission; false when the ring is empty or corrupt (`*corrupt` says which).
  bool pop_submission(shm::Submission* s, bool* corrupt) { return shm::ring_pop(ctl_->submissions, s, corrupt); }
  // Pushes `comp` on the completion ring and signals the client. Returns false when the ring is
  // full (a protocol error of the client: it does not consume its completions); a failing
  // eventfd drops the connection. Nothing is posted to a dropped connection or one without rings.
  bool post_completion(const shm::Completion& comp);

  // Ring not drained last round: poll again without waiting.
  bool more_submissions = false;
  // tensor id -> this client's slot (a mapping of 4 * count bytes).
  std::map<uint32_t, ShmMapping> slots;

 private:
  uint32_t id_;
  Fd sock_;
  pid_t peer_pid_;
  uid_t peer_uid_;
  Clock::time_point accepted_;
  State state_ = State::kAwaitHello;
  std::array<uint8_t, 2 * proto::kMaxMessageBytes> in_{};
  size_t in_used_ = 0;
  ShmMapping control_;
  shm::ShmControl* ctl_ = nullptr;
  Fd sub_efd_;
  Fd comp_efd_;
  bool drop_ = false;
  std::string drop_reason_;
};

}  // namespace sparsecar
