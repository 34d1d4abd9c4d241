"""Drift between parallel configurations, as a report in the schema of ``rlk consistency``'s ``report.json``.

The consistency tool compares a rollout path with a training path, rlk's chain off and on. Here the paths
are parallel configurations of :mod:`rlk.distributed.decoder` (e.g. rollout at TP = 2, training at TP = 1
and DP = 2) and the chains are the stock combine (``"off"``: each rank's partial sums added by an all-reduce
that ignores the tree) and rlk's (``"on"``). The fields the tool's writers read are filled the same way
(``rlk.app.consistency.report.format_table`` / ``write_all`` render it); ``report["parallel"]`` records the
configurations; the "gradients" entries count parameter tensors (the tool counts sequences: per sequence
``grad_equal`` is None here), and a scored sequence is all "response" (``prompt_len`` 0).
"""

from __future__ import annotations

import datetime
import math
import platform
from importlib import metadata

import torch
from torch import Tensor

#: The histogram of |rollout lp - training lp|: an exact-zero bin, then decades (the consistency tool's bins).
HIST_EDGES = [0.0] + [10.0**k for k in range(-9, 2)] + [math.inf]


def _labels() -> list[str]:
    """``"0"``, then ``"(lo, hi]"`` per bin of :func:`histogram`."""

    def fmt(x):
        return "inf" if math.isinf(x) else ("0" if x == 0 else f"1e{round(math.log10(x))}")

    return ["0"] + [f"({fmt(lo)}, {fmt(hi)}]" for lo, hi in zip(HIST_EDGES[:-1], HIST_EDGES[1:])]


def _finite(x: float) -> float | None:
    return x if math.isfinite(x) else None


def compare_tokens(a: list[Tensor], b: list[Tensor]) -> dict:
    """Per-token comparison of two lists of per-sequence tensors (the tool's ``rollout_vs_training`` fields)."""
    deltas = [(x.double() - y.double()).abs().reshape(-1) for x, y in zip(a, b)]
    flat = torch.cat(deltas) if deltas else torch.zeros(0, dtype=torch.float64)
    equal_tokens = sum(int((x.reshape(-1) == y.reshape(-1)).sum()) for x, y in zip(a, b))
    tokens = int(flat.numel())
    seqs = [bool(torch.equal(x, y)) for x, y in zip(a, b)]
    return {
        "max_abs": float(flat.max()) if tokens else 0.0,
        "mean_abs": float(flat.mean()) if tokens else 0.0,
        "equal_tokens": equal_tokens,
        "tokens": tokens,
        "equal_sequences": sum(seqs),
        "sequences": len(seqs),
        "bitwise": all(seqs),
        "equal": seqs,
        "per_sequence_max_abs": [float(d.max()) if d.numel() else 0.0 for d in deltas],
    }


def compare_tensors(a: dict[str, Tensor], b: dict[str, Tensor]) -> dict:
    """Tensor by tensor (e.g. parameter gradients): the tool's ``gradients`` fields, counting tensors."""
    rows = {k: (bool(torch.equal(a[k], b[k])), float((a[k].double() - b[k].double()).abs().max())) for k in a}
    diff = [k for k, (eq, _) in rows.items() if not eq]
    return {
        "equal_sequences": len(rows) - len(diff),
        "sequences": len(rows),
        "max_abs": max((m for _, m in rows.values()), default=0.0),
        "bitwise": not diff,
        "differing": diff,
        "rel_l2": None,
    }


def layer_drift(trace_a: list, trace_b: list) -> dict:
    """The tool's probe fields from two :func:`rlk.distributed.decoder.forward` traces ``[(layer, op, x)]``."""
    per_layer: dict[int, dict] = {}
    first = None
    for (layer, op, x), (_, _, y) in zip(trace_a, trace_b):
        d = (x.double() - y.double()).abs()
        row = per_layer.setdefault(layer, {"layer": layer, "max_abs": 0.0, "mean_abs": 0.0, "first_op": None, "ops": 0})
        row["max_abs"] = max(row["max_abs"], float(d.max()))
        row["mean_abs"] += float(d.mean())
        row["ops"] += 1
        if float(d.max()) > 0:
            row["first_op"] = row["first_op"] or op
            first = first or [layer, op]
    rows = []
    for row in per_layer.values():
        row["mean_abs"] /= row.pop("ops")
        rows.append(row)
    return {"first_divergent": first, "per_layer": rows}


def histogram(a: list[Tensor], b: list[Tensor]) -> list[int]:
    """Counts of ``|a - b|`` per token: exactly 0, then ``(lo, hi]`` for consecutive :data:`HIST_EDGES`."""
    values = torch.cat([(x.double() - y.double()).abs().reshape(-1) for x, y in zip(a, b)])
    counts = [int((values == 0).sum())]
    for lo, hi in zip(HIST_EDGES[:-1], HIST_EDGES[1:]):
        counts.append(int(((values > lo) & (values <= hi)).sum()))
    return counts


