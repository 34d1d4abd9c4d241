"""The batch-invariant mode (aten overrides) and ``rlk.patch_model`` for transformers models.

Mode bookkeeping runs anywhere a batch-invariant backend serves a device; the routed-op checks
(``triton_interpreter``) run the triton backend's kernels on the CPU under ``TRITON_INTERPRET=1``
with small fp32 / fp16 shapes. The same tests run on a GPU. Batch invariance is checked with
``torch.equal``.
"""

from __future__ import annotations

import contextlib
import os
import warnings
import weakref

import pytest
import torch
import torch.nn.functional as F

from rlk.core import dispatch
from rlk.integrations.batch_invariant import (
    batch_invariant,
    disable_batch_invariant,
    enable_batch_invariant,
    is_batch_invariant_enabled,
    served_calls,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
# Routed ops need the triton backend: on the CPU only under the interpreter.
routed = pytest.mark.triton_interpreter if not ON_GPU else pytest.mark.gpu

pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
]


def _transformers():
    if os.environ.get("RLK_REQUIRE_TRANSFORMERS") == "1":
        import transformers

        return transformers
    return pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _mode_off_after_each_test():
    yield
    disable_batch_invariant()
    assert not is_batch_invariant_enabled()


def _gen(seed):
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------------------
# mode bookkeeping
# ---------------------------------------------------------------------------


@routed
def test_overrides_live_only_inside_the_context_and_nest():
    assert not is_batch_invariant_enabled()
    with batch_invariant():
        assert is_batch_invariant_enabled()
        with batch_invariant():
            assert is_batch_invariant_enabled()
        assert is_batch_invariant_enabled()  # the inner exit keeps the outer block's overrides
    assert not is_batch_invariant_enabled()
    enable_batch_invariant()
    enable_batch_invariant()  # twice: a no-op
    with batch_invariant():
        pass
    assert is_batch_invariant_enabled()  # a block inside the explicit mode does not end it
    disable_batch_invariant()
    assert not is_batch_invariant_enabled()
    with batch_invariant():
        disable_batch_invariant()  # undoes only enable_batch_invariant(): the block keeps the mode
        assert is_batch_invariant_enabled()
    assert not is_batch_invariant_enabled()


@routed
def test_an_exception_inside_the_context_restores_the_stock_kernels():
    a, b = torch.randn(3, 4, device=DEVICE), torch.randn(4, 5, device=DEVICE)
    before = served_calls["mm"]
    with pytest.raises(ZeroDivisionError):
        with batch_invariant():
            torch.mm(a, b)
            raise ZeroDivisionError("inside the block")
    assert not is_batch_invariant_enabled()
    assert served_calls["mm"] == before + 1
    torch.mm(a, b)
    assert served_calls["mm"] == before + 1  # stock kernel again


def test_enabling_without_a_batch_invariant_backend_raises(monkeypatch):
    statuses = {name: status for name, status in dispatch.discover().items() if name == "reference"}
    monkeypatch.setattr(dispatch, "discover", lambda: statuses)
    expected = "(?s)no batch-invariant backend serves.*reference: does not promise"
    with pytest.raises(dispatch.BackendError, match=expected):
        enable_batch_invariant()
    assert not is_batch_invariant_enabled()
    with pytest.raises(dispatch.BackendError):
        with batch_invariant():
            pass
    assert not is_batch_invariant_enabled()


# ---------------------------------------------------------------------------
# routed ops: invariant, equal to the rlk primitives, fallbacks untouched
# ---------------------------------------------------------------------------


def _triton():
    return dispatch.backend_named("triton").primitives


def _invariant_rows(fn, pool: torch.Tensor, probe: int = 3, counts=(1, 2, 7, 16)):
    """``fn(rows)[i]`` for the probe row is bitwise the same in batches of several sizes."""
    alone = fn(pool[probe : probe + 1])[0]
    for n in counts:
        rows = torch.cat([pool[probe + 1 : probe + n], pool[probe : probe + 1]])  # probe last
        assert torch.equal(fn(rows)[-1], alone), f"row differs with {n} rows"
    return alone


@routed
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_matmuls_under_the_mode_are_invariant_and_are_rlk(dtype):
    g = _gen(0)
    pool = torch.randn(20, 40, generator=g).to(DEVICE, dtype)
    w = (torch.randn(24, 40, generator=g) / 6).to(DEVICE, dtype)
    bias = torch.randn(24, generator=g).to(DEVICE, dtype)
    expect = torch.empty(1, 24, device=DEVICE, dtype=dtype)
    _triton()["matmul_fwd"](pool[3:4], w.t(), bias, expect)
    with batch_invariant():
        start = dict(served_calls)
        got = _invariant_rows(lambda x: F.linear(x, w, bias), pool)
        assert torch.equal(got, expect[0])
        _invariant_rows(lambda x: torch.mm(x, w.t()), pool)
        _invariant_rows(lambda x: torch.addmm(bias, x, w.t(), beta=0.5, alpha=2.0), pool)
        batched = pool[:16].reshape(2, 8, 40)
        out = torch.bmm(batched, w.t().expand(2, 40, 24))
        assert torch.equal(out[1, 2], torch.bmm(batched[1:2, 2:3], w.t()[None])[0, 0])
        for name in ("mm", "addmm", "bmm"):
            assert served_calls[name] > start.get(name, 0), f"{name} was not served by rlk"


