"""Stored outputs: a fixed, seeded case set whose outputs one machine saves and another compares with.

``python -m parity --save-outputs DIR --backends B1[,B2...]`` runs :data:`CASES` (each case on the first listed
backend that serves it) and writes ``DIR/outputs.pt`` (a ``torch.save`` dict of CPU tensors) and
``DIR/manifest.json`` (backend, device, versions, commit, command). ``--against DIR`` (:mod:`parity.against`)
regenerates the inputs from the stored seed, checks them against the stored SHA-256 of each input, and compares.

Small tensors are stored whole. A larger one (over :data:`FULL_LIMIT` elements) is viewed as ``[shape[0], -1]``
and stored as a fixed sample, :data:`SAMPLE_ROWS` rows by up to :data:`SAMPLE_COLS` columns (its largest columns
included), plus its L2 norm. Bad input (missing or corrupt files, another format or case-set version, an unknown
case, regenerated inputs that differ) raises :class:`StoredError`: exit code 2.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import subprocess
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

import rlk
from parity import cases as cs
from parity import chain, rl
from parity import run as pr
from rlk.core import abi, contract, dispatch

FORMAT = "rlk-parity-stored-outputs"
#: Version of the file layout, and of the case set (sizes, features, seeds): a file of another version is refused.
FORMAT_VERSION = 1
CASE_SET_VERSION = 1
OUTPUTS_FILE, MANIFEST_FILE = "outputs.pt", "manifest.json"
#: What a manifest must hold besides the format (:func:`manifest_of` writes them; reports read them).
MANIFEST_KEYS = ("backends", "device", "device_name", "versions", "commit", "command", "created", "outputs_sha256")

#: Tensors of at most this many elements are stored whole; larger ones as a sample and their norm.
FULL_LIMIT = 4096
SAMPLE_ROWS = 4
SAMPLE_COLS = 1024
#: Columns of a sample picked by size (the largest entries over the sampled rows: a log-prob gradient's targets).
TOP_COLS = 32

CPU = torch.device("cpu")
LOGPROB, CHAIN, RL = "logprob", "chain", "rl"
DTYPES = ("bfloat16", "float16", "float32")


class StoredError(Exception):
    """Bad input for stored-outputs mode (missing or corrupt files, version or case mismatch): exit code 2."""


# ---------------------------------------------------------------------------
# the case set
# ---------------------------------------------------------------------------


@dataclass(frozen=True)
class StoredCase:
    """One case of the set: a parity case (``parity.cases.Case``, ``parity.chain.ChainCase`` or
    ``parity.rl.RLCase``) in one dtype (``"bfloat16"``, ``"float16"`` or ``"float32"``)."""

    case: cs.Case | chain.ChainCase | rl.RLCase
    dtype: str

    @property
    def op(self) -> str:
        return self.case.op

    @property
    def family(self) -> str:
        if isinstance(self.case, cs.Case):
            return LOGPROB
        return CHAIN if isinstance(self.case, chain.ChainCase) else RL

    @property
    def key(self) -> str:
        """The case's name in the stored file: ``op dtype label``."""
        return f"{self.op} {self.dtype} {self.case.label()}"


def _chain_case(op: str, size: tuple, variant: str) -> chain.ChainCase:
    return chain.ChainCase(op, size, variant, dict(chain.VARIANTS[op])[variant])


def _rl_case(op: str, rows: int, cols: int, variant: str, **extra) -> rl.RLCase:
    return rl.RLCase(op, rows, cols, variant, dict(rl.VARIANTS[op])[variant] + tuple(extra.items()))


