// Portable variants of the selection kernels: plain loops the compiler vectorises for the
// baseline ISA. Also the reference behaviour the AVX-512 variants must match bit for bit.
#include "detail/cpu.h"
#include "detail/topk.h"

namespace sparsecar::kernels::detail {

void add_portable(float* dst, const float* src, size_t n) {
  for (size_t i = 0; i < n; ++i) dst[i] += src[i];
}

void scale_portable(float* x, size_t n, float factor) {
  for (size_t i = 0; i < n; ++i) x[i] *= factor;
}

size_t threshold_select_portable(const float* x, size_t n, uint32_t lambda_key, uint32_t* out_index,
                                 float* out_value, size_t capacity) {
  size_t count = 0;
  for (size_t i = 0; i < n; ++i) {
    if (magnitude_key(x[i]) >= lambda_key) {
      if (count < capacity) {
        out_index[count] = static_cast<uint32_t>(i);
        out_value[count] = x[i];
      }
      ++count;
    }
  }
  return count;
}

size_t ef_threshold_portable(float* residual, const float* grad, size_t n, uint32_t lambda_key,
                             uint32_t* out_index, float* out_value, size_t capacity) {
  size_t count = 0;
  for (size_t i = 0; i < n; ++i) {
    float v = residual[i] + grad[i];
    if (magnitude_key(v) >= lambda_key) {
      if (count < capacity) {
        out_index[count] = static_cast<uint32_t>(i);
        out_value[count] = v;
        v = 0.0f;  // sent: residual -= selected
      }
      ++count;
    }
    residual[i] = v;
  }
  return count;
}

void topk_histogram_portable(const float* x, size_t n, uint32_t* hist) {
  uint32_t* h0 = hist;
  uint32_t* h1 = hist + kTopkHiBins;
  uint32_t* h2 = hist + 2 * kTopkHiBins;
  uint32_t* h3 = hist + 3 * kTopkHiBins;
  size_t i = 0;
  for (; i + 4 <= n; i += 4) {
    ++h0[magnitude_key(x[i]) >> kTopkHiShift];
    ++h1[magnitude_key(x[i + 1]) >> kTopkHiShift];
    ++h2[magnitude_key(x[i + 2]) >> kTopkHiShift];
    ++h3[magnitude_key(x[i + 3]) >> kTopkHiShift];
  }
  for (; i < n; ++i) ++h0[magnitude_key(x[i]) >> kTopkHiShift];
}

size_t topk_partition_portable(const float* x, size_t n, uint32_t bin, uint32_t* out_index,
                               float* out_value, uint32_t* candidates, size_t* n_candidates) {
  size_t above = 0;
  size_t equal = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t digit = magnitude_key(x[i]) >> kTopkHiShift;
    if (digit > bin) {
      out_index[above] = static_cast<uint32_t>(i);
      out_value[above] = x[i];
      ++above;
    } else if (digit == bin) {
      candidates[equal++] = static_cast<uint32_t>(i);
    }
  }
  *n_candidates = equal;
  return above;
}

size_t topk_candidates_portable(const float* x, size_t n, uint32_t base, uint32_t lo, uint32_t hi,
                                uint32_t* cand_index, float* cand_value, size_t cap,
                                uint32_t* band_keys, size_t band_cap, size_t* n_band,
                                size_t* n_above) {
  size_t count = 0;
  size_t band = 0;
  size_t above = 0;
  for (size_t i = 0; i < n; ++i) {
    const uint32_t key = magnitude_key(x[i]);
    if (key < lo) continue;
    if (count == cap) return kBandOverflow;
    cand_index[count] = base + static_cast<uint32_t>(i);
    cand_value[count] = x[i];
    ++count;
    if (key > hi) {
      ++above;
    } else {
      if (band == band_cap) return kBandOverflow;
      band_keys[band++] = key;
    }
  }
  *n_band = band;
  *n_above = above;
  return count;
}

size_t topk_compact_portable(const uint32_t* cand_index, const float* cand_value, size_t count,
                             uint32_t kth, size_t ties, uint32_t* out_index, float* out_value,
                             size_t k) {
  size_t written = 0;
  for (size_t j = 0; j < count; ++j) {
    const uint32_t key = magnitude_key(cand_value[j]);
    if (key > kth || (key == kth && ties > 0)) {
      if (key == kth) --ties;
      if (written == k) return kBandOverflow;
      out_index[written] = cand_index[j];
      out_value[written] = cand_value[j];
      ++written;
    }
  }
  return written;
}

}  // namespace sparsecar::kernels::detail
