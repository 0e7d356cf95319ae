// The budget controller: the hard-threshold selector, lambda moved so that the volume sent over
// the run tracks a total budget. Its row: controllers.cc.
#include "controller_internal.h"

#include <algorithm>
#include <cmath>
#include <memory>

namespace sparsecar::policies {
namespace {

class BudgetController final : public Controller {
 public:
  ControllerKind kind() const override { return ControllerKind::kBudget; }
  uint32_t version() const override { return 1; }
  Status update(const ControlContext& ctx, ControlKnobs* knobs) override {
    const auto& s = ctx.settings;
    const auto& o = ctx.obs;
    if (s.budget.total_elements <= 0 || s.budget.steps == 0) return Status::Ok();
    knobs->selector = kernels::Selector::kThreshold;
    if (!init_) {
      lambda_ = initial_ = knobs->threshold;
      init_ = true;
      // Taking over (selector -> threshold) is a change too: what was sent before says nothing
      // about this lambda.
      changed_ = true;
      last_change_ = o.step;
    }
    used_ += o.nnz;
    ctx.status->budget_used_elements = used_;
    // Rate of the lambda in force: an EMA of nnz (error feedback makes the first steps after a
    // change a transient: a higher lambda sends little until the residual has grown).
    // Observations of the two steps after a change still ran under the old lambda (decision latency).
    if (!changed_ || o.step >= last_change_ + 2) {
      rate_ = rate_n_ == 0 ? o.nnz : 0.4 * o.nnz + 0.6 * rate_;
      ++rate_n_;
    }
    const uint64_t done = o.step + 1;
    const bool settling = changed_ && o.step < last_change_ + std::max<uint64_t>(s.budget.settle_steps, 2);
    if (done < s.budget.steps && !settling && rate_n_ > 0) {
      // What is left of the budget, spread over what is left of the run: cumulative volume
      // tracks the budget because every overshoot or undershoot is paid back over the rest.
      const double remaining = static_cast<double>(s.budget.steps - done);
      const double target_rate = std::max(s.budget.total_elements - used_, 0.0) / remaining;
      // Newton steps in log(lambda) on log(rate / wanted rate). The slope of log nnz against
      // log lambda is measured from the last two lambdas (secant; it is about -1 for error
      // feedback in steady state, steeper on a real gradient's tail) so a steep curve does not
      // make the loop oscillate. Full steps until within 1.5x (calibration), then half steps of
      // at most 10 %.
      double log_ratio;
      if (target_rate <= 0) {
        log_ratio = 2.0;  // budget spent: send as little as possible
      } else if (rate_ <= 0) {
        log_ratio = -2.0;
      } else {
        log_ratio = std::clamp(std::log(rate_ / target_rate), -3.0, 3.0);
      }
      if (has_prev_ && rate_ > 0) {
        const double dl = std::log(lambda_) - prev_log_lambda_;
        if (std::fabs(dl) > 1e-3) {
          const double measured = -(std::log(rate_) - prev_log_rate_) / dl;
          if (std::isfinite(measured)) elasticity_ = std::clamp(0.5 * elasticity_ + 0.5 * measured, 0.5, 5.0);
        }
      }
      if (!calibrated_ && std::fabs(log_ratio) < std::log(1.5)) calibrated_ = true;
      double factor = std::exp((calibrated_ ? 0.5 : 1.0) * log_ratio / elasticity_);
      if (calibrated_) factor = std::clamp(factor, 1.0 / 1.1, 1.1);
      if (std::fabs(std::log(factor)) > std::log1p(s.controller_hysteresis / 4)) {
        if (rate_ > 0) {
          has_prev_ = true;
          prev_log_lambda_ = std::log(lambda_);
          prev_log_rate_ = std::log(rate_);
        }
        lambda_ = std::clamp(lambda_ * factor, initial_ * 1e-6, initial_ * 1e6);
        changed_ = true;
        last_change_ = o.step;
        rate_n_ = 0;
      }
    }
    knobs->threshold = lambda_;
    return Status::Ok();
  }

 private:
  bool init_ = false;
  bool calibrated_ = false;
  bool changed_ = false;
  double lambda_ = 0;
  double initial_ = 0;
  double elasticity_ = 1.0;  // -d log nnz / d log lambda
  bool has_prev_ = false;
  double prev_log_lambda_ = 0, prev_log_rate_ = 0;
  double used_ = 0;
  double rate_ = 0;
  uint64_t rate_n_ = 0;
  uint64_t last_change_ = 0;
};

}  // namespace

std::unique_ptr<Controller> make_budget_controller() { return std::make_unique<BudgetController>(); }

}  // namespace sparsecar::policies
