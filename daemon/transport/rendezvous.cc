#include "daemon/transport/rendezvous.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>
#include <thread>

#include "sparsecar/common/log.h"

namespace sparsecar::rendezvous {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint32_t kMagic = 0x5A524353;  // "SCRZ"
constexpr uint16_t kVersion = 1;
constexpr size_t kHelloFixedBytes = 32;
constexpr uint32_t kMaxLabel = 256;
constexpr uint32_t kMaxAddress = 64 * 1024;
constexpr uint32_t kMaxReason = 4096;
constexpr uint32_t kVerdictAccepted = 0;
constexpr uint32_t kVerdictRefused = 1;

// Owns a file descriptor.
class Fd {
 public:
  Fd() = default;
  explicit Fd(int fd) : fd_(fd) {}
  Fd(Fd&& other) noexcept : fd_(std::exchange(other.fd_, -1)) {}
  Fd& operator=(Fd&& other) noexcept {
    if (this != &other) {
      reset();
      fd_ = std::exchange(other.fd_, -1);
    }
    return *this;
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  ~Fd() { reset(); }
  int get() const { return fd_; }
  void reset() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
  }

 private:
  int fd_ = -1;
};

int remaining_ms(Clock::time_point deadline) {
  auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return left <= 0 ? 0 : static_cast<int>(std::min<long long>(left, 1 << 30));
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
Status write_all(int fd, const std::string& data, Clock::time_point deadline, const std::string& who) {
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
      int left = remaining_ms(deadline);
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
Status read_exact(int fd, char* out, size_t size, Clock::time_point deadline, const std::string& who) {
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
      int left = remaining_ms(deadline);
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

// ---- rank 0 ---------------------------------------------------------------------------------

struct Pending {
  Fd fd;
  std::string from;  // remote IP, for messages
  std::string buf;
};

struct Hello {
  uint64_t job_id;
  uint32_t world_size;
  uint32_t rank;
  std::string label;
  std::string address;
};

// Parses a complete hello from `buf`; nullopt = need more bytes; error = malformed.
Expected<std::optional<Hello>> parse_hello(const std::string& buf) {
  if (buf.size() < kHelloFixedBytes) return std::optional<Hello>{};
  const char* p = buf.data();
  if (get_le(p, 4) != kMagic) return invalid_argument("not a sparsecar rendezvous hello (bad magic)");
  if (get_le(p + 4, 2) != kVersion) {
    return invalid_argument("rendezvous protocol version " + std::to_string(get_le(p + 4, 2)) +
                            ", rank 0 speaks " + std::to_string(kVersion));
  }
  Hello h;
  h.job_id = get_le(p + 8, 8);
  h.world_size = static_cast<uint32_t>(get_le(p + 16, 4));
  h.rank = static_cast<uint32_t>(get_le(p + 20, 4));
  uint32_t label_len = static_cast<uint32_t>(get_le(p + 24, 4));
  uint32_t address_len = static_cast<uint32_t>(get_le(p + 28, 4));
  if (label_len > kMaxLabel || address_len > kMaxAddress || address_len == 0) {
    return invalid_argument("hello has label_len " + std::to_string(label_len) + " / address_len " +
                            std::to_string(address_len) + " outside the limits");
  }
  if (buf.size() < kHelloFixedBytes + label_len + address_len) return std::optional<Hello>{};
  h.label.assign(p + kHelloFixedBytes, label_len);
  h.address.assign(p + kHelloFixedBytes + label_len, address_len);
  return std::optional<Hello>{std::move(h)};
}

void refuse(Pending& conn, const std::string& reason, Clock::time_point deadline) {
  SC_LOG_WARN("rendezvous: refusing %s: %s", conn.from.c_str(), reason.c_str());
  std::string out;
  put32(out, kMagic);
  put32(out, kVerdictRefused);
  std::string r = reason.substr(0, kMaxReason);
  put32(out, static_cast<uint32_t>(r.size()));
  out += r;
  // Best effort and short: the refused peer is not worth holding up the job for.
  auto bound = std::min(deadline, Clock::now() + std::chrono::seconds(1));
  write_all(conn.fd.get(), out, bound, conn.from).ignore();
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
  SC_LOG_ERROR("%s", s.message().c_str());
  return s;
}

uint16_t bound_port(int fd) {
  sockaddr_storage ss{};
  socklen_t len = sizeof ss;
  if (::getsockname(fd, reinterpret_cast<sockaddr*>(&ss), &len) != 0) return 0;
  if (ss.ss_family == AF_INET) return ntohs(reinterpret_cast<sockaddr_in*>(&ss)->sin_port);
  return ntohs(reinterpret_cast<sockaddr_in6*>(&ss)->sin6_port);
}

Expected<std::vector<Peer>> serve(const Options& o, const std::string& my_address, Clock::time_point deadline) {
  SC_ASSIGN_OR_RETURN(Fd listener, listen_on(o));
  if (o.on_listening) o.on_listening(bound_port(listener.get()));

  std::vector<Peer> table(o.world_size);
  std::vector<Pending> joined(o.world_size);  // joined[r].fd valid once rank r is accepted
  table[0] = Peer{o.label, my_address};
  uint32_t count = 1;
  std::vector<Pending> pending;

  while (count < o.world_size) {
    int left = remaining_ms(deadline);
    if (left == 0) {
      std::string missing;
      for (uint32_t r = 1; r < o.world_size; ++r) {
        if (joined[r].fd.get() < 0) missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      }
      return deadline_exceeded("rendezvous: only " + std::to_string(count) + " of " + std::to_string(o.world_size) +
                               " ranks joined at " + o.coordinator + " within " +
                               std::to_string(o.timeout.count()) + " ms; missing rank(s) " + missing);
    }
    std::vector<pollfd> fds;
    fds.push_back({listener.get(), POLLIN, 0});
    for (auto& p : pending) fds.push_back({p.fd.get(), POLLIN, 0});
    int r = ::poll(fds.data(), fds.size(), left);
    if (r < 0) {
      if (errno == EINTR) continue;
      return errno_status("rendezvous: poll", errno);
    }
    if (fds[0].revents & POLLIN) {
      for (;;) {
        sockaddr_storage ss{};
        socklen_t len = sizeof ss;
        int c = ::accept4(listener.get(), reinterpret_cast<sockaddr*>(&ss), &len, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (c < 0) break;  // EAGAIN (or a transient error): poll again
        pending.push_back(Pending{Fd(c), sockaddr_text(reinterpret_cast<sockaddr*>(&ss)), {}});
      }
    }
    for (size_t i = 1; i < fds.size(); ++i) {
      if (fds[i].revents == 0) continue;
      Pending& conn = pending[i - 1];
      char chunk[4096];
      ssize_t n = ::recv(conn.fd.get(), chunk, sizeof chunk, 0);
      if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR && errno != EWOULDBLOCK)) {
        SC_LOG_WARN("rendezvous: connection from %s closed before its hello arrived", conn.from.c_str());
        conn.fd.reset();
        continue;
      }
      if (n < 0) continue;
      conn.buf.append(chunk, static_cast<size_t>(n));
      auto parsed = parse_hello(conn.buf);
      if (!parsed.ok()) {
        refuse(conn, parsed.status().message(), deadline);
        continue;
      }
      if (!parsed->has_value()) continue;
      Hello& h = **parsed;
      std::string who = "rank " + std::to_string(h.rank) + " (" + h.label + " from " + conn.from + ")";
      if (h.job_id != o.job_id) {
        refuse(conn, who + " has job id " + std::to_string(h.job_id) + " but rank 0 runs job " + std::to_string(o.job_id),
               deadline);
      } else if (h.world_size != o.world_size) {
        refuse(conn, who + " has world size " + std::to_string(h.world_size) + " but rank 0 has " +
                         std::to_string(o.world_size), deadline);
      } else if (h.rank == 0 || h.rank >= o.world_size) {
        refuse(conn, who + ": rank must be in 1.." + std::to_string(o.world_size - 1), deadline);
      } else if (joined[h.rank].fd.get() >= 0) {
        refuse(conn, who + ": rank " + std::to_string(h.rank) + " already joined as " + table[h.rank].label, deadline);
      } else {
        table[h.rank] = Peer{h.label + " via " + conn.from, std::move(h.address)};
        joined[h.rank] = std::move(conn);
        ++count;
        SC_LOG_DEBUG("rendezvous: %s joined (%u of %u)", who.c_str(), count, o.world_size);
      }
    }
    std::erase_if(pending, [](const Pending& p) { return p.fd.get() < 0; });
  }
  listener.reset();
  // Anyone still half-way through a hello is late: the job is complete.
  for (auto& p : pending) refuse(p, "the job is already complete (all ranks joined)", deadline);

  std::string reply;
  put32(reply, kMagic);
  put32(reply, kVerdictAccepted);
  put32(reply, o.world_size);
  for (const Peer& p : table) {
    put32(reply, static_cast<uint32_t>(p.label.size()));
    put32(reply, static_cast<uint32_t>(p.address.size()));
    reply += p.label;
    reply += p.address;
  }
  for (uint32_t r = 1; r < o.world_size; ++r) {
    Status s = write_all(joined[r].fd.get(), reply, deadline, "rank " + std::to_string(r));
    if (!s.ok()) {
      SC_LOG_ERROR("rendezvous: cannot send the address table to rank %u (%s): %s", r, table[r].label.c_str(),
                   s.message().c_str());
      return s.with_context("rendezvous");
    }
  }
  return table;
}

// ---- ranks 1..W-1 ---------------------------------------------------------------------------

// One connect attempt, bounded by `deadline`; returns the connected socket or the errno.
Expected<Fd> try_connect(const addrinfo* a, Clock::time_point deadline) {
  Fd fd(::socket(a->ai_family, a->ai_socktype | SOCK_NONBLOCK | SOCK_CLOEXEC, a->ai_protocol));
  if (fd.get() < 0) return errno_status("socket", errno);
  if (::connect(fd.get(), a->ai_addr, a->ai_addrlen) == 0) return fd;
  if (errno != EINPROGRESS) return errno_status("connect", errno);
  pollfd p{fd.get(), POLLOUT, 0};
  int left = std::min(remaining_ms(deadline), 1000);
  int r = ::poll(&p, 1, left);
  if (r == 0) return deadline_exceeded("connect timed out");
  if (r < 0) return errno_status("poll", errno);
  int err = 0;
  socklen_t len = sizeof err;
  if (::getsockopt(fd.get(), SOL_SOCKET, SO_ERROR, &err, &len) != 0) return errno_status("getsockopt", errno);
  if (err != 0) return errno_status("connect", err);
  return fd;
}

Expected<std::vector<Peer>> join(const Options& o, const std::string& my_address, Clock::time_point deadline) {
  SC_ASSIGN_OR_RETURN(addrinfo * ai, resolve(o.coordinator, /*passive=*/false));
  std::unique_ptr<addrinfo, decltype(&::freeaddrinfo)> guard(ai, &::freeaddrinfo);
  const std::string who = "rank 0 at " + o.coordinator;

  Fd fd;
  Status last = unavailable("no address");
  auto backoff = std::chrono::milliseconds(10);
  while (fd.get() < 0) {
    for (const addrinfo* a = ai; a != nullptr && fd.get() < 0; a = a->ai_next) {
      auto attempt = try_connect(a, deadline);
      if (attempt.ok()) {
        fd = std::move(*attempt);
      } else {
        last = attempt.status();
      }
    }
    if (fd.get() >= 0) break;
    int left = remaining_ms(deadline);
    if (left == 0) {
      return deadline_exceeded("rendezvous: rank " + std::to_string(o.rank) + " could not reach " + who + " within " +
                               std::to_string(o.timeout.count()) + " ms (last error: " + last.message() + ")");
    }
    // Rank 0 may simply not be up yet: back off and retry.
    std::this_thread::sleep_for(std::min(backoff, std::chrono::milliseconds(left)));
    backoff = std::min(backoff * 2, std::chrono::milliseconds(250));
  }
  int one = 1;
  ::setsockopt(fd.get(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);

  std::string hello;
  put32(hello, kMagic);
  put16(hello, kVersion);
  put16(hello, 0);
  put64(hello, o.job_id);
  put32(hello, o.world_size);
  put32(hello, o.rank);
  std::string label = o.label.substr(0, kMaxLabel);
  put32(hello, static_cast<uint32_t>(label.size()));
  put32(hello, static_cast<uint32_t>(my_address.size()));
  hello += label;
  hello += my_address;
  SC_RETURN_IF_ERROR(write_all(fd.get(), hello, deadline, who));

  char head[8];
  SC_RETURN_IF_ERROR(read_exact(fd.get(), head, sizeof head, deadline, who));
  if (get_le(head, 4) != kMagic) return data_loss("rendezvous: " + who + " answered with a bad magic");
  uint32_t verdict = static_cast<uint32_t>(get_le(head + 4, 4));
  char word[8];
  if (verdict == kVerdictRefused) {
    SC_RETURN_IF_ERROR(read_exact(fd.get(), word, 4, deadline, who));
    uint32_t len = static_cast<uint32_t>(get_le(word, 4));
    if (len > kMaxReason) return data_loss("rendezvous: " + who + " sent an oversized refusal");
    std::string reason(len, '\0');
    SC_RETURN_IF_ERROR(read_exact(fd.get(), reason.data(), len, deadline, who));
    SC_LOG_ERROR("rendezvous: refused by %s: %s", who.c_str(), reason.c_str());
    return failed_precondition("rendezvous refused by " + who + ": " + reason);
  }
  if (verdict != kVerdictAccepted) return data_loss("rendezvous: " + who + " sent unknown verdict " + std::to_string(verdict));
  SC_RETURN_IF_ERROR(read_exact(fd.get(), word, 4, deadline, who));
  if (get_le(word, 4) != o.world_size) return data_loss("rendezvous: " + who + " sent a table of the wrong size");
  std::vector<Peer> table(o.world_size);
  for (uint32_t r = 0; r < o.world_size; ++r) {
    SC_RETURN_IF_ERROR(read_exact(fd.get(), word, 8, deadline, who));
    uint32_t label_len = static_cast<uint32_t>(get_le(word, 4));
    uint32_t address_len = static_cast<uint32_t>(get_le(word + 4, 4));
    if (label_len > 2 * kMaxLabel || address_len > kMaxAddress) {
      return data_loss("rendezvous: " + who + " sent an oversized table entry");
    }
    table[r].label.resize(label_len);
    table[r].address.resize(address_len);
    SC_RETURN_IF_ERROR(read_exact(fd.get(), table[r].label.data(), label_len, deadline, who));
    SC_RETURN_IF_ERROR(read_exact(fd.get(), table[r].address.data(), address_len, deadline, who));
  }
  return table;
}

}  // namespace

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

Expected<std::vector<Peer>> run(const Options& o, const std::string& my_address) {
  if (o.world_size == 0 || o.rank >= o.world_size) {
    return invalid_argument("rank " + std::to_string(o.rank) + " is not below world size " + std::to_string(o.world_size));
  }
  const auto deadline = Clock::now() + o.timeout;
  if (o.world_size == 1) return std::vector<Peer>{Peer{o.label, my_address}};
  return o.rank == 0 ? serve(o, my_address, deadline) : join(o, my_address, deadline);
}

}  // namespace sparsecar::rendezvous
