"""A Qwen2-VL-style processor built offline from real transformers parts, and Qwen2-VL's 3-D positions.

:class:`OfflineQwen2VLProcessor`: transformers' Qwen2-VL image processor (``Qwen2VLImageProcessorPil`` where it
exists, 5.x, else ``Qwen2VLImageProcessor``, 4.57) and a Qwen2 tokenizer over a word-level ``tokenizers`` model
trained in memory, both from explicit arguments; each image placeholder expands to ``t * h * w / merge**2`` tokens
of the image processor's grid, as Qwen2-VL's processor does (``transformers.Qwen2VLProcessor`` itself needs a video
processor, hence torchvision). :func:`mrope_positions`: ``get_rope_index`` of a tiny random-weight
``Qwen2VLModel`` built from a config. transformers is imported when these are called.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
from collections.abc import Sequence

import torch
from torch import Tensor

from rlk.core.checks import choice, integer
from rlk.integrations.multimodal.fixtures import WORDS, RawSample
from rlk.integrations.multimodal.layout_parity import Encoding
from rlk.integrations.multimodal.schema import VisionTokens, processor_fingerprint

#: The tokenizer's special tokens (Qwen2-VL's names).
SPECIAL_TOKENS = (
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|image_pad|>",
    "<|video_pad|>",
)
IMAGE_PAD = "<|image_pad|>"
#: The image processor settings that decide a layout, read back from the processor for the fingerprint.
LAYOUT_KEYS = (
    "size",
    "patch_size",
    "temporal_patch_size",
    "merge_size",
    "do_resize",
    "do_rescale",
    "rescale_factor",
    "do_normalize",
    "image_mean",
    "image_std",
    "do_convert_rgb",
)


def _transformers():
    import transformers

    from rlk.integrations.hf.compat import check_version

    check_version()
    return transformers


def _plain(value):
    """JSON-able: tuples to lists, enums (PIL's resample) to ints."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items() if v is not None}
    return value


def layout_config(image_processor, tokenizer) -> dict:
    """The layout-relevant settings of a Qwen2-VL image processor and tokenizer, under the same keys on
    transformers 4.57 and 5.x (for :func:`~rlk.integrations.multimodal.schema.processor_fingerprint`):
    :data:`LAYOUT_KEYS` of ``image_processor.to_dict()``, the tokenizer's padding side and a hash of its
    vocabulary."""
    settings = image_processor.to_dict()
    config = {key: _plain(settings.get(key)) for key in LAYOUT_KEYS}
    vocab = json.dumps(sorted(tokenizer.get_vocab().items()))
    config["padding_side"] = tokenizer.padding_side
    config["vocab_sha256"] = hashlib.sha256(vocab.encode()).hexdigest()[:16]
    return config


class OfflineQwen2VLProcessor:
    """Qwen2-VL's layout from real transformers parts, no download.

    Args:
        min_pixels, max_pixels: the image processor's pixel bounds (an image is resized into them, to multiples of
            ``patch_size * merge_size`` = 28 pixels).
        padding_side: the tokenizer's ``"left"`` or ``"right"``.
        words: the tokenizer's vocabulary (plus :data:`SPECIAL_TOKENS` and ``[UNK]``).

    Attributes:
        image_processor: ``transformers.Qwen2VLImageProcessorPil`` (5.x) or ``Qwen2VLImageProcessor`` (4.57).
        tokenizer: ``transformers.Qwen2TokenizerFast`` (4.57) / ``Qwen2Tokenizer`` (5.x) over a
            ``tokenizers.models.WordLevel`` model.
        tokens: the vision token ids.
        config, fingerprint: :func:`layout_config` and its fingerprint.
    """

    def __init__(
        self,
        *,
        min_pixels: int = 4 * 28 * 28,
        max_pixels: int = 256 * 28 * 28,
        padding_side: str = "right",
        words: Sequence[str] = WORDS,
    ) -> None:
        integer("min_pixels", min_pixels, minimum=1)
        integer("max_pixels", max_pixels, minimum=min_pixels)
        choice("padding_side", padding_side, ("left", "right"))
        transformers = _transformers()
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers

        model = Tokenizer(models.WordLevel(unk_token="[UNK]"))
        model.pre_tokenizer = pre_tokenizers.Whitespace()
        trainer = trainers.WordLevelTrainer(special_tokens=["[UNK]", *SPECIAL_TOKENS], min_frequency=1)
        model.train_from_iterator([" ".join(words)], trainer)
        tokenizer_class = getattr(transformers, "Qwen2TokenizerFast", None) or transformers.Qwen2Tokenizer
        self.tokenizer = tokenizer_class(
            tokenizer_object=model,
            unk_token="[UNK]",
            pad_token="<|endoftext|>",
            additional_special_tokens=list(SPECIAL_TOKENS),
            padding_side=padding_side,
        )
        image_class = getattr(transformers, "Qwen2VLImageProcessorPil", None) or transformers.Qwen2VLImageProcessor
        self.image_processor = image_class(
            min_pixels=min_pixels, max_pixels=max_pixels, patch_size=14, temporal_patch_size=2, merge_size=2
        )
        ids = self.tokenizer.convert_tokens_to_ids
        self.tokens = VisionTokens(
            image=ids(IMAGE_PAD),
            video=ids("<|video_pad|>"),
            vision_start=ids("<|vision_start|>"),
            vision_end=ids("<|vision_end|>"),
            spatial_merge_size=self.image_processor.merge_size,
        )
        self.config = layout_config(self.image_processor, self.tokenizer)
        self.fingerprint = processor_fingerprint(self.config)

    def image_grids(self, samples: Sequence[RawSample]) -> Tensor | None:
        """int64 ``[I, 3]``: the image processor's ``image_grid_thw`` of every image of ``samples`` in order."""
        images = [image.numpy() for sample in samples for image in sample.images]
        if not images:
            return None
        return self.image_processor(images=images, return_tensors="pt")["image_grid_thw"]

    def __call__(self, samples: Sequence[RawSample], *, positions: bool = True) -> Encoding:
        """Encode ``samples``: prompt (placeholders expanded) and response as one text, padded by the tokenizer.

        Returns an :class:`~rlk.integrations.multimodal.layout_parity.Encoding` with ``input_ids`` int64
        ``[B, T]``, ``attention_mask``, ``loss_mask`` (1 on the response tokens), ``image_grid_thw`` and, if
        ``positions``, the 3-D ``position_ids`` ``[3, B, T]`` of :func:`mrope_positions`.
        """
        grids = self.image_grids(samples)
        merge = self.tokens.spatial_merge_size
        texts, prompt_lengths, k = [], [], 0
        for i, sample in enumerate(samples):
            parts = sample.prompt.split(IMAGE_PAD)
            if len(parts) - 1 != len(sample.images):
                raise ValueError(
                    f"samples[{i}]: {len(parts) - 1} {IMAGE_PAD} placeholders for {len(sample.images)} images"
                )
            prompt = parts[0]
            for part in parts[1:]:
                prompt += IMAGE_PAD * (int(grids[k].prod()) // merge**2) + part
                k += 1
            texts.append(f"{prompt} {sample.response}")
            prompt_lengths.append(len(self.tokenizer(prompt, add_special_tokens=False)["input_ids"]))
        batch = self.tokenizer(texts, padding=True, add_special_tokens=False, return_tensors="pt")
        ids, mask = batch["input_ids"].long(), batch["attention_mask"].long()
        loss = torch.zeros_like(mask)
        for b, start in enumerate(prompt_lengths):
            loss[b, mask[b].nonzero()[start:, 0]] = 1
        return Encoding(
            input_ids=ids,
            attention_mask=mask,
            position_ids=mrope_positions(ids, mask, self.tokens, image_grid_thw=grids) if positions else None,
            loss_mask=loss,
            image_grid_thw=grids,
            processor_fingerprint=self.fingerprint,
            processor_config=self.config,
        )


def tiny_qwen2_vl_config(tokens: VisionTokens, vocab_size: int, *, width: int = 16, layers: int = 1):
    """A tiny ``transformers.Qwen2VLConfig`` over ``tokens``' ids: text and vision widths ``width`` (head size 8),
    ``layers`` text layers and vision blocks, MLPs twice as wide, untied LM head, 14-pixel patches, 2 temporal
    patches, 3-D rotary sections ``[1, 1, 2]``."""
    transformers = _transformers()
    heads = width // 8
    return transformers.Qwen2VLConfig(
        text_config={
            "vocab_size": vocab_size,
            "hidden_size": width,
            "intermediate_size": 2 * width,
            "num_hidden_layers": layers,
            "num_attention_heads": heads,
            "num_key_value_heads": max(heads // 2, 1),
            "rope_scaling": {"type": "mrope", "mrope_section": [1, 1, 2]},
            "tie_word_embeddings": False,
            "bos_token_id": None,
            "eos_token_id": None,
        },
        vision_config={
            "depth": layers,
            "embed_dim": width,
            "hidden_size": width,
            "num_heads": heads,
            "mlp_ratio": 2,
            "patch_size": 14,
            "spatial_merge_size": tokens.spatial_merge_size,
            "temporal_patch_size": 2,
        },
        image_token_id=tokens.image,
        video_token_id=tokens.video,
        vision_start_token_id=tokens.vision_start,
        vision_end_token_id=tokens.vision_end,
    )


@functools.lru_cache(maxsize=8)
def _tiny_qwen2_vl(tokens: VisionTokens, vocab_size: int):
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return _transformers().Qwen2VLModel(tiny_qwen2_vl_config(tokens, vocab_size)).eval()


def mrope_positions(
    input_ids: Tensor,
    attention_mask: Tensor,
    tokens: VisionTokens,
    *,
    image_grid_thw: Tensor | None = None,
    video_grid_thw: Tensor | None = None,
) -> Tensor:
    """Qwen2-VL's multimodal rotary positions, int64 ``[3, B, T]`` (temporal, height, width), from
    ``transformers.Qwen2VLModel.get_rope_index`` of a tiny random-weight model built from a config (its weights
    play no part). Padding positions are whatever that transformers gives them (0 or 1); compare attended
    tokens only."""
    model = _tiny_qwen2_vl(tokens, max(int(input_ids.max()) + 1, tokens.image + 1, tokens.video + 1))
    extra = {}
    if "mm_token_type_ids" in inspect.signature(model.get_rope_index).parameters:  # transformers 5.x
        extra["mm_token_type_ids"] = (input_ids == tokens.image).int() + 2 * (input_ids == tokens.video).int()
    positions, _ = model.get_rope_index(
        input_ids,
        image_grid_thw=image_grid_thw,
        video_grid_thw=video_grid_thw,
        attention_mask=attention_mask,
        **extra,
    )
    return positions.long()
