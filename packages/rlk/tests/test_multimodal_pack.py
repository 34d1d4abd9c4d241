"""Modality-aware packing (``rlk.multimodal.pack_batch`` / ``unpack_batch``) on the reference and Triton backends:
packed rows, ``cu_seqlens``, position ids, temporal ids and span offsets against a plain Python loop (frame- and
token-major video order), bitwise round trips on every fixture kind with left and right padding, offsets that do
not depend on the rest of the batch, gradients (each direction's backward is the other direction), the two
backends bit for bit, the ``total`` argument, and bad input."""

from __future__ import annotations

import pytest
import torch

import rlk
import rlk.multimodal as mm
from rlk.integrations.multimodal.schema import MODALITIES, SPAN_DTYPE, MultimodalBatch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# the Triton backend: under the interpreter on the CPU, compiled on a GPU
BACKENDS = [
    "reference",
    pytest.param("triton", marks=pytest.mark.gpu if DEVICE.type == "cuda" else pytest.mark.triton_interpreter),
]
ORDERS = ("frame", "token")


@pytest.fixture(params=BACKENDS)
def backend(request):
    with rlk.use_backend(request.param):
        yield request.param


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _data(shape, dtype, seed=0):
    if dtype.is_floating_point:
        return torch.randn(shape, generator=_gen(seed)).to(dtype).to(DEVICE)
    return torch.randint(-1000, 50000, shape, generator=_gen(seed)).to(dtype).to(DEVICE)


# ---------------------------------------------------------------------------
# batches: fixtures, one sample alone, samples of several kinds joined
# ---------------------------------------------------------------------------


def _samples(batch: MultimodalBatch) -> list[dict]:
    """Each sequence of ``batch`` on its own: attended ids, spans relative to its first attended token."""
    out = []
    for b in range(batch.batch_size):
        cols = batch.attention_mask[b].nonzero().flatten().tolist()
        first = cols[0]
        assert cols == list(range(first, first + len(cols)))  # the fixtures have no holes
        rows = [i for i, row in enumerate(batch.modality_spans.tolist()) if row[0] == b]
        out.append(
            {
                "ids": batch.input_ids[b, first : first + len(cols)].tolist(),
                "media": [(a - first, e - first, tag) for _, a, e, tag in batch.modality_spans[rows].tolist()],
                "grid": batch.media_grid_thw[rows].tolist(),
                "keys": [batch.media_cache_keys[i] for i in rows],
                "loss": [(a - first, e - first, tag) for s, a, e, tag in batch.loss_spans.tolist() if s == b],
            }
        )
    return out


def _build(samples: list[dict], padding_side: str = "right") -> MultimodalBatch:
    """A batch of ``samples`` padded to the longest one on ``padding_side``."""
    length = max(len(s["ids"]) for s in samples)
    ids = torch.zeros(len(samples), length, dtype=torch.int64)
    mask = torch.zeros(len(samples), length, dtype=torch.int64)
    media, loss, grid, keys = [], [], [], []
    for b, s in enumerate(samples):
        shift = length - len(s["ids"]) if padding_side == "left" else 0
        ids[b, shift : shift + len(s["ids"])] = torch.tensor(s["ids"])
        mask[b, shift : shift + len(s["ids"])] = 1
        media += [(b, a + shift, e + shift, tag) for a, e, tag in s["media"]]
        loss += [(b, a + shift, e + shift, tag) for a, e, tag in s["loss"]]
        grid += s["grid"]
        keys += s["keys"]
    lengths = torch.tensor([e - a for _, a, e, _ in media], dtype=SPAN_DTYPE)
    return MultimodalBatch(
        input_ids=ids.to(DEVICE),
        attention_mask=mask.to(DEVICE),
        media_ids=torch.arange(len(media), dtype=torch.int64, device=DEVICE),
        modality_spans=torch.tensor(media, dtype=SPAN_DTYPE).reshape(-1, 4).to(DEVICE),
        loss_spans=torch.tensor(loss, dtype=SPAN_DTYPE).reshape(-1, 4).to(DEVICE),
        vision_token_offsets=torch.nn.functional.pad(lengths.cumsum(0, dtype=SPAN_DTYPE), (1, 0)).to(DEVICE),
        media_cache_keys=tuple(keys),
        processor_fingerprint="test",
        media_grid_thw=torch.tensor(grid, dtype=torch.int64).reshape(-1, 3).to(DEVICE),
    )


