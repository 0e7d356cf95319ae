#include "sparsecar/policies/overrides.h"

#include <cmath>
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

bool parse_number(std::string_view text, double lo, double hi, bool lo_open, double* out) {
  const std::string s(text);
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  if (s.empty() || end != s.c_str() + s.size() || !std::isfinite(v)) return false;
  if (v > hi || v < lo || (lo_open && v == lo)) return false;
  *out = v;
  return true;
}

}  // namespace

bool glob_match(std::string_view glob, std::string_view name) {
  // Iterative matcher with one backtrack point for the last '*' (linear for typical globs).
  size_t g = 0, n = 0, star = std::string_view::npos, mark = 0;
  while (n < name.size()) {
    if (g < glob.size() && (glob[g] == '?' || glob[g] == name[n])) {
      ++g;
      ++n;
    } else if (g < glob.size() && glob[g] == '*') {
      star = g++;
      mark = n;
    } else if (star != std::string_view::npos) {
      g = star + 1;
      n = ++mark;
    } else {
      return false;
    }
  }
  while (g < glob.size() && glob[g] == '*') ++g;
  return g == glob.size();
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
      if (key == "compression") {
        if (value == "on" || value == "true") {
          o.compression = true;
        } else if (value == "off" || value == "false") {
          o.compression = false;
        } else {
          return invalid_argument(bad + " (on|off)");
        }
      } else if (key == "selector") {
        kernels::Selector s;
        if (!kernels::parse_selector(value, &s) || s == kernels::Selector::kNone) {
          return invalid_argument(bad + " (a selector name, e.g. topk, randomk)");
        }
        o.selector = s;
      } else if (key == "density") {
        if (!parse_number(value, 1e-6, 1.0, false, &v)) return invalid_argument(bad + " (in [1e-6, 1])");
        o.density = v;
      } else if (key == "threshold") {
        if (!parse_number(value, 1e-30, 1e30, false, &v)) return invalid_argument(bad + " (in [1e-30, 1e30])");
        o.threshold = v;
      } else if (key == "quantile") {
        if (!parse_number(value, 0.0, 1.0, true, &v)) return invalid_argument(bad + " (in (0, 1])");
        o.quantile = v;
      } else if (key == "approx_tolerance") {
        if (!parse_number(value, 0.0, 1.0, false, &v)) return invalid_argument(bad + " (in [0, 1])");
        o.approx_tolerance = v;
      } else {
        return invalid_argument(where + ": unknown key '" + std::string(key) +
                                "' (compression, selector, density, threshold, quantile, "
                                "approx_tolerance)");
      }
      any = true;
    }
    if (!any) return invalid_argument(where + ": no key=value");
    rules.push_back(std::move(o));
  }
  return rules;
}

}  // namespace sparsecar::policies