@routed
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_softmax_and_mean_under_the_mode(dtype):
    pool = (torch.randn(20, 33, generator=_gen(1)) * 3).to(DEVICE, dtype)
    expect = torch.empty(1, 33, device=DEVICE, dtype=dtype)
    _triton()["softmax_fwd"](pool[3:4], True, expect)
    with batch_invariant():
        start = dict(served_calls)
        assert torch.equal(_invariant_rows(lambda x: torch.log_softmax(x, -1), pool), expect[0])
        _invariant_rows(lambda x: torch.softmax(x, -1), pool)
        _invariant_rows(lambda x: torch.softmax(x.T, 0).T, pool)  # another dim
        mean = _invariant_rows(lambda x: x.mean(-1, keepdim=True), pool)
        torch.testing.assert_close(
            mean.double(), pool[3:4].double().mean(-1), rtol=1e-3 if dtype != torch.float32 else 1e-6, atol=1e-6
        )
        x = pool.clone().requires_grad_(True)
        torch.log_softmax(x, -1).pow(2).sum().backward()
        torch.softmax(x, -1).pow(2).sum().backward()
        for name in ("_log_softmax", "_softmax", "mean.dim", "_log_softmax_backward_data", "_softmax_backward_data"):
            assert served_calls[name] > start.get(name, 0), f"{name} was not served by rlk"


@routed
def test_ints_and_float64_fall_back_to_the_stock_kernels():
    xd = torch.randn(3, 4, dtype=torch.float64, device=DEVICE)
    xi = torch.arange(12).reshape(3, 4)  # integer matmuls: the CPU only (CUDA has no kernel)

    def calls():
        ints = (torch.mm(xi, xi.T),) if not ON_GPU else ()
        return (*ints, torch.mm(xd, xd.T), torch.softmax(xd, -1), xd.mean(-1), torch.bmm(xd[None], xd.T[None]))

    stock = calls()
    with batch_invariant():
        start = dict(served_calls)
        moded = calls()
        assert dict(served_calls) == start  # nothing was served by rlk
    for a, b in zip(stock, moded):
        assert torch.equal(a, b)


@routed
def test_embedding_backward_and_fused_rms_norm_are_routed():
    g = _gen(2)
    weight = torch.randn(10, 8, generator=g).to(DEVICE).requires_grad_(True)
    ids = torch.tensor([[1, 2, 1], [3, 1, 0]], device=DEVICE)
    x = torch.randn(5, 8, generator=g).to(DEVICE).requires_grad_(True)
    w = torch.randn(8, generator=g).to(DEVICE)
    with batch_invariant():
        start = dict(served_calls)
        F.embedding(ids, weight).pow(2).sum().backward()
        y = F.rms_norm(x, [8], w, 1e-6)
        y.sum().backward()
    expected = torch.zeros(10, 8, device=DEVICE)
    for i in ids.reshape(-1).tolist():
        expected[i] += 2 * weight.detach()[i]
    torch.testing.assert_close(weight.grad, expected)
    torch.testing.assert_close(y, F.rms_norm(x.detach(), [8], w, 1e-6), rtol=1e-5, atol=1e-6)
    assert served_calls["embedding_dense_backward"] > start.get("embedding_dense_backward", 0)
    if ON_GPU and hasattr(torch.ops.aten, "_fused_rms_norm"):  # the CPU rms_norm decomposes when grads are needed
        assert served_calls["_fused_rms_norm"] > start.get("_fused_rms_norm", 0)
        assert served_calls["_fused_rms_norm_backward"] > start.get("_fused_rms_norm_backward", 0)


# ---------------------------------------------------------------------------
# tiny transformers models with rlk.patch_model
# ---------------------------------------------------------------------------


