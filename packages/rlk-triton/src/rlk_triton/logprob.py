"""Triton kernels of the log-prob ops: ``selected_logprob`` and ``linear_logprob``.

The math is the spec in :mod:`rlk.reference.logprob`. For a row with scaled
logits ``z = x * inv_temperature`` over ``V`` vocab entries and target ``y``::

    lse     = logsumexp_v z_v
    logprob = z_y - lse
    entropy = lse - sum_v p_v z_v,            p = softmax(z)

computed online over vocab tiles with a running max ``m`` (starts at -inf),
``s = sum_v exp(z_v - m)`` and ``b = sum_v (z_v - m) exp(z_v - m)`` (<= 0, kept
relative to ``m``: when ``m`` grows to ``m'``, ``b' = (b + (m - m') s) exp(m - m')``);
``lse = m + log s``, ``entropy = log s - b / s`` (two terms >= 0: no cancellation
of two numbers of size ``|z|``, and never negative), ``logprob = (z_y - m) - log s``
(two terms <= 0: its rounding follows the log-prob, not ``|z|``; the reference's
module docstring says why). The vocab-split partials merge the same way.
Gradients with respect to the unscaled logits ``x``::

    dx_v = inv_t * (g_lp * (onehot(y)_v - p_v) + g_H * p_v * ((lse - H) - z_v))

where the entropy term counts as 0 where ``p_v == 0`` (so -inf logits are fine).
For ``linear_logprob`` the logits are ``x = hidden @ weight.T``; the kernels never
materialize ``[N, V]``: ``grad_hidden = G @ weight`` and ``grad_weight = G.T @ hidden``
are accumulated over fixed vocab chunks of ``G = d loss / d x``.

Vocab-parallel alignment (``linear_logprob``): the vocabulary is cut into ``L = tree_leaves(V)``
equal leaves (the largest power of two <= 8 dividing ``V``); the forward's vocab splits and the
backward's vocab chunks restart at every leaf boundary, a leaf merges its splits in order and the
leaves are merged in the fixed binary tree of :func:`rlk_triton.matmul.tree_reduce` (``grad_hidden``:
its leaves' fp32 sums added in that tree). A vocab shard of ``P`` ranks (``P`` in 1, 2, 4, 8) is
``L / P`` whole leaves, a subtree, so the ``*_shard_*`` / ``*_combine_*`` entry points that
``rlk.distributed`` calls reproduce the single-device bits. Spec: :mod:`rlk.reference.logprob`.

Batch invariance by construction: every tile size is fixed per dtype in
:data:`TILE_CONFIGS` (no autotuning, nothing derived from ``N``), a row's result
is computed by the same instruction sequence whatever the other rows and its
position in a row block, there are no atomics and every reduction (over vocab
tiles, vocab splits, vocab chunks, the ``K`` loop of a GEMM) runs in a fixed
order. ``grad_weight`` sums rows in a fixed partition and order, so it is
deterministic run to run. Accumulation is fp32; fp32 inputs use IEEE fp32 dots
(no TF32); 16-bit inputs use tensor-core dots with fp32 accumulators.

Ignored rows (``target == ignore_index``) give logprob 0, entropy 0, lse 0 and
zero gradients.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlk_triton.common import dot, grouped_tile, on_device
from rlk_triton.matmul import BACKWARD_TILE_CONFIGS, _gemm, tree_leaves, tree_reduce

#: Fixed tile configuration per kernel family and input dtype; the launchers read it
#: at every call, so a sweep may overwrite entries (kernels recompile per config).
#: Nothing here depends on the batch size: that is what makes results batch-invariant.
#:
#: * ``"selected"``: ``selected_logprob`` fwd/bwd, one program per row looping over the
#:   vocab in ``BLOCK_V`` chunks.
#: * ``"linear_fwd"``: the ``linear_logprob`` forward. A program owns ``BLOCK_N`` rows and
#:   one vocab split of ``VOCAB_SPLIT`` columns (a multiple of ``BLOCK_V``; the last split of a
#:   leaf may be shorter), walked in tiles of ``BLOCK_V`` columns, each computed by a ``K`` loop
#:   over the hidden size in ``BLOCK_K`` steps; a leaf's splits are merged in split order, the
#:   leaves in the fixed tree. ``GROUP_N`` row blocks are scheduled together so that concurrent
#:   programs share weight tiles in L2 (no effect on the numbers).
#: * ``"linear_bwd"``: the backward walks each leaf of the vocab in chunks of ``VOCAB_CHUNK``
#:   columns; its grad-logits kernel computes one ``BLOCK_N x BLOCK_V`` tile per program.
#:
#: The backward's GEMMs (``grad_hidden``, ``grad_weight``) are :func:`rlk_triton.matmul._gemm` with the tiles of
#: :data:`rlk_triton.matmul.BACKWARD_TILE_CONFIGS`.
#:
#: Compile option of every kernel that forms ``z = x * inv_temperature``: the ABI makes it one rounded fp32
#: multiply in every backend, and LLVM would otherwise contract it with the next subtraction
#: (``fma(x, inv_t, -lse)``, seen in the sm_90 PTX), so that ``p_target = exp(z - lse)`` could exceed 1.
_NO_FP_FUSION = {"enable_fp_fusion": False}

TILE_CONFIGS: dict[str, dict[torch.dtype, dict[str, int]]] = {
    "selected": {
        torch.float32: {"BLOCK_V": 2048, "num_warps": 8},
        torch.float16: {"BLOCK_V": 4096, "num_warps": 8},
        torch.bfloat16: {"BLOCK_V": 4096, "num_warps": 8},
    },
    "linear_fwd": {
        torch.float32: {
            "BLOCK_N": 64,
            "BLOCK_V": 64,
            "BLOCK_K": 32,
            "VOCAB_SPLIT": 4096,
            "GROUP_N": 32,
            "num_warps": 4,
            "num_stages": 2,
        },
        torch.float16: {
            "BLOCK_N": 128,
            "BLOCK_V": 256,
            "BLOCK_K": 64,
            "VOCAB_SPLIT": 4096,
            "GROUP_N": 8,
            "num_warps": 8,
            "num_stages": 3,
        },
        torch.bfloat16: {
            "BLOCK_N": 128,
            "BLOCK_V": 256,
            "BLOCK_K": 64,
            "VOCAB_SPLIT": 4096,
            "GROUP_N": 8,
            "num_warps": 8,
            "num_stages": 3,
        },
    },
    "linear_bwd": {
        torch.float32: {
            "BLOCK_N": 64,
            "BLOCK_V": 64,
            "BLOCK_K": 32,
            "VOCAB_CHUNK": 4096,
            "GROUP_N": 32,
            "num_warps": 4,
            "num_stages": 2,
        },
        torch.float16: {
            "BLOCK_N": 128,
            "BLOCK_V": 128,
            "BLOCK_K": 64,
            "VOCAB_CHUNK": 4096,
            "GROUP_N": 8,
            "num_warps": 8,
            "num_stages": 4,
        },
        torch.bfloat16: {
            "BLOCK_N": 128,
            "BLOCK_V": 128,
            "BLOCK_K": 64,
            "VOCAB_CHUNK": 4096,
            "GROUP_N": 8,
            "num_warps": 8,
            "num_stages": 4,
        },
    },
    # linear_logprob_stored_bwd: "stored_grad", the in-place G pass (one program per row, BLOCK_V columns per
    # step); its GEMMs use rlk_triton.matmul.BACKWARD_TILE_CONFIGS.
    "stored_grad": {
        torch.float32: {"BLOCK_V": 2048, "num_warps": 8},
        torch.float16: {"BLOCK_V": 4096, "num_warps": 8},
        torch.bfloat16: {"BLOCK_V": 4096, "num_warps": 8},
    },
}

#: At most this many vocab leaves (:func:`rlk_triton.matmul.tree_leaves`): the vocab-parallel degrees the
#: reduction is aligned with are 1, 2, 4 and 8. Read at every call; 1 gives one leaf, the split order of the
#: kernels before the tree (``tools/bench_distributed_sim.py`` measures both).
MAX_TREE_LEAVES = 8

#: Rows per program of the forward's split-combine kernel (per-row work; any value gives the same bits).
_COMBINE_ROWS = 128


# ----------------------------------------------------------------------------------------------
# Shared device helpers
# ----------------------------------------------------------------------------------------------


@triton.jit
def _moved(m, s, b, shift):
    """A state ``(m, s, b)`` moved to the max ``shift >= m``: ``(s * r, (b + (m - shift) * s) * r)``,
    ``r = exp(m - shift)``; 0 where ``r`` is 0 (``m = -inf``, ``s = 0``: no ``0 * -inf``)."""
    r = tl.exp(m - shift)
    return s * r, tl.where(r > 0, (b + (m - shift) * s) * r, 0.0)


@triton.jit
def _online_update(m, s, b, z):
    """One tile of the reference's online ``(m, s, b)`` update, ``s`` and ``b`` relative to ``m``.

    ``z`` is ``[R, C]`` fp32 (-inf in masked columns); ``m, s, b`` are ``[R]``. While a
    row's max is -inf the shift is 0, so no ``exp((-inf) - (-inf))``; ``0 * -inf`` is 0.
    """
    m_new = tl.maximum(m, tl.max(z, axis=1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    s, b = _moved(m, s, b, shift)
    d = z - shift[:, None]  # <= 0
    e = tl.exp(d)
    s = s + tl.sum(e, axis=1)
    b = b + tl.sum(tl.where(e > 0, d * e, 0.0), axis=1)
    return m_new, s, b


@triton.jit
def _merge(m, s, b, m2, s2, b2):
    """Merge two online states, each moved to the common max (same -inf convention as :func:`_online_update`)."""
    m_new = tl.maximum(m, m2)
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    s_a, b_a = _moved(m, s, b, shift)
    s_b, b_b = _moved(m2, s2, b2, shift)
    return m_new, s_a + s_b, b_a + b_b


@triton.jit
def _entropy(s, b):
    """``log s - b / s`` of a final state (``s >= 1``, ``b <= 0``: both terms >= 0)."""
    return tl.log(s) - b / s


@triton.jit
def _grad_z(z, is_target, lse, g_lp, mean_z, g_ent, HAS_ENT: tl.constexpr):
    """``d loss / d z`` for a tile: ``g_lp * (onehot - p) + g_H * p * (E_p[z] - z)`` (0 where p == 0).

    ``z`` is ``[R, C]``; the per-row operands are ``[R, 1]``; ``mean_z = lse - entropy``.
    """
    p = tl.exp(z - lse)
    g = -g_lp * p
    g = tl.where(is_target, g + g_lp, g)
    if HAS_ENT:
        g = g + tl.where(p > 0, g_ent * p * (mean_z - z), 0.0)
    return g


@triton.jit
def _linear_logits_tile(
    hidden_ptr,
    weight_ptr,
    rows,
    row_mask,
    cols,
    col_mask,
    H,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    """``hidden[rows] @ weight[cols].T`` as a ``[BLOCK_N, BLOCK_V]`` fp32 tile, K loop in fixed order.

    ``rows`` and ``cols`` are int64. Masked rows/columns read zeros.
    """
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    h_ptrs = hidden_ptr + rows[:, None] * H
    w_ptrs = weight_ptr + cols[None, :] * H
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_mask = ks < H
        h = tl.load(h_ptrs + ks[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs + ks[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0)
        acc = dot(h, w, acc, IEEE)
    return acc


# ----------------------------------------------------------------------------------------------
# selected_logprob: one program per row, vocab loop in BLOCK_V chunks (memory-bound)
# ----------------------------------------------------------------------------------------------


@triton.jit
def _selected_fwd_kernel(
    logits_ptr,
    targets_ptr,
    inv_t_ptr,
    logprob_ptr,
    entropy_ptr,
    lse_ptr,
    V,
    ignore_index,
    HAS_ENTROPY: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)  # this program's row, as a [1] tensor
    tgt = tl.load(targets_ptr + rows)
    valid = tgt != ignore_index
    inv_t = tl.load(inv_t_ptr + rows)
    row_ptr = logits_ptr + rows[:, None] * V
    m = tl.full((1,), float("-inf"), tl.float32)
    s = tl.zeros((1,), tl.float32)
    b = tl.zeros((1,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_mask = cols[None, :] < V
        x = tl.load(row_ptr + cols[None, :], mask=col_mask & valid[:, None], other=0.0)
        z = tl.where(col_mask, x.to(tl.float32) * inv_t[:, None], float("-inf"))
        m, s, b = _online_update(m, s, b, z)
    safe_tgt = tl.where(valid, tgt, 0)
    z_tgt = tl.load(logits_ptr + rows * V + safe_tgt, mask=valid, other=0.0).to(tl.float32) * inv_t
    log_s = tl.log(s)
    lse = m + log_s
    tl.store(logprob_ptr + rows, tl.where(valid, (z_tgt - m) - log_s, 0.0))
    tl.store(lse_ptr + rows, tl.where(valid, lse, 0.0))
    if HAS_ENTROPY:
        tl.store(entropy_ptr + rows, tl.where(valid, _entropy(s, b), 0.0))


@triton.jit
def _selected_bwd_kernel(
    logits_ptr,
    targets_ptr,
    inv_t_ptr,
    lse_ptr,
    entropy_ptr,
    g_lp_ptr,
    g_ent_ptr,
    grad_ptr,
    V,
    ignore_index,
    HAS_ENT: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)
    tgt = tl.load(targets_ptr + rows)
    valid = tgt != ignore_index
    inv_t = tl.load(inv_t_ptr + rows)[:, None]
    lse = tl.load(lse_ptr + rows)[:, None]
    g_lp = tl.load(g_lp_ptr + rows)[:, None]
    mean_z = lse
    g_ent = g_lp
    if HAS_ENT:
        mean_z = lse - tl.load(entropy_ptr + rows)[:, None]
        g_ent = tl.load(g_ent_ptr + rows)[:, None]
    row_off = rows[:, None] * V
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_mask = cols[None, :] < V
        x = tl.load(logits_ptr + row_off + cols[None, :], mask=col_mask & valid[:, None], other=0.0)
        z = x.to(tl.float32) * inv_t
        g = _grad_z(z, cols[None, :] == tgt[:, None], lse, g_lp, mean_z, g_ent, HAS_ENT)
        g = tl.where(valid[:, None], g * inv_t, 0.0)
        tl.store(grad_ptr + row_off + cols[None, :], g.to(grad_ptr.dtype.element_ty), mask=col_mask)


def selected_logprob_fwd(logits, targets, inv_temperature, ignore_index, logprob_out, entropy_out, lse_out):
    """Log-prob of the target, entropy and lse of ``softmax(logits * inv_temperature)`` per row.

    Args:
        logits: ``[N, V]`` fp32 / fp16 / bf16, contiguous.
        targets: ``[N]`` int64; rows equal to ``ignore_index`` are ignored.
        inv_temperature: ``[N]`` fp32, per-row ``1 / T``.
        ignore_index: the ignored-row marker.
        logprob_out: ``[N]`` fp32, written ``(z_y - m) - log s`` (``z_y - lse`` relative to the max; 0 on
            ignored rows).
        entropy_out: ``[N]`` fp32 or None (then the entropy is not stored), written ``lse - E_p[z]``.
        lse_out: ``[N]`` fp32, written ``logsumexp(z)`` (0 on ignored rows), for the backward.

    Spec: :func:`rlk.reference.logprob.selected_logprob_fwd`. One program per row.
    """
    n_rows, vocab = logits.shape
    cfg = TILE_CONFIGS["selected"][logits.dtype]
    has_entropy = entropy_out is not None
    with on_device(logits.device):
        _selected_fwd_kernel[(n_rows,)](
            logits,
            targets,
            inv_temperature,
            logprob_out,
            entropy_out if has_entropy else logprob_out,
            lse_out,
            vocab,
            ignore_index,
            HAS_ENTROPY=has_entropy,
            BLOCK_V=cfg["BLOCK_V"],
            num_warps=cfg["num_warps"],
            **_NO_FP_FUSION,
        )


def selected_logprob_bwd(
    logits, targets, inv_temperature, lse, entropy, grad_logprob, grad_entropy, ignore_index, grad_logits_out
):
    """Gradient of ``sum(grad_logprob * logprob + grad_entropy * entropy)`` w.r.t. the logits.

    Args:
        logits, targets, inv_temperature, ignore_index: as in :func:`selected_logprob_fwd`.
        lse: ``[N]`` fp32 from the forward.
        entropy: ``[N]`` fp32 from the forward; needed when ``grad_entropy`` is given.
        grad_logprob: ``[N]`` fp32.
        grad_entropy: ``[N]`` fp32 or None (no entropy term).
        grad_logits_out: ``[N, V]`` in ``logits.dtype``, written
            ``inv_t * (g_lp * (onehot - p) + g_H * p * ((lse - H) - z))``; 0 on ignored rows.

    Spec: :func:`rlk.reference.logprob.selected_logprob_bwd`. One program per row, one pass over V.
    """
    n_rows, vocab = logits.shape
    cfg = TILE_CONFIGS["selected"][logits.dtype]
    has_ent = grad_entropy is not None
    if has_ent and entropy is None:
        raise ValueError("selected_logprob_bwd: grad_entropy needs the forward's entropy")
    with on_device(logits.device):
        _selected_bwd_kernel[(n_rows,)](
            logits,
            targets,
            inv_temperature,
            lse,
            entropy if has_ent else lse,
            grad_logprob,
            grad_entropy if has_ent else grad_logprob,
            grad_logits_out,
            vocab,
            ignore_index,
            HAS_ENT=has_ent,
            BLOCK_V=cfg["BLOCK_V"],
            num_warps=cfg["num_warps"],
            **_NO_FP_FUSION,
        )


# ----------------------------------------------------------------------------------------------
# linear_logprob forward: (row block x vocab split) partials, then a fixed-order split combine
# ----------------------------------------------------------------------------------------------


@triton.jit
def _linear_fwd_partial_kernel(
    hidden_ptr,
    weight_ptr,
    targets_ptr,
    inv_t_ptr,
    part_m_ptr,
    part_s_ptr,
    part_b_ptr,
    z_tgt_ptr,
    logits_ptr,
    N,
    H,
    leaf_size,
    splits_per_leaf,
    n_splits,
    logits_stride,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    VOCAB_SPLIT: tl.constexpr,
    GROUP_N: tl.constexpr,
    IEEE: tl.constexpr,
    STORE_LOGITS: tl.constexpr,
):
    """Online ``(m, s, b)`` of ``BLOCK_N`` rows over one vocab split; stores the target logit.

    Split ``i`` is split ``i % splits_per_leaf`` of leaf ``i // splits_per_leaf``: ``VOCAB_SPLIT``
    columns from the leaf's start on (the leaf's last split ends at the leaf's end). Partials go
    to ``part_*[split, row]``; ``z_tgt[row]`` is written only by the split holding the row's target
    (exactly one program), so no two programs write the same element. With ``STORE_LOGITS`` every
    scaled fp32 logit tile ``z`` is also stored to ``logits[row, col]`` (row stride ``logits_stride``),
    the values the online state reads: the stores change no arithmetic, so no bit of the outputs.
    """
    row_tile, split = grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_N), n_splits, GROUP_N)
    rows = row_tile.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    tgt = tl.load(targets_ptr + rows, mask=row_mask, other=-1)
    inv_t = tl.load(inv_t_ptr + rows, mask=row_mask, other=1.0)
    leaf_begin = (split // splits_per_leaf).to(tl.int64) * leaf_size
    v_begin = leaf_begin + (split % splits_per_leaf) * VOCAB_SPLIT
    v_end = tl.minimum(v_begin + VOCAB_SPLIT, leaf_begin + leaf_size)
    m = tl.full((BLOCK_N,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_N,), tl.float32)
    b = tl.zeros((BLOCK_N,), tl.float32)
    z_tgt = tl.zeros((BLOCK_N,), tl.float32)
    for v0 in range(v_begin, v_end, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        col_mask = cols < v_end
        x = _linear_logits_tile(
            hidden_ptr, weight_ptr, rows, row_mask, cols, col_mask, H, BLOCK_N, BLOCK_V, BLOCK_K, IEEE
        )
        z = tl.where(col_mask[None, :], x * inv_t[:, None], float("-inf"))
        if STORE_LOGITS:
            tl.store(
                logits_ptr + rows[:, None] * logits_stride + cols[None, :],
                z,
                mask=row_mask[:, None] & col_mask[None, :],
            )
        m, s, b = _online_update(m, s, b, z)
        # Exactly one column of one tile matches; adding zeros elsewhere keeps it exact.
        z_tgt += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)
    part = split.to(tl.int64) * N + rows
    tl.store(part_m_ptr + part, m, mask=row_mask)
    tl.store(part_s_ptr + part, s, mask=row_mask)
    tl.store(part_b_ptr + part, b, mask=row_mask)
    tl.store(z_tgt_ptr + rows, z_tgt, mask=row_mask & (tgt >= v_begin) & (tgt < v_end))


@triton.jit
def _fold(part_m_ptr, part_s_ptr, part_b_ptr, first, count, N, rows, row_mask):
    """Parts ``first, ..., first + count - 1`` of ``BLOCK`` rows merged in order, from the first part itself."""
    # int64 offsets of [part, rows], advanced one part (N elements) per step
    part = (tl.zeros((), tl.int64) + first) * N + rows
    m = tl.load(part_m_ptr + part, mask=row_mask, other=float("-inf"))
    s = tl.load(part_s_ptr + part, mask=row_mask, other=0.0)
    b = tl.load(part_b_ptr + part, mask=row_mask, other=0.0)
    for _ in range(1, count):
        part += N
        m2 = tl.load(part_m_ptr + part, mask=row_mask, other=float("-inf"))
        s2 = tl.load(part_s_ptr + part, mask=row_mask, other=0.0)
        b2 = tl.load(part_b_ptr + part, mask=row_mask, other=0.0)
        m, s, b = _merge(m, s, b, m2, s2, b2)
    return m, s, b


@triton.jit
def _linear_fwd_combine_kernel(
    part_m_ptr,
    part_s_ptr,
    part_b_ptr,
    z_tgt_ptr,
    targets_ptr,
    logprob_ptr,
    entropy_ptr,
    lse_ptr,
    state_ptr,
    N,
    per_leaf,
    ignore_index,
    LEAVES: tl.constexpr,
    FINALIZE: tl.constexpr,
    HAS_ENTROPY: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Merge ``LEAVES * per_leaf`` partials of each row: each leaf's ``per_leaf`` parts in order, then the
    leaves (``LEAVES`` in 1, 2, 4, 8) in the balanced tree of :func:`tree_reduce`. With ``FINALIZE`` write
    log-prob, entropy and lse; else the merged state to ``state[3, N]`` (a shard's partial)."""
    rows = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    row_mask = rows < N
    m, s, b = _fold(part_m_ptr, part_s_ptr, part_b_ptr, 0, per_leaf, N, rows, row_mask)
    if LEAVES >= 2:
        m1, s1, b1 = _fold(part_m_ptr, part_s_ptr, part_b_ptr, per_leaf, per_leaf, N, rows, row_mask)
        m, s, b = _merge(m, s, b, m1, s1, b1)
    if LEAVES >= 4:
        m2, s2, b2 = _fold(part_m_ptr, part_s_ptr, part_b_ptr, 2 * per_leaf, per_leaf, N, rows, row_mask)
        m3, s3, b3 = _fold(part_m_ptr, part_s_ptr, part_b_ptr, 3 * per_leaf, per_leaf, N, rows, row_mask)
        m2, s2, b2 = _merge(m2, s2, b2, m3, s3, b3)
        m, s, b = _merge(m, s, b, m2, s2, b2)
    if LEAVES >= 8:
        m4, s4, b4 = _fold(part_m_ptr, part_s_ptr, part_b_ptr, 4 * per_leaf, per_leaf, N, rows, row_mask)
        m5, s5, b5 = _fold(part_m_ptr, part_s_ptr, part_b_ptr, 5 * per_leaf, per_leaf, N, rows, row_mask)
        m4, s4, b4 = _merge(m4, s4, b4, m5, s5, b5)
        m6, s6, b6 = _fold(part_m_ptr, part_s_ptr, part_b_ptr, 6 * per_leaf, per_leaf, N, rows, row_mask)
        m7, s7, b7 = _fold(part_m_ptr, part_s_ptr, part_b_ptr, 7 * per_leaf, per_leaf, N, rows, row_mask)
        m6, s6, b6 = _merge(m6, s6, b6, m7, s7, b7)
        m4, s4, b4 = _merge(m4, s4, b4, m6, s6, b6)
        m, s, b = _merge(m, s, b, m4, s4, b4)
    if FINALIZE:
        tgt = tl.load(targets_ptr + rows, mask=row_mask, other=ignore_index)
        valid = tgt != ignore_index
        z_tgt = tl.load(z_tgt_ptr + rows, mask=row_mask & valid, other=0.0)
        log_s = tl.log(s)
        lse = m + log_s
        tl.store(logprob_ptr + rows, tl.where(valid, (z_tgt - m) - log_s, 0.0), mask=row_mask)
        tl.store(lse_ptr + rows, tl.where(valid, lse, 0.0), mask=row_mask)
        if HAS_ENTROPY:
            tl.store(entropy_ptr + rows, tl.where(valid, _entropy(s, b), 0.0), mask=row_mask)
    else:
        tl.store(state_ptr + rows, m, mask=row_mask)
        tl.store(state_ptr + N + rows, s, mask=row_mask)
        tl.store(state_ptr + 2 * N + rows, b, mask=row_mask)


