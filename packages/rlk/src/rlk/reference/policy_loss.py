"""Reference policy-loss and KL primitives: the readable specification and ground truth.

Notation (per token ``t`` of row ``i``; rows are sequences)
----------------------------------------------------------
``lp`` the log-prob under the current policy (it carries the gradient), ``old`` the
behaviour log-prob, ``ref`` the reference-model log-prob, ``A`` the advantage, ``m`` the
loss mask, ``n_i = sum_t m`` (``n1_i = max(n_i, 1)``), ``I`` the optional per-token
importance weight (1 when absent), ``H`` the optional entropy, ``c_i`` the aggregation
weight of row ``i`` (:func:`rlk.reference.aggregation.row_weights`), ``sg`` stop-gradient.
Every input is first masked with ``where(m, x, 0)``, so masked-out positions may hold
``-inf`` or NaN without touching any result.

``d = lp - old``; ``dc = clamp(d, clamp_low, clamp_high)`` (no clamp at +-inf); ``r = exp(dc)``.
A clamped token (``d`` outside ``[clamp_low, clamp_high]``) gets no gradient through ``r``,
as with ``torch.clamp``. ``eps_l, eps_h = clip_low, clip_high``.

Per-token losses ``L`` (minimized) and their derivatives ``g = dL / d lp``
--------------------------------------------------------------------------
``ppo``::

    L1 = -A r,  L2 = -A clip(r, 1 - eps_l, 1 + eps_h),  L = max(L1, L2)
    g  = -A r where L1 >= L2 (the unclipped branch is active), else 0
    dual clip c > 0 (``dual_clip``): where A < 0 and L > -A c:  L = -A c, g = 0

(At exact ties, ``L1 == L2`` means ``r`` inside the clip range and both branches agree; at
``L == -A c`` exactly, ``torch.minimum`` would split the gradient in half, rlk keeps it whole.)

``gspo`` (sequence ratio, GSPO-token form)::

    log s_i = sum_t m d / n1_i;   log s~_t = clamp(lp_t - sg(lp_t) + sg(log s_i), clamp_low, clamp_high)
    value s~_t = exp(clamp(log s_i)); d s~_t / d lp_t = s~_t (0 where log s_i is clamped)
    then the ppo clip with s~ in place of r (no dual clip)

``cispo``::

    w = sg(clip(r, 1 - eps_l, 1 + eps_h))        (cispo_upper=False: verl / slime)
    w = sg(min(r, eps_h))                        (cispo_upper=True: TRL, eps_h is the cap itself)
    L = -w A lp,  g = -w A

``gpg``: ``L = -A lp``, ``g = -A``.

``sapo``: ``tau = tau_pos if A > 0 else tau_neg``, ``f = sigmoid(tau (r - 1))``,
``L = -A f 4 / tau``, ``g = -4 A f (1 - f) r``.

``geo_mean`` (GMPO), one loss per sequence::

    dt = min(dc, eps_h) if A > 0;  max(dc, -eps_l) if A < 0;  0 if A == 0   (sign-aware clip)
    R_i = exp(sum_t m dt / n1_i),   Abar_i = sum_t m A / n1_i,   l_i = -Abar_i R_i
    L_t = l_i (every token of the row carries the sequence loss)
    d l_i / d lp_t = -Abar_i R_i p_t / n1_i,   p_t = 1 where dt follows dc (A > 0 and dc <= eps_h,
                                               or A < 0 and dc >= -eps_l) and d is not clamped

``dppo_tv`` / ``dppo_kl`` (DPPO-Binary, arXiv 2602.04879; verl's ``dppo_tv`` / ``dppo_kl``), ``c = dual_clip``
(the cap of the truncated ratio, verl's ``clip_ratio_c``; 0: no cap), ``p = exp(lp)``, ``q = exp(old)``::

    w = sg(min(r, c))                                             (sg(r) when c = 0)
    tv:  valid = (p - q <= eps_h) if A > 0 else (p - q >= -eps_l)
    kl:  b = q (old - lp) + (1 - q) log((1 - q + 1e-8) / (1 - p + 1e-8))
         valid = (b <= eps_h or p <= q) if A > 0 else (b <= eps_l or p >= q)
    L = -A w lp [valid],  g = -A w [valid]                        (valid is detached: a token outside the
                                                                    trust region gets neither loss nor gradient)

(``p`` and ``q`` from the unclamped log-probs.) Metrics: ``clip_fraction`` the tokens outside the trust region,
``lower_clip_fraction`` the valid tokens whose ratio the cap truncates (``r > c``).

``vespo`` (VESPO, TRL's ``loss_type="vespo"``), a detached gamma weight of the sequence ratio::

    log w_i = clamp(sum_t m (dc_t + clamp(log I_t, ln 1e-8, 20)), ln 1e-8, 20)   (the I term only when given)
    k, lam  = (k_pos, lam_pos) if A >= 0 else (k_neg, lam_neg)               (per token, by the sign of A)
    phi     = sg(exp(lam + k log w_i - lam w_i))   (= w^k e^(lam (1 - w)), phi(1) = 1)
              0 where the exponent exceeds ln(fp32 max) = 88.72 (exp overflows fp32; TRL's nan_to_num)
    L = -phi A lp,  g = -phi A

The importance weights ``I`` (a rollout correction) enter the sequence ratio ``w_i`` instead of
multiplying ``L`` (``w`` is then the ratio to the behaviour policy, as in VESPO). Metrics: ``clip_fraction``
0, ``ratio_mean`` / ``ratio_max`` of ``w_i``.

Overflow: ``r = exp(dc)`` is ``inf`` in fp32 for ``dc > 88.7``. Every product with such a factor
is taken as 0 where its other factor is exactly 0 (``A = 0``, ``f (1 - f) = 0``, ``Abar_i = 0``, ``I = 0``,
``w = 0``): ``0 * inf`` counts as 0, never NaN. A value whose exact result exceeds the fp32 range (``-A r``
with ``A < 0`` and ``r = inf``, say) is ``+-inf``, its correctly rounded value.

Importance weights multiply ``L`` and ``g`` (for ``geo_mean``: ``sum_t m c I l_i``, so the row's
gradient carries ``SI_i = sum_t m I``).

The objective
-------------
With the KL estimate ``K = k(lp, ref)`` (:func:`kl_estimate`, optionally importance-weighted
by ``w = sg(exp(d))``) and coefficients ``beta = kl_coef`` and ``eta = entropy_coef``::

    loss = sum_i c_i sum_t m (I L + beta K - eta H)

The forward computes the row weights ``c_i`` from the mask and the normalizers
(:func:`rlk.reference.aggregation.row_weights`) and, in the same pass, the gradient of the loss
itself (for an upstream gradient of 1), the per-token coefficient of the row sum times the row's
weight::

    grad_logprob = (m (I g + beta dK/dlp)) * c_i,    grad_entropy = (-eta) * c_i on the mask

so the backward of an upstream gradient ``G`` (a scalar) is ``grad * G``, and
``rlk.policy_loss_and_grad`` returns ``grad`` itself. A row's coefficient never depends on the
other rows; its gradient does only through ``c_i`` (not at all with the global normalizers).

Metrics over the masked tokens of the call (``n = sum m``; every metric is 0 when ``n = 0``)
-------------------------------------------------------------------------------------------
``clip_fraction``: tokens whose ratio is clipped (ppo / gspo: ``L2 > L1``; cispo: ``w != r``;
geo_mean: the sign-aware clip is active; gpg / sapo: 0). ``lower_clip_fraction``: ppo tokens
where the dual clip is active. ``approx_kl``: mean of ``-dc`` (of ``-d`` for gspo).
``ratio_mean`` / ``ratio_max``: of the ratio in the loss (``r``; ``s~`` for gspo; ``R_i`` for
geo_mean; ``r`` for gpg, which does not use it). ``entropy_mean``: of ``H``. ``kl_mean``: of
``K`` (importance-weighted when requested). ``tokens``: ``n``.

The per-row partial sums behind them are an output too (``row_stats``, columns
:data:`ROW_STATS`): ``loss`` is the row's ``c_i sum_t m (I L + beta K - eta H)``.

KL estimators (``delta = lp - ref``) and their derivatives
----------------------------------------------------------
``k1``: ``delta`` (1). ``abs``: ``|delta|`` (``sign(delta)``). ``k2``: ``delta^2 / 2`` (``delta``).
``k3``: ``exp(-delta) - 1 + delta`` (``1 - exp(-delta)``); with ``k3_clamp`` (verl's
``low_var_kl``): ``x = clamp(-delta, -20, 20)``, ``clamp(exp(x) - x - 1, -10, 10)``, the
derivative 0 wherever a clamp is active. ``clamp`` (OpenRLHF): the estimator value is clamped
to ``[-clamp, clamp]`` (derivative 0 outside). ``straight_through`` (verl's ``"k3+"``): the
value as above, the derivative of ``k2`` (``delta``). With ``old`` (slime's unbiased KL):
value and derivative multiplied by ``sg(exp(lp - old))``.

Math runs in fp32 (fp64 when the inputs are fp64: ground truth). Vectorized over the whole
``[B, T]`` batch; deterministic; no batch-invariance promise (the Triton kernels make it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlk.core.abi import (
    K3_LOG_RATIO_CLAMP,
    K3_VALUE_CLAMP,
    ROW_STATS,
    VESPO_LOG_PHI_MAX,
    VESPO_LOG_W_MAX,
    VESPO_LOG_W_MIN,
)
from rlk.core.checks import compute_dtype
from rlk.reference import aggregation


def times(a: Tensor, b: Tensor) -> Tensor:
    """``a * b``, and 0 wherever either factor is 0 (an overflowed ``inf`` times an exact 0 gives 0, not NaN)."""
    return torch.where((a == 0) | (b == 0), 0.0, a * b)


def _clamp_with_pass(x: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    """``clamp(x, low, high)`` and where its derivative is 1 (``low <= x <= high``, as ``torch.clamp``)."""
    return x.clamp(low, high), (x >= low) & (x <= high)


def kl_estimate(
    delta: Tensor, estimator: str, *, k3_clamp: bool, clamp: float, straight_through: bool
) -> tuple[Tensor, Tensor]:
    """Value of the KL estimator at ``delta = lp - ref`` and its derivative with respect to ``lp``.

    The single definition of the estimators, used by ``kl_penalty_fwd`` and ``policy_loss_fwd``
    (module docstring). ``clamp`` is ``inf`` for no clamp.
    """
    if estimator == "k1":
        value, grad = delta, torch.ones_like(delta)
    elif estimator == "abs":
        value, grad = delta.abs(), torch.sign(delta)
    elif estimator == "k2":
        value, grad = 0.5 * delta * delta, delta
    elif estimator == "k3":
        x = -delta
        inside = torch.ones_like(delta, dtype=torch.bool)
        if k3_clamp:
            x, inside = _clamp_with_pass(x, -K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
        e = torch.exp(x)
        value = e - x - 1.0
        grad = 1.0 - e
        if k3_clamp:
            value, kept = _clamp_with_pass(value, -K3_VALUE_CLAMP, K3_VALUE_CLAMP)
            inside = inside & kept
        grad = torch.where(inside, grad, 0.0)
    else:
        raise ValueError(f"unknown KL estimator {estimator!r}")
    if clamp != float("inf"):
        value, kept = _clamp_with_pass(value, -clamp, clamp)
        grad = torch.where(kept, grad, 0.0)
    if straight_through:
        grad = delta
    return value, grad


def kl_grad_terms(delta: Tensor, *, k3_clamp: bool) -> Tensor:
    """A bound on the terms of every KL estimator's derivative at ``delta = lp - ref`` by absolute value
    (``1 + |delta| + exp(-delta)``, the exponent clamped as ``k3``'s): the contract's magnitude where they cancel
    (``k3``'s ``1 - exp(-delta)`` near ``delta = 0``)."""
    exponent = (-delta).clamp(max=K3_LOG_RATIO_CLAMP) if k3_clamp else -delta
    return 1.0 + delta.abs() + torch.exp(exponent)


def kl_penalty_fwd(
    logprob, ref_logprob, old_logprob, kl_out, coef_out, *, estimator, straight_through, k3_clamp, clamp
):
    """Per-element KL estimate ``kl_out`` and its derivative ``coef_out = d kl / d logprob`` (all ``[N]``).

    With ``old_logprob`` both are multiplied by the detached weight ``exp(logprob - old_logprob)``.
    """
    cdt = compute_dtype(logprob.dtype)
    lp = logprob.to(cdt)
    value, grad = kl_estimate(
        lp - ref_logprob.to(cdt), estimator, k3_clamp=k3_clamp, clamp=clamp, straight_through=straight_through
    )
    if old_logprob is not None:
        w = torch.exp(lp - old_logprob.to(cdt))
        value, grad = times(value, w), times(grad, w)
    kl_out.copy_(value)
    coef_out.copy_(grad)


def kl_contract_scale(logprob, ref_logprob, old_logprob, *, estimator, k3_clamp) -> tuple[Tensor, Tensor]:
    """The numerical contract's per-element scales of ``kl_penalty``'s value and derivative (fp64 inputs).

    fp32 gets the estimator to about ``2^-24`` times the size of the terms it adds (``k3``: ``exp(x) - x - 1``
    with ``x = -delta`` clamped as in :func:`kl_estimate`, each term up to ``exp(x)``, ``|x|`` and 1, which cancel
    for small ``delta``; ``k2``: ``delta^2 / 2``; ``k1`` / ``abs``: ``|delta|``), and ``exp`` turns the rounding of a
    log-ratio ``y`` into a relative error ``|y| 2^-24``. With ``old_logprob`` the weight ``w = exp(lp - old)``
    multiplies both. Returns ``(value_scale, grad_magnitude)``: ``1 + |k| + w (1 + |d|) T`` and
    ``w (1 + |d|) T'`` with ``T`` the terms of the value and ``T'`` those of the derivative (``k3``: ``1 + exp(x)``).
    """
    lp = logprob.double()
    delta = lp - ref_logprob.double()
    if estimator == "k3":
        x = -delta.clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP) if k3_clamp else -delta
        e = torch.exp(x)
        terms, grad_terms, amp = e + x.abs() + 1.0, 1.0 + e, 1.0 + x.abs()
    elif estimator == "k2":
        terms, grad_terms, amp = 0.5 * delta * delta, delta.abs(), torch.ones_like(delta)
    else:
        terms, grad_terms, amp = delta.abs(), torch.ones_like(delta), torch.ones_like(delta)
    value, _ = kl_estimate(delta, estimator, k3_clamp=k3_clamp, clamp=float("inf"), straight_through=False)
    w = torch.ones_like(delta)
    if old_logprob is not None:
        d = lp - old_logprob.double()
        w, amp = torch.exp(d), amp + d.abs()
    return 1.0 + (w * value).abs() + w * amp * terms, w * amp * grad_terms


def kl_penalty_bwd(grad_kl, coef, grad_logprob_out):
    """``grad_logprob = grad_kl * coef`` (elementwise)."""
    torch.mul(grad_kl, coef, out=grad_logprob_out)


def _token_losses(
    lp,
    old,
    adv,
    m,
    n1,
    *,
    loss,
    cispo_upper,
    clip_low,
    clip_high,
    dual_clip,
    clamp_low,
    clamp_high,
    tau_pos,
    tau_neg,
    vespo=None,
):
    """Per-token ``L``, ``g``, ratio, clipped / lower-clipped flags and the log-ratio of the metrics.

    All inputs are already masked (0 off the mask). For ``geo_mean`` ``L`` and ``g`` are the
    sequence quantities ``l_i`` and ``d l_i / d lp_t`` (module docstring).
    """
    d = lp - old
    no = torch.zeros_like(m)
    if loss == "gspo":
        log_s = torch.where(m, d, 0.0).sum(dim=1) / n1
        log_s, passes = _clamp_with_pass(log_s, clamp_low, clamp_high)
        ratio = torch.exp(log_s)[:, None].expand_as(d)
        passes = passes[:, None].expand_as(d)
        log_ratio = d
    else:
        log_ratio, passes = _clamp_with_pass(d, clamp_low, clamp_high)
        ratio = torch.exp(log_ratio)
    if loss in ("ppo", "gspo"):
        l1 = times(-adv, ratio)
        l2 = -adv * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
        value = torch.maximum(l1, l2)
        grad = torch.where((l1 >= l2) & passes, l1, 0.0)
        clipped, lower = l2 > l1, no
        if dual_clip > 0:
            dual = -adv * dual_clip
            lower = (adv < 0) & (value > dual)
            value = torch.where(lower, dual, value)
            grad = torch.where(lower, 0.0, grad)
        return value, grad, ratio, clipped, lower, log_ratio
    if loss == "cispo":
        w = (
            torch.minimum(ratio, torch.full_like(ratio, clip_high))
            if cispo_upper
            else ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
        )
        return -w * adv * lp, -w * adv, ratio, w != ratio, no, log_ratio
    if loss == "gpg":
        return -adv * lp, -adv, ratio, no, no, log_ratio
    if loss == "sapo":
        tau = torch.where(adv > 0, torch.full_like(adv, tau_pos), torch.full_like(adv, tau_neg))
        f = torch.sigmoid(tau * (ratio - 1.0))
        value = -adv * f * (4.0 / tau)
        grad = torch.where(passes, -4.0 * adv * times(f * (1.0 - f), ratio), 0.0)
        return value, grad, ratio, no, no, log_ratio
    if loss == "geo_mean":
        pos, neg = adv > 0, adv < 0
        dt = torch.where(pos, log_ratio.clamp(max=clip_high), torch.where(neg, log_ratio.clamp(min=-clip_low), 0.0))
        follows = (pos & (log_ratio <= clip_high)) | (neg & (log_ratio >= -clip_low))
        seq_ratio = torch.exp(torch.where(m, dt, 0.0).sum(dim=1) / n1)
        adv_bar = torch.where(m, adv, 0.0).sum(dim=1) / n1
        seq_loss = times(-adv_bar, seq_ratio)
        grad = torch.where(follows & passes, (seq_loss / n1)[:, None], 0.0)
        clipped = (pos & (log_ratio > clip_high)) | (neg & (log_ratio < -clip_low))
        ratio = seq_ratio[:, None].expand_as(d)
        return seq_loss[:, None].expand_as(d), grad, ratio, clipped, no, log_ratio
    if loss in ("dppo_tv", "dppo_kl"):
        return _dppo_token_losses(
            lp, old, adv, m, log_ratio, ratio, loss=loss, clip_low=clip_low, clip_high=clip_high, cap=dual_clip
        )
    if loss == "vespo":
        log_w, w, k, lam, _ = vespo_weights(log_ratio, adv, m, **vespo)
        log_phi = lam + k * log_w - lam * w
        phi = torch.where(log_phi <= VESPO_LOG_PHI_MAX, torch.exp(log_phi.clamp(max=VESPO_LOG_PHI_MAX)), 0.0)
        return -phi * adv * lp, -phi * adv, w.expand_as(d), no, no, log_ratio
    raise ValueError(f"unknown policy loss {loss!r}")


#: verl's guard in the binary KL of ``dppo_kl``.
DPPO_KL_GUARD = 1e-8


def dppo_binary_kl(lp: torch.Tensor, old: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``dppo_kl``'s binary KL ``b = q (log q - log p) + (1 - q) log((1 - q + g) / (1 - p + g))`` of the token
    probabilities ``p = exp(lp)``, ``q = exp(old)`` (``g``: :data:`DPPO_KL_GUARD`), and its log term; any shape."""
    p, q = torch.exp(lp), torch.exp(old)
    log_term = torch.log((1.0 - q + DPPO_KL_GUARD) / (1.0 - p + DPPO_KL_GUARD))
    return q * (old - lp) + (1.0 - q) * log_term, log_term


def _dppo_token_losses(lp, old, adv, m, log_ratio, ratio, *, loss, clip_low, clip_high, cap):
    """``dppo_tv`` / ``dppo_kl``: the truncated ratio ``w`` times ``-A lp`` on the trust region (module docstring)."""
    w = torch.minimum(ratio, torch.full_like(ratio, cap)) if cap > 0 else ratio
    p, q = torch.exp(lp), torch.exp(old)
    if loss == "dppo_tv":
        valid = torch.where(adv > 0, p - q <= clip_high, p - q >= -clip_low)
    else:
        b, _ = dppo_binary_kl(lp, old)
        valid = torch.where(adv > 0, (b <= clip_high) | (p <= q), (b <= clip_low) | (p >= q))
    valid = valid & m
    grad = torch.where(valid, times(-adv, w), 0.0)
    lower = valid & (ratio > cap) if cap > 0 else torch.zeros_like(m)
    return times(grad, lp), grad, ratio, m & ~valid, lower, log_ratio


def vespo_weights(log_ratio, adv, m, *, iw, k_pos, lambda_pos, k_neg, lambda_neg):
    """vespo's ``log w_i``, ``w_i`` (``[B, 1]``), ``k``, ``lam`` (``[B, T]``, by the sign of ``A``) and the
    magnitude sum ``sum_t m (|dc_t| + |log I_t|)`` (``[B, 1]``, for the contract's scale); module docstring.
    ``log_ratio`` is ``dc``; ``iw`` the masked importance weights or None."""
    terms = torch.where(m, log_ratio, 0.0)
    if iw is not None:
        terms = terms + torch.where(m, torch.log(iw).clamp(VESPO_LOG_W_MIN, VESPO_LOG_W_MAX), 0.0)
    log_w = terms.sum(dim=1, keepdim=True).clamp(VESPO_LOG_W_MIN, VESPO_LOG_W_MAX)
    nonneg = adv >= 0
    k = torch.where(nonneg, torch.full_like(adv, k_pos), torch.full_like(adv, k_neg))
    lam = torch.where(nonneg, torch.full_like(adv, lambda_pos), torch.full_like(adv, lambda_neg))
    return log_w, torch.exp(log_w), k, lam, terms.abs().sum(dim=1, keepdim=True)


def _terms(
    logprob,
    old_logprob,
    advantages,
    mask,
    row_weight,
    importance_weights,
    ref_logprob,
    entropy,
    *,
    loss,
    cispo_upper,
    clip_low,
    clip_high,
    dual_clip,
    clamp_low,
    clamp_high,
    tau_pos,
    tau_neg,
    kl,
    kl_coef,
    kl_k3_clamp,
    kl_clamp,
    kl_straight_through,
    kl_unbiased,
    entropy_coef,
    vespo_k_pos=2.0,
    vespo_lambda_pos=3.0,
    vespo_k_neg=3.0,
    vespo_lambda_neg=2.0,
    bounds=False,
) -> dict[str, Tensor]:
    """Every per-token quantity of the objective (``[B, T]``, 0 off the mask) and the row weights ``c``; with
    ``bounds`` also ``coef_terms``, the gradient coefficient's terms by absolute value (for the contract)."""
    cdt = compute_dtype(logprob.dtype)
    m = mask
    zero = torch.zeros((), dtype=cdt, device=logprob.device)

    def masked(x: Tensor) -> Tensor:
        return torch.where(m, x.to(cdt).expand(m.shape), zero)

    lp, old, adv = masked(logprob), masked(old_logprob), masked(advantages)
    n = m.sum(dim=1).to(cdt)
    vespo = None
    if loss == "vespo":  # the importance weights enter the sequence ratio, not a factor of L
        vespo = {
            "iw": None if importance_weights is None else masked(importance_weights),
            "k_pos": vespo_k_pos,
            "lambda_pos": vespo_lambda_pos,
            "k_neg": vespo_k_neg,
            "lambda_neg": vespo_lambda_neg,
        }
        importance_weights = None
    value, grad, ratio, clipped, lower, log_ratio = _token_losses(
        lp,
        old,
        adv,
        m,
        n.clamp(min=1.0),
        loss=loss,
        cispo_upper=cispo_upper,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        clamp_low=clamp_low,
        clamp_high=clamp_high,
        tau_pos=tau_pos,
        tau_neg=tau_neg,
        vespo=vespo,
    )
    if importance_weights is not None:
        iw = masked(importance_weights)
        value = times(iw, value)
        grad = times(iw, grad) if loss != "geo_mean" else times(iw.sum(dim=1, keepdim=True), grad)
    elif loss == "geo_mean":
        grad = grad * n[:, None]
    t = {
        "m": m,
        "c": row_weight.to(cdt),
        "n": n,
        "policy": value,
        "objective": value,
        "coef": grad,
        **({"coef_terms": grad.abs()} if bounds else {}),
        "clipped": clipped.to(cdt),
        "lower": lower.to(cdt),
        "neg_log_ratio": -log_ratio,
        "ratio": ratio,
        "log_ratio": lp - old,
        "kl": torch.zeros_like(lp),
        "kl_log_ratio": torch.zeros_like(lp),
        "entropy": torch.zeros_like(lp),
    }
    if ref_logprob is not None:
        delta = lp - masked(ref_logprob)
        k, dk = kl_estimate(delta, kl, k3_clamp=kl_k3_clamp, clamp=kl_clamp, straight_through=kl_straight_through)
        if kl_unbiased:
            w = torch.exp(lp - old)
            k, dk = times(k, w), times(dk, w)
        t["kl"], t["kl_log_ratio"] = k, delta
        if kl_coef != 0:
            t["objective"] = t["objective"] + kl_coef * k
            t["coef"] = t["coef"] + kl_coef * dk
            if bounds:
                dk_terms = kl_grad_terms(delta, k3_clamp=kl_k3_clamp)
                t["coef_terms"] = t["coef_terms"] + abs(kl_coef) * (times(dk_terms, w) if kl_unbiased else dk_terms)
    if entropy is not None:
        t["entropy"] = masked(entropy)
        if entropy_coef != 0:
            t["objective"] = t["objective"] - entropy_coef * t["entropy"]
    for name, x in t.items():
        if name not in ("m", "c", "n"):
            t[name] = torch.where(m, x, zero)
    return t


def _row_stats(t: dict[str, Tensor]) -> Tensor:
    """``[B, len(ROW_STATS)]``: the row sums (and the ratio max) of the per-token quantities."""
    return torch.stack(
        [
            t["c"] * t["objective"].sum(dim=1),
            t["n"],
            t["clipped"].sum(dim=1),
            t["lower"].sum(dim=1),
            t["neg_log_ratio"].sum(dim=1),
            t["ratio"].sum(dim=1),
            t["ratio"].amax(dim=1),
            t["entropy"].sum(dim=1),
            t["kl"].sum(dim=1),
        ],
        dim=1,
    )


def _metrics(stats: Tensor) -> Tensor:
    total = stats.sum(dim=0)
    tokens = total[1]
    inv = torch.where(tokens > 0, 1.0 / tokens.clamp(min=1.0), 0.0)
    return torch.stack(
        [
            total[2] * inv,
            total[3] * inv,
            total[4] * inv,
            total[5] * inv,
            stats[:, 6].amax(),
            total[7] * inv,
            total[8] * inv,
            tokens,
        ]
    )


def policy_loss_fwd(
    logprob,
    old_logprob,
    advantages,
    mask,
    importance_weights,
    ref_logprob,
    entropy,
    global_tokens,
    global_seqs,
    loss_scale,
    loss_out,
    grad_logprob_out,
    grad_entropy_out,
    row_weight_out,
    row_stats_out,
    metrics_out,
    *,
    agg,
    **attrs,
):
    """The fused policy loss: loss, its gradient, row weights, per-row partials and metrics, in one pass.

    Args (module docstring for the math):
        logprob, old_logprob: ``[B, T]``. advantages: ``[B, T]`` or ``[B, 1]`` (one per row).
        mask: ``[B, T]`` bool. importance_weights, ref_logprob, entropy: ``[B, T]`` or None.
        global_tokens, global_seqs, loss_scale: the aggregation's normalizers (numbers, one-element
            tensors or None; :mod:`rlk.reference.aggregation`).
        loss_out: ``[]``. grad_logprob_out: ``[B, T]``, ``d loss / d logprob``: the derivative of the
            row's objective sum ``sum_t m (I L + beta K - eta H)`` times the row weight ``c_i``
            (computed in this order), 0 off the mask.
        grad_entropy_out: ``[B, T]`` (``(-eta) * c_i`` on the mask) or None. row_weight_out: ``[B]``,
            the aggregation weights ``c`` (:func:`rlk.reference.aggregation.row_weights`).
        row_stats_out: ``[B, len(ROW_STATS)]``. metrics_out: ``[len(POLICY_METRICS)]``.
        agg (keyword-only): the aggregation mode.
        attrs (keyword-only): loss, cispo_upper, clip_low, clip_high, dual_clip (0: off),
            clamp_low, clamp_high (+-inf: off), tau_pos, tau_neg: the policy loss; kl, kl_coef,
            kl_k3_clamp, kl_clamp (inf: off), kl_straight_through, kl_unbiased: the KL term (used
            when ``ref_logprob`` is given; it enters the loss when ``kl_coef != 0``);
            entropy_coef: the entropy bonus.

    The backward of an upstream gradient ``G`` is ``grad * G`` (:func:`policy_loss_bwd`).
    """
    row_weight = aggregation.row_weights(
        mask,
        agg,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        loss_scale=loss_scale,
        dtype=compute_dtype(logprob.dtype),
    )
    row_weight_out.copy_(row_weight)
    t = _terms(logprob, old_logprob, advantages, mask, row_weight, importance_weights, ref_logprob, entropy, **attrs)
    c = t["c"][:, None]
    grad_logprob_out.copy_(torch.where(t["m"], t["coef"] * c, 0.0))
    if grad_entropy_out is not None:
        grad_entropy_out.copy_(torch.where(t["m"], -attrs["entropy_coef"] * c, 0.0))
    stats = _row_stats(t)
    row_stats_out.copy_(stats)
    loss_out.copy_(stats[:, 0].sum())
    metrics_out.copy_(_metrics(stats))


def contract_scale(
    logprob, old_logprob, advantages, mask, row_weight, importance_weights, ref_logprob, entropy, **attrs
) -> dict[str, Tensor]:
    """The numerical contract's scales of ``loss`` ``[]``, ``row_stats`` ``[B, 9]`` and ``metrics`` ``[8]``.

    Every output is a sum over tokens (a mean: a sum over ``n``). fp32 gets each summand ``x``
    to about ``2^-24 (1 + |x|) (1 + |d| + |delta|)`` (``d = lp - old``, ``delta = lp - ref``:
    ``exp`` turns the rounding of a log-ratio ``y`` into a relative error ``|y| 2^-24``), and
    the sum to ``2^-24`` times the sum of the summands' magnitudes. So the scale of a sum is
    ``sum_t m (1 + |x_t|) (1 + |d_t| + |delta_t|)`` (times ``|c_i|`` for the loss, whose summand
    is ``|I L| + |beta K| + |eta H|``); a mean divides it by ``n``; ``ratio_max`` takes
    ``max_t ratio_t (1 + |d_t| + |delta_t|)``. Call it with the fp64 inputs of the ground truth.
    """
    t = _terms(
        logprob,
        old_logprob,
        advantages,
        mask,
        row_weight,
        importance_weights,
        ref_logprob,
        entropy,
        bounds=True,
        **attrs,
    )
    m = t["m"]
    amp = torch.where(m, 1.0 + t["log_ratio"].abs() + t["kl_log_ratio"].abs(), 0.0)
    loss_terms = (
        t["policy"].abs() + abs(attrs["kl_coef"]) * t["kl"].abs() + abs(attrs["entropy_coef"]) * t["entropy"].abs()
    )

    def row_scale(x: Tensor) -> Tensor:
        return ((1.0 + x.abs()) * amp).sum(dim=1)

    stats = torch.stack(
        [
            t["c"].abs() * row_scale(loss_terms),
            row_scale(t["n"][:, None] * 0.0),
            row_scale(t["clipped"]),
            row_scale(t["lower"]),
            row_scale(t["neg_log_ratio"]),
            row_scale(t["ratio"]),
            (t["ratio"] * amp).amax(dim=1),
            row_scale(t["entropy"]),
            row_scale(t["kl"]),
        ],
        dim=1,
    )
    grad_max_scale = torch.ones((), dtype=stats.dtype, device=stats.device)
    if attrs["loss"] == "vespo":
        extra, phi_rel = _vespo_scale(t, advantages, importance_weights, attrs)
        stats = stats + extra
        grad_max_scale = 1.0 + phi_rel.amax() if phi_rel.numel() else grad_max_scale
    total = stats.sum(dim=0)
    tokens = t["n"].sum()
    inv = torch.where(tokens > 0, 1.0 / tokens.clamp(min=1.0), 0.0)
    metrics = torch.stack(
        [
            total[2] * inv,
            total[3] * inv,
            total[4] * inv,
            total[5] * inv,
            stats[:, 6].amax(),
            total[7] * inv,
            total[8] * inv,
            torch.ones_like(tokens),
        ]
    )
    grad_magnitude = t["c"].abs()[:, None] * t["coef_terms"]
    return {
        "loss": total[0],
        "row_stats": stats,
        "metrics": metrics,
        "grad_max_scale": grad_max_scale,
        "grad_magnitude": grad_magnitude,
    }


def _vespo_scale(t: dict[str, Tensor], advantages, importance_weights, attrs) -> Tensor:
    """vespo's addition to the row statistics' scales (``[B, 9]``), and ``phi``'s relative error per token (the
    gradient ``-phi A`` carries it: ``grad_max_scale``): ``log w_i`` sums the row's log-ratios, so
    fp32 gets it to about ``2^-24 S_i`` (``S_i = sum_t m (|dc_t| + |log I_t|)``), ``w_i`` to ``2^-24 w_i S_i``,
    and ``phi`` to a relative ``2^-24 (|k - lam w_i| S_i + |lam| + |k log w_i| + |lam w_i|)``; each term of the
    loss and ``ratio`` carries that relative error on top of :func:`contract_scale`'s."""
    m = t["m"]
    cdt = t["c"].dtype

    def masked(x: Tensor) -> Tensor:
        return torch.where(m, x.to(cdt).expand(m.shape), 0.0)

    iw = None if importance_weights is None else masked(importance_weights)
    log_w, w, k, lam, size = vespo_weights(
        -t["neg_log_ratio"],
        masked(advantages),
        m,
        iw=iw,
        k_pos=attrs.get("vespo_k_pos", 2.0),
        lambda_pos=attrs.get("vespo_lambda_pos", 3.0),
        k_neg=attrs.get("vespo_k_neg", 3.0),
        lambda_neg=attrs.get("vespo_lambda_neg", 2.0),
    )
    phi_rel = torch.where(m, (k - lam * w).abs() * size + lam.abs() + (k * log_w).abs() + (lam * w).abs(), 0.0)
    extra = torch.zeros(m.shape[0], len(ROW_STATS), dtype=cdt, device=m.device)
    extra[:, 0] = t["c"].abs() * (t["policy"].abs() * phi_rel).sum(dim=1)
    extra[:, 5] = (t["ratio"].abs() * size).sum(dim=1)
    extra[:, 6] = (t["ratio"] * size).amax(dim=1)
    return extra, phi_rel


def policy_loss_bwd(grad_loss, grad_logprob, grad_entropy, grad_logprob_out, grad_entropy_out):
    """``grad_logprob_out = grad_logprob * grad_loss`` (the forward's gradient times the upstream ``[]``), and the
    same for the entropy."""
    torch.mul(grad_logprob, grad_loss, out=grad_logprob_out)
    if grad_entropy_out is not None:
        torch.mul(grad_entropy, grad_loss, out=grad_entropy_out)
