"""Vocab-parallel ``linear_logprob``: the LM head sharded by vocabulary, bitwise the single-device op.

Rank ``r`` of ``P`` holds rows ``[r V_s, (r + 1) V_s)`` of the ``[V, H]`` head (``V = P V_s``). The
single-device kernels cut the vocabulary into ``L = tree_leaves(V)`` leaves (the largest power of two
<= 8 dividing ``V``) and merge them in a fixed binary tree; a shard is ``L / P`` whole leaves, a subtree.
Forward: each rank computes its subtree's online state ``(m, s, b)`` and its targets' logits, the
states are gathered (bits only) and merged in the tree's top levels by the backend's combine, the very
code the single-device forward ends with. Backward: ``grad_weight`` is row-local (each shard's rows are
the single-device rows); ``grad_hidden`` is the sum over leaves, each rank adding its leaves' fp32
partials in its subtree and the ranks' partials added in the top of the tree.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlk.core import checks
from rlk.core.checks import check_float
from rlk.distributed import _kernels
from rlk.distributed.group import Comm, Group
from rlk.ops import logprob as single

#: The target of a row that is not the shard's to score: outside every shard's range and never ignore_index.
_NOT_HERE = -(2**62)


def _local_targets(targets: Tensor, valid: Tensor, rank: int, v_shard: int) -> Tensor:
    """Targets relative to rank ``rank``'s first vocab row; ignored rows get a value in no shard."""
    return torch.where(valid, targets - rank * v_shard, _NOT_HERE)


