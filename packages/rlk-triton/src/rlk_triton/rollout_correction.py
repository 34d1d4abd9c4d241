"""Triton kernels of ``rollout_correction``: rollout-vs-training importance weights and their metrics.

The math is the spec in :mod:`rlk.reference.rollout_correction`. Programs ``(row, chunk of BLOCK_T tokens)``
compute the weights and the chunk's partial statistics (at the sequence level after a pass that writes each
chunk's sum of log-ratios, which every program of the row adds in chunk order); one program per row adds its
chunks in chunk order; one program adds the rows in row order into the metrics.

Batch invariance and determinism by construction: fixed tile sizes (nothing derived from ``B``), a row's
weights depend only on that row, no atomics, every floating-point reduction in an order that depends only on
``T`` (within a row) or ``B`` (over rows). Standard deviations merge (count, sum, centred sum of squares)
partials (Chan et al.), never ``E[x^2] - E[x]^2``. Offsets are int64; everything is fp32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlk.core.abi import CORRECTION_METRICS, correction_thresholds
from rlk_triton.common import on_device

#: Tokens per program (one chunk of one row); chunk partials per step of the in-row sums; rows per step (lanes)
#: of the sum over rows. Fixed: results never depend on the batch.
BLOCK_T = 1024
PARTS_BLOCK = 32
COMBINE_BLOCK = 128
NUM_WARPS = 4

# Columns of the chunk and row statistics (sums unless marked; identities 0 for the maxima of values >= 0).
_N = tl.constexpr(0)  # tokens
_SW = tl.constexpr(1)  # sum of w
_QW = tl.constexpr(2)  # sum of (w - mean w)^2 (merged by _chan)
_WMAX = tl.constexpr(3)  # max of w
_WMIN = tl.constexpr(4)  # min of w (identity +inf)
_SW2 = tl.constexpr(5)  # sum of w^2
_RMAX = tl.constexpr(6)  # max of r
_RMIN = tl.constexpr(7)  # min of r (identity +inf)
_HIGH = tl.constexpr(8)  # tokens with r > high
_LOW = tl.constexpr(9)  # tokens with r < low
_CLIP = tl.constexpr(10)  # tokens with w != r
_SABS = tl.constexpr(11)  # sum of |old - roll| over the scored tokens (log-ratio not NaN)
_MABS = tl.constexpr(12)  # max of it
_NSC = tl.constexpr(13)  # scored tokens
_SD = tl.constexpr(14)  # sum of d
_SK3 = tl.constexpr(15)  # sum of exp(dc) - dc - 1
_SCHI = tl.constexpr(16)  # sum of exp(dc)^2 - 1
_SOLD = tl.constexpr(17)  # sum of old
_SR = tl.constexpr(18)  # sum of r
_NUM_STATS = 19
_STATS = tl.constexpr(_NUM_STATS)
_COLS = 32  # the columns padded to a power of two

#: The order in which _combine_kernel stores the metrics: it must be CORRECTION_METRICS.
_STORE_ORDER = (
    "weight_mean",
    "weight_max",
    "weight_min",
    "weight_std",
    "ess",
    "ratio_max",
    "ratio_min",
    "fraction_high",
    "fraction_low",
    "clipped_fraction",
    "abs_log_ratio_mean",
    "abs_log_ratio_max",
    "kl",
    "k3_kl",
    "chi2_token",
    "tokens",
    "seq_weight_mean",
    "seq_weight_max",
    "seq_weight_min",
    "seq_weight_std",
    "seq_weight_max_deviation",
    "seq_fraction_high",
    "seq_fraction_low",
    "seq_clipped_fraction",
    "chi2_seq",
    "training_ppl",
    "training_log_ppl",
    "rollout_ppl",
    "rollout_log_ppl",
    "log_ppl_diff",
    "log_ppl_abs_diff",
    "log_ppl_diff_max",
    "log_ppl_diff_min",
    "ppl_ratio",
    "sequences",
)
assert _STORE_ORDER == CORRECTION_METRICS


@triton.jit
def _clamp(x, c, HAS_CLAMP: tl.constexpr):
    if HAS_CLAMP:
        x = tl.minimum(tl.maximum(x, -c), c)
    return x


@triton.jit
def _chan(na, sa, qa, nb, sb, qb):
    """Merge two (count, sum, centred sum of squares) partials; a part with count 0 adds nothing."""
    n = na + nb
    delta = sb / tl.maximum(nb, 1.0) - sa / tl.maximum(na, 1.0)
    cross = tl.where((na > 0) & (nb > 0), delta * delta * (na * nb / tl.maximum(n, 1.0)), 0.0)
    return n, sa + sb, qa + qb + cross


@triton.jit
def _log_ratios(old_ptr, roll_ptr, mask_ptr, base, offs, inb):
    """Mask, ``old`` and ``raw = old - roll`` (0 off the mask), the scored tokens and ``d`` (raw, NaN as 0)."""
    m = tl.load(mask_ptr + base + offs, mask=inb, other=0) != 0
    old = tl.where(m, tl.load(old_ptr + base + offs, mask=inb, other=0.0), 0.0)
    raw = old - tl.where(m, tl.load(roll_ptr + base + offs, mask=inb, other=0.0), 0.0)
    scored = m & (raw == raw)
    return m, old, raw, scored, tl.where(scored, raw, 0.0)


@triton.jit
def _row_sum_kernel(old_ptr, roll_ptr, mask_ptr, parts_ptr, T, n_chunks, BLOCK: tl.constexpr):
    """Program ``(row, chunk)``: the chunk's sum of log-ratios ``d`` (level "sequence")."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1).to(tl.int64)
    offs = chunk * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    _, _, _, _, d = _log_ratios(old_ptr, roll_ptr, mask_ptr, row * T, offs, offs < T)
    tl.store(parts_ptr + row * n_chunks + chunk, tl.sum(d, axis=0))


