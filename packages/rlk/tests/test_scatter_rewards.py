"""``rlk.scatter_rewards`` on the reference backend: hand-computed examples, independent fp64 re-derivations (plain
Python loops written from the formulas of verl's DAPO reward manager, TRL's GRPO trainer and soft overlong
punishment, OpenRLHF's RLOO reward at the EOS token, DeepSeekMath's process supervision; no code shared with rlk),
float32 against the fp64 ground truth under the contract, edge cases, bad input, value checks, torch.library
integration. Batch invariance (a Triton promise) is tested with the kernels."""

from __future__ import annotations

import math

import pytest
import torch

import rlk
from rlk.core import abi, contract
from rlk.ops.rewards import primitive_inputs
from rlk.reference import rewards as ref

ENTRY = contract.entry("scatter_rewards", torch.float32)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _right_padded(lengths: list[int], t: int) -> torch.Tensor:
    return torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]


def _assert_contract(name: str, got: torch.Tensor, truth: torch.Tensor, scale: torch.Tensor) -> float:
    assert got.dtype == torch.float32
    dev = contract.compare_outputs(ENTRY, name, got.reshape(-1), truth.reshape(-1), scale.reshape(-1))
    assert dev.ok, dev
    return dev.ratio


def _truth_and_scale(rewards, mask, **kw) -> tuple[dict, dict]:
    """The op on fp64 copies (ground truth) and the contract's scales, keyed ``rewards`` / ``costs``."""

    def f64(v):
        return v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v

    kw64 = {k: (tuple(f64(t) for t in v) if isinstance(v, tuple) else f64(v)) for k, v in kw.items()}
    out = rlk.scatter_rewards(f64(rewards), mask, **kw64)
    truth = dict(zip(("rewards", "costs"), out)) if isinstance(out, tuple) else {"rewards": out}
    return truth, ref.contract_scale(*primitive_inputs(f64(rewards), mask, **kw64))


# ----------------------------------------------------------------------------------------------
# hand-computed examples
# ----------------------------------------------------------------------------------------------

_MASK = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 0, 1, 1, 0]], dtype=torch.bool)
_SCORES = torch.tensor([1.0, 0.0, 0.5, 2.0])
_REGIONS = (torch.tensor([1.0, 2.0, 3.0]), torch.tensor([[0, 0, 2], [1, 1, 4], [3, 0, 4]]))


def test_last_token_rewards_by_hand():
    """verl's reward tensor: the score at the last masked token; an empty row gets nothing; a hole in a row does
    not move its last token."""
    want = torch.zeros(4, 5)
    want[0, 2], want[1, 4], want[3, 3] = 1.0, 0.0, 2.0
    assert torch.equal(rlk.scatter_rewards(_SCORES, _MASK), want)


def test_grpo_broadcast_by_hand():
    """Groups of 2: (1, 0) and (0.5, 2): mean / unbiased std give -+1 / sqrt(2) (std sqrt(1/2), sqrt(9/8))."""
    got = rlk.scatter_rewards(_SCORES, _MASK, placement="broadcast", group_mode="grpo", group_size=2)
    a = 0.5 / (math.sqrt(0.5) + 1e-6)
    b = 0.75 / (math.sqrt(1.125) + 1e-6)
    want = torch.tensor([[a] * 3 + [0, 0], [-a] * 5, [0.0] * 5, [b, 0, b, b, 0]])
    torch.testing.assert_close(got, want.float(), rtol=1e-6, atol=0)


def test_columns_nan_and_overlong_by_hand():
    """Columns (1, NaN), (0, 1), (0.5, 0.5), (2, 1) with weights (1, 0.5): NaN adds nothing; overlong (5, 2, 1):
    length 5 is 2 past 3 = 5 - 2, so -1; lengths 3 add nothing."""
    x = torch.tensor([[1.0, math.nan], [0.0, 1.0], [0.5, 0.5], [2.0, 1.0]])
    got = rlk.scatter_rewards(x, _MASK, reward_weights=[1.0, 0.5], overlong=(5, 2, 1.0))
    want = torch.zeros(4, 5)
    want[0, 2], want[1, 4], want[3, 3] = 1.0, 0.5 - 1.0, 2.5
    assert torch.equal(got, want)


