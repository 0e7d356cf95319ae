#include "daemon/pipeline/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <bit>
#include <cerrno>
#include <cstring>

#include "sparsecar/common/checked_file.h"
#include "sparsecar/kernels/codec.h"

namespace sparsecar {
namespace {

// Residuals are copied as arrays of floats in and out of the file, which holds them as
// little-endian IEEE-754 binary32 (CHECKPOINT.md): only right on a little-endian host.
static_assert(std::endian::native == std::endian::little, "the checkpoint format is little-endian");

// Reads little-endian integers off the front of a byte string.
class Reader {
 public:
  explicit Reader(std::string_view data) : data_(data) {}
  template <typename T>
  bool get(T* v) {
    if (data_.size() - pos_ < sizeof(T)) return false;
    T out = 0;
    for (size_t i = 0; i < sizeof(T); ++i) out |= static_cast<T>(static_cast<unsigned char>(data_[pos_ + i])) << (8 * i);
    *v = out;
    pos_ += sizeof(T);
    return true;
  }
  bool bytes(size_t n, std::string_view* out) {
    if (data_.size() - pos_ < n) return false;
    *out = data_.substr(pos_, n);
    pos_ += n;
    return true;
  }
  size_t pos() const { return pos_; }

 private:
  std::string_view data_;
  size_t pos_ = 0;
};

template <typename T>
void put(std::string& out, T v) {
  for (size_t i = 0; i < sizeof(T); ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

}  // namespace

std::string encode_checkpoint(uint64_t job_id, uint32_t rank, uint32_t world_size,
                              std::span<const CheckpointEntry> entries) {
  std::string out(kCheckpointMagic, sizeof kCheckpointMagic);
  put<uint32_t>(out, kCheckpointVersion);
  put<uint32_t>(out, static_cast<uint32_t>(entries.size()));
  put<uint64_t>(out, job_id);
  put<uint32_t>(out, rank);
  put<uint32_t>(out, world_size);
  for (const CheckpointEntry& e : entries) {
    put<uint32_t>(out, static_cast<uint32_t>(e.name.size()));
    out += e.name;
    put<uint64_t>(out, e.residual.size());
    out.append(reinterpret_cast<const char*>(e.residual.data()), e.residual.size_bytes());
  }
  put<uint32_t>(out, kernels::crc32c(0, out.data(), out.size()));
  return out;
}

uint64_t checkpoint_bytes(std::span<const TensorSpec> tensors) {
  uint64_t bytes = kCheckpointHeaderBytes + 4;  // + CRC
  for (const TensorSpec& t : tensors) bytes += 4 + t.name.size() + 8 + t.count * sizeof(float);
  return bytes;
}

Expected<LoadedCheckpoint> load_checkpoint(const std::string& path, std::span<const TensorSpec> tensors,
                                           uint32_t rank, uint32_t world_size) {
  const std::string where = "checkpoint " + path;
  if (tensors.empty()) return failed_precondition("no tensors are registered yet; restore after the trainers registered");
  const uint64_t expected = checkpoint_bytes(tensors);
  SC_ASSIGN_OR_RETURN(std::string bytes, read_checked_file(path, where, expected, [&](const struct stat& st) -> Status {
    if (!S_ISREG(st.st_mode)) {
      return failed_precondition(where + " is " + file_kind(st.st_mode) + "; restore reads regular files only");
    }
    if (static_cast<uint64_t>(st.st_size) != expected) {
      uint64_t elements = 0;
      for (const TensorSpec& t : tensors) elements += t.count;
      return failed_precondition(where + " is " + std::to_string(st.st_size) + " bytes; a checkpoint of the " +
                                 std::to_string(tensors.size()) + " tensors registered now (" +
                                 std::to_string(elements) + " elements) is exactly " + std::to_string(expected) +
                                 " bytes");
    }
    return Status::Ok();
  }));
  // Never more than `expected` is read, whatever the file does meanwhile.
  if (bytes.size() < expected) {
    return data_loss(where + " shrank to " + std::to_string(bytes.size()) + " bytes while it was read");
  }
  return parse_checkpoint(std::move(bytes), tensors, rank, world_size, where);
}

Expected<LoadedCheckpoint> parse_checkpoint(std::string bytes, std::span<const TensorSpec> tensors, uint32_t rank,
                                            uint32_t world_size, const std::string& where) {
  LoadedCheckpoint out;
  out.bytes = std::move(bytes);
  if (out.bytes.size() < kCheckpointHeaderBytes + 4) return data_loss(where + " is too short to be a checkpoint");
  const std::string& data = out.bytes;
  if (std::memcmp(data.data(), kCheckpointMagic, sizeof kCheckpointMagic) != 0) {
    return data_loss(where + " is not a sparsecar residual checkpoint");
  }
  uint32_t crc = 0;
  Reader(std::string_view(data).substr(data.size() - 4)).get(&crc);
  if (kernels::crc32c(0, data.data(), data.size() - 4) != crc) return data_loss(where + ": checksum mismatch");
  Reader r(std::string_view(data).substr(0, data.size() - 4));
  std::string_view magic;
  uint32_t version = 0, count = 0, file_rank = 0, world = 0;
  if (!r.bytes(sizeof kCheckpointMagic, &magic) || !r.get(&version) || !r.get(&count) || !r.get(&out.job_id) ||
      !r.get(&file_rank) || !r.get(&world)) {
    return data_loss(where + ": truncated header");
  }
  if (version != kCheckpointVersion) {
    return failed_precondition(where + ": version " + std::to_string(version) + " (want " +
                               std::to_string(kCheckpointVersion) + ")");
  }
  if (file_rank != rank || world != world_size) {
    return failed_precondition(where + " was written by rank " + std::to_string(file_rank) + " of " +
                               std::to_string(world) + "; this is rank " + std::to_string(rank) + " of " +
                               std::to_string(world_size));
  }
  if (count != tensors.size()) {
    return failed_precondition(where + " holds " + std::to_string(count) + " tensors; " +
                               std::to_string(tensors.size()) + " are registered");
  }
  for (uint32_t i = 0; i < count; ++i) {
    uint32_t len = 0;
    uint64_t n = 0;
    std::string_view name, values;
    if (!r.get(&len) || !r.bytes(len, &name) || !r.get(&n)) return data_loss(where + ": truncated tensor entry");
    const TensorSpec& spec = tensors[i];
    if (name != spec.name || n != spec.count) {
      return failed_precondition(where + ": tensor " + std::to_string(i) + " is '" + std::string(name) + "' (" +
                                 std::to_string(n) + " elements); registered is '" + spec.name + "' (" +
                                 std::to_string(spec.count) + ")");
    }
    const size_t at = r.pos();
    if (!r.bytes(n * sizeof(float), &values)) return data_loss(where + ": truncated residual of '" + spec.name + "'");
    out.offsets.push_back(at);
  }
  if (r.pos() != data.size() - 4) return data_loss(where + ": trailing bytes after the last tensor");
  return out;
}

}  // namespace sparsecar
