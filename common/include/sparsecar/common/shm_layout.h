// Shared-memory layout between a trainer (client library) and its daemon (session protocol v1).
//
// Each client session has one control mapping (a memfd made by the daemon, passed with
// SCM_RIGHTS at the handshake) holding a ShmControl: a submission ring (client -> daemon) and a
// completion ring (daemon -> client), each single-producer/single-consumer. Each registered
// tensor has its own data mapping (another memfd, pre-faulted) of `count` elements.
//
// Protocol of one step: the client writes its gradient into the tensor's mapping, pushes a
// Submission and signals the submission eventfd; from then until the matching Completion the
// client must not touch that mapping. The daemon writes the averaged gradient into the mapping,
// pushes a Completion and signals the completion eventfd.
//
// Every Submission is answered by exactly one Completion (success or error), so a client that
// keeps at most kRingSlots submissions un-answered can never overflow its completion ring; the
// daemon treats a full completion ring as a protocol violation and drops the session.
//
// Both sides treat the other as untrusted: indices are masked (a scribbled head/tail can only
// make a side read or overwrite an entry, never leave the mapping), a head more than kRingSlots
// ahead of tail is reported as corrupt, and every field of a popped entry is validated. The
// daemon seals every memfd against shrinking so a client cannot make the daemon's mapping fault.
// The layout is frozen for kShmVersion; golden tests pin the offsets.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <new>

