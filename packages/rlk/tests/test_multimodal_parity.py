"""rlk.multimodal.compare_layouts and ``rlk multimodal-parity`` on already-encoded tensors (no transformers): identical
encodings pass; each planted mismatch (placeholder expansion, a dropped image, token ids, an attention-mask hole,
padding side, position ids off by one, 3-D vs 1-D positions, a loss mask over visual tokens, grids that disagree
with the tokens) is the reported first mismatch, with its sample, token and reason."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from rlk.app import cli
from rlk.multimodal import FIXTURE_TOKENS, KINDS, Encoding, compare_layouts, synthetic_batch

T = FIXTURE_TOKENS


def _encode(samples, *, padding_side="right", three_d=False) -> Encoding:
    """Lay out ``samples`` (lists of ``("text", n)``, ``("image", (t, h, w))``, ``("video", grid)``,
    ``("response", n)``) with the fixture vocabulary: text token k is 8 + k % 50; 1-D positions count attended
    tokens (``three_d``: the same on three rows)."""
    rows, losses, images, videos = [], [], [], []
    for spec in samples:
        ids, loss = [], []
        for kind, arg in spec:
            if kind in ("text", "response"):
                ids += [8 + (len(ids) + k) % 50 for k in range(arg)]
                loss += [int(kind == "response")] * arg
            else:
                n = arg[0] * arg[1] * arg[2] // 4
                ids += [T.vision_start] + [T.image if kind == "image" else T.video] * n + [T.vision_end]
                loss += [0] * (n + 2)
                (images if kind == "image" else videos).append(list(arg))
        rows.append(ids)
        losses.append(loss)
    length = max(map(len, rows))
    input_ids = torch.zeros(len(rows), length, dtype=torch.int64)
    mask, loss_mask = torch.zeros_like(input_ids), torch.zeros_like(input_ids)
    for b, (ids, loss) in enumerate(zip(rows, losses)):
        cols = slice(length - len(ids), length) if padding_side == "left" else slice(0, len(ids))
        input_ids[b, cols], mask[b, cols], loss_mask[b, cols] = torch.tensor(ids), 1, torch.tensor(loss)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    return Encoding(
        input_ids=input_ids,
        attention_mask=mask,
        position_ids=positions.expand(3, -1, -1).clone() if three_d else positions,
        loss_mask=loss_mask,
        image_grid_thw=torch.tensor(images, dtype=torch.int64).reshape(-1, 3) if images else None,
        video_grid_thw=torch.tensor(videos, dtype=torch.int64).reshape(-1, 3) if videos else None,
    )


SAMPLES = [
    [("text", 3), ("image", (1, 8, 8)), ("text", 2), ("response", 5)],
    [("text", 4), ("image", (1, 4, 6)), ("text", 1), ("image", (1, 4, 4)), ("response", 3)],
    [("text", 2), ("video", (2, 4, 4)), ("text", 3), ("response", 6)],
    [("text", 6), ("response", 2)],
]


def _compare(rollout, training, **kwargs):
    return compare_layouts(rollout, training, tokens=T, **kwargs)


@pytest.mark.parametrize("kind", KINDS)
def test_identical_encodings_pass(kind):
    encoding = Encoding.from_batch(synthetic_batch(kind, seed=5))
    report = _compare(encoding, Encoding.from_batch(synthetic_batch(kind, seed=5)))
    assert report.passed and report.first is None and report.mismatches == []
    assert report.format().startswith("layout parity: PASS (4 samples")
    assert report.to_dict()["passed"] is True
    # the negative control: another seed's batch is not the same samples
    assert not _compare(encoding, Encoding.from_batch(synthetic_batch(kind, seed=6))).passed


def test_hand_built_encodings_pass_in_both_position_layouts():
    for three_d in (False, True):
        report = _compare(_encode(SAMPLES, three_d=three_d), _encode(SAMPLES, three_d=three_d))
        assert report.passed, report.format()
        assert any(
            c.startswith("position ids ([3, B, T]" if three_d else "position ids ([B, T]") for c in report.compared
        )


def test_expansion_difference_names_the_grids():
    smaller = [list(s) for s in SAMPLES]
    smaller[0][1] = ("image", (1, 4, 4))
    report = _compare(_encode(SAMPLES), _encode(smaller))
    first = report.first
    assert (first.check, first.sample, first.token, first.span) == ("media", 0, 4, (4, 20))
    assert first.message == (
        "sample 0: image 0 expands to 16 tokens on the rollout side, 4 on the training side "
        "(image_grid_thw differs: rollout [1, 8, 8], training [1, 4, 4])"
    )
    assert len(report.mismatches) == 1, "the sample is not compared further; the others match"


def test_same_grid_different_count_says_so():
    rollout, training = _encode(SAMPLES), _encode(SAMPLES)
    training.image_grid_thw = rollout.image_grid_thw.clone()
    training.image_grid_thw[0] = torch.tensor([1, 4, 4])
    training.input_ids = training.input_ids.clone()
    report = _compare(rollout, _encode([[("text", 3), ("image", (1, 4, 4)), ("text", 2), ("response", 5)]]))
    assert report.mismatches[0].check == "batch" and "batch size differs: 4 samples" in report.mismatches[0].message
    # a side whose tokens disagree with its own grid: reported on that side
    bad = _encode(SAMPLES)
    bad.image_grid_thw = bad.image_grid_thw.clone()
    bad.image_grid_thw[0] = torch.tensor([1, 4, 4])
    report = _compare(_encode(SAMPLES), bad)
    assert report.first.check == "media"
    assert "image_grid_thw is [1, 8, 8] on both sides" not in report.first.message
    spans = [m for m in report.mismatches if m.check == "media_spans"]
    assert spans and spans[0].message == (
        "sample 0: on the training side image 0 has 16 placeholder tokens (4..19) but its image_grid_thw row 0 "
        "[1, 4, 4] gives 4 (merge 2)"
    )


def test_dropped_image_placeholder():
    dropped = [list(s) for s in SAMPLES]
    dropped[1] = [("text", 4), ("image", (1, 4, 6)), ("text", 1), ("response", 3)]
    report = _compare(_encode(SAMPLES), _encode(dropped))
    first = report.first
    assert (first.check, first.sample) == ("media", 1)
    assert first.message.startswith(
        "sample 1: image 1 (rollout tokens 14..17) has no placeholder on the training side: "
        "rollout 2 image(s), 0 video(s), training 1 image(s), 0 video(s)"
    )
    assert first.span == (14, 18) and first.token == 13
    # the training side's grid still lists the dropped image: that shows as a batch-level mismatch too
    kept_grid = _encode(dropped)
    kept_grid.image_grid_thw = _encode(SAMPLES).image_grid_thw
    report = _compare(_encode(SAMPLES), kept_grid)
    assert report.first.message == (
        f"the training side: image_grid_thw has 3 rows but its tokens hold 2 image(s) (runs of the image "
        f"placeholder id {T.image})"
    )
    assert report.mismatches[1].message.startswith("sample 1: image 1 (rollout tokens 14..17) has no placeholder")


def test_token_difference_and_text_length():
    rollout, training = _encode(SAMPLES), _encode(SAMPLES)
    training.input_ids = training.input_ids.clone()
    training.input_ids[2, 13] = 63
    report = _compare(rollout, training, token_text=lambda i: f"w{i}")
    assert report.first.check == "tokens" and report.first.token == 13
    assert report.first.message == (
        f"sample 2: token 13 (text after video 0) differs: rollout {int(rollout.input_ids[2, 13])} "
        f"('w{int(rollout.input_ids[2, 13])}'), training 63 ('w63') (1 token(s) differ)"
    )
    longer = [list(s) for s in SAMPLES]
    longer[3] = [("text", 7), ("response", 2)]
    report = _compare(_encode(SAMPLES), _encode(longer))
    assert report.first.message.startswith("sample 3: 8 tokens on the rollout side, 9 on the training side")


def test_attention_mask_hole_and_values():
    training = _encode(SAMPLES)
    training.attention_mask = training.attention_mask.clone()
    training.attention_mask[0, 2] = 0
    report = _compare(_encode(SAMPLES), training)
    assert report.first.check == "attention_mask" and report.first.sample == 0 and report.first.token == 2
    assert "training attention_mask is 0 at column 2 between attended tokens" in report.first.message
    training.attention_mask[0, 2] = 2
    report = _compare(_encode(SAMPLES), training)
    assert "holds 2 at column 2 (expected 0 or 1)" in report.first.message


def test_padding_side_differs():
    report = _compare(_encode(SAMPLES), _encode(SAMPLES, padding_side="left"))
    first = report.first
    assert (first.check, first.sample) == ("padding", 1), "sample 0 is the longest: no padding"
    assert first.message == (
        "sample 1: padding side differs: the rollout side pads on the right (6 tokens), the training side on the "
        "left (6 tokens)"
    )
    assert {m.check for m in report.mismatches} == {"padding"}, "positions and loss of attended tokens agree"
    assert _compare(_encode(SAMPLES), _encode(SAMPLES, padding_side="left"), check_padding_side=False).passed


@pytest.mark.parametrize("three_d", [False, True])
def test_position_ids_off_by_one(three_d):
    rollout, training = _encode(SAMPLES, three_d=three_d), _encode(SAMPLES, three_d=three_d)
    training.position_ids = training.position_ids.clone()
    training.position_ids[..., 1, 11:] += 1  # sample 1 from the text after image 0
    report = _compare(rollout, training)
    first = report.first
    assert (first.check, first.sample, first.token) == ("position_ids", 1, 11)
    shown = "(t, h, w) = (11, 11, 11)" if three_d else "11"
    assert first.message.startswith(
        f"sample 1: position ids differ from token 11 (text after image 0): rollout {shown}"
    )
    assert first.message.endswith("training = rollout + 1 on every token from there to the end (off by one)")
    # one token moved: no constant offset
    training.position_ids[..., 1, 12:] -= 1
    assert _compare(rollout, training).first.message.endswith("; 1 token(s) differ")


def test_three_d_against_one_d_positions():
    report = _compare(_encode(SAMPLES, three_d=True), _encode(SAMPLES))
    assert report.first.check == "batch" and report.first.sample is None
    assert report.first.message == (
        "position_ids: [3, B, T] (multimodal rotary: temporal, height, width) on the rollout side, [B, T] on the "
        "training side"
    )


def test_loss_mask_over_visual_tokens():
    rollout, training = _encode(SAMPLES), _encode(SAMPLES)
    training.loss_mask = training.loss_mask.clone()
    training.loss_mask[0, 4:20] = 1  # image 0's visual tokens
    report = _compare(rollout, training)
    first = report.first
    assert (first.check, first.sample, first.span) == ("loss_mask", 0, (4, 20))
    assert (
        first.message
        == "sample 0: the loss mask covers visual tokens 4..19 (image 0: all 16 of its tokens) on the training side"
    )
    assert len(report.mismatches) == 1, "the visual tokens explain the whole difference"
    rollout.loss_mask = training.loss_mask
    assert "on both sides" in _compare(rollout, training).first.message
    # a text token under the loss on one side only: the generic difference
    training = _encode(SAMPLES)
    training.loss_mask = training.loss_mask.clone()
    training.loss_mask[3, 0] = 1
    assert _compare(_encode(SAMPLES), training).first.message == (
        "sample 3: loss masks differ from token 0 (text before any media): rollout 0, training 1 (1 token(s) differ)"
    )


def test_first_mismatch_is_ordered_by_sample_then_check():
    training = _encode(SAMPLES)
    training.loss_mask = training.loss_mask.clone()
    training.loss_mask[0, 4:6] = 1
    training.position_ids = training.position_ids.clone()
    training.position_ids[0, 25:] += 2
    training.input_ids = training.input_ids.clone()
    training.input_ids[2, 0] = 9
    report = _compare(_encode(SAMPLES), training)
    assert [(m.sample, m.check) for m in report.mismatches] == [(0, "position_ids"), (0, "loss_mask"), (2, "tokens")]
    assert "covers visual tokens 4..5 (image 0: 2 of its 16 tokens 4..19)" in report.mismatches[1].message
    assert "training = rollout + 2" in report.mismatches[0].message
    text = report.format()
    assert text.startswith("layout parity: FAIL (3 mismatch(es) over 4 samples")
    assert "first mismatch: sample 0: position ids differ" in text


def test_modality_spans_checked_against_tokens():
    batch = synthetic_batch("multi-image", seed=0)
    encoding = Encoding.from_batch(batch)
    shifted = Encoding.from_batch(batch)
    shifted.modality_spans = batch.modality_spans.clone()
    shifted.modality_spans[2, 2] -= 1
    report = _compare(encoding, shifted)
    assert report.first.check == "media_spans"
    assert report.first.message.startswith(
        f"sample {int(batch.modality_spans[2, 0])}: on the training side modality_spans row 2 is"
    )


def test_notes_say_what_was_not_compared():
    rollout, training = _encode(SAMPLES), _encode(SAMPLES)
    training.position_ids = None
    training.loss_mask = None
    rollout.processor_fingerprint, training.processor_fingerprint = "aaaa", "bbbb"
    rollout.processor_config, training.processor_config = {"size": {"longest_edge": 5}}, {"size": {"longest_edge": 6}}
    report = _compare(rollout, training)
    assert report.passed
    assert report.notes == [
        "position_ids not compared (none on the training side)",
        "loss_mask compared only for visual tokens (none on the training side)",
        "processor fingerprints differ: aaaa (rollout) vs bbbb (training)",
        "processor configs differ: size.longest_edge = 5 (rollout) vs 6 (training)",
    ]


@pytest.mark.parametrize(
    ("change", "error", "message"),
    [
        ({"input_ids": torch.zeros(2, 3)}, TypeError, "training.input_ids: expected dtype int64 or int32, got float32"),
        (
            {"attention_mask": torch.ones(2, 4, dtype=torch.int64)},
            ValueError,
            "training.attention_mask: expected shape",
        ),
        ({"position_ids": torch.zeros(2, 2, 3, dtype=torch.int64)}, ValueError, "training.position_ids: expected"),
        ({"image_grid_thw": torch.zeros(1, 2, dtype=torch.int64)}, ValueError, "training.image_grid_thw: expected"),
    ],
)
def test_malformed_encodings_are_errors_naming_side_and_field(change, error, message):
    base = {"input_ids": torch.zeros(2, 3, dtype=torch.int64), "attention_mask": torch.ones(2, 3, dtype=torch.int64)}
    with pytest.raises(error, match=message):
        _compare(base, {**base, **change})
    with pytest.raises(ValueError, match="rollout: missing key 'attention_mask'"):
        _compare({"input_ids": base["input_ids"]}, base)


# ---------------------------------------------------------------------------
# the CLI on files
# ---------------------------------------------------------------------------


def _save(path, encoding: Encoding, **extra):
    data = {k: v for k, v in vars(encoding).items() if isinstance(v, torch.Tensor)}
    torch.save({**data, **extra}, path)
    return str(path)


def _fixture_ids():
    return {
        "image_token_id": T.image,
        "video_token_id": T.video,
        "vision_start_token_id": T.vision_start,
        "vision_end_token_id": T.vision_end,
    }


def test_cli_files_pass_fail_and_json(tmp_path, capsys):
    same = _save(tmp_path / "a.pt", _encode(SAMPLES), **_fixture_ids())
    also = _save(tmp_path / "b.pt", _encode(SAMPLES), **_fixture_ids())
    assert cli.main(["multimodal-parity", same, also]) == 0
    assert capsys.readouterr().out.startswith("layout parity: PASS (4 samples")
    smaller = [list(s) for s in SAMPLES]
    smaller[0][1] = ("image", (1, 4, 4))
    other = _save(tmp_path / "c.pt", _encode(smaller), **_fixture_ids())
    assert cli.main(["multimodal-parity", same, other, "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["passed"] is False and report["first"]["check"] == "media" and report["first"]["sample"] == 0
    assert "expands to 16 tokens on the rollout side, 4 on the training side" in report["first"]["message"]
    # files without the fixture's token ids get Qwen2-VL's, which match no placeholder here: the grids then have
    # no runs to describe (said, with the id), and sample 0 differs in length; the options give the ids
    bare_a, bare_b = _save(tmp_path / "d.pt", _encode(SAMPLES)), _save(tmp_path / "e.pt", _encode(smaller))
    assert cli.main(["multimodal-parity", bare_a, bare_b]) == 1
    out = capsys.readouterr().out
    assert (
        "first mismatch: the rollout side: image_grid_thw has 3 rows but its tokens hold 0 image(s) (runs of the "
        "image placeholder id 151655)" in out
    )
    assert "sample 0: 28 tokens on the rollout side, 16 on the training side; they first differ at token 8" in out
    options = [f"--{k.replace('_', '-')}={v}" for k, v in _fixture_ids().items()]
    assert cli.main(["multimodal-parity", bare_a, bare_b, *options]) == 1
    assert "image 0 expands to 16 tokens" in capsys.readouterr().out


def test_cli_usage_errors_exit_2(tmp_path, capsys):
    good = _save(tmp_path / "a.pt", _encode(SAMPLES))
    assert cli.main(["multimodal-parity", good, str(tmp_path / "missing.pt")]) == 2
    err = capsys.readouterr().err
    assert err.strip().count("\n") == 0 and "training file" in err and "no such file" in err
    torch.save({"input_ids": torch.zeros(2, 3)}, tmp_path / "bad.pt")
    assert cli.main(["multimodal-parity", good, str(tmp_path / "bad.pt")]) == 2
    assert "training: missing key 'attention_mask'" in capsys.readouterr().err
    (tmp_path / "text.pt").write_text("not a tensor file")
    assert cli.main(["multimodal-parity", str(tmp_path / "text.pt"), good]) == 2
    assert "rollout file" in capsys.readouterr().err
    torch.save({**torch.load(good), "image_token_id": 1}, tmp_path / "other_ids.pt")
    torch.save({**torch.load(good), "image_token_id": 2}, tmp_path / "other_ids2.pt")
    assert cli.main(["multimodal-parity", str(tmp_path / "other_ids.pt"), str(tmp_path / "other_ids2.pt")]) == 2
    assert "image_token_id: the two files disagree ([1, 2])" in capsys.readouterr().err
    for argv in (
        ["multimodal-parity"],
        ["multimodal-parity", good],
        ["multimodal-parity", good, good, "--offline-processor"],
    ):
        with pytest.raises(SystemExit) as exc:
            cli.main(argv)
        assert exc.value.code == 2


def test_schema_and_checker_work_without_transformers(tmp_path):
    """A process where transformers and tokenizers cannot be imported: rlk, the fixtures, the schema, the
    comparison and the CLI's file mode all run; the offline processor is a one-line error, exit 2."""
    a = _save(tmp_path / "a.pt", _encode(SAMPLES), **_fixture_ids())
    code = f"""
import sys
sys.modules["transformers"] = None
sys.modules["tokenizers"] = None
import rlk
from rlk.multimodal import Encoding, compare_layouts, synthetic_batch, FIXTURE_TOKENS
batch = synthetic_batch("gui-trajectory", seed=0)
assert compare_layouts(Encoding.from_batch(batch), Encoding.from_batch(batch), tokens=FIXTURE_TOKENS).passed
from rlk.app import cli
assert cli.main(["multimodal-parity", {a!r}, {a!r}]) == 0
sys.exit(cli.main(["multimodal-parity", "--offline-processor"]))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert result.returncode == 2, result.stderr
    assert result.stdout.startswith("layout parity: PASS")
    assert result.stderr.strip() == (
        "rlk multimodal-parity: error: needs the optional dependency transformers (pip install 'rlk[hf]')"
    )