@pytest.mark.parametrize("placement", abi.PLACEMENTS)
def test_rloo_regions_and_costs_by_hand(placement):
    """rloo over groups {0, 1}, {2, 3}: sequences (1, 0) -> (1, -1), (0.5, 2) -> (-1.5, 1.5); regions of group 0
    (1 on seq 0, 2 on seq 1) -> (-1, 1); group 1's only region keeps its 3 (a singleton: mean 0). Costs (0, 1) /
    (0, 1) -> (-1, 1) twice, on their own."""
    tok, cost = rlk.scatter_rewards(
        _SCORES,
        _MASK,
        region_rewards=_REGIONS,
        costs=torch.tensor([0.0, 1.0, 0.0, 1.0]),
        group_mode="rloo",
        group_index=torch.tensor([7, 7, -2, -2]),
        placement=placement,
    )
    if placement == "last":
        want = torch.tensor([[0, -1, 1, 0, 0], [0, 0, 0, 1, -1], [0] * 5, [0, 0, 0, 4.5, 0]])
        want_cost = torch.tensor([[0, 0, -1, 0, 0], [0, 0, 0, 0, 1], [0] * 5, [0, 0, 0, 1, 0]])
    else:
        want = torch.tensor([[0, 0, 1, 0, 0], [-1, 0, 0, 0, -1], [0] * 5, [4.5, 0, 4.5, 4.5, 0]])
        want_cost = torch.tensor([[-1, -1, -1, 0, 0], [1] * 5, [0] * 5, [1, 0, 1, 1, 0]])
    assert torch.equal(tok, want.float()) and torch.equal(cost, want_cost.float())


# ----------------------------------------------------------------------------------------------
# independent re-derivations (fp64 Python floats, loops)
# ----------------------------------------------------------------------------------------------


def verl_overlong(length: int, max_len: int, cache: int, factor: float) -> float:
    """verl's DAPO reward manager (``overlong_buffer``): ``min(-exceed / len * penalty_factor, 0)``."""
    exceed = length - (max_len - cache)
    return min(-exceed / cache * factor, 0.0)


def trl_soft_overlong(length: int, max_len: int, cache: int) -> float:
    """TRL's ``get_soft_overlong_punishment`` (DAPO eq. 13)."""
    if length <= max_len - cache:
        return 0.0
    if length <= max_len:
        return (max_len - cache - length) / cache
    return -1.0


def _mean(xs):
    return sum(xs) / len(xs)


def _std(xs):
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def test_verl_dapo_reward_tensor_with_overlong_buffer():
    """verl: ``reward_tensor[i, valid_response_length - 1] = score + overlong_reward`` (right-padded responses no
    longer than ``max_resp_len``, lengths spanning the whole buffer)."""
    t, cache, factor = 40, 16, 0.5
    lengths = [40, 1, 24, 25, 31, 39, 12, 33]
    scores = torch.randn(len(lengths), generator=_gen(0))
    mask = _right_padded(lengths, t)
    got = rlk.scatter_rewards(scores, mask, overlong=(t, cache, factor))
    want = torch.zeros(len(lengths), t, dtype=torch.float64)
    for i, length in enumerate(lengths):
        want[i, length - 1] = float(scores[i]) + verl_overlong(length, t, cache, factor)
    truth, scale = _truth_and_scale(scores, mask, overlong=(t, cache, factor))
    torch.testing.assert_close(truth["rewards"], want, rtol=1e-15, atol=1e-15)
    _assert_contract("token_rewards", got, want, scale["rewards"])


