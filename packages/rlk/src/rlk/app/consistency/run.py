"""``rlk consistency``: the rollout-vs-training chain test, with rlk's batch-invariant chain off and on.

For ``enabled`` in (False, True), on one model built once (:func:`rlk.app.consistency.harness.build_model`):

1. rollout (:func:`rlk.app.consistency.paths.rollout`) of the fixed prompt set under
   :func:`~rlk.integrations.hf.chain.chain` ``(model, enabled)``, with a :class:`~rlk.app.consistency.probe.Probe`;
   the sampling seed is the same for both chains, each chain samples its own responses with ``rlk.sample``
   (per-sequence seeds :func:`~rlk.app.consistency.paths.sequence_seeds`, step = the token's index in its
   response): a token is a function of its logits row's bits, the seed, the sequence index and the step, so the
   chains sample the same tokens as long as their logits rows are bitwise equal, and their responses part only
   where a drifted logit flips the Gumbel-max argmax;
2. training log-probs (:func:`~rlk.app.consistency.paths.training_logprobs`) of the same sampled tokens, under
   the same chain, in two micro-batch splits: A = every sequence packed in one micro-batch, B = ``[0]``,
   ``[1, 2]``, ``[3, ...]``; both with ``backward=True`` (the per-sequence input-embedding gradients are
   compared across the splits), B with a Probe;
3. the numbers: per response token ``|rollout lp - training lp|`` (split A), ``|lp_A - lp_B|``, per sequence
   whether the gradients of A and B are equal bit for bit, and the error of both paths against the
   ground truth (:func:`~rlk.app.consistency.harness.reference_logprobs`); the probe's layer-wise drift between
   the rollout and training split B; timed forward passes without the probe (tokens/s).

Verdicts (``report["verdicts"]``): the rlk-on claims are bitwise and judged with ``torch.equal``; rlk off
must drift on a GPU (otherwise the comparison proves nothing; on the CPU stock kernels may agree, so
there it is reported only); the error against the ground truth is judged with the contract table
(:mod:`rlk.core.contract`, entry ``selected_logprob`` of the model's dtype, see :func:`_contract_verdict`).

The returned report is a JSON-serializable dict; with ``out`` it is also written as ``report.json``,
``drift.html`` (self-contained) and ``drift.png`` (if matplotlib is installed), see
:mod:`rlk.app.consistency.report`.
"""

from __future__ import annotations

import datetime
import math
import os
import platform
import sys
import time
from importlib import metadata

import torch

#: The histogram of the final log-prob drift |rollout - training|: an exact-zero bin, then decades.
HIST_EDGES = [0.0] + [10.0**k for k in range(-9, 2)] + [math.inf]

SPLIT_A_NAME = "all sequences in one packed micro-batch"
SPLIT_B_NAME = "[0], [1, 2], [3, ...] (three packed micro-batches)"


def split_description(micro_batches: list[list[int]]) -> str:
    """``[[0], [1, 2], [3, 4, 5]]`` -> ``"[0], [1, 2], [3..5] (3 packed micro-batches)"``."""

    def one(mb):
        return f"[{mb[0]}..{mb[-1]}]" if len(mb) > 2 else str(list(mb))

    return f"{', '.join(one(mb) for mb in micro_batches)} ({len(micro_batches)} packed micro-batches)"


# ---------------------------------------------------------------------------
# environment
# ---------------------------------------------------------------------------


