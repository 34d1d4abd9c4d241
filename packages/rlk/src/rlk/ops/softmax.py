"""Public softmax ops: ``softmax`` and ``log_softmax``, batch-invariant on backends that promise it.

Both are one pair of ``torch.library.custom_op`` primitives, ``rlk::softmax_fwd`` and
``rlk::softmax_bwd``, over the last dim of ``[N, V]`` rows, with fake implementations (so they
trace under ``torch.compile(fullgraph=True)``) and one ``register_autograd`` that calls the backward
primitive on the backend that served the forward. The public functions move any ``dim`` last.
The math is specified in ``rlk.reference.softmax``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlk.core import custom_op
from rlk.core.checks import check_float

# ---------------------------------------------------------------------------
# custom ops
# ---------------------------------------------------------------------------


softmax_op = custom_op.declare("softmax")


@softmax_op.forward(outputs=lambda x, log: torch.empty_like(x))
def _softmax_fwd(primitive, out, x: Tensor, log: bool) -> Tensor:
    if out.numel():
        primitive(x, log, out)


@softmax_op.backward_primitive(outputs=lambda grad_out, out, log: torch.empty_like(out))
def _softmax_bwd(primitive, out, grad_out: Tensor, y: Tensor, log: bool) -> Tensor:
    if out.numel():
        primitive(grad_out, y, log, out)


def _save(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.log = inputs[1]


def _backward(ctx, grad_out):
    (out,) = ctx.saved_tensors
    grad_out = grad_out.to(out.dtype).contiguous()
    return softmax_op.backward(ctx, grad_out, out, ctx.log), None


softmax_op.autograd(save=_save, backward=_backward)


# ---------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------


def _over_dim(x: Tensor, dim: int, log: bool) -> Tensor:
    check_float("x", x)
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"dim: expected an int, got {type(dim).__name__}")
    if x.dim() == 0:
        if dim not in (0, -1):
            raise IndexError(f"dim: out of range for a 0-d tensor (expected -1 or 0), got {dim}")
        return _over_dim(x.reshape(1), 0, log).reshape(())
    if not -x.dim() <= dim < x.dim():
        raise IndexError(
            f"dim: out of range for a {x.dim()}-d tensor (expected [{-x.dim()}, {x.dim() - 1}]), got {dim}"
        )
    moved = x.movedim(dim, -1)
    rows = moved.reshape(math.prod(moved.shape[:-1]), moved.shape[-1]).contiguous()
    out = _softmax_fwd(rows, log)
    return out.view(moved.shape).movedim(-1, dim)


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    """``softmax(x)`` along ``dim``: ``exp(x_v - m) / sum_u exp(x_u - m)``, ``m = max_u x_u``.

    Args:
        x: any shape, bfloat16, float16 or float32 (float64: reference backend only); any strides.
        dim: the dim to normalize over (moved last internally).

    Returns:
        A tensor of ``x``'s shape and dtype: fp32 math, one rounding to ``x.dtype``. Differentiable
        w.r.t. ``x`` (``grad_x = y * (g - sum(g * y))``, from the saved output ``y``). A slice that is
        all ``-inf`` gives NaN, as ``torch.softmax`` does.

    Batch invariance (backends that promise it, ``rlk info``): each slice along ``dim`` is reduced by
    one program in an order fixed by its length, so its result is bitwise independent of the other
    slices.
    """
    return _over_dim(x, dim, log=False)


def log_softmax(x: Tensor, dim: int = -1) -> Tensor:
    """``log_softmax(x)`` along ``dim``: ``(x_v - m) - log sum_u exp(x_u - m)``, ``m = max_u x_u``.

    Same arguments, dtypes and invariance as :func:`softmax`. Differentiable w.r.t. ``x``
    (``grad_x = g - exp(y) * sum(g)``, from the saved output ``y``).
    """
    return _over_dim(x, dim, log=True)
