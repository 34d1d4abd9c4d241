"""Fixed-order reductions shared by the loss kernels.

rlk aggregates per-token losses as ``loss = sum_i c[i] * sum_t m[i, t] * L[i, t]`` with per-row
weights ``c`` computed once, in PyTorch, by :mod:`rlk.reference.aggregation` (every backend
receives ``c``, so the aggregation modes and their normalizers are defined in one place). A
kernel then reduces in two fixed-order steps, with no atomics:

1. one program per row sums its tokens in ``BLOCK_T`` chunks (lane ``j`` of the accumulator
   takes tokens ``j, j + BLOCK_T, ...`` in order, then one ``tl.sum`` tree), and stores the
   row's partial, already multiplied by ``c[i]``;
2. one program sums the ``[N]`` row partials with :func:`fixed_order_sum`.

A row's partial depends only on that row, and the combine order depends only on ``N``, so the
result is deterministic run to run, and per-row quantities are batch-invariant.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: Lanes of the combine accumulator (any fixed value gives deterministic results).
COMBINE_BLOCK = 1024


@triton.jit
def fixed_order_sum(ptr, n, BLOCK: tl.constexpr):
    """``sum(ptr[0:n])`` in a fixed order: ``BLOCK`` lanes accumulate chunk by chunk, then a ``tl.sum`` tree.

    The accumulator has the pointer's element type (fp32 partials, int32 counts); ``n`` may be 0.
    """
    acc = tl.zeros((BLOCK,), ptr.dtype.element_ty)
    for i0 in range(0, n, BLOCK):
        offs = i0 + tl.arange(0, BLOCK).to(tl.int64)
        acc += tl.load(ptr + offs, mask=offs < n, other=0)
    return tl.sum(acc, axis=0)
