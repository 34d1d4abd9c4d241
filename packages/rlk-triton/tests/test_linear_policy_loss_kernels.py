"""Triton ``linear_logprob_stored`` primitives (the one-pass mode of ``fused_linear_policy_loss``).

The forward must give ``linear_logprob_fwd``'s log-prob, entropy and lse bit for bit (``torch.equal``) and store the
scaled logits it reduced; the backward turns them into ``G`` in place (16-bit ``G`` packed into each row's first
half) and computes ``grad_hidden = G @ weight`` and ``grad_weight (+)= G.T @ hidden``. Checked against the fp64
reference under the numerical contract, bit for bit where the design promises it (batch invariance of a row's
``grad_hidden``, determinism, accumulation, optional outputs). On a machine without CUDA the kernels run under the
Triton interpreter with tiles small enough for several row blocks, vocab leaves, splits and tiles, ragged ones
included; ``gpu``-marked cases run bf16 at the real shape.
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

pytestmark = [
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:All-NaN slice encountered:RuntimeWarning"),  # the NaN padding row
]

# bf16 tl.dot is wrong under the CPU interpreter: bf16 only on a GPU. fp16 exercises the 16-bit in-place G.
DTYPES = [torch.float32, torch.float16, pytest.param(torch.bfloat16, marks=pytest.mark.gpu)]

# V = 150 gives 2 vocab leaves of 75: splits of 32, 32, 11 columns per leaf, in 16-column tiles (a ragged one);
# the G pass walks 64-column tiles (ragged last); grad_hidden sums K = V in two segments (one GEMM each, ragged
# BLOCK_K steps).
V, H = 150, 32
SMALL_TILES = {
    "linear_fwd": {
        "BLOCK_N": 16,
        "BLOCK_V": 16,
        "BLOCK_K": 32,
        "VOCAB_SPLIT": 32,
        "GROUP_N": 2,
        "num_warps": 4,
        "num_stages": 1,
    },
    "linear_bwd": {
        "BLOCK_N": 16,
        "BLOCK_V": 32,
        "BLOCK_K": 32,
        "VOCAB_CHUNK": 48,
        "GROUP_N": 2,
        "num_warps": 4,
        "num_stages": 1,
    },
    "stored_grad": {"BLOCK_V": 64, "num_warps": 4},
}
SMALL_GEMM = {"BLOCK_M": 32, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 1}


@pytest.fixture
def small_tiles(monkeypatch):
    for family, cfg in SMALL_TILES.items():
        for dtype in list(tk.TILE_CONFIGS[family]):
            monkeypatch.setitem(tk.TILE_CONFIGS[family], dtype, dict(cfg))
    for dtype in list(tm.BACKWARD_TILE_CONFIGS):
        monkeypatch.setitem(tm.BACKWARD_TILE_CONFIGS, dtype, dict(SMALL_GEMM))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def inputs(n: int, dtype: torch.dtype, seed: int = 0, v: int = V, h: int = H, nan_ignored: bool = False):
    """hidden / weight (logits ~ 2 N(0, 1)), targets with row 1 ignored, per-row 1 / T in [0.5, 2], upstream
    gradients of log-prob and entropy. ``nan_ignored``: the ignored row's hidden state is NaN (padding)."""
    g = _gen(seed)
    hidden = torch.randn(n, h, generator=g)
    weight = torch.randn(v, h, generator=g) * (2 / h**0.5)
    targets = torch.randint(0, v, (n,), generator=g)
    if n >= 3:
        targets[1] = IGNORE
        if nan_ignored:
            hidden[1] = float("nan")
    inv_t = torch.rand(n, generator=g) * 1.5 + 0.5
    grad_lp, grad_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    to = {"device": DEVICE}
    return (
        hidden.to(dtype).to(**to),
        weight.to(dtype).to(**to),
        targets.to(**to),
        inv_t.to(**to),
        grad_lp.to(**to),
        grad_ent.to(**to),
    )


