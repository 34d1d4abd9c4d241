"""``tools/triton_aot_check.py``: interpreted launches are recorded and compiled for sm_90 without a GPU, and a
kernel that only the compiler rejects is reported.

The bad kernel is a bug the H200 once found and the interpreter did not: a string
``tl.constexpr`` parameter of a device function with a default value, called without it (Triton 3.6
cannot lower the default; Triton 3.6, the version ci/requirements-dev.txt pins).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.triton_interpreter

TOOL = Path(__file__).parents[3] / "tools" / "triton_aot_check.py"

PROBE = """
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait


@triton.jit
def _scaled(x, SCALE: tl.constexpr):
    return x * SCALE


@triton.jit
def good_kernel(x_ptr, out_ptr, n, SCALE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    tl.store(out_ptr + offs, _scaled(tl.load(x_ptr + offs, mask=inb), SCALE), mask=inb)


@triton.jit
def cast_kernel(x_ptr, out_ptr, n, OUT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=inb).to(OUT).to(tl.float32), mask=inb)


def _twice(x):  # a plain Python function: the interpreter calls it, the compiler refuses it (triton 3.6 and 3.9)
    return x * 2.0


@triton.jit
def bad_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    tl.store(out_ptr + offs, _twice(tl.load(x_ptr + offs, mask=inb)), mask=inb)


@triton.jit
def pdl_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr, PDL_WAIT: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inb = offs < n
    x = tl.load(x_ptr + offs, mask=inb)
    if PDL_WAIT:
        gdc_wait()
    tl.store(out_ptr + offs, x + 1.0, mask=inb)


