// Writes the seed corpora of the parser fuzzers (tests/fuzz/corpus/<target>/): valid inputs made
// by the real encoders (session_protocol.h structs + make_header/set_field, format_observation,
// format_changes, get_knob) plus a few typical hand-written texts. Run once and check the files
// in; deterministic. Also writes knobs.dict (libFuzzer dictionary) beside the corpus directory.
//   fuzz_make_parser_seeds tests/fuzz/corpus packaging/sparsecard.toml.example
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "daemon/config/config.h"
#include "daemon/pipeline/checkpoint.h"
#include "daemon/transport/rendezvous.h"
#include "daemon/transport/wire.h"
#include "sparsecar/kernels/codec.h"
#include "daemon/pipeline/decisions.h"
#include "daemon/pipeline/observations.h"
#include "sparsecar/common/session_protocol.h"
#include "sparsecar/common/shm_layout.h"
#include "sparsecar/policies/controllers.h"
#include "sparsecar/policies/tensor_plan.h"

namespace {

namespace proto = sparsecar::proto;

std::string g_dir;
int g_written = 0;

void write(const std::string& target, const std::string& name, const std::string& bytes) {
  const std::string path = g_dir + "/" + target + "/" + name;
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr || std::fwrite(bytes.data(), 1, bytes.size(), f) != bytes.size()) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    std::exit(1);
  }
  std::fclose(f);
  ++g_written;
}

template <typename T>
std::string message(proto::MsgType type, const T& payload) {
  static_assert(sizeof(T) <= proto::kMaxPayloadBytes);
  const proto::MsgHeader h = proto::make_header(type);
  std::string out(reinterpret_cast<const char*>(&h), sizeof h);
  out.append(reinterpret_cast<const char*>(&payload), sizeof payload);
  return out;
}

void session_frames() {
  proto::Hello hello{};
  hello.version = proto::kProtocolVersion;
  hello.shm_version = sparsecar::shm::kShmVersion;
  hello.pid = 4242;
  proto::Register reg{};
  reg.count = 1000;
  proto::set_field(reg.name, sizeof reg.name, "layer1.weight");
  proto::RegisterShaped shaped{};
  shaped.count = 64 * 3 * 3 * 3;
  shaped.ndim = 4;
  const uint64_t dims[] = {64, 3, 3, 3};
  std::memcpy(shaped.dims, dims, sizeof dims);
  proto::set_field(shaped.name, sizeof shaped.name, "conv1.weight");
  proto::RegisterShaped matrix{};
  matrix.count = 512 * 128;
  matrix.ndim = 2;
  matrix.dims[0] = 512;
  matrix.dims[1] = 128;
  proto::set_field(matrix.name, sizeof matrix.name, "attn.q_proj.weight");
  proto::RegisterDevice device{};  // a DDP bucket in a caching-allocator segment, no shape
  device.count = 1 << 20;
  device.offset = 4096;
  for (uint8_t i = 0; i < proto::kDeviceUuidBytes; ++i) device.device_uuid[i] = static_cast<uint8_t>(0x10 + i);
  for (uint8_t i = 0; i < proto::kIpcHandleBytes; ++i) {
    device.mem_handle[i] = i;
    device.ready_event[i] = static_cast<uint8_t>(0x40 + i);
    device.done_event[i] = static_cast<uint8_t>(0x80 + i);
  }
  proto::set_field(device.name, sizeof device.name, "ddp.bucket.0");
  proto::Metric metric{};
  metric.value = 0.6931;
  metric.step = 17;
  proto::set_field(metric.name, sizeof metric.name, "loss");
  proto::HelloAck hello_ack{};
  hello_ack.client_id = 1;
  hello_ack.local_clients = 2;
  hello_ack.shm_version = sparsecar::shm::kShmVersion;
  hello_ack.control_bytes = 1 << 20;
  proto::RegisterAck register_ack{};
  register_ack.tensor_id = 3;
  register_ack.count = 1000;
  register_ack.slot_bytes = 4000;
  proto::Error error{};
  error.status = 8;
  proto::set_field(error.message, sizeof error.message, "protocol error: first message is not Hello");

  // Byte 0 picks the chunking (odd: small chunks).
  const std::string h = message(proto::MsgType::kHello, hello);
  write("session_frames", "hello", "\x01" + h);
  write("session_frames", "register", "\x02" + h + message(proto::MsgType::kRegister, reg));
  write("session_frames", "shaped_metric", "\x03" + h + message(proto::MsgType::kRegisterShaped, shaped) +
                                               message(proto::MsgType::kRegisterShaped, matrix) +
                                               message(proto::MsgType::kMetric, metric));
  write("session_frames", "session", "\x04" + h + message(proto::MsgType::kRegister, reg) +
                                         message(proto::MsgType::kMetric, metric) +
                                         message(proto::MsgType::kMetric, metric));
  write("session_frames", "daemon_replies", "\x05" + message(proto::MsgType::kHelloAck, hello_ack) +
                                                message(proto::MsgType::kRegisterAck, register_ack) +
                                                message(proto::MsgType::kError, error));
  const std::string partial = message(proto::MsgType::kRegister, reg);
  write("session_frames", "partial", "\x06" + h + partial.substr(0, 100));
  write("session_frames", "device", "\x08" + h + message(proto::MsgType::kRegisterDevice, device) +
                                        message(proto::MsgType::kMetric, metric));
  proto::MsgHeader bad = proto::make_header(proto::MsgType::kMetric);
  bad.length = 12;
  write("session_frames", "bad_length", "\x07" + h + std::string(reinterpret_cast<const char*>(&bad), sizeof bad));
}

