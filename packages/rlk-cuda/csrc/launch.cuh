// Host-side launch helpers shared by the launchers (*.cu): device guard, error checks, dtype
// dispatch. Nothing here is a kernel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <type_traits>

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

// Calls f(T{}) for the 16-bit dtypes (the tensor-core kernels); throws for the others.
template <typename F>
void dispatch_half(DType dtype, const char* what, F&& f) {
  if (dtype != DType::kFloat16 && dtype != DType::kBFloat16) {
    throw std::invalid_argument(std::string("rlk_cuda: ") + what + ": only float16 and bfloat16 are implemented");
  }
  dispatch_float(dtype, [&](auto tag) {
    if constexpr (!std::is_same_v<decltype(tag), float>) f(tag);
  });
}

inline bool host_aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

// Opts a kernel into `bytes` of dynamic shared memory (above the 48 KiB default).
template <typename K>
void allow_smem(int bytes, K kernel, const char* name) {
  DeviceGuard::check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), name);
}

// A 1-D grid of `blocks` blocks, or an error if it does not fit.
inline unsigned grid_of(int64_t blocks, const char* what) {
  require(blocks >= 1 && blocks <= max_grid_x(), std::string(what) + ": problem too large for one grid");
  return static_cast<unsigned>(blocks);
}

// The checks every linear_logprob launcher makes: sizes, H a positive multiple of 8, 16-byte aligned operands.
inline void check_linear_inputs(const char* what, const void* hidden, const void* weight, int64_t n_rows, int64_t vocab,
                                int64_t hidden_size) {
  const std::string w(what);
  require(n_rows >= 1, w + ": n_rows must be >= 1");
  require(vocab >= 1, w + ": vocab must be >= 1");
  require(hidden_size >= 8 && hidden_size % 8 == 0,
          w + ": hidden size must be a positive multiple of 8 (the Python layer pads other sizes), got " +
              std::to_string(hidden_size));
  require(host_aligned16(hidden) && host_aligned16(weight), w + ": hidden and weight must be 16-byte aligned");
}

}  // namespace rlk_cuda
