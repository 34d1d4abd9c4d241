"""Shared pieces of the training-engine tests (``test_engine_*.py``): a tiny Qwen3, the training path (packed
micro-batches through ``rlk.integrations.hf.apply``'s log-prob call, or the logits) and the HF rollout path (left-padded
prefill and KV-cache decode, scored by ``logprobs_from_hidden``), both returning per-sequence response log-probs.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

import rlk
import rlk.integrations.hf as hf

VOCAB = 96
PROMPTS = [[5, 17, 3, 60, 41], [7, 2, 88], [33, 12, 9, 70, 1, 54], [25, 64, 8, 19]]
MAX_NEW = 4


def tiny_qwen3():
    """A random 2-layer Qwen3 (fp32, untied head, hidden 64, 2 query / 1 kv heads of 32), the same on every rank."""
    import transformers

    config = transformers.Qwen3Config(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        vocab_size=VOCAB,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.normal_(0, 0.6)  # next-token distributions far from uniform
    return model


# ---------------------------------------------------------------------------
# the two paths
# ---------------------------------------------------------------------------


def packed(prompts, responses, seqs):
    """One packed row of sequences ``seqs``: token ids ``[T]``, position ids ``[1, T]`` (restarting at 0), the
    targets ``[1, T]`` (the response tokens at the positions predicting them, -100 elsewhere) and row offsets."""
    tokens, positions, targets, starts = [], [], [], [0]
    for i in seqs:
        p, r = prompts[i], responses[i]
        tokens += p + r
        positions += list(range(len(p) + len(r)))
        targets += [-100] * (len(p) - 1) + r + [-100]
        starts.append(len(tokens))
    return torch.tensor(tokens), torch.tensor([positions]), torch.tensor([targets]), starts


def train(model, embed, prompts, responses, micro_batches, *, rlk_on=True, backward=True, coef=None):
    """Training-style scoring: each micro-batch one packed row through ``model(inputs_embeds=...,
    logprob_targets=...)`` (``rlk_on``) or the logits and ``log_softmax`` (stock); returns per sequence the response
    log-probs and ``d sum(coef * logprobs) / d inputs_embeds`` of its rows (``backward``)."""
    lps, grads = {}, {}
    for mb in micro_batches:
        tokens, positions, targets, starts = packed(prompts, responses, mb)
        x = embed[tokens][None].detach().requires_grad_(backward)
        with torch.set_grad_enabled(backward):
            if rlk_on:
                lp = model(inputs_embeds=x, position_ids=positions, logprob_targets=targets, use_cache=False).logprobs
            else:
                logits = model(inputs_embeds=x, position_ids=positions, use_cache=False).logits
                lp = torch.log_softmax(logits.float(), -1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
                lp = lp.masked_fill(targets == -100, 0.0)
            if backward:
                weights = torch.ones_like(lp) if coef is None else coef(targets)
                state = getattr(model, "_rlk_apply", None)  # apply(batch_invariant=True): backward in the mode too
                invariant = state is not None and state.batch_invariant
                with rlk.batch_invariant() if invariant else contextlib.nullcontext():
                    (lp * weights).sum().backward()
        for k, i in enumerate(mb):
            p, r = len(prompts[i]), len(responses[i])
            lps[i] = lp[0, starts[k] + p - 1 : starts[k] + p + r - 1].detach()
            if backward:
                grads[i] = x.grad[0, starts[k] : starts[k + 1]].clone()
    order = sorted(lps)
    return [lps[i] for i in order], [grads[i] for i in order] if backward else None


def rollout_scores(model, prompts, responses, *, rlk_on=True):
    """The HF rollout path on given tokens: the prompts left-padded in one batch, prefilled, then one response token
    per row per step through the KV cache (every row teacher-forced with its response; rows that are done repeat
    their last token, their scores dropped). rlk: ``logprobs_from_hidden`` of the hidden state the head received
    (the op, weight and backend of training's fused head); stock: ``log_softmax`` of the logits."""
    from rlk.integrations.hf import compat

    n, width = len(prompts), max(map(len, prompts))
    ids = torch.zeros((n, width), dtype=torch.int64)
    mask = torch.zeros((n, width), dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :], mask[i, width - len(p) :] = torch.tensor(p), 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    seen = {}
    hook = model.get_output_embeddings().register_forward_pre_hook(lambda m, args: seen.update(h=args[0]))
    cache = compat.new_cache(model)
    scores = [[] for _ in range(n)]
    try:
        with torch.no_grad():
            kwargs = dict(attention_mask=mask, position_ids=pos, logits_to_keep=1)
            out = compat.cached_forward(model, cache, input_ids=ids, **kwargs)
            for step in range(max(map(len, responses))):
                token = torch.tensor([r[min(step, len(r) - 1)] for r in responses])
                if rlk_on:
                    lp = hf.logprobs_from_hidden(model, seen["h"][:, -1], token)
                else:
                    lp = torch.log_softmax(out.logits[:, -1].float(), -1).gather(1, token[:, None])[:, 0]
                for i, r in enumerate(responses):
                    if step < len(r):
                        scores[i].append(lp[i])
                mask = torch.cat([mask, mask.new_ones((n, 1))], 1)
                pos = pos[:, -1:] + 1
                kwargs.update(attention_mask=mask, position_ids=pos)
                out = compat.cached_forward(model, cache, input_ids=token[:, None], **kwargs)
    finally:
        hook.remove()
    return [torch.stack(s) for s in scores]


def assert_all_equal(got, truth, what):
    assert len(got) == len(truth), what
    for i, (a, b) in enumerate(zip(got, truth)):
        assert a.dtype == b.dtype and torch.equal(a, b), (
            f"{what}: sequence {i} differs (max {(a.double() - b.double()).abs().max().item():.3g})"
        )


def all_gather(obj, group):
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out
