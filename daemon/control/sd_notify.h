// sd_notify(3) without libsystemd: one datagram of "KEY=VALUE\n..." to the AF_UNIX socket named
// by $NOTIFY_SOCKET (a path, or '@' for the abstract namespace). No-op when the variable is unset
// (not started by systemd with Type=notify). Errors are logged once and otherwise ignored: the
// daemon works the same without a service manager.
// Thread-safety: any thread.
#pragma once

#include <string>

namespace sparsecar {

// E.g. "READY=1\nSTATUS=serving", "RELOADING=1", "STOPPING=1". Returns true when sent.
bool sd_notify_state(const std::string& state);

}  // namespace sparsecar
