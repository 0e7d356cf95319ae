// The public codec API: sizes, `auto`, validating encode and the receiver's decode-and-accumulate.
// Checks happen here (encoders) or in the per-format decoders (codec_*.cc); see codec_internal.h.
#include "sparsecar/kernels/codec.h"

#include <algorithm>

#include "codec_internal.h"
#include "sparsecar/common/log.h"

namespace sparsecar::kernels {
namespace {

using codec::add_sat;
using codec::kSizeMax;
using codec::mul_sat;
using codec::num;

bool known_format(Format f) { return static_cast<uint16_t>(f) < kFormatCount; }

// The selection contract every encoder relies on: strictly increasing, < dense_len.
Status check_selection(const char* who, size_t dense_len, std::span<const uint32_t> index) {
  const size_t k = index.size();
  bool bad = false;
  for (size_t i = 1; i < k; ++i) bad |= index[i] <= index[i - 1];
  if (!bad && (k == 0 || index[k - 1] < dense_len)) return Status::Ok();
  for (size_t i = 0; i < k; ++i) {
    if (index[i] >= dense_len) {
      return invalid_argument(std::string(who) + ": index[" + num(i) + "]=" + num(index[i]) +
                              " is outside the dense length " + num(dense_len));
    }
    if (i > 0 && index[i] <= index[i - 1]) {
      return invalid_argument(std::string(who) + ": index[" + num(i) + "]=" + num(index[i]) +
                              " is not greater than index[" + num(i - 1) + "]=" + num(index[i - 1]));
    }
  }
  return Status::Ok();
}

// Size for a checked selection; `rows` already validated for CSR.
size_t size_of(Format format, ValueType vt, size_t dense_len, uint32_t rows, std::span<const uint32_t> index) {
  const size_t k = index.size();
  const size_t v = codec::value_bytes(vt, k);
  switch (format) {
    case Format::kDense: return codec::value_bytes(vt, dense_len);
    case Format::kCoo: return add_sat(mul_sat(4, k), v);
    case Format::kCooVarint: return add_sat(v, codec::varint_index_bytes(index));
    case Format::kBitmap: return add_sat(dense_len / 8 + (dense_len % 8 != 0), v);
    case Format::kCsr:
      return add_sat(add_sat(8 + mul_sat(4, rows), mul_sat(codec::csr_col_width(dense_len / rows), k)), v);
    case Format::kRle: return add_sat(v, codec::rle_index_bytes(index));
  }
  return kSizeMax;
}

Status check_params(const char* who, const EncodeParams& params, size_t dense_len) {
  if (!known_format(params.format)) {
    return invalid_argument(std::string(who) + ": format " + num(static_cast<unsigned>(params.format)) + " is unknown");
  }
  if (!codec::known_value_type(params.value_type)) {
    return invalid_argument(std::string(who) + ": value type " + num(static_cast<unsigned>(params.value_type)) +
                            " is unknown");
  }
  if (dense_len > 0xFFFFFFFFull) {
    return invalid_argument(std::string(who) + ": dense length " + num(dense_len) + " exceeds 2^32 - 1");
  }
  if (params.format == Format::kCsr && (params.rows == 0 || (dense_len != 0 && dense_len % params.rows != 0) ||
                                        (dense_len == 0 && params.rows != 1))) {
    return invalid_argument(std::string(who) + ": csr rows " + num(params.rows) + " do not divide the dense length " +
                            num(dense_len));
  }
  return Status::Ok();
}

}  // namespace

size_t value_block_bytes(ValueType value_type, size_t m) {
  return codec::known_value_type(value_type) ? codec::value_bytes(value_type, m) : 0;
}

SizeRange payload_size_range(Format format, ValueType value_type, uint64_t dense_len, uint64_t nnz) {
  if (!known_format(format) || !codec::known_value_type(value_type) || nnz > dense_len) return {};
  const size_t n = static_cast<size_t>(dense_len);
  const size_t k = static_cast<size_t>(nnz);
  const size_t v = codec::value_bytes(value_type, k);
  switch (format) {
    case Format::kDense: {
      if (nnz != dense_len) return {};
      const size_t b = codec::value_bytes(value_type, n);
      return {b, b};
    }
    case Format::kCoo: {
      const size_t b = add_sat(mul_sat(4, k), v);
      return {b, b};
    }
    case Format::kBitmap: {
      const size_t b = add_sat(n / 8 + (n % 8 != 0), v);
      return {b, b};
    }
    case Format::kCooVarint: return {add_sat(v, k), add_sat(v, mul_sat(5, k))};
    case Format::kRle: return {add_sat(v, k == 0 ? 0 : 2), add_sat(v, mul_sat(10, k))};
    case Format::kCsr:
      // rows >= 1 and rows <= max(n, 1); columns take 2 or 4 bytes.
      return {add_sat(add_sat(12, mul_sat(2, k)), v),
              add_sat(add_sat(add_sat(8, mul_sat(4, std::max<size_t>(n, 1))), mul_sat(4, k)), v)};
  }
  return {};
}

size_t encoded_bytes(Format format, ValueType value_type, size_t dense_len, size_t nnz) {
  if (!known_format(format) || !codec::known_value_type(value_type)) return 0;
  if (format == Format::kDense) return codec::value_bytes(value_type, dense_len);
  if (format == Format::kCoo) return add_sat(mul_sat(4, nnz), codec::value_bytes(value_type, nnz));
  if (nnz > dense_len) return kSizeMax;
  return payload_size_range(format, value_type, dense_len, nnz).max;
}

size_t max_encoded_bytes(size_t dense_len) {
  // The largest over formats and value types at nnz = dense_len: CSR with one element per row
  // (8 + 4n + 4n + 4n) and RLE (4n + 10n, though real runs need at most 2 * 5 * ceil(n/2)).
  size_t best = 0;
  for (int f = 0; f < kFormatCount; ++f) {
    for (int t = 0; t < kValueTypeCount; ++t) {
      const auto r = payload_size_range(static_cast<Format>(f), static_cast<ValueType>(t), dense_len, dense_len);
      if (r.min <= r.max) best = std::max(best, r.max);
    }
  }
  return best;
}

Expected<size_t> encoded_size(const EncodeParams& params, size_t dense_len, std::span<const uint32_t> index) {
  SC_RETURN_IF_ERROR(check_params("encoded_size", params, dense_len));
  SC_RETURN_IF_ERROR(check_selection("encoded_size", dense_len, index));
  return size_of(params.format, params.value_type, dense_len, params.rows, index);
}

Expected<size_t> encode(const EncodeParams& params, size_t dense_len, std::span<const uint32_t> index,
                        std::span<const float> value, std::span<std::byte> out) {
  SC_RETURN_IF_ERROR(check_params("encode", params, dense_len));
  if (value.size() != index.size()) {
    return invalid_argument("encode: " + num(index.size()) + " indices but " + num(value.size()) + " values");
  }
  SC_RETURN_IF_ERROR(check_selection("encode", dense_len, index));
  const size_t need = size_of(params.format, params.value_type, dense_len, params.rows, index);
  if (out.size() < need) {
    return invalid_argument("encode: output of " + num(out.size()) + " bytes, " +
                            std::string(format_name(params.format)) + "/" +
                            std::string(value_type_name(params.value_type)) + " needs " + num(need));
  }
  const ValueType vt = params.value_type;
  std::byte* p = out.data();
  size_t wrote = 0;
  switch (params.format) {
    case Format::kDense: wrote = codec::write_values_scattered(vt, index, value, dense_len, p); break;
    case Format::kCoo: wrote = codec::coo_write(vt, index, value, p); break;
    case Format::kCooVarint: wrote = codec::coo_varint_write(vt, index, value, p); break;
    case Format::kBitmap: wrote = codec::bitmap_write(vt, dense_len, index, value, p); break;
    case Format::kCsr: wrote = codec::csr_write(vt, dense_len, params.rows, index, value, p); break;
    case Format::kRle: wrote = codec::rle_write(vt, index, value, p); break;
  }
  SC_CHECK(wrote == need, "encoder wrote a different size than encoded_size computed");
  return wrote;
}

Expected<FormatChoice> choose_format(ValueType value_type, uint32_t rows, size_t dense_len,
                                     std::span<const uint32_t> index) {
  EncodeParams params;
  params.value_type = value_type;
  SC_RETURN_IF_ERROR(check_params("choose_format", params, dense_len));
  SC_RETURN_IF_ERROR(check_selection("choose_format", dense_len, index));
  FormatChoice choice;
  for (int f = 0; f < kFormatCount; ++f) {
    const auto format = static_cast<Format>(f);
    params.format = format;
    params.rows = rows;
    const bool usable = format != Format::kCsr || check_params("choose_format", params, dense_len).ok();
    choice.bytes_by_format[f] = usable ? size_of(format, value_type, dense_len, rows, index) : kSizeMax;
  }
  constexpr Format kPreference[] = {Format::kCoo,  Format::kBitmap,    Format::kDense,
                                    Format::kCsr,  Format::kCooVarint, Format::kRle};
  choice.format = kPreference[0];
  choice.bytes = kSizeMax;
  for (Format f : kPreference) {
    const size_t b = choice.bytes_by_format[static_cast<int>(f)];
    if (b < choice.bytes) {
      choice.bytes = b;
      choice.format = f;
    }
  }
  return choice;
}

Status coo_encode(std::span<const uint32_t> index, std::span<const float> value, std::span<std::byte> out) {
  const size_t nnz = index.size();
  if (value.size() != nnz) {
    return invalid_argument("coo_encode: " + num(nnz) + " indices but " + num(value.size()) + " values");
  }
  const size_t need = mul_sat(nnz, 8);
  if (out.size() < need) {
    return invalid_argument("coo_encode: output of " + num(out.size()) + " bytes, " + num(nnz) +
                            " entries need " + num(need));
  }
  SC_RETURN_IF_ERROR(check_selection("coo_encode", 0xFFFFFFFFull + 1, index));
  codec::coo_write(ValueType::kF32, index, value, out.data());
  return Status::Ok();
}

Status dense_encode(std::span<const float> values, std::span<std::byte> out) {
  const size_t need = values.size() * sizeof(float);
  if (out.size() < need) {
    return invalid_argument("dense_encode: output of " + num(out.size()) + " bytes, need " + num(need));
  }
  if (need > 0) std::memcpy(out.data(), values.data(), need);
  return Status::Ok();
}

Status decode_accumulate(Format format, ValueType value_type, std::span<const std::byte> payload, uint64_t nnz,
                         std::span<float> dense_out, ThreadPool* pool) {
  if (!codec::known_value_type(value_type)) {
    return data_loss("payload value_type " + num(static_cast<unsigned>(value_type)) + " is unknown");
  }
  switch (format) {
    case Format::kDense: return codec::dense_decode(value_type, payload, nnz, dense_out, pool);
    case Format::kCoo: return codec::coo_decode(value_type, payload, nnz, dense_out, pool);
    case Format::kCooVarint: return codec::coo_varint_decode(value_type, payload, nnz, dense_out);
    case Format::kBitmap: return codec::bitmap_decode(value_type, payload, nnz, dense_out, pool);
    case Format::kCsr: return codec::csr_decode(value_type, payload, nnz, dense_out);
    case Format::kRle: return codec::rle_decode(value_type, payload, nnz, dense_out);
  }
  return data_loss("payload format " + num(static_cast<unsigned>(format)) + " is unknown");
}

}  // namespace sparsecar::kernels
