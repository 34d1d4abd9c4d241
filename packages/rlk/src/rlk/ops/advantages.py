"""Public advantage and return ops: ``group_advantages``, ``masked_whiten``,
``discounted_returns`` and ``gae``.

Each op is one ``torch.library.custom_op`` (``rlk::<op>_fwd``) with a fake implementation, so
the ops trace under ``torch.compile(fullgraph=True)``. None is differentiable: they compute
training targets from rewards, scores and values, which carry no gradient, so there is no
``register_autograd``; the public functions detach their inputs and the outputs never require
grad. The custom ops dispatch to the backend chosen by ``rlk.core.dispatch`` at run time. The math
is specified in ``rlk.reference.advantages``.

Inputs may be float32, bfloat16 or float16 (16-bit inputs are upcast to float32, exactly) or
float64 (reference-only ground truth); outputs are float32 (float64 for float64 inputs).
Masks may be bool or int/float 0/1; a non-bool mask's values are checked inside the custom op
(one host synchronization; ``RLK_CHECK_VALUES=0`` skips it, and then any non-zero counts as 1).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlk.core import checks, custom_op
from rlk.core.abi import EPS_MODES, GROUP_MODES, PASSK_MODES, RETURN_MASK_MODES, recurrence_constants

_UPCAST = (torch.float16, torch.bfloat16)
_FLOAT_DTYPES = (torch.float32, torch.float64) + _UPCAST
_INDEX_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


# ---------------------------------------------------------------------------
# argument checks
# ---------------------------------------------------------------------------


def _float_input(name: str, x: Tensor) -> Tensor:
    """``x`` detached, as fp32 (fp64 stays fp64), contiguous."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _FLOAT_DTYPES:
        raise TypeError(
            f"{name}: expected dtype float32, bfloat16 or float16 (float64 for reference runs), got {x.dtype}"
        )
    x = x.detach()
    if x.dtype in _UPCAST:
        x = x.float()
    return x.contiguous()


def _check_like(name: str, t: Tensor, like: Tensor, like_name: str) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")
    if t.shape != like.shape:
        raise ValueError(f"{name}: expected shape {tuple(like.shape)} (the shape of {like_name}), got {tuple(t.shape)}")
    if t.device != like.device:
        raise ValueError(f"{name}: expected device {like.device} (the device of {like_name}), got {t.device}")


def _mask_input(mask: Tensor, like: Tensor, like_name: str) -> Tensor:
    _check_like("mask", mask, like, like_name)
    if mask.dtype != torch.bool and mask.dtype not in _FLOAT_DTYPES + _INDEX_DTYPES:
        raise TypeError(f"mask: expected dtype bool or an int/float dtype holding 0/1, got {mask.dtype}")
    return mask.detach().contiguous()


def _bool_mask(mask: Tensor, name: str = "mask") -> Tensor:
    """The ABI's bool mask; inside the custom op, so the value check may synchronize (its error names ``name``)."""
    if mask.dtype == torch.bool:
        return mask
    if checks.values_checked():
        bad = (mask != 0) & (mask != 1)
        if bool(bad.any()):
            i = int(bad.reshape(-1).nonzero()[0, 0])
            found = mask.reshape(-1)[i].item()
            raise ValueError(f"{name}: values must be 0 or 1; found {found} at flat position {i}")
    return mask != 0


def _groups(
    group_size: int | None, group_index: Tensor | None, like: Tensor, like_name: str
) -> tuple[Tensor | None, int]:
    """The primitives' ``(group_index, group_size)`` from exactly one of the two (``like``: the ``[B]`` tensor whose
    rows they group): int64 ids and 0, or None and a size that divides ``B``."""
    if (group_size is None) == (group_index is None):
        raise ValueError("group_size, group_index: pass exactly one of them")
    if group_size is not None:
        group_size = checks.integer("group_size", group_size, minimum=1)
        if like.shape[0] % group_size:
            raise ValueError(f"group_size: {group_size} does not divide the batch size B = {like.shape[0]}")
        return None, group_size
    _check_like("group_index", group_index, like, like_name)
    if group_index.dtype not in _INDEX_DTYPES:
        raise TypeError(f"group_index: expected an integer dtype, got {group_index.dtype}")
    return group_index.detach().to(torch.int64).contiguous(), 0


def _like_first(x: Tensor, *_) -> Tensor:
    """The output allocator of a one-output op: ``torch.empty_like`` of its first input."""
    return torch.empty_like(x)


# ---------------------------------------------------------------------------
# group_advantages
# ---------------------------------------------------------------------------