def _mixed(padding_side: str = "right") -> MultimodalBatch:
    """Videos, images and GUI screenshots in one batch (two samples of each of three kinds, interleaved)."""
    kinds = [_samples(mm.synthetic_batch(k, seed=3, batch_size=2)) for k in ("video", "multi-image", "image-text")]
    return _build([s for pair in zip(*kinds) for s in pair], padding_side)


def _batch(kind: str, padding_side: str) -> MultimodalBatch:
    if kind == "mixed":
        return _mixed(padding_side)
    return mm.synthetic_batch(kind, seed=1, batch_size=3, padding_side=padding_side, device=DEVICE)


KINDS = (*mm.KINDS, "mixed")


# ---------------------------------------------------------------------------
# the spec as a loop
# ---------------------------------------------------------------------------


def loop_pack(batch: MultimodalBatch, x: torch.Tensor, video_order: str):
    """The readable spec: packed rows of ``x``, cu_seqlens, position ids, temporal ids, span offsets."""
    mask, spans, grid = batch.attention_mask.tolist(), batch.modality_spans.tolist(), batch.media_grid_thw.tolist()
    rows, positions, temporal, cu, offsets = [], [], [], [0], []
    for b in range(batch.batch_size):
        cols = [c for c in range(batch.seq_len) if mask[b][c]]  # attended columns; position = index here
        videos = {a: (e, grid[i][0]) for i, (s, a, e, tag) in enumerate(spans) if s == b and tag == 2}
        offsets += [cu[-1] + cols.index(a) for s, a, _, _ in spans if s == b]
        k = 0
        while k < len(cols):
            column = cols[k]
            if column in videos:  # a whole video span: its frames, each `per` spatial tokens
                end, frames = videos[column]
                per = (end - column) // frames
                order = (
                    [(f, s) for f in range(frames) for s in range(per)]
                    if video_order == "frame"
                    else [(f, s) for s in range(per) for f in range(frames)]
                )
                for f, s in order:
                    rows.append(x[b, column + f * per + s])
                    positions.append(k + f * per + s)
                    temporal.append(f)
                k += end - column
            else:
                rows.append(x[b, column])
                positions.append(k)
                temporal.append(-1)
                k += 1
        cu.append(cu[-1] + len(cols))
    packed = torch.stack(rows) if rows else x.new_empty((0, *x.shape[2:]))
    as_long = lambda v: torch.tensor(v, dtype=torch.int64, device=DEVICE)  # noqa: E731
    return packed, as_long(cu).int(), as_long(positions), as_long(temporal), as_long(offsets).int()


