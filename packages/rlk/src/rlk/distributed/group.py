"""Process groups as the distributed ops see them: a real ``torch.distributed`` group, or P simulated ranks.

Every op of :mod:`rlk.distributed` is written once against :class:`Comm`: the ranks this process computes
(one for a real group, all ``P`` for a :class:`SimulatedGroup`), a gather of per-rank tensors, and a
row-chunked reduction in the fixed tree. The collectives carry bits only (``all_gather``,
``all_to_all``); every addition happens in this process, in the tree of :func:`rlk.distributed.tree_sum`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from rlk.core import checks


class SimulatedGroup:
    """``size`` ranks simulated in one process: the same shard kernels and combine code as a real group.

    With it, each sharded argument of a :mod:`rlk.distributed` op is a sequence of ``size`` tensors (rank
    order) and each sharded result a list; replicated arguments and results stay single tensors. The
    collectives become ``torch.stack``, so the bits are those of ``size`` real ranks (what
    ``tools/bench_distributed_sim.py`` checks at real shapes on one GPU).
    """

    def __init__(self, size: int):
        self.size = checks.integer("size", size, minimum=1)

    def __repr__(self) -> str:
        return f"SimulatedGroup({self.size})"


Group = dist.ProcessGroup | SimulatedGroup | None


class Comm:
    """What the ops need of a group: its size, the ranks computed here, gathers and fixed-tree reductions."""

    def __init__(self, group: Group):
        self.group = group
        if isinstance(group, SimulatedGroup):
            self.simulated, self.size, self.ranks = True, group.size, list(range(group.size))
        elif group is None and not (dist.is_available() and dist.is_initialized()):
            self.simulated, self.size, self.ranks = False, 1, [0]  # no process group: one rank, no communication
        elif group is None or isinstance(group, dist.ProcessGroup):
            self.simulated = False
            self.size = dist.get_world_size(group)
            self.ranks = [dist.get_rank(group)]
        else:
            raise TypeError(
                f"group: expected a torch.distributed ProcessGroup, rlk.distributed.SimulatedGroup or "
                f"None, got {type(group).__name__}"
            )

    @property
    def local(self) -> bool:
        """All ranks in this process (simulated, or a group of one): collectives are local."""
        return self.simulated or self.size == 1

    def shards(self, name: str, x) -> list[Tensor]:
        """The per-rank values of a sharded argument computed here: ``[x]``, or the ``size`` tensors of a
        simulated group."""
        if not self.simulated:
            if not isinstance(x, Tensor):
                raise TypeError(f"{name}: expected a torch.Tensor (this rank's shard), got {type(x).__name__}")
            return [x]
        if isinstance(x, Tensor) or not isinstance(x, Sequence) or len(x) != self.size:
            got = type(x).__name__ if not isinstance(x, Sequence) else f"a sequence of {len(x)}"
            raise TypeError(
                f"{name}: with {self.group!r} expected a sequence of {self.size} tensors (one shard per "
                f"rank), got {got}"
            )
        for i, t in enumerate(x):
            if not isinstance(t, Tensor):
                raise TypeError(f"{name}[{i}]: expected a torch.Tensor, got {type(t).__name__}")
        return list(x)

    def result(self, per_rank: list):
        """A sharded result: the list (simulated) or this rank's value."""
        return per_rank if self.simulated else per_rank[0]

    def gather(self, local: list[Tensor]) -> Tensor:
        """``[size, *shape]``: every rank's tensor in rank order (identical on every rank)."""
        if self.local:
            return torch.stack([t.contiguous() for t in local])
        x = local[0].contiguous().view(1, *local[0].shape)
        out = x.new_empty((self.size, *x.shape[1:]))
        dist.all_gather_into_tensor(out.view(self.size, *x.shape[1:]), x, group=self.group)
        return out

    def reduce_rows(
        self,
        local: list[Tensor],
        combine: Callable[[Tensor, Tensor], None],
        out_dtype: torch.dtype,
        out_shape: tuple[int, ...] | None = None,
    ) -> Tensor:
        """``combine(parts, out)`` of every rank's ``[M, ...]`` tensor, ``parts`` ``[size, rows, ...]`` in rank
        order: ``combine`` works row by row (a tree over ranks, a bias, a rounding), so a real group runs it on
        ``M / size`` rows per rank (``all_to_all`` the rows, combine, ``all_gather`` the results: each rank sends
        and receives ``2 (size - 1) / size`` of the tensor, as a ring all-reduce does). Returns ``[M, ...]``
        (``out_shape``'s trailing dims when they differ from the parts') in ``out_dtype``, on every rank."""
        first = local[0]
        trailing = tuple(first.shape[1:]) if out_shape is None else tuple(out_shape[1:])
        if self.local:
            out = first.new_empty((first.shape[0], *trailing), dtype=out_dtype)
            combine(torch.stack([t.contiguous() for t in local]), out)
            return out
        m = first.shape[0]
        rows = -(-m // self.size)
        padded = first.new_zeros((self.size * rows, *first.shape[1:]))
        padded[:m] = first
        received = torch.empty_like(padded)
        dist.all_to_all_single(received, padded, group=self.group)
        chunk = first.new_empty((rows, *trailing), dtype=out_dtype)
        combine(received.view(self.size, rows, *first.shape[1:]), chunk)
        gathered = chunk.new_empty((self.size * rows, *trailing))
        dist.all_gather_into_tensor(gathered, chunk, group=self.group)
        return gathered[:m]