group_advantages_op = custom_op.declare("group_advantages")


@group_advantages_op.forward(outputs=_like_first)
def _group_advantages_fwd(
    primitive,
    out,
    scores: Tensor,
    group_index: Tensor | None,
    group_size: int,
    lengths: Tensor | None,
    mode: str,
    eps: float,
) -> Tensor:
    if scores.shape[0] == 0:
        return
    checks.check_count_values({"lengths": lengths})
    primitive(scores, group_index, group_size, lengths, mode, eps, out)


def group_advantages(
    scores: Tensor,
    *,
    group_size: int | None = None,
    group_index: Tensor | None = None,
    mode: str = "grpo",
    eps: float = 1e-6,
    lengths: Tensor | None = None,
) -> Tensor:
    """Group-relative advantage of each sequence's score (GRPO family; one value per sequence).

    Sequences sharing a prompt form a group ``g`` of ``n`` members. With ``mean_g`` and the
    unbiased (Bessel) ``std_g`` of the group's scores, computed around the mean (two passes,
    pivoted on the group's first score, never ``E[s^2] - E[s]^2``)::

        grpo                   (s - mean_g) / (std_g + eps)
        dr_grpo                s - mean_g                                 (Dr.GRPO: no std)
        rloo                   s_i - mean_{j != i} s_j  = n / (n - 1) * (s - mean_g)
        reinforce_pp_baseline  s - mean_g   (REINFORCE++-baseline; broadcast it over the tokens and
                               whiten with ``masked_whiten(adv[:, None] * mask, mask)`` as verl does)
        opo                    s - sum_g(l * s) / sum_g(l)   (OPO's length-weighted optimal baseline,
                               ``l = lengths``; the plain mean where a group's lengths sum to 0)
        gpg                    alpha * (s - mean_g),  alpha = B / max(B_valid, 1)
        grpo_passk             (max_g - second_g) / (std_g + eps) for the group's best (its first member
                               holding the max), 0 for the others (Pass@k, arXiv 2503.19595; verl's grpo_passk)
        dr_grpo_passk          max_g - second_g for the best, 0 for the others (no std)

    For ``gpg`` (GPG, arXiv 2504.02546), ``B_valid`` is the number of sequences of this call
    whose advantage ``s - mean_g`` is non-zero (GPG's correction for groups that carry no
    gradient); so ``gpg`` depends on the whole call, not only on the group. (verl's ``gpg``
    estimator uses ``B / count_nonzero(scores)`` instead; for that, scale ``dr_grpo`` yourself.)

    Singleton groups take mean 0 and std 1 (verl): the advantage is ``s / (1 + eps)`` for
    ``grpo`` and ``grpo_passk``, ``s`` for the other modes. A group of equal scores gives exactly 0.

    Args:
        scores: ``[B]`` float32 / bfloat16 / float16 (float64 for reference runs): one score
            per sequence (an outcome reward, or the sum of its token rewards).
        group_size: groups are consecutive blocks of this many sequences (must divide ``B``).
        group_index: or ``[B]`` integer group ids (any values, any order; members keep their
            batch order within a group). Pass exactly one of ``group_size`` and ``group_index``.
        mode: one of ``grpo``, ``dr_grpo``, ``rloo``, ``reinforce_pp_baseline``, ``opo``, ``gpg``,
            ``grpo_passk``, ``dr_grpo_passk``.
        eps: ``> 0``, added to the std (``grpo`` only); verl uses 1e-6, TRL 1e-4.
        lengths: ``[B]`` response lengths (tokens, ``>= 0``), required by ``opo`` and only by it.

    Returns:
        ``[B]`` float32 advantages (float64 for float64 scores); not differentiable.

    Batch invariance: on backends that promise it, a group's advantages are bitwise the same
    whatever the other groups and wherever its members sit in the batch, as long as they keep
    their relative order (``gpg`` excepted: its ``alpha`` depends on the whole call).
    """
    x = _float_input("scores", scores)
    if x.dim() != 1:
        raise ValueError(f"scores: expected shape [B] (one score per sequence), got {tuple(x.shape)}")
    if mode not in PASSK_MODES:
        mode = checks.choice("mode", mode, GROUP_MODES)
    eps = checks.number("eps", eps, above=0.0, dtype=torch.float32)
    index, size = _groups(group_size, group_index, x, "scores")
    lens = None
    if mode == "opo":
        if lengths is None:
            raise ValueError("lengths: mode='opo' needs the response lengths [B]")
        _check_like("lengths", lengths, x, "scores")
        if lengths.dtype == torch.bool or lengths.dtype not in _FLOAT_DTYPES + _INDEX_DTYPES:
            raise TypeError(f"lengths: expected an integer or float dtype, got {lengths.dtype}")
        lens = lengths.detach().to(x.dtype).contiguous()
    elif lengths is not None:
        raise ValueError(f"lengths: only mode='opo' uses lengths (mode is {mode!r})")
    return _group_advantages_fwd(x, index, size, lens, mode, eps)


