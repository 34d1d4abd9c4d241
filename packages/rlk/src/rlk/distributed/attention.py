"""Context-parallel attention: each sequence split into contiguous token chunks over ranks, K/V gathered.

Rank ``r`` of ``P`` holds chunk ``r`` of every sequence of a packed batch (the chunks of a sequence, in rank
order, are the sequence). Its queries attend, with the bottom-right causal mask, to the keys of chunks
``0..r`` (all chunks when not causal): exactly what a chunk of a chunked prefill sees, so on a backend that
promises chunked-prefill invariance (``rlk info``: batch-invariant, e.g. Triton) each query's output, LSE
and ``dq`` are bitwise those of the whole sequence on one rank. The K/V gradients of a chunk are the sum of
every rank's contributions, added in the fixed tree over ranks: deterministic, the same on any run at a
given ``P``, but not the single-device bits (that kernel sums all query blocks in one loop).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from rlk.core import checks
from rlk.distributed.group import Comm, Group
from rlk.distributed.reduce import tree_sum
from rlk.ops.attention import attention as _attention


class _GatherTokens(torch.autograd.Function):
    """Forward: every rank's ``[T_max, ...]`` (padded) token block, ``[P, T_max, ...]``. Backward: each rank's
    gradient of the gathered blocks sent to the block's owner (``all_to_all``) and added in the fixed tree."""

    @staticmethod
    def forward(ctx, comm, x):
        ctx.comm = comm
        return comm.gather([x])

    @staticmethod
    def backward(ctx, grad):
        comm = ctx.comm
        grad = grad.contiguous()
        received = torch.empty_like(grad)
        dist.all_to_all_single(received, grad, group=comm.group)  # received[s] = rank s's gradient of my block
        return None, tree_sum(received)


def context_parallel_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    cu_seqlens: Tensor,
    group: Group,
    causal: bool = True,
    softmax_scale: float | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """``rlk.attention`` over sequences whose tokens are split into contiguous chunks over ``group``.

    Args:
        q: ``[T_r, Hq, D]`` this rank's query tokens: chunk ``r`` of each sequence, packed in sequence order.
        k, v: ``[T_r, Hkv, D]`` the keys and values of the same tokens.
        cu_seqlens: int32 ``[B + 1]`` offsets of the chunks in ``q`` (this rank's chunk lengths; a chunk may
            be empty, and the ranks' chunks of a sequence may differ in length).
        group: the context-parallel process group (None: the default group, or this process alone).
        causal, softmax_scale, return_lse: as in ``rlk.attention`` (the causal mask is the whole sequence's).

    Returns:
        ``out [T_r, Hq, D]`` (and ``lse [Hq, T_r]`` fp32) for this rank's queries: per token the bits of
        ``rlk.attention`` on the whole sequences on a backend with the batch-invariance promise. Differentiable
        w.r.t. ``q``, ``k``, ``v``: ``dq`` likewise; ``dk`` / ``dv`` deterministic (fixed tree over ranks).

    Communication: one ``all_gather`` of the chunk lengths (and a host synchronization to read them), one of
    K and V; the backward an ``all_to_all`` of the K/V gradients. Memory: the K/V of the whole sequences.
    """
    comm = Comm(group)
    if comm.simulated:
        raise TypeError("group: context_parallel_attention runs on a real process group (or None)")
    causal = checks.flag("causal", causal)
    return_lse = checks.flag("return_lse", return_lse)
    checks.cu_seqlens("cu_seqlens", cu_seqlens, q.device)
    for name, x in (("q", q), ("k", k), ("v", v)):
        checks.check_float(name, x)
        if x.dim() != 3:
            raise ValueError(f"{name}: expected shape [tokens, heads, head_dim], got {tuple(x.shape)}")
    if k.shape[0] != q.shape[0] or v.shape != k.shape:
        raise ValueError(
            f"k, v: expected {q.shape[0]} tokens (q's) and one shape, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int64)
    lens = comm.gather([lengths]).tolist()  # [P][B]
    totals = comm.gather([torch.tensor([q.shape[0]], dtype=torch.int64, device=q.device)]).view(-1).tolist()
    rank = comm.ranks[0]
    if totals[rank] != int(cu_seqlens[-1]):
        raise ValueError(
            f"cu_seqlens: must end at the number of tokens of q ({q.shape[0]}), ends at {int(cu_seqlens[-1])}"
        )
    t_max = max(totals)
    kv = torch.cat([k, v], dim=1)  # [T_r, 2 Hkv, D]: one gather for both
    padded = kv.new_zeros((t_max, *kv.shape[1:]))
    padded[: kv.shape[0]] = kv
    gathered = _GatherTokens.apply(comm, padded) if not comm.local else padded[None]
    flat = gathered.reshape(comm.size * t_max, *kv.shape[1:])

    # Each sequence's keys: the chunks of ranks 0..r (causal) or of every rank, in rank order.
    index, cu_k, longest = [], [0], 0
    n_seq = len(lens[0])
    starts = [[0] * (n_seq + 1) for _ in range(comm.size)]
    for s in range(comm.size):
        for b in range(n_seq):
            starts[s][b + 1] = starts[s][b] + lens[s][b]
    last = rank if causal else comm.size - 1
    for b in range(n_seq):
        n = 0
        for s in range(last + 1):
            first = s * t_max + starts[s][b]
            index.append(torch.arange(first, first + lens[s][b], device=q.device))
            n += lens[s][b]
        cu_k.append(cu_k[-1] + n)
        longest = max(longest, n)
    index = torch.cat(index) if index else torch.zeros(0, dtype=torch.int64, device=q.device)
    keys = flat[index]
    hkv = k.shape[1]
    k_full, v_full = keys[:, :hkv], keys[:, hkv:]
    cu_k = torch.tensor(cu_k, dtype=torch.int32, device=q.device)
    max_q = max(lens[rank]) if n_seq else 0
    return _attention(
        q,
        k_full,
        v_full,
        cu_seqlens_q=cu_seqlens,
        cu_seqlens_k=cu_k,
        max_seqlen_q=max_q,
        max_seqlen_k=longest,
        causal=causal,
        softmax_scale=softmax_scale,
        return_lse=return_lse,
    )
