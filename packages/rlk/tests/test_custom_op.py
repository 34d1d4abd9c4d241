"""rlk.core.custom_op: the direct eager path and torch's custom-op path give bitwise the same results.

Every public op runs twice on the same inputs: plainly (eager: the op bodies are called directly, through a
``torch.autograd.Function`` when a gradient is needed) and under a pass-through ``TorchDispatchMode``, which
makes every call take torch's dispatcher and the registered custom-op autograd (the path ``torch.compile``
and ``opcheck`` see). Outputs and every input gradient must be ``torch.equal``. Also: which path a call
takes, and that each primitive is an :class:`rlk.core.custom_op.Op`.
"""

from __future__ import annotations

import importlib
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import rlk
from rlk.core import custom_op


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _gen():
    return torch.Generator().manual_seed(0)


def _leaf(*shape, gen, scale=1.0):
    return (torch.randn(*shape, generator=gen, dtype=torch.float32) * scale).requires_grad_()


def _case_policy_loss(gen):
    lp, old, adv = _leaf(3, 8, gen=gen), torch.randn(3, 8, generator=gen), torch.randn(3, 8, generator=gen)
    ent = _leaf(3, 8, gen=gen)
    mask = torch.rand(3, 8, generator=gen) < 0.8
    return (lp, ent), lambda: rlk.policy_loss(lp, old, adv, mask, dual_clip=3.0, entropy=ent, entropy_coef=0.01)


def _case_kl_penalty(gen):
    lp, ref = _leaf(4, 5, gen=gen), torch.randn(4, 5, generator=gen)
    return (lp,), lambda: rlk.kl_penalty(lp, ref, "k3")


def _case_rms_norm(gen):
    x, w, r = _leaf(5, 16, gen=gen), _leaf(16, gen=gen), _leaf(5, 16, gen=gen)
    return (x, w, r), lambda: rlk.rms_norm(x, w, 1e-6, residual=r)


def _case_linear(gen):
    x, w, b = _leaf(5, 16, gen=gen), _leaf(12, 16, gen=gen), _leaf(12, gen=gen)
    return (x, w, b), lambda: rlk.linear(x, w, b)


def _case_softmax(gen):
    x = _leaf(4, 33, gen=gen)
    return (x,), lambda: (rlk.softmax(x), rlk.log_softmax(x))


def _case_rope(gen):
    q, k = _leaf(1, 4, 6, 8, gen=gen), _leaf(1, 2, 6, 8, gen=gen)
    angles = torch.rand(1, 6, 8, generator=gen)
    return (q, k), lambda: rlk.apply_rope(q, k, angles.cos(), angles.sin())


def _case_embedding(gen):
    w = _leaf(10, 8, gen=gen)
    ids = torch.randint(0, 10, (7,), generator=gen)
    return (w,), lambda: rlk.embedding(ids, w)


def _case_attention(gen):
    q, k, v = _leaf(9, 4, 16, gen=gen), _leaf(9, 2, 16, gen=gen), _leaf(9, 2, 16, gen=gen)
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    return (q, k, v), lambda: rlk.attention(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=5, max_seqlen_k=5, return_lse=True
    )


def _case_prefix_attention(gen):
    q, k, v = _leaf(12, 4, 16, gen=gen), _leaf(12, 2, 16, gen=gen), _leaf(12, 2, 16, gen=gen)
    cu = torch.tensor([0, 4, 9, 12], dtype=torch.int32)
    prefix_index = torch.tensor([-1, 0, 0], dtype=torch.int32)
    return (q, k, v), lambda: rlk.prefix_attention(
        q,
        k,
        v,
        cu_seqlens_q=cu,
        cu_seqlens_k=cu,
        max_seqlen_q=5,
        max_seqlen_k=5,
        prefix_index=prefix_index,
        return_lse=True,
    )


def _case_selected_logprob(gen):
    logits = _leaf(4, 11, gen=gen)
    targets = torch.tensor([1, -100, 10, 0])
    return (logits,), lambda: rlk.selected_logprob(logits, targets, temperature=0.7, return_entropy=True)


