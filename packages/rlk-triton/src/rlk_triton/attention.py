"""Triton kernels of ``attention``: batch-invariant varlen flash attention with LSE, forward and backward.

The math is the spec in :mod:`rlk.reference.attention`. Sequence ``b`` owns query rows
``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` (``Lq``) and key rows ``cu_seqlens_k[b]:cu_seqlens_k[b+1]``
(``Lk``); query head ``h`` reads key/value head ``h // (Hq // Hkv)``. For query ``i`` and key ``j``
of a sequence, with ``c = softmax_scale * log2(e)`` folded into one multiply::

    x_ij = c * (q_i . k_j)                      (log2 units; -inf where not visible)
    visible(i, j) = j < Lk and (not causal or j <= i + Lk - Lq)
    m_i  = max_j x_ij,  l_i = sum_j 2^(x_ij - m_i),  out_i = sum_j 2^(x_ij - m_i) v_j / l_i
    lse_i = (m_i + log2 l_i) * ln 2             (natural log; -inf, with out_i = 0, when nothing is visible)

Forward: one program per (query block of ``BLOCK_M`` rows, sequence, query head). Query blocks
are aligned to query 0 of the sequence, key blocks of ``BLOCK_N`` to key 0, and the key blocks
are reduced with the online softmax in order 0, 1, 2, ... on every path. Key blocks every row
of the query block sees entirely run unmasked; the blocks on the causal diagonal (and the
partial last block) run a masked step that sets invisible scores to -inf *before* the shared
arithmetic, so a visible score goes through the same instructions whichever step handles it.
A block beyond a row's causal limit contributes exact zeros to it (its scores are -inf, so
``p = 0`` and the rescale factor ``2^(m - m) = 1``); hence a query's ``out`` and ``lse`` are the
same bits whether it is computed in a full prefill, in any chunk of a chunked prefill, or alone
in a decode step (where the other rows of its block are masked), and whatever the packing.
A row that has seen only -inf so far uses the shift 0 (never ``-inf - -inf``); the first key
block holds key 0, which every row that sees any key sees, so its max is finite from then on.

Backward (deterministic, no atomics), with ``p_ij = 2^(x_ij - lse_i log2 e)`` recomputed from
the saved ``lse``:

* ``_bwd_delta_kernel``: ``delta_i = sum_d dO_id out_id - grad_lse_i`` (fp32), per row;
* ``_bwd_dkdv_kernel``: one program per (key block, sequence, key/value head) holds ``dk`` and
  ``dv`` of its keys and loops over the query heads of the group, then over query blocks in
  order: ``dv_j += sum_i p_ij dO_i``, ``dk_j += c' sum_i p_ij (dO_i . v_j - delta_i) q_i``;
* ``_bwd_dq_kernel``: one program per (query block, sequence, query head) loops over key blocks
  in order (the forward's structure): ``dq_i += c' sum_j p_ij (dO_i . v_j - delta_i) k_j``,
  so ``dq`` is invariant like the forward;

with ``c' = softmax_scale``. Padding rows of a block (beyond ``Lq``) read ``q = dO = 0``,
``delta = 0`` and ``lse = +inf``, so they contribute exact zeros; rows whose ``lse`` is ``-inf``
(no visible key) are read as ``+inf`` for the same reason.

``prefix_attention`` runs the same three kernels with ``HAS_PREFIX`` (a ``tl.constexpr``; plain ``attention``
compiles without it, its code unchanged). Sequence ``b`` with ``prefix_index[b] = a >= 0`` has the *logical*
keys ``[keys of a; own keys]`` of length ``n_k = P + Lk`` (``P = Lk_a``): the forward and ``dq`` kernels run
the very block structure above over the logical keys (``BLOCK_N`` blocks aligned to logical key 0, the same
unmasked / masked split, the same arithmetic) and only load a block's rows from elsewhere: logical key ``j``
is physical row ``k_start_a + j`` for ``j < P`` and ``k_start_b + j - P`` after (per element: a block may
straddle the boundary). So a query's ``out``, ``lse`` and ``dq`` are the bits of plain ``attention`` over the
physically concatenated keys. The ``dk``/``dv`` grid stays (key/value head, sequence, own key block): a block of
a reading sequence ``b`` sees its own queries at logical columns ``P + j``; a block of a read sequence ``a``
sees its own queries, then the queries of each sequence that reads it, in ascending sequence order (their
``offset = P + Lk_c - Lq_c`` with ``P = Lk_a``), found in a CSR (``order``, ``ends``) the launcher builds on the
device from ``prefix_index`` without a host synchronization.

Tile sizes, ``num_warps`` and ``num_stages`` are constants per (dtype, head-dim bucket) in
:data:`TILE_CONFIGS`; nothing depends on the sequence lengths, the batch or the number of
queries. Accumulation is fp32; fp32 inputs use IEEE fp32 dots (no TF32); 16-bit inputs use
tensor-core dots with fp32 accumulators, ``p`` rounded to the input dtype for ``p @ v``.
Head dims up to 256 are padded to the next power of two (at least 16).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlk_triton.common import dot, on_device

#: Fixed tile configuration per kernel, input dtype and head-dim bucket (the padded head dim
#: rounded up to 64, 128 or 256). The launchers read it at every call, so a sweep may overwrite
#: entries (kernels recompile per config). Nothing here depends on the lengths or the batch:
#: that is what makes results batch-invariant.
#:
#: * ``"fwd"``: ``BLOCK_M`` query rows x ``BLOCK_N`` keys per step.
#: * ``"dkdv"``: ``BLOCK_N`` keys per program, query blocks of ``BLOCK_M`` rows per step.
#: * ``"dq"``: ``BLOCK_M`` query rows per program, key blocks of ``BLOCK_N`` per step.
#:
#: fp32 runs IEEE fp32 dots (CUDA cores, not the performance path): small tiles.
_FP16_CONFIGS = {
    "fwd": {
        64: {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3},
        128: {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
        256: {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2},
    },
    "dkdv": {
        64: {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3},
        128: {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 8, "num_stages": 2},
        256: {"BLOCK_M": 32, "BLOCK_N": 64, "num_warps": 8, "num_stages": 1},
    },
    "dq": {
        64: {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
        128: {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3},
        256: {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 8, "num_stages": 1},
    },
}
_FP32_CONFIGS = {
    "fwd": {d: {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2} for d in (64, 128, 256)},
    "dkdv": {d: {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2} for d in (64, 128, 256)},
    "dq": {d: {"BLOCK_M": 32, "BLOCK_N": 16, "num_warps": 4, "num_stages": 2} for d in (64, 128, 256)},
}
TILE_CONFIGS: dict[str, dict[torch.dtype, dict[int, dict[str, int]]]] = {
    kernel: {
        torch.float32: {d: dict(c) for d, c in _FP32_CONFIGS[kernel].items()},
        torch.float16: {d: dict(c) for d, c in _FP16_CONFIGS[kernel].items()},
        torch.bfloat16: {d: dict(c) for d, c in _FP16_CONFIGS[kernel].items()},
    }
    for kernel in ("fwd", "dkdv", "dq")
}

#: Rows per program of the backward's ``delta`` kernel (per-row work: any value gives the same bits).
_DELTA_ROWS = 64
MAX_HEAD_DIM = 256
_LOG2E = 1.4426950408889634


def _block_d(head_dim: int) -> int:
    if head_dim > MAX_HEAD_DIM:
        raise ValueError(f"the Triton attention kernels support head_dim <= {MAX_HEAD_DIM}, got {head_dim}")
    return max(16, triton.next_power_of_2(head_dim))


def _config(kernel: str, dtype: torch.dtype, block_d: int) -> dict[str, int]:
    bucket = 64 if block_d <= 64 else block_d
    return TILE_CONFIGS[kernel][dtype][bucket]


# ----------------------------------------------------------------------------------------------
# Shared device helpers
# ----------------------------------------------------------------------------------------------


@triton.jit
def _sequence(cu_q_ptr, cu_k_ptr, b):
    """(first query token, Lq, first key token, Lk) of sequence ``b``; token indices as int64."""
    q_start = tl.load(cu_q_ptr + b).to(tl.int64)
    k_start = tl.load(cu_k_ptr + b).to(tl.int64)
    n_q = tl.load(cu_q_ptr + b + 1) - q_start.to(tl.int32)
    n_k = tl.load(cu_k_ptr + b + 1) - k_start.to(tl.int32)
    return q_start, n_q, k_start, n_k


@triton.jit
def _prefix(cu_k_ptr, prefix_ptr, b):
    """(first key token as int64, P) of sequence ``b``'s prefix: the keys of sequence ``prefix_index[b]``, or
    ``(0, 0)`` for ``-1``."""
    a = tl.load(prefix_ptr + b)
    has_prefix = a >= 0
    a = tl.maximum(a, 0)
    p_start = tl.load(cu_k_ptr + a)
    n_p = tl.where(has_prefix, tl.load(cu_k_ptr + a + 1) - p_start, 0)
    return p_start.to(tl.int64), n_p


@triton.jit
def _logical_rows(cols, n_p, p_start, k_start):
    """Physical key rows (int64) of the logical key indices ``cols``: the prefix's ``n_p`` rows from ``p_start``,
    then the sequence's own from ``k_start``."""
    return tl.where(cols < n_p, p_start + cols, k_start + (cols - n_p))


