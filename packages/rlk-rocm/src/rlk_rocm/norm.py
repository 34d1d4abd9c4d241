"""ROCm primitives of ``rms_norm`` (kernels: rlk-cuda's ``csrc/norm.cuh``, shared through ``portable.cuh``;
launchers: ``csrc/norm.hip``).

The math is the spec in :mod:`rlk.reference.norm`; the kernels and their layouts are rlk-cuda's (see
:mod:`rlk_cuda.norm`), in 64-lane wavefronts: a forward team per row with the row in registers, a backward
workgroup per ``BWD_ROWS`` consecutive rows (a fixed partition, never derived from N) writing fp32 grad-weight
partial rows that a second kernel sums in a fixed order. 16-bit backward rows of more than 7168 values take the
chunked long-row kernel (a workgroup has 64 KiB of LDS). Batch invariance: layouts depend on H and the dtypes
only; fixed-order reductions; no atomics.
"""

from __future__ import annotations

import torch

from rlk_rocm._native import C, array, on_device, stream_of

#: Rows per backward block (the grad-weight row partition), per input dtype, in [1, 256]. Read at every
#: call, so a test or a sweep may override an entry; nothing here depends on the number of rows; a
#: row's grad_input does not depend on it (grad_weight's summation order does). rlk-cuda's value (tuned on
#: an H200); not tuned on AMD hardware.
BWD_ROWS: dict[torch.dtype, int] = {torch.float32: 32, torch.float16: 32, torch.bfloat16: 32}


def rms_norm_fwd(x, weight, residual, eps, gemma, out, residual_out, rstd_out):
    """RMSNorm forward: ``y``, the new residual ``s`` (when fused) and ``rstd``.

    Args:
        x: ``[N, H]`` fp32 / fp16 / bf16, contiguous, on an AMD GPU.
        weight: ``[H]``, x.dtype or fp32.
        residual: ``[N, H]`` x.dtype, or None (unfused: ``s = x``).
        eps: added to the mean of squares (rounded to fp32).
        gemma: the ``n * (1 + w)`` form.
        out: ``[N, H]``, x.dtype (fp32 for an fp32 weight with 16-bit x and gemma=False: torch's promotion).
        residual_out: ``[N, H]`` x.dtype, written ``s``; None when unfused.
        rstd_out: ``[N]`` fp32.
    """
    with on_device(x):
        C.rms_norm_fwd(
            array(x),
            array(weight),
            array(residual),
            float(eps),
            bool(gemma),
            array(out),
            array(residual_out),
            array(rstd_out),
            stream_of(x),
        )


def rms_norm_bwd(grad_out, s, weight, rstd, gemma, grad_residual, grad_input_out, grad_weight_out):
    """RMSNorm backward: the gradient of ``s`` (of x, and of residual when fused) and of the weight.

    Args:
        grad_out: ``[N, H]`` gradient of y (y's dtype). s: ``[N, H]`` the normalized input, x.dtype.
        weight: ``[H]``. rstd: ``[N]`` fp32. gemma: as in the forward.
        grad_residual: ``[N, H]`` x.dtype, the upstream gradient of the returned residual, or None.
        grad_input_out: ``[N, H]`` x.dtype. grad_weight_out: ``[H]`` weight.dtype, or None (not computed).

    Extra memory: ``ceil(N / BWD_ROWS) x H`` fp32 partials when ``grad_weight_out`` is given.
    """
    n_rows, hidden = s.shape
    rows = BWD_ROWS[s.dtype]
    partials = None
    if grad_weight_out is not None:
        partials = torch.empty(
            (C.rms_norm_bwd_partial_rows(n_rows, rows), hidden), dtype=torch.float32, device=s.device
        )
    with on_device(s):
        C.rms_norm_bwd(
            array(grad_out),
            array(s),
            array(weight),
            array(rstd),
            bool(gemma),
            array(grad_residual),
            array(grad_input_out),
            array(grad_weight_out),
            partials,
            rows,
            stream_of(s),
        )
