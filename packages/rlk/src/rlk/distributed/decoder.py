"""A Qwen3-style decoder built from rlk ops in Megatron's tensor-parallel layout (the distributed chain).

One function, :func:`forward`, runs it three ways: ``mode="single"`` with rlk's single-device ops on the
full weights (TP = 1); ``mode="tp"`` with :mod:`rlk.distributed` on each rank's shards (a real group, or a
:class:`~rlk.distributed.SimulatedGroup` with every rank's shards in one process); ``mode="stock"``, the
negative control, as ``"tp"`` but with the row-parallel partial sums computed per rank by ``rlk.linear`` and
added by ``torch.distributed.all_reduce`` (simulated: in rank order). Layout: q / k / v / gate / up and
the LM head sharded by output rows (heads, intermediate features, vocabulary), o / down by input columns,
norms and the embedding replicated (Qwen3's per-head q / k norm weights are applied head by head and their
gradient summed over the heads in the fixed tree, hence also across ranks); no dropout. Parameters are a
flat dict (``"layers.0.q"``...); :func:`shard_dims` says how each is split. The tests
(``tests/test_distributed_chain.py``) and ``tools/bench_distributed_sim.py`` use it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from rlk.distributed.group import Comm, Group, SimulatedGroup
from rlk.distributed.logprob import vocab_parallel_linear_logprob
from rlk.distributed.matmul import column_parallel_linear, row_parallel_linear
from rlk.distributed.reduce import all_reduce_fixed, tree_sum
from rlk.ops.attention import attention
from rlk.ops.embedding import embedding
from rlk.ops.logprob import linear_logprob
from rlk.ops.matmul import linear
from rlk.ops.norm import rms_norm
from rlk.ops.rope import apply_rope


@dataclass(frozen=True)
class Config:
    vocab: int = 256
    hidden: int = 256
    layers: int = 2
    heads: int = 8
    kv_heads: int = 4
    head_dim: int = 32
    intermediate: int = 512
    eps: float = 1e-6
    rope_theta: float = 10000.0
    dropout: float = 0.0  # the chain has none; recorded so that tests can check the precondition


#: Qwen3-8B's layer and head shapes.
QWEN3_8B = Config(vocab=151936, hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, intermediate=12288)

_LAYER_SHARDS = {
    "input_norm": None,
    "q": 0,
    "k": 0,
    "v": 0,
    "q_norm": None,
    "k_norm": None,
    "o": 1,
    "post_norm": None,
    "gate": 0,
    "up": 0,
    "down": 1,
}


def shard_dims(config: Config) -> dict[str, int | None]:
    """Parameter name -> the dim it is split along over the ranks (None: replicated)."""
    dims = {"embed": None, "final_norm": None, "lm_head": 0}
    for i in range(config.layers):
        dims.update({f"layers.{i}.{k}": d for k, d in _LAYER_SHARDS.items()})
    return dims


def init_params(config: Config, dtype: torch.dtype, device, seed: int = 0) -> dict[str, Tensor]:
    """Random full parameters (scaled so that activations stay O(1)); norms near 1."""
    g = torch.Generator().manual_seed(seed)
    c = config

    def w(*shape, fan_in):
        return (torch.randn(*shape, generator=g) / fan_in**0.5).to(dtype).to(device)

    def norm(n):
        return (1 + 0.1 * torch.randn(n, generator=g)).to(dtype).to(device)

    p = {
        "embed": w(c.vocab, c.hidden, fan_in=1),
        "final_norm": norm(c.hidden),
        "lm_head": w(c.vocab, c.hidden, fan_in=c.hidden),
    }
    for i in range(c.layers):
        p.update(
            {
                f"layers.{i}.input_norm": norm(c.hidden),
                f"layers.{i}.q": w(c.heads * c.head_dim, c.hidden, fan_in=c.hidden),
                f"layers.{i}.k": w(c.kv_heads * c.head_dim, c.hidden, fan_in=c.hidden),
                f"layers.{i}.v": w(c.kv_heads * c.head_dim, c.hidden, fan_in=c.hidden),
                f"layers.{i}.q_norm": norm(c.head_dim),
                f"layers.{i}.k_norm": norm(c.head_dim),
                f"layers.{i}.o": w(c.hidden, c.heads * c.head_dim, fan_in=c.heads * c.head_dim),
                f"layers.{i}.post_norm": norm(c.hidden),
                f"layers.{i}.gate": w(c.intermediate, c.hidden, fan_in=c.hidden),
                f"layers.{i}.up": w(c.intermediate, c.hidden, fan_in=c.hidden),
                f"layers.{i}.down": w(c.hidden, c.intermediate, fan_in=c.intermediate),
            }
        )
    return p


def shard(config: Config, params: dict[str, Tensor], size: int, ranks: list[int]) -> dict[str, Tensor | list[Tensor]]:
    """The parameters of ``ranks`` (of ``size``): sharded entries as lists of contiguous copies (one per rank of
    ``ranks``), replicated entries as the tensors themselves."""
    if config.heads % size or config.kv_heads % size:
        raise ValueError(f"size: {size} ranks must divide the {config.heads} query and {config.kv_heads} kv heads")
    out: dict[str, Tensor | list[Tensor]] = {}
    for name, dim in shard_dims(config).items():
        x = params[name]
        out[name] = x if dim is None else [x.chunk(size, dim=dim)[r].contiguous() for r in ranks]
    return out


def unshard(config: Config, per_rank: list[dict[str, Tensor]]) -> dict[str, Tensor]:
    """Full tensors from every rank's (rank order) dict of shard-shaped tensors (e.g. gradients): sharded entries
    concatenated, replicated ones taken from rank 0 (``replicated_equal`` checks the others)."""
    out = {}
    for name, dim in shard_dims(config).items():
        out[name] = per_rank[0][name] if dim is None else torch.cat([p[name] for p in per_rank], dim=dim)
    return out


def rope_tables(positions: Tensor, config: Config) -> tuple[Tensor, Tensor]:
    """HF's rotate-half cos / sin ``[T, head_dim]`` (fp32) for token positions ``[T]``."""
    d = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=positions.device) / d))
    angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    return emb.cos(), emb.sin()