@triton.jit
def _fwd_block_ptrs(
    k_ptr,
    v_ptr,
    k_ptrs,
    v_ptrs,
    n0,
    offs_n,
    offs_d,
    n_p,
    p_start,
    k_start,
    hk,
    HKV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
):
    """The forward's ``K^T`` ``[BLOCK_D, BLOCK_N]`` and ``V`` ``[BLOCK_N, BLOCK_D]`` pointers of the key block from
    (logical) key ``n0``: per element through :func:`_logical_rows` with a prefix, else the first block's pointers
    ``k_ptrs`` / ``v_ptrs`` moved by ``n0`` keys."""
    if HAS_PREFIX:
        kv_row = _logical_rows(n0 + offs_n, n_p, p_start, k_start) * HKV + hk
        return (
            k_ptr + kv_row[None, :] * HEAD_DIM + offs_d[:, None],
            v_ptr + kv_row[:, None] * HEAD_DIM + offs_d[None, :],
        )
    step = n0.to(tl.int64) * (HKV * HEAD_DIM)
    return k_ptrs + step, v_ptrs + step


@triton.jit
def _dq_block_offsets(
    kv_offs,
    n0,
    offs_n,
    offs_d,
    n_p,
    p_start,
    k_start,
    hk,
    HKV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
):
    """The ``dq`` kernel's element offsets ``[BLOCK_N, BLOCK_D]`` of the key block from (logical) key ``n0`` (as
    :func:`_fwd_block_ptrs`, for ``K`` and ``V`` alike)."""
    if HAS_PREFIX:
        return (_logical_rows(n0 + offs_n, n_p, p_start, k_start) * HKV + hk)[:, None] * HEAD_DIM + offs_d[None, :]
    return kv_offs + n0.to(tl.int64) * (HKV * HEAD_DIM)


