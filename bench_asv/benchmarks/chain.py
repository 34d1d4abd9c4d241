"""Forward of a Hugging Face causal LM with rlk's batch-invariant chain on vs stock kernels: a training forward, a
prefill and a decode step (the suite's view of ``tools/bench_chain_forward.py``).

The tool builds the inputs and times each scenario (it is loaded by path, so the suite and the tool time the same
thing); the model is ``rlk.app.consistency.harness.build_model``'s:

* ``training``: one packed row of ``S x L`` tokens, full logits (a trainer's forward); one unit is the forward;
* ``prefill``: ``B x P`` left-padded tokens into a fresh KV cache, last-position logits; one unit is the forward;
* ``decode``: per repetition an untimed left-padded ``B_dec x P_dec`` prefill, then ``K`` single-token steps;
  one unit is one step;
* ``decode_graph``: the same steps on a static KV cache, each replayed from a CUDA graph (eager off CUDA).

Implementations (``impl``): ``stock`` (PyTorch / cuBLAS / SDPA) and ``rlk`` (``rlk.batch_invariant()`` +
``rlk.patch_model``), switched on one model by ``rlk.app.consistency.paths.chain``. Shape ``(layers,)``: the model's
decoder layers. On a GPU: ``qwen3-8b-shape`` (hidden 4096, 32 / 8 heads of 128, MLP 12288, V = 151936) with 8
layers in bf16, S = 16, L = 512, B = 16, P = 512, B_dec = 32, P_dec = 512, K = 16 (issue 19's decode figure).
Quick mode (or no GPU): the tiny model in float32 with sizes of 2-8, rlk's chain in the Triton interpreter, so
the numbers only check the suite.

Work credited per unit, the same for both impls (the roofline of each regime):

* training and prefill (``TFLOP/s``): ``2 x tokens x`` the weights of every ``nn.Linear`` (the decoder's
  projections and the LM head; prefill's head at one position per row): the dense GEMM FLOPs, attention's own
  FLOPs left out;
* decode and decode_graph (``GB/s``): one read of every ``nn.Linear`` weight plus the KV cache a step reads
  (``2 x layers x B_dec x (P_dec + (K + 1) / 2) x Hkv x D`` elements, the mean over the K steps): the bytes
  a perfect step moves.

``peak_extra_mib`` is that of one repetition (for decode: the prefill and the K steps; for decode_graph also its
graph's capture, which the first repetition does; its static cache is allocated when the scenario is built).
"""

from __future__ import annotations

import importlib.util
import statistics
from pathlib import Path

import torch

from .common import DEVICE, QUICK, REPEATS, SEED, WARMUP, CaseBase, _CaseSetup, peak_extra_mib

IMPLS = ["stock", "rlk"]
SCENARIOS = ["training", "prefill", "decode", "decode_graph"]
MODEL = "tiny" if QUICK else "qwen3-8b-shape"
DTYPE = torch.float32 if QUICK else torch.bfloat16
SHAPES = [(2,)] if QUICK else [(8,)]
#: The tool's size arguments (its defaults on a GPU).
SIZES = (
    [
        "--seqs",
        "2",
        "--seq-len",
        "8",
        "--prefill-batch",
        "2",
        "--prefill-len",
        "8",
        "--decode-batch",
        "2",
        "--decode-len",
        "8",
        "--decode-steps",
        "2",
    ]
    if QUICK
    else []
)

_TOOL_PATH = Path(__file__).resolve().parents[2] / "tools" / "bench_chain_forward.py"
_tool = None
_model = {}  # (layers) -> the model, one at a time


def tool():
    """``tools/bench_chain_forward.py`` as a module (loaded once)."""
    global _tool
    if _tool is None:
        spec = importlib.util.spec_from_file_location("_rlk_bench_chain_forward", _TOOL_PATH)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _tool = module
    return _tool


