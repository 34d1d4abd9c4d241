// Host-side launch helpers of the CUDA launchers (*.cu): launch_common.h's (device guard, error checks,
// dtype dispatch, grid sizes; shared with rlk-rocm) and the ones only rlk-cuda's kernels need. Nothing here
// is a kernel.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>
#include <type_traits>

#include "rlk_cuda.h"
// Keep after rlk_cuda.h (it defines RLK_NAMESPACE).
#include "launch_common.h"

namespace rlk_cuda {

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

// Opts a kernel into `bytes` of dynamic shared memory (above the 48 KiB default).
template <typename K>
void allow_smem(int bytes, K kernel, const char* name) {
  DeviceGuard::check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), name);
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
