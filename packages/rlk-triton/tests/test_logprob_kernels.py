"""Triton log-prob primitives against the reference (ground truth: the reference run in fp64).

On a machine without CUDA the kernels run under the Triton CPU interpreter
(``TRITON_INTERPRET=1``, set below before triton is imported), with small shapes;
with CUDA the same tests run on the GPU, plus the ``gpu``-marked ones (bf16 dots,
realistic shapes). Tolerances come from the numerical contract (``rlk.core.contract``);
batch invariance and determinism are checked bit for bit (``torch.equal``).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from rlk.core import contract
from rlk.reference import logprob as ref
from rlk_triton import logprob as tk
from rlk_triton import matmul as tm

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
IGNORE = -100

# The interpreter evaluates both branches of tl.where on masked lanes (log(0), 0 * -inf): harmless.
pytestmark = [
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]

# bf16 tl.dot gives wrong results under the CPU interpreter: bf16 linear runs only on a GPU
# (the repository conftest deselects ``gpu`` tests when no GPU is visible).
SELECTED_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
LINEAR_DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]

# Tiny tiles so that CPU-sized problems cover several row blocks, vocab splits / chunks and K steps.
SMALL_TILES = {
    "linear_fwd": {
        "BLOCK_N": 16,
        "BLOCK_V": 16,
        "BLOCK_K": 16,
        "VOCAB_SPLIT": 64,
        "GROUP_N": 2,
        "num_warps": 4,
        "num_stages": 1,
    },
    "linear_bwd": {
        "BLOCK_N": 16,
        "BLOCK_V": 16,
        "BLOCK_K": 16,
        "VOCAB_CHUNK": 48,
        "GROUP_N": 2,
        "num_warps": 4,
        "num_stages": 1,
    },
}
SMALL_GEMM = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 1}


@pytest.fixture
def small_tiles(monkeypatch):
    for family, cfg in SMALL_TILES.items():
        for dtype in list(tk.TILE_CONFIGS[family]):
            monkeypatch.setitem(tk.TILE_CONFIGS[family], dtype, dict(cfg))
    for dtype in list(tm.BACKWARD_TILE_CONFIGS):
        monkeypatch.setitem(tm.BACKWARD_TILE_CONFIGS, dtype, dict(SMALL_GEMM))


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _row_inputs(n: int, v: int, seed: int):
    """targets (row 1 ignored when n >= 3), per-row inv_temperature in [0.5, 2], grad_logprob, grad_entropy."""
    g = _gen(seed)
    targets = torch.randint(0, v, (n,), generator=g)
    if n >= 3:
        targets[1] = IGNORE
    inv_t = torch.rand(n, generator=g) * 1.5 + 0.5
    grad_lp = torch.randn(n, generator=g)
    grad_ent = torch.randn(n, generator=g)
    return targets, inv_t, grad_lp, grad_ent


def selected_inputs(n: int, v: int, dtype: torch.dtype, seed: int = 0, extreme: bool = False):
    """Logits ~ 3 N(0, 1); row 0 has -inf entries (not its target); with ``extreme`` row 2 is +-1e4."""
    targets, inv_t, grad_lp, grad_ent = _row_inputs(n, v, seed)
    x = torch.randn(n, v, generator=_gen(seed + 1)) * 3
    if v >= 3:
        x[0, 0::3] = -torch.inf
        targets[0] = 1
    if extreme and n >= 3 and v >= 2:
        x[2, 0::2] = 1e4
        x[2, 1::2] = -1e4
    to = {"device": DEVICE}
    return x.to(dtype).to(**to), targets.to(**to), inv_t.to(**to), grad_lp.to(**to), grad_ent.to(**to)


def linear_inputs(n: int, v: int, h: int, dtype: torch.dtype, seed: int = 0, extreme: bool = False):
    """hidden / weight giving logits ~ N(0, 1); with ``extreme`` row 2 of hidden is scaled x500 (logits in the
    thousands, a peaked softmax)."""
    targets, inv_t, grad_lp, grad_ent = _row_inputs(n, v, seed)
    g = _gen(seed + 1)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) / h**0.5
    if extreme and n >= 3:
        hidden[2] *= 500
    to = {"device": DEVICE}
    return (
        hidden.to(dtype).to(**to),
        weight.to(dtype).to(**to),
        targets.to(**to),
        inv_t.to(**to),
        grad_lp.to(**to),
        grad_ent.to(**to),
    )


def _stat_dtype(x: torch.Tensor) -> torch.dtype:
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def run_fwd(impl, op: str, data: tuple, targets, inv_t, with_entropy: bool) -> dict[str, torch.Tensor]:
    """Call ``impl.<op>_fwd`` on ``data`` (``(logits,)`` or ``(hidden, weight)``); returns its outputs."""
    n = data[0].shape[0]
    out = {name: torch.empty(n, dtype=_stat_dtype(data[0]), device=DEVICE) for name in ("logprob", "entropy", "lse")}
    fwd = getattr(impl, f"{op}_fwd")
    fwd(*data, targets, inv_t, IGNORE, out["logprob"], out["entropy"] if with_entropy else None, out["lse"])
    if not with_entropy:
        del out["entropy"]
    return out


def run_selected_bwd(impl, x, targets, inv_t, stats, grad_lp, grad_ent) -> torch.Tensor:
    grad = torch.empty_like(x)
    impl.selected_logprob_bwd(x, targets, inv_t, stats["lse"], stats.get("entropy"), grad_lp, grad_ent, IGNORE, grad)
    return grad


def run_linear_bwd(impl, hidden, weight, targets, inv_t, stats, grad_lp, grad_ent, want_hidden=True, want_weight=True):
    gh = torch.empty_like(hidden) if want_hidden else None
    gw = torch.empty_like(weight) if want_weight else None
    impl.linear_logprob_bwd(
        hidden, weight, targets, inv_t, stats["lse"], stats.get("entropy"), grad_lp, grad_ent, IGNORE, gh, gw
    )
    return gh, gw


def _f64(*tensors):
    return tuple(t.double() for t in tensors)


def check_stats(op: str, dtype: torch.dtype, got: dict, truth: dict, targets: torch.Tensor) -> float:
    """Contract check of logprob / entropy / lse (lse on non-ignored rows only); returns the max row scale."""
    entry = contract.entry(op, dtype)
    scale = contract.row_scale(truth["logprob"], truth["lse"])
    valid = targets != IGNORE
    for name, value in got.items():
        keep = valid if name == "lse" else torch.ones_like(valid)
        dev = contract.compare_outputs(entry, name, value[keep], truth[name][keep], scale[keep])
        assert dev.ok, dev
    assert bool((got["logprob"][~valid] == 0).all())
    if "entropy" in got:
        assert bool((got["entropy"][~valid] == 0).all())
    return float(scale[valid].max()) if bool(valid.any()) else 1.0


def check_grad(op: str, dtype: torch.dtype, name: str, grad: torch.Tensor, truth: torch.Tensor, max_scale: float):
    assert grad.dtype == dtype
    dev = contract.compare_grad(contract.entry(op, dtype), name, grad, truth, max_scale)
    assert dev.ok, dev


# ----------------------------------------------------------------------------------------------
# selected_logprob
# ----------------------------------------------------------------------------------------------

ENTROPY_MODES = ["off", "fwd_only", "fwd_and_grad"]


@pytest.mark.parametrize("entropy_mode", ENTROPY_MODES)
@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (37, 1000), (5, 3001), (3, 5000)])
@pytest.mark.parametrize("dtype", SELECTED_DTYPES)
def test_selected_matches_reference(dtype, shape, entropy_mode, extreme=False):
    n, v = shape
    x, targets, inv_t, grad_lp, grad_ent = selected_inputs(n, v, dtype, extreme=extreme)
    with_entropy = entropy_mode != "off"
    g_ent = grad_ent if entropy_mode == "fwd_and_grad" else None

    got = run_fwd(tk, "selected_logprob", (x,), targets, inv_t, with_entropy)
    truth = run_fwd(ref, "selected_logprob", _f64(x), targets, inv_t.double(), with_entropy)
    max_scale = check_stats("selected_logprob", dtype, got, truth, targets)

    grad = run_selected_bwd(tk, x, targets, inv_t, got, grad_lp, g_ent)
    grad_truth = run_selected_bwd(
        ref, *_f64(x), targets, inv_t.double(), truth, grad_lp.double(), None if g_ent is None else g_ent.double()
    )
    check_grad("selected_logprob", dtype, "grad_logits", grad, grad_truth, max_scale)
    assert bool((grad[targets == IGNORE] == 0).all())


@pytest.mark.parametrize("dtype", SELECTED_DTYPES)
def test_selected_extreme_logits(dtype):
    """A row of +-1e4 logits next to ordinary ones (the contract scales the bound by the logit size)."""
    test_selected_matches_reference(dtype, (5, 3001), "fwd_and_grad", extreme=True)


@pytest.mark.parametrize("dtype", SELECTED_DTYPES)
def test_selected_batch_invariance(dtype):
    v = 1000
    # the probe row has -inf entries; the batches hold ignored and +-1e4 rows
    probe, p_targets, p_inv_t, p_glp, p_gent = selected_inputs(1, v, dtype, seed=7)
    alone = run_fwd(tk, "selected_logprob", (probe,), p_targets, p_inv_t, True)
    alone_grad = run_selected_bwd(tk, probe, p_targets, p_inv_t, alone, p_glp, p_gent)
    for n in (2, 5, 37):
        x, targets, inv_t, glp, gent = selected_inputs(n, v, dtype, seed=n, extreme=True)
        for pos in sorted({0, n // 2, n - 1}):
            x[pos], targets[pos], inv_t[pos], glp[pos], gent[pos] = (
                probe[0],
                p_targets[0],
                p_inv_t[0],
                p_glp[0],
                p_gent[0],
            )
            out = run_fwd(tk, "selected_logprob", (x,), targets, inv_t, True)
            grad = run_selected_bwd(tk, x, targets, inv_t, out, glp, gent)
            for name in ("logprob", "entropy", "lse"):
                assert torch.equal(out[name][pos : pos + 1], alone[name]), (name, n, pos)
            assert torch.equal(grad[pos : pos + 1], alone_grad), (n, pos)


# Logits far from 0 (the offset) with an O(1) spread, where entropy = lse - E_p[z] would subtract two numbers
# of size |z|. float16 cannot hold the 1e6 and 3e38 offsets (6e4 stands in for them).
LARGE_LOGITS = [
    (torch.float32, 30.0, 0.05),
    (torch.float32, 1e6, 1.0),
    (torch.float32, 3e38, 1.0),
    (torch.bfloat16, 30.0, 0.05),
    (torch.bfloat16, 1e6, 1.0),
    (torch.bfloat16, 3e38, 1.0),
    (torch.float16, 30.0, 0.05),
    (torch.float16, 6e4, 1.0),
]


def large_logit_inputs(n: int, v: int, dtype: torch.dtype, offset: float, temperature: float, seed: int = 8):
    """``offset + N(0, 1)`` logits on a 1/64 grid, so that ``z = x * (1 / T)`` is exact in fp32 for T = 1 and
    0.05 (``1 / 0.05`` rounds to 20) and the fp64 reference sees the kernels' z; row 0 has -inf entries (not its
    target), row 1 is one-hot-like (its target ``20 / T`` above the other logits), row 2 is ignored."""
    targets, _, grad_lp, grad_ent = _row_inputs(n, v, seed)
    x = offset + torch.round(torch.randn(n, v, generator=_gen(seed + 1)) * 64) / 64
    x[0, 0::3] = -torch.inf
    targets[0], targets[2] = 1, IGNORE
    x[1] = offset - 20 * temperature
    x[1, targets[1]] = offset
    inv_t = torch.full((n,), 1.0 / temperature)
    to = {"device": DEVICE}
    return x.to(dtype).to(**to), targets.to(**to), inv_t.to(**to), grad_lp.to(**to), grad_ent.to(**to)


def check_entropy_of_large_logits(op: str, dtype: torch.dtype, entropy: torch.Tensor, truth: torch.Tensor):
    """Entropy finite and >= 0, and (z being exact) within the contract's atol / rtol on the entropy's own scale
    ``1 + |H|``: no error of the size of ``|z| * 2^-24``, which the contract's row scale would allow."""
    assert bool(torch.isfinite(entropy).all()) and bool((entropy >= 0).all()), entropy.min()
    dev = contract.compare_outputs(contract.entry(op, dtype), "entropy", entropy, truth, 1.0 + truth.abs())
    assert dev.ok, dev


