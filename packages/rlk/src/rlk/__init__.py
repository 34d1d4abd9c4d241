"""rlk (RL-Kernel): fused, batch-invariant operators for RL training of LLMs.

Public API:

* ops: :func:`selected_logprob`, :func:`linear_logprob`, :func:`value_loss`, :func:`dpo_loss`,
  :func:`group_advantages`, :func:`masked_whiten`, :func:`discounted_returns`, :func:`gae`,
  :func:`policy_loss`, :func:`kl_penalty`, :func:`fused_linear_policy_loss`;
* backends: :func:`explain`, :func:`use_backend`, :func:`info`, :class:`BackendError`,
  and :class:`Backend` for backend authors (entry-point group ``rlk.backends``);
* the numerical contract: :mod:`rlk.contract`.
"""

from __future__ import annotations

__version__ = "0.1.0"

from rlk.abi import ABI_VERSION
from rlk.advantages import discounted_returns, gae, group_advantages, masked_whiten
from rlk.backend import Backend
from rlk.dispatch import BackendError, explain, use_backend
from rlk.info import info
from rlk.linear_policy_loss import fused_linear_policy_loss
from rlk.logprob import linear_logprob, selected_logprob
from rlk.losses import dpo_loss, value_loss
from rlk.policy_loss import kl_penalty, policy_loss

__all__ = [
    "ABI_VERSION",
    "Backend",
    "BackendError",
    "__version__",
    "discounted_returns",
    "dpo_loss",
    "explain",
    "fused_linear_policy_loss",
    "gae",
    "group_advantages",
    "info",
    "kl_penalty",
    "linear_logprob",
    "masked_whiten",
    "policy_loss",
    "selected_logprob",
    "use_backend",
    "value_loss",
]
