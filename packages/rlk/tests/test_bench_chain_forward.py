"""tools/bench_chain_forward.py: the chain-on vs stock forward benchmark runs end to end on the tiny model on the
CPU (Triton interpreter, tiny shapes) and reports consistent numbers (no GPU kernel time off CUDA), writes the host
profiles of both chains with ``--host-profile``; bad arguments are refused."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[3] / "tools" / "bench_chain_forward.py"


def _tool():
    spec = importlib.util.spec_from_file_location("bench_chain_forward", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _need_transformers():
    if os.environ.get("RLK_REQUIRE_TRANSFORMERS") == "1":
        import transformers  # noqa: F401  (CI installs it: fail loudly when it is missing)
    else:
        pytest.importorskip("transformers")


def test_unknown_scenario_and_bad_sizes_are_refused():
    tool = _tool()
    with pytest.raises(SystemExit, match="unknown"):
        tool.main(["--scenarios", "training,backward"])
    with pytest.raises(SystemExit, match=">= 1"):
        tool.main(["--reps", "0"])
    with pytest.raises(SystemExit, match="host-profile must be >= 0"):
        tool.main(["--host-profile", "-1"])
    with pytest.raises(SystemExit, match="--out"):
        tool.main(["--host-profile", "3", "--out", ""])
    with pytest.raises(SystemExit):  # argparse: not one of the scenarios
        tool.main(["--host-profile", "3", "--host-profile-scenario", "backward"])


def test_kernel_time_is_the_busy_time_of_cuda_events_only():
    """The tool reuses bench_asv's ``device_ms``: CPU events (whose ``device_time_total`` repeats their kernels')
    are left out; the CUDA kernels / memcpys / memsets count by their device intervals, time in which two overlap
    (programmatic dependent launch) once, in ms."""
    import torch
    from torch.autograd.profiler_util import Interval

    tool = _tool()
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    class Event:
        def __init__(self, device_type, start, end):
            self.device_type, self.time_range = device_type, Interval(start, end)

    class Prof:
        def __init__(self, events):
            self._events = events

        def events(self):
            return self._events

    apart = [Event(cpu, 0.0, 500.0), Event(cuda, 10.0, 130.0), Event(cuda, 200.0, 230.0), Event(cpu, 0.0, 150.0)]
    assert tool.bench_common.device_ms(Prof(apart)) == pytest.approx(0.15, rel=1e-12)
    # [10, 130] and [100, 160] overlap by 30 us; [150, 155] lies inside [100, 160]; [300, 301] apart
    overlapping = [
        Event(cuda, 100.0, 160.0),
        Event(cuda, 10.0, 130.0),
        Event(cuda, 150.0, 155.0),
        Event(cuda, 300.0, 301.0),
        Event(cpu, 0.0, 1000.0),
    ]
    assert tool.bench_common.device_ms(Prof(overlapping)) == pytest.approx(0.151, rel=1e-12)


@pytest.mark.slow
@pytest.mark.triton_interpreter
def test_tiny_model_on_cpu_reports_every_scenario(tmp_path, capsys):
    _need_transformers()
    from rlk.integrations.batch_invariant import is_batch_invariant_enabled

    tool = _tool()
    out = tmp_path / "cb"
    argv = [
        "--model",
        "tiny",
        "--device",
        "cpu",
        "--seqs",
        "2",
        "--seq-len",
        "8",
        "--prefill-batch",
        "2",
        "--prefill-len",
        "8",
        "--decode-batch",
        "2",
        "--decode-len",
        "8",
        "--decode-steps",
        "2",
        "--reps",
        "1",
        "--out",
        str(out),
        "--host-profile",
        "5",
    ]
    tool.main(argv)
    assert not is_batch_invariant_enabled()  # the chain is switched off again
    table = capsys.readouterr().out
    report = json.loads((out / "chain_forward.json").read_text())

    assert report["command"][1:] == argv
    assert report["model"]["name"] == "tiny" and report["dtype"] == "float32"
    assert {"torch", "triton", "transformers"} <= set(report["versions"])
    assert report["settings"]["reps"] == 1 and report["settings"]["decode_steps"] == 2
    assert list(report["scenarios"]) == ["training", "prefill", "decode", "decode_graph"]
    tokens = {"training": 2 * 8, "decode": 2, "decode_graph": 2}
    for name, r in report["scenarios"].items():
        assert name in table
        for chain in ("off", "on"):
            c = r[chain]
            assert len(c["ms_all"]) == 1 and c["ms_median"] > 0 and c["ms_min"] > 0
            assert c["tokens_per_s"] == pytest.approx(r["tokens_per_unit"] / (c["ms_median"] / 1e3), rel=1e-12)
        assert r["off"]["kernel_ms"] is None and r["on"]["kernel_ms"] is None  # CPU: no GPU kernel time
        assert r["kernel_overhead"] is None
        assert r["off"]["rlk_aten_calls"] == 0 and r["on"]["rlk_aten_calls"] > 0
        assert r["on"]["rlk_fallback_warnings"] == []
        assert r["overhead"] == pytest.approx(r["on"]["ms_median"] / r["off"]["ms_median"] - 1, rel=1e-12)
        assert r["target_met"] == (r["overhead"] <= 0.20)
        if name in tokens:
            assert r["tokens_per_unit"] == tokens[name]
    prefill = report["scenarios"]["prefill"]["shape"]
    assert prefill["input_ids"] == [2, 8] and all(4 <= n <= 8 for n in prefill["row_lengths"])
    assert report["scenarios"]["prefill"]["tokens_per_unit"] == sum(prefill["row_lengths"])

    # --host-profile 5: the decode scenario (the default) profiled once per chain, top 5 functions twice per file
    host = report["host_profile"]
    assert host["scenario"] == "decode" and host["top"] == 5 and host["units"] == 2
    assert report["settings"]["host_profile"] == 5 and report["settings"]["host_profile_scenario"] == "decode"
    assert host["off"]["rlk_aten_calls"] == 0 and host["on"]["rlk_aten_calls"] > 0
    for chain in ("off", "on"):
        path = out / f"host_profile_decode_{chain}.txt"
        assert host[chain]["file"] == str(path) and f"wrote {path}" in table
        text = path.read_text()
        assert text.startswith(f"host profile (cProfile) of decode, chain {chain}: one body of 2 decode step(s)")
        assert "=== top 5 by cumulative time ===" in text and "=== top 5 by own time (tottime) ===" in text
        assert "bench_chain_forward.py" in text and "(body)" in text  # the scenario's body is the profiled call
        assert host[chain]["wall_ms"] > 0
        assert host[chain]["wall_ms_per_unit"] == pytest.approx(host[chain]["wall_ms"] / 2, rel=1e-12)
    assert sorted(p.name for p in out.iterdir()) == [
        "chain_forward.json",
        "host_profile_decode_off.txt",
        "host_profile_decode_on.txt",
    ]
