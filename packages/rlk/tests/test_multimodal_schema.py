"""rlk.multimodal's schema: the synthetic fixtures are valid and seeded, span tables round-trip through dense masks,
every malformed field is refused with an error naming it, and ``RLK_CHECK_VALUES=0`` skips the value checks
without reading any tensor back to the host."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import rlk
from rlk.multimodal import (
    FIXTURE_TOKENS,
    KINDS,
    MODALITIES,
    SPAN_DTYPE,
    MultimodalBatch,
    mask_to_spans,
    media_cache_key,
    processor_fingerprint,
    spans_to_mask,
    synthetic_batch,
)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_fixtures_are_valid_and_seeded(kind, padding_side):
    batch = synthetic_batch(kind, seed=3, padding_side=padding_side)
    batch.validate(values=True)
    again = synthetic_batch(kind, seed=3, padding_side=padding_side)
    other = synthetic_batch(kind, seed=4, padding_side=padding_side)
    for name, tensor in batch.tensors().items():
        assert torch.equal(tensor.nan_to_num(), again.tensors()[name].nan_to_num()), name
    assert batch.media_cache_keys == again.media_cache_keys
    assert not torch.equal(batch.input_ids, other.input_ids) or batch.input_ids.shape != other.input_ids.shape
    # the modality spans are exactly the placeholder tokens, with the right modality
    ids = batch.input_ids
    assert torch.equal(batch.modality_mask("image"), ids == FIXTURE_TOKENS.image)
    assert torch.equal(batch.modality_mask("video"), ids == FIXTURE_TOKENS.video)
    # each run has t * h * w / 4 tokens, and the vision-output offsets step by them
    lengths = (batch.modality_spans[:, 2] - batch.modality_spans[:, 1]).long()
    assert torch.equal(lengths, batch.media_grid_thw.prod(1) // 4)
    assert torch.equal(batch.vision_token_offsets[1:].long(), lengths.cumsum(0))
    # padding is on the requested side
    edge = batch.attention_mask[:, 0] if padding_side == "left" else batch.attention_mask[:, -1]
    assert bool((edge == 0).any()), "some row is padded"
    assert all(t.device == batch.device for t in batch.tensors().values())
    assert batch.modality_spans.dtype == SPAN_DTYPE and batch.loss_spans.dtype == SPAN_DTYPE


def test_fixture_kinds_differ_as_documented():
    video = synthetic_batch("video", seed=0)
    assert set(video.modality_spans[:, 3].tolist()) == {MODALITIES["video"]}
    multi = synthetic_batch("multi-image", seed=0)
    assert all(int((multi.modality_spans[:, 0] == b).sum()) >= 2 for b in range(multi.batch_size))
    gui = synthetic_batch("gui-trajectory", seed=0)
    assert gui.coordinate_system == "pixels" and gui.screen_size.shape == (gui.num_media, 2)
    assert gui.loss_spans[:, 3].max() >= 1, "turns tag the loss spans"
    clicks = ~torch.isnan(gui.point_targets).all(1)
    assert bool(clicks.any()) and bool((~clicks).any()), "clicks with points and typing without"
    # every click's point lies in its target box (the box is built around it), in its screenshot
    points = gui.point_targets[clicks]
    assert points.shape[0] == gui.bbox_targets.shape[0]
    box = gui.bbox_targets
    assert bool(((box[:, 0] <= points[:, 0]) & (points[:, 0] <= box[:, 2])).all())
    assert bool(((box[:, 1] <= points[:, 1]) & (points[:, 1] <= box[:, 3])).all())


def test_spans_round_trip_through_dense_masks():
    g = torch.Generator().manual_seed(0)
    mask = torch.rand(5, 37, generator=g) < 0.4
    spans = mask_to_spans(mask, tag=2)
    assert spans.dtype == SPAN_DTYPE and spans.shape[1] == 4
    assert torch.equal(spans_to_mask(spans, (5, 37)), mask)
    assert bool((spans[:, 3] == 2).all()) and bool((spans[:, 1] < spans[:, 2]).all())
    # sorted by (sequence, start)
    key = spans[:, 0].long() * 100 + spans[:, 1].long()
    assert bool((key[1:] > key[:-1]).all())
    batch = synthetic_batch("multi-image", seed=1)
    loss = batch.loss_mask()
    assert torch.equal(mask_to_spans(loss), batch.loss_spans)
    media = batch.modality_mask()
    assert torch.equal(mask_to_spans(media, tag=MODALITIES["image"]), batch.modality_spans)
    assert not bool((loss & media).any())
    assert spans_to_mask(batch.modality_spans, (batch.batch_size, batch.seq_len), tags=(2,)).sum() == 0
    assert mask_to_spans(torch.zeros(2, 4, dtype=torch.bool)).shape == (0, 4)


def test_cache_keys_and_fingerprints():
    image = torch.arange(12, dtype=torch.uint8).reshape(2, 2, 3)
    key = media_cache_key(image, "f1")
    assert len(key) == 32 and key == media_cache_key(image.clone(), "f1")
    assert key != media_cache_key(image, "f2"), "another processor: another key"
    assert key != media_cache_key(image.flip(0), "f1") and key != media_cache_key(image.reshape(3, 4), "f1")
    assert media_cache_key(image.numpy().tobytes(), "f1") != key, "raw bytes carry no shape"
    fingerprint = processor_fingerprint({"b": [1, 2], "a": {"x": 1}})
    assert fingerprint == processor_fingerprint({"a": {"x": 1}, "b": [1, 2]}) and len(fingerprint) == 16
    assert fingerprint != processor_fingerprint({"b": [1, 2], "a": {"x": 2}})


def test_rlk_multimodal_is_the_public_name():
    import rlk.multimodal as public

    assert public is rlk.multimodal
    assert public.MultimodalBatch is MultimodalBatch


def _replace(batch, **fields):
    return dataclasses.replace(batch, **fields)


def _row(table, i, **columns):
    out = table.clone()
    for col, value in columns.items():
        out[i, ("sequence", "start", "end", "tag").index(col)] = value
    return out


def _metadata_cases():
    b = synthetic_batch("image-text", seed=0)
    g = synthetic_batch("gui-trajectory", seed=0)
    meta = torch.device("meta")
    return [
        (b, {"modality_spans": b.modality_spans.long()}, TypeError, "modality_spans: expected dtype int32"),
        (b, {"loss_spans": b.loss_spans[:, :3]}, ValueError, "loss_spans: expected shape [L, 4]"),
        (b, {"input_ids": b.input_ids.float()}, TypeError, "input_ids: expected dtype int64 or int32"),
        (b, {"attention_mask": b.attention_mask[:, 1:]}, ValueError, "attention_mask: expected shape [B, T]"),
        (b, {"media_ids": b.media_ids.to(meta)}, ValueError, "media_ids: expected device cpu"),
        (b, {"media_ids": b.media_ids[:-1]}, ValueError, "media_ids: expected shape [M]"),
        (b, {"vision_token_offsets": b.vision_token_offsets[:-1]}, ValueError, "vision_token_offsets: expected shape"),
        (b, {"media_cache_keys": b.media_cache_keys[:-1]}, ValueError, "media_cache_keys: expected 4 keys"),
        (b, {"media_cache_keys": [1, 2, 3, 4]}, TypeError, "media_cache_keys: expected a tuple of str"),
        (b, {"processor_fingerprint": ""}, TypeError, "processor_fingerprint: expected a non-empty str"),
        (b, {"position_ids": b.position_ids[None].expand(2, -1, -1)}, ValueError, "position_ids: expected shape"),
        (b, {"media_grid_thw": b.media_grid_thw.int()}, TypeError, "media_grid_thw: expected dtype int64"),
        (g, {"bbox_targets": None}, ValueError, "bbox_targets: required with region_spans"),
        (g, {"point_targets": g.point_targets.double()}, TypeError, "point_targets: expected dtype float32"),
        (g, {"coordinate_system": None}, ValueError, "coordinate_system: required"),
        (g, {"coordinate_system": "percent"}, ValueError, "coordinate_system: expected one of"),
        (g, {"screen_size": None}, ValueError, "screen_size: required with coordinate_system='pixels'"),
    ]


@pytest.mark.parametrize("case", range(len(_metadata_cases())))
def test_metadata_errors_name_the_field(case, monkeypatch):
    batch, fields, error, message = _metadata_cases()[case]
    monkeypatch.setenv("RLK_CHECK_VALUES", "0")  # metadata checks run regardless
    with pytest.raises(error, match=message.replace("[", r"\[").replace("(", r"\(")):
        _replace(batch, **fields)


def _value_cases():
    b = synthetic_batch("image-text", seed=0)
    g = synthetic_batch("gui-trajectory", seed=0)
    s0 = b.loss_spans[0].tolist()
    visual = b.modality_spans[0].tolist()
    length = b.seq_len
    pad_row = int((b.attention_mask == 0).any(1).nonzero()[0, 0])
    pad_col = int((b.attention_mask[pad_row] == 0).nonzero()[0, 0])
    loss_two = torch.tensor([s0, [s0[0], s0[1] + 1, s0[2] + 1, 0]], dtype=SPAN_DTYPE)
    loss_swapped = b.loss_spans.flip(0)
    pixels = g.bbox_targets.clone()
    pixels[0, 2] = float(g.screen_size[int(g.region_spans[0, 3]), 0]) + 5
    normalized = _replace(
        g,
        coordinate_system="normalized",
        bbox_targets=(g.bbox_targets / 3000).clamp(0, 1),
        point_targets=g.point_targets / 3000,
    )
    one_nan = g.point_targets.clone()
    one_nan[~torch.isnan(one_nan).any(1).nonzero()[0, 0], 0] = float("nan")
    flipped = g.bbox_targets.clone()
    flipped[1, [0, 2]] = flipped[1, [2, 0]]
    return [
        (b, {"loss_spans": loss_two}, "loss_spans row 1 .* overlaps loss_spans row 0"),
        (b, {"loss_spans": loss_swapped}, "loss_spans row 1 .* not sorted by \\(sequence, start\\)"),
        (b, {"loss_spans": _row(b.loss_spans, 2, end=length + 1)}, "loss_spans row 2 .* needs 0 <= start < end"),
        (b, {"loss_spans": _row(b.loss_spans, 1, end=int(b.loss_spans[1, 1]))}, "loss_spans row 1 .* start < end"),
        (b, {"modality_spans": _row(b.modality_spans, 3, sequence=9)}, "modality_spans row 3 .* sequence out of range"),
        (b, {"modality_spans": _row(b.modality_spans, 0, tag=3)}, "modality_spans row 0: modality code 3"),
        (b, {"loss_spans": _row(b.loss_spans, 0, tag=-1)}, "loss_spans row 0: segment index -1"),
        (
            b,
            {"loss_spans": torch.tensor([[visual[0], visual[1], visual[1] + 2, 0]], dtype=SPAN_DTYPE)},
            "loss_spans row 0 .* covers visual tokens",
        ),
        (
            b,
            {"loss_spans": torch.tensor([[pad_row, pad_col, pad_col + 1, 0]], dtype=SPAN_DTYPE)},
            f"loss_spans row 0 \\(sequence {pad_row}, tokens {pad_col}..{pad_col}\\) covers padding",
        ),
        (b, {"vision_token_offsets": b.vision_token_offsets + 1}, "vision_token_offsets: must start at 0"),
        (
            b,
            {"vision_token_offsets": b.vision_token_offsets * torch.tensor([1, 1, 2, 2, 2], dtype=SPAN_DTYPE)},
            "vision_token_offsets: media item 1 has",
        ),
        (b, {"media_grid_thw": b.media_grid_thw * 0}, "media_grid_thw row 0: .* must be >= 1"),
        (g, {"bbox_targets": pixels}, "bbox_targets row 0: .* lies outside the screen of media item"),
        (g, {"bbox_targets": flipped}, "bbox_targets row 1: .* needs x0 <= x1"),
        (normalized, {"bbox_targets": normalized.bbox_targets * 2}, "bbox_targets row .* not normalized to \\[0, 1\\]"),
        (g, {"point_targets": one_nan}, "point_targets row .* one NaN coordinate"),
        (g, {"action_spans": _row(g.action_spans, 0, tag=99)}, "action_spans row 0: media item 99 out of range"),
        (g, {"screen_size": -g.screen_size}, "screen_size row 0"),
    ]


@pytest.mark.parametrize("case", range(len(_value_cases())))
def test_value_errors_name_the_field_and_row(case, monkeypatch):
    batch, fields, message = _value_cases()[case]
    monkeypatch.delenv("RLK_CHECK_VALUES", raising=False)
    with pytest.raises(ValueError, match=message):
        _replace(batch, **fields)
    # RLK_CHECK_VALUES=0 skips them (what the value checks cost: a host synchronization)
    monkeypatch.setenv("RLK_CHECK_VALUES", "0")
    skipped = _replace(batch, **fields)
    with pytest.raises(ValueError, match=message):
        skipped.validate(values=True)


def test_normalized_coordinates_pass():
    g = synthetic_batch("gui-trajectory", seed=0)
    boxes = g.bbox_targets / g.screen_size[g.region_spans[:, 3].long()].float().repeat(1, 2) * 1000
    points = g.point_targets / g.screen_size[g.action_spans[:, 3].long()].float() * 1000
    ok = _replace(g, coordinate_system="normalized_1000", bbox_targets=boxes, point_targets=points)
    ok.validate(values=True)
    with pytest.raises(ValueError, match="not normalized to \\[0, 1\\]"):
        _replace(ok, coordinate_system="normalized")


def test_values_off_reads_nothing_back(monkeypatch):
    """With RLK_CHECK_VALUES=0 validation touches metadata only: every way a tensor's contents reach the host
    raises here; the negative control shows the value checks do read (once)."""
    batch = synthetic_batch("gui-trajectory", seed=2)
    reads = []

    def forbidden(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            reads.append(name)
            return original(self, *args, **kwargs)

        return read

    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "nonzero", "numpy"):
        monkeypatch.setattr(torch.Tensor, name, forbidden(name))
    monkeypatch.setenv("RLK_CHECK_VALUES", "0")
    batch.validate()
    assert reads == []
    monkeypatch.delenv("RLK_CHECK_VALUES")
    batch.validate()
    assert reads == ["tolist"], "one synchronization for every value check of a valid batch"


def test_meta_batch_checks_metadata_only():
    batch = synthetic_batch("video", seed=0).to("meta")
    assert batch.device.type == "meta"
    with pytest.raises(ValueError, match="media_ids: expected device meta"):
        _replace(batch, media_ids=torch.zeros(batch.num_media, dtype=torch.int64))


@pytest.mark.gpu
def test_on_the_gpu_without_host_synchronization(monkeypatch):
    """On CUDA: validation with RLK_CHECK_VALUES=0 and the span-to-mask helpers run under sync-debug mode "error"
    (any synchronizing call raises) and replay from a CUDA graph with new spans; with value checks on, a valid
    batch passes and an overlap is caught on the device."""
    cpu = synthetic_batch("gui-trajectory", seed=0)
    batch = cpu.to("cuda")
    monkeypatch.setenv("RLK_CHECK_VALUES", "0")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        again = _replace(batch)
        loss, image = again.loss_mask(), again.modality_mask("image")
        region = spans_to_mask(again.region_spans, (again.batch_size, again.seq_len), tags=(0, 1, 2))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(loss.cpu(), cpu.loss_mask()) and torch.equal(image.cpu(), cpu.modality_mask("image"))
    keep = (cpu.region_spans[:, 3] <= 2).nonzero()[:, 0]
    assert torch.equal(region.cpu(), spans_to_mask(cpu.region_spans[keep], (cpu.batch_size, cpu.seq_len)))

    spans = batch.loss_spans.clone()
    shape = (batch.batch_size, batch.seq_len)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        spans_to_mask(spans, shape)  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = spans_to_mask(spans, shape)
    other = synthetic_batch("gui-trajectory", seed=0).loss_spans.clone()
    other[:, 2] = other[:, 1] + 1  # one token per span
    spans.copy_(other.to("cuda"))
    graph.replay()
    assert torch.equal(captured.cpu(), spans_to_mask(other, shape))

    monkeypatch.delenv("RLK_CHECK_VALUES")
    batch.validate()
    overlapping = batch.loss_spans.clone()
    overlapping[1] = overlapping[0]
    with pytest.raises(ValueError, match="loss_spans row 1 .* overlaps loss_spans row 0"):
        _replace(batch, loss_spans=overlapping)
