"""The trainer's side of a vLLM rollout: a padded teacher-forced batch of ``prompt + response`` scored by transformers,
stock or with rlk's chain, and the checks that it holds the very tokens the engine saw.

With rlk on (``rlk.batch_invariant()`` + ``rlk.patch_model``), a token's log-prob is
:func:`rlk.integrations.vllm.ops.token_logprobs` of its logits row: ``rlk.selected_logprob(logits, token,
temperature=T)``, bitwise what the plugin made vLLM report. Stock: ``log_softmax(logits.float() / T)[token]``.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

PADDING_SIDES = ("left", "right")


@dataclasses.dataclass
class Batch:
    """A padded batch: ``input_ids``, ``attention_mask`` (1: token), ``position_ids`` (0 at each row's first
    token), all int64 ``[B, W]``; ``starts[i]`` the column of row ``i``'s first token; ``prompt_lengths`` and
    ``lengths`` (prompt + response) per row; ``padding_side``."""

    input_ids: Tensor
    attention_mask: Tensor
    position_ids: Tensor
    starts: list[int]
    prompt_lengths: list[int]
    lengths: list[int]
    padding_side: str


def padded_batch(
    prompts: list[list[int]],
    responses: list[list[int]],
    *,
    padding_side: str = "right",
    pad_token_id: int = 0,
    mask_side: str | None = None,
) -> Batch:
    """``prompt + response`` rows padded on ``padding_side`` with ``pad_token_id``. ``mask_side`` (default: the
    same) is where the mask and positions believe the padding is: a different side plants the classic mismatch
    that :func:`check_inputs` must catch."""
    for name, side in (("padding_side", padding_side), ("mask_side", mask_side or padding_side)):
        if side not in PADDING_SIDES:
            raise ValueError(f"{name}: expected one of {PADDING_SIDES}, got {side!r}")
    if len(prompts) != len(responses) or not prompts:
        raise ValueError(f"need one response per prompt: {len(prompts)} prompts, {len(responses)} responses")
    seqs = [list(p) + list(r) for p, r in zip(prompts, responses)]
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_token_id, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    starts, mask_starts = [], []
    for row, seq in enumerate(seqs):
        start = width - len(seq) if padding_side == "left" else 0
        ids[row, start : start + len(seq)] = torch.tensor(seq, dtype=torch.int64)
        mask_start = width - len(seq) if (mask_side or padding_side) == "left" else 0
        mask[row, mask_start : mask_start + len(seq)] = 1
        starts.append(start)
        mask_starts.append(mask_start)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return Batch(ids, mask, positions, mask_starts, [len(p) for p in prompts], [len(s) for s in seqs], padding_side)


def check_inputs(batch: Batch, prompts: list[list[int]], responses: list[list[int]]) -> dict:
    """Whether each row of the trainer's ``batch``, read through its own mask and positions, is exactly the engine's
    ``prompt + response`` at positions ``0 .. L-1``: ``{"ok", "rows_equal", "first_bad_row", "detail"}``."""
    bad = []
    for row, (p, r) in enumerate(zip(prompts, responses)):
        seen = batch.input_ids[row][batch.attention_mask[row].bool()].tolist()
        pos = batch.position_ids[row][batch.attention_mask[row].bool()].tolist()
        if seen != list(p) + list(r) or pos != list(range(len(p) + len(r))):
            bad.append(row)
    detail = (
        "every row holds the engine's tokens at positions 0..L-1"
        if not bad
        else (
            f"rows {bad[:8]} do not hold the engine's prompt + response at positions 0..L-1 "
            f"(padding side {batch.padding_side!r} vs the mask's)"
        )
    )
    return {
        "ok": not bad,
        "rows_equal": len(prompts) - len(bad),
        "first_bad_row": bad[0] if bad else None,
        "detail": detail,
    }


def score(model, batch: Batch, *, rlk_on: bool, temperature: float = 1.0) -> tuple[list[Tensor], list[Tensor]]:
    """Teacher-forced log-probs of every row: ``(response_logprobs, prompt_logprobs)``, fp32 ``[len(response)]`` and
    ``[len(prompt) - 1]`` per row (the prompt's at temperature 1, as vLLM reports them), on the CPU. ``rlk_on``:
    under :func:`rlk.integrations.hf.chain.chain` (``batch_invariant`` + ``patch_model``) with
    :func:`~rlk.integrations.vllm.ops.token_logprobs`; else stock kernels and ``log_softmax``."""
    from rlk.integrations.hf.chain import chain
    from rlk.integrations.vllm.ops import token_logprobs

    device = next(model.parameters()).device
    with torch.no_grad(), chain(model, rlk_on):
        logits = model(
            input_ids=batch.input_ids.to(device),
            attention_mask=batch.attention_mask.to(device),
            position_ids=batch.position_ids.to(device),
        ).logits
        responses, prompts = [], []
        for row in range(logits.shape[0]):
            start, plen, length = batch.starts[row], batch.prompt_lengths[row], batch.lengths[row]
            ids = batch.input_ids[row, start : start + length].to(device)
            rows = logits[row, start : start + length - 1]  # row t predicts token t + 1
            targets = ids[1:]
            if rlk_on:
                resp = token_logprobs(rows[plen - 1 :], targets[plen - 1 :], temperature)
                prompt = token_logprobs(rows[: plen - 1], targets[: plen - 1])
            else:
                z = rows.float()
                resp = torch.log_softmax(z[plen - 1 :] / temperature, -1).gather(1, targets[plen - 1 :, None])[:, 0]
                prompt = torch.log_softmax(z[: plen - 1], -1).gather(1, targets[: plen - 1, None])[:, 0]
            responses.append(resp.float().cpu())
            prompts.append(prompt.float().cpu())
    return responses, prompts


def first_difference(a: Tensor, b: Tensor) -> int | None:
    """The first index where two equal-length tensors differ bitwise (None: equal, or -1 for other lengths)."""
    if a.shape != b.shape:
        return -1
    diff = (a != b).nonzero()
    return int(diff[0, 0]) if diff.numel() else None
