"""Log-prob primitives (spec: :mod:`rlk.reference.logprob`): the spec run on fixed blocks of rows.

Padded rows carry ``ignore_index`` targets (log-prob, entropy and gradients 0); the weight gradient adds the blocks'
fp32 partials in block order. A row's vocab reduction is the spec's: ``VOCAB_CHUNK`` tiles merged in order.
"""

from __future__ import annotations

from rlk.core.checks import compute_dtype
from rlk.reference import logprob as spec
from rlk_domestic.blocks import Out, Rows, Total, run_rows


def selected_logprob_fwd(logits, targets, inv_temperature, ignore_index, logprob_out, entropy_out, lse_out):
    run_rows(
        spec.selected_logprob_fwd,
        logits.shape[0],
        Rows(logits),
        Rows(targets, ignore_index),
        Rows(inv_temperature, 1.0),
        ignore_index,
        Out(logprob_out),
        Out(entropy_out),
        Out(lse_out),
    )


def selected_logprob_bwd(
    logits, targets, inv_temperature, lse, entropy, grad_logprob, grad_entropy, ignore_index, grad_logits_out
):
    run_rows(
        spec.selected_logprob_bwd,
        logits.shape[0],
        Rows(logits),
        Rows(targets, ignore_index),
        Rows(inv_temperature, 1.0),
        Rows(lse),
        Rows(entropy),
        Rows(grad_logprob),
        Rows(grad_entropy),
        ignore_index,
        Out(grad_logits_out),
    )


def linear_logprob_fwd(hidden, weight, targets, inv_temperature, ignore_index, logprob_out, entropy_out, lse_out):
    run_rows(
        spec.linear_logprob_fwd,
        hidden.shape[0],
        Rows(hidden),
        weight,
        Rows(targets, ignore_index),
        Rows(inv_temperature, 1.0),
        ignore_index,
        Out(logprob_out),
        Out(entropy_out),
        Out(lse_out),
    )


def linear_logprob_bwd(
    hidden,
    weight,
    targets,
    inv_temperature,
    lse,
    entropy,
    grad_logprob,
    grad_entropy,
    ignore_index,
    grad_hidden_out,
    grad_weight_out,
):
    run_rows(
        spec.linear_logprob_bwd,
        hidden.shape[0],
        Rows(hidden),
        weight,
        Rows(targets, ignore_index),
        Rows(inv_temperature, 1.0),
        Rows(lse),
        Rows(entropy),
        Rows(grad_logprob),
        Rows(grad_entropy),
        ignore_index,
        Out(grad_hidden_out),
        Total(grad_weight_out, compute_dtype(hidden.dtype)),
    )


def linear_logprob_stored_fwd(
    hidden, weight, targets, inv_temperature, ignore_index, logprob_out, entropy_out, lse_out, logits_out
):
    run_rows(
        spec.linear_logprob_stored_fwd,
        hidden.shape[0],
        Rows(hidden),
        weight,
        Rows(targets, ignore_index),
        Rows(inv_temperature, 1.0),
        ignore_index,
        Out(logprob_out),
        Out(entropy_out),
        Out(lse_out),
        Out(logits_out),
    )


def linear_logprob_stored_bwd(
    hidden,
    weight,
    targets,
    inv_temperature,
    lse,
    entropy,
    grad_logprob,
    grad_entropy,
    ignore_index,
    logits,
    grad_hidden_out,
    grad_weight_out,
    accumulate,
):
    run_rows(
        spec.linear_logprob_stored_bwd,
        hidden.shape[0],
        Rows(hidden),
        weight,
        Rows(targets, ignore_index),
        Rows(inv_temperature, 1.0),
        Rows(lse),
        Rows(entropy),
        Rows(grad_logprob),
        Rows(grad_entropy),
        ignore_index,
        Rows(logits),
        Out(grad_hidden_out),
        Total(grad_weight_out, compute_dtype(hidden.dtype), accumulate=accumulate),
        False,
    )
