"""Triton ``scatter_rewards`` primitive against the reference (ground truth: the reference run in fp64).

On a machine without CUDA the kernels run under the Triton CPU interpreter (``TRITON_INTERPRET=1``, set below before
triton is imported), with small shapes and, where chunking matters, tiny tiles; with CUDA the same tests run on the
GPU, plus the ``gpu``-marked ones (B = 512, T = 8192, groups of 8). Tolerances come from the numerical contract
(entry ``scatter_rewards``, scales from ``rlk.reference.rewards.contract_scale``); batch invariance and determinism
are checked bit for bit (``torch.equal``), with negative controls.
"""

from __future__ import annotations

import math
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

import rlk
from rlk.core import abi, contract
from rlk.ops.rewards import primitive_inputs
from rlk.reference import rewards as ref
from rlk_triton import advantages as tk_adv
from rlk_triton import rewards as tk

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ENTRY = contract.entry("scatter_rewards", torch.float32)
MODES = [None, *abi.REWARD_GROUP_MODES]

# The interpreter evaluates both sides of tl.where where a group holds inf / NaN: harmless warnings.
pytestmark = pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")

#: Tiny tiles: rows of several chunks (a ragged last one), spans across chunk borders, groups of several chunks.
SMALL_TILES = {"row": {"BLOCK_T": 8, "num_warps": 1}, "place": {"BLOCK_T": 8, "num_warps": 1}}


def _small(monkeypatch) -> None:
    for family, cfg in SMALL_TILES.items():
        monkeypatch.setitem(tk.TILE_CONFIGS, family, dict(cfg))
    monkeypatch.setitem(tk_adv.TILE_CONFIGS, "group", {"BLOCK": 4, "num_warps": 1})


@pytest.fixture(params=["default_tiles", "small_tiles"])
def tiles(request, monkeypatch):
    if request.param == "small_tiles":
        _small(monkeypatch)
    return request.param


