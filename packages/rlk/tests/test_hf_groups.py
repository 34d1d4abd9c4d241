"""``rlk.integrations.hf.group_logprobs``: GRPO groups scored with each prompt computed once, on a tiny random Qwen3
(and Llama) model in float32 through the Triton kernels (``TRITON_INTERPRET=1`` on the CPU).

A response's log-probs must be bitwise (``torch.equal``) those of ``prompt + response`` scored alone by the applied,
batch-invariant model; the parameter gradients of a summed loss agree with the per-sequence ones under the contract
(the prefix's key / value gradients are summed over the group). Negative control: the same packed row without the
layout (each response attending to the other responses) gives other log-probs.
"""

from __future__ import annotations

import pytest
import torch
from test_hf_apply import DEVICE, routed, tiny_model

from rlk.integrations.hf import apply, group_batch, group_logprobs
from rlk.integrations.hf.groups import LAYOUT_KEYWORD

pytestmark = [
    pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:divide by zero encountered:RuntimeWarning"),
]

PROMPTS = [[5, 17, 3, 99, 42], [7, 1]]
RESPONSES = [[[11, 12, 13], [21], [31, 32, 33, 34, 35, 36]], [[8, 9, 10, 4], [2, 2]]]


def test_group_batch_layout():
    batch = group_batch(PROMPTS, RESPONSES, ignore_index=-1)
    ids, pos, tgt = (x[0].tolist() for x in (batch.input_ids, batch.position_ids, batch.targets))
    assert ids == [5, 17, 3, 99, 42, 11, 12, 42, 42, 31, 32, 33, 34, 35, 7, 1, 8, 9, 10, 1, 2]
    assert pos == [0, 1, 2, 3, 4, 5, 6, 4, 4, 5, 6, 7, 8, 9, 0, 1, 2, 3, 4, 1, 2]
    assert tgt == [-1] * 4 + [11, 12, 13, 21, 31, 32, 33, 34, 35, 36, -1, 8, 9, 10, 4, 2, 2]
    assert batch.layout.cu_seqlens.tolist() == [0, 4, 7, 8, 14, 15, 19, 21]
    assert batch.layout.prefix_index.tolist() == [-1, 0, 0, 0, -1, 4, 4]
    assert batch.layout.max_seqlen == 6 and batch.layout.total == 21
    assert batch.spans == [[(4, 7), (7, 8), (8, 14)], [(15, 19), (19, 21)]]


def test_group_batch_errors_name_the_argument():
    with pytest.raises(ValueError, match="prompts"):
        group_batch([], [])
    with pytest.raises(ValueError, match="responses"):
        group_batch([[1, 2]], [])
    with pytest.raises(ValueError, match=r"prompts\[0\]"):
        group_batch([[]], [[[1]]])
    with pytest.raises(ValueError, match=r"responses\[0\]\[1\]"):
        group_batch([[1, 2]], [[[3], []]])
    with pytest.raises(ValueError, match=r"responses\[0\]"):
        group_batch([[1, 2]], [[]])
    with pytest.raises(TypeError, match=r"prompts\[0\]"):
        group_batch([[1.5, 2]], [[[3]]])
    with pytest.raises(ValueError, match=r"prompts\[0\]"):
        group_batch([torch.ones(2, 2, dtype=torch.int64)], [[[3]]])


def test_token_ids_out_of_range_are_refused():
    """A negative id (an ignore_index such as -100) would score 0 without a word, an id past the vocabulary read out
    of bounds: both are errors naming the prompt or response, the position and the id."""
    cases = [
        (([[1, 2]], [[[5, -100]]]), {}, r"^responses\[0\]\[0\]: token id -100 at position 1"),
        (([[1, 2], [3, -1]], [[[5]], [[6]]]), {}, r"^prompts\[1\]: token id -1 at position 1"),
        (([[1, 2]], [[[5], torch.tensor([4, -7])]]), {}, r"^responses\[0\]\[1\]: token id -7 at position 1"),
        (([[1, 2]], [[[5], [49, 50]]]), dict(vocab_size=50), r"^responses\[0\]\[1\]: token id 50 at position 1"),
        (([[0, 50]], [[[5]]]), dict(vocab_size=50), r"^prompts\[0\]: token id 50 at position 1"),
    ]
    for args, kw, message in cases:
        with pytest.raises(ValueError, match=message):
            group_batch(*args, **kw)
    group_batch([[0, 49]], [[[49, 0]]], vocab_size=50)  # the edges are valid ids
    with pytest.raises(ValueError, match="^vocab_size"):
        group_batch([[1]], [[[2]]], vocab_size=0)


