#include "daemon/transport/ucx_transport.h"

#include <poll.h>
#include <sys/syscall.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bitset>
#include <chrono>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <future>
#include <mutex>
#include <thread>
#include <utility>
#include <vector>

#include <ucp/api/ucp.h>

#include "daemon/transport/peer_watch.h"
#include "daemon/transport/receive_timer.h"
#include "daemon/transport/rendezvous.h"
#include "sparsecar/common/log.h"

namespace sparsecar {
namespace {

// Active-message id of sparsecar messages and the route prefix in front of the caller's header.
constexpr unsigned kAmId = kUcxDataAmId;
// Sent to every live peer by an orderly stop(), so peers report "left the job" instead of a
// connection error. Header = the route prefix; no payload.
constexpr unsigned kByeAmId = kUcxByeAmId;
// Rank 0 -> every other live rank: "rank R has a new process" (after Coordinator admitted it).
// Header = route prefix + {u32 rank, u32 0, u64 generation, u8 body_mac[32]}; data = the body
// {u32 label_len, u32 address_len, label, address}, sent eagerly; body_mac = keyed BLAKE2b-256
// (transport key) of "sparsecar rejoin v1" || body, so the route MAC covers the body too.
constexpr unsigned kRejoinAmId = kUcxRejoinAmId;
constexpr size_t kRejoinHeaderBytes = 16 + auth::kMac256Bytes;
constexpr char kRejoinDomain[] = "sparsecar rejoin v1";
constexpr uint32_t kMaxRejoinLabel = 1024;
constexpr uint32_t kMaxRejoinAddress = 64 * 1024;
// A replacement of generation g numbers its messages from g << 40 + 1, and every peer sends to it
// from there too: no message of an earlier process of that rank (or to it) can pass the replay
// window once the replacement's first message has (WIRE.md, "Replacements").
constexpr int kGenerationShift = 40;
// Route prefix v2: {u32 sender, u32 magic, u64 sequence, u8 mac[16]} (WIRE.md).
constexpr uint32_t kRouteMagic = 0x32544353;  // "SCT2"
constexpr size_t kRouteBytes = kUcxRouteBytes;
constexpr size_t kRouteMacOffset = 16;
// Sequence numbers accepted out of order: UCX does not promise AM order across lanes (a large
// message may travel on another lane than a small one), so a receiver accepts any sequence number
// it has not seen within this many below the highest it has accepted; older ones are rejected.
constexpr size_t kReplayWindow = 4096;
// Largest caller header the transport carries (the wire header is 80 bytes).
constexpr size_t kMaxHeaderBytes = 256;
constexpr uint64_t kMaxPayloadBytes = uint64_t{1} << 30;
// Receive buffers kept for reuse by rendezvous receives (large messages).
constexpr size_t kMaxPooledBuffers = 8;

Code code_of(ucs_status_t s) {
  switch (s) {
    case UCS_ERR_ENDPOINT_TIMEOUT:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_REJECTED:
    case UCS_ERR_NOT_CONNECTED:
    case UCS_ERR_IO_ERROR:
    case UCS_ERR_CANCELED:
      return Code::kUnavailable;
    case UCS_ERR_TIMED_OUT:
      return Code::kDeadlineExceeded;
    case UCS_ERR_NO_MEMORY:
    case UCS_ERR_NO_RESOURCE:
    case UCS_ERR_EXCEEDS_LIMIT:
      return Code::kResourceExhausted;
    case UCS_ERR_INVALID_PARAM:
    case UCS_ERR_UNSUPPORTED:
      return Code::kInvalidArgument;
    default:
      return Code::kInternal;
  }
}

Status ucx_status(std::string_view what, ucs_status_t s, std::string_view who) {
  std::string m(what);
  if (!who.empty()) m += std::string(" (") + std::string(who) + ")";
  m += ": ";
  m += ucs_status_string(s);
  return Status(code_of(s), std::move(m));
}

void put_le32(std::byte* out, uint32_t v) {
  for (int i = 0; i < 4; ++i) out[i] = static_cast<std::byte>((v >> (8 * i)) & 0xFFu);
}
uint32_t get_le32(const std::byte* in) {
  uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= static_cast<uint32_t>(std::to_integer<uint8_t>(in[i])) << (8 * i);
  return v;
}
void put_le64(std::byte* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out[i] = static_cast<std::byte>((v >> (8 * i)) & 0xFFu);
}
uint64_t get_le64(const std::byte* in) {
  uint64_t v = 0;
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(std::to_integer<uint8_t>(in[i])) << (8 * i);
  return v;
}
std::span<const uint8_t> u8(const std::byte* p, size_t n) { return {reinterpret_cast<const uint8_t*>(p), n}; }

// Logs at most a few lines per second of `clock`; says how many it left out.
class RateLimitedLog {
 public:
  explicit RateLimitedLog(const Clock& clock) : clock_(clock) {}

