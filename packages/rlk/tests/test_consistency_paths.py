"""rlk.app.consistency.harness and rlk.app.consistency.paths: the two execution paths and the ground truth.

With rlk's chain on, the rollout path (left-padded batched prefill, chunked or not, then KV-cache decode with a
shrinking batch) and the training path (packed varlen rows in micro-batches) give bitwise-identical log-probs
for every response token, and the training log-probs and per-sequence input-embedding gradients do not depend on
the micro-batch split (``torch.equal``, never ``allclose``). With the chain off both paths agree with the fp64
reference within fp32 rounding (they compute the right thing). On the CPU the chain runs the Triton interpreter
(``triton_interpreter``: deselected unless ``TRITON_INTERPRET=1``, fp32 tiny models); the same tests run on a
GPU, plus a negative control on the 8B-shaped model in bf16.
"""

from __future__ import annotations

import os
import warnings

import pytest
import torch

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
ON_GPU = DEVICE.type == "cuda"
# rlk's chain needs the triton backend: on the CPU only under the interpreter.
routed = pytest.mark.triton_interpreter if not ON_GPU else pytest.mark.gpu


def _transformers():
    if os.environ.get("RLK_REQUIRE_TRANSFORMERS") == "1":
        import transformers

        return transformers
    return pytest.importorskip("transformers")


@pytest.fixture(autouse=True)
def _need_transformers():
    _transformers()
    yield
    from rlk.integrations.batch_invariant import disable_batch_invariant, is_batch_invariant_enabled

    disable_batch_invariant()
    assert not is_batch_invariant_enabled()


_MODELS: dict[tuple[str, int | None], object] = {}


def _model(name: str, layers: int | None = None):
    """One fp32 tiny model per name (and layer count: None, the model's 2) for the whole module (the paths never
    change the weights)."""
    from rlk.app.consistency import harness

    if (name, layers) not in _MODELS:
        _MODELS[name, layers] = harness.build_model(name, dtype=torch.float32, device=DEVICE, seed=0, num_layers=layers)
    return _MODELS[name, layers]


def _prompts(model, n: int = 3, seed: int = 0):
    from rlk.app.consistency import harness

    return harness.make_prompts(n, vocab_size=model.config.vocab_size, seed=seed, min_len=3, max_len=9)


def _assert_lists_equal(a, b, what):
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        assert x.shape == y.shape, f"{what}: sequence {i} shapes {tuple(x.shape)} vs {tuple(y.shape)}"
        assert torch.equal(x, y), f"{what}: sequence {i} differs, max |delta| {(x - y).abs().max().item():.3e}"


# ---------------------------------------------------------------------------
# harness
# ---------------------------------------------------------------------------


def test_build_model_is_seeded_and_standard():
    from rlk.app.consistency import harness

    transformers = _transformers()
    a = harness.build_model("tiny", dtype=torch.float32, device="cpu", seed=1)
    b = harness.build_model("tiny", dtype=torch.float32, device="cpu", seed=1)
    c = harness.build_model("tiny", dtype=torch.float32, device="cpu", seed=2)
    llama = harness.build_model("tiny-llama", dtype=torch.float32, device="cpu", num_layers=1)
    assert isinstance(a, transformers.Qwen3ForCausalLM) and isinstance(llama, transformers.LlamaForCausalLM)
    assert not a.training and a.config._attn_implementation == "sdpa" and llama.config.num_hidden_layers == 1
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])
    assert set(harness.MODELS) == {"tiny", "tiny-llama", "qwen3-8b-shape", "llama3-8b-shape"}


def test_build_model_loads_a_local_checkpoint(tmp_path):
    """``--model PATH``: a checkpoint directory (save_pretrained) loads with the same weights, eval, sdpa."""
    from rlk.app.consistency import harness

    _transformers()
    saved = harness.build_model("tiny-llama", dtype=torch.float32, device="cpu", seed=3)
    saved.save_pretrained(tmp_path)
    loaded = harness.build_model(str(tmp_path), dtype=torch.float32, device="cpu")
    assert type(loaded) is type(saved) and not loaded.training and loaded.config._attn_implementation == "sdpa"
    a, b = saved.state_dict(), loaded.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_make_prompts_is_fixed_and_mixed():
    from rlk.app.consistency import harness

    p = harness.make_prompts(16, vocab_size=50, seed=3, min_len=2, max_len=20)
    assert p == harness.make_prompts(16, vocab_size=50, seed=3, min_len=2, max_len=20)
    assert p != harness.make_prompts(16, vocab_size=50, seed=4, min_len=2, max_len=20)
    assert all(2 <= len(x) <= 20 and all(0 <= t < 50 for t in x) for x in p)
    assert len({len(x) for x in p}) > 3


