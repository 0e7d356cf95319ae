// The files and ports one sparsecard claims on its host, resolved from the configuration and
// checked before the daemon joins a job, so that a mistake is reported at once on the node that
// made it instead of after the rendezvous on every node.
//
//   trainer socket   --socket (default /run/sparsecar/sparsecard.sock), locked through
//                    <socket>.lock for the daemon's life
//   control socket   --control; 'auto' = ipc://<socket minus .sock>-control.sock, locked through
//                    <path>.lock (the control server binds it later under that lock)
//   metrics          --metrics-listen; 'auto' = 127.0.0.1:(9464 + rank), so that the daemons of a
//                    single-host job do not collide
//
// Socket directories. A socket's directory must exist and be writable. A missing one is created
// (mode 0750, one level only) when it is clearly this daemon's: the default /run/sparsecar, or a
// directory whose name starts with "sparsecar" inside an existing directory. Anything else is
// refused with a message naming the flag, since creating an arbitrary path on behalf of a typo
// would hide the typo.
//
// Lock files are removed by their holder on exit (common/lock_file.h); a daemon refused because
// another live one holds a lock removes nothing.
//
// Thread-safety: plain functions of their arguments; LocalClaims is owned by the daemon.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

#include "daemon/config/knobs.h"
#include "sparsecar/common/lock_file.h"
#include "sparsecar/common/status.h"

namespace sparsecar {

inline constexpr std::string_view kDefaultSocketDir = "/run/sparsecar";
inline constexpr uint16_t kMetricsBasePort = 9464;

// The control endpoint `control` resolves to ('auto' -> ipc:// beside the trainer socket); 'off'
// and explicit endpoints unchanged.
std::string resolved_control_endpoint(const Config& config);
// The address metrics_listen resolves to ('auto' -> 127.0.0.1:(9464 + rank)); 'off' unchanged.
std::string resolved_metrics_listen(const Config& config);

// Checks (and where the rule above allows, creates) the directory of the socket at `path`.
// `flag` names the option that sets the path ("--socket", "--control") in the error.
Status prepare_socket_dir(const std::string& path, std::string_view flag);

struct LocalClaims {
  LockFile socket_lock;   // <socket>.lock
  LockFile control_lock;  // <control ipc path>.lock; not held for tcp://, 'off' or an unusable 'auto'
};

// The socket directories checked and the sockets' locks taken, in that order. Errors name the
// path and the flag that changes it; another live daemon's lock is reported, never removed.
Expected<LocalClaims> claim_local_paths(const Config& config);

}  // namespace sparsecar