@triton.jit
def _token_kernel(
    old_ptr,
    roll_ptr,
    mask_ptr,
    parts_ptr,
    w_ptr,
    stats_ptr,
    T,
    n_chunks,
    upper,
    lower,
    high,
    low,
    clamp,
    SEQUENCE: tl.constexpr,
    MASK_MODE: tl.constexpr,
    HAS_CLAMP: tl.constexpr,
    BLOCK: tl.constexpr,
    PARTS_BLOCK: tl.constexpr,
):
    """Program ``(row, chunk)``: the weights of ``BLOCK`` tokens and the chunk's statistics."""
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1).to(tl.int64)
    base = row * T
    offs = chunk * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    inb = offs < T
    m, old, raw, scored, d = _log_ratios(old_ptr, roll_ptr, mask_ptr, base, offs, inb)
    dc = _clamp(d, clamp, HAS_CLAMP)
    if SEQUENCE:
        # the row's sum of log-ratios from the chunk sums, added in chunk order (the same sum in every program)
        acc = tl.zeros((PARTS_BLOCK,), tl.float32)
        for c0 in range(0, n_chunks, PARTS_BLOCK):
            ks = c0 + tl.arange(0, PARTS_BLOCK).to(tl.int64)
            acc += tl.load(parts_ptr + row * n_chunks + ks, mask=ks < n_chunks, other=0.0)
        s = tl.sum(acc, axis=0)
        s = tl.where(s == s, s, 0.0)
        x = tl.zeros((BLOCK,), tl.float32) + _clamp(s, clamp, HAS_CLAMP)
    else:
        x = dc
    r = tl.where(m, tl.exp(x), 0.0)
    if MASK_MODE:
        w = tl.where((r >= lower) & (r <= upper), r, 0.0)
    else:
        w = tl.minimum(tl.maximum(r, lower), upper)
    w = tl.where(m, w, 0.0)
    tl.store(w_ptr + base + offs, w, mask=inb)

    ones = tl.where(m, 1.0, 0.0)
    n = tl.sum(ones, axis=0)
    sw = tl.sum(w, axis=0)
    centred = tl.where(m, w - sw / tl.maximum(n, 1.0), 0.0)
    abs_raw = tl.where(scored, tl.abs(raw), 0.0)
    rho = tl.exp(dc)
    out = stats_ptr + (row * n_chunks + chunk) * _STATS
    tl.store(out + _N, n)
    tl.store(out + _SW, sw)
    tl.store(out + _QW, tl.sum(centred * centred, axis=0))
    tl.store(out + _WMAX, tl.max(w, axis=0))
    tl.store(out + _WMIN, tl.min(tl.where(m, w, float("inf")), axis=0))
    tl.store(out + _SW2, tl.sum(w * w, axis=0))
    tl.store(out + _RMAX, tl.max(r, axis=0))
    tl.store(out + _RMIN, tl.min(tl.where(m, r, float("inf")), axis=0))
    tl.store(out + _HIGH, tl.sum(tl.where(m & (r > high), 1.0, 0.0), axis=0))
    tl.store(out + _LOW, tl.sum(tl.where(m & (r < low), 1.0, 0.0), axis=0))
    tl.store(out + _CLIP, tl.sum(tl.where(m & (w != r), 1.0, 0.0), axis=0))
    tl.store(out + _SABS, tl.sum(abs_raw, axis=0))
    tl.store(out + _MABS, tl.max(abs_raw, axis=0))
    tl.store(out + _NSC, tl.sum(tl.where(scored, 1.0, 0.0), axis=0))
    tl.store(out + _SD, tl.sum(d, axis=0))
    tl.store(out + _SK3, tl.sum(tl.where(m, rho - dc - 1.0, 0.0), axis=0))
    tl.store(out + _SCHI, tl.sum(tl.where(m, rho * rho - 1.0, 0.0), axis=0))
    tl.store(out + _SOLD, tl.sum(old, axis=0))
    tl.store(out + _SR, tl.sum(r, axis=0))


