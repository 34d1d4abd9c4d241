"""The batch-invariant patch of a transformers causal LM: :func:`patch_model` / :func:`unpatch_model`.

The aten overrides of :mod:`rlk.integrations.batch_invariant` cannot reach two things in a transformers causal LM:

* RMSNorm written as ``pow / mean / rsqrt`` in fp32 (Llama, Qwen2/3, Mistral...): ``patch_model``
  replaces the ``forward`` of every module with a 1-D ``weight`` and a float ``variance_epsilon``
  (``LlamaRMSNorm``, ``Qwen3RMSNorm``, ...) by rlk's ``rms_norm`` primitives (same formula:
  ``weight * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)``, fp32 statistics), one program per row;
* attention with padding masks: ``patch_model`` registers the attention function ``"rlk"`` with
  ``transformers.AttentionInterface`` and switches the model to it. With a 2-D ``attention_mask`` whose
  rows each hold one run of tokens (left or right padding), it runs rlk's varlen attention in place on the
  padded ``[B * S]`` tokens, each row cut into three sequences by ``cu_seqlens`` (the pads before the run,
  the run, the pads after it) computed on the device: no host synchronization, so a decode step can be
  captured in a CUDA graph (with ``RLK_CHECK_VALUES=0``, which also skips the one check that the mask has
  no holes). A mask with holes drops the padding and packs the valid tokens; packed rows without a mask
  are split where ``position_ids`` restart at 0. With a static KV cache (keys of ``max_cache_len`` slots, longer
  than the mask) the slots after the mask are padding; a caller that passes ``cache_position`` may give a mask
  over all the slots (0 where not written yet), one shape on every step, as a captured decode step needs.
  transformers < 5 does not forward ``cache_position`` to the attention function: a pre-hook on each attention
  module records the one it was called with; a mask over all of a static cache's slots whose query slots are not
  known is refused (ValueError), never read as the last columns. While a CUDA graph is captured the layout is
  recomputed in the graph (never taken from the per-forward cache). Pad positions get zeros. A token's attention
  output is then bitwise the same alone or batched, whatever the padding.

Together with ``with rlk.batch_invariant():`` (matmuls, softmax, the remaining reductions) a sequence's
logits and per-token gradients do not depend on the micro-batch it is in. Left padding needs
``position_ids`` (``attention_mask.cumsum(-1) - 1``), as always with transformers.

Both replacements use the first batch-invariant backend serving the tensors (see
:func:`rlk.integrations.batch_invariant._invariant_backend`). When none serves them (CPU without
``TRITON_INTERPRET=1``, float64, bfloat16 on the CPU, ...), or for a case the rlk path does not cover (attention
dropout, sliding windows, 4-D masks, weights of another dtype than the activations), the stock code runs, with a
one-time warning: the model's own RMSNorm, and transformers' SDPA attention with the mask transformers' SDPA mask
builder makes (:func:`padding_mask` returns that mask where rlk's attention will not run; :func:`_stock_mask` builds
it from the padding mask for a fallback decided per call), so the outputs are bitwise those of the unpatched model
with ``attn_implementation="sdpa"``. The switch of attention implementation is made on copies of the model's config
objects: another model built from the same config object is not affected.

transformers is imported only when :func:`patch_model` is called (optional dependency).
"""

from __future__ import annotations

import copy
import inspect
import math
import types
import warnings
import weakref

import torch
from torch import Tensor

from rlk.core import checks, custom_op, dispatch
from rlk.integrations.batch_invariant import _invariant_backend
from rlk.integrations.hf.groups import LAYOUT_KEYWORD

ATTENTION_NAME = "rlk"

_warned: set[str] = set()


def _warn_once(what: str) -> None:
    if what not in _warned:
        _warned.add(what)
        warnings.warn(
            f"rlk.patch_model: {what}; running the stock transformers code (not batch-invariant)",
            RuntimeWarning,
            stacklevel=3,
        )


