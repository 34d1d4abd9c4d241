"""CUDA primitives of ``rms_norm`` (kernels: ``csrc/norm.cuh``).

The math is the spec in :mod:`rlk.reference.norm`. Per row of ``H`` elements::

    s    = x + residual (rounded to x.dtype; s = x unfused)
    rstd = rsqrt(mean(s^2) + eps)                        fp32
    y    = w * (s * rstd).to(x.dtype)  |  (s * rstd) * (1 + w)   (gemma), rounded once to y's dtype
    grad_s = rstd * (g_n - n * mean(g_n * n)) (+ grad_residual),  g_n = grad_y * w  (or 1 + w),  n = s * rstd
    grad_w = sum over rows of grad_y * n.to(x.dtype)  (gemma: grad_y * n), fp32

Forward: a team of threads per row (a function of H and the dtype: bf16 H = 4096 takes 128 threads, 32
values each), each team walking 4 consecutive rows; backward: one block per ``BWD_ROWS`` consecutive rows
(a fixed partition, never derived from N) writing one fp32 grad-weight partial row each, then a
fixed-order sum of the partials. A row is loaded into registers with all its loads in flight at once,
reduced over its team, and written from the same registers: one pass over every input, one write of
every output (rows of more than 16384 16-bit / 8192 fp32 values forward, 8192 / 4096 backward, take a
chunked kernel that reads the row twice). Batch invariance: thread layouts depend on H and the dtype
only; per-row reductions run in a fixed order; no atomics.
"""

from __future__ import annotations

import torch

from rlk_cuda._native import C, array, on_device, stream_of

#: Rows per backward block (the grad-weight row partition), per input dtype, in [1, 256]. Read at every
#: call, so a test or a sweep may override an entry; nothing here depends on the number of rows; a
#: row's grad_input does not depend on it (grad_weight's summation order does). N = 16384 with 32 rows:
#: 512 blocks (bf16 H = 4096: four resident per SM of an H200, so all 512 in one wave), partials 512 x H
#: fp32 (1/16 of the bytes of a bf16 [N, H] tensor, written once and read once).
BWD_ROWS: dict[torch.dtype, int] = {torch.float32: 32, torch.float16: 32, torch.bfloat16: 32}


def rms_norm_fwd(x, weight, residual, eps, gemma, out, residual_out, rstd_out):
    """RMSNorm forward: ``y``, the new residual ``s`` (when fused) and ``rstd``.

    Args:
        x: ``[N, H]`` fp32 / fp16 / bf16, contiguous, on a CUDA device.
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
