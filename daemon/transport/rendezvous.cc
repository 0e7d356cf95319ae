#include "daemon/transport/rendezvous.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <deque>
#include <optional>
#include <thread>

#include "sparsecar/common/clock_wait.h"
#include "sparsecar/common/fd.h"
#include "sparsecar/common/log.h"

namespace sparsecar::rendezvous {
namespace {

constexpr uint32_t kMagic = 0x5A524353;  // "SCRZ"
// v3: the dense ring in segments (WIRE.md, "The dense ring's messages"). v2's daemons send a ring
// phase as one message, which a v3 node refuses as data loss: such a job would form and then fail
// at its first ring step, so it is refused here, before it forms.
constexpr uint16_t kVersion = 3;
constexpr char kSameRelease[] = "every node of a job must run the same sparsecar release";
constexpr size_t kChallengeBytes = 8 + auth::kNonceBytes;                           // 40
constexpr size_t kHelloHeadBytes = 12 + auth::kNonceBytes + auth::kMac256Bytes;     // 76
constexpr size_t kHelloMacOffset = 12 + auth::kNonceBytes;                          // 44
constexpr size_t kHelloBodyFixedBytes = 24;
constexpr uint32_t kMaxLabel = 256;
constexpr uint32_t kMaxAddress = 64 * 1024;
constexpr uint32_t kMaxHelloBody = kHelloBodyFixedBytes + kMaxLabel + kMaxAddress;
constexpr uint32_t kMaxReason = 4096;
constexpr uint64_t kMaxWelcomeBody = uint64_t{256} << 20;
constexpr uint16_t kVerdictAccepted = 0;
constexpr uint16_t kVerdictRefused = 1;
constexpr uint16_t kVerdictReplacement = 2;  // welcome into a running formation, + u64 generation
constexpr char kHelloDomain[] = "sparsecar rendezvous hello v3";
constexpr char kWelcomeDomain[] = "sparsecar rendezvous welcome v3";
constexpr char kRefusalDomain[] = "sparsecar rendezvous refusal v3";
constexpr char kAuthFailed[] = "authentication failed";

// Milliseconds from now to `deadline` on `clock`; 0 once it has passed.
int remaining_ms(const Clock& clock, Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock.now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<long long>(left, 1 << 30));
}

// A poll() timeout for `deadline` on `clock`: remaining_ms, at most one kClockWaitSlice (the
// clock need not be real time; the caller looks at it again after the poll).
int poll_ms(const Clock& clock, Clock::time_point deadline) {
  return std::min(remaining_ms(clock, deadline), static_cast<int>(kClockWaitSlice.count()));
}

void put32(std::string& out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}
void put16(std::string& out, uint16_t v) {
  for (int i = 0; i < 2; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}
void put64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}
uint64_t get_le(const char* p, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= static_cast<uint64_t>(static_cast<unsigned char>(p[i])) << (8 * i);
  return v;
}

// Writes all of `data`, bounded by `deadline`.
Status write_all(int fd, const std::string& data, const Clock& clock, Clock::time_point deadline,
                 const std::string& who) {
  size_t done = 0;
  while (done < data.size()) {
    ssize_t n = ::send(fd, data.data() + done, data.size() - done, MSG_NOSIGNAL);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd, POLLOUT, 0};
      int left = poll_ms(clock, deadline);
      if (left == 0) return deadline_exceeded("rendezvous: timed out writing to " + who);
      int r = ::poll(&p, 1, left);
      if (r < 0 && errno != EINTR) return errno_status("rendezvous: poll on " + who, errno);
      continue;
    }
    return errno_status("rendezvous: send to " + who, errno);
  }
  return Status::Ok();
}

// Reads exactly `size` bytes, bounded by `deadline`.
Status read_exact(int fd, char* out, size_t size, const Clock& clock, Clock::time_point deadline,
                  const std::string& who) {
  size_t done = 0;
  while (done < size) {
    ssize_t n = ::recv(fd, out + done, size - done, 0);
    if (n > 0) {
      done += static_cast<size_t>(n);
      continue;
    }
    if (n == 0) return unavailable("rendezvous: " + who + " closed the connection");
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) {
      pollfd p{fd, POLLIN, 0};
      int left = poll_ms(clock, deadline);
      if (left == 0) return deadline_exceeded("rendezvous: timed out waiting for " + who);
      int r = ::poll(&p, 1, left);
      if (r < 0 && errno != EINTR) return errno_status("rendezvous: poll on " + who, errno);
      continue;
    }
    return errno_status("rendezvous: recv from " + who, errno);
  }
  return Status::Ok();
}

Expected<addrinfo*> resolve(const std::string& coordinator, bool passive) {
  std::string host, port;
  if (!split_host_port(coordinator, &host, &port)) {
    return invalid_argument("coordinator '" + coordinator + "' is not HOST:PORT");
  }
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  addrinfo* result = nullptr;
  int rc = ::getaddrinfo(host.empty() ? nullptr : host.c_str(), port.c_str(), &hints, &result);
  if (rc != 0) {
    return invalid_argument("cannot resolve coordinator '" + coordinator + "': " + gai_strerror(rc));
  }
  return result;
}

std::string sockaddr_text(const sockaddr* sa) {
  char host[INET6_ADDRSTRLEN] = "?";
  if (sa->sa_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(sa)->sin_addr, host, sizeof host);
  } else if (sa->sa_family == AF_INET6) {
    ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(sa)->sin6_addr, host, sizeof host);
  }
  return host;
}