# ---------------------------------------------------------------------------
# RMSNorm
# ---------------------------------------------------------------------------


class _RMSNorm(torch.autograd.Function):
    """``y = weight * (x * rstd).to(x.dtype)``, ``rstd = rsqrt(mean(x^2) + eps)`` on ``[N, H]`` rows."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float, backend: str) -> Tensor:
        out = torch.empty_like(x)
        rstd = x.new_empty((x.shape[0],), dtype=torch.float32)
        dispatch.backend_named(backend).primitives["rms_norm_fwd"](x, weight, None, eps, False, out, None, rstd)
        ctx.save_for_backward(x, weight, rstd)
        ctx.backend = backend
        return out

    @staticmethod
    @custom_op.first_order_only("rlk::rms_norm_fwd")
    def backward(ctx, grad_out: Tensor):
        x, weight, rstd = ctx.saved_tensors
        grad_x = torch.empty_like(x)
        grad_w = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        dispatch.backend_named(ctx.backend).primitives["rms_norm_bwd"](
            grad_out.to(x.dtype).contiguous(), x, weight, rstd, False, None, grad_x, grad_w
        )
        return grad_x, grad_w, None, None


def _is_rms_norm(module: torch.nn.Module) -> bool:
    """The Llama / Qwen pattern: a 1-D ``weight`` parameter and a float ``variance_epsilon``."""
    weight = getattr(module, "weight", None)
    eps = getattr(module, "variance_epsilon", None)
    return (
        isinstance(weight, torch.nn.Parameter)
        and weight.dim() == 1
        and isinstance(eps, (int, float))
        and not isinstance(eps, bool)
        and "gemma" not in type(module).__name__.lower()
    )


def _rms_norm_forward(self, hidden_states: Tensor) -> Tensor:
    """Replacement ``forward`` of an RMSNorm module (see the module docstring)."""
    x, weight = hidden_states, self.weight
    hidden = weight.shape[0]
    backend = None
    if x.dtype == weight.dtype and x.device == weight.device and x.shape[-1:] == (hidden,) and x.numel() > 0:
        backend = _invariant_backend("rms_norm", x.device, x.dtype)
    if backend is None:
        _warn_once(
            f"no batch-invariant rms_norm for {x.dtype} activations and {weight.dtype} weight on {x.device.type}"
        )
        return type(self).forward(self, hidden_states)
    rows = x.reshape(-1, hidden).contiguous()
    return _RMSNorm.apply(rows, weight.contiguous(), float(self.variance_epsilon), backend.name).view(x.shape)


# ---------------------------------------------------------------------------
# attention
# ---------------------------------------------------------------------------


#: The last layout :func:`_varlen_layout` computed, with weak references to the tensors it came from: every
#: layer of one forward passes the same mask (or position ids), and the layout costs host synchronizations.
_last_layout: dict[str, object] = {}


def _tensor_key(x: Tensor | None) -> tuple | None:
    """Identity of a tensor's current contents (storage, offset, version counter, shape), or None."""
    return None if x is None else (x.data_ptr(), x.storage_offset(), x._version, tuple(x.shape), x.device)


def _varlen_layout(
    attention_mask: Tensor | None,
    position_ids: Tensor | None,
    cache_position: Tensor | None,
    batch: int,
    seq_q: int,
    seq_k: int,
    device: torch.device,
):
    """:func:`_varlen_index`, computed once per (mask, position ids, cache positions, shapes) for all the layers of
    a forward; computed afresh while a CUDA graph is captured (the graph must recompute it from its buffers)."""
    if attention_mask is None and position_ids is None:
        return _varlen_index(None, None, None, batch, seq_q, seq_k, device)
    sources = (attention_mask, position_ids, cache_position)
    if _capturing(device):
        return _varlen_index(*sources, batch, seq_q, seq_k, device)
    key = (*map(_tensor_key, sources), batch, seq_q, seq_k, device)
    refs = _last_layout.get("refs")
    if (
        _last_layout.get("key") == key
        and refs is not None
        and all((ref is None and x is None) or (ref is not None and ref() is x) for ref, x in zip(refs, sources))
    ):
        return _last_layout["layout"]
    layout = _varlen_index(*sources, batch, seq_q, seq_k, device)
    _last_layout.update(key=key, layout=layout, refs=tuple(None if x is None else weakref.ref(x) for x in sources))
    return layout


