"""The public advantage ops on the reference backend: the math against independent fp64
re-derivations (plain Python loops written from the formulas of verl, TRL and OpenRLHF with
their defaults), edge cases, bad input, torch.library integration. Tolerances come from the
contract; the re-derivations here do not share code with rlk."""

from __future__ import annotations

import math
import struct
from collections import defaultdict

import pytest
import torch

import rlk
from rlk.core import abi, contract
from rlk.reference import advantages as ref


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _assert_contract(op: str, name: str, value: torch.Tensor, truth: torch.Tensor, scale: torch.Tensor):
    assert value.dtype == torch.float32
    dev = contract.compare_outputs(
        contract.entry(op, torch.float32), name, value.reshape(-1), truth.reshape(-1), scale.reshape(-1)
    )
    assert dev.ok, dev


# ----------------------------------------------------------------------------------------------
# independent re-derivations (fp64 Python floats, loops)
# ----------------------------------------------------------------------------------------------


def _groups(ids: list) -> dict:
    groups = defaultdict(list)
    for i, g in enumerate(ids):
        groups[g].append(i)
    return groups


def _mean(xs):
    return sum(xs) / len(xs)


def _std_unbiased(xs):
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def verl_grpo(scores, ids, eps=1e-6, norm_by_std=True):
    """verl's GRPO outcome advantage: singleton groups take mean 0 and std 1; torch.std is unbiased."""
    out = [0.0] * len(scores)
    for members in _groups(ids).values():
        xs = [scores[i] for i in members]
        mean, std = (0.0, 1.0) if len(xs) == 1 else (_mean(xs), _std_unbiased(xs))
        for i in members:
            out[i] = (scores[i] - mean) / (std + eps) if norm_by_std else scores[i] - mean
    return out


def trl_grpo(scores, group_size, eps=1e-4):
    """TRL's GRPO: rewards viewed [-1, G], unbiased std per group, (r - mean) / (std + 1e-4)."""
    out = []
    for g0 in range(0, len(scores), group_size):
        xs = scores[g0 : g0 + group_size]
        mean, std = _mean(xs), _std_unbiased(xs)
        out += [(x - mean) / (std + eps) for x in xs]
    return out


def rloo(scores, ids):
    """Leave-one-out baseline: the mean of the other members; a singleton keeps its score (verl)."""
    out = [0.0] * len(scores)
    for members in _groups(ids).values():
        for i in members:
            others = [scores[j] for j in members if j != i]
            out[i] = scores[i] - (_mean(others) if others else 0.0)
    return out


def opo(scores, ids, lengths):
    """OPO's optimal baseline: the length-weighted mean score of the group (singleton: 0)."""
    out = [0.0] * len(scores)
    for members in _groups(ids).values():
        if len(members) == 1:
            baseline = 0.0
        elif sum(lengths[i] for i in members) > 0:
            baseline = sum(lengths[i] * scores[i] for i in members) / sum(lengths[i] for i in members)
        else:
            baseline = _mean([scores[i] for i in members])
        for i in members:
            out[i] = scores[i] - baseline
    return out


def gpg(scores, ids):
    """GPG: (s - mean_g) (singleton mean 0) times B / (number of non-zero such advantages)."""
    centred = verl_grpo(scores, ids, norm_by_std=False)
    n_valid = sum(1 for a in centred if a != 0.0)
    return [a * len(scores) / max(n_valid, 1) for a in centred]


def verl_masked_whiten(x, mask, shift_mean=True, eps=1e-8):
    """verl: masked mean, unbiased masked variance (Bessel n / (n - 1)), (x - mu) * rsqrt(var + eps)."""
    vals = [v for v, m in zip(x, mask) if m]
    mu = _mean(vals)
    var = sum((v - mu) ** 2 for v in vals) / len(vals) * len(vals) / (len(vals) - 1)
    out = [(v - mu) / math.sqrt(var + eps) for v in x]
    return [o + mu for o in out] if not shift_mean else out


def openrlhf_normalize(x, mask):
    """OpenRLHF's advantage normalization: biased variance over the action mask, rsqrt(clamp(var, 1e-8))."""
    vals = [v for v, m in zip(x, mask) if m]
    mu = sum(vals) / len(vals)
    var = sum((v - mu) ** 2 for v in vals) / len(vals)
    return [(v - mu) / math.sqrt(max(var, 1e-8)) for v in x]


def f32(x: float) -> float:
    """``x`` rounded to float32: fp32 torch code multiplies by ``f32(gamma)`` and ``f32(gamma * lam)``."""
    return struct.unpack("f", struct.pack("f", x))[0]


def verl_gae(rewards, values, mask, gamma=1.0, lam=1.0):
    """verl's GAE loop for one row: next value and last advantage carried through masked positions.
    Its fp32 tensors multiply by fp32(gamma) and fp32(gamma * lam) (``gamma * lam * lastgaelam``)."""
    next_value, last, adv = 0.0, 0.0, [0.0] * len(rewards)
    gamma, gamma_lam = f32(gamma), f32(gamma * lam)
    for t in reversed(range(len(rewards))):
        delta = rewards[t] + gamma * next_value - values[t]
        candidate = delta + gamma_lam * last
        next_value = values[t] * mask[t] + (1 - mask[t]) * next_value
        last = candidate * mask[t] + (1 - mask[t]) * last
        adv[t] = last
    return adv, [a + v for a, v in zip(adv, values)]


def openrlhf_gae(rewards, values, mask, gamma=1.0, lambd=0.95):
    """OpenRLHF's GAE for one row: rewards and values zeroed where masked, next value = values[t + 1]."""
    r = [x * m for x, m in zip(rewards, mask)]
    v = [x * m for x, m in zip(values, mask)]
    last, adv = 0.0, [0.0] * len(r)
    gamma, gamma_lambd = f32(gamma), f32(gamma * lambd)
    for t in reversed(range(len(r))):
        next_value = v[t + 1] if t + 1 < len(r) else 0.0
        last = r[t] + gamma * next_value - v[t] + gamma_lambd * last
        adv[t] = last
    return adv, [a + x for a, x in zip(adv, v)]


