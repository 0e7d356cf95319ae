// Writes the seed corpus of the decoder fuzzers (tests/fuzz/corpus/decode_<format>/): valid
// encodings of typical selections for every row of the codec registry (kernels/codecs.h) in
// every value type, in the fuzzers' input layout (see decode_fuzzer.cc). Run it after adding a
// codec and check the files in; deterministic (fixed seeds).
//   fuzz_make_seeds <corpus dir>
//   fuzz_make_seeds --list        the rows' names in id order, one a line (the build reads them
//                                 to write one fuzz test per row: decode_tests.cmake)
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "sparsecar/kernels/codec.h"

namespace sk = sparsecar::kernels;

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s CORPUS_DIR | --list\n", argv[0]);
    return 2;
  }
  if (std::strcmp(argv[1], "--list") == 0) {
    for (const sk::CodecInfo& row : sk::codec_registry()) std::printf("%s\n", row.name);
    return 0;
  }
  const std::string dir = argv[1];
  struct Case {
    size_t n;
    double density;
    bool blocks;
    uint32_t rows;
  };
  const Case cases[] = {{0, 0, false, 1},     {1, 1, false, 1},    {10, 0.4, false, 2},
                        {100, 0.05, false, 4}, {257, 0.5, true, 1}, {1000, 0.01, false, 10},
                        {4096, 0.1, true, 16}, {20001, 0.002, false, 1}};
  std::mt19937_64 rng(7);
  int written = 0;
  for (const sk::CodecInfo& row : sk::codec_registry()) {
    const std::string format_dir = dir + "/decode_" + row.name;
    std::error_code made;
    std::filesystem::create_directories(format_dir, made);
    for (const sk::ValueTypeInfo& vt : sk::value_type_registry()) {
      int i = 0;
      for (const Case& c : cases) {
        std::vector<uint32_t> index;
        std::bernoulli_distribution keep(c.density);
        for (size_t e = 0; e < c.n; ++e) {
          const bool k = c.blocks ? ((e / 16) % 3 == 0) : keep(rng);
          if (k) index.push_back(static_cast<uint32_t>(e));
        }
        std::normal_distribution<float> dist(0.0f, 2.0f);
        std::vector<float> value(index.size());
        for (float& v : value) v = dist(rng);
        sk::EncodeParams p;
        p.format = row.id;
        p.value_type = vt.id;
        p.rows = c.rows;
        auto size = sk::encoded_size(p, c.n, index);
        if (!size.ok()) continue;
        std::vector<std::byte> payload(*size);
        if (!sk::encode(p, c.n, index, value, payload).ok()) return 1;
        const uint64_t nnz = row.dense ? c.n : index.size();
        std::vector<unsigned char> input = {static_cast<unsigned char>(vt.id),
                                            static_cast<unsigned char>(c.n),
                                            static_cast<unsigned char>(c.n >> 8),
                                            static_cast<unsigned char>(c.n >> 16),
                                            static_cast<unsigned char>(nnz),
                                            static_cast<unsigned char>(nnz >> 8),
                                            static_cast<unsigned char>(nnz >> 16)};
        for (std::byte b : payload) input.push_back(std::to_integer<unsigned char>(b));
        const std::string path = format_dir + "/seed_" + vt.name + "_" + std::to_string(i++);
        std::FILE* file = std::fopen(path.c_str(), "wb");
        if (file == nullptr || std::fwrite(input.data(), 1, input.size(), file) != input.size()) {
          std::fprintf(stderr, "cannot write %s\n", path.c_str());
          return 1;
        }
        std::fclose(file);
        ++written;
      }
    }
  }
  std::printf("%d seeds\n", written);
  return 0;
}
