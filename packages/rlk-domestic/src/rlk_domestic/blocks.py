"""Fixed-shape blocks: the machinery every domestic primitive runs on.

A row-wise primitive runs once per block of ``ROWS`` rows on fresh contiguous buffers, the last block padded to
``ROWS`` with rows that contribute nothing: every row is computed by the same tensor ops on tensors of one shape,
strides and layout, whatever the batch. Sums over rows (weight gradients) add the blocks' partials, in the compute
dtype, in block order. Matmuls run on the same row blocks with ``K`` in ``K_CHUNK`` chunks added in order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from rlk.core.checks import compute_dtype

#: Rows per block of a row-wise primitive (every call of the spec sees exactly this many rows).
ROWS = 64
#: Elements per block of an elementwise primitive whose math includes transcendentals (a multiple of every SIMD
#: width, so no element lands in a vector loop's scalar tail).
ELEMENTS = 4096
#: ``K`` chunk of the matmuls: partial products of this depth, added in order.
K_CHUNK = 256


@dataclass(frozen=True)
class Rows:
    """A per-row input (rows along ``dim``), padded with ``fill`` (a value whose rows contribute nothing)."""

    tensor: torch.Tensor | None
    fill: float | int | bool = 0
    dim: int = 0


@dataclass(frozen=True)
class Out:
    """A per-row output (rows along ``dim``): each block writes a fresh buffer, its real rows are copied back."""

    tensor: torch.Tensor | None
    dim: int = 0


@dataclass(frozen=True)
class Total:
    """An output summed over rows (a weight gradient): each block writes its partial into a fresh buffer of
    ``dtype``; the partials are added in block order and written once (added to the output with ``accumulate``)."""

    tensor: torch.Tensor | None
    dtype: torch.dtype | None = None
    accumulate: bool = False


def padded(t: torch.Tensor, r0: int, r1: int, rows: int, fill=0, dim: int = 0) -> torch.Tensor:
    """Rows ``[r0, r1)`` of ``t`` (along ``dim``) in a fresh contiguous buffer of ``rows`` rows, the rest ``fill``."""
    shape = list(t.shape)
    shape[dim] = rows
    block = torch.full(shape, fill, dtype=t.dtype, device=t.device)
    block.narrow(dim, 0, r1 - r0).copy_(t.narrow(dim, r0, r1 - r0))
    return block


def _fresh(t: torch.Tensor, rows: int, dim: int) -> torch.Tensor:
    shape = list(t.shape)
    shape[dim] = rows
    return torch.empty(shape, dtype=t.dtype, device=t.device)


def run_rows(primitive: Callable[..., None], n: int, *args, rows: int = ROWS, **kwargs) -> None:
    """Call ``primitive`` once per block of ``rows`` of the ``n`` rows; :class:`Rows`, :class:`Out` and
    :class:`Total` arguments (positional or keyword) are cut into blocks, every other argument is passed as is."""
    totals: dict[int, torch.Tensor] = {}
    names = list(range(len(args))) + list(kwargs)
    values = list(args) + list(kwargs.values())
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        call, outs, parts = [], [], []
        for key, a in zip(names, values):
            if isinstance(a, Rows):
                call.append(None if a.tensor is None else padded(a.tensor, r0, r1, rows, a.fill, a.dim))
            elif isinstance(a, Out):
                buf = None if a.tensor is None else _fresh(a.tensor, rows, a.dim)
                call.append(buf)
                if buf is not None:
                    outs.append((a, buf))
            elif isinstance(a, Total):
                buf = (
                    None
                    if a.tensor is None
                    else torch.zeros(a.tensor.shape, dtype=a.dtype or a.tensor.dtype, device=a.tensor.device)
                )
                call.append(buf)
                if buf is not None:
                    parts.append((key, buf))
            else:
                call.append(a)
        primitive(*call[: len(args)], **dict(zip(list(kwargs), call[len(args) :])))
        for a, buf in outs:
            a.tensor.narrow(a.dim, r0, r1 - r0).copy_(buf.narrow(a.dim, 0, r1 - r0))
        for key, buf in parts:  # the partials in block order: one elementwise add per block
            totals[key] = buf if key not in totals else totals[key] + buf
    for key, a in zip(names, values):
        if isinstance(a, Total) and a.tensor is not None:
            if a.accumulate:
                a.tensor.add_(totals[key])
            else:
                a.tensor.copy_(totals[key])


def run_elements(primitive: Callable[..., None], n: int, *args, **kwargs) -> None:
    """:func:`run_rows` over blocks of :data:`ELEMENTS` elements of 1-D tensors."""
    run_rows(primitive, n, *args, rows=ELEMENTS, **kwargs)


def ordered_sum(x: torch.Tensor, rows: int = ROWS) -> torch.Tensor:
    """``x.sum(0)`` as per-block sums of ``rows`` rows (the last block padded with zeros) added in block order."""
    total = None
    for r0 in range(0, x.shape[0], rows):
        part = padded(x, r0, min(x.shape[0], r0 + rows), rows).sum(0)
        total = part if total is None else total + part
    return total


def matmul_rows(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """``out = a @ b (+ bias)``: :data:`ROWS` rows of ``a`` at a time (padded), the ``K`` sum as
    :data:`K_CHUNK`-deep partial products in the compute dtype added in order, one rounding to ``out.dtype``."""
    m, k = a.shape
    cdt = compute_dtype(a.dtype)
    chunks = [(k0, min(k, k0 + K_CHUNK)) for k0 in range(0, k, K_CHUNK)]
    b_chunks = [b[k0:k1].to(cdt, copy=True) for k0, k1 in chunks]  # fresh copies: one layout whatever b's strides
    bias_c = None if bias is None else bias.to(cdt)
    for r0 in range(0, m, ROWS):
        r1 = min(m, r0 + ROWS)
        block = padded(a, r0, r1, ROWS).to(cdt)
        acc = None
        for (k0, k1), bk in zip(chunks, b_chunks):
            part = block[:, k0:k1].contiguous() @ bk
            acc = part if acc is None else acc + part
        if bias_c is not None:
            acc = acc + bias_c
        out[r0:r1] = acc[: r1 - r0]


def sum_over_rows(a: torch.Tensor, g: torch.Tensor, out: torch.Tensor) -> None:
    """``out = a.T @ g`` (a sum over the rows of ``a`` ``[M, K]`` and ``g`` ``[M, N]``): per block of :data:`ROWS`
    rows a partial ``[K, N]`` in the compute dtype, the partials added in block order, one rounding."""
    cdt = compute_dtype(a.dtype)
    total = None
    for r0 in range(0, a.shape[0], ROWS):
        r1 = min(a.shape[0], r0 + ROWS)
        part = padded(a, r0, r1, ROWS).to(cdt).T @ padded(g, r0, r1, ROWS).to(cdt)
        total = part if total is None else total + part
    out.copy_(total)


def sequences(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    """``(start, end)`` of every sequence of a ``cu_seqlens`` tensor, as Python ints."""
    cu = cu_seqlens.tolist()
    return [(cu[b], cu[b + 1]) for b in range(len(cu) - 1)]
