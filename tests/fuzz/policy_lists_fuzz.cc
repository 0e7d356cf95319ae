// libFuzzer target: the comma-list knobs the policies parse (policies/tensor_plan.h):
// `controller` (parse_controllers), `layerwise_sensitivity` (parse_sensitivity) and
// `tensor_density_scale` (parse_tensor_scales, which the frequency controller publishes in
// decisions and every node parses back). Their text comes from a config file, a flag, the
// control socket's `set` or a decision from rank 0.
//
// Input: byte 0 picks the parser (mod 3); the rest is the knob's text.
// Properties checked beyond "no crash, no sanitizer report":
//   - an error is kInvalidArgument;
//   - controllers: only known kinds are set, and format_controllers → parse gives the same set;
//   - sensitivity: every rule has a non-empty, trimmed pattern without ',' and a finite scale > 0
//     (or dense);
//   - tensor scales: every scale is finite and > 0, and the published text (format_tensor_scales)
//     parses back: format → parse → format is a fixed point with the same ids.
// Built by the clang fuzz project (tests/fuzz/CMakeLists.txt: fuzz_policy_lists); seeds in
// corpus/policy_lists/ (fuzz_make_parser_seeds).
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "sparsecar/policies/tensor_plan.h"

namespace {

namespace sp = sparsecar::policies;

#define CHECK(cond)                \
  do {                             \
    if (!(cond)) __builtin_trap(); \
  } while (0)

bool trimmed(const std::string& s) {
  return s.empty() || (s.front() != ' ' && s.front() != '\t' && s.back() != ' ' && s.back() != '\t');
}

void controllers(std::string_view text) {
  auto set = sp::parse_controllers(text);
  if (!set.ok()) {
    CHECK(set.status().code() == sparsecar::Code::kInvalidArgument);
    return;
  }
  CHECK((*set >> sp::kControllerKindCount) == 0 && (*set & 1u) == 0);  // bit 0 is `static`: never set
  auto again = sp::parse_controllers(sp::format_controllers(*set));
  CHECK(again.ok() && *again == *set);
}

void sensitivity(std::string_view text) {
  auto rules = sp::parse_sensitivity(text);
  if (!rules.ok()) {
    CHECK(rules.status().code() == sparsecar::Code::kInvalidArgument);
    return;
  }
  for (const sp::SensitivityRule& r : *rules) {
    CHECK(!r.pattern.empty() && trimmed(r.pattern) && r.pattern.find(',') == std::string::npos);
    CHECK(r.dense || (std::isfinite(r.scale) && r.scale > 0));
  }
}

void scales(std::string_view text) {
  auto parsed = sp::parse_tensor_scales(text);
  if (!parsed.ok()) {
    CHECK(parsed.status().code() == sparsecar::Code::kInvalidArgument);
    return;
  }
  for (const auto& [id, scale] : *parsed) CHECK(std::isfinite(scale) && scale > 0);
  const std::string published = sp::format_tensor_scales(*parsed);
  auto back = sp::parse_tensor_scales(published);
  CHECK(back.ok() && back->size() == parsed->size());
  for (auto a = parsed->begin(), b = back->begin(); a != parsed->end(); ++a, ++b) CHECK(a->first == b->first);
  CHECK(sp::format_tensor_scales(*back) == published);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 1) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  switch (data[0] % 3) {
    case 0: controllers(text); break;
    case 1: sensitivity(text); break;
    default: scales(text); break;
  }
  return 0;
}
