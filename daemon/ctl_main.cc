// sparsecarctl: the operator's tool for a running sparsecard. The ZeroMQ control protocol and
// its commands (status, get, set, policy, drain, checkpoint, ...) come with the control issue;
// this version offers the knob table so operators can see every knob, its default and range.
#include <cstdio>
#include <cstring>
#include <string>

#include "daemon/config/config.h"
#include "daemon/config/knobs.h"

namespace {

void usage(FILE* out) {
  std::fputs(
      "usage: sparsecarctl <command>\n"
      "commands:\n"
      "  knobs       list every knob: name, default, range/choices, live, agreed, doc\n"
      "  version     print the version\n"
      "  --help      this text\n"
      "The control socket commands (status, get, set, ...) are not available in this version.\n",
      out);
}

}  // namespace

int main(int argc, char** argv) {
  using namespace sparsecar;
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  std::string cmd = argv[1];
  if (cmd == "version" || cmd == "--version") {
    std::printf("%s\n", version_string().c_str());
    return 0;
  }
  if (cmd == "knobs") {
    std::printf("%-18s %-22s %-24s %-5s %-6s %s\n", "KNOB", "DEFAULT", "RANGE", "LIVE", "AGREED", "DOC");
    for (const auto& k : knob_table()) {
      char range[64] = "";
      if (k.choices[0] != '\0') {
        std::snprintf(range, sizeof range, "%s", k.choices);
      } else if (k.type == KnobType::kUint || k.type == KnobType::kDouble) {
        std::snprintf(range, sizeof range, "[%g, %g]", k.min, k.max);
      } else if (k.type == KnobType::kBool) {
        std::snprintf(range, sizeof range, "on|off");
      }
      std::printf("%-18s %-22s %-24s %-5s %-6s %s\n", k.name, knob_default(k).c_str(), range, k.live ? "yes" : "no",
                  k.agreed ? "yes" : "no", k.doc);
    }
    return 0;
  }
  std::fprintf(stderr, "sparsecarctl: unknown command '%s'\n", cmd.c_str());
  usage(stderr);
  return 2;
}