# ---------------------------------------------------------------------------
# tests
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("video_order", ORDERS)
@pytest.mark.parametrize("padding_side", ["right", "left"])
@pytest.mark.parametrize("kind", KINDS)
def test_pack_matches_the_loop_and_round_trips(backend, kind, padding_side, video_order):
    batch = _batch(kind, padding_side)
    b, t = batch.batch_size, batch.seq_len
    hidden = _data((b, t, 3), torch.bfloat16, seed=1)
    pairs = _data((b, t, 2, 2), torch.float32, seed=2)
    ids32 = batch.input_ids.int()
    packed = mm.pack_batch(batch, hidden, pairs, ids32, video_order=video_order)

    want, cu, positions, temporal, offsets = loop_pack(batch, hidden, video_order)
    assert torch.equal(packed.tensors[0], want)
    assert torch.equal(packed.tensors[1], loop_pack(batch, pairs, video_order)[0])
    assert torch.equal(packed.tensors[2], loop_pack(batch, ids32, video_order)[0])
    assert packed.input_ids.dtype == torch.int64
    assert torch.equal(packed.input_ids, loop_pack(batch, batch.input_ids, video_order)[0])
    assert packed.cu_seqlens.dtype == torch.int32 and torch.equal(packed.cu_seqlens, cu)
    assert packed.position_ids.dtype == torch.int64 and torch.equal(packed.position_ids, positions)
    assert packed.temporal_ids.dtype == torch.int64 and torch.equal(packed.temporal_ids, temporal)
    assert packed.span_offsets.dtype == torch.int32 and torch.equal(packed.span_offsets, offsets)
    assert packed.total == int(batch.attention_mask.sum()) and packed.video_order == video_order

    keep = batch.attention_mask.bool()
    for x, p in zip((hidden, pairs, ids32), packed.tensors):
        shape = keep.view(b, t, *([1] * (x.dim() - 2)))
        assert torch.equal(mm.unpack_batch(packed, p), torch.where(shape, x, torch.zeros_like(x)))
        fill = -7 if not x.dtype.is_floating_point else -2.5
        assert torch.equal(
            mm.unpack_batch(packed, p, padding_value=fill), torch.where(shape, x, torch.full_like(x, fill))
        )
    assert torch.equal(mm.unpack_batch(packed, packed.input_ids), batch.input_ids)  # padding id 0


@pytest.mark.parametrize("padding_side", ["right", "left"])
def test_frame_order_is_rlk_pack(backend, padding_side):
    batch = _mixed(padding_side)
    hidden = _data((batch.batch_size, batch.seq_len, 4), torch.float32, seed=3)
    packed = mm.pack_batch(batch, hidden)
    want, cu, positions = rlk.pack(hidden, batch.attention_mask)
    assert torch.equal(packed.tensors[0], want)
    assert torch.equal(packed.cu_seqlens, cu) and torch.equal(packed.position_ids, positions)


def test_token_order_interleaves_the_frames_of_each_video():
    """An explicit small case: a video of t = 3 frames of 2 tokens each between two text tokens."""
    ids = torch.tensor([[10, 4, 70, 71, 72, 73, 74, 75, 5, 11, 0]], device=DEVICE)
    batch = MultimodalBatch(
        input_ids=ids,
        attention_mask=(ids != 0).long(),
        media_ids=torch.zeros(1, dtype=torch.int64, device=DEVICE),
        modality_spans=torch.tensor([[0, 2, 8, MODALITIES["video"]]], dtype=SPAN_DTYPE, device=DEVICE),
        loss_spans=torch.tensor([[0, 9, 10, 0]], dtype=SPAN_DTYPE, device=DEVICE),
        vision_token_offsets=torch.tensor([0, 6], dtype=SPAN_DTYPE, device=DEVICE),
        media_cache_keys=("k",),
        processor_fingerprint="test",
        media_grid_thw=torch.tensor([[3, 2, 4]], device=DEVICE),
    )
    frame = mm.pack_batch(batch, video_order="frame")
    token = mm.pack_batch(batch, video_order="token")
    assert frame.input_ids.tolist() == [10, 4, 70, 71, 72, 73, 74, 75, 5, 11]
    assert token.input_ids.tolist() == [10, 4, 70, 72, 74, 71, 73, 75, 5, 11]
    assert frame.temporal_ids.tolist() == [-1, -1, 0, 0, 1, 1, 2, 2, -1, -1]
    assert token.temporal_ids.tolist() == [-1, -1, 0, 1, 2, 0, 1, 2, -1, -1]
    assert token.position_ids.tolist() == [0, 1, 2, 4, 6, 3, 5, 7, 8, 9]
    assert frame.span_offsets.tolist() == token.span_offsets.tolist() == [2]
    assert token.remap_spans(batch.loss_spans).tolist() == [[0, 9, 10, 0]]
    assert torch.equal(mm.unpack_batch(token, token.input_ids), ids)


