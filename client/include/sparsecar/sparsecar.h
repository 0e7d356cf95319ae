/* sparsecar C ABI: the client library for trainers written in C or loaded through an FFI
 * (ctypes, cffi, Rust, Julia). It mirrors the C++ API of client.h one to one.
 *
 *   sc_client* client = NULL;
 *   if (sc_connect("/run/sparsecar/sparsecard.sock", 10000, &client) != SC_OK) {
 *     fprintf(stderr, "%s\n", sc_last_error());
 *   }
 *   sc_tensor* w = NULL;
 *   sc_register_tensor(client, "fc.weight", 5000, SC_DTYPE_F32, &w);
 *   memcpy(sc_tensor_data(w), grad, 5000 * sizeof(float));
 *   sc_submit(client, w, step, 0.1f);
 *   sc_step_info info;
 *   if (sc_wait(client, w, step, 30000, &info) != SC_OK) {
 *     fprintf(stderr, "%s\n", sc_client_last_error(client));
 *   }
 *   sc_client_close(client);   // also frees every sc_tensor of the client
 *
 * Status codes are the numbers of sparsecar::Code (frozen). Every call that fails stores its
 * message: sc_client_last_error(client) for calls on a client, and sc_last_error() (per
 * thread) for every failed call, including sc_connect. Strings returned stay valid until the
 * next call on the same client (resp. thread).
 * Thread-safety: one client from one thread at a time; different clients are independent.
 * No function throws or aborts on bad input; NULL handles give SC_INVALID_ARGUMENT.
 */
#ifndef SPARSECAR_SPARSECAR_H_
#define SPARSECAR_SPARSECAR_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 2: sc_register_tensor_shaped, sc_tensor_ndim, sc_tensor_dim (version 1 calls unchanged).
 * 3: GPU tensors by CUDA IPC handles: sc_device_handles, sc_register_device_tensor,
 *    sc_tensor_on_device (version 1 and 2 calls unchanged).
 * 4: dense steps the trainer all-reduces itself: sc_submit_flags, sc_wait_flags,
 *    SC_SUBMIT_TRAINER_REDUCES, SC_STEP_TRAINER_REDUCES (earlier calls unchanged). */
#define SPARSECAR_C_ABI_VERSION 4

typedef int32_t sc_status;
enum {
  SC_OK = 0,
  SC_INVALID_ARGUMENT = 1,
  SC_NOT_FOUND = 2,
  SC_ALREADY_EXISTS = 3,
  SC_OUT_OF_RANGE = 4,
  SC_DEADLINE_EXCEEDED = 5,
  SC_UNAVAILABLE = 6,
  SC_DATA_LOSS = 7,
  SC_FAILED_PRECONDITION = 8,
  SC_PERMISSION_DENIED = 9,
  SC_INTERNAL = 10,
  SC_WOULD_BLOCK = 11,
  SC_ABORTED = 12,
  SC_RESOURCE_EXHAUSTED = 13
};

enum { SC_DTYPE_F32 = 0 };
enum { SC_MAX_DIMS = 4 }; /* most dims a registered shape may have */

/* sc_submit_flags: this trainer all-reduces a dense step itself when the daemon asks (the
 * daemons' knob dense_collective=trainer, where every trainer of the job says so); not sent to a
 * daemon older than the knob. Since ABI version 4. */
#define SC_SUBMIT_TRAINER_REDUCES 1u
/* sc_wait_flags: the slot holds this trainer's share of its node's contribution, not the average:
 * sum it over every trainer of the job (an all-reduce of the trainer's own) and divide by their
 * number. Only for a submit with SC_SUBMIT_TRAINER_REDUCES. Since ABI version 4. */
#define SC_STEP_TRAINER_REDUCES 1u

typedef struct sc_client sc_client;  /* a session with the local daemon */
typedef struct sc_tensor sc_tensor;  /* a registered tensor; owned by its client */

/* Where a GPU tensor is, as the bytes of the CUDA IPC types (no CUDA header needed here):
 * cudaIpcGetMemHandle of the base of the allocation holding the tensor, the tensor's byte offset
 * from that base (a multiple of 4), cudaIpcGetEventHandle of two events the trainer created with
 * cudaEventInterprocess | cudaEventDisableTiming on the tensor's device, and that device's
 * cudaDeviceProp::uuid. Since ABI version 3. */
typedef struct sc_device_handles {
  uint8_t device_uuid[16]; /* cudaUUID_t */
  uint8_t mem_handle[64];  /* cudaIpcMemHandle_t of the allocation's base */
  uint64_t offset;         /* bytes from the allocation's base to the tensor */
  uint8_t ready_event[64]; /* cudaIpcEventHandle_t: the trainer records it after writing the gradient */
  uint8_t done_event[64];  /* cudaIpcEventHandle_t: the daemon records it after writing the average */
} sc_device_handles;

typedef struct sc_step_info {
  uint64_t step;
  uint64_t bytes_sent;   /* bytes the local daemon put on the wire for this (tensor, step) */
  uint64_t dense_bytes;  /* what a dense exchange would have sent */
  uint64_t nnz;          /* elements the local daemon selected */
} sc_step_info;

