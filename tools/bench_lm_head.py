"""The fused LM-head ops against their peers, one run, one GPU: time, peak memory, error, bitwise guarantees.

Cases (bf16; ``--quick``: the first three): ``linear_logprob`` with entropy at N 16384, H 4096, V 151936 (forward +
backward and forward only); the GRPO head ``fused_linear_policy_loss`` (ppo + k3 KL, token-mean, 16 x 1024 tokens);
``fused_linear_kl`` forward KL at N 8192 (and JSD beta 0.5, reverse KL); ``linear_logprob`` at N 131072; the
Liger README's shape (H 4096, V 131072). Implementations per case, each one skipped with its reason when missing or
failing (an OOM included): rlk's cuBLAS-tiled path (``RLK_TRITON_LM_HEAD=tiled``), rlk's Triton kernels
(``kernels``, the default); the unfused PyTorch expression in eager mode and under ``torch.compile``;
the cuBLAS GEMM floor (the GEMMs of the design alone, in chunks of 2048 rows with fp32 output); TRL 1.16's
``ChunkedLogProbFunction`` / ``ChunkedDivergenceFunction``; Liger's ``LigerFusedLinearGRPOLoss`` /
``LigerFusedLinearJSD``.

Time: median of ``triton.testing.do_bench``. Memory: ``torch.cuda.max_memory_allocated`` during one step minus the
memory allocated before it (the inputs), returned gradients included. Error: max |delta| of the log-prob (or the
loss) against an fp64 computation from the same bf16 inputs, on a slice of rows. Rates: the nominal FLOPs (8 NHV
forward + backward with recomputation, 6 NHV one pass, 2 NHV forward) over the time, and the roofline: those FLOPs
at the GEMM rate measured in the same run. Checks (PASS / FAIL): a row's log-prob, entropy and ``grad_hidden``
alone equal its bits in the batch (``torch.equal``), forward only equals forward + backward, gradients equal run to
run.

    PYTHONPATH=out/gpu_peers:$PYTHONPATH python tools/bench_lm_head.py --quick --out lm_head.json
    python tools/bench_lm_head.py --device cpu --tiny      # the script end to end on the CPU (interpreter)
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
import types
from collections.abc import Callable

if "--device" in sys.argv and sys.argv[sys.argv.index("--device") + 1] == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

ENV = "RLK_TRITON_LM_HEAD"
GIB = 2**30
CHUNK = 2048  # rows per GEMM of the floor (the design's CHUNK_ROWS)


# ----------------------------------------------------------------------------------------------
# measuring
# ----------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, device: torch.device, rep_ms: int):
        self.device = device
        self.rep_ms = rep_ms

    def sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def time_ms(self, fn: Callable[[], object]) -> float:
        if self.device.type == "cuda":
            import triton

            return float(
                triton.testing.do_bench(fn, warmup=max(25, self.rep_ms // 4), rep=self.rep_ms, return_mode="median")
            )
        fn()
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)

    def peak_gib(self, fn: Callable[[], object]) -> float | None:
        if self.device.type != "cuda":
            return None
        gc.collect()
        torch.cuda.empty_cache()
        self.sync()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        out = fn()
        self.sync()
        peak = torch.cuda.max_memory_allocated() - before
        del out
        return peak / GIB

    def clear(self):
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text[:200]


def measure(
    bench: Bench,
    name: str,
    fn: Callable[[], object],
    flops: float,
    error: Callable[[], float] | None,
    env: str | None = None,
) -> dict:
    """One implementation of a case: ms, nominal TFLOP/s, peak GiB, max error; an exception is recorded."""
    row: dict = {"impl": name, "flops": flops}
    old = os.environ.get(ENV)
    if env is not None:
        os.environ[ENV] = env
    try:
        fn()  # warm-up (compiles)
        bench.sync()
        row["ms"] = bench.time_ms(fn)
        row["tflops"] = flops / row["ms"] / 1e9 if flops else None
        row["peak_gib"] = bench.peak_gib(fn)
        if error is not None:
            row["max_err"] = float(error())
    except Exception as exc:  # a peer failing (OOM, missing, wrong version) is reported, not fatal
        row["error"] = _short(exc)
        if os.environ.get("RLK_BENCH_TRACEBACK"):
            traceback.print_exc()
    finally:
        if env is not None:
            if old is None:
                os.environ.pop(ENV, None)
            else:
                os.environ[ENV] = old
        bench.clear()
    status = f"{row['ms']:.2f} ms" if "ms" in row else f"skipped: {row['error']}"
    print(f"  {name}: {status}", flush=True)
    return row


# ----------------------------------------------------------------------------------------------
# peers
# ----------------------------------------------------------------------------------------------


def _stub_transformers() -> None:
    """TRL's kernel files import ``transformers.utils.is_triton_available`` only: a stand-in where transformers is
    not installed (the GPU box)."""
    if importlib.util.find_spec("transformers") is not None:
        return
    pkg, utils = types.ModuleType("transformers"), types.ModuleType("transformers.utils")
    utils.is_triton_available = lambda: importlib.util.find_spec("triton") is not None
    pkg.utils = utils
    sys.modules["transformers"], sys.modules["transformers.utils"] = pkg, utils


def load_trl():
    """``(ChunkedLogProbFunction, ChunkedDivergenceFunction, version)`` or the reason they cannot be imported."""
    try:
        _stub_transformers()
        from trl.kernels.chunked_divergence import ChunkedDivergenceFunction
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction

        return ChunkedLogProbFunction, ChunkedDivergenceFunction
    except Exception as exc:
        return _short(exc)


def load_liger():
    try:
        from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss
        from liger_kernel.transformers.fused_linear_jsd import LigerFusedLinearJSD

        return LigerFusedLinearGRPOLoss, LigerFusedLinearJSD
    except Exception as exc:
        return _short(exc)


def _missing(name: str, reason: str) -> dict:
    print(f"  {name}: skipped: {reason}", flush=True)
    return {"impl": name, "error": reason}


# ----------------------------------------------------------------------------------------------
# references (eager PyTorch) and the GEMM floor
# ----------------------------------------------------------------------------------------------


def torch_logprob(hidden, weight, targets, entropy: bool = True):
    logp = torch.log_softmax((hidden @ weight.T).float(), dim=-1)
    lp = logp.gather(-1, targets[:, None])[:, 0]
    if not entropy:
        return (lp,)
    return lp, -(logp.exp() * logp).sum(-1)


def torch_grpo(hidden, weight, targets, old_lp, advantages, mask, ref_lp, clip=0.2, kl_coef=0.04):
    lp = torch.log_softmax((hidden @ weight.T).float(), dim=-1).gather(-1, targets[..., None])[..., 0]
    return grpo_of(lp, old_lp, advantages, mask, ref_lp, clip, kl_coef)


def grpo_of(lp, old_lp, advantages, mask, ref_lp, clip=0.2, kl_coef=0.04):
    ratio = torch.exp(lp - old_lp)
    pg = -torch.minimum(ratio * advantages, ratio.clamp(1 - clip, 1 + clip) * advantages)
    d = ref_lp - lp
    kl = torch.exp(d) - d - 1  # k3
    per_token = pg + kl_coef * kl
    return (per_token * mask).sum() / mask.sum().clamp(min=1)


def torch_divergence(sh, sw, th, tw, beta: float):
    """Mean over rows of TRL's convention: beta 0 KL(teacher || student), 1 KL(student || teacher), else the JSD."""
    q_log = torch.log_softmax((sh @ sw.T).float(), dim=-1)
    p_log = torch.log_softmax((th @ tw.T).float(), dim=-1)
    if beta == 0.0:
        per = (p_log.exp() * (p_log - q_log)).sum(-1)
    elif beta == 1.0:
        per = (q_log.exp() * (q_log - p_log)).sum(-1)
    else:
        m_log = torch.logaddexp(q_log + math.log(1 - beta), p_log + math.log(beta))
        per = beta * (p_log.exp() * (p_log - m_log)).sum(-1) + (1 - beta) * (q_log.exp() * (q_log - m_log)).sum(-1)
    return per.mean()


