"""Stored-outputs mode (``python -m parity --save-outputs DIR`` / ``--against DIR``) on the CPU.

A small subset of the stored case set (:data:`SMALL`, real keys of it) is saved once per test module with the
reference backend; the tests compare backends against it, plant mismatches, damage the files, and regenerate
the inputs. The Triton backend runs under its CPU interpreter when no GPU is visible.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

import rlk
from parity import against as ag
from parity import stored as st
from parity.__main__ import main
from parity.run import ALL_OPS
from rlk.core import contract, dispatch

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # Triton interpreter: log(0) on masked lanes

CPU = torch.device("cpu")
SELECTED_FP32 = "selected_logprob float32 V=1000 N=7 [ignore,T=row,entropy]"
RMS_FP16 = "rms_norm float16 N=7 H=4096 [gemma]"
#: Whole tensors and samples (grad_logits: 7 x 1000 > FULL_LIMIT; rms_norm: 4096 columns > SAMPLE_COLS), every
#: family, three dtypes; the cheap ones under the Triton interpreter.
SMALL = (
    SELECTED_FP32,
    "selected_logprob float16 V=1000 N=7 [ignore,T=row,entropy]",
    "selected_logprob bfloat16 V=1000 N=7 [ignore,T=row,entropy]",
    "linear_logprob float32 V=1000 N=7 H=64 [ignore,T=row,entropy]",
    RMS_FP16,
    "kl_penalty float32 B=7 T=300 [k3]",
)


@pytest.fixture(scope="module")
def small_set():
    table = st.case_table()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(st, "CASES", tuple(table[key] for key in SMALL))
        yield


@pytest.fixture(scope="module")
def saved(small_set, tmp_path_factory):
    """The small set saved with the reference backend (read-only: copy it to change it)."""
    folder = tmp_path_factory.mktemp("stored") / "reference-cpu"
    assert main(["--device", "cpu", "--backends", "reference", "--save-outputs", str(folder)]) == 0
    return folder


@pytest.fixture
def copy(saved, tmp_path):
    folder = tmp_path / "copy"
    shutil.copytree(saved, folder)
    return folder


def _against(folder, backends: str, out=None, ops: str | None = None) -> int:
    argv = ["--device", "cpu", "--backends", backends, "--against", str(folder)]
    argv += ["--out", str(out)] if out is not None else []
    return main(argv + (["--ops", ops] if ops is not None else []))


def _rewrite(folder, change) -> None:
    """Load ``folder``, apply ``change(payload)`` and write it back with a fresh manifest checksum."""
    manifest, payload = st.load(folder)
    change(payload)
    st.write(folder, payload, {k: v for k, v in manifest.items() if not k.startswith("outputs_")})


# ---------------------------------------------------------------------------
# the case set and the storage
# ---------------------------------------------------------------------------


def test_the_case_set_is_well_formed():
    keys = [sc.key for sc in st.CASES]
    assert len(set(keys)) == len(keys)
    assert {sc.op for sc in st.CASES} <= set(ALL_OPS)
    for sc in st.CASES:
        contract.entry(sc.op, sc.dtype)  # raises where the contract has no entry
    for op in ("selected_logprob", "linear_logprob", "rms_norm"):
        assert {sc.dtype for sc in st.CASES if sc.op == op} == {"bfloat16", "float16", "float32"}
    big = [sc for sc in st.CASES if sc.op == "selected_logprob" and sc.case.vocab == 151936]
    assert {sc.dtype for sc in big} == {"bfloat16", "float16", "float32"}
    assert all(sc.dtype == "float32" for sc in st.CASES if sc.family == st.RL)


def test_a_large_tensor_is_kept_as_a_sample_with_its_largest_columns():
    gen = torch.Generator().manual_seed(0)
    t = torch.randn(7, 151936, generator=gen).to(torch.bfloat16)
    t[0, 12345] = 1e4  # row 0 is always sampled
    record = st.summarize(t, torch.Generator().manual_seed(1))
    assert record["sample"].dtype == torch.bfloat16 and record["shape"] == [7, 151936]
    assert record["sample"].shape == (st.SAMPLE_ROWS, st.SAMPLE_COLS)
    assert {0, 6} <= set(record["rows"].tolist()) and 12345 in record["cols"].tolist()
    assert torch.equal(st.take(t, record), record["sample"])
    assert record["norm"] == float(torch.linalg.vector_norm(t.double()))
    small = st.summarize(t[:2, :100], torch.Generator())
    assert torch.equal(small["full"], t[:2, :100]) and "sample" not in small


def test_grad_bound_is_the_contracts_allowance():
    entry = contract.entry("selected_logprob", torch.bfloat16)
    gen = torch.Generator().manual_seed(0)
    ref = torch.randn(33, 64, generator=gen, dtype=torch.float64)
    got = (ref + 1e-3 * torch.randn(33, 64, generator=gen, dtype=torch.float64)).to(torch.bfloat16)
    for magnitude in (None, ref.abs() * 3):
        dev = contract.compare_grad(entry, "g", got, ref, 20.0, magnitude)
        assert ag.grad_bound(entry, "g", ref, torch.bfloat16, 20.0, magnitude) == dev.allowed
        assert dev.worst == pytest.approx(float(torch.linalg.vector_norm(got.double() - ref)))
    zero = torch.zeros(33, 64, dtype=torch.float64)
    assert ag.grad_bound(entry, "g", zero, torch.bfloat16, 0.0, None) == entry.atol * math.sqrt(33 * 64)


def test_the_file_round_trips_and_the_inputs_regenerate_bitwise(saved):
    manifest, payload = st.load(saved)
    assert set(payload["cases"]) == set(SMALL) == {c["key"] for c in manifest["cases"]}
    assert manifest["backends"] == {"reference": rlk.__version__} and manifest["device"] == "cpu"
    assert {"commit", "dirty", "command", "versions", "created"} <= set(manifest)
    assert "--save-outputs" in manifest["command"] and manifest["versions"]["torch"] == torch.__version__
    assert manifest["outputs_bytes"] == (saved / st.OUTPUTS_FILE).stat().st_size < 5 * 2**20
    for key, record in payload["cases"].items():
        sc = st.case_table()[key]
        low, again = st.make_low(sc, payload["seed"]), st.make_low(sc, payload["seed"])
        assert st.input_checksums(sc, low) == record["inputs"]
        first, second = st.named_inputs(sc, low), st.named_inputs(sc, again)
        assert all(
            torch.equal(v, second[k]) if isinstance(v, torch.Tensor) else v == second[k] for k, v in first.items()
        )
        with rlk.use_backend("reference"):  # the reference is deterministic: rerunning gives the stored bits
            got = st.produce(sc, st.to_device(sc, low, CPU))
        for kind, tensors in (("values", got.values), ("grads", got.grads)):
            assert set(record[kind]) == set(tensors)
            for name, t in tensors.items():
                kept = record[kind][name]
                assert torch.equal(st.take(t, kept), st.stored_tensor(kept)), (key, name)
                assert "full" in kept or kept["norm"] == float(torch.linalg.vector_norm(t.double()))
    sampled = payload["cases"][SELECTED_FP32]["grads"]["grad_logits"]
    assert "sample" in sampled and sampled["sample"].shape == (st.SAMPLE_ROWS, 1000)


def test_changed_inputs_are_refused(saved):
    _, payload = st.load(saved)
    cases = [st.case_table()[key] for key in SMALL]
    st.verify_inputs(cases, payload)
    with pytest.raises(st.StoredError, match=r"regenerated input\(s\) .*x.* differ from the stored checksums"):
        st.verify_inputs(cases, payload | {"seed": 1})


# ---------------------------------------------------------------------------
# --against
# ---------------------------------------------------------------------------


@pytest.mark.triton_interpreter
def test_triton_against_the_stored_reference_passes(saved, tmp_path, capsys):
    assert _against(saved, "triton", tmp_path / "out") == 0
    markdown = capsys.readouterr().out
    assert "# rlk stored-outputs parity report" in markdown and "## Failures\n\nnone" in markdown
    record = json.loads((tmp_path / "out" / "parity.json").read_text())
    assert record["failed"] is False and [c["key"] for c in record["cases"]] == list(SMALL)
    for case in record["cases"]:
        assert case["stored_ok"] and [c["status"] for c in case["cells"]] == ["PASS"], case["key"]
        sides = {check["side"] for check in case["cells"][0]["checks"]}
        assert sides == {ag.VS_STORED, ag.VS_FP64}
        assert all(check["ratio"] <= 1 for check in case["cells"][0]["checks"] + case["stored_checks"])
    selected = next(c for c in record["cases"] if c["key"] == SELECTED_FP32)
    names = {check["name"] for check in selected["cells"][0]["checks"] if check["side"] == ag.VS_STORED}
    assert names == {"logprob", "entropy", "grad_logits[sample]", "grad_logits[norm]"}


def _add_to_full(name: str, delta: float):
    def change(payload):
        payload["cases"][SELECTED_FP32]["values"][name]["full"][0] += delta

    return change


def _scale_grad(name: str, part: str, factor: float):
    def change(payload):
        kept = payload["cases"][RMS_FP16]["grads"][name]
        if part == "sample":
            kept["sample"] *= factor
        else:
            kept["norm"] *= factor

    return change


@pytest.mark.parametrize(
    "change, key, check",
    [
        (_add_to_full("logprob", 0.5), SELECTED_FP32, "logprob"),
        (_scale_grad("grad_x", "sample", 1.5), RMS_FP16, "grad_x[sample]"),
        (_scale_grad("grad_x", "norm", 1.5), RMS_FP16, "grad_x[norm]"),
    ],
    ids=["output", "gradient-sample", "gradient-norm"],
)
def test_a_planted_mismatch_fails_naming_the_case_and_output(copy, tmp_path, capsys, change, key, check):
    _rewrite(copy, change)
    assert _against(copy, "reference", tmp_path / "out", ops=f"{key.split()[0]},kl_penalty") == 1
    markdown = capsys.readouterr().out
    assert f"- {key}: the stored side (reference) is off: {check} stored vs fp64 " in markdown
    assert f"- reference {key} (side off: stored): {check} vs stored " in markdown
    record = json.loads((tmp_path / "out" / "parity.json").read_text())
    bad = {c["key"] for c in record["cases"] if not c["stored_ok"]}
    assert bad == {key} and record["failed"] is True
    case = next(c for c in record["cases"] if c["key"] == key)
    assert case["cells"][0]["side_off"] == "stored"
    assert {c["name"] for c in case["cells"][0]["checks"] if not c["ok"]} == {check}


def _selected_off_by(name: str, delta: float) -> rlk.Backend:
    """The reference's selected_logprob primitives with ``delta`` added to every log-prob."""
    ref = dispatch.discover()["reference"].backend.primitives

    def forward(logits, targets, inv_temperature, ignore_index, logprob_out, entropy_out, lse_out):
        ref["selected_logprob_fwd"](logits, targets, inv_temperature, ignore_index, logprob_out, entropy_out, lse_out)
        logprob_out.add_(delta)

    return rlk.Backend(
        name=name,
        version="0",
        abi_version=rlk.ABI_VERSION,
        primitives={"selected_logprob_fwd": forward, "selected_logprob_bwd": ref["selected_logprob_bwd"]},
        probe=lambda: None,
        device_types=lambda: ("cpu",),
        batch_invariant=False,
    )


