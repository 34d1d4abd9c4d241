"""Layer specs that build a megatron-core ``GPTModel`` on rlk's modules, and :func:`gpt_model` that uses them.

The spec is megatron-core's local GPT layer (``TransformerLayer`` with ``SelfAttention`` and a gated ``MLP``) with
every compute module swapped for :mod:`rlk.integrations.megatron.layers`: ``linear_qkv`` / ``linear_fc1`` column-
parallel and ``linear_proj`` / ``linear_fc2`` row-parallel through :mod:`rlk.distributed`, the norms (input, pre-MLP,
q / k, final) through ``rlk.rms_norm``, ``core_attention`` through ``rlk.attention`` with the rotary embedding
applied inside it (the model is built with ``position_embedding_type="none"``).
"""

from __future__ import annotations

import functools

from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.identity_op import IdentityOp
from megatron.core.transformer.mlp import MLP, MLPSubmodules
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

from rlk.integrations.megatron.layers import (
    ColumnParallelLinear,
    CoreAttention,
    GatedColumnParallelLinear,
    RMSNorm,
    RowParallelLinear,
)


def layer_spec(*, rope_theta: float, qk_layernorm: bool = True, gated: bool = True) -> ModuleSpec:
    """A ``TransformerLayer`` spec on rlk's modules (Llama: ``qk_layernorm=False``; Qwen3: True). ``gated``: the
    config's ``gated_linear_unit`` (SwiGLU: ``linear_fc1`` holds gate and up)."""
    attention = ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=functools.partial(CoreAttention, rope_theta=rope_theta),
            linear_proj=RowParallelLinear,
            q_layernorm=RMSNorm if qk_layernorm else IdentityOp,
            k_layernorm=RMSNorm if qk_layernorm else IdentityOp,
        ),
    )
    mlp = ModuleSpec(
        module=MLP,
        submodules=MLPSubmodules(
            linear_fc1=GatedColumnParallelLinear if gated else ColumnParallelLinear, linear_fc2=RowParallelLinear
        ),
    )
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=RMSNorm,
            self_attention=attention,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=RMSNorm,
            mlp=mlp,
            mlp_bda=get_bias_dropout_add,
        ),
    )


def block_spec(config, *, rope_theta: float, qk_layernorm: bool = True) -> TransformerBlockSubmodules:
    """``config.num_layers`` layers of :func:`layer_spec` and rlk's RMSNorm as the final norm (no pipeline
    parallelism: the block holds every layer)."""
    check_config(config)
    layer = layer_spec(rope_theta=rope_theta, qk_layernorm=qk_layernorm, gated=config.gated_linear_unit)
    return TransformerBlockSubmodules(layer_specs=[layer] * config.num_layers, layer_norm=RMSNorm)


def check_config(config) -> None:
    """Refuse the ``TransformerConfig`` settings rlk's Megatron chain does not reproduce, naming the option."""
    wrong = []
    if config.normalization != "RMSNorm":
        wrong.append(f"normalization={config.normalization!r} (needs 'RMSNorm')")
    if config.sequence_parallel:
        wrong.append("sequence_parallel=True (not supported)")
    if config.context_parallel_size != 1:
        wrong.append(f"context_parallel_size={config.context_parallel_size} (needs 1)")
    if config.pipeline_model_parallel_size != 1:
        wrong.append(f"pipeline_model_parallel_size={config.pipeline_model_parallel_size} (needs 1)")
    if config.num_moe_experts:
        wrong.append(f"num_moe_experts={config.num_moe_experts} (dense MLPs only)")
    if config.hidden_dropout or config.attention_dropout:
        wrong.append(f"hidden_dropout={config.hidden_dropout}, attention_dropout={config.attention_dropout} (need 0)")
    if config.fp32_residual_connection:
        wrong.append("fp32_residual_connection=True (the rollout adds residuals in the activations' dtype)")
    if config.apply_rope_fusion or config.bias_activation_fusion or config.gradient_accumulation_fusion:
        wrong.append("apply_rope_fusion / bias_activation_fusion / gradient_accumulation_fusion (need False)")
    if wrong:
        raise ValueError("TransformerConfig: rlk's Megatron layers do not support " + "; ".join(wrong))


def gpt_model(
    config,
    *,
    vocab_size: int,
    max_sequence_length: int,
    rope_theta: float,
    qk_layernorm: bool = True,
    share_embeddings_and_output_weights: bool = False,
    **kwargs,
) -> GPTModel:
    """A megatron-core ``GPTModel`` on :func:`block_spec` (``position_embedding_type="none"``: the rotary embedding
    runs in rlk's attention). ``kwargs`` go to ``GPTModel`` (``pre_process`` / ``post_process``, ...)."""
    if kwargs.get("position_embedding_type", "none") != "none":
        raise ValueError("position_embedding_type: rlk's attention applies the rotary embedding; leave it 'none'")
    kwargs["position_embedding_type"] = "none"
    return GPTModel(
        config=config,
        transformer_layer_spec=block_spec(config, rope_theta=rope_theta, qk_layernorm=qk_layernorm),
        vocab_size=vocab_size,
        max_sequence_length=max_sequence_length,
        share_embeddings_and_output_weights=share_embeddings_and_output_weights,
        **kwargs,
    )


def use_rotary_table(model, inv_freq) -> int:
    """Give every rlk attention of ``model`` the rotary frequencies ``inv_freq [head_dim / 2]`` (e.g. the rollout
    model's ``model.model.rotary_emb.inv_freq``, so that both compute the same table whatever device or dtype it was
    built on); returns the number of attention modules set."""
    modules = [m for m in model.modules() if isinstance(m, CoreAttention)]
    for m in modules:
        m.set_inv_freq(inv_freq)
    return len(modules)
