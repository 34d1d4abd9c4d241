"""NVIDIA-only launch paths of the Triton backend stay off on a ROCm build of torch (faked: no AMD GPU needed).

On ROCm, ``torch.cuda.get_device_capability`` reports the gfx version as a pair (gfx90a / MI200: ``(9, 0)``,
gfx942 / MI300: ``(9, 4)``, gfx950: ``(9, 5)``), so a check ``capability >= (9, 0)`` alone would take an AMD GPU
for a Hopper. The policy-loss kernels' CUDA-only options (``maxnreg``, programmatic dependent launch) check
``torch.version.hip`` first, and so do the matmul's H200-checked tile buckets and its TMA kernel;
``tools/triton_aot_check.py --arch gfx942 gfx90a`` compiles them without those options.
"""

from __future__ import annotations

import pytest
import torch

from rlk_triton import matmul, policy_loss

#: gfx name -> what torch.cuda.get_device_capability reports for it on ROCm
ROCM_CAPABILITIES = {"gfx90a": (9, 0), "gfx942": (9, 4), "gfx950": (9, 5)}


@pytest.fixture
def programmatic_launch():
    policy_loss._programmatic_launch.cache_clear()
    yield policy_loss._programmatic_launch
    policy_loss._programmatic_launch.cache_clear()


@pytest.mark.parametrize("gfx", sorted(ROCM_CAPABILITIES))
def test_policy_loss_uses_no_cuda_only_launch_option_on_hip(monkeypatch, programmatic_launch, gfx):
    monkeypatch.setattr(torch.version, "hip", "6.4.43482-0f2d60242")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: ROCM_CAPABILITIES[gfx])
    assert policy_loss._register_limit() == {}
    assert programmatic_launch(0) is False


@pytest.mark.parametrize("capability, pdl", [((9, 0), True), ((10, 0), True), ((8, 0), False)])
def test_policy_loss_launch_options_on_cuda(monkeypatch, programmatic_launch, capability, pdl):
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: capability)
    assert policy_loss._register_limit() == (
        {"maxnreg": policy_loss.MAX_REGISTERS} if policy_loss.MAX_REGISTERS else {}
    )
    assert programmatic_launch(0) is pdl


class _OnGpu:
    """A CPU tensor that says it is on ``cuda:0`` (what ``_tma_operands`` reads: dtype, shape, strides, pointer)."""

    device = torch.device("cuda", 0)

    def __init__(self, t):
        self._t = t

    def __getattr__(self, name):
        return getattr(self._t, name)

    @property
    def T(self):
        return _OnGpu(self._t.T)


@pytest.mark.parametrize(
    "hip, capability, nvidia_paths",
    [
        ("6.4.43482", ROCM_CAPABILITIES["gfx90a"], False),
        ("6.4.43482", ROCM_CAPABILITIES["gfx942"], False),
        ("6.4.43482", ROCM_CAPABILITIES["gfx950"], False),
        (None, (9, 0), True),
    ],
)
def test_matmul_takes_the_h200_buckets_and_tma_on_nvidia_only(monkeypatch, hip, capability, nvidia_paths):
    monkeypatch.setattr(torch.version, "hip", hip)
    monkeypatch.setattr(matmul, "_capability", lambda index: capability)
    gpu = torch.device("cuda", 0)
    assert matmul.buckets_serve(gpu) is nvidia_paths
    assert (matmul.tiles_for(torch.bfloat16, 4096, 1, gpu) is not matmul.TILE_CONFIGS[torch.bfloat16]) is nvidia_paths
    a = _OnGpu(torch.zeros(256, 128, dtype=torch.bfloat16))
    w = torch.zeros(384, 128, dtype=torch.bfloat16)
    out = _OnGpu(torch.zeros(256, 384, dtype=torch.bfloat16))
    assert matmul._tma_operands(a, _OnGpu(w.T), None, out) is nvidia_paths
