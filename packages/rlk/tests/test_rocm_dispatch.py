"""The ROCm dispatch chain on a faked HIP build of torch (no AMD GPU needed).

A ROCm torch is a "cuda" device type with ``torch.version.hip`` set; :func:`rlk.core.dispatch.chain_for` walks
``rocm -> triton -> reference`` there. Devices are plain ``torch.device("cuda")`` objects: ``decide`` looks only at
a device's type and the backends' own checks, never at a tensor, so nothing here allocates on a GPU.
"""

from __future__ import annotations

import pytest
import torch

from rlk import reference
from rlk.core import abi, dispatch
from rlk.core.backend import Backend

HIP = "6.4.43482-0f2d60242"  # a torch.version.hip string of a ROCm wheel
GPU = torch.device("cuda")


@pytest.fixture(autouse=True)
def _fresh_dispatch(monkeypatch):
    monkeypatch.delenv("RLK_BACKEND", raising=False)
    dispatch.refresh()
    yield
    monkeypatch.undo()
    dispatch.refresh()


@pytest.fixture
def hip(monkeypatch):
    """torch as a ROCm build: ``torch.version.hip`` set, ``torch.version.cuda`` None."""
    monkeypatch.setattr(torch.version, "hip", HIP)
    monkeypatch.setattr(torch.version, "cuda", None)


def _gpu_backend(name: str, **overrides) -> Backend:
    """An available backend of every primitive (the reference's) that serves the "cuda" device type."""
    fields = dict(
        name=name,
        version="9.9",
        abi_version=abi.ABI_VERSION,
        primitives=reference.backend().primitives,
        probe=lambda: None,
        device_types=lambda: ("cuda",),
        batch_invariant=True,
    )
    fields.update(overrides)
    return Backend(**fields)


def _install(monkeypatch, *statuses: dispatch.BackendStatus):
    found = {"reference": dispatch._load_reference(), **{s.name: s for s in statuses}}
    monkeypatch.setattr(dispatch, "discover", lambda: found)


def _status(backend: Backend) -> dispatch.BackendStatus:
    return dispatch._status_of(backend.name, lambda: backend, "test")


def test_a_hip_build_chains_a_gpu_through_rocm_triton_reference(hip):
    assert dispatch.chain_for(GPU) == ("rocm", "triton", "reference")
    assert dispatch.chain_for(torch.device("cuda", 3)) == ("rocm", "triton", "reference")
    assert dispatch.chain_for(torch.device("cpu")) == ("reference",)
    assert "cuda" not in dispatch.chain_for(GPU)


def test_a_cuda_build_keeps_the_cuda_chain(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None)
    assert dispatch.chain_for(GPU) == ("cuda", "triton", "reference")


def test_an_absent_rocm_backend_is_skipped_and_triton_serves(monkeypatch, hip):
    _install(monkeypatch, _status(_gpu_backend("triton")))
    decision = dispatch.decide("selected_logprob", GPU, torch.bfloat16)
    assert decision.chain == ("rocm", "triton", "reference")
    assert decision.backend == "triton"
    assert decision.skipped == (("rocm", "not installed"),)
    assert "chain rocm -> triton -> reference" in str(decision) and "skip rocm: not installed" in str(decision)


@pytest.mark.parametrize(
    "rocm, reason",
    [
        (_gpu_backend("rocm", probe=lambda: "no ROCm GPU visible"), "unavailable: no ROCm GPU visible"),
        (
            _gpu_backend("rocm", abi_version=abi.ABI_VERSION + 1),
            f"unavailable: built for rlk ABI {abi.ABI_VERSION + 1}, this rlk speaks ABI {abi.ABI_VERSION}",
        ),
        (_gpu_backend("rocm", device_types=lambda: ("cpu",)), "does not serve device type 'cuda' (serves: cpu)"),
        (_gpu_backend("rocm", primitives={}), "does not implement selected_logprob_fwd, selected_logprob_bwd"),
        (
            _gpu_backend("rocm", supports=lambda p, d, t: "bfloat16 declined" if t == torch.bfloat16 else None),
            "bfloat16 declined",
        ),
    ],
)
def test_a_rocm_backend_that_cannot_serve_is_skipped_with_its_reason(monkeypatch, caplog, hip, rocm, reason):
    _install(monkeypatch, _status(rocm), _status(_gpu_backend("triton")))
    decision = dispatch.decide("selected_logprob", GPU, torch.bfloat16)
    assert decision.backend == "triton" and decision.skipped == (("rocm", reason),)
    with caplog.at_level("WARNING", logger="rlk"):
        assert dispatch.select("selected_logprob", GPU, torch.bfloat16).name == "triton"
    assert f"falls back from 'rocm' to 'triton': {reason}" in caplog.text


