"""Helpers every Triton op family of rlk shares: the launch device, the dot product and tile scheduling, and two
fixes to Triton's CPU interpreter (tests only)."""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl


def _type_interpreter_comparisons_as_int1() -> bool:
    """Make the CPU interpreter type a comparison's result as ``int1``, as compiled Triton does; True if it had to.

    Triton's interpreter types ``a < b`` with the dtype of ``a`` (seen in 3.6 and 3.9), so a scalar comparison
    broadcast into a block mask (``col_mask & (row < N)``) comes out as an int32 mask. 3.6's load takes it; 3.9's
    refuses it ("mask has unsupported dtype"). Compiled kernels are not affected (the compiler types comparisons
    itself): this touches only ``TRITON_INTERPRET=1`` runs, where the probe below sees the mistyped mask.
    """
    import numpy as np
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    b = builder()
    cols = interpreter.TensorHandle(np.arange(4, dtype=np.int32), tl.int32)
    row = interpreter.TensorHandle(np.array(1, dtype=np.int64), tl.int64)
    col_mask = b.create_icmpSLT(cols, cols)  # as cols < H
    row_mask = b.create_splat(tl.block_type(tl.int1, [4]), b.create_icmpSLT(row, row))  # as (row < N), broadcast
    if b.create_and(col_mask, row_mask).data.dtype == np.bool_:
        return False
    for name in dir(builder):
        if name.startswith(("create_icmp", "create_fcmp")):
            compare = getattr(builder, name)

            def as_int1(self, lhs, rhs, _compare=compare):
                out = _compare(self, lhs, rhs)
                return interpreter.TensorHandle(out.data.astype(np.bool_), tl.int1)

            setattr(builder, name, as_int1)
    return True


def _make_interpreted_dot_row_independent() -> None:
    """Make the CPU interpreter's ``tl.dot`` sum each output element over K in order, whatever the other rows hold.

    The interpreter computes ``tl.dot`` with ``np.matmul``, i.e. OpenBLAS, whose kernel is picked for the CPU at run
    time: on some CPUs (an AMD EPYC, where OpenBLAS picks its Zen / Haswell kernels) an output row's bits depend on
    the rows around it, so a kernel that is batch-invariant on a GPU is not under the interpreter, and the tests
    of invariance fail by machine. ``np.einsum(..., optimize=False)`` (no BLAS) gives every output element the same
    sequence of operations. Compiled kernels are not affected.
    """
    import numpy as np
    from triton.runtime import interpreter

    original = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8 or a.data.ndim != 2 or b.data.ndim != 2:
            return original(self, a, b, d, input_precision, max_num_imprecise_acc)
        acc = d.data.dtype
        # C-ordered copies: einsum picks its loop order from the strides
        out = np.einsum("mk,kn->mn", a.data.astype(acc, order="C"), b.data.astype(acc, order="C"), optimize=False)
        return interpreter.TensorHandle(out + d.data, d.dtype.scalar)

    interpreter.InterpreterBuilder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    INTERPRETER_COMPARISONS_RETYPED = _type_interpreter_comparisons_as_int1()
    _make_interpreted_dot_row_independent()


def on_device(device: torch.device):
    """Launch on ``device``'s GPU (a no-op for CPU tensors under the interpreter)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


@triton.jit
def grouped_tile(pid, n_row_tiles, n_col_tiles, GROUP: tl.constexpr):
    """Map a linear program id to (row tile, column tile), ``GROUP`` row tiles varying fastest.

    Programs launched together then cover a ``GROUP x k`` block of tiles and share the
    operand tiles in L2. Pure scheduling: no effect on any value.
    """
    per_group = GROUP * n_col_tiles
    first_row_tile = (pid // per_group) * GROUP
    group_rows = tl.minimum(n_row_tiles - first_row_tile, GROUP)
    local = pid % per_group
    return first_row_tile + local % group_rows, local // group_rows


@triton.jit
def dot(a, b, acc, IEEE: tl.constexpr):
    """``acc + a @ b`` with fp32 accumulation; IEEE fp32 products for fp32 inputs (no TF32)."""
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc
