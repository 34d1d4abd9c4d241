// Build and device facts for the backend's probe: runtime / driver versions, compiled
// architectures, and whether this module has a kernel image for a given device.
#include <string>
#include <vector>

#include "launch.cuh"

#ifndef RLK_CUDA_ARCHITECTURES
#define RLK_CUDA_ARCHITECTURES ""
#endif

namespace rlk_cuda {
namespace {

// Compiled for the same architectures as every kernel of the module: its image exists for a device
// exactly when theirs do.
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

int runtime_version() { return CUDART_VERSION; }

int driver_version() {
  int version = 0;
  if (cudaDriverGetVersion(&version) != cudaSuccess) return 0;
  return version;
}

int device_count() {
  int count = 0;
  if (cudaGetDeviceCount(&count) != cudaSuccess) {
    cudaGetLastError();  // clear the error so the next call does not report it
    return 0;
  }
  return count;
}

std::vector<std::string> compiled_architectures() {
  std::vector<std::string> archs;
  const std::string list = RLK_CUDA_ARCHITECTURES;
  size_t start = 0;
  while (start < list.size()) {
    size_t end = list.find(';', start);
    if (end == std::string::npos) end = list.size();
    if (end > start) archs.push_back(list.substr(start, end - start));
    start = end + 1;
  }
  return archs;
}

std::string device_problem(int device) {
  int count = device_count();
  if (device < 0 || device >= count) {
    return "no CUDA device " + std::to_string(device) + " (" + std::to_string(count) + " visible)";
  }
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess) previous = device;
  std::string problem;
  if (cudaSetDevice(device) != cudaSuccess) {
    problem =
        std::string("cudaSetDevice(") + std::to_string(device) + ") failed: " + cudaGetErrorString(cudaGetLastError());
  } else {
    // Asking for a kernel's attributes loads this module's image for the device: it fails with
    // cudaErrorNoKernelImageForDevice (or cudaErrorInvalidDeviceFunction) when none fits.
    cudaFuncAttributes attrs;
    const cudaError_t err = cudaFuncGetAttributes(&attrs, image_probe_kernel);
    if (err != cudaSuccess) {
      cudaGetLastError();
      cudaDeviceProp prop;
      std::string arch = "?";
      if (cudaGetDeviceProperties(&prop, device) == cudaSuccess) {
        arch = "sm_" + std::to_string(prop.major) + std::to_string(prop.minor) + " (" + prop.name + ")";
      }
      problem = "no kernel image for GPU " + std::to_string(device) + ", " + arch + ": built for " +
                std::string(RLK_CUDA_ARCHITECTURES) + " (" + cudaGetErrorName(err) +
                "); rebuild with RLK_CUDA_ARCHS including it";
    }
  }
  cudaSetDevice(previous);
  return problem;
}

}  // namespace rlk_cuda
