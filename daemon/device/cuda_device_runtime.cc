// The CUDA DeviceRuntime (device_runtime.h): opens a trainer's tensor by CUDA IPC (the
// allocation's cudaIpcMemHandle_t + the tensor's offset) and its two interprocess events.
//
// CUDA maps an IPC handle once per process, and several tensors (DDP buckets carved out of one
// caching-allocator segment) can name the same allocation, so mappings are shared: one per
// handle, with a reference per opened tensor; the last keepalive to go closes it. The handle's
// bytes identify the exporting process and allocation, so the cache is keyed by them alone: a
// trainer that reconnects (a new client id) while a step of its old session still holds the
// mapping gets the same mapping instead of CUDA's "already mapped" error.
//
// Every CUDA call is checked (SC_CUDA_TRY): the error names the call and CUDA's text, and is
// logged once here. The driver's cuMemGetAddressRange (the allocation's bounds) is looked up
// through cudart (cudaGetDriverEntryPointByVersion) instead of linking libcuda, so the daemon
// starts on machines without the NVIDIA driver and answers kUnavailable there.
//
// Thread-safety: available() is immutable after construction; open() from the session thread;
// keepalives are dropped on any thread (the mapping table has its own mutex; the current device
// of the dropping thread is restored).
#include <cuda.h>  // CUresult, CUdeviceptr: the types of the one driver entry point used
#include <cuda_runtime.h>

#include <array>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "daemon/device/device_runtime.h"
#include "daemon/device/no_device_runtime.h"
#include "sparsecar/common/log.h"

namespace sparsecar {
namespace {

using Handle = std::array<uint8_t, proto::kIpcHandleBytes>;
using GetAddressRange = CUresult (*)(CUdeviceptr* base, size_t* size, CUdeviceptr ptr);

static_assert(sizeof(cudaIpcMemHandle_t) == proto::kIpcHandleBytes);
static_assert(sizeof(cudaIpcEventHandle_t) == proto::kIpcHandleBytes);
static_assert(sizeof(cudaUUID_t) == proto::kDeviceUuidBytes);

Code code_of(cudaError_t err) {
  switch (err) {
    case cudaErrorInvalidValue:
    case cudaErrorInvalidResourceHandle:
    case cudaErrorInvalidDevicePointer:
    case cudaErrorMapBufferObjectFailed:
      return Code::kInvalidArgument;  // handles that do not open here: the trainer's to fix
    case cudaErrorNoDevice:
    case cudaErrorInsufficientDriver:
    case cudaErrorDevicesUnavailable:
      return Code::kUnavailable;
    default:
      return Code::kInternal;
  }
}

// The status of a failed CUDA call `call` ("cudaIpcOpenMemHandle(...)": the name is what comes
// before the parenthesis), logged once here with `what` (the tensor or device involved).
Status cuda_error(std::string_view call, cudaError_t err, std::string_view what) {
  call = call.substr(0, call.find('('));
  cudaGetLastError();  // clear a non-sticky error so the next call does not report it again
  std::string text = fmt::format("{}: {} ({}) [{}]", call, cudaGetErrorString(err), cudaGetErrorName(err), what);
  SC_LOG_WARN("CUDA: {}", text);
  return Status(code_of(err), std::move(text));
}

#define SC_CUDA_TRY(call, what)                                   \
  do {                                                            \
    const cudaError_t sc_cuda_err_ = (call);                      \
    if (sc_cuda_err_ != cudaSuccess) return cuda_error(#call, sc_cuda_err_, (what)); \
  } while (0)

// Logs a failed CUDA call on a path that cannot return it (destructors).
void cuda_log(std::string_view call, cudaError_t err, std::string_view what) {
  if (err != cudaSuccess) cuda_error(call, err, what).ignore();
}

// "GPU-8f2c1a3e-...", as nvidia-smi -L names GPUs.
std::string uuid_text(const uint8_t* b) {
  std::string out = "GPU-";
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) out += '-';
    out += fmt::format("{:02x}", b[i]);
  }
  return out;
}

// Makes `device` current for the scope and restores the thread's previous device.
class DeviceScope {
 public:
  Status enter(int device) {
    SC_CUDA_TRY(cudaGetDevice(&previous_), "current device");
    if (previous_ == device) return Status::Ok();
    SC_CUDA_TRY(cudaSetDevice(device), fmt::format("device {}", device));
    entered_ = true;
    return Status::Ok();
  }
  ~DeviceScope() {
    if (entered_) cuda_log("cudaSetDevice", cudaSetDevice(previous_), "restoring the current device");
  }

