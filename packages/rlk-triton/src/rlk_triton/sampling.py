"""Triton kernel of ``rlk.sample``: batch-invariant fused sampling (spec: :mod:`rlk.reference.sampling`).

One program per row; every pass reads the row in chunks in index order:

1. the max ``mx`` of the logits ``x`` (NaN read as -inf) and the first index of it; with top-k, also the 256-bin
   count histogram of the top byte of the order keys of ``x``; from here on the scaled logits
   ``z = (x - mx) * inv_t`` (0 where ``x == mx``) lie in ``[-inf, 0]`` with ``max z = 0``;
2. top-k only: three more counting passes, one byte each, find the k-th largest key of ``x`` by radix select
   (per pass a ``tl.histogram`` of the next byte of the keys that match the bytes found so far); ``z`` is
   non-decreasing in ``x``, so ``tau_k`` is the key of that logit's ``z``;
3. greedy and top-p only: the sum pass: ``R`` (fp64); with top-p also the integer mass total ``Q`` of the top-k
   survivors and a count histogram of them over bins of ``0.1`` in ``-z``. From it a *candidate list*: the
   survivors in the fewest top bins whose mass, bounded below from the counts, reaches ``p * Q`` (fewer bins if
   that is more than ``LIST_CAP`` survivors).
   One pass copies their logits, in index order, to the row's scratch list and one pass over the list checks that
   its exact mass reaches the target. Then ``tau_p`` by a radix select over the list, or (no list, or one short of
   the target) over the row: 4-bit digits of ``key - kmin`` (``kmin``: the smallest key of positive mass), one pass
   per digit with a 16-bin exact int64 mass histogram of the keys that match the digits found so far;
4. the Gumbel-max pass (``R`` here when top-p is off): keys ``>= max(tau_k, tau_p)`` (and ``e >= min_p``) are kept;
   a chunk without a kept token skips the noise; Philox4x32-10 in uint32 arithmetic (``tl.umulhi``), once per
   counter for its four lanes, then ``-log(-log(u))`` in fp64; a running argmax that keeps the lowest index on ties.

Every threshold is exactly the reference's (the selects count or sum exact integers, and the list is an upper set
of the keys that provably holds the top-p threshold, else the row is used), so the list, its bins and ``LIST_CAP``
change the speed, never a bit of the result. Nothing depends on the batch, the grid or the row's position: no
atomics, a fixed chunk order, no sort. The top-k / top-p / min-p passes are compiled in only when the filter is on.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlk_triton.common import on_device

BLOCK = 2048
NUM_WARPS = 8
#: Software-pipelining depth of the loads of the passes that do little arithmetic (max, counts, sum, copy).
LOAD_STAGES = 3
# The kernel is compiled with enable_fp_fusion=False: z = (x - mx) * inv_t ends in one rounded multiply (the spec),
# and LLVM / ptxas would otherwise contract it with the next add or subtraction (score = z + g, seen for m - z in the
# sm_90 PTX), which changes the scores' bits and makes the list's bins differ between two passes.
#: Most top-p candidates copied to the scratch list of a row (more: the top-p select runs over the row).
LIST_CAP = 16384
#: The list must reach this multiple of the target mass by its counted lower bound (headroom for rounding).
LIST_MARGIN = 1.01
#: 2**36, as rlk.reference.sampling.MASS_SCALE (a constexpr: the kernel reads it).
MASS_SCALE = tl.constexpr(68719476736.0)
PHILOX_M0 = tl.constexpr(0xD2511F53)
PHILOX_M1 = tl.constexpr(0xCD9E8D57)
PHILOX_W0 = tl.constexpr(0x9E3779B9)
PHILOX_W1 = tl.constexpr(0xBB67AE85)
#: Radix select of top-k: 8-bit digits of the order keys, counted with tl.histogram.
KEY_BINS = tl.constexpr(256)
#: Radix select of top-p: 4-bit digits, an exact int64 mass per bin, over chunks of MASS_BLOCK.
MASS_BINS = tl.constexpr(16)
MASS_BLOCK = tl.constexpr(256)
#: Bins of the candidate list: bin b holds 0.1 * b <= m - z < 0.1 * (b + 1); the last bin holds the rest.
Z_BINS = tl.constexpr(256)
Z_BIN_SCALE = tl.constexpr(10.0)
INT32_MIN = tl.constexpr(-2147483648)
INT32_MAX = tl.constexpr(2147483647)


@triton.jit
def _philox(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on uint32 values (wrapping products, ``tl.umulhi`` for the high words): the four outputs."""
    for i in tl.static_range(10):
        if i > 0:
            k0 = k0 + PHILOX_W0
            k1 = k1 + PHILOX_W1
        hi0 = tl.umulhi(c0, PHILOX_M0)
        hi1 = tl.umulhi(c2, PHILOX_M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, c2 * PHILOX_M1, hi0 ^ c3 ^ k1, c0 * PHILOX_M0
    return c0, c1, c2, c3


@triton.jit
def _gumbel(r):
    """fp32 ``-log(-log(u))``, ``u = (fp64(r >> 8) + 0.5) * 2**-24``, of uint32 Philox outputs (in fp64)."""
    u = ((r >> 8).to(tl.float64) + 0.5) * 5.9604644775390625e-08
    return (-tl.log(-tl.log(u))).to(tl.float32)


@triton.jit
def _key(z):
    """int32 order keys of fp32 values: the bits, negative ones with the 31 low bits flipped."""
    bits = z.to(tl.int32, bitcast=True)
    return tl.where(bits >= 0, bits, bits ^ INT32_MAX)


@triton.jit
def _ukey(key):
    """The order keys as uint32 (``key + 2**31``): the same order, unsigned digits."""
    return (key ^ INT32_MIN).to(tl.uint32, bitcast=True)


@triton.jit
def _x(ptr, offs, n):
    """The logits at ``offs`` in fp32, NaN read as ``-inf`` (``-inf`` from ``n`` on)."""
    x = tl.load(ptr + offs, mask=offs < n, other=float("-inf")).to(tl.float32)
    return tl.where(x != x, float("-inf"), x)


@triton.jit
def _scale(x, mx, inv_t):
    """The scaled logits ``(x - mx) * inv_t`` of fp32 logits without NaN (0 where ``x == mx``, also infinite), in
    ``[-inf, 0]``: two fp32 roundings, never fused (``enable_fp_fusion=False``)."""
    return tl.where(x == mx, 0.0, x - mx) * inv_t


@triton.jit
def _z(ptr, offs, n, mx, inv_t):
    """The scaled logits at ``offs`` (``-inf`` from ``n`` on)."""
    return tl.where(offs < n, _scale(_x(ptr, offs, n), mx, inv_t), float("-inf"))


@triton.jit
def _e(z):
    """``fp32(exp(fp64(z)))`` (``z - max z`` with ``max z = 0``)."""
    return tl.exp(z.to(tl.float64)).to(tl.float32)


@triton.jit
def _mass(e):
    """The exact int64 top-p masses ``floor(fp64(e) * 2**36)``."""
    return (e.to(tl.float64) * MASS_SCALE).to(tl.int64)


@triton.jit
def _z_bin(z):
    """The candidate-list bin of ``z``: ``min(floor(-z * 10), 255)``, monotone in ``z``."""
    return tl.minimum(-z * Z_BIN_SCALE, Z_BINS - 1.0).to(tl.int32)


@triton.jit
def _count_digit(hist, need):
    """The digit holding the ``need``-th largest of the counted keys (``hist``: counts by digit, ascending) and the
    rank of that key among the keys with that digit."""
    bins = tl.arange(0, KEY_BINS)
    above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0)  # keys with a larger digit
    digit = tl.max(tl.where(above + hist >= need, bins, 0), axis=0)
    return digit, need - tl.sum(tl.where(bins == digit, above, 0), axis=0)


