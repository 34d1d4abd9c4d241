"""Forward throughput of rlk's batch-invariant chain vs stock kernels on a transformers causal LM.

The target: the invariant chain costs at most 20% over stock kernels on the H200 forward. ``rlk consistency``
times only its tiny prompt set (host-bound); this tool times realistic shapes, chain off and on, in one process on
one model (:func:`rlk.app.consistency.harness.build_model`), switching with :func:`rlk.app.consistency.paths.chain`
(on: ``rlk.batch_invariant()`` + ``rlk.patch_model(model)``; off: stock PyTorch / cuBLAS / SDPA). Inputs are fed
the way :mod:`rlk.app.consistency.paths` feeds them (the shapes the consistency test checks bitwise), all under
``torch.no_grad()``; token ids are drawn from ``torch.Generator(seed)``:

* ``training``: one packed row of ``S`` sequences of ``L`` tokens, ``input_ids [1, S*L]``, ``position_ids``
  restarting at 0 per sequence, no mask, no cache, full logits ``[1, S*L, V]`` (a trainer's forward).
  tokens = ``S*L``. Stock transformers turns the packing into a block-diagonal mask for SDPA (not a flash
  varlen kernel); rlk's patched attention splits the row at ``position_ids == 0`` (varlen ``cu_seqlens``).
* ``prefill``: a left-padded batch ``input_ids [B, P]`` (row lengths uniform in ``[ceil(P/2), P]``),
  ``attention_mask [B, P]`` (1: token), ``position_ids = clamp(cumsum(mask) - 1, 0)``, a fresh
  ``transformers.DynamicCache``, ``logits_to_keep=1``. tokens = the non-pad tokens.
* ``decode``: per repetition (untimed) a fresh cache and the prefill of a left-padded batch ``[B_dec, P_dec]``
  (lengths as above), then (timed) ``K`` single-token steps ``input_ids [B_dec, 1]`` with the mask grown by one
  column and ``position_ids`` = each row's next position, ``logits_to_keep=1``. Reported per step;
  tokens/s = ``B_dec / step time``. The step tokens are drawn in advance (no sampling in the timed region).
* ``decode_graph``: the decode step as a rollout engine runs it, captured in a CUDA graph: a
  ``transformers.StaticCache`` of ``P_dec + K`` slots, fixed buffers for ``input_ids [B_dec, 1]``,
  ``position_ids``, ``cache_position [1]`` and an ``attention_mask [B_dec, P_dec + K]`` over all the slots (0 where
  not written yet); per repetition (untimed) the cache is reset in place and the prompts prefilled eagerly, then
  (timed) ``K`` steps, each writing its inputs into the buffers and replaying the graph. The graph is captured
  once per chain state, after one eager warmup step, with rlk's value checks off (``RLK_CHECK_VALUES=0``'s
  context: they read tensors on the host). Same inputs and tokens/s as ``decode``. On the CPU (no graphs) the
  same step runs eagerly: it checks the tool, not the timing.

Timing: CUDA events on a GPU (``perf_counter`` + synchronize otherwise), the device synchronized before each timed
region; 2 warmup repetitions (Triton compiles there), then ``--reps``; median and min in ms. Per scenario:
``overhead = t_on / t_off - 1`` of the medians (and of the mins), target ``overhead <= 0.20``.

GPU kernel time (CUDA only; ``None`` on the CPU): after the timed repetitions, one more repetition (setup untimed,
outside) runs under ``torch.profiler`` (activities CPU + CUDA); ``kernel_ms`` is the device busy time of the CUDA
kernels and memory operations (memcpy, memset) it ran: their summed durations, overlaps counted once (``device_ms``
of ``bench_asv/benchmarks/common.py``, the helper the asv suite's ``kernel_ms`` uses), per timed unit (per step for
decode); ``kernel_overhead = kernel_ms_on / kernel_ms_off - 1``. The wall time minus the kernel time is what the
host adds (Python, launches, GPU idle between kernels): a host-bound scenario (decode) has ``kernel_ms`` far below
its wall time.
``rlk_aten_calls`` counts the warmup and timed repetitions only, not the profiled one.

Host profile (``--host-profile N``, off by default): after the scenarios, one unit of work of
``--host-profile-scenario`` (one forward; for decode one repetition's ``K`` steps, its prefill untimed outside), same
inputs, runs under ``cProfile`` with the chain off and with it on (after ``2`` warmup repetitions when the scenario
was not timed in this run); the device is synchronized before and after, outside the profile, so the profile is the
host's time. The top ``N`` functions by cumulative time and by own time (``pstats`` text) go to
``<out>/host_profile_<scenario>_<off|on>.txt``, headed by the unit's wall time under cProfile (inflated by cProfile's
own cost) and the aten calls rlk served in it.

    python tools/bench_chain_forward.py [--model qwen3-8b-shape] [--reps 5]
        [--scenarios training,prefill,decode,decode_graph]
        [--out out/chain_bench]          # writes out/chain_bench/chain_forward.json
        [--host-profile 40 [--host-profile-scenario decode]]   # and out/chain_bench/host_profile_decode_{off,on}.txt

On the CPU the chain runs in the Triton interpreter (float32 only): the numbers check the tool, not the overhead.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import importlib.util
import json
import math
import os
import pstats
import statistics
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch

SCENARIOS = ("training", "prefill", "decode", "decode_graph")
TARGET_OVERHEAD = 0.20
WARMUP = 2


def _load_bench_common():
    """``bench_asv/benchmarks/common.py``, the shared measurement helpers of the asv suite, loaded by path (the
    ``benchmarks`` package is not installed; its ``run.py`` puts ``bench_asv`` on ``sys.path`` instead)."""
    path = Path(__file__).resolve().parents[1] / "bench_asv" / "benchmarks" / "common.py"
    spec = importlib.util.spec_from_file_location("_rlk_bench_asv_common", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench_common = _load_bench_common()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--model",
        default="qwen3-8b-shape",
        help="tiny, tiny-llama, qwen3-8b-shape, llama3-8b-shape or a checkpoint directory",
    )
    p.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    p.add_argument("--num-layers", type=int, default=None, help="override the model's layer count")
    p.add_argument("--seed", type=int, default=0, help="weights and input tokens")
    p.add_argument("--seqs", type=int, default=16, help="training: sequences packed in the row (S)")
    p.add_argument("--seq-len", type=int, default=512, help="training: tokens per sequence (L)")
    p.add_argument("--prefill-batch", type=int, default=16, help="prefill: batch rows (B)")
    p.add_argument("--prefill-len", type=int, default=512, help="prefill: padded width (P)")
    p.add_argument("--decode-batch", type=int, default=32, help="decode: batch rows (B_dec)")
    p.add_argument("--decode-len", type=int, default=512, help="decode: padded prompt width (P_dec)")
    p.add_argument("--decode-steps", type=int, default=16, help="decode: timed single-token steps (K)")
    p.add_argument("--reps", type=int, default=5, help="timed repetitions (after 2 warmup ones)")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma-separated subset of " + ",".join(SCENARIOS))
    p.add_argument("--out", default="out/chain_bench", help="directory of chain_forward.json")
    p.add_argument(
        "--host-profile",
        type=int,
        default=0,
        metavar="N",
        help="cProfile one unit of --host-profile-scenario, chain off and on; write the top N functions "
        "to <out>/host_profile_<scenario>_<chain>.txt (0: off)",
    )
    p.add_argument(
        "--host-profile-scenario", default="decode", choices=SCENARIOS, help="the scenario --host-profile profiles"
    )
    return p


# ---------------------------------------------------------------------------
# inputs (fed as rlk.app.consistency.paths feeds them)
# ---------------------------------------------------------------------------


def _row_lengths(n: int, width: int, gen: torch.Generator) -> list[int]:
    """``n`` lengths uniform in ``[ceil(width / 2), width]``."""
    return torch.randint(max(1, math.ceil(width / 2)), width + 1, (n,), generator=gen).tolist()


def _left_padded(lengths: list[int], width: int, vocab: int, gen: torch.Generator, device: torch.device):
    """Left-padded batch as in ``paths.rollout``: ``ids [B, width]`` int64 (0 in the pads), ``mask [B, width]``
    int64 (1: token), ``position_ids = clamp(cumsum(mask) - 1, min=0)``; on ``device``."""
    n = len(lengths)
    ids = torch.zeros((n, width), dtype=torch.int64)
    mask = torch.zeros((n, width), dtype=torch.int64)
    for i, length in enumerate(lengths):
        ids[i, width - length :] = torch.randint(0, vocab, (length,), generator=gen)
        mask[i, width - length :] = 1
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids.to(device), mask.to(device), position_ids.to(device)


def _packed_row(seqs: int, seq_len: int, vocab: int, gen: torch.Generator, device: torch.device):
    """One packed row as in ``paths.training_logprobs``: ``ids [1, seqs*seq_len]`` int64 and ``position_ids``
    ``[1, seqs*seq_len]`` = ``0..seq_len-1`` per sequence."""
    ids = torch.randint(0, vocab, (1, seqs * seq_len), generator=gen)
    position_ids = torch.arange(seq_len, dtype=torch.int64).repeat(seqs)[None]
    return ids.to(device), position_ids.to(device)


# ---------------------------------------------------------------------------
# scenarios: (setup, body, tokens per timed unit, units per body, shape)
# ---------------------------------------------------------------------------


class Scenario:
    """``setup()`` (untimed) returns the state ``body(state)`` (timed) consumes; one body = ``units`` timed units
    (1 forward, or K decode steps) of ``tokens`` tokens each."""

    def __init__(
        self,
        setup: Callable[[], object],
        body: Callable[[object], None],
        tokens: int,
        units: int,
        unit: str,
        shape: dict,
    ):
        self.setup, self.body, self.tokens, self.units, self.unit, self.shape = setup, body, tokens, units, unit, shape


def _training(model, args, gen, device) -> Scenario:
    ids, position_ids = _packed_row(args.seqs, args.seq_len, model.config.vocab_size, gen, device)

    def body(_):
        model(input_ids=ids, position_ids=position_ids, use_cache=False)  # full logits (logits_to_keep=0)

    return Scenario(
        lambda: None,
        body,
        ids.shape[1],
        1,
        "forward",
        {
            "input_ids": list(ids.shape),
            "sequences": args.seqs,
            "seq_len": args.seq_len,
            "layout": "one packed row, position_ids restart per sequence, no mask, no cache",
            "logits": "all positions",
        },
    )


def _prefill(model, args, gen, device) -> Scenario:
    from rlk.integrations.hf import compat

    lengths = _row_lengths(args.prefill_batch, args.prefill_len, gen)
    ids, mask, position_ids = _left_padded(lengths, args.prefill_len, model.config.vocab_size, gen, device)

    def body(cache):
        compat.cached_forward(
            model, cache, input_ids=ids, attention_mask=mask, position_ids=position_ids, logits_to_keep=1
        )

    return Scenario(
        lambda: compat.new_cache(model),
        body,
        sum(lengths),
        1,
        "forward",
        {
            "input_ids": list(ids.shape),
            "row_lengths": lengths,
            "layout": "left-padded, attention_mask + position_ids, fresh DynamicCache",
            "logits": "last position (logits_to_keep=1)",
        },
    )


def _decode(model, args, gen, device) -> Scenario:
    from rlk.integrations.hf import compat

    n, steps = args.decode_batch, args.decode_steps
    lengths = _row_lengths(n, args.decode_len, gen)
    ids, mask, position_ids = _left_padded(lengths, args.decode_len, model.config.vocab_size, gen, device)
    step_ids = torch.randint(0, model.config.vocab_size, (steps, n, 1), generator=gen).to(device)
    step_masks = [torch.cat([mask, mask.new_ones((n, k + 1))], 1) for k in range(steps)]
    step_pos = [position_ids[:, -1:] + 1 + k for k in range(steps)]

    def setup():
        cache = compat.new_cache(model)
        compat.cached_forward(
            model, cache, input_ids=ids, attention_mask=mask, position_ids=position_ids, logits_to_keep=1
        )
        return cache

    def body(cache):
        for k in range(steps):
            compat.cached_forward(
                model,
                cache,
                input_ids=step_ids[k],
                attention_mask=step_masks[k],
                position_ids=step_pos[k],
                logits_to_keep=1,
            )

    return Scenario(
        setup,
        body,
        n,
        steps,
        "decode step",
        {
            "prompt_ids": list(ids.shape),
            "row_lengths": lengths,
            "steps": steps,
            "layout": "untimed left-padded prefill into a fresh DynamicCache per repetition, then K "
            "timed steps input_ids [B, 1] with the mask grown by one column",
            "logits": "last position (logits_to_keep=1)",
        },
    )


class _StaticDecode:
    """A static KV cache, the fixed input buffers of one decode step and, on CUDA, that step captured in a graph
    (one per chain state: the patched model's kernels differ from the stock ones)."""

    def __init__(self, model, ids, mask, position_ids, step_ids, device):
        from transformers import StaticCache

        from rlk.integrations.hf import compat

        self.model, self.ids, self.prompt_mask, self.position_ids = model, ids, mask, position_ids
        self.step_ids = step_ids
        self.prompt_len, self.steps = ids.shape[1], step_ids.shape[0]
        self.cache_keyword = compat.cache_keyword(model)
        self.cache = StaticCache(config=model.config, max_cache_len=self.prompt_len + self.steps)
        self.mask = torch.zeros((ids.shape[0], self.prompt_len + self.steps), dtype=mask.dtype, device=device)
        self.step_input = torch.empty_like(step_ids[0])
        self.step_pos = torch.empty_like(position_ids[:, -1:])
        self.slot = torch.zeros((1,), dtype=torch.int64, device=device)
        self.graphs: dict[bool, torch.cuda.CUDAGraph] = {}
        self.device = device

    def _forward(self, **kwargs):
        return self.model(
            **kwargs, attention_mask=self.mask, use_cache=True, logits_to_keep=1, **{self.cache_keyword: self.cache}
        )

    def prefill(self) -> None:
        """Reset the cache in place and prefill the prompts (eager)."""
        self.cache.reset()
        self.mask.zero_()
        self.mask[:, : self.prompt_len] = self.prompt_mask
        self._forward(
            input_ids=self.ids,
            position_ids=self.position_ids,
            cache_position=torch.arange(self.prompt_len, device=self.device),
        )

    def set_inputs(self, k: int) -> None:
        """Step ``k``'s inputs into the buffers: its tokens, positions, slot, and the slot's mask column."""
        self.step_input.copy_(self.step_ids[k])
        self.step_pos.copy_(self.position_ids[:, -1:] + 1 + k)
        self.slot.fill_(self.prompt_len + k)
        self.mask[:, self.prompt_len + k] = 1

    def step(self) -> None:
        self._forward(input_ids=self.step_input, position_ids=self.step_pos, cache_position=self.slot)

    def graph(self) -> torch.cuda.CUDAGraph | None:
        """The captured step of the current chain state (captured on first use); None off CUDA."""
        if self.device.type != "cuda":
            return None
        from rlk.core import checks

        chain_on = getattr(self.model, "_rlk_patch", None) is not None
        if chain_on not in self.graphs:
            self.prefill()
            self.set_inputs(0)
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side), checks.trusted_values():
                self.step()  # warmup: compiles, allocates the step's workspace
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph), checks.trusted_values():
                self.step()
            self.graphs[chain_on] = graph
        return self.graphs[chain_on]


