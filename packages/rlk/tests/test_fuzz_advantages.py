"""Property-based fuzzing of the advantage and return ops: ``group_advantages`` (every mode), ``masked_whiten``,
``discounted_returns`` (every mask_mode) and ``gae`` (profiles, backends and repro lines: ``fuzz_support.py``;
what is fuzzed and how to run it: ``docs/fuzzing.md``).

Properties (each a test; every backend that implements the op, batch invariance on those declaring it):

* agreement with the fp64 ground truth under the numerical contract, with the per-element scales of
  ``rlk.reference.advantages`` (``group_``, ``whiten_``, ``returns_``, ``gae_contract_scale``), and finite
  outputs where the truth is finite; 16-bit inputs are upcast exactly (the truth is computed from the
  upcast values). The recurrences' ground truth runs the reference primitives in fp64 with the
  float32-rounded ``gamma`` and ``gamma * lam`` the op passes (``recurrence_constants``), as the contract says;
* documented exact values: a group of equal scores gives exactly 0; masked entries of ``masked_whiten``
  are exactly 0;
* masked positions never influence a result: NaN / +-inf there versus 0 give bitwise equal outputs at the
  unmasked positions (``masked_whiten``: everywhere);
* batch invariance: a group alone versus with its members spread among other groups (``gpg`` excepted:
  its ``alpha`` spans the call); a row of ``discounted_returns`` / ``gae`` alone versus inside a batch of
  other rows, padded with masked positions; ``masked_whiten`` (call-wide statistics) is deterministic.

No exclusions: the exact results of these inputs are representable in fp32 (score spreads reach 1e20, whose
squares overflow fp32 while the advantages themselves are of order 1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch
from fuzz_support import (
    DEVICE,
    FILTERS,
    MASK_KINDS,
    RowInBatch,
    as32,
    as64,
    backends,
    cast,
    check_equal,
    check_finite,
    check_value,
    fuzz_run,
    generator,
    insert_row,
    interpreted,
    limit,
    make_mask,
    on_backend,
    on_reference,
    padded_row,
    poisoned,
    rows_in_batch,
    seeds,
    sizes,
    zeroed,
)
from hypothesis import strategies as st

import rlk
from rlk.core import abi, contract
from rlk.reference import advantages as ref_adv

pytestmark = FILTERS

ALL_DTYPES = ("float32", "bfloat16", "float16")


# =============================================================================================
# group_advantages
# =============================================================================================


@dataclass(frozen=True)
class GroupCase:
    """One ``group_advantages`` call: the group sizes, how the groups are given and how scores are drawn."""

    groups: tuple[int, ...]  # member counts (all equal with group_size)
    seed: int
    mode: str
    by_index: bool = False  # group_index (arbitrary ids, members shuffled) instead of group_size
    eps: float = 1e-6
    dtype: str = "float32"
    scores: str = "normal"  # "binary", "normal", "equal" (constant groups), "offset" (1e6 + small spread), "wide"
    zero_lengths: bool = False  # opo: a group whose lengths are all 0 (the plain mean)


@st.composite
def group_cases(draw, backend: str, one_group: bool = False) -> GroupCase:
    by_index = True if one_group else draw(st.booleans())
    n_max = limit(backend, 9, 300)
    if one_group:
        groups = (draw(sizes(1, n_max)),)
    elif by_index:
        groups = tuple(draw(st.lists(sizes(1, n_max), min_size=0, max_size=limit(backend, 6, 40))))
    else:
        count, size = draw(sizes(0, limit(backend, 6, 40))), draw(sizes(1, n_max))
        groups = (size,) * count
    dtype = draw(st.sampled_from(ALL_DTYPES))
    kinds = ["binary", "normal", "equal"] + ([] if dtype == "float16" else ["offset", "wide"])
    modes = [m for m in abi.GROUP_MODES if not (one_group and m == "gpg")]
    return GroupCase(
        groups=groups,
        seed=draw(seeds),
        mode=draw(st.sampled_from(modes)),
        by_index=by_index,
        eps=draw(st.sampled_from([1e-6, 1e-4, 1.0])),
        dtype=dtype,
        scores=draw(st.sampled_from(kinds)),
        zero_lengths=draw(st.booleans()),
    )


def group_inputs(case: GroupCase) -> dict[str, torch.Tensor]:
    """Scores, lengths and ``gid`` (each sequence's group number, 0.. in the order of ``groups``), in batch
    order: consecutive blocks, or (``by_index``) shuffled."""
    g = generator(case.seed)
    gid = torch.repeat_interleave(torch.arange(len(case.groups)), torch.tensor(case.groups, dtype=torch.int64))
    b = gid.shape[0]
    if case.scores == "binary":
        scores = (torch.rand(b, generator=g) < 0.5).float()
    elif case.scores == "equal":
        scores = (torch.randn(len(case.groups), generator=g) * 3)[gid] if b else torch.zeros(0)
    elif case.scores == "offset":
        scores = 1e6 + 1e-2 * torch.randn(b, generator=g)
    elif case.scores == "wide":
        scores = torch.randn(b, generator=g) * 1e20
    else:
        scores = torch.randn(b, generator=g) * 3
    lengths = torch.randint(0, 100, (b,), generator=g).float()
    if case.zero_lengths and case.groups:
        lengths[gid == 0] = 0
    if case.by_index:
        order = torch.randperm(b, generator=g)
        scores, lengths, gid = scores[order], lengths[order], gid[order]
    x = cast({"scores": scores}, case.dtype)
    return x | {"lengths": lengths.to(DEVICE), "gid": gid.to(DEVICE)}


def group_call(x: dict[str, torch.Tensor], case: GroupCase, ids: torch.Tensor | None = None) -> torch.Tensor:
    """``group_advantages`` on the pinned backend; group ids ``37 * gid - 5`` (or ``ids``) with ``by_index``."""
    kw = {"mode": case.mode, "eps": case.eps}
    if case.mode == "opo":
        kw["lengths"] = x["lengths"]
    if case.by_index:
        return rlk.group_advantages(x["scores"], group_index=37 * x["gid"] - 5 if ids is None else ids, **kw)
    return rlk.group_advantages(x["scores"], group_size=case.groups[0] if case.groups else 1, **kw)


def check_group_advantages_matches_reference(backend: str, case: GroupCase) -> None:
    """The advantages against the fp64 ground truth (from the upcast scores) under the contract (per sequence
    ``1 + max |adv|`` of its group), finite; a group of equal scores gives exactly 0."""
    x = group_inputs(case)
    with on_backend(backend):
        got = group_call(x, case)
    if not case.groups:  # an empty batch: an empty result
        assert got.shape == (0,) and got.dtype == torch.float32
        return
    x64 = as64(x)
    with on_reference():
        truth = group_call(x64, case)
    index = 37 * x["gid"] - 5 if case.by_index else None
    scale = ref_adv.group_contract_scale(truth, index, 0 if case.by_index else (case.groups[0] if case.groups else 1))
    check_finite("advantages", got)
    check_value(contract.entry("group_advantages", torch.float32), "advantages", got, truth, scale)
    if case.scores == "equal":
        sizes_of = torch.tensor(case.groups, device=DEVICE)[x["gid"]] if case.groups else x["gid"]
        grouped = sizes_of > 1
        check_equal("advantages of constant groups", got[grouped], torch.zeros_like(got[grouped]))


def check_group_advantages_batch_invariance(backend: str, case: RowInBatch) -> None:
    """A group alone (by ``group_size`` and by a single id) versus with its members at random positions among
    ``pad + 1`` other groups of ``others`` members (relative order kept): bitwise equal advantages."""
    probe = case.probe
    x = group_inputs(probe)
    others = group_inputs(replace(probe, groups=(case.others,) * (case.pad + 1), seed=case.seed))
    n, m = x["scores"].shape[0], others["scores"].shape[0]
    g = generator(case.seed + 1)
    slots = torch.sort(torch.randperm(n + m, generator=g)[:n]).values.to(DEVICE)
    is_probe = torch.zeros(n + m, dtype=torch.bool, device=DEVICE)
    is_probe[slots] = True
    batch = {}
    for name in ("scores", "lengths"):
        batch[name] = torch.empty(n + m, dtype=x[name].dtype, device=DEVICE)
        batch[name][is_probe], batch[name][~is_probe] = x[name], others[name]
    ids = torch.empty(n + m, dtype=torch.int64, device=DEVICE)
    ids[is_probe], ids[~is_probe] = 1000, others["gid"]
    alone_by_size = replace(probe, by_index=False, groups=(n,))
    with on_backend(backend):
        alone = group_call(x, probe, ids=torch.full((n,), 1000, device=DEVICE))
        alone_sized = group_call(x, alone_by_size)
        inside = group_call(batch, probe, ids=ids)
    check_equal("group_size vs group_index", alone_sized, alone)
    check_equal("the group's advantages", inside[is_probe], alone)


@pytest.mark.parametrize("backend", backends("group_advantages"))
def test_group_advantages_matches_reference(backend):
    fuzz_run(check_group_advantages_matches_reference, backend, group_cases(backend), ci=8)


@pytest.mark.parametrize("backend", backends("group_advantages", invariant_only=True))
def test_group_advantages_batch_invariance(backend):
    fuzz_run(
        check_group_advantages_batch_invariance,
        backend,
        rows_in_batch(group_cases(backend, one_group=True), limit(backend, 9, 300), 3),
        ci=5,
    )


# =============================================================================================
# masked_whiten
# =============================================================================================


@dataclass(frozen=True)
class WhitenCase:
    """One ``masked_whiten`` call on a ``[rows, cols]`` input (``flat``: ``[rows * cols]``; ``lead``: ``[rows, 1,
    cols]``)."""

    rows: int
    cols: int
    seed: int
    layout: str = "2d"  # "2d", "flat", "lead"
    mask: str = "holes"
    float_mask: bool = False
    unbiased: bool = True
    eps: float = 1e-8
    eps_mode: str = "add"
    shift_mean: bool = True
    dtype: str = "float32"
    offset: float = 0.0
    scale: float = 1.0


@st.composite
def whiten_cases(draw, backend: str) -> WhitenCase:
    dtype = draw(st.sampled_from(ALL_DTYPES))
    return WhitenCase(
        rows=draw(sizes(0, limit(backend, 9, 64))),
        cols=draw(sizes(0, limit(backend, 300, 4097))),
        seed=draw(seeds),
        layout=draw(st.sampled_from(["2d", "flat", "lead"])),
        mask=draw(st.sampled_from(MASK_KINDS)),
        float_mask=draw(st.booleans()),
        unbiased=draw(st.booleans()),
        eps=draw(st.sampled_from([1e-8, 1e-5, 1.0])),
        eps_mode=draw(st.sampled_from(["add", "clamp"])),
        shift_mean=draw(st.booleans()),
        dtype=dtype,
        offset=draw(st.sampled_from([0.0, 20.0] + ([] if dtype == "float16" else [1e6]))),
        scale=draw(st.sampled_from([1.0, 1e-3, 100.0])),
    )


def whiten_inputs(case: WhitenCase) -> dict[str, torch.Tensor]:
    g = generator(case.seed)
    x = case.offset + case.scale * torch.randn(case.rows, case.cols, generator=g)
    mask = make_mask(case.rows, case.cols, case.mask, g)
    shape = {"2d": (case.rows, case.cols), "flat": (case.rows * case.cols,), "lead": (case.rows, 1, case.cols)}
    x, mask = x.reshape(shape[case.layout]), mask.reshape(shape[case.layout])
    return cast({"x": x, "mask": mask.float() if case.float_mask else mask}, case.dtype)


def whiten_call(x: dict[str, torch.Tensor], case: WhitenCase) -> torch.Tensor:
    return rlk.masked_whiten(
        x["x"], x["mask"], unbiased=case.unbiased, eps=case.eps, shift_mean=case.shift_mean, eps_mode=case.eps_mode
    )


def check_masked_whiten_matches_reference(backend: str, case: WhitenCase) -> None:
    """The whitened values against the fp64 ground truth under the contract (per entry ``1 + |ref| + (|x| + |mu|)
    * rstd``), finite, exactly 0 off the mask; deterministic on backends declaring batch invariance."""
    x = whiten_inputs(case)
    with on_backend(backend):
        got = whiten_call(x, case)
        again = whiten_call(x, case)
    x64 = as64(x)
    with on_reference():
        truth = whiten_call(x64, case)
    mask = x64["mask"] != 0
    scale = ref_adv.whiten_contract_scale(x64["x"], mask, case.unbiased, case.eps, case.eps_mode, truth)
    check_finite("whitened", got)
    check_value(contract.entry("masked_whiten", torch.float32), "whitened", got, truth, scale)
    check_equal("off the mask", got[~mask], torch.zeros_like(got[~mask]))
    check_equal("the same call twice", again, got)


def check_masked_whiten_masked_positions(backend: str, case: WhitenCase) -> None:
    """NaN / +-inf at the masked-out entries versus 0 there: bitwise equal outputs."""
    x = whiten_inputs(case)
    masked = x["mask"] == 0
    with on_backend(backend):
        a = whiten_call({"x": poisoned(x["x"], masked, generator(case.seed + 1)), "mask": x["mask"]}, case)
        b = whiten_call({"x": zeroed(x["x"], masked), "mask": x["mask"]}, case)
    check_equal("whitened", a, b)


@pytest.mark.parametrize("backend", backends("masked_whiten"))
def test_masked_whiten_matches_reference(backend):
    fuzz_run(check_masked_whiten_matches_reference, backend, whiten_cases(backend), ci=6)


@pytest.mark.parametrize("backend", backends("masked_whiten"))
def test_masked_whiten_masked_positions_never_matter(backend):
    fuzz_run(check_masked_whiten_masked_positions, backend, whiten_cases(backend), ci=4)


# =============================================================================================
# discounted_returns and gae
# =============================================================================================


@pytest.fixture
def interpreted_scan_chunks(monkeypatch, backend):
    """In the Triton interpreter the scans run chunks of 32 positions, not 1024: rows of the CI profile's lengths
    (<= 129) then span several chunks (the carry from one chunk to the next, a ragged last chunk), where one 1024
    chunk reached neither, and the interpreter's scan (one Python step per lane) costs ~6x less."""
    if interpreted(backend):
        from rlk_triton import advantages as tk

        monkeypatch.setitem(tk.TILE_CONFIGS, "scan", {**tk.TILE_CONFIGS["scan"], "BLOCK_T": 32})


@dataclass(frozen=True)
class ReturnsCase:
    """One ``discounted_returns`` (``mask_mode`` set) or ``gae`` (``mask_mode`` None) call on ``[B, T]`` rows
    (``lead``: ``[B, 1, T]``)."""

    b: int
    t: int
    seed: int
    gamma: float
    lam: float = 1.0
    mask_mode: str | None = "carry"
    mask: str = "holes"
    float_mask: bool = False
    dtype: str = "float32"
    rewards: str = "terminal"  # "terminal" (shaping + a terminal +-1), "normal", "large" (1e4)
    lead: bool = False


@st.composite
def returns_cases(draw, backend: str, gae: bool, one_row: bool = False) -> ReturnsCase:
    gammas = st.sampled_from([1.0, 0.99, 0.0, 0.95, 1 - 2**-7]) | st.floats(0.0, 1.0)
    return ReturnsCase(
        b=1 if one_row else draw(sizes(0, limit(backend, 3, 64))),
        t=draw(sizes(1 if one_row else 0, limit(backend, 129, 4097))),
        seed=draw(seeds),
        gamma=draw(gammas),
        lam=draw(gammas) if gae else 1.0,
        mask_mode=None if gae else draw(st.sampled_from(abi.RETURN_MASK_MODES)),
        mask=draw(st.sampled_from(MASK_KINDS)),
        float_mask=draw(st.booleans()),
        dtype=draw(st.sampled_from(ALL_DTYPES)),
        rewards=draw(st.sampled_from(["terminal", "normal", "large"])),
        lead=False if one_row else draw(st.booleans()),
    )


def returns_inputs(case: ReturnsCase) -> dict[str, torch.Tensor]:
    g = generator(case.seed)
    b, t = case.b, case.t
    mask = make_mask(b, t, case.mask, g)
    if case.rewards == "terminal":
        rewards = 0.1 * torch.randn(b, t, generator=g)
        last = (mask.cumsum(1) == mask.sum(1, keepdim=True)) & mask
        rewards = torch.where(last, torch.randn(b, t, generator=g).sign(), rewards)
    else:
        rewards = torch.randn(b, t, generator=g) * (1e4 if case.rewards == "large" else 1.0)
    x = {"rewards": rewards, "mask": mask.float() if case.float_mask else mask}
    if case.mask_mode is None:
        x["values"] = torch.randn(b, t, generator=g) * (1e3 if case.rewards == "large" else 0.5)
    if case.lead:
        x = {name: value[:, None, :] for name, value in x.items()}
    return cast(x, case.dtype)


def returns_call(x: dict[str, torch.Tensor], case: ReturnsCase) -> tuple[torch.Tensor, ...]:
    """The public op on the pinned backend: ``(returns,)`` or ``(advantages, returns)``."""
    if case.mask_mode is None:
        return rlk.gae(x["rewards"], x["values"], x["mask"], gamma=case.gamma, lam=case.lam)
    return (rlk.discounted_returns(x["rewards"], x["mask"], case.gamma, mask_mode=case.mask_mode),)


def returns_truth(x: dict[str, torch.Tensor], case: ReturnsCase) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """fp64 ground truth and contract scales, from the reference primitives with the float32-rounded constants
    the op passes for float32 inputs."""
    gamma, gamma_lam = abi.recurrence_constants(case.gamma, case.lam, torch.float32)
    x64 = as64(as32(x))
    shape = x64["rewards"].shape
    r = x64["rewards"].reshape(math.prod(shape[:-1]), shape[-1])
    m = (x64["mask"] != 0).reshape(r.shape)
    if case.mask_mode is None:
        v = x64["values"].reshape(r.shape)
        adv, ret = torch.empty_like(r), torch.empty_like(r)
        ref_adv.gae_fwd(r, v, m, gamma, gamma_lam, adv, ret)
        return [adv, ret], list(ref_adv.gae_contract_scale(r, v, m, gamma, gamma_lam))
    out = torch.empty_like(r)
    ref_adv.discounted_returns_fwd(r, m, gamma, case.mask_mode, out)
    return [out], [ref_adv.returns_contract_scale(r, m, gamma, case.mask_mode)]


def _names(case: ReturnsCase) -> tuple[str, ...]:
    return ("returns",) if case.mask_mode is not None else ("advantages", "returns")


def check_returns_matches_reference(backend: str, case: ReturnsCase) -> None:
    """Every output against the fp64 ground truth under the contract (``returns_`` / ``gae_contract_scale``),
    finite; 16-bit inputs give the bits of their fp32 upcast."""
    x = returns_inputs(case)
    with on_backend(backend):
        got = returns_call(x, case)
        exact = got if case.dtype == "float32" else returns_call(as32(x), case)
    truths, scales = returns_truth(x, case)
    op = "gae" if case.mask_mode is None else "discounted_returns"
    for name, value, upcast, truth, scale in zip(_names(case), got, exact, truths, scales):
        check_equal(f"{name} of {case.dtype} inputs vs their fp32 upcast", value, upcast)
        check_finite(name, value)
        check_value(contract.entry(op, torch.float32), name, value, truth, scale)


def check_returns_masked_positions(backend: str, case: ReturnsCase) -> None:
    """NaN / +-inf in the rewards (and values) at masked positions versus 0 there: bitwise equal outputs at
    the unmasked positions."""
    x = returns_inputs(case)
    masked = x["mask"] == 0
    g = generator(case.seed + 1)
    bad = {name: (v if name == "mask" else poisoned(v, masked, g)) for name, v in x.items()}
    clean = {name: (v if name == "mask" else zeroed(v, masked)) for name, v in x.items()}
    with on_backend(backend):
        a, b = returns_call(bad, case), returns_call(clean, case)
    for name, value, want in zip(_names(case), a, b):
        check_equal(f"{name} at unmasked positions", value[~masked], want[~masked])


def check_returns_batch_invariance(backend: str, case: RowInBatch) -> None:
    """A row alone versus inside a batch of other rows at a random position, every row padded with masked
    zero positions: bitwise equal outputs on the row's positions."""
    probe = case.probe
    x = returns_inputs(probe)
    others = returns_inputs(replace(probe, b=case.others, t=probe.t + case.pad, seed=case.seed))
    batch = insert_row(padded_row(x, case.pad, ("rewards", "values", "mask")), others, case.position)
    with on_backend(backend):
        alone = returns_call(x, probe)
        inside = returns_call(batch, probe)
    for name, value, want in zip(_names(probe), inside, alone):
        check_equal(f"{name} of the row", value[case.position : case.position + 1, : probe.t], want)


@pytest.mark.parametrize("backend", backends("discounted_returns"))
def test_discounted_returns_matches_reference(interpreted_scan_chunks, backend):
    fuzz_run(check_returns_matches_reference, backend, returns_cases(backend, gae=False), ci=4)


@pytest.mark.parametrize("backend", backends("discounted_returns"))
def test_discounted_returns_masked_positions_never_matter(interpreted_scan_chunks, backend):
    fuzz_run(check_returns_masked_positions, backend, returns_cases(backend, gae=False), ci=3)


@pytest.mark.parametrize("backend", backends("discounted_returns", invariant_only=True))
def test_discounted_returns_batch_invariance(interpreted_scan_chunks, backend):
    fuzz_run(
        check_returns_batch_invariance,
        backend,
        rows_in_batch(returns_cases(backend, gae=False, one_row=True), limit(backend, 2, 64), limit(backend, 33, 300)),
        ci=3,
    )


@pytest.mark.parametrize("backend", backends("gae"))
def test_gae_matches_reference(interpreted_scan_chunks, backend):
    fuzz_run(check_returns_matches_reference, backend, returns_cases(backend, gae=True), ci=4)


@pytest.mark.parametrize("backend", backends("gae"))
def test_gae_masked_positions_never_matter(interpreted_scan_chunks, backend):
    fuzz_run(check_returns_masked_positions, backend, returns_cases(backend, gae=True), ci=3)


@pytest.mark.parametrize("backend", backends("gae", invariant_only=True))
def test_gae_batch_invariance(interpreted_scan_chunks, backend):
    fuzz_run(
        check_returns_batch_invariance,
        backend,
        rows_in_batch(returns_cases(backend, gae=True, one_row=True), limit(backend, 2, 64), limit(backend, 33, 300)),
        ci=3,
    )
