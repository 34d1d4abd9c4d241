"""Global normalizers of the loss ops over data-parallel ranks, micro-batches and sequence (context) shards.

``rlk.policy_loss`` / ``rlk.value_loss`` take ``global_tokens`` and ``global_seqs``: the masked tokens and
the sequences with a masked token of the whole optimizer step. With them each token's gradient depends on
its own row only, so it is bitwise the same whatever the micro-batching, the data-parallel degree or the
context-parallel split (the loss *value* is a sum over ranks: add it with
:func:`rlk.distributed.all_reduce_fixed` for a deterministic total). Counts are integers summed with
``torch.distributed.all_reduce`` in int64, which is exact in any order.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from rlk.distributed.group import Comm, Group


def _masks(mask: Tensor | Sequence[Tensor]) -> list[Tensor]:
    masks = [mask] if isinstance(mask, Tensor) else list(mask)
    if not masks:
        raise ValueError("mask: expected a [B, T] tensor or a non-empty sequence of them (the step's micro-batches)")
    for i, m in enumerate(masks):
        if not isinstance(m, Tensor) or m.dim() != 2:
            what = type(m).__name__ if not isinstance(m, Tensor) else f"shape {tuple(m.shape)}"
            raise ValueError(f"mask[{i}]: expected a [B, T] tensor, got {what}")
        if m.device != masks[0].device:
            raise ValueError(f"mask[{i}]: expected device {masks[0].device} (the device of mask[0]), got {m.device}")
    return masks


def _sum(x: Tensor, group: Group, name: str) -> Tensor:
    comm = Comm(group)
    if comm.simulated:
        raise TypeError(f"{name}: the normalizers need a real process group (or None)")
    if not comm.local:
        dist.all_reduce(x, group=comm.group)
    return x


def sequence_token_counts(mask: Tensor, sequence_group: Group = None) -> Tensor:
    """``n_i``, the masked tokens of each sequence (row) of ``mask`` ``[B, T]``, summed over the ranks of
    ``sequence_group`` that hold the other shards of the same sequences (context parallelism: every rank of it
    holds the same ``B`` rows, each a slice of the tokens). int64 ``[B]``, the same on those ranks."""
    (mask,) = _masks(mask)
    return _sum(mask.sum(dim=1, dtype=torch.int64), sequence_group, "sequence_group")


def global_normalizers(
    mask: Tensor | Sequence[Tensor], *, group: Group = None, sequence_group: Group = None
) -> dict[str, Tensor]:
    """``global_tokens`` and ``global_seqs`` of an optimizer step, for ``rlk.policy_loss(..., **normalizers)``.

    Args:
        mask: this rank's loss mask ``[B, T]``, or the list of its micro-batches' masks for the step.
        group: the data-parallel group (ranks holding different sequences; not the ranks of
            ``sequence_group``, whose tokens it would count twice); None: the default group when
            ``torch.distributed`` is initialized, else this process alone.
        sequence_group: the context-parallel group whose ranks hold slices of the same sequences (None when
            sequences are not split: pass a group of one, or leave None without context parallelism).

    Returns:
        ``{"global_tokens": N_tok, "global_seqs": N_seq}``, fp32 one-element tensors on the mask's device
        (at least 1, so that an empty step gives loss 0, never a division by 0): ``N_tok`` the masked tokens
        over micro-batches, sequence shards and data-parallel ranks; ``N_seq`` the sequences with at least
        one masked token in any of their shards. Identical on every rank.
    """
    masks = _masks(mask)
    tokens = torch.zeros((), dtype=torch.int64, device=masks[0].device)
    seqs = torch.zeros_like(tokens)
    for m in masks:
        per_row = m.sum(dim=1, dtype=torch.int64)
        if sequence_group is not None:
            per_row = _sum(per_row, sequence_group, "sequence_group")
        tokens += per_row.sum()
        seqs += (per_row > 0).sum()
    counts = _sum(torch.stack([tokens, seqs]), group, "group")
    counts = counts.clamp(min=1).to(torch.float32)
    return {"global_tokens": counts[0].clone(), "global_seqs": counts[1].clone()}
