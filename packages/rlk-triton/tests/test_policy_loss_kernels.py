"""Triton policy-loss and KL primitives against the reference (ground truth: the reference run in fp64).

On a machine without CUDA the kernels run under the Triton CPU interpreter
(``TRITON_INTERPRET=1``, set below before triton is imported), with small shapes. Tolerances
come from the numerical contract (``rlk.core.contract``, entries ``policy_loss`` / ``kl_penalty``,
scale ``1 + |ref|``); batch invariance and determinism are checked bit for bit (``torch.equal``).
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import torch

from rlk.core import abi

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

import rlk
from rlk.core import contract
from rlk.reference import aggregation
from rlk.reference import policy_loss as ref
from rlk_triton import policy_loss as tk

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ENTRY = contract.entry("policy_loss", torch.float32)
KL_ENTRY = contract.entry("kl_penalty", torch.float32)
LOSSES = list(abi.LOSSES)
INF = math.inf

# Worst deviation / allowed per output (printed with RLK_REPORT_RATIOS=1 and -s).
_WORST: dict[str, float] = {}


@pytest.fixture(scope="module", autouse=True)
def _report_ratios():
    yield
    if os.environ.get("RLK_REPORT_RATIOS") == "1":
        for name, ratio in sorted(_WORST.items(), key=lambda kv: -kv[1]):
            print(f"contract ratio {ratio:.3g}  {name}")


# The interpreter evaluates both branches of tl.where on masked lanes: harmless overflow warnings.
pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]


@pytest.fixture
def small_blocks(monkeypatch):
    """Rows of several BLOCK_T chunks (with a ragged last one), a combine over several row chunks, mask counts
    over several steps of a row (T > 16), count programs of several row groups (B > 2). (Several rows per count
    program: the default COUNT_ELEMENTS with the short rows of test_matches_reference.) Also the blocks of every
    test whose point is not the default tiles (edge values, options, aggregations): under the interpreter a
    token program's tuple reduce costs one Python step per lane, so a 1024-token chunk of a 20-token row costs
    ~60x a 16-token one; the default tiles are test_matches_reference's, test_dppo's and test_vespo's."""
    monkeypatch.setattr(tk, "BLOCK_T", 16)
    monkeypatch.setattr(tk, "COUNT_ELEMENTS", 16)
    monkeypatch.setattr(tk, "COUNT_PROGRAMS", 2)
    monkeypatch.setattr(tk, "COMBINE_BLOCK", 4)
    monkeypatch.setattr(tk, "PARTS_BLOCK", 2)
    monkeypatch.setattr(tk, "BLOCK_ELEMENTWISE", 32)


# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def make_inputs(b: int, t: int, seed: int = 0, per_seq_adv: bool = True) -> dict:
    """fp32 [B, T] inputs: ragged masks (row 0 full, an empty row when b >= 4), ratios spread around 1 with some
    far outside the clip ranges, mixed-sign advantages."""
    g = torch.Generator().manual_seed(seed)
    lp = -torch.rand(b, t, generator=g) * 4 - 0.05
    old = lp + 0.3 * torch.randn(b, t, generator=g)
    old[:, ::5] = lp[:, ::5] - 1.5
    old[:, 1::7] = lp[:, 1::7] + 1.5
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[0] = t
    if b >= 4:
        lengths[3] = 0
    mask = torch.arange(t)[None, :] < lengths[:, None]
    adv = torch.randn(b, 1, generator=g) if per_seq_adv else torch.randn(b, t, generator=g)
    out = {
        "logprob": lp,
        "old_logprob": old,
        "advantages": adv,
        "mask": mask,
        "importance_weights": torch.rand(b, t, generator=g) + 0.5,
        "ref_logprob": lp + 0.7 * torch.randn(b, t, generator=g),
        "entropy": torch.rand(b, t, generator=g) * 2,
    }
    return {k: v.to(DEVICE) for k, v in out.items()}


BASE = {
    "loss": "ppo",
    "cispo_upper": False,
    "clip_low": 0.2,
    "clip_high": 0.28,
    "dual_clip": 0.0,
    "clamp_low": -INF,
    "clamp_high": INF,
    "tau_pos": 1.0,
    "tau_neg": 1.05,
    "kl": "k3",
    "kl_coef": 0.1,
    "kl_k3_clamp": True,
    "kl_clamp": INF,
    "kl_straight_through": False,
    "kl_unbiased": False,
    "entropy_coef": 0.01,
}
TENSORS = ("logprob", "old_logprob", "advantages", "mask", "importance_weights", "ref_logprob", "entropy")
#: The aggregation of the kernel tests unless a test says otherwise: per-row weights c_i = 1 / (n_i N_seq).
AGG = {"agg": "seq-mean-token-mean", "global_tokens": None, "global_seqs": None, "loss_scale": None}


