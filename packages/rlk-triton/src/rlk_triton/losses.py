"""Triton kernels of the value loss (PPO critic) and the DPO family.

The math is the spec in :mod:`rlk.reference.losses`; the aggregation weights come from
:mod:`rlk.reference.aggregation` as per-row weights ``c[B]``.

``value_loss``: ``loss = 0.5 * sum_i c_i * sum_t m max((v - R)^2, (clip(v, v_old +- eps) - R)^2)``.
The forward runs one program per row, walking the row's tokens in ``BLOCK_T`` chunks into
``BLOCK_T``-lane accumulators (loss, sum of values, token count, clipped count), reduced with one
``tl.sum`` tree and stored as per-row partials (``c_i`` applied); one program then sums the
partials in row order (:func:`rlk_triton.aggregation.fixed_order_sum`) and writes the loss and
the metrics. The backward is elementwise: ``dv = g * c_i * (v - R)`` where the token is masked
in and not clipped, else 0; a ``(row, BLOCK_T chunk)`` grid.

``dpo_loss``: elementwise over pairs in ``BLOCK_P`` blocks (per-pair losses, per-block partial
sums of the loss and the metrics), then one program sums the block partials in block order.
The backward is elementwise.

Batch invariance and determinism by construction: block sizes are fixed constants (no
autotuning, nothing derived from the batch), a row's (pair's) values and gradients are computed
from that row alone by the same instruction sequence wherever it sits, there are no atomics,
and every reduction runs in a fixed order. Accumulation is fp32; token counts are int32 (exact).
Masked-out tokens are never loaded, so inf/NaN padding cannot leak into the results.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlk_triton.aggregation import COMBINE_BLOCK, fixed_order_sum
from rlk_triton.common import on_device

#: Tokens per chunk of the value-loss kernels (a row is walked in chunks of this size).
VALUE_BLOCK_T = 1024
#: Pairs per program of the DPO kernels.
DPO_BLOCK_P = 1024

#: DPO variant -> code used by the kernels (order of ``rlk.reference.losses.DPO_LOSSES``).
_DPO_CODES = {"sigmoid": 0, "hinge": 1, "ipo": 2, "robust": 3}


# ----------------------------------------------------------------------------------------------
# value loss
# ----------------------------------------------------------------------------------------------


@triton.jit
def _value_terms(v, v_old, ret, clip, HAS_CLIP: tl.constexpr):
    """Per-token ``L = max(L1, L2)``, ``clipped = L2 > L1`` and ``v - R`` (see the module docstring)."""
    diff = v - ret
    l1 = diff * diff
    if HAS_CLIP:
        v_clipped = tl.minimum(tl.maximum(v, v_old - clip), v_old + clip)
        diff2 = v_clipped - ret
        l2 = diff2 * diff2
        clipped = l2 > l1
        loss = tl.where(clipped, l2, l1)
    else:
        clipped = tl.full(l1.shape, 0, tl.int1)
        loss = l1
    return loss, clipped, diff


@triton.jit
def _value_fwd_row_kernel(
    v_ptr,
    v_old_ptr,
    ret_ptr,
    mask_ptr,
    c_ptr,
    part_loss_ptr,
    part_vsum_ptr,
    part_n_ptr,
    part_clip_ptr,
    B,
    T,
    clip,
    HAS_CLIP: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """Row partials: ``c_i * sum_t m L``, ``sum_t m v``, ``sum_t m`` and ``sum_t m [L2 > L1]``."""
    row = tl.program_id(0).to(tl.int64)
    base = row * T
    acc_loss = tl.zeros((BLOCK_T,), tl.float32)
    acc_v = tl.zeros((BLOCK_T,), tl.float32)
    acc_n = tl.zeros((BLOCK_T,), tl.int32)
    acc_clip = tl.zeros((BLOCK_T,), tl.int32)
    for t0 in range(0, T, BLOCK_T):
        offs = base + t0 + tl.arange(0, BLOCK_T)
        m = tl.load(mask_ptr + offs, mask=(t0 + tl.arange(0, BLOCK_T)) < T, other=0) != 0
        v = tl.load(v_ptr + offs, mask=m, other=0.0)
        ret = tl.load(ret_ptr + offs, mask=m, other=0.0)
        v_old = v
        if HAS_CLIP:
            v_old = tl.load(v_old_ptr + offs, mask=m, other=0.0)
        loss, clipped, _ = _value_terms(v, v_old, ret, clip, HAS_CLIP)
        acc_loss += tl.where(m, loss, 0.0)
        acc_v += v
        acc_n += m.to(tl.int32)
        acc_clip += (m & clipped).to(tl.int32)
    c = tl.load(c_ptr + row)
    tl.store(part_loss_ptr + row, c * tl.sum(acc_loss, axis=0))
    tl.store(part_vsum_ptr + row, tl.sum(acc_v, axis=0))
    tl.store(part_n_ptr + row, tl.sum(acc_n, axis=0))
    tl.store(part_clip_ptr + row, tl.sum(acc_clip, axis=0))


@triton.jit
def _value_fwd_combine_kernel(
    part_loss_ptr,
    part_vsum_ptr,
    part_n_ptr,
    part_clip_ptr,
    loss_ptr,
    metrics_ptr,
    B,
    BLOCK: tl.constexpr,
):
    """``loss = 0.5 * sum_i part_loss_i``; clip fraction and mean value over all masked tokens."""
    total = fixed_order_sum(part_loss_ptr, B, BLOCK)
    v_sum = fixed_order_sum(part_vsum_ptr, B, BLOCK)
    n = tl.maximum(fixed_order_sum(part_n_ptr, B, BLOCK), 1).to(tl.float32)
    n_clip = fixed_order_sum(part_clip_ptr, B, BLOCK).to(tl.float32)
    tl.store(loss_ptr, 0.5 * total)
    tl.store(metrics_ptr, n_clip / n)
    tl.store(metrics_ptr + 1, v_sum / n)


@triton.jit
def _value_bwd_kernel(
    v_ptr,
    v_old_ptr,
    ret_ptr,
    mask_ptr,
    c_ptr,
    grad_loss_ptr,
    grad_ptr,
    T,
    clip,
    HAS_CLIP: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    """``dv = g * c_i * (v - R)`` on masked-in, unclipped tokens; 0 elsewhere."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_T + tl.arange(0, BLOCK_T)
    in_row = cols < T
    offs = row * T + cols
    m = tl.load(mask_ptr + offs, mask=in_row, other=0) != 0
    v = tl.load(v_ptr + offs, mask=m, other=0.0)
    ret = tl.load(ret_ptr + offs, mask=m, other=0.0)
    v_old = v
    if HAS_CLIP:
        v_old = tl.load(v_old_ptr + offs, mask=m, other=0.0)
    _, clipped, diff = _value_terms(v, v_old, ret, clip, HAS_CLIP)
    scale = tl.load(grad_loss_ptr) * tl.load(c_ptr + row)
    grad = tl.where(m & ~clipped, scale * diff, 0.0)
    tl.store(grad_ptr + offs, grad, mask=in_row)


