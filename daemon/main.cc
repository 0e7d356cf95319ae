// sparsecard: the sparsecar daemon, one per node. Parses the knob table's flags, starts the
// daemon's parts and waits for SIGTERM/SIGINT.
#include <csignal>
#include <cstdio>

#include "daemon/config/config.h"
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
  pthread_sigmask(SIG_BLOCK, &signals, nullptr);
  std::signal(SIGPIPE, SIG_IGN);

  auto daemon = Daemon::start(config);
  if (!daemon.ok()) {
    SC_LOG_ERROR("cannot start: %s", daemon.status().to_string().c_str());
    return 1;
  }
  int sig = 0;
  sigwait(&signals, &sig);
  SC_LOG_INFO("signal %d: shutting down", sig);
  (*daemon)->stop();
  return 0;
}
