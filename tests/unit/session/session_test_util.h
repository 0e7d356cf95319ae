// Test helpers for the session server and the client library: a fake pipeline, unique socket
// paths, a raw protocol speaker for malformed-input tests, and deadline-bounded polling.
#pragma once

#include <fcntl.h>
#include <poll.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "daemon/pipeline/step.h"
#include "sparsecar/common/session_protocol.h"
#include "sparsecar/common/shm_layout.h"

namespace sparsecar::testing {

using namespace std::chrono_literals;

// Polls `pred` until it holds or `timeout` passes (never an unbounded wait).
inline bool wait_until(const std::function<bool()>& pred, std::chrono::milliseconds timeout = 5000ms) {
  auto deadline = std::chrono::steady_clock::now() + timeout;
  while (!pred()) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

// A private directory with a socket path in it; removed at the end.
class TempSocket {
 public:
  TempSocket() {
    char tmpl[] = "/tmp/sc-session-XXXXXX";
    char* d = ::mkdtemp(tmpl);
    dir_ = d != nullptr ? d : "/tmp";
    path_ = dir_ + "/sparsecard.sock";
  }
  ~TempSocket() {
    ::unlink(path_.c_str());
    ::rmdir(dir_.c_str());
  }
  const std::string& path() const { return path_; }
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_, path_;
};

// The pipeline as a test double: answers local_sum * 0.5 (kHalf), fails every job (kFail), or
// holds jobs until release() (kHold). Records what it saw.
class FakePipeline : public StepSink {
 public:
  enum class Mode { kHalf, kFail, kHold };
  struct SeenJob {
    uint32_t tensor_id;
    uint64_t step;
    float lr;
    std::vector<float> local_sum;
    std::vector<DeviceBuffer> device;  // a device tensor's buffers (StepJob::device)
    bool keepalive = false;            // StepJob::keepalive was set
    bool trainer_reduces = false;      // StepJob::trainer_reduces
    bool takes_lease = false;          // StepJob::takes_lease
  };

  explicit FakePipeline(Mode mode = Mode::kHalf) : mode_(mode) {}
  // kHalf: a job whose trainers all-reduce dense steps is answered as one (StepResult::trainer_reduces).
  std::atomic<bool> answer_trainer_reduces{false};
  // ... with this lease (StepResult::lease_steps), also to a job that did not ask for one when
  // lease_unasked (a daemon that breaks the protocol: the client must refuse it).
  std::atomic<uint32_t> answer_lease{0};
  std::atomic<bool> lease_unasked{false};
  void attach(StepResultSink* sink) { sink_.store(sink); }

  Status register_tensor(uint32_t tensor_id, const TensorSpec& spec) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (refuse_registration) return failed_precondition("the job already started");
    registered.emplace_back(tensor_id, spec.name);
    specs.push_back(spec);
    return Status::Ok();
  }
  void submit(const StepJob& job) override {
    StepResult r;
    r.tensor_id = job.tensor_id;
    r.step = job.step;
    r.generation = job.generation;
    {
      std::lock_guard<std::mutex> lock(mu_);
      jobs.push_back({job.tensor_id, job.step, job.lr, {job.local_sum.begin(), job.local_sum.end()},
                      {job.device.begin(), job.device.end()}, job.keepalive != nullptr, job.trainer_reduces,
                      job.takes_lease});
      if (mode_ == Mode::kHold) {
        held_.push_back(job);
        return;
      }
    }
    if (fail_with_deadline.load()) {
      r.status = deadline_exceeded("rank 1 did not deliver tensor " + std::to_string(job.tensor_id) + " step " +
                                   std::to_string(job.step) + " within 500 ms");
    } else if (mode_ == Mode::kFail) {
      r.status = aborted("injected pipeline failure for step " + std::to_string(job.step));
    } else {
      for (size_t i = 0; i < job.result.size(); ++i) job.result[i] = job.local_sum[i] * 0.5f;
      r.bytes_sent = 8 * job.local_sum.size();
      r.dense_bytes = 4 * job.local_sum.size();
      r.nnz = job.local_sum.size();
      r.trainer_reduces = job.trainer_reduces && answer_trainer_reduces.load();
      if (r.trainer_reduces && (job.takes_lease || lease_unasked.load())) r.lease_steps = answer_lease.load();
    }
    sink_.load()->complete(r);
  }
  void report_metric(const std::string& name, double value, uint64_t step) override {
    std::lock_guard<std::mutex> lock(mu_);
    metrics.push_back({name, value, step});
  }
  uint64_t tensor_footprint_bytes(const TensorSpec& spec) const override { return footprint_per_element * spec.count; }
  void fail_step(uint32_t tensor_id, uint64_t step, const std::string& reason) override {
    std::lock_guard<std::mutex> lock(mu_);
    failed.push_back({tensor_id, step, reason});
  }
  size_t failed_count() {
    std::lock_guard<std::mutex> lock(mu_);
    return failed.size();
  }
  void reset() override {
    std::vector<StepJob> held;
    {
      std::lock_guard<std::mutex> lock(mu_);
      ++resets;
      if (keep_held_on_reset) return;  // like a step still running on the pipeline thread
      held.swap(held_);
    }
    for (const StepJob& job : held) {
      StepResult r;
      r.tensor_id = job.tensor_id;
      r.step = job.step;
      r.generation = job.generation;
      r.status = aborted("pipeline reset");
      sink_.load()->complete(r);
    }
  }
  // Completes every held job: result = local_sum * 0.5.
  void release() {
    std::vector<StepJob> held;
    {
      std::lock_guard<std::mutex> lock(mu_);
      held.swap(held_);
    }
    for (const StepJob& job : held) {
      for (size_t i = 0; i < job.result.size(); ++i) job.result[i] = job.local_sum[i] * 0.5f;
      StepResult r;
      r.tensor_id = job.tensor_id;
      r.step = job.step;
      r.generation = job.generation;
      r.nnz = job.local_sum.size();
      sink_.load()->complete(r);
    }
  }
  size_t job_count() {
    std::lock_guard<std::mutex> lock(mu_);
    return jobs.size();
  }
  int reset_count() {
    std::lock_guard<std::mutex> lock(mu_);
    return resets;
  }
  size_t metric_count() {
    std::lock_guard<std::mutex> lock(mu_);
    return metrics.size();
  }

  struct SeenMetric {
    std::string name;
    double value;
    uint64_t step;
  };
  std::mutex mu_;
  std::vector<SeenJob> jobs;                               // guarded by mu_
  std::vector<std::pair<uint32_t, std::string>> registered;  // guarded by mu_
  std::vector<TensorSpec> specs;                           // guarded by mu_
  std::vector<SeenMetric> metrics;                         // guarded by mu_
  bool refuse_registration = false;                        // guarded by mu_
  struct FailedStep {
    uint32_t tensor_id;
    uint64_t step;
    std::string reason;
  };
  std::vector<FailedStep> failed;                          // guarded by mu_: fail_step() calls
  bool keep_held_on_reset = false;                         // guarded by mu_
  std::atomic<bool> fail_with_deadline{false};             // answer DEADLINE_EXCEEDED like a silent peer
  uint64_t footprint_per_element = 0;                      // tensor_footprint_bytes per element
  int resets = 0;                                          // guarded by mu_

 private:
  Mode mode_;
  std::atomic<StepResultSink*> sink_{nullptr};
  std::vector<StepJob> held_;  // guarded by mu_
};

// Speaks the session protocol byte by byte, for tests that send what a real client never would.
class RawSession {
 public:
  enum class Read { kMsg, kEof, kTimeout, kError };