def returns_loop(rewards, mask, gamma, mode):
    """Discounted returns of one row: carry (skip masked), verl (reset after masked), OpenRLHF (zero)."""
    g, out, gamma = 0.0, [0.0] * len(rewards), f32(gamma)
    for t in reversed(range(len(rewards))):
        if mode == "carry":
            if mask[t]:
                g = rewards[t] + gamma * g
            out[t] = g
        elif mode == "reset":  # verl REINFORCE++: running = r + gamma * running; out = running; running *= m
            g = rewards[t] + gamma * g
            out[t] = g
            g = g * mask[t]
        else:  # OpenRLHF get_cumulative_returns: rewards *= mask, then a plain discounted cumsum
            g = rewards[t] * mask[t] + gamma * g
            out[t] = g
    return out


# ----------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------


def _group_case(seed=0, n_groups=7, max_size=6):
    """Unsorted group ids with groups of 1..max_size members (one singleton), float scores."""
    g = _gen(seed)
    sizes = torch.randint(2, max_size + 1, (n_groups,), generator=g)
    sizes[3] = 1
    ids = torch.repeat_interleave(torch.arange(n_groups) * 10 + 3, sizes)
    ids = ids[torch.randperm(ids.numel(), generator=g)]
    scores = torch.randn(ids.numel(), generator=g) * 2 + 0.5
    scores[ids == ids[0]] = 1.0  # one group of equal scores (advantage exactly 0)
    return scores, ids


def _row_masks(b, t, seed):
    """Masks with every pattern: right padding, left padding, interior gaps (multi-turn), empty, full."""
    g = _gen(seed)
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[0] = True
    if b > 1:
        mask[1] = False
    if b > 2:
        mask[2] = torch.arange(t) < t * 2 // 3
    if b > 3:
        mask[3] = torch.arange(t) >= t // 4
    return mask


def _group_truth(mode, scores, ids, lengths=None, eps=1e-6):
    s, i = scores.double().tolist(), ids.tolist()
    if mode == "grpo":
        return torch.tensor(verl_grpo(s, i, eps), dtype=torch.float64)
    if mode in ("dr_grpo", "reinforce_pp_baseline"):
        return torch.tensor(verl_grpo(s, i, norm_by_std=False), dtype=torch.float64)
    if mode == "rloo":
        return torch.tensor(rloo(s, i), dtype=torch.float64)
    if mode == "opo":
        return torch.tensor(opo(s, i, lengths.double().tolist()), dtype=torch.float64)
    return torch.tensor(gpg(s, i), dtype=torch.float64)


# ----------------------------------------------------------------------------------------------
# group_advantages
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", abi.GROUP_MODES)
def test_group_advantages_match_rederivation(mode):
    scores, ids = _group_case()
    lengths = torch.randint(0, 50, ids.shape, generator=_gen(1)) if mode == "opo" else None
    adv = rlk.group_advantages(scores, group_index=ids, mode=mode, lengths=lengths)
    assert adv.shape == scores.shape and adv.dtype == torch.float32
    truth = _group_truth(mode, scores, ids, lengths)
    _assert_contract("group_advantages", mode, adv, truth, ref.group_contract_scale(truth, ids, 0))
    assert torch.all(adv[ids == ids[0]] == 0)  # equal scores: exactly 0
    single = ids == ids[(ids.unsqueeze(1) == ids).sum(1) == 1][0]
    expected_single = scores[single] / (1 + 1e-6) if mode == "grpo" else scores[single]
    if mode == "gpg":
        expected_single = expected_single * truth[single].double() / scores[single].double()
    torch.testing.assert_close(adv[single].double(), expected_single.double(), rtol=1e-6, atol=0)


def test_trl_grpo_with_group_size_and_eps_1e_4():
    scores = torch.randn(24, generator=_gen(2))
    adv = rlk.group_advantages(scores, group_size=6, eps=1e-4)
    truth = torch.tensor(trl_grpo(scores.double().tolist(), 6), dtype=torch.float64)
    _assert_contract("group_advantages", "grpo", adv, truth, ref.group_contract_scale(truth, None, 6))


def openrlhf_group_norm(scores, group_size, eps=1e-9):
    """OpenRLHF's ``group_norm`` (GRPO): rewards viewed [-1, n], (r - mean) / (unbiased std + 1e-9)."""
    return trl_grpo(scores, group_size, eps)


def openrlhf_rloo(scores, group_size):
    """OpenRLHF's ``rloo``: baseline (sum - r) / (n - 1) per group."""
    out = []
    for g0 in range(0, len(scores), group_size):
        xs = scores[g0 : g0 + group_size]
        out += [x - (sum(xs) - x) / (group_size - 1) for x in xs]
    return out


def test_openrlhf_group_norm_and_rloo():
    scores = torch.randn(32, generator=_gen(20)) * 0.5 + 0.5
    adv = rlk.group_advantages(scores, group_size=8, eps=1e-9)
    truth = torch.tensor(openrlhf_group_norm(scores.double().tolist(), 8), dtype=torch.float64)
    _assert_contract("group_advantages", "grpo", adv, truth, ref.group_contract_scale(truth, None, 8))
    adv = rlk.group_advantages(scores, group_size=8, mode="rloo")
    truth = torch.tensor(openrlhf_rloo(scores.double().tolist(), 8), dtype=torch.float64)
    _assert_contract("group_advantages", "rloo", adv, truth, ref.group_contract_scale(truth, None, 8))


