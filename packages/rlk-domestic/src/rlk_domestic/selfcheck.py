"""The device-side check of what the blocks' invariance rests on: inside a block of fixed shape, a row's bits do
not depend on its position (row alignment, the tiling of a library reduction or matmul). Run by
``rlk info --selfcheck`` on the device."""

from __future__ import annotations

import torch

from rlk_domestic import logprob, matmul, norm, softmax
from rlk_domestic.blocks import ROWS


def _rows_agree(name: str, fn, x: torch.Tensor) -> list[str]:
    """``fn(rows) -> [n, ...]`` gives row 0's bits alone and at every position of a block of :data:`ROWS` rows."""
    alone = fn(x[:1])[0]
    for position in range(ROWS):
        rows = torch.cat([x[1 : position + 1], x[:1], x[position + 1 : ROWS]])
        if not torch.equal(fn(rows)[position], alone):
            return [f"{name}: a row's bits change at position {position} of a block"]
    return []


def positions_agree(device: torch.device, sizes: tuple[int, int] = (1003, 517)) -> list[str]:
    """One line per primitive and dtype whose row bits change with the row's position in a block; ``sizes``: the
    row length and the matmul's output width."""
    cols, width = sizes
    g = torch.Generator().manual_seed(0)
    problems = []
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(ROWS, cols, generator=g).to(device, dtype)
        w = (torch.randn(cols, width, generator=g) / 30).to(device, dtype)

        def mm(rows, w=w):
            out = torch.empty(rows.shape[0], w.shape[1], dtype=rows.dtype, device=device)
            matmul.matmul_fwd(rows, w, None, out)
            return out

        def sm(rows):
            out = torch.empty_like(rows)
            softmax.softmax_fwd(rows, True, out)
            return out

        def rms(rows, dtype=dtype):
            out, rstd = torch.empty_like(rows), torch.empty(rows.shape[0], device=device)
            norm.rms_norm_fwd(
                rows, torch.ones(rows.shape[1], dtype=dtype, device=device), None, 1e-6, False, out, None, rstd
            )
            return out

        def lp(rows):
            n = rows.shape[0]
            out = torch.empty(3, n, device=device)
            targets = torch.zeros(n, dtype=torch.int64, device=device)
            logprob.selected_logprob_fwd(rows, targets, torch.ones(n, device=device), -100, out[0], out[1], out[2])
            return out.T

        for name, fn in (("matmul_fwd", mm), ("softmax_fwd", sm), ("rms_norm_fwd", rms), ("selected_logprob_fwd", lp)):
            problems += [f"{p} ({str(dtype).removeprefix('torch.')})" for p in _rows_agree(name, fn, x)]
    return problems
