"""Triton value-loss and DPO primitives against the reference (ground truth: the reference run in fp64).

On a machine without CUDA the kernels run under the Triton CPU interpreter (``TRITON_INTERPRET=1``,
set below before triton is imported), with small shapes. Tolerances come from the numerical
contract (``rlk.core.contract``); batch invariance and determinism are checked bit for bit
(``torch.equal``).
"""

from __future__ import annotations

import math
import os

import torch

from rlk.core import abi

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

import rlk
from rlk.core import contract
from rlk.reference import aggregation
from rlk.reference import losses as ref
from rlk_triton import losses as tk

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
F32 = torch.float32

# The interpreter evaluates both branches of tl.where on masked lanes: harmless.
pytestmark = [
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
]


@pytest.fixture
def small_blocks(monkeypatch):
    """Tiny blocks so that CPU-sized problems cover several token chunks, pair blocks and combine steps."""
    monkeypatch.setattr(tk, "VALUE_BLOCK_T", 16)
    monkeypatch.setattr(tk, "DPO_BLOCK_P", 8)
    monkeypatch.setattr(tk, "COMBINE_BLOCK", 4)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _f64(*tensors):
    return tuple(None if t is None else t.double() for t in tensors)


# ----------------------------------------------------------------------------------------------
# value loss
# ----------------------------------------------------------------------------------------------


def value_inputs(b: int, t: int, seed: int = 0, garbage: bool = False):
    """values, old_values, returns [B, T] fp32 and a bool mask of ragged lengths (row 1 empty when B >= 3)."""
    g = _gen(seed)
    values = torch.randn(b, t, generator=g) * 2
    old_values = values + 0.7 * torch.randn(b, t, generator=g)
    returns = torch.randn(b, t, generator=g) * 2
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    mask = torch.arange(t)[None, :] < lengths[:, None]
    mask &= torch.rand(b, t, generator=g) > 0.1  # a few holes, as multi-turn masks have
    if b >= 3:
        mask[1] = False
    if garbage:
        values[~mask], old_values[~mask], returns[~mask] = math.nan, math.inf, -math.inf
    return tuple(x.to(DEVICE) for x in (values, old_values, returns, mask))


def run_value(impl, values, old_values, returns, mask, weights, clip, grad_loss):
    dtype = values.dtype
    loss = torch.empty((), dtype=dtype, device=DEVICE)
    metrics = torch.empty(2, dtype=dtype, device=DEVICE)
    impl.value_loss_fwd(values, old_values, returns, mask, weights, clip, loss, metrics)
    grad = torch.empty_like(values)
    impl.value_loss_bwd(values, old_values, returns, mask, weights, clip, grad_loss.to(dtype), grad)
    return loss, metrics, grad


def check_value(got, truth, values, mask):
    e = contract.entry("value_loss", F32)
    loss, metrics, grad = got
    r_loss, r_metrics, r_grad = truth
    v_abs = torch.where(mask, values.double().abs(), 0.0).sum() / mask.sum().clamp(min=1)
    one = torch.ones(1, dtype=torch.float64, device=DEVICE)
    for name, value, ground, scale in (
        ("loss", loss, r_loss, 1 + r_loss.abs()),
        ("vf_clip_fraction", metrics[0], r_metrics[0], one),
        ("values_mean", metrics[1], r_metrics[1], 1 + v_abs),
    ):
        dev = contract.compare_outputs(e, name, value.reshape(1), ground.reshape(1), scale.reshape(1))
        assert dev.ok, dev
    assert grad.dtype == F32
    dev = contract.compare_grad(e, "grad_values", grad, r_grad, 1.0)
    assert dev.ok, dev
    assert bool((grad[~mask] == 0).all())


AGG_CASES = [("token-mean", {}), ("seq-mean-token-mean", {}), ("seq-mean-token-sum-norm", {"loss_scale": 300})]


