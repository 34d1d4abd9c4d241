"""Public attention ops: ``attention``, packed variable-length (flash-style) attention with LSE export, and
``prefix_attention``, the same with sequences that read another sequence's keys as a shared prefix (a GRPO
group's responses and their prompt).

Each op is two ``torch.library.custom_op`` primitives (``rlk::attention_fwd`` / ``rlk::attention_bwd``,
``rlk::prefix_attention_fwd`` / ``rlk::prefix_attention_bwd``) with fake implementations, so the ops trace under
``torch.compile(fullgraph=True)``, and one ``register_autograd`` that calls the backward primitive on the backend
that served the forward. The math is specified in ``rlk.reference.attention``.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlk.core import checks, custom_op
from rlk.core.checks import check_float, stat_dtype

# ---------------------------------------------------------------------------
# argument checks (shape and dtype at call time; values inside the custom op)
# ---------------------------------------------------------------------------


def _check_float(name: str, x: Tensor) -> None:
    check_float(name, x)
    if x.dim() != 3:
        raise ValueError(f"{name}: expected shape [tokens, heads, head_dim], got {tuple(x.shape)}")


def _check_arguments(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q,
    max_seqlen_k,
    causal,
    softmax_scale,
) -> tuple[int, int, bool, float]:
    """The call-time checks of ``attention`` and ``prefix_attention`` (shapes, dtypes, devices, scalars; errors name
    the argument). Returns ``(max_seqlen_q, max_seqlen_k, causal, softmax_scale)`` validated, the scale defaulted."""
    _check_float("q", q)
    _check_float("k", k)
    _check_float("v", v)
    total_q, n_heads, head_dim = q.shape
    if head_dim == 0 or n_heads == 0:
        raise ValueError(f"q: expected Hq >= 1 and D >= 1, got shape {tuple(q.shape)}")
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name}: expected the dtype of q ({q.dtype}), got {x.dtype}")
        if x.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (the device of q), got {x.device}")
    if k.shape[2] != head_dim:
        raise ValueError(f"k: expected head_dim D = {head_dim} (q's last dim), got shape {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v: expected the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    n_kv_heads = k.shape[1]
    if n_kv_heads == 0 or n_heads % n_kv_heads != 0:
        raise ValueError(f"k: its number of heads Hkv = {n_kv_heads} must divide q's Hq = {n_heads}")
    checks.cu_seqlens("cu_seqlens_q", cu_seqlens_q, q.device)
    checks.cu_seqlens("cu_seqlens_k", cu_seqlens_k, q.device)
    if cu_seqlens_k.shape != cu_seqlens_q.shape:
        raise ValueError(
            f"cu_seqlens_k: expected the shape of cu_seqlens_q {tuple(cu_seqlens_q.shape)} "
            f"(one entry per sequence + 1), got {tuple(cu_seqlens_k.shape)}"
        )
    max_seqlen_q = checks.integer("max_seqlen_q", max_seqlen_q, minimum=0)
    max_seqlen_k = checks.integer("max_seqlen_k", max_seqlen_k, minimum=0)
    causal = checks.flag("causal", causal)
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(head_dim)
    softmax_scale = checks.number("softmax_scale", softmax_scale, above=0.0, dtype=torch.float32)
    return max_seqlen_q, max_seqlen_k, causal, float(softmax_scale)


def _check_prefix_index(prefix_index, cu_seqlens_q: Tensor, device: torch.device) -> None:
    """``prefix_index``: an int32 ``[B]`` tensor on q's device (values: :func:`_check_prefix_values`)."""
    if not isinstance(prefix_index, Tensor):
        raise TypeError(f"prefix_index: expected a torch.Tensor, got {type(prefix_index).__name__}")
    if prefix_index.dtype != torch.int32:
        raise TypeError(f"prefix_index: expected dtype int32, got {prefix_index.dtype}")
    n_seq = cu_seqlens_q.shape[0] - 1
    if prefix_index.shape != (n_seq,):
        raise ValueError(
            f"prefix_index: expected shape [B] = ({n_seq},) (one entry per sequence of cu_seqlens_q), "
            f"got {tuple(prefix_index.shape)}"
        )
    if prefix_index.device != device:
        raise ValueError(f"prefix_index: expected device {device} (the device of q), got {prefix_index.device}")