def _mm32(a, b):
    if a.device.type == "cuda" and a.dtype != torch.float32:
        return torch.mm(a, b, out_dtype=torch.float32)
    return torch.mm(a.float(), b.float())


def gemm_floor(hidden, weight, gemms: int):
    """The design's GEMMs alone, per chunk of 2048 rows: ``gemms`` 1 (logits), 3 (one pass: logits, G @ W, G.T @ h
    summed in fp32) or 4 (the logits once more, recomputed)."""
    n, _ = hidden.shape
    g = torch.randn((CHUNK, weight.shape[0]), dtype=hidden.dtype, device=hidden.device) * 1e-3
    acc = torch.zeros(weight.shape, dtype=torch.float32, device=hidden.device) if gemms > 1 else None

    def run():
        for r0 in range(0, n, CHUNK):
            h = hidden[r0 : r0 + CHUNK]
            x = _mm32(h, weight.T)
            if gemms == 4:
                x = _mm32(h, weight.T)
            if gemms > 1:
                torch.mm(g[: h.shape[0]], weight)
                gt = g[: h.shape[0]].T
                if hidden.device.type == "cuda" and hidden.dtype != torch.float32:
                    torch.addmm(acc, gt, h, out_dtype=torch.float32, out=acc)
                else:
                    acc.addmm_(gt.float(), h.float())
            del x

    return run


