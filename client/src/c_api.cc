// The C ABI (sparsecar.h) over the C++ client. Nothing may unwind through extern "C": every
// entry point catches what the C++ side could throw (allocation) and turns it into a status.
#include "sparsecar/sparsecar.h"

#include <cstring>
#include <exception>
#include <memory>
#include <new>
#include <string>
#include <vector>

#include "sparsecar/client.h"

struct sc_client {
  std::unique_ptr<sparsecar::Client> client;
  std::string last_error;
};

namespace {

thread_local std::string t_last_error;

sc_status record(sc_client* client, const sparsecar::Status& st) {
  if (st.ok()) return SC_OK;
  std::string text = st.to_string();
  if (client != nullptr) client->last_error = text;
  t_last_error = std::move(text);
  return static_cast<sc_status>(st.code());
}

sparsecar::Tensor* as_tensor(sc_tensor* t) { return reinterpret_cast<sparsecar::Tensor*>(t); }
const sparsecar::Tensor* as_tensor(const sc_tensor* t) {
  return reinterpret_cast<const sparsecar::Tensor*>(t);
}

template <typename F>
sc_status guarded(sc_client* client, F&& body) {
  try {
    return body();
  } catch (const std::bad_alloc&) {
    return record(client, sparsecar::resource_exhausted("out of memory"));
  } catch (const std::exception& e) {
    return record(client, sparsecar::internal_error(e.what()));
  } catch (...) {
    return record(client, sparsecar::internal_error("unknown exception"));
  }
}

}  // namespace

