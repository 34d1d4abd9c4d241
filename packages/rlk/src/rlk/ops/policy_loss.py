"""Public policy-loss ops: ``policy_loss`` (PPO / GRPO / DAPO, GSPO, CISPO, GPG, SAPO, GMPO, DPPO, VESPO) and
``kl_penalty``.

Each op is declared with :func:`rlk.core.custom_op.declare`: two ``torch.library`` custom ops
(``rlk::<op>_fwd``, ``rlk::<op>_bwd``) with fakes, so they trace under ``torch.compile(fullgraph=True)``,
and their autograd formula. The policy-loss forward primitive does all the work in one pass over the
tokens: the loss, its gradient (for an upstream gradient of 1), the aggregation weights of the
rows and the metrics; the backward only multiplies the saved gradient by the upstream gradient,
and ``policy_loss_and_grad`` returns it without a backward at all. A call's options (the variant, its clip
ranges, the aggregation, the KL and entropy terms) are one frozen :class:`PolicyLossConfig`, checked once
when it is made. Backends are chosen at run time by ``rlk.core.dispatch``; the backward runs on the backend
that served the forward. The math is specified in :mod:`rlk.reference.policy_loss`; the aggregation modes
in :mod:`rlk.reference.aggregation`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from rlk.core import checks, custom_op
from rlk.core.abi import AGG_MODES, KL_ESTIMATORS, LOSSES, POLICY_METRICS, ROW_STATS
from rlk.core.checks import INPUT_DTYPES, stat_dtype
from rlk.ops import spans
from rlk.reference import aggregation

_KL_ALIASES = {"kl": "k1", "mse": "k2", "low_var_kl": "k3"}
_CISPO_FORMS = ("clip", "upper")
#: The losses that read ``dual_clip``: ppo's dual clip; the DPPO losses' ratio cap.
_CAPPED_LOSSES = ("ppo", "dppo_tv", "dppo_kl")
_INF = math.inf


# ---------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------


def _check_tensor(
    name: str, x, shapes: tuple[tuple[int, ...], ...], device: torch.device, floating: bool = True
) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if floating and x.dtype not in INPUT_DTYPES:
        raise TypeError(
            f"{name}: expected dtype float32, bfloat16 or float16 (float64 for reference runs), got {x.dtype}"
        )
    if tuple(x.shape) not in shapes:
        wanted = " or ".join(str(s) for s in shapes)
        raise ValueError(f"{name}: expected shape {wanted}, got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name}: expected device {device} (the device of logprob), got {x.device}")


def _kl_spec(name: str, estimator) -> tuple[str, bool]:
    """Canonical estimator name and the straight-through flag (a trailing ``+``, verl's ``"k3+"``)."""
    if not isinstance(estimator, str):
        raise TypeError(f"{name}: expected a string, got {type(estimator).__name__}")
    straight = estimator.endswith("+")
    base = estimator[:-1] if straight else estimator
    base = _KL_ALIASES.get(base, base)
    if base not in KL_ESTIMATORS:
        known = ", ".join(repr(k) for k in (*KL_ESTIMATORS, *_KL_ALIASES))
        raise ValueError(
            f"{name}: expected one of {known} (optionally with a trailing '+' for the straight-through "
            f"form), got {estimator!r}"
        )
    return base, straight


def _clamp_bounds(clamp_log_ratio) -> tuple[float, float]:
    if clamp_log_ratio is None:
        return -_INF, _INF
    if isinstance(clamp_log_ratio, (tuple, list)):
        if len(clamp_log_ratio) != 2:
            raise ValueError(f"clamp_log_ratio: expected a number c or a pair (low, high), got {clamp_log_ratio!r}")
        low, high = clamp_log_ratio
        low = -_INF if low is None else checks.number("clamp_log_ratio", low)
        high = _INF if high is None else checks.number("clamp_log_ratio", high)
        if not low < high:
            raise ValueError(f"clamp_log_ratio: expected low < high, got ({low:g}, {high:g})")
        return low, high
    c = checks.number("clamp_log_ratio", clamp_log_ratio, above=0.0)
    return -c, c


# ---------------------------------------------------------------------------
# policy_loss
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PolicyLossConfig:
    """The options of a policy-loss call: everything but its tensors and its normalizers, checked when the config
    is made (errors name the field). Frozen: build one per training run and pass it as ``config=``; keywords of the
    same names given to the call override its fields (``policy_loss(..., config=cfg, clip_high=0.28)``).

    Attributes:
        loss: ``"ppo"``, ``"gspo"``, ``"cispo"``, ``"gpg"``, ``"sapo"``, ``"geo_mean"``, ``"dppo_tv"``,
            ``"dppo_kl"`` or ``"vespo"`` (formulas: :func:`policy_loss`).
        clip_low, clip_high: ``eps_low`` and ``eps_high`` (>= 0; ``clip_high=None`` means ``clip_low``). DAPO:
            0.2 / 0.28; GSPO: 3e-4 / 4e-4.
        dual_clip: the dual-clip constant ``c > 1`` (``"ppo"``), the ratio cap (``"dppo_tv"``, ``"dppo_kl"``), or
            None.
        clamp_log_ratio: clamp the log-ratio to ``[-c, c]`` (or ``(low, high)``, either None) before ``exp``; a
            clamped token gets no gradient through the ratio. verl and OpenRLHF use 20. For ``"gspo"`` it clamps
            the sequence log-ratio ``log s_i``; for ``"gpg"`` it only affects the ratio metrics; for ``"vespo"``
            it clamps each token's log-ratio before the row's sum (TRL: 20). None: no clamp (TRL, slime).
        cispo_form: ``"clip"`` or ``"upper"`` (see ``"cispo"``).
        sapo_tau: ``(tau for A > 0, tau for A <= 0)``.
        agg: the aggregation (:mod:`rlk.reference.aggregation`): ``"token-mean"``, ``"token-sum"``,
            ``"seq-mean-token-sum"``, ``"seq-mean-token-mean"``, ``"seq-mean-token-sum-norm"`` (Dr.GRPO; needs
            the call's ``loss_scale``).
        kl: the KL estimator: ``"k1"`` (alias ``"kl"``), ``"abs"``, ``"k2"`` (``"mse"``), ``"k3"``
            (``"low_var_kl"``); a trailing ``"+"`` is the straight-through form (value of the estimator,
            gradient of k2). See :func:`kl_penalty`.
        kl_coef: the KL coefficient ``beta``; nonzero needs the call's ``ref_logprob``.
        kl_k3_clamp, kl_clamp: as ``k3_clamp`` and ``clamp`` of :func:`kl_penalty` (TRL's k3:
            ``kl_k3_clamp=False``; OpenRLHF: ``kl_clamp=10``).
        kl_unbiased: weight the KL term by ``sg(exp(logprob - old_logprob))`` (slime's unbiased KL).
        entropy_coef: with ``entropy_coef != 0`` the loss subtracts ``entropy_coef * agg(entropy)`` and the
            gradient flows to the call's ``entropy``.
        vespo_k, vespo_lambda: ``"vespo"``'s exponent ``k`` and decay ``lam > 0``, each ``(for A >= 0, for
            A < 0)``.
    """

    loss: str = "ppo"
    clip_low: float = 0.2
    clip_high: float | None = None
    dual_clip: float | None = None
    clamp_log_ratio: float | tuple[float | None, float | None] | None = None
    cispo_form: str = "clip"
    sapo_tau: tuple[float, float] = (1.0, 1.05)
    agg: str = "token-mean"
    kl: str = "k3"
    kl_coef: float = 0.0
    kl_k3_clamp: bool = True
    kl_clamp: float | None = None
    kl_unbiased: bool = False
    entropy_coef: float = 0.0
    vespo_k: tuple[float, float] = (2.0, 3.0)
    vespo_lambda: tuple[float, float] = (3.0, 2.0)
    #: The fields encoded for the forward primitive (set when the config is made).
    attrs: _OpAttrs = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "attrs", _op_attrs(self))