class _VocabParallelLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, comm, kern, leaves, ignore_index, with_entropy, hidden, targets, inv_t, *shards):
        n_rows = hidden.shape[0]
        v_shard = shards[0].shape[0]
        stat = checks.stat_dtype(hidden)
        valid = targets != ignore_index
        local = []
        for rank, weight in zip(comm.ranks, shards):
            buf = torch.empty((4, n_rows), dtype=kern.partial_dtype(hidden.dtype), device=hidden.device)
            kern.linear_logprob_shard_fwd(
                hidden, weight, _local_targets(targets, valid, rank, v_shard), inv_t, leaves, buf[:3], buf[3]
            )
            local.append(buf)
        gathered = comm.gather(local)  # [P, 4, N]: m, s, b, target logit
        owner = torch.where(valid, targets // v_shard, 0)
        z_target = gathered[:, 3].gather(0, owner[None]).squeeze(0).contiguous()
        logprob = hidden.new_empty((n_rows,), dtype=stat)
        entropy = hidden.new_empty((n_rows if with_entropy else 0,), dtype=stat)
        lse = hidden.new_empty((n_rows,), dtype=stat)
        kern.linear_logprob_combine_fwd(
            gathered[:, :3].contiguous(),
            z_target,
            targets,
            ignore_index,
            logprob,
            entropy if with_entropy else None,
            lse,
        )
        ctx.save_for_backward(hidden, targets, inv_t, lse, entropy, *shards)
        ctx.setup = (comm, kern, leaves, ignore_index, with_entropy)
        return logprob, entropy

    @staticmethod
    def backward(ctx, grad_logprob, grad_entropy):
        hidden, targets, inv_t, lse, entropy, *shards = ctx.saved_tensors
        comm, kern, leaves, ignore_index, with_entropy = ctx.setup
        stat = checks.stat_dtype(hidden)
        n_rows = hidden.shape[0]
        # as rlk.linear_logprob's backward: fp32 contiguous, a missing log-prob gradient is zeros
        if grad_logprob is None:
            grad_logprob = hidden.new_zeros((n_rows,), dtype=stat)
        grad_logprob = grad_logprob.to(stat).contiguous()
        if not with_entropy or grad_entropy is None:
            grad_entropy = None
        else:
            grad_entropy = grad_entropy.to(stat).contiguous()
        need_hidden = ctx.needs_input_grad[5]
        need_weight = any(ctx.needs_input_grad[8:])
        valid = targets != ignore_index
        if need_weight:
            # as rlk.linear_logprob's backward: the ignored rows' hidden states zeroed, so that NaN or inf there
            # (padding) never reach the shards' weight gradients as 0 * NaN
            hidden = torch.where(valid[:, None], hidden, hidden.new_zeros(()))
        v_shard = shards[0].shape[0]
        partials, grad_weights = [], []
        for rank, weight in zip(comm.ranks, shards):
            part = None
            if need_hidden:
                part = hidden.new_empty(hidden.shape, dtype=kern.partial_dtype(hidden.dtype))
            grad_weight = torch.empty_like(weight) if need_weight else None
            kern.linear_logprob_shard_bwd(
                hidden,
                weight,
                _local_targets(targets, valid, rank, v_shard),
                inv_t,
                lse,
                entropy if grad_entropy is not None else None,
                grad_logprob,
                grad_entropy,
                _NOT_HERE,
                leaves,
                part,
                grad_weight,
            )
            partials.append(part)
            grad_weights.append(grad_weight)
        grad_hidden = None
        if need_hidden:
            grad_hidden = comm.reduce_rows(partials, kern.linear_logprob_combine_bwd, hidden.dtype)
        return (None, None, None, None, None, grad_hidden, None, None, *grad_weights)


def vocab_parallel_linear_logprob(
    hidden: Tensor,
    weight_shard,
    targets: Tensor,
    *,
    group: Group,
    temperature: float | Tensor = 1.0,
    ignore_index: int = -100,
    return_entropy: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """``rlk.linear_logprob`` with the LM head sharded by vocabulary over ``group``: the same bits.

    ``z = (hidden @ weight.T) / T`` over the full vocabulary ``V``; ``logprob = z_y - logsumexp(z)``,
    ``entropy = logsumexp(z) - sum_v softmax(z)_v z_v``, never materializing the logits, forward and backward.
    Outputs, ``grad_hidden`` and each shard's ``grad_weight`` are bitwise those of ``rlk.linear_logprob`` on
    the full head (on the same backend) for ``P`` in 1, 2, 4, 8, any ``V = P * V_s`` (e.g. 151936 = 8 x 18992,
    a shard that is no multiple of the kernels' tiles).

    Args:
        hidden: ``[..., H]`` bfloat16, float16 or float32, the same on every rank of ``group``.
        weight_shard: ``[V_s, H]`` of hidden's dtype: rows ``[r V_s, (r + 1) V_s)`` of the head on rank ``r``
            (with a :class:`~rlk.distributed.SimulatedGroup`: the sequence of the ``P`` shards).
        targets: ``[...]`` int32 / int64 global token ids in ``[0, V)`` or ``ignore_index``, the same on every rank.
        group: the tensor-parallel process group (``None``: the default group, or this process alone when
            ``torch.distributed`` is not initialized), or a ``SimulatedGroup``.
        temperature, ignore_index, return_entropy: as in ``rlk.linear_logprob``.

    Returns:
        fp32 ``logprob`` (and ``entropy``) of ``targets``' shape, the same on every rank, differentiable w.r.t.
        ``hidden`` and the shard(s).

    Communication: forward one ``all_gather`` of ``4 x N`` fp32 per rank; backward an ``all_to_all`` and an
    ``all_gather`` of ``grad_hidden``'s rows (fp32 partials in, ``hidden.dtype`` out). The backend is the one
    ``rlk.linear_logprob`` would use (``reference`` or ``triton``: others have no shard kernels yet).
    """
    comm = Comm(group)
    shards = comm.shards("weight_shard", weight_shard)
    check_float("hidden", hidden)
    if hidden.dim() < 1 or hidden.shape[-1] == 0:
        raise ValueError(f"hidden: expected shape [..., H] with H >= 1, got {tuple(hidden.shape)}")
    first = shards[0]
    for i, w in enumerate(shards):
        name = "weight_shard" if not comm.simulated else f"weight_shard[{i}]"
        check_float(name, w)
        if w.dim() != 2 or w.shape[0] == 0 or w.shape[1] != hidden.shape[-1] or w.shape != first.shape:
            raise ValueError(
                f"{name}: expected shape [V_s, H] with V_s >= 1 (the same on every rank) and "
                f"H = {hidden.shape[-1]} (hidden's last dim), got {tuple(w.shape)}"
            )
        if w.dtype != hidden.dtype:
            raise TypeError(f"{name}: expected the dtype of hidden ({hidden.dtype}), got {w.dtype}")
        if w.device != hidden.device:
            raise ValueError(f"{name}: expected device {hidden.device} (the device of hidden), got {w.device}")
    ignore_index = checks.integer("ignore_index", ignore_index)
    with_entropy = checks.flag("return_entropy", return_entropy)
    lead = hidden.shape[:-1]
    single._check_targets(targets, lead, "hidden", hidden.device)
    vocab = comm.size * first.shape[0]
    kern = _kernels.kernels("linear_logprob", "logprob", hidden.device, hidden.dtype)
    leaves = kern.tree_leaves(vocab, kern.MAX_TREE_LEAVES)
    if leaves % comm.size:
        raise ValueError(
            f"group: a vocab-parallel degree of {comm.size} does not align with the vocabulary's "
            f"reduction tree ({leaves} leaves for V = {vocab}): use 1, 2, 4 or 8 ranks "
            f"(<= MAX_TREE_LEAVES = {kern.MAX_TREE_LEAVES})"
        )
    flat_hidden = hidden.reshape(-1, hidden.shape[-1]).contiguous()
    flat_targets = targets.reshape(-1).to(torch.int64).contiguous()
    inv_t = single._inv_temperature(temperature, lead, hidden.device, checks.stat_dtype(hidden))
    if flat_hidden.shape[0] == 0:
        empty = flat_hidden.new_empty((0,), dtype=checks.stat_dtype(hidden))
        return (empty.view(lead), empty.view(lead)) if with_entropy else empty.view(lead)
    single._check_values(flat_targets, inv_t, vocab, ignore_index)
    logprob, entropy = _VocabParallelLogprob.apply(
        comm,
        kern,
        leaves // comm.size,
        ignore_index,
        with_entropy,
        flat_hidden,
        flat_targets,
        inv_t,
        *[w.contiguous() for w in shards],
    )
    if with_entropy:
        return logprob.view(lead), entropy.view(lead)
    return logprob.view(lead)
