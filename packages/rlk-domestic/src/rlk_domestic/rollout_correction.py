"""Rollout-correction primitive (spec: :mod:`rlk.reference.rollout_correction`): the weights run on fixed blocks of
rows (a row's sequence-level log-ratio is its own sum over time); the metrics, which span the call, are the spec's
over the whole call (deterministic)."""

from __future__ import annotations

import torch

from rlk.reference import rollout_correction as spec
from rlk_domestic.blocks import Out, Rows, run_rows


def rollout_correction_fwd(
    old_logprob, rollout_logprob, mask, weights_out, metrics_out, *, level, mode, upper, lower, clamp
):
    attrs = {"level": level, "mode": mode, "upper": upper, "lower": lower, "clamp": clamp}
    spec.rollout_correction_fwd(old_logprob, rollout_logprob, mask, torch.empty_like(weights_out), metrics_out, **attrs)

    def block(old, roll, m, weights):
        spec.rollout_correction_fwd(old, roll, m, weights, torch.empty_like(metrics_out), **attrs)

    run_rows(block, mask.shape[0], Rows(old_logprob), Rows(rollout_logprob), Rows(mask, False), Out(weights_out))
