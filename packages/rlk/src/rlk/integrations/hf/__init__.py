"""Hugging Face transformers integration.

* :func:`apply` / :func:`unapply` (:mod:`rlk.integrations.hf.training`): the training one-liner; ``model(...,
  logprob_targets=targets)`` then returns per-token log-probs (and entropy) through :func:`rlk.linear_logprob`,
  without the ``[N, V]`` logits; :func:`logprobs_from_hidden` scores tokens chosen outside a forward (a rollout's
  samples) with the same bits;
* :func:`patch_model` / :func:`unpatch_model` (:mod:`rlk.integrations.hf.patch`): make an unmodified causal LM
  batch-invariant where the aten overrides of :func:`rlk.batch_invariant` cannot reach (RMSNorm, attention
  with padding masks);
* :func:`group_logprobs` (:mod:`rlk.integrations.hf.groups`): a GRPO group's response log-probs with the prompt
  computed once (:func:`rlk.prefix_attention` in the patched attention), bitwise those of each sequence alone.

transformers is imported only when a function here is called (optional dependency).
"""

from __future__ import annotations

from rlk.integrations.hf.groups import group_batch, group_logprobs
from rlk.integrations.hf.patch import patch_model, unpatch_model
from rlk.integrations.hf.training import apply, logprobs_from_hidden, unapply

__all__ = ["apply", "group_batch", "group_logprobs", "logprobs_from_hidden", "patch_model", "unapply", "unpatch_model"]
