"""Triton advantage primitives against the reference (ground truth: the reference run in fp64).

On a machine without CUDA the kernels run under the Triton CPU interpreter
(``TRITON_INTERPRET=1``, set below before triton is imported), with small shapes and, where
chunking matters, tiny tiles; with CUDA the same tests run on the GPU, plus the ``gpu``-marked
ones (realistic shapes). Tolerances come from the numerical contract (``rlk.core.contract``); batch
invariance and determinism are checked bit for bit (``torch.equal``).
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
from rlk.reference import advantages as ref
from rlk_triton import advantages as tk

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

# Tiny tiles so that CPU-sized problems cover several member chunks, partials and time chunks.
SMALL_TILES = {
    "group": {"BLOCK": 4, "num_warps": 1},
    "whiten": {"BLOCK": 16, "COMBINE_BLOCK": 4, "num_warps": 1},
    "scan": {"BLOCK_T": 8, "num_warps": 1},
}


@pytest.fixture(params=["default_tiles", "small_tiles"])
def tiles(request, monkeypatch):
    if request.param == "small_tiles":
        for family, cfg in SMALL_TILES.items():
            monkeypatch.setitem(tk.TILE_CONFIGS, family, dict(cfg))
    return request.param


@pytest.fixture
def small_tiles(monkeypatch):
    for family, cfg in SMALL_TILES.items():
        monkeypatch.setitem(tk.TILE_CONFIGS, family, dict(cfg))


def _use_tiles(monkeypatch, tiles: str) -> None:
    if tiles == "small":
        for family, cfg in SMALL_TILES.items():
            monkeypatch.setitem(tk.TILE_CONFIGS, family, dict(cfg))


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _check(op: str, name: str, value: torch.Tensor, truth: torch.Tensor, scale: torch.Tensor) -> float:
    assert value.dtype == torch.float32
    dev = contract.compare_outputs(
        contract.entry(op, torch.float32),
        name,
        value.reshape(-1).cpu(),
        truth.reshape(-1).cpu(),
        scale.reshape(-1).cpu(),
    )
    assert dev.ok, dev
    return dev.ratio


# ----------------------------------------------------------------------------------------------
# group_advantages
# ----------------------------------------------------------------------------------------------


def group_inputs(sizes: list[int], seed: int, offset: float = 0.0, equal_group: int | None = 0):
    """Scores (``offset`` + 2 N(0, 1), or small integers on top of a large offset), shuffled
    group ids with the given group sizes, and OPO lengths (one group with all-zero lengths)."""
    g = _gen(seed)
    ids = torch.repeat_interleave(torch.arange(len(sizes)) * 5 - 7, torch.tensor(sizes))
    ids = ids[torch.randperm(ids.numel(), generator=g)]
    if offset:
        scores = offset + torch.randint(0, 5, ids.shape, generator=g).float()
    else:
        scores = torch.randn(ids.shape, generator=g) * 2
    if equal_group is not None:
        scores[ids == ids[equal_group]] = 0.3
    lengths = torch.randint(0, 200, ids.shape, generator=g).float()
    lengths[ids == ids[-1]] = 0
    return scores.to(DEVICE), ids.to(DEVICE), lengths.to(DEVICE)


def run_group(impl, scores, ids, size, lengths, mode, eps=1e-6):
    out = torch.empty_like(scores)
    impl.group_advantages_fwd(scores, ids, size, lengths if mode == "opo" else None, mode, eps, out)
    return out


def check_group(scores, ids, size, lengths, mode, eps=1e-6):
    got = run_group(tk, scores, ids, size, lengths, mode, eps)
    truth = run_group(ref, scores.double(), ids, size, lengths.double(), mode, eps)
    ratio = _check("group_advantages", mode, got, truth, ref.group_contract_scale(truth, ids, size))
    return got, ratio


@pytest.mark.parametrize("mode", abi.GROUP_MODES)
def test_group_index_matches_reference(tiles, mode):
    sizes = [1, 2, 3, 4, 5, 8, 9, 13, 1, 16]
    scores, ids, lengths = group_inputs(sizes, seed=1)
    got, _ = check_group(scores, ids, 0, lengths, mode)
    assert torch.all(got[ids == ids[0]] == 0)
    for single in (ids == -7, ids == 33):  # the two singleton groups
        # tensor / tensor: torch divides by a Python scalar through its reciprocal on CUDA (not IEEE)
        expected = scores[single] / torch.full_like(scores[single], 1 + 1e-6) if mode == "grpo" else scores[single]
        if mode != "gpg":
            assert torch.equal(got[single], expected)


@pytest.mark.parametrize("mode", abi.GROUP_MODES)
@pytest.mark.parametrize("size", [1, 5, 16])
def test_group_size_matches_reference(tiles, mode, size):
    g = _gen(2)
    scores = (torch.randn(size * 7, generator=g) * 3).to(DEVICE)
    scores[:size] = -1.25  # an equal group
    lengths = torch.randint(0, 100, (size * 7,), generator=g).float().to(DEVICE)
    got, _ = check_group(scores, None, size, lengths, mode)
    if size > 1:
        assert torch.all(got[:size] == 0)
    elif mode != "gpg":  # singletons: mean 0, std 1
        assert torch.equal(got, scores / torch.full_like(scores, 1 + 1e-6) if mode == "grpo" else scores)


@pytest.mark.parametrize("mode", ["grpo", "rloo", "dr_grpo"])
def test_group_large_scores(small_tiles, mode):
    scores, ids, lengths = group_inputs([8, 16, 5, 3], seed=3, offset=3e6, equal_group=None)
    check_group(scores, ids, 0, lengths, mode)


def test_group_eps_is_used(small_tiles):
    scores, ids, lengths = group_inputs([2, 2, 3, 1], seed=4)
    a = run_group(tk, scores, ids, 0, lengths, "grpo", eps=1e-4)
    b = run_group(tk, scores, ids, 0, lengths, "grpo", eps=1e-6)
    assert not torch.equal(a, b)
    check_group(scores, ids, 0, lengths, "grpo", eps=1e-4)


# Spreads whose squares (or differences) overflow fp32, with representable advantages: the 1e20
# example, +-3e38, equal scores near the fp32 maximum, an ordinary group; rloo and gpg (whose
# factors n / (n - 1) and alpha grow the values) get a +-1e38 group instead of +-3e38.
HUGE_SCORES = [0.0, 1e20, -1e20, 3e19, 3e38, -3e38, 1e38, 0.0, 3e38, 3e38, 3e38, 3e38, 0.5, -1.0, 2.0, 0.25]
HUGE_SCORES_RLOO = [0.0, 1e20, -1e20, 3e19, 1e38, -1e38, 5e37, 0.0, 3e38, 3e38, 3e38, 3e38, 0.5, -1.0, 2.0, 0.25]
HUGE_LENGTHS = [3.0, 1.0, 0.0, 7.0, 2.0, 2.0, 1.0, 1.0, 3.0, 1.0, 0.0, 7.0, 3.0, 1.0, 0.0, 7.0]


@pytest.mark.parametrize("mode", abi.GROUP_MODES)
def test_group_huge_spread(tiles, mode):
    """A spread above ~1e19 overflowed the fp32 variance (advantages 0, or NaN at +-3e38); against the
    fp64 reference, with group_size and with shuffled group_index."""
    scores = torch.tensor(HUGE_SCORES_RLOO if mode in ("rloo", "gpg") else HUGE_SCORES, device=DEVICE)
    lengths = torch.tensor(HUGE_LENGTHS, device=DEVICE)
    got, _ = check_group(scores, None, 4, lengths, mode)
    assert torch.all(got[8:12] == 0)  # equal scores of 3e38: exactly 0
    perm = torch.randperm(16, generator=_gen(13)).to(DEVICE)
    ids = torch.arange(16, device=DEVICE) // 4 * 3 - 2
    shuffled, _ = check_group(scores[perm], ids[perm], 0, lengths[perm], mode)
    assert torch.all(shuffled[(ids[perm] == 4)] == 0)
    single = torch.tensor([3e38, -2e38, 1.0], device=DEVICE)
    got = run_group(tk, single, None, 1, torch.ones(3, device=DEVICE), mode)
    if mode != "gpg":
        assert torch.equal(got, single / torch.full_like(single, 1 + 1e-6) if mode == "grpo" else single)


@pytest.mark.parametrize("fill", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("mode", abi.GROUP_MODES)
def test_group_non_finite_scores_stay_in_their_group(small_tiles, mode, fill):
    """Every row is in a group, and a group reads only its own scores and lengths: a NaN / inf there
    leaves the other groups bitwise as with finite values (distinct ones, so that gpg's count of
    non-zero advantages, where NaN counts, is the same)."""
    scores, ids, lengths = group_inputs([3, 9, 1, 6, 5], seed=14, equal_group=None)
    bad = ids == ids[(ids.unsqueeze(1) == ids).sum(1) == 9][0]  # the group of 9 (over two chunks of 4)
    dirty = scores.clone()
    dirty[bad] = fill
    dirty[bad.nonzero()[-1]] = 1.5
    dirty_len = lengths.clone()
    dirty_len[bad] = fill
    for group_ids, size, mask in ((ids, 0, bad), (None, 3, torch.arange(24, device=DEVICE) // 3 == 2)):
        if group_ids is None:  # group_size 3: garbage in the third group
            dirty = scores.clone()
            dirty[mask] = fill
            dirty_len = lengths.clone()
            dirty_len[mask] = fill
        finite = run_group(tk, scores, group_ids, size, lengths, mode)
        got = run_group(tk, dirty, group_ids, size, lengths, mode)
        assert torch.equal(got[~mask], finite[~mask])
        assert not bool(torch.isfinite(got[mask]).all())
        if mode == "opo":
            assert torch.equal(run_group(tk, scores, group_ids, size, dirty_len, mode)[~mask], finite[~mask])


def test_group_segments():
    ids = torch.tensor([4, -1, 4, 7, -1, 4, 9], device=DEVICE)
    perm, seg_len = tk.group_segments(ids)
    assert perm.tolist() == [1, 4, 0, 2, 5, 3, 6]
    assert seg_len.tolist() == [2, 0, 3, 0, 0, 1, 1]


@pytest.mark.parametrize("mode", ["grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "opo"])
def test_group_batch_invariance(small_tiles, mode):
    """A group's advantages alone equal, bit for bit, its advantages among other groups, wherever its
    members sit (keeping their relative order), for group_index and group_size batches."""
    g = _gen(5)
    probe = (torch.randn(9, generator=g) * 4 + 1).to(DEVICE)
    probe_len = torch.randint(1, 50, (9,), generator=g).float().to(DEVICE)
    alone = run_group(tk, probe, None, 9, probe_len, mode)
    assert torch.equal(run_group(tk, probe, torch.zeros(9, dtype=torch.long, device=DEVICE), 0, probe_len, mode), alone)
    for n_other in (1, 6, 20):
        other = (torch.randn(n_other * 9, generator=g) * 10).to(DEVICE)
        other_len = torch.randint(0, 50, (n_other * 9,), generator=g).float().to(DEVICE)
        # group_size: the probe as group k of n_other + 1
        for k in sorted({0, n_other // 2, n_other}):
            scores = torch.cat([other[: k * 9], probe, other[k * 9 :]])
            lengths = torch.cat([other_len[: k * 9], probe_len, other_len[k * 9 :]])
            out = run_group(tk, scores, None, 9, lengths, mode)
            assert torch.equal(out[k * 9 : (k + 1) * 9], alone), (n_other, k)
        # group_index: the probe's members scattered (in order) among other groups' members
        total = (n_other + 1) * 9
        where = torch.sort(torch.randperm(total, generator=g)[:9]).values.to(DEVICE)
        ids = torch.randint(1, 2 + n_other, (total,), generator=g).to(DEVICE)
        ids[where] = 0
        scores = torch.empty(total, device=DEVICE)
        lengths = torch.empty(total, device=DEVICE)
        rest = torch.ones(total, dtype=torch.bool, device=DEVICE)
        rest[where] = False
        scores[where], lengths[where] = probe, probe_len
        scores[rest], lengths[rest] = other, other_len
        out = run_group(tk, scores, ids, 0, lengths, mode)
        assert torch.equal(out[where], alone), n_other


# ----------------------------------------------------------------------------------------------
# masked_whiten
# ----------------------------------------------------------------------------------------------


def run_whiten(impl, x, mask, unbiased, eps_mode, shift_mean, eps=1e-8):
    out = torch.empty_like(x)
    impl.masked_whiten_fwd(x, mask, unbiased, eps, eps_mode, shift_mean, out)
    return out


def check_whiten(x, mask, unbiased, eps_mode, shift_mean):
    got = run_whiten(tk, x, mask, unbiased, eps_mode, shift_mean)
    truth = run_whiten(ref, x.double(), mask, unbiased, eps_mode, shift_mean)
    scale = ref.whiten_contract_scale(x, mask, unbiased, 1e-8, eps_mode, truth)
    _check("masked_whiten", "white", got, truth, scale)
    assert torch.all(got[~mask] == 0)
    return got


# (tiles, N): the interpreter's cost grows with the number of programs, so tiny tiles get smaller N
WHITEN_CASES = [("default", 1), ("default", 37), ("default", 9000), ("small", 37), ("small", 1000)]


@pytest.mark.parametrize("shift_mean", [True, False])
@pytest.mark.parametrize("unbiased, eps_mode", [(True, "add"), (False, "clamp"), (False, "add")])
@pytest.mark.parametrize("tiles, n", WHITEN_CASES)
def test_whiten_matches_reference(monkeypatch, tiles, n, unbiased, eps_mode, shift_mean):
    _use_tiles(monkeypatch, tiles)
    g = _gen(n)
    x = (torch.randn(n, generator=g) * 5 + 20).to(DEVICE)
    mask = (torch.rand(n, generator=g) > 0.4).to(DEVICE)
    if n > 1:
        mask[0] = True
    check_whiten(x, mask, unbiased, eps_mode, shift_mean)


def test_whiten_edge_cases(small_tiles):
    x = torch.randn(50, generator=_gen(6)).to(DEVICE)
    none = torch.zeros(50, dtype=torch.bool, device=DEVICE)
    assert torch.equal(run_whiten(tk, x, none, True, "add", True), torch.zeros(50, device=DEVICE))
    one = none.clone()
    one[17] = True
    assert torch.equal(run_whiten(tk, x, one, True, "add", True), torch.zeros(50, device=DEVICE))
    kept = run_whiten(tk, x, one, True, "add", False)
    assert kept[17] == x[17] and int((kept != 0).sum()) == 1
    const = torch.full((50,), -2.5, device=DEVICE)
    assert torch.equal(run_whiten(tk, const, ~none, True, "add", True), torch.zeros(50, device=DEVICE))
    x[3] = float("nan")  # a masked-out NaN does not leak
    mask = ~none
    mask[3] = False
    assert torch.isfinite(run_whiten(tk, x, mask, True, "add", True)).all()


def test_whiten_large_values_and_determinism(small_tiles):
    g = _gen(7)
    x = (1e6 + torch.randn(1500, generator=g)).to(DEVICE)
    mask = (torch.rand(1500, generator=g) > 0.2).to(DEVICE)
    first = check_whiten(x, mask, True, "add", True)
    assert torch.equal(run_whiten(tk, x, mask, True, "add", True), first)


@pytest.mark.parametrize("shift_mean", [True, False])
@pytest.mark.parametrize("unbiased, eps_mode", [(True, "add"), (False, "clamp")])
@pytest.mark.parametrize("tiles, n", [("default", 37), ("small", 150)])
def test_whiten_huge_spread(monkeypatch, tiles, n, unbiased, eps_mode, shift_mean):
    """Squares of 1e20 and sums of values near 3e38 overflowed fp32 (output 0 or NaN); the partials of
    small tiles carry different power-of-two scales (blocks of ordinary values next to huge ones)."""
    _use_tiles(monkeypatch, tiles)
    g = _gen(15)
    x = torch.randn(n, generator=g) * 3
    x[n // 3 : n // 3 + 5] = torch.tensor([1e20, -1e20, 3e19, 2e38, 3e38])
    x[-4:] = torch.tensor([3e38, 3e38, -1e38, 3e38])
    mask = torch.rand(n, generator=g) > 0.3
    mask[n // 3 : n // 3 + 5] = True
    mask[-4:] = True
    x[~mask] = math.nan
    got = check_whiten(x.to(DEVICE), mask.to(DEVICE), unbiased, eps_mode, shift_mean)
    assert bool(torch.isfinite(got).all())


def test_whiten_equal_huge_values(small_tiles):
    """Equal entries near the fp32 maximum: eps * 2^-2k underflows to 0, the output is still 0 (or mu)."""
    x = torch.full((40,), 3e38, device=DEVICE)
    mask = torch.ones(40, dtype=torch.bool, device=DEVICE)
    mask[7] = False
    for eps_mode in abi.EPS_MODES:
        assert torch.equal(run_whiten(tk, x, mask, True, eps_mode, True), torch.zeros(40, device=DEVICE))
        assert torch.equal(run_whiten(tk, x, mask, True, eps_mode, False), torch.where(mask, x, 0.0))


@pytest.mark.parametrize("fill", [math.nan, math.inf, -math.inf])
def test_whiten_masked_garbage_does_not_leak(small_tiles, fill):
    g = _gen(16)
    x = (torch.randn(100, generator=g) * 2 + 3).to(DEVICE)
    mask = (torch.rand(100, generator=g) > 0.3).to(DEVICE)
    mask[16:32] = False  # a whole partial of masked-out entries
    for unbiased, eps_mode, shift_mean in ((True, "add", True), (False, "clamp", False)):
        want = run_whiten(tk, torch.where(mask, x, 0.0), mask, unbiased, eps_mode, shift_mean)
        got = run_whiten(tk, torch.where(mask, x, fill), mask, unbiased, eps_mode, shift_mean)
        assert torch.equal(got, want)


# ----------------------------------------------------------------------------------------------
# discounted_returns and gae
# ----------------------------------------------------------------------------------------------


def row_masks(b: int, t: int, seed: int) -> torch.Tensor:
    """Random masks plus a full row, an empty row, right and left padding."""
    g = _gen(seed)
    mask = torch.rand(b, t, generator=g) > 0.3
    patterns = [
        torch.ones(t, dtype=torch.bool),
        torch.zeros(t, dtype=torch.bool),
        torch.arange(t) < (t * 2) // 3,
        torch.arange(t) >= t // 4,
    ]
    for i, p in enumerate(patterns[:b]):
        mask[i] = p
    return mask.to(DEVICE)


def run_returns(impl, rewards, mask, gamma, mode):
    """Both backends get the op layer's constant: gamma rounded to float32 (the kernels' inputs)."""
    out = torch.empty_like(rewards)
    impl.discounted_returns_fwd(rewards, mask, abi.recurrence_constants(gamma, 1.0, torch.float32)[0], mode, out)
    return out


def run_gae(impl, rewards, values, mask, gamma, lam):
    adv, ret = torch.empty_like(rewards), torch.empty_like(rewards)
    impl.gae_fwd(rewards, values, mask, *abi.recurrence_constants(gamma, lam, torch.float32), adv, ret)
    return adv, ret


def check_returns(rewards, mask, gamma, mode):
    got = run_returns(tk, rewards, mask, gamma, mode)
    truth = run_returns(ref, rewards.double(), mask, gamma, mode)
    return got, _check("discounted_returns", mode, got, truth, ref.returns_contract_scale(rewards, mask, gamma, mode))


def check_gae(rewards, values, mask, gamma, lam):
    adv, ret = run_gae(tk, rewards, values, mask, gamma, lam)
    adv_truth, ret_truth = run_gae(ref, rewards.double(), values.double(), mask, gamma, lam)
    scale_adv, scale_ret = ref.gae_contract_scale(rewards, values, mask, gamma, gamma * lam)
    r1 = _check("gae", "advantages", adv, adv_truth, scale_adv)
    r2 = _check("gae", "returns", ret, ret_truth, scale_ret)
    return adv, ret, max(r1, r2)


# (tiles, (B, T)): one chunk, several chunks with a ragged last one, T = 1. The default tiles: T = 1, and the four
# mask patterns of row_masks (full, empty, right and left padding) over two chunks of 1024 with a ragged last one
# (the interpreter's scan costs one Python step per lane of BLOCK_T: 8 row-chunks, where (6, 37) and (2, 2500)
# took 12); one-chunk rows, random masks and middle chunks are the small tiles' cases.
SCAN_CASES = [
    ("default", (1, 1)),
    ("default", (4, 1100)),
    ("small", (5, 7)),
    ("small", (6, 37)),
    ("small", (3, 150)),
]


@pytest.mark.parametrize("gamma", [1.0, 0.99])
@pytest.mark.parametrize("mode", abi.RETURN_MASK_MODES)
@pytest.mark.parametrize("tiles, shape", SCAN_CASES)
def test_returns_match_reference(monkeypatch, tiles, shape, mode, gamma):
    _use_tiles(monkeypatch, tiles)
    b, t = shape
    rewards = torch.randn(b, t, generator=_gen(b * t)).to(DEVICE)
    mask = row_masks(b, t, b * t)
    got, _ = check_returns(rewards, mask, gamma, mode)
    if b > 1 and mode == "carry":
        assert torch.all(got[1] == 0)  # an empty row


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95), (0.0, 0.5), (1.0, 0.0)])
@pytest.mark.parametrize("tiles, shape", SCAN_CASES)
def test_gae_matches_reference(monkeypatch, tiles, shape, gamma, lam):
    _use_tiles(monkeypatch, tiles)
    b, t = shape
    g = _gen(b + t)
    rewards = torch.randn(b, t, generator=g).to(DEVICE)
    values = (torch.randn(b, t, generator=g) * 3).to(DEVICE)
    mask = row_masks(b, t, b + t)
    adv, ret, _ = check_gae(rewards, values, mask, gamma, lam)
    if b > 1:
        assert torch.all(adv[1] == 0) and torch.equal(ret[1], values[1])


def test_scans_large_values(small_tiles):
    g = _gen(8)
    rewards = (torch.randn(3, 300, generator=g) * 1e4).to(DEVICE)
    values = (1e5 + torch.randn(3, 300, generator=g) * 10).to(DEVICE)
    mask = row_masks(3, 300, 8)
    for mode in abi.RETURN_MASK_MODES:
        check_returns(rewards, mask, 0.99, mode)
    check_gae(rewards, values, mask, 0.99, 0.95)


def test_returns_reset_nan_example():
    """A NaN reward at a masked position made every position to its left NaN (0 * NaN in the scan)."""
    rewards = torch.tensor([[1.0, 2.0, math.nan, 3.0, 4.0]], device=DEVICE)
    mask = torch.tensor([[1, 1, 0, 1, 1]], dtype=torch.bool, device=DEVICE)
    with rlk.use_backend("triton"):
        got = rlk.discounted_returns(rewards, mask, gamma=0.9, mask_mode="reset")
        want = rlk.discounted_returns(torch.nan_to_num(rewards), mask, gamma=0.9, mask_mode="reset")
    assert torch.equal(got[mask], want[mask]) and bool(torch.isnan(got[0, 2]))
    truth = run_returns(ref, torch.nan_to_num(rewards).double(), mask, 0.9, "reset")
    _check(
        "discounted_returns",
        "reset",
        got[mask],
        truth[mask],
        ref.returns_contract_scale(torch.nan_to_num(rewards), mask, 0.9, "reset")[mask],
    )


def _garbage_mask(b: int, t: int, seed: int) -> torch.Tensor:
    """row_masks plus masked positions at chunk starts and ends of the small and the default BLOCK_T
    (8 and 1024), where a state is carried from one chunk to the next."""
    mask = row_masks(b, t, seed)
    mask[0, [p for p in (0, 7, 8, 15, 16, 17, 24, 1023, 1024, 1025, 2047, 2048) if p < t]] = False
    return mask


# The interpreter's scan costs about BLOCK_T per chunk: the default BLOCK_T runs on the GPU only here.
@pytest.mark.parametrize("fill", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize(
    "tiles, shape", [("small", (6, 37)), ("small", (2, 70)), pytest.param("default", (6, 2100), marks=pytest.mark.gpu)]
)
def test_scans_masked_garbage_does_not_leak(monkeypatch, tiles, shape, fill):
    """NaN / inf rewards and values at masked positions: every mode's returns and GAE's advantages at
    the unmasked positions are bitwise those with 0 there; carry, zero and the advantages do not read
    a masked reward at all (their masked positions match too); reset and the returns of GAE put it
    in their own masked position's output, as the reference does."""
    _use_tiles(monkeypatch, tiles)
    b, t = shape
    g = _gen(17)
    rewards = torch.randn(b, t, generator=g).to(DEVICE)
    values = torch.randn(b, t, generator=g).to(DEVICE)
    mask = _garbage_mask(b, t, 18)
    clean_r, clean_v = torch.where(mask, rewards, 0.0), torch.where(mask, values, 0.0)
    dirty_r, dirty_v = torch.where(mask, rewards, fill), torch.where(mask, values, fill)
    for mode in abi.RETURN_MASK_MODES:
        want = run_returns(tk, clean_r, mask, 0.99, mode)
        got = run_returns(tk, dirty_r, mask, 0.99, mode)
        assert torch.equal(got[mask], want[mask]), mode
        if mode == "reset":
            expected = run_returns(ref, dirty_r, mask, 0.99, mode)
            assert torch.equal(got[~mask].isnan(), expected[~mask].isnan())
            assert torch.equal(got[~mask].isinf(), expected[~mask].isinf())
        else:
            assert torch.equal(got, want), mode
    clean_adv, clean_ret = run_gae(tk, clean_r, clean_v, mask, 0.99, 0.95)
    adv, ret = run_gae(tk, dirty_r, clean_v, mask, 0.99, 0.95)
    assert torch.equal(adv, clean_adv) and torch.equal(ret, clean_ret)
    adv, ret = run_gae(tk, dirty_r, dirty_v, mask, 0.99, 0.95)
    assert torch.equal(adv, clean_adv) and torch.equal(ret[mask], clean_ret[mask])
    assert not bool(torch.isfinite(ret[~mask]).any())