@triton.jit
def _key_blocks(m0, n_q, n_k, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key blocks of the query block starting at row ``m0``: ``[0, n_full)`` are visible to every row
    of the block and run unmasked; ``[n_full, n_end)`` run the masked step."""
    if CAUSAL:
        offset = n_k - n_q
        everyone = tl.maximum(tl.minimum(m0 + offset + 1, n_k), 0)  # keys [0, everyone) seen by all rows
        anyone = tl.maximum(tl.minimum(m0 + BLOCK_M + offset, n_k), 0)  # keys seen by some row
    else:
        everyone = n_k
        anyone = n_k
    return everyone // BLOCK_N, tl.cdiv(anyone, BLOCK_N)


# ----------------------------------------------------------------------------------------------
# Forward
# ----------------------------------------------------------------------------------------------


@triton.jit
def _fwd_step(
    acc,
    l_i,
    m_i,
    q,
    k_ptrs,
    v_ptrs,
    n0,
    rows,
    offset,
    n_k,
    qk_scale,
    offs_n,
    d_mask,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    EVEN_D: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One key block of the online softmax. ``k_ptrs`` address ``K^T`` ``[BLOCK_D, BLOCK_N]`` and
    ``v_ptrs`` ``V`` ``[BLOCK_N, BLOCK_D]`` of the block's first key; ``n0`` is that key's index."""
    cols = n0 + offs_n
    if MASKED:
        col_ok = cols < n_k
        if EVEN_D:
            k = tl.load(k_ptrs, mask=col_ok[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=col_ok[:, None], other=0.0)
        else:
            k = tl.load(k_ptrs, mask=col_ok[None, :] & d_mask[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=col_ok[:, None] & d_mask[None, :], other=0.0)
    else:
        if EVEN_D:
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        else:
            k = tl.load(k_ptrs, mask=d_mask[:, None], other=0.0)
            v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
    qk = dot(q, k, tl.zeros((BLOCK_M, BLOCK_N), tl.float32), IEEE)
    if MASKED:
        visible = cols[None, :] < n_k
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None] + offset)
        qk = tl.where(visible, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, axis=1) * qk_scale)
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(qk * qk_scale - shift[:, None])
    alpha = tl.math.exp2(m_i - shift)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None]
    acc = dot(p.to(v.dtype), v, acc, IEEE)
    return acc, l_i, m_new


