// Test harness for integration tests: starts real `sparsecard` processes on loopback (UCX over
// tcp or shared memory), each in its own process group with its log in a temp file, and tears
// them down (SIGTERM, then SIGKILL after a bound) whatever happens in the test.
#pragma once

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace sparsecar::itest {

inline uint16_t free_tcp_port() {
  int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  ::bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof addr);
  socklen_t len = sizeof addr;
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len);
  ::close(fd);
  return ntohs(addr.sin_port);
}

struct JobSpec {
  uint32_t world = 2;
  uint32_t local_clients = 1;
  std::string tls = "tcp";  // or "shm"
  std::vector<std::string> extra;  // extra flags for every daemon
  std::vector<std::vector<std::string>> per_rank_extra;  // extra flags for rank r
  std::vector<std::string> env;  // "NAME=value" for every daemon (e.g. SPARSECAR_TEST_FAULTS)
};

class DaemonProcess {
 public:
  DaemonProcess(const std::string& binary, const std::vector<std::string>& args, const std::string& log_path,
                const std::vector<std::string>& env)
      : log_path_(log_path) {
    pid_ = ::fork();
    if (pid_ == 0) {
      ::setpgid(0, 0);
      FILE* log = std::fopen(log_path.c_str(), "w");
      if (log) {
        ::dup2(fileno(log), STDERR_FILENO);
        ::dup2(fileno(log), STDOUT_FILENO);
      }
      for (const auto& e : env) ::putenv(const_cast<char*>(e.c_str()));
      std::vector<char*> argv{const_cast<char*>(binary.c_str())};
      for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
      argv.push_back(nullptr);
      ::execv(binary.c_str(), argv.data());
      std::perror("execv sparsecard");
      std::_Exit(127);
    }
  }
  ~DaemonProcess() { stop(); }

  pid_t pid() const { return pid_; }
  bool running() {
    if (pid_ <= 0) return false;
    int status = 0;
    if (::waitpid(pid_, &status, WNOHANG) == 0) return true;
    reaped(status);
    return false;
  }
  // Waits (bounded) for the process to exit by itself; its exit code (128 + signal when killed),
  // or -1 if it still runs at the deadline.
  int wait_exit(std::chrono::milliseconds timeout) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (running()) {
      if (std::chrono::steady_clock::now() > deadline) return -1;
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    return exit_code_;
  }
  void kill9() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
      pid_ = -1;
    }
  }
  // SIGTERM, then SIGKILL after 5 s.
  int stop() {
    if (pid_ <= 0) return exit_code_;
    ::kill(pid_, SIGTERM);
    ::kill(pid_, SIGCONT);  // a stopped (SIGSTOP) daemon must see it too
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    int status = 0;
    while (std::chrono::steady_clock::now() < deadline) {
      if (::waitpid(pid_, &status, WNOHANG) == pid_) {
        reaped(status);
        return exit_code_;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    ::kill(pid_, SIGKILL);
    ::waitpid(pid_, nullptr, 0);
    pid_ = -1;
    exit_code_ = 137;
    return exit_code_;
  }
  void signal(int sig) {
    if (pid_ > 0) ::kill(pid_, sig);
  }
  std::string log() const {
    std::ifstream in(log_path_);
    std::stringstream ss;
    ss << in.rdbuf();
    return ss.str();
  }

 private:
  void reaped(int status) {
    pid_ = -1;
    exit_code_ = WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
  }
  pid_t pid_ = -1;
  int exit_code_ = -1;
  std::string log_path_;
};

// W daemons of one job in a temp dir. sockets()[r] is rank r's trainer socket.
class LocalJob {
 public:
  explicit LocalJob(const JobSpec& spec) : spec_(spec) {
    char tmpl[] = "/tmp/sparsecar-itest-XXXXXX";
    dir_ = ::mkdtemp(tmpl);
    const std::string coordinator = "127.0.0.1:" + std::to_string(free_tcp_port());
    std::vector<std::string> env = spec.env;  // UCX picks transports from the daemon's knobs, not the environment
    std::vector<std::string> tls = spec.tls == "shm"
                                       ? std::vector<std::string>{"--ucx-tls", "posix,self"}
                                       : std::vector<std::string>{"--ucx-tls", "tcp", "--ucx-net-devices", "lo"};
    for (uint32_t r = 0; r < spec.world; ++r) {
      sockets_.push_back(dir_ + "/rank-" + std::to_string(r) + ".sock");
      std::vector<std::string> args = {"--rank", std::to_string(r), "--world-size", std::to_string(spec.world),
                                       "--coordinator", coordinator, "--socket", sockets_.back(),
                                       "--metrics-listen", "off", "--local-clients",
                                       std::to_string(spec.local_clients), "--join-timeout-ms", "20000",
                                       "--log-level", "info"};
      args.insert(args.end(), tls.begin(), tls.end());
      args.insert(args.end(), spec.extra.begin(), spec.extra.end());
      if (r < spec.per_rank_extra.size()) {
        args.insert(args.end(), spec.per_rank_extra[r].begin(), spec.per_rank_extra[r].end());
      }
      daemons_.push_back(std::make_unique<DaemonProcess>(SPARSECARD_PATH, args, dir_ + "/rank-" + std::to_string(r) + ".log", env));
      args_.push_back(std::move(args));
    }
    env_ = std::move(env);
  }

  // Starts a new process for rank `r` with the same arguments (after the old one died), logging
  // to rank-<r>.<n>.log; `extra` arguments go last. The old process's log stays in logs().
  void restart(uint32_t r, const std::vector<std::string>& extra = {}) {
    std::vector<std::string> args = args_[r];
    args.insert(args.end(), extra.begin(), extra.end());
    retired_.push_back(std::move(daemons_[r]));
    const std::string log = dir_ + "/rank-" + std::to_string(r) + "." + std::to_string(retired_.size()) + ".log";
    daemons_[r] = std::make_unique<DaemonProcess>(SPARSECARD_PATH, args, log, env_);
  }
  ~LocalJob() {
    daemons_.clear();
    std::error_code ec;
    std::filesystem::remove_all(dir_, ec);
  }

  // Waits until every daemon's socket exists (the rendezvous is done). False on timeout or if a
  // daemon exited.
  bool wait_ready(std::chrono::milliseconds timeout = std::chrono::seconds(30)) {
    auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      bool all = true;
      for (uint32_t r = 0; r < spec_.world; ++r) {
        struct stat st{};
        if (::stat(sockets_[r].c_str(), &st) != 0) all = false;
        if (!daemons_[r]->running()) return false;
      }
      if (all) return true;
      if (std::chrono::steady_clock::now() > deadline) return false;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  std::string logs() const {
    std::string out;
    for (size_t i = 0; i < retired_.size(); ++i) out += "---- an earlier process ----\n" + retired_[i]->log();
    for (uint32_t r = 0; r < daemons_.size(); ++r) out += "---- rank " + std::to_string(r) + " ----\n" + daemons_[r]->log();
    return out;
  }

  const std::vector<std::string>& sockets() const { return sockets_; }
  DaemonProcess& daemon(uint32_t r) { return *daemons_[r]; }
  const std::string& dir() const { return dir_; }

 private:
  JobSpec spec_;
  std::string dir_;
  std::vector<std::string> sockets_;
  std::vector<std::unique_ptr<DaemonProcess>> daemons_;
  std::vector<std::unique_ptr<DaemonProcess>> retired_;  // processes replaced by restart()
  std::vector<std::vector<std::string>> args_;
  std::vector<std::string> env_;
};

}  // namespace sparsecar::itest
