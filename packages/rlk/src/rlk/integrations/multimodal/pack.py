"""Modality-aware packing of a :class:`~rlk.integrations.multimodal.schema.MultimodalBatch`: its padded ``[B, T]``
rows (text, image and video spans) into varlen rows with ``cu_seqlens``, per-span offsets, position ids and
temporal ids, and back.

The data movement is ``rlk.pack``'s: one slot map ``slot[B * T]`` (the packed row of each attended token, -1 at
padding) and the two primitives ``pack_fwd`` / ``pack_bwd`` (:mod:`rlk.reference.pack`, the Triton kernels,
whichever backend serves ``pack``), run through the same custom ops as :func:`rlk.pack` / :func:`rlk.unpack`, so
the copies are bitwise, deterministic, atomic-free and differentiable both ways. What this module adds is the
map: the attended tokens' prefix sums (as ``rlk.pack``) with, for ``video_order="token"``, each video span's
tokens permuted inside the span. Every index is computed on the device with torch ops.

Video layout. A video's ``modality_spans`` row covers ``t * h * w / merge**2`` placeholder tokens in the
processor's (Qwen2-VL's) order, **frame-major**: the ``h * w / merge**2`` merged tokens of temporal patch 0 in
raster order, then those of temporal patch 1, ... (``t`` is row ``i`` of ``media_grid_thw``; a temporal patch is
what this module calls a frame). The tokens per frame are taken as ``span length / t``, so the merge size is not
needed. ``video_order="frame"`` keeps that order; ``video_order="token"`` interleaves the frames: spatial token
0 of frames 0, 1, ..., t - 1, then spatial token 1 of every frame, ... (packed index ``s * t + f`` for the
token of frame ``f`` at spatial index ``s``, which was at ``f * (length / t) + s``).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from rlk.core import checks
from rlk.integrations.multimodal.schema import MODALITIES, SPAN_DTYPE, MultimodalBatch
from rlk.ops import spans as span_tables
from rlk.ops.pack import _check_data, _checked, _numel, _pack_fwd, _unpack_fwd, check_padding_value

#: The orders a video span's tokens can be packed in.
VIDEO_ORDERS = ("frame", "token")


@dataclasses.dataclass(frozen=True)
class PackedBatch:
    """A :class:`MultimodalBatch` packed by :func:`pack_batch` (``M`` = ``total``, the attended tokens).

    Attributes:
        tensors: the tensors given to :func:`pack_batch`, each packed to ``[M, *trailing]`` in its dtype.
        input_ids: ``[M]`` the batch's token ids, packed (``input_ids``' dtype).
        cu_seqlens: int32 ``[B + 1]``: packed rows ``cu_seqlens[b] : cu_seqlens[b + 1]`` are sequence ``b``'s.
        position_ids: int64 ``[M]``: each packed token's index among its sequence's attended tokens in the
            batch's order (0, 1, ... per sequence; with ``video_order="token"`` a video span's positions are
            permuted with its tokens, so a token keeps the position it has in the processor's layout).
        temporal_ids: int64 ``[M]``: the frame (temporal patch, ``0 .. t - 1``) of each video token; -1 on text
            and image tokens.
        span_offsets: int32 ``[S]``: the packed row where each ``modality_spans`` row starts (its media item's
            tokens are rows ``span_offsets[i] : span_offsets[i] + length``). Stable: ``span_offsets[i] -
            cu_seqlens[sequence]`` counts the attended tokens before the span in its own row, the same whatever
            else is in the batch and on whichever side it is padded.
        slot: int64 ``[B * T]``: the packed row of each ``[B, T]`` position, -1 at padding (what
            :func:`unpack_batch` scatters by).
        shape: ``(B, T)``.
        total: ``M``.
        video_order: ``"frame"`` or ``"token"``.
    """

    tensors: tuple[Tensor, ...]
    input_ids: Tensor
    cu_seqlens: Tensor
    position_ids: Tensor
    temporal_ids: Tensor
    span_offsets: Tensor
    slot: Tensor
    shape: tuple[int, int]
    total: int
    video_order: str

    def remap_spans(self, spans: Tensor) -> Tensor:
        """A span table of the batch (int ``[S, 4]`` ``(sequence, start, end, tag)``, e.g. ``loss_spans``) with
        ``start`` / ``end`` mapped to packed rows (global rows of the packed tensors, not per sequence): int32
        ``[S, 4]`` ``(sequence, packed_start, packed_start + end - start, tag)``.

        For the batch's own tables (validated: on attended tokens, which have no holes inside a span; a video is
        permuted only inside its span, and only whole modality spans start at a video's first token). No host
        synchronization.
        """
        if not isinstance(spans, Tensor) or spans.dim() != 2 or spans.shape[1] != 4:
            got = tuple(spans.shape) if isinstance(spans, Tensor) else type(spans).__name__
            raise ValueError(f"spans: expected an int [S, 4] span table (sequence, start, end, tag), got {got}")
        if spans.dtype.is_floating_point or spans.dtype == torch.bool:
            raise TypeError(f"spans: expected an integer dtype, got {spans.dtype}")
        if spans.device != self.slot.device:
            raise ValueError(f"spans: expected device {self.slot.device} (the packed batch's), got {spans.device}")
        _, length = self.shape
        starts = self.slot[spans[:, 0].long() * length + spans[:, 1].long()] if spans.shape[0] else spans[:, 1]
        starts = starts.to(SPAN_DTYPE)
        ends = starts + (spans[:, 2] - spans[:, 1]).to(SPAN_DTYPE)
        return torch.stack([spans[:, 0].to(SPAN_DTYPE), starts, ends, spans[:, 3].to(SPAN_DTYPE)], dim=1)


def pack_batch(
    batch: MultimodalBatch, *tensors: Tensor, video_order: str = "frame", total: int | None = None
) -> PackedBatch:
    """Pack a multimodal batch's attended tokens (and ``tensors``, e.g. hidden states) into varlen rows.

    Args:
        batch: a :class:`MultimodalBatch`. ``media_grid_thw`` is required when ``modality_spans`` has rows (each
            video's ``t``).
        tensors: any number of ``[B, T, *trailing]`` tensors (any trailing shape and strides) of dtype float32,
            float16, bfloat16, float64, int32 or int64, on the batch's device: hidden states, per-token ids,
            ``batch.position_ids.permute(1, 2, 0)`` for 3-D rotary positions, ... Each is packed with the tokens.
        video_order: ``"frame"`` (the processor's frame-major order, as ``rlk.pack``) or ``"token"`` (each
            video span's frames interleaved: the same spatial token of every frame adjacent; module docstring).
        total: the number of attended tokens, if known: as :func:`rlk.pack`'s ``total``, it spares the one host
            synchronization that reads it back. The value checks (attention mask values 0 / 1, a given
            ``total``, every video span's length a multiple of its ``t``) share that one synchronization; none
            at all with ``total`` given and ``RLK_CHECK_VALUES=0`` (or under ``torch.compile``).

    Returns:
        A :class:`PackedBatch`. Packing is a bitwise copy; a token's packed value, position id, temporal id and
        offset within its sequence do not depend on the other sequences. Differentiable w.r.t. float
        ``tensors``: the gradient of a packed tensor is :func:`unpack_batch` of its gradient (0 at padding).
    """
    if not isinstance(batch, MultimodalBatch):
        raise TypeError(f"batch: expected a MultimodalBatch, got {type(batch).__name__}")
    video_order = checks.choice("video_order", video_order, VIDEO_ORDERS)
    if total is not None:
        total = checks.integer("total", total, minimum=0)
    mask = batch.attention_mask
    b, t = mask.shape
    for i, x in enumerate(tensors):
        _check_data(f"tensors[{i}]", x, mask)
        if x.dim() < 2 or tuple(x.shape[:2]) != (b, t):
            raise ValueError(
                f"tensors[{i}]: expected shape [B, T, *trailing] with [B, T] = {[b, t]} (the shape of the "
                f"batch's input_ids), got {tuple(x.shape)}"
            )
    spans = batch.modality_spans
    grid = batch.media_grid_thw
    if spans.shape[0] and grid is None:
        raise ValueError(
            "media_grid_thw: required by pack_batch when modality_spans has rows (each video's temporal patches t)"
        )
    device = mask.device

    # the attended tokens' prefix sums: rlk.pack's map (frame order)
    flat = mask.reshape(-1)
    valid = flat != 0
    ends = torch.cumsum(valid, 0, dtype=torch.int64)
    base = torch.where(valid, ends - 1, -1)
    cu = ends.new_zeros(b + 1)
    if t:
        cu[1:] = ends.view(b, t)[:, -1]
    row_start = cu[:-1].repeat_interleave(t)  # [B * T] the packed row of each position's sequence start
    position = torch.where(valid, base - row_start, -1)  # index among the row's attended tokens
    slot = base
    temporal = torch.full_like(base, -1)

    bad_video = None
    if spans.shape[0]:
        seq, start, end = spans[:, 0].long(), spans[:, 1].long(), spans[:, 2].long()
        is_video = spans[:, 3] == MODALITIES["video"]
        frames = grid[:, 0].clamp(min=1)
        lengths = end - start
        bad_video = is_video & (lengths % frames != 0)
        # the video span (+ 1) each position lies in, 0 elsewhere: a difference array of span numbers
        number = torch.arange(1, spans.shape[0] + 1, dtype=torch.int64, device=device) * is_video
        owner = span_tables.difference_marks(seq, start, end, number, b, t).cumsum(1)[:, :t].reshape(-1)
        in_video = owner > 0
        item = (owner - 1).clamp(min=0)
        per_frame = (lengths // frames).clamp(min=1)[item]
        column = torch.arange(t, dtype=torch.int64, device=device).repeat(b)
        k = column - start[item]  # the token's index in its video span (frame-major)
        frame, spatial = k // per_frame, k % per_frame
        temporal = torch.where(in_video, frame, -1)
        if video_order == "token":
            slot = torch.where(in_video, base + spatial * frames[item] + frame - k, base)

    checked = _checked()
    if total is None or checked:
        probe = [cu[-1:]]
        if checked:
            probe.append(((flat != 0) & (flat != 1)).sum(dtype=torch.int64).view(1))
            if bad_video is not None:
                probe.append(bad_video.sum(dtype=torch.int64).view(1))
        host = torch.cat(probe).tolist()
        found = host[0]
        if checked and host[1]:
            bad = int(((flat != 0) & (flat != 1)).nonzero()[0, 0])
            raise ValueError(
                f"attention_mask: values must be 0 or 1 (or bool); found {flat[bad].item()} at [{bad // t}, {bad % t}]"
            )
        if checked and bad_video is not None and host[2]:
            i = int(bad_video.nonzero()[0, 0])
            s, a, e, _ = spans[i].tolist()
            raise ValueError(
                f"modality_spans row {i} (sequence {s}, tokens {a}..{e - 1}): a video span of {e - a} tokens is not "
                f"t = {int(grid[i, 0])} frames of equal length (media_grid_thw row {i} = {grid[i].tolist()})"
            )
        if total is not None and total != found:
            raise ValueError(f"total: expected the number of attended tokens of the batch, {found}; got {total}")
        total = found

    # ids, positions and temporal ids travel with the tokens, through the same primitive
    aux = torch.stack([batch.input_ids.reshape(-1).long(), position, temporal], dim=1)
    packed_aux = _pack_fwd(aux.contiguous(), slot, total)
    packed = tuple(
        _pack_fwd(x.reshape(b * t, _numel(tuple(x.shape[2:]))).contiguous(), slot, total).view(total, *x.shape[2:])
        for x in tensors
    )
    result = PackedBatch(
        tensors=packed,
        input_ids=packed_aux[:, 0].to(batch.input_ids.dtype),
        cu_seqlens=cu.to(torch.int32),
        position_ids=packed_aux[:, 1].contiguous(),
        temporal_ids=packed_aux[:, 2].contiguous(),
        span_offsets=torch.empty(0, dtype=SPAN_DTYPE, device=device),
        slot=slot,
        shape=(b, t),
        total=total,
        video_order=video_order,
    )
    offsets = result.remap_spans(spans)[:, 1].contiguous()
    return dataclasses.replace(result, span_offsets=offsets)


def unpack_batch(packed_batch: PackedBatch, packed: Tensor, *, padding_value: float = 0) -> Tensor:
    """Scatter a packed tensor back to the batch's ``[B, T, *trailing]`` layout: the exact inverse of
    :func:`pack_batch` (a video packed in ``"token"`` order comes back in the processor's order).

    Args:
        packed_batch: what :func:`pack_batch` returned.
        packed: ``[M, *trailing]`` (``M`` = ``packed_batch.total``; dtypes as :func:`rlk.unpack`), rows in
            ``packed_batch``'s order: one of its ``tensors``, or anything computed row by row from them.
        padding_value: the value at padding positions: one that ``packed.dtype`` holds exactly, else an error
            (:func:`rlk.ops.pack.check_padding_value`, as :func:`rlk.unpack`).

    Returns:
        ``[B, T, *trailing]`` in ``packed.dtype``: each attended position holds its packed row's bits, padding
        ``padding_value``. Differentiable w.r.t. ``packed`` (the gradient is the gradient packed back). No host
        synchronization.
    """
    if not isinstance(packed_batch, PackedBatch):
        raise TypeError(f"packed_batch: expected a PackedBatch (from pack_batch), got {type(packed_batch).__name__}")
    slot = packed_batch.slot
    if not isinstance(packed, Tensor):
        raise TypeError(f"packed: expected a torch.Tensor, got {type(packed).__name__}")
    _check_data("packed", packed, slot)
    if packed.dim() < 1 or packed.shape[0] != packed_batch.total:
        raise ValueError(
            f"packed: expected shape [M, *trailing] with M = {packed_batch.total} (the packed batch's total), "
            f"got {tuple(packed.shape)}"
        )
    check_padding_value(padding_value, packed.dtype)
    b, t = packed_batch.shape
    trailing = tuple(packed.shape[1:])
    rows = packed.reshape(packed.shape[0], _numel(trailing))
    return _unpack_fwd(rows.contiguous(), slot, float(padding_value)).view(b, t, *trailing)
