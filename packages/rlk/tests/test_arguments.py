"""Arguments that used to be coerced silently or failed with an internal exception now give a clear error
naming the argument (``rlk.core.checks``), on the reference backend and on Triton (through the interpreter).

Also: meta tensors give shapes (the fake implementations), and a call the Triton kernels cannot serve
(head dim above 256) is declined with its reason instead of failing inside the launcher.
"""

from __future__ import annotations

import numpy as np
import public_calls
import pytest
import torch

import rlk
from rlk.app import cli

BACKENDS = ["reference", pytest.param("triton", marks=pytest.mark.triton_interpreter)]


def _logits():
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(0)), torch.tensor([1, 2, 1, 3])


def _policy_inputs():
    g = torch.Generator().manual_seed(1)
    lp = -torch.rand(2, 5, generator=g)
    return lp, lp - 0.1, torch.randn(2, 5, generator=g), torch.ones(2, 5, dtype=torch.bool)


# ---------------------------------------------------------------------------
# integer indices
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [1.5, True, None, "1", 1.0])
def test_ignore_index_must_be_an_integer(backend, bad):
    """``ignore_index=1.5`` used to be truncated to 1 (every target 1 then ignored); ``None`` raised from int()."""
    logits, targets = _logits()
    hidden, weight = torch.randn(4, 6), torch.randn(8, 6)
    lp, old, adv, mask = _policy_inputs()
    with rlk.use_backend(backend):
        with pytest.raises(TypeError, match=r"ignore_index: expected an integer, got"):
            rlk.selected_logprob(logits, targets, ignore_index=bad)
        with pytest.raises(TypeError, match=r"ignore_index: expected an integer, got"):
            rlk.linear_logprob(hidden, weight, targets, ignore_index=bad)
        with pytest.raises(TypeError, match=r"ignore_index: expected an integer, got"):
            rlk.fused_linear_policy_loss(
                hidden.view(2, 2, 6), weight, targets.view(2, 2), None, adv[:, :2], mask[:, :2], ignore_index=bad
            )


def test_integer_like_ignore_index_is_accepted():
    logits, targets = _logits()
    want = rlk.selected_logprob(logits, targets, ignore_index=1)
    assert torch.equal(rlk.selected_logprob(logits, targets, ignore_index=np.int64(1)), want)
    assert float(want[0]) == 0.0 and float(want[2]) == 0.0 and float(want[1]) < 0.0


def test_embedding_padding_idx_must_be_an_integer():
    with pytest.raises(TypeError, match=r"padding_idx: expected an integer, got float 1.5"):
        rlk.embedding(torch.tensor([1, 2]), torch.randn(5, 3), padding_idx=1.5)


# ---------------------------------------------------------------------------
# temperatures: finite and > 0 in the dtype they are used in
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "bad, message",
    [
        (1e39, r"temperature: 1e\+39 overflows torch.float32"),
        (1e-50, r"temperature: 1e-50 rounds to 0 in torch.float32"),
        (1e-40, r"temperature: 1e-40 is so small that 1/temperature overflows torch.float32"),
        (float("inf"), r"temperature: must be a finite number > 0, got inf"),
        (0.0, r"temperature: must be a finite number > 0, got 0.0"),
    ],
)
def test_temperature_numbers(backend, bad, message):
    logits, targets = _logits()
    with rlk.use_backend(backend), pytest.raises(ValueError, match=message):
        rlk.selected_logprob(logits, targets, temperature=bad)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "bad, found",
    [
        (float("inf"), "inf or a value above 3.403e+38"),
        (0.0, "0 or a value so small that 1/temperature overflows torch.float32"),
        (1e-50, "0 or a value so small"),  # a float64 tensor: 0 in float32
        (-2.0, "-2.0"),
        (float("nan"), "nan"),
    ],
)
def test_temperature_tensors(backend, bad, found):
    """A tensor holding +inf used to raise ZeroDivisionError while the message was formatted; 1e-50 said 0.0."""
    logits, targets = _logits()
    temperature = torch.tensor([1.0, bad, 1.0, 1.0], dtype=torch.float64)
    with rlk.use_backend(backend), pytest.raises(ValueError) as info:
        rlk.selected_logprob(logits, targets, temperature=temperature)
    assert str(info.value).startswith(f"temperature: must be finite and > 0; found {found}")
    assert str(info.value).endswith("at flat position 1")


