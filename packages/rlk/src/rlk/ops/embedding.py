"""Public embedding lookup: ``embedding``, like ``torch.nn.functional.embedding`` with a deterministic,
batch-invariant weight gradient.

One ``torch.library.custom_op`` pair (``rlk::embedding_fwd``, ``rlk::embedding_bwd``) with fake
implementations, so the op traces under ``torch.compile(fullgraph=True)``, and one
``register_autograd`` calling the backward primitive on the backend that served the forward.
The math is specified in ``rlk.reference.embedding``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlk.core import checks, custom_op
from rlk.core.checks import INPUT_DTYPES, values_checked

_ID_DTYPES = (torch.int32, torch.int64)


def _check_values(ids: Tensor, vocab: int) -> None:
    """ids in ``[0, V)``; runs inside the custom op (one host synchronization per forward).

    ``RLK_CHECK_VALUES=0`` skips it (for CUDA graph capture, or once a pipeline is known to be
    clean): an id outside ``[0, V)`` then reads (forward) or writes (backward) out of bounds.
    """
    if not values_checked():
        return
    bad = (ids < 0) | (ids >= vocab)
    if bool(bad.any()):
        i = int(bad.nonzero()[0, 0])
        raise ValueError(f"ids: values must lie in [0, {vocab}); found {int(ids[i])} at flat position {i}")


# ---------------------------------------------------------------------------
# custom ops
# ---------------------------------------------------------------------------


embedding_op = custom_op.declare("embedding")


@embedding_op.forward(outputs=lambda weight, ids, padding_idx: weight.new_empty((ids.shape[0], weight.shape[1])))
def _embedding_fwd(primitive, out, weight: Tensor, ids: Tensor, padding_idx: int) -> Tensor:
    """The gather; ``padding_idx`` (-1: none) is only carried to the backward."""
    if ids.numel() == 0:
        return
    _check_values(ids, weight.shape[0])
    if out.numel():
        primitive(weight, ids, out)


@embedding_op.backward_primitive(
    outputs=lambda grad_out, ids, padding_idx, vocab: grad_out.new_empty((vocab, grad_out.shape[1]))
)
def _embedding_bwd(primitive, out, grad_out: Tensor, ids: Tensor, padding_idx: int, vocab: int) -> Tensor:
    if grad_out.numel() == 0:
        out.zero_()
        return
    primitive(grad_out, ids, padding_idx, out)


def _save(ctx, inputs, output):
    ctx.save_for_backward(inputs.ids)
    ctx.padding_idx = inputs.padding_idx
    ctx.vocab = inputs.weight.shape[0]
    ctx.dtype = inputs.weight.dtype


def _backward(ctx, grad_out):
    (ids,) = ctx.saved_tensors
    grad_out = grad_out.to(ctx.dtype).contiguous()
    return {"weight": embedding_op.backward(ctx, grad_out, ids, ctx.padding_idx, ctx.vocab)}


embedding_op.autograd(save=_save, backward=_backward)


# ---------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------


def embedding(ids: Tensor, weight: Tensor, padding_idx: int | None = None) -> Tensor:
    """Embedding lookup ``out[...] = weight[ids[...]]``, like ``torch.nn.functional.embedding``.

    Args:
        ids: int32 or int64 of any shape (any strides), values in ``[0, V)``; checked (one host
            synchronization) unless ``RLK_CHECK_VALUES=0``.
        weight: ``[V, H]`` bfloat16, float16 or float32 (float64: reference runs).
        padding_idx: an id whose row gets no gradient (``None``: none; negative counts from the
            end, ``-1`` is ``V - 1``). As in torch, the forward still returns that row.

    Returns:
        ``[*ids.shape, H]`` in ``weight.dtype``: a bitwise copy of the rows. Differentiable w.r.t.
        ``weight`` (not ``ids``).

    Gradient: ``grad_weight[v]`` is the sum of the output-gradient rows at the positions whose id
    is ``v``, accumulated in fp32 **in position order** (flattened ``ids``) and rounded once to
    ``weight.dtype``; 0 for unused ids and for ``padding_idx``. No atomics: deterministic run to
    run and bitwise identical across backends that follow the spec (``rlk.reference.embedding``);
    a row's gradient depends only on the rows with its id and their order, not on the rest of
    the batch.
    """
    if not isinstance(weight, Tensor):
        raise TypeError(f"weight: expected a torch.Tensor, got {type(weight).__name__}")
    if weight.dtype not in INPUT_DTYPES:
        raise TypeError(
            f"weight: expected dtype bfloat16, float16 or float32 (float64 for reference runs), got {weight.dtype}"
        )
    if weight.dim() != 2:
        raise ValueError(f"weight: expected shape [V, H], got {tuple(weight.shape)}")
    if not isinstance(ids, Tensor):
        raise TypeError(f"ids: expected a torch.Tensor, got {type(ids).__name__}")
    if ids.dtype not in _ID_DTYPES:
        raise TypeError(f"ids: expected dtype int32 or int64, got {ids.dtype}")
    if ids.device != weight.device:
        raise ValueError(f"ids: expected device {weight.device} (the device of weight), got {ids.device}")
    vocab = weight.shape[0]
    if padding_idx is None:
        padding = -1
    else:
        padding_idx = checks.integer("padding_idx", padding_idx)
        if not -vocab <= padding_idx < vocab:
            raise ValueError(
                f"padding_idx: expected None or an int in [-{vocab}, {vocab}) (V = {vocab}), got {padding_idx!r}"
            )
        padding = padding_idx % vocab
    flat_ids = ids.reshape(-1).to(torch.int64).contiguous()
    out = _embedding_fwd(weight.contiguous(), flat_ids, padding)
    return out.view(*ids.shape, weight.shape[1])