def stats(n: int, dtype=torch.float32, entropy: bool = True) -> dict[str, torch.Tensor]:
    out = {name: torch.empty(n, dtype=dtype, device=DEVICE) for name in ("logprob", "entropy", "lse")}
    if not entropy:
        del out["entropy"]
    return out


def stored_fwd(hidden, weight, targets, inv_t, entropy=True, logits=None):
    n, v = hidden.shape[0], weight.shape[0]
    out = stats(n, entropy=entropy)
    logits = torch.full((n, v), 7.0, device=DEVICE) if logits is None else logits
    tk.linear_logprob_stored_fwd(
        hidden, weight, targets, inv_t, IGNORE, out["logprob"], out.get("entropy"), out["lse"], logits
    )
    return out, logits


def stored_bwd(
    hidden,
    weight,
    targets,
    inv_t,
    out,
    logits,
    grad_lp,
    grad_ent,
    want_hidden=True,
    want_weight=True,
    grad_weight=None,
    accumulate=False,
):
    gh = torch.empty_like(hidden) if want_hidden else None
    if want_weight and grad_weight is None:
        grad_weight = torch.empty_like(weight)
    zeroed = torch.where((targets != IGNORE)[:, None], hidden, hidden.new_zeros(()))  # as the op layer passes it
    tk.linear_logprob_stored_bwd(
        zeroed,
        weight,
        targets,
        inv_t,
        out["lse"],
        out.get("entropy"),
        grad_lp,
        grad_ent,
        IGNORE,
        logits,
        gh,
        grad_weight if want_weight else None,
        accumulate,
    )
    return gh, grad_weight if want_weight else None


def truth(hidden, weight, targets, inv_t, grad_lp, grad_ent):
    """fp64 reference: stats, grad_hidden, grad_weight (ignored rows' hidden zeroed, as the op layer does)."""
    h64 = torch.where((targets != IGNORE)[:, None], hidden.double(), 0.0)
    w64 = weight.double()
    out = stats(hidden.shape[0], torch.float64, entropy=True)
    ref.linear_logprob_fwd(h64, w64, targets, inv_t.double(), IGNORE, out["logprob"], out["entropy"], out["lse"])
    gh, gw = torch.empty_like(h64), torch.empty_like(w64)
    ref.linear_logprob_bwd(
        h64,
        w64,
        targets,
        inv_t.double(),
        out["lse"],
        out["entropy"],
        grad_lp.double(),
        None if grad_ent is None else grad_ent.double(),
        IGNORE,
        gh,
        gw,
    )
    return out, gh, gw


def max_row_scale(out64, targets) -> float:
    valid = targets != IGNORE
    return float(contract.row_scale(out64["logprob"], out64["lse"])[valid].max())


def check_grad(dtype, name, grad, grad64, scale):
    assert grad.dtype == dtype and torch.isfinite(grad).all()
    dev = contract.compare_grad(contract.entry("linear_logprob_stored", dtype), name, grad, grad64, scale)
    assert dev.ok, dev


