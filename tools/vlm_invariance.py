"""Batch invariance of a vision-language prefill: a random-weight Qwen2-VL, rlk's chain on vs stock kernels.

Builds ``transformers.Qwen2VLForConditionalGeneration`` from a config (random weights, no download): the vision
tower (Conv3d patch embedding, LayerNorm blocks, per-image attention), the merger (LayerNorm + MLP) and the
language model (3-D multimodal rotary positions). Samples are token ids around one or more random uint8 images
(``<|vision_start|>`` + image pads + ``<|vision_end|>``), the images run through transformers' Qwen2-VL image
processor, and a response; positions come from ``get_rope_index`` (:func:`rlk.multimodal.mrope_positions`).

Each sample's response log-probs (``log_softmax`` of the logits at the token before each response token) are
computed alone (batch 1, no padding, images processed fresh): the reference. Then each comparison recomputes them
in another prefill and checks ``torch.equal`` per sample:

* ``batch<N>-right`` / ``batch<N>-left``: all samples in one batch, right / left padded;
* ``images<K>-<side>``: a smaller batch holding ``K`` images in all (other samples, other image counts);
* ``pixel-cache``: the batch's ``pixel_values`` taken from a per-image cache (each image processed once, alone)
  instead of one processor call over the batch's images;
* ``embed-cache``: the images' vision-tower outputs computed once per image (alone) and scattered into the input
  embeddings, instead of the vision tower running on the batch's images.

Run twice: ``rlk`` (``rlk.batch_invariant()`` + ``rlk.patch_model(model)``) and ``stock`` (PyTorch kernels). Prints
one line per comparison and chain (``bitwise-equal yes/no`` and the largest difference), the aten calls rlk served,
then a verdict. Exit code 1 when a comparison under rlk differs, or (with ``--expect-stock-drift``) when stock kernels
never drift; 2 when no batch-invariant backend serves the device (the CPU without ``TRITON_INTERPRET=1``).

Presets (``--preset``): ``8b`` (the default: Qwen2-VL-7B's language model, hidden 3584, 28 heads, 4 KV heads,
intermediate 18944, vocab 152064, 2 layers instead of 28; its vision tower, embed dim 1280, 16 heads, patch 14, depth
2 instead of 32; bf16 on CUDA; images of 224 to 448 pixels), ``small`` (a few hundred hidden units, bf16, for a GPU
test) and ``tiny`` (fp32, a CPU smoke run: with ``TRITON_INTERPRET=1`` the triton backend runs rlk's kernels on the
CPU, slowly). ``--layers`` / ``--vision-depth`` override the depths.

    python tools/vlm_invariance.py                       # on a GPU: the 8B-shaped model
    TRITON_INTERPRET=1 python tools/vlm_invariance.py --preset tiny --device cpu
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
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
        dtype="bfloat16",
        image_sizes=((224, 224), (224, 336), (336, 224), (448, 448)),
        text=(8, 32),
        response=(16, 64),
    ),
}

PATCH_SIZE, MERGE_SIZE, TEMPORAL_PATCH_SIZE = 14, 2, 2


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


def build_model(preset: dict, device: torch.device, seed: int = 0):
    """A random-weight ``Qwen2VLForConditionalGeneration`` of ``preset``'s shape, eval mode, SDPA attention."""
    import transformers

    tokens = special_tokens(preset["vocab"])
    hidden, heads = preset["hidden"], preset["heads"]
    head_dim = hidden // heads
    section = head_dim // 2 // 4  # mrope sections (temporal, height, width) summing to head_dim / 2
    config = transformers.Qwen2VLConfig(
        text_config={
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
        },
        vision_config={
            "depth": preset["vision_depth"],
            "embed_dim": preset["vision_embed"],
            "hidden_size": hidden,
            "num_heads": preset["vision_heads"],
            "mlp_ratio": preset["mlp_ratio"],
            "patch_size": PATCH_SIZE,
            "spatial_merge_size": MERGE_SIZE,
            "temporal_patch_size": TEMPORAL_PATCH_SIZE,
        },
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
            model = transformers.Qwen2VLForConditionalGeneration(config)
    model = model.to(dtype=dtype).eval()
    model.rlk_vision_tokens = tokens
    return model


def image_processor(preset: dict):
    """transformers' Qwen2-VL image processor (the PIL one on 5.x), keeping the presets' image sizes."""
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


@dataclasses.dataclass
class Sample:
    """Text pieces around the images: ``texts[0]``, image 0, ``texts[1]``, image 1, ...; then the response."""

    texts: list[list[int]]
    images: list[Tensor]  # uint8 [H, W, 3]
    response: list[int]


def make_samples(preset: dict, image_counts: Sequence[int] = (1, 2, 1, 0), seed: int = 0) -> list[Sample]:
    """One sample per entry of ``image_counts`` (that many images each), drawn from ``torch.Generator(seed)``."""
    g = torch.Generator().manual_seed(seed)
    text_ids = preset["vocab"] - 5  # ids 1 .. vocab - 5: text; 0: padding; the last four: vision tokens
    sizes = preset["image_sizes"]

    def draw(low_high) -> list[int]:
        n = int(torch.randint(low_high[0], low_high[1] + 1, (), generator=g))
        return (torch.randint(1, text_ids, (n,), generator=g)).tolist()

    samples, k = [], 0
    for count in image_counts:
        images = []
        for _ in range(count):
            h, w = sizes[k % len(sizes)]
            k += 1
            images.append(torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8))
        samples.append(Sample([draw(preset["text"]) for _ in range(count + 1)], images, draw(preset["response"])))
    return samples