def test_trl_grpo_with_reward_columns_nan_and_soft_overlong():
    """TRL: ``(rewards_per_func * reward_weights).nansum(1)`` (NaN: a reward function returned None), the soft
    overlong punishment as one more column (its weight 1, or rlk's ``overlong`` with penalty 1), groups of
    ``num_generations``, ``(r - mean) / (std + 1e-4)`` with the unbiased std, one advantage on every token."""
    b, t, group, max_len, cache = 12, 30, 4, 30, 8
    g = _gen(1)
    lengths = torch.randint(1, t + 1, (b,), generator=g).tolist()
    mask = _right_padded(lengths, t)
    columns = (torch.rand(b, 2, generator=g) < 0.5).float() + 0.1 * torch.randn(b, 2, generator=g)
    columns[::3, 1] = math.nan
    weights = [1.0, 0.75]
    total = []
    for i in range(b):
        row = [w * float(x) for w, x in zip(weights, columns[i]) if not math.isnan(float(x))]
        total.append(sum(row) + trl_soft_overlong(lengths[i], max_len, cache))
    want = torch.zeros(b, t, dtype=torch.float64)
    for g0 in range(0, b, group):
        xs = total[g0 : g0 + group]
        for i in range(g0, g0 + group):
            want[i, : lengths[i]] = (total[i] - _mean(xs)) / (_std(xs) + 1e-4)
    kw = {"reward_weights": weights, "overlong": (max_len, cache, 1.0), "placement": "broadcast"}
    kw |= {"group_mode": "grpo", "group_size": group, "eps": 1e-4}
    got = rlk.scatter_rewards(columns, mask, **kw)
    _, scale = _truth_and_scale(columns, mask, **kw)
    _assert_contract("token_rewards", got, want, scale["rewards"])
    # the punishment as a column of its own (TRL's way) is the same reward
    punish = torch.tensor([trl_soft_overlong(n, max_len, cache) for n in lengths])
    as_column = torch.cat([columns, punish[:, None]], 1)
    kw_column = dict(kw, reward_weights=[*weights, 1.0], overlong=None)
    _assert_contract("token_rewards", rlk.scatter_rewards(as_column, mask, **kw_column), want, scale["rewards"])


def test_openrlhf_rloo_at_the_eos_token():
    """OpenRLHF: baseline ``(sum_g - r) / (n - 1)``, the reward put at ``eos_indices``, the last position of the
    action mask (multi-turn masks with holes included; every row non-empty: OpenRLHF's index of an empty row is
    T - 1, rlk puts nothing there)."""
    b, t, group = 10, 17, 5
    g = _gen(2)
    mask = torch.rand(b, t, generator=g) < 0.6
    mask[:, 0] = True
    scores = torch.randn(b, generator=g)
    want = torch.zeros(b, t, dtype=torch.float64)
    for g0 in range(0, b, group):
        xs = [float(v) for v in scores[g0 : g0 + group]]
        for i in range(g0, g0 + group):
            eos = max(j for j in range(t) if mask[i, j])
            want[i, eos] = xs[i - g0] - (sum(xs) - xs[i - g0]) / (group - 1)
    got = rlk.scatter_rewards(scores, mask, group_mode="rloo", group_size=group)
    _, scale = _truth_and_scale(scores, mask, group_mode="rloo", group_size=group)
    _assert_contract("token_rewards", got, want, scale["rewards"])


def test_process_supervision_grpo_with_returns():
    """DeepSeekMath's process supervision: the step rewards of a group pooled, ``(r - mean) / std``, and a token's
    advantage the sum of the normalized rewards of the steps ending at or after it: ``placement="last"`` then
    ``rlk.discounted_returns(gamma=1)``. Steps are spans of right-padded responses; sequence scores are 0 (equal
    scores: exactly 0)."""
    group, t = 3, 20
    lengths = [20, 14, 9, 17, 20, 5]
    ends = [[4, 11, 20], [6, 14], [9], [3, 8, 12, 17], [20], [2, 5]]
    g = _gen(3)
    values = [[float(v) for v in torch.rand(len(e), generator=g)] for e in ends]
    mask = _right_padded(lengths, t)
    spans = [[i, (e[k - 1] if k else 0), e[k]] for i, e in enumerate(ends) for k in range(len(e))]
    region_values = torch.tensor([v for vs in values for v in vs])
    want = torch.zeros(len(lengths), t, dtype=torch.float64)
    for g0 in range(0, len(lengths), group):
        pooled = [v for vs in values[g0 : g0 + group] for v in vs]
        mean, std = _mean(pooled), _std(pooled)
        for i in range(g0, g0 + group):
            for tok in range(lengths[i]):
                want[i, tok] = sum((v - mean) / (std + 1e-6) for e, v in zip(ends[i], values[i]) if e - 1 >= tok)
    kw = {"region_rewards": (region_values, torch.tensor(spans)), "group_mode": "grpo", "group_size": group}
    tokens = rlk.scatter_rewards(torch.zeros(len(lengths)), mask, **kw)
    got = rlk.discounted_returns(tokens, mask, 1.0)
    got = torch.where(mask, got, 0.0)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_costs_are_kept_apart_from_rewards():
    """Constrained objectives: the costs get their own statistics and output. The rewards are bitwise those of a
    call without costs, the costs those of the same steps run on the costs alone (no columns, no overlong)."""
    b, t = 8, 12
    g = _gen(4)
    mask = torch.rand(b, t, generator=g) < 0.7
    rewards = torch.rand(b, 2, generator=g)
    costs = (torch.rand(b, generator=g) < 0.4).float()
    spans = torch.tensor([[0, 0, 5], [3, 2, 9], [3, 0, 12], [6, 4, 7]])
    region_costs = (torch.tensor([1.0, 0.0, 1.0, 1.0]), spans)
    region_rewards = (torch.rand(4, generator=g), spans)
    for mode in abi.REWARD_GROUP_MODES:
        common = {"group_mode": mode, "group_size": 4, "placement": "broadcast"}
        tok, cost = rlk.scatter_rewards(
            rewards,
            mask,
            reward_weights=[1.0, 2.0],
            overlong=(t, 4, 0.5),
            region_rewards=region_rewards,
            costs=costs,
            region_costs=region_costs,
            **common,
        )
        alone = rlk.scatter_rewards(
            rewards, mask, reward_weights=[1.0, 2.0], overlong=(t, 4, 0.5), region_rewards=region_rewards, **common
        )
        assert torch.equal(tok, alone)
        assert torch.equal(cost, rlk.scatter_rewards(costs, mask, region_rewards=region_costs, **common))
        only_regions = rlk.scatter_rewards(rewards, mask, region_costs=region_costs, **common)[1]
        assert torch.equal(
            only_regions, rlk.scatter_rewards(torch.zeros(b), mask, region_rewards=region_costs, **common)
        )


