"""The PyTorch baselines of ``bench_asv/benchmarks/rl_objectives.py``, ``distill.py``, ``pack.py``, ``rewards.py`` and
``multimodal.py``
compute what the rlk implementations they are timed against compute: a speedup over a baseline that does something
else would mean nothing."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

import rlk

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "bench_asv"))
from benchmarks import distill as bench_distill  # noqa: E402
from benchmarks import multimodal as bench_multimodal  # noqa: E402
from benchmarks import pack as bench_pack  # noqa: E402
from benchmarks import rewards as bench_rewards  # noqa: E402
from benchmarks import rl_objectives as bench  # noqa: E402


@pytest.mark.parametrize("global_tokens", [None, 1000.0])
def test_ppo_baseline_matches_rlk(global_tokens):
    """Loss, clip fraction, approx KL and the gradient of the eager composition against ``rlk.policy_loss`` (autograd)
    and ``rlk.policy_loss_and_grad``, token-mean over the mask's count or over ``global_tokens`` (not the count: the
    loss must use it, the metrics must not)."""
    gen = torch.Generator(bench.DEVICE).manual_seed(3)
    logprob, old, advantages, mask = bench._token_inputs(4, 50, gen)
    assert global_tokens is None or global_tokens != float(mask.sum())
    logprob.requires_grad_()
    base = bench.torch_ppo_loss(logprob, old, advantages, mask, global_tokens)
    (base_grad,) = torch.autograd.grad(base[0], logprob)
    with rlk.use_backend("reference"):
        ours = bench.rlk_ppo_loss(logprob, old, advantages, mask, global_tokens)
        (ours_grad,) = torch.autograd.grad(ours[0], logprob)
        loss, grad, clip_fraction, approx_kl = bench.rlk_ppo_loss_and_grad(
            logprob, old, advantages, mask, global_tokens
        )
    for got in (ours, (loss, clip_fraction, approx_kl)):
        for a, b in zip(got, base):
            torch.testing.assert_close(a.detach(), b.detach(), rtol=1e-5, atol=1e-7)
    for g in (ours_grad, grad):
        torch.testing.assert_close(g, base_grad, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize("divergence", bench_distill.DIVERGENCES)
def test_distill_baseline_matches_rlk(divergence):
    """The plain-formula baseline of ``fused_linear_kl`` (F.kl_div / logaddexp on materialized logits): loss and
    gradients equal rlk's at the benchmark's temperature and beta, with ignored rows."""
    case = bench_distill.Case("fused_linear_kl", "torch_eager", divergence, (16, 32, 100))
    case.targets[::3] = -100
    base = bench_distill.torch_divergence(*case.inputs, *case.teacher, case.targets, divergence)
    base_grads = torch.autograd.grad(base, case.inputs)
    with rlk.use_backend("reference"):
        ours = bench_distill.rlk_divergence(*case.inputs, *case.teacher, case.targets, divergence)
        ours_grads = torch.autograd.grad(ours, case.inputs)
    torch.testing.assert_close(ours, base, rtol=1e-5, atol=1e-6)
    for a, b in zip(ours_grads, base_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_grpo_k3_baseline_matches_rlk():
    """The fused-linear benchmark's PyTorch GRPO loss (clip 0.2 / 0.28, verl's clamped k3 KL, token-mean) is what
    ``rlk.fused_linear_policy_loss`` computes in both modes: loss and gradients of hidden and weight."""
    gen = torch.Generator(bench.DEVICE).manual_seed(5)
    b, t, h, v = 2, 16, 32, 200
    hidden = torch.randn(b, t, h, generator=gen, device=bench.DEVICE)
    weight = torch.randn(v, h, generator=gen, device=bench.DEVICE) * h**-0.5
    targets = torch.randint(0, v, (b, t), generator=gen, device=bench.DEVICE)
    _, old, advantages, mask = bench._token_inputs(b, t, gen)
    ref = old + 0.3 * torch.randn(b, t, generator=gen, device=bench.DEVICE)
    args = (targets, old, ref, advantages, mask)
    results = []
    for fn in (
        bench.torch_grpo_k3_loss,
        lambda *a: bench.rlk_grpo_k3_loss(*a, mode="lean"),
        lambda *a: bench.rlk_grpo_k3_loss(*a, mode="one_pass"),
    ):
        hh, ww = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        with rlk.use_backend("reference"):
            loss = fn(hh, ww, *args)
        results.append((loss.detach(), *torch.autograd.grad(loss, (hh, ww))))
    base = results[0]
    assert float(base[0]) != 0.0
    for got in results[1:]:
        for a, b_ in zip(got, base):
            torch.testing.assert_close(a, b_, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("option", bench_pack.OPTIONS)
def test_pack_baseline_matches_rlk(option):
    """The boolean-mask indexing baseline of ``rlk.pack`` / ``rlk.unpack`` (``torch_index``): the same outputs
    (packed rows, ``cu_seqlens`` and position ids; the unpacked batch, zeros at the padding) and the same gradient,
    bitwise, on the benchmark's right-padded mask."""
    shape = (4, 16, 8)
    base = bench_pack.PackCase("pack", "torch_index", option, shape)
    assert 0 < int(base.mask.sum()) < base.mask.numel()
    base_grad = base.step()
    with rlk.use_backend("reference"):
        case = bench_pack.PackCase("pack", "rlk", option, shape)
        grad = case.step()
        if option == "pack_fwd_bwd":
            ours, theirs = rlk.pack(case.input, case.mask), bench_pack.torch_pack(base.input, base.mask)
        else:
            ours, theirs = (rlk.unpack(case.input, case.mask),), (bench_pack.torch_unpack(base.input, base.mask),)
    assert torch.equal(case.input, base.input) and torch.equal(case.mask, base.mask)
    for a, b in zip(ours, theirs):
        assert a.dtype == b.dtype and torch.equal(a.detach(), b.detach())
    assert torch.equal(grad, base_grad)


