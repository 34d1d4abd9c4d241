"""Reference matmul primitives: the readable specification and ground truth.

Forward, for ``a`` ``[M, K]``, ``b`` ``[K, N]`` and an optional ``bias`` ``[N]``::

    out[i, j] = round( sum_k a[i, k] * b[k, j]  +  bias[j] )

with one rounding, to the output dtype (``a.dtype``), at the end (the reference's float64 result
goes through torch's cast, which may pass through float32 for 16-bit outputs). Backward, for an output
gradient ``g`` ``[M, N]``::

    grad_a    = g @ b.T        [M, K]
    grad_b    = a.T @ g        [K, N]
    grad_bias = sum_i g[i, :]  [N]

each rounded once to its tensor's dtype.

The reference computes every sum in float64 (the inputs upcast): a product of two float32
(or 16-bit) numbers is exact in float64 and the float64 sum of ``K`` such products is far more
accurate than the output dtype, so the stored value is the exact result rounded once (up to a
float64 error that no output dtype can see). float64 inputs are computed in float64. Work is
chunked (``COL_CHUNK`` columns of ``b`` upcast at a time, ``ROW_CHUNK`` rows of ``a`` per
product), so the extra memory is bounded whatever M, N and K are.

Tensor-parallel alignment (with :mod:`rlk.core.tensor_parallel` on; off, ``L = 1``: one plain ``K`` sum): the
``K`` sum of the forward (and the ``N`` sum of ``grad_a``) is cut into
``L = tree_leaves(K, MAX_TREE_LEAVES, MIN_LEAF)`` equal segments, each summed on its own, and the
segments' sums are added in the fixed binary tree of :func:`tree_reduce` before the bias and the
rounding. A row-parallel shard of ``P`` ranks (``P`` in 1, 2, 4, 8 dividing ``L``; rank ``r`` holds
``K`` columns ``[r K / P, (r + 1) K / P)``) is ``L / P`` whole segments, a subtree:
:func:`matmul_shard_fwd` computes its (unrounded) partial and :func:`matmul_combine` adds the ranks'
partials in the same tree, so ``rlk.distributed`` reproduces the single-device bits. ``grad_b``
(a sum over rows) is one segment.

``a`` and ``b`` may be any strided views (row-major, column-major, slices); outputs are written
through their own strides. Deterministic; the reference does not promise batch invariance.
"""

from __future__ import annotations

import torch

from rlk.core import tensor_parallel

ROW_CHUNK = 1024
COL_CHUNK = 1024

# ---------------------------------------------------------------------------
# the fixed reduction tree (shared with rlk.reference.logprob's vocab leaves)
# ---------------------------------------------------------------------------

#: At most this many ``K`` segments: the tensor-parallel degrees the reduction is aligned with are 1, 2, 4 and 8.
#: Read at every call (1: one segment, the plain ``K`` order).
MAX_TREE_LEAVES = 8
#: Segments are at least this long (a small ``K``, such as a head dim in ``bmm``, stays one segment).
MIN_LEAF = 128


def tree_leaves(n: int, max_leaves: int, min_leaf: int = 1) -> int:
    """The leaves of the fixed reduction tree over ``n`` elements: the largest power of two ``L <= max_leaves``
    that divides ``n`` into leaves of at least ``min_leaf`` elements (1 when none does)."""
    leaves = 1
    while 2 * leaves <= max_leaves and n % (2 * leaves) == 0 and n // (2 * leaves) >= min_leaf:
        leaves *= 2
    return leaves


def tree_reduce(leaf, n: int, merge):
    """``merge`` over ``leaf(0), ..., leaf(n - 1)`` in the fixed binary tree: a node of ``k > 1`` leaves is
    ``merge(left, right)`` with a left subtree of the largest power of two ``< k`` leaves (for ``n`` a power of
    two: the balanced tree). Any aligned block of ``2^j`` leaves is a subtree. Leaves are evaluated in order,
    at most ``log2(n) + 1`` partial results live at a time."""
    return _tree_node(leaf, merge, 0, n)


def _tree_node(leaf, merge, lo: int, hi: int):
    """The subtree of leaves ``[lo, hi)`` (a module function: a recursive closure would form a reference cycle
    that keeps the leaves' tensors alive until the garbage collector runs)."""
    if hi - lo == 1:
        return leaf(lo)
    mid = lo + (1 << ((hi - lo - 1).bit_length() - 1))
    return merge(_tree_node(leaf, merge, lo, mid), _tree_node(leaf, merge, mid, hi))


def _leaves(k: int) -> int:
    """The ``K`` segments of a product over ``k``: the tree's with ``rlk.core.tensor_parallel`` on, else 1."""
    return tree_leaves(k, tensor_parallel.max_matmul_leaves(MAX_TREE_LEAVES), MIN_LEAF)