std::span<const uint8_t> u8(const std::string& s) { return auth::bytes_of(std::string_view(s)); }
std::span<const uint8_t> u8(const char* p, size_t n) { return {reinterpret_cast<const uint8_t*>(p), n}; }
template <size_t N>
std::span<const uint8_t> domain(const char (&text)[N]) {
  return {reinterpret_cast<const uint8_t*>(text), N - 1};
}

// Logs at most a few lines per second of `clock` per kind; says how many it left out.
class RateLimitedLog {
 public:
  explicit RateLimitedLog(const Clock& clock) : clock_(clock) {}

  template <typename... Args>
  void warn(fmt::format_string<Args...> format, Args&&... args) {
    const auto now = clock_.now();
    if (now - window_start_ >= std::chrono::seconds(1)) {
      if (suppressed_ > 0) SC_LOG_WARN("rendezvous: {} similar lines suppressed", static_cast<unsigned long long>(suppressed_));
      window_start_ = now;
      in_window_ = 0;
      suppressed_ = 0;
    }
    if (in_window_++ < 5) {
      if (log_enabled(LogLevel::kWarn)) {
        log_write(LogLevel::kWarn, __FILE__, __LINE__, fmt::vformat(format, fmt::make_format_args(args...)));
      }
    } else {
      ++suppressed_;
    }
  }

 private:
  const Clock& clock_;
  Clock::time_point window_start_{};
  uint64_t in_window_ = 0;
  uint64_t suppressed_ = 0;
};

// "refused" message: header, reason, MAC over both nonces, the header and the reason.
std::string refusal_bytes(const auth::Key& key, const auth::Nonce& challenge, const auth::Nonce& nonce,
                          const std::string& reason) {
  std::string r = reason.substr(0, kMaxReason);
  std::string out;
  put32(out, kMagic);
  put16(out, kVersion);
  put16(out, kVerdictRefused);
  put32(out, static_cast<uint32_t>(r.size()));
  out += r;
  auth::Mac256 mac = auth::mac256(key, {domain(kRefusalDomain), challenge, nonce, u8(out)});
  out.append(reinterpret_cast<const char*>(mac.data()), mac.size());
  return out;
}

// The joiner's hello under the rendezvous key `key` (see the header: framing, nonce, MAC, body).
std::string hello_bytes(const HelloFields& h, const auth::Key& key, const auth::Nonce& challenge) {
  std::string body;
  put64(body, h.job_id);
  put32(body, h.world_size);
  put32(body, h.rank);
  const std::string label = h.label.substr(0, kMaxLabel);
  put32(body, static_cast<uint32_t>(label.size()));
  put32(body, static_cast<uint32_t>(h.address.size()));
  body += label;
  body += h.address;
  std::string hello;
  put32(hello, kMagic);
  put16(hello, kVersion);
  put16(hello, 0);
  put32(hello, static_cast<uint32_t>(body.size()));
  hello.append(reinterpret_cast<const char*>(h.nonce.data()), h.nonce.size());
  auth::Mac256 mac = auth::mac256(key, {domain(kHelloDomain), challenge, u8(hello), u8(body)});
  hello.append(reinterpret_cast<const char*>(mac.data()), mac.size());
  hello += body;
  return hello;
}

// ---- rank 0 ---------------------------------------------------------------------------------

struct Pending {
  Fd fd;
  std::string from;  // remote IP, for messages
  auth::Nonce challenge{};
  Clock::time_point accepted_at;
  std::string buf;
};

struct Hello {
  auth::Nonce nonce{};
  uint64_t job_id = 0;
  uint32_t world_size = 0;
  uint32_t rank = 0;
  std::string label;
  std::string address;
};

// The total size of the hello in `buf` once its framing is known: nullopt = need more bytes;
// error = not a v3 hello or a body out of bounds. Interprets nothing but the framing.
Expected<std::optional<size_t>> hello_size(const std::string& buf) {
  if (buf.size() < 12) return std::optional<size_t>{};
  const char* p = buf.data();
  const uint64_t version = get_le(p + 4, 2);
  if (get_le(p, 4) != kMagic || version == 0 || version > 99) {  // no echo of an outsider's bytes
    return invalid_argument("not a sparsecar rendezvous v3 hello");
  }
  if (version != kVersion) {
    return invalid_argument("a sparsecar rendezvous v" + std::to_string(version) + " hello; this rank 0 speaks v3 (" +
                            kSameRelease + ")");
  }
  const uint64_t body = get_le(p + 8, 4);
  if (body < kHelloBodyFixedBytes || body > kMaxHelloBody) return invalid_argument("malformed hello");
  return std::optional<size_t>{kHelloHeadBytes + body};
}

// Verifies the MAC of a complete hello, then parses it. Nothing is interpreted before the MAC
// has been checked.
Expected<Hello> open_hello(const std::string& buf, const auth::Key& key, const auth::Nonce& challenge) {
  const char* p = buf.data();
  const size_t body_len = static_cast<size_t>(get_le(p + 8, 4));
  std::span<const uint8_t> body = u8(p + kHelloHeadBytes, body_len);
  auth::Mac256 expect = auth::mac256(key, {domain(kHelloDomain), challenge, u8(p, kHelloMacOffset), body});
  if (!auth::equal(expect, u8(p + kHelloMacOffset, auth::kMac256Bytes))) return permission_denied(kAuthFailed);
  Hello h;
  std::memcpy(h.nonce.data(), p + 12, h.nonce.size());
  const char* b = p + kHelloHeadBytes;
  h.job_id = get_le(b, 8);
  h.world_size = static_cast<uint32_t>(get_le(b + 8, 4));
  h.rank = static_cast<uint32_t>(get_le(b + 12, 4));
  const uint64_t label_len = get_le(b + 16, 4);
  const uint64_t address_len = get_le(b + 20, 4);
  if (label_len > kMaxLabel || address_len > kMaxAddress || address_len == 0 ||
      kHelloBodyFixedBytes + label_len + address_len != body_len) {
    return invalid_argument("malformed hello");
  }
  h.label.assign(b + kHelloBodyFixedBytes, label_len);
  h.address.assign(b + kHelloBodyFixedBytes + label_len, address_len);
  return h;
}