def _check_prefix_values(prefix_index: Tensor) -> None:
    """Value checks of ``prefix_index`` (one host synchronization, inside the custom op; skipped like the
    ``cu_seqlens`` checks, :func:`rlk.core.checks.values_checked`): every entry is -1 or a sequence index in
    ``[0, B)`` whose own entry is -1 (prefixes are one level deep; a sequence cannot be its own prefix)."""
    n_seq = prefix_index.shape[0]
    if not checks.values_checked() or n_seq == 0 or prefix_index.device.type == "meta":
        return
    index = prefix_index.long()
    out_of_range = (index < -1) | (index >= n_seq)
    nested = (index >= 0) & ~out_of_range & (index[index.clamp(0, n_seq - 1)] != -1)
    bad_range, bad_depth = torch.stack([out_of_range.any(), nested.any()]).tolist()
    if bad_range:
        b = int(out_of_range.nonzero()[0, 0])
        raise ValueError(
            f"prefix_index: values must be -1 or a sequence index in [0, {n_seq}); sequence {b} has {int(index[b])}"
        )
    if bad_depth:
        b = int(nested.nonzero()[0, 0])
        a = int(index[b])
        raise ValueError(
            f"prefix_index: sequence {b} has the prefix sequence {a}, whose own prefix_index is "
            f"{int(index[a])} (must be -1: prefixes are one level deep, and a sequence is not its own "
            "prefix)"
        )


def _check_values(
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, total_q: int, total_k: int, max_seqlen_q: int, max_seqlen_k: int
) -> None:
    """Value checks of ``cu_seqlens`` that need the data (one host synchronization); run inside the custom op.

    ``RLK_CHECK_VALUES=0`` skips them (for CUDA graph capture, or once a pipeline is known to be clean): bad
    offsets then read out of bounds in the kernels, and a length above ``max_seqlen_*`` leaves rows unwritten,
    instead of raising. ``rlk.patch_model``'s attention builds its offsets itself and skips them.
    """
    checks.check_cu_seqlens_values(
        [
            ("cu_seqlens_q", cu_seqlens_q, total_q, "q", max_seqlen_q),
            ("cu_seqlens_k", cu_seqlens_k, total_k, "k and v", max_seqlen_k),
        ]
    )


# ---------------------------------------------------------------------------
# custom ops
# ---------------------------------------------------------------------------


def _key(q: Tensor, *_):
    return q.device, q.dtype, {"head_dim": q.shape[2]}


def _no_keys_or_queries(q: Tensor, k: Tensor, o: Tensor, lse: Tensor) -> bool:
    """Fill the forward's outputs of an empty problem (no queries, or no keys anywhere: every query sees nothing)
    and say so; False when there is work for the kernels."""
    if q.shape[0] == 0:
        return True
    if k.shape[0] == 0:
        o.zero_()
        lse.fill_(-math.inf)
        return True
    return False


def _zero_grads_if_empty(q: Tensor, k: Tensor, grads: tuple[Tensor, Tensor, Tensor]) -> bool:
    """Zero the gradients of an empty problem (no queries or no keys) and say so."""
    if q.shape[0] == 0 or k.shape[0] == 0:
        for grad in grads:
            grad.zero_()
        return True
    return False


def _incoming_grads(
    grad_out: Tensor | None, grad_lse: Tensor | None, out: Tensor, lse: Tensor
) -> tuple[Tensor, Tensor | None]:
    """The gradients reaching ``out`` and ``lse`` in the dtypes and layout the backward primitives take."""
    grad_out = torch.zeros_like(out) if grad_out is None else grad_out.to(out.dtype).contiguous()
    return grad_out, None if grad_lse is None else grad_lse.to(lse.dtype).contiguous()


def _fwd_outputs(q: Tensor, *_) -> tuple[Tensor, Tensor]:
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=stat_dtype(q))