  template <typename... Args>
  void error(fmt::format_string<Args...> format, Args&&... args) {
    const auto now = clock_.now();
    if (now - window_start_ >= std::chrono::seconds(1)) {
      if (suppressed_ > 0) {
        SC_LOG_ERROR("transport: {} more rejected messages not logged", static_cast<unsigned long long>(suppressed_));
      }
      window_start_ = now;
      in_window_ = 0;
      suppressed_ = 0;
    }
    if (in_window_++ < 5) {
      if (log_enabled(LogLevel::kError)) {
        log_write(LogLevel::kError, __FILE__, __LINE__, fmt::vformat(format, fmt::make_format_args(args...)));
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

bool mentions_shared_memory(const std::string& tls) {
  if (tls.empty()) return true;  // UCX's default ("all") includes shared memory
  for (const char* name : {"posix", "sysv", "sm", "shm", "all", "mm"}) {
    size_t pos = 0;
    while ((pos = tls.find(name, pos)) != std::string::npos) {
      size_t end = pos + std::strlen(name);
      bool starts = pos == 0 || tls[pos - 1] == ',' || tls[pos - 1] == '^';
      bool ends = end == tls.size() || tls[end] == ',';
      if (starts && ends) return true;
      pos = end;
    }
  }
  return false;
}

std::string default_label() {
  char host[256] = "?";
  ::gethostname(host, sizeof host - 1);
  return std::string(host) + ":" + std::to_string(::getpid());
}

}  // namespace

// Checks a UCX call that returns ucs_status_t; on failure logs the real cause once (with the
// peer involved) and returns it as a Status from the enclosing function.
#define SC_UCX_CHECK(call, who)                                          \
  do {                                                                   \
    ucs_status_t sc_ucs_ = (call);                                       \
    if (sc_ucs_ != UCS_OK) {                                             \
      ::sparsecar::Status sc_st_ = ucx_status(#call, sc_ucs_, (who));    \
      SC_LOG_ERROR("{}", sc_st_.message());                      \
      return sc_st_;                                                     \
    }                                                                    \
  } while (0)

class UcxTransport::Impl {
 public:
  struct SendOp;

  // What send() hands to the progress thread.
  struct SendRequest {
    uint32_t peer = 0;
    unsigned am_id = kAmId;
    bool raw = false;  // send_raw_for_test: send am_header as given, unsealed
    bool bulk = false;  // send_bulk: eager unless timed, while timed sends are on
    uint32_t am_header_len = 0;
    std::array<std::byte, kRouteBytes + kMaxHeaderBytes> am_header{};
    const void* payload = nullptr;
    size_t payload_len = 0;
    SendCallback done;
  };

  // A posted send, owned by the progress thread until UCX completes it.
  struct SendOp {
    Impl* impl = nullptr;
    SendRequest req;
    void* ucx_request = nullptr;
    bool orphaned = false;  // stop() already reported it; ignore UCX's late completion
    SendOp* prev = nullptr;  // in the peer's in-flight list
    SendOp* next = nullptr;
  };

  struct Buffer {
    std::unique_ptr<std::byte[]> data;
    size_t capacity = 0;
  };

  // A rendezvous receive in progress.
  struct RecvOp {
    Impl* impl = nullptr;
    uint32_t peer = 0;
    std::array<std::byte, kMaxHeaderBytes> header{};
    size_t header_len = 0;
    Buffer buffer;
    size_t length = 0;
    bool orphaned = false;
    bool timed = false;  // counted in timer_ (link_busy_begin) until it ends
  };

  struct Peer {
    Impl* impl = nullptr;
    uint32_t rank = 0;
    std::string name;
    ucp_ep_h ep = nullptr;
    // Set (release) by the progress thread after `failure` is written; read by send().
    std::atomic<bool> failed{false};
    Status failure;              // written by the progress thread; read elsewhere under peer_mu_
    bool close_pending = false;  // failed; ep still to be force-closed
    int pidfd = -1;              // watches a peer process on this machine (see watch_process)
    uint64_t generation = 0;     // which process of this rank: 0 = the formation's, n = n-th replacement
    SendOp* inflight = nullptr;  // head of the in-flight list
    // Progress thread only: the last sequence number sent to this peer, and the replay window of
    // what was accepted from it (bit i = sequence number recv_max - i).
    uint64_t send_seq = 0;
    uint64_t recv_max = 0;
    std::bitset<kReplayWindow> recv_seen;
    uint32_t untimed_sends = 0;  // progress thread: sends since the last timed one (set_timed_sends)
    uint32_t timed_every = 0;    // progress thread: the cadence untimed_sends counts for
    std::array<std::byte, kRouteBytes> bye_header{};  // the sealed bye of stop()
  };

  Impl(const UcxTransportOptions& o, MessageSink* sink) : options_(o), clock_(*o.clock), sink_(sink) {}

  ~Impl() {
    stop();
    if (progress_thread_.joinable()) progress_thread_.join();
    destroy_ucx();
    if (wake_fd_ >= 0) ::close(wake_fd_);
    for (Peer& p : peers_) {
      if (p.pidfd >= 0) ::close(p.pidfd);
    }
  }

  Status init() {
    if (options_.world_size == 0 || options_.rank >= options_.world_size) {
      return invalid_argument("rank " + std::to_string(options_.rank) + " is not below world size " +
                              std::to_string(options_.world_size));
    }
    if (sink_ == nullptr) return invalid_argument("UcxTransport needs a MessageSink");
    if (options_.label.empty()) options_.label = default_label();
    wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
    if (wake_fd_ < 0) {
      Status s = errno_status("eventfd", errno);
      SC_LOG_ERROR("{}", s.message());
      return s;
    }
    SC_RETURN_IF_ERROR(init_ucx());

    ucp_address_t* address = nullptr;
    size_t address_len = 0;
    SC_UCX_CHECK(ucp_worker_get_address(worker_, &address, &address_len), "self");
    me_ = my_identity();
    const ProcessIdentity& me = me_;
    std::string my_address = pack_address(me, std::string(reinterpret_cast<const char*>(address), address_len));
    ucp_worker_release_address(worker_, address);

    rendezvous::Options ro;
    ro.rank = options_.rank;
    ro.world_size = options_.world_size;
    ro.job_id = options_.job_id;
    ro.coordinator = options_.coordinator;
    ro.timeout = options_.rendezvous_timeout;
    ro.key = options_.key;
    ro.label = options_.label;
    ro.on_listening = options_.on_listening;
    ro.max_pending = options_.rendezvous_max_pending;
    ro.hello_timeout = options_.rendezvous_hello_timeout;
    ro.stats = &rendezvous_stats_;
    ro.clock = &clock_;
    rendezvous::Formation formation;
    if (options_.rank == 0 && options_.world_size > 1) {
      SC_ASSIGN_OR_RETURN(coordinator_, rendezvous::Coordinator::form(ro, my_address, &formation));
    } else {
      SC_ASSIGN_OR_RETURN(formation, rendezvous::run(ro, my_address));
    }
    const std::vector<rendezvous::Peer>& table = formation.peers;
    formation_id_ = formation.formation_id;
    mac_key_ = auth::transport_key(options_.key, options_.job_id, formation_id_);
    // A replacement's messages, and everyone's to it, are numbered above every earlier process's.
    const uint64_t first_seq = formation.generation << kGenerationShift;
    if (formation.generation > 0) {
      SC_LOG_INFO("transport: rank {} joined the running job as a replacement (generation {})", options_.rank,
                  static_cast<unsigned long long>(formation.generation));
    }

    peers_ = std::vector<Peer>(options_.world_size);
    timer_.reset(options_.world_size);
    for (uint32_t r = 0; r < options_.world_size; ++r) {
      Peer& p = peers_[r];
      p.impl = this;
      p.rank = r;
      p.name = "rank " + std::to_string(r) + " (" + (r == options_.rank ? options_.label : table[r].label) + ")";
      p.send_seq = first_seq;
      p.recv_max = first_seq;
      if (r == options_.rank) {
        p.generation = formation.generation;
        continue;
      }
      ProcessIdentity peer_id;
      std::string ucx_address;
      if (!unpack_address(table[r].address, &peer_id, &ucx_address)) {
        return data_loss("rendezvous: " + p.name + " sent a malformed address (another sparsecar version?)");
      }
      // UCX notices a killed peer at once over TCP, but over shared memory only through its
      // keepalive, which (UCX 1.13) can miss a peer that dies with a rendezvous in flight. A
      // process on this machine is watched directly: its pidfd becomes readable when it exits.
      bool gone = false;
      p.pidfd = watch_process(me, peer_id, &gone);
      if (gone && formation.generation > 0) {
        // Another lost rank of the running job: it stays lost until its own replacement comes.
        p.failure = unavailable(p.name + " failed: its process had exited when this replacement joined");
        p.failed.store(true, std::memory_order_release);
        sink_->on_peer_failed(p.rank, p.failure);
        continue;
      }
      if (gone) {
        return unavailable("rendezvous: " + p.name + " exited before the job started");
      }
      SC_RETURN_IF_ERROR(connect(p, ucx_address));
    }
    progress_thread_ = std::thread([this] { progress_main(); });
    if (coordinator_) {
      coordinator_->serve([this](uint32_t rank) { return peers_[rank].failed.load(std::memory_order_acquire); },
                          [this](const rendezvous::Replacement& r) { return admit_replacement(r); });
    }
    return Status::Ok();
  }

  std::string peer_name(uint32_t peer) const {
    std::lock_guard<std::mutex> lock(peer_mu_);
    return peers_[peer].name;
  }
  const UcxTransportOptions& options() const { return options_; }
  const auth::Nonce& formation_id() const { return formation_id_; }

  UcxTransportStats stats() const {
    UcxTransportStats s;
    s.messages_rejected = rejected_.load(std::memory_order_relaxed);
    s.messages_out_of_order = out_of_order_.load(std::memory_order_relaxed);
    s.rendezvous_auth_failures = rendezvous_stats_.auth_failures.load(std::memory_order_relaxed);
    s.rendezvous_refused = rendezvous_stats_.refused.load(std::memory_order_relaxed) +
                           rendezvous_stats_.malformed.load(std::memory_order_relaxed);
    s.rendezvous_shed = rendezvous_stats_.shed.load(std::memory_order_relaxed);
    s.replacements_admitted = replacements_admitted_.load(std::memory_order_relaxed);
    s.peers_rejoined = peers_rejoined_.load(std::memory_order_relaxed);
    return s;
  }

  Status send_raw_for_test(uint32_t peer, unsigned am_id, std::span<const std::byte> am_header) {
    if (peer >= options_.world_size || peer == options_.rank || am_header.size() > kRouteBytes + kMaxHeaderBytes) {
      return invalid_argument("send_raw_for_test: bad peer or header");
    }
    SendRequest req;
    req.peer = peer;
    req.am_id = am_id;
    req.raw = true;
    std::memcpy(req.am_header.data(), am_header.data(), am_header.size());
    req.am_header_len = static_cast<uint32_t>(am_header.size());
    req.done = [](const Status&) {};
    return enqueue(std::move(req));
  }

  Status send(uint32_t peer, std::span<const std::byte> header, std::span<const std::byte> payload,
              SendCallback done, bool bulk = false) {
    if (peer >= options_.world_size || peer == options_.rank) {
      return invalid_argument("send to rank " + std::to_string(peer) + ": not a peer of rank " +
                              std::to_string(options_.rank) + " in a world of " + std::to_string(options_.world_size));
    }
    if (header.size() > kMaxHeaderBytes) {
      return invalid_argument("send to " + peer_name(peer) + ": header of " + std::to_string(header.size()) +
                              " bytes exceeds " + std::to_string(kMaxHeaderBytes));
    }
    if (payload.size() > kMaxPayloadBytes) {
      return resource_exhausted("send to " + peer_name(peer) + ": payload of " + std::to_string(payload.size()) +
                                " bytes exceeds the 1 GiB message limit");
    }
    if (!done) return invalid_argument("send needs a completion callback");
    if (stop_requested_.load(std::memory_order_acquire)) return unavailable("transport stopped");
    if (peers_[peer].failed.load(std::memory_order_acquire)) {
      std::lock_guard<std::mutex> lock(peer_mu_);
      return peers_[peer].failure;
    }
    SendRequest req;
    req.peer = peer;
    // The route prefix (sequence number, MAC) is written by the progress thread when it posts.
    std::memcpy(req.am_header.data() + kRouteBytes, header.data(), header.size());
    req.am_header_len = static_cast<uint32_t>(kRouteBytes + header.size());
    req.payload = payload.data();
    req.payload_len = payload.size();
    req.done = std::move(done);
    req.bulk = bulk;
    if (options_.before_enqueue_for_test) options_.before_enqueue_for_test();
    return enqueue(std::move(req));
  }

  // Queues a request for the progress thread, unless shutdown() has taken the queue for the last
  // time: checked under the queue lock, so no request can be left behind (its callback never run).
  Status enqueue(SendRequest&& req) {
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      if (queue_closed_) return unavailable("transport stopped");
      queue_.push_back(std::move(req));
    }
    if (sleeping_.exchange(false, std::memory_order_seq_cst)) wake();
    return Status::Ok();
  }

  // Requests the stop; waits for the progress thread unless called on it. Idempotent.
  void stop() {
    stop_requested_.store(true, std::memory_order_seq_cst);
    if (std::this_thread::get_id() == progress_thread_id_.load()) return;  // the destructor joins
    std::lock_guard<std::mutex> lock(stop_mu_);
    if (coordinator_) coordinator_->stop();  // no replacement is admitted into a stopping transport
    if (progress_thread_.joinable()) {
      wake();
      progress_thread_.join();
    }
    destroy_ucx();
  }

 private:
  // A daemon started just before its network interface is up finds no usable device: UCX
  // refuses to create the context (or worker). Retry for up to device_wait, then give up.
  Status init_ucx() {
    const auto begin = clock_.now();
    const auto give_up = begin + std::min(options_.device_wait, options_.rendezvous_timeout);
    auto backoff = std::chrono::milliseconds(50);
    int attempts = 0;
    for (;;) {
      ++attempts;
      bool retryable = false;
      Status s = init_ucx_once(&retryable);
      if (s.ok()) {
        if (attempts > 1) {
          SC_LOG_INFO("transport: UCX came up after {} attempts ({} ms)", attempts,
                      static_cast<long long>(std::chrono::duration_cast<std::chrono::milliseconds>(clock_.now() - begin).count()));
        }
        return s;
      }
      destroy_ucx();
      if (!retryable || clock_.now() >= give_up) {
        if (retryable) s = s.with_context("no usable network device after " + std::to_string(attempts) + " attempts in " +
                                          std::to_string(options_.device_wait.count()) + " ms");
        SC_LOG_ERROR("transport: {}", s.message());
        return s;
      }
      if (attempts == 1) {
        SC_LOG_WARN("transport: {}; retrying for up to {} ms (network device not up yet?)", s.message(),
                    static_cast<long long>(options_.device_wait.count()));
      }
      std::this_thread::sleep_for(std::min<Clock::duration>(backoff, give_up - clock_.now()));
      backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
    }
  }

  // UCX statuses that a network device coming up can cure.
  static bool device_may_appear(ucs_status_t s) {
    return s == UCS_ERR_NO_DEVICE || s == UCS_ERR_NO_ELEM || s == UCS_ERR_UNREACHABLE || s == UCS_ERR_IO_ERROR ||
           s == UCS_ERR_NO_RESOURCE || s == UCS_ERR_UNSUPPORTED;
  }

  Status init_ucx_once(bool* retryable) {
    ucp_config_t* config = nullptr;
    SC_UCX_CHECK(ucp_config_read(nullptr, nullptr, &config), "");
    std::unique_ptr<ucp_config_t, decltype(&ucp_config_release)> config_guard(config, &ucp_config_release);
    auto modify = [&](const char* name, const std::string& value) -> Status {
      ucs_status_t s = ucp_config_modify(config, name, value.c_str());
      if (s != UCS_OK) {
        Status st = ucx_status(std::string("ucp_config_modify(") + name + "=" + value + ")", s, "");
        SC_LOG_ERROR("{}", st.message());
        return st;
      }
      return Status::Ok();
    };
    if (!options_.tls.empty()) SC_RETURN_IF_ERROR(modify("TLS", options_.tls));
    if (!options_.net_devices.empty()) SC_RETURN_IF_ERROR(modify("NET_DEVICES", options_.net_devices));
    if (mentions_shared_memory(options_.tls)) {
      // Under UCP_ERR_HANDLING_MODE_PEER, UCX drops the shared-memory transports unless they
      // advertise error handling. ucx_info -c lists UCX_POSIX_ERROR_HANDLING/UCX_SYSV_ERROR_HANDLING,
      // but through ucp_config_modify UCX 1.13 only accepts the shared sub-table's name
      // "MM_ERROR_HANDLING" (the per-component names are reported as invalid configurations).
      SC_RETURN_IF_ERROR(modify("MM_ERROR_HANDLING", "y"));
    }
    SC_RETURN_IF_ERROR(modify("KEEPALIVE_INTERVAL", std::to_string(options_.keepalive_interval.count()) + "ms"));

    ucp_params_t params{};
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED | UCP_PARAM_FIELD_NAME;
    params.features = UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    params.mt_workers_shared = 0;
    params.name = "sparsecar";
    if (ucs_status_t st = ucp_init(&params, config, &context_); st != UCS_OK) {
      context_ = nullptr;
      *retryable = device_may_appear(st);
      return ucx_status("ucp_init", st, "");
    }

    ucp_worker_params_t wparams{};
    wparams.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    // The worker is only ever touched by one thread at a time: start() builds it, then the
    // progress thread owns it until stop() has joined that thread.
    wparams.thread_mode = UCS_THREAD_MODE_SINGLE;
    if (ucs_status_t st = ucp_worker_create(context_, &wparams, &worker_); st != UCS_OK) {
      worker_ = nullptr;
      *retryable = device_may_appear(st);
      return ucx_status("ucp_worker_create", st, "");
    }
    SC_UCX_CHECK(ucp_worker_get_efd(worker_, &worker_fd_), "");

    ucp_am_handler_param_t am{};
    am.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB | UCP_AM_HANDLER_PARAM_FIELD_ARG |
                    UCP_AM_HANDLER_PARAM_FIELD_FLAGS;
    am.id = kAmId;
    am.cb = &Impl::on_am;
    am.arg = this;
    am.flags = UCP_AM_FLAG_WHOLE_MSG;
    SC_UCX_CHECK(ucp_worker_set_am_recv_handler(worker_, &am), "");
    am.id = kByeAmId;
    am.cb = &Impl::on_bye;
    SC_UCX_CHECK(ucp_worker_set_am_recv_handler(worker_, &am), "");
    am.id = kRejoinAmId;
    am.cb = &Impl::on_rejoin;
    SC_UCX_CHECK(ucp_worker_set_am_recv_handler(worker_, &am), "");
    return Status::Ok();
  }

  void destroy_ucx() {
    // Endpoints not closed by the shutdown sequence (it timed out) go with the worker.
    for (void* request : close_requests_) ucp_request_free(request);
    close_requests_.clear();
    if (worker_ != nullptr) ucp_worker_destroy(worker_);
    worker_ = nullptr;
    if (context_ != nullptr) ucp_cleanup(context_);
    context_ = nullptr;
  }

  void wake() {
    uint64_t one = 1;
    // EAGAIN means the counter is already non-zero: the thread will wake anyway.
    if (::write(wake_fd_, &one, sizeof one) < 0 && errno != EAGAIN) {
      SC_LOG_ERROR("transport: write(eventfd): {}", std::strerror(errno));
    }
  }

  // ---- progress thread ------------------------------------------------------------------------

  void progress_main() {
    progress_thread_id_.store(std::this_thread::get_id());
    while (true) {
      post_queued_sends();
      admit_queued_replacements();
      while (ucp_worker_progress(worker_) != 0) {
      }
      close_failed_endpoints();
      if (stop_requested_.load(std::memory_order_acquire)) break;
      sleep_until_event(options_.idle_wakeup);
    }
    shutdown();
  }

  // Sleeps on the worker's event fd and the wake eventfd, at most `limit`.
  void sleep_until_event(std::chrono::milliseconds limit) {
    sleeping_.store(true, std::memory_order_seq_cst);
    bool queued;
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      queued = !queue_.empty() || !replacements_.empty();
    }
    if (queued || stop_requested_.load(std::memory_order_seq_cst)) {
      sleeping_.store(false);
      return;
    }
    ucs_status_t s = ucp_worker_arm(worker_);
    if (s == UCS_ERR_BUSY) {  // events arrived meanwhile: progress again
      sleeping_.store(false);
      return;
    }
    if (s != UCS_OK) {
      // Cannot arm: fall back to a short timed sleep so we still make progress.
      SC_LOG_ERROR("transport: ucp_worker_arm: {}", ucs_status_string(s));
      limit = std::min(limit, std::chrono::milliseconds(1));
    }
    poll_fds_.clear();
    poll_fds_.push_back({worker_fd_, POLLIN, 0});
    poll_fds_.push_back({wake_fd_, POLLIN, 0});
    for (const Peer& p : peers_) {
      if (p.pidfd >= 0) poll_fds_.push_back({p.pidfd, POLLIN, 0});
    }
    int r = ::poll(poll_fds_.data(), poll_fds_.size(), static_cast<int>(limit.count()));
    if (r < 0 && errno != EINTR) SC_LOG_ERROR("transport: poll: {}", std::strerror(errno));
    sleeping_.store(false);
    if (r <= 0) return;
    if (poll_fds_[1].revents & POLLIN) {
      uint64_t count;
      if (::read(wake_fd_, &count, sizeof count) < 0 && errno != EAGAIN) {
        SC_LOG_ERROR("transport: read(eventfd): {}", std::strerror(errno));
      }
    }
    for (size_t i = 2; i < poll_fds_.size(); ++i) {
      if (poll_fds_[i].revents == 0) continue;
      for (Peer& p : peers_) {
        if (p.pidfd != poll_fds_[i].fd) continue;
        ::close(p.pidfd);
        p.pidfd = -1;
        peer_gone(p, unavailable(p.name + " failed: its process exited"), /*orderly=*/false);
      }
    }
  }

  void post_queued_sends() {
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      if (queue_.empty()) return;
      posting_.swap(queue_);
    }
    for (SendRequest& req : posting_) post(std::move(req));
    posting_.clear();
  }

  SendOp* acquire_op() {
    if (free_ops_.empty()) {
      ops_.push_back(std::make_unique<SendOp>());
      ops_.back()->impl = this;
      return ops_.back().get();
    }
    SendOp* op = free_ops_.back();
    free_ops_.pop_back();
    return op;
  }

  void post(SendRequest&& req) {
    Peer& p = peers_[req.peer];
    if (p.failed.load(std::memory_order_relaxed)) {
      req.done(p.failure);
      return;
    }
    SendOp* op = acquire_op();
    op->req = std::move(req);
    op->orphaned = false;
    if (!op->req.raw) seal(p, op->req.am_header.data(), op->req.am_header_len, op->req.am_id);
    if (options_.observe_sent_for_test) {
      options_.observe_sent_for_test(p.rank, op->req.am_id,
                                     std::span<const std::byte>(op->req.am_header.data(), op->req.am_header_len));
    }
    ucp_request_param_t param{};
    param.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
    if (op->req.am_id == kRejoinAmId) {  // its receiver reads the body in the handler: never rendezvous
      param.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
      param.flags = UCP_AM_SEND_FLAG_EAGER;
    } else if (const uint32_t every = timed_send_every_.load(std::memory_order_relaxed);
               op->req.am_id == kAmId && op->req.payload_len > 0 && every > 0) {
      // The receiver times one message in `every` to it (set_timed_sends), the first one after
      // a change of the cadence included.
      if (p.timed_every != every) {
        p.timed_every = every;
        p.untimed_sends = 0;
      }
      // Bulk sends (send_bulk) that are not timed go eagerly: a rendezvous send's reply from the
      // receiver queues behind that node's own bulk data on a shaped link (the ring's segments,
      // both ways at once; 1.1 M elements at 1 Gbit/s: 70 ms a ring step against 49 eager).
      if (p.untimed_sends == 0) {
        param.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = UCP_AM_SEND_FLAG_RNDV;
      } else if (op->req.bulk) {
        param.op_attr_mask |= UCP_OP_ATTR_FIELD_FLAGS;
        param.flags = UCP_AM_SEND_FLAG_EAGER;
      }
      p.untimed_sends = (p.untimed_sends + 1) % every;
    }
    param.cb.send = &Impl::on_send_done;
    param.user_data = op;
    param.datatype = ucp_dt_make_contig(1);
    ucs_status_ptr_t r = ucp_am_send_nbx(p.ep, op->req.am_id, op->req.am_header.data(), op->req.am_header_len,
                                         op->req.payload, op->req.payload_len, &param);
    if (r == nullptr) {
      finish_send(op, Status::Ok());
    } else if (UCS_PTR_IS_ERR(r)) {
      Status s = ucx_status("ucp_am_send_nbx", UCS_PTR_STATUS(r), p.name);
      SC_LOG_ERROR("{}", s.message());
      finish_send(op, s);
    } else {
      op->ucx_request = r;
      link(p, op);
    }
  }

  // Writes the route prefix of a message to `p` into am_header[0, kRouteBytes): this rank, the
  // magic, the next sequence number to `p` and the MAC over the prefix's first 16 bytes, the
  // receiver, the AM id and the caller's header (am_header[kRouteBytes, am_header_len)).
  void seal(Peer& p, std::byte* am_header, size_t am_header_len, unsigned am_id) {
    put_le32(am_header, options_.rank);
    put_le32(am_header + 4, kRouteMagic);
    put_le64(am_header + 8, ++p.send_seq);
    const auth::Mac128 mac = route_mac(am_header, am_header_len, p.rank, am_id);
    std::memcpy(am_header + kRouteMacOffset, mac.data(), mac.size());
  }

  auth::Mac128 route_mac(const std::byte* am_header, size_t am_header_len, uint32_t receiver, unsigned am_id) const {
    std::byte ids[8];
    put_le32(ids, receiver);
    put_le32(ids + 4, am_id);
    return auth::mac128(mac_key_, {u8(am_header, kRouteMacOffset), u8(ids, sizeof ids),
                                   u8(am_header + kRouteBytes, am_header_len - kRouteBytes)});
  }

  // Checks a received AM header's route prefix: framing, sender, MAC, then the replay window.
  // On success returns the sender; a failure is counted, logged (rate limited) and reported to the
  // sink. Only an authentic message moves the window, so forgeries cannot push it ahead.
  Expected<uint32_t> open_route(const void* header, size_t header_length, unsigned am_id) {
    const auto* h = static_cast<const std::byte*>(header);
    uint32_t claimed = MessageSink::kUnknownPeer;
    auto reject = [&](const char* why) { return reject_message(claimed, am_id, header_length, why); };
    if (header_length < kRouteBytes || header_length > kRouteBytes + kMaxHeaderBytes) {
      return reject("bad route header length");
    }
    if (get_le32(h + 4) != kRouteMagic) return reject("bad route magic (not sparsecar transport v2)");
    const uint32_t sender = get_le32(h);
    if (sender >= options_.world_size || sender == options_.rank) return reject("bad sender rank");
    claimed = sender;
    const auth::Mac128 expect = route_mac(h, header_length, options_.rank, am_id);
    if (!auth::equal(expect, u8(h + kRouteMacOffset, expect.size()))) {
      return reject("MAC does not verify (forged, corrupted, or another job's secret or formation)");
    }
    Peer& p = peers_[sender];
    const uint64_t seq = get_le64(h + 8);
    if (seq == 0) return reject("sequence number 0");
    if (seq > p.recv_max) {
      const uint64_t ahead = seq - p.recv_max;
      if (ahead >= kReplayWindow) {
        p.recv_seen.reset();
      } else {
        p.recv_seen <<= static_cast<size_t>(ahead);
      }
      p.recv_seen.set(0);
      p.recv_max = seq;
      return sender;
    }
    const uint64_t behind = p.recv_max - seq;
    if (behind >= kReplayWindow) return reject("sequence number too old to tell from a replay");
    if (p.recv_seen.test(static_cast<size_t>(behind))) return reject("replayed sequence number");
    p.recv_seen.set(static_cast<size_t>(behind));
    out_of_order_.fetch_add(1, std::memory_order_relaxed);
    return sender;
  }

  // Counts, logs (rate limited) and reports a message dropped before delivery.
  Status reject_message(uint32_t claimed, unsigned am_id, size_t header_length, const char* why) {
    rejected_.fetch_add(1, std::memory_order_relaxed);
    Status s = data_loss(std::string("transport: rejected a message (AM ") + std::to_string(am_id) + ", " +
                         std::to_string(header_length) + " header bytes" +
                         (claimed != MessageSink::kUnknownPeer ? ", claiming " + peers_[claimed].name : std::string()) +
                         "): " + why);
    reject_log_.error("{}", s.message());
    if (!stop_requested_.load(std::memory_order_acquire)) sink_->on_rejected(claimed, s);
    return s;
  }

  // ---- replacements of lost ranks ---------------------------------------------------------------

  // Creates p's endpoint to `ucx_address`, with peer error handling (init(), then the progress
  // thread).
  Status connect(Peer& p, const std::string& ucx_address) {
    ucp_ep_params_t ep_params{};
    ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                           UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep_params.address = reinterpret_cast<const ucp_address_t*>(ucx_address.data());
    ep_params.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep_params.err_handler.cb = &Impl::on_ep_error;
    ep_params.err_handler.arg = &p;
    SC_UCX_CHECK(ucp_ep_create(worker_, &ep_params, &p.ep), p.name);
    return Status::Ok();
  }

  // Coordinator's thread (rank 0): has the progress thread make this rank ready for the
  // replacement, and waits (bounded) for the generation it was given.
  Expected<uint64_t> admit_replacement(const rendezvous::Replacement& r) {
    if (!options_.accept_replacements) {
      return failed_precondition("this job does not admit replacements (accept_replacements is off on rank 0)");
    }
    auto pending = std::make_shared<PendingReplacement>();
    pending->replacement = r;
    auto result = pending->done.get_future();
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      if (queue_closed_) return unavailable("rank 0 is stopping");
      replacements_.push_back(pending);
    }
    wake();
    if (result.wait_for(std::chrono::seconds(5)) != std::future_status::ready) {
      return unavailable("rank 0's transport did not get ready for the replacement in time");
    }
    return result.get();
  }

