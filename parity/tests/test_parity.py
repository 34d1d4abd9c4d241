"""The parity suite itself: it runs a tiny matrix, reports it, and can fail.

Tiny matrices (V in {1000, 3000}, N in {1, 7}) keep these tests fast on the CPU;
the Triton backend runs under its CPU interpreter when no GPU is visible.
Deliberately broken backends are registered by patching ``rlk.core.dispatch.discover``.
"""

from __future__ import annotations

import json
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

import rlk
from parity import cases as cs
from parity import chain, distill, report, rl
from parity.__main__ import main
from parity.run import ALL_OPS, FAIL, NA, PASS, Config, run_matrix, runnable_backends
from rlk.core import abi, dispatch

CPU = torch.device("cpu")

#: ABI ops the parity matrix does not run yet, each with where it is checked instead.
NOT_IN_PARITY = {
    "linear_logprob_stored": "fused_linear_policy_loss's one-pass primitives: checked against the fp64 reference and "
    "the lean mode by packages/rlk/tests/test_linear_policy_loss.py and the backends' "
    "test_linear_policy_loss_kernels.py / test_linear_logprob_stored_cuda.py",
    "ema": "an in-place list update with no output (rlk.ema_): checked against torch._foreach_lerp_ and the fp64 "
    "reference under the contract, for determinism and for independence from the other tensors by "
    "packages/rlk/tests/test_ema.py and packages/rlk-triton/tests/test_ema_kernels.py",
    "sample": "a random draw with integer outputs (rlk.sample), not a tolerance against fp64: checked bitwise "
    "reference vs Triton, for batch invariance, by chi-square tests of the filters and Philox "
    "known-answer vectors by packages/rlk/tests/test_sampling.py and "
    "packages/rlk-triton/tests/test_sampling_kernels.py",
}


def test_the_matrix_covers_every_abi_op():
    """Every op of the ABI is in the parity matrix, or listed in NOT_IN_PARITY with where it is checked: a new op
    cannot enter the ABI unseen by parity."""
    assert len(set(ALL_OPS)) == len(ALL_OPS) and set(ALL_OPS) <= set(abi.OPS)
    assert set(abi.OPS) - set(ALL_OPS) == set(NOT_IN_PARITY)


pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # Triton interpreter: log(0) on masked lanes


@pytest.fixture(autouse=True)
def tiny_matrix(monkeypatch):
    monkeypatch.setattr(cs, "QUICK_VOCABS", (1000, 3000))
    monkeypatch.setattr(cs, "QUICK_ROWS", (1, 7))
    monkeypatch.setitem(cs.INVARIANCE_VOCAB, "cpu", {"selected_logprob": 1000, "linear_logprob": 1000})


def _config(backends, dtypes=("float32",), ops=cs.OPS) -> Config:
    return Config(CPU, list(backends), list(dtypes), list(ops), quick=True, seed=0)


def _run(config: Config):
    return {(c.op, c.dtype, c.backend): c for c in run_matrix(config, progress=lambda line: None)}


def _register(monkeypatch, backend: rlk.Backend) -> None:
    statuses = dict(dispatch.discover())
    statuses[backend.name] = dispatch.BackendStatus(backend.name, backend, None, "test")
    monkeypatch.setattr(dispatch, "discover", lambda: statuses)


def _selected_only(name: str, batch_invariant: bool, after_forward) -> rlk.Backend:
    """The reference's selected_logprob primitives, with ``after_forward(logits, logprob_out)`` applied."""
    ref = dispatch.discover()["reference"].backend.primitives

    def forward(logits, targets, inv_temperature, ignore_index, logprob_out, entropy_out, lse_out):
        ref["selected_logprob_fwd"](logits, targets, inv_temperature, ignore_index, logprob_out, entropy_out, lse_out)
        after_forward(logits, logprob_out)

    return rlk.Backend(
        name=name,
        version="0",
        abi_version=rlk.ABI_VERSION,
        primitives={"selected_logprob_fwd": forward, "selected_logprob_bwd": ref["selected_logprob_bwd"]},
        probe=lambda: None,
        device_types=lambda: ("cpu",),
        batch_invariant=batch_invariant,
    )


def _offset(logits, logprob_out):
    logprob_out.add_(1e-2)


def _depends_on_batch(logits, logprob_out):
    logprob_out.add_(1e-6 * logits.shape[0])  # within the value tolerance, but not the same bits


def _json_roundtrip(config, cells) -> dict:
    env = report.environment(CPU, "python -m parity --quick")
    record = report.to_json(config, cells, {}, env, 1.0)
    return json.loads(json.dumps(record, allow_nan=False))


def test_reference_matrix_passes_and_reports_every_case():
    config = _config(["reference"], dtypes=("float32", "bfloat16"))
    cells = _run(config)
    assert len(cells) == 4 and all(c.status == PASS for c in cells.values())
    selected = cells["selected_logprob", "float32", "reference"]
    assert len(selected.results) == 4
    assert selected.invariance is not None and not selected.invariance.claimed
    assert selected.invariance.verdict.startswith("not claimed (measured: ")

    record = _json_roundtrip(config, list(cells.values()))
    assert record["failed"] is False
    assert {"torch", "triton", "rlk", "device_name", "command"} <= set(record["environment"])
    linear = next(c for c in record["cells"] if c["op"] == "linear_logprob" and c["dtype"] == "float32")
    names = {d["name"] for case in linear["cases"] for d in case["deviations"]}
    assert names == {"logprob", "entropy", "grad_hidden", "grad_weight"}
    assert all(d["ok"] and d["ratio"] <= 1 for case in linear["cases"] for d in case["deviations"])

    markdown = report.to_markdown(config, list(cells.values()), {}, record["environment"], 1.0)
    assert "| op | dtype | reference |" in markdown
    assert "| selected_logprob | bfloat16 | PASS · worst " in markdown
    assert "## Failures\n\nnone" in markdown


@pytest.mark.triton_interpreter
def test_triton_under_the_interpreter():
    assert "triton" in runnable_backends(CPU)[0], "triton must serve the CPU under TRITON_INTERPRET=1"
    cells = _run(_config(["reference", "triton"], dtypes=("float32", "bfloat16")))
    assert cells["linear_logprob", "bfloat16", "triton"].status == NA
    assert "interpreter" in cells["linear_logprob", "bfloat16", "triton"].na_reason
    for key in [("selected_logprob", "float32"), ("selected_logprob", "bfloat16"), ("linear_logprob", "float32")]:
        cell = cells[(*key, "triton")]
        assert cell.status == PASS, [r.worst for r in cell.results]
        assert cell.invariance.claimed and cell.invariance.verdict == "bitwise"


def test_a_backend_off_by_1e_2_fails(monkeypatch):
    _register(monkeypatch, _selected_only("broken", False, _offset))
    cells = _run(_config(["broken"]))
    selected = cells["selected_logprob", "float32", "broken"]
    assert selected.status == FAIL
    case, worst = selected.worst
    assert worst.name == "logprob" and worst.ratio > 100
    linear = cells["linear_logprob", "float32", "broken"]
    assert linear.status == NA and "does not implement linear_logprob_fwd" in linear.na_reason


def test_the_command_line_exits_1_on_failure(monkeypatch, tmp_path, capsys):
    _register(monkeypatch, _selected_only("broken", False, _offset))
    argv = [
        "--device",
        "cpu",
        "--backends",
        "broken",
        "--ops",
        "selected_logprob",
        "--dtypes",
        "fp32",
        "--quick",
        "--out",
        str(tmp_path),
    ]
    assert main(argv) == 1
    assert "| selected_logprob | float32 | FAIL · worst " in capsys.readouterr().out
    record = json.loads((tmp_path / "parity.json").read_text())
    assert record["failed"] is True and record["environment"]["command"].endswith("--out " + str(tmp_path))
    assert (tmp_path / "parity.md").read_text().startswith("# rlk parity report")


def test_a_batch_dependent_backend_breaks_its_invariance_claim(monkeypatch):
    _register(monkeypatch, _selected_only("batchy", True, _depends_on_batch))
    cell = _run(_config(["batchy"], ops=["selected_logprob"]))["selected_logprob", "float32", "batchy"]
    assert all(r.ok for r in cell.results)  # the values are within the contract...
    assert cell.invariance.verdict.startswith("BROKEN")  # ...but the bits depend on the batch
    assert "logprob" in cell.invariance.details
    assert cell.status == FAIL


def test_an_unclaimed_batch_dependence_is_information_only(monkeypatch):
    _register(monkeypatch, _selected_only("batchy", False, _depends_on_batch))
    cell = _run(_config(["batchy"], ops=["selected_logprob"]))["selected_logprob", "float32", "batchy"]
    assert cell.invariance.verdict.startswith("not claimed (measured: differs")
    assert cell.status == PASS


# ---------------------------------------------------------------------------
# the RL-objective ops
# ---------------------------------------------------------------------------

#: What each RL op's cells must check (outputs, and gradients of the differentiable ops).
RL_CHECKS = {
    "policy_loss": {
        "loss",
        "clip_fraction",
        "lower_clip_fraction",
        "approx_kl",
        "ratio_mean",
        "ratio_max",
        "entropy_mean",
        "kl_mean",
        "grad_logprob",
        "grad_entropy",
    },
    "kl_penalty": {"kl", "grad_logprob"},
    "value_loss": {"loss", "vf_clip_fraction", "values_mean", "grad_values"},
    "dpo_loss": {
        "losses",
        "loss",
        "rewards_chosen",
        "rewards_rejected",
        "reward_margin",
        "reward_accuracy",
        "grad_chosen",
        "grad_rejected",
    },
    "group_advantages": {"advantages"},
    "masked_whiten": {"whitened"},
    "discounted_returns": {"returns"},
    "gae": {"advantages", "returns"},
    "rollout_correction": {"weights", *abi.CORRECTION_METRICS},
    "scatter_rewards": {"token_rewards", "token_costs"},
}


#: The RL ops whose parity cells the gate runs (policy_loss, the longest at ~85 s, runs against the fp64 reference
#: in the gate's kernel tests); the others (each served by kernels the gate's kernel tests cover) run in the nightly
#: tier (``slow``).
GATE_RL_OPS = ("kl_penalty", "gae")


@pytest.mark.triton_interpreter
@pytest.mark.parametrize(
    "op", [op if op in GATE_RL_OPS else pytest.param(op, marks=pytest.mark.slow) for op in rl.RL_OPS]
)
def test_rl_op_is_reported_and_passes_on_reference_and_triton(op):
    config = _config(["reference", "triton"], dtypes=("float32", "bfloat16"), ops=(op,))
    cells = _run(config)
    assert set(cells) == {(op, "float32", b) for b in ("reference", "triton")}  # fp32 rows only
    for (_, _, backend), cell in cells.items():
        assert cell.status == PASS, (op, backend, [(r.case.label(), r.error, r.worst) for r in cell.results])
        cases = rl.value_cases(op, "cpu", quick=True)
        assert [r.case for r in cell.results] == cases and any(c.rows == 1 for c in cases)
        assert {d.name for r in cell.results for d in r.deviations} == RL_CHECKS[op]
        assert all(0 <= d.ratio <= 1 for r in cell.results for d in r.deviations)
        if op in rl.INVARIANT_OPS:
            assert cell.invariance is not None and cell.invariance.checks
            assert cell.invariance.claimed == (backend == "triton")
            assert cell.invariance.bitwise, cell.invariance.details
        else:
            assert cell.invariance is None

    record = _json_roundtrip(config, list(cells.values()))
    assert record["failed"] is False
    assert {(c["op"], c["dtype"]) for c in record["cells"]} == {(op, "float32")}
    markdown = report.to_markdown(config, list(cells.values()), {}, record["environment"], 1.0)
    assert f"| {op} | float32 | PASS · worst " in markdown
    assert f"| {op} | bfloat16 |" not in markdown
    assert f"- {op} (float32): " in markdown
    if op in rl.INVARIANT_OPS:
        assert "invariance: bitwise" in markdown
    assert "## Failures\n\nnone" in markdown


def _gae_only(name: str, batch_invariant: bool, after) -> rlk.Backend:
    """The reference's gae primitive, with ``after(rewards, advantages_out)`` applied."""
    ref = dispatch.discover()["reference"].backend.primitives

    def gae_fwd(rewards, values, mask, gamma, gamma_lam, advantages_out, returns_out):
        ref["gae_fwd"](rewards, values, mask, gamma, gamma_lam, advantages_out, returns_out)
        after(rewards, advantages_out)

    return rlk.Backend(
        name=name,
        version="0",
        abi_version=rlk.ABI_VERSION,
        primitives={"gae_fwd": gae_fwd},
        probe=lambda: None,
        device_types=lambda: ("cpu",),
        batch_invariant=batch_invariant,
    )


def test_an_rl_backend_off_by_1e_3_fails(monkeypatch):
    _register(monkeypatch, _gae_only("broken", False, lambda rewards, adv: adv.add_(1e-3)))
    cells = _run(_config(["broken"], ops=["gae", "policy_loss"]))
    gae = cells["gae", "float32", "broken"]
    assert gae.status == FAIL
    _, worst = gae.worst
    assert worst.name == "advantages" and worst.ratio > 1
    assert cells["policy_loss", "float32", "broken"].status == NA


def test_a_batch_dependent_rl_backend_breaks_its_invariance_claim(monkeypatch):
    # a relative change of B * 2^-20: new bits, but well within the contract's rtol
    _register(monkeypatch, _gae_only("batchy", True, lambda rewards, adv: adv.mul_(1 + rewards.shape[0] * 2**-20)))
    cell = _run(_config(["batchy"], ops=["gae"]))["gae", "float32", "batchy"]
    assert all(r.ok for r in cell.results)
    assert cell.invariance.verdict.startswith("BROKEN") and "advantages" in cell.invariance.details
    assert cell.status == FAIL


