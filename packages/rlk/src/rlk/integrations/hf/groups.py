"""Prefix-shared forwards of GRPO groups: :func:`group_logprobs` scores G responses to one prompt with the prompt
computed once.

A group's tokens go into one packed row: the prompt minus its last token (the *prefix*, computed once), then per
response its own segment, the prompt's last token followed by the response's tokens but the last::

    [p_0 ... p_{P-2}] [p_{P-1} r1_0 ... r1_{R1-2}] [p_{P-1} r2_0 ... r2_{R2-2}] ...

Position ids run 0..P-2 over the prefix and P-1.. over each segment, and every segment's attention reads the
prefix's keys and values before its own (:func:`rlk.prefix_attention`), so row ``t`` of a segment is the token at
position ``P - 1 + t`` of ``prompt + response`` and predicts response token ``t``: one LM-head row per scored token,
the prompt's last token computed once per response (one token, so that each response's first token is scored from a
row of its own). Everything else in the model is per token. Under ``apply(model, batch_invariant=True)`` a response's
log-probs are therefore bitwise those of ``prompt + response`` scored alone; the work saved is the prefix's
attention and MLP for G - 1 of the G responses.

The layout reaches rlk's attention through a keyword argument of the model's forward
(:data:`LAYOUT_KEYWORD`), which transformers passes down to the attention function (also when gradient checkpointing
recomputes a layer).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch
from torch import Tensor

from rlk.core import checks

#: The keyword of the model's forward that carries a :class:`PrefixLayout` to rlk's attention function.
LAYOUT_KEYWORD = "rlk_prefix_layout"


@dataclasses.dataclass(frozen=True)
class PrefixLayout:
    """The packed row's sequences for :func:`rlk.prefix_attention` (one row, queries and keys the same tokens).

    ``cu_seqlens`` int32 ``[S + 1]``, ``prefix_index`` int32 ``[S]`` (-1 for a prefix, its prefix's sequence index
    for a response segment), ``max_seqlen`` the longest sequence, ``total`` the row's tokens.
    """

    cu_seqlens: Tensor
    prefix_index: Tensor
    max_seqlen: int
    total: int


@dataclasses.dataclass(frozen=True)
class GroupBatch:
    """One packed row of groups: what :func:`group_logprobs` feeds the model.

    ``input_ids``, ``position_ids`` and ``targets`` (``ignore_index`` on the prefix rows) are int64 ``[1, T]``;
    ``spans[g][j]`` the ``(start, end)`` rows of response ``j`` of group ``g``.
    """

    input_ids: Tensor
    position_ids: Tensor
    targets: Tensor
    layout: PrefixLayout
    spans: list[list[tuple[int, int]]]


def _token_list(name: str, value, vocab_size: int | None) -> list[int]:
    """The token ids of ``value`` as a list, each in ``[0, vocab_size)`` (``[0, inf)`` without a vocabulary): a
    negative id (an ``ignore_index`` such as -100) would silently score 0, an id past the vocabulary read out of
    bounds."""
    if isinstance(value, Tensor):
        if value.dim() != 1 or value.dtype.is_floating_point or value.dtype == torch.bool:
            raise ValueError(
                f"{name}: expected a 1-D integer tensor of token ids, got {value.dtype} of shape {tuple(value.shape)}"
            )
        ids = [int(t) for t in value.tolist()]
    elif not isinstance(value, Sequence) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise TypeError(f"{name}: expected a 1-D integer tensor or a list of ints, got {type(value).__name__}")
    else:
        ids = list(value)
    for k, token in enumerate(ids):
        if token < 0 or (vocab_size is not None and token >= vocab_size):
            bound = f"[0, {vocab_size})" if vocab_size is not None else ">= 0"
            raise ValueError(f"{name}: token id {token} at position {k} is not a valid token id ({bound})")
    return ids


def group_batch(
    prompts: Sequence,
    responses: Sequence[Sequence],
    *,
    device: torch.device | str = "cpu",
    ignore_index: int = -100,
    vocab_size: int | None = None,
) -> GroupBatch:
    """Pack ``prompts[g]`` and its responses ``responses[g]`` (token ids: 1-D tensors or lists of ints) into one row.

    Every prompt needs at least one token and every response at least one; a group needs at least one response.
    Token ids must be ``>= 0`` and, with ``vocab_size`` given, ``< vocab_size``: else an error naming the prompt or
    response (``prompts[g]``, ``responses[g][j]``), the position and the id.
    """
    if vocab_size is not None:
        vocab_size = checks.integer("vocab_size", vocab_size, minimum=1)
    if isinstance(prompts, Tensor) or not isinstance(prompts, Sequence) or len(prompts) == 0:
        raise ValueError("prompts: expected a non-empty list of prompts (one per group)")
    if not isinstance(responses, Sequence) or len(responses) != len(prompts):
        raise ValueError(
            f"responses: expected one list of responses per prompt ({len(prompts)}), got "
            f"{len(responses) if isinstance(responses, Sequence) else type(responses).__name__}"
        )
    ids: list[int] = []
    positions: list[int] = []
    targets: list[int] = []
    cuts = [0]
    prefix_index: list[int] = []
    spans: list[list[tuple[int, int]]] = []
    for g, (prompt, group) in enumerate(zip(prompts, responses)):
        prompt = _token_list(f"prompts[{g}]", prompt, vocab_size)
        if not prompt:
            raise ValueError(f"prompts[{g}]: empty (a prompt needs at least one token)")
        if isinstance(group, Tensor) or not isinstance(group, Sequence) or len(group) == 0:
            raise ValueError(f"responses[{g}]: expected a non-empty list of responses")
        head = len(prefix_index)
        n = len(prompt) - 1
        ids += prompt[:-1]
        positions += range(n)
        targets += [ignore_index] * n
        cuts.append(cuts[-1] + n)
        prefix_index.append(-1)
        rows = []
        for j, response in enumerate(group):
            response = _token_list(f"responses[{g}][{j}]", response, vocab_size)
            if not response:
                raise ValueError(f"responses[{g}][{j}]: empty (a response needs at least one token)")
            start = len(ids)
            ids += [prompt[-1], *response[:-1]]
            positions += range(n, n + len(response))
            targets += response
            cuts.append(cuts[-1] + len(response))
            prefix_index.append(head)
            rows.append((start, len(ids)))
        spans.append(rows)
    lengths = [b - a for a, b in zip(cuts, cuts[1:])]
    layout = PrefixLayout(
        cu_seqlens=torch.tensor(cuts, dtype=torch.int32, device=device),
        prefix_index=torch.tensor(prefix_index, dtype=torch.int32, device=device),
        max_seqlen=max(lengths),
        total=len(ids),
    )
    row = dict(dtype=torch.int64, device=device)
    return GroupBatch(
        input_ids=torch.tensor([ids], **row),
        position_ids=torch.tensor([positions], **row),
        targets=torch.tensor([targets], **row),
        layout=layout,
        spans=spans,
    )


def _rows(weight: Tensor) -> int:
    """An embedding's rows: a DeepSpeed ZeRO-3 parameter outside its module's forward holds only its partition
    (``ds_shape`` is the full shape); an FSDP2 DTensor's shape is the full one."""
    return int(getattr(weight, "ds_shape", weight.shape)[0])


