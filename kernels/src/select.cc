// Public selection kernels: validate, then dispatch to the per-ISA variants in detail/.
#include "sparsecar/kernels/select.h"

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <string>

#include "detail/cpu.h"
#include "sparsecar/common/log.h"

namespace sparsecar::kernels {
namespace {

using detail::Isa;

constexpr size_t kScratchAlign = 64;
constexpr size_t kHiHistBytes = detail::kTopkHistCopies * detail::kTopkHiBins * sizeof(uint32_t);
constexpr size_t kMaxElements = std::numeric_limits<uint32_t>::max();  // indices are uint32

// Key that |x| must reach to be selected by `|x| >= lambda`. A lambda that is not > 0 (zero,
// negative, NaN) selects every element; +inf selects +-inf and NaN.
uint32_t lambda_key(float lambda) {
  if (!(lambda > 0.0f)) return 0;
  return detail::magnitude_key(lambda);
}

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
  SC_CHECK(false, "top-k histogram holds %zu keys, fewer than k=%zu", sum, k);
  return 0;
}

}  // namespace

namespace detail {

void add_isa(Isa isa, std::span<float> dst, std::span<const float> src) {
  SC_CHECK(dst.size() == src.size(), "add: %zu vs %zu elements", dst.size(), src.size());
  if (isa == Isa::kAvx512) {
    detail::add_avx512(dst.data(), src.data(), dst.size());
  } else {
    detail::add_portable(dst.data(), src.data(), dst.size());
  }
}

void scale_isa(Isa isa, std::span<float> x, float factor) {
  if (isa == Isa::kAvx512) {
    detail::scale_avx512(x.data(), x.size(), factor);
  } else {
    detail::scale_portable(x.data(), x.size(), factor);
  }
}

}  // namespace detail

size_t topk_count(size_t n, double density) {
  if (n == 0) return 0;
  if (!(density > 0.0)) return 1;
  if (density >= 1.0) return n;
  const double k = std::round(density * static_cast<double>(n));
  if (k < 1.0) return 1;
  if (k >= static_cast<double>(n)) return n;
  return static_cast<size_t>(k);
}

size_t topk_scratch_bytes(size_t n) { return kScratchAlign + kHiHistBytes + n * sizeof(uint32_t); }

namespace detail {

Expected<size_t> topk_exact_isa(Isa isa, std::span<const float> x, size_t k,
                                std::span<std::byte> scratch, uint32_t* out_index,
                                float* out_value) {
  const size_t n = x.size();
  if (n > kMaxElements) {
    return invalid_argument("topk_exact: " + std::to_string(n) + " elements exceed uint32 indices");
  }
  if (scratch.size() < topk_scratch_bytes(n)) {
    return invalid_argument("topk_exact: scratch of " + std::to_string(scratch.size()) +
                            " bytes, need topk_scratch_bytes(" + std::to_string(n) +
                            ") = " + std::to_string(topk_scratch_bytes(n)));
  }
  if (k > n) k = n;
  if (k == 0) return size_t{0};
  if (out_index == nullptr || out_value == nullptr) {
    return invalid_argument("topk_exact: null output with k=" + std::to_string(k));
  }
  if (k == n) {
    for (size_t i = 0; i < n; ++i) {
      out_index[i] = static_cast<uint32_t>(i);
      out_value[i] = x[i];
    }
    return n;
  }

  const uintptr_t base = reinterpret_cast<uintptr_t>(scratch.data());
  const uintptr_t aligned = (base + kScratchAlign - 1) & ~uintptr_t{kScratchAlign - 1};
  uint32_t* hist = std::assume_aligned<kScratchAlign>(reinterpret_cast<uint32_t*>(aligned));
  uint32_t* candidates = hist + kHiHistBytes / sizeof(uint32_t);
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
           "top-k partition disagrees with its histogram (%zu/%zu above, %zu/%u in bin)", written,
           above, n_candidates, hist[bin]);