namespace sparsecar::shm {

inline constexpr uint32_t kShmMagic = 0x4D485343;  // "CSHM"
inline constexpr uint32_t kShmVersion = 1;
inline constexpr uint32_t kRingSlots = 256;      // power of two
inline constexpr size_t kErrorTextBytes = 192;   // NUL-terminated, truncated

// Submission::flags: the trainer all-reduces a step the daemon answers with
// kCompletionTrainerReduces itself (Completion::flags). Other bits: 0.
inline constexpr uint32_t kSubmitTrainerReduces = 1;
// Submission::flags, with kSubmitTrainerReduces only: the trainer reads Completion::lease_steps
// (a client older than the field refuses a non-zero one, so the daemon fills it only when asked).
inline constexpr uint32_t kSubmitTakesLease = 2;
inline constexpr uint32_t kSubmitFlags = kSubmitTrainerReduces | kSubmitTakesLease;
// Completion::flags: the mapping holds this trainer's share of its node's contribution (local
// sum + residual, over the node's trainers), not the average: the trainer sums it over all
// trainers of the job and divides by their number (dense_collective=trainer; only answered to
// submissions that carried kSubmitTrainerReduces, on every node of the job alike).
inline constexpr uint32_t kCompletionTrainerReduces = 1;

// ShmControl::features: what the daemon that made the mapping understands. The field was
// `reserved` (0) before, so a daemon older than a feature says it lacks it; such a daemon refuses
// any Submission flag (it fails the step), so a client sets a flag only where the feature is
// said (submission_flags below): a new trainer on an old daemon runs as before, with the
// daemons' ring for dense steps. Clients older than the field never read it.
inline constexpr uint32_t kFeatureTrainerReduces = 1;  // takes kSubmitTrainerReduces
inline constexpr uint32_t kFeatureLease = 2;           // takes kSubmitTakesLease
inline constexpr uint32_t kDaemonFeatures = kFeatureTrainerReduces | kFeatureLease;

struct Submission {
  uint64_t seq;        // client's running count, for diagnostics
  uint64_t step;
  uint32_t tensor_id;  // as returned at registration
  uint32_t flags;      // kSubmitTrainerReduces, | kSubmitTakesLease, or 0
  float lr;            // learning rate of this step (0 = not given)
  uint32_t reserved;
};
static_assert(sizeof(Submission) == 32);

struct Completion {
  uint64_t step;
  uint32_t tensor_id;
  int32_t code;              // sparsecar::Code; 0 = OK and the mapping holds the averaged gradient
  uint64_t bytes_sent;       // bytes this daemon put on the wire for this (tensor, step)
  uint64_t dense_bytes;      // what a dense exchange of the same step would have sent
  uint64_t nnz;              // elements this node selected (== count when dense)
  uint32_t flags;            // kCompletionTrainerReduces or 0
  // With kCompletionTrainerReduces, to a submission with kSubmitTakesLease: the next this many
  // steps of the tensor are dense steps the trainers reduce as well under the decision in force
  // (the knob trainer_lease bounds it), so a trainer may all-reduce them itself without
  // submitting them; the daemon takes any later step next. A lease only ever saves the round
  // trip: taking fewer of its steps, or none, is always right. 0 otherwise (it was `reserved`).
  uint32_t lease_steps;
  char message[kErrorTextBytes];  // error text when code != 0
};
static_assert(sizeof(Completion) == 240);

// A single-producer/single-consumer ring. `head` is written only by the producer, `tail` only
// by the consumer; both count pushes/pops since creation (wrap at 2^64, index = value % slots).
template <typename Entry>
struct alignas(64) Ring {
  alignas(64) std::atomic<uint64_t> head;  // next slot the producer writes
  alignas(64) std::atomic<uint64_t> tail;  // next slot the consumer reads
  alignas(64) Entry entries[kRingSlots];
};

struct ShmControl {
  uint32_t magic;       // kShmMagic
  uint32_t version;     // kShmVersion
  uint32_t ring_slots;  // kRingSlots
  uint32_t features;    // kFeature* bits; 0 from daemons before them (the field was reserved)
  Ring<Submission> submissions;  // client produces, daemon consumes
  Ring<Completion> completions;  // daemon produces, client consumes
};

static_assert(std::atomic<uint64_t>::is_always_lock_free, "rings need lock-free 64-bit atomics");
static_assert((kRingSlots & (kRingSlots - 1)) == 0, "kRingSlots must be a power of two");
static_assert(offsetof(ShmControl, submissions) == 64);
static_assert(offsetof(Ring<Submission>, tail) == 64);
static_assert(offsetof(Ring<Submission>, entries) == 128);
static_assert(sizeof(Ring<Submission>) == 128 + 32 * kRingSlots);
static_assert(offsetof(ShmControl, completions) == 64 + sizeof(Ring<Submission>));
static_assert(sizeof(Ring<Completion>) == 128 + 240 * kRingSlots);
static_assert(offsetof(Completion, message) == 48);

// Size of the control memfd: ShmControl rounded up to whole 4 KiB pages.
inline constexpr size_t kControlBytes = (sizeof(ShmControl) + 4095) / 4096 * 4096;

// The daemon initialises a fresh (zeroed) control mapping before handing it out.
inline ShmControl* init_control(void* mapping) {
  auto* ctl = static_cast<ShmControl*>(mapping);
  ctl->magic = kShmMagic;
  ctl->version = kShmVersion;
  ctl->ring_slots = kRingSlots;
  ctl->features = kDaemonFeatures;
  new (&ctl->submissions.head) std::atomic<uint64_t>(0);
  new (&ctl->submissions.tail) std::atomic<uint64_t>(0);
  new (&ctl->completions.head) std::atomic<uint64_t>(0);
  new (&ctl->completions.tail) std::atomic<uint64_t>(0);
  return ctl;
}

// The client checks a mapping it received before using it.
inline bool control_valid(const ShmControl& ctl) {
  return ctl.magic == kShmMagic && ctl.version == kShmVersion && ctl.ring_slots == kRingSlots;
}

// The Submission::flags a client sends for a step, given the daemon's features.
inline uint32_t submission_flags(const ShmControl& ctl, bool trainer_reduces, bool takes_lease = false) {
  if (!trainer_reduces || (ctl.features & kFeatureTrainerReduces) == 0) return 0;
  return kSubmitTrainerReduces | (takes_lease && (ctl.features & kFeatureLease) != 0 ? kSubmitTakesLease : 0);
}

// Producer side: false when full (would block).
template <typename Entry>
inline bool ring_push(Ring<Entry>& ring, const Entry& entry) {
  uint64_t head = ring.head.load(std::memory_order_relaxed);
  uint64_t tail = ring.tail.load(std::memory_order_acquire);
  if (head - tail >= kRingSlots) return false;
  ring.entries[head % kRingSlots] = entry;
  ring.head.store(head + 1, std::memory_order_release);
  return true;
}

// Consumer side: false when empty. A producer that moved `head` more than kRingSlots ahead of
// `tail` is corrupt; ring_pop reports it through *corrupt and consumes nothing.
template <typename Entry>
inline bool ring_pop(Ring<Entry>& ring, Entry* out, bool* corrupt = nullptr) {
  uint64_t tail = ring.tail.load(std::memory_order_relaxed);
  uint64_t head = ring.head.load(std::memory_order_acquire);
  if (head == tail) return false;
  if (head - tail > kRingSlots) {
    if (corrupt) *corrupt = true;
    return false;
  }
  *out = ring.entries[tail % kRingSlots];
  ring.tail.store(tail + 1, std::memory_order_release);
  return true;
}

}  // namespace sparsecar::shm