def _case_linear_logprob(gen):
    h, w = _leaf(4, 8, gen=gen), _leaf(11, 8, gen=gen)
    targets = torch.tensor([1, -100, 10, 0])
    return (h, w), lambda: rlk.linear_logprob(h, w, targets, return_entropy=True)


def _case_value_loss(gen):
    v, old, ret = _leaf(3, 6, gen=gen), torch.randn(3, 6, generator=gen), torch.randn(3, 6, generator=gen)
    mask = torch.rand(3, 6, generator=gen) < 0.8
    return (v,), lambda: rlk.value_loss(v, old, ret, mask)


def _case_dpo_loss(gen):
    c, r = _leaf(5, gen=gen), _leaf(5, gen=gen)
    rc, rr = torch.randn(5, generator=gen), torch.randn(5, generator=gen)
    return (c, r), lambda: rlk.dpo_loss(c, r, rc, rr)


def _case_advantages(gen):
    scores = torch.randn(8, generator=gen)
    rewards, values = torch.randn(2, 6, generator=gen), torch.randn(2, 6, generator=gen)
    mask = torch.rand(2, 6, generator=gen) < 0.8
    return (), lambda: (
        rlk.group_advantages(scores, group_size=4),
        rlk.masked_whiten(values, mask),
        rlk.discounted_returns(rewards, mask, 0.9),
        rlk.gae(rewards, values, mask, gamma=0.9, lam=0.8),
    )


CASES = {name[len("_case_") :]: fn for name, fn in globals().items() if name.startswith("_case_")}


def _flat(out) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out]
    if isinstance(out, dict):
        return [t for key in sorted(out) for t in _flat(out[key])]
    return [t for item in out for t in _flat(item)]


def _run(case, through_dispatcher: bool):
    leaves, fn = case(_gen())
    if through_dispatcher:
        with _PassThrough():
            outputs = _flat(fn())
    else:
        outputs = _flat(fn())
    differentiable = [o for o in outputs if o.requires_grad]
    grads = []
    if leaves:
        assert differentiable, "the case must produce something to differentiate"
        total = sum((o.float() * (i + 1)).sum() for i, o in enumerate(differentiable))
        grads = list(torch.autograd.grad(total, leaves, allow_unused=True))
    return [o.detach() for o in outputs], grads


@pytest.mark.parametrize("name", sorted(CASES))
def test_eager_path_equals_the_custom_op_path_bitwise(name):
    eager_out, eager_grads = _run(CASES[name], through_dispatcher=False)
    op_out, op_grads = _run(CASES[name], through_dispatcher=True)
    assert len(eager_out) == len(op_out) and len(eager_grads) == len(op_grads)
    for a, b in zip(eager_out + eager_grads, op_out + op_grads):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a, b), f"{name}: the eager and custom-op paths differ"


DIFFERENTIABLE = sorted(name for name, case in CASES.items() if case(_gen())[0])


@pytest.mark.parametrize("backend", ["reference", pytest.param("triton", marks=pytest.mark.triton_interpreter)])
@pytest.mark.parametrize("through_dispatcher", [False, True])
@pytest.mark.parametrize("name", DIFFERENTIABLE)
def test_double_backward_is_refused_with_the_op_name(name, through_dispatcher, backend):
    """A backward with create_graph=True (second-order gradients) raises at once, naming the public op: rlk's
    backward kernels are first order, so a graph through them would be wrong (reference) or detached (Triton)."""
    leaves, fn = CASES[name](_gen())
    with rlk.use_backend(backend):
        if through_dispatcher:
            with _PassThrough():
                outputs = _flat(fn())
        else:
            outputs = _flat(fn())
        total = sum(o.float().sum() for o in outputs if o.requires_grad)
        with pytest.raises(custom_op.DoubleBackwardError, match=r"rlk\.\w+: double backward is not supported"):
            torch.autograd.grad(total, leaves, create_graph=True, allow_unused=True)
        grads = torch.autograd.grad(
            sum(o.float().sum() for o in _flat(fn()) if o.requires_grad), leaves, allow_unused=True
        )
    assert any(g is not None for g in grads)


