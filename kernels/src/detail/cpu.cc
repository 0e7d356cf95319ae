#include "detail/cpu.h"

namespace sparsecar::kernels::detail {

Isa best_isa() {
  static const Isa isa = [] {
    __builtin_cpu_init();
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                        __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt");
    return avx512 ? Isa::kAvx512 : Isa::kPortable;
  }();
  return isa;
}

bool has_sse42() {
  static const bool sse42 = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("sse4.2") != 0;
  }();
  return sse42;
}

}  // namespace sparsecar::kernels::detail
