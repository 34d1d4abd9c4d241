"""The Triton backend's probe and its one fix to Triton's CPU interpreter."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

import rlk_triton
from rlk_triton import common


def test_an_older_triton_is_refused_with_the_supported_range(monkeypatch):
    monkeypatch.setattr(triton, "__version__", "3.4.0")
    assert rlk_triton._probe() == "triton 3.4.0 is older than rlk-triton supports (>= 3.6; tested with 3.6, 3.9)"


def test_the_abi_version_is_the_backends_own_and_an_other_rlk_is_refused(monkeypatch):
    """The backend states the ABI it was written for as a literal (rlk compares it with its own), and refuses an rlk
    of another version with the reason, serving nothing."""
    from rlk.core import abi, dispatch, version

    assert rlk_triton.ABI_VERSION == abi.ABI_VERSION
    assert rlk_triton.backend().abi_version == rlk_triton.ABI_VERSION and rlk_triton.backend().primitives
    reason = rlk_triton.version_problem("9.9.9")
    assert reason and rlk_triton.__version__ in reason and "9.9.9" in reason
    assert rlk_triton.version_problem(rlk_triton.__version__) is None
    monkeypatch.setattr(version, "__version__", "9.9.9")
    refused = rlk_triton.backend()
    assert refused.primitives == {} and refused.probe() == reason and refused.device_types() == ()
    monkeypatch.setattr(version, "__version__", rlk_triton.__version__)
    monkeypatch.setattr(rlk_triton, "ABI_VERSION", abi.ABI_VERSION + 1)
    status = dispatch._status_of("triton", rlk_triton.backend, "rlk_triton:backend")
    assert not status.available and status.reason == (
        f"built for rlk ABI {abi.ABI_VERSION + 1}, this rlk speaks ABI {abi.ABI_VERSION}"
    )


@triton.jit
def _masked_copy(x_ptr, y_ptr, N, H, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = (cols < H) & (row < N)  # a scalar comparison broadcast into a block mask
    tl.store(y_ptr + row * H + cols, tl.load(x_ptr + row * H + cols, mask=mask, other=0.0), mask=mask)


@pytest.mark.triton_interpreter
def test_interpreted_comparisons_are_int1():
    """A scalar comparison broadcast into a mask is a bool mask under the interpreter (Triton 3.9's interpreter
    typed it int32 and refused it: "mask has unsupported dtype"); the copy is exact."""
    assert hasattr(common, "INTERPRETER_COMPARISONS_RETYPED")
    x = torch.randn(3, 5)
    y = torch.zeros(3, 5)
    _masked_copy[(3,)](x, y, 3, 5, BLOCK=8)
    assert torch.equal(x, y)
