"""Public normalization op: ``rms_norm`` (Llama / Qwen3 and Gemma forms, optional fused residual add).

The op is two ``torch.library.custom_op`` primitives (``rlk::rms_norm_fwd`` and ``rlk::rms_norm_bwd``)
with fake implementations, so it traces under ``torch.compile(fullgraph=True)``, and one
``register_autograd`` that calls the backward primitive. The custom ops dispatch to the backend
chosen by ``rlk.core.dispatch`` at run time; the backward runs on the backend that served the forward.
The math is specified in :mod:`rlk.reference.norm`.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlk.core import checks, custom_op
from rlk.core.checks import check_float, stat_dtype

# ---------------------------------------------------------------------------
# dtypes and argument checks
# ---------------------------------------------------------------------------


def output_dtype(x_dtype: torch.dtype, weight_dtype: torch.dtype, gemma: bool) -> torch.dtype:
    """Dtype of ``y``, as Hugging Face's modules give it.

    Gemma returns ``x.dtype``. Llama / Qwen3 return ``weight * n.to(x.dtype)``, whose dtype is torch's
    type promotion of weight and x: x.dtype when the weight has it, float32 for a float32 weight
    with 16-bit x (fp32 master weights).
    """
    return x_dtype if gemma else torch.promote_types(x_dtype, weight_dtype)


def _check_inputs(x, weight, residual) -> None:
    check_float("x", x)
    if x.dim() < 1 or x.shape[-1] == 0:
        raise ValueError(f"x: expected shape [..., H] with H >= 1, got {tuple(x.shape)}")
    hidden = x.shape[-1]
    check_float("weight", weight)
    if tuple(weight.shape) != (hidden,):
        raise ValueError(f"weight: expected shape ({hidden},) (x's last dim), got {tuple(weight.shape)}")
    if weight.dtype not in (x.dtype, torch.float32):
        raise TypeError(f"weight: expected the dtype of x ({x.dtype}) or float32, got {weight.dtype}")
    if weight.device != x.device:
        raise ValueError(f"weight: expected device {x.device} (the device of x), got {weight.device}")
    if residual is None:
        return
    if not isinstance(residual, Tensor):
        raise TypeError(f"residual: expected a torch.Tensor or None, got {type(residual).__name__}")
    if residual.shape != x.shape:
        raise ValueError(f"residual: expected shape {tuple(x.shape)} (the shape of x), got {tuple(residual.shape)}")
    if residual.dtype != x.dtype:
        raise TypeError(f"residual: expected the dtype of x ({x.dtype}), got {residual.dtype}")
    if residual.device != x.device:
        raise ValueError(f"residual: expected device {x.device} (the device of x), got {residual.device}")


# ---------------------------------------------------------------------------
# custom ops
# ---------------------------------------------------------------------------


def _fwd_outputs(
    x: Tensor, weight: Tensor, residual: Tensor | None, eps: float, gemma: bool
) -> tuple[Tensor, Tensor, Tensor]:
    y = x.new_empty(x.shape, dtype=output_dtype(x.dtype, weight.dtype, gemma))
    s = torch.empty_like(x) if residual is not None else custom_op.placeholder(x)
    rstd = x.new_empty((x.shape[0],), dtype=stat_dtype(x))
    return y, s, rstd


def _bwd_outputs(
    grad_out: Tensor,
    s: Tensor,
    weight: Tensor,
    rstd: Tensor,
    grad_residual: Tensor | None,
    gemma: bool,
    need_grad_weight: bool,
) -> tuple[Tensor, Tensor]:
    grad_weight = torch.empty_like(weight) if need_grad_weight else custom_op.placeholder(weight)
    return torch.empty_like(s), grad_weight


rms_norm_op = custom_op.declare("rms_norm")


@rms_norm_op.forward(outputs=_fwd_outputs)
def _rms_norm_fwd(
    primitive, out, x: Tensor, weight: Tensor, residual: Tensor | None, eps: float, gemma: bool
) -> tuple[Tensor, Tensor, Tensor]:
    y, s, rstd = out
    if x.shape[0]:
        primitive(x, weight, residual, eps, gemma, y, s if residual is not None else None, rstd)


@rms_norm_op.backward_primitive(outputs=_bwd_outputs)
def _rms_norm_bwd(
    primitive,
    out,
    grad_out: Tensor,
    s: Tensor,
    weight: Tensor,
    rstd: Tensor,
    grad_residual: Tensor | None,
    gemma: bool,
    need_grad_weight: bool,
) -> tuple[Tensor, Tensor]:
    grad_input, grad_weight = out
    if s.shape[0] == 0:
        grad_weight.zero_()
        return
    primitive(grad_out, s, weight, rstd, gemma, grad_residual, grad_input, grad_weight if need_grad_weight else None)


def _save(ctx, inputs, output):
    x, weight, residual, eps, gemma = inputs
    y, s, rstd = output
    ctx.fused = residual is not None
    ctx.save_for_backward(s if ctx.fused else x, weight, rstd)
    ctx.gemma = gemma
    ctx.y_meta = (y.shape, y.dtype)


def _backward(ctx, grad_y, grad_s, grad_rstd):
    s, weight, rstd = ctx.saved_tensors
    if grad_y is None:
        shape, dtype = ctx.y_meta
        grad_y = s.new_zeros(shape, dtype=dtype)
    grad_residual = grad_s.to(s.dtype).contiguous() if ctx.fused and grad_s is not None else None
    need_x = ctx.needs_input_grad[0] or ctx.needs_input_grad[2]
    need_w = ctx.needs_input_grad[1]
    if not (need_x or need_w):
        return None, None, None, None, None
    grad_input, grad_weight = rms_norm_op.backward(
        ctx, grad_y.contiguous(), s, weight, rstd, grad_residual, ctx.gemma, need_w
    )
    return (
        grad_input if ctx.needs_input_grad[0] else None,
        grad_weight if need_w else None,
        grad_input if ctx.needs_input_grad[2] else None,
        None,
        None,
    )


rms_norm_op.autograd(save=_save, backward=_backward)


# ---------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------


def rms_norm(
    x: Tensor,
    weight: Tensor,
    eps: float = 1e-6,
    *,
    residual: Tensor | None = None,
    gemma: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Root-mean-square normalization over the last dim, as Hugging Face's RMSNorm modules compute it.

    Per row of ``H`` elements, with ``s = x + residual`` (rounded to x.dtype, HF's
    ``hidden_states = residual + hidden_states``) or ``s = x``::

        n = s.float() * rsqrt(mean(s.float() ** 2) + eps)
        y = weight * n.to(x.dtype)                        (gemma=False: Llama, Qwen3, Mistral...)
        y = (n * (1 + weight.float())).to(x.dtype)        (gemma=True: Gemma)

    Args:
        x: ``[..., H]`` bfloat16, float16 or float32 (any strides; float64 for reference runs).
        weight: ``[H]``, the dtype of x or float32.
        eps: ``>= 0``, added to the mean of squares.
        residual: ``[..., H]`` like x, or None. When given, the sum ``s`` is normalized and also
            returned as the new residual (the pre-norm residual stream of a decoder layer).
        gemma: the Gemma form ``(1 + weight)`` with the product taken in fp32.

    Returns:
        ``y`` of x's shape, or ``(y, s)`` when ``residual`` is given. ``y``'s dtype is x.dtype, except
        for ``gemma=False`` with a float32 weight and 16-bit x: then float32, as torch's type promotion
        gives for HF's ``weight * n.to(x.dtype)``. Differentiable w.r.t. x, weight and residual
        (``grad_x = grad_residual = rstd * (g_n - n * mean(g_n * n)) + grad_s``, ``g_n = grad_y * weight``,
        with ``(1 + weight)`` for Gemma; ``grad_weight = sum_rows grad_y * n.to(x.dtype)``, ``n`` for Gemma),
        fp32 accumulation.

    Range: a row whose ``mean(s ** 2) + eps`` overflows fp32 (``|s|`` beyond about 1e19) or falls below
    ``2 ** -100`` (``|s|`` below about 1e-15 with ``eps < 2 ** -100``) has its mean of squares computed again on
    ``s`` scaled by ``2 ** -100`` or ``2 ** 100`` (exact), so ``x = 1e20`` gives ``y = weight`` rather than 0 and
    ``x = 1e-30, eps = 0`` rather than inf; every other row keeps the plain formula's bits (HF's). Only a row whose
    root mean square lies below ``1 / 3.4e38`` (subnormal values) with ``eps = 0`` has an ``rstd`` beyond fp32's
    range (``inf``).

    Batch invariance: on backends that promise it (``rlk info``), a row's ``y``, ``s`` and ``grad_x`` are
    bitwise independent of the other rows; ``grad_weight`` sums rows over a fixed partition in a fixed
    order (deterministic run to run).
    """
    _check_inputs(x, weight, residual)
    eps = checks.number("eps", eps, minimum=0.0)
    gemma = checks.flag("gemma", gemma)
    hidden = x.shape[-1]
    flat_x = x.reshape(-1, hidden).contiguous()
    flat_res = None if residual is None else residual.reshape(-1, hidden).contiguous()
    y, s, _ = _rms_norm_fwd(flat_x, weight.contiguous(), flat_res, eps, gemma)
    y = y.view(x.shape)
    if residual is None:
        return y
    return y, s.view(x.shape)
