"""Reference sampling primitive: the readable specification of ``rlk.sample``.

Per row ``b`` of ``logits [B, V]`` (any values: NaN and +-inf included; no host synchronization)::

    x[v]   = fp32(logits[v]), NaN -> -inf           # a NaN logit is never sampled (probability 0)
    mx     = max_v x[v]; v* = the first index of it
    s[v]   = 0 if x[v] == mx else x[v] - mx         # fp32 in [-inf, 0], never NaN (0 also where x = mx = +-inf)
    z[v]   = s[v] * inv_t                           # one fp32 multiply; inv_t = fp32(1 / T), 1 when greedy;
                                                    # in [-inf, 0], z[v*] = 0 = max z: nothing overflows
    e[v]   = fp32(exp(fp64(z[v])))                  # the unnormalized probability, computed in fp64, rounded once
    R      = sum_v fp64(e[v]) over v != v*         # fp64, any order
    logprob = fp32(fp64(z[tok]) - log(1 + R))       # log_softmax(z)[tok], PRE-filter, finite and <= 0
                                                    # (R's summation order changes it only far below fp32's ulp,
                                                    # also for near-certain tokens, where the logprob is tiny)

    So +inf logits share the row's mass equally (the others get none), a row of -inf / NaN logits only is uniform,
    and a tiny temperature (1 / T up to fp32's largest) leaves only the max logits (z = -inf elsewhere).

    key[v] = the order key of z[v]'s fp32 bits      # int32 bits, negative ones with the 31 low bits flipped:
                                                    # a total order (-0.0 sorts just below +0.0)
    top-k (0 < k < V):  tau_k = the k-th largest key (with multiplicity); keep key >= tau_k
                        (every token tied with the k-th value is kept: possibly more than k tokens)
    top-p (p < 1):      q[v] = floor(fp64(e[v]) * 2**36) as int64 for tokens kept by top-k, else 0 (exact integer
                        masses); Q = sum q; M(t) = sum of q[v] over key[v] >= t;
                        tau_p = the largest int t with fp64(M(t)) >= fp64(p32) * fp64(Q); keep key >= tau_p
                        (the smallest set of largest-probability tokens, after top-k, whose mass reaches p; ties at
                        the threshold kept)
    min-p (min_p > 0):  keep e[v] >= fp32(min_p)    # prob >= min_p * max prob (fp32 compare)

    r[v]   = Philox4x32-10(key = (seed lo32, seed hi32), counter = (v // 4, 0, step lo32, step hi32))[v % 4]
    u[v]   = (fp64(r[v] >> 8) + 0.5) * 2**-24       # in (0, 1), exact
    g[v]   = fp32(-log(-log(u[v])))                 # Gumbel(0, 1), computed in fp64, rounded once
    tok    = argmax over kept v of fp32(z[v] + g[v]), ties to the lowest index (v* is always kept: its score is
             finite, so a token of z = -inf is never drawn)
    greedy (T == 0): tok = v* (the first max logit), filters ignored, logprob under T = 1

``z`` is a non-decreasing function of ``x``, so the k-th largest ``z`` is the ``z`` of the k-th largest ``x`` (the
Triton kernel selects on ``x`` before it knows ``mx``). Every threshold is an exact integer comparison, so the
Triton kernel finds them by 32-step bisections over the key range instead of a sort; this reference sorts. The two
backends agree bitwise on the token and the logprob as long as their fp64 ``exp`` / ``log`` round to the same fp32
values (they can differ only when an fp64 result lies within an fp64 ulp of an fp32 rounding boundary).
"""

from __future__ import annotations

import torch

M0, M1 = 0xD2511F53, 0xCD9E8D57
W0, W1 = 0x9E3779B9, 0xBB67AE85
MASK32 = 0xFFFFFFFF
#: Fixed-point scale of the top-p masses (V < 2**26 keeps the int64 sums exact).
MASS_SCALE = 2.0**36
MAX_VOCAB = 2**26


