// Structured selectors (structured.h): validate, score the groups, rank them, emit.
//
// Group scores are a streaming pass (memory-bound like ef_accumulate); ranking works on one
// score per group (n / 32 at most for blocks), so a comparison-based nth_element over the group
// ids is cheap next to the pass over x and keeps the tie rule obvious.
#include "sparsecar/kernels/structured.h"

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>

#include "detail/cpu.h"
#include "detail/topk.h"
#include "sparsecar/common/log.h"
#include "sparsecar/kernels/select.h"

namespace sparsecar::kernels {
namespace {

constexpr size_t kScratchAlign = 64;
constexpr size_t kMaxElements = std::numeric_limits<uint32_t>::max();  // indices are uint32

struct GroupScratch {
  double* score = nullptr;
  uint32_t* order = nullptr;
};

GroupScratch carve(std::span<std::byte> scratch, size_t groups) {
  auto base = reinterpret_cast<uintptr_t>(scratch.data());
  const uintptr_t aligned = (base + kScratchAlign - 1) & ~uintptr_t{kScratchAlign - 1};
  GroupScratch s;
  s.score = reinterpret_cast<double*>(aligned);
  s.order = reinterpret_cast<uint32_t*>(aligned + groups * sizeof(double));
  return s;
}

// Scores add x² or |x| in float64. NaN propagates through the sum (a NaN group ranks first).
inline double term(float v, GroupNorm norm) {
  const double d = static_cast<double>(v);
  return norm == GroupNorm::kL2 ? d * d : std::fabs(d);
}

// a ranks before b: NaN first, then the larger score, then the lower group index.
inline bool ranks_before(const double* score, uint32_t a, uint32_t b) {
  const bool na = std::isnan(score[a]), nb = std::isnan(score[b]);
  if (na != nb) return na;
  if (!na && score[a] != score[b]) return score[a] > score[b];
  return a < b;
}

// Ranks `groups` scored groups and leaves the ids of the `keep` best in order[0..keep) in
// increasing id order. keep <= groups.
void rank_groups(const GroupScratch& s, size_t groups, size_t keep) {
  for (size_t g = 0; g < groups; ++g) s.order[g] = static_cast<uint32_t>(g);
  if (keep < groups) {
    std::nth_element(s.order, s.order + keep, s.order + groups,
                     [&](uint32_t a, uint32_t b) { return ranks_before(s.score, a, b); });
  }
  std::sort(s.order, s.order + keep);
}

Status check_common(std::span<const float> x, size_t groups, size_t keep, std::span<std::byte> scratch,
                    const uint32_t* out_index, const float* out_value, const char* who) {
  if (x.size() > kMaxElements) {
    return invalid_argument(std::string(who) + ": more than 2^32 - 1 elements");
  }
  if (scratch.size() < group_scratch_bytes(groups)) {
    return invalid_argument(std::string(who) + ": scratch of " + std::to_string(scratch.size()) +
                            " bytes; needs " + std::to_string(group_scratch_bytes(groups)));
  }
  if (keep > 0 && !x.empty() && (out_index == nullptr || out_value == nullptr)) {
    return invalid_argument(std::string(who) + ": null output");
  }
  return Status::Ok();
}

// Keeps the `keep` best of the contiguous groups [g*size, min((g+1)*size, n)).
size_t contiguous_topk(std::span<const float> x, size_t size, size_t keep, GroupNorm norm,
                       std::span<std::byte> scratch, uint32_t* out_index, float* out_value) {
  const size_t n = x.size();
  if (n == 0 || keep == 0) return 0;
  const size_t groups = (n + size - 1) / size;
  keep = std::min(keep, groups);
  GroupScratch s = carve(scratch, groups);
  for (size_t g = 0; g < groups; ++g) {
    const size_t begin = g * size, end = std::min(n, begin + size);
    double acc = 0.0;
    for (size_t i = begin; i < end; ++i) acc += term(x[i], norm);
    s.score[g] = acc;
  }
  rank_groups(s, groups, keep);
  size_t out = 0;
  for (size_t j = 0; j < keep; ++j) {
    const size_t begin = size_t{s.order[j]} * size, end = std::min(n, begin + size);
    for (size_t i = begin; i < end; ++i) {
      out_index[out] = static_cast<uint32_t>(i);
      out_value[out] = x[i];
      ++out;
    }
  }
  return out;
}

}  // namespace

std::string_view group_norm_name(GroupNorm norm) {
  switch (norm) {
    case GroupNorm::kL2: return "l2";
    case GroupNorm::kL1: return "l1";
  }
  return "unknown";
}

bool parse_group_norm(std::string_view text, GroupNorm* out) {
  for (GroupNorm g : {GroupNorm::kL2, GroupNorm::kL1}) {
    if (text == group_norm_name(g)) {
      *out = g;
      return true;
    }
  }
  return false;
}

size_t group_scratch_bytes(size_t groups) { return kScratchAlign + groups * (sizeof(double) + sizeof(uint32_t)); }

Expected<size_t> block_topk(std::span<const float> x, size_t block, size_t keep, GroupNorm norm,
                            std::span<std::byte> scratch, uint32_t* out_index, float* out_value) {
  if (block < kMinBlock || block > kMaxBlock) {
    return invalid_argument("block_topk: block of " + std::to_string(block) + " elements; allowed " +
                            std::to_string(kMinBlock) + ".." + std::to_string(kMaxBlock));
  }
  SC_RETURN_IF_ERROR(check_common(x, (x.size() + block - 1) / block, keep, scratch, out_index, out_value, "block_topk"));
  return contiguous_topk(x, block, keep, norm, scratch, out_index, out_value);
}

Expected<size_t> randblock_select(std::span<const float> x, size_t block, double p, uint64_t seed, bool unbiased,
                                  uint32_t* out_index, float* out_value, size_t capacity) {
  const size_t n = x.size();
  if (block < kMinBlock || block > kMaxBlock) {
    return invalid_argument("randblock_select: block of " + std::to_string(block) + " elements; allowed " +
                            std::to_string(kMinBlock) + ".." + std::to_string(kMaxBlock));
  }
  if (n > kMaxElements) return invalid_argument("randblock_select: more than 2^32 - 1 elements");
  if (capacity > 0 && (out_index == nullptr || out_value == nullptr)) {
    return invalid_argument("randblock_select: null output");
  }
  const uint64_t t = random_keep_threshold(p);
  if (t == 0) return size_t{0};
  const double inv_p = 4294967296.0 / static_cast<double>(t);
  // random_draw(seed, b) with the seed's mix taken once.
  const uint64_t mixed = detail::splitmix64(seed);
  const auto a = static_cast<uint32_t>(mixed);
  const auto b = static_cast<uint32_t>(mixed >> 32);
  size_t count = 0;
  const size_t blocks = (n + block - 1) / block;
  for (size_t g = 0; g < blocks; ++g) {
    if (detail::draw(a, b, static_cast<uint32_t>(g)) >= t) continue;
    const size_t end = std::min(n, (g + 1) * block);
    for (size_t i = g * block; i < end; ++i, ++count) {
      if (count >= capacity) continue;
      out_index[count] = static_cast<uint32_t>(i);
      out_value[count] = unbiased ? static_cast<float>(static_cast<double>(x[i]) * inv_p) : x[i];
    }
  }
  return count;
}

Expected<size_t> row_topk(std::span<const float> x, size_t rows, size_t cols, size_t keep, GroupNorm norm,
                          std::span<std::byte> scratch, uint32_t* out_index, float* out_value) {
  if (rows == 0 || cols == 0 || rows > x.size() || rows * cols != x.size()) {
    return invalid_argument("row_topk: shape [" + std::to_string(rows) + ", " + std::to_string(cols) +
                            "] does not hold " + std::to_string(x.size()) + " elements");
  }
  SC_RETURN_IF_ERROR(check_common(x, rows, keep, scratch, out_index, out_value, "row_topk"));
  return contiguous_topk(x, cols, keep, norm, scratch, out_index, out_value);
}

Expected<size_t> channel_topk(std::span<const float> x, std::span<const uint64_t, 4> shape, size_t keep,
                              GroupNorm norm, std::span<std::byte> scratch, uint32_t* out_index,
                              float* out_value) {
  uint64_t product = 1;
  bool overflow = false;
  for (uint64_t d : shape) {
    if (d == 0 || product > std::numeric_limits<uint64_t>::max() / d) overflow = true;
    if (!overflow) product *= d;
  }
  if (overflow || product != x.size()) {
    return invalid_argument("channel_topk: shape [" + std::to_string(shape[0]) + ", " + std::to_string(shape[1]) +
                            ", " + std::to_string(shape[2]) + ", " + std::to_string(shape[3]) +
                            "] does not hold " + std::to_string(x.size()) + " elements");
  }
  SC_RETURN_IF_ERROR(check_common(x, shape[0], keep, scratch, out_index, out_value, "channel_topk"));
  return contiguous_topk(x, x.size() / shape[0], keep, norm, scratch, out_index, out_value);
}

Expected<size_t> head_topk(std::span<const float> x, size_t leading, size_t heads, size_t keep, GroupNorm norm,
                           std::span<std::byte> scratch, uint32_t* out_index, float* out_value) {
  if (leading == 0 || heads == 0 || x.size() % leading != 0 || leading % heads != 0) {
    return invalid_argument("head_topk: " + std::to_string(heads) + " heads do not split a leading dimension of " +
                            std::to_string(leading) + " (of " + std::to_string(x.size()) + " elements)");
  }
  SC_RETURN_IF_ERROR(check_common(x, heads, keep, scratch, out_index, out_value, "head_topk"));
  return contiguous_topk(x, x.size() / heads, keep, norm, scratch, out_index, out_value);
}

Expected<size_t> column_topk(std::span<const float> x, size_t rows, size_t cols, size_t keep, GroupNorm norm,
                             std::span<std::byte> scratch, uint32_t* out_index, float* out_value) {
  if (rows == 0 || cols == 0 || rows > x.size() || rows * cols != x.size()) {
    return invalid_argument("column_topk: shape [" + std::to_string(rows) + ", " + std::to_string(cols) +
                            "] does not hold " + std::to_string(x.size()) + " elements");
  }
  SC_RETURN_IF_ERROR(check_common(x, cols, keep, scratch, out_index, out_value, "column_topk"));
  if (keep == 0) return size_t{0};
  keep = std::min(keep, cols);
  GroupScratch s = carve(scratch, cols);
  std::fill(s.score, s.score + cols, 0.0);
  // Row by row: each column still sums its elements in increasing index order.
  for (size_t r = 0; r < rows; ++r) {
    const float* row = x.data() + r * cols;
    for (size_t c = 0; c < cols; ++c) s.score[c] += term(row[c], norm);
  }
  rank_groups(s, cols, keep);
  size_t out = 0;
  for (size_t r = 0; r < rows; ++r) {
    const size_t base = r * cols;
    for (size_t j = 0; j < keep; ++j) {
      const size_t i = base + s.order[j];
      out_index[out] = static_cast<uint32_t>(i);
      out_value[out] = x[i];
      ++out;
    }
  }
  return out;
}

void importance_accumulate(std::span<float> importance, std::span<const float> g) {
  SC_CHECK(importance.size() == g.size(), "importance_accumulate: {} vs {} elements", importance.size(), g.size());
  float* acc = importance.data();
  const float* src = g.data();
  for (size_t i = 0; i < g.size(); ++i) acc[i] += std::fabs(src[i]);
}

void gather(std::span<const float> x, std::span<const uint32_t> index, float* out_value) {
  const size_t n = x.size();
  for (size_t j = 0; j < index.size(); ++j) {
    SC_CHECK(index[j] < n, "gather: index {} out of {} elements", index[j], n);
    out_value[j] = x[index[j]];
  }
}

Expected<size_t> topk_or_threshold(std::span<const float> x, size_t k, float lambda, std::span<std::byte> scratch,
                                   uint32_t* out_index, float* out_value) {
  if (!x.empty() && (out_index == nullptr || out_value == nullptr)) {
    return invalid_argument("topk_or_threshold: null output");
  }
  SC_ASSIGN_OR_RETURN(size_t kept, topk_exact(x, k, scratch, out_index, out_value));
  // The top-k holds every element above the k-th magnitude. If lambda lies above it, the
  // threshold set is inside the top-k and the top-k is the union; otherwise the threshold set
  // holds the whole top-k (ties at the k-th magnitude included) and is the union.
  const uint32_t lambda_key = lambda > 0.0f ? detail::magnitude_key(lambda) : 0;
  uint32_t kth_key = std::numeric_limits<uint32_t>::max();
  for (size_t j = 0; j < kept; ++j) kth_key = std::min(kth_key, detail::magnitude_key(out_value[j]));
  if (kept > 0 && lambda_key > kth_key) return kept;
  return threshold_select(x, lambda, out_index, out_value, x.size());
}

void magnitude_histogram_add(std::span<uint64_t, kMagnitudeBins> hist, std::span<const float> x) {
  for (float v : x) ++hist[detail::magnitude_key(v) >> 15];
}

float magnitude_histogram_threshold(std::span<const uint64_t, kMagnitudeBins> hist, uint64_t count) {
  if (count == 0) return std::numeric_limits<float>::infinity();
  uint64_t sum = 0;
  for (size_t b = kMagnitudeBins; b-- > 0;) {
    sum += hist[b];
    if (sum >= count) {
      const uint32_t edge = static_cast<uint32_t>(b) << 15;
      return edge >= 0x7f800000u ? std::numeric_limits<float>::infinity() : std::bit_cast<float>(edge);
    }
  }
  return 0.0f;
}

}  // namespace sparsecar::kernels
