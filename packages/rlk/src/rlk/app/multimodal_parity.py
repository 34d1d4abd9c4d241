"""``rlk multimodal-parity``: compare a rollout-side and a training-side encoding of the same multimodal samples.

Two sources: two files (``torch.save`` of a dict of tensors with :class:`~rlk.integrations.multimodal.Encoding`'s
field names as keys, optionally the vision token ids), or ``--offline-processor``: synthetic samples encoded once
per side by rlk's offline Qwen2-VL processor (transformers) with each side's settings. Exit codes: 0 the layouts
match, 1 they differ, 2 a usage error (a missing file, a bad key or dtype; for ``--offline-processor`` transformers,
tokenizers or Pillow missing: ``pip install 'rlk[hf]'``).
"""

from __future__ import annotations

import argparse
import json
import sys

from rlk.integrations.multimodal.layout_parity import compare_layouts
from rlk.integrations.multimodal.schema import QWEN2_VL_TOKENS, VisionTokens

#: Keys of an encoding file that give the vision token ids (the ``--*-token-id`` options override them).
TOKEN_KEYS = {
    "image_token_id": "image",
    "video_token_id": "video",
    "vision_start_token_id": "vision_start",
    "vision_end_token_id": "vision_end",
    "spatial_merge_size": "spatial_merge_size",
}


def add_parser(sub) -> None:
    mm = sub.add_parser(
        "multimodal-parity",
        help="compare the rollout-side and training-side encodings of the same multimodal samples",
        description="Compare two encodings of the same samples (token ids, image / video placeholder expansion, "
        "attention masks, padding side, position ids including Qwen2-VL's 3-D ones, loss masks) and report the "
        "first mismatch of each sample and why. Exit code 1 when they differ.",
    )
    mm.add_argument(
        "rollout",
        nargs="?",
        help="the rollout side: a torch.save'd dict of tensors (input_ids, "
        "attention_mask, and any of position_ids, loss_mask, image_grid_thw, video_grid_thw)",
    )
    mm.add_argument("training", nargs="?", help="the training side, the same way")
    mm.add_argument(
        "--offline-processor",
        action="store_true",
        help="instead of files: encode synthetic samples "
        "with rlk's offline Qwen2-VL processor (needs rlk[hf]: transformers, tokenizers, Pillow), once per side",
    )
    mm.add_argument(
        "--fixture",
        choices=("image-text", "multi-image", "gui-trajectory"),
        default="multi-image",
        help="samples for --offline-processor (default multi-image)",
    )
    mm.add_argument("--samples", type=int, default=4, help="number of samples for --offline-processor (default 4)")
    mm.add_argument("--seed", type=int, default=0, help="seed of the samples (default 0)")
    for side in ("rollout", "training"):
        mm.add_argument(
            f"--{side}-min-pixels",
            type=int,
            default=4 * 28 * 28,
            help=f"{side} image processor's min_pixels (default 3136)",
        )
        mm.add_argument(
            f"--{side}-max-pixels",
            type=int,
            default=256 * 28 * 28,
            help=f"{side} image processor's max_pixels (default 200704)",
        )
        mm.add_argument(
            f"--{side}-padding-side",
            choices=("left", "right"),
            default="right",
            help=f"{side} tokenizer's padding side (default right)",
        )
    for key, field in TOKEN_KEYS.items():
        mm.add_argument(
            f"--{key.replace('_', '-')}",
            type=int,
            default=None,
            help=f"files: the {field} id "
            f"(default: the files' {key!r}, else Qwen2-VL's {getattr(QWEN2_VL_TOKENS, field)})",
        )
    mm.add_argument("--no-padding-side", action="store_true", help="do not report samples padded on different sides")
    mm.add_argument("--json", action="store_true", help="the report as JSON")


def _load(path: str, side: str) -> dict:
    import torch

    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"{side} file {path!r}: no such file") from None
    except Exception as exc:  # a file that is not a torch.save'd dict: unpickling errors of many kinds
        raise ValueError(
            f"{side} file {path!r}: not a torch.save'd dict of tensors ({type(exc).__name__}: {exc})"
        ) from None
    if not isinstance(data, dict):
        raise ValueError(f"{side} file {path!r}: expected a dict of tensors, got {type(data).__name__}")
    return data


def _tokens(args, files: list[dict]) -> VisionTokens:
    values = {}
    for key, field in TOKEN_KEYS.items():
        given = getattr(args, key)
        found = {int(f[key]) for f in files if key in f}
        if given is None and len(found) > 1:
            raise ValueError(f"{key}: the two files disagree ({sorted(found)}); pass --{key.replace('_', '-')}")
        values[field] = given if given is not None else found.pop() if found else getattr(QWEN2_VL_TOKENS, field)
    return VisionTokens(**values)


def run(args, parser: argparse.ArgumentParser) -> int:
    if args.offline_processor and args.rollout is not None:
        parser.error("multimodal-parity: give two files (ROLLOUT TRAINING) or --offline-processor, not both")
    if not args.offline_processor and args.rollout is None:
        parser.error("multimodal-parity: give two files (ROLLOUT TRAINING) or --offline-processor")
    if not args.offline_processor and args.training is None:
        parser.error("multimodal-parity: the training-side file is missing")
    if args.samples < 1:
        parser.error(f"--samples: must be >= 1, got {args.samples}")
    try:
        if args.offline_processor:
            from rlk.integrations.hf.compat import UnsupportedTransformers
            from rlk.integrations.multimodal.fixtures import synthetic_samples
            from rlk.integrations.multimodal.processor import OfflineQwen2VLProcessor

            samples = synthetic_samples(args.fixture, seed=args.seed, batch_size=args.samples)
            try:
                sides = [
                    OfflineQwen2VLProcessor(
                        min_pixels=getattr(args, f"{side}_min_pixels"),
                        max_pixels=getattr(args, f"{side}_max_pixels"),
                        padding_side=getattr(args, f"{side}_padding_side"),
                    )
                    for side in ("rollout", "training")
                ]
            except UnsupportedTransformers as exc:
                raise ValueError(str(exc)) from None
            encodings = [processor(samples) for processor in sides]
            tokens, text = sides[0].tokens, sides[0].tokenizer.convert_ids_to_tokens
        else:
            encodings = [_load(args.rollout, "rollout"), _load(args.training, "training")]
            tokens, text = _tokens(args, encodings), None
        report = compare_layouts(
            *encodings, tokens=tokens, check_padding_side=not args.no_padding_side, token_text=text
        )
    except (ValueError, TypeError) as exc:
        print(f"rlk multimodal-parity: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(report.to_dict(), indent=2) if args.json else report.format())
    return 0 if report.passed else 1
