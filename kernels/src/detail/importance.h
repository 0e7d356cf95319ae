// Importance sampling's arithmetic, written once for the CPU (select.cc's importance_scale and
// importance_select) and the CUDA kernels (cuda/detail/importance_kernels.cuh): the summation
// order, the per-element terms, the fixed-point step that solves for c, the keep threshold and
// the unbiased value. SC_HOST_DEVICE compiles them for both (detail/bits.h); the CPU loop and
// the GPU's grid both call these, so they give the same c, the same draws and the same values
// bit for bit.
//
// The summation order ("blocked tree"): the terms in chunks of kTreeWidth = 1024 by index, each
// chunk summed by a fixed pairwise tree (v[i] += v[i + s] for s = 512, 256, ..., 1; terms past n
// are 0), then the chunk sums combined by the same tree, 1024 at a time, until one is left. The
// result depends only on n and the data, not on threads or blocks: a GPU block sums a chunk in
// the same pairs, and zeros added for padding (or an extra level) change nothing since every
// term is >= +0. Error: at most 10 additions per level along any path, so for non-negative terms
// |error| <= 10 * levels * 2^-53 * sum (levels = 4 for 2^32 elements), against ~n * 2^-53 for
// a sequential sum.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>

#include "bits.h"  // relative: tests include this header without kernels/src on the path