 private:
  int previous_ = -1;
  bool entered_ = false;
};

struct Mapping {
  void* ptr = nullptr;  // the allocation's base in this process
  uint64_t bytes = 0;   // from ptr to the end of the allocation
  int device = -1;
  uint32_t refs = 0;    // opened tensors (leases) using it
};

// The mapping table, shared by the runtime and every lease (which may outlive the runtime).
struct Mappings {
  std::mutex mu;
  std::map<Handle, Mapping> by_handle;  // guarded by mu

  // Drops one reference (or none: `take_ref` false) and closes the mapping when none is left.
  void release(const Handle& handle, bool take_ref) {
    std::lock_guard<std::mutex> lock(mu);
    auto it = by_handle.find(handle);
    if (it == by_handle.end()) return;
    if (take_ref && it->second.refs > 0) --it->second.refs;
    if (it->second.refs != 0) return;
    DeviceScope scope;
    if (scope.enter(it->second.device).ok()) {
      cuda_log("cudaIpcCloseMemHandle", cudaIpcCloseMemHandle(it->second.ptr), "a trainer's allocation");
    }
    by_handle.erase(it);
  }
};

// One opened tensor: its events and a reference to its mapping (OpenedDevice::keepalive).
struct Lease {
  std::shared_ptr<Mappings> mappings;
  Handle handle{};
  int device = -1;
  cudaEvent_t ready = nullptr;
  cudaEvent_t done = nullptr;

  Lease() = default;
  Lease(const Lease&) = delete;
  Lease& operator=(const Lease&) = delete;
  ~Lease() {
    {
      DeviceScope scope;
      if (scope.enter(device).ok()) {
        if (ready != nullptr) cuda_log("cudaEventDestroy", cudaEventDestroy(ready), "ready event");
        if (done != nullptr) cuda_log("cudaEventDestroy", cudaEventDestroy(done), "done event");
      }
    }
    if (mappings) mappings->release(handle, /*take_ref=*/true);
  }
};

struct Gpu {
  int ordinal = 0;
  std::array<uint8_t, proto::kDeviceUuidBytes> uuid{};
  std::string name;
};

class CudaDeviceRuntime final : public DeviceRuntime {
 public:
  CudaDeviceRuntime() : mappings_(std::make_shared<Mappings>()) { available_ = discover(); }

  Status available() const override { return available_; }

  Expected<OpenedDevice> open(uint32_t client, const DeviceRegion& region) override {
    SC_RETURN_IF_ERROR(available_);
    if (region.offset % sizeof(float) != 0) {
      return invalid_argument(fmt::format("device offset {} is not a multiple of 4",
                                          static_cast<unsigned long long>(region.offset)));
    }
    const Gpu* gpu = nullptr;
    for (const Gpu& g : gpus_) {
      if (g.uuid == region.device_uuid) gpu = &g;
    }
    if (gpu == nullptr) {
      std::string seen;
      for (const Gpu& g : gpus_) {
        seen += fmt::format("{}{}: {} ({})", seen.empty() ? "" : ", ", g.ordinal, uuid_text(g.uuid.data()), g.name);
      }
      return not_found(fmt::format("no GPU with UUID {} is visible to sparsecard (it sees {}); run the daemon where "
                                   "it sees the trainers' GPUs (CUDA_VISIBLE_DEVICES)",
                                   uuid_text(region.device_uuid.data()), seen));
    }
    const std::string who = fmt::format("client {}, GPU {}", client, gpu->ordinal);
    DeviceScope scope;
    SC_RETURN_IF_ERROR(scope.enter(gpu->ordinal));

    std::lock_guard<std::mutex> lock(mappings_->mu);
    auto it = mappings_->by_handle.find(region.mem_handle);
    if (it == mappings_->by_handle.end()) {
      auto mapped = map(region.mem_handle, gpu->ordinal, who);
      if (!mapped.ok()) return mapped.status();
      it = mappings_->by_handle.emplace(region.mem_handle, *mapped).first;
    }
    Mapping& m = it->second;
    // An unused fresh mapping is closed again when anything below fails.
    auto fail = [&](Status st) -> Status {
      if (m.refs == 0) {
        cuda_log("cudaIpcCloseMemHandle", cudaIpcCloseMemHandle(m.ptr), who);
        mappings_->by_handle.erase(it);
      }
      return st;
    };
    if (m.device != gpu->ordinal) {
      return fail(invalid_argument(fmt::format("the allocation is mapped on GPU {}, the registration names GPU {} ({})",
                                               m.device, gpu->ordinal, uuid_text(gpu->uuid.data()))));
    }
    if (region.offset > m.bytes || region.bytes > m.bytes - region.offset) {
      return fail(invalid_argument(fmt::format(
          "the tensor ({} bytes at offset {}) passes the end of its allocation ({} bytes)",
          static_cast<unsigned long long>(region.bytes), static_cast<unsigned long long>(region.offset),
          static_cast<unsigned long long>(m.bytes))));
    }
    auto lease = std::make_shared<Lease>();
    lease->device = gpu->ordinal;
    if (Status st = open_event(region.ready_event, &lease->ready, "ready event, " + who); !st.ok()) return fail(st);
    if (Status st = open_event(region.done_event, &lease->done, "done event, " + who); !st.ok()) {
      cuda_log("cudaEventDestroy", cudaEventDestroy(lease->ready), who);
      lease->ready = nullptr;
      return fail(st);
    }
    ++m.refs;
    lease->mappings = mappings_;  // from here on the lease owns one reference
    lease->handle = region.mem_handle;

    OpenedDevice out;
    out.buffer.data = reinterpret_cast<float*>(static_cast<char*>(m.ptr) + region.offset);
    out.buffer.device = gpu->ordinal;
    out.buffer.ready_event = lease->ready;
    out.buffer.done_event = lease->done;
    out.keepalive = std::move(lease);
    return out;
  }

