"""Rendering of the ``rlk consistency`` report dict (see :mod:`rlk.app.consistency.run`).

* :func:`format_table`: the text table the command prints;
* :func:`write_json`: ``report.json`` (strict JSON: NaN / inf written as null);
* :func:`write_png`: ``drift.png`` with matplotlib (an optional dependency: without it nothing is written and
  the reason is returned);
* :func:`write_html`: ``drift.html``, one self-contained page (inline CSS and SVG charts drawn here, no external
  assets, no JavaScript): per-layer drift with rlk off vs on on a log scale (exact zero drawn as a labelled
  floor), the histogram of the final log-prob drift, the verdicts and the numbers;
* :func:`write_all`: the three files into a folder.

Only the report dict is needed: these functions import neither torch models nor transformers.
"""

from __future__ import annotations

import html
import json
import math
import os

CHAINS = (("off", "rlk off (stock kernels)", "#d62728"), ("on", "rlk on (batch-invariant chain)", "#1f77b4"))


# ---------------------------------------------------------------------------
# small formatting helpers
# ---------------------------------------------------------------------------


def _num(x, digits: int = 3) -> str:
    """``0`` for exact zero, ``-`` for missing, else ``digits`` significant digits."""
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return str(x)
    if x == 0:
        return "0"
    return f"{x:.{digits}g}"


def _first(probe: dict) -> str:
    first = probe.get("first_divergent")
    return "none (bitwise equal)" if first is None else f"layer {first[0]} {first[1]}"


def _rate(timings: dict, key: str) -> str:
    v = timings.get(key)
    return "-" if v is None else f"{v:,.0f}"


