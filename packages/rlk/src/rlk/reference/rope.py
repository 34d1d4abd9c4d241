"""Reference rotary position embedding (rope) primitives: the readable specification.

A rotation acts on pairs of the first ``R`` features of every head (``R = cos.shape[-1]``, the
rotary dim, even, ``R <= D``); features ``R..D-1`` pass through unchanged (partial rotary). The
pair of feature ``a`` is feature ``b``:

* rotate-half (``interleaved=False``, Hugging Face / Llama / Qwen): ``a = i``, ``b = i + R/2``
  for ``i < R/2``;
* interleaved (``interleaved=True``, GPT-J / GPT-NeoX-interleaved): ``a = 2i``, ``b = 2i + 1``.

With ``c = cos[t]`` and ``s = sin[t]`` (shape ``[R]``, one per token ``t``, shared by every head)::

    out[a] = x[a] * c[a] - x[b] * s[a]
    out[b] = x[b] * c[b] + x[a] * s[b]

which is Hugging Face's ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``
(interleaved: ``rotate_every_two(x) = stack(-x[1::2], x[0::2])`` interleaved back). The usual
tables hold each angle twice (``c[a] == c[b]``, ``s[a] == s[b]``); the formulas do not assume it.

The backward is the transpose of that linear map (cos and sin get no gradient)::

    grad_x[a] = g[a] * c[a] + g[b] * s[b]
    grad_x[b] = g[b] * c[b] - g[a] * s[a]

which, for the usual tables, is the inverse rotation (the forward with ``sin`` negated).

Math is fp32 (fp64 for fp64 inputs) from ``x``, ``cos`` and ``sin`` as given, rounded once to
the output dtype. The reference is elementwise, so it is trivially batch-invariant.
"""

from __future__ import annotations

import torch

from rlk.core.checks import compute_dtype


def _pair_slices(rotary_dim: int, interleaved: bool) -> tuple[slice, slice]:
    """Feature indices of the first (``a``) and second (``b``) member of every rotated pair."""
    if interleaved:
        return slice(0, rotary_dim, 2), slice(1, rotary_dim, 2)
    half = rotary_dim // 2
    return slice(0, half), slice(half, rotary_dim)


def _rotate(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, transpose: bool, out: torch.Tensor
) -> None:
    rotary_dim = cos.shape[-1]
    a, b = _pair_slices(rotary_dim, interleaved)
    cdt = compute_dtype(x.dtype)
    xa, xb = x[..., a].to(cdt), x[..., b].to(cdt)
    ca, cb = cos[:, None, a].to(cdt), cos[:, None, b].to(cdt)  # [T, 1, R/2], broadcast over heads
    sa, sb = sin[:, None, a].to(cdt), sin[:, None, b].to(cdt)
    if transpose:
        out[..., a] = xa * ca + xb * sb
        out[..., b] = xb * cb - xa * sa
    else:
        out[..., a] = xa * ca - xb * sa
        out[..., b] = xb * cb + xa * sb
    out[..., rotary_dim:] = x[..., rotary_dim:]


def rope_fwd(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, out: torch.Tensor) -> None:
    """Rotate ``x`` by the per-token angles (module docstring).

    Args:
        x: ``[T, H, D]`` float.
        cos, sin: ``[T, R]`` fp32 or ``x.dtype``; ``R`` even, ``R <= D``.
        interleaved: pair layout (module docstring).
        out: ``[T, H, D]`` ``x.dtype``, written.
    """
    _rotate(x, cos, sin, interleaved, False, out)


def rope_bwd(
    grad_out: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool, grad_x_out: torch.Tensor
) -> None:
    """Gradient of :func:`rope_fwd` w.r.t. ``x``: the transpose rotation of ``grad_out`` (module docstring).

    Args:
        grad_out: ``[T, H, D]`` float.
        cos, sin: as in the forward.
        interleaved: as in the forward.
        grad_x_out: ``[T, H, D]`` ``grad_out.dtype``, written.
    """
    _rotate(grad_out, cos, sin, interleaved, True, grad_x_out)


def error_scale(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """The numerical contract's per-element scale of :func:`rope_fwd`, in float64.

    ``|x[a] cos[a]| + |x[b] sin[a]|`` (and the mirror for ``b``): the sizes of the two products a
    rotated feature adds; ``|x|`` on the features past the rotary dim. ``x`` ``[T, H, D]``, ``cos`` and
    ``sin`` ``[T, R]``.
    """
    scale = torch.empty(x.shape, dtype=torch.float64, device=x.device)
    x, cos, sin = x.double().abs(), cos.double().abs(), sin.double().abs()
    a, b = _pair_slices(cos.shape[-1], interleaved)
    ca, cb, sa, sb = cos[:, None, a], cos[:, None, b], sin[:, None, a], sin[:, None, b]
    scale[..., a] = x[..., a] * ca + x[..., b] * sa
    scale[..., b] = x[..., b] * cb + x[..., a] * sb
    scale[..., cos.shape[-1] :] = x[..., cos.shape[-1] :]
    return scale
