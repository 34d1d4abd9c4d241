"""Synthetic multimodal batches from a seed: image-text, multi-image, short-video and GUI-trajectory.

:func:`synthetic_batch` builds an encoded :class:`~rlk.integrations.multimodal.schema.MultimodalBatch` (tiny
vocabulary :data:`FIXTURE_TOKENS`, no processor); :func:`synthetic_samples` builds raw samples (text with
Qwen2-VL image placeholders, uint8 images) for a real processor. Same seed, same bits; torch only.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from rlk.core.checks import choice, integer
from rlk.integrations.multimodal.schema import (
    MODALITIES,
    SPAN_DTYPE,
    MultimodalBatch,
    VisionTokens,
    media_cache_key,
    processor_fingerprint,
)

KINDS = ("image-text", "multi-image", "video", "gui-trajectory")
#: The fixtures' vision token ids (a 64-token vocabulary: 0 padding, 4-7 vision tokens, 8-63 text).
FIXTURE_TOKENS = VisionTokens(image=6, video=7, vision_start=4, vision_end=5, spatial_merge_size=2)
PAD_ID = 0
VOCAB_SIZE = 64
_TEXT_IDS = (8, VOCAB_SIZE)
#: Screen sizes (width, height) of the GUI fixtures' screenshots.
SCREENS = ((1280, 720), (1920, 1080), (1080, 2340))
#: The words of :func:`synthetic_samples`' text (a processor's tokenizer trained on them knows every word).
WORDS = (
    "describe the image in one sentence what is shown here compare these pictures which one is larger click on "
    "button open settings menu type your name scroll down the page find search box answer a cat dog red blue car "
    "tree left right top bottom and then done"
).split()
_FINGERPRINT = processor_fingerprint({"processor": "rlk synthetic fixtures", "patch_size": 14, "merge_size": 2})


def _randint(g: torch.Generator, low: int, high: int) -> int:
    """An int in ``[low, high]`` from ``g``."""
    return int(torch.randint(low, high + 1, (1,), generator=g))


def _text(g: torch.Generator, low: int, high: int) -> list[int]:
    return torch.randint(*_TEXT_IDS, (_randint(g, low, high),), generator=g).tolist()


def _pick(g: torch.Generator, options: tuple) -> object:
    return options[_randint(g, 0, len(options) - 1)]


@dataclasses.dataclass
class _Sample:
    """One sequence under construction: its tokens and the spans found while laying it out."""

    ids: list[int] = dataclasses.field(default_factory=list)
    media: list[tuple[int, int, int, tuple[int, int, int]]] = dataclasses.field(default_factory=list)
    loss: list[tuple[int, int, int]] = dataclasses.field(default_factory=list)
    regions: list[tuple[int, int, int, list[float]]] = dataclasses.field(default_factory=list)
    actions: list[tuple[int, int, int, list[float]]] = dataclasses.field(default_factory=list)
    screens: list[tuple[int, int]] = dataclasses.field(default_factory=list)

    def text(self, ids: list[int]) -> None:
        self.ids += ids

    def medium(self, modality: str, grid: tuple[int, int, int], screen=(0, 0)) -> int:
        """Append ``<vision_start>``, the placeholders, ``<vision_end>``; return the item's index in the sample."""
        merge = FIXTURE_TOKENS.spatial_merge_size
        count = grid[0] * grid[1] * grid[2] // merge**2
        token = FIXTURE_TOKENS.image if modality == "image" else FIXTURE_TOKENS.video
        self.ids.append(FIXTURE_TOKENS.vision_start)
        self.media.append((len(self.ids), len(self.ids) + count, MODALITIES[modality], grid))
        self.ids += [token] * count + [FIXTURE_TOKENS.vision_end]
        self.screens.append(screen)
        return len(self.media) - 1

    def response(self, ids: list[int], turn: int) -> int:
        start = len(self.ids)
        self.loss.append((start, start + len(ids), turn))
        self.ids += ids
        return start