# ----------------------------------------------------------------------------------------------
# forward: linear_logprob's bits, and the logits stored
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("entropy", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_stored_fwd_is_linear_logprob_fwd_bit_for_bit(small_tiles, dtype, entropy):
    """Log-prob, entropy and lse equal ``linear_logprob_fwd``'s (torch.equal); the logits are written into the first
    rows of a larger buffer (the rows after them untouched) and are ``(hidden @ weight.T) * inv_t``."""
    n = 37  # three row blocks, a ragged last one
    hidden, weight, targets, inv_t, _, _ = inputs(n, dtype)
    plain = stats(n, entropy=entropy)
    tk.linear_logprob_fwd(hidden, weight, targets, inv_t, IGNORE, plain["logprob"], plain.get("entropy"), plain["lse"])
    buffer = torch.full((n + 5, V), 7.0, device=DEVICE)
    out, logits = stored_fwd(hidden, weight, targets, inv_t, entropy, logits=buffer[:n])
    for name in plain:
        assert torch.equal(out[name], plain[name]), name
    assert torch.equal(buffer[n:], torch.full_like(buffer[n:], 7.0))
    z64 = (hidden.double() @ weight.double().T) * inv_t.double()[:, None]
    torch.testing.assert_close(logits.double(), z64, rtol=1e-5 if dtype == torch.float32 else 4e-3, atol=1e-5)
    valid = targets != IGNORE
    z_target = logits[valid].gather(1, targets[valid][:, None])[:, 0]  # the target logit the log-prob used
    torch.testing.assert_close(out["logprob"][valid], z_target - out["lse"][valid], rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# backward from the stored logits
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("with_entropy_grad", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_stored_bwd_matches_fp64(small_tiles, dtype, with_entropy_grad):
    """grad_hidden and grad_weight against the fp64 reference under the contract; a NaN hidden state on an ignored
    row (padding) stays out of both; G left in the logits buffer is the fp64 G rounded to the input dtype."""
    n = 20
    hidden, weight, targets, inv_t, grad_lp, grad_ent = inputs(n, dtype, seed=1, nan_ignored=True)
    grad_ent = grad_ent if with_entropy_grad else None
    out, logits = stored_fwd(hidden, weight, targets, inv_t)
    gh, gw = stored_bwd(hidden, weight, targets, inv_t, out, logits, grad_lp, grad_ent)
    out64, gh64, gw64 = truth(hidden, weight, targets, inv_t, grad_lp, grad_ent)
    scale = max_row_scale(out64, targets)
    check_grad(dtype, "grad_hidden", gh, gh64, scale)
    check_grad(dtype, "grad_weight", gw, gw64, scale)
    assert bool((gh[1] == 0).all())
    # G in place: the fp64 gradient of the logits, in the input dtype, in each row's first half
    g = tk.stored_grad_view(logits, dtype)
    assert g.dtype == dtype and g.shape == (n, V)
    g64 = torch.empty(n, V, dtype=torch.float64)
    h64 = torch.where((targets != IGNORE)[:, None], hidden.double(), 0.0)
    ref.selected_logprob_bwd(
        h64 @ weight.double().T,
        targets,
        inv_t.double(),
        out64["lse"],
        out64["entropy"],
        grad_lp.double(),
        None if grad_ent is None else grad_ent.double(),
        IGNORE,
        g64,
    )
    assert bool((g[1] == 0).all())
    dev = contract.compare_grad(contract.entry("linear_logprob_stored", dtype), "G", g, g64, scale)
    assert dev.ok, dev


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_stored_bwd_agrees_with_the_recomputing_backward(small_tiles, dtype):
    """The same gradients as ``linear_logprob_bwd`` (which recomputes the logits) within the contract of one
    against the other (both approximate the fp64 truth within it)."""
    n = 20
    hidden, weight, targets, inv_t, grad_lp, grad_ent = inputs(n, dtype, seed=2)
    out, logits = stored_fwd(hidden, weight, targets, inv_t)
    gh, gw = stored_bwd(hidden, weight, targets, inv_t, out, logits, grad_lp, grad_ent)
    lean_h, lean_w = torch.empty_like(hidden), torch.empty_like(weight)
    zeroed = torch.where((targets != IGNORE)[:, None], hidden, hidden.new_zeros(()))
    tk.linear_logprob_bwd(
        zeroed, weight, targets, inv_t, out["lse"], out["entropy"], grad_lp, grad_ent, IGNORE, lean_h, lean_w
    )
    out64, _, _ = truth(hidden, weight, targets, inv_t, grad_lp, grad_ent)
    scale = 2 * max_row_scale(out64, targets)
    check_grad(dtype, "grad_hidden", gh, lean_h.double(), scale)
    check_grad(dtype, "grad_weight", gw, lean_w.double(), scale)


def test_stored_bwd_accumulates_in_fp32_and_writes_optional_outputs(small_tiles):
    """``accumulate`` adds the fp32 product to ``grad_weight_out`` (one fp32 add of the product the non-accumulating
    call writes, bit for bit); either output may be None without changing the other's bits."""
    dtype = torch.float16
    hidden, weight, targets, inv_t, grad_lp, grad_ent = inputs(20, dtype, seed=3)
    out, logits = stored_fwd(hidden, weight, targets, inv_t)
    keep = logits.clone()
    gh, gw32 = stored_bwd(
        hidden,
        weight,
        targets,
        inv_t,
        out,
        logits,
        grad_lp,
        grad_ent,
        grad_weight=torch.empty(weight.shape, device=DEVICE),
    )
    first = torch.randn(weight.shape, generator=_gen(9)).to(DEVICE)
    acc = first.clone()
    stored_bwd(
        hidden,
        weight,
        targets,
        inv_t,
        out,
        keep.clone(),
        grad_lp,
        grad_ent,
        want_hidden=False,
        grad_weight=acc,
        accumulate=True,
    )
    assert torch.equal(acc, first + gw32)
    only_h, none_w = stored_bwd(hidden, weight, targets, inv_t, out, keep.clone(), grad_lp, grad_ent, want_weight=False)
    none_h, gw16 = stored_bwd(hidden, weight, targets, inv_t, out, keep.clone(), grad_lp, grad_ent, want_hidden=False)
    assert none_w is None and none_h is None and torch.equal(only_h, gh)
    assert gw16.dtype == dtype and torch.equal(gw16, gw32.to(dtype))  # rounded once, from the same fp32 sums
    with pytest.raises(ValueError, match="accumulate needs an fp32 grad_weight_out"):
        stored_bwd(hidden, weight, targets, inv_t, out, keep.clone(), grad_lp, grad_ent, accumulate=True)


def test_stored_grad_hidden_is_batch_invariant_and_grad_weight_deterministic(small_tiles):
    """A row's log-prob, entropy and grad_hidden are bitwise the same alone and at three positions of batches of
    other rows (fp16: the 16-bit G packing); grad_weight is the same bits run to run."""
    dtype = torch.float16
    probe_h, weight, p_t, p_inv_t, p_glp, p_gent = inputs(1, dtype, seed=11)
    out, logits = stored_fwd(probe_h, weight, p_t, p_inv_t)
    alone, _ = stored_bwd(probe_h, weight, p_t, p_inv_t, out, logits, p_glp, p_gent, want_weight=False)
    for n in (2, 19):
        hidden, _, targets, inv_t, glp, gent = inputs(n, dtype, seed=n)
        for pos in sorted({0, n // 2, n - 1}):
            hidden[pos], targets[pos], inv_t[pos], glp[pos], gent[pos] = (
                probe_h[0],
                p_t[0],
                p_inv_t[0],
                p_glp[0],
                p_gent[0],
            )
            batch, logits = stored_fwd(hidden, weight, targets, inv_t)
            for name in ("logprob", "entropy", "lse"):
                assert torch.equal(batch[name][pos : pos + 1], out[name]), (name, n, pos)
            gh, gw = stored_bwd(hidden, weight, targets, inv_t, batch, logits.clone(), glp, gent)
            assert torch.equal(gh[pos : pos + 1], alone), (n, pos)
            _, again = stored_bwd(
                hidden, weight, targets, inv_t, batch, stored_fwd(hidden, weight, targets, inv_t)[1], glp, gent
            )
            assert torch.equal(gw, again)


@pytest.mark.parametrize("impl", ["reference", "triton"])
def test_tree_reduce_keeps_nothing_alive(impl):
    """``tree_reduce`` holds no reference to its leaves once it returns, without the garbage collector: a recursive
    closure did (a cycle), which kept the one-pass logits buffer alive past its ``del`` on the H200 (the peak grew by
    the buffer, 3.6 -> 4.8 GiB)."""
    import gc
    import weakref

    from rlk.reference import matmul as reference_matmul
    from rlk_triton import matmul as triton_matmul

    tree_reduce = (reference_matmul if impl == "reference" else triton_matmul).tree_reduce

    def total_of(x):  # the leaves close over x, as the backward's leaves close over their buffers
        return tree_reduce(lambda j: x[j : j + 1] * (j + 1), 8, lambda a, b: a.add_(b))

    held = torch.ones(1000)
    gone = weakref.ref(held)
    gc.disable()
    try:
        total = total_of(held)
        del held
        assert gone() is None, "a leaf's tensor outlived tree_reduce"
    finally:
        gc.enable()
    assert float(total) == 36.0


def test_stored_bwd_releases_the_logits_buffer(small_tiles):
    """After ``linear_logprob_stored_bwd``, dropping the caller's logits buffer frees it (no cycle holds a view)."""
    import gc
    import weakref

    hidden, weight, targets, inv_t, grad_lp, grad_ent = inputs(5, torch.float32, seed=3)
    out, logits = stored_fwd(hidden, weight, targets, inv_t)
    gone = weakref.ref(logits)
    gc.disable()
    try:
        stored_bwd(hidden, weight, targets, inv_t, out, logits, grad_lp, grad_ent)
        del logits
        assert gone() is None, "the logits buffer outlived the backward"
    finally:
        gc.enable()


def test_tile_configs_of_the_stored_kernels():
    assert set(tk.TILE_CONFIGS["stored_grad"]) == {torch.float32, torch.float16, torch.bfloat16}
    for cfg in tk.TILE_CONFIGS["stored_grad"].values():
        assert cfg["BLOCK_V"] & (cfg["BLOCK_V"] - 1) == 0


# ----------------------------------------------------------------------------------------------
# GPU only: bf16 at real shapes
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_stored_realistic_shape_gpu(dtype):
    """N = 300, V = 20000, H = 1024: forward bits of linear_logprob, gradients against fp64 under the contract."""
    n, v, h = 300, 20000, 1024
    hidden, weight, targets, inv_t, grad_lp, grad_ent = inputs(n, dtype, seed=5, v=v, h=h)
    plain = stats(n)
    tk.linear_logprob_fwd(hidden, weight, targets, inv_t, IGNORE, plain["logprob"], plain["entropy"], plain["lse"])
    out, logits = stored_fwd(hidden, weight, targets, inv_t)
    for name in plain:
        assert torch.equal(out[name], plain[name]), name
    gh, gw = stored_bwd(hidden, weight, targets, inv_t, out, logits, grad_lp, grad_ent)
    out64, gh64, gw64 = truth(hidden, weight, targets, inv_t, grad_lp, grad_ent)
    scale = max_row_scale(out64, targets)
    check_grad(dtype, "grad_hidden", gh, gh64, scale)
    check_grad(dtype, "grad_weight", gw, gw64, scale)


@pytest.mark.gpu
def test_stored_fwd_bits_and_batch_invariance_headline_shape_gpu():
    """bf16, V = 151936, H = 4096, a 2048-token chunk: log-probs bitwise linear_logprob's; a row's grad_hidden
    bitwise the same in a chunk of 2048 rows and of 7."""
    n, v, h = 2048, 151936, 4096
    hidden, weight, targets, inv_t, grad_lp, grad_ent = inputs(n, torch.bfloat16, seed=6, v=v, h=h)
    plain = stats(n)
    tk.linear_logprob_fwd(hidden, weight, targets, inv_t, IGNORE, plain["logprob"], plain["entropy"], plain["lse"])
    out, logits = stored_fwd(hidden, weight, targets, inv_t)
    for name in plain:
        assert torch.equal(out[name], plain[name]), name
    gh, _ = stored_bwd(hidden, weight, targets, inv_t, out, logits, grad_lp, grad_ent, want_weight=False)
    del logits
    rows = slice(1000, 1007)
    small, small_logits = stored_fwd(hidden[rows], weight, targets[rows], inv_t[rows])
    gh_small, _ = stored_bwd(
        hidden[rows],
        weight,
        targets[rows],
        inv_t[rows],
        small,
        small_logits,
        grad_lp[rows],
        grad_ent[rows],
        want_weight=False,
    )
    assert torch.equal(gh_small, gh[rows])
