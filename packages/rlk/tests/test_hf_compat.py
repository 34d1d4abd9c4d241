"""rlk.integrations.hf.compat: the KV cache reaches the model under the keyword its forward takes, on every supported
transformers; a cache that does not advance, a forward without a cache keyword and a transformers below the
supported range are errors naming the version and the range (CI runs this file under two transformers).
"""

from __future__ import annotations

import os

import pytest
import torch

from rlk.integrations.hf import compat


def _transformers():
    try:
        import transformers
    except ImportError:
        if os.environ.get("RLK_REQUIRE_TRANSFORMERS") == "1":
            raise
        pytest.fail("transformers is not installed (pip install rlk[hf])")
    return transformers


def _tiny_qwen3():
    transformers = _transformers()
    config = transformers.Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    return transformers.Qwen3ForCausalLM(config).eval()


def test_the_cache_keyword_is_the_one_the_forward_takes():
    import inspect

    model = _tiny_qwen3()
    keyword = compat.cache_keyword(model)
    assert keyword in ("cache", "past_key_values")
    assert keyword in inspect.signature(type(model).forward).parameters


def test_cached_decode_equals_the_full_forward():
    """Prefill 5 tokens into the cache, decode 3 one at a time: each step's logits equal the full forward's at
    that position (a step run without its past would not)."""
    model = _tiny_qwen3()
    ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(input_ids=ids, use_cache=False).logits
        cache = compat.new_cache(model)
        out = compat.cached_forward(model, cache, input_ids=ids[:, :5])
        steps = [out.logits[:, -1]]
        for t in range(5, 8):
            steps.append(compat.cached_forward(model, cache, input_ids=ids[:, t : t + 1]).logits[:, -1])
    assert cache.get_seq_length() == 8
    for k, logits in enumerate(steps):
        torch.testing.assert_close(logits, full[:, 4 + k], rtol=1e-4, atol=1e-5)


def test_a_cache_that_does_not_advance_is_an_error():
    model = _tiny_qwen3()
    forward = type(model).forward

    def forgetful(self, *args, **kwargs):  # drops the cache, as an unknown keyword in **kwargs would
        kwargs.pop(compat.cache_keyword(model))
        return forward(self, *args, **kwargs)

    forgetful.__signature__ = __import__("inspect").signature(forward)
    broken = type("Forgetful", (type(model),), {"forward": forgetful})
    model.__class__ = broken
    ids = torch.randint(0, 64, (1, 4))
    with (
        torch.no_grad(),
        pytest.raises(
            compat.UnsupportedTransformers, match=r"the KV cache did not advance .*rlk supports transformers"
        ),
    ):
        compat.cached_forward(model, compat.new_cache(model), input_ids=ids)


def test_a_forward_without_a_cache_keyword_is_an_error():
    class NoCache(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None):
            return input_ids

    with pytest.raises(
        compat.UnsupportedTransformers,
        match=r"NoCache.forward takes its KV cache neither as "
        r"cache= nor as past_key_values=",
    ):
        compat.cache_keyword(NoCache())


def test_an_older_transformers_is_refused_with_the_range(monkeypatch):
    transformers = _transformers()
    monkeypatch.setattr(transformers, "__version__", "4.46.3")
    with pytest.raises(
        compat.UnsupportedTransformers,
        match=r"older than rlk supports \(transformers 4\.46\.3; rlk supports transformers >=4\.57",
    ):
        compat.check_version()


def test_the_installed_transformers_is_in_the_supported_range():
    from packaging.specifiers import SpecifierSet

    assert _transformers().__version__ in SpecifierSet(compat.SUPPORTED)
    compat.check_version()
