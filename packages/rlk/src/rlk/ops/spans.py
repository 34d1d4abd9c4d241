"""Span tables as op arguments: ``loss_spans`` of the log-prob ops and losses, and the regions of ``scatter_rewards``.

A span table is an integer ``[S, 4]`` tensor of rows ``(sequence, start, end, tag)`` (``rlk.multimodal``'s layout;
``[S, 3]`` without the tag) addressing the columns ``[start, end)`` of row ``sequence`` of a ``[B, T]`` batch. The
ops turn it into their mask on the tensors' device, by a difference array and a cumulative sum: no dense mask is
built on the host and nothing synchronizes but the optional value check. The mask of ``loss_spans`` is one custom op
(``rlk::span_mask``: its value check runs inside it, as every op's), so the ops trace under
``torch.compile(fullgraph=True)`` with spans too.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlk.core import checks, custom_op

_INDEX_DTYPES = (torch.int32, torch.int64)


def check_table(name: str, spans, device: torch.device, *, tagged: bool = False) -> Tensor:
    """``spans`` as int64 ``[S, 4]`` / ``[S, 3]`` (shape, dtype and device checked, errors name ``name``): on
    ``device`` or on the CPU (a host table: its mask is built there and copied over); ``tagged``: the tag column is
    required."""
    if not isinstance(spans, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor (an int [S, 4] span table), got {type(spans).__name__}")
    if spans.dtype not in _INDEX_DTYPES:
        raise TypeError(f"{name}: expected dtype int32 or int64, got {spans.dtype}")
    widths = (4,) if tagged else (3, 4)
    if spans.dim() != 2 or spans.shape[1] not in widths:
        expected = "[S, 4] (sequence, start, end, tag)" + ("" if tagged else " or [S, 3] (sequence, start, end)")
        raise ValueError(f"{name}: expected shape {expected}, got {tuple(spans.shape)}")
    if spans.device != device and spans.device.type != "cpu":
        raise ValueError(f"{name}: expected device {device} or the CPU, got {spans.device}")
    return spans.detach().to(torch.int64).contiguous()


def check_values(named: tuple[tuple[str, Tensor | None], ...], n_rows: int, n_cols: int) -> None:
    """Value check of the span tables given, one host synchronization for all (``RLK_CHECK_VALUES=0`` skips it):
    ``0 <= sequence < B`` and ``0 <= start <= end <= T`` on every row."""
    given = [(name, s) for name, s in named if s is not None and s.shape[0]]
    if not given or not checks.values_checked():
        return

    def outside(s: Tensor) -> Tensor:
        seq, start, end = s[:, 0], s[:, 1], s[:, 2]
        return (seq < 0) | (seq >= n_rows) | (start < 0) | (start > end) | (end > n_cols)

    bad = torch.stack([outside(s).any() for _, s in given]).tolist()
    for (name, s), wrong in zip(given, bad):
        if wrong:
            k = int(outside(s).nonzero()[0, 0])
            i, a, b = s[k, :3].tolist()
            raise ValueError(
                f"{name}: row {k} is (seq, start, end) = ({i}, {a}, {b}); "
                f"need 0 <= seq < B = {n_rows} and 0 <= start <= end <= T = {n_cols}"
            )


def mask(spans: Tensor, shape: tuple[int, int], *, tags: tuple[int, ...] | None = None) -> Tensor:
    """The bool ``[B, T]`` mask of the columns ``spans`` covers (only rows whose tag is in ``tags``, if given).

    ``spans``: int ``[S, 4]`` (``[S, 3]`` when ``tags`` is None), in range. Built on ``spans``' device by a difference
    array (integer adds: exact in any order) and a cumulative sum; no host synchronization.
    """
    batch, length = shape
    # rows whose tag is not in ``tags`` weigh 0 (a boolean filter would synchronize to size its output)
    weight = torch.ones(spans.shape[0], dtype=torch.int32, device=spans.device)
    if tags is not None:
        keep = torch.zeros_like(weight)
        for tag in tags:
            keep |= (spans[:, 3] == tag).int()
        weight = keep
    marks = difference_marks(spans[:, 0].long(), spans[:, 1].long(), spans[:, 2].long(), weight, batch, length)
    return marks.cumsum(1)[:, :length] > 0


def difference_marks(rows: Tensor, starts: Tensor, ends: Tensor, weight: Tensor, batch: int, length: int) -> Tensor:
    """The difference array ``[B, T + 1]``: ``+weight`` at ``(row, start)``, ``-weight`` at ``(row, end)``."""
    marks = torch.zeros(batch * (length + 1), dtype=weight.dtype, device=weight.device)
    marks.scatter_add_(0, rows * (length + 1) + starts, weight)
    marks.scatter_add_(0, rows * (length + 1) + ends, -weight)
    return marks.view(batch, length + 1)


def _tags(span_tags) -> tuple[int, ...] | None:
    if span_tags is None:
        return None
    if isinstance(span_tags, (bool, float, str)) or not hasattr(span_tags, "__iter__"):
        span_tags = (span_tags,)
    return tuple(checks.integer("span_tags", t) for t in span_tags)


@custom_op.define("rlk::span_mask")
def _span_mask(table: Tensor, batch: int, length: int, tags: list[int] | None, device: torch.device) -> Tensor:
    """The bool ``[batch, length]`` mask of the span table ``loss_spans`` (int64, checked by :func:`check_table`) on
    ``device``, its values checked first (inside the op: under ``torch.compile`` too, when the graph runs)."""
    check_values((("loss_spans", table),), batch, length)
    return to_device(mask(table, (batch, length), tags=None if tags is None else tuple(tags)), device)


@_span_mask.register_fake
def _span_mask_fake(table: Tensor, batch: int, length: int, tags: list[int] | None, device: torch.device) -> Tensor:
    return torch.empty((batch, length), dtype=torch.bool, device=device)


def loss_mask(loss_spans, span_tags, shape: tuple[int, ...], device: torch.device, what: str) -> Tensor:
    """The bool ``[B, T]`` mask of an op's ``loss_spans`` (rows tagged one of ``span_tags``, if given) for tensors of
    ``shape`` (``what`` names them in the error when they are not ``[B, T]``); values checked (one synchronization,
    ``RLK_CHECK_VALUES=0`` skips it)."""
    if len(shape) != 2:
        raise ValueError(f"loss_spans: needs {what} of shape [B, T] (spans address (sequence, column)), got {shape}")
    tags = _tags(span_tags)
    table = check_table("loss_spans", loss_spans, device, tagged=tags is not None)
    return _span_mask(table, shape[0], shape[1], None if tags is None else list(tags), device)


def mask_of(
    mask: Tensor | None, loss_spans, span_tags, shape: tuple[int, ...], device: torch.device, what: str = "logprob"
) -> Tensor:
    """A loss's mask given ``mask`` or ``loss_spans`` (exactly one; errors name them): ``mask`` as it is, or the bool
    mask of the spans for ``what`` (the ``[B, T]`` tensors of ``shape``) on ``device``."""
    no_tags_without_spans(loss_spans, span_tags)
    if loss_spans is None:
        if mask is None:
            raise TypeError("mask: required (a [B, T] loss mask), unless loss_spans is given")
        return mask
    if mask is not None:
        raise ValueError("mask, loss_spans: give one of them (both describe the loss tokens)")
    return loss_mask(loss_spans, span_tags, shape, device, what)


def to_device(x: Tensor, device: torch.device) -> Tensor:
    """``x`` on ``device``; a CPU tensor bound for CUDA goes through pinned memory without blocking (no host
    synchronization)."""
    if x.device == device:
        return x
    if x.device.type == "cpu" and device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


def scored_slots(loss_spans: Tensor, span_tags, shape: tuple[int, ...], device: torch.device) -> tuple[Tensor, int]:
    """From a span table on the CPU: ``slot [N]`` int64 on ``device`` (the packed row of each scored position in
    row-major order, -1 elsewhere; ``rlk.pack``'s slot map) and the number of scored positions, computed on the host
    (no device synchronization)."""
    scored = loss_mask(loss_spans, span_tags, shape, torch.device("cpu"), "targets (hidden)").reshape(-1)
    slot = torch.where(scored, scored.cumsum(0) - 1, -1)
    return to_device(slot, device), int(scored.sum())


def no_tags_without_spans(loss_spans, span_tags) -> None:
    if span_tags is not None and loss_spans is None:
        raise ValueError("span_tags: given without loss_spans (the tags select rows of loss_spans)")