namespace sparsecar::kernels::detail {

inline constexpr size_t kTreeWidth = 1024;     // terms per chunk, and chunk sums per tree above it
inline constexpr int kImportanceRounds = 8;    // fixed-point rounds at most
inline constexpr uint64_t kAlwaysKept = uint64_t{1} << 32;  // a keep threshold no draw reaches

// Float64 arithmetic, rounded to nearest and never contracted into an FMA on the device (the
// CPU build has no FMA: x86-64 baseline).
SC_HOST_DEVICE double add_f64(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dadd_rn(a, b);
#else
  return a + b;
#endif
}
SC_HOST_DEVICE double mul_f64(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __dmul_rn(a, b);
#else
  return a * b;
#endif
}
SC_HOST_DEVICE double div_f64(double a, double b) {
#if defined(__CUDA_ARCH__)
  return __ddiv_rn(a, b);
#else
  return a / b;
#endif
}

// v[0] = the tree sum of v[0 .. kTreeWidth) (v is overwritten): the reference form of the
// pairing a GPU block does in parallel.
SC_HOST_DEVICE double tree_sum_chunk(double* v) {
  for (size_t s = kTreeWidth / 2; s >= 1; s /= 2) {
    for (size_t i = 0; i < s; ++i) v[i] = add_f64(v[i], v[i + s]);
  }
  return v[0];
}

// The blocked tree sum of term(i) for i in [0, n) (host code). term is called once per i, in
// increasing i, so it may count as it goes. `span` elements feed one entry of this level.
template <class Term>
double blocked_tree_sum_level(size_t n, size_t first, size_t span, const Term& term) {
  double v[kTreeWidth];
  size_t j = 0;
  if (span == 1) {
    for (; j < kTreeWidth && first + j < n; ++j) v[j] = term(first + j);
  } else {
    for (; j < kTreeWidth && first + j * span < n; ++j) {
      v[j] = blocked_tree_sum_level(n, first + j * span, span / kTreeWidth, term);
    }
  }
  for (; j < kTreeWidth; ++j) v[j] = 0.0;  // past n
  return tree_sum_chunk(v);
}
template <class Term>
double blocked_tree_sum(size_t n, const Term& term) {
  size_t span = 1;  // elements under one entry of the top tree
  while (span * kTreeWidth < n) span *= kTreeWidth;
  return blocked_tree_sum_level(n, 0, span, term);
}

SC_HOST_DEVICE bool is_finite(float v) { return (float_bits(v) & 0x7f800000u) != 0x7f800000u; }
// |v| in float64 (exact), -0 as +0.
SC_HOST_DEVICE double magnitude_f64(float v) { return static_cast<double>(bits_float(float_bits(v) & 0x7fffffffu)); }

// The first pass's term: |v| of a finite non-zero element, else 0; counts the non-finite and
// the non-zero finite elements.
SC_HOST_DEVICE double importance_stats_term(float v, uint64_t& nonfinite, uint64_t& nonzero) {
  if (!is_finite(v)) {
    ++nonfinite;
    return 0.0;
  }
  const double a = magnitude_f64(v);
  if (a > 0.0) ++nonzero;
  return a;
}
// A round's term: |v| of a finite element below the cap (c |v| < 1), else 0; counts the capped
// finite elements (c |v| >= 1).
SC_HOST_DEVICE double importance_round_term(float v, double c, uint64_t& capped) {
  if (!is_finite(v)) return 0.0;
  const double a = magnitude_f64(v);
  if (mul_f64(c, a) >= 1.0) {
    ++capped;
    return 0.0;
  }
  return a;
}

// The solve for c: sum_i min(1, c |x_i|) = k over the finite elements, the non-finite ones
// always kept (p = 1), zeros never. A fixed point from below, c <- (k - capped) / (sum of the
// uncapped |x_i|), at most kImportanceRounds rounds; done when a round caps no new element, when
// the capped ones fill k, or when nothing is left uncapped.
struct ImportanceSolve {
  double c;
  uint64_t k;
  uint64_t nonfinite;
  uint64_t capped_before;  // elements at p = 1 after the previous round (non-finite included)
  bool done;
};
// After the first pass: +inf when the non-zero elements do not exceed k (all kept), 0 when the
// non-finite ones fill k, else k' / sum.
SC_HOST_DEVICE ImportanceSolve importance_start(uint64_t k, uint64_t nonfinite, uint64_t nonzero, double sum) {
  ImportanceSolve s{};
  s.k = k;
  s.nonfinite = nonfinite;
  s.capped_before = nonfinite;
  s.done = true;
  if (k >= nonfinite + nonzero) {
    s.c = std::numeric_limits<double>::infinity();
  } else if (k <= nonfinite) {
    s.c = 0.0;
  } else {
    s.c = div_f64(static_cast<double>(k - nonfinite), sum);
    s.done = false;
  }
  return s;
}
// One round's update from its pass (0-based `round`): `capped` counts every element at p = 1
// under the current c (non-finite included), `uncapped` is the blocked tree sum of the rest.
SC_HOST_DEVICE void importance_round(ImportanceSolve& s, int round, uint64_t capped, double uncapped) {
  if (capped == s.capped_before && round > 0) {
    s.done = true;
    return;
  }
  s.capped_before = capped;
  if (capped >= s.k || !(uncapped > 0.0)) {
    s.done = true;
    return;
  }
  const double next = div_f64(static_cast<double>(s.k - capped), uncapped);
  if (s.c < next) s.c = next;  // c only grows: std::max(c, next)
}

// The random selectors' keep rule (select.h's random_keep_threshold): a draw d keeps when
// d < keep_threshold(p) = ceil(p 2^32); 0 for p <= 0 or NaN, 2^32 for p >= 1.
SC_HOST_DEVICE uint64_t keep_threshold(double p) {
  if (!(p > 0.0)) return 0;
  if (p >= 1.0) return kAlwaysKept;
#if defined(__CUDA_ARCH__)
  return static_cast<uint64_t>(::ceil(mul_f64(p, 4294967296.0)));
#else
  return static_cast<uint64_t>(std::ceil(p * 4294967296.0));
#endif
}
// Element v's keep threshold under c: non-finite always, zeros never, else p = min(1, c |v|).
SC_HOST_DEVICE uint64_t importance_keep_threshold(float v, double c) {
  if (!is_finite(v)) return kAlwaysKept;
  const double a = magnitude_f64(v);
  if (a == 0.0) return 0;
  return keep_threshold(c > std::numeric_limits<double>::max() ? 1.0 : mul_f64(c, a));
}
// The unbiased value of a kept v: v / p with the probability actually used (2^32 / t), in
// float64: float(v 2^32 / t). A NaN keeps its payload (quieted), as through the CPU's conversions.
SC_HOST_DEVICE float importance_unbiased(float v, uint64_t t) {
#if defined(__CUDA_ARCH__)
  if (is_nan(v)) return quieted(v);
#endif
  return static_cast<float>(div_f64(mul_f64(static_cast<double>(v), 4294967296.0), static_cast<double>(t)));
}

}  // namespace sparsecar::kernels::detail