class _Ops:
    """The three ways to run a linear layer and the LM head (see the module docstring)."""

    def __init__(self, mode: str, group: Group):
        if mode not in ("single", "tp", "stock"):
            raise ValueError(f"mode: expected 'single', 'tp' or 'stock', got {mode!r}")
        self.mode, self.group = mode, group
        self.comm = Comm(SimulatedGroup(1) if mode == "single" else group)  # single: one rank, whatever is initialized

    def column(self, x: Tensor, ws: list[Tensor]) -> list[Tensor]:
        if self.mode == "single":
            return [linear(x, ws[0])]
        out = column_parallel_linear(x, self.comm.result(ws), group=self.group)
        return out if self.comm.simulated else [out]

    def row(self, xs: list[Tensor], ws: list[Tensor]) -> Tensor:
        if self.mode == "single":
            return linear(xs[0], ws[0])
        if self.mode == "stock":
            partials = [linear(x, w) for x, w in zip(xs, ws)]
            if self.comm.simulated:  # the partials added in rank order, as a reduction that ignores the tree would
                return sum(partials[1:], partials[0])
            y = partials[0]
            return _StockAllReduce.apply(y, self.group) if self.comm.size > 1 else y
        return row_parallel_linear(self.comm.result(xs), self.comm.result(ws), group=self.group)

    def logprob(self, h: Tensor, ws: list[Tensor], targets: Tensor, temperature: float):
        if self.mode == "single":
            return linear_logprob(h, ws[0], targets, temperature=temperature, return_entropy=True)
        return vocab_parallel_linear_logprob(
            h, self.comm.result(ws), targets, group=self.group, temperature=temperature, return_entropy=True
        )

    def logits(self, h: Tensor, ws: list[Tensor]) -> Tensor:
        if self.mode == "single":
            return linear(h, ws[0])
        return column_parallel_linear(h, self.comm.result(ws), group=self.group, gather_output=True)


class _StockAllReduce(torch.autograd.Function):
    """The negative control's reduction: ``torch.distributed.all_reduce`` (identity backward, as Megatron's)."""

    @staticmethod
    def forward(ctx, x, group):
        y = x.clone()
        dist.all_reduce(y, group=group)
        return y

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _PerHead(torch.autograd.Function):
    """A weight shared by ``n`` heads (Qwen3's q / k norm), one copy per head: the gradient is the sum over the
    heads in the fixed tree, then over the ranks (:func:`all_reduce_fixed`): with ``n`` heads per rank (a power
    of two) that is the tree over all heads, whatever the tensor-parallel degree."""

    @staticmethod
    def forward(ctx, comm, n, weight):
        ctx.comm = comm
        return weight.expand(n, *weight.shape).clone()

    @staticmethod
    def backward(ctx, grad):
        total = tree_sum(grad)
        if not ctx.comm.local:
            all_reduce_fixed(total, ctx.comm.group)
        return None, None, total


