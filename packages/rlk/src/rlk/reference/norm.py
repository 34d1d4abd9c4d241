"""Reference RMSNorm primitives: the readable specification and ground truth.

Numerics follow Hugging Face's ``LlamaRMSNorm`` / ``Qwen3RMSNorm`` and ``Gemma3RMSNorm``. For one
row ``x`` of ``H`` elements (and, when fused, the residual row ``r``)::

    s    = x + r                        (in x.dtype, as HF's ``residual + hidden_states``; s = x unfused)
    rstd = 1 / sqrt(mean_h s_h^2 + eps)  (fp32; fp64 for fp64 inputs; rows where it overflows or
                                         underflows computed on s scaled by a power of two: rstd_of)
    n    = s * rstd                     (fp32)
    y    = weight * n.to(x.dtype)       (gemma=False: the product of two tensors under torch's type
                                         promotion: computed in fp32, rounded once to the output dtype,
                                         which is x.dtype, or float32 when weight is float32 and x 16-bit)
    y    = (n * (1 + weight.float())).to(x.dtype)   (gemma=True)

``s`` is returned as the new residual; ``rstd`` is saved for the backward. The backward, per row,
with ``w' = weight`` (``1 + weight`` for Gemma) in fp32 and ``g = grad_y`` in fp32::

    g_n        = g * w'
    grad_s     = rstd * (g_n - n * mean_h(g_n * n))  (+ grad_residual, the upstream gradient of s)
    grad_w     = sum over rows of g * m,  m = n.to(x.dtype) (gemma=False: the factor HF's autograd
                 multiplies by), m = n (gemma=True)

``grad_s`` is the gradient of both ``x`` and ``residual``. Math runs in fp32 (fp64 for fp64 inputs,
which is how the contract tests build ground truth), ``ROW_CHUNK`` rows at a time, so memory beyond
inputs and outputs is a few ``[ROW_CHUNK, H]`` tiles and one ``[H]`` accumulator. The reference is
deterministic; it does not promise batch invariance.
"""

from __future__ import annotations

import torch

from rlk.core.checks import compute_dtype

ROW_CHUNK = 1024
#: A row whose ``mean(s^2) + eps`` overflows (inf) or falls below ``RESCALE_BELOW`` has its sum of squares computed
#: again on ``s * c``, ``c = 2^-100`` or ``2^100`` (a power of two: exact), and ``rstd = rsqrt(mean((s c)^2) + eps c^2)
#: c``: ``s^2`` neither overflows (``|s|`` of 1e20 gave ``rstd = 0``, ``y = 0``) nor underflows (``|s|`` of 1e-30 with
#: ``eps = 0`` gave ``rstd = inf``). Every other row keeps the plain formula's bits.
RESCALE_BELOW = 2.0**-100
RESCALE = 2.0**100


def rstd_of(s: torch.Tensor, eps: float) -> torch.Tensor:
    """``rsqrt(mean(s^2) + eps)`` per row of ``s`` ``[R, H]`` (the compute dtype), rescaled where the plain form
    overflows or underflows (:data:`RESCALE_BELOW`)."""
    d = s.square().mean(dim=-1) + eps
    big, small = torch.isinf(d), d < RESCALE_BELOW  # small: eps < 2^-100 too, so eps c^2 < 2^100
    c = torch.where(big, 1.0 / RESCALE, torch.where(small, RESCALE, 1.0)).to(s.dtype)
    rescaled = torch.rsqrt((s * c[:, None]).square().mean(dim=-1) + eps * c * c) * c
    return torch.where(big | small, rescaled, torch.rsqrt(d))


def _normalized(s: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """``n = s * rstd`` in the compute dtype (``rstd`` per row)."""
    return s.to(rstd.dtype) * rstd[:, None]


def rms_norm_fwd(x, weight, residual, eps, gemma, out, residual_out, rstd_out):
    """Fill ``out`` (y), ``residual_out`` (s, when fused) and ``rstd_out`` (the module docstring's math).

    Args:
        x: ``[N, H]`` float. weight: ``[H]``. residual: ``[N, H]`` x.dtype or None.
        eps: added to the mean of squares. gemma: the ``(1 + weight)`` form.
        out: ``[N, H]``, x.dtype (or the promoted dtype described above). residual_out: ``[N, H]`` x.dtype,
        or None (then residual is None). rstd_out: ``[N]`` fp32 (fp64 for fp64 inputs).
    """
    cdt = compute_dtype(x.dtype)
    w = weight.to(cdt)
    w_gemma = 1.0 + w
    for r0 in range(0, x.shape[0], ROW_CHUNK):
        rows = slice(r0, min(x.shape[0], r0 + ROW_CHUNK))
        s = x[rows] if residual is None else x[rows] + residual[rows]  # in x.dtype, as HF
        if residual_out is not None:
            residual_out[rows] = s
        sf = s.to(cdt)
        rstd = rstd_of(sf, eps)
        n = sf * rstd[:, None]
        if gemma:
            y = n * w_gemma
        else:
            y = weight * n.to(x.dtype)  # torch promotion: one rounding of the fp32 product
        out[rows] = y
        rstd_out[rows] = rstd


def rms_norm_bwd(grad_out, s, weight, rstd, gemma, grad_residual, grad_input_out, grad_weight_out):
    """Fill ``grad_input_out`` (the gradient of s) and ``grad_weight_out`` (when not None).

    Args:
        grad_out: ``[N, H]`` gradient of y (y's dtype). s: ``[N, H]`` the normalized input (x, or x + residual).
        weight: ``[H]``. rstd: ``[N]`` from the forward. gemma: as in the forward.
        grad_residual: ``[N, H]`` upstream gradient of the returned residual, or None.
        grad_input_out: ``[N, H]`` x.dtype. grad_weight_out: ``[H]`` weight.dtype, or None.
    """
    cdt = compute_dtype(s.dtype)
    w = weight.to(cdt)
    if gemma:
        w = 1.0 + w
    grad_w = torch.zeros(w.shape, dtype=cdt, device=w.device)
    for r0 in range(0, s.shape[0], ROW_CHUNK):
        rows = slice(r0, min(s.shape[0], r0 + ROW_CHUNK))
        r = rstd[rows].to(cdt)
        n = _normalized(s[rows], r)
        g = grad_out[rows].to(cdt)
        g_n = g * w
        grad_s = r[:, None] * (g_n - n * (g_n * n).mean(dim=-1, keepdim=True))
        if grad_residual is not None:
            grad_s = grad_s + grad_residual[rows].to(cdt)
        grad_input_out[rows] = grad_s
        if grad_weight_out is not None:
            m = n if gemma else n.to(s.dtype).to(cdt)
            grad_w += (g * m).sum(dim=0)
    if grad_weight_out is not None:
        grad_weight_out.copy_(grad_w)