def _image_grid(g: torch.Generator) -> tuple[int, int, int]:
    return (1, _pick(g, (4, 6, 8)), _pick(g, (4, 6, 8)))


def _sample(kind: str, g: torch.Generator) -> _Sample:
    s = _Sample()
    if kind == "image-text":
        s.text(_text(g, 2, 6))
        s.medium("image", _image_grid(g))
        s.text(_text(g, 2, 5))
        s.response(_text(g, 3, 8), turn=0)
    elif kind == "multi-image":
        s.text(_text(g, 2, 4))
        for _ in range(_randint(g, 2, 3)):
            s.medium("image", _image_grid(g))
            s.text(_text(g, 1, 3))
        s.response(_text(g, 3, 8), turn=0)
    elif kind == "video":
        s.text(_text(g, 2, 4))
        s.medium("video", (_pick(g, (2, 3)), _pick(g, (4, 6)), _pick(g, (4, 6))))
        s.text(_text(g, 2, 4))
        s.response(_text(g, 3, 8), turn=0)
    else:  # gui-trajectory: per turn a screenshot, an instruction, an action and (for clicks) the target's box
        for turn in range(_randint(g, 2, 3)):
            width, height = _pick(g, SCREENS)
            item = s.medium("image", (1, 2 * round(height / 224), 2 * round(width / 224)), screen=(width, height))
            s.text(_text(g, 2, 4))
            clicks = _randint(g, 0, 2) > 0
            action, box = _text(g, 3, 3), _text(g, 4, 4) if clicks else []
            start = s.response(action + box, turn=turn)
            if clicks:
                x = float(torch.rand((), generator=g)) * (width - 1)
                y = float(torch.rand((), generator=g)) * (height - 1)
                half = 8.0 + 40.0 * float(torch.rand((), generator=g))
                bbox = [max(x - half, 0.0), max(y - half, 0.0), min(x + half, width), min(y + half, height)]
                s.actions.append((start, start + 3, item, [x, y]))
                s.regions.append((start + 3, start + 7, item, bbox))
            else:
                s.actions.append((start, start + 3, item, [float("nan"), float("nan")]))
    return s


