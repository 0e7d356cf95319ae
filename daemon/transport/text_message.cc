#include "daemon/transport/text_message.h"

#include <array>
#include <memory>
#include <span>

#include "sparsecar/common/log.h"

namespace sparsecar {

Status send_text_message(Transport& transport, uint32_t peer, wire::WireHeader header, std::string text,
                         std::string what, bool quiet) {
  struct Buffers {
    std::string text;
    std::array<std::byte, wire::kHeaderBytes> header;
  };
  auto b = std::make_shared<Buffers>();
  b->text = std::move(text);
  header.magic = wire::kMagic;
  header.version = wire::kVersion;
  auto payload = std::as_bytes(std::span<const char>(b->text.data(), b->text.size()));
  header.payload_bytes = payload.size();
  wire::seal(header, payload, std::span<std::byte, wire::kHeaderBytes>(b->header));
  return transport.send(peer, b->header, payload, [b, peer, what = std::move(what), quiet](const Status& st) {
    if (st.ok()) return;
    if (quiet) {
      SC_LOG_DEBUG("{} to rank {} was not delivered: {}", what, peer, st.to_string());
    } else {
      SC_LOG_WARN("{} to rank {} was not delivered: {}", what, peer, st.to_string());
    }
  });
}

}  // namespace sparsecar
