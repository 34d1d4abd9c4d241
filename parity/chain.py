"""The batch-invariant forward chain in the parity matrix: cases, inputs, calls, contract scales, invariance.

Ops: ``rms_norm`` (with the fused residual), ``matmul`` (through ``rlk.ops.matmul.linear`` with a bias),
``attention`` (packed varlen, causal, GQA), ``prefix_attention`` (GRPO groups: responses that read their
prompt's keys, mixed with ordinary sequences), ``softmax`` (and ``log_softmax``), ``rope`` (packed
``[T, H, D]`` layout), ``embedding`` and ``pack`` (padded ``[B, T, F]`` to varlen rows, with holes; its
forward also unpacks the result). Each is run in bf16, fp16 and fp32, forward and backward
(the loss ``sum(cotangent * output)`` with fixed random cotangents); ground truth is the same public
op on fp64 copies of the same values (the inputs as cast to the tested dtype), pinned to the reference
backend.

Scales (what each deviation is measured against; ``rlk/core/contract.json`` states them per op):

* ``rms_norm``, ``softmax``: per element ``1 + |ref|`` (``log_softmax``: ``1 + |ref| + |x|``,
  since fp32 rounds ``x - lse`` to ``|x - lse| 2^-24``);
* ``rope``: ``|x[a] cos[a]| + |x[b] sin[a]|`` per element (``rlk.reference.rope.error_scale``);
* ``matmul``: per element ``(|x| @ |W|^T) + |bias|``, the size of the terms the dot product adds;
* ``attention``: ``out``: per element ``1 + max |v|`` over the keys of the query's sequence and kv
  head; ``lse``: ``1 + |lse|``; ``prefix_attention`` the same over the query's logical keys (its prompt's, then
  its own);
* ``embedding``, ``pack``: ``1 + |ref|`` (the forward is a copy);
* every gradient: ``compare_grad`` with ``max_scale = 0`` (the relative L2 bound ``grad_rel_l2`` alone).

Batch invariance: a probe (one row, one token, one sequence for attention, one group for prefix_attention)
alone versus inside
batches at first, middle and last position; its outputs and its own input gradient rows must be
equal bit for bit (``torch.equal``). Weight gradients (sums over rows) are not per-row quantities
and are not part of the probe.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch

from parity.cases import generator
from rlk import use_backend as _use_backend
from rlk.core import contract
from rlk.reference import matmul as ref_matmul
from rlk.reference import rope as ref_rope

CHAIN_OPS = ("rms_norm", "matmul", "attention", "prefix_attention", "softmax", "rope", "embedding", "pack")
#: The public function each op is called through: (module, name).
_PUBLIC = {
    "rms_norm": ("rlk.ops.norm", "rms_norm"),
    "matmul": ("rlk.ops.matmul", "linear"),
    "attention": ("rlk.ops.attention", "attention"),
    "prefix_attention": ("rlk.ops.attention", "prefix_attention"),
    "softmax": ("rlk.ops.softmax", "softmax"),
    "log_softmax": ("rlk.ops.softmax", "log_softmax"),
    "rope": ("rlk.ops.rope", "apply_rope"),
    "embedding": ("rlk.ops.embedding", "embedding"),
    "pack": ("rlk.ops.pack", "pack"),
    "unpack": ("rlk.ops.pack", "unpack"),
}


def _public(name: str) -> Callable:
    module, function = _PUBLIC[name]
    return getattr(importlib.import_module(module), function)


#: Problem sizes per op and device type (see :func:`_describe` for what each tuple means).
SIZES: dict[str, dict[str, tuple]] = {
    "rms_norm": {"cuda": ((1, 4096), (133, 4096), (4096, 5120)), "cpu": ((1, 64), (7, 96), (33, 64))},
    "matmul": {
        "cuda": ((1, 4096, 4096), (133, 4096, 12288), (4096, 12288, 4096)),
        "cpu": ((1, 64, 80), (7, 72, 80), (33, 64, 96)),
    },
    # attention: (sequence lengths (queries = keys), Hq, Hkv, D)
    "attention": {
        "cuda": (((4096,), 32, 8, 128), ((1, 77, 1000, 3000), 16, 4, 64), ((513, 2048), 8, 8, 128)),
        "cpu": (((1, 5, 37), 4, 2, 64), ((70,), 2, 1, 64)),
    },
    # prefix_attention: (groups (prompt length, response lengths); no responses: an ordinary sequence, Hq, Hkv, D);
    # queries = own keys per sequence
    "prefix_attention": {
        "cuda": (
            (((1000, (1000, 1, 700, 0)), (300, ()), (2048, (513, 2048))), 16, 4, 128),
            (((77, (77,) * 8), (4096, ())), 32, 8, 128),
        ),
        "cpu": ((((37, (23, 0, 40)), (5, ()), (19, (19, 1))), 4, 2, 64), (((21, (17, 30)),), 2, 1, 64)),
    },
    "softmax": {"cuda": ((7, 151936), (133, 32000)), "cpu": ((7, 1000), (33, 300))},
    # rope: (T tokens, Hq, Hk, D)
    "rope": {"cuda": ((4096, 32, 8, 128), (7, 16, 4, 64)), "cpu": ((33, 4, 2, 64), (5, 2, 2, 16))},
    # embedding: (N ids, V, H)
    "embedding": {"cuda": ((16384, 32000, 1024), (7, 151936, 256)), "cpu": ((33, 128, 64), (300, 17, 32))},
    # pack: (B rows, T tokens, F trailing elements)
    "pack": {"cuda": ((64, 2048, 512), (7, 300, 8)), "cpu": ((5, 9, 4), (3, 17, 1))},
}
VARIANTS: dict[str, tuple[tuple[str, tuple], ...]] = {
    "rms_norm": (
        ("llama", (("gemma", False), ("residual", False))),
        ("residual", (("gemma", False), ("residual", True))),
        ("gemma", (("gemma", True), ("residual", False))),
    ),
    "matmul": (("linear+bias", ()),),
    "attention": (("causal", (("causal", True),)),),
    "prefix_attention": (("causal", (("causal", True),)),),
    "softmax": (("softmax", (("log", False),)), ("log_softmax", (("log", True),))),
    "rope": (("rotate-half", (("interleaved", False),)), ("interleaved", (("interleaved", True),))),
    "embedding": (("ids", ()),),
    "pack": (("holes", ()),),
}
INVARIANCE_BATCHES = {"cuda": (7, 133, 1024), "cpu": (7, 33)}
QUICK_INVARIANCE_BATCHES = (7,)
EPS = 1e-6


@dataclass(frozen=True)
class ChainCase:
    """One value case of a chain op: a size tuple and a variant (keyword parameters)."""

    op: str
    size: tuple
    variant: str
    params: tuple[tuple[str, object], ...] = ()

    @property
    def kwargs(self) -> dict:
        return dict(self.params)

    def label(self) -> str:
        return f"{_describe(self.op, self.size)} [{self.variant}]"


def _describe(op: str, size: tuple) -> str:
    if op == "rms_norm":
        return f"N={size[0]} H={size[1]}"
    if op == "matmul":
        return f"M={size[0]} K={size[1]} N={size[2]}"
    if op == "attention":
        lengths, hq, hkv, d = size
        return f"lengths={','.join(map(str, lengths))} Hq={hq} Hkv={hkv} D={d}"
    if op == "prefix_attention":
        groups, hq, hkv, d = size
        spelled = " ".join(f"{p}+[{','.join(map(str, r))}]" if r else str(p) for p, r in groups)
        return f"groups={spelled} Hq={hq} Hkv={hkv} D={d}"
    if op == "softmax":
        return f"N={size[0]} V={size[1]}"
    if op == "rope":
        return f"T={size[0]} Hq={size[1]} Hk={size[2]} D={size[3]}"
    if op == "pack":
        return f"B={size[0]} T={size[1]} F={size[2]}"
    return f"N={size[0]} V={size[1]} H={size[2]}"


def value_cases(op: str, device_type: str, quick: bool) -> list[ChainCase]:
    """Every variant of ``op`` on every size (quick: the first size, every variant)."""
    sizes = SIZES[op][device_type][:1] if quick else SIZES[op][device_type]
    return [ChainCase(op, size, label, params) for size in sizes for label, params in VARIANTS[op]]


# ---------------------------------------------------------------------------
# inputs: fp64 CPU tensors (int64 ids, int32 cu_seqlens), cast per dtype
# ---------------------------------------------------------------------------


def _rope_tables(t: int, d: int, interleaved: bool, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.randint(0, 32768, (t,), generator=gen).double()
    inv_freq = 1.0 / (1e6 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    angles = positions[:, None] * inv_freq[None, :]
    angles = angles.repeat_interleave(2, dim=1) if interleaved else torch.cat([angles, angles], dim=1)
    return angles.cos(), angles.sin()


def make_inputs(case: ChainCase, seed: int) -> dict[str, torch.Tensor]:
    """The fp64 inputs of a case and its cotangents (``cot_*``), on the CPU."""
    gen = generator(seed, f"chain {case.op} {case.label()}")
    op, size, kw = case.op, case.size, case.kwargs

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    if op == "rms_norm":
        n, h = size
        out = {"x": randn(n, h) * 2, "weight": 1 + 0.1 * randn(h), "cot_y": randn(n, h)}
        if kw["residual"]:
            out |= {"residual": randn(n, h), "cot_residual": randn(n, h)}
        return out
    if op == "matmul":
        m, k, n = size
        return {"x": randn(m, k), "weight": randn(n, k) / k**0.5, "bias": randn(n), "cot_y": randn(m, n)}
    if op == "attention":
        lengths, hq, hkv, d = size
        total = sum(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        return {
            "q": randn(total, hq, d),
            "k": randn(total, hkv, d),
            "v": randn(total, hkv, d),
            "cu_seqlens": cu,
            "cot_out": randn(total, hq, d),
            "cot_lse": randn(hq, total),
        }
    if op == "prefix_attention":
        groups, hq, hkv, d = size
        lengths, prefix, starts = _group_layout(groups)
        total = sum(lengths)
        cu = torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)
        return {
            "q": randn(total, hq, d),
            "k": randn(total, hkv, d),
            "v": randn(total, hkv, d),
            "cu_seqlens": cu,
            "prefix_index": torch.tensor(prefix, dtype=torch.int32),
            "group_starts": torch.tensor(starts, dtype=torch.int64),
            "cot_out": randn(total, hq, d),
            "cot_lse": randn(hq, total),
        }
    if op == "softmax":
        n, v = size
        return {"x": 3 * randn(n, v), "cot_y": randn(n, v)}
    if op == "rope":
        t, hq, hk, d = size
        cos, sin = _rope_tables(t, d, kw["interleaved"], gen)
        return {
            "q": randn(t, hq, d),
            "k": randn(t, hk, d),
            "cos": cos,
            "sin": sin,
            "cot_q": randn(t, hq, d),
            "cot_k": randn(t, hk, d),
        }
    if op == "pack":
        b, t, f = size
        mask = (torch.rand(b, t, generator=gen) < 0.7).long()  # right padding, left padding and holes alike
        return {"x": randn(b, t, f), "mask": mask, "cot_y": randn(int(mask.sum()), f)}
    n, v, h = size
    ids = torch.randint(0, v, (n,), generator=gen)
    ids[: n // 4] = ids[0]  # a repeated id: its gradient row sums many rows
    return {"ids": ids, "weight": randn(v, h), "cot_y": randn(n, h)}


def _group_layout(groups) -> tuple[list[int], list[int], list[int]]:
    """Sequence lengths, prefix_index and each group's first sequence (then the number of sequences) of
    ``groups``: ``(prompt length, response lengths)`` each, the prompt's sequence first."""
    lengths, prefix, starts = [], [], []
    for prompt, responses in groups:
        starts.append(len(lengths))
        first = len(lengths)
        lengths.append(prompt)
        prefix.append(-1)
        lengths += list(responses)
        prefix += [first] * len(responses)
    return lengths, prefix, [*starts, len(lengths)]


