"""Triton ``rms_norm`` primitives against the reference (ground truth: the reference run in fp64).

Without CUDA the kernels run under the Triton CPU interpreter (``TRITON_INTERPRET=1``, tests marked
``triton_interpreter``, tiny shapes, fp32 and fp16: the interpreter truncates fp32 -> bf16 casts, so
bf16 is checked on the GPU only); with CUDA the ``gpu`` tests add bf16 and realistic shapes. Tolerances
come from the numerical contract (``rlk.core.contract``); batch invariance and determinism are checked bit
for bit (``torch.equal``).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from rlk.core import contract
from rlk.ops.norm import output_dtype
from rlk.reference import norm as ref
from rlk_triton import norm as tk

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
EPS = 1e-6
CPU_DTYPES = [torch.float32, torch.float16]
# Row counts of the invariance matrix: around the backward's 32-row programs and powers of two.
GPU_ROW_COUNTS = (1, 2, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65, 127, 128, 129, 131, 132, 133, 255, 256, 257, 1024)
CPU_ROW_COUNTS = (1, 2, 7, 8, 15, 16, 17, 31, 33, 63, 65, 127, 129)

interp = pytest.mark.triton_interpreter


@pytest.fixture
def long_rows(monkeypatch):
    """Rows wider than 32 columns take the chunked path (several chunks, a ragged last one)."""
    for dtype in list(tk.TILE_CONFIGS):
        monkeypatch.setitem(tk.TILE_CONFIGS[dtype], "MAX_BLOCK_H", 32)


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def make_inputs(
    n: int,
    h: int,
    dtype: torch.dtype,
    seed: int = 0,
    w_dtype: torch.dtype | None = None,
    fused: bool = True,
    scale: float = 1.0,
) -> dict:
    """x ~ scale * N(0, 1) (row 0 all zeros when n >= 3), weight ~ 1 + 0.3 N(0, 1), residual, grad_y, grad_s."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g) * scale
    if n >= 3:
        x[0] = 0.0
    data = {
        "x": x,
        "weight": 1.0 + 0.3 * torch.randn(h, generator=g),
        "residual": torch.randn(n, h, generator=g) * scale if fused else None,
        "grad_y": torch.randn(n, h, generator=g),
        "grad_s": torch.randn(n, h, generator=g) if fused else None,
    }
    dtypes = {"x": dtype, "weight": w_dtype or dtype, "residual": dtype, "grad_y": dtype, "grad_s": dtype}
    out = {k: None if v is None else v.to(DEVICE, dtypes[k]) for k, v in data.items()}
    if fused and n >= 3:
        out["residual"][0] = 0.0
    return out


def as_f64(data: dict) -> dict:
    return {k: None if v is None else v.double() for k, v in data.items()}


def run(impl, data: dict, gemma: bool, want_dw: bool = True, eps: float = EPS) -> dict:
    """Forward then backward of ``impl`` (the triton module or the reference) on ``data``."""
    x, w, r = data["x"], data["weight"], data["residual"]
    n = x.shape[0]
    y = torch.empty(x.shape, dtype=output_dtype(x.dtype, w.dtype, gemma), device=x.device)
    s = torch.empty_like(x) if r is not None else None
    rstd = torch.empty(n, dtype=torch.float64 if x.dtype == torch.float64 else torch.float32, device=x.device)
    impl.rms_norm_fwd(x, w, r, eps, gemma, y, s, rstd)
    grad_x = torch.empty_like(x)
    grad_w = torch.empty_like(w) if want_dw else None
    impl.rms_norm_bwd(data["grad_y"].to(y.dtype), x if s is None else s, w, rstd, gemma, data["grad_s"], grad_x, grad_w)
    return {"y": y, "s": s, "rstd": rstd, "grad_x": grad_x, "grad_w": grad_w}


def check_against_reference(data: dict, gemma: bool) -> dict:
    """Contract check of every output of the kernels vs the fp64 reference; returns the worst ratios."""
    dtype = data["x"].dtype
    got = run(tk, data, gemma)
    truth = run(ref, as_f64(data), gemma)
    e = contract.entry("rms_norm", dtype)
    ratios = {}
    for name in ("y", "rstd"):
        dev = contract.compare_outputs(
            e, name, got[name].reshape(-1), truth[name].reshape(-1), 1.0 + truth[name].abs().reshape(-1)
        )
        assert dev.ok, dev
        ratios[name] = dev.ratio
    if data["residual"] is not None:  # the new residual is torch's x + residual, bit for bit
        assert torch.equal(got["s"], data["x"] + data["residual"])
    for name in ("grad_x", "grad_w"):
        assert got[name].dtype == data["x" if name == "grad_x" else "weight"].dtype
        dev = contract.compare_grad(e, name, got[name], truth[name], 1.0)
        assert dev.ok, dev
        ratios[name] = dev.ratio
    return ratios


