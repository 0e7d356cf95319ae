// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78): the SSE4.2 crc32 instruction when the CPU
// has it, else slicing-by-8 tables built at compile time.
#include <nmmintrin.h>

#include <array>
#include <cstring>

#include "detail/cpu.h"
#include "sparsecar/kernels/codec.h"

namespace sparsecar::kernels {
namespace detail {
namespace {

constexpr uint32_t kPoly = 0x82F63B78u;

constexpr std::array<std::array<uint32_t, 256>, 8> make_tables() {
  std::array<std::array<uint32_t, 256>, 8> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int b = 0; b < 8; ++b) c = (c & 1u) ? (c >> 1) ^ kPoly : c >> 1;
    t[0][i] = c;
  }
  for (size_t s = 1; s < 8; ++s) {
    for (uint32_t i = 0; i < 256; ++i) t[s][i] = (t[s - 1][i] >> 8) ^ t[0][t[s - 1][i] & 0xffu];
  }
  return t;
}

constexpr auto kTables = make_tables();

}  // namespace

uint32_t crc32c_update_table(uint32_t state, const unsigned char* p, size_t n) {
  while (n >= 8) {
    uint32_t lo;
    uint32_t hi;
    std::memcpy(&lo, p, 4);
    std::memcpy(&hi, p + 4, 4);
    lo ^= state;
    state = kTables[7][lo & 0xffu] ^ kTables[6][(lo >> 8) & 0xffu] ^
            kTables[5][(lo >> 16) & 0xffu] ^ kTables[4][lo >> 24] ^ kTables[3][hi & 0xffu] ^
            kTables[2][(hi >> 8) & 0xffu] ^ kTables[1][(hi >> 16) & 0xffu] ^ kTables[0][hi >> 24];
    p += 8;
    n -= 8;
  }
  while (n-- > 0) state = (state >> 8) ^ kTables[0][(state ^ *p++) & 0xffu];
  return state;
}

__attribute__((target("sse4.2"))) uint32_t crc32c_update_sse42(uint32_t state,
                                                              const unsigned char* p, size_t n) {
  uint64_t c = state;
  while (n > 0 && (reinterpret_cast<uintptr_t>(p) & 7u) != 0) {
    c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
    --n;
  }
  while (n >= 8) {
    uint64_t word;
    std::memcpy(&word, p, 8);
    c = _mm_crc32_u64(c, word);
    p += 8;
    n -= 8;
  }
  while (n-- > 0) c = _mm_crc32_u8(static_cast<uint32_t>(c), *p++);
  return static_cast<uint32_t>(c);
}

}  // namespace detail

uint32_t crc32c(uint32_t crc, const void* data, size_t size) {
  const auto* p = static_cast<const unsigned char*>(data);
  const uint32_t state = ~crc;
  return ~(detail::has_sse42() ? detail::crc32c_update_sse42(state, p, size)
                               : detail::crc32c_update_table(state, p, size));
}

}  // namespace sparsecar::kernels