# ----------------------------------------------------------------------------------------------
# float32 against the fp64 ground truth
# ----------------------------------------------------------------------------------------------


def _random_case(b: int, t: int, seed: int, columns: int = 3, n_regions: int = 0):
    g = _gen(seed)
    mask = torch.rand(b, t, generator=g) < 0.8
    if b > 2:
        mask[1] = False
        mask[2] = torch.arange(t) < t // 3
    rewards = torch.randn(b, columns, generator=g) * 2 + 0.5
    if columns > 1:
        rewards[::4, 1] = math.nan
    seq = torch.randint(0, b, (n_regions,), generator=g)
    start = torch.randint(0, t + 1, (n_regions,), generator=g)
    end = start + (torch.rand(n_regions, generator=g) * (t + 1 - start)).long()
    spans = torch.stack([seq, start, end], 1)
    return rewards, mask, (torch.randn(n_regions, generator=g), spans), torch.rand(b, generator=g)


@pytest.mark.parametrize("placement", abi.PLACEMENTS)
@pytest.mark.parametrize("mode", [None, *abi.REWARD_GROUP_MODES])
def test_float32_matches_fp64_ground_truth(mode, placement):
    rewards, mask, regions, costs = _random_case(24, 37, seed=5, n_regions=30)
    ids = torch.randint(0, 5, (24,), generator=_gen(6)) * 3 - 4
    kw = {"reward_weights": [0.3, 1.0, -0.7], "overlong": (37, 10, 0.8), "placement": placement}
    kw |= {"region_rewards": regions, "costs": costs, "region_costs": (regions[0].abs(), regions[1])}
    if mode is not None:
        kw |= {"group_mode": mode, "group_index": ids}
    tok, cost = rlk.scatter_rewards(rewards, mask, **kw)
    truth, scale = _truth_and_scale(rewards, mask, **kw)
    _assert_contract("token_rewards", tok, truth["rewards"], scale["rewards"])
    _assert_contract("token_costs", cost, truth["costs"], scale["costs"])
    assert torch.all(tok[~mask] == 0) and torch.all(cost[~mask] == 0)


