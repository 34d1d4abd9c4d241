"""Reference softmax primitives: the readable specification and ground truth.

Over the last dim of ``x [N, V]``, per row, with ``m = max_v x_v`` and
``s = sum_v exp(x_v - m)``::

    softmax(x)_v     = exp(x_v - m) / s
    log_softmax(x)_v = (x_v - m) - log(s)

Backward, with ``y`` the forward's output and ``g`` the gradient of ``y``::

    log_softmax:  grad_x = g - exp(y) * sum_v g_v
    softmax:      grad_x = y * (g - sum_v g_v * y_v)

Math runs in fp32 (fp64 for fp64 inputs, which is how the contract builds ground
truth) with one rounding to the output dtype. A row whose entries are all
``-inf`` (or that holds ``+inf`` or NaN) gives NaN, as ``torch.softmax`` does.
Work is chunked over rows, so memory beyond inputs and outputs is one
``[ROW_CHUNK, V]`` fp32 tile. The reference is deterministic; it does not promise
batch invariance.
"""

from __future__ import annotations

import torch

from rlk.core.checks import compute_dtype

ROW_CHUNK = 256


def softmax_fwd(x, log, out):
    """``out = log_softmax(x)`` if ``log`` else ``softmax(x)``, over the last dim of ``x [N, V]``."""
    cdt = compute_dtype(x.dtype)
    for r0 in range(0, x.shape[0], ROW_CHUNK):
        z = x[r0 : r0 + ROW_CHUNK].to(cdt)
        shifted = z - z.amax(dim=1, keepdim=True)
        s = torch.exp(shifted).sum(dim=1, keepdim=True)
        y = shifted - torch.log(s) if log else torch.exp(shifted) / s
        out[r0 : r0 + ROW_CHUNK] = y.to(out.dtype)


def softmax_bwd(grad_out, out, log, grad_x_out):
    """Gradient of ``sum(grad_out * y)`` w.r.t. ``x``, from the forward's output ``y = out``."""
    cdt = compute_dtype(out.dtype)
    for r0 in range(0, out.shape[0], ROW_CHUNK):
        g = grad_out[r0 : r0 + ROW_CHUNK].to(cdt)
        y = out[r0 : r0 + ROW_CHUNK].to(cdt)
        if log:
            grad = g - torch.exp(y) * g.sum(dim=1, keepdim=True)
        else:
            grad = y * (g - (g * y).sum(dim=1, keepdim=True))
        grad_x_out[r0 : r0 + ROW_CHUNK] = grad.to(grad_x_out.dtype)