void observations() {
  sparsecar::policies::NodeObservation o;
  o.rank = 1;
  o.step = 120;
  o.elements = 11689512;
  o.nnz = 116895;
  o.bytes_sent = 935160;
  o.dense_bytes = 46758048;
  o.exchange_s = 0.0123;
  o.encode_s = 0.0041;
  o.link_bytes = 900000;
  o.link_s = 0.0009;
  write("observation", "no_tensors", sparsecar::format_observation(o));
  o.grad_norm2 = 12.5;
  o.residual_norm2 = 3.25;
  o.compute_s = 0.08;
  o.has_loss = true;
  o.loss = 2.302585;
  o.has_loss_target = true;
  o.loss_target = 0.5;
  for (uint32_t t = 0; t < 4; ++t) {
    o.tensors.push_back({t, 1000u * (t + 1), 10u * (t + 1), t == 0 ? -1.0 : 0.25 * t});
  }
  write("observation", "tensors_loss", sparsecar::format_observation(o));
  write("observation", "unknown_key", sparsecar::format_observation(o) + "future_key 1\n");
  // The budget controller's histograms (mh<bin> / gh<bin> lines).
  using sparsecar::policies::kMagnitudeBins;
  using sparsecar::policies::magnitude_bin;
  o.magnitude_elements = 10000;
  o.threshold = 0.0125;
  o.magnitude_hist.assign(kMagnitudeBins, 0);
  o.gradient_hist.assign(kMagnitudeBins, 0);
  o.magnitude_hist[magnitude_bin(0.0f)] = 9900;
  o.magnitude_hist[magnitude_bin(0.003f)] = 60;
  o.magnitude_hist[magnitude_bin(0.02f)] = 40;
  o.gradient_hist[magnitude_bin(0.001f)] = 9000;
  o.gradient_hist[magnitude_bin(0.01f)] = 1000;
  write("observation", "magnitudes", sparsecar::format_observation(o));
}

void knob_changes() {
  using sparsecar::KnobChanges;
  write("knob_changes", "density", sparsecar::format_changes(KnobChanges{{"density", "0.002"}}));
  write("knob_changes", "selector", sparsecar::format_changes(KnobChanges{{"selector", "threshold"}, {"threshold", "0.01"}}));
  write("knob_changes", "controller",
        sparsecar::format_changes(KnobChanges{{"density_cap", "0.25"}, {"tensor_density_scale", "0:2,3:0.5"},
                                              {"compression", "on"}}));
  write("knob_changes", "overrides",
        sparsecar::format_changes(KnobChanges{{"tensor_overrides", "embed*: selector=randomk, density=0.001"},
                                              {"format", "auto"}, {"log_level", "debug"}}));
  write("knob_changes", "not_live", sparsecar::format_changes(KnobChanges{{"rank", "3"}, {"world_size", "4"}}));
}