def test_group_size_and_sorted_group_index_agree_bitwise():
    scores = torch.randn(30, generator=_gen(3))
    for mode in ("grpo", "rloo", "dr_grpo"):
        by_size = rlk.group_advantages(scores, group_size=5, mode=mode)
        by_index = rlk.group_advantages(scores, group_index=torch.arange(30) // 5 * 7, mode=mode)
        assert torch.equal(by_size, by_index)


def test_opo_zero_lengths_fall_back_to_the_mean():
    scores = torch.tensor([1.0, 2.0, 4.0, 3.0, 5.0])
    ids = torch.tensor([0, 0, 0, 1, 1])
    lengths = torch.tensor([0, 0, 0, 2, 6])
    adv = rlk.group_advantages(scores, group_index=ids, mode="opo", lengths=lengths)
    expected = torch.tensor([1 - 7 / 3, 2 - 7 / 3, 4 - 7 / 3, 3 - 4.5, 5 - 4.5])
    torch.testing.assert_close(adv, expected, rtol=0, atol=1e-6)


def test_all_equal_scores_give_exact_zero_where_naive_mean_does_not():
    scores = torch.full((21,), 0.1)
    naive = scores.view(3, 7) - scores.view(3, 7).sum(1, keepdim=True) / 7
    assert bool((naive != 0).any())  # the naive fp32 mean is not exact: the pivot matters
    for mode in abi.GROUP_MODES:
        lengths = torch.arange(21) if mode == "opo" else None
        assert torch.all(rlk.group_advantages(scores, group_size=7, mode=mode, lengths=lengths) == 0)


def test_large_scores_with_a_small_spread():
    """1e6 + small spread: fp32 E[s^2] - E[s]^2 would be noise; the pivoted two-pass is accurate."""
    g = _gen(4)
    scores = 1e6 + torch.randint(0, 4, (32,), generator=g).float()
    var_naive = (scores * scores).view(4, 8).mean(1) - scores.view(4, 8).mean(1) ** 2
    var_true = scores.double().view(4, 8).var(1, unbiased=False)
    assert float((var_naive.double() - var_true).abs().max()) > 0.5  # the naive formula fails here
    for mode in ("grpo", "rloo", "dr_grpo"):
        adv = rlk.group_advantages(scores, group_size=8, mode=mode)
        truth = _group_truth(mode, scores, torch.arange(32) // 8)
        _assert_contract("group_advantages", mode, adv, truth, ref.group_contract_scale(truth, None, 8))


# Spreads whose squares (or whose differences) overflow fp32, and the rloo / gpg values of each
# stay representable: group 0 is the 1e20 example, group 1 spans +-3e38, group 2 is equal scores
# near the fp32 maximum, group 3 an ordinary group next to them, and a huge singleton.
HUGE_SCORES = [0.0, 1e20, -1e20, 3e19, 3e38, -3e38, 1e38, 0.0, 3e38, 3e38, 3e38, 3e38, 0.5, -1.0, 2.0, 0.25]
HUGE_IDS = [0] * 4 + [1] * 4 + [2] * 4 + [3] * 4
HUGE_SCORES_RLOO = [0.0, 1e20, -1e20, 3e19, 1e38, -1e38, 5e37, 0.0, 3e38, 3e38, 3e38, 3e38, 0.5, -1.0, 2.0, 0.25]
HUGE_LENGTHS = [3.0, 1.0, 0.0, 7.0, 2.0, 2.0, 1.0, 1.0, 3.0, 1.0, 0.0, 7.0, 3.0, 1.0, 0.0, 7.0]


@pytest.mark.parametrize("mode", abi.GROUP_MODES)
def test_group_advantages_with_a_huge_spread(mode):
    """The variance of a spread above ~1e19 overflows fp32 (it returned 0, or NaN at +-3e38); the
    scores are scaled by a power of two first, so the advantages match fp64."""
    scores = torch.tensor(HUGE_SCORES_RLOO if mode in ("rloo", "gpg") else HUGE_SCORES)
    ids = torch.tensor(HUGE_IDS)
    lengths = torch.tensor(HUGE_LENGTHS) if mode == "opo" else None
    by_size = rlk.group_advantages(scores, group_size=4, mode=mode, lengths=lengths)
    truth = _group_truth(mode, scores, ids, lengths)
    assert float(truth.abs().max()) < torch.finfo(torch.float32).max  # representable advantages
    _assert_contract("group_advantages", mode, by_size, truth, ref.group_contract_scale(truth, None, 4))
    assert torch.all(by_size[8:12] == 0)  # equal scores of 3e38: exactly 0
    assert torch.equal(rlk.group_advantages(scores, group_index=ids * 3, mode=mode, lengths=lengths), by_size)
    single = rlk.group_advantages(
        torch.tensor([3e38, 1.0]),
        group_index=torch.tensor([0, 1]),
        mode=mode,
        lengths=torch.ones(2) if mode == "opo" else None,
    )
    if mode != "gpg":
        expected = torch.tensor([3e38, 1.0]) / torch.full((2,), 1 + 1e-6) if mode == "grpo" else torch.tensor([3e38, 1])
        assert torch.equal(single, expected)


def test_group_advantages_the_1e20_example():
    adv = rlk.group_advantages(torch.tensor([0.0, 1e20, -1e20, 3e19]), group_size=4, mode="grpo")
    s = torch.tensor([0.0, 1e20, -1e20, 3e19], dtype=torch.float64)
    truth = (s - s.mean()) / (s.std() + 1e-6)
    _assert_contract("group_advantages", "grpo", adv, truth, ref.group_contract_scale(truth, None, 4))


@pytest.mark.parametrize("fill", [math.nan, math.inf, -math.inf])
@pytest.mark.parametrize("mode", abi.GROUP_MODES)
def test_group_advantages_non_finite_scores_stay_in_their_group(monkeypatch, mode, fill):
    """Every row is in a group; a NaN / inf score (or, unchecked, OPO length) changes its own group
    only: the other groups are bitwise those of the same call with finite values there (distinct
    values, so that gpg's count of non-zero advantages, where NaN counts, is the same)."""
    scores, ids = _group_case(seed=21)
    lengths = torch.randint(1, 50, ids.shape, generator=_gen(22)).float() if mode == "opo" else None
    bad = ids == torch.mode(ids).values  # a group of several members
    assert int(bad.sum()) > 2
    finite = rlk.group_advantages(scores, group_index=ids, mode=mode, lengths=lengths)
    dirty = scores.clone()
    dirty[bad] = fill
    dirty[bad.nonzero()[-1]] = 1.5  # a group of a non-finite score and finite ones
    got = rlk.group_advantages(dirty, group_index=ids, mode=mode, lengths=lengths)
    assert torch.equal(got[~bad], finite[~bad])
    assert not bool(torch.isfinite(got[bad]).all())
    if mode == "opo":
        monkeypatch.setenv("RLK_CHECK_VALUES", "0")
        dirty_len = lengths.clone()
        dirty_len[bad] = fill
        got = rlk.group_advantages(scores, group_index=ids, mode=mode, lengths=dirty_len)
        assert torch.equal(got[~bad], finite[~bad])


def test_reinforce_pp_baseline_then_whiten_matches_verl():
    scores, ids = _group_case(seed=5)
    b, t = scores.shape[0], 9
    mask = _row_masks(b, t, 5)
    mask[1] = True  # verl needs at least two masked tokens overall; keep every row non-empty
    adv = rlk.group_advantages(scores, group_index=ids, mode="reinforce_pp_baseline")
    tokens = rlk.masked_whiten(adv[:, None].expand(b, t), mask)
    centred = verl_grpo(scores.double().tolist(), ids.tolist(), norm_by_std=False)
    flat_mask = mask.reshape(-1).tolist()
    tiled = [centred[i] * mask[i, j].item() for i in range(b) for j in range(t)]
    truth = torch.tensor(verl_masked_whiten(tiled, flat_mask), dtype=torch.float64).view(b, t) * mask
    scale = ref.whiten_contract_scale(torch.tensor(tiled).view(b, t), mask, True, 1e-8, "add", truth)
    _assert_contract("masked_whiten", "tokens", tokens, truth, scale)


# ----------------------------------------------------------------------------------------------
# masked_whiten
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shift_mean", [True, False])
def test_masked_whiten_matches_verl(shift_mean):
    x = torch.randn(6, 11, generator=_gen(6)) * 3 + 40
    mask = _row_masks(6, 11, 6)
    out = rlk.masked_whiten(x, mask, shift_mean=shift_mean)
    truth = torch.tensor(
        verl_masked_whiten(x.double().reshape(-1).tolist(), mask.reshape(-1).tolist(), shift_mean), dtype=torch.float64
    ).view(6, 11)
    truth = torch.where(mask, truth, 0.0)
    scale = ref.whiten_contract_scale(x, mask, True, 1e-8, "add", truth)
    _assert_contract("masked_whiten", "white", out, truth, scale)
    assert torch.all(out[~mask] == 0)


def test_masked_whiten_matches_openrlhf():
    x = torch.randn(5, 13, generator=_gen(7)) * 0.5 - 3
    mask = _row_masks(5, 13, 7)
    out = rlk.masked_whiten(x, mask, unbiased=False, eps_mode="clamp")
    truth = torch.tensor(
        openrlhf_normalize(x.double().reshape(-1).tolist(), mask.reshape(-1).tolist()), dtype=torch.float64
    ).view(5, 13)
    truth = torch.where(mask, truth, 0.0)
    scale = ref.whiten_contract_scale(x, mask, False, 1e-8, "clamp", truth)
    _assert_contract("masked_whiten", "white", out, truth, scale)


def test_masked_whiten_edge_cases():
    x = torch.randn(3, 4, generator=_gen(8))
    empty = rlk.masked_whiten(x, torch.zeros(3, 4, dtype=torch.bool))
    assert torch.equal(empty, torch.zeros(3, 4))
    one = torch.zeros(3, 4, dtype=torch.bool)
    one[1, 2] = True
    assert torch.equal(rlk.masked_whiten(x, one), torch.zeros(3, 4))
    kept = rlk.masked_whiten(x, one, shift_mean=False)
    assert kept[1, 2] == x[1, 2] and int((kept != 0).sum()) == 1
    const = rlk.masked_whiten(torch.full((2, 5), 7.0), torch.ones(2, 5, dtype=torch.bool))
    assert torch.equal(const, torch.zeros(2, 5))
    assert rlk.masked_whiten(torch.zeros(0, 3), torch.zeros(0, 3)).shape == (0, 3)
    # NaN in a masked-out entry does not leak
    x[0, 0] = math.nan
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[0, 0] = False
    assert torch.isfinite(rlk.masked_whiten(x, mask)).all()


def test_masked_whiten_large_values():
    x = 1e6 + torch.randn(4, 50, generator=_gen(9))
    mask = _row_masks(4, 50, 9)
    out = rlk.masked_whiten(x, mask)
    centered, _, rstd, _ = ref._whiten_stats(x.double(), mask, True, 1e-8, "add")
    truth = torch.where(mask, centered * rstd, 0.0)
    _assert_contract("masked_whiten", "white", out, truth, ref.whiten_contract_scale(x, mask, True, 1e-8, "add", truth))


@pytest.mark.parametrize(
    "unbiased, eps_mode, shift_mean", [(True, "add", True), (False, "clamp", True), (True, "add", False)]
)
def test_masked_whiten_huge_spread(unbiased, eps_mode, shift_mean):
    """Squares of 1e20 (and sums of values near 3e38) overflow fp32: the statistics are computed on
    values scaled by a power of two, and the output matches fp64."""
    x = torch.tensor([[1e20, -1e20, 3e19, 5.0, 7.0, -2.0], [3e38, 2e38, -1e38, 3e38, 0.0, math.nan]])
    mask = torch.tensor([[1, 1, 1, 1, 0, 1], [1, 1, 1, 1, 1, 0]], dtype=torch.bool)
    for rows in ([0], [1], [0, 1]):
        xs, ms = x[rows], mask[rows]
        out = rlk.masked_whiten(xs, ms, unbiased=unbiased, eps_mode=eps_mode, shift_mean=shift_mean)
        flat_x, flat_m = torch.where(ms, xs, 0.0).double().reshape(-1).tolist(), ms.reshape(-1).tolist()
        if unbiased:
            truth = verl_masked_whiten(flat_x, flat_m, shift_mean)
        else:
            truth = openrlhf_normalize(flat_x, flat_m)
        truth = torch.where(ms, torch.tensor(truth, dtype=torch.float64).view(ms.shape), 0.0)
        assert bool(torch.isfinite(truth).all())
        scale = ref.whiten_contract_scale(xs, ms, unbiased, 1e-8, eps_mode, truth)
        _assert_contract("masked_whiten", "white", out, truth, scale)


def test_masked_whiten_equal_huge_values():
    """Equal entries near the fp32 maximum: the scaled eps underflows, the output is still 0 (or mu)."""
    x = torch.full((3, 4), 3e38)
    mask = torch.ones(3, 4, dtype=torch.bool)
    mask[0, 0] = False
    for eps_mode in abi.EPS_MODES:
        assert torch.equal(rlk.masked_whiten(x, mask, eps_mode=eps_mode), torch.zeros(3, 4))
        assert torch.equal(rlk.masked_whiten(x, mask, eps_mode=eps_mode, shift_mean=False), torch.where(mask, x, 0.0))


GARBAGE = [math.nan, math.inf, -math.inf]


@pytest.mark.parametrize("fill", GARBAGE)
def test_masked_whiten_masked_garbage_does_not_leak(fill):
    x = torch.randn(5, 9, generator=_gen(23)) * 3 + 1
    mask = _row_masks(5, 9, 23)
    dirty = torch.where(mask, x, fill)
    for unbiased, eps_mode, shift_mean in ((True, "add", True), (False, "clamp", False)):
        want = rlk.masked_whiten(
            torch.where(mask, x, 0.0), mask, unbiased=unbiased, eps_mode=eps_mode, shift_mean=shift_mean
        )
        got = rlk.masked_whiten(dirty, mask, unbiased=unbiased, eps_mode=eps_mode, shift_mean=shift_mean)
        assert torch.equal(got, want)  # masked-out entries are 0 in both


# ----------------------------------------------------------------------------------------------
# discounted_returns and gae
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fill", GARBAGE)
@pytest.mark.parametrize("mask_mode", abi.RETURN_MASK_MODES)
def test_discounted_returns_masked_garbage_does_not_leak(mask_mode, fill):
    """NaN / inf rewards at masked positions: the unmasked returns are bitwise those with 0 there;
    carry and zero do not read a masked reward at all, reset puts it in its own position's output."""
    rewards = torch.randn(6, 17, generator=_gen(24))
    mask = _row_masks(6, 17, 24)
    mask[0, 5:8] = False  # an interior gap
    want = rlk.discounted_returns(torch.where(mask, rewards, 0.0), mask, 0.9, mask_mode=mask_mode)
    got = rlk.discounted_returns(torch.where(mask, rewards, fill), mask, 0.9, mask_mode=mask_mode)
    assert torch.equal(got[mask], want[mask])
    if mask_mode == "reset":
        assert not bool(torch.isfinite(got[~mask]).any())
    else:
        assert torch.equal(got, want)


@pytest.mark.parametrize("fill", GARBAGE)
def test_gae_masked_garbage_does_not_leak(fill):
    """NaN / inf rewards and values at masked positions: the advantages (all of them) and the unmasked
    returns are bitwise those with 0 there; a masked return is a + V_t, as documented."""
    g = _gen(25)
    rewards, values = torch.randn(6, 19, generator=g), torch.randn(6, 19, generator=g) * 2
    mask = _row_masks(6, 19, 25)
    clean_r, clean_v = torch.where(mask, rewards, 0.0), torch.where(mask, values, 0.0)
    clean_adv, clean_ret = rlk.gae(clean_r, clean_v, mask, gamma=0.99, lam=0.95)
    dirty_r, dirty_v = torch.where(mask, rewards, fill), torch.where(mask, values, fill)
    adv, ret = rlk.gae(dirty_r, clean_v, mask, gamma=0.99, lam=0.95)
    assert torch.equal(adv, clean_adv) and torch.equal(ret, clean_ret)  # a masked reward is never read
    for r in (clean_r, dirty_r):
        adv, ret = rlk.gae(r, dirty_v, mask, gamma=0.99, lam=0.95)
        assert torch.equal(adv, clean_adv) and torch.equal(ret[mask], clean_ret[mask])
        assert not bool(torch.isfinite(ret[~mask]).any())


@pytest.mark.parametrize("gamma", [1.0, 0.99])
@pytest.mark.parametrize("mask_mode", abi.RETURN_MASK_MODES)
def test_discounted_returns_match_rederivation(mask_mode, gamma):
    rewards = torch.randn(6, 17, generator=_gen(10))
    mask = _row_masks(6, 17, 10)
    out = rlk.discounted_returns(rewards, mask, gamma, mask_mode=mask_mode)
    truth = torch.tensor(
        [returns_loop(r, m, gamma, mask_mode) for r, m in zip(rewards.double().tolist(), mask.double().tolist())],
        dtype=torch.float64,
    )
    _assert_contract(
        "discounted_returns", mask_mode, out, truth, ref.returns_contract_scale(rewards, mask, f32(gamma), mask_mode)
    )


def test_return_modes_agree_on_right_padded_rows():
    rewards = torch.randn(4, 12, generator=_gen(11))
    mask = torch.arange(12) < torch.tensor([[12], [7], [1], [0]])
    rewards = rewards * mask
    outs = [rlk.discounted_returns(rewards, mask, 0.99, mask_mode=m) for m in abi.RETURN_MASK_MODES]
    for other in outs[1:]:
        torch.testing.assert_close(other, outs[0], rtol=0, atol=0)
    assert torch.all(outs[0][3] == 0)  # an empty row: no NaN, zeros


@pytest.mark.parametrize("gamma, lam", [(1.0, 1.0), (0.99, 0.95)])
def test_gae_matches_verl(gamma, lam):
    g = _gen(12)
    rewards, values = torch.randn(6, 19, generator=g), torch.randn(6, 19, generator=g) * 2
    mask = _row_masks(6, 19, 12)
    adv, ret = rlk.gae(rewards, values, mask, gamma=gamma, lam=lam)
    truth = [
        verl_gae(r, v, m, gamma, lam)
        for r, v, m in zip(rewards.double().tolist(), values.double().tolist(), mask.double().tolist())
    ]
    adv_truth = torch.tensor([a for a, _ in truth], dtype=torch.float64)
    ret_truth = torch.tensor([r for _, r in truth], dtype=torch.float64)
    scale_adv, scale_ret = ref.gae_contract_scale(rewards, values, mask, gamma, gamma * lam)
    _assert_contract("gae", "advantages", adv, adv_truth, scale_adv)
    _assert_contract("gae", "returns", ret, ret_truth, scale_ret)
    assert torch.all(adv[1] == 0) and torch.equal(ret[1], values[1])  # an all-masked row


def test_gae_matches_openrlhf_on_right_padded_rows_then_normalize():
    """OpenRLHF (gamma 1, lambd 0.95) zeroes rewards / values where masked; on right-padded rows its
    advantages and returns agree with verl's convention on every unmasked position, and its global
    normalization (biased variance, rsqrt(clamp(var, 1e-8))) is masked_whiten(unbiased=False, clamp)."""
    g = _gen(13)
    rewards, values = torch.randn(5, 16, generator=g), torch.randn(5, 16, generator=g)
    mask = torch.arange(16) < torch.tensor([[16], [9], [3], [1], [12]])
    adv, ret = rlk.gae(rewards, values, mask, gamma=1.0, lam=0.95)
    white = rlk.masked_whiten(adv, mask, unbiased=False, eps_mode="clamp")
    truth = [
        openrlhf_gae(r, v, m)
        for r, v, m in zip(rewards.double().tolist(), values.double().tolist(), mask.double().tolist())
    ]
    adv_truth = torch.tensor([a for a, _ in truth], dtype=torch.float64)
    ret_truth = torch.tensor([r for _, r in truth], dtype=torch.float64)
    scale_adv, scale_ret = ref.gae_contract_scale(rewards, values, mask, 1.0, 0.95)  # gamma * lam = 0.95
    _assert_contract("gae", "advantages", adv[mask], adv_truth[mask], scale_adv[mask])
    _assert_contract("gae", "returns", ret[mask], ret_truth[mask], scale_ret[mask])
    white_truth = torch.tensor(
        openrlhf_normalize(adv_truth.reshape(-1).tolist(), mask.reshape(-1).tolist()), dtype=torch.float64
    ).view(5, 16)
    white_truth = torch.where(mask, white_truth, 0.0)
    scale = ref.whiten_contract_scale(adv_truth, mask, False, 1e-8, "clamp", white_truth)
    # the advantages feed the whitening with their own rounding: allow for it through the gae scale
    dev = contract.compare_outputs(
        contract.entry("gae", torch.float32),
        "white",
        white.reshape(-1),
        white_truth.reshape(-1),
        (scale * (1 + scale_adv)).reshape(-1),
    )
    assert dev.ok, dev


def test_reinforce_pp_returns_then_whiten():
    """verl's REINFORCE++: returns with the reset convention, then masked_whiten over the mask."""
    rewards = torch.zeros(4, 10)
    mask = torch.arange(10) < torch.tensor([[10], [6], [4], [8]])
    rewards[torch.arange(4), mask.sum(1) - 1] = torch.tensor([1.0, 0.0, -1.0, 0.5])
    returns = rlk.discounted_returns(rewards, mask, 1.0, mask_mode="reset")
    adv = rlk.masked_whiten(returns, mask)
    loops = [returns_loop(r, m, 1.0, "reset") for r, m in zip(rewards.double().tolist(), mask.double().tolist())]
    truth = torch.tensor(verl_masked_whiten(sum(loops, []), mask.reshape(-1).tolist()), dtype=torch.float64)
    truth = torch.where(mask.reshape(-1), truth, 0.0)
    scale = ref.whiten_contract_scale(torch.tensor(loops), mask, True, 1e-8, "add", truth.view(4, 10))
    _assert_contract("masked_whiten", "advantages", adv, truth, scale)


def test_long_horizon_uses_the_float32_constants():
    """T = 3000, gamma = 0.999: fp32(gamma) differs from 0.999 by 2e-11, which moves a far return by
    about T * 2e-11 / 0.999 relative: the op multiplies by fp32(gamma) and fp32(gamma * lam) exactly."""
    assert abi.recurrence_constants(0.999, 0.95, torch.float32) == (f32(0.999), f32(0.999 * 0.95))
    assert abi.recurrence_constants(0.999, 0.95, torch.float64) == (0.999, 0.999 * 0.95)
    rewards = torch.rand(2, 3000, generator=_gen(18))
    mask = torch.ones(2, 3000, dtype=torch.bool)
    out = rlk.discounted_returns(rewards, mask, 0.999)
    truth = torch.tensor(
        [returns_loop(r, m, 0.999, "carry") for r, m in zip(rewards.double().tolist(), mask.double().tolist())]
    )
    _assert_contract(
        "discounted_returns", "carry", out, truth, ref.returns_contract_scale(rewards, mask, f32(0.999), "carry")
    )
    adv, _ = rlk.gae(rewards, rewards, mask, gamma=0.999, lam=1.0)
    truth = torch.tensor(
        [verl_gae(r, r, m, 0.999, 1.0)[0] for r, m in zip(rewards.double().tolist(), mask.double().tolist())]
    )
    _assert_contract("gae", "advantages", adv, truth, ref.gae_contract_scale(rewards, rewards, mask, 0.999, 0.999)[0])


def test_empty_sequences_and_batches():
    assert rlk.discounted_returns(torch.zeros(3, 0), torch.zeros(3, 0), 0.9).shape == (3, 0)
    assert rlk.discounted_returns(torch.zeros(0, 5), torch.zeros(0, 5), 0.9).shape == (0, 5)
    adv, ret = rlk.gae(torch.zeros(2, 0), torch.zeros(2, 0), torch.zeros(2, 0, dtype=torch.bool))
    assert adv.shape == ret.shape == (2, 0)
    assert rlk.group_advantages(torch.zeros(0), group_size=4).shape == (0,)
    assert rlk.group_advantages(torch.zeros(0), group_index=torch.zeros(0, dtype=torch.long)).shape == (0,)
    r = torch.randn(3, 1, 8, generator=_gen(19))
    out = rlk.discounted_returns(r, torch.ones(3, 1, 8), 1.0)  # leading dims are kept
    assert out.shape == (3, 1, 8)
    torch.testing.assert_close(out[..., 0].double(), r.double().sum(-1), rtol=0, atol=1e-6)


# ----------------------------------------------------------------------------------------------
# dtypes, masks, non-differentiability
# ----------------------------------------------------------------------------------------------


def test_16_bit_inputs_are_upcast_exactly():
    g = _gen(14)
    scores = torch.randn(12, generator=g).to(torch.bfloat16)
    assert torch.equal(rlk.group_advantages(scores, group_size=4), rlk.group_advantages(scores.float(), group_size=4))
    r, v = torch.randn(3, 9, generator=g).half(), torch.randn(3, 9, generator=g).bfloat16()
    mask = _row_masks(3, 9, 14)
    for a, b in zip(
        rlk.gae(r, v, mask, gamma=0.99, lam=0.95), rlk.gae(r.float(), v.float(), mask, gamma=0.99, lam=0.95)
    ):
        assert a.dtype == torch.float32 and torch.equal(a, b)
    assert torch.equal(rlk.masked_whiten(r, mask), rlk.masked_whiten(r.float(), mask))
    assert torch.equal(rlk.discounted_returns(r, mask, 0.9), rlk.discounted_returns(r.float(), mask, 0.9))


def test_fp64_inputs_give_fp64_outputs():
    x = torch.randn(3, 5, dtype=torch.float64)
    mask = torch.ones(3, 5, dtype=torch.bool)
    assert rlk.masked_whiten(x, mask).dtype == torch.float64
    assert rlk.discounted_returns(x, mask, 1.0).dtype == torch.float64
    assert all(t.dtype == torch.float64 for t in rlk.gae(x, x, mask))
    assert rlk.group_advantages(x.reshape(-1), group_size=5).dtype == torch.float64


def test_mask_dtypes_are_equivalent_and_checked(monkeypatch):
    x = torch.randn(4, 7, generator=_gen(15))
    mask = _row_masks(4, 7, 15)
    expected = rlk.discounted_returns(x, mask, 0.9)
    for m in (mask.int(), mask.float(), mask.to(torch.uint8)):
        assert torch.equal(rlk.discounted_returns(x, m, 0.9), expected)
        assert torch.equal(rlk.masked_whiten(x, m), rlk.masked_whiten(x, mask))
    half = mask.float()
    half[2, 3] = 0.5
    with pytest.raises(ValueError, match=r"mask: values must be 0 or 1; found 0.5 at flat position 17"):
        rlk.discounted_returns(x, half, 0.9)
    with pytest.raises(ValueError, match="mask: values must be 0 or 1"):
        rlk.gae(x, x, half)
    monkeypatch.setenv("RLK_CHECK_VALUES", "0")
    rlk.masked_whiten(x, half)  # not checked: any non-zero counts as 1


def test_outputs_are_not_differentiable():
    x = torch.randn(2, 6, requires_grad=True)
    mask = torch.ones(2, 6)
    outs = [
        rlk.masked_whiten(x, mask),
        rlk.discounted_returns(x, mask, 0.9),
        *rlk.gae(x, x, mask),
        rlk.group_advantages(x.reshape(-1), group_size=3),
    ]
    assert not any(o.requires_grad for o in outs)
    for name in ("group_advantages", "masked_whiten", "discounted_returns", "gae"):
        assert abi.OPS[name].backward is None and abi.OPS[name].primitives == (f"{name}_fwd",)
        e = contract.entry(name, torch.float32)
        assert e.grad_rel_l2 is None
        assert e.batch_invariance == ("deterministic" if name == "masked_whiten" else "bitwise")


# ----------------------------------------------------------------------------------------------
# bad input
# ----------------------------------------------------------------------------------------------

_S = torch.zeros(6)
_R = torch.zeros(2, 5)
_M = torch.ones(2, 5, dtype=torch.bool)


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: rlk.group_advantages(_S), ValueError, "group_size, group_index: pass exactly one of them"),
        (
            lambda: rlk.group_advantages(_S, group_size=2, group_index=torch.zeros(6, dtype=torch.long)),
            ValueError,
            "pass exactly one",
        ),
        (
            lambda: rlk.group_advantages(_S, group_size=4),
            ValueError,
            "group_size: 4 does not divide the batch size B = 6",
        ),
        (lambda: rlk.group_advantages(_S, group_size=0), ValueError, "group_size: expected an int >= 1"),
        (
            lambda: rlk.group_advantages(_S, group_index=torch.zeros(5, dtype=torch.long)),
            ValueError,
            r"group_index: expected shape \(6,\) \(the shape of scores\)",
        ),
        (
            lambda: rlk.group_advantages(_S, group_index=torch.zeros(6)),
            TypeError,
            "group_index: expected an integer dtype",
        ),
        (
            lambda: rlk.group_advantages(_S, group_size=2, mode="ppo"),
            ValueError,
            "mode: expected one of 'grpo', 'dr_grpo', 'rloo', 'reinforce_pp_baseline', 'opo', 'gpg', got 'ppo'",
        ),
        (lambda: rlk.group_advantages(_S, group_size=2, eps=0.0), ValueError, "eps: must be a finite number > 0"),
        (lambda: rlk.group_advantages(torch.zeros(2, 3), group_size=2), ValueError, r"scores: expected shape \[B\]"),
        (
            lambda: rlk.group_advantages(torch.zeros(6, dtype=torch.long), group_size=2),
            TypeError,
            "scores: expected dtype",
        ),
        (
            lambda: rlk.group_advantages(_S, group_size=2, mode="opo"),
            ValueError,
            "lengths: mode='opo' needs the response lengths",
        ),
        (
            lambda: rlk.group_advantages(_S, group_size=2, lengths=torch.ones(6)),
            ValueError,
            "lengths: only mode='opo' uses lengths",
        ),
        (
            lambda: rlk.group_advantages(_S, group_size=2, mode="opo", lengths=torch.ones(5)),
            ValueError,
            r"lengths: expected shape \(6,\)",
        ),
        (
            lambda: rlk.group_advantages(_S, group_size=2, mode="opo", lengths=-torch.ones(6)),
            ValueError,
            "lengths: must be finite and >= 0; found -1.0 at position 0",
        ),
        (
            lambda: rlk.masked_whiten(_R, torch.ones(2, 4)),
            ValueError,
            r"mask: expected shape \(2, 5\) \(the shape of x\)",
        ),
        (lambda: rlk.masked_whiten(_R, _M, eps=-1.0), ValueError, "eps: must be a finite number > 0, got -1.0"),
        (lambda: rlk.masked_whiten(_R, _M, eps_mode="max"), ValueError, "eps_mode: expected one of 'add', 'clamp'"),
        (lambda: rlk.masked_whiten(_R, _M, unbiased=1), TypeError, "unbiased: expected a bool"),
        (lambda: rlk.masked_whiten(_R, torch.ones(2, 5, dtype=torch.complex64)), TypeError, "mask: expected dtype"),
        (
            lambda: rlk.discounted_returns(_R, _M, 1.5),
            ValueError,
            r"gamma: must be a finite number in \[0, 1\], got 1.5",
        ),
        (lambda: rlk.discounted_returns(_R, _M, -0.1), ValueError, r"gamma: must be a finite number in \[0, 1\]"),
        (lambda: rlk.discounted_returns(_R, _M, "0.9"), TypeError, "gamma: expected a number"),
        (
            lambda: rlk.discounted_returns(_R, _M, 0.9, mask_mode="skip"),
            ValueError,
            "mask_mode: expected one of 'carry', 'reset', 'zero'",
        ),
        (
            lambda: rlk.discounted_returns(_R, _M[:, :4], 0.9),
            ValueError,
            r"mask: expected shape \(2, 5\) \(the shape of rewards\)",
        ),
        (
            lambda: rlk.discounted_returns(torch.zeros(()), torch.ones(()), 0.9),
            ValueError,
            r"rewards: expected shape \[..., T\]",
        ),
        (lambda: rlk.gae(_R, torch.zeros(2, 6), _M), ValueError, r"values: expected shape \(2, 5\)"),
        (lambda: rlk.gae(_R, _R, _M, lam=2.0), ValueError, r"lam: must be a finite number in \[0, 1\], got 2.0"),
        (lambda: rlk.gae(_R, _R, _M, gamma=1.01), ValueError, r"gamma: must be a finite number in \[0, 1\]"),
        (lambda: rlk.gae(_R.double(), _R, _M), TypeError, "values: expected float64 exactly when rewards"),
        (lambda: rlk.gae(_R, _R, torch.ones(2, 5, device="meta")), ValueError, "mask: expected device cpu"),
    ],
)
def test_bad_input_gets_a_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