def _one_run_offsets(mask: Tensor) -> Tensor:
    """int32 ``cu_seqlens [3 B + 1]`` of the flattened ``[B, S]`` tokens of a boolean mask with one run of
    ``True`` per row: row ``b`` is cut at ``b S``, at its run's first token and after its last (empty cuts for an
    empty run or no padding). Device ops only."""
    batch, seq = mask.shape
    ones = mask.sum(1, dtype=torch.int32)
    before = (mask.cumsum(1, dtype=torch.int32) == 0).sum(1, dtype=torch.int32)  # the pads before the run
    start = torch.arange(batch, dtype=torch.int32, device=mask.device) * seq
    cuts = torch.stack([start, start + before, start + before + ones], dim=1).reshape(-1)
    return torch.cat([cuts, cuts.new_full((1,), batch * seq)])


def _one_run_per_row(mask: Tensor) -> bool:
    """Whether every row of a boolean ``[B, S]`` mask holds at most one run of ``True`` (one host
    synchronization; assumed without it under ``RLK_CHECK_VALUES=0``)."""
    if not checks.values_checked():
        return True
    edges = (mask[:, 1:] != mask[:, :-1]).sum(1) + mask[:, 0].int() + mask[:, -1].int()
    return bool((edges <= 2).all())


def _varlen_index(
    attention_mask: Tensor | None,
    position_ids: Tensor | None,
    cache_position: Tensor | None,
    batch: int,
    seq_q: int,
    seq_k: int,
    device: torch.device,
) -> tuple[Tensor | None, Tensor | None, Tensor, Tensor, int, int] | None:
    """Rows of the flattened ``[B * S]`` tokens to keep (None: all) for queries and keys, ``cu_seqlens_q``,
    ``cu_seqlens_k`` and the max lengths; None when the layout is not one this path handles.

    A mask with one run per row keeps every row (the pads become sequences of their own, :func:`_one_run_offsets`);
    the first row tensor is then the ``[B * Sq]`` query mask, so that the pad rows' outputs are zeroed. The queries
    are the mask's last ``Sq`` columns, or with ``cache_position`` (``[Sq]``, when the caller passes it) its columns
    at those slots: a static cache's mask may then span all its slots, the ones not written yet 0."""
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape[0] != batch or attention_mask.shape[1] < seq_q:
            return None
        mask = attention_mask[:, -seq_k:].to(device=device, dtype=torch.bool)
        slots = attention_mask.shape[1] <= seq_k and cache_position is not None and cache_position.shape == (seq_q,)
        q_mask = mask.index_select(1, cache_position.to(device)) if slots else mask[:, -seq_q:]
        if mask.shape[1] < seq_k:  # a static cache: its slots after the mask's ``past + S`` are not written yet
            mask = torch.nn.functional.pad(mask, (0, seq_k - mask.shape[1]), value=False)
        if _one_run_per_row(mask):
            return (q_mask.reshape(-1), None, _one_run_offsets(q_mask), _one_run_offsets(mask), seq_q, seq_k)
        q_len, k_len = q_mask.sum(1), mask.sum(1)
        zero = torch.zeros(1, dtype=torch.int32, device=device)
        cu_q = torch.cat([zero, q_len.cumsum(0).to(torch.int32)])
        cu_k = torch.cat([zero, k_len.cumsum(0).to(torch.int32)])
        lengths = torch.stack([q_len.max(), k_len.max()]).tolist()
        return (
            q_mask.reshape(-1).nonzero().squeeze(1),
            mask.reshape(-1).nonzero().squeeze(1),
            cu_q,
            cu_k,
            int(lengths[0]),
            int(lengths[1]),
        )
    if position_ids is not None and seq_q == seq_k and position_ids.shape[-1] == seq_q:
        pos = position_ids.to(device).expand(batch, seq_q).reshape(-1)
        starts = pos == 0
        starts[::seq_q] = True  # every row starts a sequence
        bounds = torch.cat([starts.nonzero().squeeze(1), torch.tensor([batch * seq_q], device=device)]).to(torch.int32)
        longest = int((bounds[1:] - bounds[:-1]).max())
        return None, None, bounds, bounds, longest, longest
    cu_q = torch.arange(batch + 1, dtype=torch.int32, device=device) * seq_q
    cu_k = torch.arange(batch + 1, dtype=torch.int32, device=device) * seq_k
    return None, None, cu_q, cu_k, seq_q, seq_k