// Snapshots of a real board: the start-up state alone, and after two decisions.
void decision_snapshot() {
  sparsecar::Config c;
  sparsecar::DecisionBoard board(c, nullptr);
  board.with_snapshot([](const std::string& s) { write("decision_snapshot", "start_up", s); });
  const auto later = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  if (!board.propose({{"density", "0.05"}}, "seed", later).ok()) std::abort();
  if (!board.propose({{"selector", "threshold"}, {"threshold", "0.002"}}, "seed", later).ok()) std::abort();
  board.with_snapshot([](const std::string& s) { write("decision_snapshot", "two_decisions", s); });
}

void tensor_overrides() {
  write("tensor_overrides", "doc_example",
        "embed*: selector=randomk, density=0.001, format=bitmap; *.bias: compression=off;\n"
        "attn.*: selector=head_topk, heads=16, group_norm=l1; fc*: block_size=128, value_type=fp16");
  write("tensor_overrides", "every_key",
        "layer?.w*: compression=on, selector=topk, density=0.01, threshold=0.001, quantile=0.99, "
        "approx_tolerance=0.1, format=auto, value_type=bf16, block_size=64, group_norm=l2, heads=8, "
        "mask_period=100, error_feedback=momentum, momentum=0.9, clip_norm=1.5");
  write("tensor_overrides", "with_name", "conv*.weight: format=csr, value_type=int8\nconv2.weight");
}

// Byte 0 picks the parser (policy_lists_fuzz.cc): 0 controllers, 1 sensitivity, 2 tensor scales.
void policy_lists() {
  write("policy_lists", "controllers", std::string(1, '\0') + "schedule, bandwidth,frequency");
  write("policy_lists", "controllers_all",
        std::string(1, '\0') + sparsecar::policies::format_controllers((1u << sparsecar::policies::kControllerKindCount) - 2));
  write("policy_lists", "sensitivity", "\x01bias:dense, embed:0.1, fc2:2");
  sparsecar::policies::TensorScales scales = {{0, 2.0}, {3, 0.5}, {17, 0.125}};
  write("policy_lists", "scales", "\x02" + sparsecar::policies::format_tensor_scales(scales));
}

void config_files(const std::string& example) {
  std::ifstream in(example);
  std::stringstream text;
  text << in.rdbuf();
  if (text.str().empty()) {
    std::fprintf(stderr, "cannot read %s\n", example.c_str());
    std::exit(1);
  }
  write("config_file", "example", text.str());
  // The defaults, rendered the way the fuzzer renders a parsed config.
  const sparsecar::Config defaults;
  std::string all;
  for (const auto& spec : sparsecar::knob_table()) {
    std::string v = sparsecar::get_knob(defaults, spec.name).value();
    all += std::string(spec.name) + " = \"" + v + "\"\n";
  }
  write("config_file", "defaults", all);
  write("config_file", "typed",
        "rank = 1\nworld_size = 4\ncoordinator = \"10.0.0.1:29600\"\ncompression = true\n"
        "density = 0.002\nthreshold = 1e-4\nlog_level = \"debug\"\nkernel_threads = 2\n");
  write("config_file", "tensor_tables",
        "selector = \"block_topk\"\ndensity = 0.01\n[tensor.\"embed*\"]\nselector = \"randomk\"\n"
        "density = 0.001\nformat = \"bitmap\"\n[tensor.\"*.bias\"]\ncompression = false\n"
        "[tensor.\"attn.*\"]\nblock_size = 128\nvalue_type = \"fp16\"\n");
}

// ---- wire_header: byte 0 = the fuzzer's mode bits, then a sealed header + payload ----------
namespace wire = sparsecar::wire;
namespace kernels = sparsecar::kernels;
constexpr uint64_t kSeedJobId = 0x0102030405060708ull;  // wire_header_fuzz.cc's job

