// COO payloads: uint32 indices (format 1) and gap varints (format 2). Layouts: WIRE.md (rows: codecs.cc).
#include "codec_internal.h"

namespace sparsecar::kernels::codec {
namespace {

// Index of the first entry that breaks "strictly increasing and < dense_len", or nnz if none.
// The common (valid) case is one branch-free pass that the compiler vectorises.
size_t first_bad_index(const std::byte* idx, size_t nnz, size_t dense_len) {
  if (nnz == 0) return 0;
  bool bad = false;
  for (size_t i = 1; i < nnz; ++i) bad |= load_u32(idx + 4 * i) <= load_u32(idx + 4 * (i - 1));
  // Strictly increasing, so the last index is the largest.
  if (!bad && load_u32(idx + 4 * (nnz - 1)) < dense_len) return nnz;
  if (load_u32(idx) >= dense_len) return 0;
  for (size_t i = 1; i < nnz; ++i) {
    const uint32_t cur = load_u32(idx + 4 * i);
    if (cur <= load_u32(idx + 4 * (i - 1)) || cur >= dense_len) return i;
  }
  return nnz;
}

// How far ahead the scatter prefetches the target cache line: the scatter into a large tensor is
// bound by cache and TLB misses, and keeping this many in flight hides most of their latency.
#ifndef SPARSECAR_COO_PREFETCH
#define SPARSECAR_COO_PREFETCH 32
#endif
constexpr size_t kPrefetchAhead = SPARSECAR_COO_PREFETCH;
// Entries per thread before a pool is used: each is a cache miss into a large sum (~5-100 ns),
// so far fewer than the streaming kernels' elements pay for waking a worker.
constexpr size_t kDecodeMinEntries = 16384;

// Dense selections (more than 1 in kPrefetchMaxDensity elements) touch nearly every line in
// order: the hardware prefetcher follows them and a software prefetch per entry only costs
// (measured: 10 % at 64M 2.2 -> 2.8 GB/s without it, 1 % 4.3 -> 2.7 GB/s).
constexpr size_t kPrefetchMaxDensity = 32;

template <typename Reader>
void coo_scatter(const std::byte* idx, size_t n, Reader value, float* out, bool prefetch) {
  size_t i = 0;
  if (prefetch && n > kPrefetchAhead) {
    for (; i < n - kPrefetchAhead; ++i) {
      __builtin_prefetch(out + load_u32(idx + 4 * (i + kPrefetchAhead)), 1, 0);
      out[load_u32(idx + 4 * i)] += value(i);
    }
  }
  for (; i < n; ++i) out[load_u32(idx + 4 * i)] += value(i);
}

}  // namespace

size_t coo_write(ValueType vt, std::span<const uint32_t> index, std::span<const float> value, std::byte* out) {
  const size_t k = index.size();
  if (k > 0) std::memcpy(out, index.data(), 4 * k);
  return 4 * k + write_values(vt, value, out + 4 * k);
}

Status coo_decode(ValueType vt, std::span<const std::byte> payload, uint64_t nnz, std::span<float> dense_out,
                  ThreadPool* pool) {
  const size_t dense_len = dense_out.size();
  if (nnz > dense_len) {
    return data_loss("coo payload: nnz " + num(nnz) + " exceeds the dense length " + num(dense_len));
  }
  const size_t n = static_cast<size_t>(nnz);
  const size_t need = add_sat(4 * n, value_bytes(vt, n));
  if (payload.size() != need) {
    return size_mismatch("coo", payload.size(), need, "for nnz " + num(n));
  }
  const std::byte* idx = payload.data();
  const std::byte* values = payload.data() + 4 * n;
  const size_t bad = first_bad_index(idx, n, dense_len);
  if (bad < n) {
    const uint32_t at = load_u32(idx + 4 * bad);
    if (at >= dense_len) {
      return data_loss("coo payload: index[" + num(bad) + "]=" + num(at) + " is outside the dense length " +
                       num(dense_len));
    }
    return data_loss("coo payload: index[" + num(bad) + "]=" + num(at) + " is not greater than index[" +
                     num(bad - 1) + "]=" + num(load_u32(idx + 4 * (bad - 1))));
  }
  SC_RETURN_IF_ERROR(check_values(vt, values, n, "coo"));
  // Indices are strictly increasing, so chunks of entries scatter into disjoint elements.
  const unsigned chunks = chunk_count(pool, n, kDecodeMinEntries);
  const bool prefetch = n * kPrefetchMaxDensity < dense_len;
  with_reader(vt, values, [&](auto reader) {
    run_chunks(pool, chunks, [&](unsigned c) {
      const size_t begin = chunk_begin(n, chunks, c);
      const size_t end = chunk_begin(n, chunks, c + 1);
      coo_scatter(idx + 4 * begin, end - begin, [&reader, begin](size_t j) { return reader(begin + j); },
                  dense_out.data(), prefetch);
    });
  });
  return Status::Ok();
}

size_t varint_index_bytes(std::span<const uint32_t> index) {
  size_t bytes = 0;
  uint32_t next = 0;  // the smallest index the next entry may have
  for (uint32_t i : index) {
    bytes += varint_len(i - next);
    next = i + 1;
  }
  return bytes;
}

size_t coo_varint_write(ValueType vt, std::span<const uint32_t> index, std::span<const float> value,
                        std::byte* out) {
  std::byte* p = out + write_values(vt, value, out);
  uint32_t next = 0;
  for (uint32_t i : index) {
    p = varint_put(p, i - next);
    next = i + 1;
  }
  return static_cast<size_t>(p - out);
}

Status coo_varint_decode(ValueType vt, std::span<const std::byte> payload, uint64_t nnz,
                         std::span<float> dense_out) {
  const size_t dense_len = dense_out.size();
  if (nnz > dense_len) {
    return data_loss("coo_varint payload: nnz " + num(nnz) + " exceeds the dense length " + num(dense_len));
  }
  const size_t n = static_cast<size_t>(nnz);
  const size_t vbytes = value_bytes(vt, n);
  if (payload.size() < add_sat(vbytes, n) || payload.size() > add_sat(vbytes, mul_sat(5, n))) {
    return size_mismatch("coo_varint", payload.size(), add_sat(vbytes, n),
                         "at least (at most " + num(add_sat(vbytes, mul_sat(5, n))) + ") for nnz " + num(n));
  }
  const std::byte* values = payload.data();
  const std::byte* begin = payload.data() + vbytes;
  const std::byte* end = payload.data() + payload.size();
  // Pass 1: validate every varint and index without writing.
  const std::byte* p = begin;
  uint64_t next = 0;
  for (size_t j = 0; j < n; ++j) {
    uint32_t gap = 0;
    const size_t used = varint_get(p, end, &gap);
    if (used == 0) {
      return data_loss("coo_varint payload: varint of index[" + num(j) + "] at byte " + num(vbytes + (p - begin)) +
                       " is truncated, overlong or over 32 bits");
    }
    p += used;
    const uint64_t at = next + gap;
    if (at >= dense_len) {
      return data_loss("coo_varint payload: index[" + num(j) + "]=" + num(at) + " is outside the dense length " +
                       num(dense_len));
    }
    next = at + 1;
  }
  if (p != end) {
    return data_loss("coo_varint payload: " + num(static_cast<size_t>(end - p)) + " bytes after the " + num(n) +
                     " indices nnz says (payload_bytes " + num(payload.size()) + ")");
  }
  SC_RETURN_IF_ERROR(check_values(vt, values, n, "coo_varint"));
  // Pass 2: accumulate.
  with_reader(vt, values, [&](auto reader) {
    const std::byte* q = begin;
    size_t at = 0;
    float* out = dense_out.data();
    for (size_t j = 0; j < n; ++j) {
      uint32_t gap = 0;
      q += varint_get(q, end, &gap);
      at += gap;
      out[at] += reader(j);
      ++at;
    }
  });
  return Status::Ok();
}

Status size_mismatch(const char* format, size_t got, size_t want, const std::string& why) {
  return data_loss(std::string(format) + " payload: payload_bytes " + num(got) + ", expected " + num(want) + " " + why);
}

}  // namespace sparsecar::kernels::codec
