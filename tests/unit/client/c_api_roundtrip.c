/* The C ABI used from C: this file must compile as C (no C++ in sparsecar.h). */
#include <string.h>

#include "sparsecar/sparsecar.h"

/* Connects, registers "c.w" of n elements, submits x[i] = i + 1 for `step`, waits, and checks the
 * daemon's answer (the test pipeline returns local_sum * 0.5). Returns 0 on success, else the
 * number of the failed check. */
int sc_test_c_roundtrip(const char* socket_path, uint64_t step) {
  sc_client* client = NULL;
  sc_tensor* w = NULL;
  sc_step_info info;
  uint64_t i, n = 33;
  float* data;
  int rc = 0;
  if (sc_connect(socket_path, 5000, &client) != SC_OK || client == NULL) return 1;
  if (sc_register_tensor(client, "c.w", n, SC_DTYPE_F32, &w) != SC_OK || w == NULL) {
    rc = 2;
    goto out;
  }
  if (sc_tensor_size(w) != n || strcmp(sc_tensor_name(w), "c.w") != 0) {
    rc = 3;
    goto out;
  }
  data = sc_tensor_data(w);
  for (i = 0; i < n; ++i) data[i] = (float)(i + 1);
  if (sc_submit(client, w, step, 0.5f) != SC_OK) {
    rc = 4;
    goto out;
  }
  memset(&info, 0, sizeof info);
  if (sc_wait(client, w, step, 5000, &info) != SC_OK) {
    rc = 5;
    goto out;
  }
  if (info.step != step || info.nnz != n) {
    rc = 6;
    goto out;
  }
  for (i = 0; i < n; ++i) {
    if (data[i] != (float)(i + 1) * 0.5f) {
      rc = 7;
      goto out;
    }
  }
  if (sc_report_metric(client, "loss", 0.25, step) != SC_OK) rc = 8;
out:
  sc_client_close(client);
  return rc;
}
