// AVX-512 variants of the selection kernels. Each function carries SC_TARGET_AVX512 so this file
// builds with the project's baseline flags; select.cc calls them only after best_isa() says the
// CPU has AVX-512F/VL/BW/DQ and BMI2. Results equal the portable variants exactly.
//
// The streaming kernels process 16 floats per iteration: compute the magnitude key, compare, and
// compress-store the selected (index, value) lanes. Selections are sparse, so the compress path
// sits behind a branch that is almost never taken at 0.1-10 % density.
// GCC 12 warns inside its own avx512fintrin.h (_mm512_undefined_epi32 self-initialises on
// purpose) once those intrinsics are inlined at -O2+; the warning is about the header, not us.
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include "detail/cpu.h"
#include "detail/topk.h"

namespace sparsecar::kernels::detail {
namespace {

constexpr uint32_t kAbsMask = 0x7fffffffu;
// Software prefetch distance of the streaming top-k passes (a prefetch past the end is harmless).
constexpr int kPrefetchBytes = 4096;

SC_TARGET_AVX512 inline __mmask16 tail_mask(size_t remaining) {
  return remaining >= 16 ? __mmask16{0xffff} : static_cast<__mmask16>((1u << remaining) - 1u);
}

SC_TARGET_AVX512 inline __m512i keys_of(__m512 v) {
  const __m512i bits = _mm512_and_si512(_mm512_castps_si512(v), _mm512_set1_epi32(kAbsMask));
  return _mm512_min_epu32(bits, _mm512_set1_epi32(static_cast<int>(kNanKey)));
}

// Writes the lanes of `m` (or only its lowest ones when capacity runs out) and returns the mask
// of lanes actually written. *count advances by popcount(m) either way. `seen` is the number of
// elements scanned so far: once the selection is denser than 1/kDenseSelection and 16 entries of
// room are left it is branch-free: the lanes are compressed in a register and all 16 stored
// (lanes past popcount(m) are overwritten by later stores or lie beyond the count), because at
// ~1-10 % density a "rare" store branch mispredicts often and compress-to-memory is microcoded.
// Sparser selections keep the branch (almost never taken; measured faster at 0.1 %).
constexpr size_t kDenseSelection = 256;
SC_TARGET_AVX512 inline __mmask16 emit(__mmask16 m, __m512i index, __m512 value, size_t* count,
                                       uint32_t* out_index, float* out_value, size_t capacity,
                                       size_t seen) {
  const size_t c = *count;
  if (c * kDenseSelection < seen || c + 16 > capacity) {
    if (m == 0) return 0;
  } else {
    _mm512_storeu_si512(out_index + c, _mm512_maskz_compress_epi32(m, index));
    _mm512_storeu_ps(out_value + c, _mm512_maskz_compress_ps(m, value));
    *count = c + static_cast<size_t>(_mm_popcnt_u32(m));
    return m;
  }
  const size_t matches = static_cast<size_t>(_mm_popcnt_u32(m));
  __mmask16 written = m;
  if (c + matches > capacity) {
    const size_t room = capacity > c ? capacity - c : 0;
    // The lowest `room` set bits of m (room < matches <= 16).
    written = static_cast<__mmask16>(_pdep_u32((1u << room) - 1u, m));
  }
  if (written) {
    _mm512_mask_compressstoreu_epi32(out_index + c, written, index);
    _mm512_mask_compressstoreu_ps(out_value + c, written, value);
  }
  *count = c + matches;
  return written;
}

}  // namespace

SC_TARGET_AVX512 void add_avx512(float* dst, const float* src, size_t n) {
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(dst + i, _mm512_add_ps(_mm512_loadu_ps(dst + i), _mm512_loadu_ps(src + i)));
  }
  if (i < n) {
    const __mmask16 live = tail_mask(n - i);
    _mm512_mask_storeu_ps(dst + i, live,
                          _mm512_add_ps(_mm512_maskz_loadu_ps(live, dst + i),
                                        _mm512_maskz_loadu_ps(live, src + i)));
  }
}

SC_TARGET_AVX512 void scale_avx512(float* x, size_t n, float factor) {
  const __m512 f = _mm512_set1_ps(factor);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_loadu_ps(x + i), f));
  if (i < n) {
    const __mmask16 live = tail_mask(n - i);
    _mm512_mask_storeu_ps(x + i, live, _mm512_mul_ps(_mm512_maskz_loadu_ps(live, x + i), f));
  }
}

