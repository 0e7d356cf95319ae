// Job rendezvous over plain TCP through rank 0: every rank learns every other rank's UCX worker
// address before any UCX traffic flows. Used by UcxTransport::start(); separate so it can be
// tested (and reasoned about) without UCX.
//
// Rank 0 binds the coordinator HOST:PORT (SO_REUSEADDR) and waits for world_size - 1 hellos;
// every other rank connects (retrying until the deadline) and sends a hello. Rank 0 refuses a
// hello with a reason when the job id or world size differ, the rank is out of range or already
// taken; the refused rank's call fails with FAILED_PRECONDITION and that reason, while rank 0 keeps
// waiting for the right one. When all ranks have joined, rank 0 answers each with the full table
// and every socket is closed. Every connect, read and write is bounded by the one deadline.
//
// Protocol v1 (all integers little-endian):
//   hello  (rank r -> rank 0): u32 magic 0x5A524353 ("SCRZ"), u16 version 1, u16 0, u64 job_id,
//                              u32 world_size, u32 rank, u32 label_len, u32 address_len,
//                              label bytes, address bytes
//   reply  (rank 0 -> rank r): u32 magic, u32 verdict (0 accepted, 1 refused), then
//                              refused:  u32 reason_len, reason bytes (UTF-8)
//                              accepted: u32 world_size, then per rank 0..W-1:
//                                        u32 label_len, u32 address_len, label, address
//   Limits: label <= 256 bytes, address <= 64 KiB, reason <= 4 KiB.
//
// Threads: a blocking call on the caller's thread; no shared state.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "sparsecar/common/status.h"

namespace sparsecar::rendezvous {

struct Options {
  uint32_t rank = 0;
  uint32_t world_size = 1;
  uint64_t job_id = 0;
  std::string coordinator;  // "HOST:PORT" ("[v6addr]:PORT" for IPv6); rank 0 may use port 0
  std::chrono::milliseconds timeout{60000};
  // Human label of this rank for error messages (e.g. "host:pid").
  std::string label;
  // Rank 0 only: called with the bound port once listening (useful with port 0 in tests).
  std::function<void(uint16_t port)> on_listening;
};

struct Peer {
  std::string label;    // as the peer described itself, plus its address seen by rank 0
  std::string address;  // opaque (the UCX worker address)
};

// Returns the table indexed by rank (including this rank's own entry).
Expected<std::vector<Peer>> run(const Options& options, const std::string& my_address);

// Splits "HOST:PORT" / "[HOST]:PORT"; false on malformed input.
bool split_host_port(const std::string& text, std::string* host, std::string* port);

}  // namespace sparsecar::rendezvous
