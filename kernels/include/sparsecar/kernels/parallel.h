// The optional thread count of the kernels: a caller-owned pool one kernel call can be split over.
//
// Kernels never start threads themselves. A caller that wants more than one core per call (the
// daemon's `kernel_threads` knob) owns a ThreadPool and passes it to the selection kernels
// (select.h) and decode_accumulate (codec.h); nullptr, or a pool of size 1,
// runs the call on the calling thread alone. Results are bit-identical for every thread count:
// a call splits its input into contiguous chunks, each chunk's output lands where the
// single-threaded pass would have put it, and anything order-dependent (tie-breaking, the running
// count of a compaction) is resolved by a prefix over the chunks in index order.
// Splitting pays only for large inputs: kernels stay on one thread below about
// kParallelMinElements per extra thread, where waking the workers costs more than it saves.
//
// Thread-safety: one run() at a time per pool (the daemon's pipeline thread owns its pool);
// run() returns only after every task has finished, so tasks may use the caller's stack.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace sparsecar::kernels {

inline constexpr size_t kParallelMinElements = size_t{1} << 18;  // 1 MiB of floats per thread
inline constexpr unsigned kMaxKernelThreads = 64;

class ThreadPool {
 public:
  // threads: how many threads work on one call, the caller included; clamped to
  // [1, kMaxKernelThreads]. threads - 1 workers are started here and joined by the destructor.
  explicit ThreadPool(unsigned threads);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  unsigned size() const { return static_cast<unsigned>(workers_.size()) + 1; }

  // Runs task(0) ... task(tasks - 1), at most size() at once (task 0 and any beyond the
  // workers on the calling thread), and returns when all have finished. tasks == 0 does nothing.
  void run(unsigned tasks, const std::function<void(unsigned)>& task);

 private:
  void work(unsigned worker);

  std::vector<std::thread> workers_;
  std::mutex mu_;
  std::condition_variable wake_;
  std::condition_variable done_;
  const std::function<void(unsigned)>* task_ = nullptr;
  unsigned tasks_ = 0;
  unsigned next_ = 0;        // next task to hand out
  unsigned finished_ = 0;    // tasks finished in this run
  unsigned long generation_ = 0;
  bool stop_ = false;
};

// How many chunks to split n units of work into: 1 without a pool, else up to pool->size() with
// at least min_per_chunk each (elements of a streaming pass by default; the decoders pass a
// smaller number of scattered entries, each a cache miss).
unsigned chunk_count(const ThreadPool* pool, size_t n, size_t min_per_chunk = kParallelMinElements);
// Runs task(c) for c in [0, chunks): on the pool, or inline when chunks == 1 or there is none
// (then without wrapping the task in a std::function: no allocation on the one-thread path).
template <class Task>
void run_chunks(ThreadPool* pool, unsigned chunks, const Task& task) {
  if (chunks <= 1 || pool == nullptr) {
    for (unsigned c = 0; c < chunks; ++c) task(c);
    return;
  }
  pool->run(chunks, task);
}
// [begin, end) of chunk c of `chunks` over n elements, boundaries rounded to multiples of 16
// elements (whole cache lines and vectors).
size_t chunk_begin(size_t n, unsigned chunks, unsigned c);

}  // namespace sparsecar::kernels
