// make_device_runtime() as built here: on a machine without a GPU (or a build without CUDA) it
// refuses device tensors with kUnavailable saying why, for available() and open() alike; with a
// GPU it names a UUID it does not see.
#include "daemon/device/device_runtime.h"

#include <gtest/gtest.h>

#include <string>

#include "sparsecar/kernels/cuda.h"

namespace sparsecar {
namespace {

TEST(DeviceRuntime, WithoutAGpuDeviceTensorsAreRefusedSayingWhy) {
  if (kernels::cuda::device_count() > 0) GTEST_SKIP() << "a GPU is visible: see UnknownGpuIsNamed";
  auto runtime = make_device_runtime();
  ASSERT_NE(runtime, nullptr);
  const Status st = runtime->available();
  ASSERT_FALSE(st.ok());
  EXPECT_EQ(st.code(), Code::kUnavailable);
  const std::string& m = st.message();
  EXPECT_TRUE(m.find("GPU") != std::string::npos || m.find("CUDA") != std::string::npos) << m;
  EXPECT_NE(m.find("register a host tensor"), std::string::npos) << m;
  auto opened = runtime->open(1, DeviceRegion{});
  ASSERT_FALSE(opened.ok());
  EXPECT_EQ(opened.status().code(), Code::kUnavailable);
  EXPECT_EQ(opened.status().message(), m);
}

TEST(DeviceRuntime, UnknownGpuIsNamed) {
  if (kernels::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA GPU here: checked on a GPU machine";
  auto runtime = make_device_runtime();
  ASSERT_TRUE(runtime->available().ok()) << runtime->available().to_string();
  DeviceRegion region;
  region.device_uuid.fill(0xee);
  region.bytes = 16;
  auto opened = runtime->open(1, region);
  ASSERT_FALSE(opened.ok());
  EXPECT_EQ(opened.status().code(), Code::kNotFound);
  EXPECT_NE(opened.status().message().find("GPU-eeeeeeee-eeee-eeee-eeee-eeeeeeeeeeee"), std::string::npos)
      << opened.status().message();
}

}  // namespace
}  // namespace sparsecar