def tiny_model(kind: str, dtype=torch.float32, device=DEVICE, hidden=64, layers=2, heads=4, kv_heads=2, vocab=128):
    transformers = _transformers()
    torch.manual_seed(0)
    common = dict(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=4096,
        attn_implementation="sdpa",
    )
    if kind == "llama":
        config = transformers.LlamaConfig(**common)
        model = transformers.LlamaForCausalLM(config)
    else:
        config = transformers.Qwen3Config(head_dim=hidden // heads, **common)
        model = transformers.Qwen3ForCausalLM(config)
    return model.to(device=device, dtype=dtype).eval()


def padded_batch(seq: torch.Tensor, others: list[torch.Tensor], side: str, pad_id: int = 5):
    """``seq`` (row 0) and ``others`` padded to one length on ``side``, with garbage ids in the pads; returns
    ``(ids, attention_mask, position_ids, slice of row 0's real tokens)``."""
    length = max(len(s) for s in [seq, *others]) + 2
    rows = [seq, *others]
    ids = torch.full((len(rows), length), pad_id, dtype=torch.long, device=seq.device)
    mask = torch.zeros(len(rows), length, dtype=torch.long, device=seq.device)
    for i, s in enumerate(rows):
        ids[i] = (torch.arange(length, device=seq.device) * 7 + i) % 100  # garbage in the pads
        part = slice(0, len(s)) if side == "right" else slice(length - len(s), length)
        ids[i, part] = s
        mask[i, part] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    real = slice(0, len(seq)) if side == "right" else slice(length - len(seq), length)
    return ids, mask, position_ids, real


def check_model_invariance(kind, dtype, device, lengths, others_lengths, **model_kw):
    from rlk.integrations.hf import patch_model, unpatch_model

    model = tiny_model(kind, dtype, device, **model_kw)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(3)
    seq = torch.randint(0, vocab, (lengths,), generator=g).to(device)
    others = [torch.randint(0, vocab, (n,), generator=g).to(device) for n in others_lengths]
    stock = model(seq[None]).logits
    assert patch_model(model) is model and patch_model(model) is model  # idempotent
    served_before = served_calls["mm"]
    with batch_invariant(), warnings.catch_warnings():
        warnings.filterwarnings("error", message="rlk")  # any fallback to stock code fails the test
        alone = model(seq[None]).logits[0]
        for side in ("right", "left"):
            ids, mask, pos, real = padded_batch(seq, others, side)
            batched = model(ids, attention_mask=mask, position_ids=pos).logits
            assert torch.equal(batched[0, real], alone), f"{kind}: logits differ alone vs {side}-padded batch"
        # gradient of the logits: a per-row loss on the real tokens; the grad rows of row 0 match
        emb = model.get_input_embeddings()
        x_alone = emb(seq[None]).detach().requires_grad_(True)
        loss_alone = model(inputs_embeds=x_alone).logits.float().log_softmax(-1)[..., 0].sum()
        loss_alone.backward()
        ids, mask, pos, real = padded_batch(seq, others, "right")
        x_batch = emb(ids).detach().requires_grad_(True)
        logp = model(inputs_embeds=x_batch, attention_mask=mask, position_ids=pos).logits.float().log_softmax(-1)
        (logp[..., 0] * mask).sum().backward()
        assert torch.equal(x_batch.grad[0, real], x_alone.grad[0]), f"{kind}: input gradient rows differ"
    assert served_calls["mm"] > served_before, "the matmuls did not run on rlk"
    unpatch_model(model)
    assert not hasattr(model, "_rlk_patch")
    assert torch.equal(model(seq[None]).logits, stock), "unpatch_model did not restore the stock model"
    return model


@routed
@pytest.mark.parametrize("kind", ["llama", pytest.param("qwen3", marks=pytest.mark.slow)])
def test_tiny_model_logits_and_gradients_are_batch_invariant(kind):
    check_model_invariance(kind, torch.float32, DEVICE, 9, [13, 6])


def test_patch_model_without_transformers_models_is_harmless():
    """patch_model on a plain module: no RMSNorm found, nothing to switch; unpatch restores nothing."""
    _transformers()
    from rlk.integrations.hf import patch_model, unpatch_model

    class Norm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(4))
            self.variance_epsilon = 1e-6

        def forward(self, x):
            return x * 2

    net = torch.nn.Sequential(Norm(), torch.nn.Linear(4, 4))
    patch_model(net)
    assert "forward" in net[0].__dict__
    unpatch_model(net)
    assert "forward" not in net[0].__dict__ and not hasattr(net, "_rlk_patch")
    x = torch.randn(2, 4)
    assert torch.equal(net[0](x), x * 2)


@routed
def test_the_varlen_layout_is_computed_once_per_forward(monkeypatch):
    """Every layer gets the same padding mask: its varlen layout (host synchronizations) is computed once per
    forward, and again for a new mask."""
    import rlk.integrations.hf.patch as hf

    _transformers()
    calls = []
    real = hf._varlen_index
    monkeypatch.setattr(hf, "_varlen_index", lambda *args: (calls.append(1), real(*args))[1])
    model = hf.patch_model(tiny_model("llama", layers=3))
    g = torch.Generator().manual_seed(8)
    seq, other = torch.randint(0, 128, (7,), generator=g), torch.randint(0, 128, (4,), generator=g)
    with batch_invariant():
        for side in ("right", "left"):
            ids, mask, pos, _ = padded_batch(seq.to(DEVICE), [other.to(DEVICE)], side)
            model(ids, attention_mask=mask, position_ids=pos)
    hf.unpatch_model(model)
    assert len(calls) == 2  # one per forward (3 layers each)


