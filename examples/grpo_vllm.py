"""GRPO with a real vLLM rollout engine: vLLM + the rlk plugin samples, transformers + rlk trains, weights sync back.

    TRITON_INTERPRET=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 python examples/grpo_vllm.py --steps 3
    TRITON_INTERPRET=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 python examples/grpo_vllm.py --steps 3 --stock

Needs the vLLM environment (``ci/install_vllm_env.sh``); CPU, the tiny Qwen3 with head_dim 32 (vLLM's CPU attention
sizes), float32. Each step: the engine (in this process) rolls out ``--prompts`` x ``--group`` responses and reports
each sampled token's log-prob: these are the behaviour log-probs (not recomputed); the verifier of
``examples/grpo.py`` (the share of even token ids) rewards them; ``rlk.group_advantages``; the trainer scores the
same tokens in right-padded teacher-forced micro-batches (transformers under ``rlk.batch_invariant()`` +
``patch_model``, log-probs by ``rlk.selected_logprob``) and ``rlk.policy_loss`` (PPO-clip) trains; one AdamW step;
then :func:`rlk.integrations.vllm.sync_weights` copies the new weights into the running engine through its
``load_weights`` and checks every tensor bitwise. With rlk on the first micro-step's importance ratio is exactly 1
for every token on every step (``max_abs_delta`` = 0). ``--stock``: vLLM's own kernels, stock transformers and a
PyTorch PPO loss; vLLM's CPU GEMMs prepack the weights at load time, so the stock engine is rebuilt from a saved
checkpoint every step instead of synced. Per step it prints (and with ``--out`` writes to log.jsonl): reward,
loss, max |rollout - training log-prob| over the first micro-step's tokens, step time, peak memory, sync result.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo import group_advantages_torch, group_micro_batches, make_prompts, peak_memory_mib, ppo_clip_torch, verify  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny | tiny-llama (default tiny)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prompts", type=int, default=2, help="prompts per step")
    p.add_argument("--group", type=int, default=4, help="responses per prompt (the GRPO group)")
    p.add_argument("--prompt-len", type=int, default=6, help="longest prompt (prompts are 2..this long)")
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--micro-batches", type=int, default=2, help="micro-batches per step (runs of whole groups)")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stock", action="store_true", help="vLLM's and transformers' own kernels, a PyTorch loss")
    p.add_argument("--out", default=None, help="folder for log.jsonl")
    args = p.parse_args(argv)
    if not 1 <= args.micro_batches <= args.prompts:
        p.error(f"argument --micro-batches: {args.micro_batches} is not in 1..{args.prompts} (--prompts)")
    return args


def training_logprobs(model, prompts, responses, rows, rlk_on: bool) -> torch.Tensor:
    """``[len(rows), max_new]`` log-probs of the responses of ``rows`` (one right-padded teacher-forced forward):
    ``rlk.selected_logprob`` of the logits rows with rlk on (the plugin's op), ``log_softmax`` stock."""
    from rlk.integrations.vllm import training
    from rlk.integrations.vllm.ops import token_logprobs

    batch = training.padded_batch([prompts[i] for i in rows], [responses[i] for i in rows])
    logits = model(
        input_ids=batch.input_ids, attention_mask=batch.attention_mask, position_ids=batch.position_ids
    ).logits
    out = []
    for row in range(len(rows)):
        start, plen, length = batch.starts[row], batch.prompt_lengths[row], batch.lengths[row]
        pred = logits[row, start + plen - 1 : start + length - 1]
        targets = batch.input_ids[row, start + plen : start + length]
        if rlk_on:
            out.append(token_logprobs(pred, targets))
        else:
            out.append(torch.log_softmax(pred.float(), -1).gather(1, targets[:, None])[:, 0])
    return torch.stack(out)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") != "1":
        if "triton" in sys.modules:
            raise SystemExit("set TRITON_INTERPRET=1 before importing triton (or run this script directly)")
        os.environ["TRITON_INTERPRET"] = "1"
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    import rlk
    import rlk.integrations.vllm as rv
    from rlk.app.consistency.paths import chain
    from rlk.app.consistency.vllm_rollout import build_model
    from rlk.integrations.vllm import engine

    rlk_on = not args.stock
    model = build_model(args.model, dtype=torch.float32, seed=args.seed).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    workdir = tempfile.mkdtemp(prefix="rlk-grpo-vllm-")
    engine.save_checkpoint(model, workdir)
    if rlk_on:
        rv.enable()
    llm = engine.start_engine(workdir, dtype=torch.float32, seed=args.seed, max_model_len=64)
    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    log = []
    for step in range(args.steps):
        t0 = time.perf_counter()
        prompts = [p for p in make_prompts(args.prompts, args.prompt_len, model.config.vocab_size, gen)
                   for _ in range(args.group)]  # fmt: skip
        samples = engine.generate(llm, prompts, max_new_tokens=args.max_new_tokens)
        responses = [s.tokens for s in samples]
        old = torch.stack([s.logprobs for s in samples])  # the behaviour log-probs, from the rollout
        rewards = torch.tensor([verify(p, r) for p, r in zip(prompts, responses)])
        adv = rlk.group_advantages(rewards, group_size=args.group, mode="grpo") if rlk_on else (
            group_advantages_torch(rewards, args.group))  # fmt: skip
        n_tokens = len(prompts) * args.max_new_tokens
        total_loss, max_delta = 0.0, None
        optimizer.zero_grad(set_to_none=True)
        for groups in group_micro_batches(args.prompts, args.micro_batches):
            rows = list(range(groups.start * args.group, groups.stop * args.group))
            with chain(model, rlk_on):
                lp = training_logprobs(model, prompts, responses, rows, rlk_on)
                if rlk_on:
                    loss, _ = rlk.policy_loss(lp, old[rows], adv[rows], torch.ones_like(lp, dtype=torch.bool),
                                              loss="ppo", clip_low=0.2, agg="token-mean",
                                              global_tokens=float(n_tokens))  # fmt: skip
                else:
                    loss, _ = ppo_clip_torch(lp, old[rows], adv[rows][:, None], n_tokens=n_tokens)
                loss.backward()
            delta = float((lp.detach() - old[rows]).abs().max())
            max_delta = delta if max_delta is None else max_delta  # the first micro-step: nothing updated yet
            total_loss += float(loss.detach())
        optimizer.step()
        sync = "rebuilt"
        if rlk_on:
            result = rv.sync_weights(llm, model.state_dict())  # raises unless every tensor is bitwise the trainer's
            sync = f"{result['equal']} tensors bitwise"
        else:  # vLLM's CPU GEMMs prepacked the old weights: a new engine from the new checkpoint
            engine.stop_engine(llm)
            del llm
            engine.save_checkpoint(model, workdir)
            llm = engine.start_engine(workdir, dtype=torch.float32, seed=args.seed + step + 1, max_model_len=64)
        record = {
            "step": step,
            "reward": float(rewards.mean()),
            "loss": total_loss,
            "max_abs_delta": max_delta,
            "ratio_exactly_1": max_delta == 0.0,
            "weight_sync": sync,
            "step_s": time.perf_counter() - t0,
            "peak_mib": peak_memory_mib(torch.device("cpu")),
        }
        log.append(record)
        print(json.dumps(record), flush=True)
        if out_dir:
            with open(out_dir / "log.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
    engine.stop_engine(llm)
    del llm
    if rlk_on:
        rv.disable()
    return log


if __name__ == "__main__":
    main()