def _head_norm(x: Tensor, weights: Tensor, eps: float) -> Tensor:
    """``rms_norm`` of each head ``x[:, h]`` ``[T, d]`` with its own copy ``weights[h]`` of the shared weight."""
    return torch.stack([rms_norm(x[:, h], weights[h], eps) for h in range(x.shape[1])], dim=1)


def _per_rank(p, single: bool) -> list[Tensor]:
    return [p] if single else p


def forward(
    config: Config,
    params: dict[str, Tensor | list[Tensor]],
    ids: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    positions: Tensor,
    targets: Tensor | None = None,
    *,
    mode: str = "tp",
    group: Group = None,
    temperature: float = 1.0,
    with_logits: bool = False,
    trace: list | None = None,
) -> dict[str, Tensor]:
    """The decoder on packed sequences: ``ids`` / ``positions`` ``[T]``, ``cu_seqlens`` int32 ``[B + 1]``.

    ``params``: full tensors (``mode="single"``) or :func:`shard`'s output for this process's ranks. Returns
    ``{"logprob", "entropy"}`` of ``targets`` (fp32 ``[T]``) when given, and ``"logits"`` ``[T, V]`` (the full
    vocabulary, gathered) with ``with_logits``. ``trace``: a list that receives ``(layer, op, hidden)`` for the
    residual stream after each layer's attention and MLP (``"attention"``, ``"mlp"``; detached).
    """
    ops = _Ops(mode, group)
    single = mode == "single"
    c = config
    n_tokens = ids.shape[0]
    x = embedding(ids, params["embed"])
    cos, sin = rope_tables(positions, c)
    for i in range(c.layers):
        p = {k: params[f"layers.{i}.{k}"] for k in _LAYER_SHARDS}
        h = rms_norm(x, p["input_norm"], c.eps)
        qs, ks, vs = (ops.column(h, _per_rank(p[name], single)) for name in ("q", "k", "v"))
        n_q, n_kv = qs[0].shape[1] // c.head_dim, ks[0].shape[1] // c.head_dim
        q_norms = _PerHead.apply(ops.comm, len(qs) * n_q, p["q_norm"])
        k_norms = _PerHead.apply(ops.comm, len(ks) * n_kv, p["k_norm"])
        attn = []
        for j, (q, k, v) in enumerate(zip(qs, ks, vs)):
            q = _head_norm(q.view(n_tokens, n_q, c.head_dim), q_norms[j * n_q : (j + 1) * n_q], c.eps)
            k = _head_norm(k.view(n_tokens, n_kv, c.head_dim), k_norms[j * n_kv : (j + 1) * n_kv], c.eps)
            q, k = apply_rope(q, k, cos, sin)
            a = attention(
                q,
                k,
                v.view(n_tokens, -1, c.head_dim),
                cu_seqlens_q=cu_seqlens,
                cu_seqlens_k=cu_seqlens,
                max_seqlen_q=max_seqlen,
                max_seqlen_k=max_seqlen,
            )
            attn.append(a.reshape(n_tokens, -1))
        x = x + ops.row(attn, _per_rank(p["o"], single))
        if trace is not None:
            trace.append((i, "attention", x.detach()))
        h = rms_norm(x, p["post_norm"], c.eps)
        gates, ups = ops.column(h, _per_rank(p["gate"], single)), ops.column(h, _per_rank(p["up"], single))
        acts = [F.silu(g) * u for g, u in zip(gates, ups)]
        x = x + ops.row(acts, _per_rank(p["down"], single))
        if trace is not None:
            trace.append((i, "mlp", x.detach()))
    h = rms_norm(x, params["final_norm"], c.eps)
    out = {}
    head = _per_rank(params["lm_head"], single)
    if targets is not None:
        out["logprob"], out["entropy"] = ops.logprob(h, head, targets, temperature)
    if with_logits:
        out["logits"] = ops.logits(h, head)
    return out