def _value_case(shape, agg, norms, clip, garbage=False):
    """Kernels vs the fp64 reference on one problem; returns the kernels' (loss, metrics, grad)."""
    values, old_values, returns, mask = value_inputs(*shape, garbage=garbage)
    weights = aggregation.row_weights(mask, agg, **norms)
    grad_loss = torch.tensor(1.7, device=DEVICE)
    got = run_value(tk, values, old_values, returns, mask, weights, clip, grad_loss)
    truth = run_value(ref, *_f64(values, old_values, returns), mask, weights.double(), clip, grad_loss)
    check_value(got, truth, values, mask)
    return got


@pytest.mark.parametrize("clip", [0.5, None])
@pytest.mark.parametrize("agg, norms", AGG_CASES)
@pytest.mark.parametrize("shape", [(1, 1), (5, 7), (6, 1500), (3, 2049)])
def test_value_matches_reference(shape, agg, norms, clip):
    _value_case(shape, agg, norms, clip)


@pytest.mark.parametrize("clip", [0.3, None])
@pytest.mark.parametrize("shape", [(37, 50), (5, 33)])
def test_value_small_blocks_match_reference(small_blocks, shape, clip):
    """Several token chunks per row (a ragged last one) and several combine steps."""
    _value_case(shape, "seq-mean-token-sum", {}, clip)


def test_value_masked_garbage_and_empty_mask(small_blocks):
    got = _value_case((9, 40), "token-mean", {}, 0.2, garbage=True)
    assert all(bool(torch.isfinite(t).all()) for t in got)
    values, old_values, returns, _ = value_inputs(4, 40, garbage=False)
    mask = torch.zeros_like(values, dtype=torch.bool)
    values[0, 3] = math.nan
    loss, metrics, grad = run_value(
        tk,
        values,
        old_values,
        returns,
        mask,
        aggregation.row_weights(mask, "token-mean"),
        0.2,
        torch.tensor(1.0, device=DEVICE),
    )
    assert float(loss) == 0.0 and bool((metrics == 0).all()) and bool((grad == 0).all())


