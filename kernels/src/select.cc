// Public selection kernels: validate, then dispatch to the per-ISA variants in detail/.
#include "sparsecar/kernels/select.h"

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>

#include "detail/cpu.h"
#include "detail/importance.h"
#include "detail/topk.h"
#include "sparsecar/common/log.h"
#include "sparsecar/kernels/parallel.h"

namespace sparsecar::kernels {
namespace {

using detail::Isa;

constexpr size_t kScratchAlign = 64;
constexpr size_t kHiHistBytes = detail::kTopkHistCopies * detail::kTopkHiBins * sizeof(uint32_t);
constexpr size_t kMaxElements = std::numeric_limits<uint32_t>::max();  // indices are uint32
// The sampled estimate of the k-th key (detail/bits.h: kSampleMax keys at most, all of x when
// n <= kSampleMax). Top-k uses it from kSampledMinN elements on; below that the two-pass path
// is as fast (everything is in cache).
using detail::kSampleMax;
using detail::kSampleSeed;
using detail::sample_size;
constexpr size_t kSampleBytes = kSampleMax * sizeof(uint32_t);
constexpr size_t kSampledMinN = 32768;
// Half-width of the bracket around the sample rank of the k-th key, in standard deviations of
// that rank (binomial), plus a constant for small ranks. 3 sigma: the bracket misses (and the
// exact fallback runs) in about 0.3 % of calls on continuous data, a cost of < 1 % on average
// for a band half as wide as at 4 sigma.
constexpr double kBracketSigmas = 3.0;
constexpr double kBracketSlack = 2.0;

using detail::lambda_key;

// Walks bins from the top and returns the bin holding the k-th largest key (k >= 1 and
// k <= total count); *above is the number of keys in higher bins.
uint32_t find_bin(const uint32_t* hist, size_t bins, size_t k, size_t* above) {
  size_t sum = 0;
  for (size_t b = bins; b-- > 0;) {
    if (sum + hist[b] >= k) {
      *above = sum;
      return static_cast<uint32_t>(b);
    }
    sum += hist[b];
  }
  SC_CHECK(false, "top-k histogram holds {} keys, fewer than k={}", sum, k);
  return 0;
}

struct ScratchLayout {
  uint32_t* hist;    // kTopkHistCopies * kTopkHiBins counters
  uint32_t* sample;  // kSampleMax keys
  uint32_t* region;  // n words: candidate indices (two-pass) or band pairs (sampled)
};

ScratchLayout layout_of(std::span<std::byte> scratch) {
  const uintptr_t base = reinterpret_cast<uintptr_t>(scratch.data());
  const uintptr_t aligned = (base + kScratchAlign - 1) & ~uintptr_t{kScratchAlign - 1};
  uint32_t* hist = std::assume_aligned<kScratchAlign>(reinterpret_cast<uint32_t*>(aligned));
  uint32_t* sample = hist + kHiHistBytes / sizeof(uint32_t);
  return {hist, sample, sample + kSampleBytes / sizeof(uint32_t)};
}

// Keys of a stratified sample: s strata of n / s elements, one pseudo-random position in each
// (fixed seed: the same positions on every call and node). s == n samples every element.
// With `add` non-null, the key of x[i] + add[i] (the residual after error feedback, unwritten).
void sample_keys(const float* x, const float* add, size_t n, size_t s, uint32_t* keys) {
  const size_t stride = n / s;
  const uint64_t mixed = detail::splitmix64(kSampleSeed);
  const auto a = static_cast<uint32_t>(mixed);
  const auto b = static_cast<uint32_t>(mixed >> 32);
  for (size_t j = 0; j < s; ++j) {
    const size_t i = detail::sample_position(j, stride, a, b);
    keys[j] = detail::magnitude_key(add ? x[i] + add[i] : x[i]);
  }
}

// The key at 0-based position `rank` of keys[from, s) sorted in decreasing order (reorders).
uint32_t key_at_rank(uint32_t* keys, size_t from, size_t s, size_t rank) {
  std::nth_element(keys + from, keys + rank, keys + s, std::greater<>());
  return keys[rank];
}

// Radix select over the keys for_each_key(f) passes to f (in index order), all in [lo, hi]: the
// key T of the need-th largest (1 <= need <= their count), with *ties = how many keys equal to T
// belong to the top `need` (the lowest-index ones). The digits are taken from key - lo,
// 11 bits at a time from the highest bit in which the range differs, so a narrow range (a
// sampled band) takes two passes, the second testing one bin; the full range [0, kNanKey] takes
// three. hist: kTopkHiBins counters.
template <class ForEachKey>
uint32_t kth_largest_key(const ForEachKey& for_each_key, size_t need, uint32_t lo, uint32_t hi,
                         uint32_t* hist, size_t* ties) {
  constexpr int kDigitBits = 11;
  static_assert(detail::kTopkHiBins == size_t{1} << kDigitBits);
  uint32_t base = lo;
  uint32_t span = hi - lo;  // keys of interest: base <= key <= base + span
  for (;;) {
    const int width = std::bit_width(span);
    const int shift = width > kDigitBits ? width - kDigitBits : 0;
    const size_t bins = (span >> shift) + size_t{1};
    std::memset(hist, 0, bins * sizeof(uint32_t));
    for_each_key([&](uint32_t key) {
      const uint32_t offset = key - base;  // wraps above span for keys below base
      if (offset <= span) ++hist[offset >> shift];
    });
    size_t above = 0;
    const uint32_t bin = find_bin(hist, bins, need, &above);
    need -= above;
    base += bin << shift;
    if (shift == 0) {
      *ties = need;
      return base;
    }
    span = std::min(span - (bin << shift), (uint32_t{1} << shift) - 1u);
  }
}

// Keeps, in place and in order, the `need` largest of the (index, value) pairs [0, count)
// (pairs in increasing index order, so ties go to the lower index; every key in [lo, hi]).
// need <= count. The compaction is the top-k kernel's (vector, in place: it writes at or below
// where it reads); a branchy scalar filter mispredicted on every other pair.
void keep_largest_pairs(detail::Isa isa, uint32_t* index, float* value, size_t count, size_t need,
                        uint32_t* hist, uint32_t lo = 0, uint32_t hi = detail::kNanKey) {
  if (need >= count) return;
  if (need == 0) return;
  size_t ties = 0;
  const auto keys = [value, count](auto&& f) {
    for (size_t j = 0; j < count; ++j) f(detail::magnitude_key(value[j]));
  };
  const uint32_t kth = kth_largest_key(keys, need, lo, hi, hist, &ties);
  const size_t kept = isa == detail::Isa::kAvx512
                          ? detail::topk_compact_avx512(index, value, count, kth, ties, index, value, need)
                          : detail::topk_compact_portable(index, value, count, kth, ties, index, value, need);
  SC_CHECK(kept == need, "top-k pair refinement kept {} of {}", kept, need);
}

// out[0, above) and the second list (second_count entries, index via idx(j), value via val(j))
// are both in increasing index order and disjoint: merge them, from the back, into out[0, total).
template <class Idx, class Val>
void merge_from_back(uint32_t* out_index, float* out_value, size_t above, size_t second_count,
                     const Idx& idx, const Val& val) {
  size_t i = above;
  size_t j = second_count;
  size_t w = above + second_count;
  while (j > 0) {
    --w;
    if (i > 0 && out_index[i - 1] > idx(j - 1)) {
      --i;
      out_index[w] = out_index[i];
      out_value[w] = out_value[i];
    } else {
      --j;
      out_index[w] = idx(j);
      out_value[w] = val(j);
    }
  }
}

Status check_topk_args(const char* what, size_t n, std::span<std::byte> scratch) {
  if (n > kMaxElements) {
    return invalid_argument(std::string(what) + ": " + std::to_string(n) +
                            " elements exceed uint32 indices");
  }
  if (scratch.size() < topk_scratch_bytes(n)) {
    return invalid_argument(std::string(what) + ": scratch of " + std::to_string(scratch.size()) +
                            " bytes, need topk_scratch_bytes(" + std::to_string(n) +
                            ") = " + std::to_string(topk_scratch_bytes(n)));
  }
  return Status::Ok();
}

}  // namespace

size_t topk_count(size_t n, double density) {
  if (n == 0) return 0;
  if (!(density > 0.0)) return 1;
  if (density >= 1.0) return n;
  const double k = std::round(density * static_cast<double>(n));
  if (k < 1.0) return 1;
  if (k >= static_cast<double>(n)) return n;
  return static_cast<size_t>(k);
}

size_t topk_scratch_bytes(size_t n) {
  return kScratchAlign + kHiHistBytes + kSampleBytes + n * sizeof(uint32_t);
}

namespace detail {

namespace {

// Validates and handles the trivial cases shared by both top-k flavours. Returns true with
// *result set when nothing is left to do.
Expected<bool> topk_trivial(const char* what, std::span<const float> x, size_t* k,
                            std::span<std::byte> scratch, uint32_t* out_index, float* out_value,
                            size_t* result) {
  const size_t n = x.size();
  SC_RETURN_IF_ERROR(check_topk_args(what, n, scratch));
  if (*k > n) *k = n;
  if (*k == 0) {
    *result = 0;
    return true;
  }
  if (out_index == nullptr || out_value == nullptr) {
    return invalid_argument(std::string(what) + ": null output with k=" + std::to_string(*k));
  }
  if (*k == n) {
    for (size_t i = 0; i < n; ++i) {
      out_index[i] = static_cast<uint32_t>(i);
      out_value[i] = x[i];
    }
    *result = n;
    return true;
  }
  return false;
}

// Histogram of the top 11 key bits, partition into winners / the k-th element's bin, radix
// refinement of that bin, merge. 0 < k < n, arguments validated.
size_t topk_two_pass(Isa isa, std::span<const float> x, size_t k, const ScratchLayout& mem,
                     uint32_t* out_index, float* out_value) {
  const size_t n = x.size();
  uint32_t* hist = mem.hist;
  uint32_t* candidates = mem.region;
  const bool avx512 = isa == Isa::kAvx512;

  // Pass 1: histogram of the top 11 key bits; find the bin of the k-th largest.
  std::memset(hist, 0, kHiHistBytes);
  if (avx512) {
    detail::topk_histogram_avx512(x.data(), n, hist);
  } else {
    detail::topk_histogram_portable(x.data(), n, hist);
  }
  for (size_t c = 1; c < detail::kTopkHistCopies; ++c) {
    const uint32_t* copy = hist + c * detail::kTopkHiBins;
    for (size_t b = 0; b < detail::kTopkHiBins; ++b) hist[b] += copy[b];
  }
  size_t above = 0;
  const uint32_t bin = find_bin(hist, detail::kTopkHiBins, k, &above);

  // Pass 2: everything in higher bins is selected (written straight to the output, in index
  // order); the bin itself becomes the candidate list.
  size_t n_candidates = 0;
  const size_t written =
      avx512 ? detail::topk_partition_avx512(x.data(), n, bin, out_index, out_value, candidates,
                                             &n_candidates)
             : detail::topk_partition_portable(x.data(), n, bin, out_index, out_value, candidates,
                                               &n_candidates);
  SC_CHECK(written == above && n_candidates == hist[bin],
           "top-k partition disagrees with its histogram ({}/{} above, {}/{} in bin)", written,
           above, n_candidates, hist[bin]);

  // The exact k-th key T among the candidates; keep those above T and the lowest-index ones
  // equal to T.
  const size_t need = k - above;
  size_t kept = n_candidates;
  if (need < n_candidates) {
    const float* xs = x.data();
    size_t ties = 0;
    const auto keys = [xs, candidates, n_candidates](auto&& f) {
      for (size_t j = 0; j < n_candidates; ++j) f(detail::magnitude_key(xs[candidates[j]]));
    };
    const uint32_t kth = kth_largest_key(keys, need, 0, detail::kNanKey, hist, &ties);
    kept = 0;
    for (size_t j = 0; j < n_candidates; ++j) {
      const uint32_t key = detail::magnitude_key(x[candidates[j]]);
      if (key > kth || (key == kth && ties > 0)) {
        if (key == kth) --ties;
        candidates[kept++] = candidates[j];
      }
    }
  }
  SC_CHECK(kept == need, "top-k refinement kept {} of {}", kept, need);
  const float* xs = x.data();
  merge_from_back(
      out_index, out_value, above, need, [candidates](size_t j) { return candidates[j]; },
      [xs, candidates](size_t j) { return xs[candidates[j]]; });
  return k;
}

// The sampled path: bracket the k-th key from a sample, one pass, refine the band. Returns
// false (outputs clobbered) when the bracket missed; the caller then runs the two-pass path.
bool topk_sampled(Isa isa, std::span<const float> x, size_t k, const ScratchLayout& mem,
                  uint32_t* out_index, float* out_value, ThreadPool* pool, size_t out_capacity) {
  const size_t n = x.size();
  const size_t s = sample_size(n);
  sample_keys(x.data(), nullptr, n, s, mem.sample);
  const double p = static_cast<double>(k) / static_cast<double>(n);
  const double rank = p * static_cast<double>(s);  // sample keys expected above the k-th
  const double margin = kBracketSigmas * std::sqrt(rank * (1.0 - p)) + kBracketSlack;
  const double hi_pos = std::floor(rank - margin);
  const double lo_pos = std::ceil(rank + margin);
  // Winners: key > hi (none when the bracket reaches the top); band: lo <= key <= hi.
  uint32_t hi = std::numeric_limits<uint32_t>::max();
  size_t from = 0;
  if (hi_pos >= 0.0) {
    const auto pos = static_cast<size_t>(hi_pos);
    hi = key_at_rank(mem.sample, 0, s, pos);
    from = pos + 1;
  }
  uint32_t lo = 0;
  if (lo_pos < static_cast<double>(s)) {
    const auto pos = std::max(from, static_cast<size_t>(lo_pos));
    lo = pos < s ? key_at_rank(mem.sample, from, s, pos) : 0;
  }
  // One pass writes every candidate (key >= lo) as an (index, value) pair, in index order, and
  // the band's keys (lo <= key <= hi) on their own; a radix select over the band finds the
  // exact k-th key T; a compaction of the candidates (about k + band pairs, not n) writes
  // key > T and the first `ties` keys == T. With a pool, x is split into chunks and chunk c
  // uses the scratch words [begin_c, end_c) for its candidates and band keys (each array with
  // the slack the vector stores need); the compaction of chunk c writes at the prefix of the
  // counts before it, so the result is the single-threaded one.
  const size_t slack = detail::kBandSlack;
  const unsigned chunks = chunk_count(pool, n);
  struct Chunk {
    size_t begin, end;
    uint32_t* cand_index;
    float* cand_value;
    uint32_t* band_keys;
    size_t count, band, above;
  };
  std::array<Chunk, kMaxKernelThreads> part{};
  for (unsigned c = 0; c < chunks; ++c) {
    Chunk& ch = part[c];
    ch.begin = chunk_begin(n, chunks, c);
    ch.end = chunk_begin(n, chunks, c + 1);
    const size_t words = ch.end - ch.begin;
    if (words < 8 * slack) return false;
    const size_t cap = (words - 3 * slack) * 3 / 8;
    ch.cand_index = mem.region + ch.begin;
    ch.cand_value = reinterpret_cast<float*>(ch.cand_index + cap + slack);
    ch.band_keys = reinterpret_cast<uint32_t*>(ch.cand_value + cap + slack);
    ch.count = cap;                                // capacity until the pass runs
    ch.band = words - 3 * slack - 2 * cap;
  }
  // One chunk and outputs with room for the candidates (the daemon's are n long): the candidates
  // go straight to the outputs and the compaction runs in place (it writes at or below where it
  // reads), so the result lines are written where they were just read instead of being fetched
  // for ownership a second time; the band keys get all of scratch.
  const bool in_place = chunks == 1 && out_capacity >= part[0].count + slack;
  if (in_place) {
    part[0].cand_index = out_index;
    part[0].cand_value = out_value;
    part[0].count = out_capacity - slack;
    part[0].band_keys = mem.region;
    part[0].band = n - slack;
  }
  const bool avx512 = isa == Isa::kAvx512;
  const auto candidates_pass = [&](unsigned c) {
    Chunk& ch = part[c];
    const auto base = static_cast<uint32_t>(ch.begin);
    const size_t m = ch.end - ch.begin;
    const size_t cap = ch.count;
    const size_t band_cap = ch.band;
    ch.count = avx512 ? detail::topk_candidates_avx512(x.data() + ch.begin, m, base, lo, hi,
                                                       ch.cand_index, ch.cand_value, cap,
                                                       ch.band_keys, band_cap, &ch.band, &ch.above)
                      : detail::topk_candidates_portable(x.data() + ch.begin, m, base, lo, hi,
                                                         ch.cand_index, ch.cand_value, cap,
                                                         ch.band_keys, band_cap, &ch.band,
                                                         &ch.above);
  };
  run_chunks(pool, chunks, candidates_pass);
  size_t count = 0;
  size_t above = 0;
  for (unsigned c = 0; c < chunks; ++c) {
    if (part[c].count == detail::kBandOverflow) return false;
    count += part[c].count;
    above += part[c].above;
  }
  if (above > k || count < k) return false;
  const size_t need = k - above;
  uint32_t kth = hi;  // need == 0: exactly the keys above hi
  size_t ties = 0;
  if (need > 0) {
    const auto band_keys = [&part, chunks](auto&& f) {
      for (unsigned c = 0; c < chunks; ++c) {
        for (size_t j = 0; j < part[c].band; ++j) f(part[c].band_keys[j]);
      }
    };
    kth = kth_largest_key(band_keys, need, lo, hi, mem.hist, &ties);
  }
  // Chunk c keeps gt_c (key > kth) plus its share of the ties, in chunk order.
  std::array<size_t, kMaxKernelThreads> keep{};
  std::array<size_t, kMaxKernelThreads> chunk_ties{};
  std::array<size_t, kMaxKernelThreads> offset{};
  if (chunks == 1) {
    keep[0] = k;
    chunk_ties[0] = ties;
  } else {
    size_t ties_left = ties;
    size_t at = 0;
    for (unsigned c = 0; c < chunks; ++c) {
      size_t gt = part[c].above;
      size_t eq = 0;
      for (size_t j = 0; j < part[c].band; ++j) {
        gt += part[c].band_keys[j] > kth ? 1 : 0;
        eq += part[c].band_keys[j] == kth ? 1 : 0;
      }
      chunk_ties[c] = std::min(eq, ties_left);
      ties_left -= chunk_ties[c];
      keep[c] = gt + chunk_ties[c];
      offset[c] = at;
      at += keep[c];
    }
    SC_CHECK(at == k, "top-k chunks keep {} of {}", at, k);
  }
  std::array<size_t, kMaxKernelThreads> written{};
  const auto compact = [&](unsigned c) {
    const Chunk& ch = part[c];
    written[c] = avx512 ? detail::topk_compact_avx512(ch.cand_index, ch.cand_value, ch.count, kth,
                                                      chunk_ties[c], out_index + offset[c],
                                                      out_value + offset[c], keep[c])
                        : detail::topk_compact_portable(ch.cand_index, ch.cand_value, ch.count,
                                                        kth, chunk_ties[c], out_index + offset[c],
                                                        out_value + offset[c], keep[c]);
  };
  run_chunks(pool, chunks, compact);
  for (unsigned c = 0; c < chunks; ++c) {
    SC_CHECK(written[c] == keep[c], "top-k compaction of chunk {} wrote {} of {}", c,
             written[c], keep[c]);
  }
  return true;
}

// A selection pass split over the pool: chunk c runs pass(begin_c, end_c, ...) with its output
// at out + begin_c (room for the whole chunk, as capacity >= n), then the chunks' pairs move down
// in order, their indices rebased. Without a pool, or with capacity < n (a pass must then stop
// where the single-threaded one would), one pass over everything.
template <class Pass>
size_t chunked_select(ThreadPool* pool, size_t n, uint32_t* out_index, float* out_value,
                      size_t capacity, const Pass& pass) {
  const unsigned chunks = capacity >= n ? chunk_count(pool, n) : 1;
  if (chunks == 1) return pass(0, n, out_index, out_value, capacity);
  std::array<size_t, kMaxKernelThreads> counts{};
  run_chunks(pool, chunks, [&](unsigned c) {
    const size_t begin = chunk_begin(n, chunks, c);
    const size_t end = chunk_begin(n, chunks, c + 1);
    counts[c] = pass(begin, end, out_index + begin, out_value + begin, end - begin);
  });
  size_t total = counts[0];
  for (unsigned c = 1; c < chunks; ++c) {
    const size_t begin = chunk_begin(n, chunks, c);
    const auto base = static_cast<uint32_t>(begin);
    for (size_t j = 0; j < counts[c]; ++j) {  // total <= begin: a forward copy is safe
      out_index[total + j] = out_index[begin + j] + base;
      out_value[total + j] = out_value[begin + j];
    }
    total += counts[c];
  }
  return total;
}

// threshold_select on a key (magnitude_key(x_i) >= key), split over the pool.
size_t threshold_keys(Isa isa, std::span<const float> x, uint32_t key, uint32_t* out_index,
                      float* out_value, size_t capacity, ThreadPool* pool) {
  const auto pass = [&](size_t begin, size_t end, uint32_t* oi, float* ov, size_t cap) {
    return isa == Isa::kAvx512
               ? detail::threshold_select_avx512(x.data() + begin, end - begin, key, oi, ov, cap)
               : detail::threshold_select_portable(x.data() + begin, end - begin, key, oi, ov,
                                                   cap);
  };
  return chunked_select(pool, x.size(), out_index, out_value, capacity, pass);
}

}  // namespace

Expected<size_t> topk_exact_isa(Isa isa, std::span<const float> x, size_t k,
                                std::span<std::byte> scratch, uint32_t* out_index,
                                float* out_value, ThreadPool* pool, size_t capacity) {
  size_t result = 0;
  SC_ASSIGN_OR_RETURN(bool done,
                      topk_trivial("topk_exact", x, &k, scratch, out_index, out_value, &result));
  if (done) return result;
  const ScratchLayout mem = layout_of(scratch);
  if (x.size() >= kSampledMinN &&
      topk_sampled(isa, x, k, mem, out_index, out_value, pool, std::max(capacity, k))) {
    return k;
  }
  return topk_two_pass(isa, x, k, mem, out_index, out_value);
}

Expected<size_t> topk_exact_two_pass_isa(Isa isa, std::span<const float> x, size_t k,
                                         std::span<std::byte> scratch, uint32_t* out_index,
                                         float* out_value) {
  size_t result = 0;
  SC_ASSIGN_OR_RETURN(bool done,
                      topk_trivial("topk_exact", x, &k, scratch, out_index, out_value, &result));
  if (done) return result;
  return topk_two_pass(isa, x, k, layout_of(scratch), out_index, out_value);
}

Expected<size_t> topk_approx_isa(Isa isa, std::span<const float> x, size_t k, double tolerance,
                                 std::span<std::byte> scratch, uint32_t* out_index,
                                 float* out_value, size_t capacity, ThreadPool* pool) {
  const size_t n = x.size();
  if (!(tolerance >= 0.0 && tolerance <= 1.0)) {
    return invalid_argument("topk_approx: tolerance " + std::to_string(tolerance) +
                            " is outside [0, 1]");
  }
  if (capacity < std::min(k, n)) {
    return invalid_argument("topk_approx: capacity " + std::to_string(capacity) +
                            " is below k=" + std::to_string(std::min(k, n)));
  }
  size_t result = 0;
  SC_ASSIGN_OR_RETURN(bool done,
                      topk_trivial("topk_approx", x, &k, scratch, out_index, out_value, &result));
  if (done) return result;
  const ScratchLayout mem = layout_of(scratch);
  const size_t s = sample_size(n);
  sample_keys(x.data(), nullptr, n, s, mem.sample);
  const size_t at = detail::approx_sample_position(k, n, s, tolerance);
  const uint32_t lambda = key_at_rank(mem.sample, 0, s, at);
  const size_t count = threshold_keys(isa, x, lambda, out_index, out_value, capacity, pool);
  const double low = static_cast<double>(k) * (1.0 - tolerance);
  const double high = static_cast<double>(k) * (1.0 + tolerance);
  const auto c = static_cast<double>(count);
  if (count <= capacity && c >= low && c <= high) return count;
  if (count <= capacity && c > high) {
    // Every unselected |x_i| is below lambda <= every selected one: the top k of the selection
    // is the exact top k.
    keep_largest_pairs(isa, out_index, out_value, count, k, mem.hist, lambda);  // every key >= lambda
    return k;
  }
  return topk_exact_isa(isa, x, k, scratch, out_index, out_value, pool, capacity);
}

size_t threshold_select_isa(Isa isa, std::span<const float> x, float lambda, uint32_t* out_index,
                            float* out_value, size_t capacity, ThreadPool* pool) {
  SC_CHECK(x.size() <= kMaxElements, "threshold_select: {} elements exceed uint32", x.size());
  SC_CHECK(capacity == 0 || (out_index != nullptr && out_value != nullptr),
           "threshold_select: null output with capacity {}", capacity);
  return threshold_keys(isa, x, lambda_key(lambda), out_index, out_value, capacity, pool);
}

size_t ef_threshold_isa(Isa isa, std::span<float> residual, std::span<const float> grad,
                        float lambda, uint32_t* out_index, float* out_value, size_t capacity,
                        ThreadPool* pool) {
  SC_CHECK(residual.size() == grad.size(), "ef_threshold: {} vs {} elements", residual.size(),
           grad.size());
  SC_CHECK(residual.size() <= kMaxElements, "ef_threshold: {} elements exceed uint32",
           residual.size());
  SC_CHECK(capacity == 0 || (out_index != nullptr && out_value != nullptr),
           "ef_threshold: null output with capacity {}", capacity);
  const uint32_t key = lambda_key(lambda);
  const auto pass = [&](size_t begin, size_t end, uint32_t* oi, float* ov, size_t cap) {
    return isa == Isa::kAvx512 ? detail::ef_threshold_avx512(residual.data() + begin,
                                                             grad.data() + begin, end - begin,
                                                             key, oi, ov, cap)
                               : detail::ef_threshold_portable(residual.data() + begin,
                                                               grad.data() + begin, end - begin,
                                                               key, oi, ov, cap);
  };
  return chunked_select(pool, residual.size(), out_index, out_value, capacity, pass);
}

}  // namespace detail

// ---- public API: the best variant for this CPU -----------------------------------------------

Expected<size_t> topk_exact(std::span<const float> x, size_t k, std::span<std::byte> scratch,
                            uint32_t* out_index, float* out_value, ThreadPool* pool,
                            size_t capacity) {
  return detail::topk_exact_isa(detail::best_isa(), x, k, scratch, out_index, out_value, pool,
                                capacity);
}

size_t threshold_select(std::span<const float> x, float lambda, uint32_t* out_index,
                        float* out_value, size_t capacity, ThreadPool* pool) {
  return detail::threshold_select_isa(detail::best_isa(), x, lambda, out_index, out_value,
                                      capacity, pool);
}


size_t ef_threshold(std::span<float> residual, std::span<const float> grad, float lambda,
                    uint32_t* out_index, float* out_value, size_t capacity, ThreadPool* pool) {
  return detail::ef_threshold_isa(detail::best_isa(), residual, grad, lambda, out_index, out_value,
                                  capacity, pool);
}

Expected<size_t> topk_approx(std::span<const float> x, size_t k, double tolerance,
                             std::span<std::byte> scratch, uint32_t* out_index, float* out_value,
                             size_t capacity, ThreadPool* pool) {
  return detail::topk_approx_isa(detail::best_isa(), x, k, tolerance, scratch, out_index,
                                 out_value, capacity, pool);
}

float magnitude_quantile(std::span<const float> x, double q, std::span<std::byte> scratch,
                         std::span<const float> add) {
  const size_t n = x.size();
  SC_CHECK(add.empty() || add.size() == n, "magnitude_quantile: {} vs {} elements", n,
           add.size());
  SC_CHECK(scratch.size() >= kScratchAlign + kHiHistBytes + kSampleBytes,
           "magnitude_quantile: scratch of {} bytes", scratch.size());
  if (n == 0) return 0.0f;
  if (!(q >= 0.0)) q = 0.0;  // NaN too
  if (q > 1.0) q = 1.0;
  const ScratchLayout mem = layout_of(scratch);
  const size_t s = sample_size(n);
  sample_keys(x.data(), add.empty() ? nullptr : add.data(), n, s, mem.sample);
  // Ascending position floor(q s): |e| >= lambda keeps the top s - floor(q s) of the sample.
  const auto asc = std::min(s - 1, static_cast<size_t>(std::floor(q * static_cast<double>(s))));
  const uint32_t key = key_at_rank(mem.sample, 0, s, s - 1 - asc);
  if (key >= detail::kNanKey) return std::numeric_limits<float>::infinity();
  return std::bit_cast<float>(key);
}

uint32_t random_draw(uint64_t seed, uint32_t index) {
  const uint64_t mixed = detail::splitmix64(seed);
  return detail::draw(static_cast<uint32_t>(mixed), static_cast<uint32_t>(mixed >> 32), index);
}

uint64_t derive_seed(uint64_t job_seed, uint32_t tensor_id, uint64_t step) {
  return detail::splitmix64(detail::splitmix64(detail::splitmix64(job_seed) ^ tensor_id) ^ step);
}

namespace {

constexpr double kTwo32 = 4294967296.0;

}  // namespace

uint64_t random_keep_threshold(double p) { return detail::keep_threshold(p); }

size_t randomk_select(std::span<const float> x, double p, uint64_t seed, bool unbiased,
                      uint32_t* out_index, float* out_value, size_t capacity) {
  const size_t n = x.size();
  SC_CHECK(n <= kMaxElements, "randomk_select: {} elements exceed uint32", n);
  SC_CHECK(capacity == 0 || (out_index != nullptr && out_value != nullptr),
           "randomk_select: null output with capacity {}", capacity);
  const uint64_t t = random_keep_threshold(p);
  if (t == 0) return 0;
  // Scale by the probability actually used (t / 2^32), so E[sent] == x exactly.
  const double inv_p = kTwo32 / static_cast<double>(t);
  const uint64_t mixed = detail::splitmix64(seed);
  const auto a = static_cast<uint32_t>(mixed);
  const auto b = static_cast<uint32_t>(mixed >> 32);
  size_t count = 0;
  for (size_t i = 0; i < n; ++i) {
    if (detail::draw(a, b, static_cast<uint32_t>(i)) < t) {
      if (count < capacity) {
        out_index[count] = static_cast<uint32_t>(i);
        out_value[count] =
            unbiased ? static_cast<float>(static_cast<double>(x[i]) * inv_p) : x[i];
      }
      ++count;
    }
  }
  return count;
}

double importance_scale(std::span<const float> x, size_t k) {
  // Every sum in the blocked tree order of detail/importance.h, which the CUDA kernels repeat.
  const size_t n = x.size();
  uint64_t nonfinite = 0;
  uint64_t nonzero = 0;
  const double sum =
      detail::blocked_tree_sum(n, [&](size_t i) { return detail::importance_stats_term(x[i], nonfinite, nonzero); });
  detail::ImportanceSolve solve = detail::importance_start(k, nonfinite, nonzero, sum);
  for (int round = 0; round < detail::kImportanceRounds && !solve.done; ++round) {
    uint64_t capped = 0;
    const double uncapped =
        detail::blocked_tree_sum(n, [&](size_t i) { return detail::importance_round_term(x[i], solve.c, capped); });
    detail::importance_round(solve, round, nonfinite + capped, uncapped);
  }
  return solve.c;
}

size_t importance_select(std::span<const float> x, size_t k, uint64_t seed, bool unbiased,
                         uint32_t* out_index, float* out_value, size_t capacity) {
  const size_t n = x.size();
  SC_CHECK(n <= kMaxElements, "importance_select: {} elements exceed uint32", n);
  SC_CHECK(capacity == 0 || (out_index != nullptr && out_value != nullptr),
           "importance_select: null output with capacity {}", capacity);
  if (k == 0 || n == 0) return 0;
  const double c = importance_scale(x, k);
  const uint64_t mixed = detail::splitmix64(seed);
  const auto a = static_cast<uint32_t>(mixed);
  const auto b = static_cast<uint32_t>(mixed >> 32);
  size_t count = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint64_t t = detail::importance_keep_threshold(x[i], c);
    if (detail::draw(a, b, static_cast<uint32_t>(i)) < t) {
      if (count < capacity) {
        out_index[count] = static_cast<uint32_t>(i);
        out_value[count] = unbiased ? detail::importance_unbiased(x[i], t) : x[i];
      }
      ++count;
    }
  }
  return count;
}

}  // namespace sparsecar::kernels
