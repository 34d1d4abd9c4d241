"""megatron-core integration: a ``GPTModel`` running rlk's chain, bitwise the same at any tensor-parallel degree
and bitwise the Hugging Face rollout path with the same weights (``docs/megatron.md``).

* :func:`gpt_model` / :func:`block_spec` / :func:`layer_spec`: megatron-core's local GPT layer with rlk's modules
  (:mod:`~rlk.integrations.megatron.layers`) in every compute slot;
* :func:`logprobs` / :func:`policy_loss` / :func:`last_hidden_state`: the vocab-parallel head without logits;
* :func:`hf_to_megatron` / :func:`megatron_to_hf` / :func:`checksum`: Llama / Qwen weights, per rank.

Written and tested for megatron-core 0.16.1 (imported with this module: ``pip install 'rlk[megatron]'``).
"""

from __future__ import annotations

from rlk.integrations import extras

extras.require("megatron.core", needed_by="rlk.integrations.megatron")

from rlk.integrations.megatron.convert import Layout, checksum, hf_to_megatron, megatron_to_hf  # noqa: E402
from rlk.integrations.megatron.head import (  # noqa: E402
    head_weight,
    last_hidden_state,
    logprobs,
    policy_loss,
    tp_group,
)
from rlk.integrations.megatron.layers import (  # noqa: E402
    ColumnParallelLinear,
    CoreAttention,
    GatedColumnParallelLinear,
    RMSNorm,
    RowParallelLinear,
)
from rlk.integrations.megatron.spec import (  # noqa: E402
    block_spec,
    check_config,
    gpt_model,
    layer_spec,
    use_rotary_table,
)

__all__ = [
    "ColumnParallelLinear",
    "CoreAttention",
    "GatedColumnParallelLinear",
    "Layout",
    "RMSNorm",
    "RowParallelLinear",
    "block_spec",
    "check_config",
    "checksum",
    "gpt_model",
    "head_weight",
    "hf_to_megatron",
    "last_hidden_state",
    "layer_spec",
    "logprobs",
    "megatron_to_hf",
    "policy_loss",
    "tp_group",
    "use_rotary_table",
]