@pytest.fixture
def small_tiles(monkeypatch):
    _small(monkeypatch)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_case(b: int, t: int, seed: int, columns: int = 2, regions_per_row: int = 2) -> dict:
    """Reward columns (0 / 1 plus noise, NaN entries in the second), a mask with every pattern (empty, prefix,
    holes), regions (random spans, empty ones included), costs and region costs, group ids of ragged groups."""
    g = _gen(seed)
    mask = torch.rand(b, t, generator=g) < 0.75
    if b > 3:
        mask[1] = False
        mask[2] = torch.arange(t) < t // 3
        mask[3] = torch.arange(t) >= t // 4
    rewards = (torch.rand(b, columns, generator=g) < 0.5).float() + 0.1 * torch.randn(b, columns, generator=g)
    if columns > 1:
        rewards[::3, 1] = math.nan
    n = regions_per_row * b
    start = torch.randint(0, t + 1, (n,), generator=g)
    end = start + (torch.rand(n, generator=g) * (t + 1 - start)).long()
    spans = torch.stack([torch.arange(b).repeat_interleave(regions_per_row), start, end], 1)
    case = {
        "rewards": rewards,
        "mask": mask,
        "spans": spans,
        "region_values": torch.randn(n, generator=g),
        "region_costs": (torch.rand(n, generator=g) < 0.3).float(),
        "costs": (torch.rand(b, generator=g) < 0.4).float(),
        "group_index": torch.randint(0, max(b // 3, 1), (b,), generator=g) * 5 - 3,
    }
    return {k: v.to(DEVICE) for k, v in case.items()}


def keywords(case: dict, mode, placement: str, *, by_size: int = 0, overlong: bool = True) -> dict:
    b, t = case["mask"].shape
    kw = {"placement": placement, "group_mode": mode}
    if mode is not None:
        kw |= {"group_size": by_size} if by_size else {"group_index": case["group_index"]}
    if case["rewards"].shape[1] > 1:
        kw["reward_weights"] = [1.0, 0.5, 0.25][: case["rewards"].shape[1]]
    if overlong:
        kw["overlong"] = (t, max(t // 3, 1), 0.75)
    kw["region_rewards"] = (case["region_values"], case["spans"])
    kw["costs"] = case["costs"]
    kw["region_costs"] = (case["region_costs"], case["spans"])
    return kw


def run(impl, rewards, mask, **kw) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``impl.scatter_rewards_fwd`` on ``primitive_inputs`` (the mask as bool)."""
    inputs = primitive_inputs(rewards, mask.bool(), **kw)
    out = torch.empty(mask.shape, dtype=inputs[0].dtype, device=mask.device)
    costs = torch.empty_like(out) if inputs[3] is not None else None
    impl.scatter_rewards_fwd(*inputs, out, costs)
    return out, costs


def _double(kw: dict) -> dict:
    def f64(v):
        return v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v

    return {k: (tuple(f64(x) for x in v) if isinstance(v, tuple) else f64(v)) for k, v in kw.items()}


def check(case: dict, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton against the fp64 reference under the contract; returns Triton's outputs."""
    got = run(tk, case["rewards"], case["mask"], **kw)
    truth = run(ref, case["rewards"].double(), case["mask"], **_double(kw))
    scales = ref.contract_scale(*primitive_inputs(case["rewards"].double(), case["mask"], **_double(kw)))
    for name, g, t in zip(("rewards", "costs"), got, truth):
        dev = contract.compare_outputs(
            ENTRY, name, g.reshape(-1).cpu(), t.reshape(-1).cpu(), scales[name].reshape(-1).cpu()
        )
        assert dev.ok, (name, dev)
        assert torch.all(g[~case["mask"]] == 0)
    return got


# ----------------------------------------------------------------------------------------------
# against the reference
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("placement", abi.PLACEMENTS)
@pytest.mark.parametrize("mode", MODES)
def test_matches_reference(tiles, mode, placement):
    case = make_case(13, 37, seed=1)
    check(case, **keywords(case, mode, placement))


@pytest.mark.parametrize("placement", abi.PLACEMENTS)
@pytest.mark.parametrize("shape", [(1, 1), (1, 50), (8, 17), pytest.param((16, 64), marks=pytest.mark.slow)])
def test_shapes_and_group_size(small_tiles, shape, placement):
    b, t = shape
    case = make_case(b, t, seed=2, columns=3 if b > 1 else 1)
    for mode in MODES:
        check(case, **keywords(case, mode, placement, by_size=4 if b % 4 == 0 else b))


def test_without_regions_costs_or_overlong(small_tiles):
    case = make_case(9, 21, seed=3, columns=1)
    for placement in abi.PLACEMENTS:
        for mode in MODES:
            kw = {"placement": placement, "group_mode": mode}
            if mode is not None:
                kw["group_size"] = 3
            got, costs = run(tk, case["rewards"], case["mask"], **kw)
            want, _ = run(ref, case["rewards"].double(), case["mask"], **_double(kw))
            assert costs is None
            torch.testing.assert_close(got.double(), want, rtol=2e-6, atol=1e-6)


def test_placement_is_exact_given_the_values(small_tiles):
    """Without normalization the placement adds the reference's values in the reference's order: the same bits."""
    case = make_case(11, 29, seed=4, columns=3, regions_per_row=3)
    for placement in abi.PLACEMENTS:
        kw = keywords(case, None, placement)
        got = run(tk, case["rewards"], case["mask"], **kw)
        want = run(ref, case["rewards"], case["mask"], **kw)
        assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_overlong_boundaries(small_tiles):
    t = 20
    lengths = torch.arange(t + 1, device=DEVICE)
    mask = torch.arange(t, device=DEVICE)[None, :] < lengths[:, None]
    zeros = torch.zeros(t + 1, device=DEVICE)
    for cache in (0, 1, 6, 18):
        kw = {"overlong": (18, cache, 1.5), "placement": "last"}
        got, _ = run(tk, zeros, mask, **kw)
        want, _ = run(ref, zeros, mask, **kw)
        assert torch.equal(got, want), cache


def test_public_op_runs_the_triton_primitive(small_tiles):
    case = make_case(12, 19, seed=5)
    kw = keywords(case, "grpo", "broadcast")
    with rlk.use_backend("triton"):
        assert rlk.explain("scatter_rewards", case["rewards"]).backend == "triton"
        public = rlk.scatter_rewards(case["rewards"], case["mask"].float(), **kw)
    direct = run(tk, case["rewards"], case["mask"], **kw)
    assert all(torch.equal(a, b) for a, b in zip(public, direct))


def test_tile_configs_are_powers_of_two():
    for cfg in tk.TILE_CONFIGS.values():
        assert cfg["BLOCK_T"] & (cfg["BLOCK_T"] - 1) == 0


# ----------------------------------------------------------------------------------------------
# batch invariance and determinism
# ----------------------------------------------------------------------------------------------


def take_rows(case: dict, rows: torch.Tensor, ids: torch.Tensor) -> dict:
    """The inputs of the sequences ``rows`` (in that order) with group ids ``ids``; their regions renumbered and
    ordered by their new sequence (keeping their order within one)."""
    where = torch.full((case["mask"].shape[0],), -1, dtype=torch.long, device=DEVICE)
    where[rows] = torch.arange(rows.shape[0], device=DEVICE)
    seq = where[case["spans"][:, 0]]
    keep = (seq >= 0).nonzero().squeeze(1)
    keep = keep[torch.sort(seq[keep], stable=True).indices]
    out = {k: case[k][rows] for k in ("rewards", "mask", "costs")}
    out["spans"] = torch.cat([seq[keep, None], case["spans"][keep, 1:]], 1)
    out |= {k: case[k][keep] for k in ("region_values", "region_costs")}
    out["group_index"] = ids
    return out


PROBE = 5  # the probe group's size


@pytest.mark.parametrize("placement", abi.PLACEMENTS)
@pytest.mark.parametrize(
    "mode", [mode if mode == "rloo" else pytest.param(mode, marks=pytest.mark.slow) for mode in MODES]
)
def test_batch_invariance(small_tiles, mode, placement):
    """A group of 5 sequences (with its regions and costs) alone, then among other groups at the first, middle and
    last position of batches of 8 and 13 rows, by group_index (other groups: random ids, ragged sizes) and by
    group_size 5 (the probe as the first, middle or last of 3 blocks): its token rewards and costs are equal bit
    for bit. (Each row is a program under the interpreter: 13 and 3 blocks reach every position at 2/3 the cost of
    21 and 5.)"""
    case = make_case(21 + PROBE, 23, seed=6, columns=3)
    probe = torch.arange(PROBE, device=DEVICE)
    others_ids = torch.randint(0, 4, (21 + PROBE,), generator=_gen(7)).to(DEVICE)
    alone = run_rows(take_rows(case, probe, torch.zeros(PROBE, dtype=torch.long, device=DEVICE)), mode, placement)
    assert bool((alone[0] != 0).any())
    for batch in (8, 13):
        others = torch.arange(PROBE, PROBE + batch - PROBE, device=DEVICE)
        for pos in sorted({0, (batch - PROBE) // 2, batch - PROBE}):
            rows = torch.cat([others[:pos], probe, others[pos:]])
            ids = others_ids[rows].clone()
            ids[pos : pos + PROBE] = -9
            got = run_rows(take_rows(case, rows, ids), mode, placement)
            assert all(torch.equal(a[pos : pos + PROBE], b) for a, b in zip(got, alone)), (batch, pos)
    if mode is not None:  # group_size: the probe as the k-th block of 5
        for k in (0, 1, 2):
            before, after = torch.arange(PROBE, PROBE + 5 * k), torch.arange(PROBE + 5 * k, 15)
            rows = torch.cat([before.to(DEVICE), probe, after.to(DEVICE)])
            got = run_rows(take_rows(case, rows, rows), mode, placement, by_size=PROBE)
            window = slice(5 * k, 5 * k + PROBE)
            assert all(torch.equal(a[window], b) for a, b in zip(got, alone)), k


def run_rows(x: dict, mode, placement: str, by_size: int = 0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton on the inputs of :func:`take_rows` (every input on; groups by ``group_index`` unless ``by_size``)."""
    return run(tk, x["rewards"], x["mask"], **keywords(x, mode, placement, by_size=by_size))


def test_negative_controls(small_tiles):
    """The invariance test can fail: a group's tokens change when one of its members does (the same check as
    above, on a changed composition), and a framework's batch-wide statistic (TRL's ``scale_rewards="batch"``: the
    std over the whole batch) moves the probe group's advantages with the other groups, where rlk's do not."""
    case = make_case(21 + PROBE, 23, seed=8, columns=1)
    probe = torch.arange(PROBE, device=DEVICE)
    zeros = torch.zeros(PROBE, dtype=torch.long, device=DEVICE)
    alone = run_rows(take_rows(case, probe, zeros), "grpo", "broadcast")[0]
    changed = take_rows(case, probe, zeros)
    changed["rewards"] = changed["rewards"].clone()
    changed["rewards"][0] += 0.25
    moved = run_rows(changed, "grpo", "broadcast")[0]
    assert not torch.equal(moved[1:], alone[1:])

    def trl_batch_scaled(rewards: torch.Tensor, group: int) -> torch.Tensor:
        grouped = rewards.view(-1, group)
        centred = (grouped - grouped.mean(1, keepdim=True)).view(-1)
        return centred / (rewards.std() + 1e-4)

    scores = case["rewards"][:, 0]
    trl_alone = trl_batch_scaled(scores[:PROBE], PROBE)
    trl_batch = trl_batch_scaled(scores[: 4 * PROBE], PROBE)[:PROBE]
    assert not torch.equal(trl_alone, trl_batch)
    kw = {"group_mode": "grpo", "group_size": PROBE, "placement": "broadcast"}
    ours_batch = run(tk, scores[: 4 * PROBE], case["mask"][: 4 * PROBE], **kw)[0][:PROBE]
    assert torch.equal(run(tk, scores[:PROBE], case["mask"][:PROBE], **kw)[0], ours_batch)


def test_deterministic(small_tiles):
    case = make_case(14, 30, seed=9, columns=3)
    kw = keywords(case, "rloo", "last")
    first, second = run(tk, case["rewards"], case["mask"], **kw), run(tk, case["rewards"], case["mask"], **kw)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


@pytest.mark.parametrize("fill", [math.nan, math.inf])
def test_non_finite_values_stay_in_their_group(small_tiles, fill):
    case = make_case(12, 15, seed=10, columns=1)
    kw = keywords(case, "grpo", "broadcast", by_size=4)
    clean = run(tk, case["rewards"], case["mask"], **kw)
    dirty_rewards = case["rewards"].clone()
    dirty_rewards[5, 0] = math.inf
    kw["costs"] = case["costs"].clone()
    kw["costs"][9] = fill
    got = run(tk, dirty_rewards, case["mask"], **kw)
    group_of = torch.arange(12, device=DEVICE) // 4
    assert torch.equal(got[0][group_of != 1], clean[0][group_of != 1])
    assert torch.equal(got[1][group_of != 2], clean[1][group_of != 2])


def test_unchecked_spans_stay_inside_the_mask(small_tiles, monkeypatch):
    """With value checks off, spans past T (or starting before 0) read no further than the row: the outputs are
    those of the clipped spans."""
    monkeypatch.setenv("RLK_CHECK_VALUES", "0")
    mask = torch.ones(3, 10, dtype=torch.bool, device=DEVICE)
    wild = torch.tensor([[0, -4, 3], [1, 6, 40], [2, 12, 30]], device=DEVICE)
    clipped = torch.tensor([[0, 0, 3], [1, 6, 10], [2, 10, 10]], device=DEVICE)
    values = torch.tensor([1.0, 2.0, 3.0], device=DEVICE)
    for placement in abi.PLACEMENTS:
        kw = {"placement": placement}
        got = run(tk, torch.zeros(3, device=DEVICE), mask, region_rewards=(values, wild), **kw)[0]
        want = run(tk, torch.zeros(3, device=DEVICE), mask, region_rewards=(values, clipped), **kw)[0]
        assert torch.equal(got, want)


# ----------------------------------------------------------------------------------------------
# GPU only: the benchmark's shape
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("placement", abi.PLACEMENTS)
def test_realistic_shapes_gpu(placement):
    """B = 512 sequences of T = 8192 tokens in groups of 8, 3 reward columns, 2 regions per sequence, costs: every
    mode against the fp64 reference, and a group's bits alone and inside the batch."""
    case = make_case(512, 8192, seed=11, columns=3)
    for mode in MODES:
        got = check(case, **keywords(case, mode, placement, by_size=8))
        if mode is not None:
            rows = torch.arange(8, device=DEVICE) + 256
            part = take_rows(case, rows, rows)
            alone = run(tk, part["rewards"], part["mask"], **keywords(part, mode, placement, by_size=8))
            assert all(torch.equal(a[256:264], b) for a, b in zip(got, alone))
