// sparsecard: the sparsecar daemon, one per node. Parses the knob table's flags, starts the
// daemon's parts and serves signals:
//   SIGTERM/SIGINT  drain (new steps refused, queued ones finish within drain_timeout_ms), stop
//   SIGHUP          re-read flags + config file; live knobs that changed become one job-wide
//                   decision, structural ones are refused with a log line
// A peer down for longer than peer_down_grace_ms makes it stop and exit with status 3.
// and tells systemd (Type=notify) READY / RELOADING / STOPPING through $NOTIFY_SOCKET.
#include <csignal>
#include <cstdio>

#include "daemon/config/config.h"
#include "daemon/control/sd_notify.h"
#include "daemon/daemon.h"
#include "sparsecar/common/log.h"

int main(int argc, char** argv) {
  using namespace sparsecar;
  std::string text;
  auto cmd = parse_command_line(argc, argv, &text);
  if (!cmd.ok()) {
    std::fprintf(stderr, "sparsecard: %s\n", cmd.status().message().c_str());
    return 2;
  }
  if (cmd->exit_now) {
    std::fputs(text.c_str(), stdout);
    return cmd->exit_code;
  }
  const Config& config = cmd->config;
  LogLevel level = LogLevel::kInfo;
  parse_log_level(config.log_level, &level);
  set_log_level(level);
  set_log_tag("sparsecard rank " + std::to_string(config.rank));

  // Block the shutdown signals in every thread; this one waits for them below.
  sigset_t signals;
  sigemptyset(&signals);
  sigaddset(&signals, SIGTERM);
  sigaddset(&signals, SIGINT);
  sigaddset(&signals, SIGHUP);
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  std::signal(SIGPIPE, SIG_IGN);

  auto daemon = Daemon::start(config);
  if (!daemon.ok()) {
    SC_LOG_ERROR("cannot start: {}", daemon.status().to_string());
    return 1;
  }
  sd_notify_state("READY=1\nSTATUS=serving");
  Config loaded = config;  // what the flags and the file said at the last (re)load
  int exit_code = 0;
  for (;;) {
    // Wake every 200 ms to notice a peer that has been down too long (Daemon::fatal).
    const timespec tick{0, 200 * 1000 * 1000};
    const int sig = sigtimedwait(&signals, nullptr, &tick);
    if (sig < 0) {
      Status fatal = (*daemon)->fatal();
      if (fatal.ok()) continue;
      SC_LOG_ERROR("{}; exiting with status 3 so that the job can be restarted", fatal.message());
      sd_notify_state("STOPPING=1\nSTATUS=" + fatal.message());
      exit_code = 3;
      break;
    }
    if (sig != SIGHUP) {
      SC_LOG_INFO("signal {}: draining (up to {} ms), then shutting down", sig, config.drain_timeout_ms);
      sd_notify_state("STOPPING=1");
      Status drained = (*daemon)->drain(std::chrono::milliseconds(loaded.drain_timeout_ms));
      if (!drained.ok()) SC_LOG_WARN("{}; stopping anyway", drained.to_string());
      break;
    }
    sd_notify_state("RELOADING=1");
    std::string ignored;
    auto again = parse_command_line(argc, argv, &ignored);
    if (!again.ok()) {
      SC_LOG_ERROR("reload: {}; keeping the running configuration", again.status().message());
    } else {
      Status s = (*daemon)->reload(loaded, again->config);
      if (s.ok()) {
        // Live knobs were applied; structural ones stay as they run (and are reported again).
        for (const auto& spec : knob_table()) {
          if (spec.live) set_knob(loaded, spec.name, get_knob(again->config, spec.name).value()).ignore();
        }
      }
    }
    sd_notify_state("READY=1\nSTATUS=serving");
  }
  (*daemon)->stop();
  return exit_code;
}
