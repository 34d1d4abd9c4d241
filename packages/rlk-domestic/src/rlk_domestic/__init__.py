"""rlk-domestic: the rlk backend for Ascend (``npu``), Cambricon (``mlu``), Moore Threads (``musa``) and MetaX
(MACA) devices: device-generic PyTorch that runs rlk's reference (the spec) on fixed-shape blocks of rows, so every
result is batch-invariant (:mod:`rlk_domestic.blocks`; docs/domestic.md).

rlk finds it through the entry point ``rlk.backends: domestic = rlk_domestic:backend``. Nothing of it has run on
Ascend, Cambricon, Moore Threads or MetaX hardware yet; on the CPU it serves only under ``RLK_DOMESTIC_STANDIN=cpu``
(for tests).
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os

import torch

__version__ = "0.1.0"

#: The rlk op ABI this backend implements (rlk.core.abi.ABI_VERSION it was written for); rlk refuses a backend whose ABI
#: differs from its own.
ABI_VERSION = 3

#: ``RLK_DOMESTIC_STANDIN=cpu`` makes the backend serve the CPU device (tests only; never on by default).
ENV_STANDIN = "RLK_DOMESTIC_STANDIN"

#: torch device type -> (vendor device, the torch plugin that registers it). The plugins register the device types
#: through torch's PrivateUse1 mechanism (``torch.npu``, ``torch.mlu``, ``torch.musa``).
PLUGINS = {
    "npu": ("Ascend NPU", "torch_npu"),
    "mlu": ("Cambricon MLU", "torch_mlu"),
    "musa": ("Moore Threads GPU", "torch_musa"),
}
#: MetaX's PyTorch (a torch build whose version carries ``+metax``) registers no device type of its own: its GPUs are
#: ``cuda`` devices (``torch.cuda``), so the backend serves ``cuda`` only in such a build, and only when pinned
#: (``RLK_BACKEND=domestic``): the ``cuda`` chain is NVIDIA's.
METAX_DEVICE = "cuda"

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_PACK_INT_DTYPES = (torch.int32, torch.int64)


def standin() -> bool:
    """Whether the CPU stand-in is on (``RLK_DOMESTIC_STANDIN=cpu``)."""
    return os.environ.get(ENV_STANDIN, "") == "cpu"


def _plugin_device(device_type: str) -> str | None:
    """None if ``device_type``'s torch plugin imports and reports a device, else why not."""
    vendor, plugin = PLUGINS[device_type]
    if importlib.util.find_spec(plugin) is None:
        return f"no {vendor}: {plugin} is not installed"
    try:
        importlib.import_module(plugin)
    except Exception as exc:  # a plugin without its SDK (CANN, Neuware, MUSA toolkit) fails to import
        return f"no {vendor}: {plugin} does not import ({type(exc).__name__}: {exc})"
    module = getattr(torch, device_type, None)
    try:
        count = module.device_count() if module is not None and module.is_available() else 0
    except Exception as exc:
        return f"no {vendor}: torch.{device_type} raised {type(exc).__name__}: {exc}"
    return None if count > 0 else f"no {vendor}: {plugin} imports but torch.{device_type} reports no device"


def _metax() -> str | None:
    """None on a MetaX (MACA) build of torch that sees a GPU, else why not."""
    if "metax" not in torch.__version__:
        return f"no MetaX GPU: torch {torch.__version__} is not a MetaX (MACA) build"
    if not torch.cuda.is_available():
        return "no MetaX GPU: the MetaX build of torch sees no device"
    return None


@functools.cache
def _devices() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The vendor device types found in this process and the reasons of the others (looked up once)."""
    served, reasons = [], []
    for device_type, reason in [(t, _plugin_device(t)) for t in PLUGINS] + [(METAX_DEVICE, _metax())]:
        if reason is None:
            served.append(device_type)
        else:
            reasons.append(reason)
    return tuple(served), tuple(reasons)


def _served() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The device types served now (the vendors', and the CPU under the stand-in) and the reasons of the others."""
    served, reasons = _devices()
    return served + (("cpu",) if standin() else ()), reasons


def _probe() -> str | None:
    served, reasons = _served()
    if served:
        return None
    return "; ".join(reasons) + f" (set {ENV_STANDIN}=cpu to serve the CPU, for tests)"


def _device_types() -> tuple[str, ...]:
    return _served()[0]


def _supports(primitive: str, device: torch.device, dtype: torch.dtype) -> str | None:
    if primitive.startswith("pack_") and dtype in _PACK_INT_DTYPES:
        return None  # pack / unpack copy integer ids too
    if dtype not in _DTYPES:
        return f"dtype {dtype} not supported (bfloat16, float16, float32)"
    return None


def _selfcheck(device: torch.device) -> list[str]:
    """The assumption the invariance rests on, on ``device``: a row gives the same bits at every position of a
    block (:func:`rlk_domestic.selfcheck.positions_agree`)."""
    from rlk_domestic import selfcheck

    return selfcheck.positions_agree(device)


def version_problem(rlk_version: str) -> str | None:
    """None if this backend may run under rlk ``rlk_version``, else why not (rlk's ``domestic`` extra pins them).
    Kept in the backend, not imported from rlk: it has to work against an rlk of another version."""
    if rlk_version == __version__:
        return None
    return (
        f"rlk-domestic {__version__} needs rlk {__version__}, found rlk {rlk_version}: install matching versions "
        f"(pip install 'rlk[domestic]=={rlk_version}' pins both)"
    )


def backend():
    """The ``rlk.Backend`` of this package (entry-point factory)."""
    from rlk.core.abi import collect_primitives
    from rlk.core.backend import Backend
    from rlk.core.version import __version__ as rlk_version

    mismatch = version_problem(rlk_version)
    if mismatch is not None:
        return Backend(
            name="domestic",
            version=__version__,
            abi_version=ABI_VERSION,
            primitives={},
            probe=lambda: mismatch,
            device_types=lambda: (),
        )
    from rlk_domestic import (
        advantages,
        attention,
        distill,
        ema,
        embedding,
        logprob,
        losses,
        matmul,
        norm,
        pack,
        policy_loss,
        rewards,
        rollout_correction,
        rope,
        sampling,
        softmax,
    )

    return Backend(
        name="domestic",
        version=__version__,
        abi_version=ABI_VERSION,
        primitives=collect_primitives(
            advantages,
            attention,
            distill,
            ema,
            embedding,
            logprob,
            losses,
            matmul,
            norm,
            pack,
            policy_loss,
            rewards,
            rollout_correction,
            rope,
            sampling,
            softmax,
        ),
        probe=_probe,
        device_types=_device_types,
        supports=_supports,
        batch_invariant=True,
        selfcheck=_selfcheck,
    )
