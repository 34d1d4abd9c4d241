"""The rlk-rocm backend without an AMD GPU: registration, the native module and its GPU targets (the linear_logprob
MFMA kernels among its code objects), the probe's reasons, the primitive table, the argument checks that run
before a kernel. These run wherever rlk-rocm is installed (CI's CPU machine, with Debian's ROCm
5.2 runtime and no GPU); the GPU checks are marked ``gpu``.
"""

from __future__ import annotations

import importlib
import inspect
import os
from importlib import metadata
from pathlib import Path

import pytest
import torch

from rlk.app.info import info
from rlk.core import abi, dispatch, version
from rlk.reference import logprob as ref_logprob
from rlk.reference import norm as ref_norm

rlk_rocm = pytest.importorskip("rlk_rocm", reason="rlk-rocm is not installed (bash ci/build_rocm.sh)")
_native = importlib.import_module("rlk_rocm._native")

IMPLEMENTED = (
    "selected_logprob_fwd",
    "selected_logprob_bwd",
    "linear_logprob_fwd",
    "linear_logprob_bwd",
    "rms_norm_fwd",
    "rms_norm_bwd",
)
logprob = importlib.import_module("rlk_rocm.logprob")


@pytest.fixture
def fresh_probe():
    rlk_rocm._probe_cached.cache_clear()
    rlk_rocm._device_problem.cache_clear()
    yield
    rlk_rocm._probe_cached.cache_clear()
    rlk_rocm._device_problem.cache_clear()


