// The codec registry's rows (codecs.h) and the adapters that give every format's functions
// (codec_*.cc) the one signature per function that the rows hold (defined here, so the rows'
// static_asserts can see them). A row is the only place that says which functions a format id
// means.
#include "sparsecar/kernels/codecs.h"

#include <array>
#include <string>

#include "codec_internal.h"

namespace sparsecar::kernels {
namespace {

using codec::add_sat;
using codec::mul_sat;
using codec::value_bytes;

size_t bitmap_bytes(size_t n) { return n / 8 + (n % 8 != 0); }
SizeRange exactly(size_t bytes) { return {bytes, bytes}; }

// ---- dense (0): V(n), the selection scattered into zeros ----------------------------------------

size_t dense_size(const CodecSelection& s) { return value_bytes(s.value_type, s.dense_len); }
size_t dense_encode_row(const CodecSelection& s, std::byte* out) {
  return codec::write_values_scattered(s.value_type, s.index, s.value, s.dense_len, out);
}
SizeRange dense_range(ValueType vt, uint64_t n, uint64_t) { return exactly(value_bytes(vt, n)); }
Status dense_decode_row(ValueType vt, std::span<const std::byte> payload, uint64_t nnz, std::span<float> out,
                        ThreadPool* pool) {
  return codec::dense_decode(vt, payload, nnz, out, pool);
}

// ---- coo (1): uint32 index[k], then V(k) ---------------------------------------------------------

size_t coo_size(const CodecSelection& s) {
  return add_sat(mul_sat(4, s.index.size()), value_bytes(s.value_type, s.index.size()));
}
size_t coo_encode_row(const CodecSelection& s, std::byte* out) {
  return codec::coo_write(s.value_type, s.index, s.value, out);
}
SizeRange coo_range(ValueType vt, uint64_t, uint64_t k) { return exactly(add_sat(mul_sat(4, k), value_bytes(vt, k))); }
Status coo_decode_row(ValueType vt, std::span<const std::byte> payload, uint64_t nnz, std::span<float> out,
                      ThreadPool* pool) {
  return codec::coo_decode(vt, payload, nnz, out, pool);
}

// ---- coo_varint (2): V(k), then k LEB128 gaps ----------------------------------------------------

size_t coo_varint_size(const CodecSelection& s) {
  return add_sat(value_bytes(s.value_type, s.index.size()), codec::varint_index_bytes(s.index));
}
size_t coo_varint_encode_row(const CodecSelection& s, std::byte* out) {
  return codec::coo_varint_write(s.value_type, s.index, s.value, out);
}
SizeRange coo_varint_range(ValueType vt, uint64_t, uint64_t k) {
  const size_t v = value_bytes(vt, k);
  return {add_sat(v, k), add_sat(v, mul_sat(5, k))};
}
Status coo_varint_decode_row(ValueType vt, std::span<const std::byte> payload, uint64_t nnz,
                             std::span<float> out, ThreadPool*) {
  return codec::coo_varint_decode(vt, payload, nnz, out);
}

// ---- bitmap (3): ceil(n/8) bytes of bits, then V(k) ----------------------------------------------

size_t bitmap_size(const CodecSelection& s) {
  return add_sat(bitmap_bytes(s.dense_len), value_bytes(s.value_type, s.index.size()));
}
size_t bitmap_encode_row(const CodecSelection& s, std::byte* out) {
  return codec::bitmap_write(s.value_type, s.dense_len, s.index, s.value, out);
}
SizeRange bitmap_range(ValueType vt, uint64_t n, uint64_t k) {
  return exactly(add_sat(bitmap_bytes(n), value_bytes(vt, k)));
}
Status bitmap_decode_row(ValueType vt, std::span<const std::byte> payload, uint64_t nnz, std::span<float> out,
                         ThreadPool* pool) {
  return codec::bitmap_decode(vt, payload, nnz, out, pool);
}

// ---- csr (4): rows, cols, row ends, u16/u32 columns, then V(k) -----------------------------------

size_t csr_size(const CodecSelection& s) {
  const size_t k = s.index.size();
  return add_sat(add_sat(8 + mul_sat(4, s.rows), mul_sat(codec::csr_col_width(s.dense_len / s.rows), k)),
                 value_bytes(s.value_type, k));
}
size_t csr_encode_row(const CodecSelection& s, std::byte* out) {
  return codec::csr_write(s.value_type, s.dense_len, s.rows, s.index, s.value, out);
}
SizeRange csr_range(ValueType vt, uint64_t n, uint64_t k) {
  // rows >= 1 and rows <= max(n, 1); columns take 2 or 4 bytes.
  const size_t v = value_bytes(vt, k);
  return {add_sat(add_sat(12, mul_sat(2, k)), v),
          add_sat(add_sat(add_sat(8, mul_sat(4, n > 1 ? n : 1)), mul_sat(4, k)), v)};
}
Status csr_decode_row(ValueType vt, std::span<const std::byte> payload, uint64_t nnz, std::span<float> out,
                      ThreadPool*) {
  return codec::csr_decode(vt, payload, nnz, out);
}

// ---- rle (5): V(k), then (gap, length) varint pairs per run --------------------------------------

size_t rle_size(const CodecSelection& s) {
  return add_sat(value_bytes(s.value_type, s.index.size()), codec::rle_index_bytes(s.index));
}
size_t rle_encode_row(const CodecSelection& s, std::byte* out) {
  return codec::rle_write(s.value_type, s.index, s.value, out);
}
SizeRange rle_range(ValueType vt, uint64_t, uint64_t k) {
  const size_t v = value_bytes(vt, k);
  return {add_sat(v, k == 0 ? 0 : 2), add_sat(v, mul_sat(10, k))};
}
Status rle_decode_row(ValueType vt, std::span<const std::byte> payload, uint64_t nnz, std::span<float> out,
                      ThreadPool*) {
  return codec::rle_decode(vt, payload, nnz, out);
}

// ---- the rows ------------------------------------------------------------------------------------

// Every field is written out in every row (no silently defaulted column). auto_rank orders the
// decoders by speed (docs/benchmarks.md): coo, bitmap, dense, csr, coo_varint, rle.
constexpr CodecInfo kRows[] = {
    {.id = Format::kDense,
     .name = "dense",
     .doc = "every element's value, the selection scattered into zeros (nnz = dense length)",
     .dense = true, .needs_rows = false, .parallel_decode = true, .auto_rank = 2,
     .size = dense_size, .encode = dense_encode_row, .size_range = dense_range, .decode = dense_decode_row,
     .cuda_encode = nullptr, .cuda_decode = nullptr},
    {.id = Format::kCoo,
     .name = "coo",
     .doc = "uint32 indices, then the values",
     .dense = false, .needs_rows = false, .parallel_decode = true, .auto_rank = 0,
     .size = coo_size, .encode = coo_encode_row, .size_range = coo_range, .decode = coo_decode_row,
     .cuda_encode = nullptr, .cuda_decode = nullptr},
    {.id = Format::kCooVarint,
     .name = "coo_varint",
     .doc = "the values, then the index gaps as LEB128 varints",
     .dense = false, .needs_rows = false, .parallel_decode = false, .auto_rank = 4,
     .size = coo_varint_size, .encode = coo_varint_encode_row, .size_range = coo_varint_range,
     .decode = coo_varint_decode_row,
     .cuda_encode = nullptr, .cuda_decode = nullptr},
    {.id = Format::kBitmap,
     .name = "bitmap",
     .doc = "one bit per element (LSB first), then the values in index order",
     .dense = false, .needs_rows = false, .parallel_decode = true, .auto_rank = 1,
     .size = bitmap_size, .encode = bitmap_encode_row, .size_range = bitmap_range, .decode = bitmap_decode_row,
     .cuda_encode = nullptr, .cuda_decode = nullptr},
    {.id = Format::kCsr,
     .name = "csr",
     .doc = "rows of the 2-D view: row ends, uint16/uint32 column indices, then the values",
     .dense = false, .needs_rows = true, .parallel_decode = false, .auto_rank = 3,
     .size = csr_size, .encode = csr_encode_row, .size_range = csr_range, .decode = csr_decode_row,
     .cuda_encode = nullptr, .cuda_decode = nullptr},
    {.id = Format::kRle,
     .name = "rle",
     .doc = "the values, then a (gap, length) varint pair per run of kept elements",
     .dense = false, .needs_rows = false, .parallel_decode = false, .auto_rank = 5,
     .size = rle_size, .encode = rle_encode_row, .size_range = rle_range, .decode = rle_decode_row,
     .cuda_encode = nullptr, .cuda_decode = nullptr},
};

static_assert(std::size(kRows) == static_cast<size_t>(kFormatCount), "one codec row per format id (kFormatCount)");
static_assert([] {
  for (size_t i = 0; i < std::size(kRows); ++i) {
    const CodecInfo& r = kRows[i];
    if (static_cast<size_t>(r.id) != i) return false;
    if (r.size == nullptr || r.encode == nullptr || r.size_range == nullptr || r.decode == nullptr) return false;
    for (size_t j = 0; j < i; ++j) {
      if (kRows[j].auto_rank == r.auto_rank) return false;
    }
  }
  return true;
}(), "codec rows must be in id order, ids 0..N-1, each with all four CPU functions and its own auto_rank");

constexpr ValueTypeInfo kValueTypes[] = {
    {.id = ValueType::kF32, .name = "fp32", .doc = "float32, exact"},
    {.id = ValueType::kF16, .name = "fp16", .doc = "IEEE binary16, round to nearest even, saturating at +-65504"},
    {.id = ValueType::kBf16, .name = "bf16", .doc = "bfloat16, round to nearest even, saturating"},
    {.id = ValueType::kI8, .name = "int8", .doc = "a float32 scale per message, then int8 codes in -127..127"},
};
static_assert(std::size(kValueTypes) == static_cast<size_t>(kValueTypeCount),
              "one value type row per id (kValueTypeCount)");
static_assert([] {
  for (size_t i = 0; i < std::size(kValueTypes); ++i) {
    if (static_cast<size_t>(kValueTypes[i].id) != i) return false;
  }
  return true;
}(), "value type rows must be in id order, ids 0..N-1");

template <typename Rows>
std::string names_of(const Rows& rows) {
  std::string out;
  for (const auto& row : rows) {
    if (!out.empty()) out += '|';
    out += row.name;
  }
  return out;
}

}  // namespace

std::span<const CodecInfo> codec_registry() { return kRows; }

const CodecInfo* find_codec(Format f) {
  const auto i = static_cast<size_t>(f);
  return i < std::size(kRows) ? &kRows[i] : nullptr;
}

const CodecInfo* find_codec(std::string_view name) {
  for (const CodecInfo& row : kRows) {
    if (name == row.name) return &row;
  }
  return nullptr;
}

std::string_view format_name(Format f) {
  const CodecInfo* row = find_codec(f);
  return row != nullptr ? row->name : "unknown";
}

bool parse_format(std::string_view text, Format* out) {
  const CodecInfo* row = find_codec(text);
  if (row == nullptr) return false;
  *out = row->id;
  return true;
}

const char* format_choices() {
  static const std::string choices = names_of(kRows);
  return choices.c_str();
}

std::span<const ValueTypeInfo> value_type_registry() { return kValueTypes; }

const ValueTypeInfo* find_value_type(ValueType v) {
  const auto i = static_cast<size_t>(v);
  return i < std::size(kValueTypes) ? &kValueTypes[i] : nullptr;
}

std::string_view value_type_name(ValueType v) {
  const ValueTypeInfo* row = find_value_type(v);
  return row != nullptr ? row->name : "unknown";
}

bool parse_value_type(std::string_view text, ValueType* out) {
  for (const ValueTypeInfo& row : kValueTypes) {
    if (text == row.name) {
      *out = row.id;
      return true;
    }
  }
  return false;
}

const char* value_type_choices() {
  static const std::string choices = names_of(kValueTypes);
  return choices.c_str();
}

}  // namespace sparsecar::kernels
