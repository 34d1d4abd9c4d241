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

``import rlk`` imports none of this (nor torch): the first public name used loads them all (``_EXPORTS``), so
``import rlk`` and ``rlk --version`` are fast.

Layers (imports run downward only, ``tests/test_layers.py``): :mod:`rlk.core` (ABI, backends, dispatch, the op
declaration helper, checks, contract) < :mod:`rlk.reference` (the spec backend) < :mod:`rlk.ops` <
:mod:`rlk.distributed` < :mod:`rlk.integrations` < :mod:`rlk.app`.
"""

from __future__ import annotations

import importlib
import sys

from rlk.core.version import __version__

#: Each public name and the module that defines it; loaded together when the first one is used (PEP 562).
_EXPORTS = {
    "ABI_VERSION": "rlk.core.abi",
    "Backend": "rlk.core.backend",
    "BackendError": "rlk.core.dispatch",
    "PolicyLossAndGrad": "rlk.ops.policy_loss",
    "PolicyLossConfig": "rlk.ops.policy_loss",
    "apply_rope": "rlk.ops.rope",
    "attention": "rlk.ops.attention",
    "batch_invariant": "rlk.integrations.batch_invariant",
    "disable_batch_invariant": "rlk.integrations.batch_invariant",
    "discounted_returns": "rlk.ops.advantages",
    "dpo_loss": "rlk.ops.losses",
    "ema_": "rlk.ops.ema",
    "embedding": "rlk.ops.embedding",
    "enable_batch_invariant": "rlk.integrations.batch_invariant",
    "explain": "rlk.core.dispatch",
    "fused_linear_kl": "rlk.ops.distill",
    "fused_linear_policy_loss": "rlk.ops.linear_policy_loss",
    "gae": "rlk.ops.advantages",
    "group_advantages": "rlk.ops.advantages",
    "info": "rlk.app.info",
    "is_batch_invariant_enabled": "rlk.integrations.batch_invariant",
    "is_tensor_parallel_invariant": "rlk.core.tensor_parallel",
    "kl_penalty": "rlk.ops.policy_loss",
    "linear": "rlk.ops.matmul",
    "linear_logprob": "rlk.ops.logprob",
    "log_softmax": "rlk.ops.softmax",
    "masked_whiten": "rlk.ops.advantages",
    "matmul": "rlk.ops.matmul",
    "multimodal": "rlk.multimodal",  # a module: rlk.integrations.multimodal under its public name
    "pack": "rlk.ops.pack",
    "patch_model": "rlk.integrations.hf",
    "policy_loss": "rlk.ops.policy_loss",
    "policy_loss_and_grad": "rlk.ops.policy_loss",
    "prefix_attention": "rlk.ops.attention",
    "rms_norm": "rlk.ops.norm",
    "rollout_correction": "rlk.ops.rollout_correction",
    "sample": "rlk.ops.sampling",
    "scatter_rewards": "rlk.ops.rewards",
    "selected_logprob": "rlk.ops.logprob",
    "set_profiler_ranges": "rlk.core.custom_op",
    "set_tensor_parallel_invariant": "rlk.core.tensor_parallel",
    "softmax": "rlk.ops.softmax",
    "tensor_parallel_invariant": "rlk.core.tensor_parallel",
    "unpack": "rlk.ops.pack",
    "unpatch_model": "rlk.integrations.hf",
    "use_backend": "rlk.core.dispatch",
    "value_loss": "rlk.ops.losses",
}

__all__ = ["__version__", *_EXPORTS]


#: The layers (``rlk.ops.norm`` and the like, reachable as attributes once the facade is loaded).
_SUBPACKAGES = ("core", "reference", "ops", "distributed", "integrations", "app")


def __getattr__(name: str):
    if name not in _EXPORTS and name not in _SUBPACKAGES:
        raise AttributeError(f"module 'rlk' has no attribute {name!r}")
    # The first public name used loads the whole facade, as a non-lazy ``import rlk`` would: every module of
    # _EXPORTS (and what they import), so that the layers' modules are attributes too (``rlk.ops.norm``).
    for defining in dict.fromkeys(_EXPORTS.values()):
        importlib.import_module(defining)
    for public, defining in _EXPORTS.items():
        imported = sys.modules[defining]
        globals()[public] = imported if defining == f"{__name__}.{public}" else getattr(imported, public)
    return globals()[name] if name in _EXPORTS else importlib.import_module(f"{__name__}.{name}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