def _register(monkeypatch, backend: rlk.Backend) -> None:
    statuses = dict(dispatch.discover())
    statuses[backend.name] = dispatch.BackendStatus(backend.name, backend, None, "test")
    monkeypatch.setattr(dispatch, "discover", lambda: statuses)


def test_a_backend_off_here_fails_on_this_machines_side(saved, tmp_path, monkeypatch, capsys):
    _register(monkeypatch, _selected_off_by("broken", 1e-2))
    assert _against(saved, "broken", tmp_path / "out", ops="selected_logprob,rms_norm") == 1
    markdown = capsys.readouterr().out
    assert f"- broken {SELECTED_FP32} (side off: this machine): logprob vs fp64 " in markdown
    record = json.loads((tmp_path / "out" / "parity.json").read_text())
    assert all(c["stored_ok"] for c in record["cases"])
    statuses = {c["key"]: c["cells"][0]["status"] for c in record["cases"]}
    assert statuses[SELECTED_FP32] == "FAIL" and statuses[RMS_FP16] == "n/a"


def test_nothing_compared_is_a_failure(saved, monkeypatch, capsys):
    _register(monkeypatch, _selected_off_by("selected-only", 0.0))
    assert main(["--device", "cpu", "--backends", "selected-only", "--ops", "rms_norm", "--against", str(saved)]) == 1
    assert "n/a (does not implement rms_norm_fwd" in capsys.readouterr().out


