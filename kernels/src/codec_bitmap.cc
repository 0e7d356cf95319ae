// Bitmap payloads (format 3) and dense payloads (format 0). Layouts: WIRE.md (rows: codecs.cc).
#include <immintrin.h>

#include <algorithm>
#include <array>
#include <bit>

#include "codec_internal.h"
#include "detail/cpu.h"

namespace sparsecar::kernels::codec {
namespace {

size_t bitmap_bytes(size_t n) { return n / 8 + (n % 8 != 0); }

// Word w (64 bits, little-endian) of a bitmap of `bytes` bytes; the last word may be partial.
inline uint64_t bitmap_word(const std::byte* bm, size_t bytes, size_t w) {
  if (8 * w + 8 <= bytes) return load_u64(bm + 8 * w);
  uint64_t v = 0;
  std::memcpy(&v, bm + 8 * w, bytes - 8 * w);
  return v;
}

template <typename Reader>
void bitmap_scatter(const std::byte* bm, size_t bytes, Reader value, float* out) {
  const size_t words = bytes / 8 + (bytes % 8 != 0);
  size_t j = 0;
  for (size_t w = 0; w < words; ++w) {
    uint64_t bits = bitmap_word(bm, bytes, w);
    float* base = out + 64 * w;
    while (bits != 0) {
      base[std::countr_zero(bits)] += value(j++);
      bits &= bits - 1;
    }
  }
}

// Set bits in the first `words` full words. The portable build has no popcnt instruction (a
// dozen ALU ops per word); the AVX-512 variant uses it.
size_t count_bits_portable(const std::byte* bm, size_t words) {
  size_t count = 0;
  for (size_t w = 0; w < words; ++w) count += static_cast<size_t>(std::popcount(load_u64(bm + 8 * w)));
  return count;
}
SC_TARGET_AVX512 size_t count_bits_avx512(const std::byte* bm, size_t words) {
  size_t count = 0;
  for (size_t w = 0; w < words; ++w) count += static_cast<size_t>(__builtin_popcountll(load_u64(bm + 8 * w)));
  return count;
}

// Words with at most this many set bits are scattered bit by bit instead of by vector groups.
constexpr int kSparseWordBits = 4;

// fp32 with AVX-512: 512 bits of the bitmap are tested at once and only its non-zero words
// visited; each such word is handled as four 16-bit masks, the kept values expanded into their
// lanes and added with a masked load/add/store (masked-off lanes are never touched, and an empty
// mask is a no-op, so there is no data-dependent branch inside a word).
SC_TARGET_AVX512 inline size_t bitmap_word_f32_avx512(uint64_t bits, const float* v, size_t j, float* base) {
  // A sparse word (the common case below ~5 % density) costs less bit by bit: four masked
  // expand/load/store groups are ~20 cycles whatever the word holds.
  if (__builtin_popcountll(bits) <= kSparseWordBits) {
    while (bits != 0) {
      float add = 0.0f;  // values may sit at any byte offset of the payload
      std::memcpy(&add, reinterpret_cast<const char*>(v) + 4 * j++, sizeof add);
      base[__builtin_ctzll(bits)] += add;
      bits &= bits - 1;
    }
    return j;
  }
  for (int q = 0; q < 4; ++q) {
    const auto m = static_cast<__mmask16>((bits >> (16 * q)) & 0xFFFFu);
    const __m512 add = _mm512_maskz_expandloadu_ps(m, v + j);
    const __m512 cur = _mm512_maskz_loadu_ps(m, base + 16 * q);
    _mm512_mask_storeu_ps(base + 16 * q, m, _mm512_add_ps(cur, add));
    j += static_cast<size_t>(__builtin_popcount(m));
  }
  return j;
}

SC_TARGET_AVX512 void bitmap_scatter_f32_avx512(const std::byte* bm, size_t bytes, const std::byte* values,
                                                float* out) {
  const auto* v = reinterpret_cast<const float*>(values);  // unaligned loads only
  const size_t full_words = bytes / 8;
  size_t j = 0;
  size_t w = 0;
  for (; w + 8 <= full_words; w += 8) {
    const __m512i words = _mm512_loadu_si512(bm + 8 * w);
    unsigned nonzero = _mm512_test_epi64_mask(words, words);
    while (nonzero != 0) {
      const size_t at = w + static_cast<size_t>(__builtin_ctz(nonzero));
      nonzero &= nonzero - 1;
      j = bitmap_word_f32_avx512(load_u64(bm + 8 * at), v, j, out + 64 * at);
    }
  }
  for (; w < full_words; ++w) {
    const uint64_t bits = load_u64(bm + 8 * w);
    if (bits != 0) j = bitmap_word_f32_avx512(bits, v, j, out + 64 * w);
  }
  // The partial last word: the scalar loop.
  if (full_words * 8 < bytes) {
    uint64_t bits = bitmap_word(bm, bytes, full_words);
    float* base = out + 64 * full_words;
    while (bits != 0) {
      base[std::countr_zero(bits)] += load_f32(values + 4 * j++);
      bits &= bits - 1;
    }
  }
}

}  // namespace

size_t bitmap_write(ValueType vt, size_t n, std::span<const uint32_t> index, std::span<const float> value,
                    std::byte* out) {
  const size_t bytes = bitmap_bytes(n);
  if (bytes > 0) std::memset(out, 0, bytes);
  auto* bm = reinterpret_cast<unsigned char*>(out);
  for (uint32_t i : index) bm[i >> 3] = static_cast<unsigned char>(bm[i >> 3] | (1u << (i & 7u)));
  return bytes + write_values(vt, value, out + bytes);
}

Status bitmap_decode(ValueType vt, std::span<const std::byte> payload, uint64_t nnz, std::span<float> dense_out,
                     ThreadPool* pool) {
  const size_t dense_len = dense_out.size();
  if (nnz > dense_len) {
    return data_loss("bitmap payload: nnz " + num(nnz) + " exceeds the dense length " + num(dense_len));
  }
  const size_t n = static_cast<size_t>(nnz);
  const size_t bytes = bitmap_bytes(dense_len);
  const size_t need = add_sat(bytes, value_bytes(vt, n));
  if (payload.size() != need) {
    return size_mismatch("bitmap", payload.size(), need, "for dense length " + num(dense_len) + " and nnz " + num(n));
  }
  const std::byte* bm = payload.data();
  const size_t full = bytes / 8;
  const size_t words = full + (bytes % 8 != 0);
  const bool avx512 = detail::best_isa() == detail::Isa::kAvx512;
  // Chunks of whole words; the set bits before each chunk (its first value) come from the same
  // popcount pass that validates nnz.
  // A chunk must hold 1 Mi elements (128 KiB of bitmap): below that waking a worker costs more
  // than the popcount scan and the scatter of a sparse chunk.
  const unsigned chunks = chunk_count(pool, dense_len, 4 * kParallelMinElements);
  std::array<size_t, kMaxKernelThreads + 1> first_value{};
  size_t count = 0;
  for (unsigned c = 0; c < chunks; ++c) {
    first_value[c] = count;
    const size_t w0 = std::min(full, chunk_begin(words, chunks, c));
    const size_t w1 = std::min(full, chunk_begin(words, chunks, c + 1));
    count += avx512 ? count_bits_avx512(bm + 8 * w0, w1 - w0) : count_bits_portable(bm + 8 * w0, w1 - w0);
  }
  for (size_t b = 8 * full; b < bytes; ++b) count += static_cast<size_t>(std::popcount(std::to_integer<uint8_t>(bm[b])));
  if (dense_len % 8 != 0) {
    const auto last = std::to_integer<uint8_t>(bm[bytes - 1]);
    if ((last >> (dense_len % 8)) != 0) {
      return data_loss("bitmap payload: bits past the dense length " + num(dense_len) + " are set (index out of range)");
    }
  }
  if (count != n) {
    return data_loss("bitmap payload: " + num(count) + " bits set but nnz is " + num(n));
  }
  const std::byte* values = payload.data() + bytes;
  SC_RETURN_IF_ERROR(check_values(vt, values, n, "bitmap"));
  const auto chunk_bytes = [&](unsigned c, size_t* w0) {
    *w0 = chunk_begin(words, chunks, c);
    return std::min(bytes, 8 * chunk_begin(words, chunks, c + 1)) - 8 * *w0;
  };
  if (vt == ValueType::kF32 && avx512) {
    run_chunks(pool, chunks, [&](unsigned c) {
      size_t w0 = 0;
      const size_t len = chunk_bytes(c, &w0);
      bitmap_scatter_f32_avx512(bm + 8 * w0, len, values + 4 * first_value[c], dense_out.data() + 64 * w0);
    });
    return Status::Ok();
  }
  with_reader(vt, values, [&](auto reader) {
    run_chunks(pool, chunks, [&](unsigned c) {
      size_t w0 = 0;
      const size_t len = chunk_bytes(c, &w0);
      const size_t first = first_value[c];
      bitmap_scatter(bm + 8 * w0, len, [&reader, first](size_t j) { return reader(first + j); },
                     dense_out.data() + 64 * w0);
    });
  });
  return Status::Ok();
}

Status dense_decode(ValueType vt, std::span<const std::byte> payload, uint64_t nnz, std::span<float> dense_out,
                    ThreadPool* pool) {
  const size_t dense_len = dense_out.size();
  if (nnz != dense_len) {
    return data_loss("dense payload: nnz " + num(nnz) + " differs from the dense length " + num(dense_len));
  }
  const size_t need = value_bytes(vt, dense_len);
  if (payload.size() != need) {
    return size_mismatch("dense", payload.size(), need, "for " + num(dense_len) + " values");
  }
  SC_RETURN_IF_ERROR(check_values(vt, payload.data(), dense_len, "dense"));
  float* out = dense_out.data();
  const unsigned chunks = chunk_count(pool, dense_len);
  with_reader(vt, payload.data(), [&](auto reader) {
    run_chunks(pool, chunks, [&](unsigned c) {
      const size_t end = chunk_begin(dense_len, chunks, c + 1);
      for (size_t i = chunk_begin(dense_len, chunks, c); i < end; ++i) out[i] += reader(i);
    });
  });
  return Status::Ok();
}

}  // namespace sparsecar::kernels::codec
