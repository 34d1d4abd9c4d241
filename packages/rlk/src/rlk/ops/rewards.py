"""Public reward-to-token op: ``scatter_rewards``.

One ``torch.library.custom_op`` (``rlk::scatter_rewards_fwd``) with a fake implementation, so the op traces under
``torch.compile(fullgraph=True)``. Not differentiable: rewards and costs carry no gradient, so the inputs are
detached and the outputs never require grad. The math is specified in ``rlk.reference.rewards``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from rlk.core import checks, custom_op
from rlk.core.abi import PLACEMENTS, REWARD_GROUP_MODES
from rlk.ops.advantages import _FLOAT_DTYPES, _INDEX_DTYPES, _bool_mask, _float_input, _groups
from rlk.ops.spans import check_values as check_span_values

_MASK_DTYPES = (torch.bool, *_FLOAT_DTYPES, *_INDEX_DTYPES)


# ---------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------


def _like_rewards(name: str, t, x: Tensor, shape: tuple[int, ...], what: str) -> Tensor:
    """A float tensor of ``shape`` on ``x``'s device, as ``x``'s dtype (fp64 exactly when ``x`` is: checked by
    :func:`primitive_inputs`' ``checks.same_dtype``)."""
    v = _float_input(name, t)
    if tuple(v.shape) != shape:
        raise ValueError(f"{name}: expected shape {list(shape)} ({what}), got {tuple(v.shape)}")
    if v.device != x.device:
        raise ValueError(f"{name}: expected device {x.device} (the device of rewards), got {v.device}")
    return v


def _response_mask(mask, x: Tensor) -> Tensor:
    if not isinstance(mask, Tensor):
        raise TypeError(f"response_mask: expected a torch.Tensor, got {type(mask).__name__}")
    if mask.dim() != 2 or mask.shape[0] != x.shape[0]:
        raise ValueError(
            f"response_mask: expected shape [B, T] with B = {x.shape[0]} (the rows of rewards), got {tuple(mask.shape)}"
        )
    if mask.device != x.device:
        raise ValueError(f"response_mask: expected device {x.device} (the device of rewards), got {mask.device}")
    if mask.dtype not in _MASK_DTYPES:
        raise TypeError(f"response_mask: expected dtype bool or an int/float dtype holding 0/1, got {mask.dtype}")
    return mask.detach().contiguous()


def _weights(weights, x: Tensor) -> Tensor:
    n = x.shape[1]
    if weights is None:
        return torch.ones(n, dtype=x.dtype, device=x.device)
    if isinstance(weights, Tensor):
        return _like_rewards("reward_weights", weights, x, (n,), "one weight per reward column")
    if not isinstance(weights, (list, tuple)):
        raise TypeError(f"reward_weights: expected a tensor or a sequence of numbers, got {type(weights).__name__}")
    if len(weights) != n:
        raise ValueError(f"reward_weights: expected {n} weights (one per reward column), got {len(weights)}")
    values = [checks.number(f"reward_weights[{k}]", w, dtype=torch.float32) for k, w in enumerate(weights)]
    return torch.tensor(values, dtype=x.dtype, device=x.device)


def _regions(name: str, pair, x: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """``(values [S], spans [S, 3] int64)`` of ``region_rewards`` / ``region_costs``; ``(None, None)`` when absent
    or empty."""
    if pair is None:
        return None, None
    if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
        raise TypeError(f"{name}: expected a (values [S], spans [S, 3]) pair, got {type(pair).__name__}")
    values, spans = pair
    if not isinstance(values, Tensor):
        raise TypeError(f"{name}: values: expected a torch.Tensor, got {type(values).__name__}")
    if values.dim() != 1:
        raise ValueError(f"{name} values: expected shape [S] (one value per region), got {tuple(values.shape)}")
    v = _like_rewards(f"{name} values", values, x, tuple(values.shape), "one value per region")
    if not isinstance(spans, Tensor):
        raise TypeError(f"{name} spans: expected a torch.Tensor, got {type(spans).__name__}")
    if spans.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name} spans: expected an integer dtype, got {spans.dtype}")
    if spans.dim() == 2 and spans.shape[0] == v.shape[0] and spans.shape[1] == 4:
        spans = spans[:, :3]  # an rlk.multimodal span table: (seq, start, end, tag); the tag is not used here
    if tuple(spans.shape) != (v.shape[0], 3):
        raise ValueError(
            f"{name} spans: expected shape [{v.shape[0]}, 3] (seq, start, end per region) or [{v.shape[0]}, 4] (an "
            f"rlk.multimodal span table), got {tuple(spans.shape)}"
        )
    if spans.device != x.device:
        raise ValueError(f"{name} spans: expected device {x.device} (the device of rewards), got {spans.device}")
    if v.shape[0] == 0:
        return None, None
    return v, spans.detach().to(torch.int64).contiguous()


def _overlong(overlong) -> tuple[int | None, int, float]:
    if overlong is None:
        return None, 0, 0.0
    if not (isinstance(overlong, (tuple, list)) and len(overlong) == 3):
        raise TypeError(f"overlong: expected (max_len, cache, penalty), got {overlong!r}")
    max_len = checks.integer("overlong max_len", overlong[0], minimum=1)
    cache = checks.integer("overlong cache", overlong[1], minimum=0)
    if cache > max_len:
        raise ValueError(f"overlong cache: {cache} is longer than max_len = {max_len}")
    penalty = checks.number("overlong penalty", overlong[2], minimum=0.0, dtype=torch.float32)
    return max_len, cache, penalty


# ---------------------------------------------------------------------------
# the op
# ---------------------------------------------------------------------------


def _outputs(rewards: Tensor, reward_weights, mask: Tensor, costs, region_values, region_spans, cost_region_values, *_):
    token_rewards = torch.empty(mask.shape, dtype=rewards.dtype, device=rewards.device)
    return token_rewards, torch.empty_like(token_rewards) if costs is not None else custom_op.placeholder(token_rewards)


scatter_rewards_op = custom_op.declare("scatter_rewards")


@scatter_rewards_op.forward(outputs=_outputs)
def _scatter_rewards_fwd(
    primitive,
    out,
    rewards: Tensor,
    reward_weights: Tensor,
    mask: Tensor,
    costs: Tensor | None,
    region_values: Tensor | None,
    region_spans: Tensor | None,
    cost_region_values: Tensor | None,
    cost_region_spans: Tensor | None,
    group_index: Tensor | None,
    group_size: int,
    mode: str | None,
    eps: float,
    placement: str,
    overlong_max_len: int | None,
    overlong_cache: int,
    overlong_penalty: float,
) -> tuple[Tensor, Tensor]:
    token_rewards, token_costs = out
    check_span_values((("region_rewards spans", region_spans), ("region_costs spans", cost_region_spans)), *mask.shape)
    if token_rewards.numel() == 0:
        return
    primitive(
        rewards,
        reward_weights,
        _bool_mask(mask, "response_mask"),
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
        overlong_penalty,
        token_rewards,
        token_costs if costs is not None else None,
    )


def scatter_rewards(
    rewards: Tensor,
    response_mask: Tensor,
    *,
    reward_weights: Tensor | Sequence[float] | None = None,
    region_rewards: tuple[Tensor, Tensor] | None = None,
    overlong: tuple[int, int, float] | None = None,
    placement: str = "last",
    group_mode: str | None = None,
    group_size: int | None = None,
    group_index: Tensor | None = None,
    eps: float = 1e-6,
    costs: Tensor | None = None,
    region_costs: tuple[Tensor, Tensor] | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Sequence- and region-level rewards (and costs) to token-level rewards or advantages ``[B, T]``.

    Per sequence ``i`` (row ``i`` of ``response_mask``, ``L_i`` its masked tokens), the score adds the reward
    columns ``x_ir`` (a verifier, a format check, a reward model, ...) with their weights, left to right, skipping
    NaN entries (TRL's ``nansum``: a reward function returns None where it does not apply), and the overlong
    penalty ``o_i`` (DAPO's soft overlong punishment)::

        s_i = sum_r w_r x_ir + o_i
        o_i = -penalty * clamp(L_i - (max_len - cache), 0, cache) / cache   (L_i <= max_len; 0 when cache = 0)
            = -penalty                                                       (L_i > max_len)

    Then, with ``group_mode``, ``s`` is normalized over each group ``g`` (``n`` members; the same math as
    :func:`rlk.group_advantages`, whose conventions hold: singleton groups take mean 0 and std 1)::

        grpo      (s - mean_g) / (std_g + eps)     std_g unbiased (Bessel), as verl, TRL and OpenRLHF
        dr_grpo   s - mean_g
        rloo      s_i - mean_{j != i} s_j          (the leave-one-out baseline)

    and placed on the row: ``placement="last"`` at the last masked token (verl's reward tensor, OpenRLHF's
    ``eos_indices``; nothing for an empty row), ``"broadcast"`` on every masked token (GRPO's token advantages).

    Region rewards (a span of one sequence's tokens: a reasoning step scored by a process reward model, a
    sentence or a grounded box of a multimodal answer) are normalized the same way over the regions of the
    group (a GRPO group's step rewards pooled, as DeepSeekMath's process supervision; a group's only region keeps
    its value, the singleton convention) and placed on their span: at its last masked token or on all of them.
    Values landing on one token add up: the sequence's value first, then the regions' in ascending region index.
    ``placement="last"`` followed by ``rlk.discounted_returns(gamma=1)`` gives each token the sum of the values from
    it to the end (process supervision's advantage); ``group_mode=None`` with ``"last"`` gives the token rewards
    GAE takes.

    Costs (constrained / safety objectives) go through the same steps on their own, never mixed with the rewards:
    their own statistics, their own output.

    Args:
        rewards: ``[B]`` or ``[B, R]`` float32 / bfloat16 / float16 (float64 for reference runs): one score per
            sequence, or ``R`` reward columns. NaN entries are skipped; an inf propagates.
        response_mask: ``[B, T]``; bool, or int/float 0/1 (checked, one synchronization; ``RLK_CHECK_VALUES=0``
            skips it).
        reward_weights: ``R`` weights: a list of finite numbers (copied to the device on every call), or a ``[R]``
            float tensor on ``rewards``' device (used as it is: what CUDA graph capture needs); default 1 each (TRL's
            ``reward_weights``).
        region_rewards: ``(values [S], spans [S, 3])``: a float value per region and integer ``(seq, start, end)``
            rows, the half-open token span ``[start, end)`` of sequence ``seq`` (``0 <= seq < B``,
            ``0 <= start <= end <= T``; checked, one host synchronization for all the spans of the call, which
            ``RLK_CHECK_VALUES=0`` skips: then a span outside the row reads nothing outside it). Regions may overlap.
            An ``rlk.multimodal`` span table (int32 ``[S, 4]`` rows ``(seq, start, end, tag)``, e.g. a batch's
            ``region_spans``) is taken as it is; its tag column is not used.
        overlong: ``(max_len, cache, penalty)``: verl's ``overlong_buffer`` (``max_resp_len``, ``len``,
            ``penalty_factor``); TRL's ``get_soft_overlong_punishment(max_len, cache)`` is ``penalty = 1``.
            ``0 <= cache <= max_len``, ``penalty >= 0``. ``L_i`` counts the masked tokens of the row.
        placement: ``"last"`` or ``"broadcast"`` (sequences and regions alike).
        group_mode: None (no normalization), ``"grpo"``, ``"dr_grpo"`` or ``"rloo"``.
        group_size: groups of consecutive sequences of this size (divides ``B``), or
        group_index: ``[B]`` integer group ids (any values, any order). With ``group_mode``, exactly one of them.
        eps: ``> 0``, added to the std (``grpo``); verl uses 1e-6, TRL 1e-4.
        costs: ``[B]`` float: one cost per sequence (no columns, no overlong penalty).
        region_costs: ``(values [S2], spans [S2, 3])``: region costs, as ``region_rewards``.

    Returns:
        ``token_rewards`` ``[B, T]`` float32 (float64 for float64 rewards), 0 wherever nothing lands; with
        ``costs`` or ``region_costs``, the pair ``(token_rewards, token_costs)``. Not differentiable.

    Batch invariance: on backends that promise it, a sequence's outputs are bitwise the same whatever the other
    groups and wherever its group sits in the batch, as long as the group's members and their regions keep their
    relative order; without ``group_mode`` they depend on the sequence's own row and regions only.

    Host synchronization: none, but for the value checks of the regions' spans and of a mask that is not bool
    (``RLK_CHECK_VALUES=0`` turns them off, e.g. for CUDA graph capture).
    """
    inputs = primitive_inputs(
        rewards,
        response_mask,
        reward_weights=reward_weights,
        region_rewards=region_rewards,
        overlong=overlong,
        placement=placement,
        group_mode=group_mode,
        group_size=group_size,
        group_index=group_index,
        eps=eps,
        costs=costs,
        region_costs=region_costs,
    )
    token_rewards, token_costs = _scatter_rewards_fwd(*inputs)
    return (token_rewards, token_costs) if costs is not None or region_costs is not None else token_rewards


def primitive_inputs(
    rewards: Tensor,
    response_mask: Tensor,
    *,
    reward_weights: Tensor | Sequence[float] | None = None,
    region_rewards: tuple[Tensor, Tensor] | None = None,
    overlong: tuple[int, int, float] | None = None,
    placement: str = "last",
    group_mode: str | None = None,
    group_size: int | None = None,
    group_index: Tensor | None = None,
    eps: float = 1e-6,
    costs: Tensor | None = None,
    region_costs: tuple[Tensor, Tensor] | None = None,
) -> tuple:
    """:func:`scatter_rewards`' arguments, checked, as the inputs of the ABI primitive ``scatter_rewards_fwd`` in its
    order (``rlk.core.abi``; the mask as given, converted to bool inside the op): what ground truth and the
    contract's scale (``rlk.reference.rewards.contract_scale``) take."""
    x = _float_input("rewards", rewards)
    if x.dim() == 1:
        x = x[:, None]
    if x.dim() != 2 or x.shape[1] == 0:
        raise ValueError(f"rewards: expected shape [B] or [B, R] with R >= 1, got {tuple(rewards.shape)}")
    mask = _response_mask(response_mask, x)
    weights = _weights(reward_weights, x)
    cost = None if costs is None else _like_rewards("costs", costs, x, (x.shape[0],), "one cost per sequence")
    region_values, region_spans = _regions("region_rewards", region_rewards, x)
    cost_values, cost_spans = _regions("region_costs", region_costs, x)
    if region_costs is not None and cost is None:  # region costs only: the sequences' costs are 0
        cost = torch.zeros(x.shape[0], dtype=x.dtype, device=x.device)
    placement = checks.choice("placement", placement, PLACEMENTS)
    eps = checks.number("eps", eps, above=0.0, dtype=torch.float32)
    index, size = None, 1
    if group_mode is not None:
        group_mode = checks.choice("group_mode", group_mode, REWARD_GROUP_MODES)
        index, size = _groups(group_size, group_index, x[:, 0], "rewards[:, 0]")
    elif group_size is not None or group_index is not None:
        raise ValueError("group_size, group_index: they group sequences for group_mode, which is None")
    max_len, cache, penalty = _overlong(overlong)
    checks.same_dtype(
        ("rewards", rewards),
        ("reward_weights", reward_weights),
        ("costs", costs),
        ("region_rewards values", None if region_rewards is None else region_rewards[0]),
        ("region_costs values", None if region_costs is None else region_costs[0]),
    )
    return (
        x,
        weights,
        mask,
        cost,
        region_values,
        region_spans,
        cost_values,
        cost_spans,
        index,
        size,
        group_mode,
        eps,
        placement,
        max_len,
        cache,
        penalty,
    )