def _decode_graph(model, args, gen, device) -> Scenario:
    n, steps = args.decode_batch, args.decode_steps
    lengths = _row_lengths(n, args.decode_len, gen)
    ids, mask, position_ids = _left_padded(lengths, args.decode_len, model.config.vocab_size, gen, device)
    step_ids = torch.randint(0, model.config.vocab_size, (steps, n, 1), generator=gen).to(device)
    static = _StaticDecode(model, ids, mask, position_ids, step_ids, device)

    def setup():
        graph = static.graph()
        static.prefill()
        return graph

    def body(graph):
        for k in range(steps):
            static.set_inputs(k)
            if graph is None:
                static.step()
            else:
                graph.replay()

    return Scenario(
        setup,
        body,
        n,
        steps,
        "decode step",
        {
            "prompt_ids": list(ids.shape),
            "row_lengths": lengths,
            "steps": steps,
            "layout": f"StaticCache of {args.decode_len + steps} slots reset and prefilled (untimed) per "
            "repetition, then K timed steps: inputs copied into fixed buffers (mask over all "
            "slots, cache_position), the step replayed from a CUDA graph (eager off CUDA)",
            "logits": "last position (logits_to_keep=1)",
        },
    )


_BUILDERS = {"training": _training, "prefill": _prefill, "decode": _decode, "decode_graph": _decode_graph}


