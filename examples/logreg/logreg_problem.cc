#include "logreg_problem.h"

#include <algorithm>
#include <cmath>
#include <numeric>

namespace logreg {
namespace {

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

// Uniform in [0, 1).
double uniform(uint64_t& state) {
  return static_cast<double>(splitmix64(state) >> 11) * (1.0 / 9007199254740992.0);
}

double normal(uint64_t& state) {
  double u1 = uniform(state);
  double u2 = uniform(state);
  return std::sqrt(-2.0 * std::log(1.0 - u1)) * std::cos(6.283185307179586 * u2);
}

template <typename T>
void shuffle_in_place(std::vector<T>& v, uint64_t& state) {
  for (size_t i = v.size(); i > 1; --i) {
    size_t j = static_cast<size_t>(splitmix64(state) % i);
    std::swap(v[i - 1], v[j]);
  }
}

double logistic_loss(double z, double y) {
  // log(1 + exp(z)) - y*z, stable for large |z|.
  return std::log1p(std::exp(-std::fabs(z))) + std::max(z, 0.0) - y * z;
}

double sigmoid(double z) {
  if (z >= 0) return 1.0 / (1.0 + std::exp(-z));
  double e = std::exp(z);
  return e / (1.0 + e);
}

double row_dot(const Dataset& data, const Model& model, size_t row) {
  double z = model.bias;
  for (uint32_t p = data.row_begin[row]; p < data.row_begin[row + 1]; ++p) {
    z += static_cast<double>(model.weight[data.index[p]]) * data.value[p];
  }
  return z;
}

}  // namespace

Dataset make_gisette_like(const ProblemOptions& o) {
  uint64_t rng = o.seed * 0x2545f4914f6cdd1dULL + 17;
  Dataset d;
  d.features = o.features;

  // Which features are informative (a random subset) and the hidden weights they carry.
  std::vector<uint32_t> perm(o.features);
  std::iota(perm.begin(), perm.end(), 0u);
  shuffle_in_place(perm, rng);
  std::vector<double> hidden(o.features, 0.0);
  std::vector<char> informative(o.features, 0);
  for (size_t j = 0; j < std::min(o.informative, o.features); ++j) {
    informative[perm[j]] = 1;
    hidden[perm[j]] = o.signal * normal(rng);
  }

  // Samples: each feature is set with its density. Informative values lie in [0.5, 1]; probe
  // values are skewed towards 0 (most set pixels are faint), like gisette's scaled features.
  std::vector<double> score(o.samples);
  d.row_begin.reserve(o.samples + 1);
  d.row_begin.push_back(0);
  for (size_t i = 0; i < o.samples; ++i) {
    double s = 0.0;
    for (size_t j = 0; j < o.features; ++j) {
      double density = informative[j] ? o.informative_density : o.probe_density;
      if (uniform(rng) >= density) continue;
      double u = 1.0 - uniform(rng);  // (0, 1]
      float v = static_cast<float>(informative[j] ? 0.5 + 0.5 * u : u * u * u * u);
      d.index.push_back(static_cast<uint32_t>(j));
      d.value.push_back(v);
      s += hidden[j] * v;
    }
    score[i] = s;
    d.row_begin.push_back(static_cast<uint32_t>(d.index.size()));
  }

  // Labels from the hidden logistic model around the mean score (balanced classes), then a
  // fraction flipped outright.
  double mean = 0.0;
  for (double s : score) mean += s;
  mean /= static_cast<double>(std::max<size_t>(1, o.samples));
  d.label.resize(o.samples);
  for (size_t i = 0; i < o.samples; ++i) {
    bool positive = uniform(rng) < sigmoid(score[i] - mean);
    if (uniform(rng) < o.label_noise) positive = !positive;
    d.label[i] = positive ? 1.0f : 0.0f;
  }
  return d;
}

Dataset split_tail(Dataset& data, size_t count) {
  count = std::min(count, data.rows());
  size_t first = data.rows() - count;
  Dataset tail;
  tail.features = data.features;
  uint32_t base = data.row_begin[first];
  for (size_t i = first; i <= data.rows(); ++i) tail.row_begin.push_back(data.row_begin[i] - base);
  tail.index.assign(data.index.begin() + base, data.index.end());
  tail.value.assign(data.value.begin() + base, data.value.end());
  tail.label.assign(data.label.begin() + static_cast<long>(first), data.label.end());
  data.row_begin.resize(first + 1);
  data.index.resize(base);
  data.value.resize(base);
  data.label.resize(first);
  return tail;
}

double mean_loss(const Dataset& data, const Model& model, double* accuracy) {
  double total = 0.0;
  size_t correct = 0;
  for (size_t i = 0; i < data.rows(); ++i) {
    double z = row_dot(data, model, i);
    total += logistic_loss(z, data.label[i]);
    correct += ((z > 0) == (data.label[i] > 0.5f)) ? 1 : 0;
  }
  size_t n = std::max<size_t>(1, data.rows());
  if (accuracy != nullptr) *accuracy = static_cast<double>(correct) / static_cast<double>(n);
  return total / static_cast<double>(n);
}

void minibatch_gradient(const Dataset& data, const Model& model, std::span<const uint32_t> rows,
                        std::span<float> grad_weight, float* grad_bias) {
  std::fill(grad_weight.begin(), grad_weight.end(), 0.0f);
  double gb = 0.0;
  double scale = rows.empty() ? 0.0 : 1.0 / static_cast<double>(rows.size());
  for (uint32_t row : rows) {
    double r = (sigmoid(row_dot(data, model, row)) - data.label[row]) * scale;
    for (uint32_t p = data.row_begin[row]; p < data.row_begin[row + 1]; ++p) {
      grad_weight[data.index[p]] += static_cast<float>(r * data.value[p]);
    }
    gb += r;
  }
  *grad_bias = static_cast<float>(gb);
}

void add_l2(const Model& model, float l2, std::span<float> grad_weight) {
  if (l2 == 0.0f) return;
  for (size_t j = 0; j < grad_weight.size(); ++j) grad_weight[j] += l2 * model.weight[j];
}

void sgd_update(Model& model, std::span<const float> grad_weight, float grad_bias, float lr) {
  for (size_t j = 0; j < model.weight.size(); ++j) model.weight[j] -= lr * grad_weight[j];
  model.bias -= lr * grad_bias;
}

ShardSampler::ShardSampler(size_t samples, uint32_t rank, uint32_t world, size_t batch,
                           uint64_t seed)
    : batch_size_(std::max<size_t>(1, batch)), rng_(seed * 0x9e3779b97f4a7c15ULL + rank + 1) {
  for (size_t i = rank; i < samples; i += world) shard_.push_back(static_cast<uint32_t>(i));
  shuffle();
}

void ShardSampler::shuffle() {
  shuffle_in_place(shard_, rng_);
  cursor_ = 0;
}

std::span<const uint32_t> ShardSampler::next() {
  batch_.clear();
  while (batch_.size() < batch_size_ && !shard_.empty()) {
    if (cursor_ == shard_.size()) shuffle();
    batch_.push_back(shard_[cursor_++]);
  }
  return batch_;
}

size_t topk_count(size_t n, double density) {
  if (n == 0) return 0;
  auto k = static_cast<size_t>(std::llround(density * static_cast<double>(n)));
  return std::clamp<size_t>(k, 1, n);
}

TopkErrorFeedback::TopkErrorFeedback(size_t n, double density)
    : residual_(n, 0.0f), order_(n), k_(topk_count(n, density)) {}

size_t TopkErrorFeedback::compress(std::span<float> grad) {
  for (size_t i = 0; i < grad.size(); ++i) residual_[i] += grad[i];
  std::iota(order_.begin(), order_.end(), 0u);
  auto bigger = [&](uint32_t a, uint32_t b) {
    float fa = std::fabs(residual_[a]), fb = std::fabs(residual_[b]);
    return fa != fb ? fa > fb : a < b;
  };
  std::nth_element(order_.begin(), order_.begin() + static_cast<long>(k_ - 1), order_.end(), bigger);
  std::fill(grad.begin(), grad.end(), 0.0f);
  for (size_t j = 0; j < k_; ++j) {
    grad[order_[j]] = residual_[order_[j]];
    residual_[order_[j]] = 0.0f;
  }
  return k_;
}

}  // namespace logreg
