"""Triton kernels of the advantage ops: ``group_advantages``, ``masked_whiten``,
``discounted_returns`` and ``gae``.

The math is the spec in :mod:`rlk.reference.advantages`; none of these ops is differentiable.
Every reduction runs in a fixed order and there are no atomics, so results are deterministic
run to run; the per-group and per-row kernels are also batch-invariant (a group's or a row's
result is computed by the same instruction sequence whatever the other groups / rows).

* ``group_advantages``: one program per group, looping over the group's members in chunks of
  ``BLOCK`` (fixed) and accumulating each chunk's reduction in chunk order: pass 0 the largest
  ``|s|`` (a max: exact, order-free), whose exponent ``k`` gives the exact power-of-two scale
  ``2^-k`` applied to every score (so no sum or square overflows, whatever the spread), pass 1
  the sum of ``d = s * 2^-k - pivot`` (the pivot is the group's first score, scaled), pass 2
  (``grpo``) the sum of ``(d - mean_d)^2`` around the mean, pass 3 the advantages (scaled back by
  ``2^k``). For ``group_size`` groups program ``g`` owns positions ``[g * size, (g + 1) * size)``.
  For ``group_index`` a CSR of the groups is built on the device with deterministic torch ops (a
  stable sort of the ids, segment heads, a reverse ``cummin`` for the segment lengths: no host
  synchronization); one program per sorted position runs, and only segment heads do any work.
  Members keep their batch order inside a group (stable sort), so a group's chunks, lanes and sums
  are the same wherever the group sits and whatever the other groups are. ``gpg``'s ``alpha`` sums
  exact integer counts of non-zero advantages per group (``torch.sum`` of int32: order-independent).
* ``masked_whiten``: two passes, each a fixed partition of the flattened input into ``BLOCK``
  element partials followed by a one-program combine of the partials in index order: pass 1
  gives per block the exponent ``k_p`` of its largest masked ``|x|`` and its sum of ``x * 2^-k_p``
  (exact scaling: no overflow); the combine takes ``k = max k_p``, rescales each partial by
  ``2^(k_p - k)`` (exact) and gives ``n`` (exact int) and ``mu' = mu * 2^-k``; pass 2 gives
  ``sum (x * 2^-k - mu')^2`` and ``rstd' = rstd * 2^k``; a fifth launch applies them. The
  statistics span the whole call by definition (no batch invariance). Masked-out entries are
  loaded but only ever selected away (``tl.where``), never multiplied by 0.
* ``discounted_returns`` and ``gae``: one program per row; the recurrences are linear, so
  each position is an affine map ``x -> a * x + b`` of the state coming from its right, and a
  chunk of ``BLOCK_T`` positions (fixed, aligned to position 0) is solved at once by
  ``tl.associative_scan`` over map composition (lanes hold the chunk's positions right to
  left). Chunks run from the last to the first, carrying the state (a scalar) in that fixed
  order: no Python loop over time, no host synchronization. A masked position of ``carry``
  (and of GAE) is the identity map ``(1, 0)``, which composes exactly, so trailing padding
  does not change a row's values either. A map with ``a = 0`` (``reset`` after a masked
  position) is the constant ``b``: composition and application select ``b`` there instead of
  computing ``0 * x + b``, so a NaN or inf state coming from a masked position (its reward)
  does not reach the positions to its left.

Divisions and square roots are correctly rounded (``tl.div_rn``, ``tl.sqrt_rn``), as in torch, so a
singleton group's ``s / (1 + eps)`` is the same bits on every device.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlk_triton.common import on_device

#: Fixed tile configuration (fp32 only; the op layer upcasts 16-bit inputs). The launchers read
#: it at every call, so a sweep or a test may overwrite entries. Nothing depends on the batch.
#:
#: * ``"group"``: members per chunk of a group program.
#: * ``"whiten"``: elements per partial (``BLOCK``) and partials per combine step (``COMBINE_BLOCK``).
#: * ``"scan"``: positions per chunk of the returns / GAE scans.
TILE_CONFIGS: dict[str, dict[str, int]] = {
    "group": {"BLOCK": 128, "num_warps": 4},
    "whiten": {"BLOCK": 4096, "COMBINE_BLOCK": 1024, "num_warps": 8},
    "scan": {"BLOCK_T": 1024, "num_warps": 4},
}

_GROUP_MODE_IDS = {"grpo": 0, "dr_grpo": 1, "reinforce_pp_baseline": 1, "gpg": 1, "rloo": 2, "opo": 3}
_RETURN_MASK_MODE_IDS = {"carry": 0, "reset": 1, "zero": 2}
# Pass@k (4: over the std, 5: unscaled)
_GROUP_MODE_IDS.update({"grpo_passk": 4, "dr_grpo_passk": 5})


# ----------------------------------------------------------------------------------------------
# group_advantages
# ----------------------------------------------------------------------------------------------


@triton.jit
def _scale_exponent(m):
    """``k = floor(log2 m)`` clamped to ``[0, 126]`` (int32), for fp32 ``m >= 0`` (a largest ``|x|``): read
    from the exponent bits (spec: :func:`rlk.reference.advantages.pow2_scale`)."""
    k = ((m.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    return tl.minimum(tl.maximum(k, 0), 126)


@triton.jit
def _pow2(k):
    """``2^k`` in fp32 for int32 ``-126 <= k <= 127``, built from bits: exact."""
    return ((127 + k) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _group_chunk(scores_ptr, perm_ptr, start, offs, valid, BY_SIZE: tl.constexpr):
    """Batch positions and scores of the members ``offs`` (int64) of the group starting at ``start``."""
    if BY_SIZE:
        idx = start + offs
    else:
        idx = tl.load(perm_ptr + start + offs, mask=valid, other=0)
    return idx, tl.load(scores_ptr + idx, mask=valid, other=0.0)


@triton.jit
def _group_advantages_kernel(
    scores_ptr,
    perm_ptr,
    seg_len_ptr,
    lengths_ptr,
    out_ptr,
    nonzero_ptr,
    group_size,
    eps,
    MODE: tl.constexpr,
    GPG: tl.constexpr,
    BY_SIZE: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Advantages of one group (MODE 0 grpo, 1 centred only, 2 rloo, 3 opo); see the module docstring."""
    pid = tl.program_id(0).to(tl.int64)
    if BY_SIZE:
        start = pid * group_size
        n = pid * 0 + group_size
    else:
        start = pid
        n = tl.load(seg_len_ptr + pid)  # 0 unless this sorted position starts a group
    lane = tl.arange(0, BLOCK).to(tl.int64)
    if BY_SIZE:
        first = start
    else:
        first = tl.load(perm_ptr + start, mask=n > 0, other=0)
    n_f = tl.maximum(n, 1).to(tl.float32)

    # pass 0: the group's largest |s|, whose exponent k scales every score by 2^-k (exact)
    acc_max = 0.0
    for j0 in range(0, n, BLOCK):
        offs = j0 + lane
        valid = offs < n
        idx, s = _group_chunk(scores_ptr, perm_ptr, start, offs, valid, BY_SIZE)
        acc_max = tl.maximum(acc_max, tl.max(tl.where(valid, tl.abs(s), 0.0)))
    k = _scale_exponent(acc_max)
    down = _pow2(-k)
    up = _pow2(k)
    pivot = tl.load(scores_ptr + first, mask=n > 0, other=0.0) * down

    # pass 1: sum of d = s * 2^-k - pivot (and of w * d, w for opo), chunk by chunk in order
    acc_d = 0.0
    acc_wd = 0.0
    acc_w = 0.0
    for j0 in range(0, n, BLOCK):
        offs = j0 + lane
        valid = offs < n
        idx, s = _group_chunk(scores_ptr, perm_ptr, start, offs, valid, BY_SIZE)
        d = tl.where(valid, s * down - pivot, 0.0)
        acc_d += tl.sum(d)
        if MODE == 3:
            w = tl.load(lengths_ptr + idx, mask=valid, other=0.0)
            acc_wd += tl.sum(w * d)
            acc_w += tl.sum(w)
    base = tl.div_rn(acc_d, n_f)
    if MODE == 3:
        base = tl.where(acc_w > 0, tl.div_rn(acc_wd, tl.where(acc_w > 0, acc_w, 1.0)), base)

    # pass 2 (grpo): sum of squared deviations around the mean, and the denominator std' + eps * 2^-k
    den = 1.0
    if MODE == 0:
        acc_ss = 0.0
        for j0 in range(0, n, BLOCK):
            offs = j0 + lane
            valid = offs < n
            idx, s = _group_chunk(scores_ptr, perm_ptr, start, offs, valid, BY_SIZE)
            c = tl.where(valid, (s * down - pivot) - base, 0.0)
            acc_ss += tl.sum(c * c)
        den = tl.sqrt_rn(tl.div_rn(acc_ss, tl.maximum(n_f - 1.0, 1.0))) + eps * down
        den = tl.where(den > 0, den, 1.0)  # equal huge scores: c = 0 and eps * 2^-k underflowed
    factor = tl.div_rn(n_f, tl.maximum(n_f - 1.0, 1.0))

    # Pass@k (MODE 4, 5): the top score, its first holder (smallest batch position: members are in batch order),
    # the runner-up (the largest of the others), and the margin (over std' + eps * 2^-k for MODE 4); maxima and
    # minima are exact, so the chunk order does not matter
    winner = tl.full((), -1, tl.int64)
    margin = 0.0
    has_nan = 0
    if MODE >= 4:
        top = -float("inf")
        for j0 in range(0, n, BLOCK):
            offs = j0 + lane
            valid = offs < n
            idx, s = _group_chunk(scores_ptr, perm_ptr, start, offs, valid, BY_SIZE)
            top = tl.maximum(top, tl.max(tl.where(valid, s, -float("inf"))))
            has_nan = tl.maximum(has_nan, tl.max(tl.where(valid & (s != s), 1, 0)))
        winner = tl.full((), 2**62, tl.int64)
        for j0 in range(0, n, BLOCK):
            offs = j0 + lane
            valid = offs < n
            idx, s = _group_chunk(scores_ptr, perm_ptr, start, offs, valid, BY_SIZE)
            winner = tl.minimum(winner, tl.min(tl.where(valid & (s == top), idx, 2**62)))
        second = -float("inf")
        acc_ss = 0.0
        for j0 in range(0, n, BLOCK):
            offs = j0 + lane
            valid = offs < n
            idx, s = _group_chunk(scores_ptr, perm_ptr, start, offs, valid, BY_SIZE)
            second = tl.maximum(second, tl.max(tl.where(valid & (idx != winner), s, -float("inf"))))
            c = tl.where(valid, (s * down - pivot) - base, 0.0)
            acc_ss += tl.sum(c * c)
        margin = top * down - second * down
        if MODE == 4:
            den_k = tl.sqrt_rn(tl.div_rn(acc_ss, tl.maximum(n_f - 1.0, 1.0))) + eps * down
            margin = tl.div_rn(margin, tl.where(den_k > 0, den_k, 1.0))
        else:
            margin = margin * up
        winner = tl.where(n > 1, winner, -1)

    # pass 3: the advantages
    single = n == 1
    nonzero = tl.zeros((), tl.int32)
    for j0 in range(0, n, BLOCK):
        offs = j0 + lane
        valid = offs < n
        idx, s = _group_chunk(scores_ptr, perm_ptr, start, offs, valid, BY_SIZE)
        c = (s * down - pivot) - base
        if MODE == 0:
            a = tl.where(single, tl.div_rn(s, 1.0 + eps), tl.div_rn(c, den))
        elif MODE == 2:
            a = tl.where(single, s, (c * factor) * up)
        elif MODE >= 4:
            a = tl.where(idx == winner, margin, 0.0)
            if MODE == 4:
                a = tl.where(single, tl.div_rn(s, 1.0 + eps), a)
            else:
                a = tl.where(single, s, a)
            a = tl.where(has_nan > 0, float("nan"), a)
        else:
            a = tl.where(single, s, c * up)
        if GPG:
            nonzero += tl.sum((valid & (a != 0.0)).to(tl.int32))
        tl.store(out_ptr + idx, a, mask=valid)
    if GPG:
        tl.store(nonzero_ptr + pid, nonzero)