@pytest.mark.parametrize("fill", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("dirty", [0, 1, 2])
@pytest.mark.parametrize("clip", [0.2, None])
def test_value_masked_garbage_in_each_input(small_blocks, dirty, fill, clip):
    """NaN / inf at the masked positions of values, old_values or returns: loss, metrics and gradient
    are bitwise those of the same call with 0 there."""
    inputs = value_inputs(9, 40, seed=3)
    mask = inputs[3]
    weights = aggregation.row_weights(mask, "seq-mean-token-mean")
    grad_loss = torch.tensor(1.3, device=DEVICE)
    clean = [torch.where(mask, t, 0.0) for t in inputs[:3]]
    garbage = list(clean)
    garbage[dirty] = torch.where(mask, inputs[dirty], fill)
    want = run_value(tk, *clean, mask, weights, clip, grad_loss)
    got = run_value(tk, *garbage, mask, weights, clip, grad_loss)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert bool((got[2][~mask] == 0).all())


def test_value_clipping_branches():
    """Hand-made tokens: inside the range, clipped larger (zero gradient), clipped smaller (unclipped gradient)."""
    values = torch.tensor([[1.0, 2.0, -1.0, 0.3]], device=DEVICE)
    old_values = torch.tensor([[0.9, 0.0, 0.0, 0.3]], device=DEVICE)
    returns = torch.tensor([[0.0, 2.2, 3.0, 0.3]], device=DEVICE)
    mask = torch.ones_like(values, dtype=torch.bool)
    weights = torch.ones(1, device=DEVICE)
    loss, metrics, grad = run_value(
        tk, values, old_values, returns, mask, weights, 0.5, torch.tensor(1.0, device=DEVICE)
    )
    # token 0: in range, L = 1; token 1: clipped to 0.5, L2 = 2.89 > L1 = 0.04; token 2: clipped to -0.5,
    # L2 = 12.25 < L1 = 16; token 3: L = 0
    assert float(loss) == pytest.approx(0.5 * (1.0 + 2.89 + 16.0), rel=1e-6)
    assert float(metrics[0]) == pytest.approx(0.25) and float(metrics[1]) == pytest.approx(0.575)
    torch.testing.assert_close(grad, torch.tensor([[1.0, 0.0, -4.0, 0.0]], device=DEVICE))


def _value_batch_invariance(batch_sizes, t):
    """A probe row alone vs inside batches of other rows at first / middle / last position."""
    p_values, p_old, p_returns, p_mask = value_inputs(1, t, seed=21)
    weight = torch.full((1,), 1 / 97, device=DEVICE)  # a global normalizer: the row's weight is fixed
    grad_loss = torch.tensor(0.9, device=DEVICE)
    _, _, alone = run_value(tk, p_values, p_old, p_returns, p_mask, weight, 0.4, grad_loss)
    for n in batch_sizes:
        values, old_values, returns, mask = value_inputs(n, t, seed=n, garbage=True)
        for pos in sorted({0, n // 2, n - 1}):
            values[pos], old_values[pos], returns[pos], mask[pos] = p_values[0], p_old[0], p_returns[0], p_mask[0]
            weights = torch.full((n,), 1 / 97, device=DEVICE)
            first = run_value(tk, values, old_values, returns, mask, weights, 0.4, grad_loss)
            again = run_value(tk, values, old_values, returns, mask, weights, 0.4, grad_loss)
            assert torch.equal(first[2][pos : pos + 1], alone), (n, pos)
            assert all(torch.equal(a, b) for a, b in zip(first, again))  # deterministic


def test_value_batch_invariance_default_blocks():
    _value_batch_invariance((2, 7), 1100)


def test_value_batch_invariance_small_blocks(small_blocks):
    _value_batch_invariance((2, 9, 23), 45)


# ----------------------------------------------------------------------------------------------
# DPO
# ----------------------------------------------------------------------------------------------


def dpo_inputs(p: int, seed: int = 0):
    g = _gen(seed)
    len_c = torch.randint(1, 500, (p,), generator=g).float()
    len_r = torch.randint(0, 500, (p,), generator=g).float()  # a 0 counts as 1
    lc = -len_c * (0.2 + torch.rand(p, generator=g))
    lr = -(len_r + 1) * (0.2 + torch.rand(p, generator=g))
    lc_ref = lc + 10 * torch.randn(p, generator=g)
    lr_ref = lr + 10 * torch.randn(p, generator=g)
    return tuple(x.to(DEVICE) for x in (lc, lr, lc_ref, lr_ref, len_c, len_r))


def run_dpo(impl, data, beta, loss_type, eps, mean, grad_losses, grad_loss):
    lc = data[0]
    lengths = data[4:] if loss_type == "ipo" else (None, None)
    losses = torch.empty_like(lc)
    loss = torch.empty((), dtype=lc.dtype, device=DEVICE)
    metrics = torch.empty(4, dtype=lc.dtype, device=DEVICE)
    impl.dpo_loss_fwd(*data[:4], *lengths, beta, loss_type, eps, mean, losses, loss, metrics)
    g_c, g_r = torch.empty_like(lc), torch.empty_like(lc)
    impl.dpo_loss_bwd(*data[:4], *lengths, beta, loss_type, eps, mean, *_f64_like(lc, grad_losses, grad_loss), g_c, g_r)
    return losses, loss, metrics, g_c, g_r


def _f64_like(like, *tensors):
    return tuple(None if t is None else t.to(like.dtype) for t in tensors)


def _dpo_truth_scales(data, beta, loss_type, eps):
    """Per-pair scale s, |dl/dx| (from the fp64 reference) and the contract's derived scales."""
    lc, lr, lc_ref, lr_ref, len_c, len_r = _f64(*data)
    if loss_type == "ipo":
        n_c, n_r = len_c.clamp(min=1), len_r.clamp(min=1)
        lc, lc_ref, lr, lr_ref = lc / n_c, lc_ref / n_c, lr / n_r, lr_ref / n_r
    s = 1 + lc.abs() + lr.abs() + lc_ref.abs() + lr_ref.abs()
    _, dl_dx, *_ = ref._dpo_terms(*_f64(*data), beta, loss_type, eps)
    return s, dl_dx.abs()


def check_dpo(got, truth, data, beta, loss_type, eps, mean):
    e = contract.entry("dpo_loss", F32)
    s, dl_dx = _dpo_truth_scales(data, beta, loss_type, eps)
    per_pair = 1 + truth[0].abs() + dl_dx * s
    reduced = per_pair.mean() if mean else per_pair.sum()
    reward_scale = 1 + beta * s.mean()
    checks = [("losses", got[0], truth[0], per_pair), ("loss", got[1].reshape(1), truth[1].reshape(1), reduced[None])]
    checks += [
        (name, got[2][k : k + 1], truth[2][k : k + 1], reward_scale[None])
        for k, name in enumerate(("rewards_chosen", "rewards_rejected", "reward_margin"))
    ]
    checks.append(("reward_accuracy", got[2][3:], truth[2][3:], torch.ones(1, dtype=torch.float64)))
    for name, value, ground, scale in checks:
        dev = contract.compare_outputs(e, name, value, ground, scale)
        assert dev.ok, dev
    k = 1.0 if loss_type == "ipo" else beta
    for name, value, ground in (("grad_chosen", got[3], truth[3]), ("grad_rejected", got[4], truth[4])):
        dev = contract.compare_grad(e, name, value, ground, float((k * s).max()))
        assert dev.ok, dev


VARIANTS = [("sigmoid", 0.0), ("sigmoid", 0.25), ("hinge", 0.0), ("ipo", 0.0), ("robust", 0.1)]


@pytest.mark.parametrize("mean", [True, False])
@pytest.mark.parametrize("loss_type, eps", VARIANTS)
@pytest.mark.parametrize("pairs", [1, 6, 2500])
def test_dpo_matches_reference(pairs, loss_type, eps, mean):
    data = dpo_inputs(pairs, seed=pairs)
    beta = 0.1
    grad_losses = torch.randn(pairs, generator=_gen(3)).to(DEVICE)
    grad_loss = torch.tensor(1.3, device=DEVICE)
    got = run_dpo(tk, data, beta, loss_type, eps, mean, grad_losses, grad_loss)
    truth = run_dpo(ref, _f64(*data), beta, loss_type, eps, mean, grad_losses, grad_loss)
    check_dpo(got, truth, data, beta, loss_type, eps, mean)
    # each gradient source alone (the op passes None for an unused output)
    for g_losses, g_loss in ((grad_losses, None), (None, grad_loss)):
        got = run_dpo(tk, data, beta, loss_type, eps, mean, g_losses, g_loss)
        truth = run_dpo(ref, _f64(*data), beta, loss_type, eps, mean, g_losses, g_loss)
        check_dpo(got, truth, data, beta, loss_type, eps, mean)


@pytest.mark.parametrize("loss_type, eps", VARIANTS)
def test_dpo_small_blocks_match_reference(small_blocks, loss_type, eps):
    """Several pair blocks (a ragged last one) and several combine steps."""
    data = dpo_inputs(43, seed=5)
    grad_loss = torch.tensor(0.7, device=DEVICE)
    got = run_dpo(tk, data, 0.2, loss_type, eps, True, None, grad_loss)
    truth = run_dpo(ref, _f64(*data), 0.2, loss_type, eps, True, None, grad_loss)
    check_dpo(got, truth, data, 0.2, loss_type, eps, True)


@pytest.mark.parametrize("loss_type, eps", VARIANTS)
def test_dpo_batch_invariance_and_determinism(small_blocks, loss_type, eps):
    probe = dpo_inputs(1, seed=31)
    g_probe = torch.tensor([0.6], device=DEVICE)
    alone = run_dpo(tk, probe, 0.1, loss_type, eps, False, g_probe, None)
    for n in (2, 9, 30):
        data = [t.clone() for t in dpo_inputs(n, seed=n)]
        for pos in sorted({0, n // 2, n - 1}):
            for t, p in zip(data, probe):
                t[pos] = p[0]
            g = torch.randn(n, generator=_gen(n)).to(DEVICE)
            g[pos] = g_probe[0]
            first = run_dpo(tk, data, 0.1, loss_type, eps, False, g, None)
            again = run_dpo(tk, data, 0.1, loss_type, eps, False, g, None)
            for k in (0, 3, 4):  # per-pair loss, grad_chosen, grad_rejected
                assert torch.equal(first[k][pos : pos + 1], alone[k]), (n, pos, k)
            assert all(torch.equal(a, b) for a, b in zip(first, again))


def test_dpo_extreme_margins(small_blocks):
    """u = beta x from -1e3 to 1e3, u = 30 (loss ~ 1e-13: the log1p tail must survive), and u = 1 exactly
    (the hinge's kink: gradient 0, as torch.relu's)."""
    lc = torch.tensor([-10.0, -10000.0, -5.0, -10.0, -1.0, -5.0], device=DEVICE)
    lr = torch.tensor([-10000.0, -10.0, -5.0, -310.0, -1.0 - 1e-4, -15.0], device=DEVICE)
    zeros = torch.zeros(6, device=DEVICE)
    data = (lc, lr, zeros, zeros, None, None)
    for loss_type, eps in VARIANTS:
        if loss_type == "ipo":
            continue
        got = run_dpo(tk, data, 0.1, loss_type, eps, True, None, torch.tensor(1.0, device=DEVICE))
        truth = run_dpo(ref, _f64(*data), 0.1, loss_type, eps, True, None, torch.tensor(1.0, device=DEVICE))
        assert all(bool(torch.isfinite(t).all()) for t in got)
        assert float(got[2][3]) == pytest.approx(4 / 6, rel=1e-7)  # pair 2 is a tie: not accurate
        if loss_type == "sigmoid":
            torch.testing.assert_close(got[0].double(), truth[0], rtol=2e-6, atol=0)
            torch.testing.assert_close(got[3].double(), truth[3], rtol=2e-6, atol=0)
        if loss_type == "hinge":
            assert float(got[0][5]) == 0.0 and float(got[3][5]) == 0.0 and float(truth[3][5]) == 0.0
            assert float(got[3][4]) < 0.0  # just inside the margin: gradient -beta / P


# ----------------------------------------------------------------------------------------------
# the public ops on the Triton backend: autograd, micro-batching, opcheck, torch.compile
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("agg", abi.AGG_MODES)
def test_public_value_loss_micro_batch_gradients_are_bitwise(agg):
    """With global normalizers, each micro-batch's gradient rows equal the full batch's, bit for bit."""
    values, old_values, returns, mask = value_inputs(11, 70, seed=41, garbage=True)
    norms = {"global_tokens": int(mask.sum()), "global_seqs": int(mask.any(-1).sum())}
    if agg == "seq-mean-token-sum-norm":
        norms["loss_scale"] = 70
    with rlk.use_backend("triton"):
        v = values.clone().requires_grad_(True)
        full, _ = rlk.value_loss(v, old_values, returns, mask, agg=agg, **norms)
        full.backward()
        total, grads = 0.0, []
        for rows in (slice(0, 1), slice(1, 6), slice(6, 11)):
            part = values[rows].clone().requires_grad_(True)
            loss, _ = rlk.value_loss(part, old_values[rows], returns[rows], mask[rows], agg=agg, **norms)
            loss.backward()
            total += float(loss.detach())
            grads.append(part.grad)
    assert torch.equal(torch.cat(grads), v.grad)
    e = contract.entry("value_loss", F32)
    full = float(full.detach())
    assert abs(total - full) <= e.atol + e.rtol * (1 + abs(full))
    v64 = values.double().requires_grad_(True)
    truth, _ = rlk.value_loss(v64, old_values.double(), returns.double(), mask, agg=agg, **norms)
    truth.backward()
    assert contract.compare_outputs(
        e, "loss", torch.tensor([full]), truth.detach().reshape(1), 1 + truth.detach().abs().reshape(1)
    ).ok
    assert contract.compare_grad(e, "grad_values", v.grad, v64.grad, 1.0).ok


def test_public_dpo_micro_batch_gradients_are_bitwise():
    lc, lr, lc_ref, lr_ref, len_c, len_r = dpo_inputs(20, seed=43)
    with rlk.use_backend("triton"):
        a, b = lc.clone().requires_grad_(True), lr.clone().requires_grad_(True)
        rlk.dpo_loss(a, b, lc_ref, lr_ref, loss="ipo", chosen_length=len_c, rejected_length=len_r, reduction="sum")[
            0
        ].backward()
        for rows in (slice(0, 7), slice(7, 20)):
            pa, pb = lc[rows].clone().requires_grad_(True), lr[rows].clone().requires_grad_(True)
            rlk.dpo_loss(
                pa,
                pb,
                lc_ref[rows],
                lr_ref[rows],
                loss="ipo",
                chosen_length=len_c[rows],
                rejected_length=len_r[rows],
                reduction="sum",
            )[0].backward()
            assert torch.equal(pa.grad, a.grad[rows]) and torch.equal(pb.grad, b.grad[rows])


def test_public_ops_opcheck_and_compile_on_triton():
    values, old_values, returns, mask = value_inputs(4, 20, seed=44)
    lc, lr, lc_ref, lr_ref, len_c, len_r = dpo_inputs(6, seed=45)
    weights = aggregation.row_weights(mask, "token-mean")
    with rlk.use_backend("triton"):
        torch.library.opcheck(
            torch.ops.rlk.value_loss_fwd.default,
            (values.clone().requires_grad_(True), old_values, returns, mask, weights, 0.5, ""),
        )
        torch.library.opcheck(
            torch.ops.rlk.dpo_loss_fwd.default,
            (
                lc.clone().requires_grad_(True),
                lr.clone().requires_grad_(True),
                lc_ref,
                lr_ref,
                None,
                None,
                0.1,
                "robust",
                0.2,
                True,
            ),
        )

        def step(v, a, b):
            vl, vm = rlk.value_loss(v, old_values, returns, mask, agg="seq-mean-token-mean")
            dl, dm = rlk.dpo_loss(a, b, lc_ref, lr_ref, loss="hinge")
            return vl + dl, vm["vf_clip_fraction"], dm["reward_accuracy"]

        results = []
        for fn in (step, torch.compile(step, fullgraph=True, backend="aot_eager")):
            inputs = [t.clone().requires_grad_(True) for t in (values, lc, lr)]
            loss, *metrics = fn(*inputs)
            loss.backward()
            results.append((loss.detach(), *metrics, *(t.grad for t in inputs)))
        for eager, compiled in zip(*results):
            assert torch.equal(eager, compiled)
        assert rlk.explain("value_loss", values).backend == "triton"


# ----------------------------------------------------------------------------------------------
# GPU only: realistic shapes
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_value_realistic_shape_gpu():
    """B = 512 responses of up to 8192 tokens; a probe row alone vs in the batch."""
    _value_case((512, 8192), "token-mean", {}, 0.5)
    _value_batch_invariance((64, 512), 8192)


@pytest.mark.gpu
@pytest.mark.parametrize("loss_type, eps", VARIANTS)
def test_dpo_realistic_shape_gpu(loss_type, eps):
    test_dpo_matches_reference(100_000, loss_type, eps, True)