#: The keyword names under which transformers passes an attention module its KV cache (4.x, 5.x).
_CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "cache")


def _is_attention_module(module: torch.nn.Module) -> bool:
    """Whether ``module`` is an attention module of transformers that receives its KV cache: it has ``is_causal``
    and its ``forward`` takes a cache argument (the module the attention function gets as ``module``)."""
    if not hasattr(module, "is_causal"):
        return False
    try:
        names = inspect.signature(type(module).forward).parameters
    except (TypeError, ValueError):
        return False
    return any(name in names for name in _CACHE_ARGUMENTS)


def _record_cache_call(module, args, kwargs) -> None:
    """Forward pre-hook of an attention module: the ``cache_position`` and the KV cache it is called with, which
    transformers < 5 does not forward to the attention function (read by :func:`_query_slots`)."""
    cache = next((kwargs[name] for name in _CACHE_ARGUMENTS if kwargs.get(name) is not None), None)
    module._rlk_cache_call = (kwargs.get("cache_position"), cache)


def _forget_cache_call(module, args, output) -> None:
    """Forward hook (also after an exception): drop the record, so that no module keeps a KV cache alive."""
    module.__dict__.pop("_rlk_cache_call", None)


def _query_slots(module, attention_mask: Tensor | None, seq_k: int, kwargs) -> Tensor | None:
    """The cache slots of the queries: ``cache_position`` as the attention function or its module received it,
    else None (the queries are the mask's last columns). Raises ValueError for a mask over all ``seq_k`` slots of
    a static cache without them: there the last columns are slots not written yet."""
    slots = kwargs.get("cache_position")
    recorded, cache = getattr(module, "_rlk_cache_call", (None, None))
    if slots is None:
        slots = recorded
    if (
        slots is None
        and cache is not None
        and getattr(cache, "is_compileable", False)
        and attention_mask is not None
        and attention_mask.dim() == 2
        and attention_mask.shape[1] == seq_k
    ):
        raise ValueError(
            f"rlk.patch_model: attention_mask spans all {seq_k} slots of a static KV cache, and the queries' slots "
            "are not known: pass cache_position= (the slots of this forward's tokens) to the model, or a mask of "
            "[batch, past + new tokens]"
        )
    return slots


def _unsupported(module, query: Tensor, key: Tensor, value: Tensor, dropout: float, kwargs) -> str | None:
    """What of an attention call rlk's kernels do not cover (None: everything is covered)."""
    if dropout and module.training:
        return "attention dropout"
    if kwargs.get("sliding_window") is not None or kwargs.get("softcap") is not None:
        return "sliding-window or soft-capped attention"
    if query.dtype != key.dtype or query.dtype != value.dtype or query.shape[1] % key.shape[1] != 0:
        return "mixed dtypes or head counts"
    return None