def _clean(x):
    """NaN / inf -> None, tuples -> lists, recursively (strict JSON)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


# ---------------------------------------------------------------------------
# text table
# ---------------------------------------------------------------------------


def summary_rows(report: dict) -> list[tuple[str, str, str]]:
    """(what, rlk off, rlk on) rows of the main table."""
    off, on = report["chains"]["off"], report["chains"]["on"]
    con = report.get("contract", {}).get("paths", {})

    def both(fn):
        return fn(off, "off"), fn(on, "on")

    def equal(d):
        return f"{d['equal_tokens']}/{d['tokens']}"

    rows = [
        ("rollout vs training: max |delta lp|", *both(lambda c, _: _num(c["rollout_vs_training"]["max_abs"]))),
        ("rollout vs training: mean |delta lp|", *both(lambda c, _: _num(c["rollout_vs_training"]["mean_abs"]))),
        ("rollout vs training: tokens bitwise equal", *both(lambda c, _: equal(c["rollout_vs_training"]))),
        ("training split A vs B: max |delta lp|", *both(lambda c, _: _num(c["split_a_vs_b"]["max_abs"]))),
        ("training split A vs B: tokens bitwise equal", *both(lambda c, _: equal(c["split_a_vs_b"]))),
        (
            "input gradients equal across splits (seqs)",
            *both(lambda c, _: f"{c['gradients']['equal_sequences']}/{c['gradients']['sequences']}"),
        ),
        ("input gradients: max |delta|", *both(lambda c, _: _num(c["gradients"]["max_abs"]))),
        ("rollout vs reference: max |delta lp|", *both(lambda c, k: _num(con.get(f"{k}.rollout", {}).get("max_abs")))),
        (
            "training vs reference: max |delta lp|",
            *both(lambda c, k: _num(con.get(f"{k}.training", {}).get("max_abs"))),
        ),
        (
            "contract ratio (worst / allowed, <= 1 ok)",
            *both(
                lambda c, k: _num(max((con.get(f"{k}.{p}", {}).get("ratio") or 0.0) for p in ("rollout", "training")))
            ),
        ),
        ("probe: first divergent (layer, op)", *both(lambda c, _: _first(c["probe"]))),
        (
            "probe: max |delta| over all layers",
            *both(
                lambda c, _: _num(
                    max((r.get("max_abs") or 0.0) for r in c["probe"]["per_layer"]) if c["probe"]["per_layer"] else None
                )
            ),
        ),
        ("forward tokens/s, rollout", *both(lambda c, _: _rate(c.get("timings", {}), "rollout_tokens_per_s"))),
        ("forward tokens/s, training", *both(lambda c, _: _rate(c.get("timings", {}), "training_tokens_per_s"))),
    ]
    on_gpu = str(report["device"]["device"]).startswith("cuda")
    for path, label in (("rollout", "rollout"), ("training_forward", "training")):
        t = report.get("throughput", {}).get(path)
        if t and on_gpu:  # on the CPU the chain runs in the Triton interpreter: no overhead to speak of
            rows.append((f"rlk overhead, {label} forward (t_on / t_off - 1)", "", f"{100 * t['on_overhead']:+.0f}%"))
    return rows


def format_table(report: dict) -> str:
    """The terminal summary: setup, off-vs-on table, per-layer drift, verdicts."""
    m, s = report["model"], report["settings"]
    cfg = m.get("config", {})
    dev = report["device"]
    lines = [
        f"rlk consistency: {m['name']} ({m.get('class')}, {cfg.get('num_hidden_layers', '?')} layers, hidden "
        f"{cfg.get('hidden_size', '?')}, vocab {cfg.get('vocab_size', '?')}) in {report['dtype']} on {dev['device']}"
        f" ({dev.get('name') or '?'})",
        f"{s['prompts']} prompts of {min(report['prompt_lengths'])}..{max(report['prompt_lengths'])} tokens, up to "
        f"{s['max_new_tokens']} tokens each sampled by rlk.sample (prefill chunk {s['prefill_chunk']}), seed "
        f"{report['seeds']['sampling']}; split A: {s['split_a']}; split B: {s['split_b']}",
        "",
    ]
    rows = summary_rows(report)
    w0 = max(len(r[0]) for r in rows)
    w1 = max(12, *(len(r[1]) for r in rows))
    w2 = max(12, *(len(r[2]) for r in rows))
    lines.append(f"{'':<{w0}}  {'rlk off':>{w1}}  {'rlk on':>{w2}}")
    for what, a, b in rows:
        lines.append(f"{what:<{w0}}  {a:>{w1}}  {b:>{w2}}")
    off_layers = {r["layer"]: r for r in report["chains"]["off"]["probe"]["per_layer"]}
    on_layers = {r["layer"]: r for r in report["chains"]["on"]["probe"]["per_layer"]}
    if off_layers:
        lines += ["", "per-layer drift, rollout vs training (max |delta| / mean |delta| over the layer's ops)"]
        lines.append(f"  {'layer':>5}  {'rlk off max':>11} {'mean':>9} {'first op':<24} {'rlk on max':>10} {'mean':>9}")
        for layer in sorted(off_layers):
            a, b = off_layers[layer], on_layers.get(layer, {})
            lines.append(
                f"  {layer:>5}  {_num(a.get('max_abs')):>11} {_num(a.get('mean_abs')):>9} "
                f"{a.get('first_op') or '-':<24} {_num(b.get('max_abs')):>10} {_num(b.get('mean_abs')):>9}"
            )
    hist = report.get("histogram")
    if hist:
        lines += ["", f"histogram of {hist['what']}:"]
        lines.append(
            "  "
            + "  ".join(f"{lab}: {a}/{b}" for lab, a, b in zip(hist["labels"], hist["off"], hist["on"]) if a or b)
            + "   (rlk off / rlk on)"
        )
    con = report.get("contract")
    if con:
        lines += [
            "",
            f"ground truth: {report['reference']['dtype']} ({report['reference']['how']}); judged with the "
            f"contract entry {con['op']}/{con['dtype']} (atol {con['atol']:g}, rtol {con['rtol']:g}, scale "
            f"{con['scale']})",
        ]
    lines += ["", "verdicts:"]
    for v in report["verdicts"]:
        mark = {"pass": "PASS", "fail": "FAIL", "info": "INFO"}[v["status"]]
        lines.append(f"  {mark}  {v['claim']}: {v['detail']}")
    for note in report.get("notes", []):
        lines.append(f"  note: {note}")
    files = report.get("files")
    if files:
        written = [p for k, p in files.items() if k in ("json", "html", "png") and p]
        lines += ["", "wrote " + ", ".join(written)]
    lines.append("")
    lines.append(
        "PASSED: every rlk-on claim holds bit for bit" if report["passed"] else f"FAILED: {', '.join(report['failed'])}"
    )
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# JSON
# ---------------------------------------------------------------------------


def write_json(report: dict, path: str) -> str:
    """Strict JSON (NaN / inf as null), indented."""
    with open(path, "w") as f:
        json.dump(_clean(report), f, indent=1, allow_nan=False)
        f.write("\n")
    return path


# ---------------------------------------------------------------------------
# chart data shared by the PNG and the SVG
# ---------------------------------------------------------------------------


def layer_series(report: dict, key: str = "max_abs") -> dict[str, list[tuple[int, float | None]]]:
    """Per chain: ``[(layer, value)]`` from the probe's per-layer drift."""
    return {
        name: [(r["layer"], r.get(key)) for r in report["chains"][name]["probe"]["per_layer"]] for name, _, _ in CHAINS
    }