@triton.jit
def _column(tile, cols, k):
    """Column ``k`` of a ``[lanes, COLS]`` tile as a ``[lanes]`` vector (exact: adds zeros)."""
    return tl.sum(tl.where(cols[None, :] == k, tile, 0.0), axis=1)


@triton.jit
def _merge(acc, tile, cols):
    """Lane-wise merge of statistics tiles ``[lanes, COLS]``: sums, maxima, minima by column, the centred sum of
    squares by :func:`_chan`."""
    is_max = (cols == _WMAX) | (cols == _RMAX) | (cols == _MABS)
    is_min = (cols == _WMIN) | (cols == _RMIN)
    merged = tl.where(
        is_max[None, :], tl.maximum(acc, tile), tl.where(is_min[None, :], tl.minimum(acc, tile), acc + tile)
    )
    _, _, q = _chan(
        _column(acc, cols, _N),
        _column(acc, cols, _SW),
        _column(acc, cols, _QW),
        _column(tile, cols, _N),
        _column(tile, cols, _SW),
        _column(tile, cols, _QW),
    )
    return tl.where((cols == _QW)[None, :], q[:, None], merged)


@triton.jit
def _total(acc, cols):
    """The lanes of :func:`_merge` tiles reduced to ``[COLS]`` (one tree, fixed for a lane count), and the
    merged centred sum of squares."""
    is_max = (cols == _WMAX) | (cols == _RMAX) | (cols == _MABS)
    is_min = (cols == _WMIN) | (cols == _RMIN)
    total = tl.where(is_max, tl.max(acc, axis=0), tl.where(is_min, tl.min(acc, axis=0), tl.sum(acc, axis=0)))
    _, _, q = tl.reduce((_column(acc, cols, _N), _column(acc, cols, _SW), _column(acc, cols, _QW)), 0, _chan)
    return tl.where(cols == _QW, q, total)


@triton.jit
def _identity(cols):
    """The identity row of :func:`_merge`: 0, and +inf in the minimum columns."""
    return tl.where((cols == _WMIN) | (cols == _RMIN), float("inf"), 0.0)


