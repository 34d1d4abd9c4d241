"""Reference advantage and return primitives: the readable specification and ground truth.

Four primitives, none differentiable (they run on rewards, scores and values, which carry no
gradient in RL training):

``group_advantages_fwd``
    One score ``s_i`` per sequence, sequences grouped by prompt. For a group ``g`` of ``n``
    members, in group order (ascending batch position), let ``p`` be the score of the first
    member (the *pivot*) and ``d_i = s_i - p``. Then::

        mean_g = p + base_d,     base_d = sum_g d / n
        c_i    = d_i - base_d                       (= s_i - mean_g)
        var_g  = sum_g c^2 / (n - 1)                (Bessel, around the mean: never E[s^2] - E[s]^2)

    and per mode::

        grpo                   c_i / (sqrt(var_g) + eps)
        dr_grpo                c_i
        reinforce_pp_baseline  c_i        (the caller then whitens it per token: masked_whiten)
        rloo                   c_i * (n / (n - 1))                  (= s_i - mean of the others)
        opo                    d_i - sum_g(w d) / sum_g(w),  w = lengths (the length-weighted
                               baseline sum_g(w s) / sum_g(w); the plain mean if sum_g(w) == 0)
        gpg                    alpha * c_i,  alpha = B / max(#{i : a_i != 0}, 1)

    A singleton group (``n == 1``) has mean 0 and std 1 (verl's convention): its advantage
    is ``s / (1 + eps)`` for ``grpo`` and ``s`` for every other mode. The pivot makes a
    group of equal scores give exactly 0 (``d`` is exactly 0), and keeps the sums well
    conditioned for large scores with a small spread. ``gpg`` (GPG, arXiv 2504.02546) is
    the Dr.GRPO advantage scaled by GPG's gradient-estimation correction
    ``alpha = B / B_valid``, where ``B_valid`` counts the sequences of the call whose
    unscaled advantage (``c_i``, or ``s_i`` for a singleton) is non-zero: it depends on the
    whole call, not just on the group.

``masked_whiten_fwd``
    Over the entries with ``mask`` true (``n`` of them)::

        mu   = sum_m x / max(n, 1)
        var  = sum_m (x - mu)^2 / max(n - 1, 1)      (unbiased, verl)
             = sum_m (x - mu)^2 / max(n, 1)          (biased, OpenRLHF)
        rstd = 1 / sqrt(var + eps)                   (eps_mode "add", verl)
             = 1 / sqrt(max(var, eps))               (eps_mode "clamp", OpenRLHF)
        out  = (x - mu) * rstd (+ mu unless shift_mean)   where mask, else 0

    An empty mask gives all zeros; a single masked entry gives 0 (``mu`` when not shifting).

``discounted_returns_fwd``
    Per row, right to left, from ``G = 0`` after the last position; ``mask_mode`` says what
    a position with mask 0 does::

        carry (rlk's canonical form):  G_t = r_t + gamma * G_{t+1}  where m_t,  else G_{t+1}
            (a masked position passes the return through unchanged: its reward and a
            discount step are skipped, as GAE does; its output is the carried value)
        reset (verl's REINFORCE++):    G_t = r_t + gamma * m_{t+1} * G_{t+1}
            (the running return restarts at 0 after each masked position)
        zero (OpenRLHF):               G_t = m_t * r_t + gamma * G_{t+1}
            (masked rewards count as 0; discounting continues through masked positions)

    All three agree on the unmasked positions when the mask is 1 then 0 (trailing padding)
    and the padding rewards are 0; they differ for interior masked spans (multi-turn).

``gae_fwd``
    Per row, right to left from ``nv = 0`` (the next value) and ``a = 0`` (verl's
    convention)::

        delta_t = r_t + gamma * nv - V_t
        where m_t:  a = delta_t + gamma_lam * a,     nv = V_t      (gamma_lam = gamma * lam)
        (a masked position leaves a and nv unchanged: it is skipped)
        advantages_t = a (after position t),   returns_t = advantages_t + V_t

    so a masked position's advantage is the one of the next unmasked position to its
    right (0 if none), and ``nv`` is the value of the next unmasked position.

The recurrences' constants ``gamma`` and ``gamma_lam`` come rounded to the compute dtype
(:func:`recurrence_constants`; fp32 torch code such as verl's multiplies by exactly these), so
ground truth in fp64 uses the very constants an fp32 backend uses: over a horizon of ``k``
steps, a constant off by half an fp32 ulp would move a return by ``k * 3e-8`` relative.

Math runs in fp32 (fp64 when the inputs are fp64, which is how the contract tests build
ground truth). The scans are plain Python loops over time (vectorized over rows): this is
the spec; the Triton backend computes the same recurrences as parallel scans. The
reference is deterministic; it does not promise batch invariance.

The ``*_contract_scale`` helpers give the per-element ``scale`` of the numerical contract
(``contract.json``: ``|value - ref| <= atol + rtol * scale``), computed from fp64 ground truth.
"""