def model(layers: int):
    """The benchmark's model with ``layers`` decoder layers, no gradients (built once, shared by both impls)."""
    if layers not in _model:
        from rlk.app.consistency import harness

        _model.clear()
        built = harness.build_model(MODEL, dtype=DTYPE, device=DEVICE, seed=SEED, num_layers=layers)
        for p in built.parameters():
            p.requires_grad_(False)
        _model[layers] = built
    return _model[layers]


def _work(lm, scenario: str, args) -> tuple[float, str]:
    linears = [m for m in lm.modules() if isinstance(m, torch.nn.Linear)]
    weights = sum(m.weight.numel() for m in linears)
    head = lm.get_output_embeddings().weight.numel()
    if scenario == "training":
        return 2.0 * args.seqs * args.seq_len * weights, "TFLOP/s"
    if scenario == "prefill":
        rows, width = args.prefill_batch, args.prefill_len
        return 2.0 * rows * width * (weights - head) + 2.0 * rows * head, "TFLOP/s"
    cfg = lm.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = 2 * cfg.num_hidden_layers * args.decode_batch * (args.decode_len + (args.decode_steps + 1) / 2)
    itemsize = torch.empty((), dtype=DTYPE).element_size()
    return (weights + kv * cfg.num_key_value_heads * head_dim) * itemsize, "GB/s"


class ChainCase(CaseBase):
    """One scenario of the chain benchmark, stock or rlk, on the shared model."""

    def __init__(self, op: str, impl: str, scenario: str, shape: tuple[int]):
        if impl not in IMPLS:
            raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
        if scenario not in SCENARIOS:
            raise ValueError(f"unknown scenario {scenario!r}; expected one of {SCENARIOS}")
        t = tool()
        (layers,) = shape
        self.lm = model(layers)
        self.enabled = impl == "rlk"
        self.args = t.build_parser().parse_args(["--model", MODEL, *SIZES])
        self.scenario = t.build_scenario(self.lm, scenario, self.args, DEVICE)
        self.work, self.unit = _work(self.lm, scenario, self.args)
        self._times = None

    def _chain(self):
        from rlk.app.consistency.paths import chain

        return chain(self.lm, self.enabled)

    def step(self) -> object:
        """One repetition: the untimed setup and the timed body."""
        with self._chain(), torch.no_grad():
            return self.scenario.body(self.scenario.setup())

    def ms(self) -> float:
        """Median ms per unit over ``REPEATS`` repetitions after ``WARMUP`` (the tool's ``time_scenario``; quick
        mode: one after one, the interpreter being slow)."""
        if self._ms is None:
            with self._chain(), torch.no_grad():
                self._times = tool().time_scenario(
                    self.scenario, DEVICE, 1 if QUICK else REPEATS, warmup=max(WARMUP, 1)
                )
            self._ms = statistics.median(self._times)
        return self._ms

    def rate(self) -> float:
        """The work per unit over the median: TFLOP/s (training, prefill) or GB/s (decode)."""
        scale = 1e12 if self.unit == "TFLOP/s" else 1e9
        return self.work / (self.ms() * 1e-3) / scale

    def kernel_ms(self) -> float | None:
        """GPU ms per unit of one profiled repetition (None off CUDA)."""
        with self._chain(), torch.no_grad():
            return tool().kernel_ms_per_unit(self.scenario, DEVICE)

    def peak_extra_mib(self) -> float:
        return peak_extra_mib(self.step)


class ChainForward(_CaseSetup):
    """The batch-invariant chain vs stock kernels: ms per forward (per decode step)."""

    op, case_type, shape_names = "chain_forward", ChainCase, "L"
    baselines = ("stock",)
    param_names = ["impl", "scenario", "shape"]
    params = [IMPLS, SCENARIOS, SHAPES]
    timeout = 1800  # the 8-layer model's first compiles

    def track_ms(self, impl: str, scenario: str, shape: tuple[int]) -> float:
        return self.case.ms()

    track_ms.unit = "ms"