@triton.jit
def _top_k_threshold(row_ptr, V, mx, inv_t, hist, top_k, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """``tau_k``, the ``top_k``-th largest key of ``z`` (with multiplicity): the key of ``z`` of the ``top_k``-th
    largest logit (``z`` is non-decreasing in ``x``), found by radix select over the keys of ``x``: ``hist`` counts
    their top byte; each further pass counts the next byte of the keys whose higher bytes match those found."""
    base = tl.arange(0, BLOCK)
    digit, need = _count_digit(hist, top_k)
    prefix = digit.to(tl.uint32)
    for shift in tl.static_range(16, -1, -8):
        hist = tl.zeros([KEY_BINS], tl.int32)
        for start in tl.range(0, V, BLOCK, num_stages=STAGES):
            offs = start + base
            u = _ukey(_key(_x(row_ptr, offs, V)))
            match = (offs < V) & ((u >> (shift + 8)) == prefix)
            hist += tl.histogram(((u >> shift) & 0xFF).to(tl.int32), KEY_BINS, mask=match)
        digit, need = _count_digit(hist, need)
        prefix = (prefix << 8) | digit.to(tl.uint32)
    key_x = (prefix ^ 0x80000000).to(tl.int32, bitcast=True)
    x_k = tl.where(key_x >= 0, key_x, key_x ^ INT32_MAX).to(tl.float32, bitcast=True)  # the inverse of _key
    return _key(_scale(x_k, mx, inv_t))


@triton.jit
def _list_last_bin(hist, target, cap, margin):
    """The last bin of the candidate list (``hist``: the survivors' counts by bin): the first bin where the mass of
    bins ``0..b``, bounded below by ``count * exp(-(b + 1) / 10)`` each, reaches ``margin * target``, or, if those
    bins hold more than ``cap`` survivors (or the bound never reaches it), the last bin that keeps the list within
    ``cap`` (-1: none). A heuristic: the caller checks the list's exact mass."""
    bins = tl.arange(0, Z_BINS)
    floor_e = tl.where(bins < Z_BINS - 1, tl.exp(-(bins + 1).to(tl.float32) / Z_BIN_SCALE), 0.0)
    lower = tl.cumsum(hist.to(tl.float32) * floor_e, axis=0) * MASS_SCALE
    reach = tl.min(tl.where(lower >= target.to(tl.float32) * margin, bins, Z_BINS - 1), axis=0)
    fit = tl.max(tl.where(tl.cumsum(hist, axis=0) <= cap, bins, -1), axis=0)
    return tl.minimum(reach, fit)


@triton.jit
def _copy_list(row_ptr, V, mx, inv_t, tau_k, last, list_ptr, cap, BLOCK: tl.constexpr, STAGES: tl.constexpr):
    """Copy the logits of the survivors in bins ``0..last`` to ``list_ptr``, in index order; their number."""
    base = tl.arange(0, BLOCK)
    n = tl.sum(base * 0, axis=0)
    for start in tl.range(0, V, BLOCK, num_stages=STAGES):
        offs = start + base
        x = tl.load(row_ptr + offs, mask=offs < V)
        xf = x.to(tl.float32)
        z = _scale(tl.where(xf != xf, float("-inf"), xf), mx, inv_t)
        sel = (offs < V) & (_key(z) >= tau_k) & (_z_bin(z) <= last)
        pos = n + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        tl.store(list_ptr + pos, x, mask=sel & (pos < cap))
        n += tl.sum(sel.to(tl.int32), axis=0)
    return n


@triton.jit
def _list_mass(list_ptr, n, mx, inv_t, BLOCK: tl.constexpr):
    """The exact mass of the ``n`` listed logits and the smallest key among those of positive mass."""
    base = tl.arange(0, BLOCK)
    total = tl.sum(base.to(tl.int64) * 0, axis=0)
    kmin = tl.sum(base * 0, axis=0) + INT32_MAX
    for start in range(0, n, BLOCK):
        offs = start + base
        z = _z(list_ptr, offs, n, mx, inv_t)
        q = tl.where(offs < n, _mass(_e(z)), 0)
        total += tl.sum(q, axis=0)
        kmin = tl.minimum(kmin, tl.min(tl.where(q > 0, _key(z), INT32_MAX), axis=0))
    return total, kmin


@triton.jit
def _top_p_threshold(src, n, mx, inv_t, tau_k, kmin, kmax, target):
    """``tau_p``: the largest key ``t`` with ``fp64(sum of the masses of keys >= t) >= target`` over the ``n`` logits
    at ``src`` kept by top-k (an upper set of the row's keys reaching the target), by radix select on 4-bit digits
    of ``key - kmin`` (``kmin``: their smallest key of positive mass; ``kmax``: their largest key)."""
    base = tl.arange(0, MASS_BLOCK)
    digits = tl.arange(0, MASS_BINS)
    ukmin = _ukey(kmin)
    width = _ukey(kmax) - ukmin
    n_digits = tl.sum(base * 0, axis=0)
    for i in tl.static_range(8):
        n_digits += ((width >> (4 * i)) != 0).to(tl.int32)
    prefix = ukmin * 0
    above = tl.sum(base.to(tl.int64) * 0, axis=0)  # the mass of the keys above the prefix's range
    for level in range(n_digits):
        shift = (4 * (n_digits - 1 - level)).to(tl.uint32)
        mass = tl.zeros([MASS_BINS], tl.int64)
        for start in range(0, n, MASS_BLOCK):
            offs = start + base
            z = _z(src, offs, n, mx, inv_t)
            key = _key(z)
            u = _ukey(key) - ukmin
            hit = (offs < n) & (key >= tau_k) & (key >= kmin) & (((u >> shift) >> 4) == prefix)
            if tl.max(hit.to(tl.int32), axis=0) > 0:
                q = tl.where(hit, _mass(_e(z)), 0)
                digit = ((u >> shift) & 0xF).to(tl.int32)
                mass += tl.sum(tl.where(digit[:, None] == digits[None, :], q[:, None], 0), axis=0)
        # the mass of the digits >= d, and > d
        at_least = above + tl.sum(tl.where(digits[None, :] >= digits[:, None], mass[None, :], 0), axis=1)
        digit = tl.max(tl.where(at_least.to(tl.float64) >= target, digits, 0), axis=0)
        above = tl.sum(tl.where(digits == digit, at_least - mass, 0), axis=0)
        prefix = (prefix << 4) | digit.to(tl.uint32)
    return ((prefix + ukmin) ^ 0x80000000).to(tl.int32, bitcast=True)


@triton.jit
def _sample_kernel(
    logits,
    seed_ptr,
    step_ptr,
    tokens,
    logprob,
    scratch,
    V,
    stride,
    inv_t,
    top_k,
    top_p,
    min_p,
    list_cap,
    list_margin,
    GREEDY: tl.constexpr,
    TOPK: tl.constexpr,
    TOPP: tl.constexpr,
    MINP: tl.constexpr,
    BLOCK: tl.constexpr,
    STAGES: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits + row * stride
    base = tl.arange(0, BLOCK)
    zero = tl.sum(base * 0, axis=0)
    # pass 1: the max logit and its first index v* (the greedy token; z = 0 there); with top-k the top bytes'
    # histogram of the logits' keys
    mx = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    arg = zero
    hist = tl.zeros([KEY_BINS], tl.int32)
    for start in tl.range(0, V, BLOCK, num_stages=STAGES):
        offs = start + base
        x = _x(row_ptr, offs, V)
        cm = tl.max(x, axis=0)
        ci = tl.min(tl.where(x == cm, offs, V + BLOCK), axis=0)
        better = cm > mx
        arg = tl.where(better, ci, arg)
        mx = tl.where(better, cm, mx)
        if TOPK:
            hist += tl.histogram((_ukey(_key(x)) >> 24).to(tl.int32), KEY_BINS, mask=offs < V)
    tau_k = zero + INT32_MIN
    if TOPK:
        tau_k = _top_k_threshold(row_ptr, V, mx, inv_t, hist, top_k, BLOCK, STAGES)
    # R (fp64: all but the first max) here when the Gumbel pass does not compute it; with top-p Q, the list's bins
    s = tl.sum(tl.zeros([BLOCK], tl.float64), axis=0)
    tau_p = zero + INT32_MIN
    if GREEDY or TOPP:
        total = tl.sum(base.to(tl.int64) * 0, axis=0)
        zhist = tl.zeros([Z_BINS], tl.int32)
        kmin = zero + INT32_MAX
        for start in tl.range(0, V, BLOCK, num_stages=STAGES):
            offs = start + base
            z = _z(row_ptr, offs, V, mx, inv_t)
            e = tl.where(offs < V, _e(z), 0.0)
            s += tl.sum(tl.where(offs == arg, 0.0, e.to(tl.float64)), axis=0)
            if TOPP:
                key = _key(z)
                q = _mass(e)
                cand = (offs < V) & (key >= tau_k)
                total += tl.sum(tl.where(cand, q, 0), axis=0)
                zhist += tl.histogram(_z_bin(z), Z_BINS, mask=cand)
                kmin = tl.minimum(kmin, tl.min(tl.where(cand & (q > 0), key, INT32_MAX), axis=0))
        if TOPP:
            target = total.to(tl.float64) * top_p  # top_p: fp32, promoted exactly
            list_ptr = scratch + row * list_cap
            last = _list_last_bin(zhist, target, list_cap, list_margin)
            on_list = last >= 0
            n = zero
            if on_list:
                # n <= cap by the counts; the check below guards the scratch row all the same
                n = _copy_list(row_ptr, V, mx, inv_t, tau_k, last, list_ptr, list_cap, BLOCK, STAGES)
                list_total, list_kmin = _list_mass(list_ptr, tl.minimum(n, list_cap), mx, inv_t, BLOCK)
                on_list = (n <= list_cap) & (list_total.to(tl.float64) >= target)
                kmin = tl.where(on_list, list_kmin, kmin)
            tau_p = _top_p_threshold(  # the largest key: that of max z = +0.0, 0
                tl.where(on_list, list_ptr, row_ptr), tl.where(on_list, n, V), mx, inv_t, tau_k, kmin, zero, target
            )
    if not GREEDY:
        seed = tl.load(seed_ptr + row)
        step = tl.load(step_ptr + row)
        k0 = seed.to(tl.uint32)
        k1 = (seed >> 32).to(tl.uint32)
        quad = tl.arange(0, BLOCK // 4)
        ctr_zero = quad.to(tl.uint32) * 0
        c2 = ctr_zero + step.to(tl.uint32)
        c3 = ctr_zero + (step >> 32).to(tl.uint32)
        best = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
        tok = zero
        tau = tl.maximum(tau_k, tau_p)
        for start in range(0, V, BLOCK):
            offs = start + base
            z = _z(row_ptr, offs, V, mx, inv_t)
            keep = (offs < V) & (_key(z) >= tau)
            if MINP or not TOPP:
                e = tl.where(offs < V, _e(z), 0.0)
                if not TOPP:
                    s += tl.sum(tl.where(offs == arg, 0.0, e.to(tl.float64)), axis=0)
                if MINP:
                    keep = keep & (e >= min_p)
            if tl.max(keep.to(tl.int32), axis=0) > 0:
                # one Philox block per counter c = v // 4, its lanes 0..3 interleaved: token 4 c + l gets lane l
                r0, r1, r2, r3 = _philox((start // 4 + quad).to(tl.uint32), ctr_zero, c2, c3, k0, k1)
                r = tl.reshape(tl.join(tl.join(r0, r2), tl.join(r1, r3)), [BLOCK])  # [c, i, j]: lane 2 i + j
                score = tl.where(keep, z + _gumbel(r), float("-inf"))
                cm = tl.max(score, axis=0)
                ci = tl.min(tl.where(score == cm, offs, V + BLOCK), axis=0)
                better = cm > best
                tok = tl.where(better, ci, tok)
                best = tl.where(better, cm, best)
        arg = tok
    z_tok = _scale(_x(row_ptr + arg, zero, 1), mx, inv_t)
    lp = z_tok.to(tl.float64) - tl.log(1.0 + s)
    tl.store(tokens + row, arg.to(tl.int64))
    tl.store(logprob + row, lp.to(tl.float32))


def sample_fwd(logits, seed, step, inv_temperature, top_k, top_p, min_p, greedy, tokens_out, logprob_out) -> None:
    """Fill ``tokens_out`` (int64 [B]) and ``logprob_out`` (fp32 [B]) (module docstring)."""
    B, V = logits.shape
    inv_t = 1.0 if greedy else float(torch.tensor(inv_temperature, dtype=torch.float32))
    p32 = float(torch.tensor(top_p, dtype=torch.float32))
    topp = (not greedy) and top_p < 1.0
    # the top-p candidate lists, in the logits' dtype (unused without top-p)
    cap = min(V, LIST_CAP)
    scratch = torch.empty((B, cap) if topp else (1,), dtype=logits.dtype, device=logits.device)
    with on_device(logits.device):
        _sample_kernel[(B,)](
            logits,
            seed,
            step,
            tokens_out,
            logprob_out,
            scratch,
            V,
            logits.stride(0),
            inv_t,
            top_k,
            p32,
            float(torch.tensor(min_p, dtype=torch.float32)),
            cap,
            LIST_MARGIN,
            GREEDY=bool(greedy),
            TOPK=(not greedy) and 0 < top_k < V,
            TOPP=topp,
            MINP=(not greedy) and min_p > 0.0,
            BLOCK=BLOCK,
            STAGES=LOAD_STAGES,
            num_warps=NUM_WARPS,
            enable_fp_fusion=False,
        )