def test_large_scores_with_a_small_spread_and_huge_spread():
    """Scores of 1e6 plus small integers (the pivot keeps the centring exact) and a spread of 1e20 (scaled by a
    power of two before squaring): group_advantages' numerics hold for the scores and the regions."""
    mask = torch.ones(8, 6, dtype=torch.bool)
    for scores in (
        1e6 + torch.randint(0, 4, (8,), generator=_gen(7)).float(),
        torch.tensor([0, 1e20, -1e20, 3e19] * 2),
    ):
        regions = (scores.clone(), torch.stack([torch.arange(8), torch.zeros(8).long(), torch.full((8,), 6)], 1))
        kw = {"group_mode": "grpo", "group_size": 4, "placement": "last", "region_rewards": regions}
        truth, scale = _truth_and_scale(scores, mask, **kw)
        _assert_contract("token_rewards", rlk.scatter_rewards(scores, mask, **kw), truth["rewards"], scale["rewards"])


# ----------------------------------------------------------------------------------------------
# edge cases
# ----------------------------------------------------------------------------------------------


def test_overlong_boundaries():
    """Lengths up to ``max_len - cache`` add 0; the buffer is linear; past ``max_len``: -penalty (TRL's -1);
    ``cache = 0``: 0 up to ``max_len``, -penalty past it."""
    t = 12
    lengths = list(range(t + 1))
    mask = _right_padded(lengths, t)
    zeros = torch.zeros(len(lengths))
    got = rlk.scatter_rewards(zeros, mask, overlong=(10, 4, 2.0), placement="broadcast")[1:, 0]  # row 0 is empty
    want = [0.0] * 6 + [-0.5, -1.0, -1.5, -2.0, -2.0, -2.0]
    assert got.tolist() == want == [2.0 * trl_soft_overlong(n, 10, 4) for n in lengths[1:]]
    hard = rlk.scatter_rewards(zeros, mask, overlong=(10, 0, 1.0), placement="broadcast")[1:, 0]
    assert hard.tolist() == [0.0] * 10 + [-1.0, -1.0]


def test_regions_edge_cases():
    """An empty span, a span with no masked token, overlapping regions (added in region order), a region covering
    masked-out positions only partly."""
    mask = torch.tensor([[1, 1, 0, 1, 1, 0]], dtype=torch.bool)
    spans = torch.tensor([[0, 2, 2], [0, 2, 3], [0, 0, 4], [0, 3, 6], [0, 1, 2]])
    values = torch.tensor([5.0, 6.0, 1.0, 2.0, 4.0])
    last = rlk.scatter_rewards(torch.zeros(1), mask, region_rewards=(values, spans))
    assert last.tolist() == [[0.0, 4.0, 0.0, 1.0, 2.0, 0.0]]
    bcast = rlk.scatter_rewards(torch.zeros(1), mask, region_rewards=(values, spans), placement="broadcast")
    assert bcast.tolist() == [[1.0, 5.0, 0.0, 3.0, 2.0, 0.0]]
    empty = rlk.scatter_rewards(torch.ones(1), mask, region_rewards=(torch.zeros(0), torch.zeros(0, 3).long()))
    assert torch.equal(empty, rlk.scatter_rewards(torch.ones(1), mask))


def test_empty_batches_and_rows():
    assert rlk.scatter_rewards(torch.zeros(0), torch.zeros(0, 5, dtype=torch.bool)).shape == (0, 5)
    tok, cost = rlk.scatter_rewards(torch.ones(3), torch.zeros(3, 0), costs=torch.ones(3))
    assert tok.shape == cost.shape == (3, 0)
    none = rlk.scatter_rewards(torch.ones(2), torch.zeros(2, 4), group_mode="grpo", group_size=2)
    assert torch.equal(none, torch.zeros(2, 4))


def test_singletons_and_equal_groups():
    """Singleton groups: mean 0, std 1 (``s / (1 + eps)`` for grpo, ``s`` otherwise); equal scores give exactly 0."""
    mask = torch.ones(4, 3, dtype=torch.bool)
    scores = torch.tensor([0.1, 0.1, 0.1, 2.5])
    ids = torch.tensor([0, 0, 0, 1])
    for mode in abi.REWARD_GROUP_MODES:
        out = rlk.scatter_rewards(scores, mask, group_mode=mode, group_index=ids, placement="broadcast")
        assert torch.all(out[:3] == 0)
        single = torch.tensor(2.5) / torch.tensor(1 + 1e-6) if mode == "grpo" else torch.tensor(2.5)
        assert torch.equal(out[3], single.expand(3))


