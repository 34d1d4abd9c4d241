"""Reference matmul primitives: the readable specification and ground truth.

Forward, for ``a`` ``[M, K]``, ``b`` ``[K, N]`` and an optional ``bias`` ``[N]``::

    out[i, j] = round( sum_k a[i, k] * b[k, j]  +  bias[j] )

with one rounding, to the output dtype (``a.dtype``), at the end (the reference's float64 result
goes through torch's cast, which may pass through float32 for 16-bit outputs). Backward, for an output
gradient ``g`` ``[M, N]``::

    grad_a    = g @ b.T        [M, K]
    grad_b    = a.T @ g        [K, N]
    grad_bias = sum_i g[i, :]  [N]

each rounded once to its tensor's dtype.

The reference computes every sum in float64 (the inputs upcast): a product of two float32
(or 16-bit) numbers is exact in float64 and the float64 sum of ``K`` such products is far more
accurate than the output dtype, so the stored value is the exact result rounded once (up to a
float64 error that no output dtype can see). float64 inputs are computed in float64. Work is
chunked (``COL_CHUNK`` columns of ``b`` upcast at a time, ``ROW_CHUNK`` rows of ``a`` per
product), so the extra memory is bounded whatever M, N and K are.

``a`` and ``b`` may be any strided views (row-major, column-major, slices); outputs are written
through their own strides. Deterministic; the reference does not promise batch invariance.
"""

from __future__ import annotations

import torch

ROW_CHUNK = 1024
COL_CHUNK = 1024


def _product(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> None:
    """``out = a @ b (+ bias)`` with float64 sums, rounded once to ``out.dtype``."""
    m, n = a.shape[0], b.shape[1]
    for c0 in range(0, n, COL_CHUNK):
        c1 = min(n, c0 + COL_CHUNK)
        b64 = b[:, c0:c1].to(torch.float64)
        bias64 = None if bias is None else bias[c0:c1].to(torch.float64)
        for r0 in range(0, m, ROW_CHUNK):
            r1 = min(m, r0 + ROW_CHUNK)
            acc = a[r0:r1].to(torch.float64) @ b64
            if bias64 is not None:
                acc += bias64
            out[r0:r1, c0:c1] = acc


def error_scale(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The numerical contract's per-element scale of ``a @ b + bias``: ``(|a| @ |b|) + |bias|`` in float64.

    A sum of products accumulated in fp32 and rounded once to the output dtype is off by at most
    about ``(K * eps_fp32 + eps_out) * scale`` (``eps_out`` the output dtype's unit roundoff), whatever
    cancellation the signs cause; tolerances are ``atol + rtol * scale``. For ``grad_a`` use
    ``error_scale(grad_out, b.T)``, for ``grad_b`` ``error_scale(a.T, grad_out)``.
    """
    scale = torch.empty((a.shape[0], b.shape[1]), dtype=torch.float64, device=a.device)
    _product(a.abs(), b.abs(), None if bias is None else bias.abs(), scale)
    return scale


def matmul_fwd(a, b, bias, out):
    """``out = a @ b + bias`` (bias optional), float64 sums, one rounding to ``out.dtype``.

    Args:
        a: ``[M, K]`` float (any strides).
        b: ``[K, N]``, ``a.dtype`` (any strides; ``linear`` passes ``weight.t()``).
        bias: ``[N]``, ``a.dtype``, or None.
        out: ``[M, N]``, ``a.dtype``, written.
    """
    _product(a, b, bias, out)


def matmul_bwd(grad_out, a, b, grad_a_out, grad_b_out, grad_bias_out):
    """Gradients of ``sum(grad_out * (a @ b + bias))``; a None output is not computed.

    Args:
        grad_out: ``[M, N]``, ``a.dtype``.
        a, b: the forward's inputs.
        grad_a_out: ``[M, K]`` or None, written ``grad_out @ b.T``.
        grad_b_out: ``[K, N]`` or None, written ``a.T @ grad_out``.
        grad_bias_out: ``[N]`` or None, written ``grad_out.sum(0)``.
    """
    if grad_a_out is not None:
        _product(grad_out, b.T, None, grad_a_out)
    if grad_b_out is not None:
        _product(a.T, grad_out, None, grad_b_out)
    if grad_bias_out is not None:
        acc = torch.zeros(grad_out.shape[1], dtype=torch.float64, device=grad_out.device)
        for r0 in range(0, grad_out.shape[0], ROW_CHUNK):
            acc += grad_out[r0:r0 + ROW_CHUNK].to(torch.float64).sum(dim=0)
        grad_bias_out.copy_(acc)
