"""Loss aggregation: the reduction that turns per-token losses ``L[B, T]`` into a scalar.

Shared by every rlk loss with a token dimension (``value_loss``, ``policy_loss``, ...), so
the modes, their normalizers and their argument checks live here once. Pure PyTorch,
device-generic, no host synchronization.

Every mode is a masked, weighted sum ``loss = sum_{i,t} w[i, t] * L[i, t]`` whose token
weight factors into the mask times a per-row weight, ``w[i, t] = m[i, t] * c[i]``. With
``n_i = sum_t m[i, t]`` (the tokens of row ``i``):

==========================  ==============================================  =====================
``agg``                     loss                                            ``c[i]``
==========================  ==============================================  =====================
``token-mean``              ``sum_{i,t} m L / N_tok``                       ``1 / N_tok``
``token-sum``               ``sum_{i,t} m L``                               ``1``
``seq-mean-token-sum``      ``sum_i [n_i>0] sum_t m L / N_seq``             ``1 / N_seq``
``seq-mean-token-mean``     ``sum_i [n_i>0] (sum_t m L) / n_i / N_seq``     ``1 / (n_i N_seq)``
``seq-mean-token-sum-norm`` ``seq-mean-token-sum / S`` (Dr.GRPO)            ``1 / (N_seq S)``
==========================  ==============================================  =====================

(A row with ``n_i = 0`` has no masked token, so its ``c[i]`` never multiplies anything;
``seq-mean-token-mean`` uses ``max(n_i, 1)`` there to stay finite.)

Normalizers:

* ``N_tok = global_tokens`` when given: the masked tokens of the whole optimizer step,
  summed over all micro-batches and data-parallel ranks. Otherwise the micro-batch is the
  whole batch: ``N_tok = max(sum_i n_i, 1)``.
* ``N_seq = global_seqs`` when given: the sequences of the whole optimizer step with at
  least one masked token. Otherwise ``N_seq = max(#{i : n_i > 0}, 1)``.
* ``S = loss_scale``: a constant such as the maximum response length. Required by
  ``seq-mean-token-sum-norm`` (never the padded length of the current micro-batch, which
  would make the loss depend on how the step was split) and rejected by the other modes.

With global normalizers, the losses of the micro-batches of one step add up to the loss of
the whole step, and each row's weight depends only on that row: this is what makes
micro-batching and data parallelism leave the gradient unchanged. A normalizer a mode does
not use (``global_seqs`` for ``token-mean``, ``global_tokens`` for the ``seq-*`` modes) is
ignored, so callers may pass both.

An empty mask gives loss 0 (never NaN) in every mode.

Normalizers are Python numbers (checked: finite, > 0) or one-element tensors on the mask's
device, for instance the result of an all-reduce; the ops check tensor values inside the op
(finite, > 0: one host synchronization, skipped with ``RLK_CHECK_VALUES=0``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlk.core import checks
from rlk.core.abi import AGG_MODES

Normalizer = int | float | Tensor | None


def check_agg(
    agg: str,
    device: torch.device,
    global_tokens: Normalizer = None,
    global_seqs: Normalizer = None,
    loss_scale: Normalizer = None,
) -> None:
    """Validate the aggregation arguments; errors name the argument at fault."""
    if agg not in AGG_MODES:
        raise ValueError(f"agg: expected one of {', '.join(repr(a) for a in AGG_MODES)}, got {agg!r}")
    checks.normalizer("global_tokens", global_tokens, device)
    checks.normalizer("global_seqs", global_seqs, device)
    checks.normalizer("loss_scale", loss_scale, device)
    if agg == "seq-mean-token-sum-norm" and loss_scale is None:
        raise ValueError(
            "loss_scale: agg='seq-mean-token-sum-norm' needs loss_scale, a constant such as the "
            "maximum response length (never the padded length of the micro-batch)"
        )
    if agg != "seq-mean-token-sum-norm" and loss_scale is not None:
        raise ValueError(f"loss_scale: only agg='seq-mean-token-sum-norm' uses it (agg is {agg!r})")


def _as_tensor(value: int | float | Tensor, dtype: torch.dtype, device: torch.device) -> Tensor:
    if isinstance(value, Tensor):
        return value.reshape(()).to(dtype)
    return torch.tensor(float(value), dtype=dtype, device=device)


def row_weights(
    mask: Tensor,
    agg: str,
    *,
    global_tokens: Normalizer = None,
    global_seqs: Normalizer = None,
    loss_scale: Normalizer = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Per-row weights ``c[B]`` with ``loss = sum_i c[i] * sum_t m[i, t] * L[i, t]`` (module docstring).

    Args:
        mask: ``[B, T]`` bool (or 0/1 numbers: nonzero counts as a token).
        agg: one of :data:`AGG_MODES`.
        global_tokens, global_seqs, loss_scale: the normalizers (module docstring).
        dtype: float32 (float64 for ground-truth runs).

    Returns:
        ``c`` of shape ``[B]`` in ``dtype``, on the mask's device.
    """
    if not isinstance(mask, Tensor) or mask.dim() != 2:
        raise ValueError(f"mask: expected a [B, T] tensor, got {getattr(mask, 'shape', type(mask).__name__)}")
    check_agg(agg, mask.device, global_tokens, global_seqs, loss_scale)
    m = mask if mask.dtype == torch.bool else mask != 0
    n_row = m.sum(dim=1, dtype=torch.int64)  # n_i, exact
    one = torch.ones((), dtype=dtype, device=mask.device)
    if agg == "token-sum":
        return one.expand(mask.shape[0]).clone()
    if agg == "token-mean":
        if global_tokens is None:
            n_tok = n_row.sum().clamp(min=1).to(dtype)
        else:
            n_tok = _as_tensor(global_tokens, dtype, mask.device)
        return (one / n_tok).expand(mask.shape[0]).clone()
    if global_seqs is None:
        n_seq = (n_row > 0).sum().clamp(min=1).to(dtype)
    else:
        n_seq = _as_tensor(global_seqs, dtype, mask.device)
    if agg == "seq-mean-token-sum":
        return (one / n_seq).expand(mask.shape[0]).clone()
    if agg == "seq-mean-token-mean":
        return one / (n_row.clamp(min=1).to(dtype) * n_seq)
    # seq-mean-token-sum-norm
    return (one / (n_seq * _as_tensor(loss_scale, dtype, mask.device))).expand(mask.shape[0]).clone()


