"""Triton ``fused_linear_kl`` primitives against the reference (ground truth: the reference run in fp64).

Without CUDA the kernels run under the Triton CPU interpreter (small shapes, tiny tiles so that a problem spans
several row blocks, vocab splits and chunks and K steps); with CUDA the same tests run on the GPU, plus the
``gpu``-marked ones (bf16 dots, realistic shapes). Tolerances come from the contract; batch invariance and
determinism are checked bit for bit (``torch.equal``).
"""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

import rlk
from rlk.core import contract
from rlk.reference import distill as ref
from rlk_triton import distill as tk
from rlk_triton import matmul as tk_matmul

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
IGNORE = -100
DIVERGENCES = ["forward_kl", "reverse_kl", "jsd"]
BETA = 0.3

# The interpreter evaluates both branches of tl.where on masked lanes (log(0), 0 * -inf): harmless.
pytestmark = [
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    # rows past N in a block read zeros: with a -inf weight entry their (never stored) logits are NaN
    pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning"),
]

# bf16 tl.dot is wrong under the CPU interpreter: bf16 runs only on a GPU (deselected without one).
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]

SMALL_TILES = {
    "partial": {
        "BLOCK_N": 16,
        "BLOCK_V": 16,
        "BLOCK_K": 16,
        "VOCAB_SPLIT": 64,
        "GROUP_N": 2,
        "num_warps": 4,
        "num_stages": 1,
    },
    "grad": {
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
    for dtype in list(tk_matmul.BACKWARD_TILE_CONFIGS):
        monkeypatch.setitem(tk_matmul.BACKWARD_TILE_CONFIGS, dtype, dict(SMALL_GEMM))


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_inputs(n, v, hs, ht, dtype, seed=0, extreme=False, with_targets=True):
    """Student / teacher hidden states and heads (logits of std ~2), targets with row 1 ignored, per-row inv_t in
    [0.5, 2] and random per-row gradient coefficients. ``extreme``: row 2's student and row 3's teacher logits
    reach about 1e4."""
    g = _gen(seed)
    sh = torch.randn(n, hs, generator=g)
    sw = torch.randn(v, hs, generator=g) * (2 / hs**0.5)
    th = torch.randn(n, ht, generator=g)
    tw = torch.randn(v, ht, generator=g) * (2 / ht**0.5)
    targets = torch.randint(0, v, (n,), generator=g)
    if n >= 3:
        targets[1] = IGNORE
    if extreme and n >= 4:
        sh[2] *= 3000
        th[3] *= 3000
    inv_t = torch.rand(n, generator=g) * 1.5 + 0.5
    coef = torch.randn(n, generator=g)
    to = {"device": DEVICE}
    return (
        [t.to(dtype).to(**to) for t in (sh, sw, th, tw)],
        targets.to(**to) if with_targets else None,
        inv_t.to(**to),
        coef.to(**to),
    )


def _f64(tensors):
    return [t.double() for t in tensors]


def run_fwd(impl, data, targets, inv_t, divergence, coef=None, want=(True, True)):
    """``impl.fused_linear_kl_fwd``; returns ``(loss, stats, grad_hidden, grad_weight)`` (grads None unless
    ``coef``)."""
    n = data[0].shape[0]
    dt = torch.float64 if data[0].dtype == torch.float64 else torch.float32
    loss = torch.empty(n, dtype=dt, device=DEVICE)
    stats = torch.empty(3, n, dtype=dt, device=DEVICE)
    gh = torch.empty_like(data[0]) if coef is not None and want[0] else None
    gw = torch.empty_like(data[1]) if coef is not None and want[1] else None
    impl.fused_linear_kl_fwd(
        *data,
        targets,
        inv_t.to(dt),
        IGNORE,
        divergence,
        BETA,
        loss,
        stats,
        None if coef is None else coef.to(dt),
        gh,
        gw,
    )
    return loss, stats, gh, gw


def run_bwd(impl, data, targets, inv_t, stats, grad_loss, divergence, want=(True, True)):
    dt = stats.dtype
    gh = torch.empty_like(data[0]) if want[0] else None
    gw = torch.empty_like(data[1]) if want[1] else None
    impl.fused_linear_kl_bwd(*data, targets, inv_t.to(dt), stats, grad_loss.to(dt), IGNORE, divergence, BETA, gh, gw)
    return gh, gw


def check(dtype, loss, grads, truth_loss, truth_stats, truth_grads, targets):
    """Contract check of the per-row loss and the gradients; ignored rows exactly 0."""
    e = contract.entry("fused_linear_kl", dtype)
    scale = contract.divergence_scale(truth_stats[0], truth_stats[1])
    valid = torch.ones_like(loss, dtype=torch.bool) if targets is None else targets != IGNORE
    dev = contract.compare_outputs(e, "loss", loss, truth_loss, scale)
    assert dev.ok, dev
    assert bool((loss[~valid] == 0).all())
    max_scale = float(scale[valid].max()) if bool(valid.any()) else 1.0
    for name, got, want in zip(("grad_hidden", "grad_weight"), grads, truth_grads):
        assert got.dtype == dtype
        dev = contract.compare_grad(e, name, got, want, max_scale)
        assert dev.ok, dev
    assert bool((grads[0][~valid] == 0).all())


def _case(dtype, divergence, shape, extreme=False, with_targets=True, seed=0):
    """The fused forward (gradient coefficients ``coef``) and the recomputing backward (upstream ``coef ** 2``) of
    the kernels against the fp64 reference."""
    n, v, hs, ht = shape
    data, targets, inv_t, coef = make_inputs(n, v, hs, ht, dtype, seed, extreme, with_targets)
    loss, stats, gh, gw = run_fwd(tk, data, targets, inv_t, divergence, coef)
    t_loss, t_stats, t_gh, t_gw = run_fwd(ref, _f64(data), targets, inv_t, divergence, coef)
    check(dtype, loss, (gh, gw), t_loss, t_stats, (t_gh, t_gw), targets)
    upstream = coef * coef
    bgh, bgw = run_bwd(tk, data, targets, inv_t, stats, upstream, divergence)
    t_bgh, t_bgw = run_bwd(ref, _f64(data), targets, inv_t, t_stats, upstream, divergence)
    check(dtype, loss, (bgh, bgw), t_loss, t_stats, (t_bgh, t_bgw), targets)
    return data, targets, inv_t, coef, (loss, stats, gh, gw)


# ----------------------------------------------------------------------------------------------
# values and gradients
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_matches_reference_small_tiles(small_tiles, divergence, dtype):
    """37 rows (3 row blocks, the last ragged), V = 150 (3 vocab splits, 4 gradient chunks, ragged), Hs = 24 and
    Ht = 40 (ragged K loops of different lengths), an ignored row, per-row temperatures, extreme rows."""
    _case(dtype, divergence, (37, 150, 24, 40), extreme=True)


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_matches_reference_default_tiles(divergence):
    """The shipped fp32 tiles; V = 300 fits in one split and one chunk; N = 1 and N = 5."""
    _case(torch.float32, divergence, (5, 300, 40, 24))
    _case(torch.float32, divergence, (1, 300, 40, 24), seed=1)


def test_without_targets(small_tiles):
    """``targets = None``: every row counts (no row is zeroed)."""
    *_, (loss, *_) = _case(torch.float32, "jsd", (20, 70, 16, 16), with_targets=False)
    assert bool((loss > 0).all())


@pytest.mark.parametrize("divergence", ["forward_kl", "jsd"])
def test_minus_inf_teacher_logits(small_tiles, divergence):
    """Teacher logits of -inf in whole vocab tiles and splits (columns 0-79 of every row) and scattered: finite
    loss and gradients, within the contract."""
    data, targets, inv_t, coef = make_inputs(20, 150, 16, 16, torch.float32)
    data[2][:, 0] = 1.0
    banned = torch.cat([torch.arange(80), torch.arange(90, 150, 7)]).to(DEVICE)
    data[3][banned] = 0.0
    data[3][banned, 0] = -math.inf
    loss, stats, gh, gw = run_fwd(tk, data, targets, inv_t, divergence, coef)
    assert bool(torch.isfinite(loss).all()) and bool(torch.isfinite(gh).all()) and bool(torch.isfinite(gw).all())
    t_loss, t_stats, t_gh, t_gw = run_fwd(ref, _f64(data), targets, inv_t, divergence, coef)
    check(torch.float32, loss, (gh, gw), t_loss, t_stats, (t_gh, t_gw), targets)


def test_nan_in_ignored_rows(small_tiles):
    """An ignored row of NaN (student and teacher) gives loss 0 and a zero gradient row; the other rows' results
    are unchanged bit for bit (``grad_weight`` too, with the ignored row zeroed as the op layer does)."""
    data, targets, inv_t, coef = make_inputs(20, 70, 16, 16, torch.float32)
    clean = run_fwd(tk, data, targets, inv_t, "jsd", coef)
    dirty = [t.clone() for t in data]
    dirty[0][1], dirty[2][1] = math.nan, math.nan
    dirty_loss, dirty_stats, dirty_gh, _ = run_fwd(tk, dirty, targets, inv_t, "jsd", coef, want=(True, False))
    assert torch.equal(dirty_loss, clean[0]) and torch.equal(dirty_gh, clean[2])
    assert torch.equal(dirty_stats[2], clean[1][2])


def test_optional_outputs_and_determinism(small_tiles):
    """grad_hidden_out / grad_weight_out may be None: the other is unchanged bit for bit; a second run gives the
    same bits (grad_weight sums the rows in a fixed order)."""
    data, targets, inv_t, coef = make_inputs(20, 70, 16, 24, torch.float32)
    _, stats, gh, gw = run_fwd(tk, data, targets, inv_t, "reverse_kl", coef)
    assert torch.equal(run_fwd(tk, data, targets, inv_t, "reverse_kl", coef, want=(True, False))[2], gh)
    assert torch.equal(run_fwd(tk, data, targets, inv_t, "reverse_kl", coef, want=(False, True))[3], gw)
    again = run_bwd(tk, data, targets, inv_t, stats, coef, "reverse_kl")
    assert torch.equal(again[0], gh) and torch.equal(again[1], gw)
    assert run_bwd(tk, data, targets, inv_t, stats, coef, "reverse_kl", want=(False, False)) == (None, None)


# ----------------------------------------------------------------------------------------------
# batch invariance
# ----------------------------------------------------------------------------------------------


def _rows(n, hs, ht, dtype, seed, extreme=False):
    """Per-row inputs only (hidden states, targets, inv_t), as :func:`make_inputs` draws them for ``v = 1``."""
    (sh, _, th, _), targets, inv_t, _ = make_inputs(n, 1, hs, ht, dtype, seed, extreme)
    return sh, th, targets, inv_t


def _batch_invariance(dtype, divergence, v, hs, ht, batch_sizes, heads=None):
    """A probe row alone vs at the first, middle and last position of batches of other rows (an ignored row, an
    extreme row), all with the same heads: its loss, stats and gradient row (coefficient 1: reduction 'sum') are
    bitwise equal."""
    p_sh, p_th, _, p_inv_t = _rows(1, hs, ht, dtype, seed=11)
    sw, tw = heads if heads is not None else [make_inputs(1, v, hs, ht, dtype, seed=0)[0][i] for i in (1, 3)]
    p_targets = torch.zeros(1, dtype=torch.long, device=DEVICE)
    one = torch.ones(1, device=DEVICE)
    alone = run_fwd(tk, [p_sh, sw, p_th, tw], p_targets, p_inv_t, divergence, one, want=(True, False))
    for n in batch_sizes:
        sh, th, targets, inv_t = _rows(n, hs, ht, dtype, seed=n, extreme=True)
        for pos in sorted({0, n // 2, n - 1}):
            sh[pos], th[pos], targets[pos], inv_t[pos] = p_sh[0], p_th[0], p_targets[0], p_inv_t[0]
            out = run_fwd(
                tk, [sh, sw, th, tw], targets, inv_t, divergence, torch.ones(n, device=DEVICE), want=(True, False)
            )
            assert torch.equal(out[0][pos : pos + 1], alone[0]), (n, pos)
            assert torch.equal(out[1][:, pos : pos + 1], alone[1]), (n, pos)
            assert torch.equal(out[2][pos : pos + 1], alone[2]), (n, pos)
    return alone


@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_batch_invariance_small_tiles(small_tiles, divergence):
    _batch_invariance(torch.float32, divergence, 70, 16, 24, (2, 37))


def test_batch_invariance_default_tiles():
    block_n = max(tk.TILE_CONFIGS[f][torch.float32]["BLOCK_N"] for f in ("partial", "grad"))
    _batch_invariance(torch.float32, "jsd", 100, 16, 24, (block_n + 3,))


def test_the_bitwise_checks_see_a_changed_reduction_order(small_tiles, monkeypatch):
    """Negative control: the same rows with the vocab cut into splits of 32 instead of 64 columns (another merge
    order of the online states) give other bits, so ``torch.equal`` above would catch an order that depended on
    the batch. The values stay within the contract."""
    data, targets, inv_t, _ = make_inputs(37, 150, 24, 40, torch.float32)
    first = run_fwd(tk, data, targets, inv_t, "forward_kl")
    monkeypatch.setitem(tk.TILE_CONFIGS["partial"], torch.float32, {**SMALL_TILES["partial"], "VOCAB_SPLIT": 32})
    second = run_fwd(tk, data, targets, inv_t, "forward_kl")
    assert not torch.equal(first[0], second[0])
    e = contract.entry("fused_linear_kl", torch.float32)
    assert contract.compare_outputs(
        e, "loss", second[0], first[0].double(), contract.divergence_scale(first[1][0], first[1][1])
    ).ok


# ----------------------------------------------------------------------------------------------
# through the public op, and the tile table
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_public_op_on_triton_matches_the_reference_backend(small_tiles, reduction):
    """``rlk.fused_linear_kl`` pinned to Triton (fused gradient for 'mean', recomputed for 'none') against the same
    call pinned to the reference."""
    data, targets, inv_t, coef = make_inputs(20, 70, 16, 24, torch.float32)
    results = {}
    for backend in ("triton", "reference"):
        hs, ws = (t.clone().requires_grad_(True) for t in data[:2])
        with rlk.use_backend(backend):
            loss = rlk.fused_linear_kl(
                hs, ws, *data[2:], targets, divergence="jsd", beta=BETA, temperature=1 / inv_t, reduction=reduction
            )
            (loss * (coef if reduction == "none" else 1.0)).sum().backward()
        results[backend] = (loss.detach(), hs.grad, ws.grad)
    got, want = results["triton"], results["reference"]
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got[2], want[2], rtol=1e-4, atol=1e-6)


def test_tile_configs_are_consistent():
    for family in ("partial", "grad"):
        assert set(tk.TILE_CONFIGS[family]) == {torch.float32, torch.float16, torch.bfloat16}
    for cfg in tk.TILE_CONFIGS["partial"].values():
        assert cfg["VOCAB_SPLIT"] % cfg["BLOCK_V"] == 0


# ----------------------------------------------------------------------------------------------
# GPU only: realistic shapes (bf16)
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("divergence", DIVERGENCES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_realistic_shape_gpu(dtype, divergence):
    _case(dtype, divergence, (300, 20000, 1024, 1536), extreme=True)
    _batch_invariance(dtype, divergence, 20000, 1024, 1536, (7, 300))


@pytest.mark.gpu
@pytest.mark.parametrize("divergence", DIVERGENCES)
def test_headline_shape_gpu(divergence):
    """N = 16384, H = 4096 (student and teacher), V = 151936, bf16 (N * V > 2^31): the last rows' loss and the fused
    gradient against the fp64 reference of those rows, grad_weight determinism, and a probe row alone vs at the
    first, middle and last of the 16384 rows."""
    n, v, h = 16384, 151936, 4096
    data, targets, inv_t, _ = make_inputs(n, v, h, h, torch.bfloat16, seed=5)
    ones = torch.ones(n, device=DEVICE)
    loss, stats, gh, gw = run_fwd(tk, data, targets, inv_t, divergence, ones)
    last = slice(n - 64, n)
    part = [data[0][last], data[1], data[2][last], data[3]]
    t_loss, t_stats, t_gh, _ = run_fwd(
        ref, _f64(part), targets[last], inv_t[last], divergence, ones[last], want=(True, False)
    )
    e = contract.entry("fused_linear_kl", torch.bfloat16)
    scale = contract.divergence_scale(t_stats[0], t_stats[1])
    assert contract.compare_outputs(e, "loss", loss[last], t_loss, scale).ok
    valid = targets[last] != IGNORE
    assert contract.compare_grad(e, "grad_hidden", gh[last], t_gh, float(scale[valid].max())).ok
    assert torch.equal(run_bwd(tk, data, targets, inv_t, stats, ones, divergence, want=(False, True))[1], gw)
    del gh, gw, stats
    _batch_invariance(torch.bfloat16, divergence, v, h, h, (n,), heads=(data[1], data[3]))
