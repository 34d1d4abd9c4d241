// Host-side launch helpers of the CUDA launchers (*.cu): launch_common.h's (device guard, error checks,
// dtype dispatch, grid sizes, the linear_logprob input checks; shared with rlk-rocm) and the one only rlk-cuda's
// kernels need (allow_smem). Nothing here is a kernel.
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

// Opts a kernel into `bytes` of dynamic shared memory (above the 48 KiB default).
template <typename K>
void allow_smem(int bytes, K kernel, const char* name) {
  DeviceGuard::check(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes), name);
}

}  // namespace rlk_cuda
