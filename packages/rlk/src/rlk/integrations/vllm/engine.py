"""A vLLM engine over a transformers model, offline, and its rollout: sampled tokens, their log-probs, prompt log-probs.

:func:`save_checkpoint` writes a model where vLLM can load it (``save_pretrained`` plus a word-level
``tokenizers`` tokenizer over the vocabulary, no download); :func:`start_engine` starts ``vllm.LLM`` on it with what
the bitwise comparison needs (eager, no prefix cache, the given dtype and seed); :func:`generate` rolls out token-id
prompts and returns, per prompt, what the engine sampled and scored.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import os

import torch
from torch import Tensor

#: The special tokens of the word-level tokenizer :func:`save_checkpoint` writes (ids 0, 1, 2).
SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}


def save_checkpoint(model, path: str) -> str:
    """``model.save_pretrained(path)`` (safetensors) and a word-level tokenizer (tokens ``<pad> <s> </s> t3 t4
    ...`` for ids ``0 .. vocab - 1``); the config's pad / bos / eos ids set to 0 / 1 / 2. Returns ``path``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab_size = model.config.vocab_size
    names = list(SPECIAL_TOKENS.values()) + [f"t{i}" for i in range(len(SPECIAL_TOKENS), vocab_size)]
    backend = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, padding_side="left", **SPECIAL_TOKENS)
    model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id = 0, 1, 2
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


def start_engine(path: str, *, dtype: torch.dtype, seed: int = 0, max_model_len: int = 512, **options):
    """``vllm.LLM`` on the checkpoint at ``path``: ``enforce_eager`` (compiled graphs bypass the aten overrides),
    no prefix caching (every prompt token computed), ``seed``, ``dtype``; ``options`` passed on (for example
    ``max_num_batched_tokens`` to force chunked prefill). Set ``VLLM_CPU_KVCACHE_SPACE`` (GiB) before, on the CPU."""
    from vllm import LLM

    settings = dict(
        model=path,
        dtype=str(dtype).removeprefix("torch."),
        enforce_eager=True,
        max_model_len=max_model_len,
        seed=seed,
        enable_prefix_caching=False,
    )
    settings.update(options)
    return LLM(**settings)


def stop_engine(llm) -> None:
    """Shut an in-process engine down now (its distributed state and memory), instead of whenever the garbage
    collector finds it: a late finalizer would tear down the process groups of the next engine. Drop your
    references to ``llm`` afterwards."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if core is not None and hasattr(core, "shutdown"):
        core.shutdown()
    gc.collect()


@contextlib.contextmanager
def running_engine(path: str, *, dtype: torch.dtype, **options):
    """:func:`start_engine` for the ``with`` block, :func:`stop_engine` at its end."""
    llm = start_engine(path, dtype=dtype, **options)
    try:
        yield llm
    finally:
        stop_engine(llm)
        del llm
        gc.collect()


@dataclasses.dataclass
class Sample:
    """One prompt's rollout: ``prompt`` and ``tokens`` (ids), ``logprobs`` fp32 ``[len(tokens)]`` (the engine's
    log-prob of each sampled token), ``prompt_logprobs`` fp32 ``[len(prompt) - 1]`` (of prompt tokens 1..)."""

    prompt: list[int]
    tokens: list[int]
    logprobs: Tensor
    prompt_logprobs: Tensor


def generate(llm, prompts: list[list[int]], *, max_new_tokens: int, temperature: float = 1.0) -> list[Sample]:
    """Roll out ``prompts`` (token ids) in one call: sampling at ``temperature`` from the engine's seeded generator
    (no per-request seed: vLLM's CPU sampler cannot rewind a request's generator across chunked-prefill steps),
    ``max_new_tokens`` tokens each (EOS ignored), the sampled tokens' log-probs and the prompt log-probs
    (``logprobs=0``, ``prompt_logprobs=0``: the chosen token's only)."""
    from vllm import SamplingParams

    params = [
        SamplingParams(
            temperature=temperature,
            max_tokens=max_new_tokens,
            ignore_eos=True,
            logprobs=0,
            prompt_logprobs=0,
            detokenize=False,
        )
        for _ in prompts
    ]
    requests = [{"prompt_token_ids": list(p)} for p in prompts]
    outputs = llm.generate(requests, params, use_tqdm=False)
    samples = []
    for prompt, out in zip(prompts, outputs):
        completion = out.outputs[0]
        tokens = list(completion.token_ids)
        lps = [step[t].logprob for step, t in zip(completion.logprobs, tokens)]
        plps = [step[t].logprob for step, t in zip(out.prompt_logprobs[1:], prompt[1:])]
        samples.append(
            Sample(
                prompt=list(out.prompt_token_ids),
                tokens=tokens,
                logprobs=torch.tensor(lps, dtype=torch.float64).float(),
                prompt_logprobs=torch.tensor(plps, dtype=torch.float64).float(),
            )
        )
    return samples


def engine_special_tokens(llm) -> dict:
    """The pad / bos / eos ids and padding side of the engine's tokenizer (None where it has none)."""
    tok = llm.get_tokenizer()
    return {
        "pad_token_id": getattr(tok, "pad_token_id", None),
        "bos_token_id": getattr(tok, "bos_token_id", None),
        "eos_token_id": getattr(tok, "eos_token_id", None),
        "padding_side": getattr(tok, "padding_side", None),
    }


def write_json(path: str, data) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