def _split_layout(vocab: int, leaves: int, vocab_split: int) -> tuple[int, int]:
    """(leaf size, splits per leaf) of ``vocab`` columns cut into ``leaves`` leaves of ``vocab_split`` splits."""
    leaf_size = vocab // leaves
    return leaf_size, triton.cdiv(leaf_size, vocab_split)


def _partials(hidden, weight, targets, inv_temperature, leaves, z_tgt, logits_out=None):
    """The partial kernel's ``part [3, n_splits, N]`` (fp32 ``m, s, b``) over ``leaves`` leaves of ``weight``;
    with ``logits_out`` (``[N, V]`` fp32, unit column stride) the scaled logits are stored there too."""
    n_rows, hidden_size = hidden.shape
    cfg = TILE_CONFIGS["linear_fwd"][hidden.dtype]
    leaf_size, per_leaf = _split_layout(weight.shape[0], leaves, cfg["VOCAB_SPLIT"])
    n_splits = leaves * per_leaf
    part = torch.empty((3, n_splits, n_rows), dtype=torch.float32, device=hidden.device)
    store = logits_out is not None
    with on_device(hidden.device):
        _linear_fwd_partial_kernel[(triton.cdiv(n_rows, cfg["BLOCK_N"]) * n_splits,)](
            hidden,
            weight,
            targets,
            inv_temperature,
            part[0],
            part[1],
            part[2],
            z_tgt,
            logits_out if store else z_tgt,
            n_rows,
            hidden_size,
            leaf_size,
            per_leaf,
            n_splits,
            logits_out.stride(0) if store else 0,
            BLOCK_N=cfg["BLOCK_N"],
            BLOCK_V=cfg["BLOCK_V"],
            BLOCK_K=cfg["BLOCK_K"],
            VOCAB_SPLIT=cfg["VOCAB_SPLIT"],
            GROUP_N=cfg["GROUP_N"],
            IEEE=hidden.dtype == torch.float32,
            STORE_LOGITS=store,
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
            **_NO_FP_FUSION,
        )
    return part, per_leaf


