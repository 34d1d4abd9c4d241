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

``prefix_attention`` (shared prompts, e.g. a GRPO group): sequence ``b`` with
``prefix_index[b] = a >= 0`` attends over the *logical* keys ``[keys of a; keys of b]``
(``P_b = Lk_a`` prefix keys, then its own ``Lk_b``), and ``Lk`` above is the logical
length ``P_b + Lk_b``: ``visible(i, j) = j <= i + (P_b + Lk_b - Lq_b)`` under causal.
``prefix_index[b] = -1`` is an ordinary sequence (``P_b = 0``). The gradient of a key
row of sequence ``a`` is the sum of its contributions through ``a``'s own queries and
through the queries of every sequence that references ``a``; the reference adds them in
that order (own queries first, then the referencing sequences in ascending index).
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


def _sequence_fwd(q, kb, vb, q0, q1, causal, softmax_scale, out, lse_out):
    """One sequence's forward: query rows ``q0:q1`` against its (logical) keys ``kb``, ``vb`` ``[Lk, Hq, D]``
    (compute dtype, already repeated over the query heads of each group)."""
    n_q, n_k = q1 - q0, kb.shape[0]
    for r0 in range(0, n_q, Q_CHUNK):
        r1 = min(n_q, r0 + Q_CHUNK)
        qb = q[q0 + r0 : q0 + r1].to(kb.dtype)
        rows = torch.arange(r0, r1, device=q.device)
        s = torch.einsum("ihd,jhd->hij", qb, kb) * softmax_scale  # [Hq, rows, Lk]
        s = torch.where(_visible(rows, n_q, n_k, causal)[None], s, -torch.inf)
        lse = torch.logsumexp(s, dim=-1)  # -inf for rows that see no key
        p = _probabilities(qb, kb, lse, rows, n_q, causal, softmax_scale)
        out[q0 + r0 : q0 + r1] = torch.einsum("hij,jhd->ihd", p, vb).to(out.dtype)
        lse_out[:, q0 + r0 : q0 + r1] = lse.to(lse_out.dtype)


def _sequence_bwd(grad_out, q, kb, vb, out, lse, grad_lse, q0, q1, causal, softmax_scale, grad_q_out):
    """One sequence's backward against its (logical) keys ``kb``, ``vb`` ``[Lk, Hq, D]``: writes ``grad_q_out``
    rows ``q0:q1`` and returns ``dk``, ``dv`` ``[Lk, Hq, D]`` per query head (compute dtype)."""
    cdt = kb.dtype
    n_q = q1 - q0
    dk = torch.zeros_like(kb)
    dv = torch.zeros_like(kb)
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
    return dk, dv


def _heads(x, cdt, group):
    """Key/value rows in the compute dtype, repeated over the query heads of each group: ``[L, Hq, D]``."""
    return x.to(cdt).repeat_interleave(group, dim=1)


def _sum_groups(grad, n_kv_heads):
    """``[L, Hq, D]`` per query head -> ``[L, Hkv, D]``: the sum over each key/value head's query heads."""
    n, n_heads, head_dim = grad.shape
    return grad.view(n, n_kv_heads, n_heads // n_kv_heads, head_dim).sum(2)


def attention_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, out, lse_out):
    """Varlen attention forward: ``out [Tq, Hq, D]`` and ``lse_out [Hq, Tq]`` (see the module docstring).

    ``max_seqlen_*`` are not needed here (the reference reads the lengths from ``cu_seqlens``).
    """
    cdt = compute_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    for q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        _sequence_fwd(
            q, _heads(k[k0:k1], cdt, group), _heads(v[k0:k1], cdt, group), q0, q1, causal, softmax_scale, out, lse_out
        )


