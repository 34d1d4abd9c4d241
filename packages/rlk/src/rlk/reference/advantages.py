"""Reference advantage and return primitives: the readable specification and ground truth.

Four primitives, none differentiable (they run on rewards, scores and values, which carry no
gradient in RL training):

``group_advantages_fwd``
    One score ``s_i`` per sequence, sequences grouped by prompt. For a group ``g`` of ``n``
    members, in group order (ascending batch position), the scores are first scaled by an
    exact power of two, ``s'_i = s_i * 2^-k`` with ``k`` the exponent of the group's largest
    ``|s|`` (:func:`pow2_scale`: ``2^k <= max_g |s| < 2^(k+1)``, ``k`` clamped to ``[0, 126]``
    in fp32), so ``|s'| < 4`` and no sum or square below can overflow (a spread of 1e20
    squares to 1e40, past fp32's 3.4e38). Let ``p`` be the scaled score of the first member
    (the *pivot*) and ``d_i = s'_i - p``. Then::

        mean'_g = p + base_d,     base_d = sum_g d / n
        c_i     = d_i - base_d                      (= (s_i - mean_g) * 2^-k)
        var'_g  = sum_g c^2 / (n - 1)               (Bessel, around the mean: never E[s^2] - E[s]^2)
        std'_g  = sqrt(var'_g)                      (= std_g * 2^-k)

    and per mode::

        grpo                   c_i / (std'_g + eps * 2^-k)        (= (s_i - mean_g) / (std_g + eps))
        dr_grpo                c_i * 2^k
        reinforce_pp_baseline  c_i * 2^k  (the caller then whitens it per token: masked_whiten)
        rloo                   (c_i * (n / (n - 1))) * 2^k         (= s_i - mean of the others)
        opo                    (d_i - sum_g(w d) / sum_g(w)) * 2^k,  w = lengths (the length-
                               weighted baseline sum_g(w s) / sum_g(w); the plain mean if
                               sum_g(w) == 0)
        gpg                    alpha * c_i * 2^k,  alpha = B / max(#{i : a_i != 0}, 1)

    and the Pass@k modes (arXiv 2503.19595; verl's ``grpo_passk``), with ``top_g`` the group's largest scaled
    score, ``w`` its first member (in group order) holding it and ``second_g`` the largest of the others::

        grpo_passk             (top_g - second_g) / (std'_g + eps * 2^-k)  for w, 0 for the others
        dr_grpo_passk          (top_g - second_g) * 2^k                     for w, 0 for the others

    (a tie for the top gives 0 to everyone; a singleton group takes the family's convention, ``s / (1 + eps)`` and
    ``s``; a NaN score makes its whole group NaN).

    Scaling by a power of two is exact (barring underflow of terms far below the group's
    largest score), so the results are the bits of the unscaled formulas wherever those do
    not overflow. In ``grpo`` a group of equal scores has ``c = 0`` and ``std' = 0``; its
    denominator ``eps * 2^-k`` can underflow to 0 for huge scores, so a zero denominator is
    taken as 1 (the advantages are 0 either way).

    A singleton group (``n == 1``) has mean 0 and std 1 (verl's convention): its advantage
    is ``s / (1 + eps)`` for ``grpo`` and ``s`` for every other mode. The pivot makes a
    group of equal scores give exactly 0 (``d`` is exactly 0), and keeps the sums well
    conditioned for large scores with a small spread. ``gpg`` (GPG, arXiv 2504.02546) is
    the Dr.GRPO advantage scaled by GPG's gradient-estimation correction
    ``alpha = B / B_valid``, where ``B_valid`` counts the sequences of the call whose
    advantage before ``alpha`` (``c_i * 2^k``, or ``s_i`` for a singleton) is non-zero: it
    depends on the whole call, not just on the group. Every row belongs to a group, and a
    group reads only its own scores (and lengths): a NaN or inf score gives NaN / inf
    advantages in its own group only (and counts as non-zero for ``gpg``'s ``alpha``).

``masked_whiten_fwd``
    Over the entries with ``mask`` true (``n`` of them), scaled like the groups above by
    ``2^-k``, ``k`` the exponent of the largest masked ``|x|`` (:func:`pow2_scale`), so that
    neither the sum nor the squares overflow (``x' = x * 2^-k``, ``|x'| < 4``)::

        mu'   = sum_m x' / max(n, 1)                 (mu = mu' * 2^k)
        var'  = sum_m (x' - mu')^2 / max(n - 1, 1)   (unbiased, verl)
              = sum_m (x' - mu')^2 / max(n, 1)       (biased, OpenRLHF)
        eps'  = eps * 2^-k * 2^-k
        rstd' = 1 / sqrt(var' + eps')                (eps_mode "add", verl)
              = 1 / sqrt(max(var', eps'))            (eps_mode "clamp", OpenRLHF)
        out   = (x' - mu') * rstd' (+ mu unless shift_mean)   where mask, else 0

    which is ``(x - mu) * rstd`` with ``rstd = 1 / sqrt(var + eps)`` (``max(var, eps)``):
    the same bits wherever the unscaled formulas do not overflow. When ``var' + eps'`` is 0
    (equal entries so large that ``eps'`` underflows to 0: above ~5e18 for ``eps = 1e-8``)
    ``rstd'`` is taken as 0: every ``x' - mu'`` is 0 then. An empty mask gives all zeros; a single masked entry
    gives 0 (``mu`` when not shifting). Entries with mask false never enter the statistics.

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
    and the padding rewards are 0; they differ for interior masked spans (multi-turn). The
    mask acts through selects, never through a multiplication by 0 or 1, so a masked reward
    (NaN, inf, anything) never reaches an unmasked position; in ``reset`` it is in the output
    at its own position (``G_t = r_t + ...``), in ``carry`` and ``zero`` it is not read.

``gae_fwd``
    Per row, right to left from ``nv = 0`` (the next value) and ``a = 0`` (verl's
    convention)::

        delta_t = r_t + gamma * nv - V_t
        where m_t:  a = delta_t + gamma_lam * a,     nv = V_t      (gamma_lam = gamma * lam)
        (a masked position leaves a and nv unchanged: it is skipped)
        advantages_t = a (after position t),   returns_t = advantages_t + V_t

    so a masked position's advantage is the one of the next unmasked position to its
    right (0 if none), and ``nv`` is the value of the next unmasked position. A masked
    position's reward and value never reach the advantages or the unmasked returns (selects,
    not multiplications by the mask); its own return is ``a + V_t`` (NaN for a NaN ``V_t``).

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

from rlk.core.abi import EPS_MODES, GROUP_MODES, RETURN_MASK_MODES
from rlk.core.checks import compute_dtype

#: Per compute dtype: (int view, mantissa bits, exponent bias, largest k of :func:`pow2_scale`).
_FLOAT_BITS = {torch.float32: (torch.int32, 23, 127, 126), torch.float64: (torch.int64, 52, 1023, 1022)}


def pow2_scale(m: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(2^-k, 2^k)`` for ``m >= 0`` (fp32 or fp64, any shape), ``k = floor(log2 m)`` clamped to
    ``[0, k_max]`` (126 in fp32, 1022 in fp64; ``k = 0`` for ``m < 2``, so small inputs are not
    scaled at all).

    ``k`` is read from ``m``'s exponent bits and both powers are built from bits, so they are
    exact and multiplying by them is exact (barring underflow): ``|x| <= m`` gives ``|x * 2^-k| < 4``.
    """
    int_dtype, mantissa, bias, k_max = _FLOAT_BITS[m.dtype]
    k = ((m.contiguous().view(int_dtype) >> mantissa) & (2 * bias + 1)) - bias
    k = k.clamp(0, k_max)
    return ((bias - k) << mantissa).view(m.dtype), ((bias + k) << mantissa).view(m.dtype)


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
    cdt = compute_dtype(scores.dtype)
    members = dense_groups(group_index, group_size, scores.shape[0], scores.device)
    valid = members >= 0
    safe = members.clamp(min=0)
    s = torch.where(valid, scores[safe].to(cdt), 0.0)
    n = valid.sum(1).to(cdt)
    down, up = pow2_scale(torch.where(valid, s.abs(), 0.0).amax(1))  # per group: 2^-k, 2^k
    s_scaled = s * down[:, None]
    d = torch.where(valid, s_scaled - s_scaled[:, :1], 0.0)
    base = d.sum(1) / n
    if mode == "opo":
        w = torch.where(valid, lengths[safe].to(cdt), 0.0)
        w_sum = w.sum(1)
        base = torch.where(w_sum > 0, (w * d).sum(1) / torch.where(w_sum > 0, w_sum, 1.0), base)
    c = torch.where(valid, d - base[:, None], 0.0)
    single = (n == 1)[:, None]
    if mode == "grpo":
        var = (c * c).sum(1) / (n - 1).clamp(min=1)
        den = torch.sqrt(var) + eps * down
        den = torch.where(den > 0, den, 1.0)  # equal huge scores: c = 0 and eps * 2^-k underflowed
        adv = torch.where(single, s / (1.0 + eps), c / den[:, None])
    elif mode == "rloo":
        factor = n / (n - 1).clamp(min=1)
        adv = torch.where(single, s, (c * factor[:, None]) * up[:, None])
    elif mode in ("dr_grpo", "reinforce_pp_baseline", "opo", "gpg"):
        adv = torch.where(single, s, c * up[:, None])
    elif mode in ("grpo_passk", "dr_grpo_passk"):
        adv = _passk(s, s_scaled, valid, c, n, eps, down, up, with_std=mode == "grpo_passk")
    else:
        raise ValueError(f"mode: expected one of {', '.join(GROUP_MODES)}, got {mode!r}")
    if mode == "gpg":
        n_valid = ((adv != 0) & valid).sum()
        alpha = torch.tensor(scores.shape[0], dtype=cdt, device=scores.device) / n_valid.clamp(min=1).to(cdt)
        adv = adv * alpha
    out[members[valid]] = adv[valid].to(out.dtype)