class Pixels:
    """Images to ``(pixel_values, image_grid_thw)`` through the image processor: fresh (one call over the batch's
    images) or from a per-image cache (each image processed once, alone)."""

    def __init__(self, processor) -> None:
        self.processor = processor
        self.cache: dict[int, tuple[Tensor, Tensor]] = {}

    def fresh(self, images: list[Tensor]) -> tuple[Tensor, Tensor]:
        out = self.processor(images=[image.numpy() for image in images], return_tensors="pt")
        return out["pixel_values"], out["image_grid_thw"]

    def cached(self, images: list[Tensor]) -> tuple[Tensor, Tensor]:
        parts = []
        for image in images:
            if id(image) not in self.cache:
                self.cache[id(image)] = self.fresh([image])
            parts.append(self.cache[id(image)])
        return torch.cat([p for p, _ in parts]), torch.cat([g for _, g in parts])


def sample_ids(sample: Sample, grids: Tensor, tokens) -> tuple[list[int], int]:
    """The sample's token ids (image pads expanded to each grid's merged token count) and its response length."""
    ids = list(sample.texts[0])
    for grid, text in zip(grids.tolist(), sample.texts[1:]):
        ids += [tokens.vision_start] + [tokens.image] * (grid[0] * grid[1] * grid[2] // MERGE_SIZE**2)
        ids += [tokens.vision_end] + text
    return ids + sample.response, len(sample.response)


@dataclasses.dataclass
class Batch:
    input_ids: Tensor  # [B, T]
    attention_mask: Tensor  # [B, T]
    position_ids: Tensor  # [3, B, T]
    pixel_values: Tensor | None
    image_grid_thw: Tensor | None
    rows: list[tuple[slice, int]]  # per sample: its real tokens, its response length


def make_batch(samples: Sequence[Sample], side: str, pixels: Pixels, tokens, device, cache: bool = False) -> Batch:
    """``samples`` padded (pad id 0) on ``side``; their images through ``pixels`` (``cache``: the per-image cache)."""
    from rlk.integrations.multimodal.processor import mrope_positions

    images = [image for sample in samples for image in sample.images]
    pixel_values, grids = (pixels.cached if cache else pixels.fresh)(images) if images else (None, None)
    seqs, k = [], 0
    for sample in samples:
        n = len(sample.images)
        seqs.append(sample_ids(sample, grids[k : k + n] if n else torch.zeros(0, 3, dtype=torch.long), tokens))
        k += n
    length = max(len(ids) for ids, _ in seqs)
    input_ids = torch.zeros(len(seqs), length, dtype=torch.long)
    mask = torch.zeros(len(seqs), length, dtype=torch.long)
    rows = []
    for b, (ids, response) in enumerate(seqs):
        part = slice(0, len(ids)) if side == "right" else slice(length - len(ids), length)
        input_ids[b, part] = torch.tensor(ids)
        mask[b, part] = 1
        rows.append((part, response))
    positions = mrope_positions(input_ids, mask, tokens, image_grid_thw=grids)
    return Batch(
        input_ids.to(device),
        mask.to(device),
        positions.to(device),
        None if pixel_values is None else pixel_values.to(device),
        None if grids is None else grids.to(device),
        rows,
    )


def image_embeddings(model, pixels: Pixels, image: Tensor, device) -> Tensor:
    """One image's vision-tower output (merged tokens ``[n, hidden]``), computed alone: what an embedding cache
    stores."""
    pixel_values, grid = pixels.cached([image])
    visual = model.model.visual
    out = visual(pixel_values.to(device, visual.dtype), grid_thw=grid.to(device))
    return getattr(out, "pooler_output", out)  # transformers 5.x: the merged tokens; 4.x: the tensor itself


def response_logprobs(model, batch: Batch, embeds: list[Tensor] | None = None) -> list[Tensor]:
    """Per sample: fp32 log-probs of its response tokens ``[R]``. ``embeds``: the batch's images' cached vision
    outputs, in order (scattered into the input embeddings; the vision tower does not run)."""
    kwargs = dict(attention_mask=batch.attention_mask, position_ids=batch.position_ids, use_cache=False)
    if embeds is None:
        out = model(
            input_ids=batch.input_ids, pixel_values=batch.pixel_values, image_grid_thw=batch.image_grid_thw, **kwargs
        )
    else:
        inputs_embeds = model.get_input_embeddings()(batch.input_ids)
        if embeds:
            image = (batch.input_ids == model.config.image_token_id).unsqueeze(-1).expand_as(inputs_embeds)
            inputs_embeds = inputs_embeds.masked_scatter(image, torch.cat(embeds).to(inputs_embeds.dtype))
        out = model(inputs_embeds=inputs_embeds, **kwargs)
    logp = out.logits.float().log_softmax(-1)
    result = []
    for b, (part, response) in enumerate(batch.rows):
        positions = torch.arange(part.stop - response, part.stop, device=logp.device)
        targets = batch.input_ids[b, positions]
        result.append(logp[b, positions - 1].gather(-1, targets[:, None])[:, 0])
    return result


# ---------------------------------------------------------------------------
# the comparisons
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Comparison:
    name: str
    sample: int
    equal: bool
    max_diff: float


def comparisons(model, samples: list[Sample], pixels: Pixels, device) -> list[Comparison]:
    """Every comparison of the module docstring, against each sample alone."""
    tokens = model.rlk_vision_tokens
    with torch.no_grad():
        alone = [response_logprobs(model, make_batch([s], "right", pixels, tokens, device))[0] for s in samples]
        results: list[Comparison] = []

        def check(name: str, members: list[int], side: str, cache: str = "off") -> None:
            batch = make_batch([samples[i] for i in members], side, pixels, tokens, device, cache=cache == "pixel")
            embeds = None
            if cache == "embed":
                images = [image for i in members for image in samples[i].images]
                embeds = [image_embeddings(model, pixels, image, device) for image in images]
            for i, got in zip(members, response_logprobs(model, batch, embeds)):
                diff = (got - alone[i]).abs().max().item() if got.numel() else 0.0
                results.append(Comparison(name, i, torch.equal(got, alone[i]), diff))

        everyone = list(range(len(samples)))
        for side in ("right", "left"):
            check(f"batch{len(samples)}-{side}", everyone, side)
        # smaller batches: other neighbours, other image counts (the first sample has one image, the second two,
        # the fourth none)
        for members, side in (([1, 0], "left"), ([3, 0], "right")):
            count = sum(len(samples[i].images) for i in members)
            check(f"images{count}-{side}", members, side)
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


def run(preset: dict, device: torch.device, seed: int = 0, chains: Sequence[str] = ("rlk", "stock")) -> dict:
    """``{chain: [Comparison]}`` for a model and samples of ``preset``."""
    model = build_model(preset, device, seed)
    samples = make_samples(preset, seed=seed)
    pixels = Pixels(image_processor(preset))
    results = {}
    for chain in chains:
        context = rlk_chain(model) if chain == "rlk" else contextlib.nullcontext()
        with context:
            results[chain] = comparisons(model, samples, pixels, device)
    return results


def report(results: dict, out=sys.stdout) -> None:
    for chain, rows in results.items():
        for row in rows:
            verdict = "yes" if row.equal else "no"
            where = f"{chain:5s}  {row.name:14s}  sample {row.sample}"
            print(f"{where}  bitwise-equal {verdict:3s}  max|diff| {row.max_diff:.3e}", file=out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", choices=sorted(PRESETS), default="8b")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--layers", type=int, help="language model layers (default: the preset's)")
    parser.add_argument("--vision-depth", type=int, help="vision tower blocks (default: the preset's)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), help="default: the preset's")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-stock", action="store_true", help="skip the stock-kernel run (negative control)")
    parser.add_argument("--expect-stock-drift", action="store_true", help="also fail when stock kernels never drift")
    args = parser.parse_args(argv)
    preset = dict(PRESETS[args.preset])
    for key, value in (("layers", args.layers), ("vision_depth", args.vision_depth), ("dtype", args.dtype)):
        if value is not None:
            if key != "dtype" and value < 1:
                parser.error(f"--{key.replace('_', '-')} must be >= 1")
            preset[key] = value
    device = torch.device(args.device)
    chains = ("rlk",) if args.no_stock else ("rlk", "stock")
    from rlk.integrations.batch_invariant import served_calls

    start = dict(served_calls)
    from rlk.core.dispatch import BackendError

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            results = run(preset, device, args.seed, chains)
        except BackendError as err:  # e.g. the CPU without TRITON_INTERPRET=1
            print(f"error: {err}", file=sys.stderr)
            return 2
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