SC_TARGET_AVX512 size_t threshold_select_avx512(const float* x, size_t n, uint32_t lambda_key,
                                                uint32_t* out_index, float* out_value,
                                                size_t capacity) {
  const __m512i lambda = _mm512_set1_epi32(static_cast<int>(lambda_key));
  const __m512i step = _mm512_set1_epi32(16);
  __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  size_t count = 0;
  for (size_t i = 0; i < n; i += 16) {
    const __mmask16 live = tail_mask(n - i);
    const __m512 v = _mm512_maskz_loadu_ps(live, x + i);
    const __mmask16 m = _mm512_mask_cmpge_epu32_mask(live, keys_of(v), lambda);
    emit(m, index, v, &count, out_index, out_value, capacity, i);
    index = _mm512_add_epi32(index, step);
  }
  return count;
}

SC_TARGET_AVX512 size_t ef_threshold_avx512(float* residual, const float* grad, size_t n,
                                            uint32_t lambda_key, uint32_t* out_index,
                                            float* out_value, size_t capacity) {
  const __m512i lambda = _mm512_set1_epi32(static_cast<int>(lambda_key));
  const __m512i step = _mm512_set1_epi32(16);
  __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  size_t count = 0;
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_add_ps(_mm512_loadu_ps(residual + i), _mm512_loadu_ps(grad + i));
    const __mmask16 m = _mm512_cmpge_epu32_mask(keys_of(v), lambda);
    const __mmask16 written = emit(m, index, v, &count, out_index, out_value, capacity, i);
    _mm512_storeu_ps(residual + i, _mm512_maskz_mov_ps(static_cast<__mmask16>(~written), v));
    index = _mm512_add_epi32(index, step);
  }
  if (i < n) {
    const __mmask16 live = tail_mask(n - i);
    const __m512 v = _mm512_add_ps(_mm512_maskz_loadu_ps(live, residual + i),
                                   _mm512_maskz_loadu_ps(live, grad + i));
    const __mmask16 m = _mm512_mask_cmpge_epu32_mask(live, keys_of(v), lambda);
    __mmask16 written = 0;
    if (m) written = emit(m, index, v, &count, out_index, out_value, capacity, i);
    _mm512_mask_storeu_ps(residual + i, live,
                          _mm512_maskz_mov_ps(static_cast<__mmask16>(~written), v));
  }
  return count;
}

SC_TARGET_AVX512 void topk_histogram_avx512(const float* x, size_t n, uint32_t* hist) {
  uint32_t* h0 = hist;
  uint32_t* h1 = hist + kTopkHiBins;
  uint32_t* h2 = hist + 2 * kTopkHiBins;
  uint32_t* h3 = hist + 3 * kTopkHiBins;
  alignas(64) uint32_t digit[16];
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i d = _mm512_srli_epi32(keys_of(_mm512_loadu_ps(x + i)), kTopkHiShift);
    _mm512_store_si512(digit, d);
    for (int j = 0; j < 16; j += 4) {
      ++h0[digit[j]];
      ++h1[digit[j + 1]];
      ++h2[digit[j + 2]];
      ++h3[digit[j + 3]];
    }
  }
  for (; i < n; ++i) ++h0[magnitude_key(x[i]) >> kTopkHiShift];
}

SC_TARGET_AVX512 size_t topk_partition_avx512(const float* x, size_t n, uint32_t bin,
                                              uint32_t* out_index, float* out_value,
                                              uint32_t* candidates, size_t* n_candidates) {
  const __m512i b = _mm512_set1_epi32(static_cast<int>(bin));
  const __m512i step = _mm512_set1_epi32(16);
  __m512i index = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  size_t above = 0;
  size_t equal = 0;
  for (size_t i = 0; i < n; i += 16) {
    const __mmask16 live = tail_mask(n - i);
    const __m512 v = _mm512_maskz_loadu_ps(live, x + i);
    const __m512i d = _mm512_srli_epi32(keys_of(v), kTopkHiShift);
    const __mmask16 gt = _mm512_mask_cmpgt_epu32_mask(live, d, b);
    const __mmask16 eq = _mm512_mask_cmpeq_epu32_mask(live, d, b);
    if (gt) {
      _mm512_mask_compressstoreu_epi32(out_index + above, gt, index);
      _mm512_mask_compressstoreu_ps(out_value + above, gt, v);
      above += static_cast<size_t>(_mm_popcnt_u32(gt));
    }
    if (eq) {
      _mm512_mask_compressstoreu_epi32(candidates + equal, eq, index);
      equal += static_cast<size_t>(_mm_popcnt_u32(eq));
    }
    index = _mm512_add_epi32(index, step);
  }
  *n_candidates = equal;
  return above;
}

