"""Property-based fuzzing of the ops whose edge cases are values, not shapes: ``sample`` (non-finite logits, extreme
temperatures), ``unpack``'s fill value at each dtype's edge, and ``ema_`` (its exact endpoints, random decays, and
overlapping targets) (profiles, backends and repro lines: ``fuzz_support.py``; what is fuzzed and how to run it:
``docs/fuzzing.md``).

Properties (each a test, on every backend that implements the op):

* ``sample``: bitwise the reference's tokens and logprobs on rows with NaN, +inf and -inf logits, rows without a
  logit above -inf, logits up to fp32's range and temperatures from 3e-39 to 3e38 (and greedy), under every filter;
  and the documented rule: the logprob is finite and <= 0, a NaN logit is never drawn from a row that has a logit
  above -inf, a row with +inf logits draws one of them with logprob ``-log(count)``, a row without a logit above
  -inf is uniform (``-log(V)``), greedy takes the first max, and no drawn token is less likely than the Gumbel
  noise's span allows (``logprob >= -(GUMBEL_SPAN + log V)``: at a tiny temperature only the max logits are drawn);
* ``unpack``: a ``padding_value`` the dtype holds (checked by a round trip through torch, independently of the op's
  check) fills the padding bit for bit and leaves the tokens' bits; any other is an error naming ``padding_value``.
  Values at each dtype's edge: its largest finite value and half a spacing above, subnormals and half the smallest,
  ``2**p +- 1``, int64 around ``2**53`` and ``2**63``, the integer types' bounds +- 1, inf, -inf, NaN, -0.0;
* ``ema_``: ``decay = 1`` keeps every target bit and ``decay = 0`` copies every source bit, over NaN, +-inf, -0.0
  and the dtype's largest values; other decays (1e-12, 2**-25, 0.5, 1 - 1e-9, random) give the reference's bits
  (within one ulp where the backend fuses the multiply-add) and stay within one ulp of ``torch._foreach_lerp_``;
  views of one buffer as targets (and sources) are refused exactly when two targets share an element or a source
  shares one with a target other than itself, and otherwise updated as each view alone.
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

import pytest
import torch
from fuzz_support import (
    DEVICE,
    DTYPES,
    FILTERS,
    MASK_KINDS,
    ON_GPU,
    backends,
    check_bits,
    check_finite,
    dtype_names,
    fuzz_run,
    generator,
    limit,
    make_mask,
    on_backend,
    on_reference,
    seeds,
    sizes,
)
from hypothesis import strategies as st

import rlk
from rlk.core import abi, dispatch
from rlk.reference import ema as ref_ema

pytestmark = FILTERS

NAN, INF = math.nan, math.inf

# =============================================================================================
# sample
# =============================================================================================

#: The spread of the Gumbel noise ``-log(-log(u))`` over the spec's ``u = (r + 0.5) 2**-24`` (``r`` from 0 to
#: ``2**24 - 1``), about 20.2: a token whose scaled logit is further below the max is never drawn (the max logit's
#: score is larger).
GUMBEL_SPAN = -math.log(-math.log(1 - 0.5 * 2.0**-24)) + math.log(-math.log(0.5 * 2.0**-24))
#: What a whole row can be made of (besides the drawn logits).
ROW_KINDS = ("drawn", "all_nan", "all_neg_inf", "nan_and_neg_inf", "one_pos_inf", "all_pos_inf")


@dataclass(frozen=True)
class SampleCase:
    """One ``sample`` call: ``[rows, vocab]`` logits ``N(0, 1) * scale`` in ``dtype`` with fractions of NaN, +inf and
    -inf, and one row (``special_row``) made of ``row_kind``."""

    rows: int
    vocab: int
    dtype: str
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    scale: float
    nan: float
    pos_inf: float
    neg_inf: float
    row_kind: str
    special_row: int
    seed: int


@st.composite
def sample_cases(draw, backend: str) -> SampleCase:
    rows = draw(sizes(1, limit(backend, 4, 64)))
    vocab = draw(sizes(1, limit(backend, 40, 5000)))
    fractions = st.sampled_from([0.0, 0.0, 0.05, 0.3])
    return SampleCase(
        rows=rows,
        vocab=vocab,
        dtype=draw(st.sampled_from(dtype_names(backend, "sample"))),
        temperature=draw(
            st.one_of(
                st.sampled_from([0.0, 3e-39, 1e-37, 1e-30, 1e-6, 0.7, 1.0, 1e30, 3e38]),
                st.floats(1e-3, 10.0),
            )
        ),
        top_k=draw(st.one_of(st.just(0), st.integers(1, vocab + 1))),
        top_p=draw(st.sampled_from([1.0, 1.0, 1e-6, 0.5, 0.9, 0.99999994])),
        min_p=draw(st.sampled_from([0.0, 0.0, 0.05, 1.0])),
        scale=draw(st.sampled_from([1.0, 30.0, 1e4, 1e30, 3e38])),
        nan=draw(fractions),
        pos_inf=draw(st.sampled_from([0.0, 0.0, 0.0, 0.05])),
        neg_inf=draw(fractions),
        row_kind=draw(st.sampled_from(ROW_KINDS)),
        special_row=draw(st.integers(0, rows - 1)),
        seed=draw(seeds),
    )


def sample_inputs(case: SampleCase) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(logits, seed, step)`` on the device."""
    g = generator(case.seed)
    x = torch.randn(case.rows, case.vocab, generator=g, dtype=torch.float64) * case.scale
    u = torch.rand(case.rows, case.vocab, generator=g, dtype=torch.float64)
    x = torch.where(u < case.nan, NAN, x)
    x = torch.where((u >= case.nan) & (u < case.nan + case.pos_inf), INF, x)
    x = torch.where((u >= case.nan + case.pos_inf) & (u < case.nan + case.pos_inf + case.neg_inf), -INF, x)
    row = x[case.special_row]
    odd = torch.arange(case.vocab) % 2 == 1
    if case.row_kind == "all_nan":
        row.fill_(NAN)
    elif case.row_kind == "all_neg_inf":
        row.fill_(-INF)
    elif case.row_kind == "nan_and_neg_inf":
        row.copy_(torch.where(odd, NAN, -INF))
    elif case.row_kind == "one_pos_inf":
        row[case.seed % case.vocab] = INF
    elif case.row_kind == "all_pos_inf":
        row.fill_(INF)
    ids = torch.randint(-(2**63), 2**63 - 1, (2, case.rows), generator=g, dtype=torch.int64)
    return x.to(DTYPES[case.dtype]).to(DEVICE), ids[0].to(DEVICE), ids[1].to(DEVICE)