# ---------------------------------------------------------------------------
# aggregation normalizers given as tensors
# ---------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bad", [0.0, -3.0, float("nan"), float("inf")])
def test_tensor_normalizers_are_checked(backend, bad):
    """``global_tokens=torch.tensor(0.)`` used to give loss = inf (NaN on the reference)."""
    lp, old, adv, mask = _policy_inputs()
    value = torch.tensor(bad)
    with rlk.use_backend(backend):
        for call in (rlk.policy_loss, rlk.policy_loss_and_grad):
            with pytest.raises(ValueError, match=r"global_tokens: must be finite and > 0; found"):
                call(lp, old, adv, mask, global_tokens=value)
            with pytest.raises(ValueError, match=r"global_seqs: must be finite and > 0; found"):
                call(lp, old, adv, mask, agg="seq-mean-token-mean", global_seqs=value)
            with pytest.raises(ValueError, match=r"loss_scale: must be finite and > 0; found"):
                call(lp, old, adv, mask, agg="seq-mean-token-sum-norm", loss_scale=value)
        with pytest.raises(
            ValueError,
            match=r"global_tokens: must be finite and > 0; the aggregation weight they give "
            r"row 0 is",
        ):
            rlk.value_loss(lp, old, adv, mask, global_tokens=value)
        loss, _ = rlk.policy_loss(lp, old, adv, mask, global_tokens=torch.tensor(7.0))
        assert torch.isfinite(loss)


def test_number_normalizers_whose_reciprocal_overflows():
    lp, old, adv, mask = _policy_inputs()
    with pytest.raises(ValueError, match=r"global_tokens: 1e-45 is so small that 1/global_tokens overflows"):
        rlk.policy_loss(lp, old, adv, mask, global_tokens=1e-45)


# ---------------------------------------------------------------------------
# cu_seqlens, empty tensors, meta tensors
# ---------------------------------------------------------------------------


def _attn(q_tokens=6, k_tokens=6, head_dim=8):
    g = torch.Generator().manual_seed(2)
    return (
        torch.randn(q_tokens, 2, head_dim, generator=g),
        torch.randn(k_tokens, 2, head_dim, generator=g),
        torch.randn(k_tokens, 2, head_dim, generator=g),
    )


@pytest.mark.parametrize("backend", BACKENDS)
def test_cu_seqlens_edited_in_place_are_checked_again(backend):
    """The values were validated once and then remembered by tensor identity and version counter, which a write
    through ``.data`` or NumPy does not bump: the edited offsets ran unchecked."""
    q, k, v = _attn()
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with rlk.use_backend(backend):
        rlk.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4)
        cu.data[1] = 7
        with pytest.raises(ValueError, match=r"cu_seqlens_q: must be non-decreasing; sequence 1 has offsets 7 -> 6"):
            rlk.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4)
        cu.data[1] = 2
        cu.numpy()[2] = 5
        with pytest.raises(ValueError, match=r"cu_seqlens_q: must end at the number of tokens of q \(6\), ends at 5"):
            rlk.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4)


def test_empty_q_still_checks_cu_seqlens():
    q, k, v = _attn(q_tokens=0)
    cu_q = torch.tensor([0, 0, 0], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"cu_seqlens_k: must end at the number of tokens of k and v \(6\), ends at 9"):
        rlk.attention(
            q,
            k,
            v,
            cu_seqlens_q=cu_q,
            cu_seqlens_k=torch.tensor([0, 3, 9], dtype=torch.int32),
            max_seqlen_q=0,
            max_seqlen_k=6,
        )
    out = rlk.attention(
        q,
        k,
        v,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=torch.tensor([0, 3, 6], dtype=torch.int32),
        max_seqlen_q=0,
        max_seqlen_k=3,
    )
    assert out.shape == (0, 2, 8)


def test_embedding_with_no_columns_checks_its_ids():
    with pytest.raises(ValueError, match=r"ids: values must lie in \[0, 10\); found 100 at flat position 1"):
        rlk.embedding(torch.tensor([5, 100]), torch.randn(10, 0))
    assert rlk.embedding(torch.tensor([5, 9]), torch.randn(10, 0)).shape == (2, 0)


