// Host-side launch helpers both backends' launchers share (rlk-cuda's launch.cuh, rlk-rocm's launch.h; single
// source, read by rlk-rocm from here in a checkout, from csrc/shared in its sdist): device guard, error checks,
// dtype dispatch, grid sizes, the linear_logprob input checks. Nothing here is a kernel. On the CUDA runtime, or the
// HIP one where
// __HIP_PLATFORM_AMD__ is defined (the names differ by prefix only: cudaGetDevice / hipGetDevice, ...). The
// includer first includes its launchers header (rlk_cuda.h, rlk_rocm.h), which defines RLK_NAMESPACE.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <type_traits>

#if defined(__HIP_PLATFORM_AMD__)
#include <hip/hip_runtime.h>

#include "portable.cuh"  // rlk_cuda::bf16
#define RLK_GPU(name) hip##name
#else
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define RLK_GPU(name) cuda##name
#endif

#ifndef RLK_NAMESPACE
#error "launch_common.h: include rlk_cuda.h / rlk_rocm.h (they define RLK_NAMESPACE) first"
#endif

#define RLK_LAUNCH_STR2(x) #x
#define RLK_LAUNCH_STR(x) RLK_LAUNCH_STR2(x)
// The runtime function `name` as a string ("cudaGetDevice", "hipGetDevice").
#define RLK_GPU_NAME(name) RLK_LAUNCH_STR(RLK_GPU(name))

namespace RLK_NAMESPACE {

// "rlk_cuda: " / "rlk_rocm: ", the prefix of every error message.
inline const char* error_prefix() { return RLK_LAUNCH_STR(RLK_NAMESPACE) ": "; }

// Makes `device` current for the scope, restores the previous device after.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check(RLK_GPU(GetDevice)(&previous_), RLK_GPU_NAME(GetDevice));
    if (previous_ != device) check(RLK_GPU(SetDevice)(device), RLK_GPU_NAME(SetDevice));
  }
  ~DeviceGuard() {
    int current = -1;
    if (RLK_GPU(GetDevice)(&current) == RLK_GPU(Success) && current != previous_) (void)RLK_GPU(SetDevice)(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

  static void check(RLK_GPU(Error_t) err, const char* what) {
    if (err != RLK_GPU(Success)) {
      throw std::runtime_error(std::string(error_prefix()) + what + " failed: " + RLK_GPU(GetErrorName)(err) + ": " +
                               RLK_GPU(GetErrorString)(err));
    }
  }

 private:
  int previous_ = 0;
};

// Throws if the launch just made failed (bad configuration, no kernel image / code object for the device...).
inline void check_launch(const char* kernel) { DeviceGuard::check(RLK_GPU(GetLastError)(), kernel); }

inline void require(bool ok, const std::string& message) {
  if (!ok) throw std::invalid_argument(error_prefix() + message);
}

inline RLK_GPU(Stream_t) as_stream(std::uintptr_t stream) { return reinterpret_cast<RLK_GPU(Stream_t)>(stream); }

// Calls f(T{}) with T the C++ type of `dtype` (float, __half, and __nv_bfloat16 on CUDA, rlk_cuda::bf16 on HIP).
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
#if defined(__HIP_PLATFORM_AMD__)
      f(rlk_cuda::bf16{});
#else
      f(__nv_bfloat16{});
#endif
      return;
  }
  throw std::invalid_argument(std::string(error_prefix()) + "unknown dtype");
}

// Calls f(T{}) for the 16-bit dtypes (the tensor-core kernels: linear_logprob, fused_linear_kl); throws for the
// others.
template <typename F>
void dispatch_half(DType dtype, const char* what, F&& f) {
  if (dtype != DType::kFloat16 && dtype != DType::kBFloat16) {
    throw std::invalid_argument(std::string(error_prefix()) + what + ": only float16 and bfloat16 are implemented");
  }
  dispatch_float(dtype, [&](auto tag) {
    if constexpr (!std::is_same_v<decltype(tag), float>) f(tag);
  });
}

inline int64_t max_grid_x() { return 2147483647; }

inline bool host_aligned16(const void* p) { return (reinterpret_cast<std::uintptr_t>(p) & 15u) == 0; }

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

}  // namespace RLK_NAMESPACE
