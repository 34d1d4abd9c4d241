"""rlk inside vLLM: a plugin whose rollout log-probs are bitwise the trainer's (transformers + rlk), and weight sync.

Off unless enabled: ``RLK_VLLM=1`` in the environment (the ``vllm.general_plugins`` entry point ``rlk`` then
installs it in every vLLM process, the spawned workers included), or :func:`enable` before the engine starts
(it also sets ``RLK_VLLM=1`` for the workers vLLM spawns later). With it on, vLLM's model forward and log-probs run
rlk's batch-invariant chain in the trainer's op order (:mod:`rlk.integrations.vllm.plugin`); served models: dense
Qwen3 and Llama (:data:`SERVED_ARCHITECTURES`), others are refused when the engine builds them. vLLM versions:
:data:`SUPPORTED_VLLM`. See ``docs/vllm.md``.

* :func:`enable` / :func:`disable` / :func:`is_enabled`; :func:`register` is the entry point;
* :func:`sync_weights` / :func:`weight_checksums` (:mod:`rlk.integrations.vllm.weights`): the trainer's weights into
  a running in-process engine through its ``load_weights``, each synced tensor checked bitwise.

vLLM is imported only when a function here is called (optional dependency: ``pip install 'rlk[vllm]'``).
"""

from __future__ import annotations

import os

from rlk.integrations.vllm.attention import SERVED_ARCHITECTURES
from rlk.integrations.vllm.ops import NotServed
from rlk.integrations.vllm.plugin import SUPPORTED_VLLM, TESTED_VLLM, UnsupportedVLLM, check_version
from rlk.integrations.vllm.weights import sync_weights, vllm_state_dict, weight_checksums

ENV_FLAG = "RLK_VLLM"


def _require_vllm() -> None:
    from rlk.integrations import extras

    extras.require("vllm", needed_by="rlk.integrations.vllm")


def _flag_on() -> bool:
    value = os.environ.get(ENV_FLAG, "0").strip().lower()
    if value not in ("", "0", "1", "false", "true", "off", "on"):
        raise ValueError(f"{ENV_FLAG}={os.environ[ENV_FLAG]!r}: expected 0 or 1")
    return value in ("1", "true", "on")


def enable() -> None:
    """Turn the plugin on in this process (and, through ``RLK_VLLM=1``, in the worker processes vLLM spawns
    afterwards). Call before creating the engine: models built earlier keep vLLM's own kernels."""
    _require_vllm()
    from rlk.integrations.vllm import plugin

    plugin.install()
    os.environ[ENV_FLAG] = "1"


def disable() -> None:
    """Turn the plugin off in this process (``RLK_VLLM=0`` for workers spawned afterwards) and the aten overrides
    of :func:`rlk.enable_batch_invariant` with it. Engines built while it was on keep its layers."""
    os.environ[ENV_FLAG] = "0"
    from rlk.integrations.vllm import plugin

    if plugin.is_installed():
        plugin.uninstall()


def is_enabled() -> bool:
    from rlk.integrations.vllm import plugin

    return plugin.is_installed()


def register() -> None:
    """The ``vllm.general_plugins`` entry point (``rlk = rlk.integrations.vllm:register``): installs the plugin
    when ``RLK_VLLM=1``, does nothing otherwise (vLLM then runs exactly its own code)."""
    if _flag_on():
        enable()


__all__ = [
    "ENV_FLAG",
    "NotServed",
    "SERVED_ARCHITECTURES",
    "SUPPORTED_VLLM",
    "TESTED_VLLM",
    "UnsupportedVLLM",
    "check_version",
    "disable",
    "enable",
    "is_enabled",
    "register",
    "sync_weights",
    "vllm_state_dict",
    "weight_checksums",
]
