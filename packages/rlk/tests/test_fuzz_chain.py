"""Property-based fuzzing of the batch-invariant forward chain: ``rms_norm``, ``linear``, ``matmul``, ``attention``
(packed varlen, GQA, causal, LSE), ``apply_rope``, ``softmax``, ``log_softmax`` and ``embedding`` (profiles,
backends and repro lines: ``fuzz_support.py``; what is fuzzed and how to run it: ``docs/fuzzing.md``).

Properties (each a test; every backend that implements the op, batch invariance on those declaring it):

* agreement with the fp64 ground truth (the public op on fp64 copies of the inputs *as cast to the tested
  dtype*, pinned to the reference backend) under the contract, forward and backward of ``sum(cotangent *
  output)``, with the scales of the contract entries (as the parity suite, ``parity/chain.py``: ``1 + |ref|``;
  ``rlk.reference.matmul.error_scale``; ``rlk.reference.rope.error_scale``; attention ``1 + max |v|`` over the
  query's keys and ``1 + |lse|``; log_softmax ``1 + |ref| + |x|``; every gradient by relative L2); finite
  outputs and gradients; documented exact values (rms_norm's new residual is torch's ``x + residual``,
  attention rows that see no key give ``out = 0``, ``lse = -inf`` and no gradient, softmax in ``[0, 1]``,
  log_softmax ``<= 0``, embedding's forward is a bitwise copy and ``padding_idx`` gets no gradient);
* batch invariance: a row (token) alone versus at a random position among other rows; an attention sequence
  alone versus packed among others, and a chunk of a causal prefill (a decode step for one query) versus the
  full prefill; embedding's weight gradient is deterministic.

Exclusions: attention scores stay within about +-30 (the contract's fp32 entry holds up to about 60);
softmax slices are never all ``-inf`` (NaN by definition, as torch). Under the Triton CPU interpreter these
ops decline bfloat16 (``rlk_triton._NO_BF16_ON_CPU``), so bf16 is drawn only where the backend serves it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch
from fuzz_support import (
    DEVICE,
    DTYPES,
    FILTERS,
    backends,
    check_equal,
    check_finite,
    check_grad,
    check_value,
    dtype_names,
    fuzz_run,
    generator,
    limit,
    on_backend,
    on_reference,
    seeds,
    sizes,
)
from hypothesis import strategies as st

import rlk
from rlk.core import contract
from rlk.ops.norm import output_dtype
from rlk.reference import matmul as ref_matmul
from rlk.reference import rope as ref_rope

pytestmark = FILTERS


def randn(gen: torch.Generator, *shape: int) -> torch.Tensor:
    return torch.randn(shape, generator=gen, dtype=torch.float64)


def leaves(x: dict[str, torch.Tensor], names: tuple[str, ...]) -> dict[str, torch.Tensor]:
    return {name: x[name].detach().clone().requires_grad_() for name in names if name in x}


def grads(leaf: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {f"grad_{name}": (t.grad if t.grad is not None else torch.zeros_like(t)) for name, t in leaf.items()}


def low_and_exact(x: dict[str, torch.Tensor], dtype: str, keep: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """The inputs cast to ``dtype`` on the device (``keep``: left as they are, e.g. fp32 tables) and fp64 copies
    of those values (the ground truth's inputs: the input rounding is not charged to the op)."""
    low = {
        name: (v.to(DEVICE, DTYPES[dtype]) if v.is_floating_point() and name not in keep else v.to(DEVICE))
        for name, v in x.items()
    }
    exact = {name: (v.double() if v.is_floating_point() else v) for name, v in low.items()}
    return low, exact


def check_against_truth(
    op: str,
    dtype: str,
    got: tuple[dict, dict],
    truth: tuple[dict, dict],
    scales: dict,
    grad_scale: float = 0.0,
    magnitudes: dict | None = None,
) -> None:
    """Every output (``scales[name]``) and gradient (relative L2, ``max_scale = grad_scale``; ``magnitudes[name]``:
    the gradient's terms by absolute value, where they may cancel) under the contract."""
    entry = contract.entry(op, DTYPES[dtype])
    (values, gradients), (ref_values, ref_gradients) = got, truth
    for name, ref in ref_values.items():
        check_finite(name, values[name], torch.isfinite(ref))
        check_value(entry, name, values[name], ref, scales[name])
    for name, ref in ref_gradients.items():
        check_finite(name, gradients[name])
        check_grad(entry, name, gradients[name], ref, grad_scale, (magnitudes or {}).get(name))


# =============================================================================================
# rms_norm
# =============================================================================================


@dataclass(frozen=True)
class NormCase:
    """``rms_norm`` of ``[rows, h]`` (``lead``: ``[2, rows, h]``) inputs."""

    rows: int
    h: int
    seed: int
    dtype: str = "float32"
    weight_fp32: bool = False  # an fp32 weight with 16-bit x
    residual: bool = False
    gemma: bool = False
    eps: float = 1e-6
    scale: float = 1.0
    zero_row: bool = False  # row 0 all zeros (needs eps > 0)
    lead: bool = False


@st.composite
def norm_cases(draw, backend: str, one_row: bool = False) -> NormCase:
    eps = draw(st.sampled_from([1e-6, 1e-5, 0.0, 1.0]))
    return NormCase(
        rows=1 if one_row else draw(sizes(0, limit(backend, 9, 512))),
        h=draw(sizes(1, limit(backend, 300, 8192))),
        seed=draw(seeds),
        dtype=draw(st.sampled_from(dtype_names(backend, "rms_norm"))),
        weight_fp32=draw(st.booleans()),
        residual=draw(st.booleans()),
        gemma=draw(st.booleans()),
        eps=eps,
        scale=draw(st.sampled_from([1.0, 1e-3, 100.0])),
        zero_row=eps > 0 and draw(st.booleans()),
        lead=False if one_row else draw(st.booleans()),
    )


def norm_inputs(case: NormCase) -> tuple[dict, dict]:
    g = generator(case.seed)
    shape = (2, case.rows, case.h) if case.lead else (case.rows, case.h)
    x = {
        "x": randn(g, *shape) * case.scale,
        "weight": (0.0 if case.gemma else 1.0) + 0.3 * randn(g, case.h),
        "cot_y": randn(g, *shape),
    }
    if case.zero_row and case.rows:
        x["x"][..., 0, :] = 0.0
    if case.residual:
        x |= {"residual": randn(g, *shape) * case.scale, "cot_residual": randn(g, *shape)}
    low, exact = low_and_exact(x, case.dtype)
    if case.weight_fp32:
        low["weight"] = exact["weight"].float()
    return low, exact


def norm_call(x: dict, case: NormCase) -> tuple[dict, dict]:
    leaf = leaves(x, ("x", "weight", "residual"))
    out = rlk.rms_norm(leaf["x"], leaf["weight"], case.eps, residual=leaf.get("residual"), gemma=case.gemma)
    y, new_residual = out if case.residual else (out, None)
    loss = (x["cot_y"].to(y.dtype) * y).sum()
    values = {"y": y.detach()}
    if case.residual:
        loss = loss + (x["cot_residual"].to(new_residual.dtype) * new_residual).sum()
        values["residual"] = new_residual.detach()
    loss.backward()
    return values, grads(leaf)


def check_rms_norm_matches_reference(backend: str, case: NormCase) -> None:
    """y (its dtype as HF's modules give it), the new residual (bitwise torch's ``x + residual``) and the
    gradients against the fp64 ground truth under the contract (``1 + |ref|``; relative L2)."""
    low, exact = norm_inputs(case)
    with on_backend(backend):
        got = norm_call(low, case)
    with on_reference():
        truth = norm_call(exact, case)
    want_dtype = output_dtype(low["x"].dtype, low["weight"].dtype, case.gemma)
    assert got[0]["y"].dtype == want_dtype, f"y: dtype {got[0]['y'].dtype}, expected {want_dtype}"
    if case.residual:
        check_equal("residual vs torch's x + residual", got[0]["residual"], low["x"] + low["residual"])
    scales = {name: 1.0 + ref.abs() for name, ref in truth[0].items()}
    check_against_truth("rms_norm", case.dtype, got, truth, scales, magnitudes=rms_norm_grad_magnitudes(exact, case))


def rms_norm_grad_magnitudes(x: dict, case: NormCase) -> dict[str, torch.Tensor]:
    """The terms of rms_norm's gradients by absolute value (fp64): with ``n = s rstd`` and ``w' = w`` (Gemma:
    ``1 + w``), ``grad_s = rstd (w' g - n mean(w' g n))`` sums ``rstd (|w' g| + |n| mean(|w' g n|))`` (they cancel
    almost exactly at one feature), ``grad_w = sum_rows g n`` sums ``|g n|``."""
    s = x["x"] + x["residual"] if case.residual else x["x"]
    rstd = torch.rsqrt((s * s).mean(-1, keepdim=True) + case.eps)
    n, w = s * rstd, (1.0 + x["weight"]) if case.gemma else x["weight"]
    wg = (w * x["cot_y"]).abs()
    grad_s = rstd * (wg + n.abs() * (wg * n.abs()).mean(-1, keepdim=True))
    if case.residual:
        grad_s = grad_s + x["cot_residual"].abs()
    out = {"grad_x": grad_s, "grad_weight": (x["cot_y"] * n).abs().reshape(-1, s.shape[-1]).sum(0)}
    if case.residual:
        out["grad_residual"] = grad_s
    return out


def check_rms_norm_batch_invariance(backend: str, case) -> None:
    """A row alone versus at a random position among other rows: bitwise equal y, residual and input-gradient
    rows."""
    probe, x = case.probe, norm_inputs(case.probe)[0]
    others = norm_inputs(replace(probe, rows=case.others, seed=case.seed, zero_row=False))[0]
    batch = {
        name: (v if name == "weight" else torch.cat([others[name][: case.position], v, others[name][case.position :]]))
        for name, v in x.items()
    }
    with on_backend(backend):
        alone = norm_call(x, probe)
        inside = norm_call(batch, probe)
    row = slice(case.position, case.position + 1)
    for part_alone, part_inside in zip(alone, inside):
        for name, value in part_alone.items():
            if name != "grad_weight":  # a sum over rows
                check_equal(f"{name} of the row", part_inside[name][row], value)


@dataclass(frozen=True)
class ChainRowInBatch:
    """A one-row probe case among ``others`` other rows (own values from ``seed``) at ``position``."""

    probe: object
    others: int
    position: int
    seed: int


@st.composite
def chain_rows_in_batch(draw, probe: st.SearchStrategy, max_others: int) -> ChainRowInBatch:
    case = draw(probe)
    others = draw(sizes(1, max_others))
    return ChainRowInBatch(case, others, draw(st.integers(0, others)), draw(seeds))


@pytest.mark.parametrize("backend", backends("rms_norm"))
def test_rms_norm_matches_reference(backend):
    fuzz_run(check_rms_norm_matches_reference, backend, norm_cases(backend), ci=5)


@pytest.mark.parametrize("backend", backends("rms_norm", invariant_only=True))
def test_rms_norm_batch_invariance(backend):
    fuzz_run(
        check_rms_norm_batch_invariance,
        backend,
        chain_rows_in_batch(norm_cases(backend, one_row=True), limit(backend, 9, 512)),
        ci=3,
    )


# =============================================================================================
# linear and matmul
# =============================================================================================


@dataclass(frozen=True)
class MatmulCase:
    """``linear(x[m, k], w[n, k], bias)`` (``lead``: x ``[2, m, k]``), ``matmul(a[m, k], b[k, n])`` or the
    batched ``matmul(a[batch, m, k], b[batch, k, n])``."""

    form: str  # "linear", "matmul", "bmm"
    m: int
    k: int
    n: int
    seed: int
    dtype: str = "float32"
    batch: int = 1
    bias: bool = False
    lead: bool = False
    column_major: bool = False  # the second operand as a column-major view
    scale: float = 1.0


@st.composite
def matmul_cases(draw, backend: str, one_row: bool = False) -> MatmulCase:
    form = "linear" if one_row else draw(st.sampled_from(["linear", "matmul", "bmm"]))
    return MatmulCase(
        form=form,
        m=1 if one_row else draw(sizes(0, limit(backend, 33, 512))),
        k=draw(sizes(0, limit(backend, 65, 2048))),
        n=draw(sizes(0, limit(backend, 65, 2048))),
        seed=draw(seeds),
        dtype=draw(st.sampled_from(dtype_names(backend, "matmul"))),
        batch=draw(sizes(1, 3)) if form == "bmm" else 1,
        bias=form == "linear" and draw(st.booleans()),
        lead=form == "linear" and not one_row and draw(st.booleans()),
        column_major=draw(st.booleans()),
        scale=draw(st.sampled_from([1.0, 1e-3, 30.0])),
    )


def matmul_inputs(case: MatmulCase) -> tuple[dict, dict]:
    g = generator(case.seed)
    m, k, n = case.m, case.k, case.n
    if case.form == "linear":
        a_shape = (2, m, k) if case.lead else (m, k)
        x = {
            "a": randn(g, *a_shape) * case.scale,
            "b": randn(g, n, k) / math.sqrt(max(k, 1)),
            "cot": randn(g, *a_shape[:-1], n),
        }
        if case.bias:
            x["bias"] = randn(g, n)
    else:
        lead = (case.batch,) if case.form == "bmm" else ()
        x = {
            "a": randn(g, *lead, m, k) * case.scale,
            "b": randn(g, *lead, k, n) / math.sqrt(max(k, 1)),
            "cot": randn(g, *lead, m, n),
        }
    low, exact = low_and_exact(x, case.dtype)
    if case.column_major:  # the same values, column-major storage
        for pair in (low, exact):
            pair["b"] = pair["b"].transpose(-1, -2).contiguous().transpose(-1, -2)
    return low, exact


def matmul_call(x: dict, case: MatmulCase) -> tuple[dict, dict]:
    leaf = leaves(x, ("a", "b", "bias"))
    if case.form == "linear":
        y = rlk.linear(leaf["a"], leaf["b"], leaf.get("bias"))
    else:
        y = rlk.matmul(leaf["a"], leaf["b"])
    (x["cot"].to(y.dtype) * y).sum().backward()
    return {"y": y.detach()}, grads(leaf)


def matmul_scale(exact: dict, case: MatmulCase) -> torch.Tensor:
    """``(|a| @ |b|) + |bias|`` per output element (``rlk.reference.matmul.error_scale``)."""
    a, b = exact["a"], exact["b"]
    if case.form == "linear":
        flat = a.reshape(math.prod(a.shape[:-1]), case.k)
        return ref_matmul.error_scale(flat, b.T, exact.get("bias")).reshape(*a.shape[:-1], case.n)
    if case.form == "matmul":
        return ref_matmul.error_scale(a, b)
    return torch.stack([ref_matmul.error_scale(a[i], b[i]) for i in range(case.batch)])


def check_matmul_matches_reference(backend: str, case: MatmulCase) -> None:
    """The product and its gradients against the fp64 ground truth under the contract (per element
    ``(|a| @ |b|) + |bias|``; gradients by relative L2); K = 0 gives zeros, empty M or N empty results."""
    low, exact = matmul_inputs(case)
    with on_backend(backend):
        got = matmul_call(low, case)
    with on_reference():
        truth = matmul_call(exact, case)
    assert got[0]["y"].dtype == DTYPES[case.dtype]
    check_against_truth("matmul", case.dtype, got, truth, {"y": matmul_scale(exact, case)})
    if case.k == 0:
        check_equal("K = 0", got[0]["y"], torch.zeros_like(got[0]["y"]) + (low["bias"] if case.bias else 0))


def check_linear_batch_invariance(backend: str, case: ChainRowInBatch) -> None:
    """A row of ``linear`` alone versus at a random position among other rows: bitwise equal output and
    input-gradient rows."""
    probe, x = case.probe, matmul_inputs(case.probe)[0]
    others = matmul_inputs(replace(probe, m=case.others, seed=case.seed))[0]
    batch = {
        name: (
            v if name in ("b", "bias") else torch.cat([others[name][: case.position], v, others[name][case.position :]])
        )
        for name, v in x.items()
    }
    with on_backend(backend):
        alone = matmul_call(x, probe)
        inside = matmul_call(batch, probe)
    row = slice(case.position, case.position + 1)
    check_equal("y of the row", inside[0]["y"][row], alone[0]["y"])
    check_equal("grad_a of the row", inside[1]["grad_a"][row], alone[1]["grad_a"])


@pytest.mark.parametrize("backend", backends("matmul"))
def test_matmul_and_linear_match_reference(backend):
    fuzz_run(check_matmul_matches_reference, backend, matmul_cases(backend), ci=5)


@pytest.mark.parametrize("backend", backends("matmul", invariant_only=True))
def test_linear_batch_invariance(backend):
    fuzz_run(
        check_linear_batch_invariance,
        backend,
        chain_rows_in_batch(matmul_cases(backend, one_row=True), limit(backend, 33, 512)),
        ci=3,
    )


# =============================================================================================
# attention
# =============================================================================================


@dataclass(frozen=True)
class AttentionCase:
    """Packed varlen attention: per sequence ``lengths_q[b]`` queries and ``lengths_k[b]`` keys."""

    lengths_q: tuple[int, ...]
    lengths_k: tuple[int, ...]
    hkv: int
    group: int  # query heads per kv head (Hq = hkv * group)
    d: int
    seed: int
    dtype: str = "float32"
    causal: bool = True
    softmax_scale: float | None = None
    score: float = 1.0  # q and k standard deviation (scores ~ score^2 * N(0, 1))
    slack: int = 0  # max_seqlen_* exceed the longest sequence by this much

    @property
    def hq(self) -> int:
        return self.hkv * self.group


@st.composite
def attention_cases(draw, backend: str, prefill: bool = False) -> AttentionCase:
    """``prefill``: one causal sequence with as many queries as keys (the probe of the invariance checks)."""
    n_max = limit(backend, 40, 1100)
    if prefill:
        lengths_k = (draw(sizes(1, n_max)),)
        lengths_q = lengths_k
    else:
        lengths_k = tuple(draw(st.lists(sizes(0, n_max), min_size=0, max_size=limit(backend, 3, 8))))
        shape = draw(st.sampled_from(["prefill", "chunk", "any"]))
        if shape == "prefill":
            lengths_q = lengths_k
        elif shape == "chunk":  # a chunk of queries against a cache holding the earlier tokens (decode: 1 query)
            lengths_q = tuple(draw(st.integers(min(1, n), n)) for n in lengths_k)
        else:
            lengths_q = tuple(draw(sizes(0, n_max)) for _ in lengths_k)
    return AttentionCase(
        lengths_q=lengths_q,
        lengths_k=lengths_k,
        hkv=draw(st.sampled_from([1, 2, 3])),
        group=draw(st.sampled_from([1, 2, 4])),
        d=draw(sizes(1, limit(backend, 64, 256))),
        seed=draw(seeds),
        dtype=draw(st.sampled_from(dtype_names(backend, "attention"))),
        causal=True if prefill else draw(st.booleans()),
        softmax_scale=draw(st.sampled_from([None, 0.05, 1.0])),
        score=draw(st.sampled_from([1.0, 0.1, 2.0])),
        slack=draw(st.sampled_from([0, 3])),
    )


def cu_seqlens(lengths: tuple[int, ...]) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths, dtype=torch.int64).cumsum(0).tolist()], dtype=torch.int32)