std::string wire_message(uint8_t mode, wire::WireHeader h, const std::string& payload) {
  h.magic = wire::kMagic;
  h.version = wire::kVersion;
  h.job_id = kSeedJobId;
  h.payload_bytes = payload.size();
  std::array<std::byte, wire::kHeaderBytes> header{};
  wire::seal(h, std::as_bytes(std::span(payload.data(), payload.size())), header);
  std::string out(1, static_cast<char>(mode));
  out.append(reinterpret_cast<const char*>(header.data()), header.size());
  return out + payload;
}

wire::WireHeader data_header(kernels::Format format, kernels::ValueType vt, uint64_t dense_len, uint64_t nnz) {
  wire::WireHeader h{};
  h.kind = static_cast<uint16_t>(wire::Kind::kData);
  h.sender_rank = 1;
  h.tensor_id = 3;
  h.step = 17;
  h.epoch = 2;
  h.format = static_cast<uint16_t>(format);
  h.value_type = static_cast<uint16_t>(vt);
  h.dense_len = dense_len;
  h.nnz = nnz;
  h.incarnation = 0x1122334455667788ull;
  return h;
}

void wire_header() {
  const size_t n = 96;
  const std::vector<uint32_t> index = {0, 1, 2, 7, 8, 9, 10, 40, 41, 95};
  std::vector<float> value;
  for (size_t i = 0; i < index.size(); ++i) value.push_back(0.25f * static_cast<float>(i) - 1.0f);
  const uint8_t modes[] = {0x00, 0x02, 0x18, 0x20, 0x46, 0x30};
  int m = 0;
  for (const kernels::CodecInfo& row : kernels::codec_registry()) {  // every format, in id order
    for (const kernels::ValueTypeInfo& vt : kernels::value_type_registry()) {
      const char* fmt_name = row.name;
      const char* vt_name = vt.name;
      kernels::EncodeParams params;
      params.format = row.id;
      params.value_type = vt.id;
      params.rows = row.needs_rows ? 8 : 1;
      std::vector<uint32_t> idx = index;
      std::vector<float> val = value;
      if (row.dense) {  // carries every element
        idx.clear();
        val.clear();
        for (uint32_t i = 0; i < n; ++i) {
          idx.push_back(i);
          val.push_back(static_cast<float>(i % 5) - 2.0f);
        }
      }
      auto size = kernels::encoded_size(params, n, idx);
      if (!size.ok()) {
        std::fprintf(stderr, "wire seed %s/%s: %s\n", fmt_name, vt_name, size.status().to_string().c_str());
        std::exit(1);
      }
      std::string payload(*size, '\0');
      auto wrote = kernels::encode(params, n, idx, val,
                                   std::as_writable_bytes(std::span(payload.data(), payload.size())));
      if (!wrote.ok() || *wrote != *size) {
        std::fprintf(stderr, "wire seed %s/%s: encode failed\n", fmt_name, vt_name);
        std::exit(1);
      }
      write("wire_header", std::string("data_") + fmt_name + "_" + vt_name,
            wire_message(modes[m++ % 6], data_header(params.format, params.value_type, n, idx.size()), payload));
    }
  }
  // The empty selection, and the other kinds with their text payloads.
  write("wire_header", "data_coo_empty",
        wire_message(0x02, data_header(kernels::Format::kCoo, kernels::ValueType::kF32, n, 0), ""));
  auto other = [](wire::Kind kind, uint64_t step, uint64_t incarnation) {
    wire::WireHeader h{};
    h.kind = static_cast<uint16_t>(kind);
    h.sender_rank = 2;
    h.tensor_id = kind == wire::Kind::kAbort ? 3 : 0;
    h.step = step;
    h.epoch = 4;
    h.incarnation = incarnation;
    return h;
  };
  write("wire_header", "abort", wire_message(0x00, other(wire::Kind::kAbort, 17, 0x1122334455667788ull),
                                             "compress failed: tensor layer1.weight has NaN"));
  write("wire_header", "abort_reset", wire_message(0x10, other(wire::Kind::kAbort, 17, 0x1122334455667788ull),
                                                   "trainer died"));
  write("wire_header", "manifest", wire_message(0x12, other(wire::Kind::kManifest, 0, 0x0badc0ffee0ddf00ull),
                                                "tensor 0 layer1.weight 1000 [10, 100]\nknob density=0.01\n"));
  write("wire_header", "manifest_ack", wire_message(0x00, other(wire::Kind::kManifestAck, 0x0badc0ffee0ddf00ull,
                                                                0x1122334455667788ull), "ok"));
  write("wire_header", "decision", wire_message(0x00, other(wire::Kind::kDecision, 120, 0), "density=0.005\n"));
  write("wire_header", "knob_request", wire_message(0x00, other(wire::Kind::kKnobRequest, 7, 0), "selector=randomk\n"));
  write("wire_header", "knob_reply", wire_message(0x00, other(wire::Kind::kKnobReply, 7, 0), "ok 5 130"));
  write("wire_header", "observation", wire_message(0x00, other(wire::Kind::kObservation, 0, 0),
                                                   "step 17\ngrad_norm 3.25\nbytes_sent 40960\n"));
  write("wire_header", "probe", wire_message(0x00, other(wire::Kind::kProbe, 0, 0), std::string(1000, '\0')));
}

