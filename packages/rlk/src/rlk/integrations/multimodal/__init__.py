"""Multimodal RL batches (``rlk.multimodal``): the schema, synthetic fixtures and the processor-layout checker.

* :mod:`~rlk.integrations.multimodal.schema`: :class:`MultimodalBatch` (token tensors and int32 ``[S, 4]`` span
  tables ``(sequence, start, end, tag)``), its validation, :func:`spans_to_mask` / :func:`mask_to_spans`;
* :mod:`~rlk.integrations.multimodal.fixtures`: :func:`synthetic_batch` (image-text, multi-image, short-video,
  GUI-trajectory) and :func:`synthetic_samples` (raw samples for a processor) from a seed;
* :mod:`~rlk.integrations.multimodal.layout_parity`: :func:`compare_layouts` of a rollout-side and a training-side
  :class:`Encoding` (``rlk multimodal-parity``);
* :mod:`~rlk.integrations.multimodal.pack`: :func:`pack_batch` / :func:`unpack_batch`, modality-aware varlen
  packing (``cu_seqlens``, per-span offsets, position and temporal ids, frame- or token-major video order) on
  ``rlk.pack``'s primitives;
* :mod:`~rlk.integrations.multimodal.processor`: :class:`OfflineQwen2VLProcessor` and :func:`mrope_positions`
  (transformers, imported when called).

Guide: docs/multimodal.md.
"""

from __future__ import annotations

from rlk.integrations.multimodal.fixtures import (
    FIXTURE_TOKENS,
    IMAGE_PLACEHOLDER,
    KINDS,
    RawSample,
    synthetic_batch,
    synthetic_samples,
)
from rlk.integrations.multimodal.layout_parity import Encoding, LayoutReport, Mismatch, compare_layouts
from rlk.integrations.multimodal.pack import VIDEO_ORDERS, PackedBatch, pack_batch, unpack_batch
from rlk.integrations.multimodal.processor import OfflineQwen2VLProcessor, layout_config, mrope_positions
from rlk.integrations.multimodal.schema import (
    COORDINATE_SYSTEMS,
    MODALITIES,
    QWEN2_VL_TOKENS,
    SPAN_COLUMNS,
    SPAN_DTYPE,
    SPAN_TAGS,
    MultimodalBatch,
    VisionTokens,
    mask_to_spans,
    media_cache_key,
    processor_fingerprint,
    shift_spans,
    spans_to_mask,
)

__all__ = [
    "COORDINATE_SYSTEMS",
    "FIXTURE_TOKENS",
    "IMAGE_PLACEHOLDER",
    "KINDS",
    "MODALITIES",
    "QWEN2_VL_TOKENS",
    "SPAN_COLUMNS",
    "SPAN_DTYPE",
    "SPAN_TAGS",
    "VIDEO_ORDERS",
    "Encoding",
    "LayoutReport",
    "Mismatch",
    "MultimodalBatch",
    "OfflineQwen2VLProcessor",
    "PackedBatch",
    "RawSample",
    "VisionTokens",
    "compare_layouts",
    "layout_config",
    "mask_to_spans",
    "media_cache_key",
    "mrope_positions",
    "pack_batch",
    "processor_fingerprint",
    "shift_spans",
    "spans_to_mask",
    "synthetic_batch",
    "synthetic_samples",
    "unpack_batch",
]
