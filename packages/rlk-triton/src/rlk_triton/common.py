"""Helpers every Triton op family of rlk shares: the launch device, the dot product and tile scheduling."""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl


def on_device(device: torch.device):
    """Launch on ``device``'s GPU (a no-op for CPU tensors under the interpreter)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@triton.jit
def grouped_tile(pid, n_row_tiles, n_col_tiles, GROUP: tl.constexpr):
    """Map a linear program id to (row tile, column tile), ``GROUP`` row tiles varying fastest.

    Programs launched together then cover a ``GROUP x k`` block of tiles and share the
    operand tiles in L2. Pure scheduling: no effect on any value.
    """
    per_group = GROUP * n_col_tiles
    first_row_tile = (pid // per_group) * GROUP
    group_rows = tl.minimum(n_row_tiles - first_row_tile, GROUP)
    local = pid % per_group
    return first_row_tile + local % group_rows, local // group_rows


@triton.jit
def dot(a, b, acc, IEEE: tl.constexpr):
    """``acc + a @ b`` with fp32 accumulation; IEEE fp32 products for fp32 inputs (no TF32)."""
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc
