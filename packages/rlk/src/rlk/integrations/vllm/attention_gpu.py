"""The GPU variant of the plugin's attention: vLLM's ``FLASH_ATTN`` backend with rlk's paged attention.

WRITTEN, NOT RUN: vLLM's CUDA wheels do not reach rlk's GPU machine (see ``docs/vllm.md``). The cache layout is
flash attention's (``kv_cache [num_blocks, Hkv, block_size, 2 D]`` viewed ``[num_blocks, block_size, Hkv, D]``
per half); the writes and reads are :func:`rlk.integrations.vllm.attention.write_cache` /
:func:`~rlk.integrations.vllm.attention.paged_attention` with ``heads_first=False``. They read the metadata on
the host (``int(sum(seq_lens))``, the padding slots), so the engine must run eager (``enforce_eager=True``: CUDA
graphs would also bypass the aten overrides).
"""

from __future__ import annotations

from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl

from rlk.integrations.vllm.attention import check_served, paged_attention, write_cache
from rlk.integrations.vllm.ops import NotServed


def _split(kv_cache, head_size: int):
    return kv_cache.transpose(1, 2).split(head_size, dim=-1)  # [num_blocks, block_size, Hkv, D] each


class RlkFlashAttentionImpl(FlashAttentionImpl):
    """``FLASH_ATTN`` with rlk's cache writes and batch-invariant paged attention."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        check_served(self)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        if attn_metadata is None:
            return output.fill_(0)
        if any(x is not None for x in args) or any(v is not None for v in kwargs.values()):
            raise NotServed("rlk vLLM plugin: fused output quantization is not served")
        tokens = attn_metadata.num_actual_tokens
        key_cache, value_cache = _split(kv_cache, self.head_size)
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
            heads_first=False,
        )
        output[:tokens].view(out.shape).copy_(out)
        return output

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping):
        key_cache, value_cache = _split(kv_cache, self.head_size)
        write_cache(key, value, key_cache, value_cache, slot_mapping, heads_first=False)


class RlkFlashAttentionBackend(FlashAttentionBackend):
    """vLLM's ``FLASH_ATTN`` backend whose attention runs rlk's paged attention."""

    @staticmethod
    def get_impl_cls():
        return RlkFlashAttentionImpl
