"""Triton kernels of varlen packing: the padded rows ``[N, F]`` (``N = B * T``) to the packed rows ``[M, F]``
and back, by ``slot[N]`` (the packed row of each valid token, -1 at padding; computed once by the op layer from
the attention mask's prefix sums). The spec is :mod:`rlk.reference.pack`.

Both kernels run one program per (padded row, chunk of ``BLOCK`` trailing elements) and copy the chunk:

* ``pack_fwd``: a valid row ``n`` stores ``x[n]`` at ``out[slot[n]]``; padding rows do nothing;
* ``pack_bwd``: row ``n`` loads ``packed[slot[n]]`` (or takes ``fill``, a one-element tensor that torch cast to
  the output dtype) and stores it at ``out[n]``, so the padding is written in the same pass.

Every output element is written by exactly one program from one input element: no atomics, no arithmetic on
the values (bitwise copies of any dtype), deterministic, and a token's bits depend on that token alone. Offsets
are int64. No host synchronization.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlk_triton.common import on_device

#: Trailing elements per program (a power of two; fewer when the rows are shorter) and warps.
MAX_BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def _pack_kernel(x_ptr, slot_ptr, out_ptr, features, BLOCK: tl.constexpr):
    """``out[slot[n], chunk] = x[n, chunk]`` if ``slot[n] >= 0``, for ``n = program_id(0)``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    dest = tl.load(slot_ptr + row)
    valid = dest >= 0
    mask = (cols < features) & valid
    dest = tl.where(valid, dest, 0)
    values = tl.load(x_ptr + row * features + cols, mask=mask)
    tl.store(out_ptr + dest * features + cols, values, mask=mask)


@triton.jit
def _unpack_kernel(packed_ptr, slot_ptr, fill_ptr, out_ptr, features, BLOCK: tl.constexpr):
    """``out[n, chunk] = packed[slot[n], chunk]`` if ``slot[n] >= 0`` else ``fill``, for ``n = program_id(0)``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK).to(tl.int64)
    col_ok = cols < features
    src = tl.load(slot_ptr + row)
    valid = src >= 0
    src = tl.where(valid, src, 0)
    values = tl.load(packed_ptr + src * features + cols, mask=col_ok & valid)
    fill = tl.load(fill_ptr)
    tl.store(out_ptr + row * features + cols, tl.where(valid, values, fill), mask=col_ok)


def _block(features: int) -> int:
    return min(MAX_BLOCK, triton.next_power_of_2(max(features, 1)))


def pack_fwd(x: torch.Tensor, slot: torch.Tensor, out: torch.Tensor) -> None:
    """``out[slot[n]] = x[n]`` for ``slot[n] >= 0``: x ``[N, F]``, slot ``[N]`` int64, out ``[M, F]``.
    Spec: ``rlk.reference.pack.pack_fwd``."""
    rows, features = x.shape
    block = _block(features)
    with on_device(x.device):
        _pack_kernel[(rows, triton.cdiv(features, block))](x, slot, out, features, BLOCK=block, num_warps=NUM_WARPS)


def pack_bwd(packed: torch.Tensor, slot: torch.Tensor, fill: float, out: torch.Tensor) -> None:
    """``out[n] = packed[slot[n]]`` for ``slot[n] >= 0``, else ``fill``: packed ``[M, F]``, slot ``[N]`` int64,
    out ``[N, F]``. Spec: ``rlk.reference.pack.pack_bwd``."""
    rows, features = out.shape
    block = _block(features)
    fill_value = torch.full((1,), fill, dtype=out.dtype, device=out.device)
    with on_device(out.device):
        _unpack_kernel[(rows, triton.cdiv(features, block))](
            packed, slot, fill_value, out, features, BLOCK=block, num_warps=NUM_WARPS
        )
