"""Reference distillation primitives (``fused_linear_kl``): the readable specification and ground truth.

Per row, the student's and the teacher's scaled logits ``zq = (h_s @ W_s.T) * inv_t`` and
``zp = (h_t @ W_t.T) * inv_t`` give ``q = softmax(zq)`` (student) and ``p = softmax(zp)`` (teacher)::

    forward_kl   KL(p || q) = sum_v p_v (log p_v - log q_v)
    reverse_kl   KL(q || p) = sum_v q_v (log q_v - log p_v)
    jsd          beta KL(p || m) + (1 - beta) KL(q || m),   m = beta p + (1 - beta) q,   0 < beta < 1

Pass 1 walks the vocab in tiles with an online state per distribution: running max ``m`` and
``s = sum exp(z - m)`` (``lse = m + log s``). The KLs need one more sum, kept relative to both maxes:
with ``a`` the distribution that weights the sum (p for forward, q for reverse) and ``c`` the other one,
``b = sum_v exp(za_v - m_a) ((za_v - m_a) - (zc_v - m_c))``, moved like the entropy sum of
:mod:`rlk.reference.logprob` when a max grows: ``b' = (b + ((m_a - m_a') - (m_c - m_c')) s_a) exp(m_a - m_a')``.
Then ``KL(a || c) = b / s_a - log s_a + log s_c``: the logits' common offsets cancel before any rounding.
The JSD needs both ``lse`` first: pass 2 sums ``p (log p - log m)`` and ``q (log q - log m)`` with
``log m = logaddexp(log beta + log p, log(1 - beta) + log q)`` (finite where p or q underflows).

Gradients with respect to the student's scaled logits (times ``inv_t`` for the logits ``x``)::

    forward_kl   q_v - p_v
    reverse_kl   q_v ((log q_v - log p_v) - KL(q || p))
    jsd          (1 - beta) q_v ((log q_v - log m_v) - KL(q || m))

``grad_hidden = G @ W_s`` and ``grad_weight = G.T @ h_s`` with ``G`` the per-row gradient coefficient times
the above. A term whose weight ``exp(.)`` is 0 counts as 0 (no ``0 * inf``). Ignored rows give loss 0 and no
gradient. Work is chunked over rows and vocab: memory beyond inputs and outputs is a few
``[ROW_CHUNK, VOCAB_CHUNK]`` tiles, per-row state and the fp32 gradient accumulators. Math in fp32 (fp64 for
fp64 inputs: the contract's ground truth). Deterministic; batch invariance is not promised here.
"""

from __future__ import annotations

import math

import torch

from rlk.core.checks import compute_dtype

ROW_CHUNK = 256
VOCAB_CHUNK = 8192


class _Tiles:
    """Scaled logit tiles of the student and the teacher, in the compute dtype."""

    def __init__(self, student_hidden, student_weight, teacher_hidden, teacher_weight, inv_temperature):
        self.cdt = compute_dtype(student_hidden.dtype)
        self.hs, self.ws, self.ht, self.wt = student_hidden, student_weight, teacher_hidden, teacher_weight
        self.inv_t = inv_temperature.to(self.cdt)

    def __call__(self, r0: int, r1: int, v0: int, v1: int) -> tuple[torch.Tensor, torch.Tensor]:
        inv_t = self.inv_t[r0:r1, None]
        zq = (self.hs[r0:r1].to(self.cdt) @ self.ws[v0:v1].to(self.cdt).T) * inv_t
        zp = (self.ht[r0:r1].to(self.cdt) @ self.wt[v0:v1].to(self.cdt).T) * inv_t
        return zq, zp


def _valid(targets: torch.Tensor | None, ignore_index: int, r0: int, r1: int, device) -> torch.Tensor:
    if targets is None:
        return torch.ones(r1 - r0, dtype=torch.bool, device=device)
    return targets[r0:r1] != ignore_index


def _shift(m: torch.Tensor) -> torch.Tensor:
    """The max a state is moved to: 0 while a row has seen only -inf, so no exp sees (-inf) - (-inf)."""
    return torch.where(m == -torch.inf, 0.0, m)


# ---------------------------------------------------------------------------
# pass 1: (m, s) of both distributions and the KL sum b
# ---------------------------------------------------------------------------


