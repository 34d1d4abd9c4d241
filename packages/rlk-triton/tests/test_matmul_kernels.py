"""Triton matmul primitives against the reference (ground truth: the reference run in fp64).

Without CUDA the kernels run under the Triton CPU interpreter (``TRITON_INTERPRET=1``) on small
shapes, in fp32 and fp16 (bf16 ``tl.dot`` is wrong under the interpreter); with CUDA the same
tests run on the GPU, plus the ``gpu``-marked ones (bf16, N = K = 4096, a negative control on
cuBLAS). Tolerances come from the numerical contract (``rlk.core.contract``, scale
``(|a| @ |b|) + |bias|``); batch invariance and determinism are checked bit for bit.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from rlk.core import contract
from rlk.reference import matmul as ref
from rlk_triton import matmul as tk

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]

# Small-shape tests: under the CPU interpreter they carry ``triton_interpreter``; on a GPU they run there.
interpreter = pytest.mark.gpu if ON_GPU else pytest.mark.triton_interpreter

# Tiny tiles so that CPU-sized problems cover several row tiles, column tiles, groups and K steps.
SMALL_TILES = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 1}


@pytest.fixture
def small_tiles(monkeypatch):
    for dtype in list(tk.TILE_CONFIGS):
        monkeypatch.setitem(tk.TILE_CONFIGS, dtype, dict(SMALL_TILES))


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _rand(shape, seed, dtype, scale=1.0):
    x = torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale
    return x.to(dtype).to(DEVICE)


def _operand(shape, seed, dtype, column_major):
    """A ``shape`` matrix, stored row-major or column-major (a transposed view of a contiguous tensor)."""
    if column_major:
        return _rand(shape[::-1], seed, dtype).T
    return _rand(shape, seed, dtype)


def _like(x: torch.Tensor, dtype=None) -> torch.Tensor:
    """An empty tensor shaped like ``x``, in ``x``'s layout (column-major if ``x`` is)."""
    dtype = dtype or x.dtype
    if x.stride(0) == 1 and x.stride(1) != 1:
        return torch.empty(x.shape[::-1], dtype=dtype, device=x.device).T
    return torch.empty(x.shape, dtype=dtype, device=x.device)


def run_fwd(impl, a, b, bias=None, out_dtype=None):
    out = torch.empty(a.shape[0], b.shape[1], dtype=out_dtype or a.dtype, device=a.device)
    impl.matmul_fwd(a, b, bias, out)
    return out


def run_bwd(impl, g, a, b, want=(True, True, True), out_dtype=None):
    grads = (
        _like(a, out_dtype) if want[0] else None,
        _like(b, out_dtype) if want[1] else None,
        torch.empty(b.shape[1], dtype=out_dtype or a.dtype, device=a.device) if want[2] else None,
    )
    impl.matmul_bwd(g, a, b, *grads)
    return grads


def _f64(*tensors):
    return tuple(None if t is None else t.double() for t in tensors)


def check_value(dtype, name, got, truth, scale):
    assert got.dtype == dtype
    dev = contract.compare_outputs(
        contract.entry("matmul", dtype), name, got.reshape(-1), truth.reshape(-1), scale.reshape(-1)
    )
    assert dev.ok, dev
    return dev


def check_case(dtype, m, n, k, a_cm=False, b_cm=False, with_bias=True, seed=0):
    """Forward and backward of the kernels against the fp64 reference, under the contract."""
    a = _operand((m, k), seed, dtype, a_cm)
    b = _operand((k, n), seed + 1, dtype, b_cm)
    bias = _rand((n,), seed + 2, dtype) if with_bias else None
    g = _rand((m, n), seed + 3, dtype)
    out = run_fwd(tk, a, b, bias)
    truth = run_fwd(ref, *_f64(a, b, bias))
    check_value(dtype, "out", out, truth, ref.error_scale(a, b, bias))
    grads = run_bwd(tk, g, a, b, want=(True, True, with_bias))
    truths = run_bwd(ref, *_f64(g, a, b), want=(True, True, with_bias))
    ga, gb, gbias = grads
    check_value(dtype, "grad_a", ga, truths[0], ref.error_scale(g, b.T))
    check_value(dtype, "grad_b", gb, truths[1], ref.error_scale(a.T, g))
    if with_bias:
        check_value(dtype, "grad_bias", gbias, truths[2], g.double().abs().sum(0))
    return out, grads