def value_loss_fwd(values, old_values, returns, mask, row_weight, clip, loss_out, metrics_out):
    """PPO critic loss and its metrics.

    Args:
        values, old_values, returns: ``[B, T]`` fp32, contiguous.
        mask: ``[B, T]`` bool, contiguous.
        row_weight: ``[B]`` fp32, the aggregation weights ``c``.
        clip: the clip range ``eps >= 0``, or None (unclipped).
        loss_out: ``[]`` fp32, written ``0.5 * sum_i c_i sum_t m L``.
        metrics_out: ``[2]`` fp32, written (vf_clip_fraction, values_mean) over the masked tokens.

    Spec: :func:`rlk.reference.losses.value_loss_fwd`. Two launches: ``B`` row programs, then one
    combine program; scratch ``4 x B`` (fp32 and int32).
    """
    n_rows, n_cols = values.shape
    mask = mask.view(torch.uint8)  # same bytes; the kernels test != 0
    part_f = torch.empty((2, n_rows), dtype=torch.float32, device=values.device)
    part_i = torch.empty((2, n_rows), dtype=torch.int32, device=values.device)
    has_clip = clip is not None
    with on_device(values.device):
        _value_fwd_row_kernel[(n_rows,)](
            values,
            old_values,
            returns,
            mask,
            row_weight,
            part_f[0],
            part_f[1],
            part_i[0],
            part_i[1],
            n_rows,
            n_cols,
            float(clip) if has_clip else 0.0,
            HAS_CLIP=has_clip,
            BLOCK_T=VALUE_BLOCK_T,
        )
        _value_fwd_combine_kernel[(1,)](
            part_f[0],
            part_f[1],
            part_i[0],
            part_i[1],
            loss_out,
            metrics_out,
            n_rows,
            BLOCK=COMBINE_BLOCK,
        )


