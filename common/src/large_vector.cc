#include "sparsecar/common/large_vector.h"

#include <sys/mman.h>

#include <cstdlib>

namespace sparsecar::detail {

void* allocate_huge(size_t bytes) {
  const size_t rounded = (bytes + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  void* p = std::aligned_alloc(kHugePageBytes, rounded);
  if (p == nullptr) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
  // A hint: EINVAL (no THP in this kernel) leaves ordinary pages, which is still correct.
  (void)madvise(p, rounded, MADV_HUGEPAGE);
#endif
  return p;
}

void free_huge(void* p) noexcept { std::free(p); }

}  // namespace sparsecar::detail