@routed
def test_group_logprobs_refuses_ids_past_the_vocabulary():
    model = apply(tiny_model("qwen3").to(DEVICE), batch_invariant=True)
    vocab = model.get_output_embeddings().weight.shape[0]
    with pytest.raises(ValueError, match=rf"^responses\[1\]\[0\]: token id {vocab} at position 2"):
        group_logprobs(model, PROMPTS, [RESPONSES[0], [[8, 9, vocab], [2, 2]]])
    with pytest.raises(ValueError, match=r"^responses\[0\]\[2\]: token id -100 at position 0"):
        group_logprobs(model, PROMPTS, [[*RESPONSES[0][:2], [-100]], RESPONSES[1]])


def _alone(model, prompt, response):
    """The response's log-probs from ``prompt + response`` scored alone (positions P-1 .. P+R-2)."""
    ids = torch.tensor([prompt + response], device=DEVICE)
    targets = torch.full_like(ids, -100)
    targets[0, len(prompt) - 1 : -1] = torch.tensor(response, device=DEVICE)
    out = model(input_ids=ids, logprob_targets=targets, use_cache=False)
    return out.logprobs[0, len(prompt) - 1 : -1]


@routed
@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_bitwise_equal_to_each_sequence_alone(kind):
    model = apply(tiny_model(kind).to(DEVICE), batch_invariant=True)
    with torch.no_grad():
        grouped = group_logprobs(model, PROMPTS, RESPONSES)
        for g, prompt in enumerate(PROMPTS):
            for j, response in enumerate(RESPONSES[g]):
                assert grouped[g][j].shape == (len(response),)
                assert torch.equal(grouped[g][j], _alone(model, prompt, response)), (g, j)
        # negative control: the packed row without the layout (responses attend to each other) differs
        batch = group_batch(PROMPTS, RESPONSES, device=DEVICE)
        plain = model(
            input_ids=batch.input_ids, position_ids=batch.position_ids, logprob_targets=batch.targets, use_cache=False
        ).logprobs[0]
        a, b = batch.spans[0][1]
        assert not torch.equal(plain[a:b], grouped[0][1])


@routed
def test_gradients_match_the_sequences_alone():
    # one layer: the layout reaching every layer is the bitwise test's (2 layers); here the backward through it
    model = apply(tiny_model("qwen3", layers=1).to(DEVICE), batch_invariant=True)
    weights = torch.tensor([1.0, -0.5, 0.25, 2.0, 0.75])

    def grads(loss):
        model.zero_grad(set_to_none=True)
        loss.backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    grouped = group_logprobs(model, PROMPTS, RESPONSES)
    flat = [lp for group in grouped for lp in group]
    got = grads(sum(w * lp.sum() for w, lp in zip(weights, flat)))
    alone = [_alone(model, p, r) for p, group in zip(PROMPTS, RESPONSES) for r in group]
    want = grads(sum(w * lp.sum() for w, lp in zip(weights, alone)))
    assert got.keys() == want.keys() and len(got) > 0
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)


@routed
def test_gradient_checkpointing_keeps_the_layout():
    model = apply(tiny_model("qwen3").to(DEVICE), batch_invariant=True)
    model.train()
    lp = group_logprobs(model, PROMPTS[:1], RESPONSES[:1])
    model.zero_grad(set_to_none=True)
    sum(x.sum() for x in lp[0]).backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.gradient_checkpointing_enable()
    lp2 = group_logprobs(model, PROMPTS[:1], RESPONSES[:1])
    model.zero_grad(set_to_none=True)
    sum(x.sum() for x in lp2[0]).backward()
    for a, b in zip(lp[0], lp2[0]):
        assert torch.equal(a, b)
    for name, p in model.named_parameters():  # recomputed with the layout (without it they would be far off);
        # checkpointing changes autograd's accumulation order, so the gradients agree to rounding, not bitwise
        scale = float(want[name].abs().max())
        torch.testing.assert_close(p.grad, want[name], rtol=1e-5, atol=1e-5 * scale, msg=name)


def test_refuses_a_model_without_the_patched_attention():
    model = apply(tiny_model("qwen3"))  # the fused head, not batch-invariant: no patched attention
    with pytest.raises(ValueError, match="model"):
        group_logprobs(model, PROMPTS, RESPONSES)


@routed
def test_layout_mismatch_is_refused():
    model = apply(tiny_model("qwen3").to(DEVICE), batch_invariant=True)
    batch = group_batch(PROMPTS, RESPONSES, device=DEVICE)
    with pytest.raises(ValueError, match=LAYOUT_KEYWORD), torch.no_grad():
        model(
            input_ids=batch.input_ids[:, :-1],
            position_ids=batch.position_ids[:, :-1],
            use_cache=False,
            **{LAYOUT_KEYWORD: batch.layout},
        )