def _default_archs(hip_version: int) -> list[str]:
    requested = os.environ.get("RLK_ROCM_ARCHS", "").replace(",", ";").replace(" ", ";")
    if requested.strip(";"):
        return [a for a in requested.split(";") if a]
    return (
        ["gfx90a", "gfx942"]
        if (hip_version // 10_000_000, hip_version // 100_000 % 100) >= (5, 7)
        else ["gfx90a", "gfx940"]
    )


def test_entry_point_is_registered():
    eps = [ep for ep in metadata.entry_points(group=dispatch.ENTRY_POINT_GROUP) if ep.name == "rocm"]
    assert len(eps) == 1 and eps[0].value == "rlk_rocm:backend"
    assert metadata.distribution("rlk-rocm6").version == rlk_rocm.__version__


def test_native_module_imports_and_matches_the_package():
    assert _native.IMPORT_ERROR is None, _native.IMPORT_ERROR
    c = _native.C
    assert c.__version__ == rlk_rocm.__version__
    assert c.distribution == "rlk-rocm6"
    assert c.runtime_version() > 5 * 10_000_000


def test_recorded_targets_are_the_built_code_objects():
    """The recorded target list is the build's (gfx90a;gfx940 with Debian's ROCm 5.2), and the module's fat binary
    holds a code object for each of them (the offload bundle names them ``amdgcn-amd-amdhsa--<target>``)."""
    c = _native.C
    archs = c.compiled_architectures()
    assert archs == _default_archs(c.runtime_version())
    blob = Path(c.__file__).read_bytes()
    for arch in archs:
        assert f"amdgcn-amd-amdhsa--{arch}".encode() in blob, arch


def test_primitive_table_follows_the_abi():
    backend = rlk_rocm.backend()
    assert backend.name == "rocm" and backend.batch_invariant and backend.abi_version == abi.ABI_VERSION
    assert sorted(backend.primitives) == sorted(IMPLEMENTED)
    assert set(IMPLEMENTED) <= set(abi.PRIMITIVES)
    for name, fn in backend.primitives.items():
        spec = getattr(ref_norm if name.startswith("rms_norm") else ref_logprob, name)
        assert list(inspect.signature(fn).parameters) == list(inspect.signature(spec).parameters), name


def test_ops_it_lacks_fall_through():
    """linear_logprob_stored (and every op but three) is not in the table: dispatch skips rocm for it ("does not
    implement") and the ROCm chain goes on to triton, then reference."""
    table = rlk_rocm.backend().primitives
    for op in ("selected_logprob", "linear_logprob", "rms_norm"):
        assert set(abi.OPS[op].primitives) <= set(table), op
    assert not set(abi.OPS["linear_logprob_stored"].primitives) & set(table)
    assert dispatch._CHAINS["rocm"] == ("rocm", "triton", "reference")


def test_linear_logprob_kernels_are_in_the_code_objects():
    """The MFMA linear_logprob kernels (forward, combine, and the backward's three GEMM kernels, for both 16-bit
    dtypes) are compiled into the module's code objects: their symbol names are in its offload bundle."""
    blob = Path(_native.C.__file__).read_bytes()
    for kernel in (
        "linear_logprob_fwd_kernel",
        "linear_logprob_combine_kernel",
        "linear_logprob_grad_logits_kernel",
        "linear_logprob_grad_hidden_kernel",
        "linear_logprob_grad_weight_kernel",
    ):
        for dtype in ("6__half", "NS_4bf16E"):
            if kernel != "linear_logprob_combine_kernel":
                assert f"{kernel}I{dtype}".encode() in blob, (kernel, dtype)
        assert kernel.encode() in blob, kernel


def test_linear_logprob_sizes():
    """The scratch sizes the native module gives the wrapper (the same splits and chunks of 4096 as rlk-cuda)."""
    c = _native.C
    assert [c.linear_logprob_num_splits(v) for v in (1, 4096, 4097, 151936)] == [1, 1, 2, 38]
    assert [c.linear_logprob_bwd_chunk_cols(v) for v in (1, 128, 1000, 4096, 151936)] == [128, 128, 1024, 4096, 4096]
    assert [c.linear_logprob_bwd_num_chunks(v) for v in (1, 4096, 4097, 151936)] == [1, 1, 2, 38]


def test_linear_logprob_wrapper_checks():
    """What the Python wrappers refuse before any kernel: float32 (declined by supports, so dispatch never sends it),
    and an entropy gradient without the forward's entropy."""
    h = torch.zeros(2, 8)
    w = torch.zeros(3, 8)
    t = torch.zeros(2, dtype=torch.int64)
    f = torch.ones(2)
    with pytest.raises(ValueError, match="float32 not implemented|dtype torch.float32 not implemented"):
        logprob.linear_logprob_fwd(h, w, t, f, -100, f, None, f)
    hb, wb = h.bfloat16(), w.bfloat16()
    with pytest.raises(ValueError, match="entropy: required when grad_entropy is given"):
        logprob.linear_logprob_bwd(hb, wb, t, f, f, None, f, f, -100, torch.empty_like(hb), None)
    # nothing requested: nothing to compute, no kernel
    assert logprob.linear_logprob_bwd(hb, wb, t, f, f, None, f, None, -100, None, None) is None


@pytest.mark.no_gpu
def test_probe_here_says_no_amd_gpu(fresh_probe):
    """This machine: libamdhip64 loads, no GPU; torch is not a ROCm build."""
    reason = rlk_rocm._probe()
    assert reason and reason.startswith("no AMD GPU"), reason
    if torch.version.hip is None:
        assert "is not a ROCm build of torch" in reason
    status = dispatch.discover()["rocm"]
    assert not status.available and status.reason
    assert rlk_rocm._device_types() == ()
    assert "rocm" in info() and f"unavailable: {status.reason}" in info()


def test_probe_without_runtime(fresh_probe, monkeypatch):
    monkeypatch.setattr(_native, "C", None)
    monkeypatch.setattr(
        _native,
        "IMPORT_ERROR",
        "ImportError: libamdhip64.so.6: cannot open shared object file: No such file or directory",
    )
    reason = rlk_rocm._probe()
    assert reason.startswith("no ROCm runtime: libamdhip64 is not loadable"), reason
    monkeypatch.setattr(_native, "IMPORT_ERROR", "ImportError: undefined symbol: foo")
    rlk_rocm._probe_cached.cache_clear()
    assert rlk_rocm._probe().startswith("native module rlk_rocm._C failed to import"), rlk_rocm._probe()


class _FakeC:
    __version__ = rlk_rocm.__version__

    def __init__(self, archs: list[str]):
        self.archs = archs

    def runtime_version(self):
        return 60_241_134

    def device_count(self):
        return len(self.archs)

    def compiled_architectures(self):
        return ["gfx90a", "gfx942"]

    def device_arch(self, index):
        return self.archs[index]


def _rocm_torch(monkeypatch, hip: str | None = "6.2.41134", cuda: str | None = None, available: bool = True):
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(torch.version, "cuda", cuda)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: available)


def test_probe_no_gpu(fresh_probe, monkeypatch):
    monkeypatch.setattr(_native, "C", _FakeC([]))
    _rocm_torch(monkeypatch)
    assert rlk_rocm._probe().startswith("no AMD GPU: the HIP runtime (ROCm 6.2) sees no device")