def check_invariance(dtype: torch.dtype, h: int, row_counts, gemma: bool, fused: bool, positions=None) -> None:
    """A needle row alone vs at first / middle / last of batches: y, s, rstd, grad_x bit for bit."""
    needle = make_inputs(1, h, dtype, seed=99, fused=fused, scale=3.0)
    alone = run(tk, needle, gemma, want_dw=False)
    for n in row_counts:
        batch = make_inputs(n, h, dtype, seed=n, fused=fused)
        batch["weight"] = needle["weight"]
        for pos in positions(n) if positions else sorted({0, n // 2, n - 1}):
            for key, value in needle.items():
                if value is not None and key != "weight":
                    batch[key][pos] = value[0]
            out = run(tk, batch, gemma)
            for name in ("y", "s", "rstd", "grad_x"):
                if out[name] is not None:
                    assert torch.equal(out[name][pos : pos + 1], alone[name]), (name, n, pos)


# ----------------------------------------------------------------------------------------------
# interpreter (and GPU) tests: tiny shapes
# ----------------------------------------------------------------------------------------------


@interp
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("h", [64, 96])
@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_matches_reference(dtype, h, gemma, fused):
    check_against_reference(make_inputs(37, h, dtype, fused=fused), gemma)


@interp
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("h", [80, 96])
@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_long_rows_match_reference(long_rows, dtype, h, gemma):
    """The chunked path (rows wider than MAX_BLOCK_H, ragged last chunk for H = 80)."""
    check_against_reference(make_inputs(37, h, dtype), gemma)


@interp
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
def test_fp32_weight_with_fp16_input(gemma):
    """fp32 master weights: y is fp32 for Llama (torch promotion), fp16 for Gemma; grad_weight is fp32."""
    data = make_inputs(9, 64, torch.float16, w_dtype=torch.float32)
    out = run(tk, data, gemma)
    assert out["y"].dtype == (torch.float16 if gemma else torch.float32)
    assert out["grad_w"].dtype == torch.float32
    check_against_reference(data, gemma)


@interp
def test_large_and_small_magnitudes():
    """Rows of magnitude 1e4 and 1e-4 (rstd in [1e-4, 1e4]), an all-zero row (y = 0, finite gradients)."""
    for scale in (1e4, 1e-4):
        data = make_inputs(5, 96, torch.float32, scale=scale)
        ratios = check_against_reference(data, gemma=False)
        assert all(r <= 1 for r in ratios.values())
    out = run(tk, make_inputs(5, 96, torch.float32), gemma=False)
    assert bool((out["y"][0] == 0).all()) and bool(torch.isfinite(out["grad_x"]).all())


@interp
@pytest.mark.parametrize(("scale", "eps"), [(1e20, EPS), (1e-30, 0.0)])
def test_extreme_magnitudes_in_long_rows(long_rows, scale, eps):
    """Rows whose mean of squares overflows (|s| ~ 1e20: rstd was 0, y = 0) or underflows (1e-30 with eps = 0: rstd
    was inf) sum the squares again of s scaled by a power of two, on the chunked path too (rows of 80 in chunks of
    32, the row read once more): y, rstd and the gradients within the contract of the fp64 reference."""
    data = make_inputs(2, 80, torch.float32, scale=scale)  # two rows: no all-zero row (0 / 0 with eps = 0)
    got, truth = run(tk, data, False, eps=eps), run(ref, as_f64(data), False, eps=eps)
    e = contract.entry("rms_norm", torch.float32)
    for name in ("y", "rstd"):
        want = truth[name].reshape(-1)
        dev = contract.compare_outputs(e, name, got[name].reshape(-1), want, 1.0 + want.abs())
        assert dev.ok, (name, dev)
    for name in ("grad_x", "grad_w"):
        dev = contract.compare_grad(e, name, got[name], truth[name], 1.0)
        assert dev.ok, (name, dev)


@interp
def test_bwd_without_grad_weight_and_determinism():
    data = make_inputs(70, 64, torch.float32)
    first, second = run(tk, data, gemma=False), run(tk, data, gemma=False)
    assert torch.equal(first["grad_w"], second["grad_w"])
    no_dw = run(tk, data, gemma=False, want_dw=False)
    assert no_dw["grad_w"] is None and torch.equal(no_dw["grad_x"], first["grad_x"])


@interp
def test_rows_per_program_do_not_change_the_bits(monkeypatch):
    """FWD_ROWS only groups rows into programs; BWD_ROWS also changes the grad-weight partition only."""
    data = make_inputs(37, 64, torch.float32)
    base = run(tk, data, gemma=False)
    monkeypatch.setitem(tk.TILE_CONFIGS[torch.float32], "FWD_ROWS", 1)
    monkeypatch.setitem(tk.TILE_CONFIGS[torch.float32], "BWD_ROWS", 4)
    other = run(tk, data, gemma=False)
    for name in ("y", "s", "rstd", "grad_x"):
        assert torch.equal(other[name], base[name]), name
    torch.testing.assert_close(other["grad_w"], base["grad_w"], rtol=1e-6, atol=1e-6)


@interp
@pytest.mark.parametrize("dtype", CPU_DTYPES)
def test_batch_invariance(dtype):
    """The interpreter's matrix: fp32 every row count at first / middle / last, fused Llama; fp16 sampled."""
    if dtype == torch.float32:
        check_invariance(dtype, 96, CPU_ROW_COUNTS, gemma=False, fused=True)
    else:
        check_invariance(dtype, 64, (1, 17, 33, 129), gemma=True, fused=False)


@interp
def test_batch_invariance_long_rows(long_rows):
    check_invariance(torch.float32, 80, (1, 7, 33), gemma=False, fused=True)


def test_tile_configs():
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        cfg = tk.TILE_CONFIGS[dtype]
        for key in ("MAX_BLOCK_H", "SUM_BLOCK_P", "SUM_BLOCK_H", "BWD_ROWS"):
            assert cfg[key] & (cfg[key] - 1) == 0, (dtype, key)  # powers of two (tl.arange sizes)
        # the row tiles are a function of H only, and H = 4096 runs one chunk with 8 warps
        assert tk._row_tiles(4096, dtype) == (4096, 1, 8)
        assert tk._row_tiles(5120, dtype)[:2] == (8192, 1)
        assert tk._row_tiles(96, dtype) == (128, 1, 1)


# ----------------------------------------------------------------------------------------------
# GPU only: bf16, realistic shapes, the full invariance matrix
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_headline_shape_matches_reference_gpu(dtype, gemma, fused):
    """[16384, 4096] under the contract, and grad_weight identical across two runs."""
    data = make_inputs(16384, 4096, dtype, fused=fused)
    check_against_reference(data, gemma)
    assert torch.equal(run(tk, data, gemma)["grad_w"], run(tk, data, gemma)["grad_w"])


@pytest.mark.gpu
@pytest.mark.parametrize("h", [96, 5120, 20000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_other_widths_match_reference_gpu(dtype, h):
    """H not a power of two; 20000 > MAX_BLOCK_H takes the chunked path."""
    check_against_reference(make_inputs(1000, h, dtype), gemma=False)
    check_against_reference(make_inputs(1000, h, dtype, w_dtype=torch.float32, fused=False), gemma=True)


@pytest.mark.gpu
@pytest.mark.parametrize("fused", [False, True], ids=["plain", "residual"])
@pytest.mark.parametrize("gemma", [False, True], ids=["llama", "gemma"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_batch_invariance_gpu(dtype, gemma, fused):
    check_invariance(dtype, 4096, GPU_ROW_COUNTS, gemma, fused)


@pytest.mark.gpu
@pytest.mark.parametrize("h", [5120, 20000])
def test_batch_invariance_other_widths_gpu(h):
    check_invariance(torch.bfloat16, h, (1, 31, 33, 257), gemma=False, fused=True)


@pytest.mark.gpu
def test_batch_invariance_headline_shape_gpu():
    """A row alone vs at first / middle / last of 16384 rows of 4096, bf16, fused residual."""
    check_invariance(torch.bfloat16, 4096, (16384,), gemma=False, fused=True)


@pytest.mark.gpu
def test_int64_offsets_gpu():
    """N * H > 2^31 (bf16 [132000, 16384]): the last rows match the same rows run alone."""
    n, h = 132000, 16384
    g = torch.Generator(DEVICE).manual_seed(5)
    data = {
        "x": torch.randn(n, h, generator=g, device=DEVICE, dtype=torch.bfloat16),
        "weight": torch.rand(h, generator=g, device=DEVICE, dtype=torch.bfloat16) + 0.5,
        "residual": None,
        "grad_y": torch.randn(n, h, generator=g, device=DEVICE, dtype=torch.bfloat16),
        "grad_s": None,
    }
    out = run(tk, data, gemma=False, want_dw=False)
    tail = {k: None if v is None else (v if k == "weight" else v[-3:].clone()) for k, v in data.items()}
    alone = run(tk, tail, gemma=False, want_dw=False)
    for name in ("y", "rstd", "grad_x"):
        assert torch.equal(out[name][-3:], alone[name]), name