@pytest.mark.parametrize("video_order", ORDERS)
def test_span_offsets_and_rows_do_not_depend_on_the_rest_of_the_batch(backend, video_order):
    mixed = {side: _mixed(side) for side in ("right", "left")}
    samples = _samples(mixed["right"])
    packs = {side: mm.pack_batch(batch, video_order=video_order) for side, batch in mixed.items()}
    spans = mixed["right"].modality_spans[:, 0].long()
    for b, sample in enumerate(samples):
        alone = mm.pack_batch(_build([sample]), video_order=video_order)
        assert torch.equal(alone.cu_seqlens[:1], torch.zeros(1, dtype=torch.int32, device=DEVICE))
        for packed in packs.values():
            start, end = packed.cu_seqlens[b], packed.cu_seqlens[b + 1]
            relative = packed.span_offsets[spans == b] - start
            assert torch.equal(relative, alone.span_offsets)
            for name in ("input_ids", "position_ids", "temporal_ids"):
                assert torch.equal(getattr(packed, name)[start:end], getattr(alone, name))
    # negative control: the absolute offsets of the last sample are not its offsets alone
    assert not torch.equal(packs["right"].span_offsets[spans == b], alone.span_offsets)


@pytest.mark.parametrize("kind", KINDS)
def test_remapped_spans_address_the_same_tokens(kind):
    batch = _batch(kind, "left")
    packed = mm.pack_batch(batch, video_order="token")
    for table in (batch.loss_spans, batch.modality_spans):
        remapped = packed.remap_spans(table)
        assert remapped.dtype == SPAN_DTYPE
        assert torch.equal(remapped[:, 0], table[:, 0]) and torch.equal(remapped[:, 3], table[:, 3])
        for (s, a, e, _), (_, pa, pe, _) in zip(table.tolist(), remapped.tolist()):
            assert sorted(packed.input_ids[pa:pe].tolist()) == sorted(batch.input_ids[s, a:e].tolist())
            assert pe - pa == e - a
    remapped = packed.remap_spans(batch.loss_spans).tolist()
    for (s, a, e, _), (_, pa, pe, _) in zip(batch.loss_spans.tolist(), remapped):
        assert torch.equal(packed.input_ids[pa:pe], batch.input_ids[s, a:e])  # text: the same order