# ----------------------------------------------------------------------------------------------
# values
# ----------------------------------------------------------------------------------------------


@interpreter
@pytest.mark.parametrize("layout", ["rr", "rc", "cr", "cc"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference_small_tiles(small_tiles, dtype, layout):
    """Ragged M, N, K (several tiles, a ragged last K step); a and b row- ('r') or column-major ('c')."""
    check_case(dtype, 37, 80, 72, a_cm=layout[0] == "c", b_cm=layout[1] == "c")


@interpreter
@pytest.mark.parametrize("shape", [(1, 1, 1), (3, 5, 7), (33, 80, 72), (130, 96, 256)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_reference_default_tiles(dtype, shape):
    """The shipped tiles (K = 256: EVEN_K with two K steps; others ragged); linear's layout (b column-major)."""
    check_case(dtype, *shape, b_cm=True, with_bias=shape[0] != 3)


@interpreter
def test_fp32_is_not_tf32(small_tiles):
    """fp32 products are IEEE: the error stays at fp32 rounding level (TF32 would be ~1e-3 relative)."""
    a, b = _rand((16, 256), 1, torch.float32), _rand((256, 16), 2, torch.float32)
    out = run_fwd(tk, a, b)
    truth = run_fwd(ref, *_f64(a, b))
    scale = ref.error_scale(a, b)
    assert float(((out.double() - truth).abs() / scale).max()) < 1e-6


@interpreter
def test_k_zero_and_bias_only():
    a, b = torch.empty(3, 0, device=DEVICE), torch.empty(0, 5, device=DEVICE)
    bias = _rand((5,), 1, torch.float32)
    assert torch.equal(run_fwd(tk, a, b, bias), bias.expand(3, 5))
    assert torch.equal(run_fwd(tk, a, b), torch.zeros(3, 5, device=DEVICE))


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_bwd_optional_outputs(small_tiles, dtype):
    """Each gradient may be skipped (None); the others are unchanged bit for bit."""
    a, b, g = _rand((37, 72), 1, dtype), _operand((72, 80), 2, dtype, True), _rand((37, 80), 3, dtype)
    full = run_bwd(tk, g, a, b)
    for i in range(3):
        want = tuple(j == i for j in range(3))
        only = run_bwd(tk, g, a, b, want=want)
        assert all(only[j] is None for j in range(3) if j != i)
        assert torch.equal(only[i], full[i])


# ----------------------------------------------------------------------------------------------
# batch invariance and determinism
# ----------------------------------------------------------------------------------------------

# Around multiples of the shipped row tiles (BLOCK_M = 64 for 16-bit and fp32) and of SMALL_TILES (16).
INVARIANCE_M = (1, 2, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129)


def _probe_invariance(dtype, n, k, batch_sizes, b_cm=True, with_bias=True):
    """A probe row alone vs at first / middle / last of M rows: out and grad_a rows bitwise equal."""
    b = _operand((k, n), 100, dtype, b_cm)
    bias = _rand((n,), 101, dtype) if with_bias else None
    probe, probe_g = _rand((1, k), 102, dtype), _rand((1, n), 103, dtype)
    alone = run_fwd(tk, probe, b, bias)
    alone_ga = run_bwd(tk, probe_g, probe, b, want=(True, False, False))[0]
    for m in batch_sizes:
        a, g = _rand((m, k), m, dtype, scale=3.0), _rand((m, n), m + 1, dtype)
        for pos in sorted({0, m // 2, m - 1}):
            a[pos], g[pos] = probe[0], probe_g[0]
            out = run_fwd(tk, a, b, bias)
            ga = run_bwd(tk, g, a, b, want=(True, False, False))[0]
            assert torch.equal(out[pos : pos + 1], alone), (m, pos)
            assert torch.equal(ga[pos : pos + 1], alone_ga), (m, pos)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_batch_invariance_default_tiles(dtype):
    _probe_invariance(dtype, 80, 72, INVARIANCE_M)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_batch_invariance_small_tiles(small_tiles, dtype):
    """Tiles of 16: the probe lands in different row tiles, GROUP_M groups and positions inside a tile."""
    _probe_invariance(dtype, 80, 72, (1, 15, 17, 31, 33, 63, 65), b_cm=False, with_bias=False)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_grad_b_and_bias_deterministic(small_tiles, dtype):
    a, b, g = _rand((65, 72), 1, dtype), _operand((72, 80), 2, dtype, True), _rand((65, 80), 3, dtype)
    first = run_bwd(tk, g, a, b)
    second = run_bwd(tk, g, a, b)
    for x, y in zip(first, second):
        assert torch.equal(x, y)


def test_tile_configs_are_consistent():
    assert set(tk.TILE_CONFIGS) == {torch.float32, torch.float16, torch.bfloat16}
    keys = {"BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages"}
    for dtype, cfg in tk.TILE_CONFIGS.items():
        # 16-bit: the tree's warps (more than one K segment holds up to 4 fp32 accumulators)
        assert set(cfg) == keys | ({"tree_num_warps"} if dtype != torch.float32 else set())
        assert all(isinstance(v, int) and v > 0 for v in cfg.values())
    for dtype, buckets in tk.M_TILE_CONFIGS.items():
        bounds = [m_max for m_max, _ in buckets]
        assert all(isinstance(b, int) for b in bounds[:-1]) and bounds[:-1] == sorted(set(bounds[:-1])), dtype
        for _, cfg in buckets:  # "tma": the large bucket's TMA loads, where the operands allow them
            assert cfg is None or (
                set(cfg) - {"tma"} == keys and all(isinstance(v, int) and v > 0 for v in cfg.values())
            )


# ----------------------------------------------------------------------------------------------
# GPU only: bf16, the headline shape, and a negative control
# ----------------------------------------------------------------------------------------------

FULL_M = (1, 2, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 131, 132, 133, 255, 256, 257, 1024, 16384)


def _rows_vs_alone(mm, dtype, n, k, batch_sizes, seed=0):
    """For each M: does the probe row at first / middle / last of M rows equal the probe computed alone?

    ``mm(a, w)`` computes ``a @ w.T`` with ``w`` ``[N, K]``. Returns the (M, position) pairs that differ.
    """
    w = _rand((n, k), seed, dtype, scale=k**-0.5)
    probe = _rand((1, k), seed + 1, dtype)
    alone = mm(probe, w)
    differ = []
    for m in batch_sizes:
        a = _rand((m, k), seed + m, dtype)
        for pos in sorted({0, m // 2, m - 1}):
            a[pos] = probe[0]
            if not torch.equal(mm(a, w)[pos : pos + 1], alone):
                differ.append((m, pos))
    return differ


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_probe_row_invariance_headline_gpu(dtype):
    """N = K = 4096, linear's layout, bias: the probe row is bitwise identical for every M in the full list."""
    bias = _rand((4096,), 7, dtype)
    sizes = FULL_M if dtype == torch.bfloat16 else (1, 17, 129, 1024)
    differ = _rows_vs_alone(lambda a, w: run_fwd(tk, a, w.T, bias), dtype, 4096, 4096, sizes)
    assert not differ, f"rows differ from the row computed alone at (M, position) {differ}"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_m_tile_buckets_give_the_same_bits_gpu(dtype):
    """The guard of M_TILE_CONFIGS on this GPU: every bucket's tiles give bitwise TILE_CONFIGS' output
    (tile_buckets_agree: M 1 ... 1000, K a multiple of BLOCK_K or not, bias, both layouts). A GPU where this fails
    must not be in SAME_BITS_CAPABILITIES. (test_probe_row_invariance_headline_gpu crosses the buckets through
    matmul_fwd: rows at M = 1 ... 16384.)"""
    assert tk.tile_buckets_agree(DEVICE, dtype) == []


@interpreter
@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("m", [5, 70, 1030])
def test_m_tile_buckets_compute_the_product(monkeypatch, dtype, m):
    """Each bucket's tiles (M = 5, 70, 1030: small, fixed, large) give the product and its gradients under the
    contract, taken as if this device were a checked one (on the CPU too, so the AOT check of CI compiles every
    bucket's kernel for sm_90 and sm_80)."""
    monkeypatch.setattr(tk, "buckets_serve", lambda device: True)
    check_case(dtype, m, 40, 48, b_cm=True)


@interpreter
@pytest.mark.parametrize("dtype", [torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("n", [48, 44])
def test_tma_large_bucket_gives_the_pointer_kernels_bits(monkeypatch, dtype, n):
    """The large bucket in linear's layout runs the TMA kernel (a persistent grid walking several tiles per
    program; N = 48: TMA store, N = 44: rows not 16-byte aligned, masked stores; K = 40: a ragged, zero-filled
    last K step) and gives bitwise the pointer kernel's output with the same tiles; a row-major b, a column-major
    a, an fp32 output (too much shared memory for these tiles on an H200) and an [M, N] addend (the bias as a full
    tensor: the bias's bits) stay on the pointer kernel."""
    large = tk.M_TILE_CONFIGS[torch.float16][-1][1]
    assert large.get("tma")
    pointer = {key: value for key, value in large.items() if key != "tma"}
    taken = []
    real = tk._gemm_tma
    monkeypatch.setattr(tk, "_gemm_tma", lambda *args: (taken.append(True), real(*args)))
    m, k = 1030, 40
    a, w, bias = _rand((m, k), 0, dtype), _rand((n, k), 1, dtype), _rand((n,), 2, dtype)
    out, expected = (torch.empty(m, n, dtype=dtype, device=DEVICE) for _ in range(2))
    tk._gemm(a, w.T, out, addend=bias, cfg=large)
    assert taken == [True]
    tk._gemm(a, w.T, expected, addend=bias, cfg=pointer)
    assert torch.equal(out, expected)
    tk._gemm(a, w.T.contiguous(), torch.empty_like(out), addend=bias, cfg=large)
    tk._gemm(a.T.contiguous().T, w.T, torch.empty_like(out), addend=bias, cfg=large)
    tk._gemm(a, w.T, torch.empty(m, n, device=DEVICE), addend=bias, cfg=large)
    full = torch.empty_like(out)
    tk._gemm(a, w.T, full, addend=bias.expand(m, n).contiguous(), cfg=large)
    assert taken == [True]
    assert torch.equal(full, expected)


@interpreter
@pytest.mark.parametrize("leaves", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_addend_is_added_after_the_k_sum(small_tiles, dtype, leaves):
    """``_gemm``'s addend: ``out = round(fp32 tree of the K segments + addend)``, bitwise the fp32 partial plus the
    addend in torch, rounded once; for a bias ``[N]``, a full ``[M, N]`` addend of another layout (column-major),
    an fp32 ``out`` that is its own addend (``out += a @ b``), K = 40 (ragged steps) and 64 (even steps)."""
    m, n = 37, 40
    for k in (40, 64):
        a, b = _rand((m, k), 0, dtype), _operand((k, n), 1, dtype, True)
        partial = torch.empty(m, n, device=DEVICE)
        tk._gemm(a, b, partial, leaves=leaves)
        bias, full = _rand((n,), 2, dtype), _operand((m, n), 3, dtype, True)
        for addend in (bias, full):
            out = torch.empty(m, n, dtype=dtype, device=DEVICE)
            tk._gemm(a, b, out, addend=addend, leaves=leaves)
            assert torch.equal(out, (partial + addend.float()).to(dtype))
        acc = _rand((m, n), 4, torch.float32)
        expected = acc + partial
        tk._gemm(a, b, acc, addend=acc, leaves=leaves)
        assert torch.equal(acc, expected)


def test_m_tile_buckets_choice(monkeypatch):
    """tiles_for: on a checked GPU the bucket of M (one K segment only), elsewhere TILE_CONFIGS; CPU tensors
    never take the buckets."""
    cpu = torch.device("cpu")
    assert not tk.buckets_serve(cpu)
    assert tk.tiles_for(torch.bfloat16, 1, 1, cpu) is tk.TILE_CONFIGS[torch.bfloat16]
    monkeypatch.setattr(tk, "buckets_serve", lambda device: True)
    buckets = tk.M_TILE_CONFIGS[torch.bfloat16]
    small, large = buckets[0][1], buckets[-1][1]
    assert tk.tiles_for(torch.bfloat16, 1, 1, cpu) is small and tk.tiles_for(torch.bfloat16, 64, 1, cpu) is small
    assert tk.tiles_for(torch.bfloat16, 65, 1, cpu) is tk.TILE_CONFIGS[torch.bfloat16]
    assert tk.tiles_for(torch.bfloat16, 1023, 1, cpu) is tk.TILE_CONFIGS[torch.bfloat16]
    assert tk.tiles_for(torch.bfloat16, 1024, 1, cpu) is large
    assert tk.tiles_for(torch.bfloat16, 1, 8, cpu) is tk.TILE_CONFIGS[torch.bfloat16]  # the tree keeps its tiles
    assert tk.tiles_for(torch.float32, 1, 1, cpu) is tk.TILE_CONFIGS[torch.float32]


@pytest.mark.gpu
def test_grad_a_invariance_and_grad_b_determinism_gpu():
    dtype, n, k = torch.bfloat16, 4096, 4096
    w_t = _rand((n, k), 1, dtype, scale=k**-0.5).T
    probe, probe_g = _rand((1, k), 2, dtype), _rand((1, n), 3, dtype)
    alone = run_bwd(tk, probe_g, probe, w_t, want=(True, False, False))[0]
    for m in (1, 7, 129, 257, 4096):
        a, g = _rand((m, k), m, dtype), _rand((m, n), m + 1, dtype)
        pos = m // 2
        a[pos], g[pos] = probe[0], probe_g[0]
        ga, gb, gbias = run_bwd(tk, g, a, w_t)
        assert torch.equal(ga[pos : pos + 1], alone), m
        again = run_bwd(tk, g, a, w_t)
        assert torch.equal(again[1], gb) and torch.equal(again[2], gbias), m


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(300, 4096, 4096), (64, 12288, 4096), (1000, 4096, 12288), (5, 1000, 333)])
def test_matches_reference_gpu(dtype, shape):
    """(M, N, K) incl. the Qwen3-8B MLP shapes: values and all gradients vs fp64 under the contract."""
    m, n, k = shape
    check_case(dtype, m, n, k, b_cm=True)


@pytest.mark.gpu
def test_cublas_is_not_batch_invariant_gpu():
    """Negative control: the same probe check on ``torch.mm`` (cuBLAS) must find a differing M, which
    shows that the check can fail. If cuBLAS happens to be invariant on this stack, this fails and says so."""
    differ = _rows_vs_alone(lambda a, w: torch.mm(a, w.T), torch.bfloat16, 4096, 4096, FULL_M)
    assert differ, (
        "torch.mm was batch-invariant at N = K = 4096 bf16 for every M tried: the negative control "
        "shows nothing on this GPU / cuBLAS version; pick shapes where it differs"
    )
