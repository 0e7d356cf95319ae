// The public codec API: sizes, `auto`, validating encode and the receiver's decode-and-accumulate.
// Checks happen here (encoders) or in the per-format decoders (codec_*.cc); see codec_internal.h.
// Every per-format step is the registry row's function (codecs.h): one lookup, no switch.
#include "sparsecar/kernels/codec.h"

#include <algorithm>

#include "codec_internal.h"
#include "sparsecar/common/log.h"

namespace sparsecar::kernels {
namespace {

using codec::kSizeMax;
using codec::mul_sat;
using codec::num;

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

// The row of params.format after checking the parameters every row relies on (CodecSelection).
Expected<const CodecInfo*> check_params(const char* who, const EncodeParams& params, size_t dense_len) {
  const CodecInfo* row = find_codec(params.format);
  if (row == nullptr) {
    return invalid_argument(std::string(who) + ": format " + num(static_cast<unsigned>(params.format)) + " is unknown");
  }
  if (!codec::known_value_type(params.value_type)) {
    return invalid_argument(std::string(who) + ": value type " + num(static_cast<unsigned>(params.value_type)) +
                            " is unknown");
  }
  if (dense_len > 0xFFFFFFFFull) {
    return invalid_argument(std::string(who) + ": dense length " + num(dense_len) + " exceeds 2^32 - 1");
  }
  if (row->needs_rows && (params.rows == 0 || (dense_len != 0 && dense_len % params.rows != 0) ||
                          (dense_len == 0 && params.rows != 1))) {
    return invalid_argument(std::string(who) + ": " + row->name + " rows " + num(params.rows) +
                            " do not divide the dense length " + num(dense_len));
  }
  return row;
}

CodecSelection selection_of(const EncodeParams& params, size_t dense_len, std::span<const uint32_t> index,
                            std::span<const float> value) {
  CodecSelection sel;
  sel.value_type = params.value_type;
  sel.dense_len = dense_len;
  sel.rows = params.rows;
  sel.index = index;
  sel.value = value;
  return sel;
}

}  // namespace

size_t value_block_bytes(ValueType value_type, size_t m) {
  return codec::known_value_type(value_type) ? codec::value_bytes(value_type, m) : 0;
}

SizeRange payload_size_range(Format format, ValueType value_type, uint64_t dense_len, uint64_t nnz) {
  const CodecInfo* row = find_codec(format);
  if (row == nullptr || !codec::known_value_type(value_type) || nnz > dense_len) return {};
  if (row->dense && nnz != dense_len) return {};
  return row->size_range(value_type, dense_len, nnz);
}

size_t encoded_bytes(Format format, ValueType value_type, size_t dense_len, size_t nnz) {
  const CodecInfo* row = find_codec(format);
  if (row == nullptr || !codec::known_value_type(value_type)) return 0;
  if (row->dense) return row->size_range(value_type, dense_len, dense_len).max;
  if (nnz > dense_len) return kSizeMax;
  return row->size_range(value_type, dense_len, nnz).max;
}

size_t max_encoded_bytes(size_t dense_len) {
  // The largest over formats and value types at nnz = dense_len: CSR with one element per row
  // (8 + 4n + 4n + 4n) and RLE (4n + 10n, though real runs need at most 2 * 5 * ceil(n/2)).
  size_t best = 0;
  for (const CodecInfo& row : codec_registry()) {
    for (const ValueTypeInfo& vt : value_type_registry()) {
      const auto r = payload_size_range(row.id, vt.id, dense_len, dense_len);
      if (r.min <= r.max) best = std::max(best, r.max);
    }
  }
  return best;
}

Expected<size_t> encoded_size(const EncodeParams& params, size_t dense_len, std::span<const uint32_t> index) {
  SC_ASSIGN_OR_RETURN(const CodecInfo* row, check_params("encoded_size", params, dense_len));
  SC_RETURN_IF_ERROR(check_selection("encoded_size", dense_len, index));
  return row->size(selection_of(params, dense_len, index, {}));
}

Expected<size_t> encode(const EncodeParams& params, size_t dense_len, std::span<const uint32_t> index,
                        std::span<const float> value, std::span<std::byte> out) {
  SC_ASSIGN_OR_RETURN(const CodecInfo* row, check_params("encode", params, dense_len));
  if (value.size() != index.size()) {
    return invalid_argument("encode: " + num(index.size()) + " indices but " + num(value.size()) + " values");
  }
  SC_RETURN_IF_ERROR(check_selection("encode", dense_len, index));
  const CodecSelection sel = selection_of(params, dense_len, index, value);
  const size_t need = row->size(sel);
  if (out.size() < need) {
    return invalid_argument("encode: output of " + num(out.size()) + " bytes, " + row->name + "/" +
                            std::string(value_type_name(params.value_type)) + " needs " + num(need));
  }
  const size_t wrote = row->encode(sel, out.data());
  SC_CHECK(wrote == need, "encoder wrote a different size than encoded_size computed");
  return wrote;
}

Expected<FormatChoice> choose_format(ValueType value_type, uint32_t rows, size_t dense_len,
                                     std::span<const uint32_t> index) {
  EncodeParams params;
  params.value_type = value_type;
  SC_RETURN_IF_ERROR(check_params("choose_format", params, dense_len).status());
  SC_RETURN_IF_ERROR(check_selection("choose_format", dense_len, index));
  params.rows = rows;
  FormatChoice choice;
  const CodecInfo* best = nullptr;
  for (const CodecInfo& row : codec_registry()) {
    params.format = row.id;
    const bool usable = check_params("choose_format", params, dense_len).ok();
    const size_t bytes = usable ? row.size(selection_of(params, dense_len, index, {})) : kSizeMax;
    choice.bytes_by_format[static_cast<size_t>(row.id)] = bytes;
    // The smallest; of equal sizes the lowest auto_rank. Nothing usable: the lowest rank.
    if (best == nullptr || bytes < choice.bytes || (bytes == choice.bytes && row.auto_rank < best->auto_rank)) {
      best = &row;
      choice.bytes = bytes;
    }
  }
  choice.format = best->id;
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
  const CodecInfo* row = find_codec(format);
  if (row == nullptr) return data_loss("payload format " + num(static_cast<unsigned>(format)) + " is unknown");
  return row->decode(value_type, payload, nnz, dense_out, pool);
}

}  // namespace sparsecar::kernels
