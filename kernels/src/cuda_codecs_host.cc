// cuda_codecs.h's host-only parts, built with and without CUDA: the header checks of a received
// payload and decode_status(), which writes a DecodeStatus as the CPU decoder's message. Every
// message here is the one the CPU decoder (codec_coo.cc, codec_bitmap.cc, quantize.cc,
// codec.cc) gives for the same payload; tests/unit/kernels/cuda_codecs_test.cc compares them.
#include <bit>
#include <string>

#include "codec_internal.h"
#include "cuda/detail/codec_checks.h"
#include "sparsecar/kernels/cuda_codecs.h"

namespace sparsecar::kernels::cuda {
namespace detail {
namespace {

using codec::add_sat;
using codec::mul_sat;
using codec::num;

size_t bitmap_bytes(size_t n) { return n / 8 + (n % 8 != 0); }

}  // namespace

Status header_check(const DevicePayload& p, size_t dense_len) {
  if (!codec::known_value_type(p.value_type)) {
    return data_loss("payload value_type " + num(static_cast<unsigned>(p.value_type)) + " is unknown");
  }
  const CodecInfo* row = find_codec(p.format);
  if (row == nullptr) return data_loss("payload format " + num(static_cast<unsigned>(p.format)) + " is unknown");
  const std::string name = row->name;
  if (p.nnz > dense_len) {
    return data_loss(name + " payload: nnz " + num(p.nnz) + " exceeds the dense length " + num(dense_len));
  }
  const auto n = static_cast<size_t>(p.nnz);
  const size_t values = codec::value_bytes(p.value_type, n);
  switch (p.format) {
    case Format::kCoo: {
      const size_t need = add_sat(4 * n, values);
      if (p.bytes != need) return codec::size_mismatch("coo", p.bytes, need, "for nnz " + num(n));
      return Status::Ok();
    }
    case Format::kCooVarint: {
      const size_t least = add_sat(values, n);
      const size_t most = add_sat(values, mul_sat(5, n));
      if (p.bytes < least || p.bytes > most) {
        return codec::size_mismatch("coo_varint", p.bytes, least,
                                    "at least (at most " + num(most) + ") for nnz " + num(n));
      }
      return Status::Ok();
    }
    case Format::kBitmap: {
      const size_t need = add_sat(bitmap_bytes(dense_len), values);
      if (p.bytes != need) {
        return codec::size_mismatch("bitmap", p.bytes, need,
                                    "for dense length " + num(dense_len) + " and nnz " + num(n));
      }
      return Status::Ok();
    }
    case Format::kDense:
    case Format::kCsr:
    case Format::kRle:
      return Status::Ok();  // no device decoder: decode_accumulate refuses the call before
  }
  return Status::Ok();
}

}  // namespace detail

Status decode_status(const DevicePayload& p, size_t dense_len, const DecodeStatus& s) {
  const CodecInfo* row = find_codec(p.format);
  const std::string name = std::string(row != nullptr ? row->name : "unknown") + " payload: ";
  switch (static_cast<DecodeError>(s.error)) {
    case DecodeError::kNone:
      return Status::Ok();
    case DecodeError::kHeader: {
      Status h = detail::header_check(p, dense_len);
      if (!h.ok()) return h;
      return data_loss(name + "rejected by the header checks");  // not reached for the same arguments
    }
    case DecodeError::kIndexRange:
      return data_loss(name + "index[" + codec::num(s.entry) + "]=" + codec::num(s.value) +
                       " is outside the dense length " + codec::num(dense_len));
    case DecodeError::kIndexOrder:
      return data_loss(name + "index[" + codec::num(s.entry) + "]=" + codec::num(s.value) +
                       " is not greater than index[" + codec::num(s.entry - 1) + "]=" + codec::num(s.other));
    case DecodeError::kVarint:
      return data_loss(name + "varint of index[" + codec::num(s.entry) + "] at byte " + codec::num(s.value) +
                       " is truncated, overlong or over 32 bits");
    case DecodeError::kTrailing:
      return data_loss(name + codec::num(s.value) + " bytes after the " + codec::num(p.nnz) +
                       " indices nnz says (payload_bytes " + codec::num(p.bytes) + ")");
    case DecodeError::kBitmapTail:
      return data_loss(name + "bits past the dense length " + codec::num(dense_len) + " are set (index out of range)");
    case DecodeError::kBitmapCount:
      return data_loss(name + codec::num(s.value) + " bits set but nnz is " + codec::num(p.nnz));
    case DecodeError::kInt8Scale:
      return data_loss(name + "int8 scale " + std::to_string(std::bit_cast<float>(static_cast<uint32_t>(s.value))) +
                       " is negative or infinite");
    case DecodeError::kInt8Code:
      return data_loss(name + "int8 value[" + codec::num(s.entry) + "] is -128 (codes are -127..127)");
  }
  return data_loss(name + "decode status " + codec::num(s.error) + " is unknown");
}

}  // namespace sparsecar::kernels::cuda