@routed
@pytest.mark.parametrize("kind", ["llama", "qwen3"])
def test_patched_decode_and_chunked_prefill_see_the_padding(kind):
    """A left-padded batch through the KV cache (a prefill chunk, then a decode step: fewer queries than keys)
    gives the padded row bitwise the logits of its sequence run alone. The patched attention must receive the
    padding mask: transformers builds it only for attention names registered with a mask function, and
    without one the pad keys were attended (logits off by up to ~2 in this test)."""
    from transformers import DynamicCache

    from rlk.integrations.hf import patch_model, unpatch_model

    model = tiny_model(kind, torch.float32, DEVICE)
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(5)
    long, short = (torch.randint(0, vocab, (n,), generator=g).to(DEVICE) for n in (7, 3))
    nxt = torch.randint(0, vocab, (2, 1), generator=g).to(DEVICE)
    pad = long.numel() - short.numel()
    ids = torch.stack([long, torch.cat([torch.zeros(pad, dtype=long.dtype, device=DEVICE), short])])
    mask = torch.tensor([[1] * 7, [0] * pad + [1] * 3], device=DEVICE)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    patch_model(model)
    try:
        with batch_invariant(), torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("error", message="rlk")
            cache = DynamicCache()
            model(
                ids[:, :4], attention_mask=mask[:, :4], position_ids=pos[:, :4], past_key_values=cache, use_cache=True
            )  # prefill chunk 1: row 1 is all padding here
            chunk = model(
                ids[:, 4:], attention_mask=mask, position_ids=pos[:, 4:], past_key_values=cache, use_cache=True
            )  # chunk 2: 3 queries against 7 keys
            step_mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype, device=DEVICE)], 1)
            step = model(
                nxt, attention_mask=step_mask, position_ids=pos[:, -1:] + 1, past_key_values=cache, use_cache=True
            )
            alone_cache = DynamicCache()
            alone = model(short[None], past_key_values=alone_cache, use_cache=True)
            alone_step = model(
                nxt[1:], position_ids=torch.tensor([[3]], device=DEVICE), past_key_values=alone_cache, use_cache=True
            )
        assert torch.equal(chunk.logits[1], alone.logits[0]), f"{kind}: prefill chunk differs from the sequence alone"
        assert torch.equal(step.logits[1, -1], alone_step.logits[0, -1]), f"{kind}: decode step sees the padding"
    finally:
        unpatch_model(model)


def test_one_run_offsets_cut_each_row_around_its_run():
    """Row ``b`` of a mask with one run per row becomes three sequences: the pads before the run, the run, the pads
    after it (empty ones where there are none); a mask with holes is told apart."""
    import rlk.integrations.hf.patch as hf

    mask = torch.tensor([[0, 0, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0], [0, 1, 1, 0]], dtype=torch.bool)
    expected = [0, 2, 4, 4, 4, 6, 8, 8, 12, 12, 16, 16, 16, 17, 19, 20]
    assert hf._one_run_offsets(mask).tolist() == expected
    assert hf._one_run_offsets(mask).dtype == torch.int32
    assert hf._one_run_per_row(mask)
    assert not hf._one_run_per_row(torch.tensor([[1, 0, 1, 1]], dtype=torch.bool))
    assert not hf._one_run_per_row(torch.tensor([[0, 1, 0, 1]], dtype=torch.bool))


