"""RMSNorm primitives (spec: :mod:`rlk.reference.norm`): the spec run on fixed blocks of rows; the weight gradient
adds the blocks' fp32 partials in block order."""

from __future__ import annotations

from rlk.core.checks import compute_dtype
from rlk.reference import norm as spec
from rlk_domestic.blocks import Out, Rows, Total, run_rows


def rms_norm_fwd(x, weight, residual, eps, gemma, out, residual_out, rstd_out):
    run_rows(
        spec.rms_norm_fwd,
        x.shape[0],
        Rows(x),
        weight,
        Rows(residual),
        eps,
        gemma,
        Out(out),
        Out(residual_out),
        Out(rstd_out),
    )


def rms_norm_bwd(grad_out, s, weight, rstd, gemma, grad_residual, grad_input_out, grad_weight_out):
    run_rows(
        spec.rms_norm_bwd,
        s.shape[0],
        Rows(grad_out),
        Rows(s),
        weight,
        Rows(rstd),
        gemma,
        Rows(grad_residual),
        Out(grad_input_out),
        Total(grad_weight_out, compute_dtype(s.dtype)),
    )