def value_loss_bwd(values, old_values, returns, mask, row_weight, clip, grad_loss, grad_values_out):
    """Gradient of ``grad_loss * loss`` w.r.t. the values.

    Args:
        values, old_values, returns, mask, row_weight, clip: as in :func:`value_loss_fwd`.
        grad_loss: ``[]`` fp32, the gradient of the loss (read on the device: no host sync).
        grad_values_out: ``[B, T]`` fp32, written ``g * c_i * (v - R)`` or 0.

    Spec: :func:`rlk.reference.losses.value_loss_bwd`. Elementwise, grid ``B x cdiv(T, BLOCK_T)``.
    """
    n_rows, n_cols = values.shape
    mask = mask.view(torch.uint8)
    has_clip = clip is not None
    with on_device(values.device):
        _value_bwd_kernel[(n_rows, triton.cdiv(n_cols, VALUE_BLOCK_T))](
            values,
            old_values,
            returns,
            mask,
            row_weight,
            grad_loss,
            grad_values_out,
            n_cols,
            float(clip) if has_clip else 0.0,
            HAS_CLIP=has_clip,
            BLOCK_T=VALUE_BLOCK_T,
        )


# ----------------------------------------------------------------------------------------------
# DPO
# ----------------------------------------------------------------------------------------------


@triton.jit
def _softplus(y):
    """``log(1 + exp(y))`` without overflow, accurate for large ``|y|`` (``-logsigmoid(-y)``)."""
    e = tl.exp(-tl.abs(y))  # in (0, 1]
    u = 1.0 + e
    # log1p(e): log(u) * e / (u - 1) corrects the rounding of 1 + e; e itself when 1 + e rounds to 1.
    den = tl.where(u == 1.0, 1.0, u - 1.0)
    log1p = tl.where(u == 1.0, e, tl.log(u) * (e / den))
    return tl.maximum(y, 0.0) + log1p