  // Progress thread: answers every queued replacement (refused once a stop was requested).
  void admit_queued_replacements() {
    std::vector<std::shared_ptr<PendingReplacement>> todo;
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      if (replacements_.empty()) return;
      todo.swap(replacements_);
    }
    for (auto& pending : todo) {
      if (stop_requested_.load(std::memory_order_acquire)) {
        pending->done.set_value(unavailable("rank 0 is stopping"));
        continue;
      }
      pending->done.set_value(admit_now(pending->replacement));
    }
  }

  Expected<uint64_t> admit_now(const rendezvous::Replacement& r) {
    Peer& p = peers_[r.rank];
    if (!p.failed.load(std::memory_order_relaxed)) {
      return failed_precondition("rank " + std::to_string(r.rank) + " is alive in the running job");
    }
    const uint64_t generation = p.generation + 1;
    SC_RETURN_IF_ERROR(replace_peer(p, r.label, r.address, generation));
    replacements_admitted_.fetch_add(1, std::memory_order_relaxed);
    // Every other live rank learns it from rank 0 before the replacement has its table, so on each
    // endpoint the news comes before anything that rank 0 sends later about the job.
    std::string body;
    body.resize(8);
    put_le32(reinterpret_cast<std::byte*>(body.data()), static_cast<uint32_t>(r.label.size()));
    put_le32(reinterpret_cast<std::byte*>(body.data()) + 4, static_cast<uint32_t>(r.address.size()));
    body += r.label;
    body += r.address;
    auto shared = std::make_shared<const std::string>(std::move(body));
    const auth::Mac256 mac = body_mac(std::as_bytes(std::span<const char>(shared->data(), shared->size())));
    for (Peer& q : peers_) {
      if (q.rank == options_.rank || q.rank == r.rank || q.failed.load(std::memory_order_relaxed) || q.ep == nullptr) {
        continue;
      }
      SendRequest req;
      req.peer = q.rank;
      req.am_id = kRejoinAmId;
      std::byte* h = req.am_header.data() + kRouteBytes;
      put_le32(h, r.rank);
      put_le32(h + 4, 0);
      put_le64(h + 8, generation);
      std::memcpy(h + 16, mac.data(), mac.size());
      req.am_header_len = static_cast<uint32_t>(kRouteBytes + kRejoinHeaderBytes);
      req.payload = shared->data();
      req.payload_len = shared->size();
      req.done = [shared, rank = q.rank](const Status& st) {
        if (!st.ok()) SC_LOG_WARN("transport: telling rank {} about the replacement failed: {}", rank, st.message());
      };
      post(std::move(req));
    }
    return generation;
  }