def cast(inputs: dict[str, torch.Tensor], dtype: torch.dtype, device: torch.device) -> dict[str, torch.Tensor]:
    """Floating tensors in ``dtype`` on ``device`` (ids and cu_seqlens keep theirs); rope's tables stay fp32
    (fp64 for the ground truth), as a model computes them."""
    out = {}
    for name, value in inputs.items():
        if not value.is_floating_point():
            out[name] = value.to(device)
        elif name in ("cos", "sin"):
            out[name] = value.to(device, torch.float64 if dtype == torch.float64 else torch.float32)
        else:
            out[name] = value.to(device, dtype)
    return out


# ---------------------------------------------------------------------------
# one call: outputs and gradients of the public op
# ---------------------------------------------------------------------------


@dataclass
class ChainOutputs:
    values: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.detach().clone().requires_grad_()


def forward_backward(op: str, params: dict, x: dict[str, torch.Tensor]) -> ChainOutputs:
    """The public op on the currently pinned backend, forward and backward."""
    fn = _public("log_softmax" if op == "softmax" and params["log"] else op)
    if op == "rms_norm":
        xx, w = _leaf(x["x"]), _leaf(x["weight"])
        if params["residual"]:
            res = _leaf(x["residual"])
            y, new_res = fn(xx, w, EPS, residual=res, gemma=params["gemma"])
            ((x["cot_y"] * y).sum() + (x["cot_residual"] * new_res).sum()).backward()
            return ChainOutputs(
                {"y": y.detach(), "residual": new_res.detach()},
                {"grad_x": xx.grad, "grad_weight": w.grad, "grad_residual": res.grad},
            )
        y = fn(xx, w, EPS, gemma=params["gemma"])
        (x["cot_y"] * y).sum().backward()
        return ChainOutputs({"y": y.detach()}, {"grad_x": xx.grad, "grad_weight": w.grad})
    if op == "matmul":
        xx, w, b = _leaf(x["x"]), _leaf(x["weight"]), _leaf(x["bias"])
        y = fn(xx, w, b)
        (x["cot_y"] * y).sum().backward()
        return ChainOutputs({"y": y.detach()}, {"grad_x": xx.grad, "grad_weight": w.grad, "grad_bias": b.grad})
    if op == "attention":
        q, k, v, cu = _leaf(x["q"]), _leaf(x["k"]), _leaf(x["v"]), x["cu_seqlens"]
        longest = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
        out, lse = fn(
            q,
            k,
            v,
            cu_seqlens_q=cu,
            cu_seqlens_k=cu,
            max_seqlen_q=longest,
            max_seqlen_k=longest,
            causal=params["causal"],
            return_lse=True,
        )
        ((x["cot_out"] * out).sum() + (x["cot_lse"].to(lse.dtype) * lse).sum()).backward()
        return ChainOutputs(
            {"out": out.detach(), "lse": lse.detach()}, {"grad_q": q.grad, "grad_k": k.grad, "grad_v": v.grad}
        )
    if op == "prefix_attention":
        q, k, v, cu = _leaf(x["q"]), _leaf(x["k"]), _leaf(x["v"]), x["cu_seqlens"]
        longest = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
        out, lse = fn(
            q,
            k,
            v,
            cu_seqlens_q=cu,
            cu_seqlens_k=cu,
            max_seqlen_q=longest,
            max_seqlen_k=longest,
            prefix_index=x["prefix_index"],
            causal=params["causal"],
            return_lse=True,
        )
        finite = torch.isfinite(lse.detach())
        ((x["cot_out"] * out).sum() + torch.where(finite, x["cot_lse"].to(lse.dtype) * lse, 0).sum()).backward()
        return ChainOutputs(
            {"out": out.detach(), "lse": lse.detach()}, {"grad_q": q.grad, "grad_k": k.grad, "grad_v": v.grad}
        )
    if op == "softmax":
        xx = _leaf(x["x"])
        y = fn(xx, dim=-1)
        (x["cot_y"] * y).sum().backward()
        return ChainOutputs({"y": y.detach()}, {"grad_x": xx.grad})
    if op == "rope":
        q, k = _leaf(x["q"]), _leaf(x["k"])
        q_out, k_out = fn(q, k, x["cos"], x["sin"], interleaved=params["interleaved"])
        ((x["cot_q"] * q_out).sum() + (x["cot_k"] * k_out).sum()).backward()
        return ChainOutputs({"q": q_out.detach(), "k": k_out.detach()}, {"grad_q": q.grad, "grad_k": k.grad})
    if op == "pack":
        xx = _leaf(x["x"])
        y, _, _ = fn(xx, x["mask"])
        (x["cot_y"] * y).sum().backward()
        unpacked = _public("unpack")(y.detach(), x["mask"])
        return ChainOutputs({"y": y.detach(), "unpacked": unpacked}, {"grad_x": xx.grad})
    w = _leaf(x["weight"])
    y = fn(x["ids"], w)
    (x["cot_y"] * y).sum().backward()
    return ChainOutputs({"y": y.detach()}, {"grad_weight": w.grad})