@triton.jit
def tma_kernel(x_desc, out_ptr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(out_ptr + offs[:, None] * BLOCK + offs[None, :], x_desc.load([0, 0]))
"""


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _tool_and_probe(tmp_path: Path):
    """The checker and the probe kernels as modules, and a small input."""
    (tmp_path / "aot_probe.py").write_text(textwrap.dedent(PROBE))
    tool, probe = _load(TOOL, "triton_aot_check"), _load(tmp_path / "aot_probe.py", "aot_probe")
    return tool, probe, torch.arange(10, dtype=torch.float32)


def _check(records: list[dict], tmp_path: Path, archs: tuple[str, ...] = ("90",)) -> subprocess.CompletedProcess:
    path = tmp_path / "records.json"
    path.write_text(json.dumps(records))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, str(TOOL), str(path), "--arch", *archs, "--packages", "aot_probe"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )


def test_records_compile_and_a_compiler_only_error_is_reported(tmp_path):
    assert os.environ.get("TRITON_INTERPRET") == "1"
    tool, probe, x = _tool_and_probe(tmp_path)
    good, bad = [], []
    with tool.record_launches(good):
        out = torch.empty_like(x)
        probe.good_kernel[(1,)](x, out, x.numel(), SCALE=3.0, BLOCK=16, num_warps=2)
    with tool.record_launches(bad):
        out2 = torch.empty_like(x)
        probe.bad_kernel[(1,)](x, out2, x.numel(), BLOCK=16)
    # the interpreter runs both happily
    assert torch.equal(out, x * 3.0) and torch.equal(out2, x * 2.0)
    assert good == [
        {
            "module": "aot_probe",
            "kernel": "good_kernel",
            "signature": {"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32"},
            "constants": {"SCALE": 3.0, "BLOCK": 16},
            "options": {"num_warps": 2},
        }
    ]

    done = _check(good, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "compiled 1 of 1 kernel specializations for sm_90" in done.stdout

    done = _check(good + bad, tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "compiled 1 of 2" in done.stdout
    assert "FAILED sm_90 aot_probe.bad_kernel" in done.stdout


def test_a_launch_the_checker_cannot_type_is_listed_not_dropped(tmp_path):
    """A tl.dtype constexpr is not recorded as a specialization; the compile step names the launch it left out."""
    import triton.language as tl

    tool, probe, x = _tool_and_probe(tmp_path)
    records: list[dict] = []
    with tool.record_launches(records):
        probe.cast_kernel[(1,)](x, torch.empty_like(x), x.numel(), OUT=tl.float16, BLOCK=16)
    assert records == [{"module": "aot_probe", "kernel": "cast_kernel", "left_out": "constexpr OUT of type dtype"}]
    done = _check(records, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "compiled 0 of 0" in done.stdout
    assert "left out (not typed by this checker): aot_probe.cast_kernel: constexpr OUT of type dtype" in done.stdout


def test_programmatic_launch_switches_are_compiled_on_from_sm_90(tmp_path):
    """The interpreter runs ``PDL_*`` switches off (it cannot run ``griddepcontrol``); the checker also compiles the
    switched-on specialization (launched with ``launch_pdl``) for sm_90, and only the recorded one for sm_80."""
    tool, probe, x = _tool_and_probe(tmp_path)
    records: list[dict] = []
    with tool.record_launches(records):
        out = torch.empty_like(x)
        probe.pdl_kernel[(1,)](x, out, x.numel(), BLOCK=16, PDL_WAIT=False)
    assert torch.equal(out, x + 1.0)
    variants = tool.with_programmatic_launch(records)
    assert [v["constants"]["PDL_WAIT"] for v in variants] == [False, True]
    assert variants[1]["options"] == {"launch_pdl": True}
    done = _check(records, tmp_path, ("90", "80"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "compiled 2 of 2 kernel specializations for sm_90" in done.stdout
    assert "compiled 1 of 1 kernel specializations for sm_80" in done.stdout


def test_tma_descriptors_are_typed_and_compiled_from_sm_90_only(tmp_path):
    """A host TMA descriptor argument is recorded as ``tensordesc<dtype[box]>`` and compiled for sm_90; below 9.0
    (no TMA unit) the record is left out of the count and said so."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    tool, probe, _ = _tool_and_probe(tmp_path)
    x = torch.arange(64, dtype=torch.float32).reshape(8, 8)
    out = torch.empty(16, 16)
    records: list[dict] = []
    with tool.record_launches(records):
        probe.tma_kernel[(1,)](TensorDescriptor.from_tensor(x, [16, 16]), out, BLOCK=16)
    assert torch.equal(out[:8, :8], x) and not out[8:].any() and not out[:, 8:].any()  # zero-filled box
    assert records[0]["signature"] == {"x_desc": "tensordesc<fp32[16, 16]>", "out_ptr": "*fp32"}
    done = _check(records, tmp_path, ("90", "80"))
    assert done.returncode == 0, done.stdout + done.stderr
    assert "compiled 1 of 1 kernel specializations for sm_90" in done.stdout
    assert (
        "compiled 0 of 0 kernel specializations for sm_80 (1 with TMA descriptors left out below sm_90)" in done.stdout
    )


def test_arch_names_map_to_cuda_and_hip_targets(tmp_path):
    """A number is a CUDA compute capability (warps of 32), a gfx name an AMD GPU (CDNA: wavefronts of 64)."""
    tool, _, _ = _tool_and_probe(tmp_path)
    assert tool.target_of("90") == ("cuda", 90, 32) and tool.label("90") == "sm_90"
    assert tool.target_of("gfx942") == ("hip", "gfx942", 64) and tool.label("gfx942") == "gfx942"
    assert tool.target_of("gfx90a") == ("hip", "gfx90a", 64)
    assert tool.target_of("gfx1100") == ("hip", "gfx1100", 32)  # RDNA: wave32, as Triton's AMD backend
    with pytest.raises(ValueError, match="unknown arch 'sm90'"):
        tool.target_of("sm90")


def test_records_compile_for_amd_gfx942_and_gfx90a(tmp_path):
    """The recorded specializations compile for AMD targets (Triton's AMD backend: no ROCm, no GPU); a record's
    ``num_warps`` is wavefronts of 64 there, and a block above 1024 threads fails (it would not launch). The CUDA-only
    options (``maxnreg``, ``launch_pdl``) are dropped and the ``PDL_*`` switches compiled off only; a TMA descriptor
    kernel compiles too (Triton's AMD backend lowers the descriptor to plain loads)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    tool, probe, x = _tool_and_probe(tmp_path)
    records: list[dict] = []
    with tool.record_launches(records):
        probe.good_kernel[(1,)](x, torch.empty_like(x), x.numel(), SCALE=3.0, BLOCK=16, num_warps=2)
        probe.pdl_kernel[(1,)](x, torch.empty_like(x), x.numel(), BLOCK=16, PDL_WAIT=False)
        probe.tma_kernel[(1,)](
            TensorDescriptor.from_tensor(x.reshape(2, 5)[:, :4].contiguous(), [16, 16]), torch.empty(16, 16), BLOCK=16
        )
    with_maxnreg = dict(records[0], options={"num_warps": 2, "maxnreg": 56})  # the same kernel on AMD
    done = _check(records + [with_maxnreg], tmp_path, ("gfx942", "gfx90a"))
    assert done.returncode == 0, done.stdout + done.stderr
    for arch in ("gfx942", "gfx90a"):
        assert f"compiled 3 of 3 kernel specializations for {arch}\n" in done.stdout
    assert "summary: gfx942: 3/3 compiled" in done.stdout and "gfx90a: 3/3 compiled" in done.stdout

    wide = [dict(records[0], options={"num_warps": 32})]  # 1024 threads on NVIDIA, 2048 on AMD
    done = _check(wide, tmp_path, ("90", "gfx942"))
    assert done.returncode == 1, done.stdout + done.stderr
    assert "compiled 1 of 1 kernel specializations for sm_90" in done.stdout
    assert "compiled 0 of 1 kernel specializations for gfx942" in done.stdout
    assert "does not launch: 32 warps of 64 = 2048 threads per block, at most 1024" in done.stdout
