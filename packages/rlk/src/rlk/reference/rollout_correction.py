"""Reference rollout-correction primitive: the readable specification and ground truth.

The rollout engine (vLLM, SGLang) samples the tokens; the training engine recomputes their
log-probs. Where the two disagree, the policy loss is reweighted per token by the importance ratio
of the training engine's behaviour probability to the rollout engine's, truncated or masked at
thresholds (TIS, IcePop, TRL's ``vllm_importance_sampling_mode``, verl's ``rollout_is``).

Notation (per token ``t`` of row ``i``; rows are sequences)
----------------------------------------------------------
``old`` the training engine's log-prob of the sampled token, ``roll`` the rollout engine's, ``m`` the
mask, ``n_i = sum_t m``. Every input is first masked with ``where(m, x, 0)``, so masked-out positions
may hold anything (NaN, +-inf) without touching any result.

The weights::

    d_t = old_t - roll_t         on the mask, 0 off it; a NaN d_t (a token the rollout engine could not
                                 score, or -inf - -inf) counts as 0: ratio 1, no correction (TRL's rule)
    x_t = d_t                    level "token"
    x_t = S_i = sum_t m d_t      level "sequence" (one ratio per row; a NaN sum, +inf + -inf, counts as 0)
    r_t = exp(clamp(x_t, -c, c)) the ratio; c = ``clamp`` (verl: 20; TRL and no clamp: c = inf)
    truncate:  w_t = min(max(r_t, lower), upper)
    mask:      w_t = r_t if lower <= r_t <= upper else 0
    w_t = 0 off the mask

``upper = inf`` and ``lower = 0`` mean no bound. ``r_t`` is never NaN: the clamp takes +-inf to +-c
(with no clamp, exp gives ``inf`` and ``0``, and ``upper`` then caps ``inf``).

Metrics (fp32 scalars, columns :data:`rlk.core.abi.CORRECTION_METRICS`; each 0 when it has nothing to average)
--------------------------------------------------------------------------------------
Thresholds of the fractions: ``high = upper`` and ``low = lower``, or ``1 / upper`` when no lower bound
is given (verl's convention), 0 when neither is. Over the ``n`` masked tokens of the call:

* ``weight_mean``, ``weight_max``, ``weight_min``: of ``w``; ``weight_std``: population std of ``w``;
  ``ess``: ``weight_mean^2 / mean(w^2)`` (effective sample size, in (0, 1]);
* ``ratio_max``, ``ratio_min``: of ``r`` (before truncation or masking);
* ``fraction_high``, ``fraction_low``: share of tokens with ``r > high``, ``r < low``;
  ``clipped_fraction``: share of tokens whose weight is not their ratio (truncated or masked);
* ``abs_log_ratio_mean``, ``abs_log_ratio_max``: of ``|old - roll|`` over the masked tokens whose
  log-ratio is not NaN (TRL leaves those out);
* ``kl``: mean of ``-d`` (``roll - old``); ``k3_kl``: mean of ``exp(dc) - dc - 1``; ``chi2_token``: mean of
  ``exp(dc)^2 - 1``, with ``dc = clamp(d_t, -c, c)`` the token log-ratio at either level;
* ``tokens``: ``n``.

Over the ``s`` non-empty rows (``n_i > 0``), with ``W_i`` the mean of the row's weights (its one
weight at the sequence level), ``R_i`` the mean of its ratios, ``L_i = sum_t m old / n_i`` and
``D_i = S_i / n_i``:

* ``seq_weight_mean``, ``seq_weight_max``, ``seq_weight_min`` of ``W_i``; ``seq_weight_std``: their
  unbiased std (0 for ``s < 2``); ``seq_weight_max_deviation``: ``max |W_i - 1|``;
* ``seq_fraction_high``, ``seq_fraction_low``: share of rows with ``R_i > high``, ``R_i < low``;
  ``seq_clipped_fraction``: share of rows with a clipped token;
* ``chi2_seq``: mean of ``exp(2 clamp(S_i, -c, c)) - 1``;
* ``training_log_ppl``: mean of ``-L_i``; ``training_ppl``: mean of ``exp(-L_i)``; ``rollout_log_ppl``,
  ``rollout_ppl``: the same of ``L_i - D_i`` (the rollout engine's mean log-prob);
  ``log_ppl_diff``: mean of ``-D_i``; ``log_ppl_abs_diff``: mean of ``|D_i|``; ``log_ppl_diff_max``,
  ``log_ppl_diff_min``: of ``-D_i``; ``ppl_ratio``: mean of ``exp(-D_i)``;
* ``sequences``: ``s``.

Math runs in fp32 (fp64 when the inputs are fp64: ground truth). Vectorized over the whole ``[B, T]``
batch; deterministic; no batch-invariance promise (the Triton kernels make it).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlk.core.abi import (
    correction_thresholds,
)


def _terms(
    old_logprob: Tensor,
    rollout_logprob: Tensor,
    mask: Tensor,
    *,
    level: str,
    mode: str,
    upper: float,
    lower: float,
    clamp: float,
) -> dict[str, Tensor]:
    """Every per-token quantity (``[B, T]``, 0 off the mask) and the per-row sums."""
    m = mask
    zero = torch.zeros((), dtype=old_logprob.dtype, device=old_logprob.device)
    old = torch.where(m, old_logprob, zero)
    raw = old - torch.where(m, rollout_logprob, zero)
    scored = m & ~torch.isnan(raw)
    d = torch.where(scored, raw, zero)
    s = d.sum(dim=1)
    s = torch.where(torch.isnan(s), zero, s)
    x = s[:, None].expand_as(d) if level == "sequence" else d
    r = torch.where(m, torch.exp(x.clamp(-clamp, clamp)), zero)
    if mode == "truncate":
        w = r.clamp(lower, upper)
    else:
        w = torch.where((r >= lower) & (r <= upper), r, zero)
    w = torch.where(m, w, zero)
    dc = d.clamp(-clamp, clamp)
    return {
        "m": m,
        "old": old,
        "raw": raw,
        "scored": scored,
        "d": d,
        "s": s,
        "dc": dc,
        "r": r,
        "w": w,
        "n_row": m.sum(dim=1).to(old.dtype),
    }


def _masked_max(x: Tensor, keep: Tensor) -> Tensor:
    """Max of ``x`` where ``keep`` (0 where nothing is kept)."""
    top = torch.where(keep, x, -math.inf).amax()
    return torch.where(keep.any(), top, 0.0)


def _masked_min(x: Tensor, keep: Tensor) -> Tensor:
    low = torch.where(keep, x, math.inf).amin()
    return torch.where(keep.any(), low, 0.0)


def _mean(total: Tensor, count: Tensor) -> Tensor:
    return torch.where(count > 0, total / count.clamp(min=1.0), 0.0)


def _metrics(t: dict[str, Tensor], *, upper: float, lower: float, clamp: float) -> Tensor:
    m, w, r, d, dc = t["m"], t["w"], t["r"], t["d"], t["dc"]
    high, low = correction_thresholds(upper, lower)
    n = m.sum().to(w.dtype)

    def mean(x: Tensor) -> Tensor:
        return _mean(torch.where(m, x, 0.0).sum(), n)

    weight_mean = mean(w)
    var = mean((w - weight_mean) ** 2)
    mean_sq = mean(w * w)
    n_scored = t["scored"].sum().to(w.dtype)
    abs_raw = t["raw"].abs()
    rho = torch.exp(dc)
    token = [
        weight_mean,
        _masked_max(w, m),
        _masked_min(w, m),
        var.sqrt(),
        torch.where(mean_sq > 0, weight_mean * weight_mean / torch.where(mean_sq > 0, mean_sq, 1.0), 0.0),
        _masked_max(r, m),
        _masked_min(r, m),
        mean((r > high).to(w.dtype)),
        mean((r < low).to(w.dtype)),
        mean((w != r).to(w.dtype)),
        _mean(torch.where(t["scored"], abs_raw, 0.0).sum(), n_scored),
        _masked_max(abs_raw, t["scored"]),
        mean(-d),
        mean(rho - dc - 1.0),
        mean(rho * rho - 1.0),
        n,
    ]

    n_row = t["n_row"]
    rows = n_row > 0
    s_count = rows.sum().to(w.dtype)
    n1 = n_row.clamp(min=1.0)
    seq_w = w.sum(dim=1) / n1
    seq_r = r.sum(dim=1) / n1
    clipped_row = (m & (w != r)).any(dim=1)
    log_old = t["old"].sum(dim=1) / n1  # L_i
    log_diff = t["s"] / n1  # D_i
    log_roll = log_old - log_diff

    def row_mean(x: Tensor) -> Tensor:
        return _mean(torch.where(rows, x, 0.0).sum(), s_count)

    seq_mean = row_mean(seq_w)
    seq_var = torch.where(
        s_count > 1, torch.where(rows, (seq_w - seq_mean) ** 2, 0.0).sum() / (s_count - 1.0).clamp(min=1.0), 0.0
    )
    seq = [
        seq_mean,
        _masked_max(seq_w, rows),
        _masked_min(seq_w, rows),
        seq_var.sqrt(),
        _masked_max((seq_w - 1.0).abs(), rows),
        row_mean((seq_r > high).to(w.dtype)),
        row_mean((seq_r < low).to(w.dtype)),
        row_mean(clipped_row.to(w.dtype)),
        row_mean(torch.exp(2.0 * t["s"].clamp(-clamp, clamp)) - 1.0),
        row_mean(torch.exp(-log_old)),
        row_mean(-log_old),
        row_mean(torch.exp(-log_roll)),
        row_mean(-log_roll),
        row_mean(-log_diff),
        row_mean(log_diff.abs()),
        _masked_max(-log_diff, rows),
        _masked_min(-log_diff, rows),
        row_mean(torch.exp(-log_diff)),
        s_count,
    ]
    return torch.stack(token + seq)


def rollout_correction_fwd(
    old_logprob, rollout_logprob, mask, weights_out, metrics_out, *, level, mode, upper, lower, clamp
):
    """Importance weights and their metrics (module docstring for the math).

    Args:
        old_logprob, rollout_logprob: ``[B, T]`` fp32 (fp64: ground truth). mask: ``[B, T]`` bool.
        weights_out: ``[B, T]``, the weights ``w`` (0 off the mask). metrics_out: ``[len(CORRECTION_METRICS)]``.
        level (keyword-only): ``"token"`` or ``"sequence"``. mode: ``"truncate"`` or ``"mask"``.
        upper: the upper threshold (``inf``: none). lower: the lower threshold (``0``: none).
        clamp: the bound ``c`` of the log-ratio before ``exp`` (``inf``: none).
    """
    t = _terms(old_logprob, rollout_logprob, mask, level=level, mode=mode, upper=upper, lower=lower, clamp=clamp)
    weights_out.copy_(t["w"])
    metrics_out.copy_(_metrics(t, upper=upper, lower=lower, clamp=clamp))


def contract_scale(
    old_logprob: Tensor,
    rollout_logprob: Tensor,
    mask: Tensor,
    *,
    level: str,
    mode: str,
    upper: float,
    lower: float,
    clamp: float,
) -> dict[str, Tensor]:
    """The numerical contract's scales of ``weights`` ``[B, T]`` and ``metrics`` ``[len(CORRECTION_METRICS)]``.

    fp32 gets a log-ratio ``x`` to about ``2^-24 a`` with ``a = 1 + min(|d_t|, c)`` (token level) or
    ``1 + min(sum_t m |d_t|, c)`` (sequence level: the rounding of the row sum; a clamped log-ratio is
    exact), and ``exp`` turns it into a relative error ``2^-24 a`` of the ratio. So a weight's scale is
    ``1 + w a``; a mean of per-token values ``v`` has ``1 + mean(|v| a)``, a max or min ``1 + max(|v| a)`` (over
    the finite ones: infinite values are compared exactly), ``weight_std`` that of ``weight_max``, ``ess``
    ``1 + max(a)``; the per-row means ``L_i``, ``D_i`` carry ``2^-24`` times the row's mean of
    ``|old|``, ``|d|``, so ``exp(-L_i)`` has ``1 + exp(-L_i) (1 + mean |old|)`` and so on; counts and
    fractions 1 (exact, whenever no ratio lies within rounding of a threshold). Call it with the fp64
    inputs of the ground truth.
    """
    t = _terms(old_logprob, rollout_logprob, mask, level=level, mode=mode, upper=upper, lower=lower, clamp=clamp)
    m, w, r, d, dc = t["m"], t["w"], t["r"], t["d"], t["dc"]
    one = torch.ones((), dtype=w.dtype, device=w.device)
    n = m.sum().to(w.dtype)
    abs_d = d.abs()
    if level == "sequence":
        a = torch.where(m, abs_d, 0.0).sum(dim=1, keepdim=True).expand_as(d)
    else:
        a = abs_d
    a = torch.where(m, 1.0 + a.clamp(max=clamp), 0.0)  # a clamped log-ratio carries no rounding of its own

    def amplified(x: Tensor) -> Tensor:
        """``|x| a``, 0 where ``x`` is 0 (a masked-out infinite ratio has weight 0, exactly)."""
        return torch.where(x == 0, 0.0, x.abs() * a)

    def mean(x: Tensor) -> Tensor:
        return 1.0 + _mean(torch.where(m, amplified(x), 0.0).sum(), n)

    def top(x: Tensor) -> Tensor:
        """The scale of a max or min: of the largest finite value (an infinite one is compared exactly)."""
        v = amplified(x)
        return 1.0 + _masked_max(v, m & torch.isfinite(v))

    rho = torch.exp(dc)
    amp = torch.where(m, 1.0 + dc.abs(), 0.0)  # token-level log-ratios (the k3 / chi2 terms)
    token = [
        mean(w),
        top(w),
        top(w),
        top(w),
        1.0 + _masked_max(a, m),
        top(r),
        top(r),
        one,
        one,
        one,
        1.0 + _mean(torch.where(t["scored"], t["raw"].abs(), 0.0).sum(), t["scored"].sum().to(w.dtype)),
        1.0 + _masked_max(t["raw"].abs(), t["scored"]),
        1.0 + _mean(abs_d.sum(), n),
        1.0 + _mean(torch.where(m, (rho + dc.abs() + 1.0) * amp, 0.0).sum(), n),
        1.0 + _mean(torch.where(m, (rho * rho + 1.0) * amp, 0.0).sum(), n),
        one,
    ]

    n_row = t["n_row"]
    rows = n_row > 0
    s_count = rows.sum().to(w.dtype)
    n1 = n_row.clamp(min=1.0)
    w_row = torch.where(m, amplified(w), 0.0).sum(dim=1) / n1  # the scale of W_i (a mean over the row)
    old_row = t["old"].abs().sum(dim=1) / n1  # mean |old| of the row
    d_row = abs_d.sum(dim=1) / n1  # mean |d| of the row
    log_old = t["old"].sum(dim=1) / n1
    log_diff = t["s"] / n1
    s_amp = 1.0 + 2.0 * abs_d.sum(dim=1).clamp(max=clamp)

    def row_mean(x: Tensor) -> Tensor:
        return 1.0 + _mean(torch.where(rows, x.abs(), 0.0).sum(), s_count)

    def row_top(x: Tensor) -> Tensor:
        return 1.0 + _masked_max(x.abs(), rows & torch.isfinite(x))

    seq = [
        row_mean(w_row),
        row_top(w_row),
        row_top(w_row),
        row_top(w_row),
        row_top(w_row),
        one,
        one,
        one,
        row_mean((torch.exp(2.0 * t["s"].clamp(-clamp, clamp)) + 1.0) * s_amp),
        row_mean(torch.exp(-log_old) * (1.0 + old_row)),
        row_mean(old_row),
        row_mean(torch.exp(log_diff - log_old) * (1.0 + old_row + d_row)),
        row_mean(old_row + d_row),
        row_mean(d_row),
        row_mean(d_row),
        row_top(d_row),
        row_top(d_row),
        row_mean(torch.exp(-log_diff) * (1.0 + d_row)),
        one,
    ]
    return {"weights": 1.0 + amplified(w), "metrics": torch.stack(token + seq)}
