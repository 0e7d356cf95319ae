// One sender for the daemon's text control messages (job agreement, decisions, knob requests and
// replies, observations): fills the wire header's framing fields (magic, version, payload size,
// checksum), keeps header and text alive until the transport is done with them, and logs a send
// that fails later.
//
// Thread-safety: as Transport::send (any thread).
#pragma once

#include <cstdint>
#include <string>

#include "daemon/transport/transport.h"
#include "daemon/transport/wire.h"
#include "sparsecar/common/status.h"

namespace sparsecar {

// Sends `text` to `peer` under `header`, whose kind, job id, sender and addressing fields
// (step, epoch, incarnation, ...) the caller has set. `what` names the message in the log line of
// a send that fails after it was queued ("a decision"); `quiet` logs that at debug level (for
// messages sent every step). Returns what Transport::send returns.
Status send_text_message(Transport& transport, uint32_t peer, wire::WireHeader header, std::string text,
                         std::string what, bool quiet = false);

}  // namespace sparsecar