  // Points `p` at a new process of its rank: the old endpoint is closed (its sends fail), a new one
  // is created, sequence numbers start above every earlier process's, and the sink hears that the
  // peer is back. Progress thread.
  Status replace_peer(Peer& p, const std::string& label, const std::string& address, uint64_t generation) {
    ProcessIdentity id;
    std::string ucx_address;
    if (!unpack_address(address, &id, &ucx_address)) {
      return invalid_argument("the replacement for " + p.name + " sent a malformed address (another sparsecar version?)");
    }
    if (!p.failed.load(std::memory_order_relaxed)) {
      peer_gone(p, unavailable(p.name + " was replaced by a new process of its rank"), /*orderly=*/false);
    }
    close_endpoint(p);
    if (p.pidfd >= 0) ::close(p.pidfd);
    bool gone = false;
    p.pidfd = watch_process(me_, id, &gone);
    if (gone) return unavailable("the replacement for " + p.name + " exited before it could join");
    SC_RETURN_IF_ERROR(connect(p, ucx_address));
    p.generation = generation;
    const uint64_t first_seq = generation << kGenerationShift;
    p.send_seq = first_seq;
    if (p.recv_max < first_seq) {
      p.recv_max = first_seq;
      p.recv_seen.reset();
    }
    {
      std::lock_guard<std::mutex> lock(peer_mu_);
      p.name = "rank " + std::to_string(p.rank) + " (" + label + ")";
    }
    p.failed.store(false, std::memory_order_release);
    peers_rejoined_.fetch_add(1, std::memory_order_relaxed);
    SC_LOG_INFO("transport: {} rejoined the job (generation {})", p.name,
                static_cast<unsigned long long>(generation));
    sink_->on_peer_rejoined(p.rank);
    return Status::Ok();
  }

