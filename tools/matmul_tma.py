"""EXPERIMENTAL: a Hopper TMA (tensor-descriptor) variant of rlk's batch-invariant GEMM.

Not part of any package (it lives in tools/, next to its sweep). It exists to test whether TMA
loads and/or a persistent schedule bring the 16-bit forward of :mod:`rlk_triton.matmul` closer to
cuBLAS with one tile configuration for every ``M`` (``tools/sweep_matmul_tma.py`` measures it; since
``rlk_triton.matmul.M_TILE_CONFIGS`` chooses tiles per M range, ``tools/sweep_matmul.py --tma`` times its
candidates per M, as the lever for the large-M bucket in linear's layout).

Result on an H200 (2026-11-29, Triton 3.6, run 3 in ``docs/performance.md``; its log in the git history):
no single configuration meets both targets. The best large-M candidate (128x256x64 w8 s3,
persistent) reaches a worst 0.86x cuBLAS at M >= 1024 but 0.26x at M <= 64; the shipped
pointer-load kernel gives 0.64x / 0.66x. Every candidate was batch-invariant and gave bitwise the
shipped kernel's output (same wgmma k16 accumulation order).

The math::

    linear_tma(x, weight, bias):  out = x @ weight.T + bias   x [M, K], weight [N, K], bias [N] (optional)
    matmul_tma(a, b, bias):       out = a @ b + bias          a [M, K], b [K, N] row-major

fp16 / bf16 only, all operands contiguous, ``out`` [M, N] of the input dtype.

Kernel, :func:`_linear_tma_kernel`: ``C = A @ B (+ bias)`` over ``BLOCK_M x BLOCK_N`` output
tiles. ``A``, ``B`` (and ``C`` when ``tma_store``) are read/written through host-side
``triton.tools.tensor_descriptor.TensorDescriptor`` objects: the TMA unit copies whole
``[BLOCK_M, BLOCK_K]`` / ``[BLOCK_N, BLOCK_K]`` boxes into shared memory, fills the parts past
the tensor's extent (rows ``>= M``, columns ``>= K``) with zeros, and a TMA store writes only
the part of a box inside ``[M, N]``. Each program walks tiles ``pid, pid + P, pid + 2P, ...``
(``P`` = number of programs) in the grouped order of :func:`rlk_triton.common.grouped_tile`:
``P`` = number of tiles for the plain schedule (one tile per program, like ``matmul.py``),
``P`` = min(number of SMs, number of tiles) for the persistent one.

Why host-side descriptors (not device-side ``tl.make_tensor_descriptor``): they need no global
allocator (``triton.set_allocator`` is process-wide state and a per-launch scratch buffer),
the CUtensorMap is encoded on the host at launch and passed as a ``__grid_constant__``
kernel parameter, and the Triton CPU interpreter runs them too. The cost is a few
microseconds of host work per launch (three ``cuTensorMapEncodeTiled`` calls).

Batch invariance, by the same rules as ``matmul.py``: the configuration is one constant per
dtype (:data:`TILE_CONFIGS`; nothing derived from ``M``; ``M`` is also excluded from
Triton's integer specialization, so one compiled binary serves every ``M``), no split-K (one
program owns a whole output tile and walks all of ``K``), ``K`` in ``BLOCK_K`` steps in
increasing order, an fp32 accumulator, the bias added in fp32 to the accumulator, one
rounding to the output dtype at the store, rows past ``M`` never stored. Which program
computes a tile (persistent or not, tile order) changes no value.

Bits vs ``matmul.py``: both compute every output element as the same chain
``acc = dot(a[:, k0:k0+BLOCK_K], b[k0:k0+BLOCK_K, :], acc)`` for ``k0 = 0, BLOCK_K, ...``,
which on sm_90 lowers to a chain of ``wgmma`` instructions of ``k = 16`` (16-bit inputs) in
increasing ``k``; zero-filled lanes add exact zeros in both. So the outputs should be
bitwise equal to the shipped kernel whatever the tiles (the pointer-load sweep saw every tile
config give the same bits). That is reasoning, not a guarantee of the compiler: the sweep
checks it.

Shape requirements of TMA (checked; ``ValueError`` otherwise): 16-byte aligned base
pointers and row strides, i.e. ``K % 8 == 0`` and (for ``tma_store`` or ``b`` [K, N])
``N % 8 == 0``; ``M, N, K >= 1``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from rlk_triton.common import grouped_tile, on_device


def make_config(block_m: int, block_n: int, block_k: int, num_warps: int, num_stages: int, *,
                persistent: bool = False, flatten: bool = False, tma_store: bool = True,
                group_m: int = 8) -> dict:
    """One tile configuration.

    ``persistent``: grid = min(#SMs, #tiles) instead of #tiles. ``flatten``: ask Triton to fuse
    the tile loop and the ``K`` loop into one pipelined loop (``tl.range(..., flatten=True)``), so
    the next tile's loads overlap this tile's epilogue. ``tma_store``: store ``C`` through a TMA
    descriptor (staged in shared memory) rather than masked pointer stores. None changes a value.

    Triton 3.6's automatic warp specialization (``tl.range(..., warp_specialize=True)``) is not
    offered: compiled for sm_90 it left this kernel unspecialized on the tile loop and crashed the
    ``NVGPUWarpSpecialization`` pass (num_warps = 4) on the ``K`` loop.
    """
    return {"BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k, "GROUP_M": group_m,
            "num_warps": num_warps, "num_stages": num_stages, "persistent": persistent,
            "flatten": flatten, "tma_store": tma_store}


def config_name(cfg: dict) -> str:
    """Short label, e.g. ``128x128x64 w4 s4 P F TS`` (P persistent, F flatten, TS TMA store, PS pointer store)."""
    flags = [f for f, on in (("P", cfg["persistent"]), ("F", cfg["flatten"])) if on]
    flags.append("TS" if cfg["tma_store"] else "PS")
    return (f"{cfg['BLOCK_M']}x{cfg['BLOCK_N']}x{cfg['BLOCK_K']} w{cfg['num_warps']} s{cfg['num_stages']} "
            + " ".join(flags))


#: Candidates for ``tools/sweep_matmul_tma.py``, most promising / least risky first. Shared
#: memory per block on sm_90 is 227 KiB: each pipeline stage holds ``(BLOCK_M + BLOCK_N) *
#: BLOCK_K * 2`` bytes and a TMA store stages ``BLOCK_M * BLOCK_N * 2`` bytes more.
#: Small ``M`` is bound by reading the weight with only ``N / BLOCK_N`` programs (32 for
#: ``N = 4096, BLOCK_N = 128``). The weight bytes in flight over the whole GPU are about
#: ``N * BLOCK_K * 2 * (num_stages - 1)`` whatever ``BLOCK_N`` is, so small ``M`` wants a deep
#: ``BLOCK_K * num_stages``; large ``M`` wants big ``BLOCK_M x BLOCK_N`` tiles (operand reuse).
#: Shared memory of each (compiled for sm_90a here, no GPU) is in the comment.
CANDIDATES: list[dict] = [
    make_config(64, 128, 128, 4, 4),                                    # 208 KiB, matmul.py's tiles
    make_config(64, 128, 128, 4, 4, persistent=True, flatten=True),     # 208 KiB
    make_config(64, 64, 128, 4, 6, persistent=True, flatten=True),      # 200 KiB, small-M oriented
    make_config(128, 64, 128, 4, 4, persistent=True, flatten=True),     # 208 KiB
    make_config(128, 128, 64, 4, 4, persistent=True, flatten=True),     # 160 KiB
    make_config(128, 128, 64, 8, 4, persistent=True, flatten=True),     # 160 KiB
    make_config(128, 128, 64, 8, 5, persistent=True, flatten=True),     # 192 KiB
    make_config(128, 128, 128, 8, 3, persistent=True, flatten=True),    # 224 KiB
    make_config(128, 256, 64, 8, 3, persistent=True, flatten=True),     # 208 KiB, large-M oriented
    make_config(128, 128, 64, 8, 4),                                    # not persistent
    make_config(128, 128, 64, 8, 4, persistent=True),                   # not flattened (same binary as above)
    make_config(128, 128, 64, 8, 4, persistent=True, flatten=True, tma_store=False),  # 160 KiB
]

#: The one configuration per dtype that :func:`linear_tma` uses when ``config`` is None.
#: A placeholder until the sweep has run on an H200 (the sweep prints the winner); nothing here
#: depends on ``M``.
TILE_CONFIGS: dict[torch.dtype, dict] = {
    torch.float16: make_config(64, 128, 128, 4, 4),
    torch.bfloat16: make_config(64, 128, 128, 4, 4),
}


@triton.jit(do_not_specialize=["M"])
def _linear_tma_kernel(
    a_desc, b_desc, c, bias_ptr, M, N, K, stride_cm,
    HAS_BIAS: tl.constexpr, B_IS_KN: tl.constexpr, TMA_STORE: tl.constexpr,
    FLATTEN: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """``C[tile] = A[rows] @ B[:, cols] (+ bias[cols])`` for tiles ``pid, pid + P, ...`` (``P`` programs).

    a_desc: descriptor of A [M, K], block [BLOCK_M, BLOCK_K].
    b_desc: descriptor of B as weight [N, K], block [BLOCK_N, BLOCK_K] (``B_IS_KN`` False),
        or of B [K, N], block [BLOCK_K, BLOCK_N] (``B_IS_KN`` True).
    c: descriptor of C [M, N], block [BLOCK_M, BLOCK_N] (``TMA_STORE``), else a pointer to a
        row-major C with row stride ``stride_cm``.
    bias_ptr: [N] (read when ``HAS_BIAS``).
    Per tile: ``acc = 0 (fp32); for k0 = 0, BLOCK_K, ... < K: acc = dot(A[rows, k0:], B[k0:, cols], acc)``;
    ``acc += bias`` (fp32); one rounding at the store. Boxes past [M, K] / [N, K] are zero-filled.
    """
    n_row_tiles = tl.cdiv(M, BLOCK_M)
    n_col_tiles = tl.cdiv(N, BLOCK_N)
    n_tiles = n_row_tiles * n_col_tiles
    k_steps = tl.cdiv(K, BLOCK_K)
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0), flatten=FLATTEN):
        tile_m, tile_n = grouped_tile(tile, n_row_tiles, n_col_tiles, GROUP_M)
        # TMA coordinates are int32 by the hardware (each < 2^31); addresses are 64-bit inside the unit.
        off_m = tile_m * BLOCK_M
        off_n = tile_n * BLOCK_N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for ks in range(k_steps):
            off_k = ks * BLOCK_K
            a = a_desc.load([off_m, off_k])
            if B_IS_KN:
                acc = tl.dot(a, b_desc.load([off_k, off_n]), acc)
            else:
                acc = tl.dot(a, b_desc.load([off_n, off_k]).T, acc)
        offs_n = tile_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        if HAS_BIAS:
            acc += tl.load(bias_ptr + offs_n, mask=offs_n < N, other=0.0).to(tl.float32)[None, :]
        if TMA_STORE:
            # The TMA store writes only the part of the box inside [M, N]: rows >= M are never stored.
            c.store([off_m, off_n], acc.to(a_desc.dtype))
        else:
            offs_m = tile_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
            tl.store(c + offs_m[:, None] * stride_cm + offs_n[None, :], acc.to(a_desc.dtype),
                     mask=(offs_m < M)[:, None] & (offs_n < N)[None, :])


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


#: Number of persistent programs under the CPU interpreter (small, so that programs walk several tiles).
INTERPRETER_PROGRAMS = 3


def _check(t: torch.Tensor, name: str) -> None:
    if t.dim() != 2 or t.stride(1) != 1 or t.stride(0) != t.shape[1]:
        raise ValueError(f"{name} must be a contiguous 2-D tensor, got shape {tuple(t.shape)} strides {t.stride()}")
    if t.data_ptr() % 16 != 0 or (t.shape[1] * t.element_size()) % 16 != 0:
        raise ValueError(f"{name}: TMA needs a 16-byte aligned base and row stride (last dim % 8 == 0 for 16-bit)")


def _launch(a: torch.Tensor, b: torch.Tensor, b_is_kn: bool, bias: torch.Tensor | None,
            out: torch.Tensor | None, config: dict | None) -> torch.Tensor:
    if a.dtype not in (torch.float16, torch.bfloat16) or b.dtype != a.dtype:
        raise ValueError(f"fp16 / bf16 operands of one dtype expected, got {a.dtype} and {b.dtype}")
    m, k = a.shape
    n = b.shape[1] if b_is_kn else b.shape[0]
    if (b.shape[0] if b_is_kn else b.shape[1]) != k:
        raise ValueError(f"inner dimensions differ: a {tuple(a.shape)}, b {tuple(b.shape)} (b_is_kn={b_is_kn})")
    if out is None:
        out = torch.empty(m, n, device=a.device, dtype=a.dtype)
    if m == 0 or n == 0:
        return out
    if k == 0:
        raise ValueError("K = 0 is not supported by the TMA variant")
    cfg = TILE_CONFIGS[a.dtype] if config is None else config
    _check(a, "a (x)")
    _check(b, "b" if b_is_kn else "weight")
    if out.dtype != a.dtype or tuple(out.shape) != (m, n):
        raise ValueError(f"out must be [{m}, {n}] {a.dtype}")
    if cfg["tma_store"]:
        _check(out, "out")
    elif out.stride(1) != 1:
        raise ValueError("out must have unit column stride")
    if bias is not None and (bias.shape != (n,) or bias.dtype != a.dtype or bias.stride(0) != 1):
        raise ValueError(f"bias must be a contiguous [{n}] {a.dtype} tensor")
    bm, bn, bk = cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["BLOCK_K"]
    a_desc = TensorDescriptor.from_tensor(a, [bm, bk])
    b_desc = TensorDescriptor.from_tensor(b, [bk, bn] if b_is_kn else [bn, bk])
    c_arg = TensorDescriptor.from_tensor(out, [bm, bn]) if cfg["tma_store"] else out
    n_tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    if cfg["persistent"]:
        sms = _num_sms(a.device.index if a.device.index is not None else torch.cuda.current_device()) \
            if a.device.type == "cuda" else INTERPRETER_PROGRAMS
        grid = (min(sms, n_tiles),)
    else:
        grid = (n_tiles,)
    with on_device(a.device):
        _linear_tma_kernel[grid](
            a_desc, b_desc, c_arg, out if bias is None else bias, m, n, k, out.stride(0),
            HAS_BIAS=bias is not None, B_IS_KN=b_is_kn, TMA_STORE=cfg["tma_store"],
            FLATTEN=cfg["flatten"],
            BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg["GROUP_M"],
            num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
        )
    return out


def linear_tma(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
               config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out = x @ weight.T + bias`` (bias optional), fp32 accumulation, one rounding.

    Args:
        x: ``[M, K]`` fp16 / bf16, contiguous, ``K % 8 == 0``.
        weight: ``[N, K]`` (nn.Linear's layout), ``x.dtype``, contiguous; read in place through a
            TMA descriptor (no transpose copy).
        bias: ``[N]``, ``x.dtype``, contiguous, or None.
        config: a :func:`make_config` dict; None = ``TILE_CONFIGS[x.dtype]``.
        out: ``[M, N]`` ``x.dtype`` contiguous (``N % 8 == 0`` with a TMA store), or None to allocate.

    Returns ``out``. Rows are batch-invariant: a row of ``out`` depends only on the same row of
    ``x`` (bitwise), whatever ``M`` and the row's position.
    """
    return _launch(x, weight, False, bias, out, config)


def matmul_tma(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
               config: dict | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """``out = a @ b + bias`` for a row-major ``b`` ``[K, N]`` (``N % 8 == 0``); otherwise as :func:`linear_tma`."""
    return _launch(a, b, True, bias, out, config)