def test_an_available_rocm_backend_comes_first(monkeypatch, hip):
    _install(monkeypatch, _status(_gpu_backend("rocm")), _status(_gpu_backend("triton")))
    decision = dispatch.decide("selected_logprob", GPU, torch.float16)
    assert decision.backend == "rocm" and decision.skipped == ()


def test_the_cuda_backend_is_never_chosen_on_hip(monkeypatch, hip):
    """Even a cuda backend that says it is available and serves "cuda" devices: it is not in the HIP chain, so
    the chain falls through to triton, then the reference."""
    cuda = _status(_gpu_backend("cuda"))
    _install(monkeypatch, cuda, _status(_gpu_backend("triton")))
    assert cuda.available
    decision = dispatch.decide("selected_logprob", GPU, torch.bfloat16)
    assert decision.backend == "triton" and all(name != "cuda" for name, _ in decision.skipped)
    _install(monkeypatch, cuda, _status(_gpu_backend("triton", probe=lambda: "no GPU")))
    decision = dispatch.decide("selected_logprob", GPU, torch.bfloat16)
    assert decision.backend == "reference"
    assert [name for name, _ in decision.skipped] == ["rocm", "triton"]


def test_the_real_triton_backend_serves_a_hip_gpu(monkeypatch, hip):
    """rlk_triton's probe on a ROCm torch with a GPU: available (it asks torch.cuda.is_available only, no NVIDIA
    capability), serves "cuda" devices, and takes every op of the chain after an absent rocm backend."""
    rlk_triton = pytest.importorskip("rlk_triton")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    triton_status = dispatch._status_of("triton", rlk_triton.backend, "rlk_triton:backend")
    assert triton_status.available, triton_status.reason
    assert "cuda" in triton_status.backend.device_types()
    _install(monkeypatch, triton_status)
    for op in abi.OPS:
        for dtype in (torch.float32, torch.bfloat16):
            decision = dispatch.decide(op, GPU, dtype)
            assert decision.backend == "triton", str(decision)
            assert decision.skipped == (("rocm", "not installed"),)


@pytest.mark.native
@pytest.mark.no_gpu
def test_the_real_rocm_backend_without_an_amd_gpu_is_skipped_and_triton_serves(monkeypatch, hip):
    """rlk_rocm (where installed) on a machine without an AMD GPU or HIP runtime: unavailable, with its reason, and
    the real triton backend serves the op next in the chain."""
    import rlk_rocm
    import rlk_triton

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    clear = getattr(getattr(rlk_rocm, "_probe_cached", None), "cache_clear", lambda: None)
    clear()
    try:
        rocm = dispatch._status_of("rocm", rlk_rocm.backend, "rlk_rocm:backend")
    finally:
        clear()
    assert not rocm.available, f"rlk-rocm is available on a machine without a GPU: {rocm.reason}"
    _install(monkeypatch, rocm, dispatch._status_of("triton", rlk_triton.backend, "rlk_triton:backend"))
    decision = dispatch.decide("selected_logprob", GPU, torch.float32)
    assert decision.backend == "triton"
    assert decision.skipped == (("rocm", f"unavailable: {rocm.reason}"),)


@pytest.mark.native
def test_the_real_cuda_backend_refuses_a_hip_build(monkeypatch, hip):
    """rlk_cuda's probe on a ROCm torch (its native module taken as loaded): unavailable, saying why."""
    import rlk_cuda

    monkeypatch.setattr(rlk_cuda, "_native_problem", lambda: None)
    rlk_cuda._probe_cached.cache_clear()
    try:
        assert rlk_cuda._probe() == f"torch {torch.__version__} is a ROCm build; rlk-cuda serves NVIDIA GPUs"
        assert rlk_cuda._device_types() == ()
    finally:
        rlk_cuda._probe_cached.cache_clear()