  // Refine within the candidates on the lower 10 + 10 key bits to the exact k-th key T, then keep
  // the candidates above T and the lowest-index ones equal to T.
  const size_t need = k - above;
  size_t kept = n_candidates;
  if (need < n_candidates) {
    const uint32_t* cand = candidates;
    size_t above2 = 0;
    std::memset(hist, 0, detail::kTopkLoBins * sizeof(uint32_t));
    for (size_t j = 0; j < n_candidates; ++j) {
      ++hist[(detail::magnitude_key(x[cand[j]]) >> 10) & (detail::kTopkLoBins - 1)];
    }
    const uint32_t mid = find_bin(hist, detail::kTopkLoBins, need, &above2);
    const uint32_t prefix = (bin << 10) | mid;
    size_t above3 = 0;
    std::memset(hist, 0, detail::kTopkLoBins * sizeof(uint32_t));
    for (size_t j = 0; j < n_candidates; ++j) {
      const uint32_t key = detail::magnitude_key(x[cand[j]]);
      if ((key >> 10) == prefix) ++hist[key & (detail::kTopkLoBins - 1)];
    }
    const uint32_t low = find_bin(hist, detail::kTopkLoBins, need - above2, &above3);
    const uint32_t kth_key = (prefix << 10) | low;
    size_t ties = need - above2 - above3;  // how many keys equal to kth_key to take, lowest first
    kept = 0;
    for (size_t j = 0; j < n_candidates; ++j) {
      const uint32_t key = detail::magnitude_key(x[candidates[j]]);
      if (key > kth_key || (key == kth_key && ties > 0)) {
        if (key == kth_key) --ties;
        candidates[kept++] = candidates[j];
      }
    }
  }
  SC_CHECK(kept == need, "top-k refinement kept %zu of %zu", kept, need);

  // Merge the two index-sorted lists, from the back, into out[0, k).
  size_t i = above;
  size_t j = kept;
  size_t w = k;
  while (j > 0) {
    --w;
    if (i > 0 && out_index[i - 1] > candidates[j - 1]) {
      --i;
      out_index[w] = out_index[i];
      out_value[w] = out_value[i];
    } else {
      --j;
      out_index[w] = candidates[j];
      out_value[w] = x[candidates[j]];
    }
  }
  return k;
}

size_t threshold_select_isa(Isa isa, std::span<const float> x, float lambda, uint32_t* out_index,
                            float* out_value, size_t capacity) {
  SC_CHECK(x.size() <= kMaxElements, "threshold_select: %zu elements exceed uint32", x.size());
  SC_CHECK(capacity == 0 || (out_index != nullptr && out_value != nullptr),
           "threshold_select: null output with capacity %zu", capacity);
  const uint32_t key = lambda_key(lambda);
  if (isa == Isa::kAvx512) {
    return detail::threshold_select_avx512(x.data(), x.size(), key, out_index, out_value, capacity);
  }
  return detail::threshold_select_portable(x.data(), x.size(), key, out_index, out_value, capacity);
}

size_t ef_threshold_isa(Isa isa, std::span<float> residual, std::span<const float> grad,
                        float lambda, uint32_t* out_index, float* out_value, size_t capacity) {
  SC_CHECK(residual.size() == grad.size(), "ef_threshold: %zu vs %zu elements", residual.size(),
           grad.size());
  SC_CHECK(residual.size() <= kMaxElements, "ef_threshold: %zu elements exceed uint32",
           residual.size());
  SC_CHECK(capacity == 0 || (out_index != nullptr && out_value != nullptr),
           "ef_threshold: null output with capacity %zu", capacity);
  const uint32_t key = lambda_key(lambda);
  if (isa == Isa::kAvx512) {
    return detail::ef_threshold_avx512(residual.data(), grad.data(), residual.size(), key,
                                       out_index, out_value, capacity);
  }
  return detail::ef_threshold_portable(residual.data(), grad.data(), residual.size(), key,
                                       out_index, out_value, capacity);
}

}  // namespace detail

// ---- public API: the best variant for this CPU -----------------------------------------------

void ef_accumulate(std::span<float> residual, std::span<const float> grad) { add(residual, grad); }

void add(std::span<float> dst, std::span<const float> src) {
  detail::add_isa(detail::best_isa(), dst, src);
}

void scale(std::span<float> x, float factor) { detail::scale_isa(detail::best_isa(), x, factor); }

Expected<size_t> topk_exact(std::span<const float> x, size_t k, std::span<std::byte> scratch,
                            uint32_t* out_index, float* out_value) {
  return detail::topk_exact_isa(detail::best_isa(), x, k, scratch, out_index, out_value);
}

size_t threshold_select(std::span<const float> x, float lambda, uint32_t* out_index,
                        float* out_value, size_t capacity) {
  return detail::threshold_select_isa(detail::best_isa(), x, lambda, out_index, out_value,
                                      capacity);
}

void clear_selected(std::span<float> residual, std::span<const uint32_t> index) {
  const size_t n = residual.size();
  for (const uint32_t i : index) {
    SC_CHECK(i < n, "clear_selected: index %u outside %zu elements", i, n);
    residual[i] = 0.0f;
  }
}

size_t ef_threshold(std::span<float> residual, std::span<const float> grad, float lambda,
                    uint32_t* out_index, float* out_value, size_t capacity) {
  return detail::ef_threshold_isa(detail::best_isa(), residual, grad, lambda, out_index, out_value,
                                  capacity);
}

}  // namespace sparsecar::kernels