# ----------------------------------------------------------------------------------------------
# torch.library integration
# ----------------------------------------------------------------------------------------------


def test_opcheck_all_custom_ops():
    g = _gen(16)
    scores, ids = _group_case(seed=16)
    lengths = torch.rand(ids.shape, generator=g) * 10
    for mode in ("grpo", "rloo", "gpg"):
        torch.library.opcheck(torch.ops.rlk.group_advantages_fwd.default, (scores, ids, 0, None, mode, 1e-6))
    torch.library.opcheck(torch.ops.rlk.group_advantages_fwd.default, (scores[:12], None, 4, lengths[:12], "opo", 1e-6))
    x = torch.randn(3, 8, generator=g)
    mask = _row_masks(3, 8, 16)
    torch.library.opcheck(torch.ops.rlk.masked_whiten_fwd.default, (x, mask, True, 1e-8, "add", False))
    torch.library.opcheck(torch.ops.rlk.masked_whiten_fwd.default, (x, mask.float(), False, 1e-8, "clamp", True))
    torch.library.opcheck(torch.ops.rlk.discounted_returns_fwd.default, (x, mask, 0.99, "reset"))
    torch.library.opcheck(torch.ops.rlk.gae_fwd.default, (x, x * 2, mask, 0.99, 0.95))


