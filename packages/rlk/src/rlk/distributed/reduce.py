"""Deterministic sums across ranks and micro-batches: one fixed binary tree, whatever arrives first.

``tree_sum`` is the tree every reduction of rlk follows (the kernels' vocab leaves and ``K`` segments
too): a node of ``k > 1`` leaves adds its left subtree, the largest power of two ``< k`` leaves, to its
right subtree. :func:`all_reduce_fixed` sums a tensor over the ranks of a group in that tree (over the
rank index); :class:`GradientTree` sums gradients over the *global micro-batch index* of an optimizer
step, so data-parallel degree, the micro-batches each rank runs and the order they finish in do not
change a bit of the result.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from rlk.core import checks
from rlk.distributed.group import Comm, Group


def tree_reduce(leaf: Callable[[int], object], n: int, merge: Callable[[object, object], object]):
    """``merge`` over ``leaf(0), ..., leaf(n - 1)`` in the fixed tree (left subtree: the largest power of two
    ``< k`` of a node's ``k`` leaves; for ``n`` a power of two the balanced tree, in which any aligned block of
    ``2^j`` leaves is a subtree). Leaves are evaluated in order."""

    def node(lo: int, hi: int):
        if hi - lo == 1:
            return leaf(lo)
        mid = _split(lo, hi)
        return merge(node(lo, mid), node(mid, hi))

    return node(0, n)


def _split(lo: int, hi: int) -> int:
    return lo + (1 << ((hi - lo - 1).bit_length() - 1))


def tree_sum(parts: Tensor | Sequence[Tensor]) -> Tensor:
    """``parts[0] + ... + parts[n - 1]`` (a stacked ``[n, ...]`` tensor or a sequence) added in the fixed tree,
    in the parts' dtype. ``tree_sum([a, b, c, d]) = (a + b) + (c + d)``, ``tree_sum([a, b, c]) = (a + b) + c``."""
    n = len(parts)
    if n == 0:
        raise ValueError("parts: expected at least one tensor")
    return tree_reduce(lambda j: parts[j], n, lambda a, b: a + b)


def all_reduce_fixed(tensor, group: Group = None):
    """Sum ``tensor`` over the ranks of ``group`` in place, in the fixed tree over the rank index; returns it.

    Unlike ``torch.distributed.all_reduce`` the result does not depend on the order partial sums arrive in,
    the algorithm NCCL or gloo picks, or the topology: it is ``tree_sum`` of the ranks' tensors (bitwise the
    same on every rank, and the same as :func:`tree_sum` of the tensors in one process). Communication: the
    tensor's elements are split among the ranks (``all_to_all``), each rank sums its share in the tree and
    the sums are gathered (``all_gather``): ``2 (P - 1) / P`` of the tensor sent per rank, as a ring
    all-reduce; memory: two copies. With a :class:`~rlk.distributed.SimulatedGroup`, ``tensor`` is the
    sequence of the ranks' tensors and every one of them receives the sum.
    """
    comm = Comm(group)
    local = comm.shards("tensor", tensor)
    first = local[0]
    for i, t in enumerate(local):
        if t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
            raise ValueError(
                f"tensor[{i}]: expected the shape, dtype and device of tensor[0], got "
                f"{tuple(t.shape)} {t.dtype} {t.device}"
            )

    def combine(parts: Tensor, out: Tensor) -> None:
        out.copy_(tree_sum(parts))

    total = comm.reduce_rows([t.reshape(-1, 1) for t in local], combine, first.dtype)
    for t in local:
        t.copy_(total.view(t.shape))
    return tensor


# ---------------------------------------------------------------------------
# gradients over the global micro-batch index
# ---------------------------------------------------------------------------

Grads = list[Tensor | None]


