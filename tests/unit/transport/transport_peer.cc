// A one-rank transport in its own process, for tests that kill a peer (ucx_transport_test).
//
//   transport_peer RANK WORLD_SIZE JOB_ID COORDINATOR_HOST TLS NET_DEVICES [SECRET]   ("-" = empty;
//                  without SECRET the job is open)
// Reads the coordinator port as the first line of stdin (the test learns it only once rank 0
// listens). Writes "ready\n" to fd 3 (UCX logs to stdout, so not there) once the job has gathered, answers every message with a 4-byte
// "pong" header (empty payload) to its sender, and stops cleanly when stdin closes. Tests
// normally end it with SIGKILL.
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>

#include "daemon/transport/ucx_transport.h"

namespace {

class Ponger : public sparsecar::MessageSink {
 public:
  sparsecar::Transport* transport = nullptr;
  void on_message(uint32_t peer, std::span<const std::byte>, std::span<const std::byte>) override {
    static const std::byte kPong[4] = {std::byte{'p'}, std::byte{'o'}, std::byte{'n'}, std::byte{'g'}};
    transport->send(peer, kPong, {}, [](const sparsecar::Status&) {}).ignore();
  }
  void on_peer_failed(uint32_t, const sparsecar::Status&) override {}
};

}  // namespace

int main(int argc, char** argv) {
  if (argc != 7 && argc != 8) {
    std::fprintf(stderr, "usage: %s RANK WORLD_SIZE JOB_ID COORDINATOR_HOST TLS NET_DEVICES [SECRET]\n", argv[0]);
    return 2;
  }
  sparsecar::UcxTransportOptions o;
  o.rank = static_cast<uint32_t>(std::strtoul(argv[1], nullptr, 10));
  o.world_size = static_cast<uint32_t>(std::strtoul(argv[2], nullptr, 10));
  o.job_id = std::strtoull(argv[3], nullptr, 10);
  std::string port;
  char c;
  while (::read(0, &c, 1) == 1 && c != '\n') port.push_back(c);
  o.coordinator = std::string(argv[4]) + ":" + port;
  o.tls = std::string(argv[5]) == "-" ? "" : argv[5];
  o.net_devices = std::string(argv[6]) == "-" ? "" : argv[6];
  o.rendezvous_timeout = std::chrono::seconds(30);
  if (argc == 8) o.key = sparsecar::auth::job_key_from_secret(argv[7]);
  Ponger sink;
  auto t = sparsecar::UcxTransport::start(o, &sink);
  if (!t.ok()) {
    std::fprintf(stderr, "transport_peer: %s\n", t.status().to_string().c_str());
    return 1;
  }
  sink.transport = t->get();
  if (::write(3, "ready\n", 6) != 6) return 1;
  while (::read(0, &c, 1) > 0) {
  }
  (*t)->stop();
  return 0;
}