extern "C" {

int sc_abi_version(void) { return SPARSECAR_C_ABI_VERSION; }

const char* sc_status_name(sc_status status) {
  if (status < 0 || status > SC_RESOURCE_EXHAUSTED) return "UNKNOWN";
  // code_name returns views of string literals: NUL-terminated.
  return sparsecar::code_name(static_cast<sparsecar::Code>(status)).data();
}

const char* sc_last_error(void) { return t_last_error.c_str(); }

sc_status sc_connect(const char* socket_path, int64_t timeout_ms, sc_client** out) {
  if (out != nullptr) *out = nullptr;
  if (socket_path == nullptr || out == nullptr || timeout_ms < 0) {
    return record(nullptr, sparsecar::invalid_argument("sc_connect: NULL path/out or negative timeout"));
  }
  return guarded(nullptr, [&]() -> sc_status {
    sparsecar::ConnectOptions options;
    options.timeout = std::chrono::milliseconds(timeout_ms);
    auto client = sparsecar::Client::connect(socket_path, options);
    if (!client.ok()) return record(nullptr, client.status());
    auto* handle = new sc_client;
    handle->client = std::move(client).value();
    *out = handle;
    return SC_OK;
  });
}

void sc_client_close(sc_client* client) { delete client; }

const char* sc_client_last_error(const sc_client* client) {
  return client == nullptr ? "" : client->last_error.c_str();
}

sc_status sc_register_tensor(sc_client* client, const char* name, uint64_t count, int32_t dtype,
                             sc_tensor** out) {
  return sc_register_tensor_shaped(client, name, count, dtype, nullptr, 0, out);
}

sc_status sc_register_tensor_shaped(sc_client* client, const char* name, uint64_t count, int32_t dtype,
                                    const uint64_t* shape, uint32_t ndim, sc_tensor** out) {
  if (out != nullptr) *out = nullptr;
  if (client == nullptr || name == nullptr || out == nullptr || (ndim > 0 && shape == nullptr)) {
    return record(client, sparsecar::invalid_argument("sc_register_tensor: NULL argument"));
  }
  if (dtype != SC_DTYPE_F32) {
    return record(client, sparsecar::invalid_argument("sc_register_tensor: only SC_DTYPE_F32"));
  }
  if (ndim > SC_MAX_DIMS) {
    return record(client, sparsecar::invalid_argument("sc_register_tensor_shaped: " + std::to_string(ndim) +
                                                      " dims; at most " + std::to_string(SC_MAX_DIMS)));
  }
  return guarded(client, [&]() -> sc_status {
    std::vector<uint64_t> dims(shape, shape + ndim);
    auto t = client->client->register_tensor(name, count, sparsecar::DType::kF32, dims);
    if (!t.ok()) return record(client, t.status());
    *out = reinterpret_cast<sc_tensor*>(t.value());
    return SC_OK;
  });
}

sc_status sc_register_device_tensor(sc_client* client, const char* name, uint64_t count, int32_t dtype,
                                    const uint64_t* shape, uint32_t ndim, const sc_device_handles* handles,
                                    sc_tensor** out) {
  if (out != nullptr) *out = nullptr;
  if (client == nullptr || name == nullptr || out == nullptr || handles == nullptr || (ndim > 0 && shape == nullptr)) {
    return record(client, sparsecar::invalid_argument("sc_register_device_tensor: NULL argument"));
  }
  if (dtype != SC_DTYPE_F32) {
    return record(client, sparsecar::invalid_argument("sc_register_device_tensor: only SC_DTYPE_F32"));
  }
  if (ndim > SC_MAX_DIMS) {
    return record(client, sparsecar::invalid_argument("sc_register_device_tensor: " + std::to_string(ndim) +
                                                      " dims; at most " + std::to_string(SC_MAX_DIMS)));
  }
  return guarded(client, [&]() -> sc_status {
    sparsecar::DeviceHandles h;
    std::memcpy(h.device_uuid.data(), handles->device_uuid, h.device_uuid.size());
    std::memcpy(h.mem_handle.data(), handles->mem_handle, h.mem_handle.size());
    std::memcpy(h.ready_event.data(), handles->ready_event, h.ready_event.size());
    std::memcpy(h.done_event.data(), handles->done_event, h.done_event.size());
    h.offset = handles->offset;
    auto t = client->client->register_device_tensor(name, count, h, std::span<const uint64_t>(shape, ndim));
    if (!t.ok()) return record(client, t.status());
    *out = reinterpret_cast<sc_tensor*>(t.value());
    return SC_OK;
  });
}

int sc_tensor_on_device(const sc_tensor* tensor) {
  return tensor != nullptr && as_tensor(tensor)->on_device() ? 1 : 0;
}

float* sc_tensor_data(sc_tensor* tensor) {
  return tensor == nullptr ? nullptr : as_tensor(tensor)->data();
}
uint64_t sc_tensor_size(const sc_tensor* tensor) {
  return tensor == nullptr ? 0 : as_tensor(tensor)->size();
}
uint32_t sc_tensor_id(const sc_tensor* tensor) {
  return tensor == nullptr ? 0 : as_tensor(tensor)->id();
}
const char* sc_tensor_name(const sc_tensor* tensor) {
  return tensor == nullptr ? "" : as_tensor(tensor)->name().c_str();
}
uint32_t sc_tensor_ndim(const sc_tensor* tensor) {
  return tensor == nullptr ? 0 : static_cast<uint32_t>(as_tensor(tensor)->shape().size());
}
uint64_t sc_tensor_dim(const sc_tensor* tensor, uint32_t i) {
  if (tensor == nullptr || i >= as_tensor(tensor)->shape().size()) return 0;
  return as_tensor(tensor)->shape()[i];
}

sc_status sc_submit(sc_client* client, sc_tensor* tensor, uint64_t step, float lr) {
  return sc_submit_flags(client, tensor, step, lr, 0);
}

sc_status sc_submit_flags(sc_client* client, sc_tensor* tensor, uint64_t step, float lr, uint32_t flags) {
  if (client == nullptr || tensor == nullptr) {
    return record(client, sparsecar::invalid_argument("sc_submit: NULL argument"));
  }
  if ((flags & ~SC_SUBMIT_TRAINER_REDUCES) != 0) {
    return record(client, sparsecar::invalid_argument("sc_submit_flags: unknown flag bits " + std::to_string(flags)));
  }
  return guarded(client, [&]() -> sc_status {
    sparsecar::SubmitOptions options;
    options.lr = lr;
    options.trainer_reduces = (flags & SC_SUBMIT_TRAINER_REDUCES) != 0;
    return record(client, client->client->submit(*as_tensor(tensor), step, options));
  });
}

sc_status sc_wait(sc_client* client, sc_tensor* tensor, uint64_t step, int64_t timeout_ms,
                  sc_step_info* info) {
  return sc_wait_flags(client, tensor, step, timeout_ms, info, nullptr);
}

sc_status sc_wait_flags(sc_client* client, sc_tensor* tensor, uint64_t step, int64_t timeout_ms,
                        sc_step_info* info, uint32_t* flags) {
  if (client == nullptr || tensor == nullptr || timeout_ms < 0) {
    return record(client, sparsecar::invalid_argument("sc_wait: NULL argument or negative timeout"));
  }
  return guarded(client, [&]() -> sc_status {
    auto r = client->client->wait(*as_tensor(tensor), step, std::chrono::milliseconds(timeout_ms));
    if (!r.ok()) return record(client, r.status());
    if (info != nullptr) {
      info->step = r->step;
      info->bytes_sent = r->bytes_sent;
      info->dense_bytes = r->dense_bytes;
      info->nnz = r->nnz;
    }
    if (flags != nullptr) *flags = r->trainer_reduces ? SC_STEP_TRAINER_REDUCES : 0;
    return SC_OK;
  });
}

int sc_step_in_flight(sc_client* client, sc_tensor* tensor, uint64_t step) {
  if (client == nullptr || tensor == nullptr || client->client == nullptr) return 0;
  return client->client->in_flight(*as_tensor(tensor), step) ? 1 : 0;
}

sc_status sc_report_metric(sc_client* client, const char* name, double value, uint64_t step) {
  if (client == nullptr || name == nullptr) {
    return record(client, sparsecar::invalid_argument("sc_report_metric: NULL argument"));
  }
  return guarded(client, [&]() -> sc_status {
    return record(client, client->client->report_metric(name, value, step));
  });
}

}  // extern "C"

static_assert(SC_RESOURCE_EXHAUSTED == static_cast<int>(sparsecar::Code::kResourceExhausted));
static_assert(SC_ABORTED == static_cast<int>(sparsecar::Code::kAborted));
static_assert(SC_DEADLINE_EXCEEDED == static_cast<int>(sparsecar::Code::kDeadlineExceeded));
static_assert(SC_UNAVAILABLE == static_cast<int>(sparsecar::Code::kUnavailable));
static_assert(SC_MAX_DIMS == sparsecar::Client::kMaxDims);
static_assert(sizeof(sc_device_handles::device_uuid) == sizeof(sparsecar::DeviceHandles::device_uuid));
static_assert(sizeof(sc_device_handles::mem_handle) == sizeof(sparsecar::DeviceHandles::mem_handle));
static_assert(sizeof(sc_device_handles::ready_event) == sizeof(sparsecar::DeviceHandles::ready_event));
static_assert(sizeof(sc_device_handles::done_event) == sizeof(sparsecar::DeviceHandles::done_event));
static_assert(SC_PERMISSION_DENIED == static_cast<int>(sparsecar::Code::kPermissionDenied));