# ---------------------------------------------------------------------------
# masked_whiten
# ---------------------------------------------------------------------------


masked_whiten_op = custom_op.declare("masked_whiten")


@masked_whiten_op.forward(outputs=_like_first)
def _masked_whiten_fwd(
    primitive, out, x: Tensor, mask: Tensor, unbiased: bool, eps: float, eps_mode: str, shift_mean: bool
) -> Tensor:
    if x.numel():
        primitive(x.reshape(-1), _bool_mask(mask).reshape(-1), unbiased, eps, eps_mode, shift_mean, out.view(-1))


def masked_whiten(
    x: Tensor,
    mask: Tensor,
    *,
    unbiased: bool = True,
    eps: float = 1e-8,
    shift_mean: bool = True,
    eps_mode: str = "add",
) -> Tensor:
    """Whiten ``x`` with the mean and variance of its masked entries (all of them, across rows).

    ``out = (x - mu) * rsqrt(var + eps)`` where ``mask``, and 0 elsewhere, with ``mu`` and
    ``var`` over the ``n`` masked entries; the variance is taken around the mean (two passes).

    Args:
        x: any shape, float32 / bfloat16 / float16 (float64 for reference runs).
        mask: the shape of ``x``; bool, or int/float 0/1.
        unbiased: ``var = sum (x - mu)^2 / (n - 1)`` (verl, the default) or ``/ n`` (OpenRLHF).
        eps: ``> 0``.
        shift_mean: when False the mean is added back: ``(x - mu) * rstd + mu`` (verl's option).
        eps_mode: ``"add"``: ``rsqrt(var + eps)`` (verl); ``"clamp"``: ``rsqrt(max(var, eps))``
            (OpenRLHF's advantage normalization).

    Returns:
        float32 tensor of ``x``'s shape (float64 for float64 ``x``); not differentiable. Entries
        where ``mask`` is 0 are 0 (verl and OpenRLHF apply the formula there too; their losses
        ignore those entries). An empty mask gives all zeros; one masked entry gives 0 (its
        ``mu`` without ``shift_mean``); ``n - 1`` is taken as 1 when ``n = 1`` (verl raises).

    The statistics span the whole call, so a row's output depends on the other rows by
    definition; on the Triton backend it is deterministic (fixed-order reductions, no atomics).
    """
    x = _float_input("x", x)
    mask = _mask_input(mask, x, "x")
    unbiased = checks.flag("unbiased", unbiased)
    shift_mean = checks.flag("shift_mean", shift_mean)
    eps = checks.number("eps", eps, above=0.0, dtype=torch.float32)
    eps_mode = checks.choice("eps_mode", eps_mode, EPS_MODES)
    return _masked_whiten_fwd(x, mask, unbiased, eps, eps_mode, shift_mean)


# ---------------------------------------------------------------------------
# discounted_returns
# ---------------------------------------------------------------------------


def _rows(name: str, x: Tensor) -> Tensor:
    if x.dim() < 1:
        raise ValueError(f"{name}: expected shape [..., T], got {tuple(x.shape)}")
    return x.reshape(math.prod(x.shape[:-1]), x.shape[-1])


discounted_returns_op = custom_op.declare("discounted_returns")


@discounted_returns_op.forward(outputs=_like_first)
def _discounted_returns_fwd(primitive, out, rewards: Tensor, mask: Tensor, gamma: float, mask_mode: str) -> Tensor:
    if rewards.numel():
        gamma_c, _ = recurrence_constants(gamma, 1.0, rewards.dtype)
        primitive(rewards, _bool_mask(mask), gamma_c, mask_mode, out)


