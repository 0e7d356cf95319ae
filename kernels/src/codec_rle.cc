// Run-length payloads (format 5): the values, then one (gap, length) varint pair per maximal run
// of kept elements. Wins on structured (block, row, channel) selections. Layout: WIRE.md (row: codecs.cc).
#include "codec_internal.h"

namespace sparsecar::kernels::codec {
namespace {

// Calls fn(gap, length) for every maximal run of consecutive indices.
template <typename Fn>
void for_each_run(std::span<const uint32_t> index, Fn&& fn) {
  const size_t k = index.size();
  uint32_t next = 0;  // first element after the previous run
  size_t j = 0;
  while (j < k) {
    const uint32_t start = index[j];
    size_t e = j + 1;
    while (e < k && index[e] == index[e - 1] + 1) ++e;
    const auto length = static_cast<uint32_t>(e - j);
    fn(start - next, length);
    next = start + length;
    j = e;
  }
}

}  // namespace

size_t rle_index_bytes(std::span<const uint32_t> index) {
  size_t bytes = 0;
  for_each_run(index, [&](uint32_t gap, uint32_t length) { bytes += varint_len(gap) + varint_len(length); });
  return bytes;
}

size_t rle_write(ValueType vt, std::span<const uint32_t> index, std::span<const float> value, std::byte* out) {
  std::byte* p = out + write_values(vt, value, out);
  for_each_run(index, [&](uint32_t gap, uint32_t length) {
    p = varint_put(p, gap);
    p = varint_put(p, length);
  });
  return static_cast<size_t>(p - out);
}

Status rle_decode(ValueType vt, std::span<const std::byte> payload, uint64_t nnz, std::span<float> dense_out) {
  const size_t dense_len = dense_out.size();
  if (nnz > dense_len) {
    return data_loss("rle payload: nnz " + num(nnz) + " exceeds the dense length " + num(dense_len));
  }
  const size_t n = static_cast<size_t>(nnz);
  const size_t vbytes = value_bytes(vt, n);
  const size_t min_bytes = add_sat(vbytes, n == 0 ? 0 : 2);
  const size_t max_bytes = add_sat(vbytes, mul_sat(10, n));
  if (payload.size() < min_bytes || payload.size() > max_bytes) {
    return size_mismatch("rle", payload.size(), min_bytes, "at least (at most " + num(max_bytes) + ") for nnz " + num(n));
  }
  const std::byte* values = payload.data();
  const std::byte* begin = payload.data() + vbytes;
  const std::byte* end = payload.data() + payload.size();
  // Pass 1: validate every run.
  const std::byte* p = begin;
  uint64_t next = 0;
  uint64_t kept = 0;
  for (size_t r = 0; p < end; ++r) {
    uint32_t gap = 0;
    uint32_t length = 0;
    size_t used = varint_get(p, end, &gap);
    if (used == 0) {
      return data_loss("rle payload: gap varint of run " + num(r) + " at byte " + num(vbytes + (p - begin)) +
                       " is truncated, overlong or over 32 bits");
    }
    p += used;
    used = varint_get(p, end, &length);
    if (used == 0) {
      return data_loss("rle payload: length varint of run " + num(r) + " at byte " + num(vbytes + (p - begin)) +
                       " is truncated, overlong or over 32 bits");
    }
    p += used;
    if (length == 0) return data_loss("rle payload: run " + num(r) + " has length 0");
    if (r > 0 && gap == 0) {
      return data_loss("rle payload: run " + num(r) + " has gap 0 (runs must be maximal)");
    }
    const uint64_t start = next + gap;
    if (start + length > dense_len) {
      return data_loss("rle payload: run " + num(r) + " [" + num(start) + ", " + num(start + length) +
                       ") ends past the dense length " + num(dense_len));
    }
    next = start + length;
    kept += length;
    if (kept > n) {
      return data_loss("rle payload: runs hold more than nnz " + num(n) + " elements");
    }
  }
  if (kept != n) {
    return data_loss("rle payload: runs hold " + num(kept) + " elements but nnz is " + num(n));
  }
  SC_RETURN_IF_ERROR(check_values(vt, values, n, "rle"));
  // Pass 2: accumulate run by run.
  with_reader(vt, values, [&](auto reader) {
    const std::byte* q = begin;
    size_t at = 0;
    size_t j = 0;
    float* out = dense_out.data();
    while (q < end) {
      uint32_t gap = 0;
      uint32_t length = 0;
      q += varint_get(q, end, &gap);
      q += varint_get(q, end, &length);
      at += gap;
      for (uint32_t i = 0; i < length; ++i) out[at + i] += reader(j + i);
      at += length;
      j += length;
    }
  });
  return Status::Ok();
}

}  // namespace sparsecar::kernels::codec