def sample_call(case: SampleCase, x, seed, step):
    return rlk.sample(x, seed, step, temperature=case.temperature, top_k=case.top_k, top_p=case.top_p, min_p=case.min_p)


def check_sample_rule_and_backends(backend: str, case: SampleCase) -> None:
    """Bitwise the reference's draw, and the documented rule for non-finite logits and extreme temperatures."""
    x, seed, step = sample_inputs(case)
    with on_backend(backend):
        tokens, logprobs = sample_call(case, x, seed, step)
    if backend != "reference":
        with on_reference():
            want_tokens, want_logprobs = sample_call(case, x, seed, step)
        check_bits("tokens", tokens, want_tokens)
        check_bits("logprobs", logprobs, want_logprobs)
    check_finite("logprobs", logprobs)
    assert bool((logprobs <= 0).all()), f"a positive logprob: {logprobs.tolist()}"
    raw = x.float().cpu()
    xf = torch.where(torch.isnan(raw), -INF, raw)
    tokens, logprobs = tokens.cpu(), logprobs.cpu()
    picked = raw.gather(1, tokens[:, None])[:, 0]
    top = xf.max(dim=1).values
    infinite = (xf == INF).sum(dim=1)
    fp32 = lambda v: torch.tensor(v, dtype=torch.float32).item()  # noqa: E731
    for i in range(case.rows):
        if top[i] == -INF:  # no logit above -inf: uniform
            assert logprobs[i].item() == fp32(-math.log(case.vocab)), (i, logprobs[i].item())
            continue
        assert not math.isnan(picked[i].item()), f"row {i}: a NaN logit drawn"
        if infinite[i]:
            assert picked[i].item() == INF, f"row {i}: drew {picked[i].item()} beside +inf logits"
            assert logprobs[i].item() == fp32(-math.log(int(infinite[i]))), (i, logprobs[i].item())
        if case.temperature == 0.0:
            assert tokens[i].item() == int(torch.argmax(xf[i])), f"row {i}: greedy is not the first max"
        else:
            bound = -(GUMBEL_SPAN + math.log(case.vocab)) - 1e-4
            assert logprobs[i].item() >= bound, f"row {i}: drew a token of logprob {logprobs[i].item()} < {bound}"


