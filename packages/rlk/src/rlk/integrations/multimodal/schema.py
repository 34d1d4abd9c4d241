"""The multimodal RL batch: token tensors plus compact span tables, on the batch's device.

Every span table is an int32 ``[S, 4]`` tensor of rows ``(sequence, start, end, tag)``: row ``sequence`` of the
batch's ``[B, T]`` token layout, columns ``start`` (inclusive) to ``end`` (exclusive), sorted by
``(sequence, start)``, not overlapping. What ``tag`` holds depends on the table (:data:`SPAN_TAGS`). Value checks
(one host synchronization for all) run unless ``RLK_CHECK_VALUES=0`` (:func:`rlk.core.checks.values_checked`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from rlk.core.checks import choice, values_checked
from rlk.ops import spans as span_tables

#: The dtype of every span table and of ``vision_token_offsets`` (the dtype of ``cu_seqlens`` in rlk).
SPAN_DTYPE = torch.int32
#: The columns of a span row.
SPAN_COLUMNS = ("sequence", "start", "end", "tag")
#: Codes of the ``tag`` column of ``modality_spans`` (text is never a modality span; the codes are those of
#: transformers' ``mm_token_type_ids``).
MODALITIES = {"image": 1, "video": 2}
#: What the ``tag`` column means in each span table.
SPAN_TAGS = {
    "modality_spans": "modality code (MODALITIES: 1 image, 2 video); row i is media item i",
    "loss_spans": "segment (turn) index within its sequence, >= 0",
    "region_spans": "media item (row of media_ids) whose frame bbox_targets' row is in",
    "action_spans": "media item (row of media_ids) whose frame point_targets' row is in",
}
#: Coordinate systems of ``bbox_targets`` / ``point_targets`` and the range each allows.
COORDINATE_SYSTEMS = ("normalized", "normalized_1000", "pixels")
_COORDINATE_LIMIT = {"normalized": 1.0, "normalized_1000": 1000.0}
_MASK_DTYPES = (torch.bool, torch.int64, torch.int32, torch.uint8, torch.int8)
_ID_DTYPES = (torch.int64, torch.int32)


@dataclasses.dataclass(frozen=True)
class VisionTokens:
    """The token ids that lay media out in a sequence (Qwen2-VL style: ``<|vision_start|>``, one placeholder token
    per visual token, ``<|vision_end|>``) and the vision encoder's spatial merge (``merge`` x ``merge`` patches make
    one visual token)."""

    image: int
    video: int
    vision_start: int
    vision_end: int
    spatial_merge_size: int = 2

    def modality_of(self, token: int) -> str | None:
        return {self.image: "image", self.video: "video"}.get(token)


#: Qwen2-VL / Qwen2.5-VL's ids (``<|image_pad|>`` 151655, ``<|video_pad|>`` 151656, ``<|vision_start|>`` 151652,
#: ``<|vision_end|>`` 151653) and merge size 2.
QWEN2_VL_TOKENS = VisionTokens(image=151655, video=151656, vision_start=151652, vision_end=151653)


def processor_fingerprint(config: Mapping) -> str:
    """A short stable hash (16 hex digits) of a processor's layout-relevant settings (a JSON-able mapping: pixel
    bounds, patch and merge sizes, normalization, the tokenizer's vocabulary hash, padding side): two encodings
    with different fingerprints may lay out the same sample differently."""
    text = json.dumps(config, sort_keys=True, default=str, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def media_cache_key(content: bytes | Tensor, fingerprint: str) -> str:
    """The cache key (32 hex digits) of one media item's vision-encoder output: a hash of its content (raw bytes, or
    a tensor's shape, dtype and bytes) and the processor fingerprint (the same pixels under another processor give
    other tokens)."""
    if isinstance(content, Tensor):  # its bytes, shape and dtype
        header = f"{tuple(content.shape)}:{content.dtype}:".encode()
        content = header + content.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    return hashlib.sha256(content + fingerprint.encode()).hexdigest()[:32]


# ---------------------------------------------------------------------------
# Dense helpers (reference / spec use: they build [B, T] masks)
# ---------------------------------------------------------------------------


def spans_to_mask(spans: Tensor, shape: tuple[int, int], *, tags: tuple[int, ...] | None = None) -> Tensor:
    """The bool ``[B, T]`` mask of the tokens ``spans`` cover (only rows whose tag is in ``tags``, if given).

    ``spans``: int ``[S, 4]`` rows ``(sequence, start, end, tag)``, in range (checked by :class:`MultimodalBatch`).
    Built on ``spans``' device by a difference array and a cumulative sum (no host synchronization).
    """
    return span_tables.mask(spans, shape, tags=tags)


def shift_spans(spans: Tensor, shift: int) -> Tensor:
    """``spans`` with every ``start`` and ``end`` moved by ``shift`` columns and clamped at 0, on the device (a
    positive shift can move an end past ``T``; the ops' value check then reports the row).

    ``shift_spans(batch.loss_spans, -1)`` maps spans of predicted tokens (token columns) onto the positions that
    predict them (``targets[:, t] = input_ids[:, t + 1]``), for ``loss_spans=`` of the log-prob ops and losses; a
    span starting at column 0 loses that column (no position predicts the first token).
    """
    shift = int(shift)
    out = spans.clone()
    out[:, 1:3] = (spans[:, 1:3] + shift).clamp(min=0)
    return out


def mask_to_spans(mask: Tensor, *, tag: int = 0) -> Tensor:
    """The runs of True in a ``[B, T]`` mask as an int32 ``[S, 4]`` span table, sorted, tag ``tag`` on every row
    (the inverse of :func:`spans_to_mask` for spans that do not touch: adjacent spans come back merged).
    Synchronizes (the number of runs sizes the output)."""
    if mask.dim() != 2:
        raise ValueError(f"mask: expected shape [B, T], got {tuple(mask.shape)}")
    edges = torch.nn.functional.pad(mask.bool().to(torch.int8), (1, 1)).diff(dim=1)
    starts = (edges == 1).nonzero()
    ends = (edges == -1).nonzero()
    table = torch.stack([starts[:, 0], starts[:, 1], ends[:, 1], torch.full_like(starts[:, 0], tag)], dim=1)
    return table.to(SPAN_DTYPE)


def _covered_counts(spans: Tensor, batch: int, length: int) -> Tensor:
    """int64 ``[B, T + 1]``: ``out[b, t]`` = tokens of row ``b`` before column ``t`` that ``spans`` cover (indices
    clamped into range: a row out of range is reported by the range checks first)."""
    if batch == 0:
        return torch.zeros(batch, length + 1, dtype=torch.int64, device=spans.device)
    rows = spans[:, 0].long().clamp(0, batch - 1)
    ones = torch.ones(rows.shape[0], dtype=torch.int64, device=spans.device)
    starts, ends = spans[:, 1].long().clamp(0, length), spans[:, 2].long().clamp(0, length)
    covered = (span_tables.difference_marks(rows, starts, ends, ones, batch, length).cumsum(1)[:, :length] > 0).long()
    return torch.nn.functional.pad(covered.cumsum(1), (1, 0))


def _count_in(counts: Tensor, spans: Tensor) -> Tensor:
    """Per span row: how many of its tokens ``counts`` (``_covered_counts``' cumulative form) marks."""
    batch, length = counts.shape[0], counts.shape[1] - 1
    rows = spans[:, 0].long().clamp(0, max(batch - 1, 0))
    start = spans[:, 1].long().clamp(0, length)
    end = spans[:, 2].long().clamp(0, length)
    if batch == 0:
        return torch.zeros_like(start)
    return counts[rows, end] - counts[rows, start]


def _numbers(row: Tensor) -> str:
    """A row of coordinates for a message: ``[1003.92, 96.4894, 1290, nan]``."""
    return "[" + ", ".join(f"{v:.6g}" for v in row.tolist()) + "]"


# ---------------------------------------------------------------------------
# The batch
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class MultimodalBatch:
    """A multimodal RL batch: padded token tensors and the span tables later ops consume on the device.

    Every tensor lives on ``input_ids``' device. ``M`` media items (images, videos) appear in the batch in order
    (sequence, then column); row ``i`` of ``modality_spans``, ``media_ids``, ``media_cache_keys``,
    ``media_grid_thw`` and ``screen_size`` all describe media item ``i``.

    Attributes:
        input_ids: int64 (or int32) ``[B, T]`` token ids.
        attention_mask: bool or integer ``[B, T]``, 1 on tokens, 0 on padding.
        media_ids: int64 ``[M]``, the media items' ids (e.g. dataset indices; repeats allowed: a GRPO group's
            samples share their prompt's images).
        modality_spans: int32 ``[M, 4]`` span table; tag = modality code (:data:`MODALITIES`). Each span covers a
            media item's visual (placeholder) tokens, on attended tokens.
        loss_spans: int32 ``[L, 4]`` span table of the tokens the loss covers; tag = segment (turn) index, >= 0.
            Never on visual tokens or padding.
        vision_token_offsets: int32 ``[M + 1]``: media item ``i``'s visual tokens are rows
            ``vision_token_offsets[i] : vision_token_offsets[i + 1]`` of the vision encoder's concatenated output;
            starts at 0, and each difference equals the item's span length.
        media_cache_keys: ``M`` strings, each media item's vision-output cache key (:func:`media_cache_key`).
        processor_fingerprint: the processor's :func:`processor_fingerprint`.
        position_ids: optional int64 ``[B, T]`` or ``[3, B, T]`` (multimodal rotary: temporal, height, width).
        media_grid_thw: optional int64 ``[M, 3]``: the vision encoder's patch grid (t, h, w) per media item.
        region_spans: optional int32 ``[R, 4]`` span table of grounding tokens (a box in the text); tag = the media
            item whose frame the box is in. Never on visual tokens.
        bbox_targets: float32 ``[R, 4]`` ``(x0, y0, x1, y1)`` per region span, ``x0 <= x1``, ``y0 <= y1``.
        action_spans: optional int32 ``[A, 4]`` span table of GUI action tokens; tag = the media item (screenshot)
            the action acts on. Never on visual tokens.
        point_targets: float32 ``[A, 2]`` ``(x, y)`` per action span; a row of two NaNs: the action has no point
            (typing, a key press).
        coordinate_system: ``"normalized"`` (``[0, 1]``), ``"normalized_1000"`` (``[0, 1000]``, Qwen2-VL's
            grounding) or ``"pixels"`` (within ``screen_size``); required with region or action spans.
        screen_size: int64 ``[M, 2]`` ``(width, height)`` in pixels of each media item; required with
            ``coordinate_system="pixels"``.

    Construction runs :meth:`validate`.
    """

    input_ids: Tensor
    attention_mask: Tensor
    media_ids: Tensor
    modality_spans: Tensor
    loss_spans: Tensor
    vision_token_offsets: Tensor
    media_cache_keys: tuple[str, ...]
    processor_fingerprint: str
    position_ids: Tensor | None = None
    media_grid_thw: Tensor | None = None
    region_spans: Tensor | None = None
    bbox_targets: Tensor | None = None
    action_spans: Tensor | None = None
    point_targets: Tensor | None = None
    coordinate_system: str | None = None
    screen_size: Tensor | None = None

    def __post_init__(self) -> None:
        if isinstance(self.media_cache_keys, list):
            self.media_cache_keys = tuple(self.media_cache_keys)
        self.validate()

    @property
    def batch_size(self) -> int:
        return self.input_ids.shape[0]

    @property
    def seq_len(self) -> int:
        return self.input_ids.shape[1]

    @property
    def num_media(self) -> int:
        return self.modality_spans.shape[0]

    @property
    def device(self) -> torch.device:
        return self.input_ids.device

    def tensors(self) -> dict[str, Tensor]:
        """The batch's tensors by field name (None fields left out)."""
        return {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if isinstance(getattr(self, f.name), Tensor)
        }

    def to(self, device: torch.device | str) -> MultimodalBatch:
        """A copy with every tensor on ``device`` (validated again)."""
        return dataclasses.replace(self, **{k: v.to(device) for k, v in self.tensors().items()})

    def loss_mask(self) -> Tensor:
        """Dense bool ``[B, T]`` loss mask (reference use; later ops read ``loss_spans`` directly)."""
        return spans_to_mask(self.loss_spans, (self.batch_size, self.seq_len))

    def modality_mask(self, modality: str | None = None) -> Tensor:
        """Dense bool ``[B, T]`` mask of the visual tokens (of one modality, if given; reference use)."""
        tags = None if modality is None else (MODALITIES[choice("modality", modality, tuple(MODALITIES))],)
        return spans_to_mask(self.modality_spans, (self.batch_size, self.seq_len), tags=tags)

    def validate(self, *, values: bool | None = None) -> None:
        """Check every field; errors name the field (and the row of a span table).

        Shapes, dtypes and devices are always checked (metadata, free). The values (ranges, order, overlaps,
        offsets, coordinates) need one host synchronization; they run when ``values`` is True, or when it is None
        and ``RLK_CHECK_VALUES`` is not ``0`` (:func:`rlk.core.checks.values_checked`).
        """
        self._check_metadata()
        if values or (values is None and values_checked()):
            if self.device.type != "meta":
                self._check_values()

    # -- metadata ------------------------------------------------------------------------------------------

    def _tensor(self, name: str, dtypes: tuple[torch.dtype, ...], shape: tuple, what: str) -> Tensor:
        x = getattr(self, name)
        if not isinstance(x, Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in dtypes:
            names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise TypeError(f"{name}: expected dtype {names}, got {str(x.dtype).removeprefix('torch.')}")
        if x.dim() != len(shape) or any(want is not None and got != want for got, want in zip(x.shape, shape)):
            raise ValueError(f"{name}: expected shape {what}, got {tuple(x.shape)}")
        if name != "input_ids" and x.device != self.input_ids.device:
            raise ValueError(
                f"{name}: expected device {self.input_ids.device} (the device of input_ids), got {x.device}"
            )
        return x

    def _check_metadata(self) -> None:
        ids = self._tensor("input_ids", _ID_DTYPES, (None, None), "[B, T]")
        batch, length = ids.shape
        self._tensor("attention_mask", _MASK_DTYPES, (batch, length), f"[B, T] = [{batch}, {length}]")
        if self.position_ids is not None:
            if not isinstance(self.position_ids, Tensor) or self.position_ids.dim() == 3:
                shape, what = (3, batch, length), f"[3, B, T] = [3, {batch}, {length}] or [B, T]"
            else:
                shape, what = (batch, length), f"[B, T] = [{batch}, {length}] or [3, B, T]"
            self._tensor("position_ids", _ID_DTYPES, shape, what)
        spans = self._tensor("modality_spans", (SPAN_DTYPE,), (None, 4), "[M, 4] (sequence, start, end, modality)")
        media = spans.shape[0]
        self._tensor("media_ids", (torch.int64,), (media,), f"[M] = [{media}] (one per modality_spans row)")
        self._tensor("loss_spans", (SPAN_DTYPE,), (None, 4), "[L, 4] (sequence, start, end, segment)")
        self._tensor("vision_token_offsets", (SPAN_DTYPE,), (media + 1,), f"[M + 1] = [{media + 1}]")
        keys = self.media_cache_keys
        if not isinstance(keys, tuple) or not all(isinstance(k, str) for k in keys):
            raise TypeError(f"media_cache_keys: expected a tuple of str, got {type(keys).__name__}")
        if len(keys) != media:
            raise ValueError(f"media_cache_keys: expected {media} keys (one per modality_spans row), got {len(keys)}")
        if not isinstance(self.processor_fingerprint, str) or not self.processor_fingerprint:
            raise TypeError(f"processor_fingerprint: expected a non-empty str, got {self.processor_fingerprint!r}")
        if self.media_grid_thw is not None:
            self._tensor("media_grid_thw", (torch.int64,), (media, 3), f"[M, 3] = [{media}, 3] (t, h, w)")
        pairs = (
            ("region_spans", "bbox_targets", 4, "(x0, y0, x1, y1)"),
            ("action_spans", "point_targets", 2, "(x, y)"),
        )
        grounded = False
        for spans_name, targets_name, width, columns in pairs:
            given = (getattr(self, spans_name) is not None, getattr(self, targets_name) is not None)
            if given[0] != given[1]:
                missing = targets_name if given[0] else spans_name
                raise ValueError(f"{missing}: required with {targets_name if given[1] else spans_name}")
            if given[0]:
                grounded = True
                rows = self._tensor(spans_name, (SPAN_DTYPE,), (None, 4), "[N, 4] (sequence, start, end, media)")
                n = rows.shape[0]
                self._tensor(targets_name, (torch.float32,), (n, width), f"[{n}, {width}] {columns}, one per span")
        if grounded or self.coordinate_system is not None:
            if self.coordinate_system is None:
                raise ValueError("coordinate_system: required with region_spans or action_spans")
            choice("coordinate_system", self.coordinate_system, COORDINATE_SYSTEMS)
        if self.screen_size is not None:
            self._tensor("screen_size", (torch.int64,), (media, 2), f"[M, 2] = [{media}, 2] (width, height)")
        elif grounded and self.coordinate_system == "pixels":
            raise ValueError("screen_size: required with coordinate_system='pixels'")

    # -- values (one synchronization) ----------------------------------------------------------------------

    def _span_checks(self, name: str, spans: Tensor, checks: list) -> None:
        """Range, order and overlap checks of one span table, appended to ``checks`` as (bad rows, message)."""
        batch, length = self.batch_size, self.seq_len
        seq, start, end = spans[:, 0], spans[:, 1], spans[:, 2]

        def where(i: int) -> str:
            s, a, b, tag = spans[i].tolist()
            return f"{name} row {i} (sequence {s}, tokens {a}..{b - 1}, tag {tag})"

        checks.append(((seq < 0) | (seq >= batch), lambda i: f"{where(i)}: sequence out of range [0, {batch})"))
        checks.append(
            (
                (start < 0) | (end > length) | (start >= end),
                lambda i: f"{where(i)}: needs 0 <= start < end <= T = {length}",
            )
        )
        same = seq[1:] == seq[:-1]
        unsorted = (seq[1:] < seq[:-1]) | (same & (start[1:] < start[:-1]))
        checks.append((unsorted, lambda i: f"{where(i + 1)}: not sorted by (sequence, start) after {where(i)}"))
        checks.append((same & (start[1:] < end[:-1]), lambda i: f"{where(i + 1)}: overlaps {where(i)}"))

    def _check_values(self) -> None:
        batch, length, media = self.batch_size, self.seq_len, self.num_media
        checks: list[tuple[Tensor, Callable[[int], str]]] = []
        tables = {name: getattr(self, name) for name in SPAN_TAGS if getattr(self, name) is not None}
        for name, spans in tables.items():
            self._span_checks(name, spans, checks)

        modality = self.modality_spans
        checks.append(
            (
                ~((modality[:, 3] == MODALITIES["image"]) | (modality[:, 3] == MODALITIES["video"])),
                lambda i: (
                    f"modality_spans row {i}: modality code {int(modality[i, 3])} is not one of "
                    f"{', '.join(f'{v} ({k})' for k, v in MODALITIES.items())}"
                ),
            )
        )
        loss = self.loss_spans
        checks.append((loss[:, 3] < 0, lambda i: f"loss_spans row {i}: segment index {int(loss[i, 3])} < 0"))
        for name in ("region_spans", "action_spans"):
            if name in tables:
                rows = tables[name]
                checks.append(
                    (
                        (rows[:, 3] < 0) | (rows[:, 3] >= media),
                        lambda i, rows=rows, name=name: (
                            f"{name} row {i}: media item {int(rows[i, 3])} out of range [0, {media})"
                        ),
                    )
                )

        # every span on attended tokens (the loss and the visual tokens never on padding)
        attended = torch.nn.functional.pad((self.attention_mask != 0).long().cumsum(1), (1, 0))
        for name in ("modality_spans", "loss_spans"):
            spans = tables[name]
            lengths = (spans[:, 2] - spans[:, 1]).long()
            checks.append(
                (
                    _count_in(attended, spans) != lengths,
                    lambda i, spans=spans, name=name: (
                        f"{name} row {i} (sequence {int(spans[i, 0])}, tokens "
                        f"{int(spans[i, 1])}..{int(spans[i, 2]) - 1}) covers padding (attention_mask 0)"
                    ),
                )
            )
        # nothing but modality spans on visual tokens
        visual = _covered_counts(modality, batch, length)
        for name in ("loss_spans", "region_spans", "action_spans"):
            if name in tables:
                spans = tables[name]
                checks.append(
                    (
                        _count_in(visual, spans) > 0,
                        lambda i, spans=spans, name=name: (
                            f"{name} row {i} (sequence {int(spans[i, 0])}, tokens "
                            f"{int(spans[i, 1])}..{int(spans[i, 2]) - 1}) covers visual tokens of modality_spans"
                        ),
                    )
                )
        # vision-output offsets: start at 0, step by each span's length
        offsets = self.vision_token_offsets
        lengths = modality[:, 2] - modality[:, 1]
        checks.append(
            (offsets[:1] != 0, lambda i: f"vision_token_offsets: must start at 0, starts at {int(offsets[0])}")
        )
        checks.append(
            (
                offsets[1:] - offsets[:-1] != lengths,
                lambda i: (
                    f"vision_token_offsets: media item {i} has {int(offsets[i + 1] - offsets[i])} vision "
                    f"tokens ({int(offsets[i])}..{int(offsets[i + 1])}) but modality_spans row {i} covers "
                    f"{int(lengths[i])} tokens"
                ),
            )
        )
        if self.media_grid_thw is not None:
            grid = self.media_grid_thw
            checks.append(((grid < 1).any(1), lambda i: f"media_grid_thw row {i}: {grid[i].tolist()} must be >= 1"))
        if self.screen_size is not None:
            screen = self.screen_size
            checks.append(((screen < 1).any(1), lambda i: f"screen_size row {i}: {screen[i].tolist()} must be >= 1"))
        for spans_name, targets_name in (("region_spans", "bbox_targets"), ("action_spans", "point_targets")):
            if spans_name in tables:
                self._target_checks(tables[spans_name], targets_name, checks)

        flags = torch.stack([bad.any() for bad, _ in checks]).tolist()
        for flag, (bad, message) in zip(flags, checks):
            if flag:
                raise ValueError(message(int(bad.nonzero()[0, 0])))

    def _target_checks(self, spans: Tensor, name: str, checks: list) -> None:
        targets = getattr(self, name)
        system = self.coordinate_system
        xs, ys = targets[:, 0::2], targets[:, 1::2]
        if name == "point_targets":
            no_point = torch.isnan(targets).all(1)
            checks.append(
                (
                    torch.isnan(targets).any(1) & ~no_point,
                    lambda i: (
                        f"point_targets row {i}: {_numbers(targets[i])} has one NaN coordinate (a row of two "
                        "NaNs means no point)"
                    ),
                )
            )
        else:
            no_point = torch.zeros(targets.shape[0], dtype=torch.bool, device=targets.device)
            checks.append(
                (
                    (targets[:, 0] > targets[:, 2]) | (targets[:, 1] > targets[:, 3]),
                    lambda i: (
                        f"bbox_targets row {i}: (x0, y0, x1, y1) = {_numbers(targets[i])} needs x0 <= x1 and y0 <= y1"
                    ),
                )
            )
        checks.append(
            (
                ~torch.isfinite(targets).all(1) & ~no_point,
                lambda i: f"{name} row {i}: {_numbers(targets[i])} is not finite",
            )
        )
        if system in _COORDINATE_LIMIT:
            limit = _COORDINATE_LIMIT[system]
            outside = ((targets < 0) | (targets > limit)).any(1) & ~no_point
            checks.append(
                (
                    outside,
                    lambda i: (
                        f"{name} row {i}: {_numbers(targets[i])} is not normalized to [0, {limit:g}] "
                        f"(coordinate_system={system!r})"
                    ),
                )
            )
            return
        media = spans[:, 3].long().clamp(0, max(self.num_media - 1, 0))
        if self.num_media == 0:
            return
        size = self.screen_size[media].to(targets.dtype)
        outside = (
            (xs < 0).any(1) | (ys < 0).any(1) | (xs > size[:, :1]).any(1) | (ys > size[:, 1:]).any(1)
        ) & ~no_point
        checks.append(
            (
                outside,
                lambda i: (
                    f"{name} row {i}: {_numbers(targets[i])} lies outside the screen of media item "
                    f"{int(media[i])} ({int(size[i, 0])} x {int(size[i, 1])} pixels, coordinate_system='pixels')"
                ),
            )
        )
