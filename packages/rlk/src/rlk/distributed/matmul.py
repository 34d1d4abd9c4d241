"""Tensor-parallel ``linear`` in Megatron's layout, bitwise the single-device ``rlk.linear`` (both with
:mod:`rlk.core.tensor_parallel` on: at ``P > 1`` these ops refuse to run without it).

Column-parallel: rank ``r`` of ``P`` holds output rows ``[r N_s, (r + 1) N_s)`` of the ``[N, K]`` weight;
its output columns are the single-device columns (the same ``K`` segments per element). The backward's
``grad_x = sum_n g[:, n] W[n, :]`` is a sum over the sharded ``N``: the single-device kernel cuts it into
``tree_leaves(N)`` segments added in a fixed tree, a shard is a subtree, and the ranks' fp32 partials are
added in the top of the tree. Row-parallel: rank ``r`` holds input columns ``[r K_s, (r + 1) K_s)``; the
forward's ``K`` sum is cut the same way (``tree_leaves(K)`` segments), the bias added and the result rounded
once after the ranks' partials are combined; its backward is row- or column-local. Weight gradients are
sums over rows, computed by each rank for its own shard exactly as on one device.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlk.core import tensor_parallel
from rlk.core.checks import check_float, flag
from rlk.distributed import _kernels
from rlk.distributed.group import Comm, Group


def _tree_segments(kern, n: int, comm: Comm, name: str, what: str) -> int:
    """The full ``n``-sum's tree segments a shard holds (``tree_leaves(n) / P``), or an error naming ``name``."""
    if comm.size > 1 and not tensor_parallel.is_tensor_parallel_invariant():
        raise RuntimeError(
            f"{name}: {comm.size} ranks reproduce the single-device {what} sum only in its tensor-"
            "parallel order, which is off: call rlk.set_tensor_parallel_invariant(True) (or set "
            f"{tensor_parallel.ENV_VAR}=1) in every process whose numbers are compared, the "
            "single-device ones included"
        )
    leaves = kern.tree_leaves(n, tensor_parallel.max_matmul_leaves(kern.MAX_TREE_LEAVES), kern.MIN_LEAF)
    if leaves % comm.size:
        raise ValueError(
            f"{name}: the {what} sum over {n} = {comm.size} x {n // comm.size} has "
            f"{leaves} tree segment(s) (power-of-two segments of >= MIN_LEAF = {kern.MIN_LEAF}, at "
            f"most {kern.MAX_TREE_LEAVES}), which {comm.size} ranks cannot split along: use a "
            "degree that divides them"
        )
    return leaves // comm.size


def _check(name: str, x: Tensor, like: Tensor, like_name: str) -> None:
    check_float(name, x)
    if x.dtype != like.dtype:
        raise TypeError(f"{name}: expected the dtype of {like_name} ({like.dtype}), got {x.dtype}")
    if x.device != like.device:
        raise ValueError(f"{name}: expected device {like.device} (the device of {like_name}), got {x.device}")


def _weights(comm: Comm, name: str, weight, x: Tensor, k: int | None) -> list[Tensor]:
    """The weight shards, checked: 2-D, one shape on every rank, ``k`` columns when given."""
    shards = comm.shards(name, weight)
    for i, w in enumerate(shards):
        label = name if not comm.simulated else f"{name}[{i}]"
        _check(label, w, x, "x")
        if w.dim() != 2 or w.shape != shards[0].shape or (k is not None and w.shape[1] != k):
            want = f"[N_s, {k}]" if k is not None else "[N, K_s]"
            raise ValueError(f"{label}: expected shape {want} (the same on every rank), got {tuple(w.shape)}")
    return [w.contiguous() for w in shards]


def _biases(comm: Comm, name: str, bias, x: Tensor, n: int, sharded: bool) -> list[Tensor] | None:
    if bias is None:
        return None
    biases = comm.shards(name, bias) if sharded else [bias]
    for i, b in enumerate(biases):
        label = name if not (sharded and comm.simulated) else f"{name}[{i}]"
        _check(label, b, x, "x")
        if b.shape != (n,):
            raise ValueError(f"{label}: expected shape ({n},), got {tuple(b.shape)}")
    return [b.contiguous() for b in biases]


def _rows(x: Tensor) -> Tensor:
    flat = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    return flat if flat.stride(-1) == 1 or flat.stride(-2) == 1 else flat.contiguous()


# ---------------------------------------------------------------------------
# column-parallel
# ---------------------------------------------------------------------------