// Best effort, never blocks: whoever is refused is not worth holding up the job for. Unread input
// is drained first (bounded) so that closing does not reset the connection before the peer has
// read the refusal.
void send_and_close(Pending& conn, const std::string& bytes) {
  const int fd = conn.fd.get();
  if (fd >= 0) {
    [[maybe_unused]] ssize_t n = ::send(fd, bytes.data(), bytes.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
    ::shutdown(fd, SHUT_WR);
    char sink[4096];
    for (int i = 0; i < 16 && ::recv(fd, sink, sizeof sink, MSG_DONTWAIT) > 0; ++i) {
    }
  }
  conn.fd.reset();
}

Expected<Fd> listen_on(const Options& o) {
  SC_ASSIGN_OR_RETURN(addrinfo * ai, resolve(o.coordinator, /*passive=*/true));
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(ai, &::freeaddrinfo);
  int last_errno = 0;
  for (addrinfo* a = ai; a != nullptr; a = a->ai_next) {
    Fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol));
    if (fd.get() < 0) {
      last_errno = errno;
      continue;
    }
    int one = 1;
    if (::setsockopt(fd.get(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof one) != 0) {
      return errno_status("rendezvous: setsockopt(SO_REUSEADDR)", errno);
    }
    if (::bind(fd.get(), a->ai_addr, a->ai_addrlen) != 0 || ::listen(fd.get(), 1024) != 0) {
      last_errno = errno;
      continue;
    }
    return fd;
  }
  Status s = errno_status("rendezvous: rank 0 cannot listen on " + o.coordinator, last_errno);
  SC_LOG_ERROR("{}", s.message());
  return s;
}

