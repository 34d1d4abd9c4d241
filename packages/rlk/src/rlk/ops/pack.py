"""Public varlen packing: ``pack`` (padded ``[B, T, *trailing]`` to packed rows ``[total, *trailing]`` with
``cu_seqlens`` and position ids) and ``unpack`` (back to padded).

Both are one gather / scatter by a precomputed map (``slot``: the packed row of each valid token, -1 for
padding; ``rlk.reference.pack``), so they are bitwise copies, deterministic and free of atomics. The
custom ops ``rlk::pack_fwd`` / ``rlk::pack_bwd`` run the ABI op ``pack``; ``rlk::unpack_fwd`` /
``rlk::unpack_bwd`` run the same two primitives the other way round: the gradient of ``pack`` is the
``unpack`` of its gradient (zeros at padding) and the gradient of ``unpack`` the ``pack`` of its gradient.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from rlk.core import checks, custom_op
from rlk.core.checks import values_checked

#: Dtypes of the tensors packed (floats, and integer token ids).
PACK_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64)
_DTYPE_NAMES = "float32, float16, bfloat16, float64, int32 or int64"


# ---------------------------------------------------------------------------
# custom ops
# ---------------------------------------------------------------------------


pack_op = custom_op.declare("pack")


@pack_op.forward(outputs=lambda x, slot, total: x.new_empty((total, x.shape[1])))
def _pack_fwd(primitive, out, x: Tensor, slot: Tensor, total: int) -> Tensor:
    """``out[slot[n]] = x[n]`` for the valid tokens ``n``."""
    if out.numel():
        primitive(x, slot, out)


@pack_op.backward_primitive(
    outputs=lambda grad, slot: grad.new_empty((slot.shape[0], grad.shape[1])), primitive="pack_bwd"
)
def _pack_bwd(primitive, out, grad: Tensor, slot: Tensor) -> Tensor:
    """The gradient of ``pack``: ``grad`` unpacked, 0 at padding."""
    if not out.numel():
        return
    if grad.shape[0] == 0:
        out.zero_()
        return
    primitive(grad, slot, 0.0, out)


def _pack_save(ctx, inputs, output):
    ctx.save_for_backward(inputs.slot)
    ctx.dtype = inputs.x.dtype


def _pack_backward(ctx, grad):
    (slot,) = ctx.saved_tensors
    return {"x": pack_op.backward(ctx, grad.to(ctx.dtype).contiguous(), slot)}


pack_op.autograd(save=_pack_save, backward=_pack_backward)


unpack_op = custom_op.declare("unpack", dispatch_op="pack")


@unpack_op.forward(
    outputs=lambda packed, slot, fill: packed.new_empty((slot.shape[0], packed.shape[1])), primitive="pack_bwd"
)
def _unpack_fwd(primitive, out, packed: Tensor, slot: Tensor, fill: float) -> Tensor:
    """``out[n] = packed[slot[n]]`` for the valid tokens, ``fill`` elsewhere."""
    if not out.numel():
        return
    if packed.shape[0] == 0:
        out.fill_(fill)
        return
    primitive(packed, slot, fill, out)


@unpack_op.backward_primitive(
    outputs=lambda grad, slot, total: grad.new_empty((total, grad.shape[1])), primitive="pack_fwd"
)
def _unpack_bwd(primitive, out, grad: Tensor, slot: Tensor, total: int) -> Tensor:
    """The gradient of ``unpack``: ``grad`` packed (the padding positions get none)."""
    if out.numel():
        primitive(grad, slot, out)


def _unpack_save(ctx, inputs, output):
    ctx.save_for_backward(inputs.slot)
    ctx.dtype = inputs.packed.dtype
    ctx.total = inputs.packed.shape[0]


def _unpack_backward(ctx, grad):
    (slot,) = ctx.saved_tensors
    return {"packed": unpack_op.backward(ctx, grad.to(ctx.dtype).contiguous(), slot, ctx.total)}


unpack_op.autograd(save=_unpack_save, backward=_unpack_backward)


# ---------------------------------------------------------------------------
# the map from the mask
# ---------------------------------------------------------------------------


def _check_mask(attention_mask) -> None:
    if not isinstance(attention_mask, Tensor):
        raise TypeError(f"attention_mask: expected a torch.Tensor, got {type(attention_mask).__name__}")
    if attention_mask.dtype.is_floating_point or attention_mask.dtype.is_complex:
        raise TypeError(
            f"attention_mask: expected dtype bool or an integer dtype (values 0 / 1), got {attention_mask.dtype}"
        )
    if attention_mask.dim() != 2:
        raise ValueError(f"attention_mask: expected shape [B, T], got {tuple(attention_mask.shape)}")


def _check_data(name: str, x, attention_mask: Tensor) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in PACK_DTYPES:
        raise TypeError(f"{name}: expected dtype {_DTYPE_NAMES}, got {x.dtype}")
    if x.device != attention_mask.device:
        raise ValueError(
            f"{name}: expected device {attention_mask.device} (the device of attention_mask), got {x.device}"
        )


def _checked() -> bool:
    """Whether the value checks run: ``RLK_CHECK_VALUES`` (``rlk.core.checks.values_checked``), never while
    ``torch.compile`` traces (a check reads values back to the host)."""
    return not torch.compiler.is_compiling() and values_checked()


def _slots(attention_mask: Tensor, total: int | None, rows: int | None) -> tuple[Tensor, Tensor, int]:
    """``(slot [B*T] int64, cu_seqlens [B+1] int64, total)`` from the mask.

    At most one host synchronization: the total, when not given, and the value checks (mask values 0 / 1,
    a given ``total``, the ``rows`` of a packed tensor) read back together; none with ``total`` given and
    ``RLK_CHECK_VALUES=0``.
    """
    b, t = attention_mask.shape
    flat = attention_mask.reshape(-1)
    valid = flat != 0
    ends = torch.cumsum(valid, 0, dtype=torch.int64)  # valid tokens up to and including n
    slot = torch.where(valid, ends - 1, -1)
    cu = ends.new_zeros(b + 1)
    if t:
        cu[1:] = ends.view(b, t)[:, -1]
    count = cu[-1:]
    checked = _checked()
    if total is None or checked:
        probe = [count]
        if checked:
            probe.append(((flat != 0) & (flat != 1)).sum(dtype=torch.int64).view(1))
        host = torch.cat(probe).tolist()
        found = host[0]
        if checked and host[1]:
            bad = ((flat != 0) & (flat != 1)).nonzero()[0, 0]
            raise ValueError(
                f"attention_mask: values must be 0 or 1 (or bool); found {flat[bad].item()} at "
                f"[{int(bad) // t}, {int(bad) % t}]"
            )
        if total is not None and total != found:
            raise ValueError(f"total: expected the number of valid tokens of attention_mask, {found}; got {total}")
        if rows is not None and rows != found:
            raise ValueError(f"packed: expected {found} rows (the valid tokens of attention_mask), got {rows}")
        if total is None:
            total = found
    return slot, cu, total


# ---------------------------------------------------------------------------
# public API
# ---------------------------------------------------------------------------


def pack(x: Tensor, attention_mask: Tensor, *, total: int | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """Pack a padded batch into varlen rows: the valid tokens of each row, in order, rows one after another.

    Args:
        x: ``[B, T, *trailing]`` (any trailing shape, any strides) of dtype float32, float16, bfloat16, float64
            (reference runs), int32 or int64 (token ids).
        attention_mask: ``[B, T]`` bool or integer, 1 (True) at the valid tokens: left padding, right padding
            and holes inside a row are all allowed. Values other than 0 / 1 are an error (checked unless
            ``RLK_CHECK_VALUES=0``).
        total: the number of valid tokens (``attention_mask.sum()``), if known. The packed length is data
            dependent: without ``total`` it is read back from the device (one host synchronization); with it,
            none, except the value checks (one synchronization, which also checks ``total``) unless
            ``RLK_CHECK_VALUES=0``. Under ``torch.compile`` the value checks are skipped, and ``total`` is
            what keeps the graph whole (``fullgraph=True``).

    Returns:
        ``(packed, cu_seqlens, position_ids)``: ``packed`` ``[total, *trailing]`` in ``x.dtype``, a bitwise copy
        of the valid tokens in row-major order; ``cu_seqlens`` ``[B + 1]`` int32, the cumulative valid-token
        counts (``cu_seqlens[b] : cu_seqlens[b + 1]`` are row ``b``'s tokens; what ``rlk.attention`` takes);
        ``position_ids`` ``[total]`` int64, each token's index among the valid tokens of its row (0, 1, ...).

    Differentiable w.r.t. ``x`` (float dtypes): the gradient is ``unpack`` of the output gradient, 0 at the
    padding. Deterministic and batch invariant: a gather / scatter by the mask's prefix sums, no atomics; a
    token's packed value is its input bits, whatever the other rows.
    """
    _check_mask(attention_mask)
    _check_data("x", x, attention_mask)
    b, t = attention_mask.shape
    if x.dim() < 2 or tuple(x.shape[:2]) != (b, t):
        raise ValueError(
            f"x: expected shape [B, T, *trailing] with [B, T] = {[b, t]} (the shape of "
            f"attention_mask), got {tuple(x.shape)}"
        )
    if total is not None:
        total = checks.integer("total", total, minimum=0)
    slot, cu, total = _slots(attention_mask, total, None)
    trailing = tuple(x.shape[2:])
    rows = x.reshape(b * t, _numel(trailing))
    packed = _pack_fwd(rows.contiguous(), slot, total)
    lengths = cu[1:] - cu[:-1]
    starts = torch.repeat_interleave(cu[:-1], lengths, output_size=total)
    position_ids = torch.arange(total, dtype=torch.int64, device=x.device) - starts
    return packed.view(total, *trailing), cu.to(torch.int32), position_ids


def unpack(packed: Tensor, attention_mask: Tensor, *, padding_value: float = 0) -> Tensor:
    """Scatter packed varlen rows back into a padded batch (the inverse of :func:`pack`).

    Args:
        packed: ``[total, *trailing]``, ``total`` the number of valid tokens of ``attention_mask`` (checked,
            with the mask's values, in one host synchronization unless ``RLK_CHECK_VALUES=0``; unchecked, a
            wrong ``total`` reads or leaves rows out of bounds). Dtypes as :func:`pack`'s ``x``.
        attention_mask: ``[B, T]`` bool or integer, 1 at the valid tokens (as in :func:`pack`).
        padding_value: the value at the padding positions (0 by default): one that ``packed.dtype`` holds exactly,
            else an error (:func:`check_padding_value`: an integer within range for integer ``packed``, for int64
            also exactly a float64; for floating ``packed`` a value of the dtype, ``inf``, ``-inf`` or NaN).

    Returns:
        ``[B, T, *trailing]`` in ``packed.dtype``: row ``b``'s valid positions hold, in order, the packed rows
        ``cu_seqlens[b] : cu_seqlens[b + 1]`` (bitwise), the others ``padding_value``.

    Differentiable w.r.t. ``packed``: the gradient is ``pack`` of the output gradient (padding positions give
    none). Deterministic, no atomics.
    """
    _check_mask(attention_mask)
    _check_data("packed", packed, attention_mask)
    if packed.dim() < 1:
        raise ValueError(f"packed: expected shape [total, *trailing], got {tuple(packed.shape)}")
    check_padding_value(padding_value, packed.dtype)
    b, t = attention_mask.shape
    slot, _, _ = _slots(attention_mask, None if _checked() else packed.shape[0], packed.shape[0])
    trailing = tuple(packed.shape[1:])
    rows = packed.reshape(packed.shape[0], _numel(trailing))
    out = _unpack_fwd(rows.contiguous(), slot, float(padding_value))
    return out.view(b, t, *trailing)


def _float_format(dtype: torch.dtype) -> tuple[int, int, float]:
    """``(significand bits, frexp exponent of the smallest normal, largest finite)`` of a floating dtype."""
    info = torch.finfo(dtype)
    return 1 - round(math.log2(info.eps)), round(math.log2(info.smallest_normal)) + 1, info.max


_FLOAT_FORMATS = {dtype: _float_format(dtype) for dtype in PACK_DTYPES if dtype.is_floating_point}


def _holds(dtype: torch.dtype, value: float) -> bool:
    """Whether the finite float ``value`` is a value of the floating ``dtype``: within its range and a multiple of
    its spacing there (plain Python: no tensor, so ``torch.compile`` folds it)."""
    bits, min_exponent, largest = _FLOAT_FORMATS[dtype]
    if abs(value) > largest:
        return False
    if value == 0.0:
        return True
    return math.ldexp(value, bits - max(math.frexp(value)[1], min_exponent)).is_integer()


def check_padding_value(padding_value, dtype: torch.dtype) -> None:
    """``padding_value`` is an int or float that ``dtype`` holds exactly, else an error naming it.

    The fill reaches the primitives as a float64 (their ``fill: float``) and is cast to ``dtype`` there, so:
    floating dtypes take any value of the dtype (``65504`` in float16, not ``65520`` or ``1e10``; ``0.1`` only
    in float64), and ``inf``, ``-inf`` and NaN; integer dtypes take integers within their range that a float64
    holds exactly (for int64: within ``+-2**53``, beyond it only multiples of the float64 spacing).
    """
    if isinstance(padding_value, bool) or not isinstance(padding_value, (int, float)):
        raise TypeError(f"padding_value: expected an int or a float, got {type(padding_value).__name__}")
    if not dtype.is_floating_point:
        if isinstance(padding_value, float) and not padding_value.is_integer():
            raise ValueError(f"padding_value: expected an integer for {dtype} packed, got {padding_value!r}")
        info = torch.iinfo(dtype)
        if not info.min <= padding_value <= info.max:
            raise ValueError(f"padding_value: {padding_value!r} does not fit {dtype}")
        if float(padding_value) != padding_value:
            raise ValueError(
                f"padding_value: {padding_value!r} is not exactly a float64 (the fill reaches the kernels as one; "
                f"beyond 2**53 only multiples of the float64 spacing are), it would be stored as "
                f"{int(float(padding_value))}"
            )
        return
    if isinstance(padding_value, float) and not math.isfinite(padding_value):
        return  # inf, -inf and NaN are values of every floating dtype
    try:
        value = float(padding_value)
    except OverflowError:
        raise ValueError(f"padding_value: {padding_value!r} overflows {dtype}") from None
    if value != padding_value or not _holds(dtype, value):
        stored = torch.tensor(value, dtype=torch.float64).to(dtype).item()
        raise ValueError(
            f"padding_value: {padding_value!r} is not a value of {dtype} (it would be stored as {stored!r}); "
            f"pass one that {dtype} holds exactly"
        )


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
