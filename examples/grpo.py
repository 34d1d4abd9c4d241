"""An end-to-end GRPO loop on a synthetic task with a deterministic verifier, with rlk's kernels or stock ones.

    python examples/grpo.py                          # CPU: the tiny Qwen3 (rlk's chain through the Triton interpreter)
    python examples/grpo.py --device cuda --model qwen3-8b-shape --layers 4 --dtype bfloat16
    python examples/grpo.py --stock                  # the same loop with stock kernels and a PyTorch loss

Each step: a rollout by the Hugging Face model (left-padded prefill, then KV-cache decode; the next token is
sampled, apart from scoring, by rlk's fused batch-invariant sampler ``rlk.sample`` on the model's device, in both
modes, with a seed per sequence derived from the step's sampling seed and the sequence index, and the step = the
token's index in the response), the verifier's rewards, group advantages, then the policy loss over
``--micro-batches`` micro-batches (each a contiguous run of whole groups) and one optimizer step. The behaviour
log-probs are the rollout's own (not recomputed). With rlk on, the model runs under
``rlk.integrations.hf.apply(model, batch_invariant=True)``: the rollout's log-probs come from
``rlk.integrations.hf.logprobs_from_hidden`` on the hidden states its forwards gave, training's from
``rlk.integrations.hf.group_logprobs`` (one packed row per micro-batch, each group's prompt computed once for its
G responses, the same fused head), so the first micro-step's importance ratio is exactly 1 for every token
(logged as ``max_abs_delta`` = 0). ``--stock``: stock kernels, right-padded micro-batches (every response with
its own copy of the prompt), logits and ``log_softmax``, and a PyTorch PPO-clip loss.

Task: a prompt of random tokens; the verifier rewards the response's even token ids (reward = their share). A
random policy scores about 0.5; the tiny model (seed 0, CPU, rlk on) gets past 0.9 within about 25 steps (0.91 at
step 24, above 0.9 from step 27) and to 1.0 within about 30 (first at step 29, 0.97-1.00 from there to step 39).
Per step it prints and writes (``--out``/log.jsonl): reward, loss, clip fraction, max |rollout - training
log-prob| over the first micro-step's tokens, step time and peak memory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="tiny | qwen3-8b-shape | llama3-8b-shape | PATH (default tiny)")
    p.add_argument("--layers", type=int, default=None, help="keep this many layers of a built-in model")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--dtype", default=None, choices=("float32", "bfloat16"), help="default: bfloat16 on a GPU, float32 on the CPU"
    )
    p.add_argument("--steps", type=int, default=25)
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--group", type=int, default=4, help="responses per prompt (the GRPO group)")
    p.add_argument("--prompt-len", type=int, default=6, help="longest prompt (prompts are 2..this long)")
    p.add_argument("--max-new-tokens", type=int, default=6)
    p.add_argument(
        "--micro-batches",
        type=int,
        default=2,
        help="micro-batches per optimizer step, each a contiguous run of whole groups (1..--prompts)",
    )
    p.add_argument("--lr", type=float, default=None, help="AdamW learning rate (default: 1e-2 tiny, 1e-5 otherwise)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--stock", action="store_true", help="stock kernels and a PyTorch loss")
    p.add_argument("--out", default=None, help="folder for log.jsonl")
    args = p.parse_args(argv)
    if not 1 <= args.micro_batches <= args.prompts:
        p.error(
            f"argument --micro-batches: {args.micro_batches} is not in 1..{args.prompts} (--prompts): each "
            "micro-batch is a run of whole groups, one group per prompt"
        )
    return args


# ---------------------------------------------------------------------------
# the task
# ---------------------------------------------------------------------------


def make_prompts(n: int, longest: int, vocab: int, gen: torch.Generator) -> list[list[int]]:
    lengths = torch.randint(2, longest + 1, (n,), generator=gen)
    return [torch.randint(1, vocab, (int(k),), generator=gen).tolist() for k in lengths]


def verify(prompt: list[int], response: list[int]) -> float:
    """The share of even token ids in the response (the prompt only conditions the model)."""
    return sum(t % 2 == 0 for t in response) / len(response)


# ---------------------------------------------------------------------------
# rollout: left-padded prefill, KV-cache decode, sampling apart from scoring
# ---------------------------------------------------------------------------


def rollout(model, prompts: list[list[int]], max_new: int, seed: int, rlk_on: bool):
    """Responses and their fp32 log-probs ``[N, max_new]`` (the behaviour policy's, temperature 1).

    Token ``t`` of sequence ``i`` is ``rlk.sample(logits, seed_i, t)``, ``seed_i =
    rlk.app.consistency.paths.sequence_seeds(seed, N)[i]`` (SplitMix64 of ``seed`` and ``i``): it depends on
    the sequence's own logits only, not on the batch or the backend."""
    import rlk
    from rlk.app.consistency.paths import sequence_seeds
    from rlk.integrations.hf import compat

    device = next(model.parameters()).device
    n, width = len(prompts), max(len(p) for p in prompts)
    ids = torch.zeros((n, width), dtype=torch.int64)
    mask = torch.zeros((n, width), dtype=torch.int64)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    seeds = sequence_seeds(seed, n).to(device)
    head = model.get_output_embeddings()
    seen = {}
    hook = head.register_forward_pre_hook(lambda module, args: seen.__setitem__("hidden", args[0]))
    cache = compat.new_cache(model)
    tokens, logprobs = [], []
    try:
        with torch.no_grad():
            out = compat.cached_forward(
                model, cache, input_ids=ids, attention_mask=mask, position_ids=pos, logits_to_keep=1
            )
            next_pos = pos[:, -1:] + 1
            for t in range(max_new):
                logits = out.logits[:, -1].float()
                step = torch.full((n,), t, dtype=torch.int64, device=device)  # every row's t-th response token
                token, _ = rlk.sample(logits, seeds, step)
                if rlk_on:  # the very op, weight and backend training's fused head will use on these hidden rows
                    lp = rlk.integrations.hf.logprobs_from_hidden(model, seen["hidden"][:, -1], token)
                else:
                    lp = torch.log_softmax(logits, -1).gather(1, token[:, None])[:, 0]
                tokens.append(token)
                logprobs.append(lp.float())
                mask = torch.cat([mask, mask.new_ones((n, 1))], 1)
                out = compat.cached_forward(
                    model, cache, input_ids=token[:, None], attention_mask=mask, position_ids=next_pos, logits_to_keep=1
                )
                next_pos = next_pos + 1
    finally:
        hook.remove()
    return torch.stack(tokens, 1).cpu(), torch.stack(logprobs, 1)


# ---------------------------------------------------------------------------
# training: micro-batches of whole groups, the policy loss, one optimizer step
# ---------------------------------------------------------------------------


def group_micro_batches(n_groups: int, k: int) -> list[range]:
    """``k`` contiguous runs of whole groups covering ``0..n_groups - 1``, sizes differing by at most one."""
    size, extra = divmod(n_groups, k)
    bounds = [0]
    for i in range(k):
        bounds.append(bounds[-1] + size + (i < extra))
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


def response_logprobs_groups(model, prompts, responses, groups: range, group: int):
    """[b, max_new] log-probs of the response tokens of ``groups`` (rows ``groups.start * group`` on), from
    :func:`rlk.integrations.hf.group_logprobs`: one packed row, each group's prompt computed once."""
    import rlk

    heads = [prompts[g * group] for g in groups]  # the group's G rows repeat its prompt
    members = [[responses[g * group + j] for j in range(group)] for g in groups]
    out = rlk.integrations.hf.group_logprobs(model, heads, members)
    return torch.stack([lp for per_group in out for lp in per_group])


def training_batch(prompts, responses, rows, device):
    """Right-padded ``ids``, ``attention_mask``, ``position_ids`` and the response's (row, column) positions."""
    seqs = [prompts[i] + responses[i].tolist() for i in rows]
    width = max(len(s) for s in seqs)
    ids = torch.zeros((len(rows), width), dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s)
        mask[r, : len(s)] = 1
    starts = torch.tensor([len(prompts[i]) for i in rows])  # the first response token's position
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), pos.to(device), starts