def attention_inputs(case: AttentionCase) -> tuple[dict, dict]:
    g = generator(case.seed)
    tq, tk = sum(case.lengths_q), sum(case.lengths_k)
    x = {
        "q": randn(g, tq, case.hq, case.d) * case.score,
        "k": randn(g, tk, case.hkv, case.d) * case.score,
        "v": randn(g, tk, case.hkv, case.d),
        "cot_out": randn(g, tq, case.hq, case.d),
        "cot_lse": randn(g, case.hq, tq),
        "cu_q": cu_seqlens(case.lengths_q),
        "cu_k": cu_seqlens(case.lengths_k),
    }
    return low_and_exact(x, case.dtype)


def attention_call(x: dict, case: AttentionCase) -> tuple[dict, dict]:
    """Forward and backward of ``sum(cot_out * out) + sum(cot_lse * lse)`` (rows that see no key have
    ``lse = -inf``: their ``cot_lse`` term is left out)."""
    leaf = leaves(x, ("q", "k", "v"))
    out, lse = rlk.attention(
        leaf["q"],
        leaf["k"],
        leaf["v"],
        cu_seqlens_q=x["cu_q"],
        cu_seqlens_k=x["cu_k"],
        max_seqlen_q=max(case.lengths_q, default=0) + case.slack,
        max_seqlen_k=max(case.lengths_k, default=0) + case.slack,
        causal=case.causal,
        softmax_scale=case.softmax_scale,
        return_lse=True,
    )
    seen = torch.isfinite(lse.detach())
    loss = (x["cot_out"].to(out.dtype) * out).sum() + torch.where(seen, x["cot_lse"].to(lse.dtype) * lse, 0.0).sum()
    loss.backward()
    return {"out": out.detach(), "lse": lse.detach()}, grads(leaf)


