#include "sparsecar/policies/overrides.h"

#include <fnmatch.h>

#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace sparsecar::policies {
namespace {

std::string_view trim(std::string_view s) {
  while (!s.empty() && (s.front() == ' ' || s.front() == '\t')) s.remove_prefix(1);
  while (!s.empty() && (s.back() == ' ' || s.back() == '\t')) s.remove_suffix(1);
  return s;
}

std::vector<std::string_view> split(std::string_view s, char sep) {
  std::vector<std::string_view> out;
  for (;;) {
    const size_t at = s.find(sep);
    out.push_back(s.substr(0, at));
    if (at == std::string_view::npos) return out;
    s.remove_prefix(at + 1);
  }
}

// The knob table's number rule: finite, within the closed range.
bool parse_number(std::string_view text, KnobRange range, double* out) {
  const std::string s(text);
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size() || !std::isfinite(v)) return false;
  if (v < range.min || v > range.max) return false;
  *out = v;
  return true;
}

// The knob table's unsigned-integer rule: decimal digits only, within the closed range.
bool parse_uint(std::string_view text, KnobRange range, uint64_t* out) {
  uint64_t v = 0;
  const auto [end, ec] = std::from_chars(text.data(), text.data() + text.size(), v);
  if (text.empty() || ec != std::errc() || end != text.data() + text.size()) return false;
  if (static_cast<double>(v) < range.min || static_cast<double>(v) > range.max) return false;
  *out = v;
  return true;
}

std::string describe_range(const char* what, KnobRange range) {
  char buf[96];
  std::snprintf(buf, sizeof buf, " (%s in [%g, %g])", what, range.min, range.max);
  return buf;
}

// The per-tensor selector parameter named `key`, or null (job-wide ones are not keys).
const kernels::ParamInfo* per_tensor_param(std::string_view key) {
  for (const kernels::ParamInfo& p : kernels::kSelectorParams) {
    if (p.per_tensor && key == p.name) return &p;
  }
  return nullptr;
}

// Parses `value` as the selector parameter `p` (its row's type, range and choices) into o.
Status parse_param(const kernels::ParamInfo& p, std::string_view value, const std::string& bad, TensorOverride* o) {
  const KnobRange range{p.min, p.max};
  kernels::ParamValue v;
  switch (p.type) {
    case kernels::ParamType::kNumber:
      if (!parse_number(value, range, &v.number)) return invalid_argument(bad + describe_range("a number", range));
      break;
    case kernels::ParamType::kUint:
      if (!parse_uint(value, range, &v.integer)) {
        return invalid_argument(bad + describe_range("an unsigned integer", range));
      }
      break;
    case kernels::ParamType::kChoice:
      if (!kernels::parse_param_choice(p, value, &v.integer)) return invalid_argument(bad + " (" + p.choices + ")");
      break;
  }
  kernels::set_param(o->params, p.param, v);
  o->params_set |= kernels::param_bit(p.param);
  return Status::Ok();
}

}  // namespace

std::string tensor_override_keys() {
  std::string keys = "compression, selector";
  for (const kernels::ParamInfo& p : kernels::kSelectorParams) {
    if (p.per_tensor) keys.append(", ").append(p.name);
  }
  return keys + ", format, value_type, error_feedback, momentum, clip_norm";
}

bool glob_match(std::string_view glob, std::string_view name) {
  // fnmatch(3) reads NUL-terminated strings: a NUL inside either would cut it short.
  if (glob.find('\0') != std::string_view::npos || name.find('\0') != std::string_view::npos) return false;
  // No flags: '*' and '?' also match '/' and a leading '.', as tensor names are not paths.
  return ::fnmatch(std::string(glob).c_str(), std::string(name).c_str(), 0) == 0;
}

Expected<std::vector<TensorOverride>> parse_tensor_overrides(std::string_view text) {
  std::vector<TensorOverride> rules;
  for (std::string_view rule : split(text, ';')) {
    rule = trim(rule);
    if (rule.empty()) continue;
    const size_t colon = rule.find(':');
    const std::string where = "tensor override '" + std::string(rule) + "'";
    if (colon == std::string_view::npos) {
      return invalid_argument(where + ": expected 'GLOB: key=value, ...'");
    }
    TensorOverride o;
    o.glob = std::string(trim(rule.substr(0, colon)));
    if (o.glob.empty()) return invalid_argument(where + ": empty tensor glob");
    bool any = false;
    for (std::string_view item : split(rule.substr(colon + 1), ',')) {
      item = trim(item);
      if (item.empty()) continue;
      const size_t eq = item.find('=');
      if (eq == std::string_view::npos) {
        return invalid_argument(where + ": '" + std::string(item) + "' is not key=value");
      }
      const std::string_view key = trim(item.substr(0, eq));
      const std::string_view value = trim(item.substr(eq + 1));
      const std::string bad = where + ": invalid " + std::string(key) + " '" + std::string(value) + "'";
      double v = 0;
      auto number = [&](KnobRange range, std::optional<double>* field) {
        if (!parse_number(value, range, &v)) return invalid_argument(bad + describe_range("a number", range));
        *field = v;
        return Status::Ok();
      };
      auto choice = [&](const char* choices) { return invalid_argument(bad + " (" + choices + ")"); };
      Status st;
      if (key == "compression") {
        // The bool knobs' spellings (daemon/config/knobs.cc).
        if (value == "on" || value == "true" || value == "1" || value == "yes") {
          o.compression = true;
        } else if (value == "off" || value == "false" || value == "0" || value == "no") {
          o.compression = false;
        } else {
          return invalid_argument(bad + " (on|off)");
        }
      } else if (key == "selector") {
        kernels::Selector s;
        if (!kernels::parse_selector(value, &s) || s == kernels::Selector::kNone) {
          return invalid_argument(bad + " (" + kernels::selector_choices() + ")");
        }
        o.selector = s;
      } else if (key == "format") {
        kernels::Format f;
        if (value == "auto") {
          o.auto_format = true;
          o.format.reset();
        } else if (kernels::parse_format(value, &f)) {
          o.auto_format = false;
          o.format = f;
        } else {
          return choice(kFormatChoices);
        }
      } else if (key == "value_type") {
        kernels::ValueType t;
        if (!kernels::parse_value_type(value, &t)) return choice(kValueTypeChoices);
        o.value_type = t;
      } else if (const kernels::ParamInfo* param = per_tensor_param(key)) {
        st = parse_param(*param, value, bad, &o);
      } else if (key == "error_feedback") {
        ErrorFeedback e;
        if (!parse_error_feedback(value, &e)) return choice(kErrorFeedbackChoices);
        o.error_feedback = e;
      } else if (key == "momentum") {
        st = number(kMomentumRange, &o.momentum);
      } else if (key == "clip_norm") {
        st = number(kClipNormRange, &o.clip_norm);
      } else {
        return invalid_argument(where + ": unknown key '" + std::string(key) + "' (" + tensor_override_keys() + ")");
      }
      if (!st.ok()) return st;
      any = true;
    }
    if (!any) return invalid_argument(where + ": no key=value");
    rules.push_back(std::move(o));
  }
  return rules;
}

}  // namespace sparsecar::policies