@triton.jit
def _sigmoid(y):
    e = tl.exp(-tl.abs(y))
    return tl.where(y >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def _dpo_terms(lc_ptr, lr_ptr, lc_ref_ptr, lr_ref_ptr, nc_ptr, nr_ptr, offs, valid, beta, eps, LOSS: tl.constexpr):
    """Per pair: loss, dl/dx, dx/dlc, dx/dlr and the two rewards (see the module docstring)."""
    lc = tl.load(lc_ptr + offs, mask=valid, other=0.0)
    lr = tl.load(lr_ptr + offs, mask=valid, other=0.0)
    lc_ref = tl.load(lc_ref_ptr + offs, mask=valid, other=0.0)
    lr_ref = tl.load(lr_ref_ptr + offs, mask=valid, other=0.0)
    dx_dc = tl.full(lc.shape, 1.0, tl.float32)
    dx_dr = tl.full(lc.shape, -1.0, tl.float32)
    if LOSS == 2:  # ipo: length-normalized log-probs
        n_c = tl.maximum(tl.load(nc_ptr + offs, mask=valid, other=1.0), 1.0)
        n_r = tl.maximum(tl.load(nr_ptr + offs, mask=valid, other=1.0), 1.0)
        lc = lc / n_c
        lc_ref = lc_ref / n_c
        lr = lr / n_r
        lr_ref = lr_ref / n_r
        dx_dc = 1.0 / n_c
        dx_dr = -1.0 / n_r
    x = (lc - lr) - (lc_ref - lr_ref)
    u = beta * x
    if LOSS == 0:  # sigmoid (label smoothing eps: conservative DPO)
        loss = (1.0 - eps) * _softplus(-u) + eps * _softplus(u)
        dl_dx = beta * (-(1.0 - eps) * _sigmoid(-u) + eps * _sigmoid(u))
    elif LOSS == 1:  # hinge
        loss = tl.maximum(1.0 - u, 0.0)
        dl_dx = tl.where(u < 1.0, -beta, 0.0)
    elif LOSS == 2:  # ipo
        d = x - 0.5 / beta
        loss = d * d
        dl_dx = 2.0 * d
    else:  # robust
        loss = ((1.0 - eps) * _softplus(-u) - eps * _softplus(u)) / (1.0 - 2.0 * eps)
        dl_dx = beta * (-(1.0 - eps) * _sigmoid(-u) - eps * _sigmoid(u)) / (1.0 - 2.0 * eps)
    return loss, dl_dx, dx_dc, dx_dr, beta * (lc - lc_ref), beta * (lr - lr_ref)


# The pair count is not specialized: Triton compiles a count of 1 as a constant, and that variant's code gave one
# pair's ipo loss other bits than the generic one (H200 fuzzing: 1 pair alone vs 2 pairs, 2 ulps apart).
@triton.jit(do_not_specialize=["P"])
def _dpo_fwd_kernel(
    lc_ptr,
    lr_ptr,
    lc_ref_ptr,
    lr_ref_ptr,
    nc_ptr,
    nr_ptr,
    losses_ptr,
    part_ptr,
    P,
    n_blocks,
    beta,
    eps,
    LOSS: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """Per-pair losses, and this block's sums of (loss, reward_c, reward_r, margin, accuracy)."""
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK_P + tl.arange(0, BLOCK_P)
    valid = offs < P
    loss, _, _, _, r_c, r_r = _dpo_terms(
        lc_ptr, lr_ptr, lc_ref_ptr, lr_ref_ptr, nc_ptr, nr_ptr, offs, valid, beta, eps, LOSS
    )
    tl.store(losses_ptr + offs, loss, mask=valid)
    tl.store(part_ptr + pid, tl.sum(tl.where(valid, loss, 0.0), axis=0))
    tl.store(part_ptr + n_blocks + pid, tl.sum(tl.where(valid, r_c, 0.0), axis=0))
    tl.store(part_ptr + 2 * n_blocks + pid, tl.sum(tl.where(valid, r_r, 0.0), axis=0))
    tl.store(part_ptr + 3 * n_blocks + pid, tl.sum(tl.where(valid, r_c - r_r, 0.0), axis=0))
    tl.store(part_ptr + 4 * n_blocks + pid, tl.sum(tl.where(valid & (r_c > r_r), 1.0, 0.0), axis=0))


@triton.jit
def _dpo_fwd_combine_kernel(part_ptr, loss_ptr, metrics_ptr, n_blocks, inv_p, MEAN: tl.constexpr, BLOCK: tl.constexpr):
    """Sum the block partials in block order; the loss is their mean (``MEAN``) or sum, the metrics means."""
    total = fixed_order_sum(part_ptr, n_blocks, BLOCK)
    if MEAN:
        total = total * inv_p
    tl.store(loss_ptr, total)
    for k in tl.static_range(4):
        tl.store(metrics_ptr + k, fixed_order_sum(part_ptr + (k + 1) * n_blocks, n_blocks, BLOCK) * inv_p)


@triton.jit(do_not_specialize=["P"])
def _dpo_bwd_kernel(
    lc_ptr,
    lr_ptr,
    lc_ref_ptr,
    lr_ref_ptr,
    nc_ptr,
    nr_ptr,
    g_losses_ptr,
    g_loss_ptr,
    grad_c_ptr,
    grad_r_ptr,
    P,
    inv_p,
    beta,
    eps,
    LOSS: tl.constexpr,
    HAS_G_LOSSES: tl.constexpr,
    HAS_G_LOSS: tl.constexpr,
    MEAN: tl.constexpr,
    BLOCK_P: tl.constexpr,
):
    """``d / d lc = g_i * dl/dx * dx/dlc`` (same for ``lr``), ``g_i = g_losses_i + g_loss (/ P when MEAN)``."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK_P + tl.arange(0, BLOCK_P)
    valid = offs < P
    _, dl_dx, dx_dc, dx_dr, _, _ = _dpo_terms(
        lc_ptr, lr_ptr, lc_ref_ptr, lr_ref_ptr, nc_ptr, nr_ptr, offs, valid, beta, eps, LOSS
    )
    g = tl.zeros((BLOCK_P,), tl.float32)
    if HAS_G_LOSSES:
        g += tl.load(g_losses_ptr + offs, mask=valid, other=0.0)
    if HAS_G_LOSS:
        g_loss = tl.load(g_loss_ptr)
        if MEAN:
            g_loss = g_loss * inv_p
        g += g_loss
    grad_x = g * dl_dx
    tl.store(grad_c_ptr + offs, grad_x * dx_dc, mask=valid)
    tl.store(grad_r_ptr + offs, grad_x * dx_dr, mask=valid)


def dpo_loss_fwd(
    chosen,
    rejected,
    ref_chosen,
    ref_rejected,
    len_chosen,
    len_rejected,
    beta,
    loss_type,
    label_smoothing,
    mean,
    losses_out,
    loss_out,
    metrics_out,
):
    """DPO-family losses of ``P`` preference pairs.

    Args:
        chosen, rejected, ref_chosen, ref_rejected: ``[P]`` fp32 sequence log-probs.
        len_chosen, len_rejected: ``[P]`` fp32 completion lengths (``ipo`` only; None otherwise).
        beta: ``> 0``. loss_type: ``sigmoid``, ``hinge``, ``ipo`` or ``robust``.
        label_smoothing: ``eps`` of ``sigmoid`` / ``robust`` (0 for the others).
        mean: whether ``loss_out`` is the mean (else the sum) of the per-pair losses.
        losses_out: ``[P]`` fp32 per-pair losses. loss_out: ``[]`` fp32.
        metrics_out: ``[4]`` fp32 means of (rewards_chosen, rewards_rejected, reward_margin, reward_accuracy).

    Spec: :func:`rlk.reference.losses.dpo_loss_fwd`. ``cdiv(P, BLOCK_P)`` elementwise programs with
    per-block partial sums, then one program sums them in block order.
    """
    n_pairs = chosen.shape[0]
    n_blocks = triton.cdiv(n_pairs, DPO_BLOCK_P)
    part = torch.empty((5, n_blocks), dtype=torch.float32, device=chosen.device)
    code = _DPO_CODES[loss_type]
    n_c = len_chosen if len_chosen is not None else chosen
    n_r = len_rejected if len_rejected is not None else chosen
    with on_device(chosen.device):
        _dpo_fwd_kernel[(n_blocks,)](
            chosen,
            rejected,
            ref_chosen,
            ref_rejected,
            n_c,
            n_r,
            losses_out,
            part,
            n_pairs,
            n_blocks,
            float(beta),
            float(label_smoothing),
            LOSS=code,
            BLOCK_P=DPO_BLOCK_P,
        )
        _dpo_fwd_combine_kernel[(1,)](
            part, loss_out, metrics_out, n_blocks, 1.0 / n_pairs, MEAN=bool(mean), BLOCK=COMBINE_BLOCK
        )


def dpo_loss_bwd(
    chosen,
    rejected,
    ref_chosen,
    ref_rejected,
    len_chosen,
    len_rejected,
    beta,
    loss_type,
    label_smoothing,
    mean,
    grad_losses,
    grad_loss,
    grad_chosen_out,
    grad_rejected_out,
):
    """Gradients w.r.t. ``chosen`` and ``rejected`` of ``sum_i g_losses_i l_i + g_loss * loss``.

    Args:
        chosen, ..., mean: as in :func:`dpo_loss_fwd`.
        grad_losses: ``[P]`` fp32 or None, the gradient of the per-pair losses.
        grad_loss: ``[]`` fp32 or None, the gradient of the reduced loss (read on the device).
        grad_chosen_out, grad_rejected_out: ``[P]`` fp32.

    Spec: :func:`rlk.reference.losses.dpo_loss_bwd`. Elementwise.
    """
    n_pairs = chosen.shape[0]
    code = _DPO_CODES[loss_type]
    n_c = len_chosen if len_chosen is not None else chosen
    n_r = len_rejected if len_rejected is not None else chosen
    with on_device(chosen.device):
        _dpo_bwd_kernel[(triton.cdiv(n_pairs, DPO_BLOCK_P),)](
            chosen,
            rejected,
            ref_chosen,
            ref_rejected,
            n_c,
            n_r,
            grad_losses if grad_losses is not None else chosen,
            grad_loss if grad_loss is not None else chosen,
            grad_chosen_out,
            grad_rejected_out,
            n_pairs,
            1.0 / n_pairs,
            float(beta),
            float(label_smoothing),
            LOSS=code,
            HAS_G_LOSSES=grad_losses is not None,
            HAS_G_LOSS=grad_loss is not None,
            MEAN=bool(mean),
            BLOCK_P=DPO_BLOCK_P,
        )
