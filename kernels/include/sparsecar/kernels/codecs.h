// The codec registry: one row per payload format, and one per value type.
//
// A codec row (kernels/src/codecs.cc) holds the format's frozen id (the wire header's `format`),
// its name, a one-line doc, what it needs from the selection (every element, a 2-D view), its
// tie-break rank for `auto`, and its functions over every value type: the exact size of a
// selection, the size range a wire header allows, the encoder and the validating
// decode-and-accumulate (plus slots for the CUDA ones). Every other place derives from the rows:
// the names (format_name / parse_format), the `format` knob's choices (policies'
// kFormatChoices: `sparsecard --help`, `sparsecarctl knobs`, tensor_overrides), the public codec
// API's dispatch (codec.h: one table lookup, no switch), `auto` (choose_format) and the cost
// controller's format choice, the wire layer's "known format" check, the decoder fuzz targets
// and their seeds (tests/fuzz), the codec benchmark rows and the registry tests that run every
// row.
//
// The bytes of each layout are specified in daemon/transport/WIRE.md ("Payload layouts", "Value
// blocks"); that document stays the spec, and golden-bytes tests pin it.
//
// Adding a codec: an id below (and kFormatCount), its functions (a codec_<name>.cc), its row in
// codecs.cc, its test (golden bytes and malformed payloads) and its WIRE.md section.
//
// Ids are frozen: they travel in every data message. Add new ones at the end; never renumber or
// reuse one. Thread-safety: the tables are immutable; the functions are pure over caller-owned
// buffers.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string_view>

#include "sparsecar/common/status.h"

namespace sparsecar::kernels {

class ThreadPool;  // parallel.h

// How a selection is laid out in a message payload (WIRE.md "Payload layouts").
enum class Format : uint16_t {
  kDense = 0,
  kCoo = 1,
  kCooVarint = 2,
  kBitmap = 3,
  kCsr = 4,
  kRle = 5,
};
// Number of formats: ids 0 .. kFormatCount - 1, one row each (checked in codecs.cc).
inline constexpr int kFormatCount = 6;

// Element type of the values in a payload (WIRE.md "Value blocks").
enum class ValueType : uint16_t {
  kF32 = 0,
  kF16 = 1,   // IEEE binary16, round to nearest even, finite values saturate at +-65504
  kBf16 = 2,  // bfloat16 (top 16 bits of fp32), round to nearest even, saturating
  kI8 = 3,    // float32 scale, then int8 q[] in [-127, 127]; value = q * scale
};
inline constexpr int kValueTypeCount = 4;

// Sizes a payload of (format, value_type) with nnz entries of a dense_len tensor can have, from
// what the wire header says alone (payload_size_range in codec.h).
struct SizeRange {
  size_t min = 1;
  size_t max = 0;
  bool contains(size_t bytes) const { return min <= bytes && bytes <= max; }
};

// ---- the functions of a row --------------------------------------------------------------------

// A selection as the row functions get it, already checked by codec.h's public functions: index
// strictly increasing and < dense_len (<= 2^32 - 1), value of the same size (empty when only the
// size is asked), a known value type, and for rows with .needs_rows a `rows` that divides
// dense_len (1 for an empty tensor).
struct CodecSelection {
  ValueType value_type = ValueType::kF32;
  size_t dense_len = 0;
  uint32_t rows = 1;
  std::span<const uint32_t> index;
  std::span<const float> value;
};

// Exact payload bytes of the selection (saturating at SIZE_MAX, never wrapping).
using CodecSizeFn = size_t (*)(const CodecSelection& sel);
// Writes the payload into out (exactly size(sel) bytes) and returns the bytes written.
using CodecEncodeFn = size_t (*)(const CodecSelection& sel, std::byte* out);
// The payload sizes a header (value_type known, nnz <= dense_len, nnz == dense_len for .dense
// rows) allows; saturating.
using CodecSizeRangeFn = SizeRange (*)(ValueType value_type, uint64_t dense_len, uint64_t nnz);
// Validates the whole payload (value_type known; nnz and the size as the header says, hostile)
// and only then adds it into dense_out; on error kDataLoss naming the field, nothing written.
// pool (optional): rows with .parallel_decode split the scatter over it.
using CodecDecodeFn = Status (*)(ValueType value_type, std::span<const std::byte> payload, uint64_t nnz,
                                 std::span<float> dense_out, ThreadPool* pool);
// The CUDA backend's entries (device buffers, a stream); declared by the CUDA kernels when they
// come. No row has them yet.
struct CudaCodecArgs;
using CudaEncodeFn = Expected<size_t> (*)(const CudaCodecArgs& args);
using CudaDecodeFn = Status (*)(const CudaCodecArgs& args);

struct CodecInfo {
  Format id;
  const char* name;         // config files, flags, override values, metrics labels, fuzz targets
  const char* doc;          // one line: the layout in words (the bytes: WIRE.md)
  bool dense;               // carries all dense_len elements: the header's nnz is dense_len and the
                            // selection is scattered into zeros
  bool needs_rows;          // reads the tensor's 2-D view (EncodeParams::rows must divide dense_len;
                            // `auto` skips the row when it does not)
  bool parallel_decode;     // the decoder splits its scatter over a ThreadPool
  uint8_t auto_rank;        // `auto`'s tie-break: of equal sizes the lowest rank wins (the faster
                            // decoder); unique per row
  CodecSizeFn size;
  CodecEncodeFn encode;
  CodecSizeRangeFn size_range;
  CodecDecodeFn decode;
  CudaEncodeFn cuda_encode;  // null: no CUDA backend
  CudaDecodeFn cuda_decode;
};

// Every row in id order (ids are 0 .. size - 1).
std::span<const CodecInfo> codec_registry();
// The row of `f`, or null for a value no row has.
const CodecInfo* find_codec(Format f);
// The row named `name`, or null.
const CodecInfo* find_codec(std::string_view name);

std::string_view format_name(Format f);  // "unknown" for a value no row has
// false (and *out unchanged) if no row has that name ("auto" is a plan's choice, not a format).
bool parse_format(std::string_view text, Format* out);
// "dense|coo|...": every row's name in id order, as a C string that lives as long as the program.
const char* format_choices();

// ---- value types -----------------------------------------------------------------------------------

struct ValueTypeInfo {
  ValueType id;
  const char* name;  // "fp32", ...: config files, flags, override values
  const char* doc;   // one line: what the receiver decodes (the bytes and bounds: WIRE.md)
};

// Every value type in id order (ids are 0 .. size - 1).
std::span<const ValueTypeInfo> value_type_registry();
const ValueTypeInfo* find_value_type(ValueType v);  // null for a value no row has
std::string_view value_type_name(ValueType v);      // "unknown" for a value no row has
bool parse_value_type(std::string_view text, ValueType* out);  // false (*out unchanged) if unknown
// "fp32|fp16|bf16|int8": every value type's name in id order (lives as long as the program).
const char* value_type_choices();

}  // namespace sparsecar::kernels
