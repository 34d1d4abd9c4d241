// Host-side launch helpers of the HIP launchers (*.hip): rlk-cuda's launch_common.h (device guard, error
// checks, dtype dispatch, grid sizes, on the HIP runtime) and the HIP-only facts. Nothing here is a kernel.
#pragma once

#include <hip/hip_runtime.h>

#include <string>

#include "common.cuh"
#include "rlk_rocm.h"
// Keep after rlk_rocm.h (it defines RLK_NAMESPACE).
#include "launch_common.h"

namespace rlk_rocm {

// Shared memory (LDS) of one workgroup on gfx90a / gfx94x: 64 KiB, static and dynamic together.
constexpr int kMaxSharedBytes = 64 * 1024;

// The launchers' counterpart of rlk-cuda's allow_smem (which opts a kernel into more than 48 KiB of dynamic shared
// memory): HIP needs no opt-in below the workgroup's 64 KiB, so this only checks that `bytes` of dynamic LDS plus
// the kernel's static LDS fit.
template <typename K>
void allow_smem(int bytes, K kernel, const char* name) {
  hipFuncAttributes attrs;
  DeviceGuard::check(hipFuncGetAttributes(&attrs, reinterpret_cast<const void*>(kernel)), name);
  require(bytes + static_cast<int64_t>(attrs.sharedSizeBytes) <= kMaxSharedBytes,
          std::string(name) + ": " + std::to_string(bytes) + " bytes of dynamic LDS + " +
              std::to_string(attrs.sharedSizeBytes) + " static exceed the workgroup's 64 KiB");
}

}  // namespace rlk_rocm
