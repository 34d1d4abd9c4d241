"""Reference embedding primitives: the readable specification.

Forward: a gather, ``out[n] = weight[ids[n]]`` (a bitwise copy).

Backward: row ``v`` of ``grad_weight`` is the sum of the ``grad_out`` rows whose id is ``v``,
taken **in position order** with an fp32 accumulator (fp64 for fp64 inputs) that starts at 0,
rounded once to ``weight.dtype``::

    acc = 0
    for n in 0..N-1 with ids[n] == v:   # increasing n
        acc = acc + float32(grad_out[n])
    grad_weight[v] = round(acc)

Rows of unused ids are 0; the ``padding_idx`` row is 0. The order is fixed by the positions
alone, so the result is deterministic and every backend that follows it gives the same bits
(an accumulation in another order, such as atomics or a tree, would not).
"""

from __future__ import annotations

import torch

from rlk.core.checks import compute_dtype


def embedding_fwd(weight: torch.Tensor, ids: torch.Tensor, out: torch.Tensor) -> None:
    """``out[n] = weight[ids[n]]``.

    Args:
        weight: ``[V, H]`` float.
        ids: ``[N]`` int64 in ``[0, V)``.
        out: ``[N, H]`` ``weight.dtype``, written.
    """
    torch.index_select(weight, 0, ids, out=out)


def embedding_bwd(grad_out: torch.Tensor, ids: torch.Tensor, padding_idx: int, grad_weight_out: torch.Tensor) -> None:
    """Position-ordered per-id sums of ``grad_out`` rows (module docstring).

    Args:
        grad_out: ``[N, H]`` ``weight.dtype``.
        ids: ``[N]`` int64 in ``[0, V)``.
        padding_idx: the id whose row gets 0, or -1 for none.
        grad_weight_out: ``[V, H]`` ``weight.dtype``, written.

    The sum runs as a loop over the occurrence number ``k``: step ``k`` adds, for every id that
    occurs more than ``k`` times, its ``k``-th row (in position order) to its accumulator. Every
    accumulator thus sees its rows one by one in position order, and one step touches each
    accumulator at most once.
    """
    grad_weight_out.zero_()
    order = torch.sort(ids, stable=True).indices  # positions grouped by id, in position order within an id
    unique_ids, counts = torch.unique_consecutive(ids[order], return_counts=True)
    starts = torch.cumsum(counts, 0) - counts
    acc = grad_out.new_zeros((unique_ids.shape[0], grad_out.shape[1]), dtype=compute_dtype(grad_out.dtype))
    by_count = torch.argsort(counts, descending=True, stable=True)  # ids occurring more than k times: a prefix
    host_counts = counts[by_count].tolist()
    live = len(host_counts)
    for k in range(host_counts[0]):
        while host_counts[live - 1] <= k:
            live -= 1
        runs = by_count[:live]
        acc[runs] += grad_out[order[starts[runs] + k]].to(acc.dtype)
    grad_weight_out[unique_ids] = acc.to(grad_weight_out.dtype)
    if padding_idx >= 0:
        grad_weight_out[padding_idx] = 0
