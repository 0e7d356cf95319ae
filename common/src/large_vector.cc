#include "sparsecar/common/large_vector.h"

#include <sys/mman.h>

#include <cstdlib>

namespace sparsecar::detail {

void* allocate_huge(size_t bytes) {
  void* p = nullptr;
  if (posix_memalign(&p, kHugePageBytes, bytes) != 0) throw std::bad_alloc();
#ifdef MADV_HUGEPAGE
  // Only the whole huge pages: advising a partial tail would let a fault there back it with a
  // full 2 MiB page (up to 2 MiB resident that the buffer never uses). A hint: EINVAL (no THP in
  // this kernel) leaves ordinary pages, which is still correct.
  const size_t whole = bytes / kHugePageBytes * kHugePageBytes;
  if (whole > 0) (void)madvise(p, whole, MADV_HUGEPAGE);
#endif
  return p;
}

void free_huge(void* p) noexcept { std::free(p); }

}  // namespace sparsecar::detail
