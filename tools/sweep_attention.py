"""Sweep the fixed tile configurations of the Triton attention kernels on a GPU (about 2 minutes).

The shipped configuration is one constant per (dtype, head dim) (batch invariance forbids choosing
tiles at run time); this script is how the constant is chosen. For each candidate it times the
forward and forward+backward at the headline shape (B=8, Hq=32, Hkv=8, S=4096, D=128, causal, bf16)
next to SDPA's flash backend in the same run, and checks that the candidate keeps a query's output
bitwise equal between the full prefill and a decode step of the last tokens.

    python tools/sweep_attention.py [--seqlen 4096 --batch 8 --head-dim 128]
"""

from __future__ import annotations

import argparse
import math

import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention

from rlk_triton import attention as tk

DTYPE = torch.bfloat16
FWD_CANDIDATES = [
    dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=4),
    dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
]
DKDV_CANDIDATES = [
    dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=2),
    dict(BLOCK_M=32, BLOCK_N=128, num_warps=8, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=128, num_warps=8, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
]
DQ_CANDIDATES = [
    dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=2),
    dict(BLOCK_M=128, BLOCK_N=32, num_warps=8, num_stages=3),
    dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
    dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
]


def _ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=10, rep=100, return_mode="median")


class Problem:
    """Dense causal batch as packed varlen tensors, plus the SDPA layout of the same data."""

    def __init__(self, batch: int, seqlen: int, n_heads: int, n_kv_heads: int, head_dim: int):
        gen = torch.Generator("cuda").manual_seed(0)
        total = batch * seqlen
        self.q = torch.randn(total, n_heads, head_dim, generator=gen, device="cuda", dtype=DTYPE)
        self.k = torch.randn(total, n_kv_heads, head_dim, generator=gen, device="cuda", dtype=DTYPE)
        self.v = torch.randn(total, n_kv_heads, head_dim, generator=gen, device="cuda", dtype=DTYPE)
        self.grad_out = torch.randn_like(self.q)
        self.cu = torch.arange(0, total + 1, seqlen, device="cuda", dtype=torch.int32)
        self.seqlen, self.batch, self.scale = seqlen, batch, 1 / math.sqrt(head_dim)
        self.out = torch.empty_like(self.q)
        self.lse = torch.empty(n_heads, total, device="cuda")
        self.grads = [torch.empty_like(t) for t in (self.q, self.k, self.v)]

        def dense(t):
            return t.view(batch, seqlen, t.shape[1], head_dim).transpose(1, 2).contiguous().requires_grad_()

        self.dq, self.dk, self.dv = dense(self.q), dense(self.k), dense(self.v)
        self.dense_grad = self.grad_out.view(batch, seqlen, n_heads, head_dim).transpose(1, 2).contiguous()

    def fwd(self):
        tk.attention_fwd(
            self.q, self.k, self.v, self.cu, self.cu, self.seqlen, self.seqlen, True, self.scale, self.out, self.lse
        )

    def bwd(self):
        tk.attention_bwd(
            self.grad_out,
            self.q,
            self.k,
            self.v,
            self.out,
            self.lse,
            None,
            self.cu,
            self.cu,
            self.seqlen,
            self.seqlen,
            True,
            self.scale,
            *self.grads,
        )

    def sdpa_fwd(self):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return scaled_dot_product_attention(self.dq, self.dk, self.dv, is_causal=True, enable_gqa=True)

    def sdpa_fwd_bwd(self):
        out = self.sdpa_fwd()
        return torch.autograd.grad(out, (self.dq, self.dk, self.dv), self.dense_grad)

    def prefill_decode_equal(self) -> bool:
        """Full prefill vs the last 3 tokens of sequence 0 decoded one at a time against its KV prefix."""
        self.fwd()
        for t in range(self.seqlen - 3, self.seqlen):
            cu_q = torch.tensor([0, 1], device="cuda", dtype=torch.int32)
            cu_k = torch.tensor([0, t + 1], device="cuda", dtype=torch.int32)
            out = torch.empty_like(self.q[t : t + 1])
            lse = torch.empty(self.q.shape[1], 1, device="cuda")
            tk.attention_fwd(
                self.q[t : t + 1].contiguous(),
                self.k[: t + 1].contiguous(),
                self.v[: t + 1].contiguous(),
                cu_q,
                cu_k,
                1,
                t + 1,
                True,
                self.scale,
                out,
                lse,
            )
            if not (torch.equal(out, self.out[t : t + 1]) and torch.equal(lse[:, 0], self.lse[:, t])):
                return False
        return True


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seqlen", type=int, default=4096)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    args = parser.parse_args()
    p = Problem(args.batch, args.seqlen, args.heads, args.kv_heads, args.head_dim)
    flops_fwd = 2 * 2 * args.seqlen**2 / 2 * args.head_dim * args.heads * args.batch
    flops_bwd = 2.5 * flops_fwd
    bucket = 64 if args.head_dim <= 64 else triton.next_power_of_2(args.head_dim)
    sdpa_f = _ms(p.sdpa_fwd)
    sdpa_fb = _ms(p.sdpa_fwd_bwd)
    print(
        f"SDPA flash: fwd {sdpa_f:.2f} ms ({flops_fwd / sdpa_f / 1e9:.0f} TFLOP/s), fwd+bwd {sdpa_fb:.2f} ms "
        f"({(flops_fwd + flops_bwd) / sdpa_fb / 1e9:.0f} TFLOP/s)"
    )
    shipped = {kind: dict(tk.TILE_CONFIGS[kind][DTYPE][bucket]) for kind in ("fwd", "dkdv", "dq")}
    for kind, candidates in (("fwd", FWD_CANDIDATES), ("dkdv", DKDV_CANDIDATES), ("dq", DQ_CANDIDATES)):
        for cfg in candidates:
            tk.TILE_CONFIGS[kind][DTYPE][bucket] = dict(cfg)
            try:
                p.fwd()
                ms = _ms(p.fwd) if kind == "fwd" else _ms(p.bwd)
                fwd_ms = _ms(p.fwd)
                bwd_ms = _ms(p.bwd)
                ok = p.prefill_decode_equal()
                total = fwd_ms + bwd_ms
                print(
                    f"{kind:5s} {cfg}: {ms:.2f} ms | fwd {fwd_ms:.2f} ({sdpa_f / fwd_ms:.2f}x SDPA) "
                    f"fwd+bwd {total:.2f} ({sdpa_fb / total:.2f}x SDPA) | prefill==decode {ok}"
                )
            except Exception as exc:  # a config that does not compile (shared memory) is reported, not fatal
                print(f"{kind:5s} {cfg}: failed: {type(exc).__name__}: {str(exc)[:100]}")
        tk.TILE_CONFIGS[kind][DTYPE][bucket] = shipped[kind]


if __name__ == "__main__":
    main()
