"""Reference reward-to-token primitive ``scatter_rewards_fwd``: the readable specification and ground truth.

Not differentiable (rewards carry no gradient). Row ``i`` of the ``[B, T]`` response mask ``m`` is sequence ``i``;
``L_i = sum_t m_it`` is its length (its masked tokens) and ``last_i`` its last masked position.

1. **Score** of sequence ``i`` from its ``R`` reward columns ``x_ir`` (reward functions: a verifier, a format check,
   a reward model...) and their weights ``w_r``, added left to right in fp32 (fp64 for ground truth)::

       s_i = (...((0 + w_0 x_i0) + w_1 x_i1) + ... + w_{R-1} x_i,R-1) + o_i

   where a NaN ``x_ir`` adds nothing (TRL's ``nansum``: a reward function that does not apply to a sample returns
   None, stored as NaN), and ``o_i`` is DAPO's soft overlong punishment (0 when off)::

       o_i = -penalty                        if L_i > max_len
             -penalty * (e_i / cache)        otherwise,  e_i = max(L_i - (max_len - cache), 0)  (0 if cache == 0)

   (verl's ``overlong_buffer``: ``min(-e / cache * penalty_factor, 0)``, the same bits; TRL's
   ``get_soft_overlong_punishment``: ``penalty = 1``). The cost ``c_i`` of a constrained (safety) objective is taken
   as given: no columns, no overlong penalty.

2. **Normalization** (``mode``): the scores ``s``, the costs ``c``, the region rewards and the region costs are four
   separate lists, each normalized on its own by :func:`rlk.reference.advantages.group_advantages_fwd` over the
   groups of the sequences (a region belongs to its sequence's group; a group's regions in ascending region index,
   its sequences in ascending batch position)::

       grpo      (x - mean_g) / (std_g + eps)        std_g unbiased (Bessel), around the mean
       dr_grpo   x - mean_g
       rloo      x_i - mean_{j != i} x_j             (the leave-one-out baseline: n / (n - 1) (x - mean_g))

   with group_advantages' conventions (a singleton group has mean 0 and std 1; equal values give exactly 0).
   ``mode`` None keeps the values as they are. Rewards and costs never mix.

3. **Placement** on ``[B, T]`` (0 everywhere nothing lands): ``last``: the sequence's value ``a_i`` at ``last_i``
   (nowhere for an empty sequence), a region's value at the last masked position of its span ``[start, end)``
   (nowhere if the span has none); ``broadcast``: ``a_i`` at every masked position of row ``i``, a region's value
   at every masked position of its span. Values landing on one position are added in a fixed order: the
   sequence's value first, then its regions' in ascending region index.

Every statistic reads one group; every placement one row. :func:`scatter` is the primitive with the group
normalization passed in (the domestic backend passes its per-group one). :func:`contract_scale` gives the
per-position ``scale`` of the numerical contract from fp64 ground truth.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from rlk.core.abi import PLACEMENTS, REWARD_GROUP_MODES
from rlk.core.checks import compute_dtype
from rlk.reference import advantages

# ----------------------------------------------------------------------------------------------
# the three steps
# ----------------------------------------------------------------------------------------------


def overlong_penalty(lengths: torch.Tensor, max_len: int, cache: int, penalty: float, dtype: torch.dtype):
    """``o_i`` of the module docstring for integer ``lengths`` ``[B]``, in ``dtype``: ``-penalty * ratio`` with
    ``ratio = 1`` past ``max_len``, else ``e / cache`` (``e`` an exact integer, one correctly rounded division)."""
    excess = (lengths - (max_len - cache)).clamp(min=0, max=cache).to(dtype)
    # tensor / tensor: torch divides by a Python number through its reciprocal on CUDA (not correctly rounded)
    ratio = torch.where(lengths > max_len, 1.0, excess / torch.full_like(excess, max(cache, 1)))
    return -(penalty * ratio)


def sequence_scores(rewards, reward_weights, mask, overlong_max_len, overlong_cache, overlong_penalty_factor):
    """``s`` ``[B]`` (module docstring, step 1) in the compute dtype of ``rewards``."""
    cdt = compute_dtype(rewards.dtype)
    s = torch.zeros(rewards.shape[0], dtype=cdt, device=rewards.device)
    for r in range(rewards.shape[1]):
        x = rewards[:, r].to(cdt)
        s = s + torch.where(torch.isnan(x), 0.0, reward_weights[r].to(cdt) * x)
    if overlong_max_len is not None:
        lengths = mask.sum(1)
        s = s + overlong_penalty(lengths, overlong_max_len, overlong_cache, overlong_penalty_factor, cdt)
    return s


def region_groups(seq: torch.Tensor, group_index: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """The group id of each region (its sequence's): ``group_index[seq]``, or ``seq // group_size``."""
    if group_index is None:
        return seq // group_size
    return group_index[seq.clamp(0, group_index.shape[0] - 1)]  # clamped: unchecked spans never index outside


def normalize(values, group_index, group_size, mode, eps, group_fn=advantages.group_advantages_fwd):
    """``values`` ``[n]`` normalized over its groups (``group_index`` ids, or consecutive blocks of ``group_size``)
    by ``group_fn`` (a ``group_advantages_fwd``), or as they are for ``mode`` None (module docstring, step 2)."""
    values = values.to(compute_dtype(values.dtype))
    if mode is None or values.numel() == 0:
        return values
    if mode not in REWARD_GROUP_MODES:
        raise ValueError(f"mode: expected None or one of {', '.join(REWARD_GROUP_MODES)}, got {mode!r}")
    out = torch.empty_like(values)
    group_fn(values.contiguous(), group_index, group_size, None, mode, eps, out)
    return out


def last_positions(mask: torch.Tensor) -> torch.Tensor:
    """Per row, the last position where ``mask`` is true, or -1 (int64 ``[B]``)."""
    positions = torch.arange(mask.shape[1], device=mask.device)
    return torch.where(mask, positions, -1).amax(1)


def place_sequences(values: torch.Tensor, mask: torch.Tensor, placement: str, out: torch.Tensor) -> None:
    """``out`` ``[B, T]`` = each row's value at its last masked position (``last``) or at all of them (``broadcast``),
    0 elsewhere."""
    if placement == "broadcast":
        out.copy_(torch.where(mask, values[:, None].to(out.dtype), 0.0))
        return
    if placement != "last":
        raise ValueError(f"placement: expected one of {', '.join(PLACEMENTS)}, got {placement!r}")
    out.zero_()
    last = last_positions(mask)
    rows = (last >= 0).nonzero().squeeze(1)
    out[rows, last[rows]] = values[rows].to(out.dtype)


def add_regions(values: torch.Tensor, spans: torch.Tensor, mask: torch.Tensor, placement: str, out: torch.Tensor):
    """Add each region's value to ``out`` on its span, in ascending region index (module docstring, step 3)."""
    for k, (i, start, end) in enumerate(spans.tolist()):  # one host synchronization: fine for the spec
        tokens = mask[i, start:end]
        row = out[i, start:end]
        if placement == "broadcast":
            row.copy_(torch.where(tokens, row + values[k], row))
        else:
            hits = tokens.nonzero()
            if hits.numel():
                row[int(hits[-1, 0])] += values[k]


def scatter(
    group_fn: Callable,
    rewards,
    reward_weights,
    mask,
    costs,
    region_values,
    region_spans,
    cost_region_values,
    cost_region_spans,
    group_index,
    group_size,
    mode,
    eps,
    placement,
    overlong_max_len,
    overlong_cache,
    overlong_penalty_factor,
    rewards_out,
    costs_out,
) -> None:
    """:func:`scatter_rewards_fwd` with the group normalization ``group_fn`` (a ``group_advantages_fwd``)."""
    channels = [(rewards_out, region_values, region_spans)]
    scores = [sequence_scores(rewards, reward_weights, mask, overlong_max_len, overlong_cache, overlong_penalty_factor)]
    if costs_out is not None:
        channels.append((costs_out, cost_region_values, cost_region_spans))
        scores.append(costs)
    for (out, values, spans), s in zip(channels, scores):
        place_sequences(normalize(s, group_index, group_size, mode, eps, group_fn), mask, placement, out)
        if values is not None and values.numel():
            ids = region_groups(spans[:, 0], group_index, group_size)
            add_regions(normalize(values, ids, 0, mode, eps, group_fn), spans, mask, placement, out)


def scatter_rewards_fwd(
    rewards,
    reward_weights,
    mask,
    costs,
    region_values,
    region_spans,
    cost_region_values,
    cost_region_spans,
    group_index,
    group_size,
    mode,
    eps,
    placement,
    overlong_max_len,
    overlong_cache,
    overlong_penalty_factor,
    rewards_out,
    costs_out,
):
    """Token-level rewards (and costs) of sequences and regions (see the module docstring for the math).

    Args:
        rewards: ``[B, R]`` fp32 (fp64 for ground truth) reward columns, ``B >= 1``.
        reward_weights: ``[R]``, ``rewards.dtype``.
        mask: ``[B, T]`` bool response mask.
        costs: ``[B]`` ``rewards.dtype``, given exactly when ``costs_out`` is (zeros for region costs alone).
        region_values, region_spans: ``[S]`` values and ``[S, 3]`` int64 ``(seq, start, end)``, or None.
        cost_region_values, cost_region_spans: the same for costs, or None.
        group_index: ``[B]`` int64 group ids, or None: consecutive groups of ``group_size``.
        mode: one of :data:`REWARD_GROUP_MODES`, or None (no normalization).
        eps: added to the std in ``grpo``.
        placement: ``"last"`` or ``"broadcast"``.
        overlong_max_len, overlong_cache, overlong_penalty_factor: the overlong punishment, or None for the first.
        rewards_out: ``[B, T]``, ``rewards.dtype``: written.
        costs_out: ``[B, T]`` or None: written when given.
    """
    scatter(
        advantages.group_advantages_fwd,
        rewards,
        reward_weights,
        mask,
        costs,
        region_values,
        region_spans,
        cost_region_values,
        cost_region_spans,
        group_index,
        group_size,
        mode,
        eps,
        placement,
        overlong_max_len,
        overlong_cache,
        overlong_penalty_factor,
        rewards_out,
        costs_out,
    )


# ----------------------------------------------------------------------------------------------
# the contract's scale
# ----------------------------------------------------------------------------------------------


def _members(group_index, group_size: int, n: int, mode, device) -> torch.Tensor:
    """The dense groups (:func:`rlk.reference.advantages.dense_groups`) the normalization reads: each value alone
    for ``mode`` None."""
    if mode is None:
        return advantages.dense_groups(None, 1, n, device)
    return advantages.dense_groups(group_index, group_size, n, device)


def _group_scales(values, normalized, rounding, members, mode, eps) -> torch.Tensor:
    """Per element ``1 + max_g |a| + k_g * max_g rounding`` (fp64): the error of a normalized value follows the
    largest value of its group (the centred values share the rounding of the mean) and, where the value was itself
    rounded before normalization (``rounding``: the magnitude of the terms added up), that rounding scaled by the
    normalization's factor ``k_g`` (``1 / (std_g + eps)`` for grpo, ``n / (n - 1)`` for rloo, 1 otherwise)."""
    valid = members >= 0
    safe = members.clamp(min=0)
    n = valid.sum(1).double()
    biggest = torch.where(valid, normalized[safe].abs(), 0.0).amax(1)
    rounded = torch.where(valid, rounding[safe], 0.0).amax(1)
    k = torch.ones_like(n)
    if mode == "grpo":
        x = torch.where(valid, values[safe], 0.0)
        centred = torch.where(valid, x - (x.sum(1) / n)[:, None], 0.0)
        std = torch.sqrt((centred * centred).sum(1) / (n - 1).clamp(min=1))
        k = torch.where(n > 1, 1.0 / (std + eps), 1.0 / (1.0 + eps))
    elif mode == "rloo":
        k = torch.where(n > 1, n / (n - 1).clamp(min=1), 1.0)
    scale = torch.empty_like(values)
    scale[members[valid]] = (1.0 + biggest + k * rounded)[:, None].expand(members.shape)[valid]
    return scale


def contract_scale(
    rewards,
    reward_weights,
    mask,
    costs,
    region_values,
    region_spans,
    cost_region_values,
    cost_region_spans,
    group_index,
    group_size,
    mode,
    eps,
    placement,
    overlong_max_len,
    overlong_cache,
    overlong_penalty_factor,
) -> dict[str, torch.Tensor]:
    """Per-position scales (fp64, ``[B, T]``) of ``rewards_out`` and, where costs are given, ``costs_out``: 1 plus the
    scale of every value placed there (:func:`_group_scales`; a value's own rounding counts for the scores only, the
    sum of ``|w_r x_ir|`` and ``|o_i|``, unless the score is one column of weight 1 without overlong penalty, hence
    exact). Inputs as :func:`scatter_rewards_fwd`'s, in fp64."""
    n_rows = rewards.shape[0]
    dev = rewards.device
    s = sequence_scores(rewards, reward_weights, mask, overlong_max_len, overlong_cache, overlong_penalty_factor)
    terms = torch.where(torch.isnan(rewards), 0.0, (rewards * reward_weights[None, :]).abs()).sum(1)
    if overlong_max_len is not None:
        o = overlong_penalty(mask.sum(1), overlong_max_len, overlong_cache, overlong_penalty_factor, s.dtype)
        terms = terms + o.abs()
    exact = rewards.shape[1] == 1 and bool(reward_weights[0] == 1) and overlong_max_len is None
    rounding = torch.zeros_like(s) if exact else terms
    by_seq = _members(group_index, group_size, n_rows, mode, dev)
    channels = {"rewards": (s, rounding, region_values, region_spans)}
    if costs is not None:
        c = costs.double()
        channels["costs"] = (c, torch.zeros_like(s), cost_region_values, cost_region_spans)
    scales = {}
    for name, (x, rounding_x, values, spans) in channels.items():
        a = normalize(x, group_index, group_size, mode, eps)
        out = torch.empty(mask.shape, dtype=torch.float64, device=dev)
        place_sequences(_group_scales(x, a, rounding_x, by_seq, mode, eps), mask, placement, out)
        if values is not None and values.numel():
            ids = region_groups(spans[:, 0], group_index, group_size)
            v = values.double()
            members = _members(ids, 0, v.shape[0], mode, dev)
            a_v = normalize(v, ids, 0, mode, eps)
            add_regions(_group_scales(v, a_v, torch.zeros_like(v), members, mode, eps), spans, mask, placement, out)
        scales[name] = 1.0 + out
    return scales
