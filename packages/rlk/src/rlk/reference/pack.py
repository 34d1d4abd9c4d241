"""Reference pack / unpack primitives: the readable specification.

A padded batch ``x[B, T, *trailing]`` seen as ``N = B * T`` rows of ``F`` elements (``F`` the product
of the trailing dims) and its packed varlen form ``packed[M, F]`` (``M`` = the number of valid tokens)
are related by one map, ``slot[N]`` int64, that the op layer computes from the attention mask::

    slot[n] = (number of valid tokens before n, in row-major order)   if token n is valid
              -1                                                      otherwise

Valid tokens thus keep their order (within a row and across rows) and ``slot`` is a bijection of the
valid tokens onto ``[0, M)``.

* ``pack_fwd``:   ``out[slot[n]] = x[n]`` for every valid ``n`` (a bitwise copy);
* ``pack_bwd``:   ``out[n] = packed[slot[n]]`` if ``slot[n] >= 0`` else ``fill`` (cast to ``out.dtype``
  as ``torch.full`` casts it).

Each output element is written once from one input element: no sums, no atomics, deterministic, and a
token's value depends on that token alone. The gradient of each primitive is the other one (with
``fill = 0``).
"""

from __future__ import annotations

import torch


def pack_fwd(x: torch.Tensor, slot: torch.Tensor, out: torch.Tensor) -> None:
    """``out[slot[n]] = x[n]`` for ``slot[n] >= 0``.

    Args:
        x: ``[N, F]``, any dtype.
        slot: ``[N]`` int64, ``-1`` or the packed row of token ``n`` (a bijection onto ``[0, M)``).
        out: ``[M, F]`` ``x.dtype``, written.
    """
    valid = slot >= 0
    out[slot[valid]] = x[valid]


def pack_bwd(packed: torch.Tensor, slot: torch.Tensor, fill: float, out: torch.Tensor) -> None:
    """``out[n] = packed[slot[n]]`` for ``slot[n] >= 0``, else ``fill``.

    Args:
        packed: ``[M, F]``, any dtype.
        slot: ``[N]`` int64 (as in :func:`pack_fwd`).
        fill: the value of the invalid rows.
        out: ``[N, F]`` ``packed.dtype``, written.
    """
    out.fill_(fill)
    valid = slot >= 0
    out[valid] = packed[slot[valid]]
