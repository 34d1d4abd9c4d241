"""Distillation primitives (spec: :mod:`rlk.reference.distill`): the spec run on fixed blocks of rows.

Padded rows have zero hidden states (finite, uniform distributions), ignored targets where targets are given and a
zero gradient coefficient, so they add nothing to the weight gradient, whose block partials are added in order.
"""

from __future__ import annotations

from rlk.core.checks import compute_dtype
from rlk.reference import distill as spec
from rlk_domestic.blocks import Out, Rows, Total, run_rows


def fused_linear_kl_fwd(
    student_hidden,
    student_weight,
    teacher_hidden,
    teacher_weight,
    targets,
    inv_temperature,
    ignore_index,
    divergence,
    beta,
    loss_out,
    stats_out,
    grad_coef,
    grad_hidden_out,
    grad_weight_out,
):
    run_rows(
        spec.fused_linear_kl_fwd,
        student_hidden.shape[0],
        Rows(student_hidden),
        student_weight,
        Rows(teacher_hidden),
        teacher_weight,
        Rows(targets, ignore_index),
        Rows(inv_temperature, 1.0),
        ignore_index,
        divergence,
        beta,
        Out(loss_out),
        Out(stats_out, dim=1),
        Rows(grad_coef),
        Out(grad_hidden_out),
        Total(grad_weight_out, compute_dtype(student_hidden.dtype)),
    )


def fused_linear_kl_bwd(
    student_hidden,
    student_weight,
    teacher_hidden,
    teacher_weight,
    targets,
    inv_temperature,
    stats,
    grad_loss,
    ignore_index,
    divergence,
    beta,
    grad_hidden_out,
    grad_weight_out,
):
    run_rows(
        spec.fused_linear_kl_bwd,
        student_hidden.shape[0],
        Rows(student_hidden),
        student_weight,
        Rows(teacher_hidden),
        teacher_weight,
        Rows(targets, ignore_index),
        Rows(inv_temperature, 1.0),
        Rows(stats, dim=1),
        Rows(grad_loss),
        ignore_index,
        divergence,
        beta,
        Out(grad_hidden_out),
        Total(grad_weight_out, compute_dtype(student_hidden.dtype)),
    )