# ----------------------------------------------------------------------------------------------
# the cases
# ----------------------------------------------------------------------------------------------


def _inputs(n, h, v, dtype, device, seed=0):
    g = torch.Generator(device=device).manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, device=device).to(dtype)
    weight = (torch.randn(v, h, generator=g, device=device) / h**0.5 * 4).to(dtype)
    targets = torch.randint(0, v, (n,), generator=g, device=device)
    return hidden, weight, targets


def _ratios(rows: list[dict], ours: str) -> None:
    mine = next((r for r in rows if r["impl"] == ours and "ms" in r), None)
    for r in rows:
        if mine is not None and "ms" in r:
            r["ours_over_this"] = mine["ms"] / r["ms"]


def case_linear_logprob(bench, args, n, h, v, trl, label, gemm_rate):
    import rlk

    dtype = args.dtype
    hidden, weight, targets = _inputs(n, h, v, dtype, bench.device)
    hg, wg = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    gen = torch.Generator(device="cpu").manual_seed(1)
    g_lp = torch.randn(n, generator=gen).to(bench.device)
    g_ent = torch.randn(n, generator=gen).to(bench.device) * 0.1
    sl = slice(0, min(n, args.err_rows))
    with torch.no_grad():
        ref_lp, ref_ent = torch_logprob(hidden[sl].double(), weight.double(), targets[sl])

    def err_of(fn):
        def error():
            with torch.no_grad():
                out = fn()
            return max(
                float((out[0][sl].double() - ref_lp).abs().max()), float((out[1][sl].double() - ref_ent).abs().max())
            )

        return error

    def rlk_fwd(backend="triton"):
        def run():
            with rlk.use_backend(backend):
                return rlk.linear_logprob(hg, wg, targets, return_entropy=True)

        return run

    def train(fwd):
        def run():
            lp, ent = fwd()
            return torch.autograd.grad((lp, ent), (hg, wg), (g_lp, g_ent))

        return run

    def no_grad(fwd):
        def run():
            with torch.no_grad():
                return fwd()

        return run

    eager = lambda: torch_logprob(hg, wg, targets)  # noqa: E731
    compiled_fn = torch.compile(torch_logprob, dynamic=False) if args.compile else None
    compiled = (lambda: compiled_fn(hg, wg, targets)) if compiled_fn else None  # noqa: E731

    def trl_fwd():
        lp, ent, *_ = trl[0].apply(hg, wg, None, targets, 1.0, 32768, None, 1.0, ("entropy",))
        return lp, ent

    results = {"case": label, "shape": {"N": n, "H": h, "V": v, "dtype": str(dtype)}, "rows": {}}
    for mode, flops, gemms in (("fwd+bwd", 8 * n * h * v, 4), ("fwd", 2 * n * h * v, 1)):
        if mode == "fwd" and args.no_fwd:
            continue
        print(f"[{label}] {mode}", flush=True)
        wrap = train if mode == "fwd+bwd" else no_grad
        rows = [
            measure(bench, "rlk tiled", wrap(rlk_fwd()), flops, err_of(rlk_fwd()), env="tiled"),
            measure(bench, "rlk kernels", wrap(rlk_fwd()), flops, err_of(rlk_fwd()), env="kernels"),
        ]
        rows.append(measure(bench, "torch eager", wrap(eager), flops, err_of(eager)))
        if compiled is not None:
            rows.append(measure(bench, "torch.compile", wrap(compiled), flops, err_of(compiled)))
        rows.append(measure(bench, f"cuBLAS floor ({gemms} GEMMs)", gemm_floor(hidden, weight, gemms), flops, None))
        if isinstance(trl, tuple):
            rows.append(measure(bench, "TRL ChunkedLogProb", wrap(trl_fwd), flops, err_of(trl_fwd)))
        else:
            rows.append(_missing("TRL ChunkedLogProb", trl))
        floor = next((r for r in rows if r["impl"].startswith("cuBLAS") and "ms" in r), None)
        if floor is not None:
            gemm_rate[mode] = flops / floor["ms"] / 1e9
        _ratios(rows, "rlk tiled")
        results["rows"][mode] = rows
    return results