  // A rank other than 0 learns from rank 0 that rank R has a new process.
  static ucs_status_t on_rejoin(void* arg, const void* header, size_t header_length, void* data, size_t length,
                                const ucp_am_recv_param_t* param) {
    auto* self = static_cast<Impl*>(arg);
    const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    if (rndv) ucp_am_data_release(self->worker_, data);
    if (self->stop_requested_.load(std::memory_order_acquire)) return UCS_OK;
    auto sender = self->open_route(header, header_length, kRejoinAmId);
    if (!sender.ok()) return UCS_OK;
    auto reject = [&](const char* why) {
      self->reject_message(*sender, kRejoinAmId, header_length, why).ignore();
      return UCS_OK;
    };
    if (*sender != 0) return reject("a replacement announced by a rank other than 0");
    if (rndv || header_length != kRouteBytes + kRejoinHeaderBytes) return reject("malformed replacement announcement");
    const auto* h = static_cast<const std::byte*>(header) + kRouteBytes;
    const uint32_t rank = get_le32(h);
    const uint64_t generation = get_le64(h + 8);
    const auto* body = static_cast<const std::byte*>(data);
    const auth::Mac256 expect = self->body_mac(std::span<const std::byte>(body, length));
    if (!auth::equal(expect, u8(h + 16, expect.size()))) return reject("replacement announcement body does not verify");
    if (rank == 0 || rank == self->options_.rank || rank >= self->options_.world_size) {
      return reject("replacement announced for an impossible rank");
    }
    if (length < 8) return reject("malformed replacement announcement");
    const uint64_t label_len = get_le32(body);
    const uint64_t address_len = get_le32(body + 4);
    if (label_len > kMaxRejoinLabel || address_len > kMaxRejoinAddress || 8 + label_len + address_len != length) {
      return reject("malformed replacement announcement");
    }
    Peer& p = self->peers_[rank];
    if (generation <= p.generation) return reject("replacement announcement older than the one in force");
    const std::string label(reinterpret_cast<const char*>(body + 8), label_len);
    const std::string address(reinterpret_cast<const char*>(body + 8 + label_len), address_len);
    Status s = self->replace_peer(p, label, address, generation);
    if (!s.ok()) SC_LOG_ERROR("transport: cannot connect to the replacement of rank {}: {}", rank, s.message());
    return UCS_OK;
  }

