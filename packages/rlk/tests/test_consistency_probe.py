"""The layer-wise drift probe (:mod:`rlk.app.consistency.probe`) on tiny transformers models, stock PyTorch, CPU.

The tests drive ``Probe.on_forward`` themselves with the slots of each forward: one left-padded batch, two
batches (left padding and a packed row), decode-like ``S = 1`` steps with a KV cache. Paths that batch
differently are only close on the CPU (stock matmuls are not batch-invariant); the same path run twice is
bitwise equal, and a perturbed weight is found at the right (layer, op).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import warnings

import pytest
import torch

from rlk.app.consistency.probe import OPS, Drift, Probe, compare, find_layers

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, LAYERS = 64, 4, 2, 16, 128, 128, 2
LENGTHS = (5, 3, 7, 4)
LLAMA_OPS = tuple(op for op in OPS if op not in ("q_norm", "k_norm"))


def _transformers():
    if os.environ.get("RLK_REQUIRE_TRANSFORMERS") == "1":
        import transformers

        return transformers
    return pytest.importorskip("transformers")


def tiny_model(kind: str):
    """A 2-layer, hidden-64 transformers model from a config (seeded init), float32, eval mode, SDPA."""
    transformers = _transformers()
    torch.manual_seed(0)
    common = dict(
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        vocab_size=VOCAB,
        max_position_embeddings=256,
        attn_implementation="sdpa",
    )
    if kind == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common))
    return model.float().eval()


def sequences(lengths=LENGTHS, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=g) for n in lengths]


def run_padded(model, probe, seqs, index):
    """One left-padded batch of ``seqs`` (sequence numbers ``index``), garbage ids in the pads."""
    length = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), length), 7, dtype=torch.int64)
    mask = torch.zeros(len(seqs), length, dtype=torch.int64)
    slots = torch.full((len(seqs), length, 2), -1, dtype=torch.int64)
    for row, (i, s) in enumerate(zip(index, seqs)):
        pad = length - len(s)
        ids[row, pad:] = s
        mask[row, pad:] = 1
        slots[row, pad:, 0] = i
        slots[row, pad:, 1] = torch.arange(len(s))
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    probe.on_forward(slots)
    with torch.no_grad():
        model(ids, attention_mask=mask, position_ids=position_ids, use_cache=False)


def run_packed(model, probe, seqs, index):
    """One packed row (batch 1, position ids restarting at 0 per sequence, no mask, no cache)."""
    ids = torch.cat(seqs)[None]
    positions = torch.cat([torch.arange(len(s)) for s in seqs])[None]
    owner = torch.cat([torch.full((len(s),), i, dtype=torch.int64) for i, s in zip(index, seqs)])[None]
    probe.on_forward(torch.stack([owner, positions], -1))
    with torch.no_grad():
        model(ids, position_ids=positions, use_cache=False)


def all_keys(seqs):
    return {(i, p) for i, s in enumerate(seqs) for p in range(len(s))}


# ---------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_every_op_of_every_layer_is_captured_in_computation_order(kind):
    model, seqs = tiny_model(kind), sequences()
    with Probe(model) as probe:
        run_padded(model, probe, seqs, range(len(seqs)))
    ops = OPS if kind == "qwen3" else LLAMA_OPS
    assert probe.order() == [(layer, op) for layer in range(LAYERS) for op in ops]
    assert list(probe.states()) == probe.order()
    widths = {
        "q_proj": HEADS * HEAD_DIM,
        "q_norm": HEADS * HEAD_DIM,
        "k_proj": KV_HEADS * HEAD_DIM,
        "k_norm": KV_HEADS * HEAD_DIM,
        "v_proj": KV_HEADS * HEAD_DIM,
        "attention": HEADS * HEAD_DIM,
        "gate_proj": INTER,
        "up_proj": INTER,
        "act": INTER,
    }
    for (layer, op), states in probe.states().items():
        assert set(states) == all_keys(seqs), (layer, op)  # the pads (-1, -1) are not kept
        for vector in states.values():
            assert vector.shape == (widths.get(op, HIDDEN),) and vector.dtype == torch.float32
            assert vector.device.type == "cpu"
    # the hooks are gone after the block
    model(seqs[0][None])
    assert probe.unannounced == 0 and probe.duplicates == 0


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_states_are_the_model_intermediates(kind):
    model, seqs = tiny_model(kind), sequences()
    with Probe(model) as probe:
        run_padded(model, probe, seqs[:1], [0])
    with torch.no_grad():
        out = model(seqs[0][None], output_hidden_states=True, use_cache=False)
    layer0 = torch.stack([probe.states()[(0, "layer")][(0, p)] for p in range(len(seqs[0]))])
    assert torch.equal(layer0, out.hidden_states[1][0])
    mlp = find_layers(model)[0].mlp
    h = torch.stack([probe.states()[(0, "post_attention_layernorm")][(0, p)] for p in range(len(seqs[0]))])
    with torch.no_grad():
        act = mlp.act_fn(mlp.gate_proj(h)) * mlp.up_proj(h)
    act_probe = torch.stack([probe.states()[(0, "act")][(0, p)] for p in range(len(seqs[0]))])
    torch.testing.assert_close(act_probe, act)


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_identical_runs_have_no_drift(kind):
    model, seqs = tiny_model(kind), sequences()
    probes = []
    for _ in range(2):
        with Probe(model) as probe:
            run_padded(model, probe, seqs, range(len(seqs)))
        probes.append(probe)
    drift = compare(*probes)
    assert isinstance(drift, Drift)
    assert drift.first_divergent is None
    assert drift.tokens == sum(LENGTHS)
    assert len(drift.per_op) == LAYERS * len(OPS if kind == "qwen3" else LLAMA_OPS)
    assert all(e["max_abs"] == 0.0 and e["mean_abs"] == 0.0 and e["equal"] for e in drift.per_op.values())
    assert all(e["n_tokens"] == sum(LENGTHS) for e in drift.per_op.values())
    assert [row["layer"] for row in drift.per_layer] == list(range(LAYERS))
    assert all(row["max_abs"] == 0.0 and row["first_op"] is None and row["equal"] for row in drift.per_layer)
    assert drift.to_dict()["first_divergent"] is None


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_a_perturbed_weight_is_the_first_divergent_op(kind):
    model, seqs = tiny_model(kind), sequences()
    other = copy.deepcopy(model)
    with torch.no_grad():
        find_layers(other)[1].mlp.up_proj.weight[3, 5] += 1e-3
    probes = []
    for m in (model, other):
        with Probe(m) as probe:
            run_padded(m, probe, seqs, range(len(seqs)))
        probes.append(probe)
    drift = compare(*probes)
    assert drift.first_divergent == (1, "up_proj")
    names = list(drift.per_op)
    cut = names.index("1.up_proj")
    for name in names[:cut]:
        assert drift.per_op[name]["max_abs"] == 0.0 and drift.per_op[name]["equal"], name
    for name in ("1.up_proj", "1.act", "1.down_proj", "1.layer"):
        assert drift.per_op[name]["max_abs"] > 0.0 and not drift.per_op[name]["equal"], name
    assert drift.per_op["1.gate_proj"]["max_abs"] == 0.0
    assert drift.per_layer[0]["first_op"] is None and drift.per_layer[0]["max_abs"] == 0.0
    assert drift.per_layer[1]["first_op"] == "up_proj" and drift.per_layer[1]["max_abs"] > 0.0
    assert drift.per_layer[1]["out_max_abs"] == drift.per_op["1.layer"]["max_abs"]
    assert drift.to_dict()["first_divergent"] == [1, "up_proj"]


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_one_batch_vs_two_batches_with_padding_and_packing(kind):
    """(a) all sequences in one left-padded batch; (b) a left-padded batch of two and a packed row of two.
    The probes key the same tokens; stock CPU kernels make the values close, not necessarily equal."""
    model, seqs = tiny_model(kind), sequences()
    with Probe(model) as a:
        run_padded(model, a, seqs, range(len(seqs)))
    with Probe(model) as b:
        run_padded(model, b, seqs[:2], [0, 1])
        run_packed(model, b, seqs[2:], [2, 3])
    for (layer, op), states in b.states().items():
        assert set(states) == all_keys(seqs), (layer, op)
    drift = compare(a, b)
    assert drift.tokens == sum(LENGTHS)
    assert all(e["max_abs"] < 1e-4 for e in drift.per_op.values()), drift.per_op
    assert all(e["n_tokens"] == sum(LENGTHS) for e in drift.per_op.values())
    # restricted to one sequence's tokens
    only = {(3, p) for p in range(LENGTHS[3])}
    assert compare(a, b, positions=only).tokens == LENGTHS[3]


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_decode_steps_of_one_token(kind):
    """Left-padded prefill of the first tokens into a DynamicCache, then S = 1 decode steps (teacher-forced, the
    batch shrinking as sequences end) vs one full forward per sequence."""
    _transformers()
    from rlk.integrations.hf import compat

    model, seqs = tiny_model(kind), sequences()
    prompt = 2
    with Probe(model) as full:
        for i, s in enumerate(seqs):
            run_padded(model, full, [s], [i])
    with Probe(model) as step:
        cache = compat.new_cache(model)
        live = list(range(len(seqs)))
        ids = torch.stack([s[:prompt] for s in seqs])
        mask = torch.ones(len(seqs), prompt, dtype=torch.int64)
        slots = torch.stack(
            [torch.tensor(live)[:, None].expand(-1, prompt), torch.arange(prompt).expand(len(seqs), -1)], -1
        )
        step.on_forward(slots)
        with torch.no_grad():
            compat.cached_forward(
                model,
                cache,
                input_ids=ids,
                attention_mask=mask,
                position_ids=torch.arange(prompt).expand(len(seqs), -1),
            )
        for pos in range(prompt, max(LENGTHS)):
            keep = [row for row, i in enumerate(live) if len(seqs[i]) > pos]
            if len(keep) < len(live):  # drop the finished rows from the batch and the cache
                cache.batch_select_indices(torch.tensor(keep))
                mask = mask[keep]
                live = [live[row] for row in keep]
            mask = torch.cat([mask, torch.ones(len(live), 1, dtype=torch.int64)], 1)
            ids = torch.stack([seqs[i][pos : pos + 1] for i in live])
            step.on_forward(torch.tensor([[[i, pos]] for i in live]))  # [B, 1, 2]
            with torch.no_grad():
                compat.cached_forward(
                    model, cache, input_ids=ids, attention_mask=mask, position_ids=torch.full((len(live), 1), pos)
                )
    assert step.unannounced == 0 and step.duplicates == 0
    for (layer, op), states in step.states().items():
        assert set(states) == all_keys(seqs), (layer, op)
    drift = compare(full, step)
    assert drift.tokens == sum(LENGTHS)
    assert all(e["max_abs"] < 1e-4 for e in drift.per_op.values()), drift.per_op


def test_padding_slots_and_unannounced_forwards_are_ignored():
    model, seqs = tiny_model("qwen3"), sequences()
    with Probe(model) as probe:
        with torch.no_grad():
            model(seqs[0][None], use_cache=False)  # not announced: skipped
        assert probe.unannounced == 1
        slots = torch.full((1, 4, 2), -1, dtype=torch.int64)
        slots[0, 1:, 0] = 0
        slots[0, 1:, 1] = torch.arange(3)
        slots[0, 2, 1] = -1  # a hole
        probe.on_forward(slots)
        with torch.no_grad():
            model(seqs[0][None, :4], use_cache=False)
        with torch.no_grad():
            model(seqs[0][None, :2], use_cache=False)  # the announcement was consumed
    assert probe.unannounced == 2
    for states in probe.states().values():
        assert set(states) == {(0, 0), (0, 2)}


def test_slots_seen_twice_keep_the_first_copy():
    model, seqs = tiny_model("llama"), sequences()
    with Probe(model) as probe:
        run_padded(model, probe, seqs[:1], [0])
        first = probe.states()[(0, "layer")][(0, 0)].clone()
        with torch.no_grad():
            find_layers(model)[0].mlp.down_proj.weight.add_(1.0)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run_padded(model, probe, seqs[:1], [0])
    assert probe.duplicates == len(LLAMA_OPS) * LAYERS * LENGTHS[0]
    assert sum("seen twice" in str(w.message) for w in caught) == 1
    assert torch.equal(probe.states()[(0, "layer")][(0, 0)], first)


def test_restricting_what_is_kept():
    model, seqs = tiny_model("qwen3"), sequences()
    with Probe(model, layers=[1], ops=["up_proj", "layer"]) as probe:
        run_padded(model, probe, seqs, range(len(seqs)))
    assert probe.order() == [(1, "up_proj"), (1, "layer")]
    with Probe(model, positions={(0, 1), (2, 0), (9, 9)}) as probe:
        run_padded(model, probe, seqs, range(len(seqs)))
    assert all(set(s) == {(0, 1), (2, 0)} for s in probe.states().values())
    with Probe(model, max_tokens=6) as probe:
        run_padded(model, probe, seqs[:1], [0])
        run_padded(model, probe, seqs[1:], [1, 2, 3])
    assert all(set(s) == all_keys(seqs[:1]) | {(1, 0)} for s in probe.states().values())


def test_compare_errors():
    model, seqs = tiny_model("qwen3"), sequences()
    with Probe(model) as a:
        run_padded(model, a, seqs[:1], [0])
    with Probe(model) as b:
        run_padded(model, b, seqs[1:2], [1])
    with pytest.raises(ValueError, match="share no"):
        compare(a, b)
    with pytest.raises(ValueError, match="share no"):
        compare(a, a, positions={(5, 5)})
    with Probe(model, ops=["layer"]) as c, Probe(model, ops=["act"]) as d:
        run_padded(model, c, seqs[:1], [0])
        d.on_forward(torch.zeros(1, 1, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="no common"):
        compare(c, d)
    with Probe(model) as e:
        e.on_forward(torch.zeros(1, 3, 2, dtype=torch.int64))  # announces 3 slots, the forward has 5
        with pytest.raises(ValueError, match="does not match"), torch.no_grad():
            model(seqs[0][None], use_cache=False)
    with pytest.raises(ValueError, match=r"\[B, S, 2\]"):
        Probe(model).on_forward(torch.zeros(3, 2, dtype=torch.int64))


def test_unknown_architecture_is_hooked_by_name():
    """GPT-2: layers under transformer.h, Conv1D / LayerNorm submodules hooked under their dotted names."""
    transformers = _transformers()
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB, n_positions=64)
    model = transformers.GPT2LMHeadModel(config).eval()
    seqs = sequences()
    probes = []
    for _ in range(2):
        with Probe(model) as probe:
            run_padded(model, probe, seqs, range(len(seqs)))
        probes.append(probe)
    ops = [op for layer, op in probes[0].order() if layer == 0]
    assert ops[0] == "ln_1" and ops[-1] == "layer" and "attn.c_attn" in ops and "mlp.c_proj" in ops
    assert len(probes[0].order()) == 2 * len(ops)
    assert compare(*probes).first_divergent is None


def test_importing_the_probe_does_not_import_transformers():
    code = "import sys, rlk.app.consistency.probe; assert 'transformers' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.triton_interpreter
def test_with_rlk_chain_batching_does_not_change_any_state():
    """rlk's chain on (batch_invariant + patch_model, Triton interpreter): one padded batch vs a padded batch and
    a packed row are bitwise equal at every op (stock kernels: only close, see the test above)."""
    import rlk
    from rlk.integrations.hf import patch_model, unpatch_model

    model, seqs = tiny_model("qwen3"), sequences()
    patch_model(model)
    try:
        with rlk.batch_invariant(), warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # no stock fallback inside the chain
            with Probe(model) as a:
                run_padded(model, a, seqs, range(len(seqs)))
            with Probe(model) as b:
                run_padded(model, b, seqs[:2], [0, 1])
                run_packed(model, b, seqs[2:], [2, 3])
    finally:
        unpatch_model(model)
    drift = compare(a, b)
    assert drift.first_divergent is None and drift.tokens == sum(LENGTHS)
    assert all(e["max_abs"] == 0.0 for e in drift.per_op.values())
