"""The public op ``rlk.sample``: reference vs Triton bitwise (tokens and logprobs), batch invariance (a row alone,
at other positions, in batches of other sizes: ``torch.equal``), negative controls (another step or seed gives
another draw), chi-square tests of the sampled distributions (plain, temperature, top-k, top-p, min-p; fixed seeds,
deterministic), greedy at temperature 0, ties, the pre-filter logprob, Philox4x32-10 known answers and bad input
(errors name the argument)."""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

import rlk
from rlk.core import abi, dispatch
from rlk.reference import sampling as ref

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
FILTERS = [
    dict(),
    dict(temperature=0.7),
    dict(top_k=7),
    dict(top_p=0.8),
    dict(min_p=0.05),
    dict(temperature=1.3, top_k=40, top_p=0.9, min_p=0.02),
    dict(temperature=0.0),
]


def _triton_ok(dtype):
    return dispatch.why_not("triton", abi.OPS["sample"], DEVICE, dtype) is None


def _backends(dtype):
    return ["reference"] + (["triton"] if _triton_ok(dtype) else [])


def _inputs(rows=6, vocab=1500, dtype=torch.float32, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, vocab, generator=g) * scale).to(dtype).to(DEVICE)
    seeds = torch.tensor(
        [0, 1, -5, 2**40 + 3, 7, 2**62, -(2**63), 11][:rows] + list(range(100, 100 + rows - 8)),
        dtype=torch.int64,
        device=DEVICE,
    )
    steps = torch.tensor(
        [0, 3, 2**33, 9, 1, -1, 5, 2**63 - 1][:rows] + list(range(rows - 8)), dtype=torch.int64, device=DEVICE
    )
    return x, seeds[:rows], steps[:rows]


def _sample(backend, *args, **kw):
    with rlk.use_backend(backend):
        return rlk.sample(*args, **kw)


# --------------------------------------------------------------------------- Philox