def rlk_attention_forward(
    module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
):
    """The ``"rlk"`` entry of ``transformers.AttentionInterface``.

    ``query [B, Hq, Sq, D]``, ``key``/``value`` ``[B, Hkv, Sk, D]``, ``attention_mask`` the 2-D padding mask
    ``[B, >= Sk]`` (1: token) or None; returns ``(attn_output [B, Sq, Hq, D], None)``.
    """
    group_layout = kwargs.get(LAYOUT_KEYWORD)
    if group_layout is not None:
        return _prefix_shared_forward(module, query, key, value, group_layout, scaling, dropout, kwargs)
    batch, heads, seq_q, head_dim = query.shape
    seq_k = key.shape[2]
    why = _unsupported(module, query, key, value, dropout, kwargs)
    layout = None
    backend = None
    if why is None:
        backend = _invariant_backend("attention", query.device, query.dtype, head_dim=head_dim)
        if backend is None:
            why = f"no batch-invariant attention for {query.dtype} on {query.device.type} (head dim {head_dim})"
    if why is None:
        layout = _varlen_layout(
            attention_mask,
            kwargs.get("position_ids"),
            _query_slots(module, attention_mask, seq_k, kwargs),
            batch,
            seq_q,
            seq_k,
            query.device,
        )
        if layout is None:
            why = f"an attention mask of shape {tuple(attention_mask.shape)}"
    if why is not None:
        _warn_once(why)
        return _stock_attention(module, query, key, value, attention_mask, scaling, dropout, kwargs)
    q_rows, k_rows, cu_q, cu_k, max_q, max_k = layout
    in_place = q_rows is not None and q_rows.dtype == torch.bool  # one run per row: the query mask
    q = query.transpose(1, 2).reshape(batch * seq_q, heads, head_dim)
    k = key.transpose(1, 2).reshape(batch * seq_k, key.shape[1], head_dim)
    v = value.transpose(1, 2).reshape(batch * seq_k, key.shape[1], head_dim)
    if q_rows is not None and not in_place:
        q, k, v = q.index_select(0, q_rows), k.index_select(0, k_rows), v.index_select(0, k_rows)
    from rlk.ops.attention import attention

    causal = bool(getattr(module, "is_causal", True))
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(head_dim)
    with dispatch.use_backend(backend.name), checks.trusted_values():  # offsets built above from the mask
        out = attention(
            q,
            k,
            v,
            cu_seqlens_q=cu_q,
            cu_seqlens_k=cu_k,
            max_seqlen_q=max_q,
            max_seqlen_k=max_k,
            causal=causal,
            softmax_scale=scale,
        )
    if in_place:  # the pad sequences attend among themselves: their rows are set to 0
        out = torch.where(q_rows[:, None, None], out, 0.0)
    elif q_rows is not None:
        out = out.new_zeros((batch * seq_q, heads, head_dim)).index_copy(0, q_rows, out)
    return out.view(batch, seq_q, heads, head_dim), None