  auth::Mac256 body_mac(std::span<const std::byte> body) const {
    return auth::mac256(mac_key_, {auth::bytes_of(std::string_view(kRejoinDomain)), auth::bytes_of(body)});
  }

  static void link(Peer& p, SendOp* op) {
    op->prev = nullptr;
    op->next = p.inflight;
    if (p.inflight != nullptr) p.inflight->prev = op;
    p.inflight = op;
  }
  static void unlink(Peer& p, SendOp* op) {
    if (op->prev != nullptr) op->prev->next = op->next;
    else p.inflight = op->next;
    if (op->next != nullptr) op->next->prev = op->prev;
    op->prev = op->next = nullptr;
  }

  void finish_send(SendOp* op, const Status& status) {
    SendCallback done = std::move(op->req.done);
    op->req.done = nullptr;
    free_ops_.push_back(op);
    done(status);
  }

  static void on_send_done(void* request, ucs_status_t status, void* user_data) {
    auto* op = static_cast<SendOp*>(user_data);
    Impl* self = op->impl;
    ucp_request_free(request);
    op->ucx_request = nullptr;
    if (op->orphaned) {  // already reported when its peer failed or the transport stopped
      op->orphaned = false;
      self->free_ops_.push_back(op);
      return;
    }
    Peer& p = self->peers_[op->req.peer];
    unlink(p, op);
    if (status == UCS_OK) {
      self->finish_send(op, Status::Ok());
      return;
    }
    Status s = p.failed.load(std::memory_order_relaxed)
                   ? unavailable("send failed: " + p.failure.message())
                   : ucx_status("send", status, p.name);
    self->finish_send(op, s);
  }

  static void on_ep_error(void* arg, ucp_ep_h ep, ucs_status_t status) {
    auto* p = static_cast<Peer*>(arg);
    if (ep != p->ep) return;  // an endpoint to an earlier process of that rank, already closed
    // Whatever UCX calls it (endpoint timeout, connection reset, shared memory error when the
    // peer's segment vanished), for the pipeline the peer is gone.
    p->impl->peer_gone(*p, unavailable(p->name + " failed: " + ucs_status_string(status)), /*orderly=*/false);
  }