def _tree_product(a: torch.Tensor, b: torch.Tensor, leaves: int) -> torch.Tensor:
    """``a @ b`` in float64, the ``K`` sum cut into ``leaves`` equal segments added in the fixed tree. Each
    segment's operands are fresh contiguous float64 copies, so a segment's product does not depend on where
    the segment sits in memory."""
    seg = a.shape[1] // leaves

    def leaf(j: int) -> torch.Tensor:
        ks = slice(j * seg, (j + 1) * seg)
        return a[:, ks].to(torch.float64, copy=True) @ b[ks].to(torch.float64, copy=True)

    return tree_reduce(leaf, leaves, lambda x, y: x + y)


def _product(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, leaves: int = 1) -> None:
    """``out = a @ b (+ bias)`` with float64 sums over ``leaves`` ``K`` segments, rounded once to ``out.dtype``
    (not rounded when ``out`` is float64: a shard's partial)."""
    m, n = a.shape[0], b.shape[1]
    for c0 in range(0, n, COL_CHUNK):
        c1 = min(n, c0 + COL_CHUNK)
        bias64 = None if bias is None else bias[c0:c1].to(torch.float64)
        for r0 in range(0, m, ROW_CHUNK):
            r1 = min(m, r0 + ROW_CHUNK)
            acc = _tree_product(a[r0:r1], b[:, c0:c1], leaves)
            if bias64 is not None:
                acc += bias64
            out[r0:r1, c0:c1] = acc


def error_scale(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The numerical contract's per-element scale of ``a @ b + bias``: ``(|a| @ |b|) + |bias|`` in float64.

    A sum of products accumulated in fp32 and rounded once to the output dtype is off by at most
    about ``(K * eps_fp32 + eps_out) * scale`` (``eps_out`` the output dtype's unit roundoff), whatever
    cancellation the signs cause; tolerances are ``atol + rtol * scale``. For ``grad_a`` use
    ``error_scale(grad_out, b.T)``, for ``grad_b`` ``error_scale(a.T, grad_out)``.
    """
    scale = torch.empty((a.shape[0], b.shape[1]), dtype=torch.float64, device=a.device)
    _product(a.abs(), b.abs(), None if bias is None else bias.abs(), scale)
    return scale


def matmul_fwd(a, b, bias, out):
    """``out = a @ b + bias`` (bias optional), float64 sums, one rounding to ``out.dtype``.

    Args:
        a: ``[M, K]`` float (any strides).
        b: ``[K, N]``, ``a.dtype`` (any strides; ``linear`` passes ``weight.t()``).
        bias: ``[N]``, ``a.dtype``, or None.
        out: ``[M, N]``, ``a.dtype``, written.
    """
    _product(a, b, bias, out, _leaves(a.shape[1]))


def matmul_bwd(grad_out, a, b, grad_a_out, grad_b_out, grad_bias_out):
    """Gradients of ``sum(grad_out * (a @ b + bias))``; a None output is not computed.

    Args:
        grad_out: ``[M, N]``, ``a.dtype``.
        a, b: the forward's inputs.
        grad_a_out: ``[M, K]`` or None, written ``grad_out @ b.T``.
        grad_b_out: ``[K, N]`` or None, written ``a.T @ grad_out``.
        grad_bias_out: ``[N]`` or None, written ``grad_out.sum(0)``.
    """
    if grad_a_out is not None:
        _product(grad_out, b.T, None, grad_a_out, _leaves(grad_out.shape[1]))
    if grad_b_out is not None:
        _product(a.T, grad_out, None, grad_b_out)
    if grad_bias_out is not None:
        acc = torch.zeros(grad_out.shape[1], dtype=torch.float64, device=grad_out.device)
        for r0 in range(0, grad_out.shape[0], ROW_CHUNK):
            acc += grad_out[r0 : r0 + ROW_CHUNK].to(torch.float64).sum(dim=0)
        grad_bias_out.copy_(acc)


def partial_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a row-parallel shard's partial product: float64 (the reference's sums)."""
    return torch.float64


def matmul_shard_fwd(a, b, leaves, partial_out):
    """A shard's unrounded partial ``a @ b`` over ``leaves`` whole ``K`` segments of the full product's tree.

    Args:
        a: ``[M, K_s]``, the shard's columns of the full ``a``; b: ``[K_s, N]``, its rows of the full ``b``.
        leaves: the full tree's segments in the shard (``tree_leaves(K) / P``).
        partial_out: ``[M, N]`` in :func:`partial_dtype`, written.
    """
    _product(a, b, None, partial_out, leaves)


def matmul_combine(partials, bias, out):
    """``out = round(tree(partials) + bias)``: the shards' partials ``[P, M, N]`` (shard order) added in the fixed
    tree, the bias added, one rounding to ``out.dtype``: the bits of :func:`matmul_fwd` on the full operands."""
    acc = tree_reduce(lambda j: partials[j], partials.shape[0], lambda x, y: x + y)
    if bias is not None:
        acc = acc + bias.to(acc.dtype)
    out.copy_(acc)