class _ColumnParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, kern, segments, gather_output, n_bias, x, *params):
        weights, biases = params[: len(params) - n_bias], params[len(params) - n_bias :]
        outs = []
        for i, w in enumerate(weights):
            out = x.new_empty((x.shape[0], w.shape[0]))
            kern.matmul_fwd(x, w.t(), biases[i] if n_bias else None, out)
            outs.append(out)
        ctx.save_for_backward(x, *weights)
        ctx.setup = (comm, kern, segments, gather_output, n_bias)
        if gather_output:
            gathered = comm.gather(outs)  # [P, M, N_s]
            return gathered.permute(1, 0, 2).reshape(x.shape[0], -1)
        return tuple(outs)

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        comm, kern, segments, gather_output, n_bias = ctx.setup
        n_s = weights[0].shape[0]
        if gather_output:
            (grad,) = grads
            grads = [grad[:, r * n_s : (r + 1) * n_s] for r in comm.ranks]
        grads = [
            torch.zeros((x.shape[0], n_s), dtype=x.dtype, device=x.device) if g is None else g.contiguous()
            for g in grads
        ]
        need_x = ctx.needs_input_grad[5]
        need_w = any(ctx.needs_input_grad[6 : 6 + len(weights)])
        need_b = n_bias and any(ctx.needs_input_grad[6 + len(weights) :])
        partials, grad_ws, grad_bs = [], [], []
        for g, w in zip(grads, weights):
            if need_x:
                part = x.new_empty(x.shape, dtype=kern.partial_dtype(x.dtype))
                kern.matmul_shard_fwd(g, w, segments, part)  # g @ W_r: this shard's subtree of the N sum
                partials.append(part)
            grad_w = torch.empty_like(w) if need_w else None
            grad_b = x.new_empty((n_s,)) if need_b else None
            if need_w or need_b:
                kern.matmul_bwd(g, x, w.t(), None, None if grad_w is None else grad_w.t(), grad_b)
            grad_ws.append(grad_w)
            grad_bs.append(grad_b)
        grad_x = None
        if need_x:
            grad_x = comm.reduce_rows(partials, lambda parts, out: kern.matmul_combine(parts, None, out), x.dtype)
        return (None, None, None, None, None, grad_x, *grad_ws, *(grad_bs if n_bias else []))


def column_parallel_linear(x: Tensor, weight_shard, bias_shard=None, *, group: Group, gather_output: bool = False):
    """``rlk.linear(x, weight, bias)`` with the weight's output rows sharded over ``group`` (Megatron's
    column-parallel layer): the same bits as the single-device call, forward and backward.

    Args:
        x: ``[..., K]`` bfloat16, float16 or float32, the same on every rank.
        weight_shard: ``[N_s, K]``: rows ``[r N_s, (r + 1) N_s)`` of the ``[N, K]`` weight on rank ``r``
            (a sequence of the ``P`` shards with a :class:`~rlk.distributed.SimulatedGroup`).
        bias_shard: ``[N_s]`` (the matching slice of the bias) or None.
        group: the tensor-parallel group (None: the default group, or this process alone), or a SimulatedGroup.
        gather_output: return the full ``[..., N]`` output on every rank (columns in rank order) instead of the
            rank's ``[..., N_s]`` columns.

    Returns:
        This rank's ``[..., N_s]`` output (a list per rank when simulated), or the gathered ``[..., N]``; the
        columns of ``rlk.linear(x, weight, bias)``. Differentiable: ``grad_x`` (a sum over ``N``) is combined
        over the ranks in the fixed tree, ``grad_weight`` / ``grad_bias`` are each rank's own rows. Needs
        ``tree_leaves(N)`` divisible by ``P`` (``N`` a multiple of ``P * MIN_LEAF`` for ``P`` up to 8).
    """
    comm = Comm(group)
    check_float("x", x)
    gather_output = flag("gather_output", gather_output)
    if x.dim() < 1:
        raise ValueError(f"x: expected shape [..., K], got {tuple(x.shape)}")
    weights = _weights(comm, "weight_shard", weight_shard, x, x.shape[-1])
    n_s = weights[0].shape[0]
    biases = _biases(comm, "bias_shard", bias_shard, x, n_s, sharded=True)
    kern = _kernels.kernels("matmul", "matmul", x.device, x.dtype)
    segments = _tree_segments(kern, comm.size * n_s, comm, "weight_shard", "grad_x")
    rows = _rows(x)
    out = _ColumnParallel.apply(
        comm, kern, segments, gather_output, 0 if biases is None else len(biases), rows, *weights, *(biases or [])
    )
    lead = x.shape[:-1]
    if gather_output:
        return out.view(*lead, comm.size * n_s)
    return comm.result([o.view(*lead, n_s) for o in out])


