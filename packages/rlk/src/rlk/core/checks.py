"""Argument checks shared by every public op: one helper per kind of argument, one wording of each error.

Every error names the argument. Shape and dtype checks are free (metadata only). *Value* checks (index
ranges, ``cu_seqlens`` offsets, the values of tensor temperatures and normalizers) need the tensor's contents
and so a host synchronization; they run inside the custom ops through :func:`values_checked`, which
``RLK_CHECK_VALUES=0`` turns off (for CUDA graph capture, or once a pipeline is known to feed valid inputs).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import operator
import os
from collections.abc import Iterator

import torch
from torch import Tensor

#: Floating dtypes the public ops accept (float64: reference-only ground-truth runs).
INPUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def check_float(name: str, x) -> None:
    """``x`` is a tensor of one of :data:`INPUT_DTYPES`; the error names the argument."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(
            f"{name}: expected dtype bfloat16, float16 or float32 (float64 for reference runs), got {x.dtype}"
        )


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype rlk computes and returns statistics in for inputs of ``dtype``: float64 for float64 (reference
    runs, the contract's ground truth), else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def stat_dtype(x: Tensor) -> torch.dtype:
    """:func:`compute_dtype` of ``x``'s dtype."""
    return compute_dtype(x.dtype)


def same_dtype(*named: tuple[str, Tensor | None], exact: bool = False) -> None:
    """The dtype rule of an op's floating tensor inputs; the error names the first argument that breaks it.

    ``named``: ``(name, tensor)`` pairs of the op's data inputs, the first its main input; entries that are not
    tensors (None: an optional input not given) are skipped, as are integer and bool tensors (indices, masks,
    counts). Parameters that may be given as tensors (temperatures, aggregation normalizers) are not data: they are
    converted to the compute dtype and their values checked there.

    By default the inputs must share the :func:`compute_dtype`: bfloat16, float16 and float32 mix (each is read as
    float32, exactly), while float64, the reference backend's ground truth, is all or none (a float64 input among
    float32 ones would otherwise turn the whole call into a reference-only float64 run, or be read in float32
    silently). ``exact``: the dtypes must be equal (operands a kernel reads in their own dtype, such as a GEMM's).
    """
    given = [(name, x) for name, x in named if isinstance(x, Tensor) and x.is_floating_point()]
    if not given:
        return
    first, like = given[0]
    for name, x in given[1:]:
        if exact and x.dtype != like.dtype:
            raise TypeError(f"{name}: expected the dtype of {first} ({like.dtype}), got {x.dtype}")
        if compute_dtype(x.dtype) != compute_dtype(like.dtype):
            raise TypeError(
                f"{name}: expected float64 exactly when {first} is float64, got {x.dtype} with {first} {like.dtype}"
            )


# ---------------------------------------------------------------------------
# Python scalars
# ---------------------------------------------------------------------------


def integer(name: str, value, *, minimum: int | None = None) -> int:
    """An integer argument (an index such as ``ignore_index``, a size): a Python or NumPy int, never a bool,
    a float (``1.5`` would be truncated) or None."""
    if isinstance(value, (bool, float)) or value is None:
        raise TypeError(f"{name}: expected an integer, got {type(value).__name__} {value!r}")
    try:
        result = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an integer, got {type(value).__name__} {value!r}") from None
    if minimum is not None and result < minimum:
        raise ValueError(f"{name}: expected an int >= {minimum}, got {result}")
    return result


def _range(minimum: float | None, above: float | None, maximum: float | None) -> str:
    low = f"[{minimum:g}" if minimum is not None else (f"({above:g}" if above is not None else None)
    if low is not None and maximum is not None:
        return f" in {low}, {maximum:g}]"
    if low is not None:
        return f" {'>=' if minimum is not None else '>'} {low[1:]}"
    return f" <= {maximum:g}" if maximum is not None else ""


def number(
    name: str,
    value,
    *,
    minimum: float | None = None,
    above: float | None = None,
    maximum: float | None = None,
    dtype: torch.dtype | None = None,
) -> float:
    """A finite real number (never a bool), ``>= minimum``, ``> above``, ``<= maximum`` where given.

    ``dtype``: the number is used in that floating dtype, so it must stay finite there, and a nonzero value
    must not round to 0 (``1e39`` and ``1e-50`` are finite Python floats but inf and 0 in float32).
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number, got {type(value).__name__}")
    x = float(value)
    if not (
        math.isfinite(x)
        and (minimum is None or x >= minimum)
        and (above is None or x > above)
        and (maximum is None or x <= maximum)
    ):
        raise ValueError(f"{name}: must be a finite number{_range(minimum, above, maximum)}, got {value}")
    if dtype is not None and dtype.is_floating_point:
        rounded = torch.tensor(x, dtype=torch.float64).to(dtype).item()
        if not math.isfinite(rounded):
            raise ValueError(f"{name}: {value} overflows {dtype} (largest finite: {torch.finfo(dtype).max:.4g})")
        if rounded == 0.0 and x != 0.0:
            smallest = torch.finfo(dtype).smallest_normal * torch.finfo(dtype).eps
            raise ValueError(f"{name}: {value} rounds to 0 in {dtype} (smallest positive: {smallest:.4g})")
    return x


def choice(name: str, value, choices: tuple[str, ...]) -> str:
    """One of ``choices`` (strings)."""
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"{name}: expected one of {', '.join(repr(c) for c in choices)}, got {value!r}")
    return value


def flag(name: str, value) -> bool:
    """A bool argument (numbers are refused: ``return_entropy=2`` is a mistake, not a choice)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name}: expected a bool, got {type(value).__name__} {value!r}")
    return value


