// The DeviceRuntime that refuses every device tensor with one fixed status (kUnavailable and
// the reason): what a daemon built without CUDA uses, and what the CUDA runtime falls back to
// on a machine without a GPU or driver. Internal to daemon/device.
//
// Thread-safety: immutable after construction.
#pragma once

#include <memory>

#include "daemon/device/device_runtime.h"

namespace sparsecar {

// `why` must not be OK: available() and open() answer it.
std::unique_ptr<DeviceRuntime> make_refusing_device_runtime(Status why);

}  // namespace sparsecar
