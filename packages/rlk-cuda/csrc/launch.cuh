// Host-side launch helpers shared by the launchers (*.cu): device guard, error checks, dtype
// dispatch. Nothing here is a kernel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "rlk_cuda.h"

namespace rlk_cuda {

// Makes `device` current for the scope, restores the previous device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check(cudaSetDevice(device), "cudaSetDevice");
  }
  ~DeviceGuard() {
    int current = -1;
    if (cudaGetDevice(&current) == cudaSuccess && current != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

  static void check(cudaError_t err, const char* what) {
    if (err != cudaSuccess) {
      throw std::runtime_error(std::string("rlk_cuda: ") + what + " failed: " + cudaGetErrorName(err) + ": " +
                               cudaGetErrorString(err));
    }
  }

 private:
  int previous_ = 0;
};

// Throws if the launch just made failed (bad configuration, no kernel image for the device...).
inline void check_launch(const char* kernel) { DeviceGuard::check(cudaGetLastError(), kernel); }

inline void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument("rlk_cuda: " + message);
}

inline cudaStream_t as_stream(std::uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

// Calls f(T{}) with T the C++ type of `dtype` (float, __half, __nv_bfloat16).
template <typename F>
void dispatch_float(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      f(float{});
      return;
    case DType::kFloat16:
      f(__half{});
      return;
    case DType::kBFloat16:
      f(__nv_bfloat16{});
      return;
  }
  throw std::invalid_argument("rlk_cuda: unknown dtype");
}

inline int64_t max_grid_x() { return 2147483647; }

}  // namespace rlk_cuda
