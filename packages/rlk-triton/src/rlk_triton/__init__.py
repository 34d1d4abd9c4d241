"""rlk-triton: the Triton backend of rlk (NVIDIA and AMD GPUs; the CPU through
``TRITON_INTERPRET=1``, for tests).

rlk finds it through the entry point ``rlk.backends: triton = rlk_triton:backend``.
Every kernel is batch-invariant by construction: fixed tile sizes per dtype,
no autotuning, no atomics, reductions in a fixed order (see ``logprob.py``).
"""

from __future__ import annotations

import os

import torch

__version__ = "0.1.0"

#: The rlk op ABI this backend implements (rlk.core.abi.ABI_VERSION it was written for); rlk refuses a backend whose ABI
#: differs from its own.
ABI_VERSION = 3

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_PACK_INT_DTYPES = (torch.int32, torch.int64)
#: Primitives declined for bfloat16 under the CPU interpreter: kernels that use tl.dot (wrong results there), and
#: the forward-chain ops whose bf16 outputs the interpreter truncates instead of rounding (verified on the GPU).
_NO_BF16_ON_CPU = (
    "linear_",
    "fused_linear_",
    "matmul_",
    "attention_",
    "prefix_attention_",
    "rms_norm_",
    "softmax_",
    "rope_",
    "embedding_",
    "ema_",
    "sample_",
)
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


#: The triton releases this backend is tested with (CI: the pinned 3.6 and 3.9, what torch 2.15 brings, under the
#: interpreter and compiled ahead of time for sm_90 / sm_80). Older ones are refused by the probe; newer ones run.
TESTED_TRITON = ("3.6", "3.9")
_MINIMUM_TRITON = (3, 6)


def _probe() -> str | None:
    try:
        import triton
    except Exception as exc:
        return f"triton not importable: {type(exc).__name__}: {exc}"
    try:
        release = tuple(int(part) for part in triton.__version__.split("+")[0].split(".")[:2])
    except ValueError:
        release = _MINIMUM_TRITON  # an unusual version string (a source build): let it run
    if release < _MINIMUM_TRITON:
        return (
            f"triton {triton.__version__} is older than rlk-triton supports (>= 3.6; tested with "
            f"{', '.join(TESTED_TRITON)})"
        )
    if _INTERPRET:
        return None
    if not torch.cuda.is_available():
        return "no GPU visible to torch (set TRITON_INTERPRET=1 to run the kernels on the CPU, slowly)"
    return None


def _device_types() -> tuple[str, ...]:
    if _probe() is not None:
        return ()
    types = ("cuda",) if torch.cuda.is_available() else ()
    return types + (("cpu",) if _INTERPRET else ())


def _supports(primitive: str, device: torch.device, dtype: torch.dtype) -> str | None:
    if primitive.startswith("pack_") and dtype in _PACK_INT_DTYPES:
        return None  # pack / unpack copy integer ids too
    if dtype not in _DTYPES:
        return f"dtype {dtype} not supported (bfloat16, float16, float32)"
    if device.type == "cpu" and dtype == torch.bfloat16 and primitive.startswith(_NO_BF16_ON_CPU):
        return (
            "bfloat16 under the Triton CPU interpreter: wrong tl.dot results, fp32->bf16 casts truncated "
            "(verified on the GPU)"
        )
    return None


def _selfcheck(device: torch.device) -> list[str]:
    """On a GPU: the matmul's ``M`` buckets give the bits of its fixed tiles (:func:`matmul.tile_buckets_agree`)."""
    if device.type != "cuda":
        return []
    from rlk_triton import matmul

    problems = []
    for dtype in matmul.M_TILE_CONFIGS:
        problems += matmul.tile_buckets_agree(device, dtype)
    return problems


def version_problem(rlk_version: str) -> str | None:
    """None if this backend may run under rlk ``rlk_version``, else why not (rlk's ``triton`` extra pins them). Kept
    in the backend, not imported from rlk: it has to work against an rlk of another version."""
    if rlk_version == __version__:
        return None
    return (
        f"rlk-triton {__version__} needs rlk {__version__}, found rlk {rlk_version}: install matching versions "
        f"(pip install 'rlk[triton]=={rlk_version}' pins both)"
    )


def backend():
    """The ``rlk.Backend`` of this package (entry-point factory)."""
    from rlk.core.abi import collect_primitives
    from rlk.core.backend import Backend
    from rlk.core.version import __version__ as rlk_version

    mismatch = version_problem(rlk_version)
    if mismatch is not None:
        return Backend(
            name="triton",
            version=__version__,
            abi_version=ABI_VERSION,
            primitives={},
            probe=lambda: mismatch,
            device_types=lambda: (),
        )
    from rlk_triton import (
        advantages,
        attention,
        distill,
        ema,
        embedding,
        lm_head,
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

    primitives = collect_primitives(
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
    # the LM-head primitives: the cuBLAS-tiled path or logprob's kernels, per call (lm_head.lm_head_path)
    primitives.update(lm_head.PRIMITIVES)
    return Backend(
        name="triton",
        version=__version__,
        abi_version=ABI_VERSION,
        primitives=primitives,
        probe=_probe,
        device_types=_device_types,
        supports=_supports,
        batch_invariant=True,
        limits={
            name: {"head_dim": attention.MAX_HEAD_DIM}
            for name in ("attention_fwd", "attention_bwd", "prefix_attention_fwd", "prefix_attention_bwd")
        },
        selfcheck=_selfcheck,
    )