# ---------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_scenario(scenario: Scenario, device: torch.device, reps: int, warmup: int = WARMUP) -> list[float]:
    """ms per timed unit of each of the ``reps`` repetitions after ``warmup`` ones (setup untimed)."""
    times = []
    for i in range(warmup + reps):
        state = None  # free the previous repetition's cache before building the next one
        state = scenario.setup()
        _sync(device)
        ms = bench_common.run_ms(lambda state=state: scenario.body(state), device)
        if i >= warmup:
            times.append(ms / scenario.units)
    return times


def kernel_ms_per_unit(scenario: Scenario, device: torch.device) -> float | None:
    """GPU ms per timed unit of one repetition under ``torch.profiler`` (activities CPU + CUDA): ``setup()``
    outside the profile, ``body(state)`` and a synchronize inside; the device busy time of the CUDA kernels,
    memcpys and memsets it recorded (``bench_common.device_ms``) / ``units``. ``None`` off CUDA."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    state = scenario.setup()
    _sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        scenario.body(state)
        _sync(device)
    return bench_common.device_ms(prof) / scenario.units


def _stats(times: list[float], tokens: int) -> dict:
    med = statistics.median(times)
    return {"ms_median": med, "ms_min": min(times), "ms_all": times, "tokens_per_s": tokens / (med / 1e3)}


def build_scenario(model, name: str, args, device: torch.device) -> Scenario:
    """Scenario ``name`` on inputs drawn from ``args.seed`` (the same inputs every time it is built)."""
    gen = torch.Generator().manual_seed(args.seed * 1_000_003 + SCENARIOS.index(name) + 1)
    return _BUILDERS[name](model, args, gen, device)


def run_scenario(model, name: str, args, device: torch.device) -> dict:
    """Time ``name`` with the chain off, then on, on the same inputs (drawn from ``args.seed``); then, per chain,
    one profiled repetition for the GPU kernel time."""
    from rlk.app.consistency.paths import chain
    from rlk.integrations.batch_invariant import served_calls

    scenario = build_scenario(model, name, args, device)
    out: dict = {"shape": scenario.shape, "unit": scenario.unit, "tokens_per_unit": scenario.tokens}
    for enabled in (False, True):
        before = sum(served_calls.values())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with chain(model, enabled), torch.no_grad():
                times = time_scenario(scenario, device, args.reps)
                calls = sum(served_calls.values()) - before
                kernel_ms = kernel_ms_per_unit(scenario, device)
        _sync(device)
        stats = _stats(times, scenario.tokens)
        stats["kernel_ms"] = kernel_ms
        stats["rlk_aten_calls"] = calls
        stats["rlk_fallback_warnings"] = sorted({str(w.message) for w in caught if "rlk" in str(w.message)})
        out["on" if enabled else "off"] = stats
    off, on = out["off"], out["on"]
    out["overhead"] = on["ms_median"] / off["ms_median"] - 1.0
    out["overhead_min"] = on["ms_min"] / off["ms_min"] - 1.0
    out["target_met"] = out["overhead"] <= TARGET_OVERHEAD
    out["kernel_overhead"] = (
        on["kernel_ms"] / off["kernel_ms"] - 1.0 if off["kernel_ms"] and on["kernel_ms"] is not None else None
    )
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def host_profile(model, args, device: torch.device, warm: bool) -> dict:
    """cProfile one unit of work of ``args.host_profile_scenario`` (one forward, or one repetition's ``K`` decode
    steps; ``setup()`` outside the profile) with the chain off, then on, after ``WARMUP`` untimed repetitions unless
    ``warm`` (the scenario already ran in this process). Writes the top ``args.host_profile`` functions by cumulative
    and by own time to ``<args.out>/host_profile_<scenario>_<off|on>.txt``; returns the file paths, the unit's wall
    ms under cProfile and the aten calls rlk served in it, per chain."""
    from rlk.app.consistency.paths import chain
    from rlk.integrations.batch_invariant import served_calls

    name, top = args.host_profile_scenario, args.host_profile
    scenario = build_scenario(model, name, args, device)
    result: dict = {"scenario": name, "top": top, "unit": scenario.unit, "units": scenario.units}
    for enabled in (False, True):
        label = "on" if enabled else "off"
        with chain(model, enabled), torch.no_grad():
            if not warm:
                time_scenario(scenario, device, reps=0)
            state = scenario.setup()
            _sync(device)
            before = sum(served_calls.values())
            profiler = cProfile.Profile()
            t0 = time.perf_counter()
            profiler.enable()
            scenario.body(state)
            profiler.disable()
            wall_ms = (time.perf_counter() - t0) * 1e3
            calls = sum(served_calls.values()) - before
            _sync(device)
            state = None
        path = os.path.join(args.out, f"host_profile_{name}_{label}.txt")
        with open(path, "w") as f:
            f.write(
                f"host profile (cProfile) of {name}, chain {label}: one body of {scenario.units} "
                f"{scenario.unit}(s) on {device}, wall {wall_ms:.3f} ms under cProfile "
                f"({wall_ms / scenario.units:.3f} ms per {scenario.unit}), {calls} aten calls served by rlk\n"
            )
            stats = pstats.Stats(profiler, stream=f)
            f.write(f"\n=== top {top} by cumulative time ===\n")
            stats.sort_stats("cumulative").print_stats(top)
            f.write(f"\n=== top {top} by own time (tottime) ===\n")
            stats.sort_stats("tottime").print_stats(top)
        result[label] = {
            "file": path,
            "wall_ms": wall_ms,
            "wall_ms_per_unit": wall_ms / scenario.units,
            "rlk_aten_calls": calls,
        }
        print(f"wrote {path}")
    return result


# ---------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------


def _shape_text(name: str, r: dict) -> str:
    s = r["shape"]
    if name == "training":
        return f"1 x {s['sequences']}x{s['seq_len']} packed"
    if name == "prefill":
        b, p = s["input_ids"]
        return f"{b} x {p} left-padded"
    b, p = s["prompt_ids"]
    return f"{b} x {p} + {s['steps']} steps"


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def format_table(report: dict) -> str:
    head = (
        f"{'scenario':<9} {'shape':<24} {'unit':<12} {'tok/unit':>8} {'ms off med/min':>17} "
        f"{'ms on med/min':>17} {'tok/s off':>11} {'tok/s on':>11} {'overhead':>9}  <=20% "
        f"{'kernel ms off/on':>19} {'kern ovh':>9}"
    )
    lines = [
        f"rlk chain forward: {report['model']['name']} ({report['dtype']}) on {report['device']['name']}, "
        f"{report['settings']['reps']} reps after {report['settings']['warmup']} warmup, {report['timer']}",
        head,
        "-" * len(head),
    ]
    for name, r in report["scenarios"].items():
        off, on = r["off"], r["on"]
        lines.append(
            f"{name:<9} {_shape_text(name, r):<24} {r['unit']:<12} {r['tokens_per_unit']:>8} "
            f"{off['ms_median']:>8.3f}/{off['ms_min']:<8.3f} {on['ms_median']:>8.3f}/{on['ms_min']:<8.3f} "
            f"{off['tokens_per_s']:>11.1f} {on['tokens_per_s']:>11.1f} {100 * r['overhead']:>8.1f}%  "
            f"{'yes' if r['target_met'] else 'NO':<5} {_ms(off['kernel_ms']):>9}/{_ms(on['kernel_ms']):<9} "
            f"{'-' if r['kernel_overhead'] is None else format(100 * r['kernel_overhead'], '.1f') + '%':>9}"
        )
    lines += [f"note: {n}" for n in report["notes"]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    """Parse ``argv`` (default ``sys.argv[1:]``), run the scenarios, print the table, write
    ``<out>/chain_forward.json``; returns the report dict."""
    command = list(sys.argv) if argv is None else [sys.argv[0] if sys.argv else "bench_chain_forward.py", *argv]
    args = build_parser().parse_args(argv)
    names = [s.strip() for s in args.scenarios.split(",") if s.strip()]
    bad = [s for s in names if s not in SCENARIOS]
    if bad or not names:
        raise SystemExit(f"--scenarios: unknown {bad or names}; choose from {','.join(SCENARIOS)}")
    sizes = {
        k: getattr(args, k)
        for k in (
            "seqs",
            "seq_len",
            "prefill_batch",
            "prefill_len",
            "decode_batch",
            "decode_len",
            "decode_steps",
            "reps",
        )
    }
    if any(v < 1 for v in sizes.values()):
        raise SystemExit(f"every size must be >= 1: {sizes}")
    if args.host_profile < 0:
        raise SystemExit(f"--host-profile must be >= 0 (0: off), got {args.host_profile}")
    if args.host_profile and not args.out:
        raise SystemExit("--host-profile writes its files under --out: give a directory")

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    from rlk.app.consistency import run

    dtype = run.parse_dtype(args.dtype) if args.dtype else (torch.bfloat16 if device.type == "cuda" else torch.float32)
    notes = []
    if device.type == "cpu":
        if dtype != torch.float32:
            raise SystemExit(f"--dtype {args.dtype} on the CPU: the Triton interpreter serves float32 only")
        run.ensure_interpreter()  # before triton is imported (building the model may import it)
        notes.append(
            "CPU: rlk's chain runs in the Triton interpreter, stock kernels natively: the overhead says "
            "nothing about the GPU"
        )

    from rlk.app.consistency import harness

    model = harness.build_model(args.model, dtype=dtype, device=device, seed=args.seed, num_layers=args.num_layers)
    for p in model.parameters():
        p.requires_grad_(False)

    scenarios = {name: run_scenario(model, name, args, device) for name in names}
    host = None
    if args.host_profile:
        os.makedirs(args.out, exist_ok=True)
        host = host_profile(model, args, device, warm=args.host_profile_scenario in names)
    for name, r in scenarios.items():
        if r["on"]["rlk_aten_calls"] == 0:
            notes.append(f"{name}: no aten call was served by rlk with the chain on")
        if r["on"]["rlk_fallback_warnings"]:
            notes.append(f"{name}: rlk fell back to stock code: {'; '.join(r['on']['rlk_fallback_warnings'])}")

    report = {
        "benchmark": "rlk chain forward (batch-invariant chain vs stock kernels)",
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": command,
        "device": {
            "device": str(device),
            "name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        },
        "versions": run._versions(),
        "model": run._model_summary(args.model, model),
        "dtype": str(dtype).removeprefix("torch."),
        "timer": "cuda events" if device.type == "cuda" else "perf_counter",
        "settings": {
            **sizes,
            "warmup": WARMUP,
            "seed": args.seed,
            "num_layers": args.num_layers,
            "scenarios": names,
            "target_overhead": TARGET_OVERHEAD,
            "overhead": "ms_on_median / ms_off_median - 1 (overhead_min: of the mins)",
            "kernel_ms": "device busy time of the CUDA kernels + memcpy/memset of one extra repetition under "
            "torch.profiler, per unit (None off CUDA); kernel_overhead: kernel_ms_on / "
            "kernel_ms_off - 1",
            "host_profile": args.host_profile,
            "host_profile_scenario": args.host_profile_scenario,
        },
        "scenarios": scenarios,
        "host_profile": host,
        "target_met": all(r["target_met"] for r in scenarios.values()),
        "notes": notes,
    }
    print(format_table(report))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, "chain_forward.json")
        with open(path, "w") as f:
            json.dump(report, f, indent=2)
        report["file"] = path
        print(f"wrote {path}")
    return report


if __name__ == "__main__":
    main()
