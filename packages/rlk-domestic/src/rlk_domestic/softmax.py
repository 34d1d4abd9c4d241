"""Softmax primitives (spec: :mod:`rlk.reference.softmax`): the spec run on fixed blocks of rows."""

from __future__ import annotations

from rlk.reference import softmax as spec
from rlk_domestic.blocks import Out, Rows, run_rows


def softmax_fwd(x, log, out):
    run_rows(spec.softmax_fwd, x.shape[0], Rows(x), log, Out(out))


def softmax_bwd(grad_out, out, log, grad_x_out):
    run_rows(spec.softmax_bwd, out.shape[0], Rows(grad_out), Rows(out), log, Out(grad_x_out))
