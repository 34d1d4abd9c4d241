"""Reference attention primitives: the readable specification and ground truth.

Packed variable-length ("varlen") attention. Sequence ``b`` owns query rows
``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` (``Lq`` of them) and key/value rows
``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` (``Lk``). Query head ``h`` of ``Hq`` reads
key/value head ``h // (Hq // Hkv)`` (grouped-query attention). For query ``i`` and
key ``j`` of one sequence (0-based within it)::

    s_ij   = softmax_scale * (q_i . k_j)
    visible(i, j) = j <= i + (Lk - Lq)       if causal (bottom-right aligned), else always
    lse_i  = log sum_{j visible} exp(s_ij)   (natural log; -inf when no key is visible)
    p_ij   = exp(s_ij - lse_i)               (0 where not visible)
    out_i  = sum_j p_ij v_j

A query that sees no key (``i < Lq - Lk`` under causal, or ``Lk = 0``) gets
``out = 0`` and ``lse = -inf``, and every gradient through it is 0.

Backward, with ``dO`` the gradient of ``out`` and ``g_i`` the gradient of ``lse_i``
(``d lse_i / d s_ij = p_ij``)::

    delta_i = sum_d dO_id * out_id - g_i
    dv_j    = sum_i p_ij dO_i
    dS_ij   = p_ij * (dO_i . v_j - delta_i)
    dq_i    = softmax_scale * sum_j dS_ij k_j
    dk_j    = softmax_scale * sum_i dS_ij q_i

summed over the query heads of a key/value head's group for ``dk`` and ``dv``.

Math runs in fp32 (fp64 for fp64 inputs, which is how the contract builds ground
truth), one sequence at a time and ``Q_CHUNK`` query rows at a time, so memory
beyond inputs and outputs is ``Hq * Q_CHUNK * Lk`` scores. The reference is
deterministic; it does not promise batch invariance.
"""

from __future__ import annotations

import torch

from rlk.core.checks import compute_dtype

Q_CHUNK = 1024


def _sequences(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor):
    """(q_start, q_end, k_start, k_end) of every sequence, as Python ints."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    return [(cq[b], cq[b + 1], ck[b], ck[b + 1]) for b in range(len(cq) - 1)]


def _visible(rows: torch.Tensor, n_q: int, n_k: int, causal: bool) -> torch.Tensor:
    """``[len(rows), n_k]`` bool: key j is visible to query row i (rows are 0-based within the sequence)."""
    cols = torch.arange(n_k, device=rows.device)
    if not causal:
        return torch.ones(len(rows), n_k, dtype=torch.bool, device=rows.device)
    return cols[None, :] <= rows[:, None] + (n_k - n_q)


def _probabilities(q, k, lse, rows, n_q, causal, scale):
    """``p [Hq, rows, Lk]`` from the saved ``lse [Hq, rows]`` (0 where not visible or no key at all)."""
    s = torch.einsum("ihd,jhd->hij", q, k) * scale
    visible = _visible(rows, n_q, k.shape[0], causal)[None]
    finite = torch.isfinite(lse)[:, :, None]
    p = torch.exp(s - torch.where(finite, lse[:, :, None], 0.0))
    return torch.where(visible & finite, p, 0.0)


def attention_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
                  out, lse_out):
    """Varlen attention forward: ``out [Tq, Hq, D]`` and ``lse_out [Hq, Tq]`` (see the module docstring).

    ``max_seqlen_*`` are not needed here (the reference reads the lengths from ``cu_seqlens``).
    """
    cdt = compute_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    for q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        n_q, n_k = q1 - q0, k1 - k0
        kb = k[k0:k1].to(cdt).repeat_interleave(group, dim=1)  # [Lk, Hq, D]
        vb = v[k0:k1].to(cdt).repeat_interleave(group, dim=1)
        for r0 in range(0, n_q, Q_CHUNK):
            r1 = min(n_q, r0 + Q_CHUNK)
            qb = q[q0 + r0:q0 + r1].to(cdt)
            rows = torch.arange(r0, r1, device=q.device)
            s = torch.einsum("ihd,jhd->hij", qb, kb) * softmax_scale  # [Hq, rows, Lk]
            s = torch.where(_visible(rows, n_q, n_k, causal)[None], s, -torch.inf)
            lse = torch.logsumexp(s, dim=-1)  # -inf for rows that see no key
            p = _probabilities(qb, kb, lse, rows, n_q, causal, softmax_scale)
            out[q0 + r0:q0 + r1] = torch.einsum("hij,jhd->ihd", p, vb).to(out.dtype)
            lse_out[:, q0 + r0:q0 + r1] = lse.to(lse_out.dtype)


def attention_bwd(grad_out, q, k, v, out, lse, grad_lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                  causal, softmax_scale, grad_q_out, grad_k_out, grad_v_out):
    """Gradients of ``q``, ``k``, ``v`` from ``grad_out`` and (optionally) ``grad_lse`` (module docstring)."""
    cdt = compute_dtype(q.dtype)
    n_kv_heads = k.shape[1]
    group = q.shape[1] // n_kv_heads
    for q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        n_q, n_k = q1 - q0, k1 - k0
        kb = k[k0:k1].to(cdt).repeat_interleave(group, dim=1)
        vb = v[k0:k1].to(cdt).repeat_interleave(group, dim=1)
        dk = torch.zeros(n_k, q.shape[1], q.shape[2], dtype=cdt, device=q.device)  # per query head
        dv = torch.zeros_like(dk)
        for r0 in range(0, n_q, Q_CHUNK):
            r1 = min(n_q, r0 + Q_CHUNK)
            t0, t1 = q0 + r0, q0 + r1
            qb, do, ob = q[t0:t1].to(cdt), grad_out[t0:t1].to(cdt), out[t0:t1].to(cdt)
            rows = torch.arange(r0, r1, device=q.device)
            lse_b = lse[:, t0:t1].to(cdt)
            p = _probabilities(qb, kb, lse_b, rows, n_q, causal, softmax_scale)  # [Hq, rows, Lk]
            delta = (do * ob).sum(-1).T  # [Hq, rows]
            if grad_lse is not None:
                delta = delta - grad_lse[:, t0:t1].to(cdt)
            dp = torch.einsum("ihd,jhd->hij", do, vb)
            ds = p * (dp - delta[:, :, None])
            dv += torch.einsum("hij,ihd->jhd", p, do)
            dk += torch.einsum("hij,ihd->jhd", ds, qb) * softmax_scale
            grad_q_out[t0:t1] = (torch.einsum("hij,jhd->ihd", ds, kb) * softmax_scale).to(grad_q_out.dtype)
        # sum the query heads of each key/value head's group
        head_dim = q.shape[2]
        grad_k_out[k0:k1] = dk.view(n_k, n_kv_heads, group, head_dim).sum(2).to(grad_k_out.dtype)
        grad_v_out[k0:k1] = dv.view(n_k, n_kv_heads, group, head_dim).sum(2).to(grad_v_out.dtype)
