"""Argument checks shared by every public op: one wording of each error, one switch for value checks.

Shape and dtype checks are free (metadata only). *Value* checks (index ranges, ``cu_seqlens``
monotonicity...) need the tensor's contents and so a host synchronization; every op runs them
through :func:`values_checked`, which ``RLK_CHECK_VALUES=0`` turns off (for CUDA graph capture, or
once a pipeline is known to feed valid inputs).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

#: Floating dtypes the public ops accept (float64: reference-only ground-truth runs).
INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_float(name: str, x) -> None:
    """``x`` is a tensor of one of :data:`INPUT_DTYPES`; the error names the argument."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"{name}: expected dtype bfloat16, float16 or float32 (float64 for reference runs), "
                        f"got {x.dtype}")


def values_checked() -> bool:
    """Whether value checks (one host synchronization each) run: unless ``RLK_CHECK_VALUES=0``."""
    return os.environ.get("RLK_CHECK_VALUES", "1") != "0"