def test_linear_logprob_with_no_hidden_columns():
    with pytest.raises(ValueError, match=r"hidden: expected shape \[\.\.\., H\] with H >= 1, got \(4, 0\)"):
        rlk.linear_logprob(torch.randn(4, 0), torch.randn(8, 0), torch.tensor([1, 2, 1, 3]))


def test_meta_tensors_give_shapes():
    """Meta tensors have no data: the ops run their fake implementations (shapes and dtypes, forward and backward)
    instead of failing in a value check."""
    meta = torch.device("meta")
    logits = torch.randn(4, 8, device=meta, requires_grad=True)
    targets = torch.zeros(4, dtype=torch.int64, device=meta)
    lp, ent = rlk.selected_logprob(logits, targets, return_entropy=True, temperature=torch.ones(4, device=meta))
    (lp.sum() + ent.sum()).backward()
    assert lp.shape == (4,) and lp.is_meta and logits.grad.shape == (4, 8) and logits.grad.is_meta
    hidden = torch.randn(2, 3, 8, device=meta, requires_grad=True)
    weight = torch.randn(16, 8, device=meta, requires_grad=True)
    rlk.linear_logprob(hidden, weight, torch.zeros(2, 3, dtype=torch.int64, device=meta)).sum().backward()
    assert hidden.grad.shape == hidden.shape and weight.grad.shape == weight.shape
    loss, metrics = rlk.policy_loss(
        *(x.to(meta) for x in _policy_inputs()), global_tokens=torch.tensor(3.0, device=meta)
    )
    assert loss.shape == () and loss.is_meta and metrics["clip_fraction"].is_meta
    q, k, v = (x.to(meta) for x in _attn())
    cu = torch.tensor([0, 2, 6], dtype=torch.int32, device=meta)
    assert rlk.attention(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4).is_meta
    assert rlk.rms_norm(torch.randn(3, 8, device=meta), torch.ones(8, device=meta)).shape == (3, 8)


# ---------------------------------------------------------------------------
# a call the Triton kernels cannot serve is declined, not failed
# ---------------------------------------------------------------------------


@pytest.mark.triton_interpreter
def test_triton_declines_head_dims_above_256():
    q, k, v = _attn(head_dim=320)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    kwargs = dict(cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=4, max_seqlen_k=4)
    decision = rlk.core.dispatch.decide("attention", q.device, q.dtype, {"head_dim": 320})
    with rlk.use_backend("triton"):
        pinned = rlk.core.dispatch.decide("attention", q.device, q.dtype, {"head_dim": 320})
        assert pinned.backend is None and pinned.skipped == (("triton", "head_dim = 320 is above its limit of 256"),)
        with pytest.raises(rlk.BackendError, match="head_dim = 320 is above its limit of 256"):
            rlk.attention(q, k, v, **kwargs)
        assert rlk.core.dispatch.decide("attention", q.device, q.dtype, {"head_dim": 256}).backend == "triton"
    assert decision.backend == "reference"
    with rlk.batch_invariant():  # SDPA of an unmodified model: head dim 320 is not routed to Triton
        out = torch.nn.functional.scaled_dot_product_attention(
            q[None].transpose(1, 2), k[None].transpose(1, 2), v[None].transpose(1, 2)
        )
    assert out.shape == (1, 2, 6, 320)


# ---------------------------------------------------------------------------
# boolean options: a bool, nothing else
# ---------------------------------------------------------------------------

BOOL_OPTIONS = public_calls.bool_options()


def _bool_option_params() -> list:
    return [pytest.param(op, option, id=f"{op}-{option}") for op, option in BOOL_OPTIONS]


def test_every_boolean_option_is_found_and_has_a_call():
    """The options are found from the signatures (so a new one is covered); each op has a call to try them on."""
    found = set(BOOL_OPTIONS)
    for known in (
        ("rlk.kl_penalty", "straight_through"),
        ("rlk.kl_penalty", "k3_clamp"),
        ("rlk.PolicyLossConfig", "kl_unbiased"),
        ("rlk.policy_loss", "kl_k3_clamp"),  # a config field, given as a keyword of the call
        ("rlk.fused_linear_policy_loss", "kl_unbiased"),
        ("rlk.selected_logprob", "return_entropy"),
        ("rlk.masked_whiten", "shift_mean"),
        ("rlk.integrations.verl.compute_grpo_outcome_advantage", "norm_adv_by_std_in_grpo"),
    ):
        assert known in found, known
    missing = sorted({op for op, _ in BOOL_OPTIONS} - set(public_calls.BOOL_CALLS))
    assert not missing, f"add a call of {missing} to public_calls.BOOL_CALLS"