  static ucs_status_t on_bye(void* arg, const void* header, size_t header_length, void* data, size_t /*length*/,
                             const ucp_am_recv_param_t* param) {
    auto* self = static_cast<Impl*>(arg);
    if ((param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0) ucp_am_data_release(self->worker_, data);
    if (self->stop_requested_.load(std::memory_order_acquire)) return UCS_OK;
    auto sender = self->open_route(header, header_length, kByeAmId);
    if (!sender.ok()) return UCS_OK;
    Peer& p = self->peers_[*sender];
    self->peer_gone(p, unavailable(p.name + " stopped its transport (left the job)"), /*orderly=*/true);
    return UCS_OK;
  }

  // Marks `p` failed (once), schedules its endpoint for closing and tells the sink.
  void peer_gone(Peer& p, Status why, bool orderly) {
    if (p.failed.load(std::memory_order_relaxed)) return;
    {
      std::lock_guard<std::mutex> lock(peer_mu_);
      p.failure = std::move(why);
    }
    p.failed.store(true, std::memory_order_release);
    p.close_pending = p.ep != nullptr;
    if (stop_requested_.load(std::memory_order_acquire)) {
      SC_LOG_DEBUG("transport: during shutdown: {}", p.failure.message());
      return;
    }
    if (orderly) {
      SC_LOG_INFO("transport: {}", p.failure.message());
    } else {
      SC_LOG_ERROR("transport: {}", p.failure.message());
    }
    sink_->on_peer_failed(p.rank, p.failure);
  }

  // Failed endpoints must be closed in force mode; that also completes (with an error) every
  // send still in flight to that peer.
  void close_failed_endpoints() {
    for (Peer& p : peers_) {
      if (p.close_pending) close_endpoint(p);
    }
    progress_close_requests();
  }

  // Force-closes a failed peer's endpoint and fails every send still in flight to it.
  void close_endpoint(Peer& p) {
    p.close_pending = false;
    if (p.ep != nullptr) {
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      param.flags = UCP_EP_CLOSE_FLAG_FORCE;
      ucs_status_ptr_t r = ucp_ep_close_nbx(p.ep, &param);
      p.ep = nullptr;
      if (UCS_PTR_IS_PTR(r)) {
        close_requests_.push_back(r);
      } else if (UCS_PTR_IS_ERR(r)) {
        SC_LOG_DEBUG("transport: force-closing the endpoint to {}: {}", p.name,
                     ucs_status_string(UCS_PTR_STATUS(r)));
      }
    }
    // Sends that UCX did not complete while closing are failed here.
    while (p.inflight != nullptr) {
      SendOp* op = p.inflight;
      unlink(p, op);
      op->orphaned = true;
      Status s = unavailable("send failed: " + p.failure.message());
      SendCallback done = std::move(op->req.done);
      op->req.done = nullptr;
      done(s);  // the op stays allocated (orphaned) until UCX lets go of its request
    }
  }

  void progress_close_requests() {
    std::erase_if(close_requests_, [](void* request) {
      if (ucp_request_check_status(request) == UCS_INPROGRESS) return false;
      ucp_request_free(request);
      return true;
    });
  }

  static ucs_status_t on_am(void* arg, const void* header, size_t header_length, void* data, size_t length,
                            const ucp_am_recv_param_t* param) {
    auto* self = static_cast<Impl*>(arg);
    const bool rndv = (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV) != 0;
    auto drop = [&](const char* why) {
      SC_LOG_ERROR("transport: dropping a message of {}+{} bytes: {}", header_length, length, why);
      self->dropped_++;
      if (rndv) ucp_am_data_release(self->worker_, data);
      return UCS_OK;
    };
    if (self->stop_requested_.load(std::memory_order_acquire)) {
      if (rndv) ucp_am_data_release(self->worker_, data);
      return UCS_OK;
    }
    // Authenticated before anything else: a forged rendezvous-protocol message is never fetched.
    auto route = self->open_route(header, header_length, kAmId);
    if (!route.ok()) {
      if (rndv) ucp_am_data_release(self->worker_, data);
      return UCS_OK;
    }
    const auto* h = static_cast<const std::byte*>(header);
    const uint32_t sender = *route;
    if (length > kMaxPayloadBytes) return drop("payload larger than 1 GiB");
    std::span<const std::byte> user_header(h + kRouteBytes, header_length - kRouteBytes);
    if (!rndv) {
      self->link_busy_add(sender, header_length - kRouteBytes + length);
      self->sink_->on_message(sender, user_header, std::span<const std::byte>(static_cast<const std::byte*>(data), length));
      return UCS_OK;
    }
    // Rendezvous: fetch the payload into a (pooled) buffer, then deliver.
    RecvOp* op = self->acquire_recv();
    op->peer = sender;
    self->link_busy_begin(op);
    op->header_len = user_header.size();
    std::memcpy(op->header.data(), user_header.data(), user_header.size());
    op->length = length;
    op->buffer = self->acquire_buffer(length);
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_DATATYPE;
    rp.cb.recv_am = &Impl::on_recv_done;
    rp.user_data = op;
    rp.datatype = ucp_dt_make_contig(1);
    ucs_status_ptr_t r = ucp_am_recv_data_nbx(self->worker_, data, op->buffer.data.get(), length, &rp);
    if (r == nullptr) {
      self->deliver(op);
    } else if (UCS_PTR_IS_ERR(r)) {
      SC_LOG_ERROR("transport: ucp_am_recv_data_nbx ({}, {} bytes): {}", self->peers_[sender].name, length,
                   ucs_status_string(UCS_PTR_STATUS(r)));
      self->dropped_++;
      self->link_busy_end(op, false);
      self->release_recv(op);
    }
    return UCS_OK;
  }

  static void on_recv_done(void* request, ucs_status_t status, size_t /*length*/, void* user_data) {
    auto* op = static_cast<RecvOp*>(user_data);
    Impl* self = op->impl;
    ucp_request_free(request);
    if (op->orphaned) return;
    if (status != UCS_OK) {
      SC_LOG_ERROR("transport: receiving {} bytes from {}: {}", op->length, self->peers_[op->peer].name,
                   ucs_status_string(status));
      self->dropped_++;
      self->link_busy_end(op, false);
      self->release_recv(op);
      return;
    }
    self->deliver(op);
  }

  // ---- receiver-side link timing (progress thread; samples_ under samples_mu_) ----------------
  // receive_timer.h: a busy period per peer, eager arrivals while it is open included.
  void link_busy_add(uint32_t peer, size_t bytes) { timer_.add(peer, bytes); }

  void link_busy_begin(RecvOp* op) {
    if (op->peer >= options_.world_size) return;
    timer_.begin(op->peer, std::chrono::steady_clock::now());
    op->timed = true;
  }

  void link_busy_end(RecvOp* op, bool ok) {
    if (!op->timed) return;
    op->timed = false;
    auto sample = timer_.end(op->peer, op->length + op->header_len, ok, std::chrono::steady_clock::now());
    if (!sample) return;
    std::lock_guard<std::mutex> lock(samples_mu_);
    if (samples_.size() >= kMaxReceiveSamples) samples_.pop_front();
    samples_.push_back(*sample);
  }

 public:
  std::vector<ReceiveSample> drain_receive_samples() {
    std::lock_guard<std::mutex> lock(samples_mu_);
    std::vector<ReceiveSample> out(samples_.begin(), samples_.end());
    samples_.clear();
    return out;
  }
  void set_timed_sends(uint32_t every) { timed_send_every_.store(every, std::memory_order_relaxed); }

 private:
  void deliver(RecvOp* op) {
    link_busy_end(op, true);
    if (!stop_requested_.load(std::memory_order_acquire)) {
      sink_->on_message(op->peer, std::span<const std::byte>(op->header.data(), op->header_len),
                        std::span<const std::byte>(op->buffer.data.get(), op->length));
    }
    release_recv(op);
  }

  RecvOp* acquire_recv() {
    RecvOp* op;
    if (free_recvs_.empty()) {
      recvs_.push_back(std::make_unique<RecvOp>());
      op = recvs_.back().get();
      op->impl = this;
    } else {
      op = free_recvs_.back();
      free_recvs_.pop_back();
    }
    op->orphaned = false;
    active_recvs_.push_back(op);
    return op;
  }

  void release_recv(RecvOp* op) {
    std::erase(active_recvs_, op);
    release_buffer(std::move(op->buffer));
    op->buffer = Buffer{};
    free_recvs_.push_back(op);
  }

  Buffer acquire_buffer(size_t length) {
    // Smallest pooled buffer that fits; reusing keeps large receives off fresh (slow) pages.
    size_t best = buffers_.size();
    for (size_t i = 0; i < buffers_.size(); ++i) {
      if (buffers_[i].capacity >= length && (best == buffers_.size() || buffers_[i].capacity < buffers_[best].capacity)) {
        best = i;
      }
    }
    if (best != buffers_.size()) {
      Buffer b = std::move(buffers_[best]);
      buffers_.erase(buffers_.begin() + static_cast<std::ptrdiff_t>(best));
      return b;
    }
    Buffer b;
    b.capacity = std::max<size_t>(length, 1);
    b.data.reset(new std::byte[b.capacity]);
    return b;
  }

  void release_buffer(Buffer&& b) {
    if (b.data == nullptr) return;
    buffers_.push_back(std::move(b));
    if (buffers_.size() > kMaxPooledBuffers) {
      // Drop the smallest: large buffers are the expensive ones to fault in again.
      auto smallest = std::min_element(buffers_.begin(), buffers_.end(),
                                       [](const Buffer& a, const Buffer& c) { return a.capacity < c.capacity; });
      buffers_.erase(smallest);
    }
  }

  // Runs on the progress thread once a stop was requested: fail what is queued, flush and close
  // every endpoint (bounded by stop_timeout), fail what is still in flight.
  void shutdown() {
    {
      std::lock_guard<std::mutex> lock(queue_mu_);
      queue_closed_ = true;  // send() refuses from now on: nothing can be queued behind this swap
      posting_.swap(queue_);
    }
    for (SendRequest& req : posting_) req.done(aborted("transport stopped before the send to " + peers_[req.peer].name + " was posted"));
    posting_.clear();
    admit_queued_replacements();  // refused: stop_requested_ is set

    const auto deadline = clock_.now() + options_.stop_timeout;
    for (Peer& p : peers_) {
      if (p.ep == nullptr || p.failed.load(std::memory_order_relaxed)) continue;
      // Best effort: the flush in the close below delivers it before the endpoint goes.
      ucp_request_param_t bye{};
      bye.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      bye.flags = UCP_AM_SEND_FLAG_EAGER;
      // UCX may read the header until the send completes (UCX 1.13 has no COPY_HEADER flag), so
      // each peer's bye has its own buffer, alive until the worker is destroyed.
      seal(p, p.bye_header.data(), kRouteBytes, kByeAmId);
      if (options_.observe_sent_for_test) options_.observe_sent_for_test(p.rank, kByeAmId, p.bye_header);
      ucs_status_ptr_t r = ucp_am_send_nbx(p.ep, kByeAmId, p.bye_header.data(), kRouteBytes, nullptr, 0, &bye);
      if (UCS_PTR_IS_PTR(r)) ucp_request_free(r);  // released by UCX once sent
    }
    for (Peer& p : peers_) {
      if (p.ep == nullptr) continue;
      ucp_request_param_t param{};
      param.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
      param.flags = p.failed.load(std::memory_order_relaxed) ? UCP_EP_CLOSE_FLAG_FORCE : 0;
      ucs_status_ptr_t r = ucp_ep_close_nbx(p.ep, &param);
      p.ep = nullptr;
      p.close_pending = false;
      if (UCS_PTR_IS_PTR(r)) close_requests_.push_back(r);
    }
    auto closing = [&] { return !close_requests_.empty(); };
    while (closing() && clock_.now() < deadline) {
      while (ucp_worker_progress(worker_) != 0) {
      }
      progress_close_requests();
      if (!closing()) break;
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - clock_.now());
      sleep_until_event(std::clamp(left, std::chrono::milliseconds(1), std::chrono::milliseconds(10)));
    }
    if (closing()) SC_LOG_WARN("transport: endpoints did not close within {} ms; dropping them",
                               static_cast<long long>(options_.stop_timeout.count()));
    for (Peer& p : peers_) {
      while (p.inflight != nullptr) {
        SendOp* op = p.inflight;
        unlink(p, op);
        op->orphaned = true;
        SendCallback done = std::move(op->req.done);
        op->req.done = nullptr;
        done(aborted("transport stopped with a send to " + p.name + " in flight"));
      }
    }
    for (RecvOp* op : active_recvs_) op->orphaned = true;
    active_recvs_.clear();
  }