class _OpAttrs(NamedTuple):
    """A config as ``rlk::policy_loss_fwd`` takes it: the canonical estimator name, the flags of ``_BOOL_ATTRS``
    and the numbers of ``_FLOAT_ATTRS`` (the call's normalizer numbers follow them in ``params``)."""

    kl: str
    flags: list[bool]
    params: list[float]


def _pair(name: str, value, sides: str = "for A >= 0, for A < 0") -> tuple:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"{name}: expected a pair ({sides}), got {value!r}")
    return tuple(value)


def _op_attrs(config: PolicyLossConfig) -> _OpAttrs:
    """Check ``config``'s fields (errors name the field) and encode them for the forward primitive."""
    loss, cispo_form = config.loss, config.cispo_form
    if loss not in LOSSES:
        raise ValueError(f"loss: expected one of {', '.join(repr(x) for x in LOSSES)}, got {loss!r}")
    if cispo_form not in _CISPO_FORMS:
        raise ValueError(f"cispo_form: expected 'clip' or 'upper', got {cispo_form!r}")
    clip_low = checks.number("clip_low", config.clip_low, minimum=0.0)
    clip_high = config.clip_high
    if clip_high is None:
        if loss == "cispo" and cispo_form == "upper":
            raise ValueError(
                "clip_high: cispo_form='upper' caps the ratio at clip_high itself (TRL's epsilon_high, "
                "e.g. 5.0); pass it explicitly"
            )
        clip_high = clip_low
    clip_high = checks.number("clip_high", clip_high, minimum=0.0)
    dual_clip = config.dual_clip
    if dual_clip is not None:
        if loss not in _CAPPED_LOSSES:
            raise ValueError(
                f"dual_clip: only loss='ppo' has a dual clip, and 'dppo_tv' / 'dppo_kl' a ratio cap (loss is {loss!r})"
            )
        dual_clip = checks.number("dual_clip", dual_clip, above=1.0)
    clamp_low, clamp_high = _clamp_bounds(config.clamp_log_ratio)
    tau_pos, tau_neg = (
        checks.number("sapo_tau", tau, above=0.0) for tau in _pair("sapo_tau", config.sapo_tau, "for A > 0, for A <= 0")
    )
    vespo_k_pos, vespo_k_neg = (
        checks.number("vespo_k", k, dtype=torch.float32) for k in _pair("vespo_k", config.vespo_k)
    )
    vespo_lambda_pos, vespo_lambda_neg = (
        checks.number("vespo_lambda", lam, above=0.0, dtype=torch.float32)
        for lam in _pair("vespo_lambda", config.vespo_lambda)
    )
    kl, kl_straight = _kl_spec("kl", config.kl)
    kl_coef = checks.number("kl_coef", config.kl_coef)
    kl_clamp = _INF if config.kl_clamp is None else checks.number("kl_clamp", config.kl_clamp, above=0.0)
    entropy_coef = checks.number("entropy_coef", config.entropy_coef)
    if config.agg not in AGG_MODES:
        raise ValueError(f"agg: expected one of {', '.join(repr(a) for a in AGG_MODES)}, got {config.agg!r}")
    kl_k3_clamp = checks.flag("kl_k3_clamp", config.kl_k3_clamp)
    kl_unbiased = checks.flag("kl_unbiased", config.kl_unbiased)
    flags = [cispo_form == "upper", kl_k3_clamp, kl_straight, kl_unbiased]
    params = [
        clip_low,
        clip_high,
        0.0 if dual_clip is None else dual_clip,
        clamp_low,
        clamp_high,
        tau_pos,
        tau_neg,
        kl_coef,
        kl_clamp,
        entropy_coef,
        vespo_k_pos,
        vespo_lambda_pos,
        vespo_k_neg,
        vespo_lambda_neg,
    ]
    return _OpAttrs(kl, flags, params)


