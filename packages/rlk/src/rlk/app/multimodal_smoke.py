"""``rlk multimodal-smoke``: an image-text GRPO step end to end, each stage checked before the next.

1. **layout parity**: the same samples encoded by a rollout-side and a training-side processor (rlk's offline Qwen2-VL
   processor: transformers' image processor and a ``tokenizers`` tokenizer) are compared by
   :func:`~rlk.integrations.multimodal.compare_layouts` (token ids, placeholder expansion, 3-D positions, masks), and
   a planted mismatch (the rollout side left-padded) must be reported;
2. **modality-aware log-probs**: a tiny random-weight ``Qwen2VLForConditionalGeneration`` (vision tower, merger,
   language model) runs the batch; :func:`rlk.linear_logprob` scores its final hidden states with ``loss_spans`` (the
   response tokens, shifted onto the positions that predict them): every position that predicts a visual, prompt or
   padding token gives exactly 0, every response position a log-prob equal to the model's own logits' within fp32
   rounding;
3. **loss masking**: group-normalized advantages from per-sample scores (:func:`rlk.scatter_rewards`, GRPO groups)
   and :func:`rlk.policy_loss` with the same ``loss_spans``: the loss's gradient is exactly 0 off the spans;
4. **one loss step**: backward through the model and an SGD step: finite gradients that reach the LM head and the
   vision tower, and response log-probs that move.

Exit code 0 when every stage passes, 1 otherwise, 2 on bad arguments (``--device``: cpu or cuda) or a missing
optional dependency (transformers, tokenizers, Pillow: ``pip install 'rlk[hf]'``).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

import rlk
from rlk.integrations.multimodal import (
    OfflineQwen2VLProcessor,
    RawSample,
    compare_layouts,
    mask_to_spans,
    shift_spans,
    synthetic_samples,
)
from rlk.integrations.multimodal.processor import tiny_qwen2_vl_config


def add_parser(sub) -> None:
    from rlk.app.cli import add_device_argument

    smoke = sub.add_parser(
        "multimodal-smoke",
        help="an image-text GRPO step through a tiny vision-language model: layout parity, span-masked log-probs, "
        "loss masking, one optimizer step",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    smoke.add_argument("--prompts", type=int, default=2, help="prompts (each with one image) (default 2)")
    smoke.add_argument("--group-size", type=int, default=4, help="responses per prompt, the GRPO group (default 4)")
    smoke.add_argument("--seed", type=int, default=0, help="seed of the samples, scores and weights (default 0)")
    add_device_argument(smoke)
    smoke.add_argument("--json", action="store_true", help="print the report as JSON")


def _grpo_samples(prompts: int, group_size: int, seed: int) -> list[RawSample]:
    """``prompts * group_size`` samples: each prompt (text + one 112 x 112 image) with ``group_size`` responses."""
    base = synthetic_samples("image-text", seed=seed, batch_size=prompts * group_size, image_size=(112, 112))
    return [
        RawSample(base[p * group_size].prompt, base[p * group_size].images, base[p * group_size + j].response)
        for p in range(prompts)
        for j in range(group_size)
    ]


def _tiny_vlm(processor: OfflineQwen2VLProcessor, seed: int):
    import transformers

    config = tiny_qwen2_vl_config(processor.tokens, len(processor.tokenizer), width=32, layers=2)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return transformers.Qwen2VLForConditionalGeneration(config)


class SmokeReport:
    """The stages of a smoke run: per stage its name, whether it passed, its checks (name -> bool) and figures."""

    def __init__(self) -> None:
        self.stages: list[dict] = []

    def stage(self, name: str, checks: dict[str, bool], figures: dict[str, object]) -> bool:
        self.stages.append({"stage": name, "passed": all(checks.values()), "checks": checks, "figures": figures})
        return all(checks.values())

    @property
    def passed(self) -> bool:
        return bool(self.stages) and all(s["passed"] for s in self.stages)

    def format(self) -> str:
        lines = []
        for s in self.stages:
            lines.append(f"{'PASS' if s['passed'] else 'FAIL'}  {s['stage']}")
            lines += [f"      {'ok ' if ok else 'BAD'} {name}" for name, ok in s["checks"].items()]
            lines += [f"      {name}: {value}" for name, value in s["figures"].items()]
        lines.append(f"multimodal smoke test: {'passed' if self.passed else 'FAILED'}")
        return "\n".join(lines)


def smoke(prompts: int = 2, group_size: int = 4, seed: int = 0, device: str | torch.device = "cpu") -> SmokeReport:
    """Run the four stages (module docstring) and return the report; stops at the first stage that fails."""
    device = torch.device(device)
    report = SmokeReport()
    samples = _grpo_samples(prompts, group_size, seed)

    # 1. layout parity: rollout and training encode the same samples
    rollout_side, training_side = OfflineQwen2VLProcessor(), OfflineQwen2VLProcessor()
    rollout, training = rollout_side(samples), training_side(samples)
    layout = compare_layouts(rollout, training, tokens=training_side.tokens)
    planted = compare_layouts(
        OfflineQwen2VLProcessor(padding_side="left")(samples), training, tokens=rollout_side.tokens
    )
    if not report.stage(
        "layout parity (rollout vs training processor)",
        {"encodings agree": layout.passed, "a planted mismatch (rollout left-padded) is reported": not planted.passed},
        {"samples": len(samples), "tokens": tuple(training.input_ids.shape), "first mismatch": layout.format()[:200]}
        if not layout.passed
        else {"samples": len(samples), "tokens per row": training.input_ids.shape[1]},
    ):
        return report

    # 2. modality-aware log-probs from the model's final hidden states
    images = [image.numpy() for sample in samples for image in sample.images]
    pixels = training_side.image_processor(images=images, return_tensors="pt")
    model = _tiny_vlm(training_side, seed).to(device)
    input_ids, attention = training.input_ids.to(device), training.attention_mask.to(device)
    inputs = {
        "input_ids": input_ids,
        "attention_mask": attention,
        "position_ids": training.position_ids.to(device),  # the 3-D positions the layout check compared
        "pixel_values": pixels["pixel_values"].to(device),
        "image_grid_thw": pixels["image_grid_thw"].to(device),
    }
    loss_tokens = training.loss_mask.to(device).bool()  # on token columns
    loss_spans = shift_spans(mask_to_spans(loss_tokens), -1)  # onto the positions predicting them
    targets = torch.nn.functional.pad(input_ids[:, 1:], (0, 1))  # targets[:, t] = input_ids[:, t + 1]
    out = model(**inputs, output_hidden_states=True)
    hidden, head = out.hidden_states[-1], model.get_output_embeddings().weight
    logprob = rlk.linear_logprob(hidden, head, targets, loss_spans=loss_spans)
    scored = torch.nn.functional.pad(loss_tokens[:, 1:], (0, 1))
    predicts_visual = torch.nn.functional.pad((input_ids == training_side.tokens.image)[:, 1:], (0, 1))
    model_lp = torch.log_softmax(out.logits.double(), -1).gather(-1, targets[..., None])[..., 0]
    error = (logprob.double() - model_lp).abs()[scored].max().item()
    if not report.stage(
        "modality-aware log-probs (linear_logprob with loss_spans)",
        {
            "0 on every position predicting a visual token": bool((logprob[predicts_visual] == 0).all()),
            "0 on every other unscored position (prompt, padding)": bool((logprob[~scored] == 0).all()),
            "a log-prob < 0 on every response position": bool((logprob[scored] < 0).all()),
            "equal to the model's own logits within 1e-5": error < 1e-5,
        },
        {
            "visual tokens": int((input_ids == training_side.tokens.image).sum()),
            "scored positions": int(scored.sum()),
            "max |linear_logprob - log_softmax(logits)|": f"{error:.2e}",
        },
    ):
        return report

    # 3. loss masking: GRPO advantages from per-sample scores, the policy loss over the same spans
    scores = torch.rand(len(samples), generator=torch.Generator().manual_seed(seed)).to(device)
    token_adv = rlk.scatter_rewards(
        scores, loss_tokens, group_mode="grpo", group_size=group_size, placement="broadcast"
    )
    advantages = torch.nn.functional.pad(token_adv[:, 1:], (0, 1))
    loss, metrics = rlk.policy_loss(logprob, logprob.detach(), advantages, loss_spans=loss_spans, loss="ppo")
    (grad_logprob,) = torch.autograd.grad(loss, logprob, retain_graph=True)
    if not report.stage(
        "loss masking (scatter_rewards + policy_loss with loss_spans)",
        {
            "loss finite": bool(torch.isfinite(loss)),
            "d loss / d logprob exactly 0 off the spans": bool((grad_logprob[~scored] == 0).all()),
            "d loss / d logprob nonzero on the spans": bool((grad_logprob[scored] != 0).all()),
        },
        {"loss": f"{loss.item():.6f}", "ratio_mean": f"{metrics['ratio_mean'].item():.4f}"},
    ):
        return report

    # 4. one loss step
    loss.backward()
    grads = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    vision = [g for name, g in grads.items() if ".visual." in f".{name}"]
    finite = all(bool(torch.isfinite(g).all()) for g in grads.values())
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p -= 0.5 * p.grad
        after = model(**inputs, output_hidden_states=True).hidden_states[-1]
        new_lp = rlk.linear_logprob(after, head, targets, loss_spans=loss_spans)
    moved = (new_lp - logprob.detach()).abs()
    report.stage(
        "one loss step (backward + SGD)",
        {
            "every gradient finite": finite,
            "the LM head has a nonzero gradient": bool(head.grad is not None and (head.grad != 0).any()),
            "the vision tower has a nonzero gradient": bool(vision) and any(bool((g != 0).any()) for g in vision),
            "response log-probs moved": bool((moved[scored] > 0).any()),
            "unscored positions still 0": bool((new_lp[~scored] == 0).all()),
        },
        {
            "parameters with a gradient": f"{len(grads)} of {sum(1 for _ in model.parameters())}",
            "mean |change| of response log-probs": f"{moved[scored].mean().item():.3e}",
        },
    )
    return report


def run(args, parser: argparse.ArgumentParser) -> int:
    if args.prompts < 1:
        parser.error(f"--prompts: must be >= 1, got {args.prompts}")
    if args.group_size < 2:
        parser.error(f"--group-size: must be >= 2 (GRPO normalizes within a group), got {args.group_size}")
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    report = smoke(args.prompts, args.group_size, args.seed, device)
    print(json.dumps({"passed": report.passed, "stages": report.stages}, indent=2) if args.json else report.format())
    sys.stdout.flush()
    return 0 if report.passed else 1
