"""Triton kernels of ``fused_linear_kl``: KL / JSD between a student's and a teacher's softmax, logits never stored.

Spec: :mod:`rlk.reference.distill` (formulas, the online states, the gradients). Layout, as in
``linear_logprob``'s kernels: a partial kernel over (row block x vocab split) programs recomputes both logit tiles
(``K`` loops over ``Hs`` and ``Ht``) and writes per-split states; a combine kernel merges a row's splits in split
order; the gradient walks the vocab in fixed chunks, writes ``G = d loss / d x_student`` of the chunk to a scratch
buffer and adds ``G @ W_s`` (fp32 accumulator) and ``G.T @ h_s`` with the fixed-order GEMM of ``logprob``'s
backward (``rlk_triton.matmul._gemm``, :data:`rlk_triton.matmul.BACKWARD_TILE_CONFIGS`).
Passes: forward / reverse KL one (their sums ride on the online states), JSD two; the gradient one more.
Batch invariance: tiles fixed per dtype (:data:`TILE_CONFIGS`, nothing derived from ``N``), no atomics, every
reduction in a fixed order; ``grad_weight`` sums rows in a fixed partition (deterministic).
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from rlk_triton.common import grouped_tile, on_device
from rlk_triton.logprob import _NO_FP_FUSION, _linear_logits_tile
from rlk_triton.matmul import BACKWARD_TILE_CONFIGS, _gemm

#: Fixed tiles per kernel family and input dtype (read at every call; nothing depends on ``N``). ``"partial"``:
#: a program owns ``BLOCK_N`` rows and ``VOCAB_SPLIT`` vocab columns (a multiple of ``BLOCK_V``), walked in
#: ``BLOCK_V`` tiles of both logits. ``"grad"``: one ``BLOCK_N x BLOCK_V`` tile of ``G`` per program, the vocab
#: walked in ``VOCAB_CHUNK`` columns. The GEMMs use ``rlk_triton.matmul.BACKWARD_TILE_CONFIGS``.
#: The 16-bit tiles are the fastest of four measured on an H200 at N = 16384, H = 4096, V = 151936 bf16 forward KL,
#: fwd+bwd: 128 x 128 x 64 w8 s3 261.8 ms, 64 x 128 x 64 w4 s3 291.7, 128 x 64 x 64 w8 s3 316.0, 128 x 64 x 32 w8
#: s3 (the earlier choice, free of register spills in ``ptxas -v``) 446.8 ms; the same loss to 7 digits and
#: gradients within 4.4e-5 relative L2 of each other (docs/performance.md). fp16 takes the bf16 tiles (not timed).
#: fp32: 64 x 64 x 32 with 8 warps, chosen offline (two fp32 logit tiles are live at once).
TILE_CONFIGS: dict[str, dict[torch.dtype, dict[str, int]]] = {
    "partial": {
        torch.float32: {
            "BLOCK_N": 64,
            "BLOCK_V": 64,
            "BLOCK_K": 32,
            "VOCAB_SPLIT": 4096,
            "GROUP_N": 32,
            "num_warps": 8,
            "num_stages": 2,
        },
        torch.float16: {
            "BLOCK_N": 128,
            "BLOCK_V": 128,
            "BLOCK_K": 64,
            "VOCAB_SPLIT": 4096,
            "GROUP_N": 8,
            "num_warps": 8,
            "num_stages": 3,
        },
        torch.bfloat16: {
            "BLOCK_N": 128,
            "BLOCK_V": 128,
            "BLOCK_K": 64,
            "VOCAB_SPLIT": 4096,
            "GROUP_N": 8,
            "num_warps": 8,
            "num_stages": 3,
        },
    },
    "grad": {
        torch.float32: {
            "BLOCK_N": 64,
            "BLOCK_V": 64,
            "BLOCK_K": 32,
            "VOCAB_CHUNK": 4096,
            "GROUP_N": 32,
            "num_warps": 8,
            "num_stages": 2,
        },
        torch.float16: {
            "BLOCK_N": 128,
            "BLOCK_V": 128,
            "BLOCK_K": 64,
            "VOCAB_CHUNK": 4096,
            "GROUP_N": 8,
            "num_warps": 8,
            "num_stages": 3,
        },
        torch.bfloat16: {
            "BLOCK_N": 128,
            "BLOCK_V": 128,
            "BLOCK_K": 64,
            "VOCAB_CHUNK": 4096,
            "GROUP_N": 8,
            "num_warps": 8,
            "num_stages": 3,
        },
    },
}

#: Rows per program of the combine kernel (per-row work: any value gives the same bits).
_COMBINE_ROWS = 128

#: Kernel modes: the partial kernel's pass and the gradient's divergence.
_FORWARD_KL, _REVERSE_KL, _LSE_ONLY, _JSD_SUMS = 0, 1, 2, 3
_DIVERGENCE_MODE = {"forward_kl": _FORWARD_KL, "reverse_kl": _REVERSE_KL, "jsd": _JSD_SUMS}
_PARTS = 5  # m_q, s_q, m_p, s_p, b (the JSD sums use the first two)


# ----------------------------------------------------------------------------------------------
# device helpers
# ----------------------------------------------------------------------------------------------


@triton.jit
def _shift(m):
    """The max a state is moved to: 0 while a row has seen only -inf (no ``(-inf) - (-inf)``)."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def _moved_b(b, s_a, m_a, m_c, shift_a, shift_c):
    """The KL sum ``b`` (weights of distribution a, relative to the shifts of ``m_a``, ``m_c``) moved to the
    shifts ``shift_a``, ``shift_c``: ``(b + ((sh(m_a) - shift_a) - (sh(m_c) - shift_c)) s_a) exp(m_a - shift_a)``,
    0 where that factor is 0."""
    r_a = tl.exp(m_a - shift_a)
    moved = (b + ((_shift(m_a) - shift_a) - (_shift(m_c) - shift_c)) * s_a) * r_a
    return tl.where(r_a > 0, moved, 0.0)