@pytest.mark.parametrize(
    "key,ctr,want",
    [
        ((0, 0), (0, 0, 0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 2, (0xFFFFFFFF,) * 4, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0xA4093822, 0x299F31D0),
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ],
)
def test_philox_known_answers(key, ctr, want):
    """Random123's published Philox4x32-10 known-answer vectors."""
    t = [torch.tensor([v], dtype=torch.int64) for v in (*ctr, *key)]
    assert tuple(int(o) for o in ref.philox4x32_10(*t)) == want


def test_noise_layout_is_counter_based():
    """Element v of a row is lane v % 4 of block v // 4 (counter (v // 4, 0, step lo, step hi), key = seed)."""
    seed = torch.tensor([2**40 + 3], dtype=torch.int64)
    step = torch.tensor([2**33 + 5], dtype=torch.int64)
    g = ref.gumbel(seed, step, 10)
    i64 = lambda v: torch.tensor([v], dtype=torch.int64)  # noqa: E731
    out = ref.philox4x32_10(i64(2), i64(0), i64(5), i64(2), i64(3), i64(256))
    u = ((int(out[1]) >> 8) + 0.5) * 2.0**-24
    assert g[0, 9].item() == torch.tensor(-math.log(-math.log(u)), dtype=torch.float32).item()


# --------------------------------------------------------------------------- reference vs Triton


@pytest.mark.parametrize("kw", FILTERS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "plain")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("vocab", [1, 5, 1500, 4096])
def test_triton_matches_reference_bitwise(kw, dtype, vocab):
    if not _triton_ok(dtype):
        pytest.skip("triton not available for this dtype here")
    x, seed, step = _inputs(rows=6, vocab=vocab, dtype=dtype)
    t_ref, l_ref = _sample("reference", x, seed, step, **kw)
    t_tri, l_tri = _sample("triton", x, seed, step, **kw)
    assert torch.equal(t_ref, t_tri)
    assert torch.equal(l_ref, l_tri)


def test_bfloat16_is_the_fp32_definition():
    """bf16 logits are upcast exactly: the same draw as their fp32 copy (bf16 on the CPU runs on the reference)."""
    x, seed, step = _inputs(dtype=torch.bfloat16)
    for kw in FILTERS:
        a = rlk.sample(x, seed, step, **kw)
        b = rlk.sample(x.float(), seed, step, **kw)
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# --------------------------------------------------------------------------- batch invariance


@pytest.mark.parametrize("backend", _backends(torch.float32))
@pytest.mark.parametrize("kw", [dict(), dict(top_k=5, top_p=0.9, min_p=0.01)], ids=["plain", "filters"])
def test_batch_invariance(backend, kw):
    x, seed, step = _inputs(rows=7, vocab=1100)
    tokens, logprobs = _sample(backend, x, seed, step, **kw)
    for i in range(7):
        t1, l1 = _sample(backend, x[i : i + 1], seed[i : i + 1], step[i : i + 1], **kw)
        assert torch.equal(t1, tokens[i : i + 1]) and torch.equal(l1, logprobs[i : i + 1])
    perm = torch.tensor([3, 6, 0, 5, 1, 4, 2], device=DEVICE)
    tp, lp = _sample(backend, x[perm], seed[perm], step[perm], **kw)
    assert torch.equal(tp, tokens[perm]) and torch.equal(lp, logprobs[perm])
    big = torch.cat([x, x[:3]]), torch.cat([seed, seed[:3] + 1]), torch.cat([step, step[:3]])
    tb, lb = _sample(backend, *big, **kw)
    assert torch.equal(tb[:7], tokens) and torch.equal(lb[:7], logprobs)
    strided = torch.cat([x, x], dim=1)[:, :1100]  # rows with a stride != V
    ts, ls = _sample(backend, strided, seed, step, **kw)
    assert torch.equal(ts, tokens) and torch.equal(ls, logprobs)


@pytest.mark.parametrize("backend", _backends(torch.float32))
def test_other_step_or_seed_gives_other_draws(backend):
    """Negative control: a flat distribution over 1000 tokens, 8 rows: another step / seed changes the draws."""
    x = torch.zeros(8, 1000, device=DEVICE)
    seed = torch.arange(8, dtype=torch.int64, device=DEVICE)
    step = torch.zeros(8, dtype=torch.int64, device=DEVICE)
    base, _ = _sample(backend, x, seed, step)
    again, _ = _sample(backend, x, seed, step)
    assert torch.equal(base, again)
    other_step, _ = _sample(backend, x, seed, step + 1)
    other_seed, _ = _sample(backend, x, seed + 2**32, step)  # only the key's high word differs
    assert (other_step != base).sum() >= 6
    assert (other_seed != base).sum() >= 6
    assert len(set(base.tolist())) >= 6  # rows with different seeds differ too


# --------------------------------------------------------------------------- distributions


PROBS = torch.tensor([0.3, 0.2, 0.15, 0.12, 0.1, 0.08, 0.03, 0.02], dtype=torch.float64)


def _chi_square_p(counts: torch.Tensor, expected_probs: torch.Tensor, draws: int) -> float:
    support = expected_probs > 0
    assert counts[~support].sum() == 0, "a filtered-out token was drawn"
    exp = expected_probs[support] * draws
    stat = ((counts[support].double() - exp) ** 2 / exp).sum()
    df = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


def _expected(kw):
    p = torch.softmax(PROBS.log() / kw.get("temperature", 1.0), dim=0)
    keep = torch.ones(8, dtype=torch.bool)
    if kw.get("top_k", 0):
        keep[kw["top_k"] :] = False
    if kw.get("top_p", 1.0) < 1.0:
        cum = torch.cumsum(p * keep, 0) / (p * keep).sum()
        n = int((cum < kw["top_p"]).sum()) + 1
        keep[n:] = False
    if kw.get("min_p", 0.0):
        keep &= p >= kw["min_p"] * p.max()
    q = p * keep
    return q / q.sum()


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(temperature=0.6),
        dict(top_k=3),
        dict(top_p=0.6),
        dict(min_p=0.3),
        dict(top_k=5, top_p=0.7, temperature=1.5),
    ],
    ids=["plain", "temperature", "top_k", "top_p", "min_p", "combined"],
)
def test_chi_square(kw):
    """20000 draws (distinct steps, one seed) of a known V = 8 distribution, on the reference (bitwise the Triton
    kernel's draws, above): the counts fit the filtered, renormalized distribution (p-value > 1e-3)."""
    draws = 20000
    x = PROBS.log().float().expand(draws, 8).contiguous()
    seed = torch.full((draws,), 1234, dtype=torch.int64)
    step = torch.arange(draws, dtype=torch.int64)
    with rlk.use_backend("reference"):
        tokens, _ = rlk.sample(x, seed, step, **kw)
    counts = torch.bincount(tokens, minlength=8)
    assert _chi_square_p(counts, _expected(kw), draws) > 1e-3