@pytest.mark.parametrize("fill", [math.nan, math.inf])
def test_non_finite_values_stay_in_their_group(fill):
    """An inf score, a NaN cost or a NaN region value changes its own group only (NaN reward columns are skipped)."""
    rewards, mask, regions, costs = _random_case(12, 9, seed=8, columns=1, n_regions=10)
    kw = {"group_mode": "grpo", "group_size": 4, "placement": "broadcast", "region_rewards": regions}
    clean_tok, clean_cost = rlk.scatter_rewards(rewards, mask, costs=costs, **kw)
    dirty = rewards.clone()
    dirty[5, 0] = math.inf
    dirty_costs = costs.clone()
    dirty_costs[9] = fill
    tok, cost = rlk.scatter_rewards(dirty, mask, costs=dirty_costs, **kw)
    group_of = torch.arange(12) // 4
    assert torch.equal(tok[group_of != 1], clean_tok[group_of != 1])
    assert torch.equal(cost[group_of != 2], clean_cost[group_of != 2])
    assert not bool(torch.isfinite(tok[group_of == 1][mask[group_of == 1]]).all())


def test_16_bit_inputs_are_upcast_exactly_and_fp64_stays():
    rewards, mask, regions, costs = _random_case(8, 7, seed=9, n_regions=5)
    kw = {"group_mode": "grpo", "group_size": 4, "region_rewards": (regions[0].bfloat16(), regions[1])}
    low = rlk.scatter_rewards(rewards.bfloat16(), mask.float(), costs=costs.half(), **kw)
    kw32 = dict(kw, region_rewards=(regions[0].bfloat16().float(), regions[1]))
    high = rlk.scatter_rewards(rewards.bfloat16().float(), mask, costs=costs.half().float(), **kw32)
    assert all(a.dtype == torch.float32 and torch.equal(a, b) for a, b in zip(low, high))
    assert rlk.scatter_rewards(rewards.double(), mask).dtype == torch.float64


def test_mask_dtypes_and_outputs_not_differentiable():
    rewards, mask, _, _ = _random_case(5, 6, seed=10, columns=1)
    want = rlk.scatter_rewards(rewards, mask, placement="broadcast")
    for m in (mask.int(), mask.float(), mask.to(torch.uint8)):
        assert torch.equal(rlk.scatter_rewards(rewards, m, placement="broadcast"), want)
    x = rewards.clone().requires_grad_()
    assert not rlk.scatter_rewards(x, mask).requires_grad
    op = abi.OPS["scatter_rewards"]
    assert op.backward is None and op.primitives == ("scatter_rewards_fwd",)
    assert ENTRY.grad_rel_l2 is None and ENTRY.batch_invariance == "bitwise"
    assert "scale" in contract.table()["ops"]["scatter_rewards"]


# ----------------------------------------------------------------------------------------------
# bad input and value checks
# ----------------------------------------------------------------------------------------------

_R = torch.zeros(4)
_M = torch.ones(4, 6, dtype=torch.bool)
_SPANS = torch.tensor([[0, 0, 3], [3, 2, 6]])