def test_torch_compile_fullgraph_matches_eager():
    g = _gen(17)
    scores = torch.randn(12, generator=g)
    rewards, values = torch.randn(3, 9, generator=g), torch.randn(3, 9, generator=g)
    mask = _row_masks(3, 9, 17).float()
    ids = torch.tensor([3, 1, 3, 2, 1, 1, 2, 3, 2, 1, 3, 2])

    def pipeline(scores, rewards, values, mask):
        a = rlk.group_advantages(scores, group_index=ids, mode="grpo")
        b = rlk.group_advantages(scores.bfloat16(), group_size=4, mode="rloo")
        adv, ret = rlk.gae(rewards, values, mask, gamma=0.99, lam=0.95)
        white = rlk.masked_whiten(adv, mask)
        g_t = rlk.discounted_returns(rewards, mask, 0.99, mask_mode="zero")
        return a, b, white, ret, g_t

    eager = pipeline(scores, rewards, values, mask)
    compiled = torch.compile(pipeline, fullgraph=True, backend="aot_eager")(scores, rewards, values, mask)
    for e, c in zip(eager, compiled):
        assert torch.equal(e, c)


def test_contract_entries_and_scales_exist():
    for op in ("group_advantages", "masked_whiten", "discounted_returns", "gae"):
        e = contract.entry(op, torch.float32)
        assert e.atol > 0 and e.rtol > 0
        assert "scale" in contract.table()["ops"][op]


