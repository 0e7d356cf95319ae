// libFuzzer target: the TOML config file (daemon/config/config.h load_config_text, the text
// behind load_config_file / --config / --check-config).
//
// Properties checked beyond "no crash, no sanitizer report, no exception escaping":
//   - an error is kInvalidArgument or kNotFound and names the file (errors carry file and line);
//   - every name reported as set is a knob of the table, and every knob not reported keeps its
//     default;
//   - the Config rendered back as a config file (every knob as `name = "get_knob text"`) loads
//     into a default Config with the same value of every knob (parse → format → parse);
//   - validate() (what start-up runs next) answers without a fault.
// Built by the clang fuzz project (tests/fuzz/CMakeLists.txt: fuzz_config_file); seeds in
// corpus/config_file/ (fuzz_make_parser_seeds: the defaults rendered, and typical files).
#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>

#include "daemon/config/config.h"

namespace {

#define CHECK(cond)                \
  do {                             \
    if (!(cond)) __builtin_trap(); \
  } while (0)

constexpr const char* kSource = "fuzz.toml";

// A TOML basic string holding `s` (valid UTF-8, as toml++ handed it out).
std::string toml_string(std::string_view s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    if (c == '"' || c == '\\') {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c < 0x20 || c == 0x7f) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04X", c);
      out += buf;
    } else {
      out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

std::string render(const sparsecar::Config& c) {
  std::string out;
  for (const auto& spec : sparsecar::knob_table()) {
    out += std::string(spec.name) + " = " + toml_string(sparsecar::get_knob(c, spec.name).value()) + "\n";
  }
  return out;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace sparsecar;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  Config config;
  auto set = load_config_text(text, kSource, config);
  if (!set.ok()) {
    CHECK(set.status().code() == Code::kInvalidArgument || set.status().code() == Code::kNotFound);
    CHECK(set.status().message().find(kSource) != std::string::npos);
    return 0;
  }
  const Config defaults;
  for (const auto& spec : knob_table()) {
    const bool reported = std::find(set->begin(), set->end(), spec.name) != set->end();
    if (!reported) CHECK(get_knob(config, spec.name).value() == get_knob(defaults, spec.name).value());
  }
  for (const std::string& name : *set) CHECK(find_knob(name) != nullptr);

  const std::string rendered = render(config);
  Config again;
  auto set_again = load_config_text(rendered, "rendered.toml", again);
  CHECK(set_again.ok());
  CHECK(render(again) == rendered);

  validate(config).ignore();
  return 0;
}