# ---------------------------------------------------------------------------
# Temperatures and other positive numbers given as a number or a tensor
# ---------------------------------------------------------------------------


def positive_scalar_or_tensor(name: str, value, dtype: torch.dtype) -> float | Tensor:
    """A number ``> 0`` that stays finite and nonzero in ``dtype`` with a finite reciprocal (temperatures:
    the ops divide by them), or a floating tensor, whose values :func:`check_positive_values` checks later."""
    if isinstance(value, Tensor):
        if not value.is_floating_point():
            raise TypeError(f"{name}: expected a float or a floating tensor, got dtype {value.dtype}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a float or a tensor, got {type(value).__name__}")
    value = number(name, value, above=0.0, dtype=dtype)
    if not math.isfinite(torch.tensor(1.0 / value, dtype=torch.float64).to(dtype).item()):
        raise ValueError(f"{name}: {value:.4g} is so small that 1/{name} overflows {dtype}")
    return value


def check_positive_values(name: str, values: Tensor, *, reciprocal: bool = False) -> None:
    """Value check (inside the op, one synchronization; :func:`values_checked`): every element finite and > 0.

    ``reciprocal``: ``values`` holds ``1 / x`` of the user's ``x`` (the ops store inverse temperatures), and the
    message speaks of ``x``.
    """
    if not values_checked() or values.numel() == 0 or values.device.type == "meta":
        return
    bad = ~(values > 0) | torch.isinf(values)
    if not bool(bad.any()):
        return
    i = int(bad.reshape(-1).nonzero()[0, 0])
    v = float(values.reshape(-1)[i])
    if not reciprocal:
        found = f"{v}"
    elif math.isnan(v):
        found = "nan"
    elif v == math.inf:
        found = f"0 or a value so small that 1/{name} overflows {values.dtype}"
    elif v == 0.0:
        found = f"inf or a value above {torch.finfo(values.dtype).max:.4g}"
    else:
        found = f"{1.0 / v}"
    where = f" at flat position {i}" if values.numel() > 1 else ""
    raise ValueError(f"{name}: must be finite and > 0; found {found}{where}")


def check_count_values(named: dict[str, Tensor | None]) -> None:
    """Value check of token counts (lengths) among ``named`` (inside the op, one synchronization for all;
    :func:`values_checked`): every element finite and ``>= 0``."""
    given = {name: t for name, t in named.items() if t is not None and t.numel() and t.device.type != "meta"}
    if not given or not values_checked():
        return

    def bad(t: Tensor) -> Tensor:
        return ~(t >= 0) | (t == math.inf)

    flags = torch.stack([bad(t).any() for t in given.values()]).tolist()
    for (name, t), wrong in zip(given.items(), flags):
        if wrong:
            i = int(bad(t).reshape(-1).nonzero()[0, 0])
            raise ValueError(f"{name}: must be finite and >= 0; found {t.reshape(-1)[i].item()} at position {i}")


# ---------------------------------------------------------------------------
# Aggregation normalizers
# ---------------------------------------------------------------------------


def normalizer(name: str, value, device: torch.device) -> None:
    """An aggregation normalizer (``global_tokens``, ``global_seqs``, ``loss_scale``: the loss divides by it):
    None, a number ``> 0`` whose reciprocal is finite in float32, or a one-element real tensor on ``device``
    (e.g. an all-reduced count), whose value :func:`check_normalizer_values` checks inside the op."""
    if value is None:
        return
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(f"{name}: expected a number or a one-element tensor, got shape {tuple(value.shape)}")
        if value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"{name}: expected a real numeric tensor, got dtype {value.dtype}")
        if value.device != device:
            raise ValueError(f"{name}: expected device {device} (the device of mask), got {value.device}")
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a number or a one-element tensor, got {type(value).__name__}")
    positive_scalar_or_tensor(name, value, torch.float32)


