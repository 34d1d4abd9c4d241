"""``rlk info`` and ``python -m rlk info`` report versions, backends and op routing; ``rlk consistency`` and
``rlk demo`` parse their arguments, report errors, and switch triton to its interpreter on the CPU."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import types

import pytest

import rlk
from rlk.app import cli


def _check_report(text: str) -> None:
    assert f"rlk {rlk.__version__} (op ABI {rlk.ABI_VERSION})" in text
    assert "torch " in text and "device: " in text
    assert "reference" in text and "[built-in] available" in text
    assert "selected_logprob" in text and "linear_logprob" in text


def test_python_m_rlk_info():
    result = subprocess.run([sys.executable, "-m", "rlk", "info"], capture_output=True, text=True, check=True)
    _check_report(result.stdout)


def test_console_script():
    assert shutil.which("rlk"), "the rlk console script is not on PATH: is the package installed?"
    result = subprocess.run(["rlk", "info"], capture_output=True, text=True, check=True)
    _check_report(result.stdout)


def test_info_selfcheck(monkeypatch, capsys):
    """``rlk info --selfcheck``: each available backend's checks on the device, exit code 0 when all hold; a failed
    check is printed and gives exit code 1."""
    import dataclasses

    from rlk.app import cli
    from rlk.core import dispatch

    assert cli.main(["info", "--selfcheck"]) == 0
    out = capsys.readouterr().out
    assert "selfcheck on " in out and "reference  ok" in out
    statuses = dispatch.discover()
    ref = statuses["reference"]
    failing = dataclasses.replace(ref.backend, selfcheck=lambda device: ["tiles differ"])
    broken = dataclasses.replace(ref, backend=failing)
    monkeypatch.setattr(dispatch, "discover", lambda: {**statuses, "reference": broken})
    assert cli.main(["info", "--selfcheck"]) == 1
    out = capsys.readouterr().out
    assert "reference  FAILED (1)" in out and "tiles differ" in out


def test_version():
    result = subprocess.run([sys.executable, "-m", "rlk", "--version"], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == f"rlk {rlk.__version__}"


def test_info_json_is_the_report_as_data(capsys):
    """``rlk info --json``: the text report's facts as JSON; every ABI op with the backend of each of its dtypes;
    with ``--selfcheck`` its verdict and lines."""
    import json

    from rlk.core import abi

    assert cli.main(["info", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["rlk"] == rlk.__version__ and data["abi_version"] == rlk.ABI_VERSION
    assert set(data["ops"]) == set(abi.OPS)
    assert all(set(by_dtype) == set(abi.OPS[op].dtypes) for op, by_dtype in data["ops"].items())
    ref = next(b for b in data["backends"] if b["name"] == "reference")
    assert ref["available"] and ref["reason"] is None and ref["source"] == "built-in"
    assert data["device"]["device"] == "cpu" and data["chain"][-1] == "reference"
    assert cli.main(["info", "--json", "--selfcheck"]) == 0
    checked = json.loads(capsys.readouterr().out)["selfcheck"]
    assert checked["ok"] is True and any("reference" in line for line in checked["lines"])


def test_missing_optional_dependency_is_one_line_and_exit_code_2(monkeypatch, capsys):
    """A command whose optional dependency is missing ends in one line naming the extra, exit code 2; any other
    missing module is a bug and raises."""
    from rlk.app.consistency import run

    def missing(name):
        def run_consistency(model, **kw):
            raise ModuleNotFoundError(f"No module named '{name}'", name=name)

        return run_consistency

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(run, "run_consistency", missing("transformers"))
    assert cli.main(["consistency", "--device", "cpu"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "rlk consistency: error: needs the optional dependency transformers (pip install 'rlk[hf]')"
    monkeypatch.setattr(run, "run_consistency", missing("not_a_dependency_of_rlk"))
    with pytest.raises(ModuleNotFoundError):
        cli.main(["consistency", "--device", "cpu"])


def without_modules(tmp_path, *modules: str) -> dict[str, str]:
    """The environment of a child Python in which importing each of ``modules`` fails (a ``sitecustomize`` on
    ``PYTHONPATH`` sets ``sys.modules[name] = None``, as for a package that is not installed); children of that
    child (``rlk`` re-running itself with the Triton interpreter) inherit it."""
    shim = tmp_path / "shim"
    shim.mkdir(exist_ok=True)
    (shim / "sitecustomize.py").write_text("import sys\n" + "".join(f"sys.modules[{m!r}] = None\n" for m in modules))
    return dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (str(shim), os.environ.get("PYTHONPATH")) if p))


@pytest.mark.parametrize(
    "args, module, distribution",
    [
        (["consistency", "--device", "cpu"], "transformers", "transformers"),
        (["demo", "--device", "cpu"], "transformers", "transformers"),
        (["multimodal-smoke", "--device", "cpu"], "PIL", "Pillow"),
        (["multimodal-parity", "--offline-processor"], "PIL", "Pillow"),
    ],
)
def test_a_missing_optional_dependency_ends_in_one_line_naming_the_extra(args, module, distribution, tmp_path):
    """Without transformers (consistency, demo) or Pillow (the multimodal commands: transformers' image processor
    needs it), the command prints one line naming the distribution and ``pip install 'rlk[hf]'`` and exits with 2,
    before any work (it used to end in a traceback and exit code 1)."""
    out = ["--out", str(tmp_path / "out")] if args[0] in ("consistency", "demo") else []
    result = _run(*args, *out, env=without_modules(tmp_path, module))
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip() == (
        f"rlk {args[0]}: error: needs the optional dependency {distribution} (pip install 'rlk[hf]')"
    )
    assert result.stdout == ""


def test_every_device_option_is_the_shared_one():
    """Every command with ``--device`` checks it with ``cli.device_arg`` (one helper, one set of messages)."""
    parser = cli.build_parser()
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    with_device = {
        name: option for name, sub in commands.items() for option in sub._actions if "--device" in option.option_strings
    }
    assert set(with_device) == {"consistency", "demo", "multimodal-smoke"}
    assert all(option.type is cli.device_arg for option in with_device.values())


@pytest.mark.parametrize("command", ["consistency", "demo", "multimodal-smoke"])
@pytest.mark.parametrize(
    "device, message",
    [("tpu", "'tpu' is not a torch device (cpu, cuda, cuda:1, ...)"), ("meta", "run on cpu or cuda devices")],
)
def test_a_bad_device_is_a_usage_error_of_every_command(command, device, message, capsys):
    """``--device tpu`` used to reach ``torch.device`` inside ``rlk multimodal-smoke``: a traceback, exit code 1."""
    with pytest.raises(SystemExit) as exit_info:
        cli.main([command, "--device", device])
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith(f"rlk {command}: error: argument --device: ") and message in last


def test_unknown_command_fails():
    result = subprocess.run([sys.executable, "-m", "rlk", "nope"], capture_output=True, text=True)
    assert result.returncode == 2 and "invalid choice" in result.stderr


# ---------------------------------------------------------------------------
# rlk consistency / rlk demo: argument parsing, errors, the interpreter switch
# ---------------------------------------------------------------------------


@pytest.fixture(autouse=True)
def _restore_triton_interpret():
    """``cli.main`` sets TRITON_INTERPRET for CPU commands: never leak it into the rest of the test session."""
    before = os.environ.get("TRITON_INTERPRET")
    yield
    if before is None:
        os.environ.pop("TRITON_INTERPRET", None)
    else:
        os.environ["TRITON_INTERPRET"] = before


def _run(*args, env=None):
    return subprocess.run([sys.executable, "-m", "rlk", *args], capture_output=True, text=True, env=env)


def test_consistency_help_lists_the_options():
    result = _run("consistency", "--help")
    assert result.returncode == 0
    for option in ("--model", "--device", "--dtype", "--prompts", "--max-new-tokens", "--out", "qwen3-8b-shape"):
        assert option in result.stdout
    demo = _run("demo", "--help")
    assert demo.returncode == 0 and "--skip-consistency" in demo.stdout


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "no-such-model"], "neither a built-in model"),
        (["--prompts", "0"], "must be >= 1"),
        (["--prompts", "many"], "is not an integer"),
        (["--max-new-tokens", "-3"], "must be >= 1"),
        (["--dtype", "float64"], "invalid choice"),
        (["--device", "nonsense"], "is not a torch device"),
        (["--device", "cpu", "--dtype", "bfloat16"], "float32 only"),
    ],
)
def test_consistency_argument_errors(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["consistency", *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_parser_defaults():
    args = cli.build_parser().parse_args(["consistency"])
    assert (args.model, args.prompts, args.max_new_tokens, args.dtype, args.device, args.out) == (
        "tiny",
        8,
        16,
        None,
        None,
        None,
    )


def _fake_run(calls, passed):
    def run_consistency(model, **kw):
        calls.append((model, kw, os.environ.get("TRITON_INTERPRET")))
        return {"passed": passed}

    return run_consistency


def test_consistency_sets_the_interpreter_on_cpu_and_exits_by_the_verdicts(monkeypatch):
    from rlk.app.consistency import run

    calls = []
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delitem(sys.modules, "triton", raising=False)
    monkeypatch.setattr(run, "run_consistency", _fake_run(calls, passed=True))
    assert cli.main(["consistency", "--device", "cpu", "--prompts", "2", "--out", "x"]) == 0
    model, kw, interp = calls[0]
    assert model == "tiny" and interp == "1" and kw["prompts"] == 2 and kw["out"] == "x"
    monkeypatch.setattr(run, "run_consistency", _fake_run(calls, passed=False))
    assert cli.main(["consistency", "--device", "cpu"]) == 1


def test_consistency_reruns_itself_when_triton_was_imported_without_the_interpreter(monkeypatch):
    seen = {}

    def fake_subprocess_run(cmd, env):
        seen["cmd"], seen["env"] = cmd, env
        return subprocess.CompletedProcess(cmd, 7)

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setitem(sys.modules, "triton", types.ModuleType("triton"))
    monkeypatch.setattr(cli.subprocess, "run", fake_subprocess_run)
    assert cli.main(["consistency", "--device", "cpu", "--prompts", "3"]) == 7
    assert seen["cmd"][1:] == ["-m", "rlk", "consistency", "--device", "cpu", "--prompts", "3"]
    assert seen["env"]["TRITON_INTERPRET"] == "1" and "TRITON_INTERPRET" not in os.environ


def test_run_errors_are_reported_without_a_traceback(monkeypatch, capsys):
    from rlk.app.consistency import run

    def bad(model, **kw):
        raise ValueError("something is wrong")

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(run, "run_consistency", bad)
    assert cli.main(["consistency", "--device", "cpu"]) == 2
    assert "rlk consistency: error: something is wrong" in capsys.readouterr().err