#: What rlk-rocm serves (selected_logprob, rms_norm) and linear_logprob in every dtype, at the real vocabularies
#: (Llama-3 128256, Qwen 151936) and small ones; a few chain and RL ops (cheap) besides.
_LOGPROB_CASES = (
    cs.Case("selected_logprob", 1000, 7, 0, cs.Features(ignore=True, temperature="per_row")),
    cs.Case("selected_logprob", 32000, 33, 0, cs.Features(neg_inf=True, ignore=True, entropy=False)),
    cs.Case("selected_logprob", 128256, 1, 0, cs.Features()),
    cs.Case("selected_logprob", 151936, 4, 0, cs.Features(extreme=True, temperature=0.7)),
    cs.Case("linear_logprob", 1000, 7, 64, cs.Features(ignore=True, temperature="per_row")),
    cs.Case("linear_logprob", 151936, 9, 1536, cs.Features(ignore=True, temperature=1.3)),
)
_CHAIN_CASES = (
    _chain_case("rms_norm", (1, 4096), "llama"),
    _chain_case("rms_norm", (7, 4096), "gemma"),
    _chain_case("rms_norm", (33, 5120), "residual"),
    _chain_case("softmax", (7, 1000), "log_softmax"),
    _chain_case("matmul", (33, 64, 96), "linear+bias"),
    _chain_case("attention", ((1, 5, 37), 4, 2, 64), "causal"),
)
_RL_CASES = (
    _rl_case("policy_loss", 7, 300, "ppo dual-clip token-mean"),
    _rl_case("kl_penalty", 7, 300, "k3"),
    _rl_case("gae", 7, 300, f"gamma={rl.GAMMA} lam={rl.LAM}"),
    _rl_case("group_advantages", 64, 8, "grpo", group_size=8),
)
CASES: tuple[StoredCase, ...] = tuple(
    StoredCase(case, dtype) for case in _LOGPROB_CASES + _CHAIN_CASES for dtype in DTYPES
) + tuple(StoredCase(case, "float32") for case in _RL_CASES)


def case_table() -> dict[str, StoredCase]:
    """Every case of the set by key."""
    return {sc.key: sc for sc in CASES}


def select_cases(ops: list[str], dtypes: list[str]) -> list[StoredCase]:
    """The cases of the set whose op is in ``ops`` and dtype in ``dtypes`` (names as ``"float32"``)."""
    return [sc for sc in CASES if sc.op in ops and sc.dtype in dtypes]


# ---------------------------------------------------------------------------
# inputs
# ---------------------------------------------------------------------------


def make_low(sc: StoredCase, seed: int):
    """The case's inputs as cast to its dtype, on the CPU (the suite's seeded generator): a
    ``parity.cases.Inputs`` (log-prob ops) or a dict of tensors."""
    dtype = pr.DTYPES[sc.dtype]
    if sc.family == LOGPROB:
        return cs.make_inputs(sc.case, seed).cast(dtype, CPU)
    if sc.family == CHAIN:
        return chain.cast(chain.make_inputs(sc.case, seed), dtype, CPU)
    return rl.cast(rl.make_inputs(sc.case, seed), dtype, CPU)


def named_inputs(sc: StoredCase, low) -> dict[str, torch.Tensor | float]:
    """The inputs of :func:`make_low` by name (a float temperature as a float)."""
    if sc.family != LOGPROB:
        return dict(low)
    named = {"x": low.x, "weight": low.weight, "targets": low.targets, "temperature": low.temperature}
    named |= {"c1": low.c1, "c2": low.c2}
    return {name: value for name, value in named.items() if value is not None}


def checksum(value: torch.Tensor | float) -> str:
    """SHA-256 (hex) of a tensor's dtype, shape and bytes, or of a float's ``repr``."""
    digest = hashlib.sha256()
    if not isinstance(value, torch.Tensor):
        digest.update(repr(float(value)).encode())
        return digest.hexdigest()
    t = value.detach().cpu().contiguous()
    digest.update(f"{t.dtype} {tuple(t.shape)}".encode())
    digest.update(t.reshape(-1).view(torch.uint8).numpy())
    return digest.hexdigest()


def input_checksums(sc: StoredCase, low) -> dict[str, str]:
    """:func:`checksum` of every input of :func:`make_low`."""
    return {name: checksum(value) for name, value in named_inputs(sc, low).items()}


def to_device(sc: StoredCase, low, device: torch.device):
    """The inputs of :func:`make_low` moved to ``device`` (the same bits)."""
    dtype = pr.DTYPES[sc.dtype]
    if sc.family == LOGPROB:
        return low.cast(dtype, device)
    if sc.family == CHAIN:
        return chain.cast(low, dtype, device)
    return rl.cast(low, dtype, device)


# ---------------------------------------------------------------------------
# running a case and its fp64 ground truth
# ---------------------------------------------------------------------------


@dataclass
class Produced:
    """What one call produced: ``values`` (outputs, per row or element) and the inputs' ``grads``."""

    values: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]


