"""Triton kernels of ``rms_norm`` (Llama / Qwen3 and Gemma forms, optional fused residual add).

The math is the spec in :mod:`rlk.reference.norm`. Per row of ``H`` elements::

    s    = x + residual (rounded to x.dtype; s = x unfused)
    rstd = rsqrt(mean(s^2) + eps)                       fp32
    n    = s * rstd                                     fp32
    y    = w * n.to(x.dtype)  |  n * (1 + w)            (gemma) rounded once to y's dtype
    grad_s = rstd * (g_n - n * mean(g_n * n)) (+ grad_residual),  g_n = grad_y * w  (or (1 + w))
    grad_w = sum over rows of grad_y * n.to(x.dtype)    (gemma: grad_y * n), fp32

Launch structure:

* forward: one program per ``FWD_ROWS`` consecutive rows, walked one row at a time; a row (``BLOCK_H``
  columns, the next power of two of ``H`` up to ``MAX_BLOCK_H``) is loaded once (the next row's loads are
  issued before this row's reduction), reduced, scaled and stored: one pass over ``x`` (and ``residual``),
  ``y`` (and ``s``) written once;
* backward: one program per ``BWD_ROWS`` consecutive rows (a fixed partition, never derived from ``N``);
  each row's ``grad_y`` and ``s`` are read once and ``grad_s`` written once, while the program
  accumulates its rows' ``grad_y * n`` into an fp32 ``[BLOCK_H]`` register vector, stored as one row of
  an fp32 ``[P, H]`` partial buffer (``P = cdiv(N, BWD_ROWS)``); a second kernel sums the partials over
  ``P`` in a fixed order (``SUM_BLOCK_P`` partial rows at a time, then one tree over them) and stores
  ``grad_weight`` in weight's dtype. No atomics: deterministic run to run.

Rows longer than ``MAX_BLOCK_H`` loop over chunks of ``MAX_BLOCK_H`` columns (the forward reads the
row twice, the backward reads ``grad_y`` and ``s`` twice).

Batch invariance by construction: ``BLOCK_H`` and ``num_warps`` depend only on ``H`` and the dtype,
every per-row reduction (the mean of squares, the mean of ``g_n * n``) covers the row in an order
that depends only on ``H``, and a row's instructions are the same whatever its position in a
program (rows past ``N`` are masked lanes of their own loop iteration). Offsets are int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlk_triton.common import on_device

#: Fixed tile constants per input dtype (read at every call, so a test or a sweep may override an
#: entry; kernels recompile per value). Nothing here depends on the number of rows.
#:
#: * ``MAX_BLOCK_H``: widest row chunk a program holds (columns); ``BLOCK_H = min(next_pow2(H), MAX_BLOCK_H)``;
#: * ``COLUMNS_PER_WARP``: ``num_warps = clamp(BLOCK_H // COLUMNS_PER_WARP, 1, MAX_WARPS)`` (H = 4096: 8 warps,
#:   16 columns per thread);
#: * ``FWD_ROWS``: rows per forward program (any value gives the same bits);
#: * ``BWD_ROWS``: rows per backward program, i.e. the grad-weight row partition (N = 16384: 512 programs,
#:   about 4 per SM of an H200; partials ``512 x H`` fp32 = 1/16 of the bytes of a bf16 ``[N, H]`` tensor);
#: * ``SUM_BLOCK_P`` x ``SUM_BLOCK_H``: the tile of the partial-sum kernel.
TILE_CONFIGS: dict[torch.dtype, dict[str, int]] = {
    torch.float32: {
        "MAX_BLOCK_H": 8192,
        "COLUMNS_PER_WARP": 512,
        "MAX_WARPS": 16,
        "FWD_ROWS": 4,
        "BWD_ROWS": 32,
        "SUM_BLOCK_P": 32,
        "SUM_BLOCK_H": 32,
    },
    torch.float16: {
        "MAX_BLOCK_H": 16384,
        "COLUMNS_PER_WARP": 512,
        "MAX_WARPS": 16,
        "FWD_ROWS": 4,
        "BWD_ROWS": 32,
        "SUM_BLOCK_P": 32,
        "SUM_BLOCK_H": 32,
    },
    torch.bfloat16: {
        "MAX_BLOCK_H": 16384,
        "COLUMNS_PER_WARP": 512,
        "MAX_WARPS": 16,
        "FWD_ROWS": 4,
        "BWD_ROWS": 32,
        "SUM_BLOCK_P": 32,
        "SUM_BLOCK_H": 32,
    },
}


#: Rows whose ``mean(s^2) + eps`` overflows (inf) or falls below ``RESCALE_BELOW`` sum the squares again of ``s * c``
#: (``c = 2^-100`` or ``2^100``, exact): ``rstd = rsqrt(mean((s c)^2) + eps c^2) c``, as
#: :func:`rlk.reference.norm.rstd_of`. Every other row keeps the plain formula's bits and its single pass.
RESCALE_BELOW = tl.constexpr(2.0**-100)
RESCALE = tl.constexpr(2.0**100)


def _row_tiles(hidden: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """``(BLOCK_H, NUM_CHUNKS, num_warps)`` for rows of ``hidden`` columns: a function of H and dtype only."""
    cfg = TILE_CONFIGS[dtype]
    block = min(triton.next_power_of_2(hidden), cfg["MAX_BLOCK_H"])
    warps = max(1, min(cfg["MAX_WARPS"], block // cfg["COLUMNS_PER_WARP"]))
    return block, triton.cdiv(hidden, block), warps


# ----------------------------------------------------------------------------------------------
# device helpers
# ----------------------------------------------------------------------------------------------


@triton.jit
def _load_s(x_ptr, res_ptr, s_ptr, offs, mask, HAS_RESIDUAL: tl.constexpr, STORE_S: tl.constexpr):
    """``s = x + residual`` in x's dtype (the fp32 sum rounded once, as torch does), or ``x``."""
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x_ptr.dtype.element_ty)
        if STORE_S:
            tl.store(s_ptr + offs, x, mask=mask)
    return x