def ensure_interpreter() -> None:
    """On the CPU rlk's chain runs through the Triton interpreter: ``TRITON_INTERPRET=1`` must be set before
    triton is first imported. Sets it when triton is not imported yet; raises ``RuntimeError`` otherwise."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    if "triton" in sys.modules:
        raise RuntimeError(
            "rlk consistency on the CPU runs rlk's chain through the Triton interpreter, but triton was imported "
            "without TRITON_INTERPRET=1; set TRITON_INTERPRET=1 in the environment before starting Python "
            "(the `rlk consistency` command does this itself)"
        )
    os.environ["TRITON_INTERPRET"] = "1"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _versions() -> dict:
    import rlk

    versions = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": _version("triton"),
        "transformers": _version("transformers"),
        "rlk": rlk.__version__,
        "rlk-triton": _version("rlk-triton"),
    }
    return {k: v for k, v in versions.items() if v is not None}


def _device_info(device: torch.device) -> dict:
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return {"device": str(device), "name": props.name, "chain_backend": "GPU kernels"}
    return {
        "device": str(device),
        "name": platform.processor() or platform.machine(),
        "chain_backend": "Triton interpreter (TRITON_INTERPRET=1): slow, for checking, not timing",
    }


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------
# progress
# ---------------------------------------------------------------------------


class _Progress:
    """Step-level progress on stderr: a tqdm bar when installed and stderr is a terminal, else one line per step;
    ``tick`` counts model forwards (shown in the bar)."""

    def __init__(self, total: int, enabled: bool):
        self.enabled = enabled
        self.step = 0
        self.total = total
        self.forwards = 0
        self.label = ""
        self.bar = None
        if enabled and sys.stderr.isatty():
            try:
                from tqdm import tqdm

                self.bar = tqdm(
                    total=total,
                    desc="rlk consistency",
                    file=sys.stderr,
                    leave=False,
                    bar_format="{desc:<52} {bar:20} {n_fmt}/{total_fmt} [{elapsed}]",
                )
            except ImportError:
                self.bar = None

    def start(self, label: str) -> None:
        self.label, self.forwards = label, 0
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_description_str(label)
        else:
            print(f"[{self.step + 1}/{self.total}] {label}", file=sys.stderr, flush=True)

    def tick(self) -> None:
        self.forwards += 1
        if self.bar is not None and self.forwards % 4 == 0:
            self.bar.set_description_str(f"{self.label} (forward {self.forwards})")

    def done(self) -> None:
        self.step += 1
        if self.bar is not None:
            self.bar.update(1)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _observer(progress: _Progress, probe=None):
    """An ``on_forward`` that counts forwards for the progress bar and forwards the slots to the probe."""

    def on_forward(slots: torch.Tensor) -> None:
        progress.tick()
        if probe is not None:
            probe.on_forward(slots)

    return on_forward


# ---------------------------------------------------------------------------
# numbers
# ---------------------------------------------------------------------------


def _tokenwise(a: list[torch.Tensor], b: list[torch.Tensor]) -> tuple[list[dict], dict, torch.Tensor]:
    """Per sequence and overall ``|a - b|`` of two lists of fp32 log-prob vectors; equality is ``torch.equal``
    per sequence and ``==`` per token. Returns (per sequence, aggregate, all |delta| concatenated, fp64)."""
    rows, deltas = [], []
    for x, y in zip(a, b):
        x, y = x.detach().cpu(), y.detach().cpu()
        if x.shape != y.shape:
            raise ValueError(f"log-prob vectors of different lengths: {tuple(x.shape)} vs {tuple(y.shape)}")
        d = (x.double() - y.double()).abs()
        deltas.append(d)
        rows.append(
            {
                "max_abs": float(d.max()) if d.numel() else 0.0,
                "equal": bool(torch.equal(x, y)),
                "equal_tokens": int((x == y).sum()),
            }
        )
    all_d = torch.cat(deltas) if deltas else torch.zeros(0, dtype=torch.float64)
    agg = {
        "tokens": int(all_d.numel()),
        "equal_tokens": sum(r["equal_tokens"] for r in rows),
        "equal_sequences": sum(r["equal"] for r in rows),
        "sequences": len(rows),
        "max_abs": float(all_d.max()) if all_d.numel() else 0.0,
        "mean_abs": float(all_d.mean()) if all_d.numel() else 0.0,
    }
    agg["bitwise"] = agg["equal_sequences"] == agg["sequences"]
    return rows, agg, all_d


def _grad_compare(ga: list[torch.Tensor], gb: list[torch.Tensor]) -> tuple[list[dict], dict]:
    rows = []
    for x, y in zip(ga, gb):
        x, y = x.detach().cpu(), y.detach().cpu()
        rel = float(
            torch.linalg.vector_norm((x - y).double()) / max(float(torch.linalg.vector_norm(y.double())), 1e-300)
        )
        rows.append(
            {"equal": bool(torch.equal(x, y)), "max_abs": float((x.double() - y.double()).abs().max()), "rel_l2": rel}
        )
    agg = {
        "equal_sequences": sum(r["equal"] for r in rows),
        "sequences": len(rows),
        "max_abs": max((r["max_abs"] for r in rows), default=0.0),
        "max_rel_l2": max((r["rel_l2"] for r in rows), default=0.0),
    }
    agg["bitwise"] = agg["equal_sequences"] == agg["sequences"]
    return rows, agg


def histogram(values: torch.Tensor, edges: list[float] = HIST_EDGES) -> list[int]:
    """Counts of ``values`` (>= 0) per bin: bin 0 counts exact zeros, bin 1 ``0 < v < edges[1]``, bin i
    ``edges[i-1] <= v < edges[i]``; the last bin (up to inf) also counts inf and NaN."""
    v = values.detach().double().cpu()
    v = torch.where(torch.isnan(v), math.inf, v)
    counts = [int((v == 0).sum())]
    for lo, hi in zip(edges[:-1], edges[1:]):
        upper = (v <= hi) if math.isinf(hi) else (v < hi)
        counts.append(int(((v > lo) & upper).sum()) if lo == 0 else int(((v >= lo) & upper).sum()))
    return counts


def histogram_labels(edges: list[float] = HIST_EDGES) -> list[str]:
    def fmt(x):
        return "inf" if math.isinf(x) else f"1e{round(math.log10(x))}"

    labels = ["0"]
    for lo, hi in zip(edges[:-1], edges[1:]):
        close = "]" if math.isinf(hi) else ")"
        labels.append(f"(0, {fmt(hi)})" if lo == 0 else f"[{fmt(lo)}, {fmt(hi)}{close}")
    return labels


def _contract_verdict(
    dtype: torch.dtype, path_lp: dict[str, list[torch.Tensor]], reference: list[torch.Tensor]
) -> dict:
    """The error of a path's log-probs against the ground truth, judged by the contract.

    Entry: ``selected_logprob`` of the model's dtype (the op that turns logits into a token's log-prob; the
    contract has no entry for a whole model). Bound per token: ``atol + rtol * scale`` with
    ``scale = 1 + |ref logprob|``: the contract's scale is ``1 + |lse| + |z_target|``, which is at least that
    (``lp = z_target - lse``), so this bound is never looser than the contract's. The ground truth runs the
    whole model in float64 (float32 for a GPU-sized model, see the report's ``reference``), so for a 16-bit
    model the deviation is dominated by the model's own rounding in every layer, which an op's tolerance does
    not cover: the verdict is then reported, not judged.
    """
    from rlk.core import contract

    e = contract.entry("selected_logprob", dtype)
    ref = torch.cat([r.detach().double().cpu() for r in reference]) if reference else torch.zeros(0)
    scale = 1.0 + ref.abs()
    judged = dtype == torch.float32
    summary = {
        "op": "selected_logprob",
        "dtype": e.dtype,
        "atol": e.atol,
        "rtol": e.rtol,
        "scale": "1 + |ref logprob| (never looser than the contract's 1 + |lse| + |z_target|)",
        "judged": judged,
        "paths": {},
    }
    ok = True
    for name, lps in path_lp.items():
        value = torch.cat([x.detach().double().cpu() for x in lps]) if lps else torch.zeros(0)
        dev = contract.compare_outputs(e, name, value, ref, scale)
        delta = (value - ref).abs()
        summary["paths"][name] = {
            "worst": dev.worst,
            "allowed": dev.allowed,
            "ratio": _finite(dev.ratio),
            "ok": dev.ok,
            "max_abs": float(delta.max()) if delta.numel() else 0.0,
            "mean_abs": float(delta.mean()) if delta.numel() else 0.0,
        }
        ok = ok and dev.ok
    summary["ok"] = ok
    return summary


def _finite(x: float) -> float | None:
    """JSON has no inf / nan: None stands for them."""
    return x if math.isfinite(x) else None


def _model_summary(name: str, model) -> dict:
    cfg = model.config
    keys = (
        "hidden_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "intermediate_size",
        "vocab_size",
        "rms_norm_eps",
        "rope_theta",
        "tie_word_embeddings",
    )
    config = {}
    for k in keys:
        v = getattr(cfg, k, None)
        if isinstance(v, (int, float, bool, str)):
            config[k] = v
    return {
        "name": name,
        "class": type(model).__name__,
        "model_type": getattr(cfg, "model_type", None),
        "parameters": sum(p.numel() for p in model.parameters()),
        "config": config,
    }


def _split_b(n: int) -> list[list[int]]:
    if n <= 1:
        return [list(range(n))]
    if n <= 3:
        return [[0], list(range(1, n))]
    return [[0], [1, 2], list(range(3, n))]


# ---------------------------------------------------------------------------
# one chain
# ---------------------------------------------------------------------------


def _run_chain(
    model,
    prompts,
    *,
    enabled: bool,
    max_new_tokens: int,
    prefill_chunk: int | None,
    seed: int,
    timing: bool,
    progress: _Progress,
    device: torch.device,
) -> dict:
    from rlk.app.consistency import paths, probe
    from rlk.integrations.batch_invariant import served_calls

    tag = "rlk on" if enabled else "rlk off"
    n = len(prompts)
    split_a, split_b = [list(range(n))], _split_b(n)
    served_before = sum(served_calls.values())
    out: dict = {"enabled": enabled}
    with paths.chain(model, enabled):
        progress.start(f"{tag}: rollout")
        with probe.Probe(model) as probe_rollout:
            _sync(device)
            t0 = time.perf_counter()
            roll = paths.rollout(
                model,
                prompts,
                max_new_tokens=max_new_tokens,
                prefill_chunk=prefill_chunk,
                seed=seed,
                on_forward=_observer(progress, probe_rollout),
            )
            _sync(device)
            rollout_probe_s = time.perf_counter() - t0
        progress.done()

        progress.start(f"{tag}: training split A + backward")
        lp_a, grad_a = paths.training_logprobs(
            model, prompts, roll.responses, micro_batches=split_a, backward=True, on_forward=_observer(progress)
        )
        progress.done()

        progress.start(f"{tag}: training split B + backward")
        with probe.Probe(model) as probe_training:
            lp_b, grad_b = paths.training_logprobs(
                model,
                prompts,
                roll.responses,
                micro_batches=split_b,
                backward=True,
                on_forward=_observer(progress, probe_training),
            )
        progress.done()

        timings = {"rollout_with_probe_s": rollout_probe_s}
        if timing:
            progress.start(f"{tag}: timed forwards (no probe)")
            timings.update(_timed(model, prompts, roll, max_new_tokens, prefill_chunk, seed, split_a, device, progress))
            progress.done()
    served = sum(served_calls.values()) - served_before

    rows_rt, agg_rt, delta_rt = _tokenwise(roll.logprobs, lp_a)
    rows_ab, agg_ab, _ = _tokenwise(lp_a, lp_b)
    rows_g, agg_g = _grad_compare(grad_a, grad_b)
    drift = probe.compare(probe_rollout, probe_training)
    out.update(
        {
            "responses": [list(map(int, r)) for r in roll.responses],
            "response_lengths": [len(r) for r in roll.responses],
            "rollout_vs_training": agg_rt,
            "split_a_vs_b": agg_ab,
            "gradients": agg_g,
            "probe": _drift_dict(drift),
            "histogram": histogram(delta_rt),
            "timings": timings,
            "rlk_calls": served,
            "sequences": [
                {
                    "index": i,
                    "prompt_len": len(prompts[i]),
                    "response_len": len(roll.responses[i]),
                    "rollout_vs_training_max_abs": rt["max_abs"],
                    "rollout_vs_training_equal": rt["equal"],
                    "rollout_vs_training_equal_tokens": rt["equal_tokens"],
                    "split_a_vs_b_max_abs": ab["max_abs"],
                    "split_a_vs_b_equal": ab["equal"],
                    "grad_equal": g["equal"],
                    "grad_max_abs": g["max_abs"],
                    "grad_rel_l2": g["rel_l2"],
                }
                for i, (rt, ab, g) in enumerate(zip(rows_rt, rows_ab, rows_g))
            ],
        }
    )
    # kept out of the JSON: the tensors the reference comparison needs
    out["_logprobs"] = {"rollout": roll.logprobs, "training_a": lp_a, "training_b": lp_b}
    return out


def _timed(model, prompts, roll, max_new_tokens, prefill_chunk, seed, split_a, device, progress) -> dict:
    """Forward-only passes without the probe, after the probed ones (kernels compiled, caches warm).

    tokens/s = tokens fed to the model / seconds: the training forward feeds prompt + response; the rollout
    feeds the prompt and every sampled token but the last (one token per sequence fewer)."""
    from rlk.app.consistency import paths

    n_prompt = sum(len(p) for p in prompts)
    n_resp = sum(len(r) for r in roll.responses)
    with torch.no_grad():
        _sync(device)
        t0 = time.perf_counter()
        again = paths.rollout(
            model,
            prompts,
            max_new_tokens=max_new_tokens,
            prefill_chunk=prefill_chunk,
            seed=seed,
            on_forward=_observer(progress),
        )
        _sync(device)
        t_roll = time.perf_counter() - t0
        t0 = time.perf_counter()
        paths.training_logprobs(
            model, prompts, roll.responses, micro_batches=split_a, backward=False, on_forward=_observer(progress)
        )
        _sync(device)
        t_train = time.perf_counter() - t0
    rollout_tokens = n_prompt + n_resp - len(prompts)
    training_tokens = n_prompt + n_resp
    rerun_same = again.responses == roll.responses and all(
        torch.equal(x.cpu(), y.cpu()) for x, y in zip(again.logprobs, roll.logprobs)
    )
    return {
        "rollout_s": t_roll,
        "rollout_tokens": rollout_tokens,
        "rollout_tokens_per_s": rollout_tokens / t_roll,
        "training_forward_s": t_train,
        "training_tokens": training_tokens,
        "training_tokens_per_s": training_tokens / t_train,
        "rollout_rerun_identical": bool(rerun_same),
    }


def _drift_dict(drift) -> dict:
    """The probe's :class:`~rlk.app.consistency.probe.Drift` as JSON-ready data (NaN / inf become None)."""
    return _jsonable(drift.to_dict())


def _jsonable(x):
    if isinstance(x, float):
        return _finite(x)
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    return x


# ---------------------------------------------------------------------------
# verdicts
# ---------------------------------------------------------------------------


def _verdict(name: str, claim: str, kind: str, status: str, gates: bool, detail: str) -> dict:
    """status: "pass", "fail" or "info" (reported, not judged); ``gates``: a failure makes the command fail."""
    return {"name": name, "claim": claim, "kind": kind, "status": status, "gates_exit": gates, "detail": detail}


def _verdicts(off: dict, on: dict, contract_summary: dict, device: torch.device) -> list[dict]:
    v = []
    rt, ab, g = on["rollout_vs_training"], on["split_a_vs_b"], on["gradients"]
    v.append(
        _verdict(
            "on.rollout_equals_training",
            "rlk on: rollout log-probs == training log-probs, every response token",
            "bitwise",
            "pass" if rt["bitwise"] else "fail",
            True,
            f"{rt['equal_tokens']}/{rt['tokens']} tokens equal, max |delta| {rt['max_abs']:.3g}",
        )
    )
    v.append(
        _verdict(
            "on.split_invariant_logprobs",
            "rlk on: training log-probs do not depend on the micro-batch split",
            "bitwise",
            "pass" if ab["bitwise"] else "fail",
            True,
            f"{ab['equal_sequences']}/{ab['sequences']} sequences equal, max |delta| {ab['max_abs']:.3g}",
        )
    )
    v.append(
        _verdict(
            "on.split_invariant_gradients",
            "rlk on: per-sequence input-embedding gradients do not depend on the split",
            "bitwise",
            "pass" if g["bitwise"] else "fail",
            True,
            f"{g['equal_sequences']}/{g['sequences']} sequences equal, max |delta| {g['max_abs']:.3g}",
        )
    )
    v.append(
        _verdict(
            "on.rlk_kernels_ran",
            "rlk on: the batch-invariant kernels served the model's ops",
            "check",
            "pass" if on["rlk_calls"] > 0 else "fail",
            True,
            f"{on['rlk_calls']} aten calls served by rlk (rlk off: {off['rlk_calls']})",
        )
    )
    drifted = off["rollout_vs_training"]["max_abs"] > 0 or off["split_a_vs_b"]["max_abs"] > 0
    on_gpu = device.type == "cuda"
    v.append(
        _verdict(
            "off.drift_nonzero",
            "rlk off (stock kernels): the paths drift, so the comparison can fail",
            "control",
            "pass" if drifted else ("fail" if on_gpu else "info"),
            on_gpu,
            f"max |delta| rollout vs training {off['rollout_vs_training']['max_abs']:.3g}, split A vs B "
            f"{off['split_a_vs_b']['max_abs']:.3g}"
            + ("" if on_gpu else "; on the CPU stock kernels may agree: reported, not judged"),
        )
    )
    paths = contract_summary["paths"]
    worst = max((p["ratio"] if p["ratio"] is not None else math.inf) for p in paths.values())
    v.append(
        _verdict(
            "reference_contract",
            f"both chains, both paths: |lp - reference| <= atol + rtol * (1 + |ref|) "
            f"(contract selected_logprob/{contract_summary['dtype']})",
            "contract",
            ("pass" if contract_summary["ok"] else "fail") if contract_summary["judged"] else "info",
            False,
            f"worst ratio {worst:.3g} (deviation / allowed)"
            + (
                ""
                if contract_summary["judged"]
                else "; 16-bit model vs a high-precision reference: reported, not judged"
            ),
        )
    )
    return v


# ---------------------------------------------------------------------------
# entry point
# ---------------------------------------------------------------------------


def run_consistency(
    model: str = "tiny",
    *,
    device=None,
    dtype=None,
    prompts: int = 8,
    max_new_tokens: int = 16,
    out: str | None = None,
    progress: bool = True,
    seed: int = 0,
    prefill_chunk: int | None = None,
    timing: bool = True,
    print_table: bool = True,
) -> dict:
    """Run the chain test and return the report dict (JSON-serializable; see the module docstring).

    ``device``: default the GPU if any, else ``"cpu"`` (then ``TRITON_INTERPRET=1`` is set if triton is not
    imported yet, see :func:`ensure_interpreter`). ``dtype``: default bfloat16 on a GPU, float32 on the CPU
    (the interpreter declines 16-bit types, so the CPU takes float32 only). ``seed`` seeds the weights, the
    prompts and the sampling. ``prefill_chunk``: chunked prefill of the rollout (default: 8 tokens, so that
    prompts longer than 8 take several chunks). With ``out`` the report, the HTML and the PNG are written
    there; with ``print_table`` the table is printed.
    """
    device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    if dtype is None:
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if device.type == "cpu":
        if dtype != torch.float32:
            raise ValueError(
                f"on the CPU rlk's chain runs in the Triton interpreter, which serves float32 only, "
                f"not {dtype}; use --dtype float32 (the default there)"
            )
        ensure_interpreter()
    if prompts < 1 or max_new_tokens < 1:
        raise ValueError("prompts and max_new_tokens must be >= 1")
    prefill_chunk = 8 if prefill_chunk is None else prefill_chunk

    from rlk.app.consistency import harness

    bar = _Progress(total=2 + 2 * (4 if timing else 3), enabled=progress)
    notes: list[str] = []
    try:
        bar.start("building the model")
        started = time.perf_counter()
        net = harness.build_model(model, dtype=dtype, device=device, seed=seed)
        for p in net.parameters():
            p.requires_grad_(False)  # gradients are taken w.r.t. the input embeddings only
        vocab = net.config.vocab_size
        prompt_ids = harness.make_prompts(prompts, vocab_size=vocab, seed=seed)
        bar.done()

        chains = {}
        for enabled in (False, True):
            chains["on" if enabled else "off"] = _run_chain(
                net,
                prompt_ids,
                enabled=enabled,
                max_new_tokens=max_new_tokens,
                prefill_chunk=prefill_chunk,
                seed=seed,
                timing=timing,
                progress=bar,
                device=device,
            )

        bar.start("ground truth (reference log-probs)")
        ref_by_chain = {}
        for key, c in chains.items():
            same = key == "on" and c["responses"] == chains["off"]["responses"]
            ref_by_chain[key] = (
                ref_by_chain["off"]
                if same
                else harness.reference_logprobs(net, prompt_ids, [list(r) for r in c["responses"]])
            )
        bar.done()
    finally:
        bar.close()

    path_lp = {}
    for key, c in chains.items():
        lps = c.pop("_logprobs")
        path_lp[key] = {f"{key}.rollout": lps["rollout"], f"{key}.training": lps["training_a"]}
        for i, seq in enumerate(c["sequences"]):
            ref = ref_by_chain[key][i].double().cpu()
            r, t = lps["rollout"][i].double().cpu(), lps["training_a"][i].double().cpu()
            seq["rollout_vs_reference_max_abs"] = float((r - ref).abs().max()) if ref.numel() else 0.0
            seq["training_vs_reference_max_abs"] = float((t - ref).abs().max()) if ref.numel() else 0.0
    # each chain's paths against the ground truth of that chain's own responses
    contract_summary = _contract_verdict(dtype, path_lp["off"], ref_by_chain["off"])
    on_summary = _contract_verdict(dtype, path_lp["on"], ref_by_chain["on"])
    contract_summary["paths"].update(on_summary["paths"])
    contract_summary["ok"] = contract_summary["ok"] and on_summary["ok"]

    verdicts = _verdicts(chains["off"], chains["on"], contract_summary, device)
    failed = [v["name"] for v in verdicts if v["gates_exit"] and v["status"] == "fail"]
    report = {
        "report": "rlk consistency",
        "schema": 1,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": _model_summary(model, net),
        "device": _device_info(device),
        "dtype": str(dtype).removeprefix("torch."),
        "versions": _versions(),
        "seeds": {"weights": seed, "prompts": seed, "sampling": seed},
        "settings": {
            "prompts": prompts,
            "max_new_tokens": max_new_tokens,
            "prefill_chunk": prefill_chunk,
            "temperature": 1.0,
            "sampler": "rlk.sample (Gumbel-max with Philox, per-sequence seed from the sampling seed and "
            "the sequence index, step = the token's index in its response)",
            "scoring": "log_softmax(logits.float())[token], temperature 1",
            "split_a": SPLIT_A_NAME,
            "split_b": split_description(_split_b(prompts)),
            "split_b_micro_batches": _split_b(prompts),
        },
        "prompt_lengths": [len(p) for p in prompt_ids],
        "reference": {
            "dtype": "float64" if device.type == "cpu" else "float32",
            "how": "each sequence alone, teacher-forced, on a high-precision copy of the model",
        },
        "contract": contract_summary,
        "histogram": {
            "what": "|rollout lp - training lp| per response token (split A)",
            "edges": [_finite(e) for e in HIST_EDGES],
            "labels": histogram_labels(),
            "off": chains["off"].pop("histogram"),
            "on": chains["on"].pop("histogram"),
        },
        "chains": chains,
        "throughput": _throughput(chains),
        "verdicts": verdicts,
        "failed": failed,
        "passed": not failed,
        "seconds": time.perf_counter() - started,
        "notes": notes,
    }
    if device.type == "cpu" and timing:
        notes.append(
            "CPU: rlk's chain runs in the Triton interpreter, stock kernels natively: the tokens/s "
            "compare an interpreter with compiled code and say nothing about the GPU overhead."
        )
    if device.type != "cpu" and timing:
        notes.append(
            "the tokens/s time the consistency prompt set (a few short sequences, one timed pass each): "
            "host-bound and noisy; tools/bench_chain_forward.py measures the chain's throughput at "
            "realistic shapes (docs/consistency.md)"
        )
    if not timing:
        notes.append("timed forward passes skipped (tokens/s not measured)")
    if out is not None:
        from rlk.app.consistency import report as rep

        report["files"] = rep.write_all(report, out)
    if print_table:
        from rlk.app.consistency import report as rep

        print(rep.format_table(report))
    return report


def _throughput(chains: dict) -> dict:
    """Forward tokens/s per path, rlk off vs on, and the chain's overhead ``t_on / t_off - 1`` (empty when the
    timed passes were skipped)."""
    out = {}
    for path, key in (("rollout", "rollout_tokens_per_s"), ("training_forward", "training_tokens_per_s")):
        off, on = chains["off"]["timings"].get(key), chains["on"]["timings"].get(key)
        if off and on:
            out[path] = {"off_tokens_per_s": off, "on_tokens_per_s": on, "on_overhead": off / on - 1.0}
    return out


def parse_dtype(name: str) -> torch.dtype:
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if name not in names:
        raise ValueError(f"unknown dtype {name!r}; one of {', '.join(names)}")
    return names[name]