def attention_scale(exact: dict, case: AttentionCase) -> torch.Tensor:
    """``1 + max |v|`` over the keys of each query's sequence in its kv head, per element of ``out``."""
    v = exact["v"].abs()
    scale = torch.ones(exact["q"].shape[0], case.hq, 1, dtype=torch.float64, device=v.device)
    cu_q, cu_k = cu_seqlens(case.lengths_q).tolist(), cu_seqlens(case.lengths_k).tolist()
    for b in range(len(case.lengths_k)):
        if cu_k[b + 1] > cu_k[b] and cu_q[b + 1] > cu_q[b]:
            per_head = v[cu_k[b] : cu_k[b + 1]].amax(dim=(0, 2)).repeat_interleave(case.group)
            scale[cu_q[b] : cu_q[b + 1], :, 0] += per_head[None, :]
    return scale.expand(-1, -1, case.d)


def no_key_rows(case: AttentionCase) -> torch.Tensor:
    """``[total_q]``: the queries that see no key (``Lk = 0``, or above the bottom-right causal diagonal)."""
    rows = []
    for n_q, n_k in zip(case.lengths_q, case.lengths_k):
        i = torch.arange(n_q)
        rows.append(torch.full((n_q,), n_k == 0) | ((i + (n_k - n_q) < 0) if case.causal else False))
    return torch.cat(rows).to(DEVICE) if rows else torch.zeros(0, dtype=torch.bool, device=DEVICE)