@routed
@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("seq_q", [9, 3, 1], ids=["prefill", "chunk", "decode"])
def test_padded_attention_in_place_is_the_packed_attention_bitwise(side, seq_q, monkeypatch):
    """A padding mask with one run per row runs in place (no host synchronization): bitwise the output of dropping
    the pads and packing the valid tokens (a mask with holes), zeros at the pad rows."""
    import types

    import rlk.integrations.hf.patch as hf

    g = torch.Generator().manual_seed(3)
    batch, heads, kv_heads, seq_k, dim = 4, 4, 2, 9, 16
    q = torch.randn(batch, heads, seq_q, dim, generator=g).to(DEVICE)
    k = torch.randn(batch, kv_heads, seq_k, dim, generator=g).to(DEVICE)
    v = torch.randn(batch, kv_heads, seq_k, dim, generator=g).to(DEVICE)
    lengths = torch.tensor([9, 4, 1, 0])
    cols = torch.arange(seq_k)[None, :]
    mask = (cols >= seq_k - lengths[:, None]) if side == "left" else (cols < lengths[:, None])
    mask = mask.to(DEVICE).long()
    module = types.SimpleNamespace(is_causal=True, training=False)
    hf._last_layout.clear()
    layout = hf._varlen_index(mask, None, None, batch, seq_q, seq_k, q.device)
    assert layout[0].dtype == torch.bool and layout[1] is None and layout[2].shape == (3 * batch + 1,)
    out, _ = hf.rlk_attention_forward(module, q, k, v, mask)
    monkeypatch.setattr(hf, "_one_run_per_row", lambda m: False)  # the packing path
    hf._last_layout.clear()
    assert hf._varlen_index(mask, None, None, batch, seq_q, seq_k, q.device)[0].dtype != torch.bool
    packed, _ = hf.rlk_attention_forward(module, q, k, v, mask)
    hf._last_layout.clear()
    assert out.shape == (batch, seq_q, heads, dim)
    assert torch.equal(out, packed)
    pads = mask[:, -seq_q:] == 0
    assert pads.any() and not (~pads).all()
    assert torch.equal(out[pads], torch.zeros_like(out[pads]))
    assert out[~pads].abs().sum() > 0


def _static_cache_decodes(model, record_cache_calls: bool = True):
    """Logits of a left-padded prefill + one decode step of the patched tiny model: ``DynamicCache``,
    ``StaticCache`` with the ``[B, past + S]`` mask, and ``StaticCache`` with a mask over all 16 slots (0 where not
    written yet; what a captured decode step feeds), with and without ``cache_position`` passed (a raised
    ValueError stands for the logits where rlk refuses). ``record_cache_calls=False``: patched without the
    attention modules' pre-hooks (the negative control)."""
    from transformers import DynamicCache, StaticCache

    from rlk.integrations.hf import patch_model, unpatch_model

    g = torch.Generator().manual_seed(6)
    ids = torch.randint(0, model.config.vocab_size, (2, 6), generator=g).to(DEVICE)
    nxt = torch.randint(0, model.config.vocab_size, (2, 1), generator=g).to(DEVICE)
    mask = torch.tensor([[1] * 6, [0, 0, 0, 1, 1, 1]], device=DEVICE)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    step_mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype, device=DEVICE)], 1)
    logits = {}
    hooks = []
    patch_model(model)
    if not record_cache_calls:
        hooks, model._rlk_patch["hooks"] = model._rlk_patch["hooks"], []
        for hook in hooks:
            hook.remove()
    try:
        with batch_invariant(), torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("error", message="rlk")
            for name in ("dynamic", "static"):
                cache = DynamicCache() if name == "dynamic" else StaticCache(config=model.config, max_cache_len=16)
                prefill = model(ids, attention_mask=mask, position_ids=pos, past_key_values=cache, use_cache=True)
                step = model(
                    nxt, attention_mask=step_mask, position_ids=pos[:, -1:] + 1, past_key_values=cache, use_cache=True
                )
                logits[name] = (prefill.logits, step.logits)
            for name, passed in (("static, all slots", True), ("static, all slots, no cache_position", False)):
                cache = StaticCache(config=model.config, max_cache_len=16)
                slots = F.pad(mask, (0, 10))
                where = {"cache_position": torch.arange(6, device=DEVICE)} if passed else {}
                try:
                    prefill = model(
                        ids, attention_mask=slots, position_ids=pos, past_key_values=cache, use_cache=True, **where
                    )
                    slots[:, 6] = 1
                    where = {"cache_position": torch.tensor([6], device=DEVICE)} if passed else {}
                    step = model(
                        nxt,
                        attention_mask=slots,
                        position_ids=pos[:, -1:] + 1,
                        past_key_values=cache,
                        use_cache=True,
                        **where,
                    )
                    logits[name] = (prefill.logits, step.logits)
                except ValueError as error:
                    logits[name] = error
    finally:
        unpatch_model(model)
    assert not any(hasattr(m, "_rlk_cache_call") for m in model.modules())
    return logits


def _cache_position_reaches_attention() -> bool:
    """transformers >= 5 forwards a ``cache_position`` passed to the model to the attention function (and
    computes none itself); 4.x computes one and keeps it in the attention module."""
    import transformers

    return int(transformers.__version__.split(".")[0]) >= 5