def test_rl_inputs_are_deterministic_with_ragged_masks():
    for op in rl.RL_OPS:
        for case in rl.value_cases(op, "cpu", quick=False):
            a, b = rl.make_inputs(case, seed=0), rl.make_inputs(case, seed=0)
            assert a.keys() == b.keys()
            for k in a:  # bitwise, NaN included (scatter_rewards' reward columns hold NaN: rewards that do not apply)
                assert torch.equal(a[k].view(torch.uint8), b[k].view(torch.uint8)), (op, k)
            if "mask" in a and case.rows >= 4:
                lengths = a["mask"].sum(1)
                assert int(lengths.min()) == 0 and int(lengths.max()) == case.cols  # an empty and a full row
    assert {c.rows for c in rl.value_cases("gae", "cuda", quick=False)} <= set(range(1, 513))
    assert max(c.cols for op in rl.RL_OPS for c in rl.value_cases(op, "cuda", quick=False)) <= 8192


def test_inputs_are_deterministic_and_never_zero():
    case = cs.value_cases("selected_logprob", "cpu", quick=False)[3]
    a, b = cs.make_inputs(case, seed=0), cs.make_inputs(case, seed=0)
    assert torch.equal(a.x, b.x) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.x, cs.make_inputs(case, seed=1).x)
    assert bool((a.x != 0).all())
    finite = torch.isfinite(a.x)
    assert bool(finite.any(dim=1).all())  # -inf never fills a row
    valid = a.targets != cs.IGNORE_INDEX
    assert bool(finite[valid.nonzero().squeeze(1), a.targets[valid]].all())  # nor hits a target


def test_cli_refuses_a_backend_that_cannot_run():
    with pytest.raises(SystemExit):
        main(["--device", "cpu", "--backends", "no-such-backend"])


# ---------------------------------------------------------------------------
# the batch-invariant forward chain
# ---------------------------------------------------------------------------

CHAIN_GRADS = {
    "rms_norm": {"grad_x", "grad_weight", "grad_residual"},
    "matmul": {"grad_x", "grad_weight", "grad_bias"},
    "attention": {"grad_q", "grad_k", "grad_v"},
    "prefix_attention": {"grad_q", "grad_k", "grad_v"},
    "softmax": {"grad_x"},
    "rope": {"grad_q", "grad_k"},
    "embedding": {"grad_weight"},
    "pack": {"grad_x"},
}


@pytest.fixture
def small_chain(monkeypatch):
    """One small size per chain op (the CPU matrix's smallest), probe batches of 7."""
    for op in chain.CHAIN_OPS:
        monkeypatch.setitem(chain.SIZES[op], "cpu", chain.SIZES[op]["cpu"][-1:])


@pytest.mark.slow
def test_chain_ops_are_reported_and_pass_on_reference_and_triton(small_chain):
    config = _config(["reference", "triton"], dtypes=("float32", "float16"), ops=chain.CHAIN_OPS)
    cells = _run(config)
    assert set(cells) == {
        (op, d, b) for op in chain.CHAIN_OPS for d in ("float32", "float16") for b in ("reference", "triton")
    }
    for (op, _, backend), cell in cells.items():
        assert cell.status == PASS, (op, backend, [(r.case.label(), r.error, r.worst) for r in cell.results])
        assert [r.case for r in cell.results] == chain.value_cases(op, "cpu", quick=True)
        grads = {d.name for r in cell.results for d in r.deviations if d.name.startswith("grad_")}
        assert grads <= CHAIN_GRADS[op] and grads >= CHAIN_GRADS[op] - {"grad_residual"}
        assert cell.invariance is not None and cell.invariance.checks and cell.invariance.bitwise
        assert cell.invariance.claimed == (backend == "triton")
    record = _json_roundtrip(config, list(cells.values()))
    assert record["failed"] is False
    markdown = report.to_markdown(config, list(cells.values()), {}, record["environment"], 1.0)
    assert "| attention | float16 | PASS · worst " in markdown and "- rope invariance: probe alone" in markdown


