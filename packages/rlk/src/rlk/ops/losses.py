"""Public loss ops: ``value_loss`` (PPO critic) and ``dpo_loss`` (DPO family).

Each op is two ``torch.library.custom_op`` primitives (``rlk::<op>_fwd`` and ``rlk::<op>_bwd``)
with fake implementations, so the ops trace under ``torch.compile(fullgraph=True)``, and one
``register_autograd`` that calls the backward primitive on the backend that served the forward.
The math is specified in :mod:`rlk.reference.losses`; the aggregation modes of ``value_loss``
in :mod:`rlk.reference.aggregation`.

Inputs may be bfloat16, float16 or float32 (upcast to float32 here; gradients come back in the
input's dtype) or float64 (computed in float64 by the reference backend: ground truth), float64 for
all of a call's floating inputs or none (:func:`rlk.core.checks.same_dtype`). Masks may be bool or 0/1
numbers (nonzero counts as a token). Nothing here synchronizes with the device (normalizers may be
tensors, metrics come back as device tensors) but the value checks of ``dpo_loss``'s IPO lengths.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlk.core import checks, custom_op
from rlk.core.abi import DPO_LOSSES
from rlk.ops import spans
from rlk.reference import aggregation

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_REDUCTIONS = ("mean", "sum", "none")


# ---------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------


def _check_tensor(name: str, x, shape: torch.Size | None, device: torch.device | None, what: str) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"{name}: expected dtype bfloat16, float16 or float32 (float64 for reference runs), got {x.dtype}"
        )
    _check_like(name, x, shape, device, what)


def _check_like(name: str, x: Tensor, shape: torch.Size | None, device: torch.device | None, what: str) -> None:
    if shape is not None and x.shape != shape:
        raise ValueError(f"{name}: expected shape {tuple(shape)} (the shape of {what}), got {tuple(x.shape)}")
    if device is not None and x.device != device:
        raise ValueError(f"{name}: expected device {device} (the device of {what}), got {x.device}")


def _check_mask(mask, shape: torch.Size, device: torch.device) -> None:
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask: expected a torch.Tensor, got {type(mask).__name__}")
    if mask.is_complex():
        raise TypeError(f"mask: expected dtype bool or 0/1 numbers, got {mask.dtype}")
    _check_like("mask", mask, shape, device, "values")


# ---------------------------------------------------------------------------
# value_loss
# ---------------------------------------------------------------------------


value_loss_op = custom_op.declare("value_loss")


@value_loss_op.forward(outputs=lambda values, *_: (values.new_zeros(()), values.new_zeros((2,))))
def _value_loss_fwd(
    primitive,
    out,
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    row_weight: Tensor,
    clip: float | None,
    tensor_normalizers: str,
) -> tuple[Tensor, Tensor]:
    """``tensor_normalizers``: the names of the normalizers given as tensors ("" if none), whose values reach the op
    only through ``row_weight``: checked there (one synchronization; numbers were checked at the call)."""
    if values.numel() == 0:
        return
    if tensor_normalizers and checks.values_checked():
        bad = ~(row_weight > 0) | torch.isinf(row_weight)
        if bool(bad.any()):
            i = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"{tensor_normalizers}: must be finite and > 0; the aggregation weight they give row {i} "
                f"is {float(row_weight[i])}"
            )
    primitive(values, old_values, returns, mask, row_weight, clip, *out)


@value_loss_op.backward_primitive(outputs=lambda values, *_: torch.zeros_like(values))
def _value_loss_bwd(
    primitive,
    out,
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    row_weight: Tensor,
    clip: float | None,
    grad_loss: Tensor,
) -> Tensor:
    if values.numel():
        primitive(values, old_values, returns, mask, row_weight, clip, grad_loss, out)


def _save_value(ctx, inputs, output):
    ctx.save_for_backward(inputs.values, inputs.old_values, inputs.returns, inputs.mask, inputs.row_weight)
    ctx.clip = inputs.clip


def _backward_value(ctx, grad_loss, grad_metrics):
    values, old_values, returns, mask, row_weight = ctx.saved_tensors
    if grad_loss is None or not ctx.needs_input_grad[0]:
        return {}
    grad_values = value_loss_op.backward(
        ctx, values, old_values, returns, mask, row_weight, ctx.clip, grad_loss.to(values.dtype).contiguous()
    )
    return {"values": grad_values}


value_loss_op.autograd(save=_save_value, backward=_backward_value)


def value_loss(
    values: Tensor,
    old_values: Tensor | None,
    returns: Tensor,
    mask: Tensor | None = None,
    *,
    clip: float | None = 0.5,
    agg: str = "token-mean",
    global_tokens: int | float | Tensor | None = None,
    global_seqs: int | float | Tensor | None = None,
    loss_scale: int | float | Tensor | None = None,
    loss_spans: Tensor | None = None,
    span_tags: int | tuple[int, ...] | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO critic (value) loss with value clipping, aggregated over masked tokens.

    Per token, with ``eps = clip``::

        L = max((v - R)^2, (clamp(v, v_old - eps, v_old + eps) - R)^2)       (L = (v - R)^2 if clip is None)
        loss = 0.5 * agg(L)

    ``agg`` is one of ``token-mean``, ``token-sum``, ``seq-mean-token-sum``,
    ``seq-mean-token-mean``, ``seq-mean-token-sum-norm`` with the normalizers
    ``global_tokens`` / ``global_seqs`` (whole optimizer step, all micro-batches and ranks; by
    default the call's own counts) and ``loss_scale`` (``seq-mean-token-sum-norm`` only); see
    :mod:`rlk.reference.aggregation` for the formulas. With global normalizers, the losses (and
    gradients) of micro-batches add up to those of the whole batch.

    Args:
        values: ``[B, T]`` current value predictions (bfloat16, float16 or float32; ``old_values`` and
            ``returns`` float64 exactly when it is).
        old_values: ``[B, T]`` values at rollout time (constant); may be None when ``clip`` is None.
        returns: ``[B, T]`` value targets (constant).
        mask: ``[B, T]`` bool or 0/1; masked-out positions may hold anything (inf, NaN).
        clip: clip range ``eps >= 0``, or None for the unclipped loss.
        agg, global_tokens, global_seqs, loss_scale: the aggregation.
        loss_spans: instead of ``mask``, an int ``[S, 4]`` span table of the loss tokens (``rlk.multimodal``'s rows
            ``(sequence, start, end, tag)``, or ``[S, 3]``; on the device or the CPU), as in :func:`rlk.policy_loss`.
            Give ``mask`` or ``loss_spans``, not both.
        span_tags: only the rows of ``loss_spans`` tagged one of these count; None: every row.

    Returns:
        ``(loss, metrics)``: ``loss`` a float32 0-d tensor, differentiable w.r.t. ``values`` only
        (``d loss / d v = c_i (v - R)`` on masked, unclipped tokens, ``c_i`` the row's aggregation
        weight; 0 where the clipped branch is larger); ``metrics`` float32 0-d tensors over the
        call's masked tokens: ``vf_clip_fraction`` (share of tokens where the clipped loss is the
        larger) and ``values_mean``. An empty mask gives a loss of 0 and metrics of 0.

    Batch invariance: each row's gradient depends only on that row and its weight ``c_i``
    (bitwise, on backends that promise it, when the normalizers are fixed).
    """
    _check_tensor("values", values, None, None, "values")
    if values.dim() != 2:
        raise ValueError(f"values: expected shape [B, T], got {tuple(values.shape)}")
    _check_tensor("returns", returns, values.shape, values.device, "values")
    mask = spans.mask_of(mask, loss_spans, span_tags, tuple(values.shape), values.device, "values")
    _check_mask(mask, values.shape, values.device)
    if clip is not None:
        clip = checks.number("clip", clip, minimum=0.0)
        if old_values is None:
            raise ValueError("old_values: needed when clip is set (pass clip=None for the unclipped loss)")
    if old_values is not None:
        _check_tensor("old_values", old_values, values.shape, values.device, "values")
    checks.same_dtype(("values", values), ("old_values", old_values), ("returns", returns))
    cdt = checks.stat_dtype(values)
    weights = aggregation.row_weights(
        mask, agg, global_tokens=global_tokens, global_seqs=global_seqs, loss_scale=loss_scale, dtype=cdt
    )
    v = values.to(cdt).contiguous()
    v_old = v.detach() if old_values is None or clip is None else old_values.detach().to(cdt).contiguous()
    loss, metrics = _value_loss_fwd(
        v,
        v_old,
        returns.detach().to(cdt).contiguous(),
        (mask if mask.dtype == torch.bool else mask != 0).contiguous(),
        weights.contiguous(),
        None if clip is None else float(clip),
        ", ".join(
            name
            for name, x in (("global_tokens", global_tokens), ("global_seqs", global_seqs), ("loss_scale", loss_scale))
            if isinstance(x, Tensor)
        ),
    )
    metrics = metrics.detach()
    return loss, {"vf_clip_fraction": metrics[0], "values_mean": metrics[1]}