# ---------------------------------------------------------------------------
# ground truth and comparison
# ---------------------------------------------------------------------------


@dataclass
class ChainTruth:
    outputs: ChainOutputs
    scales: dict[str, torch.Tensor]


def _attention_scale(x: dict[str, torch.Tensor], hq: int) -> torch.Tensor:
    """``1 + max |v|`` over the keys of each query's sequence and kv head, as ``[total, Hq, 1]``."""
    v, cu = x["v"].abs(), x["cu_seqlens"].tolist()
    group = hq // v.shape[1]
    scale = torch.ones(v.shape[0], hq, 1, dtype=torch.float64, device=v.device)
    for start, end in zip(cu[:-1], cu[1:]):
        if end > start:
            per_head = v[start:end].amax(dim=(0, 2)).repeat_interleave(group)  # [Hq]
            scale[start:end, :, 0] += per_head[None, :]
    return scale


def _prefix_attention_scale(x: dict[str, torch.Tensor], hq: int) -> torch.Tensor:
    """``1 + max |v|`` over the logical keys (the prompt's, then its own) of each query's sequence and kv head."""
    v, cu, prefix = x["v"].abs(), x["cu_seqlens"].tolist(), x["prefix_index"].tolist()
    group = hq // v.shape[1]
    scale = torch.ones(v.shape[0], hq, 1, dtype=torch.float64, device=v.device)
    for b, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        keys = v[start:end] if prefix[b] < 0 else torch.cat([v[cu[prefix[b]] : cu[prefix[b] + 1]], v[start:end]])
        if end > start and keys.shape[0]:
            scale[start:end, :, 0] += keys.amax(dim=(0, 2)).repeat_interleave(group)[None, :]
    return scale


