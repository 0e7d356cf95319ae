// DeviceRuntime: the daemon's one owner of what trainers lend it on their GPUs — CUDA IPC
// mappings of their tensors and their interprocess events (session protocol RegisterDevice,
// DESIGN §8). The session asks it to open a registration's handles; the mappings live as long as
// the DeviceBuffer's keepalive, so a step still running on the pipeline keeps them open after the
// client left.
//
// Two implementations, picked at build time by make_device_runtime(): the CUDA one (built when
// CMake finds nvcc) and one that refuses every device tensor with kUnavailable saying why
// ("sparsecard was built without CUDA"), which is also what the CUDA one answers on a machine
// without a GPU or driver. The trainer then registers a host tensor instead.
//
// Thread-safety: available() from any thread; open() from the session thread; the keepalive may
// be dropped on any thread.
#pragma once

#include <array>
#include <cstdint>
#include <memory>

#include "daemon/pipeline/step.h"
#include "sparsecar/common/session_protocol.h"
#include "sparsecar/common/status.h"

namespace sparsecar {

// What a RegisterDevice message says about where the tensor is (untrusted: open() checks it).
struct DeviceRegion {
  std::array<uint8_t, proto::kDeviceUuidBytes> device_uuid{};
  std::array<uint8_t, proto::kIpcHandleBytes> mem_handle{};
  uint64_t offset = 0;  // bytes from the allocation's base
  uint64_t bytes = 0;   // the tensor's bytes (count * 4)
  std::array<uint8_t, proto::kIpcHandleBytes> ready_event{};
  std::array<uint8_t, proto::kIpcHandleBytes> done_event{};
};

// An opened region: the buffer the pipeline uses and the owner of its mappings.
struct OpenedDevice {
  DeviceBuffer buffer;
  std::shared_ptr<const void> keepalive;  // closes the events and the mapping when the last goes
};

class DeviceRuntime {
 public:
  virtual ~DeviceRuntime() = default;
  // Ok when device tensors can be opened here; else kUnavailable with the reason.
  virtual Status available() const = 0;
  // Opens `region` of local client `client`: the device with that UUID (kNotFound naming the
  // UUID when this daemon sees no such GPU), the allocation (one mapping per client and
  // allocation however many tensors it holds: CUDA maps a handle once per process), the
  // tensor's bounds inside it (kInvalidArgument when offset + bytes passes its end or the offset
  // is not 4-aligned) and both events. Errors name the CUDA call and its error text.
  virtual Expected<OpenedDevice> open(uint32_t client, const DeviceRegion& region) = 0;
};

// The CUDA runtime when built with CUDA, else the refusing one.
std::unique_ptr<DeviceRuntime> make_device_runtime();

}  // namespace sparsecar
