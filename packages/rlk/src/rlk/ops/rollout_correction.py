"""Public op ``rollout_correction``: importance weights of the training engine's log-probs against the rollout
engine's (TIS, IcePop, TRL's vLLM importance-sampling correction, verl's ``rollout_is``), with their metrics.

One ``torch.library.custom_op`` (``rlk::rollout_correction_fwd``) with a fake implementation, so the op traces
under ``torch.compile(fullgraph=True)``. Not differentiable: the weights multiply a policy loss as constants.
The math is specified in :mod:`rlk.reference.rollout_correction`. Nothing here synchronizes with the device.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlk.core import checks, custom_op
from rlk.core.abi import CORRECTION_LEVELS, CORRECTION_METRICS, CORRECTION_MODES

#: verl's bound of the log-ratio before ``exp`` (``SAFETY_BOUND``): exp(20) ~ 4.9e8.
DEFAULT_CLAMP = 20.0


def _log_probs(name: str, x, like: Tensor | None) -> Tensor:
    """``x`` checked (float, ``[B, T]``, like ``like``) and detached, as fp32 (fp64 stays fp64), contiguous."""
    checks.check_float(name, x)
    if like is None:
        if x.dim() != 2:
            raise ValueError(f"{name}: expected shape [B, T] (rows are sequences), got {tuple(x.shape)}")
    else:
        if x.shape != like.shape:
            raise ValueError(
                f"{name}: expected shape {tuple(like.shape)} (the shape of old_logprob), got {tuple(x.shape)}"
            )
        if x.device != like.device:
            raise ValueError(f"{name}: expected device {like.device} (the device of old_logprob), got {x.device}")
    x = x.detach()
    return (x if x.dtype == torch.float64 else x.float()).contiguous()


def _bool_mask(mask, like: Tensor) -> Tensor:
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask: expected a torch.Tensor, got {type(mask).__name__}")
    if mask.is_complex():
        raise TypeError(f"mask: expected dtype bool or 0/1 numbers, got {mask.dtype}")
    if mask.shape != like.shape:
        raise ValueError(
            f"mask: expected shape {tuple(like.shape)} (the shape of old_logprob), got {tuple(mask.shape)}"
        )
    if mask.device != like.device:
        raise ValueError(f"mask: expected device {like.device} (the device of old_logprob), got {mask.device}")
    mask = mask.detach()
    return (mask if mask.dtype == torch.bool else mask != 0).contiguous()


def _outputs(old: Tensor, *_) -> tuple[Tensor, Tensor]:
    return torch.empty_like(old), old.new_empty((len(CORRECTION_METRICS),))


rollout_correction_op = custom_op.declare("rollout_correction")


@rollout_correction_op.forward(outputs=_outputs)
def _rollout_correction_fwd(
    primitive,
    out,
    old_logprob: Tensor,
    rollout_logprob: Tensor,
    mask: Tensor,
    level: str,
    mode: str,
    params: list[float],
) -> tuple[Tensor, Tensor]:
    weights, metrics = out
    if old_logprob.numel() == 0:
        weights.zero_()
        metrics.zero_()
        return
    upper, lower, clamp = params
    primitive(
        old_logprob,
        rollout_logprob,
        mask,
        weights,
        metrics,
        level=level,
        mode=mode,
        upper=upper,
        lower=lower,
        clamp=clamp,
    )


def rollout_correction(
    old_logprob: Tensor,
    rollout_logprob: Tensor,
    mask: Tensor,
    *,
    level: str = "token",
    mode: str = "truncate",
    upper: float | None = 2.0,
    lower: float | None = None,
    clamp_log_ratio: float | None = DEFAULT_CLAMP,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Rollout-vs-training importance weights ``w`` of the sampled tokens, and their metrics, in one pass.

    With ``d = old_logprob - rollout_logprob`` on the mask (math: :mod:`rlk.reference.rollout_correction`)::

        level "token":     r_t = exp(clamp(d_t, -c, c))
        level "sequence":  r_t = exp(clamp(sum_t mask * d_t, -c, c))        (one ratio per row)
        mode "truncate":   w_t = min(max(r_t, lower), upper)                 (TIS)
        mode "mask":       w_t = r_t if lower <= r_t <= upper else 0         (IcePop, TRL's *_mask)

    A bound given as None is absent; ``c = clamp_log_ratio``. A NaN log-ratio on the mask (a token the
    rollout engine could not score) counts as 0, a ratio of 1 (TRL's rule); the weights are never NaN.

    Framework settings (``old_logprob`` the training engine's, ``rollout_logprob`` the rollout engine's):

    * verl ``rollout_is="token"`` / ``"sequence"``, ``rollout_is_threshold=u``: ``level`` the same,
      ``mode="truncate", upper=u``; ``rollout_is_threshold="l_u"`` (IcePop): ``mode="mask", lower=l, upper=u``.
      verl clamps the log-ratio (the row sum at the sequence level) at 20, the default here.
    * TRL ``vllm_importance_sampling_mode="token_truncate"`` / ``"token_mask"`` / ``"sequence_truncate"`` /
      ``"sequence_mask"``, ``vllm_importance_sampling_clip_max=u``, ``clip_min=l``: ``level`` and ``mode`` as
      named, ``upper=u, lower=l, clamp_log_ratio=None`` (TRL does not clamp; the weights are the same whenever
      ``exp(-20) < lower`` and ``upper < exp(20)``).

    Not covered: verl's rejection sampling (``rollout_rs``: it changes the response mask, which changes the
    loss's normalizers, rather than the weights) and ``rollout_is_batch_normalize`` (a mean over the whole
    data-parallel batch: divide the weights by the all-reduced ``weight_mean`` or ``seq_weight_mean``).

    Args:
        old_logprob: ``[B, T]`` log-probs of the sampled tokens under the training engine (the behaviour
            policy; rows are sequences); float32 (bf16 / fp16 are upcast; float64 for reference runs).
        rollout_logprob: ``[B, T]`` the rollout engine's log-probs of the same tokens.
        mask: ``[B, T]`` bool, or numbers (nonzero = a response token). Masked-out positions never touch
            the result, even when they hold NaN or +-inf.
        level: ``"token"`` or ``"sequence"``.
        mode: ``"truncate"`` or ``"mask"``.
        upper, lower: the thresholds of the ratio (> 0, ``lower <= upper``), or None.
        clamp_log_ratio: the bound ``c > 0`` of the log-ratio before ``exp``, or None (no clamp: a ratio past
            fp32's range is ``inf``, capped by ``upper``).

    Returns:
        ``(weights, metrics)``: ``weights`` ``[B, T]`` float32 (float64 for float64 inputs), 0 off the mask,
        never requiring grad; ``metrics`` a dict of 0-d device tensors (no host synchronization), each 0 when
        it has nothing to average, names and definitions in :mod:`rlk.reference.rollout_correction`: over the
        masked tokens ``weight_mean``, ``weight_max``, ``weight_min``, ``weight_std``, ``ess``, ``ratio_max``,
        ``ratio_min``, ``fraction_high``, ``fraction_low``, ``clipped_fraction``, ``abs_log_ratio_mean``,
        ``abs_log_ratio_max``, ``kl``, ``k3_kl``, ``chi2_token``, ``tokens``; over the rows with tokens
        ``seq_weight_mean``, ``seq_weight_max``, ``seq_weight_min``, ``seq_weight_std``,
        ``seq_weight_max_deviation``, ``seq_fraction_high``, ``seq_fraction_low``, ``seq_clipped_fraction``,
        ``chi2_seq``, ``training_ppl``, ``training_log_ppl``, ``rollout_ppl``, ``rollout_log_ppl``,
        ``log_ppl_diff``, ``log_ppl_abs_diff``, ``log_ppl_diff_max``, ``log_ppl_diff_min``, ``ppl_ratio``,
        ``sequences``. TRL's ``sampling/importance_sampling_ratio/{min,mean,max}`` are ``weight_*`` at the token
        level and ``seq_weight_*`` at the sequence level, its ``sampling_logp_difference/{mean,max}``
        ``abs_log_ratio_*``. verl's ``rollout_corr/`` off-policy metrics (``kl``, ``k3_kl``, ``chi2_token``,
        ``chi2_seq``, the perplexities) carry the same names; its ``rollout_is_{mean,max,min,std}`` are
        ``weight_*``, ``rollout_is_eff_sample_size`` ``ess``, ``rollout_is_oob_ratio`` ``clipped_fraction``,
        ``rollout_is_ratio_fraction_{high,low}`` ``fraction_*``, ``rollout_is_seq_{mean,std,max,min,max_deviation,
        fraction_high,fraction_low}`` ``seq_weight_*`` / ``seq_fraction_*``; at the sequence level verl's
        ``rollout_is_{max,min}`` are ``ratio_{max,min}`` and ``rollout_is_ratio_fraction_*`` ``seq_fraction_*``.
        Row metrics leave out empty rows, which TRL and verl count; verl's ``k3_kl`` is unclamped (equal where
        ``|d| <= c``), its means divide by ``count + 1e-8``.

    Batch invariance: a row's weights depend on that row only (bitwise, on backends that promise it); the
    metrics span the call and are deterministic.
    """
    old = _log_probs("old_logprob", old_logprob, None)
    roll = _log_probs("rollout_logprob", rollout_logprob, old)
    checks.same_dtype(("old_logprob", old_logprob), ("rollout_logprob", rollout_logprob))
    m = _bool_mask(mask, old)
    level = checks.choice("level", level, CORRECTION_LEVELS)
    mode = checks.choice("mode", mode, CORRECTION_MODES)
    upper_value = math.inf if upper is None else checks.number("upper", upper, above=0.0, dtype=torch.float32)
    lower_value = 0.0 if lower is None else checks.number("lower", lower, above=0.0, dtype=torch.float32)
    if lower_value > upper_value:
        raise ValueError(f"lower: must be <= upper, got lower={lower_value:g} and upper={upper_value:g}")
    clamp = (
        math.inf
        if clamp_log_ratio is None
        else checks.number("clamp_log_ratio", clamp_log_ratio, above=0.0, dtype=torch.float32)
    )
    weights, metrics = _rollout_correction_fwd(old, roll, m, level, mode, [upper_value, lower_value, clamp])
    return weights, dict(zip(CORRECTION_METRICS, metrics.unbind()))
