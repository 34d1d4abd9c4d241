"""rlk.distributed with simulated ranks on one GPU: bitwise invariance at Qwen3-8B shapes, and what the tree costs.

    python tools/bench_distributed_sim.py [--quick] [--tokens N] [--out DIR] [--skip-invariance] [--skip-overhead]

1. Invariance: a Qwen3-8B-shaped decoder (``--layers``, default 1: hidden 4096, 32 / 8 heads of 128, MLP 12288,
   V = 151936) in bf16 on ``--tokens`` tokens (4 sequences), forward + backward at TP = 1 (rlk's single-device
   ops) and at simulated TP = 2 and 4 (``rlk.distributed`` with ``SimulatedGroup``: the shard kernels and the
   combine code of real ranks, in one process): logits, log-probs, entropies and every parameter gradient must
   be bitwise equal; cross-config: log-probs at TP = 2 (the rollout) vs TP = 1 with DP = 2 (training, each
   "rank" scoring half of the sequences); control: the same TP = 2 with the row-parallel partials added in rank
   order (a stock all-reduce) must differ. Writes ``report.json`` (the ``rlk consistency`` schema, parallel
   configurations in ``report["parallel"]``; plus ``drift.html`` when the consistency tool renders it).
2. Overhead of the tree-aligned single-device kernels against today's (``MAX_TREE_LEAVES = 1``: the kernels'
   previous reduction order, bit for bit; for the matmul, ``rlk.core.tensor_parallel`` off, its default), side by
   side, median ms from ``triton.testing.do_bench``: ``linear_logprob`` forward / backward at N in 1024, 4096,
   16384 (H = 4096, V = 151936; peak memory of the backward) and ``linear`` forward / backward on the Qwen3-8B
   projections at M in 1024, 4096, 16384. The tree matmul holds up to 4 fp32 accumulators; on the 64x128x128
   tile's 4 warps ptxas spills (about 1.2 KB per thread at 8 segments), so the tree runs on 8 warps
   (``TILE_CONFIGS[...]["tree_num_warps"]``); the ``tree w4`` / ``today w8`` columns time the other warp counts.
   Target: the tree within 10% of today at M >= 1024.

``--quick``: the same code on the CPU (Triton interpreter, fp32, the chain test's tiny decoder, K segments of
>= 8), tiny shapes: a smoke run; its timings mean nothing. The H200 run: ``python tools/bench_distributed_sim.py
--out out/dist_sim`` (a few minutes).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import time

import torch


def _args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="CPU smoke run (Triton interpreter, tiny shapes)")
    p.add_argument("--tokens", type=int, default=None, help="tokens of the invariance batch (4 sequences)")
    p.add_argument("--layers", type=int, default=1, help="decoder layers of the invariance model")
    p.add_argument("--out", default=None, help="folder for bench.json and report.json")
    p.add_argument("--skip-invariance", action="store_true")
    p.add_argument("--skip-overhead", action="store_true")
    return p.parse_args(argv)


ARGS = _args(sys.argv[1:]) if __name__ == "__main__" else None
if ARGS is not None and ARGS.quick:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import rlk  # noqa: E402
from rlk import distributed as rd  # noqa: E402
from rlk.distributed import decoder, drift  # noqa: E402
from rlk_triton import logprob as tk_logprob  # noqa: E402
from rlk_triton import matmul as tk_matmul  # noqa: E402


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def _time_ms(fn, device) -> float:
    """Median ms: ``triton.testing.do_bench`` on a GPU; on the CPU (interpreter) the mean of two runs."""
    if device.type == "cuda":
        import triton

        return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))
    fn()
    start = time.perf_counter()
    for _ in range(2):
        fn()
    return (time.perf_counter() - start) / 2 * 1e3


# ----------------------------------------------------------------------------------------------
# 1. invariance at real shapes
# ----------------------------------------------------------------------------------------------


def _trainable(params):
    return {
        k: (
            [t.detach().clone().requires_grad_() for t in v]
            if isinstance(v, list)
            else v.detach().clone().requires_grad_()
        )
        for k, v in params.items()
    }


def _grads_full(config, params, world):
    if world == 1:
        return {k: v.grad for k, v in params.items()}
    per_rank = [{k: (v[r].grad if isinstance(v, list) else v.grad) for k, v in params.items()} for r in range(world)]
    return decoder.unshard(config, per_rank)


def _run(config, params, batch, mode, world, with_grad=True):
    ids, targets, cu, positions, seq_len, coef = batch
    group = rd.SimulatedGroup(world) if mode != "single" else None
    p = _trainable(params if mode == "single" else decoder.shard(config, params, world, list(range(world))))
    trace: list = []
    start = time.perf_counter()
    with torch.set_grad_enabled(with_grad):
        out = decoder.forward(
            config, p, ids, cu, seq_len, positions, targets, mode=mode, group=group, with_logits=True, trace=trace
        )
        if with_grad:
            ((out["logprob"] * coef[0]).sum() + (out["entropy"] * coef[1]).sum()).backward()
    _sync(ids.device)
    seconds = time.perf_counter() - start
    grads = _grads_full(config, p, 1 if mode == "single" else world) if with_grad else {}
    return {k: v.detach() for k, v in out.items()}, grads, trace, seconds


def _split(x, n_seqs):
    return list(x.view(n_seqs, -1))


def invariance(config, dtype, device, tokens, out_dir) -> dict:
    n_seqs, seq_len = 4, tokens // 4
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab, (n_seqs * seq_len,), generator=g).to(device)
    targets = ids.view(n_seqs, seq_len).roll(-1, dims=1).clone()
    targets[:, -1] = -100
    targets = targets.reshape(-1)
    cu = torch.arange(0, (n_seqs + 1) * seq_len, seq_len, dtype=torch.int32, device=device)
    positions = torch.arange(seq_len, device=device).repeat(n_seqs)
    coef = torch.randn(2, n_seqs * seq_len, generator=g).to(device)
    batch = (ids, targets, cu, positions, seq_len, coef)
    params = decoder.init_params(config, dtype, device, seed=0)
    started = time.perf_counter()

    single, single_grads, single_trace, t1 = _run(config, params, batch, "single", 1)
    rows, timings = [], {"tp1_fwd_bwd_s": t1}
    tp2 = None
    for world in (2, 4):
        out, grads, trace, secs = _run(config, params, batch, "tp", world)
        timings[f"tp{world}_fwd_bwd_s"] = secs
        equal = {k: bool(torch.equal(out[k], single[k])) for k in ("logits", "logprob", "entropy")}
        diff_grads = [k for k in single_grads if not torch.equal(grads[k], single_grads[k])]
        rows.append(
            {
                "tp": world,
                **equal,
                "gradients_equal": not diff_grads,
                "differing_gradients": diff_grads,
                "seconds_fwd_bwd": secs,
            }
        )
        if world == 2:
            tp2 = (out, grads, trace)
    stock, stock_grads, stock_trace, _ = _run(config, params, batch, "stock", 2)
    halves = []  # training at TP = 1, DP = 2: each simulated data-parallel rank scores 2 of the 4 sequences
    for r in range(2):
        sl = slice(r * 2 * seq_len, (r + 1) * 2 * seq_len)
        half_batch = (ids[sl], targets[sl], cu[:3], positions[sl], seq_len, coef[:, sl])
        with torch.no_grad():
            out, _, _, _ = _run(config, params, half_batch, "single", 1, with_grad=False)
        halves.append(out["logprob"])
    training = _split(torch.cat(halves), n_seqs)
    full = _split(single["logprob"], n_seqs)
    chains = {
        "on": drift.chain_entry(
            _split(tp2[0]["logprob"], n_seqs),
            training,
            full,
            tp2[1],
            single_grads,
            tp2[2],
            single_trace,
            {"tp2_fwd_bwd_s": timings["tp2_fwd_bwd_s"]},
        ),
        "off": drift.chain_entry(
            _split(stock["logprob"], n_seqs), training, full, stock_grads, single_grads, stock_trace, single_trace, {}
        ),
    }
    report = drift.parallel_report(
        model=f"qwen3-8b-shape, {config.layers} layer(s)" if config.hidden == 4096 else "tiny",
        config=config,
        device=device,
        dtype=dtype,
        parallel={
            "rollout": {"name": "TP=2", "tp": 2, "dp": 1},
            "training_a": {"name": "TP=1 DP=2", "tp": 1, "dp": 2},
            "training_b": {"name": "TP=1 DP=1", "tp": 1, "dp": 1},
            "combine": {
                "on": "rlk.distributed (fixed tree, simulated ranks)",
                "off": "each rank's rlk.linear partial added in rank order (stock all-reduce)",
            },
            "simulated": True,
        },
        chains=chains,
        seeds={"weights": 0, "prompts": 0, "sampling": 0},
        lengths=[seq_len] * n_seqs,
        histograms={
            "on": drift.histogram(_split(tp2[0]["logprob"], n_seqs), training),
            "off": drift.histogram(_split(stock["logprob"], n_seqs), training),
        },
        notes=[
            "gradients count parameter tensors (TP=2 vs TP=1), not sequences",
            "training_b (split B) is the whole batch at TP=1 on one rank",
        ],
        seconds=time.perf_counter() - started,
    )
    report["tp_rows"] = rows
    stock_equal = bool(torch.equal(stock["logprob"], single["logprob"]))
    print(f"\n== invariance: {report['model']['name']}, {dtype}, {tokens} tokens, simulated ranks on {device}")
    print(f"{'':8}{'logits':>8}{'logprob':>9}{'entropy':>9}{'all grads':>11}{'fwd+bwd s':>11}")
    print(f"{'TP=1':8}{'':>37}{t1:>11.2f}")
    for r in rows:
        cells = "".join(
            f"{'equal' if r[k] else 'DIFF':>{w}}"
            for k, w in (("logits", 8), ("logprob", 9), ("entropy", 9), ("gradients_equal", 11))
        )
        print(f"{'TP=' + str(r['tp']):8}{cells}{r['seconds_fwd_bwd']:>11.2f}")
    rt = chains["on"]["rollout_vs_training"]
    print(f"rollout TP=2 vs training TP=1 DP=2: {rt['equal_tokens']}/{rt['tokens']} tokens bitwise equal")
    print(
        f"control (stock combine) equal to TP=1: {stock_equal} (expected False); max |delta lp| "
        f"{chains['off']['rollout_vs_training']['max_abs']:.3g}"
    )
    print("report:", "PASSED" if report["passed"] else f"FAILED {report['failed']}")
    if out_dir:
        try:
            from rlk.app.consistency import report as rep

            report["files"] = rep.write_all(report, out_dir)
        except Exception as exc:  # the consistency tool's HTML may need fields this report lacks
            from rlk.app.consistency import report as rep

            report.setdefault("notes", []).append(f"drift.html not written: {type(exc).__name__}: {exc}")
            report["files"] = {"json": rep.write_json(report, os.path.join(out_dir, "report.json"))}
        print("wrote", report["files"])
    return {
        "rows": rows,
        "cross_config_bitwise": rt["bitwise"],
        "control_differs": not stock_equal,
        "passed": report["passed"] and not stock_equal,
    }


# ----------------------------------------------------------------------------------------------
# 2. overhead of the tree-aligned kernels
# ----------------------------------------------------------------------------------------------


class _Tree:
    """Set the kernels' MAX_TREE_LEAVES and the matmul's tensor-parallel switch (on for more than one leaf), and
    optionally the bf16 matmul's warps (``num_warps`` of one segment and ``tree_num_warps`` of the tree), inside a
    ``with``."""

    def __init__(self, leaves: int, warps: int | None = None, dtype=torch.bfloat16):
        self.leaves, self.warps, self.dtype = leaves, warps, dtype

    def __enter__(self):
        self.saved = (
            tk_logprob.MAX_TREE_LEAVES,
            tk_matmul.MAX_TREE_LEAVES,
            dict(tk_matmul.TILE_CONFIGS[self.dtype]),
            rlk.is_tensor_parallel_invariant(),
        )
        tk_logprob.MAX_TREE_LEAVES = tk_matmul.MAX_TREE_LEAVES = self.leaves
        rlk.set_tensor_parallel_invariant(self.leaves > 1)
        if self.warps is not None:
            tk_matmul.TILE_CONFIGS[self.dtype] = dict(self.saved[2], num_warps=self.warps, tree_num_warps=self.warps)

    def __exit__(self, *exc):
        tk_logprob.MAX_TREE_LEAVES, tk_matmul.MAX_TREE_LEAVES = self.saved[:2]
        tk_matmul.TILE_CONFIGS[self.dtype] = self.saved[2]
        rlk.set_tensor_parallel_invariant(self.saved[3])


def _variants(device):
    variants = {"today": _Tree(1), "tree": _Tree(8)}
    if device.type == "cuda":
        variants.update({"today w8": _Tree(1, 8), "tree w4": _Tree(8, 4)})
    return variants


def _print_table(title, rows, keys):
    print(f"\n== {title}")
    head = f"{'shape':<34}" + "".join(f"{k + ' ms':>12}" for k in keys) + f"{'tree/today':>12}{'TFLOP/s tree':>14}"
    print(head)
    for r in rows:
        line = f"{r['shape']:<34}" + "".join(f"{r['ms'][k]:>12.3f}" for k in keys)
        ratio = r["ms"]["tree"] / r["ms"]["today"]
        flag = "" if r.get("m", 0) < 1024 else (" ok" if ratio <= 1.10 else " >10%")
        print(line + f"{ratio:>11.3f}{flag:<1}" + f"{r['tflops_tree']:>14.1f}")


def overhead_logprob(device, dtype, sizes, h, v):
    rows = []
    for n in sizes:
        g = torch.Generator().manual_seed(n)
        hidden = torch.randn(n, h, generator=g).to(dtype).to(device)
        weight = (torch.randn(v, h, generator=g) / h**0.5).to(dtype).to(device)
        targets = torch.randint(0, v, (n,), generator=g).to(device)
        inv_t = torch.ones(n, device=device)
        lp, ent, lse = (torch.empty(n, device=device) for _ in range(3))
        g_lp, g_ent = torch.ones(n, device=device), torch.full((n,), 0.01, device=device)
        gh, gw = torch.empty_like(hidden), torch.empty_like(weight)

        fwd = functools.partial(tk_logprob.linear_logprob_fwd, hidden, weight, targets, inv_t, -100, lp, ent, lse)
        bwd = functools.partial(
            tk_logprob.linear_logprob_bwd, hidden, weight, targets, inv_t, lse, ent, g_lp, g_ent, -100, gh, gw
        )

        for what, fn, flops in (("fwd", fwd, 2 * n * v * h), ("bwd", bwd, 6 * n * v * h)):
            row = {
                "op": "linear_logprob",
                "pass": what,
                "m": n,
                "shape": f"{what} N={n} H={h} V={v}",
                "ms": {},
                "peak_mib": {},
            }
            for name, tree in _variants(device).items():
                if " w" in name:
                    continue  # the bf16 matmul warps do not touch linear_logprob's kernels
                with tree:
                    fwd()
                    if device.type == "cuda":
                        torch.cuda.synchronize()
                        torch.cuda.reset_peak_memory_stats()
                        base = torch.cuda.memory_allocated()
                        fn()
                        torch.cuda.synchronize()
                        row["peak_mib"][name] = (torch.cuda.max_memory_allocated() - base) / 2**20
                    row["ms"][name] = _time_ms(fn, device)
            row["tflops_tree"] = flops / row["ms"]["tree"] / 1e9
            rows.append(row)
    return rows


QWEN3_LINEARS = {
    "q / o (N=K=4096)": (4096, 4096),
    "k / v (N=1024, K=4096)": (1024, 4096),
    "gate / up (N=12288, K=4096)": (12288, 4096),
    "down (N=4096, K=12288)": (4096, 12288),
}


def overhead_matmul(device, dtype, sizes, shapes):
    rows = []
    for label, (n, k) in shapes.items():
        for m in sizes:
            g = torch.Generator().manual_seed(m + n + k)
            x = torch.randn(m, k, generator=g).to(dtype).to(device)
            w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(device)
            out = torch.empty(m, n, dtype=dtype, device=device)
            grad = torch.randn(m, n, generator=g).to(dtype).to(device)
            gx, gw = torch.empty_like(x), torch.empty_like(w)

            fwd = functools.partial(tk_matmul.matmul_fwd, x, w.t(), None, out)
            bwd = functools.partial(tk_matmul.matmul_bwd, grad, x, w.t(), gx, gw.t(), None)

            for what, fn, flops in (("fwd", fwd, 2 * m * n * k), ("bwd", bwd, 4 * m * n * k)):
                row = {"op": "linear", "pass": what, "m": m, "shape": f"{what} {label.split(' (')[0]} M={m}", "ms": {}}
                for name, tree in _variants(device).items():
                    with tree:
                        row["ms"][name] = _time_ms(fn, device)
                row["tflops_tree"] = flops / row["ms"]["tree"] / 1e9
                rows.append(row)
    return rows


def main(args) -> int:
    quick = args.quick
    device = torch.device("cpu" if quick or not torch.cuda.is_available() else "cuda")
    if device.type == "cpu" and not quick:
        print("no GPU: running the --quick CPU mode")
        quick = True
    dtype = torch.float32 if quick else torch.bfloat16
    if quick:
        tk_matmul.MIN_LEAF = 8  # tiny dims still split into 8 K segments
        from rlk.reference import matmul as ref_matmul

        ref_matmul.MIN_LEAF = 8
        tiles = {"BLOCK_M": 16, "BLOCK_N": 16, "BLOCK_K": 16, "GROUP_M": 2, "num_warps": 4, "num_stages": 1}
        tk_matmul.TILE_CONFIGS[torch.float32] = dict(tiles)
        config = decoder.Config(vocab=128, hidden=128, layers=1, heads=8, kv_heads=4, head_dim=16, intermediate=256)
        tokens = args.tokens or 32
        lp_sizes, lp_h, lp_v = (32,), 64, 8 * 40
        mm_sizes, mm_shapes = (32,), {"tiny (N=128, K=256)": (128, 256)}
    else:
        config = decoder.Config(**{**decoder.QWEN3_8B.__dict__, "layers": args.layers})
        tokens = args.tokens or 2048
        lp_sizes, lp_h, lp_v = (1024, 4096, 16384), 4096, 151936
        mm_sizes, mm_shapes = (1024, 4096, 16384), QWEN3_LINEARS
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    print(
        f"rlk {rlk.__version__}, torch {torch.__version__}, device {device}"
        + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else " (Triton interpreter)")
    )
    results: dict = {"device": str(device), "dtype": str(dtype), "quick": quick}
    ok = True
    rlk.set_tensor_parallel_invariant(True)  # TP = 1 and the simulated ranks in the tensor-parallel order
    with rlk.use_backend("triton"):
        if not args.skip_invariance:
            results["invariance"] = invariance(config, dtype, device, tokens, args.out)
            ok = ok and results["invariance"]["passed"]
        if not args.skip_overhead:
            lp_rows = overhead_logprob(device, dtype, lp_sizes, lp_h, lp_v)
            mm_rows = overhead_matmul(device, dtype, mm_sizes, mm_shapes)
            keys = list(lp_rows[0]["ms"])
            _print_table("linear_logprob: today's kernels vs tree-aligned (median ms)", lp_rows, keys)
            if device.type == "cuda":
                for r in lp_rows:
                    if r["pass"] == "bwd":
                        print(
                            f"  peak extra memory, {r['shape']}: "
                            + ", ".join(f"{k} {v:.0f} MiB" for k, v in r["peak_mib"].items())
                        )
            _print_table(
                "linear (x @ W.T): today's kernels vs tree-aligned (median ms)", mm_rows, list(mm_rows[0]["ms"])
            )
            results["overhead"] = {"linear_logprob": lp_rows, "linear": mm_rows}
            if quick:
                print("(--quick: interpreter timings, not a measurement)")
    if args.out:
        with open(os.path.join(args.out, "bench.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
        print("wrote", os.path.join(args.out, "bench.json"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(ARGS))