def _combine(part, per_leaf, leaves, z_tgt, targets, ignore_index, logprob_out, entropy_out, lse_out, state_out):
    """One launch of :func:`_linear_fwd_combine_kernel` (``state_out`` None: finalize)."""
    n_rows = part.shape[2]
    finalize = state_out is None
    has_entropy = entropy_out is not None
    dummy = part[0, 0]
    with on_device(part.device):
        _linear_fwd_combine_kernel[(triton.cdiv(n_rows, _COMBINE_ROWS),)](
            part[0],
            part[1],
            part[2],
            z_tgt if finalize else dummy,
            targets if finalize else dummy,
            logprob_out if finalize else dummy,
            entropy_out if has_entropy else dummy,
            lse_out if finalize else dummy,
            dummy if finalize else state_out,
            n_rows,
            per_leaf,
            ignore_index,
            LEAVES=leaves,
            FINALIZE=finalize,
            HAS_ENTROPY=has_entropy,
            BLOCK=_COMBINE_ROWS,
            **_NO_FP_FUSION,
        )


def linear_logprob_fwd(hidden, weight, targets, inv_temperature, ignore_index, logprob_out, entropy_out, lse_out):
    """Log-prob, entropy and lse of ``softmax((hidden @ weight.T) * inv_temperature)`` without ``[N, V]``.

    Args:
        hidden: ``[N, H]`` fp32 / fp16 / bf16, contiguous.
        weight: ``[V, H]``, ``hidden.dtype``, contiguous.
        targets, inv_temperature, ignore_index, logprob_out, entropy_out, lse_out: as in
            :func:`selected_logprob_fwd`.

    Spec: :func:`rlk.reference.logprob.linear_logprob_fwd`. Two launches: a grid of
    ``cdiv(N, BLOCK_N) x (L * cdiv(V / L, VOCAB_SPLIT))`` programs (``L = tree_leaves(V)``) writes
    per-(split, row) partials (fp32 scratch ``4 x n_splits x N``), then one program per
    ``_COMBINE_ROWS`` rows merges them: splits in order within a leaf, leaves in the fixed tree.
    """
    leaves = tree_leaves(weight.shape[0], MAX_TREE_LEAVES)
    z_tgt = torch.empty((hidden.shape[0],), dtype=torch.float32, device=hidden.device)
    part, per_leaf = _partials(hidden, weight, targets, inv_temperature, leaves, z_tgt)
    _combine(part, per_leaf, leaves, z_tgt, targets, ignore_index, logprob_out, entropy_out, lse_out, None)