def group_segments(group_index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """CSR of the groups, on the device, without host synchronization.

    Returns ``perm`` (batch positions sorted by group id, stable: ascending position inside a
    group) and ``seg_len`` (at a group's first sorted position, its size; 0 elsewhere).
    """
    n_rows = group_index.shape[0]
    sorted_ids, perm = torch.sort(group_index, stable=True)
    head = torch.ones(n_rows, dtype=torch.bool, device=group_index.device)
    head[1:] = sorted_ids[1:] != sorted_ids[:-1]
    pos = torch.arange(n_rows, device=group_index.device)
    next_head = torch.full_like(pos, n_rows)
    next_head[:-1] = torch.where(head[1:], pos[1:], n_rows)
    next_head = torch.flip(torch.cummin(torch.flip(next_head, (0,)), 0).values, (0,))
    return perm, torch.where(head, next_head - pos, 0)


def group_advantages_fwd(scores, group_index, group_size, lengths, mode, eps, out):
    """Group advantages of ``scores`` ``[B]`` fp32 into ``out`` ``[B]`` fp32.

    Args and math: :func:`rlk.reference.advantages.group_advantages_fwd`. Launches one program
    per group (``group_size``) or per sorted position (``group_index``, see :func:`group_segments`);
    ``gpg`` adds an int32 ``nonzero`` buffer (one count per program), summed and applied with torch.
    """
    n_rows = scores.shape[0]
    cfg = TILE_CONFIGS["group"]
    by_size = group_index is None
    if by_size:
        grid = n_rows // group_size
        perm = seg_len = scores  # unused
    else:
        perm, seg_len = group_segments(group_index)
        grid = n_rows
    gpg = mode == "gpg"
    nonzero = torch.empty(grid if gpg else 1, dtype=torch.int32, device=scores.device)
    with on_device(scores.device):
        _group_advantages_kernel[(grid,)](
            scores,
            perm,
            seg_len,
            lengths if lengths is not None else scores,
            out,
            nonzero,
            group_size,
            eps,
            MODE=_GROUP_MODE_IDS[mode],
            GPG=gpg,
            BY_SIZE=by_size,
            BLOCK=cfg["BLOCK"],
            num_warps=cfg["num_warps"],
        )
    if gpg:
        total = torch.full((), n_rows, dtype=out.dtype, device=out.device)
        out.mul_(total / nonzero.sum().clamp(min=1).to(out.dtype))


# ----------------------------------------------------------------------------------------------
# masked_whiten: fixed partials, one-program combines, two passes
# ----------------------------------------------------------------------------------------------


@triton.jit
def _whiten_partial_kernel(
    x_ptr,
    mask_ptr,
    stats_ptr,
    part_ptr,
    count_ptr,
    exp_ptr,
    N,
    CENTERED: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Block ``p``'s partials; masked-out entries contribute 0 and are never used in arithmetic.

    Pass 1: ``exp[p] = k_p`` (the exponent of the block's largest masked ``|x|``, clamped as in
    :func:`_scale_exponent`), ``part[p] = sum x * 2^-k_p`` and ``count[p]`` (masked entries).
    Pass 2 (``CENTERED``): ``part[p] = sum (x * 2^-k - mu')^2``, ``mu' = stats[0]``, ``2^-k = stats[2]``.
    """
    pid = tl.program_id(0)
    offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < N
    m = tl.load(mask_ptr + offs, mask=inb, other=0) != 0
    x = tl.load(x_ptr + offs, mask=inb, other=0.0)
    if CENTERED:
        c = x * tl.load(stats_ptr + 2) - tl.load(stats_ptr)
        tl.store(part_ptr + pid, tl.sum(tl.where(m, c * c, 0.0)))
    else:
        k = _scale_exponent(tl.max(tl.where(m, tl.abs(x), 0.0)))
        tl.store(exp_ptr + pid, k)
        tl.store(part_ptr + pid, tl.sum(tl.where(m, x * _pow2(-k), 0.0)))
        tl.store(count_ptr + pid, tl.sum(m.to(tl.int32)))


@triton.jit
def _whiten_combine_kernel(
    part_ptr,
    count_ptr,
    exp_ptr,
    stats_ptr,
    total_ptr,
    n_parts,
    eps,
    STAGE: tl.constexpr,
    UNBIASED: tl.constexpr,
    CLAMP: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Combine the partials in index order (``BLOCK`` at a time).

    Stage 0: ``k = max_p k_p``; ``total = n``; ``stats = (mu', -, 2^-k, mu)`` with ``mu' = sum_p part_p *
    2^(k_p - k) / n`` (each rescale exact: ``k_p - k >= -126``) and ``mu = mu' * 2^k``.
    Stage 1: ``stats[1] = rstd' = 1 / sqrt(var' + eps')`` (``max(var', eps')`` with ``CLAMP``),
    ``eps' = eps * 2^-k * 2^-k``; 0 when that is 0 (every ``x' - mu'`` is 0 then).
    """
    lane = tl.arange(0, BLOCK)
    if STAGE == 0:
        k = tl.zeros((), tl.int32)
        for p0 in range(0, n_parts, BLOCK):
            offs = p0 + lane
            k = tl.maximum(k, tl.max(tl.load(exp_ptr + offs, mask=offs < n_parts, other=0)))
        acc = 0.0
        n = tl.zeros((), tl.int64)
        for p0 in range(0, n_parts, BLOCK):
            offs = p0 + lane
            inb = offs < n_parts
            rescale = _pow2(tl.load(exp_ptr + offs, mask=inb, other=0) - k)
            acc += tl.sum(tl.load(part_ptr + offs, mask=inb, other=0.0) * rescale)
            n += tl.sum(tl.load(count_ptr + offs, mask=inb, other=0).to(tl.int64))
        tl.store(total_ptr, n)
        mu_scaled = tl.div_rn(acc, tl.maximum(n, 1).to(tl.float32))
        tl.store(stats_ptr, mu_scaled)
        tl.store(stats_ptr + 2, _pow2(-k))
        tl.store(stats_ptr + 3, mu_scaled * _pow2(k))
    else:
        acc = 0.0
        for p0 in range(0, n_parts, BLOCK):
            offs = p0 + lane
            acc += tl.sum(tl.load(part_ptr + offs, mask=offs < n_parts, other=0.0))
        n = tl.load(total_ptr)
        if UNBIASED:
            n = n - 1
        var = tl.div_rn(acc, tl.maximum(n, 1).to(tl.float32))
        down = tl.load(stats_ptr + 2)
        eps_scaled = eps * down * down
        if CLAMP:
            var = tl.maximum(var, eps_scaled)
        else:
            var = var + eps_scaled
        tl.store(stats_ptr + 1, tl.where(var > 0, tl.div_rn(1.0, tl.sqrt_rn(tl.where(var > 0, var, 1.0))), 0.0))


@triton.jit
def _whiten_apply_kernel(x_ptr, mask_ptr, stats_ptr, out_ptr, N, SHIFT_MEAN: tl.constexpr, BLOCK: tl.constexpr):
    """``out = (x * 2^-k - mu') * rstd' (+ mu)`` where mask, else 0."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < N
    m = tl.load(mask_ptr + offs, mask=inb, other=0) != 0
    x = tl.load(x_ptr + offs, mask=inb, other=0.0)
    y = (x * tl.load(stats_ptr + 2) - tl.load(stats_ptr)) * tl.load(stats_ptr + 1)
    if not SHIFT_MEAN:
        y = y + tl.load(stats_ptr + 3)
    tl.store(out_ptr + offs, tl.where(m, y, 0.0), mask=inb)


def masked_whiten_fwd(x, mask, unbiased, eps, eps_mode, shift_mean, out):
    """Whiten ``x`` ``[N]`` fp32 over ``mask`` ``[N]`` bool into ``out`` ``[N]`` fp32.

    Args and math: :func:`rlk.reference.advantages.masked_whiten_fwd`. Five launches (partials,
    combine, centred partials, combine, apply); scratch: ``cdiv(N, BLOCK)`` floats and two int32s each.
    """
    n = x.numel()
    cfg = TILE_CONFIGS["whiten"]
    n_parts = triton.cdiv(n, cfg["BLOCK"])
    part = torch.empty(n_parts, dtype=torch.float32, device=x.device)
    count = torch.empty(n_parts, dtype=torch.int32, device=x.device)
    exps = torch.empty(n_parts, dtype=torch.int32, device=x.device)
    stats = torch.empty(4, dtype=torch.float32, device=x.device)  # mu', rstd', 2^-k, mu
    total = torch.empty(1, dtype=torch.int64, device=x.device)
    block, combine, warps = cfg["BLOCK"], cfg["COMBINE_BLOCK"], cfg["num_warps"]
    clamp = eps_mode == "clamp"
    with on_device(x.device):
        for stage in (0, 1):
            _whiten_partial_kernel[(n_parts,)](
                x, mask, stats, part, count, exps, n, CENTERED=stage == 1, BLOCK=block, num_warps=warps
            )
            _whiten_combine_kernel[(1,)](
                part,
                count,
                exps,
                stats,
                total,
                n_parts,
                eps,
                STAGE=stage,
                UNBIASED=unbiased,
                CLAMP=clamp,
                BLOCK=combine,
                num_warps=warps,
            )
        _whiten_apply_kernel[(n_parts,)](x, mask, stats, out, n, SHIFT_MEAN=shift_mean, BLOCK=block, num_warps=warps)


# ----------------------------------------------------------------------------------------------
# discounted_returns and gae: reverse linear-recurrence scans
# ----------------------------------------------------------------------------------------------


@triton.jit
def _affine(a, x, b):
    """``a * x + b``, and exactly ``b`` where ``a == 0``: a zero coefficient drops ``x`` by a select, so a
    NaN or inf state (from a masked position) cannot turn into NaN through ``0 * x``. For finite ``x``
    the value is the same (up to the sign of a zero)."""
    return tl.where(a == 0.0, b, a * x + b)


@triton.jit
def _compose(a1, b1, a2, b2):
    """Map ``(a1, b1)`` then map ``(a2, b2)``: ``x -> a2 * (a1 * x + b1) + b2`` (``a2 == 0``: constant ``b2``)."""
    return a2 * a1, _affine(a2, b1, b2)


@triton.jit
def _apply_scan(a, b, carry):
    """Each lane's state after its position: the maps of lanes ``0..j`` composed, applied to ``carry``."""
    acc_a, acc_b = tl.associative_scan((a, b), 0, _compose)
    return _affine(acc_a, carry, acc_b)


@triton.jit
def _last_lane(x, lane, BLOCK_T: tl.constexpr):
    """Lane ``BLOCK_T - 1`` of ``x`` as a scalar (the chunk's first position: the carry to the left)."""
    return tl.sum(tl.where(lane == BLOCK_T - 1, x, 0.0))


@triton.jit
def _returns_kernel(r_ptr, m_ptr, out_ptr, T, gamma, MASK_MODE: tl.constexpr, BLOCK_T: tl.constexpr):
    """``G_t`` for one row (MASK_MODE 0 carry, 1 reset, 2 zero). Lane ``j`` of chunk ``c`` is
    position ``c * BLOCK_T + BLOCK_T - 1 - j``; positions past ``T`` are identity maps."""
    row = tl.program_id(0).to(tl.int64)
    base = row * T
    lane = tl.arange(0, BLOCK_T)
    n_chunks = tl.cdiv(T, BLOCK_T)
    carry = 0.0
    for k in range(0, n_chunks):
        t = (n_chunks - 1 - k) * BLOCK_T + (BLOCK_T - 1 - lane)
        inb = t < T
        r = tl.load(r_ptr + base + t, mask=inb, other=0.0)
        m = tl.load(m_ptr + base + t, mask=inb, other=0) != 0
        if MASK_MODE == 0:
            a = tl.where(m, gamma, 1.0)
            b = tl.where(m, r, 0.0)
        elif MASK_MODE == 1:
            m_next = tl.load(m_ptr + base + t + 1, mask=t + 1 < T, other=1) != 0
            a = tl.where(m_next, gamma, 0.0)
            b = r
        else:
            a = gamma + tl.zeros((BLOCK_T,), tl.float32)
            b = tl.where(m, r, 0.0)
        g = _apply_scan(tl.where(inb, a, 1.0), tl.where(inb, b, 0.0), carry)
        tl.store(out_ptr + base + t, g, mask=inb)
        carry = _last_lane(g, lane, BLOCK_T)


@triton.jit
def _gae_kernel(r_ptr, v_ptr, m_ptr, adv_ptr, ret_ptr, T, gamma, gamma_lam, BLOCK_T: tl.constexpr):
    """GAE for one row, two scans per chunk: the next unmasked value ``nv`` (a position maps the state
    to its right to ``V`` of position ``t + 1`` if that is unmasked, else leaves it), then ``a``."""
    row = tl.program_id(0).to(tl.int64)
    base = row * T
    lane = tl.arange(0, BLOCK_T)
    n_chunks = tl.cdiv(T, BLOCK_T)
    carry_nv = 0.0
    carry_a = 0.0
    for k in range(0, n_chunks):
        t = (n_chunks - 1 - k) * BLOCK_T + (BLOCK_T - 1 - lane)
        inb = t < T
        nxt = t + 1 < T
        r = tl.load(r_ptr + base + t, mask=inb, other=0.0)
        v = tl.load(v_ptr + base + t, mask=inb, other=0.0)
        m = tl.load(m_ptr + base + t, mask=inb, other=0) != 0
        m1 = tl.load(m_ptr + base + t + 1, mask=nxt, other=0) != 0
        v1 = tl.load(v_ptr + base + t + 1, mask=nxt, other=0.0)
        nv = _apply_scan(tl.where(m1, 0.0, 1.0), tl.where(m1, v1, 0.0), carry_nv)
        delta = r + gamma * nv - v
        adv = _apply_scan(tl.where(m, gamma_lam, 1.0), tl.where(m, delta, 0.0), carry_a)
        tl.store(adv_ptr + base + t, adv, mask=inb)
        tl.store(ret_ptr + base + t, adv + v, mask=inb)
        carry_nv = _last_lane(nv, lane, BLOCK_T)
        carry_a = _last_lane(adv, lane, BLOCK_T)


def discounted_returns_fwd(rewards, mask, gamma, mask_mode, out):
    """Returns of ``rewards`` ``[B, T]`` fp32 with ``mask`` ``[B, T]`` bool into ``out`` ``[B, T]`` fp32.

    Args and math: :func:`rlk.reference.advantages.discounted_returns_fwd`. One program per row.
    """
    n_rows, length = rewards.shape
    cfg = TILE_CONFIGS["scan"]
    with on_device(rewards.device):
        _returns_kernel[(n_rows,)](
            rewards,
            mask,
            out,
            length,
            gamma,
            MASK_MODE=_RETURN_MASK_MODE_IDS[mask_mode],
            BLOCK_T=cfg["BLOCK_T"],
            num_warps=cfg["num_warps"],
        )


def gae_fwd(rewards, values, mask, gamma, gamma_lam, advantages_out, returns_out):
    """GAE advantages and returns of ``[B, T]`` fp32 rewards / values and a bool mask.

    Args and math: :func:`rlk.reference.advantages.gae_fwd` (``gamma_lam = gamma * lam``). One
    program per row.
    """
    n_rows, length = rewards.shape
    cfg = TILE_CONFIGS["scan"]
    with on_device(rewards.device):
        _gae_kernel[(n_rows,)](
            rewards,
            values,
            mask,
            advantages_out,
            returns_out,
            length,
            gamma,
            gamma_lam,
            BLOCK_T=cfg["BLOCK_T"],
            num_warps=cfg["num_warps"],
        )
