"""verl drop-in (written for verl 0.9.1): rlk's ops under verl's names, signatures, config keys and metrics.

:func:`register` puts rlk's policy losses and advantage estimators into verl's registries as ``"rlk_<name>"`` (or,
with ``override=True``, under verl's own names, and also swaps ``agg_loss``, ``kl_penalty`` and the fused log-prob
kernels behind ``use_fused_kernels``), so a verl config picks rlk by ``policy_loss.loss_mode`` / ``adv_estimator``.
Every function here takes verl's arguments and returns what verl's function of the same name returns, metric names
included (metrics are Python floats, as verl's). verl is imported lazily; ``import rlk`` never imports this module.

Served by rlk: losses vanilla, gspo, sapo, gpg, geo_mean, cispo, dppo_tv, dppo_kl, dro (gpg plus a k2 penalty
against ``old_log_prob``) and bypass_mode (its loss; the weights and rejection mask from verl's helper);
estimators gae, grpo, grpo_vectorized, gdpo, grpo_passk, reinforce_plus_plus(_baseline), remax, rloo,
rloo_vectorized, opo, gpg. Left to verl's own code, and why:

* ``clip_cov``: a random selection (``torch.randperm``) among tokens picked by a covariance with the micro-batch's
  global means; ``kl_cov``: a top-k of that covariance over the whole micro-batch (on the host). Both couple every
  token to the whole batch through a data-dependent selection: neither token-local nor batch-invariant.
* ``dro`` with ``rollout_is_weights``: verl weights its log-ratio penalty too; rlk's importance weights multiply
  the policy term only.
* ``optimal_token_baseline``, ``tir_optimal_token_baseline``: need ``sum_pi_squared`` (a statistic of the whole
  vocabulary that rlk's log-prob ops do not produce) and a per-position group reduction with a length-dependent
  zero-tail rule; the TIR form also compacts each trajectory's tokens.
* ``linear_cross_entropy`` with a ``dist_process_group`` (verl's Megatron path, the head sharded by vocabulary) is
  served by :func:`rlk.distributed.vocab_parallel_linear_logprob`: log-probs and entropies bitwise the single-device
  ones at any tensor-parallel degree; ``grad_hidden`` is the whole gradient on the group's first rank and zeros on
  the others (verl's kernel returns each rank's partial and leaves the sum over ranks to its caller: this sum is
  exact).
* Rollout correction: :func:`rollout_is_weights` gives verl's IS weights on ``rlk.rollout_correction``; the
  rejection sampling (``rollout_rs``: it edits the response mask), ``rollout_is_batch_normalize`` (a mean over the
  whole batch) and verl's ``rollout_corr/*`` metric dict stay verl's, so bypass mode takes its weights, mask and
  metrics from verl's helper.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch import Tensor

import rlk
from rlk.core import checks

#: The verl release this adapter was written and tested for.
VERL_VERSION = "0.9.1"

#: verl's log-ratio clamp before ``exp`` in vanilla, sapo, cispo and the dppo losses.
_LOG_RATIO_CLAMP = 20.0
#: verl's GSPO clamps the sequence log-ratio from above only.
_GSPO_LOG_RATIO_MAX = 10.0


# ---------------------------------------------------------------------------
# config and aggregation
# ---------------------------------------------------------------------------


def _get(config, key: str, default=None):
    """``config[key]`` for verl's dataclass configs (``BaseConfig.get``), ``DictConfig`` and plain dicts."""
    if config is None:
        return default
    value = config.get(key, default)
    return default if value is None else value


def _clip_bounds(config) -> tuple[float, float]:
    """``(clip_ratio_low, clip_ratio_high)``, each falling back to ``clip_ratio`` (verl's rule)."""
    if config is None:
        raise ValueError("config: verl's policy losses need the actor config (clip_ratio, ...)")
    clip = config.get("clip_ratio", 0.2)
    low, high = config.get("clip_ratio_low", None), config.get("clip_ratio_high", None)
    return float(clip if low is None else low), float(clip if high is None else high)


def _agg_args(
    loss_agg_mode: str, mask: Tensor, dp_size=1, batch_num_tokens=None, global_batch_size=None, loss_scale_factor=None
) -> tuple[dict[str, Any], Any]:
    """rlk's aggregation arguments for verl's ``agg_loss`` normalizers, and the factor verl multiplies by (dp_size).

    verl: token-mean ``sum / batch_num_tokens * dp``; token-sum ``sum * dp``; seq-mean-token-sum(-norm) and
    seq-mean-token-mean ``sum_i / global_batch_size * dp`` (``/ loss_scale_factor`` for -norm, the padded length
    ``T`` when that is None); without the global numbers (only at ``dp == 1``) the micro-batch's own counts.
    """
    kwargs: dict[str, Any] = {"agg": loss_agg_mode}
    if loss_agg_mode == "token-mean":
        if batch_num_tokens is None and not _is_one(dp_size):
            raise ValueError("(global) batch_num_tokens is required when dp_size > 1")
        kwargs["global_tokens"] = batch_num_tokens
    elif loss_agg_mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm", "seq-mean-token-mean"):
        if global_batch_size is None and not _is_one(dp_size):
            raise ValueError("global_batch_size is required when dp_size > 1")
        kwargs["global_seqs"] = global_batch_size
        if loss_agg_mode == "seq-mean-token-sum-norm":
            kwargs["loss_scale"] = mask.shape[-1] if loss_scale_factor is None else loss_scale_factor
    elif loss_agg_mode != "token-sum":
        raise ValueError(f"Invalid loss_agg_mode: {loss_agg_mode}")
    return kwargs, dp_size


