"""Weight sync into a running vLLM engine with the rlk plugin: after a (simulated) training step the trainer's new
weights go in through the engine's ``load_weights``, every engine tensor is checked bitwise, and the engine's next
rollout log-probs are bitwise the updated trainer's."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.triton_interpreter, pytest.mark.slow]

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


def test_sync_weights_bitwise_then_rollout_matches(tmp_path):
    import rlk.integrations.vllm as rv
    from rlk.app.consistency.vllm_rollout import build_model
    from rlk.integrations.vllm import engine, training

    model = build_model("tiny", dtype=torch.float32, seed=0)
    engine.save_checkpoint(model, str(tmp_path))
    prompts = [[5, 6, 7, 8], [9, 10, 11, 12, 13, 14]]
    rv.enable()
    try:
        llm = engine.start_engine(str(tmp_path), dtype=torch.float32, max_model_len=64)
        before = engine.generate(llm, prompts, max_new_tokens=3)
        gen = torch.Generator().manual_seed(1)
        with torch.no_grad():  # a stand-in for an optimizer step
            for p in model.parameters():
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
        stale = rv.weight_checksums(rv.vllm_state_dict(model.state_dict()))
        assert not rv.weights.compare_checksums(stale, rv.weights.engine_checksums(llm))["ok"]
        result = rv.sync_weights(llm, model.state_dict())
        after = engine.generate(llm, prompts, max_new_tokens=3)
        engine.stop_engine(llm)
        del llm
    finally:
        rv.disable()
    assert result["ok"] and result["equal"] == len(rv.vllm_state_dict(model.state_dict()))
    batch = training.padded_batch([s.prompt for s in after], [s.tokens for s in after])
    responses, prompt_lps = training.score(model, batch, rlk_on=True)
    for s, lp, plp in zip(after, responses, prompt_lps):
        assert torch.equal(s.logprobs, lp) and torch.equal(s.prompt_logprobs, plp)
    assert not torch.equal(before[0].prompt_logprobs, after[0].prompt_logprobs)  # the engine did change weights
