"""The cuBLAS-tiled path of the LM-head primitives (``linear_logprob_*``, ``linear_logprob_stored_*``).

Rows are cut into chunks of :data:`CHUNK_ROWS` (the last one zero-padded: every GEMM has the same ``M``), the
logits ``hidden @ weight.T`` of a chunk are one vendor-BLAS GEMM with fp32 output (``torch.mm(..., out_dtype=
torch.float32)``), and one Triton kernel per chunk reads that fp32 tile to reduce it (the statistics of
:mod:`rlk_triton.logprob`'s ``_online_update``, the same formulas) or to write the gradient of the logits in the input
dtype. Batch invariance: a row's bits depend on its row only (fixed GEMM shapes, per-row kernels); the weight
gradient sums row chunks and vocab blocks in a fixed order (deterministic). Spec: :mod:`rlk.reference.logprob`.

Which path serves the Triton backend's LM-head primitives: :func:`lm_head_path` (``RLK_TRITON_LM_HEAD``). The
forward-only and the training calls of a configuration always take the same path, so the rollout's log-probs are
the training's bits.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from rlk_triton import logprob as kernels
from rlk_triton.common import on_device
from rlk_triton.logprob import _entropy, _online_update

#: Rows per GEMM (a multiple of 128, so that every chunk of a caller's fp32 logits buffer starts 512-byte aligned,
#: as a fresh allocation does: the same GEMM configuration for every chunk). The forward's fp32 logits tile is
#: ``CHUNK_ROWS * V * 4`` bytes (1.16 GiB at V = 151936). Read at every call (a sweep may change it).
CHUNK_ROWS = 2048
#: Vocab columns per block of the recomputing backward (the grad-logits tile is ``CHUNK_ROWS x VOCAB_BLOCK``; the
#: weight gradient is summed per block in an fp32 ``VOCAB_BLOCK x H`` buffer, so no fp32 ``V x H`` buffer exists).
VOCAB_BLOCK = 16384
#: Columns per step of the per-row kernels (fp32 tiles).
BLOCK_V = 2048
NUM_WARPS = 8

#: The environment variable that chooses the path: ``kernels`` (default) or ``tiled``.
ENV = "RLK_TRITON_LM_HEAD"
PATHS = ("kernels", "tiled")

_NO_FP_FUSION = {"enable_fp_fusion": False}
#: torch on NVIDIA GPUs (cuBLAS): ``torch.mm(..., out_dtype=torch.float32)`` of 16-bit operands exists there only.
_CUBLAS = torch.version.hip is None


def lm_head_path(device: torch.device, dtype: torch.dtype) -> str:
    """``"tiled"`` or ``"kernels"``: the path of the LM-head primitives (``RLK_TRITON_LM_HEAD``, default
    ``kernels``).

    The choice depends on the environment only (not on whether a gradient is needed, nor on the number of rows), so
    a configuration's log-probs are the same bits with and without backward. ``tiled`` is opt-in: it is 10-13 %
    faster on an H100 in bf16 (docs/performance.md), but ``rlk.distributed``'s vocab-parallel entry points still
    run the Triton kernels, and their bitwise equality with one device (a Megatron or TP trainer against an HF
    rollout) holds only when both sides take the same path. fp32 under ``tiled`` goes through cuBLAS too: keep
    TF32 off (the contract's IEEE fp32 dots). On ROCm ``tiled`` upcasts the 16-bit operands (the fp32-output GEMM
    of 16-bit operands is cuBLAS's). ``device`` and ``dtype`` are the inputs' (part of the selector's signature).
    """
    del device, dtype
    choice = os.environ.get(ENV, "kernels").strip().lower() or "kernels"
    if choice not in PATHS:
        raise ValueError(f"{ENV}={choice!r}: expected one of {', '.join(PATHS)}")
    return choice


# ----------------------------------------------------------------------------------------------
# GEMMs through torch (cuBLAS on CUDA)
# ----------------------------------------------------------------------------------------------

#: Per (GEMM, device, dtype): whether ``torch.mm(a, b, out_dtype=torch.float32, out=out)`` / ``torch.addmm(acc, a, b,
#: out_dtype=torch.float32, out=acc)`` ran (False once it raised: some torch builds refuse ``out`` there, or want
#: ``acc`` in the operands' dtype; then a fresh result is copied / added); no host synchronization to find out.
_FUSED_ACCUMULATE: dict[tuple[str, str, torch.dtype], bool] = {}


def _mm_f32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out = a @ b`` in fp32 (``out`` fp32): bf16 / fp16 operands through cuBLAS with fp32 output on CUDA."""
    if a.dtype == torch.float32:
        torch.mm(a, b, out=out)
    elif a.device.type == "cuda" and _CUBLAS:
        key = ("mm", str(a.device), a.dtype)
        if _FUSED_ACCUMULATE.get(key, True):
            try:
                torch.mm(a, b, out_dtype=torch.float32, out=out)
                _FUSED_ACCUMULATE[key] = True
                return
            except (RuntimeError, TypeError, NotImplementedError):  # argument checks, before any write
                _FUSED_ACCUMULATE[key] = False
        out.copy_(torch.mm(a, b, out_dtype=torch.float32))
    else:  # no 16-bit -> fp32 GEMM here (CPU, ROCm): the products of 16-bit values are exact in fp32
        torch.mm(a.float(), b.float(), out=out)


def _accumulate(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc += a @ b`` with ``acc`` fp32 (contiguous): one GEMM whose epilogue adds ``acc`` (cuBLAS with an fp32 C:
    fp32 operands, or 16-bit ones on CUDA through ``addmm(out_dtype=float32)``), else a GEMM then an add."""
    if a.dtype == torch.float32:
        torch.addmm(acc, a, b, out=acc)
        return
    if a.device.type != "cuda" or not _CUBLAS:
        acc.addmm_(a.float(), b.float())
        return
    key = ("addmm", str(a.device), a.dtype)
    if _FUSED_ACCUMULATE.get(key, True):
        try:
            torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
            _FUSED_ACCUMULATE[key] = True
            return
        except (RuntimeError, TypeError, NotImplementedError):  # raised by the argument checks, before any write
            _FUSED_ACCUMULATE[key] = False
    acc.add_(torch.mm(a, b, out_dtype=torch.float32))


def accumulates_in_place(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether :func:`_accumulate` sums 16-bit GEMMs into fp32 in one GEMM here (False: a GEMM then an add). Runs a
    tiny case (benchmarks report it)."""
    if device.type != "cuda" or not _CUBLAS or dtype == torch.float32:
        return dtype == torch.float32
    a = torch.ones((2, 2), device=device, dtype=dtype)
    _accumulate(torch.zeros((2, 2), device=device, dtype=torch.float32), a, a)
    return _FUSED_ACCUMULATE[("addmm", str(a.device), dtype)]  # the tensor's device: "cuda:0", not "cuda"


def _chunk_of(buffer: torch.Tensor | None, r0: int, rows: int, chunk: int) -> torch.Tensor | None:
    """``buffer[r0 : r0 + chunk]`` when it is a whole chunk laid out as a fresh ``[chunk, V]`` allocation (unit column
    stride, row stride V, 256-byte aligned start), else None (the caller computes in a scratch tile and copies)."""
    if buffer is None or rows != chunk:
        return None
    view = buffer[r0 : r0 + chunk]
    if view.stride() != (view.shape[1], 1) or view.data_ptr() % 256:
        return None
    return view


def _padded(x: torch.Tensor, r0: int, rows: int, chunk: int, fill) -> torch.Tensor:
    """``x[r0 : r0 + rows]`` as ``chunk`` rows (a copy with ``fill`` after ``rows`` when the chunk is short)."""
    if rows == chunk:
        return x[r0 : r0 + rows]
    out = x.new_full((chunk, *x.shape[1:]), fill)
    out[:rows] = x[r0 : r0 + rows]
    return out


# ----------------------------------------------------------------------------------------------
# The per-row kernel of the forward: statistics of an fp32 logits tile
# ----------------------------------------------------------------------------------------------


@triton.jit
def _tile_stats_kernel(
    x_ptr,
    targets_ptr,
    inv_t_ptr,
    logprob_ptr,
    entropy_ptr,
    lse_ptr,
    V,
    x_stride,
    ignore_index,
    HAS_ENTROPY: tl.constexpr,
    STORE_Z: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Program ``row``: log-prob, entropy and lse of ``z = x[row, :] * inv_t`` (fp32 logits), ``BLOCK_V`` columns at a
    time in order (``_online_update``). ``STORE_Z``: also write ``z`` over ``x`` where ``inv_t != 1`` (elsewhere
    ``z`` is ``x`` already), so the row holds the scaled logits that ``linear_logprob_stored_bwd`` reads."""
    rows = tl.program_id(0).to(tl.int64) + tl.arange(0, 1)
    tgt = tl.load(targets_ptr + rows)
    valid = tgt != ignore_index
    inv_t = tl.load(inv_t_ptr + rows)
    row_ptr = x_ptr + rows[:, None] * x_stride
    m = tl.full((1,), float("-inf"), tl.float32)
    s = tl.zeros((1,), tl.float32)
    b = tl.zeros((1,), tl.float32)
    z_tgt = tl.zeros((1,), tl.float32)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V).to(tl.int64)
        col_mask = cols[None, :] < V
        x = tl.load(row_ptr + cols[None, :], mask=col_mask & valid[:, None], other=0.0)
        z = x * inv_t[:, None]
        if STORE_Z:  # each thread stores the elements it loaded: no other thread reads them in this kernel
            tl.store(row_ptr + cols[None, :], z, mask=col_mask & valid[:, None] & (inv_t[:, None] != 1.0))
        # the target's z taken from the tile (a sum of it and zeros: exact), not reloaded after a store
        z_tgt += tl.sum(tl.where(cols[None, :] == tgt[:, None], z, 0.0), axis=1)
        m, s, b = _online_update(m, s, b, tl.where(col_mask, z, float("-inf")))
    log_s = tl.log(s)
    tl.store(logprob_ptr + rows, tl.where(valid, (z_tgt - m) - log_s, 0.0))
    tl.store(lse_ptr + rows, tl.where(valid, m + log_s, 0.0))
    if HAS_ENTROPY:
        tl.store(entropy_ptr + rows, tl.where(valid, _entropy(s, b), 0.0))


def _stats(x, targets, inv_t, ignore_index, logprob_out, entropy_out, lse_out, store_z: bool) -> None:
    """:data:`_tile_stats_kernel` over the rows of ``x`` (``[rows, V]`` fp32, unit column stride)."""
    has_entropy = entropy_out is not None
    _tile_stats_kernel[(x.shape[0],)](
        x,
        targets,
        inv_t,
        logprob_out,
        entropy_out if has_entropy else logprob_out,
        lse_out,
        x.shape[1],
        x.stride(0),
        ignore_index,
        HAS_ENTROPY=has_entropy,
        STORE_Z=store_z,
        BLOCK_V=BLOCK_V,
        num_warps=NUM_WARPS,
        **_NO_FP_FUSION,
    )


# ----------------------------------------------------------------------------------------------
# The tiled primitives
# ----------------------------------------------------------------------------------------------


def tiled_fwd(
    hidden, weight, targets, inv_temperature, ignore_index, logprob_out, entropy_out, lse_out, logits_out=None
):
    """``linear_logprob_fwd`` (``logits_out`` None) or ``linear_logprob_stored_fwd`` on the tiled path.

    Per chunk of :data:`CHUNK_ROWS` rows (zero-padded): ``x = hidden[chunk] @ weight.T`` in fp32 by one GEMM (into
    the caller's ``logits_out`` rows when they form a whole aligned chunk, else a scratch tile), then
    :data:`_tile_stats_kernel` over the chunk's real rows. The same GEMM and kernel serve both primitives, so their
    log-prob, entropy and lse are the same bits. ``logits_out`` ends holding ``z = x * inv_temperature``.
    """
    n_rows = hidden.shape[0]
    chunk = CHUNK_ROWS
    weight_t = weight.t()
    scratch = None
    with on_device(hidden.device):
        for r0 in range(0, n_rows, chunk):
            rows = min(chunk, n_rows - r0)
            x = _chunk_of(logits_out, r0, rows, chunk)
            if x is None:
                if scratch is None:
                    scratch = torch.empty((chunk, weight.shape[0]), dtype=torch.float32, device=hidden.device)
                x = scratch
            _mm_f32(_padded(hidden, r0, rows, chunk, 0), weight_t, x)
            part = slice(r0, r0 + rows)
            _stats(
                x[:rows],
                targets[part],
                inv_temperature[part],
                ignore_index,
                logprob_out[part],
                None if entropy_out is None else entropy_out[part],
                lse_out[part],
                store_z=logits_out is not None,
            )
            if logits_out is not None and x is scratch:
                logits_out[part].copy_(scratch[:rows])


def _padded_vectors(r0, rows, chunk, targets, inv_t, lse, entropy, g_lp, g_ent, ignore_index):
    """The per-row inputs of one chunk as ``chunk``-long vectors (padding: ignored rows)."""
    return (
        _padded(targets, r0, rows, chunk, ignore_index),
        _padded(inv_t, r0, rows, chunk, 1.0),
        _padded(lse, r0, rows, chunk, 0.0),
        None if entropy is None else _padded(entropy, r0, rows, chunk, 0.0),
        _padded(g_lp, r0, rows, chunk, 0.0),
        None if g_ent is None else _padded(g_ent, r0, rows, chunk, 0.0),
    )


def tiled_bwd(
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
    """``linear_logprob_bwd`` on the tiled path: the logits recomputed per (vocab block, row chunk).

    For each vocab block ``[v0, v1)`` of :data:`VOCAB_BLOCK` columns in order, and each chunk of :data:`CHUNK_ROWS`
    rows in order: ``x = hidden[chunk] @ weight[v0:v1].T`` (fp32, one GEMM), ``G = d loss / d x`` in the input dtype
    (:func:`rlk_triton.logprob.selected_logprob_bwd`'s kernel, the target relative to the block), then
    ``grad_hidden[chunk] += G @ weight[v0:v1]`` (an fp32 ``[N, H]`` sum over the blocks, rounded once) and
    ``grad_weight[v0:v1] += G.T @ hidden[chunk]`` (an fp32 ``[block, H]`` sum over the chunks, rounded once per
    block). A row's ``grad_hidden`` depends on that row only; ``grad_weight`` is summed in a fixed order.
    Extra memory: ``4 N H`` (with ``grad_hidden``) ``+ 4 VOCAB_BLOCK H + 6 CHUNK_ROWS VOCAB_BLOCK`` bytes.
    """
    need_h, need_w = grad_hidden_out is not None, grad_weight_out is not None
    if not (need_h or need_w):
        return
    n_rows, hdim = hidden.shape
    vocab = weight.shape[0]
    chunk, block = CHUNK_ROWS, min(VOCAB_BLOCK, vocab)
    n_chunks = triton.cdiv(n_rows, chunk)
    dev, dtype = hidden.device, hidden.dtype
    has_ent = grad_entropy is not None
    if has_ent and entropy is None:
        raise ValueError("linear_logprob_bwd: grad_entropy needs the forward's entropy")
    acc_h = torch.empty((n_chunks * chunk, hdim), dtype=torch.float32, device=dev) if need_h else None
    acc_w = torch.empty((block, hdim), dtype=torch.float32, device=dev) if need_w else None
    x_full = torch.empty((chunk, block), dtype=torch.float32, device=dev)
    g_full = torch.empty((chunk, block), dtype=dtype, device=dev)
    tail = vocab % block
    x_tail = torch.empty((chunk, tail), dtype=torch.float32, device=dev) if tail else None
    g_tail = torch.empty((chunk, tail), dtype=dtype, device=dev) if tail else None
    chunks, rows_of = [], []
    for c in range(n_chunks):
        r0 = c * chunk
        rows = min(chunk, n_rows - r0)
        vectors = _padded_vectors(
            r0, rows, chunk, targets, inv_temperature, lse, entropy, grad_logprob, grad_entropy, ignore_index
        )
        chunks.append((_padded(hidden, r0, rows, chunk, 0), vectors))
        rows_of.append(rows)
    cfg = kernels.TILE_CONFIGS["selected"][torch.float32]
    with on_device(dev):
        for v0 in range(0, vocab, block):
            v1 = min(vocab, v0 + block)
            w_blk = weight[v0:v1]
            x, g = (x_full, g_full) if v1 - v0 == block else (x_tail, g_tail)
            w_acc = acc_w[: v1 - v0] if need_w else None
            for c, (h, (tgt, inv_t, lse_c, ent_c, glp_c, gent_c)) in enumerate(chunks):
                _mm_f32(h, w_blk.t(), x)
                # G over the block: the kernel's target compared with the block's columns (both shifted by v0)
                if rows_of[c] < chunk:  # the padding rows of G are zeros (G.T @ hidden would meet NaN there)
                    g[rows_of[c] :].zero_()
                kernels._selected_bwd_kernel[(rows_of[c],)](
                    x,
                    tgt - v0,
                    inv_t,
                    lse_c,
                    ent_c if has_ent else lse_c,
                    glp_c,
                    gent_c if has_ent else glp_c,
                    g,
                    v1 - v0,
                    ignore_index - v0,
                    HAS_ENT=has_ent,
                    BLOCK_V=cfg["BLOCK_V"],
                    num_warps=cfg["num_warps"],
                    **_NO_FP_FUSION,
                )
                if need_h:
                    rows_h = acc_h[c * chunk : (c + 1) * chunk]
                    if v0 == 0:
                        _mm_f32(g, w_blk, rows_h)
                    else:
                        _accumulate(rows_h, g, w_blk)
                if need_w:
                    if c == 0:
                        _mm_f32(g.t(), h, w_acc)
                    else:
                        _accumulate(w_acc, g.t(), h)
            if need_w:
                grad_weight_out[v0:v1].copy_(w_acc)
        if need_h:
            grad_hidden_out.copy_(acc_h[:n_rows])


def tiled_stored_bwd(
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
    """``linear_logprob_stored_bwd`` on the tiled path (the one-pass step of ``fused_linear_policy_loss``).

    Per chunk of :data:`CHUNK_ROWS` rows of the stored ``z`` (:func:`tiled_fwd` wrote them; a short chunk is copied
    into a zero-padded scratch tile of the same layout): ``G`` written over ``z`` in the input dtype
    (:func:`rlk_triton.logprob.linear_logprob_stored_bwd`'s kernel and layout, :func:`kernels.stored_grad_view`),
    ``grad_hidden[chunk] = G @ weight`` (one GEMM, ``K = V``) and ``grad_weight (+)= G.T @ hidden[chunk]`` summed in
    fp32 over the chunks in order (into ``grad_weight_out`` when it is fp32, else an fp32 scratch rounded once).
    """
    n_rows = hidden.shape[0]
    vocab = weight.shape[0]
    chunk = CHUNK_ROWS
    dev, dtype = hidden.device, hidden.dtype
    has_ent = grad_entropy is not None
    if has_ent and entropy is None:
        raise ValueError("linear_logprob_stored_bwd: grad_entropy needs the forward's entropy")
    if accumulate and (grad_weight_out is None or grad_weight_out.dtype != torch.float32):
        raise ValueError("linear_logprob_stored_bwd: accumulate needs an fp32 grad_weight_out")
    # the weight gradient: summed in fp32 in grad_weight_out when it is fp32; a 16-bit one of several chunks is
    # summed in an fp32 scratch rounded once; a 16-bit one of one chunk is one GEMM's rounding
    w_acc = grad_weight_out
    if grad_weight_out is not None and grad_weight_out.dtype != torch.float32 and n_rows > chunk:
        w_acc = torch.empty(grad_weight_out.shape, dtype=torch.float32, device=dev)
    cfg = kernels.TILE_CONFIGS["stored_grad"][dtype]
    scratch = None
    with on_device(dev):
        for r0 in range(0, n_rows, chunk):
            rows = min(chunk, n_rows - r0)
            z = _chunk_of(logits, r0, rows, chunk)
            if z is None:
                if scratch is None:
                    scratch = torch.empty((chunk, vocab), dtype=torch.float32, device=dev)
                z = scratch
                z[:rows].copy_(logits[r0 : r0 + rows])
            tgt, inv_t, lse_c, ent_c, glp_c, gent_c = _padded_vectors(
                r0, rows, chunk, targets, inv_temperature, lse, entropy, grad_logprob, grad_entropy, ignore_index
            )
            g = kernels.stored_grad_view(z, dtype)
            if rows < chunk:  # the padding rows of G are zeros (G.T @ hidden would meet NaN there)
                g[rows:].zero_()
            kernels._stored_grad_logits_kernel[(rows,)](
                z,
                g,
                tgt,
                inv_t,
                lse_c,
                ent_c if has_ent else lse_c,
                glp_c,
                gent_c if has_ent else glp_c,
                vocab,
                z.stride(0),
                g.stride(0),
                ignore_index,
                HAS_ENT=has_ent,
                BLOCK_V=cfg["BLOCK_V"],
                num_warps=cfg["num_warps"],
                **_NO_FP_FUSION,
            )
            h = _padded(hidden, r0, rows, chunk, 0)
            if grad_hidden_out is not None:
                grad_hidden_out[r0 : r0 + rows].copy_(torch.mm(g, weight)[:rows])
            if w_acc is not None:
                if w_acc.dtype != torch.float32:
                    torch.mm(g.t(), h, out=w_acc)
                elif r0 == 0 and not accumulate:
                    _mm_f32(g.t(), h, w_acc)
                else:
                    _accumulate(w_acc, g.t(), h)
    if w_acc is not None and w_acc is not grad_weight_out:
        grad_weight_out.copy_(w_acc)


# ----------------------------------------------------------------------------------------------
# The Triton backend's LM-head primitives: the tiled path or the Triton kernels (lm_head_path)
# ----------------------------------------------------------------------------------------------


def _selected(tiled, kernel):
    """The ABI primitive served by ``tiled`` or by the Triton kernel ``kernel`` (same parameters), per
    :func:`lm_head_path` of the call's ``hidden``."""

    @functools.wraps(kernel)
    def primitive(hidden, *args):
        impl = tiled if lm_head_path(hidden.device, hidden.dtype) == "tiled" else kernel
        return impl(hidden, *args)

    return primitive


linear_logprob_fwd = _selected(tiled_fwd, kernels.linear_logprob_fwd)
linear_logprob_bwd = _selected(tiled_bwd, kernels.linear_logprob_bwd)
linear_logprob_stored_fwd = _selected(tiled_fwd, kernels.linear_logprob_stored_fwd)
linear_logprob_stored_bwd = _selected(tiled_stored_bwd, kernels.linear_logprob_stored_bwd)


#: The primitives this module serves in the Triton backend's table (in place of :mod:`rlk_triton.logprob`'s).
PRIMITIVES = {
    "linear_logprob_fwd": linear_logprob_fwd,
    "linear_logprob_bwd": linear_logprob_bwd,
    "linear_logprob_stored_fwd": linear_logprob_stored_fwd,
    "linear_logprob_stored_bwd": linear_logprob_stored_bwd,
}