def scales(case: ChainCase, x: dict[str, torch.Tensor], truth: ChainOutputs) -> dict[str, torch.Tensor]:
    """The per-element scale of every output (module docstring), from the fp64 inputs and ground truth."""
    ref = truth.values
    if case.op == "matmul":
        return {"y": ref_matmul.error_scale(x["x"], x["weight"].T, x["bias"])}
    if case.op == "attention":
        return {"out": _attention_scale(x, x["q"].shape[1]).expand_as(ref["out"]), "lse": 1 + ref["lse"].abs()}
    if case.op == "prefix_attention":
        return {"out": _prefix_attention_scale(x, x["q"].shape[1]).expand_as(ref["out"]), "lse": 1 + ref["lse"].abs()}
    if case.op == "rope":
        interleaved = case.kwargs["interleaved"]
        return {
            "q": ref_rope.error_scale(x["q"], x["cos"], x["sin"], interleaved),
            "k": ref_rope.error_scale(x["k"], x["cos"], x["sin"], interleaved),
        }
    if case.op == "softmax" and case.kwargs["log"]:
        return {"y": 1 + ref["y"].abs() + x["x"].abs()}
    return {name: 1 + value.abs() for name, value in ref.items()}


def ground_truth(case: ChainCase, low: dict[str, torch.Tensor]) -> ChainTruth:
    """The public op on fp64 copies of the case's inputs as cast to the tested dtype (``low``: the same
    values the backend sees, so the input rounding is not counted against it), pinned to the reference
    backend, and the scales."""
    x64 = {name: value.double() if value.is_floating_point() else value for name, value in low.items()}
    with _use_backend("reference"):
        outputs = forward_backward(case.op, case.kwargs, x64)
    return ChainTruth(outputs, scales(case, x64, outputs))


