"""Ground-truth harness: fixed standard Transformers, a fixed prompt set, reference log-probs.

The models are transformers' own ``Qwen3ForCausalLM`` / ``LlamaForCausalLM`` built from a config (nothing is
downloaded), weights drawn from a seed by the model's own initialization (``_init_weights``: normal(0,
``initializer_range``) for the linear and embedding weights, ones for the RMSNorm weights), in eval mode with
``attn_implementation="sdpa"``. A name that is an existing directory is loaded with ``from_pretrained``.

transformers is an optional dependency of rlk: it is imported inside the functions.
"""

from __future__ import annotations

import copy
import os

import torch

from rlk.app.consistency import MODELS
from rlk.integrations import extras

#: Per name: (architecture, config fields). The tiny configs keep the CPU Triton interpreter fast; their
#: ``initializer_range`` is larger than the default 0.02 so that a 2-layer, 64-wide model has non-flat
#: next-token distributions (log-probs far from ``-log(vocab)``), which makes the comparisons meaningful.
_CONFIGS: dict[str, tuple[str, dict]] = {
    "tiny": (
        "qwen3",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=512,
            max_position_embeddings=4096,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            initializer_range=0.1,
        ),
    ),
    "tiny-llama": (
        "llama",
        dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            vocab_size=512,
            max_position_embeddings=4096,
            rope_theta=5e5,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
            initializer_range=0.1,
        ),
    ),
    # Qwen3-8B: 36 layers, hidden 4096, 32 query / 8 key-value heads of 128, SwiGLU 12288, vocab 151936
    "qwen3-8b-shape": (
        "qwen3",
        dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_hidden_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
            max_position_embeddings=40960,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
    ),
    # Llama-3-8B: 32 layers, hidden 4096, 32 query / 8 key-value heads of 128, SwiGLU 14336, vocab 128256
    "llama3-8b-shape": (
        "llama",
        dict(
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=128256,
            max_position_embeddings=8192,
            rope_theta=5e5,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
    ),
}


def _transformers():
    extras.require("transformers", needed_by="rlk.app.consistency")
    import transformers

    return transformers


def build_model(
    name: str, *, dtype: torch.dtype, device: str | torch.device, seed: int = 0, num_layers: int | None = None
):
    """A standard causal LM: one of :data:`MODELS` built from its config, or a local checkpoint directory.

    ``name`` in :data:`MODELS`: transformers' ``Qwen3ForCausalLM`` ("tiny", "qwen3-8b-shape") or
    ``LlamaForCausalLM`` ("tiny-llama", "llama3-8b-shape") from the config above, parameters created directly
    on ``device`` in ``dtype`` and initialized by the model's own ``_init_weights`` after
    ``torch.manual_seed(seed)`` (same seed, device and dtype: same weights). ``num_layers`` overrides the layer
    count (e.g. a 2-layer 8B-shaped model for a quick GPU check). ``name`` an existing directory:
    ``AutoModelForCausalLM.from_pretrained(name, dtype=dtype)`` (``seed`` and ``num_layers`` ignored).
    Either way: eval mode, ``attn_implementation="sdpa"``, on ``device``.
    """
    transformers = _transformers()
    device = torch.device(device)
    if os.path.isdir(name):
        model = transformers.AutoModelForCausalLM.from_pretrained(name, dtype=dtype, attn_implementation="sdpa")
        return model.to(device).eval()
    if name not in _CONFIGS:
        raise ValueError(
            f"unknown model {name!r}: expected one of {', '.join(MODELS)} or an existing checkpoint directory"
        )
    arch, fields = _CONFIGS[name]
    fields = dict(fields)
    if num_layers is not None:
        if num_layers < 1:
            raise ValueError(f"num_layers must be >= 1, got {num_layers}")
        fields["num_hidden_layers"] = num_layers
    config_cls, model_cls = (
        (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)
        if arch == "qwen3"
        else (transformers.LlamaConfig, transformers.LlamaForCausalLM)
    )
    config = config_cls(attn_implementation="sdpa", **fields)
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls._from_config(config, dtype=dtype)
    return model.to(device=device, dtype=dtype).eval()


def make_prompts(n: int, *, vocab_size: int, seed: int = 0, min_len: int = 3, max_len: int = 24) -> list[list[int]]:
    """``n`` prompts of token ids in ``[0, vocab_size)``, lengths uniform in ``[min_len, max_len]``, from a
    CPU ``torch.Generator(seed)`` (the same list on every machine)."""
    if n < 1:
        raise ValueError(f"need at least one prompt, got n={n}")
    if not 1 <= min_len <= max_len:
        raise ValueError(f"need 1 <= min_len <= max_len, got {min_len}, {max_len}")
    if vocab_size < 1:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(min_len, max_len + 1, (n,), generator=g).tolist()
    return [torch.randint(0, vocab_size, (length,), generator=g).tolist() for length in lengths]


def reference_logprobs(
    model, prompts: list[list[int]], responses: list[list[int]], *, dtype: torch.dtype | None = None
) -> list[torch.Tensor]:
    """Ground truth: ``log p(response[t] | prompt + response[:t])`` for every response token, fp32 ``[len]`` on
    the CPU, per sequence.

    Each sequence runs alone (batch 1, no padding, positions ``0..L-1``), teacher-forced, on a copy of the
    model in ``dtype`` (default: float64 on the CPU; float32 on a GPU, where float64 is slow: the 8B-shaped
    model's reference is then fp32) with stock kernels (an rlk patch on the copy is removed; float64 is never
    routed to rlk's kernels); ``log_softmax`` in the copy's dtype, rounded to fp32 at the end.
    """
    if len(prompts) != len(responses):
        raise ValueError(f"{len(prompts)} prompts but {len(responses)} responses")
    device = next(model.parameters()).device
    if dtype is None:
        dtype = torch.float64 if device.type == "cpu" else torch.float32
    ref = copy.deepcopy(model)
    if getattr(ref, "_rlk_patch", None) is not None:
        from rlk.integrations.hf import unpatch_model

        unpatch_model(ref)
    ref = ref.to(dtype).eval()
    out = []
    with torch.no_grad():
        for prompt, response in zip(prompts, responses):
            if not prompt:
                raise ValueError("empty prompt")
            if not response:
                out.append(torch.zeros(0))
                continue
            ids = torch.tensor([list(prompt) + list(response)], device=device)
            logits = ref(ids, use_cache=False).logits[0]  # [L, V]
            logp = torch.log_softmax(logits[len(prompt) - 1 : -1].to(dtype), -1)
            target = torch.tensor(response, device=device)
            out.append(logp.gather(1, target[:, None])[:, 0].float().cpu())
    del ref
    return out
