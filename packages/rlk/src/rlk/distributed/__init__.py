"""rlk.distributed: tensor-, sequence- and data-parallel rlk ops whose results are bitwise the same at any degree.

Built on ``torch.distributed`` (gloo on CPU, NCCL on GPUs); collectives move bits only, every sum runs
in this process in the fixed tree of :func:`tree_sum`, and the single-device kernels reduce in the same
leaves and tree (vocab leaves of ``linear_logprob``, ``K`` segments of ``matmul``), so a shard's partial
is a subtree of the single-device sum. What is invariant across which changes: ``docs/distributed.md``.
"""

from __future__ import annotations

from rlk.distributed.attention import context_parallel_attention
from rlk.distributed.group import SimulatedGroup
from rlk.distributed.logprob import vocab_parallel_linear_logprob
from rlk.distributed.matmul import column_parallel_linear, row_parallel_linear
from rlk.distributed.normalizers import global_normalizers, sequence_token_counts
from rlk.distributed.reduce import GradientTree, all_reduce_fixed, tree_sum

__all__ = [
    "GradientTree",
    "SimulatedGroup",
    "all_reduce_fixed",
    "column_parallel_linear",
    "context_parallel_attention",
    "global_normalizers",
    "row_parallel_linear",
    "sequence_token_counts",
    "tree_sum",
    "vocab_parallel_linear_logprob",
]