@pytest.mark.parametrize(("dtype", "offset", "temperature"), LARGE_LOGITS)
def test_selected_entropy_of_large_logits(dtype, offset, temperature):
    """The entropy is accumulated relative to the running max (log s - b / s): a logit offset of 30 / 0.05 = 600
    (one-hot-like rows came out below 0), 1e6 (errors of ulp(1e6)) or 3e38 (the sum of z * exp(z - m) overflowed:
    entropy -inf) costs it no accuracy. V = 5000: several vocab tiles, so the state is moved to a larger max."""
    n, v = 6, 5000
    x, targets, inv_t, grad_lp, grad_ent = large_logit_inputs(n, v, dtype, offset, temperature)
    got = run_fwd(tk, "selected_logprob", (x,), targets, inv_t, True)
    truth = run_fwd(ref, "selected_logprob", _f64(x), targets, inv_t.double(), True)
    max_scale = check_stats("selected_logprob", dtype, got, truth, targets)
    check_entropy_of_large_logits("selected_logprob", dtype, got["entropy"], truth["entropy"])
    grad = run_selected_bwd(tk, x, targets, inv_t, got, grad_lp, grad_ent)
    grad_truth = run_selected_bwd(ref, *_f64(x), targets, inv_t.double(), truth, grad_lp.double(), grad_ent.double())
    check_grad("selected_logprob", dtype, "grad_logits", grad, grad_truth, max_scale)