# ----------------------------------------------------------------------------------------------
# Pass@k (grpo_passk, dr_grpo_passk)
# ----------------------------------------------------------------------------------------------


def passk(scores, ids, eps=1e-6, norm_by_std=True):
    """Pass@k re-derived (fp64 Python floats): the group's best (first holder of the max) gets the margin over the
    runner-up, over ``std + eps`` when normalized; singletons ``s / (1 + eps)`` (``s`` unnormalized)."""
    out = [0.0] * len(scores)
    for members in _groups(ids).values():
        vals = [scores[i] for i in members]
        if len(vals) == 1:
            out[members[0]] = vals[0] / (1 + eps) if norm_by_std else vals[0]
            continue
        best = max(range(len(vals)), key=lambda j: (vals[j], -j))
        runner_up = max(v for j, v in enumerate(vals) if j != best)
        margin = vals[best] - runner_up
        out[members[best]] = margin / (_std_unbiased(vals) + eps) if norm_by_std else margin
    return out


@pytest.mark.parametrize("mode", abi.PASSK_MODES)
def test_passk_matches_rederivation(mode):
    scores, ids = _group_case(seed=5)
    counts = {g: int((ids == g).sum()) for g in ids.tolist()}
    tied = next(g for g, c in counts.items() if c >= 3 and g != int(ids[0]))
    scores[ids == tied] = torch.tensor([2.0, 3.0, 3.0, 1.0, 3.0, 0.5])[: counts[tied]]  # a tie for the top
    adv = rlk.group_advantages(scores, group_index=ids, mode=mode)
    truth = torch.tensor(
        passk(scores.double().tolist(), ids.tolist(), norm_by_std=mode == "grpo_passk"), dtype=torch.float64
    )
    _assert_contract("group_advantages", mode, adv, truth, ref.group_contract_scale(truth, ids, 0))
    assert torch.all(adv[ids == ids[0]] == 0) and torch.all(adv[ids == tied] == 0)  # equal / tied tops: 0
    groups = _groups(ids.tolist())
    winners = sum(1 for m in groups.values() if len(m) > 1 and any(adv[i] != 0 for i in m))
    assert winners == len([m for m in groups.values() if len(m) > 1]) - 2  # every other group: one winner
    assert all(int((adv[m] != 0).sum()) <= 1 for m in map(torch.tensor, groups.values()))


@pytest.mark.parametrize("mode", abi.PASSK_MODES)
def test_passk_huge_spread_nan_and_layouts(mode):
    scores = torch.tensor(HUGE_SCORES)
    ids = torch.tensor(HUGE_IDS)
    truth = torch.tensor(
        passk(scores.double().tolist(), ids.tolist(), norm_by_std=mode == "grpo_passk"), dtype=torch.float64
    )
    by_size = rlk.group_advantages(scores, group_size=4, mode=mode)
    _assert_contract("group_advantages", mode, by_size, truth, ref.group_contract_scale(truth, None, 4))
    assert torch.equal(rlk.group_advantages(scores, group_index=ids * 3, mode=mode), by_size)
    dirty = scores.clone()
    dirty[1] = math.nan
    got = rlk.group_advantages(dirty, group_size=4, mode=mode)
    assert bool(torch.isnan(got[:4]).all()) and torch.equal(got[4:], by_size[4:])
