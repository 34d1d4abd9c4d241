"""Hugging Face transformers integration.

* :func:`patch_model` / :func:`unpatch_model` (:mod:`rlk.hf.patch`): make an unmodified causal LM
  batch-invariant where the aten overrides of :func:`rlk.batch_invariant` cannot reach (RMSNorm, attention
  with padding masks).

transformers is imported only when a function here is called (optional dependency).
"""

from __future__ import annotations

from rlk.hf.patch import patch_model, unpatch_model

__all__ = ["patch_model", "unpatch_model"]