def linear_logprob_stored_fwd(
    hidden, weight, targets, inv_temperature, ignore_index, logprob_out, entropy_out, lse_out, logits_out
):
    """:func:`linear_logprob_fwd`, which also stores the scaled logits ``z`` it reduces into ``logits_out``.

    Args:
        hidden, weight, targets, inv_temperature, ignore_index, logprob_out, entropy_out, lse_out: as in
            :func:`linear_logprob_fwd`; the log-prob, entropy and lse are its bits (the same kernels, tiles and
            reduction order, the partial kernel with ``STORE_LOGITS``).
        logits_out: ``[N, V]`` fp32, unit column stride (e.g. the first rows of a larger buffer), written
            ``(hidden @ weight.T) * inv_temperature`` tile by tile, as the forward computed them.

    Spec: :func:`rlk.reference.logprob.linear_logprob_stored_fwd`. Extra memory: ``logits_out`` (the caller's).
    """
    leaves = tree_leaves(weight.shape[0], MAX_TREE_LEAVES)
    z_tgt = torch.empty((hidden.shape[0],), dtype=torch.float32, device=hidden.device)
    part, per_leaf = _partials(hidden, weight, targets, inv_temperature, leaves, z_tgt, logits_out)
    _combine(part, per_leaf, leaves, z_tgt, targets, ignore_index, logprob_out, entropy_out, lse_out, None)


