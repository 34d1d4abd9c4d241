"""Run every rlk-cuda kernel once at small shapes, for compute-sanitizer (tools/cuda_sanitize.sh).

Covers: selected_logprob fwd / bwd for fp32, fp16, bf16, with and without entropy, ignored rows,
vocab sizes that are not pack multiples, unaligned row starts; rms_norm fwd / bwd for every
(x, weight, y) dtype triple, fused and unfused, Gemma, with and without grad_weight, rows in registers
(whole and partial packs, teams of a few lanes, one warp, several warps) and chunked rows, unaligned
rows; linear_logprob fwd / bwd for fp16 and bf16 on each kernel pair that can run (mma.sync; wgmma on
sm_90a), with and without entropy, each gradient optional, ignored rows, N / V not multiples of the tiles,
several vocab splits / chunks with a ragged last one, H = 36 (padded by the primitive), unaligned views.
Run with PYTORCH_NO_CUDA_MEMORY_CACHING=1 so every tensor is its own allocation and an out-of-bounds access
lands outside it. Exits non-zero if a result is not finite
where it must be (a cheap sanity check; the sanitizer does the real checking).
"""

from __future__ import annotations

import sys

import torch

from rlk_cuda import logprob, norm

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def unaligned_empty(shape, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized CUDA tensor (an output buffer) whose data starts one element past an allocation's start."""
    numel = 1
    for size in shape:
        numel *= size
    return torch.empty(numel + 1, dtype=dtype, device="cuda")[1:].view(shape)


def unaligned(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` whose data starts one element past an allocation's start."""
    view = unaligned_empty(t.shape, t.dtype)
    view.copy_(t)
    return view


def row_inputs(n: int, v: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Targets in [0, v) with row 1 ignored (-100) when n >= 3, and inverse temperatures in [0.5, 1.5)."""
    targets = torch.randint(0, v, (n,), device="cuda")
    if n >= 3:
        targets[1] = -100
    return targets, torch.rand(n, device="cuda") + 0.5


def logprob_cases() -> int:
    bad = 0
    for dtype in DTYPES:
        for n, v in ((1, 1), (3, 7), (5, 300), (4, 2053), (3, 8192), (2, 10007)):
            for shift in (False, True):
                x = (torch.randn(n, v, device="cuda") * 3).to(dtype)
                x = unaligned(x) if shift else x
                targets, inv_t = row_inputs(n, v)
                for entropy in (False, True):
                    lp, ent, lse = (torch.empty(n, device="cuda") for _ in range(3))
                    logprob.selected_logprob_fwd(x, targets, inv_t, -100, lp, ent if entropy else None, lse)
                    grad = unaligned_empty(x.shape, x.dtype) if shift else torch.empty_like(x)
                    g_lp, g_ent = torch.randn(2, n, device="cuda")
                    logprob.selected_logprob_bwd(
                        x, targets, inv_t, lse, ent if entropy else None, g_lp, g_ent if entropy else None, -100, grad
                    )
                    torch.cuda.synchronize()
                    bad += int(not torch.isfinite(lp).all()) + int(not torch.isfinite(grad.float()).all())
    return bad


def norm_cases() -> int:
    bad = 0
    for dtype in DTYPES:
        for w_dtype in (dtype, torch.float32):
            for gemma in (False, True):
                y_dtype = dtype if gemma else torch.promote_types(dtype, w_dtype)
                # 64 / 1024 / 8192 columns: register kernels on whole packs (rows of a few lanes, of one warp,
                # of several warps; the 8192-column backward block opts into > 48 KiB of shared memory for
                # 16-bit x); 1 / 7 / unaligned 1000: partial packs; 9000 / 20000 columns: the chunked kernels
                for n, h in ((1, 1), (3, 7), (33, 64), (6, 1024), (5, 8192), (17, 1000), (5, 9000), (3, 20000)):
                    for fused in (False, True):
                        x = torch.randn(n, h, device="cuda").to(dtype)
                        x = unaligned(x) if h == 1000 else x
                        w = (torch.randn(h, device="cuda") * 0.1 + 1).to(w_dtype)
                        r = torch.randn(n, h, device="cuda").to(dtype) if fused else None
                        y = torch.empty(n, h, dtype=y_dtype, device="cuda")
                        s = torch.empty_like(x) if fused else None
                        rstd = torch.empty(n, device="cuda")
                        norm.rms_norm_fwd(x, w, r, 1e-6, gemma, y, s, rstd)
                        gy = torch.randn(n, h, device="cuda").to(y_dtype)
                        gres = torch.randn(n, h, device="cuda").to(dtype) if fused else None
                        gin = torch.empty_like(x)
                        for want_dw in (False, True):
                            gw = torch.empty_like(w) if want_dw else None
                            norm.rms_norm_bwd(gy, s if fused else x, w, rstd, gemma, gres, gin, gw)
                            torch.cuda.synchronize()
                            bad += int(not torch.isfinite(gin.float()).all())
                            bad += int(want_dw and not torch.isfinite(gw.float()).all())
                        bad += int(not torch.isfinite(y.float()).all())
    return bad


def linear_logprob_cases() -> int:
    """Every case on each kernel pair that can run here: mma.sync, and the Hopper (wgmma) pair on sm_90a."""
    kernels = ["mma"] + (["wgmma"] if logprob.wgmma_problem(torch.device("cuda")) is None else [])
    return sum(linear_logprob_cases_on(kernel) for kernel in kernels)


def linear_logprob_cases_on(kernel: str) -> int:
    fwd = getattr(logprob, f"linear_logprob_fwd_{kernel}")
    bwd = getattr(logprob, f"linear_logprob_bwd_{kernel}")
    bad = 0
    for dtype in (torch.float16, torch.bfloat16):
        # (N, V, H): one tile; ragged rows / vocab and 2 chunks (8200 > 4096); padded H; 2 row tiles, 2 K steps
        for n, v, h in ((1, 5, 8), (7, 300, 64), (3, 8200, 64), (5, 1000, 36), (133, 700, 128)):
            for shift in (False, True):
                hidden = torch.randn(n, h, device="cuda").to(dtype)
                weight = (torch.randn(v, h, device="cuda") / h**0.5).to(dtype)
                if shift:
                    hidden, weight = unaligned(hidden), unaligned(weight)
                targets, inv_t = row_inputs(n, v)
                for entropy in (False, True):
                    lp, ent, lse = (torch.empty(n, device="cuda") for _ in range(3))
                    fwd(hidden, weight, targets, inv_t, -100, lp, ent if entropy else None, lse)
                    g_lp, g_ent = torch.randn(2, n, device="cuda")
                    for want_h, want_w in ((True, True), (True, False), (False, True)):
                        gh = torch.empty_like(hidden) if want_h else None
                        gw = torch.empty_like(weight) if want_w else None
                        bwd(
                            hidden,
                            weight,
                            targets,
                            inv_t,
                            lse,
                            ent if entropy else None,
                            g_lp,
                            g_ent if entropy else None,
                            -100,
                            gh,
                            gw,
                        )
                        torch.cuda.synchronize()
                        bad += int(want_h and not torch.isfinite(gh.float()).all())
                        bad += int(want_w and not torch.isfinite(gw.float()).all())
                    bad += int(not torch.isfinite(lp).all()) + int(not torch.isfinite(lse).all())
    return bad


def main() -> int:
    torch.manual_seed(0)
    bad = logprob_cases() + linear_logprob_cases() + norm_cases()
    print(f"sanitize_cases: done, {bad} non-finite results")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