def _pass1(tiles: _Tiles, r0: int, r1: int, vocab: int, divergence: str) -> tuple[torch.Tensor, ...]:
    """``(m_q, s_q, m_p, s_p, b)`` of rows ``[r0, r1)``; ``b`` is weighted by p (forward_kl), q (reverse_kl),
    or 0 (jsd)."""
    m_q = m_p = s_q = s_p = b = None
    for v0 in range(0, vocab, VOCAB_CHUNK):
        zq, zp = tiles(r0, r1, v0, min(vocab, v0 + VOCAB_CHUNK))
        if m_q is None:
            m_q = m_p = torch.full_like(zq[:, 0], -torch.inf)
            s_q = s_p = b = torch.zeros_like(zq[:, 0])
        new_q, new_p = torch.maximum(m_q, zq.amax(1)), torch.maximum(m_p, zp.amax(1))
        shift_q, shift_p = _shift(new_q), _shift(new_p)
        r_q, r_p = torch.exp(m_q - shift_q), torch.exp(m_p - shift_p)
        dq, dp = zq - shift_q[:, None], zp - shift_p[:, None]  # <= 0
        eq, ep = torch.exp(dq), torch.exp(dp)
        if divergence != "jsd":
            # a = the weighting distribution, c = the other one
            (m_a, s_a, r_a, e_a, d_a, shift_a), (m_c, d_c, shift_c) = (
                ((m_p, s_p, r_p, ep, dp, shift_p), (m_q, dq, shift_q))
                if divergence == "forward_kl"
                else ((m_q, s_q, r_q, eq, dq, shift_q), (m_p, dp, shift_p))
            )
            # b so far is relative to the old shifts; move it to the new ones
            moved = (b + ((_shift(m_a) - shift_a) - (_shift(m_c) - shift_c)) * s_a) * r_a
            b = torch.where(r_a > 0, moved, 0.0) + torch.where(e_a > 0, e_a * (d_a - d_c), 0.0).sum(1)
        s_q, s_p = s_q * r_q + eq.sum(1), s_p * r_p + ep.sum(1)
        m_q, m_p = new_q, new_p
    return m_q, s_q, m_p, s_p, b


# ---------------------------------------------------------------------------
# pass 2 (jsd): KL(p || m) and KL(q || m)
# ---------------------------------------------------------------------------


def _log_mixture(log_p: torch.Tensor, log_q: torch.Tensor, beta: float) -> torch.Tensor:
    """``log(beta p + (1 - beta) q)`` from ``log p`` and ``log q``."""
    return torch.logaddexp(log_p + math.log(beta), log_q + math.log1p(-beta))


def _jsd_sums(tiles: _Tiles, r0: int, r1: int, vocab: int, lse_q, lse_p, beta: float):
    """``(KL(p || m), KL(q || m))`` of rows ``[r0, r1)``."""
    kl_pm = kl_qm = 0.0
    for v0 in range(0, vocab, VOCAB_CHUNK):
        zq, zp = tiles(r0, r1, v0, min(vocab, v0 + VOCAB_CHUNK))
        log_q, log_p = zq - lse_q[:, None], zp - lse_p[:, None]
        log_m = _log_mixture(log_p, log_q, beta)
        p, q = torch.exp(log_p), torch.exp(log_q)
        kl_pm = kl_pm + torch.where(p > 0, p * (log_p - log_m), 0.0).sum(1)
        kl_qm = kl_qm + torch.where(q > 0, q * (log_q - log_m), 0.0).sum(1)
    return kl_pm, kl_qm


# ---------------------------------------------------------------------------
# the gradient tile
# ---------------------------------------------------------------------------


def _grad_z(zq, zp, lse_q, lse_p, aux, divergence: str, beta: float) -> torch.Tensor:
    """``d loss / d zq`` of one tile (per-row ``lse_q``, ``lse_p``, ``aux`` as ``[R]``)."""
    log_q, log_p = zq - lse_q[:, None], zp - lse_p[:, None]
    q = torch.exp(log_q)
    if divergence == "forward_kl":
        return q - torch.exp(log_p)
    if divergence == "reverse_kl":
        return torch.where(q > 0, q * ((log_q - log_p) - aux[:, None]), 0.0)
    log_m = _log_mixture(log_p, log_q, beta)
    return (1.0 - beta) * torch.where(q > 0, q * ((log_q - log_m) - aux[:, None]), 0.0)


