// libFuzzer target: the control protocol's request parser (daemon/control/protocol.h).
// Any bytes must give either a Request or a ProtocolError — no crash, no exception, no
// unbounded recursion — and the reply built from either must be valid JSON.
// Built by the clang fuzz project (tests/fuzz/CMakeLists.txt: fuzz_control_request); seeds in
// corpus/control_request/.
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "daemon/control/protocol.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace sparsecar::control;
  std::string_view bytes(reinterpret_cast<const char*>(data), size);
  ParseResult r = parse_request(bytes, 4096);
  std::string reply = r.ok ? ok_reply(r.request.id, r.request.args) : error_reply(r.error);
  if (nlohmann::json::parse(reply, nullptr, false).is_discarded()) __builtin_trap();
  if (r.ok && (r.request.cmd.empty() || !r.request.args.is_object())) __builtin_trap();
  return 0;
}