_DEFAULT_CONFIG = PolicyLossConfig()
_CONFIG_FIELDS = tuple(field.name for field in dataclasses.fields(PolicyLossConfig) if field.init)


def resolve_config(config: PolicyLossConfig | None, options: dict[str, object]) -> PolicyLossConfig:
    """The config of a call: ``config`` (the defaults when None) with the keyword ``options`` of the call
    (:class:`PolicyLossConfig` field names) replacing its fields."""
    if config is None:
        config = _DEFAULT_CONFIG
    elif not isinstance(config, PolicyLossConfig):
        raise TypeError(f"config: expected an rlk.PolicyLossConfig, got {type(config).__name__}")
    if not options:
        return config
    unknown = [name for name in options if name not in _CONFIG_FIELDS]
    if unknown:
        raise TypeError(
            f"{unknown[0]}: not an argument of the policy loss (its options are the fields of "
            f"rlk.PolicyLossConfig: {', '.join(_CONFIG_FIELDS)})"
        )
    return dataclasses.replace(config, **options)


def _fwd_outputs(
    logprob: Tensor,
    old_logprob,
    advantages,
    mask,
    importance_weights,
    ref_logprob,
    entropy,
    with_entropy_grad: bool,
    *_,
) -> tuple[Tensor, ...]:
    """``(loss, grad_logprob, grad_entropy, row_weight, row_stats, metrics)`` of a ``[B, T]`` call."""
    b, t = logprob.shape
    loss = logprob.new_empty(())
    grad_lp = torch.empty_like(logprob)
    grad_ent = torch.empty_like(logprob) if with_entropy_grad else custom_op.placeholder(logprob)
    row_weight = logprob.new_empty((b,))
    stats = logprob.new_empty((b, len(ROW_STATS)))
    metrics = logprob.new_empty((len(POLICY_METRICS),))
    return loss, grad_lp, grad_ent, row_weight, stats, metrics


#: The scalar attributes of the forward primitive, passed to the custom op as two lists (the op's
#: schema stays short: torch's custom-op call path costs time per schema argument and call).
_FLOAT_ATTRS = (
    "clip_low",
    "clip_high",
    "dual_clip",
    "clamp_low",
    "clamp_high",
    "tau_pos",
    "tau_neg",
    "kl_coef",
    "kl_clamp",
    "entropy_coef",
    "vespo_k_pos",
    "vespo_lambda_pos",
    "vespo_k_neg",
    "vespo_lambda_neg",
)
_BOOL_ATTRS = ("cispo_upper", "kl_k3_clamp", "kl_straight_through", "kl_unbiased")
#: The aggregation normalizers: each a number (in ``params`` after the attributes; NaN when absent or given
#: as a tensor) or a one-element tensor (an optional tensor argument).
_NORMALIZERS = ("global_tokens", "global_seqs", "loss_scale")


def normalizers(tensors: list, params: list[float]) -> dict[str, object]:
    """The normalizers by name (numbers, one-element tensors or None) from the custom op's normalizer tensors and
    ``params`` (their numbers after ``_FLOAT_ATTRS``')."""
    numbers = params[len(_FLOAT_ATTRS) :]
    return {
        name: t if t is not None else (None if math.isnan(x) else x)
        for name, t, x in zip(_NORMALIZERS, tensors, numbers)
    }


def launch(
    primitive,
    out: tuple[Tensor, ...],
    logprob: Tensor,
    old_logprob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    importance_weights: Tensor | None,
    ref_logprob: Tensor | None,
    entropy: Tensor | None,
    with_entropy_grad: bool,
    norms: dict[str, object],
    agg: str,
    loss: str,
    kl: str,
    flags: list[bool],
    params: list[float],
) -> None:
    """The backend's ``policy_loss_fwd`` on canonical inputs (:class:`PolicyLossCall`'s) into ``out``
    (``_fwd_outputs``'); ``norms`` as :func:`normalizers` gives them. Also the per-chunk calls of
    ``fused_linear_policy_loss``'s one-pass mode."""
    attrs = dict(zip(_BOOL_ATTRS, flags)) | dict(zip(_FLOAT_ATTRS, params))
    loss_out, grad_lp, grad_ent, row_weight, stats, metrics = out
    primitive(
        logprob,
        old_logprob,
        advantages,
        mask,
        importance_weights,
        ref_logprob,
        entropy,
        norms["global_tokens"],
        norms["global_seqs"],
        norms["loss_scale"],
        loss_out,
        grad_lp,
        grad_ent if with_entropy_grad else None,
        row_weight,
        stats,
        metrics,
        agg=agg,
        loss=loss,
        kl=kl,
        **attrs,
    )


