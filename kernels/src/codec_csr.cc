// CSR payloads (format 4) for 2-D tensors: row ends + narrow column indices. Layout: WIRE.md
// (row: codecs.cc). Beats COO when rows are short (uint16 columns) and most rows are kept.
#include "codec_internal.h"

namespace sparsecar::kernels::codec {
namespace {

template <typename Reader>
void csr_scatter(const std::byte* row_end, const std::byte* col, size_t width, uint64_t rows, uint64_t cols,
                 Reader value, float* out) {
  size_t j = 0;
  for (uint64_t r = 0; r < rows; ++r) {
    const size_t end = load_u32(row_end + 4 * r);
    float* row = out + r * cols;
    if (width == 2) {
      for (; j < end; ++j) row[load_u16(col + 2 * j)] += value(j);
    } else {
      for (; j < end; ++j) row[load_u32(col + 4 * j)] += value(j);
    }
  }
}

inline uint32_t col_at(const std::byte* col, size_t width, size_t j) {
  return width == 2 ? load_u16(col + 2 * j) : load_u32(col + 4 * j);
}

}  // namespace

size_t csr_write(ValueType vt, size_t n, uint32_t rows, std::span<const uint32_t> index, std::span<const float> value,
                 std::byte* out) {
  const size_t cols = n / rows;
  const size_t width = csr_col_width(cols);
  const size_t k = index.size();
  store_u32(out, rows);
  store_u32(out + 4, static_cast<uint32_t>(cols));
  std::byte* row_end = out + 8;
  std::byte* col = row_end + 4 * size_t{rows};
  size_t j = 0;
  for (size_t r = 0; r < rows; ++r) {
    const size_t row_base = r * cols;
    const size_t row_limit = row_base + cols;
    for (; j < k && index[j] < row_limit; ++j) {
      const auto c = static_cast<uint32_t>(index[j] - row_base);
      if (width == 2) {
        store_u16(col + 2 * j, static_cast<uint16_t>(c));
      } else {
        store_u32(col + 4 * j, c);
      }
    }
    store_u32(row_end + 4 * r, static_cast<uint32_t>(j));
  }
  std::byte* values = col + width * k;
  return static_cast<size_t>(values - out) + write_values(vt, value, values);
}

Status csr_decode(ValueType vt, std::span<const std::byte> payload, uint64_t nnz, std::span<float> dense_out) {
  const size_t dense_len = dense_out.size();
  if (nnz > dense_len) {
    return data_loss("csr payload: nnz " + num(nnz) + " exceeds the dense length " + num(dense_len));
  }
  const size_t n = static_cast<size_t>(nnz);
  if (payload.size() < 8) return size_mismatch("csr", payload.size(), 8, "at least for rows and cols");
  const uint64_t rows = load_u32(payload.data());
  const uint64_t cols = load_u32(payload.data() + 4);
  if (rows == 0 || rows * cols != dense_len) {
    return data_loss("csr payload: rows " + num(rows) + " x cols " + num(cols) + " is not the dense length " +
                     num(dense_len));
  }
  // An empty tensor has one row, as the encoder writes it: any other count would let a sender
  // make the receiver walk up to 2^32 row ends of nothing (and payload_size_range rejects it).
  if (dense_len == 0 && rows != 1) {
    return data_loss("csr payload: rows " + num(rows) + " for an empty tensor (one row expected)");
  }
  const size_t width = csr_col_width(cols);
  const size_t need = add_sat(add_sat(8 + 4 * rows, mul_sat(width, n)), value_bytes(vt, n));
  if (payload.size() != need) {
    return size_mismatch("csr", payload.size(), need, "for " + num(rows) + " rows and nnz " + num(n));
  }
  const std::byte* row_end = payload.data() + 8;
  const std::byte* col = row_end + 4 * rows;
  const std::byte* values = col + width * n;
  // Validate row ends, then every row's columns.
  uint64_t prev = 0;
  for (uint64_t r = 0; r < rows; ++r) {
    const uint64_t e = load_u32(row_end + 4 * r);
    if (e < prev || e > n) {
      return data_loss("csr payload: row_end[" + num(r) + "]=" + num(e) + " is below row_end[r-1]=" + num(prev) +
                       " or above nnz " + num(n));
    }
    prev = e;
  }
  if (prev != n) {
    return data_loss("csr payload: row_end[" + num(rows - 1) + "]=" + num(prev) + " but nnz is " + num(n));
  }
  size_t j = 0;
  for (uint64_t r = 0; r < rows; ++r) {
    const size_t e = load_u32(row_end + 4 * r);
    for (size_t first = j; j < e; ++j) {
      const uint32_t c = col_at(col, width, j);
      if (c >= cols) {
        return data_loss("csr payload: column index[" + num(j) + "]=" + num(c) + " of row " + num(r) +
                         " is outside cols " + num(cols));
      }
      if (j > first && c <= col_at(col, width, j - 1)) {
        return data_loss("csr payload: column index[" + num(j) + "]=" + num(c) + " of row " + num(r) +
                         " is not greater than the one before");
      }
    }
  }
  SC_RETURN_IF_ERROR(check_values(vt, values, n, "csr"));
  with_reader(vt, values,
              [&](auto reader) { csr_scatter(row_end, col, width, rows, cols, reader, dense_out.data()); });
  return Status::Ok();
}

}  // namespace sparsecar::kernels::codec
