// libFuzzer target: a peer's observation text (daemon/pipeline/observations.h parse_observation),
// the kObservation payload every node sends rank 0 once per step.
//
// Properties checked beyond "no crash, no sanitizer report" (UBSan includes float-cast-overflow,
// so a peer's number that does not fit its field must be refused, not cast):
//   - an error is kDataLoss;
//   - at most 2^20 tensor lines are accepted;
//   - parse → format → parse accepts its own output and is a fixed point: every field comes back
//     bit for bit except repeat_fraction (formatted with 9 digits), and formatting again gives
//     the same text;
//   - rank 0 merges it with its own observation (policies::merge_observations) without a fault.
// Built by the clang fuzz project (tests/fuzz/CMakeLists.txt: fuzz_observation); seeds in
// corpus/observation/ (format_observation output, written by fuzz_make_parser_seeds).
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>

#include "daemon/pipeline/observations.h"

namespace {

#define CHECK(cond)                \
  do {                             \
    if (!(cond)) __builtin_trap(); \
  } while (0)

bool same_bits(double a, double b) { return std::memcmp(&a, &b, sizeof a) == 0; }

bool same_scalars(const sparsecar::policies::NodeObservation& a, const sparsecar::policies::NodeObservation& b) {
  return a.rank == b.rank && a.step == b.step && a.elements == b.elements && a.nnz == b.nnz &&
         a.bytes_sent == b.bytes_sent && a.dense_bytes == b.dense_bytes && same_bits(a.exchange_s, b.exchange_s) &&
         same_bits(a.encode_s, b.encode_s) && a.link_bytes == b.link_bytes && same_bits(a.link_s, b.link_s) &&
         same_bits(a.grad_norm2, b.grad_norm2) && same_bits(a.residual_norm2, b.residual_norm2) &&
         same_bits(a.compute_s, b.compute_s) && a.has_loss == b.has_loss &&
         (!a.has_loss || same_bits(a.loss, b.loss)) && a.has_loss_target == b.has_loss_target &&
         (!a.has_loss_target || same_bits(a.loss_target, b.loss_target));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace sparsecar;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto parsed = parse_observation(text);
  if (!parsed.ok()) {
    CHECK(parsed.status().code() == Code::kDataLoss);
    return 0;
  }
  const policies::NodeObservation& o = *parsed;
  CHECK(o.tensors.size() <= (size_t{1} << 20));

  const std::string formatted = format_observation(o);
  auto again = parse_observation(formatted);
  CHECK(again.ok());
  CHECK(same_scalars(o, *again));
  CHECK(again->tensors.size() == o.tensors.size());
  for (size_t i = 0; i < o.tensors.size(); ++i) {
    const auto& a = o.tensors[i];
    const auto& b = again->tensors[i];
    CHECK(a.tensor_id == b.tensor_id && a.elements == b.elements && a.nnz == b.nnz);
  }
  CHECK(format_observation(*again) == formatted);

  policies::NodeObservation mine;
  mine.step = o.step;
  const policies::NodeObservation both[2] = {mine, o};
  const policies::JobObservation job = policies::merge_observations(both, 2);
  CHECK(job.nodes == 2);
  return 0;
}