def check_attention_matches_reference(backend: str, case: AttentionCase) -> None:
    """out, lse and the q / k / v gradients against the fp64 ground truth under the contract (out: ``1 + max |v|``
    of the query's keys; lse: ``1 + |lse|``; gradients by relative L2); a query that sees no key gives exactly
    ``out = 0``, ``lse = -inf`` and a zero q-gradient row."""
    low, exact = attention_inputs(case)
    with on_backend(backend):
        got = attention_call(low, case)
    with on_reference():
        truth = attention_call(exact, case)
    scales = {"out": attention_scale(exact, case), "lse": 1.0 + truth[0]["lse"].abs()}
    check_against_truth("attention", case.dtype, got, truth, scales)
    blind = no_key_rows(case)
    out, lse, grad_q = got[0]["out"], got[0]["lse"], got[1]["grad_q"]
    check_equal("out of queries that see no key", out[blind], torch.zeros_like(out[blind]))
    check_equal("lse of queries that see no key", lse[:, blind], torch.full_like(lse[:, blind], -math.inf))
    check_equal("grad_q of queries that see no key", grad_q[blind], torch.zeros_like(grad_q[blind]))


@dataclass(frozen=True)
class AttentionInBatch:
    """A causal prefill sequence (``probe``), packed at ``position`` among the sequences of ``others``, and its
    queries ``chunk_start:chunk_end`` run as a chunk against the keys ``0:chunk_end``."""

    probe: AttentionCase
    others: AttentionCase
    position: int
    chunk_start: int
    chunk_end: int