uint16_t bound_port(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return 0;
  if (ss.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  return ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
}

void bump(std::atomic<uint64_t> Stats::*counter, const Options& o) {
  if (o.stats != nullptr) (o.stats->*counter).fetch_add(1, std::memory_order_relaxed);
}

class Server {
 public:
  Server(const Options& o, const std::string& my_address, Clock::time_point deadline)
      : o_(o), clock_(*o.clock), key_(auth::rendezvous_key(o.key)), deadline_(deadline), table_(o.world_size),
        joined_(o.world_size) {
    table_[0] = Peer{o.label, my_address};
  }

  // The formation: waits until every rank has joined, then welcomes them all. With
  // `keep_listening` the listener stays open for serve().
  Expected<Formation> run(bool keep_listening = false) {
    SC_ASSIGN_OR_RETURN(listener_, listen_on(o_));
    reserve_ = Fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
    if (o_.on_listening) o_.on_listening(bound_port(listener_.get()));

    while (count_ < o_.world_size) {
      const auto now = clock_.now();
      if (now >= deadline_) return timed_out();
      expire(now);
      std::vector<pollfd> fds;
      const bool listening = now >= listener_paused_until_;
      fds.push_back({listening ? listener_.get() : -1, POLLIN, 0});
      for (auto& p : pending_) fds.push_back({p.fd.get(), POLLIN, 0});
      for (uint32_t r = 1; r < o_.world_size; ++r) fds.push_back({joined_[r].fd.get(), POLLIN, 0});
      // Wake for the next hello deadline, a paused listener or the job's deadline.
      auto wake = deadline_;
      if (!pending_.empty()) wake = std::min(wake, pending_.front().accepted_at + o_.hello_timeout);
      if (!listening) wake = std::min(wake, listener_paused_until_);
      int r = ::poll(fds.data(), fds.size(), std::max(1, poll_ms(clock_, wake)));
      if (r < 0) {
        if (errno == EINTR) continue;
        return errno_status("rendezvous: poll", errno);
      }
      // Joined ranks send nothing more: readable means they hung up (or misbehave). Free the slot
      // so a restarted rank can take it.
      for (uint32_t rank = 1; rank < o_.world_size; ++rank) {
        const pollfd& f = fds[1 + pending_.size() + rank - 1];
        if (f.revents == 0 || joined_[rank].fd.get() < 0) continue;
        SC_LOG_WARN("rendezvous: rank {} ({}) hung up before the job was complete; its slot is free again", rank,
                    table_[rank].label);
        joined_[rank].fd.reset();
        table_[rank] = Peer{};
        --count_;
      }
      for (size_t i = 0; i < pending_.size(); ++i) {
        if (fds[1 + i].revents != 0) read_from(pending_[i]);
      }
      std::erase_if(pending_, [](const Pending& p) { return p.fd.get() < 0; });
      if (fds[0].revents & POLLIN) accept_all();
    }
    if (!keep_listening) listener_.reset();
    // Anyone still half-way through a hello is late: the job is complete.
    for (auto& p : pending_) send_and_close(p, refusal_bytes(key_, p.challenge, auth::Nonce{}, "the job is already complete"));
    pending_.clear();
    auto formed = welcome();
    if (formed.ok()) {
      formation_id_ = formed->formation_id;
      table_ = formed->peers;
      joined_.clear();  // every rank has its table: the formation's connections are done
      formed_ = true;
    }
    return formed;
  }

  // After run(keep_listening = true): admits replacements for lost ranks (Coordinator) until
  // `stop_fd` becomes readable. Same limits as the formation: max_pending, hello_timeout, the
  // reserve descriptor.
  void serve(int stop_fd, Coordinator::IsDown is_down, Coordinator::Admit admit) {
    is_down_ = std::move(is_down);
    admit_ = std::move(admit);
    for (;;) {
      const auto now = clock_.now();
      expire(now);
      std::vector<pollfd> fds;
      const bool listening = now >= listener_paused_until_;
      fds.push_back({stop_fd, POLLIN, 0});
      fds.push_back({listening ? listener_.get() : -1, POLLIN, 0});
      for (auto& p : pending_) fds.push_back({p.fd.get(), POLLIN, 0});
      int timeout = -1;
      if (!pending_.empty()) timeout = std::max(1, poll_ms(clock_, pending_.front().accepted_at + o_.hello_timeout));
      if (!listening) timeout = timeout < 0 ? std::max(1, poll_ms(clock_, listener_paused_until_))
                                            : std::min(timeout, std::max(1, poll_ms(clock_, listener_paused_until_)));
      int r = ::poll(fds.data(), fds.size(), timeout);
      if (r < 0) {
        if (errno == EINTR) continue;
        SC_LOG_ERROR("rendezvous: poll: {}; no more replacements are admitted", std::strerror(errno));
        return;
      }
      if (fds[0].revents != 0) return;
      for (size_t i = 0; i < pending_.size(); ++i) {
        if (fds[2 + i].revents != 0) read_from(pending_[i]);
      }
      std::erase_if(pending_, [](const Pending& p) { return p.fd.get() < 0; });
      if (fds[1].revents & POLLIN) accept_all();
    }
  }

 private:
  Status timed_out() const {
    std::string missing;
    for (uint32_t r = 1; r < o_.world_size; ++r) {
      if (joined_[r].fd.get() < 0) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
    }
    return deadline_exceeded("rendezvous: only " + std::to_string(count_) + " of " + std::to_string(o_.world_size) +
                             " ranks joined at " + o_.coordinator + " within " + std::to_string(o_.timeout.count()) +
                             " ms; missing rank(s) " + missing);
  }

  // Closes connections whose hello is overdue.
  void expire(Clock::time_point now) {
    while (!pending_.empty() && now - pending_.front().accepted_at >= o_.hello_timeout) {
      shed_log_.warn("rendezvous: closing the connection from {}: no hello within {} ms",
                     pending_.front().from, static_cast<long long>(o_.hello_timeout.count()));
      bump(&Stats::shed, o_);
      pending_.pop_front();
    }
  }

  void accept_all() {
    for (;;) {
      sockaddr_storage ss{};
      socklen_t len = sizeof ss;
      int c = ::accept4(listener_.get(), reinterpret_cast<sockaddr*>(&ss), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
      if (c < 0) {
        if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;
        if (errno == EMFILE || errno == ENFILE) {
          out_of_fds();
          return;
        }
        if (errno != EAGAIN && errno != EWOULDBLOCK) {
          // ENOBUFS/ENOMEM and the like: back off briefly instead of spinning on a readable listener.
          SC_LOG_WARN("rendezvous: accept: {}", std::strerror(errno));
          listener_paused_until_ = clock_.now() + std::chrono::milliseconds(10);
        }
        return;
      }
      Pending p;
      p.fd = Fd(c);
      p.from = sockaddr_text(reinterpret_cast<sockaddr*>(&ss));
      p.accepted_at = clock_.now();
      p.challenge = auth::random_array<auth::kNonceBytes>();
      std::string challenge;
      put32(challenge, kMagic);
      put16(challenge, kVersion);
      put16(challenge, 0);
      challenge.append(reinterpret_cast<const char*>(p.challenge.data()), p.challenge.size());
      // A fresh socket's send buffer always takes 40 bytes; if not, the peer is not worth waiting for.
      ssize_t n = ::send(c, challenge.data(), challenge.size(), MSG_DONTWAIT | MSG_NOSIGNAL);
      if (n != static_cast<ssize_t>(challenge.size())) continue;
      if (pending_.size() >= o_.max_pending) {
        shed_log_.warn("rendezvous: {} connections are waiting for their hello; closing the oldest (from {})",
                       pending_.size(), pending_.front().from);
        bump(&Stats::shed, o_);
        pending_.pop_front();
      }
      pending_.push_back(std::move(p));
    }
  }

  // accept() failed for lack of file descriptors: the connection would stay in the backlog and
  // keep the listener readable forever. Use the reserve descriptor to accept and close it, and
  // close the oldest waiting connection so the next one (maybe a real rank) finds room.
  void out_of_fds() {
    bump(&Stats::shed, o_);
    if (!pending_.empty()) {
      shed_log_.warn("rendezvous: out of file descriptors; closing the oldest waiting connection (from {})",
                     pending_.front().from);
      pending_.pop_front();
      return;  // that freed one: the next accept() succeeds
    }
    if (reserve_.get() >= 0) {
      reserve_.reset();
      int c = ::accept4(listener_.get(), nullptr, nullptr, SOCK_CLOEXEC);
      if (c >= 0) ::close(c);
      reserve_ = Fd(::open("/dev/null", O_RDONLY | O_CLOEXEC));
      shed_log_.warn("rendezvous: out of file descriptors; refused a connection");
      if (c >= 0) return;
    }
    // Nothing to free: do not spin on the readable listener; look again shortly.
    listener_paused_until_ = clock_.now() + std::chrono::milliseconds(50);
  }

  void read_from(Pending& conn) {
    char chunk[4096];
    size_t want = chunk_want(conn);
    ssize_t n = ::recv(conn.fd.get(), chunk, std::min(want, sizeof chunk), 0);
    if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR && errno != EWOULDBLOCK)) {
      SC_LOG_DEBUG("rendezvous: connection from {} closed before its hello arrived", conn.from);
      conn.fd.reset();
      return;
    }
    if (n < 0) return;
    conn.buf.append(chunk, static_cast<size_t>(n));
    auto size = hello_size(conn.buf);
    if (!size.ok()) {
      bump(&Stats::malformed, o_);
      refuse_log_.warn("rendezvous: refusing {}: {}", conn.from, size.status().message());
      send_and_close(conn, refusal_bytes(key_, conn.challenge, auth::Nonce{}, size.status().message()));
      return;
    }
    if (!size->has_value() || conn.buf.size() < **size) return;
    auto hello = open_hello(conn.buf, key_, conn.challenge);
    if (!hello.ok()) {
      auth::Nonce nonce{};
      std::memcpy(nonce.data(), conn.buf.data() + 12, nonce.size());
      if (hello.status().code() == Code::kPermissionDenied) {
        bump(&Stats::auth_failures, o_);
        refuse_log_.warn("rendezvous: authentication failed for a hello from {} (wrong or missing job secret)",
                         conn.from);
      } else {
        bump(&Stats::malformed, o_);
        refuse_log_.warn("rendezvous: refusing {}: {}", conn.from, hello.status().message());
      }
      send_and_close(conn, refusal_bytes(key_, conn.challenge, nonce, hello.status().message()));
      return;
    }
    admit(conn, std::move(*hello));
  }

  // Bytes still missing from conn's hello (at most the largest hello), so nothing beyond it is read.
  static size_t chunk_want(const Pending& conn) {
    auto size = hello_size(conn.buf);
    size_t total = size.ok() && size->has_value() ? **size : 12;
    return total > conn.buf.size() ? total - conn.buf.size() : 1;
  }

  void admit(Pending& conn, Hello h) {
    // The hello is authentic: say what is wrong, but never rank 0's own values.
    const std::string who = "rank " + std::to_string(h.rank) + " (" + h.label + " from " + conn.from + ")";
    std::string reason;
    if (h.job_id != o_.job_id) {
      reason = "this rank's job id differs from rank 0's";
    } else if (h.world_size != o_.world_size) {
      reason = "this rank's world size differs from rank 0's";
    } else if (h.rank == 0 || h.rank >= o_.world_size) {
      reason = "rank " + std::to_string(h.rank) + " is out of range for this job";
    } else if (formed_ && !is_down_(h.rank)) {
      reason = "rank " + std::to_string(h.rank) + " is alive in the running job (only a replacement for a lost rank is "
               "admitted)";
    } else if (!formed_ && joined_[h.rank].fd.get() >= 0) {
      reason = "rank " + std::to_string(h.rank) + " has already joined";
    }
    if (!reason.empty()) {
      bump(&Stats::refused, o_);
      refuse_log_.warn("rendezvous: refusing {}: {}", who, reason);
      send_and_close(conn, refusal_bytes(key_, conn.challenge, h.nonce, reason));
      return;
    }
    if (formed_) {
      replace(conn, std::move(h), who);
      return;
    }
    table_[h.rank] = Peer{h.label + " via " + conn.from, std::move(h.address)};
    joined_[h.rank].fd = std::move(conn.fd);
    joined_[h.rank].challenge = conn.challenge;
    joined_[h.rank].nonce = h.nonce;
    ++count_;
    SC_LOG_DEBUG("rendezvous: {} joined ({} of {})", who, count_, o_.world_size);
  }

  // A replacement for lost rank h.rank, authenticated and checked like a formation's join: rank
  // 0 makes itself ready for it first (admit_: new endpoint, the other ranks told), then sends it
  // the current table, the formation id and its generation.
  void replace(Pending& conn, Hello h, const std::string& who) {
    const uint32_t rank = h.rank;
    Peer entry{h.label + " via " + conn.from, std::move(h.address)};
    auto generation = admit_(Replacement{rank, entry.label, entry.address});
    if (!generation.ok()) {
      bump(&Stats::refused, o_);
      refuse_log_.warn("rendezvous: not admitting {} as a replacement: {}", who,
                       generation.status().message());
      send_and_close(conn, refusal_bytes(key_, conn.challenge, h.nonce, generation.status().message()));
      return;
    }
    table_[rank] = std::move(entry);
    Formation f;
    f.formation_id = formation_id_;
    f.peers = table_;
    std::string body = encode_welcome_body(f);
    put64(body, *generation);
    const std::string out = verdict_bytes(kVerdictReplacement, conn.challenge, h.nonce, body);
    Status s = write_all(conn.fd.get(), out, clock_, clock_.now() + o_.hello_timeout, who);
    if (!s.ok()) {
      // Rank 0 is ready for a process that went away: its endpoint fails and the rank stays lost.
      SC_LOG_ERROR("rendezvous: cannot send the table to replacement {}: {}", who, s.message());
    } else {
      SC_LOG_INFO("rendezvous: admitted {} as the replacement for lost rank {} (generation {})", who, rank,
                  static_cast<unsigned long long>(*generation));
    }
    conn.fd.reset();
  }

  std::string verdict_bytes(uint16_t verdict, const auth::Nonce& challenge, const auth::Nonce& nonce,
                            const std::string& body) const {
    std::string head;
    put32(head, kMagic);
    put16(head, kVersion);
    put16(head, verdict);
    put32(head, static_cast<uint32_t>(body.size()));
    auth::Mac256 mac = auth::mac256(key_, {domain(kWelcomeDomain), challenge, nonce, u8(head), u8(body)});
    return head + body + std::string(reinterpret_cast<const char*>(mac.data()), mac.size());
  }

  Expected<Formation> welcome() {
    Formation f;
    f.formation_id = auth::random_array<auth::kNonceBytes>();
    f.peers = std::move(table_);
    const std::string body = encode_welcome_body(f);
    for (uint32_t r = 1; r < o_.world_size; ++r) {
      Joined& j = joined_[r];
      const std::string out = verdict_bytes(kVerdictAccepted, j.challenge, j.nonce, body);
      Status s = write_all(j.fd.get(), out, clock_, deadline_, "rank " + std::to_string(r));
      if (!s.ok()) {
        SC_LOG_ERROR("rendezvous: cannot send the address table to rank {} ({}): {}", r, f.peers[r].label,
                     s.message());
        return s.with_context("rendezvous");
      }
    }
    return f;
  }

  struct Joined {
    Fd fd;
    auth::Nonce challenge{};
    auth::Nonce nonce{};
  };

  const Options o_;  // a copy: serve() outlives the caller's options
  const Clock& clock_;
  const auth::Key key_;
  const Clock::time_point deadline_;
  std::vector<Peer> table_;
  std::vector<Joined> joined_;  // joined_[r].fd valid once rank r is accepted
  bool formed_ = false;         // run() has welcomed everyone: hellos are replacements now
  auth::Nonce formation_id_{};
  Coordinator::IsDown is_down_;
  Coordinator::Admit admit_;
  uint32_t count_ = 1;
  std::deque<Pending> pending_;  // oldest first
  Fd listener_;
  Fd reserve_;  // a spare descriptor, given up to accept-and-close when none is left
  Clock::time_point listener_paused_until_{};
  RateLimitedLog refuse_log_{clock_};
  RateLimitedLog shed_log_{clock_};
};