def _scan_outputs(rewards, values, mask):
    """Every scan output of the kernels for one batch: returns in each mode (two gammas) and GAE."""
    outs = [run_returns(tk, rewards, mask, gamma, mode) for mode in abi.RETURN_MASK_MODES for gamma in (1.0, 0.99)]
    return outs + list(run_gae(tk, rewards, values, mask, 0.99, 0.95))


# The interpreter's scan costs about BLOCK_T per chunk: the default BLOCK_T runs on the GPU only.
@pytest.mark.parametrize("block_t", [8, 32, pytest.param(None, marks=pytest.mark.gpu)])
def test_scan_batch_invariance(monkeypatch, block_t):
    """A row's returns and GAE outputs alone equal, bit for bit, the same row at any position in
    batches of several sizes, and the same row with extra trailing padding (mask 0, reward 0)."""
    if block_t is not None:
        monkeypatch.setitem(tk.TILE_CONFIGS, "scan", {"BLOCK_T": block_t, "num_warps": 1})
    t = 45
    g = _gen(9)
    p_r, p_v = torch.randn(1, t, generator=g).to(DEVICE), torch.randn(1, t, generator=g).to(DEVICE)
    p_m = row_masks(1, t, 10)
    p_m[0, 5:9] = False  # an interior gap
    p_m[0, -3:] = False
    p_r = p_r * p_m
    alone = _scan_outputs(p_r, p_v, p_m)
    for n in (2, 7):
        rewards = torch.randn(n, t, generator=g).to(DEVICE) * 100
        values = torch.randn(n, t, generator=g).to(DEVICE)
        mask = row_masks(n, t, n)
        for pos in sorted({0, n // 2, n - 1}):
            r, v, m = rewards.clone(), values.clone(), mask.clone()
            r[pos], v[pos], m[pos] = p_r[0], p_v[0], p_m[0]
            for got, want in zip(_scan_outputs(r, v, m), alone):
                assert torch.equal(got[pos : pos + 1], want), (n, pos)
    pad = 70
    padded = [torch.cat([x, torch.zeros(1, pad, dtype=x.dtype, device=DEVICE)], 1) for x in (p_r, p_v, p_m)]
    for got, want in zip(_scan_outputs(*padded), alone):
        assert torch.equal(got[:, :t], want)


# ----------------------------------------------------------------------------------------------
# the public ops on the triton backend
# ----------------------------------------------------------------------------------------------


def test_public_ops_run_the_triton_primitives(small_tiles):
    g = _gen(11)
    scores, ids, lengths = group_inputs([3, 1, 4, 6], seed=11)
    rewards = torch.randn(4, 30, generator=g).to(DEVICE)
    values = torch.randn(4, 30, generator=g).to(DEVICE)
    mask = row_masks(4, 30, 11)
    with rlk.use_backend("triton"):
        for mode in abi.GROUP_MODES:
            lens = lengths if mode == "opo" else None
            assert torch.equal(
                rlk.group_advantages(scores, group_index=ids, mode=mode, lengths=lens),
                run_group(tk, scores, ids, 0, lengths, mode),
            )
        assert torch.equal(
            rlk.masked_whiten(rewards, mask.float(), unbiased=False),
            run_whiten(tk, rewards.reshape(-1), mask.reshape(-1), False, "add", True).view(4, 30),
        )
        assert torch.equal(
            rlk.discounted_returns(rewards, mask, 0.9, mask_mode="reset"), run_returns(tk, rewards, mask, 0.9, "reset")
        )
        for a, b in zip(
            rlk.gae(rewards.bfloat16(), values, mask, gamma=0.99, lam=0.95),
            run_gae(tk, rewards.bfloat16().float(), values, mask, 0.99, 0.95),
        ):
            assert torch.equal(a, b)


def test_tile_configs_are_powers_of_two():
    for cfg in tk.TILE_CONFIGS.values():
        for key, value in cfg.items():
            if key.startswith(("BLOCK", "COMBINE")):
                assert value & (value - 1) == 0, (key, value)


# ----------------------------------------------------------------------------------------------
# GPU only: realistic shapes
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_realistic_shapes_gpu():
    g = _gen(12)
    b, t = 512, 8192
    rewards = (torch.randn(b, t, generator=g) * 0.1).to(DEVICE)
    values = torch.randn(b, t, generator=g).to(DEVICE)
    mask = row_masks(b, t, 12)
    for mode in abi.RETURN_MASK_MODES:
        check_returns(rewards, mask, 0.99, mode)
    check_gae(rewards, values, mask, 0.99, 0.95)
    check_gae(rewards, values, mask, 1.0, 1.0)
    check_whiten(rewards.reshape(-1), mask.reshape(-1), True, "add", True)
    scores, ids, lengths = group_inputs([16] * 512 + [1, 2, 300], seed=12)
    for mode in abi.GROUP_MODES:
        check_group(scores, ids, 0, lengths, mode)
        check_group(scores[:8192], None, 16, lengths[:8192], mode)


# ----------------------------------------------------------------------------------------------
# Pass@k (grpo_passk, dr_grpo_passk)
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", abi.PASSK_MODES)
def test_passk_matches_reference(tiles, mode):
    scores, ids, lengths = group_inputs([1, 2, 5, 9, 130, 3], seed=8, equal_group=None)
    five = next(g for g in ids.tolist() if int((ids == g).sum()) == 5)
    scores[ids == five] = torch.tensor([1.0, 4.0, 4.0, 0.5, 2.0], device=DEVICE)  # a tie for the top
    got, _ = check_group(scores, ids, 0, lengths, mode)
    assert int((got != 0).sum()) >= 3
    sized, _ = check_group(scores[:140], None, 7, lengths[:140], mode)
    assert int((sized != 0).sum()) >= 10
    huge = torch.tensor(HUGE_SCORES, device=DEVICE)
    check_group(huge, None, 4, torch.ones_like(huge), mode)


@pytest.mark.parametrize("mode", abi.PASSK_MODES)
def test_passk_batch_invariance_and_nan(small_tiles, mode):
    g = _gen(9)
    probe = (torch.randn(9, generator=g) * 4 + 1).to(DEVICE)
    alone = run_group(tk, probe, None, 9, None, mode)
    assert int((alone != 0).sum()) == 1
    for n_other in (1, 6):
        other = (torch.randn(n_other * 9, generator=g) * 10).to(DEVICE)
        for k in sorted({0, n_other}):
            scores = torch.cat([other[: k * 9], probe, other[k * 9 :]])
            assert torch.equal(run_group(tk, scores, None, 9, None, mode)[k * 9 : (k + 1) * 9], alone)
        total = (n_other + 1) * 9
        where = torch.sort(torch.randperm(total, generator=g)[:9]).values.to(DEVICE)
        ids = torch.randint(1, 2 + n_other, (total,), generator=g).to(DEVICE)
        ids[where] = 0
        scores = torch.empty(total, device=DEVICE)
        rest = torch.ones(total, dtype=torch.bool, device=DEVICE)
        rest[where] = False
        scores[where], scores[rest] = probe, other
        assert torch.equal(run_group(tk, scores, ids, 0, None, mode)[where], alone)
    dirty = torch.cat([probe, probe])
    dirty[3] = math.nan
    out = run_group(tk, dirty, None, 9, None, mode)
    assert bool(torch.isnan(out[:9]).all()) and torch.equal(out[9:], alone)
