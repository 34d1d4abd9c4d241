"""Layer-wise drift probe: where do two execution paths of the same tokens start to differ?

:class:`Probe` puts forward hooks on every op of every decoder layer of a Hugging Face causal LM and keeps,
per ``(layer, op)``, the output vector of every real (non-padding) token of every forward, keyed by the token's
``(sequence, position)``. Two probes over two paths of the same token sequences (a batched, left-padded rollout
with a KV cache and a packed training forward, say) are compared by :func:`compare`: per op and per layer the
max / mean ``|delta|`` over the tokens both saw, and the first ``(layer, op)`` in computation order whose states
are not bitwise equal.

Ops of a Llama / Qwen3 / Mistral-style decoder layer, in the order the layer computes them (:data:`OPS`)::

    input_layernorm   h = norm(x)                                  [B, S, H]
    q_proj            q = h @ Wq^T                                 [B, S, heads * head_dim]
    q_norm            Qwen3 only: per-head RMSNorm of q             [B, S, heads, head_dim] -> [B, S, -1]
    k_proj, k_norm    same for k                                    [B, S, kv_heads * head_dim]
    v_proj            v = h @ Wv^T                                  [B, S, kv_heads * head_dim]
    attention         softmax(q k^T / sqrt(d)) v: the INPUT of o_proj (forward pre-hook)   [B, S, heads * head_dim]
    o_proj            attention @ Wo^T                              [B, S, H]
    post_attention_layernorm   norm(x + o_proj)                     [B, S, H]
    gate_proj, up_proj                                               [B, S, I]
    act               act(gate) * up: the INPUT of down_proj (forward pre-hook)            [B, S, I]
    down_proj                                                        [B, S, H]
    layer             the decoder layer's output (x + o_proj + down_proj)                 [B, S, H]

Other architectures: the decoder layers are the largest ``nn.ModuleList`` of identical modules (``model.layers``,
``transformer.h``, ...); every leaf submodule of a layer that has a ``weight`` parameter (Linear, Conv1D, norms)
is hooked, under its :data:`OPS` name when its attribute name is one (``.../q_proj`` -> ``"q_proj"``), else under
its dotted name inside the layer (``"attn.c_attn"``), plus ``"layer"``. The computation order used by
:func:`compare` is the order in which the hooks first fired (for Llama / Qwen3 it is the :data:`OPS` order).

Slots. Every model forward of a path is announced by ``probe.on_forward(slots)`` right before it, ``slots`` an
int64 ``[B, S, 2]`` tensor of ``(sequence, position)`` per input slot, ``(-1, -1)`` for padding. The hooks of
that forward see ``[B, S, ...]`` outputs; each real slot's vector is copied (float32 on the CPU; float64 states
stay float64 so that bitwise comparisons stay exact). The announcement is consumed when decoder layer 0 starts:
a forward that was not announced (a reference forward, a gradient-checkpointing recomputation) is skipped and
counted in ``probe.unannounced``. A ``(sequence, position)`` seen twice for the same ``(layer, op)`` keeps the
first copy and is counted in ``probe.duplicates`` (one ``RuntimeWarning`` per probe).

Memory: one token costs ``4 * sum(widths of the ops)`` bytes per layer, about 0.4 MB per layer for an 8B shape
(14 MB per token over 36 layers). Restrict what is kept with ``layers=`` (layer indices), ``ops=`` (op names),
``positions=`` (the ``(sequence, position)`` keys to keep) or ``max_tokens=`` (at most this many keys, the first
ones announced); default: everything. Give both probes the same ``positions`` when the two paths announce tokens
in different orders, as :func:`compare` only uses the keys both probes kept.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import asdict, dataclass, field

import torch
from torch import Tensor, nn

#: Op names of a Llama / Qwen3-style decoder layer, in computation order (``q_norm`` / ``k_norm``: Qwen3 only).
OPS = (
    "input_layernorm",
    "q_proj",
    "q_norm",
    "k_proj",
    "k_norm",
    "v_proj",
    "attention",
    "o_proj",
    "post_attention_layernorm",
    "gate_proj",
    "up_proj",
    "act",
    "down_proj",
    "layer",
)

#: Ops captured with a forward pre-hook: the input of the named module.
_PRE_HOOK_OPS = {"o_proj": "attention", "down_proj": "act"}


def find_layers(model: nn.Module) -> nn.ModuleList:
    """The decoder layers of a causal LM: ``model.model.layers`` (Llama, Qwen, Mistral...) when it is an
    ``nn.ModuleList``, else the largest ``nn.ModuleList`` whose elements are all of one class."""
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if isinstance(layers, nn.ModuleList) and len(layers) > 0:
        return layers
    best = None
    for _, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0 and len({type(m) for m in module}) == 1:
            if best is None or len(module) > len(best):
                best = module
    if best is None:
        raise ValueError(
            f"Probe: found no decoder layers (no nn.ModuleList of identical modules) in {type(model).__name__}"
        )
    return best


def layer_ops(layer: nn.Module) -> list[tuple[str, nn.Module, bool]]:
    """``(op name, module, pre-hook?)`` for the modules of one decoder layer to hook (see the module docstring),
    in registration order, plus ``("layer", layer, False)``."""
    ops: list[tuple[str, nn.Module, bool]] = []
    taken: set[str] = set()
    for name, module in layer.named_modules():
        if not name or any(True for _ in module.children()):
            continue  # the layer itself, or not a leaf
        if not isinstance(getattr(module, "weight", None), (nn.Parameter, Tensor)):
            continue  # dropout, activation, rotary embedding...
        short = name.rsplit(".", 1)[-1]
        op = short if short in OPS and short not in taken else name
        pre = _PRE_HOOK_OPS.get(op)
        if pre is not None and pre not in taken:
            ops.append((pre, module, True))
            taken.add(pre)
        ops.append((op, module, False))
        taken.add(op)
    ops.append(("layer", layer, False))
    return ops


def _first_tensor(x) -> Tensor | None:
    """``x`` when it is a tensor, else the first tensor of a tuple / list (hook inputs and layer outputs)."""
    if isinstance(x, Tensor):
        return x
    if isinstance(x, (tuple, list)):
        for item in x:
            if isinstance(item, Tensor):
                return item
    return None


class Probe:
    """Forward hooks on every op of every decoder layer (see the module docstring).

    ``with Probe(model) as probe: path(model, ..., on_forward=probe.on_forward)``; the hooks are registered at
    construction and removed by ``__exit__`` / :meth:`close`. :meth:`states` returns, per ``(layer, op)`` in
    computation order, ``{(sequence, position): vector}`` (1-D float32 CPU tensors).

    Args:
        model: a Hugging Face causal LM (or any module with a stack of decoder layers, see :func:`find_layers`).
        layers: layer indices to keep (None: all).
        ops: op names to keep (None: all).
        positions: ``(sequence, position)`` keys to keep (None: all).
        max_tokens: keep at most this many distinct keys, the first ones announced (None: no limit).
    """

    def __init__(self, model: nn.Module, *, layers=None, ops=None, positions=None, max_tokens: int | None = None):
        self.layers = find_layers(model)
        self.keep_layers = None if layers is None else {int(i) for i in layers}
        self.keep_ops = None if ops is None else set(ops)
        self.keep_positions = None if positions is None else {(int(s), int(p)) for s, p in positions}
        self.max_tokens = max_tokens
        self.duplicates = 0  # (layer, op, key) seen again: the first copy is kept
        self.unannounced = 0  # forwards without an on_forward announcement (skipped)
        self._states: dict[tuple[int, str], dict[tuple[int, int], Tensor]] = {}
        self._order: list[tuple[int, str]] = []  # (layer, op) in the order the hooks first fired
        self._op_rank: dict[str, int] = {}  # op name -> first firing order over all layers
        self._kept: set[tuple[int, int]] = set()  # keys accepted so far (for max_tokens)
        self._pending: Tensor | None = None  # announced slots, not yet consumed by a forward
        self._current: tuple[int, int, list[tuple[int, int]], Tensor] | None = None  # B, S, keys, rows
        self._warned = False
        self._handles = []
        self._handles.append(self.layers[0].register_forward_pre_hook(self._start_forward))
        for index, layer in enumerate(self.layers):
            if self.keep_layers is not None and index not in self.keep_layers:
                continue
            for op, module, pre in layer_ops(layer):
                if self.keep_ops is not None and op not in self.keep_ops:
                    continue
                if pre:
                    self._handles.append(module.register_forward_pre_hook(self._pre_hook(index, op)))
                else:
                    self._handles.append(module.register_forward_hook(self._hook(index, op)))

    # -- context --------------------------------------------------------------------------------------------

    def __enter__(self) -> Probe:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Remove the hooks (the collected states stay)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def clear(self) -> None:
        """Drop the collected states and counters (the hooks stay)."""
        self._states.clear()
        self._order.clear()
        self._op_rank.clear()
        self._kept.clear()
        self._warned = False
        self.duplicates = self.unannounced = 0

    # -- slots ----------------------------------------------------------------------------------------------

    def on_forward(self, slots: Tensor) -> None:
        """Announce the next model forward: ``slots`` int64 ``[B, S, 2]``, ``(sequence, position)`` per input
        slot, ``(-1, -1)`` for padding."""
        if slots.dim() != 3 or slots.shape[-1] != 2:
            raise ValueError(f"Probe.on_forward: slots must be [B, S, 2], got {tuple(slots.shape)}")
        self._pending = slots.detach().to(device="cpu", dtype=torch.int64)

    def _start_forward(self, module, args) -> None:
        """Pre-hook of decoder layer 0: a forward starts; consume the announcement (or skip this forward)."""
        slots, self._pending = self._pending, None
        if slots is None:
            self._current = None
            self.unannounced += 1
            return
        batch, seq = slots.shape[:2]
        flat = slots.reshape(-1, 2)
        real = (flat[:, 0] >= 0) & (flat[:, 1] >= 0)
        rows = torch.nonzero(real).flatten()  # int64 indices into the flattened [B * S] slots
        keys = [(int(s), int(p)) for s, p in flat[rows].tolist()]
        if self.keep_positions is not None or self.max_tokens is not None:
            keep = []
            for i, key in enumerate(keys):
                if self.keep_positions is not None and key not in self.keep_positions:
                    continue
                if self.max_tokens is not None and key not in self._kept:
                    if len(self._kept) >= self.max_tokens:
                        continue
                    self._kept.add(key)
                keep.append(i)
            rows = rows[torch.tensor(keep, dtype=torch.int64)] if keep else rows[:0]
            keys = [keys[i] for i in keep]
        self._current = (int(batch), int(seq), keys, rows)

    # -- hooks ----------------------------------------------------------------------------------------------

    def _hook(self, layer: int, op: str):
        def hook(module, args, output):
            self._store(layer, op, _first_tensor(output))

        return hook

    def _pre_hook(self, layer: int, op: str):
        def hook(module, args):
            self._store(layer, op, _first_tensor(args))

        return hook

    def _store(self, layer: int, op: str, x: Tensor | None) -> None:
        """Copy the real slots' vectors of ``x`` (``[B, S, ...]``, or ``[B * S, ...]``) into the states."""
        if self._current is None or x is None:
            return
        batch, seq, keys, rows = self._current
        if (layer, op) not in self._states:
            self._states[(layer, op)] = {}
            self._order.append((layer, op))
            self._op_rank.setdefault(op, len(self._op_rank))
        if not keys:
            return
        if x.dim() >= 2 and tuple(x.shape[:2]) == (batch, seq):
            flat = x.detach().reshape(batch * seq, -1)
        elif x.dim() >= 1 and x.shape[0] == batch * seq:
            flat = x.detach().reshape(batch * seq, -1)
        else:
            raise ValueError(
                f"Probe: layer {layer} op {op!r} produced {tuple(x.shape)}, which does not match the "
                f"announced slots [B={batch}, S={seq}]"
            )
        store = self._states[(layer, op)]
        new = [i for i, key in enumerate(keys) if key not in store]
        if len(new) < len(keys):
            self.duplicates += len(keys) - len(new)
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"Probe: (sequence, position) slots seen twice (first at layer {layer} op {op!r}); "
                    f"keeping the first copy",
                    RuntimeWarning,
                    stacklevel=2,
                )
        if not new:
            return
        dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
        picked = rows if len(new) == len(keys) else rows[torch.tensor(new, dtype=torch.int64)]
        values = flat[picked.to(flat.device)].to(dtype).cpu()  # [len(new), D]
        for j, i in enumerate(new):
            store[keys[i]] = values[j]

    # -- results --------------------------------------------------------------------------------------------

    def order(self) -> list[tuple[int, str]]:
        """The captured ``(layer, op)`` in computation order: by layer, then by the order the ops first fired."""
        return sorted(self._order, key=lambda lo: (lo[0], self._op_rank[lo[1]]))

    def states(self) -> dict[tuple[int, str], dict[tuple[int, int], Tensor]]:
        """``{(layer, op): {(sequence, position): 1-D float32 CPU tensor}}`` in computation order."""
        return {lo: self._states[lo] for lo in self.order()}