// ---- rendezvous_hello: byte 0 = the fuzzer's mode, then a hello or a welcome body -----------
void rendezvous_hello() {
  namespace auth = sparsecar::auth;
  namespace rdv = sparsecar::rendezvous;
  auth::Nonce challenge{};  // rendezvous_hello_fuzz.cc's challenge_of(0xC0)
  for (size_t i = 0; i < challenge.size(); ++i) challenge[i] = static_cast<uint8_t>(0xC0 + i);
  const auth::JobKey secret = auth::job_key_from_secret("fuzz-job-secret-0123456789");
  const auth::JobKey open = auth::open_job_key();
  rdv::HelloFields h;
  h.job_id = 0x00C0FFEE12345678ull;
  h.world_size = 4;
  h.rank = 2;
  h.label = "node-b:4242";
  h.address = std::string("ucx-worker-address-2") + std::string(40, '\x07');
  for (size_t i = 0; i < h.nonce.size(); ++i) h.nonce[i] = static_cast<uint8_t>(i * 7);
  write("rendezvous_hello", "hello_secret", std::string(1, '\0') + rdv::encode_hello(h, secret, challenge));
  write("rendezvous_hello", "hello_secret_remac", std::string(1, '\1') + rdv::encode_hello(h, secret, challenge));
  write("rendezvous_hello", "hello_open", std::string(1, '\4') + rdv::encode_hello(h, open, challenge));
  write("rendezvous_hello", "hello_open_remac", std::string(1, '\5') + rdv::encode_hello(h, open, challenge));
  rdv::HelloFields empty_label = h;
  empty_label.label.clear();
  empty_label.rank = 1;
  write("rendezvous_hello", "hello_no_label", std::string(1, '\0') + rdv::encode_hello(empty_label, secret, challenge));
  // Fields for encode_hello (mode 3): job id, world, rank, nonce, u16 label length, label, address.
  std::string fields(1, '\3');
  auto le = [&](uint64_t v, int n) {
    for (int i = 0; i < n; ++i) fields += static_cast<char>((v >> (8 * i)) & 0xFF);
  };
  le(h.job_id, 8);
  le(h.world_size, 4);
  le(h.rank, 4);
  fields.append(reinterpret_cast<const char*>(h.nonce.data()), h.nonce.size());
  le(h.label.size(), 2);
  fields += h.label + h.address;
  write("rendezvous_hello", "fields", fields);
  // Welcome bodies (mode 2): byte 1 = rank pick (rank = (pick >> 3) % world).
  for (uint32_t world : {2u, 4u}) {
    rdv::Formation f;
    for (size_t i = 0; i < f.formation_id.size(); ++i) f.formation_id[i] = static_cast<uint8_t>(0xF0 ^ i);
    for (uint32_t r = 0; r < world; ++r) {
      f.peers.push_back(rdv::Peer{"node-" + std::to_string(r) + ":4242 via 10.0.0." + std::to_string(r + 1),
                                  "ucx-worker-address-" + std::to_string(r)});
    }
    const uint8_t pick = static_cast<uint8_t>((world - 1) << 3);
    write("rendezvous_hello", "welcome_" + std::to_string(world),
          std::string(1, '\2') + std::string(1, static_cast<char>(pick)) + rdv::encode_welcome_body(f));
  }
}