def synthetic_batch(
    kind: str, *, seed: int = 0, batch_size: int = 4, padding_side: str = "right", device="cpu"
) -> MultimodalBatch:
    """A valid :class:`MultimodalBatch` of ``batch_size`` random sequences of ``kind`` (:data:`KINDS`), the same
    for the same arguments.

    Token ids come from :data:`FIXTURE_TOKENS` (64-token vocabulary, padding id 0); each media item is
    ``<vision_start>``, ``t * h * w / 4`` placeholders, ``<vision_end>``; ``position_ids`` are 1-D (int64
    ``[B, T]``, counting attended tokens). ``"gui-trajectory"``: two or three turns per sequence (screenshot,
    instruction, action; a click has a point and a target box, in pixels of its screenshot; a typing action has a
    NaN point), loss spans tagged with the turn.
    """
    choice("kind", kind, KINDS)
    choice("padding_side", padding_side, ("left", "right"))
    integer("batch_size", batch_size, minimum=1)
    g = torch.Generator().manual_seed(integer("seed", seed))
    samples = [_sample(kind, g) for _ in range(batch_size)]
    length = max(len(s.ids) for s in samples)
    ids = torch.full((batch_size, length), PAD_ID, dtype=torch.int64)
    mask = torch.zeros(batch_size, length, dtype=torch.int64)
    media, loss, regions, actions, grids, screens, boxes, points = [], [], [], [], [], [], [], []
    for b, s in enumerate(samples):
        shift = length - len(s.ids) if padding_side == "left" else 0
        ids[b, shift : shift + len(s.ids)] = torch.tensor(s.ids)
        mask[b, shift : shift + len(s.ids)] = 1
        first = len(media)
        media += [(b, start + shift, end + shift, tag) for start, end, tag, _ in s.media]
        grids += [grid for *_, grid in s.media]
        screens += s.screens
        loss += [(b, start + shift, end + shift, turn) for start, end, turn in s.loss]
        regions += [(b, start + shift, end + shift, first + item) for start, end, item, _ in s.regions]
        actions += [(b, start + shift, end + shift, first + item) for start, end, item, _ in s.actions]
        boxes += [box for *_, box in s.regions]
        points += [point for *_, point in s.actions]

    def table(rows) -> Tensor:
        return torch.tensor(rows, dtype=SPAN_DTYPE).reshape(-1, 4).to(device)

    media_ids = torch.randint(0, 10**6, (len(media),), generator=g, dtype=torch.int64)
    lengths = torch.tensor([end - start for _, start, end, _ in media], dtype=SPAN_DTYPE)
    offsets = torch.nn.functional.pad(lengths.cumsum(0, dtype=SPAN_DTYPE), (1, 0))
    keys = tuple(
        media_cache_key(f"{int(i)}:{grid}".encode(), _FINGERPRINT) for i, grid in zip(media_ids.tolist(), grids)
    )
    gui = kind == "gui-trajectory"
    return MultimodalBatch(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        position_ids=(mask.cumsum(1) - 1).clamp(min=0).to(device),
        media_ids=media_ids.to(device),
        modality_spans=table(media),
        loss_spans=table(loss),
        vision_token_offsets=offsets.to(device),
        media_cache_keys=keys,
        processor_fingerprint=_FINGERPRINT,
        media_grid_thw=torch.tensor(grids, dtype=torch.int64).reshape(-1, 3).to(device),
        region_spans=table(regions) if gui else None,
        bbox_targets=torch.tensor(boxes, dtype=torch.float32).reshape(-1, 4).to(device) if gui else None,
        action_spans=table(actions) if gui else None,
        point_targets=torch.tensor(points, dtype=torch.float32).reshape(-1, 2).to(device) if gui else None,
        coordinate_system="pixels" if gui else None,
        screen_size=torch.tensor(screens, dtype=torch.int64).reshape(-1, 2).to(device) if gui else None,
    )


@dataclasses.dataclass
class RawSample:
    """One sample before a processor: ``prompt`` text with one ``<|vision_start|><|image_pad|><|vision_end|>``
    per image, ``images`` uint8 ``[H, W, 3]`` in that order, and the ``response`` text (what the loss covers)."""

    prompt: str
    images: list[Tensor]
    response: str


IMAGE_PLACEHOLDER = "<|vision_start|><|image_pad|><|vision_end|>"


def synthetic_samples(
    kind: str, *, seed: int = 0, batch_size: int = 4, image_size: tuple[int, int] | None = None
) -> list[RawSample]:
    """Raw samples of ``kind`` (``"image-text"``, ``"multi-image"`` or ``"gui-trajectory"``: images only, the
    offline processor has no video path) with words from :data:`WORDS` and random uint8 images of
    ``image_size`` (height, width), or of sizes drawn from 112..336 pixels."""
    choice("kind", kind, ("image-text", "multi-image", "gui-trajectory"))
    integer("batch_size", batch_size, minimum=1)
    g = torch.Generator().manual_seed(integer("seed", seed))

    def words(low: int, high: int) -> str:
        picks = torch.randint(0, len(WORDS), (_randint(g, low, high),), generator=g).tolist()
        return " ".join(WORDS[i] for i in picks)

    def image() -> Tensor:
        h, w = image_size or (_pick(g, (112, 168, 224, 336)), _pick(g, (112, 168, 224, 336)))
        return torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8)

    samples = []
    for _ in range(batch_size):
        count = {"image-text": 1, "multi-image": _randint(g, 2, 3), "gui-trajectory": 1}[kind]
        parts = [words(2, 5)]
        for _ in range(count):
            parts += [IMAGE_PLACEHOLDER, words(1, 4)]
        samples.append(RawSample(" ".join(parts), [image() for _ in range(count)], words(3, 8)))
    return samples