@triton.jit
def _merge(m_q, s_q, m_p, s_p, b, m_q2, s_q2, m_p2, s_p2, b2, MODE: tl.constexpr):
    """Two states merged, each moved to the common maxes; ``b`` weighted by p (forward KL) or q (reverse KL)."""
    new_q = tl.maximum(m_q, m_q2)
    new_p = tl.maximum(m_p, m_p2)
    sh_q = _shift(new_q)
    sh_p = _shift(new_p)
    if MODE == 0:
        b = _moved_b(b, s_p, m_p, m_q, sh_p, sh_q) + _moved_b(b2, s_p2, m_p2, m_q2, sh_p, sh_q)
    elif MODE == 1:
        b = _moved_b(b, s_q, m_q, m_p, sh_q, sh_p) + _moved_b(b2, s_q2, m_q2, m_p2, sh_q, sh_p)
    s_q = s_q * tl.exp(m_q - sh_q) + s_q2 * tl.exp(m_q2 - sh_q)
    s_p = s_p * tl.exp(m_p - sh_p) + s_p2 * tl.exp(m_p2 - sh_p)
    return new_q, s_q, new_p, s_p, b


@triton.jit
def _log_mixture(log_p, log_q, log_beta, log_1m_beta):
    """``log(beta p + (1 - beta) q)`` from ``log p``, ``log q`` (a logaddexp; NaN only where both are -inf)."""
    a = log_p + log_beta
    c = log_q + log_1m_beta
    hi = tl.maximum(a, c)
    lo = tl.minimum(a, c)
    return hi + tl.log(1.0 + tl.exp(lo - hi))


