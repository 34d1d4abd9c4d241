"""Public distillation op: ``fused_linear_kl``, a divergence between a student's and a teacher's next-token
distributions straight from their hidden states and LM heads, never materializing either ``[N, V]`` logits.

Two custom ops (``rlk::fused_linear_kl_fwd`` / ``_bwd``) with fakes and one ``register_autograd``. For the
``mean`` / ``sum`` reductions the forward primitive also computes the gradients (the loss is a scalar) and the
backward only scales them by the upstream gradient; ``none`` recomputes in the backward. Spec:
:mod:`rlk.reference.distill`; the conventions are in ``docs/distill.md``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlk.core import checks, custom_op
from rlk.core.abi import DIVERGENCES
from rlk.core.checks import check_float
from rlk.ops.logprob import _check_targets, _inv_temperature, _linear_bwd_outputs

REDUCTIONS = ("mean", "sum", "none")

#: Elements per step when a saved 16-bit gradient is scaled by the upstream gradient in fp32 (64 MiB of fp32
#: scratch at a time instead of a copy of the whole ``[V, H]`` weight gradient).
_SCALE_CHUNK = 1 << 24


def _valid_rows(targets: Tensor | None, ignore_index: int, n_rows: int, like: Tensor) -> Tensor:
    if targets is None:
        return torch.ones(n_rows, dtype=torch.bool, device=like.device)
    return targets != ignore_index


def _zero_ignored(hidden: Tensor, targets: Tensor | None, ignore_index: int) -> Tensor:
    """``hidden`` with the ignored rows zeroed: their gradient coefficient is 0, and ``grad_weight = G.T @ hidden``
    must not turn NaN or inf there (padding) into ``0 * NaN``."""
    if targets is None:
        return hidden
    return torch.where((targets != ignore_index)[:, None], hidden, hidden.new_zeros(()))


def _fwd_outputs(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    targets: Tensor | None,
    inv_temperature: Tensor,
    ignore_index: int,
    divergence: str,
    beta: float,
    reduction: str,
    need_grad_hidden: bool,
    need_grad_weight: bool,
    check_temperature: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """``(loss, stats, grad_hidden, grad_weight)``; the gradients are computed by the forward for ``mean`` / ``sum``
    (placeholders otherwise, or when not needed)."""
    fused = reduction != "none"
    n_rows = student_hidden.shape[0]
    dtype = checks.stat_dtype(student_hidden)
    loss = student_hidden.new_empty((n_rows,) if reduction == "none" else (), dtype=dtype)
    stats = student_hidden.new_empty((3, n_rows), dtype=dtype)
    grad_hidden = (
        torch.empty_like(student_hidden) if fused and need_grad_hidden else custom_op.placeholder(student_hidden)
    )
    grad_weight = (
        torch.empty_like(student_weight) if fused and need_grad_weight else custom_op.placeholder(student_weight)
    )
    return loss, stats, grad_hidden, grad_weight


fused_linear_kl_op = custom_op.declare("fused_linear_kl")


@fused_linear_kl_op.forward(outputs=_fwd_outputs)
def _fused_linear_kl_fwd(
    primitive,
    out,
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    targets: Tensor | None,
    inv_temperature: Tensor,
    ignore_index: int,
    divergence: str,
    beta: float,
    reduction: str,
    need_grad_hidden: bool,
    need_grad_weight: bool,
    check_temperature: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    fused = reduction != "none"
    loss, stats, grad_hidden, grad_weight = out
    n_rows = student_hidden.shape[0]
    if n_rows == 0:
        loss.zero_()
        grad_weight.zero_()
        return
    if check_temperature:  # a tensor's values (one synchronization); a number was checked by the caller
        checks.check_positive_values("temperature", inv_temperature, reciprocal=True)
    valid = _valid_rows(targets, ignore_index, n_rows, student_hidden)
    count = valid.sum().clamp(min=1).to(loss.dtype)
    coef = None
    if fused and (need_grad_hidden or need_grad_weight):
        coef = valid.to(loss.dtype)
        if reduction == "mean":
            coef = coef / count
        if need_grad_weight:
            student_hidden = _zero_ignored(student_hidden, targets, ignore_index)
    row_loss = loss if reduction == "none" else student_hidden.new_empty((n_rows,), dtype=loss.dtype)
    primitive(
        student_hidden,
        student_weight,
        teacher_hidden,
        teacher_weight,
        targets,
        inv_temperature,
        ignore_index,
        divergence,
        beta,
        row_loss,
        stats,
        coef,
        grad_hidden if coef is not None and need_grad_hidden else None,
        grad_weight if coef is not None and need_grad_weight else None,
    )
    if reduction == "sum":
        loss.copy_(row_loss.sum())
    elif reduction == "mean":
        loss.copy_(row_loss.sum() / count)


@fused_linear_kl_op.backward_primitive(outputs=_linear_bwd_outputs)
def _fused_linear_kl_bwd(
    primitive,
    out,
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    targets: Tensor | None,
    inv_temperature: Tensor,
    stats: Tensor,
    grad_loss: Tensor,
    ignore_index: int,
    divergence: str,
    beta: float,
    need_grad_hidden: bool,
    need_grad_weight: bool,
) -> tuple[Tensor, Tensor]:
    grad_hidden, grad_weight = out
    if student_hidden.shape[0] == 0:
        grad_weight.zero_()
        return
    if need_grad_weight:
        student_hidden = _zero_ignored(student_hidden, targets, ignore_index)
    if need_grad_hidden or need_grad_weight:
        primitive(
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
            grad_hidden if need_grad_hidden else None,
            grad_weight if need_grad_weight else None,
        )


def _save(ctx, inputs, output):
    _, stats, grad_hidden, grad_weight = output
    ctx.mark_non_differentiable(stats, grad_hidden, grad_weight)
    ctx.set_materialize_grads(False)
    ctx.reduction, ctx.ignore_index, ctx.divergence, ctx.beta = (
        inputs.reduction,
        inputs.ignore_index,
        inputs.divergence,
        inputs.beta,
    )
    if inputs.reduction == "none":
        ctx.save_for_backward(
            inputs.student_hidden,
            inputs.student_weight,
            inputs.teacher_hidden,
            inputs.teacher_weight,
            inputs.targets,
            inputs.inv_temperature,
            stats,
        )
    else:
        ctx.save_for_backward(grad_hidden, grad_weight)


def _scaled(grad: Tensor, scale: Tensor) -> Tensor:
    """``grad * scale`` (``scale`` a 0-dim fp32 / fp64 tensor) computed in ``scale``'s dtype and rounded once to
    ``grad``'s dtype, a chunk of rows at a time: a 16-bit product would round ``scale`` to 16 bits first."""
    if grad.dtype == scale.dtype or grad.numel() == 0:
        return grad * scale
    out = torch.empty_like(grad)
    rows = max(1, _SCALE_CHUNK // max(1, grad.shape[-1]))
    for r0 in range(0, grad.shape[0], rows):
        out[r0 : r0 + rows] = grad[r0 : r0 + rows].to(scale.dtype) * scale
    return out


def _backward(ctx, grad_loss, grad_stats, grad_grad_hidden, grad_grad_weight):
    if grad_loss is None:
        return {}
    need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if ctx.reduction == "none":
        student_hidden, student_weight, teacher_hidden, teacher_weight, targets, inv_temperature, stats = (
            ctx.saved_tensors
        )
        grad_hidden, grad_weight = fused_linear_kl_op.backward(
            ctx,
            student_hidden,
            student_weight,
            teacher_hidden,
            teacher_weight,
            targets,
            inv_temperature,
            stats,
            grad_loss.to(stats.dtype).contiguous(),
            ctx.ignore_index,
            ctx.divergence,
            ctx.beta,
            need_hidden,
            need_weight,
        )
    else:
        grad_hidden, grad_weight = ctx.saved_tensors
        scale = grad_loss.to(checks.stat_dtype(grad_hidden))
        grad_hidden = _scaled(grad_hidden, scale) if need_hidden else None
        grad_weight = _scaled(grad_weight, scale) if need_weight else None
    return {
        "student_hidden": grad_hidden if need_hidden else None,
        "student_weight": grad_weight if need_weight else None,
    }


fused_linear_kl_op.autograd(save=_save, backward=_backward)


def _check_teacher_frozen(name: str, x: Tensor) -> None:
    if torch.is_grad_enabled() and x.requires_grad:
        raise ValueError(
            f"{name}: requires grad, but rlk.fused_linear_kl treats the teacher as frozen and computes no gradient "
            f"for it; pass {name}.detach() (or run the teacher under torch.no_grad())"
        )


def fused_linear_kl(
    student_hidden: Tensor,
    student_weight: Tensor,
    teacher_hidden: Tensor,
    teacher_weight: Tensor,
    targets: Tensor | None = None,
    *,
    divergence: str = "forward_kl",
    beta: float = 0.5,
    temperature: float | Tensor = 1.0,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> Tensor:
    """Divergence between the teacher's and the student's next-token distributions, logits never materialized.

    Per row: ``q = softmax(student_hidden @ student_weight.T / T)`` (student), ``p = softmax(teacher_hidden @
    teacher_weight.T / T)`` (teacher), and

    * ``"forward_kl"``: ``KL(p || q) = sum_v p_v log(p_v / q_v)``;
    * ``"reverse_kl"``: ``KL(q || p)``;
    * ``"jsd"``: ``beta KL(p || m) + (1 - beta) KL(q || m)`` with ``m = beta p + (1 - beta) q``. This is 0 for any
      inputs at ``beta = 0`` (m = q) and ``beta = 1`` (m = p); there, as in TRL's GKD and Liger-Kernel, ``beta = 0``
      means ``forward_kl`` and ``beta = 1`` ``reverse_kl`` (the limits of the JSD divided by ``beta`` and by
      ``1 - beta``): the loss jumps at the two ends.

    Args:
        student_hidden: ``[..., Hs]`` bfloat16, float16 or float32 (float64: reference-only ground truth).
        student_weight: ``[V, Hs]``, the student's LM head, same dtype.
        teacher_hidden: ``[..., Ht]`` with the leading shape of ``student_hidden`` (``Ht`` may differ), same dtype.
        teacher_weight: ``[V, Ht]``, the teacher's LM head (same ``V``), same dtype.
        targets: ``[...]`` int32 / int64 labels or None; only compared with ``ignore_index`` (rows equal to it get
            loss 0 and no gradient and are left out of the mean). None: every row counts.
        divergence: ``"forward_kl"``, ``"reverse_kl"`` or ``"jsd"``.
        beta: the JSD's weight of the teacher, in ``[0, 1]`` (unused by the KLs).
        temperature: ``T > 0``, a float or a tensor broadcastable to the leading shape; both logits are divided by
            it (no ``T**2`` factor). Not differentiable.
        ignore_index: the ignored-row marker in ``targets``.
        reduction: ``"mean"`` (over the rows that are not ignored; 0 when there are none), ``"sum"``, or ``"none"``
            (per row, shape ``student_hidden.shape[:-1]``).

    Returns:
        fp32 (fp64 for fp64 inputs) loss, differentiable w.r.t. ``student_hidden`` and ``student_weight``. The
        teacher is frozen: a teacher tensor that requires grad (with grad mode on) is an error; pass it detached.

    Memory and passes: nothing of size ``[N, V]`` exists. The vocab is walked in tiles with online
    (max, sum) states; the JSD needs a second pass (after both logsumexps). For ``mean`` / ``sum`` with a
    gradient to compute, the forward also sweeps once more to form ``grad_hidden`` / ``grad_weight`` (kept
    until the backward, which scales them by the upstream gradient); ``none`` recomputes them in the backward.
    Batch invariance (on backends that promise it): a row's loss, and its ``grad_hidden`` under ``sum`` or
    ``none``, do not depend on the other rows; ``grad_weight`` is deterministic.
    """
    for name, x in (
        ("student_hidden", student_hidden),
        ("student_weight", student_weight),
        ("teacher_hidden", teacher_hidden),
        ("teacher_weight", teacher_weight),
    ):
        check_float(name, x)
    if student_hidden.dim() < 1 or student_hidden.shape[-1] == 0:
        raise ValueError(f"student_hidden: expected shape [..., Hs] with Hs >= 1, got {tuple(student_hidden.shape)}")
    hs = student_hidden.shape[-1]
    if student_weight.dim() != 2 or student_weight.shape[0] == 0 or student_weight.shape[1] != hs:
        raise ValueError(
            f"student_weight: expected shape [V, Hs] with V >= 1 and Hs = {hs} (student_hidden's last "
            f"dim), got {tuple(student_weight.shape)}"
        )
    lead = student_hidden.shape[:-1]
    if teacher_hidden.dim() < 1 or teacher_hidden.shape[:-1] != lead or teacher_hidden.shape[-1] == 0:
        raise ValueError(
            f"teacher_hidden: expected shape [{', '.join(map(str, lead))}{', ' if lead else ''}Ht] "
            f"(student_hidden's leading shape) with Ht >= 1, got {tuple(teacher_hidden.shape)}"
        )
    vocab, ht = student_weight.shape[0], teacher_hidden.shape[-1]
    if teacher_weight.dim() != 2 or teacher_weight.shape != (vocab, ht):
        raise ValueError(
            f"teacher_weight: expected shape [V, Ht] = [{vocab}, {ht}] (V of student_weight, Ht of "
            f"teacher_hidden), got {tuple(teacher_weight.shape)}"
        )
    checks.same_dtype(
        ("student_hidden", student_hidden),
        ("student_weight", student_weight),
        ("teacher_hidden", teacher_hidden),
        ("teacher_weight", teacher_weight),
        exact=True,
    )
    for name, x in (
        ("student_weight", student_weight),
        ("teacher_hidden", teacher_hidden),
        ("teacher_weight", teacher_weight),
    ):
        if x.device != student_hidden.device:
            raise ValueError(
                f"{name}: expected device {student_hidden.device} (the device of student_hidden), got {x.device}"
            )
    _check_teacher_frozen("teacher_hidden", teacher_hidden)
    _check_teacher_frozen("teacher_weight", teacher_weight)
    divergence = checks.choice("divergence", divergence, DIVERGENCES)
    reduction = checks.choice("reduction", reduction, REDUCTIONS)
    beta = checks.number("beta", beta, minimum=0.0, maximum=1.0)
    if divergence == "jsd" and beta in (0.0, 1.0):
        divergence = "forward_kl" if beta == 0.0 else "reverse_kl"
    ignore_index = checks.integer("ignore_index", ignore_index)
    if targets is not None:
        _check_targets(targets, lead, "student_hidden", student_hidden.device)
        targets = targets.reshape(-1).to(torch.int64).contiguous()
    inv_t = _inv_temperature(temperature, lead, student_hidden.device, checks.stat_dtype(student_hidden))
    grad_on = torch.is_grad_enabled()
    loss, _, _, _ = _fused_linear_kl_fwd(
        student_hidden.reshape(-1, hs).contiguous(),
        student_weight.contiguous(),
        teacher_hidden.reshape(-1, ht).contiguous(),
        teacher_weight.contiguous(),
        targets,
        inv_t,
        ignore_index,
        divergence,
        beta,
        reduction,
        grad_on and student_hidden.requires_grad,
        grad_on and student_weight.requires_grad,
        isinstance(temperature, Tensor),
    )
    return loss.view(lead) if reduction == "none" else loss