def test_chi_square_detects_a_wrong_distribution():
    """Negative control of the test itself: the plain draws do not fit the temperature-0.6 distribution."""
    draws = 20000
    x = PROBS.log().float().expand(draws, 8).contiguous()
    with rlk.use_backend("reference"):
        tokens, _ = rlk.sample(x, torch.full((draws,), 1234), torch.arange(draws))
    assert _chi_square_p(torch.bincount(tokens, minlength=8), _expected(dict(temperature=0.6)), draws) < 1e-6


# --------------------------------------------------------------------------- definitions


@pytest.mark.parametrize("backend", _backends(torch.float32))
def test_greedy_and_ties(backend):
    x = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, -1.0, 5.0, 5.0]], device=DEVICE)
    seed = torch.tensor([3, 4], device=DEVICE)
    step = torch.tensor([0, 0], device=DEVICE)
    tokens, logprobs = _sample(backend, x, seed, step, temperature=0.0)
    assert tokens.tolist() == [1, 0]
    assert torch.equal(logprobs, torch.log_softmax(x.double(), -1).gather(1, tokens[:, None])[:, 0].float())
    # top_k = 1 keeps every token tied with the largest value: only those two / three are ever drawn
    tk, _ = _sample(
        backend,
        x.expand(1, 2, 4).reshape(2, 4).repeat(50, 1),
        torch.arange(100, device=DEVICE),
        torch.zeros(100, dtype=torch.int64, device=DEVICE),
        top_k=1,
    )
    assert set(tk[0::2].tolist()) == {1, 2} and set(tk[1::2].tolist()) == {0, 2, 3}


@pytest.mark.parametrize("backend", _backends(torch.float32))
def test_logprob_is_pre_filter(backend):
    x, seed, step = _inputs(rows=6, vocab=300)
    tokens, logprobs = _sample(backend, x, seed, step, temperature=0.8, top_k=3, top_p=0.5)
    want = torch.log_softmax(x.double() * torch.tensor(1 / 0.8, dtype=torch.float32).double(), -1)
    assert torch.allclose(logprobs.double(), want.gather(1, tokens[:, None])[:, 0], atol=1e-6, rtol=0)