def test_bad_inputs_raise_clear_errors():
    from rlk.app.consistency import harness, paths

    with pytest.raises(ValueError, match="unknown model 'nope'"):
        harness.build_model("nope", dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="at least one prompt"):
        harness.make_prompts(0, vocab_size=10)
    model = _model("tiny")
    prompts = _prompts(model)
    with pytest.raises(ValueError, match="non-empty list"):
        paths.rollout(model, [], max_new_tokens=2)
    with pytest.raises(ValueError, match=r"prompts\[1\] is empty"):
        paths.rollout(model, [[1, 2], []], max_new_tokens=2)
    with pytest.raises(ValueError, match="not an int id"):
        paths.rollout(model, [[1, 10**6]], max_new_tokens=2)
    with pytest.raises(ValueError, match="max_new_tokens"):
        paths.rollout(model, prompts, max_new_tokens=0)
    with pytest.raises(ValueError, match="prefill_chunk"):
        paths.rollout(model, prompts, max_new_tokens=2, prefill_chunk=0)
    responses = [[1], [2], [3]]
    with pytest.raises(ValueError, match="non-empty list"):
        paths.training_logprobs(model, [], [], micro_batches=[[0]])
    for bad in ([[0, 1]], [[0, 1], [1, 2]], [[0, 1, 2, 3]], [[0], [], [1, 2]], []):
        with pytest.raises(ValueError, match="partition|empty"):
            paths.training_logprobs(model, prompts, responses, micro_batches=bad)
    with pytest.raises(ValueError, match="one response per prompt"):
        paths.training_logprobs(model, prompts, responses[:2], micro_batches=[[0, 1, 2]])


# ---------------------------------------------------------------------------
# observers: slots of every forward
# ---------------------------------------------------------------------------


def _record_forwards(model):
    """A pre-hook recording each forward's input shape, 2-D mask and position ids, and an on_forward recorder."""
    inputs, slots = [], []

    def hook(module, args, kwargs):
        x = kwargs.get("input_ids")
        if x is None:
            x = kwargs["inputs_embeds"][..., 0]
        inputs.append((tuple(x.shape), kwargs.get("attention_mask"), kwargs.get("position_ids")))

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    return handle, inputs, slots


def _check_slots(inputs, slots, lengths_fed):
    """Every forward's slots match its input shape, mark exactly the non-pad inputs, carry their position ids;
    over all forwards each (sequence, position) fed to the model appears exactly once."""
    assert len(inputs) == len(slots) > 0
    seen = []
    for (shape, mask, pos), s in zip(inputs, slots):
        assert s.dtype == torch.int64 and tuple(s.shape) == (*shape, 2)
        valid = s[..., 0] >= 0
        assert torch.equal(valid, s[..., 1] >= 0)
        if mask is not None:
            assert torch.equal(valid, mask[:, -shape[1] :].bool())
        else:
            assert bool(valid.all())
        assert torch.equal(s[..., 1][valid], pos.expand(shape)[valid])
        seen += [tuple(x) for x in s[valid].tolist()]
    expected = [(i, p) for i, n in enumerate(lengths_fed) for p in range(n)]
    assert sorted(seen) == expected