def _stock_attention(
    module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, scaling, dropout: float, kwargs
):
    """transformers' SDPA attention (what ``attn_implementation="sdpa"`` runs) on the mask it expects: a mask from
    transformers' SDPA mask builder (4-D, or None: :func:`padding_mask` hands it on where rlk's attention will not
    run) as it comes, rlk's 2-D padding mask (a fallback decided per call: dropout, soft-capping, ...) as
    :func:`_stock_mask` builds it."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if attention_mask is None or attention_mask.dim() == 2:
        cache = getattr(module, "_rlk_cache_call", (None, None))[1]
        attention_mask = _stock_mask(
            attention_mask,
            _query_slots(module, attention_mask, key.shape[2], kwargs),
            kwargs.get("position_ids"),
            query.shape[0],
            query.shape[2],
            key.shape[2],
            causal=bool(getattr(module, "is_causal", True)),
            cached=cache is not None or kwargs.get("past_key_values") is not None,
            device=query.device,
        )
    return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)


def _stock_mask(
    attention_mask: Tensor | None,
    query_slots: Tensor | None,
    position_ids: Tensor | None,
    batch: int,
    seq_q: int,
    seq_k: int,
    *,
    causal: bool,
    cached: bool,
    device: torch.device,
) -> Tensor | None:
    """What transformers' SDPA mask builder makes for a plain causal (or, ``causal=False``, bidirectional) layer,
    from what the ``"rlk"`` attention receives: a boolean ``[B, 1, Sq, Sk]`` mask (True: attend), or None where
    SDPA's own causal flag says the same (no padding, no packed rows, and ``Sq == 1`` or ``Sq == Sk`` with the queries
    in the last slots).

    Key slot ``j`` is visible to query ``i`` when it is not padding (``attention_mask`` ``[B, <= Sk]``, its last
    ``Sk`` columns, widened with False to the ``Sk`` slots of a static cache) and, for a causal layer, ``j <=`` the
    query's slot (``query_slots`` ``[Sq]``, else the last ``Sq`` columns of the mask) and, for packed rows without a
    mask and without a cache, ``j`` lies in the query's sequence (``position_ids`` restart at 0)."""
    keys = torch.ones(batch, seq_k, dtype=torch.bool, device=device)
    written = seq_k
    if attention_mask is not None:
        mask = attention_mask[:, -seq_k:].to(device=device, dtype=torch.bool)
        written = mask.shape[1]
        keys = torch.nn.functional.pad(mask, (0, seq_k - written), value=False)
    if not causal:
        return None if attention_mask is None else keys[:, None, None, :].expand(batch, 1, seq_q, seq_k)
    last = torch.arange(written - seq_q, written, device=device)
    slots = last if query_slots is None else query_slots.to(device=device, dtype=last.dtype)
    visible = keys[:, None, :] & (torch.arange(seq_k, device=device) <= slots[:, None])  # [B, Sq, Sk]
    packed = False
    if attention_mask is None and position_ids is not None and position_ids.dim() <= 2 and not cached:
        starts = position_ids.to(device).expand(batch, seq_q) == 0
        starts[:, 0] = True
        sequence = starts.cumsum(-1)  # [B, S]: which packed sequence each token is in
        packed = bool((sequence[:, -1] > 1).any())
        visible = visible & (sequence[:, :, None] == sequence[:, None, :])
    plain = written == seq_k and (seq_q == 1 or seq_q == seq_k) and bool(torch.equal(slots, last))
    if attention_mask is None and not packed and plain:
        return None
    return visible[:, None]


def _prefix_shared_forward(
    module, query: Tensor, key: Tensor, value: Tensor, layout, scaling: float | None, dropout: float, kwargs
):
    """The ``"rlk"`` attention over a :class:`~rlk.integrations.hf.groups.PrefixLayout` row (GRPO groups whose
    responses read their prompt's keys once): :func:`rlk.prefix_attention`. Refuses what it cannot honour (there is
    no stock fallback for a shared prefix)."""
    batch, heads, seq, head_dim = query.shape
    if batch != 1 or key.shape[2] != seq or seq != layout.total:
        raise ValueError(
            f"{LAYOUT_KEYWORD}: the layout packs {layout.total} tokens in one row, the attention got "
            f"queries {tuple(query.shape)} and keys {tuple(key.shape)} (a KV cache, or other inputs?)"
        )
    why = _unsupported(module, query, key, value, dropout, kwargs)
    if why is None and not getattr(module, "is_causal", True):
        why = "non-causal attention"
    backend = None
    if why is None:
        backend = _invariant_backend("prefix_attention", query.device, query.dtype, head_dim=head_dim)
        if backend is None:
            why = f"no batch-invariant prefix_attention for {query.dtype} on {query.device.type} (head dim {head_dim})"
    if why is not None:
        raise ValueError(f"{LAYOUT_KEYWORD}: prefix-shared attention does not support {why}")
    from rlk.ops.attention import prefix_attention

    q = query.transpose(1, 2).reshape(seq, heads, head_dim)
    k = key.transpose(1, 2).reshape(seq, key.shape[1], head_dim)
    v = value.transpose(1, 2).reshape(seq, key.shape[1], head_dim)
    scale = float(scaling) if scaling is not None else 1.0 / math.sqrt(head_dim)
    with dispatch.use_backend(backend.name), checks.trusted_values():  # the layout was built from token lists
        out = prefix_attention(
            q,
            k,
            v,
            cu_seqlens_q=layout.cu_seqlens,
            cu_seqlens_k=layout.cu_seqlens,
            max_seqlen_q=layout.max_seqlen,
            max_seqlen_k=layout.max_seqlen,
            prefix_index=layout.prefix_index,
            causal=True,
            softmax_scale=scale,
        )
    return out.view(1, seq, heads, head_dim), None


