"""The reference backend: pure PyTorch, fp32/fp64 math, any torch device.

It is the readable specification of every ABI primitive and the ground truth
of the numerical contract. It is always present (built into ``rlk``), serves
every device type, and is the last link of every fallback chain.
"""

from __future__ import annotations

import torch

from rlk import abi
from rlk.backend import Backend
from rlk.reference import advantages, logprob, losses, policy_loss

_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def _supports(primitive: str, device: torch.device, dtype: torch.dtype) -> str | None:
    if dtype not in _DTYPES:
        return f"dtype {dtype} is not a floating dtype the reference handles"
    return None


def backend() -> Backend:
    import rlk

    return Backend(
        name="reference",
        version=rlk.__version__,
        abi_version=abi.ABI_VERSION,
        primitives={
            "selected_logprob_fwd": logprob.selected_logprob_fwd,
            "selected_logprob_bwd": logprob.selected_logprob_bwd,
            "linear_logprob_fwd": logprob.linear_logprob_fwd,
            "linear_logprob_bwd": logprob.linear_logprob_bwd,
            "value_loss_fwd": losses.value_loss_fwd,
            "value_loss_bwd": losses.value_loss_bwd,
            "dpo_loss_fwd": losses.dpo_loss_fwd,
            "dpo_loss_bwd": losses.dpo_loss_bwd,
            "group_advantages_fwd": advantages.group_advantages_fwd,
            "masked_whiten_fwd": advantages.masked_whiten_fwd,
            "discounted_returns_fwd": advantages.discounted_returns_fwd,
            "gae_fwd": advantages.gae_fwd,
            "policy_loss_fwd": policy_loss.policy_loss_fwd,
            "policy_loss_bwd": policy_loss.policy_loss_bwd,
            "kl_penalty_fwd": policy_loss.kl_penalty_fwd,
            "kl_penalty_bwd": policy_loss.kl_penalty_bwd,
        },
        probe=lambda: None,
        device_types=lambda: ("*",),
        supports=_supports,
        batch_invariant=False,
    )
