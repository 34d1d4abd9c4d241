"""Batch invariance of a vision-language prefill: a random-weight Qwen2-VL or Qwen2.5-VL, rlk on vs stock kernels.

Builds ``transformers.Qwen2VLForConditionalGeneration`` (``--model qwen2-vl``, the default) or
``transformers.Qwen2_5_VLForConditionalGeneration`` (``--model qwen2.5-vl``) from a config (random weights, no
download): the vision tower (Conv3d patch embedding; Qwen2-VL: LayerNorm blocks and a GELU MLP, per-frame attention;
Qwen2.5-VL: RMSNorm blocks and a SwiGLU MLP, windowed attention over ``cu_window_seqlens`` in every block but the
full-attention ones of ``fullatt_block_indexes``, at least one of each), the merger and the language model (3-D
multimodal rotary positions). Samples are token ids around random uint8 images (``<|vision_start|>`` + image pads +
``<|vision_end|>``) and, with ``--video``, videos (4 frames: 2 temporal patches; ``<|video_pad|>`` tokens, ``t * h *
w / 4`` of them), then a response. Images run through transformers' Qwen2-VL image processor; a video's frames
run through it too, and each pair of consecutive frames is stacked into the temporal slots of its patches (the
layout of ``pixel_values_videos``; transformers' video processor needs torchvision). Positions come from
``get_rope_index`` (Qwen2-VL: :func:`rlk.multimodal.mrope_positions`; Qwen2.5-VL: the model's own, one second per
temporal patch).

Each sample's response log-probs (``log_softmax`` of the logits at the token before each response token, over the
batch's response rows) are
computed alone (batch 1, no padding, media processed fresh): the reference. Then each comparison recomputes them
in another prefill and checks ``torch.equal`` per sample:

* ``batch<N>-right`` / ``batch<N>-left``: all samples in one batch, right / left padded;
* ``images<K>-<side>`` (with videos: ``images<K>-videos<V>-<side>``): a smaller batch holding ``K`` images (``V``
  videos) in all (other samples, other media counts);
* ``pixel-cache``: the batch's pixel values taken from a per-item cache (each image or video processed once, alone)
  instead of one processor call over the batch's images (videos);
* ``embed-cache``: each image's and video's vision-tower output computed once, alone, and scattered into the input
  embeddings, instead of the vision tower running on the batch's media.

Run twice: ``rlk`` (``rlk.batch_invariant()`` + ``rlk.patch_model(model)``) and ``stock`` (PyTorch kernels). Prints
one line per comparison and chain (``bitwise-equal yes/no`` and the largest difference), the aten calls rlk served,
then a verdict. Exit code 1 when a comparison under rlk differs, or (with ``--expect-stock-drift``) when stock kernels
never drift; 2 when no batch-invariant backend serves the device (the CPU without ``TRITON_INTERPRET=1``).

Presets (``--preset``): ``8b`` (the default: the 7B models' language model, hidden 3584, 28 heads, 4 KV heads,
intermediate 18944, vocab 152064, 2 layers instead of 28; their vision tower, embed dim 1280, 16 heads, patch 14
(Qwen2.5-VL: MLP 3420, window 112 pixels), depth 2 instead of 32; bf16 on CUDA; images and frames of 224 to 448
pixels), ``small`` (a few hundred hidden units, bf16, for a GPU test) and ``tiny`` (fp32, a CPU smoke run: with
``TRITON_INTERPRET=1`` the triton backend runs rlk's kernels on the CPU, slowly). ``--layers`` / ``--vision-depth``
override the depths (Qwen2.5-VL: at least 2, so that both kinds of vision blocks run; its presets' depth is at
least 2). ``--quick`` runs the batches of all samples and the embedding cache only.

    python tools/vlm_invariance.py                       # on a GPU: the 8B-shaped Qwen2-VL, images
    python tools/vlm_invariance.py --model qwen2.5-vl --video
    TRITON_INTERPRET=1 python tools/vlm_invariance.py --preset tiny --device cpu
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import sys
import warnings
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor

PRESETS: dict[str, dict] = {
    "tiny": dict(
        hidden=64,
        layers=2,
        heads=4,
        kv_heads=2,
        intermediate=128,
        vocab=96,
        vision_embed=32,
        vision_depth=1,
        vision_heads=2,
        mlp_ratio=2,
        vision_intermediate=64,
        window=56,
        dtype="float32",
        image_sizes=((56, 56), (56, 84), (84, 56), (56, 112)),
        text=(2, 5),
        response=(3, 6),
    ),
    "small": dict(
        hidden=512,
        layers=2,
        heads=8,
        kv_heads=2,
        intermediate=1024,
        vocab=2048,
        vision_embed=256,
        vision_depth=2,
        vision_heads=4,
        mlp_ratio=4,
        vision_intermediate=1024,
        window=56,
        dtype="bfloat16",
        image_sizes=((112, 112), (112, 168), (168, 112), (224, 224)),
        text=(4, 16),
        response=(8, 24),
    ),
    "8b": dict(
        hidden=3584,
        layers=2,
        heads=28,
        kv_heads=4,
        intermediate=18944,
        vocab=152064,
        vision_embed=1280,
        vision_depth=2,
        vision_heads=16,
        mlp_ratio=4,
        vision_intermediate=3420,
        window=112,
        dtype="bfloat16",
        image_sizes=((224, 224), (224, 336), (336, 224), (448, 448)),
        text=(8, 32),
        response=(16, 64),
    ),
}

MODELS = ("qwen2-vl", "qwen2.5-vl")
PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE = 14, 2, 2
VIDEO_FRAMES = 4  # 2 temporal patches
#: Per sample, its media in order ("i": an image, "v": a video).
IMAGE_PLAN = ("i", "ii", "i", "")
VIDEO_PLAN = ("v", "iv", "", "")


# ---------------------------------------------------------------------------
# model, samples, batches
# ---------------------------------------------------------------------------


def special_tokens(vocab: int):
    """The vision token ids (the last four ids of the vocabulary) as a
    :class:`rlk.integrations.multimodal.schema.VisionTokens`."""
    from rlk.integrations.multimodal.schema import VisionTokens

    return VisionTokens(
        image=vocab - 4, video=vocab - 3, vision_start=vocab - 2, vision_end=vocab - 1, spatial_merge_size=MERGE_SIZE
    )


def full_attention_blocks(depth: int) -> list[int]:
    """Qwen2.5-VL's full-attention vision blocks: every 8th from the 8th (7, 15, 23, 31 of 32), or the last one of a
    shallower tower; the other blocks attend within windows."""
    return list(range(min(7, depth - 1), depth, 8))


def build_model(preset: dict, device: torch.device, seed: int = 0, model: str = "qwen2-vl"):
    """A random-weight ``Qwen2VLForConditionalGeneration`` (``model="qwen2-vl"``) or
    ``Qwen2_5_VLForConditionalGeneration`` (``"qwen2.5-vl"``) of ``preset``'s shape, eval mode, SDPA attention."""
    import transformers

    if model not in MODELS:
        raise ValueError(f"model: one of {MODELS}, got {model!r}")
    tokens = special_tokens(preset["vocab"])
    hidden, heads = preset["hidden"], preset["heads"]
    head_dim = hidden // heads
    section = head_dim // 2 // 4  # mrope sections (temporal, height, width) summing to head_dim / 2
    text_config = {
        "vocab_size": preset["vocab"],
        "hidden_size": hidden,
        "intermediate_size": preset["intermediate"],
        "num_hidden_layers": preset["layers"],
        "num_attention_heads": heads,
        "num_key_value_heads": preset["kv_heads"],
        "rope_scaling": {"type": "mrope", "mrope_section": [head_dim // 2 - 2 * section, section, section]},
        "max_position_embeddings": 32768,
        "bos_token_id": None,
        "eos_token_id": None,
    }
    vision_config = {
        "depth": preset["vision_depth"],
        "num_heads": preset["vision_heads"],
        "patch_size": PATCH_SIZE,
        "spatial_merge_size": MERGE_SIZE,
        "temporal_patch_size": TEMPORAL_PATCH_SIZE,
    }
    if model == "qwen2-vl":
        vision_config.update(embed_dim=preset["vision_embed"], hidden_size=hidden, mlp_ratio=preset["mlp_ratio"])
        config_class, model_class = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
    else:
        if preset["vision_depth"] < 2:
            raise ValueError("Qwen2.5-VL: vision_depth must be >= 2 (window and full-attention blocks)")
        vision_config.update(
            hidden_size=preset["vision_embed"],
            out_hidden_size=hidden,
            intermediate_size=preset["vision_intermediate"],
            window_size=preset["window"],
            fullatt_block_indexes=full_attention_blocks(preset["vision_depth"]),
        )
        config_class, model_class = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
    config = config_class(
        text_config=text_config,
        vision_config=vision_config,
        image_token_id=tokens.image,
        video_token_id=tokens.video,
        vision_start_token_id=tokens.vision_start,
        vision_end_token_id=tokens.vision_end,
    )
    config._attn_implementation = "sdpa"
    config.text_config._attn_implementation = "sdpa"
    config.vision_config._attn_implementation = "sdpa"
    dtype = getattr(torch, preset["dtype"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with torch.device(device):
            built = model_class(config)
    built = built.to(dtype=dtype).eval()
    built.rlk_vision_tokens = tokens
    built.rlk_model_name = model
    return built


def image_processor(preset: dict):
    """transformers' Qwen2-VL image processor (the PIL one on 5.x; Qwen2.5-VL uses the same), keeping the presets'
    image sizes."""
    import transformers

    cls = getattr(transformers, "Qwen2VLImageProcessorPil", None) or transformers.Qwen2VLImageProcessor
    largest = max(h * w for h, w in preset["image_sizes"])
    return cls(
        min_pixels=(PATCH_SIZE * MERGE_SIZE) ** 2,
        max_pixels=largest,
        patch_size=PATCH_SIZE,
        temporal_patch_size=TEMPORAL_PATCH_SIZE,
        merge_size=MERGE_SIZE,
    )


def is_video(item: Tensor) -> bool:
    """A media item: an image is uint8 ``[H, W, 3]``, a video uint8 ``[F, H, W, 3]``."""
    return item.dim() == 4


@dataclasses.dataclass
class Sample:
    """Text pieces around the media: ``texts[0]``, item 0, ``texts[1]``, item 1, ...; then the response. An item
    is an image (uint8 ``[H, W, 3]``) or a video (uint8 ``[F, H, W, 3]``)."""

    texts: list[list[int]]
    media: list[Tensor]
    response: list[int]

    @property
    def images(self) -> list[Tensor]:
        return [item for item in self.media if not is_video(item)]

    @property
    def videos(self) -> list[Tensor]:
        return [item for item in self.media if is_video(item)]


def make_samples(preset: dict, plan: Sequence[str] = IMAGE_PLAN, seed: int = 0) -> list[Sample]:
    """One sample per entry of ``plan`` (its media in order, ``"i"`` an image, ``"v"`` a video of
    ``VIDEO_FRAMES`` frames), drawn from ``torch.Generator(seed)``; images and frames cycle through the preset's
    sizes."""
    g = torch.Generator().manual_seed(seed)
    text_ids = preset["vocab"] - 5  # ids 1 .. vocab - 5: text; 0: padding; the last four: vision tokens
    sizes = preset["image_sizes"]

    def draw(low_high) -> list[int]:
        n = int(torch.randint(low_high[0], low_high[1] + 1, (), generator=g))
        return (torch.randint(1, text_ids, (n,), generator=g)).tolist()

    samples, k = [], 0
    for kinds in plan:
        media = []
        for kind in kinds:
            if kind not in "iv":
                raise ValueError(f"plan: 'i' (image) or 'v' (video) per item, got {kind!r}")
            h, w = sizes[k % len(sizes)]
            k += 1
            shape = (h, w, 3) if kind == "i" else (VIDEO_FRAMES, h, w, 3)
            media.append(torch.randint(0, 256, shape, generator=g, dtype=torch.uint8))
        samples.append(Sample([draw(preset["text"]) for _ in range(len(kinds) + 1)], media, draw(preset["response"])))
    return samples


class Pixels:
    """Images or videos to ``(pixel_values, grid_thw)`` through the image processor: fresh (one call over the
    batch's images, or over all the frames of the batch's videos) or from a per-item cache (each item processed
    once, alone)."""

    def __init__(self, processor) -> None:
        self.processor = processor
        self.cache: dict[int, tuple[Tensor, Tensor]] = {}

    def fresh(self, items: list[Tensor]) -> tuple[Tensor, Tensor]:
        """``items``: all images or all videos."""
        if not any(is_video(item) for item in items):
            out = self.processor(images=[image.numpy() for image in items], return_tensors="pt")
            return out["pixel_values"], out["image_grid_thw"]
        frames = [frame.numpy() for video in items for frame in video]
        out = self.processor(images=frames, return_tensors="pt")
        pixel_values, grids = out["pixel_values"], out["image_grid_thw"]
        parts, videos, row, f = [], [], 0, 0
        for video in items:
            n_frames = video.shape[0]
            grid = grids[f]
            if n_frames % TEMPORAL_PATCH_SIZE or not bool((grids[f : f + n_frames] == grid).all()):
                raise ValueError("a video's frames: one size, a multiple of the temporal patch size in number")
            n = int(grid.prod())
            parts.append(video_patches(pixel_values[row : row + n * n_frames], n_frames, n))
            videos.append([n_frames // TEMPORAL_PATCH_SIZE, int(grid[1]), int(grid[2])])
            row, f = row + n * n_frames, f + n_frames
        return torch.cat(parts), torch.tensor(videos, dtype=grids.dtype)

    def cached(self, items: list[Tensor]) -> tuple[Tensor, Tensor]:
        parts = []
        for item in items:
            if id(item) not in self.cache:
                self.cache[id(item)] = self.fresh([item])
            parts.append(self.cache[id(item)])
        return torch.cat([p for p, _ in parts]), torch.cat([g for _, g in parts])


def video_patches(frame_patches: Tensor, n_frames: int, n: int) -> Tensor:
    """A video's ``pixel_values_videos`` rows ``[t * n, C * tp * p * p]`` from its frames' image-processor rows
    ``[n_frames * n, C * tp * p * p]`` (``n`` patches a frame; each frame's temporal slots hold copies of it):
    temporal patch ``j`` takes frames ``tp j .. tp j + tp - 1`` into its slots; the patch order within a frame (merge
    blocks) is the image processor's."""
    tp = TEMPORAL_PATCH_SIZE
    per_frame = frame_patches.view(n_frames, n, 3, tp, PATCH_SIZE * PATCH_SIZE)[:, :, :, 0]  # [F, n, C, p * p]
    grouped = per_frame.view(n_frames // tp, tp, n, 3, PATCH_SIZE * PATCH_SIZE).permute(0, 2, 3, 1, 4)
    return grouped.reshape(n_frames // tp * n, 3 * tp * PATCH_SIZE * PATCH_SIZE)


def sample_ids(sample: Sample, image_grids: Tensor, video_grids: Tensor, tokens) -> tuple[list[int], int]:
    """The sample's token ids (each item's pads expanded to its grid's merged token count: image pads for an image,
    video pads for a video) and its response length."""
    ids = list(sample.texts[0])
    grids = {False: iter(image_grids.tolist()), True: iter(video_grids.tolist())}
    for item, text in zip(sample.media, sample.texts[1:]):
        t, h, w = next(grids[is_video(item)])
        pad = tokens.video if is_video(item) else tokens.image
        ids += [tokens.vision_start] + [pad] * (t * h * w // MERGE_SIZE**2) + [tokens.vision_end] + text
    return ids + sample.response, len(sample.response)


def rope_positions(model, input_ids: Tensor, mask: Tensor, image_grids: Tensor | None, video_grids: Tensor | None):
    """The 3-D rotary positions ``[3, B, T]``: Qwen2-VL's by :func:`rlk.multimodal.mrope_positions`, Qwen2.5-VL's by
    the model's ``get_rope_index`` (one second per temporal patch)."""
    tokens = model.rlk_vision_tokens
    if getattr(model, "rlk_model_name", "qwen2-vl") == "qwen2-vl":
        from rlk.integrations.multimodal.processor import mrope_positions

        return mrope_positions(input_ids, mask, tokens, image_grid_thw=image_grids, video_grid_thw=video_grids)
    get_rope_index = model.model.get_rope_index
    extra = {}
    if "mm_token_type_ids" in inspect.signature(get_rope_index).parameters:  # transformers 5.x
        extra["mm_token_type_ids"] = (input_ids == tokens.image).int() + 2 * (input_ids == tokens.video).int()
    seconds = None if video_grids is None else torch.ones(len(video_grids))
    device = model.model.visual.device if hasattr(model.model, "visual") else input_ids.device
    with torch.no_grad():
        positions, _ = get_rope_index(
            input_ids.to(device),
            image_grid_thw=None if image_grids is None else image_grids.to(device),
            video_grid_thw=None if video_grids is None else video_grids.to(device),
            second_per_grid_ts=None if seconds is None else seconds.to(device),
            attention_mask=mask.to(device),
            **{key: value.to(device) for key, value in extra.items()},
        )
    return positions.long().cpu()


@dataclasses.dataclass
class Batch:
    input_ids: Tensor  # [B, T]
    attention_mask: Tensor  # [B, T]
    position_ids: Tensor  # [3, B, T]
    pixel_values: Tensor | None
    image_grid_thw: Tensor | None
    rows: list[tuple[slice, int]]  # per sample: its real tokens, its response length
    pixel_values_videos: Tensor | None = None
    video_grid_thw: Tensor | None = None


def make_batch(samples: Sequence[Sample], side: str, pixels: Pixels, model, device, cache: bool = False) -> Batch:
    """``samples`` padded (pad id 0) on ``side``; their images and videos through ``pixels`` (``cache``: the
    per-item cache)."""
    tokens = model.rlk_vision_tokens
    encode = pixels.cached if cache else pixels.fresh
    images = [image for sample in samples for image in sample.images]
    videos = [video for sample in samples for video in sample.videos]
    pixel_values, image_grids = encode(images) if images else (None, None)
    video_values, video_grids = encode(videos) if videos else (None, None)
    none = torch.zeros(0, 3, dtype=torch.long)
    seqs, i, v = [], 0, 0
    for sample in samples:
        n_i, n_v = len(sample.images), len(sample.videos)
        mine_i = image_grids[i : i + n_i] if n_i else none
        mine_v = video_grids[v : v + n_v] if n_v else none
        seqs.append(sample_ids(sample, mine_i, mine_v, tokens))
        i, v = i + n_i, v + n_v
    length = max(len(ids) for ids, _ in seqs)
    input_ids = torch.zeros(len(seqs), length, dtype=torch.long)
    mask = torch.zeros(len(seqs), length, dtype=torch.long)
    rows = []
    for b, (ids, response) in enumerate(seqs):
        part = slice(0, len(ids)) if side == "right" else slice(length - len(ids), length)
        input_ids[b, part] = torch.tensor(ids)
        mask[b, part] = 1
        rows.append((part, response))
    positions = rope_positions(model, input_ids, mask, image_grids, video_grids)

    def to(x: Tensor | None) -> Tensor | None:
        return None if x is None else x.to(device)

    return Batch(
        input_ids.to(device),
        mask.to(device),
        positions.to(device),
        to(pixel_values),
        to(image_grids),
        rows,
        to(video_values),
        to(video_grids),
    )


def media_embeddings(model, pixels: Pixels, item: Tensor, device) -> Tensor:
    """One image's or video's vision-tower output (merged tokens ``[n, hidden]``), computed alone: what an
    embedding cache stores."""
    pixel_values, grid = pixels.cached([item])
    visual = model.model.visual
    out = visual(pixel_values.to(device, visual.dtype), grid_thw=grid.to(device))
    return getattr(out, "pooler_output", out)  # transformers 5.x: the merged tokens; 4.x: the tensor itself


def response_logprobs(model, batch: Batch, embeds: list[Tensor] | None = None) -> list[Tensor]:
    """Per sample: fp32 log-probs of its response tokens ``[R]``. ``embeds``: the batch's media's cached vision
    outputs, images first then videos, each in order (scattered into the input embeddings; the vision tower does
    not run)."""
    kwargs = dict(attention_mask=batch.attention_mask, position_ids=batch.position_ids, use_cache=False)
    if embeds is None:
        media = {}
        if batch.pixel_values is not None:
            media.update(pixel_values=batch.pixel_values, image_grid_thw=batch.image_grid_thw)
        if batch.pixel_values_videos is not None:
            media.update(pixel_values_videos=batch.pixel_values_videos, video_grid_thw=batch.video_grid_thw)
        out = model(input_ids=batch.input_ids, **media, **kwargs)
    else:
        inputs_embeds = model.get_input_embeddings()(batch.input_ids)
        start = 0
        for token in (model.config.image_token_id, model.config.video_token_id):
            where = batch.input_ids == token
            count = int(where.sum())
            if count:
                rows = torch.cat(embeds)[start : start + count].to(inputs_embeds.dtype)
                inputs_embeds = inputs_embeds.masked_scatter(where.unsqueeze(-1).expand_as(inputs_embeds), rows)
                start += count
        out = model(inputs_embeds=inputs_embeds, **kwargs)
    rows, targets = [], []  # the logits predicting each response token, and the token
    for b, (part, response) in enumerate(batch.rows):
        positions = torch.arange(part.stop - response, part.stop, device=out.logits.device)
        rows.append(out.logits[b, positions - 1])
        targets.append(batch.input_ids[b, positions])
    logp = torch.cat(rows).float().log_softmax(-1).gather(-1, torch.cat(targets)[:, None])[:, 0]
    return list(logp.split([response for _, response in batch.rows]))


# ---------------------------------------------------------------------------
# the comparisons
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Comparison:
    name: str
    sample: int
    equal: bool
    max_diff: float


def comparisons(model, samples: list[Sample], pixels: Pixels, device, quick: bool = False) -> list[Comparison]:
    """Every comparison of the module docstring, against each sample alone (``quick``: the smaller batches and the
    pixel cache left out)."""
    with torch.no_grad():
        alone = [response_logprobs(model, make_batch([s], "right", pixels, model, device))[0] for s in samples]
        results: list[Comparison] = []

        def check(name: str, members: list[int], side: str, cache: str = "off") -> None:
            batch = make_batch([samples[i] for i in members], side, pixels, model, device, cache=cache == "pixel")
            embeds = None
            if cache == "embed":
                images = [image for i in members for image in samples[i].images]
                videos = [video for i in members for video in samples[i].videos]
                embeds = [media_embeddings(model, pixels, item, device) for item in images + videos]
            for i, got in zip(members, response_logprobs(model, batch, embeds)):
                diff = (got - alone[i]).abs().max().item() if got.numel() else 0.0
                results.append(Comparison(name, i, torch.equal(got, alone[i]), diff))

        everyone = list(range(len(samples)))
        for side in ("right", "left"):
            check(f"batch{len(samples)}-{side}", everyone, side)
        any_video = any(s.videos for s in samples)
        if not quick:
            # smaller batches: other neighbours, other media counts (with the default plans the first sample has
            # one item, the second two, the fourth none)
            for members, side in (([1, 0], "left"), ([3, 0], "right")):
                images = sum(len(samples[i].images) for i in members)
                videos = sum(len(samples[i].videos) for i in members)
                check(f"images{images}-videos{videos}-{side}" if any_video else f"images{images}-{side}", members, side)
        if not quick:
            check("pixel-cache", [2, 1], "right", cache="pixel")
        check("embed-cache", [0, 3, 2], "left", cache="embed")
    return results


@contextlib.contextmanager
def rlk_chain(model) -> Iterator[None]:
    """``rlk.batch_invariant()`` + ``rlk.patch_model(model)`` for the block (unpatched after it)."""
    import rlk

    rlk.patch_model(model)
    try:
        with rlk.batch_invariant():
            yield
    finally:
        rlk.unpatch_model(model)


def resolve(preset: dict, model: str = "qwen2-vl") -> dict:
    """``preset`` for ``model``: Qwen2.5-VL's vision tower gets at least 2 blocks (a window and a full-attention
    one)."""
    if model not in MODELS:
        raise ValueError(f"model: one of {MODELS}, got {model!r}")
    preset = dict(preset)
    if model == "qwen2.5-vl":
        preset["vision_depth"] = max(2, preset["vision_depth"])
    return preset


def run(
    preset: dict,
    device: torch.device,
    seed: int = 0,
    chains: Sequence[str] = ("rlk", "stock"),
    model: str = "qwen2-vl",
    video: bool = False,
    quick: bool = False,
    plan: Sequence[str] | None = None,
) -> dict:
    """``{chain: [Comparison]}`` for a ``model`` and samples of ``preset``: ``plan``'s media (4 samples), by default
    :data:`VIDEO_PLAN`'s with ``video``, else :data:`IMAGE_PLAN`'s."""
    if plan is None:
        plan = VIDEO_PLAN if video else IMAGE_PLAN
    if len(plan) != 4:
        raise ValueError(f"plan: 4 samples (the comparisons' batches), got {len(plan)}")
    built = build_model(preset, device, seed, model)
    samples = make_samples(preset, plan, seed=seed)
    pixels = Pixels(image_processor(preset))
    results = {}
    for chain in chains:
        context = rlk_chain(built) if chain == "rlk" else contextlib.nullcontext()
        with context:
            results[chain] = comparisons(built, samples, pixels, device, quick)
    return results


def report(results: dict, out=sys.stdout) -> None:
    for chain, rows in results.items():
        for row in rows:
            verdict = "yes" if row.equal else "no"
            where = f"{chain:5s}  {row.name:14s}  sample {row.sample}"
            print(f"{where}  bitwise-equal {verdict:3s}  max|diff| {row.max_diff:.3e}", file=out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, default="qwen2-vl")
    parser.add_argument("--video", action="store_true", help="samples with videos (and images): VIDEO_PLAN")
    parser.add_argument("--quick", action="store_true", help="only the batches of all samples and the embedding cache")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="8b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, help="language model layers (default: the preset's)")
    parser.add_argument("--vision-depth", type=int, help="vision tower blocks (default: the preset's)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="default: the preset's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-stock", action="store_true", help="skip the stock-kernel run (negative control)")
    parser.add_argument("--expect-stock-drift", action="store_true", help="also fail when stock kernels never drift")
    args = parser.parse_args(argv)
    preset = resolve(PRESETS[args.preset], args.model)
    for key, value in (("layers", args.layers), ("vision_depth", args.vision_depth), ("dtype", args.dtype)):
        if value is not None:
            if key != "dtype" and value < 1:
                parser.error(f"--{key.replace('_', '-')} must be >= 1")
            preset[key] = value
    if args.model == "qwen2.5-vl" and preset["vision_depth"] < 2:
        parser.error("--vision-depth must be >= 2 for qwen2.5-vl (a window and a full-attention block)")
    device = torch.device(args.device)
    chains = ("rlk",) if args.no_stock else ("rlk", "stock")
    from rlk.integrations.batch_invariant import served_calls

    start = dict(served_calls)
    from rlk.core.dispatch import BackendError

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            results = run(preset, device, args.seed, chains, model=args.model, video=args.video, quick=args.quick)
        except BackendError as err:  # e.g. the CPU without TRITON_INTERPRET=1
            print(f"error: {err}", file=sys.stderr)
            return 2
    print(f"model: {args.model}, preset {args.preset}, {'images and videos' if args.video else 'images'}")
    report(results)
    served = {op: n - start.get(op, 0) for op, n in served_calls.items() if n > start.get(op, 0)}
    print("aten calls rlk served: " + (", ".join(f"{op} {n}" for op, n in sorted(served.items())) or "none"))
    fallbacks = sorted({str(w.message) for w in caught if "rlk" in str(w.message)})
    for message in fallbacks:
        print(f"warning: {message}")
    rlk_ok = all(row.equal for row in results["rlk"])
    print(f"rlk:   {'all bitwise-equal' if rlk_ok else 'NOT batch-invariant'}")
    failed = not rlk_ok
    if "stock" in results:
        drift = not all(row.equal for row in results["stock"])
        print(f"stock: {'drifts (negative control holds)' if drift else 'no drift seen'}")
        failed |= args.expect_stock_drift and not drift
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
