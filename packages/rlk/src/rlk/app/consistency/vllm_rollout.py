"""``rlk consistency --rollout vllm``: a real vLLM engine rolls out, the trainer (transformers) scores the same tokens.

For ``chain`` in (stock, rlk): the fixed model (saved as a checkpoint vLLM loads) and prompt set go through
``vllm.LLM`` (chunked prefill: ``max_num_batched_tokens`` below the prompt total; then decode), with the rlk plugin
off or on (:func:`rlk.integrations.vllm.enable`); the engine samples (its own seeded sampler) and reports each
sampled token's log-prob and the prompt log-probs. The trainer then scores exactly those tokens in one padded
teacher-forced batch (:mod:`rlk.integrations.vllm.training`), stock and with rlk. Reported: drift per path, tokens
bitwise equal, where each sequence first diverges, and the prechecks (identical input ids / special tokens /
padding side, identical weights by checksum, sampling separated from scoring). Gating (exit code 1): the prechecks
and the rlk claims (every rollout and prompt log-prob of the rlk engine ``torch.equal`` to the rlk trainer's).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import tempfile
import time

import torch

from rlk.app.consistency.run import ensure_interpreter

#: Planted mismatches the prechecks must catch (tests): the trainer's padding on the other side of its mask, or
#: one weight of the trainer moved by one ulp after the engine loaded it.
PLANTS = ("padding-side", "weight")

#: vLLM's CPU attention needs head_dim in 32, 64, ...: the tiny models are built with head_dim 32 here.
_VLLM_HEAD_DIM = 32


def build_model(name: str, *, dtype: torch.dtype, seed: int):
    """transformers model for the vLLM comparison: the harness's ``tiny`` / ``tiny-llama`` with ``head_dim = 32``
    (vLLM's CPU attention sizes), the other built-in names as they are, or a checkpoint directory; CPU, eval."""
    import transformers

    from rlk.app.consistency import harness

    if os.path.isdir(name) or name not in ("tiny", "tiny-llama"):
        return harness.build_model(name, dtype=dtype, device="cpu", seed=seed)
    arch, fields = harness._CONFIGS[name]
    fields = dict(fields, head_dim=_VLLM_HEAD_DIM)
    config_cls, model_cls = (
        (transformers.Qwen3Config, transformers.Qwen3ForCausalLM)
        if arch == "qwen3"
        else (transformers.LlamaConfig, transformers.LlamaForCausalLM)
    )
    torch.manual_seed(seed)
    # parameters created in dtype; no model.to(dtype): it would round the rotary inv_freq buffer to fp16
    return model_cls._from_config(config_cls(attn_implementation="sdpa", **fields), dtype=dtype).eval()


def _rollout(path: str, prompts, *, rlk_on: bool, dtype, seed: int, max_new_tokens: int, chunk: int) -> dict:
    """One engine (plugin on or off), its rollout, what it holds (checksums) and says (special tokens, mode)."""
    import rlk.integrations.vllm as rv
    from rlk.integrations.vllm import engine, weights

    if rlk_on:
        rv.enable()
    try:
        started = time.perf_counter()
        llm = engine.start_engine(
            path, dtype=dtype, seed=seed, max_num_batched_tokens=chunk, max_num_seqs=len(prompts), max_model_len=256
        )
        start_s = time.perf_counter() - started
        started = time.perf_counter()
        samples = engine.generate(llm, prompts, max_new_tokens=max_new_tokens)
        rollout_s = time.perf_counter() - started
        special = engine.engine_special_tokens(llm)
        checksums = weights.engine_checksums(llm) if rlk_on else None  # vLLM's own CPU GEMMs repack the weights
        mode = str(getattr(llm.llm_engine.model_config, "logprobs_mode", "raw_logprobs"))
        engine.stop_engine(llm)
        del llm
    finally:
        if rlk_on:
            rv.disable()
    return {
        "samples": samples,
        "special": special,
        "checksums": checksums,
        "logprobs_mode": mode,
        "engine_start_s": start_s,
        "rollout_s": rollout_s,
    }


def _compare(engine_lps, trainer_lps) -> dict:
    """Drift of two per-sequence log-prob lists: max |diff|, tokens bitwise equal, first differing index per seq."""
    from rlk.integrations.vllm.training import first_difference

    equal = total = 0
    worst = 0.0
    first = []
    for a, b in zip(engine_lps, trainer_lps):
        total += a.numel()
        if a.shape == b.shape:
            equal += int((a == b).sum())
            if a.numel():
                worst = max(worst, float((a.double() - b.double()).abs().max()))
        else:
            worst = math.inf
        first.append(first_difference(a, b))
    return {
        "tokens": total,
        "bitwise_equal": equal,
        "max_abs": worst,
        "all_equal": equal == total,
        "first_divergence": first,
    }


def run_vllm_consistency(
    model: str = "tiny",
    *,
    dtype=None,
    prompts: int = 8,
    max_new_tokens: int = 8,
    seed: int = 0,
    out: str | None = None,
    plant: str | None = None,
    padding_side: str = "right",
    print_table: bool = True,
) -> dict:
    """Run the real-engine cross-benchmark and return its report (JSON-serializable; ``report["passed"]``).

    CPU only (vLLM's CPU build; rlk's chain through the Triton interpreter), ``dtype`` float32 (default) or
    float16; the engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` unless set). ``plant``: one of
    :data:`PLANTS`, to see the prechecks fail."""
    from rlk.app.consistency import harness
    from rlk.app.consistency.run import parse_dtype
    from rlk.integrations import extras

    extras.require("vllm", "transformers", needed_by="rlk consistency --rollout vllm")
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    dtype = dtype or torch.float32
    if dtype not in (torch.float32, torch.float16):
        raise ValueError(
            f"--dtype {dtype}: the vLLM comparison on the CPU serves float32 and float16 (rlk's Triton "
            "interpreter declines bfloat16)"
        )
    if plant is not None and plant not in PLANTS:
        raise ValueError(f"plant: expected one of {PLANTS}, got {plant!r}")
    if prompts < 1 or max_new_tokens < 1:
        raise ValueError("prompts and max_new_tokens must be >= 1")
    ensure_interpreter()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from rlk.integrations.vllm import engine, training, weights

    started = time.perf_counter()
    net = build_model(model, dtype=dtype, seed=seed)
    prompt_ids = harness.make_prompts(prompts, vocab_size=net.config.vocab_size, seed=seed)
    chunk = max(32, sum(len(p) for p in prompt_ids) // 2)  # the prompts take >= 2 scheduler steps: chunked prefill
    with tempfile.TemporaryDirectory(prefix="rlk-vllm-") as path:
        engine.save_checkpoint(net, path)
        rollouts = {
            key: _rollout(
                path,
                prompt_ids,
                rlk_on=key == "rlk",
                dtype=dtype,
                seed=seed,
                max_new_tokens=max_new_tokens,
                chunk=chunk,
            )
            for key in ("stock", "rlk")
        }
    trainer_checksums = weights.weight_checksums(weights.vllm_state_dict(net.state_dict()))
    if plant == "weight":
        with torch.no_grad():
            w = net.model.norm.weight
            w[0] = torch.nextafter(w[0], torch.tensor(math.inf, dtype=w.dtype))
        trainer_checksums = weights.weight_checksums(weights.vllm_state_dict(net.state_dict()))

    rope_check = _rope_check(net)
    chains, prechecks = {}, {}
    for key, roll in rollouts.items():
        samples = roll["samples"]
        prompts_seen = [s.prompt for s in samples]
        responses = [s.tokens for s in samples]
        batch = training.padded_batch(
            prompts_seen,
            responses,
            padding_side=padding_side,
            mask_side=("left" if padding_side == "right" else "right") if plant == "padding-side" else None,
        )
        inputs = training.check_inputs(batch, prompt_ids, responses)
        inputs["prompts_identical"] = prompts_seen == prompt_ids
        inputs["ok"] = inputs["ok"] and inputs["prompts_identical"]
        config = net.config
        special = {
            "pad_token_id": config.pad_token_id,
            "bos_token_id": config.bos_token_id,
            "eos_token_id": config.eos_token_id,
        }
        special_ok = all(roll["special"][k] == v for k, v in special.items())
        scores = {}
        for trainer_key in ("stock", "rlk"):
            resp, prompt = training.score(net, batch, rlk_on=trainer_key == "rlk")
            scores[trainer_key] = {
                "rollout": _compare([s.logprobs for s in samples], resp),
                "prompt": _compare([s.prompt_logprobs for s in samples], prompt),
            }
        chains[key] = {
            "engine": "vLLM + rlk plugin" if key == "rlk" else "vLLM (stock)",
            "engine_start_s": roll["engine_start_s"],
            "rollout_s": roll["rollout_s"],
            "responses": responses,
            "trainer": scores,
        }
        checks = {
            "inputs": inputs,
            "rope": rope_check,
            "special_tokens": {
                "ok": special_ok,
                "engine": roll["special"],
                "trainer": special,
                "trainer_padding_side": padding_side,
            },
            "sampling_separated": {
                "ok": roll["logprobs_mode"] == "raw_logprobs",
                "detail": f"engine log-probs mode {roll['logprobs_mode']!r}: scored from the logits, not from the "
                "sampler's processed distribution; the trainer scores the engine's sampled tokens as given",
            },
        }
        if roll["checksums"] is not None:
            checks["weights"] = weights.compare_checksums(trainer_checksums, roll["checksums"])
        prechecks[key] = checks

    rlk_scores = chains["rlk"]["trainer"]["rlk"]
    verdicts = [
        _verdict(
            "prechecks",
            "inputs, special tokens, weights, sampling separated (rlk engine)",
            all(c["ok"] for c in prechecks["rlk"].values()),
            gates=True,
        ),
        _verdict(
            "rollout_logprobs_bitwise",
            "vLLM + rlk sampled-token log-probs torch.equal to transformers + rlk",
            rlk_scores["rollout"]["all_equal"],
            gates=True,
        ),
        _verdict(
            "prompt_logprobs_bitwise",
            "vLLM + rlk prompt log-probs torch.equal to transformers + rlk",
            rlk_scores["prompt"]["all_equal"],
            gates=True,
        ),
        _verdict(
            "stock_drift",
            "stock vLLM vs stock transformers differ (reported; on the CPU in fp32 they may agree)",
            not chains["stock"]["trainer"]["stock"]["rollout"]["all_equal"],
            gates=False,
        ),
    ]
    failed = [v["name"] for v in verdicts if v["gates_exit"] and v["status"] == "fail"]
    report = {
        "report": "rlk consistency --rollout vllm",
        "schema": 1,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": {"name": model, "architecture": type(net).__name__, "head_dim": getattr(net.config, "head_dim", None)},
        "dtype": str(dtype).removeprefix("torch."),
        "versions": _versions(),
        "settings": {
            "prompts": prompts,
            "max_new_tokens": max_new_tokens,
            "seed": seed,
            "max_num_batched_tokens": chunk,
            "prompt_tokens": sum(len(p) for p in prompt_ids),
            "trainer_padding_side": padding_side,
            "plant": plant,
            "temperature": 1.0,
        },
        "prompt_lengths": [len(p) for p in prompt_ids],
        "prechecks": prechecks,
        "chains": chains,
        "verdicts": verdicts,
        "failed": failed,
        "passed": not failed,
        "seconds": time.perf_counter() - started,
    }
    if out is not None:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "report.json"), "w") as f:
            json.dump(report, f, indent=2, default=str)
    if print_table:
        print(format_table(report))
    return report