@triton.jit
def _needs_rescale(d):
    """Whether a row's ``mean(s^2) + eps`` (``d``) overflowed or underflowed (:data:`RESCALE_BELOW`)."""
    return (d == float("inf")) | (d < RESCALE_BELOW)


@triton.jit
def _rescale_factor(d):
    """``c`` of a row to rescale: ``2^-100`` where ``d`` overflowed, else ``2^100``."""
    return tl.where(d == float("inf"), 1.0 / RESCALE, RESCALE)


@triton.jit
def _scale(n, w, X_DTYPE: tl.constexpr, GEMMA: tl.constexpr):
    """``y = w * n.to(x.dtype)`` (or ``n * (1 + w)``) in fp32; the caller rounds it once to y's dtype."""
    if GEMMA:
        y = n * (1.0 + w)
    else:
        y = w * n.to(X_DTYPE).to(tl.float32)
    return y


@triton.jit
def _weight_factor(w_ptr, cols, mask, GEMMA: tl.constexpr):
    """The fp32 factor ``g_n = grad_y * factor``: ``w``, or ``1 + w`` for Gemma."""
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if GEMMA:
        w = 1.0 + w
    return w


@triton.jit
def _grad_weight_term(g, n, X_DTYPE: tl.constexpr, GEMMA: tl.constexpr):
    """``grad_y * m``: ``m = n.to(x.dtype)`` (the factor HF's autograd multiplies by), ``n`` for Gemma."""
    if GEMMA:
        term = g * n
    else:
        term = g * n.to(X_DTYPE).to(tl.float32)
    return term


