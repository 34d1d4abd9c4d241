"""The parity case matrix and its deterministic inputs.

A *value case* is one problem size (``V`` vocab entries, ``N`` rows, hidden size
``H`` for ``linear_logprob``) with a few input features switched on (ignored
rows, logits of +-1e4, ``-inf`` logits, a temperature, the entropy output). The
features rotate over the sizes, so each appears in several cases without the
full cross product.

An *invariance plan* says how one probe row is embedded in batches of other
rows to check that a batch-invariant backend gives it the same bits.

Inputs are drawn on the CPU from a ``torch.Generator`` seeded by the run seed
and the case label, so every backend and every run sees the same values; they
are then cast to the case dtype and moved to the device.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, replace

import torch

import rlk

OPS = ("selected_logprob", "linear_logprob")
IGNORE_INDEX = -100

VOCABS = (1000, 32000, 128256, 151936)
ROWS = {"cuda": (1, 7, 133, 4096), "cpu": (1, 7, 33)}
#: Hidden size of ``linear_logprob`` per vocab size: on the GPU, real (V, H) pairs (Llama-2 7B,
#: Llama-3 8B, Qwen2 1.5B; 1024 for the toy vocab); on the CPU a small H keeps the run short.
HIDDEN = {"cuda": {1000: 1024, 32000: 4096, 128256: 4096, 151936: 1536}, "cpu": 64}
QUICK_VOCABS = (1000, 151936)
QUICK_ROWS = (1, 7)

#: The Triton interpreter runs ``linear_logprob`` at a few seconds per thousand vocab
#: entries; larger vocabularies are skipped there to keep the CPU run within minutes.
INTERPRETER_MAX_LINEAR_VOCAB = 32000

#: Invariance: the vocab size and the batch sizes a probe row is embedded in.
INVARIANCE_VOCAB = {
    "cuda": {"selected_logprob": 151936, "linear_logprob": 151936},
    "cpu": {"selected_logprob": 32000, "linear_logprob": 1000},
}
INVARIANCE_BATCHES = {"cuda": (7, 133, 4096), "cpu": (7, 33)}
QUICK_INVARIANCE_BATCHES = (7,)

#: Typical logit spread of a language model head (standard deviation of the logits).
LOGIT_STD = 3.0
EXTREME = 1e4


@dataclass(frozen=True)
class Features:
    """Input features of a value case.

    Attributes:
        ignore: about a quarter of the rows (at least one, never all) have
            ``target == ignore_index``.
        extreme: logits of magnitude ``1e4`` (selected: +1e4 target logits,
            +-1e4 entries and rows spread over [-1e4, 1e4]; linear: rows whose
            hidden state is scaled so that their logits reach about 1e4).
        neg_inf: ``-inf`` logits, never a whole row nor a target (selected only:
            a matmul cannot produce them).
        temperature: a float, or ``"per_row"`` for a tensor of per-row
            temperatures in [0.5, 2].
        entropy: also return (and differentiate) the entropy.
        spans: with ``ignore``, the scored rows are given as ``loss_spans`` instead (a span table over the rows
            seen as one ``[1, N]`` sequence; the ignored rows' targets are valid token ids, as a visual or
            prompt token's would be): ``"host"``, a CPU table (``linear_logprob`` then computes the scored rows
            only), or ``"device"``, a table on the inputs' device. Ground truth uses ``ignore_index`` targets.
    """

    ignore: bool = False
    extreme: bool = False
    neg_inf: bool = False
    temperature: float | str = 1.0
    entropy: bool = True
    spans: str = ""

    def label(self) -> str:
        parts = []
        if self.ignore:
            parts.append("ignore")
        if self.extreme:
            parts.append("1e4")
        if self.neg_inf:
            parts.append("-inf")
        if self.temperature == "per_row":
            parts.append("T=row")
        elif self.temperature != 1.0:
            parts.append(f"T={self.temperature}")
        if self.entropy:
            parts.append("entropy")
        if self.spans:
            parts.append(f"spans={self.spans}")
        return ",".join(parts) or "plain"


#: Feature sets, assigned to the (V, N) grid in turn.
FEATURE_CYCLE = (
    Features(),
    Features(ignore=True, temperature="per_row"),
    Features(extreme=True, temperature=0.7),
    Features(neg_inf=True, ignore=True, entropy=False, spans="device"),
    Features(neg_inf=True, temperature="per_row"),
    Features(extreme=True, ignore=True, temperature=1.3, entropy=False, spans="host"),
)


@dataclass(frozen=True)
class Case:
    """One value case of one op (``hidden`` is 0 for ``selected_logprob``)."""

    op: str
    vocab: int
    rows: int
    hidden: int
    features: Features

    def label(self) -> str:
        size = f"V={self.vocab} N={self.rows}" + (f" H={self.hidden}" if self.hidden else "")
        return f"{size} [{self.features.label()}]"


@dataclass(frozen=True)
class InvariancePlan:
    """A probe row alone (N=1) versus inside batches of ``batches`` rows at first/middle/last position."""

    op: str
    vocab: int
    hidden: int
    batches: tuple[int, ...]

    def positions(self, batch: int) -> tuple[int, ...]:
        return tuple(sorted({0, batch // 2, batch - 1}))


def _hidden_size(device_type: str, vocab: int) -> int:
    sizes = HIDDEN[device_type]
    return sizes if isinstance(sizes, int) else sizes[vocab]


def value_cases(op: str, device_type: str, quick: bool) -> list[Case]:
    """The value cases of ``op`` on a device type (``"cuda"`` or ``"cpu"``)."""
    vocabs = QUICK_VOCABS if quick else VOCABS
    rows = QUICK_ROWS if quick else ROWS[device_type]
    cases = []
    for r_index, n_rows in enumerate(rows):
        for v_index, vocab in enumerate(vocabs):
            features = FEATURE_CYCLE[(r_index * len(vocabs) + v_index) % len(FEATURE_CYCLE)]
            if n_rows == 1:
                features = replace(features, ignore=False, spans="")  # a single row is never ignored
            if op == "linear_logprob":
                features = replace(features, neg_inf=False)
            hidden = _hidden_size(device_type, vocab) if op == "linear_logprob" else 0
            cases.append(Case(op, vocab, n_rows, hidden, features))
    return cases


def invariance_plan(op: str, device_type: str, quick: bool) -> InvariancePlan:
    """Where the batch-invariance probe of ``op`` runs on a device type."""
    vocab = INVARIANCE_VOCAB[device_type][op]
    hidden = _hidden_size(device_type, vocab) if op == "linear_logprob" else 0
    batches = QUICK_INVARIANCE_BATCHES if quick else INVARIANCE_BATCHES[device_type]
    return InvariancePlan(op, vocab, hidden, batches)


def interpreted(backend: str, device: torch.device) -> bool:
    """Whether ``backend`` runs its kernels in an interpreter here (Triton on the CPU)."""
    return backend == "triton" and device.type == "cpu"


def skip_reason(backend: str, device: torch.device, case: Case) -> str | None:
    """Why ``backend`` skips ``case`` on ``device`` (run-time limits), or None."""
    if interpreted(backend, device) and case.op == "linear_logprob" and case.vocab > INTERPRETER_MAX_LINEAR_VOCAB:
        return f"Triton interpreter: linear_logprob limited to V <= {INTERPRETER_MAX_LINEAR_VOCAB} (run time)"
    return None


# ---------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Inputs:
    """The arguments of one op call plus the loss coefficients.

    ``x`` is the per-row input: logits ``[N, V]`` (selected) or hidden ``[N, H]``
    (linear); ``weight`` is ``[V, H]`` (linear) or None. The loss is
    ``sum(c1 * logprob + c2 * entropy)`` with fp32 per-row ``c1``, ``c2``. ``loss_spans`` (a CPU ``[S, 4]`` span table
    over ``[1, N]``, or None) and ``spans_on`` (``"host"`` or ``"device"``): the op is called with the
    scored rows as spans (:attr:`Features.spans`).
    """

    x: torch.Tensor
    weight: torch.Tensor | None
    targets: torch.Tensor
    temperature: float | torch.Tensor
    c1: torch.Tensor
    c2: torch.Tensor
    loss_spans: torch.Tensor | None = None
    spans_on: str = ""

    def cast(self, dtype: torch.dtype, device: torch.device) -> Inputs:
        """``x`` and ``weight`` in ``dtype``, everything on ``device``; fp64 also upcasts
        the temperature tensor and coefficients (a ground-truth run)."""
        aux = torch.float64 if dtype == torch.float64 else torch.float32
        temperature = self.temperature
        if isinstance(temperature, torch.Tensor):
            temperature = temperature.to(device=device, dtype=aux)
        return Inputs(
            x=self.x.to(device=device, dtype=dtype),
            weight=None if self.weight is None else self.weight.to(device=device, dtype=dtype),
            targets=self.targets.to(device),
            temperature=temperature,
            c1=self.c1.to(device=device, dtype=aux),
            c2=self.c2.to(device=device, dtype=aux),
            loss_spans=self.loss_spans,
            spans_on=self.spans_on,
        )

    @property
    def rows(self) -> int:
        return self.x.shape[0]


def generator(seed: int, label: str) -> torch.Generator:
    """A CPU generator seeded by the run seed and a label (stable across runs and processes)."""
    return torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(label.encode()))


def _apply_extreme_selected(logits: torch.Tensor, targets: torch.Tensor, gen: torch.Generator) -> None:
    n_rows, vocab = logits.shape
    for r in range(n_rows):
        kind = r % 3
        if kind == 0:
            logits[r, targets[r]] = EXTREME
        elif kind == 1:
            cols = torch.randint(0, vocab, (8,), generator=gen)
            logits[r, cols] = -EXTREME
            logits[r, cols[0]] = EXTREME
        else:
            logits[r] = (torch.rand(vocab, generator=gen) * 2 - 1) * EXTREME


def _apply_neg_inf(logits: torch.Tensor, targets: torch.Tensor, gen: torch.Generator) -> None:
    """Row 0: only the target and two other entries finite; other even rows: ~10% ``-inf``."""
    n_rows, vocab = logits.shape
    for r in range(0, n_rows, 2):
        if r == 0:
            mask = torch.ones(vocab, dtype=torch.bool)
            mask[torch.randint(0, vocab, (2,), generator=gen)] = False
        else:
            mask = torch.rand(vocab, generator=gen) < 0.1
        mask[targets[r]] = False
        logits[r, mask] = -math.inf


def _ignored_rows(n_rows: int, gen: torch.Generator) -> torch.Tensor:
    count = max(1, n_rows // 4) if n_rows > 1 else 0
    return torch.randperm(n_rows, generator=gen)[:count]


def make_inputs(case: Case, seed: int) -> Inputs:
    """fp32 CPU inputs of a value case (cast them with :meth:`Inputs.cast`)."""
    gen = generator(seed, f"{case.op} {case.label()}")
    f = case.features
    n_rows, vocab = case.rows, case.vocab
    targets = torch.randint(0, vocab, (n_rows,), generator=gen)
    weight = None
    if case.op == "selected_logprob":
        x = torch.randn(n_rows, vocab, generator=gen) * LOGIT_STD
        # sampled tokens are usually likely ones: lift the target logit of each row by U(0, 8)
        x[torch.arange(n_rows), targets] += torch.rand(n_rows, generator=gen) * 8
        if f.extreme:
            _apply_extreme_selected(x, targets, gen)
        if f.neg_inf:
            _apply_neg_inf(x, targets, gen)
    else:
        x = torch.randn(n_rows, case.hidden, generator=gen)
        weight = torch.randn(vocab, case.hidden, generator=gen) * (LOGIT_STD / math.sqrt(case.hidden))
        if f.extreme:
            x[::3] *= EXTREME / (4 * LOGIT_STD)  # logits of those rows: std ~2500, max ~1e4
    if f.ignore:
        targets[_ignored_rows(n_rows, gen)] = IGNORE_INDEX
    if f.temperature == "per_row":
        temperature = 0.5 + 1.5 * torch.rand(n_rows, generator=gen)
    else:
        temperature = float(f.temperature)
    c1 = torch.randn(n_rows, generator=gen)
    c2 = torch.randn(n_rows, generator=gen)
    loss_spans = rlk.multimodal.mask_to_spans((targets != IGNORE_INDEX)[None]) if f.spans else None
    return Inputs(x, weight, targets, temperature, c1, c2, loss_spans, f.spans)


def make_invariance_inputs(plan: InvariancePlan, seed: int) -> tuple[Inputs, Inputs]:
    """fp32 CPU inputs of an invariance check: ``(probe, others)``.

    ``probe`` is one row; ``others`` has ``max(batches) - 1`` different rows
    (each with its own logit scale, per-row temperature, some ignored) sharing
    the probe's ``weight`` (linear). Every tensor input is per row, including
    the temperature.
    """
    gen = generator(seed, f"{plan.op} invariance V={plan.vocab} H={plan.hidden}")
    n_rows = max(plan.batches)  # row 0 is the probe
    targets = torch.randint(0, plan.vocab, (n_rows,), generator=gen)
    scale = 0.5 + 3.5 * torch.rand(n_rows, 1, generator=gen)
    weight = None
    if plan.op == "selected_logprob":
        x = torch.randn(n_rows, plan.vocab, generator=gen) * LOGIT_STD * scale
    else:
        x = torch.randn(n_rows, plan.hidden, generator=gen) * scale
        weight = torch.randn(plan.vocab, plan.hidden, generator=gen) * (LOGIT_STD / math.sqrt(plan.hidden))
    ignored = _ignored_rows(n_rows - 1, gen) + 1
    targets[ignored] = IGNORE_INDEX
    temperature = 0.5 + 1.5 * torch.rand(n_rows, generator=gen)
    c1 = torch.randn(n_rows, generator=gen)
    c2 = torch.randn(n_rows, generator=gen)
    everything = Inputs(x, weight, targets, temperature, c1, c2)
    return select_rows(everything, torch.tensor([0])), select_rows(everything, torch.arange(1, n_rows))


def select_rows(inputs: Inputs, index: torch.Tensor) -> Inputs:
    """The rows ``index`` of every per-row tensor (``weight`` is shared)."""
    return Inputs(
        x=inputs.x[index].contiguous(),
        weight=inputs.weight,
        targets=inputs.targets[index],
        temperature=inputs.temperature[index],
        c1=inputs.c1[index],
        c2=inputs.c2[index],
    )


def embed_probe(probe: Inputs, others: Inputs, batch: int, position: int) -> Inputs:
    """A batch of ``batch`` rows: ``batch - 1`` of ``others`` with ``probe`` inserted at ``position``."""
    rest = batch - 1

    def cat(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return torch.cat([b[:position], a, b[position:rest]])

    return Inputs(
        x=cat(probe.x, others.x),
        weight=probe.weight,
        targets=cat(probe.targets, others.targets),
        temperature=cat(probe.temperature, others.temperature),
        c1=cat(probe.c1, others.c1),
        c2=cat(probe.c2, others.c2),
    )