# ---------------------------------------------------------------------------
# row-parallel
# ---------------------------------------------------------------------------


class _RowParallel(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, kern, segments, has_bias, n, *params):
        p = comm.size if comm.simulated else 1
        xs, weights, bias = params[:p], params[p : 2 * p], params[2 * p] if has_bias else None
        partials = []
        for x, w in zip(xs, weights):
            part = x.new_empty((x.shape[0], n), dtype=kern.partial_dtype(x.dtype))
            kern.matmul_shard_fwd(x, w.t(), segments, part)
            partials.append(part)
        out = comm.reduce_rows(partials, lambda parts, o: kern.matmul_combine(parts, bias, o), xs[0].dtype)
        ctx.save_for_backward(*xs, *weights)
        ctx.setup = (comm, kern, has_bias, p)
        return out

    @staticmethod
    def backward(ctx, grad):
        comm, kern, has_bias, p = ctx.setup
        saved = ctx.saved_tensors
        xs, weights = saved[:p], saved[p:]
        grad = grad.contiguous()
        need_x = any(ctx.needs_input_grad[5 : 5 + p])
        need_w = any(ctx.needs_input_grad[5 + p : 5 + 2 * p])
        need_b = has_bias and ctx.needs_input_grad[5 + 2 * p]
        grad_xs, grad_ws, grad_b = [], [], None
        for x, w in zip(xs, weights):
            grad_x = torch.empty_like(x) if need_x else None
            grad_w = torch.empty_like(w) if need_w else None
            gb = x.new_empty((grad.shape[1],)) if need_b and grad_b is None else None
            kern.matmul_bwd(grad, x, w.t(), grad_x, None if grad_w is None else grad_w.t(), gb)
            grad_b = gb if gb is not None else grad_b
            grad_xs.append(grad_x)
            grad_ws.append(grad_w)
        return (None, None, None, None, None, *grad_xs, *grad_ws, *([grad_b] if has_bias else []))


def row_parallel_linear(x_shard, weight_shard, bias: Tensor | None = None, *, group: Group) -> Tensor:
    """``rlk.linear(x, weight, bias)`` with the weight's input columns (and ``x``'s features) sharded over
    ``group`` (Megatron's row-parallel layer): the same bits as the single-device call, forward and backward.

    Args:
        x_shard: ``[..., K_s]``: features ``[r K_s, (r + 1) K_s)`` of ``x`` on rank ``r`` (e.g. a column-parallel
            layer's output); a sequence of the ``P`` shards with a :class:`~rlk.distributed.SimulatedGroup`.
        weight_shard: ``[N, K_s]``: the matching columns of the ``[N, K]`` weight (a sequence when simulated).
        bias: ``[N]`` or None, the same on every rank (added once, after the ranks' partial sums).
        group: the tensor-parallel group (None: the default group, or this process alone), or a SimulatedGroup.

    Returns:
        ``[..., N]`` in x's dtype, the same on every rank: the single-device kernel sums ``K`` in
        ``tree_leaves(K)`` fixed segments added in a fixed tree, rank ``r``'s fp32 partial is its subtree, and
        the partials are combined in the tree's top (``all_to_all`` + ``all_gather`` of the rows; fp32 partials,
        twice the bytes of a bf16 all-reduce). Needs ``tree_leaves(K)`` divisible by ``P``. Differentiable:
        ``grad_x_shard`` / ``grad_weight_shard`` are each rank's own columns, ``grad_bias`` is the same on every rank.
    """
    comm = Comm(group)
    xs = comm.shards("x_shard", x_shard)
    for i, x in enumerate(xs):
        label = "x_shard" if not comm.simulated else f"x_shard[{i}]"
        _check(label, x, xs[0], "x_shard")
        if x.dim() < 1 or x.shape != xs[0].shape:
            raise ValueError(f"{label}: expected shape [..., K_s] (the same on every rank), got {tuple(x.shape)}")
    weights = _weights(comm, "weight_shard", weight_shard, xs[0], xs[0].shape[-1])
    n = weights[0].shape[0]
    biases = _biases(comm, "bias", bias, xs[0], n, sharded=False)
    kern = _kernels.kernels("matmul", "matmul", xs[0].device, xs[0].dtype)
    segments = _tree_segments(kern, comm.size * xs[0].shape[-1], comm, "x_shard", "K")
    rows = [_rows(x) for x in xs]
    out = _RowParallel.apply(comm, kern, segments, biases is not None, n, *rows, *weights, *(biases or []))
    return out.view(*xs[0].shape[:-1], n)