def _is_one(x) -> bool:
    return isinstance(x, (int, float)) and x == 1


def _scaled(loss: Tensor, dp_size) -> Tensor:
    return loss if _is_one(dp_size) else loss * dp_size


def _config_agg(loss_agg_mode: str, mask: Tensor, config) -> tuple[dict[str, Any], Any]:
    """:func:`_agg_args` from ``config.global_batch_info`` (what verl's ``ppo_loss`` fills in per micro-batch)."""
    info = dict(_get(config, "global_batch_info", {}) or {})
    return _agg_args(
        loss_agg_mode,
        mask,
        info.get("dp_size", 1),
        info.get("batch_num_tokens"),
        info.get("global_batch_size"),
        info.get("loss_scale_factor"),
    )


def _items(metrics: dict[str, Tensor], names: dict[str, str]) -> dict[str, float]:
    """verl's metric dict (floats) from rlk's metrics: ``{verl name: rlk name or a number}``."""
    return {verl: float(metrics[ours].item()) if isinstance(ours, str) else float(ours) for verl, ours in names.items()}


_PPO_METRICS = {
    "actor/pg_clipfrac": "clip_fraction",
    "actor/ppo_kl": "approx_kl",
    "actor/pg_clipfrac_lower": "lower_clip_fraction",
}
_NO_LOWER_METRICS = {"actor/pg_clipfrac": "clip_fraction", "actor/ppo_kl": "approx_kl", "actor/pg_clipfrac_lower": 0.0}


def agg_loss(
    loss_mat: Tensor,
    loss_mask: Tensor,
    loss_agg_mode: str,
    dp_size: int = 1,
    batch_num_tokens: int | None = None,
    global_batch_size: int | None = None,
    loss_scale_factor: int | None = None,
) -> Tensor:
    """verl's ``agg_loss`` on rlk's aggregation (``rlk.policy_loss`` with ``loss="gpg"`` and advantages -1, so the
    per-token loss is ``loss_mat`` itself, differentiable). Masked-out entries never count, even inf or NaN."""
    kwargs, dp = _agg_args(loss_agg_mode, loss_mask, dp_size, batch_num_tokens, global_batch_size, loss_scale_factor)
    minus_one = torch.full((loss_mat.shape[0], 1), -1.0, dtype=loss_mat.dtype, device=loss_mat.device)
    loss, _ = rlk.policy_loss(loss_mat, None, minus_one, loss_mask, loss="gpg", **kwargs)
    return _scaled(loss, dp)


def kl_penalty(logprob: Tensor, ref_logprob: Tensor, kl_penalty: str) -> Tensor:
    """verl's ``kl_penalty``: ``"kl"``/``"k1"``, ``"abs"``, ``"mse"``/``"k2"``, ``"low_var_kl"``/``"k3"`` (verl's
    clamps), each optionally with ``"+"`` (value of the estimator, gradient of k2), on ``rlk.kl_penalty``."""
    if kl_penalty.rstrip("+") == "full":
        raise NotImplementedError("kl_penalty='full' needs the whole distribution (verl does not implement it)")
    return rlk.kl_penalty(logprob, ref_logprob, kl_penalty, k3_clamp=True)


# ---------------------------------------------------------------------------
# policy losses (verl's PolicyLossFn signature)
# ---------------------------------------------------------------------------


def _policy(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode,
    config,
    rollout_is_weights,
    *,
    metrics: dict,
    **kwargs,
) -> tuple[Tensor, dict[str, float]]:
    agg, dp = _config_agg(loss_agg_mode, response_mask, config)
    loss, values = rlk.policy_loss(
        log_prob, old_log_prob, advantages, response_mask, importance_weights=rollout_is_weights, **agg, **kwargs
    )
    return _scaled(loss, dp), _items(values, metrics)