def partial_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the partial results a vocab shard hands to the combine: fp32."""
    return torch.float32


def linear_logprob_shard_fwd(hidden, weight, targets, inv_temperature, leaves, state_out, z_target_out):
    """The partial forward of one vocab shard of ``leaves`` whole leaves of the full vocabulary's tree.

    Spec: :func:`rlk.reference.logprob.linear_logprob_shard_fwd` (``targets`` relative to the shard;
    ``state_out [3, N]`` fp32 ``m, s, b`` of the shard's subtree; ``z_target_out [N]``, 0 where the target
    is not in the shard). The forward's two kernels, the combine stopping before the finish.
    """
    z_target_out.zero_()
    part, per_leaf = _partials(hidden, weight, targets, inv_temperature, leaves, z_target_out)
    _combine(part, per_leaf, leaves, None, None, 0, None, None, None, state_out)


def linear_logprob_combine_fwd(states, z_target, targets, ignore_index, logprob_out, entropy_out, lse_out):
    """Merge the shards' states ``states [P, 3, N]`` (``P`` in 1, 2, 4, 8, shard order) in the fixed tree and
    finish. Spec: :func:`rlk.reference.logprob.linear_logprob_combine_fwd`. The forward's combine kernel with
    one part per leaf."""
    part = states.transpose(0, 1).contiguous()
    _combine(part, 1, states.shape[0], z_target, targets, ignore_index, logprob_out, entropy_out, lse_out, None)


# ----------------------------------------------------------------------------------------------
# linear_logprob backward: per vocab chunk, G = d loss / d x (recomputed), then two GEMMs
# ----------------------------------------------------------------------------------------------


@triton.jit
def _linear_grad_logits_kernel(
    hidden_ptr,
    weight_ptr,
    targets_ptr,
    inv_t_ptr,
    lse_ptr,
    entropy_ptr,
    g_lp_ptr,
    g_ent_ptr,
    g_out_ptr,
    N,
    H,
    v_start,
    chunk_cols,
    g_stride,
    ignore_index,
    HAS_ENT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_N: tl.constexpr,
    IEEE: tl.constexpr,
):
    """``G[:, 0:chunk_cols] = d loss / d x`` for vocab columns ``v_start + [0, chunk_cols)``.

    ``x`` is recomputed tile by tile (same K loop as the forward); G is stored in ``g_out``'s
    dtype with row stride ``g_stride``; ignored rows get 0.
    """
    row_tile, col_tile = grouped_tile(tl.program_id(0), tl.cdiv(N, BLOCK_N), tl.cdiv(chunk_cols, BLOCK_V), GROUP_N)
    rows = row_tile.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_mask = rows < N
    local_cols = col_tile.to(tl.int64) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_mask = local_cols < chunk_cols
    cols = v_start + local_cols
    tgt = tl.load(targets_ptr + rows, mask=row_mask, other=-1)
    valid = tgt != ignore_index
    inv_t = tl.load(inv_t_ptr + rows, mask=row_mask, other=1.0)[:, None]
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)[:, None]
    g_lp = tl.load(g_lp_ptr + rows, mask=row_mask, other=0.0)[:, None]
    mean_z = lse
    g_ent = g_lp
    if HAS_ENT:
        mean_z = lse - tl.load(entropy_ptr + rows, mask=row_mask, other=0.0)[:, None]
        g_ent = tl.load(g_ent_ptr + rows, mask=row_mask, other=0.0)[:, None]
    x = _linear_logits_tile(hidden_ptr, weight_ptr, rows, row_mask, cols, col_mask, H, BLOCK_N, BLOCK_V, BLOCK_K, IEEE)
    z = x * inv_t
    g = _grad_z(z, cols[None, :] == tgt[:, None], lse, g_lp, mean_z, g_ent, HAS_ENT)
    g = tl.where(valid[:, None], g * inv_t, 0.0)
    g_ptrs = g_out_ptr + rows[:, None] * g_stride + local_cols[None, :]
    tl.store(g_ptrs, g.to(g_out_ptr.dtype.element_ty), mask=row_mask[:, None] & col_mask[None, :])


def _linear_bwd_leaves(
    hidden,
    weight,
    targets,
    inv_temperature,
    lse,
    entropy,
    grad_logprob,
    grad_entropy,
    ignore_index,
    leaves,
    grad_weight_out,
    need_grad_hidden,
):
    """``grad_weight_out`` (if given) and the fp32 sum ``G @ weight`` over ``leaves`` leaves (if
    ``need_grad_hidden``): each leaf sums its ``VOCAB_CHUNK`` chunks in order (the GEMM adds each chunk's
    fp32 product to the leaf's fp32 accumulator), the leaves are added by :func:`tree_reduce`."""
    has_ent = grad_entropy is not None
    if has_ent and entropy is None:
        raise ValueError("linear_logprob_bwd: grad_entropy needs the forward's entropy")
    n_rows, hidden_size = hidden.shape
    cfg = TILE_CONFIGS["linear_bwd"][hidden.dtype]
    gemm_cfg = BACKWARD_TILE_CONFIGS[hidden.dtype]
    split = cfg["VOCAB_CHUNK"]
    leaf_size = weight.shape[0] // leaves
    g = torch.empty((n_rows, min(split, leaf_size)), dtype=hidden.dtype, device=hidden.device)

    def leaf(j: int):
        acc = None
        if need_grad_hidden:
            acc = torch.empty((n_rows, hidden_size), dtype=torch.float32, device=hidden.device)
        leaf_start = j * leaf_size
        with on_device(hidden.device):
            for v_start in range(leaf_start, leaf_start + leaf_size, split):
                cols = min(split, leaf_start + leaf_size - v_start)
                grid = (triton.cdiv(n_rows, cfg["BLOCK_N"]) * triton.cdiv(cols, cfg["BLOCK_V"]),)
                _linear_grad_logits_kernel[grid](
                    hidden,
                    weight,
                    targets,
                    inv_temperature,
                    lse,
                    entropy if has_ent else lse,
                    grad_logprob,
                    grad_entropy if has_ent else grad_logprob,
                    g,
                    n_rows,
                    hidden_size,
                    v_start,
                    cols,
                    g.stride(0),
                    ignore_index,
                    HAS_ENT=has_ent,
                    BLOCK_N=cfg["BLOCK_N"],
                    BLOCK_V=cfg["BLOCK_V"],
                    BLOCK_K=cfg["BLOCK_K"],
                    GROUP_N=cfg["GROUP_N"],
                    IEEE=hidden.dtype == torch.float32,
                    num_warps=cfg["num_warps"],
                    num_stages=cfg["num_stages"],
                    **_NO_FP_FUSION,
                )
                g_chunk = g[:, :cols]
                w_chunk = weight[v_start : v_start + cols]
                if acc is not None:
                    _gemm(g_chunk, w_chunk, acc, addend=acc if v_start > leaf_start else None, cfg=gemm_cfg)
                if grad_weight_out is not None:
                    _gemm(g_chunk.T, hidden, grad_weight_out[v_start : v_start + cols], cfg=gemm_cfg)
        return acc

    return tree_reduce(leaf, leaves, lambda a, b: None if a is None else a.add_(b))


def linear_logprob_bwd(
    hidden,
    weight,
    targets,
    inv_temperature,
    lse,
    entropy,
    grad_logprob,
    grad_entropy,
    ignore_index,
    grad_hidden_out,
    grad_weight_out,
):
    """Gradients of ``sum(grad_logprob * logprob + grad_entropy * entropy)`` w.r.t. hidden and weight.

    Args:
        hidden, weight, targets, inv_temperature, ignore_index: as in :func:`linear_logprob_fwd`.
        lse, entropy, grad_logprob, grad_entropy: as in :func:`selected_logprob_bwd`.
        grad_hidden_out: ``[N, H]`` in ``hidden.dtype`` or None (not computed): ``G @ weight``.
        grad_weight_out: ``[V, H]`` in ``weight.dtype`` or None (not computed): ``G.T @ hidden``.

    Spec: :func:`rlk.reference.logprob.linear_logprob_bwd`. For each leaf of ``V / L`` columns
    (``L = tree_leaves(V)``) and each of its chunks ``c`` of up to ``VOCAB_CHUNK`` columns, in order:
    ``G_c`` (``[N, |c|]``, input dtype, one scratch buffer reused) is recomputed from hidden and weight;
    the leaf's fp32 ``[N, H]`` accumulator gets ``G_c @ weight[c]`` (the first chunk writes it);
    ``grad_weight[c] = G_c.T @ hidden`` with the rows summed in fixed order. The leaves' accumulators are
    added in the fixed tree and rounded once to ``hidden.dtype``. Extra memory: ``N * min(V / L,
    VOCAB_CHUNK)`` elements plus ``(log2(L) + 1) * 4 * N * H`` bytes.
    """
    if grad_hidden_out is None and grad_weight_out is None:
        return
    acc = _linear_bwd_leaves(
        hidden,
        weight,
        targets,
        inv_temperature,
        lse,
        entropy,
        grad_logprob,
        grad_entropy,
        ignore_index,
        tree_leaves(weight.shape[0], MAX_TREE_LEAVES),
        grad_weight_out,
        grad_hidden_out is not None,
    )
    if grad_hidden_out is not None:
        grad_hidden_out.copy_(acc)


def linear_logprob_shard_bwd(
    hidden,
    weight,
    targets,
    inv_temperature,
    lse,
    entropy,
    grad_logprob,
    grad_entropy,
    ignore_index,
    leaves,
    grad_hidden_partial_out,
    grad_weight_out,
):
    """The backward of one vocab shard of ``leaves`` whole leaves: ``grad_weight_out`` (the shard's rows of the
    full gradient) and ``grad_hidden_partial_out`` ``[N, H]`` fp32 (the shard's subtree of the ``grad_hidden``
    sum). Spec: :func:`rlk.reference.logprob.linear_logprob_shard_bwd`."""
    if grad_hidden_partial_out is None and grad_weight_out is None:
        return
    acc = _linear_bwd_leaves(
        hidden,
        weight,
        targets,
        inv_temperature,
        lse,
        entropy,
        grad_logprob,
        grad_entropy,
        ignore_index,
        leaves,
        grad_weight_out,
        grad_hidden_partial_out is not None,
    )
    if grad_hidden_partial_out is not None:
        grad_hidden_partial_out.copy_(acc)


def linear_logprob_combine_bwd(partials, grad_hidden_out):
    """``grad_hidden_out`` = the shards' fp32 partials ``[P, N, H]`` added in the fixed tree, rounded once.
    Spec: :func:`rlk.reference.logprob.linear_logprob_combine_bwd`."""
    grad_hidden_out.copy_(tree_reduce(lambda j: partials[j], partials.shape[0], lambda a, b: a + b))


# ----------------------------------------------------------------------------------------------
# linear_logprob_stored backward: G from the forward's stored logits, in place, then two GEMMs
# ----------------------------------------------------------------------------------------------


@triton.jit
def _stored_grad_logits_kernel(
    z_ptr,
    g_ptr,
    targets_ptr,
    inv_t_ptr,
    lse_ptr,
    entropy_ptr,
    g_lp_ptr,
    g_ent_ptr,
    V,
    z_stride,
    g_stride,
    ignore_index,
    HAS_ENT: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Program ``row``: ``G[row, :] = d loss / d x`` from the stored ``z[row, :]``, over ``BLOCK_V`` tiles in order.

    ``G`` is written in ``g``'s dtype; ``g`` may alias ``z``'s storage (the same elements for fp32, each row's
    first half for a 16-bit G: ``z.view(dtype)[:, :V]``). The 16-bit store of a tile covers bytes of ``z`` that
    only this tile and earlier ones hold, and the barrier makes every thread load the tile before any stores.
    The formula and rounding are those of the backward's grad-logits kernel; ignored rows get 0.
    """
    rows = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)
    tgt = tl.load(targets_ptr + rows)
    valid = tgt != ignore_index
    inv_t = tl.load(inv_t_ptr + rows)[:, None]
    lse = tl.load(lse_ptr + rows)[:, None]
    g_lp = tl.load(g_lp_ptr + rows)[:, None]
    mean_z = lse
    g_ent = g_lp
    if HAS_ENT:
        mean_z = lse - tl.load(entropy_ptr + rows)[:, None]
        g_ent = tl.load(g_ent_ptr + rows)[:, None]
    z_row = z_ptr + rows[:, None] * z_stride
    g_row = g_ptr + rows[:, None] * g_stride
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        col_mask = cols[None, :] < V
        z = tl.load(z_row + cols[None, :], mask=col_mask, other=0.0)
        g = _grad_z(z, cols[None, :] == tgt[:, None], lse, g_lp, mean_z, g_ent, HAS_ENT)
        g = tl.where(valid[:, None], g * inv_t, 0.0)
        tl.debug_barrier()
        tl.store(g_row + cols[None, :], g.to(g_ptr.dtype.element_ty), mask=col_mask)


def stored_grad_view(logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Where :func:`linear_logprob_stored_bwd` writes ``G`` (``[N, V]`` in ``dtype``) over the fp32 ``logits``: the
    same elements for fp32, else the first half of each row's storage (row stride ``2 V``)."""
    if dtype == logits.dtype:
        return logits
    return logits.view(dtype)[:, : logits.shape[1]]


def _leaf_gemms(g: torch.Tensor, weight: torch.Tensor, leaves: int) -> torch.Tensor:
    """fp32 ``g @ weight`` (``g [N, V]``, ``weight [V, H]``) with the ``K = V`` sum cut into ``leaves`` equal
    segments: each one :func:`_gemm` (fp32 over its columns in fixed ``BLOCK_K`` steps), the segments added in
    :func:`tree_reduce`'s tree. At most ``log2(leaves) + 1`` fp32 ``[N, H]`` buffers live at once."""
    n_rows, vocab = g.shape
    size = vocab // leaves

    def leaf(j: int) -> torch.Tensor:
        out = torch.empty((n_rows, weight.shape[1]), dtype=torch.float32, device=g.device)
        _gemm(
            g[:, j * size : (j + 1) * size], weight[j * size : (j + 1) * size], out, cfg=BACKWARD_TILE_CONFIGS[g.dtype]
        )
        return out

    return tree_reduce(leaf, leaves, lambda a, b: a.add_(b))


def linear_logprob_stored_bwd(
    hidden,
    weight,
    targets,
    inv_temperature,
    lse,
    entropy,
    grad_logprob,
    grad_entropy,
    ignore_index,
    logits,
    grad_hidden_out,
    grad_weight_out,
    accumulate,
):
    """:func:`linear_logprob_bwd` from the forward's stored logits instead of recomputing them.

    Args:
        hidden, weight, targets, inv_temperature, lse, entropy, grad_logprob, grad_entropy, ignore_index: as in
            :func:`linear_logprob_bwd`.
        logits: ``[N, V]`` fp32 from :func:`linear_logprob_stored_fwd`, unit column stride; overwritten with
            ``G = d loss / d x`` in ``hidden.dtype`` (:func:`stored_grad_view`): its contents are spent.
        grad_hidden_out: ``[N, H]`` in ``hidden.dtype`` or None: ``G @ weight``.
        grad_weight_out: ``[V, H]`` or None: ``G.T @ hidden`` (fp32 or ``weight.dtype``), or with ``accumulate``
            (fp32 only) ``grad_weight_out + G.T @ hidden``.

    Spec: :func:`rlk.reference.logprob.linear_logprob_stored_bwd`. One launch of :data:`_stored_grad_logits_kernel`
    (``N`` programs; ``G`` rounded to the input dtype as the recomputing backward rounds it), then
    ``grad_hidden`` by :func:`_leaf_gemms`: the ``K = V`` sum in the ``tree_leaves(V)`` segments of the
    vocabulary's tree, one :func:`_gemm` per segment, fp32 throughout, one rounding (a row's result depends on that
    row only), and ``grad_weight`` through :func:`_gemm` (rows summed in fixed ``BLOCK_K`` steps, the fp32
    ``grad_weight_out`` added before the store when accumulating: deterministic). Extra memory: up to
    ``(log2(L) + 1) * 4 * N * H`` bytes (the segments' fp32 sums).

    (Through one :func:`_gemm` with the ``K`` tree in registers (``leaves > 1``), whose pending fp32 tiles limit it
    to 64 x 128 tiles, ``grad_hidden`` took 77 of the one-pass step's 175 ms on an H200 at N = 16384, H = 4096,
    V = 151936 bf16, 264 TFLOP/s; docs/performance.md.)
    """
    n_rows, vocab = logits.shape
    g = stored_grad_view(logits, hidden.dtype)
    has_ent = grad_entropy is not None
    if has_ent and entropy is None:
        raise ValueError("linear_logprob_stored_bwd: grad_entropy needs the forward's entropy")
    if accumulate and (grad_weight_out is None or grad_weight_out.dtype != torch.float32):
        raise ValueError("linear_logprob_stored_bwd: accumulate needs an fp32 grad_weight_out")
    cfg = TILE_CONFIGS["stored_grad"][hidden.dtype]
    with on_device(hidden.device):
        _stored_grad_logits_kernel[(n_rows,)](
            logits,
            g,
            targets,
            inv_temperature,
            lse,
            entropy if has_ent else lse,
            grad_logprob,
            grad_entropy if has_ent else grad_logprob,
            vocab,
            logits.stride(0),
            g.stride(0),
            ignore_index,
            HAS_ENT=has_ent,
            BLOCK_V=cfg["BLOCK_V"],
            num_warps=cfg["num_warps"],
            **_NO_FP_FUSION,
        )
        if grad_hidden_out is not None:
            grad_hidden_out.copy_(_leaf_gemms(g, weight, tree_leaves(vocab, MAX_TREE_LEAVES)))
        if grad_weight_out is not None:
            _gemm(
                g.T,
                hidden,
                grad_weight_out,
                addend=grad_weight_out if accumulate else None,
                cfg=BACKWARD_TILE_CONFIGS[g.dtype],
            )