# ----------------------------------------------------------------------------------------------
# forward: one program per row
# ----------------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr,
    w_ptr,
    res_ptr,
    y_ptr,
    s_ptr,
    rstd_ptr,
    N,
    H,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    GEMMA: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
):
    first = tl.program_id(0).to(tl.int64) * ROWS
    x_dtype: tl.constexpr = x_ptr.dtype.element_ty
    if NUM_CHUNKS == 1:
        cols = tl.arange(0, BLOCK_H)
        col_mask = cols < H
        w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)
        # Software pipelining: row i + 1's loads are issued before row i's reduction.
        x_next = tl.load(x_ptr + first * H + cols, mask=col_mask & (first < N), other=0.0)
        r_next = x_next
        if HAS_RESIDUAL:
            r_next = tl.load(res_ptr + first * H + cols, mask=col_mask & (first < N), other=0.0)
        for i in range(ROWS):
            row = first + i
            mask = col_mask & (row < N)
            offs = row * H + cols
            s = x_next
            if HAS_RESIDUAL:
                s = (s.to(tl.float32) + r_next.to(tl.float32)).to(x_dtype)  # torch's x + residual
                tl.store(s_ptr + offs, s, mask=mask)
            next_mask = col_mask & (row + 1 < N) & (i + 1 < ROWS)
            x_next = tl.load(x_ptr + offs + H, mask=next_mask, other=0.0)
            if HAS_RESIDUAL:
                r_next = tl.load(res_ptr + offs + H, mask=next_mask, other=0.0)
            s = s.to(tl.float32)
            d = tl.sum(s * s, axis=0) / H + eps
            rstd = tl.math.rsqrt(d)
            if _needs_rescale(d):  # the row is in registers: no second read
                scale = _rescale_factor(d)
                sc = s * scale
                rstd = tl.math.rsqrt(tl.sum(sc * sc, axis=0) / H + eps * scale * scale) * scale
            y = _scale(s * rstd, w, x_dtype, GEMMA)
            tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
            tl.store(rstd_ptr + row, rstd, mask=row < N)
    else:
        for i in range(ROWS):
            row = first + i
            base = row * H
            acc = tl.zeros((BLOCK_H,), tl.float32)
            for c in range(NUM_CHUNKS):
                cols = c * BLOCK_H + tl.arange(0, BLOCK_H)
                mask = (cols < H) & (row < N)
                s = _load_s(x_ptr, res_ptr, s_ptr, base + cols, mask, HAS_RESIDUAL, True).to(tl.float32)
                acc += s * s
            d = tl.sum(acc, axis=0) / H + eps
            rstd = tl.math.rsqrt(d)
            if _needs_rescale(d):  # read the row once more, scaled
                scale = _rescale_factor(d)
                acc = tl.zeros((BLOCK_H,), tl.float32)
                for k in range(NUM_CHUNKS):
                    cols = k * BLOCK_H + tl.arange(0, BLOCK_H)
                    mask = (cols < H) & (row < N)
                    sc = _load_s(x_ptr, res_ptr, s_ptr, base + cols, mask, HAS_RESIDUAL, False).to(tl.float32) * scale
                    acc += sc * sc
                rstd = tl.math.rsqrt(tl.sum(acc, axis=0) / H + eps * scale * scale) * scale
            for c in range(NUM_CHUNKS):
                cols = c * BLOCK_H + tl.arange(0, BLOCK_H)
                mask = (cols < H) & (row < N)
                w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
                s = _load_s(x_ptr, res_ptr, s_ptr, base + cols, mask, HAS_RESIDUAL, False).to(tl.float32)
                y = _scale(s * rstd, w, x_dtype, GEMMA)
                tl.store(y_ptr + base + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
            tl.store(rstd_ptr + row, rstd, mask=row < N)


# ----------------------------------------------------------------------------------------------
# backward: BWD_ROWS rows per program, grad-weight partials, then a fixed-order partial sum
# ----------------------------------------------------------------------------------------------


@triton.jit
def _rms_norm_bwd_kernel(
    gy_ptr,
    s_ptr,
    w_ptr,
    rstd_ptr,
    gres_ptr,
    gs_ptr,
    part_ptr,
    N,
    H,
    HAS_GRES: tl.constexpr,
    GEMMA: tl.constexpr,
    WANT_DW: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NUM_CHUNKS: tl.constexpr,
):
    pid = tl.program_id(0)
    first = pid.to(tl.int64) * ROWS
    x_dtype: tl.constexpr = s_ptr.dtype.element_ty
    if NUM_CHUNKS == 1:
        cols = tl.arange(0, BLOCK_H)
        col_mask = cols < H
        w = _weight_factor(w_ptr, cols, col_mask, GEMMA)
        dw = tl.zeros((BLOCK_H,), tl.float32)
        # Software pipelining: row i + 1's loads are issued before row i's reduction.
        nxt = first * H + cols
        g_next = tl.load(gy_ptr + nxt, mask=col_mask & (first < N), other=0.0)
        s_next = tl.load(s_ptr + nxt, mask=col_mask & (first < N), other=0.0)
        for i in range(ROWS):
            row = first + i
            mask = col_mask & (row < N)
            offs = row * H + cols
            g = g_next.to(tl.float32)
            n = s_next.to(tl.float32)
            nxt = offs + H
            next_mask = col_mask & (row + 1 < N) & (i + 1 < ROWS)
            g_next = tl.load(gy_ptr + nxt, mask=next_mask, other=0.0)
            s_next = tl.load(s_ptr + nxt, mask=next_mask, other=0.0)
            rstd = tl.load(rstd_ptr + row, mask=row < N, other=0.0)
            if HAS_GRES:
                g_res = tl.load(gres_ptr + offs, mask=mask, other=0.0)  # issued before the reduction
            n = n * rstd
            g_n = g * w
            coef = tl.sum(g_n * n, axis=0) / H
            gs = rstd * (g_n - n * coef)
            if HAS_GRES:
                gs += g_res.to(tl.float32)
            tl.store(gs_ptr + offs, gs.to(gs_ptr.dtype.element_ty), mask=mask)
            if WANT_DW:
                dw += _grad_weight_term(g, n, x_dtype, GEMMA)
        if WANT_DW:
            tl.store(part_ptr + pid.to(tl.int64) * H + cols, dw, mask=col_mask)
    else:
        # Long rows: first each row's mean(g_n * n) over all chunks (kept in a [ROWS] vector), then
        # chunk by chunk the gradients and that chunk's grad-weight partial.
        idx = tl.arange(0, ROWS)
        coefs = tl.zeros((ROWS,), tl.float32)
        for i in range(ROWS):
            row = first + i
            rstd = tl.load(rstd_ptr + row, mask=row < N, other=0.0)
            acc = tl.zeros((BLOCK_H,), tl.float32)
            for c in range(NUM_CHUNKS):
                cols = c * BLOCK_H + tl.arange(0, BLOCK_H)
                mask = (cols < H) & (row < N)
                offs = row * H + cols
                g = tl.load(gy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                n = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32) * rstd
                acc += g * _weight_factor(w_ptr, cols, mask, GEMMA) * n
            coefs = tl.where(idx == i, tl.sum(acc, axis=0) / H, coefs)
        for c in range(NUM_CHUNKS):
            cols = c * BLOCK_H + tl.arange(0, BLOCK_H)
            col_mask = cols < H
            w = _weight_factor(w_ptr, cols, col_mask, GEMMA)
            dw = tl.zeros((BLOCK_H,), tl.float32)
            for i in range(ROWS):
                row = first + i
                mask = col_mask & (row < N)
                offs = row * H + cols
                coef = tl.sum(tl.where(idx == i, coefs, 0.0), axis=0)  # exact: one term plus zeros
                g = tl.load(gy_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                n = tl.load(s_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                rstd = tl.load(rstd_ptr + row, mask=row < N, other=0.0)
                n = n * rstd
                g_n = g * w
                gs = rstd * (g_n - n * coef)
                if HAS_GRES:
                    gs += tl.load(gres_ptr + offs, mask=mask, other=0.0).to(tl.float32)
                tl.store(gs_ptr + offs, gs.to(gs_ptr.dtype.element_ty), mask=mask)
                if WANT_DW:
                    dw += _grad_weight_term(g, n, x_dtype, GEMMA)
            if WANT_DW:
                tl.store(part_ptr + pid.to(tl.int64) * H + cols, dw, mask=col_mask)


@triton.jit
def _sum_partials_kernel(part_ptr, dw_ptr, P, H, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr):
    """``dw[h] = sum_p part[p, h]``: ``BLOCK_P``-row slabs added in order, then one fixed tree over them."""
    cols = tl.program_id(0).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_mask = cols < H
    acc = tl.zeros((BLOCK_P, BLOCK_H), tl.float32)
    for p0 in range(0, P, BLOCK_P):
        ps = p0 + tl.arange(0, BLOCK_P).to(tl.int64)
        acc += tl.load(
            part_ptr + ps[:, None] * H + cols[None, :], mask=(ps[:, None] < P) & col_mask[None, :], other=0.0
        )
    tl.store(dw_ptr + cols, tl.sum(acc, axis=0).to(dw_ptr.dtype.element_ty), mask=col_mask)


# ----------------------------------------------------------------------------------------------
# primitives
# ----------------------------------------------------------------------------------------------


def rms_norm_fwd(x, weight, residual, eps, gemma, out, residual_out, rstd_out):
    """RMSNorm forward: ``y``, the new residual ``s`` (when fused) and ``rstd``.

    Args:
        x: ``[N, H]`` fp32 / fp16 / bf16, contiguous.
        weight: ``[H]``, x.dtype or fp32.
        residual: ``[N, H]`` x.dtype, or None (unfused: ``s = x``).
        eps: added to the mean of squares (rounded to fp32).
        gemma: the ``n * (1 + w)`` form.
        out: ``[N, H]``, written ``y`` in its own dtype (x.dtype; fp32 for an fp32 weight, see
            :func:`rlk.ops.norm.output_dtype`).
        residual_out: ``[N, H]`` x.dtype, written ``s = x + residual``; None when unfused.
        rstd_out: ``[N]`` fp32, written ``rsqrt(mean(s^2) + eps)``.

    Spec: :func:`rlk.reference.norm.rms_norm_fwd`. One program per ``FWD_ROWS`` rows, one pass over the inputs.
    """
    n_rows, hidden = x.shape
    block, chunks, warps = _row_tiles(hidden, x.dtype)
    rows = TILE_CONFIGS[x.dtype]["FWD_ROWS"]
    has_residual = residual is not None
    with on_device(x.device):
        _rms_norm_fwd_kernel[(triton.cdiv(n_rows, rows),)](
            x,
            weight,
            residual if has_residual else x,
            out,
            residual_out if has_residual else out,
            rstd_out,
            n_rows,
            hidden,
            eps,
            HAS_RESIDUAL=has_residual,
            GEMMA=bool(gemma),
            ROWS=rows,
            BLOCK_H=block,
            NUM_CHUNKS=chunks,
            num_warps=warps,
        )


def rms_norm_bwd(grad_out, s, weight, rstd, gemma, grad_residual, grad_input_out, grad_weight_out):
    """RMSNorm backward: the gradient of ``s`` (of x, and of residual when fused) and of the weight.

    Args:
        grad_out: ``[N, H]`` gradient of y (y's dtype), contiguous.
        s: ``[N, H]`` the normalized input (x, or x + residual), x.dtype.
        weight: ``[H]``; rstd: ``[N]`` fp32 from the forward; gemma: as in the forward.
        grad_residual: ``[N, H]`` x.dtype, the upstream gradient of the returned residual, or None.
        grad_input_out: ``[N, H]`` x.dtype, written ``rstd * (g_n - n * mean(g_n * n)) + grad_residual``.
        grad_weight_out: ``[H]`` weight.dtype, or None (not computed): ``sum_rows grad_y * n.to(x.dtype)``
            (``grad_y * n`` for Gemma), fp32 over the fixed ``BWD_ROWS`` partition, rounded once.

    Spec: :func:`rlk.reference.norm.rms_norm_bwd`. Extra memory: ``cdiv(N, BWD_ROWS) x H`` fp32 partials
    when ``grad_weight_out`` is given.
    """
    n_rows, hidden = s.shape
    cfg = TILE_CONFIGS[s.dtype]
    block, chunks, warps = _row_tiles(hidden, s.dtype)
    rows = cfg["BWD_ROWS"]
    n_programs = triton.cdiv(n_rows, rows)
    want_dw = grad_weight_out is not None
    has_gres = grad_residual is not None
    part = torch.empty((n_programs, hidden) if want_dw else (1,), dtype=torch.float32, device=s.device)
    with on_device(s.device):
        _rms_norm_bwd_kernel[(n_programs,)](
            grad_out,
            s,
            weight,
            rstd,
            grad_residual if has_gres else grad_out,
            grad_input_out,
            part,
            n_rows,
            hidden,
            HAS_GRES=has_gres,
            GEMMA=bool(gemma),
            WANT_DW=want_dw,
            ROWS=rows,
            BLOCK_H=block,
            NUM_CHUNKS=chunks,
            num_warps=warps,
        )
        if want_dw:
            _sum_partials_kernel[(triton.cdiv(hidden, cfg["SUM_BLOCK_H"]),)](
                part,
                grad_weight_out,
                n_programs,
                hidden,
                BLOCK_P=cfg["SUM_BLOCK_P"],
                BLOCK_H=cfg["SUM_BLOCK_H"],
            )
