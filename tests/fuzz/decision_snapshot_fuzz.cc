// libFuzzer target: rank 0's decision snapshot (daemon/pipeline/decisions.h), the text a node
// adopts from the job agreement's ack — also a replacement joining a running job.
//
// Properties checked beyond "no crash, no sanitizer report":
//   - a refused snapshot leaves the board exactly as it was (one decision, the start-up config);
//   - an adopted one gives consecutive epochs, each with a config that validates;
//   - the adopted board's own snapshot, adopted by a second fresh board, gives the same value of
//     every knob at every epoch (what one node passes on, the next one reads back the same).
// Built by the clang fuzz project (tests/fuzz/CMakeLists.txt: fuzz_decision_snapshot); seeds in
// corpus/decision_snapshot/ (written by fuzz_make_parser_seeds from a real board).
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "daemon/config/knobs.h"
#include "daemon/pipeline/decisions.h"
#include "tests/fuzz/knob_checks.h"

namespace {

sparsecar::Config late_node() {
  sparsecar::Config c;
  c.rank = 1;
  c.world_size = 2;
  return c;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace sparsecar;
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  const Config start = late_node();
  DecisionBoard board(start, nullptr);
  Status adopted = board.adopt(text);
  auto history = board.history();
  if (!adopted.ok()) {
    CHECK(history.size() == 1 && history[0].epoch == 0 && same_knobs(*history[0].config, start));
    return 0;
  }
  CHECK(!history.empty());
  for (size_t i = 0; i < history.size(); ++i) {
    if (i > 0) CHECK(history[i].epoch == history[i - 1].epoch + 1);
    if (history[i].error.ok()) CHECK(validate(*history[i].config).ok());
  }
  std::string again;
  board.with_snapshot([&](const std::string& s) { again = s; });
  DecisionBoard second(start, nullptr);
  CHECK(second.adopt(again).ok());
  auto copied = second.history();
  CHECK(copied.size() == history.size());
  for (size_t i = 0; i < history.size(); ++i) {
    CHECK(copied[i].epoch == history[i].epoch);
    CHECK(same_knobs(*copied[i].config, *history[i].config));
  }
  return 0;
}