def case_grpo(bench, args, b, t, h, v, liger, label):
    import rlk

    dtype = args.dtype
    n = b * t
    hidden, weight, targets = _inputs(n, h, v, dtype, bench.device, seed=2)
    hidden = hidden.view(b, t, h)
    targets = targets.view(b, t)
    hg, wg = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    gen = torch.Generator(device="cpu").manual_seed(3)
    advantages = torch.randn(b, generator=gen).repeat_interleave(t).view(b, t).to(bench.device)
    mask = torch.ones(b, t, device=bench.device)
    with torch.no_grad(), rlk.use_backend("triton"):
        os.environ[ENV] = "tiled"
        old_lp = rlk.linear_logprob(hidden, weight, targets)
        os.environ.pop(ENV)
    ref_lp = old_lp + 0.05 * torch.randn(b, t, generator=gen).to(bench.device)
    with torch.no_grad():  # fp64 log-probs row chunk by row chunk (the whole [N, V] in fp64 would be 18 GiB)
        w64 = weight.double()
        lp64 = torch.cat(
            [
                torch_logprob(hidden.view(n, h)[r : r + 1024].double(), w64, targets.view(n)[r : r + 1024], False)[0]
                for r in range(0, n, 1024)
            ]
        ).view(b, t)
        del w64
        ref_loss = grpo_of(lp64, old_lp.double(), advantages.double(), mask.double(), ref_lp.double())

    def rlk_loss(mode, backend="triton"):
        def run():
            with rlk.use_backend(backend):
                loss, _ = rlk.fused_linear_policy_loss(
                    hg,
                    wg,
                    targets,
                    old_lp,
                    advantages,
                    mask,
                    ref_logprob=ref_lp,
                    mode=mode,
                    loss="ppo",
                    kl="k3",
                    kl_coef=0.04,
                    agg="token-mean",
                )
            return loss

        return run

    def step(loss_fn):
        def run():
            return torch.autograd.grad(loss_fn(), (hg, wg))

        return run

    def err(loss_fn):
        return lambda: abs(float(loss_fn().detach().double() - ref_loss))

    eager = lambda: torch_grpo(hg, wg, targets, old_lp, advantages, mask, ref_lp)  # noqa: E731
    compiled_fn = torch.compile(torch_grpo, dynamic=False) if args.compile else None
    flops = 6 * n * h * v
    print(f"[{label}] fwd+bwd", flush=True)
    rows = [
        measure(bench, "rlk tiled one_pass", step(rlk_loss("one_pass")), flops, err(rlk_loss("one_pass")), "tiled"),
        measure(bench, "rlk tiled lean", step(rlk_loss("lean")), flops, err(rlk_loss("lean")), "tiled"),
        measure(bench, "rlk kernels one_pass", step(rlk_loss("one_pass")), flops, err(rlk_loss("one_pass")), "kernels"),
        measure(bench, "rlk kernels lean", step(rlk_loss("lean")), flops, err(rlk_loss("lean")), "kernels"),
        measure(bench, "torch eager", step(eager), flops, err(eager)),
    ]
    if compiled_fn is not None:
        comp = lambda: compiled_fn(hg, wg, targets, old_lp, advantages, mask, ref_lp)  # noqa: E731
        rows.append(measure(bench, "torch.compile", step(comp), flops, err(comp)))
    rows.append(measure(bench, "cuBLAS floor (3 GEMMs)", gemm_floor(hidden.view(n, h), weight, 3), flops, None))
    if not args.liger_grpo:
        rows.append(_missing("Liger GRPO", "not run (--liger-grpo; about 1.1 s a step on an H100)"))
    elif isinstance(liger, tuple):
        module = liger[0](beta=0.04, use_ref_model=True, loss_type="dapo", epsilon_low=0.2, epsilon_high=0.2)

        def liger_loss():
            out = module(
                hg, wg, targets, mask, advantages[:, 0], ref_per_token_logps=ref_lp, old_per_token_logps=old_lp
            )
            return out[0] if isinstance(out, tuple) else out

        rows.append(measure(bench, "Liger GRPO", step(liger_loss), flops, None))
    else:
        rows.append(_missing("Liger GRPO", liger))
    _ratios(rows, "rlk tiled one_pass")
    # the one-pass log-probs are the rollout's bits: ratio_max exactly 1 on the first micro-step
    check = {}
    try:
        os.environ[ENV] = "tiled"
        with rlk.use_backend("triton"):
            _, metrics = rlk.fused_linear_policy_loss(hg, wg, targets, old_lp, advantages, mask, mode="one_pass")
        check["one_pass_ratio_is_exactly_1"] = bool(float(metrics["ratio_max"]) == 1.0)
    except Exception as exc:
        check["error"] = _short(exc)
    finally:
        os.environ.pop(ENV, None)
    return {
        "case": label,
        "shape": {"B": b, "T": t, "H": h, "V": v, "dtype": str(dtype)},
        "rows": {"fwd+bwd": rows},
        "checks": check,
    }


