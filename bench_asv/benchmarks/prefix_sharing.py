"""Benchmarks of GRPO group log-probs with the prompt computed once (``rlk.integrations.hf.group_logprobs``,
``rlk.prefix_attention`` in the patched attention) against the same G sequences packed without sharing.

Implementations (``impl``): ``prefix_shared`` (one row: the prompt's prefix once, then each response's segment
reading the prefix's keys) and ``packed`` (one row of the G ``prompt + response`` sequences, split by their position
ids: every response recomputes the prompt). Both on the same model: ``rlk.integrations.hf.apply`` (the fused
log-prob head) + ``rlk.patch_model`` (rlk's varlen attention and RMSNorm; cuBLAS matmuls, not the batch-invariant
mode, so the figure is the one a fast trainer sees). ``option``: ``fwd`` (no grad: rollout scoring) or ``fwd_bwd``
(the summed log-probs' backward: training). Shape ``(G, P, R, layers)``: G responses of R tokens to one prompt of P
tokens, a Qwen3-8B-shaped model (hidden 4096, 32 / 8 heads of 128, MLP 12288, V = 151936) with ``layers`` decoder
layers in bf16; quick mode (or no GPU): the tiny model in fp32 through the Triton interpreter.

Reported: ``track_ms`` (median ms per call) and, on CUDA, ``track_peak_extra_mib``; ``track_tokens_per_s``: the
G x R scored tokens per second (the same work for both impls).
"""

from __future__ import annotations

import torch

from .common import DEVICE, QUICK, SEED, CaseBase, _CaseSetup, _MemorySetup

IMPLS = ["prefix_shared", "packed"]
OPTIONS = ["fwd", "fwd_bwd"]
SHAPES = [(2, 6, 5, 2)] if QUICK else [(8, 1024, 1024, 4), (16, 1024, 1024, 4)]
MODEL = "tiny" if QUICK else "qwen3-8b-shape"
DTYPE = torch.float32 if QUICK else torch.bfloat16

_model = {}  # layers -> the applied and patched model, one at a time


def model(layers: int):
    if layers not in _model:
        import rlk
        from rlk.app.consistency import harness
        from rlk.integrations.hf import apply

        _model.clear()
        built = harness.build_model(MODEL, dtype=DTYPE, device=DEVICE, seed=SEED, num_layers=layers)
        rlk.patch_model(built)
        _model[layers] = apply(built)
    return _model[layers]


class PrefixSharingCase(CaseBase):
    """One group's log-probs, with or without the shared prefix."""

    def __init__(self, op: str, impl: str, option: str, shape: tuple[int, int, int, int]):
        from rlk.integrations.hf import group_batch

        if impl not in IMPLS:
            raise ValueError(f"unknown impl {impl!r}; expected one of {IMPLS}")
        if option not in OPTIONS:
            raise ValueError(f"unknown option {option!r}; expected one of {OPTIONS}")
        groups, prompt_len, response_len, layers = shape
        self.lm = model(layers)
        vocab = self.lm.config.vocab_size
        gen = torch.Generator().manual_seed(SEED)
        prompt = torch.randint(0, vocab, (prompt_len,), generator=gen).tolist()
        responses = torch.randint(0, vocab, (groups, response_len), generator=gen).tolist()
        self.prompts, self.responses = [prompt], [responses]
        self.impl, self.backward = impl, option == "fwd_bwd"
        if impl == "packed":
            ids = [prompt + r for r in responses]
            targets = [[-100] * (prompt_len - 1) + r + [-100] for r in responses]
            row = dict(dtype=torch.int64, device=DEVICE)
            self.ids = torch.tensor([sum(ids, [])], **row)
            self.targets = torch.tensor([sum(targets, [])], **row)
            self.positions = torch.arange(prompt_len + response_len, device=DEVICE).repeat(groups)[None]
        else:
            group_batch(self.prompts, self.responses)  # check the inputs once
        self.work, self.unit = groups * response_len, "tokens/s"
        self.step()

    def _logprobs(self) -> torch.Tensor:
        if self.impl == "packed":
            return self.lm(
                input_ids=self.ids, position_ids=self.positions, logprob_targets=self.targets, use_cache=False
            ).logprobs
        from rlk.integrations.hf import group_logprobs

        return torch.cat([lp for group in group_logprobs(self.lm, self.prompts, self.responses) for lp in group])

    def step(self) -> None:
        if self.backward:
            self.lm.zero_grad(set_to_none=True)
            self._logprobs().sum().backward()
        else:
            with torch.no_grad():
                self._logprobs()

    def rate(self) -> float:
        return self.work / (self.ms() * 1e-3)


class PrefixSharing(_CaseSetup):
    """Group log-probs, prompt computed once vs G times: ms and scored tokens per second."""

    op, case_type, shape_names = "prefix_sharing", PrefixSharingCase, "GPRL"
    baselines = ("packed",)
    param_names = ["impl", "option", "shape"]
    params = [IMPLS, OPTIONS, SHAPES]
    timeout = 1200

    def teardown(self, impl: str, option: str, shape: tuple[int, int, int, int]) -> None:
        _release(self)

    def track_ms(self, impl: str, option: str, shape: tuple[int, int, int, int]) -> float:
        return self.case.ms()

    track_ms.unit = "ms"

    def track_tokens_per_s(self, impl: str, option: str, shape: tuple[int, int, int, int]) -> float:
        return self.case.rate()

    track_tokens_per_s.unit = "tokens/s"


class PrefixSharingMemory(_MemorySetup):
    """Group log-probs: peak extra GPU memory in MiB (CUDA only)."""

    op, case_type, param_names, params = (
        "prefix_sharing",
        PrefixSharingCase,
        PrefixSharing.param_names,
        PrefixSharing.params,
    )
    timeout = 1200

    def teardown(self, impl: str, option: str, shape: tuple[int, int, int, int]) -> None:
        _release(self)


def _release(benchmark) -> None:
    case = getattr(benchmark, "case", None)
    if case is not None:
        case.lm.zero_grad(set_to_none=True)
        del benchmark.case
    if DEVICE.type == "cuda":
        torch.cuda.empty_cache()
