"""Public rotary position embedding: ``apply_rope``, a drop-in for Hugging Face's ``apply_rotary_pos_emb``.

One ``torch.library.custom_op`` pair (``rlk::rope_fwd``, ``rlk::rope_bwd``) with fake
implementations, so the op traces under ``torch.compile(fullgraph=True)``, and one
``register_autograd`` calling the backward primitive on the backend that served the forward.
The primitives work on the packed layout ``x[T, H, D]`` with per-token tables ``cos, sin[T, R]``;
``apply_rope`` maps the other layouts onto it. The math is specified in ``rlk.reference.rope``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlk.core import checks, custom_op
from rlk.core.checks import check_float

# ---------------------------------------------------------------------------
# custom ops: one tensor [T, H, D] at a time
# ---------------------------------------------------------------------------


rope_op = custom_op.declare("rope")


@rope_op.forward(outputs=lambda x, cos, sin, interleaved: torch.empty_like(x))
def _rope_fwd(primitive, out, x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    if out.numel():
        primitive(x, cos, sin, interleaved, out)


@rope_op.backward_primitive(outputs=lambda grad_out, cos, sin, interleaved: torch.empty_like(grad_out))
def _rope_bwd(primitive, out, grad_out: Tensor, cos: Tensor, sin: Tensor, interleaved: bool) -> Tensor:
    if out.numel():
        primitive(grad_out, cos, sin, interleaved, out)


def _save(ctx, inputs, output):
    ctx.save_for_backward(inputs.cos, inputs.sin)
    ctx.interleaved = inputs.interleaved
    ctx.dtype = inputs.x.dtype


def _backward(ctx, grad_out):
    cos, sin = ctx.saved_tensors
    return {"x": rope_op.backward(ctx, grad_out.to(ctx.dtype).contiguous(), cos, sin, ctx.interleaved)}


rope_op.autograd(save=_save, backward=_backward)


# ---------------------------------------------------------------------------
# argument checks and layouts
# ---------------------------------------------------------------------------


def _check_tables(q: Tensor, cos: Tensor, sin: Tensor) -> int:
    """Dtype, device and rotary dim of ``cos``/``sin``; returns the rotary dim ``R``."""
    check_float("cos", cos)
    check_float("sin", sin)
    if cos.dtype not in (torch.float32, q.dtype):
        raise TypeError(f"cos: expected dtype float32 or the dtype of q ({q.dtype}), got {cos.dtype}")
    if sin.dtype != cos.dtype:
        raise TypeError(f"sin: expected the dtype of cos ({cos.dtype}), got {sin.dtype}")
    if sin.shape != cos.shape:
        raise ValueError(f"sin: expected the shape of cos {tuple(cos.shape)}, got {tuple(sin.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.device != q.device:
            raise ValueError(f"{name}: expected device {q.device} (the device of q), got {t.device}")
    head_dim = q.shape[-1]
    rotary_dim = cos.shape[-1] if cos.dim() > 0 else 0
    if rotary_dim == 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(
            f"cos: the last dim is the rotary dim R, which must be even, >= 2 and <= the head dim "
            f"D = {head_dim}; got R = {rotary_dim}"
        )
    return rotary_dim


def _packed_tables(cos: Tensor, sin: Tensor, batch: int, seq: int) -> tuple[Tensor, Tensor]:
    """``cos``/``sin`` of shape ``[S, R]`` or ``[B or 1, S, R]`` as contiguous ``[B * S, R]``."""
    rotary_dim = cos.shape[-1]
    ok = (cos.dim() == 2 and cos.shape[0] == seq) or (
        cos.dim() == 3 and cos.shape[0] in (1, batch) and cos.shape[1] == seq
    )
    if not ok:
        raise ValueError(f"cos: expected shape [S, R] or [B, S, R] with B = {batch}, S = {seq}, got {tuple(cos.shape)}")
    expand = (batch, seq, rotary_dim)
    return (t.expand(expand).reshape(batch * seq, rotary_dim).contiguous() for t in (cos, sin))


def apply_rope(
    q: Tensor,
    k: Tensor,
    cos: Tensor,
    sin: Tensor,
    *,
    interleaved: bool = False,
    unsqueeze_dim: int = 1,
) -> tuple[Tensor, Tensor]:
    """Rotary position embedding of queries and keys; a drop-in for Hugging Face's
    ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)``.

    ``out = x * cos + rotate_half(x) * sin`` on the first ``R = cos.shape[-1]`` features of every
    head (``rotate_half(x) = cat(-x2, x1)`` over the halves of those ``R`` features); features
    ``R..D-1`` pass through unchanged (partial rotary).

    Layouts (``cos`` and ``sin`` have the same shape):

    * ``unsqueeze_dim=1``: q ``[B, Hq, S, D]``, k ``[B, Hk, S, D]``; cos ``[B, S, R]``, ``[1, S, R]``
      or ``[S, R]``. Costs a transposing copy of q and k in and of the results out.
    * ``unsqueeze_dim=2``: q ``[B, S, Hq, D]``, k ``[B, S, Hk, D]``; cos as above. No copy.
    * packed (varlen): q ``[T, Hq, D]``, k ``[T, Hk, D]``, cos ``[T, R]`` (``unsqueeze_dim=1``,
      the default, as in Hugging Face's broadcasting). No copy.

    ``interleaved=False`` is the Hugging Face / Llama layout: feature ``i`` pairs with ``i + R/2``
    and cos/sin hold each angle twice, ``cos[..., i] = cos[..., i + R/2] = cos(pos * theta_i)``
    (Hugging Face's ``cat(freqs, freqs)``). ``interleaved=True`` is the GPT-J layout: feature
    ``2i`` pairs with ``2i + 1`` and cos/sin hold each angle twice side by side,
    ``cos[..., 2i] = cos[..., 2i + 1] = cos(pos * theta_i)`` (``freqs.repeat_interleave(2, -1)``);
    then ``out[2i] = x[2i] cos - x[2i+1] sin``, ``out[2i+1] = x[2i+1] cos + x[2i] sin``.
    Both use, per element, the cos/sin entry at that element's own index, exactly as
    ``x * cos + rotate(x) * sin`` does (see ``rlk.reference.rope``).

    Args:
        q, k: bfloat16, float16 or float32 (float64: reference runs), same dtype, any strides.
        cos, sin: float32 or the dtype of q; not differentiable (they come from position ids).
        interleaved: the pair layout (above).
        unsqueeze_dim: 1 or 2, the head dim of 4-d q and k (as in Hugging Face).

    Returns:
        ``(q_embed, k_embed)``, contiguous, with the shapes and dtype of q and k; differentiable
        w.r.t. q and k (the gradient is the transposed rotation; cos and sin get none).

    Numerics: each output is computed in fp32 from x, cos and sin and rounded once to the dtype of
    x. Hugging Face's formula in bf16/fp16 rounds ``x * cos``, ``rotate_half(x) * sin`` and their
    sum separately, so it can differ from rlk by an ulp or two of those products; rlk's result is
    the more accurate one. Elementwise, so batch-invariant (bitwise) on every backend.
    """
    check_float("q", q)
    check_float("k", k)
    if k.dtype != q.dtype:
        raise TypeError(f"k: expected the dtype of q ({q.dtype}), got {k.dtype}")
    if k.device != q.device:
        raise ValueError(f"k: expected device {q.device} (the device of q), got {k.device}")
    if q.dim() not in (3, 4):
        raise ValueError(f"q: expected shape [B, H, S, D], [B, S, H, D] or packed [T, H, D], got {tuple(q.shape)}")
    if k.dim() != q.dim() or k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k: expected {q.dim()} dims and head dim D = {q.shape[-1]} like q, got {tuple(k.shape)}")
    if unsqueeze_dim not in (1, 2) or (q.dim() == 3 and unsqueeze_dim != 1):
        raise ValueError(f"unsqueeze_dim: expected 1 or 2 for 4-d q and k, 1 for packed [T, H, D]; got {unsqueeze_dim}")
    _check_tables(q, cos, sin)
    interleaved = checks.flag("interleaved", interleaved)

    if q.dim() == 3:
        if k.shape[0] != q.shape[0]:
            raise ValueError(f"k: expected {q.shape[0]} tokens like q, got shape {tuple(k.shape)}")
        if cos.dim() != 2 or cos.shape[0] != q.shape[0]:
            raise ValueError(f"cos: expected shape [T, R] with T = {q.shape[0]} for packed q, got {tuple(cos.shape)}")
        cos_p, sin_p = cos.contiguous(), sin.contiguous()
        return tuple(_rope_fwd(x.contiguous(), cos_p, sin_p, interleaved) for x in (q, k))

    seq_dim = 3 - unsqueeze_dim  # the other of dims 1 and 2
    batch, seq = q.shape[0], q.shape[seq_dim]
    if k.shape[0] != batch or k.shape[seq_dim] != seq:
        raise ValueError(
            f"k: expected batch {batch} and sequence length {seq} (dims 0 and {seq_dim}) like q, "
            f"got shape {tuple(k.shape)}"
        )
    cos_p, sin_p = _packed_tables(cos, sin, batch, seq)
    outputs = []
    for x in (q, k):
        x_bshd = x if unsqueeze_dim == 2 else x.transpose(1, 2)
        heads, head_dim = x_bshd.shape[2], x_bshd.shape[3]
        packed = x_bshd.reshape(batch * seq, heads, head_dim).contiguous()
        out = _rope_fwd(packed, cos_p, sin_p, interleaved).view(batch, seq, heads, head_dim)
        outputs.append(out if unsqueeze_dim == 2 else out.transpose(1, 2).contiguous())
    return outputs[0], outputs[1]
