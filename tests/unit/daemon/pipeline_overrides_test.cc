// Per-tensor overrides through the whole data path: a job whose knobs are set the way the daemon
// sets them (set_knob + settings_from_config) with tensor_overrides giving two tensors their own
// format, block size and value type; what goes over the (fake) wire and what every node gets
// back are checked against expectations worked out by hand from the inputs and WIRE.md.
#include <gtest/gtest.h>

#include <map>
#include <mutex>
#include <vector>

#include "daemon/config/knobs.h"
#include "daemon/pipeline/settings.h"
#include "daemon/transport/wire.h"
#include "tests/unit/daemon/pipeline_job.h"

namespace sparsecar {
namespace {

using namespace std::chrono_literals;

struct SeenMessage {
  uint16_t format;
  uint16_t value_type;
  uint64_t dense_len;
  uint64_t nnz;
  uint64_t payload_bytes;
};

// The data messages seen on the wire, by tensor.
class WireLog {
 public:
  void tap(fakes::FakeNetwork& net) {
    net.set_tap([this](uint32_t, uint32_t, std::span<const std::byte> header, std::span<const std::byte>) {
      if (header.size() != wire::kHeaderBytes) return;
      const wire::WireHeader h =
          wire::decode_header(std::span<const std::byte, wire::kHeaderBytes>(header.data(), wire::kHeaderBytes));
      if (h.kind != static_cast<uint16_t>(wire::Kind::kData)) return;
      std::lock_guard<std::mutex> lock(mu_);
      by_tensor_[h.tensor_id].push_back({h.format, h.value_type, h.dense_len, h.nnz, h.payload_bytes});
    });
  }
  std::vector<SeenMessage> of(uint32_t tensor) {
    std::lock_guard<std::mutex> lock(mu_);
    return by_tensor_[tensor];
  }

 private:
  std::mutex mu_;
  std::map<uint32_t, std::vector<SeenMessage>> by_tensor_;
};

// The result every node must get: the input where the kept blocks lie, zero elsewhere (both
// nodes send the same values; the average of two equal contributions is the value).
std::vector<float> kept_only(const std::vector<float>& v, const std::vector<std::pair<size_t, size_t>>& ranges) {
  std::vector<float> out(v.size(), 0.0f);
  for (auto [from, to] : ranges) {
    for (size_t i = from; i < to; ++i) out[i] = v[i];
  }
  return out;
}

TEST(PipelineOverrides, TwoTensorsOfOneJobUseTheirOwnFormatBlockSizeAndValueType) {
  Config config;
  ASSERT_TRUE(set_knob(config, "selector", "block_topk").ok());
  ASSERT_TRUE(set_knob(config, "density", "0.25").ok());
  ASSERT_TRUE(set_knob(config, "block_size", "64").ok());
  ASSERT_TRUE(set_knob(config, "format", "coo").ok());
  ASSERT_TRUE(set_knob(config, "value_type", "fp32").ok());
  ASSERT_TRUE(set_knob(config, "tensor_overrides",
                       "emb*: format=bitmap, block_size=128; fc*: block_size=32, value_type=fp16")
                  .ok());
  ASSERT_TRUE(validate(config).ok());
  PipelineOptions options;
  options.settings = settings_from_config(config);
  options.step_timeout = 5000ms;
  options.join_timeout = 5000ms;
  fakes::PipelineJob job(2, options);
  WireLog log;
  log.tap(job.net);

  constexpr size_t n = 1024;
  // emb.weight and fc.weight share one input. In 32-element sub-blocks s: s % 4 == 1 holds 10
  // (one "spike" sub-block in every 128 elements); elsewhere 6 in the last 256 elements, 1 before.
  //   32-blocks (fc, block_size 32): the 8 spikes (L2^2 3200) beat everything else (<= 1152);
  //     32 blocks at density 0.25 keep 8: [32 + 128 j, 64 + 128 j) for j = 0..7.
  //   128-blocks (emb, block_size 128): 3200 + 96 * 36 = 6656 for the last two, 3296 for the
  //     others; 8 blocks at density 0.25 keep 2: [768, 1024).
  std::vector<float> shared(n);
  for (size_t i = 0; i < n; ++i) shared[i] = (i / 32) % 4 == 1 ? 10.0f : (i >= 768 ? 6.0f : 1.0f);
  // head.weight (no rule: the global block_size 64): 64-block k holds 10 + k for odd k, 1 for
  // even k. The best 4 of 16 are k = 15, 13, 11, 9 (a block size of 128 would have kept
  // [768, 1024) whole instead).
  std::vector<float> head(n);
  for (size_t i = 0; i < n; ++i) head[i] = (i / 64) % 2 == 1 ? 10.0f + static_cast<float>(i / 64) : 1.0f;

  const char* names[] = {"emb.weight", "fc.weight", "head.weight"};
  for (auto& node : job.nodes) {
    for (uint32_t t = 0; t < 3; ++t) ASSERT_TRUE(node->pipeline->register_tensor(t, TensorSpec{names[t], n}).ok());
  }
  std::vector<std::pair<size_t, size_t>> fc_blocks, head_blocks;
  for (size_t j = 0; j < 8; ++j) fc_blocks.emplace_back(32 + 128 * j, 64 + 128 * j);
  for (size_t k : {9, 11, 13, 15}) head_blocks.emplace_back(64 * k, 64 * k + 64);
  const std::vector<float> expected[] = {kept_only(shared, {{768, 1024}}), kept_only(shared, fc_blocks),
                                         kept_only(head, head_blocks)};
  // WIRE.md: format ids coo 1, bitmap 3; value types fp32 0 (4 bytes), fp16 1 (2 bytes).
  // Payload sizes for n = 1024, k = 256: bitmap n/8 + 4k, coo 4k + 2k (fp16), coo 4k + 4k (fp32).
  const SeenMessage wire_expected[] = {{3, 0, n, 256, 128 + 4 * 256},
                                       {1, 1, n, 256, 4 * 256 + 2 * 256},
                                       {1, 0, n, 256, 4 * 256 + 4 * 256}};

  for (uint32_t t = 0; t < 3; ++t) {
    SCOPED_TRACE(names[t]);
    const std::vector<float>& input = t == 2 ? head : shared;
    std::vector<std::vector<float>> out;
    auto results = fakes::run_step(job, t, 0, {input, input}, out);
    for (uint32_t r = 0; r < 2; ++r) {
      ASSERT_TRUE(results[r].status.ok()) << results[r].status.to_string();
      EXPECT_EQ(results[r].nnz, 256u);
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(out[r][i], expected[t][i]) << "rank " << r << " element " << i;
    }
    const auto seen = log.of(t);
    ASSERT_EQ(seen.size(), 2u) << "one data message each way";
    for (const SeenMessage& m : seen) {
      EXPECT_EQ(m.format, wire_expected[t].format);
      EXPECT_EQ(m.value_type, wire_expected[t].value_type);
      EXPECT_EQ(m.dense_len, wire_expected[t].dense_len);
      EXPECT_EQ(m.nnz, wire_expected[t].nnz);
      EXPECT_EQ(m.payload_bytes, wire_expected[t].payload_bytes);
    }
  }
}

}  // namespace
}  // namespace sparsecar
