// libFuzzer target for the payload decoders: one binary, one row of the codec registry per run
// (kernels/codecs.h), named by the environment variable SPARSECAR_FUZZ_FORMAT, so each decoder
// gets its own corpus and coverage. ctest runs it once per row (fuzz_decode_<name>; the tests
// are written after the build from `fuzz_make_seeds --list`, see CMakeLists.txt). By hand:
//   SPARSECAR_FUZZ_FORMAT=coo fuzz_decode corpus/decode_coo
//
// Input: byte 0 = value type (low 2 bits), bytes 1..3 = dense length (little-endian, low 17 bits: < 131072),
// bytes 4..6 = nnz (little-endian; may exceed the dense length), the rest = the payload.
// Properties checked beyond "no crash, no sanitizer report":
//   - an error is kDataLoss and leaves the output bit-for-bit untouched;
//   - a payload the decoder accepts also passes the wire layer's size pre-check
//     (kernels::payload_size_range), so the header check never rejects a valid payload.
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "sparsecar/kernels/codec.h"

namespace sk = sparsecar::kernels;

namespace {
sk::Format g_format = sk::Format::kDense;
}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* name = std::getenv("SPARSECAR_FUZZ_FORMAT");
  const sk::CodecInfo* row = name != nullptr ? sk::find_codec(std::string_view(name)) : nullptr;
  if (row == nullptr) {
    std::fprintf(stderr, "fuzz_decode: set SPARSECAR_FUZZ_FORMAT to a codec name (%s); got %s\n",
                 sk::format_choices(), name != nullptr ? name : "nothing");
    std::exit(2);
  }
  g_format = row->id;
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 7) return 0;
  const sk::Format format = g_format;
  const auto value_type = static_cast<sk::ValueType>(data[0] & 3u);
  const size_t dense_len = (data[1] | (size_t{data[2]} << 8) | (size_t{data[3]} << 16)) & 0x1FFFFu;
  const uint64_t nnz = data[4] | (uint64_t{data[5]} << 8) | (uint64_t{data[6]} << 16);
  std::span<const std::byte> payload(reinterpret_cast<const std::byte*>(data + 7), size - 7);

  // A recognisable, non-zero base so that "untouched" is meaningful.
  std::vector<float> out(dense_len);
  for (size_t i = 0; i < dense_len; ++i) out[i] = static_cast<float>(i % 251) + 0.25f;
  const std::vector<float> before = out;

  const sparsecar::Status s = sk::decode_accumulate(format, value_type, payload, nnz, out);
  if (!s.ok()) {
    if (s.code() != sparsecar::Code::kDataLoss) __builtin_trap();
    if (dense_len > 0 && std::memcmp(out.data(), before.data(), dense_len * sizeof(float)) != 0) __builtin_trap();
    return 0;
  }
  if (!sk::payload_size_range(format, value_type, dense_len, nnz).contains(payload.size())) __builtin_trap();
  return 0;
}