def log_range(values) -> tuple[int, int]:
    """Decades ``(lo, hi)`` covering the non-zero values (``10**lo <= v <= 10**hi``); zeros are drawn one decade
    below ``lo`` (the floor). Default ``(-8, 0)`` when nothing is non-zero."""
    nz = [v for v in values if v is not None and v > 0 and math.isfinite(v)]
    if not nz:
        return -8, 0
    lo, hi = math.floor(math.log10(min(nz))), math.ceil(math.log10(max(nz)))
    if hi <= lo:
        hi = lo + 1
    return lo, hi


# ---------------------------------------------------------------------------
# PNG (matplotlib, optional)
# ---------------------------------------------------------------------------


def write_png(report: dict, path: str) -> tuple[str | None, str | None]:
    """``drift.png``: per-layer max |delta| off vs on (log scale, zeros on a labelled floor) and the histogram.
    Returns ``(path, None)``, or ``(None, why)`` when matplotlib is not installed."""
    try:
        import matplotlib
        import matplotlib.ticker

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return (
            None,
            "drift.png not written: matplotlib is not installed (pip install matplotlib); drift.html has "
            "the same charts",
        )
    series = layer_series(report)
    lo, hi = log_range([v for s in series.values() for _, v in s])
    floor = 10.0 ** (lo - 1)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, label, color in CHAINS:
        pts = series[name]
        xs = [x for x, _ in pts]
        ys = [v if (v is not None and v > 0) else floor for _, v in pts]
        ax1.plot(xs, ys, marker="o", color=color, label=label)
    ax1.set_yscale("log")
    ax1.set_ylim(floor / 3, 10.0 ** (hi + 0.3))
    ax1.set_yticks([floor] + [10.0**d for d in range(lo, hi + 1)])
    ax1.set_yticklabels(["0"] + [f"1e{d}" for d in range(lo, hi + 1)])
    ax1.yaxis.set_minor_locator(matplotlib.ticker.NullLocator())
    ax1.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax1.axhline(floor, color="gray", linestyle=":", linewidth=1)
    ax1.text(
        0.01, floor, " 0 (bitwise equal)", transform=ax1.get_yaxis_transform(), va="bottom", fontsize=8, color="gray"
    )
    ax1.set_xlabel("decoder layer")
    ax1.set_ylabel("max |delta| of the layer's op outputs")
    ax1.set_title("per-layer drift, rollout vs training")
    ax1.legend(fontsize=8)
    hist = report["histogram"]
    idx = list(range(len(hist["labels"])))
    width = 0.4
    ax2.bar([i - width / 2 for i in idx], hist["off"], width, color=CHAINS[0][2], label=CHAINS[0][1])
    ax2.bar([i + width / 2 for i in idx], hist["on"], width, color=CHAINS[1][2], label=CHAINS[1][1])
    ax2.set_xticks(idx)
    ax2.set_xticklabels(hist["labels"], rotation=60, fontsize=7)
    ax2.set_xlabel("|rollout log-prob - training log-prob|")
    ax2.set_ylabel("response tokens")
    ax2.set_title("final log-prob drift")
    ax2.legend(fontsize=8)
    m = report["model"]
    fig.suptitle(f"rlk consistency: {m['name']}, {report['dtype']} on {report['device']['device']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path, None


# ---------------------------------------------------------------------------
# SVG / HTML
# ---------------------------------------------------------------------------


def svg_layer_chart(report: dict, width: int = 640, height: int = 320) -> str:
    """Inline SVG: per-layer max |delta| (solid) and mean |delta| (dashed) per chain on a log scale; exact zeros
    sit on a dotted floor labelled "0 (bitwise equal)"."""
    series = layer_series(report, "max_abs")
    means = layer_series(report, "mean_abs")
    lo, hi = log_range([v for s in (*series.values(), *means.values()) for _, v in s])
    floor_dec = lo - 1
    left, right, top, bottom = 70, 20, 20, 45
    pw, ph = width - left - right, height - top - bottom
    layers = sorted({x for s in series.values() for x, _ in s}) or [0]
    x0, x1 = layers[0] - 0.5, max(layers[-1], layers[0] + 1) + 0.5

    def sx(x):
        return left + (x - x0) / (x1 - x0) * pw

    def sy(dec):
        return top + (hi - dec) / (hi - floor_dec) * ph

    def ypos(v):
        return sy(floor_dec if v is None or v <= 0 else math.log10(v))

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="per-layer drift">',
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fff" stroke="#999"/>',
    ]
    for dec in range(lo, hi + 1):
        y = sy(dec)
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{y:.1f}" y2="{y:.1f}" stroke="#eee"/>')
        out.append(f'<text x="{left - 6}" y="{y + 4:.1f}" text-anchor="end" font-size="11">1e{dec}</text>')
    yf = sy(floor_dec)
    out.append(f'<line x1="{left}" x2="{left + pw}" y1="{yf:.1f}" y2="{yf:.1f}" stroke="#666" stroke-dasharray="2,3"/>')
    out.append(f'<text x="{left - 6}" y="{yf + 4:.1f}" text-anchor="end" font-size="11">0</text>')
    out.append(f'<text x="{left + 6}" y="{yf - 5:.1f}" font-size="11" fill="#666">0 (bitwise equal)</text>')
    step = max(1, len(layers) // 12)
    for x in layers[::step]:
        out.append(f'<text x="{sx(x):.1f}" y="{top + ph + 16}" text-anchor="middle" font-size="11">{x}</text>')
    out.append(f'<text x="{left + pw / 2}" y="{height - 8}" text-anchor="middle" font-size="12">decoder layer</text>')
    out.append(
        f'<text x="14" y="{top + ph / 2}" text-anchor="middle" font-size="12" '
        f'transform="rotate(-90 14 {top + ph / 2})">|delta| (log scale)</text>'
    )
    for i, (name, label, color) in enumerate(CHAINS):
        for data, dash in ((series[name], ""), (means[name], ' stroke-dasharray="5,4"')):
            pts = " ".join(f"{sx(x):.1f},{ypos(v):.1f}" for x, v in data)
            if pts:
                out.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2"{dash}/>')
        for x, v in series[name]:
            tip = "0" if not v else f"{v:.3g}"
            out.append(
                f'<circle cx="{sx(x):.1f}" cy="{ypos(v):.1f}" r="3.5" fill="{color}">'
                f"<title>{html.escape(label)}, layer {x}: max |delta| {tip}</title></circle>"
            )
        ly = top + 14 + 16 * i
        out.append(
            f'<line x1="{left + pw - 250}" x2="{left + pw - 225}" y1="{ly - 4}" y2="{ly - 4}" '
            f'stroke="{color}" stroke-width="2"/>'
        )
        out.append(f'<text x="{left + pw - 220}" y="{ly}" font-size="11">{html.escape(label)}</text>')
    out.append(
        f'<text x="{left + pw - 250}" y="{top + 14 + 16 * len(CHAINS)}" font-size="10" fill="#555">'
        f"solid: max, dashed: mean</text>"
    )
    out.append("</svg>")
    return "\n".join(out)


def svg_histogram(report: dict, width: int = 640, height: int = 300) -> str:
    """Inline SVG: grouped bars (rlk off, rlk on) of response tokens per |delta lp| bin."""
    hist = report["histogram"]
    labels, off, on = hist["labels"], hist["off"], hist["on"]
    left, right, top, bottom = 50, 20, 20, 80
    pw, ph = width - left - right, height - top - bottom
    top_count = max([1, *off, *on])
    tick = max(1, math.ceil(top_count / 4))
    ymax = tick * math.ceil(top_count / tick)
    n = max(1, len(labels))
    bw = pw / n

    def sy(c):
        return top + ph - c / ymax * ph

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" role="img" aria-label="histogram of the final log-prob drift">',
        f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="#fff" stroke="#999"/>',
    ]
    for c in range(0, ymax + 1, tick):
        out.append(f'<text x="{left - 6}" y="{sy(c) + 4:.1f}" text-anchor="end" font-size="11">{c:.0f}</text>')
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{sy(c):.1f}" y2="{sy(c):.1f}" stroke="#eee"/>')
    for i, lab in enumerate(labels):
        for j, (counts, (_, label, color)) in enumerate(((off, CHAINS[0]), (on, CHAINS[1]))):
            c = counts[i]
            x = left + i * bw + bw * (0.1 + 0.4 * j)
            out.append(
                f'<rect x="{x:.1f}" y="{sy(c):.1f}" width="{bw * 0.4:.1f}" height="{top + ph - sy(c):.1f}" '
                f'fill="{color}"><title>{html.escape(label)}: {c} tokens in {html.escape(lab)}</title></rect>'
            )
            if c:
                out.append(
                    f'<text x="{x + bw * 0.2:.1f}" y="{sy(c) - 3:.1f}" text-anchor="middle" font-size="9">{c}</text>'
                )
        cx, cy = left + (i + 0.5) * bw, top + ph + 10
        out.append(
            f'<text x="{cx:.1f}" y="{cy:.1f}" font-size="10" text-anchor="end" '
            f'transform="rotate(-45 {cx:.1f} {cy:.1f})">{html.escape(lab)}</text>'
        )
    for j, (_, label, color) in enumerate(CHAINS):
        out.append(f'<rect x="{left + pw - 240}" y="{top + 6 + 16 * j}" width="12" height="10" fill="{color}"/>')
        out.append(f'<text x="{left + pw - 222}" y="{top + 15 + 16 * j}" font-size="11">{html.escape(label)}</text>')
    out.append(
        f'<text x="{left + pw / 2}" y="{height - 4}" text-anchor="middle" font-size="12">'
        f"|rollout lp - training lp| per response token</text>"
    )
    out.append("</svg>")
    return "\n".join(out)