def _mulhilo(a: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(hi32, lo32) of ``a * m`` for 32-bit ``a`` (int64 holding a uint32) and a 32-bit constant, in int64 pieces
    that never overflow."""
    p_l = a * (m & 0xFFFF)
    p_h = a * (m >> 16)
    t = ((p_h & 0xFFFF) << 16) + p_l
    return (p_h >> 16) + (t >> 32), t & MASK32


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 on int64 tensors holding uint32 values (broadcast); returns the four 32-bit outputs."""
    for i in range(10):
        if i:
            k0 = (k0 + W0) & MASK32
            k1 = (k1 + W1) & MASK32
        hi0, lo0 = _mulhilo(c0, M0)
        hi1, lo1 = _mulhilo(c2, M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    return c0, c1, c2, c3


def gumbel(seed: torch.Tensor, step: torch.Tensor, vocab: int) -> torch.Tensor:
    """fp32 ``[B, V]`` Gumbel noise of each row's ``(seed, step)`` (module docstring)."""
    device = seed.device
    blocks = (vocab + 3) // 4
    c0 = torch.arange(blocks, dtype=torch.int64, device=device)[None, :]
    zero = torch.zeros_like(c0)
    s = step.to(torch.int64)[:, None]
    k = seed.to(torch.int64)[:, None]
    out = philox4x32_10(c0, zero, s & MASK32, (s >> 32) & MASK32, k & MASK32, (k >> 32) & MASK32)
    r = torch.stack(torch.broadcast_tensors(*out), dim=-1).reshape(seed.shape[0], blocks * 4)[:, :vocab]
    u = ((r >> 8).to(torch.float64) + 0.5) * 2.0**-24
    return (-torch.log(-torch.log(u))).to(torch.float32)


def order_key(z: torch.Tensor) -> torch.Tensor:
    """int64 keys of fp32 values, monotone in the value (-0.0 just below +0.0)."""
    bits = z.contiguous().view(torch.int32).to(torch.int64)
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def scaled_logits(logits: torch.Tensor, inv_temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x, z)``, fp32 ``[B, V]``: the logits with NaN as -inf, and the scaled logits ``(x - max x) * inv_t`` in
    ``[-inf, 0]`` (module docstring: 0 where ``x`` is the row's max, also an infinite one)."""
    x = logits.to(torch.float32)
    x = torch.where(torch.isnan(x), float("-inf"), x)
    mx = x.max(dim=-1, keepdim=True).values
    shifted = torch.where(x == mx, 0.0, x - mx)  # x - mx is NaN only where x == mx = +-inf
    return x, shifted * torch.tensor(inv_temperature, dtype=torch.float32, device=x.device)


def sample_fwd(logits, seed, step, inv_temperature, top_k, top_p, min_p, greedy, tokens_out, logprob_out) -> None:
    """Fill ``tokens_out`` (int64 [B]) and ``logprob_out`` (fp32 [B]) (module docstring)."""
    x, z = scaled_logits(logits, 1.0 if greedy else inv_temperature)
    first = torch.argmax(x, dim=-1, keepdim=True)  # v*, the first max: z = 0 and e = 1 there, left out of R
    e = torch.exp(z.double()).to(torch.float32)
    lse = torch.log(1.0 + e.double().scatter(-1, first, 0.0).sum(dim=-1))
    vocab = z.shape[-1]
    if greedy:
        tok = first[:, 0]
    else:
        keep = torch.ones_like(z, dtype=torch.bool)
        key = order_key(z)
        if 0 < top_k < vocab:
            tau_k = torch.sort(key, dim=-1, descending=True).values[:, top_k - 1 : top_k]
            keep &= key >= tau_k
        if top_p < 1.0:
            q = torch.where(keep, (e.double() * MASS_SCALE).to(torch.int64), 0)
            total = q.sum(dim=-1, keepdim=True)
            p = float(torch.tensor(top_p, dtype=torch.float32))
            sorted_key, order = torch.sort(key, dim=-1, descending=True, stable=True)
            cum = torch.cumsum(torch.gather(q, -1, order), dim=-1)
            cut = torch.argmax((cum.double() >= p * total.double()).to(torch.int8), dim=-1, keepdim=True)
            keep &= key >= torch.gather(sorted_key, -1, cut)
        if min_p > 0.0:
            keep &= e >= torch.tensor(min_p, dtype=torch.float32).to(e.device)
        score = torch.where(keep, z + gumbel(seed, step, vocab).to(z.device), float("-inf"))
        tok = torch.argmax(score, dim=-1)
    z_tok = torch.gather(z, -1, tok[:, None])[:, 0]
    tokens_out.copy_(tok)
    logprob_out.copy_((z_tok.double() - lse).to(torch.float32))