def run_fwd(impl, inputs: dict, dtype=torch.float32, with_entropy_grad=True, **attrs) -> dict:
    """Call ``impl.policy_loss_fwd``; inputs set to None are absent; ``attrs`` may set the aggregation
    (``agg``, ``global_tokens``, ``global_seqs``, ``loss_scale``). Returns its outputs."""
    args = [None if inputs.get(k) is None else (inputs[k] if k == "mask" else inputs[k].to(dtype)) for k in TENSORS]
    attrs = {**BASE, **AGG, **attrs}
    norms = [attrs.pop(k) for k in ("global_tokens", "global_seqs", "loss_scale")]
    b, t = inputs["logprob"].shape
    out = {
        "loss": torch.empty((), dtype=dtype, device=DEVICE),
        "grad_logprob": torch.empty(b, t, dtype=dtype, device=DEVICE),
        "grad_entropy": torch.empty(b, t, dtype=dtype, device=DEVICE) if with_entropy_grad else None,
        "row_weight": torch.empty(b, dtype=dtype, device=DEVICE),
        "row_stats": torch.empty(b, len(abi.ROW_STATS), dtype=dtype, device=DEVICE),
        "metrics": torch.empty(len(abi.POLICY_METRICS), dtype=dtype, device=DEVICE),
    }
    impl.policy_loss_fwd(
        *args,
        *norms,
        out["loss"],
        out["grad_logprob"],
        out["grad_entropy"],
        out["row_weight"],
        out["row_stats"],
        out["metrics"],
        **attrs,
    )
    if not with_entropy_grad:
        del out["grad_entropy"]
    return out


def scales(inputs: dict, **attrs) -> dict:
    """The contract's scales (``1 + |ref| + rlk.reference.policy_loss.contract_scale``) from the fp64 inputs."""
    args = [None if inputs.get(k) is None else (inputs[k] if k == "mask" else inputs[k].double()) for k in TENSORS]
    attrs = {**BASE, **AGG, **attrs}
    agg_args = {k: attrs.pop(k) for k in ("global_tokens", "global_seqs", "loss_scale")}
    row_weight = aggregation.row_weights(inputs["mask"], attrs.pop("agg"), dtype=torch.float64, **agg_args)
    return ref.contract_scale(*args[:4], row_weight, *args[4:], **attrs)


def check_outputs(got: dict, truth: dict, scale: dict, attrs=None) -> None:
    dev = contract.compare_outputs(
        ENTRY, "row_weight", got["row_weight"], truth["row_weight"], 1.0 + truth["row_weight"].abs()
    )
    assert dev.ok, (attrs, dev)
    for name in ("loss", "row_stats", "metrics"):
        value, expected = got[name].reshape(-1), truth[name].reshape(-1)
        dev = contract.compare_outputs(ENTRY, name, value, expected, 1.0 + expected.abs() + scale[name].reshape(-1))
        _WORST[name] = max(_WORST.get(name, 0.0), dev.ratio)
        assert dev.ok, (attrs, dev)


def check_against_reference(inputs: dict, **attrs) -> dict:
    got = run_fwd(tk, inputs, **attrs)
    truth = run_fwd(ref, inputs, dtype=torch.float64, **attrs)
    scale = scales(inputs, **attrs)
    check_outputs(got, truth, scale, attrs)
    for name in ("grad_logprob", "grad_entropy"):
        if name in got:
            dev = contract.compare_grad(ENTRY, name, got[name], truth[name], float(scale["grad_max_scale"]))
            _WORST[name] = max(_WORST.get(name, 0.0), dev.ratio)
            assert dev.ok, (attrs, dev)
            assert torch.all(got[name][~inputs["mask"]] == 0)
    return got


# ----------------------------------------------------------------------------------------------
# policy_loss_fwd against the reference
# ----------------------------------------------------------------------------------------------

CASES = [
    {"loss": "ppo"},
    {"loss": "ppo", "dual_clip": 3.0, "clamp_low": -20.0, "clamp_high": 20.0},
    {"loss": "gspo", "clip_low": 3e-4, "clip_high": 4e-4, "clamp_high": 10.0},
    {"loss": "gspo", "clamp_low": -0.05, "clamp_high": 0.05},
    {"loss": "cispo", "clamp_low": -20.0, "clamp_high": 20.0},
    {"loss": "cispo", "cispo_upper": True, "clip_high": 2.0},
    {"loss": "gpg"},
    {"loss": "sapo"},
    {"loss": "sapo", "clamp_low": -1.0, "clamp_high": 1.0},
    {"loss": "geo_mean", "clip_low": 0.3, "clip_high": 0.5},
]


# (3, 5): short rows as (7, 37)'s, without its empty row; nightly only (each row a 1024-step reduce here).
@pytest.mark.parametrize("shape", [(1, 1), pytest.param((3, 5), marks=pytest.mark.slow), (7, 37), (2, 1100)])
@pytest.mark.parametrize("attrs", CASES, ids=lambda a: "-".join(f"{k}={v}" for k, v in a.items()))
def test_matches_reference(attrs, shape):
    inputs = make_inputs(*shape, seed=shape[0] + shape[1])
    check_against_reference(inputs, **attrs)


@pytest.mark.parametrize("loss", LOSSES)
def test_small_blocks_and_token_advantages(small_blocks, loss):
    """Rows of 4 chunks of 16 tokens (the last ragged), 9 rows combined 4 at a time; per-token advantages."""
    inputs = make_inputs(9, 50, seed=1, per_seq_adv=False)
    check_against_reference(inputs, loss=loss, dual_clip=3.0 if loss == "ppo" else 0.0)


@pytest.mark.parametrize("optional", ["none", "iw", "ref", "entropy_no_grad"])
@pytest.mark.parametrize("loss", ["ppo", "geo_mean"])
def test_optional_inputs(small_blocks, loss, optional):
    inputs = make_inputs(5, 13, seed=2)
    keep = {"none": (), "iw": ("importance_weights",), "ref": ("ref_logprob",), "entropy_no_grad": ("entropy",)}
    for name in ("importance_weights", "ref_logprob", "entropy"):
        if name not in keep[optional]:
            inputs[name] = None
    attrs = {"loss": loss, "kl_coef": 0.1 if optional == "ref" else 0.0, "entropy_coef": 0.0}
    got = run_fwd(tk, inputs, with_entropy_grad=False, **attrs)
    truth = run_fwd(ref, inputs, dtype=torch.float64, with_entropy_grad=False, **attrs)
    check_outputs(got, truth, scales(inputs, **attrs), attrs)
    assert contract.compare_grad(ENTRY, "grad_logprob", got["grad_logprob"], truth["grad_logprob"], 1.0).ok


