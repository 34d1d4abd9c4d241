"""Sweep bf16 tile configurations of the Triton matmul kernel per ``M`` on a CUDA GPU, for ``M_TILE_CONFIGS``.

A row keeps its bits across ``M`` buckets only if every configuration gives the same bits
(``rlk_triton.matmul.tile_buckets_agree``). This script times each candidate of :data:`CANDIDATES` at
``M`` in :data:`M_VALUES` on the shapes that matter (N = K = 4096 and the Qwen3-8B MLP: gate/up
``[M, 4096] x [4096, 12288]``, down ``[M, 12288] x [12288, 4096]``), in linear's layout (``x @ weight.T``,
the weight ``[N, K]`` read in place) and row-major, against ``torch.mm`` (cuBLAS) on the same operands:
ratios ``cuBLAS ms / candidate ms`` (1.0 = as fast as cuBLAS; median of ``triton.testing.do_bench``,
which flushes L2, so small-M weight reads come from HBM). Per candidate it checks that its outputs at
M = 1, 64 and 4096 are bitwise those of the shipped ``TILE_CONFIGS`` (one ``K`` segment).

It prints per ``M`` the best same-bits candidate (by its worst ratio over shapes and layouts), and per
bucket of :data:`BUCKETS` the candidate with the best worst ratio over the bucket's ``M`` values, the
proposal for ``M_TILE_CONFIGS`` (copied by hand into ``rlk_triton/matmul.py``); ``--out FILE`` also
writes it as JSON (``{"buckets": [[m_max, config], ...], "same_bits": ..., "table": ...}``).

    python tools/sweep_matmul.py [--quick] [--tma] [--out FILE]

``--tma`` adds each candidate with TMA loads (``"tma": True``: ``rlk_triton.matmul._matmul_tma_kernel`` in linear's
layout, the pointer kernel row-major, as the large bucket runs) to the same tables and bit checks; a candidate
whose TMA kernel does not fit the GPU's shared memory is listed as failed.

Targets (issue 19): ratio >= 0.85 for M >= 1024 and >= 0.7 for M <= 64. A few minutes on an H200.
"""

from __future__ import annotations

import argparse
import json

import torch
import triton

from rlk_triton import matmul as tk

DTYPE = torch.bfloat16

#: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages, GROUP_M). Shared memory per stage:
#: ``(BLOCK_M + BLOCK_N) * BLOCK_K * 2`` bytes (227 KiB per block on sm_90).
CANDIDATES = [
    (64, 128, 128, 4, 4, 8),  # shipped TILE_CONFIGS
    (64, 16, 128, 4, 6, 8),
    (64, 32, 128, 4, 4, 8),
    (64, 32, 128, 4, 6, 8),
    (64, 32, 256, 4, 4, 8),
    (64, 64, 128, 4, 4, 8),
    (64, 64, 128, 4, 6, 8),
    (64, 64, 256, 4, 3, 8),
    (64, 128, 64, 4, 6, 8),
    (64, 256, 64, 4, 4, 8),
    (128, 64, 64, 4, 5, 8),
    (128, 128, 64, 4, 4, 8),
    (128, 128, 64, 8, 4, 8),
    (128, 128, 64, 8, 5, 8),
    (128, 128, 128, 8, 3, 8),
    (128, 256, 64, 8, 3, 8),
    (128, 256, 64, 8, 4, 8),
    (128, 256, 64, 8, 4, 16),
]

SHAPES = {"N=K=4096": (4096, 4096), "gate/up N=12288 K=4096": (12288, 4096), "down N=4096 K=12288": (4096, 12288)}
M_VALUES = (1, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)
#: Candidate buckets: (m_max, the M values it covers); the last covers every larger M.
BUCKETS = ((64, (1, 16, 32, 64)), (256, (128, 256)), (512, (512,)), (None, (1024, 4096, 16384)))
LAYOUTS = ("linear", "row-major")


def config(c: tuple[int, ...]) -> dict[str, int]:
    bm, bn, bk, warps, stages, group = c
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group, "num_warps": warps, "num_stages": stages}


def name(c: tuple[int, ...]) -> str:
    return f"{c[0]}x{c[1]}x{c[2]} w{c[3]} s{c[4]} g{c[5]}"


def pointer_runner(c: tuple[int, ...]):
    """``out = x @ b`` through ``rlk_triton.matmul``'s kernel with the tiles ``c`` (one K segment)."""
    cfg = config(c)
    return lambda x, b, weight, layout, out: tk._gemm(x, b, out, cfg=cfg)


