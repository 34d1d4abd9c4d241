// Launchers of the linear_logprob kernels on ROCm: rlk-cuda's linear_logprob_launchers.h (shared: argument checks,
// dtype dispatch, the forward's split + combine kernels, the backward's chunk loop) on the HIP runtime, over the
// kernel bodies of linear_logprob.cuh with the MFMA core mma_amd.cuh (32 KiB of dynamic LDS per workgroup, under
// the 64 KiB a workgroup may have: allow_smem in launch.h only checks that).
#include "launch.h"
#include "linear_logprob.cuh"
// Keep after the two above.
#include "linear_logprob_launchers.h"