@pytest.mark.parametrize("value", ["False", 2, None], ids=["str", "int", "None"])
@pytest.mark.parametrize("op, option", _bool_option_params())
def test_boolean_options_refuse_non_bools(op, option, value):
    """``kl_penalty(straight_through='False')``, ``PolicyLossConfig(kl_unbiased=2)``, ``return_entropy='no'`` used to
    switch the option on (``bool('False')`` is True) and ``k3_clamp=None`` to switch it off: every boolean option of
    the public API takes a bool only (``rlk.core.checks.flag``), and the error names it."""
    with pytest.raises((TypeError, ValueError), match=rf"^{option}: expected a bool, got"):
        public_calls.call_option(op, option, value)


@pytest.mark.parametrize("op, option", [pytest.param(op, option, id=f"{op}-{option}") for op, option in BOOL_OPTIONS])
def test_boolean_options_take_bools(op, option):
    """The control: True and False are never refused as the option (a call may still need what the minimal call
    lacks, such as a transformers model, and say so naming that argument)."""
    for value in (True, False):
        try:
            public_calls.call_option(op, option, value)
        except (TypeError, ValueError) as err:
            assert not str(err).startswith(f"{option}:"), err


# ---------------------------------------------------------------------------
# dtypes: one rule for the floating inputs of a call
# ---------------------------------------------------------------------------

DTYPE_PARAMS = [
    pytest.param(op, name, dtype, id=f"{op}-{name}-{str(dtype).removeprefix('torch.')}")
    for op, case in public_calls.DTYPE_CASES.items()
    for name in case.inputs()
    for dtype in public_calls.refused_dtypes(case, name)
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("op, name, dtype", DTYPE_PARAMS)
def test_mixed_dtypes_are_refused_naming_the_argument(backend, op, name, dtype):
    """``value_loss(values fp32, old_values fp64)`` used to return an fp64 loss on the reference and raise a
    BackendError that named no argument on Triton; ``policy_loss`` read an fp64 ``old_logprob`` in fp32 silently.
    One rule, checked in the op layer (``rlk.core.checks.same_dtype``): float64 for all floating inputs of a call
    or none, and the operands of a GEMM in one dtype; the error names the first input that breaks it."""
    case = public_calls.DTYPE_CASES[op]
    inputs, named = public_calls.mixed_inputs(case, name, dtype)
    with rlk.use_backend(backend), pytest.raises(TypeError, match=rf"^{named}: expected (float64|the dtype)"):
        case.call(inputs)


@pytest.mark.parametrize("op", sorted(public_calls.DTYPE_CASES))
def test_one_dtype_rule_accepts_what_it_documents(op):
    """The control: all float32, all float64 (reference runs), and 16-bit inputs among float32 ones where the op
    reads them as float32 (not the GEMM operands) run."""
    case = public_calls.DTYPE_CASES[op]
    inputs = case.inputs()
    case.call(inputs)
    case.call({name: x.double() for name, x in inputs.items()})
    exact = set(case.exact) | ({next(iter(inputs))} if case.exact else set())
    case.call({name: x if name in exact else x.to(torch.bfloat16) for name, x in inputs.items()})


# ---------------------------------------------------------------------------
# patch_model and the command line
# ---------------------------------------------------------------------------


def test_patch_model_needs_a_module():
    with pytest.raises(TypeError, match=r"model: expected a torch.nn.Module \(a transformers causal LM\), got None"):
        rlk.patch_model(None)
    with pytest.raises(TypeError, match=r"model: expected a torch.nn.Module"):
        rlk.unpatch_model("gpt2")


@pytest.mark.no_gpu
@pytest.mark.parametrize("command", ["consistency", "demo"])
def test_cli_device_cuda_without_a_gpu_is_a_usage_error(command, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--device", "cuda"])
    assert info.value.code == 2
    assert "argument --device: 'cuda': torch sees no CUDA GPU here" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["consistency", "demo"])
def test_cli_unwritable_out_fails_before_the_run(command, tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--device", "cpu", "--out", str(blocker / "report")])
    assert info.value.code == 2
    assert f"--out {blocker / 'report'}: cannot write there" in capsys.readouterr().err
