"""Triton rollout-correction primitive against the reference (ground truth: the reference run in fp64).

On a machine without CUDA the kernels run under the Triton CPU interpreter (``TRITON_INTERPRET=1``, set below
before triton is imported), with small shapes. Tolerances come from the numerical contract (entry
``rollout_correction``, scales from ``rlk.reference.rollout_correction.contract_scale``); batch invariance and
determinism are checked bit for bit (``torch.equal``).
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
from rlk.reference import rollout_correction as ref
from rlk_triton import rollout_correction as tk

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ENTRY = contract.entry("rollout_correction", torch.float32)
INF = math.inf

# The interpreter evaluates both branches of tl.where on masked lanes: harmless overflow warnings.
pytestmark = [
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
]

#: Primitive attributes: both levels and modes, bounds on one or both sides, with and without a clamp.
CASES = [
    {"level": "token", "mode": "truncate", "upper": 2.0, "lower": 0.0, "clamp": 20.0},
    {"level": "token", "mode": "truncate", "upper": 1.3, "lower": 0.8, "clamp": INF},
    {"level": "token", "mode": "mask", "upper": 1.5, "lower": 0.6, "clamp": 20.0},
    {"level": "token", "mode": "mask", "upper": INF, "lower": 0.7, "clamp": INF},
    {"level": "sequence", "mode": "truncate", "upper": 2.0, "lower": 0.0, "clamp": 20.0},
    {"level": "sequence", "mode": "truncate", "upper": INF, "lower": 0.5, "clamp": 3.0},
    {"level": "sequence", "mode": "mask", "upper": 3.0, "lower": 0.5, "clamp": 20.0},
    {"level": "sequence", "mode": "mask", "upper": 1.5, "lower": 0.0, "clamp": INF},
]


def _ids(attrs: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in attrs.items())


@pytest.fixture
def small_blocks(monkeypatch):
    """Rows of several BLOCK_T chunks (a ragged last one), in-row sums over several steps of chunk partials, the
    sum over rows over several steps of lanes."""
    monkeypatch.setattr(tk, "BLOCK_T", 16)
    monkeypatch.setattr(tk, "PARTS_BLOCK", 2)
    monkeypatch.setattr(tk, "COMBINE_BLOCK", 4)


def make_inputs(b: int, t: int, seed: int = 0, level: str = "token") -> dict:
    """fp32 ``[B, T]`` log-probs (ratios on both sides of the thresholds: per token, or per row sum), a ragged
    mask with holes (row 0 full, row 3 empty when ``b >= 4``)."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(b, t, generator=g) * 4 - 0.05
    if level == "token":
        roll = old + 0.3 * torch.randn(b, t, generator=g)
    else:  # a row sum of about N(0, 1.4^2): per-token noise and a row bias, 1 each
        roll = old + torch.randn(b, t, generator=g) / t**0.5 + torch.randn(b, 1, generator=g) / t
    if level == "token":
        roll[:, ::8] = old[:, ::8] + 1.2
        roll[:, 1::8] = old[:, 1::8] - 1.2
    lengths = torch.randint(1, t + 1, (b,), generator=g)
    lengths[0] = t
    mask = torch.arange(t)[None, :] < lengths[:, None]
    if b > 1:
        mask[1::2] &= torch.rand(mask[1::2].shape, generator=g) > 0.15
    if b >= 4:
        mask[3] = False
    return {"old": old.to(DEVICE), "roll": roll.to(DEVICE), "mask": mask.to(DEVICE)}


def run_fwd(impl, x: dict, dtype=torch.float32, **attrs) -> tuple[torch.Tensor, torch.Tensor]:
    """``impl.rollout_correction_fwd`` on ``x`` in ``dtype``: ``(weights [B, T], metrics [len(METRICS)])``."""
    old = x["old"].to(dtype).contiguous()
    weights = torch.empty_like(old)
    metrics = torch.empty(len(abi.CORRECTION_METRICS), dtype=dtype, device=old.device)
    impl.rollout_correction_fwd(
        old, x["roll"].to(dtype).contiguous(), x["mask"].contiguous(), weights, metrics, **attrs
    )
    return weights, metrics