def test_probe_target_not_built(fresh_probe, monkeypatch):
    monkeypatch.setattr(_native, "C", _FakeC(["gfx1100"]))
    _rocm_torch(monkeypatch)
    reason = rlk_rocm._probe()
    assert "GPU 0 is gfx1100" in reason and "gfx90a, gfx942" in reason and "RLK_ROCM_ARCHS=gfx1100" in reason


def test_probe_available_on_a_built_target(fresh_probe, monkeypatch):
    monkeypatch.setattr(_native, "C", _FakeC(["gfx942:sramecc+:xnack-", "gfx1100"]))
    _rocm_torch(monkeypatch)
    assert rlk_rocm._probe() is None
    assert rlk_rocm._device_types() == ("cuda",)
    assert rlk_rocm._supports("rms_norm_fwd", torch.device("cuda", 0), torch.bfloat16) is None
    assert "gfx1100" in rlk_rocm._supports("rms_norm_fwd", torch.device("cuda", 1), torch.bfloat16)
    for dtype in (torch.float16, torch.bfloat16):
        assert rlk_rocm._supports("linear_logprob_fwd", torch.device("cuda", 0), dtype) is None
    assert "float32 not implemented" in rlk_rocm._supports("linear_logprob_bwd", torch.device("cuda", 0), torch.float32)
    assert rlk_rocm._supports("selected_logprob_fwd", torch.device("cuda", 0), torch.float32) is None


def test_probe_on_a_cuda_torch(fresh_probe, monkeypatch):
    """An NVIDIA machine with rlk-rocm installed: torch is a CUDA build, which the probe says."""
    monkeypatch.setattr(_native, "C", _FakeC(["gfx90a"]))
    _rocm_torch(monkeypatch, hip=None, cuda="13.0")
    reason = rlk_rocm._probe()
    assert "is not a ROCm build of torch (a CUDA build (CUDA 13.0))" in reason, reason
    _rocm_torch(monkeypatch, available=False)
    rlk_rocm._probe_cached.cache_clear()
    assert "sees no GPU" in rlk_rocm._probe()


def test_version_check_refuses_another_rlk(monkeypatch):
    reason = rlk_rocm.version_problem("9.9.9")
    assert reason and rlk_rocm.__version__ in reason and "9.9.9" in reason
    monkeypatch.setattr(version, "__version__", "9.9.9")
    backend = rlk_rocm.backend()
    assert backend.primitives == {} and backend.probe() == reason and backend.device_types() == ()


def test_native_layer_rejects_cpu_tensors():
    x = torch.zeros(2, 3)
    t = torch.zeros(2, dtype=torch.int64)
    f = torch.ones(2)
    with pytest.raises(TypeError):
        _native.C.selected_logprob_fwd(x, t, f, -100, f, None, f, 0)
    hb = torch.zeros(2, 8, dtype=torch.bfloat16)
    wb = torch.zeros(3, 8, dtype=torch.bfloat16)
    parts = torch.zeros(1, 2)
    with pytest.raises(TypeError):
        _native.C.linear_logprob_fwd(hb, wb, t, f, -100, f, None, f, parts, parts, None, f, 0)
    with pytest.raises(TypeError):
        _native.C.linear_logprob_bwd(hb, wb, t, f, f, None, f, None, -100, hb, None, None, None, 0)


def test_supports_declines_other_dtypes_and_devices():
    assert "float64" in rlk_rocm._supports("rms_norm_fwd", torch.device("cuda", 0), torch.float64)
    assert "cpu" in rlk_rocm._supports("rms_norm_fwd", torch.device("cpu"), torch.float32)


@pytest.mark.gpu
@pytest.mark.rocm
def test_available_on_an_amd_gpu():
    assert rlk_rocm._probe() is None
    assert _native.C.device_problem(torch.cuda.current_device()) == ""
    for op in ("selected_logprob", "rms_norm"):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            assert dispatch.decide(op, torch.device("cuda", 0), dtype).backend == "rocm"
    for dtype in (torch.float16, torch.bfloat16):
        assert dispatch.decide("linear_logprob", torch.device("cuda", 0), dtype).backend == "rocm"
    assert dispatch.decide("linear_logprob", torch.device("cuda", 0), torch.float32).backend != "rocm"
    assert dispatch.decide("linear_logprob_stored", torch.device("cuda", 0), torch.bfloat16).backend != "rocm"