@routed
def test_patched_static_cache_decode_is_the_dynamic_cache_decode_bitwise():
    """A ``StaticCache`` (keys of ``max_cache_len`` against the ``[B, past + S]`` mask; its unwritten slots are
    padding) gives the left-padded prefill and decode step bitwise the logits of a ``DynamicCache``; so does a mask
    over all the slots with ``cache_position``. Without it: transformers 4.x's own ``cache_position`` (recorded
    by the attention modules' pre-hooks) serves; transformers 5 raises a ValueError naming ``cache_position``."""
    model = tiny_model("qwen3", torch.float32, DEVICE)
    logits = _static_cache_decodes(model)
    names = ["static", "static, all slots"]
    if _cache_position_reaches_attention():
        error = logits["static, all slots, no cache_position"]
        assert isinstance(error, ValueError) and "cache_position" in str(error), error
    else:
        names.append("static, all slots, no cache_position")
    for name in names:
        assert torch.equal(logits[name][0], logits["dynamic"][0]), name
        assert torch.equal(logits[name][1], logits["dynamic"][1]), name


@routed
def test_patched_static_cache_without_padding_masks_the_unwritten_slots():
    """An all-ones ``[B, past + S]`` mask with a ``StaticCache``: rlk's mask builder keeps it (transformers 4.x's
    flash-attention builder dropped it, and the queries then saw the zero keys of the unwritten slots)."""
    from transformers import DynamicCache, StaticCache

    from rlk.integrations.hf import patch_model, unpatch_model
    from rlk.integrations.hf.patch import padding_mask

    model = tiny_model("qwen3", torch.float32, DEVICE)
    g = torch.Generator().manual_seed(7)
    ids = torch.randint(0, model.config.vocab_size, (2, 5), generator=g).to(DEVICE)
    nxt = torch.randint(0, model.config.vocab_size, (2, 1), generator=g).to(DEVICE)
    mask = torch.ones((2, 5), dtype=torch.int64, device=DEVICE)
    logits = {}
    patch_model(model)
    try:
        with batch_invariant(), torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("error", message="rlk")
            for name in ("dynamic", "static"):
                cache = DynamicCache() if name == "dynamic" else StaticCache(config=model.config, max_cache_len=12)
                model(ids, attention_mask=mask, past_key_values=cache, use_cache=True)
                step = model(nxt, attention_mask=F.pad(mask, (0, 1), value=1), past_key_values=cache, use_cache=True)
                logits[name] = step.logits
                alive = weakref.ref(cache)
                del cache, step  # (the output holds the cache too) the attention modules' hooks keep no record of it
                assert alive() is None and not any("_rlk_cache_call" in m.__dict__ for m in model.modules())
    finally:
        unpatch_model(model)
    assert torch.equal(logits["static"], logits["dynamic"])
    full = torch.ones((2, 6), dtype=torch.bool)
    assert padding_mask(kv_length=6, attention_mask=full) is None  # no padding, as wide as the keys: packed rows
    assert torch.equal(padding_mask(kv_length=12, attention_mask=full), full)  # narrower than the keys: kept
    padded = full.clone()
    padded[0, -1] = False
    assert torch.equal(padding_mask(kv_length=4, attention_mask=padded), padded[:, -4:])  # the last columns


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_captured_static_cache_decode_is_the_eager_decode_gpu(dtype):
    """A decode step captured in a CUDA graph (``StaticCache``, fixed buffers, a mask over all the slots and
    ``cache_position``; rlk's value checks off) replays bitwise the logits of the eager ``DynamicCache`` decode, step
    after step, and its capture synchronizes nowhere (a synchronization in a capture raises)."""
    from transformers import DynamicCache, StaticCache

    from rlk.core import checks
    from rlk.integrations.hf import compat, patch_model, unpatch_model

    model = tiny_model("qwen3", dtype, DEVICE, hidden=128, layers=2, heads=4, kv_heads=2, vocab=512)
    keyword = compat.cache_keyword(model)
    g = torch.Generator().manual_seed(8)
    batch, prompt, steps = 4, 9, 4
    lengths = [9, 3, 6, 1]
    mask = torch.zeros((batch, prompt), dtype=torch.int64)
    for i, n in enumerate(lengths):
        mask[i, prompt - n :] = 1
    mask = mask.to(DEVICE)
    ids = torch.randint(0, 512, (batch, prompt), generator=g).to(DEVICE) * mask
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    tokens = torch.randint(0, 512, (steps, batch, 1), generator=g).to(DEVICE)
    patch_model(model)
    try:
        with batch_invariant(), torch.no_grad(), warnings.catch_warnings():
            warnings.filterwarnings("error", message="rlk")
            cache = DynamicCache()
            model(ids, attention_mask=mask, position_ids=pos, use_cache=True, **{keyword: cache})
            eager = []
            for k in range(steps):
                step_mask = torch.cat([mask, mask.new_ones((batch, k + 1))], 1)
                out = model(
                    tokens[k],
                    attention_mask=step_mask,
                    position_ids=pos[:, -1:] + 1 + k,
                    use_cache=True,
                    logits_to_keep=1,
                    **{keyword: cache},
                )
                eager.append(out.logits)

            static = StaticCache(config=model.config, max_cache_len=prompt + steps)
            slots = F.pad(mask, (0, steps))
            step_ids, step_pos = tokens[0].clone(), pos[:, -1:] + 1
            slot = torch.tensor([prompt], device=DEVICE)

            def prefill():
                static.reset()
                slots[:, prompt:] = 0
                model(
                    ids,
                    attention_mask=slots,
                    position_ids=pos,
                    use_cache=True,
                    cache_position=torch.arange(prompt, device=DEVICE),
                    **{keyword: static},
                )

            def step():
                return model(
                    step_ids,
                    attention_mask=slots,
                    position_ids=step_pos,
                    use_cache=True,
                    logits_to_keep=1,
                    cache_position=slot,
                    **{keyword: static},
                ).logits

            def set_inputs(k):
                step_ids.copy_(tokens[k])
                step_pos.copy_(pos[:, -1:] + 1 + k)
                slot.fill_(prompt + k)
                slots[:, prompt + k] = 1

            prefill()
            set_inputs(0)
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side), checks.trusted_values():
                step()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph), checks.trusted_values():
                captured = step()
            prefill()
            replayed = []
            for k in range(steps):
                set_inputs(k)
                graph.replay()
                replayed.append(captured.clone())
    finally:
        unpatch_model(model)
    for k in range(steps):
        assert torch.equal(replayed[k], eager[k]), f"step {k}"
    assert not torch.equal(replayed[0], replayed[1])