@pytest.mark.parametrize("name", sorted(CASES))
def test_autocast_changes_no_bit(name):
    """Under ``torch.autocast`` an rlk op computes as it does outside it (the reference's fp32 matmuls and
    statistics used to run in bf16 there: linear_logprob moved by 0.04)."""
    plain_out, plain_grads = _run(CASES[name], through_dispatcher=False)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        auto_out, auto_grads = _run(CASES[name], through_dispatcher=False)
    for a, b in zip(plain_out + plain_grads, auto_out + auto_grads):
        assert (a is None) == (b is None)
        if a is not None:
            assert torch.equal(a, b), f"{name}: autocast changed a result"


def _norm_op():
    return importlib.import_module("rlk.ops.norm")._rms_norm_fwd


def test_every_primitive_is_an_op():
    for module in (
        "advantages",
        "attention",
        "embedding",
        "logprob",
        "losses",
        "matmul",
        "norm",
        "policy_loss",
        "rope",
        "softmax",
    ):
        mod = importlib.import_module(f"rlk.ops.{module}")
        ops = [v for k, v in vars(mod).items() if k.endswith(("_fwd", "_bwd")) and k.startswith("_")]
        assert ops, module
        assert all(isinstance(op, custom_op.Op) for op in ops), module


def test_plain_eager_calls_skip_the_dispatcher():
    op = _norm_op()
    x, w = torch.randn(3, 8, requires_grad=True), torch.randn(8)
    with mock.patch.object(op, "custom_op", side_effect=AssertionError("dispatcher path taken")):
        y = rlk.rms_norm(x, w)  # autograd.Function path
        y.sum().backward()
        with torch.no_grad():
            rlk.rms_norm(x, w)  # direct body
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_dispatch_modes_and_subclasses_take_the_custom_op():
    op = _norm_op()
    calls = []
    real = op.custom_op

    def spy(*args):
        calls.append(args)
        return real(*args)

    x, w = torch.randn(3, 8), torch.randn(8)
    with mock.patch.object(op, "custom_op", side_effect=spy):
        with _PassThrough():
            rlk.rms_norm(x, w)
        assert len(calls) == 1
        with torch._subclasses.fake_tensor.FakeTensorMode() as fake_mode:
            y = rlk.rms_norm(fake_mode.from_tensor(x), fake_mode.from_tensor(w))
        assert len(calls) == 2 and y.shape == x.shape
        rlk.rms_norm(x, w)
        assert len(calls) == 2


@pytest.fixture
def profiler_ranges():
    rlk.set_profiler_ranges(True)
    yield
    rlk.set_profiler_ranges(False)


@pytest.mark.parametrize("through_dispatcher", [False, True])
def test_profiler_ranges_name_every_primitive_call(profiler_ranges, through_dispatcher):
    """With ranges on, a forward + backward shows ``torch.profiler`` ranges named after the primitives, on both
    call paths; NVTX gets one range per primitive call, pushed and popped in pairs."""
    x, w = torch.randn(3, 8, requires_grad=True), torch.randn(8, requires_grad=True)
    pushed = []
    with (
        mock.patch.object(torch.cuda, "is_available", return_value=True),
        mock.patch.object(torch.cuda.nvtx, "range_push", side_effect=pushed.append),
        mock.patch.object(torch.cuda.nvtx, "range_pop", side_effect=lambda: pushed.append("pop")),
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof,
    ):
        if through_dispatcher:
            with _PassThrough():
                rlk.rms_norm(x, w).sum().backward()
        else:
            rlk.rms_norm(x, w).sum().backward()
    names = [e.name for e in prof.events()]
    # (torch's dispatcher records a range of the custom op's name too)
    assert "rlk::rms_norm_fwd" in names and "rlk::rms_norm_bwd" in names, names
    assert pushed == ["rlk::rms_norm_fwd", "pop", "rlk::rms_norm_bwd", "pop"]


def test_profiler_ranges_are_off_by_default_and_take_a_bool():
    x, w = torch.randn(3, 8), torch.randn(8)
    with (
        mock.patch.object(torch.cuda.nvtx, "range_push", side_effect=AssertionError("range pushed")),
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof,
    ):
        rlk.rms_norm(x, w)
    assert not any(e.name.startswith("rlk::") for e in prof.events())
    with pytest.raises(TypeError, match="enabled: expected a bool"):
        rlk.set_profiler_ranges(1)