def attention_bwd(
    grad_out,
    q,
    k,
    v,
    out,
    lse,
    grad_lse,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    causal,
    softmax_scale,
    grad_q_out,
    grad_k_out,
    grad_v_out,
):
    """Gradients of ``q``, ``k``, ``v`` from ``grad_out`` and (optionally) ``grad_lse`` (module docstring)."""
    cdt = compute_dtype(q.dtype)
    n_kv_heads = k.shape[1]
    group = q.shape[1] // n_kv_heads
    for q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        dk, dv = _sequence_bwd(
            grad_out,
            q,
            _heads(k[k0:k1], cdt, group),
            _heads(v[k0:k1], cdt, group),
            out,
            lse,
            grad_lse,
            q0,
            q1,
            causal,
            softmax_scale,
            grad_q_out,
        )
        # sum the query heads of each key/value head's group
        grad_k_out[k0:k1] = _sum_groups(dk, n_kv_heads).to(grad_k_out.dtype)
        grad_v_out[k0:k1] = _sum_groups(dv, n_kv_heads).to(grad_v_out.dtype)


# ---------------------------------------------------------------------------
# prefix_attention: a sequence's logical keys are [its prefix sequence's keys; its own keys]
# ---------------------------------------------------------------------------


def _logical_keys(x, seqs, prefix, b, cdt, group):
    """``[P_b + Lk_b, Hq, D]``: the keys (or values) of sequence ``b``'s prefix sequence, then its own."""
    _, _, k0, k1 = seqs[b]
    a = prefix[b]
    if a < 0:
        return _heads(x[k0:k1], cdt, group)
    _, _, p0, p1 = seqs[a]
    return _heads(torch.cat([x[p0:p1], x[k0:k1]]), cdt, group)


def prefix_attention_fwd(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, prefix_index, causal, softmax_scale, out, lse_out
):
    """Attention with shared prefixes (module docstring): ``attention_fwd`` of each sequence over its logical keys."""
    cdt = compute_dtype(q.dtype)
    group = q.shape[1] // k.shape[1]
    seqs = _sequences(cu_seqlens_q, cu_seqlens_k)
    prefix = prefix_index.tolist()
    for b, (q0, q1, _, _) in enumerate(seqs):
        _sequence_fwd(
            q,
            _logical_keys(k, seqs, prefix, b, cdt, group),
            _logical_keys(v, seqs, prefix, b, cdt, group),
            q0,
            q1,
            causal,
            softmax_scale,
            out,
            lse_out,
        )


def prefix_attention_bwd(
    grad_out,
    q,
    k,
    v,
    out,
    lse,
    grad_lse,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    prefix_index,
    causal,
    softmax_scale,
    grad_q_out,
    grad_k_out,
    grad_v_out,
):
    """Gradients of :func:`prefix_attention_fwd`. Each sequence's backward runs over its logical keys; the part of
    its ``dk`` / ``dv`` on the prefix rows is added to the prefix sequence's own part, in ascending sequence order."""
    cdt = compute_dtype(q.dtype)
    n_kv_heads = k.shape[1]
    group = q.shape[1] // n_kv_heads
    seqs = _sequences(cu_seqlens_q, cu_seqlens_k)
    prefix = prefix_index.tolist()
    own, borrowed = [], []  # per sequence: dk, dv of its own keys; of its prefix's keys (None without a prefix)
    for b, (q0, q1, k0, k1) in enumerate(seqs):
        dk, dv = _sequence_bwd(
            grad_out,
            q,
            _logical_keys(k, seqs, prefix, b, cdt, group),
            _logical_keys(v, seqs, prefix, b, cdt, group),
            out,
            lse,
            grad_lse,
            q0,
            q1,
            causal,
            softmax_scale,
            grad_q_out,
        )
        n_p = dk.shape[0] - (k1 - k0)
        own.append((dk[n_p:], dv[n_p:]))
        borrowed.append((dk[:n_p], dv[:n_p]) if prefix[b] >= 0 else None)
    for b, part in enumerate(borrowed):  # the referencing sequences' contributions, in ascending order
        if part is not None:
            own[prefix[b]][0].add_(part[0])
            own[prefix[b]][1].add_(part[1])
    for (_, _, k0, k1), (dk, dv) in zip(seqs, own):
        grad_k_out[k0:k1] = _sum_groups(dk, n_kv_heads).to(grad_k_out.dtype)
        grad_v_out[k0:k1] = _sum_groups(dv, n_kv_heads).to(grad_v_out.dtype)
