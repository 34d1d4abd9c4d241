"""Triton kernels of the policy-loss ops: ``policy_loss`` and ``kl_penalty``.

The math is the spec in :mod:`rlk.reference.policy_loss` (per-token losses, their
derivatives, the KL estimators, the metrics). Layout of the work:

* ``policy_loss_fwd`` runs two kernels. The row kernel has one program per row (sequence)
  walking the row in fixed ``BLOCK_T`` chunks. For ``gspo`` and ``geo_mean`` it first makes a
  pass over the row for the per-sequence sums (``log s_i``; ``R_i``, ``Abar_i``, ``sum I``);
  then one pass computes, per token, the loss terms and the gradient coefficient (already
  multiplied by the row's aggregation weight ``c_i``), stores the coefficients, and
  accumulates the row's partial sums (loss, tokens, clipped, ratio, ...) lane-wise in
  ``BLOCK_T``-wide fp32 accumulators, reduced by one ``tl.sum`` / ``tl.max`` tree at the end.
  The combine kernel (one program) then adds the ``[B]`` row partials in row order, in
  ``COMBINE_BLOCK``-wide lanes and one final tree, and writes the loss and the metrics.
* ``policy_loss_bwd`` and ``kl_penalty_bwd`` are elementwise products
  ``grad = upstream * coef`` (a scalar upstream for the loss, per element for the KL).
* ``kl_penalty_fwd`` is elementwise: value and derivative of the estimator, written by the
  same device function (:func:`kl_terms`) the policy-loss kernel uses.

Batch invariance and determinism by construction: the tile sizes are fixed constants (no
autotuning, nothing derived from ``B``), a row's coefficients and partials depend only on
that row's data and its weight ``c_i`` (computed by the caller), there are no atomics, and
every reduction runs in an order that depends only on ``T`` (within a row) or ``B`` (the
combine). Offsets are int64. Everything is fp32 (the op layer upcasts 16-bit inputs).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from rlk.reference.policy_loss import KL_ESTIMATORS, LOSSES, METRICS, ROW_STATS

#: Tokens per chunk of the row kernel; elements per program of the elementwise kernels;
#: rows per chunk (lanes) of the combine kernel. Fixed: results never depend on the batch.
BLOCK_T = 1024
BLOCK_ELEMENTWISE = 1024
COMBINE_BLOCK = 256
NUM_WARPS = 4

_PPO = tl.constexpr(LOSSES.index("ppo"))
_GSPO = tl.constexpr(LOSSES.index("gspo"))
_CISPO = tl.constexpr(LOSSES.index("cispo"))
_GPG = tl.constexpr(LOSSES.index("gpg"))
_SAPO = tl.constexpr(LOSSES.index("sapo"))
_GEO = tl.constexpr(LOSSES.index("geo_mean"))
_K1 = tl.constexpr(KL_ESTIMATORS.index("k1"))
_ABS = tl.constexpr(KL_ESTIMATORS.index("abs"))
_K2 = tl.constexpr(KL_ESTIMATORS.index("k2"))
_NUM_STATS = tl.constexpr(len(ROW_STATS))
_NUM_METRICS = len(METRICS)


def _on_device(device: torch.device):
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


# ----------------------------------------------------------------------------------------------
# shared device functions
# ----------------------------------------------------------------------------------------------


@triton.jit
def _clamp(x, low, high):
    return tl.minimum(tl.maximum(x, low), high)


@triton.jit
def kl_terms(delta, clamp, EST: tl.constexpr, K3_CLAMP: tl.constexpr, HAS_CLAMP: tl.constexpr, STRAIGHT: tl.constexpr):
    """Value of the KL estimator at ``delta = lp - ref`` and its derivative w.r.t. ``lp``.

    Spec: :func:`rlk.reference.policy_loss.kl_estimate` (k3 with verl's clamps when
    ``K3_CLAMP``; ``clamp`` the symmetric value clamp when ``HAS_CLAMP``; k2's derivative when
    ``STRAIGHT``). A clamp that is active zeroes the derivative.
    """
    if EST == _K1:
        value = delta
        grad = tl.full(delta.shape, 1.0, tl.float32)
    elif EST == _ABS:
        value = tl.abs(delta)
        grad = tl.where(delta > 0, 1.0, tl.where(delta < 0, -1.0, 0.0))
    elif EST == _K2:
        value = 0.5 * delta * delta
        grad = delta
    else:
        x = -delta
        if K3_CLAMP:
            inside = (x >= -20.0) & (x <= 20.0)
            x = _clamp(x, -20.0, 20.0)
        e = tl.exp(x)
        value = e - x - 1.0
        grad = 1.0 - e
        if K3_CLAMP:
            inside = inside & (value >= -10.0) & (value <= 10.0)
            value = _clamp(value, -10.0, 10.0)
            grad = tl.where(inside, grad, 0.0)
    if HAS_CLAMP:
        grad = tl.where((value >= -clamp) & (value <= clamp), grad, 0.0)
        value = _clamp(value, -clamp, clamp)
    if STRAIGHT:
        grad = delta
    return value, grad


# ----------------------------------------------------------------------------------------------
# policy_loss
# ----------------------------------------------------------------------------------------------


@triton.jit
def _load_row(ptr, base, offs, inb, m):
    """``where(m, x, 0)`` of one chunk of a row (masked-out values never take part: -inf is fine)."""
    return tl.where(m, tl.load(ptr + base + offs, mask=inb, other=0.0).to(tl.float32), 0.0)


@triton.jit
def _policy_loss_row_kernel(
    lp_ptr, old_ptr, adv_ptr, mask_ptr, c_ptr, iw_ptr, ref_ptr, ent_ptr,
    coef_lp_ptr, coef_ent_ptr, stats_ptr,
    T, adv_stride_b, adv_stride_t,
    clip_low, clip_high, dual_clip, clamp_low, clamp_high, tau_pos, tau_neg, kl_coef, kl_clamp, entropy_coef,
    LOSS: tl.constexpr, CISPO_UPPER: tl.constexpr, HAS_DUAL: tl.constexpr,
    HAS_IW: tl.constexpr, HAS_REF: tl.constexpr, KL_TERM: tl.constexpr, KL_EST: tl.constexpr,
    KL_K3_CLAMP: tl.constexpr, KL_HAS_CLAMP: tl.constexpr, KL_STRAIGHT: tl.constexpr, KL_UNBIASED: tl.constexpr,
    HAS_ENT: tl.constexpr, ENT_TERM: tl.constexpr, ENT_GRAD: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    base = row * T
    adv_base = row * adv_stride_b
    c = tl.load(c_ptr + row).to(tl.float32)
    lanes = tl.arange(0, BLOCK).to(tl.int64)
    zeros = tl.zeros((BLOCK,), tl.float32)

    # ---- pass 1: per-sequence sums (gspo: log s_i; geo_mean: R_i, Abar_i, sum I) ----------
    seq_a = 0.0  # gspo: log s_i (clamped);  geo_mean: the sequence loss l_i
    seq_b = 0.0  # gspo: 1 if log s_i is inside the clamp;  geo_mean: R_i
    seq_w = 0.0  # geo_mean: SI_i / n1_i (the weight of d l_i / d lp_t, without p_t)
    if LOSS == _GSPO or LOSS == _GEO:
        acc_n = zeros
        acc_x = zeros
        acc_a = zeros
        acc_i = zeros
        for t0 in range(0, T, BLOCK):
            offs = t0 + lanes
            inb = offs < T
            m = tl.load(mask_ptr + base + offs, mask=inb, other=0) != 0
            lp = _load_row(lp_ptr, base, offs, inb, m)
            old = _load_row(old_ptr, base, offs, inb, m)
            d = lp - old
            acc_n += tl.where(m, 1.0, 0.0)
            if LOSS == _GSPO:
                acc_x += d
            else:
                adv = tl.where(m, tl.load(adv_ptr + adv_base + offs * adv_stride_t, mask=inb, other=0.0), 0.0)
                dc = _clamp(d, clamp_low, clamp_high)
                dt = tl.where(adv > 0, tl.minimum(dc, clip_high), tl.where(adv < 0, tl.maximum(dc, -clip_low), 0.0))
                acc_x += tl.where(m, dt, 0.0)
                acc_a += adv
                if HAS_IW:
                    acc_i += _load_row(iw_ptr, base, offs, inb, m)
        n1 = tl.maximum(tl.sum(acc_n, axis=0), 1.0)
        if LOSS == _GSPO:
            log_s = tl.sum(acc_x, axis=0) / n1
            seq_b = tl.where((log_s >= clamp_low) & (log_s <= clamp_high), 1.0, 0.0)
            seq_a = _clamp(log_s, clamp_low, clamp_high)
        else:
            seq_b = tl.exp(tl.sum(acc_x, axis=0) / n1)
            seq_a = -(tl.sum(acc_a, axis=0) / n1) * seq_b
            if HAS_IW:
                seq_w = (seq_a / n1) * tl.sum(acc_i, axis=0)
            else:
                seq_w = (seq_a / n1) * tl.sum(acc_n, axis=0)

    # ---- pass 2: per-token terms, coefficients and the row's partial sums ------------------
    acc_loss = zeros
    acc_tok = zeros
    acc_clip = zeros
    acc_low = zeros
    acc_nlr = zeros
    acc_ratio = zeros
    acc_rmax = zeros
    acc_ent = zeros
    acc_kl = zeros
    for t0 in range(0, T, BLOCK):
        offs = t0 + lanes
        inb = offs < T
        m = tl.load(mask_ptr + base + offs, mask=inb, other=0) != 0
        lp = _load_row(lp_ptr, base, offs, inb, m)
        old = _load_row(old_ptr, base, offs, inb, m)
        adv = tl.where(m, tl.load(adv_ptr + adv_base + offs * adv_stride_t, mask=inb, other=0.0), 0.0)
        d = lp - old
        clipped = zeros
        lower = zeros
        if LOSS == _GSPO:
            log_ratio = d
            ratio = zeros + tl.exp(seq_a)
            passes = (zeros + seq_b) > 0
        else:
            log_ratio = _clamp(d, clamp_low, clamp_high)
            passes = (d >= clamp_low) & (d <= clamp_high)
            ratio = tl.exp(log_ratio)
        if LOSS == _PPO or LOSS == _GSPO:
            l1 = -adv * ratio
            l2 = -adv * _clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
            value = tl.maximum(l1, l2)
            grad = tl.where((l1 >= l2) & passes, -adv * ratio, 0.0)
            clipped = tl.where(l2 > l1, 1.0, 0.0)
            if HAS_DUAL:
                dual = -adv * dual_clip
                is_lower = (adv < 0) & (value > dual)
                value = tl.where(is_lower, dual, value)
                grad = tl.where(is_lower, 0.0, grad)
                lower = tl.where(is_lower, 1.0, 0.0)
        elif LOSS == _CISPO:
            if CISPO_UPPER:
                w = tl.minimum(ratio, clip_high)
            else:
                w = _clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
            value = -w * adv * lp
            grad = -w * adv
            clipped = tl.where(w != ratio, 1.0, 0.0)
        elif LOSS == _GPG:
            value = -adv * lp
            grad = -adv
        elif LOSS == _SAPO:
            tau = tl.where(adv > 0, tau_pos, tau_neg)
            f = tl.sigmoid(tau * (ratio - 1.0))
            value = -adv * f * (4.0 / tau)
            grad = tl.where(passes, -4.0 * adv * f * (1.0 - f) * ratio, 0.0)
        else:  # geo_mean
            pos = adv > 0
            neg = adv < 0
            follows = (pos & (log_ratio <= clip_high)) | (neg & (log_ratio >= -clip_low))
            value = zeros + seq_a
            grad = tl.where(follows & passes, seq_w, 0.0)
            clipped = tl.where((pos & (log_ratio > clip_high)) | (neg & (log_ratio < -clip_low)), 1.0, 0.0)
            ratio = zeros + seq_b
        if HAS_IW:
            iw = _load_row(iw_ptr, base, offs, inb, m)
            value = value * iw
            if LOSS != _GEO:
                grad = grad * iw
        objective = value
        coef = grad
        if HAS_REF:
            ref = _load_row(ref_ptr, base, offs, inb, m)
            k, dk = kl_terms(lp - ref, kl_clamp, KL_EST, KL_K3_CLAMP, KL_HAS_CLAMP, KL_STRAIGHT)
            if KL_UNBIASED:
                wk = tl.exp(lp - old)
                k = wk * k
                dk = wk * dk
            k = tl.where(m, k, 0.0)
            acc_kl += k
            if KL_TERM:
                objective = objective + kl_coef * k
                coef = coef + kl_coef * dk
        if HAS_ENT:
            h = _load_row(ent_ptr, base, offs, inb, m)
            acc_ent += h
            if ENT_TERM:
                objective = objective - entropy_coef * h
        tl.store(coef_lp_ptr + base + offs, tl.where(m, c * coef, 0.0), mask=inb)
        if ENT_GRAD:
            tl.store(coef_ent_ptr + base + offs, tl.where(m, -entropy_coef * c, 0.0), mask=inb)
        acc_loss += tl.where(m, objective, 0.0)
        acc_tok += tl.where(m, 1.0, 0.0)
        acc_clip += tl.where(m, clipped, 0.0)
        acc_low += tl.where(m, lower, 0.0)
        acc_nlr += tl.where(m, -log_ratio, 0.0)
        ratio = tl.where(m, ratio, 0.0)
        acc_ratio += ratio
        acc_rmax = tl.maximum(acc_rmax, ratio)

    out = stats_ptr + row * _NUM_STATS
    tl.store(out + 0, c * tl.sum(acc_loss, axis=0))
    tl.store(out + 1, tl.sum(acc_tok, axis=0))
    tl.store(out + 2, tl.sum(acc_clip, axis=0))
    tl.store(out + 3, tl.sum(acc_low, axis=0))
    tl.store(out + 4, tl.sum(acc_nlr, axis=0))
    tl.store(out + 5, tl.sum(acc_ratio, axis=0))
    tl.store(out + 6, tl.max(acc_rmax, axis=0))
    tl.store(out + 7, tl.sum(acc_ent, axis=0))
    tl.store(out + 8, tl.sum(acc_kl, axis=0))


@triton.jit
def _policy_loss_combine_kernel(stats_ptr, loss_ptr, metrics_ptr, B, BLOCK: tl.constexpr):
    """Fixed-order sum of the ``[B]`` row partials (lane ``j`` takes rows ``j, j + BLOCK, ...``)."""
    zeros = tl.zeros((BLOCK,), tl.float32)
    acc_loss = zeros
    acc_tok = zeros
    acc_clip = zeros
    acc_low = zeros
    acc_nlr = zeros
    acc_ratio = zeros
    acc_rmax = zeros
    acc_ent = zeros
    acc_kl = zeros
    for b0 in range(0, B, BLOCK):
        rows = b0 + tl.arange(0, BLOCK).to(tl.int64)
        inb = rows < B
        ptr = stats_ptr + rows * _NUM_STATS
        acc_loss += tl.load(ptr + 0, mask=inb, other=0.0)
        acc_tok += tl.load(ptr + 1, mask=inb, other=0.0)
        acc_clip += tl.load(ptr + 2, mask=inb, other=0.0)
        acc_low += tl.load(ptr + 3, mask=inb, other=0.0)
        acc_nlr += tl.load(ptr + 4, mask=inb, other=0.0)
        acc_ratio += tl.load(ptr + 5, mask=inb, other=0.0)
        acc_rmax = tl.maximum(acc_rmax, tl.load(ptr + 6, mask=inb, other=0.0))
        acc_ent += tl.load(ptr + 7, mask=inb, other=0.0)
        acc_kl += tl.load(ptr + 8, mask=inb, other=0.0)
    tokens = tl.sum(acc_tok, axis=0)
    inv = tl.where(tokens > 0, 1.0 / tl.maximum(tokens, 1.0), 0.0)
    tl.store(loss_ptr, tl.sum(acc_loss, axis=0))
    tl.store(metrics_ptr + 0, tl.sum(acc_clip, axis=0) * inv)
    tl.store(metrics_ptr + 1, tl.sum(acc_low, axis=0) * inv)
    tl.store(metrics_ptr + 2, tl.sum(acc_nlr, axis=0) * inv)
    tl.store(metrics_ptr + 3, tl.sum(acc_ratio, axis=0) * inv)
    tl.store(metrics_ptr + 4, tl.max(acc_rmax, axis=0))
    tl.store(metrics_ptr + 5, tl.sum(acc_ent, axis=0) * inv)
    tl.store(metrics_ptr + 6, tl.sum(acc_kl, axis=0) * inv)
    tl.store(metrics_ptr + 7, tokens)


def policy_loss_fwd(logprob, old_logprob, advantages, mask, row_weight, importance_weights, ref_logprob, entropy,
                    loss_out, coef_logprob_out, coef_entropy_out, row_stats_out, metrics_out, *, loss, cispo_upper,
                    clip_low, clip_high, dual_clip, clamp_low, clamp_high, tau_pos, tau_neg, kl, kl_coef, kl_k3_clamp,
                    kl_clamp, kl_straight_through, kl_unbiased, entropy_coef):
    """The fused policy loss (spec and arguments: :func:`rlk.reference.policy_loss.policy_loss_fwd`).

    Shapes: ``[B, T]`` fp32 inputs (``advantages`` ``[B, T]`` or ``[B, 1]``), bool ``mask``,
    ``row_weight`` ``[B]``; outputs ``loss_out[]``, ``coef_logprob_out[B, T]``,
    ``coef_entropy_out[B, T] | None``, ``row_stats_out[B, 9]``, ``metrics_out[8]``. One row
    program per sequence, then one combine program.
    """
    n_rows, t = logprob.shape
    has_ref = ref_logprob is not None
    has_ent = entropy is not None
    has_iw = importance_weights is not None
    ent_grad = coef_entropy_out is not None
    dummy = logprob
    with _on_device(logprob.device):
        _policy_loss_row_kernel[(n_rows,)](
            logprob, old_logprob, advantages, mask.view(torch.uint8), row_weight,
            importance_weights if has_iw else dummy, ref_logprob if has_ref else dummy, entropy if has_ent else dummy,
            coef_logprob_out, coef_entropy_out if ent_grad else coef_logprob_out, row_stats_out,
            t, advantages.shape[1], 0 if advantages.shape[1] == 1 else 1,
            float(clip_low), float(clip_high), float(dual_clip), float(clamp_low), float(clamp_high), float(tau_pos),
            float(tau_neg), float(kl_coef), float(kl_clamp) if kl_clamp != float("inf") else 0.0,
            float(entropy_coef),
            LOSS=LOSSES.index(loss), CISPO_UPPER=bool(cispo_upper), HAS_DUAL=dual_clip > 0,
            HAS_IW=has_iw, HAS_REF=has_ref, KL_TERM=has_ref and kl_coef != 0, KL_EST=KL_ESTIMATORS.index(kl),
            KL_K3_CLAMP=bool(kl_k3_clamp), KL_HAS_CLAMP=kl_clamp != float("inf"),
            KL_STRAIGHT=bool(kl_straight_through), KL_UNBIASED=bool(kl_unbiased),
            HAS_ENT=has_ent, ENT_TERM=has_ent and entropy_coef != 0, ENT_GRAD=ent_grad,
            BLOCK=BLOCK_T, num_warps=NUM_WARPS,
        )
        _policy_loss_combine_kernel[(1,)](row_stats_out, loss_out, metrics_out, n_rows, BLOCK=COMBINE_BLOCK,
                                          num_warps=NUM_WARPS)


# ----------------------------------------------------------------------------------------------
# elementwise kernels: kl_penalty forward, the backward products
# ----------------------------------------------------------------------------------------------


@triton.jit
def _scale_kernel(x_ptr, s_ptr, out_ptr, N, PER_ELEMENT: tl.constexpr, BLOCK: tl.constexpr):
    """``out = x * s`` with ``s`` a scalar (``s_ptr[0]``) or per element."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    inb = offs < N
    x = tl.load(x_ptr + offs, mask=inb, other=0.0)
    if PER_ELEMENT:
        s = tl.load(s_ptr + offs, mask=inb, other=0.0)
    else:
        s = tl.load(s_ptr)
    tl.store(out_ptr + offs, x * s, mask=inb)