@triton.jit(do_not_specialize=["total_q"])
def _fwd_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    cu_q_ptr,
    cu_k_ptr,
    prefix_ptr,
    out_ptr,
    lse_ptr,
    total_q,
    qk_scale,
    n_m_blocks,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
):
    h = tl.program_id(0)
    b = tl.program_id(1)
    m_block = n_m_blocks - 1 - tl.program_id(2)  # the last (longest, under causal) query blocks first
    q_start, n_q, k_start, n_k = _sequence(cu_q_ptr, cu_k_ptr, b)
    m0 = m_block * BLOCK_M
    if m0 >= n_q:
        return
    if HAS_PREFIX:  # n_k becomes the logical length: the prefix's keys, then the sequence's own
        p_start, n_p = _prefix(cu_k_ptr, prefix_ptr, b)
        n_k = n_p + n_k
    else:  # (unused without a prefix)
        p_start, n_p = k_start, 0
    EVEN_D: tl.constexpr = HEAD_DIM == BLOCK_D
    LN2: tl.constexpr = 0.6931471805599453
    hk = h // (HQ // HKV)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    rows = m0 + offs_m
    row_ok = rows < n_q
    q_tok = q_start + rows
    q_ptrs = q_ptr + (q_tok * HQ + h)[:, None] * HEAD_DIM + offs_d[None, :]
    q = tl.load(q_ptrs, mask=row_ok[:, None] & d_mask[None, :], other=0.0)

    kv_row0 = (k_start + offs_n) * HKV + hk
    k_ptrs = k_ptr + kv_row0[None, :] * HEAD_DIM + offs_d[:, None]
    v_ptrs = v_ptr + kv_row0[:, None] * HEAD_DIM + offs_d[None, :]

    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    offset = n_k - n_q
    n_full, n_end = _key_blocks(m0, n_q, n_k, CAUSAL, BLOCK_M, BLOCK_N)
    for nb in range(0, n_full):
        n0 = nb * BLOCK_N
        kb_ptrs, vb_ptrs = _fwd_block_ptrs(
            k_ptr, v_ptr, k_ptrs, v_ptrs, n0, offs_n, offs_d, n_p, p_start, k_start, hk, HKV, HEAD_DIM, HAS_PREFIX
        )
        acc, l_i, m_i = _fwd_step(
            acc,
            l_i,
            m_i,
            q,
            kb_ptrs,
            vb_ptrs,
            n0,
            rows,
            offset,
            n_k,
            qk_scale,
            offs_n,
            d_mask,
            False,
            CAUSAL,
            EVEN_D,
            IEEE,
            BLOCK_M,
            BLOCK_N,
        )
    for nb in range(n_full, n_end):
        n0 = nb * BLOCK_N
        kb_ptrs, vb_ptrs = _fwd_block_ptrs(
            k_ptr, v_ptr, k_ptrs, v_ptrs, n0, offs_n, offs_d, n_p, p_start, k_start, hk, HKV, HEAD_DIM, HAS_PREFIX
        )
        acc, l_i, m_i = _fwd_step(
            acc,
            l_i,
            m_i,
            q,
            kb_ptrs,
            vb_ptrs,
            n0,
            rows,
            offset,
            n_k,
            qk_scale,
            offs_n,
            d_mask,
            True,
            CAUSAL,
            EVEN_D,
            IEEE,
            BLOCK_M,
            BLOCK_N,
        )
    seen = l_i > 0.0
    out = acc / tl.where(seen, l_i, 1.0)[:, None]
    lse = tl.where(seen, (m_i + tl.math.log2(tl.where(seen, l_i, 1.0))) * LN2, float("-inf"))
    out_ptrs = out_ptr + (q_tok * HQ + h)[:, None] * HEAD_DIM + offs_d[None, :]
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_mask[None, :])
    tl.store(lse_ptr + h.to(tl.int64) * total_q + q_tok, lse, mask=row_ok)


def _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, prefix_index, causal, softmax_scale, out, lse_out):
    """The forward launch of both ops (``prefix_index`` None: plain attention, ``HAS_PREFIX`` off)."""
    total_q, n_heads, head_dim = q.shape
    n_seq = cu_seqlens_q.shape[0] - 1
    block_d = _block_d(head_dim)
    cfg = _config("fwd", q.dtype, block_d)
    n_m_blocks = triton.cdiv(max_seqlen_q, cfg["BLOCK_M"])
    if n_seq == 0 or n_m_blocks == 0:
        return
    has_prefix = prefix_index is not None
    with on_device(q.device):
        _fwd_kernel[(n_heads, n_seq, n_m_blocks)](
            q,
            k,
            v,
            cu_seqlens_q,
            cu_seqlens_k,
            prefix_index if has_prefix else cu_seqlens_k,
            out,
            lse_out,
            total_q,
            softmax_scale * _LOG2E,
            n_m_blocks,
            HQ=n_heads,
            HKV=k.shape[1],
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            CAUSAL=causal,
            IEEE=q.dtype == torch.float32,
            BLOCK_M=cfg["BLOCK_M"],
            BLOCK_N=cfg["BLOCK_N"],
            HAS_PREFIX=has_prefix,
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        )


def attention_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, out, lse_out):
    """Varlen attention forward: fills ``out [Tq, Hq, D]`` (q.dtype) and ``lse_out [Hq, Tq]`` (fp32).

    Spec: :func:`rlk.reference.attention.attention_fwd`. Grid: (query head, sequence, query block),
    the last query blocks launched first.
    """
    _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, None, causal, softmax_scale, out, lse_out)


def prefix_attention_fwd(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, prefix_index, causal, softmax_scale, out, lse_out
):
    """Forward with shared prefixes (module docstring): fills ``out`` and ``lse_out`` like :func:`attention_fwd`,
    each sequence over its logical keys. Spec: :func:`rlk.reference.attention.prefix_attention_fwd`."""
    _forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, prefix_index, causal, softmax_scale, out, lse_out)