policy_loss_op = custom_op.declare("policy_loss")


@policy_loss_op.forward(outputs=_fwd_outputs)
def _policy_loss_fwd(
    primitive,
    out,
    logprob: Tensor,
    old_logprob: Tensor,
    advantages: Tensor,
    mask: Tensor,
    importance_weights: Tensor | None,
    ref_logprob: Tensor | None,
    entropy: Tensor | None,
    with_entropy_grad: bool,
    global_tokens: Tensor | None,
    global_seqs: Tensor | None,
    loss_scale: Tensor | None,
    agg: str,
    loss: str,
    kl: str,
    flags: list[bool],
    params: list[float],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    checks.check_normalizer_values(dict(zip(_NORMALIZERS, (global_tokens, global_seqs, loss_scale))))
    launch(
        primitive,
        out,
        logprob,
        old_logprob,
        advantages,
        mask,
        importance_weights,
        ref_logprob,
        entropy,
        with_entropy_grad,
        normalizers([global_tokens, global_seqs, loss_scale], params),
        agg,
        loss,
        kl,
        flags,
        params,
    )


def _bwd_outputs(grad_loss: Tensor, grad_logprob: Tensor, grad_entropy: Tensor | None) -> tuple[Tensor, Tensor]:
    grad_ent = torch.empty_like(grad_logprob) if grad_entropy is not None else custom_op.placeholder(grad_logprob)
    return torch.empty_like(grad_logprob), grad_ent


@policy_loss_op.backward_primitive(outputs=_bwd_outputs)
def _policy_loss_bwd(
    primitive, out, grad_loss: Tensor, grad_logprob: Tensor, grad_entropy: Tensor | None
) -> tuple[Tensor, Tensor]:
    grad_lp, grad_ent = out
    primitive(grad_loss, grad_logprob, grad_entropy, grad_lp, grad_ent if grad_entropy is not None else None)


def _save_policy(ctx, inputs, output):
    _, grad_lp, grad_ent, row_weight, stats, metrics = output
    ctx.save_for_backward(grad_lp, grad_ent)
    ctx.with_entropy_grad = inputs.with_entropy_grad
    ctx.mark_non_differentiable(grad_lp, grad_ent, row_weight, stats, metrics)
    ctx.set_materialize_grads(False)  # no zero-filled gradients for the non-differentiable outputs


def _backward_policy(ctx, grad_loss, grad_grad_lp, grad_grad_ent, grad_row_weight, grad_stats, grad_metrics):
    grad_lp, grad_ent = ctx.saved_tensors
    if grad_loss is None:
        return {}
    grad_lp, grad_ent = policy_loss_op.backward(
        ctx,
        grad_loss.to(grad_lp.dtype).contiguous(),
        grad_lp,
        grad_ent if ctx.with_entropy_grad else None,
    )
    return {"logprob": grad_lp, "entropy": grad_ent if ctx.with_entropy_grad else None}


policy_loss_op.autograd(save=_save_policy, backward=_backward_policy)


class PolicyLossAndGrad(NamedTuple):
    """What :func:`policy_loss_and_grad` returns."""

    loss: Tensor
    grad_logprob: Tensor
    grad_entropy: Tensor | None
    metrics: dict[str, Tensor]


def policy_loss(
    logprob: Tensor,
    old_logprob: Tensor | None,
    advantages: Tensor,
    mask: Tensor | None = None,
    *,
    loss_spans: Tensor | None = None,
    span_tags: int | tuple[int, ...] | None = None,
    config: PolicyLossConfig | None = None,
    importance_weights: Tensor | None = None,
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    loss_scale: float | Tensor | None = None,
    ref_logprob: Tensor | None = None,
    entropy: Tensor | None = None,
    **options,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Policy-gradient loss of one (micro-)batch, with its metrics, in one fused pass.

    ``loss = agg(I * L) + kl_coef * agg(k(logprob, ref_logprob)) - entropy_coef * agg(entropy)``
    with the per-token policy loss ``L`` of the variant ``loss`` (math:
    :mod:`rlk.reference.policy_loss`; ``r = exp(logprob - old_logprob)``, ``A`` the advantage):

    * ``"ppo"`` (also GRPO / DAPO): ``max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high))``; with
      ``dual_clip=c`` (> 1; verl uses 3.0), ``min(that, -A c)`` where ``A < 0``. TRL's two-sided
      ``delta`` (INTELLECT-2) is ``dual_clip=delta`` (equal in value and gradient when
      ``delta > 1 + clip_high``).
    * ``"gspo"``: the sequence ratio ``s_i = exp(mean_t (logprob - old))`` per token in the
      GSPO-token form ``lp - sg(lp) + sg(log s_i)`` (value ``s_i``, gradient to the token
      itself), then the ppo clip; no dual clip. For verl's form pass
      ``clamp_log_ratio=(None, 10.0)`` (verl clamps ``log s`` at 10 from above) and
      ``agg="seq-mean-token-mean"`` (verl forces it for GSPO; rlk accepts any mode). With one
      advantage per sequence this equals TRL's ``importance_sampling_level="sequence"``.
    * ``"cispo"``: ``-sg(w) A logprob`` with ``w = clip(r, 1 - clip_low, 1 + clip_high)``
      (``cispo_form="clip"``: verl, slime) or ``w = min(r, clip_high)``
      (``cispo_form="upper"``: TRL; ``clip_high`` is the cap itself, e.g. 5.0, and must be
      given). Clipped tokens keep their gradient.
    * ``"gpg"``: ``-A logprob``.
    * ``"sapo"``: ``-A sigmoid(tau (r - 1)) 4 / tau`` with ``tau = sapo_tau[0]`` where ``A > 0``,
      else ``sapo_tau[1]`` (defaults 1.0, 1.05).
    * ``"geo_mean"`` (GMPO): the per-token log-ratio clipped sign-aware to
      ``[-clip_low, clip_high]`` (upper bound for ``A > 0``, lower for ``A < 0``),
      ``R_i = exp(mean_t of it)``, sequence loss ``-mean_t(A) R_i`` carried by each token of the
      row. With ``agg="seq-mean-token-mean"`` the loss is the mean of the sequence losses
      (verl's GMPO).
    * ``"dppo_tv"`` / ``"dppo_kl"`` (DPPO-Binary, verl's losses of those names):
      ``-A sg(min(r, dual_clip)) logprob`` on the tokens inside the trust region, 0 elsewhere; the
      region is ``p - p_old <= clip_high`` (``A > 0``) / ``>= -clip_low`` (else) for ``dppo_tv``, the binary
      KL of ``p`` against ``p_old`` below ``clip_high`` / ``clip_low`` (or moving away from the
      advantage's direction) for ``dppo_kl`` (``p = exp(logprob)``). ``dual_clip`` is the ratio cap
      (verl's ``clip_ratio_c``), None for no cap.
    * ``"vespo"`` (VESPO, TRL's ``loss_type="vespo"``): ``-sg(phi) A logprob`` with the gamma weight
      ``phi = w^k exp(lam (1 - w))`` of the sequence ratio ``w = exp(clamp(sum_t (logprob - old), ln 1e-8,
      20))``; ``(k, lam) = (vespo_k[0], vespo_lambda[0])`` where ``A >= 0``, else ``[1]`` (defaults TRL's:
      k 2.0 / 3.0, lam 3.0 / 2.0). ``importance_weights`` enter ``w`` (their logs, each clamped to
      ``[ln 1e-8, 20]``, join the sum) instead of multiplying the loss. TRL: ``clamp_log_ratio=20``,
      ``agg="token-mean"``.

    Args:
        logprob: ``[B, T]`` log-probs of the sampled tokens under the current policy (rows are
            sequences); float32 (bf16 / fp16 are upcast). The gradient flows to it. The floating inputs may mix
            bf16, fp16 and fp32 (each read as fp32); float64 (reference runs) for all of them or none
            (:func:`rlk.core.checks.same_dtype`; the error names the first that differs).
        old_logprob: ``[B, T]`` behaviour log-probs (detached), or None for on-policy
            (``old = logprob.detach()``, ``r = 1``).
        advantages: ``[B, T]``, or ``[B]`` / ``[B, 1]`` for one advantage per sequence (detached).
        mask: ``[B, T]`` bool, or numbers (nonzero = a loss token). Masked-out positions
            never touch the result, even when they hold ``-inf`` or NaN.
        loss_spans: instead of ``mask``, an int ``[S, 4]`` span table (``rlk.multimodal``'s ``(sequence, start, end,
            tag)``; ``[S, 3]`` without tags) of the loss tokens, turned into the mask on the device (as in
            :func:`rlk.selected_logprob`; no dense mask on the host). Give ``mask`` or ``loss_spans``, not both.
        span_tags: only the rows of ``loss_spans`` tagged one of these count; None: every row.
        config: the options (:class:`PolicyLossConfig`: the variant, its clip ranges, the aggregation,
            the KL and entropy terms); None: its defaults.
        importance_weights: ``[B, T]`` per-token weights (detached, e.g. a rollout-vs-training
            correction) multiplying the policy loss ``L`` (not the KL or entropy terms); for
            ``"vespo"`` a factor of the sequence ratio instead.
        global_tokens, global_seqs, loss_scale: the normalizers of the aggregation ``agg``
            (:mod:`rlk.reference.aggregation`). With the global normalizers of the optimizer step
            (numbers or one-element tensors, e.g. all-reduced), the micro-batch losses add up to
            the full-batch loss and so do their gradients. Without them the micro-batch is the
            whole batch (its masked tokens / its sequences with at least one token).
            ``loss_scale``: ``"seq-mean-token-sum-norm"``'s constant (only that mode takes it).
        ref_logprob: ``[B, T]`` reference-model log-probs (detached); enables the KL term and
            the ``kl_mean`` metric.
        entropy: ``[B, T]`` per-token entropy; enables ``entropy_mean``. With ``entropy_coef != 0``
            the loss subtracts ``entropy_coef * agg(entropy)`` and the gradient flows to it.
        **options: fields of :class:`PolicyLossConfig` by name (``loss="gspo"``, ``clip_low=3e-4``...),
            replacing those of ``config``.

    Returns:
        ``(loss, metrics)``: ``loss`` a 0-d float32 tensor (float64 for float64 inputs),
        differentiable w.r.t. ``logprob`` (and ``entropy``); ``metrics`` a dict of detached 0-d
        tensors over the masked tokens of this call (0 when there are none): ``clip_fraction``,
        ``lower_clip_fraction`` (dual clip active), ``approx_kl`` (mean of ``old - logprob``),
        ``ratio_mean``, ``ratio_max``, and ``entropy_mean`` / ``kl_mean`` when ``entropy`` /
        ``ref_logprob`` are given. No host synchronization.

    An empty mask (or an empty batch) gives loss 0 and zero gradients, never NaN.

    Batch invariance: on backends that promise it (``rlk info``), a row's gradient and its per-row
    partial sums are bitwise independent of the other rows whenever its aggregation weight is
    (``token-sum``, or global normalizers).

    :func:`policy_loss_and_grad` returns the same loss with its gradient, without autograd and
    without the backward's extra pass over the tokens.
    """
    loss_value, _, _, metrics = _policy_loss(
        False,
        logprob,
        old_logprob,
        advantages,
        mask,
        resolve_config(config, options),
        loss_spans=loss_spans,
        span_tags=span_tags,
        importance_weights=importance_weights,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        loss_scale=loss_scale,
        ref_logprob=ref_logprob,
        entropy=entropy,
    )
    return loss_value, metrics


def policy_loss_and_grad(
    logprob: Tensor,
    old_logprob: Tensor | None,
    advantages: Tensor,
    mask: Tensor | None = None,
    *,
    loss_spans: Tensor | None = None,
    span_tags: int | tuple[int, ...] | None = None,
    config: PolicyLossConfig | None = None,
    importance_weights: Tensor | None = None,
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    loss_scale: float | Tensor | None = None,
    ref_logprob: Tensor | None = None,
    entropy: Tensor | None = None,
    **options,
) -> PolicyLossAndGrad:
    """The policy loss and its gradient from one pass over the tokens, without autograd.

    Takes exactly the arguments of :func:`policy_loss` and computes the same loss (bit for bit, on the
    same backend) and metrics, and the gradients ``policy_loss(...)[0].backward()`` would produce
    (bitwise equal: the backward of :func:`policy_loss` multiplies this gradient by the upstream 1).
    ``logprob`` (and ``entropy``) may require grad; they are read detached and nothing is recorded.

    Use it where the loss is the end of the graph and the log-probs come from a differentiable
    computation: ``out = rlk.policy_loss_and_grad(logprob, ...)`` then ``logprob.backward(out.grad_logprob)``
    (with ``torch.autograd.backward([logprob, entropy], [out.grad_logprob, out.grad_entropy])`` when the
    entropy term has a gradient). It moves the ``[B, T]`` inputs once and the gradient once: the autograd
    path of :func:`policy_loss` writes the same gradient in its forward and then reads and rescales it in
    its backward.

    Returns:
        :class:`PolicyLossAndGrad` ``(loss, grad_logprob, grad_entropy, metrics)``: ``loss`` the detached
        0-d loss; ``grad_logprob`` ``d loss / d logprob`` in ``logprob``'s dtype and shape (0 off the mask);
        ``grad_entropy`` ``d loss / d entropy`` in ``entropy``'s dtype when ``entropy_coef != 0``, else None;
        ``metrics`` as :func:`policy_loss`'s.
    """
    loss_value, grad_lp, grad_ent, metrics = _policy_loss(
        True,
        logprob,
        old_logprob,
        advantages,
        mask,
        resolve_config(config, options),
        loss_spans=loss_spans,
        span_tags=span_tags,
        importance_weights=importance_weights,
        global_tokens=global_tokens,
        global_seqs=global_seqs,
        loss_scale=loss_scale,
        ref_logprob=ref_logprob,
        entropy=entropy,
    )
    return PolicyLossAndGrad(loss_value, grad_lp, grad_ent, metrics)


class PolicyLossCall(NamedTuple):
    """One policy-loss call, checked and in canonical form (what :func:`prepare` returns): the ``[B, T]`` inputs
    other than the log-probs (compute dtype, contiguous; ``old`` None for on-policy, then the log-probs themselves),
    and the arguments of ``rlk::policy_loss_fwd`` after its tensors."""

    old: Tensor | None
    advantages: Tensor
    mask: Tensor
    importance_weights: Tensor | None
    ref_logprob: Tensor | None
    with_entropy_grad: bool
    norm_tensors: list[Tensor | None]
    agg: str
    loss: str
    kl: str
    flags: list[bool]
    params: list[float]
    metric_names: list[str]


def prepare(
    shape: tuple[int, int],
    device: torch.device,
    cdt: torch.dtype,
    old_logprob: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    config: PolicyLossConfig,
    *,
    entropy: Tensor | bool | None,
    importance_weights: Tensor | None = None,
    global_tokens: float | Tensor | None = None,
    global_seqs: float | Tensor | None = None,
    loss_scale: float | Tensor | None = None,
    ref_logprob: Tensor | None = None,
) -> PolicyLossCall:
    """Check the tensors of a policy-loss call on ``[B, T] = shape`` log-probs (compute dtype ``cdt``) against each
    other and ``config`` and put them in canonical form; errors name the argument. ``entropy``: the entropy tensor
    (checked here), ``True`` when the caller computes it itself (``fused_linear_policy_loss``), or None. The
    keywords are :func:`policy_loss`'s."""
    b = shape[0]
    if old_logprob is not None:
        _check_tensor("old_logprob", old_logprob, (shape,), device)
    _check_tensor("advantages", advantages, (shape, (b,), (b, 1)), device)
    _check_tensor("mask", mask, (shape,), device, floating=False)
    for name, x in (("importance_weights", importance_weights), ("ref_logprob", ref_logprob), ("entropy", entropy)):
        if x is not None and not (name == "entropy" and x is True):
            _check_tensor(name, x, (shape,), device)
    has_entropy = entropy is not None
    if config.kl_coef != 0 and ref_logprob is None:
        raise ValueError("ref_logprob: required when kl_coef != 0 (the KL term needs the reference log-probs)")
    if config.entropy_coef != 0 and not has_entropy:
        raise ValueError("entropy: required when entropy_coef != 0")
    aggregation.check_agg(config.agg, device, global_tokens, global_seqs, loss_scale)
    norm_tensors = [
        x.detach().reshape(()).to(cdt) if isinstance(x, Tensor) else None
        for x in (global_tokens, global_seqs, loss_scale)
    ]
    norm_numbers = [
        math.nan if x is None or isinstance(x, Tensor) else float(x) for x in (global_tokens, global_seqs, loss_scale)
    ]

    # --- canonical inputs ----------------------------------------------------------------
    mask_bool = mask if mask.dtype == torch.bool else mask != 0
    old = None if old_logprob is None else old_logprob.detach().to(cdt).contiguous()
    adv = advantages.detach().to(cdt).reshape(b, 1 if advantages.dim() == 1 else advantages.shape[1]).contiguous()

    def detached(x: Tensor | None) -> Tensor | None:
        return None if x is None else x.detach().to(cdt).contiguous()

    attrs = config.attrs
    names = ["clip_fraction", "lower_clip_fraction", "approx_kl", "ratio_mean", "ratio_max"]
    if has_entropy:
        names.append("entropy_mean")
    if ref_logprob is not None:
        names.append("kl_mean")
    return PolicyLossCall(
        old,
        adv,
        mask_bool.contiguous(),
        detached(importance_weights),
        detached(ref_logprob),
        has_entropy and config.entropy_coef != 0,
        norm_tensors,
        config.agg,
        config.loss,
        attrs.kl,
        attrs.flags,
        [*attrs.params, *norm_numbers],
        names,
    )


def metrics_dict(call: PolicyLossCall, metrics: Tensor) -> dict[str, Tensor]:
    """The public metrics dict of a call from the forward primitive's ``metrics_out`` (detached 0-d tensors)."""
    values = dict(zip(POLICY_METRICS, metrics.detach().unbind()))
    return {name: values[name] for name in call.metric_names}


def _policy_loss(
    fused: bool,
    logprob: Tensor,
    old_logprob: Tensor | None,
    advantages: Tensor,
    mask: Tensor | None,
    config: PolicyLossConfig,
    *,
    loss_spans: Tensor | None,
    span_tags,
    entropy: Tensor | None,
    **tensors,
) -> tuple[Tensor, Tensor | None, Tensor | None, dict[str, Tensor]]:
    """The body of :func:`policy_loss` (``fused=False``: the loss differentiable, no gradients returned) and
    :func:`policy_loss_and_grad` (``fused=True``: detached loss and the gradients)."""
    if not isinstance(logprob, Tensor):
        raise TypeError(f"logprob: expected a torch.Tensor, got {type(logprob).__name__}")
    if logprob.dim() != 2:
        raise ValueError(f"logprob: expected shape [B, T] (rows are sequences), got {tuple(logprob.shape)}")
    device, shape = logprob.device, tuple(logprob.shape)
    _check_tensor("logprob", logprob, (shape,), device)
    checks.same_dtype(
        ("logprob", logprob),
        ("old_logprob", old_logprob),
        ("advantages", advantages),
        ("importance_weights", tensors.get("importance_weights")),
        ("ref_logprob", tensors.get("ref_logprob")),
        ("entropy", entropy),
    )
    cdt = stat_dtype(logprob)
    mask = spans.mask_of(mask, loss_spans, span_tags, shape, device)
    call = prepare(shape, device, cdt, old_logprob, advantages, mask, config, entropy=entropy, **tensors)
    lp = (logprob.detach() if fused else logprob).to(cdt).contiguous()
    old = lp.detach() if call.old is None else call.old
    with_entropy_grad = call.with_entropy_grad
    ent = None
    if entropy is not None:
        ent = entropy.to(cdt).contiguous() if with_entropy_grad and not fused else entropy.detach().to(cdt).contiguous()
    if lp.numel() == 0:
        zero = lp.sum() * 0.0
        if with_entropy_grad:
            zero = zero + ent.sum() * 0.0
        out_loss, metrics = zero, torch.zeros(len(POLICY_METRICS), dtype=cdt, device=device)
        grad_lp = torch.zeros_like(lp)
        grad_ent = torch.zeros_like(ent) if with_entropy_grad else None
    else:
        out_loss, grad_lp, grad_ent, _, _, metrics = _policy_loss_fwd(
            lp,
            old,
            call.advantages,
            call.mask,
            call.importance_weights,
            call.ref_logprob,
            ent,
            with_entropy_grad,
            *call.norm_tensors,
            call.agg,
            call.loss,
            call.kl,
            call.flags,
            call.params,
        )
    metrics = metrics_dict(call, metrics)
    if not fused:
        return out_loss, None, None, metrics
    grad_lp = grad_lp.to(logprob.dtype)
    grad_ent = grad_ent.to(entropy.dtype) if with_entropy_grad else None
    return out_loss, grad_lp, grad_ent, metrics


# ---------------------------------------------------------------------------
# kl_penalty
# ---------------------------------------------------------------------------


kl_penalty_op = custom_op.declare("kl_penalty")


@kl_penalty_op.forward(outputs=lambda logprob, *_: (torch.empty_like(logprob), torch.empty_like(logprob)))
def _kl_penalty_fwd(
    primitive,
    out,
    logprob: Tensor,
    ref_logprob: Tensor,
    old_logprob: Tensor | None,
    estimator: str,
    straight_through: bool,
    k3_clamp: bool,
    clamp: float,
) -> tuple[Tensor, Tensor]:
    if logprob.numel():
        primitive(
            logprob,
            ref_logprob,
            old_logprob,
            *out,
            estimator=estimator,
            straight_through=straight_through,
            k3_clamp=k3_clamp,
            clamp=clamp,
        )


@kl_penalty_op.backward_primitive(outputs=lambda grad_kl, coef: torch.empty_like(coef))
def _kl_penalty_bwd(primitive, out, grad_kl: Tensor, coef: Tensor) -> Tensor:
    if coef.numel():
        primitive(grad_kl, coef, out)


def _save_kl(ctx, inputs, output):
    _, coef = output
    ctx.save_for_backward(coef)
    ctx.mark_non_differentiable(coef)
    ctx.set_materialize_grads(False)


def _backward_kl(ctx, grad_kl, grad_coef):
    (coef,) = ctx.saved_tensors
    if grad_kl is None:
        return {}
    return {"logprob": kl_penalty_op.backward(ctx, grad_kl.to(coef.dtype).contiguous(), coef)}


kl_penalty_op.autograd(save=_save_kl, backward=_backward_kl)


def kl_penalty(
    logprob: Tensor,
    ref_logprob: Tensor,
    estimator: str,
    *,
    straight_through: bool = False,
    clamp: float | None = None,
    k3_clamp: bool = True,
    old_logprob: Tensor | None = None,
    loss_spans: Tensor | None = None,
    span_tags: int | tuple[int, ...] | None = None,
) -> Tensor:
    """Per-token KL estimate between the policy and a reference, differentiable w.r.t. ``logprob``.

    With ``delta = logprob - ref_logprob`` (math: :mod:`rlk.reference.policy_loss`):

    * ``"k1"`` (alias ``"kl"``): ``delta``;
    * ``"abs"``: ``|delta|``;
    * ``"k2"`` (alias ``"mse"``): ``delta^2 / 2``;
    * ``"k3"`` (alias ``"low_var_kl"``): ``exp(-delta) - 1 + delta``. With ``k3_clamp`` (the
      default, verl's form) ``x = clamp(-delta, -20, 20)`` and the value is
      ``clamp(exp(x) - x - 1, -10, 10)``; ``k3_clamp=False`` is the plain estimator (TRL).

    Args:
        logprob: ``[...]`` float32 (bf16 / fp16 upcast); the gradient flows to it.
        ref_logprob: same shape, detached; float64 exactly when ``logprob`` is (so is ``old_logprob``).
        estimator: one of the names above; a trailing ``"+"`` (verl's ``"k3+"``) is the same as
            ``straight_through=True``.
        straight_through: the value of the estimator with the gradient of k2
            (``k2 - sg(k2) + sg(k)``: ``d/d logprob = delta``).
        clamp: clamp the estimator value to ``[-clamp, clamp]`` (OpenRLHF uses 10), zero
            gradient outside; None: no clamp. Applied after ``k3_clamp``, before the
            straight-through gradient and the importance weight.
        k3_clamp: verl's clamps of k3 (ignored by the other estimators).
        old_logprob: when given, the importance-weighted (unbiased, slime's
            ``--use-unbiased-kl``) estimate ``sg(exp(logprob - old_logprob)) * k``: the weight is
            detached, so the gradient is ``weight * dk/d logprob``.
        loss_spans, span_tags: as in :func:`policy_loss` (``[B, T]`` inputs): positions outside the spans give 0
            and no gradient, even when they hold ``-inf`` or NaN (their inputs are replaced by 0 before the
            estimator, which is 0 at ``delta = 0``).

    Returns:
        fp32 tensor of ``logprob``'s shape (fp64 for fp64 inputs). Without ``loss_spans`` no masking: multiply or
        ``where`` by your mask afterwards.
    """
    if not isinstance(logprob, Tensor):
        raise TypeError(f"logprob: expected a torch.Tensor, got {type(logprob).__name__}")
    shape, device = tuple(logprob.shape), logprob.device
    _check_tensor("logprob", logprob, (shape,), device)
    _check_tensor("ref_logprob", ref_logprob, (shape,), device)
    if old_logprob is not None:
        _check_tensor("old_logprob", old_logprob, (shape,), device)
    checks.same_dtype(("logprob", logprob), ("ref_logprob", ref_logprob), ("old_logprob", old_logprob))
    name, straight = _kl_spec("estimator", estimator)
    straight_through = checks.flag("straight_through", straight_through)
    k3_clamp = checks.flag("k3_clamp", k3_clamp)
    clamp_value = _INF if clamp is None else checks.number("clamp", clamp, above=0.0)
    cdt = stat_dtype(logprob)
    lp = logprob.to(cdt).reshape(-1).contiguous()
    ref = ref_logprob.detach().to(cdt).reshape(-1).contiguous()
    old = None if old_logprob is None else old_logprob.detach().to(cdt).reshape(-1).contiguous()
    spans.no_tags_without_spans(loss_spans, span_tags)
    if loss_spans is not None:
        scored = spans.loss_mask(loss_spans, span_tags, shape, device, "logprob").reshape(-1)
        lp, ref = torch.where(scored, lp, 0.0), torch.where(scored, ref, 0.0)
        old = None if old is None else torch.where(scored, old, 0.0)
    kl, _ = _kl_penalty_fwd(lp, ref, old, name, straight or straight_through, k3_clamp, clamp_value)
    return kl.view(shape)