# ----------------------------------------------------------------------------------------------
# linear_logprob
# ----------------------------------------------------------------------------------------------


def _linear_case(dtype, shape, entropy_mode, extreme=False):
    """Run fwd + bwd of the kernels and of the fp64 reference; check them against the contract."""
    n, v, h = shape
    hidden, weight, targets, inv_t, grad_lp, grad_ent = linear_inputs(n, v, h, dtype, extreme=extreme)
    with_entropy = entropy_mode != "off"
    g_ent = grad_ent if entropy_mode == "fwd_and_grad" else None

    got = run_fwd(tk, "linear_logprob", (hidden, weight), targets, inv_t, with_entropy)
    truth = run_fwd(ref, "linear_logprob", _f64(hidden, weight), targets, inv_t.double(), with_entropy)
    max_scale = check_stats("linear_logprob", dtype, got, truth, targets)

    gh, gw = run_linear_bwd(tk, hidden, weight, targets, inv_t, got, grad_lp, g_ent)
    gh_truth, gw_truth = run_linear_bwd(
        ref,
        *_f64(hidden, weight),
        targets,
        inv_t.double(),
        truth,
        grad_lp.double(),
        None if g_ent is None else g_ent.double(),
    )
    check_grad("linear_logprob", dtype, "grad_hidden", gh, gh_truth, max_scale)
    check_grad("linear_logprob", dtype, "grad_weight", gw, gw_truth, max_scale)
    assert bool((gh[targets == IGNORE] == 0).all())


