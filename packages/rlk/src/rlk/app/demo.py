"""``rlk demo``: first the consistency check (:func:`rlk.app.consistency.run.run_consistency`) on the built-in
model: the tiny Qwen3 model in float32 on the CPU (rlk's chain in the Triton interpreter), the
Qwen3-8B-shaped model in bfloat16 when a GPU is present, with few prompts and tokens so it stays short;
then both log-prob ops on this machine's best backend, against the PyTorch baseline
``log_softmax(hidden @ weight.T).gather(...)``, with the peak memory each needs for forward + backward.

Memory is measured, not estimated: on a GPU with ``torch.cuda.max_memory_allocated``,
on the CPU as the peak resident set size of a fresh child process per variant
(``VmHWM`` minus the resident size once the inputs exist).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time

import torch

#: The consistency check of the demo per device type. On the CPU the timed passes are skipped: rlk's chain
#: runs in the Triton interpreter there, so its tokens/s say nothing (and take a third of the time).
CONSISTENCY_CPU = dict(model="tiny", dtype=torch.float32, prompts=4, max_new_tokens=8, timing=False)
CONSISTENCY_GPU = dict(model="qwen3-8b-shape", dtype=torch.bfloat16, prompts=4, max_new_tokens=8, timing=True)

GPU_SHAPE = dict(n=4096, h=4096, v=151936, dtype=torch.bfloat16)
CPU_SHAPE = dict(n=2048, h=512, v=32000, dtype=torch.float32)


def _inputs(n: int, h: int, v: int, dtype: torch.dtype, device: str):
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(n, h, generator=g) / h**0.25).to(device, dtype)
    weight = (torch.randn(v, h, generator=g) / h**0.25).to(device, dtype)
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    return hidden, weight, targets


def _linear_rlk(hidden, weight, targets):
    import rlk

    lp, ent = rlk.linear_logprob(hidden, weight, targets, return_entropy=True)
    return lp, ent


def _linear_torch(hidden, weight, targets):
    logp = torch.log_softmax((hidden @ weight.T).float(), dim=-1)
    lp = logp.gather(-1, targets[:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


_VARIANTS = {"rlk.linear_logprob": _linear_rlk, "torch log_softmax(h @ W.T)": _linear_torch}


def _run_variant(name: str, shape: dict, device: str) -> tuple[float, float, torch.Tensor, torch.Tensor]:
    """Forward + backward of one variant; returns (seconds, peak extra MiB, logprob, entropy)."""
    hidden, weight, targets = _inputs(**shape, device=device)
    hidden.requires_grad_(True)
    weight.requires_grad_(True)
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    else:
        base = _rss_mib()
    start = time.perf_counter()
    lp, ent = _VARIANTS[name](hidden, weight, targets)
    (lp.sum() + ent.sum()).backward()
    if device.startswith("cuda"):
        torch.cuda.synchronize()
        peak = (torch.cuda.max_memory_allocated() - base) / 2**20
    else:
        peak = _peak_rss_mib() - base
    seconds = time.perf_counter() - start
    return seconds, peak, lp.detach().cpu(), ent.detach().cpu()


def _status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    return float("nan")


def _rss_mib() -> float:
    return _status_mib("VmRSS:")


def _peak_rss_mib() -> float:
    return _status_mib("VmHWM:")


def _measure(name: str, shape: dict, device: str):
    if device.startswith("cuda"):
        return _run_variant(name, shape, device)
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.pt")
        code = f"from rlk.app import demo; demo._child({name!r}, {device!r}, {out!r})"
        subprocess.run([sys.executable, "-c", code], check=True)
        return torch.load(out)


def _child(name: str, device: str, out: str) -> None:
    """Entry of the fresh process that measures one variant's peak memory on the CPU."""
    torch.save(_run_variant(name, CPU_SHAPE, device), out)


def run_consistency_demo(device: str, out: str | None) -> bool:
    """The consistency check of the demo; returns whether every gating verdict passed."""
    from rlk.app.consistency.run import run_consistency

    cfg = CONSISTENCY_GPU if device.startswith("cuda") else CONSISTENCY_CPU
    print(
        f"\n== consistency: {cfg['model']} in {str(cfg['dtype'])[6:]} on {device}: rollout vs training log-probs, "
        f"rlk off vs on =="
    )
    report = run_consistency(
        cfg["model"],
        device=device,
        dtype=cfg["dtype"],
        prompts=cfg["prompts"],
        max_new_tokens=cfg["max_new_tokens"],
        out=out,
        timing=cfg["timing"],
    )
    print(f"(full check: rlk consistency --model {cfg['model']} --prompts 8 --max-new-tokens 16)")
    return bool(report["passed"])


def run_demo(device: str | None = None, *, out: str | None = None, consistency: bool = True) -> int:
    import rlk
    from rlk.app.info import default_device

    device = device or str(default_device())
    if consistency and device.startswith("cpu"):
        from rlk.app.consistency.run import ensure_interpreter

        ensure_interpreter()  # before rlk.info() imports triton
    print(rlk.info())
    passed = run_consistency_demo(device, out) if consistency else True
    print("\n== linear_logprob: memory vs the PyTorch baseline ==")
    shape = GPU_SHAPE if device.startswith("cuda") else CPU_SHAPE
    n, h, v, dtype = shape["n"], shape["h"], shape["v"], shape["dtype"]
    hidden, weight, targets = _inputs(**shape, device=device)
    decision = rlk.explain("linear_logprob", hidden, weight, targets)
    print(
        f"\nlinear_logprob, forward + backward with entropy: N={n} H={h} V={v} {str(dtype)[6:]} on {device}, "
        f"backend '{decision.backend}'"
    )
    print(f"  (the [N, V] logits alone are {n * v * 4 / 2**20:.0f} MiB in fp32)")
    rows = {name: _measure(name, shape, device) for name in _VARIANTS}
    print(f"  {'variant':<28} {'time':>9} {'peak extra memory':>18}")
    for name, (seconds, peak, _, _) in rows.items():
        print(f"  {name:<28} {seconds:>8.2f}s {peak:>14.0f} MiB")
    (_, peak_rlk, lp_rlk, ent_rlk), (_, peak_torch, lp_torch, ent_torch) = rows.values()
    print(
        f"  memory saved: {peak_torch - peak_rlk:.0f} MiB ({peak_torch / max(peak_rlk, 1):.1f}x less); "
        f"max |delta logprob| vs torch {float((lp_rlk - lp_torch).abs().max()):.2e}, "
        f"max |delta entropy| {float((ent_rlk - ent_torch).abs().max()):.2e}"
    )
    logits = (hidden[:8] @ weight.T).float()
    lp = rlk.selected_logprob(logits, targets[:8], temperature=0.7)
    ref = torch.log_softmax(logits / 0.7, -1).gather(-1, targets[:8, None]).squeeze(-1)
    print(
        f"\nselected_logprob on [8, {v}] logits at temperature 0.7, backend "
        f"'{rlk.explain('selected_logprob', logits, targets).backend}': "
        f"max |delta| vs torch.log_softmax {float((lp - ref).abs().max()):.2e}"
    )
    return 0 if passed else 1
