"""The tensor-parallel reduction order of ``matmul`` / ``linear``: off by default, one process-wide switch.

With the switch on, every backend's matmul (forward, and the ``grad_a`` of its backward) cuts its ``K``
sum into ``tree_leaves(K)`` segments added in a fixed binary tree (:mod:`rlk.reference.matmul`), so that
a row-parallel shard of ``P`` ranks (``P`` dividing the leaves) computes a subtree of the single-device
sum and :mod:`rlk.distributed` reproduces the single-device bits. With it off (the default), ``K`` is one
segment: the plain, faster order, still batch-invariant and deterministic, but other bits than the tree's,
so ``rlk.distributed.row_parallel_linear`` / ``column_parallel_linear`` refuse to run at ``P > 1``.

The tree costs 1.3-1.9x on the Triton matmul at the Qwen3-8B projections on an H200 (``docs/distributed.md``);
``linear_logprob``'s vocab tree is always on (it costs nothing measurable there).

Set it once per process, on every process whose numbers are compared (rollout and training ranks), before
the first forward: the backward reads the setting when it runs (on autograd's own threads), so it must not
change between a forward and its backward. ``RLK_TENSOR_PARALLEL_INVARIANT=1`` turns it on at import.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

from rlk.core import checks

ENV_VAR = "RLK_TENSOR_PARALLEL_INVARIANT"

_enabled = os.environ.get(ENV_VAR, "0") not in ("", "0")


def set_tensor_parallel_invariant(enabled: bool) -> None:
    """Turn the tree-ordered ``K`` sum of ``matmul`` / ``linear`` on or off for this process (module docstring)."""
    global _enabled
    _enabled = checks.flag("enabled", enabled)


def is_tensor_parallel_invariant() -> bool:
    """Whether ``matmul`` / ``linear`` sum ``K`` in the tensor-parallel tree (``RLK_TENSOR_PARALLEL_INVARIANT``)."""
    return _enabled


@contextlib.contextmanager
def tensor_parallel_invariant(enabled: bool = True) -> Iterator[None]:
    """``set_tensor_parallel_invariant(enabled)`` inside the block, the previous setting after it. Process-wide
    (not per thread): run the backward of a forward inside the same block."""
    previous = _enabled
    set_tensor_parallel_invariant(enabled)
    try:
        yield
    finally:
        set_tensor_parallel_invariant(previous)


def max_matmul_leaves(max_tree_leaves: int) -> int:
    """The most ``K`` segments a matmul may use now: ``max_tree_leaves`` (the backend's tree) when the switch is
    on, else 1."""
    return max_tree_leaves if _enabled else 1
