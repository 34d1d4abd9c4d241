// Launchers of the linear_logprob kernels (linear_logprob.cuh over the mma.sync core mma.cuh): the launchers are
// written once, in linear_logprob_launchers.h (shared with rlk-rocm), compiled here on the CUDA runtime.
#include "launch.cuh"
#include "linear_logprob.cuh"
// Keep after the two above.
#include "linear_logprob_launchers.h"