// ---- ranks 1..W-1 ---------------------------------------------------------------------------

// One connect attempt, bounded by `deadline`; returns the connected socket or the errno.
Expected<Fd> try_connect(const addrinfo* a, const Clock& clock, Clock::time_point deadline) {
  Fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol));
  if (fd.get() < 0) return errno_status("socket", errno);
  if (::connect(fd.get(), a->ai_addr, a->ai_addrlen) == 0) return fd;
  if (errno != EINPROGRESS) return errno_status("connect", errno);
  pollfd p{fd.get(), POLLOUT, 0};
  int left = std::min(remaining_ms(clock, deadline), 1000);
  int r = ::poll(&p, 1, left);
  if (r == 0) return deadline_exceeded("connect timed out");
  if (r < 0) return errno_status("poll", errno);
  int err = 0;
  socklen_t len = sizeof err;
  if (::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) return errno_status("getsockopt", errno);
  if (err != 0) return errno_status("connect", err);
  return fd;
}

// The connection went away before a verdict (rank 0 shedding load, or restarting): try again.
bool retryable(const Status& s) { return s.code() == Code::kUnavailable; }

class Joiner {
 public:
  Joiner(const Options& o, const std::string& my_address, Clock::time_point deadline)
      : o_(o), clock_(*o.clock), my_address_(my_address), key_(auth::rendezvous_key(o.key)), deadline_(deadline),
        who_("rank 0 at " + o.coordinator) {}