def compute_policy_loss_vanilla(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """PPO with verl's dual clip ``clip_ratio_c`` (default 3.0, always on) and log-ratio clamp +-20: ``loss="ppo"``."""
    low, high = _clip_bounds(config)
    c = float(config.get("clip_ratio_c", 3.0))
    if not c > 1.0:
        raise ValueError(
            f"The lower bound of the clip_ratio_c for dual-clip PPO should be greater than 1.0, but get the value: {c}."
        )
    return _policy(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        rollout_is_weights,
        metrics=_PPO_METRICS,
        loss="ppo",
        clip_low=low,
        clip_high=high,
        dual_clip=c,
        clamp_log_ratio=_LOG_RATIO_CLAMP,
    )


def compute_policy_loss_gspo(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="seq-mean-token-mean",
    config=None,
    rollout_is_weights=None,
):
    """GSPO-token with the sequence log-ratio clamped at 10 from above: ``loss="gspo"``."""
    low, high = _clip_bounds(config)
    return _policy(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        rollout_is_weights,
        metrics=_NO_LOWER_METRICS,
        loss="gspo",
        clip_low=low,
        clip_high=high,
        clamp_log_ratio=(None, _GSPO_LOG_RATIO_MAX),
    )


def compute_policy_loss_sapo(
    old_log_prob,
    log_prob,
    advantages,
    response_mask,
    loss_agg_mode="seq-mean-token-mean",
    config=None,
    rollout_is_weights=None,
):
    """SAPO with ``config.tau_pos`` / ``tau_neg``; verl aggregates it ``seq-mean-token-mean`` whatever
    ``loss_agg_mode`` says, and so does this."""
    tau = (float(config.get("tau_pos", 1.0)), float(config.get("tau_neg", 1.05)))
    return _policy(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        "seq-mean-token-mean",
        config,
        rollout_is_weights,
        metrics={"actor/pg_clipfrac": 0.0, "actor/ppo_kl": "approx_kl", "actor/pg_clipfrac_lower": 0.0},
        loss="sapo",
        sapo_tau=tau,
        clamp_log_ratio=_LOG_RATIO_CLAMP,
    )


def compute_policy_loss_gpg(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """GPG ``-A logprob``: ``loss="gpg"`` (no metrics, as verl)."""
    if config is None:
        raise ValueError("config: verl's gpg loss needs the actor config")
    return _policy(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        rollout_is_weights,
        metrics={},
        loss="gpg",
    )


def compute_policy_loss_cispo(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """CISPO ``-sg(clip(r)) A logprob`` with the log-ratio clamp +-20: ``loss="cispo", cispo_form="clip"``."""
    low, high = _clip_bounds(config)
    return _policy(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        rollout_is_weights,
        metrics=_NO_LOWER_METRICS,
        loss="cispo",
        cispo_form="clip",
        clip_low=low,
        clip_high=high,
        clamp_log_ratio=_LOG_RATIO_CLAMP,
    )


def _dppo(variant, old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights):
    low, high = _clip_bounds(config)
    return _policy(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        rollout_is_weights,
        metrics=_PPO_METRICS,
        loss=variant,
        clip_low=low,
        clip_high=high,
        dual_clip=float(config.get("clip_ratio_c", 20.0)),
        clamp_log_ratio=_LOG_RATIO_CLAMP,
    )


def compute_policy_loss_dppo_tv(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """DPPO-Binary-TV (``loss="dppo_tv"``): ``clip_ratio_low/high`` are the TV thresholds, ``clip_ratio_c`` the cap
    of the truncated ratio."""
    return _dppo(
        "dppo_tv", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
    )


def compute_policy_loss_dppo_kl(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """DPPO-Binary-KL (``loss="dppo_kl"``): ``clip_ratio_low/high`` are the binary-KL thresholds."""
    return _dppo(
        "dppo_kl", old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
    )


def _geo_mean_seq_weights(weights: Tensor, mask: Tensor) -> Tensor:
    """verl's sequence weight of GMPO: the geometric mean ``exp(sum_t m log(w + 1e-10) / n)`` of a row's token
    weights, broadcast over the row (rlk's geo_mean multiplies a row's loss by the mean of its token weights)."""
    m = mask if mask.dtype == torch.bool else mask != 0
    logs = torch.where(m, torch.log(weights + 1e-10), 0.0).sum(dim=-1)
    n = m.sum(dim=-1).clamp(min=1).to(logs.dtype)
    return torch.exp(logs / n)[:, None].expand_as(weights)


def compute_policy_loss_geo_mean(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """GMPO: ``loss="geo_mean"`` without log-ratio clamp, the mean of the sequence losses over all ``B`` rows
    (verl ignores ``loss_agg_mode`` and the global batch info here, and so does this)."""
    low, high = _clip_bounds(config)
    weights = None if rollout_is_weights is None else _geo_mean_seq_weights(rollout_is_weights, response_mask)
    loss, values = rlk.policy_loss(
        log_prob,
        old_log_prob,
        advantages,
        response_mask,
        loss="geo_mean",
        clip_low=low,
        clip_high=high,
        importance_weights=weights,
        agg="seq-mean-token-mean",
        global_seqs=log_prob.shape[0],
    )
    # verl's clip fractions: tokens whose log-ratio lies outside [-low, high], split by the advantage's sign
    m = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    with torch.no_grad():
        d = log_prob.detach() - old_log_prob
        outside = m & ((d < -low) | (d > high))
        n = m.sum().clamp(min=1)
        upper = (outside & (advantages > 0)).sum() / n
        lower = (outside & (advantages < 0)).sum() / n
    return loss, {
        "actor/pg_clipfrac": float(upper.item()),
        "actor/ppo_kl": float(values["approx_kl"].item()),
        "actor/pg_clipfrac_lower": float(lower.item()),
    }


def compute_policy_loss_dro(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """DRO ``-(A logprob - beta / 2 (logprob - old)^2)``: rlk's ``gpg`` plus ``beta`` times the k2 estimator
    against ``old_log_prob``. With ``rollout_is_weights`` (which verl applies to the penalty too) verl's own
    function runs."""
    beta = _get(_get(config, "policy_loss"), "dro_beta")
    if beta is None or beta <= 0:
        raise ValueError("policy_loss.dro_beta must be a positive value when using DRO")
    if rollout_is_weights is not None:
        return _verl_function("compute_policy_loss_dro")(
            old_log_prob, log_prob, advantages, response_mask, loss_agg_mode, config, rollout_is_weights
        )
    return _policy(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        loss_agg_mode,
        config,
        None,
        metrics={"actor/ppo_kl": "approx_kl"},
        loss="gpg",
        ref_logprob=old_log_prob,
        kl="k2",
        kl_coef=float(beta),
    )


def compute_policy_loss_bypass_mode(
    old_log_prob, log_prob, advantages, response_mask, loss_agg_mode="token-mean", config=None, rollout_is_weights=None
):
    """verl's bypass mode (``old_log_prob`` is the rollout's): the IS weights and rejection mask from verl's
    ``compute_rollout_correction_and_rejection_mask``, then ``loss_type`` ``"ppo_clip"`` (vanilla on the kept tokens,
    no weights) or ``"reinforce"`` (``-w A logprob``: rlk's ``gpg`` with the weights)."""
    if config is None:
        raise ValueError("config is required for bypass_mode loss")
    rc = _get(_get(config, "policy_loss"), "rollout_correction")
    if rc is None:
        raise ValueError(
            "rollout_correction config not found in policy_loss. "
            "When using loss_mode='bypass_mode', ensure rollout_correction config is passed."
        )
    helper = importlib.import_module("verl.trainer.ppo.rollout_corr_helper")
    with torch.no_grad():
        weights_proto, kept, rc_metrics = helper.compute_rollout_correction_and_rejection_mask(
            old_log_prob=log_prob,
            rollout_log_prob=old_log_prob,
            response_mask=response_mask,
            rollout_is=rc.get("rollout_is", None),
            rollout_is_threshold=rc.get("rollout_is_threshold", 2.0),
            rollout_is_batch_normalize=rc.get("rollout_is_batch_normalize", False),
            rollout_rs=rc.get("rollout_rs", None),
            rollout_rs_threshold=rc.get("rollout_rs_threshold", None),
        )
    weights = weights_proto.batch["rollout_is_weights"] if weights_proto else None
    loss_type = rc.get("loss_type", "ppo_clip")
    if loss_type == "reinforce":
        loss, metrics = _policy(
            old_log_prob,
            log_prob,
            advantages,
            kept,
            loss_agg_mode,
            config,
            weights,
            metrics={"actor/ppo_kl": "approx_kl"},
            loss="gpg",
        )
    elif loss_type == "ppo_clip":
        loss, metrics = compute_policy_loss_vanilla(old_log_prob, log_prob, advantages, kept, loss_agg_mode, config)
    else:
        raise ValueError(f"Invalid loss_type: {loss_type}. Must be 'reinforce' or 'ppo_clip'.")
    metrics.update(rc_metrics)
    return loss, metrics


def rollout_is_weights(
    old_log_prob: Tensor,
    rollout_log_prob: Tensor,
    response_mask: Tensor,
    rollout_is: str = "token",
    rollout_is_threshold: str | float = 2.0,
) -> Tensor:
    """The weights of verl's ``compute_rollout_correction_weights`` (``log_ratio = old_log_prob -
    rollout_log_prob``) on ``rlk.rollout_correction``: ``rollout_is`` ``"token"`` / ``"sequence"`` is the level,
    a threshold ``u`` truncates (TIS), ``"l_u"`` masks outside ``[l, u]`` (IcePop); verl's log-ratio clamp 20.
    ``[B, T]``, 0 off the mask. Batch normalization and rejection sampling stay verl's (module docstring)."""
    if rollout_is not in ("token", "sequence"):
        raise ValueError(f"rollout_is: expected 'token' or 'sequence', got {rollout_is!r}")
    spec = rollout_is_threshold.strip() if isinstance(rollout_is_threshold, str) else rollout_is_threshold
    if isinstance(spec, str) and "_" in spec:
        lower, upper = (float(x) for x in spec.split("_", 1))
        mode = "mask"
    else:
        lower, upper, mode = None, float(spec), "truncate"
    weights, _ = rlk.rollout_correction(
        old_log_prob,
        rollout_log_prob,
        response_mask,
        level=rollout_is,
        mode=mode,
        upper=upper,
        lower=lower,
        clamp_log_ratio=_LOG_RATIO_CLAMP,
    )
    return weights


#: verl loss_mode -> rlk's drop-in (the losses rlk serves).
POLICY_LOSSES: dict[str, Callable] = {
    "vanilla": compute_policy_loss_vanilla,
    "gspo": compute_policy_loss_gspo,
    "sapo": compute_policy_loss_sapo,
    "gpg": compute_policy_loss_gpg,
    "geo_mean": compute_policy_loss_geo_mean,
    "cispo": compute_policy_loss_cispo,
    "dppo_tv": compute_policy_loss_dppo_tv,
    "dppo_kl": compute_policy_loss_dppo_kl,
    "dro": compute_policy_loss_dro,
    "bypass_mode": compute_policy_loss_bypass_mode,
}
#: verl loss modes that stay verl's own (module docstring).
VERL_ONLY_LOSSES = ("clip_cov", "kl_cov")


# ---------------------------------------------------------------------------
# advantage estimators (verl's signatures)
# ---------------------------------------------------------------------------


def _groups(index, device: torch.device) -> tuple[Tensor, np.ndarray]:
    """Group ids ``[B]`` int64 on ``device`` and the size of each row's group (host numpy) for verl's ``index``
    (the ``uid`` array: any hashable labels) or an integer tensor."""
    labels = index.detach().cpu().numpy() if isinstance(index, Tensor) else np.asarray(index)
    _, inverse, counts = np.unique(labels, return_inverse=True, return_counts=True)
    inverse = inverse.reshape(-1)
    return torch.as_tensor(inverse, dtype=torch.int64, device=device), counts[inverse]


def _broadcast(per_row: Tensor, mask: Tensor) -> Tensor:
    return per_row.unsqueeze(-1) * mask


def _whiten_masked(x: Tensor, mask: Tensor) -> Tensor:
    """verl's ``masked_whiten(x, mask) * mask`` (unbiased variance, ``+ 1e-8``): 0 off the mask."""
    return rlk.masked_whiten(x, mask)


def compute_gae_advantage_return(token_level_rewards, values, response_mask, gamma, lam):
    """GAE (``rlk.gae``, masked positions skipped) then whitened over the mask (``rlk.masked_whiten``).

    Returns ``(advantages, returns)``; ``returns = a + V`` before whitening. Advantages are 0 off the mask (verl
    leaves the whitening formula's values there; no loss reads them)."""
    adv, ret = rlk.gae(token_level_rewards, values, response_mask, gamma=float(gamma), lam=float(lam))
    return _whiten_masked(adv, response_mask), ret


def _grpo_scalars(scores, index, epsilon, norm_adv_by_std_in_grpo):
    group, _ = _groups(index, scores.device)
    mode = "grpo" if checks.flag("norm_adv_by_std_in_grpo", norm_adv_by_std_in_grpo) else "dr_grpo"
    return rlk.group_advantages(scores, group_index=group, mode=mode, eps=float(epsilon))


def compute_grpo_outcome_advantage(
    token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True, config=None
):
    """GRPO (``mode="grpo"``; ``"dr_grpo"`` when ``norm_adv_by_std_in_grpo`` is False) on the row sums of
    ``token_level_rewards``, grouped by ``index``; singletons: mean 0, std 1. Returns ``(adv, adv)`` ``[B, T]``."""
    scores = token_level_rewards.sum(dim=-1)
    adv = _broadcast(_grpo_scalars(scores, index, epsilon, norm_adv_by_std_in_grpo), response_mask)
    return adv, adv


def compute_grpo_vectorized_outcome_advantage(
    token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True, config=None
):
    """The same as :func:`compute_grpo_outcome_advantage` (verl's vectorized form computes the same quantities)."""
    return compute_grpo_outcome_advantage(
        token_level_rewards, response_mask, index, epsilon, norm_adv_by_std_in_grpo, config
    )


def compute_gdpo_outcome_advantage(
    token_level_rewards,
    response_mask,
    index,
    epsilon=1e-6,
    norm_adv_by_std_in_grpo=True,
    config=None,
    non_tensor_batch=None,
    batch=None,
    **kwargs,
):
    """GDPO: GRPO per reward component (``config.gdpo_reward_keys`` of ``non_tensor_batch``; else the summed
    token rewards), weighted by ``config.gdpo_reward_weights``, summed, broadcast and whitened over the mask."""
    components = [token_level_rewards.sum(dim=-1)]
    weights = None
    if config is not None and non_tensor_batch is not None and batch is not None:
        keys = config.get("gdpo_reward_keys", None)
        if not keys:
            raise ValueError(
                "GDPO requires 'algorithm.gdpo_reward_keys' listing the individual reward component "
                "keys returned by compute_score (e.g. ['format_reward', 'accuracy_reward'])."
            )
        missing = [key for key in keys if key not in non_tensor_batch]
        if missing:
            raise KeyError(f"GDPO reward key {missing[0]!r} not found in non_tensor_batch")
        # verl places each component at the last response token: its row sum is the component itself
        components = [
            torch.as_tensor(np.asarray(non_tensor_batch[key], dtype=np.float32), device=token_level_rewards.device)
            for key in keys
        ]
        weights = config.get("gdpo_reward_weights", None)
    weights = [1.0] * len(components) if weights is None else [float(w) for w in weights]
    total = None
    for w, scores in zip(weights, components):
        part = torch.tensor(w, dtype=torch.float32, device=scores.device) * _grpo_scalars(
            scores, index, epsilon, norm_adv_by_std_in_grpo
        )
        total = part if total is None else total + part
    adv = _whiten_masked(_broadcast(total, response_mask), response_mask)
    return adv, adv


def compute_grpo_passk_outcome_advantage(
    token_level_rewards, response_mask, index, epsilon=1e-6, norm_adv_by_std_in_grpo=True, config=None, **kwargs
):
    """Pass@k: the group's best response gets ``max - second max`` (over ``std + epsilon`` when
    ``config.norm_adv_by_std_in_grpo``, verl reads the config, not the argument), the others 0: ``mode="grpo_passk"``
    / ``"dr_grpo_passk"``. Groups of one sequence are an error, as in verl."""
    if config is None:
        raise ValueError("config: verl's grpo_passk reads norm_adv_by_std_in_grpo from the algorithm config")
    scores = token_level_rewards.sum(dim=-1)
    group, sizes = _groups(index, scores.device)
    if (sizes < 2).any():
        raise ValueError(f"Pass@k requires at least 2 samples per group. Got {int(sizes.min())} for a group.")
    mode = "grpo_passk" if config.get("norm_adv_by_std_in_grpo", True) else "dr_grpo_passk"
    adv = _broadcast(rlk.group_advantages(scores, group_index=group, mode=mode, eps=float(epsilon)), response_mask)
    return adv, adv


def compute_reinforce_plus_plus_baseline_outcome_advantage(
    token_level_rewards, response_mask, index, epsilon=1e-6, config=None, **kwargs
):
    """REINFORCE++-baseline: ``s - mean_g`` (``mode="reinforce_pp_baseline"``), broadcast, whitened over the mask."""
    scores = token_level_rewards.sum(dim=-1)
    group, _ = _groups(index, scores.device)
    centred = rlk.group_advantages(scores, group_index=group, mode="reinforce_pp_baseline")
    adv = _whiten_masked(_broadcast(centred, response_mask), response_mask)
    return adv, adv


def compute_rloo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6, config=None, **kwargs):
    """RLOO ``s_i - mean_{j != i} s_j`` (``mode="rloo"``); singletons keep their score, as in verl's loop form."""
    scores = token_level_rewards.sum(dim=-1)
    group, _ = _groups(index, scores.device)
    adv = _broadcast(rlk.group_advantages(scores, group_index=group, mode="rloo"), response_mask)
    return adv, adv


def compute_rloo_vectorized_outcome_advantage(
    token_level_rewards, response_mask, index, epsilon=1e-6, config=None, **kwargs
):
    """RLOO as :func:`compute_rloo_outcome_advantage`, but singletons get 0 (verl's vectorized form)."""
    scores = token_level_rewards.sum(dim=-1)
    group, sizes = _groups(index, scores.device)
    per_row = rlk.group_advantages(scores, group_index=group, mode="rloo")
    keep = torch.as_tensor(sizes > 1, device=scores.device)
    adv = _broadcast(torch.where(keep, per_row, 0.0), response_mask)
    return adv, adv


def compute_opo_outcome_advantage(token_level_rewards, response_mask, index, epsilon=1e-6, config=None, **kwargs):
    """OPO: ``s - sum_g(l s) / sum_g(l)`` with ``l`` the response lengths (``mode="opo"``)."""
    scores = token_level_rewards.sum(dim=-1)
    group, _ = _groups(index, scores.device)
    lengths = response_mask.sum(dim=-1)
    adv = _broadcast(rlk.group_advantages(scores, group_index=group, mode="opo", lengths=lengths), response_mask)
    return adv, adv


def compute_reinforce_plus_plus_outcome_advantage(token_level_rewards, response_mask, config=None, **kwargs):
    """REINFORCE++: returns ``G_t = r_t + gamma G_{t+1}`` carried through masked positions (``mask_mode="carry"``;
    0 there in the output, as verl), whitened over the mask. ``gamma`` is ``config.gamma``."""
    gamma = _get(config, "gamma")
    if gamma is None:
        raise ValueError("config: verl's reinforce_plus_plus reads gamma from the algorithm config")
    m = response_mask if response_mask.dtype == torch.bool else response_mask != 0
    returns = rlk.discounted_returns(token_level_rewards, m, float(gamma), mask_mode="carry")
    returns = torch.where(m, returns, 0.0)
    return _whiten_masked(returns, m), returns


def compute_remax_outcome_advantage(token_level_rewards, reward_baselines, response_mask, config=None, **kwargs):
    """ReMax: returns ``G_t = sum_{u >= t} m_u r_u`` (``rlk.discounted_returns``, gamma 1, ``mask_mode="zero"``),
    advantages ``G - b m``."""
    returns = rlk.discounted_returns(token_level_rewards, response_mask, 1.0, mask_mode="zero")
    return returns - reward_baselines.unsqueeze(-1) * response_mask, returns


def compute_gpg_outcome_advantage(
    token_level_rewards, response_mask, index, epsilon=1e-6, f_norm=1.0, alpha=1.0, config=None, **kwargs
):
    """verl's GPG estimator: ``B / max(count_nonzero(scores), 1) * (s - mean_g) / f_norm`` (rlk's ``dr_grpo``
    scaled; verl's ``alpha`` argument is overwritten by that ratio, as in verl)."""
    scores = token_level_rewards.sum(dim=-1)
    group, _ = _groups(index, scores.device)
    alpha = scores.shape[0] / torch.count_nonzero(scores).clamp(min=1)
    adv = alpha * rlk.group_advantages(scores, group_index=group, mode="dr_grpo") / f_norm
    adv = _broadcast(adv, response_mask)
    return adv, adv


#: verl adv_estimator -> rlk's drop-in.
ADVANTAGE_ESTIMATORS: dict[str, Callable] = {
    "gae": compute_gae_advantage_return,
    "grpo": compute_grpo_outcome_advantage,
    "grpo_vectorized": compute_grpo_vectorized_outcome_advantage,
    "gdpo": compute_gdpo_outcome_advantage,
    "grpo_passk": compute_grpo_passk_outcome_advantage,
    "reinforce_plus_plus_baseline": compute_reinforce_plus_plus_baseline_outcome_advantage,
    "rloo": compute_rloo_outcome_advantage,
    "rloo_vectorized": compute_rloo_vectorized_outcome_advantage,
    "opo": compute_opo_outcome_advantage,
    "reinforce_plus_plus": compute_reinforce_plus_plus_outcome_advantage,
    "remax": compute_remax_outcome_advantage,
    "gpg": compute_gpg_outcome_advantage,
}
#: verl estimators that stay verl's own (module docstring).
VERL_ONLY_ADVANTAGE_ESTIMATORS = ("optimal_token_baseline", "tir_optimal_token_baseline")


# ---------------------------------------------------------------------------
# fused log-prob + entropy (use_fused_kernels)
# ---------------------------------------------------------------------------


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    labels: Tensor,
    temperature: float = 1.0,
    reduction: str = "none",
    dist_process_group=None,
) -> tuple[Tensor, Tensor]:
    """Drop-in for ``verl.utils.kernel.linear_cross_entropy.linear_cross_entropy`` (the ``"triton"`` fused backend).

    Args:
        hidden: ``[..., H]``, the same on every rank of ``dist_process_group``; labels: ``[...]`` global token ids.
        weight: ``[V, H]`` (the LM head), or with ``dist_process_group`` this rank's ``[V / P, H]`` rows
            ``[r V / P, (r + 1) V / P)`` (Megatron's vocab-parallel output layer).
        temperature: the logits are ``hidden @ weight.T / temperature``.
        reduction: ``"none"``: log-probs ``[N]`` (``N`` = the flattened leading dims); ``"sum"`` / ``"mean"``: their
            sum / mean, a scalar.
        dist_process_group: the tensor-parallel group the head is sharded over, or None.

    Returns:
        ``(logprobs, entropy)`` fp32, entropy ``[N]``, on ``rlk.linear_logprob`` (the logits never exist), or with
        ``dist_process_group`` on ``rlk.distributed.vocab_parallel_linear_logprob`` (the same bits at any degree, the
        same on every rank); differentiable w.r.t. ``hidden`` and ``weight``. Vocab-parallel gradients follow verl's
        kernel: ``grad_weight`` is this rank's rows; the ranks' ``grad_hidden`` sum to the gradient (the caller sums
        them), here the whole gradient on the group's first rank and zeros on the others, so that sum is exact.
    """
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"Invalid reduction: {reduction}")
    flat_hidden, flat_labels = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    if dist_process_group is not None:
        import torch.distributed as dist

        from rlk.distributed import vocab_parallel_linear_logprob

        if not isinstance(dist_process_group, dist.ProcessGroup):
            raise TypeError(
                "dist_process_group: expected a torch.distributed ProcessGroup (the tensor-parallel group), got "
                f"{type(dist_process_group).__name__}"
            )
        first = dist.get_rank(dist_process_group) == 0
        logprob, entropy = vocab_parallel_linear_logprob(
            _GradOnFirstRank.apply(flat_hidden, first),
            weight,
            flat_labels,
            group=dist_process_group,
            temperature=float(temperature),
            return_entropy=True,
        )
    else:
        logprob, entropy = rlk.linear_logprob(
            flat_hidden, weight, flat_labels, temperature=float(temperature), return_entropy=True
        )
    if reduction == "sum":
        logprob = logprob.sum()
    elif reduction == "mean":
        logprob = logprob.mean()
    return logprob, entropy


class _GradOnFirstRank(torch.autograd.Function):
    """Identity; the backward passes the gradient on the group's first rank and zeros on the others."""

    @staticmethod
    def forward(ctx, x: Tensor, first: bool) -> Tensor:
        ctx.first = first
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return (grad if ctx.first else torch.zeros_like(grad)), None


class FusedLinearForPPO(torch.nn.Module):
    """Drop-in for ``verl.utils.experimental.torch_functional.FusedLinearForPPO`` (the ``"torch"`` / ``"liger"``
    fused backends): ``forward(hidden_states [B, T, H] or [T, H], vocab_weights [V, H], input_ids, temperature)``
    returns ``(log_probs fp32, entropy in hidden_states' dtype)`` of ``input_ids``' shape, on ``rlk.linear_logprob``.
    ``chunk_size`` and ``impl_backend`` are accepted for compatibility and unused (rlk tiles the vocabulary itself).
    """

    def __init__(self, chunk_size: int = 512, impl_backend: str = "torch"):
        super().__init__()
        if impl_backend not in ("torch", "liger"):
            raise ValueError(f"Unsupported FusedLinearForPPO backend: {impl_backend}. Choose 'torch' or 'liger'.")
        self.chunk_size = chunk_size
        self.impl_backend = impl_backend

    def forward(
        self, hidden_states: Tensor, vocab_weights: Tensor, input_ids: Tensor, temperature: float = 1.0
    ) -> tuple[Tensor, Tensor]:
        if hidden_states.dim() not in (2, 3):
            raise ValueError(f"hidden_states must be 2D or 3D, got shape {tuple(hidden_states.shape)}")
        if tuple(input_ids.shape) != tuple(hidden_states.shape[:-1]):
            raise ValueError(
                f"input_ids shape {tuple(input_ids.shape)} must match hidden_states shape "
                f"{tuple(hidden_states.shape[:-1])}"
            )
        logprob, entropy = rlk.linear_logprob(
            hidden_states, vocab_weights, input_ids, temperature=float(temperature), return_entropy=True
        )
        return logprob, entropy.to(hidden_states.dtype)


# ---------------------------------------------------------------------------
# registration
# ---------------------------------------------------------------------------

#: (module, attribute) -> verl's original, for :func:`unregister`.
_SAVED: dict[tuple[str, str], Any] = {}
_REGISTERED: list[tuple[str, str]] = []  # (registry, name) added by register(override=False)
_CORE = "verl.trainer.ppo.core_algos"
#: verl's Megatron forward modules that import ``linear_cross_entropy`` by name (they need megatron-core; swapped by
#: :func:`register` when already imported; imported later, they pick up the swapped function).
_MCORE_FORWARDS = ("verl.models.mcore.model_forward_fused", "verl.models.mcore.model_forward_1f1b_overlap")


def _verl_function(name: str) -> Callable:
    """verl's own function ``name`` of ``core_algos`` (the original, also while :func:`register` overrides it)."""
    return _SAVED.get((_CORE, name)) or getattr(importlib.import_module(_CORE), name)


def _swap(module: str, attribute: str, value) -> None:
    mod = importlib.import_module(module)
    _SAVED.setdefault((module, attribute), getattr(mod, attribute))
    setattr(mod, attribute, value)


def _swap_entry(registry: str, name: str, value) -> None:
    table = getattr(importlib.import_module(_CORE), registry)
    _SAVED.setdefault((registry, name), table.get(name))
    table[name] = value


def register(override: bool = False) -> list[str]:
    """Make verl run rlk: add the drop-ins to verl's policy-loss and advantage-estimator registries.

    ``override=False``: as ``"rlk_<verl name>"`` (select with ``actor.policy_loss.loss_mode=rlk_vanilla``,
    ``algorithm.adv_estimator=rlk_grpo``). ``override=True``: under verl's own names, so an unchanged verl config
    runs rlk; it also replaces ``core_algos.agg_loss`` / ``kl_penalty`` (and the copies ``verl.workers.utils.losses``
    imported), ``compute_gae_advantage_return`` / ``compute_grpo_outcome_advantage`` (which the trainer calls by
    name) and the fused log-prob kernels of ``use_fused_kernels`` (:func:`linear_cross_entropy`,
    :class:`FusedLinearForPPO`). The losses and estimators that stay verl's (``VERL_ONLY_*``) are left alone.
    :func:`unregister` undoes it. Returns the registry names now served by rlk.
    """
    override = checks.flag("override", override)
    core = importlib.import_module(_CORE)
    names = []
    tables = (("POLICY_LOSS_REGISTRY", POLICY_LOSSES), ("ADV_ESTIMATOR_REGISTRY", ADVANTAGE_ESTIMATORS))
    for registry, functions in tables:
        for verl_name, fn in functions.items():
            name = verl_name if override else f"rlk_{verl_name}"
            if override:
                _swap_entry(registry, name, fn)
            else:
                getattr(core, registry)[name] = fn
                _REGISTERED.append((registry, name))
            names.append(name)
    if override:
        for name, fn in (
            ("agg_loss", agg_loss),
            ("kl_penalty", kl_penalty),
            ("compute_gae_advantage_return", compute_gae_advantage_return),
            ("compute_grpo_outcome_advantage", compute_grpo_outcome_advantage),
            *((fn.__name__, fn) for fn in POLICY_LOSSES.values()),
        ):
            _swap(_CORE, name, fn)
        for name, fn in (("agg_loss", agg_loss), ("kl_penalty", kl_penalty)):
            _swap("verl.workers.utils.losses", name, fn)
        _swap("verl.utils.kernel.linear_cross_entropy", "linear_cross_entropy", linear_cross_entropy)
        for module in _MCORE_FORWARDS:  # verl's Megatron forwards hold their own reference, once imported
            if module in sys.modules:
                _swap(module, "linear_cross_entropy", linear_cross_entropy)
        _swap("verl.utils.experimental.torch_functional", "FusedLinearForPPO", FusedLinearForPPO)
    return names


def unregister() -> None:
    """Undo :func:`register`: remove the ``"rlk_*"`` entries and put verl's originals back."""
    core = importlib.import_module(_CORE)
    for registry, name in _REGISTERED:
        getattr(core, registry).pop(name, None)
    _REGISTERED.clear()
    for (owner, name), original in _SAVED.items():
        if owner in ("POLICY_LOSS_REGISTRY", "ADV_ESTIMATOR_REGISTRY"):
            table = getattr(core, owner)
            if original is None:
                table.pop(name, None)
            else:
                table[name] = original
        else:
            setattr(importlib.import_module(owner), name, original)
    _SAVED.clear()
