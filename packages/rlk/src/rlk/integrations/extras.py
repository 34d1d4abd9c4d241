"""rlk's optional dependencies: the extra of ``rlk`` (``packages/rlk/pyproject.toml``) that installs each module the
integrations and the ``rlk`` commands import, and the one error that says so.

:func:`require` imports modules and raises :class:`MissingDependency` (a ``ModuleNotFoundError`` whose message names
the distribution and ``pip install 'rlk[<extra>]'``) for the first that does not import; the ``rlk`` command line
prints :func:`hint` in one line and exits with code 2.
"""

from __future__ import annotations

import importlib

#: module (top-level name) -> (distribution, extra of rlk that installs it)
OPTIONAL = {
    "transformers": ("transformers", "hf"),
    "tokenizers": ("tokenizers", "hf"),
    "PIL": ("Pillow", "hf"),
    "matplotlib": ("matplotlib", "hf"),
    "tqdm": ("tqdm", "hf"),
    "trl": ("trl", "trl"),
    "accelerate": ("accelerate", "trl"),
    "verl": ("verl", "verl"),
    "numpy": ("numpy", "verl"),  # rlk.integrations.verl imports it (transformers and trl bring it too)
    "triton": ("triton", "triton"),
    "vllm": ("vllm", "vllm"),
    "megatron": ("megatron-core", "megatron"),
    "deepspeed": ("deepspeed", "deepspeed"),
}


class MissingDependency(ModuleNotFoundError):
    """An optional dependency does not import. ``name``: the module; ``hint``: ``"needs the optional dependency
    <distribution> (pip install 'rlk[<extra>]')"``; the message: ``"<needed_by> <hint>"``. ``extra`` defaults to
    the module's in :data:`OPTIONAL` (required for a module not listed there)."""

    def __init__(self, module: str, needed_by: str, extra: str | None = None):
        distribution, listed_extra = OPTIONAL.get(module.split(".")[0], (module, None))
        extra = extra or listed_extra
        if extra is None:
            raise ValueError(f"module {module!r}: not an optional dependency of rlk; pass the extra")
        self.hint = f"needs the optional dependency {distribution} (pip install 'rlk[{extra}]')"
        super().__init__(f"{needed_by} {self.hint}", name=module)


def require(*modules: str, needed_by: str) -> None:
    """Import each of ``modules`` (names of :data:`OPTIONAL`); raise :class:`MissingDependency` for the first that
    does not import (not installed, or its import fails), naming ``needed_by`` (who needs it) and the extra."""
    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise MissingDependency(module, needed_by) from exc


def hint(exc: ModuleNotFoundError) -> str | None:
    """The one-line advice for a module that did not import: a :class:`MissingDependency`'s, or for a module of
    :data:`OPTIONAL` (by its top-level name) the extra that installs it; None for any other module (a bug)."""
    if isinstance(exc, MissingDependency):
        return exc.hint
    module = (exc.name or "").split(".")[0]
    return MissingDependency(module, "").hint if module in OPTIONAL else None