  Expected<Formation> run() {
    SC_ASSIGN_OR_RETURN(addrinfo * ai, resolve(o_.coordinator, /*passive=*/false));
    std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(ai, &::freeaddrinfo);
    auto backoff = std::chrono::milliseconds(10);
    Status last = unavailable("no address");
    for (;;) {
      Fd fd;
      for (const addrinfo* a = ai; a != nullptr && fd.get() < 0; a = a->ai_next) {
        auto attempt = try_connect(a, clock_, deadline_);
        if (attempt.ok()) {
          fd = std::move(*attempt);
        } else {
          last = attempt.status();
        }
      }
      if (fd.get() >= 0) {
        auto result = exchange(fd.get());
        if (result.ok() || !retryable(result.status())) return result;
        last = result.status();
        SC_LOG_DEBUG("rendezvous: {}; reconnecting", last.message());
      }
      int left = remaining_ms(clock_, deadline_);
      if (left == 0) {
        return deadline_exceeded("rendezvous: rank " + std::to_string(o_.rank) + " could not reach " + who_ +
                                 " within " + std::to_string(o_.timeout.count()) + " ms (last error: " +
                                 last.message() + ")");
      }
      // Rank 0 may simply not be up yet (or be shedding load): back off and retry.
      std::this_thread::sleep_for(std::min(backoff, std::chrono::milliseconds(left)));
      backoff = std::min(backoff * 2, std::chrono::milliseconds(250));
    }
  }

