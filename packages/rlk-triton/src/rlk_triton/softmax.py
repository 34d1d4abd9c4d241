"""Triton kernels of ``softmax`` / ``log_softmax`` over the last dim of ``[N, V]`` rows.

The math is the spec in :mod:`rlk.reference.softmax`. Per row, with ``m = max_v x_v`` and
``s = sum_v exp(x_v - m)``::

    softmax(x)_v     = exp(x_v - m) / s
    log_softmax(x)_v = (x_v - m) - log(s)

    log_softmax backward:  grad_x = g - exp(y) * sum_v g_v
    softmax backward:      grad_x = y * (g - sum_v g_v * y_v)

One program per row. The forward makes two passes over the row: the first keeps one online
``(max, sum)`` pair per lane of a ``BLOCK_V`` chunk (lane ``j`` sees columns ``j, j + BLOCK_V,
j + 2 BLOCK_V, ...`` in increasing order) and reduces the lanes with one tree at the end; the second
writes the outputs. The backward does the same with a per-lane sum of ``g`` (or ``g * y``).
All math is fp32; each output is rounded once to its dtype.

Batch invariance by construction: ``BLOCK_V`` and ``num_warps`` are one constant per dtype in
:data:`TILE_CONFIGS` (nothing depends on ``N``), a row is reduced by one program in an order that
depends only on ``V``, and there are no atomics. So a row's outputs are bitwise the same whatever
the other rows are. int64 offsets (``N * V`` may exceed 2^31).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlk_triton.common import on_device

#: Fixed tile configuration per input dtype (read at every call, so a sweep may overwrite entries).
#: Nothing here depends on the number of rows: that is what makes the results batch-invariant.
TILE_CONFIGS: dict[torch.dtype, dict[str, int]] = {
    torch.float32: {"BLOCK_V": 2048, "num_warps": 8},
    torch.float16: {"BLOCK_V": 4096, "num_warps": 8},
    torch.bfloat16: {"BLOCK_V": 4096, "num_warps": 8},
}


@triton.jit
def _softmax_fwd_kernel(x_ptr, out_ptr, V, LOG: tl.constexpr, BLOCK_V: tl.constexpr):
    row_start = tl.program_id(0).to(tl.int64) * V
    lanes = tl.arange(0, BLOCK_V)
    m_lane = tl.full((BLOCK_V,), float("-inf"), tl.float32)
    s_lane = tl.zeros((BLOCK_V,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + lanes
        x = tl.load(x_ptr + row_start + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m_lane, x)
        # While a lane has seen only -inf its shift is 0, so no exp((-inf) - (-inf)).
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        s_lane = s_lane * tl.exp(m_lane - shift) + tl.exp(x - shift)
        m_lane = m_new
    m = tl.max(m_lane, axis=0)
    m_shift = tl.where(m == float("-inf"), 0.0, m)
    s = tl.sum(s_lane * tl.exp(m_lane - m_shift), axis=0)
    log_s = tl.log(s)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + lanes
        col_mask = cols < V
        x = tl.load(x_ptr + row_start + cols, mask=col_mask, other=0.0).to(tl.float32)
        if LOG:
            y = (x - m) - log_s
        else:
            y = tl.exp(x - m) / s
        tl.store(out_ptr + row_start + cols, y.to(out_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def _softmax_bwd_kernel(g_ptr, y_ptr, grad_ptr, V, LOG: tl.constexpr, BLOCK_V: tl.constexpr):
    row_start = tl.program_id(0).to(tl.int64) * V
    lanes = tl.arange(0, BLOCK_V)
    acc = tl.zeros((BLOCK_V,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + lanes
        col_mask = cols < V
        g = tl.load(g_ptr + row_start + cols, mask=col_mask, other=0.0).to(tl.float32)
        if LOG:
            acc += g
        else:
            acc += g * tl.load(y_ptr + row_start + cols, mask=col_mask, other=0.0).to(tl.float32)
    total = tl.sum(acc, axis=0)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + lanes
        col_mask = cols < V
        g = tl.load(g_ptr + row_start + cols, mask=col_mask, other=0.0).to(tl.float32)
        y = tl.load(y_ptr + row_start + cols, mask=col_mask, other=0.0).to(tl.float32)
        if LOG:
            grad = g - tl.exp(y) * total
        else:
            grad = y * (g - total)
        tl.store(grad_ptr + row_start + cols, grad.to(grad_ptr.dtype.element_ty), mask=col_mask)


def softmax_fwd(x, log, out):
    """``out = log_softmax(x)`` if ``log`` else ``softmax(x)`` over the last dim.

    Args:
        x: ``[N, V]`` fp32 / fp16 / bf16, contiguous.
        log: log-softmax (True) or softmax (False).
        out: ``[N, V]``, ``x.dtype``, contiguous; written.

    Spec: :func:`rlk.reference.softmax.softmax_fwd`. One program per row, two passes over it.
    """
    n_rows, vocab = x.shape
    cfg = TILE_CONFIGS[x.dtype]
    with on_device(x.device):
        _softmax_fwd_kernel[(n_rows,)](x, out, vocab, LOG=bool(log), BLOCK_V=cfg["BLOCK_V"], num_warps=cfg["num_warps"])


def softmax_bwd(grad_out, out, log, grad_x_out):
    """Gradient w.r.t. ``x`` of ``sum(grad_out * y)``, ``y = out`` the forward's output.

    Args:
        grad_out: ``[N, V]``, ``out.dtype``, contiguous.
        out: ``[N, V]`` the forward's output, contiguous.
        log: whether the forward was log-softmax.
        grad_x_out: ``[N, V]``, ``out.dtype``, contiguous; written ``g - exp(y) * sum(g)`` (log) or
            ``y * (g - sum(g * y))``.

    Spec: :func:`rlk.reference.softmax.softmax_bwd`. One program per row, two passes over it.
    """
    n_rows, vocab = out.shape
    cfg = TILE_CONFIGS[out.dtype]
    with on_device(out.device):
        _softmax_bwd_kernel[(n_rows,)](
            grad_out, out, grad_x_out, vocab, LOG=bool(log), BLOCK_V=cfg["BLOCK_V"], num_warps=cfg["num_warps"]
        )
