"""Public GEMM ops: ``matmul`` and ``linear``, batch-invariant on backends that promise it.

Both are one pair of ``torch.library.custom_op`` primitives, ``rlk::matmul_fwd`` and
``rlk::matmul_bwd``, with fake implementations (so they trace under
``torch.compile(fullgraph=True)``) and one ``register_autograd`` that calls the backward
primitive on the backend that served the forward. The math is specified in
``rlk.reference.matmul``.

The custom ops take ``a`` ``[M, K]`` and ``b`` ``[K, N]`` (or batched ``[B, M, K]`` and
``[B, K, N]``, run as ``B`` calls of the 2-D primitive into one output) as row-major or
column-major views: ``linear`` passes ``weight.t()`` and the backward passes transposed views,
without copies. The gradient of ``b`` is allocated in ``b``'s layout, so ``linear``'s
``weight.grad`` comes out contiguous ``[N, K]``.
"""

from __future__ import annotations

import math

from torch import Tensor

from rlk.core import custom_op
from rlk.core.checks import check_float

# ---------------------------------------------------------------------------
# layouts
# ---------------------------------------------------------------------------


def _unit_stride(x: Tensor) -> Tensor:
    """``x`` if each matrix of it (its last two dims) is row-major or column-major, else a contiguous copy."""
    if x.stride(-1) == 1 or x.stride(-2) == 1:
        return x
    return x.contiguous()


def _is_column_major(x: Tensor) -> bool:
    return x.stride(-1) != 1 and x.stride(-2) == 1


def _empty_in_layout_of(x: Tensor) -> Tensor:
    """A new tensor shaped like ``x``: column-major matrices if ``x``'s are, else contiguous."""
    if _is_column_major(x):
        return x.new_empty((*x.shape[:-2], x.shape[-1], x.shape[-2])).transpose(-1, -2)
    return x.new_empty(x.shape)


# ---------------------------------------------------------------------------
# custom ops
# ---------------------------------------------------------------------------


def _out_shape(a: Tensor, b: Tensor) -> tuple[int, ...]:
    return (*a.shape[:-1], b.shape[-1])


def _bwd_outputs(a: Tensor, b: Tensor, need_a: bool, need_b: bool, need_bias: bool) -> tuple[Tensor, Tensor, Tensor]:
    grad_a = _empty_in_layout_of(a) if need_a else custom_op.placeholder(a)
    grad_b = _empty_in_layout_of(b) if need_b else custom_op.placeholder(b)
    grad_bias = a.new_empty((b.shape[-1],)) if need_bias else custom_op.placeholder(a)
    return grad_a, grad_b, grad_bias


matmul_op = custom_op.declare("matmul")


@matmul_op.forward(outputs=lambda a, b, bias: a.new_empty(_out_shape(a, b)))
def _matmul_fwd(primitive, out, a: Tensor, b: Tensor, bias: Tensor | None) -> Tensor:
    if out.numel() == 0:
        return
    if a.shape[-1] == 0:  # an empty sum: the bias, or zeros
        if bias is not None:
            out.copy_(bias.expand_as(out))
        else:
            out.zero_()
        return
    if a.dim() == 2:
        primitive(a, b, bias, out)
    else:
        for i in range(a.shape[0]):
            primitive(a[i], b[i], bias, out[i])


@matmul_op.backward_primitive(
    outputs=lambda grad_out, a, b, need_a, need_b, need_bias: _bwd_outputs(a, b, need_a, need_b, need_bias)
)
def _matmul_bwd(
    primitive, out, grad_out: Tensor, a: Tensor, b: Tensor, need_a: bool, need_b: bool, need_bias: bool
) -> tuple[Tensor, Tensor, Tensor]:
    grad_a, grad_b, grad_bias = out
    m, k = a.shape[-2:]
    n = b.shape[-1]
    if m == 0 or n == 0:  # empty sums: zeros (the other gradients have no elements)
        for grad in out:
            grad.zero_()
        return
    if k == 0:  # grad_a and grad_b have no elements; grad_bias still sums grad_out
        need_a = need_b = False
    if not (need_a or need_b or need_bias):
        return
    if a.dim() == 2:
        primitive(
            grad_out, a, b, grad_a if need_a else None, grad_b if need_b else None, grad_bias if need_bias else None
        )
    else:
        for i in range(a.shape[0]):
            primitive(grad_out[i], a[i], b[i], grad_a[i] if need_a else None, grad_b[i] if need_b else None, None)


def _save(ctx, inputs, output):
    ctx.save_for_backward(inputs.a, inputs.b)
    ctx.has_bias = inputs.bias is not None


def _backward(ctx, grad_out):
    a, b = ctx.saved_tensors
    need_a, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    need_bias = ctx.has_bias and ctx.needs_input_grad[2]
    grad_a, grad_b, grad_bias = matmul_op.backward(ctx, grad_out.contiguous(), a, b, need_a, need_b, need_bias)
    return grad_a if need_a else None, grad_b if need_b else None, grad_bias if need_bias else None


