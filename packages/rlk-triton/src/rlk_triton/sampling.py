"""Triton kernel of ``rlk.sample``: batch-invariant fused sampling (spec: :mod:`rlk.reference.sampling`).

One program per row; the row is read in chunks of ``BLOCK`` logits in index order, in several passes: the max; the
top-k threshold (a 32-step bisection over the int32 order keys of the scaled logits, each step one counting pass);
the fp64 sum of ``e = fp32(exp(z - m))`` and the total of the int64 fixed-point masses; the top-p threshold (a
32-step bisection on the exact integer masses); then the Gumbel-max pass (Philox4x32-10 per element, computed in
int64 pieces exactly like the reference) with a running argmax that keeps the lowest index on ties. Nothing
depends on the batch, the grid or the row's position: no atomics, a fixed chunk order, no sort. The top-k / top-p
passes are compiled in only when the filter is on.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlk_triton.common import on_device

BLOCK = 1024
NUM_WARPS = 8
#: 2**36, as rlk.reference.sampling.MASS_SCALE (a constexpr: the kernel reads it).
MASS_SCALE = tl.constexpr(68719476736.0)


@triton.jit
def _mulhilo(a, M: tl.constexpr):
    p_l = a * (M & 0xFFFF)
    p_h = a * (M >> 16)
    t = ((p_h & 0xFFFF) << 16) + p_l
    return (p_h >> 16) + (t >> 32), t & 0xFFFFFFFF


@triton.jit
def _philox_lane(c0, c1, c2, c3, k0, k1, lane):
    """Output ``lane`` (0..3) of Philox4x32-10 on int64 values holding uint32s."""
    for i in tl.static_range(10):
        if i > 0:
            k0 = (k0 + 0x9E3779B9) & 0xFFFFFFFF
            k1 = (k1 + 0xBB67AE85) & 0xFFFFFFFF
        hi0, lo0 = _mulhilo(c0, 0xD2511F53)
        hi1, lo1 = _mulhilo(c2, 0xCD9E8D57)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return tl.where(lane == 0, c0, tl.where(lane == 1, c1, tl.where(lane == 2, c2, c3)))


@triton.jit
def _key(z):
    bits = z.to(tl.int32, bitcast=True).to(tl.int64)
    return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


@triton.jit
def _z(row_ptr, offs, V, inv_t):
    x = tl.load(row_ptr + offs, mask=offs < V, other=float("-inf")).to(tl.float32)
    return x * inv_t


@triton.jit
def _sample_kernel(logits, seed_ptr, step_ptr, tokens, logprob, V, stride, inv_t, top_k, top_p, min_p,
                   GREEDY: tl.constexpr, TOPK: tl.constexpr, TOPP: tl.constexpr, MINP: tl.constexpr,
                   BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits + row * stride
    base = tl.arange(0, BLOCK).to(tl.int64)
    # pass 1: max (and the greedy argmax, lowest index)
    m = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
    arg = tl.min(base, axis=0) * 0
    for start in range(0, V, BLOCK):
        offs = start + base
        z = _z(row_ptr, offs, V, inv_t)
        cm = tl.max(z, axis=0)
        ci = tl.min(tl.where(z == cm, offs, V + BLOCK), axis=0)
        better = cm > m
        arg = tl.where(better, ci, arg)
        m = tl.where(better, cm, m)
    m64 = m.to(tl.float64)
    # top-k threshold: the largest key t with count(key >= t) >= k
    tau_k = tl.min(base, axis=0) * 0 - 2147483648
    if TOPK:
        hi = tau_k * 0 + 2147483648
        for _ in range(32):
            mid = tau_k + (hi - tau_k) // 2
            count = tl.sum(base * 0, axis=0)
            for start in range(0, V, BLOCK):
                offs = start + base
                key = _key(_z(row_ptr, offs, V, inv_t))
                count += tl.sum(((key >= mid) & (offs < V)).to(tl.int64), axis=0)
            ok = count >= top_k
            tau_k = tl.where(ok, mid, tau_k)
            hi = tl.where(ok, hi, mid)
    # pass: S (fp64) and the integer mass total Q of the top-k survivors
    s = tl.sum(tl.zeros([BLOCK], tl.float64), axis=0)
    total = tl.sum(base * 0, axis=0)
    for start in range(0, V, BLOCK):
        offs = start + base
        z = _z(row_ptr, offs, V, inv_t)
        e = tl.exp(z.to(tl.float64) - m64).to(tl.float32)
        e = tl.where(offs < V, e, 0.0)
        s += tl.sum(tl.where(offs == arg, 0.0, e.to(tl.float64)), axis=0)  # R: all but the first max
        if TOPP:
            q = (e.to(tl.float64) * MASS_SCALE).to(tl.int64)
            total += tl.sum(tl.where(_key(z) >= tau_k, q, 0), axis=0)
    tau_p = tl.min(base, axis=0) * 0 - 2147483648
    if TOPP:
        target = total.to(tl.float64) * top_p  # top_p: fp32, promoted exactly
        hi = tau_p * 0 + 2147483648
        for _ in range(32):
            mid = tau_p + (hi - tau_p) // 2
            mass = tl.sum(base * 0, axis=0)
            for start in range(0, V, BLOCK):
                offs = start + base
                z = _z(row_ptr, offs, V, inv_t)
                e = tl.exp(z.to(tl.float64) - m64).to(tl.float32)
                q = (e.to(tl.float64) * MASS_SCALE).to(tl.int64)
                key = _key(z)
                mass += tl.sum(tl.where((key >= mid) & (key >= tau_k) & (offs < V), q, 0), axis=0)
            ok = mass.to(tl.float64) >= target
            tau_p = tl.where(ok, mid, tau_p)
            hi = tl.where(ok, hi, mid)
    if not GREEDY:
        seed = tl.load(seed_ptr + row)
        step = tl.load(step_ptr + row)
        k0 = seed & 0xFFFFFFFF
        k1 = (seed >> 32) & 0xFFFFFFFF
        c2 = step & 0xFFFFFFFF
        c3 = (step >> 32) & 0xFFFFFFFF
        best = tl.max(tl.full([BLOCK], float("-inf"), tl.float32), axis=0)
        arg = tl.min(base, axis=0) * 0
        tau = tl.maximum(tau_k, tau_p)
        for start in range(0, V, BLOCK):
            offs = start + base
            z = _z(row_ptr, offs, V, inv_t)
            keep = (offs < V) & (_key(z) >= tau)
            if MINP:
                e = tl.exp(z.to(tl.float64) - m64).to(tl.float32)
                keep = keep & (e >= min_p)
            r = _philox_lane(offs // 4, offs * 0, c2 + offs * 0, c3 + offs * 0, k0 + offs * 0, k1 + offs * 0,
                             offs % 4)
            u = ((r >> 8).to(tl.float64) + 0.5) * 5.9604644775390625e-08
            g = (-tl.log(-tl.log(u))).to(tl.float32)
            score = tl.where(keep, z + g, float("-inf"))
            cm = tl.max(score, axis=0)
            ci = tl.min(tl.where(score == cm, offs, V + BLOCK), axis=0)
            better = cm > best
            arg = tl.where(better, ci, arg)
            best = tl.where(better, cm, best)
    z_tok = tl.load(row_ptr + arg).to(tl.float32) * inv_t
    lp = (z_tok.to(tl.float64) - m64) - tl.log(1.0 + s)
    tl.store(tokens + row, arg)
    tl.store(logprob + row, lp.to(tl.float32))


def sample_fwd(logits, seed, step, inv_temperature, top_k, top_p, min_p, greedy, tokens_out, logprob_out) -> None:
    """Fill ``tokens_out`` (int64 [B]) and ``logprob_out`` (fp32 [B]) (module docstring)."""
    B, V = logits.shape
    inv_t = 1.0 if greedy else float(torch.tensor(inv_temperature, dtype=torch.float32))
    p32 = float(torch.tensor(top_p, dtype=torch.float32))
    with on_device(logits.device):
        _sample_kernel[(B,)](
            logits, seed, step, tokens_out, logprob_out, V, logits.stride(0), inv_t, top_k, p32,
            float(torch.tensor(min_p, dtype=torch.float32)),
            GREEDY=bool(greedy), TOPK=(not greedy) and 0 < top_k < V, TOPP=(not greedy) and top_p < 1.0,
            MINP=(not greedy) and min_p > 0.0, BLOCK=BLOCK, num_warps=NUM_WARPS,
        )