@pytest.mark.parametrize("entropy_mode", ENTROPY_MODES)
@pytest.mark.parametrize("shape", [(1, 1, 16), (5, 7, 16), (37, 1000, 40), (5, 3001, 16), (3, 4100, 16)])
@pytest.mark.parametrize("dtype", LINEAR_DTYPES)
def test_linear_matches_reference(dtype, shape, entropy_mode):
    _linear_case(dtype, shape, entropy_mode)


@pytest.mark.parametrize("entropy_mode", ["off", "fwd_and_grad"])
@pytest.mark.parametrize("shape", [(37, 300, 40), (20, 70, 16)])
@pytest.mark.parametrize("dtype", LINEAR_DTYPES)
def test_linear_small_tiles_match_reference(small_tiles, dtype, shape, entropy_mode):
    """Several row blocks, vocab splits/chunks (incl. a ragged last one) and K steps per problem."""
    _linear_case(dtype, shape, entropy_mode)


@pytest.mark.parametrize("dtype", LINEAR_DTYPES)
def test_linear_extreme_logits(small_tiles, dtype):
    """A hidden row scaled x500 (logits in the thousands) next to ordinary rows."""
    _linear_case(dtype, (37, 200, 40), "fwd_and_grad", extreme=True)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")  # ignored rows (lse 0): masked
