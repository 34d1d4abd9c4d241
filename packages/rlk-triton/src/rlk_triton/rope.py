"""Triton kernels of rotary position embedding (rope).

The math is the spec in :mod:`rlk.reference.rope`. Every rotated pair ``(a, b)`` of the first
``R`` features (rotate-half: ``a = i, b = i + R/2``; interleaved: ``a = 2i, b = 2i + 1``) of
every head of token ``t``, with ``c = cos[t]``, ``s = sin[t]``::

    forward:   out[a] = x[a] c[a] - x[b] s[a],      out[b] = x[b] c[b] + x[a] s[b]
    backward:  gx[a]  = g[a] c[a] + g[b] s[b],      gx[b]  = g[b] c[b] - g[a] s[a]

in fp32, rounded once to the output dtype; features ``R..D-1`` are copied. One program handles
one token and ``BLOCK_H`` of its heads, loading the token's ``cos``/``sin`` once. Elementwise,
so batch-invariant by construction: a token's values are computed by the same instructions
whatever ``T`` (tile sizes depend on ``D`` and ``R`` only). Offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlk_triton.common import on_device

#: Heads per program and warps, per pair layout and input dtype. Nothing depends on the number of
#: tokens. Measured on an H200 (T = 16384, D = 128, bf16): rotate-half with 16 heads per program runs
#: q (H = 32) at about 3.6 TB/s and k (H = 8) at 2.7 TB/s; the interleaved layout's stride-2 loads
#: prefer small programs (4 heads: about 2 TB/s; 16 heads would be 4x slower).
TILE_CONFIGS: dict[str, dict[torch.dtype, dict[str, int]]] = {
    "half": {
        torch.float32: {"BLOCK_H": 8, "num_warps": 4},
        torch.float16: {"BLOCK_H": 16, "num_warps": 2},
        torch.bfloat16: {"BLOCK_H": 16, "num_warps": 2},
    },
    "interleaved": {
        torch.float32: {"BLOCK_H": 4, "num_warps": 2},
        torch.float16: {"BLOCK_H": 4, "num_warps": 2},
        torch.bfloat16: {"BLOCK_H": 4, "num_warps": 2},
    },
}


@triton.jit
def _rope_kernel(
    x_ptr,
    cos_ptr,
    sin_ptr,
    out_ptr,
    n_heads,
    head_dim,
    rotary_dim,
    INTERLEAVED: tl.constexpr,
    TRANSPOSE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_PAIRS: tl.constexpr,
    BLOCK_PASS: tl.constexpr,
):
    """One token ``tl.program_id(0)``, heads ``[BLOCK_H * tl.program_id(1), +BLOCK_H)``.

    ``x``/``out`` are contiguous ``[T, H, D]``, ``cos``/``sin`` contiguous ``[T, R]``.
    ``TRANSPOSE`` selects the backward formula. ``BLOCK_PAIRS >= R / 2``, ``BLOCK_PASS >= D - R``
    (0: no pass-through features).
    """
    token = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H).to(tl.int64)
    head_ok = heads < n_heads
    n_pairs = rotary_dim // 2
    pairs = tl.arange(0, BLOCK_PAIRS)
    pair_ok = pairs < n_pairs
    if INTERLEAVED:
        col_a = 2 * pairs
        col_b = 2 * pairs + 1
    else:
        col_a = pairs
        col_b = pairs + n_pairs

    table = token * rotary_dim
    c_a = tl.load(cos_ptr + table + col_a, mask=pair_ok, other=0.0).to(tl.float32)
    c_b = tl.load(cos_ptr + table + col_b, mask=pair_ok, other=0.0).to(tl.float32)
    s_a = tl.load(sin_ptr + table + col_a, mask=pair_ok, other=0.0).to(tl.float32)
    s_b = tl.load(sin_ptr + table + col_b, mask=pair_ok, other=0.0).to(tl.float32)

    rows = (token * n_heads + heads) * head_dim  # [BLOCK_H] int64 offsets of the heads' first features
    mask = head_ok[:, None] & pair_ok[None, :]
    off_a = rows[:, None] + col_a[None, :]
    off_b = rows[:, None] + col_b[None, :]
    x_a = tl.load(x_ptr + off_a, mask=mask, other=0.0).to(tl.float32)
    x_b = tl.load(x_ptr + off_b, mask=mask, other=0.0).to(tl.float32)
    if TRANSPOSE:
        y_a = x_a * c_a[None, :] + x_b * s_b[None, :]
        y_b = x_b * c_b[None, :] - x_a * s_a[None, :]
    else:
        y_a = x_a * c_a[None, :] - x_b * s_a[None, :]
        y_b = x_b * c_b[None, :] + x_a * s_b[None, :]
    tl.store(out_ptr + off_a, y_a.to(out_ptr.dtype.element_ty), mask=mask)
    tl.store(out_ptr + off_b, y_b.to(out_ptr.dtype.element_ty), mask=mask)

    if BLOCK_PASS > 0:
        cols = rotary_dim + tl.arange(0, BLOCK_PASS)
        pass_mask = head_ok[:, None] & (cols < head_dim)[None, :]
        off = rows[:, None] + cols[None, :]
        tl.store(out_ptr + off, tl.load(x_ptr + off, mask=pass_mask), mask=pass_mask)


def _launch(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, transpose: bool, out: torch.Tensor
) -> None:
    n_tokens, n_heads, head_dim = x.shape
    rotary_dim = cos.shape[1]
    cfg = TILE_CONFIGS["interleaved" if interleaved else "half"][x.dtype]
    block_pass = triton.next_power_of_2(head_dim - rotary_dim) if head_dim > rotary_dim else 0
    grid = (n_tokens, triton.cdiv(n_heads, cfg["BLOCK_H"]))
    with on_device(x.device):
        _rope_kernel[grid](
            x,
            cos,
            sin,
            out,
            n_heads,
            head_dim,
            rotary_dim,
            INTERLEAVED=bool(interleaved),
            TRANSPOSE=transpose,
            BLOCK_H=cfg["BLOCK_H"],
            BLOCK_PAIRS=triton.next_power_of_2(rotary_dim // 2),
            BLOCK_PASS=block_pass,
            num_warps=cfg["num_warps"],
        )


def rope_fwd(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, out: torch.Tensor) -> None:
    """Rotate ``x`` ``[T, H, D]`` by the per-token tables ``cos``, ``sin`` ``[T, R]`` (fp32 or
    ``x.dtype``; ``R`` even, ``R <= D``) into ``out`` (``x.dtype``). Spec: ``rlk.reference.rope.rope_fwd``."""
    _launch(x, cos, sin, interleaved, False, out)


def rope_bwd(
    grad_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, grad_x_out: torch.Tensor
) -> None:
    """The transposed rotation of ``grad_out`` into ``grad_x_out``. Spec: ``rlk.reference.rope.rope_bwd``."""
    _launch(grad_out, cos, sin, interleaved, True, grad_x_out)