# ---------------------------------------------------------------------------
# patch / unpatch
# ---------------------------------------------------------------------------


def _register_attention() -> None:
    """Register ``"rlk"`` as an attention function, and with the mask builder it needs.

    transformers (>= 4.53) builds the ``attention_mask`` an attention function receives from the
    mask builder registered under the same name in ``AttentionMaskInterface``; a name without one
    gets ``None``, which would make every left-padded decode step and prefill chunk attend to the
    pad keys. rlk wants what flash attention wants: the 2-D boolean padding mask ``[B, past + S]``,
    or None when nothing is padded (packed rows are then split by ``position_ids``).
    """
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, rlk_attention_forward)
    try:
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError:  # transformers < 4.53 passes the 2-D mask through unchanged
        return
    AttentionMaskInterface.register(ATTENTION_NAME, padding_mask)


def padding_mask(*, kv_length: int, attention_mask: Tensor | None = None, **kwargs) -> Tensor | None:
    """The mask builder of the ``"rlk"`` attention (``transformers.masking_utils.AttentionMaskInterface``): the 2-D
    padding mask's last ``kv_length`` columns, or None when it has exactly ``kv_length`` columns and no padding
    (packed rows are then split by ``position_ids``).

    transformers' flash-attention builder does the same, except that 4.x also drops an all-ones mask narrower than
    the keys (a static cache's, whose unwritten slots must stay masked) and that it reads the mask on the host even
    while a CUDA graph is captured; here a captured forward keeps the mask as it is.

    Where rlk's attention will not run for these masks (:func:`_rlk_reads_the_mask`: no batch-invariant attention for
    the forward's device and dtype, or a sliding / chunked window), it returns what transformers' SDPA mask builder
    returns for the same arguments: the stock SDPA attention the ``"rlk"`` function then falls back to gets the
    stock mask."""
    if not _rlk_reads_the_mask(attention_mask, kwargs):
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        return ALL_MASK_ATTENTION_FUNCTIONS["sdpa"](kv_length=kv_length, attention_mask=attention_mask, **kwargs)
    if attention_mask is None:
        return None
    attention_mask = attention_mask[:, -kv_length:]
    if attention_mask.shape[1] != kv_length or _capturing(attention_mask.device):
        return attention_mask
    return None if bool(attention_mask.all()) else attention_mask


def _rlk_reads_the_mask(attention_mask: Tensor | None, kwargs) -> bool:
    """Whether the ``"rlk"`` attention will run rlk's kernels on the mask a builder call makes: no window
    (``local_size``: sliding or chunked layers) and a batch-invariant attention backend for the forward's device and
    dtype at the config's head dim. The builder's arguments (transformers 4.57 and 5.x): ``dtype`` (of the input
    embeddings), ``device`` (5.x) or ``cache_position`` (4.57), ``config``, ``local_size`` for windowed layers."""
    if kwargs.get("local_size") is not None:
        return False
    dtype, config = kwargs.get("dtype"), kwargs.get("config")
    cache_position = kwargs.get("cache_position")
    device = kwargs.get("device")
    if device is None:
        device = cache_position.device if cache_position is not None else getattr(attention_mask, "device", None)
    if not isinstance(dtype, torch.dtype) or device is None:
        return True  # nothing to decide on: the attention function decides per call
    head_dim = getattr(config, "head_dim", None)
    if head_dim is None and getattr(config, "num_attention_heads", None):
        head_dim = config.hidden_size // config.num_attention_heads
    features = {} if head_dim is None else {"head_dim": int(head_dim)}
    return _invariant_backend("attention", torch.device(device), dtype, **features) is not None