@routed
def test_static_cache_slots_without_the_pre_hooks_are_misread():
    """Negative control of the pre-hooks: without them, transformers 4.x's ``cache_position`` never reaches the
    attention, a mask over all the slots is read as right padding and the decode step's logits are wrong (not
    refused: the cache is unknown too); transformers 5 refuses the mask, hooks or not, when nothing is passed.
    One layer: the first misread attention already changes the logits (the hooked 2-layer run is the test above)."""
    model = tiny_model("qwen3", torch.float32, DEVICE, layers=1)
    logits = _static_cache_decodes(model, record_cache_calls=False)
    unhooked = logits["static, all slots, no cache_position"]
    if _cache_position_reaches_attention():
        assert torch.equal(logits["static, all slots"][1], logits["dynamic"][1])
        assert not isinstance(unhooked, ValueError)  # the cache is not known either: nothing to refuse on
        assert not torch.equal(unhooked[1], logits["dynamic"][1])
    else:
        assert not isinstance(unhooked, ValueError)
        assert not torch.equal(unhooked[1], logits["dynamic"][1])
        assert not torch.equal(logits["static, all slots"][1], logits["dynamic"][1])


# ---------------------------------------------------------------------------
# the fallback: no batch-invariant kernel for the dtype or device runs the stock model
# ---------------------------------------------------------------------------


def _no_invariant_backend(dtype):
    """fp64 and bf16: no batch-invariant kernel on the CPU, with the interpreter or without. fp32: none without
    ``TRITON_INTERPRET=1``; under it, the reference backend pinned (as ``RLK_BACKEND=reference``) has none either."""
    from rlk.integrations.batch_invariant import _invariant_backend

    if dtype == torch.float32 and _invariant_backend("attention", torch.device("cpu"), dtype) is not None:
        return dispatch.use_backend("reference")
    return contextlib.nullcontext()


def _left_padded(vocab: int):
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(0, vocab, (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :3] = 0
    return ids, mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_patched_model_without_invariant_kernels_is_the_stock_model(dtype, monkeypatch):
    """Where no batch-invariant kernel serves the dtype / device, the patched model warns and runs the stock code:
    its logits are bitwise those of an unpatched copy, for a left-padded batch (the attention used to receive rlk's
    2-D padding mask in SDPA: a shape error), a packed row without a mask and a cached prefill chunk + decode step."""
    import copy

    from transformers import DynamicCache

    import rlk.integrations.hf.patch as hf

    model = tiny_model("qwen3", dtype, torch.device("cpu"), layers=1, vocab=64)
    stock = copy.deepcopy(model)
    ids, mask = _left_padded(64)
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 0, 1]])
    monkeypatch.setattr(hf, "_warned", set())
    hf.patch_model(model)
    with _no_invariant_backend(dtype), torch.no_grad():
        with pytest.warns(RuntimeWarning, match="running the stock transformers code"):
            out = model(ids, attention_mask=mask).logits
        assert torch.equal(out, stock(ids, attention_mask=mask).logits)
        kw = dict(position_ids=packed, use_cache=False)
        assert torch.equal(model(ids, **kw).logits, stock(ids, **kw).logits)
        caches = DynamicCache(), DynamicCache()
        for cut in (slice(0, 4), slice(4, 7)):
            kw = dict(attention_mask=mask[:, : cut.stop], use_cache=True)
            chunk, stock_chunk = (m(ids[:, cut], past_key_values=c, **kw) for m, c in zip((model, stock), caches))
            assert torch.equal(chunk.logits, stock_chunk.logits)
        step_mask = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], 1)
        kw = dict(attention_mask=step_mask, use_cache=True)
        step, stock_step = (m(ids[:, :1], past_key_values=c, **kw) for m, c in zip((model, stock), caches))
        assert torch.equal(step.logits, stock_step.logits)