@dataclass
class Truth:
    """fp64 ground truth of a case: outputs and gradients, each output's contract scale (its shape), the
    gradients' ``max_scale`` and term magnitudes (``rlk.core.contract.compare_grad``)."""

    produced: Produced
    scales: dict[str, torch.Tensor]
    max_scale: float = 0.0
    magnitudes: dict[str, torch.Tensor] = field(default_factory=dict)


def produce(sc: StoredCase, low) -> Produced:
    """The public op forward and backward on the pinned backend (the suite's loss of each family)."""
    if sc.family == LOGPROB:
        out = pr.forward_backward(sc.op, low, sc.case.features.entropy)
        values = {"logprob": out.logprob} | ({} if out.entropy is None else {"entropy": out.entropy})
        return Produced(values, out.grads)
    module = chain if sc.family == CHAIN else rl
    out = module.forward_backward(sc.op, sc.case.kwargs, low)
    return Produced(out.values, out.grads)


def _shaped(scale: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return scale.reshape(like.shape) if scale.numel() == like.numel() else scale.expand_as(like)


def reference(sc: StoredCase, low, low_cpu, device: torch.device) -> Truth:
    """The public op on fp64 copies of ``low`` pinned to the reference backend, with the suite's scales."""
    if sc.family == LOGPROB:
        truth = pr.ground_truth(sc.op, low, sc.case.features.entropy)
        produced = Produced(
            {"logprob": truth.outputs.logprob}
            | ({} if truth.outputs.entropy is None else {"entropy": truth.outputs.entropy}),
            truth.outputs.grads,
        )
        scales = {name: truth.scale for name in produced.values}
        return Truth(produced, scales, truth.max_scale, truth.magnitudes)
    if sc.family == CHAIN:
        truth = chain.ground_truth(sc.case, low)
        return Truth(Produced(truth.outputs.values, truth.outputs.grads), _scales(truth.outputs.values, truth.scales))
    truth = rl.ground_truth(sc.case, low_cpu, device)
    values, scales = truth.outputs.values, _scales(truth.outputs.values, truth.scales)
    return Truth(Produced(values, truth.outputs.grads), scales, truth.max_scale, truth.magnitudes)


def _scales(values: dict[str, torch.Tensor], scales: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {name: _shaped(scales[name], value) for name, value in values.items()}


def contract_checks(sc: StoredCase, got: Produced, truth: Truth) -> list[contract.Deviation]:
    """Every output (per element) and gradient of ``got`` against the fp64 truth, under the contract (what
    ``parity.run`` / ``chain`` / ``rl`` check in the matrix)."""
    entry = contract.entry(sc.op, sc.dtype)
    ref = truth.produced
    deviations = [
        contract.compare_outputs(
            entry, name, got.values[name].reshape(-1), value.reshape(-1), truth.scales[name].reshape(-1)
        )
        for name, value in ref.values.items()
    ]
    deviations += [
        contract.compare_grad(entry, name, got.grads[name], value, truth.max_scale, truth.magnitudes.get(name))
        for name, value in ref.grads.items()
    ]
    return deviations


# ---------------------------------------------------------------------------
# storing a tensor: whole, or a sample and its norm
# ---------------------------------------------------------------------------


def _pick_rows(n: int, gen: torch.Generator) -> torch.Tensor:
    """All rows if ``n <= SAMPLE_ROWS``, else the first, the last and random others (sorted, int64)."""
    if n <= SAMPLE_ROWS:
        return torch.arange(n)
    middle = torch.randperm(n - 2, generator=gen)[: SAMPLE_ROWS - 2] + 1
    return torch.cat([torch.tensor([0, n - 1]), middle]).sort().values


def _pick_cols(rows: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """All columns of ``rows`` ``[r, m]`` if ``m <= SAMPLE_COLS``, else the ``TOP_COLS`` largest (by max ``|x|``
    over the rows) and random others, ``SAMPLE_COLS`` at most (sorted, int64)."""
    m = rows.shape[1]
    if m <= SAMPLE_COLS:
        return torch.arange(m)
    size = torch.nan_to_num(rows.abs().float(), posinf=torch.finfo(torch.float32).max).amax(dim=0)
    top = size.topk(TOP_COLS).indices
    others = torch.randperm(m, generator=gen)[: SAMPLE_COLS - TOP_COLS]
    return torch.unique(torch.cat([top, others]))


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` viewed as ``[shape[0], -1]`` (a 0-d tensor as ``[1, 1]``)."""
    return t.reshape(t.shape[0] if t.dim() else 1, -1)


def summarize(t: torch.Tensor, gen: torch.Generator) -> dict:
    """What the file keeps of ``t``: ``{"shape", "dtype", "full"}``, or for more than ``FULL_LIMIT`` elements
    ``{"shape", "dtype", "rows", "cols", "sample", "norm"}`` (``sample = as_rows(t)[rows][:, cols]``, int64
    indices, ``norm`` the fp64 L2 norm of all of ``t``). Tensors on the CPU, in ``t``'s dtype."""
    t = t.detach().cpu()
    record = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")}
    if t.numel() <= FULL_LIMIT:
        return record | {"full": t.clone()}
    flat = as_rows(t)
    rows = _pick_rows(flat.shape[0], gen)
    cols = _pick_cols(flat[rows], gen)
    norm = float(torch.linalg.vector_norm(t.double()))
    return record | {"rows": rows, "cols": cols, "sample": flat[rows][:, cols].clone(), "norm": norm}


def take(t: torch.Tensor, record: dict) -> torch.Tensor:
    """The part of ``t`` (shaped as the stored tensor) that ``record`` keeps: all of it, or its sample."""
    if "full" in record:
        return t
    flat = as_rows(t)
    return flat[record["rows"].to(t.device)][:, record["cols"].to(t.device)]


def stored_tensor(record: dict) -> torch.Tensor:
    """The tensor ``record`` keeps (the whole tensor or its sample)."""
    return record["full"] if "full" in record else record["sample"]


def summarize_all(sc: StoredCase, produced: Produced, seed: int) -> dict[str, dict[str, dict]]:
    """``{"values": {name: record}, "grads": {name: record}}`` of :func:`summarize` (samples seeded per tensor)."""
    out: dict[str, dict[str, dict]] = {"values": {}, "grads": {}}
    for kind, tensors in (("values", produced.values), ("grads", produced.grads)):
        for name, t in tensors.items():
            out[kind][name] = summarize(t, cs.generator(seed, f"stored {sc.key} {name}"))
    return out


# ---------------------------------------------------------------------------
# the files
# ---------------------------------------------------------------------------


def _sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write(folder: Path, payload: dict, manifest: dict) -> None:
    """``folder/outputs.pt`` (``payload``) and ``folder/manifest.json`` (``manifest`` plus the outputs file's
    SHA-256 and size)."""
    folder.mkdir(parents=True, exist_ok=True)
    outputs = folder / OUTPUTS_FILE
    torch.save(payload, outputs)
    manifest = manifest | {"outputs_file": OUTPUTS_FILE, "outputs_sha256": _sha256_file(outputs)}
    manifest["outputs_bytes"] = outputs.stat().st_size
    (folder / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2) + "\n")


def _versions_ok(where: str, record: dict) -> None:
    if record.get("format") != FORMAT:
        raise StoredError(f"{where}: not a stored-outputs file (format {record.get('format')!r}, expected {FORMAT!r})")
    got = (record.get("format_version"), record.get("case_set_version"))
    if got != (FORMAT_VERSION, CASE_SET_VERSION):
        raise StoredError(
            f"{where}: format version {got[0]}, case set version {got[1]}; this parity reads format "
            f"{FORMAT_VERSION}, case set {CASE_SET_VERSION}: save the outputs again with --save-outputs"
        )


def _read_manifest(folder: Path) -> dict:
    if not folder.is_dir():
        raise StoredError(f"--against {folder}: no such folder (make one with --save-outputs DIR)")
    path = folder / MANIFEST_FILE
    if not path.is_file():
        raise StoredError(f"--against {folder}: no {MANIFEST_FILE} (not a folder written by --save-outputs)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise StoredError(f"{path}: not readable JSON ({type(exc).__name__}: {exc})") from exc
    if not isinstance(manifest, dict):
        raise StoredError(f"{path}: not a JSON object")
    _versions_ok(str(path), manifest)
    missing = [key for key in MANIFEST_KEYS if key not in manifest]
    if missing or not isinstance(manifest["backends"], dict) or not isinstance(manifest["versions"], dict):
        raise StoredError(f"{path}: missing or malformed {', '.join(missing) or 'backends / versions'}")
    return manifest


def load(folder: Path) -> tuple[dict, dict]:
    """``(manifest, payload)`` of a stored-outputs folder, checked: format and case-set versions, the outputs
    file's SHA-256 against the manifest, every case known to this case set. Raises :class:`StoredError`."""
    manifest = _read_manifest(folder)
    path = folder / str(manifest.get("outputs_file", OUTPUTS_FILE))
    if not path.is_file():
        raise StoredError(f"--against {folder}: no {path.name} (the manifest names it)")
    if _sha256_file(path) != manifest.get("outputs_sha256"):
        raise StoredError(f"{path}: SHA-256 differs from {MANIFEST_FILE}'s (a corrupt or edited file)")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise StoredError(f"{path}: cannot be read ({type(exc).__name__}: {exc})") from exc
    if not isinstance(payload, dict) or not isinstance(payload.get("cases"), dict):
        raise StoredError(f"{path}: no 'cases' table")
    if not isinstance(payload.get("seed"), int):
        raise StoredError(f"{path}: no integer 'seed'")
    _versions_ok(str(path), payload)
    known = case_table()
    for key, record in payload["cases"].items():
        if key not in known:
            raise StoredError(f"{path}: unknown case {key!r} (not in case set {CASE_SET_VERSION})")
        _record_ok(path, key, record)
    return manifest, payload


def _record_ok(path: Path, key: str, record: object) -> None:
    """Raise :class:`StoredError` unless ``record`` has its backend, input checksums, values and grads."""

    def require(condition: bool, what: str) -> None:
        if not condition:
            raise StoredError(f"{path}: case {key!r} has a malformed record ({what})")

    require(isinstance(record, dict), "not a dict")
    require(isinstance(record.get("backend"), str) and isinstance(record.get("inputs"), dict), "backend, inputs")
    for kind in ("values", "grads"):
        require(isinstance(record.get(kind), dict), kind)
        for name, t in record[kind].items():
            require(isinstance(t, dict) and isinstance(t.get("shape"), list), f"{kind} {name}: shape")
            if "full" in t:
                require(isinstance(t["full"], torch.Tensor) and list(t["full"].shape) == t["shape"], f"{name}: full")
                continue
            parts = [t.get(k) for k in ("rows", "cols", "sample")]
            require(all(isinstance(p, torch.Tensor) for p in parts) and isinstance(t.get("norm"), float), name)
            require(tuple(parts[2].shape) == (parts[0].numel(), parts[1].numel()), f"{name}: sample shape")


def verify_inputs(cases: list[StoredCase], payload: dict) -> None:
    """Regenerate every case's inputs from the stored seed; raise :class:`StoredError` where one differs from its
    stored checksum (torch's CPU generator or the case's definition changed)."""
    seed = int(payload["seed"])
    for sc in cases:
        got = input_checksums(sc, make_low(sc, seed))
        want = payload["cases"][sc.key]["inputs"]
        differ = sorted(name for name in set(got) | set(want) if got.get(name) != want.get(name))
        if differ:
            raise StoredError(
                f"case {sc.key!r}: regenerated input(s) {', '.join(differ)} differ from the stored checksums "
                f"(torch {torch.__version__}'s CPU generator or the case set changed)"
            )


# ---------------------------------------------------------------------------
# saving
# ---------------------------------------------------------------------------


@dataclass
class Saved:
    """One case of a save: the backend that ran it, its contract check against fp64 and its record (or why it
    was not saved)."""

    sc: StoredCase
    backend: str | None = None
    deviations: list[contract.Deviation] = field(default_factory=list)
    error: str | None = None
    reason: str | None = None
    record: dict | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and all(d.ok for d in self.deviations)


def why_not(sc: StoredCase, backend: str, device: torch.device) -> str | None:
    """Why ``backend`` does not run ``sc`` on ``device`` (it declines the op or dtype, or the suite's run-time
    limit of the Triton interpreter), or None."""
    reason = dispatch.why_not(backend, abi.OPS[sc.op], device, pr.DTYPES[sc.dtype])
    if reason is None and sc.family == LOGPROB:
        reason = cs.skip_reason(backend, device, sc.case)
    return reason


def _serving_backend(sc: StoredCase, backends: list[str], device: torch.device) -> tuple[str | None, str]:
    """The first of ``backends`` that runs ``sc`` here, or None and every backend's reason."""
    reasons = []
    for name in backends:
        reason = why_not(sc, name, device)
        if reason is None:
            return name, ""
        reasons.append(f"{name}: {reason}")
    return None, "; ".join(reasons)


def save_case(sc: StoredCase, backends: list[str], device: torch.device, seed: int) -> Saved:
    """Run ``sc`` on the first of ``backends`` that serves it; check it against fp64; summarize its outputs."""
    backend, reason = _serving_backend(sc, backends, device)
    if backend is None:
        return Saved(sc, reason=reason)
    saved = Saved(sc, backend)
    try:
        low_cpu = make_low(sc, seed)
        low = to_device(sc, low_cpu, device)
        with rlk.use_backend(backend):
            got = produce(sc, low)
        saved.deviations = contract_checks(sc, got, reference(sc, low, low_cpu, device))
        record = {"op": sc.op, "dtype": sc.dtype, "label": sc.case.label(), "backend": backend}
        record["inputs"] = input_checksums(sc, low_cpu)
        record["check"] = {d.name: d.ratio for d in saved.deviations}
        saved.record = record | summarize_all(sc, got, seed)
    except Exception as exc:
        saved.error = f"{type(exc).__name__}: {exc}"
        traceback.print_exc(file=sys.stderr)
    return saved


def git_commit() -> dict:
    """``{"commit", "dirty"}`` of the checkout holding ``parity/`` (``"unknown"`` without git)."""
    root = Path(__file__).resolve().parent.parent

    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=True).stdout.strip()

    try:
        return {"commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}
    except (OSError, subprocess.CalledProcessError):
        return {"commit": "unknown", "dirty": None}


def payload_of(saved: list[Saved], seed: int) -> dict:
    """The dict ``outputs.pt`` holds."""
    cases = {s.sc.key: s.record for s in saved if s.record is not None}
    head = {"format": FORMAT, "format_version": FORMAT_VERSION, "case_set_version": CASE_SET_VERSION}
    return head | {"seed": seed, "cases": cases}


def manifest_of(saved: list[Saved], seed: int, env: dict) -> dict:
    """``manifest.json`` (without the outputs file's checksum, which :func:`write` adds)."""
    head = {"format": FORMAT, "format_version": FORMAT_VERSION, "case_set_version": CASE_SET_VERSION, "seed": seed}
    used = sorted({s.backend for s in saved if s.record is not None})
    return head | {
        "backends": {name: env["backend_versions"].get(name) for name in used},
        "device": env["device"],
        "device_name": env["device_name"],
        "versions": {k: env[k] for k in ("rlk", "abi", "torch", "cuda", "hip", "triton", "python", "platform")},
        **git_commit(),
        "command": env["command"],
        "env": env["env"],
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cases": [
            {"key": s.sc.key, "backend": s.backend, "worst_vs_fp64": max(s.record["check"].values(), default=0.0)}
            for s in saved
            if s.record is not None
        ],
        "not_saved": [{"key": s.sc.key, "reason": s.reason} for s in saved if s.reason is not None],
    }


def save_all(
    cases: list[StoredCase], backends: list[str], device: torch.device, seed: int, progress: Callable[[str], None]
) -> list[Saved]:
    """:func:`save_case` for every case, one progress line each."""
    saved = []
    for i, sc in enumerate(cases, 1):
        s = save_case(sc, backends, device, seed)
        saved.append(s)
        progress(f"[{i}/{len(cases)}] {sc.key}: {_save_line(s)}")
    return saved


def _save_line(s: Saved) -> str:
    if s.reason is not None:
        return f"not saved ({s.reason})"
    if s.error is not None:
        return f"FAIL on {s.backend}: error {s.error}"
    worst = max(s.deviations, key=lambda d: d.ratio)
    return f"{'PASS' if s.ok else 'FAIL'} on {s.backend}, worst vs fp64 {worst.ratio:.3g} ({worst.name})"