 private:
  // One exchange on a connected socket. UNAVAILABLE = the connection went away (retry).
  Expected<Formation> exchange(int fd) {
    int one = 1;
    ::setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    char challenge_bytes[kChallengeBytes];
    Status s = read_exact(fd, challenge_bytes, sizeof challenge_bytes, clock_, deadline_, who_);
    if (s.code() == Code::kDeadlineExceeded) {
      return deadline_exceeded("rendezvous: " + who_ + " sent no challenge within " + std::to_string(o_.timeout.count()) +
                               " ms (an older sparsecar speaking rendezvous v1, or not sparsecar?)");
    }
    SC_RETURN_IF_ERROR(s);
    if (get_le(challenge_bytes, 4) != kMagic) {
      return failed_precondition("rendezvous: " + who_ + " does not speak sparsecar rendezvous");
    }
    if (const uint64_t v = get_le(challenge_bytes + 4, 2); v != kVersion) {
      return failed_precondition("rendezvous: " + who_ + " speaks sparsecar rendezvous v" + std::to_string(v) +
                                 ", this daemon v3 (" + kSameRelease + ")");
    }
    auth::Nonce challenge{};
    std::memcpy(challenge.data(), challenge_bytes + 8, challenge.size());
    const auth::Nonce nonce = auth::random_array<auth::kNonceBytes>();
    const std::string hello = hello_bytes(
        HelloFields{o_.job_id, o_.world_size, o_.rank, o_.label, my_address_, nonce}, key_, challenge);
    SC_RETURN_IF_ERROR(write_all(fd, hello, clock_, deadline_, who_));

    char head[12];
    SC_RETURN_IF_ERROR(read_exact(fd, head, sizeof head, clock_, deadline_, who_));
    if (get_le(head, 4) != kMagic || get_le(head + 4, 2) != kVersion) {
      return data_loss("rendezvous: " + who_ + " answered with a bad magic or version");
    }
    const uint16_t verdict = static_cast<uint16_t>(get_le(head + 6, 2));
    const uint64_t len = get_le(head + 8, 4);
    if (verdict == kVerdictRefused) {
      if (len > kMaxReason) return data_loss("rendezvous: " + who_ + " sent an oversized refusal");
      std::string reason(len, '\0');
      char their_mac[auth::kMac256Bytes];
      SC_RETURN_IF_ERROR(read_exact(fd, reason.data(), len, clock_, deadline_, who_));
      SC_RETURN_IF_ERROR(read_exact(fd, their_mac, sizeof their_mac, clock_, deadline_, who_));
      auth::Mac256 expect = auth::mac256(key_, {domain(kRefusalDomain), challenge, nonce, u8(head, sizeof head), u8(reason)});
      for (char& c : reason) {
        if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) == 0x7f) c = '?';
      }
      if (!auth::equal(expect, u8(their_mac, sizeof their_mac))) {
        Status st = permission_denied("rendezvous: " + who_ + " refused rank " + std::to_string(o_.rank) +
                                      " without proving it holds the job secret (\"" + reason +
                                      "\"): authentication failed; is job_secret_file the same on every node?");
        SC_LOG_ERROR("{}", st.message());
        return st;
      }
      SC_LOG_ERROR("rendezvous: refused by {}: {}", who_, reason);
      return failed_precondition("rendezvous refused by " + who_ + ": " + reason);
    }
    if (verdict != kVerdictAccepted && verdict != kVerdictReplacement) {
      return data_loss("rendezvous: " + who_ + " sent unknown verdict " + std::to_string(verdict));
    }
    const uint64_t extra = verdict == kVerdictReplacement ? 8 : 0;  // the generation
    const uint64_t limit = std::min<uint64_t>(
        kMaxWelcomeBody, 36 + extra + uint64_t{o_.world_size} * (8 + 2 * kMaxLabel + 64 + kMaxAddress));
    if (len < 36 + extra || len > limit) return data_loss("rendezvous: " + who_ + " sent a table of impossible size");
    std::string body_in(len, '\0');
    char their_mac[auth::kMac256Bytes];
    SC_RETURN_IF_ERROR(read_exact(fd, body_in.data(), len, clock_, deadline_, who_));
    SC_RETURN_IF_ERROR(read_exact(fd, their_mac, sizeof their_mac, clock_, deadline_, who_));
    auth::Mac256 expect = auth::mac256(key_, {domain(kWelcomeDomain), challenge, nonce, u8(head, sizeof head), u8(body_in)});
    if (!auth::equal(expect, u8(their_mac, sizeof their_mac))) {
      Status st = permission_denied("rendezvous: " + who_ +
                                    " could not prove it holds the job secret (authentication failed); its table "
                                    "is ignored. Is job_secret_file the same on every node?");
      SC_LOG_ERROR("{}", st.message());
      return st;
    }
    uint64_t generation = 0;
    if (verdict == kVerdictReplacement) {
      generation = get_le(body_in.data() + body_in.size() - 8, 8);
      body_in.resize(body_in.size() - 8);
      if (generation == 0) return data_loss("rendezvous: " + who_ + " admitted this rank as a replacement of generation 0");
    }
    SC_ASSIGN_OR_RETURN(Formation f, parse_welcome_body(body_in, o_.world_size, o_.rank, my_address_, who_));
    f.generation = generation;
    return f;
  }

  const Options& o_;
  const Clock& clock_;
  const std::string& my_address_;
  const auth::Key key_;
  const Clock::time_point deadline_;
  const std::string who_;
};

}  // namespace

