"""Reward-to-token primitive (spec: :mod:`rlk.reference.rewards`): the spec with the group normalization run one group
at a time (:func:`rlk_domestic.advantages.group_advantages_fwd`). Its other steps read one row or one region each
(element-wise arithmetic, exact integer counts and maxima), so a sequence's tokens depend on its group only."""

from __future__ import annotations

from rlk.reference import rewards as spec
from rlk_domestic import advantages


def scatter_rewards_fwd(*args):
    spec.scatter(advantages.group_advantages_fwd, *args)