@pytest.mark.parametrize(
    "call, error, message",
    [
        (
            lambda: rlk.scatter_rewards(torch.zeros(4, 2, 1), _M),
            ValueError,
            r"rewards: expected shape \[B\] or \[B, R\]",
        ),
        (lambda: rlk.scatter_rewards(torch.zeros(4, 0), _M), ValueError, "with R >= 1"),
        (lambda: rlk.scatter_rewards(torch.zeros(4).long(), _M), TypeError, "rewards: expected dtype"),
        (lambda: rlk.scatter_rewards(_R, _M[:3]), ValueError, r"response_mask: expected shape \[B, T\] with B = 4"),
        (
            lambda: rlk.scatter_rewards(_R, torch.ones(4, 6, dtype=torch.complex64)),
            TypeError,
            "response_mask: expected dtype",
        ),
        (lambda: rlk.scatter_rewards(_R, [[1]]), TypeError, "response_mask: expected a torch.Tensor"),
        (
            lambda: rlk.scatter_rewards(_R, _M, reward_weights=[1.0, 2.0]),
            ValueError,
            "reward_weights: expected 1 weights",
        ),
        (
            lambda: rlk.scatter_rewards(_R, _M, reward_weights=[math.inf]),
            ValueError,
            "reward_weights\\[0\\]: must be a finite",
        ),
        (
            lambda: rlk.scatter_rewards(_R, _M, reward_weights=torch.ones(2)),
            ValueError,
            r"reward_weights: expected shape \[1\]",
        ),
        (
            lambda: rlk.scatter_rewards(_R, _M, reward_weights="1"),
            TypeError,
            "reward_weights: expected a tensor or a sequence",
        ),
        (
            lambda: rlk.scatter_rewards(_R, _M, placement="first"),
            ValueError,
            "placement: expected one of 'last', 'broadcast'",
        ),
        (
            lambda: rlk.scatter_rewards(_R, _M, group_mode="gpg", group_size=2),
            ValueError,
            "group_mode: expected one of 'grpo', 'dr_grpo', 'rloo'",
        ),
        (
            lambda: rlk.scatter_rewards(_R, _M, group_mode="grpo"),
            ValueError,
            "group_size, group_index: pass exactly one",
        ),
        (
            lambda: rlk.scatter_rewards(_R, _M, group_size=2),
            ValueError,
            "group_size, group_index: they group sequences for group_mode, which is None",
        ),
        (
            lambda: rlk.scatter_rewards(_R, _M, group_mode="grpo", group_size=3),
            ValueError,
            "group_size: 3 does not divide the batch size B = 4",
        ),
        (
            lambda: rlk.scatter_rewards(_R, _M, group_mode="grpo", group_index=torch.zeros(3).long()),
            ValueError,
            r"group_index: expected shape \(4,\)",
        ),
        (
            lambda: rlk.scatter_rewards(_R, _M, group_mode="grpo", group_index=torch.zeros(4)),
            TypeError,
            "group_index: expected an integer dtype",
        ),
        (lambda: rlk.scatter_rewards(_R, _M, eps=0.0), ValueError, "eps: must be a finite number > 0"),
        (
            lambda: rlk.scatter_rewards(_R, _M, overlong=(6, 2)),
            TypeError,
            r"overlong: expected \(max_len, cache, penalty\)",
        ),
        (
            lambda: rlk.scatter_rewards(_R, _M, overlong=(0, 0, 1.0)),
            ValueError,
            "overlong max_len: expected an int >= 1",
        ),
        (
            lambda: rlk.scatter_rewards(_R, _M, overlong=(6, 7, 1.0)),
            ValueError,
            "overlong cache: 7 is longer than max_len = 6",
        ),
        (lambda: rlk.scatter_rewards(_R, _M, overlong=(6, 2.5, 1.0)), TypeError, "overlong cache: expected an integer"),
        (
            lambda: rlk.scatter_rewards(_R, _M, overlong=(6, 2, -1.0)),
            ValueError,
            "overlong penalty: must be a finite number >= 0",
        ),
        (lambda: rlk.scatter_rewards(_R, _M, costs=torch.zeros(3)), ValueError, r"costs: expected shape \[4\]"),
        (
            lambda: rlk.scatter_rewards(_R, _M, costs=torch.zeros(4).double()),
            TypeError,
            "costs: expected float64 exactly when rewards is float64",
        ),
        (
            lambda: rlk.scatter_rewards(_R, _M, region_rewards=torch.zeros(2)),
            TypeError,
            r"region_rewards: expected a \(values \[S\], spans \[S, 3\]\) pair",
        ),
        (
            lambda: rlk.scatter_rewards(_R, _M, region_rewards=(torch.zeros(2, 1), _SPANS)),
            ValueError,
            r"region_rewards values: expected shape \[S\]",
        ),
        (
            lambda: rlk.scatter_rewards(_R, _M, region_rewards=(torch.zeros(3), _SPANS)),
            ValueError,
            r"region_rewards spans: expected shape \[3, 3\]",
        ),
        (
            lambda: rlk.scatter_rewards(_R, _M, region_rewards=(torch.zeros(2), _SPANS.float())),
            TypeError,
            "region_rewards spans: expected an integer dtype",
        ),
        (
            lambda: rlk.scatter_rewards(_R, _M, region_costs=(torch.zeros(2), _SPANS[:, :2])),
            ValueError,
            r"region_costs spans: expected shape \[2, 3\]",
        ),
        (
            lambda: rlk.scatter_rewards(_R, _M, region_costs=(torch.zeros(2).long(), _SPANS)),
            TypeError,
            "region_costs values: expected dtype",
        ),
    ],
)
def test_bad_input_gets_a_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