  ~RawSession() {
    for (int fd : {sock, sub_efd, comp_efd}) {
      if (fd >= 0) ::close(fd);
    }
    if (ctl != nullptr) ::munmap(ctl, shm::kControlBytes);
  }

  bool connect(const std::string& path) {
    sock = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    std::strncpy(addr.sun_path, path.c_str(), sizeof addr.sun_path - 1);
    return sock >= 0 && ::connect(sock, reinterpret_cast<sockaddr*>(&addr), sizeof addr) == 0;
  }
  bool send_bytes(const void* data, size_t len) {
    return ::send(sock, data, len, MSG_NOSIGNAL) == static_cast<ssize_t>(len);
  }
  bool send_msg(proto::MsgType type, const void* payload) {
    proto::MsgHeader h = proto::make_header(type);
    std::vector<uint8_t> buf(sizeof h + h.length);
    std::memcpy(buf.data(), &h, sizeof h);
    std::memcpy(buf.data() + sizeof h, payload, h.length);
    return send_bytes(buf.data(), buf.size());
  }
  // Reads one whole message (header + payload), collecting any fds.
  Read read_msg(proto::MsgHeader* h, std::vector<uint8_t>* payload, std::vector<int>* fds,
                std::chrono::milliseconds timeout = 5000ms) {
    Read r = read_exact(h, sizeof *h, fds, timeout);
    if (r != Read::kMsg) return r;
    if (h->length > 4096) return Read::kError;
    payload->resize(h->length);
    return read_exact(payload->data(), h->length, fds, timeout);
  }
  // Hello -> HelloAck with 3 fds -> control mapping. Returns the ack status.
  int32_t handshake() {
    proto::Hello hello{proto::kProtocolVersion, shm::kShmVersion, static_cast<uint32_t>(::getpid()), 0};
    if (!send_msg(proto::MsgType::kHello, &hello)) return -1;
    proto::MsgHeader h;
    std::vector<uint8_t> payload;
    std::vector<int> fds;
    if (read_msg(&h, &payload, &fds) != Read::kMsg) return -2;
    proto::HelloAck ack;
    std::memcpy(&ack, payload.data(), sizeof ack);
    if (ack.status != 0) return ack.status;
    if (fds.size() != 3) return -3;
    void* m = ::mmap(nullptr, shm::kControlBytes, PROT_READ | PROT_WRITE, MAP_SHARED, fds[0], 0);
    ::close(fds[0]);
    if (m == MAP_FAILED) return -4;
    ctl = static_cast<shm::ShmControl*>(m);
    sub_efd = fds[1];
    comp_efd = fds[2];
    return 0;
  }
  // Register -> RegisterAck; the slot fd (if any) is closed. Returns the ack.
  proto::RegisterAck register_raw(const proto::Register& reg) { return register_raw(proto::MsgType::kRegister, &reg); }
  proto::RegisterAck register_raw(const proto::RegisterShaped& reg) {
    return register_raw(proto::MsgType::kRegisterShaped, &reg);
  }
  proto::RegisterAck register_raw(const proto::RegisterDevice& reg) {
    return register_raw(proto::MsgType::kRegisterDevice, &reg);
  }
  proto::RegisterAck register_raw(proto::MsgType type, const void* reg) {
    proto::RegisterAck ack{};
    ack.status = -1;
    if (!send_msg(type, reg)) return ack;
    proto::MsgHeader h;
    std::vector<uint8_t> payload;
    std::vector<int> fds;
    if (read_msg(&h, &payload, &fds) != Read::kMsg || h.type != uint16_t(proto::MsgType::kRegisterAck)) {
      return ack;
    }
    std::memcpy(&ack, payload.data(), sizeof ack);
    for (int fd : fds) ::close(fd);
    return ack;
  }
  bool submit(uint32_t tensor_id, uint64_t step) {
    shm::Submission s{};
    s.tensor_id = tensor_id;
    s.step = step;
    if (!shm::ring_push(ctl->submissions, s)) return false;
    uint64_t one = 1;
    return ::write(sub_efd, &one, sizeof one) == sizeof one;
  }
  bool next_completion(shm::Completion* out, std::chrono::milliseconds timeout = 5000ms) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      if (shm::ring_pop(ctl->completions, out)) return true;
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return false;
      pollfd p{comp_efd, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) > 0) {
        uint64_t v;
        ssize_t ignored = ::read(comp_efd, &v, sizeof v);
        (void)ignored;
      }
    }
  }
  // True when the daemon closed the socket within the timeout (after any messages).
  bool closed_by_daemon(std::chrono::milliseconds timeout = 5000ms) {
    for (;;) {
      proto::MsgHeader h;
      std::vector<uint8_t> payload;
      std::vector<int> fds;
      Read r = read_msg(&h, &payload, &fds, timeout);
      for (int fd : fds) ::close(fd);
      if (r == Read::kEof || r == Read::kError) return true;
      if (r == Read::kTimeout) return false;
      last_error_type = h.type;
      if (h.type == uint16_t(proto::MsgType::kError) && payload.size() == sizeof(proto::Error)) {
        proto::Error e;
        std::memcpy(&e, payload.data(), sizeof e);
        last_error_status = e.status;
        last_error_text = e.message;
      }
    }
  }

  int sock = -1;
  int sub_efd = -1;
  int comp_efd = -1;
  shm::ShmControl* ctl = nullptr;
  uint16_t last_error_type = 0;
  int32_t last_error_status = 0;
  std::string last_error_text;

 private:
  Read read_exact(void* buf, size_t len, std::vector<int>* fds, std::chrono::milliseconds timeout) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    size_t got = 0;
    while (got < len) {
      auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
          deadline - std::chrono::steady_clock::now());
      if (left.count() <= 0) return Read::kTimeout;
      pollfd p{sock, POLLIN, 0};
      if (::poll(&p, 1, static_cast<int>(left.count())) <= 0) continue;
      iovec iov{static_cast<uint8_t*>(buf) + got, len - got};
      alignas(cmsghdr) char cbuf[CMSG_SPACE(sizeof(int) * 4)];
      msghdr msg{};
      msg.msg_iov = &iov;
      msg.msg_iovlen = 1;
      msg.msg_control = cbuf;
      msg.msg_controllen = sizeof cbuf;
      ssize_t n = ::recvmsg(sock, &msg, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
      if (n < 0) {
        if (errno == EAGAIN || errno == EINTR) continue;
        return Read::kError;
      }
      for (cmsghdr* cm = CMSG_FIRSTHDR(&msg); cm != nullptr; cm = CMSG_NXTHDR(&msg, cm)) {
        size_t nfds = (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t k = 0; k < nfds; ++k) {
          int fd;
          std::memcpy(&fd, CMSG_DATA(cm) + k * sizeof(int), sizeof fd);
          fds->push_back(fd);
        }
      }
      if (n == 0) return Read::kEof;
      got += static_cast<size_t>(n);
    }
    return Read::kMsg;
  }
};

}  // namespace sparsecar::testing