/* The C ABI version this library implements (SPARSECAR_C_ABI_VERSION). */
int sc_abi_version(void);
/* "OK", "DEADLINE_EXCEEDED", ... ; "UNKNOWN" for other numbers. Static storage. */
const char* sc_status_name(sc_status status);
/* Message of the last failed call on this thread ("" if none). */
const char* sc_last_error(void);

/* Connects to the daemon's Unix socket, retrying up to timeout_ms while it is missing or
 * refusing, and performs the handshake. On success *out is a new client. */
sc_status sc_connect(const char* socket_path, int64_t timeout_ms, sc_client** out);
/* Closes the session, unmaps every tensor of it. NULL is ignored. */
void sc_client_close(sc_client* client);
/* Message of the last failed call on this client ("" if none). */
const char* sc_client_last_error(const sc_client* client);

/* Registers a tensor of `count` elements (dtype SC_DTYPE_F32) and maps its shared slot.
 * Registering the same name with the same count again returns the same tensor. */
sc_status sc_register_tensor(sc_client* client, const char* name, uint64_t count, int32_t dtype,
                             sc_tensor** out);
/* The same with the tensor's shape: ndim (1..SC_MAX_DIMS) row-major dims, shape[0] leading, each
 * >= 1, product == count (else SC_INVALID_ARGUMENT). ndim == 0 (shape may then be NULL) is
 * sc_register_tensor. Structured selectors (rows, columns, conv channels, attention heads) use
 * the shape; every trainer must register a name with the same shape. Since ABI version 2. */
sc_status sc_register_tensor_shaped(sc_client* client, const char* name, uint64_t count, int32_t dtype,
                                    const uint64_t* shape, uint32_t ndim, sc_tensor** out);
/* Registers an fp32 tensor (dtype SC_DTYPE_F32) of `count` elements that lives in GPU memory, by
 * its CUDA IPC handles; shape/ndim as sc_register_tensor_shaped (ndim 0: no shape). No slot is
 * mapped: sc_tensor_data() is NULL and sc_tensor_on_device() 1. Per step the trainer records
 * `ready` on its stream after writing the gradient, then calls sc_submit; after sc_wait returns
 * SC_OK its stream waits on `done` (cudaStreamWaitEvent) before it reads the average. A daemon
 * built without CUDA or without a GPU answers SC_UNAVAILABLE with its reason
 * (sc_client_last_error): register a host tensor instead; the session stays usable.
 * Since ABI version 3. */
sc_status sc_register_device_tensor(sc_client* client, const char* name, uint64_t count, int32_t dtype,
                                    const uint64_t* shape, uint32_t ndim, const sc_device_handles* handles,
                                    sc_tensor** out);
float* sc_tensor_data(sc_tensor* tensor);      /* count floats; NULL for NULL or a device tensor */
/* 1 for a tensor registered with sc_register_device_tensor, else 0. Since ABI version 3. */
int sc_tensor_on_device(const sc_tensor* tensor);
uint64_t sc_tensor_size(const sc_tensor* tensor);
uint32_t sc_tensor_id(const sc_tensor* tensor);
const char* sc_tensor_name(const sc_tensor* tensor);
/* Dims of the registered shape (0 when registered without one or for NULL), and dim i (0 when
 * i >= ndim). Since ABI version 2. */
uint32_t sc_tensor_ndim(const sc_tensor* tensor);
uint64_t sc_tensor_dim(const sc_tensor* tensor, uint32_t i);

/* Hands the tensor's contents for `step` to the daemon; lr = learning rate (0 = not given).
 * Non-blocking. The slot belongs to the daemon until the matching sc_wait succeeds or fails. */
sc_status sc_submit(sc_client* client, sc_tensor* tensor, uint64_t step, float lr);
/* sc_submit with flags: 0 or SC_SUBMIT_TRAINER_REDUCES (other bits: SC_INVALID_ARGUMENT).
 * Since ABI version 4. */
sc_status sc_submit_flags(sc_client* client, sc_tensor* tensor, uint64_t step, float lr, uint32_t flags);
/* Waits up to timeout_ms for (tensor, step). SC_OK: the slot holds the averaged gradient and
 * *info (may be NULL) describes the step. Any other status is the daemon's for the step, with its
 * message, or this wait's own SC_DEADLINE_EXCEEDED: then sc_step_in_flight() is 1 and calling
 * again keeps waiting (0: the daemon failed the step with DEADLINE_EXCEEDED; it is over). */
sc_status sc_wait(sc_client* client, sc_tensor* tensor, uint64_t step, int64_t timeout_ms,
                  sc_step_info* info);
/* sc_wait that also says how the slot is to be read: *flags (may be NULL) is 0 or
 * SC_STEP_TRAINER_REDUCES on SC_OK. Since ABI version 4. */
sc_status sc_wait_flags(sc_client* client, sc_tensor* tensor, uint64_t step, int64_t timeout_ms,
                        sc_step_info* info, uint32_t* flags);
/* 1 while (tensor, step) was submitted and sc_wait has not returned its completion, else 0. */
int sc_step_in_flight(sc_client* client, sc_tensor* tensor, uint64_t step);
/* Reports a named scalar (e.g. "loss") for a step. */
sc_status sc_report_metric(sc_client* client, const char* name, double value, uint64_t step);

#ifdef __cplusplus
}  /* extern "C" */
#endif

#endif  /* SPARSECAR_SPARSECAR_H_ */
