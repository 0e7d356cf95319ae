// Error-compensation building blocks (see ef.h). Plain loops: the compiler vectorises them for
// the baseline ISA; they run once per step next to a selection that dominates.
#include "sparsecar/kernels/ef.h"

#include <cmath>

#include "sparsecar/common/log.h"

namespace sparsecar::kernels {

void ef_accumulate_scaled(std::span<float> residual, std::span<const float> grad, float factor) {
  SC_CHECK(residual.size() == grad.size(), "ef_accumulate_scaled: %zu vs %zu elements",
           residual.size(), grad.size());
  float* r = residual.data();
  const float* g = grad.data();
  const size_t n = residual.size();
  if (factor == 1.0f) {
    for (size_t i = 0; i < n; ++i) r[i] += g[i];
  } else {
    for (size_t i = 0; i < n; ++i) r[i] += factor * g[i];
  }
}

void momentum_accumulate(std::span<float> velocity, std::span<float> residual,
                         std::span<const float> grad, float momentum, float factor) {
  SC_CHECK(velocity.size() == grad.size() && residual.size() == grad.size(),
           "momentum_accumulate: %zu/%zu/%zu elements", velocity.size(), residual.size(),
           grad.size());
  float* u = velocity.data();
  float* v = residual.data();
  const float* g = grad.data();
  const size_t n = grad.size();
  for (size_t i = 0; i < n; ++i) {
    const float ui = momentum * u[i] + factor * g[i];
    u[i] = ui;
    v[i] += ui;
  }
}

void subtract_selected(std::span<float> residual, std::span<const uint32_t> index,
                       std::span<const float> value) {
  SC_CHECK(index.size() == value.size(), "subtract_selected: %zu indices, %zu values",
           index.size(), value.size());
  const size_t n = residual.size();
  for (size_t j = 0; j < index.size(); ++j) {
    SC_CHECK(index[j] < n, "subtract_selected: index %u outside %zu elements", index[j], n);
    residual[index[j]] -= value[j];
  }
}

void add_selected(std::span<float> residual, std::span<const uint32_t> index,
                  std::span<const float> value) {
  SC_CHECK(index.size() == value.size(), "add_selected: %zu indices, %zu values", index.size(),
           value.size());
  const size_t n = residual.size();
  for (size_t j = 0; j < index.size(); ++j) {
    SC_CHECK(index[j] < n, "add_selected: index %u outside %zu elements", index[j], n);
    residual[index[j]] += value[j];
  }
}

double norm2(std::span<const float> x) {
  double s = 0.0;
  for (const float v : x) s += static_cast<double>(v) * static_cast<double>(v);
  return s;
}

float clip_factor(double norm, double max_norm) {
  if (!(max_norm > 0.0) || !(norm > max_norm) || !std::isfinite(norm)) return 1.0f;
  return static_cast<float>(max_norm / norm);
}

}  // namespace sparsecar::kernels