def check_against_reference(x: dict, **attrs) -> tuple[torch.Tensor, torch.Tensor]:
    weights, metrics = run_fwd(tk, x, **attrs)
    truth_w, truth_m = run_fwd(ref, x, torch.float64, **attrs)
    scale = ref.contract_scale(x["old"].double(), x["roll"].double(), x["mask"], **attrs)
    dev = contract.compare_outputs(
        ENTRY, "weights", weights.reshape(-1), truth_w.reshape(-1), scale["weights"].reshape(-1)
    )
    assert dev.ok, (attrs, dev)
    for i, name in enumerate(abi.CORRECTION_METRICS):
        dev = contract.compare_outputs(ENTRY, name, metrics[i : i + 1], truth_m[i : i + 1], scale["metrics"][i : i + 1])
        assert dev.ok, (attrs, dev)
    assert bool((weights[~x["mask"]] == 0).all())
    return weights, metrics


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (7, 37), (2, 1100)])
@pytest.mark.parametrize("attrs", CASES, ids=_ids)
def test_matches_reference(attrs, shape):
    check_against_reference(make_inputs(*shape, seed=sum(shape), level=attrs["level"]), **attrs)


@pytest.mark.parametrize("attrs", CASES, ids=_ids)
def test_small_blocks(small_blocks, attrs):
    """Several chunks per row and several lane steps over the rows: the same contract, and every metric is
    exercised (tokens truncated or masked, not all of them)."""
    x = make_inputs(11, 53, seed=1, level=attrs["level"])
    _, metrics = check_against_reference(x, **attrs)
    values = dict(zip(abi.CORRECTION_METRICS, metrics.tolist()))
    assert 0 < values["clipped_fraction"] < 1 and values["sequences"] == 10 and values["weight_std"] > 0


def test_the_small_block_cases_are_not_trivial():
    """Row sums at the sequence level put rows on both sides of the thresholds (not all truncated or masked)."""
    for attrs in CASES[4:]:
        _, metrics = run_fwd(ref, make_inputs(11, 53, seed=1, level="sequence"), torch.float64, **attrs)
        values = dict(zip(abi.CORRECTION_METRICS, metrics.tolist()))
        assert 0 < values["seq_clipped_fraction"] < 1, attrs