def _capturing(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _own_configs(model) -> None:
    """Give every module of ``model`` that holds a transformers config a copy of it (one copy per config object,
    sub-configs included: a VLM's language model keeps holding its config's ``text_config``), so that switching the
    attention implementation changes no config object another model was built from."""
    from transformers import PretrainedConfig

    copies: dict[int, object] = {}  # deepcopy's memo: an object copied once, its copy reused
    for module in model.modules():
        config = module.__dict__.get("config")
        if isinstance(config, PretrainedConfig):
            module.config = copy.deepcopy(config, copies)


def _set_attention(model, name: str) -> None:
    setter = getattr(model, "set_attn_implementation", None)
    if setter is not None:
        try:
            setter(name)
            return
        except (ValueError, TypeError, KeyError):
            pass
    configs = {id(m.config): m.config for m in model.modules() if hasattr(m, "config")}
    for config in configs.values():
        config._attn_implementation = name


def patch_model(model):
    """Make a transformers causal LM batch-invariant where the aten overrides cannot reach; returns ``model``.

    Replaces the RMSNorm modules' ``forward`` and switches attention to rlk's varlen kernels (the
    ``"rlk"`` attention function; see the module docstring), and registers on each attention module forward hooks
    that record its ``cache_position`` and KV cache for the duration of its forward. Idempotent: patching a patched
    model does nothing. :func:`unpatch_model` restores the stock behaviour exactly. Use together with
    ``rlk.batch_invariant()`` for the matmuls and softmaxes. The model gets copies of its config objects before its
    attention is switched (``model.config`` is a copy afterwards): a config object shared with another model is left
    as it was.

    Vision-language models (Qwen2-VL) are accepted: the attention of every sub-config is switched, so the vision
    tower's per-image (non-causal) attention runs on rlk too; its patch embedding and LayerNorm are served by the
    ``convolution`` / ``native_layer_norm`` overrides of ``rlk.batch_invariant()`` (``docs/multimodal.md``).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module (a transformers causal LM), got {type(model).__name__}")
    if getattr(model, "_rlk_patch", None) is not None:
        return model
    _register_attention()
    config = getattr(model, "config", None)
    previous = getattr(config, "_attn_implementation", None)
    norms = []
    for module in model.modules():
        if _is_rms_norm(module) and "forward" not in module.__dict__:
            module.forward = types.MethodType(_rms_norm_forward, module)
            norms.append(module)
    hooks = []
    for module in model.modules():
        if _is_attention_module(module):
            hooks.append(module.register_forward_pre_hook(_record_cache_call, with_kwargs=True))
            hooks.append(module.register_forward_hook(_forget_cache_call, always_call=True))
    if config is not None:
        _own_configs(model)
        _set_attention(model, ATTENTION_NAME)
    model._rlk_patch = {"norms": norms, "attention": previous, "hooks": hooks}
    return model


def unpatch_model(model):
    """Undo :func:`patch_model` (a no-op on a model that is not patched); returns ``model``."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module (a transformers causal LM), got {type(model).__name__}")
    state = getattr(model, "_rlk_patch", None)
    if state is None:
        return model
    for module in state["norms"]:
        module.__dict__.pop("forward", None)
    for hook in state["hooks"]:
        hook.remove()
    for module in model.modules():
        module.__dict__.pop("_rlk_cache_call", None)
    if state["attention"] is not None:
        _set_attention(model, state["attention"])
    del model._rlk_patch
    return model