def _softmax_only(name: str, batch_invariant: bool, after) -> rlk.Backend:
    """The reference's softmax primitives, with ``after(x, out)`` applied to the forward's output."""
    ref = dispatch.discover()["reference"].backend.primitives

    def softmax_fwd(x, log, out):
        ref["softmax_fwd"](x, log, out)
        after(x, out)

    return rlk.Backend(
        name=name,
        version="0",
        abi_version=rlk.ABI_VERSION,
        primitives={"softmax_fwd": softmax_fwd, "softmax_bwd": ref["softmax_bwd"]},
        probe=lambda: None,
        device_types=lambda: ("cpu",),
        batch_invariant=batch_invariant,
    )


def test_a_chain_backend_off_by_1e_2_fails(monkeypatch, small_chain):
    _register(monkeypatch, _softmax_only("broken", False, lambda x, out: out.add_(1e-2)))
    cells = _run(_config(["broken"], ops=["softmax", "rms_norm"]))
    cell = cells["softmax", "float32", "broken"]
    assert cell.status == FAIL and cell.worst[1].ratio > 1
    assert any(d.name == "y" and not d.ok for r in cell.results for d in r.deviations)
    assert cells["rms_norm", "float32", "broken"].status == NA


def test_a_batch_dependent_chain_backend_breaks_its_invariance_claim(monkeypatch, small_chain):
    # a relative change of N * 2^-26: new bits for N = 7, well within the contract (gradients included)
    _register(monkeypatch, _softmax_only("batchy", True, lambda x, out: out.mul_(1 + x.shape[0] * 2**-26)))
    cell = _run(_config(["batchy"], ops=["softmax"]))["softmax", "float32", "batchy"]
    assert all(r.ok for r in cell.results)
    assert cell.invariance.verdict.startswith("BROKEN") and "y" in cell.invariance.details
    assert cell.status == FAIL


# ---------------------------------------------------------------------------
# the distillation divergence
# ---------------------------------------------------------------------------


def test_distill_op_is_reported_and_passes_on_reference_and_triton():
    config = _config(["reference", "triton"], dtypes=("float32",), ops=distill.DISTILL_OPS)
    cells = _run(config)
    assert set(cells) == {("fused_linear_kl", "float32", b) for b in ("reference", "triton")}
    for (op, _, backend), cell in cells.items():
        assert cell.status == PASS, (backend, [(r.case.label(), r.error, r.worst) for r in cell.results])
        assert [r.case for r in cell.results] == distill.value_cases(op, "cpu", quick=True)
        assert {d.name for r in cell.results for d in r.deviations} == {"loss", "grad_hidden", "grad_weight"}
        assert cell.invariance is not None and cell.invariance.checks
        assert cell.invariance.claimed == (backend == "triton")
    assert cells["fused_linear_kl", "float32", "triton"].invariance.bitwise
    record = _json_roundtrip(config, list(cells.values()))
    assert record["failed"] is False
    markdown = report.to_markdown(config, list(cells.values()), {}, record["environment"], 1.0)
    assert "| fused_linear_kl | float32 | PASS · worst " in markdown
    assert "- fused_linear_kl invariance: probe alone" in markdown


def _distill_only(name: str, batch_invariant: bool, after) -> rlk.Backend:
    """The reference's fused_linear_kl primitives, with ``after(student_hidden, loss_out)`` applied to the forward."""
    ref = dispatch.discover()["reference"].backend.primitives

    def forward(*args):
        ref["fused_linear_kl_fwd"](*args)
        after(args[0], args[9])

    return rlk.Backend(
        name=name,
        version="0",
        abi_version=rlk.ABI_VERSION,
        primitives={"fused_linear_kl_fwd": forward, "fused_linear_kl_bwd": ref["fused_linear_kl_bwd"]},
        probe=lambda: None,
        device_types=lambda: ("cpu",),
        batch_invariant=batch_invariant,
    )


def test_a_distill_backend_off_by_1e_2_fails(monkeypatch):
    _register(monkeypatch, _distill_only("broken", False, lambda hidden, loss: loss.add_(1e-2)))
    cell = _run(_config(["broken"], ops=distill.DISTILL_OPS))["fused_linear_kl", "float32", "broken"]
    assert cell.status == FAIL and cell.worst[1].ratio > 1 and cell.worst[1].name == "loss"


def test_a_batch_dependent_distill_backend_breaks_its_invariance_claim(monkeypatch):
    # a relative change of N * 2^-26: new bits for N = 7, well within the contract
    _register(monkeypatch, _distill_only("batchy", True, lambda hidden, loss: loss.mul_(1 + hidden.shape[0] * 2**-26)))
    cell = _run(_config(["batchy"], ops=distill.DISTILL_OPS))["fused_linear_kl", "float32", "batchy"]
    assert all(r.ok for r in cell.results)
    assert cell.invariance.verdict.startswith("BROKEN") and "loss" in cell.invariance.details
    assert cell.status == FAIL