@pytest.mark.parametrize("backend", backends("sample"))
def test_sample_non_finite_logits_and_extreme_temperatures(backend):
    fuzz_run(check_sample_rule_and_backends, backend, sample_cases(backend), ci=5)


# =============================================================================================
# unpack: fill values at the dtype's edge
# =============================================================================================

PACK_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "float64": torch.float64,
    "int32": torch.int32,
    "int64": torch.int64,
}


def _pack_dtype_names(backend: str) -> list[str]:
    return [n for n, d in PACK_DTYPES.items() if dispatch.why_not(backend, abi.OPS["pack"], DEVICE, d) is None]


def _spacing(dtype: torch.dtype, value: float) -> float:
    """The spacing of ``dtype``'s values at the finite ``value`` (its ulp there; subnormal below the normals)."""
    info = torch.finfo(dtype)
    bits = 1 - round(math.log2(info.eps))
    return math.ldexp(1.0, max(math.frexp(value)[1], math.frexp(info.smallest_normal)[1]) - bits)


def _round_bf16(value: float) -> float:
    """``value`` (an fp32) with its 16 low bits cleared: a bfloat16 value."""
    (word,) = struct.unpack("<I", struct.pack("<f", value))
    return struct.unpack("<f", struct.pack("<I", word & 0xFFFF0000))[0]


@st.composite
def fill_values(draw, dtype: torch.dtype):
    """A fill value near ``dtype``'s edges or drawn at random, held exactly by ``dtype`` or not."""
    if not dtype.is_floating_point:
        info = torch.iinfo(dtype)
        edges = [info.min, info.max, info.min - 1, info.max + 1, 0, -100, 7.0, 0.5, INF, NAN]
        if dtype == torch.int64:
            edges += [2**53 + k for k in (-1, 0, 1, 2, 3)] + [-(2**53) - 1, 2**62 + 1, 2**63 - 1024, 2**63 - 512]
        return draw(st.one_of(st.sampled_from(edges), st.integers(info.min - 10, info.max + 10)))
    info = torch.finfo(dtype)
    bits = 1 - round(math.log2(info.eps))
    top = math.ldexp(1.0, math.frexp(info.max)[1] - bits)  # the spacing below the largest finite value
    subnormal = info.smallest_normal * info.eps
    edges = [info.max, -info.max, info.max + top / 2, info.max + top, info.smallest_normal, subnormal]
    edges += [subnormal / 2, 2**bits, 2**bits + 1, 0.1, -0.0, INF, -INF, NAN, 1e10, 65504, 65520]
    if dtype == torch.float64:
        exact = st.floats(allow_nan=False, allow_infinity=False)
    elif dtype == torch.bfloat16:
        exact = st.floats(width=32, allow_nan=False, allow_infinity=False).map(_round_bf16)
    else:
        exact = st.floats(width=16 if dtype == torch.float16 else 32, allow_nan=False, allow_infinity=False)
    value = draw(st.one_of(st.sampled_from(edges), exact, st.integers(-(2**70), 2**70)))
    if isinstance(value, float) and math.isfinite(value) and dtype != torch.float64 and draw(st.booleans()):
        value += _spacing(dtype, abs(value)) * draw(st.sampled_from([0.5, 0.25]))  # between two values of dtype
    return value