def compare(case: ChainCase, dtype: torch.dtype, got: ChainOutputs, truth: ChainTruth) -> list[contract.Deviation]:
    """Every output (per element) and gradient (``compare_grad``, ``max_scale = 0``) under the contract."""
    entry = contract.entry(case.op, dtype)
    ref = truth.outputs
    deviations = [
        contract.compare_outputs(
            entry, name, got.values[name].reshape(-1), ref.values[name].reshape(-1), truth.scales[name].reshape(-1)
        )
        for name in ref.values
    ]
    deviations += [contract.compare_grad(entry, name, got.grads[name], ref.grads[name], 0.0) for name in ref.grads]
    return deviations


# ---------------------------------------------------------------------------
# invariance
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ChainInvariancePlan:
    """A probe (row, token or sequence) of ``case`` alone versus inside batches of ``batches``."""

    op: str
    case: ChainCase
    batches: tuple[int, ...]

    def positions(self, batch: int) -> tuple[int, ...]:
        return tuple(sorted({0, batch // 2, batch - 1}))

    def describe(self) -> str:
        return self.case.label()


#: The probe's case per op and device type: one row of the size (attention: one sequence of the first length).
_PROBE_SIZES = {
    "cuda": {
        "rms_norm": (1, 4096),
        "matmul": (1, 4096, 4096),
        "attention": ((1000,), 16, 4, 128),
        "prefix_attention": (((500, (700, 1000, 1)),), 16, 4, 128),
        "softmax": (1, 151936),
        "rope": (1, 32, 8, 128),
        "embedding": (1, 151936, 1024),
        "pack": (1, 2048, 512),
    },
    "cpu": {
        "rms_norm": (1, 96),
        "matmul": (1, 72, 80),
        "attention": ((37,), 4, 2, 64),
        "prefix_attention": (((37, (23, 40)),), 4, 2, 64),
        "softmax": (1, 1000),
        "rope": (1, 4, 2, 64),
        "embedding": (1, 128, 64),
        "pack": (1, 9, 4),
    },
}


def invariance_plan(op: str, device_type: str, quick: bool) -> ChainInvariancePlan:
    label, params = VARIANTS[op][1] if op == "rms_norm" else VARIANTS[op][0]  # rms_norm: with the residual
    case = ChainCase(op, _PROBE_SIZES[device_type][op], f"invariance {label}", params)
    return ChainInvariancePlan(op, case, QUICK_INVARIANCE_BATCHES if quick else INVARIANCE_BATCHES[device_type])


def _others(plan: ChainInvariancePlan, seed: int, batch: int) -> dict[str, torch.Tensor]:
    """``batch - 1`` other rows / tokens / sequences (different values) of the probe's problem."""
    op, size = plan.op, plan.case.size
    if op == "attention":
        gen = generator(seed, "chain attention others")
        lengths = torch.randint(1, 2 * size[0][0], (batch - 1,), generator=gen).tolist()
        size = (tuple(lengths), *size[1:])
    elif op == "prefix_attention":  # batch - 1 other groups (0 to 2 responses: some ordinary sequences)
        gen = generator(seed, "chain prefix_attention others")
        longest = 2 * size[0][0][0]
        prompts = torch.randint(1, longest, (batch - 1,), generator=gen).tolist()
        counts = torch.randint(0, 3, (batch - 1,), generator=gen).tolist()
        groups = tuple(
            (p, tuple(torch.randint(0, longest, (n,), generator=gen).tolist())) for p, n in zip(prompts, counts)
        )
        size = (groups, *size[1:])
    else:
        size = (batch - 1, *size[1:])
    return make_inputs(ChainCase(op, size, "others", plan.case.params), seed + 1)


def _embed(op: str, probe: dict, others: dict, position: int) -> tuple[dict, slice]:
    """The batch with the probe at ``position`` and the probe's rows (tokens) in it (pack: its packed tokens
    and its padded row)."""
    if op == "pack":
        start = int(others["mask"][:position].sum())
        length = int(probe["mask"].sum())
        batch = {
            name: torch.cat([others[name][:position], probe[name], others[name][position:]]) for name in ("x", "mask")
        }
        batch["cot_y"] = torch.cat([others["cot_y"][:start], probe["cot_y"], others["cot_y"][start:]])
        return batch, (slice(start, start + length), slice(position, position + 1))
    if op == "prefix_attention":
        return _embed_group(probe, others, position)
    if op != "attention":
        batch = {}
        for name, value in probe.items():
            if name in ("weight", "bias"):  # parameters: the probe's, shared by the batch
                batch[name] = value
            else:
                axis = 1 if name == "cot_lse" else 0
                batch[name] = torch.cat(
                    [
                        others[name].narrow(axis, 0, position),
                        value,
                        others[name].narrow(axis, position, others[name].shape[axis] - position),
                    ],
                    dim=axis,
                )
        return batch, slice(position, position + 1)
    lengths_others = (others["cu_seqlens"][1:] - others["cu_seqlens"][:-1]).tolist()
    start = sum(lengths_others[:position])
    length = int(probe["cu_seqlens"][-1])
    lengths = [*lengths_others[:position], length, *lengths_others[position:]]
    batch = {"cu_seqlens": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)}
    for name in ("q", "k", "v", "cot_out", "cot_lse"):
        axis = 1 if name == "cot_lse" else 0
        batch[name] = torch.cat(
            [
                others[name].narrow(axis, 0, start),
                probe[name],
                others[name].narrow(axis, start, others[name].shape[axis] - start),
            ],
            dim=axis,
        )
    return batch, slice(start, start + length)


def _embed_group(probe: dict, others: dict, position: int) -> tuple[dict, slice]:
    """prefix_attention's batch: the probe's group inserted before group ``position`` of ``others``, every
    prefix_index renumbered; and the probe's tokens in it (queries = keys per sequence)."""
    starts = others["group_starts"].tolist()
    seq = starts[position]
    start = int(others["cu_seqlens"][seq])
    lengths_others = (others["cu_seqlens"][1:] - others["cu_seqlens"][:-1]).tolist()
    lengths_probe = (probe["cu_seqlens"][1:] - probe["cu_seqlens"][:-1]).tolist()
    n_probe = len(lengths_probe)
    lengths = [*lengths_others[:seq], *lengths_probe, *lengths_others[seq:]]
    moved = [a + n_probe if a >= seq else a for a in others["prefix_index"].tolist()]
    prefix = [*moved[:seq], *[a + seq if a >= 0 else a for a in probe["prefix_index"].tolist()], *moved[seq:]]
    group_starts = [
        *starts[:position],
        *[s + seq for s in probe["group_starts"].tolist()[:-1]],
        *[s + n_probe for s in starts[position:]],
    ]
    batch = {
        "cu_seqlens": torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32),
        "prefix_index": torch.tensor(prefix, dtype=torch.int32),
        "group_starts": torch.tensor(group_starts, dtype=torch.int64),
    }
    for name in ("q", "k", "v", "cot_out", "cot_lse"):
        axis = 1 if name == "cot_lse" else 0
        batch[name] = torch.cat(
            [
                others[name].narrow(axis, 0, start),
                probe[name],
                others[name].narrow(axis, start, others[name].shape[axis] - start),
            ],
            dim=axis,
        )
    length = int(probe["cu_seqlens"][-1])
    return batch, slice(start, start + length)


def _probe_rows(op: str, out: ChainOutputs, rows) -> dict[str, torch.Tensor]:
    if op == "pack":  # rows: (packed tokens, padded rows), or one slice for both
        tokens, padded = rows if isinstance(rows, tuple) else (rows, rows)
        return {
            "y": out.values["y"][tokens],
            "unpacked": out.values["unpacked"][padded],
            "grad_x": out.grads["grad_x"][padded],
        }
    picked = {name: (value[:, rows] if name == "lse" else value[rows]) for name, value in out.values.items()}
    picked |= {name: value[rows] for name, value in out.grads.items() if name not in ("grad_weight", "grad_bias")}
    return picked


def invariance_checks(
    plan: ChainInvariancePlan,
    seed: int,
    backend: str,
    device: torch.device,
    dtype: torch.dtype,
    record: Callable[[int, int, list[str]], None],
) -> None:
    """Run the probe of ``plan`` on ``backend``; ``record(batch, position, differing outputs)`` per check."""
    probe = make_inputs(plan.case, seed)
    params = plan.case.kwargs
    with _use_backend(backend):
        alone = _probe_rows(plan.op, forward_backward(plan.op, params, cast(probe, dtype, device)), slice(None))
        for batch in plan.batches:
            others = _others(plan, seed, batch)
            for position in plan.positions(batch):
                inputs, rows = _embed(plan.op, probe, others, position)
                got = _probe_rows(plan.op, forward_backward(plan.op, params, cast(inputs, dtype, device)), rows)
                record(batch, position, [name for name, value in alone.items() if not torch.equal(value, got[name])])
