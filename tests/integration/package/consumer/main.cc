// Uses the installed client API (C++ and C ABI) and kernels; exits 0 when both link and work.
#include <cstdio>
#include <vector>

#include "sparsecar/client.h"
#include "sparsecar/kernels/select.h"
#include "sparsecar/sparsecar.h"

int main() {
  std::vector<float> x{0.5f, -3.0f, 2.0f, 0.1f};
  std::vector<uint32_t> idx(2);
  std::vector<float> val(2);
  std::vector<std::byte> scratch(sparsecar::kernels::topk_scratch_bytes(x.size()));
  auto n = sparsecar::kernels::topk_exact(x, 2, scratch, idx.data(), val.data());
  if (!n.ok() || *n != 2 || idx[0] != 1 || idx[1] != 2) return 1;
  // No daemon here: connect must fail cleanly with UNAVAILABLE or DEADLINE_EXCEEDED, not hang.
  sc_client* client = nullptr;
  sc_status s = sc_connect("/nonexistent/sparsecar.sock", 50, &client);
  std::printf("sc_connect: %s\n", sc_status_name(s));
  return s == SC_OK ? 1 : 0;
}