def held_exactly(value, dtype: torch.dtype) -> bool:
    """Whether ``value`` is a value of ``dtype`` (and, for the integer dtypes, of float64, how it reaches the
    kernels): by a round trip through torch, independent of the op's check."""
    if dtype.is_floating_point:
        if isinstance(value, float) and not math.isfinite(value):
            return True
        try:
            if float(value) != value:
                return False
        except OverflowError:
            return False
        return torch.tensor(float(value), dtype=torch.float64).to(dtype).double().item() == value
    if isinstance(value, float) and not value.is_integer():
        return False
    info = torch.iinfo(dtype)
    return info.min <= value <= info.max and float(value) == value


@dataclass(frozen=True)
class FillCase:
    """One ``unpack`` of ``[b, t, *trailing]`` data with a ``mask`` kind and a fill value."""

    dtype: str
    fill: object
    b: int
    t: int
    trailing: tuple[int, ...]
    mask: str
    seed: int


@st.composite
def fill_cases(draw, backend: str) -> FillCase:
    name = draw(st.sampled_from(_pack_dtype_names(backend)))
    return FillCase(
        dtype=name,
        fill=draw(fill_values(PACK_DTYPES[name])),
        b=draw(sizes(1, 4)),
        t=draw(sizes(1, 6)),
        trailing=draw(st.sampled_from([(), (3,)])),
        mask=draw(st.sampled_from(MASK_KINDS)),
        seed=draw(seeds),
    )


def check_fill_exact_or_refused(backend: str, case: FillCase) -> None:
    """A fill the dtype holds is written bit for bit at the padding (tokens kept bit for bit); any other is refused
    with an error naming ``padding_value``."""
    dtype = PACK_DTYPES[case.dtype]
    g = generator(case.seed)
    mask = make_mask(case.b, case.t, case.mask, g).to(DEVICE)
    shape = (case.b, case.t, *case.trailing)
    if dtype.is_floating_point:
        x = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    else:
        x = torch.randint(-1000, 1000, shape, generator=g).to(dtype)
    x = x.to(DEVICE)
    with on_backend(backend):
        packed, _, _ = rlk.pack(x, mask)
        if not held_exactly(case.fill, dtype):
            with pytest.raises(ValueError, match="^padding_value: "):
                rlk.unpack(packed, mask, padding_value=case.fill)
            return
        out = rlk.unpack(packed, mask, padding_value=case.fill)
    keep = mask.view(case.b, case.t, *([1] * len(case.trailing)))
    fill = float(case.fill) if dtype.is_floating_point else case.fill  # (torch.full refuses ints beyond int64)
    want = torch.where(keep, x, torch.full((), fill, dtype=dtype, device=DEVICE))
    check_bits("unpacked", out, want)


@pytest.mark.parametrize("backend", backends("pack"))
def test_unpack_fill_values_at_the_dtype_edge(backend):
    fuzz_run(check_fill_exact_or_refused, backend, fill_cases(backend), ci=15)


# =============================================================================================
# ema_
# =============================================================================================


def _fma_fused(backend: str) -> bool:
    """Whether ``backend`` rounds ``t + w * d`` once (the Triton kernel's ``tl.fma`` on a GPU and in interpreters
    after Triton 3.6; 3.6's interpreter evaluates it unfused, as the reference does)."""
    import triton

    return backend == "triton" and (ON_GPU or tuple(int(p) for p in triton.__version__.split(".")[:2]) > (3, 6))


