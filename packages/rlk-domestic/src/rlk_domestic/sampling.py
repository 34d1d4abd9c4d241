"""Sampling primitive (spec: :mod:`rlk.reference.sampling`): the spec run on fixed blocks of rows (a row's noise is
keyed by its own seed and step, so a block computes each row as the whole batch would)."""

from __future__ import annotations

from rlk.reference import sampling as spec
from rlk_domestic.blocks import Out, Rows, run_rows


def sample_fwd(logits, seed, step, inv_temperature, top_k, top_p, min_p, greedy, tokens_out, logprob_out):
    run_rows(
        spec.sample_fwd,
        logits.shape[0],
        Rows(logits),
        Rows(seed),
        Rows(step),
        inv_temperature,
        top_k,
        top_p,
        min_p,
        greedy,
        Out(tokens_out),
        Out(logprob_out),
    )