from __future__ import annotations

import torch

GROUP_MODES = ("grpo", "dr_grpo", "rloo", "reinforce_pp_baseline", "opo", "gpg")
RETURN_MASK_MODES = ("carry", "reset", "zero")
EPS_MODES = ("add", "clamp")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def recurrence_constants(gamma: float, lam: float, dtype: torch.dtype) -> tuple[float, float]:
    """``gamma`` and ``gamma * lam`` (the product taken in double) rounded to ``dtype``'s compute dtype:
    the constants the returns / GAE primitives receive for inputs of ``dtype``."""
    cdt = _compute_dtype(dtype)
    return (float(torch.tensor(gamma, dtype=torch.float64).to(cdt)),
            float(torch.tensor(gamma * lam, dtype=torch.float64).to(cdt)))


# ----------------------------------------------------------------------------------------------
# group_advantages
# ----------------------------------------------------------------------------------------------


def dense_groups(group_index: torch.Tensor | None, group_size: int, n_rows: int, device: torch.device):
    """Group members as a dense ``[G, max_n]`` matrix of batch positions (-1 for no member).

    Row ``g`` lists the members of the ``g``-th group in ascending batch position (groups by
    ascending id for ``group_index``; consecutive blocks for ``group_size``). Host-synchronizing
    (``G`` and ``max_n`` are data-dependent): fine for the reference.
    """
    if group_index is None:
        return torch.arange(n_rows, device=device).view(n_rows // group_size, group_size)
    sorted_ids, order = torch.sort(group_index, stable=True)
    head = torch.ones(n_rows, dtype=torch.bool, device=device)
    head[1:] = sorted_ids[1:] != sorted_ids[:-1]
    gid = torch.cumsum(head, 0) - 1
    starts = head.nonzero().squeeze(1)
    pos = torch.arange(n_rows, device=device) - starts[gid]
    n_groups, max_n = int(gid[-1]) + 1, int(pos.max()) + 1
    members = torch.full((n_groups, max_n), -1, dtype=torch.int64, device=device)
    members[gid, pos] = order
    return members


def group_advantages_fwd(scores, group_index, group_size, lengths, mode, eps, out):
    """Per-sequence group advantages (see the module docstring for the math).

    Args:
        scores: ``[B]`` fp32 (fp64 for ground truth), ``B >= 1``.
        group_index: ``[B]`` int64 group ids (any values, any order), or None.
        group_size: when ``group_index`` is None, consecutive groups of this size (divides B).
        lengths: ``[B]`` fp32 response lengths (``>= 0``) for ``mode == "opo"``, else None.
        mode: one of :data:`GROUP_MODES`.
        eps: added to the std in ``grpo`` (and to the singleton std 1).
        out: ``[B]``, ``scores.dtype``: written with the advantages.
    """
    cdt = _compute_dtype(scores.dtype)
    members = dense_groups(group_index, group_size, scores.shape[0], scores.device)
    valid = members >= 0
    safe = members.clamp(min=0)
    s = torch.where(valid, scores[safe].to(cdt), 0.0)
    n = valid.sum(1).to(cdt)
    d = torch.where(valid, s - s[:, :1], 0.0)
    base = d.sum(1) / n
    if mode == "opo":
        w = torch.where(valid, lengths[safe].to(cdt), 0.0)
        w_sum = w.sum(1)
        base = torch.where(w_sum > 0, (w * d).sum(1) / torch.where(w_sum > 0, w_sum, 1.0), base)
    c = torch.where(valid, d - base[:, None], 0.0)
    single = (n == 1)[:, None]
    if mode == "grpo":
        var = (c * c).sum(1) / (n - 1).clamp(min=1)
        adv = torch.where(single, s / (1.0 + eps), c / (torch.sqrt(var)[:, None] + eps))
    elif mode == "rloo":
        factor = n / (n - 1).clamp(min=1)
        adv = torch.where(single, s, c * factor[:, None])
    elif mode in ("dr_grpo", "reinforce_pp_baseline", "opo", "gpg"):
        adv = torch.where(single, s, c)
    else:
        raise ValueError(f"mode: expected one of {', '.join(GROUP_MODES)}, got {mode!r}")
    if mode == "gpg":
        n_valid = ((adv != 0) & valid).sum()
        alpha = torch.tensor(scores.shape[0], dtype=cdt, device=scores.device) / n_valid.clamp(min=1).to(cdt)
        adv = adv * alpha
    out[members[valid]] = adv[valid].to(out.dtype)


def group_contract_scale(ref: torch.Tensor, group_index: torch.Tensor | None, group_size: int) -> torch.Tensor:
    """``1 + max_{j in g(i)} |ref_j|`` per sequence (fp64): the errors of a group's advantages scale
    with its largest advantage (the centred scores all carry the rounding of the group mean)."""
    ref = ref.double()
    members = dense_groups(group_index, group_size, ref.shape[0], ref.device)
    valid = members >= 0
    worst = torch.where(valid, ref[members.clamp(min=0)].abs(), 0.0).amax(1)
    scale = torch.empty_like(ref)
    scale[members[valid]] = (1.0 + worst[:, None].expand_as(members))[valid]
    return scale


# ----------------------------------------------------------------------------------------------
# masked_whiten
# ----------------------------------------------------------------------------------------------


def _whiten_stats(x: torch.Tensor, mask: torch.Tensor, unbiased: bool, eps: float, eps_mode: str):
    cdt = _compute_dtype(x.dtype)
    x = x.to(cdt)
    count = mask.sum()
    mu = torch.where(mask, x, 0.0).sum() / count.clamp(min=1).to(cdt)
    centered = torch.where(mask, x - mu, 0.0)
    denom = (count - 1 if unbiased else count).clamp(min=1).to(cdt)
    var = (centered * centered).sum() / denom
    if eps_mode == "add":
        rstd = torch.rsqrt(var + eps)
    elif eps_mode == "clamp":
        rstd = torch.rsqrt(var.clamp(min=eps))
    else:
        raise ValueError(f"eps_mode: expected one of {', '.join(EPS_MODES)}, got {eps_mode!r}")
    return x, centered, mu, rstd


def masked_whiten_fwd(x, mask, unbiased, eps, eps_mode, shift_mean, out):
    """Whiten ``x`` over its masked entries (see the module docstring).

    Args:
        x: ``[N]`` fp32 (fp64 for ground truth).
        mask: ``[N]`` bool.
        unbiased: divide the squared deviations by ``n - 1`` (verl) instead of ``n`` (OpenRLHF).
        eps: ``> 0``; see ``eps_mode``.
        eps_mode: ``"add"`` (``rsqrt(var + eps)``) or ``"clamp"`` (``rsqrt(max(var, eps))``).
        shift_mean: when False, the mean is added back.
        out: ``[N]``, ``x.dtype``: written; 0 where ``mask`` is false.
    """
    _, centered, mu, rstd = _whiten_stats(x, mask, unbiased, eps, eps_mode)
    white = centered * rstd
    if not shift_mean:
        white = white + mu
    out.copy_(torch.where(mask, white, 0.0))


def whiten_contract_scale(x, mask, unbiased, eps, eps_mode, ref) -> torch.Tensor:
    """``1 + |ref| + (|x| + |mu|) * rstd`` per entry (fp64): ``x - mu`` is exact to about
    ``(|x| + |mu|) * 2^-24`` in fp32, and is then multiplied by ``rstd``."""
    x64, _, mu, rstd = _whiten_stats(x.double(), mask, unbiased, eps, eps_mode)
    return 1.0 + ref.double().abs() + (x64.abs() + mu.abs()) * rstd


# ----------------------------------------------------------------------------------------------
# discounted_returns
# ----------------------------------------------------------------------------------------------


def discounted_returns_fwd(rewards, mask, gamma, mask_mode, out):
    """Discounted returns ``G_t = r_t + gamma * G_{t+1}`` per row, right to left.

    Args:
        rewards: ``[B, T]`` fp32 (fp64 for ground truth).
        mask: ``[B, T]`` bool.
        gamma: discount in ``[0, 1]``.
        mask_mode: ``"carry"``, ``"reset"`` or ``"zero"`` (see the module docstring).
        out: ``[B, T]``, ``rewards.dtype``: written with ``G``.
    """
    cdt = _compute_dtype(rewards.dtype)
    g = torch.zeros(rewards.shape[0], dtype=cdt, device=rewards.device)
    for t in reversed(range(rewards.shape[1])):
        r, m = rewards[:, t].to(cdt), mask[:, t]
        if mask_mode == "carry":
            g = torch.where(m, r + gamma * g, g)
            out[:, t] = g
        elif mask_mode == "reset":
            g = r + gamma * g
            out[:, t] = g
            g = torch.where(m, g, 0.0)
        elif mask_mode == "zero":
            g = torch.where(m, r, 0.0) + gamma * g
            out[:, t] = g
        else:
            raise ValueError(f"mask_mode: expected one of {', '.join(RETURN_MASK_MODES)}, got {mask_mode!r}")


def returns_contract_scale(rewards, mask, gamma, mask_mode) -> torch.Tensor:
    """``1 + R_abs`` per position (fp64), ``R_abs`` the same recurrence run on ``|rewards|``: the
    rounding of a return scales with the sum of the magnitudes it adds up."""
    r_abs = torch.empty(rewards.shape, dtype=torch.float64, device=rewards.device)
    discounted_returns_fwd(rewards.double().abs(), mask, gamma, mask_mode, r_abs)
    return 1.0 + r_abs


# ----------------------------------------------------------------------------------------------
# gae
# ----------------------------------------------------------------------------------------------


def gae_fwd(rewards, values, mask, gamma, gamma_lam, advantages_out, returns_out):
    """Generalized advantage estimation with verl's handling of masked positions.

    Args:
        rewards: ``[B, T]`` fp32 (fp64 for ground truth).
        values: ``[B, T]``, ``rewards.dtype``.
        mask: ``[B, T]`` bool.
        gamma, gamma_lam: ``gamma`` and ``gamma * lam``, in ``[0, 1]`` (see :func:`recurrence_constants`).
        advantages_out, returns_out: ``[B, T]``, ``rewards.dtype``: written with ``a`` and ``a + V``.
    """
    cdt = _compute_dtype(rewards.dtype)
    next_value = torch.zeros(rewards.shape[0], dtype=cdt, device=rewards.device)
    adv = torch.zeros_like(next_value)
    for t in reversed(range(rewards.shape[1])):
        r, v, m = rewards[:, t].to(cdt), values[:, t].to(cdt), mask[:, t]
        delta = r + gamma * next_value - v
        adv = torch.where(m, delta + gamma_lam * adv, adv)
        next_value = torch.where(m, v, next_value)
        advantages_out[:, t] = adv
        returns_out[:, t] = adv + v


def gae_contract_scale(rewards, values, mask, gamma, gamma_lam) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position scales (fp64) of the advantages and the returns: ``1 + A_abs`` and
    ``1 + A_abs + |V|``, ``A_abs`` the GAE recurrence run with ``delta_t`` replaced by
    ``|r_t| + gamma * |nv| + |V_t|`` (the magnitudes the recurrence adds up)."""
    r, v = rewards.double().abs(), values.double().abs()
    a_abs = torch.empty_like(r)
    next_value = torch.zeros(r.shape[0], dtype=torch.float64, device=r.device)
    acc = torch.zeros_like(next_value)
    for t in reversed(range(r.shape[1])):
        m = mask[:, t]
        acc = torch.where(m, r[:, t] + gamma * next_value + v[:, t] + gamma_lam * acc, acc)
        next_value = torch.where(m, v[:, t], next_value)
        a_abs[:, t] = acc
    return 1.0 + a_abs, 1.0 + a_abs + v