# ----------------------------------------------------------------------------------------------
# Backward
# ----------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["total_q"])
def _bwd_delta_kernel(
    out_ptr,
    grad_out_ptr,
    grad_lse_ptr,
    delta_ptr,
    total_q,
    HQ: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_GRAD_LSE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """``delta[h, t] = sum_d grad_out[t, h, d] * out[t, h, d] - grad_lse[h, t]`` (fp32), per row."""
    h = tl.program_id(0)
    toks = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    tok_ok = toks < total_q
    offs_d = tl.arange(0, BLOCK_D)
    mask = tok_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    offs = (toks * HQ + h)[:, None] * HEAD_DIM + offs_d[None, :]
    o = tl.load(out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    do = tl.load(grad_out_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    delta = tl.sum(o * do, axis=1)
    row = h.to(tl.int64) * total_q + toks
    if HAS_GRAD_LSE:
        delta = delta - tl.load(grad_lse_ptr + row, mask=tok_ok, other=0.0)
    tl.store(delta_ptr + row, delta, mask=tok_ok)


@triton.jit
def _load_row_state(lse_ptr, delta_ptr, row, row_ok):
    """``lse * log2(e)`` (``+inf`` for padding rows and rows that see no key, so their ``p`` is 0) and ``delta``."""
    lse = tl.load(lse_ptr + row, mask=row_ok, other=float("inf"))
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * 1.4426950408889634)
    delta = tl.load(delta_ptr + row, mask=row_ok, other=0.0)
    return lse2, delta


@triton.jit
def _dkdv_step(
    dk,
    dv,
    k,
    v,
    q_head_ptr,
    do_head_ptr,
    lse_ptr,
    delta_ptr,
    m0,
    n_q,
    cols,
    offset,
    lse_row0,
    qk_scale,
    offs_m,
    offs_d,
    d_mask,
    MASKED: tl.constexpr,
    IEEE: tl.constexpr,
    ROW_STRIDE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One query block's contribution to ``dk`` and ``dv`` ``[BLOCK_N, BLOCK_D]`` of one key block,
    computed transposed (keys on the rows). ``q_head_ptr`` / ``do_head_ptr`` point at the sequence's
    first query row in this head. ``MASKED`` applies the causal mask."""
    rows = m0 + offs_m
    row_ok = rows < n_q
    mask = row_ok[:, None] & d_mask[None, :]
    offs = rows.to(tl.int64)[:, None] * ROW_STRIDE + offs_d[None, :]
    q = tl.load(q_head_ptr + offs, mask=mask, other=0.0)
    do = tl.load(do_head_ptr + offs, mask=mask, other=0.0)
    lse2, delta = _load_row_state(lse_ptr, delta_ptr, lse_row0 + rows, row_ok)
    qk_t = dot(k, tl.trans(q), tl.zeros((BLOCK_N, BLOCK_M), tl.float32), IEEE)
    if MASKED:
        qk_t = tl.where(cols[:, None] <= rows[None, :] + offset, qk_t, float("-inf"))
    p_t = tl.math.exp2(qk_t * qk_scale - lse2[None, :])
    dv = dot(p_t.to(do.dtype), do, dv, IEEE)
    dp_t = dot(v, tl.trans(do), tl.zeros((BLOCK_N, BLOCK_M), tl.float32), IEEE)
    ds_t = p_t * (dp_t - delta[None, :])
    dk = dot(ds_t.to(q.dtype), q, dk, IEEE)
    return dk, dv


@triton.jit
def _dkdv_queries(
    dk,
    dv,
    k,
    v,
    q_ptr,
    grad_out_ptr,
    lse_ptr,
    delta_ptr,
    q_start,
    n_q,
    n0,
    n_k,
    total_q,
    qk_scale,
    hk,
    offs_m,
    offs_n,
    offs_d,
    d_mask,
    CAUSAL: tl.constexpr,
    IEEE: tl.constexpr,
    HQ: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """The contributions of one sequence's queries (``n_q`` rows from token ``q_start``) to ``dk`` / ``dv`` of a
    key block whose first key has the index ``n0`` among that sequence's ``n_k`` (logical) keys."""
    cols = n0 + offs_n
    # Query blocks [m_lo, m_split) straddle the causal diagonal of this key block (masked step);
    # blocks [m_split, m_end) see all of its keys. Padding rows contribute exact zeros.
    m_end = tl.cdiv(n_q, BLOCK_M) * BLOCK_M
    if CAUSAL:
        offset = n_k - n_q
        m_lo = tl.minimum(tl.maximum(n0 - offset, 0) // BLOCK_M * BLOCK_M, m_end)
        m_split = tl.minimum(tl.cdiv(tl.maximum(n0 + BLOCK_N - 1 - offset, 0), BLOCK_M) * BLOCK_M, m_end)
        m_split = tl.maximum(m_split, m_lo)
    else:  # every query block sees every key of the block: unmasked steps only
        offset = 0
        m_lo = 0
        m_split = 0
    for g in range(GROUP):
        h = hk * GROUP + g
        head_offset = (q_start * HQ + h) * HEAD_DIM
        lse_row0 = h.to(tl.int64) * total_q + q_start
        for m0 in range(m_lo, m_split, BLOCK_M):
            dk, dv = _dkdv_step(
                dk,
                dv,
                k,
                v,
                q_ptr + head_offset,
                grad_out_ptr + head_offset,
                lse_ptr,
                delta_ptr,
                m0,
                n_q,
                cols,
                offset,
                lse_row0,
                qk_scale,
                offs_m,
                offs_d,
                d_mask,
                True,
                IEEE,
                HQ * HEAD_DIM,
                BLOCK_M,
                BLOCK_N,
            )
        for m0 in range(m_split, m_end, BLOCK_M):
            dk, dv = _dkdv_step(
                dk,
                dv,
                k,
                v,
                q_ptr + head_offset,
                grad_out_ptr + head_offset,
                lse_ptr,
                delta_ptr,
                m0,
                n_q,
                cols,
                offset,
                lse_row0,
                qk_scale,
                offs_m,
                offs_d,
                d_mask,
                False,
                IEEE,
                HQ * HEAD_DIM,
                BLOCK_M,
                BLOCK_N,
            )
    return dk, dv


@triton.jit(do_not_specialize=["total_q"])
def _bwd_dkdv_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    grad_out_ptr,
    lse_ptr,
    delta_ptr,
    cu_q_ptr,
    cu_k_ptr,
    prefix_ptr,
    readers_ptr,
    ends_ptr,
    grad_k_ptr,
    grad_v_ptr,
    total_q,
    qk_scale,
    softmax_scale,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
):
    hk = tl.program_id(0)
    b = tl.program_id(1)
    n0 = tl.program_id(2) * BLOCK_N  # the first key blocks (most queries, under causal) launched first
    q_start, n_q, k_start, n_k = _sequence(cu_q_ptr, cu_k_ptr, b)
    if n0 >= n_k:
        return
    GROUP: tl.constexpr = HQ // HKV
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    cols = n0 + offs_n
    col_ok = cols < n_k
    kv_offs = ((k_start + cols) * HKV + hk)[:, None] * HEAD_DIM + offs_d[None, :]
    kv_mask = col_ok[:, None] & d_mask[None, :]
    k = tl.load(k_ptr + kv_offs, mask=kv_mask, other=0.0)
    v = tl.load(v_ptr + kv_offs, mask=kv_mask, other=0.0)
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    if HAS_PREFIX:
        # the sequence's own queries: its keys sit at logical columns n_p + j (n_p = 0 without a prefix)
        p_start, n_p = _prefix(cu_k_ptr, prefix_ptr, b)
        dk, dv = _dkdv_queries(
            dk,
            dv,
            k,
            v,
            q_ptr,
            grad_out_ptr,
            lse_ptr,
            delta_ptr,
            q_start,
            n_q,
            n_p + n0,
            n_p + n_k,
            total_q,
            qk_scale,
            hk,
            offs_m,
            offs_n,
            offs_d,
            d_mask,
            CAUSAL,
            IEEE,
            HQ,
            HEAD_DIM,
            GROUP,
            BLOCK_M,
            BLOCK_N,
        )
        # then each sequence that reads these keys as its prefix (logical columns j), in ascending order
        for r in range(tl.load(ends_ptr + b), tl.load(ends_ptr + b + 1)):
            c = tl.load(readers_ptr + r)
            c_q_start, c_n_q, c_k_start, c_n_k = _sequence(cu_q_ptr, cu_k_ptr, c)
            dk, dv = _dkdv_queries(
                dk,
                dv,
                k,
                v,
                q_ptr,
                grad_out_ptr,
                lse_ptr,
                delta_ptr,
                c_q_start,
                c_n_q,
                n0,
                n_k + c_n_k,
                total_q,
                qk_scale,
                hk,
                offs_m,
                offs_n,
                offs_d,
                d_mask,
                CAUSAL,
                IEEE,
                HQ,
                HEAD_DIM,
                GROUP,
                BLOCK_M,
                BLOCK_N,
            )
    else:
        dk, dv = _dkdv_queries(
            dk,
            dv,
            k,
            v,
            q_ptr,
            grad_out_ptr,
            lse_ptr,
            delta_ptr,
            q_start,
            n_q,
            n0,
            n_k,
            total_q,
            qk_scale,
            hk,
            offs_m,
            offs_n,
            offs_d,
            d_mask,
            CAUSAL,
            IEEE,
            HQ,
            HEAD_DIM,
            GROUP,
            BLOCK_M,
            BLOCK_N,
        )
    dk = dk * softmax_scale
    tl.store(grad_k_ptr + kv_offs, dk.to(grad_k_ptr.dtype.element_ty), mask=kv_mask)
    tl.store(grad_v_ptr + kv_offs, dv.to(grad_v_ptr.dtype.element_ty), mask=kv_mask)


@triton.jit
def _dq_step(
    dq,
    q,
    do,
    lse2,
    delta,
    k_ptrs,
    v_ptrs,
    n0,
    rows,
    offset,
    n_k,
    qk_scale,
    offs_n,
    d_mask,
    MASKED: tl.constexpr,
    CAUSAL: tl.constexpr,
    EVEN_D: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """One key block's contribution to ``dq`` ``[BLOCK_M, BLOCK_D]`` (the forward's masking scheme)."""
    cols = n0 + offs_n
    if MASKED:
        if EVEN_D:
            kv_mask = (cols < n_k)[:, None]
        else:
            kv_mask = (cols < n_k)[:, None] & d_mask[None, :]
        k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
        v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
    elif EVEN_D:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    else:
        k = tl.load(k_ptrs, mask=d_mask[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=d_mask[None, :], other=0.0)
    qk = dot(q, tl.trans(k), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), IEEE)
    if MASKED:
        visible = cols[None, :] < n_k
        if CAUSAL:
            visible = visible & (cols[None, :] <= rows[:, None] + offset)
        qk = tl.where(visible, qk, float("-inf"))
    p = tl.math.exp2(qk * qk_scale - lse2[:, None])
    dp = dot(do, tl.trans(v), tl.zeros((BLOCK_M, BLOCK_N), tl.float32), IEEE)
    ds = p * (dp - delta[:, None])
    dq = dot(ds.to(k.dtype), k, dq, IEEE)
    return dq


@triton.jit(do_not_specialize=["total_q"])
def _bwd_dq_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    grad_out_ptr,
    lse_ptr,
    delta_ptr,
    cu_q_ptr,
    cu_k_ptr,
    prefix_ptr,
    grad_q_ptr,
    total_q,
    qk_scale,
    softmax_scale,
    n_m_blocks,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_PREFIX: tl.constexpr,
):
    h = tl.program_id(0)
    b = tl.program_id(1)
    m_block = n_m_blocks - 1 - tl.program_id(2)
    q_start, n_q, k_start, n_k = _sequence(cu_q_ptr, cu_k_ptr, b)
    m0 = m_block * BLOCK_M
    if m0 >= n_q:
        return
    if HAS_PREFIX:  # the logical keys, as in the forward
        p_start, n_p = _prefix(cu_k_ptr, prefix_ptr, b)
        n_k = n_p + n_k
    else:  # (unused without a prefix)
        p_start, n_p = k_start, 0
    hk = h // (HQ // HKV)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    rows = m0 + offs_m
    row_ok = rows < n_q
    q_tok = q_start + rows
    q_offs = (q_tok * HQ + h)[:, None] * HEAD_DIM + offs_d[None, :]
    q_mask = row_ok[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + q_offs, mask=q_mask, other=0.0)
    do = tl.load(grad_out_ptr + q_offs, mask=q_mask, other=0.0)
    lse2, delta = _load_row_state(lse_ptr, delta_ptr, h.to(tl.int64) * total_q + q_tok, row_ok)

    kv_offs = ((k_start + offs_n) * HKV + hk)[:, None] * HEAD_DIM + offs_d[None, :]
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    offset = n_k - n_q
    n_full, n_end = _key_blocks(m0, n_q, n_k, CAUSAL, BLOCK_M, BLOCK_N)
    for nb in range(0, n_full):
        n0 = nb * BLOCK_N
        block_offs = _dq_block_offsets(
            kv_offs, n0, offs_n, offs_d, n_p, p_start, k_start, hk, HKV, HEAD_DIM, HAS_PREFIX
        )
        dq = _dq_step(
            dq,
            q,
            do,
            lse2,
            delta,
            k_ptr + block_offs,
            v_ptr + block_offs,
            n0,
            rows,
            offset,
            n_k,
            qk_scale,
            offs_n,
            d_mask,
            False,
            CAUSAL,
            HEAD_DIM == BLOCK_D,
            IEEE,
            BLOCK_M,
            BLOCK_N,
        )
    for nb in range(n_full, n_end):
        n0 = nb * BLOCK_N
        block_offs = _dq_block_offsets(
            kv_offs, n0, offs_n, offs_d, n_p, p_start, k_start, hk, HKV, HEAD_DIM, HAS_PREFIX
        )
        dq = _dq_step(
            dq,
            q,
            do,
            lse2,
            delta,
            k_ptr + block_offs,
            v_ptr + block_offs,
            n0,
            rows,
            offset,
            n_k,
            qk_scale,
            offs_n,
            d_mask,
            True,
            CAUSAL,
            HEAD_DIM == BLOCK_D,
            IEEE,
            BLOCK_M,
            BLOCK_N,
        )
    dq = dq * softmax_scale
    tl.store(grad_q_ptr + q_offs, dq.to(grad_q_ptr.dtype.element_ty), mask=q_mask)


def _readers(prefix_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The sequences that read each sequence's keys as their prefix, as a CSR built on the device (no host
    synchronization): those of sequence ``a`` are ``order[ends[a]:ends[a + 1]]``, in ascending index. Both int32.

    ``key = prefix_index + 1`` (0: no prefix); ``ends`` is the inclusive prefix sum of the ``B + 1`` key counts, so
    ``ends[a]`` is the number of sequences with ``key <= a``: where the run of ``key = a + 1`` starts in the stable
    sort ``order`` of ``key``.
    """
    n_seq = prefix_index.shape[0]
    key = (prefix_index.long() + 1).clamp_(0, n_seq)  # (out-of-range values are the op layer's checks' business)
    counts = torch.zeros(n_seq + 1, dtype=torch.int64, device=prefix_index.device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    ends = torch.cumsum(counts, 0).to(torch.int32)
    order = torch.argsort(key, stable=True).to(torch.int32)
    return order, ends


def attention_bwd(
    grad_out,
    q,
    k,
    v,
    out,
    lse,
    grad_lse,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    causal,
    softmax_scale,
    grad_q_out,
    grad_k_out,
    grad_v_out,
):
    """Gradients of varlen attention: fills ``grad_q_out``, ``grad_k_out``, ``grad_v_out``.

    Spec: :func:`rlk.reference.attention.attention_bwd`. Three launches: ``delta`` per row (fp32
    ``[Hq, Tq]`` scratch), ``dk``/``dv`` per (key/value head, sequence, key block), ``dq`` per
    (query head, sequence, query block). No atomics; every sum runs in a fixed order.
    """
    _backward(
        grad_out,
        q,
        k,
        v,
        out,
        lse,
        grad_lse,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        None,
        causal,
        softmax_scale,
        grad_q_out,
        grad_k_out,
        grad_v_out,
    )


def prefix_attention_bwd(
    grad_out,
    q,
    k,
    v,
    out,
    lse,
    grad_lse,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    prefix_index,
    causal,
    softmax_scale,
    grad_q_out,
    grad_k_out,
    grad_v_out,
):
    """Gradients with shared prefixes (module docstring), the launches of :func:`attention_bwd` with ``HAS_PREFIX``.

    Spec: :func:`rlk.reference.attention.prefix_attention_bwd`. ``max_seqlen_k`` (own keys) sizes the ``dk``/``dv``
    grid; a read sequence's key block also loops over its readers' queries. No atomics; fixed order.
    """
    _backward(
        grad_out,
        q,
        k,
        v,
        out,
        lse,
        grad_lse,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        prefix_index,
        causal,
        softmax_scale,
        grad_q_out,
        grad_k_out,
        grad_v_out,
    )


def _backward(
    grad_out,
    q,
    k,
    v,
    out,
    lse,
    grad_lse,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    prefix_index,
    causal,
    softmax_scale,
    grad_q_out,
    grad_k_out,
    grad_v_out,
):
    """The backward launches of both ops (``prefix_index`` None: plain attention, ``HAS_PREFIX`` off)."""
    total_q, n_heads, head_dim = q.shape
    n_kv_heads = k.shape[1]
    n_seq = cu_seqlens_q.shape[0] - 1
    block_d = _block_d(head_dim)
    ieee = q.dtype == torch.float32
    has_prefix = prefix_index is not None
    common = dict(
        HQ=n_heads, HKV=n_kv_heads, HEAD_DIM=head_dim, BLOCK_D=block_d, CAUSAL=causal, IEEE=ieee, HAS_PREFIX=has_prefix
    )
    if has_prefix:
        readers, ends = _readers(prefix_index)
    else:  # unused pointers (HAS_PREFIX off)
        prefix_index = readers = ends = cu_seqlens_k
    qk_scale = softmax_scale * _LOG2E
    delta = torch.empty((n_heads, total_q), dtype=torch.float32, device=q.device)
    with on_device(q.device):
        _bwd_delta_kernel[(n_heads, triton.cdiv(total_q, _DELTA_ROWS))](
            out,
            grad_out,
            grad_lse if grad_lse is not None else delta,
            delta,
            total_q,
            HQ=n_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            HAS_GRAD_LSE=grad_lse is not None,
            BLOCK=_DELTA_ROWS,
        )
        cfg = _config("dkdv", q.dtype, block_d)
        n_n_blocks = triton.cdiv(max_seqlen_k, cfg["BLOCK_N"])
        if n_seq > 0 and n_n_blocks > 0:
            _bwd_dkdv_kernel[(n_kv_heads, n_seq, n_n_blocks)](
                q,
                k,
                v,
                grad_out,
                lse,
                delta,
                cu_seqlens_q,
                cu_seqlens_k,
                prefix_index,
                readers,
                ends,
                grad_k_out,
                grad_v_out,
                total_q,
                qk_scale,
                softmax_scale,
                **common,
                BLOCK_M=cfg["BLOCK_M"],
                BLOCK_N=cfg["BLOCK_N"],
                num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"],
            )
        cfg = _config("dq", q.dtype, block_d)
        n_m_blocks = triton.cdiv(max_seqlen_q, cfg["BLOCK_M"])
        if n_seq > 0 and n_m_blocks > 0:
            _bwd_dq_kernel[(n_heads, n_seq, n_m_blocks)](
                q,
                k,
                v,
                grad_out,
                lse,
                delta,
                cu_seqlens_q,
                cu_seqlens_k,
                prefix_index,
                grad_q_out,
                total_q,
                qk_scale,
                softmax_scale,
                n_m_blocks,
                **common,
                BLOCK_M=cfg["BLOCK_M"],
                BLOCK_N=cfg["BLOCK_N"],
                num_warps=cfg["num_warps"],
                num_stages=cfg["num_stages"],
            )
