"""rlk (RL-Kernel): fused, batch-invariant operators for RL training of LLMs.

Public API:

* ops: :func:`selected_logprob`, :func:`linear_logprob`;
* backends: :func:`explain`, :func:`use_backend`, :func:`info`, :class:`BackendError`,
  and :class:`Backend` for backend authors (entry-point group ``rlk.backends``);
* the numerical contract: :mod:`rlk.contract`.
"""

from __future__ import annotations

__version__ = "0.1.0"

from rlk.abi import ABI_VERSION
from rlk.backend import Backend
from rlk.dispatch import BackendError, explain, use_backend
from rlk.info import info
from rlk.logprob import linear_logprob, selected_logprob

__all__ = [
    "ABI_VERSION",
    "Backend",
    "BackendError",
    "__version__",
    "explain",
    "info",
    "linear_logprob",
    "selected_logprob",
    "use_backend",
]
