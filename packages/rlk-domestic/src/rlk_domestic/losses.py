"""Value-loss and DPO primitives (spec: :mod:`rlk.reference.losses`).

The call-wide outputs (the scalar losses and the metrics) are the spec's, computed once over the whole call
(deterministic). The per-token and per-pair outputs are batch-invariant: the value-loss gradient is single IEEE
operations per token (the spec as it is); DPO's per-pair losses and gradients (logsigmoid, sigmoid) are computed on
fixed blocks of :data:`~rlk_domestic.blocks.ELEMENTS` pairs.
"""

from __future__ import annotations

import torch

from rlk.reference import losses as spec
from rlk.reference.losses import value_loss_bwd, value_loss_fwd
from rlk_domestic.blocks import Out, Rows, run_elements

__all__ = ["dpo_loss_bwd", "dpo_loss_fwd", "value_loss_bwd", "value_loss_fwd"]


def dpo_loss_fwd(
    chosen,
    rejected,
    ref_chosen,
    ref_rejected,
    len_chosen,
    len_rejected,
    beta,
    loss_type,
    label_smoothing,
    mean,
    losses_out,
    loss_out,
    metrics_out,
):
    call_wide = torch.empty_like(losses_out)
    spec.dpo_loss_fwd(
        chosen,
        rejected,
        ref_chosen,
        ref_rejected,
        len_chosen,
        len_rejected,
        beta,
        loss_type,
        label_smoothing,
        mean,
        call_wide,
        loss_out,
        metrics_out,
    )
    scratch = torch.empty((), dtype=loss_out.dtype, device=loss_out.device)

    def block(c, r, rc, rr, lc, lr, losses):
        spec.dpo_loss_fwd(
            c,
            r,
            rc,
            rr,
            lc,
            lr,
            beta,
            loss_type,
            label_smoothing,
            mean,
            losses,
            scratch.clone(),
            torch.empty_like(metrics_out),
        )

    run_elements(
        block,
        chosen.shape[0],
        Rows(chosen),
        Rows(rejected),
        Rows(ref_chosen),
        Rows(ref_rejected),
        Rows(len_chosen, 1.0),
        Rows(len_rejected, 1.0),
        Out(losses_out),
    )


def dpo_loss_bwd(
    chosen,
    rejected,
    ref_chosen,
    ref_rejected,
    len_chosen,
    len_rejected,
    beta,
    loss_type,
    label_smoothing,
    mean,
    grad_losses,
    grad_loss,
    grad_chosen_out,
    grad_rejected_out,
):
    # the upstream gradient of the mean reaches every pair divided by the call's P, as in the spec
    shared = None if grad_loss is None else (grad_loss / chosen.shape[0] if mean else grad_loss)

    def block(c, r, rc, rr, lc, lr, g_losses, g_chosen, g_rejected):
        spec.dpo_loss_bwd(
            c, r, rc, rr, lc, lr, beta, loss_type, label_smoothing, False, g_losses, shared, g_chosen, g_rejected
        )

    run_elements(
        block,
        chosen.shape[0],
        Rows(chosen),
        Rows(rejected),
        Rows(ref_chosen),
        Rows(ref_rejected),
        Rows(len_chosen, 1.0),
        Rows(len_rejected, 1.0),
        Rows(grad_losses),
        Out(grad_chosen_out),
        Out(grad_rejected_out),
    )