@dataclass
class Drift:
    """The result of :func:`compare`.

    ``per_layer``: per layer ``{"layer", "max_abs", "mean_abs", "first_op", "equal", "out_max_abs",
    "out_mean_abs"}``, the max / mean ``|delta|`` over every value of every op of the layer, the layer's first
    not-bitwise-equal op (None), and the same two numbers for the layer output alone (the ``"layer"`` op).
    ``per_op``: ``"layer.op"`` (``"3.up_proj"``) -> ``{"layer", "op", "max_abs", "mean_abs", "n_tokens",
    "equal"}`` in computation order. ``tokens``: the number of ``(sequence, position)`` keys compared.
    """

    first_divergent: tuple[int, str] | None
    per_layer: list[dict]
    per_op: dict[str, dict]
    tokens: int = 0
    ops: list[tuple[int, str]] = field(default_factory=list)  # (layer, op) compared, in computation order

    def to_dict(self) -> dict:
        """JSON-ready dict (tuples as lists)."""
        out = asdict(self)
        out["first_divergent"] = None if self.first_divergent is None else list(self.first_divergent)
        out["ops"] = [list(lo) for lo in self.ops]
        return out


def _bitwise_equal(x: Tensor, y: Tensor) -> bool:
    """Same dtype, shape and bit patterns (``-0.0 != 0.0``, a NaN equals the same NaN)."""
    if x.dtype != y.dtype or x.shape != y.shape:
        return False
    ints = {torch.float32: torch.int32, torch.float64: torch.int64}
    return torch.equal(x.contiguous().view(ints[x.dtype]), y.contiguous().view(ints[y.dtype]))


