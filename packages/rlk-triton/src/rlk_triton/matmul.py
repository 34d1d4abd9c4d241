"""Triton kernels of ``matmul`` / ``linear``: a batch-invariant GEMM, forward and backward.

The math is the spec in :mod:`rlk.reference.matmul`::

    out       = a @ b + bias          a [M, K], b [K, N], bias [N] (optional)
    grad_a    = grad_out @ b.T        [M, K]
    grad_b    = a.T @ grad_out        [K, N]
    grad_bias = sum_i grad_out[i, :]  [N]

All three products run through one kernel, :func:`_matmul_kernel` (one bucket through its TMA twin, below):
``C = A @ B (+ C_in)`` over ``BLOCK_M x BLOCK_N`` output tiles, the ``K`` loop in ``BLOCK_K`` steps in increasing ``k``,
an fp32 accumulator, the addend ``C_in`` (the bias, a row broadcast over ``M``) added in fp32 to the accumulator,
one rounding to C's dtype at the store. It is the Triton backend's one GEMM core: the vocabulary backwards of
:mod:`rlk_triton.logprob` and :mod:`rlk_triton.distill` run their ``G @ W`` / ``G.T @ hidden`` through
:func:`_gemm` too, with their own tiles (:data:`BACKWARD_TILE_CONFIGS`) and a full ``[M, N]`` fp32 addend where
they accumulate (``C += A @ B``, ``C_in`` aliasing ``C``). Operands are read through their strides, so ``A`` and
``B`` may be row-major or column-major views: ``linear`` passes ``weight.t()`` and its backward passes ``b.T`` and
``a.T`` without copies. fp32 inputs use IEEE fp32 products (no TF32); 16-bit inputs use tensor-core
dots with fp32 accumulation.

Batch invariance by construction: the tile configuration is one constant per dtype in
:data:`TILE_CONFIGS` (no autotuning), or on GPUs where every configuration is checked to give the same bits, one
per ``M`` bucket of :data:`M_TILE_CONFIGS` (so a row's bits do not depend on the bucket); there is no split-K (one
program owns an output tile and walks all of ``K`` itself, in the same order for every row),
rows past ``M`` are masked to zeros and never stored, and no program reads another's output.
The large-``M`` bucket in linear's layout loads through TMA descriptors instead (:func:`_matmul_tma_kernel`, same
tiles and the same chain of ``dot`` steps, so the same bits; checked by :func:`tile_buckets_agree`).
So a row of ``out`` (and of ``grad_a``) is bitwise the same whatever ``M`` is and wherever the
row sits. ``grad_b`` and ``grad_bias`` are sums over the ``M`` rows: ``grad_b`` is the same
kernel with ``M`` as its reduction dimension (fixed ``BLOCK_K`` steps in increasing row
order), ``grad_bias`` a column sum over fixed row blocks in increasing order; no atomics, so
both are deterministic run to run. ``GROUP_M`` only orders the programs (row tiles of a group
are scheduled together so that they share ``B`` tiles in L2); it changes no value.

Tensor-parallel alignment (with :mod:`rlk.core.tensor_parallel` on; off, the default, ``L = 1``): the ``K`` loop of
the forward (and of ``grad_a``, whose ``K`` is ``N``) is cut into ``L = tree_leaves(K, MAX_TREE_LEAVES,
MIN_LEAF)`` equal segments (the largest power of two <= 8 dividing ``K`` into segments of at least
``MIN_LEAF``); a program sums each segment into a fresh fp32 accumulator and adds the segments' sums in the
fixed binary tree of :func:`tree_reduce` (one loop; at most 4 accumulators live, for ``L = 8``) before the
bias and the one rounding. A row-parallel shard of ``P`` ranks (``P`` dividing ``L``) is ``L / P`` whole
segments: :func:`matmul_shard_fwd` is the same kernel stopping at the fp32 partial, and :func:`matmul_combine`
adds the ranks' partials in the same tree (IEEE fp32 additions, the same in torch as in the kernel), so
``rlk.distributed`` reproduces the single-device bits. Spec: :mod:`rlk.reference.matmul`.

int64 offsets throughout (``M * K`` may exceed 2^31).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from rlk.core import tensor_parallel
from rlk_triton.common import dot, grouped_tile, on_device

#: The one tile configuration per input dtype, used for the forward and for both backward
#: products (so ``grad_a`` rows are invariant too) wherever :data:`M_TILE_CONFIGS` does not serve.
#: The launchers read it at every call, so tests and sweeps may overwrite entries.
#:
#: 16-bit: the choice balances two regimes. Large ``M`` is compute-bound and wants big tiles
#: (operand reuse); ``M <= 64`` is bound by reading ``b`` (``K * N`` elements) with only
#: ``N / BLOCK_N`` programs to do it, each computing a full ``BLOCK_M``-row tile of which ``M``
#: rows are real. ``64 x 128 x 128`` (one warpgroup, 4 stages) was the most balanced candidate
#: of ``tools/sweep_matmul.py`` on an H200 (bf16, linear layout, N = K = 4096 and the Qwen3-8B
#: MLP shapes; two runs): 0.59-0.76x cuBLAS at M >= 1024 and 0.61-1.04x at M <= 64, where the
#: large-M favourites (128 x 256 x 64 w8: 0.65-0.78x; 128 x 128 x 64 w4: 0.72-0.86x) fall to
#: 0.18-0.53x. No single pointer-load config reached 0.85x at large M (docs/performance.md, 2026-11-29).
TILE_CONFIGS: dict[torch.dtype, dict[str, int]] = {
    torch.float32: {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 3},
    torch.float16: {
        "BLOCK_M": 64,
        "BLOCK_N": 128,
        "BLOCK_K": 128,
        "GROUP_M": 8,
        "num_warps": 4,
        "num_stages": 4,
        "tree_num_warps": 8,
    },
    torch.bfloat16: {
        "BLOCK_M": 64,
        "BLOCK_N": 128,
        "BLOCK_K": 128,
        "GROUP_M": 8,
        "num_warps": 4,
        "num_stages": 4,
        "tree_num_warps": 8,
    },
}
#: ``tree_num_warps``: the warps of a sum in more than one ``K`` segment (up to 4 fp32 accumulators live at once).
#: On 4 warps ptxas spills them and the tree ran 3.4-8.5x slower than one segment on an H200 (forward 7.1-8.5x;
#: Qwen3-8B projections, M = 1024-16384); on 8 warps 1.3-1.9x (``tools/bench_distributed_sim.py``, docs/distributed.md).
#: The warps split the tile's columns, not ``K``.

#: The tiles of the vocabulary backward's GEMMs (``grad_hidden = G @ W`` and ``grad_weight = G.T @ hidden`` of
#: ``linear_logprob``, ``linear_logprob_stored`` and ``fused_linear_kl``): :func:`_gemm` with ``cfg`` these, one
#: ``K`` segment. They differ from :data:`TILE_CONFIGS` because those products are always large and compute-bound
#: (``[N, Vc] @ [Vc, H]`` and ``[Vc, N] @ [N, H]``, ``Vc`` a vocabulary chunk or leaf, ``N`` a batch's tokens), with
#: none of the forward's small-``M`` regime: 128 x 256 x 64 w8 s3 was the fastest of ``tools/sweep_linear.py``'s five
#: candidates on an H200 (bf16 [16384, 4096] @ [4096, 4096]: 597 TFLOP/s against cuBLAS's 670; docs/performance.md).
#: fp32: 64 x 64 x 32 w4 s2, chosen offline. The values are part of the bits of those backwards (``BLOCK_K`` and
#: the tile sizes are; ``num_stages`` only pipelines the loads). Read at every call, like :data:`TILE_CONFIGS`.
BACKWARD_TILE_CONFIGS: dict[torch.dtype, dict[str, int]] = {
    torch.float32: {"BLOCK_M": 64, "BLOCK_N": 64, "BLOCK_K": 32, "GROUP_M": 8, "num_warps": 4, "num_stages": 2},
    torch.float16: {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
    torch.bfloat16: {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
}

#: Tiles by ``M`` range for the 16-bit, one-segment product (the tensor-parallel tree keeps :data:`TILE_CONFIGS`):
#: ``(m_max, config)`` pairs in increasing ``m_max`` (``m_max`` None: any ``M``; ``config`` None:
#: :data:`TILE_CONFIGS`'s, read at the call); a call takes the first pair with ``M <= m_max``, an ``M`` past them
#: all :data:`TILE_CONFIGS`. A row keeps its bits whatever bucket computes it only if every configuration computes
#: each output element as the same chain of fp32 tensor-core accumulations in increasing ``k`` (``acc = dot(a[:,
#: k0:k0 + BLOCK_K], b[k0:k0 + BLOCK_K], acc)`` lowers on sm_90 to wgmma steps of ``k = 16`` whatever ``BLOCK_M``,
#: ``BLOCK_N``, ``BLOCK_K``, warps and stages are). That is a property of the compiler and the GPU, not of this
#: code: :func:`tile_buckets_agree` checks it (the GPU tests and ``rlk info --selfcheck`` run it), and the buckets
#: serve only GPUs of the compute capabilities in :data:`SAME_BITS_CAPABILITIES`, where it was checked; everywhere
#: else (other GPUs, the CPU interpreter) :data:`TILE_CONFIGS` serves every ``M``. Read at every call, like
#: :data:`TILE_CONFIGS`.
#:
#: The buckets are ``tools/sweep_matmul.py``'s on an H200 (bf16; N = K = 4096 and the Qwen3-8B MLP shapes, linear
#: and row-major layouts; ratios cuBLAS / rlk, worst over shapes and layouts; every one of its 18 candidates gave
#: the shipped bits): ``M <= 64``: 64x32x128 w4 s6, 0.77-0.89 (the 32-column tiles give ``N / 32`` programs to read
#: the weight; the shipped 64x128x128: 0.57-0.67); ``M <= 1023``: :data:`TILE_CONFIGS` (0.66-0.71 at 128-512);
#: larger: 128x256x64 w8 s3, 0.71-0.74 at 1024-16384 (0.62-0.67 shipped; 0.39 at M = 512), with TMA loads in
#: linear's layout 0.98-1.07 (``bench_asv/run.py --only matmul``; row-major: 0.87-0.93). docs/performance.md.
_SMALL_M = {"BLOCK_M": 64, "BLOCK_N": 32, "BLOCK_K": 128, "GROUP_M": 8, "num_warps": 4, "num_stages": 6}
#:
#: The large bucket loads through TMA where the operands allow it (``"tma"``: :func:`_matmul_tma_kernel`, linear's
#: layout, a persistent grid; elsewhere the pointer kernel with the same tiles): with pointer loads linear's layout
#: reached 0.71-0.73 against 0.86-1.00 row-major.
_LARGE_M = {"BLOCK_M": 128, "BLOCK_N": 256, "BLOCK_K": 64, "GROUP_M": 8, "num_warps": 8, "num_stages": 3, "tma": True}
M_TILE_CONFIGS: dict[torch.dtype, list[tuple[int | None, dict[str, int] | None]]] = {
    dtype: [(64, _SMALL_M), (1023, None), (None, _LARGE_M)] for dtype in (torch.float16, torch.bfloat16)
}
#: Compute capabilities where :func:`tile_buckets_agree` held (H200: 9.0).
SAME_BITS_CAPABILITIES = frozenset({(9, 0)})

#: At most this many ``K`` segments (1: one segment, the plain ``K`` loop of the kernel before the tree;
#: ``tools/bench_distributed_sim.py`` measures both). Read at every call, like :data:`TILE_CONFIGS`.
MAX_TREE_LEAVES = 8
#: Segments are at least this long (a small ``K``, such as a head dim in ``bmm``, stays one segment).
MIN_LEAF = 128

#: The grad_bias column sum: one program per ``BLOCK_COLS`` columns, rows in ``BLOCK_ROWS`` steps.
COLUMN_SUM_CONFIG = {"BLOCK_ROWS": 32, "BLOCK_COLS": 128, "num_warps": 4}


def tree_leaves(n: int, max_leaves: int, min_leaf: int = 1) -> int:
    """The leaves of the fixed reduction tree over ``n`` elements: the largest power of two ``L <= max_leaves``
    that divides ``n`` into leaves of at least ``min_leaf`` elements (1 when none does).
    Spec: :func:`rlk.reference.matmul.tree_leaves`."""
    leaves = 1
    while 2 * leaves <= max_leaves and n % (2 * leaves) == 0 and n // (2 * leaves) >= min_leaf:
        leaves *= 2
    return leaves


def tree_reduce(leaf, n: int, merge):
    """``merge`` over ``leaf(0), ..., leaf(n - 1)`` in the fixed binary tree (left subtree: the largest power of
    two ``< k`` of a node's ``k`` leaves). Spec: :func:`rlk.reference.matmul.tree_reduce`."""
    return _tree_node(leaf, merge, 0, n)


def _tree_node(leaf, merge, lo: int, hi: int):
    """The subtree of leaves ``[lo, hi)`` (a module function: a recursive closure would form a reference cycle
    that keeps the leaves' tensors alive until the garbage collector runs)."""
    if hi - lo == 1:
        return leaf(lo)
    mid = lo + (1 << ((hi - lo - 1).bit_length() - 1))
    return merge(_tree_node(leaf, merge, lo, mid), _tree_node(leaf, merge, mid, hi))


@triton.jit
def _matmul_kernel(
    a_ptr,
    b_ptr,
    add_ptr,
    c_ptr,
    M,
    N,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    stride_addm,
    stride_addn,
    stride_cm,
    stride_cn,
    HAS_ADDEND: tl.constexpr,
    ADDEND_ROWS: tl.constexpr,
    EVEN_K: tl.constexpr,
    IEEE: tl.constexpr,
    LEAVES: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """``C[tile] = A[rows] @ B[:, cols] (+ C_in[rows, cols])``: fp32 sums over ``LEAVES`` (1, 2, 4 or 8) equal
    ``K`` segments, added in the balanced tree of :func:`tree_reduce`, then the addend, then one rounding.

    The addend ``C_in`` (``HAS_ADDEND``) is read through its own strides and added in fp32: without
    ``ADDEND_ROWS`` it is one row broadcast over ``M`` (a bias ``[N]``: row stride 0, loaded once per tile as a
    ``[BLOCK_N]`` vector), with it a full ``[M, N]`` tensor, which may alias ``C`` (``C += A @ B``: a program
    reads its own tile of ``C`` before it stores that tile, and no other program touches it).

    One loop over the ``cdiv(seg, BLOCK_K)`` steps of every segment in order (``seg = K / LEAVES``); the
    accumulator starts from zero at each segment, and a finished segment ``j`` is added to the pending
    subtrees like a binary counter: ``lvl0`` holds a pending segment, ``lvl1`` a pending pair, ``lvl2``
    a pending four (LEAVES = 8 gives ``((s0 + s1) + (s2 + s3)) + ((s4 + s5) + (s6 + s7))`` in ``lvl0``).
    ``EVEN_K`` (``seg % BLOCK_K == 0``, a property of ``K`` alone) drops the ``k`` mask and walks the
    operands by pointer increments; masked lanes load zeros, whose products add exact zeros, so both
    variants give the same values.
    """
    tile_m, tile_n = grouped_tile(tl.program_id(0), tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N), GROUP_M)
    offs_m = tile_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K).to(tl.int64)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a0 = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :] * stride_ak
    b0 = b_ptr + offs_k[:, None] * stride_bk + offs_n[None, :] * stride_bn
    a_ptrs = a0
    b_ptrs = b0
    # One K step of each operand, as an int64 pointer increment.
    a_step = tl.full((), BLOCK_K, tl.int64) * stride_ak
    b_step = tl.full((), BLOCK_K, tl.int64) * stride_bk
    seg = K // LEAVES
    steps = tl.cdiv(seg, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    lvl0 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    lvl1 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    lvl2 = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for i in range(0, LEAVES * steps):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
            b = tl.load(b_ptrs, mask=n_mask[None, :], other=0.0)
            a_ptrs += a_step
            b_ptrs += b_step
        else:
            kk = (i % steps) * BLOCK_K  # offset in the segment
            k_begin = (i // steps) * seg + kk
            k_mask = offs_k < seg - kk
            a = tl.load(a0 + k_begin.to(tl.int64) * stride_ak, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b0 + k_begin.to(tl.int64) * stride_bk, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
        acc = dot(a, b, acc, IEEE)
        if LEAVES > 1:
            if (i + 1) % steps == 0:  # segment j = i // steps is done
                j = i // steps
                if j % 2 == 0:
                    lvl0 = acc
                else:
                    v = lvl0 + acc
                    if LEAVES > 2:
                        if (j // 2) % 2 == 0:
                            lvl1 = v
                        else:
                            v = lvl1 + v
                            if LEAVES > 4:
                                if (j // 4) % 2 == 0:
                                    lvl2 = v
                                else:
                                    lvl0 = lvl2 + v
                            else:
                                lvl0 = v
                    else:
                        lvl0 = v
                acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if LEAVES > 1:
        acc = lvl0
    if HAS_ADDEND:
        if ADDEND_ROWS:
            c_in = tl.load(
                add_ptr + offs_m[:, None] * stride_addm + offs_n[None, :] * stride_addn,
                mask=m_mask[:, None] & n_mask[None, :],
                other=0.0,
            )
            acc += c_in.to(tl.float32)
        else:
            acc += tl.load(add_ptr + offs_n * stride_addn, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["M"])
def _matmul_tma_kernel(
    a_desc,
    w_desc,
    c_desc,
    c_ptr,
    bias_ptr,
    M,
    N,
    K,
    stride_cm,
    HAS_BIAS: tl.constexpr,
    TMA_STORE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    """``C = A @ W.T (+ bias)`` (linear's layout: ``b = W.T``, ``W`` ``[N, K]`` row-major) through TMA: program
    ``p`` of ``P`` computes the output tiles ``p, p + P, ...`` in :func:`grouped_tile`'s order.

    ``a_desc`` / ``w_desc``: descriptors of ``A [M, K]`` / ``W [N, K]`` with boxes ``[BLOCK_M, BLOCK_K]`` /
    ``[BLOCK_N, BLOCK_K]``; the TMA unit fills a box's part past the tensor (rows >= M or N, columns >= K) with
    zeros, whose products add exact zeros. ``c_desc`` (``TMA_STORE``): the descriptor of ``C [M, N]``, whose
    store writes only the box's part inside ``C``; else ``c_ptr``, a row-major ``C`` written with masks.
    Per tile the accumulation is :func:`_matmul_kernel`'s: ``acc = dot(A[rows, k0:k0 + BLOCK_K],
    W[cols, k0:k0 + BLOCK_K].T, acc)`` for ``k0 = 0, BLOCK_K, ...``, fp32, then the bias, one rounding. ``M`` is
    not specialized on (one binary for every ``M``); which program computes a tile changes no value.
    """
    n_row_tiles = tl.cdiv(M, BLOCK_M)
    n_col_tiles = tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), n_row_tiles * n_col_tiles, tl.num_programs(0), flatten=True):
        tile_m, tile_n = grouped_tile(tile, n_row_tiles, n_col_tiles, GROUP_M)
        off_m = tile_m * BLOCK_M  # TMA coordinates are int32 (each < 2^31); addressing is 64-bit in the unit
        off_n = tile_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            acc = tl.dot(a_desc.load([off_m, k0]), w_desc.load([off_n, k0]).T, acc)
        offs_n = tile_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        if TMA_STORE:
            c_desc.store([off_m, off_n], acc.to(c_desc.dtype))
        else:
            offs_m = tile_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
            tl.store(
                c_ptr + offs_m[:, None] * stride_cm + offs_n[None, :],
                acc.to(c_ptr.dtype.element_ty),
                mask=(offs_m < M)[:, None] & (offs_n < N)[None, :],
            )


@triton.jit
def _column_sum_kernel(
    g_ptr,
    out_ptr,
    M,
    N,
    stride_gm,
    stride_gn,
    BLOCK_ROWS: tl.constexpr,
    BLOCK_COLS: tl.constexpr,
):
    """``out[cols] = sum_i g[i, cols]``: fp32 partial sums per row lane over row blocks in increasing
    order, then one fixed tree over the ``BLOCK_ROWS`` lanes; rounded once to ``out``'s dtype."""
    cols = tl.program_id(0).to(tl.int64) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_mask = cols < N
    lanes = tl.arange(0, BLOCK_ROWS).to(tl.int64)
    acc = tl.zeros((BLOCK_ROWS, BLOCK_COLS), dtype=tl.float32)
    for r0 in range(0, M, BLOCK_ROWS):
        rows = r0 + lanes
        x = tl.load(
            g_ptr + rows[:, None] * stride_gm + cols[None, :] * stride_gn,
            mask=(rows < M)[:, None] & col_mask[None, :],
            other=0.0,
        )
        acc += x.to(tl.float32)
    tl.store(out_ptr + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=col_mask)


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


@functools.cache
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


#: Programs of the persistent TMA grid under the CPU interpreter (a few, so that each walks several tiles).
INTERPRETER_PROGRAMS = 3


def buckets_serve(device: torch.device) -> bool:
    """Whether :data:`M_TILE_CONFIGS` serve calls on ``device`` (an NVIDIA GPU of a checked capability; a ROCm torch
    reports an AMD GPU's gfx version as its capability, gfx90a as (9, 0), so HIP is ruled out first)."""
    return device.type == "cuda" and torch.version.hip is None and _capability(_index(device)) in SAME_BITS_CAPABILITIES


def tiles_for(dtype: torch.dtype, m: int, leaves: int, device: torch.device) -> dict[str, int]:
    """The tiles of a product of ``m`` rows: the ``M`` bucket's (:data:`M_TILE_CONFIGS`, one segment, checked
    GPUs) or :data:`TILE_CONFIGS`'."""
    if leaves == 1 and buckets_serve(device):
        for m_max, cfg in M_TILE_CONFIGS.get(dtype, ()):
            if m_max is None or m <= m_max:
                return TILE_CONFIGS[dtype] if cfg is None else cfg
    return TILE_CONFIGS[dtype]


def tile_buckets_agree(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """Every configuration of :data:`M_TILE_CONFIGS` against :data:`TILE_CONFIGS` on the same operands: the
    outputs' bits (``torch.equal``) for ``M`` in 1, 17, 64, 129, 1000 and ``K`` a multiple of each ``BLOCK_K``
    or not, with a bias, in linear's layout and row-major (linear's layout takes the TMA kernel for the large
    bucket's tiles, with a TMA store at ``N = 384`` and masked stores at ``N = 260``). Returns the mismatches
    (empty: they agree)."""
    configs = [("TILE_CONFIGS", TILE_CONFIGS[dtype])]
    configs += [
        (f"M_TILE_CONFIGS[{dtype}] M <= {m_max if m_max is not None else 'any'}", cfg)
        for m_max, cfg in M_TILE_CONFIGS.get(dtype, ())
        if cfg is not None
    ]
    g = torch.Generator().manual_seed(0)
    bad = []
    for k, n in ((4096, 384), (1000, 260)):
        weight = (torch.randn(n, k, generator=g) / k**0.5).to(device, dtype)
        bias = torch.randn(n, generator=g).to(device, dtype)
        for m in (1, 17, 64, 129, 1000):
            a = torch.randn(m, k, generator=g).to(device, dtype)
            for layout, b in (("linear", weight.t()), ("row-major", weight.t().contiguous())):
                outs = []
                for _, cfg in configs:
                    out = torch.empty(m, n, dtype=dtype, device=device)
                    _gemm(a, b, out, addend=bias, cfg=cfg)
                    outs.append(out)
                for (name, _), out in zip(configs[1:], outs[1:]):
                    if not torch.equal(out, outs[0]):
                        bad.append(f"{name}: other bits than TILE_CONFIGS at M={m} K={k} N={n} ({layout})")
    return bad


def _leaves(k: int) -> int:
    """The ``K`` segments of a product over ``k``: the tree's with ``rlk.core.tensor_parallel`` on, else 1."""
    return tree_leaves(k, tensor_parallel.max_matmul_leaves(MAX_TREE_LEAVES), MIN_LEAF)


def _gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    *,
    addend: torch.Tensor | None = None,
    leaves: int = 1,
    cfg: dict[str, int] | None = None,
) -> None:
    """``out = a @ b (+ addend)`` through :func:`_matmul_kernel` with the tiles of :func:`tiles_for` (or ``cfg``:
    another op family's fixed tiles, same keys, such as :data:`BACKWARD_TILE_CONFIGS`), the ``K`` sum in
    ``leaves`` segments (``leaves`` divides ``K``). The one GEMM of the Triton backend: ``matmul`` / ``linear``
    and the backward GEMMs of ``linear_logprob``, ``linear_logprob_stored`` and ``fused_linear_kl`` call it.

    ``a`` ``[M, K]`` and ``b`` ``[K, N]`` are any strided views of one dtype; ``out`` ``[M, N]``
    is written through its strides (an fp32 ``out`` for 16-bit inputs keeps the unrounded sum).
    ``addend``: None, a bias ``[N]`` (broadcast over the rows) or an ``[M, N]`` tensor of any strides, which may be
    ``out`` itself (``out += a @ b``); added in fp32 after the ``K`` sum, before the one rounding.
    ``M, N >= 1``; ``K = 0`` gives ``addend`` (or zeros).
    """
    m, k = a.shape
    n = b.shape[1]
    cfg = tiles_for(a.dtype, m, leaves, a.device) if cfg is None else cfg
    if cfg.get("tma") and leaves == 1 and _tma_operands(a, b, addend, out):
        _gemm_tma(a, b.T, addend, out, cfg)
        return
    add = out if addend is None else addend.expand(m, n)
    warps = cfg.get("tree_num_warps", cfg["num_warps"]) if leaves > 1 else cfg["num_warps"]
    grid = (triton.cdiv(m, cfg["BLOCK_M"]) * triton.cdiv(n, cfg["BLOCK_N"]),)
    with on_device(a.device):
        _matmul_kernel[grid](
            a,
            b,
            add,
            out,
            m,
            n,
            k,
            a.stride(0),
            a.stride(1),
            b.stride(0),
            b.stride(1),
            add.stride(0),
            add.stride(1),
            out.stride(0),
            out.stride(1),
            HAS_ADDEND=addend is not None,
            ADDEND_ROWS=addend is not None and add.stride(0) != 0,
            EVEN_K=(k // leaves) % cfg["BLOCK_K"] == 0,
            IEEE=a.dtype == torch.float32,
            LEAVES=leaves,
            BLOCK_M=cfg["BLOCK_M"],
            BLOCK_N=cfg["BLOCK_N"],
            BLOCK_K=cfg["BLOCK_K"],
            GROUP_M=cfg["GROUP_M"],
            num_warps=warps,
            num_stages=cfg["num_stages"],
        )


def _aligned(t: torch.Tensor) -> bool:
    """A row-major 2-D tensor TMA can address: unit column stride, 16-byte aligned base and row stride."""
    return (
        t.stride(1) == 1
        and t.data_ptr() % 16 == 0
        and (t.stride(0) * t.element_size()) % 16 == 0
        and t.stride(0) >= t.shape[1]
    )


def _tma_operands(a: torch.Tensor, b: torch.Tensor, addend: torch.Tensor | None, out: torch.Tensor) -> bool:
    """Whether :func:`_matmul_tma_kernel` takes this product: 16-bit, ``K >= 1``, linear's layout (``b.T`` a
    row-major ``[N, K]``), ``a`` row-major, both TMA-addressable, a GPU of compute capability 9.0 or later (or the
    CPU interpreter); ``out`` of the inputs' dtype with a unit column stride (an fp32 ``out`` of the large tiles
    needs more shared memory than an H200 has for the layout change of its masked stores), ``addend`` None or a
    contiguous bias ``[N]`` (an ``[M, N]`` addend stays on the pointer kernel)."""
    if a.dtype not in (torch.float16, torch.bfloat16) or a.shape[1] == 0 or out.dtype != a.dtype or out.stride(1) != 1:
        return False
    if addend is not None and (addend.dim() != 1 or addend.stride(0) != 1):
        return False
    if a.device.type == "cuda" and (torch.version.hip is not None or _capability(_index(a.device)) < (9, 0)):
        return False
    return _aligned(a) and _aligned(b.T)


def _gemm_tma(
    a: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, cfg: dict[str, int]
) -> None:
    """``out = a @ w.T (+ bias)`` through :func:`_matmul_tma_kernel` on a persistent grid (one program per SM at
    most); the output through a TMA store when ``out`` is addressable, else masked stores."""
    m, k = a.shape
    n = w.shape[0]
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    tma_store = _aligned(out)
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    programs = _num_sms(_index(a.device)) if a.device.type == "cuda" else INTERPRETER_PROGRAMS
    with on_device(a.device):
        _matmul_tma_kernel[(min(tiles, programs),)](
            TensorDescriptor.from_tensor(a, [bm, bk]),
            TensorDescriptor.from_tensor(w, [bn, bk]),
            TensorDescriptor.from_tensor(out, [bm, bn]) if tma_store else None,
            out,
            out if bias is None else bias,
            m,
            n,
            k,
            out.stride(0),
            HAS_BIAS=bias is not None,
            TMA_STORE=tma_store,
            BLOCK_M=bm,
            BLOCK_N=bn,
            BLOCK_K=bk,
            GROUP_M=cfg["GROUP_M"],
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        )


def matmul_fwd(a, b, bias, out):
    """``out = a @ b + bias`` (bias optional): fp32 accumulation, one rounding to ``out.dtype``.

    Args:
        a: ``[M, K]`` fp32 / fp16 / bf16, row-major or column-major (one unit stride).
        b: ``[K, N]``, ``a.dtype``, row-major or column-major (``linear``: ``weight.t()``).
        bias: ``[N]``, ``a.dtype``, contiguous, or None.
        out: ``[M, N]``, ``a.dtype``, contiguous; written.

    Spec: :func:`rlk.reference.matmul.matmul_fwd`. One program per ``BLOCK_M x BLOCK_N`` output
    tile (``cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N)`` programs), each walking all of ``K`` in
    ``tree_leaves(K)`` segments.
    """
    _gemm(a, b, out, addend=bias, leaves=_leaves(a.shape[1]))


def matmul_bwd(grad_out, a, b, grad_a_out, grad_b_out, grad_bias_out):
    """Gradients of ``sum(grad_out * (a @ b + bias))``; a None output is not computed.

    Args:
        grad_out: ``[M, N]``, ``a.dtype``, contiguous.
        a, b: the forward's inputs (row- or column-major views).
        grad_a_out: ``[M, K]`` or None: ``grad_out @ b.T`` (rows batch-invariant, like the forward).
        grad_b_out: ``[K, N]`` or None: ``a.T @ grad_out``, the ``M`` rows summed in fixed
            ``BLOCK_K`` steps (deterministic).
        grad_bias_out: ``[N]`` or None: ``grad_out.sum(0)`` in fp32, fixed order (deterministic).
        Gradient outputs may be row-major or column-major; they are written through their strides.

    Spec: :func:`rlk.reference.matmul.matmul_bwd`. Two launches of the forward's kernel on
    transposed views, and one column-sum launch for the bias.
    """
    if grad_a_out is not None:
        _gemm(grad_out, b.T, grad_a_out, leaves=_leaves(grad_out.shape[1]))
    if grad_b_out is not None:
        _gemm(a.T, grad_out, grad_b_out)
    if grad_bias_out is not None:
        m, n = grad_out.shape
        cfg = COLUMN_SUM_CONFIG
        with on_device(grad_out.device):
            _column_sum_kernel[(triton.cdiv(n, cfg["BLOCK_COLS"]),)](
                grad_out,
                grad_bias_out,
                m,
                n,
                grad_out.stride(0),
                grad_out.stride(1),
                BLOCK_ROWS=cfg["BLOCK_ROWS"],
                BLOCK_COLS=cfg["BLOCK_COLS"],
                num_warps=cfg["num_warps"],
            )


def partial_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of a row-parallel shard's partial product: fp32 (the kernel's accumulator)."""
    return torch.float32


def matmul_shard_fwd(a, b, leaves, partial_out):
    """A shard's unrounded fp32 partial ``a @ b`` over ``leaves`` whole ``K`` segments of the full product's tree.
    Spec: :func:`rlk.reference.matmul.matmul_shard_fwd`. The forward's kernel, stored in fp32, no bias."""
    _gemm(a, b, partial_out, leaves=leaves)


def matmul_combine(partials, bias, out):
    """``out = round(tree(partials) + bias)`` for the shards' fp32 partials ``[P, M, N]`` (shard order): the
    additions the kernel makes after its segments, in torch (IEEE fp32 adds, round to nearest even).
    Spec: :func:`rlk.reference.matmul.matmul_combine`."""
    acc = tree_reduce(lambda j: partials[j], partials.shape[0], lambda x, y: x + y)
    if bias is not None:
        acc = acc + bias.to(torch.float32)
    out.copy_(acc)
