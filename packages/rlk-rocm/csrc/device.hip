// Build and device facts for the backend's probe: the HIP version, the compiled GPU targets, the device
// count, and whether this module has a code object for a given device.
#include <string>
#include <vector>

#include "launch.h"

#ifndef RLK_ROCM_ARCHITECTURES
#define RLK_ROCM_ARCHITECTURES ""
#endif

namespace rlk_rocm {
namespace {

// Compiled for the same targets as every kernel of the module: its code object exists for a device exactly
// when theirs do.
__global__ void image_probe_kernel() {}

}  // namespace

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32:
      return "float32";
    case DType::kFloat16:
      return "float16";
    case DType::kBFloat16:
      return "bfloat16";
  }
  return "unknown";
}

int runtime_version() { return HIP_VERSION; }

int device_count() {
  int count = 0;
  if (hipGetDeviceCount(&count) != hipSuccess) {
    (void)hipGetLastError();  // clear the error so the next call does not report it
    return 0;
  }
  return count;
}

std::vector<std::string> compiled_architectures() {
  std::vector<std::string> archs;
  const std::string list = RLK_ROCM_ARCHITECTURES;
  size_t start = 0;
  while (start < list.size()) {
    size_t end = list.find(';', start);
    if (end == std::string::npos) end = list.size();
    if (end > start) archs.push_back(list.substr(start, end - start));
    start = end + 1;
  }
  return archs;
}

std::string device_arch(int device) {
  if (device < 0 || device >= device_count()) return "";
  hipDeviceProp_t prop;
  if (hipGetDeviceProperties(&prop, device) != hipSuccess) {
    (void)hipGetLastError();
    return "";
  }
  return prop.gcnArchName;
}

std::string device_problem(int device) {
  const int count = device_count();
  if (device < 0 || device >= count) {
    return "no HIP device " + std::to_string(device) + " (" + std::to_string(count) + " visible)";
  }
  int previous = 0;
  if (hipGetDevice(&previous) != hipSuccess) previous = device;
  std::string problem;
  if (hipSetDevice(device) != hipSuccess) {
    problem = "hipSetDevice(" + std::to_string(device) + ") failed: " + hipGetErrorString(hipGetLastError());
  } else {
    // Asking for a kernel's attributes loads this module's code object for the device: it fails
    // (hipErrorNoBinaryForGpu / hipErrorInvalidDeviceFunction) when none fits.
    hipFuncAttributes attrs;
    const hipError_t err = hipFuncGetAttributes(&attrs, reinterpret_cast<const void*>(image_probe_kernel));
    if (err != hipSuccess) {
      (void)hipGetLastError();
      problem = "no code object for GPU " + std::to_string(device) + " (" + device_arch(device) + "): built for " +
                std::string(RLK_ROCM_ARCHITECTURES) + " (" + hipGetErrorName(err) +
                "); rebuild with RLK_ROCM_ARCHS including it";
    }
  }
  (void)hipSetDevice(previous);
  return problem;
}

}  // namespace rlk_rocm