// Branch-free: at 0.1-10 % density a "rare" store branch is taken often enough to mispredict
// on every other vector, so every vector compresses its selected lanes in a register and stores
// all 16 lanes at the current count (the caller's buffers have kBandSlack entries of slack; only
// popcount lanes are meaningful). Register compress + plain store is also much cheaper than
// the microcoded compress-to-memory.
SC_TARGET_AVX512 size_t topk_candidates_avx512(const float* x, size_t n, uint32_t base,
                                               uint32_t lo, uint32_t hi, uint32_t* cand_index,
                                               float* cand_value, size_t cap, uint32_t* band_keys,
                                               size_t band_cap, size_t* n_band,
                                               size_t* n_above) {
  const __m512i lo_v = _mm512_set1_epi32(static_cast<int>(lo));
  const __m512i hi_v = _mm512_set1_epi32(static_cast<int>(hi));
  const __m512i step = _mm512_set1_epi32(16);
  __m512i index = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(base)),
                                   _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
  size_t count = 0;
  size_t band = 0;
  size_t above = 0;
  for (size_t i = 0; i < n; i += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(x + i) + kPrefetchBytes, _MM_HINT_T0);
    const __mmask16 live = tail_mask(n - i);
    const __m512 v = _mm512_maskz_loadu_ps(live, x + i);
    const __m512i k = keys_of(v);
    const __mmask16 in = _mm512_mask_cmpge_epu32_mask(live, k, lo_v);
    const __mmask16 gt = _mm512_mask_cmpgt_epu32_mask(live, k, hi_v);
    const auto mid = static_cast<__mmask16>(in & ~gt);
    _mm512_storeu_si512(cand_index + count, _mm512_maskz_compress_epi32(in, index));
    _mm512_storeu_ps(cand_value + count, _mm512_maskz_compress_ps(in, v));
    _mm512_storeu_si512(band_keys + band, _mm512_maskz_compress_epi32(mid, k));
    count += static_cast<size_t>(_mm_popcnt_u32(in));
    band += static_cast<size_t>(_mm_popcnt_u32(mid));
    above += static_cast<size_t>(_mm_popcnt_u32(gt));
    if (count > cap || band > band_cap) return kBandOverflow;
    index = _mm512_add_epi32(index, step);
  }
  *n_band = band;
  *n_above = above;
  return count;
}

SC_TARGET_AVX512 size_t topk_compact_avx512(const uint32_t* cand_index, const float* cand_value,
                                            size_t count, uint32_t kth, size_t ties,
                                            uint32_t* out_index, float* out_value, size_t k) {
  const __m512i t = _mm512_set1_epi32(static_cast<int>(kth));
  size_t written = 0;
  for (size_t j = 0; j < count; j += 16) {
    _mm_prefetch(reinterpret_cast<const char*>(cand_value + j) + kPrefetchBytes, _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(cand_index + j) + kPrefetchBytes, _MM_HINT_T0);
    const __mmask16 live = tail_mask(count - j);
    const __m512 v = _mm512_maskz_loadu_ps(live, cand_value + j);
    const __m512i idx = _mm512_maskz_loadu_epi32(live, cand_index + j);
    const __m512i key = keys_of(v);
    __mmask16 sel = _mm512_mask_cmpgt_epu32_mask(live, key, t);
    const __mmask16 eq = _mm512_mask_cmpeq_epu32_mask(live, key, t);
    if (eq) {  // the k-th key itself: only its first `ties` occurrences, in index order
      const size_t m = static_cast<size_t>(_mm_popcnt_u32(eq));
      const size_t take = m < ties ? m : ties;
      sel = static_cast<__mmask16>(sel | _pdep_u32((1u << take) - 1u, eq));
      ties -= take;
    }
    const size_t c = static_cast<size_t>(_mm_popcnt_u32(sel));
    if (written + 16 <= k) {
      _mm512_storeu_si512(out_index + written, _mm512_maskz_compress_epi32(sel, idx));
      _mm512_storeu_ps(out_value + written, _mm512_maskz_compress_ps(sel, v));
    } else if (sel) {
      if (written + c > k) return kBandOverflow;
      _mm512_mask_compressstoreu_epi32(out_index + written, sel, idx);
      _mm512_mask_compressstoreu_ps(out_value + written, sel, v);
    }
    written += c;
  }
  return written;
}

}  // namespace sparsecar::kernels::detail