def _nan_max(x: float, y: float) -> float:
    """``max(x, y)``, NaN when either is NaN."""
    return math.nan if math.isnan(x) or math.isnan(y) else max(x, y)


def compare(a: Probe, b: Probe, *, positions: set[tuple[int, int]] | None = None) -> Drift:
    """Compare the states two probes saw for the same ``(sequence, position)`` (optionally only ``positions``).

    For every ``(layer, op)`` both captured, in ``a``'s computation order (:meth:`Probe.order`), over the
    keys both kept: ``delta = a - b`` (float64), ``max_abs = max |delta|``, ``mean_abs = mean |delta|`` over all
    values, and bitwise equality. ``first_divergent`` is the first ``(layer, op)`` not bitwise equal (None: all
    equal). Raises ``ValueError`` when the probes share no ``(layer, op)`` or no token, or when a token's vector
    has different widths in the two probes.
    """
    sa, sb = a.states(), b.states()
    order = [lo for lo in a.order() if lo in sb]
    if not order:
        raise ValueError(
            "compare: the two probes captured no common (layer, op); were they run on the same "
            "model architecture, with the same layers= / ops=?"
        )
    wanted = None if positions is None else {(int(s), int(p)) for s, p in positions}
    per_op: dict[str, dict] = {}
    layers: dict[int, dict] = {}
    first = None
    all_keys: set[tuple[int, int]] = set()
    for layer, op in order:
        keys = sa[(layer, op)].keys() & sb[(layer, op)].keys()
        if wanted is not None:
            keys &= wanted
        keys = sorted(keys)
        entry = {"layer": layer, "op": op, "max_abs": None, "mean_abs": None, "n_tokens": len(keys), "equal": None}
        per_op[f"{layer}.{op}"] = entry
        if not keys:
            continue
        all_keys.update(keys)
        xa = [sa[(layer, op)][k] for k in keys]
        xb = [sb[(layer, op)][k] for k in keys]
        for k, u, v in zip(keys, xa, xb):
            if u.shape != v.shape:
                raise ValueError(
                    f"compare: layer {layer} op {op!r} token {k}: width {tuple(u.shape)} vs {tuple(v.shape)}"
                )
        xa, xb = torch.stack(xa), torch.stack(xb)  # [T, D]
        delta = (xa.double() - xb.double()).abs()
        equal = _bitwise_equal(xa, xb)
        entry.update(max_abs=float(delta.max()), mean_abs=float(delta.mean()), equal=equal)
        if not equal and first is None:
            first = (layer, op)
        acc = layers.setdefault(
            layer,
            {
                "layer": layer,
                "max_abs": 0.0,
                "sum_abs": 0.0,
                "count": 0,
                "first_op": None,
                "equal": True,
                "out_max_abs": None,
                "out_mean_abs": None,
            },
        )
        acc["max_abs"] = _nan_max(acc["max_abs"], entry["max_abs"])
        acc["sum_abs"] += float(delta.sum())
        acc["count"] += delta.numel()
        if not equal and acc["first_op"] is None:
            acc["first_op"] = op
            acc["equal"] = False
        if op == "layer":
            acc["out_max_abs"], acc["out_mean_abs"] = entry["max_abs"], entry["mean_abs"]
    if not all_keys:
        raise ValueError(
            "compare: the two probes share no (sequence, position) token"
            + ("" if wanted is None else " within `positions`")
            + "; were both paths announced with on_forward(slots) over the same sequences?"
        )
    per_layer = []
    for layer in sorted(layers):
        acc = layers[layer]
        per_layer.append(
            {
                "layer": layer,
                "max_abs": acc["max_abs"],
                "mean_abs": acc["sum_abs"] / acc["count"],
                "first_op": acc["first_op"],
                "equal": acc["equal"],
                "out_max_abs": acc["out_max_abs"],
                "out_mean_abs": acc["out_mean_abs"],
            }
        )
    return Drift(first_divergent=first, per_layer=per_layer, per_op=per_op, tokens=len(all_keys), ops=order)