def _bwd_outputs(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, *_) -> tuple[Tensor, Tensor, Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


attention_op = custom_op.declare("attention", key=_key)


@attention_op.forward(outputs=_fwd_outputs)
def _attention_fwd(
    primitive,
    out,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: float,
) -> tuple[Tensor, Tensor]:
    o, lse = out
    _check_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    if _no_keys_or_queries(q, k, o, lse):
        return
    primitive(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, o, lse)


@attention_op.backward_primitive(outputs=_bwd_outputs)
def _attention_bwd(
    primitive,
    out,
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    output: Tensor,
    lse: Tensor,
    grad_lse: Tensor | None,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    grad_q, grad_k, grad_v = out
    if _zero_grads_if_empty(q, k, out):
        return
    primitive(
        grad_out,
        q,
        k,
        v,
        output,
        lse,
        grad_lse,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        causal,
        softmax_scale,
        grad_q,
        grad_k,
        grad_v,
    )


def _save(ctx, inputs, output):
    out, lse = output
    ctx.save_for_backward(inputs.q, inputs.k, inputs.v, out, lse, inputs.cu_seqlens_q, inputs.cu_seqlens_k)
    ctx.attrs = (inputs.max_seqlen_q, inputs.max_seqlen_k, inputs.causal, inputs.softmax_scale)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    grad_out, grad_lse = _incoming_grads(grad_out, grad_lse, out, lse)
    grad_q, grad_k, grad_v = attention_op.backward(
        ctx, grad_out, q, k, v, out, lse, grad_lse, cu_seqlens_q, cu_seqlens_k, *ctx.attrs
    )
    return {"q": grad_q, "k": grad_k, "v": grad_v}


attention_op.autograd(save=_save, backward=_backward)


prefix_attention_op = custom_op.declare("prefix_attention", key=_key)


@prefix_attention_op.forward(outputs=_fwd_outputs)
def _prefix_attention_fwd(
    primitive,
    out,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    prefix_index: Tensor,
    causal: bool,
    softmax_scale: float,
) -> tuple[Tensor, Tensor]:
    o, lse = out
    _check_values(cu_seqlens_q, cu_seqlens_k, q.shape[0], k.shape[0], max_seqlen_q, max_seqlen_k)
    _check_prefix_values(prefix_index)
    if _no_keys_or_queries(q, k, o, lse):  # (no keys anywhere: prefixes included)
        return
    primitive(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, prefix_index, causal, softmax_scale, o, lse
    )


@prefix_attention_op.backward_primitive(outputs=_bwd_outputs)
def _prefix_attention_bwd(
    primitive,
    out,
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    output: Tensor,
    lse: Tensor,
    grad_lse: Tensor | None,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    prefix_index: Tensor,
    causal: bool,
    softmax_scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    grad_q, grad_k, grad_v = out
    if _zero_grads_if_empty(q, k, out):
        return
    primitive(
        grad_out,
        q,
        k,
        v,
        output,
        lse,
        grad_lse,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        prefix_index,
        causal,
        softmax_scale,
        grad_q,
        grad_k,
        grad_v,
    )


def _prefix_save(ctx, inputs, output):
    out, lse = output
    ctx.save_for_backward(
        inputs.q, inputs.k, inputs.v, out, lse, inputs.cu_seqlens_q, inputs.cu_seqlens_k, inputs.prefix_index
    )
    ctx.attrs = (inputs.max_seqlen_q, inputs.max_seqlen_k)
    ctx.flags = (inputs.causal, inputs.softmax_scale)


def _prefix_backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, prefix_index = ctx.saved_tensors
    grad_out, grad_lse = _incoming_grads(grad_out, grad_lse, out, lse)
    grad_q, grad_k, grad_v = prefix_attention_op.backward(
        ctx, grad_out, q, k, v, out, lse, grad_lse, cu_seqlens_q, cu_seqlens_k, *ctx.attrs, prefix_index, *ctx.flags
    )
    return {"q": grad_q, "k": grad_k, "v": grad_v}


prefix_attention_op.autograd(save=_prefix_save, backward=_prefix_backward)


# ---------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = True,
    softmax_scale: float | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """Batch-invariant variable-length attention on packed sequences, optionally with the LSE.

    Sequence ``b`` owns query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` (``Lq`` rows) and key/value
    rows ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` (``Lk`` rows); query head ``h`` reads key/value head
    ``h // (Hq // Hkv)`` (grouped-query attention). For query ``i`` and key ``j`` of a sequence
    (0-based within it)::

        s_ij  = softmax_scale * q_i . k_j
        lse_i = log sum_{j visible} exp(s_ij),    out_i = sum_{j visible} exp(s_ij - lse_i) v_j

    With ``causal`` the mask is aligned bottom-right: key ``j`` is visible to query ``i`` when
    ``j <= i + (Lk - Lq)``, so the last query sees every key (decode, and chunked prefill against a
    KV cache holding the earlier tokens). A query that sees no key (``Lq > Lk`` rows at the top under
    ``causal``, or ``Lk = 0``) gets ``out = 0`` and ``lse = -inf`` and passes no gradient.

    Args:
        q: ``[total_q, Hq, D]`` bfloat16, float16 or float32 (float64: reference backend only).
        k, v: ``[total_k, Hkv, D]`` of q's dtype and device; ``Hkv`` divides ``Hq``.
        cu_seqlens_q, cu_seqlens_k: int32 ``[B + 1]`` offsets: start at 0, non-decreasing, end at
            ``total_q`` / ``total_k``. Checked at a host synchronization unless ``RLK_CHECK_VALUES=0``.
        max_seqlen_q, max_seqlen_k: Python ints ``>=`` every sequence's length (they size the launch
            grid, so no host synchronization is needed to launch).
        causal: bottom-right aligned causal mask (default True).
        softmax_scale: ``> 0``; default ``1 / sqrt(D)``.
        return_lse: also return ``lse``.

    Returns:
        ``out [total_q, Hq, D]`` in q's dtype, and with ``return_lse`` the natural-log logsumexp of the
        scaled scores, fp32 ``[Hq, total_q]`` (fp64 for fp64 inputs). Differentiable w.r.t. ``q``, ``k``,
        ``v``, through ``out`` and ``lse`` (``d lse_i / d s_ij = p_ij``).

    Batch invariance (backends that promise it, ``rlk info``): a query's ``out`` and ``lse``, and its
    ``q`` gradient, are bitwise identical whether its sequence is alone or packed with others, and
    whether it is computed in a full prefill, a chunk of a chunked prefill or a decode step (keys are
    reduced in fixed blocks aligned to key 0 of the sequence, in order). ``k`` / ``v`` gradients are
    deterministic and bitwise independent of the packing.
    """
    max_seqlen_q, max_seqlen_k, causal, softmax_scale = _check_arguments(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale
    )
    return_lse = checks.flag("return_lse", return_lse)
    out, lse = _attention_fwd(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        cu_seqlens_q.contiguous(),
        cu_seqlens_k.contiguous(),
        max_seqlen_q,
        max_seqlen_k,
        causal,
        softmax_scale,
    )
    return (out, lse) if return_lse else out


def prefix_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    prefix_index: Tensor,
    causal: bool = True,
    softmax_scale: float | None = None,
    return_lse: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    """:func:`attention` over packed sequences of which some read another sequence's keys first: a shared prompt
    whose keys and values are stored once (GRPO groups), bitwise what each sequence gives over the concatenated keys.

    The packed layout is :func:`attention`'s: sequence ``b`` owns query rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]``
    (``Lq_b``) and key/value rows ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` (``Lk_b``, its *own* keys); query head
    ``h`` reads key/value head ``h // (Hq // Hkv)``. ``prefix_index[b]`` chooses the keys it attends over:

    * ``-1``: its own keys only, exactly :func:`attention`;
    * ``a >= 0``: the *logical* keys ``[all Lk_a keys of sequence a; its own Lk_b keys]``, ``P_b + Lk_b`` of them
      (``P_b = Lk_a``). Prefixes are one level deep: sequence ``a`` itself must have ``prefix_index[a] = -1``.

    For query ``i`` and logical key ``j`` of sequence ``b`` (0-based within it)::

        s_ij  = softmax_scale * q_i . k_j,     visible(i, j) = j <= i + (P_b + Lk_b - Lq_b)  (causal; else all)
        lse_i = log sum_{j visible} exp(s_ij),   out_i = sum_{j visible} exp(s_ij - lse_i) v_j

    so the causal mask is aligned bottom-right over the logical length: with ``Lq_b = Lk_b`` the sequence's
    queries are the tokens that follow the prefix. A query that sees no key gets ``out = 0``, ``lse = -inf`` and
    passes no gradient. The gradient of a key of a prefix sequence sums what its own queries and the queries of
    every sequence that reads it contribute (deterministic: own queries first, then the referencing sequences in
    ascending index; no atomics).

    GRPO layout: a group is ``[prompt, response_1, ..., response_G]`` packed in that order (several groups, and
    ordinary sequences, may share one call), with ``prefix_index`` ``-1`` for the prompt and the prompt's
    sequence index for each of its responses; q / k / v rows are each token's own, so the prompt's K/V are stored
    and computed once, and the prompt's queries are an ordinary causal sequence. For one group whose prompt has
    ``P`` tokens and responses ``R_1 .. R_G`` tokens::

        cu_seqlens_q = cu_seqlens_k = [0, P, P + R_1, ..., P + R_1 + ... + R_G]
        prefix_index = [-1, 0, 0, ..., 0]                       # int32, one entry per sequence

    Args:
        q: ``[total_q, Hq, D]`` bfloat16, float16 or float32 (float64: reference backend only).
        k, v: ``[total_k, Hkv, D]`` of q's dtype and device; ``Hkv`` divides ``Hq``. Each key row once (a
            prefix sequence's keys are not repeated for its readers).
        cu_seqlens_q, cu_seqlens_k: int32 ``[B + 1]`` offsets, as in :func:`attention` (own keys).
        max_seqlen_q: a Python int ``>=`` every ``Lq_b``.
        max_seqlen_k: a Python int ``>=`` every sequence's OWN key count ``Lk_b`` (it sizes the launch grid of
            the key-gradient kernel); a logical length ``P_b + Lk_b`` may exceed it.
        prefix_index: int32 ``[B]`` on q's device: ``-1``, or the index of the sequence whose keys come first
            (itself with ``-1``). Checked at a host synchronization unless ``RLK_CHECK_VALUES=0`` (like
            ``cu_seqlens``); unchecked bad values read wrong rows or out of bounds.
        causal: bottom-right aligned causal mask over the logical keys (default True).
        softmax_scale: ``> 0``; default ``1 / sqrt(D)``.
        return_lse: also return ``lse``.

    Returns:
        ``out [total_q, Hq, D]`` in q's dtype, and with ``return_lse`` the natural-log logsumexp fp32
        ``[Hq, total_q]`` (fp64 for fp64 inputs). Differentiable w.r.t. ``q``, ``k``, ``v`` through ``out`` and
        ``lse``.

    Invariance (backends that promise batch invariance, ``rlk info``): a query's ``out``, ``lse`` and ``q``
    gradient are bitwise those of :func:`attention` on its sequence alone over the physically concatenated keys,
    ``attention(q_b, cat(k_a, k_b), cat(v_a, v_b))`` with ``Lq = Lq_b``, ``Lk = P_b + Lk_b`` (a chunked prefill
    of the response against the prompt's KV cache), hence also those of the full sequence ``[prompt; response]``
    restricted to the response rows, and of any other packing: keys are reduced in the same fixed blocks aligned
    to logical key 0, in order. ``k`` / ``v`` gradients are deterministic; they equal (within the contract, not
    bitwise) the sum over the group of each sequence's own computation.
    """
    max_seqlen_q, max_seqlen_k, causal, softmax_scale = _check_arguments(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale
    )
    return_lse = checks.flag("return_lse", return_lse)
    _check_prefix_index(prefix_index, cu_seqlens_q, q.device)
    out, lse = _prefix_attention_fwd(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        cu_seqlens_q.contiguous(),
        cu_seqlens_k.contiguous(),
        max_seqlen_q,
        max_seqlen_k,
        prefix_index.contiguous(),
        causal,
        softmax_scale,
    )
    return (out, lse) if return_lse else out
