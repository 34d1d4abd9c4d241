"""Policy-loss and KL primitives (spec: :mod:`rlk.reference.policy_loss`).

``policy_loss_fwd``: the row weights ``c`` are the spec's (:func:`rlk.reference.aggregation.row_weights` over the
call: with global normalizers a row's own). The per-token objective runs on fixed blocks of rows as the spec's
``token-sum`` form (``c = 1``); each row's gradient and loss partial are then multiplied by its ``c``, as the spec
does. The scalar loss adds the rows' partials in fixed blocks in order; the metrics are the spec's over the rows'
partials. ``kl_penalty_fwd`` runs on fixed blocks of elements; the backwards are single products (the spec).
"""

from __future__ import annotations

import torch

from rlk.core.checks import compute_dtype
from rlk.reference import aggregation
from rlk.reference import policy_loss as spec
from rlk.reference.policy_loss import kl_penalty_bwd, policy_loss_bwd
from rlk_domestic.blocks import Out, Rows, ordered_sum, run_elements, run_rows

__all__ = ["kl_penalty_bwd", "kl_penalty_fwd", "policy_loss_bwd", "policy_loss_fwd"]


def policy_loss_fwd(
    logprob,
    old_logprob,
    advantages,
    mask,
    importance_weights,
    ref_logprob,
    entropy,
    global_tokens,
    global_seqs,
    loss_scale,
    loss_out,
    grad_logprob_out,
    grad_entropy_out,
    row_weight_out,
    row_stats_out,
    metrics_out,
    *,
    agg,
    **attrs,
):
    cdt = compute_dtype(logprob.dtype)
    c = aggregation.row_weights(
        mask, agg, global_tokens=global_tokens, global_seqs=global_seqs, loss_scale=loss_scale, dtype=cdt
    )
    row_weight_out.copy_(c)

    def block(lp, old, adv, m, iw, ref, ent, grad, grad_ent, stats):
        spec.policy_loss_fwd(
            lp,
            old,
            adv,
            m,
            iw,
            ref,
            ent,
            None,
            None,
            None,
            torch.empty((), dtype=cdt, device=lp.device),
            grad,
            grad_ent,
            torch.empty(m.shape[0], dtype=cdt, device=lp.device),
            stats,
            torch.empty_like(metrics_out),
            agg="token-sum",
            **attrs,
        )

    run_rows(
        block,
        mask.shape[0],
        Rows(logprob),
        Rows(old_logprob),
        Rows(advantages),
        Rows(mask, False),
        Rows(importance_weights),
        Rows(ref_logprob),
        Rows(entropy),
        Out(grad_logprob_out),
        Out(grad_entropy_out),
        Out(row_stats_out),
    )
    grad_logprob_out.mul_(c[:, None])
    if grad_entropy_out is not None:
        grad_entropy_out.mul_(c[:, None])
    row_stats_out[:, 0].mul_(c)
    loss_out.copy_(ordered_sum(row_stats_out[:, 0]))
    metrics_out.copy_(spec._metrics(row_stats_out))


def kl_penalty_fwd(
    logprob, ref_logprob, old_logprob, kl_out, coef_out, *, estimator, straight_through, k3_clamp, clamp
):
    def block(lp, ref, old, kl, coef):
        spec.kl_penalty_fwd(
            lp,
            ref,
            old,
            kl,
            coef,
            estimator=estimator,
            straight_through=straight_through,
            k3_clamp=k3_clamp,
            clamp=clamp,
        )

    run_elements(
        block, logprob.shape[0], Rows(logprob), Rows(ref_logprob), Rows(old_logprob), Out(kl_out), Out(coef_out)
    )