def _rope_check(model) -> dict:
    """The trainer's rotary frequencies are fp32, as vLLM's and the plugin's are (``model.to(torch.float16)`` rounds
    transformers' ``inv_freq`` buffer to fp16: every position > 0 then differs)."""
    dtypes = sorted(
        {str(m.inv_freq.dtype) for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)}
    )
    return {"ok": dtypes == ["torch.float32"], "inv_freq_dtypes": dtypes}


def _verdict(name: str, claim: str, ok: bool, *, gates: bool) -> dict:
    return {"name": name, "claim": claim, "status": "pass" if ok else "fail", "gates_exit": gates}


def _versions() -> dict:
    from rlk.app.consistency.run import _versions as base
    from rlk.integrations.vllm.plugin import vllm_version

    return dict(base(), vllm=vllm_version())


def format_table(report: dict) -> str:
    """The report as text: one line per (engine, trainer) pair, then the prechecks and verdicts."""
    lines = [
        f"{report['report']}: {report['model']['name']} ({report['model']['architecture']}), {report['dtype']}, "
        f"{report['settings']['prompts']} prompts x {report['settings']['max_new_tokens']} tokens"
    ]
    lines.append(f"{'engine':<20} {'trainer':<8} {'rollout equal':>16} {'max |diff|':>11} {'prompt equal':>16}")
    for chain in report["chains"].values():
        for trainer, s in chain["trainer"].items():
            r, p = s["rollout"], s["prompt"]
            lines.append(
                f"{chain['engine']:<20} {trainer:<8} {r['bitwise_equal']:>7}/{r['tokens']:<8} {r['max_abs']:>11.3g} "
                f"{p['bitwise_equal']:>7}/{p['tokens']:<8}"
            )
    for key, checks in report["prechecks"].items():
        lines.append(
            f"prechecks ({key} engine): " + ", ".join(f"{n} {'ok' if c['ok'] else 'FAIL'}" for n, c in checks.items())
        )
    for v in report["verdicts"]:
        lines.append(f"[{v['status'].upper()}] {v['name']}: {v['claim']}{'' if v['gates_exit'] else ' (reported)'}")
    lines.append("PASSED" if report["passed"] else f"FAILED: {', '.join(report['failed'])}")
    return "\n".join(lines)
