// Watching peer processes on this machine directly, for the UCX transport: UCX notices a killed
// peer at once over TCP, but over shared memory only through its keepalive, which (UCX 1.13) can
// miss a peer that dies with a rendezvous in flight. Each rank sends its process identity in
// front of its UCX worker address at the rendezvous; a peer on the same kernel and in the same
// pid namespace is then watched through a pidfd, which becomes readable when it exits.
//
// Thread-safety: plain functions (they read /proc).
#pragma once

#include <cstdint>
#include <string>

namespace sparsecar {

// Who a process is, precisely enough to watch it from another process on the same kernel:
// exchanged in front of the UCX worker address during the rendezvous.
struct ProcessIdentity {
  std::string boot_id;    // /proc/sys/kernel/random/boot_id: same kernel (same machine, same boot)
  std::string pid_ns;     // readlink /proc/self/ns/pid: same pid namespace
  uint64_t pid = 0;
  uint64_t start_time = 0;  // /proc/<pid>/stat field 22: rules out a reused pid
};

// This process's identity.
ProcessIdentity my_identity();

// Rendezvous address blob: "SCID1\n" boot_id "\n" pid_ns "\n" pid "\n" start_time "\n" + UCX
// address; unpack_address is false on anything else (or an empty UCX address).
std::string pack_address(const ProcessIdentity& id, const std::string& ucx_address);
bool unpack_address(const std::string& blob, ProcessIdentity* id, std::string* ucx_address);

// A pidfd for `peer` when it runs on this kernel and in this pid namespace, or -1 when it cannot
// be watched that way (another machine, another namespace). *gone is set when it already exited.
int watch_process(const ProcessIdentity& mine, const ProcessIdentity& peer, bool* gone);

}  // namespace sparsecar
