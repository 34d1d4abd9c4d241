"""The rlk-cuda backend without a GPU: registration, the native module, the probe, the version check.

These run everywhere rlk-cuda is installed (CI's CPU machines included); the GPU-only checks of the
same facts are marked ``gpu``.
"""

from __future__ import annotations

import importlib
import inspect
from importlib import metadata

import pytest
import torch

from rlk.app.info import info
from rlk.core import abi, dispatch, version
from rlk.reference import distill as ref_distill
from rlk.reference import logprob as ref_logprob
from rlk.reference import norm as ref_norm

rlk_cuda = pytest.importorskip("rlk_cuda", reason="rlk-cuda is not installed (bash ci/build_cuda.sh)")
_native = importlib.import_module("rlk_cuda._native")

IMPLEMENTED = (
    "selected_logprob_fwd",
    "selected_logprob_bwd",
    "linear_logprob_fwd",
    "linear_logprob_bwd",
    "linear_logprob_stored_fwd",
    "linear_logprob_stored_bwd",
    "rms_norm_fwd",
    "rms_norm_bwd",
    "fused_linear_kl_fwd",
    "fused_linear_kl_bwd",
)


def test_entry_point_is_registered():
    eps = [ep for ep in metadata.entry_points(group=dispatch.ENTRY_POINT_GROUP) if ep.name == "cuda"]
    assert len(eps) == 1 and eps[0].value == "rlk_cuda:backend"


def test_native_module_imports_and_matches_the_package():
    assert _native.IMPORT_ERROR is None, _native.IMPORT_ERROR
    c = _native.C
    assert c.__version__ == rlk_cuda.__version__
    assert c.distribution in ("rlk-cuda12", "rlk-cuda13")
    assert c.runtime_version() // 1000 == int(c.distribution.removeprefix("rlk-cuda"))
    archs = c.compiled_architectures()
    assert archs and all(a.endswith(("-real", "-virtual")) for a in archs)


def test_primitive_table_follows_the_abi():
    backend = rlk_cuda.backend()
    assert backend.name == "cuda" and backend.batch_invariant and backend.abi_version == abi.ABI_VERSION
    assert sorted(backend.primitives) == sorted(IMPLEMENTED)
    for name, fn in backend.primitives.items():
        family = ref_logprob if name.startswith(("selected", "linear")) else ref_norm
        spec = getattr(ref_distill if name.startswith("fused_linear_kl") else family, name)
        assert list(inspect.signature(fn).parameters) == list(inspect.signature(spec).parameters), name


@pytest.mark.no_gpu
def test_probe_says_why_unavailable_without_gpu():
    reason = rlk_cuda._probe()
    assert reason and ("driver" in reason or "GPU" in reason), reason
    status = dispatch.discover()["cuda"]
    assert not status.available and status.reason == reason
    assert rlk_cuda._device_types() == ()
    assert f"unavailable: {reason}" in info()


def test_version_check_refuses_another_rlk(monkeypatch):
    reason = rlk_cuda.version_problem("9.9.9")
    assert reason and rlk_cuda.__version__ in reason and "9.9.9" in reason
    assert rlk_cuda.version_problem(rlk_cuda.__version__) is None
    monkeypatch.setattr(version, "__version__", "9.9.9")
    backend = rlk_cuda.backend()
    assert backend.primitives == {} and backend.probe() == reason and backend.device_types() == ()


def test_native_layer_rejects_cpu_tensors():
    x = torch.zeros(2, 3)
    t = torch.zeros(2, dtype=torch.int64)
    f = torch.ones(2)
    with pytest.raises(TypeError):
        _native.C.selected_logprob_fwd(x, t, f, -100, f, None, f, 0)


def test_supports_declines_other_dtypes_and_devices():
    assert "float64" in rlk_cuda._supports("rms_norm_fwd", torch.device("cuda", 0), torch.float64)
    assert "cpu" in rlk_cuda._supports("rms_norm_fwd", torch.device("cpu"), torch.float32)
    assert "float32 not implemented" in rlk_cuda._supports(
        "fused_linear_kl_fwd", torch.device("cuda", 0), torch.float32
    )


@pytest.mark.parametrize(
    ("archs", "capability", "served"),
    [
        (["90a-real"], (9, 0), True),
        (["90a-real"], (10, 0), False),
        (["90a-real"], (8, 0), False),
        (["80-real"], (8, 6), True),
        (["80-real"], (9, 0), False),
        (["80-real", "90a-real"], (9, 0), True),
        (["100-real"], (10, 3), True),
        (["120-virtual"], (13, 0), True),
        (["120-virtual"], (9, 0), False),
        (["90a-virtual"], (10, 0), False),
    ],
)
def test_architecture_compatibility(archs, capability, served):
    assert _native.compute_capability_served(archs, capability) is served


@pytest.mark.gpu
def test_available_on_gpu():
    assert rlk_cuda._probe() is None
    assert dispatch.discover()["cuda"].available
    assert _native.C.device_problem(torch.cuda.current_device()) == ""
    for op in ("selected_logprob", "rms_norm"):
        for dtype in (torch.float32, torch.float16, torch.bfloat16):
            assert dispatch.decide(op, torch.device("cuda", 0), dtype).backend == "cuda"
    # linear_logprob: bfloat16 / float16 here, float32 falls through to the next backend of the chain
    for dtype in (torch.float16, torch.bfloat16):
        assert dispatch.decide("linear_logprob", torch.device("cuda", 0), dtype).backend == "cuda"
    assert dispatch.decide("linear_logprob", torch.device("cuda", 0), torch.float32).backend != "cuda"
    # fused_linear_kl: the Hopper kernels only (16-bit); elsewhere it falls through with the reason
    from rlk_cuda import distill

    for dtype in (torch.float16, torch.bfloat16):
        decision = dispatch.decide("fused_linear_kl", torch.device("cuda", 0), dtype)
        assert (decision.backend == "cuda") == (distill.problem(torch.device("cuda", 0)) is None), decision
    assert dispatch.decide("fused_linear_kl", torch.device("cuda", 0), torch.float32).backend != "cuda"