def response_logprobs_stock(model, ids, mask, pos, starts, max_new):
    logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    cols = (starts[:, None] - 1 + torch.arange(max_new)[None, :]).to(ids.device)
    logp = torch.log_softmax(logits.gather(1, cols[:, :, None].expand(-1, -1, logits.shape[-1])), -1)
    return logp.gather(2, ids.gather(1, cols + 1)[:, :, None])[:, :, 0]


def ppo_clip_torch(lp, old, adv, clip=0.2, n_tokens=1):
    """The stock loss: PPO-clip, summed over tokens and divided by the step's token count."""
    ratio = torch.exp(lp - old)
    l1, l2 = -adv * ratio, -adv * ratio.clamp(1 - clip, 1 + clip)
    return torch.maximum(l1, l2).sum() / n_tokens, float((l2 > l1).float().mean())


def group_advantages_torch(rewards, group):
    r = rewards.view(-1, group)
    return ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).reshape(-1)


def peak_memory_mib(device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # the process's peak RSS (KiB on Linux)


def main(argv=None) -> list[dict]:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cpu" and not args.stock and os.environ.get("TRITON_INTERPRET") != "1":
        # rlk's chain runs through the Triton interpreter on the CPU; it reads the variable at import
        if "triton" in sys.modules:
            raise SystemExit("set TRITON_INTERPRET=1 before importing triton (or run this script directly)")
        os.environ["TRITON_INTERPRET"] = "1"
    import rlk
    from rlk.app.consistency.harness import build_model

    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    model = build_model(args.model, dtype=dtype, device=device, seed=args.seed, num_layers=args.layers)
    model.train()
    if not args.stock:
        rlk.integrations.hf.apply(model, batch_invariant=True)
    lr = args.lr if args.lr is not None else (1e-2 if args.model.startswith("tiny") else 1e-5)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(args.seed)
    vocab = model.config.vocab_size
    out_dir = Path(args.out) if args.out else None
    if out_dir:
        out_dir.mkdir(parents=True, exist_ok=True)
    log = []
    for step in range(args.steps):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        prompts = [p for p in make_prompts(args.prompts, args.prompt_len, vocab, gen) for _ in range(args.group)]
        responses, old = rollout(
            model, prompts, args.max_new_tokens, seed=args.seed * 7919 + step, rlk_on=not args.stock
        )
        rewards = torch.tensor([verify(p, r.tolist()) for p, r in zip(prompts, responses)])
        n = len(prompts)
        if args.stock:
            adv = group_advantages_torch(rewards, args.group)
        else:
            adv = rlk.group_advantages(rewards, group_size=args.group, mode="grpo")
        adv = adv.to(device)
        n_tokens = n * args.max_new_tokens
        total_loss, clip_fraction, max_delta = 0.0, 0.0, None
        optimizer.zero_grad(set_to_none=True)
        for groups in group_micro_batches(args.prompts, args.micro_batches):
            rows = list(range(groups.start * args.group, groups.stop * args.group))
            old_rows, adv_rows = old[rows], adv[rows]
            if args.stock:
                ids, mask, pos, starts = training_batch(prompts, responses, rows, device)
                lp = response_logprobs_stock(model, ids, mask, pos, starts, args.max_new_tokens)
                loss, clipped = ppo_clip_torch(lp, old_rows, adv_rows[:, None], n_tokens=n_tokens)
            else:
                with rlk.batch_invariant():
                    lp = response_logprobs_groups(model, prompts, responses, groups, args.group)
                    resp_mask = torch.ones_like(lp, dtype=torch.bool)
                    loss, metrics = rlk.policy_loss(
                        lp,
                        old_rows,
                        adv_rows,
                        resp_mask,
                        loss="ppo",
                        clip_low=0.2,
                        agg="token-mean",
                        global_tokens=float(n_tokens),
                    )
                    clipped = float(metrics["clip_fraction"])
            delta = float((lp.detach() - old_rows).abs().max())
            if max_delta is None:  # the first micro-step: nothing has been updated yet
                max_delta = delta
            if args.stock:
                loss.backward()
            else:
                with rlk.batch_invariant():
                    loss.backward()
            total_loss += float(loss.detach())
            clip_fraction += clipped * len(rows) / n
        optimizer.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        record = {
            "step": step,
            "reward": float(rewards.mean()),
            "loss": total_loss,
            "clip_fraction": clip_fraction,
            "max_abs_delta": max_delta,
            "ratio_exactly_1": max_delta == 0.0,
            "step_s": time.perf_counter() - t0,
            "peak_mib": peak_memory_mib(device),
        }
        log.append(record)
        print(json.dumps(record), flush=True)
        if out_dir:
            with open(out_dir / "log.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")
    return log


if __name__ == "__main__":
    main()
