// StepResults: a StepResultSink for pipeline tests that keeps every result until a test takes
// it with wait(tensor, step) (bounded: 20 s, then a test failure and an INTERNAL result).
#pragma once

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <set>
#include <utility>

#include "daemon/pipeline/step.h"

namespace sparsecar::fakes {

class StepResults final : public StepResultSink {
 public:
  void complete(const StepResult& r) override {
    std::lock_guard<std::mutex> lock(mu_);
    results_[{r.tensor_id, r.step}] = r;
    completed_.insert({r.tensor_id, r.step});
    cv_.notify_all();
  }

  // Whether the result came (taken by wait() or not).
  bool completed(uint32_t tensor, uint64_t step) {
    std::lock_guard<std::mutex> lock(mu_);
    return completed_.count({tensor, step}) > 0;
  }

  StepResult wait(uint32_t tensor, uint64_t step) {
    std::unique_lock<std::mutex> lock(mu_);
    const bool got = cv_.wait_for(lock, std::chrono::seconds(20), [&] { return results_.count({tensor, step}) > 0; });
    EXPECT_TRUE(got) << "no result for tensor " << tensor << " step " << step;
    if (!got) {
      StepResult timeout;
      timeout.tensor_id = tensor;
      timeout.step = step;
      timeout.status = internal_error("test timeout");
      return timeout;
    }
    StepResult r = results_[{tensor, step}];
    results_.erase({tensor, step});
    return r;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::map<std::pair<uint32_t, uint64_t>, StepResult> results_;
  std::set<std::pair<uint32_t, uint64_t>> completed_;
};

}  // namespace sparsecar::fakes
