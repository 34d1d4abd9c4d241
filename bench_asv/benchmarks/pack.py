"""Benchmarks of ``rlk.pack`` / ``rlk.unpack`` (a padded ``[B, T, H]`` batch to varlen rows with ``cu_seqlens`` and
position ids, and back) against the boolean-mask indexing RL code writes by hand.

Implementations (the ``impl`` parameter): ``rlk`` (the public ops on the backend rlk selects: one gather / scatter by
the mask's prefix sums, no atomics) and ``torch_index``: ``packed = x[mask]`` with ``cu_seqlens =
pad(cumsum(mask.sum(1)), (1, 0))`` (int32) and ``position_ids = (mask.cumsum(1) - 1)[mask]`` for pack (the same three
outputs as ``rlk.pack``), ``out = packed.new_zeros(B, T, H); out[mask] = packed`` for unpack; its backward is
autograd's (``IndexBackward``: an accumulating ``index_put_`` into zeros, for pack; ``grad_out[mask]`` for unpack).

``option``: ``pack_fwd_bwd`` (the trainer's step: pack the hidden states, then ``torch.autograd.grad`` of the packed
rows with respect to ``x`` for a random ``grad_packed``) or ``unpack_fwd_bwd`` (unpack the packed rows, then the
gradient with respect to them for a random ``[B, T, H]`` ``grad_out``). Neither passes the packed length: rlk reads
it back from the device (one host synchronization; the value checks share it), as ``x[mask]`` does.

Shape ``(B, T, H)``: ``[64, 4096, 4096]`` bf16 hidden states, right padding, each row's length uniform in ``[1, T]``
(seeded; about half the tokens valid), the mask ``[B, T]`` bool. Quick mode (``RLK_BENCH_QUICK=1`` or no GPU):
``[4, 64, 96]`` fp32.

Reported: ``track_ms`` (median ms per step, CUDA events) and ``track_gbps``: the bytes a step must move at least,
credited the same to both impls, over the time. With ``M`` the valid tokens, ``s`` the itemsize and the mask read
once per pass (1 byte a token):

* ``pack_fwd_bwd``: ``(3 M + B T) H s + 2 B T + 4 (B + 1) + 8 M``: the forward reads the ``M`` kept rows and the mask
  and writes the packed rows, ``cu_seqlens`` (int32) and ``position_ids`` (int64); the backward reads
  ``grad_packed`` and the mask and writes the whole ``grad_x`` (zeros at the padding);
* ``unpack_fwd_bwd``: ``(3 M + B T) H s + 2 B T``: the forward reads the packed rows and the mask and writes the
  whole ``[B, T, H]`` output; the backward reads the ``M`` kept rows of ``grad_out`` and the mask and writes
  ``grad_packed``.

``track_peak_extra_mib`` (``PackMemory``, GPU only): peak memory of one step above the inputs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

import rlk

from .common import DEVICE, QUICK, SEED, CaseBase, _CaseSetup, _MemorySetup

IMPLS = ["rlk", "torch_index"]
OPTIONS = ["pack_fwd_bwd", "unpack_fwd_bwd"]
DTYPE = torch.float32 if QUICK else torch.bfloat16
# (B, T, H): rows, padded length, hidden size.
SHAPES = [(4, 64, 96)] if QUICK else [(64, 4096, 4096)]


def right_padded_mask(b: int, t: int, gen: torch.Generator) -> Tensor:
    """``[B, T]`` bool, right padding: row ``i`` valid on its first ``length_i`` tokens, ``length_i`` uniform in
    ``[1, T]``."""
    lengths = torch.randint(1, t + 1, (b, 1), generator=gen, device=DEVICE)
    return torch.arange(t, device=DEVICE) < lengths


def torch_pack(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``rlk.pack``'s outputs by boolean-mask indexing: ``(x[mask], cu_seqlens int32, position_ids int64)``."""
    cu_seqlens = F.pad(mask.sum(1).cumsum(0, dtype=torch.int32), (1, 0))
    position_ids = (mask.cumsum(1) - 1)[mask]
    return x[mask], cu_seqlens, position_ids


def torch_unpack(packed: Tensor, mask: Tensor) -> Tensor:
    """``rlk.unpack`` by boolean-mask assignment into zeros."""
    out = packed.new_zeros(*mask.shape, *packed.shape[1:])
    out[mask] = packed
    return out


class PackCase(CaseBase):
    """One pack (or unpack) of a right-padded batch of hidden states, forward and backward."""

    def __init__(self, op: str, impl: str, option: str, shape: tuple[int, int, int]):
        if impl not in IMPLS:
            raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
        if option not in OPTIONS:
            raise ValueError(f"unknown option {option!r}; expected one of {OPTIONS}")
        gen = torch.Generator(DEVICE).manual_seed(SEED)
        b, t, h = shape
        self.mask = right_padded_mask(b, t, gen)
        m = int(self.mask.sum())
        self.unpacking = option == "unpack_fwd_bwd"
        if self.unpacking:
            self.input = torch.randn(m, h, generator=gen, device=DEVICE, dtype=DTYPE)
            self.grad_output = torch.randn(b, t, h, generator=gen, device=DEVICE, dtype=DTYPE)
        else:
            self.input = torch.randn(b, t, h, generator=gen, device=DEVICE, dtype=DTYPE)
            self.grad_output = torch.randn(m, h, generator=gen, device=DEVICE, dtype=DTYPE)
        self.input.requires_grad_()
        s = self.input.element_size()
        self.work = (3 * m + b * t) * h * s + 2 * b * t + (0 if self.unpacking else 4 * (b + 1) + 8 * m)
        self.unit = "GB/s"
        if impl == "rlk":
            self.decision = rlk.explain("pack", self.input)
        self.impl = impl
        self.step()

    def _forward(self) -> Tensor:
        if self.unpacking:
            return rlk.unpack(self.input, self.mask) if self.impl == "rlk" else torch_unpack(self.input, self.mask)
        fn = rlk.pack if self.impl == "rlk" else torch_pack
        return fn(self.input, self.mask)[0]

    def step(self) -> Tensor:
        """Forward, then the gradient of the (un)packed output with respect to the input."""
        (grad,) = torch.autograd.grad(self._forward(), self.input, self.grad_output)
        return grad


class Pack(_CaseSetup):
    """``pack`` / ``unpack`` fwd+bwd of ``[64, 4096, 4096]`` bf16: milliseconds and GB/s ((3 M + B T) H itemsize bytes
    and the mask, per step)."""

    op, case_type, shape_names = "pack", PackCase, "BTH"
    baselines = ("torch_index",)
    param_names = ["impl", "option", "shape"]
    params = [IMPLS, OPTIONS, SHAPES]

    def track_ms(self, impl: str, option: str, shape: tuple[int, int, int]) -> float:
        return self.case.ms()

    track_ms.unit = "ms"

    def track_gbps(self, impl: str, option: str, shape: tuple[int, int, int]) -> float:
        return self.case.rate()

    track_gbps.unit = "GB/s"


class PackMemory(_MemorySetup):
    """``pack`` / ``unpack`` fwd+bwd: peak extra GPU memory in MiB (CUDA only)."""

    op, case_type, param_names, params = "pack", PackCase, Pack.param_names, Pack.params