# ---------------------------------------------------------------------------
# dpo_loss
# ---------------------------------------------------------------------------


def _dpo_fwd_outputs(chosen: Tensor, *_) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(chosen), chosen.new_zeros(()), chosen.new_zeros((4,))


def _dpo_bwd_outputs(chosen: Tensor, rejected: Tensor, *_) -> tuple[Tensor, Tensor]:
    return torch.zeros_like(chosen), torch.zeros_like(rejected)


dpo_loss_op = custom_op.declare("dpo_loss")


@dpo_loss_op.forward(outputs=_dpo_fwd_outputs)
def _dpo_loss_fwd(
    primitive,
    out,
    chosen: Tensor,
    rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    len_chosen: Tensor | None,
    len_rejected: Tensor | None,
    beta: float,
    loss_type: str,
    label_smoothing: float,
    mean: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    if chosen.numel():
        checks.check_count_values({"chosen_length": len_chosen, "rejected_length": len_rejected})
        primitive(
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
            *out,
        )


@dpo_loss_op.backward_primitive(outputs=_dpo_bwd_outputs)
def _dpo_loss_bwd(
    primitive,
    out,
    chosen: Tensor,
    rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    len_chosen: Tensor | None,
    len_rejected: Tensor | None,
    beta: float,
    loss_type: str,
    label_smoothing: float,
    mean: bool,
    grad_losses: Tensor | None,
    grad_loss: Tensor | None,
) -> tuple[Tensor, Tensor]:
    if chosen.numel() == 0 or (grad_losses is None and grad_loss is None):
        return
    primitive(
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
        *out,
    )


def _save_dpo(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:6])  # chosen, rejected, ref_chosen, ref_rejected, len_chosen, len_rejected
    ctx.attrs = (inputs.beta, inputs.loss_type, inputs.label_smoothing, inputs.mean)


def _backward_dpo(ctx, grad_losses, grad_loss, grad_metrics):
    chosen, rejected, ref_chosen, ref_rejected, len_chosen, len_rejected = ctx.saved_tensors
    if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
        return {}
    if grad_losses is not None:
        grad_losses = grad_losses.to(chosen.dtype).contiguous()
    if grad_loss is not None:
        grad_loss = grad_loss.to(chosen.dtype).contiguous()
    grad_chosen, grad_rejected = dpo_loss_op.backward(
        ctx, chosen, rejected, ref_chosen, ref_rejected, len_chosen, len_rejected, *ctx.attrs, grad_losses, grad_loss
    )
    return {
        "chosen": grad_chosen if ctx.needs_input_grad[0] else None,
        "rejected": grad_rejected if ctx.needs_input_grad[1] else None,
    }


dpo_loss_op.autograd(save=_save_dpo, backward=_backward_dpo)


def _check_length(name: str, length, shape: torch.Size, device: torch.device) -> None:
    if not isinstance(length, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor of token counts, got {type(length).__name__}")
    if length.dtype == torch.bool or length.is_complex():
        raise TypeError(f"{name}: expected an integer or floating tensor of token counts, got {length.dtype}")
    _check_like(name, length, shape, device, "chosen_logprob")


def dpo_loss(
    chosen_logprob: Tensor,
    rejected_logprob: Tensor,
    ref_chosen_logprob: Tensor,
    ref_rejected_logprob: Tensor,
    *,
    beta: float = 0.1,
    loss: str = "sigmoid",
    label_smoothing: float = 0.0,
    chosen_length: Tensor | None = None,
    rejected_length: Tensor | None = None,
    reduction: str = "mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """DPO-family preference loss from per-pair sequence log-probs.

    With ``x = (lc - lr) - (lc_ref - lr_ref)``, ``u = beta * x``, ``eps = label_smoothing``::

        sigmoid: -(1 - eps) logsigmoid(u) - eps logsigmoid(-u)     (eps = 0: DPO; eps > 0: conservative DPO)
        hinge:   relu(1 - u)
        ipo:     (x - 1 / (2 beta))^2, every log-prob divided by its completion length first
        robust:  (-(1 - eps) logsigmoid(u) + eps logsigmoid(-u)) / (1 - 2 eps)

    Args:
        chosen_logprob, rejected_logprob: ``[P]`` policy sequence log-probs (sums of the masked
            token log-probs of each completion); the differentiable inputs.
        ref_chosen_logprob, ref_rejected_logprob: ``[P]`` reference-model sequence log-probs
            (constants).
        beta: ``> 0`` (default 0.1), nonzero and finite in float32; for ``ipo`` so that
            ``(1 / (2 beta))^2`` is finite in float32 (``beta`` above about ``2.7e-20``).
        loss: ``sigmoid`` (default), ``hinge``, ``ipo`` or ``robust``.
        label_smoothing: ``eps``: in ``[0, 0.5]`` for ``sigmoid``, ``[0, 0.5)`` for ``robust``;
            must be 0 for ``hinge`` and ``ipo``.
        chosen_length, rejected_length: ``[P]`` completion lengths in tokens; required by ``ipo``
            (values below 1 count as 1), ignored by the other losses. Finite and ``>= 0``, checked
            inside the op for ``ipo`` (one host synchronization; ``RLK_CHECK_VALUES=0`` skips it).
        reduction: ``mean`` (default), ``sum`` or ``none`` (per-pair losses ``[P]``).

    Returns:
        ``(loss, metrics)``: ``loss`` float32, differentiable w.r.t. ``chosen_logprob`` and
        ``rejected_logprob``; ``metrics`` float32 0-d tensors, means over the pairs:
        ``rewards_chosen = beta (lc - lc_ref)``, ``rewards_rejected = beta (lr - lr_ref)``,
        ``reward_margin`` (their difference) and ``reward_accuracy`` (share of pairs with
        ``rewards_chosen > rewards_rejected``). For ``ipo`` the rewards use the
        length-normalized log-probs, as the loss does. No pairs give a loss of 0 and metrics of 0.
    """
    _check_tensor("chosen_logprob", chosen_logprob, None, None, "chosen_logprob")
    if chosen_logprob.dim() != 1:
        raise ValueError(
            f"chosen_logprob: expected shape [P] (one log-prob per pair), got {tuple(chosen_logprob.shape)}"
        )
    shape, device = chosen_logprob.shape, chosen_logprob.device
    for name, x in (
        ("rejected_logprob", rejected_logprob),
        ("ref_chosen_logprob", ref_chosen_logprob),
        ("ref_rejected_logprob", ref_rejected_logprob),
    ):
        _check_tensor(name, x, shape, device, "chosen_logprob")
    checks.same_dtype(
        ("chosen_logprob", chosen_logprob),
        ("rejected_logprob", rejected_logprob),
        ("ref_chosen_logprob", ref_chosen_logprob),
        ("ref_rejected_logprob", ref_rejected_logprob),
    )
    if loss not in DPO_LOSSES:
        raise ValueError(f"loss: expected one of {', '.join(repr(v) for v in DPO_LOSSES)}, got {loss!r}")
    beta = checks.number("beta", beta, above=0.0, dtype=torch.float32)
    if loss == "ipo":
        target = 0.5 / beta
        if not math.isfinite(torch.tensor(target * target, dtype=torch.float64).to(torch.float32).item()):
            raise ValueError(
                f"beta: {beta:.4g} is so small that the ipo loss (x - 1 / (2 beta))^2 overflows float32 "
                f"(1 / (2 beta) = {target:.4g})"
            )
    label_smoothing = checks.number("label_smoothing", label_smoothing, minimum=0.0)
    if loss in ("hinge", "ipo") and label_smoothing != 0:
        raise ValueError(f"label_smoothing: loss={loss!r} has no label smoothing; got {label_smoothing}")
    if loss == "sigmoid" and label_smoothing > 0.5:
        raise ValueError(f"label_smoothing: must lie in [0, 0.5] for loss='sigmoid', got {label_smoothing}")
    if loss == "robust" and label_smoothing >= 0.5:
        raise ValueError(f"label_smoothing: must lie in [0, 0.5) for loss='robust', got {label_smoothing}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction: expected one of {', '.join(repr(r) for r in _REDUCTIONS)}, got {reduction!r}")
    if loss == "ipo" and (chosen_length is None or rejected_length is None):
        missing = " and ".join(
            n for n, t in (("chosen_length", chosen_length), ("rejected_length", rejected_length)) if t is None
        )
        raise ValueError(
            f"{missing}: loss='ipo' normalizes the log-probs by the completion lengths; pass "
            "chosen_length and rejected_length ([P] token counts)"
        )
    for name, length in (("chosen_length", chosen_length), ("rejected_length", rejected_length)):
        if length is not None:
            _check_length(name, length, shape, device)
    cdt = checks.stat_dtype(chosen_logprob)
    lengths = (None, None)
    if loss == "ipo":
        lengths = (chosen_length.detach().to(cdt).contiguous(), rejected_length.detach().to(cdt).contiguous())
    losses, total, metrics = _dpo_loss_fwd(
        chosen_logprob.to(cdt).contiguous(),
        rejected_logprob.to(cdt).contiguous(),
        ref_chosen_logprob.detach().to(cdt).contiguous(),
        ref_rejected_logprob.detach().to(cdt).contiguous(),
        *lengths,
        float(beta),
        loss,
        float(label_smoothing),
        reduction == "mean",
    )
    metrics = metrics.detach()
    names = ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy")
    return (losses if reduction == "none" else total), {name: metrics[k] for k, name in enumerate(names)}