@dataclass(frozen=True)
class EmaCase:
    """One ``ema_`` call over tensors of ``sizes``: values ``N(0, 1) * scale`` with a fraction ``special`` of
    NaN, +-inf, +-0.0 and the dtype's largest and smallest values."""

    sizes: tuple[int, ...]
    dtype: str
    decay: float
    scale: float
    special: float
    seed: int


@st.composite
def ema_cases(draw, backend: str, endpoints: bool) -> EmaCase:
    if endpoints:
        decay = draw(st.sampled_from([0.0, 1.0]))
    else:
        decay = draw(
            st.one_of(
                st.sampled_from([0.5, 1e-12, 2.0**-25, 1 - 1e-9, 0.999, 0.9, 0.3]),
                st.floats(0.0, 1.0, exclude_min=True, exclude_max=True),
            )
        )
    return EmaCase(
        sizes=tuple(draw(st.lists(sizes(0, limit(backend, 70, 5000)), min_size=1, max_size=4))),
        dtype=draw(st.sampled_from(dtype_names(backend, "ema"))),
        decay=decay,
        scale=draw(st.sampled_from([1.0, 1e-3, 1e4])),
        special=draw(st.sampled_from([0.0, 0.2, 1.0])) if endpoints else 0.0,
        seed=draw(seeds),
    )


def ema_inputs(case: EmaCase) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    dtype = DTYPES[case.dtype]
    info = torch.finfo(dtype)
    special = torch.tensor([NAN, INF, -INF, -0.0, 0.0, info.max, -info.max, info.smallest_normal * info.eps])
    g = generator(case.seed)
    out = []
    for n in case.sizes * 2:  # the targets, then the sources
        x = torch.randn(n, generator=g, dtype=torch.float64) * case.scale
        pick = special[torch.randint(0, len(special), (n,), generator=g)].double()
        x = torch.where(torch.rand(n, generator=g, dtype=torch.float64) < case.special, pick, x)
        out.append(x.to(dtype).to(DEVICE))
    return out[: len(case.sizes)], out[len(case.sizes) :]


def _run_ema(backend: str, targets, sources, decay) -> list[torch.Tensor]:
    got = [t.clone() for t in targets]
    with on_backend(backend):
        rlk.ema_(got, sources, decay)
    return got


def check_ema_endpoints(backend: str, case: EmaCase) -> None:
    """``decay = 1``: every target bit kept; ``decay = 0``: every source bit copied, whatever either holds."""
    targets, sources = ema_inputs(case)
    got = _run_ema(backend, targets, sources, case.decay)
    want = targets if case.decay == 1.0 else sources
    for i, (a, b) in enumerate(zip(got, want)):
        check_bits(f"target[{i}]", a, b)


def _within_one_ulp(what: str, got, want, t, s) -> None:
    """``|got - want| <= 1 ulp`` of the dtype at ``max(|t|, |s|)``, elementwise (the lerp's inputs' size)."""
    eps = torch.finfo(got.dtype).eps
    tiny = torch.finfo(got.dtype).smallest_normal * eps
    bound = eps * torch.maximum(t.double().abs(), s.double().abs()) + tiny
    over = (got.double() - want.double()).abs() > bound
    if bool(over.any()):
        i = int(over.nonzero()[0, 0])
        raise AssertionError(f"{what}: {got[i].item()!r} vs {want[i].item()!r} (t {t[i].item()}, s {s[i].item()})")


def check_ema_matches_reference(backend: str, case: EmaCase) -> None:
    """Decays between the endpoints: the reference primitive's bits (within one ulp where the backend fuses the
    multiply-add), and within one ulp of ``torch._foreach_lerp_``."""
    targets, sources = ema_inputs(case)
    got = _run_ema(backend, targets, sources, case.decay)
    want = [t.clone() for t in targets]
    ref_ema.ema_fwd(want, sources, case.decay)
    lerp = [t.clone() for t in targets]
    torch._foreach_lerp_(lerp, sources, 1 - case.decay)
    for i, (a, b, c, t, s) in enumerate(zip(got, want, lerp, targets, sources)):
        if _fma_fused(backend):
            _within_one_ulp(f"target[{i}] vs the reference", a, b, t, s)
        else:
            check_bits(f"target[{i}] vs the reference", a, b)
        _within_one_ulp(f"target[{i}] vs _foreach_lerp_", a, c, t, s)


