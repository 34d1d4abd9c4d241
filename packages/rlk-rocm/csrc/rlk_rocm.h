// The host interface of the rlk HIP kernels: plain C++ (raw device pointers, sizes, a stream handle), no
// Python and no HIP headers, so the nanobind layer (bindings.cpp) compiles as host C++. The same contract as
// rlk-cuda's rlk_cuda.h for the ops both implement: every launcher runs on HIP device `device` (made current
// for the call, then restored) and on `stream` (a hipStream_t as an integer: torch.cuda.current_stream()
// .cuda_stream on a ROCm torch), writes caller-allocated outputs only, throws std::invalid_argument for bad
// sizes and std::runtime_error when a launch fails. Math, shapes and dtypes: rlk/core/abi.py and the specs in
// rlk/reference/{logprob,norm}.py.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

// DType, selected_logprob_*, linear_logprob_* and rms_norm_*: rlk-cuda's launchers_common.h.
#define RLK_NAMESPACE rlk_rocm
#include "launchers_common.h"

namespace rlk_rocm {

// ---- build and device facts (for the backend's probe; device.hip) -----------------------------------

// HIP version this module was built with (HIP_VERSION: major * 10^7 + minor * 10^5 + patch).
int runtime_version();
// Number of HIP devices (0 when the runtime finds none: no GPU, no /dev/kfd access, *_VISIBLE_DEVICES).
int device_count();
// The GPU targets compiled into this module ("gfx90a", "gfx942", ...).
std::vector<std::string> compiled_architectures();
// The device's gcnArchName ("gfx90a:sramecc+:xnack-"), or "" if it cannot be read.
std::string device_arch(int device);
// "" if the kernels can run on `device`, else why not (no code object for its target, ...).
std::string device_problem(int device);

}  // namespace rlk_rocm