NAN, INF = float("nan"), float("inf")
#: Rows of every kind of non-finite logit (V = 6): a NaN, +inf (one and two), all NaN, all -inf, NaN and -inf only
#: with one finite logit, logits at fp32's range, and a plain row.
NON_FINITE = [
    [0.5, NAN, 1.0, 2.0, -1.0, 0.0],
    [1.0, INF, 3.0, INF, NAN, -INF],
    [NAN, 2.0, INF, 0.0, 1.0, 5.0],
    [NAN] * 6,
    [-INF] * 6,
    [NAN, -INF, NAN, -INF, 4.0, -INF],
    [100.0, 99.0, 3e38, -3e38, 3.4e38, 0.0],
    [0.3, -0.2, 0.1, 0.0, -0.4, 0.25],
]


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # the interpreter on -inf / NaN
@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(temperature=1e-37),
        dict(temperature=1e-30, top_k=2),
        dict(temperature=3e30, min_p=0.1),
        dict(temperature=0.5, top_k=3, top_p=0.7),
        dict(temperature=0.0),
    ],
    ids=["plain", "T=1e-37", "T=1e-30,top_k", "T=3e30,min_p", "filters", "greedy"],
)
def test_non_finite_logits_and_extreme_temperatures(kw):
    """The documented rule, bitwise the same on every backend: NaN counts as -inf (never drawn while the row has
    another logit), +inf logits share the mass (only they are drawn, logprob -log(count)), a row without a logit
    above -inf is uniform, a tiny temperature draws only the max logits; the logprob is finite and <= 0."""
    x = torch.tensor(NON_FINITE, device=DEVICE)
    rows = x.shape[0]
    seed = torch.arange(rows, dtype=torch.int64, device=DEVICE) * 977
    step = torch.arange(rows, dtype=torch.int64, device=DEVICE) + 2**33
    results = {b: _sample(b, x, seed, step, **kw) for b in _backends(torch.float32)}
    tokens, logprobs = results["reference"]
    for backend, (t, lp) in results.items():
        assert torch.equal(t, tokens) and torch.equal(lp, logprobs), backend
    assert bool(torch.isfinite(logprobs).all()) and bool((logprobs <= 0).all())
    picked = x.gather(1, tokens[:, None])[:, 0].cpu()
    row_max = torch.where(torch.isnan(x), -INF, x).max(dim=1).values.cpu()
    for i in range(rows):
        if row_max[i].item() == -INF:  # nothing above -inf: uniform
            assert logprobs[i].item() == torch.tensor(-math.log(6), dtype=torch.float32).item()
            continue
        assert not math.isnan(picked[i].item()), i
        infinite = int((x[i] == INF).sum())
        if infinite:
            assert picked[i].item() == INF
            assert logprobs[i].item() == torch.tensor(-math.log(infinite), dtype=torch.float32).item()
        elif kw.get("temperature", 1.0) in (0.0, 1e-37, 1e-30):
            assert picked[i].item() == row_max[i].item()
            assert logprobs[i].item() == 0.0 or kw["temperature"] == 0.0  # greedy: the logprob at T = 1


def test_top_p_one_and_large_k_are_off():
    x, seed, step = _inputs(rows=6, vocab=300)
    plain = rlk.sample(x, seed, step)
    for kw in (dict(top_p=1.0), dict(top_k=300), dict(top_k=10**6), dict(min_p=0.0)):
        got = rlk.sample(x, seed, step, **kw)
        assert torch.equal(got[0], plain[0]) and torch.equal(got[1], plain[1])


def test_empty_batch():
    t, lp = rlk.sample(
        torch.zeros(0, 5, device=DEVICE),
        torch.zeros(0, dtype=torch.int64, device=DEVICE),
        torch.zeros(0, dtype=torch.int64, device=DEVICE),
    )
    assert t.shape == (0,) and t.dtype == torch.int64 and lp.shape == (0,) and lp.dtype == torch.float32


# --------------------------------------------------------------------------- errors


def test_errors_name_the_argument():
    x, seed, step = _inputs(rows=2, vocab=10)
    cases = [
        ((x.numpy(force=True), seed, step), {}, TypeError, "logits"),
        ((x[0], seed, step), {}, ValueError, "logits"),
        ((x.long(), seed, step), {}, TypeError, "logits"),
        ((x, seed.int(), step), {}, TypeError, "seed"),
        ((x, seed[:1], step), {}, ValueError, "seed"),
        ((x, [0, 1], step), {}, TypeError, "seed"),
        ((x, seed, step.float()), {}, TypeError, "step"),
        ((x, seed, step[None]), {}, ValueError, "step"),
        ((x, seed, step), dict(temperature=-1.0), ValueError, "temperature"),
        ((x, seed, step), dict(temperature=float("nan")), ValueError, "temperature"),
        ((x, seed, step), dict(temperature=1e-50), ValueError, "temperature"),
        ((x, seed, step), dict(top_k=-1), ValueError, "top_k"),
        ((x, seed, step), dict(top_k=2.5), TypeError, "top_k"),
        ((x, seed, step), dict(top_p=0.0), ValueError, "top_p"),
        ((x, seed, step), dict(top_p=1.5), ValueError, "top_p"),
        ((x, seed, step), dict(min_p=-0.1), ValueError, "min_p"),
        ((x, seed, step), dict(min_p=2.0), ValueError, "min_p"),
    ]
    for args, kw, exc, name in cases:
        with pytest.raises(exc, match=f"^{name}"):
            rlk.sample(*args, **kw)
    if DEVICE.type == "cuda":
        with pytest.raises(ValueError, match="^seed"):
            rlk.sample(x, seed.cpu(), step)