@pytest.mark.parametrize(
    "spans, message",
    [
        ([[0, 0, 3], [4, 0, 1]], r"row 1 is \(seq, start, end\) = \(4, 0, 1\); need 0 <= seq < B = 4"),
        ([[-1, 0, 3]], r"row 0 is \(seq, start, end\) = \(-1, 0, 3\)"),
        ([[0, 4, 3]], r"\(0, 4, 3\); need .* 0 <= start <= end <= T = 6"),
        ([[1, 0, 7]], r"\(1, 0, 7\)"),
        ([[1, -2, 1]], r"\(1, -2, 1\)"),
    ],
)
def test_span_values_are_checked(spans, message):
    spans = torch.tensor(spans)
    values = torch.zeros(spans.shape[0])
    with pytest.raises(ValueError, match="region_rewards spans: .*" + message):
        rlk.scatter_rewards(_R, _M, region_rewards=(values, spans))
    with pytest.raises(ValueError, match="region_costs spans: .*" + message):
        rlk.scatter_rewards(_R, _M, region_costs=(values, spans))


def test_a_multimodal_span_table_is_taken_as_it_is():
    """``rlk.multimodal``'s int32 ``[S, 4]`` (seq, start, end, tag) tables: the same result as the ``[S, 3]`` rows."""
    batch = rlk.multimodal.synthetic_batch("gui-trajectory", seed=3)
    table = batch.action_spans
    assert table.dtype == torch.int32 and table.shape[1] == 4 and table.shape[0] > 1
    mask = batch.loss_mask()
    rewards = torch.linspace(-1.0, 1.0, batch.batch_size)
    values = torch.arange(1.0, table.shape[0] + 1.0)
    got = rlk.scatter_rewards(rewards, mask, region_rewards=(values, table), placement="broadcast")
    want = rlk.scatter_rewards(rewards, mask, region_rewards=(values, table[:, :3].long()), placement="broadcast")
    assert torch.equal(got, want)
    assert not torch.equal(got, rlk.scatter_rewards(rewards, mask, placement="broadcast"))  # the regions count


def test_value_checks_and_rlk_check_values(monkeypatch):
    half = _M.float()
    half[1, 2] = 0.5
    with pytest.raises(ValueError, match="response_mask: values must be 0 or 1; found 0.5 at flat position 8"):
        rlk.scatter_rewards(_R, half)
    monkeypatch.setenv("RLK_CHECK_VALUES", "0")
    rlk.scatter_rewards(_R, half)  # not checked: any non-zero counts as 1
    past = rlk.scatter_rewards(torch.ones(4), _M, region_rewards=(torch.ones(1), torch.tensor([[1, 2, 9]])))
    inside = rlk.scatter_rewards(torch.ones(4), _M, region_rewards=(torch.ones(1), torch.tensor([[1, 2, 6]])))
    assert torch.equal(past, inside)  # unchecked: a span past T reads no further than T


# ----------------------------------------------------------------------------------------------
# torch.library integration
# ----------------------------------------------------------------------------------------------


def test_opcheck():
    rewards, mask, regions, costs = _random_case(8, 9, seed=11, n_regions=6)
    for kw in (
        {},
        {"overlong": (9, 3, 1.0), "placement": "broadcast", "costs": costs},
        {"group_mode": "grpo", "group_size": 4, "region_rewards": regions, "region_costs": regions},
        {"group_mode": "rloo", "group_index": torch.arange(8) % 3, "region_rewards": regions},
    ):
        torch.library.opcheck(torch.ops.rlk.scatter_rewards_fwd.default, primitive_inputs(rewards, mask, **kw))


def test_torch_compile_fullgraph_matches_eager():
    rewards, mask, regions, costs = _random_case(8, 9, seed=12, n_regions=6)

    def step(rewards, mask, values, costs):
        return rlk.scatter_rewards(
            rewards,
            mask,
            reward_weights=[1.0, 0.5, 2.0],
            region_rewards=(values, regions[1]),
            overlong=(9, 3, 1.0),
            group_mode="grpo",
            group_size=4,
            placement="broadcast",
            costs=costs,
        )

    eager = step(rewards, mask, regions[0], costs)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")(rewards, mask, regions[0], costs)
    assert all(torch.equal(a, b) for a, b in zip(eager, compiled))
