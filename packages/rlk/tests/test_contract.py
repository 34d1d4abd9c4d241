"""The contract table is complete and its checks can fail."""

from __future__ import annotations

import math

import pytest
import torch

from rlk.core import abi, contract


def test_every_op_and_dtype_has_an_entry():
    for op in abi.OPS.values():
        for dtype in op.dtypes:
            e = contract.entry(op.name, dtype)
            assert e.atol > 0 and e.rtol > 0
            if op.backward is None:
                assert e.grad_rel_l2 is None, f"{op.name} is not differentiable: grad_rel_l2 must be null"
            else:
                assert e.grad_rel_l2 > 0
            assert e.batch_invariance in ("bitwise", "deterministic")
            assert e.batch_invariance == "bitwise" or op.name == "masked_whiten"


def test_unknown_entries_are_errors():
    with pytest.raises(KeyError, match="no entry for op 'nope'"):
        contract.entry("nope", torch.float32)
    with pytest.raises(KeyError, match="covers"):
        contract.entry("selected_logprob", torch.int8)


def test_compare_outputs_scales_with_the_row_and_catches_errors():
    e = contract.entry("selected_logprob", torch.float32)
    ref = torch.tensor([-1.0, -2.0, -3.0], dtype=torch.float64)
    lse = torch.tensor([5.0, 1e4, 0.0], dtype=torch.float64)
    scale = contract.row_scale(ref, lse)
    assert torch.equal(scale, 1 + lse.abs() + (ref + lse).abs())
    within = ref + 0.9 * (e.atol + e.rtol * scale)
    assert contract.compare_outputs(e, "logprob", within.float(), ref, scale).ok
    off = ref.clone()
    off[0] += 2 * (e.atol + e.rtol * scale[0])
    dev = contract.compare_outputs(e, "logprob", off, ref, scale)
    assert not dev.ok and 1.9 < dev.ratio < 2.1
    nan = ref.clone()
    nan[2] = math.nan
    assert not contract.compare_outputs(e, "logprob", nan, ref, scale).ok
    inf = ref.clone()
    inf[1] = -math.inf
    assert contract.compare_outputs(e, "logprob", inf, inf, scale).ok


def test_compare_grad():
    e = contract.entry("linear_logprob", torch.bfloat16)
    ref = torch.randn(100, dtype=torch.float64)
    assert contract.compare_grad(e, "g", ref.to(torch.bfloat16), ref, 10.0).ok
    assert not contract.compare_grad(e, "g", ref * 1.1, ref, 10.0).ok
    assert not contract.compare_grad(e, "g", torch.full_like(ref, math.nan), ref, 10.0).ok
    assert contract.compare_grad(e, "g", torch.zeros(3), torch.zeros(3), 1.0).ok
    tiny = torch.full((4,), 0.5 * e.atol)
    assert contract.compare_grad(e, "g", tiny, torch.zeros(4), 1.0).ok
    assert not contract.compare_grad(e, "g", 4 * tiny, torch.zeros(4), 1.0).ok


def test_results_beyond_the_dtype_range_are_exact_when_correctly_rounded():
    """+-inf where the ground truth exceeds the output dtype's largest value is its correctly rounded value; inf of
    the wrong sign, inf where the truth is in range, and NaN still fail."""
    e = contract.entry("policy_loss", "float32")
    truth = torch.tensor([3.7e50, -1e40, 2.0], dtype=torch.float64)
    scale = torch.ones(3, dtype=torch.float64)
    assert contract.compare_outputs(e, "x", torch.tensor([float("inf"), -float("inf"), 2.0]), truth, scale).ok
    assert not contract.compare_outputs(e, "x", torch.tensor([-float("inf"), -float("inf"), 2.0]), truth, scale).ok
    assert not contract.compare_outputs(
        e, "x", torch.tensor([float("inf"), -float("inf"), float("inf")]), truth, scale
    ).ok
    g = contract.entry("selected_logprob", "float16")
    big = torch.tensor([1e6, 1.0], dtype=torch.float64)  # 1e6 is beyond float16's 65504
    assert contract.compare_grad(g, "g", torch.tensor([float("inf"), 1.0], dtype=torch.float16), big, 1.0).ok
    assert not contract.compare_grad(g, "g", torch.tensor([float("nan"), 1.0], dtype=torch.float16), big, 1.0).ok


def test_a_gradient_below_its_dtypes_normal_range_may_round_to_zero():
    """float16 holds nothing below 6.1e-5 with relative precision: a true gradient of 1e-7 that comes out 0 (or a
    subnormal) passes; the same error on a gradient in the normal range fails."""
    e = contract.entry("selected_logprob", "float16")
    tiny = torch.tensor([1e-7, -1e-7], dtype=torch.float64)
    assert contract.compare_grad(e, "g", torch.zeros(2, dtype=torch.float16), tiny, 1.0).ok
    normal = torch.tensor([1e-1, -1e-1], dtype=torch.float64)
    assert not contract.compare_grad(e, "g", torch.tensor([0.09, -0.1], dtype=torch.float16), normal, 1.0).ok