def _scale(x: torch.Tensor, s: torch.Tensor, out: torch.Tensor) -> None:
    n = x.numel()
    with _on_device(x.device):
        _scale_kernel[(triton.cdiv(n, BLOCK_ELEMENTWISE),)](
            x, s, out, n, PER_ELEMENT=s.numel() == n and s.dim() > 0, BLOCK=BLOCK_ELEMENTWISE, num_warps=NUM_WARPS
        )


def policy_loss_bwd(grad_loss, coef_logprob, coef_entropy, grad_logprob_out, grad_entropy_out):
    """``grad_logprob = coef_logprob * grad_loss`` (``grad_loss`` ``[]``), same for the entropy."""
    _scale(coef_logprob, grad_loss, grad_logprob_out)
    if grad_entropy_out is not None:
        _scale(coef_entropy, grad_loss, grad_entropy_out)


@triton.jit
def _kl_penalty_kernel(
    lp_ptr, ref_ptr, old_ptr, kl_ptr, coef_ptr, N, clamp,
    EST: tl.constexpr, K3_CLAMP: tl.constexpr, HAS_CLAMP: tl.constexpr, STRAIGHT: tl.constexpr,
    HAS_OLD: tl.constexpr, BLOCK: tl.constexpr,
):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    inb = offs < N
    lp = tl.load(lp_ptr + offs, mask=inb, other=0.0)
    ref = tl.load(ref_ptr + offs, mask=inb, other=0.0)
    value, grad = kl_terms(lp - ref, clamp, EST, K3_CLAMP, HAS_CLAMP, STRAIGHT)
    if HAS_OLD:
        w = tl.exp(lp - tl.load(old_ptr + offs, mask=inb, other=0.0))
        value = w * value
        grad = w * grad
    tl.store(kl_ptr + offs, value, mask=inb)
    tl.store(coef_ptr + offs, grad, mask=inb)


def kl_penalty_fwd(logprob, ref_logprob, old_logprob, kl_out, coef_out, *, estimator, straight_through, k3_clamp,
                   clamp):
    """Elementwise KL estimate and its derivative (spec: :func:`rlk.reference.policy_loss.kl_penalty_fwd`).

    All tensors ``[N]`` fp32, contiguous; ``old_logprob`` may be None.
    """
    n = logprob.numel()
    has_clamp = clamp != float("inf")
    with _on_device(logprob.device):
        _kl_penalty_kernel[(triton.cdiv(n, BLOCK_ELEMENTWISE),)](
            logprob, ref_logprob, old_logprob if old_logprob is not None else logprob, kl_out, coef_out, n,
            float(clamp) if has_clamp else 0.0,
            EST=KL_ESTIMATORS.index(estimator), K3_CLAMP=bool(k3_clamp), HAS_CLAMP=has_clamp,
            STRAIGHT=bool(straight_through), HAS_OLD=old_logprob is not None, BLOCK=BLOCK_ELEMENTWISE,
            num_warps=NUM_WARPS,
        )


def kl_penalty_bwd(grad_kl, coef, grad_logprob_out):
    """``grad_logprob = grad_kl * coef`` (elementwise, ``[N]`` fp32)."""
    _scale(grad_kl, coef, grad_logprob_out)
