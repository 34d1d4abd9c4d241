"""Triton softmax primitives against the reference (ground truth: the reference run in fp64).

Without CUDA the kernels run under the Triton CPU interpreter (``TRITON_INTERPRET=1``) with small
shapes and small tiles; with CUDA the same tests run on the GPU, plus the ``gpu``-marked ones (bf16,
real vocab sizes). Tolerances come from the contract; batch invariance is checked bit for bit.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from rlk.core import contract
from rlk.reference import softmax as ref
from rlk_triton import softmax as tk

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"

pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
]
# Interpreter tests stay tiny; on a GPU the same tests run at once (the marker only gates the CPU run).
interp = pytest.mark.triton_interpreter if not ON_GPU else pytest.mark.gpu
# fp32 -> bf16 casts truncate under the interpreter: bf16 values are checked on the GPU only.
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]
ROW_COUNTS = [1, 2, 7, 8, 15, 16, 17, 31, 32, 33, 63, 64, 65]


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiny chunks so that CPU-sized rows span several chunks and a ragged tail."""
    if not ON_GPU:
        for dtype in list(tk.TILE_CONFIGS):
            monkeypatch.setitem(tk.TILE_CONFIGS, dtype, {"BLOCK_V": 16, "num_warps": 4})


def _inputs(n: int, v: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """~3 N(0, 1) rows; row 0 has -inf entries (v >= 3), row 2 (n >= 3) values of +-1e4."""
    x = torch.randn(n, v, generator=torch.Generator().manual_seed(seed)) * 3
    if v >= 3:
        x[0, 0::3] = -torch.inf
    if n >= 3:
        x[2, 0::2] = 1e4
        x[2, 1::2] = -1e4
    return x.to(dtype).to(DEVICE)


def _fwd(impl, x: torch.Tensor, log: bool, dtype=None) -> torch.Tensor:
    out = torch.empty_like(x, dtype=dtype or x.dtype)
    impl.softmax_fwd(x, log, out)
    return out


def _bwd(impl, g: torch.Tensor, y: torch.Tensor, log: bool) -> torch.Tensor:
    grad = torch.empty_like(y)
    impl.softmax_bwd(g, y, log, grad)
    return grad


def _check(dtype, name, got, truth):
    finite = torch.isfinite(truth)
    dev = contract.compare_outputs(
        contract.entry("softmax", dtype), name, got[finite], truth[finite], 1.0 + truth[finite].abs()
    )
    assert dev.ok, dev
    # -inf outputs (log_softmax of -inf entries) must be exactly -inf
    assert torch.equal(got.double()[~finite], truth[~finite])


@interp
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
@pytest.mark.parametrize("v", [1, 16, 53])
def test_forward_and_backward_match_reference(small_tiles, dtype, log, v):
    x = _inputs(5, v, dtype)
    y = _fwd(tk, x, log)
    truth = _fwd(ref, x.double(), log)
    _check(dtype, "out", y, truth)
    g = torch.randn(5, v, generator=torch.Generator().manual_seed(1)).to(dtype).to(DEVICE)
    grad = _bwd(tk, g, y, log)
    # ground truth of the backward: the reference in fp64 on the same (rounded) output y
    grad_truth = _bwd(ref, g.double(), y.double(), log)
    e = contract.entry("softmax", dtype)
    keep = torch.isfinite(grad_truth).all(dim=1)
    dev = contract.compare_grad(e, "grad_x", grad[keep], grad_truth[keep], 1.0)
    assert dev.ok, dev


@interp
def test_all_minus_inf_row_gives_nan(small_tiles):
    x = torch.full((2, 20), -torch.inf, device=DEVICE)
    x[1] = torch.arange(20.0)
    for log in (False, True):
        y = _fwd(tk, x, log)
        assert torch.isnan(y[0]).all() and torch.isfinite(y[1]).all()


@interp
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("log", [False, True], ids=["softmax", "log_softmax"])
def test_rows_are_batch_invariant(small_tiles, dtype, log):
    """A row's outputs and gradient are bitwise the same whatever the row count and its position."""
    v = 45
    pool = _inputs(70, v, dtype, seed=3)
    g_pool = torch.randn(70, v, generator=torch.Generator().manual_seed(4)).to(dtype).to(DEVICE)
    probe = 5  # the row followed across batches
    alone_y = _fwd(tk, pool[probe : probe + 1].contiguous(), log)
    alone_g = _bwd(tk, g_pool[probe : probe + 1].contiguous(), alone_y, log)
    counts = ROW_COUNTS if ON_GPU else [1, 2, 7, 16, 33, 65]
    for n in counts:
        position = n // 2  # the probe sits in the middle (the first row when alone)
        rows = torch.randperm(70, generator=torch.Generator().manual_seed(n))[:n]
        rows = rows[rows != probe][: n - 1]
        order = torch.cat([rows[:position], torch.tensor([probe]), rows[position:]])
        x = pool[order.to(DEVICE)].contiguous()
        y = _fwd(tk, x, log)
        grad = _bwd(tk, g_pool[order.to(DEVICE)].contiguous(), y, log)
        assert torch.equal(y[position], alone_y[0]), f"forward row differs with {n} rows"
        assert torch.equal(grad[position], alone_g[0]), f"backward row differs with {n} rows"


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("v", [151936, 128256])
def test_real_vocab_sizes_on_the_gpu(dtype, v):
    for log in (False, True):
        x = _inputs(64, v, dtype, seed=5)
        y = _fwd(tk, x, log)
        _check(dtype, "out", y, _fwd(ref, x.double(), log))
        g = torch.randn(64, v, generator=torch.Generator().manual_seed(6)).to(dtype).to(DEVICE)
        grad = _bwd(tk, g, y, log)
        grad_truth = _bwd(ref, g.double(), y.double(), log)
        keep = torch.isfinite(grad_truth).all(dim=1)
        dev = contract.compare_grad(contract.entry("softmax", dtype), "grad_x", grad[keep], grad_truth[keep], 1.0)
        assert dev.ok, dev
        for n in ROW_COUNTS:
            assert torch.equal(_fwd(tk, x[3 : 3 + n].contiguous(), log)[0], y[3]), f"{n} rows"
            assert torch.equal(_bwd(tk, g[3 : 3 + n].contiguous(), y[3 : 3 + n].contiguous(), log)[0], grad[3])