@triton.jit
def _row_stats_kernel(stats_ptr, row_stats_ptr, n_chunks, PARTS_BLOCK: tl.constexpr, COLS: tl.constexpr):
    """Program ``row``: the row's chunk statistics merged in chunk order (lanes ``PARTS_BLOCK`` wide, one tree)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, COLS)
    col_in = cols < _STATS
    acc = tl.zeros((PARTS_BLOCK, COLS), tl.float32) + _identity(cols)[None, :]
    for c0 in range(0, n_chunks, PARTS_BLOCK):
        ks = c0 + tl.arange(0, PARTS_BLOCK).to(tl.int64)
        tile = tl.load(
            stats_ptr + (row * n_chunks + ks)[:, None] * _STATS + cols[None, :],
            mask=(ks < n_chunks)[:, None] & col_in[None, :],
            other=0.0,
        )
        tile = tl.where((ks < n_chunks)[:, None], tile, _identity(cols)[None, :])
        acc = _merge(acc, tile, cols)
    tl.store(row_stats_ptr + row * _STATS + cols, _total(acc, cols), mask=col_in)


@triton.jit
def _pick(total, cols, k):
    return tl.sum(tl.where(cols == k, total, 0.0), axis=0)


@triton.jit
def _ratio(num, den):
    """``num / den``, 0 when ``den`` is 0."""
    return tl.where(den > 0, num / tl.maximum(den, 1.0), 0.0)


@triton.jit
def _combine_kernel(
    row_stats_ptr, metrics_ptr, B, high, low, clamp, HAS_CLAMP: tl.constexpr, LANES: tl.constexpr, COLS: tl.constexpr
):
    """One program: the rows' statistics merged in row order (lane ``j`` takes rows ``j, j + LANES, ...``; one tree
    at the end) into the token metrics, and the per-row quantities into the sequence metrics."""
    cols = tl.arange(0, COLS)
    col_in = cols < _STATS
    lanes = tl.arange(0, LANES).to(tl.int64)
    acc = tl.zeros((LANES, COLS), tl.float32) + _identity(cols)[None, :]
    zero = tl.zeros((LANES,), tl.float32)
    seqs, sum_w, q_w = zero, zero, zero
    max_w, min_w, max_dev = zero - float("inf"), zero + float("inf"), zero - float("inf")
    n_high, n_low, n_clip, chi2 = zero, zero, zero, zero
    ppl_t, log_ppl_t, ppl_r, log_ppl_r = zero, zero, zero, zero
    diff, abs_diff, ratio = zero, zero, zero
    max_diff, min_diff = zero - float("inf"), zero + float("inf")
    for b0 in range(0, B, LANES):
        rows = b0 + lanes
        row_in = rows < B
        tile = tl.load(
            row_stats_ptr + rows[:, None] * _STATS + cols[None, :], mask=row_in[:, None] & col_in[None, :], other=0.0
        )
        tile = tl.where(row_in[:, None], tile, _identity(cols)[None, :])
        acc = _merge(acc, tile, cols)
        # per-row quantities of the rows with tokens (module docstring of the reference)
        n = _column(tile, cols, _N)
        has = n > 0
        n1 = tl.maximum(n, 1.0)
        w = _column(tile, cols, _SW) / n1
        r = _column(tile, cols, _SR) / n1
        s = _column(tile, cols, _SD)
        s = tl.where(s == s, s, 0.0)
        log_old = _column(tile, cols, _SOLD) / n1
        log_diff = s / n1
        log_roll = log_old - log_diff
        one = tl.where(has, 1.0, 0.0)
        seqs, sum_w, q_w = _chan(seqs, sum_w, q_w, one, tl.where(has, w, 0.0), zero)
        max_w = tl.maximum(max_w, tl.where(has, w, -float("inf")))
        min_w = tl.minimum(min_w, tl.where(has, w, float("inf")))
        max_dev = tl.maximum(max_dev, tl.where(has, tl.abs(w - 1.0), -float("inf")))
        n_high += tl.where(has & (r > high), 1.0, 0.0)
        n_low += tl.where(has & (r < low), 1.0, 0.0)
        n_clip += tl.where(has & (_column(tile, cols, _CLIP) > 0), 1.0, 0.0)
        chi2 += tl.where(has, tl.exp(2.0 * _clamp(s, clamp, HAS_CLAMP)) - 1.0, 0.0)
        ppl_t += tl.where(has, tl.exp(-log_old), 0.0)
        log_ppl_t += tl.where(has, -log_old, 0.0)
        ppl_r += tl.where(has, tl.exp(-log_roll), 0.0)
        log_ppl_r += tl.where(has, -log_roll, 0.0)
        diff += tl.where(has, -log_diff, 0.0)
        abs_diff += tl.where(has, tl.abs(log_diff), 0.0)
        max_diff = tl.maximum(max_diff, tl.where(has, -log_diff, -float("inf")))
        min_diff = tl.minimum(min_diff, tl.where(has, -log_diff, float("inf")))
        ratio += tl.where(has, tl.exp(-log_diff), 0.0)

    total = _total(acc, cols)
    n = _pick(total, cols, _N)
    any_token = n > 0
    weight_mean = _ratio(_pick(total, cols, _SW), n)
    mean_sq = _ratio(_pick(total, cols, _SW2), n)
    tl.store(metrics_ptr + 0, weight_mean)
    tl.store(metrics_ptr + 1, _pick(total, cols, _WMAX))
    tl.store(metrics_ptr + 2, tl.where(any_token, _pick(total, cols, _WMIN), 0.0))
    tl.store(metrics_ptr + 3, tl.sqrt(_ratio(_pick(total, cols, _QW), n)))
    tl.store(
        metrics_ptr + 4, tl.where(mean_sq > 0, weight_mean * weight_mean / tl.where(mean_sq > 0, mean_sq, 1.0), 0.0)
    )
    tl.store(metrics_ptr + 5, _pick(total, cols, _RMAX))
    tl.store(metrics_ptr + 6, tl.where(any_token, _pick(total, cols, _RMIN), 0.0))
    tl.store(metrics_ptr + 7, _ratio(_pick(total, cols, _HIGH), n))
    tl.store(metrics_ptr + 8, _ratio(_pick(total, cols, _LOW), n))
    tl.store(metrics_ptr + 9, _ratio(_pick(total, cols, _CLIP), n))
    tl.store(metrics_ptr + 10, _ratio(_pick(total, cols, _SABS), _pick(total, cols, _NSC)))
    tl.store(metrics_ptr + 11, _pick(total, cols, _MABS))
    tl.store(metrics_ptr + 12, -_ratio(_pick(total, cols, _SD), n))
    tl.store(metrics_ptr + 13, _ratio(_pick(total, cols, _SK3), n))
    tl.store(metrics_ptr + 14, _ratio(_pick(total, cols, _SCHI), n))
    tl.store(metrics_ptr + 15, n)

    seqs, sum_w, q_w = tl.reduce((seqs, sum_w, q_w), 0, _chan)
    any_row = seqs > 0
    tl.store(metrics_ptr + 16, _ratio(sum_w, seqs))
    tl.store(metrics_ptr + 17, tl.where(any_row, tl.max(max_w, axis=0), 0.0))
    tl.store(metrics_ptr + 18, tl.where(any_row, tl.min(min_w, axis=0), 0.0))
    tl.store(metrics_ptr + 19, tl.where(seqs > 1, tl.sqrt(q_w / tl.maximum(seqs - 1.0, 1.0)), 0.0))
    tl.store(metrics_ptr + 20, tl.where(any_row, tl.max(max_dev, axis=0), 0.0))
    tl.store(metrics_ptr + 21, _ratio(tl.sum(n_high, axis=0), seqs))
    tl.store(metrics_ptr + 22, _ratio(tl.sum(n_low, axis=0), seqs))
    tl.store(metrics_ptr + 23, _ratio(tl.sum(n_clip, axis=0), seqs))
    tl.store(metrics_ptr + 24, _ratio(tl.sum(chi2, axis=0), seqs))
    tl.store(metrics_ptr + 25, _ratio(tl.sum(ppl_t, axis=0), seqs))
    tl.store(metrics_ptr + 26, _ratio(tl.sum(log_ppl_t, axis=0), seqs))
    tl.store(metrics_ptr + 27, _ratio(tl.sum(ppl_r, axis=0), seqs))
    tl.store(metrics_ptr + 28, _ratio(tl.sum(log_ppl_r, axis=0), seqs))
    tl.store(metrics_ptr + 29, _ratio(tl.sum(diff, axis=0), seqs))
    tl.store(metrics_ptr + 30, _ratio(tl.sum(abs_diff, axis=0), seqs))
    tl.store(metrics_ptr + 31, tl.where(any_row, tl.max(max_diff, axis=0), 0.0))
    tl.store(metrics_ptr + 32, tl.where(any_row, tl.min(min_diff, axis=0), 0.0))
    tl.store(metrics_ptr + 33, _ratio(tl.sum(ratio, axis=0), seqs))
    tl.store(metrics_ptr + 34, seqs)


def rollout_correction_fwd(
    old_logprob, rollout_logprob, mask, weights_out, metrics_out, *, level, mode, upper, lower, clamp
):
    """Importance weights and metrics (spec and arguments: the reference's
    :func:`rlk.reference.rollout_correction.rollout_correction_fwd`).

    Shapes: ``[B, T]`` fp32 log-probs, bool ``mask``; outputs ``weights_out[B, T]``,
    ``metrics_out[len(CORRECTION_METRICS)]``.
    Programs ``(row, chunk of BLOCK_T tokens)`` (after a pass of chunk sums at the sequence level), then one
    program per row, then one program over the rows.
    """
    n_rows, t = old_logprob.shape
    n_chunks = triton.cdiv(t, BLOCK_T)
    device = old_logprob.device
    high, low = correction_thresholds(upper, lower)
    has_clamp = clamp != float("inf")
    clamp_arg = float(clamp) if has_clamp else 0.0
    sequence = level == "sequence"
    stats = torch.empty((n_rows, n_chunks, _NUM_STATS), dtype=torch.float32, device=device)
    row_stats = torch.empty((n_rows, _NUM_STATS), dtype=torch.float32, device=device)
    parts = torch.empty((n_rows, n_chunks), dtype=torch.float32, device=device) if sequence else stats
    mask_bytes = mask.view(torch.uint8)
    grid = (n_rows, n_chunks)
    with on_device(device):
        if sequence:
            _row_sum_kernel[grid](
                old_logprob, rollout_logprob, mask_bytes, parts, t, n_chunks, BLOCK=BLOCK_T, num_warps=NUM_WARPS
            )
        _token_kernel[grid](
            old_logprob,
            rollout_logprob,
            mask_bytes,
            parts,
            weights_out,
            stats,
            t,
            n_chunks,
            float(upper),
            float(lower),
            float(high),
            float(low),
            clamp_arg,
            SEQUENCE=sequence,
            MASK_MODE=mode == "mask",
            HAS_CLAMP=has_clamp,
            BLOCK=BLOCK_T,
            PARTS_BLOCK=PARTS_BLOCK,
            num_warps=NUM_WARPS,
        )
        _row_stats_kernel[(n_rows,)](
            stats, row_stats, n_chunks, PARTS_BLOCK=PARTS_BLOCK, COLS=_COLS, num_warps=NUM_WARPS
        )
        _combine_kernel[(1,)](
            row_stats,
            metrics_out,
            n_rows,
            float(high),
            float(low),
            clamp_arg,
            HAS_CLAMP=has_clamp,
            LANES=COMBINE_BLOCK,
            COLS=_COLS,
            num_warps=NUM_WARPS,
        )