def _passk(s, s_scaled, valid, c, n, eps, down, up, *, with_std):
    """Pass@k advantages of dense groups (module docstring): the first member holding the top gets the margin."""
    vals = torch.where(valid, s_scaled, -torch.inf)
    top = vals.amax(1)
    col = torch.arange(vals.shape[1], device=vals.device)
    first = torch.where(valid & (vals == top[:, None]), col, vals.shape[1]).amin(1)
    winner = (col[None, :] == first[:, None]) & (n > 1)[:, None]
    second = torch.where(winner | ~valid, -torch.inf, vals).amax(1)
    margin = torch.where(n > 1, top - second, 0.0)
    if with_std:
        den = torch.sqrt((c * c).sum(1) / (n - 1).clamp(min=1)) + eps * down
        value = margin / torch.where(den > 0, den, 1.0)
    else:
        value = margin * up
    adv = torch.where(winner, value[:, None], 0.0)
    adv = torch.where((n == 1)[:, None], s / (1.0 + eps) if with_std else s, adv)
    return torch.where((valid & torch.isnan(s)).any(1)[:, None], torch.nan, adv)


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
    """The scaled statistics of the module docstring: ``(centered', mu, rstd', down)`` with
    ``centered' = (x' - mu')`` where mask (0 elsewhere), ``mu`` unscaled, ``rstd'`` and ``down = 2^-k``
    (so ``rstd = rstd' * down``)."""
    cdt = compute_dtype(x.dtype)
    x = x.to(cdt)
    count = mask.sum()
    down, up = pow2_scale(torch.where(mask, x.abs(), 0.0).amax() if x.numel() else x.new_zeros(()))
    x_scaled = x * down
    mu_scaled = torch.where(mask, x_scaled, 0.0).sum() / count.clamp(min=1).to(cdt)
    centered = torch.where(mask, x_scaled - mu_scaled, 0.0)
    denom = (count - 1 if unbiased else count).clamp(min=1).to(cdt)
    var = (centered * centered).sum() / denom
    eps_scaled = eps * down * down
    if eps_mode == "add":
        var = var + eps_scaled
    elif eps_mode == "clamp":
        var = var.clamp(min=eps_scaled)
    else:
        raise ValueError(f"eps_mode: expected one of {', '.join(EPS_MODES)}, got {eps_mode!r}")
    rstd = torch.where(var > 0, torch.rsqrt(torch.where(var > 0, var, 1.0)), 0.0)
    return centered, mu_scaled * up, rstd, down


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
    centered, mu, rstd, _ = _whiten_stats(x, mask, unbiased, eps, eps_mode)
    white = centered * rstd
    if not shift_mean:
        white = white + mu
    out.copy_(torch.where(mask, white, 0.0))


def whiten_contract_scale(x, mask, unbiased, eps, eps_mode, ref) -> torch.Tensor:
    """``1 + |ref| + (|x| + |mu|) * rstd`` per entry (fp64): ``x - mu`` is exact to about
    ``(|x| + |mu|) * 2^-24`` in fp32, and is then multiplied by ``rstd``. Masked-out entries
    (which may hold anything) count as 0."""
    x64 = torch.where(mask, x.double(), 0.0)
    _, mu, rstd, down = _whiten_stats(x64, mask, unbiased, eps, eps_mode)
    return 1.0 + ref.double().abs() + (x64.abs() + mu.abs()) * (rstd * down)


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
    cdt = compute_dtype(rewards.dtype)
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
    cdt = compute_dtype(rewards.dtype)
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