@pytest.mark.parametrize(("offset", "temperature"), [(30.0, 0.05), (1e5, 1.0)])
@pytest.mark.parametrize("dtype", LINEAR_DTYPES)
def test_linear_entropy_of_large_logits(small_tiles, dtype, offset, temperature):
    """An offset column (hidden[:, 0] * weight[:, 0] = offset) and multiples of 1/4 in [-0.5, 0.5] elsewhere:
    every logit is ``offset`` plus a multiple of 1/16, which the fp32 dot products compute exactly (as z = x * 20),
    so the fp64 reference sees the kernels' z (1e5, not 1e6: 3 bits to spare in the tensor cores' fp32
    accumulation). Small tiles: several vocab splits, merged in the combine kernel."""
    n, v, h = 37, 200, 40
    _, _, targets, inv_t, grad_lp, grad_ent = linear_inputs(n, v, h, torch.float32)
    g = _gen(12)
    hidden = torch.randint(-2, 3, (n, h), generator=g) / 4
    weight = torch.randint(-2, 3, (v, h), generator=g) / 4
    hidden[:, 0], weight[:, 0] = (1000.0, offset / 1000) if offset > 1000 else (offset, 1.0)
    hidden, weight = hidden.to(dtype).to(DEVICE), weight.to(dtype).to(DEVICE)
    inv_t = torch.full_like(inv_t, 1.0 / temperature)
    got = run_fwd(tk, "linear_logprob", (hidden, weight), targets, inv_t, True)
    truth = run_fwd(ref, "linear_logprob", _f64(hidden, weight), targets, inv_t.double(), True)
    max_scale = check_stats("linear_logprob", dtype, got, truth, targets)
    check_entropy_of_large_logits("linear_logprob", dtype, got["entropy"], truth["entropy"])
    gh, gw = run_linear_bwd(tk, hidden, weight, targets, inv_t, got, grad_lp, grad_ent)
    gh_truth, gw_truth = run_linear_bwd(
        ref, *_f64(hidden, weight), targets, inv_t.double(), truth, grad_lp.double(), grad_ent.double()
    )
    check_grad("linear_logprob", dtype, "grad_hidden", gh, gh_truth, max_scale)
    check_grad("linear_logprob", dtype, "grad_weight", gw, gw_truth, max_scale)


@pytest.mark.parametrize("dtype", LINEAR_DTYPES)
def test_linear_bwd_optional_outputs(small_tiles, dtype):
    """grad_hidden_out / grad_weight_out may be None: the other one is unchanged bit for bit."""
    hidden, weight, targets, inv_t, grad_lp, grad_ent = linear_inputs(37, 200, 40, dtype)
    stats = run_fwd(tk, "linear_logprob", (hidden, weight), targets, inv_t, True)
    gh, gw = run_linear_bwd(tk, hidden, weight, targets, inv_t, stats, grad_lp, grad_ent)
    gh_only, none_w = run_linear_bwd(tk, hidden, weight, targets, inv_t, stats, grad_lp, grad_ent, want_weight=False)
    none_h, gw_only = run_linear_bwd(tk, hidden, weight, targets, inv_t, stats, grad_lp, grad_ent, want_hidden=False)
    assert none_w is None and none_h is None
    assert torch.equal(gh_only, gh)
    assert torch.equal(gw_only, gw)
    run_linear_bwd(tk, hidden, weight, targets, inv_t, stats, grad_lp, grad_ent, want_hidden=False, want_weight=False)