def case_kl(bench, args, n, h, v, divergence, trl, liger, label):
    import rlk

    dtype = args.dtype
    sh, sw, _ = _inputs(n, h, v, dtype, bench.device, seed=4)
    th, tw, _ = _inputs(n, h, v, dtype, bench.device, seed=5)
    shg, swg = sh.clone().requires_grad_(), sw.clone().requires_grad_()
    beta = {"forward_kl": 0.0, "reverse_kl": 1.0, "jsd": 0.5}[divergence]
    sl = slice(0, min(n, args.err_rows))
    with torch.no_grad():
        ref = float(torch_divergence(sh[sl].double(), sw.double(), th[sl].double(), tw.double(), beta))

    def rlk_loss(rows=slice(None)):
        with rlk.use_backend("triton"):
            return rlk.fused_linear_kl(shg[rows], swg, th[rows], tw, divergence=divergence, beta=beta)

    def step(loss_fn):
        return lambda: torch.autograd.grad(loss_fn(), (shg, swg))

    def err(loss_fn):
        return lambda: abs(float(loss_fn(sl).detach().double()) - ref)

    eager = lambda rows=slice(None): torch_divergence(shg[rows], swg, th[rows], tw, beta)  # noqa: E731
    compiled_fn = torch.compile(torch_divergence, dynamic=False) if args.compile else None
    flops = 8 * n * h * v  # student fwd + bwd (6 NHV) and the teacher's logits (2 NHV)
    print(f"[{label}] fwd+bwd", flush=True)
    rows = [
        measure(bench, "rlk kernels", step(rlk_loss), flops, err(rlk_loss)),
        measure(bench, "torch eager", step(eager), flops, err(eager)),
    ]
    if compiled_fn is not None:
        comp = lambda rows=slice(None): compiled_fn(shg[rows], swg, th[rows], tw, beta)  # noqa: E731
        rows.append(measure(bench, "torch.compile", step(comp), flops, None))
    if isinstance(trl, tuple):

        def trl_loss(rows=slice(None)):
            div, _ = trl[1].apply(shg[rows], swg, None, th[rows], tw, None, beta, 1.0)
            return div.mean()

        rows.append(measure(bench, "TRL ChunkedDivergence", step(trl_loss), flops, err(trl_loss)))
    else:
        rows.append(_missing("TRL ChunkedDivergence", trl))
    if divergence == "jsd":
        if isinstance(liger, tuple):
            module = liger[1](jsd_beta=beta)
            liger_loss = lambda: module(shg, swg, th, tw, None)  # noqa: E731
            rows.append(measure(bench, "Liger FusedLinearJSD", step(liger_loss), flops, None))
        else:
            rows.append(_missing("Liger FusedLinearJSD", liger))
    _ratios(rows, "rlk kernels")
    return {"case": label, "shape": {"N": n, "H": h, "V": v, "dtype": str(dtype)}, "rows": {"fwd+bwd": rows}}


