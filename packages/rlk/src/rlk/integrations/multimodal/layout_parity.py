"""Processor-layout parity: does the rollout side encode the same samples as the training side?

:func:`compare_layouts` takes two :class:`Encoding` (the tensors a processor returned, plus the loss mask and
position ids) and reports, sample by sample, the first mismatch of each kind and why: media placeholders and
their expansion, token ids, attention masks, padding side, position ids (1-D or 3-D multimodal rotary) and loss
masks. Token indices in the messages count a sample's tokens from its first attended one, so they mean the same
on both sides whatever the padding. Works on the tensors alone (no transformers); host-side, a diagnostic.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from rlk.core.checks import flag
from rlk.integrations.multimodal.schema import (
    MODALITIES,
    QWEN2_VL_TOKENS,
    MultimodalBatch,
    VisionTokens,
)

#: The checks, in the order they are reported within a sample.
CHECKS = ("batch", "media", "media_spans", "tokens", "attention_mask", "padding", "position_ids", "loss_mask")
_ID_DTYPES = (torch.int64, torch.int32)
_MASK_DTYPES = (torch.bool, torch.int64, torch.int32, torch.uint8, torch.int8)
_SIDES = ("rollout", "training")


@dataclasses.dataclass
class Encoding:
    """One side's encoding of a batch of samples (the dict a processor returns, plus what training adds).

    Attributes:
        input_ids: int64 (or int32) ``[B, T]``.
        attention_mask: bool or integer ``[B, T]``, 1 on tokens, 0 on padding.
        position_ids: optional int64 ``[B, T]`` or ``[3, B, T]`` (Qwen2-VL's ``get_rope_index``: temporal, height,
            width); compared on attended tokens only.
        loss_mask: optional bool / integer / float ``[B, T]``, nonzero where the loss counts a token.
        image_grid_thw: optional int64 ``[I, 3]``, the patch grid of each image in order of appearance.
        video_grid_thw: optional int64 ``[V, 3]``, likewise for videos.
        modality_spans: optional int32 ``[M, 4]`` span table (``rlk.multimodal`` schema); if given it is checked
            against the placeholder runs of ``input_ids``.
        processor_fingerprint: optional; differing fingerprints are noted.
        processor_config: optional mapping (what the fingerprint hashes); the notes name the keys that differ.
    """

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor | None = None
    loss_mask: Tensor | None = None
    image_grid_thw: Tensor | None = None
    video_grid_thw: Tensor | None = None
    modality_spans: Tensor | None = None
    processor_fingerprint: str | None = None
    processor_config: Mapping | None = None

    @classmethod
    def from_mapping(cls, data: Mapping, *, side: str = "encoding") -> Encoding:
        """An encoding from a mapping (a processor's ``BatchFeature``, a ``torch.load``-ed dict) with the field
        names as keys; other keys (``pixel_values``, token ids) are ignored. Errors name ``side`` and the key."""
        if not isinstance(data, Mapping):
            raise TypeError(f"{side}: expected a mapping of field names to tensors, got {type(data).__name__}")
        for key in ("input_ids", "attention_mask"):
            if key not in data:
                raise ValueError(f"{side}: missing key {key!r} (keys: {', '.join(sorted(map(str, data)))})")
        fields = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in fields})

    @classmethod
    def from_batch(cls, batch: MultimodalBatch) -> Encoding:
        """The dense encoding of a :class:`MultimodalBatch` (loss mask from ``loss_spans``, image / video grids
        from ``media_grid_thw`` split by modality)."""
        kinds = batch.modality_spans[:, 3]
        grid = batch.media_grid_thw
        return cls(
            input_ids=batch.input_ids,
            attention_mask=batch.attention_mask,
            position_ids=batch.position_ids,
            loss_mask=batch.loss_mask(),
            image_grid_thw=None if grid is None else grid[kinds == MODALITIES["image"]],
            video_grid_thw=None if grid is None else grid[kinds == MODALITIES["video"]],
            modality_spans=batch.modality_spans,
            processor_fingerprint=batch.processor_fingerprint,
        )

    def check(self, side: str = "encoding") -> None:
        """Shapes and dtypes (errors name ``side.field``); contents are what :func:`compare_layouts` compares."""

        def tensor(name: str, dtypes, ranks: tuple[int, ...]) -> Tensor | None:
            x = getattr(self, name)
            if x is None:
                return None
            if not isinstance(x, Tensor):
                raise TypeError(f"{side}.{name}: expected a torch.Tensor, got {type(x).__name__}")
            if dtypes is not None and x.dtype not in dtypes:
                names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
                raise TypeError(f"{side}.{name}: expected dtype {names}, got {str(x.dtype).removeprefix('torch.')}")
            if x.dim() not in ranks:
                raise ValueError(
                    f"{side}.{name}: expected {' or '.join(f'{r}-D' for r in ranks)}, got shape {tuple(x.shape)}"
                )
            return x

        ids = tensor("input_ids", _ID_DTYPES, (2,))
        shape = tuple(ids.shape)
        for name, dtypes in (("attention_mask", _MASK_DTYPES), ("loss_mask", None)):
            x = tensor(name, dtypes, (2,))
            if x is not None and tuple(x.shape) != shape:
                raise ValueError(f"{side}.{name}: expected shape {shape} (that of input_ids), got {tuple(x.shape)}")
        pos = tensor("position_ids", _ID_DTYPES, (2, 3))
        if pos is not None and tuple(pos.shape) not in (shape, (3, *shape)):
            raise ValueError(f"{side}.position_ids: expected shape {shape} or {(3, *shape)}, got {tuple(pos.shape)}")
        for name in ("image_grid_thw", "video_grid_thw"):
            grid = tensor(name, _ID_DTYPES, (2,))
            if grid is not None and grid.shape[1] != 3:
                raise ValueError(f"{side}.{name}: expected shape [N, 3] (t, h, w), got {tuple(grid.shape)}")
        spans = tensor("modality_spans", (torch.int32,), (2,))
        if spans is not None and spans.shape[1] != 4:
            raise ValueError(f"{side}.modality_spans: expected shape [M, 4], got {tuple(spans.shape)}")


@dataclasses.dataclass
class Mismatch:
    """One difference. ``sample``: None for the batch as a whole; ``token``: the first mismatched token (counted
    from the sample's first attended token); ``span``: the tokens concerned, ``[start, end)``."""

    check: str
    message: str
    sample: int | None = None
    token: int | None = None
    span: tuple[int, int] | None = None

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class LayoutReport:
    """What :func:`compare_layouts` found: ``mismatches`` in report order (batch-level first, then by sample, in
    the order of :data:`CHECKS` within a sample), ``notes`` (what was not compared, fingerprints)."""

    samples: int
    compared: list[str]
    mismatches: list[Mismatch]
    notes: list[str]

    @property
    def passed(self) -> bool:
        return not self.mismatches

    @property
    def first(self) -> Mismatch | None:
        return self.mismatches[0] if self.mismatches else None

    def to_dict(self) -> dict:
        return {
            "passed": self.passed,
            "samples": self.samples,
            "compared": self.compared,
            "first": None if self.first is None else self.first.to_dict(),
            "mismatches": [m.to_dict() for m in self.mismatches],
            "notes": self.notes,
        }

    def format(self) -> str:
        if self.passed:
            lines = [f"layout parity: PASS ({self.samples} samples; compared {', '.join(self.compared)})"]
        else:
            lines = [
                f"layout parity: FAIL ({len(self.mismatches)} mismatch(es) over {self.samples} samples; "
                f"compared {', '.join(self.compared)})",
                f"first mismatch: {self.first.message}",
            ]
            if len(self.mismatches) > 1:
                lines += ["all mismatches:"] + [f"  [{m.check}] {m.message}" for m in self.mismatches]
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


# ---------------------------------------------------------------------------
# One side, one sample
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class _Medium:
    kind: str  # "image" / "video"
    index: int  # among the batch's items of that kind (its grid row)
    number: int  # among the sample's items of that kind
    start: int  # token index (from the sample's first attended token)
    end: int
    grid: list[int] | None


@dataclasses.dataclass
class _Row:
    first: int  # column of the first attended token (0 if none)
    ids: list[int]
    pad_side: str  # "left", "right", "none", "both"
    pad_count: int
    hole: int | None  # column of a 0 between attended tokens
    odd_value: tuple[int, float] | None  # (column, value) of an attention_mask value other than 0 / 1
    media: list[_Medium]
    positions: Tensor | None  # int64 [D, n]
    loss: Tensor | None  # bool [n]


def _runs(flags: Tensor) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of True in a 1-D bool tensor."""
    edges = torch.nn.functional.pad(flags.to(torch.int8), (1, 1)).diff()
    return list(zip((edges == 1).nonzero()[:, 0].tolist(), (edges == -1).nonzero()[:, 0].tolist()))


def _rows(enc: Encoding, tokens: VisionTokens) -> list[_Row]:
    mask = enc.attention_mask.cpu()
    ids = enc.input_ids.cpu()
    pos = enc.position_ids
    pos = None if pos is None else (pos.cpu() if pos.dim() == 3 else pos.cpu().unsqueeze(0))
    loss = None if enc.loss_mask is None else enc.loss_mask.cpu() != 0
    counters = {"image": 0, "video": 0}
    grids = {"image": enc.image_grid_thw, "video": enc.video_grid_thw}
    rows = []
    for b in range(ids.shape[0]):
        on = mask[b] != 0
        cols = on.nonzero()[:, 0]
        first, last = (int(cols[0]), int(cols[-1]) + 1) if cols.numel() else (0, 0)
        inside = mask[b, first:last]
        holes = (inside == 0).nonzero()
        odd = ((inside != 0) & (inside != 1)).nonzero()
        lead, trail = first, ids.shape[1] - last
        side = "both" if lead and trail else "left" if lead else "right" if trail else "none"
        content = ids[b, first:last]
        media = []
        for kind, token in (("image", tokens.image), ("video", tokens.video)):
            for start, end in _runs(content == token):
                media.append([start, end, kind])
        media.sort()
        numbers = {"image": 0, "video": 0}
        items = []
        for start, end, kind in media:
            grid = grids[kind]
            row = counters[kind]
            items.append(
                _Medium(
                    kind,
                    row,
                    numbers[kind],
                    start,
                    end,
                    grid[row].tolist() if grid is not None and row < grid.shape[0] else None,
                )
            )
            counters[kind] += 1
            numbers[kind] += 1
        rows.append(
            _Row(
                first=first,
                ids=content.tolist(),
                pad_side=side,
                pad_count=lead + trail,
                hole=first + int(holes[0, 0]) if holes.numel() else None,
                odd_value=(first + int(odd[0, 0]), float(inside[odd[0, 0]])) if odd.numel() else None,
                media=items,
                positions=None if pos is None else pos[:, b, first:last],
                loss=None if loss is None else loss[b, first:last],
            )
        )
    return rows


def _where(row: _Row, i: int) -> str:
    """Which part of the sample token ``i`` is in."""
    before = None
    for m in row.media:
        if m.start <= i < m.end:
            return f"{m.kind} {m.number}'s visual token {i - m.start}"
        if m.end <= i:
            before = m
    return "text before any media" if before is None else f"text after {before.kind} {before.number}"


def _positions(p: Tensor) -> str:
    values = p.tolist()
    return f"(t, h, w) = ({', '.join(map(str, values))})" if len(values) == 3 else str(values[0])


def _flatten(config: Mapping, prefix: str = "") -> dict:
    out = {}
    for key, value in config.items():
        if isinstance(value, Mapping):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# ---------------------------------------------------------------------------
# The comparison
# ---------------------------------------------------------------------------


def compare_layouts(
    rollout: Encoding | Mapping,
    training: Encoding | Mapping,
    *,
    tokens: VisionTokens = QWEN2_VL_TOKENS,
    check_padding_side: bool = True,
    token_text: Callable[[int], str] | None = None,
) -> LayoutReport:
    """Compare the rollout-side and the training-side encoding of the same samples.

    For each sample (row ``b`` of both sides), in this order, the first mismatch of each check:

    * ``media``: the number, kind, start and expanded length of each image / video placeholder run (a run of
      ``tokens.image`` or ``tokens.video`` ids), with the grids that explain a length difference;
    * ``media_spans``: on each side alone, each run's length against its ``*_grid_thw`` row
      (``t * h * w / merge**2``) and, if given, ``modality_spans`` against the runs;
    * ``tokens``: the attended token ids;
    * ``attention_mask``: values other than 0 / 1, zeros between attended tokens;
    * ``padding``: the side padding is on (unless ``check_padding_side=False``);
    * ``position_ids``: on attended tokens, 1-D or 3-D (``[3, B, T]``); a constant offset is named;
    * ``loss_mask``: visual tokens under the loss on either side, then any difference.

    A sample whose media or length differ is not compared further (its tokens do not line up).

    Args:
        rollout, training: :class:`Encoding` or mappings for :meth:`Encoding.from_mapping`.
        tokens: the vision token ids (default: Qwen2-VL's).
        check_padding_side: report samples padded on different sides.
        token_text: id -> text for the messages (e.g. a tokenizer's ``convert_ids_to_tokens``).

    Returns:
        A :class:`LayoutReport`; ``passed`` is True when nothing differs.
    """
    check_padding_side = flag("check_padding_side", check_padding_side)
    sides = []
    for name, enc in zip(_SIDES, (rollout, training)):
        enc = enc if isinstance(enc, Encoding) else Encoding.from_mapping(enc, side=name)
        enc.check(name)
        sides.append(enc)
    r_enc, t_enc = sides
    found: list[tuple[int, int, Mismatch]] = []

    def emit(check: str, message: str, sample: int | None = None, token=None, span=None) -> None:
        key = -1 if sample is None else sample
        found.append((key, CHECKS.index(check), Mismatch(check, message, sample, token, span)))

    def show(token: int) -> str:
        return f"{token} ({token_text(token)!r})" if token_text is not None else str(token)

    notes = []
    compared = ["token ids", "media placeholders", "attention masks"]
    if check_padding_side:
        compared.append("padding side")
    rows = {name: _rows(enc, tokens) for name, enc in zip(_SIDES, sides)}
    r_rows, t_rows = rows["rollout"], rows["training"]
    if len(r_rows) != len(t_rows):
        emit(
            "batch",
            f"batch size differs: {len(r_rows)} samples on the rollout side, {len(t_rows)} on the training "
            "side (the first ones compared)",
        )
    for name, enc in zip(_SIDES, sides):
        for kind in ("image", "video"):
            used = sum(m.kind == kind for row in rows[name] for m in row.media)
            grid = getattr(enc, f"{kind}_grid_thw")
            if grid is None and used:
                notes.append(f"no {kind}_grid_thw on the {name} side: its {kind} expansions not checked against grids")
            elif grid is not None and grid.shape[0] != used:
                emit(
                    "batch",
                    f"the {name} side: {kind}_grid_thw has {grid.shape[0]} rows but its tokens hold {used} {kind}(s) "
                    f"(runs of the {kind} placeholder id {getattr(tokens, kind)})",
                )
    positions = r_enc.position_ids is not None and t_enc.position_ids is not None
    if positions and r_enc.position_ids.dim() != t_enc.position_ids.dim():
        dims = {2: "[B, T]", 3: "[3, B, T] (multimodal rotary: temporal, height, width)"}
        emit(
            "batch",
            f"position_ids: {dims[r_enc.position_ids.dim()]} on the rollout side, "
            f"{dims[t_enc.position_ids.dim()]} on the training side",
        )
        positions = False
    elif positions:
        compared.append(f"position ids ({'[3, B, T]' if r_enc.position_ids.dim() == 3 else '[B, T]'})")
    else:
        missing = [n for n, e in zip(_SIDES, sides) if e.position_ids is None]
        notes.append(f"position_ids not compared (none on the {' and '.join(missing)} side)")
    losses = r_enc.loss_mask is not None and t_enc.loss_mask is not None
    if losses:
        compared.append("loss masks")
    else:
        missing = [n for n, e in zip(_SIDES, sides) if e.loss_mask is None]
        notes.append(f"loss_mask compared only for visual tokens (none on the {' and '.join(missing)} side)")
    if r_enc.processor_fingerprint and t_enc.processor_fingerprint:
        if r_enc.processor_fingerprint != t_enc.processor_fingerprint:
            notes.append(
                f"processor fingerprints differ: {r_enc.processor_fingerprint} (rollout) vs "
                f"{t_enc.processor_fingerprint} (training)"
            )
    if r_enc.processor_config is not None and t_enc.processor_config is not None:
        a, b = _flatten(r_enc.processor_config), _flatten(t_enc.processor_config)
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                notes.append(f"processor configs differ: {key} = {a.get(key)!r} (rollout) vs {b.get(key)!r} (training)")

    # each side alone: runs against grids and spans
    for name, enc in zip(_SIDES, sides):
        merge = tokens.spatial_merge_size
        for b, row in enumerate(rows[name]):
            for m in row.media:
                if m.grid is None:
                    continue
                expected = m.grid[0] * m.grid[1] * m.grid[2] // merge**2
                if expected != m.end - m.start:
                    emit(
                        "media_spans",
                        f"sample {b}: on the {name} side {m.kind} {m.number} has {m.end - m.start} "
                        f"placeholder tokens ({m.start}..{m.end - 1}) but its {m.kind}_grid_thw row {m.index} "
                        f"{m.grid} gives {expected} (merge {merge})",
                        b,
                        m.start,
                        (m.start, m.end),
                    )
                    break
        if enc.modality_spans is not None:
            derived = [
                (b, row.first + m.start, row.first + m.end, MODALITIES[m.kind])
                for b, row in enumerate(rows[name])
                for m in row.media
            ]
            given = [tuple(r) for r in enc.modality_spans.cpu().tolist()]
            for i, (want, got) in enumerate(zip(derived + [None] * len(given), given + [None] * len(derived))):
                if want != got:
                    b = (want or got)[0]
                    emit(
                        "media_spans",
                        f"sample {b}: on the {name} side modality_spans row {i} is {got} but the "
                        f"placeholder run is {want} (sequence, start, end, modality)",
                        b,
                    )
                    break

    for b, (r, t) in enumerate(zip(r_rows, t_rows)):
        # media placeholders
        kinds_r = [(m.kind, m.number) for m in r.media]
        kinds_t = [(m.kind, m.number) for m in t.media]
        first_diff = next((i for i, (x, y) in enumerate(zip(r.ids, t.ids)) if x != y), min(len(r.ids), len(t.ids)))
        if kinds_r != kinds_t:
            k = next((i for i, (x, y) in enumerate(zip(kinds_r, kinds_t)) if x != y), min(len(kinds_r), len(kinds_t)))
            more, fewer, extra = (
                ("rollout", "training", r.media) if len(r.media) > len(t.media) else ("training", "rollout", t.media)
            )
            count = {
                n: ", ".join(f"{sum(m.kind == kd for m in row.media)} {kd}(s)" for kd in ("image", "video"))
                for n, row in (("rollout", r), ("training", t))
            }
            m = extra[k] if k < len(extra) else None
            what = (
                f"{m.kind} {m.number} ({more} tokens {m.start}..{m.end - 1}) has no placeholder on the {fewer} side"
                if m is not None
                else "the media differ in kind"
            )
            emit(
                "media",
                f"sample {b}: {what}: rollout {count['rollout']}, training {count['training']}; the token ids "
                f"first differ at token {first_diff}",
                b,
                first_diff,
                None if m is None else (m.start, m.end),
            )
            continue
        stop = False
        for x, y in zip(r.media, t.media):
            name = f"{x.kind} {x.number}"
            if x.end - x.start != y.end - y.start:
                if x.grid is not None and y.grid is not None:
                    why = (
                        f"{x.kind}_grid_thw differs: rollout {x.grid}, training {y.grid}"
                        if x.grid != y.grid
                        else f"{x.kind}_grid_thw is {x.grid} on both sides: the placeholder count differs"
                    )
                else:
                    why = f"no {x.kind}_grid_thw on the {'rollout' if x.grid is None else 'training'} side"
                emit(
                    "media",
                    f"sample {b}: {name} expands to {x.end - x.start} tokens on the rollout side, "
                    f"{y.end - y.start} on the training side ({why})",
                    b,
                    x.start,
                    (x.start, x.end),
                )
                stop = True
                break
            if x.start != y.start:
                emit(
                    "media",
                    f"sample {b}: {name} starts at token {x.start} on the rollout side, {y.start} on the "
                    f"training side (the tokens before it first differ at token {first_diff})",
                    b,
                    first_diff,
                )
                stop = True
                break
            if x.grid is not None and y.grid is not None and x.grid != y.grid:
                emit(
                    "media",
                    f"sample {b}: {name} has {x.end - x.start} tokens on both sides but {x.kind}_grid_thw "
                    f"differs: rollout {x.grid}, training {y.grid} (its 3-D positions differ)",
                    b,
                    x.start,
                    (x.start, x.end),
                )
        if stop:
            continue
        # token ids
        if len(r.ids) != len(t.ids):
            at = f"token {first_diff}" if first_diff < min(len(r.ids), len(t.ids)) else "the end of the shorter"
            emit(
                "tokens",
                f"sample {b}: {len(r.ids)} tokens on the rollout side, {len(t.ids)} on the training side; "
                f"they first differ at {at}",
                b,
                first_diff,
            )
            continue
        if first_diff < len(r.ids):
            n = sum(x != y for x, y in zip(r.ids, t.ids))
            emit(
                "tokens",
                f"sample {b}: token {first_diff} ({_where(r, first_diff)}) differs: rollout "
                f"{show(r.ids[first_diff])}, training {show(t.ids[first_diff])} ({n} token(s) differ)",
                b,
                first_diff,
            )
        # attention masks
        for name, row in (("rollout", r), ("training", t)):
            if row.odd_value is not None:
                col, value = row.odd_value
                emit(
                    "attention_mask",
                    f"sample {b}: the {name} attention_mask holds {value:g} at column {col} (expected 0 or 1)",
                    b,
                    col - row.first,
                )
            if row.hole is not None:
                emit(
                    "attention_mask",
                    f"sample {b}: the {name} attention_mask is 0 at column {row.hole} between "
                    f"attended tokens (token {row.hole - row.first}, {_where(row, row.hole - row.first)}): not "
                    "padding",
                    b,
                    row.hole - row.first,
                )
        # padding side
        if check_padding_side and "none" not in (r.pad_side, t.pad_side) and r.pad_side != t.pad_side:
            emit(
                "padding",
                f"sample {b}: padding side differs: the rollout side pads on the {r.pad_side} "
                f"({r.pad_count} tokens), the training side on the {t.pad_side} ({t.pad_count} tokens)",
                b,
            )
        # position ids
        if positions:
            differ = (r.positions != t.positions).any(0).nonzero()
            if differ.numel():
                i = int(differ[0, 0])
                delta = t.positions[:, i:] - r.positions[:, i:]
                offset = int(delta[0, 0])
                if bool((delta == offset).all()):
                    tail = (
                        f"; training = rollout {'+' if offset > 0 else '-'} {abs(offset)} on every token from "
                        f"there to the end{' (off by one)' if abs(offset) == 1 else ''}"
                    )
                else:
                    tail = f"; {int((t.positions != r.positions).any(0).sum())} token(s) differ"
                emit(
                    "position_ids",
                    f"sample {b}: position ids differ from token {i} ({_where(r, i)}): rollout "
                    f"{_positions(r.positions[:, i])}, training {_positions(t.positions[:, i])}{tail}",
                    b,
                    i,
                )
        # loss masks: visual tokens first, then any difference
        explained = torch.zeros(len(r.ids), dtype=torch.bool)
        covering = {}
        for name, row in (("rollout", r), ("training", t)):
            if row.loss is None:
                continue
            for m in row.media:
                hit = row.loss[m.start : m.end].nonzero()
                if hit.numel():
                    lo, hi = m.start + int(hit[0, 0]), m.start + int(hit[-1, 0])
                    covering.setdefault((m.kind, m.number, lo, hi, m.start, m.end), []).append(name)
                    explained[m.start : m.end] = True
                    break
        for (kind, number, lo, hi, start, end), names in covering.items():
            where = "on both sides" if len(names) == 2 else f"on the {names[0]} side"
            whole = (
                f"all {end - start} of its tokens"
                if (lo, hi) == (start, end - 1)
                else f"{hi - lo + 1} of its {end - start} tokens {start}..{end - 1}"
            )
            emit(
                "loss_mask",
                f"sample {b}: the loss mask covers visual tokens {lo}..{hi} ({kind} {number}: {whole}) {where}",
                b,
                lo,
                (lo, hi + 1),
            )
        if losses:
            differ = (r.loss != t.loss) & ~explained
            if bool(differ.any()):
                i = int(differ.nonzero()[0, 0])
                emit(
                    "loss_mask",
                    f"sample {b}: loss masks differ from token {i} ({_where(r, i)}): rollout "
                    f"{int(r.loss[i])}, training {int(t.loss[i])} ({int(differ.sum())} token(s) differ)",
                    b,
                    i,
                )
    found.sort(key=lambda f: (f[0], f[1]))
    return LayoutReport(min(len(r_rows), len(t_rows)), compared, [m for *_, m in found], notes)