 private:
  Status discover() {
    int count = 0;
    const cudaError_t err = cudaGetDeviceCount(&count);
    if (err != cudaSuccess) {
      cudaGetLastError();
      return unavailable(fmt::format("no GPU visible to sparsecard (cudaGetDeviceCount: {}: {}): device tensors are "
                                     "refused; register a host tensor (the DDP hook does this by itself)",
                                     cudaGetErrorName(err), cudaGetErrorString(err)));
    }
    if (count == 0) {
      return unavailable("no GPU visible to sparsecard (cudaGetDeviceCount found none): device tensors are refused; "
                         "register a host tensor (the DDP hook does this by itself)");
    }
    for (int i = 0; i < count; ++i) {
      cudaDeviceProp prop{};
      if (Status st = [&]() -> Status {
            SC_CUDA_TRY(cudaGetDeviceProperties(&prop, i), fmt::format("GPU {}", i));
            return Status::Ok();
          }();
          !st.ok()) {
        return unavailable("no usable GPU: " + st.message());
      }
      Gpu g;
      g.ordinal = i;
      std::memcpy(g.uuid.data(), &prop.uuid, g.uuid.size());
      g.name = prop.name;
      gpus_.push_back(std::move(g));
    }
    void* fn = nullptr;
    cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
    const cudaError_t lookup = cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &found);
    if (lookup != cudaSuccess || found != cudaDriverEntryPointSuccess || fn == nullptr) {
      cudaGetLastError();
      return unavailable(fmt::format("the CUDA driver has no cuMemGetAddressRange ({}): device tensors are refused",
                                     cudaGetErrorString(lookup)));
    }
    get_range_ = reinterpret_cast<GetAddressRange>(fn);
    std::string seen;
    for (const Gpu& g : gpus_) seen += fmt::format(" {}: {} ({})", g.ordinal, uuid_text(g.uuid.data()), g.name);
    SC_LOG_INFO("device tensors: {} GPU(s) visible:{}", gpus_.size(), seen);
    return Status::Ok();
  }

  // Maps the allocation of `handle` (current device: `device`) and measures it.
  Expected<Mapping> map(const Handle& handle, int device, const std::string& who) {
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handle.data(), sizeof h);
    Mapping m;
    m.device = device;
    SC_CUDA_TRY(cudaIpcOpenMemHandle(&m.ptr, h, cudaIpcMemLazyEnablePeerAccess), who);
    CUdeviceptr base = 0;
    size_t size = 0;
    const CUresult r = get_range_(&base, &size, reinterpret_cast<CUdeviceptr>(m.ptr));
    const auto ptr = reinterpret_cast<CUdeviceptr>(m.ptr);
    if (r != CUDA_SUCCESS || ptr < base || ptr - base > size) {
      cuda_log("cudaIpcCloseMemHandle", cudaIpcCloseMemHandle(m.ptr), who);
      SC_LOG_WARN("CUDA: cuMemGetAddressRange: CUresult {} [{}]", static_cast<int>(r), who);
      return internal_error(fmt::format("cuMemGetAddressRange: CUresult {} [{}]", static_cast<int>(r), who));
    }
    m.bytes = size - (ptr - base);
    return m;
  }

  static Status open_event(const Handle& handle, cudaEvent_t* out, const std::string& what) {
    cudaIpcEventHandle_t h;
    std::memcpy(&h, handle.data(), sizeof h);
    SC_CUDA_TRY(cudaIpcOpenEventHandle(out, h), what);
    return Status::Ok();
  }

  Status available_;
  std::vector<Gpu> gpus_;
  GetAddressRange get_range_ = nullptr;
  std::shared_ptr<Mappings> mappings_;
};

}  // namespace

std::unique_ptr<DeviceRuntime> make_device_runtime() { return std::make_unique<CudaDeviceRuntime>(); }

}  // namespace sparsecar
