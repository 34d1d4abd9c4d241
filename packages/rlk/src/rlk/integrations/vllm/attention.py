"""Attention over vLLM's paged KV cache by rlk's batch-invariant varlen attention (:func:`rlk.attention`).

One path for prefill, chunked prefill and decode: the keys and values of every request of the step are gathered
from the paged cache through the block table on the device (index arithmetic, no loop over requests), packed as
``[sum(seq_lens), Hkv, D]`` with ``cu_seqlens_k = cumsum(seq_lens)``, and the step's query tokens
(``query_start_loc``) attend to them with the bottom-right causal mask. rlk's attention reduces a query's keys
in fixed blocks from key 0 of its sequence, so a token's output is bitwise the same as in the trainer's packed
teacher-forced forward, whatever the step, the batch and the chunking.

:class:`RlkCPUAttentionBackend` is registered over vLLM's ``CPU_ATTN`` (its metadata builder is vLLM's; the cache
rows are written and read by rlk, unpacked). The GPU override over ``FLASH_ATTN`` lives in
:mod:`rlk.integrations.vllm.attention_gpu` (written, not run: vLLM does not reach rlk's GPU machine).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlk.core import checks, dispatch
from rlk.integrations.vllm.ops import NotServed, _invariant

#: The model classes whose forward the plugin reproduces op for op (transformers' Qwen3 and Llama, dense).
SERVED_ARCHITECTURES = ("Qwen3ForCausalLM", "LlamaForCausalLM")


def paged_layout(seq_lens: Tensor, block_table: Tensor, block_size: int) -> tuple[Tensor, Tensor, Tensor, int]:
    """Where each request's keys sit in a paged cache: ``(blocks, offsets, cu_seqlens_k, total)``.

    ``seq_lens`` int ``[B]`` (keys per request, the step's tokens included), ``block_table`` int ``[>= B,
    max_blocks]``. Key ``j`` of request ``b`` is in cache block ``block_table[b, j // block_size]`` at slot
    ``j % block_size``; ``blocks`` and ``offsets`` are int64 ``[total]`` in request order, ``cu_seqlens_k`` int32
    ``[B + 1]``, ``total = sum(seq_lens)`` (one host read)."""
    batch = seq_lens.shape[0]
    lens = seq_lens.to(torch.int64)
    cu = torch.zeros(batch + 1, dtype=torch.int64, device=seq_lens.device)
    torch.cumsum(lens, 0, out=cu[1:])
    total = int(cu[-1])
    request = torch.repeat_interleave(torch.arange(batch, device=seq_lens.device), lens, output_size=total)
    position = torch.arange(total, device=seq_lens.device) - cu[request]
    blocks = block_table[:batch].to(torch.int64)[request, position // block_size]
    return blocks, position % block_size, cu.to(torch.int32), total


def split_cache(kv_cache: Tensor) -> tuple[Tensor, Tensor]:
    """The key and value views ``[num_blocks, Hkv, block_size, D]`` of vLLM's CPU cache tensor ``[num_blocks, Hkv,
    block_size, 2 D]`` (per block and head: ``block_size`` key rows, then ``block_size`` value rows)."""
    num_blocks, kv_heads, block_size, _ = kv_cache.shape
    return kv_cache.view(num_blocks, kv_heads, 2 * block_size, -1).chunk(2, dim=2)


def write_cache(
    key: Tensor, value: Tensor, key_cache: Tensor, value_cache: Tensor, slot_mapping: Tensor, *, heads_first: bool
) -> None:
    """Store the step's ``key`` / ``value`` ``[T, Hkv, D]`` at cache slots ``slot_mapping [T']`` (``block *
    block_size + offset``, ``-1``: a padding token, skipped) as plain rows, the layout :func:`paged_attention` reads
    (vLLM's own CPU writer packs the rows for its kernels)."""
    slots = slot_mapping.to(torch.int64)
    tokens = slots.shape[0]
    rows = (slots >= 0).nonzero().squeeze(1)
    slots = slots[rows]
    block_size = key_cache.shape[2] if heads_first else key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k, v = key[:tokens][rows], value[:tokens][rows]
    if heads_first:
        key_cache[blocks, :, offsets] = k
        value_cache[blocks, :, offsets] = v
    else:
        key_cache[blocks, offsets] = k
        value_cache[blocks, offsets] = v


def paged_attention(
    query: Tensor,
    key_cache: Tensor,
    value_cache: Tensor,
    query_start_loc: Tensor,
    seq_lens: Tensor,
    block_table: Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    *,
    heads_first: bool,
) -> Tensor:
    """``out [Tq, Hq, D]`` of the step's queries ``query [Tq, Hq, D]`` (request ``b``: rows
    ``query_start_loc[b]:query_start_loc[b + 1]``, the last tokens of its ``seq_lens[b]`` keys) over the paged
    cache: ``key_cache`` / ``value_cache`` ``[num_blocks, Hkv, block_size, D]`` (``heads_first``, vLLM's CPU
    layout) or ``[num_blocks, block_size, Hkv, D]`` (the flash-attention layout). Causal, bottom-right aligned;
    ``softmax(scale * q k^T) v`` by :func:`rlk.attention` (fp32 accumulation, output in the query's dtype)."""
    from rlk.ops.attention import attention

    block_size = key_cache.shape[2] if heads_first else key_cache.shape[1]
    blocks, offsets, cu_k, _ = paged_layout(seq_lens, block_table, block_size)
    if heads_first:  # advanced indices around a slice: the gathered dim comes first, [total, Hkv, D]
        keys, values = key_cache[blocks, :, offsets], value_cache[blocks, :, offsets]
    else:
        keys, values = key_cache[blocks, offsets], value_cache[blocks, offsets]
    head_dim = query.shape[-1]
    with dispatch.use_backend(_invariant("attention", query, head_dim=head_dim)), checks.trusted_values():
        return attention(
            query,
            keys,
            values,
            cu_seqlens_q=query_start_loc.to(torch.int32),
            cu_seqlens_k=cu_k,
            max_seqlen_q=int(max_query_len),
            max_seqlen_k=int(max_seq_len),
            causal=True,
            softmax_scale=float(scale),
        )


def check_served(impl, dtype: torch.dtype | None = None) -> None:
    """Refuse (:class:`NotServed`) what the plugin does not reproduce: a model other than
    :data:`SERVED_ARCHITECTURES`, non-decoder attention, ALiBi, sliding windows, soft-capping, sinks, a quantized
    KV cache, KV sharing across layers."""
    from vllm.config import get_current_vllm_config

    config = get_current_vllm_config()
    architectures = list(getattr(config.model_config.hf_config, "architectures", None) or [])
    if not architectures or any(a not in SERVED_ARCHITECTURES for a in architectures):
        raise NotServed(
            f"rlk vLLM plugin: model architecture {architectures} is not served (served: "
            f"{', '.join(SERVED_ARCHITECTURES)}); unset RLK_VLLM to run it with vLLM's own kernels"
        )
    why = []
    if getattr(impl, "attn_type", "decoder") != "decoder":
        why.append(f"attention type {impl.attn_type}")
    if getattr(impl, "alibi_slopes", None) is not None:
        why.append("ALiBi")
    window = getattr(impl, "sliding_window", None)
    if window is not None and any(w != -1 for w in (window if isinstance(window, tuple) else (window,))):
        why.append("a sliding window")  # CPU: -1 for none; flash attention: (-1, -1)
    if getattr(impl, "logits_soft_cap", 0) not in (None, 0, 0.0):
        why.append("logit soft-capping")
    if getattr(impl, "sinks", None) is not None:
        why.append("attention sinks")
    if str(getattr(impl, "kv_cache_dtype", "auto")) != "auto":
        why.append(f"a {impl.kv_cache_dtype} KV cache")
    if getattr(impl, "kv_sharing_target_layer_name", None) is not None:
        why.append("KV sharing across layers")
    if why:
        raise NotServed(f"rlk vLLM plugin: attention with {', '.join(why)} is not served")


def _cpu_backend_classes():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend, CPUAttentionBackendImpl

    class RlkCPUAttentionImpl(CPUAttentionBackendImpl):
        """vLLM's CPU attention with the cache writes by :func:`write_cache` and the attention by
        :func:`paged_attention`."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            check_served(self)

        def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
            if attn_metadata is None:  # warm-up
                return output
            if any(x is not None for x in args) or any(v is not None for v in kwargs.values()):
                raise NotServed("rlk vLLM plugin: fused output quantization is not served")
            tokens = attn_metadata.num_actual_tokens
            key_cache, value_cache = split_cache(kv_cache)
            out = paged_attention(
                query[:tokens],
                key_cache,
                value_cache,
                attn_metadata.query_start_loc,
                attn_metadata.seq_lens,
                attn_metadata.block_table,
                attn_metadata.max_query_len,
                attn_metadata.max_seq_len,
                self.scale,
                heads_first=True,
            )
            output[:tokens].view(out.shape).copy_(out)
            return output

        def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
            key_cache, value_cache = split_cache(kv_cache)
            write_cache(key, value, key_cache, value_cache, slot_mapping, heads_first=True)

    class RlkCPUAttentionBackend(CPUAttentionBackend):
        """vLLM's ``CPU_ATTN`` backend whose attention runs :func:`paged_attention`."""

        @staticmethod
        def get_impl_cls():
            return RlkCPUAttentionImpl

    return RlkCPUAttentionBackend, RlkCPUAttentionImpl


def __getattr__(name: str):
    # The backend classes subclass vLLM's: built on first access, so that importing this module needs no vLLM.
    if name in ("RlkCPUAttentionBackend", "RlkCPUAttentionImpl"):
        backend, impl = _cpu_backend_classes()
        globals().update(RlkCPUAttentionBackend=backend, RlkCPUAttentionImpl=impl)
        return globals()[name]
    raise AttributeError(name)