  UcxTransportOptions options_;
  const Clock& clock_;
  MessageSink* sink_;
  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int worker_fd_ = -1;
  int wake_fd_ = -1;
  std::vector<Peer> peers_;

  std::thread progress_thread_;
  std::atomic<std::thread::id> progress_thread_id_{};
  std::atomic<bool> stop_requested_{false};
  ReceiveTimer timer_;  // receiver-side link timing (link_busy_*); progress thread
  std::mutex samples_mu_;
  std::deque<ReceiveSample> samples_;  // guarded by samples_mu_
  std::atomic<uint32_t> timed_send_every_{0};
  std::atomic<bool> sleeping_{false};
  std::mutex stop_mu_;

  std::mutex queue_mu_;
  std::vector<SendRequest> queue_;  // guarded by queue_mu_
  // Replacements the coordinator's thread waits on (rank 0): guarded by queue_mu_.
  struct PendingReplacement {
    rendezvous::Replacement replacement;
    std::promise<Expected<uint64_t>> done;
  };
  std::vector<std::shared_ptr<PendingReplacement>> replacements_;
  bool queue_closed_ = false;       // guarded by queue_mu_; set by shutdown()'s final swap

  auth::Nonce formation_id_{};
  auth::Key mac_key_{};  // transport key: written by init() before the progress thread starts
  std::atomic<uint64_t> rejected_{0};
  std::atomic<uint64_t> out_of_order_{0};  // authentic messages that arrived below the highest seq
  std::atomic<uint64_t> replacements_admitted_{0};
  std::atomic<uint64_t> peers_rejoined_{0};
  mutable std::mutex peer_mu_;  // Peer::name and Peer::failure, read off the progress thread
  ProcessIdentity me_;
  std::unique_ptr<rendezvous::Coordinator> coordinator_;  // rank 0 admitting replacements
  rendezvous::Stats rendezvous_stats_;
  RateLimitedLog reject_log_{clock_};  // progress thread only

  // Progress thread only.
  std::vector<SendRequest> posting_;
  std::vector<std::unique_ptr<SendOp>> ops_;
  std::vector<SendOp*> free_ops_;
  std::vector<std::unique_ptr<RecvOp>> recvs_;
  std::vector<RecvOp*> free_recvs_;
  std::vector<RecvOp*> active_recvs_;
  std::vector<Buffer> buffers_;
  std::vector<void*> close_requests_;  // endpoint closes in progress
  uint64_t dropped_ = 0;
  std::vector<pollfd> poll_fds_;
};

Expected<std::unique_ptr<UcxTransport>> UcxTransport::start(const UcxTransportOptions& options, MessageSink* sink) {
  auto impl = std::make_unique<Impl>(options, sink);
  Status s = impl->init();
  if (!s.ok()) return s.with_context("rank " + std::to_string(options.rank) + " transport start");
  return std::unique_ptr<UcxTransport>(new UcxTransport(std::move(impl)));
}

UcxTransport::UcxTransport(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
UcxTransport::~UcxTransport() = default;

uint32_t UcxTransport::rank() const { return impl_->options().rank; }
uint32_t UcxTransport::world_size() const { return impl_->options().world_size; }
std::string UcxTransport::peer_name(uint32_t peer) const {
  if (peer >= impl_->options().world_size) return "rank " + std::to_string(peer) + " (not in this job)";
  return impl_->peer_name(peer);
}
Status UcxTransport::send(uint32_t peer, std::span<const std::byte> header, std::span<const std::byte> payload,
                          SendCallback done) {
  return impl_->send(peer, header, payload, std::move(done));
}
Status UcxTransport::send_bulk(uint32_t peer, std::span<const std::byte> header, std::span<const std::byte> payload,
                               SendCallback done) {
  return impl_->send(peer, header, payload, std::move(done), /*bulk=*/true);
}
void UcxTransport::stop() { impl_->stop(); }
std::vector<ReceiveSample> UcxTransport::drain_receive_samples() { return impl_->drain_receive_samples(); }
void UcxTransport::set_timed_sends(uint32_t every) { impl_->set_timed_sends(every); }
UcxTransportStats UcxTransport::stats() const { return impl_->stats(); }
const auth::Nonce& UcxTransport::formation_id() const { return impl_->formation_id(); }
uint64_t UcxTransport::incarnation() const {
  uint64_t v = 0;
  const auth::Nonce& f = impl_->formation_id();
  for (int i = 0; i < 8; ++i) v |= static_cast<uint64_t>(f[static_cast<size_t>(i)]) << (8 * i);
  return v;
}
Status UcxTransport::send_raw_for_test(uint32_t peer, unsigned am_id, std::span<const std::byte> am_header) {
  return impl_->send_raw_for_test(peer, am_id, am_header);
}

}  // namespace sparsecar
