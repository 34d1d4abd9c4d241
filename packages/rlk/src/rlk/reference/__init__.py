"""The reference backend: pure PyTorch, fp32/fp64 math, any torch device.

It is the readable specification of every ABI primitive and the ground truth
of the numerical contract. It is always present (built into ``rlk``), serves
every device type, and is the last link of every fallback chain.
"""

from __future__ import annotations

import torch

from rlk.core import abi
from rlk.core.backend import Backend
from rlk.core.version import __version__
from rlk.reference import (
    advantages,
    attention,
    distill,
    ema,
    embedding,
    logprob,
    losses,
    matmul,
    norm,
    pack,
    policy_loss,
    rewards,
    rollout_correction,
    rope,
    sampling,
    softmax,
)

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
_PACK_INT_DTYPES = (torch.int32, torch.int64)


def _supports(primitive: str, device: torch.device, dtype: torch.dtype) -> str | None:
    if primitive.startswith("pack_") and dtype in _PACK_INT_DTYPES:
        return None  # pack / unpack copy integer ids too
    if dtype not in _DTYPES:
        return f"dtype {dtype} is not a floating dtype the reference handles"
    return None


def backend() -> Backend:
    return Backend(
        name="reference",
        version=__version__,
        abi_version=abi.ABI_VERSION,
        primitives=abi.collect_primitives(
            advantages,
            attention,
            distill,
            ema,
            embedding,
            logprob,
            losses,
            matmul,
            norm,
            pack,
            policy_loss,
            rewards,
            rollout_correction,
            rope,
            sampling,
            softmax,
        ),
        probe=lambda: None,
        device_types=lambda: ("*",),
        supports=_supports,
        batch_invariant=False,
    )