@st.composite
def attention_in_batch(draw, backend: str) -> AttentionInBatch:
    probe = draw(attention_cases(backend, prefill=True))
    others = draw(attention_cases(backend))
    others = replace(
        others,
        hkv=probe.hkv,
        group=probe.group,
        d=probe.d,
        dtype=probe.dtype,
        causal=True,
        softmax_scale=probe.softmax_scale,
        lengths_q=others.lengths_k,
    )
    n = probe.lengths_q[0]
    end = draw(st.integers(1, n))
    return AttentionInBatch(
        probe, others, draw(st.integers(0, len(others.lengths_k))), draw(st.integers(0, end - 1)), end
    )


def check_attention_batch_invariance(backend: str, case: AttentionInBatch) -> None:
    """A sequence's out, lse and q / k / v gradients alone versus packed among other sequences, and its
    queries' out, lse and q gradients in a chunk of a chunked prefill (one query: a decode step) versus the
    full prefill: bitwise equal."""
    probe = case.probe
    x = attention_inputs(probe)[0]
    o = attention_inputs(case.others)[0]
    n, p = probe.lengths_q[0], case.position
    start = int(o["cu_k"][p])
    lengths = case.others.lengths_k[:p] + (n,) + case.others.lengths_k[p:]
    packed_case = replace(probe, lengths_q=lengths, lengths_k=lengths)
    packed = {name: torch.cat([o[name][:start], x[name], o[name][start:]]) for name in ("q", "k", "v", "cot_out")}
    packed["cot_lse"] = torch.cat([o["cot_lse"][:, :start], x["cot_lse"], o["cot_lse"][:, start:]], dim=1)
    packed["cu_q"] = packed["cu_k"] = cu_seqlens(lengths).to(DEVICE)
    a, b = case.chunk_start, case.chunk_end
    chunk_case = replace(probe, lengths_q=(b - a,), lengths_k=(b,))
    chunk = {
        "q": x["q"][a:b],
        "k": x["k"][:b],
        "v": x["v"][:b],
        "cot_out": x["cot_out"][a:b],
        "cot_lse": x["cot_lse"][:, a:b],
        "cu_q": cu_seqlens((b - a,)).to(DEVICE),
        "cu_k": cu_seqlens((b,)).to(DEVICE),
    }
    with on_backend(backend):
        alone = attention_call(x, probe)
        inside = attention_call(packed, packed_case)
        part = attention_call(chunk, chunk_case)
    rows = slice(start, start + n)
    check_equal("out, packed", inside[0]["out"][rows], alone[0]["out"])
    check_equal("lse, packed", inside[0]["lse"][:, rows], alone[0]["lse"])
    for name in ("grad_q", "grad_k", "grad_v"):
        check_equal(f"{name}, packed", inside[1][name][rows], alone[1][name])
    check_equal("out, chunk", part[0]["out"], alone[0]["out"][a:b])
    check_equal("lse, chunk", part[0]["lse"], alone[0]["lse"][:, a:b])
    check_equal("grad_q, chunk", part[1]["grad_q"], alone[1]["grad_q"][a:b])


@pytest.mark.parametrize("backend", backends("attention"))
def test_attention_matches_reference(backend):
    fuzz_run(check_attention_matches_reference, backend, attention_cases(backend), ci=4)


@pytest.mark.parametrize("backend", backends("attention", invariant_only=True))
def test_attention_batch_invariance(backend):
    fuzz_run(check_attention_batch_invariance, backend, attention_in_batch(backend), ci=3)


# =============================================================================================
# apply_rope
# =============================================================================================


@dataclass(frozen=True)
class RopeCase:
    """``apply_rope`` on ``[b, s]`` tokens: packed ``[b * s, H, D]``, ``bhsd`` (``unsqueeze_dim=1``) or ``bshd``
    (``unsqueeze_dim=2``); tables ``[s, R]``, ``[1, s, R]`` or ``[b, s, R]`` (packed: ``[b * s, R]``)."""

    layout: str
    b: int
    s: int
    hq: int
    hk: int
    d: int
    rotary: int
    seed: int
    dtype: str = "float32"
    interleaved: bool = False
    tables_fp32: bool = True  # else the dtype of q
    tables: str = "batch"  # "shared" [s, R], "one" [1, s, R], "batch" [b, s, R]
    base: float = 10000.0


