#include "sparsecar/kernels/parallel.h"

#include <algorithm>

namespace sparsecar::kernels {

ThreadPool::ThreadPool(unsigned threads) {
  const unsigned total = std::clamp(threads, 1u, kMaxKernelThreads);
  workers_.reserve(total - 1);
  for (unsigned w = 0; w + 1 < total; ++w) workers_.emplace_back([this, w] { work(w); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  wake_.notify_all();
  for (std::thread& t : workers_) t.join();
}

void ThreadPool::run(unsigned tasks, const std::function<void(unsigned)>& task) {
  if (tasks == 0) return;
  if (workers_.empty() || tasks == 1) {
    for (unsigned t = 0; t < tasks; ++t) task(t);
    return;
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    task_ = &task;
    tasks_ = tasks;
    next_ = 0;
    finished_ = 0;
    ++generation_;
  }
  wake_.notify_all();
  // The caller takes tasks too, so a run finishes even if no worker wakes in time.
  for (;;) {
    unsigned t = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (next_ >= tasks_) break;
      t = next_++;
    }
    task(t);
    std::lock_guard<std::mutex> lock(mu_);
    ++finished_;
  }
  std::unique_lock<std::mutex> lock(mu_);
  done_.wait(lock, [this] { return finished_ == tasks_; });
  task_ = nullptr;
}

void ThreadPool::work(unsigned /*worker*/) {
  unsigned long seen = 0;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    wake_.wait(lock, [&] { return stop_ || (generation_ != seen && next_ < tasks_); });
    if (stop_) return;
    seen = generation_;
    while (next_ < tasks_) {
      const unsigned t = next_++;
      const std::function<void(unsigned)>* task = task_;
      lock.unlock();
      (*task)(t);
      lock.lock();
      if (++finished_ == tasks_) done_.notify_all();
    }
  }
}

unsigned chunk_count(const ThreadPool* pool, size_t n, size_t min_per_chunk) {
  if (pool == nullptr || pool->size() <= 1) return 1;
  const size_t by_size = std::max<size_t>(1, n / std::max<size_t>(1, min_per_chunk));
  return static_cast<unsigned>(std::min<size_t>(pool->size(), by_size));
}

size_t chunk_begin(size_t n, unsigned chunks, unsigned c) {
  if (c >= chunks) return n;
  const size_t raw = static_cast<size_t>((static_cast<unsigned __int128>(n) * c) / chunks);
  return std::min(n, raw / 16 * 16);
}

}  // namespace sparsecar::kernels