# ---------------------------------------------------------------------------
# bad input: exit code 2 and one line
# ---------------------------------------------------------------------------


def _flip_a_byte(folder):
    data = bytearray((folder / st.OUTPUTS_FILE).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (folder / st.OUTPUTS_FILE).write_bytes(bytes(data))


def _garbage_with_its_checksum(folder):
    (folder / st.OUTPUTS_FILE).write_bytes(b"not a torch file")
    manifest = json.loads((folder / st.MANIFEST_FILE).read_text())
    manifest["outputs_sha256"] = st._sha256_file(folder / st.OUTPUTS_FILE)
    (folder / st.MANIFEST_FILE).write_text(json.dumps(manifest))


def _manifest_field(name, value):
    def change(folder):
        manifest = json.loads((folder / st.MANIFEST_FILE).read_text())
        (folder / st.MANIFEST_FILE).write_text(json.dumps(manifest | {name: value}))

    return change


def _drop_manifest_key(name):
    def change(folder):
        manifest = json.loads((folder / st.MANIFEST_FILE).read_text())
        del manifest[name]
        (folder / st.MANIFEST_FILE).write_text(json.dumps(manifest))

    return change


def _rename_a_case(folder):
    _rewrite(folder, lambda p: p["cases"].update({"selected_logprob float32 V=999": p["cases"].pop(SELECTED_FP32)}))


def _drop_a_sample(folder):
    _rewrite(folder, lambda p: p["cases"][RMS_FP16]["grads"]["grad_x"].pop("sample"))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda f: shutil.rmtree(f), "no such folder"),
        (lambda f: (f / st.MANIFEST_FILE).unlink(), "no manifest.json"),
        (lambda f: (f / st.OUTPUTS_FILE).unlink(), "no outputs.pt"),
        (lambda f: (f / st.MANIFEST_FILE).write_text("{"), "manifest.json: not readable JSON"),
        (_flip_a_byte, "outputs.pt: SHA-256 differs from manifest.json's (a corrupt or edited file)"),
        (_garbage_with_its_checksum, "outputs.pt: cannot be read"),
        (_manifest_field("case_set_version", 99), "case set version 99; this parity reads format 1, case set 1"),
        (_manifest_field("format", "something else"), "not a stored-outputs file"),
        (_drop_manifest_key("versions"), "manifest.json: missing or malformed versions"),
        (_rename_a_case, "unknown case 'selected_logprob float32 V=999'"),
        (_drop_a_sample, f"case '{RMS_FP16}' has a malformed record"),
        (lambda f: _rewrite(f, lambda p: p.update(seed=1)), "differ from the stored checksums"),
    ],
    ids=[
        "missing-folder",
        "missing-manifest",
        "missing-outputs",
        "bad-json",
        "flipped-byte",
        "not-torch",
        "case-set-version",
        "format",
        "manifest-key",
        "unknown-case",
        "malformed",
        "inputs-differ",
    ],
)
def test_bad_input_exits_2_with_one_line(copy, capsys, damage, message):
    damage(copy)
    assert _against(copy, "reference") == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1
    assert captured.err.startswith("python -m parity: error: ") and message in captured.err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--save-outputs", "x"], "--save-outputs needs --backends"),
        (["--against", "x", "--quick"], "--quick does not apply to --against"),
        (["--against", "x", "--seed", "3"], "--seed does not apply to --against"),
        (["--against", "x", "--save-outputs", "y"], "not allowed with argument"),
    ],
)
def test_usage_errors_name_the_argument(argv, message, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--device", "cpu", *argv])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_saving_writes_nothing_when_the_backend_fails_the_contract(small_set, tmp_path, monkeypatch, capsys):
    _register(monkeypatch, _selected_off_by("broken", 1e-2))
    folder = tmp_path / "never"
    argv = ["--device", "cpu", "--backends", "broken", "--ops", "selected_logprob", "--save-outputs", str(folder)]
    assert main(argv) == 1
    assert not folder.exists() and "wrote nothing: 3 case(s) fail the contract" in capsys.readouterr().out


#: The whole case set, as imported (the module-scoped ``small_set`` fixture narrows ``st.CASES`` while it lives).
ALL_CASES = st.CASES


def test_the_committed_cuda_file_loads_and_its_inputs_regenerate(monkeypatch):
    """The stored CUDA outputs in the tree (``parity/stored/cuda-h100``): the manifest and the file agree, every case
    of the case set is there, and this torch regenerates every input bitwise."""
    monkeypatch.setattr(st, "CASES", ALL_CASES)
    folder = Path(__file__).resolve().parents[1] / "stored" / "cuda-h100"
    manifest, payload = st.load(folder)
    assert manifest["device_name"].startswith("NVIDIA H100") and not manifest["dirty"]
    cases = st.case_table()
    assert set(payload["cases"]) == set(cases)
    assert {record["backend"] for record in payload["cases"].values()} == {"cuda", "triton"}
    st.verify_inputs(list(cases.values()), payload)