KL_OPTIONS = [
    {"kl": "k1"},
    {"kl": "abs"},
    {"kl": "k2"},
    {"kl": "k3"},
    {"kl": "k3", "kl_k3_clamp": False},
    {"kl": "k3", "kl_k3_clamp": False, "kl_clamp": 1.0},
    {"kl": "k2", "kl_straight_through": True},
    {"kl": "k3", "kl_unbiased": True},
]


@pytest.mark.parametrize("kl", KL_OPTIONS, ids=lambda a: "-".join(f"{k}={v}" for k, v in a.items()))
def test_kl_term(small_blocks, kl):
    inputs = make_inputs(4, 19, seed=3)
    inputs["ref_logprob"][0, :4] = inputs["logprob"][0, :4] + torch.tensor([25.0, -25.0, -3.0, 3.0], device=DEVICE)
    check_against_reference(inputs, **kl)


@pytest.mark.parametrize("loss", LOSSES)
def test_extreme_log_ratios(small_blocks, loss):
    """d = +-50 with and without a clamp: finite everywhere, within the contract."""
    inputs = make_inputs(4, 12, seed=4)
    inputs["old_logprob"][:, ::2] = inputs["logprob"][:, ::2] - 50.0
    inputs["old_logprob"][:, 1::2] = inputs["logprob"][:, 1::2] + 50.0
    for clamp in (INF, 20.0):
        got = check_against_reference(inputs, loss=loss, clamp_low=-clamp, clamp_high=clamp)
        assert all(bool(torch.isfinite(v).all()) for v in got.values())


@pytest.mark.parametrize("loss", LOSSES)
def test_log_ratios_beyond_the_fp32_range_of_exp(small_blocks, loss):
    """d = +-90 and +-200 without a clamp (exp overflows or underflows fp32), zero advantages in some rows, zero
    importance weights, the unbiased KL: every output has NaN exactly where the reference's fp32 outputs have it
    (nowhere: ``0 * inf`` counts as 0) and the same infinities; the finite ones within the contract."""
    inputs = make_inputs(4, 12, seed=5, per_seq_adv=False)
    inputs["old_logprob"][:, ::2] = inputs["logprob"][:, ::2] - 90.0
    inputs["old_logprob"][:, 1::4] = inputs["logprob"][:, 1::4] + 200.0
    inputs["advantages"] = inputs["advantages"].abs()
    inputs["advantages"][1] = 0.0
    inputs["importance_weights"][:, ::3] = 0.0
    inputs["ref_logprob"] = inputs["logprob"] + 100.0
    for attrs in ({"loss": loss}, {"loss": loss, "kl_unbiased": True, "kl_k3_clamp": False}):
        got = run_fwd(tk, inputs, **attrs)
        want = run_fwd(ref, inputs, **attrs)
        truth = run_fwd(ref, inputs, dtype=torch.float64, **attrs)
        scale = scales(inputs, **attrs)
        for name, value in got.items():
            assert not bool(value.isnan().any()), (attrs, name)
            assert not bool(want[name].isnan().any()), (attrs, name)
            assert torch.equal(torch.isinf(value), torch.isinf(want[name])), (attrs, name)
            finite = torch.isfinite(value).reshape(-1)
            expected = truth[name].reshape(-1)[finite]
            bound = 1.0 + expected.abs() + (scale[name].reshape(-1)[finite] if name in scale else 0.0)
            dev = contract.compare_outputs(ENTRY, name, value.reshape(-1)[finite], expected, bound)
            assert dev.ok, (attrs, name, dev)


@pytest.mark.parametrize("loss", LOSSES)
def test_minus_inf_at_masked_positions(small_blocks, loss):
    """-inf / NaN where the mask is off: the same bits as with clean values there."""
    inputs = make_inputs(5, 21, seed=5, per_seq_adv=False)
    clean = run_fwd(tk, inputs, loss=loss)
    off = ~inputs["mask"]
    for name in ("logprob", "old_logprob", "ref_logprob"):
        inputs[name][off] = -INF
    inputs["entropy"][off] = math.nan
    inputs["advantages"][off] = math.nan
    inputs["importance_weights"][off] = INF
    dirty = run_fwd(tk, inputs, loss=loss)
    for name in clean:
        assert torch.equal(clean[name], dirty[name]), name


@pytest.mark.parametrize("loss", LOSSES)
def test_empty_mask(small_blocks, loss):
    inputs = make_inputs(3, 7, seed=6)
    inputs["mask"][:] = False
    got = run_fwd(tk, inputs, loss=loss)
    assert all(bool(torch.all(v == 0)) for name, v in got.items() if name != "row_weight")
    assert torch.equal(got["row_weight"], torch.ones_like(got["row_weight"]))  # 1 / (max(n_i, 1) max(N_seq, 1))


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"])
@pytest.mark.parametrize("loss", ["ppo", "gspo"])
def test_counts_over_chunks(small_blocks, agg, loss):
    """The mask counts behind c_i (rows of several count steps) when a row's tokens start in a later chunk,
    lie in one middle chunk only, or are absent: the weights equal rlk.reference.aggregation's, bit for bit (both
    divide correctly rounded)."""
    inputs = make_inputs(6, 70, seed=15)
    mask = torch.zeros(6, 70, dtype=torch.bool)
    mask[0, 40:] = True  # first token in the third chunk of 16
    mask[1, 17:30] = True  # one middle chunk
    mask[2, ::3] = True  # every chunk
    mask[4, 69] = True  # the ragged last chunk only
    mask[5, :16] = True  # the first chunk only (row 3 stays empty)
    inputs["mask"] = mask.to(DEVICE)
    got = check_against_reference(inputs, loss=loss, agg=agg)
    expected = aggregation.row_weights(inputs["mask"], agg, dtype=torch.float32)
    assert torch.equal(got["row_weight"], expected)
    assert int(got["metrics"][-1]) == int(mask.sum())