def test_patch_model_leaves_a_shared_config_alone():
    """patch_model switches the attention on its own copy of the config: a second model built from the same config
    object keeps the stock attention and its outputs, and unpatch_model switches the copy back."""
    transformers = _transformers()
    from rlk.integrations.hf import patch_model, unpatch_model

    config = transformers.Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        vocab_size=64,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    torch.manual_seed(0)
    other = transformers.Qwen3ForCausalLM(config).eval()
    ids, mask = _left_padded(64)
    with torch.no_grad():
        before = other(ids, attention_mask=mask).logits
    patch_model(model)
    assert config._attn_implementation == "sdpa" and other.config is config
    assert model.config is not config and model.config._attn_implementation == "rlk"
    assert all(m.config is model.config for m in model.modules() if "config" in m.__dict__)
    with torch.no_grad():
        assert torch.equal(other(ids, attention_mask=mask).logits, before)
    unpatch_model(model)
    assert model.config._attn_implementation == "sdpa" and config._attn_implementation == "sdpa"


def test_a_fallback_decided_per_call_gets_the_stock_sdpa_mask(monkeypatch):
    """A case rlk's kernels do not cover, seen only by the attention call (here dropout in training), runs transformers'
    SDPA on the mask transformers' own SDPA builder makes: _stock_mask builds it from rlk's padding mask bitwise
    equal to the stock builder's (padded, packed, a cached chunk, a decode step; None where the stock one is None)."""
    from transformers import DynamicCache
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    import rlk.integrations.hf.patch as hf

    model = tiny_model("qwen3", torch.float32, torch.device("cpu"), layers=1, vocab=64)
    stock_masks = []
    stock_builder = ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]
    monkeypatch.setitem(
        ALL_MASK_ATTENTION_FUNCTIONS._global_mapping,
        "sdpa",
        lambda **kw: (stock_masks.append(stock_builder(**kw)), stock_masks[-1])[1],
    )
    ids, mask = _left_padded(64)
    packed = torch.tensor([[0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 0, 1]])
    ones = torch.ones_like(mask)
    cases = []  # (2-D mask the "rlk" builder gets, position ids, Sq, Sk, cached), one per stock forward
    with torch.no_grad():
        for padding in (mask, ones):
            model(ids, attention_mask=padding)
            cases.append((padding, None, 7, 7, True))
            cache = DynamicCache()
            for cut in (slice(0, 4), slice(4, 7)):
                model(ids[:, cut], attention_mask=padding[:, : cut.stop], past_key_values=cache, use_cache=True)
                cases.append((padding[:, : cut.stop], None, cut.stop - cut.start, cut.stop, True))
            step = torch.cat([padding, torch.ones(2, 1, dtype=mask.dtype)], 1)
            model(ids[:, :1], attention_mask=step, past_key_values=cache, use_cache=True)
            cases.append((step, None, 1, 8, True))
        model(ids, position_ids=packed, use_cache=False)
        cases.append((None, packed, 7, 7, False))
    assert len(stock_masks) == len(cases)
    for (padding, pos, seq_q, seq_k, cached), stock in zip(cases, stock_masks):
        rlk_mask = None if padding is None else hf.padding_mask(kv_length=seq_k, attention_mask=padding.bool())
        ours = hf._stock_mask(rlk_mask, None, pos, 2, seq_q, seq_k, causal=True, cached=cached, device=ids.device)
        assert (ours is None) == (stock is None) and (ours is None or torch.equal(ours, stock)), (seq_q, seq_k)
    # the attention call itself: dropout in training falls back to SDPA on the stock mask, not on rlk's 2-D one
    attention = model.model.layers[0].self_attn.train()
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, heads, 7, 16, generator=g) for heads in (4, 2, 2))
    monkeypatch.setattr(hf, "_warned", set())
    torch.manual_seed(3)
    with pytest.warns(RuntimeWarning, match="attention dropout"):
        out, _ = hf.rlk_attention_forward(
            attention, q, k, v, hf.padding_mask(kv_length=7, attention_mask=mask), dropout=0.5
        )
    torch.manual_seed(3)
    expected, _ = sdpa_attention_forward(attention, q, k, v, stock_masks[0], dropout=0.5)
    assert torch.equal(out, expected)
