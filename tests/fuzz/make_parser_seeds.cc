// Writes the seed corpora of the parser fuzzers (tests/fuzz/corpus/<target>/): valid inputs made
// by the real encoders (session_protocol.h structs + make_header/set_field, format_observation,
// format_changes, get_knob) plus a few typical hand-written texts. Run once and check the files
// in; deterministic. Also writes knobs.dict (libFuzzer dictionary) beside the corpus directory.
//   fuzz_make_parser_seeds tests/fuzz/corpus packaging/sparsecard.toml.example
#include <cstdio>
#include <cstring>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "daemon/config/config.h"
#include "daemon/pipeline/decisions.h"
#include "daemon/pipeline/observations.h"
#include "sparsecar/common/session_protocol.h"
#include "sparsecar/common/shm_layout.h"
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
  for (const char* w : {"static", "schedule", "layerwise", "gradnorm", "frequency", "bandwidth", "accuracy",
                        "budget", "cost", "dense", "l1", "l2", "fp32", "fp16", "bf16", "int8", "coo", "coo_varint",
                        "bitmap", "csr", "rle", "residual", "momentum", "randomk", "block_topk", "head_topk"}) {
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
  session_frames();
  observations();
  knob_changes();
  tensor_overrides();
  policy_lists();
  config_files(argv[2]);
  dictionaries();
  std::printf("%d seeds\n", g_written);
  return 0;
}