def chain_entry(
    rollout: list[Tensor],
    training: list[Tensor],
    training_b: list[Tensor],
    grads: dict,
    grads_truth: dict,
    trace: list,
    trace_truth: list,
    timings: dict | None = None,
) -> dict:
    """One chain of the report: rollout vs training (split A), split A vs B, gradients, the layer probe."""
    rt = compare_tokens(rollout, training)
    ab = compare_tokens(training, training_b)
    sequences = [
        {
            "index": i,
            "prompt_len": 0,
            "response_len": int(x.numel()),
            "rollout_vs_training_max_abs": rt["per_sequence_max_abs"][i],
            "rollout_vs_training_equal": rt["equal"][i],
            "split_a_vs_b_max_abs": ab["per_sequence_max_abs"][i],
            "split_a_vs_b_equal": ab["equal"][i],
            "grad_equal": None,
        }
        for i, x in enumerate(rollout)
    ]
    return {
        "rollout_vs_training": rt,
        "split_a_vs_b": ab,
        "gradients": compare_tensors(grads, grads_truth),
        "probe": layer_drift(trace, trace_truth),
        "timings": timings or {},
        "rlk_calls": 0,
        "sequences": sequences,
    }


def _verdict(name, claim, kind, status, gates, detail) -> dict:
    return {"name": name, "claim": claim, "kind": kind, "status": status, "gates_exit": gates, "detail": detail}


def parallel_report(
    *,
    model: str,
    config,
    device: torch.device,
    dtype: torch.dtype,
    parallel: dict,
    chains: dict,
    seeds: dict,
    lengths: list[int],
    histograms: dict,
    notes: list[str],
    seconds: float,
) -> dict:
    """The report dict: ``chains`` = ``{"off": chain_entry(...), "on": chain_entry(...)}``, ``parallel`` the
    configurations (``{"rollout": {...}, "training_a": {...}, "training_b": {...}, "combine": {...}}``)."""
    on, off = chains["on"], chains["off"]
    on_gpu = device.type == "cuda"
    drifted = off["rollout_vs_training"]["max_abs"] > 0
    verdicts = [
        _verdict(
            "on.rollout_equals_training",
            f"rlk on: log-probs at {parallel['rollout']['name']} == at {parallel['training_a']['name']}, every token",
            "bitwise",
            "pass" if on["rollout_vs_training"]["bitwise"] else "fail",
            True,
            f"{on['rollout_vs_training']['equal_tokens']}/{on['rollout_vs_training']['tokens']} tokens equal",
        ),
        _verdict(
            "on.split_invariant_logprobs",
            f"rlk on: log-probs at {parallel['training_a']['name']} == at {parallel['training_b']['name']}",
            "bitwise",
            "pass" if on["split_a_vs_b"]["bitwise"] else "fail",
            True,
            f"{on['split_a_vs_b']['equal_tokens']}/{on['split_a_vs_b']['tokens']} tokens equal",
        ),
        _verdict(
            "on.parallel_invariant_gradients",
            f"rlk on: every parameter gradient at {parallel['rollout']['name']} == at TP=1",
            "bitwise",
            "pass" if on["gradients"]["bitwise"] else "fail",
            True,
            f"{on['gradients']['equal_sequences']}/{on['gradients']['sequences']} parameter tensors equal",
        ),
        _verdict(
            "off.drift_nonzero",
            "stock combine: the configurations drift, so the comparison can fail",
            "control",
            "pass" if drifted else ("fail" if on_gpu else "info"),
            on_gpu,
            f"max |delta| {off['rollout_vs_training']['max_abs']:.3g}",
        ),
    ]
    failed = [v["name"] for v in verdicts if v["gates_exit"] and v["status"] == "fail"]
    versions = {}
    for dist_name in ("rlk", "rlk-triton", "torch", "triton"):
        try:
            versions[dist_name] = metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            versions[dist_name] = None
    return {
        "report": "rlk distributed consistency",
        "schema": 1,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": {
            "name": model,
            "class": "rlk.distributed.decoder",
            "config": {
                "num_hidden_layers": config.layers,
                "hidden_size": config.hidden,
                "vocab_size": config.vocab,
                "num_attention_heads": config.heads,
                "num_key_value_heads": config.kv_heads,
                "intermediate_size": config.intermediate,
            },
        },
        "device": {
            "device": str(device),
            "name": torch.cuda.get_device_name(device) if on_gpu else (platform.processor() or None),
        },
        "dtype": str(dtype).removeprefix("torch."),
        "versions": versions,
        "seeds": seeds,
        "settings": {
            "prompts": len(lengths),
            "max_new_tokens": 0,
            "prefill_chunk": None,
            "temperature": 1.0,
            "scoring": "rlk.distributed.vocab_parallel_linear_logprob / rlk.linear_logprob, temperature 1",
            "split_a": parallel["training_a"]["name"],
            "split_b": parallel["training_b"]["name"],
        },
        "parallel": parallel,
        "prompt_lengths": lengths,
        "histogram": {
            "what": f"|lp at {parallel['rollout']['name']} - lp at {parallel['training_a']['name']}| per token",
            "edges": [_finite(e) for e in HIST_EDGES],
            "labels": _labels(),
            "off": histograms["off"],
            "on": histograms["on"],
        },
        "chains": chains,
        "verdicts": verdicts,
        "failed": failed,
        "passed": not failed,
        "seconds": seconds,
        "notes": notes,
    }