_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1000px; color: #222; }
table { border-collapse: collapse; margin: 0.5em 0 1.5em; font-size: 13px; }
td, th { border: 1px solid #ccc; padding: 3px 8px; text-align: right; }
td:first-child, th:first-child { text-align: left; }
.pass { background: #d9f2d9; } .fail { background: #f8d0d0; } .info { background: #eef; }
code { background: #f4f4f4; padding: 0 3px; }
.small { font-size: 12px; color: #555; }
"""


def _table(head: list[str], rows: list[list], classes: list[str] | None = None) -> str:
    out = ["<table>", "<tr>" + "".join(f"<th>{html.escape(str(h))}</th>" for h in head) + "</tr>"]
    for i, row in enumerate(rows):
        cls = f' class="{classes[i]}"' if classes and classes[i] else ""
        out.append(f"<tr{cls}>" + "".join(f"<td>{html.escape(str(c))}</td>" for c in row) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def render_html(report: dict) -> str:
    """The self-contained page as a string."""
    esc = html.escape
    m, dev, s = report["model"], report["device"], report["settings"]
    title = f"rlk consistency: {m['name']}, {report['dtype']} on {dev['device']}"
    verdict = (
        "PASSED: every rlk-on claim holds bit for bit" if report["passed"] else "FAILED: " + ", ".join(report["failed"])
    )
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{esc(title)}</title>",
        f"<style>{_CSS}</style></head><body>",
        f"<h1>{esc(title)}</h1>",
        f'<p class="{"pass" if report["passed"] else "fail"}"><b>{esc(verdict)}</b></p>',
        f"<p>Model <code>{esc(m['name'])}</code> ({esc(str(m.get('class')))}, {m.get('parameters', 0):,} parameters), "
        f"{s['prompts']} prompts of {min(report['prompt_lengths'])}..{max(report['prompt_lengths'])} tokens, up to "
        f"{s['max_new_tokens']} sampled tokens each, seed {report['seeds']['sampling']}. The rollout (left-padded "
        f"batched prefill in chunks of {s['prefill_chunk']}, then decode with a KV cache, the batch shrinking as "
        f"sequences finish) and the training forward (packed micro-batches, teacher forcing) score the same "
        f"sampled tokens. Each chain samples its own responses with <code>rlk.sample</code> (Gumbel-max with "
        f"Philox, a seed per sequence derived from the sampling seed and the sequence index, the step = the "
        f"token's index in its response): a token depends only on its logits row's bits, so the two chains "
        f"sample the same tokens wherever their logits are bitwise equal. "
        f"Split A: {esc(s['split_a'])}; split B: {esc(s['split_b'])}.</p>",
        "<h2>Verdicts</h2>",
        _table(
            ["status", "claim", "detail"],
            [[v["status"].upper(), v["claim"], v["detail"]] for v in report["verdicts"]],
            [v["status"] for v in report["verdicts"]],
        ),
        "<h2>rlk off vs on</h2>",
        _table(["", "rlk off", "rlk on"], [list(r) for r in summary_rows(report)]),
        "<h2>Per-layer drift, rollout vs training</h2>",
        '<p class="small">Hidden states after each op of each decoder layer, captured by forward hooks on both '
        "paths for the same (sequence, position); max |delta| (solid) and mean |delta| (dashed) over the layer's "
        "ops. Exact zero is drawn on the dotted floor.</p>",
        svg_layer_chart(report),
    ]
    for name, label, _ in CHAINS:
        probe = report["chains"][name]["probe"]
        parts.append(f"<p>{esc(label)}: first divergent (layer, op): <b>{esc(_first(probe))}</b></p>")
    rows = []
    on_layers = {r["layer"]: r for r in report["chains"]["on"]["probe"]["per_layer"]}
    for r in report["chains"]["off"]["probe"]["per_layer"]:
        b = on_layers.get(r["layer"], {})
        rows.append(
            [
                r["layer"],
                _num(r.get("max_abs")),
                _num(r.get("mean_abs")),
                r.get("first_op") or "-",
                _num(b.get("max_abs")),
                _num(b.get("mean_abs")),
                b.get("first_op") or "-",
            ]
        )
    parts.append(_table(["layer", "off max", "off mean", "off first op", "on max", "on mean", "on first op"], rows))
    hist = report["histogram"]
    parts += [f"<h2>Final log-prob drift</h2><p class='small'>{esc(hist['what'])}</p>", svg_histogram(report)]
    parts.append("<h2>Per sequence</h2>")
    on_seqs = report["chains"]["on"]["sequences"]
    rows = []
    for a, b in zip(report["chains"]["off"]["sequences"], on_seqs):
        rows.append(
            [
                a["index"],
                a["prompt_len"],
                f"{a['response_len']} / {b['response_len']}",
                _num(a["rollout_vs_training_max_abs"]),
                _num(b["rollout_vs_training_max_abs"]),
                _num(a["split_a_vs_b_max_abs"]),
                _num(b["split_a_vs_b_max_abs"]),
                _num(a["grad_equal"]),
                _num(b["grad_equal"]),
                _num(a.get("training_vs_reference_max_abs")),
                _num(b.get("training_vs_reference_max_abs")),
            ]
        )
    parts.append(
        _table(
            [
                "seq",
                "prompt",
                "response off / on",
                "roll vs train off",
                "on",
                "split A vs B off",
                "on",
                "grads equal off",
                "on",
                "train vs ref off",
                "on",
            ],
            rows,
        )
    )
    con = report.get("contract")
    if con:
        parts.append(
            f"<p class='small'>Ground truth: {esc(report['reference']['dtype'])}, "
            f"{esc(report['reference']['how'])}. Judged with the contract entry <code>{esc(con['op'])}/"
            f"{esc(con['dtype'])}</code>: atol {con['atol']:g}, rtol {con['rtol']:g}, scale "
            f"{esc(con['scale'])}.</p>"
        )
    t_rows = []
    for name, label, _ in CHAINS:
        t = report["chains"][name].get("timings", {})
        t_rows.append(
            [
                label,
                _num(t.get("rollout_s")),
                _rate(t, "rollout_tokens_per_s"),
                _num(t.get("training_forward_s")),
                _rate(t, "training_tokens_per_s"),
            ]
        )
    parts += [
        "<h2>Timings</h2>",
        _table(["", "rollout s", "rollout tokens/s", "training forward s", "training tokens/s"], t_rows),
    ]
    parts.append("<h2>Environment</h2>")
    env_rows = [
        ["device", f"{dev['device']} ({dev.get('name')})"],
        ["chain backend", dev.get("chain_backend")],
        ["dtype", report["dtype"]],
        ["seeds", json.dumps(report["seeds"])],
        ["prompt lengths", " ".join(map(str, report["prompt_lengths"]))],
        ["model config", json.dumps(m.get("config", {}))],
    ]
    env_rows += [[k, v] for k, v in report["versions"].items()]
    env_rows += [["created", report.get("created")], ["run time", f"{report.get('seconds', 0):.1f} s"]]
    parts.append(_table(["", ""], env_rows))
    for note in report.get("notes", []):
        parts.append(f"<p class='small'>Note: {esc(note)}</p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def write_html(report: dict, path: str) -> str:
    with open(path, "w") as f:
        f.write(render_html(report))
    return path


def write_all(report: dict, out_dir: str) -> dict:
    """``drift.png`` (if matplotlib), ``drift.html`` and ``report.json`` into ``out_dir`` (created); returns
    ``{"json", "html", "png", "png_note"}`` (paths, None where not written), which is also stored in the JSON."""
    os.makedirs(out_dir, exist_ok=True)
    png, note = write_png(report, os.path.join(out_dir, "drift.png"))
    files = {
        "json": os.path.join(out_dir, "report.json"),
        "html": os.path.join(out_dir, "drift.html"),
        "png": png,
        "png_note": note,
    }
    report["files"] = files
    if note:
        report.setdefault("notes", []).append(note)
    write_html(report, files["html"])
    write_json(report, files["json"])
    return files