@pytest.mark.parametrize("video_order", ORDERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_backward_is_the_other_direction(backend, dtype, video_order):
    batch = _mixed("left")
    hidden = _data((batch.batch_size, batch.seq_len, 2, 3), dtype, seed=4).requires_grad_(True)
    packed = mm.pack_batch(batch, hidden, video_order=video_order)
    grad = _data(tuple(packed.tensors[0].shape), dtype, seed=5)
    packed.tensors[0].backward(grad)
    assert hidden.grad.dtype == dtype
    assert torch.equal(hidden.grad, mm.unpack_batch(packed, grad))

    leaf = packed.tensors[0].detach().clone().requires_grad_(True)
    out = mm.unpack_batch(packed, leaf, padding_value=1.0)
    grad_out = _data(tuple(out.shape), dtype, seed=6)
    out.backward(grad_out)
    assert torch.equal(leaf.grad, mm.pack_batch(batch, grad_out, video_order=video_order).tensors[0])


def test_fp64_gradcheck():
    batch = mm.synthetic_batch("video", seed=2, batch_size=2, padding_side="left", device=DEVICE)
    with rlk.use_backend("reference"):
        x = torch.randn(2, batch.seq_len, 2, dtype=torch.float64, generator=_gen(7)).to(DEVICE).requires_grad_(True)
        assert torch.autograd.gradcheck(lambda x: mm.pack_batch(batch, x, video_order="token").tensors[0], (x,))
        packed = mm.pack_batch(batch, x.detach(), video_order="token")
        p = packed.tensors[0].clone().requires_grad_(True)
        assert torch.autograd.gradcheck(lambda p: mm.unpack_batch(packed, p, padding_value=0.5), (p,))


@pytest.mark.triton_interpreter
@pytest.mark.parametrize("video_order", ORDERS)
def test_triton_and_reference_are_bitwise_equal(video_order):
    batch = _mixed("left")
    hidden = _data((batch.batch_size, batch.seq_len, 5), torch.bfloat16, seed=8)
    results = {}
    for name in ("reference", "triton"):
        with rlk.use_backend(name):
            leaf = hidden.clone().requires_grad_(True)
            packed = mm.pack_batch(batch, leaf, batch.input_ids, video_order=video_order)
            (packed.tensors[0].float() * torch.arange(5, device=DEVICE)).sum().backward()
            back = mm.unpack_batch(packed, packed.tensors[0].detach(), padding_value=3.0)
            results[name] = [*packed.tensors, packed.position_ids, packed.temporal_ids, back, leaf.grad]
    for ref, tri in zip(results["reference"], results["triton"]):
        assert torch.equal(ref, tri)


def test_total_argument_and_value_checks(backend, monkeypatch):
    batch = _mixed("right")
    hidden = _data((batch.batch_size, batch.seq_len, 2), torch.float32, seed=9)
    packed = mm.pack_batch(batch, hidden, video_order="token")
    total = packed.total
    with pytest.raises(ValueError, match=f"total: expected the number of attended tokens of the batch, {total}; got 3"):
        mm.pack_batch(batch, hidden, total=3)
    with pytest.raises(TypeError, match="total: expected an integer"):
        mm.pack_batch(batch, hidden, total=float(total))
    monkeypatch.setenv("RLK_CHECK_VALUES", "0")  # no host synchronization at all
    given = mm.pack_batch(batch, hidden, video_order="token", total=total)
    for name in ("input_ids", "cu_seqlens", "position_ids", "temporal_ids", "span_offsets", "slot"):
        assert torch.equal(getattr(given, name), getattr(packed, name))
    assert torch.equal(given.tensors[0], packed.tensors[0])


def test_a_video_span_that_is_not_whole_frames_is_an_error():
    batch = mm.synthetic_batch("video", seed=0, batch_size=2, device=DEVICE)
    grid = batch.media_grid_thw.clone()
    grid[1, 0] = 4  # the 18 tokens of sequence 1's video are not 4 frames
    batch.media_grid_thw = grid
    with pytest.raises(
        ValueError, match=r"modality_spans row 1 \(sequence 1, tokens 3..20\): a video span of 18 tokens is not t = 4 "
    ):
        mm.pack_batch(batch)


def test_empty_and_image_only_batches(backend):
    batch = mm.synthetic_batch("image-text", seed=0, batch_size=2, device=DEVICE)
    packed = mm.pack_batch(batch, video_order="token")
    assert torch.equal(packed.temporal_ids, torch.full_like(packed.temporal_ids, -1))
    sample = _samples(batch)[0]
    text = _build([{**sample, "media": [], "grid": [], "keys": []}])
    packed = mm.pack_batch(text, video_order="token")
    assert packed.span_offsets.shape == (0,) and torch.equal(mm.unpack_batch(packed, packed.input_ids), text.input_ids)
    x = _data((1, text.seq_len, 0), torch.float32)
    assert mm.pack_batch(text, x).tensors[0].shape == (packed.total, 0)


def _video():
    """The bad-input cases' batch: on the CPU, like the tensors they pass with it."""
    return mm.synthetic_batch("video", seed=0, batch_size=2, device="cpu")


@pytest.mark.parametrize(
    "call, error, message",
    [
        (lambda: mm.pack_batch({"input_ids": 1}), TypeError, "batch: expected a MultimodalBatch, got dict"),
        (
            lambda: mm.pack_batch(_video(), video_order="time"),
            ValueError,
            "video_order: expected one of 'frame', 'token', got 'time'",
        ),
        (
            lambda: mm.pack_batch(_video(), torch.zeros(2, 39), torch.zeros(2, 38, 4)),
            ValueError,
            r"tensors\[1\]: expected shape \[B, T, \*trailing\] with \[B, T\] = \[2, 39\]",
        ),
        (lambda: mm.pack_batch(_video(), torch.zeros(78)), ValueError, r"tensors\[0\]: expected shape \[B, T"),
        (
            lambda: mm.pack_batch(_video(), torch.zeros(2, 39, dtype=torch.int8)),
            TypeError,
            r"tensors\[0\]: expected dtype float32, float16, bfloat16, float64, int32 or int64",
        ),
        (lambda: mm.pack_batch(_video(), [[0.0] * 39] * 2), TypeError, r"tensors\[0\]: expected a torch.Tensor"),
        (
            lambda: mm.pack_batch(_video(), torch.zeros(2, 39, device="meta")),
            ValueError,
            r"tensors\[0\]: expected device cpu",
        ),
        (lambda: mm.pack_batch(_video(), total=-1), ValueError, "total: expected an int >= 0"),
        (
            lambda: mm.pack_batch(MultimodalBatch(**{**_video().__dict__, "media_grid_thw": None})),
            ValueError,
            "media_grid_thw: required by pack_batch when modality_spans has rows",
        ),
        (
            lambda: mm.unpack_batch(rlk.pack(torch.zeros(2, 3), torch.ones(2, 3, dtype=torch.int64)), torch.zeros(6)),
            TypeError,
            "packed_batch: expected a PackedBatch",
        ),
        (
            lambda: mm.unpack_batch(mm.pack_batch(_video()), torch.zeros(7, 2)),
            ValueError,
            r"packed: expected shape \[M, \*trailing\] with M = 73",
        ),
        (lambda: mm.unpack_batch(mm.pack_batch(_video()), torch.tensor(1.0)), ValueError, "packed: expected shape"),
        (
            lambda: mm.unpack_batch(mm.pack_batch(_video()), torch.zeros(73, dtype=torch.int64), padding_value=0.5),
            ValueError,
            "padding_value: expected an integer",
        ),
        (
            lambda: mm.unpack_batch(mm.pack_batch(_video()), torch.zeros(73), padding_value=None),
            TypeError,
            "padding_value: expected an int or a float",
        ),
        (
            lambda: mm.unpack_batch(mm.pack_batch(_video()), torch.zeros(73, dtype=torch.float16), padding_value=1e10),
            ValueError,
            r"padding_value: 10000000000.0 is not a value of torch.float16 \(it would be stored as inf\)",
        ),
        (
            lambda: mm.unpack_batch(
                mm.pack_batch(_video()), torch.zeros(73, dtype=torch.int64), padding_value=2**53 + 1
            ),
            ValueError,
            "padding_value: 9007199254740993 is not exactly a float64",
        ),
        (
            lambda: mm.pack_batch(_video()).remap_spans(torch.zeros(3, 3, dtype=torch.int32)),
            ValueError,
            r"spans: expected an int \[S, 4\] span table",
        ),
    ],
)
def test_bad_input_gets_a_clear_error(call, error, message):
    with pytest.raises(error, match=message):
        call()


def test_the_package_exports():
    assert rlk.multimodal.pack_batch is mm.pack_batch and "unpack_batch" in mm.__all__
    assert mm.VIDEO_ORDERS == ORDERS and "PackedBatch" in mm.__all__


@pytest.mark.parametrize("video_order", ORDERS)
def test_torch_compile_fullgraph_matches_eager(video_order):
    """With ``total`` given, pack_batch and unpack_batch trace into one graph: no host read of device data."""
    batch = _mixed("left")
    total = int(batch.attention_mask.sum())

    def fn(x):
        packed = mm.pack_batch(batch, x, video_order=video_order, total=total)
        out = mm.unpack_batch(packed, packed.tensors[0] * 2, padding_value=1.0)
        return packed.tensors[0], packed.position_ids, packed.temporal_ids, packed.span_offsets, out, (out * out).sum()

    x = _data((batch.batch_size, batch.seq_len, 3), torch.float32, seed=10)
    results = []
    with rlk.use_backend("reference"):
        for f in (fn, torch.compile(fn, fullgraph=True, backend="aot_eager")):
            leaf = x.clone().requires_grad_(True)
            *outs, loss = f(leaf)
            loss.backward()
            results.append([o.detach() for o in outs] + [leaf.grad])
    for eager, compiled in zip(*results):
        assert torch.equal(eager, compiled)