@pytest.mark.parametrize("blocks", ["default", pytest.param("small", marks=pytest.mark.slow)])
@pytest.mark.parametrize("attrs", [CASES[2], CASES[6]], ids=_ids)
def test_batch_invariance(request, attrs, blocks):
    """A row's weights are the same bits alone and at the first, middle and last position of batches of 2, 5
    and 9 rows."""
    if blocks == "small":
        request.getfixturevalue("small_blocks")
    probe = make_inputs(1, 40, seed=3, level=attrs["level"])
    alone, _ = run_fwd(tk, probe, **attrs)
    assert bool((alone != 0).any())
    for b in (2, 5, 9):
        for pos in sorted({0, b // 2, b - 1}):
            batch = make_inputs(b, 40, seed=10 + b, level=attrs["level"])
            for name in batch:
                batch[name][pos] = probe[name][0]
            weights, _ = run_fwd(tk, batch, **attrs)
            assert torch.equal(weights[pos : pos + 1], alone), (b, pos)


def test_deterministic(small_blocks):
    x = make_inputs(9, 33, seed=8, level="sequence")
    first = run_fwd(tk, x, **CASES[6])
    second = run_fwd(tk, x, **CASES[6])
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("fill", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("attrs", [CASES[0], CASES[7]], ids=_ids)
def test_masked_garbage_does_not_leak(small_blocks, attrs, fill):
    """NaN / +-inf at masked-out positions of either input: bitwise the weights and metrics with 0 there."""
    x = make_inputs(6, 23, seed=2, level=attrs["level"])
    for name in ("old", "roll"):
        x[name][~x["mask"]] = 0.0
    want = run_fwd(tk, x, **attrs)
    for name in ("old", "roll"):
        dirty = {k: v.clone() for k, v in x.items()}
        dirty[name][~x["mask"]] = fill
        got = run_fwd(tk, dirty, **attrs)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("attrs", CASES, ids=_ids)
def test_empty_mask(attrs):
    x = make_inputs(3, 5, seed=1)
    x["mask"][:] = False
    x["roll"][:] = math.nan
    weights, metrics = run_fwd(tk, x, **attrs)
    assert torch.equal(weights, torch.zeros_like(weights)) and torch.equal(metrics, torch.zeros_like(metrics))


@pytest.mark.parametrize("attrs", CASES, ids=_ids)
def test_extreme_and_non_finite_log_ratios(attrs):
    """Log-ratios of +-100 and +-inf, NaN (an unscored token) on the mask: the reference's weights and metrics."""
    x = make_inputs(5, 13, seed=4, level=attrs["level"])
    x["mask"][0] = True
    x["roll"][0, 0] = x["old"][0, 0] - 100.0
    x["roll"][0, 1] = x["old"][0, 1] + 100.0
    x["roll"][1, 0] = -math.inf
    x["mask"][1, 0] = True
    x["roll"][2, 0] = math.nan
    x["mask"][2, 0] = True
    weights, metrics = run_fwd(tk, x, **attrs)
    want_w, want_m = run_fwd(ref, x, **attrs)
    assert not bool(torch.isnan(weights).any())
    torch.testing.assert_close(weights, want_w, rtol=4e-6, atol=0.0, equal_nan=False)
    torch.testing.assert_close(metrics, want_m, rtol=1e-5, atol=1e-6, equal_nan=True)
    if attrs["clamp"] != INF or attrs["upper"] != INF:
        check_against_reference(x, **attrs)


def test_public_op_on_triton_and_compile():
    x = make_inputs(4, 9, seed=12, level="sequence")

    def weighted(old, roll, mask):
        weights, metrics = rlk.rollout_correction(old, roll, mask, level="sequence", mode="mask", lower=0.5, upper=3.0)
        return weights, metrics["seq_weight_mean"]

    with rlk.use_backend("triton"):
        eager = weighted(x["old"], x["roll"], x["mask"])
        compiled = torch.compile(weighted, fullgraph=True, backend="aot_eager")(x["old"], x["roll"], x["mask"])
        assert rlk.explain("rollout_correction", x["old"]).backend == "triton"
    assert all(torch.equal(e, c) for e, c in zip(eager, compiled))
    direct = run_fwd(tk, x, level="sequence", mode="mask", upper=3.0, lower=0.5, clamp=20.0)
    assert torch.equal(eager[0], direct[0])


# ----------------------------------------------------------------------------------------------
# GPU only: realistic shapes
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("attrs", CASES, ids=_ids)
def test_realistic_shape_gpu(attrs):
    """B = 512 sequences of up to 8192 tokens: the contract against the fp64 reference, a probe row alone vs
    first / middle / last (bitwise), and 10 repeated runs with the same bits."""
    x = make_inputs(512, 8192, seed=13, level=attrs["level"])
    first = check_against_reference(x, **attrs)
    for _ in range(10):
        again = run_fwd(tk, x, **attrs)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
    probe = {k: v[5:6].clone() for k, v in x.items()}
    alone, _ = run_fwd(tk, probe, **attrs)
    for pos in (0, 256, 511):
        batch = {k: v.clone() for k, v in x.items()}
        for name in batch:
            batch[name][pos] = probe[name][0]
        weights, _ = run_fwd(tk, batch, **attrs)
        assert torch.equal(weights[pos : pos + 1], alone), pos