def tma_runner(c: tuple[int, ...]):
    """``out = x @ b`` with the tiles ``c`` and TMA loads where ``rlk_triton.matmul`` takes them (linear's layout)."""
    cfg = config(c) | {"tma": True}
    return lambda x, b, weight, layout, out: tk._gemm(x, b, out, cfg=cfg)


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="M in (1, 64, 4096), N=K=4096, linear layout only")
    parser.add_argument("--out", help="write the per-M table and the proposed buckets as JSON")
    parser.add_argument("--tma", action="store_true", help="also time each candidate with TMA loads")
    args = parser.parse_args()
    shapes = dict(list(SHAPES.items())[:1]) if args.quick else SHAPES
    m_values = (1, 64, 4096) if args.quick else M_VALUES
    layouts = LAYOUTS[:1] if args.quick else LAYOUTS
    dev = torch.device("cuda")
    print(
        f"{torch.cuda.get_device_name(dev)}, torch {torch.__version__}, triton {triton.__version__}; "
        f"shipped bf16 TILE_CONFIGS {tk.TILE_CONFIGS[DTYPE]}"
    )
    gen = torch.Generator(dev).manual_seed(0)
    runners = {name(c): pointer_runner(c) for c in CANDIDATES}
    configs = {name(c): config(c) for c in CANDIDATES}
    if args.tma:
        runners |= {"TMA " + name(c): tma_runner(c) for c in CANDIDATES}
        configs |= {"TMA " + name(c): config(c) | {"tma": True} for c in CANDIDATES}
    shipped_name = name(CANDIDATES[0])
    # ratio[cand][m] = list over (shape, layout); same[cand] = bits equal to the shipped tiles everywhere
    ratio = {c: {m: [] for m in m_values} for c in runners}
    same = dict.fromkeys(runners, True)
    failed = set()
    for shape_name, (n, k) in shapes.items():
        weight = torch.randn(n, k, generator=gen, device=dev, dtype=torch.float32).mul_(k**-0.5).to(DTYPE)
        x = torch.randn(max(m_values), k, generator=gen, device=dev, dtype=torch.float32).to(DTYPE)
        out = torch.empty(max(m_values), n, device=dev, dtype=DTYPE)
        for layout in layouts:
            b = weight.t() if layout == "linear" else weight.t().contiguous()
            cublas = {m: _ms(lambda xm=x[:m], om=out[:m], bm=b: torch.mm(xm, bm, out=om)) for m in m_values}
            shipped = {}
            for m in (1, 64, 4096):
                shipped[m] = torch.empty(m, n, device=dev, dtype=DTYPE)
                tk._gemm(x[:m], b, shipped[m], cfg=tk.TILE_CONFIGS[DTYPE])
            print(f"\n### {shape_name}, {layout}: cuBLAS ms / candidate ms (cuBLAS TFLOP/s in the header)")
            print(
                "| config | "
                + " | ".join(f"M={m} ({2 * m * n * k / cublas[m] / 1e9:.0f})" for m in m_values)
                + " | same bits |"
            )
            print("|---|" + "---:|" * len(m_values) + "---|")
            for cand, run in runners.items():
                if cand in failed:
                    continue
                try:
                    row = []
                    for m in m_values:
                        ms = _ms(lambda xm=x[:m], om=out[:m], bm=b, w=weight, r=run, lay=layout: r(xm, bm, w, lay, om))
                        row.append(cublas[m] / ms)
                    bits = True
                    for m, want in shipped.items():
                        got = torch.empty_like(want)
                        run(x[:m], b, weight, layout, got)
                        bits &= torch.equal(got, want)
                except Exception as exc:  # a config the compiler rejects (shared memory): report, keep going
                    print(f"| {cand} | FAILED {type(exc).__name__}: {str(exc)[:100]} |")
                    failed.add(cand)
                    continue
                same[cand] &= bits
                for m, r in zip(m_values, row):
                    ratio[cand][m].append(r)
                print(f"| {cand} | " + " | ".join(f"{r:.2f}" for r in row) + f" | {'yes' if bits else 'NO'} |")
    usable = [c for c in runners if c not in failed and same[c]]
    print(
        f"\ncandidates with the shipped bits everywhere: {len(usable)} of {len(runners)}"
        + "".join(f"\n  OTHER BITS: {c}" for c in runners if c not in failed and not same[c])
    )
    print("\n### best same-bits candidate per M (worst ratio over shapes and layouts)")
    print("| M | best | worst ratio | shipped's worst ratio |")
    print("|---:|---|---:|---:|")
    for m in m_values:
        best = max(usable, key=lambda c: min(ratio[c][m]))
        print(f"| {m} | {best} | {min(ratio[best][m]):.2f} | {min(ratio[shipped_name][m]):.2f} |")
    print("\n### proposed buckets (best worst ratio over the bucket's M values)")
    buckets = []
    for m_max, ms in BUCKETS:
        ms = [m for m in ms if m in m_values]
        if not ms:
            continue
        best = max(usable, key=lambda c: min(min(ratio[c][m]) for m in ms))
        worst = min(min(ratio[best][m]) for m in ms)
        shipped_worst = min(min(ratio[shipped_name][m]) for m in ms)
        print(f"M <= {m_max if m_max is not None else 'any'}: {best}: worst {worst:.2f} (shipped {shipped_worst:.2f})")
        buckets.append([m_max, configs.get(best, best)])
    if args.out:
        table = {c: {str(m): ratio[c][m] for m in m_values} for c in runners if c not in failed}
        with open(args.out, "w") as f:
            json.dump(
                {"buckets": buckets, "same_bits": {c: same[c] for c in runners if c not in failed}, "table": table},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