def token_weights(
    mask: Tensor,
    agg: str,
    *,
    global_tokens: Normalizer = None,
    global_seqs: Normalizer = None,
    loss_scale: Normalizer = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Per-token weights ``w[B, T] = m * c[:, None]`` with ``loss = sum(w * L)`` (0 on masked-out tokens).

    Same arguments as :func:`row_weights`. Use ``torch.where(w != 0, w * L, 0).sum()`` (or
    mask ``L`` first) when masked-out positions of ``L`` may hold inf or NaN.
    """
    c = row_weights(mask, agg, global_tokens=global_tokens, global_seqs=global_seqs, loss_scale=loss_scale, dtype=dtype)
    m = mask if mask.dtype == torch.bool else mask != 0
    return torch.where(m, c[:, None], torch.zeros((), dtype=dtype, device=mask.device))


def aggregate(
    loss: Tensor,
    mask: Tensor,
    agg: str,
    *,
    global_tokens: Normalizer = None,
    global_seqs: Normalizer = None,
    loss_scale: Normalizer = None,
) -> Tensor:
    """``sum_i c[i] * sum_t m[i, t] * L[i, t]`` in the dtype of ``loss`` (float32 or float64).

    Masked-out positions of ``loss`` never contribute, even when they hold inf or NaN.
    Differentiable through ``loss`` (plain PyTorch: a readable spec, not a kernel).
    """
    c = row_weights(
        mask, agg, global_tokens=global_tokens, global_seqs=global_seqs, loss_scale=loss_scale, dtype=loss.dtype
    )
    m = mask if mask.dtype == torch.bool else mask != 0
    per_row = torch.where(m, loss, torch.zeros((), dtype=loss.dtype, device=loss.device)).sum(dim=1)
    return (c * per_row).sum()