def group_logprobs(
    model, prompts: Sequence, responses: Sequence[Sequence], *, temperature: float | None = None
) -> list[list[Tensor]]:
    """Per-token log-probs of every response of every group, the prompts computed once: ``out[g][j]`` fp32
    ``[len(responses[g][j])]``, differentiable like the applied model's log-prob path.

    ``model``: a transformers causal LM with rlk's fused head and patched attention (which reads the group layout):
    ``rlk.integrations.hf.apply(model, batch_invariant=True)``, or ``apply(model)`` plus ``rlk.patch_model(model)``
    (cuBLAS matmuls: faster, not batch-invariant). One forward over :func:`group_batch`'s row; ``temperature``
    overrides the applied one for this call. With ``batch_invariant=True`` a response's log-probs are bitwise those
    of ``model(prompt + response, logprob_targets=...)`` alone at its positions. Token ids must lie in
    ``[0, V)``, ``V`` the rows of the model's output (and input) embeddings: else an error naming the prompt or
    response, the position and the id (:func:`group_batch`).
    """
    state = getattr(model, "_rlk_apply", None)
    if state is None or getattr(model, "_rlk_patch", None) is None:
        raise ValueError(
            "model: expected a model after rlk.integrations.hf.apply(model, batch_invariant=True) "
            "(or apply + patch_model): prefix sharing runs in rlk's patched attention"
        )
    attention = getattr(model.config, "_attn_implementation", None)
    if attention != "rlk":
        raise ValueError(
            f"model: its attention implementation is {attention!r}, not rlk's (the layout would be "
            "ignored): leave the one patch_model set"
        )
    head = model.get_output_embeddings().weight
    vocab_size = min(_rows(head), _rows(model.get_input_embeddings().weight))
    batch = group_batch(prompts, responses, device=head.device, ignore_index=state.ignore_index, vocab_size=vocab_size)
    kwargs = {} if temperature is None else {"temperature": temperature}
    out = model(
        input_ids=batch.input_ids,
        position_ids=batch.position_ids,
        logprob_targets=batch.targets,
        use_cache=False,
        **{LAYOUT_KEYWORD: batch.layout},
        **kwargs,
    )
    logprobs = out.logprobs[0]
    return [[logprobs[a:b] for a, b in group] for group in batch.spans]