# ----------------------------------------------------------------------------------------------
# the bitwise checks of the tiled path at the benchmark shape
# ----------------------------------------------------------------------------------------------


def bitwise_checks(bench, args, n, h, v) -> dict:
    import rlk

    hidden, weight, targets = _inputs(n, h, v, args.dtype, bench.device, seed=7)
    gen = torch.Generator(device="cpu").manual_seed(8)
    g_lp = torch.randn(n, generator=gen).to(bench.device)
    g_ent = torch.randn(n, generator=gen).to(bench.device) * 0.1
    out: dict = {}
    os.environ[ENV] = "tiled"
    try:
        with rlk.use_backend("triton"):

            def train(rows):
                hg, wg = hidden[rows].clone().requires_grad_(), weight.clone().requires_grad_()
                lp, ent = rlk.linear_logprob(hg, wg, targets[rows], return_entropy=True)
                gh, gw = torch.autograd.grad((lp, ent), (hg, wg), (g_lp[rows], g_ent[rows]))
                return lp.detach(), ent.detach(), gh, gw

            whole = train(slice(None))
            with torch.no_grad():
                lp_roll, ent_roll = rlk.linear_logprob(hidden, weight, targets, return_entropy=True)
            out["forward_only_equals_training"] = bool(
                torch.equal(lp_roll, whole[0]) and torch.equal(ent_roll, whole[1])
            )
            probes = [slice(0, 1), slice(n - 1, n), slice(n // 3, n // 3 + 1)]
            if n > CHUNK:
                probes += [slice(CHUNK - 1, CHUNK + 1), slice(CHUNK // 2, CHUNK // 2 + CHUNK + 5)]
            same = True
            for rows in probes:
                alone = train(rows)
                same &= all(torch.equal(a, b[rows]) for a, b in zip(alone[:3], whole[:3], strict=True))
            out["rows_bitwise_invariant"] = bool(same)
            again = train(slice(None))
            out["grads_deterministic"] = bool(torch.equal(again[2], whole[2]) and torch.equal(again[3], whole[3]))
    except Exception as exc:
        out["error"] = _short(exc)
    finally:
        os.environ.pop(ENV, None)
        bench.clear()
    for name, ok in out.items():
        print(f"  check {name}: {'PASS' if ok is True else 'FAIL' if ok is False else ok}", flush=True)
    return out


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------


def _fmt(x, spec):
    return "" if x is None else format(x, spec)


def markdown(report: dict) -> str:
    lines = [
        f"device: {report['device']}; torch {report['torch']}; triton {report['triton']}",
        f"GEMM rate measured (cuBLAS floor): {report['gemm_rate_tflops']}",
        "",
    ]
    for case in report["cases"]:
        for mode, rows in case["rows"].items():
            rate = report["gemm_rate_tflops"].get("fwd" if mode == "fwd" else "fwd+bwd")
            lines += [
                f"### {case['case']}, {mode} ({case['shape']})",
                "",
                "| impl | ms | nominal TFLOP/s | peak GiB | max err | ours / this |",
                "|---|---|---|---|---|---|",
            ]
            for r in rows:
                if "ms" not in r:
                    lines.append(f"| {r['impl']} | {r.get('error', '')} | | | | |")
                    continue
                lines.append(
                    f"| {r['impl']} | {r['ms']:.2f} | {_fmt(r.get('tflops'), '.0f')} "
                    f"| {_fmt(r.get('peak_gib'), '.2f')} | {_fmt(r.get('max_err'), '.2e')} "
                    f"| {_fmt(r.get('ours_over_this'), '.3f')} |"
                )
            flops = rows[0].get("flops") if rows else None
            if rate and flops:
                lines.append(
                    f"\nroofline: {flops:.3g} FLOPs at the measured GEMM rate ({rate:.0f} TFLOP/s) = "
                    f"{flops / rate / 1e9:.2f} ms"
                )
            lines.append("")
        if case.get("checks"):
            lines.append(f"checks: {case['checks']}\n")
    lines.append(f"bitwise checks of the tiled path: {report.get('bitwise')}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--quick", action="store_true", help="three cases, fewer repeats (< 3 minutes on an H100)")
    parser.add_argument("--tiny", action="store_true", help="tiny fp32 shapes (the CPU end-to-end run)")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="skip the torch.compile peers")
    parser.add_argument("--liger-grpo", action="store_true", help="also time Liger's GRPO loss (slow)")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    args.dtype = torch.float32 if args.tiny else torch.bfloat16
    args.err_rows = 8 if args.tiny else 256
    args.no_fwd = False
    bench = Bench(device, rep_ms=20 if args.tiny else (400 if args.quick else 1500))
    if args.tiny:
        from rlk_triton import lm_head

        lm_head.CHUNK_ROWS, lm_head.VOCAB_BLOCK, lm_head.BLOCK_V = 16, 64, 32
        global CHUNK
        CHUNK = 16
    import triton

    trl, liger = load_trl(), load_liger()
    print(
        f"TRL kernels: {'loaded' if isinstance(trl, tuple) else trl}; Liger: "
        f"{'loaded' if isinstance(liger, tuple) else liger}",
        flush=True,
    )
    try:
        from rlk_triton import lm_head

        fused = lm_head.accumulates_in_place(device, args.dtype)
    except Exception as exc:
        fused = _short(exc)
    report = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "fp32_accumulate_in_the_gemm": fused,
        "gemm_rate_tflops": {},
        "cases": [],
    }
    if args.tiny:
        n, h, v = 40, 32, 300
        shapes = {"lp": (n, h, v), "grpo": (4, 10, h, v), "kl": (n, h, v)}
    else:
        shapes = {"lp": (16384, 4096, 151936), "grpo": (16, 1024, 4096, 151936), "kl": (8192, 4096, 151936)}
    rate = report["gemm_rate_tflops"]
    cases = [
        lambda: case_linear_logprob(bench, args, *shapes["lp"], trl, "linear_logprob + entropy", rate),
        lambda: case_grpo(bench, args, *shapes["grpo"], liger, "GRPO head (ppo + k3, token-mean)"),
        lambda: case_kl(bench, args, *shapes["kl"], "forward_kl", trl, liger, "fused_linear_kl forward KL"),
    ]
    if not args.quick:
        cases += [
            lambda: case_kl(bench, args, *shapes["kl"], "jsd", trl, liger, "fused_linear_kl JSD beta 0.5"),
            lambda: case_kl(bench, args, *shapes["kl"], "reverse_kl", trl, liger, "fused_linear_kl reverse KL"),
        ]
        if not args.tiny:
            cases += [
                lambda: case_linear_logprob(bench, args, 16384, 4096, 131072, trl, "Liger README shape", {}),
                lambda: _long(bench, args, trl),
            ]
    for run in cases:
        try:
            report["cases"].append(run())
        except Exception as exc:
            print(f"case failed: {_short(exc)}", flush=True)
            traceback.print_exc()
            report["cases"].append({"case": "failed", "error": _short(exc), "rows": {}})
        torch.compiler.reset()  # the compiled peers of a case keep nothing alive for the next
        bench.clear()
    print("[bitwise checks, tiled path]", flush=True)
    report["bitwise"] = bitwise_checks(bench, args, *(shapes["lp"] if not args.tiny else (40, 32, 300)))
    text = markdown(report)
    print("\n" + text)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1, default=str)
        print(f"\nwrote {args.out}")
    bad = [k for k, ok in report["bitwise"].items() if ok is not True]
    return 1 if bad else 0


def _long(bench, args, trl):
    """131072 tokens, forward + backward only (TRL's and ours; torch.compile runs out of memory there)."""
    saved = args.compile, args.no_fwd
    args.compile, args.no_fwd = False, True
    try:
        return case_linear_logprob(bench, args, 131072, 4096, 151936, trl, "linear_logprob + entropy, N 131072", {})
    finally:
        args.compile, args.no_fwd = saved


if __name__ == "__main__":
    sys.exit(main())
