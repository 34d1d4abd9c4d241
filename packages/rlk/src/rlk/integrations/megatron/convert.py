"""Weights between a Hugging Face Llama / Qwen2 / Qwen3 causal LM and the megatron-core ``GPTModel`` of
:func:`rlk.integrations.megatron.gpt_model`, sharded for one tensor-parallel rank, and back; :func:`checksum` to
check a round trip. Pure tensor moves (no arithmetic): the converted weights hold the same bits.

Megatron's layout, per layer: ``linear_qkv`` rows grouped by query group (``q`` heads of group ``g``, then its
``k`` and ``v`` head), rank ``r`` holding groups ``[r G / P, (r + 1) G / P)``; ``linear_fc1`` rank ``r`` holding
``[gate_r; up_r]`` (its slices of gate and up stacked); ``linear_proj`` / ``linear_fc2`` split by input columns;
the embedding and the output layer by vocabulary rows; norms replicated.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Layout:
    """The shapes the conversion needs (from a transformers config: :meth:`from_hf_config`)."""

    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tied: bool = False

    @classmethod
    def from_hf_config(cls, config) -> Layout:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(
            num_layers=config.num_hidden_layers,
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            tied=bool(getattr(config, "tie_word_embeddings", False)),
        )


# HF name (after "model.layers.{i}.") -> Megatron name (after "decoder.layers.{i}."), for the one-to-one weights
_LAYER_DIRECT = {
    "input_layernorm.weight": ("input_layernorm.weight", None),
    "self_attn.q_norm.weight": ("self_attention.q_layernorm.weight", None),
    "self_attn.k_norm.weight": ("self_attention.k_layernorm.weight", None),
    "self_attn.o_proj.weight": ("self_attention.linear_proj.weight", 1),
    "post_attention_layernorm.weight": ("pre_mlp_layernorm.weight", None),
    "mlp.down_proj.weight": ("mlp.linear_fc2.weight", 1),
}
_TOP_DIRECT = {
    "model.embed_tokens.weight": ("embedding.word_embeddings.weight", 0),
    "model.norm.weight": ("decoder.final_layernorm.weight", None),
    "lm_head.weight": ("output_layer.weight", 0),
}


def _check_rank(layout: Layout, tp_size: int, tp_rank: int) -> None:
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank / tp_size: expected 0 <= tp_rank < tp_size, got {tp_rank} / {tp_size}")
    if layout.num_kv_heads % tp_size or layout.num_heads % layout.num_kv_heads:
        raise ValueError(
            f"tp_size: {tp_size} ranks must divide the {layout.num_kv_heads} kv heads (and those the "
            f"{layout.num_heads} query heads)"
        )


def _fuse_qkv(layout: Layout, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    g, d = layout.num_kv_heads, layout.head_dim
    per = layout.num_heads // g
    q = q.reshape(g, per * d, *q.shape[1:])
    k, v = k.reshape(g, d, *k.shape[1:]), v.reshape(g, d, *v.shape[1:])
    return torch.cat([q, k, v], dim=1).reshape(-1, *q.shape[2:])


def _split_qkv(layout: Layout, fused: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    g, d = layout.num_kv_heads, layout.head_dim
    per = layout.num_heads // g
    parts = fused.reshape(g, (per + 2) * d, *fused.shape[1:])
    q, k, v = parts.split([per * d, d, d], dim=1)
    return (t.reshape(-1, *fused.shape[1:]) for t in (q, k, v))


def _shard(x: Tensor, dim: int | None, tp_size: int, tp_rank: int) -> Tensor:
    if dim is None:
        return x.clone()
    if x.shape[dim] % tp_size:
        raise ValueError(f"a dim of {x.shape[dim]} cannot be split over {tp_size} ranks")
    return x.chunk(tp_size, dim=dim)[tp_rank].clone()


def hf_to_megatron(state: dict[str, Tensor], layout: Layout, *, tp_size: int = 1, tp_rank: int = 0) -> dict:
    """Rank ``tp_rank``'s Megatron state dict (``GPTModel.load_state_dict(..., strict=True)``) from a Hugging Face
    ``state_dict()`` (``lm_head.weight`` may be absent when the embeddings are tied)."""
    _check_rank(layout, tp_size, tp_rank)
    out = {}
    for hf, (mg, dim) in _TOP_DIRECT.items():
        if hf == "lm_head.weight" and (layout.tied or hf not in state):
            continue
        out[mg] = _shard(state[hf], dim, tp_size, tp_rank)
    for i in range(layout.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf, (mg, dim) in _LAYER_DIRECT.items():
            if src + hf in state:
                out[dst + mg] = _shard(state[src + hf], dim, tp_size, tp_rank)
        for kind in ("weight", "bias"):
            names = [f"{src}self_attn.{p}_proj.{kind}" for p in "qkv"]
            if names[0] in state:
                fused = _fuse_qkv(layout, *(state[n] for n in names))
                out[f"{dst}self_attention.linear_qkv.{kind}"] = _shard(fused, 0, tp_size, tp_rank)
        gate, up = state[src + "mlp.gate_proj.weight"], state[src + "mlp.up_proj.weight"]
        out[dst + "mlp.linear_fc1.weight"] = torch.cat(
            [_shard(gate, 0, tp_size, tp_rank), _shard(up, 0, tp_size, tp_rank)], dim=0
        )
    return out


def megatron_to_hf(shards: list[dict[str, Tensor]], layout: Layout) -> dict[str, Tensor]:
    """The Hugging Face state dict from every tensor-parallel rank's Megatron state dict (rank order); replicated
    weights are taken from rank 0 after checking that every rank holds the same bits."""
    tp_size = len(shards)
    _check_rank(layout, tp_size, 0)
    shards = [{k: v for k, v in s.items() if not k.endswith("_extra_state")} for s in shards]

    def joined(name: str, dim: int | None) -> Tensor:
        parts = [s[name] for s in shards]
        if dim is None:
            for r, p in enumerate(parts):
                if not torch.equal(p, parts[0]):
                    raise ValueError(f"{name}: rank {r} holds other bits than rank 0 (a replicated weight)")
            return parts[0].clone()
        return torch.cat(parts, dim=dim)

    out = {}
    for hf, (mg, dim) in _TOP_DIRECT.items():
        if mg in shards[0]:
            out[hf] = joined(mg, dim)
    for i in range(layout.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        for hf, (mg, dim) in _LAYER_DIRECT.items():
            if src + mg in shards[0]:
                out[dst + hf] = joined(src + mg, dim)
        for kind in ("weight", "bias"):
            name = f"{src}self_attention.linear_qkv.{kind}"
            if name in shards[0]:
                q, k, v = _split_qkv(layout, joined(name, 0))
                for p, t in zip("qkv", (q, k, v)):
                    out[f"{dst}self_attn.{p}_proj.{kind}"] = t.contiguous()
        fc1 = [s[src + "mlp.linear_fc1.weight"] for s in shards]
        gates, ups = zip(*(t.chunk(2, dim=0) for t in fc1))
        out[dst + "mlp.gate_proj.weight"] = torch.cat(gates, dim=0)
        out[dst + "mlp.up_proj.weight"] = torch.cat(ups, dim=0)
    return out


def checksum(state: dict[str, Tensor]) -> str:
    """SHA-256 of a state dict: every tensor's name, dtype, shape and bytes, in name order (``_extra_state``
    entries skipped)."""
    digest = hashlib.sha256()
    for name in sorted(state):
        if name.endswith("_extra_state"):
            continue
        t = state[name].detach().contiguous().cpu()
        digest.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        digest.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return digest.hexdigest()
