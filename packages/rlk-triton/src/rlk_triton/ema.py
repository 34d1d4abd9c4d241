"""Triton kernel of the in-place exponential moving average of a list of tensors (``rlk.ema_``).

The math is the spec in :mod:`rlk.reference.ema`: ``t <- lerp(t, s, w)``, ``w = fp32(1 - decay)``, in fp32
with torch's two-sided lerp formula (``t + w (s - t)`` for ``|w| < 0.5``, else ``s - (s - t)(1 - w)``), rounded
once to the target's dtype; ``decay = 1`` launches nothing and ``decay = 0`` copies the source's bits (``COPY``),
as the spec says. The multiply-add is one explicit ``tl.fma``, as torch's CUDA lerp compiles it (meant to
be bitwise equal to ``torch._foreach_lerp_`` on the GPU); the CPU interpreter evaluates it unfused, like the
reference.

One launch per call (the op layer hands this primitive one dtype at a time): every tensor is cut into blocks
of ``BLOCK`` elements and the grid is the list's total number of blocks. A small int64 table on the device (one
copy of ``4 (T + 1)`` integers per call, ``T`` tensors) holds, per tensor, its first block, the element offsets
of its target and source from the first target's and the first source's addresses, and its size. A program
finds its tensor by a binary search of the first blocks (``ceil(log2 T) + 1`` scalar loads), then updates its
block in place; full blocks take an unmasked path (vectorized loads when every address is 16-byte aligned, which
the host checks), the tensor's last block a masked one. Elementwise, no atomics: the bits of an element depend
only on its own values and ``decay``, not on the block size, the grid or the other tensors; no copy of the
weights is made. No host synchronization beyond the table's copy.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from rlk_triton.common import on_device

#: Elements per program and warps (fixed; nothing depends on them but speed).
BLOCK = 4096
NUM_WARPS = 8


@triton.jit
def _ema_kernel(
    t_base,
    s_base,
    table,
    n_tensors,
    stride,
    weight,
    SEARCH_STEPS: tl.constexpr,
    SMALL_WEIGHT: tl.constexpr,
    COPY: tl.constexpr,
    ALIGN: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """Program ``pid`` updates block ``pid - first_block[i]`` of tensor ``i`` (``first_block[i] <= pid``); with
    ``COPY`` (``decay = 0``) it copies the source's bits instead."""
    pid = tl.program_id(0).to(tl.int64)
    lo = pid * 0
    hi = lo + n_tensors  # first_block[lo] <= pid < first_block[hi] (first_block[n_tensors] = total blocks)
    for _ in tl.static_range(SEARCH_STEPS):
        mid = (lo + hi) // 2
        go = tl.load(table + mid) <= pid
        lo = tl.where(go, mid, lo)
        hi = tl.where(go, hi, mid)
    start = (pid - tl.load(table + lo)) * BLOCK
    t_off = tl.load(table + stride + lo)
    s_off = tl.load(table + 2 * stride + lo)
    numel = tl.load(table + 3 * stride + lo)
    if ALIGN > 1:
        t_off = tl.multiple_of(t_off, ALIGN)
        s_off = tl.multiple_of(s_off, ALIGN)
    offs = start + tl.arange(0, BLOCK).to(tl.int64)
    t_ptr = t_base + t_off + offs
    s_ptr = s_base + s_off + offs
    if COPY:
        tl.store(t_ptr, tl.load(s_ptr, mask=offs < numel), mask=offs < numel)
    elif start + BLOCK <= numel:
        t = tl.load(t_ptr).to(tl.float32)
        s = tl.load(s_ptr).to(tl.float32)
        d = s - t
        if SMALL_WEIGHT:
            out = tl.fma(d, weight, t)
        else:
            out = tl.fma(-d, 1.0 - weight, s)
        tl.store(t_ptr, out.to(t_base.dtype.element_ty))
    else:
        mask = offs < numel
        t = tl.load(t_ptr, mask=mask, other=0.0).to(tl.float32)
        s = tl.load(s_ptr, mask=mask, other=0.0).to(tl.float32)
        d = s - t
        if SMALL_WEIGHT:
            out = tl.fma(d, weight, t)
        else:
            out = tl.fma(-d, 1.0 - weight, s)
        tl.store(t_ptr, out.to(t_base.dtype.element_ty), mask=mask)


def launch_table(
    targets: list[torch.Tensor], sources: list[torch.Tensor], block: int = BLOCK
) -> tuple[list[list[int]], int, int]:
    """The kernel's table rows (first blocks with the total appended, target offsets, source offsets, sizes; each
    ``T + 1`` long), the total number of blocks and the alignment (in elements) every address shares."""
    size = targets[0].element_size()
    t0, s0 = targets[0].data_ptr(), sources[0].data_ptr()
    first, t_offs, s_offs, sizes = [], [], [], []
    blocks = 0
    aligned = t0 % 16 == 0 and s0 % 16 == 0
    for t, s in zip(targets, sources):
        dt, ds = t.data_ptr() - t0, s.data_ptr() - s0
        if dt % size or ds % size:  # cannot happen for tensors of one dtype; never compute a wrong address
            raise ValueError("ema_fwd: a tensor's address is not a multiple of its element size")
        aligned = aligned and dt % 16 == 0 and ds % 16 == 0
        first.append(blocks)
        t_offs.append(dt // size)
        s_offs.append(ds // size)
        sizes.append(t.numel())
        blocks += triton.cdiv(t.numel(), block)
    pad = [0]
    return [first + [blocks], t_offs + pad, s_offs + pad, sizes + pad], blocks, (16 // size if aligned else 1)


def ema_fwd(targets: list[torch.Tensor], sources: list[torch.Tensor], decay: float) -> None:
    """``targets[i] <- lerp(targets[i], sources[i], 1 - decay)`` in place, one launch (module docstring)."""
    if not targets or decay == 1.0:  # decay = 1: the targets keep their bits
        return
    device = targets[0].device
    rows, blocks, align = launch_table(targets, sources)
    table = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=False)
    n = len(targets)
    weight = float(torch.tensor(1.0 - decay, dtype=torch.float64).to(torch.float32))
    with on_device(device):
        _ema_kernel[(blocks,)](
            targets[0],
            sources[0],
            table,
            n,
            n + 1,
            weight,
            SEARCH_STEPS=max(1, (n - 1).bit_length()) + 1,
            SMALL_WEIGHT=abs(weight) < 0.5,
            COPY=decay == 0.0,
            ALIGN=align,
            BLOCK=BLOCK,
            num_warps=NUM_WARPS,
        )