@pytest.mark.parametrize("chunk", [None, 4])
def test_rollout_slots_shrinking_batch_and_budgets(chunk):
    from rlk.app.consistency import paths

    model = _model("tiny")
    prompts = _prompts(model, n=4)
    handle, inputs, slots = _record_forwards(model)
    try:
        r = paths.rollout(model, prompts, max_new_tokens=5, prefill_chunk=chunk, seed=1, on_forward=slots.append)
    finally:
        handle.remove()
    budgets = paths._response_lengths(4, 5, 1)
    assert [len(x) for x in r.responses] == budgets and len(set(budgets)) > 1
    assert all(
        lp.dtype == torch.float32 and lp.shape == (len(x),) and bool((lp <= 0).all())
        for lp, x in zip(r.logprobs, r.responses)
    )
    # the last response token is sampled, never fed
    _check_slots(inputs, slots, [len(p) + len(x) - 1 for p, x in zip(prompts, r.responses)])
    width = max(len(p) for p in prompts)
    n_prefill = 1 if chunk is None else -(-width // chunk)
    batch_sizes = [shape[0] for shape, _, _ in inputs[n_prefill:]]
    assert batch_sizes == sorted(batch_sizes, reverse=True) and batch_sizes[-1] < 4  # the batch shrinks
    # same seed: same samples; EOS ends a sequence (kept in the response)
    again = paths.rollout(model, prompts, max_new_tokens=5, prefill_chunk=chunk, seed=1)
    assert again.responses == r.responses
    eos = r.responses[0][0]
    stopped = paths.rollout(model, prompts, max_new_tokens=5, prefill_chunk=chunk, seed=1, eos_token_id=eos)
    assert stopped.responses[0] == [eos]


# ---------------------------------------------------------------------------
# sampling: rlk.sample with per-sequence seeds, steps = token index in the response
# ---------------------------------------------------------------------------


def test_sequence_seeds_are_distinct_int64_per_index():
    from rlk.app.consistency import paths

    s = paths.sequence_seeds(7, 1000)
    assert s.dtype == torch.int64 and s.shape == (1000,) and len(set(s.tolist())) == 1000
    assert torch.equal(s, paths.sequence_seeds(7, 1000)) and torch.equal(paths.sequence_seeds(7, 3), s[:3])
    assert not set(paths.sequence_seeds(8, 1000).tolist()) & set(s.tolist())
    assert bool((s < 0).any()) and bool((s > 0).any())  # all 64 bits used
    # the documented formula: the first SplitMix64 output of state 0 is 0xE220A8397B1DCDAF
    assert paths.sequence_seeds(0, 1).tolist() == [0xE220A8397B1DCDAF - 2**64]
    assert torch.equal(paths.sequence_seeds(-1, 4), paths.sequence_seeds(2**64 - 1, 4))  # seed mod 2**64
    with pytest.raises(TypeError, match="seed must be an int"):
        paths.sequence_seeds(1.5, 2)


def test_rollout_samples_with_rlk_sample_per_sequence_seed_and_step():
    """Each token is ``rlk.sample(logits, sequence_seeds(seed, n)[i], step = its index in the response)``: checked
    token by token on the rollout's own logits (recorded by a forward hook), through the shrinking batch."""
    import rlk
    from rlk.app.consistency import paths

    model = _model("tiny")
    prompts = _prompts(model, n=3)
    rows_logits = []
    handle = model.register_forward_hook(lambda module, args, out: rows_logits.append(out.logits[:, -1].clone()))
    try:
        with paths.chain(model, False):
            r = paths.rollout(model, prompts, max_new_tokens=5, seed=4)
    finally:
        handle.remove()
    assert len({len(x) for x in r.responses}) > 1  # the batch shrinks
    seeds = paths.sequence_seeds(4, 3).to(DEVICE)
    active = [0, 1, 2]
    for t, logits in enumerate(rows_logits[: max(len(x) for x in r.responses)]):
        assert logits.shape[0] == len(active)
        tokens, _ = rlk.sample(logits, seeds[active], torch.full((len(active),), t, dtype=torch.int64, device=DEVICE))
        assert tokens.tolist() == [r.responses[i][t] for i in active]
        active = [i for i in active if len(r.responses[i]) > t + 1]


def test_identical_prompts_get_different_samples():
    """The seeds differ between sequences: identical prompts (identical logits) sample different responses at
    temperature 1 on the random model (seeds fixed: deterministic)."""
    from rlk.app.consistency import paths

    model = _model("tiny")
    prompt = _prompts(model, n=1)[0]
    with paths.chain(model, False):
        r = paths.rollout(model, [prompt] * 4, max_new_tokens=6, seed=0)
    assert len({tuple(x) for x in r.responses}) == 4
    assert len({x[0] for x in r.responses}) > 1  # already the first tokens (same logits row) differ
    again = paths.rollout(model, [prompt] * 4, max_new_tokens=6, seed=1)
    assert again.responses != r.responses


@routed
def test_rollout_response_does_not_depend_on_the_batch():
    """With rlk's chain on (batch-invariant logits), a sequence's sampled response and log-probs are the same
    rolled out alone or with other sequences, whichever they are (its seed depends on its index, its step on its
    own token count, not on the shrinking batch). One layer: the sampling seeds and steps are the point; the
    2-layer chain (every layer's cache and layout) is test_chain_on_rollout_equals_training_bitwise's."""
    from rlk.app.consistency import paths

    model = _model("tiny", layers=1)
    p = _prompts(model, n=6, seed=5)
    m, seed = 6, 3
    assert paths._response_lengths(1, m, seed)[0] == paths._response_lengths(3, m, seed)[0]
    with paths.chain(model, True), warnings.catch_warnings():
        warnings.filterwarnings("error", message="rlk")
        alone = paths.rollout(model, p[:1], max_new_tokens=m, seed=seed)
        batch = paths.rollout(model, p[:3], max_new_tokens=m, seed=seed)
        other = paths.rollout(model, [p[0], p[3], p[4]], max_new_tokens=m, seed=seed)
        other1 = paths.rollout(model, [p[5], p[1], p[2]], max_new_tokens=m, seed=seed)
    assert len({len(x) for x in batch.responses}) > 1  # the batch shrank
    assert alone.responses[0] == batch.responses[0] == other.responses[0]
    assert other1.responses[1:] == batch.responses[1:]
    assert torch.equal(alone.logprobs[0], batch.logprobs[0]) and torch.equal(other.logprobs[0], batch.logprobs[0])
    assert all(torch.equal(x, y) for x, y in zip(other1.logprobs[1:], batch.logprobs[1:]))


def test_training_slots_cover_each_token_once():
    from rlk.app.consistency import paths

    model = _model("tiny")
    prompts = _prompts(model)
    responses = [[1, 2], [], [3, 4, 5]]
    handle, inputs, slots = _record_forwards(model)
    try:
        lp, grads = paths.training_logprobs(
            model, prompts, responses, micro_batches=[[2], [1, 0]], on_forward=slots.append
        )
    finally:
        handle.remove()
    assert grads is None and len(inputs) == 2 and inputs[1][0] == (1, len(prompts[1]) + len(prompts[0]) + 2)
    assert [x.shape for x in lp] == [(2,), (0,), (3,)]
    _check_slots(inputs, slots, [len(p) + len(x) for p, x in zip(prompts, responses)])


# ---------------------------------------------------------------------------
# chain off: both paths compute the right thing
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
def test_stock_paths_match_the_fp64_reference(name):
    """Stock kernels (chain off): rollout (chunked and not) and training (two splits, with backward) agree with
    the fp64 reference within fp32 rounding, and the gradients with each other; stock transformers handles the
    packed rows (block-diagonal mask from the position ids)."""
    from rlk.app.consistency import harness, paths

    model = _model(name)
    prompts = _prompts(model, n=4)
    with paths.chain(model, False):
        r = paths.rollout(model, prompts, max_new_tokens=4, seed=2)
        rc = paths.rollout(model, prompts, max_new_tokens=4, prefill_chunk=3, seed=2)
        lp_a, g_a = paths.training_logprobs(model, prompts, r.responses, micro_batches=[[0, 1, 2, 3]], backward=True)
        lp_b, g_b = paths.training_logprobs(
            model, prompts, r.responses, micro_batches=[[3], [1, 0], [2]], backward=True
        )
    ref = harness.reference_logprobs(model, prompts, r.responses)
    for got in (r.logprobs, lp_a, lp_b):
        for x, y in zip(got, ref):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-4)
    if rc.responses == r.responses:  # chunking may change a sample under stock kernels: compare when equal
        for x, y in zip(rc.logprobs, ref):
            torch.testing.assert_close(x, y, rtol=0, atol=1e-4)
    # the gradient of a wrong (cross-sequence) mask would differ by far more than rounding
    for x, y in zip(g_a, g_b):
        torch.testing.assert_close(x, y, rtol=1e-3, atol=1e-5)
    # and a sequence alone is the same sequence: its gradient matches the packed one
    lp_0, g_0 = paths.training_logprobs(model, prompts[:1], r.responses[:1], micro_batches=[[0]], backward=True)
    torch.testing.assert_close(g_0[0], g_a[0], rtol=1e-3, atol=1e-5)


