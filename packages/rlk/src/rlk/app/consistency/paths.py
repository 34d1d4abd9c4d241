"""The two execution paths over the same token sequences: rollout-style and training-style.

Both return, per sequence, the fp32 log-probs ``log p(response[t] | prompt + response[:t])`` of the response
tokens, computed the same way: ``log_softmax(logits.float(), -1)`` of the logits row that predicts the token,
then the token's entry. What differs is how the forward passes are shaped, as in an RL system:

* :func:`rollout` (the inference engine): left-padded batched prefill of the prompts (optionally in chunks
  through the KV cache), then one token per step with the KV cache, the batch shrinking as sequences finish;
* :func:`training_logprobs` (the trainer): teacher forcing of prompt + response, the sequences of a micro-batch
  packed into one row (varlen), in micro-batches chosen by the caller; optionally the backward.

With rlk's chain on (:func:`chain`), a token's log-prob is bitwise the same on both paths and in any
micro-batch split; with stock kernels it drifts.

The rollout samples with ``rlk.sample`` (Gumbel-max, Philox keyed by a per-sequence seed and counted by the
token's index in its response, :func:`sequence_seeds`): a sequence's token is a function of its logits row's bits,
the run's seed, its sequence index and its step only, whatever the batch, the backend and the other sequences.

Observers: every model forward of a path is announced right BEFORE it runs with ``on_forward(slots)``,
``slots`` int64 ``[B, S, 2]`` on the model's device, the (sequence index, position in that sequence) of each
input slot ``[b, s]`` of this forward, ``(-1, -1)`` for padding.

The KV cache goes through :mod:`rlk.integrations.hf.compat` (the forward's own cache keyword, checked to advance at
every forward), so every transformers release of :data:`rlk.integrations.hf.compat.SUPPORTED` runs the same computation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rlk.integrations.hf.chain import chain  # noqa: F401  (paths.chain: the switch the paths run under)

OnForward = Callable[[Tensor], None] | None


# ---------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _vocab_size(model) -> int | None:
    config = getattr(model, "config", None)
    get_text = getattr(config, "get_text_config", None)
    text = get_text() if callable(get_text) else config
    return getattr(text, "vocab_size", None)


def _check_tokens(name: str, seqs: Sequence[Sequence[int]], vocab: int | None, allow_empty: bool) -> None:
    for i, seq in enumerate(seqs):
        if not allow_empty and len(seq) == 0:
            raise ValueError(f"{name}[{i}] is empty")
        for t in seq:
            if not isinstance(t, int) or isinstance(t, bool) or t < 0 or (vocab is not None and t >= vocab):
                raise ValueError(f"{name}[{i}] has token {t!r}, not an int id in [0, {vocab})")


def _check_prompts(model, prompts) -> None:
    if not isinstance(prompts, (list, tuple)) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    _check_tokens("prompts", prompts, _vocab_size(model), allow_empty=False)


def _logprob_of(logits: Tensor, tokens: Tensor) -> Tensor:
    """``log_softmax(logits.float(), -1)`` at ``tokens``: logits ``[N, V]``, tokens int64 ``[N]`` -> fp32 ``[N]``.
    The one scoring formula of both paths (temperature 1)."""
    return torch.log_softmax(logits.float(), -1).gather(1, tokens[:, None])[:, 0]


# ---------------------------------------------------------------------------
# rollout
# ---------------------------------------------------------------------------


@dataclass
class Rollout:
    """What :func:`rollout` sampled and scored."""

    prompts: list[list[int]]
    responses: list[list[int]]  # sampled tokens (shorter than max_new_tokens by the drawn length, or EOS)
    logprobs: list[Tensor]  # fp32 [len(response)] on the CPU: log p(token | prefix) from the rollout logits


def _response_lengths(n: int, max_new_tokens: int, seed: int) -> list[int]:
    """Per-sequence response budgets, uniform in ``[ceil(max_new_tokens / 2), max_new_tokens]`` from
    ``torch.Generator(seed)`` (so the decode batch shrinks over the second half)."""
    g = torch.Generator().manual_seed(seed)
    low = max(1, math.ceil(max_new_tokens / 2))
    return torch.randint(low, max_new_tokens + 1, (n,), generator=g).tolist()


_MASK64 = (1 << 64) - 1


def _splitmix64(state: int) -> int:
    """The SplitMix64 output function of a 64-bit state (a bijection of ``[0, 2**64)``)."""
    z = state & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def sequence_seeds(seed: int, n: int) -> Tensor:
    """The ``rlk.sample`` seeds of sequences ``0 .. n-1`` of a run with sampling seed ``seed``: int64 ``[n]`` (CPU).

    ``seeds[i] = splitmix64((seed + (i + 1) * 0x9E3779B97F4A7C15) mod 2**64)``, as a two's-complement int64: the
    ``(i + 1)``-th output of a SplitMix64 generator started at ``seed`` (any Python int, taken mod ``2**64``), with
    the output function ``z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB;
    z ^= z >> 31`` (mod ``2**64``). The state steps by an odd constant and the output function is a bijection, so
    the ``n`` seeds of a run are distinct (for ``n <= 2**64``), and all 64 bits of Philox's key vary. A sequence's
    seed depends only on ``seed`` and its index ``i``.
    """
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    out = []
    for i in range(n):
        z = _splitmix64(seed + (i + 1) * 0x9E3779B97F4A7C15)
        out.append(z - (1 << 64) if z >= 1 << 63 else z)
    return torch.tensor(out, dtype=torch.int64)


def _sample(logits: Tensor, seeds: Tensor, steps: Tensor, temperature: float) -> Tensor:
    """One token per row with ``rlk.sample`` (int64 ``[B]`` on the logits' device): row ``j`` drawn with its
    sequence's seed ``seeds[j]`` at step ``steps[j]`` (the index of the token in its response), so a sequence's
    draws do not depend on the other rows, on the batch size or on the backend. No top-k / top-p / min-p."""
    import rlk

    tokens, _ = rlk.sample(logits.detach(), seeds, steps, temperature=temperature)
    return tokens


def rollout(
    model,
    prompts: list[list[int]],
    *,
    max_new_tokens: int,
    prefill_chunk: int | None = None,
    seed: int = 0,
    temperature: float = 1.0,
    eos_token_id: int | None = None,
    on_forward: OnForward = None,
    pad_token_id: int = 0,
) -> Rollout:
    """Rollout-style sampling and scoring of ``prompts`` (lists of token ids).

    Prefill: the prompts left-padded to the longest, ``ids [B, P]`` (``pad_token_id`` in the pads),
    ``attention_mask [B, P]`` (1: token), ``position_ids = clamp(cumsum(mask) - 1, min=0)``; in one forward, or
    in column chunks of ``prefill_chunk`` through a ``transformers.DynamicCache`` (each chunk passes the mask of
    all columns so far). Decode: one token per active sequence per forward with the cache (mask grown by one
    column, position = the sequence's next position). A sequence finishes when it has its response budget
    (drawn per sequence from ``seed``, in ``[ceil(max_new_tokens / 2), max_new_tokens]``) or samples
    ``eos_token_id`` (kept in the response); its row is then dropped from the batch and from the cache
    (``DynamicCache.batch_select_indices``). Every forward asks for the last position's logits only
    (``logits_to_keep=1``; with left padding the last column is every row's newest token).

    Sampling is separate from scoring: the next token is drawn on the model's device by ``rlk.sample(logits,
    seeds, steps, temperature=temperature)`` (Gumbel-max with Philox, whichever backend dispatch selects; the
    backends give the same bits), with sequence ``i``'s seed ``sequence_seeds(seed, n)[i]`` and the step = the
    index of the token in its response (0 for the first). A sequence's response is thus a function of its own
    logits, ``seed`` and ``i`` only: the same whichever other sequences share (or have left) the decode batch, and
    two rollouts whose logits rows are bitwise equal (as with rlk's chain on) sample the same tokens. The
    recorded log-prob is the temperature-1 score ``log_softmax(logits.float())[token]`` on the model's device
    (what the trainer computes), not the sampler's. Gradients are off. Returns fp32 log-probs on the CPU.
    """
    _check_prompts(model, prompts)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if prefill_chunk is not None and (not isinstance(prefill_chunk, int) or prefill_chunk < 1):
        raise ValueError(f"prefill_chunk must be None or a positive int, got {prefill_chunk!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature!r}")
    from rlk.integrations.hf import compat

    device = _device(model)
    n = len(prompts)
    prompts = [list(p) for p in prompts]
    budgets = _response_lengths(n, max_new_tokens, seed)
    seeds = sequence_seeds(seed, n).to(device)  # seeds[row]: the seed of sequence active[row]

    width = max(len(p) for p in prompts)
    ids = torch.full((n, width), pad_token_id, dtype=torch.int64)
    mask = torch.zeros((n, width), dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.int64)
        mask[i, width - len(p) :] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    ids, mask, position_ids = ids.to(device), mask.to(device), position_ids.to(device)

    active = list(range(n))  # sequence index of each batch row
    responses: list[list[int]] = [[] for _ in range(n)]
    logprobs: list[list[Tensor]] = [[] for _ in range(n)]
    cache = compat.new_cache(model)

    def forward(step_ids: Tensor, step_mask: Tensor, step_pos: Tensor, slot_valid: Tensor) -> Tensor:
        if on_forward is not None:
            seq = torch.tensor(active, dtype=torch.int64, device=device)[:, None].expand_as(step_pos)
            slots = torch.stack([seq, step_pos.to(torch.int64)], -1)
            on_forward(torch.where(slot_valid[..., None], slots, torch.full_like(slots, -1)))
        out = compat.cached_forward(
            model, cache, input_ids=step_ids, attention_mask=step_mask, position_ids=step_pos, logits_to_keep=1
        )
        return out.logits[:, -1]  # [B, V]

    with torch.no_grad():
        chunk = prefill_chunk or width
        for start in range(0, width, chunk):
            stop = min(width, start + chunk)
            logits = forward(
                ids[:, start:stop], mask[:, :stop], position_ids[:, start:stop], mask[:, start:stop].bool()
            )
        next_pos = position_ids[:, -1] + 1  # [B]: every prompt is non-empty
        while True:
            steps = torch.tensor([len(responses[i]) for i in active], dtype=torch.int64, device=device)
            token_t = _sample(logits, seeds, steps, temperature)
            tokens = token_t.tolist()
            scores = _logprob_of(logits, token_t).cpu()
            keep = []
            for row, (i, t) in enumerate(zip(active, tokens)):
                responses[i].append(t)
                logprobs[i].append(scores[row])
                if len(responses[i]) < budgets[i] and t != eos_token_id:
                    keep.append(row)
            if not keep:
                break
            if len(keep) < len(active):  # the batch shrinks: drop finished rows from the batch and the cache
                rows = torch.tensor(keep, dtype=torch.int64, device=device)
                cache.batch_select_indices(rows)
                mask, next_pos, token_t, seeds = mask[rows], next_pos[rows], token_t[rows], seeds[rows]
                active = [active[row] for row in keep]
            mask = torch.cat([mask, mask.new_ones((len(active), 1))], 1)
            step_pos = next_pos[:, None]
            logits = forward(token_t[:, None], mask, step_pos, torch.ones_like(step_pos, dtype=torch.bool))
            next_pos = next_pos + 1
    return Rollout(
        prompts=prompts, responses=responses, logprobs=[torch.stack(lp) if lp else torch.zeros(0) for lp in logprobs]
    )


# ---------------------------------------------------------------------------
# training
# ---------------------------------------------------------------------------


def _check_micro_batches(micro_batches, n: int) -> list[list[int]]:
    if not isinstance(micro_batches, (list, tuple)) or not micro_batches:
        raise ValueError("micro_batches must be a non-empty list of lists of sequence indices")
    seen: list[int] = []
    for mb in micro_batches:
        if not isinstance(mb, (list, tuple)) or not mb:
            raise ValueError(f"micro_batches has an empty or non-list entry {mb!r}")
        seen.extend(mb)
    if sorted(seen) != list(range(n)) or not all(isinstance(i, int) for i in seen):
        raise ValueError(
            f"micro_batches {micro_batches!r} must partition the sequence indices 0..{n - 1} (every index exactly once)"
        )
    return [list(mb) for mb in micro_batches]


def training_logprobs(
    model,
    prompts: list[list[int]],
    responses: list[list[int]],
    *,
    micro_batches: list[list[int]],
    backward: bool = False,
    on_forward: OnForward = None,
) -> tuple[list[Tensor], list[Tensor] | None]:
    """Training-style teacher forcing of ``prompt + response`` per sequence, in packed micro-batches.

    Each micro-batch (a list of sequence indices, all of them together a partition of ``range(len(prompts))``)
    is one forward on ONE packed row: ``inputs_embeds [1, T, H]`` = the embeddings of the micro-batch's
    sequences concatenated in the given order (``T`` = their total length), ``position_ids [1, T]`` restarting
    at 0 per sequence, no attention mask, no cache. The same input serves both chains: rlk's patched attention
    splits a packed row at ``position_ids == 0`` (varlen ``cu_seqlens``); stock transformers detects the
    packing from the ``position_ids`` when there is no mask and no cache and builds a block-diagonal causal
    mask for SDPA (checked against :func:`rlk.app.consistency.harness.reference_logprobs` in the tests).

    Returns ``(logprobs, grads)``: ``logprobs[i]`` fp32 ``[len(responses[i])]`` on the CPU,
    ``log_softmax(logits.float())`` at the response tokens (the logits rows ``len(prompt) - 1 ..
    len(prompt) + len(response) - 2`` of the sequence); ``grads`` None, or with ``backward=True``
    ``grads[i] = d sum(logprobs[i]) / d inputs_embeds[sequence i]``, ``[len(prompt) + len(response), H]`` in the
    model's dtype on the CPU (the input embeddings are a leaf: the embedding table gets no gradient; the
    parameters' ``.grad`` are left untouched).
    """
    _check_prompts(model, prompts)
    if not isinstance(responses, (list, tuple)) or len(responses) != len(prompts):
        raise ValueError(
            f"need one response per prompt: {len(prompts)} prompts, "
            f"{len(responses) if isinstance(responses, (list, tuple)) else responses!r} responses"
        )
    _check_tokens("responses", responses, _vocab_size(model), allow_empty=True)
    micro_batches = _check_micro_batches(micro_batches, len(prompts))
    device = _device(model)
    embed = model.get_input_embeddings()
    out_lp: list[Tensor | None] = [None] * len(prompts)
    out_grad: list[Tensor | None] = [None] * len(prompts)

    for mb in micro_batches:
        seqs = [list(prompts[i]) + list(responses[i]) for i in mb]
        tokens = torch.tensor([t for s in seqs for t in s], dtype=torch.int64, device=device)
        position_ids = torch.cat([torch.arange(len(s), dtype=torch.int64) for s in seqs]).to(device)[None]
        starts = [0]
        for s in seqs:
            starts.append(starts[-1] + len(s))
        with torch.no_grad():
            x = embed(tokens[None])  # [1, T, H]
        if backward:
            x = x.detach().requires_grad_(True)
        if on_forward is not None:
            seq_ids = torch.cat([torch.full((len(s),), i, dtype=torch.int64) for i, s in zip(mb, seqs)]).to(device)
            on_forward(torch.stack([seq_ids[None], position_ids], -1))
        with torch.set_grad_enabled(backward):
            logits = model(inputs_embeds=x, position_ids=position_ids, use_cache=False).logits[0]  # [T, V]
            lps = []
            for k, i in enumerate(mb):
                p, r = len(prompts[i]), len(responses[i])
                rows = slice(starts[k] + p - 1, starts[k] + p + r - 1)
                lps.append(_logprob_of(logits[rows], tokens[starts[k] + p : starts[k] + p + r]))
        if backward:
            total = torch.stack([lp.sum() for lp in lps]).sum()
            (grad,) = torch.autograd.grad(total, x)
            for k, i in enumerate(mb):
                out_grad[i] = grad[0, starts[k] : starts[k + 1]].detach().cpu()
        for k, i in enumerate(mb):
            out_lp[i] = lps[k].detach().cpu()
    return out_lp, (out_grad if backward else None)
