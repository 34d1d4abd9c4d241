"""Matmul primitives (the math of :mod:`rlk.reference.matmul`, one rounding per output) with fp32 accumulation:
the spec's float64 sums are not available on these devices' matrix units. Row blocks of fixed shape, ``K`` in
fixed chunks added in order (:func:`rlk_domestic.blocks.matmul_rows`); ``grad_b`` and ``grad_bias``, sums over
rows, add fixed row blocks' partials in block order."""

from __future__ import annotations

from rlk.core.checks import compute_dtype
from rlk_domestic.blocks import matmul_rows, ordered_sum, sum_over_rows


def matmul_fwd(a, b, bias, out):
    matmul_rows(a, b, bias, out)


def matmul_bwd(grad_out, a, b, grad_a_out, grad_b_out, grad_bias_out):
    if grad_a_out is not None:
        matmul_rows(grad_out, b.T, None, grad_a_out)
    if grad_b_out is not None:
        sum_over_rows(a, grad_out, grad_b_out)
    if grad_bias_out is not None:
        grad_bias_out.copy_(ordered_sum(grad_out.to(compute_dtype(grad_out.dtype))))