@pytest.mark.parametrize("option", bench_rewards.OPTIONS)
def test_scatter_rewards_baseline_matches_rlk(option):
    """The framework composition (nansum of weighted columns, overlong penalty, view(-1, G) statistics, placement)
    gives rlk.scatter_rewards' token rewards / advantages."""
    gen = torch.Generator(bench_rewards.DEVICE).manual_seed(4)
    rewards, weights, mask = bench_rewards.make_inputs(32, 40, gen)
    base = bench_rewards.torch_scatter_rewards(rewards, weights, mask, option)
    with rlk.use_backend("reference"):
        ours = bench_rewards.rlk_scatter_rewards(rewards, weights, mask, option)
    assert bool((base != 0).any())
    torch.testing.assert_close(ours, base, rtol=1e-5, atol=1e-6)


def test_span_logprob_baseline_matches_rlk():
    """The dense framework-style path and ``linear_logprob(..., loss_spans=)`` on the benchmark's batch: the same
    log-probs and gradients (fp32, within rounding), zero off the spans in both, and the spans are the mask."""
    b, t, h, v = 3, 64, 16, 50
    targets, spans, mask = bench_multimodal.vlm_batch(b, t, v)
    assert torch.equal(rlk.multimodal.spans_to_mask(spans, (b, t)), mask)
    assert 0.1 < mask.float().mean() < 0.5
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(b, t, h, generator=gen).requires_grad_()
    weight = (torch.randn(v, h, generator=gen) * 0.3).requires_grad_()
    with rlk.use_backend("reference"):
        ours = bench_multimodal.rlk_span_logprob(hidden, weight, targets, spans)
    base = bench_multimodal.torch_dense_logprob(hidden, weight, targets, mask)
    assert torch.equal(ours == 0, ~mask) and torch.equal(base == 0, ~mask)
    torch.testing.assert_close(ours, base, rtol=1e-5, atol=1e-5)
    for a, c in zip(
        torch.autograd.grad(ours.sum(), (hidden, weight)), torch.autograd.grad(base.sum(), (hidden, weight))
    ):
        torch.testing.assert_close(a, c, rtol=1e-4, atol=1e-5)
