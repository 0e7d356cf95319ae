// Residual checkpoints: the file format and its safe reader.
//
// Format: CHECKPOINT.md beside this file (little-endian, frozen, version 1; golden bytes in
// tests/unit/daemon/checkpoint_test.cc). Pipeline::checkpoint() writes it to PATH.tmp, fsyncs and
// renames it over PATH.
//
// Reading (sparsecarctl restore) happens on the calling thread (the control thread), never on the
// pipeline thread, and is bounded before a byte is read: the path is opened O_NONBLOCK (a FIFO or
// a device cannot block the open), fstat must say it is a regular file (FIFOs, devices such as
// /dev/zero, directories and sockets are refused; a symlink is followed to what it names, which
// must itself be a regular file), and its size must be exactly checkpoint_bytes() of the tensors
// registered now. Only then are exactly that many bytes read, and the CRC, magic, version, rank,
// world size and every tensor's name and element count checked. The pipeline thread then only
// copies the residuals (Pipeline::restore).
//
// Thread-safety: plain functions of their arguments.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "daemon/pipeline/step.h"
#include "sparsecar/common/status.h"

namespace sparsecar {

inline constexpr char kCheckpointMagic[8] = {'S', 'C', 'R', 'E', 'S', 'I', 'D', '1'};
inline constexpr uint32_t kCheckpointVersion = 1;
inline constexpr size_t kCheckpointHeaderBytes = 8 + 4 + 4 + 8 + 4 + 4;

// Exact size of a checkpoint of `tensors` (header, entries, CRC).
uint64_t checkpoint_bytes(std::span<const TensorSpec> tensors);

// One tensor's entry as the writer sees it: the registered name and the residual (count = its size).
struct CheckpointEntry {
  std::string_view name;
  std::span<const float> residual;
};

// The bytes of a checkpoint of `entries` (registration order), CRC included: what
// Pipeline::checkpoint() writes, and what parse_checkpoint() accepts back for the same tensors.
std::string encode_checkpoint(uint64_t job_id, uint32_t rank, uint32_t world_size,
                              std::span<const CheckpointEntry> entries);

// A checkpoint read and validated against the tensors registered now.
struct LoadedCheckpoint {
  std::string bytes;                         // the whole file
  uint64_t job_id = 0;
  // Byte offset of each tensor's residual in `bytes`, registration order (unaligned: memcpy it).
  std::vector<size_t> offsets;
};

// Opens, checks and reads `path` as described above. `tensors` are the tensors registered now,
// in registration order; `rank`/`world_size` this node's. Errors name the path and the rule:
// kFailedPrecondition (not a regular file, wrong size, other rank/tensors, no tensors), kDataLoss
// (not a checkpoint, checksum, truncated while read), errno statuses from open/fstat/read.
Expected<LoadedCheckpoint> load_checkpoint(const std::string& path, std::span<const TensorSpec> tensors,
                                           uint32_t rank, uint32_t world_size);

// The checks load_checkpoint() makes on the bytes it read (any size; the fuzz target's entry):
// magic, CRC, version, rank, world size, every tensor's name and count, no trailing bytes.
// `where` names the source in errors.
Expected<LoadedCheckpoint> parse_checkpoint(std::string bytes, std::span<const TensorSpec> tensors, uint32_t rank,
                                            uint32_t world_size, const std::string& where = "checkpoint");

}  // namespace sparsecar
