// Host-side launch helpers of the HIP launchers (*.hip): rlk-cuda's launch_common.h (device guard, error
// checks, dtype dispatch, grid sizes, on the HIP runtime) and the HIP-only facts. Nothing here is a kernel.
#pragma once

#include <hip/hip_runtime.h>

#include "common.cuh"
#include "rlk_rocm.h"
// Keep after rlk_rocm.h (it defines RLK_NAMESPACE).
#include "launch_common.h"

namespace rlk_rocm {

// Shared memory (LDS) of one workgroup on gfx90a / gfx94x: 64 KiB, static and dynamic together.
constexpr int kMaxSharedBytes = 64 * 1024;

}  // namespace rlk_rocm
