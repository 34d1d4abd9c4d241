"""Varlen attention primitives (spec: :mod:`rlk.reference.attention`): the spec run on one sequence at a time
(``prefix_attention``: one group at a time, a referenced sequence with the sequences that read its keys, in
ascending order), on fresh copies of its rows, so a sequence's result depends on its own rows only."""

from __future__ import annotations

import torch

from rlk.reference import attention as spec
from rlk_domestic.blocks import sequences


def _cu(lengths: list[int], device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _groups(n: int, prefix: list[int] | None) -> list[list[int]]:
    """Independent sub-problems: every sequence alone, or (prefix_attention) each sequence that no other references
    with the sequences referencing it, in ascending order."""
    if prefix is None:
        return [[b] for b in range(n)]
    return [sorted([a] + [b for b in range(n) if prefix[b] == a]) for a in range(n) if prefix[a] < 0]


class _Sub:
    """The packed rows of a group of sequences: fresh contiguous copies, their own cu_seqlens."""

    def __init__(self, members, qs, ks, device):
        self.members, self.qs, self.ks = members, [qs[b] for b in members], [ks[b] for b in members]
        self.cu_q = _cu([q1 - q0 for q0, q1 in self.qs], device)
        self.cu_k = _cu([k1 - k0 for k0, k1 in self.ks], device)
        self.max_q = max((q1 - q0 for q0, q1 in self.qs), default=0)
        self.max_k = max((k1 - k0 for k0, k1 in self.ks), default=0)

    def rows(self, x, spans):
        return torch.cat([x[s0:s1] for s0, s1 in spans]).contiguous()

    def q(self, x):
        return self.rows(x, self.qs)

    def k(self, x):
        return self.rows(x, self.ks)

    def scatter(self, part, x, spans, dim=0):
        offset = 0
        for s0, s1 in spans:
            x.narrow(dim, s0, s1 - s0).copy_(part.narrow(dim, offset, s1 - s0))
            offset += s1 - s0


def _forward(fn, q, k, v, cu_q, cu_k, causal, scale, out, lse_out, prefix_index=None):
    qs, ks = sequences(cu_q), sequences(cu_k)
    prefix = None if prefix_index is None else prefix_index.tolist()
    for members in _groups(len(qs), prefix):
        sub = _Sub(members, qs, ks, q.device)
        q_sub = sub.q(q)
        o = torch.empty_like(q_sub)
        lse = torch.empty((q.shape[1], o.shape[0]), dtype=lse_out.dtype, device=q.device)
        extra = () if prefix is None else (_local_prefix(members, prefix, q.device),)
        fn(q_sub, sub.k(k), sub.k(v), sub.cu_q, sub.cu_k, sub.max_q, sub.max_k, *extra, causal, scale, o, lse)
        sub.scatter(o, out, sub.qs)
        sub.scatter(lse, lse_out, sub.qs, dim=1)


def _backward(
    fn,
    grad_out,
    q,
    k,
    v,
    out,
    lse,
    grad_lse,
    cu_q,
    cu_k,
    causal,
    scale,
    grad_q_out,
    grad_k_out,
    grad_v_out,
    prefix_index=None,
):
    qs, ks = sequences(cu_q), sequences(cu_k)
    prefix = None if prefix_index is None else prefix_index.tolist()
    for members in _groups(len(qs), prefix):
        sub = _Sub(members, qs, ks, q.device)
        q_sub, k_sub, v_sub = sub.q(q), sub.k(k), sub.k(v)
        dq, dk, dv = torch.empty_like(q_sub), torch.empty_like(k_sub), torch.empty_like(v_sub)
        lse_sub = torch.cat([lse[:, s0:s1] for s0, s1 in sub.qs], dim=1).contiguous()
        glse = None if grad_lse is None else torch.cat([grad_lse[:, s0:s1] for s0, s1 in sub.qs], dim=1).contiguous()
        extra = () if prefix is None else (_local_prefix(members, prefix, q.device),)
        fn(
            sub.q(grad_out),
            q_sub,
            k_sub,
            v_sub,
            sub.q(out),
            lse_sub,
            glse,
            sub.cu_q,
            sub.cu_k,
            sub.max_q,
            sub.max_k,
            *extra,
            causal,
            scale,
            dq,
            dk,
            dv,
        )
        sub.scatter(dq, grad_q_out, sub.qs)
        sub.scatter(dk, grad_k_out, sub.ks)
        sub.scatter(dv, grad_v_out, sub.ks)


def _local_prefix(members: list[int], prefix: list[int], device) -> torch.Tensor:
    local = {b: i for i, b in enumerate(members)}
    return torch.tensor([-1 if prefix[b] < 0 else local[prefix[b]] for b in members], dtype=torch.int32, device=device)


def attention_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, out, lse_out):
    _forward(spec.attention_fwd, q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, out, lse_out)


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
    _backward(
        spec.attention_bwd,
        grad_out,
        q,
        k,
        v,
        out,
        lse,
        grad_lse,
        cu_seqlens_q,
        cu_seqlens_k,
        causal,
        softmax_scale,
        grad_q_out,
        grad_k_out,
        grad_v_out,
    )


def prefix_attention_fwd(
    q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, prefix_index, causal, softmax_scale, out, lse_out
):
    _forward(
        spec.prefix_attention_fwd,
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        causal,
        softmax_scale,
        out,
        lse_out,
        prefix_index,
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
    _backward(
        spec.prefix_attention_bwd,
        grad_out,
        q,
        k,
        v,
        out,
        lse,
        grad_lse,
        cu_seqlens_q,
        cu_seqlens_k,
        causal,
        softmax_scale,
        grad_q_out,
        grad_k_out,
        grad_v_out,
        prefix_index,
    )