matmul_op.autograd(save=_save, backward=_backward)


# ---------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------


def _check_same(name: str, x: Tensor, like_name: str, like: Tensor) -> None:
    if x.dtype != like.dtype:
        raise TypeError(f"{name}: expected the dtype of {like_name} ({like.dtype}), got {x.dtype}")
    if x.device != like.device:
        raise ValueError(f"{name}: expected device {like.device} (the device of {like_name}), got {x.device}")


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """``a @ b`` with fp32 accumulation, batch-invariant rows on backends that promise it.

    Forms:

    * ``a`` ``[..., M, K]`` and ``b`` ``[K, N]``: the leading dims of ``a`` are flattened into
      rows; returns ``[..., M, N]``;
    * batched: ``a`` ``[B, M, K]`` and ``b`` ``[B, K, N]``; returns ``[B, M, N]``. The op runs
      the 2-D primitive once per batch entry (``B`` launches), writing into one output.

    ``out[i, j] = sum_k a[i, k] b[k, j]`` accumulated in fp32 (IEEE fp32 products for fp32
    inputs: no TF32; fp64 for fp64 inputs, a reference-only mode) and rounded once to the input
    dtype. Differentiable w.r.t. ``a`` and ``b`` (``grad_a = g @ b.T``, ``grad_b = a.T @ g``).

    Args:
        a: bfloat16, float16 or float32 (float64: reference only), at least 2-D; any strides
            (a matrix that is neither row- nor column-major is copied).
        b: same dtype and device as ``a``.

    Batch invariance (backends with ``batch_invariant``, e.g. triton): one fixed tile
    configuration per dtype and no split-K, so each output row (and each row of ``grad_a``) is
    bitwise the same whatever the number of rows and the row's position; ``grad_b`` sums the rows
    in a fixed order (deterministic run to run). Empty ``M`` or ``N`` give empty results; ``K = 0``
    gives zeros.
    """
    check_float("a", a)
    check_float("b", b)
    _check_same("b", b, "a", a)
    if a.dim() < 2:
        raise ValueError(f"a: expected shape [..., M, K] (at least 2 dims), got {tuple(a.shape)}")
    if b.dim() == 2:
        if b.shape[0] != a.shape[-1]:
            raise ValueError(f"b: expected shape [K, N] with K = {a.shape[-1]} (a's last dim), got {tuple(b.shape)}")
        flat = a.reshape(math.prod(a.shape[:-1]), a.shape[-1])
        out = _matmul_fwd(_unit_stride(flat), _unit_stride(b), None)
        return out.view(*a.shape[:-1], b.shape[1])
    if b.dim() == 3:
        if a.dim() != 3:
            raise ValueError(f"a: expected shape [B, M, K] with a batched b [B, K, N], got {tuple(a.shape)}")
        if b.shape[0] != a.shape[0] or b.shape[1] != a.shape[2]:
            raise ValueError(
                f"b: expected shape [B, K, N] with B = {a.shape[0]} and K = {a.shape[2]} (from a), got {tuple(b.shape)}"
            )
        return _matmul_fwd(_unit_stride(a), _unit_stride(b), None)
    raise ValueError(f"b: expected shape [K, N] or [B, K, N], got {tuple(b.shape)}")


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight.T + bias`` like ``torch.nn.functional.linear``, batch-invariant rows.

    ``out[..., j] = sum_k x[..., k] weight[j, k] + bias[j]``: fp32 accumulation, the bias added in
    fp32 to the accumulator, one rounding to the input dtype. The weight is read in place
    (``weight.t()`` is a column-major view, no copy). Differentiable w.r.t. ``x``, ``weight``
    and ``bias``; ``weight.grad`` is contiguous ``[N, K]``.

    Args:
        x: ``[..., K]`` bfloat16, float16 or float32 (float64: reference only); leading dims are
            flattened into rows.
        weight: ``[N, K]``, same dtype and device.
        bias: ``[N]``, same dtype and device, or None.

    Returns:
        ``[..., N]`` in the input dtype. Batch invariance as in :func:`matmul`.
    """
    check_float("x", x)
    check_float("weight", weight)
    _check_same("weight", weight, "x", x)
    if x.dim() < 1:
        raise ValueError(f"x: expected shape [..., K], got {tuple(x.shape)}")
    if weight.dim() != 2 or weight.shape[1] != x.shape[-1]:
        raise ValueError(
            f"weight: expected shape [N, K] with K = {x.shape[-1]} (x's last dim), got {tuple(weight.shape)}"
        )
    n = weight.shape[0]
    if bias is not None:
        check_float("bias", bias)
        _check_same("bias", bias, "x", x)
        if bias.shape != (n,):
            raise ValueError(f"bias: expected shape ({n},) (weight's first dim), got {tuple(bias.shape)}")
        bias = bias.contiguous()
    flat = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    out = _matmul_fwd(_unit_stride(flat), _unit_stride(weight).t(), bias)
    return out.view(*x.shape[:-1], n)