def _linear_batch_invariance(dtype, v, h, batch_sizes):
    probe_h, _, p_targets, p_inv_t, p_glp, p_gent = linear_inputs(1, v, h, dtype, seed=11)
    _, weight, *_ = linear_inputs(1, v, h, dtype, seed=0)
    alone = run_fwd(tk, "linear_logprob", (probe_h, weight), p_targets, p_inv_t, True)
    alone_gh, _ = run_linear_bwd(tk, probe_h, weight, p_targets, p_inv_t, alone, p_glp, p_gent, want_weight=False)
    for n in batch_sizes:
        hidden, _, targets, inv_t, glp, gent = linear_inputs(n, v, h, dtype, seed=n, extreme=True)
        for pos in sorted({0, n // 2, n - 1}):
            hidden[pos], targets[pos], inv_t[pos], glp[pos], gent[pos] = (
                probe_h[0],
                p_targets[0],
                p_inv_t[0],
                p_glp[0],
                p_gent[0],
            )
            out = run_fwd(tk, "linear_logprob", (hidden, weight), targets, inv_t, True)
            gh, _ = run_linear_bwd(tk, hidden, weight, targets, inv_t, out, glp, gent)
            for name in ("logprob", "entropy", "lse"):
                assert torch.equal(out[name][pos : pos + 1], alone[name]), (name, n, pos)
            assert torch.equal(gh[pos : pos + 1], alone_gh), (n, pos)


@pytest.mark.parametrize("dtype", LINEAR_DTYPES)
def test_linear_batch_invariance_default_tiles(dtype):
    block_n = max(tk.TILE_CONFIGS[family][dtype]["BLOCK_N"] for family in ("linear_fwd", "linear_bwd"))
    _linear_batch_invariance(dtype, 300, 40, (2, 37, block_n + 2))


@pytest.mark.parametrize("dtype", LINEAR_DTYPES)
def test_linear_batch_invariance_small_tiles(small_tiles, dtype):
    _linear_batch_invariance(dtype, 150, 40, (2, 17, 37))


@pytest.mark.parametrize("dtype", LINEAR_DTYPES)
def test_linear_bwd_deterministic(small_tiles, dtype):
    hidden, weight, targets, inv_t, grad_lp, grad_ent = linear_inputs(37, 150, 40, dtype)
    stats = run_fwd(tk, "linear_logprob", (hidden, weight), targets, inv_t, True)
    first = run_linear_bwd(tk, hidden, weight, targets, inv_t, stats, grad_lp, grad_ent)
    second = run_linear_bwd(tk, hidden, weight, targets, inv_t, stats, grad_lp, grad_ent)
    assert torch.equal(first[1], second[1])
    assert torch.equal(first[0], second[0])


# ----------------------------------------------------------------------------------------------
# the backward's GEMM (rlk_triton.matmul's kernel with BACKWARD_TILE_CONFIGS) and the tile tables
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("transpose_a", [False, True])
@pytest.mark.parametrize("dtype", LINEAR_DTYPES)
def test_gemm(small_tiles, dtype, transpose_a, accumulate):
    """C = A @ B (+ C_in) through the backward's tiles, with A given as a transposed view, ragged M / N / K, an fp32
    C_in aliasing C."""
    m, n, k = 37, 40, 70
    g = _gen(3)
    a = (torch.randn(k, m, generator=g).T if transpose_a else torch.randn(m, k, generator=g)).to(dtype).to(DEVICE)
    b = torch.randn(k, n, generator=g).to(dtype).to(DEVICE)
    c0 = torch.randn(m, n, generator=g).to(DEVICE)
    expected = a.double() @ b.double() + (c0.double() if accumulate else 0)
    out = c0.clone() if accumulate else torch.empty(m, n, dtype=dtype, device=DEVICE)
    tm._gemm(a, b, out, addend=out if accumulate else None, cfg=tm.BACKWARD_TILE_CONFIGS[dtype])
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}[dtype]
    torch.testing.assert_close(out.double(), expected, rtol=tol, atol=tol * float(expected.abs().max()))


def test_tile_configs_are_consistent():
    for family in ("selected", "linear_fwd", "linear_bwd", "stored_grad"):
        assert set(tk.TILE_CONFIGS[family]) == {torch.float32, torch.float16, torch.bfloat16}
    assert set(tm.BACKWARD_TILE_CONFIGS) == {torch.float32, torch.float16, torch.bfloat16}
    for cfg in tk.TILE_CONFIGS["linear_fwd"].values():
        assert cfg["VOCAB_SPLIT"] % cfg["BLOCK_V"] == 0


# ----------------------------------------------------------------------------------------------
# GPU only: realistic shapes
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_linear_realistic_shape_gpu(dtype):
    _linear_case(dtype, (300, 20000, 1024), "fwd_and_grad")
    _linear_batch_invariance(dtype, 20000, 1024, (1, 7, 300))


@pytest.mark.gpu
def test_selected_int64_indexing_gpu():
    """N * V > 2^31: rows near the end of a 14200 x 151936 bf16 batch match the row computed alone."""
    n, v = 14200, 151936
    x = torch.randn(n, v, device=DEVICE, dtype=torch.bfloat16)
    targets = torch.randint(0, v, (n,), device=DEVICE)
    inv_t = torch.ones(n, device=DEVICE)
    grad_lp = torch.ones(n, device=DEVICE)
    out = run_fwd(tk, "selected_logprob", (x,), targets, inv_t, True)
    last = slice(n - 2, n)
    x_last = x[last].double()
    truth = run_fwd(ref, "selected_logprob", (x_last,), targets[last], inv_t[last].double(), True)
    max_scale = check_stats(
        "selected_logprob", torch.bfloat16, {k: t[last] for k, t in out.items()}, truth, targets[last]
    )
    grad = run_selected_bwd(tk, x, targets, inv_t, out, grad_lp, None)
    grad_truth = run_selected_bwd(ref, x_last, targets[last], inv_t[last].double(), truth, grad_lp[last].double(), None)
    check_grad("selected_logprob", torch.bfloat16, "grad_logits", grad[last], grad_truth, max_scale)


@pytest.mark.gpu
def test_linear_batch_invariance_headline_shape_gpu():
    """A row alone vs at first/middle/last of N = 16384 rows, V = 151936, H = 4096, bf16 (N*V > 2^31)."""
    _linear_batch_invariance(torch.bfloat16, 151936, 4096, (16384,))


_PTX_CHECK = """
import re, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from rlk_triton import logprob as tk
signature = {"logits_ptr": "*bf16", "targets_ptr": "*i64", "inv_t_ptr": "*fp32", "lse_ptr": "*fp32",
             "entropy_ptr": "*fp32", "g_lp_ptr": "*fp32", "g_ent_ptr": "*fp32", "grad_ptr": "*bf16", "V": "i32",
             "ignore_index": "i64", "HAS_ENT": "constexpr", "BLOCK_V": "constexpr"}
source = ASTSource(fn=tk._selected_bwd_kernel, signature=signature, constexprs={"HAS_ENT": True, "BLOCK_V": 1024})
target = GPUTarget("cuda", 90, 32)
fused = triton.compile(source, target=target).asm["ptx"]
plain = triton.compile(source, target=target, options=tk._NO_FP_FUSION).asm["ptx"]
print(len(re.findall(r"\\bfma\\.rn\\.f32", fused)), len(re.findall(r"\\bfma\\.rn\\.f32", plain)))
"""


def test_z_is_one_rounded_multiply_in_the_compiled_kernel():
    """The ABI's ``z = x * inv_temperature`` is a rounded fp32 multiply: compiled for sm_90 (PTX, no GPU needed;
    in a process without the interpreter) with the launchers' options, the selected_logprob backward has no fused
    multiply-add. Without the option LLVM forms ``fma(x, inv_t, -lse)`` and ``p_target`` can exceed 1 by an ulp."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _PTX_CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    fused, plain = map(int, result.stdout.split())
    assert fused > 0, "the check no longer sees LLVM's contraction: revisit it"
    assert plain == 0
