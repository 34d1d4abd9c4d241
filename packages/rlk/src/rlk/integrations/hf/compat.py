"""The transformers API differences rlk depends on, detected by feature, and the supported range.

rlk supports transformers :data:`SUPPORTED` (tested: :data:`TESTED`). Where the API moved between those
releases, the code here asks the installed one what it has (``inspect.signature``, ``hasattr``) instead of
comparing version strings: the KV cache keyword of a model's forward is ``past_key_values`` up to 5.23 and
``cache`` from 5.24, and a keyword the forward does not take would vanish into its ``**kwargs`` without a
word (every decode step would then run without its past). A version or a model that lacks what rlk needs gets
:class:`UnsupportedTransformers`, naming the version and the supported range, never a silent fallback.
"""

from __future__ import annotations

import functools
import inspect

#: The transformers releases rlk supports (the ``rlk[hf]`` extra's range) and the ones CI or a GPU run tested.
SUPPORTED = ">=4.57,<6"
TESTED = ("4.57.6", "5.0.0", "5.17.0", "5.24.0")
_MINIMUM = (4, 57)


class UnsupportedTransformers(RuntimeError):
    """The installed transformers (or a model of it) lacks an API rlk needs."""


def transformers_version() -> str:
    import transformers

    return transformers.__version__


def _unsupported(what: str) -> UnsupportedTransformers:
    return UnsupportedTransformers(
        f"{what} (transformers {transformers_version()}; rlk supports transformers "
        f"{SUPPORTED}, tested with {', '.join(TESTED)})"
    )


def check_version() -> None:
    """Raise :class:`UnsupportedTransformers` below the supported range (its APIs differ more than rlk adapts to)."""
    release = transformers_version().split("+")[0].split(".")
    try:
        major_minor = (int(release[0]), int(release[1]))
    except (IndexError, ValueError):
        return  # an unusual version string (a source build): rely on the feature checks
    if major_minor < _MINIMUM:
        raise _unsupported("this transformers is older than rlk supports")


@functools.cache
def _cache_keyword_of(forward) -> str | None:
    params = inspect.signature(forward).parameters
    for name in ("cache", "past_key_values"):
        if name in params:
            return name
    return None


def cache_keyword(model) -> str:
    """The keyword argument through which ``model``'s forward takes its KV cache (``cache`` or ``past_key_values``)."""
    forward = type(model).forward
    name = _cache_keyword_of(forward)
    if name is None:
        raise _unsupported(
            f"{type(model).__name__}.forward takes its KV cache neither as cache= nor as past_key_values="
        )
    return name


def new_cache(model):
    """An empty ``transformers.DynamicCache`` for ``model`` (with the model's config, which 4.57+ accept)."""
    check_version()
    from transformers import DynamicCache

    for method in ("batch_select_indices", "get_seq_length"):
        if not hasattr(DynamicCache, method):
            raise _unsupported(f"transformers.DynamicCache has no {method}()")
    return DynamicCache(config=model.config)


def cached_forward(model, cache, **kwargs):
    """``model(**kwargs)`` with ``cache`` passed under the forward's own keyword and ``use_cache=True``, checked to
    have grown by the forward's input columns (a cache that did not advance means the model ran without its past:
    an error, never a silently different result)."""
    before = cache.get_seq_length()
    columns = (kwargs["input_ids"] if kwargs.get("input_ids") is not None else kwargs["inputs_embeds"]).shape[1]
    out = model(**kwargs, use_cache=True, **{cache_keyword(model): cache})
    after = cache.get_seq_length()
    if after != before + columns:
        raise _unsupported(
            f"the KV cache did not advance in {type(model).__name__}'s forward ({before} -> {after} "
            f"positions after {columns} new columns)"
        )
    return out