def discounted_returns(rewards: Tensor, mask: Tensor, gamma: float, *, mask_mode: str = "carry") -> Tensor:
    """Discounted returns ``G_t = r_t + gamma * G_{t+1}`` along the last dim (REINFORCE++ returns).

    ``G`` is 0 after the last position. ``mask_mode`` says what a position with mask 0 does:

    * ``"carry"`` (default, rlk's canonical form): it is skipped, the return passes through
      unchanged (``G_t = G_{t+1}``: no reward, no discount step), like GAE's masked positions;
    * ``"reset"`` (verl's REINFORCE++): ``G_t = r_t + gamma * m_{t+1} * G_{t+1}``, i.e. the
      running return restarts at 0 after each masked position;
    * ``"zero"`` (OpenRLHF): ``G_t = m_t * r_t + gamma * G_{t+1}`` (masked rewards count as 0,
      discounting continues through masked positions).

    The three agree on the unmasked positions of a right-padded row (mask 1...1 0...0) whose
    padding rewards are 0. REINFORCE++ then whitens: ``masked_whiten(G, mask)``.

    Args:
        rewards: ``[..., T]`` float32 / bfloat16 / float16 (float64 for reference runs).
        mask: the shape of ``rewards``; bool, or int/float 0/1.
        gamma: the discount, in ``[0, 1]``; used rounded to float32 for float32 inputs, as fp32
            torch code (verl, OpenRLHF) does.
        mask_mode: ``"carry"``, ``"reset"`` or ``"zero"``.

    Returns:
        ``G`` of ``rewards``' shape, float32 (float64 for float64 rewards); not differentiable.
        Rows are independent; on backends that promise it a row's returns are bitwise the same
        whatever the other rows.
    """
    x = _float_input("rewards", rewards)
    mask = _mask_input(mask, x, "rewards")
    gamma = checks.number("gamma", gamma, minimum=0.0, maximum=1.0)
    mask_mode = checks.choice("mask_mode", mask_mode, RETURN_MASK_MODES)
    out = _discounted_returns_fwd(_rows("rewards", x), _rows("mask", mask), gamma, mask_mode)
    return out.view(x.shape)


# ---------------------------------------------------------------------------
# gae
# ---------------------------------------------------------------------------


gae_op = custom_op.declare("gae")


@gae_op.forward(outputs=lambda rewards, *_: (torch.empty_like(rewards), torch.empty_like(rewards)))
def _gae_fwd(
    primitive, out, rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float
) -> tuple[Tensor, Tensor]:
    advantages, returns = out
    if rewards.numel():
        gamma_c, gamma_lam_c = recurrence_constants(gamma, lam, rewards.dtype)
        primitive(rewards, values, _bool_mask(mask), gamma_c, gamma_lam_c, advantages, returns)


def gae(
    rewards: Tensor, values: Tensor, mask: Tensor, *, gamma: float = 1.0, lam: float = 1.0
) -> tuple[Tensor, Tensor]:
    """Generalized advantage estimation (PPO), with verl's handling of masked positions.

    Per row, right to left, starting from ``a = 0`` and ``nv = 0`` (the next value)::

        delta_t = r_t + gamma * nv - V_t
        where m_t:  a = delta_t + gamma * lam * a,  nv = V_t     (else both carry through unchanged)
        advantages_t = a,   returns_t = a + V_t

    A masked position (an observation token of a multi-turn rollout, or padding) is skipped:
    it neither discounts nor contributes, its advantage is the one of the next unmasked
    position to its right (0 if none), and the next unmasked position to its left sees the
    value ``nv`` of the next unmasked position to its right. verl then whitens the
    advantages: ``masked_whiten(advantages, mask)``.

    Args:
        rewards: ``[..., T]`` float32 / bfloat16 / float16 (float64 for reference runs).
        values: the critic's values, same shape (upcast alike; float64 only with float64 rewards).
        mask: same shape; bool, or int/float 0/1.
        gamma, lam: discount and GAE lambda, in ``[0, 1]``. For float32 inputs the recurrence
            multiplies by ``gamma`` and ``gamma * lam`` rounded to float32, as fp32 torch code
            (verl: ``gamma * lam * lastgaelam``) does.

    Returns:
        ``(advantages, returns)`` of ``rewards``' shape, float32 (float64 for float64 inputs);
        not differentiable. Rows are independent; on backends that promise it a row's outputs
        are bitwise the same whatever the other rows.
    """
    x = _float_input("rewards", rewards)
    v = _float_input("values", values)
    _check_like("values", v, x, "rewards")
    checks.same_dtype(("rewards", rewards), ("values", values))
    mask = _mask_input(mask, x, "rewards")
    gamma = checks.number("gamma", gamma, minimum=0.0, maximum=1.0)
    lam = checks.number("lam", lam, minimum=0.0, maximum=1.0)
    adv, ret = _gae_fwd(_rows("rewards", x), _rows("values", v), _rows("mask", mask), gamma, lam)
    return adv.view(x.shape), ret.view(x.shape)