def _gradients(
    tiles: _Tiles, targets, ignore_index, stats, coef, divergence, beta, grad_hidden_out, grad_weight_out
) -> None:
    """``grad_hidden_out`` / ``grad_weight_out`` (either may be None) of ``sum_i coef_i loss_i``; vocab chunks
    outer (``grad_hidden`` sums them in order in an fp32 accumulator), row chunks inner (``grad_weight``'s
    chunk sums them in order)."""
    hs, ws = tiles.hs, tiles.ws
    n_rows, vocab = hs.shape[0], ws.shape[0]
    cdt = tiles.cdt
    acc = torch.zeros(hs.shape, dtype=cdt, device=hs.device) if grad_hidden_out is not None else None
    stats, coef = stats.to(cdt), coef.to(cdt)
    for v0 in range(0, vocab, VOCAB_CHUNK):
        v1 = min(vocab, v0 + VOCAB_CHUNK)
        w = ws[v0:v1].to(cdt)
        gw = torch.zeros(w.shape, dtype=cdt, device=w.device) if grad_weight_out is not None else None
        for r0 in range(0, n_rows, ROW_CHUNK):
            r1 = min(n_rows, r0 + ROW_CHUNK)
            zq, zp = tiles(r0, r1, v0, v1)
            g = _grad_z(zq, zp, stats[0, r0:r1], stats[1, r0:r1], stats[2, r0:r1], divergence, beta)
            g = g * (coef[r0:r1] * tiles.inv_t[r0:r1])[:, None]
            g = torch.where(_valid(targets, ignore_index, r0, r1, hs.device)[:, None], g, 0.0)
            if acc is not None:
                acc[r0:r1] += g @ w
            if gw is not None:
                gw += g.T @ hs[r0:r1].to(cdt)
        if gw is not None:
            grad_weight_out[v0:v1] = gw
    if acc is not None:
        grad_hidden_out.copy_(acc)


# ---------------------------------------------------------------------------
# primitives
# ---------------------------------------------------------------------------


def fused_linear_kl_fwd(
    student_hidden,
    student_weight,
    teacher_hidden,
    teacher_weight,
    targets,
    inv_temperature,
    ignore_index,
    divergence,
    beta,
    loss_out,
    stats_out,
    grad_coef,
    grad_hidden_out,
    grad_weight_out,
):
    tiles = _Tiles(student_hidden, student_weight, teacher_hidden, teacher_weight, inv_temperature)
    n_rows, vocab = student_hidden.shape[0], student_weight.shape[0]
    for r0 in range(0, n_rows, ROW_CHUNK):
        r1 = min(n_rows, r0 + ROW_CHUNK)
        m_q, s_q, m_p, s_p, b = _pass1(tiles, r0, r1, vocab, divergence)
        lse_q, lse_p = m_q + torch.log(s_q), m_p + torch.log(s_p)
        if divergence == "forward_kl":
            loss, aux = b / s_p - torch.log(s_p) + torch.log(s_q), torch.zeros_like(b)
        elif divergence == "reverse_kl":
            loss = b / s_q - torch.log(s_q) + torch.log(s_p)
            aux = loss
        else:
            kl_pm, aux = _jsd_sums(tiles, r0, r1, vocab, lse_q, lse_p, beta)
            loss = beta * kl_pm + (1.0 - beta) * aux
        valid = _valid(targets, ignore_index, r0, r1, student_hidden.device)
        loss_out[r0:r1] = torch.where(valid, loss, 0.0)
        stats_out[0, r0:r1], stats_out[1, r0:r1] = lse_q, lse_p
        stats_out[2, r0:r1] = torch.where(valid, aux, 0.0)
    if grad_coef is not None and (grad_hidden_out is not None or grad_weight_out is not None):
        _gradients(
            tiles, targets, ignore_index, stats_out, grad_coef, divergence, beta, grad_hidden_out, grad_weight_out
        )


def fused_linear_kl_bwd(
    student_hidden,
    student_weight,
    teacher_hidden,
    teacher_weight,
    targets,
    inv_temperature,
    stats,
    grad_loss,
    ignore_index,
    divergence,
    beta,
    grad_hidden_out,
    grad_weight_out,
):
    if grad_hidden_out is None and grad_weight_out is None:
        return
    tiles = _Tiles(student_hidden, student_weight, teacher_hidden, teacher_weight, inv_temperature)
    _gradients(tiles, targets, ignore_index, stats, grad_loss, divergence, beta, grad_hidden_out, grad_weight_out)