@triton.jit
def _tiles(
    sh_ptr,
    sw_ptr,
    th_ptr,
    tw_ptr,
    rows,
    row_mask,
    cols,
    col_mask,
    inv_t,
    HS,
    HT,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    """The student's and the teacher's scaled logit tiles ``[BLOCK_N, BLOCK_V]`` (-inf in masked columns)."""
    xq = _linear_logits_tile(sh_ptr, sw_ptr, rows, row_mask, cols, col_mask, HS, BLOCK_N, BLOCK_V, BLOCK_K, IEEE)
    zq = tl.where(col_mask[None, :], xq * inv_t[:, None], float("-inf"))
    xp = _linear_logits_tile(th_ptr, tw_ptr, rows, row_mask, cols, col_mask, HT, BLOCK_N, BLOCK_V, BLOCK_K, IEEE)
    zp = tl.where(col_mask[None, :], xp * inv_t[:, None], float("-inf"))
    return zq, zp


# ----------------------------------------------------------------------------------------------
# forward: (row block x vocab split) partials, then a fixed-order combine
# ----------------------------------------------------------------------------------------------


@triton.jit
def _partial_kernel(
    sh_ptr,
    sw_ptr,
    th_ptr,
    tw_ptr,
    inv_t_ptr,
    stats_ptr,
    part_ptr,
    N,
    HS,
    HT,
    V,
    n_splits,
    log_beta,
    log_1m_beta,
    MODE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    VOCAB_SPLIT: tl.constexpr,
    GROUP_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    """One vocab split of ``BLOCK_N`` rows. ``MODE`` 0 / 1 / 2: the online ``(m_q, s_q, m_p, s_p, b)`` with ``b``
    weighted by p / by q / not kept; 3 (JSD, after pass 1): ``KL(p || m)`` and ``KL(q || m)`` of the split, from the
    ``lse`` in ``stats``. Writes ``part[k, split, row]``."""
    row_tile, split = grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_N), n_splits, GROUP_N)
    rows = row_tile.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    inv_t = tl.load(inv_t_ptr + rows, mask=row_mask, other=1.0)
    v_begin = split.to(tl.int64) * VOCAB_SPLIT
    v_end = tl.minimum(v_begin + VOCAB_SPLIT, V)
    part = split.to(tl.int64) * N + rows
    stride = (tl.zeros((), tl.int64) + n_splits) * N
    if MODE == 3:
        lse_q = tl.load(stats_ptr + rows, mask=row_mask, other=0.0)[:, None]
        lse_p = tl.load(stats_ptr + N + rows, mask=row_mask, other=0.0)[:, None]
        kl_pm = tl.zeros((BLOCK_N,), tl.float32)
        kl_qm = tl.zeros((BLOCK_N,), tl.float32)
        for v0 in range(v_begin, v_end, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
            zq, zp = _tiles(
                sh_ptr,
                sw_ptr,
                th_ptr,
                tw_ptr,
                rows,
                row_mask,
                cols,
                cols < v_end,
                inv_t,
                HS,
                HT,
                BLOCK_N,
                BLOCK_V,
                BLOCK_K,
                IEEE,
            )
            log_q = zq - lse_q
            log_p = zp - lse_p
            log_m = _log_mixture(log_p, log_q, log_beta, log_1m_beta)
            p = tl.exp(log_p)
            q = tl.exp(log_q)
            kl_pm += tl.sum(tl.where(p > 0, p * (log_p - log_m), 0.0), axis=1)
            kl_qm += tl.sum(tl.where(q > 0, q * (log_q - log_m), 0.0), axis=1)
        tl.store(part_ptr + part, kl_pm, mask=row_mask)
        tl.store(part_ptr + stride + part, kl_qm, mask=row_mask)
    else:
        m_q = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        m_p = tl.full((BLOCK_N,), float("-inf"), tl.float32)
        s_q = tl.zeros((BLOCK_N,), tl.float32)
        s_p = tl.zeros((BLOCK_N,), tl.float32)
        b = tl.zeros((BLOCK_N,), tl.float32)
        for v0 in range(v_begin, v_end, BLOCK_V):
            cols = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
            zq, zp = _tiles(
                sh_ptr,
                sw_ptr,
                th_ptr,
                tw_ptr,
                rows,
                row_mask,
                cols,
                cols < v_end,
                inv_t,
                HS,
                HT,
                BLOCK_N,
                BLOCK_V,
                BLOCK_K,
                IEEE,
            )
            new_q = tl.maximum(m_q, tl.max(zq, axis=1))
            new_p = tl.maximum(m_p, tl.max(zp, axis=1))
            sh_q = _shift(new_q)
            sh_p = _shift(new_p)
            dq = zq - sh_q[:, None]  # <= 0
            dp = zp - sh_p[:, None]
            eq = tl.exp(dq)
            ep = tl.exp(dp)
            if MODE == 0:
                b = _moved_b(b, s_p, m_p, m_q, sh_p, sh_q) + tl.sum(tl.where(ep > 0, ep * (dp - dq), 0.0), axis=1)
            elif MODE == 1:
                b = _moved_b(b, s_q, m_q, m_p, sh_q, sh_p) + tl.sum(tl.where(eq > 0, eq * (dq - dp), 0.0), axis=1)
            s_q = s_q * tl.exp(m_q - sh_q) + tl.sum(eq, axis=1)
            s_p = s_p * tl.exp(m_p - sh_p) + tl.sum(ep, axis=1)
            m_q = new_q
            m_p = new_p
        tl.store(part_ptr + part, m_q, mask=row_mask)
        tl.store(part_ptr + stride + part, s_q, mask=row_mask)
        tl.store(part_ptr + 2 * stride + part, m_p, mask=row_mask)
        tl.store(part_ptr + 3 * stride + part, s_p, mask=row_mask)
        if MODE != 2:
            tl.store(part_ptr + 4 * stride + part, b, mask=row_mask)


@triton.jit
def _combine_kernel(
    part_ptr,
    targets_ptr,
    loss_ptr,
    stats_ptr,
    N,
    n_splits,
    ignore_index,
    beta,
    MODE: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """A row's splits merged in split order. ``MODE`` 0 / 1: write the KL, the ``lse`` and the row constant;
    2: the ``lse`` only (JSD pass 1); 3: the JSD from the summed ``KL(p || m)``, ``KL(q || m)``."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    row_mask = rows < N
    stride = (tl.zeros((), tl.int64) + n_splits) * N
    valid = row_mask
    if HAS_TARGETS:
        valid = row_mask & (tl.load(targets_ptr + rows, mask=row_mask, other=ignore_index) != ignore_index)
    if MODE == 3:
        kl_pm = tl.load(part_ptr + rows, mask=row_mask, other=0.0)
        kl_qm = tl.load(part_ptr + stride + rows, mask=row_mask, other=0.0)
        for split in range(1, n_splits):
            at = (tl.zeros((), tl.int64) + split) * N + rows  # int64: n_splits * N may pass 2^31
            kl_pm += tl.load(part_ptr + at, mask=row_mask, other=0.0)
            kl_qm += tl.load(part_ptr + stride + at, mask=row_mask, other=0.0)
        loss = beta * kl_pm + (1.0 - beta) * kl_qm
        tl.store(loss_ptr + rows, tl.where(valid, loss, 0.0), mask=row_mask)
        tl.store(stats_ptr + 2 * N + rows, tl.where(valid, kl_qm, 0.0), mask=row_mask)
    else:
        m_q = tl.load(part_ptr + rows, mask=row_mask, other=float("-inf"))
        s_q = tl.load(part_ptr + stride + rows, mask=row_mask, other=0.0)
        m_p = tl.load(part_ptr + 2 * stride + rows, mask=row_mask, other=float("-inf"))
        s_p = tl.load(part_ptr + 3 * stride + rows, mask=row_mask, other=0.0)
        b = tl.zeros((BLOCK,), tl.float32)
        if MODE != 2:
            b = tl.load(part_ptr + 4 * stride + rows, mask=row_mask, other=0.0)
        for split in range(1, n_splits):
            at = (tl.zeros((), tl.int64) + split) * N + rows  # int64: n_splits * N may pass 2^31
            m_q2 = tl.load(part_ptr + at, mask=row_mask, other=float("-inf"))
            s_q2 = tl.load(part_ptr + stride + at, mask=row_mask, other=0.0)
            m_p2 = tl.load(part_ptr + 2 * stride + at, mask=row_mask, other=float("-inf"))
            s_p2 = tl.load(part_ptr + 3 * stride + at, mask=row_mask, other=0.0)
            b2 = b
            if MODE != 2:
                b2 = tl.load(part_ptr + 4 * stride + at, mask=row_mask, other=0.0)
            m_q, s_q, m_p, s_p, b = _merge(m_q, s_q, m_p, s_p, b, m_q2, s_q2, m_p2, s_p2, b2, MODE)
        log_s_q = tl.log(s_q)
        log_s_p = tl.log(s_p)
        tl.store(stats_ptr + rows, m_q + log_s_q, mask=row_mask)
        tl.store(stats_ptr + N + rows, m_p + log_s_p, mask=row_mask)
        if MODE == 0:
            loss = b / s_p - log_s_p + log_s_q
            tl.store(loss_ptr + rows, tl.where(valid, loss, 0.0), mask=row_mask)
            tl.store(stats_ptr + 2 * N + rows, tl.zeros((BLOCK,), tl.float32), mask=row_mask)
        elif MODE == 1:
            loss = b / s_q - log_s_q + log_s_p
            tl.store(loss_ptr + rows, tl.where(valid, loss, 0.0), mask=row_mask)
            tl.store(stats_ptr + 2 * N + rows, tl.where(valid, loss, 0.0), mask=row_mask)


def _pass(
    mode,
    student_hidden,
    student_weight,
    teacher_hidden,
    teacher_weight,
    targets,
    inv_temperature,
    ignore_index,
    beta,
    loss_out,
    stats_out,
):
    """One partial launch and its combine."""
    n_rows, hs = student_hidden.shape
    ht = teacher_hidden.shape[1]
    vocab = student_weight.shape[0]
    cfg = TILE_CONFIGS["partial"][student_hidden.dtype]
    n_splits = triton.cdiv(vocab, cfg["VOCAB_SPLIT"])
    part = torch.empty(
        (_PARTS if mode != _JSD_SUMS else 2, n_splits, n_rows), dtype=torch.float32, device=student_hidden.device
    )
    log_beta, log_1m_beta = (math.log(beta), math.log1p(-beta)) if mode == _JSD_SUMS else (0.0, 0.0)
    with on_device(student_hidden.device):
        _partial_kernel[(triton.cdiv(n_rows, cfg["BLOCK_N"]) * n_splits,)](
            student_hidden,
            student_weight,
            teacher_hidden,
            teacher_weight,
            inv_temperature,
            stats_out,
            part,
            n_rows,
            hs,
            ht,
            vocab,
            n_splits,
            log_beta,
            log_1m_beta,
            MODE=mode,
            BLOCK_N=cfg["BLOCK_N"],
            BLOCK_V=cfg["BLOCK_V"],
            BLOCK_K=cfg["BLOCK_K"],
            VOCAB_SPLIT=cfg["VOCAB_SPLIT"],
            GROUP_N=cfg["GROUP_N"],
            IEEE=student_hidden.dtype == torch.float32,
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
            **_NO_FP_FUSION,
        )
        _combine_kernel[(triton.cdiv(n_rows, _COMBINE_ROWS),)](
            part,
            targets if targets is not None else inv_temperature,
            loss_out,
            stats_out,
            n_rows,
            n_splits,
            ignore_index,
            beta,
            MODE=mode,
            HAS_TARGETS=targets is not None,
            BLOCK=_COMBINE_ROWS,
            **_NO_FP_FUSION,
        )


# ----------------------------------------------------------------------------------------------
# gradient: per vocab chunk, G (recomputed) then two GEMMs
# ----------------------------------------------------------------------------------------------


@triton.jit
def _grad_kernel(
    sh_ptr,
    sw_ptr,
    th_ptr,
    tw_ptr,
    targets_ptr,
    inv_t_ptr,
    stats_ptr,
    coef_ptr,
    g_ptr,
    N,
    HS,
    HT,
    v_start,
    chunk_cols,
    g_stride,
    ignore_index,
    log_beta,
    log_1m_beta,
    one_m_beta,
    MODE: tl.constexpr,
    HAS_TARGETS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    """``G[:, 0:chunk_cols]`` = ``coef * inv_t * d loss / d z_student`` for vocab columns ``v_start + [0,
    chunk_cols)`` (``MODE``: 0 forward KL, 1 reverse KL, 3 JSD); 0 on ignored rows; stored in ``g``'s dtype."""
    row_tile, col_tile = grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(chunk_cols, BLOCK_V), GROUP_N)
    rows = row_tile.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    local_cols = col_tile.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = local_cols < chunk_cols
    valid = row_mask
    if HAS_TARGETS:
        valid = row_mask & (tl.load(targets_ptr + rows, mask=row_mask, other=ignore_index) != ignore_index)
    inv_t = tl.load(inv_t_ptr + rows, mask=row_mask, other=1.0)
    lse_q = tl.load(stats_ptr + rows, mask=row_mask, other=0.0)[:, None]
    lse_p = tl.load(stats_ptr + N + rows, mask=row_mask, other=0.0)[:, None]
    aux = tl.load(stats_ptr + 2 * N + rows, mask=row_mask, other=0.0)[:, None]
    scale = tl.load(coef_ptr + rows, mask=row_mask, other=0.0) * inv_t
    zq, zp = _tiles(
        sh_ptr,
        sw_ptr,
        th_ptr,
        tw_ptr,
        rows,
        row_mask,
        v_start + local_cols,
        col_mask,
        inv_t,
        HS,
        HT,
        BLOCK_N,
        BLOCK_V,
        BLOCK_K,
        IEEE,
    )
    log_q = zq - lse_q
    log_p = zp - lse_p
    q = tl.exp(log_q)
    if MODE == 0:
        g = q - tl.exp(log_p)
    elif MODE == 1:
        g = tl.where(q > 0, q * ((log_q - log_p) - aux), 0.0)
    else:
        log_m = _log_mixture(log_p, log_q, log_beta, log_1m_beta)
        g = one_m_beta * tl.where(q > 0, q * ((log_q - log_m) - aux), 0.0)
    g = tl.where(valid[:, None], g * scale[:, None], 0.0)
    g_ptrs = g_ptr + rows[:, None] * g_stride + local_cols[None, :]
    tl.store(g_ptrs, g.to(g_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def _gradients(
    student_hidden,
    student_weight,
    teacher_hidden,
    teacher_weight,
    targets,
    inv_temperature,
    stats,
    coef,
    ignore_index,
    divergence,
    beta,
    grad_hidden_out,
    grad_weight_out,
):
    """``grad_hidden_out`` / ``grad_weight_out`` (either may be None) of ``sum_i coef_i loss_i``: for each
    ``VOCAB_CHUNK`` chunk ``c`` in order, ``G_c`` (input dtype, one scratch buffer), the fp32 ``[N, Hs]``
    accumulator gets ``G_c @ W_s[c]`` (the first chunk writes it) and ``grad_weight[c] = G_c.T @ h_s`` (rows summed
    in fixed order); the accumulator is rounded once to ``grad_hidden_out``'s dtype."""
    if grad_hidden_out is None and grad_weight_out is None:
        return
    n_rows, hs = student_hidden.shape
    ht = teacher_hidden.shape[1]
    vocab = student_weight.shape[0]
    cfg = TILE_CONFIGS["grad"][student_hidden.dtype]
    gemm_cfg = BACKWARD_TILE_CONFIGS[student_hidden.dtype]
    chunk = cfg["VOCAB_CHUNK"]
    g = torch.empty((n_rows, min(chunk, vocab)), dtype=student_hidden.dtype, device=student_hidden.device)
    acc = None
    if grad_hidden_out is not None:
        acc = torch.empty((n_rows, hs), dtype=torch.float32, device=student_hidden.device)
    mode = _DIVERGENCE_MODE[divergence]
    log_beta, log_1m_beta = (math.log(beta), math.log1p(-beta)) if mode == _JSD_SUMS else (0.0, 0.0)
    with on_device(student_hidden.device):
        for v_start in range(0, vocab, chunk):
            cols = min(chunk, vocab - v_start)
            grid = (triton.cdiv(n_rows, cfg["BLOCK_N"]) * triton.cdiv(cols, cfg["BLOCK_V"]),)
            _grad_kernel[grid](
                student_hidden,
                student_weight,
                teacher_hidden,
                teacher_weight,
                targets if targets is not None else inv_temperature,
                inv_temperature,
                stats,
                coef,
                g,
                n_rows,
                hs,
                ht,
                v_start,
                cols,
                g.stride(0),
                ignore_index,
                log_beta,
                log_1m_beta,
                1.0 - beta,
                MODE=mode,
                HAS_TARGETS=targets is not None,
                BLOCK_N=cfg["BLOCK_N"],
                BLOCK_V=cfg["BLOCK_V"],
                BLOCK_K=cfg["BLOCK_K"],
                GROUP_N=cfg["GROUP_N"],
                IEEE=student_hidden.dtype == torch.float32,
                num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"],
                **_NO_FP_FUSION,
            )
            g_chunk = g[:, :cols]
            if acc is not None:
                _gemm(
                    g_chunk,
                    student_weight[v_start : v_start + cols],
                    acc,
                    addend=acc if v_start > 0 else None,
                    cfg=gemm_cfg,
                )
            if grad_weight_out is not None:
                _gemm(g_chunk.T, student_hidden, grad_weight_out[v_start : v_start + cols], cfg=gemm_cfg)
    if grad_hidden_out is not None:
        grad_hidden_out.copy_(acc)


# ----------------------------------------------------------------------------------------------
# primitives
# ----------------------------------------------------------------------------------------------


def fused_linear_kl_fwd(
    student_hidden,
    student_weight,
    teacher_hidden,
    teacher_weight,
    targets,
    inv_temperature,
    ignore_index,
    divergence,
    beta,
    loss_out,
    stats_out,
    grad_coef,
    grad_hidden_out,
    grad_weight_out,
):
    """Per-row divergence (``loss_out`` ``[N]`` fp32, 0 on ignored rows) and ``stats_out`` ``[3, N]`` fp32
    (``lse_student``, ``lse_teacher``, the gradient's row constant); with ``grad_coef`` ``[N]`` also the gradients of
    ``sum_i grad_coef_i loss_i``. Spec: :func:`rlk.reference.distill.fused_linear_kl_fwd`. Launches: KLs one
    partial + combine, JSD two of each; the gradient one grad kernel and up to two GEMMs per vocab chunk."""
    args = (
        student_hidden,
        student_weight,
        teacher_hidden,
        teacher_weight,
        targets,
        inv_temperature,
        ignore_index,
        beta,
        loss_out,
        stats_out,
    )
    if divergence == "jsd":
        _pass(_LSE_ONLY, *args)
        _pass(_JSD_SUMS, *args)
    else:
        _pass(_DIVERGENCE_MODE[divergence], *args)
    if grad_coef is not None:
        _gradients(
            student_hidden,
            student_weight,
            teacher_hidden,
            teacher_weight,
            targets,
            inv_temperature,
            stats_out,
            grad_coef,
            ignore_index,
            divergence,
            beta,
            grad_hidden_out,
            grad_weight_out,
        )


def fused_linear_kl_bwd(
    student_hidden,
    student_weight,
    teacher_hidden,
    teacher_weight,
    targets,
    inv_temperature,
    stats,
    grad_loss,
    ignore_index,
    divergence,
    beta,
    grad_hidden_out,
    grad_weight_out,
):
    """Gradients of ``sum_i grad_loss_i loss_i`` from the forward's ``stats`` (logits recomputed).
    Spec: :func:`rlk.reference.distill.fused_linear_kl_bwd`."""
    _gradients(
        student_hidden,
        student_weight,
        teacher_hidden,
        teacher_weight,
        targets,
        inv_temperature,
        stats,
        grad_loss,
        ignore_index,
        divergence,
        beta,
        grad_hidden_out,
        grad_weight_out,
    )
