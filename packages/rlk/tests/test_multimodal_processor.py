"""rlk.multimodal's offline Qwen2-VL processor (transformers' Qwen2-VL image processor, a Qwen2 tokenizer over a
word-level ``tokenizers`` model trained in memory, ``get_rope_index`` of a tiny random-weight ``Qwen2VLModel``) and
the layout checker on its encodings, with planted mismatches: different ``max_pixels``, left vs right padding, a
dropped image placeholder, position ids off by one, a loss mask over the visual tokens; identical encodings pass.

CI runs this file under transformers 5.24 and 4.57.6 (ci/test.sh); transformers missing is a failure, not a skip.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from rlk.app import cli
from rlk.multimodal import (
    IMAGE_PLACEHOLDER,
    OfflineQwen2VLProcessor,
    RawSample,
    compare_layouts,
    mrope_positions,
    synthetic_samples,
)

PIXELS_64 = 64 * 28 * 28  # a 224 x 224 image stays 224 x 224: grid [1, 16, 16], 64 visual tokens
PIXELS_16 = 16 * 28 * 28  # the same image resized to 112 x 112: grid [1, 8, 8], 16 visual tokens


def _transformers():
    try:
        import transformers
    except ImportError:
        if os.environ.get("RLK_REQUIRE_TRANSFORMERS") == "1":
            raise
        pytest.fail("transformers is not installed (pip install rlk[hf])")
    return transformers


@pytest.fixture(scope="module")
def processor():
    _transformers()
    return OfflineQwen2VLProcessor(max_pixels=PIXELS_64)


@pytest.fixture(scope="module")
def samples():
    return synthetic_samples("multi-image", seed=0, batch_size=3, image_size=(224, 224))


def _compare(processor, rollout, training, **kwargs):
    return compare_layouts(
        rollout, training, tokens=processor.tokens, token_text=processor.tokenizer.convert_ids_to_tokens, **kwargs
    )


def test_the_parts_are_transformers_own(processor, samples):
    transformers = _transformers()
    image_class = getattr(transformers, "Qwen2VLImageProcessorPil", None) or transformers.Qwen2VLImageProcessor
    assert type(processor.image_processor) is image_class
    assert isinstance(processor.tokenizer, transformers.PreTrainedTokenizerBase)
    ids = processor.tokenizer.convert_tokens_to_ids
    assert (processor.tokens.image, processor.tokens.vision_start) == (ids("<|image_pad|>"), ids("<|vision_start|>"))
    assert processor.tokenizer.convert_ids_to_tokens(processor.tokenizer("click the button")["input_ids"]) == [
        "click",
        "the",
        "button",
    ]
    encoding = processor(samples)
    grids = encoding.image_grid_thw
    assert grids.tolist() == [[1, 16, 16]] * grids.shape[0]
    assert grids.shape[0] == sum(len(s.images) for s in samples) >= 6
    for b, sample in enumerate(samples):
        row = encoding.input_ids[b][encoding.attention_mask[b] == 1]
        starts = (row == processor.tokens.vision_start).nonzero()[:, 0]
        assert len(starts) == len(sample.images)
        for start in starts.tolist():  # <|vision_start|>, 64 <|image_pad|>, <|vision_end|>
            assert bool((row[start + 1 : start + 65] == processor.tokens.image).all())
            assert int(row[start + 65]) == processor.tokens.vision_end
        response = processor.tokenizer(sample.response, add_special_tokens=False)["input_ids"]
        assert encoding.loss_mask[b].sum() == len(response)
        assert row[encoding.loss_mask[b][encoding.attention_mask[b] == 1] == 1].tolist() == response
    assert encoding.position_ids.shape == (3, *encoding.input_ids.shape)


def test_mrope_positions_are_qwen2_vl_s(processor):
    """Text counts up; an image's 8 x 8 merged grid gets (t, h, w) = (s, s + row, s + column); the text after it
    continues from the largest position + 1. Attended tokens get the same positions under left padding."""
    t = processor.tokens
    ids = torch.tensor([[20, 21, t.vision_start] + [t.image] * 64 + [t.vision_end, 22, 23]])
    grid = torch.tensor([[1, 16, 16]])
    positions = mrope_positions(ids, torch.ones_like(ids), t, image_grid_thw=grid)
    rows, cols = torch.meshgrid(torch.arange(8), torch.arange(8), indexing="ij")
    visual = torch.stack([torch.zeros(64, dtype=torch.long), rows.reshape(-1), cols.reshape(-1)]) + 3
    expected = torch.cat([torch.arange(3).expand(3, 3), visual, (torch.arange(3) + 11).expand(3, 3)], dim=1)
    assert torch.equal(positions[:, 0], expected)
    padded = torch.cat([torch.zeros(1, 5, dtype=torch.long), ids], 1)
    mask = torch.cat([torch.zeros(1, 5, dtype=torch.long), torch.ones_like(ids)], 1)
    assert torch.equal(mrope_positions(padded, mask, t, image_grid_thw=grid)[:, 0, 5:], expected)


def test_identical_encodings_pass(processor, samples):
    again = OfflineQwen2VLProcessor(max_pixels=PIXELS_64)
    report = _compare(processor, processor(samples), again(samples))
    assert report.passed, report.format()
    assert "position ids ([3, B, T])" in report.compared and "loss masks" in report.compared
    assert again.fingerprint == processor.fingerprint


def test_max_pixels_changes_the_expansion(processor, samples):
    training = OfflineQwen2VLProcessor(max_pixels=PIXELS_16)
    report = _compare(processor, processor(samples), training(samples))
    first = report.first
    assert (first.check, first.sample) == ("media", 0)
    assert first.message == (
        "sample 0: image 0 expands to 64 tokens on the rollout side, 16 on the training side "
        "(image_grid_thw differs: rollout [1, 16, 16], training [1, 8, 8])"
    )
    assert [m.sample for m in report.mismatches] == [0, 1, 2]
    assert f"processor configs differ: size.longest_edge = {PIXELS_64} (rollout) vs {PIXELS_16} (training)" in (
        report.notes
    )


def test_padding_side(processor, samples):
    left = OfflineQwen2VLProcessor(max_pixels=PIXELS_64, padding_side="left")
    rollout, training = processor(samples), left(samples)
    assert bool((training.attention_mask[:, 0] == 0).any()) and bool((rollout.attention_mask[:, -1] == 0).any())
    report = _compare(processor, rollout, training)
    padded = [b for b in range(len(samples)) if rollout.attention_mask[b, -1] == 0]
    assert report.first.check == "padding" and report.first.sample == padded[0]
    assert report.first.message.startswith(
        f"sample {padded[0]}: padding side differs: the rollout side pads on the right ("
    )
    assert {m.check for m in report.mismatches} == {"padding"}
    # get_rope_index gives attended tokens the same 3-D positions whatever the padding side
    assert _compare(processor, rollout, training, check_padding_side=False).passed


def test_dropped_image_placeholder(processor, samples):
    dropped = list(samples)
    two = next(b for b, s in enumerate(samples) if len(s.images) >= 2)
    parts = samples[two].prompt.split(IMAGE_PLACEHOLDER)
    prompt = IMAGE_PLACEHOLDER.join(parts[:2]) + "".join(parts[2:])  # the second image's placeholder is gone
    dropped[two] = RawSample(prompt, samples[two].images[:1] + samples[two].images[2:], samples[two].response)
    assert dropped[two].prompt.count(IMAGE_PLACEHOLDER) == len(samples[two].images) - 1
    rollout, training = processor(samples), processor(dropped)
    report = _compare(processor, rollout, training)
    first = report.first
    assert (first.check, first.sample) == ("media", two)
    row = rollout.input_ids[two][rollout.attention_mask[two] == 1]
    start = int((row == processor.tokens.image).nonzero()[64, 0])  # image 1's first visual token
    assert first.message.startswith(
        f"sample {two}: image 1 (rollout tokens {start}..{start + 63}) has no placeholder on the training side"
    )
    assert first.token == start - 1, "the first differing token is image 1's <|vision_start|>"


def test_position_ids_off_by_one(processor, samples):
    rollout, training = processor(samples), processor(samples)
    row = rollout.input_ids[1]
    after = int((row == processor.tokens.vision_end).nonzero()[0, 0]) + 1  # the text after image 0
    training.position_ids = training.position_ids.clone()
    training.position_ids[:, 1, after:] += 1
    report = _compare(processor, rollout, training)
    first = report.first
    assert (first.check, first.sample, first.token) == ("position_ids", 1, after)
    p = rollout.position_ids[:, 1, after].tolist()
    assert first.message.startswith(
        f"sample 1: position ids differ from token {after} (text after image 0): rollout (t, h, w) = "
        f"({p[0]}, {p[1]}, {p[2]}), training (t, h, w) = ({p[0] + 1}, {p[1] + 1}, {p[2] + 1})"
    )
    assert "(off by one)" in first.message
    assert len(report.mismatches) == 1


def test_loss_mask_over_the_visual_prefix(processor, samples):
    rollout, training = processor(samples), processor(samples)
    visual = (rollout.input_ids[0] == processor.tokens.image).nonzero()[:64, 0]
    first_token, last_token = int(visual[0]), int(visual[-1])
    training.loss_mask = training.loss_mask.clone()
    training.loss_mask[0, : last_token + 1] = 1  # the whole prompt up to the end of image 0: the visual prefix
    report = _compare(processor, rollout, training)
    first = report.first
    assert (first.check, first.sample, first.span) == ("loss_mask", 0, (first_token, last_token + 1))
    assert first.message == (
        f"sample 0: the loss mask covers visual tokens {first_token}..{last_token} (image 0: all 64 of its tokens) "
        "on the training side"
    )
    assert "loss masks differ from token 0 (text before any media)" in report.mismatches[1].message


def test_fingerprint_is_the_same_on_every_transformers(processor):
    """The layout config is read back from the processor under the same keys on 4.57 and 5.x, so the same
    settings give the same fingerprint across versions (this value is checked under both in CI)."""
    assert processor.config["size"] == {"longest_edge": PIXELS_64, "shortest_edge": 4 * 28 * 28}
    assert processor.config["merge_size"] == 2 and processor.config["padding_side"] == "right"
    assert processor.fingerprint == "3baeb6805d4bf239"
    assert OfflineQwen2VLProcessor(max_pixels=PIXELS_64, padding_side="left").fingerprint != processor.fingerprint


def test_cli_offline_processor(capsys):
    _transformers()
    base = ["multimodal-parity", "--offline-processor", "--fixture", "image-text", "--samples", "2"]
    assert cli.main(base) == 0
    assert capsys.readouterr().out.startswith("layout parity: PASS (2 samples")
    assert cli.main([*base, "--training-max-pixels", "3136", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["first"]["check"] == "media" and report["first"]["sample"] == 0
    assert "on the training side (image_grid_thw differs: " in report["first"]["message"]
    assert report["first"]["message"].startswith("sample 0: image 0 expands to ")
    assert cli.main([*base, "--training-padding-side", "left"]) == 1
    assert "padding side differs" in capsys.readouterr().out
    assert cli.main([*base, "--rollout-max-pixels", "10"]) == 2
    assert "max_pixels: expected an int >= 3136, got 10" in capsys.readouterr().err