@st.composite
def rope_cases(draw, backend: str, one_token: bool = False) -> RopeCase:
    d = 2 * draw(sizes(1, limit(backend, 32, 128)))
    return RopeCase(
        layout="packed" if one_token else draw(st.sampled_from(["packed", "bhsd", "bshd"])),
        b=1 if one_token else draw(sizes(0, limit(backend, 3, 8))),
        s=1 if one_token else draw(sizes(0, limit(backend, 17, 512))),
        hq=draw(sizes(1, limit(backend, 4, 32))),
        hk=draw(sizes(1, limit(backend, 4, 8))),
        d=d,
        rotary=2 * draw(st.integers(1, d // 2)),
        seed=draw(seeds),
        dtype=draw(st.sampled_from(dtype_names(backend, "rope"))),
        interleaved=draw(st.booleans()),
        tables_fp32=draw(st.booleans()),
        tables=draw(st.sampled_from(["batch", "shared", "one"])),
        base=draw(st.sampled_from([10000.0, 1e6])),
    )


def rope_inputs(case: RopeCase) -> tuple[dict, dict, dict]:
    """The call's inputs (cast), their fp64 copies, and the packed ``[T, H, D]`` / ``[T, R]`` fp64 views of both
    (for the contract scale)."""
    g = generator(case.seed)
    b, s, r = case.b, case.s, case.rotary
    positions = torch.randint(0, 32768, (b, s), generator=g).double()
    inv_freq = 1.0 / (case.base ** (torch.arange(0, r, 2, dtype=torch.float64) / r))
    angles = positions[..., None] * inv_freq
    angles = angles.repeat_interleave(2, dim=-1) if case.interleaved else torch.cat([angles, angles], dim=-1)
    bshd = {
        "q": randn(g, b, s, case.hq, case.d),
        "k": randn(g, b, s, case.hk, case.d),
        "cot_q": randn(g, b, s, case.hq, case.d),
        "cot_k": randn(g, b, s, case.hk, case.d),
    }
    cos, sin = angles.cos(), angles.sin()  # [b, s, R]
    packed = {name: v.reshape(b * s, *v.shape[2:]) for name, v in bshd.items()}
    packed |= {"cos": cos.reshape(b * s, r), "sin": sin.reshape(b * s, r)}
    if case.layout == "packed":
        x = dict(packed)
    else:
        x = {name: (v if case.layout == "bshd" else v.transpose(1, 2).contiguous()) for name, v in bshd.items()}
        kind = case.tables if b else "batch"
        if kind == "batch":
            tables = (cos, sin)
        else:
            tables = (cos[:1], sin[:1]) if kind == "one" else (cos[0], sin[0])
        if case.tables != "batch" and b:  # tables shared over the batch: every row has row 0's positions
            for t in (packed["cos"], packed["sin"]):
                t.copy_(t.view(b, s, r)[:1].expand(b, s, r).reshape(b * s, r))
        x |= {"cos": tables[0], "sin": tables[1]}
    keep = ("cos", "sin") if case.tables_fp32 else ()
    low, exact = low_and_exact(x, case.dtype, keep=keep)
    if case.tables_fp32:
        for name in ("cos", "sin"):
            low[name] = low[name].float()
            exact[name] = low[name].double()
            packed[name] = packed[name].float().double()
    else:
        for name in ("cos", "sin"):
            packed[name] = packed[name].to(DTYPES[case.dtype]).double()
    packed = {
        name: v.to(DEVICE, DTYPES[case.dtype]).double() if name in ("q", "k") else v.to(DEVICE)
        for name, v in packed.items()
    }
    return low, exact, packed


def rope_call(x: dict, case: RopeCase) -> tuple[dict, dict]:
    leaf = leaves(x, ("q", "k"))
    q_out, k_out = rlk.apply_rope(
        leaf["q"],
        leaf["k"],
        x["cos"],
        x["sin"],
        interleaved=case.interleaved,
        unsqueeze_dim=2 if case.layout == "bshd" else 1,
    )
    ((x["cot_q"].to(q_out.dtype) * q_out).sum() + (x["cot_k"].to(k_out.dtype) * k_out).sum()).backward()
    return {"q": q_out.detach(), "k": k_out.detach()}, grads(leaf)


def to_layout(t: torch.Tensor, case: RopeCase) -> torch.Tensor:
    """A packed ``[T, H, D]`` tensor in the case's layout."""
    if case.layout == "packed":
        return t
    bshd = t.reshape(case.b, case.s, *t.shape[1:])
    return bshd if case.layout == "bshd" else bshd.transpose(1, 2)


def check_rope_matches_reference(backend: str, case: RopeCase) -> None:
    """Rotated q and k and their gradients against the fp64 ground truth under the contract (per element
    ``|x[a] cos| + |x[b] sin|``, ``|x|`` past the rotary dim; gradients by relative L2)."""
    low, exact, packed = rope_inputs(case)
    with on_backend(backend):
        got = rope_call(low, case)
    with on_reference():
        truth = rope_call(exact, case)
    scales = {
        name: to_layout(ref_rope.error_scale(packed[name], packed["cos"], packed["sin"], case.interleaved), case)
        for name in ("q", "k")
    }
    check_against_truth("rope", case.dtype, got, truth, scales)


def check_rope_batch_invariance(backend: str, case: ChainRowInBatch) -> None:
    """A token alone versus at a random position among other tokens (packed layout): bitwise equal outputs
    and gradient rows."""
    probe = case.probe
    x = rope_inputs(probe)[0]
    others = rope_inputs(replace(probe, s=case.others, seed=case.seed))[0]
    batch = {
        name: torch.cat([others[name][: case.position], v, others[name][case.position :]]) for name, v in x.items()
    }
    with on_backend(backend):
        alone = rope_call(x, probe)
        inside = rope_call(batch, probe)
    row = slice(case.position, case.position + 1)
    for part_alone, part_inside in zip(alone, inside):
        for name, value in part_alone.items():
            check_equal(f"{name} of the token", part_inside[name][row], value)


@pytest.mark.parametrize("backend", backends("rope"))
def test_rope_matches_reference(backend):
    fuzz_run(check_rope_matches_reference, backend, rope_cases(backend), ci=4)


@pytest.mark.parametrize("backend", backends("rope", invariant_only=True))
def test_rope_batch_invariance(backend):
    fuzz_run(
        check_rope_batch_invariance,
        backend,
        chain_rows_in_batch(rope_cases(backend, one_token=True), limit(backend, 17, 512)),
        ci=3,
    )


# =============================================================================================
# softmax and log_softmax
# =============================================================================================


@dataclass(frozen=True)
class SoftmaxCase:
    """``softmax`` (``log``: ``log_softmax``) of a ``shape`` input along ``dim``."""

    log: bool
    shape: tuple[int, ...]
    dim: int
    seed: int
    dtype: str = "float32"
    scale: float = 3.0
    neg_inf: bool = False  # ~30% -inf entries, never a whole slice
    transposed: bool = False  # a non-contiguous input


@st.composite
def softmax_cases(draw, backend: str, one_row: bool = False) -> SoftmaxCase:
    if one_row:
        shape = (1, draw(sizes(1, limit(backend, 300, 40000))))
    else:
        shape = draw(
            st.sampled_from([(), (1,)])
            | st.tuples(sizes(0, limit(backend, 300, 40000)))
            | st.tuples(sizes(0, limit(backend, 9, 64)), sizes(0, limit(backend, 300, 4097)))
            | st.tuples(sizes(0, 5), sizes(0, 9), sizes(0, 33))
        )
    dim = -1 if one_row or not shape else draw(st.integers(-len(shape), len(shape) - 1))
    dtype = draw(st.sampled_from(dtype_names(backend, "softmax")))
    largest = 1e3 if dtype == "float16" else 1e4  # fp16 overflows at 65504
    return SoftmaxCase(
        log=draw(st.booleans()),
        shape=shape,
        dim=dim,
        seed=draw(seeds),
        dtype=dtype,
        scale=draw(st.sampled_from([3.0, 1e-3, 30.0, largest])),
        neg_inf=draw(st.booleans()),
        transposed=not one_row and len(shape) >= 2 and draw(st.booleans()),
    )


def softmax_inputs(case: SoftmaxCase) -> tuple[dict, dict]:
    g = generator(case.seed)
    x = randn(g, *case.shape) * case.scale
    if case.neg_inf and x.dim() and x.shape[case.dim] > 1:
        hole = torch.rand(x.shape, generator=g) < 0.3
        keep = torch.zeros_like(hole).movedim(case.dim, -1)
        keep[..., 0] = True  # one finite entry per slice
        hole &= ~keep.movedim(-1, case.dim)
        x = x.masked_fill(hole, -math.inf)
    low, exact = low_and_exact({"x": x, "cot": randn(g, *case.shape)}, case.dtype)
    if case.transposed:
        for pair in (low, exact):
            pair["x"] = pair["x"].transpose(0, 1).contiguous().transpose(0, 1)
    return low, exact


def softmax_call(x: dict, case: SoftmaxCase) -> tuple[dict, dict]:
    leaf = leaves(x, ("x",))
    y = (rlk.log_softmax if case.log else rlk.softmax)(leaf["x"], case.dim)
    finite = torch.isfinite(y.detach())
    torch.where(finite, x["cot"].to(y.dtype) * y, 0.0).sum().backward()  # -inf outputs of log_softmax left out
    return {"y": y.detach()}, grads(leaf)


def softmax_grad_magnitude(x: dict, y: torch.Tensor, case: SoftmaxCase) -> torch.Tensor:
    """The terms of the gradient by absolute value (fp64): softmax's ``y (g - sum g y)`` sums
    ``y (|g| + sum |g y|)`` (they cancel at a dominant entry), log_softmax's ``g - p sum g`` sums
    ``|g| + p sum |g|``; ``-inf`` outputs carry no cotangent."""
    finite = torch.isfinite(y)
    g = torch.where(finite, x["cot"].abs(), 0.0)
    if case.log:
        p = torch.where(finite, y, -math.inf).exp()
        return g + p * g.sum(case.dim, keepdim=True)
    return y * (g + (g * y).sum(case.dim, keepdim=True))


def check_softmax_matches_reference(backend: str, case: SoftmaxCase) -> None:
    """The output and its gradient against the fp64 ground truth under the contract (``1 + |ref|``, log_softmax
    ``1 + |ref| + |x|``; the gradient by relative L2 with ``max_scale`` the largest output scale, as the softmax
    tests do); softmax in ``[0, 1]``, log_softmax ``<= 0``."""
    low, exact = softmax_inputs(case)
    with on_backend(backend):
        got = softmax_call(low, case)
    with on_reference():
        truth = softmax_call(exact, case)
    ref = truth[0]["y"]
    scale = 1.0 + ref.abs() + (exact["x"].abs() if case.log else 0.0)
    finite_scale = scale[torch.isfinite(scale)]
    check_against_truth(
        "softmax",
        case.dtype,
        got,
        truth,
        {"y": scale},
        float(finite_scale.max()) if finite_scale.numel() else 0.0,
        {"grad_x": softmax_grad_magnitude(exact, ref, case)},
    )
    y = got[0]["y"]
    if case.log:
        assert bool((y <= 0).all()), f"log_softmax > 0: max {y.max().item()!r}"
    else:
        assert bool(((y >= 0) & (y <= 1)).all()), f"softmax outside [0, 1]: {y.min().item()!r}..{y.max().item()!r}"


def check_softmax_batch_invariance(backend: str, case: ChainRowInBatch) -> None:
    """A row alone versus at a random position among other rows: bitwise equal output and gradient rows."""
    probe = case.probe
    x = softmax_inputs(probe)[0]
    others = softmax_inputs(replace(probe, shape=(case.others, probe.shape[1]), seed=case.seed, scale=probe.scale * 2))[
        0
    ]
    batch = {
        name: torch.cat([others[name][: case.position], v, others[name][case.position :]]) for name, v in x.items()
    }
    with on_backend(backend):
        alone = softmax_call(x, probe)
        inside = softmax_call(batch, probe)
    row = slice(case.position, case.position + 1)
    check_equal("y of the row", inside[0]["y"][row], alone[0]["y"])
    check_equal("grad_x of the row", inside[1]["grad_x"][row], alone[1]["grad_x"])


@pytest.mark.parametrize("backend", backends("softmax"))
def test_softmax_matches_reference(backend):
    fuzz_run(check_softmax_matches_reference, backend, softmax_cases(backend), ci=5)


@pytest.mark.parametrize("backend", backends("softmax", invariant_only=True))
def test_softmax_batch_invariance(backend):
    fuzz_run(
        check_softmax_batch_invariance,
        backend,
        chain_rows_in_batch(softmax_cases(backend, one_row=True), limit(backend, 9, 512)),
        ci=3,
    )


# =============================================================================================
# embedding
# =============================================================================================


@dataclass(frozen=True)
class EmbeddingCase:
    """``embedding(ids[ids_shape], weight[v, h])``."""

    ids_shape: tuple[int, ...]
    v: int
    h: int
    seed: int
    dtype: str = "float32"
    padding_idx: int | None = None
    repeated: bool = True  # a quarter of the ids equal to the first
    int32: bool = False


@st.composite
def embedding_cases(draw, backend: str) -> EmbeddingCase:
    v = draw(sizes(1, limit(backend, 129, 40000)))
    n = limit(backend, 65, 4097)
    ids_shape = draw(st.sampled_from([(), (1,)]) | st.tuples(sizes(0, n)) | st.tuples(sizes(0, 5), sizes(0, 17)))
    padding = draw(st.sampled_from([None, 0, -1]) | st.integers(-v, v - 1))
    return EmbeddingCase(
        ids_shape=ids_shape,
        v=v,
        h=draw(sizes(1, limit(backend, 65, 1024))),
        seed=draw(seeds),
        dtype=draw(st.sampled_from(dtype_names(backend, "embedding"))),
        padding_idx=padding,
        repeated=draw(st.booleans()),
        int32=draw(st.booleans()),
    )


def embedding_inputs(case: EmbeddingCase) -> tuple[dict, dict]:
    g = generator(case.seed)
    ids = torch.randint(0, case.v, case.ids_shape, generator=g)
    if case.repeated and ids.numel():
        flat = ids.view(-1)
        flat[: max(1, flat.numel() // 4)] = flat[0]
    x = {
        "ids": ids.to(torch.int32 if case.int32 else torch.int64),
        "weight": randn(g, case.v, case.h),
        "cot": randn(g, *case.ids_shape, case.h),
    }
    return low_and_exact(x, case.dtype)


def embedding_call(x: dict, case: EmbeddingCase) -> tuple[dict, dict]:
    leaf = leaves(x, ("weight",))
    y = rlk.embedding(x["ids"], leaf["weight"], padding_idx=case.padding_idx)
    (x["cot"].to(y.dtype) * y).sum().backward()
    return {"y": y.detach()}, grads(leaf)


def check_embedding_matches_reference(backend: str, case: EmbeddingCase) -> None:
    """The forward is a bitwise copy of the rows; the weight gradient agrees with the fp64 ground truth under the
    contract (per element the sum of ``|grad_out|`` over the rows with that id; relative L2), is exactly 0 for
    ``padding_idx`` and, on backends declaring batch invariance, the same bits on a second run."""
    low, exact = embedding_inputs(case)
    with on_backend(backend):
        got = embedding_call(low, case)
        again = embedding_call(low, case) if backend != "reference" else got
    with on_reference():
        truth = embedding_call(exact, case)
    check_equal("y vs weight[ids]", got[0]["y"], low["weight"][low["ids"].long()])
    ids = exact["ids"].reshape(-1).long()
    scale = torch.zeros_like(exact["weight"]).index_add_(0, ids, exact["cot"].reshape(-1, case.h).abs())
    entry = contract.entry("embedding", DTYPES[case.dtype])
    grad = got[1]["grad_weight"]
    check_finite("grad_weight", grad)
    check_value(entry, "grad_weight", grad, truth[1]["grad_weight"], scale)
    check_grad(entry, "grad_weight", grad, truth[1]["grad_weight"], 0.0)
    if case.padding_idx is not None:
        row = grad[case.padding_idx % case.v]
        check_equal("grad_weight of padding_idx", row, torch.zeros_like(row))
    check_equal("grad_weight, second run", again[1]["grad_weight"], grad)


@pytest.mark.parametrize("backend", backends("embedding"))
def test_embedding_matches_reference(backend):
    fuzz_run(check_embedding_matches_reference, backend, embedding_cases(backend), ci=5)