# ----------------------------------------------------------------------------------------------
# batch invariance and determinism
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("blocks", ["default", "small"])
@pytest.mark.parametrize(
    "loss", [loss if loss == "ppo" else pytest.param(loss, marks=pytest.mark.slow) for loss in LOSSES]
)
def test_batch_invariance(request, loss, blocks):
    """A row's gradients and row statistics are the same bits alone and at the first, middle and last
    position of batches of 2, 5 and 9 rows (both carry c_i, which is the row's own, 1 / (n_i N_seq), with a
    global N_seq). The default blocks: batches of 2 and 5 (every row in one count program and one combine step
    whatever the batch, so 9 rows reach nothing new there, at 1024 interpreted reduce steps a row)."""
    if blocks == "small":
        request.getfixturevalue("small_blocks")
    attrs = {"loss": loss, "dual_clip": 3.0 if loss == "ppo" else 0.0, "global_seqs": 64.0}
    probe = make_inputs(1, 40, seed=7, per_seq_adv=False)
    alone = run_fwd(tk, probe, **attrs)
    for b in (2, 5, 9) if blocks == "small" else (2, 5):
        for pos in sorted({0, b // 2, b - 1}):
            batch = make_inputs(b, 40, seed=10 + b, per_seq_adv=False)
            for name in TENSORS:
                batch[name][pos] = probe[name][0]
            out = run_fwd(tk, batch, **attrs)
            for name in ("grad_logprob", "grad_entropy", "row_stats", "row_weight"):
                assert torch.equal(out[name][pos : pos + 1], alone[name]), (name, b, pos)


def test_deterministic(small_blocks):
    inputs = make_inputs(9, 33, seed=8)
    first = run_fwd(tk, inputs, loss="gspo")
    second = run_fwd(tk, inputs, loss="gspo")
    assert all(torch.equal(first[k], second[k]) for k in first)


# ----------------------------------------------------------------------------------------------
# backward products and kl_penalty
# ----------------------------------------------------------------------------------------------


def test_policy_loss_bwd_is_the_reference_product(small_blocks):
    """grad * grad_loss: one fp32 multiply per element, correctly rounded in both backends: the same bits
    (several BLOCK_ELEMENTWISE chunks, a ragged last one)."""
    g = torch.Generator().manual_seed(9)
    grad, grad_ent = torch.randn(2, 7, 50, generator=g).to(DEVICE)
    grad_loss = torch.tensor(0.37, device=DEVICE)
    outs = []
    for impl in (tk, ref):
        gl, ge = torch.empty_like(grad), torch.empty_like(grad)
        impl.policy_loss_bwd(grad_loss, grad, grad_ent, gl, ge)
        gl2 = torch.empty_like(grad)
        impl.policy_loss_bwd(grad_loss, grad, None, gl2, None)
        outs.append((gl, ge, gl2))
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    assert torch.equal(outs[0][0], grad * grad_loss)


KL_CASES = [
    ("k1", {}),
    ("abs", {}),
    ("k2", {}),
    ("k3", {}),
    ("k3", {"k3_clamp": False}),
    ("k1", {"clamp": 2.0}),
    ("k3", {"clamp": 10.0, "k3_clamp": False}),
    ("k3", {"straight_through": True}),
    ("abs", {"old": True}),
    ("k3", {"old": True}),
]


@pytest.mark.parametrize("estimator, kwargs", KL_CASES)
def test_kl_penalty_matches_reference(small_blocks, estimator, kwargs):
    g = torch.Generator().manual_seed(10)
    n = 101
    lp = (-torch.rand(n, generator=g) * 5).to(DEVICE)
    delta = torch.randn(n, generator=g) * 3
    delta[:5] = torch.tensor([25.0, -25.0, -12.0, 15.0, 0.0])
    ref_lp = lp - delta.to(DEVICE)
    old = lp + 0.3 * torch.randn(n, generator=g).to(DEVICE)
    kwargs = dict(kwargs)
    use_old = kwargs.pop("old", False)
    attrs = {"estimator": estimator, "straight_through": False, "k3_clamp": True, "clamp": INF, **kwargs}
    outs = {}
    for impl, dtype in ((tk, torch.float32), (ref, torch.float64)):
        kl, coef = torch.empty(n, dtype=dtype, device=DEVICE), torch.empty(n, dtype=dtype, device=DEVICE)
        impl.kl_penalty_fwd(lp.to(dtype), ref_lp.to(dtype), old.to(dtype) if use_old else None, kl, coef, **attrs)
        upstream = torch.linspace(-1, 1, n, dtype=dtype, device=DEVICE)
        grad = torch.empty_like(kl)
        impl.kl_penalty_bwd(upstream, coef, grad)
        outs[impl] = (kl, coef, grad)
    kl, coef, grad = outs[tk]
    kl64, coef64, grad64 = outs[ref]
    assert contract.compare_outputs(KL_ENTRY, "kl", kl, kl64, 1 + kl64.abs()).ok
    assert contract.compare_grad(KL_ENTRY, "coef", coef, coef64, 1.0).ok
    assert contract.compare_grad(KL_ENTRY, "grad_logprob", grad, grad64, 1.0).ok


# ----------------------------------------------------------------------------------------------
# the public ops on the Triton backend
# ----------------------------------------------------------------------------------------------


def test_public_ops_on_triton_match_the_fp64_reference():
    inputs = make_inputs(6, 17, seed=11)
    kwargs = {
        "loss": "ppo",
        "dual_clip": 3.0,
        "agg": "seq-mean-token-mean",
        "kl": "low_var_kl",
        "kl_coef": 0.1,
        "entropy_coef": 0.01,
    }
    results = {}
    for backend, dtype in (("triton", torch.float32), ("reference", torch.float64)):
        kwargs["importance_weights"] = inputs["importance_weights"].to(dtype)  # float64 is all or none
        lp = inputs["logprob"].detach().to(dtype).clone().requires_grad_(True)
        ent = inputs["entropy"].detach().to(dtype).clone().requires_grad_(True)
        with rlk.use_backend(backend):
            value, metrics = rlk.policy_loss(
                lp,
                inputs["old_logprob"].to(dtype),
                inputs["advantages"].to(dtype),
                inputs["mask"],
                ref_logprob=inputs["ref_logprob"].to(dtype),
                entropy=ent,
                **kwargs,
            )
            kl = rlk.kl_penalty(lp, inputs["ref_logprob"].to(dtype), "k3+")
        (value + kl.sum()).backward()
        results[backend] = (value, metrics, lp.grad, ent.grad, kl)
    value, metrics, grad, grad_ent, kl = results["triton"]
    value64, metrics64, grad64, grad_ent64, kl64 = results["reference"]
    # the tighter scale 1 + |ref| (no per-token magnitudes: ordinary inputs)
    value64 = value64.detach().reshape(1)
    assert contract.compare_outputs(ENTRY, "loss", value.reshape(1), value64, 1 + value64.abs()).ok
    for name, m in metrics.items():
        expected = metrics64[name].reshape(1)
        assert contract.compare_outputs(ENTRY, name, m.reshape(1), expected, 1 + expected.abs()).ok
    assert contract.compare_grad(ENTRY, "grad_logprob", grad, grad64, 1.0).ok
    assert contract.compare_grad(ENTRY, "grad_entropy", grad_ent, grad_ent64, 1.0).ok
    kl64 = kl64.detach().reshape(-1)
    assert contract.compare_outputs(KL_ENTRY, "kl", kl.reshape(-1), kl64, 1 + kl64.abs()).ok


@pytest.mark.parametrize(
    "loss", ["ppo", pytest.param("gspo", marks=pytest.mark.slow), pytest.param("geo_mean", marks=pytest.mark.slow)]
)
def test_micro_batches_on_triton(small_blocks, loss):
    """With global normalizers each row's weight is its own: the micro-batch gradients are the full batch's,
    bit for bit, and the micro losses add up to the full loss."""
    inputs = make_inputs(9, 23, seed=14)
    tokens, seqs = int(inputs["mask"].sum()), int(inputs["mask"].any(dim=1).sum())

    def run(rows):
        lp = inputs["logprob"][rows].clone().requires_grad_(True)
        with rlk.use_backend("triton"):
            value, _ = rlk.policy_loss(
                lp,
                inputs["old_logprob"][rows],
                inputs["advantages"][rows],
                inputs["mask"][rows],
                loss=loss,
                agg="seq-mean-token-mean",
                global_tokens=tokens,
                global_seqs=seqs,
            )
        value.backward()
        return value.detach(), lp.grad

    full, full_grad = run(slice(0, 9))
    parts = [run(rows) for rows in (slice(0, 4), slice(4, 5), slice(5, 9))]
    total, full = sum(p[0] for p in parts).reshape(1), full.double().reshape(1)
    assert contract.compare_outputs(ENTRY, "loss", total, full, 1 + full.abs()).ok
    assert torch.equal(torch.cat([p[1] for p in parts]), full_grad)


@pytest.mark.parametrize(
    "agg", [{"agg": "token-mean"}, {"agg": "seq-mean-token-mean"}, {"agg": "token-mean", "global_tokens": 500.0}]
)
def test_policy_loss_and_grad_on_triton_is_the_autograd_path(small_blocks, agg):
    """On the Triton backend, policy_loss_and_grad gives the loss, metrics and gradients of policy_loss +
    backward() bit for bit (the backward multiplies the forward's gradient by the upstream 1)."""
    inputs = make_inputs(7, 40, seed=16, per_seq_adv=False)
    kwargs = {
        "loss": "ppo",
        "dual_clip": 3.0,
        "clamp_log_ratio": 20.0,
        "ref_logprob": inputs["ref_logprob"],
        "kl": "low_var_kl",
        "kl_coef": 0.05,
        "entropy_coef": 0.01,
        **agg,
    }
    with rlk.use_backend("triton"):
        lp = inputs["logprob"].clone().requires_grad_(True)
        ent = inputs["entropy"].clone().requires_grad_(True)
        value, metrics = rlk.policy_loss(
            lp, inputs["old_logprob"], inputs["advantages"], inputs["mask"], entropy=ent, **kwargs
        )
        value.backward()
        out = rlk.policy_loss_and_grad(
            inputs["logprob"],
            inputs["old_logprob"],
            inputs["advantages"],
            inputs["mask"],
            entropy=inputs["entropy"],
            **kwargs,
        )
    assert torch.equal(out.loss, value.detach())
    assert torch.equal(out.grad_logprob, lp.grad) and torch.equal(out.grad_entropy, ent.grad)
    assert all(torch.equal(out.metrics[k], metrics[k]) for k in metrics)


def test_compile_with_triton_matches_eager(small_blocks):
    inputs = make_inputs(4, 9, seed=12)

    def objective(lp):
        value, metrics = rlk.policy_loss(
            lp, inputs["old_logprob"], inputs["advantages"], inputs["mask"], loss="gspo", agg="token-sum"
        )
        return value + rlk.kl_penalty(lp, inputs["ref_logprob"], "k3").sum(), metrics["clip_fraction"]

    results = []
    with rlk.use_backend("triton"):
        for fn in (objective, torch.compile(objective, fullgraph=True, backend="aot_eager")):
            lp = inputs["logprob"].clone().requires_grad_(True)
            value, clip_fraction = fn(lp)
            value.backward()
            results.append((value.detach(), clip_fraction, lp.grad))
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)


# ----------------------------------------------------------------------------------------------
# GPU only: realistic shapes
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("loss", LOSSES)
def test_realistic_shape_gpu(loss):
    """B = 512 sequences of up to 8192 tokens (several BLOCK_T chunks, several combine chunks): the contract
    against the fp64 reference, and a probe row alone vs first / middle / last (bitwise)."""
    attrs = {"loss": loss, "dual_clip": 3.0 if loss == "ppo" else 0.0, "clamp_low": -20.0, "clamp_high": 20.0}
    inputs = make_inputs(512, 8192, seed=13, per_seq_adv=loss != "geo_mean")
    attrs["agg"] = "token-sum"
    check_against_reference(inputs, **attrs)
    probe = {k: v[5:6].clone() for k, v in inputs.items()}
    alone = run_fwd(tk, probe, **attrs)
    for pos in (0, 256, 511):
        batch = {k: v.clone() for k, v in inputs.items()}
        for name in TENSORS:
            batch[name][pos] = probe[name][0]
        out = run_fwd(tk, batch, **attrs)
        for name in ("grad_logprob", "grad_entropy", "row_stats"):
            assert torch.equal(out[name][pos : pos + 1], alone[name]), (name, pos)


@pytest.mark.gpu
@pytest.mark.parametrize("agg", ["token-mean", "token-sum"])
def test_repeated_runs_give_the_same_bits_gpu(agg):
    """On the GPU the last program of the finish kernel (the one that sums the rows) differs from run to run: 20
    runs at [512, 8192] (token-mean: after the count kernel; token-sum: without it), every output the same bits as
    the first run's (the token pass zeroes the finish kernel's counter: nothing left over from the run before)."""
    inputs = make_inputs(512, 8192, seed=17)
    first = run_fwd(tk, inputs, loss="ppo", dual_clip=3.0, agg=agg)
    for _ in range(20):
        again = run_fwd(tk, inputs, loss="ppo", dual_clip=3.0, agg=agg)
        for name in first:
            assert torch.equal(first[name], again[name]), name


@pytest.mark.gpu
@pytest.mark.parametrize(
    "loss,agg",
    [("ppo", "token-mean"), ("ppo", "token-sum"), ("gspo", "token-mean"), ("geo_mean", "seq-mean-token-mean")],
)
def test_programmatic_launch_changes_no_bit_gpu(loss, agg, monkeypatch):
    """Programmatic dependent launch (on from compute capability 9.0) lets each kernel of a call start before the one
    ahead of it ends: [512, 8192] with it and without it, every output the same bits (10 runs with it: a kernel that
    read its predecessor's counts or partials before they were written would read the uninitialized scratch and
    most likely differ). The chains:
    count -> token pass -> finish; token pass -> finish; count -> partial sums -> token pass -> finish."""
    inputs = make_inputs(512, 8192, seed=19, per_seq_adv=loss != "geo_mean")
    attrs = {"loss": loss, "agg": agg, "dual_clip": 3.0 if loss == "ppo" else 0.0}
    assert tk._programmatic_launch(torch.cuda.current_device()) == (torch.cuda.get_device_capability()[0] >= 9)
    monkeypatch.setattr(tk, "PROGRAMMATIC_LAUNCH", False)
    serial = run_fwd(tk, inputs, **attrs)
    monkeypatch.setattr(tk, "PROGRAMMATIC_LAUNCH", True)
    for _ in range(10):
        chained = run_fwd(tk, inputs, **attrs)
        for name in serial:
            assert torch.equal(serial[name], chained[name]), name


@pytest.mark.triton_interpreter
def test_runs_without_tritons_cuda_extras():
    """A Triton built without its CUDA backend (a ROCm build may be) has no ``triton.language.extra.cuda``: the
    policy-loss kernels still import (no-op stand-ins for the programmatic-launch instructions, which only CUDA
    launches use) and meet the contract against the fp64 reference (this module's own check, in a fresh process)."""
    code = textwrap.dedent(f"""
        import sys
        import triton
        sys.modules["triton.language.extra.cuda"] = None  # importing it now fails, as in such a build
        sys.path.insert(0, {os.path.dirname(__file__)!r})
        import test_policy_loss_kernels as t
        assert t.tk.gdc_wait.fn.__module__ == "rlk_triton.policy_loss", t.tk.gdc_wait.fn.__module__
        t.tk.BLOCK_T = t.tk.COUNT_ELEMENTS = 16  # small_blocks' tiles: 1024 interpreted reduce steps a row otherwise
        t.check_against_reference(t.make_inputs(5, 40, seed=7), loss="ppo", dual_clip=3.0, agg="token-mean")
        print("ok")
    """)
    env = dict(os.environ, TRITON_INTERPRET="1")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stdout + done.stderr


AGG_CASES = [
    {"agg": "token-mean"},
    {"agg": "token-mean", "global_tokens": 300.0},
    {"agg": "token-mean", "global_tokens": "tensor"},
    {"agg": "token-sum"},
    {"agg": "seq-mean-token-sum"},
    {"agg": "seq-mean-token-sum", "global_seqs": 11.0},
    {"agg": "seq-mean-token-mean", "global_seqs": "tensor"},
    {"agg": "seq-mean-token-sum-norm", "loss_scale": 64.0},
    {"agg": "seq-mean-token-sum-norm", "loss_scale": "tensor", "global_seqs": "tensor"},
]


@pytest.mark.parametrize("agg", AGG_CASES, ids=lambda a: "-".join(f"{k}={v}" for k, v in a.items()))
def test_every_aggregation_matches_the_reference(small_blocks, agg):
    """The finalize program's weights c_i (numbers, one-element tensors or absent normalizers; an empty row and
    rows of different lengths) against rlk.reference.aggregation, and the loss, statistics and metrics."""
    inputs = make_inputs(6, 23, seed=12)
    attrs = {
        k: (torch.tensor(7.0 if k != "global_tokens" else 150.0, device=DEVICE) if v == "tensor" else v)
        for k, v in agg.items()
    }
    got = check_against_reference(inputs, loss="ppo", **attrs)
    expected = aggregation.row_weights(
        inputs["mask"], attrs["agg"], dtype=torch.float64, **{k: v for k, v in attrs.items() if k != "agg"}
    )
    assert torch.allclose(got["row_weight"].double(), expected, rtol=1e-6, atol=0)


# ----------------------------------------------------------------------------------------------
# DPPO-Binary (dppo_tv, dppo_kl): trust region and ratio cap
# ----------------------------------------------------------------------------------------------

DPPO_CASES = [
    {"loss": "dppo_tv", "clip_low": 0.05, "clip_high": 0.08, "dual_clip": 2.0, "clamp_low": -20.0, "clamp_high": 20.0},
    {"loss": "dppo_tv", "clip_low": 0.2, "clip_high": 0.2},
    {"loss": "dppo_kl", "clip_low": 0.01, "clip_high": 0.02, "dual_clip": 2.0, "clamp_low": -20.0, "clamp_high": 20.0},
    {"loss": "dppo_kl", "clip_low": 0.05, "clip_high": 0.05, "dual_clip": 1.5},
]


@pytest.mark.parametrize("shape", [(1, 1), (7, 37), (2, 1100)])
@pytest.mark.parametrize("attrs", DPPO_CASES, ids=lambda a: "-".join(f"{k}={v}" for k, v in a.items()))
def test_dppo_matches_reference(attrs, shape):
    inputs = make_inputs(*shape, seed=3 * shape[0] + shape[1])
    got = check_against_reference(inputs, **attrs)
    if shape == (7, 37):  # the region and the cap are both active on these inputs
        metrics = dict(zip(abi.POLICY_METRICS, got["metrics"].tolist()))
        assert 0.0 < metrics["clip_fraction"] < 1.0
        if attrs.get("dual_clip"):
            assert metrics["lower_clip_fraction"] > 0.0


# vespo: the gamma weight of the sequence ratio (TRL's loss_type="vespo")
# ----------------------------------------------------------------------------------------------

# A zero importance weight is log 0 = -inf before vespo's clamp (intended): the interpreter warns.
pytestmark.append(pytest.mark.filterwarnings("ignore:divide by zero encountered in log:RuntimeWarning"))

VESPO = {
    "loss": "vespo",
    "clamp_low": -20.0,
    "clamp_high": 20.0,
    "vespo_k_pos": 2.0,
    "vespo_lambda_pos": 3.0,
    "vespo_k_neg": 3.0,
    "vespo_lambda_neg": 2.0,
}


def vespo_inputs(b: int, t: int, seed: int, per_seq_adv: bool = True) -> dict:
    """make_inputs with log-ratios of about 0.03 per token (sequence ratios near 1, where phi is not 0), one row
    far off-policy (w_i = e^-n_i: phi about 0) and importance weights around 1 with a zero (log 0: the lower clamp)."""
    inputs = make_inputs(b, t, seed=seed, per_seq_adv=per_seq_adv)
    g = torch.Generator().manual_seed(seed + 1)
    inputs["old_logprob"] = inputs["logprob"] + (0.03 * torch.randn(b, t, generator=g)).to(DEVICE)
    if b > 2:
        inputs["old_logprob"][2] = inputs["logprob"][2] + 1.0
    inputs["importance_weights"] = (1.0 + 0.05 * torch.randn(b, t, generator=g)).to(DEVICE)
    inputs["importance_weights"][min(2, b - 1), 0] = 0.0
    return inputs


def _phi_is_not_trivial(got: dict, inputs: dict, ratios_near_one: bool = True) -> None:
    """Most loss tokens get a gradient (phi neither 0 nor overflowing), and ratio_max is a sequence ratio near 1."""
    live = (got["grad_logprob"] != 0) & inputs["mask"]
    assert int(live.sum()) > int(inputs["mask"].sum()) // 3
    if ratios_near_one:
        assert 0.5 < float(got["metrics"][abi.POLICY_METRICS.index("ratio_max")]) < 3.0


# (5, 13): (7, 37)'s cases on shorter rows (both with the far off-policy row 2); nightly only, as (3, 5) above.
@pytest.mark.parametrize("shape", [(1, 1), pytest.param((5, 13), marks=pytest.mark.slow), (7, 37), (2, 1100)])
@pytest.mark.parametrize("iw", [False, True], ids=["no_iw", "iw"])
def test_vespo_matches_reference(shape, iw):
    """Loss, gradient, row statistics and metrics within the contract; the importance weights enter w_i (a zero
    weight gives the row log w = ln 1e-8), the KL and entropy terms are the other variants'."""
    inputs = vespo_inputs(*shape, seed=shape[0] * 7 + shape[1])
    if not iw:
        inputs["importance_weights"] = None
    got = check_against_reference(inputs, **VESPO)
    if shape[0] > 2:
        _phi_is_not_trivial(got, inputs)


@pytest.mark.parametrize(
    "params",
    [
        {"vespo_k_pos": 1.0, "vespo_lambda_pos": 0.5},
        {"vespo_k_neg": 10.0, "vespo_lambda_neg": 1e-4, "kl_coef": 0.0},
        {"clamp_low": -INF, "clamp_high": INF},
    ],
)
def test_vespo_parameters_and_token_advantages(small_blocks, params):
    """Rows of several chunks (the sequence sum over chunk partials), per-token advantages of both signs (k and lam
    chosen per token), other k / lam (k = 10, lam = 1e-4 at w = 1e5: phi = e^105 overflows fp32 and counts as 0,
    as TRL's nan_to_num), no clamp."""
    inputs = vespo_inputs(9, 50, seed=3, per_seq_adv=False)
    overflow = "vespo_k_neg" in params
    if overflow:  # row 4: log w = ln 1e5 spread over its tokens, negative advantages
        m4 = inputs["mask"][4]
        inputs["old_logprob"][4] = inputs["logprob"][4] - math.log(1e5) / int(m4.sum())
        inputs["advantages"][4] = -inputs["advantages"][4].abs() - 0.1
    got = check_against_reference(inputs, **{**VESPO, **params})
    _phi_is_not_trivial(got, inputs, ratios_near_one=not overflow)
    if overflow:
        assert torch.all(got["grad_logprob"][4] == 0) and bool(inputs["mask"][4].any())


@pytest.mark.slow
def test_vespo_batch_invariance_with_importance_weights():
    """A row's gradient and statistics are the same bits alone and anywhere in batches of 2, 5 and 9 rows, with
    its importance weights in its sequence ratio (small blocks: a sum over several chunks)."""
    attrs = {**VESPO, "global_seqs": 64.0}
    probe = vespo_inputs(1, 40, seed=7, per_seq_adv=False)
    alone = run_fwd(tk, probe, **attrs)
    assert bool((alone["grad_logprob"] != 0).any())
    for b in (2, 5, 9):
        for pos in sorted({0, b // 2, b - 1}):
            batch = vespo_inputs(b, 40, seed=10 + b, per_seq_adv=False)
            for name in TENSORS:
                batch[name][pos] = probe[name][0]
            out = run_fwd(tk, batch, **attrs)
            for name in ("grad_logprob", "grad_entropy", "row_stats", "row_weight"):
                assert torch.equal(out[name][pos : pos + 1], alone[name]), (name, b, pos)


def test_vespo_public_op_on_triton_matches_the_fp64_reference(small_blocks):
    """rlk.policy_loss(loss="vespo") on the Triton backend against the reference backend in fp64 (scale 1 + |ref|),
    with TRL's settings (clamp_log_ratio=20, token-mean over a global token count) and a k3 KL term."""
    inputs = vespo_inputs(6, 17, seed=11)
    kwargs = {
        "loss": "vespo",
        "clamp_log_ratio": 20.0,
        "agg": "token-mean",
        "global_tokens": 70.0,
        "importance_weights": inputs["importance_weights"],
        "kl": "k3",
        "kl_k3_clamp": False,
        "kl_coef": 0.04,
        "vespo_k": (2.0, 3.0),
        "vespo_lambda": (3.0, 2.0),
    }
    results = {}
    for backend, dtype in (("triton", torch.float32), ("reference", torch.float64)):
        lp = inputs["logprob"].detach().to(dtype).clone().requires_grad_(True)
        with rlk.use_backend(backend):
            value, metrics = rlk.policy_loss(
                lp,
                inputs["old_logprob"].to(dtype),
                inputs["advantages"].to(dtype),
                inputs["mask"],
                ref_logprob=inputs["ref_logprob"].to(dtype),
                **{**kwargs, "importance_weights": kwargs["importance_weights"].to(dtype)},
            )
        value.backward()
        results[backend] = (value.detach().reshape(1), metrics, lp.grad)
    (value, metrics, grad), (value64, metrics64, grad64) = results["triton"], results["reference"]
    assert contract.compare_outputs(ENTRY, "loss", value, value64, 1 + value64.abs()).ok
    for name, m in metrics.items():
        expected = metrics64[name].reshape(1)
        assert contract.compare_outputs(ENTRY, name, m.reshape(1), expected, 1 + expected.abs()).ok, name
    assert contract.compare_grad(ENTRY, "grad_logprob", grad, grad64, 1.0).ok
    assert float(value64.abs()) > 0.01 and float(metrics64["ratio_mean"]) > 0.5
