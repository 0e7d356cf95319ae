// libFuzzer target: decision / knob-change text (daemon/pipeline/decisions.h parse_changes), the
// payload of kDecision (rank 0 → every node) and kKnobRequest (any node → rank 0), and applying
// it to a Config the way each side does (knobs.h set_knob, validate).
//
// Properties checked beyond "no crash, no sanitizer report":
//   - an error is kInvalidArgument; a parsed change has a non-empty name without '=' or '\n'
//     and a value without '\n';
//   - parse → format_changes → parse gives the same changes;
//   - rank 0's path (known, live knobs only, set_knob each, validate) and a peer's path (set_knob
//     each on its copy of the config) agree: when rank 0 accepts a decision, the peer that
//     applies the decision's text ends with the same value of every knob in the table;
//   - every knob value a change set reads back with get_knob as text that set_knob accepts and
//     that gives the same value again (the knob text round trip `get`/`set` rely on).
// Built by the clang fuzz project (tests/fuzz/CMakeLists.txt: fuzz_knob_changes); seeds in
// corpus/knob_changes/ (format_changes output, written by fuzz_make_parser_seeds).
#include <charconv>
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <string_view>

#include "daemon/config/knobs.h"
#include "daemon/pipeline/decisions.h"
#include "tests/fuzz/knob_checks.h"

namespace {

// `set` (accepted by set_knob) and `shown` (get_knob after it) denote the same value.
bool same_value(const sparsecar::KnobSpec& spec, const std::string& set, const std::string& shown) {
  switch (spec.type) {
    case sparsecar::KnobType::kBool:
      return shown == ((set == "on" || set == "true" || set == "1" || set == "yes") ? "on" : "off");
    case sparsecar::KnobType::kUint: {
      uint64_t a = 0, b = 0;
      std::from_chars(set.data(), set.data() + set.size(), a);
      std::from_chars(shown.data(), shown.data() + shown.size(), b);
      return a == b;  // catches a value stored into a narrower field than its range
    }
    case sparsecar::KnobType::kDouble:
      return std::strtod(set.c_str(), nullptr) == std::strtod(shown.c_str(), nullptr);
    case sparsecar::KnobType::kString:
    case sparsecar::KnobType::kChoice:
      return set == shown;
  }
  return false;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace sparsecar;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  auto changes = parse_changes(text);
  if (!changes.ok()) {
    CHECK(changes.status().code() == Code::kInvalidArgument);
    return 0;
  }
  for (const auto& [name, value] : *changes) {
    CHECK(!name.empty() && name.find('=') == std::string::npos && name.find('\n') == std::string::npos);
    CHECK(value.find('\n') == std::string::npos);
  }
  const std::string formatted = format_changes(*changes);
  auto again = parse_changes(formatted);
  CHECK(again.ok() && *again == *changes);

  // Rank 0 (DecisionBoard::decide_locked).
  const Config base;
  Config leader = base;
  bool accepted = !changes->empty();
  for (const auto& [name, value] : *changes) {
    const KnobSpec* spec = find_knob(name);
    if (spec == nullptr || !spec->live || !set_knob(leader, name, value).ok()) {
      accepted = false;
      break;
    }
  }
  accepted = accepted && validate(leader).ok();

  // A peer (DecisionBoard::on_message, kDecision): every change of the text, errors only logged.
  Config peer = base;
  for (const auto& [name, value] : *again) {
    if (!set_knob(peer, name, value).ok()) continue;
    // The knob text round trip: what get shows is what was set, and set accepts it back.
    auto shown = get_knob(peer, name);
    CHECK(shown.ok());
    CHECK(same_value(*find_knob(name), value, *shown));
    Config fresh = base;
    CHECK(set_knob(fresh, name, *shown).ok());
    CHECK(get_knob(fresh, name).value() == *shown);
  }
  if (accepted) CHECK(same_knobs(leader, peer));
  return 0;
}