@pytest.mark.parametrize("backend", backends("ema"))
def test_ema_endpoints_are_exact(backend):
    fuzz_run(check_ema_endpoints, backend, ema_cases(backend, endpoints=True), ci=6)


@pytest.mark.parametrize("backend", backends("ema"))
def test_ema_random_decays_match_reference(backend):
    fuzz_run(check_ema_matches_reference, backend, ema_cases(backend, endpoints=False), ci=6)


@dataclass(frozen=True)
class OverlapCase:
    """``ema_`` over views ``(start, length)`` of one float32 buffer of ``n`` elements as targets; the sources are
    views of another buffer, or of the same one (``shared``), or the targets themselves (``own``)."""

    n: int
    views: tuple[tuple[int, int], ...]
    sources: str
    source_views: tuple[tuple[int, int], ...]
    seed: int


@st.composite
def overlap_cases(draw) -> OverlapCase:
    n = draw(st.integers(1, 24))
    view = st.integers(0, n - 1).flatmap(lambda a: st.tuples(st.just(a), st.integers(0, n - a)))
    views = tuple(draw(st.lists(view, min_size=1, max_size=4)))
    lengths = [length for _, length in views]
    source_views = tuple(
        draw(st.integers(0, n - length).map(lambda a, length=length: (a, length))) for length in lengths
    )
    return OverlapCase(n, views, draw(st.sampled_from(["other", "shared", "own"])), source_views, draw(seeds))


def check_ema_overlap(backend: str, case: OverlapCase) -> None:
    """Refused exactly when two targets share an element (an error naming ``target``) or a source shares one with a
    target other than itself (naming ``source``), with nothing written; otherwise each view is updated as alone."""
    g = generator(case.seed)
    buffer = torch.randint(-8, 9, (case.n,), generator=g).float().to(DEVICE)
    other = torch.randint(-8, 9, (case.n,), generator=g).float().to(DEVICE)
    targets = [buffer[a : a + k] for a, k in case.views]
    if case.sources == "own":
        source_spans, sources = case.views, targets
    else:
        source_spans = case.source_views
        sources = [(buffer if case.sources == "shared" else other)[a : a + k] for a, k in source_spans]
    cells = [set(range(a, a + k)) for a, k in case.views]
    targets_overlap = any(cells[i] & cells[j] for i in range(len(cells)) for j in range(i))
    source_overlap = case.sources != "other" and any(
        set(range(a, a + k)) & cells[j] and not (i == j and (a, k) == case.views[j])
        for i, (a, k) in enumerate(source_spans)
        for j in range(len(cells))
    )
    before = buffer.clone()
    if targets_overlap or source_overlap:
        with pytest.raises(ValueError, match=r"^target\[" if targets_overlap else r"^source\["):
            with on_backend(backend):
                rlk.ema_(targets, sources, 0.5)
        check_bits("the buffer after a refused call", buffer, before)
        return
    want = before.clone()
    for (a, k), (b, _), s in zip(case.views, source_spans, sources):
        source = s if case.sources == "other" else before[b : b + k]  # the values before the call
        ref_ema.ema_fwd([want[a : a + k]], [source], 0.5)  # small integers: t + (s - t) / 2 is exact, fused or not
    with on_backend(backend):
        rlk.ema_(targets, sources, 0.5)
    check_bits("the buffer", buffer, want)


@pytest.mark.parametrize("backend", backends("ema"))
def test_ema_overlapping_targets_are_refused(backend):
    fuzz_run(check_ema_overlap, backend, overlap_cases(), ci=10)