def test_chain_off_runs_a_patched_model_stock_and_the_reference_ignores_the_patch():
    """chain(model, False) unpatches a patched model for the block and patches it again on exit;
    reference_logprobs runs a stock float64 copy even of a patched model."""
    from rlk.app.consistency import harness, paths
    from rlk.integrations.hf import patch_model, unpatch_model

    model = harness.build_model("tiny", dtype=torch.float32, device="cpu", num_layers=1)
    prompts, responses = _prompts(model), [[1, 2], [3], [4, 5]]
    ref = harness.reference_logprobs(model, prompts, responses)
    assert all(x.dtype == torch.float32 for x in ref)
    patch_model(model)
    try:
        with paths.chain(model, False):
            assert getattr(model, "_rlk_patch", None) is None
            assert model.config._attn_implementation == "sdpa"
        assert model._rlk_patch is not None
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # the copy is unpatched: no rlk fallback warning
            again = harness.reference_logprobs(model, prompts, responses)
        assert model._rlk_patch is not None  # the model itself is untouched
    finally:
        unpatch_model(model)
    _assert_lists_equal(ref, again, "reference of a patched model")


# ---------------------------------------------------------------------------
# chain on: bitwise
# ---------------------------------------------------------------------------


@routed
@pytest.mark.parametrize("name", ["tiny", "tiny-llama"])
def test_chain_on_rollout_equals_training_bitwise(name):
    """rlk's chain on: every response token's log-prob is bitwise the same in the rollout (left-padded prefill,
    unchunked and in chunks of 4, KV-cache decode with a shrinking batch) and in packed training; and no rlk
    component falls back to stock code."""
    from rlk.app.consistency import harness, paths

    model = _model(name)
    prompts = _prompts(model)
    with paths.chain(model, True), warnings.catch_warnings():
        warnings.filterwarnings("error", message="rlk")  # any fallback to stock code fails the test
        r = paths.rollout(model, prompts, max_new_tokens=4, seed=0)
        rc = paths.rollout(model, prompts, max_new_tokens=4, prefill_chunk=4, seed=0)
        lp, _ = paths.training_logprobs(model, prompts, r.responses, micro_batches=[[0, 1, 2]])
    assert rc.responses == r.responses  # invariant logits: the same samples
    assert sum(len(x) for x in r.responses) >= 6 and len({len(x) for x in r.responses}) > 1
    _assert_lists_equal(r.logprobs, lp, "rollout vs training")
    _assert_lists_equal(rc.logprobs, lp, "chunked rollout vs training")
    assert getattr(model, "_rlk_patch", None) is None  # chain() restored the model
    ref = harness.reference_logprobs(model, prompts, r.responses)
    for x, y in zip(lp, ref):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-4)


@routed
def test_chain_on_training_split_invariance_with_gradients():
    """rlk's chain on: log-probs and per-sequence input-embedding gradients are bitwise the same in two
    different micro-batch splits (one packed row of all vs singles and a reordered pair). One layer, as in the test
    above."""
    from rlk.app.consistency import paths

    model = _model("tiny", layers=1)
    prompts = _prompts(model)
    responses = [[5, 6, 7], [8], [9, 10]]
    with paths.chain(model, True), warnings.catch_warnings():
        warnings.filterwarnings("error", message="rlk")
        lp_a, g_a = paths.training_logprobs(model, prompts, responses, micro_batches=[[0, 1, 2]], backward=True)
        lp_b, g_b = paths.training_logprobs(model, prompts, responses, micro_batches=[[2, 0], [1]], backward=True)
    _assert_lists_equal(lp_a, lp_b, "log-probs across splits")
    _assert_lists_equal(g_a, g_b, "input-embedding gradients across splits")
    assert [tuple(g.shape) for g in g_a] == [(len(p) + len(x), 64) for p, x in zip(prompts, responses)]
    assert all(bool(g.abs().sum() > 0) for g in g_a)


# ---------------------------------------------------------------------------
# GPU negative control: stock kernels drift on the 8B-shaped model
# ---------------------------------------------------------------------------


@pytest.mark.gpu
def test_stock_drift_is_nonzero_on_the_8b_shape_in_bf16():
    """Negative control (H200): with stock cuBLAS / SDPA the rollout and training log-probs of the 8B-shaped
    Qwen3 (2 layers, bf16) are NOT all bitwise equal, so the chain test can fail; with the chain on they are."""
    from rlk.app.consistency import harness, paths

    model = harness.build_model("qwen3-8b-shape", dtype=torch.bfloat16, device="cuda", num_layers=2)
    prompts = harness.make_prompts(8, vocab_size=model.config.vocab_size, seed=0, min_len=16, max_len=200)
    with paths.chain(model, False):
        r = paths.rollout(model, prompts, max_new_tokens=16, prefill_chunk=64, seed=0)
        lp, _ = paths.training_logprobs(model, prompts, r.responses, micro_batches=[list(range(8))])
    stock_equal = all(torch.equal(x, y) for x, y in zip(r.logprobs, lp))
    assert not stock_equal, "stock kernels gave bitwise-equal log-probs: the comparison proves nothing"
    with paths.chain(model, True):
        r_on = paths.rollout(model, prompts, max_new_tokens=16, prefill_chunk=64, seed=0)
        lp_on, _ = paths.training_logprobs(model, prompts, r_on.responses, micro_batches=[[0, 1, 2], [3, 4, 5, 6, 7]])
    _assert_lists_equal(r_on.logprobs, lp_on, "8B shape, chain on: rollout vs training")