Status check_hello(std::span<const uint8_t> bytes, const auth::JobKey& key, const auth::Nonce& challenge) {
  const std::string buf(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  SC_ASSIGN_OR_RETURN(std::optional<size_t> size, hello_size(buf));
  if (!size.has_value() || buf.size() != *size) return invalid_argument("incomplete hello");
  return open_hello(buf, auth::rendezvous_key(key), challenge).status();
}

std::string encode_hello(const HelloFields& hello, const auth::JobKey& key, const auth::Nonce& challenge) {
  return hello_bytes(hello, auth::rendezvous_key(key), challenge);
}

std::string encode_welcome_body(const Formation& formation) {
  std::string body(reinterpret_cast<const char*>(formation.formation_id.data()), formation.formation_id.size());
  put32(body, static_cast<uint32_t>(formation.peers.size()));
  for (const Peer& p : formation.peers) {
    put32(body, static_cast<uint32_t>(p.label.size()));
    put32(body, static_cast<uint32_t>(p.address.size()));
    body += p.label;
    body += p.address;
  }
  return body;
}

Expected<Formation> parse_welcome_body(std::string_view body, uint32_t world_size, uint32_t rank,
                                       std::string_view my_address, const std::string& who) {
  auto bad = [&] { return data_loss("rendezvous: " + who + " sent a malformed table"); };
  Formation f;
  if (body.size() < f.formation_id.size() + 4 || rank >= world_size) return bad();
  std::memcpy(f.formation_id.data(), body.data(), f.formation_id.size());
  size_t pos = f.formation_id.size();
  if (get_le(body.data() + pos, 4) != world_size) return bad();
  pos += 4;
  // Every entry takes at least 8 bytes: a world size the body cannot hold allocates nothing.
  if ((body.size() - pos) / 8 < world_size) return bad();
  f.peers.resize(world_size);
  for (uint32_t r = 0; r < world_size; ++r) {
    if (body.size() - pos < 8) return bad();
    const uint64_t label_len = get_le(body.data() + pos, 4);
    const uint64_t address_len = get_le(body.data() + pos + 4, 4);
    pos += 8;
    if (label_len > 2 * kMaxLabel + 64 || address_len > kMaxAddress || body.size() - pos < label_len + address_len) {
      return bad();
    }
    f.peers[r].label = std::string(body.substr(pos, label_len));
    f.peers[r].address = std::string(body.substr(pos + label_len, address_len));
    pos += label_len + address_len;
  }
  if (pos != body.size() || f.peers[rank].address != my_address) return bad();
  return f;
}

bool split_host_port(const std::string& text, std::string* host, std::string* port) {
  size_t colon;
  if (!text.empty() && text.front() == '[') {
    size_t close = text.find(']');
    if (close == std::string::npos || close + 1 >= text.size() || text[close + 1] != ':') return false;
    *host = text.substr(1, close - 1);
    colon = close + 1;
  } else {
    colon = text.rfind(':');
    if (colon == std::string::npos) return false;
    *host = text.substr(0, colon);
  }
  *port = text.substr(colon + 1);
  if (port->empty() || port->size() > 5) return false;
  for (char c : *port) {
    if (c < '0' || c > '9') return false;
  }
  return std::stoul(*port) <= 65535;
}

struct Coordinator::State {
  Server server;
  int stop_fd = -1;
  std::thread thread;
  State(const Options& o, const std::string& my_address) : server(o, my_address, o.clock->now() + o.timeout) {}
};

Expected<std::unique_ptr<Coordinator>> Coordinator::form(const Options& o, const std::string& my_address,
                                                         Formation* formation) {
  if (o.rank != 0 || o.world_size < 2) return invalid_argument("only rank 0 of a job of several ranks coordinates");
  auto state = std::make_unique<State>(o, my_address);
  SC_ASSIGN_OR_RETURN(*formation, state->server.run(/*keep_listening=*/true));
  state->stop_fd = ::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (state->stop_fd < 0) return errno_status("rendezvous: eventfd", errno);
  return std::unique_ptr<Coordinator>(new Coordinator(std::move(state)));
}

Coordinator::Coordinator(std::unique_ptr<State> state) : state_(std::move(state)) {}

void Coordinator::serve(IsDown is_down, Admit admit) {
  if (state_->thread.joinable()) return;
  state_->thread = std::thread([s = state_.get(), is_down = std::move(is_down), admit = std::move(admit)]() mutable {
    s->server.serve(s->stop_fd, std::move(is_down), std::move(admit));
  });
}

void Coordinator::stop() {
  if (!state_) return;
  if (state_->thread.joinable()) {
    uint64_t one = 1;
    [[maybe_unused]] ssize_t n = ::write(state_->stop_fd, &one, sizeof one);
    state_->thread.join();
  }
}

Coordinator::~Coordinator() {
  stop();
  if (state_ && state_->stop_fd >= 0) ::close(state_->stop_fd);
}

Expected<Formation> run(const Options& o, const std::string& my_address) {
  if (o.world_size == 0 || o.rank >= o.world_size) {
    return invalid_argument("rank " + std::to_string(o.rank) + " is not below world size " + std::to_string(o.world_size));
  }
  const auto deadline = o.clock->now() + o.timeout;
  if (o.world_size == 1) {
    Formation f;
    f.peers.push_back(Peer{o.label, my_address});
    f.formation_id = auth::random_array<auth::kNonceBytes>();
    return f;
  }
  if (o.rank == 0) return Server(o, my_address, deadline).run();
  return Joiner(o, my_address, deadline).run();
}

}  // namespace sparsecar::rendezvous
