"""rlk (RL-Kernel): fused, batch-invariant operators for RL training of LLMs.

Public API:

* ops: :func:`selected_logprob`, :func:`linear_logprob`, :func:`value_loss`, :func:`dpo_loss`,
  :func:`group_advantages`, :func:`masked_whiten`, :func:`discounted_returns`, :func:`gae`,
  :func:`policy_loss`, :func:`policy_loss_and_grad` (options: :class:`PolicyLossConfig`), :func:`kl_penalty`,
  :func:`fused_linear_policy_loss`,
  :func:`rollout_correction`, :func:`scatter_rewards` (sequence / region rewards and costs to token rewards or
  advantages: weighted reward columns, overlong penalty, group normalization), :func:`fused_linear_kl`
  (distillation: KL / JSD between a student and a teacher from their hidden states and LM heads); :func:`pack` /
  :func:`unpack` (padded batches to varlen rows with ``cu_seqlens`` and position ids, and back); :func:`ema_`
  (in-place exponential moving average of a list of tensors: reference / target model weights); :func:`sample`
  (batch-invariant fused token sampling:
  temperature, top-k, top-p, min-p, per-row seed / step);
* the batch-invariant forward chain: :func:`rms_norm`, :func:`matmul`, :func:`linear`,
  :func:`attention` (and :func:`prefix_attention`: sequences that share another's keys as a prefix, such as a
  GRPO group's responses and their prompt), :func:`softmax`, :func:`log_softmax`, :func:`apply_rope`,
  :func:`embedding`;
  :func:`batch_invariant` (with :func:`enable_batch_invariant`, :func:`disable_batch_invariant`,
  :func:`is_batch_invariant_enabled`) routes an unmodified model's aten ops to them, and
  :func:`patch_model` / :func:`unpatch_model` what the overrides cannot reach in a Hugging Face model.
  (Each function lives in the module of its op family under :mod:`rlk.ops`, e.g. ``rlk.ops.matmul``.)
* backends: :func:`explain`, :func:`use_backend`, :func:`info`, :class:`BackendError`,
  and :class:`Backend` for backend authors (entry-point group ``rlk.backends``);
* tensor-parallel reduction order of ``matmul`` / ``linear`` (for :mod:`rlk.distributed`, off by default):
  :func:`set_tensor_parallel_invariant`, :func:`tensor_parallel_invariant`, :func:`is_tensor_parallel_invariant`
  (or ``RLK_TENSOR_PARALLEL_INVARIANT=1``);
* profiling: :func:`set_profiler_ranges` (or ``RLK_NVTX=1``) names every primitive call in NVTX and
  ``torch.profiler`` timelines;
* the numerical contract: :mod:`rlk.core.contract`.
* multimodal RL batches (``rlk.multimodal``, :mod:`rlk.integrations.multimodal`): the span schema, synthetic
  fixtures, and the rollout-vs-training processor-layout checker (``rlk multimodal-parity``).

Layers (imports run downward only, ``tests/test_layers.py``): :mod:`rlk.core` (ABI, backends, dispatch, the op
declaration helper, checks, contract) < :mod:`rlk.reference` (the spec backend) < :mod:`rlk.ops` <
:mod:`rlk.distributed` < :mod:`rlk.integrations` < :mod:`rlk.app`.
"""

from __future__ import annotations

import sys

from rlk.app.info import info
from rlk.core.abi import ABI_VERSION
from rlk.core.backend import Backend
from rlk.core.custom_op import set_profiler_ranges
from rlk.core.dispatch import BackendError, explain, use_backend
from rlk.core.tensor_parallel import (
    is_tensor_parallel_invariant,
    set_tensor_parallel_invariant,
    tensor_parallel_invariant,
)
from rlk.core.version import __version__
from rlk.integrations import multimodal
from rlk.integrations.batch_invariant import (
    batch_invariant,
    disable_batch_invariant,
    enable_batch_invariant,
    is_batch_invariant_enabled,
)
from rlk.integrations.hf import patch_model, unpatch_model
from rlk.ops.advantages import discounted_returns, gae, group_advantages, masked_whiten
from rlk.ops.attention import attention, prefix_attention
from rlk.ops.distill import fused_linear_kl
from rlk.ops.ema import ema_
from rlk.ops.embedding import embedding
from rlk.ops.linear_policy_loss import fused_linear_policy_loss
from rlk.ops.logprob import linear_logprob, selected_logprob
from rlk.ops.losses import dpo_loss, value_loss
from rlk.ops.matmul import linear, matmul
from rlk.ops.norm import rms_norm
from rlk.ops.pack import pack, unpack
from rlk.ops.policy_loss import PolicyLossAndGrad, PolicyLossConfig, kl_penalty, policy_loss, policy_loss_and_grad
from rlk.ops.rewards import scatter_rewards
from rlk.ops.rollout_correction import rollout_correction
from rlk.ops.rope import apply_rope
from rlk.ops.sampling import sample
from rlk.ops.softmax import log_softmax, softmax

# ``import rlk.multimodal`` / ``from rlk.multimodal import ...``: the public name of rlk.integrations.multimodal
sys.modules.setdefault(f"{__name__}.multimodal", multimodal)

__all__ = [
    "ABI_VERSION",
    "Backend",
    "BackendError",
    "__version__",
    "apply_rope",
    "attention",
    "batch_invariant",
    "disable_batch_invariant",
    "discounted_returns",
    "dpo_loss",
    "ema_",
    "embedding",
    "enable_batch_invariant",
    "explain",
    "fused_linear_kl",
    "fused_linear_policy_loss",
    "gae",
    "group_advantages",
    "info",
    "is_batch_invariant_enabled",
    "is_tensor_parallel_invariant",
    "kl_penalty",
    "linear",
    "linear_logprob",
    "log_softmax",
    "masked_whiten",
    "pack",
    "matmul",
    "multimodal",
    "patch_model",
    "policy_loss",
    "policy_loss_and_grad",
    "prefix_attention",
    "sample",
    "scatter_rewards",
    "PolicyLossAndGrad",
    "PolicyLossConfig",
    "rms_norm",
    "rollout_correction",
    "selected_logprob",
    "set_profiler_ranges",
    "set_tensor_parallel_invariant",
    "softmax",
    "tensor_parallel_invariant",
    "unpack",
    "unpatch_model",
    "use_backend",
    "value_loss",
]
