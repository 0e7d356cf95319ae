// The model and data of the logistic-regression example: a seeded synthetic problem shaped like
// gisette (5,000 sparse non-negative features in [0, 1], of which only a few carry the label and
// the rest are "probes"), the loss, the minibatch gradient, and an in-process simulation of
// Top-k with error feedback for the trainer's --local mode.
//
// Everything is a pure function of the seed, so every trainer of a job builds the same data and
// takes its own shard (sample i belongs to rank i mod world). Random numbers come from our own
// splitmix64, not from <random>'s distributions, so the data does not depend on the standard
// library. Thread-safety: plain values; no shared state.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

namespace logreg {

struct ProblemOptions {
  size_t features = 5000;
  size_t samples = 4000;
  size_t informative = 20;           // features that carry the label; the rest are probes
  double informative_density = 0.5;  // fraction of samples in which an informative feature is set
  double probe_density = 0.12;       // fraction of samples in which a probe is set
  double signal = 3.0;               // scale of the hidden weights (higher = less label noise)
  double label_noise = 0.0;          // fraction of labels flipped on top of the logistic model
  uint64_t seed = 1;
};

// Samples in CSR form; labels in {0, 1}, drawn from a hidden logistic model over the informative
// features: P(y = 1 | x) = sigmoid(w*.x - mean score), w*_j ~ signal * N(0, 1).
struct Dataset {
  size_t features = 0;
  std::vector<uint32_t> row_begin;  // rows() + 1 offsets into index/value
  std::vector<uint32_t> index;
  std::vector<float> value;
  std::vector<float> label;
  size_t rows() const { return label.size(); }
  size_t nnz() const { return index.size(); }
};

Dataset make_gisette_like(const ProblemOptions& options);

// Moves the last `count` samples of `data` into a new Dataset (a held-out set).
Dataset split_tail(Dataset& data, size_t count);

struct Model {
  std::vector<float> weight;
  float bias = 0.0f;
};

// Mean logistic loss over every sample; writes the accuracy when `accuracy` is not null.
double mean_loss(const Dataset& data, const Model& model, double* accuracy = nullptr);

// Gradient of the mean logistic loss over `rows`: overwrites grad_weight (features elements)
// and *grad_bias.
void minibatch_gradient(const Dataset& data, const Model& model, std::span<const uint32_t> rows,
                        std::span<float> grad_weight, float* grad_bias);

// grad_weight += l2 * weight (the bias is not penalised).
void add_l2(const Model& model, float l2, std::span<float> grad_weight);

// Plain SGD: model -= lr * gradient.
void sgd_update(Model& model, std::span<const float> grad_weight, float grad_bias, float lr);

// Minibatches of one rank's shard (samples i with i % world == rank), reshuffled each epoch.
class ShardSampler {
 public:
  ShardSampler(size_t samples, uint32_t rank, uint32_t world, size_t batch, uint64_t seed);
  std::span<const uint32_t> next();
  size_t shard_size() const { return shard_.size(); }

 private:
  void shuffle();
  std::vector<uint32_t> shard_;
  std::vector<uint32_t> batch_;
  size_t cursor_ = 0;
  size_t batch_size_;
  uint64_t rng_;
};

// One node's Top-k with error feedback, as the daemon does it (local simulation only):
//   residual += grad; keep the k largest |residual_i|; grad = those (zeros elsewhere);
//   residual -= kept. Returns k.
class TopkErrorFeedback {
 public:
  TopkErrorFeedback(size_t n, double density);
  size_t compress(std::span<float> grad);
  size_t k() const { return k_; }

 private:
  std::vector<float> residual_;
  std::vector<uint32_t> order_;
  size_t k_;
};

// Same rule as the daemon: max(1, round(density * n)), capped at n.
size_t topk_count(size_t n, double density);

}  // namespace logreg
