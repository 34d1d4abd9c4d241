"""The tree-aligned shard kernels of the backend that serves an op (the backend ``rlk.<op>`` would run on).

The shard / combine entry points (``linear_logprob_shard_fwd``, ``matmul_shard_fwd``, ``*_combine*``,
``partial_dtype``) live in the backends' op-family modules next to the primitives, but they are not ABI
primitives yet, so they are found by module here. A backend without them is refused with its name: the
distributed op would not have the bits of the single-device op it serves.
"""

from __future__ import annotations

import importlib
from types import ModuleType

import torch

from rlk.core import dispatch

#: backend name -> package holding ``logprob`` and ``matmul`` modules with the shard kernels.
_PACKAGES = {"reference": "rlk.reference", "triton": "rlk_triton"}


def kernels(op: str, family: str, device: torch.device, dtype: torch.dtype) -> ModuleType:
    """The ``family`` module (``"logprob"``, ``"matmul"``) of the backend that runs ``op`` on this device and
    dtype now (``RLK_BACKEND`` / ``rlk.use_backend`` pins apply)."""
    decision = dispatch.decide(op, device, dtype)
    if decision.backend is None:
        raise dispatch.BackendError(str(decision))
    package = _PACKAGES.get(decision.backend)
    if package is None:
        raise dispatch.BackendError(
            f"rlk.distributed: {op} runs on backend '{decision.backend}' here, which has no tree-aligned shard "
            f"kernels (backends with them: {', '.join(_PACKAGES)}); pin one, e.g. rlk.use_backend('triton'), for "
            "the single-device and the distributed calls alike"
        )
    return importlib.import_module(f"{package}.{family}")