class GradientTree:
    """Sum per-micro-batch gradients of one optimizer step in the fixed tree over the global micro-batch index.

    The step's global batch is ``num_micro_batches`` micro-batches, numbered ``0 .. n - 1`` across all
    data-parallel ranks. Each rank runs some of them (any subset, in any order) and calls
    :meth:`add` with the micro-batch's index and its gradients (e.g. ``torch.autograd.grad`` results, or
    each parameter's ``.grad`` set to None in between: never gradients accumulated by autograd across
    micro-batches, which sums them in arrival order). Completed subtrees are added at once, so a rank holds
    one partial per maximal subtree it owns. :meth:`reduce` finishes the tree over ``group``: when every
    rank owns one aligned block of ``n / P`` micro-batches (``n / P`` a power of two) that is
    :func:`all_reduce_fixed` of one partial per rank; otherwise the ranks exchange their partial subtrees
    and each finishes the tree itself. The result is bitwise the same for any data-parallel degree and any
    assignment of micro-batches to ranks, and on every rank.

    ``grads`` is a list of tensors (or None, consistently for a parameter without gradient); the partial
    sums are new tensors, the caller's are only read.
    """

    def __init__(self, num_micro_batches: int, group: Group = None):
        self.n = checks.integer("num_micro_batches", num_micro_batches, minimum=1)
        self.comm = Comm(group)
        if self.comm.simulated:
            raise TypeError(
                "group: GradientTree runs on a real process group (or None); a simulated group holds "
                "every micro-batch in one process, where the tree needs no communication (use None)"
            )
        self._nodes: dict[tuple[int, int], Grads] = {}
        self._structure: list[tuple[tuple[int, ...], torch.dtype, torch.device] | None] | None = None

    def _check(self, grads: Sequence[Tensor | None]) -> Grads:
        grads = list(grads)
        structure = [None if g is None else (tuple(g.shape), g.dtype, g.device) for g in grads]
        for i, g in enumerate(grads):
            if g is not None and not isinstance(g, Tensor):
                raise TypeError(f"grads[{i}]: expected a torch.Tensor or None, got {type(g).__name__}")
        if self._structure is None:
            self._structure = structure
        elif structure != self._structure:
            raise ValueError("grads: expected the shapes, dtypes and devices (and Nones) of the first add()")
        return grads

    def _parent(self, node: tuple[int, int]) -> tuple[int, int] | None:
        lo, hi = 0, self.n
        parent = None
        while (lo, hi) != node:
            parent = (lo, hi)
            mid = _split(lo, hi)
            lo, hi = (lo, mid) if node[1] <= mid else (mid, hi)
        return parent

    def add(self, index: int, grads: Sequence[Tensor | None]) -> None:
        """The gradients of micro-batch ``index`` (global numbering, in ``[0, num_micro_batches)``)."""
        index = checks.integer("index", index, minimum=0)
        if index >= self.n:
            raise ValueError(f"index: expected a micro-batch index < num_micro_batches={self.n}, got {index}")
        grads = self._check(grads)
        node = (index, index + 1)
        if any(lo <= index < hi for lo, hi in self._nodes):
            raise ValueError(f"index: micro-batch {index} was added already")
        value = [None if g is None else g.clone() for g in grads]
        while True:
            parent = self._parent(node)
            if parent is None:
                break
            mid = _split(*parent)
            left, right = (parent[0], mid), (mid, parent[1])
            sibling = right if node == left else left
            if sibling not in self._nodes:
                break
            other = self._nodes.pop(sibling)
            a, b = (value, other) if node == left else (other, value)
            value = [None if x is None else x + y for x, y in zip(a, b)]
            node = parent
        self._nodes[node] = value

    def local_nodes(self) -> list[tuple[int, int]]:
        """The maximal subtrees ``(first, end)`` whose micro-batches this rank has added."""
        return sorted(self._nodes)

    def _finish(self, known: dict[tuple[int, int], Grads]) -> Grads:
        def value(lo: int, hi: int) -> Grads:
            if (lo, hi) in known:
                return known[(lo, hi)]
            if hi - lo == 1:
                raise ValueError(f"GradientTree.reduce: micro-batch {lo} was added on no rank")
            mid = _split(lo, hi)
            a, b = value(lo, mid), value(mid, hi)
            return [None if x is None else x + y for x, y in zip(a, b)]

        return value(0, self.n)

    def reduce(self) -> Grads:
        """The step's gradient sum (the same bits on every rank); call once, on every rank of the group."""
        comm = self.comm
        if comm.local:
            return self._finish(dict(self._nodes))
        nodes = self.local_nodes()
        everyone: list = [None] * comm.size
        dist.all_gather_object(everyone, (nodes, self._structure), group=comm.group)
        structure = next((s for _, s in everyone if s is not None), None)
        if structure is None:
            raise ValueError("GradientTree.reduce: no rank added a micro-batch")
        all_nodes = [node for rank_nodes, _ in everyone for node in rank_nodes]
        covered = sorted(all_nodes)
        if [lo for lo, _ in covered] != [0] + [hi for _, hi in covered[:-1]] or covered[-1][1] != self.n:
            raise ValueError(
                f"GradientTree.reduce: the ranks' micro-batches {covered} do not cover [0, {self.n}) exactly once"
            )
        block = self.n // comm.size
        aligned = (
            self.n % comm.size == 0
            and block & (block - 1) == 0
            and all(rank_nodes == [(r * block, (r + 1) * block)] for r, (rank_nodes, _) in enumerate(everyone))
        )
        if aligned:
            (grads,) = self._nodes.values()
            return [None if g is None else all_reduce_fixed(g, comm.group) for g in grads]
        known: dict[tuple[int, int], Grads] = {}
        for src, (rank_nodes, _) in enumerate(everyone):
            for node in rank_nodes:
                if src == comm.ranks[0]:
                    grads = self._nodes[node]
                else:
                    grads = [None if s is None else torch.empty(s[0], dtype=s[1], device=s[2]) for s in structure]
                for g in grads:
                    if g is not None:
                        dist.broadcast(g, group_src=src, group=comm.group)
                known[node] = grads
        return self._finish(known)
