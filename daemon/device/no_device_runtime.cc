// The refusing DeviceRuntime (no_device_runtime.h), and make_device_runtime() of a daemon built
// without CUDA.
#include "daemon/device/no_device_runtime.h"

#include <utility>

#include "sparsecar/common/log.h"

namespace sparsecar {
namespace {

class RefusingDeviceRuntime final : public DeviceRuntime {
 public:
  explicit RefusingDeviceRuntime(Status why) : why_(std::move(why)) {
    SC_CHECK(!why_.ok(), "a refusing device runtime needs a reason");
  }
  Status available() const override { return why_; }
  Expected<OpenedDevice> open(uint32_t client, const DeviceRegion& region) override {
    (void)client;
    (void)region;
    return why_;
  }

 private:
  Status why_;
};

}  // namespace

std::unique_ptr<DeviceRuntime> make_refusing_device_runtime(Status why) {
  return std::make_unique<RefusingDeviceRuntime>(std::move(why));
}

#if !defined(SPARSECAR_DEVICE_CUDA)
std::unique_ptr<DeviceRuntime> make_device_runtime() {
  return make_refusing_device_runtime(
      unavailable("sparsecard was built without CUDA: device tensors are refused; register a host tensor "
                  "(the DDP hook does this by itself)"));
}
#endif

}  // namespace sparsecar