def check_normalizer_values(named: dict[str, Tensor | None]) -> None:
    """Value check of the tensor normalizers among ``named`` (inside the op, one synchronization;
    :func:`values_checked`): each finite and > 0, so that the loss never becomes inf or NaN by them."""
    given = {name: t.reshape(1) for name, t in named.items() if t is not None and t.device.type != "meta"}
    if not given or not values_checked():
        return
    bad = torch.cat([~(t > 0) | torch.isinf(t) for t in given.values()])
    if bool(bad.any()):
        for name, t in given.items():
            check_positive_values(name, t)


# ---------------------------------------------------------------------------
# cu_seqlens
# ---------------------------------------------------------------------------


def cu_seqlens(name: str, cu, device: torch.device) -> None:
    """Packed-sequence offsets: an int32 ``[B + 1]`` tensor on ``device`` (values: :func:`check_cu_seqlens_values`)."""
    if not isinstance(cu, Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(cu).__name__}")
    if cu.dtype != torch.int32:
        raise TypeError(f"{name}: expected dtype int32, got {cu.dtype}")
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(f"{name}: expected shape [B + 1] (B >= 0 sequences), got {tuple(cu.shape)}")
    if cu.device != device:
        raise ValueError(f"{name}: expected device {device} (the device of q), got {cu.device}")


def check_cu_seqlens_values(offsets: list[tuple[str, Tensor, int, str, int]]) -> None:
    """Value checks of packed-sequence offsets, one synchronization for all (inside the op; :func:`values_checked`).

    ``offsets``: ``(name, cu, total, what, max_len)`` each: ``cu`` must start at 0, be non-decreasing, end at
    ``total`` (the tokens of ``what``), and no sequence may be longer than ``max_len`` (the argument
    ``max_<name's suffix>``). Checked on every call: a tensor edited in place is checked again.
    """
    if not values_checked():
        return
    checks = []
    for _, cu, total, _, max_len in offsets:
        lengths = cu[1:] - cu[:-1]
        longest = lengths.max() if lengths.numel() else cu.new_zeros(())
        checks += [cu[0] != 0, cu[-1] != total, (lengths < 0).any(), longest > max_len]
    flags = torch.stack(checks).tolist()
    for k, (name, cu, total, what, max_len) in enumerate(offsets):
        start, end, decreasing, too_long = flags[4 * k : 4 * k + 4]
        if start:
            raise ValueError(f"{name}: must start at 0, starts at {int(cu[0])}")
        if end:
            raise ValueError(f"{name}: must end at the number of tokens of {what} ({total}), ends at {int(cu[-1])}")
        if decreasing:
            b = int(((cu[1:] - cu[:-1]) < 0).nonzero()[0, 0])
            raise ValueError(
                f"{name}: must be non-decreasing; sequence {b} has offsets {int(cu[b])} -> {int(cu[b + 1])}"
            )
        if too_long:
            lengths = cu[1:] - cu[:-1]
            b = int(lengths.argmax())
            max_name = "max_seqlen_" + name.removeprefix("cu_seqlens_")
            raise ValueError(f"{max_name}: sequence {b} has {int(lengths[b])} tokens, more than {max_name}={max_len}")


# ---------------------------------------------------------------------------
# The switch
# ---------------------------------------------------------------------------

_trusted = contextvars.ContextVar("rlk_trusted_values", default=False)


def values_checked() -> bool:
    """Whether value checks (one host synchronization each) run: unless ``RLK_CHECK_VALUES=0``, or inside
    :func:`trusted_values`; never while ``torch.compile`` traces a call (a check reads values back to the host,
    and the switch is a context variable, neither of which a graph holds). The checks inside the custom ops run
    when the compiled graph runs them, under the switch of that moment."""
    if torch.compiler.is_compiling():
        return False
    return not _trusted.get() and os.environ.get("RLK_CHECK_VALUES", "1") != "0"


@contextlib.contextmanager
def trusted_values() -> Iterator[None]:
    """Skip value checks for calls whose index tensors rlk built itself (e.g. the ``cu_seqlens`` that
    ``patch_model``'s attention derives from the padding mask): valid by construction, and checking them
    in every layer would synchronize once per layer."""
    token = _trusted.set(True)
    try:
        yield
    finally:
        _trusted.reset(token)
