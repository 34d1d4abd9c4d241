"""Advantage and return primitives (spec: :mod:`rlk.reference.advantages`).

* ``group_advantages_fwd``: the spec run on one group at a time (its scores alone, in group order), so a group's
  advantages depend on its own scores only; ``gpg`` runs each group as ``dr_grpo`` and then applies the spec's
  call-wide ``alpha = B / max(#{a != 0}, 1)``.
* ``masked_whiten_fwd``: one statistic over the whole call (the contract's ``deterministic`` class): the spec as it
  is.
* ``discounted_returns_fwd``, ``gae_fwd``: the spec as it is: right-to-left recurrences vectorized over rows whose
  steps are single IEEE operations and selects, so a row's results depend on its own values only.
"""

from __future__ import annotations

import torch

from rlk.core.checks import compute_dtype
from rlk.reference import advantages as spec
from rlk.reference.advantages import discounted_returns_fwd, gae_fwd, masked_whiten_fwd

__all__ = ["discounted_returns_fwd", "gae_fwd", "group_advantages_fwd", "masked_whiten_fwd"]


def group_advantages_fwd(scores, group_index, group_size, lengths, mode, eps, out):
    members = spec.dense_groups(group_index, group_size, scores.shape[0], scores.device)
    per_group = "dr_grpo" if mode == "gpg" else mode
    for row in members:
        idx = row[row >= 0]
        part = torch.empty(idx.shape[0], dtype=out.dtype, device=out.device)
        spec.group_advantages_fwd(
            scores[idx].contiguous(),
            None,
            idx.shape[0],
            None if lengths is None else lengths[idx].contiguous(),
            per_group,
            eps,
            part,
        )
        out[idx] = part
    if mode == "gpg":  # the spec's gradient-estimation correction: one factor for the whole call
        cdt = compute_dtype(scores.dtype)
        n_valid = (out != 0).sum()
        alpha = torch.tensor(scores.shape[0], dtype=cdt, device=scores.device) / n_valid.clamp(min=1).to(cdt)
        out.copy_(out * alpha)
