// libFuzzer target: the `tensor_overrides` knob (policies/overrides.h parse_tensor_overrides) and
// its glob matcher. The text comes from a config file, a flag or the control socket's `set`.
//
// Properties checked beyond "no crash, no sanitizer report":
//   - an error is kInvalidArgument;
//   - every rule has a non-empty, trimmed glob without ':' or ';' and sets at least one key; every
//     number is finite and inside the range of its knob (the selector registry's kSelectorParams,
//     compression_knobs.h); format=auto and a named format are exclusive;
//   - parse → format (below, in the documented text form) → parse gives the same rules;
//   - glob_match (fnmatch) agrees with a simple dynamic-programming matcher of '*' and '?', on
//     each rule's glob against the other globs and against a name taken from the input; a glob
//     matches itself (both only for globs without '[' or '\', which the matcher does not model).
// Built by the clang fuzz project (tests/fuzz/CMakeLists.txt: fuzz_tensor_overrides); seeds in
// corpus/tensor_overrides/ (fuzz_make_parser_seeds).
#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <vector>

#include "sparsecar/policies/overrides.h"

namespace {

namespace sp = sparsecar::policies;
namespace sk = sparsecar::kernels;

#define CHECK(cond)                \
  do {                             \
    if (!(cond)) __builtin_trap(); \
  } while (0)

std::string number(double v) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.17g", v);
  return buf;
}

// One rule in the documented text form.
std::string format_rule(const sp::TensorOverride& o) {
  std::vector<std::string> items;
  auto add = [&](const char* key, const std::string& value) { items.push_back(std::string(key) + "=" + value); };
  if (o.compression) add("compression", *o.compression ? "on" : "off");
  if (o.selector) add("selector", std::string(sk::selector_name(*o.selector)));
  for (const sk::ParamInfo& p : sk::kSelectorParams) {
    if (!o.sets(p.param)) continue;
    const sk::ParamValue v = sk::get_param(o.params, p.param);
    switch (p.type) {
      case sk::ParamType::kNumber: add(p.name, number(v.number)); break;
      case sk::ParamType::kUint: add(p.name, std::to_string(v.integer)); break;
      case sk::ParamType::kChoice: add(p.name, std::string(sk::param_choice(p, v.integer))); break;
    }
  }
  if (o.auto_format && *o.auto_format) add("format", "auto");
  if (o.format) add("format", std::string(sk::format_name(*o.format)));
  if (o.value_type) add("value_type", std::string(sk::value_type_name(*o.value_type)));
  if (o.error_feedback) add("error_feedback", std::string(sp::error_feedback_name(*o.error_feedback)));
  if (o.momentum) add("momentum", number(*o.momentum));
  if (o.clip_norm) add("clip_norm", number(*o.clip_norm));
  std::string out = o.glob + ":";
  for (size_t i = 0; i < items.size(); ++i) out += (i ? ", " : " ") + items[i];
  return out;
}

bool same(const sp::TensorOverride& a, const sp::TensorOverride& b) {
  return a.glob == b.glob && a.compression == b.compression && a.selector == b.selector &&
         a.params_set == b.params_set && a.params == b.params && a.format == b.format &&
         a.auto_format == b.auto_format && a.value_type == b.value_type && a.error_feedback == b.error_feedback &&
         a.momentum == b.momentum && a.clip_norm == b.clip_norm;
}

// Every selector parameter the rule sets is a value its row allows (finite, in range, a choice).
bool params_in_range(const sp::TensorOverride& o) {
  for (const sk::ParamInfo& p : sk::kSelectorParams) {
    if (!o.sets(p.param)) continue;
    if (!p.per_tensor) return false;
    const sk::ParamValue v = sk::get_param(o.params, p.param);
    const double x = p.type == sk::ParamType::kNumber ? v.number : static_cast<double>(v.integer);
    if (p.type == sk::ParamType::kChoice) {
      if (sk::param_choice(p, v.integer).empty()) return false;
    } else if (!std::isfinite(x) || x < p.min || x > p.max) {
      return false;
    }
  }
  return true;
}

template <typename T>
bool in(const std::optional<T>& v, sp::KnobRange r) {
  return !v || (std::isfinite(static_cast<double>(*v)) && static_cast<double>(*v) >= r.min &&
                static_cast<double>(*v) <= r.max);
}

// Reference matcher: whole-name match, '*' any run, '?' any one character.
bool reference_match(std::string_view glob, std::string_view name) {
  std::vector<std::vector<char>> m(glob.size() + 1, std::vector<char>(name.size() + 1, 0));
  m[glob.size()][name.size()] = 1;
  for (size_t g = glob.size(); g-- > 0;) {
    for (size_t n = name.size() + 1; n-- > 0;) {
      if (glob[g] == '*') {
        m[g][n] = m[g + 1][n] || (n < name.size() && m[g][n + 1]);
      } else {
        m[g][n] = n < name.size() && (glob[g] == '?' || glob[g] == name[n]) && m[g + 1][n + 1];
      }
    }
  }
  return m[0][0];
}

// glob_match is fnmatch(3): the reference models only '*' and '?', so globs with a bracket set
// or an escape (and NULs, which never match) are left to the unit tests.
bool reference_covers(std::string_view glob, std::string_view name) {
  return glob.find_first_of(std::string_view("[\\\0", 3)) == std::string_view::npos &&
         name.find('\0') == std::string_view::npos;
}

void check_match(std::string_view glob, std::string_view name) {
  if (glob.size() > 128 || name.size() > 128) return;  // keep the reference cheap
  if (!reference_covers(glob, name)) return;
  CHECK(sp::glob_match(glob, name) == reference_match(glob, name));
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  // A name to match against: the input's last line (overrides texts rarely hold newlines).
  const size_t nl = text.rfind('\n');
  const std::string_view name = nl == std::string_view::npos ? text.substr(0, 0) : text.substr(nl + 1);

  auto rules = sp::parse_tensor_overrides(text);
  if (!rules.ok()) {
    CHECK(rules.status().code() == sparsecar::Code::kInvalidArgument);
    return 0;
  }
  std::string formatted;
  for (const sp::TensorOverride& o : *rules) {
    CHECK(!o.glob.empty() && o.glob.find_first_of(":;") == std::string::npos);
    CHECK(o.glob.front() != ' ' && o.glob.front() != '\t' && o.glob.back() != ' ' && o.glob.back() != '\t');
    CHECK(params_in_range(o) && in(o.momentum, sp::kMomentumRange) && in(o.clip_norm, sp::kClipNormRange));
    CHECK(!(o.auto_format.value_or(false) && o.format));
    CHECK(o.auto_format.has_value() == (o.auto_format.value_or(false) || o.format.has_value()));
    const std::string rule = format_rule(o);
    CHECK(rule.size() > o.glob.size() + 1);  // at least one key
    formatted += (formatted.empty() ? "" : "; ") + rule;
  }
  auto again = sp::parse_tensor_overrides(formatted);
  CHECK(again.ok() && again->size() == rules->size());
  for (size_t i = 0; i < rules->size(); ++i) CHECK(same((*rules)[i], (*again)[i]));

  const size_t pairs = std::min<size_t>(rules->size(), 8);  // bounded: the reference is quadratic
  for (size_t i = 0; i < rules->size(); ++i) {
    const std::string& glob = (*rules)[i].glob;
    if (reference_covers(glob, glob)) CHECK(sp::glob_match(glob, glob));  // "[a]" does not match "[a]"
    if (i >= pairs) continue;
    check_match(glob, name);
    for (size_t j = 0; j < pairs; ++j) check_match(glob, (*rules)[j].glob);
  }
  return 0;
}
