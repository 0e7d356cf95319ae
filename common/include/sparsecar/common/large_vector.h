// Storage for the large per-tensor buffers (residuals, sums, selections, scratch).
//
// HugePageAllocator backs every allocation of 2 MiB or more with 2 MiB-aligned memory and asks
// the kernel for transparent huge pages on its whole 2 MiB pages (the tail below 2 MiB stays on
// 4 KiB pages, so nothing is resident beyond the buffer) (madvise(MADV_HUGEPAGE); Debian's default THP mode
// is `madvise`, so without the call such buffers stay on 4 KiB pages). The kernels stream over
// these buffers and scatter into them: on 4 KiB pages a pass over a 256 MiB tensor walks 65,536
// pages and a scatter misses the TLB on almost every element (docs/benchmarks.md has the
// measured difference). Smaller allocations come from operator new. When the kernel has no huge
// page to give, the memory is ordinary memory: the advice is a hint, never a failure.
//
// LargeVector<T> is a std::vector with this allocator: the same interface, spans work as usual.
// Thread-safety: as std::allocator.
#pragma once

#include <cstddef>
#include <new>
#include <vector>

namespace sparsecar {

namespace detail {
inline constexpr size_t kHugePageBytes = size_t{2} << 20;
// Allocates `bytes` (>= kHugePageBytes) 2 MiB-aligned with huge-page advice; throws bad_alloc.
void* allocate_huge(size_t bytes);
void free_huge(void* p) noexcept;
}  // namespace detail

template <class T>
struct HugePageAllocator {
  using value_type = T;
  HugePageAllocator() = default;
  template <class U>
  explicit HugePageAllocator(const HugePageAllocator<U>& /*other*/) noexcept {}

  T* allocate(size_t n) {
    if (n > static_cast<size_t>(-1) / sizeof(T)) throw std::bad_array_new_length();
    const size_t bytes = n * sizeof(T);
    if (bytes >= detail::kHugePageBytes) return static_cast<T*>(detail::allocate_huge(bytes));
    return static_cast<T*>(::operator new(bytes, std::align_val_t{alignof(T) > 64 ? alignof(T) : 64}));
  }
  void deallocate(T* p, size_t n) noexcept {
    if (n * sizeof(T) >= detail::kHugePageBytes) {
      detail::free_huge(p);
    } else {
      ::operator delete(p, std::align_val_t{alignof(T) > 64 ? alignof(T) : 64});
    }
  }
  template <class U>
  bool operator==(const HugePageAllocator<U>& /*other*/) const noexcept {
    return true;
  }
};

template <class T>
using LargeVector = std::vector<T, HugePageAllocator<T>>;

}  // namespace sparsecar