// ---- checkpoint: byte 0 = the fuzzer's mode, then a checkpoint file --------------------------
void checkpoint() {
  // The tensor sets of checkpoint_fuzz.cc's fixed_specs(), written by the real writer.
  struct Set {
    const char* file;
    uint8_t mode;
    std::vector<std::pair<std::string, size_t>> tensors;
  };
  const std::vector<Set> sets = {
      {"one", 0x00, {{"w", 100}}},
      {"three", 0x10, {{"layer1.weight", 64}, {"layer1.bias", 8}, {"head.weight", 0}}},
      {"embedding", 0x20, {{"embedding.weight", 1000}}},
      {"odd_names", 0x30, {{"", 1}, {"a", 1}}},
      {"declared", 0x02, {{"encoder.layers.0.attn.q_proj.weight", 48}, {"encoder.layers.0.attn.q_proj.bias", 12}}},
      {"declared_own_rank", 0x07, {{"x", 5}}},
  };
  for (const Set& s : sets) {
    std::vector<std::vector<float>> residuals;
    std::vector<sparsecar::CheckpointEntry> entries;
    residuals.reserve(s.tensors.size());
    for (const auto& [name, count] : s.tensors) {
      std::vector<float>& r = residuals.emplace_back(count);
      for (size_t i = 0; i < count; ++i) r[i] = 1e-3f * static_cast<float>(i) - 0.01f;
      entries.push_back({name, r});
    }
    const uint32_t rank = s.mode == 0x07 ? 3 : 1;
    const uint32_t world = s.mode == 0x07 ? 8 : 4;
    write("checkpoint", s.file,
          std::string(1, static_cast<char>(s.mode)) + sparsecar::encode_checkpoint(0xABCDEF0123ull, rank, world, entries));
  }
}

// libFuzzer dictionaries (-dict=): the words the text parsers look for, from the knob table and
// the choice lists, so the fuzzers reach the per-knob code (set_knob, validate's sub-parsers)
// without guessing names byte by byte.
void dictionaries() {
  std::set<std::string> words = {"tensor", "[tensor.\"", "\"]", " = ", "=", ";", ":", ", ", "*", "?", "on",
                                 "off", "true", "false", "auto"};
  for (const auto& spec : sparsecar::knob_table()) {
    words.insert(spec.name);
    words.insert(std::string(spec.name) + "=");
    std::string choices = spec.choices;
    for (size_t bar; (bar = choices.find('|')) != std::string::npos; choices.erase(0, bar + 1)) {
      words.insert(choices.substr(0, bar));
    }
    if (!choices.empty()) words.insert(choices);
  }
  // The `controller` knob's words (its choices are free text): the controller registry's names.
  for (const sparsecar::policies::ControllerInfo& row : sparsecar::policies::controller_registry()) {
    words.insert(row.name);
  }
  for (const char* w : {"dense", "l1", "l2", "fp32", "fp16", "bf16", "int8", "coo", "coo_varint", "bitmap", "csr",
                        "rle", "residual", "momentum", "randomk", "block_topk", "head_topk"}) {
    words.insert(w);
  }
  std::string dict;
  for (const std::string& w : words) {
    dict += '"';
    for (char c : w) {
      if (c == '"' || c == '\\') dict += '\\';
      dict += c;
    }
    dict += "\"\n";
  }
  write("..", "knobs.dict", dict);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR EXAMPLE_CONFIG\n", argv[0]);
    return 2;
  }
  g_dir = argv[1];
  for (const char* target : {"wire_header", "rendezvous_hello", "checkpoint"}) {
    std::filesystem::create_directories(g_dir + "/" + target);
  }
  session_frames();
  observations();
  knob_changes();
  decision_snapshot();
  tensor_overrides();
  policy_lists();
  config_files(argv[2]);
  wire_header();
  rendezvous_hello();
  checkpoint();
  dictionaries();
  std::printf("%d seeds\n", g_written);
  return 0;
}
